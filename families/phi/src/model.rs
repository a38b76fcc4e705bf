//! Phi-3 as an op graph, following mlx-lm's `phi3.py`.
//!
//! A Llama-shaped decoder whose projections are fused in the checkpoint: `qkv_proj` holds the rows of
//! q (all heads), then k, then v, and `gate_up_proj` the rows of gate, then up. Each part is read as a
//! row view of the one tensor (the kit's `Linear::rows`), so nothing is repacked at load. Rope turns
//! only the first `partial_rotary_factor` of each head, with LongRoPE's stretched periods when the
//! config extends the context.

use mlxcel_family_kit::rope::{step_inv_freq, su_scaled};
use mlxcel_family_kit::{
    rope_freqs, AttentionShape, GraphWriter, Linear, RopeFreqs, RopeInputs, SelfAttention, WeightRef, WeightTable,
};
use mlxcel_plugin_api::{
    DType, FamilyModel, Graph, KvKind, KvLayerDesc, ModelDescription, OpCode, OutputKind, PluginError, StepDesc, Task,
    Versioned, INPUT_OUTPUT_ROWS, INPUT_POSITIONS, INPUT_TOKENS,
};

use crate::config::{Phi3Config, RopeScaling};

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

pub struct Phi3Model {
    pub cfg: Phi3Config,
    embed: Linear,
    layers: Vec<Layer>,
    norm: WeightRef,
    /// `None` when tied to the embedding.
    lm_head: Option<Linear>,
    rope: RopeFreqs,
    kv_layers: Vec<KvLayerDesc>,
    used_weights: Vec<u32>,
    quantization: String,
    /// The most recent step's graph, owned here as the ABI requires.
    graph: Graph,
}

