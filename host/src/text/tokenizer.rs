//! The tokenizer of a model folder: `tokenizer.json` through the `tokenizers` crate, special tokens
//! from `tokenizer_config.json`, the chat template, and the EOS ids from every place a checkpoint
//! may state them.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value;
use tokenizers::Tokenizer;

use super::chat_template::{ChatMessage, ChatTemplate};
use super::grammar::Grammars;

pub struct TextTokenizer {
    pub inner: Tokenizer,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// Every id that ends generation.
    pub eos_ids: Vec<u32>,
    pub chat_template: Option<ChatTemplate>,
    /// Why the model's own chat template could not be used (it does not parse): said where a
    /// template is needed, so that raw completion and a replacement template still work.
    pub chat_template_error: Option<String>,
    /// A copy of `inner` that reads special-token text as plain text, made on first use.
    literal: std::sync::OnceLock<Tokenizer>,
    /// Grammars over this vocabulary, made at the first constrained request.
    grammars: std::sync::OnceLock<Result<std::sync::Arc<Grammars>, String>>,
}

/// A special token in `tokenizer_config.json`: a string or `{"content": ...}`.
fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

fn ids_of(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect(),
        _ => vec![],
    }
}

/// The texts of tokens that end a turn, from llama.cpp's end-of-generation list: those of the chat
/// formats of the families served here (gpt-oss's harmony markers, where `<|end|>` ends only a
/// message, are left out with that format).
const END_OF_TURN: &[&str] = &[
    "<|eot_id|>",
    "<|eom_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "<end_of_utterance>",
    "<｜end▁of▁sentence｜>",
];

