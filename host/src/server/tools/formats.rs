//! The ways models write tool calls: which one a chat template uses, the tags around a call, and a
//! call's body read into names and arguments.
//!
//! - Hermes (Qwen2.5, Qwen3, Hermes, SmolLM3 …): `<tool_call>{"name": …, "arguments": {…}}</tool_call>`;
//! - Qwen3-Coder XML: `<tool_call><function=NAME><parameter=K>V</parameter>…</function></tool_call>`;
//! - GLM-4.5/4.6: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>…</tool_call>`;
//! - LFM2: `<|tool_call_start|>[name(k="v"), …]<|tool_call_end|>` (Python calls, or a JSON list);
//! - Mistral: `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]` (Nemo, Small 3.0/3.1), or per call
//!   `[TOOL_CALLS]NAME[ARGS]{…}` (Small 3.2, Magistral; `[CALL_ID]ID` before `[ARGS]` in some);
//! - Llama 3.1+: the whole answer is `{"name": …, "parameters": {…}}` (optionally after
//!   `<|python_tag|>`).
//!
//! The XML formats write values as text: a parameter whose schema says string keeps it as written,
//! others are read as JSON where they parse (as llama.cpp and vLLM read them).

use serde_json::{Map, Value};

use super::python;

/// How a model writes tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    QwenXml,
    Glm,
    Lfm2,
    Mistral,
    Llama3Json,
}

/// The tool-call format of a chat template, or why tools cannot be given to it. The formats that
/// share `<tool_call>` are told apart by the tags inside it, so they are looked for first.
pub fn format_of(template: Option<&str>) -> Result<ToolFormat, String> {
    let Some(t) = template else {
        return Err(
            "this model has no chat template, so no tools can be given to it (--chat-template-file sets one)".into()
        );
    };
    if !t.contains("tools") {
        return Err(
            "this model's chat template does not take tools (--chat-template-file can give one that does)".into()
        );
    }
    if t.contains("<function=") {
        if t.contains("<parameter=") {
            return Ok(ToolFormat::QwenXml);
        }
        // Functionary's `<function=name>{…}</function>`.
        return Err("this model writes tool calls as `<function=…>{…}</function>` (Functionary), which this server does not read yet".into());
    }
    if t.contains("<arg_key>") && t.contains("<arg_value>") {
        return Ok(ToolFormat::Glm);
    }
    if t.contains("<|tool_list_start|>") || t.contains("<|tool_call_start|>") {
        return Ok(ToolFormat::Lfm2);
    }
    if t.contains("[TOOL_CALLS]") {
        return Ok(ToolFormat::Mistral);
    }
    if t.contains("<tool_call>") {
        return Ok(ToolFormat::Hermes);
    }
    if t.contains("<|python_tag|>") || (t.contains("ipython") && t.contains("\"parameters\"")) {
        return Ok(ToolFormat::Llama3Json);
    }
    Err("the tool-call format of this model's chat template is not supported (supported: Hermes `<tool_call>` \
         JSON, Qwen3-Coder XML, GLM-4.5 `<arg_key>`, LFM2 `<|tool_call_start|>`, Mistral `[TOOL_CALLS]`, and \
         Llama 3.1+ JSON calls)"
        .into())
}

impl ToolFormat {
    /// The format as its models' documentation names it.
    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "Hermes `<tool_call>` JSON",
            ToolFormat::QwenXml => "Qwen3-Coder XML",
            ToolFormat::Glm => "GLM-4.5 `<arg_key>`",
            ToolFormat::Lfm2 => "LFM2 Python",
            ToolFormat::Mistral => "Mistral `[TOOL_CALLS]`",
            ToolFormat::Llama3Json => "Llama 3 JSON",
        }
    }

    /// The tag a call (or a list of calls) starts with; on Llama 3's JSON calls the tag is optional.
    pub fn open(self) -> &'static str {
        match self {
            ToolFormat::Hermes | ToolFormat::QwenXml | ToolFormat::Glm => "<tool_call>",
            ToolFormat::Lfm2 => "<|tool_call_start|>",
            ToolFormat::Mistral => "[TOOL_CALLS]",
            ToolFormat::Llama3Json => "<|python_tag|>",
        }
    }

    /// The tag that ends a call; Mistral's end with their JSON.
    pub fn close(self) -> Option<&'static str> {
        match self {
            ToolFormat::Hermes | ToolFormat::QwenXml | ToolFormat::Glm => Some("</tool_call>"),
            ToolFormat::Lfm2 => Some("<|tool_call_end|>"),
            ToolFormat::Mistral | ToolFormat::Llama3Json => None,
        }
    }

    /// Every tag the format writes: where the tokenizer has them as special tokens, their text must
    /// still show for the calls to be read.
    pub fn tags(self) -> &'static [&'static str] {
        match self {
            ToolFormat::Hermes | ToolFormat::QwenXml => &["<tool_call>", "</tool_call>"],
            ToolFormat::Glm => {
                &["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"]
            }
            ToolFormat::Lfm2 => &["<|tool_call_start|>", "<|tool_call_end|>"],
            ToolFormat::Mistral => &["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"],
            ToolFormat::Llama3Json => &["<|python_tag|>"],
        }
    }
}

