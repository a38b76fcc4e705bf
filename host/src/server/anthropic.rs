//! The Anthropic dialect: `/v1/messages` (plain and streamed with Anthropic's event sequence) and
//! `/v1/messages/count_tokens`. `usage.input_tokens` counts the prompt tokens computed,
//! `cache_read_input_tokens` those served from the prefix cache, as Anthropic reports them.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{json, Value};

use super::completion::{collect, new_id, stream_response, submit, Ending, Job, Live, StreamDialect};
use super::error::{parse_body, ApiError, Dialect};
use super::openai::{chat_prompt, StopField};
use super::reasoning::{self, Parts, ReasoningFormat, Splitter};
use super::state::{AppState, LoadedModel, RequestLog};
use crate::engine::{TokenLogprob, Usage};
use crate::text::ChatMessage;

/// `system` and message `content`: a string or a list of blocks.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Blocks {
    Text(String),
    List(Vec<Block>),
}

#[derive(Deserialize, Debug)]
pub struct Block {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
    /// A `thinking` block's thought (an assistant turn's, echoed back in the history).
    pub thinking: Option<String>,
}

#[derive(Deserialize, Debug)]
pub struct MessageIn {
    pub role: String,
    pub content: Blocks,
}

#[derive(Deserialize, Debug)]
pub struct MessagesRequest {
    pub model: Option<String>,
    pub messages: Vec<MessageIn>,
    pub system: Option<Blocks>,
    pub max_tokens: Option<u64>,
    pub stop_sequences: Option<Vec<String>>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub stream: Option<bool>,
    pub tools: Option<Vec<Value>>,
    pub thinking: Option<Value>,
}

fn block_text(b: &Blocks, field: &str) -> Result<String, ApiError> {
    Ok(blocks(b, field, false)?.0)
}

/// The text of `system` or a message's content, and (where `thinking` allows, in an assistant
/// turn) the thoughts of its `thinking` blocks; a `redacted_thinking` block is encrypted and left
/// out.
fn blocks(b: &Blocks, field: &str, thinking: bool) -> Result<(String, Option<String>), ApiError> {
    match b {
        Blocks::Text(s) => Ok((s.clone(), None)),
        Blocks::List(list) => {
            let mut out = Vec::new();
            let mut thoughts = Vec::new();
            for (j, block) in list.iter().enumerate() {
                match (block.kind.as_str(), &block.text, &block.thinking) {
                    ("text", Some(t), _) => out.push(t.as_str()),
                    ("text", None, _) => {
                        return Err(ApiError::field(&format!("{field}[{j}].text"), "a text block needs `text`"))
                    }
                    ("thinking", _, Some(t)) if thinking => thoughts.push(t.as_str()),
                    ("redacted_thinking", _, _) if thinking => {}
                    (kind, _, _) => {
                        let also = if thinking { " and thinking" } else { "" };
                        return Err(ApiError::field(
                            &format!("{field}[{j}].type"),
                            format!("`{kind}` blocks are not supported here; this server reads text{also} blocks only"),
                        ));
                    }
                }
            }
            Ok((out.join("\n"), (!thoughts.is_empty()).then(|| thoughts.join("\n"))))
        }
    }
}

fn conversation(r: &MessagesRequest) -> Result<Vec<ChatMessage>, ApiError> {
    if r.messages.is_empty() {
        return Err(ApiError::field("messages", "messages must hold at least one message"));
    }
    if r.tools.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(ApiError::field("tools", "tool use is not supported by this server yet"));
    }
    let mut out = Vec::new();
    if let Some(s) = &r.system {
        out.push(ChatMessage::new("system", &block_text(s, "system")?));
    }
    for (i, m) in r.messages.iter().enumerate() {
        if m.role != "user" && m.role != "assistant" {
            return Err(ApiError::field(
                &format!("messages[{i}].role"),
                format!("unknown role `{}` (expected user or assistant; the system prompt goes in `system`)", m.role),
            ));
        }
        let (text, thought) = blocks(&m.content, &format!("messages[{i}].content"), m.role == "assistant")?;
        out.push(ChatMessage { reasoning_content: thought, ..ChatMessage::new(&m.role, &text) });
    }
    Ok(out)
}

