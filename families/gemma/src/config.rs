//! The `config.json` fields this family reads, with the defaults of mlx-lm's `gemma.py`, `gemma2.py`,
//! `gemma3_text.py` and `gemma3.py` (the multimodal wrapper whose text tower this family serves).

use mlxcel_family_kit::config::{check_head_dim, check_heads};
use mlxcel_plugin_api::DType;
use serde::Deserialize;
use serde_json::{json, Value};

/// Architectures (`model_type`) this family handles.
pub const ARCHITECTURES: &[&str] = &["gemma", "gemma2", "gemma3_text", "gemma3"];

/// Which Gemma: the variants are flags on [`GemmaConfig`] derived from this, not copies of the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Generation {
    Gemma1,
    Gemma2,
    Gemma3,
}

/// The text model's fields, after a `gemma3` wrapper's `text_config` has been lifted to the top.
#[derive(Debug, Clone, Deserialize)]
pub struct GemmaConfig {
    /// The top-level `model_type` (`gemma3` for the wrapper, whose text tower is `gemma3_text`).
    pub model_type: String,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_traditional: bool,
    /// Gemma 3: the base of the sliding-window layers (global layers use `rope_theta` and scaling).
    #[serde(default)]
    pub rope_local_base_freq: Option<f64>,
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    #[serde(default)]
    pub max_position_embeddings: Option<usize>,
    /// Gemma 2 / 3: attention scores are scaled by `query_pre_attn_scalar^-0.5`, not `head_dim^-0.5`.
    #[serde(default)]
    pub query_pre_attn_scalar: Option<f64>,
    #[serde(default)]
    pub attn_logit_softcapping: Option<f32>,
    #[serde(default)]
    pub final_logit_softcapping: Option<f32>,
    #[serde(default)]
    pub sliding_window: Option<usize>,
    #[serde(default)]
    pub sliding_window_pattern: Option<usize>,
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    #[serde(default)]
    pub quantization: Option<Value>,
    /// Where the text model's tensors live: `language_model.` for the wrapper, else empty.
    #[serde(skip)]
    pub weight_prefix: String,
}

fn default_rope_theta() -> f64 {
    10000.0
}

/// mlx-lm's `gemma3_text.ModelArgs` defaults: real Gemma 3 configs (the wrapper's `text_config`
/// especially) state only what differs from them.
fn gemma3_defaults() -> Value {
    json!({
        "hidden_size": 1152,
        "num_hidden_layers": 26,
        "intermediate_size": 6912,
        "num_attention_heads": 4,
        "head_dim": 256,
        "rms_norm_eps": 1.0e-6,
        "vocab_size": 262144,
        "num_key_value_heads": 1,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": 256.0,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "max_position_embeddings": 32768,
    })
}

impl GemmaConfig {
    /// Parses a config; a `gemma3` wrapper's `text_config` becomes the model, with the wrapper's
    /// `vocab_size` (default 262208), head counts (8 and 4 when absent) and `quantization`, as
    /// mlx-lm's `gemma3.ModelArgs` does.
    pub fn parse(json: &str) -> Result<GemmaConfig, String> {
        let top: Value = serde_json::from_str(json).map_err(|e| format!("config.json is not valid JSON: {e}"))?;
        let top_type = top.get("model_type").and_then(Value::as_str).unwrap_or_default().to_string();
        let (mut v, prefix) = match top.get("text_config") {
            Some(Value::Object(text)) => {
                let mut t = text.clone();
                t.insert("vocab_size".into(), top.get("vocab_size").cloned().unwrap_or(json!(262208)));
                t.entry("num_attention_heads").or_insert(json!(8));
                t.entry("num_key_value_heads").or_insert(json!(4));
                t.entry("model_type").or_insert(json!("gemma3_text"));
                if let Some(q) = top.get("quantization") {
                    t.entry("quantization").or_insert(q.clone());
                }
                (Value::Object(t), "language_model.")
            }
            _ => (top.clone(), ""),
        };
        let text_type = v.get("model_type").and_then(Value::as_str).unwrap_or_default().to_string();
        if text_type == "gemma3_text" {
            if let (Value::Object(obj), Value::Object(defaults)) = (&mut v, gemma3_defaults()) {
                for (k, d) in defaults {
                    if obj.get(&k).is_none_or(Value::is_null) {
                        obj.insert(k, d);
                    }
                }
            }
        }
        let mut cfg: GemmaConfig = serde_json::from_value(v).map_err(|e| format!("config.json: {e}"))?;
        if !top_type.is_empty() {
            cfg.model_type = top_type;
        }
        cfg.weight_prefix = prefix.to_string();
        cfg.check()?;
        Ok(cfg)
    }

