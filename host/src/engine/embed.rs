//! Encoder models: sentence embeddings and cross-encoder rerankers. An encoder keeps no state between
//! steps, so there are no KV pages and no scheduler: each input is one whole sequence, many inputs go
//! through one forward pass (each sequence attends only to itself, without padding), and the model
//! outputs one row per input (a pooled vector, or a relevance logit).
//!
//! - [`EncoderTokenizer`] turns texts, text pairs or caller-given token ids into sequences, honouring
//!   the model's truncation (sentence-transformers' `max_seq_length`, else `tokenizer.json`'s), with any
//!   padding switched off, and refuses what the model cannot take (empty input, ids outside the
//!   vocabulary, too long with truncation off).
//! - [`Encoder`] owns the [`ModelRunner`] on its own thread; concurrent requests are gathered into the
//!   same forward passes, up to a token budget per pass.

use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use mlxcel_plugin_api::Task;
use serde_json::Value;
use tokenizers::{Tokenizer, TruncationDirection, TruncationParams, TruncationStrategy};

use super::kv_cache::SeqBlocks;
use super::request::EngineError;
use super::runner::{Logits, ModelRunner, SeqChunk};

/// One input ready for the model: token ids and their token types (segment ids).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodedInput {
    pub ids: Vec<u32>,
    pub types: Vec<u32>,
}

/// The tokenizer side of an encoder model.
pub struct EncoderTokenizer {
    inner: Tokenizer,
    /// Longest sequence the model takes (its positions, or the truncation length when lower); longer
    /// texts are cut to it.
    pub max_tokens: usize,
    vocab_size: usize,
    /// RoBERTa-style models have one token type: every token is type 0 whatever the tokenizer says.
    single_type: bool,
}

impl EncoderTokenizer {
    /// Loads `dir/tokenizer.json` for a model of `vocab_size` ids and `model_max` positions.
    /// Texts are cut as sentence-transformers cuts them: at `sentence_transformers.max_seq_length` of
    /// `config`, else the `truncation` of `tokenizer.json`, else `model_max_length` of
    /// `tokenizer_config.json`, all capped at `model_max` (which applies alone where none is given,
    /// as sentence-transformers takes the positions then). A fixed padding in `tokenizer.json`
    /// (all-MiniLM-L6-v2 pads to 128) is switched off: every sequence runs at its own length.
    pub fn load(dir: &Path, config: &Value, model_max: usize, vocab_size: usize) -> Result<EncoderTokenizer> {
        let path = dir.join("tokenizer.json");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("{}: an encoder model needs tokenizer.json beside its weights", path.display()))?;
        let json: Value =
            serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))?;
        let mut inner = Tokenizer::from_file(&path)
            .map_err(|e| anyhow::anyhow!("{}: cannot load tokenizer: {e}", path.display()))?;
        let st_max = config
            .get(crate::checkpoint::sentence_transformers::CONFIG_KEY)
            .and_then(|s| s.get("max_seq_length"))
            .and_then(Value::as_u64);
        let tok_max = json.get("truncation").and_then(|t| t.get("max_length")).and_then(Value::as_u64);
        // (Transformers writes a huge number there for "no limit".)
        let config_max =
            crate::text::tokenizer_config(dir).and_then(|c| c.get("model_max_length").and_then(Value::as_u64));
        let limit = st_max.or(tok_max).or(config_max).map_or(model_max, |m| (m as usize).min(model_max));
        inner.with_padding(None);
        let truncation = TruncationParams {
            max_length: limit,
            strategy: TruncationStrategy::LongestFirst,
            stride: 0,
            direction: TruncationDirection::Right,
        };
        inner.with_truncation(Some(truncation)).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        let single_type = config.get("type_vocab_size").and_then(Value::as_u64) == Some(1);
        Ok(EncoderTokenizer { inner, max_tokens: limit, vocab_size, single_type })
    }

    /// One text, with the tokenizer's special tokens (`[CLS] text [SEP]`).
    pub fn encode(&self, text: &str) -> Result<EncodedInput, EngineError> {
        if text.is_empty() {
            return Err(EngineError::Invalid("the input is an empty string".into()));
        }
        let enc = self.inner.encode(text, true).map_err(|e| EngineError::Invalid(format!("tokenizing failed: {e}")))?;
        self.finish(enc.get_ids().to_vec(), enc.get_type_ids().to_vec())
    }

    /// A (query, document) pair for a cross-encoder (`[CLS] a [SEP] b [SEP]`, types 0 then 1).
    pub fn encode_pair(&self, a: &str, b: &str) -> Result<EncodedInput, EngineError> {
        if a.is_empty() || b.is_empty() {
            return Err(EngineError::Invalid("the query and each document must be non-empty strings".into()));
        }
        let enc =
            self.inner.encode((a, b), true).map_err(|e| EngineError::Invalid(format!("tokenizing failed: {e}")))?;
        self.finish(enc.get_ids().to_vec(), enc.get_type_ids().to_vec())
    }

    /// Token ids the caller tokenized: used as given (no special tokens added, never truncated).
    pub fn from_ids(&self, ids: Vec<u32>) -> Result<EncodedInput, EngineError> {
        if ids.is_empty() {
            return Err(EngineError::Invalid("the input is an empty list of token ids".into()));
        }
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= self.vocab_size) {
            return Err(EngineError::Invalid(format!(
                "token id {bad} is outside the vocabulary (ids are below {})",
                self.vocab_size
            )));
        }
        if ids.len() > self.max_tokens {
            return Err(EngineError::Invalid(format!(
                "the input has {} tokens; the model takes at most {}",
                ids.len(),
                self.max_tokens
            )));
        }
        let types = vec![0; ids.len()];
        Ok(EncodedInput { ids, types })
    }

    fn finish(&self, ids: Vec<u32>, mut types: Vec<u32>) -> Result<EncodedInput, EngineError> {
        if ids.len() > self.max_tokens {
            // (A pair whose query alone fills the limit: the tokenizer cannot cut it to fit.)
            return Err(EngineError::Invalid(format!(
                "the input has {} tokens after cutting; the model takes at most {}",
                ids.len(),
                self.max_tokens
            )));
        }
        if self.single_type {
            types.iter_mut().for_each(|t| *t = 0);
        }
        Ok(EncodedInput { ids, types })
    }
}

