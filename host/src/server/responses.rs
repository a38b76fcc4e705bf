//! OpenAI's Responses API, `POST /v1/responses`: `input` as a string or a list of items (messages,
//! function calls and their outputs, reasoning), `instructions`, function `tools`; the answer as
//! output items — reasoning, a message, function calls — whole or streamed as Responses events
//! (`response.created` … `response.completed`, each with its `sequence_number`). Nothing is
//! stored here, so `previous_response_id` and `store: true` are refused; a client that keeps no
//! state sends its reasoning items back, which the model sees again as its earlier thought.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{json, Value};

use super::completion::{
    collect, logit_bias, new_id, stream_response, submit, unix_time, Ending, Job, Live, StreamDialect,
};
use super::error::{parse_body_with, ApiError, Dialect};
use super::openai::{chat_prompt, request_tools, SamplingFields, TemplatedPrompt};
use super::reasoning::{self, Parts, ReasoningFormat, Splitter};
use super::samplers::LlamaSamplers;
use super::state::{AppState, LoadedModel, RequestLog};
use super::structured;
use super::tools::{parameters_problem, pieces_through, CallParser, Piece, ToolCall, Tooling};
use crate::engine::{TokenLogprob, Usage};
use crate::text::{ChatMessage, TextTokenizer};

/// `input`: a string (one user message) or a list of items.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Input {
    Text(String),
    Items(Vec<Value>),
}

