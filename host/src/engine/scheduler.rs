//! Continuous batching: every step puts all active sequences into one forward pass — running decodes
//! first, then chunks of prompts still being prefilled — up to `parallel` sequences and a token budget
//! per step. Requests beyond `parallel` wait in a bounded queue.
//!
//! KV pages are taken page by page as a sequence grows and given back when it ends (see
//! [`kv_cache`](super::kv_cache)); full pages go to the [`PrefixCache`] so a later prompt with the same
//! start skips recomputing them. When pages run out, unused cached pages are evicted first; then the
//! newest sequence is preempted: its pages are let go and it goes back to the front of the queue with its
//! generated tokens appended to what it must recompute, so its output continues exactly where it was.
//!
//! [`Scheduler`] is synchronous and single-threaded (tests drive it step by step);
//! [`Engine`](super::handle::Engine) runs it on its own thread behind channels.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedSender;

use super::generate::FinishReason;
use super::kv_cache::{KvCache, SeqBlocks};
use super::memory::scoring_chunk;
use super::prefix_cache::{PrefixCache, ROOT};
use super::request::{EngineError, GenerationEvent, GenerationRequest, TokenLogprob, Usage};
use super::runner::{Logits, ModelRunner, RowsWanted, SeqChunk, StepRows};
use super::sampling::VocabTables;
use super::sampling::{Sampler, SamplingParams};
use super::streaming_text::StreamingText;
use super::thought::Thought;
use crate::text::grammar::Constraint;
use crate::text::TextTokenizer;

/// What the scheduler needs of a model: one batched forward pass and the KV pages it reads.
/// [`ModelRunner`] is the real one; tests use a model that checks what each page holds.
pub trait StepModel {
    /// Starts one step over `chunks` (the device may run it while the host goes on); `want` says what
    /// [`StepModel::wait`] brings back of each requested logits row.
    fn submit(&mut self, chunks: &[SeqChunk], want: RowsWanted) -> anyhow::Result<()>;
    /// The requested logits rows of the step [`StepModel::submit`] started, in chunk order.
    fn wait(&mut self) -> anyhow::Result<StepRows>;
    fn vocab_size(&self) -> usize;
    /// Longest context one sequence may reach.
    fn ctx_size(&self) -> usize;
    /// The model's KV pages (all groups; the figures it reports are group 0's).
    fn kv_cache(&self) -> &KvCache;
    /// KV bytes per token of context (all layers), for reporting the budget.
    fn kv_bytes_per_token(&self) -> usize;
    /// Whether one sequence may reuse another's KV pages for a shared prefix. Not for models with
    /// state outside the pages (recurrent layers) or pages freed outside a window (sliding window).
    fn prefix_reuse_safe(&self) -> bool;
    /// Whether [`StepModel::copy_page`] can copy (the backend has `copy_blocks`).
    fn copies_pages(&self) -> bool {
        false
    }
    /// Copies KV page `src` into page `dst` in every layer (no step in flight).
    fn copy_page(&mut self, src: u32, dst: u32) -> anyhow::Result<()> {
        let _ = (src, dst);
        anyhow::bail!("this model cannot copy KV pages")
    }
    /// Moves on whenever the model lost its cached state (its backend was rebuilt after a plugin panic):
    /// every sequence's KV must then be computed again.
    fn state_epoch(&self) -> u64 {
        0
    }
}

impl StepModel for ModelRunner {
    fn submit(&mut self, chunks: &[SeqChunk], want: RowsWanted) -> anyhow::Result<()> {
        ModelRunner::submit(self, chunks, want)
    }
    fn wait(&mut self) -> anyhow::Result<StepRows> {
        ModelRunner::wait(self)
    }
    fn vocab_size(&self) -> usize {
        self.info.vocab_size
    }
    fn ctx_size(&self) -> usize {
        self.ctx_size
    }
    fn kv_cache(&self) -> &KvCache {
        &self.pool
    }
    fn kv_bytes_per_token(&self) -> usize {
        ModelRunner::kv_bytes_per_token(self)
    }
    fn prefix_reuse_safe(&self) -> bool {
        self.pool.prefix_reusable()
    }
    fn copies_pages(&self) -> bool {
        ModelRunner::copies_pages(self)
    }
    fn copy_page(&mut self, src: u32, dst: u32) -> anyhow::Result<()> {
        ModelRunner::copy_page(self, src, dst)
    }
    fn state_epoch(&self) -> u64 {
        self.state_epoch
    }
}

/// How the engine schedules.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Sequences in flight together (`-np/--parallel`).
    pub parallel: usize,
    /// Most tokens scheduled in one step (`-b/--batch-size`).
    pub batch_size: usize,
    /// Most tokens one forward pass computes (`-ub/--ubatch-size`). A step is one forward pass, so its
    /// budget is the smaller of the two (and never less than `parallel`, so every decode fits).
    pub ubatch_size: usize,
    /// Requests that may wait for a slot; one more is refused with [`EngineError::QueueFull`].
    pub max_queue: usize,
    /// Keep full KV pages for later requests with the same prefix (`--cache-prompt`); a request can
    /// still opt out with `cache_prompt: false`.
    pub prefix_cache: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions { parallel: 4, batch_size: 2048, ubatch_size: 512, max_queue: 128, prefix_cache: true }
    }
}

impl EngineOptions {
    /// Tokens one step may compute.
    pub fn step_tokens(&self) -> usize {
        self.batch_size.min(self.ubatch_size).max(self.parallel).max(1)
    }
}

/// What a slot is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    Idle,
    /// Computing its prompt (or recomputing after preemption).
    Prefill,
    Generating,
}

impl SlotState {
    pub fn name(self) -> &'static str {
        match self {
            SlotState::Idle => "idle",
            SlotState::Prefill => "prefill",
            SlotState::Generating => "generating",
        }
    }
}

