//! Liquid LFM2 (`lfm2`) as an op graph, following mlx-lm's `lfm2.py`.
//!
//! Each layer is `h += op(operator_norm(h)); h += w2(silu(w1 x) * w3 x)` over `ffn_norm(h)`, where `op`
//! is grouped-query attention (per-head RMS norm on q and k, then rope) on the layers of
//! `full_attn_idxs` and a gated short convolution on the others:
//!
//! ```text
//! B, C, x = split(in_proj(h), 3);  y = out_proj(C * conv(B * x))
//! ```
//!
//! `conv` is a depthwise causal convolution of `conv_L_cache` taps. Its window is per-sequence state:
//! the last `K − 1` rows of `B * x` live in a recurrent state row of the layer (`Conv1d` in causal
//! mode reads and stores them), so a prompt in chunks and token-by-token decode continue exactly, and
//! each sequence of a batch keeps its own. The final norm is `embedding_norm` (applied after the last
//! layer, despite its name) and the head is the embedding, as mlx-lm always ties it.

use mlxcel_family_kit::decoder::quantization;
use mlxcel_family_kit::rope::step_inv_freq;
use mlxcel_family_kit::{
    rope_freqs, AttentionShape, Decoder, GateActivation, GatedMlp, GraphWriter, Linear, RopeFreqs, RopeInputs,
    SelfAttention, StepInputs, TextDecoder, TextModelFacts, UsedWeights, WeightRef, WeightTable, Weights,
};
use mlxcel_plugin_api::{
    conv_state_elems, DType, KvKind, KvLayerDesc, OpCode, StepDesc, Task, TensorId, Versioned, CONV_CAUSAL_STATE,
    INPUT_TOKEN_SEQ,
};

use crate::config::Lfm2Config;

/// The gated short-convolution block.
struct ShortConv {
    /// `[3C, C]`: the rows of B, then C, then x.
    in_proj: Linear,
    /// The depthwise kernel as `Conv1d` reads it, `[C, K, 1]`.
    conv: WeightRef,
    conv_bias: Option<WeightRef>,
    out_proj: Linear,
}

impl ShortConv {
    /// `out_proj(C * conv(B * x))` for `t` tokens of `x`, the window carried in state layer `layer`.
    fn forward(&self, w: &mut GraphWriter, x: TensorId, t: u64, seq: TensorId, layer: usize) -> TensorId {
        let d = self.out_proj.out_features;
        let bcx = w.linear(x, t, &self.in_proj);
        let part = |w: &mut GraphWriter, i: u64| {
            w.g.op_with(OpCode::Slice, &[t, d], &[bcx], &[(i * d) as i64, ((i + 1) * d) as i64], &[])
        };
        let (b, c, xs) = (part(w, 0), part(w, 1), part(w, 2));
        let bx = w.g.op(OpCode::Mul, &[t, d], &[b, xs]);
        let kernel = w.weight(&self.conv);
        let mut src = vec![bx, kernel, seq];
        src.extend(self.conv_bias.as_ref().map(|b| w.weight(b)));
        // Causal, stride 1, no padding, depthwise (one group per channel), state of this layer.
        let y = w.g.op_with(OpCode::Conv1d, &[t, d], &src, &[CONV_CAUSAL_STATE, 1, 0, d as i64, layer as i64], &[]);
        let y = w.g.op(OpCode::Mul, &[t, d], &[c, y]);
        w.linear(y, t, &self.out_proj)
    }
}

impl Weights for ShortConv {
    fn indices(&self) -> Vec<u32> {
        let mut v = self.in_proj.indices();
        v.push(self.conv.index);
        v.extend(self.conv_bias.as_ref().map(|b| b.index));
        v.extend(self.out_proj.indices());
        v
    }
}

/// What a layer does before its MLP. (One per layer, made once at load: the variants' sizes do not matter.)
#[allow(clippy::large_enum_variant)]
enum Operator {
    Attention(SelfAttention),
    Conv(ShortConv),
}

impl Weights for Operator {
    fn indices(&self) -> Vec<u32> {
        match self {
            Operator::Attention(a) => a.indices(),
            Operator::Conv(c) => c.indices(),
        }
    }
}

struct Layer {
    operator_norm: WeightRef,
    op: Operator,
    ffn_norm: WeightRef,
    /// `w2(silu(w1 x) * w3 x)`.
    mlp: GatedMlp,
}

pub struct Lfm2Model {
    pub cfg: Lfm2Config,
    embed: Linear,
    layers: Vec<Layer>,
    embedding_norm: WeightRef,
    rope: RopeFreqs,
}

/// The depthwise kernel `name` seen as `[C, K, 1]`. Hugging Face checkpoints store it as
/// `[C, 1, K]`, MLX ones as `[C, K, 1]` (mlx-lm transposes on load); with a middle or last axis of one
/// both hold the same bytes in the same order, so no copy is needed.
fn depthwise_kernel(table: &WeightTable, name: &str, c: u64, k: u64) -> Result<WeightRef, String> {
    let w = table.require(name)?;
    if !matches!(w.dtype, DType::F32 | DType::F16 | DType::BF16) {
        return Err(format!("tensor `{name}` has dtype {}, expected a float", w.dtype.name()));
    }
    if w.shape != [c, 1, k] && w.shape != [c, k, 1] {
        return Err(format!("tensor `{name}` has shape {:?}, config implies [{c}, {k}, 1] or [{c}, 1, {k}]", w.shape));
    }
    Ok(WeightRef { shape: vec![c, k, 1], ..w })
}

