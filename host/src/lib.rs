//! The mlxcel host: model folders, the engine (KV cache, steps, sampling), text (tokenizer, chat
//! templates) and the command line. Architectures and kernels live in plugins.

pub mod checkpoint;
pub mod cli;
pub mod engine;
pub mod logging;
pub mod server;
pub mod store;
pub mod testing;
pub mod text;