/// One slot of `parallel`, as `/slots` shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct SlotStats {
    pub id: usize,
    pub state: SlotState,
    /// The request in the slot.
    pub request: Option<u64>,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub generated_tokens: usize,
    /// Positions whose KV the sequence holds.
    pub kv_tokens: usize,
    /// The request's sampling, and the tokens it may still generate.
    pub sampling: Option<SamplingParams>,
    pub remaining_tokens: usize,
}

/// Totals since the engine started, as `/metrics` shows them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineCounters {
    /// Requests accepted into the queue.
    pub requests: u64,
    pub requests_finished: u64,
    pub requests_cancelled: u64,
    pub requests_failed: u64,
    /// Prompt tokens computed (tokens served from the prefix cache are not).
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    /// Prompt tokens served from the prefix cache.
    pub cache_hit_tokens: u64,
    pub preemptions: u64,
    /// Forward passes run.
    pub steps: u64,
    /// Sequences computed, summed over forward passes (÷ `steps` = sequences per pass).
    pub sequence_steps: u64,
    /// Time from admission to first token, summed over requests.
    pub prompt_seconds: f64,
    /// Time from first to last token, summed over requests.
    pub generation_seconds: f64,
}

/// A snapshot of the engine for `/slots`, `/metrics` and `/props`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    pub slots: Vec<SlotStats>,
    /// Requests waiting for a slot (preempted ones included).
    pub queued: usize,
    pub ctx_size: usize,
    pub parallel: usize,
    pub kv_page_tokens: usize,
    pub kv_pages_total: usize,
    /// Pages held by sequences or the prefix cache.
    pub kv_pages_used: usize,
    /// Pages the prefix cache holds (some may also be in use by sequences).
    pub kv_pages_cached: usize,
    pub kv_bytes_per_token: usize,
    pub counters: EngineCounters,
}

impl EngineStats {
    /// Slots with a sequence in them.
    pub fn busy_slots(&self) -> usize {
        self.slots.iter().filter(|s| s.state != SlotState::Idle).count()
    }
}

/// The limits a request is checked against before it is queued.
#[derive(Debug, Clone, Copy)]
pub struct RequestLimits {
    pub vocab_size: usize,
    pub ctx_size: usize,
    /// Positions the whole KV pool holds.
    pub kv_tokens: usize,
}

impl RequestLimits {
    pub fn of(model: &dyn StepModel) -> Self {
        let pool = model.kv_cache();
        RequestLimits {
            vocab_size: model.vocab_size(),
            ctx_size: model.ctx_size(),
            kv_tokens: pool.num_blocks * pool.block_size,
        }
    }

    /// Refuses what could never run: an empty or too long prompt, an unknown token, bad sampling.
    pub fn check(&self, req: &GenerationRequest) -> Result<(), EngineError> {
        if req.prompt.is_empty() {
            return Err(EngineError::Invalid("the prompt is empty".into()));
        }
        if let Some(&t) = req.prompt.iter().find(|&&t| t as usize >= self.vocab_size) {
            return Err(EngineError::Invalid(format!(
                "token id {t} is outside the vocabulary ({} tokens)",
                self.vocab_size
            )));
        }
        req.sampling.validate().map_err(EngineError::Invalid)?;
        // The prompt and the first generated token must fit the context and the whole KV pool.
        let limit = self.ctx_size.min(self.kv_tokens);
        if req.prompt.len() >= limit {
            return Err(EngineError::PromptTooLong { prompt_tokens: req.prompt.len(), ctx_size: limit });
        }
        Ok(())
    }
}

/// Counts the scheduler shares with submitters, so a full queue is refused without a round trip to
/// the engine thread.
#[derive(Debug, Default)]
pub struct QueueCounts {
    /// Requests submitted and never admitted yet (including those still in the channel).
    waiting: AtomicUsize,
    /// Sequences in slots.
    running: AtomicUsize,
}

impl QueueCounts {
    /// Requests submitted and not admitted yet.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    /// Counts a new request in, unless it would wait behind `max_queue` others for a slot.
    pub fn try_enter(&self, parallel: usize, max_queue: usize) -> Result<(), EngineError> {
        let free_slots = parallel.saturating_sub(self.running.load(Ordering::SeqCst));
        let queued = self.waiting.fetch_add(1, Ordering::SeqCst);
        if queued >= max_queue.saturating_add(free_slots) {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(EngineError::QueueFull { queued });
        }
        Ok(())
    }

