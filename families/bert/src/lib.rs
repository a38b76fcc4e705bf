//! The bert family plugin: BERT and (XLM-)RoBERTa encoders as op graphs, for sentence embeddings
//! (`BertModel`, `XLMRobertaModel`, pooled as sentence-transformers says) and cross-encoder rerankers
//! (`*ForSequenceClassification` with one label); and ModernBERT embedding models.
//!
//! [`config`] reads `config.json` (with the sentence-transformers block the host adds from
//! `modules.json` and `1_Pooling/config.json`) and [`model`] is the architecture; [`modernbert`] is
//! ModernBERT's config and architecture (rotary, GeGLU, alternating global and local attention).

pub mod config;
pub mod model;
pub mod modernbert;

use mlxcel_family_kit::config::{match_architectures, model_type};
use mlxcel_family_kit::WeightTable;
use mlxcel_plugin_api::{
    export_family, Family, FamilyModel, Graph, ModelDescription, PluginError, StepDesc, WeightInfo,
};

use config::{BertConfig, ARCHITECTURES};
use model::BertModel;
use modernbert::{ModernBertConfig, ModernBertModel};

/// Every `model_type` the family takes.
const ALL_ARCHITECTURES: &[&str] = &["bert", "roberta", "xlm-roberta", "modernbert"];

/// The bert family.
pub struct Bert;

/// One of the family's architectures. One per loaded model, so the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub enum EncoderModel {
    Bert(BertModel),
    ModernBert(ModernBertModel),
}

impl FamilyModel for EncoderModel {
    fn description(&self) -> ModelDescription {
        match self {
            EncoderModel::Bert(m) => m.description(),
            EncoderModel::ModernBert(m) => m.description(),
        }
    }

    fn build_graph(&mut self, step: &StepDesc) -> Result<&Graph, PluginError> {
        match self {
            EncoderModel::Bert(m) => m.build_graph(step),
            EncoderModel::ModernBert(m) => m.build_graph(step),
        }
    }
}

impl Family for Bert {
    const NAME: &'static str = "bert";
    const DESCRIPTION: &'static str =
        "Encoders: BERT, RoBERTa, XLM-RoBERTa (sentence embeddings; cross-encoder rerankers), ModernBERT (embeddings)";
    const ARCHITECTURES: &'static [&'static str] = ALL_ARCHITECTURES;
    type Model = EncoderModel;

    fn match_config(config_json: &str) -> u32 {
        match_architectures(config_json, ALL_ARCHITECTURES)
    }

    fn create(config_json: &str, weights: &[WeightInfo]) -> Result<EncoderModel, PluginError> {
        let table = WeightTable::new(weights);
        if model_type(config_json).as_deref() == Some("modernbert") {
            let cfg = ModernBertConfig::parse(config_json).map_err(PluginError::invalid)?;
            return ModernBertModel::new(cfg, &table).map(EncoderModel::ModernBert).map_err(PluginError::invalid);
        }
        debug_assert!(ARCHITECTURES.iter().all(|a| ALL_ARCHITECTURES.contains(a)));
        let cfg = BertConfig::parse(config_json).map_err(PluginError::invalid)?;
        BertModel::new(cfg, &table).map(EncoderModel::Bert).map_err(PluginError::invalid)
    }
}

export_family!(Bert);
