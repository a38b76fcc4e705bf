//! The OpenAI dialect: `/v1/chat/completions`, `/v1/completions`, `/v1/models`. Requests become
//! [`Job`]s; answers and stream chunks are written in OpenAI's shapes (plus llama-server's `timings`).
//! Like llama-server, any `model` name is accepted and answered by the one served model.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{json, Value};

use super::completion::{
    data, logit_bias, new_id, run_all, stream_many, submit_all, timings, token_label, unix_time, Asked, Ending, Job,
    Live, StreamDialect, StreamExtras,
};
use super::error::{parse_body_with, ApiError, Dialect, ErrorKind};
use super::reasoning::{self, Parts, ReasoningFormat, Splitter};
use super::samplers::LlamaSamplers;
use super::state::{AppState, LoadedModel, RequestLog};
use super::structured;
use super::tools::{parameters_problem, pieces_through, text_and_calls, CallParser, Forced, ToolCall, Tooling};
use crate::engine::{SamplingParams, TokenLogprob, Usage};
use crate::text::{ChatMessage, TextTokenizer};

/// `stop`: one string or a list.
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

impl StopField {
    /// The stop strings; an empty one is dropped (it would match anywhere), as llama-server drops it.
    pub fn into_vec(self) -> Vec<String> {
        let mut v = match self {
            StopField::One(s) => vec![s],
            StopField::Many(v) => v,
        };
        v.retain(|s| !s.is_empty());
        v
    }
}

#[derive(Deserialize, Debug, Default)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
    /// OpenAI's random padding of stream chunks (against length side channels): not added here.
    pub include_obfuscation: Option<bool>,
}

/// Message content: a string or a list of parts.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize, Debug)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Deserialize, Debug)]
pub struct MessageIn {
    pub role: String,
    pub content: Option<Content>,
    /// A participant's name.
    pub name: Option<String>,
    /// An assistant turn's calls and a tool result's answer to one (history of an earlier tool use).
    pub tool_calls: Option<Vec<Value>>,
    pub tool_call_id: Option<String>,
    /// Output-only fields of an assistant message that clients echo back into the history: taken
    /// where they say nothing (see [`chat_messages`]).
    pub refusal: Option<String>,
    pub annotations: Option<Vec<Value>>,
    /// A reasoning model's thinking in an earlier turn (templates that show it read it).
    pub reasoning_content: Option<String>,
    pub audio: Option<Value>,
    pub function_call: Option<Value>,
}

/// Sampling fields shared by both generating routes (OpenAI's, plus llama-server's extensions).
/// (Spelled out in each request rather than `#[serde(flatten)]`, which would lose the field name in
/// type errors.)
#[derive(Debug, Default)]
pub struct SamplingFields {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub repeat_last_n: Option<i64>,
}

impl SamplingFields {
    /// The request's sampling over `defaults`; `ctx` is what a `repeat_last_n` of -1 means.
    pub fn apply(&self, defaults: &SamplingParams, ctx: usize) -> Result<SamplingParams, ApiError> {
        let mut p = defaults.clone();
        p.temperature = self.temperature.unwrap_or(p.temperature);
        p.top_p = self.top_p.unwrap_or(p.top_p);
        p.presence_penalty = self.presence_penalty.unwrap_or(p.presence_penalty);
        p.frequency_penalty = self.frequency_penalty.unwrap_or(p.frequency_penalty);
        // llama-server's extension: 0 or less turns top-k off.
        p.top_k = self.top_k.map_or(p.top_k, |k| usize::try_from(k).unwrap_or(0));
        p.min_p = self.min_p.unwrap_or(p.min_p);
        p.repeat_penalty = self.repeat_penalty.unwrap_or(p.repeat_penalty);
        p.penalty_last_n = super::samplers::penalty_last_n(self.repeat_last_n, p.penalty_last_n, ctx)?;
        // OpenAI's seed is any int64, negative ones as deterministic as the rest — but -1 (and its
        // 32-bit spelling), which llama-server's clients send for "random", is random.
        match self.seed {
            Some(-1) | Some(0xFFFF_FFFF) => p.seed = None,
            Some(s) => p.seed = Some(s as u64),
            None => {}
        }
        for (field, v, min) in [
            ("presence_penalty", p.presence_penalty, -2.0),
            ("frequency_penalty", p.frequency_penalty, -2.0),
            ("temperature", p.temperature, 0.0),
        ] {
            if !(min..=2.0).contains(&v) {
                let message = format!("{field} must be in [{min}, 2], got {v}");
                return Err(ApiError::out_of_range(field, false, v > 2.0, message));
            }
        }
        Ok(p)
    }
}

macro_rules! sampling_fields {
    ($r:expr) => {
        SamplingFields {
            temperature: $r.temperature,
            top_p: $r.top_p,
            seed: $r.seed,
            presence_penalty: $r.presence_penalty,
            frequency_penalty: $r.frequency_penalty,
            top_k: $r.top_k,
            min_p: $r.min_p,
            repeat_penalty: $r.repeat_penalty,
            repeat_last_n: $r.repeat_last_n,
        }
    };
}

#[derive(Deserialize, Debug)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<MessageIn>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    /// llama-server's name for the same limit, which it reads here too.
    pub n_predict: Option<i64>,
    pub stop: Option<StopField>,
    pub n: Option<u32>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u32>,
    pub cache_prompt: Option<bool>,
    pub ignore_eos: Option<bool>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub response_format: Option<Value>,
    /// llama-server's: the JSON schema the answer must follow (as `response_format` says it).
    pub json_schema: Option<Value>,
    pub logit_bias: Option<Value>,
    /// More variables for the chat template (llama-server's; Qwen3's `enable_thinking`, …).
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// llama-server's: whether the template opens the assistant's turn (default true), and whether
    /// the final (assistant) message is continued instead.
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: Option<Value>,
    /// llama-server's cap on the thought, in tokens (-1: none), where `--reasoning-budget` sets none.
    pub thinking_budget_tokens: Option<i64>,
    /// llama-server's: how thinking is returned (the server's `--reasoning-format` by default).
    pub reasoning_format: Option<String>,
    /// OpenAI's: how much a reasoning model thinks (see [`reasoning::effort`]).
    pub reasoning_effort: Option<String>,
    /// llama-server's: `timings` in every stream chunk, and prompt-progress chunks.
    pub timings_per_token: Option<bool>,
    pub return_progress: Option<bool>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub repeat_last_n: Option<i64>,
}