    /// Takes back a request counted in but never delivered.
    pub fn leave(&self) {
        self.waiting.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A request as the engine receives it, with where its events go.
pub struct Submission {
    pub id: u64,
    pub request: GenerationRequest,
    pub events: UnboundedSender<GenerationEvent>,
    /// Set by the requester to stop the request (it ends with `Cancelled`).
    pub cancel: Arc<AtomicBool>,
    pub submitted: Instant,
    /// The request's sampler, made by the submitter (with the vocabulary tables it reads, built off
    /// this thread: [`Scheduler::vocab_tables`]); None: the scheduler makes it.
    pub sampler: Option<Sampler>,
}

/// One request in flight or waiting.
struct Sequence {
    id: u64,
    /// Prompt, then every generated token. All but the last are what the KV must hold before the
    /// next token can be sampled.
    tokens: Vec<u32>,
    prompt_len: usize,
    kv: SeqBlocks,
    /// Pages of `kv` offered to the prefix cache, and the key of the last one.
    offered_pages: usize,
    offered_key: u64,
    cache_prompt: bool,
    logprobs: Option<usize>,
    /// The prompt's scores, where the request asked for them.
    scores: Option<PromptScores>,
    sampler: Sampler,
    text: StreamingText,
    events: UnboundedSender<GenerationEvent>,
    cancel: Arc<AtomicBool>,
    deadline: Option<Instant>,
    submitted: Instant,
    admitted: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    /// Prompt tokens the first admission found in the prefix cache.
    cached_tokens: usize,
    slot: Option<usize>,
    /// The slot it must run in, if it asked for one.
    pinned: Option<usize>,
    thought: Option<Thought>,
    /// The grammar its tokens must follow, if any (whole rows are then sampled, masked by it).
    constraint: Option<Constraint>,
}

/// A scored prompt's log-probabilities so far: kept across a preemption (what was scored is not
/// scored again), sent once every prompt token after the first has its score.
struct PromptScores {
    /// Alternatives per token.
    top: usize,
    /// Of prompt tokens `1..`, in order.
    scores: Vec<TokenLogprob>,
    sent: bool,
}

impl PromptScores {
    /// The prompt position whose logits row scores the next token still to score.
    fn next_row(&self) -> usize {
        self.scores.len()
    }
}

impl Sequence {
    /// Whether the chunk of `n` tokens from the KV's end computes a logits row that scores a prompt
    /// token (the row of position `p` scores token `p + 1`).
    fn scores_in(&self, n: usize) -> bool {
        self.scores.as_ref().is_some_and(|sc| {
            let (first, end) = (self.kv.len, self.kv.len + n);
            !sc.sent && end > sc.next_row() && first + 1 < self.prompt_len
        })
    }

    /// Whether its prompt still has tokens to score (its chunks then bring back a logits row each,
    /// which a step holds to [`SCORING_ROWS_BYTES`](super::memory::SCORING_ROWS_BYTES)).
    fn scoring(&self) -> bool {
        self.scores.as_ref().is_some_and(|sc| !sc.sent)
    }

    /// The grammar that holds the next token: none while a thought goes on (the answer's grammar
    /// holds what follows the thought, as a thought is free text).
    fn held(&mut self) -> Option<&mut Constraint> {
        match self.thought.as_ref().is_some_and(Thought::inside) {
            true => None,
            false => self.constraint.as_mut(),
        }
    }

    /// Tokens still to feed before the next token can be sampled (1 while decoding).
    fn pending(&self) -> usize {
        self.tokens.len() - self.kv.len
    }

    fn cancelled(&self, now: Instant) -> bool {
        self.cancel.load(Ordering::Relaxed) || self.events.is_closed() || self.deadline.is_some_and(|d| now >= d)
    }

    fn send(&self, event: GenerationEvent) {
        // A closed receiver is noticed at the next step and cancels the sequence.
        let _ = self.events.send(event);
    }

    fn usage(&self) -> Usage {
        let since = |a: Option<Instant>, b: Option<Instant>| match (a, b) {
            (Some(a), Some(b)) => b.saturating_duration_since(a),
            _ => Duration::ZERO,
        };
        Usage {
            prompt_tokens: self.prompt_len,
            cached_tokens: self.cached_tokens,
            completion_tokens: self.text.generated(),
            prompt_time: since(self.admitted, self.first_token),
            generation_time: since(self.first_token, self.last_token),
            queue_time: since(Some(self.submitted), self.admitted),
        }
    }
}

/// How one sequence ends.
enum Outcome {
    Finished(FinishReason),
    Failed(EngineError),
}

/// The batching scheduler over a model. Not thread-safe; see [`Engine`](super::handle::Engine).
pub struct Scheduler<M: StepModel> {
    model: M,
    tokenizer: Arc<TextTokenizer>,
    opts: EngineOptions,
    cache: PrefixCache,
    reuse_prefixes: bool,
    /// Waiting, in order; preempted sequences go back to the front.
    waiting: VecDeque<Sequence>,
    /// Admitted, oldest request first (the newest is the one preempted).
    running: Vec<Sequence>,
    free_slots: Vec<usize>,
    /// What the queue limit counts, shared with the submitters.
    counts: Arc<QueueCounts>,
    counters: EngineCounters,
    /// The model's state epoch the running sequences' KV belongs to.
    epoch: u64,
    /// What the infill sampler and DRY read over the vocabulary, shared with the engine's handle,
    /// which builds it before a request arrives here.
    vocab: Arc<VocabTables>,
    /// Held ends (`Done`, `Error`) of the requests finished since the last [`Self::send_ends`],
    /// where the engine thread holds them until its stats are published (None: sent at once).
    held_ends: Option<Vec<(UnboundedSender<GenerationEvent>, GenerationEvent)>>,
}

impl<M: StepModel> Scheduler<M> {
    pub fn new(model: M, tokenizer: Arc<TextTokenizer>, opts: EngineOptions) -> Self {
        let parallel = opts.parallel.max(1);
        let opts = EngineOptions { parallel, ..opts };
        let reuse_prefixes = opts.prefix_cache && model.prefix_reuse_safe();
        if opts.prefix_cache && !reuse_prefixes {
            match model.kv_cache().has_windows() {
                true => tracing::info!(
                    "prefix cache off: this model's sliding-window layers let go of the pages behind their window (--swa-full keeps them, in more memory)"
                ),
                false => tracing::info!("prefix cache off: this model keeps state outside its KV pages"),
            }
        }
        Scheduler {
            cache: PrefixCache::new(model.kv_cache().block_size),
            model,
            vocab: Arc::new(VocabTables::new(tokenizer.clone())),
            tokenizer,
            opts,
            reuse_prefixes,
            waiting: VecDeque::new(),
            running: Vec::new(),
            free_slots: (0..parallel).rev().collect(),
            counts: Arc::default(),
            counters: EngineCounters::default(),
            epoch: 0,
            held_ends: None,
        }
    }

    /// Holds each finished request's last event until [`Self::send_ends`], so that the engine thread
    /// publishes stats (`/slots`, `/metrics`) without the request before its client hears it ended.
    pub fn hold_ends(&mut self) {
        self.held_ends.get_or_insert_with(Vec::new);
    }

    /// Sends the held last events.
    pub fn send_ends(&mut self) {
        for (events, end) in self.held_ends.iter_mut().flat_map(std::mem::take) {
            let _ = events.send(end);
        }
    }

    /// A finished request's last event, held or sent (see the `Drop` impl for a panic between).
    fn end(&mut self, seq: &Sequence, end: GenerationEvent) {
        match &mut self.held_ends {
            Some(held) => held.push((seq.events.clone(), end)),
            None => seq.send(end),
        }
    }

    pub fn model(&self) -> &M {
        &self.model
    }

    pub fn options(&self) -> &EngineOptions {
        &self.opts
    }

    pub fn limits(&self) -> RequestLimits {
        RequestLimits::of(&self.model)
    }

    /// The vocabulary tables samplers read, for submitters to make samplers with.
    pub fn vocab_tables(&self) -> Arc<VocabTables> {
        self.vocab.clone()
    }

    /// The counts the queue limit is checked against, shared with submitters.
    pub fn queue_counts(&self) -> Arc<QueueCounts> {
        self.counts.clone()
    }

    /// No request is running or waiting.
    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    /// Checks and queues a request. The queue holds `max_queue` requests beyond the free slots.
    pub fn submit(&mut self, sub: Submission) -> Result<(), EngineError> {
        self.limits().check(&sub.request)?;
        self.counts.try_enter(self.opts.parallel, self.opts.max_queue)?;
        self.enqueue(sub);
        Ok(())
    }

    /// Queues a request already checked and counted in by [`QueueCounts::try_enter`] (by [`EngineHandle`]).
    ///
    /// [`EngineHandle`]: super::handle::EngineHandle
    pub fn enqueue(&mut self, sub: Submission) {
        let r = sub.request;
        self.counters.requests += 1;
        let sampler =
            sub.sampler.unwrap_or_else(|| self.vocab.sampler(r.sampling.clone(), &r.end_tokens, r.ignore_eos));
        self.waiting.push_back(Sequence {
            id: sub.id,
            prompt_len: r.prompt.len(),
            tokens: r.prompt,
            kv: SeqBlocks::new(),
            offered_pages: 0,
            offered_key: ROOT,
            cache_prompt: r.cache_prompt,
            logprobs: r.logprobs.map(|n| n.min(self.model.vocab_size())),
            scores: r.prompt_logprobs.map(|n| PromptScores {
                top: n.min(self.model.vocab_size()),
                scores: Vec::new(),
                sent: false,
            }),
            sampler,
            text: StreamingText::new(&r.stop, r.ignore_eos, r.max_tokens)
                .showing(r.shown_special)
                .ending_at(r.end_tokens)
                .limited(r.code_limits),
            events: sub.events,
            cancel: sub.cancel,
            // A timeout too long to represent is no timeout.
            deadline: r.timeout.and_then(|t| sub.submitted.checked_add(t)),
            submitted: sub.submitted,
            admitted: None,
            first_token: None,
            last_token: None,
            cached_tokens: 0,
            slot: None,
            pinned: r.slot.map(|s| s % self.opts.parallel.max(1)),
            thought: r.thought_budget.map(Thought::new),
            constraint: r.constraint,
        });
    }

    /// One scheduling step: drop cancelled requests, admit waiting ones, run one forward pass over
    /// every running sequence that has room, sample, stream. Returns whether a forward pass ran.
    pub fn step(&mut self) -> bool {
        self.admit_waiting();
        let plan = self.plan();
        let ran = !plan.is_empty();
        if ran {
            let outcomes = self.run(&plan);
            self.counters.steps += 1;
            self.counters.sequence_steps += plan.len() as u64;
            for (i, outcome) in outcomes.into_iter().rev() {
                let seq = self.running.remove(i);
                self.finish(seq, outcome);
            }
        }
        self.counts.running.store(self.running.len(), Ordering::SeqCst);
        ran
    }

    /// What a step does first: drops cancelled requests and admits waiting ones. True where that
    /// changed which requests run or wait (the engine thread then publishes its stats before the
    /// step, so that `/slots` shows a request during its first prefill chunk).
    pub fn admit_waiting(&mut self) -> bool {
        let before = (self.running.len(), self.waiting.len());
        self.drop_cancelled();
        self.admit();
        self.counts.running.store(self.running.len(), Ordering::SeqCst);
        (self.running.len(), self.waiting.len()) != before
    }

    /// Ends every request (shutdown): one that has sampled tokens ends `Cancelled` (its client has
    /// part of an answer); one that has not fails with `ShuttingDown` (a 503, not an empty answer).
    pub fn cancel_all(&mut self) {
        let all: Vec<Sequence> = self.running.drain(..).chain(self.waiting.drain(..)).collect();
        for seq in all {
            let outcome = if seq.first_token.is_some() {
                Outcome::Finished(FinishReason::Cancelled)
            } else {
                Outcome::Failed(EngineError::ShuttingDown)
            };
            self.finish(seq, outcome);
        }
        self.counts.running.store(0, Ordering::SeqCst);
    }

    /// Fails every waiting request that has not started its answer with `ShuttingDown` (a shutdown's
    /// first step: one preempted part way through its answer stays, to finish with the running ones).
    pub fn refuse_waiting(&mut self) {
        let (started, refused): (VecDeque<Sequence>, VecDeque<Sequence>) =
            self.waiting.drain(..).partition(|s| s.first_token.is_some());
        self.waiting = started;
        for seq in refused {
            self.finish(seq, Outcome::Failed(EngineError::ShuttingDown));
        }
    }

    /// Drops every cached page no sequence holds.
    pub fn clear_prefix_cache(&mut self) {
        self.cache.clear_unused();
    }

    pub fn stats(&self) -> EngineStats {
        let pool = self.model.kv_cache();
        let mut slots: Vec<SlotStats> = (0..self.opts.parallel)
            .map(|id| SlotStats {
                id,
                state: SlotState::Idle,
                request: None,
                prompt_tokens: 0,
                cached_tokens: 0,
                generated_tokens: 0,
                kv_tokens: 0,
                sampling: None,
                remaining_tokens: 0,
            })
            .collect();
        for s in &self.running {
            let Some(slot) = s.slot else { continue };
            slots[slot] = SlotStats {
                id: slot,
                state: if s.first_token.is_some() && s.pending() <= 1 {
                    SlotState::Generating
                } else {
                    SlotState::Prefill
                },
                request: Some(s.id),
                prompt_tokens: s.prompt_len,
                cached_tokens: s.cached_tokens,
                generated_tokens: s.text.generated(),
                kv_tokens: s.kv.len,
                sampling: Some(s.sampler.params().clone()),
                remaining_tokens: s.text.remaining(),
            };
        }
        EngineStats {
            slots,
            queued: self.waiting.len(),
            ctx_size: self.model.ctx_size(),
            parallel: self.opts.parallel,
            kv_page_tokens: pool.block_size,
            kv_pages_total: pool.num_blocks,
            kv_pages_used: pool.num_blocks - pool.free_blocks(),
            kv_pages_cached: self.cache.len(),
            kv_bytes_per_token: self.model.kv_bytes_per_token(),
            counters: self.counters.clone(),
        }
    }

    fn drop_cancelled(&mut self) {
        let now = Instant::now();
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].cancelled(now) {
                let seq = self.running.remove(i);
                self.finish(seq, Outcome::Finished(FinishReason::Cancelled));
            } else {
                i += 1;
            }
        }
        let (gone, kept): (Vec<Sequence>, Vec<Sequence>) = self.waiting.drain(..).partition(|s| s.cancelled(now));
        self.waiting = kept.into();
        for seq in gone {
            self.finish(seq, Outcome::Finished(FinishReason::Cancelled));
        }
    }

