//! Tool calling: the request's tools go to the chat template (which writes them into the prompt the
//! way the model was trained to read them), and the model's answer is read back for calls in the
//! format its template uses — as llama-server does with `--jinja`, but without grammars: a call is
//! what the model writes, parsed after the fact, never forced.
//!
//! Formats, recognised from the template's source:
//! - Hermes (Qwen2.5, Qwen3, Hermes, SmolLM3 …): `<tool_call>{"name": …, "arguments": {…}}</tool_call>`,
//!   any number of them, after optional text;
//! - Llama 3.1+: the whole answer is `{"name": …, "parameters": {…}}` (optionally after
//!   `<|python_tag|>`).
//!
//! Streams are parsed as they arrive: text goes out at once except what may still be the start of a
//! call, and each call goes out whole once its closing tag (or the end) is seen.

use serde_json::{json, Map, Value};

use super::completion::new_id;

/// How a model writes tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3Json,
}

/// The tool-call format of a chat template, or why tools cannot be given to it.
pub fn format_of(template: Option<&str>) -> Result<ToolFormat, String> {
    let t = template.unwrap_or_default();
    if !t.contains("tools") {
        return Err("this model's chat template does not take tools".into());
    }
    // Qwen3-Coder's and Functionary's XML calls (`<function=name><parameter=k>v</parameter>`) share
    // the tags of the JSON formats.
    if t.contains("<function=") {
        return Err("this model writes tool calls as XML (`<function=…>`), which this server does not read yet".into());
    }
    if t.contains("<tool_call>") && !t.contains("<arg_key>") {
        return Ok(ToolFormat::Hermes);
    }
    if t.contains("<|python_tag|>") || (t.contains("ipython") && t.contains("\"parameters\"")) {
        return Ok(ToolFormat::Llama3Json);
    }
    Err("the tool-call format of this model's chat template is not supported (supported: Hermes `<tool_call>` \
         as Qwen2.5/Qwen3 write it, and Llama 3.1+ JSON calls)"
        .into())
}

/// The tools a request gives the model, checked against its template. Calls are not forced
/// (there is no constrained decoding): a `strict` tool's calls are checked against its parameter
/// schema instead, and one that does not fit it is not a call.
#[derive(Debug, Clone)]
pub struct Tooling {
    pub format: ToolFormat,
    /// As chat templates read them: `{"type": "function", "function": {name, description, parameters}}`.
    pub tools: Vec<Value>,
    pub names: Vec<String>,
    /// More than one call per answer (else the first call is kept).
    pub parallel: bool,
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

impl Tooling {
    /// `tools` in the template's shape (each with a `function.name`) for a model whose template is
    /// `template`.
    pub fn new(tools: Vec<Value>, parallel: bool, template: Option<&str>) -> Result<Tooling, String> {
        let format = format_of(template)?;
        let names = tools
            .iter()
            .map(|t| t.pointer("/function/name").and_then(Value::as_str).unwrap_or_default().to_string())
            .collect();
        Ok(Tooling { format, tools, names, parallel })
    }

