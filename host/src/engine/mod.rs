//! The engine: sequences, the paged KV cache, the prefix cache, batch steps and sampling. It knows no
//! architecture (that is the family plugin's) and no HTTP (that is the server's).

pub mod embed;
pub mod generate;
pub mod handle;
pub mod kv_cache;
pub mod kv_plan;
pub mod memory;
pub mod prefix_cache;
pub mod request;
pub mod runner;
pub mod sampling;
pub mod scheduler;
pub mod streaming_text;
pub mod thought;

pub use embed::{EncodedInput, Encoder, EncoderOptions, EncoderTokenizer};
pub use generate::{FinishReason, GenerateOptions, Generation, Session};
pub use handle::{Engine, EngineHandle, RequestStream};
pub use kv_cache::{KvBlock, KvBlockPool, KvCache, SeqBlocks};
pub use kv_plan::{KvCacheType, KvCacheTypes, KvPlan};
pub use prefix_cache::PrefixCache;
pub use request::{EngineError, GenerationEvent, GenerationRequest, TokenLogprob, Usage};
pub use runner::{EmbeddingFlags, Logits, ModelRunner, RowsWanted, RunnerOptions, SeqChunk, StepRows};
pub use sampling::{DryParams, Sampler, SamplingOverrides, SamplingParams, Step};
pub use scheduler::{
    EngineCounters, EngineOptions, EngineStats, RequestLimits, Scheduler, SlotState, SlotStats, StepModel, Submission,
};
pub use streaming_text::{CodeLimits, StreamingText, TokenStep};
pub use thought::ThoughtBudget;
