//! What every text decoder does around its layers: the [`FamilyModel`] the host calls ([`Decoder`]:
//! the description, the step's graph reset, its token and position inputs), the rows that need logits,
//! and the facts a description reports (quantization in words, activation bytes). A family writes its
//! config, its blocks and [`TextDecoder::forward`]; the kit does the rest.
//!
//! A decoder loaded as an embedding model ([`Task::Embed`], Qwen3-Embedding) is the same `Decoder`: it
//! reports no KV layers and vectors of the hidden size, and each step holds whole sequences whose
//! pooled rows the family's `forward` returns (see [`crate::embedding`]).

use mlxcel_plugin_api::{
    DType, FamilyModel, Graph, KvLayerDesc, ModelDescription, OpCode, OutputKind, PluginError, StepDesc, Task,
    TensorId, INPUT_OUTPUT_ROWS, INPUT_POSITIONS, INPUT_TOKENS,
};
use serde_json::Value;

use crate::attention::AttentionShape;
use crate::embedding::check_whole_sequences;
use crate::weights::{GraphWriter, Linear};

/// The inputs every decoder step has.
#[derive(Debug, Clone, Copy)]
pub struct StepInputs {
    /// Token ids, `[n_tokens]`.
    pub tokens: TensorId,
    /// Each token's position in its sequence, `[n_tokens]`.
    pub positions: TensorId,
    pub n_tokens: u64,
    /// Rows that need logits (an embedding model: one pooled row per sequence).
    pub n_rows: u64,
}

impl StepInputs {
    /// The rows of `h [n_tokens, width]` that need logits (`GetRows` on `INPUT_OUTPUT_ROWS`): only
    /// they go through the final norm and the vocabulary projection.
    pub fn output_rows(&self, w: &mut GraphWriter, h: TensorId, width: u64) -> TensorId {
        let rows = w.g.input(INPUT_OUTPUT_ROWS, DType::I32, &[self.n_rows]);
        w.g.op(OpCode::GetRows, &[self.n_rows, width], &[h, rows])
    }
}

/// A text decoder's forward pass, which [`Decoder`] serves to the host.
pub trait TextDecoder: Send + 'static {
    /// The nodes of one step (at least one token), from its inputs to the logits `[n_rows, vocab]`
    /// (an embedding model: the sentence vectors `[n_seqs, hidden]`).
    fn forward(&self, w: &mut GraphWriter, step: &StepDesc, inputs: StepInputs) -> Result<TensorId, String>;
}

/// What a text decoder reports to the host; its output follows from the task (logits over the
/// vocabulary for [`Task::Text`], hidden-size vectors for [`Task::Embed`]).
pub struct TextModelFacts {
    /// [`Task::Text`], or [`Task::Embed`] for a decoder run as an embedding model.
    pub task: Task,
    pub architecture: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub max_positions: usize,
    /// One per layer (an embedding model keeps no KV, and reports none).
    pub kv_layers: Vec<KvLayerDesc>,
    pub used_weights: Vec<u32>,
    pub activation_bytes_per_token: u64,
    pub quantization: String,
}

/// A text decoder as the host sees it: its description, and the graph of the latest step, owned here
/// as the ABI requires.
pub struct Decoder<M> {
    pub model: M,
    description: ModelDescription,
    graph: Graph,
}

impl<M: TextDecoder> Decoder<M> {
    pub fn new(model: M, facts: TextModelFacts) -> Decoder<M> {
        let embeds = facts.task == Task::Embed;
        let description = ModelDescription {
            task: facts.task,
            architecture: facts.architecture,
            vocab_size: facts.vocab_size as u64,
            hidden_size: facts.hidden_size as u64,
            n_layers: facts.kv_layers.len() as u32,
            max_positions: facts.max_positions as u64,
            kv_layers: if embeds { Vec::new() } else { facts.kv_layers },
            used_weights: facts.used_weights,
            activation_bytes_per_token: facts.activation_bytes_per_token,
            quantization: facts.quantization,
            output_kind: if embeds { OutputKind::Embeddings } else { OutputKind::Logits },
            output_dim: if embeds { facts.hidden_size } else { facts.vocab_size } as u64,
        };
        Decoder { model, description, graph: Graph::new() }
    }
}

impl<M: TextDecoder> FamilyModel for Decoder<M> {
    fn description(&self) -> ModelDescription {
        self.description.clone()
    }

    fn build_graph(&mut self, step: &StepDesc) -> Result<&Graph, PluginError> {
        let (t, r) = (step.n_tokens as u64, step.n_output_rows as u64);
        if t == 0 {
            return Err(PluginError::invalid("a step needs at least one token"));
        }
        if self.description.task == Task::Embed {
            check_whole_sequences(step).map_err(PluginError::invalid)?;
        }
        // The graph keeps its allocations from step to step.
        self.graph.nodes.clear();
        self.graph.constants.clear();
        self.graph.outputs.clear();
        let mut w = GraphWriter::new(&mut self.graph);
        let tokens = w.g.input(INPUT_TOKENS, DType::I32, &[t]);
        let positions = w.g.input(INPUT_POSITIONS, DType::I32, &[t]);
        let inputs = StepInputs { tokens, positions, n_tokens: t, n_rows: r };
        let logits = self.model.forward(&mut w, step, inputs).map_err(PluginError::invalid)?;
        w.g.mark_output(logits);
        Ok(&self.graph)
    }
}

/// How the model is quantized, in words (see [`crate::quant::describe`]), judged by `layer` (a
/// representative projection: the first layer's MLP down projection) or else the embedding.
pub fn quantization(layer: Option<&Linear>, embed: &Linear, config: Option<&Value>) -> String {
    let spec = layer.and_then(Linear::describe_quant).or_else(|| embed.describe_quant());
    crate::quant::describe(spec, config)
}

/// Rough activation bytes per token in flight: one layer's f32 values — `hidden_vectors` of the model
/// width, q, k and v of every head, and a gated MLP's gate, up and product.
pub fn activation_bytes_per_token(hidden_vectors: usize, attention: &AttentionShape, mlp_width: usize) -> u64 {
    (4 * (hidden_vectors * attention.hidden + 3 * mlp_width + attention.qkv_width())) as u64
}