#[derive(Deserialize, Debug)]
pub struct ResponsesRequest {
    pub model: Option<String>,
    pub input: Input,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub stream: Option<bool>,
    /// Only OpenAI's `include_obfuscation: false` (no padding is added here).
    pub stream_options: Option<Value>,
    pub metadata: Option<Value>,
    /// llama-server's: how thinking is returned (`none` leaves it in the message).
    pub reasoning_format: Option<String>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// Responses are not stored, so there is none to continue.
    pub previous_response_id: Option<String>,
    pub text: Option<Value>,
    pub reasoning: Option<Value>,
    pub truncation: Option<String>,
    pub include: Option<Vec<String>>,
    /// llama-server's sampling fields beyond the Responses API's, read as on its other routes.
    pub top_k: Option<i64>,
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

/// The conversation `input` (and `instructions`) say, in chat-template messages.
fn conversation(r: &ResponsesRequest) -> Result<Vec<ChatMessage>, ApiError> {
    let mut out = Vec::new();
    if let Some(i) = &r.instructions {
        out.push(ChatMessage::new("system", i));
    }
    let items = match &r.input {
        Input::Text(s) => return Ok([out, vec![ChatMessage::new("user", s)]].concat()),
        Input::Items(items) => items,
    };
    // A reasoning item belongs to the assistant turn right after it; a call's output to a call.
    let mut thought: Option<String> = None;
    // Every call so far, and those not yet answered: as OpenAI, a call's output comes before the next
    // user or system message (the template would show the model a call it never saw answered).
    let (mut call_ids, mut open): (Vec<&str>, Vec<&str>) = (Vec::new(), Vec::new());
    let unanswered =
        |at: String, id: &str| ApiError::field(&at, format!("No tool output found for function call {id}."));
    for (i, item) in items.iter().enumerate() {
        let at = |f: &str| format!("input[{i}].{f}");
        let kind = item.get("type").and_then(Value::as_str).unwrap_or("message");
        // (An assistant message may sit between: this server writes a call's text after it in order.)
        let role = item.get("role").and_then(Value::as_str).unwrap_or_default();
        if let (Some(id), "message", false) = (open.first(), kind, role == "assistant") {
            return Err(unanswered(format!("input[{i}]"), id));
        }
        match kind {
            "message" => {
                let role = item.get("role").and_then(Value::as_str).unwrap_or_default();
                let role = match role {
                    "system" | "developer" => "system",
                    "user" | "assistant" => role,
                    other => return Err(ApiError::field(&at("role"), format!("unknown role `{other}`"))),
                };
                let text = content_text(item.get("content"), &at("content"))?;
                let mut m = ChatMessage::new(role, &text);
                m.reasoning_content = thought.take().filter(|_| role == "assistant");
                out.push(m);
            }
            "function_call" => {
                let field = |f: &str| item.get(f).and_then(Value::as_str);
                let (Some(call_id), Some(name)) = (field("call_id"), field("name")) else {
                    return Err(ApiError::field(&at("call_id"), "a function_call item needs `call_id` and `name`"));
                };
                if call_ids.contains(&call_id) {
                    return Err(ApiError::field(&at("call_id"), format!("Duplicate function call id {call_id}.")));
                }
                call_ids.push(call_id);
                open.push(call_id);
                let args = field("arguments").unwrap_or("{}");
                let args = serde_json::from_str(args).unwrap_or_else(|_| json!(args));
                let call = super::tools::template_call(call_id, name, args);
                // Calls made together are one assistant turn.
                match out.last_mut() {
                    Some(m) if m.role == "assistant" && thought.is_none() => {
                        m.tool_calls.get_or_insert_with(Vec::new).push(call)
                    }
                    _ => out.push(ChatMessage {
                        tool_calls: Some(vec![call]),
                        reasoning_content: thought.take(),
                        ..ChatMessage::new("assistant", "")
                    }),
                }
            }
            "function_call_output" => {
                let Some(call_id) = item.get("call_id").and_then(Value::as_str) else {
                    return Err(ApiError::field(&at("call_id"), "a function_call_output item needs `call_id`"));
                };
                if !call_ids.contains(&call_id) {
                    return Err(ApiError::field(
                        &at("call_id"),
                        format!("No tool call found for function call output with call_id {call_id}."),
                    ));
                }
                open.retain(|o| *o != call_id);
                thought = None;
                let output = content_text(item.get("output"), &at("output"))?;
                out.push(ChatMessage { tool_call_id: Some(call_id.into()), ..ChatMessage::new("tool", &output) });
            }
            "reasoning" => {
                let texts = |key: &str| -> Vec<String> {
                    item.get(key)
                        .and_then(Value::as_array)
                        .map(|parts| parts.iter().filter_map(|p| p.get("text")?.as_str().map(str::to_string)).collect())
                        .unwrap_or_default()
                };
                let mut t = texts("content");
                if t.is_empty() {
                    t = texts("summary");
                }
                // A client that kept only the item's encrypted_content: this server's is the thought
                // (another's, such as OpenAI's, cannot be read here and is left out).
                let kept = item.get("encrypted_content").and_then(Value::as_str).and_then(|e| e.strip_prefix(OUR_THOUGHT));
                if let (true, Some(e)) = (t.is_empty(), kept) {
                    t.push(e.to_string());
                }
                thought = Some(t.join("\n"));
            }
            other => {
                return Err(ApiError::field(
                    &at("type"),
                    format!("`{other}` items are not supported; this server reads messages, function calls, their outputs and reasoning"),
                ))
            }
        }
    }
    if let Some(id) = open.first() {
        return Err(unanswered("input".into(), id));
    }
    if out.iter().all(|m| m.role == "system") {
        return Err(ApiError::field("input", "input holds no message to answer"));
    }
    Ok(out)
}

/// A message's content (or a call's output): a string, or text parts.
fn content_text(v: Option<&Value>, field: &str) -> Result<String, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::new();
            for (j, p) in parts.iter().enumerate() {
                match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                    (Some("input_text" | "output_text" | "text"), Some(t)) => texts.push(t),
                    (kind, _) => {
                        return Err(ApiError::field(
                            &format!("{field}[{j}].type"),
                            format!("`{}` content is not supported; this server reads text only", kind.unwrap_or("?")),
                        ))
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        Some(_) => Err(ApiError::field(field, "expected a string or a list of text parts")),
    }
}

/// The `include` entry that asks for each reasoning item's `encrypted_content`: what a client that
/// keeps no server state sends back for the model to see its earlier thought. Here it is the
/// thought's text itself (nothing is hidden from the client: the item carries it already).
const ENCRYPTED_REASONING: &str = "reasoning.encrypted_content";
/// What this server's `encrypted_content` starts with, before the thought.
const OUR_THOUGHT: &str = "mlxcel-thought:";

/// Whether `reasoning.summary` (or its old name `generate_summary`) asks for a summary. A summary
/// here is the whole thought (`auto` and `detailed`: the most detailed there is); `concise` would
/// need a summarizer and is refused.
fn summary(r: &ResponsesRequest) -> Result<bool, ApiError> {
    match Some(reasoning_field(r, "summary")).filter(|v| !v.is_null()) {
        None => Ok(false),
        Some(Value::String(s)) if s == "auto" || s == "detailed" => Ok(true),
        Some(Value::String(s)) if s == "none" => Ok(false),
        Some(Value::String(s)) if s == "concise" => Err(ApiError::field(
            "reasoning.summary",
            "`concise` summaries are not written here: a thought comes back whole; ask for `auto` or `detailed`",
        )),
        Some(v) => Err(ApiError::field(
            "reasoning.summary",
            format!("reasoning.summary must be `auto`, `detailed`, `concise` or `none`, got {v}"),
        )),
    }
}

/// `reasoning.<key>` as the request gave it (`summary` also by its old name, `generate_summary`).
fn reasoning_field(r: &ResponsesRequest, key: &str) -> Value {
    let v = r
        .reasoning
        .as_ref()
        .and_then(|v| v.get(key).or_else(|| (key == "summary").then(|| v.get("generate_summary")).flatten()));
    v.cloned().unwrap_or(Value::Null)
}

/// Refuses what this server cannot do as asked.
fn refuse_unsupported(r: &ResponsesRequest) -> Result<(), ApiError> {
    if r.previous_response_id.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::field(
            "previous_response_id",
            "responses are not stored by this server; send the whole conversation in `input`",
        ));
    }
    summary(r)?;
    if r.text.as_ref().and_then(|t| t.get("verbosity")).is_some_and(|v| !v.is_null() && v != "medium") {
        return Err(ApiError::field("text.verbosity", "only the default verbosity, medium, is supported"));
    }
    if r.truncation.as_deref().is_some_and(|t| t != "disabled") {
        return Err(ApiError::field(
            "truncation",
            "only `disabled`: a conversation over the context is refused, not cut",
        ));
    }
    for (i, what) in r.include.iter().flatten().enumerate() {
        if what != ENCRYPTED_REASONING {
            return Err(ApiError::field(
                &format!("include[{i}]"),
                format!("`{what}` is not available here; only `{ENCRYPTED_REASONING}` (the thought, to send back)"),
            ));
        }
    }
    if let Some(o) = &r.stream_options {
        if !r.stream.unwrap_or(false) {
            return Err(ApiError::field("stream_options", "stream_options needs stream: true"));
        }
        let padded = o.get("include_obfuscation").and_then(Value::as_bool).unwrap_or(false);
        if padded || o.as_object().is_some_and(|m| m.keys().any(|k| k != "include_obfuscation")) {
            return Err(ApiError::field(
                "stream_options",
                "only include_obfuscation: false (no padding is added here)",
            ));
        }
    }
    if r.metadata.as_ref().is_some_and(|m| !m.is_object() && !m.is_null()) {
        return Err(ApiError::field("metadata", "metadata must be an object"));
    }
    Ok(())
}

