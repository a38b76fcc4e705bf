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

/// Grouped-query heads as a config gives them: `num_attention_heads` a positive multiple of
/// `num_key_value_heads`.
pub fn check_heads(n_heads: usize, n_kv_heads: usize) -> Result<(), String> {
    if n_heads == 0 || n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) {
        return Err(format!(
            "config.json: num_attention_heads ({n_heads}) must be a positive multiple of num_key_value_heads \
             ({n_kv_heads})"
        ));
    }
    Ok(())
}

/// A head size rope can turn: even and positive.
pub fn check_head_dim(head_dim: usize) -> Result<(), String> {
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(format!("config.json: head_dim {head_dim} must be even and positive"));
    }
    Ok(())
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
