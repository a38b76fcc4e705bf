//! Chat templates from `tokenizer_config.json` (`chat_template`, a string or a list of named templates)
//! or `chat_template.jinja`, rendered with minijinja plus what Hugging Face templates expect:
//! `raise_exception`, `strftime_now`, `tojson`, loop controls and Python string methods.

use std::path::Path;

use minijinja::{context, Environment, Error, ErrorKind, Value};
use serde::Serialize;

/// One chat message, as templates read it: `role` and `content`, and where a conversation has them,
/// a participant's `name`, an assistant turn's `tool_calls` (each call's `function.arguments` an
/// object, as Hugging Face templates expect) and a tool result's `tool_call_id`.
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    /// The text parts `content` was sent as (None: one string). A template that reads typed content
    /// gets them as `[{"type": "text", "text": …}]`, as llama.cpp passes them; `content` joins them
    /// with line breaks for one that reads strings only.
    #[serde(skip)]
    pub parts: Option<Vec<String>>,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        ChatMessage { role: role.to_string(), content: content.to_string(), ..Default::default() }
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// Which forms of `content` the template shows (probed once, as llama.cpp's template caps).
    content: ContentForms,
}

/// Whether a template shows a message's `content` given as a string, and as a list of typed parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContentForms {
    pub string: bool,
    pub typed: bool,
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

fn strftime_now(format: String) -> String {
    chrono::Local::now().format(&format).to_string()
}

