//! The gemma family plugin: Gemma, Gemma 2, Gemma 3 text checkpoints and the text tower of Gemma 3
//! multimodal checkpoints, as op graphs.
//!
//! [`config`] reads `config.json` and [`model`] is the architecture; weights, linear layers, norms and
//! RoPE come from the family kit, and the C entry points from `export_family!`.

pub mod config;
pub mod model;

use mlxcel_family_kit::config::match_architectures;
use mlxcel_family_kit::{Decoder, WeightTable};
use mlxcel_plugin_api::{export_family, Family, PluginError, WeightInfo};

use config::{GemmaConfig, ARCHITECTURES};
use model::GemmaModel;

/// The gemma family.
pub struct Gemma;

impl Family for Gemma {
    const NAME: &'static str = "gemma";
    const DESCRIPTION: &'static str =
        "Gemma 1/2/3: (1 + w) RMS norms, GELU MLP, soft-capping, local/global attention with per-layer rope";
    const ARCHITECTURES: &'static [&'static str] = ARCHITECTURES;
    type Model = Decoder<GemmaModel>;

    fn match_config(config_json: &str) -> u32 {
        match_architectures(config_json, ARCHITECTURES)
    }

    fn create(config_json: &str, weights: &[WeightInfo]) -> Result<Decoder<GemmaModel>, PluginError> {
        let cfg = GemmaConfig::parse(config_json).map_err(PluginError::invalid)?;
        GemmaModel::load(cfg, &WeightTable::new(weights)).map_err(PluginError::invalid)
    }
}

export_family!(Gemma);
