//! `--cache-type-k` / `--cache-type-v`: what the KV cache keeps its values in, as llama.cpp's flags
//! (and their `LLAMA_ARG_CACHE_TYPE_*` variables) say it. Shared by every command that loads a model
//! for generation.

use clap::Args;

use crate::engine::{KvCacheType, KvCacheTypes};

#[derive(Args, Debug, Clone, Default)]
pub struct CacheTypeArgs {
    /// K cache type: f32, f16 or bf16 (default: f16 where the backend keeps it, else f32).
    #[arg(long = "cache-type-k", env = "LLAMA_ARG_CACHE_TYPE_K", value_name = "TYPE")]
    pub cache_type_k: Option<KvCacheType>,
    /// V cache type: f32, f16 or bf16 (default: f16 where the backend keeps it, else f32).
    #[arg(long = "cache-type-v", env = "LLAMA_ARG_CACHE_TYPE_V", value_name = "TYPE")]
    pub cache_type_v: Option<KvCacheType>,
}

impl CacheTypeArgs {
    /// `None` when neither flag is given (the runner's default); one flag alone leaves the other cache
    /// at f16, as llama.cpp does.
    pub fn types(&self) -> Option<KvCacheTypes> {
        if self.cache_type_k.is_none() && self.cache_type_v.is_none() {
            return None;
        }
        let d = KvCacheTypes::DEFAULT;
        Some(KvCacheTypes { k: self.cache_type_k.unwrap_or(d.k), v: self.cache_type_v.unwrap_or(d.v) })
    }
}
