//! The `config.json` fields Whisper needs, under Hugging Face's names (`d_model`, `encoder_layers`, …)
//! or the OpenAI / mlx-community names (`n_audio_state`, `n_audio_layer`, …).

use serde::Deserialize;
use serde_json::Value;

/// Architectures (`model_type`) this family handles.
pub const ARCHITECTURES: &[&str] = &["whisper"];

#[derive(Debug, Clone, Deserialize)]
pub struct WhisperConfig {
    #[serde(alias = "n_audio_state")]
    pub d_model: usize,
    /// mlx-community configs name the decoder width separately; it must equal the encoder's.
    #[serde(default)]
    pub n_text_state: Option<usize>,
    #[serde(alias = "n_audio_layer")]
    pub encoder_layers: usize,
    #[serde(alias = "n_text_layer")]
    pub decoder_layers: usize,
    #[serde(alias = "n_audio_head")]
    pub encoder_attention_heads: usize,
    #[serde(alias = "n_text_head")]
    pub decoder_attention_heads: usize,
    /// Absent in mlx-community configs: 4 × d_model there.
    #[serde(default)]
    pub encoder_ffn_dim: Option<usize>,
    #[serde(default)]
    pub decoder_ffn_dim: Option<usize>,
    #[serde(alias = "n_mels")]
    pub num_mel_bins: usize,
    #[serde(alias = "n_audio_ctx")]
    pub max_source_positions: usize,
    #[serde(alias = "n_text_ctx")]
    pub max_target_positions: usize,
    #[serde(alias = "n_vocab")]
    pub vocab_size: usize,
    #[serde(default)]
    pub activation_function: Option<String>,
    #[serde(default)]
    pub scale_embedding: bool,
    #[serde(default)]
    pub tie_word_embeddings: Option<bool>,
    #[serde(default)]
    pub quantization: Option<Value>,
}

impl WhisperConfig {
    pub fn parse(json: &str) -> Result<WhisperConfig, String> {
        let cfg: WhisperConfig = serde_json::from_str(json).map_err(|e| format!("config.json: {e}"))?;
        if let Some(act) = cfg.activation_function.as_deref() {
            if act != "gelu" {
                return Err(format!("config.json: activation_function `{act}` is not supported (gelu)"));
            }
        }
        if cfg.scale_embedding {
            return Err("config.json: scale_embedding = true is not supported (no Whisper checkpoint uses it)".into());
        }
        if cfg.n_text_state.is_some_and(|n| n != cfg.d_model) {
            return Err(format!(
                "config.json: n_text_state {} differs from n_audio_state {}; only equal widths are supported",
                cfg.n_text_state.unwrap_or(0),
                cfg.d_model
            ));
        }
        for (name, heads) in [("encoder", cfg.encoder_attention_heads), ("decoder", cfg.decoder_attention_heads)] {
            if heads == 0 || !cfg.d_model.is_multiple_of(heads) {
                return Err(format!("config.json: {name} heads {heads} do not divide d_model {}", cfg.d_model));
            }
        }
        if cfg.max_source_positions == 0 || cfg.max_target_positions == 0 {
            return Err("config.json: max_source_positions and max_target_positions must be positive".into());
        }
        Ok(cfg)
    }

    pub fn encoder_ffn(&self) -> usize {
        self.encoder_ffn_dim.unwrap_or(4 * self.d_model)
    }

    pub fn decoder_ffn(&self) -> usize {
        self.decoder_ffn_dim.unwrap_or(4 * self.d_model)
    }
}

/// 100 for `model_type: whisper`, and for an OpenAI-style config without `model_type` that has the
/// audio and text dimensions (older mlx-community conversions); else 0.
pub fn match_config(json: &str) -> u32 {
    let Ok(v) = serde_json::from_str::<Value>(json) else { return 0 };
    match v.get("model_type").and_then(Value::as_str) {
        Some(t) if ARCHITECTURES.contains(&t) => 100,
        Some(_) => 0,
        None if v.get("n_audio_state").is_some() && v.get("n_text_ctx").is_some() => 90,
        None => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hugging_face_and_mlx_names_read_the_same_dimensions() {
        let hf = r#"{"model_type":"whisper","d_model":384,"encoder_layers":4,"decoder_layers":4,
            "encoder_attention_heads":6,"decoder_attention_heads":6,"encoder_ffn_dim":1536,"decoder_ffn_dim":1536,
            "num_mel_bins":80,"max_source_positions":1500,"max_target_positions":448,"vocab_size":51864,
            "activation_function":"gelu"}"#;
        let mlx = r#"{"model_type":"whisper","n_mels":80,"n_audio_ctx":1500,"n_audio_state":384,"n_audio_head":6,
            "n_audio_layer":4,"n_vocab":51864,"n_text_ctx":448,"n_text_state":384,"n_text_head":6,"n_text_layer":4,
            "quantization":{"group_size":64,"bits":4}}"#;
        let (a, b) = (WhisperConfig::parse(hf).unwrap(), WhisperConfig::parse(mlx).unwrap());
        assert_eq!(
            (a.d_model, a.encoder_ffn(), a.max_source_positions),
            (b.d_model, b.encoder_ffn(), b.max_source_positions)
        );
        assert_eq!((a.decoder_layers, a.vocab_size, a.num_mel_bins), (b.decoder_layers, b.vocab_size, b.num_mel_bins));
        assert!(b.quantization.is_some());
        assert_eq!(match_config(hf), 100);
        assert_eq!(match_config(&mlx.replace(r#""model_type":"whisper","#, "")), 90);
        assert_eq!(match_config(r#"{"model_type":"llama"}"#), 0);
        assert!(WhisperConfig::parse(&hf.replace(r#""gelu""#, r#""relu""#)).unwrap_err().contains("relu"));
    }
}
