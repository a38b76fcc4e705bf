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
    rope_freqs, AttentionShape, Decoder, Experts, GateActivation, GatedMlp, GraphWriter, Linear, QuantSpec, RopeFreqs,
    RopeInputs, SelfAttention, StepInputs, TextDecoder, TextModelFacts, UsedWeights, WeightRef, WeightTable, Weights,
};
use mlxcel_plugin_api::{OpCode, StepDesc, Task, TensorId};

use crate::config::MoeConfig;

struct SparseMoe {
    router: Linear,
    gate: Experts,
    up: Experts,
    down: Experts,
    /// Qwen2-MoE: an MLP every token takes, scaled by `sigmoid(shared_gate(x))`.
    shared: Option<(GatedMlp, Linear)>,
}

// One per layer, built once: the size of the variants does not matter.
#[allow(clippy::large_enum_variant)]
enum FeedForward {
    Dense(GatedMlp),
    Sparse(SparseMoe),
}

impl FeedForward {
    /// Its representative projection: the experts' down projection, or the MLP's.
    fn down_quant(&self) -> Option<QuantSpec> {
        match self {
            FeedForward::Sparse(m) => m.down.describe_quant(),
            FeedForward::Dense(m) => m.down.describe_quant(),
        }
    }
}

impl Weights for FeedForward {
    fn indices(&self) -> Vec<u32> {
        match self {
            FeedForward::Dense(m) => m.indices(),
            FeedForward::Sparse(m) => m.indices(),
        }
    }
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
}

/// SwiGLU: `down(silu(gate(x)) · up(x))` of width `width` under module `path`.
fn mlp(table: &WeightTable, cfg: &MoeConfig, path: &str, width: usize) -> Result<GatedMlp, String> {
    let q = cfg.quantization.as_ref();
    GatedMlp::load(table, q, path, cfg.hidden_size, width, false, GateActivation::Silu)
}

