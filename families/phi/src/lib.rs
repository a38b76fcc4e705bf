//! The phi family plugin: Phi-3 checkpoints (Phi-3, Phi-3.5, Phi-4-mini) as op graphs.
//!
//! [`config`] reads `config.json` and [`model`] is the architecture; weights, linear layers (with row
//! views of fused tensors), norms and RoPE come from the family kit, and the C entry points from
//! `export_family!`.

pub mod config;
pub mod model;

use mlxcel_family_kit::config::match_architectures;
use mlxcel_family_kit::{Decoder, WeightTable};
use mlxcel_plugin_api::{export_family, Family, PluginError, WeightInfo};

use config::{Phi3Config, ARCHITECTURES};
use model::Phi3Model;

/// The phi family.
pub struct Phi;

impl Family for Phi {
    const NAME: &'static str = "phi";
    const DESCRIPTION: &'static str = "Phi-3: fused qkv / gate-up projections, partial rotary, LongRoPE";
    const ARCHITECTURES: &'static [&'static str] = ARCHITECTURES;
    type Model = Decoder<Phi3Model>;

    fn match_config(config_json: &str) -> u32 {
        match_architectures(config_json, ARCHITECTURES)
    }

    fn create(config_json: &str, weights: &[WeightInfo]) -> Result<Decoder<Phi3Model>, PluginError> {
        let cfg = Phi3Config::parse(config_json).map_err(PluginError::invalid)?;
        Phi3Model::load(cfg, &WeightTable::new(weights)).map_err(PluginError::invalid)
    }
}

export_family!(Phi);