    pub fn parser(&self, id_prefix: &'static str) -> CallParser {
        let mut p = CallParser::new(self.format, self.names.clone(), self.parallel, id_prefix);
        p.strict = self.names.iter().filter_map(|n| Some((n.clone(), self.strict_schema(n)?.clone()))).collect();
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

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";

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
    /// The whitespace before the `<tool_call>` being read.
    ws_before: String,
    /// The strict tools' parameter schemas, by name.
    strict: Vec<(String, Value)>,
}

impl CallParser {
    pub fn new(format: ToolFormat, names: Vec<String>, parallel: bool, id_prefix: &'static str) -> CallParser {
        let held = String::new();
        let (calls, scan_from, ws_before) = (0, 0, String::new());
        let strict = Vec::new();
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
                    let t = self.held.trim_start();
                    if t.is_empty() || !(t.starts_with('{') || t.starts_with(PYTHON_TAG) || PYTHON_TAG.starts_with(t)) {
                        self.state = State::Text;
                        continue;
                    }
                    if !last {
                        return out;
                    }
                    let body = std::mem::take(&mut self.held);
                    let t = body.trim().strip_prefix(PYTHON_TAG).unwrap_or(body.trim());
                    match self.call_from(t, "parameters") {
                        Some(Some(c)) => out.push(Piece::Call(c)),
                        Some(None) => {}
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
                (ToolFormat::Hermes, State::Text) => {
                    if let Some(at) = self.held.find(OPEN) {
                        // The whitespace before a call is not text (it goes back if this is no call).
                        let before = self.held[..at].trim_end();
                        if !before.is_empty() {
                            out.push(Piece::Text(before.to_string()));
                        }
                        self.ws_before = self.held[before.len()..at].to_string();
                        self.held.drain(..at + OPEN.len());
                        self.state = State::Call;
                        self.scan_from = 0;
                        continue;
                    }
                    // Keep a possible start of `<tool_call>` and the whitespace before it.
                    let keep_from =
                        if last { self.held.len() } else { self.held.len() - partial_tag(&self.held, OPEN) };
                    let emit = if last { keep_from } else { self.held[..keep_from].trim_end().len() };
                    if emit > 0 {
                        out.push(Piece::Text(self.held.drain(..emit).collect()));
                    }
                    return out;
                }
                (ToolFormat::Hermes, State::Call) => {
                    // The close can only be in what arrived since the last look (or straddle it).
                    let found = self.held[self.scan_from..].find(CLOSE).map(|at| self.scan_from + at);
                    let (body, rest) = match found {
                        Some(at) => (self.held[..at].to_string(), Some(self.held[at + CLOSE.len()..].to_string())),
                        // Cut off by the token limit, maybe inside the close.
                        None if last => (std::mem::take(&mut self.held), None),
                        None => {
                            let mut from = self.held.len().saturating_sub(CLOSE.len() - 1);
                            while !self.held.is_char_boundary(from) {
                                from -= 1;
                            }
                            self.scan_from = from;
                            return out;
                        }
                    };
                    let json = if rest.is_some() { &body } else { &body[..body.len() - partial_tag(&body, CLOSE)] };
                    match self.call_from(json.trim(), "arguments") {
                        Some(Some(c)) => out.push(Piece::Call(c)),
                        Some(None) => {}
                        // Not a call after all: the text as the model wrote it.
                        None => {
                            let close = if rest.is_some() { CLOSE } else { "" };
                            out.push(Piece::Text(format!("{}{OPEN}{body}{close}", self.ws_before)));
                            self.held = rest.unwrap_or_default();
                            self.state = State::Text;
                            continue;
                        }
                    }
                    self.held = rest.unwrap_or_default();
                    self.state = State::AfterCall;
                    if last && self.held.is_empty() {
                        return out;
                    }
                }
                (ToolFormat::Hermes, State::AfterCall) => {
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

    /// A call from its JSON (`{"name": …, "arguments": {…}}`; Llama 3 names them `parameters`):
    /// None when it is not one, `Some(None)` for a call dropped (past the first, without parallel
    /// calls).
    fn call_from(&mut self, body: &str, args_key: &str) -> Option<Option<ToolCall>> {
        let v: Map<String, Value> = serde_json::from_str(body).ok()?;
        let name = v.get("name")?.as_str().filter(|n| self.names.iter().any(|d| d == n))?.to_string();
        let arguments = match v.get(args_key).or_else(|| v.get("arguments")).or_else(|| v.get("parameters")) {
            None | Some(Value::Null) => json!({}),
            // Some models write the arguments as a JSON string.
            Some(Value::String(s)) => serde_json::from_str(s).ok().filter(Value::is_object)?,
            Some(o @ Value::Object(_)) => o.clone(),
            Some(_) => return None,
        };
        if self.strict.iter().any(|(n, schema)| *n == name && !fits(&arguments, schema)) {
            return None;
        }
        if !self.parallel && self.calls > 0 {
            return Some(None);
        }
        self.calls += 1;
        Some(Some(ToolCall { id: new_id(self.id_prefix), name, arguments }))
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
        let tooling = Tooling { format, tools: vec![], names: names(), parallel: true };
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
        let one = Tooling { format: ToolFormat::Hermes, tools: vec![], names, parallel: false };
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
            };
            let pieces = strict.pieces("call_", &answer(args));
            assert_eq!(matches!(pieces[..], [Piece::Call(_)]), ok, "{args}: {pieces:?}");
            // Not strict: any JSON object is the call.
            let loose = Tooling { tools: vec![tool(false)], ..strict };
            assert!(matches!(loose.pieces("call_", &answer(args))[..], [Piece::Call(_)]), "{args}");
        }
    }

    #[test]
    fn formats_are_told_from_the_template() {
        let qwen = "{% if tools %}<tools>{{ tools | tojson }}</tools> <tool_call>{% endif %}";
        assert_eq!(format_of(Some(qwen)), Ok(ToolFormat::Hermes));
        let llama = "{% if tools %}{{ '<|python_tag|>' }}{% endif %}";
        assert_eq!(format_of(Some(llama)), Ok(ToolFormat::Llama3Json));
        assert!(format_of(Some("{{ messages }}")).unwrap_err().contains("does not take tools"));
        assert!(format_of(Some("{% if tools %}[TOOL_CALLS]{% endif %}")).unwrap_err().contains("not supported"));
        let coder = "{% if tools %}<tool_call>\n<function=name>\n<parameter=k>v</parameter>{% endif %}";
        assert!(format_of(Some(coder)).unwrap_err().contains("XML"));
        assert!(format_of(None).is_err());
    }

    #[test]
    fn ids_are_fresh_and_openai_arguments_are_a_string() {
        let answer = "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}</tool_call>";
        let tooling = Tooling { format: ToolFormat::Hermes, tools: vec![], names: vec!["f".into()], parallel: true };
        let pieces = tooling.pieces("call_", answer);
        let Piece::Call(c) = &pieces[0] else { panic!("{pieces:?}") };
        assert!(c.id.starts_with("call_") && c.id.len() > 10);
        assert_eq!(c.openai()["function"]["arguments"], json!("{\"a\":1}"));
    }
}
