//! GLM-4 (`glm4`, the GLM-4-0414 models) as an op graph, following mlx-lm's `glm4.py`.
//!
//! Per layer, four RMS norms around two blocks: `h += post_self_attn_norm(attn(input_norm(h)))`, then
//! `h += post_mlp_norm(down(silu(gate) * up))` over `post_attention_norm(h)`, the gate and up rows
//! read from the one fused `gate_up_proj` (row views, no repacking). q/k/v carry biases; rope turns
//! the first `partial_rotary_factor` of each head with interleaved pairs; the head is never tied.

use mlxcel_family_kit::rope::step_inv_freq;
use mlxcel_family_kit::{
    rope_freqs, AttentionShape, GraphWriter, Linear, RopeFreqs, RopeInputs, SelfAttention, WeightRef, WeightTable,
};
use mlxcel_plugin_api::{
    DType, FamilyModel, Graph, KvKind, KvLayerDesc, ModelDescription, OpCode, OutputKind, PluginError, StepDesc, Task,
    Versioned, INPUT_OUTPUT_ROWS, INPUT_POSITIONS, INPUT_TOKENS,
};

use crate::config::Glm4Config;

struct Mlp {
    /// The fused `gate_up_proj`; `gate` and `up` are its row halves.
    gate_up: Linear,
    gate: Linear,
    up: Linear,
    down: Linear,
}

struct Layer {
    input_norm: WeightRef,
    attn: SelfAttention,
    post_self_attn_norm: WeightRef,
    post_attention_norm: WeightRef,
    mlp: Mlp,
    post_mlp_norm: WeightRef,
}

pub struct Glm4Model {
    pub cfg: Glm4Config,
    embed: Linear,
    layers: Vec<Layer>,
    norm: WeightRef,
    lm_head: Linear,
    rope: RopeFreqs,
    kv_layers: Vec<KvLayerDesc>,
    used_weights: Vec<u32>,
    quantization: String,
    /// The most recent step's graph, owned here as the ABI requires.
    graph: Graph,
}

impl Glm4Model {
    pub fn new(cfg: Glm4Config, table: &WeightTable) -> Result<Glm4Model, String> {
        let (d, hd, inter) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
        let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let q = cfg.quantization.as_ref();
        let norm = |name: String| table.float(&name, &[d as u64]);

        let embed = Linear::load(table, q, "model.embed_tokens", d, cfg.vocab_size, false)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let shape = AttentionShape {
                hidden: d,
                n_heads: nh,
                n_kv_heads: nkv,
                head_dim: hd,
                qkv_bias: cfg.attention_bias,
                o_bias: false,
                qk_norm: false,
                norm_plus_one: false,
                scale: None,
                softcap: 0.0,
                window: 0,
            };
            let attn = SelfAttention::load(table, q, &format!("{p}.self_attn"), shape)?;
            let gate_up = Linear::load(table, q, &format!("{p}.mlp.gate_up_proj"), d, 2 * inter, false)?;
            let mlp = Mlp {
                gate: gate_up.rows(0, inter as u64)?,
                up: gate_up.rows(inter as u64, inter as u64)?,
                gate_up,
                down: Linear::load(table, q, &format!("{p}.mlp.down_proj"), inter, d, false)?,
            };
            layers.push(Layer {
                input_norm: norm(format!("{p}.input_layernorm.weight"))?,
                attn,
                post_self_attn_norm: norm(format!("{p}.post_self_attn_layernorm.weight"))?,
                post_attention_norm: norm(format!("{p}.post_attention_layernorm.weight"))?,
                mlp,
                post_mlp_norm: norm(format!("{p}.post_mlp_layernorm.weight"))?,
            });
        }
        let final_norm = norm("model.norm.weight".into())?;
        let lm_head = Linear::load(table, q, "lm_head", d, cfg.vocab_size, false)?;
        let rope = rope_freqs(cfg.rotary_dims(), cfg.rope_theta, None, cfg.max_position_embeddings)?;

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
            let norms = [&l.input_norm, &l.post_self_attn_norm, &l.post_attention_norm, &l.post_mlp_norm];
            used.extend(norms.map(|w| w.index));
            used.extend(l.attn.indices());
            for lin in [&l.mlp.gate_up, &l.mlp.down] {
                used.extend(lin.indices());
            }
        }
        used.push(final_norm.index);
        used.extend(lm_head.indices());
        used.sort_unstable();
        used.dedup();

        let first = layers.first().and_then(|l| l.mlp.down.describe_quant()).or_else(|| embed.describe_quant());
        let quantization = mlxcel_family_kit::quant::describe(first, cfg.quantization.as_ref());
        Ok(Glm4Model {
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
        let per = 5 * c.hidden_size
            + 3 * c.intermediate_size
            + (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim;
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
            params: [cfg.head_dim as i64, cfg.rotary_dims() as i64, cfg.rope_traditional as i64],
            mscale: self.rope.mscale,
        };

        let mut h = w.embedding(tokens, t, &self.embed);
        for (i, layer) in self.layers.iter().enumerate() {
            let x = w.rms_norm(h, &[t, d], &layer.input_norm, eps);
            let o = layer.attn.forward(&mut w, x, t, i, &rope, eps);
            let o = w.rms_norm(o, &[t, d], &layer.post_self_attn_norm, eps);
            h = w.g.op(OpCode::Add, &[t, d], &[h, o]);

            let x = w.rms_norm(h, &[t, d], &layer.post_attention_norm, eps);
            let inter = layer.mlp.gate.out_features;
            let gate = w.linear(x, t, &layer.mlp.gate);
            let up = w.linear(x, t, &layer.mlp.up);
            let m = w.g.op(OpCode::SiluMul, &[t, inter], &[gate, up]);
            let down = w.linear(m, t, &layer.mlp.down);
            let down = w.rms_norm(down, &[t, d], &layer.post_mlp_norm, eps);
            h = w.g.op(OpCode::Add, &[t, d], &[h, down]);
        }

        // Only the rows that need logits go through the final norm and the vocabulary projection.
        let rows = w.g.input(INPUT_OUTPUT_ROWS, DType::I32, &[r]);
        let h = w.g.op(OpCode::GetRows, &[r, d], &[h, rows]);
        let h = w.rms_norm(h, &[r, d], &self.norm, eps);
        let logits = w.linear(h, r, &self.lm_head);
        w.g.mark_output(logits);
        self.graph = graph;
        Ok(())
    }
}

impl FamilyModel for Glm4Model {
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