    /// Moves waiting requests into free slots, first come first served, while the KV pool can take
    /// their prompts (counting pages found in the prefix cache and cached pages it could evict). A
    /// request whose prompt pages a running sequence is still computing is passed over, keeping its
    /// place and a slot, until they are cached.
    fn admit(&mut self) {
        let bs = self.model.kv_cache().block_size;
        // Pages the running prompts still need (their prefills take them chunk by chunk), and then
        // those of each request admitted here: admissions are counted against the pool together, so
        // a pool shared by several slots (`-np` auto) does not admit prompts it would have to
        // preempt a step later.
        let mut committed: usize = {
            let pool = self.model.kv_cache();
            self.running.iter().map(|r| pool.pages_for(r.tokens.len()).saturating_sub(r.kv.num_pages())).sum()
        };
        // Requests passed over keep their place; those waiting on shared pages keep a slot each too
        // (`kept`), those waiting for the slot they asked for none.
        let (mut next, mut kept) = (0, 0);
        while self.running.len() + kept < self.opts.parallel {
            let Some(seq) = self.waiting.get(next) else { break };
            if seq.pinned.is_some_and(|s| !self.free_slots.contains(&s)) {
                next += 1;
                continue;
            }
            // Reuse whole cached pages, but always compute the last token (its logits are needed) in a
            // page this sequence owns.
            let reusable = (seq.tokens.len() - 1) / bs;
            // A prompt still to score computes every row (its pages are still offered to the cache).
            let reuse = self.reuse_prefixes && seq.cache_prompt && !seq.scoring();
            let hit =
                if reuse { self.cache.lookup(&seq.tokens[..reusable * bs], reusable) } else { Default::default() };
            if reuse && self.computing_shared_pages(seq, hit.pages.len()) {
                // It finds those pages cached a step or so later; the requests behind it need not
                // wait for them, but leave it a slot.
                next += 1;
                kept += 1;
                continue;
            }
            let pool = self.model.kv_cache();
            let need = pool.pages_for(seq.tokens.len()) - hit.pages.len();
            let available = pool.free_blocks() + self.cache.evictable();
            if need + committed > available && !self.running.is_empty() {
                break;
            }
            let mut seq = self.waiting.remove(next).expect("the request looked at");
            let mut reused = hit.pages.len() * bs;
            for page in hit.pages {
                seq.kv.push_shared(page);
            }
            seq.kv.len = reused;
            seq.offered_pages = seq.kv.num_pages();
            seq.offered_key = hit.key;
            if reuse && self.model.copies_pages() {
                reused += self.reuse_page_head(&mut seq, hit.key);
            }
            // What it still needs (a page head copied above is taken from the free pages already).
            let pool = self.model.kv_cache();
            committed += pool.pages_for(seq.tokens.len()).saturating_sub(seq.kv.num_pages());
            self.counters.cache_hit_tokens += reused as u64;
            seq.slot = match seq.pinned {
                Some(s) => {
                    self.free_slots.retain(|&f| f != s);
                    Some(s)
                }
                None => self.free_slots.pop(),
            };
            if seq.admitted.is_none() {
                seq.admitted = Some(Instant::now());
                seq.cached_tokens = reused;
                self.counts.leave();
                seq.send(GenerationEvent::Started { cached_tokens: reused, slot: seq.slot.unwrap_or(0) });
            }
            let at = self.running.partition_point(|s| s.id < seq.id);
            self.running.insert(at, seq);
        }
    }

