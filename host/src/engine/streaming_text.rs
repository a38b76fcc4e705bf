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
    /// Whether stop strings are looked for in the next token's text (see [`StreamingText::match_stops`]).
    stops_on: bool,
    ignore_eos: bool,
    max_tokens: usize,
    generated: usize,
    // The state of `tokenizers`' DecodeStream, kept here so it does not borrow the tokenizer between
    // tokens (a scheduler holds many of these beside one tokenizer).
    ids: Vec<u32>,
    prefix: String,
    prefix_index: usize,
    /// Special tokens whose text shows (decoding skips the others).
    shown_special: Vec<u32>,
    /// Tokens that end generation beside the tokenizer's end-of-sequence ones.
    end_tokens: Vec<u32>,
    code: CodeLimits,
}

/// llama-server's limits for code completion (its `n_indent` and `t_max_predict_ms`), which editors
/// set so that a suggestion stays within the block being written and arrives in time.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CodeLimits {
    /// A line after the first that starts less indented than this many spaces or tabs ends the
    /// answer before it (0: off).
    pub n_indent: usize,
    /// Once this long has passed since the first token, the answer ends at the next line break.
    pub t_max_predict: Option<std::time::Duration>,
    /// The first token's time, and the indent of the line being written while it is all blanks.
    started: Option<std::time::Instant>,
    indent: Option<usize>,
}

impl CodeLimits {
    pub fn new(n_indent: usize, t_max_predict: Option<std::time::Duration>) -> CodeLimits {
        CodeLimits { n_indent, t_max_predict, ..Default::default() }
    }

