//! Tool calling: the request's tools go to the chat template (which writes them into the prompt the
//! way the model was trained to read them), and the model's answer is read back for calls in the
//! format its template uses — as llama-server does with `--jinja`, but without grammars: a call is
//! what the model writes, parsed after the fact, never forced.
//!
//! The formats and their tags are in [`formats`].
//!
//! Streams are parsed as they arrive: text goes out at once except what may still be the start of a
//! call, and each call goes out whole once its closing tag (or the end) is seen.

use serde_json::{json, Value};

use super::completion::new_id;
use crate::text::{ChatMessage, TextTokenizer};

mod formats;
mod python;

use formats::RawCall;
pub use formats::{format_of, ToolFormat};

/// The tools a request gives the model, checked against its template. Where the client forces a
/// call (`tool_choice` `required` or a named tool) the answer is held to a grammar of calls in the
/// template's format ([`Tooling::forced_grammar`]); otherwise the model chooses, and a `strict`
/// tool's calls are checked against its parameter schema (one that does not fit is not a call).
#[derive(Debug, Clone)]
pub struct Tooling {
    pub format: ToolFormat,
    /// As chat templates read them: `{"type": "function", "function": {name, description, parameters}}`.
    pub tools: Vec<Value>,
    pub names: Vec<String>,
    /// More than one call per answer (else the first call is kept).
    pub parallel: bool,
    /// The answer must be calls: to any of the tools, or to the one named.
    pub forced: Option<Forced>,
}

/// Prefixes every local `$ref` (`#/…`) inside `v` with `at`, the JSON pointer `v` now sits at.
fn rebase_refs(v: &mut Value, at: &str) {
    match v {
        Value::Object(o) => {
            for (k, x) in o.iter_mut() {
                match x {
                    Value::String(r) if k == "$ref" && r.starts_with("#/") => *r = format!("#{at}{}", &r[1..]),
                    _ => rebase_refs(x, at),
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(|x| rebase_refs(x, at)),
        _ => {}
    }
}

/// A call the client forces.
#[derive(Debug, Clone, PartialEq)]
pub enum Forced {
    Any,
    Named(String),
}

impl Tooling {
    /// The parameter schema a call to `name` must fit (a `strict` tool's).
    fn strict_schema(&self, name: &str) -> Option<&Value> {
        let f = self.tools.iter().map(|t| &t["function"]).find(|f| f["name"] == name)?;
        (f["strict"] == Value::Bool(true)).then(|| &f["parameters"])
    }
}

/// Whether `v` fits `schema` in what strict schemas say: `type` (one or a list), `enum`,
/// `properties`, `required`, `additionalProperties: false`, `items`, `anyOf`.
pub fn fits(v: &Value, schema: &Value) -> bool {
    if let Some(any) = schema.get("anyOf").and_then(Value::as_array) {
        return any.iter().any(|s| fits(v, s));
    }
    if let Some(options) = schema.get("enum").and_then(Value::as_array) {
        if !options.contains(v) {
            return false;
        }
    }
    let type_fits = |t: &str| match t {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "integer" => v.is_i64() || v.is_u64(),
        "number" => v.is_number(),
        "boolean" => v.is_boolean(),
        "null" => v.is_null(),
        _ => true,
    };
    let typed = match schema.get("type") {
        Some(Value::String(t)) => type_fits(t),
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).any(type_fits),
        _ => true,
    };
    if !typed {
        return false;
    }
    if let Some(o) = v.as_object() {
        let props = schema.get("properties").and_then(Value::as_object);
        let required = schema.get("required").and_then(Value::as_array).into_iter().flatten();
        if required.filter_map(Value::as_str).any(|k| !o.contains_key(k)) {
            return false;
        }
        for (k, x) in o {
            match props.and_then(|p| p.get(k)) {
                Some(s) if !fits(x, s) => return false,
                None if schema.get("additionalProperties") == Some(&Value::Bool(false)) => return false,
                _ => {}
            }
        }
    }
    if let (Some(items), Some(a)) = (schema.get("items"), v.as_array()) {
        return a.iter().all(|x| fits(x, items));
    }
    true
}

/// Why a tool's parameter schema (`field`, as the dialect names it) cannot be one: OpenAI and
/// Anthropic take a JSON schema of an object (the call's arguments); none at all (or null) is a
/// function without parameters.
pub fn parameters_problem(schema: Option<&Value>, field: &str) -> Option<String> {
    match schema {
        None | Some(Value::Null) => None,
        Some(Value::Object(o)) => match o.get("type") {
            None => None,
            Some(Value::String(t)) if t == "object" => None,
            Some(t) => Some(format!("`{field}` must be a JSON schema of type `object`, not of type {t}")),
        },
        Some(other) => Some(format!("`{field}` must be a JSON schema (an object), not {other}")),
    }
}

/// Why `name` cannot name a client tool on Anthropic's route: Anthropic's API takes names matching
/// `^[a-zA-Z0-9_-]{1,128}$` only, and says so in these words. (OpenAI's route takes any name, as
/// llama-server and vLLM do: clients written for them send names such as `server.tool`.)
pub fn anthropic_tool_name_problem(name: &str) -> Option<&'static str> {
    let valid = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    (name.is_empty() || name.len() > 128 || !name.chars().all(valid))
        .then_some("String should match pattern '^[a-zA-Z0-9_-]{1,128}$'")
}

/// The first name given twice, if any (Anthropic refuses them: a call must say which tool it is).
pub fn duplicate_name<'a>(names: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    let mut seen = std::collections::HashSet::new();
    names.into_iter().find(|n| !seen.insert(*n))
}

