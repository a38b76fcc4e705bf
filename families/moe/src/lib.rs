//! The mixture-of-experts family plugin: Qwen2-MoE (with its shared expert) and Qwen3-MoE checkpoints as
//! op graphs.
//!
//! [`config`] reads `config.json` and [`model`] is the architecture; weights, linear layers, expert
//! projections, norms and RoPE come from the family kit, and the C entry points from `export_family!`.

pub mod config;
pub mod model;

use mlxcel_family_kit::config::match_architectures;
use mlxcel_family_kit::{Decoder, WeightTable};
use mlxcel_plugin_api::{export_family, Family, PluginError, WeightInfo};

use config::{MoeConfig, ARCHITECTURES};
use model::MoeModel;

/// The mixture-of-experts family.
pub struct Moe;

impl Family for Moe {
    const NAME: &'static str = "moe";
    const DESCRIPTION: &'static str = "Mixture-of-experts decoders: Qwen2-MoE (shared expert), Qwen3-MoE";
    const ARCHITECTURES: &'static [&'static str] = ARCHITECTURES;
    type Model = Decoder<MoeModel>;

    fn match_config(config_json: &str) -> u32 {
        match_architectures(config_json, ARCHITECTURES)
    }

    fn create(config_json: &str, weights: &[WeightInfo]) -> Result<Decoder<MoeModel>, PluginError> {
        let cfg = MoeConfig::parse(config_json).map_err(PluginError::invalid)?;
        MoeModel::load(cfg, &WeightTable::new(weights)).map_err(PluginError::invalid)
    }
}

export_family!(Moe);
