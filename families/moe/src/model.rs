//! Qwen2-MoE and Qwen3-MoE as an op graph.
//!
//! Per layer: `h += o_proj(attn(rope(q), rope(k), v))` over `rms_norm(h)` (Qwen2-MoE: q/k/v biases;
//! Qwen3-MoE: per-head q/k RMS norm), then `h += moe(rms_norm(h))`, where
//! `moe(x) = Σ_j p_j · down_j(silu(gate_j x) · up_j x)` over the `k` experts of highest router
//! probability `p = softmax(router(x))` (divided by their sum with `norm_topk_prob`), each expert
//! computing only the tokens routed to it; Qwen2-MoE adds `sigmoid(shared_gate(x)) · shared(x)`.
//! Layers listed in `mlp_only_layers` (or off the `decoder_sparse_step`) have a dense MLP instead.

use mlxcel_family_kit::rope::step_inv_freq;
use mlxcel_family_kit::{
    rope_freqs, AttentionShape, Experts, GraphWriter, Linear, RopeFreqs, RopeInputs, SelfAttention, WeightRef,
    WeightTable,
};
use mlxcel_plugin_api::{
    DType, FamilyModel, Graph, KvKind, KvLayerDesc, ModelDescription, OpCode, OutputKind, PluginError, StepDesc, Task,
    TensorId, Versioned, INPUT_OUTPUT_ROWS, INPUT_POSITIONS, INPUT_TOKENS,
};

use crate::config::MoeConfig;

/// SwiGLU: `down(silu(gate(x)) · up(x))`.
struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

struct SparseMoe {
    router: Linear,
    gate: Experts,
    up: Experts,
    down: Experts,
    /// Qwen2-MoE: an MLP every token takes, scaled by `sigmoid(shared_gate(x))`.
    shared: Option<(Mlp, Linear)>,
}

// One per layer, built once: the size of the variants does not matter.
#[allow(clippy::large_enum_variant)]
enum FeedForward {
    Dense(Mlp),
    Sparse(SparseMoe),
}

struct Layer {
    input_norm: WeightRef,
    attn: SelfAttention,
    post_attention_norm: WeightRef,
    ffn: FeedForward,
}

pub struct MoeModel {
    pub cfg: MoeConfig,
    embed: Linear,
    layers: Vec<Layer>,
    norm: WeightRef,
    /// `None` when tied to the embedding.
    lm_head: Option<Linear>,
    rope: RopeFreqs,
    used_weights: Vec<u32>,
    quantization: String,
    /// The most recent step's graph, owned here as the ABI requires.
    graph: Graph,
}

impl Mlp {
    fn load(table: &WeightTable, cfg: &MoeConfig, path: &str, width: usize) -> Result<Mlp, String> {
        let (q, d) = (cfg.quantization.as_ref(), cfg.hidden_size);
        Ok(Mlp {
            gate: Linear::load(table, q, &format!("{path}.gate_proj"), d, width, false)?,
            up: Linear::load(table, q, &format!("{path}.up_proj"), d, width, false)?,
            down: Linear::load(table, q, &format!("{path}.down_proj"), width, d, false)?,
        })
    }

    fn indices(&self) -> Vec<u32> {
        [&self.gate, &self.up, &self.down].iter().flat_map(|l| l.indices()).collect()
    }

    fn forward(&self, w: &mut GraphWriter, x: TensorId, t: u64) -> TensorId {
        let gate = w.linear(x, t, &self.gate);
        let up = w.linear(x, t, &self.up);
        let m = w.g.op(OpCode::SiluMul, &[t, self.gate.out_features], &[gate, up]);
        w.linear(m, t, &self.down)
    }
}