impl Tooling {
    /// `tools` in the template's shape (each with a `function.name`) for a model whose template is
    /// `template`.
    pub fn new(tools: Vec<Value>, parallel: bool, template: Option<&str>) -> Result<Tooling, String> {
        let format = format_of(template)?;
        let names = tools
            .iter()
            .map(|t| t.pointer("/function/name").and_then(Value::as_str).unwrap_or_default().to_string())
            .collect();
        Ok(Tooling { format, tools, names, parallel, forced: None })
    }

    /// These tools with a call forced (None: the model chooses); Err when the named tool is not
    /// among them.
    pub fn forcing(mut self, forced: Option<Forced>) -> Result<Tooling, String> {
        if let Some(Forced::Named(n)) = &forced {
            if !self.names.contains(n) {
                return Err(format!("the forced tool `{n}` is not among the request's tools"));
            }
        }
        self.forced = forced;
        Ok(self)
    }

    /// The grammar (llguidance's Lark) of answers that are only calls in this template's format —
    /// to the forced tool, or to any when none is named; one call, or several where parallel —
    /// each call's arguments held to its tool's parameter schema. `tag_id` gives the token of a tag
    /// that is a special token. Err for a format whose calls are not written as a grammar here.
    pub fn forced_grammar(&self, tag_id: impl Fn(&str) -> Option<u32>) -> Result<String, String> {
        let Some(forced) = &self.forced else { return Err("no call is forced".into()) };
        let args_key = if self.format == ToolFormat::Llama3Json { "parameters" } else { "arguments" };
        let calls: Vec<Value> = self
            .tools
            .iter()
            .map(|t| &t["function"])
            .filter(|f| match forced {
                Forced::Any => true,
                Forced::Named(n) => f["name"] == n.as_str(),
            })
            .map(|f| {
                // (OpenAI: "omitting parameters defines a function with an empty parameter list".)
                let none = json!({"type": "object", "properties": {}, "additionalProperties": false});
                let mut params = Some(&f["parameters"]).filter(|p| !p.is_null()).cloned().unwrap_or(none);
                // As a JSON format's: listed arguments only (a call with none closes at once).
                crate::text::grammar::close_objects(&mut params);
                json!({"type": "object", "properties": {"name": {"const": f["name"]}, args_key: params},
                    "required": ["name", args_key], "additionalProperties": false})
            })
            .collect();
        let many = calls.len() > 1;
        let mut calls = calls;
        // Each tool's schema moves under its call's `arguments`: its own `#/…` references follow.
        for (i, c) in calls.iter_mut().enumerate() {
            let at = if many { format!("/anyOf/{i}/properties/{args_key}") } else { format!("/properties/{args_key}") };
            rebase_refs(&mut c["properties"][args_key], &at);
        }
        let mut schema = match calls.len() {
            0 => return Err("the forced tool is not among the request's tools".into()),
            1 => calls.into_iter().next().expect("one"),
            _ => json!({"anyOf": calls}),
        };
        // The JSON as these templates write calls (`", "`, `": "`, no other whitespace); keywords
        // the grammar cannot hold to (`uniqueItems`, formats) are left unchecked, as the model
        // would have been shown them.
        schema["x-guidance"] =
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ", "lenient": true});
        let call = format!("%json {schema}");
        let tag = |t: &str| match tag_id(t) {
            Some(id) => format!("<[{id}]>"),
            None => serde_json::to_string(t).expect("a string"),
        };
        match self.format {
            ToolFormat::Hermes => {
                let close = self.format.close().expect("Hermes calls end with a tag");
                let one = format!("{} \"\\n\" {call} \"\\n\" {}", tag(self.format.open()), tag(close));
                // A named tool is one call (OpenAI's forced function); `required` may be several.
                let more = if self.parallel && *forced == Forced::Any { "(\"\\n\" call)*" } else { "" };
                Ok(format!("start: call {more}\ncall: {one}\n"))
            }
            // The whole answer is the call (optionally after `<|python_tag|>`, left out here).
            ToolFormat::Llama3Json => Ok(format!("start: {call}\n")),
            other => Err(format!("forcing a call is not supported for {} calls (only auto and none)", other.name())),
        }
    }