/// A cross-encoder's relevance logit as a score in (0, 1): the sigmoid sentence-transformers'
/// `CrossEncoder` applies to one-label models. Monotonic, so the order is the logits' order.
pub fn relevance_score(logit: f32) -> f32 {
    1.0 / (1.0 + (-logit).exp())
}

/// How an [`Encoder`] batches.
#[derive(Debug, Clone, Copy)]
pub struct EncoderOptions {
    /// Most tokens in one forward pass (a longer single input still runs, alone).
    pub max_batch_tokens: usize,
    /// Most requests waiting before new ones are refused with [`EngineError::QueueFull`].
    pub max_queue: usize,
}

impl Default for EncoderOptions {
    fn default() -> Self {
        EncoderOptions { max_batch_tokens: 4096, max_queue: 256 }
    }
}

/// What the model is, for the front ends.
#[derive(Debug, Clone)]
pub struct EncoderInfo {
    pub task: Task,
    /// Floats per output row (the embedding width; 1 for a reranker).
    pub output_dim: usize,
    pub max_tokens: usize,
    /// The model L2-normalises its vectors (sentence-transformers' `Normalize`), so shortened ones
    /// are normalised again (see [`shorten`]).
    pub normalized: bool,
}

/// Checks a requested embedding width against the model's (`1..=width`); the error completes a
/// sentence that starts with the option's name.
pub fn check_dimensions(dims: u64, width: usize) -> Result<usize, String> {
    match dims {
        0 => Err("must be at least 1".into()),
        d if d > width as u64 => Err(format!("is {d}, but the model's vectors have only {width} dimensions")),
        d => Ok(d as usize),
    }
}