    /// Whether a running sequence is still computing whole pages of `waiting`'s prompt beyond the
    /// `cached` pages the prefix cache holds for it (several answers to one prompt, users whose
    /// shared system prompt arrives at once). Admitted now, `waiting` would compute them a second
    /// time; a step or so later it finds them in the cache, as pages are offered when they fill.
    fn computing_shared_pages(&self, waiting: &Sequence, cached: usize) -> bool {
        let bs = self.model.kv_cache().block_size;
        let reusable = (waiting.tokens.len() - 1) / bs;
        self.running.iter().any(|r| {
            let prefilling = r.cache_prompt && r.pending() > 1;
            let computed = r.kv.len / bs;
            prefilling && reusable > cached.max(computed) && {
                let shared = waiting.tokens.iter().zip(&r.tokens).take_while(|(a, b)| a == b).count() / bs;
                shared.min(reusable) > cached.max(computed)
            }
        })
    }

    /// Where the prompt goes on past its whole cached pages (the prefix keyed `parent`) with the head
    /// of another cached page, copies that page into one of the sequence's own and takes its matching
    /// positions as computed (never the prompt's last token); returns how many (none when no page
    /// can be had or the copy fails).
    fn reuse_page_head(&mut self, seq: &mut Sequence, parent: u64) -> usize {
        let start = seq.kv.len;
        let next = &seq.tokens[start..seq.tokens.len() - 1];
        let Some((cached, n)) =
            self.cache.lookup_partial(parent, &next[..next.len().min(self.model.kv_cache().block_size)])
        else {
            return 0;
        };
        if self.model.kv_cache().free_blocks() == 0 {
            self.cache.evict_one();
        }
        let pool = self.model.kv_cache();
        if pool.reserve(&mut seq.kv, start + 1).is_err() {
            return 0;
        }
        let own = *seq.kv.blocks.last().expect("a page was reserved");
        match self.model.copy_page(cached.id(), own) {
            Ok(()) => {
                seq.kv.len = start + n;
                n
            }
            Err(e) => {
                tracing::warn!("copying a cached KV page failed ({e:#}); computing those tokens instead");
                0
            }
        }
    }

