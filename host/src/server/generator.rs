//! What the HTTP layer needs from an engine, as one small trait: submit a tokenized request and get its
//! events back, and read a snapshot of the engine's state for `/slots`, `/metrics` and `/props`.
//! The server never touches a runner; anything that implements [`Generator`] can serve (the
//! one-request-at-a-time adapter in `serial_engine.rs` today, the batching scheduler next, a scripted
//! fake in the tests).

use serde::Serialize;
use tokio::sync::mpsc;

use crate::engine::{EngineError, GenerationEvent, GenerationRequest, SamplingParams};

/// The events of one request: any number of `Text`, then one `Done` or one `Error`. Dropping the
/// receiver cancels the request.
pub type EventStream = mpsc::Receiver<GenerationEvent>;

pub trait Generator: Send + Sync + 'static {
    /// Queues `req`. Refusals that need no work (queue full, prompt too long, shutting down) come back
    /// at once; failures during the run arrive as [`GenerationEvent::Error`].
    fn submit(&self, req: GenerationRequest) -> Result<EventStream, EngineError>;

    /// A snapshot of the engine's state now.
    fn stats(&self) -> EngineStats;

    /// Takes no more requests and fails those waiting for a slot as shutting down (503), while the
    /// running ones go on: a shutdown's first step.
    fn refuse_waiting(&self) {}

    /// Ends every request in flight or waiting and takes no more (a shutdown past its grace period):
    /// cut short where it has an answer under way, failed as shutting down where it has none; blocks
    /// until the engine has stopped.
    fn cut_all(&self) {}
}

/// One sequence slot as `/slots` shows it.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct SlotStats {
    pub id: usize,
    pub is_processing: bool,
    /// Prompt tokens of the request in the slot (0 when idle).
    pub n_prompt_tokens: usize,
    /// Tokens generated so far for that request.
    pub n_decoded: usize,
    /// The engine's id of the request in the slot.
    pub id_task: Option<u64>,
    /// Its sampling, and the tokens it may still generate.
    #[serde(skip)]
    pub params: Option<crate::engine::SamplingParams>,
    pub n_remain: usize,
}

/// The engine's state; counters are totals since start.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct EngineStats {
    /// Requests being computed now.
    pub requests_processing: usize,
    /// Requests waiting in the queue.
    pub requests_deferred: usize,
    /// Forward passes run.
    pub n_decode_total: u64,
    /// Sum over forward passes of the sequences in each (busy slots per decode = this / n_decode_total).
    pub n_busy_slots_total: u64,
    /// Requests stopped before their end: the client left, the timeout, shutdown.
    pub requests_cancelled: u64,
    pub kv_blocks_used: usize,
    pub kv_blocks_total: usize,
    /// Tokens per KV block.
    pub kv_block_size: usize,
    pub slots: Vec<SlotStats>,
}

impl EngineStats {
    pub fn kv_usage_ratio(&self) -> f64 {
        if self.kv_blocks_total == 0 {
            0.0
        } else {
            self.kv_blocks_used as f64 / self.kv_blocks_total as f64
        }
    }
}

/// Facts about the served model that the routes report (`/v1/models`, `/props`) or check against
/// (the context size).
#[derive(Debug, Clone)]
pub struct ModelFacts {
    /// The id clients see: `--alias`, else the MODEL argument as given.
    pub id: String,
    /// The folder the weights came from.
    pub path: String,
    pub architecture: String,
    pub family: String,
    pub backend: String,
    /// Longest context one sequence may reach, in tokens.
    pub ctx_size: usize,
    /// The model's own maximum (`max_position_embeddings`).
    pub ctx_train: usize,
    pub vocab_size: usize,
    pub weight_bytes: u64,
    /// KV bytes one token of context costs (all layers, K and V).
    pub kv_bytes_per_token: usize,
    /// The chat template source in use (None: the model has none).
    pub chat_template: Option<String>,
    /// Sampling settings a request starts from (model's generation_config.json, then the flags).
    pub default_sampling: SamplingParams,
}