/// Matryoshka shortening, as OpenAI's `dimensions` does it: the first `dims` values, L2-normalised
/// again when the model normalises its vectors (a model trained for it, e.g. Qwen3-Embedding, keeps
/// most of its quality in the leading dimensions; for others the prefix is merely a projection).
pub fn shorten(v: &mut Vec<f32>, dims: usize, normalize: bool) {
    v.truncate(dims);
    if normalize {
        let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
        v.iter_mut().for_each(|x| *x /= norm);
    }
}

/// llama-server's `embd_normalize` over a vector: `p` = -1 none, 0 the largest magnitude to 32760
/// (int16's range), 1 taxicab, 2 Euclidean, larger the p-norm. A zero vector stays zero.
pub fn normalize_by(v: &mut [f32], p: i64) {
    let sum: f64 = match p {
        -1 => 1.0,
        0 => v.iter().fold(0.0f64, |m, &x| m.max(x.abs() as f64)) / 32760.0,
        2 => v.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt(),
        p => {
            // Over the largest magnitude first, so that no power overflows whatever `p`.
            let max = v.iter().fold(0.0f64, |m, &x| m.max(x.abs() as f64));
            let p = p as f64;
            let sum = v.iter().map(|&x| (x.abs() as f64 / max).powf(p)).sum::<f64>();
            if max > 0.0 {
                max * sum.powf(1.0 / p)
            } else {
                0.0
            }
        }
    };
    let scale = if sum > 0.0 { (1.0 / sum) as f32 } else { 0.0 };
    v.iter_mut().for_each(|x| *x *= scale);
}

/// Counters since start.
#[derive(Debug, Default)]
pub struct EncoderCounters {
    pub queued: AtomicUsize,
    pub running: AtomicUsize,
    pub passes: AtomicU64,
    pub inputs: AtomicU64,
    pub tokens: AtomicU64,
    pub compute_micros: AtomicU64,
    /// Requests stopped because their caller stopped waiting.
    pub cancelled: AtomicU64,
}

/// One output row per input, or why the request failed.
type Rows = Result<Vec<Vec<f32>>, EngineError>;

/// One request's inputs, and where its rows go.
struct Job {
    inputs: Vec<EncodedInput>,
    reply: tokio::sync::oneshot::Sender<Rows>,
}

/// A running encoder model: a handle to its thread (Clone + Send + Sync). Dropping the last handle
/// stops the thread once its queue is empty.
#[derive(Clone)]
pub struct Encoder {
    tx: mpsc::SyncSender<Job>,
    pub info: EncoderInfo,
    pub counters: Arc<EncoderCounters>,
}

impl Encoder {
    /// Moves `runner` onto its own thread. The runner's model must be an embedding or rerank model.
    pub fn start(runner: ModelRunner, max_tokens: usize, opts: EncoderOptions) -> Result<Encoder> {
        let task = runner.info.task;
        if !matches!(task, Task::Embed | Task::Rerank) {
            anyhow::bail!("{} is a {} model, not an encoder", runner.checkpoint.dir.display(), task.name());
        }
        let normalized = crate::checkpoint::sentence_transformers::normalizes(&runner.checkpoint.config);
        let info = EncoderInfo { task, output_dim: runner.info.output_dim, max_tokens, normalized };
        let (tx, rx) = mpsc::sync_channel::<Job>(opts.max_queue.max(1));
        let counters = Arc::new(EncoderCounters::default());
        let c = counters.clone();
        std::thread::Builder::new()
            .name("mlxcel-encoder".into())
            .spawn(move || serve(runner, rx, opts, &c))
            .context("cannot start the encoder thread")?;
        Ok(Encoder { tx, info, counters })
    }

    /// Runs `inputs` and returns one row per input, in order. Dropping the future (the client left,
    /// the request timed out) stops the request's remaining passes.
    pub async fn run(&self, inputs: Vec<EncodedInput>) -> Result<Vec<Vec<f32>>, EngineError> {
        let rx = self.submit(inputs)?;
        rx.await.unwrap_or_else(|_| Err(EngineError::Internal("the encoder stopped".into())))
    }