    /// Chooses each running sequence's tokens for this step and gives it the pages they need:
    /// decodes first, then prompt chunks, oldest request first, within the step's token budget.
    /// Returns `(index in running, tokens)` in `running` order.
    fn plan(&mut self) -> Vec<(usize, usize)> {
        let mut budget = self.opts.step_tokens();
        // Logits rows the step may bring back for scored prompts, all of them together.
        let mut scoring_rows = scoring_chunk(self.model.vocab_size());
        let mut planned = vec![0usize; self.running.len()];
        for decodes in [true, false] {
            let mut i = 0;
            while i < self.running.len() && budget > 0 {
                let pending = self.running[i].pending();
                if planned[i] > 0 || (pending == 1) != decodes {
                    i += 1;
                    continue;
                }
                let scoring = self.running[i].scoring();
                if scoring && scoring_rows == 0 {
                    // Its next chunk waits for the next step's rows.
                    i += 1;
                    continue;
                }
                let cap = if scoring { scoring_rows } else { usize::MAX };
                if let Some(n) = self.grow(i, pending.min(budget).min(cap)) {
                    planned[i] = n;
                    budget -= n;
                    if scoring {
                        scoring_rows -= n;
                    }
                    i += 1;
                    continue;
                }
                // Not one more page: preempt the newest sequence (maybe this one), unless a prompt chunk
                // can simply wait for pages that running decodes will free.
                let nothing_planned = planned.iter().all(|&n| n == 0);
                if !decodes && !nothing_planned {
                    i += 1;
                    continue;
                }
                let newest = self.running.len() - 1;
                if newest == 0 {
                    // Alone and the pool is full: this sequence has used all the KV memory there is.
                    let seq = self.running.remove(0);
                    planned.remove(0);
                    self.finish(seq, Outcome::Finished(FinishReason::Length));
                    break;
                }
                self.preempt(newest);
                planned.pop();
                if newest == i {
                    break;
                }
            }
        }
        planned.iter().enumerate().filter(|(_, &n)| n > 0).map(|(i, &n)| (i, n)).collect()
    }

    /// Gives `running[i]` the pages for up to `want` more tokens, evicting unused cached pages if
    /// needed; returns how many tokens it has room for (None: not even one).
    fn grow(&mut self, i: usize, want: usize) -> Option<usize> {
        let pool = self.model.kv_cache();
        let seq = &mut self.running[i];
        let have = seq.kv.num_pages();
        let need = pool.pages_for(seq.kv.len + want).saturating_sub(have);
        while pool.free_blocks() < need && self.cache.evict_one() {}
        let pages = have + need.min(pool.free_blocks());
        let n = (pages * pool.block_size).saturating_sub(seq.kv.len).min(want);
        if n == 0 {
            return None;
        }
        let end = seq.kv.len + n;
        pool.reserve(&mut seq.kv, end).ok()?;
        Some(n)
    }

    /// Lets go of `running[i]`'s pages and sends it back to the front of the queue; it recomputes its
    /// prompt and what it generated so far when it is admitted again.
    fn preempt(&mut self, i: usize) {
        let mut seq = self.running.remove(i);
        tracing::debug!("preempting request {} ({} tokens of KV) to free pages", seq.id, seq.kv.len);
        seq.kv = SeqBlocks::new();
        seq.offered_pages = 0;
        seq.offered_key = ROOT;
        if let Some(slot) = seq.slot.take() {
            self.free_slots.push(slot);
        }
        self.counters.preemptions += 1;
        self.waiting.push_front(seq);
    }

