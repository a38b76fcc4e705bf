//! The Llama architecture (and its Mistral / Qwen2 / Qwen3 variants) as an op graph.
//!
//! Per layer: `h += o_proj(attn(rope(q), rope(k), v))` over `rms_norm(h)`, then
//! `h += down(act(gate(x)) * up(x))` over `rms_norm(h)`. Qwen2 adds q/k/v biases, Qwen3 adds a per-head
//! RMS norm on q and k; both are flags on [`Variant`], not copies of this file.
//!
//! As an embedding model (Qwen3-Embedding: sentence-transformers metadata beside the weights), each
//! sequence is whole in its step and attends causally among its own tokens without a KV cache; the
//! final-norm rows are pooled (the last token's) and L2-normalised instead of projected to logits.

use mlxcel_family_kit::rope::step_inv_freq;
use mlxcel_family_kit::{
    rope_freqs, AttentionShape, EmbeddingHead, GraphWriter, Linear, RopeFreqs, RopeInputs, SelfAttention, WeightRef,
    WeightTable,
};
use mlxcel_plugin_api::{
    DType, FamilyModel, Graph, KvKind, KvLayerDesc, ModelDescription, OpCode, OutputKind, PluginError, StepDesc, Task,
    Versioned, INPUT_OUTPUT_ROWS, INPUT_POSITIONS, INPUT_TOKENS, INPUT_TOKEN_SEQ,
};

use crate::config::{LlamaConfig, Variant};

struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

struct Layer {
    input_norm: WeightRef,
    attn: SelfAttention,
    post_attention_norm: WeightRef,
    mlp: Mlp,
}

pub struct LlamaModel {
    pub cfg: LlamaConfig,
    embed: Linear,
    layers: Vec<Layer>,
    norm: WeightRef,
    /// `None` when tied to the embedding, or for an embedding model.
    lm_head: Option<Linear>,
    /// Set for an embedding model: its pooling replaces the vocabulary projection.
    embedding: Option<EmbeddingHead>,
    rope: RopeFreqs,
    kv_layers: Vec<KvLayerDesc>,
    used_weights: Vec<u32>,
    quantization: String,
    /// The most recent step's graph, owned here as the ABI requires.
    graph: Graph,
}

impl LlamaModel {
    pub fn new(cfg: LlamaConfig, table: &WeightTable) -> Result<LlamaModel, String> {
        let Variant { qkv_bias, o_bias, qk_norm } = cfg.variant();
        let (d, hd) = (cfg.hidden_size, cfg.head_dim());
        let (nh, nkv) = (cfg.num_attention_heads, cfg.n_kv_heads());
        let q = cfg.quantization.as_ref();
        let norm = |name: String, n: usize| table.float(&name, &[n as u64]);

        let embed = Linear::load(table, q, "model.embed_tokens", d, cfg.vocab_size, false)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let shape = AttentionShape {
                hidden: d,
                n_heads: nh,
                n_kv_heads: nkv,
                head_dim: hd,
                qkv_bias,
                o_bias,
                qk_norm,
                norm_plus_one: false,
                scale: None,
                softcap: 0.0,
                window: cfg.layer_window(i),
            };
            let attn = SelfAttention::load(table, q, &format!("{p}.self_attn"), shape)?;
            let mlp = Mlp {
                gate: Linear::load(table, q, &format!("{p}.mlp.gate_proj"), d, cfg.intermediate_size, cfg.mlp_bias)?,
                up: Linear::load(table, q, &format!("{p}.mlp.up_proj"), d, cfg.intermediate_size, cfg.mlp_bias)?,
                down: Linear::load(table, q, &format!("{p}.mlp.down_proj"), cfg.intermediate_size, d, cfg.mlp_bias)?,
            };
            layers.push(Layer {
                input_norm: norm(format!("{p}.input_layernorm.weight"), d)?,
                attn,
                post_attention_norm: norm(format!("{p}.post_attention_layernorm.weight"), d)?,
                mlp,
            });
        }
        let final_norm = norm("model.norm.weight".into(), d)?;
        let embedding = cfg.embedding()?;
        let lm_head = if cfg.tied_embeddings() || embedding.is_some() {
            None
        } else {
            Some(Linear::load(table, q, "lm_head", d, cfg.vocab_size, false)?)
        };
        let max_pos = cfg.max_position_embeddings.unwrap_or(4096);
        let rope = rope_freqs(hd, cfg.rope_base(), cfg.rope_scaling(), max_pos)?;

        let kv_layers = layers
            .iter()
            .map(|l| KvLayerDesc {
                kind: if l.attn.shape.window > 0 { KvKind::SlidingWindow } else { KvKind::Full } as u32,
                n_kv_heads: nkv as u32,
                head_dim: hd as u32,
                window: l.attn.shape.window as u32,
                ..KvLayerDesc::zeroed()
            })
            .collect();

        let mut used: Vec<u32> = embed.indices();
        for l in &layers {
            used.push(l.input_norm.index);
            used.push(l.post_attention_norm.index);
            used.extend(l.attn.indices());
            for lin in [&l.mlp.gate, &l.mlp.up, &l.mlp.down] {
                used.extend(lin.indices());
            }
        }
        used.push(final_norm.index);
        if let Some(h) = &lm_head {
            used.extend(h.indices());
        }
        used.sort_unstable();
        used.dedup();