/// A conversation in the roles chat templates know: `developer` is a system message; content parts
/// are joined; anything but text is refused by name.
pub fn chat_messages(messages: &[MessageIn]) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::field("messages", "messages must hold at least one message"));
    }
    check_tool_history(messages)?;
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let role = match m.role.as_str() {
            "system" | "developer" => "system",
            r @ ("user" | "assistant" | "tool") => r,
            other => {
                return Err(ApiError::field(
                    &format!("messages[{i}].role"),
                    format!("unknown role `{other}` (expected system, developer, user, assistant or tool)"),
                ))
            }
        };
        if m.audio.as_ref().is_some_and(|a| !a.is_null()) || m.function_call.as_ref().is_some_and(|f| !f.is_null()) {
            let field = if m.audio.as_ref().is_some_and(|a| !a.is_null()) { "audio" } else { "function_call" };
            return Err(ApiError::field(
                &format!("messages[{i}].{field}"),
                format!("`{field}` in a message is not supported (audio output and legacy function calls are not implemented)"),
            ));
        }
        let content = match &m.content {
            // As OpenAI's API (and llama-server: "Expected 'content' or 'tool_calls'"): only an
            // assistant turn that called tools, refused, or only thought has none.
            None if role == "assistant"
                && (m.tool_calls.is_some() || m.refusal.is_some() || m.reasoning_content.is_some()) =>
            {
                (String::new(), None)
            }
            None => {
                return Err(ApiError::field(
                    &format!("messages[{i}].content"),
                    format!(
                        "a {} message needs `content`{}",
                        m.role,
                        if role == "assistant" { " or `tool_calls`" } else { "" }
                    ),
                ))
            }
            Some(Content::Text(s)) => (s.clone(), None),
            Some(Content::Parts(parts)) => {
                let mut texts = Vec::new();
                for (j, p) in parts.iter().enumerate() {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => texts.push(t.as_str()),
                        ("text", None) => {
                            return Err(ApiError::field(
                                &format!("messages[{i}].content[{j}].text"),
                                "a text part needs `text`",
                            ))
                        }
                        (kind, _) => {
                            return Err(ApiError::field(
                                &format!("messages[{i}].content[{j}].type"),
                                format!("`{kind}` content is not supported; this server reads text parts only"),
                            ))
                        }
                    }
                }
                (texts.join("\n"), Some(texts.iter().map(|t| t.to_string()).collect()))
            }
        };
        // A refusal stands in for the content it refused to give.
        let (content, parts) = match (&m.refusal, content.0.is_empty()) {
            (Some(r), true) => (r.clone(), None),
            _ => content,
        };
        // (An empty list is no calls: templates test for its presence.)
        let tool_calls =
            m.tool_calls.as_ref().filter(|c| !c.is_empty()).map(|c| c.iter().map(template_tool_call).collect());
        out.push(ChatMessage {
            name: m.name.clone(),
            tool_calls,
            tool_call_id: m.tool_call_id.clone(),
            reasoning_content: m.reasoning_content.clone(),
            parts,
            ..ChatMessage::new(role, &content)
        });
    }
    Ok(out)
}

/// OpenAI's rules for the tool calls of a history, which a template relies on: each call has an `id`
/// and a function name; a tool message answers, by `tool_call_id`, a call of the assistant message
/// before it; and what follows an assistant's calls comes after an answer to each.
fn check_tool_history(messages: &[MessageIn]) -> Result<(), ApiError> {
    let unanswered = |at: &str, open: &[&str]| {
        let ids = open.join(", ");
        ApiError::field(
            at,
            format!("an assistant message with `tool_calls` must be followed by tool messages answering each call; none answers {ids}"),
        )
    };
    // The calls of the last assistant message, and those of them still unanswered.
    let (mut asked, mut open): (Vec<&str>, Vec<&str>) = (Vec::new(), Vec::new());
    for (i, m) in messages.iter().enumerate() {
        if m.role == "tool" {
            let Some(id) = m.tool_call_id.as_deref() else {
                return Err(ApiError::field(
                    &format!("messages[{i}].tool_call_id"),
                    "a message with role `tool` needs the `tool_call_id` of the call it answers",
                ));
            };
            if !asked.contains(&id) {
                return Err(ApiError::field(
                    &format!("messages[{i}].tool_call_id"),
                    format!("`{id}` is not the id of a call in the assistant message before this tool message"),
                ));
            }
            open.retain(|o| *o != id);
            continue;
        }
        if !open.is_empty() {
            return Err(unanswered(&format!("messages[{i}]"), &open));
        }
        asked.clear();
        if m.role == "assistant" {
            for (j, call) in m.tool_calls.iter().flatten().enumerate() {
                let Some(id) = call.get("id").and_then(Value::as_str).filter(|id| !id.is_empty()) else {
                    return Err(ApiError::field(
                        &format!("messages[{i}].tool_calls[{j}].id"),
                        "a tool call needs an `id`",
                    ));
                };
                if call.pointer("/function/name").and_then(Value::as_str).is_none_or(str::is_empty) {
                    return Err(ApiError::field(
                        &format!("messages[{i}].tool_calls[{j}].function.name"),
                        "a tool call needs the name of its function",
                    ));
                }
                asked.push(id);
            }
            open = asked.clone();
        }
    }
    // Answers to only some calls at the end leave the model to go on with the rest unanswered. (A
    // last assistant message with calls and no answers stays: a prefill to continue.)
    if messages.last().is_some_and(|m| m.role == "tool") && !open.is_empty() {
        return Err(unanswered("messages", &open));
    }
    Ok(())
}

/// An OpenAI tool call as chat templates read it: `function.arguments`, a JSON string on the wire, as
/// the object it encodes (Hugging Face templates write it with `tojson`), as llama-server does.
fn template_tool_call(call: &Value) -> Value {
    let mut call = call.clone();
    if let Some(args) = call.pointer_mut("/function/arguments") {
        if let Some(parsed) = args.as_str().and_then(|s| serde_json::from_str::<Value>(s).ok()) {
            *args = parsed;
        }
    }
    call
}

/// How a conversation's prompt ends, as a request asks: llama-server's `add_generation_prompt` (default
/// true) and `continue_final_message` (`true` or `"content"`).
#[derive(Default, Clone, Copy)]
pub struct PromptEnd<'a> {
    pub add_generation_prompt: Option<bool>,
    pub continue_final_message: Option<&'a Value>,
    /// llama-server's rule on its chat routes: two assistant messages at the end are refused (where
    /// no continuation is asked for).
    pub one_final_assistant: bool,
}

impl PromptEnd<'_> {
    /// Whether the request asks for the final message to be continued (else it is, as llama-server
    /// does, where that message is the assistant's).
    fn continues(&self) -> Result<bool, ApiError> {
        let field = "continue_final_message";
        let asked = match self.continue_final_message {
            None | Some(Value::Null) | Some(Value::Bool(false)) => false,
            Some(Value::Bool(true)) => true,
            Some(Value::String(s)) if s == "content" => true,
            Some(Value::String(s)) if s == "reasoning_content" => {
                return Err(ApiError::field(field, "continuing a message's reasoning_content is not supported"))
            }
            Some(v) => {
                return Err(ApiError::field(field, format!("{field} must be true, false or \"content\", got {v}")))
            }
        };
        // (llama-server's rule: add_generation_prompt defaults to true, so a continuation sets it false.)
        if asked && self.add_generation_prompt != Some(false) {
            return Err(ApiError::field(
                "add_generation_prompt",
                "Cannot set both add_generation_prompt and continue_final_message to true (add_generation_prompt defaults to true)",
            ));
        }
        Ok(asked)
    }
}

