//! The `config.json` fields this family reads, with transformers' defaults, and the
//! sentence-transformers block the host adds beside them (read by the kit's [`EmbeddingHead`]).

use mlxcel_family_kit::EmbeddingHead;
use serde::Deserialize;
use serde_json::Value;

pub use mlxcel_family_kit::embedding::Pooling;

/// Architectures (`model_type`) this family handles.
pub const ARCHITECTURES: &[&str] = &["bert", "roberta", "xlm-roberta"];

#[derive(Debug, Clone, Deserialize)]
pub struct BertConfig {
    pub model_type: String,
    #[serde(default)]
    pub architectures: Vec<String>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    #[serde(default = "default_act")]
    pub hidden_act: String,
    #[serde(default = "default_positions")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_type_vocab")]
    pub type_vocab_size: usize,
    #[serde(default = "default_eps")]
    pub layer_norm_eps: f32,
    #[serde(default)]
    pub pad_token_id: Option<usize>,
    #[serde(default)]
    pub position_embedding_type: Option<String>,
    #[serde(default)]
    pub num_labels: Option<usize>,
    #[serde(default)]
    pub id2label: Option<serde_json::Map<String, Value>>,
    #[serde(default)]
    pub quantization: Option<Value>,
    /// Added by the host from the sentence-transformers files of the folder, when it has them.
    #[serde(default)]
    pub sentence_transformers: Option<Value>,
}

fn default_act() -> String {
    "gelu".into()
}
fn default_positions() -> usize {
    512
}
fn default_type_vocab() -> usize {
    2
}
fn default_eps() -> f32 {
    1e-12
}

/// What the model computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Head {
    /// A sentence embedding: pooled token rows, L2-normalised when asked.
    Embedding { pooling: Pooling, normalize: bool },
    /// `BertForSequenceClassification`: `classifier(tanh(pooler.dense(h[CLS])))`.
    BertClassifier,
    /// `(XLM)RobertaForSequenceClassification`: `out_proj(tanh(dense(h[<s>])))`.
    RobertaClassifier,
}

impl BertConfig {
    pub fn parse(json: &str) -> Result<BertConfig, String> {
        let cfg: BertConfig = serde_json::from_str(json).map_err(|e| format!("config.json: {e}"))?;
        if !ARCHITECTURES.contains(&cfg.model_type.as_str()) {
            return Err(format!("model_type `{}` is not one of {ARCHITECTURES:?}", cfg.model_type));
        }
        if cfg.num_attention_heads == 0 || !cfg.hidden_size.is_multiple_of(cfg.num_attention_heads) {
            return Err(format!(
                "hidden_size {} is not a multiple of num_attention_heads {}",
                cfg.hidden_size, cfg.num_attention_heads
            ));
        }
        if let Some(p) = cfg.position_embedding_type.as_deref() {
            if p != "absolute" {
                return Err(format!("position_embedding_type `{p}` is not supported (only `absolute`)"));
            }
        }
        cfg.activation()?;
        cfg.head()?;
        if cfg.max_position_embeddings <= cfg.position_offset() {
            return Err(format!(
                "max_position_embeddings {} leaves no positions after the offset {}",
                cfg.max_position_embeddings,
                cfg.position_offset()
            ));
        }
        Ok(cfg)
    }

    /// RoBERTa counts positions from `pad_token_id + 1` (its padding row sits below them).
    pub fn position_offset(&self) -> usize {
        match self.model_type.as_str() {
            "roberta" | "xlm-roberta" => self.pad_token_id.unwrap_or(1) + 1,
            _ => 0,
        }
    }

    /// Longest sequence the position table holds.
    pub fn max_tokens(&self) -> usize {
        self.max_position_embeddings - self.position_offset()
    }

    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// `num_labels`, else the size of `id2label`, else transformers' default of 2.
    pub fn labels(&self) -> usize {
        self.num_labels.or_else(|| self.id2label.as_ref().map(|m| m.len())).unwrap_or(2)
    }