impl SparseMoe {
    fn load(table: &WeightTable, cfg: &MoeConfig, path: &str) -> Result<SparseMoe, String> {
        let (q, d, e, inter) = (cfg.quantization.as_ref(), cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size);
        let shared = if cfg.shared_expert_intermediate_size > 0 {
            let mlp = Mlp::load(table, cfg, &format!("{path}.shared_expert"), cfg.shared_expert_intermediate_size)?;
            let gate = Linear::load(table, q, &format!("{path}.shared_expert_gate"), d, 1, false)?;
            Some((mlp, gate))
        } else {
            None
        };
        Ok(SparseMoe {
            router: Linear::load(table, q, &format!("{path}.gate"), d, e, false)?,
            gate: Experts::load(table, q, path, "gate_proj", e, d, inter)?,
            up: Experts::load(table, q, path, "up_proj", e, d, inter)?,
            down: Experts::load(table, q, path, "down_proj", e, inter, d)?,
            shared,
        })
    }

    fn indices(&self) -> Vec<u32> {
        let mut v = self.router.indices();
        for e in [&self.gate, &self.up, &self.down] {
            v.extend(e.indices());
        }
        if let Some((mlp, gate)) = &self.shared {
            v.extend(mlp.indices());
            v.extend(gate.indices());
        }
        v
    }

    fn forward(&self, w: &mut GraphWriter, x: TensorId, t: u64, k: u64, renormalize: bool) -> TensorId {
        let d = self.down.out_features;
        let logits = w.linear(x, t, &self.router);
        let routes = w.route(logits, t, k, renormalize);
        let gate = w.experts(x, t, routes, &self.gate);
        let up = w.experts(x, t, routes, &self.up);
        let m = w.g.op(OpCode::SiluMul, &[t, k, self.gate.out_features], &[gate, up]);
        let y = w.experts(m, t, routes, &self.down);
        let y = w.combine(y, routes.weights, t, d);
        let Some((mlp, shared_gate)) = &self.shared else { return y };
        let s = mlp.forward(w, x, t);
        let g = w.linear(x, t, shared_gate);
        let g = w.g.op(OpCode::Sigmoid, &[t, 1], &[g]);
        let s = w.combine(s, g, t, d);
        w.g.op(OpCode::Add, &[t, d], &[y, s])
    }
}

impl MoeModel {
    pub fn new(cfg: MoeConfig, table: &WeightTable) -> Result<MoeModel, String> {
        let (d, hd) = (cfg.hidden_size, cfg.head_dim());
        let (nh, nkv) = (cfg.num_attention_heads, cfg.n_kv_heads());
        let q = cfg.quantization.as_ref();
        let norm = |name: String, n: usize| table.float(&name, &[n as u64]);
        let bias = cfg.qkv_bias();

        let embed = Linear::load(table, q, "model.embed_tokens", d, cfg.vocab_size, false)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let shape = AttentionShape {
                hidden: d,
                n_heads: nh,
                n_kv_heads: nkv,
                head_dim: hd,
                qkv_bias: bias,
                o_bias: false,
                qk_norm: cfg.qk_norm(),
                norm_plus_one: false,
                scale: None,
                softcap: 0.0,
                window: 0,
            };
            let attn = SelfAttention::load(table, q, &format!("{p}.self_attn"), shape)?;
            let ffn = if cfg.sparse_layer(i) {
                FeedForward::Sparse(SparseMoe::load(table, &cfg, &format!("{p}.mlp"))?)
            } else {
                FeedForward::Dense(Mlp::load(table, &cfg, &format!("{p}.mlp"), cfg.intermediate_size)?)
            };
            layers.push(Layer {
                input_norm: norm(format!("{p}.input_layernorm.weight"), d)?,
                attn,
                post_attention_norm: norm(format!("{p}.post_attention_layernorm.weight"), d)?,
                ffn,
            });
        }
        let final_norm = norm("model.norm.weight".into(), d)?;
        let lm_head = if cfg.tied_embeddings() {
            None
        } else {
            Some(Linear::load(table, q, "lm_head", d, cfg.vocab_size, false)?)
        };
        let max_pos = cfg.max_position_embeddings.unwrap_or(4096);
        let scaling = cfg.rope_scaling.as_ref().filter(|v| !v.is_null());
        let rope = rope_freqs(hd, cfg.rope_theta, scaling, max_pos)?;

