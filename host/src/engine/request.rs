//! The engine's request boundary: what a front end (the HTTP server, the CLI) hands the scheduler and
//! what it gets back. Nothing here knows HTTP or an API dialect; the server translates each dialect to
//! a [`GenerationRequest`] and [`GenerationEvent`]s back to the dialect.

use std::time::Duration;

use super::generate::FinishReason;
use super::sampling::SamplingParams;
use super::streaming_text::CodeLimits;
use super::thought::ThoughtBudget;
use crate::text::grammar::Constraint;

/// One completion to run: a tokenized prompt and how to continue it.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    /// Prompt token ids (already templated and tokenized by the caller).
    pub prompt: Vec<u32>,
    /// Each request samples with its own settings, seed and penalties, even inside one batch.
    pub sampling: SamplingParams,
    /// Most tokens to generate (the context size also stops generation).
    pub max_tokens: usize,
    /// Stop strings: generation ends when the text contains one; the string itself is not returned.
    pub stop: Vec<String>,
    /// Keep going past end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Reuse cached KV pages of an earlier request that shares a prefix (and leave this one's pages
    /// for later requests).
    pub cache_prompt: bool,
    /// Report the chosen token's log-probability and this many alternatives per token (None = off).
    pub logprobs: Option<usize>,
    /// Score the prompt: each prompt token's log-probability given the tokens before it (the first
    /// has none) and this many alternatives per token (None = off), sent as one
    /// [`GenerationEvent::PromptLogprobs`] before any text. A scored prompt is computed whole: it
    /// reuses no cached prefix.
    pub prompt_logprobs: Option<usize>,
    /// The slot to run in (llama-server's `id_slot`; taken modulo the slots, as there): the request
    /// waits for that slot (None: any free slot).
    pub slot: Option<usize>,
    /// Give up after this long (None = no limit); the request ends with [`FinishReason::Cancelled`].
    pub timeout: Option<Duration>,
    /// A cap on a reasoning model's thought (None = the model thinks as long as it likes).
    pub thought_budget: Option<ThoughtBudget>,
    /// Special tokens whose text shows in the answer (the tool-call and thought tags a server reads
    /// back, as llama-server's preserved tokens); other special tokens show nothing.
    pub shown_special: Vec<u32>,
    /// Tokens that end the answer as end-of-sequence does, beside the model's own (infill's file
    /// separators, as llama-server ends at them).
    pub end_tokens: Vec<u32>,
    /// llama-server's code-completion limits (see [`CodeLimits`](super::streaming_text::CodeLimits)).
    pub code_limits: CodeLimits,
    /// A grammar every token must keep the answer inside (structured outputs).
    pub constraint: Option<Constraint>,
}

impl GenerationRequest {
    pub fn new(prompt: Vec<u32>, sampling: SamplingParams, max_tokens: usize) -> Self {
        GenerationRequest {
            prompt,
            sampling,
            max_tokens,
            stop: Vec::new(),
            ignore_eos: false,
            cache_prompt: true,
            logprobs: None,
            prompt_logprobs: None,
            slot: None,
            timeout: None,
            thought_budget: None,
            shown_special: Vec::new(),
            end_tokens: Vec::new(),
            code_limits: CodeLimits::default(),
            constraint: None,
        }
    }
}

/// A token's log-probability and the most likely alternatives at its step.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// `(token, logprob)`, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// Token counts and timings of one finished request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Usage {
    /// Tokens in the prompt.
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache (not recomputed).
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// From admission to the first generated token.
    pub prompt_time: Duration,
    /// From the first generated token to the last.
    pub generation_time: Duration,
    /// Time spent waiting in the queue before admission.
    pub queue_time: Duration,
}

/// What the engine streams back for one request, in order: any number of `Text`, then one `Done`
/// (or one `Error`).
#[derive(Debug, Clone)]
pub enum GenerationEvent {
    /// The request was admitted (sent once, before any text): how many prompt tokens come from the
    /// prefix cache, which Anthropic's `message_start` reports, and the slot it runs in.
    Started { cached_tokens: usize, slot: usize },
    /// Prompt processing went on (after each prompt chunk the engine computes, the last one too):
    /// `processed` of the prompt's `total` tokens are in the KV, `cached` of them from the prefix
    /// cache, `elapsed` since admission.
    PromptProgress { processed: usize, total: usize, cached: usize, elapsed: Duration },
    /// The log-probabilities of the prompt's tokens after the first, in order (sent once, before any
    /// text, to a request that asked for [`GenerationRequest::prompt_logprobs`]).
    PromptLogprobs(Vec<TokenLogprob>),
    /// New text (already through the streaming detokenizer and the stop-string matcher; may be empty
    /// when a token only completes a multi-byte character later) and the token ids behind it.
    Text { text: String, tokens: Vec<u32>, logprobs: Vec<TokenLogprob> },
    /// The token that ended the answer as an end of sequence does (it adds no text, and is no token
    /// of the answer's) with its log-probability: sent, to a request that asked for logprobs, just
    /// before `Done`, for the dialects that list it (OpenAI's legacy completions, llama-server's).
    EndToken(TokenLogprob),
    /// The request ended.
    Done { finish: FinishReason, usage: Usage },
    /// The request failed; nothing more follows.
    Error(EngineError),
}

/// Why the engine refused or failed a request. The server maps each to its dialect's status code.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum EngineError {
    /// The waiting queue is full (HTTP 503 with `Retry-After`).
    #[error("the server is busy: {queued} requests are waiting; retry later")]
    QueueFull { queued: usize },
    /// The prompt does not fit the context (HTTP 400 with the numbers).
    #[error("the prompt has {prompt_tokens} tokens but the context size is {ctx_size}")]
    PromptTooLong { prompt_tokens: usize, ctx_size: usize },
    /// A field of the request is invalid (HTTP 400).
    #[error("{0}")]
    Invalid(String),
    /// The engine is shutting down (HTTP 503).
    #[error("the server is shutting down")]
    ShuttingDown,
    /// The request ran past `--timeout` with nothing to show for it (HTTP 504).
    #[error("the request did not finish within the server's --timeout ({}s)", .0.as_secs_f64())]
    TimedOut(std::time::Duration),
    /// Anything else (HTTP 500); the message says what failed.
    #[error("{0}")]
    Internal(String),
}
