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

use super::completion::{collect, logit_bias, new_id, stream_response, submit, Ending, Job, Live, StreamDialect};
use super::error::{dotted, parse_body_with, ApiError, Dialect};
use super::openai::{chat_prompt, SamplingFields, StopField};
use super::reasoning::{self, Parts, ReasoningFormat, Splitter};
use super::samplers::LlamaSamplers;
use super::state::{AppState, LoadedModel, RequestLog};
use super::structured;
use super::tools::{
    anthropic_tool_name_problem, duplicate_name, parameters_problem, pieces_through, shown_tags, CallParser, Forced,
    Piece, ToolCall, Tooling,
};
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
    /// A `tool_use` block's call (an assistant turn's).
    pub id: Option<String>,
    pub name: Option<String>,
    pub input: Option<Value>,
    /// A `tool_result` block's answer to a call (a user turn's).
    pub tool_use_id: Option<String>,
    pub content: Option<Blocks>,
    pub is_error: Option<bool>,
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
    pub tool_choice: Option<Value>,
    pub thinking: Option<Value>,
    /// llama-server's: how thinking is returned (the server's `--reasoning-format` by default).
    pub reasoning_format: Option<String>,
    /// llama-server's sampling fields beyond Anthropic's, read as on its other routes.
    pub seed: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub min_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub repeat_last_n: Option<i64>,
    pub logit_bias: Option<Value>,
    pub cache_prompt: Option<bool>,
    pub ignore_eos: Option<bool>,
}

fn block_text(b: &Blocks, field: &str) -> Result<String, ApiError> {
    Ok(turn(b, field, "system")?.text)
}

/// What one message's content says, as chat templates take it.
#[derive(Default)]
struct Turn {
    text: String,
    /// Its `thinking` blocks' thoughts (an assistant turn; `redacted_thinking` is encrypted and left
    /// out).
    thinking: Option<String>,
    /// Its `tool_use` blocks as template tool calls (an assistant turn).
    calls: Vec<Value>,
    /// Its `tool_result` blocks: (the block's index, the call's id, the result's text) (a user turn).
    results: Vec<(usize, String, String)>,
    /// It held `redacted_thinking`, which a model here cannot read (but which is content).
    redacted: bool,
}

/// The blocks of `system` or a message of `role`, each kind where Anthropic allows it.
fn turn(b: &Blocks, field: &str, role: &str) -> Result<Turn, ApiError> {
    let list = match b {
        Blocks::Text(s) => return Ok(Turn { text: s.clone(), ..Default::default() }),
        Blocks::List(list) => list,
    };
    let (assistant, user) = (role == "assistant", role == "user");
    let mut t = Turn::default();
    let mut texts = Vec::new();
    let mut thoughts = Vec::new();
    for (j, block) in list.iter().enumerate() {
        let at = |f: &str| format!("{field}[{j}].{f}");
        match block.kind.as_str() {
            "text" => {
                let text =
                    block.text.clone().ok_or_else(|| ApiError::field(&at("text"), "a text block needs `text`"))?;
                // As Anthropic's API refuses them (an empty block is not an empty turn).
                let part = if field.starts_with("system") { "system" } else { "messages" };
                if text.is_empty() {
                    return Err(ApiError::field(&at("text"), format!("{part}: text content blocks must be non-empty")));
                }
                if text.trim().is_empty() {
                    return Err(ApiError::field(
                        &at("text"),
                        format!("{part}: text content blocks must contain non-whitespace text"),
                    ));
                }
                texts.push(text)
            }
            "thinking" if assistant => thoughts.push(block.thinking.clone().unwrap_or_default()),
            "redacted_thinking" if assistant => t.redacted = true,
            "tool_use" if assistant => {
                let (Some(id), Some(name)) = (&block.id, &block.name) else {
                    return Err(ApiError::field(&at("id"), "a tool_use block needs `id` and `name`"));
                };
                let Some(input) = block.input.as_ref().filter(|i| i.is_object()) else {
                    // In Anthropic's words, with its dotted path.
                    let message = format!("{}: Input should be a valid dictionary", dotted(&at("input")));
                    return Err(ApiError::field(&at("input"), message));
                };
                t.calls.push(super::tools::template_call(id, name, input.clone()));
            }
            "tool_result" if user => {
                let id = block
                    .tool_use_id
                    .clone()
                    .ok_or_else(|| ApiError::field(&at("tool_use_id"), "a tool_result block needs `tool_use_id`"))?;
                let text = match &block.content {
                    None => String::new(),
                    Some(c) => turn(c, &at("content"), "tool")?.text,
                };
                let text = if block.is_error == Some(true) { format!("Error: {text}") } else { text };
                t.results.push((j, id, text));
            }
            kind => {
                return Err(ApiError::field(
                    &at("type"),
                    format!(
                        "`{kind}` blocks are not supported here; this server reads text, thinking and tool blocks only"
                    ),
                ));
            }
        }
    }
    t.text = texts.join("\n");
    t.thinking = (!thoughts.is_empty()).then(|| thoughts.join("\n"));
    Ok(t)
}

