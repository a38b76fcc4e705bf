//! How a model's per-sequence state is laid out before anything is allocated: which layers share a KV
//! group, how many blocks each group gets, and the bytes that makes. The runner allocates from it and
//! the memory estimate counts from it, so the fit check counts what will actually be allocated.

use mlxcel_plugin_api::{DType, KvKind};
use mlxcel_plugins::ModelInfo;

/// What a KV cache keeps its values in, named as llama.cpp's `--cache-type-k/-v` name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvCacheType {
    F32,
    F16,
    Bf16,
}

impl KvCacheType {
    pub const ALL: [KvCacheType; 3] = [KvCacheType::F32, KvCacheType::F16, KvCacheType::Bf16];

    pub fn dtype(self) -> DType {
        match self {
            KvCacheType::F32 => DType::F32,
            KvCacheType::F16 => DType::F16,
            KvCacheType::Bf16 => DType::BF16,
        }
    }

    pub fn bytes(self) -> usize {
        self.dtype().size()
    }

    /// Of two types, the one that rounds more (bf16, then f16, then f32).
    pub fn coarser(self, other: KvCacheType) -> KvCacheType {
        let rank = |t: KvCacheType| match t {
            KvCacheType::F32 => 0,
            KvCacheType::F16 => 1,
            KvCacheType::Bf16 => 2,
        };
        if rank(other) > rank(self) {
            other
        } else {
            self
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvCacheType::F32 => "f32",
            KvCacheType::F16 => "f16",
            KvCacheType::Bf16 => "bf16",
        }
    }
}

impl std::fmt::Display for KvCacheType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KvCacheType {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(KvCacheType::F32),
            "f16" => Ok(KvCacheType::F16),
            "bf16" => Ok(KvCacheType::Bf16),
            q if q.starts_with('q') || q.starts_with("iq") => {
                Err(format!("quantized KV caches ({s}) are not supported yet; use f32, f16 or bf16"))
            }
            _ => Err(format!("`{s}` is not a KV cache type; use f32, f16 or bf16")),
        }
    }
}

/// The types of a model's K and V caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheTypes {
    pub k: KvCacheType,
    pub v: KvCacheType,
}

impl KvCacheTypes {
    /// Half the memory of f32 at the precision the checkpoints are trained in (llama.cpp's default).
    pub const DEFAULT: KvCacheTypes = KvCacheTypes { k: KvCacheType::F16, v: KvCacheType::F16 };
    pub const F32: KvCacheTypes = KvCacheTypes { k: KvCacheType::F32, v: KvCacheType::F32 };

    /// Bytes of one token's K and V rows in a layer of `n_kv_heads` × `head_dim`.
    pub fn bytes_per_token(self, n_kv_heads: usize, head_dim: usize) -> usize {
        n_kv_heads * head_dim * (self.k.bytes() + self.v.bytes())
    }
}

impl std::fmt::Display for KvCacheTypes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "K {} / V {}", self.k, self.v)
    }
}

/// The KV groups and state rows of a model at a context size and parallelism.
#[derive(Debug, Clone, PartialEq)]
pub struct KvPlan {
    pub block_size: usize,
    pub max_blocks_per_seq: usize,
    /// Window of each group (0 = full attention); group 0 is the full-attention group when there is one.
    pub windows: Vec<usize>,
    /// Blocks of each group, all sequences together.
    pub blocks_per_group: Vec<usize>,
    /// The group of each layer (`None` for layers without KV).
    pub layer_group: Vec<Option<u32>>,
    /// Rows of recurrent state per stateful layer (one per sequence in flight; 0 if none).
    pub state_slots: usize,
}

impl KvPlan {
    /// Plans caches for `parallel` sequences of up to `ctx_size` tokens that bring at most
    /// `max_step_tokens` tokens to one step: full-attention layers get `ctx_size` per sequence — or
    /// `ctx_size × pool_seqs` shared by all, where `pool_seqs` is fewer (llama-server's unified KV:
    /// a sequence may still reach `ctx_size`, and the scheduler preempts when pages run out); a
    /// sliding-window group only its window plus one step's tokens per sequence (pages behind it are
    /// released).
    pub fn new(
        info: &ModelInfo,
        ctx_size: usize,
        block_size: usize,
        parallel: usize,
        max_step_tokens: usize,
        pool_seqs: usize,
    ) -> Self {
        let block_size = block_size.max(1);
        let parallel = parallel.max(1);
        let pool_seqs = pool_seqs.clamp(1, parallel);
        let max_blocks_per_seq = ctx_size.div_ceil(block_size);
        let window_of = |kind: KvKind, window: usize| match kind {
            KvKind::SlidingWindow if window > 0 && window < ctx_size => window,
            _ => 0,
        };
        let attention = || info.kv_layers.iter().filter(|l| matches!(l.kind, KvKind::Full | KvKind::SlidingWindow));
        let mut windows: Vec<usize> = Vec::new();
        if attention().any(|l| window_of(l.kind, l.window) == 0) {
            windows.push(0);
        }
        for l in attention() {
            let w = window_of(l.kind, l.window);
            if w > 0 && !windows.contains(&w) {
                windows.push(w);
            }
        }
        let blocks_per_group = windows
            .iter()
            .map(|&w| match w {
                0 => max_blocks_per_seq * pool_seqs,
                w => ((w + max_step_tokens.max(1)).div_ceil(block_size) + 1).min(max_blocks_per_seq) * parallel,
            })
            .collect();
        let layer_group = info
            .kv_layers
            .iter()
            .map(|l| match l.kind {
                KvKind::Full | KvKind::SlidingWindow => {
                    let w = window_of(l.kind, l.window);
                    Some(windows.iter().position(|&g| g == w).unwrap_or(0) as u32)
                }
                _ => None,
            })
            .collect();
        let state_slots = if info.kv_layers.iter().any(|l| l.kind == KvKind::Recurrent) { parallel } else { 0 };
        KvPlan { block_size, max_blocks_per_seq, windows, blocks_per_group, layer_group, state_slots }
    }

    /// Bytes of every KV cache and state buffer this plan allocates (f32 caches).
    pub fn bytes(&self, info: &ModelInfo, types: KvCacheTypes) -> u64 {
        info.kv_layers
            .iter()
            .zip(&self.layer_group)
            .map(|(l, g)| match (l.kind, g) {
                (KvKind::Recurrent, _) => (self.state_slots * l.state_elems * 4) as u64,
                (_, Some(g)) => {
                    let slots = self.blocks_per_group[*g as usize] * self.block_size;
                    (slots * types.bytes_per_token(l.n_kv_heads, l.head_dim)) as u64
                }
                _ => 0,
            })
            .sum()
    }
}
