//! Text in and out: tokenizer, chat templates, and stop-string matching for streamed output.

pub mod chat_template;
pub mod grammar;
pub mod stop;
pub mod tokenizer;

pub use chat_template::{ChatMessage, ChatTemplate};
pub use tokenizer::TextTokenizer;