fn conversation(r: &MessagesRequest) -> Result<Vec<ChatMessage>, ApiError> {
    if r.messages.is_empty() {
        return Err(ApiError::field("messages", "messages must hold at least one message"));
    }
    let mut out = Vec::new();
    if let Some(s) = &r.system {
        out.push(ChatMessage::new("system", &block_text(s, "system")?));
    }
    // The ids of the calls of the last assistant turn (a `tool_result` must answer one of them).
    let mut asked: Vec<String> = Vec::new();
    // The calls still unanswered in the user turn after them, and that turn's first message.
    let (mut answering, mut open): (usize, Vec<String>) = (0, Vec::new());
    for (i, m) in r.messages.iter().enumerate() {
        if m.role != "user" && m.role != "assistant" {
            return Err(ApiError::field(
                &format!("messages[{i}].role"),
                format!("unknown role `{}` (expected user or assistant; the system prompt goes in `system`)", m.role),
            ));
        }
        let at = format!("messages[{i}].content");
        let t = turn(&m.content, &at, &m.role)?;
        let last = i + 1 == r.messages.len();
        let empty =
            t.text.is_empty() && t.calls.is_empty() && t.results.is_empty() && t.thinking.is_none() && !t.redacted;
        if empty && !(last && m.role == "assistant") {
            return Err(ApiError::field(
                &at,
                format!("messages.{i}: all messages must have non-empty content except for the optional final assistant message"),
            ));
        }
        let blank = matches!(&m.content, Blocks::Text(s) if !s.is_empty() && s.trim().is_empty());
        if blank && !(last && m.role == "assistant") {
            return Err(ApiError::field(&at, "messages: text content blocks must contain non-whitespace text"));
        }
        // A prefill the answer continues: Anthropic refuses one that ends in whitespace (the model
        // would go on from a word boundary it never writes, and answers degrade).
        if last && m.role == "assistant" && t.text.ends_with(char::is_whitespace) {
            return Err(ApiError::field(&at, "messages: final assistant content cannot end with trailing whitespace"));
        }
        // As Anthropic's API: a result answers a call of the turn just before (consecutive messages
        // of one role being one turn).
        if m.role == "assistant" {
            if i == 0 || r.messages[i - 1].role != "assistant" {
                asked.clear();
            }
            asked.extend(t.calls.iter().filter_map(|c| c["id"].as_str().map(str::to_string)));
        }
        if let Some((j, id, _)) = t.results.iter().find(|(_, id, _)| !asked.contains(id)) {
            return Err(ApiError::field(
                &format!("{at}[{j}].tool_use_id"),
                format!("messages.{i}.content.{j}: unexpected `tool_use_id` found in `tool_result` blocks: {id}. Each `tool_result` block must have a corresponding `tool_use` block in the previous message."),
            ));
        }
        // Every call of an assistant turn is answered in the user turn right after it.
        if m.role == "user" {
            if i > 0 && r.messages[i - 1].role == "assistant" {
                (answering, open) = (i, asked.clone());
            }
            open.retain(|a| !t.results.iter().any(|(_, id, _)| id == a));
            let turn_ends = r.messages.get(i + 1).is_none_or(|next| next.role != "user");
            if turn_ends && !open.is_empty() {
                return Err(ApiError::field(
                    &format!("messages[{answering}].content"),
                    format!(
                        "messages.{answering}: `tool_use` ids were found without `tool_result` blocks immediately \
                         after: {}. Each `tool_use` block must have a corresponding `tool_result` block in the next \
                         message.",
                        open.join(", ")
                    ),
                ));
            }
        }
        // A user turn's tool results are the templates' `tool` messages, before its text.
        for (_, id, result) in &t.results {
            out.push(ChatMessage { tool_call_id: Some(id.clone()), ..ChatMessage::new("tool", result) });
        }
        if m.role == "user" && !t.results.is_empty() && t.text.is_empty() {
            continue;
        }
        // Consecutive turns of one role are one turn, as Anthropic's API combines them (up to a
        // turn's tool calls, which end it).
        match out.last_mut() {
            Some(prev) if t.results.is_empty() && prev.role == m.role && prev.tool_calls.is_none() => {
                prev.content = joined(&prev.content, &t.text);
                if let Some(thought) = t.thinking {
                    let before = prev.reasoning_content.take().unwrap_or_default();
                    prev.reasoning_content = Some(joined(&before, &thought));
                }
                prev.tool_calls = (!t.calls.is_empty()).then_some(t.calls);
                continue;
            }
            _ => {}
        }
        out.push(ChatMessage {
            reasoning_content: t.thinking,
            tool_calls: (!t.calls.is_empty()).then_some(t.calls),
            ..ChatMessage::new(&m.role, &t.text)
        });
    }
    Ok(out)
}