/// A call as read from the model's text, before it is checked against the request's tools.
pub type RawCall = (String, Value);

/// The calls in the body of one call block (what lies between the format's tags), or None when it
/// is not one. `schema` gives a tool's parameter schema by name (for the XML formats' values).
pub fn calls_in<'a>(
    format: ToolFormat,
    body: &str,
    schema: &dyn Fn(&str) -> Option<&'a Value>,
) -> Option<Vec<RawCall>> {
    let body = body.trim();
    match format {
        ToolFormat::Hermes => Some(vec![json_call(serde_json::from_str(body).ok()?)?]),
        ToolFormat::Llama3Json => Some(vec![json_call(serde_json::from_str(body).ok()?)?]),
        ToolFormat::QwenXml => Some(vec![qwen_xml(body, schema)?]),
        ToolFormat::Glm => Some(vec![glm(body, schema)?]),
        ToolFormat::Lfm2 => match body.starts_with("[{") || body.starts_with('{') {
            true => json_calls(serde_json::from_str(body).ok()?),
            false => python::calls(body),
        },
        ToolFormat::Mistral => mistral(body),
    }
}

/// `{"name": …, "arguments": {…}}` (Llama 3 names them `parameters`; some models write the
/// arguments as a JSON string).
fn json_call(v: Value) -> Option<RawCall> {
    let Value::Object(v) = v else { return None };
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(Value::String(s)) => serde_json::from_str(s).ok().filter(Value::is_object)?,
        Some(o @ Value::Object(_)) => o.clone(),
        Some(_) => return None,
    };
    Some((name, arguments))
}

/// One JSON call, or a list of them.
fn json_calls(v: Value) -> Option<Vec<RawCall>> {
    match v {
        Value::Array(list) if !list.is_empty() => list.into_iter().map(json_call).collect(),
        Value::Array(_) => None,
        v => Some(vec![json_call(v)?]),
    }
}

/// A value written as text: as written where the parameter is a string, else JSON where it parses.
fn text_value(raw: &str, schema: Option<&Value>) -> Value {
    let stringy = |t: &Value| match t {
        Value::String(t) => t == "string",
        Value::Array(ts) => ts.iter().any(|t| t == "string"),
        _ => false,
    };
    if schema.and_then(|s| s.get("type")).is_some_and(stringy) {
        return Value::String(raw.to_string());
    }
    serde_json::from_str(raw.trim()).unwrap_or_else(|_| Value::String(raw.to_string()))
}

/// The schema of parameter `key` of tool `name`.
fn param_schema<'a>(schema: &dyn Fn(&str) -> Option<&'a Value>, name: &str, key: &str) -> Option<&'a Value> {
    schema(name).and_then(|s| s.get("properties")).and_then(|p| p.get(key))
}

/// `<function=NAME>` then `<parameter=K>\nV\n</parameter>` for each argument, then `</function>`.
fn qwen_xml<'a>(body: &str, schema: &dyn Fn(&str) -> Option<&'a Value>) -> Option<RawCall> {
    let (name, mut rest) = body.strip_prefix("<function=")?.split_once('>')?;
    let name = name.trim();
    let mut args = Map::new();
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break;
        }
        if let Some(end) = rest.strip_prefix("</function>") {
            if !end.trim().is_empty() {
                return None;
            }
            break;
        }
        let (key, r) = rest.strip_prefix("<parameter=")?.split_once('>')?;
        let (raw, r) = r.split_once("</parameter>")?;
        // The value sits on its own lines.
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        args.insert(key.trim().to_string(), text_value(raw, param_schema(schema, name, key.trim())));
        rest = r;
    }
    (!name.is_empty()).then(|| (name.to_string(), Value::Object(args)))
}

