//! Gemma 1, 2 and 3 (text) as an op graph, following mlx-lm's `gemma.py`, `gemma2.py` and
//! `gemma3_text.py`.
//!
//! `h = embed(tokens) * √hidden`; per layer `h += [post_attn_norm](attn(input_norm(h)))`, then
//! `h += [post_ff_norm](down(gelu(gate(x)) * up(x)))` over `x = pre_ff_norm(h)` (Gemma 1 names it
//! `post_attention_layernorm` and has no post norms). Every norm scales by `(1 + w)`. Gemma 2 soft-caps
//! attention scores and the final logits; Gemma 3 norms q and k per head and gives its local
//! (sliding-window) layers their own rope base. The differences are the flags of [`GemmaConfig`].

use mlxcel_family_kit::decoder::{activation_bytes_per_token, quantization};
use mlxcel_family_kit::rope::step_inv_freq;
use mlxcel_family_kit::{
    rope_freqs, AttentionShape, Decoder, GateActivation, GatedMlp, GraphWriter, Linear, RopeFreqs, RopeInputs,
    SelfAttention, StepInputs, TextDecoder, TextModelFacts, UsedWeights, WeightRef, WeightTable,
};
use mlxcel_plugin_api::{OpCode, StepDesc, Task, TensorId};
use serde_json::Value;

use crate::config::{GemmaConfig, Generation};

struct Layer {
    input_norm: WeightRef,
    attn: SelfAttention,
    /// Index into [`GemmaModel::ropes`].
    rope: usize,
    /// Gemma 2 / 3: norm of the attention output before the residual add.
    post_attention_norm: Option<WeightRef>,
    /// Norm before the MLP (Gemma 1's `post_attention_layernorm`, Gemma 2 / 3's
    /// `pre_feedforward_layernorm`).
    pre_ff_norm: WeightRef,
    mlp: GatedMlp,
    /// Gemma 2 / 3: norm of the MLP output before the residual add.
    post_ff_norm: Option<WeightRef>,
}

pub struct GemmaModel {
    pub cfg: GemmaConfig,
    embed: Linear,
    embed_scale: f32,
    layers: Vec<Layer>,
    norm: WeightRef,
    /// `None` when tied to the embedding (always for Gemma 1 and 2; Gemma 3 when `lm_head` is absent).
    lm_head: Option<Linear>,
    /// The distinct rope frequencies of the layers (Gemma 3: local and global).
    ropes: Vec<RopeFreqs>,
}

impl GemmaModel {
    pub fn load(cfg: GemmaConfig, table: &WeightTable) -> Result<Decoder<GemmaModel>, String> {
        let (d, hd, inter) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
        let q = cfg.quantization.as_ref();
        let pre = cfg.weight_prefix.clone();
        let norm = |name: String| table.float(&format!("{pre}{name}"), &[d as u64]);
        let linear = |path: String, i: usize, o: usize| Linear::load(table, q, &format!("{pre}{path}"), i, o, false);
        let act = if cfg.exact_gelu() { GateActivation::Gelu } else { GateActivation::GeluTanh };
        let sandwich = cfg.sandwich_norms();
        let shape = AttentionShape {
            qk_norm: cfg.qk_norm(),
            norm_plus_one: true,
            scale: Some(cfg.attention_scale()),
            softcap: cfg.attn_softcap().unwrap_or(0.0),
            ..AttentionShape::new(d, cfg.num_attention_heads, cfg.num_key_value_heads, hd)
        };

        let embed = linear("model.embed_tokens".into(), d, cfg.vocab_size)?;
        let mut ropes: Vec<(f64, Option<Value>, RopeFreqs)> = Vec::new();
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let (base, scaling) = (cfg.layer_rope_base(i), cfg.layer_rope_scaling(i).cloned());
            let rope = match ropes.iter().position(|(b, s, _)| *b == base && *s == scaling) {
                Some(r) => r,
                None => {
                    ropes.push((base, scaling.clone(), rope_freqs(hd, base, scaling.as_ref(), cfg.max_positions())?));
                    ropes.len() - 1
                }
            };
            let shape = AttentionShape { window: cfg.layer_window(i), ..shape };
            let (post_attention_norm, pre_ff_norm, post_ff_norm) = if sandwich {
                (
                    Some(norm(format!("{p}.post_attention_layernorm.weight"))?),
                    norm(format!("{p}.pre_feedforward_layernorm.weight"))?,
                    Some(norm(format!("{p}.post_feedforward_layernorm.weight"))?),
                )
            } else {
                (None, norm(format!("{p}.post_attention_layernorm.weight"))?, None)
            };
            layers.push(Layer {
                input_norm: norm(format!("{p}.input_layernorm.weight"))?,
                attn: SelfAttention::load(table, q, &format!("{pre}{p}.self_attn"), shape)?,
                rope,
                post_attention_norm,
                pre_ff_norm,
                mlp: GatedMlp::load(table, q, &format!("{pre}{p}.mlp"), d, inter, false, act)?,
                post_ff_norm,
            });
        }
        let final_norm = norm("model.norm.weight".into())?;
        // mlx-lm's gemma3 ties the head when the checkpoint has no `lm_head`; Gemma 1 and 2 always tie.
        let has_head = table.get(&format!("{pre}lm_head.weight")).is_some();
        let lm_head = if cfg.generation() == Generation::Gemma3 && has_head {
            Some(linear("lm_head".into(), d, cfg.vocab_size)?)
        } else {
            None
        };

