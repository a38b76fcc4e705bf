//! Whisper's special tokens, found by name in `tokenizer.json`, and what `generation_config.json` says
//! to suppress.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value;
use tokenizers::Tokenizer;

/// Seconds per timestamp token (`<|0.00|>`, `<|0.02|>`, …).
pub const TIME_PRECISION: f32 = 0.02;

/// The special tokens decoding needs.
#[derive(Debug, Clone)]
pub struct WhisperVocab {
    pub eot: u32,
    pub sot: u32,
    pub sot_prev: Option<u32>,
    pub sot_lm: Option<u32>,
    pub transcribe: Option<u32>,
    pub translate: Option<u32>,
    pub no_speech: Option<u32>,
    pub no_timestamps: u32,
    /// First timestamp token (`<|0.00|>`), when the vocabulary has them.
    pub timestamp_begin: Option<u32>,
    /// `(code, id)` of every `<|xx|>` language token.
    pub languages: Vec<(String, u32)>,
    pub multilingual: bool,
    /// Never sampled (`suppress_tokens`, plus the task and start tokens, as openai-whisper does).
    pub suppress: Vec<u32>,
    /// Not sampled as the first token (`begin_suppress_tokens`: a blank and end-of-text).
    pub begin_suppress: Vec<u32>,
    pub vocab_size: usize,
}

fn ids(v: Option<&Value>) -> Vec<u32> {
    v.and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_i64).filter(|&i| i >= 0).map(|i| i as u32).collect())
        .unwrap_or_default()
}

impl WhisperVocab {
    pub fn new(tok: &Tokenizer, config: &Value, generation: Option<&Value>, vocab_size: usize) -> Result<WhisperVocab> {
        let id = |s: &str| tok.token_to_id(s);
        let need =
            |s: &str| id(s).with_context(|| format!("tokenizer.json has no `{s}` token: not a Whisper tokenizer"));
        let eot = need("<|endoftext|>")?;
        let sot = need("<|startoftranscript|>")?;
        let no_timestamps = need("<|notimestamps|>")?;
        let no_speech = id("<|nospeech|>").or_else(|| id("<|nocaptions|>"));
        let timestamp_begin = Some(no_timestamps + 1).filter(|&t| (t as usize) < vocab_size);
        let translate = id("<|translate|>");
        // Language tokens sit between <|startoftranscript|> and <|translate|> in every Whisper vocabulary.
        let mut languages = Vec::new();
        if let Some(tr) = translate {
            for i in sot + 1..tr {
                if let Some(name) = tok.id_to_token(i) {
                    if let Some(code) = name.strip_prefix("<|").and_then(|n| n.strip_suffix("|>")) {
                        languages.push((code.to_string(), i));
                    }
                }
            }
        }
        let gen = |k: &str| generation.and_then(|g| g.get(k)).or_else(|| config.get(k));
        let multilingual = match gen("is_multilingual").and_then(Value::as_bool) {
            Some(m) => m,
            None => vocab_size >= 51865,
        };
        let mut suppress = ids(gen("suppress_tokens"));
        let (transcribe, sot_prev, sot_lm) = (id("<|transcribe|>"), id("<|startofprev|>"), id("<|startoflm|>"));
        suppress.extend([transcribe, translate, Some(sot), sot_prev, sot_lm, no_speech].into_iter().flatten());
        suppress.retain(|&t| (t as usize) < vocab_size);
        suppress.sort_unstable();
        suppress.dedup();
        let begin_suppress = ids(gen("begin_suppress_tokens"));
        Ok(WhisperVocab {
            eot,
            sot,
            sot_prev,
            sot_lm,
            transcribe,
            translate,
            no_speech,
            no_timestamps,
            timestamp_begin,
            languages,
            multilingual,
            suppress,
            begin_suppress,
            vocab_size,
        })
    }

    pub fn language_token(&self, code: &str) -> Option<u32> {
        self.languages.iter().find(|(c, _)| c == code).map(|(_, id)| *id)
    }

    pub fn is_timestamp(&self, t: u32) -> bool {
        self.timestamp_begin.is_some_and(|b| t >= b)
    }
}

/// `tokenizer.json` of a model folder.
pub fn load_tokenizer(dir: &Path) -> Result<Tokenizer> {
    let path = dir.join("tokenizer.json");
    if !path.is_file() {
        bail!("{} is missing: a Whisper model folder needs its tokenizer.json", path.display());
    }
    Tokenizer::from_file(&path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}
