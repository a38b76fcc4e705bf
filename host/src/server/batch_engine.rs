//! The server's [`Generator`] over the continuous-batching engine (`crate::engine::Engine`): the model
//! is loaded with KV room for `--parallel` sequences, the scheduler batches every request into one
//! forward pass per step, and each request's events are relayed to the HTTP task that asked.

use std::sync::Arc;

use anyhow::Result;
use tokio::sync::mpsc;

use super::args::ServerConfig;
use super::generator::{EngineStats, EventStream, Generator, ModelFacts, SlotStats};
use super::state::LoadedModel;
use crate::engine::{
    Engine, EngineError, EngineHandle, EngineOptions, GenerationEvent, GenerationRequest, ModelRunner, SlotState,
};
use crate::text::TextTokenizer;

pub struct BatchEngine {
    handle: EngineHandle,
}

/// Starts the engine thread on a text model [`super::model::load`] loaded.
pub fn start(
    config: &ServerConfig,
    runner: ModelRunner,
    tokenizer: TextTokenizer,
    facts: ModelFacts,
) -> Result<LoadedModel> {
    let tokenizer = Arc::new(tokenizer);
    let options = EngineOptions {
        parallel: config.parallel.max(1),
        batch_size: config.batch_size,
        ubatch_size: config.ubatch_size,
        max_queue: config.queue_limit,
        prefix_cache: config.cache_prompt,
    };
    let handle = Engine::start(runner, tokenizer.clone(), options)?;
    Ok(LoadedModel { generator: Arc::new(BatchEngine { handle }), text: tokenizer, facts, encoder: None })
}

impl Drop for BatchEngine {
    fn drop(&mut self) {
        self.handle.shutdown();
    }
}

impl Generator for BatchEngine {
    fn refuse_waiting(&self) {
        self.handle.refuse_waiting();
    }

    fn cut_all(&self) {
        // Each request's stream gets its end: cut short where it had tokens, a 503 where it had none.
        self.handle.shutdown();
    }

    fn submit(&self, req: GenerationRequest) -> Result<EventStream, EngineError> {
        // A sampler that reads tokens' texts (infill, DRY) may build a table over the vocabulary
        // first (milliseconds).
        let mut stream = match req.sampling.reads_token_texts() {
            true => super::blocking(|| self.handle.submit(req))?,
            false => self.handle.submit(req)?,
        };
        let (tx, rx) = mpsc::channel(64);
        // Relay until the request ends or the HTTP side lets go of its receiver; either way `stream`
        // is dropped here, which cancels the request (its pages are freed within one step).
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    event = stream.next() => match event {
                        Some(ev) => {
                            let last = matches!(ev, GenerationEvent::Done { .. } | GenerationEvent::Error(_));
                            if tx.send(ev).await.is_err() || last {
                                break;
                            }
                        }
                        None => {
                            let _ = tx
                                .send(GenerationEvent::Error(EngineError::Internal("the engine stopped".into())))
                                .await;
                            break;
                        }
                    },
                    _ = tx.closed() => break,
                }
            }
        });
        Ok(rx)
    }

    fn stats(&self) -> EngineStats {
        let s = self.handle.stats();
        let slots: Vec<SlotStats> = s
            .slots
            .iter()
            .map(|slot| SlotStats {
                id: slot.id,
                is_processing: slot.state != SlotState::Idle,
                n_prompt_tokens: slot.prompt_tokens,
                n_decoded: slot.generated_tokens,
                id_task: slot.request,
                params: slot.sampling.clone(),
                n_remain: slot.remaining_tokens,
            })
            .collect();
        EngineStats {
            requests_processing: slots.iter().filter(|s| s.is_processing).count(),
            requests_deferred: s.queued,
            n_decode_total: s.counters.steps,
            n_busy_slots_total: s.counters.sequence_steps,
            requests_cancelled: s.counters.requests_cancelled,
            kv_blocks_used: s.kv_pages_used,
            kv_blocks_total: s.kv_pages_total,
            kv_block_size: s.kv_page_tokens,
            slots,
        }
    }
}