/// Responses' function tools (`{"type": "function", "name", "parameters"}`) as chat tools.
fn chat_tools(tools: &Option<Vec<Value>>) -> Result<Option<Vec<Value>>, ApiError> {
    let Some(tools) = tools else { return Ok(None) };
    let mut out = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(ApiError::field(&format!("tools[{i}].type"), "only `function` tools are supported"));
        }
        // Checked here, where the fields have the paths the client gave them (the chat checks would
        // name `tools[i].function.…`).
        if t.get("name").and_then(Value::as_str).is_none_or(str::is_empty) {
            return Err(ApiError::field(&format!("tools[{i}].name"), "a function tool needs a name"));
        }
        if let Some(problem) = parameters_problem(t.get("parameters"), "parameters") {
            return Err(ApiError::field(&format!("tools[{i}].parameters"), problem));
        }
        // The function's own fields, in the client's order.
        let function: serde_json::Map<String, Value> = t
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(k, _)| *k != "type")
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(Some(out))
}

pub async fn responses(
    State(state): State<Arc<AppState>>,
    Extension(log): Extension<RequestLog>,
    body: Bytes,
) -> Response {
    responses_inner(state, log, &body).await.unwrap_or_else(|e| e.in_dialect(Dialect::OpenAi).into_response())
}