    /// Runs the planned chunks as one forward pass, then samples and streams for every sequence that
    /// asked for logits. Returns the sequences that ended, `(index in running, how)`, in order.
    ///
    /// When every sampling sequence of the step needs only a row's largest logits (greedy, or a top-k
    /// as the first cut; no penalties or DRY before it, no log-probabilities), the backend selects them
    /// and the rows never come back whole.
    fn run(&mut self, plan: &[(usize, usize)]) -> Vec<(usize, Outcome)> {
        let mut top_k = Some(0);
        let chunks: Vec<SeqChunk> = plan
            .iter()
            .map(|&(i, n)| {
                let s = &self.running[i];
                let samples = s.kv.len + n == s.tokens.len();
                if samples {
                    let whole = s.logprobs.is_some() || s.constraint.is_some();
                    let needed = if whole { None } else { s.sampler.top_k_needed() };
                    top_k = top_k.zip(needed).map(|(a, b)| a.max(b));
                }
                let logits = if s.scores_in(n) {
                    // Scores are log-softmaxes of whole rows.
                    top_k = None;
                    Logits::All
                } else if samples {
                    Logits::Last
                } else {
                    Logits::None
                };
                SeqChunk { blocks: &s.kv, tokens: &s.tokens[s.kv.len..s.kv.len + n], start_pos: s.kv.len, logits }
            })
            .collect();
        // Each chunk's logits rows, and whether they score its prompt.
        let row_counts: Vec<(usize, bool)> = chunks
            .iter()
            .map(|c| match c.logits {
                Logits::All => (c.tokens.len(), true),
                Logits::Last => (1, false),
                Logits::None => (0, false),
            })
            .collect();
        let want = match top_k {
            Some(k) if k > 0 => RowsWanted::Top(k),
            _ => RowsWanted::Full,
        };
        let submitted = self.model.submit(&chunks, want);
        drop(chunks);
        let rows = match submitted.and_then(|()| self.model.wait()) {
            Ok(rows) => rows,
            Err(e) => {
                tracing::error!("forward pass failed: {e:#}");
                if self.model.state_epoch() != self.epoch {
                    // The backend was rebuilt: every cached page is gone. Sequences outside this step
                    // start their KV over from their tokens, as after a preemption.
                    self.epoch = self.model.state_epoch();
                    self.cache = PrefixCache::new(self.model.kv_cache().block_size);
                    for s in &mut self.running {
                        s.kv = SeqBlocks::new();
                        (s.offered_pages, s.offered_key) = (0, ROOT);
                    }
                }
                let err = EngineError::Internal(format!("the forward pass failed: {e:#}"));
                return plan.iter().map(|&(i, _)| (i, Outcome::Failed(err.clone()))).collect();
            }
        };

        let vocab = self.model.vocab_size();
        let ctx_size = self.model.ctx_size();
        let page_size = self.model.kv_cache().block_size;
        let mut row_index = 0;
        let mut ended = Vec::new();
        let mut rows = rows;
        for (&(i, n), &(row_count, scoring)) in plan.iter().zip(&row_counts) {
            let seq = &mut self.running[i];
            if scoring {
                if let StepRows::Full(v) = &rows {
                    let first = row_index * vocab;
                    score_prompt(seq, v.get(first..first + row_count * vocab).unwrap_or_default(), vocab);
                }
            }
            seq.kv.len += n;
            if seq.first_token.is_none() {
                self.counters.prompt_tokens += n as u64;
                seq.send(GenerationEvent::PromptProgress {
                    processed: seq.kv.len.min(seq.prompt_len),
                    total: seq.prompt_len,
                    cached: seq.cached_tokens,
                    elapsed: seq.admitted.map_or(Duration::ZERO, |t| t.elapsed()),
                });
            }
            if self.reuse_prefixes && seq.cache_prompt {
                offer_full_pages(&mut self.cache, seq, page_size);
            }
            let prompt_len = seq.prompt_len;
            if let Some(sc) = seq.scores.as_mut().filter(|sc| !sc.sent && sc.next_row() + 1 >= prompt_len) {
                sc.sent = true;
                let scores = std::mem::take(&mut sc.scores);
                seq.send(GenerationEvent::PromptLogprobs(scores));
            }
            if seq.kv.len < seq.tokens.len() {
                row_index += row_count;
                continue;
            }
            // The sampling row is the chunk's last.
            row_index += row_count.saturating_sub(1);
            let row = match &mut rows {
                StepRows::Full(v) => v.chunks_exact_mut(vocab).nth(row_index).map(Row::Full),
                StepRows::Top { k, ids, values } => {
                    let r = row_index * *k..(row_index + 1) * *k;
                    ids.get(r.clone()).zip(values.get(r)).map(|(ids, values)| Row::Top(ids, values))
                }
            };
            row_index += 1;
            let Some(row) = row else {
                ended.push((i, Outcome::Failed(EngineError::Internal("the model returned too few logits".into()))));
                continue;
            };
            match sample_next(seq, &self.tokenizer, row, ctx_size) {
                Ok(None) => {}
                Ok(Some(finish)) => ended.push((i, Outcome::Finished(finish))),
                Err(e) => ended.push((i, Outcome::Failed(EngineError::Internal(e)))),
            }
        }
        ended
    }

    /// Sends a sequence's last events and lets go of it (its pages return to the pool, or stay in the
    /// prefix cache).
    fn finish(&mut self, mut seq: Sequence, outcome: Outcome) {
        if let Some(slot) = seq.slot.take() {
            self.free_slots.push(slot);
        }
        if seq.admitted.is_none() {
            self.counts.leave();
        }
        let usage = seq.usage();
        self.counters.generated_tokens += usage.completion_tokens as u64;
        self.counters.prompt_seconds += usage.prompt_time.as_secs_f64();
        self.counters.generation_seconds += usage.generation_time.as_secs_f64();
        match outcome {
            Outcome::Finished(finish) => {
                if finish == FinishReason::Cancelled {
                    self.counters.requests_cancelled += 1;
                } else {
                    self.counters.requests_finished += 1;
                }
                // Text held back for a possible stop string belongs to the answer when something else
                // ended it (a token that ended it has already released its text).
                let rest = seq.text.flush(&self.tokenizer);
                if !rest.is_empty() {
                    seq.send(GenerationEvent::Text { text: rest, tokens: vec![], logprobs: vec![] });
                }
                self.end(&seq, GenerationEvent::Done { finish, usage });
            }
            Outcome::Failed(e) => {
                self.counters.requests_failed += 1;
                self.end(&seq, GenerationEvent::Error(e));
            }
        }
    }
}

impl<M: StepModel> Drop for Scheduler<M> {
    /// Ends held back are sent even when the engine thread unwinds from a panic.
    fn drop(&mut self) {
        self.send_ends();
    }
}

/// Offers the sequence's newly filled pages to the prefix cache.
fn offer_full_pages(cache: &mut PrefixCache, seq: &mut Sequence, page_size: usize) {
    while (seq.offered_pages + 1) * page_size <= seq.kv.len {
        let p = seq.offered_pages;
        let tokens = &seq.tokens[p * page_size..(p + 1) * page_size];
        seq.offered_key = cache.insert(seq.offered_key, tokens, p + 1, seq.kv.page(p));
        seq.offered_pages += 1;
    }
}

/// Scores the prompt tokens that the logits `rows` (of the positions from the KV's end on, `vocab`
/// each) predict and that have no score yet.
fn score_prompt(seq: &mut Sequence, rows: &[f32], vocab: usize) {
    let Some(sc) = seq.scores.as_mut() else { return };
    for (j, row) in rows.chunks_exact(vocab).enumerate() {
        let pos = seq.kv.len + j;
        if pos != sc.next_row() || pos + 1 >= seq.prompt_len {
            continue;
        }
        let token = seq.tokens[pos + 1];
        let (lse, top) = log_softmax_top(row, sc.top);
        sc.scores.push(TokenLogprob { token, logprob: row[token as usize] - lse, top });
    }
}