    pub fn is_classifier(&self) -> bool {
        self.architectures.iter().any(|a| a.ends_with("ForSequenceClassification"))
    }

    /// The activation op of the feed-forward block.
    pub fn activation(&self) -> Result<mlxcel_plugin_api::OpCode, String> {
        use mlxcel_plugin_api::OpCode;
        Ok(match self.hidden_act.as_str() {
            "gelu" => OpCode::Gelu,
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => OpCode::GeluTanh,
            "relu" => OpCode::Relu,
            "silu" | "swish" => OpCode::Silu,
            other => return Err(format!("hidden_act `{other}` is not supported")),
        })
    }

    /// What the checkpoint computes: a classifier head for `*ForSequenceClassification` (one label:
    /// a cross-encoder's relevance logit), else a sentence embedding pooled as sentence-transformers
    /// says (mean pooling without normalisation when the folder has no sentence-transformers files).
    pub fn head(&self) -> Result<Head, String> {
        if self.is_classifier() {
            if self.labels() != 1 {
                return Err(format!(
                    "{} has {} labels; only one-label classifiers (cross-encoder rerankers) are supported",
                    self.architectures.join(", "),
                    self.labels()
                ));
            }
            return Ok(match self.model_type.as_str() {
                "bert" => Head::BertClassifier,
                _ => Head::RobertaClassifier,
            });
        }
        let Some(st) = &self.sentence_transformers else {
            return Ok(Head::Embedding { pooling: Pooling::Mean, normalize: false });
        };
        let EmbeddingHead { pooling, normalize } = EmbeddingHead::from_sentence_transformers(st, Pooling::Mean)?;
        Ok(Head::Embedding { pooling, normalize })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: &str) -> Result<BertConfig, String> {
        BertConfig::parse(&format!(
            r#"{{"model_type":"bert","vocab_size":10,"hidden_size":8,"num_hidden_layers":1,
                "num_attention_heads":2,"intermediate_size":16{extra}}}"#
        ))
    }

    #[test]
    fn sentence_transformers_pooling_and_normalize_are_read() {
        let c = cfg(r#","sentence_transformers":{"modules":["Transformer","Pooling","Normalize"],
            "pooling":{"pooling_mode_cls_token":true,"pooling_mode_mean_tokens":false}}"#)
        .unwrap();
        assert_eq!(c.head().unwrap(), Head::Embedding { pooling: Pooling::Cls, normalize: true });
        let c = cfg("").unwrap();
        assert_eq!(c.head().unwrap(), Head::Embedding { pooling: Pooling::Mean, normalize: false });
    }

    #[test]
    fn unsupported_heads_and_modules_are_refused_by_name() {
        let e = cfg(r#","sentence_transformers":{"modules":["Transformer","Pooling","Dense"]}"#).unwrap_err();
        assert!(e.contains("`Dense`"), "{e}");
        let e =
            cfg(r#","sentence_transformers":{"modules":[],"pooling":{"pooling_mode_max_tokens":true}}"#).unwrap_err();
        assert!(e.contains("pooling_mode_max_tokens"), "{e}");
        let e = cfg(r#","architectures":["BertForSequenceClassification"],"num_labels":3"#).unwrap_err();
        assert!(e.contains("3 labels"), "{e}");
        let e = cfg(r#","position_embedding_type":"relative_key""#).unwrap_err();
        assert!(e.contains("relative_key"), "{e}");
    }

    #[test]
    fn roberta_positions_start_after_the_padding_row() {
        let c = BertConfig::parse(
            r#"{"model_type":"xlm-roberta","vocab_size":10,"hidden_size":8,"num_hidden_layers":1,
                "num_attention_heads":2,"intermediate_size":16,"pad_token_id":1,"max_position_embeddings":514}"#,
        )
        .unwrap();
        assert_eq!((c.position_offset(), c.max_tokens()), (2, 512));
    }
}