/// The tools a Responses request gives the model (fields it cannot have refused first).
fn tooling_of(model: &LoadedModel, r: &ResponsesRequest) -> Result<Option<Tooling>, ApiError> {
    refuse_unsupported(r)?;
    request_tools(model, &chat_tools(&r.tools)?, r.tool_choice.as_ref(), r.parallel_tool_calls)
}

/// The prompt of a Responses request: its instructions, input items, `tooling` and reasoning effort
/// through the template.
fn prompt_of(
    state: &AppState,
    model: &LoadedModel,
    r: &ResponsesRequest,
    tooling: Option<&Tooling>,
) -> Result<TemplatedPrompt, ApiError> {
    let messages = conversation(r)?;
    let effort = reasoning::effort(asked_effort(r)?, "reasoning.effort", model.facts.chat_template.as_deref())?;
    let kwargs = state.template_kwargs_with(&effort.vars, None);
    let (text, ids) = chat_prompt(model, &messages, kwargs.as_ref(), tooling, Default::default())?;
    Ok(TemplatedPrompt { text, ids, effort, kwargs })
}

/// The `reasoning.effort` a request asks for.
fn asked_effort(r: &ResponsesRequest) -> Result<Option<&str>, ApiError> {
    match r.reasoning.as_ref().and_then(|v| v.get("effort")).filter(|e| !e.is_null()) {
        None => Ok(None),
        Some(Value::String(e)) => Ok(Some(e.as_str())),
        Some(_) => Err(ApiError::field("reasoning.effort", "reasoning.effort must be a string")),
    }
}

/// `POST /v1/responses/input_tokens`: the tokens a Responses request's prompt would take.
pub async fn input_tokens(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let run = || -> Result<Response, ApiError> {
        let model = state.ready()?;
        // (The sampler settings a generating request may carry do not change the count.)
        let (r, _): (ResponsesRequest, LlamaSamplers) = parse_body_with(&body)?;
        let tooling = tooling_of(model, &r)?;
        let n = prompt_of(&state, model, &r, tooling.as_ref())?.ids.len();
        Ok(Json(json!({"object": "response.input_tokens", "input_tokens": n})).into_response())
    };
    run().unwrap_or_else(|e| e.in_dialect(Dialect::OpenAi).into_response())
}

