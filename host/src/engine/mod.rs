//! The engine: sequences, the paged KV cache, batch steps and sampling. It knows no architecture (that
//! is the family plugin's) and no HTTP (that is the server's).

pub mod generate;
pub mod kv_cache;
pub mod kv_plan;
pub mod memory;
pub mod request;
pub mod runner;
pub mod sampler;

pub use generate::{FinishReason, GenerateOptions, Generation, Session};
pub use kv_cache::{KvBlockPool, KvCache, SeqBlocks};
pub use kv_plan::KvPlan;
pub use request::{EngineError, GenerationEvent, GenerationRequest, TokenLogprob, Usage};
pub use runner::{Logits, ModelRunner, RunnerOptions, SeqChunk};
pub use sampler::{Sampler, SamplingParams};
