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
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

fn strftime_now(format: String) -> String {
    chrono::Local::now().format(&format).to_string()
}

impl ChatTemplate {
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate, String> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        // HF templates are written for Python's Jinja, which keeps a trailing newline trimmed like this.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_template_owned("chat", source.to_string()).map_err(|e| format!("chat template does not parse: {e}"))?;
        Ok(ChatTemplate { env, bos_token: bos_token.to_string(), eos_token: eos_token.to_string() })
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
}