async fn responses_inner(state: Arc<AppState>, log: RequestLog, body: &[u8]) -> Result<Response, ApiError> {
    let model = state.ready()?;
    let (r, llama_samplers): (ResponsesRequest, LlamaSamplers) = parse_body_with(body)?;
    let tooling = tooling_of(model, &r)?;
    let schema = structured::requested_schema(r.text.as_ref().and_then(|t| t.get("format")), "text.format")?;
    structured::refuse_with_tools(schema.is_some(), tooling.is_some(), "text.format")?;
    let TemplatedPrompt { text: prompt_text, ids: prompt, effort, kwargs } =
        prompt_of(&state, model, &r, tooling.as_ref())?;
    let (temperature, top_p) = (r.temperature.map(|t| t as f32), r.top_p.map(|p| p as f32));
    let sampling = SamplingFields {
        temperature,
        top_p,
        top_k: r.top_k,
        seed: r.seed,
        presence_penalty: r.presence_penalty,
        frequency_penalty: r.frequency_penalty,
        min_p: r.min_p,
        repeat_penalty: r.repeat_penalty,
        repeat_last_n: r.repeat_last_n,
    };
    let mut sampling = sampling.apply(&model.facts.default_sampling, model.facts.ctx_size)?;
    llama_samplers.apply(&mut sampling)?;
    let mut job = Job::new(prompt, sampling);
    job.slot = llama_samplers.slot()?;
    if let Some(b) = &r.logit_bias {
        job.sampling.logit_bias = logit_bias(b, model, true)?;
    }
    job.cache_prompt = r.cache_prompt;
    job.ignore_eos = r.ignore_eos.unwrap_or(false);
    job.max_tokens = match r.max_output_tokens {
        None => None,
        Some(n) if n >= 1 => Some(n as usize),
        Some(n) => {
            return Err(ApiError::field("max_output_tokens", format!("max_output_tokens must be at least 1, got {n}")))
        }
    };
    let budget = reasoning::tighter(reasoning::server_budget(&state, kwargs.as_ref()), effort.budget);
    job.thought_budget = reasoning::thought_budget(model, budget, &prompt_text)?;
    job.shown_special = super::tools::shown_tags(&model.text, tooling.as_ref());
    let text_format = r.text.as_ref().and_then(|t| t.get("format")).cloned().unwrap_or(json!({"type": "text"}));
    let held_at = if schema.is_some() { "text.format" } else { "tool_choice" };
    match schema {
        Some(_) => job.constraint = structured::constraint(model, schema, "text.format")?,
        None => structured::force_calls(model, tooling.as_ref(), &mut job)?,
    }
    let format = reasoning::request_format(&state, r.reasoning_format.as_deref(), true)?;
    structured::after_thought(model, &prompt_text, &mut job, format != ReasoningFormat::Split, held_at)?;
    let prompt_tokens = job.prompt.len();
    let summarized = summary(&r)?;
    let req = job.into_request(&state, model, "input")?;
    let events = submit(model, req)?;
    let head = Head {
        id: new_id("resp_"),
        created_at: unix_time(),
        model: r.model.clone().filter(|m| !m.is_empty()).unwrap_or_else(|| model.facts.id.clone()),
        echo: json!({
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "temperature": r.temperature,
            "top_p": r.top_p,
            "tools": r.tools.clone().unwrap_or_default(),
            "tool_choice": r.tool_choice.clone().unwrap_or(json!("auto")),
            "parallel_tool_calls": r.parallel_tool_calls.unwrap_or(true),
            "text": {"format": text_format},
            "truncation": "disabled",
            "store": false,
            "previous_response_id": null,
            "reasoning": {"effort": asked_effort(&r)?, "summary": if summarized { reasoning_field(&r, "summary") } else { Value::Null }},
            "metadata": r.metadata.clone().filter(Value::is_object).unwrap_or(json!({})),
            "error": null,
        }),
    };
    let split = Splitter::new(format, reasoning::forced_open(&prompt_text));
    let calls = tooling.as_ref().map(|t| t.parser("call_"));
    let mut dialect = ResponseStream {
        head,
        split,
        calls,
        output: vec![],
        open: None,
        seq: 0,
        cut_short: false,
        finished: Value::Null,
        tok: model.text.clone(),
        thoughts: Thoughts { summarized, encrypted: r.include.iter().flatten().any(|i| i == ENCRYPTED_REASONING) },
    };

    if r.stream.unwrap_or(false) {
        return Ok(stream_response(events, dialect, prompt_tokens, vec![], model.text.clone(), state.clone(), log));
    }
    // The whole answer is the stream's items, its events unsent.
    let c = collect(events, &[], &model.text, &state, &log).await?;
    let live = Live::new(prompt_tokens);
    dialect.text(&c.text, &[], &[], &live);
    dialect.done(&c.ending, &c.usage, &live);
    Ok(Json(dialect.finished).into_response())
}

