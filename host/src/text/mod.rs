//! Text in and out: tokenizer, chat templates, and stop-string matching for streamed output.

pub mod chat_template;
pub mod grammar;
pub mod stop;
pub mod tokenizer;

pub use chat_template::{ChatMessage, ChatTemplate};
pub use tokenizer::TextTokenizer;

/// A model folder's `tokenizer_config.json`, where there is one that parses (the readers that only
/// consult it: chat template, input limit; [`TextTokenizer::load`] reads it strictly).
pub fn tokenizer_config(dir: &std::path::Path) -> Option<serde_json::Value> {
    let text = std::fs::read_to_string(dir.join("tokenizer_config.json")).ok()?;
    serde_json::from_str(&text).ok()
}
