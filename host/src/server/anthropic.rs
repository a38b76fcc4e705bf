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

use super::completion::{collect, new_id, stream_response, submit, Ending, Job, StreamDialect};
use super::error::{parse_body, ApiError, Dialect};
use super::openai::{chat_prompt, StopField};
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
    match b {
        Blocks::Text(s) => Ok(s.clone()),
        Blocks::List(list) => {
            let mut out = Vec::new();
            for (j, block) in list.iter().enumerate() {
                match (block.kind.as_str(), &block.text) {
                    ("text", Some(t)) => out.push(t.as_str()),
                    ("text", None) => {
                        return Err(ApiError::field(&format!("{field}[{j}].text"), "a text block needs `text`"))
                    }
                    (kind, _) => {
                        return Err(ApiError::field(
                            &format!("{field}[{j}].type"),
                            format!("`{kind}` blocks are not supported; this server reads text blocks only"),
                        ))
                    }
                }
            }
            Ok(out.join("\n"))
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
    if r.thinking.as_ref().is_some_and(|t| t.get("type").and_then(Value::as_str) != Some("disabled")) {
        return Err(ApiError::field("thinking", "extended thinking is not supported by this server"));
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
        out.push(ChatMessage::new(&m.role, &block_text(&m.content, &format!("messages[{i}].content"))?));
    }
    Ok(out)
}

fn prompt_of(model: &LoadedModel, r: &MessagesRequest) -> Result<Vec<u32>, ApiError> {
    Ok(chat_prompt(model, &conversation(r)?, None)?.1)
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
    let prompt = prompt_of(model, &r)?;
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
        let dialect = MessageStream { id, model: model_name, prompt_tokens };
        return Ok(stream_response(events, dialect, stops, model.text.clone(), state.clone(), log));
    }
    let c = collect(events, &stops, &model.text, &state, &log).await?;
    let (reason, sequence) = stop_reason(&c.ending);
    Ok(Json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model_name,
        "content": [{"type": "text", "text": c.text}],
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
}

impl StreamDialect for MessageStream {
    fn start(&mut self, cached_tokens: usize) -> Vec<Event> {
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
            event(json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})),
            event(json!({"type": "ping"})),
        ]
    }

    fn text(&mut self, text: &str, _tokens: &[u32], _logprobs: &[TokenLogprob]) -> Vec<Event> {
        vec![event(json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}}))]
    }

    fn done(&mut self, ending: &Ending, usage: &Usage) -> Vec<Event> {
        let (reason, sequence) = stop_reason(ending);
        vec![
            event(json!({"type": "content_block_stop", "index": 0})),
            event(json!({"type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": usage_json(usage)})),
            event(json!({"type": "message_stop"})),
        ]
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
        let n = prompt_of(model, &r)?.len();
        Ok(Json(json!({"input_tokens": n})).into_response())
    };
    run().unwrap_or_else(|e| e.in_dialect(Dialect::Anthropic).into_response())
}
