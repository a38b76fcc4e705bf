//! The Llama architecture (and its Mistral / Qwen2 / Qwen3 variants) as an op graph.
//!
//! Per layer: `h += o_proj(attn(rope(q), rope(k), v))` over `rms_norm(h)`, then
//! `h += down(act(gate(x)) * up(x))` over `rms_norm(h)`. Qwen2 adds q/k/v biases, Qwen3 adds a per-head
//! RMS norm on q and k; both are flags on [`Variant`], not copies of this file.
//!
//! As an embedding model (Qwen3-Embedding: sentence-transformers metadata beside the weights), each
//! sequence is whole in its step and attends causally among its own tokens without a KV cache; the
//! final-norm rows are pooled (the last token's) and L2-normalised instead of projected to logits.

use mlxcel_family_kit::decoder::{activation_bytes_per_token, quantization};
use mlxcel_family_kit::rope::step_inv_freq;
use mlxcel_family_kit::{
    rope_freqs, AttentionShape, Decoder, EmbeddingHead, GateActivation, GatedMlp, GraphWriter, Linear, RopeFreqs,
    RopeInputs, SelfAttention, StepInputs, TextDecoder, TextModelFacts, UsedWeights, WeightRef, WeightTable,
};
use mlxcel_plugin_api::{DType, OpCode, StepDesc, Task, TensorId, INPUT_TOKEN_SEQ};

use crate::config::{LlamaConfig, Variant};

struct Layer {
    input_norm: WeightRef,
    attn: SelfAttention,
    post_attention_norm: WeightRef,
    mlp: GatedMlp,
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
}

impl LlamaModel {
    pub fn load(cfg: LlamaConfig, table: &WeightTable) -> Result<Decoder<LlamaModel>, String> {
        let Variant { qkv_bias, o_bias, qk_norm } = cfg.variant();
        let (d, hd, inter) = (cfg.hidden_size, cfg.head_dim(), cfg.intermediate_size);
        let q = cfg.quantization.as_ref();
        let norm = |name: String| table.float(&name, &[d as u64]);
        let act = if cfg.gelu() { GateActivation::GeluTanh } else { GateActivation::Silu };
        let shape = AttentionShape {
            qkv_bias,
            o_bias,
            qk_norm,
            ..AttentionShape::new(d, cfg.num_attention_heads, cfg.n_kv_heads(), hd)
        };

        let embed = Linear::load(table, q, "model.embed_tokens", d, cfg.vocab_size, false)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let shape = AttentionShape { window: cfg.layer_window(i), ..shape };
            layers.push(Layer {
                input_norm: norm(format!("{p}.input_layernorm.weight"))?,
                attn: SelfAttention::load(table, q, &format!("{p}.self_attn"), shape)?,
                post_attention_norm: norm(format!("{p}.post_attention_layernorm.weight"))?,
                mlp: GatedMlp::load(table, q, &format!("{p}.mlp"), d, inter, cfg.mlp_bias, act)?,
            });
        }
        let final_norm = norm("model.norm.weight".into())?;
        let embedding = cfg.embedding()?;
        let lm_head = if cfg.tied_embeddings() || embedding.is_some() {
            None
        } else {
            Some(Linear::load(table, q, "lm_head", d, cfg.vocab_size, false)?)
        };
        let max_positions = cfg.max_position_embeddings.unwrap_or(4096);
        let rope = rope_freqs(hd, cfg.rope_base(), cfg.rope_scaling(), max_positions)?;

        let mut used = UsedWeights::default();
        used.add(&embed).add(&final_norm).add(&lm_head);
        for l in &layers {
            used.add(&l.input_norm).add(&l.attn).add(&l.post_attention_norm).add(&l.mlp);
        }
        let facts = TextModelFacts {
            task: if embedding.is_some() { Task::Embed } else { Task::Text },
            architecture: cfg.model_type.clone(),
            vocab_size: cfg.vocab_size,
            hidden_size: d,
            max_positions,
            kv_layers: layers.iter().map(|l| l.attn.shape.kv_layer()).collect(),
            used_weights: used.finish(),
            activation_bytes_per_token: activation_bytes_per_token(4, &shape, inter),
            quantization: quantization(layers.first().map(|l| &l.mlp.down), &embed, q),
        };
        let model = LlamaModel { cfg, embed, layers, norm: final_norm, lm_head, embedding, rope };
        Ok(Decoder::new(model, facts))
    }
}

impl TextDecoder for LlamaModel {
    fn forward(&self, w: &mut GraphWriter, step: &StepDesc, inputs: StepInputs) -> Result<TensorId, String> {
        let StepInputs { tokens, positions, n_tokens: t, n_rows: r } = inputs;
        let cfg = &self.cfg;
        let (d, hd) = (cfg.hidden_size as u64, cfg.head_dim() as i64);
        let eps = cfg.rms_norm_eps;
        let rope = RopeInputs {
            positions,
            inv_freq: step_inv_freq(w.g, &self.rope, step),
            params: [hd, hd, cfg.rope_traditional as i64],
            mscale: self.rope.mscale,
        };

        // An embedding model's sequences are whole in the step: attention among their own tokens.
        let seq = self.embedding.map(|_| w.g.input(INPUT_TOKEN_SEQ, DType::I32, &[t]));
        let mut h = w.embedding(tokens, t, &self.embed);
        for (i, layer) in self.layers.iter().enumerate() {
            let x = w.rms_norm(h, &[t, d], &layer.input_norm, eps);
            let o = match seq {
                Some(seq) => layer.attn.forward_in_step(w, x, t, seq, &rope, eps),
                None => layer.attn.forward(w, x, t, i, &rope, eps),
            };
            h = w.g.op(OpCode::Add, &[t, d], &[h, o]);

            let x = w.rms_norm(h, &[t, d], &layer.post_attention_norm, eps);
            let m = layer.mlp.forward(w, x, t);
            h = w.g.op(OpCode::Add, &[t, d], &[h, m]);
        }

        if let (Some(head), Some(seq)) = (&self.embedding, seq) {
            let h = w.rms_norm(h, &[t, d], &self.norm, eps);
            return Ok(head.forward(w, h, seq, step.n_seqs as u64, d));
        }
        let h = inputs.output_rows(w, h, d);
        let h = w.rms_norm(h, &[r, d], &self.norm, eps);
        Ok(w.linear(h, r, self.lm_head.as_ref().unwrap_or(&self.embed)))
    }
}
