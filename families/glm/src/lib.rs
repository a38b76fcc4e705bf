//! The glm family plugin: GLM-4 checkpoints (`glm4`) as op graphs.
//!
//! [`config`] reads `config.json` and [`model`] is the architecture; weights, linear layers (with row
//! views of the fused gate-up tensor), norms and RoPE come from the family kit, and the C entry points
//! from `export_family!`.

pub mod config;
pub mod model;

use mlxcel_family_kit::config::match_architectures;
use mlxcel_family_kit::{Decoder, WeightTable};
use mlxcel_plugin_api::{export_family, Family, PluginError, WeightInfo};

use config::{Glm4Config, ARCHITECTURES};
use model::Glm4Model;

/// The glm family.
pub struct Glm;

impl Family for Glm {
    const NAME: &'static str = "glm";
    const DESCRIPTION: &'static str = "GLM-4: sandwich RMS norms, partial interleaved rotary, fused gate-up";
    const ARCHITECTURES: &'static [&'static str] = ARCHITECTURES;
    type Model = Decoder<Glm4Model>;

    fn match_config(config_json: &str) -> u32 {
        match_architectures(config_json, ARCHITECTURES)
    }

    fn create(config_json: &str, weights: &[WeightInfo]) -> Result<Decoder<Glm4Model>, PluginError> {
        let cfg = Glm4Config::parse(config_json).map_err(PluginError::invalid)?;
        Glm4Model::load(cfg, &WeightTable::new(weights)).map_err(PluginError::invalid)
    }
}

export_family!(Glm);