/// Two turns' texts as one, on separate lines (an empty one adds nothing).
fn joined(a: &str, b: &str) -> String {
    match (a.is_empty(), b.is_empty()) {
        (true, _) => b.to_string(),
        (_, true) => a.to_string(),
        _ => format!("{a}\n{b}"),
    }
}

/// The request's tools in the template's shape (None: none, or `tool_choice: {"type": "none"}`).
/// `any` and a named tool force a call (see [`Tooling::forced_grammar`]); Anthropic's server tools
/// are refused.
fn request_tools(model: &LoadedModel, r: &MessagesRequest) -> Result<Option<Tooling>, ApiError> {
    let choice = r.tool_choice.as_ref().filter(|c| !c.is_null());
    if choice.is_some_and(|c| !c.is_object()) {
        return Err(ApiError::field("tool_choice", "tool_choice must be an object such as {\"type\": \"auto\"}"));
    }
    let kind = choice.map(|c| c.get("type").and_then(Value::as_str).unwrap_or_default());
    let parallel = !choice.and_then(|c| c.get("disable_parallel_tool_use")).and_then(Value::as_bool).unwrap_or(false);
    // `any` and a named `tool` force a call (the answer is held to a grammar of calls).
    let forced = match kind {
        None | Some("auto") | Some("none") => None,
        Some("any") => Some(Forced::Any),
        Some("tool") => match choice.and_then(|c| c.get("name")).and_then(Value::as_str) {
            Some(n) => Some(Forced::Named(n.to_string())),
            None => return Err(ApiError::field("tool_choice", "tool_choice `tool` needs the tool's name")),
        },
        Some(k) => {
            return Err(ApiError::field(
                "tool_choice",
                format!("tool_choice `{k}` is not supported (auto, any, tool or none)"),
            ))
        }
    };
    let Some(tools) = r.tools.as_ref().filter(|t| !t.is_empty()) else {
        return match forced {
            None => Ok(None),
            Some(_) => Err(ApiError::field("tool_choice", "tool_choice forces a call, but the request gives no tools")),
        };
    };
    if kind == Some("none") {
        return Ok(None);
    }
    let mut shaped = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        if t.get("type").and_then(Value::as_str).is_some_and(|k| k != "custom") {
            return Err(ApiError::field(
                &format!("tools[{i}].type"),
                "Anthropic's server tools are not supported; give client tools (name, description, input_schema)",
            ));
        }
        let name = t.get("name").and_then(Value::as_str).filter(|n| !n.is_empty());
        let Some(name) = name else {
            return Err(ApiError::field(&format!("tools[{i}].name"), "a tool needs a name"));
        };
        // (Anthropic's error shape has no `param`: its messages start with the field's path.)
        if let Some(problem) = anthropic_tool_name_problem(name) {
            let param = format!("tools[{i}].name");
            return Err(ApiError::field(&param, format!("{}: {problem}", dotted(&param))));
        }
        let param = format!("tools[{i}].input_schema");
        let at = dotted(&param);
        let Some(schema) = t.get("input_schema").filter(|s| !s.is_null()) else {
            return Err(ApiError::field(&param, format!("{at}: Field required")));
        };
        if let Some(problem) = parameters_problem(Some(schema), "input_schema") {
            return Err(ApiError::field(&param, format!("{at}: {problem}")));
        }
        let mut function = json!({
            "name": name,
            "description": t.get("description").cloned().unwrap_or(json!("")),
            "parameters": schema,
        });
        if let Some(strict) = t.get("strict") {
            function["strict"] = strict.clone();
        }
        shaped.push(json!({"type": "function", "function": function}));
    }
    if let Some(name) = duplicate_name(shaped.iter().filter_map(|t| t.pointer("/function/name")?.as_str())) {
        return Err(ApiError::field("tools", format!("tools: Tool names must be unique (`{name}` is given twice)")));
    }
    let tooling = Tooling::new(shaped, parallel, model.facts.chat_template.as_deref())
        .map_err(|e| ApiError::field("tools", e))?;
    tooling.forcing(forced).map(Some).map_err(|e| ApiError::field("tool_choice", e))
}