    pub fn parser(&self, id_prefix: &'static str) -> CallParser {
        let mut p = CallParser::new(self.format, self.names.clone(), self.parallel, id_prefix);
        p.strict = self.names.iter().filter_map(|n| Some((n.clone(), self.strict_schema(n)?.clone()))).collect();
        p.params = self
            .tools
            .iter()
            .map(|t| &t["function"])
            .filter_map(|f| Some((f["name"].as_str()?.to_string(), f["parameters"].clone())))
            .collect();
        p.forced = self.forced.is_some();
        p
    }

    /// A whole answer's pieces, in order.
    pub fn pieces(&self, id_prefix: &'static str, text: &str) -> Vec<Piece> {
        join_text(self.parser(id_prefix).feed(text, true))
    }

    /// A whole answer's text (the pieces between calls joined) and its calls.
    pub fn split(&self, id_prefix: &'static str, text: &str) -> (String, Vec<ToolCall>) {
        text_and_calls(self.pieces(id_prefix, text))
    }
}

/// A conversation's tool calls as the template of format `format` (source `template`) takes them:
/// Mistral's templates take only ids of nine letters and digits (others are mapped, calls and
/// results alike), and an LFM2 template that leaves calls out of the history gets them in the
/// assistant's text, as the model wrote them.
pub fn history_for(template: Option<&str>, messages: &[ChatMessage]) -> Option<Vec<ChatMessage>> {
    let format = format_of(template).ok()?;
    let lfm2_text = format == ToolFormat::Lfm2 && !template.unwrap_or_default().contains("tool_calls");
    if format != ToolFormat::Mistral && !lfm2_text {
        return None;
    }
    let mut out = messages.to_vec();
    for m in &mut out {
        if format == ToolFormat::Mistral {
            m.tool_call_id = m.tool_call_id.as_deref().map(formats::mistral_id);
            for call in m.tool_calls.iter_mut().flatten() {
                if let Some(id) = call.get("id").and_then(Value::as_str).map(formats::mistral_id) {
                    call["id"] = Value::String(id);
                }
            }
        }
        if lfm2_text {
            let named = |c: &Value| {
                let name = c.pointer("/function/name").and_then(Value::as_str).unwrap_or_default().to_string();
                (name, c.pointer("/function/arguments").cloned().unwrap_or(Value::Null))
            };
            if let Some(calls) = m.tool_calls.take() {
                // Calls first, as LFM2 writes them.
                let text = formats::lfm2_call_text(&calls.iter().map(named).collect::<Vec<RawCall>>());
                m.content.insert_str(0, &text);
            }
        }
    }
    Some(out)
}

/// The special tokens whose text a chat answer keeps: the thought tags, and with tools the call
/// format's tags (which a tokenizer may hold as special tokens, as LFM2's and Mistral's do).
pub fn shown_tags(tok: &TextTokenizer, tooling: Option<&Tooling>) -> Vec<u32> {
    let mut tags = vec!["<think>", "</think>"];
    tags.extend(tooling.map_or(&[][..], |t| t.format.tags()));
    tok.special_ids(&tags)
}

