//! The `config.json` fields this family reads, as mlx-lm's `lfm2.py` does (it requires most of them).

use serde::Deserialize;
use serde_json::Value;

/// Architectures (`model_type`) this family handles.
pub const ARCHITECTURES: &[&str] = &["lfm2"];

#[derive(Debug, Clone, Deserialize)]
pub struct Lfm2Config {
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// mlx-lm: the number of attention heads when absent or null.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    pub max_position_embeddings: usize,
    /// Every RMS norm's epsilon (mlx-lm ignores `block_norm_eps`).
    pub norm_eps: f32,
    /// Biases on the convolution blocks' `in_proj`, `conv` and `out_proj`.
    pub conv_bias: bool,
    /// The short convolution's kernel size.
    #[serde(rename = "conv_L_cache")]
    pub conv_l_cache: usize,
    /// The MLP's input and output width (the hidden size in every LFM2 checkpoint).
    pub block_dim: usize,
    pub block_ff_dim: usize,
    pub block_multiple_of: usize,
    #[serde(default)]
    pub block_ffn_dim_multiplier: Option<f64>,
    pub block_auto_adjust_ff_dim: bool,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    /// Newer configs put `rope_theta` here; it wins over the top-level one, as in mlx-lm.
    #[serde(default)]
    pub rope_parameters: Option<Value>,
    /// The attention layers; when absent, the `full_attention` entries of `layer_types`.
    #[serde(default)]
    pub full_attn_idxs: Option<Vec<usize>>,
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    #[serde(default)]
    pub quantization: Option<Value>,
}

fn default_rope_theta() -> f64 {
    1_000_000.0
}

impl Lfm2Config {
    pub fn parse(json: &str) -> Result<Lfm2Config, String> {
        let mut cfg: Lfm2Config = serde_json::from_str(json).map_err(|e| format!("config.json: {e}"))?;
        if !ARCHITECTURES.contains(&cfg.model_type.as_str()) {
            return Err(format!("model_type `{}` is not handled by the lfm2 family", cfg.model_type));
        }
        if let Some(theta) = cfg.rope_parameters.as_ref().and_then(|p| p.get("rope_theta")).and_then(Value::as_f64) {
            cfg.rope_theta = theta;
        }
        if cfg.full_attn_idxs.is_none() {
            let types = cfg.layer_types.as_ref().ok_or("config.json: needs `full_attn_idxs` or `layer_types`")?;
            cfg.full_attn_idxs =
                Some(types.iter().enumerate().filter(|(_, t)| *t == "full_attention").map(|(i, _)| i).collect());
        }
        let (nh, nkv) = (cfg.num_attention_heads, cfg.n_kv_heads());
        if nh == 0 || nkv == 0 || !nh.is_multiple_of(nkv) || !cfg.hidden_size.is_multiple_of(nh) {
            return Err(format!(
                "config.json: num_attention_heads ({nh}) must divide hidden_size ({}) and be a multiple of \
                 num_key_value_heads ({nkv})",
                cfg.hidden_size
            ));
        }
        if cfg.block_dim != cfg.hidden_size {
            return Err(format!(
                "config.json: block_dim ({}) must equal hidden_size ({}): the MLP adds to the residual",
                cfg.block_dim, cfg.hidden_size
            ));
        }
        if cfg.conv_l_cache == 0 {
            return Err("config.json: conv_L_cache must be at least 1".into());
        }
        if let Some(&i) = cfg.attention_layers().iter().find(|&&i| i >= cfg.num_hidden_layers) {
            return Err(format!("config.json: attention layer {i} of {} layers", cfg.num_hidden_layers));
        }
        Ok(cfg)
    }

    pub fn n_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    fn attention_layers(&self) -> &[usize] {
        self.full_attn_idxs.as_deref().unwrap_or(&[])
    }

    /// Whether layer `i` is attention (else a short-convolution block).
    pub fn is_attention(&self, i: usize) -> bool {
        self.attention_layers().contains(&i)
    }

    /// The MLP's hidden width: with `block_auto_adjust_ff_dim`, two thirds of `block_ff_dim`, times the
    /// multiplier, rounded up to `block_multiple_of` (Python's `int` truncations, as mlx-lm).
    pub fn ff_dim(&self) -> usize {
        if !self.block_auto_adjust_ff_dim {
            return self.block_ff_dim;
        }
        let mut ff = (2.0 * self.block_ff_dim as f64 / 3.0) as usize;
        if let Some(m) = self.block_ffn_dim_multiplier {
            ff = (m * ff as f64) as usize;
        }
        let multiple = self.block_multiple_of.max(1);
        ff.div_ceil(multiple) * multiple
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str) -> Result<Lfm2Config, String> {
        Lfm2Config::parse(&format!(
            r#"{{"model_type":"lfm2","vocab_size":65536,"hidden_size":1024,"num_hidden_layers":16,
                "num_attention_heads":16,"num_key_value_heads":8,"max_position_embeddings":128000,
                "norm_eps":1e-5,"conv_bias":false,"conv_L_cache":3,"block_dim":1024,"block_ff_dim":6656,
                "block_multiple_of":256,"block_ffn_dim_multiplier":1.0,"block_auto_adjust_ff_dim":true{extra}}}"#
        ))
    }

    #[test]
    fn lfm2_350m_shapes_follow_mlx_lm() {
        // LiquidAI/LFM2-350M's config.json, with its layer list as `layer_types` only.
        let types = r#","layer_types":["conv","conv","full_attention","conv","conv","full_attention","conv","conv",
            "full_attention","conv","full_attention","conv","full_attention","conv","full_attention","conv"]"#;
        let cfg = config(types).unwrap();
        assert_eq!(cfg.full_attn_idxs.as_deref(), Some(&[2, 5, 8, 10, 12, 14][..]));
        assert!(cfg.is_attention(2) && !cfg.is_attention(3));
        // int(2 * 6656 / 3) = 4437, rounded up to a multiple of 256.
        assert_eq!(cfg.ff_dim(), 4608);
        assert_eq!((cfg.head_dim(), cfg.n_kv_heads()), (64, 8));
        assert_eq!(cfg.rope_theta, 1e6);
    }

    #[test]
    fn explicit_attention_indices_and_rope_parameters_win() {
        let cfg = config(
            r#","full_attn_idxs":[1,3],"layer_types":["full_attention"],"rope_theta":10000.0,
               "rope_parameters":{"rope_theta":500000.0,"rope_type":"default"}"#,
        )
        .unwrap();
        assert_eq!(cfg.full_attn_idxs.as_deref(), Some(&[1, 3][..]));
        assert_eq!(cfg.rope_theta, 500000.0);
    }

    #[test]
    fn a_config_without_layer_kinds_with_a_wrong_block_dim_or_a_layer_out_of_range_is_refused() {
        assert!(config("").unwrap_err().contains("layer_types"));
        let wrong = r#"{"model_type":"lfm2","vocab_size":8,"hidden_size":8,"num_hidden_layers":1,
            "num_attention_heads":2,"max_position_embeddings":8,"norm_eps":1e-5,"conv_bias":false,
            "conv_L_cache":3,"block_dim":16,"block_ff_dim":8,"block_multiple_of":8,"block_auto_adjust_ff_dim":false,
            "full_attn_idxs":[0]}"#;
        assert!(Lfm2Config::parse(wrong).unwrap_err().contains("block_dim"));
        assert_eq!(config(r#","full_attn_idxs":[16]"#).unwrap_err(), "config.json: attention layer 16 of 16 layers");
    }
}