/// The chat-template variables `thinking` asks for: `{"type": "disabled"}` turns a reasoning
/// model's thinking off (`enable_thinking: false`, which templates without the switch ignore).
/// Thinking is otherwise the model's own, returned in `thinking` blocks; a token budget for it
/// (`enabled`) is not enforced here, so it is refused.
fn thinking_kwargs(state: &AppState, r: &MessagesRequest) -> Result<Option<serde_json::Map<String, Value>>, ApiError> {
    let mut request = serde_json::Map::new();
    match r.thinking.as_ref().and_then(|t| t.get("type")).and_then(Value::as_str) {
        None if r.thinking.as_ref().is_none_or(Value::is_null) => {}
        Some("disabled") => {
            request.insert("enable_thinking".into(), Value::Bool(false));
        }
        _ => {
            return Err(ApiError::field(
                "thinking",
                "thinking budgets are not enforced by this server: leave `thinking` out (a reasoning model's thoughts come back as thinking blocks) or send {\"type\": \"disabled\"}",
            ))
        }
    }
    Ok(state.template_kwargs(Some(&request)))
}

/// The prompt's text and token ids.
fn prompt_of(state: &AppState, model: &LoadedModel, r: &MessagesRequest) -> Result<(String, Vec<u32>), ApiError> {
    let conversation = conversation(r)?;
    chat_prompt(model, &conversation, thinking_kwargs(state, r)?.as_ref())
}

/// The server's reasoning format for Anthropic answers: thoughts go to `thinking` blocks, never
/// into the text as well (`deepseek-legacy` is read as `deepseek`).
fn reasoning_format(state: &AppState) -> ReasoningFormat {
    match state.config.reasoning_format {
        ReasoningFormat::Legacy => ReasoningFormat::Split,
        f => f,
    }
}

fn stop_reason(e: &Ending) -> (&'static str, Value) {
    match e {
        Ending::Eos => ("end_turn", Value::Null),
        Ending::StopWord(s) => ("stop_sequence", json!(s)),
        Ending::Length | Ending::Cancelled => ("max_tokens", Value::Null),
    }
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens.saturating_sub(u.cached_tokens),
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": u.cached_tokens,
        "cache_creation_input_tokens": 0,
    })
}

pub async fn messages(
    State(state): State<Arc<AppState>>,
    Extension(log): Extension<RequestLog>,
    body: Bytes,
) -> Response {
    messages_inner(state, log, &body).await.unwrap_or_else(|e| e.in_dialect(Dialect::Anthropic).into_response())
}

async fn messages_inner(state: Arc<AppState>, log: RequestLog, body: &[u8]) -> Result<Response, ApiError> {
    let model = state.ready()?;
    let r: MessagesRequest = parse_body(body)?;
    let max_tokens = r.max_tokens.ok_or_else(|| ApiError::field("max_tokens", "max_tokens: Field required"))?;
    let (prompt_text, prompt) = prompt_of(&state, model, &r)?;
    let (format, open) = (reasoning_format(&state), reasoning::forced_open(&prompt_text));
    if let Some(t) = r.temperature.filter(|t| !(0.0..=1.0).contains(t)) {
        return Err(ApiError::field("temperature", format!("temperature: must be between 0 and 1, got {t}")));
    }
    let mut sampling = model.facts.default_sampling.clone();
    sampling.temperature = r.temperature.unwrap_or(sampling.temperature);
    sampling.top_p = r.top_p.unwrap_or(sampling.top_p);
    sampling.top_k = r.top_k.unwrap_or(sampling.top_k);
    let prompt_tokens = prompt.len();
    let mut job = Job::new(prompt, sampling);
    job.max_tokens = Some(max_tokens as usize);
    job.stop = r.stop_sequences.clone().map(|v| StopField::Many(v).into_vec()).unwrap_or_default();
    let stops = job.stop.clone();
    let req = job.into_request(&state, model, "messages")?;
    let events = submit(model, req)?;
    let model_name = r.model.filter(|m| !m.is_empty()).unwrap_or_else(|| model.facts.id.clone());
    let id = new_id("msg_");

    if r.stream.unwrap_or(false) {
        let split = Splitter::new(format, open);
        let dialect = MessageStream { id, model: model_name, prompt_tokens, split, open: None, blocks: 0 };
        return Ok(stream_response(events, dialect, prompt_tokens, stops, model.text.clone(), state.clone(), log));
    }
    let c = collect(events, &stops, &model.text, &state, &log).await?;
    let (reason, sequence) = stop_reason(&c.ending);
    let parts = Splitter::split_all(format, open, &c.text);
    let mut content = vec![];
    if !parts.reasoning.is_empty() {
        content.push(json!({"type": "thinking", "thinking": parts.reasoning, "signature": ""}));
    }
    if !parts.content.is_empty() || content.is_empty() {
        content.push(json!({"type": "text", "text": parts.content}));
    }
    Ok(Json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model_name,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage_json(&c.usage),
    }))
    .into_response())
}