impl TextTokenizer {
    /// Loads from `dir`; `config` and `generation_config` contribute EOS ids.
    pub fn load(dir: &Path, config: &Value, generation_config: Option<&Value>) -> Result<TextTokenizer> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            bail!(
                "{} has no tokenizer.json; mlxcel needs the Hugging Face tokenizer file beside the weights",
                dir.display()
            );
        }
        let mut inner = Tokenizer::from_file(&path)
            .map_err(|e| anyhow::anyhow!("{}: cannot load tokenizer: {e}", path.display()))?;
        // Some checkpoints ship padding/truncation switched on (sentence-transformers); generation wants neither.
        inner.with_padding(None);
        inner.with_truncation(None).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;

        let tc_path = dir.join("tokenizer_config.json");
        let tc: Option<Value> = if tc_path.is_file() {
            let text = std::fs::read_to_string(&tc_path).with_context(|| format!("reading {}", tc_path.display()))?;
            Some(serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", tc_path.display()))?)
        } else {
            None
        };
        let bos_token = token_text(tc.as_ref().and_then(|t| t.get("bos_token")));
        let eos_token = token_text(tc.as_ref().and_then(|t| t.get("eos_token")));

        let mut eos_ids = ids_of(config.get("eos_token_id"));
        if let Some(text) = config.get("text_config") {
            eos_ids.extend(ids_of(text.get("eos_token_id")));
        }
        if let Some(g) = generation_config {
            eos_ids.extend(ids_of(g.get("eos_token_id")));
        }
        if let Some(id) = eos_token.as_deref().and_then(|t| inner.token_to_id(t)) {
            eos_ids.push(id);
        }
        // Ends of turn found by their text, as llama.cpp finds its end-of-generation tokens: a
        // folder without generation_config.json (Gemma's `<end_of_turn>` is only there) still
        // stops at the end of its turn. Only special tokens count: as text they are plain words.
        let added = inner.get_added_vocabulary().get_added_tokens_decoder();
        eos_ids.extend(
            END_OF_TURN
                .iter()
                .filter_map(|t| inner.token_to_id(t))
                .filter(|id| added.get(id).is_some_and(|a| a.special)),
        );
        eos_ids.sort_unstable();
        eos_ids.dedup();

        let (bos, eos) = (bos_token.as_deref().unwrap_or(""), eos_token.as_deref().unwrap_or(""));
        let (chat_template, chat_template_error) = match ChatTemplate::source_in(dir, tc.as_ref()) {
            Some(src) => match ChatTemplate::new(&src, bos, eos) {
                Ok(t) => (Some(t), None),
                Err(e) => (None, Some(format!("{}: {e}", dir.display()))),
            },
            None => (None, None),
        };
        Ok(TextTokenizer {
            inner,
            bos_token,
            eos_token,
            eos_ids,
            chat_template,
            chat_template_error,
            literal: Default::default(),
            grammars: Default::default(),
        })
    }

    /// Token ids of `text`. With `add_special`, the tokenizer's own post-processor adds BOS etc., but a
    /// BOS already present in the text is not doubled.
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, add_special).map_err(|e| anyhow::anyhow!("tokenizing failed: {e}"))?;
        let mut ids = enc.get_ids().to_vec();
        if add_special {
            if let Some(bos) = self.bos_token.as_deref().and_then(|b| self.inner.token_to_id(b)) {
                if ids.len() >= 2 && ids[0] == bos && ids[1] == bos {
                    ids.remove(0);
                }
            }
        }
        Ok(ids)
    }

    /// The prompt of a conversation through the chat template (tokenized without adding specials:
    /// the template writes them).
    pub fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        let t = self.template()?;
        let text = t.render(messages, true).map_err(|e| anyhow::anyhow!(e))?;
        self.encode(&text, false)
    }

    /// The chat template, or why there is none to use.
    pub fn template(&self) -> Result<&ChatTemplate> {
        match (&self.chat_template, &self.chat_template_error) {
            (Some(t), _) => Ok(t),
            (None, Some(e)) => bail!("{e}; use --no-chat-template, or another template with --chat-template-file"),
            (None, None) => bail!(
                "this model has no chat template (tokenizer_config.json `chat_template` or chat_template.jinja); use --no-chat-template"
            ),
        }
    }

    /// Replaces the model's chat template with `source` (`--chat-template-file`); `what` names it in
    /// an error.
    pub fn replace_template(&mut self, source: &str, what: &str) -> Result<()> {
        let (bos, eos) = (self.bos_token.as_deref().unwrap_or(""), self.eos_token.as_deref().unwrap_or(""));
        let t = ChatTemplate::new(source, bos, eos).map_err(|e| anyhow::anyhow!("{what}: {e}"))?;
        (self.chat_template, self.chat_template_error) = (Some(t), None);
        Ok(())
    }

    /// Token ids of `text` with special-token text (`<|im_start|>`) tokenized as ordinary text, as
    /// llama-server's `parse_special: false` asks.
    pub fn encode_literal(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let t = self.literal.get_or_init(|| {
            let mut t = self.inner.clone();
            t.set_encode_special_tokens(true);
            t
        });
        let enc = t.encode(text, add_special).map_err(|e| anyhow::anyhow!("tokenizing failed: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The bytes token `id` stands for, also where they are only part of a UTF-8 character (a
    /// byte-level BPE piece, or a SentencePiece `<0xNN>` byte-fallback token), where decoding the
    /// token alone gives U+FFFD.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        let text = self.inner.decode(&[id], false).unwrap_or_default();
        if !text.contains('\u{FFFD}') {
            return text.into_bytes();
        }
        let piece = self.inner.id_to_token(id).unwrap_or_default();
        if let Some(b) =
            piece.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')).and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            return vec![b];
        }
        // GPT-2's byte-level alphabet: a char per byte, printable bytes as themselves.
        let byte_of = |c: char| -> Option<u8> {
            let c = c as u32;
            let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
            if c < 256 && printable(c) {
                return Some(c as u8);
            }
            // The others, in order, were moved to 256, 257, ….
            let k = c.checked_sub(256)?;
            (0u32..256).filter(|&b| !printable(b)).nth(k as usize).map(|b| b as u8)
        };
        piece.chars().map(byte_of).collect::<Option<Vec<u8>>>().unwrap_or_else(|| text.into_bytes())
    }

    /// The bytes token `id` adds to a text it follows: [`token_bytes`](Self::token_bytes), except
    /// that a SentencePiece piece keeps its leading space (decoding it alone would drop it).
    pub fn piece_bytes(&self, id: u32) -> Vec<u8> {
        match self.inner.id_to_token(id) {
            Some(p) if p.contains('▁') && !p.starts_with("<0x") => p.replace('▁', " ").into_bytes(),
            _ => self.token_bytes(id),
        }
    }

    /// The number of token ids: one past the highest id the vocabulary or the ends of sequence
    /// use (the tokenizer's own count is of distinct strings, short where ids repeat or skip).
    pub fn id_count(&self) -> u32 {
        let highest = self.inner.get_vocab(true).into_values().chain(self.eos_ids.iter().copied()).max();
        highest.map_or(0, |h| h + 1)
    }

    /// Whether [`grammars`](Self::grammars) has been made (or failed) already.
    pub fn has_grammars(&self) -> bool {
        self.grammars.get().is_some()
    }

    /// What compiles grammars (JSON schemas) over this vocabulary, made on first use; Err when the
    /// vocabulary cannot end a constrained answer.
    pub fn grammars(&self) -> Result<std::sync::Arc<Grammars>, String> {
        let made =
            self.grammars.get_or_init(|| Grammars::new(self).map(std::sync::Arc::new).map_err(|e| format!("{e:#}")));
        made.clone()
    }

    /// The ids of those of `tags` that are special tokens here (their text is skipped in decoding
    /// unless a request shows it).
    pub fn special_ids(&self, tags: &[&str]) -> Vec<u32> {
        let added = self.inner.get_added_vocabulary().get_added_tokens_decoder();
        tags.iter()
            .filter_map(|t| self.inner.token_to_id(t))
            .filter(|id| added.get(id).is_some_and(|a| a.special))
            .collect()
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, true).map_err(|e| anyhow::anyhow!("decoding failed: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A folder whose configs name only `<|endoftext|>` still ends at ChatML's `<|im_end|>`, a special
    /// token of its vocabulary, as llama.cpp ends there.
    #[test]
    fn special_ends_of_turn_end_generation_by_their_text() {
        let dir = crate::testing::workspace_root().join("families/llama/tests/fixtures/qwen3-q4");
        let tok = TextTokenizer::load(&dir, &serde_json::json!({}), None).unwrap();
        let id = |t: &str| tok.inner.token_to_id(t).unwrap();
        assert_eq!(tok.eos_ids, vec![id("<|endoftext|>"), id("<|im_end|>")]);
    }
}
