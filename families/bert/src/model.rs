//! BERT / (XLM-)RoBERTa encoders as an op graph.
//!
//! Embeddings: `LayerNorm(word[id] + position[pos + offset] + token_type[type])`. Per layer (post-norm):
//! `h = LayerNorm(h + dense(attn(q, k, v)))` with bidirectional attention among each sequence's own
//! tokens, then `h = LayerNorm(h + out(act(intermediate(h))))`. Then one row per sequence: pooled
//! (mean / CLS / last token, optionally L2-normalised) for embeddings, or a classifier on the first
//! token for cross-encoders. RoBERTa differs only in its position offset (`pad_token_id + 1`) and its
//! classifier head: flags on the config, not a copy of this file.
//!
//! Every sequence is whole in its step (an encoder keeps no state between steps), so a step's rows are
//! exactly its sequences' tokens, without padding.

use mlxcel_family_kit::{GraphWriter, Linear, WeightRef, WeightTable, Weights};
use mlxcel_plugin_api::{
    DType, FamilyModel, Graph, ModelDescription, OpCode, OutputKind, PluginError, StepDesc, Task, TensorId,
    INPUT_POSITIONS, INPUT_TOKENS, INPUT_TOKEN_SEQ, INPUT_TOKEN_TYPES, POOL_FIRST, POOL_LAST, POOL_MEAN,
};

use crate::config::{BertConfig, Head, Pooling};

/// A layer norm's scale and shift.
struct Norm {
    weight: WeightRef,
    bias: WeightRef,
}

impl Norm {
    fn load(table: &WeightTable, path: &str, d: usize) -> Result<Norm, String> {
        let d = d as u64;
        Ok(Norm {
            weight: table.float(&format!("{path}.weight"), &[d])?,
            bias: table.float(&format!("{path}.bias"), &[d])?,
        })
    }

    fn forward(&self, w: &mut GraphWriter, x: TensorId, shape: &[u64], eps: f32) -> TensorId {
        let (g, b) = (w.weight(&self.weight), w.weight(&self.bias));
        w.g.op_with(OpCode::LayerNorm, shape, &[x, g, b], &[], &[eps])
    }
}

struct Layer {
    query: Linear,
    key: Linear,
    value: Linear,
    attn_out: Linear,
    attn_norm: Norm,
    intermediate: Linear,
    output: Linear,
    output_norm: Norm,
}

/// The head's weights (see [`Head`]). One per model, so the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum HeadWeights {
    Embedding {
        pooling: Pooling,
        normalize: bool,
    },
    /// BERT: `classifier(tanh(pooler(cls)))`; RoBERTa: `out_proj(tanh(dense(cls)))`. Same shape.
    Classifier {
        dense: Linear,
        out: Linear,
    },
}

pub struct BertModel {
    pub cfg: BertConfig,
    word: Linear,
    position: WeightRef,
    token_type: WeightRef,
    embed_norm: Norm,
    layers: Vec<Layer>,
    head_weights: HeadWeights,
    used_weights: Vec<u32>,
    /// The most recent step's graph, owned here as the ABI requires.
    graph: Graph,
}

/// The prefix of the encoder's tensors: none for a bare `BertModel` save, `bert.` / `roberta.` inside
/// a task model.
fn encoder_prefix(table: &WeightTable) -> Result<&'static str, String> {
    ["", "bert.", "roberta.", "model."]
        .into_iter()
        .find(|p| table.get(&format!("{p}embeddings.word_embeddings.weight")).is_some())
        .ok_or_else(|| "checkpoint has no `embeddings.word_embeddings.weight` (with or without a prefix)".into())
}