        let first = layers.first().and_then(|l| l.mlp.down.describe_quant()).or_else(|| embed.describe_quant());
        let quantization = mlxcel_family_kit::quant::describe(first, cfg.quantization.as_ref());
        Ok(LlamaModel {
            cfg,
            embed,
            layers,
            norm: final_norm,
            lm_head,
            embedding,
            rope,
            kv_layers,
            used_weights: used,
            quantization,
            graph: Graph::new(),
        })
    }

    /// Rough activation bytes per token in flight (f32 activations of one layer plus logits rows).
    pub fn activation_bytes_per_token(&self) -> u64 {
        let c = &self.cfg;
        let per =
            4 * c.hidden_size + 3 * c.intermediate_size + (c.num_attention_heads + 2 * c.n_kv_heads()) * c.head_dim();
        (per * 4) as u64
    }

    /// The forward pass of one step.
    fn forward(&mut self, step: &StepDesc) -> Result<(), String> {
        let t = step.n_tokens as u64;
        let r = step.n_output_rows as u64;
        if t == 0 {
            return Err("a step needs at least one token".into());
        }
        if self.embedding.is_some() {
            mlxcel_family_kit::embedding::check_whole_sequences(step)?;
        }
        let cfg = &self.cfg;
        let (d, hd) = (cfg.hidden_size as u64, cfg.head_dim() as u64);
        let eps = cfg.rms_norm_eps;

        let mut graph = std::mem::take(&mut self.graph);
        graph.nodes.clear();
        graph.constants.clear();
        graph.outputs.clear();
        let mut w = GraphWriter::new(&mut graph);

        let tokens = w.g.input(INPUT_TOKENS, DType::I32, &[t]);
        let positions = w.g.input(INPUT_POSITIONS, DType::I32, &[t]);
        let inv_freq = step_inv_freq(w.g, &self.rope, step);
        let rope = RopeInputs {
            positions,
            inv_freq,
            params: [hd as i64, hd as i64, cfg.rope_traditional as i64],
            mscale: self.rope.mscale,
        };

        // An embedding model's sequences are whole in the step: attention among their own tokens.
        let seq = self.embedding.map(|_| w.g.input(INPUT_TOKEN_SEQ, DType::I32, &[t]));
        let mut h = w.embedding(tokens, t, &self.embed);
        for (i, layer) in self.layers.iter().enumerate() {
            let x = w.rms_norm(h, &[t, d], &layer.input_norm, eps);
            let o = match seq {
                Some(seq) => layer.attn.forward_in_step(&mut w, x, t, seq, &rope, eps),
                None => layer.attn.forward(&mut w, x, t, i, &rope, eps),
            };
            h = w.g.op(OpCode::Add, &[t, d], &[h, o]);

            let x = w.rms_norm(h, &[t, d], &layer.post_attention_norm, eps);
            let inter = layer.mlp.gate.out_features;
            let gate = w.linear(x, t, &layer.mlp.gate);
            let up = w.linear(x, t, &layer.mlp.up);
            let act = if cfg.gelu() { OpCode::GeluTanhMul } else { OpCode::SiluMul };
            let m = w.g.op(act, &[t, inter], &[gate, up]);
            let down = w.linear(m, t, &layer.mlp.down);
            h = w.g.op(OpCode::Add, &[t, d], &[h, down]);
        }

        if let (Some(head), Some(seq)) = (&self.embedding, seq) {
            let h = w.rms_norm(h, &[t, d], &self.norm, eps);
            let out = head.forward(&mut w, h, seq, step.n_seqs as u64, d);
            w.g.mark_output(out);
            self.graph = graph;
            return Ok(());
        }
        // Only the rows that need logits go through the final norm and the vocabulary projection.
        let rows = w.g.input(INPUT_OUTPUT_ROWS, DType::I32, &[r]);
        let h = w.g.op(OpCode::GetRows, &[r, d], &[h, rows]);
        let h = w.rms_norm(h, &[r, d], &self.norm, eps);
        let logits = w.linear(h, r, self.lm_head.as_ref().unwrap_or(&self.embed));
        w.g.mark_output(logits);
        self.graph = graph;
        Ok(())
    }
}

impl FamilyModel for LlamaModel {
    fn description(&self) -> ModelDescription {
        let c = &self.cfg;
        let embeds = self.embedding.is_some();
        ModelDescription {
            task: if embeds { Task::Embed } else { Task::Text },
            architecture: c.model_type.clone(),
            vocab_size: c.vocab_size as u64,
            hidden_size: c.hidden_size as u64,
            n_layers: c.num_hidden_layers as u32,
            max_positions: c.max_position_embeddings.unwrap_or(4096) as u64,
            kv_layers: if embeds { Vec::new() } else { self.kv_layers.clone() },
            used_weights: self.used_weights.clone(),
            activation_bytes_per_token: self.activation_bytes_per_token(),
            quantization: self.quantization.clone(),
            output_kind: if embeds { OutputKind::Embeddings } else { OutputKind::Logits },
            output_dim: if embeds { c.hidden_size } else { c.vocab_size } as u64,
        }
    }

    fn build_graph(&mut self, step: &StepDesc) -> Result<&Graph, PluginError> {
        self.forward(step).map_err(PluginError::invalid)?;
        Ok(&self.graph)
    }
}
