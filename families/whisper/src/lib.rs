//! The whisper family plugin: OpenAI Whisper checkpoints (Hugging Face and mlx-community layouts) as op
//! graphs. The encoder runs in the step that brings a sequence's log-mel frames and stores each decoder
//! layer's cross-attention keys and values in the sequence's state; every step decodes tokens.
//!
//! [`config`] reads `config.json` and [`model`] is the architecture; linear layers, quantization and
//! the weight table come from the family kit, the C entry points from `export_family!`.

pub mod config;
pub mod model;

use mlxcel_family_kit::WeightTable;
use mlxcel_plugin_api::{export_family, Family, PluginError, WeightInfo};

use config::{WhisperConfig, ARCHITECTURES};
use model::WhisperModel;

/// The whisper family.
pub struct Whisper;

impl Family for Whisper {
    const NAME: &'static str = "whisper";
    const DESCRIPTION: &'static str = "Whisper speech recognition: log-mel encoder, text decoder with cross-attention";
    const ARCHITECTURES: &'static [&'static str] = ARCHITECTURES;
    type Model = WhisperModel;

    fn match_config(config_json: &str) -> u32 {
        config::match_config(config_json)
    }

    fn create(config_json: &str, weights: &[WeightInfo]) -> Result<WhisperModel, PluginError> {
        let cfg = WhisperConfig::parse(config_json).map_err(PluginError::invalid)?;
        WhisperModel::new(cfg, &WeightTable::new(weights)).map_err(PluginError::invalid)
    }
}

export_family!(Whisper);