/// The token ids of a conversation through the model's chat template. A conversation that ends with
/// an assistant message is a prefill, as Anthropic's API and llama-server take it: the answer
/// continues that message (the turns before it, the assistant's turn opened, then its text). `end`
/// may ask for that explicitly, or for no generation prompt. With thinking switched off
/// (`enable_thinking: false`), a thought the template opens anyway (as DeepSeek-R1's does, without
/// that switch) is closed before the answer.
pub fn chat_prompt(
    model: &LoadedModel,
    messages: &[ChatMessage],
    kwargs: Option<&serde_json::Map<String, Value>>,
    tools: Option<&Tooling>,
    end: PromptEnd,
) -> Result<(String, Vec<u32>), ApiError> {
    let tools = tools.map(|t| t.tools.as_slice());
    let continues = end.continues()?;
    let assistant = |m: &ChatMessage| m.role == "assistant" && m.tool_calls.is_none();
    if let [.., before, last] = messages {
        if end.one_final_assistant && !continues && last.role == "assistant" && before.role == "assistant" {
            return Err(ApiError::field(
                "messages",
                "Cannot have 2 or more assistant messages at the end of the list.",
            ));
        }
    }
    let prefill =
        match messages {
            [.., last] if assistant(last) => true,
            _ if continues => return Err(ApiError::field(
                "continue_final_message",
                "continue_final_message needs the conversation to end with an assistant message (without tool calls)",
            )),
            _ => false,
        };
    let adapted = super::tools::history_for(model.facts.chat_template.as_deref(), messages);
    let messages = adapted.as_deref().unwrap_or(messages);
    let t = model.text.chat_template.as_ref().ok_or_else(|| {
        ApiError::invalid(
            "this model has no chat template; start the server with --chat-template-file, or use /v1/completions",
        )
    })?;
    let text = match messages.split_last() {
        Some((last, before)) if prefill => {
            let rendered = t.render_with(before, true, kwargs, tools).map_err(|e| match before.is_empty() {
                true => ApiError::field(
                    "messages",
                    format!("this model's chat template cannot open an answer with nothing before it (a conversation of one assistant message is a prefill): {e}"),
                ),
                false => ApiError::invalid(e),
            })?;
            rendered + &last.content
        }
        _ => t
            .render_with(messages, end.add_generation_prompt.unwrap_or(true), kwargs, tools)
            .map_err(ApiError::invalid)?,
    };
    let thinking_off = kwargs.and_then(|k| k.get("enable_thinking")) == Some(&Value::Bool(false));
    let text = if thinking_off && reasoning::forced_open(&text) { text + "\n</think>\n\n" } else { text };
    let ids = model.text.encode(&text, false).map_err(|e| ApiError::internal(e.to_string()))?;
    Ok((text, ids))
}

fn usage_json(prompt_tokens: usize, cached: usize, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

fn token_entry(tok: &TextTokenizer, id: u32, logprob: f32) -> Value {
    json!({"token": token_label(tok, id), "logprob": logprob, "bytes": tok.token_bytes(id)})
}

/// Chat logprobs: `{"content": [{token, logprob, bytes, top_logprobs: [...]}]}`.
fn chat_logprobs(tok: &TextTokenizer, lps: &[TokenLogprob]) -> Value {
    let content: Vec<Value> = lps
        .iter()
        .map(|l| {
            let mut e = token_entry(tok, l.token, l.logprob);
            e["top_logprobs"] = l.top.iter().map(|(id, lp)| token_entry(tok, *id, *lp)).collect();
            e
        })
        .collect();
    json!({ "content": content })
}

/// Legacy completions logprobs: parallel lists, token by token. `text_offset` counts characters
/// from where it starts: a token's offset is the number of characters begun before its bytes.
struct LegacyLogprobs<'a> {
    tok: &'a TextTokenizer,
    offset: usize,
    tokens: Vec<String>,
    token_logprobs: Vec<Value>,
    top: Vec<Value>,
    offsets: Vec<usize>,
}

impl<'a> LegacyLogprobs<'a> {
    fn new(tok: &'a TextTokenizer, start_offset: usize) -> Self {
        let (tokens, token_logprobs, top, offsets) = (vec![], vec![], vec![], vec![]);
        LegacyLogprobs { tok, offset: start_offset, tokens, token_logprobs, top, offsets }
    }

    /// An echoed prompt, `ids` echoed as `text`, and `scores` of its tokens after the first (which
    /// has none: `null`, as in OpenAI's answer). Offsets count the characters the prompt decodes to
    /// before each token (a token that shows no text, such as a BOS, adds none); what follows
    /// starts after `text`.
    fn prompt(mut self, ids: &[u32], scores: &[TokenLogprob], text: &str) -> Self {
        let mut stream = self.tok.inner.decode_stream(true);
        let mut at = self.offset;
        for (k, &id) in ids.iter().enumerate() {
            let scored = k.checked_sub(1).and_then(|i| scores.get(i));
            let (logprob, top) = match scored {
                Some(l) => (json!(l.logprob), self.top_of(l)),
                None => (Value::Null, Value::Null),
            };
            self.offsets.push(at);
            at += stream.step(id).ok().flatten().map_or(0, |piece| piece.chars().count());
            self.tokens.push(token_label(self.tok, id));
            self.token_logprobs.push(logprob);
            self.top.push(top);
        }
        self.offset += text.chars().count();
        self
    }

    fn top_of(&self, l: &TokenLogprob) -> Value {
        Value::Object(l.top.iter().map(|(id, lp)| (token_label(self.tok, *id), json!(lp))).collect())
    }

    fn scored(mut self, lps: &[TokenLogprob]) -> Self {
        for l in lps {
            let top = self.top_of(l);
            self.token(l.token, json!(l.logprob), top);
        }
        self
    }

    fn token(&mut self, id: u32, logprob: Value, top: Value) {
        self.offsets.push(self.offset);
        // Every byte but a UTF-8 continuation byte begins a character.
        self.offset += self.tok.token_bytes(id).iter().filter(|&&b| b & 0xC0 != 0x80).count();
        self.tokens.push(token_label(self.tok, id));
        self.token_logprobs.push(logprob);
        self.top.push(top);
    }

    fn json(self) -> Value {
        let LegacyLogprobs { tokens, token_logprobs, top, offsets, .. } = self;
        json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets})
    }
}

fn completion_logprobs(tok: &TextTokenizer, lps: &[TokenLogprob], start_offset: usize) -> Value {
    LegacyLogprobs::new(tok, start_offset).scored(lps).json()
}

/// The answers per prompt that `field` (`n`, or llama-server's `n_cmpl`) asks for; streamed, each
/// answer's chunks carry its `index`.
fn check_n(field: &str, n: Option<u32>) -> Result<usize, ApiError> {
    let n = n.unwrap_or(1) as usize;
    if n == 0 || n > 16 {
        return Err(ApiError::out_of_range(field, true, n > 16, format!("{field} must be between 1 and 16, got {n}")));
    }
    Ok(n)
}