    /// Where in `text`, the answer's next piece, the answer ends (the bytes to keep), if it does.
    fn end_in(&mut self, text: &str) -> Option<usize> {
        let started = *self.started.get_or_insert_with(std::time::Instant::now);
        if self.n_indent > 0 {
            for (i, c) in text.char_indices() {
                match (c, &mut self.indent) {
                    // A line break ends a line too: a blank line is measured (as llama-server does).
                    ('\n', n) => {
                        if n.is_some_and(|n| n < self.n_indent) {
                            return Some(i);
                        }
                        *n = Some(0);
                    }
                    (' ' | '\t', Some(n)) => *n += 1,
                    (_, n) => {
                        if n.take().is_some_and(|n| n < self.n_indent) {
                            return Some(i);
                        }
                    }
                }
            }
        }
        let late = self.t_max_predict.is_some_and(|t| started.elapsed() > t);
        (late && text.contains('\n')).then_some(text.len())
    }
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
            stops_on: true,
            ignore_eos,
            max_tokens,
            generated: 0,
            ids: Vec::new(),
            prefix: String::new(),
            prefix_index: 0,
            shown_special: Vec::new(),
            end_tokens: Vec::new(),
            code: CodeLimits::default(),
        }
    }

    /// Applies llama-server's code-completion limits.
    pub fn limited(mut self, code: CodeLimits) -> Self {
        self.code = code;
        self
    }

    /// Ends generation at these tokens too, as at end-of-sequence.
    pub fn ending_at(mut self, tokens: Vec<u32>) -> Self {
        self.end_tokens = tokens;
        self
    }

    /// The tokens besides the tokenizer's end of sequence that end this answer.
    pub fn end_tokens(&self) -> &[u32] {
        &self.end_tokens
    }

    /// Shows the text of these special tokens (see [`GenerationRequest::shown_special`](super::GenerationRequest)).
    pub fn showing(mut self, special: Vec<u32>) -> Self {
        self.shown_special = special;
        self
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

    /// Whether the next tokens' text may end the answer at a stop string: not inside a thought whose
    /// answer a grammar must hold (the answer would end before it).
    pub fn match_stops(&mut self, on: bool) {
        self.stops_on = on;
    }

    /// Takes the next sampled token.
    pub fn push(&mut self, tokenizer: &TextTokenizer, token: u32) -> Result<TokenStep, String> {
        if !self.ignore_eos && (tokenizer.eos_ids.contains(&token) || self.end_tokens.contains(&token)) {
            return Ok(TokenStep { text: self.flush(tokenizer), accepted: false, finish: Some(FinishReason::Stop) });
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
        // The stream skips special tokens (adding no text, so its spacing stays as without them);
        // a shown one's text follows what came before it.
        let piece = match self.shown_special.contains(&token) {
            true => {
                let tag = tokenizer
                    .inner
                    .decode(&[token], false)
                    .map_err(|e| format!("decoding token {token} failed: {e}"))?;
                Some(piece.unwrap_or_default() + &tag)
            }
            false => piece,
        };
        let mut text = String::new();
        if !self.stops_on {
            // Text held back as a possible stop's start goes out with this piece, unmatched.
            text = self.stop.flush() + &piece.unwrap_or_default();
        } else if let Some(piece) = piece {
            match self.stop.push(&piece) {
                StopResult::Continue(s) => text = s,
                StopResult::Stopped(s) => {
                    // The stop string and anything held back with it are not shown.
                    return Ok(TokenStep { text: s, accepted: true, finish: Some(FinishReason::Stop) });
                }
            }
        }
        if let Some(keep) = self.code.end_in(&text) {
            // Cut inside the text (an under-indented line): what follows, held text too, is dropped.
            if keep < text.len() {
                text.truncate(keep);
                self.stop = StopMatcher::new(&[]);
                self.ids.clear();
                self.prefix_index = 0;
                self.prefix.clear();
            } else {
                text.push_str(&self.flush(tokenizer));
            }
            return Ok(TokenStep { text, accepted: true, finish: Some(FinishReason::Length) });
        }
        if self.exhausted() {
            text.push_str(&self.flush(tokenizer));
            return Ok(TokenStep { text, accepted: true, finish: Some(FinishReason::Length) });
        }
        Ok(TokenStep { text, accepted: true, finish: None })
    }

    /// Text held back as a possible stop-string prefix, released when generation ends for a reason
    /// other than a stop string (the context limit, a cancellation), then the text of tokens that
    /// ended inside a UTF-8 character (their bytes so far as U+FFFD, after whatever whole
    /// characters they hold, as llama-server shows them).
    pub fn flush(&mut self, tokenizer: &TextTokenizer) -> String {
        let mut text = self.stop.flush();
        if self.ids.len() > self.prefix_index {
            let whole = tokenizer.inner.decode(&self.ids, true).unwrap_or_default();
            if let Some(rest) = whole.strip_prefix(self.prefix.as_str()) {
                text.push_str(rest);
            }
            self.prefix = whole;
            self.prefix_index = self.ids.len();
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> TextTokenizer {
        let dir = crate::testing::workspace_root().join("families/llama/tests/fixtures/llama-f32");
        let config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
        TextTokenizer::load(&dir, &config, None).unwrap()
    }

    /// A generation cut off inside a character keeps what its tokens hold: the whole characters
    /// before the cut, then U+FFFD for the bytes of the unfinished one.
    #[test]
    fn an_end_inside_a_character_keeps_the_text_before_it() {
        let tok = tokenizer();
        let ids = tok.encode("a 😀", false).unwrap();
        let whole = ids.len();
        assert!(whole >= 3, "the fixture splits the emoji into several tokens: {ids:?}");
        // Stop one token before the emoji is complete.
        let mut out = StreamingText::new(&[], true, whole - 1);
        let mut text = String::new();
        for &id in &ids[..whole - 1] {
            let step = out.push(&tok, id).unwrap();
            text.push_str(&step.text);
            if step.finish.is_some() {
                assert_eq!(step.finish, Some(FinishReason::Length));
                break;
            }
        }
        assert!(text.starts_with("a ") && text.ends_with('\u{FFFD}'), "{text:?}");
        // A complete answer is unchanged.
        let mut out = StreamingText::new(&[], true, whole);
        let text: String = ids.iter().map(|&id| out.push(&tok, id).unwrap().text).collect();
        assert_eq!(text, "a 😀");
    }

    /// Special tokens show nothing unless the request shows them; a shown one's text sits where
    /// the token was, and the text around it is unchanged.
    #[test]
    fn only_shown_special_tokens_show() {
        let tok = tokenizer();
        let mut ids = tok.encode("Hi", false).unwrap();
        ids.push(1); // <|im_start|>, a special token
        ids.extend(tok.encode(" there", false).unwrap());
        let run = |shown: Vec<u32>| {
            let mut out = StreamingText::new(&[], true, 100).showing(shown);
            ids.iter().map(|&id| out.push(&tok, id).unwrap().text).collect::<String>()
        };
        // The tokenizer tells which tags are special tokens (text and unknown tags are not).
        assert_eq!(tok.special_ids(&["<|im_start|>", "Hi", "<think>"]), [1]);
        assert_eq!(run(vec![]), "Hi there");
        assert_eq!(run(vec![1]), "Hi<|im_start|> there");
        // Showing a token the answer does not hold changes nothing.
        assert_eq!(run(vec![2]), "Hi there");
    }

    /// llama-server's `n_indent`: a later line less indented ends the answer before its first
    /// character; `t_max_predict_ms`: past the time, the answer ends with the next line break.
    #[test]
    fn code_limits_end_answers_as_llama_server_does() {
        let tok = tokenizer();
        let run = |text: &str, code: CodeLimits| {
            let mut out = StreamingText::new(&[], true, 100).limited(code);
            let mut shown = String::new();
            for id in tok.encode(text, false).unwrap() {
                let step = out.push(&tok, id).unwrap();
                shown.push_str(&step.text);
                if step.finish.is_some() {
                    assert_eq!(step.finish, Some(FinishReason::Length));
                    return shown;
                }
            }
            shown
        };
        let code = "return a\n    b = 1\n  c = 2\nd";
        assert_eq!(run(code, CodeLimits::new(4, None)), "return a\n    b = 1\n  ");
        assert_eq!(run(code, CodeLimits::new(2, None)), "return a\n    b = 1\n  c = 2\n");
        assert_eq!(run(code, CodeLimits::new(0, None)), code);
        // A blank line is less indented too.
        assert_eq!(run("x\n    a\n\n    b", CodeLimits::new(4, None)), "x\n    a\n");
        // The first line is never measured (the cursor sits inside it).
        assert_eq!(run("x\ny", CodeLimits::new(1, None)), "x\n");
        let late = run(code, CodeLimits::new(0, Some(std::time::Duration::ZERO)));
        assert!(late.starts_with("return a\n") && late.len() < code.len(), "{late:?}");
    }
}
