//! Whisper decoding over a loaded model, as `openai-whisper`'s `transcribe` does it: the log-mel of
//! the whole recording walked in 30 s windows; per window the special-token prompt (previous text after
//! `<|startofprev|>`, then `<|startoftranscript|>`, language, task and `<|notimestamps|>` unless
//! timestamps are wanted), the encoder once, then tokens one at a time through the KV cache with the
//! logit rules (suppressed tokens, blank start, timestamp pairing); greedy first, and if the result
//! looks wrong (compression ratio above 2.4, mean log-probability below −1) again at rising temperatures,
//! where `best_of` candidates are sampled and the likeliest (sum log-probability over length) is kept.
//! The candidates of a window decode as sequences of one step, over one encoder pass whose stored
//! cross-attention keys are copied to each ([`ModelRunner::copy_state_rows`]); more candidates than
//! the runner has sequence rows decode in consecutive groups.
//!
//! A `stop` check runs before every step: when it says so, decoding ends with [`Cancelled`] and the
//! sequences are released.

use anyhow::{bail, Context, Result};
use mlxcel_audio::{MelSpectrogram, HOP_LENGTH, SAMPLE_RATE};
use rand::{Rng, SeedableRng};
use serde::Serialize;
use tokenizers::Tokenizer;

use super::vocab::{WhisperVocab, TIME_PRECISION};
use crate::engine::{Logits, ModelRunner, SeqBlocks, SeqChunk};

/// Frames per timestamp step (0.02 s = two 10 ms frames).
const INPUT_STRIDE: usize = 2;
const COMPRESSION_RATIO_THRESHOLD: f32 = 2.4;
const LOGPROB_THRESHOLD: f32 = -1.0;
const NO_SPEECH_THRESHOLD: f32 = 0.6;
/// The first timestamp may not be later than this (openai-whisper's `max_initial_timestamp`).
const MAX_INITIAL_TIMESTAMP: f32 = 1.0;
const TEMPERATURE_STEP: f32 = 0.2;
/// Candidates sampled per window at temperatures above 0 unless asked otherwise (openai-whisper's and
/// whisper.cpp's `best_of`).
pub const DEFAULT_BEST_OF: usize = 5;
/// The most `best_of` takes (each candidate is a decoding sequence; the runner's rows take them in
/// groups).
pub const MAX_BEST_OF: usize = 20;

/// What [`Transcriber::transcribe`] fails with when its `stop` check ended it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cancelled;

impl std::fmt::Display for Cancelled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the transcription was cancelled")
    }
}

impl std::error::Error for Cancelled {}

/// An option the model cannot honour: which one (`language`, `model` for a task the model lacks,
/// `timestamps`, `temperature`, `best_of`) and why, so that the server can name the request field.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct BadOption {
    pub field: &'static str,
    pub message: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum SpeechTask {
    Transcribe,
    Translate,
}

impl SpeechTask {
    pub fn parse(s: &str) -> Result<SpeechTask> {
        match s {
            "transcribe" => Ok(SpeechTask::Transcribe),
            "translate" => Ok(SpeechTask::Translate),
            other => bail!("task `{other}` is not one of transcribe, translate"),
        }
    }
}

#[derive(Debug, Clone)]
pub struct TranscribeOptions {
    /// Language code (`en`, `de`, …); `None` detects it (multilingual models) or is English.
    pub language: Option<String>,
    pub task: SpeechTask,
    /// Predict segment timestamps (otherwise each 30 s window is one segment).
    pub timestamps: bool,
    /// First temperature; on failure decoding retries up to 1.0 in steps of 0.2.
    pub temperature: f32,
    /// Candidates sampled per window at temperatures above 0 (1..=[`MAX_BEST_OF`]); the likeliest is
    /// kept. Greedy decoding (temperature 0) has one.
    pub best_of: usize,
    /// Text that conditions the first window (spelling, names, style).
    pub prompt: Option<String>,
    /// Seed for sampling at temperatures above 0.
    pub seed: u64,
}