/// The token limit of the first of `fields` given: -1 is "no limit" (llama-server's, which its
/// clients send on these routes too), otherwise at least `min`.
fn token_limit(fields: &[(&str, Option<i64>)], min: i64) -> Result<Option<usize>, ApiError> {
    // llama-server's n_predict may be 0: the prompt alone, as editors warm the cache with it.
    let least = |f: &str| if f == "n_predict" { 0 } else { min };
    match fields.iter().find_map(|(f, v)| v.map(|v| (*f, v))) {
        None | Some((_, -1)) => Ok(None),
        Some((f, v)) if v < least(f) => {
            let message = format!("{f} must be at least {} (or -1 for no limit), got {v}", least(f));
            Err(ApiError::out_of_range(f, true, false, message))
        }
        Some((_, v)) => Ok(Some(v as usize)),
    }
}

fn check_stream_options(options: &Option<StreamOptions>, stream: bool) -> Result<(), ApiError> {
    if options.as_ref().and_then(|o| o.include_obfuscation) == Some(true) {
        return Err(ApiError::field(
            "stream_options.include_obfuscation",
            "stream obfuscation is not implemented; send include_obfuscation: false",
        ));
    }
    if options.is_some() && !stream {
        return Err(ApiError::field(
            "stream_options",
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
        ));
    }
    Ok(())
}

/// The request's tools, for the template and for reading calls back (None: no tools, or
/// `tool_choice: none`). `required` and a named function force a call (a grammar of calls holds the
/// answer, see [`Tooling::forced_grammar`]); otherwise a `strict` tool's calls are checked against
/// its schema (see [`Tooling`]).
pub fn request_tools(
    model: &LoadedModel,
    tools: &Option<Vec<Value>>,
    choice: Option<&Value>,
    parallel: Option<bool>,
) -> Result<Option<Tooling>, ApiError> {
    // `allowed_tools` narrows the tools the model is shown; `required` (also as its mode) and a
    // named function force a call.
    let mut allowed: Option<Vec<&str>> = None;
    let mut forced = None;
    let choice_str = match choice {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s == "auto" || s == "none" => Some(s.as_str()),
        Some(Value::String(s)) if s == "required" => {
            forced = Some(Forced::Any);
            None
        }
        Some(v) if v.get("type").and_then(Value::as_str) == Some("allowed_tools") => {
            // Chat nests the list (`allowed_tools: {mode, tools}`); Responses does not.
            let spec = v.get("allowed_tools").unwrap_or(v);
            match spec.get("mode").and_then(Value::as_str) {
                Some("auto") => {}
                Some("required") => forced = Some(Forced::Any),
                _ => return Err(ApiError::field("tool_choice", "allowed_tools takes mode `auto` or `required`")),
            }
            let names = spec.get("tools").and_then(Value::as_array).into_iter().flatten();
            let names = names.map(|t| t.pointer("/function/name").or_else(|| t.get("name")).and_then(Value::as_str));
            let names: Option<Vec<&str>> = names.collect();
            allowed = Some(names.ok_or_else(|| ApiError::field("tool_choice", "each allowed tool needs a name"))?);
            None
        }
        // Chat: `{"type": "function", "function": {"name"}}`; Responses: `{"type": "function", "name"}`.
        Some(v) if v.get("type").and_then(Value::as_str) == Some("function") => {
            let name = v.pointer("/function/name").or_else(|| v.get("name")).and_then(Value::as_str);
            let name = name.ok_or_else(|| ApiError::field("tool_choice", "a forced function needs its name"))?;
            forced = Some(Forced::Named(name.to_string()));
            None
        }
        Some(v) => {
            return Err(ApiError::field(
                "tool_choice",
                format!(
                    "tool_choice {v} is not supported (\"auto\", \"none\", \"required\", a function, or allowed_tools)"
                ),
            ))
        }
    };
    let Some(tools) = tools.as_ref().filter(|t| !t.is_empty()) else {
        return match forced {
            None => Ok(None),
            Some(_) => Err(ApiError::field("tool_choice", "tool_choice forces a call, but the request gives no tools")),
        };
    };
    if choice_str == Some("none") {
        return Ok(None);
    }
    let name_of = |t: &Value| t.pointer("/function/name").and_then(Value::as_str).unwrap_or_default().to_string();
    let tools: Vec<Value> = match &allowed {
        None => tools.clone(),
        Some(names) => {
            if let Some(n) = names.iter().find(|n| !tools.iter().any(|t| name_of(t) == **n)) {
                return Err(ApiError::field(
                    "tool_choice",
                    format!("allowed tool `{n}` is not among the request's tools"),
                ));
            }
            tools.iter().filter(|t| names.contains(&name_of(t).as_str())).cloned().collect()
        }
    };
    if tools.is_empty() {
        return match forced {
            None => Ok(None),
            Some(_) => Err(ApiError::field("tool_choice", "a call is forced but the request gives no tools")),
        };
    }
    for (i, t) in tools.iter().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::field(&format!("tools[{i}].type"), "only `function` tools are supported"));
        }
        if t.pointer("/function/name").and_then(Value::as_str).is_none_or(str::is_empty) {
            return Err(ApiError::field(&format!("tools[{i}].function.name"), "a function tool needs a name"));
        }
        if let Some(problem) = parameters_problem(t.pointer("/function/parameters"), "function.parameters") {
            return Err(ApiError::field(&format!("tools[{i}].function.parameters"), problem));
        }
    }
    let tooling = Tooling::new(tools, parallel.unwrap_or(true), model.facts.chat_template.as_deref())
        .map_err(|e| ApiError::field("tools", e))?;
    tooling.forcing(forced).map(Some).map_err(|e| ApiError::field("tool_choice", e))
}

pub async fn chat(State(state): State<Arc<AppState>>, Extension(log): Extension<RequestLog>, body: Bytes) -> Response {
    chat_inner(state, log, &body).await.unwrap_or_else(|e| e.in_dialect(Dialect::OpenAi).into_response())
}

/// A request's prompt as the chat template writes it (chat and Responses), with what it was
/// written from.
pub struct TemplatedPrompt {
    pub text: String,
    pub ids: Vec<u32>,
    pub effort: reasoning::Effort,
    /// The template variables the prompt was written with.
    pub kwargs: Option<serde_json::Map<String, Value>>,
}

