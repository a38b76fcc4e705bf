//! The `config.json` fields this family reads, with the defaults mlx-lm and transformers use.

use mlxcel_family_kit::config::{check_head_dim, check_heads};
use mlxcel_family_kit::embedding::{EmbeddingHead, Pooling};
use serde::Deserialize;
use serde_json::Value;

/// Architectures (`model_type`) this family handles.
pub const ARCHITECTURES: &[&str] = &["llama", "mistral", "qwen2", "qwen3"];

#[derive(Debug, Clone, Deserialize)]
pub struct LlamaConfig {
    pub model_type: String,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    pub vocab_size: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub rope_traditional: bool,
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    #[serde(default)]
    pub rope_parameters: Option<Value>,
    #[serde(default)]
    pub max_position_embeddings: Option<usize>,
    #[serde(default)]
    pub attention_bias: Option<bool>,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    #[serde(default)]
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    #[serde(default)]
    pub sliding_window: Option<usize>,
    #[serde(default)]
    pub quantization: Option<Value>,
    /// sentence-transformers' metadata, which the host adds when the folder has `modules.json` (or
    /// when asked to serve the model as an embedding model): the model is then a sentence-embedding
    /// model (Qwen3-Embedding style), see [`LlamaConfig::embedding`].
    #[serde(default)]
    pub sentence_transformers: Option<Value>,
}

fn default_eps() -> f32 {
    1e-6
}

/// Which flavour of the architecture a config is: variants are flags, not copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Variant {
    /// q/k/v projections carry a bias (qwen2 always; llama when `attention_bias`).
    pub qkv_bias: bool,
    /// o_proj carries a bias (llama `attention_bias` only).
    pub o_bias: bool,
    /// Per-head RMS norm on q and k before rope (qwen3).
    pub qk_norm: bool,
}

impl LlamaConfig {
    /// Parses a config, reading a nested `text_config` when the top level is a wrapper.
    pub fn parse(json: &str) -> Result<LlamaConfig, String> {
        let mut v: Value = serde_json::from_str(json).map_err(|e| format!("config.json is not valid JSON: {e}"))?;
        if let Some(Value::Object(text)) = v.get("text_config").cloned() {
            let quant = v.get("quantization").cloned();
            let mut inner = Value::Object(text);
            if inner.get("quantization").is_none() {
                if let (Some(q), Some(obj)) = (quant, inner.as_object_mut()) {
                    obj.insert("quantization".into(), q);
                }
            }
            v = inner;
        }
        let cfg: LlamaConfig = serde_json::from_value(v).map_err(|e| format!("config.json: {e}"))?;
        cfg.check()?;
        Ok(cfg)
    }

    fn check(&self) -> Result<(), String> {
        if !ARCHITECTURES.contains(&self.model_type.as_str()) {
            return Err(format!("model_type `{}` is not handled by the llama family", self.model_type));
        }
        check_heads(self.num_attention_heads, self.n_kv_heads())?;
        check_head_dim(self.head_dim())?;
        if let Some(act) = &self.hidden_act {
            if !matches!(act.as_str(), "silu" | "swish" | "gelu_pytorch_tanh") {
                return Err(format!("config.json: hidden_act `{act}` is not supported (silu, gelu_pytorch_tanh)"));
            }
        }
        if let Some(lt) = &self.layer_types {
            if lt.len() != self.num_hidden_layers {
                return Err(format!(
                    "config.json: layer_types has {} entries for {} layers",
                    lt.len(),
                    self.num_hidden_layers
                ));
            }
            if let Some(bad) = lt.iter().find(|t| *t != "full_attention" && *t != "sliding_attention") {
                return Err(format!("config.json: unknown layer type `{bad}`"));
            }
            if lt.iter().any(|t| t == "sliding_attention") && self.sliding_window.unwrap_or(0) == 0 {
                return Err("config.json: sliding_attention layers need sliding_window".into());
            }
        }
        Ok(())
    }

    pub fn n_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    pub fn rope_base(&self) -> f64 {
        self.rope_theta
            .or_else(|| self.rope_parameters.as_ref().and_then(|p| p.get("rope_theta")).and_then(Value::as_f64))
            .unwrap_or(10000.0)
    }

    /// `rope_scaling`, or transformers 5's `rope_parameters` when it names a scaling type.
    pub fn rope_scaling(&self) -> Option<&Value> {
        self.rope_scaling.as_ref().filter(|v| !v.is_null()).or_else(|| {
            self.rope_parameters.as_ref().filter(|p| p.get("rope_type").or_else(|| p.get("type")).is_some())
        })
    }

    pub fn tied_embeddings(&self) -> bool {
        // mlx-lm's llama and qwen2 default to tied; qwen3 configs always state it.
        self.tie_word_embeddings.unwrap_or(true)
    }

    pub fn gelu(&self) -> bool {
        self.hidden_act.as_deref() == Some("gelu_pytorch_tanh")
    }

    pub fn variant(&self) -> Variant {
        let attention_bias = self.attention_bias.unwrap_or(false);
        match self.model_type.as_str() {
            "qwen2" => Variant { qkv_bias: true, o_bias: false, qk_norm: false },
            "qwen3" => Variant { qkv_bias: attention_bias, o_bias: attention_bias, qk_norm: true },
            _ => Variant { qkv_bias: attention_bias, o_bias: attention_bias, qk_norm: false },
        }
    }

    /// The pooling of an embedding model (`None` for a text-generation model): the last token's row
    /// unless sentence-transformers' pooling config names another.
    pub fn embedding(&self) -> Result<Option<EmbeddingHead>, String> {
        self.sentence_transformers
            .as_ref()
            .map(|st| EmbeddingHead::from_sentence_transformers(st, Pooling::LastToken))
            .transpose()
    }

    /// Sliding window of layer `i` (0 = full attention), following `layer_types` as mlx-lm does.
    pub fn layer_window(&self, i: usize) -> usize {
        match &self.layer_types {
            Some(lt) if lt[i] == "sliding_attention" => self.sliding_window.unwrap_or(0),
            _ => 0,
        }
    }
}