impl BertModel {
    pub fn new(cfg: BertConfig, table: &WeightTable) -> Result<BertModel, String> {
        let (d, inter) = (cfg.hidden_size, cfg.intermediate_size);
        let q = cfg.quantization.as_ref();
        let p = encoder_prefix(table)?;
        let lin = |path: String, i: usize, o: usize| Linear::load(table, q, &path, i, o, true);

        let word = Linear::load(table, q, &format!("{p}embeddings.word_embeddings"), d, cfg.vocab_size, false)?;
        let position = table.float(
            &format!("{p}embeddings.position_embeddings.weight"),
            &[cfg.max_position_embeddings as u64, d as u64],
        )?;
        let token_type = table
            .float(&format!("{p}embeddings.token_type_embeddings.weight"), &[cfg.type_vocab_size as u64, d as u64])?;
        let embed_norm = Norm::load(table, &format!("{p}embeddings.LayerNorm"), d)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let l = format!("{p}encoder.layer.{i}");
            layers.push(Layer {
                query: lin(format!("{l}.attention.self.query"), d, d)?,
                key: lin(format!("{l}.attention.self.key"), d, d)?,
                value: lin(format!("{l}.attention.self.value"), d, d)?,
                attn_out: lin(format!("{l}.attention.output.dense"), d, d)?,
                attn_norm: Norm::load(table, &format!("{l}.attention.output.LayerNorm"), d)?,
                intermediate: lin(format!("{l}.intermediate.dense"), d, inter)?,
                output: lin(format!("{l}.output.dense"), inter, d)?,
                output_norm: Norm::load(table, &format!("{l}.output.LayerNorm"), d)?,
            });
        }
        let labels = cfg.labels();
        let head_weights = match cfg.head()? {
            Head::Embedding { pooling, normalize } => HeadWeights::Embedding { pooling, normalize },
            Head::BertClassifier => HeadWeights::Classifier {
                dense: lin(format!("{p}pooler.dense"), d, d)?,
                out: lin("classifier".into(), d, labels)?,
            },
            Head::RobertaClassifier => HeadWeights::Classifier {
                dense: lin("classifier.dense".into(), d, d)?,
                out: lin("classifier.out_proj".into(), d, labels)?,
            },
        };