/// The prompt of a chat request: its messages, `tooling` (the request's tools) and reasoning effort
/// through the template.
fn chat_prompt_of(
    state: &AppState,
    model: &LoadedModel,
    r: &ChatRequest,
    tooling: Option<&Tooling>,
) -> Result<TemplatedPrompt, ApiError> {
    let messages = chat_messages(&r.messages)?;
    let effort =
        reasoning::effort(r.reasoning_effort.as_deref(), "reasoning_effort", model.facts.chat_template.as_deref())?;
    let kwargs = state.template_kwargs_with(&effort.vars, r.chat_template_kwargs.as_ref());
    let end = PromptEnd {
        add_generation_prompt: r.add_generation_prompt,
        continue_final_message: r.continue_final_message.as_ref(),
        one_final_assistant: true,
    };
    let (text, ids) = chat_prompt(model, &messages, kwargs.as_ref(), tooling, end)?;
    Ok(TemplatedPrompt { text, ids, effort, kwargs })
}

/// The prompt a chat request's body would be answered from, for the routes that only render it
/// (`/v1/chat/completions/input_tokens`, llama-server's `/apply-template`, which read any chat
/// request); the generating fields it may carry are read and change nothing here.
pub fn templated_chat_body(state: &AppState, model: &LoadedModel, body: &[u8]) -> Result<TemplatedPrompt, ApiError> {
    let (r, _): (ChatRequest, LlamaSamplers) = parse_body_with(body)?;
    let tooling = request_tools(model, &r.tools, r.tool_choice.as_ref(), r.parallel_tool_calls)?;
    chat_prompt_of(state, model, &r, tooling.as_ref())
}

/// `POST /v1/chat/completions/input_tokens` (llama-server's): the tokens a chat request's prompt
/// would take, answered as OpenAI's `/v1/responses/input_tokens` answers.
pub async fn chat_input_tokens(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let run = || -> Result<Response, ApiError> {
        let model = state.ready()?;
        let n = templated_chat_body(&state, model, &body)?.ids.len();
        Ok(Json(json!({"object": "response.input_tokens", "input_tokens": n})).into_response())
    };
    run().unwrap_or_else(|e| e.in_dialect(Dialect::OpenAi).into_response())
}

async fn chat_inner(state: Arc<AppState>, log: RequestLog, body: &[u8]) -> Result<Response, ApiError> {
    let model = state.ready()?;
    let (r, llama_samplers): (ChatRequest, LlamaSamplers) = parse_body_with(body)?;
    let (schema, schema_field) = match structured::requested_schema(r.response_format.as_ref(), "response_format")? {
        Some(s) => (Some(s), "response_format"),
        None => (r.json_schema.clone().filter(|s| !s.is_null()), "json_schema"),
    };
    let tooling = request_tools(model, &r.tools, r.tool_choice.as_ref(), r.parallel_tool_calls)?;
    structured::refuse_with_tools(schema.is_some(), tooling.is_some(), schema_field)?;
    let stream = r.stream.unwrap_or(false);
    let n = check_n("n", r.n)?;
    check_stream_options(&r.stream_options, stream)?;
    let limit = token_limit(
        &[("max_completion_tokens", r.max_completion_tokens), ("max_tokens", r.max_tokens), ("n_predict", r.n_predict)],
        1,
    )?;
    let extras = StreamExtras::new(r.timings_per_token, r.return_progress, stream)?;
    let reasoning = reasoning::request_format(&state, r.reasoning_format.as_deref(), false)?;
    let TemplatedPrompt { text: prompt_text, ids: prompt, effort, kwargs } =
        chat_prompt_of(&state, model, &r, tooling.as_ref())?;
    let thinking = reasoning::forced_open(&prompt_text);
    let mut sampling = sampling_fields!(r).apply(&model.facts.default_sampling, model.facts.ctx_size)?;
    llama_samplers.apply(&mut sampling)?;
    let mut job = Job::new(prompt, sampling);
    job.slot = llama_samplers.slot()?;
    if let Some(b) = &r.logit_bias {
        job.sampling.logit_bias = logit_bias(b, model, true)?;
    }
    job.max_tokens = limit;
    job.stop = r.stop.map(StopField::into_vec).unwrap_or_default();
    let held_at = if schema.is_some() { schema_field } else { "tool_choice" };
    match schema {
        Some(_) => job.constraint = structured::constraint(model, schema, schema_field)?,
        None => structured::force_calls(model, tooling.as_ref(), &mut job)?,
    }
    let effort_budget = effort.budget_under(r.chat_template_kwargs.as_ref());
    // llama-server's per-request cap applies where the server sets none.
    let asked = match r.thinking_budget_tokens {
        None | Some(-1) => None,
        Some(n) => Some(usize::try_from(n).map_err(|_| {
            ApiError::field("thinking_budget_tokens", "thinking_budget_tokens must be ≥ -1 (-1: no cap)")
        })?),
    };
    let server = reasoning::server_budget(&state, kwargs.as_ref());
    let budget = reasoning::tighter(server.or(asked), effort_budget);
    job.thought_budget = reasoning::thought_budget(model, budget, &prompt_text)?;
    structured::after_thought(model, &prompt_text, &mut job, reasoning != ReasoningFormat::Split, held_at)?;
    job.shown_special = super::tools::shown_tags(&model.text, tooling.as_ref());
    job.cache_prompt = r.cache_prompt;
    job.ignore_eos = r.ignore_eos.unwrap_or(false);
    let want_logprobs = r.logprobs.unwrap_or(false);
    if let Some(k) = r.top_logprobs {
        if !want_logprobs {
            return Err(ApiError::field("top_logprobs", "top_logprobs needs logprobs: true"));
        }
        if k > 20 {
            let message = format!("top_logprobs must be at most 20, got {k}");
            return Err(ApiError::out_of_range("top_logprobs", true, true, message));
        }
    }
    job.logprobs = want_logprobs.then(|| r.top_logprobs.unwrap_or(0) as usize);
    let model_name = r.model.filter(|m| !m.is_empty()).unwrap_or_else(|| model.facts.id.clone());
    let id = new_id("chatcmpl-");

    let jobs: Vec<Job> = (0..n).map(|i| job.with_seed_offset(i)).collect();
    if stream {
        // Each choice streams on its own, its chunks interleaved with the others' by `index`.
        let (stops, prompt_tokens) = (job.stop.clone(), job.prompt.len());
        let (created, include_usage) = (unix_time(), r.stream_options.and_then(|o| o.include_usage).unwrap_or(false));
        let streams = submit_all(jobs, &state, model, Asked { prompt: "messages", count: "n" })?
            .into_iter()
            .enumerate()
            .map(|(index, (events, _))| {
                let dialect = ChatStream {
                    id: id.clone(),
                    index,
                    created,
                    model: model_name.clone(),
                    include_usage,
                    logprobs: want_logprobs,
                    tok: model.text.clone(),
                    split: Splitter::new(reasoning, thinking),
                    calls: tooling.as_ref().map(|t| t.parser("call_")),
                    sent_calls: 0,
                    extras,
                };
                (events, dialect, prompt_tokens)
            })
            .collect();
        return Ok(stream_many(streams, n, stops, model.text.clone(), state.clone(), log));
    }

    let done = run_all(jobs, &state, model, Asked { prompt: "messages", count: "n" }, &log).await?;
    let choices: Vec<Value> = done
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let parts = Splitter::split_all(reasoning, thinking, &c.text);
            let (content, calls) = match &tooling {
                Some(t) => t.split("call_", &parts.content),
                None => (parts.content, vec![]),
            };
            let mut message = json!({"role": "assistant", "content": content});
            if !calls.is_empty() {
                if content.trim().is_empty() {
                    message["content"] = Value::Null;
                }
                message["tool_calls"] = calls.iter().map(ToolCall::openai).collect();
            }
            if !parts.reasoning.is_empty() {
                message["reasoning_content"] = json!(parts.reasoning);
            }
            json!({
                "index": i,
                "message": message,
                "logprobs": if want_logprobs { chat_logprobs(&model.text, &c.logprobs) } else { Value::Null },
                "finish_reason": finish_reason(&c.ending, calls.len()),
            })
        })
        .collect();
    let u = &done[0].usage;
    let completion_tokens = done.iter().map(|c| c.usage.completion_tokens).sum();
    Ok(Json(json!({
        "id": id,
        "object": "chat.completion",
        "created": unix_time(),
        "model": model_name,
        "system_fingerprint": system_fingerprint(),
        "choices": choices,
        "usage": usage_json(u.prompt_tokens, u.cached_tokens, completion_tokens),
        "timings": timings(u),
    }))
    .into_response())
}