    pub fn generation(&self) -> Generation {
        match self.model_type.as_str() {
            "gemma" => Generation::Gemma1,
            "gemma2" => Generation::Gemma2,
            _ => Generation::Gemma3,
        }
    }

    fn check(&self) -> Result<(), String> {
        if !ARCHITECTURES.contains(&self.model_type.as_str()) {
            return Err(format!("model_type `{}` is not handled by the gemma family", self.model_type));
        }
        check_heads(self.num_attention_heads, self.num_key_value_heads)?;
        check_head_dim(self.head_dim)?;
        if self.generation() == Generation::Gemma3 && self.sliding_window_pattern == Some(0) {
            return Err("config.json: sliding_window_pattern must be at least 1".into());
        }
        if let Some(lt) = &self.layer_types {
            if self.generation() == Generation::Gemma2 && lt.len() != self.num_hidden_layers {
                return Err(format!(
                    "config.json: layer_types has {} entries for {} layers",
                    lt.len(),
                    self.num_hidden_layers
                ));
            }
        }
        for (name, cap) in [("attn", self.attn_softcap()), ("final", self.final_softcap())] {
            if cap.is_some_and(|c| c <= 0.0) {
                return Err(format!("config.json: {name}_logit_softcapping must be positive"));
            }
        }
        Ok(())
    }

    /// Attention score scale: `head_dim^-0.5` (Gemma 1), `query_pre_attn_scalar^-0.5` (Gemma 2: default
    /// 144; Gemma 3: 256).
    pub fn attention_scale(&self) -> f32 {
        let s = match self.generation() {
            Generation::Gemma1 => self.head_dim as f64,
            Generation::Gemma2 => self.query_pre_attn_scalar.unwrap_or(144.0),
            Generation::Gemma3 => self.query_pre_attn_scalar.unwrap_or(256.0),
        };
        (1.0 / s.sqrt()) as f32
    }

    /// Gemma 2's attention logit soft-cap (mlx-lm's default 50); Gemma 1 and 3 have none.
    pub fn attn_softcap(&self) -> Option<f32> {
        (self.generation() == Generation::Gemma2).then(|| self.attn_logit_softcapping.unwrap_or(50.0))
    }

    /// Gemma 2's final logit soft-cap (mlx-lm's default 30); Gemma 1 and 3 have none.
    pub fn final_softcap(&self) -> Option<f32> {
        (self.generation() == Generation::Gemma2).then(|| self.final_logit_softcapping.unwrap_or(30.0))
    }

    /// Four norms per layer (attention and feed-forward outputs normed before the residual add).
    pub fn sandwich_norms(&self) -> bool {
        self.generation() != Generation::Gemma1
    }

    /// Per-head RMS norms on q and k before rope (Gemma 3).
    pub fn qk_norm(&self) -> bool {
        self.generation() == Generation::Gemma3
    }

    /// mlx-lm's Gemma 1 MLP uses the exact (erf) GELU whatever the config says; Gemma 2 and 3 the tanh
    /// approximation.
    pub fn exact_gelu(&self) -> bool {
        self.generation() == Generation::Gemma1
    }

    /// Sliding window of layer `i` (0 = global attention).
    ///
    /// Gemma 3 as mlx-lm: every layer but each `sliding_window_pattern`-th is local. Gemma 2 as the model
    /// is trained and transformers runs it: `layer_types` when given, else even layers local (mlx-lm
    /// 0.32's gemma2 keeps every layer global, which only differs past `sliding_window` tokens).
    pub fn layer_window(&self, i: usize) -> usize {
        let window = self.sliding_window.unwrap_or(0);
        match self.generation() {
            Generation::Gemma1 => 0,
            Generation::Gemma2 => {
                let sliding = match &self.layer_types {
                    Some(lt) => lt[i] == "sliding_attention",
                    None => i.is_multiple_of(2),
                };
                if sliding {
                    window
                } else {
                    0
                }
            }
            Generation::Gemma3 => {
                let pattern = self.sliding_window_pattern.unwrap_or(6);
                if !(i + 1).is_multiple_of(pattern) {
                    window
                } else {
                    0
                }
            }
        }
    }

    /// Rope base of layer `i`: Gemma 3's local layers use `rope_local_base_freq`.
    pub fn layer_rope_base(&self, i: usize) -> f64 {
        if self.generation() == Generation::Gemma3 && self.layer_window(i) > 0 {
            self.rope_local_base_freq.unwrap_or(10000.0)
        } else {
            self.rope_theta
        }
    }

    /// Rope scaling of layer `i`: Gemma 3 scales only its global layers; Gemma 1 and 2 have none in
    /// mlx-lm.
    pub fn layer_rope_scaling(&self, i: usize) -> Option<&Value> {
        if self.generation() == Generation::Gemma3 && self.layer_window(i) == 0 {
            self.rope_scaling.as_ref().filter(|v| !v.is_null())
        } else {
            None
        }
    }