/// `NAME` then `<arg_key>K</arg_key><arg_value>V</arg_value>` for each argument.
fn glm<'a>(body: &str, schema: &dyn Fn(&str) -> Option<&'a Value>) -> Option<RawCall> {
    let at = body.find("<arg_key>").unwrap_or(body.len());
    let name = body[..at].trim();
    if name.is_empty() || name.contains(char::is_whitespace) || name.contains('<') {
        return None;
    }
    let mut rest = &body[at..];
    let mut args = Map::new();
    while !rest.trim().is_empty() {
        let (key, r) = rest.trim_start().strip_prefix("<arg_key>")?.split_once("</arg_key>")?;
        let (raw, r) = r.trim_start().strip_prefix("<arg_value>")?.split_once("</arg_value>")?;
        args.insert(key.trim().to_string(), text_value(raw, param_schema(schema, name, key.trim())));
        rest = r;
    }
    Some((name.to_string(), Value::Object(args)))
}

/// A Mistral call block: a JSON list of calls (or one call), or `NAME[ARGS]{…}` with an optional
/// `[CALL_ID]ID` before `[ARGS]`.
fn mistral(body: &str) -> Option<Vec<RawCall>> {
    if body.starts_with('[') || body.starts_with('{') {
        return json_calls(serde_json::from_str(body).ok()?);
    }
    let brace = body.find('{')?;
    let head = &body[..brace];
    let head = head.split("[CALL_ID]").next().unwrap_or(head);
    let name = head.strip_suffix("[ARGS]").unwrap_or(head).trim();
    if name.is_empty() || name.contains(char::is_whitespace) || name.contains('[') {
        return None;
    }
    let args: Value = serde_json::from_str(&body[brace..]).ok().filter(Value::is_object)?;
    Some(vec![(name.to_string(), args)])
}

/// Where a Mistral call block that starts `text` ends: after its JSON (the list, the call, or the
/// arguments after the name); None while it may still be a call; or, for text that cannot be one,
/// `Some(at)` where that shows (the block up to there goes out as text, and what follows is read
/// again). `json_may_end`: the text got a `}` or `]` since the last look (else a started JSON cannot
/// have ended, and is not parsed again).
pub fn mistral_end(text: &str, json_may_end: bool) -> Option<usize> {
    let lead = text.len() - text.trim_start().len();
    let start = match text[lead..].bytes().next()? {
        b'[' | b'{' => lead,
        _ => {
            // NAME, then `{`, `[ARGS]{` or `[CALL_ID]ID[ARGS]{`.
            let name_end = lead + text[lead..].find(|c: char| !is_name_char(c)).unwrap_or(text.len() - lead);
            let mut at = name_end;
            if at == text.len() {
                return None;
            }
            if at == lead {
                // Past the first character (whole: it may take several bytes).
                return Some(lead + text[lead..].chars().next().map_or(1, char::len_utf8));
            }
            let rest = &text[at..];
            if let Some(id) = rest.strip_prefix("[CALL_ID]") {
                let id_len = id.find(|c: char| !c.is_ascii_alphanumeric()).unwrap_or(id.len());
                at += "[CALL_ID]".len() + id_len;
            } else if "[CALL_ID]".starts_with(rest) {
                return None;
            }
            let rest = &text[at..];
            if let Some(r) = rest.strip_prefix("[ARGS]") {
                at += rest.len() - r.len();
            } else if rest.is_empty() || "[ARGS]".starts_with(rest) {
                return None;
            }
            match text[at..].bytes().next() {
                None => return None,
                Some(b'{') => at,
                Some(_) => return Some(at),
            }
        }
    };
    if !json_may_end {
        return None;
    }
    let mut values = serde_json::Deserializer::from_str(&text[start..]).into_iter::<serde::de::IgnoredAny>();
    match values.next()? {
        Ok(_) => Some(start + values.byte_offset()),
        Err(e) if e.is_eof() => None,
        // Not JSON: the block ends as text just past where it began.
        Err(_) => Some(start + 1),
    }
}