impl SparseMoe {
    fn load(table: &WeightTable, cfg: &MoeConfig, path: &str) -> Result<SparseMoe, String> {
        let (q, d, e, inter) = (cfg.quantization.as_ref(), cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size);
        let shared = if cfg.shared_expert_intermediate_size > 0 {
            let mlp = mlp(table, cfg, &format!("{path}.shared_expert"), cfg.shared_expert_intermediate_size)?;
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

impl Weights for SparseMoe {
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
}

impl MoeModel {
    pub fn load(cfg: MoeConfig, table: &WeightTable) -> Result<Decoder<MoeModel>, String> {
        let (d, hd) = (cfg.hidden_size, cfg.head_dim());
        let q = cfg.quantization.as_ref();
        let norm = |name: String| table.float(&name, &[d as u64]);
        let shape = AttentionShape {
            qkv_bias: cfg.qkv_bias(),
            qk_norm: cfg.qk_norm(),
            ..AttentionShape::new(d, cfg.num_attention_heads, cfg.n_kv_heads(), hd)
        };

        let embed = Linear::load(table, q, "model.embed_tokens", d, cfg.vocab_size, false)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let attn = SelfAttention::load(table, q, &format!("{p}.self_attn"), shape)?;
            let ffn = if cfg.sparse_layer(i) {
                FeedForward::Sparse(SparseMoe::load(table, &cfg, &format!("{p}.mlp"))?)
            } else {
                FeedForward::Dense(mlp(table, &cfg, &format!("{p}.mlp"), cfg.intermediate_size)?)
            };
            layers.push(Layer {
                input_norm: norm(format!("{p}.input_layernorm.weight"))?,
                attn,
                post_attention_norm: norm(format!("{p}.post_attention_layernorm.weight"))?,
                ffn,
            });
        }
        let final_norm = norm("model.norm.weight".into())?;
        let lm_head = if cfg.tied_embeddings() {
            None
        } else {
            Some(Linear::load(table, q, "lm_head", d, cfg.vocab_size, false)?)
        };
        let max_positions = cfg.max_position_embeddings.unwrap_or(4096);
        let scaling = cfg.rope_scaling.as_ref().filter(|v| !v.is_null());
        let rope = rope_freqs(hd, cfg.rope_theta, scaling, max_positions)?;

        let mut used = UsedWeights::default();
        used.add(&embed).add(&final_norm).add(&lm_head);
        for l in &layers {
            used.add(&l.input_norm).add(&l.attn).add(&l.post_attention_norm).add(&l.ffn);
        }
        // One layer's f32 values: the `k` experts' rows, the dense or shared MLP's, and attention's.
        let c = &cfg;
        let experts = 3 * c.num_experts_per_tok * c.moe_intermediate_size + c.num_experts_per_tok * d;
        let dense = 3 * c.intermediate_size.max(c.shared_expert_intermediate_size);
        let per_token = 4 * d + experts + dense + shape.qkv_width();
        let facts = TextModelFacts {
            task: Task::Text,
            architecture: cfg.model_type.clone(),
            vocab_size: cfg.vocab_size,
            hidden_size: d,
            max_positions,
            kv_layers: layers.iter().map(|l| l.attn.shape.kv_layer()).collect(),
            used_weights: used.finish(),
            activation_bytes_per_token: (per_token * 4) as u64,
            quantization: describe_quantization(&embed, &layers),
        };
        Ok(Decoder::new(MoeModel { cfg, embed, layers, norm: final_norm, lm_head, rope }, facts))
    }
}

impl TextDecoder for MoeModel {
    fn forward(&self, w: &mut GraphWriter, step: &StepDesc, inputs: StepInputs) -> Result<TensorId, String> {
        let StepInputs { tokens, positions, n_tokens: t, n_rows: r } = inputs;
        let cfg = &self.cfg;
        let (d, hd) = (cfg.hidden_size as u64, cfg.head_dim() as i64);
        let (eps, k) = (cfg.rms_norm_eps, cfg.num_experts_per_tok as u64);
        let rope = RopeInputs {
            positions,
            inv_freq: step_inv_freq(w.g, &self.rope, step),
            params: [hd, hd, cfg.rope_traditional as i64],
            mscale: self.rope.mscale,
        };

        let mut h = w.embedding(tokens, t, &self.embed);
        for (i, layer) in self.layers.iter().enumerate() {
            let x = w.rms_norm(h, &[t, d], &layer.input_norm, eps);
            let o = layer.attn.forward(w, x, t, i, &rope, eps);
            h = w.g.op(OpCode::Add, &[t, d], &[h, o]);

            let x = w.rms_norm(h, &[t, d], &layer.post_attention_norm, eps);
            let f = match &layer.ffn {
                FeedForward::Dense(m) => m.forward(w, x, t),
                FeedForward::Sparse(m) => m.forward(w, x, t, k, cfg.norm_topk_prob),
            };
            h = w.g.op(OpCode::Add, &[t, d], &[h, f]);
        }

        let h = inputs.output_rows(w, h, d);
        let h = w.rms_norm(h, &[r, d], &self.norm, eps);
        Ok(w.linear(h, r, self.lm_head.as_ref().unwrap_or(&self.embed)))
    }
}

/// "affine 4-bit g32" from the experts (most of the weights), else the embedding; "(mixed)" when
/// another width appears (Qwen3-MoE's routers are 8-bit).
fn describe_quantization(embed: &Linear, layers: &[Layer]) -> String {
    let mut specs = vec![embed.describe_quant()];
    for l in layers {
        specs.push(l.ffn.down_quant());
        if let FeedForward::Sparse(m) = &l.ffn {
            specs.push(m.router.describe_quant());
        }
    }
    let main = layers.iter().find_map(|l| l.ffn.down_quant()).or(specs[0]);
    match main {
        Some(s) => {
            let mixed = specs.iter().any(|o| o.is_some_and(|o| o != s));
            format!("affine {}-bit g{}{}", s.bits, s.group_size, if mixed { " (mixed)" } else { "" })
        }
        None => String::new(),
    }
}
