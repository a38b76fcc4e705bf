//! The llama family plugin: Llama, Mistral, Qwen2 and Qwen3 checkpoints as op graphs.
//!
//! [`config`] reads `config.json` and [`model`] is the architecture; weights, linear layers, norms and
//! RoPE come from the family kit, and the C entry points from `export_family!`.

pub mod config;
pub mod model;

use mlxcel_family_kit::config::match_architectures;
use mlxcel_family_kit::{Decoder, WeightTable};
use mlxcel_plugin_api::{export_family, Family, PluginError, WeightInfo};

use config::{LlamaConfig, ARCHITECTURES};
use model::LlamaModel;

/// The llama family.
pub struct Llama;

impl Family for Llama {
    const NAME: &'static str = "llama";
    const DESCRIPTION: &'static str = "Llama-style decoders: Llama, Mistral, Qwen2, Qwen3 (q/k norm)";
    const ARCHITECTURES: &'static [&'static str] = ARCHITECTURES;
    type Model = Decoder<LlamaModel>;

    fn match_config(config_json: &str) -> u32 {
        match_architectures(config_json, ARCHITECTURES)
    }

    fn create(config_json: &str, weights: &[WeightInfo]) -> Result<Decoder<LlamaModel>, PluginError> {
        let cfg = LlamaConfig::parse(config_json).map_err(PluginError::invalid)?;
        LlamaModel::load(cfg, &WeightTable::new(weights)).map_err(PluginError::invalid)
    }
}

export_family!(Llama);
