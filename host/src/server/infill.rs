//! llama-server's `/infill` prompt: fill-in-the-middle for code editors (llama.vscode, llama.vim).
//! The model's FIM tokens frame the code before and after the cursor, after any extra files the
//! editor sends, as llama-server lays them out (repo-level FIM, Qwen2.5-Coder's paper):
//!
//! ```text
//! [FIM_REP]myproject\n [FIM_SEP]file0\n text0 … [FIM_SEP]filename\n [FIM_PRE]prefix [FIM_SUF]suffix [FIM_MID]prompt
//! ```
//!
//! (`prompt`, when given, follows the prefix.) The prefix keeps its last tokens and the suffix its
//! first ones to fit a batch 3:1, and the extra files fill what the context leaves.

use serde::Deserialize;

use crate::text::TextTokenizer;

/// One extra file from the editor.
#[derive(Deserialize, Debug, Clone)]
pub struct ExtraChunk {
    pub text: String,
    pub filename: Option<String>,
    /// When the editor took the chunk (llama.vim and llama.vscode send it); the order of the chunks
    /// is theirs, so it is not read.
    #[allow(dead_code)]
    pub time: Option<serde_json::Value>,
}

/// A model's fill-in-the-middle tokens, found by the names their tokenizers give them.
#[derive(Debug, Clone, PartialEq)]
pub struct Fim {
    /// Other tokens that end a fill.
    pub ends: Vec<u32>,
    pub prefix: u32,
    pub suffix: u32,
    pub middle: u32,
    /// Repository name and file separator (repo-level FIM), and padding, where the model has them.
    pub repo: Option<u32>,
    pub file_sep: Option<u32>,
    pub pad: Option<u32>,
}

// The names each FIM token goes by in the tokenizers of Qwen2.5-Coder, OpenCoder, StarCoder,
// DeepSeek-Coder, CodeLlama, CodeGemma and GLM-4 (llama.cpp's lists, with the file separators of
// StarCoder's and CodeGemma's own).
const PREFIX: &[&str] =
    &["<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>"];
const SUFFIX: &[&str] =
    &["<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>"];
const MIDDLE: &[&str] =
    &["<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>"];
const REPO: &[&str] = &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"];
const FILE_SEP: &[&str] = &["<|file_sep|>", "<file_sep>", "<|file_separator|>"];
const PAD: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"];
// Ends of a turn or a fill that llama.cpp ends every generation at, where a tokenizer does not list
// them as end-of-sequence (CodeLlama ends an infill with `<EOT>`, its EOS being `</s>`).
const ENDS: &[&str] = &["<EOT>", "▁<EOT>", "<|endoftext|>", "<|im_end|>", "<end_of_turn>", "<|eot_id|>"];

impl Fim {
    /// The tokenizer's FIM tokens, or what is missing (as llama-server words it).
    pub fn of(tok: &TextTokenizer) -> Result<Fim, String> {
        let find = |names: &[&str]| names.iter().find_map(|n| tok.inner.token_to_id(n));
        let (prefix, suffix, middle) = (find(PREFIX), find(SUFFIX), find(MIDDLE));
        let mut missing = String::new();
        for (id, what) in [(prefix, "prefix"), (suffix, "suffix"), (middle, "middle")] {
            if id.is_none() {
                missing += &format!("{what} token is missing. ");
            }
        }
        match (prefix, suffix, middle) {
            (Some(prefix), Some(suffix), Some(middle)) => {
                let ends = ENDS.iter().filter_map(|n| tok.inner.token_to_id(n)).collect();
                Ok(Fim { ends, prefix, suffix, middle, repo: find(REPO), file_sep: find(FILE_SEP), pad: find(PAD) })
            }
            _ => Err(format!("Infill is not supported by this model: {}", missing.trim_end())),
        }
    }

    /// The tokens that end an infill answer beside end-of-sequence: the model going on to padding
    /// or to another file, or ending its turn.
    pub fn end_tokens(&self) -> Vec<u32> {
        let mut ends: Vec<u32> = [self.pad, self.repo, self.file_sep].into_iter().flatten().collect();
        for &e in &self.ends {
            if !ends.contains(&e) {
                ends.push(e);
            }
        }
        ends
    }
}

/// What an infill prompt is made of.
pub struct InfillInput<'a> {
    pub prefix: &'a str,
    pub suffix: &'a str,
    pub extra: &'a [ExtraChunk],
    /// Text after the prefix, where the answer starts.
    pub prompt: &'a str,
}

/// The prompt's token ids for a server whose batch is `n_batch` tokens and context `n_ctx`, with
/// `n_predict` tokens kept for the answer.
pub fn prompt(
    tok: &TextTokenizer,
    fim: &Fim,
    input: &InfillInput,
    n_batch: usize,
    n_predict: usize,
    n_ctx: usize,
) -> anyhow::Result<Vec<u32>> {
    // The user's code is text: special-token names in it are not tokens.
    let text = |s: &str| tok.encode_literal(s, false);
    let mut extra = Vec::new();
    if let Some(repo) = fim.repo {
        extra.push(repo);
        extra.extend(text("myproject\n")?);
    }
    for chunk in input.extra {
        match fim.file_sep {
            Some(sep) => {
                extra.push(sep);
                extra.extend(text(&format!("{}\n", chunk.filename.as_deref().unwrap_or("tmp")))?);
            }
            None => extra.extend(text("\n\n--- snippet ---\n\n")?),
        }
        extra.extend(text(&chunk.text)?);
    }
    if let Some(sep) = fim.file_sep {
        extra.push(sep);
        extra.extend(text("filename\n")?);
    }

    let prompt = tok.encode(input.prompt, false)?;
    let mut prefix = text(input.prefix)?;
    let mut suffix = text(input.suffix)?;
    // The prefix and suffix share a batch 3:1; the extra files take what the context leaves.
    let prefix_take = prefix.len().min(3 * (n_batch / 4));
    let suffix_take = suffix.len().min((n_batch / 4).saturating_sub(2 + prompt.len()));
    let extra_take = extra.len().min(n_ctx.saturating_sub(n_batch.saturating_add(n_predict.saturating_mul(2))));
    prefix.drain(..prefix.len() - prefix_take);
    suffix.truncate(suffix_take);

    let mut ids = extra[extra.len() - extra_take..].to_vec();
    // A BOS, where the tokenizer starts its sequences with one.
    ids.extend(tok.encode("", true)?);
    ids.push(fim.prefix);
    ids.extend(prefix);
    ids.extend(prompt);
    ids.push(fim.suffix);
    ids.extend(suffix);
    ids.push(fim.middle);
    Ok(ids)
}
