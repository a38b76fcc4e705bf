//! The `config.json` fields this family reads, with the defaults of mlx-lm's `phi3.py`.

use serde::Deserialize;
use serde_json::Value;

/// Architectures (`model_type`) this family handles.
pub const ARCHITECTURES: &[&str] = &["phi3"];

#[derive(Debug, Clone, Deserialize)]
pub struct Phi3Config {
    pub model_type: String,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    pub rms_norm_eps: f32,
    pub vocab_size: usize,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_traditional: bool,
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    #[serde(default = "default_partial_rotary")]
    pub partial_rotary_factor: f64,
    #[serde(default = "default_max_positions")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_original_max_positions")]
    pub original_max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default)]
    pub quantization: Option<Value>,
}

fn default_rope_theta() -> f64 {
    10000.0
}
fn default_partial_rotary() -> f64 {
    1.0
}
fn default_max_positions() -> usize {
    131072
}
fn default_original_max_positions() -> usize {
    4096
}

/// How the rotary frequencies are made.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear(f64),
    /// LongRoPE / "su": periods stretched by `long_factor`, rotated dims scaled (see the kit's `su_scaled`).
    LongRope(Vec<f64>),
}

impl Phi3Config {
    pub fn parse(json: &str) -> Result<Phi3Config, String> {
        let cfg: Phi3Config = serde_json::from_str(json).map_err(|e| format!("config.json: {e}"))?;
        cfg.check()?;
        Ok(cfg)
    }

    fn check(&self) -> Result<(), String> {
        if !ARCHITECTURES.contains(&self.model_type.as_str()) {
            return Err(format!("model_type `{}` is not handled by the phi family", self.model_type));
        }
        let (nh, nkv) = (self.num_attention_heads, self.n_kv_heads());
        if nh == 0 || nkv == 0 || !nh.is_multiple_of(nkv) || !self.hidden_size.is_multiple_of(nh) {
            return Err(format!(
                "config.json: hidden_size ({}) must split into num_attention_heads ({nh}), a multiple of \
                 num_key_value_heads ({nkv})",
                self.hidden_size
            ));
        }
        let rot = self.rotary_dims();
        if rot == 0 || !rot.is_multiple_of(2) {
            return Err(format!("config.json: partial_rotary_factor gives {rot} rotary dims; it must be even"));
        }
        self.rope()?;
        Ok(())
    }

    pub fn n_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// mlx-lm's phi3 derives the head size; it reads no `head_dim`.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// The leading dims of each head that rotate: `int(head_dim * partial_rotary_factor)`.
    pub fn rotary_dims(&self) -> usize {
        (self.head_dim() as f64 * self.partial_rotary_factor) as usize
    }

    /// `rope_scaling` as mlx-lm's phi3 reads it: `longrope` / `su` and `linear`; any other type is
    /// ignored (mlx-lm warns and runs without scaling).
    pub fn rope(&self) -> Result<RopeScaling, String> {
        let Some(s) = self.rope_scaling.as_ref().filter(|v| !v.is_null()) else { return Ok(RopeScaling::None) };
        match s.get("type").or_else(|| s.get("rope_type")).and_then(Value::as_str) {
            Some("longrope" | "su") => {
                Ok(RopeScaling::LongRope(mlxcel_family_kit::rope::factors(s, "long_factor", self.rotary_dims())?))
            }
            Some("linear") => {
                let f =
                    s.get("factor").and_then(Value::as_f64).ok_or("config.json: linear rope_scaling needs `factor`")?;
                Ok(RopeScaling::Linear(f))
            }
            _ => Ok(RopeScaling::None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partial_rotary_and_longrope_are_read() {
        let cfg = Phi3Config::parse(
            r#"{"model_type":"phi3","hidden_size":64,"num_hidden_layers":1,"intermediate_size":8,
                "num_attention_heads":4,"rms_norm_eps":1e-5,"vocab_size":4,"partial_rotary_factor":0.75,
                "rope_scaling":{"type":"longrope","long_factor":[1,2,3,4,5,6],"short_factor":[1,1,1,1,1,1]}}"#,
        )
        .unwrap();
        assert_eq!((cfg.head_dim(), cfg.rotary_dims(), cfg.n_kv_heads()), (16, 12, 4));
        assert_eq!(cfg.rope().unwrap(), RopeScaling::LongRope(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]));
        let bad = r#"{"model_type":"phi3","hidden_size":64,"num_hidden_layers":1,"intermediate_size":8,
            "num_attention_heads":4,"rms_norm_eps":1e-5,"vocab_size":4,"rope_scaling":{"type":"su","long_factor":[1]}}"#;
        assert!(Phi3Config::parse(bad).unwrap_err().contains("long_factor"));
    }
}