        let mut used: Vec<u32> = word.indices();
        used.extend([position.index, token_type.index, embed_norm.weight.index, embed_norm.bias.index]);
        for l in &layers {
            for lin in [&l.query, &l.key, &l.value, &l.attn_out, &l.intermediate, &l.output] {
                used.extend(lin.indices());
            }
            for n in [&l.attn_norm, &l.output_norm] {
                used.extend([n.weight.index, n.bias.index]);
            }
        }
        if let HeadWeights::Classifier { dense, out } = &head_weights {
            used.extend(dense.indices());
            used.extend(out.indices());
        }
        used.sort_unstable();
        used.dedup();
        Ok(BertModel {
            cfg,
            word,
            position,
            token_type,
            embed_norm,
            layers,
            head_weights,
            used_weights: used,
            graph: Graph::new(),
        })
    }

    /// Floats per output row: the hidden size for embeddings, the labels for a classifier.
    fn output_dim(&self) -> u64 {
        match &self.head_weights {
            HeadWeights::Embedding { .. } => self.cfg.hidden_size as u64,
            HeadWeights::Classifier { out, .. } => out.out_features,
        }
    }

    /// Rough activation bytes per token in flight (one layer's f32 rows).
    fn activation_bytes_per_token(&self) -> u64 {
        let c = &self.cfg;
        ((8 * c.hidden_size + 2 * c.intermediate_size) * 4) as u64
    }

    /// Refuses steps an encoder cannot run: a sequence split over steps, or longer than the positions.
    fn check_step(&self, step: &StepDesc) -> Result<(), String> {
        if step.n_tokens == 0 {
            return Err("a step needs at least one token".into());
        }
        if step.n_output_rows != step.n_seqs {
            return Err(format!(
                "an encoder outputs one row per sequence: the step asks for {} rows from {} sequences",
                step.n_output_rows, step.n_seqs
            ));
        }
        // SAFETY: the host gives arrays of `n_seqs` entries (the ABI's contract for `StepDesc`).
        let (n, ctx) = unsafe { (step.seq_n_tokens(), step.seq_context()) };
        for (s, (&n, &ctx)) in n.iter().zip(ctx).enumerate() {
            if n == 0 || n != ctx {
                return Err(format!(
                    "sequence {s} must be whole in its step (an encoder keeps no state): {n} tokens, context {ctx}"
                ));
            }
            if n as usize > self.cfg.max_tokens() {
                return Err(format!("sequence {s} has {n} tokens; the model takes at most {}", self.cfg.max_tokens()));
            }
        }
        Ok(())
    }

    /// The forward pass of one step.
    fn forward(&mut self, step: &StepDesc) -> Result<(), String> {
        self.check_step(step)?;
        let cfg = &self.cfg;
        let (t, n) = (step.n_tokens as u64, step.n_seqs as u64);
        let (d, inter, hd) = (cfg.hidden_size as u64, cfg.intermediate_size as u64, cfg.head_dim() as i64);
        let nh = cfg.num_attention_heads as i64;
        let eps = cfg.layer_norm_eps;
        let act = cfg.activation()?;

        let mut graph = std::mem::take(&mut self.graph);
        graph.nodes.clear();
        graph.constants.clear();
        graph.outputs.clear();
        let mut w = GraphWriter::new(&mut graph);

        let tokens = w.g.input(INPUT_TOKENS, DType::I32, &[t]);
        let positions = w.g.input(INPUT_POSITIONS, DType::I32, &[t]);
        let types = w.g.input(INPUT_TOKEN_TYPES, DType::I32, &[t]);
        let seq = w.g.input(INPUT_TOKEN_SEQ, DType::I32, &[t]);

        // Positions count from 0 in each sequence; RoBERTa's table starts them at `offset`, so the
        // embedding reads a row view of the table beginning there.
        let off = cfg.position_offset() as u64;
        let stored = cfg.max_position_embeddings as u64;
        let pos_table = if off == 0 {
            w.weight(&self.position)
        } else {
            w.g.weight_rows(self.position.index, self.position.dtype, stored, off, stored - off, d)
        };
        let word = w.embedding(tokens, t, &self.word);
        let pos = w.g.op(OpCode::Embedding, &[t, d], &[positions, pos_table]);
        let type_table = w.weight(&self.token_type);
        let typ = w.g.op(OpCode::Embedding, &[t, d], &[types, type_table]);
        let e = w.g.op(OpCode::Add, &[t, d], &[word, pos]);
        let e = w.g.op(OpCode::Add, &[t, d], &[e, typ]);
        let mut h = self.embed_norm.forward(&mut w, e, &[t, d], eps);

        let scale = 1.0 / (hd as f32).sqrt();
        for l in &self.layers {
            let q = w.linear(h, t, &l.query);
            let k = w.linear(h, t, &l.key);
            let v = w.linear(h, t, &l.value);
            let a = w.g.op_with(OpCode::StepAttention, &[t, d], &[q, k, v, seq], &[nh, nh, hd, 0, 0], &[scale, 0.0]);
            let o = w.linear(a, t, &l.attn_out);
            let x = w.g.op(OpCode::Add, &[t, d], &[h, o]);
            h = l.attn_norm.forward(&mut w, x, &[t, d], eps);

            let i = w.linear(h, t, &l.intermediate);
            let i = w.g.op(act, &[t, inter], &[i]);
            let o = w.linear(i, t, &l.output);
            let x = w.g.op(OpCode::Add, &[t, d], &[h, o]);
            h = l.output_norm.forward(&mut w, x, &[t, d], eps);
        }

        let out = match &self.head_weights {
            HeadWeights::Embedding { pooling, normalize } => {
                let mode = match pooling {
                    Pooling::Mean => POOL_MEAN,
                    Pooling::Cls => POOL_FIRST,
                    Pooling::LastToken => POOL_LAST,
                };
                let pooled = w.g.op_with(OpCode::SegmentPool, &[n, d], &[h, seq], &[mode], &[]);
                if *normalize {
                    w.g.op_with(OpCode::L2Normalize, &[n, d], &[pooled], &[], &[1e-12])
                } else {
                    pooled
                }
            }
            HeadWeights::Classifier { dense, out } => {
                let cls = w.g.op_with(OpCode::SegmentPool, &[n, d], &[h, seq], &[POOL_FIRST], &[]);
                let x = w.linear(cls, n, dense);
                // tanh(x) = 1 · tanh(x / 1): a soft-cap of 1.
                let x = w.g.op_with(OpCode::Softcap, &[n, d], &[x], &[], &[1.0]);
                w.linear(x, n, out)
            }
        };
        w.g.mark_output(out);
        self.graph = graph;
        Ok(())
    }
}

impl FamilyModel for BertModel {
    fn description(&self) -> ModelDescription {
        let c = &self.cfg;
        let (task, output_kind) = match self.head_weights {
            HeadWeights::Embedding { .. } => (Task::Embed, OutputKind::Embeddings),
            HeadWeights::Classifier { .. } => (Task::Rerank, OutputKind::Scores),
        };
        ModelDescription {
            task,
            architecture: c.model_type.clone(),
            vocab_size: c.vocab_size as u64,
            hidden_size: c.hidden_size as u64,
            n_layers: c.num_hidden_layers as u32,
            max_positions: c.max_tokens() as u64,
            kv_layers: Vec::new(),
            used_weights: self.used_weights.clone(),
            activation_bytes_per_token: self.activation_bytes_per_token(),
            quantization: self
                .word
                .describe_quant()
                .map_or_else(String::new, |s| format!("affine {}-bit g{}", s.bits, s.group_size)),
            output_kind,
            output_dim: self.output_dim(),
        }
    }

    fn build_graph(&mut self, step: &StepDesc) -> Result<&Graph, PluginError> {
        self.forward(step).map_err(PluginError::invalid)?;
        Ok(&self.graph)
    }
}