/// What every response object repeats.
struct Head {
    id: String,
    created_at: u64,
    model: String,
    /// The request's settings, echoed as OpenAI echoes them.
    echo: Value,
}

impl Head {
    /// The response object: in progress (`ending` None) or finished.
    fn response(&self, ending: &Ending, usage: Option<&Usage>, output: Vec<Value>, reasoning_tokens: usize) -> Value {
        let mut v = self.echo.clone();
        let (status, incomplete) = match (usage, ending) {
            (None, _) => ("in_progress", Value::Null),
            (_, Ending::Length | Ending::Cancelled) => ("incomplete", json!({"reason": "max_output_tokens"})),
            _ => ("completed", Value::Null),
        };
        v["id"] = json!(self.id);
        v["object"] = json!("response");
        v["created_at"] = json!(self.created_at);
        v["status"] = json!(status);
        v["incomplete_details"] = incomplete;
        v["model"] = json!(self.model);
        v["output"] = json!(output);
        v["usage"] = match usage {
            None => Value::Null,
            Some(u) => json!({
                "input_tokens": u.prompt_tokens,
                "input_tokens_details": {"cached_tokens": u.cached_tokens},
                "output_tokens": u.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                "total_tokens": u.prompt_tokens + u.completion_tokens,
            }),
        };
        v
    }
}

/// An output item being written: reasoning, a message, or a function call.
enum Item {
    Reasoning { id: String, text: String },
    Message { id: String, text: String },
    Call { id: String, call: ToolCall },
}

impl Item {
    fn kind(&self) -> &'static str {
        match self {
            Item::Reasoning { .. } => "reasoning",
            Item::Message { .. } => "message",
            Item::Call { .. } => "function_call",
        }
    }

    fn id(&self) -> &str {
        match self {
            Item::Reasoning { id, .. } | Item::Message { id, .. } | Item::Call { id, .. } => id,
        }
    }

    /// The item as `response.output_item.added` shows it (nothing in it yet).
    fn added(&self) -> Value {
        match self {
            Item::Reasoning { id, .. } => json!({"type": "reasoning", "id": id, "summary": [], "content": []}),
            Item::Message { id, .. } => {
                json!({"type": "message", "id": id, "status": "in_progress", "role": "assistant", "content": []})
            }
            Item::Call { id, call } => json!({"type": "function_call", "id": id, "call_id": call.id,
                "name": call.name, "arguments": "", "status": "in_progress"}),
        }
    }

    /// The finished item (`status` `incomplete` for text cut short).
    fn done(self, cut_short: bool, thoughts: Thoughts) -> Value {
        let status = if cut_short { "incomplete" } else { "completed" };
        match self {
            Item::Reasoning { id, text } => {
                let summary =
                    if thoughts.summarized { json!([{"type": "summary_text", "text": text}]) } else { json!([]) };
                let mut item = json!({"type": "reasoning", "id": id, "summary": summary,
                    "content": [{"type": "reasoning_text", "text": text}], "status": status});
                if thoughts.encrypted {
                    item["encrypted_content"] = json!(format!("{OUR_THOUGHT}{text}"));
                }
                item
            }
            Item::Message { id, text } => {
                json!({"type": "message", "id": id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]})
            }
            Item::Call { id, call } => json!({"type": "function_call", "id": id, "call_id": call.id,
                "name": call.name, "arguments": call.arguments.to_string(), "status": "completed"}),
        }
    }
}

/// How reasoning items are written: with the thought as their summary too (`reasoning.summary`),
/// with it as `encrypted_content` (`include`).
#[derive(Clone, Copy)]
struct Thoughts {
    summarized: bool,
    encrypted: bool,
}

