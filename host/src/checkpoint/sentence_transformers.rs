//! sentence-transformers' files beside the weights: `modules.json` (what follows the transformer:
//! pooling, normalisation, …), the pooling module's `config.json` and `sentence_bert_config.json`
//! (`max_seq_length`). The checkpoint adds them to the config a family reads, under
//! `"sentence_transformers"`, so the family builds the pooling into its graph from data alone:
//!
//! ```json
//! "sentence_transformers": {"modules": ["Transformer", "Pooling", "Normalize"],
//!                           "pooling": {"pooling_mode_mean_tokens": true, ...},
//!                           "max_seq_length": 256}
//! ```

use std::path::Path;

use serde_json::{json, Value};

use super::{read_json, CheckpointError};

/// The config key the metadata is added under.
pub const CONFIG_KEY: &str = "sentence_transformers";

/// The folder's sentence-transformers metadata, or `None` when it has no `modules.json`.
pub fn read(dir: &Path) -> Result<Option<Value>, CheckpointError> {
    let modules_path = dir.join("modules.json");
    if !modules_path.is_file() {
        return Ok(None);
    }
    let modules = read_json(&modules_path)?;
    let list = modules.as_array().ok_or_else(|| CheckpointError::BadJson {
        path: modules_path.clone(),
        reason: "expected a list of modules".into(),
    })?;
    let mut types = Vec::new();
    let mut pooling = Value::Null;
    for m in list {
        let ty = m.get("type").and_then(Value::as_str).unwrap_or("");
        // `sentence_transformers.models.Pooling` → `Pooling`.
        let short = ty.rsplit('.').next().unwrap_or(ty).to_string();
        if short == "Pooling" {
            let sub = m.get("path").and_then(Value::as_str).unwrap_or("1_Pooling");
            let path = dir.join(sub).join("config.json");
            if path.is_file() {
                pooling = read_json(&path)?;
            }
        }
        types.push(short);
    }
    let sbert = dir.join("sentence_bert_config.json");
    let max_seq_length = if sbert.is_file() {
        read_json(&sbert)?.get("max_seq_length").cloned().unwrap_or(Value::Null)
    } else {
        Value::Null
    };
    Ok(Some(json!({"modules": types, "pooling": pooling, "max_seq_length": max_seq_length})))
}

/// A pooling mode asked for on the command line (llama-server's `--pooling`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolingFlag {
    Mean,
    Cls,
    Last,
}

impl PoolingFlag {
    /// llama-server's names; `none` and `rank` are refused with what to do instead.
    pub fn parse(s: &str) -> Result<PoolingFlag, String> {
        match s {
            "mean" => Ok(PoolingFlag::Mean),
            "cls" => Ok(PoolingFlag::Cls),
            "last" => Ok(PoolingFlag::Last),
            "none" => Err("per-token embeddings (pooling `none`) are not supported; use mean, cls or last".into()),
            "rank" => Err("rerankers are recognised from their checkpoint (a *ForSequenceClassification head); \
                           no pooling flag is needed"
                .into()),
            other => Err(format!("unknown pooling `{other}`: use mean, cls or last")),
        }
    }

    /// The name sentence-transformers' `pooling_mode` gives it.
    fn mode(self) -> &'static str {
        match self {
            PoolingFlag::Mean => "mean",
            PoolingFlag::Cls => "cls",
            PoolingFlag::Last => "lasttoken",
        }
    }
}

/// Makes `config` describe an embedding model (llama-server's `--embedding` and `--pooling`): without
/// sentence-transformers metadata, a Transformer → Pooling → Normalize pipeline (llama-server
/// normalises its embeddings too) pooled as the family's default (the last token for a decoder) or
/// `pooling`; with metadata, `pooling` replaces the folder's pooling config.
pub fn serve_as_embedding(config: &mut Value, pooling: Option<PoolingFlag>) {
    let Some(obj) = config.as_object_mut() else { return };
    let st = obj.entry(CONFIG_KEY).or_insert_with(
        || json!({"modules": ["Transformer", "Pooling", "Normalize"], "pooling": null, "max_seq_length": null}),
    );
    if let Some(p) = pooling {
        st["pooling"] = json!({"pooling_mode": p.mode()});
    }
}

/// Whether the model's vectors are L2-normalised (a `Normalize` module in the metadata `config` holds).
pub fn normalizes(config: &Value) -> bool {
    config
        .get(CONFIG_KEY)
        .and_then(|st| st.get("modules"))
        .and_then(Value::as_array)
        .is_some_and(|m| m.iter().any(|t| t.as_str() == Some("Normalize")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modules_pooling_and_max_length_are_gathered() {
        let dir = tempfile::tempdir().unwrap();
        assert!(read(dir.path()).unwrap().is_none());
        std::fs::write(
            dir.path().join("modules.json"),
            r#"[{"idx":0,"name":"0","path":"","type":"sentence_transformers.models.Transformer"},
                {"idx":1,"name":"1","path":"1_Pooling","type":"sentence_transformers.models.Pooling"},
                {"idx":2,"name":"2","path":"2_Normalize","type":"sentence_transformers.models.Normalize"}]"#,
        )
        .unwrap();
        std::fs::create_dir(dir.path().join("1_Pooling")).unwrap();
        std::fs::write(dir.path().join("1_Pooling/config.json"), r#"{"pooling_mode_cls_token":true}"#).unwrap();
        std::fs::write(dir.path().join("sentence_bert_config.json"), r#"{"max_seq_length":256}"#).unwrap();
        let v = read(dir.path()).unwrap().unwrap();
        assert_eq!(v["modules"], json!(["Transformer", "Pooling", "Normalize"]));
        assert_eq!(v["pooling"]["pooling_mode_cls_token"], json!(true));
        assert_eq!(v["max_seq_length"], json!(256));
        assert!(normalizes(&json!({CONFIG_KEY: v})));
        assert!(!normalizes(&json!({"model_type": "bert"})));
    }

    #[test]
    fn a_model_served_as_embedding_gets_pooling_and_normalize() {
        let mut c = json!({"model_type": "qwen3"});
        serve_as_embedding(&mut c, None);
        assert_eq!(c[CONFIG_KEY]["modules"], json!(["Transformer", "Pooling", "Normalize"]));
        assert_eq!(c[CONFIG_KEY]["pooling"], Value::Null);
        serve_as_embedding(&mut c, Some(PoolingFlag::Mean));
        assert_eq!(c[CONFIG_KEY]["pooling"], json!({"pooling_mode": "mean"}));
        // The folder's own modules are kept; only the pooling changes.
        let mut c =
            json!({CONFIG_KEY: {"modules": ["Transformer", "Pooling"], "pooling": {"pooling_mode_cls_token": true}}});
        serve_as_embedding(&mut c, Some(PoolingFlag::Last));
        assert_eq!(c[CONFIG_KEY]["modules"], json!(["Transformer", "Pooling"]));
        assert_eq!(c[CONFIG_KEY]["pooling"], json!({"pooling_mode": "lasttoken"}));
        assert_eq!(PoolingFlag::parse("last"), Ok(PoolingFlag::Last));
        assert!(PoolingFlag::parse("none").unwrap_err().contains("not supported"));
        assert!(PoolingFlag::parse("rank").unwrap_err().contains("no pooling flag"));
    }
}
