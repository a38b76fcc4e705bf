//! How much memory a model needs at a context size and parallelism, before anything is loaded:
//! weights exactly (safetensors payload bytes), KV cache from the family's per-layer description,
//! and an estimate of activations and workspace.

use mlxcel_plugin_api::KvKind;
use mlxcel_plugins::ModelInfo;
use serde::Serialize;

/// Bytes per KV element in this engine's cache (f32).
pub const KV_ELEMENT_BYTES: u64 = 4;
/// Prompt tokens computed per step (activations scale with it).
pub const PREFILL_CHUNK: u64 = 512;

#[derive(Debug, Clone, Serialize)]
pub struct MemoryEstimate {
    pub weight_bytes: u64,
    pub kv_bytes: u64,
    pub kv_bytes_per_token: u64,
    pub activation_bytes: u64,
    pub total_bytes: u64,
    pub available_bytes: u64,
    pub fits: bool,
    pub ctx_size: u64,
    pub parallel: u64,
}

/// `MemAvailable` from /proc/meminfo (0 where unknown).
pub fn available_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

impl MemoryEstimate {
    pub fn new(info: &ModelInfo, weight_bytes: u64, ctx_size: u64, parallel: u64) -> MemoryEstimate {
        let parallel = parallel.max(1);
        let mut per_token = 0u64;
        let mut kv = 0u64;
        for l in &info.kv_layers {
            let row = 2 * l.n_kv_heads as u64 * l.head_dim as u64 * KV_ELEMENT_BYTES;
            match l.kind {
                // The engine pages sliding-window layers like full ones today: count what it allocates.
                KvKind::Full | KvKind::SlidingWindow => {
                    per_token += row;
                    kv += row * ctx_size;
                }
                KvKind::Recurrent => kv += 4 * l.state_elems as u64,
                KvKind::None => {}
            }
        }
        let kv_bytes = kv * parallel;
        // One prefill chunk of activations plus the logits rows, plus CPU-side scratch slack.
        let chunk = PREFILL_CHUNK.min(ctx_size.max(1));
        let activation_bytes =
            info.activation_bytes_per_token * chunk * 2 + info.vocab_size as u64 * 4 * parallel + 16 * 1024 * 1024;
        let total = weight_bytes + kv_bytes + activation_bytes;
        let available = available_memory();
        MemoryEstimate {
            weight_bytes,
            kv_bytes,
            kv_bytes_per_token: per_token,
            activation_bytes,
            total_bytes: total,
            available_bytes: available,
            fits: available == 0 || total <= available,
            ctx_size,
            parallel,
        }
    }

    /// One line for an error or a report.
    pub fn summary(&self) -> String {
        let mb = |b: u64| b as f64 / 1e6;
        format!(
            "needs {:.0} MB (weights {:.0} MB + KV cache {:.0} MB for {} tokens × {} + activations {:.0} MB), {:.0} MB available",
            mb(self.total_bytes),
            mb(self.weight_bytes),
            mb(self.kv_bytes),
            self.ctx_size,
            self.parallel,
            mb(self.activation_bytes),
            mb(self.available_bytes)
        )
    }
}
