//! The `config.json` fields this family reads, with the defaults mlx-lm and transformers use.

use mlxcel_family_kit::config::{check_head_dim, check_heads};
use serde::Deserialize;
use serde_json::Value;

/// Architectures (`model_type`) this family handles.
pub const ARCHITECTURES: &[&str] = &["qwen2_moe", "qwen3_moe"];

#[derive(Debug, Clone, Deserialize)]
pub struct MoeConfig {
    pub model_type: String,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    /// Width of the dense MLP of `mlp_only_layers`.
    pub intermediate_size: usize,
    pub num_attention_heads: usize,
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    #[serde(default)]
    pub head_dim: Option<usize>,
    pub vocab_size: usize,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_traditional: bool,
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    #[serde(default)]
    pub max_position_embeddings: Option<usize>,
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    /// Qwen2-MoE's shared expert (0 or absent: none).
    #[serde(default)]
    pub shared_expert_intermediate_size: usize,
    /// Divide the chosen experts' probabilities by their sum (Qwen3-MoE; mlx-lm's qwen2_moe never does).
    #[serde(default)]
    pub norm_topk_prob: bool,
    /// Layers `i` with `(i + 1) % decoder_sparse_step == 0` are sparse, unless in `mlp_only_layers`.
    #[serde(default = "one")]
    pub decoder_sparse_step: usize,
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
    #[serde(default)]
    pub hidden_act: Option<String>,
    #[serde(default)]
    pub quantization: Option<Value>,
}

fn default_eps() -> f32 {
    1e-6
}

fn default_rope_theta() -> f64 {
    1_000_000.0
}

fn one() -> usize {
    1
}

impl MoeConfig {
    pub fn parse(json: &str) -> Result<MoeConfig, String> {
        let cfg: MoeConfig = serde_json::from_str(json).map_err(|e| format!("config.json: {e}"))?;
        cfg.check()?;
        Ok(cfg)
    }

    fn check(&self) -> Result<(), String> {
        if !ARCHITECTURES.contains(&self.model_type.as_str()) {
            return Err(format!("model_type `{}` is not handled by the moe family", self.model_type));
        }
        check_heads(self.num_attention_heads, self.n_kv_heads())?;
        check_head_dim(self.head_dim())?;
        if self.num_experts == 0 || self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.num_experts {
            return Err(format!(
                "config.json: num_experts_per_tok ({}) must be between 1 and num_experts ({})",
                self.num_experts_per_tok, self.num_experts
            ));
        }
        if self.decoder_sparse_step == 0 {
            return Err("config.json: decoder_sparse_step must be positive".into());
        }
        if let Some(act) = &self.hidden_act {
            if !matches!(act.as_str(), "silu" | "swish") {
                return Err(format!("config.json: hidden_act `{act}` is not supported (silu)"));
            }
        }
        Ok(())
    }

    pub fn n_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Qwen3-MoE states `head_dim`; Qwen2-MoE derives it (mlx-lm ignores a stated one there).
    pub fn head_dim(&self) -> usize {
        match (self.model_type.as_str(), self.head_dim) {
            ("qwen3_moe", Some(h)) => h,
            _ => self.hidden_size / self.num_attention_heads.max(1),
        }
    }

    /// q/k/v projections carry a bias (Qwen2-MoE).
    pub fn qkv_bias(&self) -> bool {
        self.model_type == "qwen2_moe"
    }

    /// Per-head RMS norm on q and k before rope (Qwen3-MoE).
    pub fn qk_norm(&self) -> bool {
        self.model_type == "qwen3_moe"
    }

    /// Whether layer `i` routes through experts (else a dense MLP of `intermediate_size`).
    pub fn sparse_layer(&self, i: usize) -> bool {
        !self.mlp_only_layers.contains(&i) && (i + 1).is_multiple_of(self.decoder_sparse_step)
    }

    /// mlx-lm's qwen2_moe always has its own `lm_head`; qwen3_moe ties when the config says so.
    pub fn tied_embeddings(&self) -> bool {
        self.model_type == "qwen3_moe" && self.tie_word_embeddings.unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_layers_follow_the_step_and_the_dense_list() {
        let json = r#"{"model_type":"qwen3_moe","hidden_size":64,"num_hidden_layers":4,"intermediate_size":128,
            "num_attention_heads":4,"vocab_size":10,"num_experts":8,"num_experts_per_tok":2,
            "moe_intermediate_size":32,"decoder_sparse_step":2,"mlp_only_layers":[3],"head_dim":16}"#;
        let c = MoeConfig::parse(json).unwrap();
        assert_eq!((0..4).map(|i| c.sparse_layer(i)).collect::<Vec<_>>(), [false, true, false, false]);
        assert_eq!(c.head_dim(), 16);
        let bad = json.replace(r#""num_experts_per_tok":2"#, r#""num_experts_per_tok":9"#);
        assert!(MoeConfig::parse(&bad).unwrap_err().contains("num_experts_per_tok"));
    }
}