    /// The factor the embedding rows are multiplied by: √hidden in the activation dtype (the embedding's
    /// output dtype, where mlx-lm multiplies), Gemma 3 first rounding it to bfloat16 as mlx-lm does.
    pub fn embedding_scale(&self, activation: DType) -> f32 {
        let s = (self.hidden_size as f32).sqrt();
        let s = if self.generation() == Generation::Gemma3 { round_to(DType::BF16, s) } else { s };
        round_to(activation, s)
    }

    /// Interleaved rope pairs when the config says so (Gemma 1 / 2); mlx-lm's Gemma 3 always splits halves.
    pub fn rope_traditional(&self) -> bool {
        self.rope_traditional && self.generation() != Generation::Gemma3
    }

    pub fn max_positions(&self) -> usize {
        self.max_position_embeddings.unwrap_or(8192)
    }
}

/// `v` rounded to the nearest value of `dtype` (round to nearest even), as a cast in MLX does.
pub fn round_to(dtype: DType, v: f32) -> f32 {
    match dtype {
        DType::BF16 => {
            let b = v.to_bits();
            let r = b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000;
            f32::from_bits(r)
        }
        DType::F16 => {
            // f16 has 10 mantissa bits: round the f32 mantissa at bit 13 (values here are normal).
            let b = v.to_bits();
            let r = b.wrapping_add(0xfff + ((b >> 13) & 1)) & 0xffff_e000;
            f32::from_bits(r)
        }
        _ => v,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sparse_gemma3_wrapper_takes_mlx_lm_defaults() {
        // The shape of google/gemma-3-4b-it's config.json: most text fields are left to defaults.
        let cfg = GemmaConfig::parse(
            r#"{"model_type":"gemma3","text_config":{"model_type":"gemma3_text","hidden_size":2560,
                "intermediate_size":10240,"num_hidden_layers":34,"sliding_window":1024,
                "rope_scaling":{"factor":8.0,"rope_type":"linear"}},"quantization":{"group_size":64,"bits":4}}"#,
        )
        .unwrap();
        assert_eq!(cfg.model_type, "gemma3");
        assert_eq!(cfg.weight_prefix, "language_model.");
        assert_eq!((cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim), (8, 4, 256));
        assert_eq!(cfg.vocab_size, 262208);
        assert!(cfg.quantization.is_some());
        assert_eq!((cfg.layer_window(4), cfg.layer_window(5)), (1024, 0));
        assert_eq!((cfg.layer_rope_base(0), cfg.layer_rope_base(5)), (10000.0, 1_000_000.0));
        assert!(cfg.layer_rope_scaling(0).is_none() && cfg.layer_rope_scaling(5).is_some());
        assert!((cfg.attention_scale() - 1.0 / 16.0).abs() < 1e-9);
    }

    #[test]
    fn embedding_scale_is_rounded_like_mlx_lm() {
        let cfg = GemmaConfig::parse(r#"{"model_type":"gemma3_text","hidden_size":96}"#).unwrap();
        assert_eq!(cfg.embedding_scale(DType::F32), 9.8125);
        let cfg = GemmaConfig::parse(
            r#"{"model_type":"gemma","hidden_size":96,"num_hidden_layers":1,"intermediate_size":8,
                "num_attention_heads":1,"num_key_value_heads":1,"head_dim":8,"vocab_size":4,"rms_norm_eps":1e-6}"#,
        )
        .unwrap();
        assert_eq!(cfg.embedding_scale(DType::F32), 96f32.sqrt());
        assert_eq!(cfg.embedding_scale(DType::BF16), 9.8125);
        assert_eq!(round_to(DType::F16, 96f32.sqrt()), 9.796875);
    }

    #[test]
    fn gemma2_alternates_local_and_global_layers() {
        let base = r#""hidden_size":8,"num_hidden_layers":3,"intermediate_size":8,"num_attention_heads":1,
            "num_key_value_heads":1,"head_dim":8,"vocab_size":4,"rms_norm_eps":1e-6,"sliding_window":4096"#;
        let cfg = GemmaConfig::parse(&format!(r#"{{"model_type":"gemma2",{base}}}"#)).unwrap();
        assert_eq!((0..3).map(|i| cfg.layer_window(i)).collect::<Vec<_>>(), [4096, 0, 4096]);
        assert_eq!((cfg.attn_softcap(), cfg.final_softcap()), (Some(50.0), Some(30.0)));
        let missing = GemmaConfig::parse(r#"{"model_type":"gemma2","hidden_size":8}"#).unwrap_err();
        assert!(missing.contains("missing field"), "{missing}");
    }
}