/// The Responses event stream; the whole answer is the same items with the events left unsent.
struct ResponseStream {
    head: Head,
    split: Splitter,
    calls: Option<CallParser>,
    /// Finished items.
    output: Vec<Value>,
    /// The item being written (reasoning or a message), with its text so far.
    open: Option<Item>,
    seq: u64,
    /// Whether the answer was cut short (its open item is incomplete).
    cut_short: bool,
    /// The response once done.
    finished: Value,
    tok: Arc<TextTokenizer>,
    thoughts: Thoughts,
}

impl ResponseStream {
    fn event(&mut self, kind: &str, mut data: Value) -> Event {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.seq);
        self.seq += 1;
        Event::default().event(kind).data(data.to_string())
    }

    /// Closes the open item (its `.done` events).
    fn close(&mut self, out: &mut Vec<Event>) {
        let Some(item) = self.open.take() else { return };
        let (index, id) = (self.output.len(), item.id().to_string());
        let part = match &item {
            Item::Reasoning { text, .. } => {
                let e = self.event(
                    "response.reasoning_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
                );
                out.push(e);
                if self.thoughts.summarized {
                    let at = json!({"item_id": id, "output_index": index, "summary_index": 0});
                    let mut e = at.clone();
                    e["text"] = json!(text);
                    let e = self.event("response.reasoning_summary_text.done", e);
                    out.push(e);
                    let mut e = at;
                    e["part"] = json!({"type": "summary_text", "text": text});
                    let e = self.event("response.reasoning_summary_part.done", e);
                    out.push(e);
                }
                Some(json!({"type": "reasoning_text", "text": text}))
            }
            Item::Message { text, .. } => {
                let e = self.event(
                    "response.output_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": text, "logprobs": []}),
                );
                out.push(e);
                Some(json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []}))
            }
            Item::Call { .. } => None,
        };
        if let Some(part) = part {
            let e = self.event(
                "response.content_part.done",
                json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
            );
            out.push(e);
        }
        let done = item.done(self.cut_short, self.thoughts);
        let e = self.event("response.output_item.done", json!({"output_index": index, "item": done}));
        out.push(e);
        self.output.push(done);
    }

    /// Opens `item` (closing another kind first) unless one of its kind is open.
    fn open(&mut self, item: Item, out: &mut Vec<Event>) {
        if self.open.as_ref().is_some_and(|o| o.kind() == item.kind()) {
            return;
        }
        self.close(out);
        let index = self.output.len();
        let e = self.event("response.output_item.added", json!({"output_index": index, "item": item.added()}));
        out.push(e);
        let part = match &item {
            Item::Reasoning { .. } => Some(json!({"type": "reasoning_text", "text": ""})),
            Item::Message { .. } => Some(json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []})),
            Item::Call { .. } => None,
        };
        let id = item.id().to_string();
        if let Some(part) = part {
            let e = self.event(
                "response.content_part.added",
                json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
            );
            out.push(e);
        }
        if matches!(item, Item::Reasoning { .. }) && self.thoughts.summarized {
            let e = self.event(
                "response.reasoning_summary_part.added",
                json!({"item_id": id, "output_index": index, "summary_index": 0, "part": {"type": "summary_text", "text": ""}}),
            );
            out.push(e);
        }
        self.open = Some(item);
    }

    /// The events for new text.
    fn parts(&mut self, parts: Parts, end: bool) -> Vec<Event> {
        let mut out = vec![];
        if !parts.reasoning.is_empty() {
            self.open(Item::Reasoning { id: new_id("rs_"), text: String::new() }, &mut out);
            let index = self.output.len();
            if let Some(Item::Reasoning { id, text }) = &mut self.open {
                text.push_str(&parts.reasoning);
                let id = id.clone();
                let e = self.event(
                    "response.reasoning_text.delta",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "delta": parts.reasoning}),
                );
                out.push(e);
                if self.thoughts.summarized {
                    let e = self.event(
                        "response.reasoning_summary_text.delta",
                        json!({"item_id": id, "output_index": index, "summary_index": 0, "delta": parts.reasoning}),
                    );
                    out.push(e);
                }
            }
        }
        for piece in pieces_through(&mut self.calls, &parts.content, end) {
            match piece {
                Piece::Text(t) => {
                    self.open(Item::Message { id: new_id("msg_"), text: String::new() }, &mut out);
                    let index = self.output.len();
                    if let Some(Item::Message { id, text }) = &mut self.open {
                        text.push_str(&t);
                        let id = id.clone();
                        let e = self.event(
                            "response.output_text.delta",
                            json!({"item_id": id, "output_index": index, "content_index": 0, "delta": t, "logprobs": []}),
                        );
                        out.push(e);
                    }
                }
                Piece::Call(call) => {
                    // A call goes out whole: added, its arguments, done.
                    self.open(Item::Call { id: new_id("fc_"), call }, &mut out);
                    let index = self.output.len();
                    if let Some(Item::Call { id, call }) = &self.open {
                        let (id, args) = (id.clone(), call.arguments.to_string());
                        let e = self.event(
                            "response.function_call_arguments.delta",
                            json!({"item_id": id, "output_index": index, "delta": args}),
                        );
                        out.push(e);
                        let e = self.event(
                            "response.function_call_arguments.done",
                            json!({"item_id": id, "output_index": index, "arguments": args}),
                        );
                        out.push(e);
                    }
                    self.close(&mut out);
                }
            }
        }
        out
    }

    /// The tokens of the answer's reasoning (as the tokenizer counts its text).
    fn reasoning_tokens(&self) -> usize {
        self.output
            .iter()
            .filter(|i| i["type"] == "reasoning")
            .filter_map(|i| i.pointer("/content/0/text").and_then(Value::as_str))
            .map(|t| self.tok.encode(t, false).map_or(0, |ids| ids.len()))
            .sum()
    }
}

