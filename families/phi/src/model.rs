//! Phi-3 as an op graph, following mlx-lm's `phi3.py`.
//!
//! A Llama-shaped decoder whose projections are fused in the checkpoint: `qkv_proj` holds the rows of
//! q (all heads), then k, then v, and `gate_up_proj` the rows of gate, then up. Each part is read as a
//! row view of the one tensor (the kit's `Linear::rows`), so nothing is repacked at load. Rope turns
//! only the first `partial_rotary_factor` of each head, with LongRoPE's stretched periods when the
//! config extends the context.

use mlxcel_family_kit::decoder::{activation_bytes_per_token, quantization};
use mlxcel_family_kit::rope::{step_inv_freq, su_scaled};
use mlxcel_family_kit::{
    rope_freqs, AttentionShape, Decoder, GateActivation, GatedMlp, GraphWriter, Linear, RopeFreqs, RopeInputs,
    SelfAttention, StepInputs, TextDecoder, TextModelFacts, UsedWeights, WeightRef, WeightTable,
};
use mlxcel_plugin_api::{OpCode, StepDesc, Task, TensorId};

use crate::config::{Phi3Config, RopeScaling};

struct Layer {
    input_norm: WeightRef,
    attn: SelfAttention,
    post_attention_norm: WeightRef,
    mlp: GatedMlp,
}

pub struct Phi3Model {
    pub cfg: Phi3Config,
    embed: Linear,
    layers: Vec<Layer>,
    norm: WeightRef,
    /// `None` when tied to the embedding.
    lm_head: Option<Linear>,
    rope: RopeFreqs,
}

impl Phi3Model {
    pub fn load(cfg: Phi3Config, table: &WeightTable) -> Result<Decoder<Phi3Model>, String> {
        let (d, hd, inter) = (cfg.hidden_size, cfg.head_dim(), cfg.intermediate_size);
        let (nh, nkv) = (cfg.num_attention_heads, cfg.n_kv_heads());
        let q = cfg.quantization.as_ref();
        let norm = |name: String| table.float(&name, &[d as u64]);
        let shape = AttentionShape::new(d, nh, nkv, hd);

        let embed = Linear::load(table, q, "model.embed_tokens", d, cfg.vocab_size, false)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let (nq, nk) = ((nh * hd) as u64, (nkv * hd) as u64);
            let qkv = Linear::load(table, q, &format!("{p}.self_attn.qkv_proj"), d, nh * hd + 2 * nkv * hd, false)?;
            let attn = SelfAttention {
                q: qkv.rows(0, nq)?,
                k: qkv.rows(nq, nk)?,
                v: qkv.rows(nq + nk, nk)?,
                o: Linear::load(table, q, &format!("{p}.self_attn.o_proj"), nh * hd, d, false)?,
                q_norm: None,
                k_norm: None,
                shape,
            };
            layers.push(Layer {
                input_norm: norm(format!("{p}.input_layernorm.weight"))?,
                attn,
                post_attention_norm: norm(format!("{p}.post_attention_layernorm.weight"))?,
                mlp: GatedMlp::fused(table, q, &format!("{p}.mlp"), d, inter, GateActivation::Silu)?,
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

        let mut used = UsedWeights::default();
        used.add(&embed).add(&final_norm).add(&lm_head);
        for l in &layers {
            used.add(&l.input_norm).add(&l.attn).add(&l.post_attention_norm).add(&l.mlp);
        }
        let facts = TextModelFacts {
            task: Task::Text,
            architecture: cfg.model_type.clone(),
            vocab_size: cfg.vocab_size,
            hidden_size: d,
            max_positions: cfg.max_position_embeddings,
            kv_layers: layers.iter().map(|l| l.attn.shape.kv_layer()).collect(),
            used_weights: used.finish(),
            activation_bytes_per_token: activation_bytes_per_token(4, &shape, inter),
            quantization: quantization(layers.first().map(|l| &l.mlp.down), &embed, q),
        };
        Ok(Decoder::new(Phi3Model { cfg, embed, layers, norm: final_norm, lm_head, rope }, facts))
    }
}

impl TextDecoder for Phi3Model {
    fn forward(&self, w: &mut GraphWriter, step: &StepDesc, inputs: StepInputs) -> Result<TensorId, String> {
        let StepInputs { tokens, positions, n_tokens: t, n_rows: r } = inputs;
        let cfg = &self.cfg;
        let d = cfg.hidden_size as u64;
        let eps = cfg.rms_norm_eps;
        // mlx-lm's LongRoPE always splits halves; plain rope follows the config.
        let traditional = cfg.rope_traditional && !matches!(cfg.rope(), Ok(RopeScaling::LongRope(_)));
        let rope = RopeInputs {
            positions,
            inv_freq: step_inv_freq(w.g, &self.rope, step),
            params: [cfg.head_dim() as i64, cfg.rotary_dims() as i64, traditional as i64],
            mscale: self.rope.mscale,
        };

        let mut h = w.embedding(tokens, t, &self.embed);
        for (i, layer) in self.layers.iter().enumerate() {
            let x = w.rms_norm(h, &[t, d], &layer.input_norm, eps);
            let o = layer.attn.forward(w, x, t, i, &rope, eps);
            h = w.g.op(OpCode::Add, &[t, d], &[h, o]);

            let x = w.rms_norm(h, &[t, d], &layer.post_attention_norm, eps);
            let m = layer.mlp.forward(w, x, t);
            h = w.g.op(OpCode::Add, &[t, d], &[h, m]);
        }

        let h = inputs.output_rows(w, h, d);
        let h = w.rms_norm(h, &[r, d], &self.norm, eps);
        Ok(w.linear(h, r, self.lm_head.as_ref().unwrap_or(&self.embed)))
    }
}