/// `finish_reason`: an answer that called tools ended to let them run.
fn finish_reason(ending: &Ending, calls: usize) -> &'static str {
    match ending {
        Ending::Eos | Ending::StopWord(_) if calls > 0 => "tool_calls",
        e => e.openai(),
    }
}

/// The end of an OpenAI stream: the usage chunk (`template` with `usage` filled in) if asked for,
/// then `[DONE]`.
fn end_of_stream(include_usage: bool, mut template: Value, total: &Usage) -> Vec<Event> {
    let mut out = vec![];
    if include_usage {
        template["usage"] = usage_json(total.prompt_tokens, total.cached_tokens, total.completion_tokens);
        out.push(data(&template));
    }
    out.push(Event::default().data("[DONE]"));
    out
}

fn system_fingerprint() -> String {
    format!("mlxcel-{}", env!("CARGO_PKG_VERSION"))
}

struct ChatStream {
    id: String,
    /// Which choice this is (of `n`).
    index: usize,
    created: u64,
    model: String,
    include_usage: bool,
    logprobs: bool,
    tok: Arc<TextTokenizer>,
    split: Splitter,
    /// The answer's call reader, and the calls sent.
    calls: Option<CallParser>,
    sent_calls: usize,
    extras: StreamExtras,
}

impl ChatStream {
    fn chunk(&self, delta: Value, finish: Option<&str>, logprobs: Value) -> Value {
        let mut c = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": system_fingerprint(),
            "choices": [{"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        });
        if self.include_usage {
            c["usage"] = Value::Null;
        }
        c
    }

    /// The chunks for new reasoning and answer text: one for the text, one per tool call read from
    /// it (the logprobs, and `timings` if asked for, on the first; a chunk for logprobs alone when
    /// the text is all held back). `end`: the answer is over, so the call reader gives what it held.
    fn deltas(&mut self, parts: Parts, end: bool, logprobs: Value, live: &Live) -> Vec<Event> {
        let (content, calls) = text_and_calls(pieces_through(&mut self.calls, &parts.content, end));
        let parts = Parts { reasoning: parts.reasoning, content };
        let mut deltas = vec![];
        if !parts.is_empty() || (!logprobs.is_null() && calls.is_empty()) {
            deltas.push(Self::delta(&parts));
        }
        for c in calls {
            let mut call = c.openai();
            call["index"] = json!(self.sent_calls);
            self.sent_calls += 1;
            deltas.push(json!({"tool_calls": [call]}));
        }
        let mut logprobs = Some(logprobs);
        deltas
            .into_iter()
            .map(|d| {
                let mut c = self.chunk(d, None, logprobs.take().unwrap_or(Value::Null));
                self.extras.add_timings(&mut c, live);
                data(&c)
            })
            .collect()
    }

    /// A delta of reasoning and answer text (`content` present unless the delta is reasoning alone).
    fn delta(parts: &Parts) -> Value {
        let mut d = json!({});
        if !parts.reasoning.is_empty() {
            d["reasoning_content"] = json!(parts.reasoning);
        }
        if !parts.content.is_empty() || parts.reasoning.is_empty() {
            d["content"] = json!(parts.content);
        }
        d
    }
}

impl StreamDialect for ChatStream {
    fn start(&mut self, _live: &Live) -> Vec<Event> {
        // `content: null`, as llama-server's first chunk: the SDKs add up the content deltas, and an
        // empty string there made an answer of tool calls alone have content "" instead of none.
        vec![data(&self.chunk(json!({"role": "assistant", "content": null}), None, Value::Null))]
    }

    fn progress(&mut self, live: &Live, progress: Value) -> Vec<Event> {
        let c = self.chunk(json!({"role": "assistant", "content": null}), None, Value::Null);
        self.extras.progress(c, progress, live)
    }

    fn text(&mut self, text: &str, _tokens: &[u32], logprobs: &[TokenLogprob], live: &Live) -> Vec<Event> {
        let parts = self.split.push(text);
        let lp = if self.logprobs { chat_logprobs(&self.tok, logprobs) } else { Value::Null };
        self.deltas(parts, false, lp, live)
    }

    fn done(&mut self, ending: &Ending, usage: &Usage, live: &Live) -> Vec<Event> {
        let rest = self.split.finish();
        let mut out = self.deltas(rest, true, Value::Null, live);
        let mut last = self.chunk(json!({}), Some(finish_reason(ending, self.sent_calls)), Value::Null);
        last["timings"] = timings(usage);
        out.push(data(&last));
        out
    }

    fn end(&mut self, total: &Usage) -> Vec<Event> {
        let mut u = self.chunk(json!({}), None, Value::Null);
        u["choices"] = json!([]);
        end_of_stream(self.include_usage, u, total)
    }

    fn error(&mut self, e: &ApiError) -> Vec<Event> {
        vec![data(&e.clone().in_dialect(Dialect::OpenAi).body())]
    }
}

/// `prompt` of `/v1/completions`: a string, a list of strings, token ids, or a list of token-id lists.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum PromptField {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Deserialize, Debug)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: PromptField,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<i64>,
    pub n_predict: Option<i64>,
    pub stop: Option<StopField>,
    pub n: Option<u32>,
    /// llama-server's name for `n`.
    pub n_cmpl: Option<u32>,
    pub logprobs: Option<u32>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<u32>,
    pub cache_prompt: Option<bool>,
    pub ignore_eos: Option<bool>,
    pub logit_bias: Option<Value>,
    pub timings_per_token: Option<bool>,
    pub return_progress: Option<bool>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub repeat_last_n: Option<i64>,
}

/// The prompts of a completion request as (text, token ids).
fn prompts(model: &LoadedModel, p: PromptField) -> Result<Vec<(String, Vec<u32>)>, ApiError> {
    let enc = |s: &str| model.text.encode(s, true).map_err(|e| ApiError::internal(e.to_string()));
    let dec = |ids: &[u32]| model.text.decode(ids).map_err(|e| ApiError::field("prompt", e.to_string()));
    let vocab = model.facts.vocab_size as u32;
    let check = |ids: &[u32]| match ids.iter().find(|&&t| t >= vocab) {
        Some(t) => Err(ApiError::field("prompt", format!("token id {t} is outside the vocabulary (size {vocab})"))),
        None => Ok(()),
    };
    let out = match p {
        PromptField::Text(s) => vec![(s.clone(), enc(&s)?)],
        PromptField::Texts(v) => v.iter().map(|s| Ok((s.clone(), enc(s)?))).collect::<Result<_, ApiError>>()?,
        PromptField::Tokens(ids) => {
            check(&ids)?;
            vec![(dec(&ids)?, ids)]
        }
        PromptField::TokenLists(v) => v
            .into_iter()
            .map(|ids| {
                check(&ids)?;
                Ok((dec(&ids)?, ids))
            })
            .collect::<Result<_, ApiError>>()?,
    };
    if out.is_empty() {
        return Err(ApiError::field("prompt", "the prompt is empty"));
    }
    Ok(out)
}

pub async fn completions(
    State(state): State<Arc<AppState>>,
    Extension(log): Extension<RequestLog>,
    body: Bytes,
) -> Response {
    completions_inner(state, log, &body).await.unwrap_or_else(|e| e.in_dialect(Dialect::OpenAi).into_response())
}

async fn completions_inner(state: Arc<AppState>, log: RequestLog, body: &[u8]) -> Result<Response, ApiError> {
    let model = state.ready()?;
    let (r, llama_samplers): (CompletionRequest, LlamaSamplers) = parse_body_with(body)?;
    if r.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::field("suffix", "suffix (fill-in-the-middle) is not supported by this server"));
    }
    if r.best_of.is_some_and(|b| b > 1) {
        return Err(ApiError::field("best_of", "best_of > 1 is not supported"));
    }
    let echo = r.echo.unwrap_or(false);
    if let Some(k) = r.logprobs {
        if k > 5 {
            return Err(ApiError::out_of_range("logprobs", true, true, format!("logprobs must be at most 5, got {k}")));
        }
    }
    let stream = r.stream.unwrap_or(false);
    // llama-server's name for `n` on this route too.
    let n = match r.n_cmpl {
        Some(k) => check_n("n_cmpl", Some(k))?,
        None => check_n("n", r.n)?,
    };
    check_stream_options(&r.stream_options, stream)?;
    let extras = StreamExtras::new(r.timings_per_token, r.return_progress, stream)?;
    let prompts = prompts(model, r.prompt)?;
    let mut sampling = sampling_fields!(r).apply(&model.facts.default_sampling, model.facts.ctx_size)?;
    llama_samplers.apply(&mut sampling)?;
    if let Some(b) = &r.logit_bias {
        sampling.logit_bias = logit_bias(b, model, true)?;
    }
    let stop = r.stop.map(StopField::into_vec).unwrap_or_default();
    let model_name = r.model.filter(|m| !m.is_empty()).unwrap_or_else(|| model.facts.id.clone());
    let id = new_id("cmpl-");
    let limit = token_limit(&[("max_tokens", r.max_tokens), ("n_predict", r.n_predict)], 0)?;
    let slot = llama_samplers.slot()?;
    let make_job = |ids: Vec<u32>| {
        let mut job = Job::new(ids, sampling.clone());
        job.max_tokens = limit;
        job.stop = stop.clone();
        job.cache_prompt = r.cache_prompt;
        job.ignore_eos = r.ignore_eos.unwrap_or(false);
        job.logprobs = r.logprobs.map(|k| k as usize);
        // Echoed with logprobs, the prompt is scored too (what evaluation harnesses ask for).
        job.prompt_logprobs = job.logprobs.filter(|_| echo);
        // Each prompt's first answer runs in the slot asked for (see `Job::with_seed_offset`).
        job.slot = slot;
        job
    };

    // `n` answers to each prompt, listed prompt by prompt.
    let mut jobs = Vec::with_capacity(prompts.len() * n);
    for (_, ids) in &prompts {
        let job = make_job(ids.clone());
        jobs.extend((0..n).map(|i| job.with_seed_offset(i)));
    }
    let count = if n == 1 {
        "prompt"
    } else if r.n_cmpl.is_some() {
        "n_cmpl"
    } else {
        "n"
    };
    let asked = Asked { prompt: "prompt", count };
    if stream {
        // Each answer is a choice of its own, its chunks interleaved with the others' by `index`.
        // (The prompt's ids go with its echo, whose logprobs list them.)
        let lens: Vec<(usize, Vec<u32>)> =
            jobs.iter().map(|j| (j.prompt.len(), if echo { j.prompt.clone() } else { vec![] })).collect();
        let texts: Vec<String> = prompts.iter().flat_map(|(text, _)| std::iter::repeat_n(text.clone(), n)).collect();
        let created = unix_time();
        let include_usage = r.stream_options.and_then(|o| o.include_usage).unwrap_or(false);
        let streams = submit_all(jobs, &state, model, asked)?
            .into_iter()
            .zip(texts)
            .zip(lens)
            .enumerate()
            .map(|(index, (((events, _), text), (prompt_tokens, prompt_ids)))| {
                let dialect = CompletionStream {
                    id: id.clone(),
                    index,
                    created,
                    model: model_name.clone(),
                    include_usage,
                    logprobs: r.logprobs.is_some(),
                    echo: echo.then_some(text),
                    prompt_ids,
                    offset: 0,
                    tok: model.text.clone(),
                    extras,
                };
                (events, dialect, prompt_tokens)
            })
            .collect();
        return Ok(stream_many(streams, n, stop, model.text.clone(), state.clone(), log));
    }

    let done = run_all(jobs, &state, model, asked, &log).await?;
    // A prompt asked to be scored and cut short before it was (`--timeout`, shutdown) is an error:
    // an answer with its scores missing would be read as one with them.
    if r.logprobs.is_some() && echo && done.iter().any(|c| c.prompt_logprobs.is_none()) {
        return Err(unscored());
    }
    let mut choices = Vec::new();
    let (mut prompt_tokens, mut cached, mut completion_tokens) = (0, 0, 0);
    for (i, c) in done.iter().enumerate() {
        let prompt_text = &prompts[i / n].0;
        let text = if echo { format!("{prompt_text}{}", c.text) } else { c.text.clone() };
        let logprobs = match r.logprobs {
            Some(_) => {
                let (prompt_text, ids) = &prompts[i / n];
                let lp = match (echo, &c.prompt_logprobs) {
                    (true, Some(scores)) => LegacyLogprobs::new(&model.text, 0).prompt(ids, scores, prompt_text),
                    _ => LegacyLogprobs::new(&model.text, 0),
                };
                lp.scored(&c.logprobs).scored(c.end_token.as_slice()).json()
            }
            None => Value::Null,
        };
        choices.push(json!({"index": i, "text": text, "logprobs": logprobs, "finish_reason": c.ending.openai()}));
        if i % n == 0 {
            prompt_tokens += c.usage.prompt_tokens;
            cached += c.usage.cached_tokens;
        }
        completion_tokens += c.usage.completion_tokens;
    }
    Ok(Json(json!({
        "id": id,
        "object": "text_completion",
        "created": unix_time(),
        "model": model_name,
        "system_fingerprint": system_fingerprint(),
        "choices": choices,
        "usage": usage_json(prompt_tokens, cached, completion_tokens),
        "timings": timings(&done[0].usage),
    }))
    .into_response())
}