        let mut used = UsedWeights::default();
        used.add(&embed).add(&final_norm).add(&lm_head);
        for l in &layers {
            used.add(&l.input_norm).add(&l.attn).add(&l.post_attention_norm);
            used.add(&l.pre_ff_norm).add(&l.mlp).add(&l.post_ff_norm);
        }
        let facts = TextModelFacts {
            task: Task::Text,
            architecture: cfg.model_type.clone(),
            vocab_size: cfg.vocab_size,
            hidden_size: d,
            max_positions: cfg.max_positions(),
            kv_layers: layers.iter().map(|l| l.attn.shape.kv_layer()).collect(),
            used_weights: used.finish(),
            activation_bytes_per_token: activation_bytes_per_token(5, &shape, inter),
            quantization: quantization(layers.first().map(|l| &l.mlp.down), &embed, q),
        };
        let embed_scale = cfg.embedding_scale(embed.compute_dtype());
        let ropes = ropes.into_iter().map(|(_, _, f)| f).collect();
        Ok(Decoder::new(GemmaModel { cfg, embed, embed_scale, layers, norm: final_norm, lm_head, ropes }, facts))
    }
}

impl TextDecoder for GemmaModel {
    fn forward(&self, w: &mut GraphWriter, step: &StepDesc, inputs: StepInputs) -> Result<TensorId, String> {
        let StepInputs { tokens, positions, n_tokens: t, n_rows: r } = inputs;
        let cfg = &self.cfg;
        let (d, hd) = (cfg.hidden_size as u64, cfg.head_dim as i64);
        let eps = cfg.rms_norm_eps;
        let ropes: Vec<RopeInputs> = self
            .ropes
            .iter()
            .map(|f| RopeInputs {
                positions,
                inv_freq: step_inv_freq(w.g, f, step),
                params: [hd, hd, cfg.rope_traditional() as i64],
                mscale: f.mscale,
            })
            .collect();

        let h = w.embedding(tokens, t, &self.embed);
        let mut h = w.g.op_with(OpCode::Scale, &[t, d], &[h], &[], &[self.embed_scale]);
        for (i, layer) in self.layers.iter().enumerate() {
            let x = w.rms_norm_plus_one(h, &[t, d], &layer.input_norm, eps);
            let mut o = layer.attn.forward(w, x, t, i, &ropes[layer.rope], eps);
            if let Some(n) = &layer.post_attention_norm {
                o = w.rms_norm_plus_one(o, &[t, d], n, eps);
            }
            h = w.g.op(OpCode::Add, &[t, d], &[h, o]);

            let x = w.rms_norm_plus_one(h, &[t, d], &layer.pre_ff_norm, eps);
            let mut m = layer.mlp.forward(w, x, t);
            if let Some(n) = &layer.post_ff_norm {
                m = w.rms_norm_plus_one(m, &[t, d], n, eps);
            }
            h = w.g.op(OpCode::Add, &[t, d], &[h, m]);
        }

        let h = inputs.output_rows(w, h, d);
        let h = w.rms_norm_plus_one(h, &[r, d], &self.norm, eps);
        let mut logits = w.linear(h, r, self.lm_head.as_ref().unwrap_or(&self.embed));
        if let Some(cap) = cfg.final_softcap() {
            logits = w.g.op_with(OpCode::Softcap, &[r, cfg.vocab_size as u64], &[logits], &[], &[cap]);
        }
        Ok(logits)
    }
}