/// An Anthropic SSE event: `event: <type>` with the JSON as data.
fn event(v: Value) -> Event {
    let kind = v["type"].as_str().unwrap_or("message").to_string();
    Event::default().event(kind).data(v.to_string())
}

struct MessageStream {
    id: String,
    model: String,
    prompt_tokens: usize,
    split: Splitter,
    /// The content block open now (its index and kind), and how many were opened.
    open: Option<(usize, &'static str)>,
    blocks: usize,
}

impl MessageStream {
    /// Events that open a block of `kind` (closing the one open, if another kind) and give it `text`.
    fn write_block(&mut self, kind: &'static str, text: &str, out: &mut Vec<Event>) {
        if self.open.is_some_and(|(_, k)| k != kind) {
            self.close(out);
        }
        let index = match self.open {
            Some((i, _)) => i,
            None => {
                let i = self.blocks;
                self.blocks += 1;
                self.open = Some((i, kind));
                out.push(event(
                    json!({"type": "content_block_start", "index": i, "content_block": {"type": kind, kind: ""}}),
                ));
                i
            }
        };
        if !text.is_empty() {
            let delta = if kind == "thinking" {
                json!({"type": "thinking_delta", "thinking": text})
            } else {
                json!({"type": "text_delta", "text": text})
            };
            out.push(event(json!({"type": "content_block_delta", "index": index, "delta": delta})));
        }
    }

    /// Events that close the open block; a thinking block ends with its (empty: no signing here)
    /// signature, as Anthropic's do.
    fn close(&mut self, out: &mut Vec<Event>) {
        if let Some((index, kind)) = self.open.take() {
            if kind == "thinking" {
                out.push(event(json!({"type": "content_block_delta", "index": index,
                    "delta": {"type": "signature_delta", "signature": ""}})));
            }
            out.push(event(json!({"type": "content_block_stop", "index": index})));
        }
    }

    fn parts(&mut self, parts: Parts) -> Vec<Event> {
        let mut out = vec![];
        if !parts.reasoning.is_empty() {
            self.write_block("thinking", &parts.reasoning, &mut out);
        }
        if !parts.content.is_empty() {
            self.write_block("text", &parts.content, &mut out);
        }
        out
    }
}

impl StreamDialect for MessageStream {
    fn start(&mut self, live: &Live) -> Vec<Event> {
        let cached_tokens = live.cached_tokens;
        vec![
            event(json!({"type": "message_start", "message": {
                "id": self.id,
                "type": "message",
                "role": "assistant",
                "model": self.model,
                "content": [],
                "stop_reason": null,
                "stop_sequence": null,
                "usage": {"input_tokens": self.prompt_tokens.saturating_sub(cached_tokens), "output_tokens": 0,
                          "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0},
            }})),
            event(json!({"type": "ping"})),
        ]
    }

    fn text(&mut self, text: &str, _tokens: &[u32], _logprobs: &[TokenLogprob], _live: &Live) -> Vec<Event> {
        let parts = self.split.push(text);
        self.parts(parts)
    }

    fn done(&mut self, ending: &Ending, usage: &Usage) -> Vec<Event> {
        let rest = self.split.finish();
        let mut out = self.parts(rest);
        if self.blocks == 0 {
            self.write_block("text", "", &mut out);
        }
        self.close(&mut out);
        let (reason, sequence) = stop_reason(ending);
        out.extend([
            event(json!({"type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": usage_json(usage)})),
            event(json!({"type": "message_stop"})),
        ]);
        out
    }

    fn error(&mut self, e: &ApiError) -> Vec<Event> {
        vec![event(e.clone().in_dialect(Dialect::Anthropic).body())]
    }
}

/// `/v1/messages/count_tokens`: the prompt's size through the chat template, without generating.
pub async fn count_tokens(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let run = || -> Result<Response, ApiError> {
        let model = state.ready()?;
        let r: MessagesRequest = parse_body(&body)?;
        let n = prompt_of(&state, model, &r)?.1.len();
        Ok(Json(json!({"input_tokens": n})).into_response())
    };
    run().unwrap_or_else(|e| e.in_dialect(Dialect::Anthropic).into_response())
}
