//! GLM-4 (`glm4`, the GLM-4-0414 models) as an op graph, following mlx-lm's `glm4.py`.
//!
//! Per layer, four RMS norms around two blocks: `h += post_self_attn_norm(attn(input_norm(h)))`, then
//! `h += post_mlp_norm(down(silu(gate) * up))` over `post_attention_norm(h)`, the gate and up rows
//! read from the one fused `gate_up_proj` (row views, no repacking). q/k/v carry biases; rope turns
//! the first `partial_rotary_factor` of each head with interleaved pairs; the head is never tied.

use mlxcel_family_kit::decoder::{activation_bytes_per_token, quantization};
use mlxcel_family_kit::rope::step_inv_freq;
use mlxcel_family_kit::{
    rope_freqs, AttentionShape, Decoder, GateActivation, GatedMlp, GraphWriter, Linear, RopeFreqs, RopeInputs,
    SelfAttention, StepInputs, TextDecoder, TextModelFacts, UsedWeights, WeightRef, WeightTable,
};
use mlxcel_plugin_api::{OpCode, StepDesc, Task, TensorId};

use crate::config::Glm4Config;

struct Layer {
    input_norm: WeightRef,
    attn: SelfAttention,
    post_self_attn_norm: WeightRef,
    post_attention_norm: WeightRef,
    mlp: GatedMlp,
    post_mlp_norm: WeightRef,
}

pub struct Glm4Model {
    pub cfg: Glm4Config,
    embed: Linear,
    layers: Vec<Layer>,
    norm: WeightRef,
    lm_head: Linear,
    rope: RopeFreqs,
}

impl Glm4Model {
    pub fn load(cfg: Glm4Config, table: &WeightTable) -> Result<Decoder<Glm4Model>, String> {
        let (d, hd, inter) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
        let q = cfg.quantization.as_ref();
        let norm = |name: String| table.float(&name, &[d as u64]);
        let shape = AttentionShape {
            qkv_bias: cfg.attention_bias,
            ..AttentionShape::new(d, cfg.num_attention_heads, cfg.num_key_value_heads, hd)
        };

        let embed = Linear::load(table, q, "model.embed_tokens", d, cfg.vocab_size, false)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            layers.push(Layer {
                input_norm: norm(format!("{p}.input_layernorm.weight"))?,
                attn: SelfAttention::load(table, q, &format!("{p}.self_attn"), shape)?,
                post_self_attn_norm: norm(format!("{p}.post_self_attn_layernorm.weight"))?,
                post_attention_norm: norm(format!("{p}.post_attention_layernorm.weight"))?,
                mlp: GatedMlp::fused(table, q, &format!("{p}.mlp"), d, inter, GateActivation::Silu)?,
                post_mlp_norm: norm(format!("{p}.post_mlp_layernorm.weight"))?,
            });
        }
        let final_norm = norm("model.norm.weight".into())?;
        let lm_head = Linear::load(table, q, "lm_head", d, cfg.vocab_size, false)?;
        let rope = rope_freqs(cfg.rotary_dims(), cfg.rope_theta, None, cfg.max_position_embeddings)?;

        let mut used = UsedWeights::default();
        used.add(&embed).add(&final_norm).add(&lm_head);
        for l in &layers {
            used.add(&l.input_norm).add(&l.attn).add(&l.post_self_attn_norm);
            used.add(&l.post_attention_norm).add(&l.mlp).add(&l.post_mlp_norm);
        }
        let facts = TextModelFacts {
            task: Task::Text,
            architecture: cfg.model_type.clone(),
            vocab_size: cfg.vocab_size,
            hidden_size: d,
            max_positions: cfg.max_position_embeddings,
            kv_layers: layers.iter().map(|l| l.attn.shape.kv_layer()).collect(),
            used_weights: used.finish(),
            activation_bytes_per_token: activation_bytes_per_token(5, &shape, inter),
            quantization: quantization(layers.first().map(|l| &l.mlp.down), &embed, q),
        };
        Ok(Decoder::new(Glm4Model { cfg, embed, layers, norm: final_norm, lm_head, rope }, facts))
    }
}

impl TextDecoder for Glm4Model {
    fn forward(&self, w: &mut GraphWriter, step: &StepDesc, inputs: StepInputs) -> Result<TensorId, String> {
        let StepInputs { tokens, positions, n_tokens: t, n_rows: r } = inputs;
        let cfg = &self.cfg;
        let d = cfg.hidden_size as u64;
        let eps = cfg.rms_norm_eps;
        let rope = RopeInputs {
            positions,
            inv_freq: step_inv_freq(w.g, &self.rope, step),
            params: [cfg.head_dim as i64, cfg.rotary_dims() as i64, cfg.rope_traditional as i64],
            mscale: self.rope.mscale,
        };

        let mut h = w.embedding(tokens, t, &self.embed);
        for (i, layer) in self.layers.iter().enumerate() {
            let x = w.rms_norm(h, &[t, d], &layer.input_norm, eps);
            let o = layer.attn.forward(w, x, t, i, &rope, eps);
            let o = w.rms_norm(o, &[t, d], &layer.post_self_attn_norm, eps);
            h = w.g.op(OpCode::Add, &[t, d], &[h, o]);

            let x = w.rms_norm(h, &[t, d], &layer.post_attention_norm, eps);
            let m = layer.mlp.forward(w, x, t);
            let m = w.rms_norm(m, &[t, d], &layer.post_mlp_norm, eps);
            h = w.g.op(OpCode::Add, &[t, d], &[h, m]);
        }

        let h = inputs.output_rows(w, h, d);
        let h = w.rms_norm(h, &[r, d], &self.norm, eps);
        Ok(w.linear(h, r, &self.lm_head))
    }
}