struct CompletionStream {
    id: String,
    /// Which prompt's choice this is.
    index: usize,
    created: u64,
    model: String,
    include_usage: bool,
    logprobs: bool,
    /// The prompt, while it is still to be echoed.
    echo: Option<String>,
    prompt_ids: Vec<u32>,
    offset: usize,
    tok: Arc<TextTokenizer>,
    extras: StreamExtras,
}

impl CompletionStream {
    /// The echo chunk, with the prompt's logprobs, if it is still to be sent.
    fn echo_prompt(&mut self, scores: &[TokenLogprob]) -> Vec<Event> {
        let Some(p) = self.echo.take() else { return vec![] };
        let lp = LegacyLogprobs::new(&self.tok, 0).prompt(&self.prompt_ids, scores, &p);
        self.offset = lp.offset;
        vec![data(&self.chunk(&p, None, lp.json()))]
    }

    fn chunk(&self, text: &str, finish: Option<&str>, logprobs: Value) -> Value {
        let mut c = json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": system_fingerprint(),
            "choices": [{"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        });
        if self.include_usage {
            c["usage"] = Value::Null;
        }
        c
    }
}

impl StreamDialect for CompletionStream {
    fn start(&mut self, _live: &Live) -> Vec<Event> {
        // With logprobs, the echo waits for the prompt's scores and carries them.
        match self.echo.take_if(|_| !self.logprobs) {
            Some(p) => vec![data(&self.chunk(&p, None, Value::Null))],
            None => vec![],
        }
    }

    fn prompt_logprobs(&mut self, scores: &[TokenLogprob], _live: &Live) -> Vec<Event> {
        self.echo_prompt(scores)
    }

    fn progress(&mut self, live: &Live, progress: Value) -> Vec<Event> {
        self.extras.progress(self.chunk("", None, Value::Null), progress, live)
    }

    /// Listed with no text, as OpenAI's legacy completions list an `<|endoftext|>` they end at.
    fn end_token(&mut self, token: &TokenLogprob, live: &Live) -> Vec<Event> {
        self.text("", &[], std::slice::from_ref(token), live)
    }

    fn text(&mut self, text: &str, _tokens: &[u32], logprobs: &[TokenLogprob], live: &Live) -> Vec<Event> {
        let lp = if self.logprobs { completion_logprobs(&self.tok, logprobs, self.offset) } else { Value::Null };
        self.offset += text.chars().count();
        let mut c = self.chunk(text, None, lp);
        self.extras.add_timings(&mut c, live);
        vec![data(&c)]
    }

    fn done(&mut self, ending: &Ending, usage: &Usage, _live: &Live) -> Vec<Event> {
        // Cut short before the prompt was scored: an error, not an echo without its scores.
        if self.logprobs && self.echo.take().is_some() {
            return self.error(&unscored());
        }
        let mut last = self.chunk("", Some(ending.openai()), Value::Null);
        last["timings"] = timings(usage);
        vec![data(&last)]
    }

    fn end(&mut self, total: &Usage) -> Vec<Event> {
        let mut u = self.chunk("", None, Value::Null);
        u["choices"] = json!([]);
        end_of_stream(self.include_usage, u, total)
    }

    fn error(&mut self, e: &ApiError) -> Vec<Event> {
        vec![data(&e.clone().in_dialect(Dialect::OpenAi).body())]
    }
}

/// A scored prompt's request cut short before its prompt was scored.
fn unscored() -> ApiError {
    ApiError::new(
        ErrorKind::Timeout,
        "the request was cut short (--timeout, or the server shutting down) before its prompt was scored",
    )
}

/// `/v1/models` (and `/models`): the one served model.
/// The served model as a model object of both APIs that list models at `/v1/models` — OpenAI's
/// (`object`, `created`, `owned_by`) and Anthropic's (`type`, `display_name`, `created_at`) — so
/// either SDK reads it (a speech model's, on a transcription server).
fn model_object(state: &AppState) -> Result<Value, ApiError> {
    let created_at = chrono::DateTime::from_timestamp(state.started_unix as i64, 0)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let common = |id: &str| {
        json!({"id": id, "object": "model", "created": state.started_unix, "owned_by": "mlxcel",
               "type": "model", "display_name": id, "created_at": created_at})
    };
    if let Some(s) = state.speech.get() {
        let mut m = common(&s.id);
        m["meta"] = json!({"task": "asr", "path": s.path, "n_ctx": s.n_ctx()});
        return Ok(m);
    }
    let f = &state.ready()?.facts;
    let mut m = common(&f.id);
    m["meta"] = json!({
            "n_ctx": f.ctx_size,
            "n_ctx_train": f.ctx_train,
            "n_vocab": f.vocab_size,
            "size": f.weight_bytes,
            "architecture": f.architecture,
            "path": f.path,
    });
    Ok(m)
}

/// `GET /v1/models`: the one served model, as OpenAI's list and Anthropic's page.
pub async fn models(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    match model_object(&state) {
        Ok(m) => {
            let id = m["id"].clone();
            Json(json!({"object": "list", "data": [m], "has_more": false, "first_id": id, "last_id": id}))
                .into_response()
        }
        Err(e) => e.in_dialect(Dialect::of_request("/v1/models", &headers)).into_response(),
    }
}

/// `GET /v1/models/{id}`: the served model under its own name (or alias); any other name is a 404,
/// as OpenAI answers for a model that does not exist.
pub async fn model(State(state): State<Arc<AppState>>, Path(id): Path<String>, headers: HeaderMap) -> Response {
    let id = id.trim_start_matches('/');
    let found = model_object(&state).and_then(|m| {
        // The route drops a leading slash, which an id given as an absolute path has.
        if m["id"].as_str().map(|s| s.trim_start_matches('/')) == Some(id) {
            Ok(m)
        } else {
            Err(ApiError::new(
                ErrorKind::NotFound,
                format!(
                    "The model `{id}` does not exist (this server serves `{}`)",
                    m["id"].as_str().unwrap_or_default()
                ),
            )
            .with_code("model_not_found"))
        }
    });
    match found {
        Ok(m) => Json(m).into_response(),
        Err(e) => e.in_dialect(Dialect::of_request("/v1/models/", &headers)).into_response(),
    }
}