        let mut used: Vec<u32> = embed.indices();
        for l in &layers {
            used.extend([l.input_norm.index, l.post_attention_norm.index]);
            used.extend(l.attn.indices());
            used.extend(match &l.ffn {
                FeedForward::Dense(m) => m.indices(),
                FeedForward::Sparse(m) => m.indices(),
            });
        }
        used.push(final_norm.index);
        if let Some(h) = &lm_head {
            used.extend(h.indices());
        }
        used.sort_unstable();
        used.dedup();

        let quantization = describe_quantization(&embed, &layers);
        Ok(MoeModel {
            cfg,
            embed,
            layers,
            norm: final_norm,
            lm_head,
            rope,
            used_weights: used,
            quantization,
            graph: Graph::new(),
        })
    }

    /// Rough activation bytes per token in flight: one layer's f32 activations (the `k` experts' rows
    /// and the dense or shared MLP) plus attention.
    pub fn activation_bytes_per_token(&self) -> u64 {
        let c = &self.cfg;
        let experts = 3 * c.num_experts_per_tok * c.moe_intermediate_size + c.num_experts_per_tok * c.hidden_size;
        let mlp = 3 * c.intermediate_size.max(c.shared_expert_intermediate_size);
        let per = 4 * c.hidden_size + experts + mlp + (c.num_attention_heads + 2 * c.n_kv_heads()) * c.head_dim();
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
        let (d, hd) = (cfg.hidden_size as u64, cfg.head_dim() as u64);
        let (eps, k) = (cfg.rms_norm_eps, cfg.num_experts_per_tok as u64);

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

        let mut h = w.embedding(tokens, t, &self.embed);
        for (i, layer) in self.layers.iter().enumerate() {
            let x = w.rms_norm(h, &[t, d], &layer.input_norm, eps);
            let o = layer.attn.forward(&mut w, x, t, i, &rope, eps);
            h = w.g.op(OpCode::Add, &[t, d], &[h, o]);

            let x = w.rms_norm(h, &[t, d], &layer.post_attention_norm, eps);
            let f = match &layer.ffn {
                FeedForward::Dense(m) => m.forward(&mut w, x, t),
                FeedForward::Sparse(m) => m.forward(&mut w, x, t, k, cfg.norm_topk_prob),
            };
            h = w.g.op(OpCode::Add, &[t, d], &[h, f]);
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

impl FamilyModel for MoeModel {
    fn description(&self) -> ModelDescription {
        let c = &self.cfg;
        let kv = KvLayerDesc {
            kind: KvKind::Full as u32,
            n_kv_heads: c.n_kv_heads() as u32,
            head_dim: c.head_dim() as u32,
            ..KvLayerDesc::zeroed()
        };
        ModelDescription {
            task: Task::Text,
            architecture: c.model_type.clone(),
            vocab_size: c.vocab_size as u64,
            hidden_size: c.hidden_size as u64,
            n_layers: c.num_hidden_layers as u32,
            max_positions: c.max_position_embeddings.unwrap_or(4096) as u64,
            kv_layers: vec![kv; c.num_hidden_layers],
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

/// "affine 4-bit g32" from the experts (most of the weights), else the embedding; "(mixed)" when
/// another width appears (Qwen3-MoE's routers are 8-bit).
fn describe_quantization(embed: &Linear, layers: &[Layer]) -> String {
    let mut specs = vec![embed.describe_quant()];
    for l in layers {
        match &l.ffn {
            FeedForward::Sparse(m) => {
                specs.push(m.down.describe_quant());
                specs.push(m.router.describe_quant());
            }
            FeedForward::Dense(m) => specs.push(m.down.describe_quant()),
        }
    }
    let main = layers
        .iter()
        .find_map(|l| match &l.ffn {
            FeedForward::Sparse(m) => m.down.describe_quant(),
            FeedForward::Dense(m) => m.down.describe_quant(),
        })
        .or(specs[0]);
    match main {
        Some(s) => {
            let mixed = specs.iter().any(|o| o.is_some_and(|o| o != s));
            format!("affine {}-bit g{}{}", s.bits, s.group_size, if mixed { " (mixed)" } else { "" })
        }
        None => String::new(),
    }
}
