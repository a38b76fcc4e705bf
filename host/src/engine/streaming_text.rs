//! What one sequence shows for the tokens it samples: end-of-sequence, the streaming detokenizer
//! (UTF-8-safe: a token that only starts a character shows nothing yet), stop strings and the token
//! limit. The single-sequence [`Session`](super::Session) and the batching scheduler both use it, so a
//! request ends the same way whichever runs it.

use super::generate::FinishReason;
use crate::text::stop::{StopMatcher, StopResult};
use crate::text::TextTokenizer;

/// The text state of one sequence's generation.
pub struct StreamingText {
    stop: StopMatcher,
    ignore_eos: bool,
    max_tokens: usize,
    generated: usize,
    // The state of `tokenizers`' DecodeStream, kept here so it does not borrow the tokenizer between
    // tokens (a scheduler holds many of these beside one tokenizer).
    ids: Vec<u32>,
    prefix: String,
    prefix_index: usize,
}

/// What one sampled token did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenStep {
    /// Text to show now (possibly empty).
    pub text: String,
    /// False for an end-of-sequence token, which is not part of the answer.
    pub accepted: bool,
    /// Generation ends with this token.
    pub finish: Option<FinishReason>,
}

impl StreamingText {
    pub fn new(stop: &[String], ignore_eos: bool, max_tokens: usize) -> Self {
        StreamingText {
            stop: StopMatcher::new(stop),
            ignore_eos,
            max_tokens,
            generated: 0,
            ids: Vec::new(),
            prefix: String::new(),
            prefix_index: 0,
        }
    }

    /// Tokens it may still take before the token limit.
    pub fn remaining(&self) -> usize {
        self.max_tokens.saturating_sub(self.generated)
    }

    /// Tokens accepted so far.
    pub fn generated(&self) -> usize {
        self.generated
    }

    /// The token limit is reached (true from the start when it is 0).
    pub fn exhausted(&self) -> bool {
        self.generated >= self.max_tokens
    }

    /// Takes the next sampled token.
    pub fn push(&mut self, tokenizer: &TextTokenizer, token: u32) -> Result<TokenStep, String> {
        if !self.ignore_eos && tokenizer.eos_ids.contains(&token) {
            return Ok(TokenStep { text: self.flush(), accepted: false, finish: Some(FinishReason::Stop) });
        }
        self.generated += 1;
        let piece = tokenizers::tokenizer::step_decode_stream(
            &tokenizer.inner,
            token,
            true,
            &mut self.ids,
            &mut self.prefix,
            &mut self.prefix_index,
        )
        .map_err(|e| format!("decoding token {token} failed: {e}"))?;
        let mut text = String::new();
        if let Some(piece) = piece {
            match self.stop.push(&piece) {
                StopResult::Continue(s) => text = s,
                StopResult::Stopped(s) => {
                    // The stop string and anything held back with it are not shown.
                    return Ok(TokenStep { text: s, accepted: true, finish: Some(FinishReason::Stop) });
                }
            }
        }
        if self.exhausted() {
            text.push_str(&self.flush());
            return Ok(TokenStep { text, accepted: true, finish: Some(FinishReason::Length) });
        }
        Ok(TokenStep { text, accepted: true, finish: None })
    }

    /// Text held back as a possible stop-string prefix, released when generation ends for a reason
    /// other than a stop string (the context limit, a cancellation).
    pub fn flush(&mut self) -> String {
        self.stop.flush()
    }
}