impl Default for TranscribeOptions {
    fn default() -> Self {
        TranscribeOptions {
            language: None,
            task: SpeechTask::Transcribe,
            timestamps: false,
            temperature: 0.0,
            best_of: DEFAULT_BEST_OF,
            prompt: None,
            seed: 0,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Segment {
    pub id: usize,
    pub seek: usize,
    pub start: f32,
    pub end: f32,
    pub text: String,
    pub tokens: Vec<u32>,
    pub temperature: f32,
    pub avg_logprob: f32,
    pub compression_ratio: f32,
    pub no_speech_prob: f32,
}

#[derive(Debug, Clone, Serialize)]
pub struct Transcript {
    pub text: String,
    pub language: String,
    /// Seconds of audio.
    pub duration: f32,
    pub segments: Vec<Segment>,
}

/// One candidate's tokens (end-of-text excluded) and the sum of their log-probabilities (end-of-text
/// included when it was sampled).
struct Candidate {
    tokens: Vec<u32>,
    sum_logprob: f64,
    done: bool,
}

/// openai-whisper's `MaximumLikelihoodRanker` as `transcribe` uses it (no `length_penalty`): the
/// candidate of `(token count, sum log-probability)` whose sum divided by its count is highest, the
/// first on ties. An empty candidate scores −∞ (numpy's negative / 0) unless its sum is 0.
fn best_candidate(candidates: &[(usize, f64)]) -> usize {
    let score = |&(len, sum): &(usize, f64)| {
        if len == 0 {
            if sum < 0.0 {
                f64::NEG_INFINITY
            } else {
                0.0
            }
        } else {
            sum / len as f64
        }
    };
    let mut best = 0;
    for (i, c) in candidates.iter().enumerate().skip(1) {
        if score(c) > score(&candidates[best]) {
            best = i;
        }
    }
    best
}

/// One window's decoding.
struct Decoded {
    tokens: Vec<u32>,
    avg_logprob: f32,
    no_speech_prob: f32,
    compression_ratio: f32,
    temperature: f32,
}

/// A Whisper model ready to transcribe: the runner, its tokenizer and special tokens.
pub struct Transcriber {
    pub runner: ModelRunner,
    pub tokenizer: Tokenizer,
    pub vocab: WhisperVocab,
    mel: MelSpectrogram,
    n_mels: usize,
    /// Longest decoder sequence (prompt plus generated).
    n_text_ctx: usize,
    /// Log-mel frames of one window: twice the encoder's positions (3000, 30 s, in every released
    /// Whisper; tiny test checkpoints have shorter windows).
    n_frames: usize,
}

impl Transcriber {
    pub fn new(runner: ModelRunner, tokenizer: Tokenizer) -> Result<Transcriber> {
        let ck = &runner.checkpoint;
        let generation = std::fs::read_to_string(ck.dir.join("generation_config.json"))
            .ok()
            .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok());
        let vocab = WhisperVocab::new(&tokenizer, &ck.config, generation.as_ref(), runner.info.vocab_size)?;
        let n_mels = ck
            .config
            .get("num_mel_bins")
            .or_else(|| ck.config.get("n_mels"))
            .and_then(serde_json::Value::as_u64)
            .context("config.json has no num_mel_bins")? as usize;
        if !matches!(n_mels, 80 | 128) {
            bail!("config.json: num_mel_bins {n_mels}; Whisper's log-mel has 80 or 128 bins");
        }
        let n_text_ctx = runner.ctx_size;
        let n_frames = 2 * ck
            .config
            .get("max_source_positions")
            .or_else(|| ck.config.get("n_audio_ctx"))
            .and_then(serde_json::Value::as_u64)
            .context("config.json has no max_source_positions")? as usize;
        Ok(Transcriber { mel: MelSpectrogram::new(n_mels), runner, tokenizer, vocab, n_mels, n_text_ctx, n_frames })
    }

    /// Longest decoder sequence (prompt plus generated tokens) of a window.
    pub fn text_context(&self) -> usize {
        self.n_text_ctx
    }

    /// Refuses options this model cannot honour (translation on an English-only model, an unknown
    /// language, timestamps without timestamp tokens, a temperature outside 0..1).
    pub fn check_options(&self, opts: &TranscribeOptions) -> Result<(), BadOption> {
        let v = &self.vocab;
        let bad = |field, message: String| Err(BadOption { field, message });
        if opts.timestamps && v.timestamp_begin.is_none() {
            return bad(
                "timestamps",
                "this model's vocabulary has no timestamp tokens; transcribe without timestamps".into(),
            );
        }
        if !v.multilingual {
            if opts.task == SpeechTask::Translate {
                return bad(
                    "model",
                    "this is an English-only Whisper model: it cannot translate (use a multilingual model)".into(),
                );
            }
            if let Some(l) = opts.language.as_deref().filter(|l| *l != "en") {
                // A code no Whisper vocabulary has is named as such, not as one this model lacks.
                if !v.languages.is_empty() && v.language_token(l).is_none() {
                    return bad("language", format!("`{l}` is not a Whisper language code (such as `en`, `fr`)"));
                }
                return bad("language", "this is an English-only Whisper model: language must be `en`".into());
            }
        } else if let Some(l) = opts.language.as_deref() {
            if v.language_token(l).is_none() {
                return bad("language", format!("language `{l}` is not one of this model's languages"));
            }
        }
        if !(0.0..=1.0).contains(&opts.temperature) {
            return bad("temperature", format!("temperature {} is outside 0..1", opts.temperature));
        }
        if !(1..=MAX_BEST_OF).contains(&opts.best_of) {
            return bad("best_of", format!("best_of {} is outside 1..{MAX_BEST_OF}", opts.best_of));
        }
        Ok(())
    }

    /// Transcribes 16 kHz mono samples; `progress(done, total)` in seconds after every window. `stop`
    /// is asked before every step; when it answers true the result is the error [`Cancelled`].
    pub fn transcribe(
        &mut self,
        samples: &[f32],
        opts: &TranscribeOptions,
        progress: &mut dyn FnMut(f32, f32),
        stop: &dyn Fn() -> bool,
    ) -> Result<Transcript> {
        self.check_options(opts)?;
        let v = self.vocab.clone();
        let duration = samples.len() as f32 / SAMPLE_RATE as f32;
        // The whole recording plus a window of silence, as openai-whisper pads it; windows cut from it.
        let n_frames = self.n_frames;
        let mut padded = samples.to_vec();
        padded.extend(std::iter::repeat_n(0.0, n_frames * HOP_LENGTH));
        let (mel, frames) = self.mel.compute(&padded);
        let content_frames = frames.saturating_sub(n_frames).min(samples.len() / HOP_LENGTH);

        let mut language = opts.language.clone();
        if v.multilingual && language.is_none() {
            let window = self.window(&mel, frames, 0);
            language = Some(self.detect_language(&window, stop)?);
        }
        let language = language.unwrap_or_else(|| "en".into());

        let mut sot_sequence = vec![v.sot];
        if v.multilingual {
            sot_sequence.push(v.language_token(&language).context("language token")?);
            let task = match opts.task {
                SpeechTask::Transcribe => v.transcribe,
                SpeechTask::Translate => v.translate,
            };
            sot_sequence.push(task.context("tokenizer has no task tokens")?);
        }
        if !opts.timestamps {
            sot_sequence.push(v.no_timestamps);
        }

        let mut all_tokens: Vec<u32> = match &opts.prompt {
            Some(p) if !p.trim().is_empty() => self.encode(&format!(" {}", p.trim()))?,
            _ => Vec::new(),
        };
        let mut prompt_reset_since = 0;
        let mut segments: Vec<Segment> = Vec::new();
        let mut seek = 0usize;
        let mut rng = rand::rngs::StdRng::seed_from_u64(opts.seed);
        while seek < content_frames {
            let segment_size = n_frames.min(content_frames - seek);
            let time_offset = seek as f32 * HOP_LENGTH as f32 / SAMPLE_RATE as f32;
            let window = self.window(&mel, frames, seek);

            let mut prompt = Vec::new();
            if let Some(prev) = v.sot_prev {
                let history = &all_tokens[prompt_reset_since..];
                if !history.is_empty() {
                    let keep = (self.n_text_ctx / 2).saturating_sub(1);
                    prompt.push(prev);
                    prompt.extend_from_slice(&history[history.len().saturating_sub(keep)..]);
                }
            }
            prompt.extend_from_slice(&sot_sequence);

            let d = self.decode_with_fallback(&window, &prompt, opts, &mut rng, stop)?;
            let skip = d.no_speech_prob > NO_SPEECH_THRESHOLD && d.avg_logprob < LOGPROB_THRESHOLD;
            let segment_duration = segment_size as f32 * HOP_LENGTH as f32 / SAMPLE_RATE as f32;
            if skip {
                seek += segment_size;
            } else {
                let before = segments.len();
                seek += self.add_segments(&d, seek, segment_size, time_offset, segment_duration, &mut segments)?;
                for s in &segments[before..] {
                    all_tokens.extend_from_slice(&s.tokens);
                }
                if d.temperature > 0.5 {
                    prompt_reset_since = all_tokens.len();
                }
            }
            let done = (seek.min(content_frames) * HOP_LENGTH) as f32 / SAMPLE_RATE as f32;
            progress(done.min(duration), duration);
        }
        let text = segments.iter().map(|s| s.text.as_str()).collect::<String>();
        Ok(Transcript { text, language, duration, segments })
    }

    /// Frames `seek..seek + n_frames` as `[frames, n_mels]` rows (the encoder's input layout).
    fn window(&self, mel: &[f32], frames: usize, seek: usize) -> Vec<f32> {
        let n = self.n_frames;
        let w = mlxcel_audio::mel_window(mel, self.n_mels, seek.min(frames), n);
        let mut rows = vec![0f32; w.len()];
        for m in 0..self.n_mels {
            for t in 0..n {
                rows[t * self.n_mels + m] = w[m * n + t];
            }
        }
        rows
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.tokenizer.encode(text, false).map_err(|e| anyhow::anyhow!("tokenizing the prompt: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    fn decode_text(&self, tokens: &[u32]) -> Result<String> {
        let text: Vec<u32> = tokens.iter().copied().filter(|&t| t < self.vocab.eot).collect();
        self.tokenizer.decode(&text, true).map_err(|e| anyhow::anyhow!("decoding tokens: {e}"))
    }

    /// The most likely language token after `<|startoftranscript|>`.
    fn detect_language(&mut self, window: &[f32], stop: &dyn Fn() -> bool) -> Result<String> {
        if stop() {
            return Err(Cancelled.into());
        }
        let mut seq = SeqBlocks::default();
        let logits = self.step(&mut seq, &[self.vocab.sot], 0, Some(window));
        self.runner.pool.release(&mut seq);
        let logits = logits?;
        let best = self
            .vocab
            .languages
            .iter()
            .max_by(|a, b| logits[a.1 as usize].total_cmp(&logits[b.1 as usize]))
            .context("the tokenizer has no language tokens")?;
        Ok(best.0.clone())
    }

    /// One forward step of `tokens` at `start`, with the encoder when `features` come along.
    fn step(
        &mut self,
        seq: &mut SeqBlocks,
        tokens: &[u32],
        start: usize,
        features: Option<&[f32]>,
    ) -> Result<Vec<f32>> {
        self.runner.pool.reserve(seq, start + tokens.len())?;
        let chunk = SeqChunk { blocks: seq, tokens, start_pos: start, logits: Logits::Last };
        match features {
            Some(f) => self.runner.forward_with_features(&[chunk], &[f], self.n_mels),
            None => self.runner.forward(&[chunk]),
        }
    }

    fn decode_with_fallback(
        &mut self,
        window: &[f32],
        prompt: &[u32],
        opts: &TranscribeOptions,
        rng: &mut rand::rngs::StdRng,
        stop: &dyn Fn() -> bool,
    ) -> Result<Decoded> {
        let mut temperature = opts.temperature;
        loop {
            // As openai-whisper: greedy is one candidate, sampling `best_of`.
            let n = if temperature > 0.0 { opts.best_of.max(1) } else { 1 };
            let d = self.decode_window(window, prompt, temperature, n, opts.timestamps, rng, stop)?;
            tracing::debug!(
                temperature,
                candidates = n,
                tokens = d.tokens.len(),
                avg_logprob = d.avg_logprob,
                compression_ratio = d.compression_ratio,
                no_speech_prob = d.no_speech_prob,
                "decoded a window"
            );
            let failed = d.compression_ratio > COMPRESSION_RATIO_THRESHOLD || d.avg_logprob < LOGPROB_THRESHOLD;
            let silence = d.no_speech_prob > NO_SPEECH_THRESHOLD && d.avg_logprob < LOGPROB_THRESHOLD;
            if !failed || silence || temperature + 1e-6 >= 1.0 {
                return Ok(d);
            }
            temperature = (temperature + TEMPERATURE_STEP).min(1.0);
            tracing::debug!("window decoding failed its thresholds; retrying at temperature {temperature:.1}");
        }
    }

    /// `n` candidates for one window at `temperature`, in groups of as many sequences as the runner
    /// has state rows; the likeliest is returned ([`best_candidate`]).
    #[allow(clippy::too_many_arguments)]
    fn decode_window(
        &mut self,
        window: &[f32],
        prompt: &[u32],
        temperature: f32,
        n: usize,
        timestamps: bool,
        rng: &mut rand::rngs::StdRng,
        stop: &dyn Fn() -> bool,
    ) -> Result<Decoded> {
        let group = self.runner.pool.state_slots.max(1);
        let mut candidates: Vec<Candidate> = Vec::with_capacity(n);
        let mut no_speech_prob = 0.0;
        while candidates.len() < n {
            let m = group.min(n - candidates.len());
            let mut seqs: Vec<SeqBlocks> = (0..m).map(|_| SeqBlocks::default()).collect();
            let r = self.decode_group(&mut seqs, window, prompt, temperature, timestamps, rng, stop);
            for s in &mut seqs {
                self.runner.pool.release(s);
            }
            let (p, c) = r?;
            no_speech_prob = p;
            candidates.extend(c);
        }
        let scores: Vec<(usize, f64)> = candidates.iter().map(|c| (c.tokens.len(), c.sum_logprob)).collect();
        let best = candidates.swap_remove(best_candidate(&scores));
        let text = self.decode_text(&best.tokens)?;
        Ok(Decoded {
            avg_logprob: (best.sum_logprob / (best.tokens.len() + 1) as f64) as f32,
            compression_ratio: compression_ratio(&text),
            tokens: best.tokens,
            no_speech_prob,
            temperature,
        })
    }

    /// One candidate per sequence of `seqs`, decoded together: the encoder once (with the first
    /// sequence's prompt up to `<|startoftranscript|>`, whose logits give P(no speech)), its stored
    /// keys copied to the others, then every prompt's rest and every sampled token in shared steps.
    #[allow(clippy::too_many_arguments)]
    fn decode_group(
        &mut self,
        seqs: &mut [SeqBlocks],
        window: &[f32],
        prompt: &[u32],
        temperature: f32,
        timestamps: bool,
        rng: &mut rand::rngs::StdRng,
        stop: &dyn Fn() -> bool,
    ) -> Result<(f32, Vec<Candidate>)> {
        let v = self.vocab.clone();
        let out_dim = self.runner.info.output_dim;
        let sot_at = prompt.iter().position(|&t| t == v.sot).context("prompt without <|startoftranscript|>")?;
        if stop() {
            return Err(Cancelled.into());
        }
        let first = self.step(&mut seqs[0], &prompt[..=sot_at], 0, Some(window))?;
        let no_speech_prob = match v.no_speech {
            Some(ns) => softmax_at(&first, ns as usize),
            None => 0.0,
        };
        for s in seqs.iter_mut() {
            self.runner.pool.reserve(s, prompt.len())?;
        }
        for k in 1..seqs.len() {
            self.runner.copy_state_rows(&seqs[0], &seqs[k])?;
        }
        // The first sequence's rest of the prompt; the others' whole prompt over the copied keys.
        let rest = &prompt[sot_at + 1..];
        let mut chunks = Vec::with_capacity(seqs.len());
        if !rest.is_empty() {
            chunks.push(SeqChunk { blocks: &seqs[0], tokens: rest, start_pos: sot_at + 1, logits: Logits::Last });
        }
        for s in &seqs[1..] {
            chunks.push(SeqChunk { blocks: s, tokens: prompt, start_pos: 0, logits: Logits::Last });
        }
        let out = if chunks.is_empty() { Vec::new() } else { self.runner.forward(&chunks)? };
        let mut rows = out.chunks_exact(out_dim).map(<[f32]>::to_vec);
        let mut logits: Vec<Vec<f32>> = Vec::with_capacity(seqs.len());
        logits.push(if rest.is_empty() { first } else { rows.next().context("internal: missing logits")? });
        logits.extend(rows);
        if logits.len() != seqs.len() {
            bail!("internal: {} logit rows for {} candidates", logits.len(), seqs.len());
        }

        let sample_begin = prompt.len();
        let sample_len = (self.n_text_ctx / 2).min(self.n_text_ctx.saturating_sub(sample_begin));
        let mut cands: Vec<Candidate> =
            (0..seqs.len()).map(|_| Candidate { tokens: Vec::new(), sum_logprob: 0.0, done: false }).collect();
        for _ in 0..sample_len {
            let mut stepping: Vec<(usize, u32, usize)> = Vec::new(); // candidate, token, position
            for (k, c) in cands.iter_mut().enumerate().filter(|(_, c)| !c.done) {
                self.apply_rules(&mut logits[k], &c.tokens, timestamps);
                let logprobs = log_softmax(&logits[k]);
                let next = if temperature == 0.0 { argmax(&logits[k]) } else { sample(&logits[k], temperature, rng) };
                c.sum_logprob += logprobs[next as usize] as f64;
                if next == v.eot {
                    c.done = true;
                    continue;
                }
                c.tokens.push(next);
                let pos = sample_begin + c.tokens.len() - 1;
                if pos + 1 >= self.n_text_ctx {
                    c.done = true;
                    continue;
                }
                stepping.push((k, next, pos));
            }
            if stepping.is_empty() {
                break;
            }
            if stop() {
                return Err(Cancelled.into());
            }
            for &(k, _, pos) in &stepping {
                self.runner.pool.reserve(&mut seqs[k], pos + 1)?;
            }
            let next: Vec<[u32; 1]> = stepping.iter().map(|&(_, t, _)| [t]).collect();
            let chunks: Vec<SeqChunk> = stepping
                .iter()
                .zip(&next)
                .map(|(&(k, _, pos), t)| SeqChunk { blocks: &seqs[k], tokens: t, start_pos: pos, logits: Logits::Last })
                .collect();
            let out = self.runner.forward(&chunks)?;
            for (&(k, _, _), row) in stepping.iter().zip(out.chunks_exact(out_dim)) {
                logits[k] = row.to_vec();
            }
        }
        Ok((no_speech_prob, cands))
    }

    /// openai-whisper's logit filters: suppress blank and end-of-text first, suppressed tokens, and
    /// with timestamps its pairing / monotonicity / initial-timestamp rules.
    fn apply_rules(&self, logits: &mut [f32], tokens: &[u32], timestamps: bool) {
        let v = &self.vocab;
        let ninf = f32::NEG_INFINITY;
        let kill = |t: u32, l: &mut [f32]| {
            if let Some(x) = l.get_mut(t as usize) {
                *x = ninf;
            }
        };
        if tokens.is_empty() {
            for &t in &v.begin_suppress {
                kill(t, logits);
            }
        }
        for &t in &v.suppress {
            kill(t, logits);
        }
        let Some(tb) = v.timestamp_begin else { return };
        let (tb, n) = (tb as usize, logits.len());
        if !timestamps {
            // Without timestamps none may be sampled.
            logits[tb.min(n)..].fill(ninf);
            return;
        }
        kill(v.no_timestamps, logits);
        let last_ts = tokens.last().is_some_and(|&t| v.is_timestamp(t));
        let penultimate_ts = tokens.len() < 2 || v.is_timestamp(tokens[tokens.len() - 2]);
        if last_ts {
            if penultimate_ts {
                logits[tb..].fill(ninf);
            } else {
                logits[..v.eot as usize].fill(ninf);
            }
        }
        if let Some(&last) = tokens.iter().rev().find(|&&t| v.is_timestamp(t)) {
            let floor = if last_ts && !penultimate_ts { last as usize } else { last as usize + 1 };
            logits[tb..floor.min(n).max(tb)].fill(ninf);
        }
        if tokens.is_empty() {
            logits[..tb].fill(ninf);
            let last_allowed = tb + (MAX_INITIAL_TIMESTAMP / TIME_PRECISION).round() as usize;
            if last_allowed + 1 < n {
                logits[last_allowed + 1..].fill(ninf);
            }
        }
        // If the timestamps together are likelier than any text token, sample a timestamp.
        let lp = log_softmax(logits);
        let ts_mass = log_sum_exp(&lp[tb..]);
        let text_max = lp[..tb].iter().copied().fold(ninf, f32::max);
        if ts_mass > text_max {
            logits[..tb].fill(ninf);
        }
    }

    /// Segments of one decoded window; returns how many frames to move on.
    fn add_segments(
        &self,
        d: &Decoded,
        seek: usize,
        segment_size: usize,
        time_offset: f32,
        segment_duration: f32,
        out: &mut Vec<Segment>,
    ) -> Result<usize> {
        let v = &self.vocab;
        let toks = &d.tokens;
        let is_ts: Vec<bool> = toks.iter().map(|&t| v.is_timestamp(t)).collect();
        let ts_time = |t: u32| (t - v.timestamp_begin.unwrap_or(0)) as f32 * TIME_PRECISION;
        let single_ending = is_ts.len() >= 2 && !is_ts[is_ts.len() - 2] && is_ts[is_ts.len() - 1];
        let mut consecutive: Vec<usize> = (1..is_ts.len()).filter(|&i| is_ts[i - 1] && is_ts[i]).collect();
        let mut push = |tokens: &[u32], start: f32, end: f32| -> Result<()> {
            let text = self.decode_text(tokens)?;
            if text.trim().is_empty() && tokens.iter().all(|&t| v.is_timestamp(t)) {
                return Ok(());
            }
            // Whole milliseconds: 160 × 0.02 is 3.1999998 in f32, and the formats print what they get.
            let ms = |s: f32| (s * 1000.0).round() / 1000.0;
            out.push(Segment {
                id: out.len(),
                seek,
                start: ms(start),
                end: ms(end),
                text,
                tokens: tokens.to_vec(),
                temperature: d.temperature,
                avg_logprob: d.avg_logprob,
                compression_ratio: d.compression_ratio,
                no_speech_prob: d.no_speech_prob,
            });
            Ok(())
        };
        if !consecutive.is_empty() {
            if single_ending {
                consecutive.push(toks.len());
            }
            let mut last = 0;
            for &cur in &consecutive {
                let sliced = &toks[last..cur];
                push(sliced, time_offset + ts_time(sliced[0]), time_offset + ts_time(sliced[sliced.len() - 1]))?;
                last = cur;
            }
            if single_ending {
                Ok(segment_size)
            } else {
                Ok((ts_time(toks[last - 1]) / TIME_PRECISION).round() as usize * INPUT_STRIDE)
            }
        } else {
            let mut duration = segment_duration;
            if let Some(&t) = toks.iter().rev().find(|&&t| v.is_timestamp(t)) {
                if Some(t) != v.timestamp_begin {
                    duration = ts_time(t);
                }
            }
            push(toks, time_offset, time_offset + duration)?;
            Ok(segment_size)
        }
    }
}

fn argmax(x: &[f32]) -> u32 {
    x.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1).then(b.0.cmp(&a.0))).map_or(0, |(i, _)| i as u32)
}

fn log_sum_exp(x: &[f32]) -> f32 {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if m == f32::NEG_INFINITY {
        return m;
    }
    m + x.iter().map(|&v| ((v - m) as f64).exp()).sum::<f64>().ln() as f32
}

fn log_softmax(x: &[f32]) -> Vec<f32> {
    let lse = log_sum_exp(x);
    x.iter().map(|&v| v - lse).collect()
}

fn softmax_at(x: &[f32], i: usize) -> f32 {
    x.get(i).map_or(0.0, |&v| (v - log_sum_exp(x)).exp())
}

fn sample(logits: &[f32], temperature: f32, rng: &mut rand::rngs::StdRng) -> u32 {
    let scaled: Vec<f32> = logits.iter().map(|&l| l / temperature).collect();
    let lse = log_sum_exp(&scaled);
    let mut u: f64 = rng.gen();
    for (i, &s) in scaled.iter().enumerate() {
        u -= ((s - lse) as f64).exp();
        if u <= 0.0 {
            return i as u32;
        }
    }
    argmax(logits)
}

/// `len(text) / len(zlib.compress(text))` over UTF-8 bytes: repetitive (looping) output compresses well.
pub fn compression_ratio(text: &str) -> f32 {
    use std::io::Write;
    let bytes = text.as_bytes();
    if bytes.is_empty() {
        return 0.0;
    }
    let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
    let _ = z.write_all(bytes);
    let compressed = z.finish().map(|c| c.len()).unwrap_or(bytes.len());
    bytes.len() as f32 / compressed.max(1) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repetitive_text_has_a_high_compression_ratio() {
        let looping = "the cat sat on the mat. ".repeat(20);
        assert!(compression_ratio(&looping) > COMPRESSION_RATIO_THRESHOLD);
        assert!(compression_ratio("This is a speech recognition test.") < COMPRESSION_RATIO_THRESHOLD);
        assert_eq!(compression_ratio(""), 0.0);
    }

    #[test]
    fn the_likeliest_candidate_per_token_wins() {
        // Sum log-probability over token count: -3/6 = -0.5 beats -2/2 = -1 though its sum is lower.
        assert_eq!(best_candidate(&[(2, -2.0), (6, -3.0), (4, -4.0)]), 1);
        // Ties keep the first; a lone candidate is chosen.
        assert_eq!(best_candidate(&[(2, -1.0), (4, -2.0)]), 0);
        assert_eq!(best_candidate(&[(3, -9.0)]), 0);
        // An empty candidate (end-of-text first) loses to any scored one, and wins when all are empty.
        assert_eq!(best_candidate(&[(0, -0.1), (10, -50.0)]), 1);
        assert_eq!(best_candidate(&[(0, -0.1), (0, -0.2)]), 0);
    }

    #[test]
    fn log_softmax_sums_to_one_and_ignores_suppressed_entries() {
        let lp = log_softmax(&[1.0, 2.0, f32::NEG_INFINITY, 0.5]);
        let total: f32 = lp.iter().map(|v| v.exp()).sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert_eq!(argmax(&[0.1, 3.0, 3.0]), 1);
    }
}