impl StreamDialect for ResponseStream {
    fn start(&mut self, _live: &Live) -> Vec<Event> {
        let r = self.head.response(&Ending::Eos, None, vec![], 0);
        vec![
            self.event("response.created", json!({"response": r})),
            self.event("response.in_progress", json!({"response": r})),
        ]
    }

    fn text(&mut self, text: &str, _tokens: &[u32], _logprobs: &[TokenLogprob], _live: &Live) -> Vec<Event> {
        let parts = self.split.push(text);
        self.parts(parts, false)
    }

    fn done(&mut self, ending: &Ending, usage: &Usage, _live: &Live) -> Vec<Event> {
        self.cut_short = matches!(ending, Ending::Length | Ending::Cancelled);
        let rest = self.split.finish();
        let mut out = self.parts(rest, true);
        self.close(&mut out);
        let reasoning_tokens = self.reasoning_tokens();
        let r = self.head.response(ending, Some(usage), std::mem::take(&mut self.output), reasoning_tokens);
        let kind = if r["status"] == "completed" { "response.completed" } else { "response.incomplete" };
        out.push(self.event(kind, json!({"response": r.clone()})));
        self.finished = r;
        out
    }

    /// An `error` event, then the response as failed (what the SDK's final response reads).
    fn error(&mut self, e: &ApiError) -> Vec<Event> {
        let body = e.clone().in_dialect(Dialect::OpenAi).body();
        let err = &body["error"];
        let code = err["code"].as_str().unwrap_or("server_error").to_string();
        let error = self.event("error", json!({"code": err["code"], "message": err["message"], "param": err["param"]}));
        let mut r = self.head.response(&Ending::Eos, None, std::mem::take(&mut self.output), 0);
        r["status"] = json!("failed");
        r["error"] = json!({"code": code, "message": err["message"]});
        vec![error, self.event("response.failed", json!({"response": r}))]
    }
}
