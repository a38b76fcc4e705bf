//! The lfm2 family plugin: Liquid LFM2 checkpoints (`lfm2`) as op graphs.
//!
//! [`config`] reads `config.json` and [`model`] is the architecture; weights, linear layers, norms,
//! the attention block and RoPE come from the family kit, and the C entry points from
//! `export_family!`.

pub mod config;
pub mod model;

use mlxcel_family_kit::config::match_architectures;
use mlxcel_family_kit::{Decoder, WeightTable};
use mlxcel_plugin_api::{export_family, Family, PluginError, WeightInfo};

use config::{Lfm2Config, ARCHITECTURES};
use model::Lfm2Model;

/// The lfm2 family.
pub struct Lfm2;

impl Family for Lfm2 {
    const NAME: &'static str = "lfm2";
    const DESCRIPTION: &'static str = "Liquid LFM2: gated short convolutions (state per sequence) and GQA attention";
    const ARCHITECTURES: &'static [&'static str] = ARCHITECTURES;
    type Model = Decoder<Lfm2Model>;

    fn match_config(config_json: &str) -> u32 {
        match_architectures(config_json, ARCHITECTURES)
    }

    fn create(config_json: &str, weights: &[WeightInfo]) -> Result<Decoder<Lfm2Model>, PluginError> {
        let cfg = Lfm2Config::parse(config_json).map_err(PluginError::invalid)?;
        Lfm2Model::load(cfg, &WeightTable::new(weights)).map_err(PluginError::invalid)
    }
}

export_family!(Lfm2);