/// What `thinking` asks for: the chat-template variables and a cap on the thought.
/// `{"type": "enabled", "budget_tokens": N}` switches thinking on (`enable_thinking: true`) with at
/// most N tokens of thought (then the server ends it); `adaptive` switches it on without a cap;
/// `disabled` switches it off (`enable_thinking: false`, which templates without the switch
/// ignore, so a thought the model starts anyway is ended at once). Without `thinking`, the server's
/// `--reasoning-budget`.
type Thinking = (Option<serde_json::Map<String, Value>>, Option<usize>);

fn thinking(state: &AppState, r: &MessagesRequest) -> Result<Thinking, ApiError> {
    let mut request = serde_json::Map::new();
    let t = r.thinking.as_ref().filter(|t| !t.is_null());
    let mut budget = None;
    match t.map(|t| t.get("type").and_then(Value::as_str)) {
        None => {}
        Some(Some("disabled")) => {
            request.insert("enable_thinking".into(), Value::Bool(false));
            budget = Some(0);
        }
        Some(Some("adaptive")) => {
            request.insert("enable_thinking".into(), Value::Bool(true));
        }
        Some(Some("enabled")) => {
            // (count_tokens has no max_tokens.)
            let max_tokens = r.max_tokens.unwrap_or(u64::MAX);
            let n = t.and_then(|t| t.get("budget_tokens")).and_then(Value::as_u64);
            let Some(n) = n.filter(|&n| n >= 1 && n < max_tokens) else {
                return Err(ApiError::field(
                    "thinking.budget_tokens",
                    format!("thinking.budget_tokens: an integer of at least 1 and less than max_tokens ({max_tokens}) is required"),
                ));
            };
            request.insert("enable_thinking".into(), Value::Bool(true));
            budget = Some(n as usize);
        }
        Some(other) => {
            return Err(ApiError::field(
                "thinking.type",
                format!("thinking.type must be enabled, adaptive or disabled, got {}", other.unwrap_or("nothing")),
            ))
        }
    }
    let kwargs = state.template_kwargs(Some(&request));
    let budget = budget.or_else(|| reasoning::server_budget(state, kwargs.as_ref()));
    Ok((kwargs, budget))
}

/// The prompt of a request.
struct Prompt {
    text: String,
    ids: Vec<u32>,
    /// The tools given to the model.
    tools: Option<Tooling>,
    /// The cap on its thought.
    budget: Option<usize>,
}

fn prompt_of(state: &AppState, model: &LoadedModel, r: &MessagesRequest) -> Result<Prompt, ApiError> {
    let conversation = conversation(r)?;
    let tools = request_tools(model, r)?;
    let (kwargs, budget) = thinking(state, r)?;
    let (text, ids) = chat_prompt(model, &conversation, kwargs.as_ref(), tools.as_ref(), Default::default())?;
    Ok(Prompt { text, ids, tools, budget })
}