/// `tojson` as Hugging Face's template environment defines it — Python's `json.dumps` with
/// `ensure_ascii=False`: keys in their order, `", "` and `": "` between items (or `indent`), no HTML
/// escaping — so that tools and tool-call arguments reach the model as it saw them in training.
/// (minijinja's own sorts nothing but writes compact JSON with `<`, `>`, `&` and `'` escaped.)
fn tojson(value: &Value, kwargs: minijinja::value::Kwargs) -> Result<Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(value).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        Some(_) => return Err(Error::new(ErrorKind::InvalidOperation, "tojson: separators takes two strings")),
        None if indent.is_some() => (",".into(), ": ".into()),
        None => (", ".into(), ": ".into()),
    };
    let style = PyJson {
        indent,
        item,
        key,
        ensure_ascii: ensure_ascii.unwrap_or(false),
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    style.write(&json, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// A float as Python's `repr` writes it: the shortest digits that read back the same, fixed-point
/// for exponents in [-4, 16) (always with a fractional part), else `d.ddde±XX`.
fn py_float(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    // Rust's `{:e}` gives the same shortest digits: `-d.ddde-x`.
    let s = format!("{x:e}");
    let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (sign, mantissa) = mantissa.strip_prefix('-').map_or(("", mantissa), |m| ("-", m));
    let digits: String = mantissa.chars().filter(|&c| c != '.').collect();
    if (-4..16).contains(&exp) {
        let point = exp + 1;
        if point <= 0 {
            format!("{sign}0.{}{digits}", "0".repeat(-point as usize))
        } else if point as usize >= digits.len() {
            format!("{sign}{digits}{}.0", "0".repeat(point as usize - digits.len()))
        } else {
            format!("{sign}{}.{}", &digits[..point as usize], &digits[point as usize..])
        }
    } else {
        let m = if digits.len() > 1 { format!("{}.{}", &digits[..1], &digits[1..]) } else { digits };
        format!("{sign}{m}e{}{:02}", if exp < 0 { '-' } else { '+' }, exp.abs())
    }
}

/// How Python's `json.dumps` lays a value out.
struct PyJson {
    indent: Option<usize>,
    item: String,
    key: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

impl PyJson {
    fn write(&self, v: &serde_json::Value, depth: usize, out: &mut String) {
        use serde_json::Value as J;
        match v {
            J::Array(items) if !items.is_empty() => {
                out.push('[');
                for (i, x) in items.iter().enumerate() {
                    self.separate(i, depth + 1, out);
                    self.write(x, depth + 1, out);
                }
                self.close(depth, out);
                out.push(']');
            }
            J::Object(map) if !map.is_empty() => {
                let mut entries: Vec<_> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, x)) in entries.into_iter().enumerate() {
                    self.separate(i, depth + 1, out);
                    self.string(k, out);
                    out.push_str(&self.key);
                    self.write(x, depth + 1, out);
                }
                self.close(depth, out);
                out.push('}');
            }
            J::String(s) => self.string(s, out),
            J::Number(n) if n.is_f64() => out.push_str(&py_float(n.as_f64().unwrap_or(f64::NAN))),
            other => out.push_str(&other.to_string()),
        }
    }

    fn separate(&self, i: usize, depth: usize, out: &mut String) {
        if i > 0 {
            out.push_str(&self.item);
        }
        if let Some(n) = self.indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    }

    fn close(&self, depth: usize, out: &mut String) {
        if let Some(n) = self.indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        // serde_json escapes as Python does (quotes, backslashes, control characters), never `/`.
        let quoted = serde_json::Value::String(s.to_string()).to_string();
        if !self.ensure_ascii {
            out.push_str(&quoted);
            return;
        }
        for c in quoted.chars() {
            if c.is_ascii() && c != '\x7f' {
                out.push(c);
            } else {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
        }
    }
}

impl ChatTemplate {
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate, String> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        // HF templates are written for Python's Jinja, which keeps a trailing newline trimmed like this.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_template_owned("chat", source.to_string()).map_err(|e| format!("chat template does not parse: {e}"))?;
        let mut t = ChatTemplate {
            env,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
            content: ContentForms { string: true, typed: false },
        };
        t.content = t.probe_content_forms();
        Ok(t)
    }

    /// Which forms of content the template shows: a one-message conversation rendered with each. A
    /// list shown as a list (`[{'type': 'text', …}]`, by a template that prints whatever content
    /// is) is not read; where strings render too, a list is read when it renders as its string.
    /// One that shows neither (it needs more to render) is taken to read strings.
    fn probe_content_forms(&self) -> ContentForms {
        const PROBE: &str = "<mlxcel content probe>";
        let render = |content: serde_json::Value| {
            let messages = [serde_json::json!({"role": "user", "content": content})];
            self.render_values(&messages, false, None, None).ok().filter(|s| s.contains(PROBE))
        };
        let as_string = render(serde_json::json!(PROBE));
        let as_list = render(serde_json::json!([{"type": "text", "text": PROBE}]));
        let typed = match (&as_string, &as_list) {
            (_, None) => false,
            (Some(s), Some(l)) => s == l,
            (None, Some(l)) => !l.contains("'type'") && !l.contains("\"type\""),
        };
        ContentForms { string: as_string.is_some() || !typed, typed }
    }

    /// The forms of content the template shows.
    pub fn content_forms(&self) -> ContentForms {
        self.content
    }

    /// Finds the template of a model folder: `chat_template.jinja`, else `tokenizer_config.json`'s
    /// `chat_template` (the `default` entry of a named list).
    pub fn source_in(dir: &Path, tokenizer_config: Option<&serde_json::Value>) -> Option<String> {
        if let Ok(s) = std::fs::read_to_string(dir.join("chat_template.jinja")) {
            return Some(s);
        }
        match tokenizer_config?.get("chat_template")? {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Array(list) => {
                let named = |n: &str| list.iter().find(|e| e.get("name").and_then(|v| v.as_str()) == Some(n));
                named("default")
                    .or_else(|| list.first())
                    .and_then(|e| e.get("template"))
                    .and_then(|t| t.as_str())
                    .map(str::to_string)
            }
            _ => None,
        }
    }

    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, String> {
        self.render_with(messages, add_generation_prompt, None, None)
    }

    /// [`ChatTemplate::render`] with more variables for the template (a request's
    /// `chat_template_kwargs`, such as Qwen3's `enable_thinking`), which never replace the messages,
    /// the generation prompt switch, the special tokens or `tools` — the tools the model may call
    /// (OpenAI's `{"type": "function", "function": {…}}` objects, as Hugging Face templates read them).
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: Option<&serde_json::Map<String, serde_json::Value>>,
        tools: Option<&[serde_json::Value]>,
    ) -> Result<String, String> {
        // Content as the template reads it: sent parts stay a list where it reads lists (a string
        // too where it reads lists only), else the joined string (llama.cpp's normalisation).
        let messages: Vec<serde_json::Value> = messages
            .iter()
            .map(|m| {
                let mut v = serde_json::to_value(m).unwrap_or_default();
                let parts = match (&m.parts, self.content) {
                    (Some(parts), ContentForms { typed: true, .. }) => Some(parts.clone()),
                    (None, ContentForms { string: false, typed: true }) => Some(vec![m.content.clone()]),
                    _ => None,
                };
                if let Some(parts) = parts {
                    let list: Vec<serde_json::Value> =
                        parts.into_iter().map(|t| serde_json::json!({"type": "text", "text": t})).collect();
                    v["content"] = serde_json::Value::Array(list);
                }
                v
            })
            .collect();
        self.render_values(&messages, add_generation_prompt, extra, tools)
    }

    fn render_values(
        &self,
        messages: &[serde_json::Value],
        add_generation_prompt: bool,
        extra: Option<&serde_json::Map<String, serde_json::Value>>,
        tools: Option<&[serde_json::Value]>,
    ) -> Result<String, String> {
        let tmpl = self.env.get_template("chat").map_err(|e| e.to_string())?;
        let extra = Value::from_serialize(extra.cloned().unwrap_or_default());
        tmpl.render(context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
            tools => tools.map_or(Value::UNDEFINED, Value::from_serialize),
            ..extra
        })
        .map_err(|e| {
            let mut msg = format!("chat template failed: {e}");
            let mut src = std::error::Error::source(&e);
            while let Some(s) = src {
                msg.push_str(&format!(": {s}"));
                src = s.source();
            }
            msg
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Text parts reach a template that reads lists as a list (Gemma 3's trims each part), one that
    /// reads strings joined, and a template that reads lists only gets strings as lists too — as
    /// llama.cpp normalises content for its templates.
    #[test]
    fn content_parts_reach_each_template_in_the_form_it_reads() {
        let with_parts = ChatMessage {
            parts: Some(vec!["part one".into(), " part two".into()]),
            ..ChatMessage::new("user", "part one\n part two")
        };
        let plain = ChatMessage::new("user", "plain");
        let gemma = ChatTemplate::new(
            "{% for m in messages %}{% if m.content is string %}{{ m.content | trim }}{% else %}{% for item in m.content %}{% if item.type == 'text' %}{{ item.text | trim }}{% endif %}{% endfor %}{% endif %}|{% endfor %}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(gemma.content_forms(), ContentForms { string: true, typed: true });
        assert_eq!(gemma.render(&[with_parts.clone(), plain.clone()], false).unwrap(), "part onepart two|plain|");
        // A template that prints whatever content is (SmolLM2's ChatML) reads strings only.
        let chatml = ChatTemplate::new("{% for m in messages %}{{ m.content }}|{% endfor %}", "", "").unwrap();
        assert_eq!(chatml.content_forms(), ContentForms { string: true, typed: false });
        assert_eq!(chatml.render(&[with_parts.clone(), plain.clone()], false).unwrap(), "part one\n part two|plain|");
        let lists_only = ChatTemplate::new(
            "{% for m in messages %}{% for item in m.content %}{{ item.text }}{% endfor %}|{% endfor %}",
            "",
            "",
        )
        .unwrap();
        assert_eq!(lists_only.content_forms(), ContentForms { string: false, typed: true });
        assert_eq!(lists_only.render(&[with_parts, plain], false).unwrap(), "part one part two|plain|");
    }

    #[test]
    fn extra_variables_reach_the_template_but_never_replace_its_own() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{{ m.content }}{% endfor %}{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{{ add_generation_prompt }}",
            "",
            "",
        )
        .unwrap();
        let msgs = [ChatMessage::new("user", "Hi")];
        assert_eq!(t.render(&msgs, true).unwrap(), "HiTrue");
        let kw: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(r#"{"enable_thinking": false, "add_generation_prompt": false, "messages": []}"#)
                .unwrap();
        assert_eq!(t.render_with(&msgs, true, Some(&kw), None).unwrap(), "Hi<think></think>True");
    }

    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are helpful<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn chatml_renders_with_generation_prompt() {
        let t = ChatTemplate::new(CHATML, "<s>", "</s>").unwrap();
        let out = t.render(&[ChatMessage::new("user", "Hi")], true).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn raise_exception_surfaces_the_message() {
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", "", "").unwrap();
        assert!(t.render(&[], false).unwrap_err().contains("roles must alternate"));
    }

    #[test]
    fn hf_helpers_work() {
        let src = "{{ bos_token }}{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}{{ m.content.strip() | tojson }}{% endfor %}{{ strftime_now('%Y') | length }}";
        let t = ChatTemplate::new(src, "<s>", "").unwrap();
        let out = t.render(&[ChatMessage::new("user", "  a  "), ChatMessage::new("skip", "b")], false).unwrap();
        assert_eq!(out, "<s>\"a\"4");
    }

    #[test]
    fn floats_are_written_as_python_repr_writes_them() {
        let cases = [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (1.5, "1.5"),
            (12345.678, "12345.678"),
            (1e15, "1000000000000000.0"),
            (1e16, "1e+16"),
            (1e20, "1e+20"),
            (0.0001, "0.0001"),
            (1e-5, "1e-05"),
            (2.5e-5, "2.5e-05"),
            (1.5e-6, "1.5e-06"),
            (1e-10, "1e-10"),
            (5e-324, "5e-324"),
            (1.7976931348623157e308, "1.7976931348623157e+308"),
            (0.1, "0.1"),
            (-123.25, "-123.25"),
            (f64::INFINITY, "Infinity"),
        ];
        for (x, want) in cases {
            assert_eq!(py_float(x), want, "{x}");
        }
    }

    #[test]
    fn tojson_writes_what_python_json_dumps_writes() {
        let t = ChatTemplate::new(
            "{{ tools | tojson }}|{{ tools[0] | tojson(indent=2) }}|{{ \"é<&>'\" | tojson }}|{{ 'é' | tojson(ensure_ascii=true) }}|{{ {'b': 1.5, 'a': [1, 2]} | tojson(sort_keys=true) }}",
            "",
            "",
        )
        .unwrap();
        let tools: Vec<serde_json::Value> = vec![serde_json::from_str(
            r#"{"type": "function", "function": {"name": "f", "parameters": {}, "n": [1, 2.0]}}"#,
        )
        .unwrap()];
        let got = t.render_with(&[], false, None, Some(&tools)).unwrap();
        let want = [
            r#"[{"type": "function", "function": {"name": "f", "parameters": {}, "n": [1, 2.0]}}]"#,
            "{\n  \"type\": \"function\",\n  \"function\": {\n    \"name\": \"f\",\n    \"parameters\": {},\n    \"n\": [\n      1,\n      2.0\n    ]\n  }\n}",
            r#""é<&>'""#,
            r#""\u00e9""#,
            r#"{"a": [1, 2], "b": 1.5}"#,
        ]
        .join("|");
        assert_eq!(got, want);
    }
}
