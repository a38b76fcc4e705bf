//! The llama family plugin: Llama, Mistral, Qwen2 and Qwen3 checkpoints as op graphs.
//!
//! [`config`] reads `config.json` and [`model`] is the architecture; weights, linear layers, norms and
//! RoPE come from the family kit, and the C entry points from `export_family!`. A checkpoint with
//! sentence-transformers metadata (Qwen3-Embedding) is an embedding model of the same architecture.

pub mod config;
pub mod model;

use mlxcel_family_kit::config::match_architectures;
use mlxcel_family_kit::{Decoder, WeightTable};
use mlxcel_plugin_api::{export_family, Family, PluginError, StrRef, WeightInfo};

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
        LlamaModel::load(cfg, &weight_table(weights)).map_err(PluginError::invalid)
    }
}

/// The weight table under the causal-LM names (`model.layers.N…`). sentence-transformers saves a
/// decoder's body alone (Qwen3-Embedding: `embed_tokens.weight`, `layers.N…`, `norm.weight`), which is
/// read as if it had the `model.` prefix.
fn weight_table(weights: &[WeightInfo]) -> WeightTable {
    // SAFETY: the host's names live for the duration of the call.
    let name = |w: &WeightInfo| unsafe { w.name.as_str() };
    let bare_body = weights.iter().any(|w| name(w) == "embed_tokens.weight")
        && !weights.iter().any(|w| name(w) == "model.embed_tokens.weight");
    if !bare_body {
        return WeightTable::new(weights);
    }
    let names: Vec<String> = weights.iter().map(|w| format!("model.{}", name(w))).collect();
    let renamed: Vec<WeightInfo> =
        weights.iter().zip(&names).map(|(w, n)| WeightInfo { name: StrRef::new(n), ..*w }).collect();
    WeightTable::new(&renamed)
}

export_family!(Llama);