/// The pieces new answer text completes, through the call reader when the request has tools (else
/// the text itself); empty text left out. `end`: the answer is over.
pub fn pieces_through(calls: &mut Option<CallParser>, text: &str, end: bool) -> Vec<Piece> {
    let mut pieces = match calls {
        None => vec![Piece::Text(text.to_string())],
        Some(p) => p.feed(text, end),
    };
    pieces.retain(|p| !matches!(p, Piece::Text(t) if t.is_empty()));
    pieces
}

/// Pieces as their text (joined) and their calls.
pub fn text_and_calls(pieces: Vec<Piece>) -> (String, Vec<ToolCall>) {
    let mut text = String::new();
    let mut calls = Vec::new();
    for piece in pieces {
        match piece {
            Piece::Text(t) => text.push_str(&t),
            Piece::Call(c) => calls.push(c),
        }
    }
    (text, calls)
}

/// One call the model made: `arguments` is a JSON object.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: Value,
}

impl ToolCall {
    /// OpenAI's shape (`arguments` as a JSON string).
    pub fn openai(&self) -> Value {
        json!({"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments.to_string()}})
    }

    /// Anthropic's `tool_use` block.
    pub fn anthropic(&self) -> Value {
        json!({"type": "tool_use", "id": self.id, "name": self.name, "input": self.arguments})
    }
}

/// A call as a chat template reads it in an assistant turn of the history.
pub fn template_call(id: &str, name: &str, arguments: Value) -> Value {
    json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
}

/// A piece of the answer: text, or a whole call.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Text(String),
    Call(ToolCall),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum State {
    /// Nothing but whitespace yet (Llama 3: a call is the whole answer).
    Start,
    Text,
    /// Inside a call: its text is held until it ends.
    Call,
    /// Just past a call: whitespace before the next one is dropped.
    AfterCall,
}

/// Reads an answer's text as it streams into text and calls. Only a call to one of the request's
/// tools is a call (JSON that names anything else stays text); without parallel calls, calls past
/// the first are dropped. Whitespace just before a call, or between calls, is not text.
pub struct CallParser {
    format: ToolFormat,
    names: Vec<String>,
    parallel: bool,
    state: State,
    held: String,
    /// Prefix of the ids it makes (`call_` for OpenAI, `toolu_` for Anthropic).
    id_prefix: &'static str,
    calls: usize,
    /// Inside a call, where in `held` its close may start (what came before was looked through).
    scan_from: usize,
    /// The whitespace before the call being read.
    ws_before: String,
    /// The strict tools' parameter schemas, by name.
    strict: Vec<(String, Value)>,
    /// Every tool's parameter schema, by name (how the XML formats' values are read).
    params: Vec<(String, Value)>,
    /// A call was forced, so the answer is only calls: one cut short (by the token limit, a stop
    /// string or the timeout) is dropped, where it would otherwise stay text.
    forced: bool,
}

impl CallParser {
    pub fn new(format: ToolFormat, names: Vec<String>, parallel: bool, id_prefix: &'static str) -> CallParser {
        let held = String::new();
        let (calls, scan_from, ws_before) = (0, 0, String::new());
        let (strict, params, forced) = (Vec::new(), Vec::new(), false);
        CallParser {
            format,
            names,
            parallel,
            state: State::Start,
            held,
            id_prefix,
            calls,
            scan_from,
            ws_before,
            strict,
            params,
            forced,
        }
    }

    /// The pieces `text` completes; `end`: the answer is over, so what was held goes out too.
    pub fn feed(&mut self, text: &str, end: bool) -> Vec<Piece> {
        let mut pieces = self.push(text);
        if end {
            pieces.extend(self.finish());
        }
        pieces
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.held.push_str(text);
        self.advance(false)
    }

    /// What is left at the end of the answer (an unclosed call that parses is a call).
    pub fn finish(&mut self) -> Vec<Piece> {
        self.advance(true)
    }

    fn advance(&mut self, last: bool) -> Vec<Piece> {
        let mut out = Vec::new();
        loop {
            match (self.format, self.state) {
                (_, State::Start) => {
                    if self.held.trim_start().is_empty() && !last {
                        return out;
                    }
                    self.state = if self.format == ToolFormat::Llama3Json { State::Call } else { State::Text };
                }
                (ToolFormat::Llama3Json, State::Call) => {
                    // A call is the whole answer: JSON from the start (or after the tag).
                    let (t, tag) = (self.held.trim_start(), ToolFormat::Llama3Json.open());
                    if t.is_empty() || !(t.starts_with('{') || t.starts_with(tag) || tag.starts_with(t)) {
                        self.state = State::Text;
                        continue;
                    }
                    if !last {
                        return out;
                    }
                    let body = std::mem::take(&mut self.held);
                    let t = body.trim().strip_prefix(ToolFormat::Llama3Json.open()).unwrap_or(body.trim());
                    match self.take(t) {
                        Some(calls) => out.extend(calls.into_iter().map(Piece::Call)),
                        None if self.forced => {}
                        None => out.push(Piece::Text(body)),
                    }
                    self.state = State::Text;
                    return out;
                }
                (ToolFormat::Llama3Json, _) => {
                    if !self.held.is_empty() {
                        out.push(Piece::Text(std::mem::take(&mut self.held)));
                    }
                    return out;
                }
                (format, State::Text) => {
                    let open = format.open();
                    if let Some(at) = self.held.find(open) {
                        // The whitespace before a call is not text (it goes back if this is no call).
                        let before = self.held[..at].trim_end();
                        if !before.is_empty() {
                            out.push(Piece::Text(before.to_string()));
                        }
                        self.ws_before = self.held[before.len()..at].to_string();
                        self.held.drain(..at + open.len());
                        self.state = State::Call;
                        self.scan_from = 0;
                        continue;
                    }
                    // Keep a possible start of the tag and the whitespace before it.
                    let keep_from =
                        if last { self.held.len() } else { self.held.len() - partial_tag(&self.held, open) };
                    let emit = if last { keep_from } else { self.held[..keep_from].trim_end().len() };
                    if emit > 0 {
                        out.push(Piece::Text(self.held.drain(..emit).collect()));
                    }
                    return out;
                }
                (format, State::Call) => {
                    let Some((body, rest, closed)) = self.call_body(format.close(), last) else { return out };
                    // An unclosed call may end inside its close.
                    let cut = match (closed, format.close()) {
                        (false, Some(close)) => body.len() - partial_tag(&body, close),
                        _ => body.len(),
                    };
                    match self.take(&body[..cut]) {
                        Some(calls) => out.extend(calls.into_iter().map(Piece::Call)),
                        // A forced call cut short is no call, and not text either.
                        None if self.forced && !closed => {
                            self.held = rest;
                            self.state = State::Text;
                            continue;
                        }
                        // Not a call after all: the text as the model wrote it.
                        None => {
                            let close = if closed { format.close().unwrap_or_default() } else { "" };
                            out.push(Piece::Text(format!("{}{}{body}{close}", self.ws_before, format.open())));
                            self.held = rest;
                            self.state = State::Text;
                            continue;
                        }
                    }
                    self.held = rest;
                    self.state = State::AfterCall;
                    if last && self.held.is_empty() {
                        return out;
                    }
                }
                (_, State::AfterCall) => {
                    // Whitespace after a call is text only if text follows (not another call or the
                    // end), as the model wrote it.
                    if self.held.trim_start().is_empty() {
                        if last {
                            self.held.clear();
                        }
                        return out;
                    }
                    self.state = State::Text;
                }
            }
        }
    }

    /// The body of the call being read, the text after it, and whether its close tag was seen; None
    /// while it is not complete. A call ends at its close tag (`close`), or where its JSON does
    /// (Mistral's); at the end of the answer, whatever was held is its body (a call cut off by the
    /// token limit, maybe inside its close).
    fn call_body(&mut self, close: Option<&str>, last: bool) -> Option<(String, String, bool)> {
        let Some(close) = close else {
            let json_may_end = self.held[self.scan_from..].contains(['}', ']']);
            self.scan_from = self.held.len();
            return match formats::mistral_end(&self.held, json_may_end || last) {
                Some(end) => Some((self.held[..end].to_string(), self.held[end..].to_string(), false)),
                None if last => Some((std::mem::take(&mut self.held), String::new(), false)),
                None => None,
            };
        };
        // The close can only be in what arrived since the last look (or straddle it).
        match self.held[self.scan_from..].find(close).map(|at| self.scan_from + at) {
            Some(at) => Some((self.held[..at].to_string(), self.held[at + close.len()..].to_string(), true)),
            None if last => Some((std::mem::take(&mut self.held), String::new(), false)),
            None => {
                let mut from = self.held.len().saturating_sub(close.len() - 1);
                while !self.held.is_char_boundary(from) {
                    from -= 1;
                }
                self.scan_from = from;
                None
            }
        }
    }

    /// The calls of one call block's body: None when it is not a call to the request's tools
    /// (or, for a strict tool, does not fit its schema); calls past the first are dropped without
    /// parallel calls.
    fn take(&mut self, body: &str) -> Option<Vec<ToolCall>> {
        let params = &self.params;
        let schema = |name: &str| params.iter().find(|(n, _)| n == name).map(|(_, s)| s);
        let raw: Vec<RawCall> = formats::calls_in(self.format, body, &schema)?;
        for (name, arguments) in &raw {
            if !self.names.iter().any(|d| d == name) {
                return None;
            }
            if self.strict.iter().any(|(n, schema)| n == name && !fits(arguments, schema)) {
                return None;
            }
        }
        let mut calls = Vec::new();
        for (name, arguments) in raw {
            if !self.parallel && self.calls > 0 {
                break;
            }
            self.calls += 1;
            calls.push(ToolCall { id: new_id(self.id_prefix), name, arguments });
        }
        Some(calls)
    }
}

/// The length of the longest end of `text` that `tag` starts with (short of the whole tag).
fn partial_tag(text: &str, tag: &str) -> usize {
    (1..tag.len()).rev().find(|&k| text.ends_with(&tag[..k])).unwrap_or(0)
}

fn join_text(pieces: Vec<Piece>) -> Vec<Piece> {
    let mut out: Vec<Piece> = Vec::new();
    for p in pieces {
        match (out.last_mut(), p) {
            (Some(Piece::Text(a)), Piece::Text(b)) => a.push_str(&b),
            (_, p) => out.push(p),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pieces of `text` streamed in two parts at every cut, ids aside, text joined: the same as
    /// the whole answer's.
    fn streamed(format: ToolFormat, text: &str) -> Vec<Piece> {
        let strip = |pieces: Vec<Piece>| {
            join_text(pieces)
                .into_iter()
                .map(|p| match p {
                    Piece::Call(c) => Piece::Call(ToolCall { id: String::new(), ..c }),
                    t => t,
                })
                .collect::<Vec<_>>()
        };
        let names = || ["weather", "time", "f"].map(String::from).to_vec();
        let tooling = Tooling { format, tools: vec![], names: names(), parallel: true, forced: None };
        let whole = strip(tooling.pieces("call_", text));
        for cut in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
            let mut p = tooling.parser("call_");
            let mut pieces = p.push(&text[..cut]);
            pieces.extend(p.push(&text[cut..]));
            pieces.extend(p.finish());
            assert_eq!(strip(pieces), whole, "cut at {cut} of {text:?}");
        }
        whole
    }

    fn call(name: &str, arguments: Value) -> Piece {
        Piece::Call(ToolCall { id: String::new(), name: name.into(), arguments })
    }

    fn text(s: &str) -> Piece {
        Piece::Text(s.into())
    }

    #[test]
    fn hermes_calls_after_text_in_any_cut() {
        let a = "Let me look.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"time\", \"arguments\": \"{\\\"tz\\\": \\\"CET\\\"}\"}\n</tool_call>";
        assert_eq!(
            streamed(ToolFormat::Hermes, a),
            [text("Let me look."), call("weather", json!({"city": "Paris"})), call("time", json!({"tz": "CET"}))]
        );
        // Without parallel calls, the first only.
        let names = vec!["weather".into(), "time".into()];
        let one = Tooling { format: ToolFormat::Hermes, tools: vec![], names, parallel: false, forced: None };
        let (content, calls) = one.split("call_", a);
        assert_eq!((content.as_str(), calls.len(), calls[0].name.as_str()), ("Let me look.", 1, "weather"));
        assert_eq!(streamed(ToolFormat::Hermes, "Paris is the capital."), [text("Paris is the capital.")]);
        assert_eq!(streamed(ToolFormat::Hermes, "a <tool b"), [text("a <tool b")]);
        // Unclosed at the end (or cut inside the close), but whole JSON: a call.
        assert_eq!(streamed(ToolFormat::Hermes, "<tool_call>{\"name\": \"f\"}"), [call("f", json!({}))]);
        assert_eq!(streamed(ToolFormat::Hermes, "<tool_call>{\"name\": \"f\"}\n</tool_"), [call("f", json!({}))]);
        // Not JSON: the text as written.
        assert_eq!(
            streamed(ToolFormat::Hermes, "<tool_call>oops</tool_call> x"),
            [text("<tool_call>oops</tool_call> x")]
        );
        assert_eq!(
            streamed(ToolFormat::Hermes, "a <tool_call>oops</tool_call> x"),
            [text("a <tool_call>oops</tool_call> x")]
        );
        // Text after a call keeps the break before it.
        let after = "Checking.\n<tool_call>{\"name\": \"f\"}</tool_call>\nDone.\n";
        assert_eq!(streamed(ToolFormat::Hermes, after), [text("Checking."), call("f", json!({})), text("\nDone.\n")]);
        // A call to a tool the request did not give is text.
        let other = "<tool_call>{\"name\": \"rm\", \"arguments\": {}}</tool_call>";
        assert_eq!(streamed(ToolFormat::Hermes, other), [text(other)]);
    }

    #[test]
    fn a_forced_call_cut_short_is_dropped_not_text() {
        let names = || vec!["weather".to_string(), "f".to_string()];
        let cut = "<tool_call>\n{\"name\": \"f\"}\n</tool_call>\n<tool_call>\n{\"name\": \"weather\", \"argu";
        for (format, answer, whole) in [
            (ToolFormat::Hermes, cut, vec![call("f", json!({}))]),
            (ToolFormat::Llama3Json, "{\"name\": \"weather\", \"param", vec![]),
        ] {
            let auto = Tooling { format, tools: vec![], names: names(), parallel: true, forced: None };
            let forced = Tooling { forced: Some(Forced::Any), ..auto };
            let mut pieces = forced.pieces("call_", answer);
            for p in &mut pieces {
                if let Piece::Call(c) = p {
                    c.id.clear();
                }
            }
            assert_eq!(pieces, whole, "{format:?}");
            // Where the model chose to call, what it wrote stays: it may be text.
            let auto = Tooling { forced: None, ..forced };
            assert!(auto.split("call_", answer).0.contains("\"weather\""), "{format:?}");
        }
    }

    #[test]
    fn llama3_json_calls_are_the_whole_answer() {
        let a = " {\"name\": \"weather\", \"parameters\": {\"city\": \"Paris\"}}";
        assert_eq!(streamed(ToolFormat::Llama3Json, a), [call("weather", json!({"city": "Paris"}))]);
        let tagged = "<|python_tag|>{\"name\": \"f\", \"parameters\": {}}";
        assert_eq!(streamed(ToolFormat::Llama3Json, tagged), [call("f", json!({}))]);
        assert_eq!(streamed(ToolFormat::Llama3Json, "Hello {there}"), [text("Hello {there}")]);
        assert_eq!(streamed(ToolFormat::Llama3Json, "{not json"), [text("{not json")]);
        // JSON naming no declared tool is an answer, not a call.
        let person = "{\"name\": \"Bob\", \"age\": 3}";
        assert_eq!(streamed(ToolFormat::Llama3Json, person), [text(person)]);
        assert_eq!(streamed(ToolFormat::Llama3Json, "<b>bold</b>"), [text("<b>bold</b>")]);
    }

    #[test]
    fn a_forced_call_to_a_tool_without_parameters_has_empty_arguments() {
        let t = Tooling {
            format: ToolFormat::Hermes,
            tools: vec![json!({"type": "function", "function": {"name": "ping"}})],
            names: vec!["ping".into()],
            parallel: true,
            forced: Some(Forced::Any),
        };
        let g = t.forced_grammar(|_| None).unwrap();
        let empty = json!({"type": "object", "properties": {}, "additionalProperties": false}).to_string();
        assert!(g.contains(&format!("\"arguments\":{empty}")), "{g}");
        // Given as an empty object with no word on other keys, it is closed the same way.
        let t = Tooling {
            tools: vec![
                json!({"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}),
            ],
            ..t
        };
        let g = t.forced_grammar(|_| None).unwrap();
        assert!(g.contains(&format!("\"arguments\":{empty}")), "{g}");
    }

    #[test]
    fn a_strict_tools_calls_must_fit_its_schema() {
        let schema = json!({"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
            "unit": {"enum": ["C", "F"]}}, "required": ["city"], "additionalProperties": false});
        let tool = |strict: bool| json!({"type": "function", "function": {"name": "f", "parameters": schema, "strict": strict}});
        let answer = |args: &str| format!("<tool_call>{{\"name\": \"f\", \"arguments\": {args}}}</tool_call>");
        for (args, ok) in [
            (r#"{"city": "Paris"}"#, true),
            (r#"{"city": "Paris", "days": 3, "unit": "C"}"#, true),
            (r#"{"days": 3}"#, false),
            (r#"{"city": "Paris", "days": 2.5}"#, false),
            (r#"{"city": "Paris", "unit": "K"}"#, false),
            (r#"{"city": "Paris", "extra": 1}"#, false),
        ] {
            let strict = Tooling {
                format: ToolFormat::Hermes,
                tools: vec![tool(true)],
                names: vec!["f".into()],
                parallel: true,
                forced: None,
            };
            let pieces = strict.pieces("call_", &answer(args));
            assert_eq!(matches!(pieces[..], [Piece::Call(_)]), ok, "{args}: {pieces:?}");
            // Not strict: any JSON object is the call.
            let loose = Tooling { tools: vec![tool(false)], ..strict };
            assert!(matches!(loose.pieces("call_", &answer(args))[..], [Piece::Call(_)]), "{args}");
        }
    }

    #[test]
    fn every_format_streams_its_calls_in_any_cut() {
        let xml = "Checking.\n<tool_call>\n<function=weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n\
                   <tool_call>\n<function=time>\n</function>\n</tool_call>";
        let both = [text("Checking."), call("weather", json!({"city": "Paris"})), call("time", json!({}))];
        assert_eq!(streamed(ToolFormat::QwenXml, xml), both);
        let glm =
            "Checking.\n<tool_call>weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>\n\
                   <tool_call>time\n</tool_call>";
        assert_eq!(streamed(ToolFormat::Glm, glm), both);
        let lfm2 = "Checking.<|tool_call_start|>[weather(city=\"Paris\"), time()]<|tool_call_end|>";
        assert_eq!(streamed(ToolFormat::Lfm2, lfm2), both);
        let lfm2_after = "<|tool_call_start|>[f()]<|tool_call_end|>Done.";
        assert_eq!(streamed(ToolFormat::Lfm2, lfm2_after), [call("f", json!({})), text("Done.")]);
        let list = "Checking.[TOOL_CALLS][{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"time\", \"arguments\": {}}]";
        assert_eq!(streamed(ToolFormat::Mistral, list), both);
        let prose = "Note[TOOL_CALLS] see below[TOOL_CALLS]weather[ARGS]{\"city\": \"Paris\"}";
        assert_eq!(streamed(ToolFormat::Mistral, prose), [text("Note[TOOL_CALLS] see below"), both[1].clone()]);
        let each = "Checking.[TOOL_CALLS]weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]time[CALL_ID]a1b2c3d4e[ARGS]{}";
        assert_eq!(streamed(ToolFormat::Mistral, each), both);
        // Cut off by the token limit inside the arguments: text as written.
        let cut = "[TOOL_CALLS]weather[ARGS]{\"city\": \"Par";
        assert_eq!(streamed(ToolFormat::Mistral, cut), [text(cut)]);
        // A block that is no call to the request's tools stays text, tags and all.
        let other = "<|tool_call_start|>[rm(path=\"/\")]<|tool_call_end|> ok";
        assert_eq!(streamed(ToolFormat::Lfm2, other), [text(other)]);
        let prose = "Use [TOOL_CALLS] like so.";
        assert_eq!(streamed(ToolFormat::Mistral, prose), [text(prose)]);
    }

    #[test]
    fn ids_are_fresh_and_openai_arguments_are_a_string() {
        let answer = "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}</tool_call>";
        let tooling = Tooling {
            format: ToolFormat::Hermes,
            tools: vec![],
            names: vec!["f".into()],
            parallel: true,
            forced: None,
        };
        let pieces = tooling.pieces("call_", answer);
        let Piece::Call(c) = &pieces[0] else { panic!("{pieces:?}") };
        assert!(c.id.starts_with("call_") && c.id.len() > 10);
        assert_eq!(c.openai()["function"]["arguments"], json!("{\"a\":1}"));
    }
}