    /// [`Encoder::run`] for callers outside an async runtime (the CLI).
    pub fn run_blocking(&self, inputs: Vec<EncodedInput>) -> Result<Vec<Vec<f32>>, EngineError> {
        let rx = self.submit(inputs)?;
        rx.blocking_recv().unwrap_or_else(|_| Err(EngineError::Internal("the encoder stopped".into())))
    }

    fn submit(&self, inputs: Vec<EncodedInput>) -> Result<tokio::sync::oneshot::Receiver<Rows>, EngineError> {
        if inputs.is_empty() {
            return Err(EngineError::Invalid("no inputs".into()));
        }
        let (reply, rx) = tokio::sync::oneshot::channel();
        // Counted before it is sent: the encoder thread may take it (and count it off) at once.
        self.counters.queued.fetch_add(1, Ordering::Relaxed);
        let refused = match self.tx.try_send(Job { inputs, reply }) {
            Ok(()) => return Ok(rx),
            Err(mpsc::TrySendError::Full(_)) => {
                EngineError::QueueFull { queued: self.counters.queued.load(Ordering::Relaxed).saturating_sub(1) }
            }
            Err(mpsc::TrySendError::Disconnected(_)) => EngineError::ShuttingDown,
        };
        self.counters.queued.fetch_sub(1, Ordering::Relaxed);
        Err(refused)
    }
}

/// A request the encoder thread has taken: its rows so far.
struct Active {
    job: Job,
    rows: Vec<Vec<f32>>,
    failed: Option<EngineError>,
}

impl Active {
    fn done(&self) -> bool {
        self.failed.is_some() || self.rows.len() == self.job.inputs.len()
    }
}

/// The encoder thread. Between passes it takes the requests that have arrived (up to `max_queue`),
/// and each pass takes their next inputs in turn (one from each, round and round, starting one
/// request further on each pass) up to `max_batch_tokens`, so a short request that arrives behind a
/// long one runs within a pass or two, not after it; a request is answered as soon as its last row
/// is in.
fn serve(mut runner: ModelRunner, rx: mpsc::Receiver<Job>, opts: EncoderOptions, counters: &EncoderCounters) {
    let mut active: Vec<Active> = Vec::new();
    loop {
        if active.is_empty() {
            match rx.recv() {
                Ok(job) => active.push(Active { job, rows: Vec::new(), failed: None }),
                Err(_) => return,
            }
            counters.queued.fetch_sub(1, Ordering::Relaxed);
        }
        // At most `max_queue` taken: the rest wait in the channel, whose bound refuses new requests
        // (`QueueFull`) while the encoder is that far behind.
        while active.len() < opts.max_queue.max(1) {
            let Ok(job) = rx.try_recv() else { break };
            counters.queued.fetch_sub(1, Ordering::Relaxed);
            active.push(Active { job, rows: Vec::new(), failed: None });
        }
        // A request whose caller stopped waiting (it left, or timed out) runs no more passes.
        active.retain(|a| {
            let gone = a.job.reply.is_closed();
            if gone {
                counters.cancelled.fetch_add(1, Ordering::Relaxed);
                tracing::info!("stopped an encoder request: its caller stopped waiting");
            }
            !gone
        });
        counters.running.store(active.len(), Ordering::Relaxed);
        if active.is_empty() {
            continue;
        }
        let remaining: Vec<&[EncodedInput]> = active.iter().map(|a| &a.job.inputs[a.rows.len()..]).collect();
        let picks = round_robin(&remaining, opts.max_batch_tokens);
        let inputs: Vec<&EncodedInput> = picks.iter().map(|&(a, i)| &remaining[a][i]).collect();
        let start = Instant::now();
        let result = forward(&mut runner, &inputs);
        counters.compute_micros.fetch_add(start.elapsed().as_micros() as u64, Ordering::Relaxed);
        counters.passes.fetch_add(1, Ordering::Relaxed);
        counters.inputs.fetch_add(inputs.len() as u64, Ordering::Relaxed);
        counters.tokens.fetch_add(inputs.iter().map(|i| i.ids.len() as u64).sum(), Ordering::Relaxed);
        match result {
            // Picks hold each request's inputs in order, so its rows arrive in order.
            Ok(out) => picks.iter().zip(out).for_each(|(&(a, _), row)| active[a].rows.push(row)),
            Err(e) => {
                tracing::warn!("encoder pass failed: {e:#}");
                for &(a, _) in &picks {
                    active[a].failed.get_or_insert_with(|| EngineError::Internal(format!("{e:#}")));
                }
            }
        }
        // The next pass starts its turns at the next request, so a long one at the front cannot keep
        // taking a pass's room first.
        if active.len() > 1 {
            active.rotate_left(1);
        }
        for a in std::mem::take(&mut active) {
            if !a.done() {
                active.push(a);
                continue;
            }
            let _ = a.job.reply.send(match a.failed {
                Some(e) => Err(e),
                None => Ok(a.rows),
            });
        }
        counters.running.store(active.len(), Ordering::Relaxed);
    }
}

