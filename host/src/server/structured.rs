//! Structured outputs: the JSON an answer must be, as each dialect asks for it — OpenAI's
//! `response_format`, the Responses API's `text.format`, llama-server's `json_schema` — and the
//! calls it must be where a request forces one (`tool_choice`), compiled against the model's
//! vocabulary into the engine's token-by-token constraint (see [`grammar`](crate::text::grammar)).

use std::sync::Arc;

use serde_json::{json, Value};

use super::completion::Job;
use super::error::ApiError;
use super::reasoning;
use super::state::LoadedModel;
use super::tools::Tooling;
use crate::text::grammar::{Constraint, Grammars};

/// The schema a `response_format` (chat) or `text.format` (Responses) asks for: None for `text`,
/// any object for `json_object`, the given schema for `json_schema` — nested in `json_schema` as
/// chat sends it, or beside `type` as Responses (and llama-server) take it; no schema is any JSON
/// value.
pub fn requested_schema(format: Option<&Value>, field: &str) -> Result<Option<Value>, ApiError> {
    let Some(f) = format.filter(|f| !f.is_null()) else { return Ok(None) };
    let kind = f.get("type").and_then(Value::as_str);
    match kind {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(f.get("schema").cloned().unwrap_or_else(|| json!({"type": "object"})))),
        Some("json_schema") => {
            let inner = f.get("json_schema").unwrap_or(f);
            match inner.get("schema") {
                None | Some(Value::Null) => Ok(Some(json!({}))),
                Some(s) if s.is_object() || s.is_boolean() => Ok(Some(s.clone())),
                Some(_) => {
                    let at = if f.get("json_schema").is_some() { "json_schema.schema" } else { "schema" };
                    Err(ApiError::field(&format!("{field}.{at}"), "a JSON schema must be an object"))
                }
            }
        }
        other => Err(ApiError::field(
            &format!("{field}.type"),
            format!("`{}` is not a format here: `text`, `json_object` or `json_schema`", other.unwrap_or("?")),
        )),
    }
}

/// The constraint that holds an answer to `schema`; a schema the grammar compiler refuses is the
/// client's error (400, naming `field`).
pub fn constraint(model: &LoadedModel, schema: Option<Value>, field: &str) -> Result<Option<Constraint>, ApiError> {
    let Some(schema) = schema else { return Ok(None) };
    let grammars = grammars(model).map_err(|e| ApiError::field(field, e))?;
    grammars
        .json_schema(&schema)
        .map(Some)
        .map_err(|e| ApiError::field(field, format!("the JSON schema in `{field}` cannot be used: {e}")))
}

/// Holds `job` to calls where the request forces one (`tool_choice` `required`, `any`, or a named
/// tool). The calls' grammar ends the answer, so the job's stop strings (set before this) are
/// dropped: one inside a call's arguments would leave no call at all.
pub fn force_calls(model: &LoadedModel, tooling: Option<&Tooling>, job: &mut Job) -> Result<(), ApiError> {
    job.constraint = forced_calls(model, tooling)?;
    if job.constraint.is_some() {
        job.stop.clear();
    }
    Ok(())
}

/// The constraint that holds an answer to calls, where the request forces one.
fn forced_calls(model: &LoadedModel, tooling: Option<&Tooling>) -> Result<Option<Constraint>, ApiError> {
    let Some(t) = tooling.filter(|t| t.forced.is_some()) else { return Ok(None) };
    let tags: Vec<&str> = [Some(t.format.open()), t.format.close()].into_iter().flatten().collect();
    let special = model.text.special_ids(&tags);
    let tag_id = |tag: &str| model.text.inner.token_to_id(tag).filter(|id| special.contains(id));
    let grammar = t.forced_grammar(tag_id).map_err(|e| ApiError::field("tool_choice", e))?;
    let grammars = grammars(model).map_err(|e| ApiError::field("tool_choice", e))?;
    let c = grammars
        .lark(&grammar)
        .map_err(|e| ApiError::field("tools", format!("the tools' schemas cannot be used to force a call: {e}")))?;
    Ok(Some(c))
}

/// The model's grammar compiler. Its vocabulary index is built by the first request that needs it
/// (~0.2 s for a 49K vocabulary, more for larger ones; kept from then on), which tells the runtime
/// it blocks so that the worker's other connections move on meanwhile.
fn grammars(model: &LoadedModel) -> Result<Arc<Grammars>, String> {
    match model.text.has_grammars() {
        true => model.text.grammars(),
        false => super::blocking(|| model.text.grammars()),
    }
}

/// Where the template has opened a thought, the answer's grammar (a JSON format at `field`, or a
/// forced call at `tool_choice`) holds only what follows the thought, as a reasoning model's
/// structured answer comes after its reasoning: the engine watches for the thought's end (with no
/// cap where no budget gives one). Refused where the thought would stay in a JSON answer's content
/// (`thought_in_content`: reasoning format `none` or `deepseek-legacy`), and where the tokenizer
/// writes `</think>` in pieces (a piece could carry answer text the grammar never saw).
pub fn after_thought(
    model: &LoadedModel,
    prompt_text: &str,
    job: &mut Job,
    thought_in_content: bool,
    field: &str,
) -> Result<(), ApiError> {
    if job.constraint.is_none() || !reasoning::forced_open(prompt_text) {
        return Ok(());
    }
    if thought_in_content && field != "tool_choice" {
        return Err(ApiError::field(
            "reasoning_format",
            "the chat template opens a thought, which this reasoning format (the request's reasoning_format, or \
             the server's --reasoning-format) leaves in the content, so the content would not be the JSON asked \
             for; use reasoning_format auto, or switch thinking off",
        ));
    }
    if model.text.encode("</think>", false).map_or(true, |ids| ids.len() != 1) {
        return Err(ApiError::field(
            field,
            "the chat template opens a thought, whose end this tokenizer writes in pieces, so the grammar could not \
             tell where the answer starts; switch thinking off",
        ));
    }
    if job.thought_budget.is_none() {
        job.thought_budget = reasoning::thought_budget(model, Some(usize::MAX), prompt_text)?;
    }
    Ok(())
}

/// Tools beside a JSON format: a call could not be written inside the JSON the answer must be.
pub fn refuse_with_tools(constrained: bool, has_tools: bool, field: &str) -> Result<(), ApiError> {
    if constrained && has_tools {
        return Err(ApiError::field(
            field,
            "a JSON format and tools in one request are not supported: the answer held to the JSON could not call a tool",
        ));
    }
    Ok(())
}
