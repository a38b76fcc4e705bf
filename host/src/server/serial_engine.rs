//! A [`Generator`] over the single-sequence [`Session`]: one thread owns the runner and answers queued
//! requests one at a time, reusing the KV of the prefix the previous request left. It serves real
//! models today and is replaced by the continuous-batching scheduler; nothing else in the server
//! depends on it.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result};
use tokio::sync::mpsc;

use super::args::ServerConfig;
use super::generator::{EngineStats, EventStream, Generator, ModelFacts, SlotStats};
use crate::engine::{EngineError, GenerateOptions, GenerationEvent, GenerationRequest, ModelRunner, Session, Usage};
use crate::text::TextTokenizer;

struct Queued {
    req: GenerationRequest,
    events: mpsc::Sender<GenerationEvent>,
    queued_at: Instant,
}

#[derive(Default)]
struct Shared {
    deferred: AtomicUsize,
    n_decode: AtomicU64,
    kv_used: AtomicUsize,
    slot: Mutex<SlotStats>,
}

pub struct SerialEngine {
    jobs: std_mpsc::SyncSender<Queued>,
    shared: Arc<Shared>,
    ctx_size: usize,
    kv_blocks_total: usize,
    kv_block_size: usize,
}

/// Loads the model on a new engine thread and returns the engine with the model's tokenizer and facts.
pub fn start(config: &ServerConfig) -> Result<(SerialEngine, Arc<TextTokenizer>, ModelFacts)> {
    let (ready_tx, ready_rx) = std_mpsc::channel();
    let (jobs, job_rx) = std_mpsc::sync_channel::<Queued>(config.queue_limit);
    let shared = Arc::new(Shared::default());
    let cfg = config.clone();
    let sh = shared.clone();
    std::thread::Builder::new()
        .name("mlxcel-engine".into())
        .spawn(move || {
            let (mut runner, tok, facts) = match super::model::load(&cfg, 1) {
                Ok(l) => l,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let tok = Arc::new(tok);
            let pool = (runner.pool.num_blocks, runner.pool.block_size);
            let _ = ready_tx.send(Ok((tok.clone(), facts, pool)));
            let mut session = Session::new();
            while let Ok(job) = job_rx.recv() {
                sh.deferred.fetch_sub(1, Ordering::Relaxed);
                run_one(&mut runner, &tok, &mut session, job, &cfg, &sh);
            }
        })
        .context("cannot start the engine thread")?;
    let (tok, facts, (kv_blocks_total, kv_block_size)) =
        ready_rx.recv().context("the engine thread ended while loading")??;
    let engine = SerialEngine { jobs, shared, ctx_size: facts.ctx_size, kv_blocks_total, kv_block_size };
    Ok((engine, tok, facts))
}

fn run_one(
    runner: &mut ModelRunner,
    tok: &TextTokenizer,
    session: &mut Session,
    job: Queued,
    cfg: &ServerConfig,
    sh: &Shared,
) {
    let Queued { req, events, queued_at } = job;
    if events.is_closed() {
        return; // the client left while the request waited
    }
    let queue_time = queued_at.elapsed();
    if !req.cache_prompt {
        session.clear(runner);
    }
    *sh.slot.lock().unwrap() =
        SlotStats { id: 0, is_processing: true, n_prompt_tokens: req.prompt.len(), n_decoded: 0 };
    let opts = GenerateOptions {
        sampling: req.sampling.clone(),
        max_tokens: req.max_tokens,
        stop: req.stop.clone(),
        ignore_eos: req.ignore_eos,
        prefill_chunk: cfg.ubatch_size,
    };
    let deadline = req.timeout.map(|t| queued_at + t);
    let cancel = AtomicBool::new(false);
    let result = session.generate(runner, tok, &req.prompt, &opts, &cancel, &mut |s| {
        if let Ok(mut slot) = sh.slot.lock() {
            slot.n_decoded += 1;
        }
        let gone =
            events.blocking_send(GenerationEvent::Text { text: s.to_string(), tokens: vec![], logprobs: vec![] });
        if gone.is_err() || deadline.is_some_and(|d| Instant::now() >= d) {
            cancel.store(true, Ordering::Relaxed);
        }
    });
    let chunks = req.prompt.len().div_ceil(cfg.ubatch_size.max(1)) as u64;
    match result {
        Ok(g) => {
            sh.n_decode.fetch_add(chunks + g.stats.generated_tokens as u64, Ordering::Relaxed);
            // The token ids arrive once, at the end (the session streams text only).
            let _ =
                events.blocking_send(GenerationEvent::Text { text: String::new(), tokens: g.tokens, logprobs: vec![] });
            let usage = Usage {
                prompt_tokens: req.prompt.len(),
                cached_tokens: g.stats.prompt_reused,
                completion_tokens: g.stats.generated_tokens,
                prompt_time: g.stats.prompt_time,
                generation_time: g.stats.generation_time,
                queue_time,
            };
            let _ = events.blocking_send(GenerationEvent::Done { finish: g.finish, usage });
        }
        Err(e) => {
            session.clear(runner);
            let _ = events.blocking_send(GenerationEvent::Error(EngineError::Internal(format!("{e:#}"))));
        }
    }
    let used = runner.pool.num_blocks - runner.pool.free_blocks();
    sh.kv_used.store(used, Ordering::Relaxed);
    *sh.slot.lock().unwrap() = SlotStats::default();
}

impl Generator for SerialEngine {
    fn submit(&self, req: GenerationRequest) -> Result<EventStream, EngineError> {
        if req.prompt.len() >= self.ctx_size {
            return Err(EngineError::PromptTooLong { prompt_tokens: req.prompt.len(), ctx_size: self.ctx_size });
        }
        if req.logprobs.is_some() {
            return Err(EngineError::Invalid(
                "logprobs are not available from the single-sequence engine this server runs".into(),
            ));
        }
        let (tx, rx) = mpsc::channel(256);
        self.shared.deferred.fetch_add(1, Ordering::Relaxed);
        match self.jobs.try_send(Queued { req, events: tx, queued_at: Instant::now() }) {
            Ok(()) => Ok(rx),
            Err(e) => {
                self.shared.deferred.fetch_sub(1, Ordering::Relaxed);
                Err(match e {
                    std_mpsc::TrySendError::Full(_) => {
                        EngineError::QueueFull { queued: self.shared.deferred.load(Ordering::Relaxed) }
                    }
                    std_mpsc::TrySendError::Disconnected(_) => EngineError::ShuttingDown,
                })
            }
        }
    }

    fn stats(&self) -> EngineStats {
        let slot = self.shared.slot.lock().map(|s| s.clone()).unwrap_or_default();
        EngineStats {
            requests_processing: usize::from(slot.is_processing),
            requests_deferred: self.shared.deferred.load(Ordering::Relaxed),
            n_decode_total: self.shared.n_decode.load(Ordering::Relaxed),
            n_busy_slots_total: self.shared.n_decode.load(Ordering::Relaxed),
            kv_blocks_used: self.shared.kv_used.load(Ordering::Relaxed),
            kv_blocks_total: self.kv_blocks_total,
            kv_block_size: self.kv_block_size,
            slots: vec![SlotStats { id: 0, ..slot }],
        }
    }
}
