//! The `config.json` fields this family reads, as mlx-lm's `glm4.py` does (it requires most of them).

use mlxcel_family_kit::config::check_heads;
use serde::Deserialize;
use serde_json::Value;

/// Architectures (`model_type`) this family handles.
pub const ARCHITECTURES: &[&str] = &["glm4"];

#[derive(Debug, Clone, Deserialize)]
pub struct Glm4Config {
    pub model_type: String,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// q, k and v carry a bias (o_proj never does).
    pub attention_bias: bool,
    pub rms_norm_eps: f32,
    pub vocab_size: usize,
    pub partial_rotary_factor: f64,
    pub rope_theta: f64,
    /// mlx-lm's glm4 defaults to interleaved pairs.
    #[serde(default = "default_true")]
    pub rope_traditional: bool,
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub quantization: Option<Value>,
}

fn default_true() -> bool {
    true
}
fn default_max_positions() -> usize {
    32768
}

impl Glm4Config {
    pub fn parse(json: &str) -> Result<Glm4Config, String> {
        let cfg: Glm4Config = serde_json::from_str(json).map_err(|e| format!("config.json: {e}"))?;
        if !ARCHITECTURES.contains(&cfg.model_type.as_str()) {
            return Err(format!("model_type `{}` is not handled by the glm family", cfg.model_type));
        }
        check_heads(cfg.num_attention_heads, cfg.num_key_value_heads)?;
        let rot = cfg.rotary_dims();
        if rot == 0 || !rot.is_multiple_of(2) || rot > cfg.head_dim {
            return Err(format!("config.json: partial_rotary_factor gives {rot} rotary dims; it must be even"));
        }
        Ok(cfg)
    }

    /// The leading dims of each head that rotate: `int(head_dim * partial_rotary_factor)`.
    pub fn rotary_dims(&self) -> usize {
        (self.head_dim as f64 * self.partial_rotary_factor) as usize
    }
}