impl Phi3Model {
    pub fn new(cfg: Phi3Config, table: &WeightTable) -> Result<Phi3Model, String> {
        let (d, hd, inter) = (cfg.hidden_size, cfg.head_dim(), cfg.intermediate_size);
        let (nh, nkv) = (cfg.num_attention_heads, cfg.n_kv_heads());
        let q = cfg.quantization.as_ref();
        let norm = |name: String| table.float(&name, &[d as u64]);

        let embed = Linear::load(table, q, "model.embed_tokens", d, cfg.vocab_size, false)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let (nq, nk) = ((nh * hd) as u64, (nkv * hd) as u64);
            let qkv = Linear::load(table, q, &format!("{p}.self_attn.qkv_proj"), d, nh * hd + 2 * nkv * hd, false)?;
            let gate_up = Linear::load(table, q, &format!("{p}.mlp.gate_up_proj"), d, 2 * inter, false)?;
            let attn = SelfAttention {
                q: qkv.rows(0, nq)?,
                k: qkv.rows(nq, nk)?,
                v: qkv.rows(nq + nk, nk)?,
                o: Linear::load(table, q, &format!("{p}.self_attn.o_proj"), nh * hd, d, false)?,
                q_norm: None,
                k_norm: None,
                shape: AttentionShape {
                    hidden: d,
                    n_heads: nh,
                    n_kv_heads: nkv,
                    head_dim: hd,
                    qkv_bias: false,
                    o_bias: false,
                    qk_norm: false,
                    norm_plus_one: false,
                    scale: None,
                    softcap: 0.0,
                    window: 0,
                },
            };
            let mlp = Mlp {
                gate: gate_up.rows(0, inter as u64)?,
                up: gate_up.rows(inter as u64, inter as u64)?,
                down: Linear::load(table, q, &format!("{p}.mlp.down_proj"), inter, d, false)?,
            };
            layers.push(Layer {
                input_norm: norm(format!("{p}.input_layernorm.weight"))?,
                attn,
                post_attention_norm: norm(format!("{p}.post_attention_layernorm.weight"))?,
                mlp,
            });
        }
        let final_norm = norm("model.norm.weight".into())?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(Linear::load(table, q, "lm_head", d, cfg.vocab_size, false)?)
        };
        let rot = cfg.rotary_dims();
        let rope = match cfg.rope()? {
            RopeScaling::LongRope(long) => {
                su_scaled(rot, cfg.rope_theta, &long, cfg.max_position_embeddings, cfg.original_max_position_embeddings)
            }
            RopeScaling::Linear(f) => {
                rope_freqs(rot, cfg.rope_theta, Some(&serde_json::json!({"type": "linear", "factor": f})), 0)?
            }
            RopeScaling::None => rope_freqs(rot, cfg.rope_theta, None, 0)?,
        };

        let kv_layers = layers
            .iter()
            .map(|_| KvLayerDesc {
                kind: KvKind::Full as u32,
                n_kv_heads: nkv as u32,
                head_dim: hd as u32,
                ..KvLayerDesc::zeroed()
            })
            .collect();

        let mut used: Vec<u32> = embed.indices();
        for l in &layers {
            used.extend([l.input_norm.index, l.post_attention_norm.index]);
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
        Ok(Phi3Model {
            cfg,
            embed,
            layers,
            norm: final_norm,
            lm_head,
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
        let cfg = &self.cfg;
        let d = cfg.hidden_size as u64;
        let eps = cfg.rms_norm_eps;
        // mlx-lm's LongRoPE always splits halves; plain rope follows the config.
        let traditional = cfg.rope_traditional && !matches!(cfg.rope(), Ok(RopeScaling::LongRope(_)));

        let mut graph = std::mem::take(&mut self.graph);
        graph.nodes.clear();
        graph.constants.clear();
        graph.outputs.clear();
        let mut w = GraphWriter::new(&mut graph);

        let tokens = w.g.input(INPUT_TOKENS, DType::I32, &[t]);
        let positions = w.g.input(INPUT_POSITIONS, DType::I32, &[t]);
        let rope = RopeInputs {
            positions,
            inv_freq: step_inv_freq(w.g, &self.rope, step),
            params: [cfg.head_dim() as i64, cfg.rotary_dims() as i64, traditional as i64],
            mscale: self.rope.mscale,
        };

        let mut h = w.embedding(tokens, t, &self.embed);
        for (i, layer) in self.layers.iter().enumerate() {
            let x = w.rms_norm(h, &[t, d], &layer.input_norm, eps);
            let o = layer.attn.forward(&mut w, x, t, i, &rope, eps);
            h = w.g.op(OpCode::Add, &[t, d], &[h, o]);

            let x = w.rms_norm(h, &[t, d], &layer.post_attention_norm, eps);
            let inter = layer.mlp.gate.out_features;
            let gate = w.linear(x, t, &layer.mlp.gate);
            let up = w.linear(x, t, &layer.mlp.up);
            let m = w.g.op(OpCode::SiluMul, &[t, inter], &[gate, up]);
            let down = w.linear(m, t, &layer.mlp.down);
            h = w.g.op(OpCode::Add, &[t, d], &[h, down]);
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

impl FamilyModel for Phi3Model {
    fn description(&self) -> ModelDescription {
        let c = &self.cfg;
        ModelDescription {
            task: Task::Text,
            architecture: c.model_type.clone(),
            vocab_size: c.vocab_size as u64,
            hidden_size: c.hidden_size as u64,
            n_layers: c.num_hidden_layers as u32,
            max_positions: c.max_position_embeddings as u64,
            kv_layers: self.kv_layers.clone(),
            used_weights: self.used_weights.clone(),
            activation_bytes_per_token: self.activation_bytes_per_token(),
            quantization: self.quantization.clone(),
            output_kind: OutputKind::Logits,
            output_dim: c.vocab_size as u64,
        }
    }

    fn build_graph(&mut self, step: &StepDesc) -> Result<&Graph, PluginError> {
        self.forward(step).map_err(PluginError::invalid)?;
        Ok(&self.graph)
    }
}
