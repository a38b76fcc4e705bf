//! Reading a `config.json` before a family parses it fully.

/// The `model_type` of a config, or of its nested `text_config` (multimodal wrappers whose text tower
/// a text family serves).
pub fn model_type(json: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(json).ok()?;
    v.get("text_config")
        .and_then(|t| t.get("model_type"))
        .or_else(|| v.get("model_type"))
        .and_then(|m| m.as_str())
        .map(str::to_string)
}

/// The usual `match_config`: 100 when the config's `model_type` is one of `architectures`, else 0.
pub fn match_architectures(json: &str, architectures: &[&str]) -> u32 {
    match model_type(json) {
        Some(t) if architectures.contains(&t.as_str()) => 100,
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_type_is_read_from_the_text_tower_first() {
        assert_eq!(model_type(r#"{"model_type":"llama"}"#).as_deref(), Some("llama"));
        assert_eq!(
            model_type(r#"{"model_type":"gemma3","text_config":{"model_type":"gemma3_text"}}"#).as_deref(),
            Some("gemma3_text")
        );
        assert_eq!(match_architectures(r#"{"model_type":"qwen3"}"#, &["llama", "qwen3"]), 100);
        assert_eq!(match_architectures("not json", &["llama"]), 0);
    }
}