/// One sequence's logits from a step: the whole row, or its largest logits (ids and values, best first).
enum Row<'a> {
    Full(&'a mut [f32]),
    Top(&'a [u32], &'a [f32]),
}

/// Samples the sequence's next token from its logits row and streams it; returns how it ended, if
/// it did.
fn sample_next(
    seq: &mut Sequence,
    tokenizer: &TextTokenizer,
    row: Row,
    ctx_size: usize,
) -> Result<Option<FinishReason>, String> {
    let now = Instant::now();
    if seq.first_token.is_none() {
        seq.first_token = Some(now);
    }
    if seq.text.exhausted() {
        // `max_tokens` 0: the prompt is computed (and cached), nothing generated.
        return Ok(Some(FinishReason::Length));
    }
    // Log-probabilities are the model's, before penalties change the row (a sequence that wants them
    // always gets whole rows).
    // A thought over its budget is closed by the engine, token by token, in place of sampling.
    let forced = seq.thought.as_mut().and_then(Thought::forced);
    let (token, model_row) = match (forced, row) {
        (Some(t), Row::Full(row)) => (t, seq.logprobs.map(|_| row.to_vec())),
        (Some(t), Row::Top(..)) => (t, None),
        (None, Row::Full(row)) => {
            let model_row = seq.logprobs.map(|_| row.to_vec());
            if let Some(c) = seq.held() {
                c.mask(row).map_err(|e| format!("the answer's grammar failed: {e}"))?;
                // No token of the model's fits (its ends lie outside the row, as in a test model's).
                if row.iter().all(|&l| l == f32::NEG_INFINITY) {
                    return ruled_out(c, "no token of the model's vocabulary");
                }
            } else if seq.constraint.is_some() {
                // Inside a thought that the answer's grammar must follow, the answer may not end.
                for &id in tokenizer.eos_ids.iter().chain(seq.text.end_tokens()) {
                    if let Some(l) = row.get_mut(id as usize) {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
            let token = seq.sampler.sample(row, &seq.tokens);
            // A sampler that falls back on a token the grammar ruled out (the infill sampler's end,
            // argmax of a row that biases left empty) ends the answer where the grammar may end.
            if let Some(c) = seq.held().filter(|_| row.get(token as usize) == Some(&f32::NEG_INFINITY)) {
                return ruled_out(c, "no token the sampler may choose");
            }
            (token, model_row)
        }
        (None, Row::Top(ids, values)) => (seq.sampler.sample_top(ids, values, &seq.tokens), None),
    };
    // A token the engine wrote in (a thought's close) is not the answer's: the grammar holds what
    // follows.
    if let Some(c) = seq.held().filter(|_| forced.is_none()) {
        c.accept(token).map_err(|e| format!("token {token} does not follow the answer's grammar: {e}"))?;
    }
    // A stop string does not end a thought whose answer a grammar holds: the answer would be missing.
    // (The close the engine writes for a budget is the thought's too, to its last token.)
    let in_thought = forced.is_some() || seq.thought.as_ref().is_some_and(Thought::inside);
    seq.text.match_stops(!(in_thought && seq.constraint.is_some()));
    let step = seq.text.push(tokenizer, token)?;
    let mut logprobs = Vec::new();
    let mut tokens = Vec::new();
    if step.accepted {
        if let Some(thought) = seq.thought.as_mut().filter(|t| t.watching()) {
            thought.push(&String::from_utf8_lossy(&tokenizer.token_bytes(token)));
        }
        seq.tokens.push(token);
        seq.last_token = Some(now);
        tokens.push(token);
        if let (Some(n), Some(model_row)) = (seq.logprobs, &model_row) {
            let (lse, top) = log_softmax_top(model_row, n);
            logprobs.push(TokenLogprob { token, logprob: model_row[token as usize] - lse, top });
        }
    }
    if !step.text.is_empty() || !tokens.is_empty() {
        seq.send(GenerationEvent::Text { text: step.text, tokens, logprobs });
    }
    if let (false, Some(n), Some(model_row)) = (step.accepted, seq.logprobs, &model_row) {
        let (lse, top) = log_softmax_top(model_row, n);
        seq.send(GenerationEvent::EndToken(TokenLogprob { token, logprob: model_row[token as usize] - lse, top }));
    }
    if step.finish.is_some() {
        return Ok(step.finish);
    }
    // The answer's grammar allows nothing more: it ends as at an end of sequence.
    if seq.constraint.as_ref().is_some_and(Constraint::finished) {
        return Ok(Some(FinishReason::Stop));
    }
    // Feeding this token next would pass the context.
    if seq.tokens.len() >= ctx_size {
        return Ok(Some(FinishReason::Length));
    }
    Ok(None)
}

/// Where the grammar rules out every token there is to take (`what`): the answer ends if the grammar
/// may end here, and fails otherwise.
fn ruled_out(c: &mut Constraint, what: &str) -> Result<Option<FinishReason>, String> {
    match c.may_end() {
        true => Ok(Some(FinishReason::Stop)),
        false => Err(format!("{what} fits the answer's grammar")),
    }
}

/// The log-sum-exp of `row` and its `n` most likely tokens with their log-probabilities.
fn log_softmax_top(row: &[f32], n: usize) -> (f32, Vec<(u32, f32)>) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let lse = max + sum.ln() as f32;
    let mut idx: Vec<u32> = (0..row.len() as u32).collect();
    let n = n.min(idx.len());
    if n > 0 && n < idx.len() {
        idx.select_nth_unstable_by(n - 1, |&a, &b| row[b as usize].total_cmp(&row[a as usize]));
    }
    idx.truncate(n);
    idx.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
    (lse, idx.into_iter().map(|t| (t, row[t as usize] - lse)).collect())
}

#[cfg(test)]
#[path = "scheduler_tests.rs"]
mod tests;
