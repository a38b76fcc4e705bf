//! One conversation's generation loop on a [`ModelRunner`]: prefill the prompt in chunks (reusing the
//! KV of whatever prefix the previous turn left), then sample token by token, streaming text through
//! the detokenizer and the stop-string matcher.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};

use super::kv_cache::SeqBlocks;
use super::runner::{Logits, ModelRunner, RowsWanted, SeqChunk, StepRows};
use super::sampling::{DryBreakers, Sampler, SamplingParams, TokenTexts};
use super::streaming_text::StreamingText;
use crate::text::TextTokenizer;

#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// Prompt tokens per prefill step.
    pub prefill_chunk: usize,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            sampling: SamplingParams::default(),
            max_tokens: 256,
            stop: vec![],
            ignore_eos: false,
            prefill_chunk: 512,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS or a stop string.
    Stop,
    /// `max_tokens` or the context size.
    Length,
    /// Interrupted by the user, a vanished client or a timeout.
    Cancelled,
}

#[derive(Debug, Clone, Default)]
pub struct GenerationStats {
    /// Prompt tokens computed (the reused prefix is not counted).
    pub prompt_tokens: usize,
    pub prompt_reused: usize,
    pub prompt_time: Duration,
    pub generated_tokens: usize,
    pub generation_time: Duration,
}

impl GenerationStats {
    pub fn prompt_tps(&self) -> f64 {
        self.prompt_tokens as f64 / self.prompt_time.as_secs_f64().max(1e-9)
    }
    pub fn generation_tps(&self) -> f64 {
        // The first generated token comes from the prefill; the rest each cost a decode step.
        self.generated_tokens.saturating_sub(1) as f64 / self.generation_time.as_secs_f64().max(1e-9)
    }
}

#[derive(Debug, Clone)]
pub struct Generation {
    pub text: String,
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
    pub stats: GenerationStats,
}

/// A conversation's KV state: the tokens whose keys and values are cached, and their blocks.
#[derive(Default)]
pub struct Session {
    blocks: SeqBlocks,
    cached: Vec<u32>,
    /// The runner's state epoch the cached blocks belong to (see [`ModelRunner::state_epoch`]).
    epoch: u64,
}

impl Session {
    pub fn new() -> Self {
        Self::default()
    }

    /// Forgets the cached context (returns its blocks).
    pub fn clear(&mut self, runner: &mut ModelRunner) {
        runner.pool.release(&mut self.blocks);
        self.cached.clear();
    }

    /// Runs `prompt` and samples up to `max_tokens`, calling `on_text` with each new piece of text.
    pub fn generate(
        &mut self,
        runner: &mut ModelRunner,
        tokenizer: &TextTokenizer,
        prompt: &[u32],
        opts: &GenerateOptions,
        cancel: &AtomicBool,
        on_text: &mut dyn FnMut(&str),
    ) -> Result<Generation> {
        opts.sampling.validate().map_err(|e| anyhow::anyhow!(e))?;
        if prompt.is_empty() {
            bail!("the prompt is empty");
        }
        if prompt.len() >= runner.ctx_size {
            bail!(
                "the prompt has {} tokens but the context size is {}; shorten it or raise --ctx-size",
                prompt.len(),
                runner.ctx_size
            );
        }
        let vocab = runner.info.vocab_size;
        let mut stats = GenerationStats::default();
        if self.epoch != runner.state_epoch {
            // The runner rebuilt its device state after a plugin panic: our pages are gone with it.
            self.blocks = SeqBlocks::default();
            self.cached.clear();
            self.epoch = runner.state_epoch;
        }

        // Reuse the cached prefix; at least one prompt token is computed to get logits.
        let mut common = self.cached.iter().zip(prompt).take_while(|(a, b)| a == b).count();
        common = common.min(prompt.len() - 1);
        // A model with sliding windows or recurrent state may not be able to cut back: it says how
        // much it kept.
        common = runner.pool.truncate(&mut self.blocks, common);
        self.cached.truncate(common);
        stats.prompt_reused = common;

        let t0 = Instant::now();
        let mut sampler = Sampler::new(opts.sampling.clone());
        if let Some(breakers) = opts.sampling.dry_breakers_needed() {
            let table = DryBreakers::new(tokenizer, &TokenTexts::new(tokenizer), breakers);
            sampler = sampler.with_dry_breakers(std::sync::Arc::new(table));
        }
        // Greedy and top-k sampling need only a row's largest logits: the backend selects them.
        let want = sampler.top_k_needed().map_or(RowsWanted::Full, RowsWanted::Top);
        let mut rows = StepRows::Full(Vec::new());
        let chunk = opts.prefill_chunk.max(1);
        let mut pos = common;
        while pos < prompt.len() {
            let end = (pos + chunk).min(prompt.len());
            runner.pool.reserve(&mut self.blocks, end)?;
            let logits = if end == prompt.len() { Logits::Last } else { Logits::None };
            rows = run_step(runner, &self.blocks, &prompt[pos..end], pos, logits, want)?;
            self.cached.extend_from_slice(&prompt[pos..end]);
            self.blocks.len = end;
            pos = end;
            if cancel.load(Ordering::Relaxed) {
                return Ok(Generation { text: String::new(), tokens: vec![], finish: FinishReason::Cancelled, stats });
            }
        }
        stats.prompt_tokens = prompt.len() - common;
        stats.prompt_time = t0.elapsed();

        let t1 = Instant::now();
        let mut history: Vec<u32> = prompt.to_vec();
        let mut generated = Vec::new();
        let mut text = String::new();
        let mut out = StreamingText::new(&opts.stop, opts.ignore_eos, opts.max_tokens);
        let finish = loop {
            if out.exhausted() {
                break FinishReason::Length;
            }
            if cancel.load(Ordering::Relaxed) {
                break FinishReason::Cancelled;
            }
            let next = match &mut rows {
                StepRows::Full(logits) if logits.len() >= vocab => sampler.sample(&mut logits[..vocab], &history),
                StepRows::Top { ids, values, .. } if !ids.is_empty() => sampler.sample_top(ids, values, &history),
                _ => bail!("internal: the model returned no logits"),
            };
            let step = out.push(tokenizer, next).map_err(|e| anyhow::anyhow!(e))?;
            if step.accepted {
                generated.push(next);
                history.push(next);
            }
            on_text(&step.text);
            text.push_str(&step.text);
            if let Some(finish) = step.finish {
                break finish;
            }
            let p = self.cached.len();
            if p + 1 >= runner.ctx_size {
                break FinishReason::Length;
            }
            runner.pool.reserve(&mut self.blocks, p + 1)?;
            rows = run_step(runner, &self.blocks, &[next], p, Logits::Last, want)?;
            self.cached.push(next);
            self.blocks.len = p + 1;
        };
        // Ended from outside the text (context, cancel): what was held back as a possible stop-string
        // prefix belongs to the answer. (A token that ended it has already released its text.)
        let rest = out.flush(tokenizer);
        on_text(&rest);
        text.push_str(&rest);
        stats.generated_tokens = generated.len();
        stats.generation_time = t1.elapsed();
        Ok(Generation { text, tokens: generated, finish, stats })
    }
}

/// One sequence's step through the runner.
fn run_step(
    runner: &mut ModelRunner,
    blocks: &SeqBlocks,
    tokens: &[u32],
    start_pos: usize,
    logits: Logits,
    want: RowsWanted,
) -> Result<StepRows> {
    runner.submit(&[SeqChunk { blocks, tokens, start_pos, logits }], want)?;
    runner.wait()
}
