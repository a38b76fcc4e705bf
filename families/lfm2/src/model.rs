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

use mlxcel_family_kit::rope::step_inv_freq;
use mlxcel_family_kit::{
    rope_freqs, AttentionShape, GraphWriter, Linear, RopeFreqs, RopeInputs, SelfAttention, WeightRef, WeightTable,
};
use mlxcel_plugin_api::{
    conv_state_elems, DType, FamilyModel, Graph, KvKind, KvLayerDesc, ModelDescription, OpCode, OutputKind,
    PluginError, StepDesc, Task, TensorId, Versioned, CONV_CAUSAL_STATE, INPUT_OUTPUT_ROWS, INPUT_POSITIONS,
    INPUT_TOKENS, INPUT_TOKEN_SEQ,
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

/// What a layer does before its MLP. (One per layer, made once at load: the variants' sizes do not matter.)
#[allow(clippy::large_enum_variant)]
enum Operator {
    Attention(SelfAttention),
    Conv(ShortConv),
}

struct Mlp {
    w1: Linear,
    w3: Linear,
    w2: Linear,
}

struct Layer {
    operator_norm: WeightRef,
    op: Operator,
    ffn_norm: WeightRef,
    mlp: Mlp,
}

pub struct Lfm2Model {
    pub cfg: Lfm2Config,
    embed: Linear,
    layers: Vec<Layer>,
    embedding_norm: WeightRef,
    rope: RopeFreqs,
    kv_layers: Vec<KvLayerDesc>,
    used_weights: Vec<u32>,
    quantization: String,
    /// The most recent step's graph, owned here as the ABI requires.
    graph: Graph,
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
    pub fn new(cfg: Lfm2Config, table: &WeightTable) -> Result<Lfm2Model, String> {
        let (d, hd, ff) = (cfg.hidden_size, cfg.head_dim(), cfg.ff_dim());
        let (nh, nkv) = (cfg.num_attention_heads, cfg.n_kv_heads());
        let kernel = cfg.conv_l_cache as u64;
        let q = cfg.quantization.as_ref();
        let vector = |name: String, n: usize| table.float(&name, &[n as u64]);
        let lin = |name: String, i: usize, o: usize, bias: bool| Linear::load(table, q, &name, i, o, bias);

        let embed = lin("model.embed_tokens".into(), d, cfg.vocab_size, false)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        let mut kv_layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let op = if cfg.is_attention(i) {
                let a = format!("{p}.self_attn");
                kv_layers.push(KvLayerDesc {
                    kind: KvKind::Full as u32,
                    n_kv_heads: nkv as u32,
                    head_dim: hd as u32,
                    ..KvLayerDesc::zeroed()
                });
                Operator::Attention(SelfAttention {
                    q: lin(format!("{a}.q_proj"), d, nh * hd, false)?,
                    k: lin(format!("{a}.k_proj"), d, nkv * hd, false)?,
                    v: lin(format!("{a}.v_proj"), d, nkv * hd, false)?,
                    o: lin(format!("{a}.out_proj"), nh * hd, d, false)?,
                    q_norm: Some(vector(format!("{a}.q_layernorm.weight"), hd)?),
                    k_norm: Some(vector(format!("{a}.k_layernorm.weight"), hd)?),
                    shape: AttentionShape {
                        hidden: d,
                        n_heads: nh,
                        n_kv_heads: nkv,
                        head_dim: hd,
                        qkv_bias: false,
                        o_bias: false,
                        qk_norm: true,
                        norm_plus_one: false,
                        scale: None,
                        softcap: 0.0,
                        window: 0,
                    },
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
                mlp: Mlp {
                    w1: lin(format!("{p}.feed_forward.w1"), d, ff, false)?,
                    w3: lin(format!("{p}.feed_forward.w3"), d, ff, false)?,
                    w2: lin(format!("{p}.feed_forward.w2"), ff, d, false)?,
                },
            });
        }
        let embedding_norm = vector("model.embedding_norm.weight".into(), d)?;
        let rope = rope_freqs(hd, cfg.rope_theta, None, cfg.max_position_embeddings)?;

        let mut used: Vec<u32> = embed.indices();
        for l in &layers {
            used.extend([l.operator_norm.index, l.ffn_norm.index]);
            match &l.op {
                Operator::Attention(a) => used.extend(a.indices()),
                Operator::Conv(c) => {
                    used.extend(c.in_proj.indices());
                    used.push(c.conv.index);
                    used.extend(c.conv_bias.as_ref().map(|b| b.index));
                    used.extend(c.out_proj.indices());
                }
            }
            for lin in [&l.mlp.w1, &l.mlp.w3, &l.mlp.w2] {
                used.extend(lin.indices());
            }
        }
        used.push(embedding_norm.index);
        used.sort_unstable();
        used.dedup();

        let first = layers.first().and_then(|l| l.mlp.w2.describe_quant()).or_else(|| embed.describe_quant());
        let quantization = mlxcel_family_kit::quant::describe(first, cfg.quantization.as_ref());
        Ok(Lfm2Model {
            cfg,
            embed,
            layers,
            embedding_norm,
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
        let attention = (c.num_attention_heads + 2 * c.n_kv_heads()) * c.head_dim();
        let per = 5 * c.hidden_size + (3 * c.hidden_size).max(attention) + 3 * c.ff_dim();
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
        let eps = cfg.norm_eps;

        let mut graph = std::mem::take(&mut self.graph);
        graph.nodes.clear();
        graph.constants.clear();
        graph.outputs.clear();
        let mut w = GraphWriter::new(&mut graph);

        let tokens = w.g.input(INPUT_TOKENS, DType::I32, &[t]);
        let positions = w.g.input(INPUT_POSITIONS, DType::I32, &[t]);
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
                Operator::Attention(a) => a.forward(&mut w, x, t, i, &rope, eps),
                Operator::Conv(c) => c.forward(&mut w, x, t, seq, i),
            };
            h = w.g.op(OpCode::Add, &[t, d], &[h, o]);

            let x = w.rms_norm(h, &[t, d], &layer.ffn_norm, eps);
            let ff = layer.mlp.w1.out_features;
            let gate = w.linear(x, t, &layer.mlp.w1);
            let up = w.linear(x, t, &layer.mlp.w3);
            let m = w.g.op(OpCode::SiluMul, &[t, ff], &[gate, up]);
            let down = w.linear(m, t, &layer.mlp.w2);
            h = w.g.op(OpCode::Add, &[t, d], &[h, down]);
        }

        // Only the rows that need logits go through the final norm and the tied head.
        let rows = w.g.input(INPUT_OUTPUT_ROWS, DType::I32, &[r]);
        let h = w.g.op(OpCode::GetRows, &[r, d], &[h, rows]);
        let h = w.rms_norm(h, &[r, d], &self.embedding_norm, eps);
        let logits = w.linear(h, r, &self.embed);
        w.g.mark_output(logits);
        self.graph = graph;
        Ok(())
    }
}

impl FamilyModel for Lfm2Model {
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
