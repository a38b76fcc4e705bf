//! The bert family plugin: BERT and (XLM-)RoBERTa encoders as op graphs, for sentence embeddings
//! (`BertModel`, `XLMRobertaModel`, pooled as sentence-transformers says) and cross-encoder rerankers
//! (`*ForSequenceClassification` with one label).
//!
//! [`config`] reads `config.json` (with the sentence-transformers block the host adds from
//! `modules.json` and `1_Pooling/config.json`) and [`model`] is the architecture.

pub mod config;
pub mod model;

use mlxcel_family_kit::config::match_architectures;
use mlxcel_family_kit::WeightTable;
use mlxcel_plugin_api::{export_family, Family, PluginError, WeightInfo};

use config::{BertConfig, ARCHITECTURES};
use model::BertModel;

/// The bert family.
pub struct Bert;

impl Family for Bert {
    const NAME: &'static str = "bert";
    const DESCRIPTION: &'static str =
        "Encoders: BERT, RoBERTa, XLM-RoBERTa (sentence embeddings; cross-encoder rerankers)";
    const ARCHITECTURES: &'static [&'static str] = ARCHITECTURES;
    type Model = BertModel;

    fn match_config(config_json: &str) -> u32 {
        match_architectures(config_json, ARCHITECTURES)
    }

    fn create(config_json: &str, weights: &[WeightInfo]) -> Result<BertModel, PluginError> {
        let cfg = BertConfig::parse(config_json).map_err(PluginError::invalid)?;
        BertModel::new(cfg, &WeightTable::new(weights)).map_err(PluginError::invalid)
    }
}

export_family!(Bert);