/// A character of a function name.
fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')
}

/// A call as an LFM2 template that leaves calls out of the history wants it in the assistant's text.
pub fn lfm2_call_text(calls: &[(String, Value)]) -> String {
    let list: Vec<String> = calls.iter().map(|(name, args)| python::call_text(name, args)).collect();
    format!("<|tool_call_start|>[{}]<|tool_call_end|>", list.join(", "))
}

/// A call id as Mistral's templates take them (nine letters and digits): ids of that shape as they
/// are, others by a hash of the id, so that a call and its result still match.
pub fn mistral_id(id: &str) -> String {
    if id.len() == 9 && id.chars().all(|c| c.is_ascii_alphanumeric()) {
        return id.to_string();
    }
    // FNV-1a, base 62.
    let mut h: u64 = 0xcbf29ce484222325;
    for b in id.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x100000001b3);
    }
    const DIGITS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ";
    (0..9)
        .map(|_| {
            let c = DIGITS[(h % 62) as usize] as char;
            h /= 62;
            c
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn no_schema(_: &str) -> Option<&'static Value> {
        None
    }

    #[test]
    fn formats_are_told_from_the_template() {
        let cases = [
            ("{% if tools %}<tools>{{ tools | tojson }}</tools> <tool_call>{% endif %}", ToolFormat::Hermes),
            ("{% if tools %}{{ '<|python_tag|>' }}{% endif %}", ToolFormat::Llama3Json),
            ("{% if tools %}<tool_call>\n<function=name>\n<parameter=k>v</parameter>{% endif %}", ToolFormat::QwenXml),
            ("{% if tools %}<tool_call>{{ name }}<arg_key>{{ k }}</arg_key><arg_value>{% endif %}", ToolFormat::Glm),
            (
                "{% if tools %}List of tools: <|tool_list_start|>{{ tools }}<|tool_list_end|>{% endif %}",
                ToolFormat::Lfm2,
            ),
            (
                "{% if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]",
                ToolFormat::Mistral,
            ),
        ];
        for (template, format) in cases {
            assert_eq!(format_of(Some(template)), Ok(format), "{template}");
        }
        assert!(format_of(Some("{{ messages }}")).unwrap_err().contains("does not take tools"));
        assert!(format_of(None).unwrap_err().contains("no chat template"));
        assert!(format_of(Some("{% if tools %}<|tool|>{% endif %}")).unwrap_err().contains("not supported"));
        assert!(format_of(None).is_err());
        let functionary = "{% if tools %}<|python_tag|> <function=name>{args}</function>{% endif %}";
        assert!(format_of(Some(functionary)).unwrap_err().contains("Functionary"));
    }

    #[test]
    fn xml_values_are_text_where_the_schema_says_string() {
        let schema = json!({"properties": {"city": {"type": "string"}, "days": {"type": "integer"},
            "code": {"type": "string"}, "opts": {"type": "object"}}});
        let by_name = |n: &str| (n == "weather").then_some(&schema);
        let body = "<function=weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n\
                    <parameter=code>\n007\n</parameter>\n<parameter=opts>\n{\"a\": [1]}\n</parameter>\n\
                    <parameter=note>\nnot json\n</parameter>\n</function>";
        let calls = calls_in(ToolFormat::QwenXml, body, &by_name).unwrap();
        assert_eq!(
            calls,
            [(
                "weather".into(),
                json!({"city": "New York", "days": 3, "code": "007", "opts": {"a": [1]}, "note": "not json"})
            )]
        );
        // Multi-line values keep their inner lines.
        let body = "<function=write>\n<parameter=text>\nline 1\n\nline 2\n</parameter>\n</function>";
        assert_eq!(calls_in(ToolFormat::QwenXml, body, &no_schema).unwrap()[0].1, json!({"text": "line 1\n\nline 2"}));
        assert_eq!(calls_in(ToolFormat::QwenXml, "<function=f>\n</function>", &no_schema).unwrap()[0].1, json!({}));
        for bad in ["{\"name\": \"f\"}", "<function=f>\n<parameter=a>\n1\n", "<function=f></function> x"] {
            assert_eq!(calls_in(ToolFormat::QwenXml, bad, &no_schema), None, "{bad}");
        }

        let body = "weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n";
        assert_eq!(
            calls_in(ToolFormat::Glm, body, &by_name).unwrap(),
            [("weather".into(), json!({"city": "Paris", "days": 3}))]
        );
        assert_eq!(calls_in(ToolFormat::Glm, "f", &no_schema).unwrap(), [("f".into(), json!({}))]);
        for bad in ["two words", "f\n<arg_key>a</arg_key>", "f\n<arg_value>1</arg_value>"] {
            assert_eq!(calls_in(ToolFormat::Glm, bad, &no_schema), None, "{bad}");
        }
    }

    #[test]
    fn lfm2_and_mistral_bodies_hold_lists_of_calls() {
        let py = "[weather(city=\"Paris\", days=3), time(tz='CET', dst=True)]";
        assert_eq!(
            calls_in(ToolFormat::Lfm2, py, &no_schema).unwrap(),
            [
                ("weather".into(), json!({"city": "Paris", "days": 3})),
                ("time".into(), json!({"tz": "CET", "dst": true}))
            ]
        );
        let js = "[{\"name\": \"f\", \"arguments\": {\"a\": 1}}]";
        assert_eq!(calls_in(ToolFormat::Lfm2, js, &no_schema).unwrap(), [("f".into(), json!({"a": 1}))]);
        assert_eq!(calls_in(ToolFormat::Mistral, js, &no_schema).unwrap(), [("f".into(), json!({"a": 1}))]);
        for body in ["f[ARGS]{\"a\": 1}", "f[CALL_ID]abc123XYZ[ARGS]{\"a\": 1}", "f{\"a\": 1}"] {
            assert_eq!(
                calls_in(ToolFormat::Mistral, body, &no_schema).unwrap(),
                [("f".into(), json!({"a": 1}))],
                "{body}"
            );
        }
        assert_eq!(calls_in(ToolFormat::Mistral, "hello there", &no_schema), None);
        assert_eq!(calls_in(ToolFormat::Mistral, "[]", &no_schema), None);
    }

    #[test]
    fn a_mistral_block_ends_with_its_json() {
        let block = "[{\"name\": \"f\", \"arguments\": {\"a\": \"]\"}}]";
        for cut in 0..block.len() {
            assert_eq!(mistral_end(&block[..cut], true), None, "{cut}");
        }
        assert_eq!(mistral_end(&format!("{block}[TOOL_CALLS]g"), true), Some(block.len()));
        assert_eq!(mistral_end("f[ARGS]{\"a\": 1} and", true), Some(15));
        assert_eq!(mistral_end("f[CALL_ID]a1b2c3d4e[ARGS]{} and", true), Some(27));
        assert_eq!(mistral_end("f[ARGS]{\"a\"", true), None);
        // Not parsed again until a `}` or `]` may have ended it.
        assert_eq!(mistral_end("f[ARGS]{\"a\": 1}", false), None);
        // A name is still coming, or the tags after it are.
        for open in ["", " ", "get_wea", "f[ARG", "f[CALL_ID]a1b", "f[CALL_ID]a1b[AR"] {
            assert_eq!(mistral_end(open, true), None, "{open:?}");
        }
        // Prose is text as soon as it shows, up to where it does (what follows is read again).
        assert_eq!(mistral_end(" see below [TOOL_CALLS]f[ARGS]{}", true), Some(4));
        assert_eq!(mistral_end("f [ARGS]{}", true), Some(1));
        assert_eq!(mistral_end("!", true), Some(1));
        assert_eq!(mistral_end(" “quoted”", true), Some(4));
        assert_eq!(mistral_end("😀", true), Some(4));
        assert_eq!(mistral_end("[1, oops", true), Some(1));
    }

    #[test]
    fn mistral_ids_have_nine_letters_and_digits() {
        let id = mistral_id("call_abcdefghijklmnopqrstuvwx");
        assert!(id.len() == 9 && id.chars().all(|c| c.is_ascii_alphanumeric()), "{id}");
        assert_eq!(id, mistral_id("call_abcdefghijklmnopqrstuvwx"));
        assert_ne!(id, mistral_id("call_abcdefghijklmnopqrstuvwy"));
        assert_eq!(mistral_id("abc123XYZ"), "abc123XYZ");
    }
}