/// `stop_reason` and `stop_sequence`: an answer that called tools stopped to let them run; one that
/// filled the context (`out_of_context`) says so, as Anthropic's API does.
fn stop_reason(e: &Ending, calls: usize, out_of_context: bool) -> (&'static str, Value) {
    match e {
        Ending::Eos | Ending::StopWord(_) if calls > 0 => ("tool_use", Value::Null),
        Ending::Eos => ("end_turn", Value::Null),
        Ending::StopWord(s) => ("stop_sequence", json!(s)),
        Ending::Length if out_of_context => ("model_context_window_exceeded", Value::Null),
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
    let (r, llama_samplers): (MessagesRequest, LlamaSamplers) = parse_body_with(body)?;
    let max_tokens = r.max_tokens.ok_or_else(|| ApiError::field("max_tokens", "max_tokens: Field required"))?;
    let Prompt { text: prompt_text, ids: prompt, tools, budget } = prompt_of(&state, model, &r)?;
    let format = reasoning::request_format(&state, r.reasoning_format.as_deref(), true)?;
    let open = reasoning::forced_open(&prompt_text);
    if let Some(t) = r.temperature.filter(|t| !(0.0..=1.0).contains(t)) {
        return Err(ApiError::field("temperature", format!("temperature: must be between 0 and 1, got {t}")));
    }
    let fields = SamplingFields {
        temperature: r.temperature,
        top_p: r.top_p,
        top_k: r.top_k.map(|k| k.min(i64::MAX as usize) as i64),
        seed: r.seed,
        presence_penalty: r.presence_penalty,
        frequency_penalty: r.frequency_penalty,
        min_p: r.min_p,
        repeat_penalty: r.repeat_penalty,
        repeat_last_n: r.repeat_last_n,
    };
    let mut sampling = fields.apply(&model.facts.default_sampling, model.facts.ctx_size)?;
    llama_samplers.apply(&mut sampling)?;
    let prompt_tokens = prompt.len();
    let mut job = Job::new(prompt, sampling);
    job.slot = llama_samplers.slot()?;
    if let Some(b) = &r.logit_bias {
        job.sampling.logit_bias = logit_bias(b, model, true)?;
    }
    job.cache_prompt = r.cache_prompt;
    job.ignore_eos = r.ignore_eos.unwrap_or(false);
    job.max_tokens = Some(max_tokens as usize);
    job.thought_budget = reasoning::thought_budget(model, budget, &prompt_text)?;
    job.shown_special = shown_tags(&model.text, tools.as_ref());
    if let Some(j) = r.stop_sequences.iter().flatten().position(|s| s.trim().is_empty()) {
        return Err(ApiError::field(
            &format!("stop_sequences[{j}]"),
            "stop_sequences: each stop sequence must contain non-whitespace",
        ));
    }
    job.stop = r.stop_sequences.clone().map(|v| StopField::Many(v).into_vec()).unwrap_or_default();
    structured::force_calls(model, tools.as_ref(), &mut job)?;
    structured::after_thought(model, &prompt_text, &mut job, format != ReasoningFormat::Split, "tool_choice")?;
    let stops = job.stop.clone();
    let req = job.into_request(&state, model, "messages")?;
    let events = submit(model, req)?;
    let model_name = r.model.filter(|m| !m.is_empty()).unwrap_or_else(|| model.facts.id.clone());
    let id = new_id("msg_");

    if r.stream.unwrap_or(false) {
        let split = Splitter::new(format, open);
        let calls = tools.as_ref().map(|t| t.parser("toolu_"));
        let dialect = MessageStream {
            id,
            model: model_name,
            prompt_tokens,
            split,
            calls,
            sent_calls: 0,
            open: None,
            blocks: 0,
            ctx_size: model.facts.ctx_size,
        };
        return Ok(stream_response(events, dialect, prompt_tokens, stops, model.text.clone(), state.clone(), log));
    }
    let c = collect(events, &stops, &model.text, &state, &log).await?;
    let parts = Splitter::split_all(format, open, &c.text);
    let pieces = match &tools {
        Some(t) => t.pieces("toolu_", &parts.content),
        None => vec![Piece::Text(parts.content)],
    };
    let calls = pieces.iter().filter(|p| matches!(p, Piece::Call(_))).count();
    let (reason, sequence) = stop_reason(&c.ending, calls, c.ending.out_of_context(&c.usage, model.facts.ctx_size));
    let mut content = vec![];
    if !parts.reasoning.is_empty() {
        content.push(json!({"type": "thinking", "thinking": parts.reasoning, "signature": ""}));
    }
    // Text and calls in the order the model wrote them (as the stream gives them).
    for piece in pieces {
        match piece {
            Piece::Text(t) if t.is_empty() => {}
            Piece::Text(t) => content.push(json!({"type": "text", "text": t})),
            Piece::Call(c) => content.push(c.anthropic()),
        }
    }
    if content.is_empty() {
        content.push(json!({"type": "text", "text": ""}));
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
    /// The answer's call reader, and the calls sent.
    calls: Option<CallParser>,
    sent_calls: usize,
    /// The content block open now (its index and kind), and how many were opened.
    open: Option<(usize, &'static str)>,
    blocks: usize,
    ctx_size: usize,
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
                block_start(i, json!({"type": kind, kind: ""}), out);
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

    /// A `tool_use` block, whole: its start, its input as one JSON delta, its stop (after a `ping`
    /// when it is the first block).
    fn tool_block(&mut self, call: &ToolCall, out: &mut Vec<Event>) {
        self.close(out);
        let index = self.blocks;
        self.blocks += 1;
        self.sent_calls += 1;
        let start = json!({"type": "tool_use", "id": call.id, "name": call.name, "input": {}});
        block_start(index, start, out);
        out.push(event(json!({"type": "content_block_delta", "index": index,
            "delta": {"type": "input_json_delta", "partial_json": call.arguments.to_string()}})));
        out.push(event(json!({"type": "content_block_stop", "index": index})));
    }

    /// The events for new reasoning and answer text (`end`: the answer is over, so the call reader
    /// gives what it held).
    fn parts(&mut self, parts: Parts, end: bool) -> Vec<Event> {
        let mut out = vec![];
        if !parts.reasoning.is_empty() {
            self.write_block("thinking", &parts.reasoning, &mut out);
        }
        for piece in pieces_through(&mut self.calls, &parts.content, end) {
            match piece {
                Piece::Text(t) => self.write_block("text", &t, &mut out),
                Piece::Call(c) => self.tool_block(&c, &mut out),
            }
        }
        out
    }
}

/// A block's `content_block_start`; after the first one, a `ping`, where Anthropic's streams send it.
fn block_start(index: usize, block: Value, out: &mut Vec<Event>) {
    out.push(event(json!({"type": "content_block_start", "index": index, "content_block": block})));
    if index == 0 {
        out.push(event(json!({"type": "ping"})));
    }
}

impl StreamDialect for MessageStream {
    fn start(&mut self, live: &Live) -> Vec<Event> {
        let cached_tokens = live.cached_tokens;
        vec![event(json!({"type": "message_start", "message": {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": null,
            "stop_sequence": null,
            "usage": {"input_tokens": self.prompt_tokens.saturating_sub(cached_tokens), "output_tokens": 0,
                      "cache_read_input_tokens": cached_tokens, "cache_creation_input_tokens": 0},
        }}))]
    }

    fn text(&mut self, text: &str, _tokens: &[u32], _logprobs: &[TokenLogprob], _live: &Live) -> Vec<Event> {
        let parts = self.split.push(text);
        self.parts(parts, false)
    }

    fn done(&mut self, ending: &Ending, usage: &Usage, _live: &Live) -> Vec<Event> {
        let rest = self.split.finish();
        let mut out = self.parts(rest, true);
        if self.blocks == 0 {
            self.write_block("text", "", &mut out);
        }
        self.close(&mut out);
        let (reason, sequence) = stop_reason(ending, self.sent_calls, ending.out_of_context(usage, self.ctx_size));
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
        // (The sampler settings a generating request may carry do not change the count.)
        let (r, _): (MessagesRequest, LlamaSamplers) = parse_body_with(&body)?;
        let n = prompt_of(&state, model, &r)?.ids.len();
        Ok(Json(json!({"input_tokens": n})).into_response())
    };
    run().unwrap_or_else(|e| e.in_dialect(Dialect::Anthropic).into_response())
}