impl Lfm2Model {
    pub fn load(cfg: Lfm2Config, table: &WeightTable) -> Result<Decoder<Lfm2Model>, String> {
        let (d, hd, ff) = (cfg.hidden_size, cfg.head_dim(), cfg.ff_dim());
        let (nh, nkv) = (cfg.num_attention_heads, cfg.n_kv_heads());
        let kernel = cfg.conv_l_cache as u64;
        let q = cfg.quantization.as_ref();
        let vector = |name: String, n: usize| table.float(&name, &[n as u64]);
        let lin = |name: String, i: usize, o: usize, bias: bool| Linear::load(table, q, &name, i, o, bias);
        let shape = AttentionShape { qk_norm: true, ..AttentionShape::new(d, nh, nkv, hd) };

        let embed = lin("model.embed_tokens".into(), d, cfg.vocab_size, false)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        let mut kv_layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let op = if cfg.is_attention(i) {
                let a = format!("{p}.self_attn");
                kv_layers.push(shape.kv_layer());
                Operator::Attention(SelfAttention {
                    q: lin(format!("{a}.q_proj"), d, nh * hd, false)?,
                    k: lin(format!("{a}.k_proj"), d, nkv * hd, false)?,
                    v: lin(format!("{a}.v_proj"), d, nkv * hd, false)?,
                    o: lin(format!("{a}.out_proj"), nh * hd, d, false)?,
                    q_norm: Some(vector(format!("{a}.q_layernorm.weight"), hd)?),
                    k_norm: Some(vector(format!("{a}.k_layernorm.weight"), hd)?),
                    shape,
                })
            } else {
                let c = format!("{p}.conv");
                kv_layers.push(KvLayerDesc {
                    kind: KvKind::Recurrent as u32,
                    state_elems: conv_state_elems(kernel, d as u64),
                    ..KvLayerDesc::zeroed()
                });
                Operator::Conv(ShortConv {
                    in_proj: lin(format!("{c}.in_proj"), d, 3 * d, cfg.conv_bias)?,
                    conv: depthwise_kernel(table, &format!("{c}.conv.weight"), d as u64, kernel)?,
                    conv_bias: cfg.conv_bias.then(|| vector(format!("{c}.conv.bias"), d)).transpose()?,
                    out_proj: lin(format!("{c}.out_proj"), d, d, cfg.conv_bias)?,
                })
            };
            layers.push(Layer {
                operator_norm: vector(format!("{p}.operator_norm.weight"), d)?,
                op,
                ffn_norm: vector(format!("{p}.ffn_norm.weight"), d)?,
                mlp: GatedMlp {
                    gate: lin(format!("{p}.feed_forward.w1"), d, ff, false)?,
                    up: lin(format!("{p}.feed_forward.w3"), d, ff, false)?,
                    down: lin(format!("{p}.feed_forward.w2"), ff, d, false)?,
                    activation: GateActivation::Silu,
                },
            });
        }
        let embedding_norm = vector("model.embedding_norm.weight".into(), d)?;
        let rope = rope_freqs(hd, cfg.rope_theta, None, cfg.max_position_embeddings)?;

        let mut used = UsedWeights::default();
        used.add(&embed).add(&embedding_norm);
        for l in &layers {
            used.add(&l.operator_norm).add(&l.op).add(&l.ffn_norm).add(&l.mlp);
        }
        // One layer's f32 values: the residual stream's, the operator's widest projection, the MLP's.
        let per_token = 5 * d + (3 * d).max(shape.qkv_width()) + 3 * ff;
        let facts = TextModelFacts {
            task: Task::Text,
            architecture: cfg.model_type.clone(),
            vocab_size: cfg.vocab_size,
            hidden_size: d,
            max_positions: cfg.max_position_embeddings,
            kv_layers,
            used_weights: used.finish(),
            activation_bytes_per_token: (per_token * 4) as u64,
            quantization: quantization(layers.first().map(|l| &l.mlp.down), &embed, q),
        };
        Ok(Decoder::new(Lfm2Model { cfg, embed, layers, embedding_norm, rope }, facts))
    }
}

impl TextDecoder for Lfm2Model {
    fn forward(&self, w: &mut GraphWriter, step: &StepDesc, inputs: StepInputs) -> Result<TensorId, String> {
        let StepInputs { tokens, positions, n_tokens: t, n_rows: r } = inputs;
        let cfg = &self.cfg;
        let d = cfg.hidden_size as u64;
        let eps = cfg.norm_eps;
        let seq = w.g.input(INPUT_TOKEN_SEQ, DType::I32, &[t]);
        let hd = cfg.head_dim() as i64;
        let rope = RopeInputs {
            positions,
            inv_freq: step_inv_freq(w.g, &self.rope, step),
            params: [hd, hd, 0],
            mscale: self.rope.mscale,
        };

        let mut h = w.embedding(tokens, t, &self.embed);
        for (i, layer) in self.layers.iter().enumerate() {
            let x = w.rms_norm(h, &[t, d], &layer.operator_norm, eps);
            let o = match &layer.op {
                Operator::Attention(a) => a.forward(w, x, t, i, &rope, eps),
                Operator::Conv(c) => c.forward(w, x, t, seq, i),
            };
            h = w.g.op(OpCode::Add, &[t, d], &[h, o]);

            let x = w.rms_norm(h, &[t, d], &layer.ffn_norm, eps);
            let m = layer.mlp.forward(w, x, t);
            h = w.g.op(OpCode::Add, &[t, d], &[h, m]);
        }

        // The final norm and the tied head.
        let h = inputs.output_rows(w, h, d);
        let h = w.rms_norm(h, &[r, d], &self.embedding_norm, eps);
        Ok(w.linear(h, r, &self.embed))
    }
}