/// One pass's inputs from the requests' remaining ones (`(request, index into its remaining)`):
/// the first input of each request in turn, then the second of each, … while the pass holds at
/// most `budget` tokens (an input longer than the budget runs alone). Each request's picks are its
/// next inputs in order.
fn round_robin(remaining: &[&[EncodedInput]], budget: usize) -> Vec<(usize, usize)> {
    let mut picks = Vec::new();
    let mut tokens = 0;
    let mut full = vec![false; remaining.len()];
    for round in 0.. {
        let mut took = false;
        for (a, inputs) in remaining.iter().enumerate() {
            let Some(input) = inputs.get(round).filter(|_| !full[a]) else { continue };
            let n = input.ids.len();
            if !picks.is_empty() && tokens + n > budget {
                // This request's next input does not fit: it waits, so its later ones wait too.
                full[a] = true;
                continue;
            }
            picks.push((a, round));
            tokens += n;
            took = true;
        }
        if !took {
            break;
        }
    }
    picks
}

/// Consecutive runs of `items` holding at most `budget` tokens each (a longer item alone).
fn batches<'a, T>(items: &'a [(T, &'a EncodedInput)], budget: usize) -> Vec<&'a [(T, &'a EncodedInput)]> {
    let mut out = Vec::new();
    let (mut start, mut tokens) = (0, 0);
    for (i, (_, input)) in items.iter().enumerate() {
        let n = input.ids.len();
        if i > start && tokens + n > budget {
            out.push(&items[start..i]);
            (start, tokens) = (i, 0);
        }
        tokens += n;
    }
    if start < items.len() {
        out.push(&items[start..]);
    }
    out
}

/// Runs `inputs` on the calling thread in passes of at most `max_batch_tokens`: one row per input.
pub fn encode_all(runner: &mut ModelRunner, inputs: &[EncodedInput], max_batch_tokens: usize) -> Result<Vec<Vec<f32>>> {
    let items: Vec<((), &EncodedInput)> = inputs.iter().map(|i| ((), i)).collect();
    let mut out = Vec::with_capacity(inputs.len());
    for batch in batches(&items, max_batch_tokens) {
        let refs: Vec<&EncodedInput> = batch.iter().map(|(_, i)| *i).collect();
        out.extend(forward(runner, &refs)?);
    }
    Ok(out)
}

/// One forward pass over whole sequences: one output row per input.
pub fn forward(runner: &mut ModelRunner, inputs: &[&EncodedInput]) -> Result<Vec<Vec<f32>>> {
    let blocks = SeqBlocks::new();
    let chunks: Vec<SeqChunk> = inputs
        .iter()
        .map(|i| SeqChunk { blocks: &blocks, tokens: &i.ids, start_pos: 0, logits: Logits::Last })
        .collect();
    let types: Vec<&[u32]> = inputs.iter().map(|i| i.types.as_slice()).collect();
    let out = runner.forward_with_types(&chunks, &types)?;
    let dim = runner.info.output_dim;
    Ok(out.chunks(dim).map(<[f32]>::to_vec).collect())
}

impl EncoderCounters {
    /// Time spent in forward passes since start.
    pub fn compute_time(&self) -> Duration {
        Duration::from_micros(self.compute_micros.load(Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(n: usize) -> EncodedInput {
        EncodedInput { ids: vec![1; n], types: vec![0; n] }
    }

    #[test]
    fn a_pass_takes_each_requests_next_inputs_in_turn() {
        let long: Vec<EncodedInput> = (0..10).map(|_| input(3)).collect();
        let short = [input(2)];
        let picks = round_robin(&[&long, &short], 10);
        // The short request's one input joins the first pass, beside the long one's first two.
        assert_eq!(picks, [(0, 0), (1, 0), (0, 1)]);
        // Alone, a request fills the pass with its next inputs, in order.
        assert_eq!(round_robin(&[&long], 10), [(0, 0), (0, 1), (0, 2)]);
        // An input over the budget runs alone; one that no longer fits stops its request's picks.
        let big = [input(50), input(1)];
        assert_eq!(round_robin(&[&big, &short], 10), [(0, 0)]);
        assert_eq!(round_robin(&[&short, &big], 10), [(0, 0)]);
        let mixed = [input(4), input(9), input(1)];
        assert_eq!(round_robin(&[&mixed, &long], 10), [(0, 0), (1, 0), (1, 1)]);
    }

    #[test]
    fn batches_fill_the_token_budget_and_a_long_input_runs_alone() {
        let inputs = [input(3), input(3), input(3), input(10), input(1)];
        let items: Vec<(usize, &EncodedInput)> = inputs.iter().enumerate().collect();
        let sizes: Vec<usize> = batches(&items, 6).iter().map(|b| b.len()).collect();
        assert_eq!(sizes, [2, 1, 1, 1]);
        assert_eq!(batches(&items, 100).len(), 1);
    }

    #[test]
    fn llama_server_normalisations() {
        let v = [3.0f32, -4.0];
        let by = |p| {
            let mut w = v;
            normalize_by(&mut w, p);
            w
        };
        let near = |a: [f32; 2], b: [f64; 2]| a.iter().zip(b).all(|(x, y)| (*x as f64 - y).abs() <= 1e-6 * y.abs());
        assert_eq!(by(-1), v);
        assert!(near(by(0), [24570.0, -32760.0]));
        assert!(near(by(1), [3.0 / 7.0, -4.0 / 7.0]));
        assert!(near(by(2), [0.6, -0.8]));
        let cubic = (27.0f64 + 64.0).powf(1.0 / 3.0);
        assert!(near(by(3), [3.0 / cubic, -4.0 / cubic]));
        assert!(near(by(1000), [0.75, -1.0]), "a large p is the largest magnitude: {:?}", by(1000));
        assert!(near(by(i64::MAX), [0.75, -1.0]));
        let mut zero = [0.0f32; 3];
        normalize_by(&mut zero, 2);
        normalize_by(&mut zero, 5);
        assert_eq!(zero, [0.0; 3]);
    }

    #[test]
    fn shortened_vectors_keep_the_prefix_and_are_normalised_again_when_the_model_normalises() {
        let mut v = vec![0.6, 0.0, 0.8, 0.0];
        shorten(&mut v, 4, true);
        assert_eq!(v, [0.6, 0.0, 0.8, 0.0]);
        let mut a = v.clone();
        shorten(&mut a, 2, true);
        assert_eq!(a, [1.0, 0.0]);
        shorten(&mut v, 1, false);
        assert_eq!(v, [0.6]);
        assert_eq!(check_dimensions(3, 4), Ok(3));
        assert_eq!(check_dimensions(4, 4), Ok(4));
        assert!(check_dimensions(0, 4).unwrap_err().contains("at least 1"));
        assert!(check_dimensions(5, 4).unwrap_err().contains("only 4"));
    }

    #[test]
    fn relevance_is_the_sigmoid_of_the_logit() {
        assert_eq!(relevance_score(0.0), 0.5);
        assert!(relevance_score(5.0) > relevance_score(1.0));
    }
}
