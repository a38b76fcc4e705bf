//! How much memory a model needs at a context size and parallelism, before anything is loaded:
//! weights exactly (safetensors payload bytes), KV caches as [`KvPlan`] will allocate them (full
//! layers for the whole context, sliding-window layers for their window), and an estimate of
//! activations and workspace — against the memory the backend's device says is free.

use mlxcel_plugin_api::KvKind;
use mlxcel_plugins::ModelInfo;
use serde::Serialize;

use super::kv_plan::{KvCacheTypes, KvPlan};

/// A loaded Hugging Face tokenizer's resident bytes per byte of its `tokenizer.json`: 8.7–12× on
/// the files measured (Gemma 3's 33 MB file, 262k tokens and 6k added ones, holds 290 MB; SmolLM2's
/// 1.5 MB, 19 MB; whisper-tiny's 2.1 MB, 21 MB), so ten.
pub const TOKENIZER_BYTES_PER_FILE_BYTE: u64 = 10;

/// Prompt tokens computed per step (activations scale with it).
pub const PREFILL_CHUNK: u64 = 512;

/// Most bytes of logits rows a step brings back to score prompts (`echo` with `logprobs`), all the
/// scored prompts of the step together: they are computed in chunks of as many rows as fit (at
/// least one).
pub const SCORING_ROWS_BYTES: u64 = 32 * 1024 * 1024;

/// The scored prompt tokens of one step for a vocabulary of `vocab` logits.
pub fn scoring_chunk(vocab: usize) -> usize {
    (SCORING_ROWS_BYTES as usize / (vocab.max(1) * 4)).max(1)
}

#[derive(Debug, Clone, Serialize)]
pub struct MemoryEstimate {
    pub weight_bytes: u64,
    pub kv_bytes: u64,
    pub kv_bytes_per_token: u64,
    /// What the K and V caches keep (`f32`, `f16`, `bf16`).
    pub cache_type_k: &'static str,
    pub cache_type_v: &'static str,
    pub activation_bytes: u64,
    /// The tokenizer in memory (an estimate from its file, see [`TOKENIZER_BYTES_PER_FILE_BYTE`]).
    pub tokenizer_bytes: u64,
    pub total_bytes: u64,
    pub available_bytes: u64,
    pub fits: bool,
    pub ctx_size: u64,
    pub parallel: u64,
    /// Full contexts of KV the sequences share (`parallel` unless fewer).
    pub pool_seqs: u64,
}

impl MemoryEstimate {
    /// `available` is the free memory of the device the model will run on (the backend's own report;
    /// 0 = unknown, which never refuses).
    pub fn new(
        info: &ModelInfo,
        weight_bytes: u64,
        ctx_size: u64,
        parallel: u64,
        pool_seqs: u64,
        available: u64,
        cache_types: KvCacheTypes,
    ) -> MemoryEstimate {
        let parallel = parallel.max(1);
        let per_token: u64 = info
            .kv_layers
            .iter()
            .filter(|l| matches!(l.kind, KvKind::Full | KvKind::SlidingWindow))
            .map(|l| cache_types.bytes_per_token(l.n_kv_heads, l.head_dim) as u64)
            .sum();
        let plan =
            KvPlan::new(info, ctx_size as usize, 16, parallel as usize, PREFILL_CHUNK as usize, pool_seqs as usize);
        let kv_bytes = plan.bytes(info, cache_types);
        // One prefill chunk of activations plus the logits rows (one per sequence, and a scored
        // prompt's), plus CPU-side scratch slack.
        let chunk = PREFILL_CHUNK.min(ctx_size.max(1));
        let logits_bytes = info.vocab_size as u64 * 4 * parallel + SCORING_ROWS_BYTES;
        let activation_bytes = info.activation_bytes_per_token * chunk * 2 + logits_bytes + 16 * 1024 * 1024;
        let total = weight_bytes + kv_bytes + activation_bytes;
        MemoryEstimate {
            weight_bytes,
            kv_bytes,
            kv_bytes_per_token: per_token,
            cache_type_k: cache_types.k.name(),
            cache_type_v: cache_types.v.name(),
            activation_bytes,
            tokenizer_bytes: 0,
            total_bytes: total,
            available_bytes: available,
            fits: available == 0 || total <= available,
            ctx_size,
            parallel,
            pool_seqs: pool_seqs.clamp(1, parallel),
        }
    }

    /// Counts the tokenizer of the model in `dir` (its `tokenizer.json`; none where there is none).
    pub fn with_tokenizer(mut self, dir: &std::path::Path) -> MemoryEstimate {
        let file = std::fs::metadata(dir.join("tokenizer.json")).map_or(0, |m| m.len());
        self.tokenizer_bytes = file * TOKENIZER_BYTES_PER_FILE_BYTE;
        self.total_bytes += self.tokenizer_bytes;
        self.fits = self.available_bytes == 0 || self.total_bytes <= self.available_bytes;
        self
    }

    /// One line for an error or a report.
    pub fn summary(&self) -> String {
        let mb = |b: u64| b as f64 / 1e6;
        format!(
            "needs {:.0} MB (weights {:.0} MB + KV cache {:.0} MB for {} tokens × {}{} + activations {:.0} MB + tokenizer {:.0} MB), {:.0} MB available",
            mb(self.total_bytes),
            mb(self.weight_bytes),
            mb(self.kv_bytes),
            self.ctx_size,
            self.pool_seqs,
            if self.pool_seqs < self.parallel { format!(" shared by {} sequences", self.parallel) } else { String::new() },
            mb(self.activation_bytes),
            mb(self.tokenizer_bytes),
            mb(self.available_bytes)
        )
    }
}
