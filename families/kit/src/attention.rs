//! The grouped-query self-attention block most decoders share: q/k/v projections (with optional
//! biases), optional per-head RMS norm on q and k, RoPE, paged attention over the layer's KV cache
//! (full or sliding window, optionally soft-capped and scaled by a configured query scalar), o_proj.

use mlxcel_plugin_api::{KvKind, KvLayerDesc, OpCode, TensorId, Versioned};
use serde_json::Value;

use crate::weights::{GraphWriter, Linear, WeightRef, WeightTable, Weights};

/// The shape of one layer's attention.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub hidden: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub qkv_bias: bool,
    pub o_bias: bool,
    /// Per-head RMS norm on q and k (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// The q/k norms scale by `(1 + w)`: the checkpoint stores the offset from one (Gemma 3).
    pub norm_plus_one: bool,
    /// Attention-score scale; `None` is `1/√head_dim` (Gemma 2 and 3: `1/√query_pre_attn_scalar`).
    pub scale: Option<f32>,
    /// Soft-cap of the attention scores, `cap · tanh(s / cap)` (Gemma 2; 0 = none).
    pub softcap: f32,
    /// Sliding window (0 = full attention).
    pub window: usize,
}

impl AttentionShape {
    /// Plain attention of these sizes: no biases, no q/k norm, score scale `1/√head_dim`, no soft-cap,
    /// full context. Variants set their fields over it (`AttentionShape { qk_norm: true, ..base }`).
    pub fn new(hidden: usize, n_heads: usize, n_kv_heads: usize, head_dim: usize) -> AttentionShape {
        AttentionShape {
            hidden,
            n_heads,
            n_kv_heads,
            head_dim,
            qkv_bias: false,
            o_bias: false,
            qk_norm: false,
            norm_plus_one: false,
            scale: None,
            softcap: 0.0,
            window: 0,
        }
    }

    /// The layer's KV cache: full, or a sliding window.
    pub fn kv_layer(&self) -> KvLayerDesc {
        KvLayerDesc {
            kind: if self.window > 0 { KvKind::SlidingWindow } else { KvKind::Full } as u32,
            n_kv_heads: self.n_kv_heads as u32,
            head_dim: self.head_dim as u32,
            window: self.window as u32,
            ..KvLayerDesc::zeroed()
        }
    }

    /// f32 values of one token's q, k and v.
    pub fn qkv_width(&self) -> usize {
        (self.n_heads + 2 * self.n_kv_heads) * self.head_dim
    }
}

/// One layer's weights.
pub struct SelfAttention {
    pub q: Linear,
    pub k: Linear,
    pub v: Linear,
    pub o: Linear,
    pub q_norm: Option<WeightRef>,
    pub k_norm: Option<WeightRef>,
    pub shape: AttentionShape,
}

/// The step-wide inputs every layer's RoPE reads.
#[derive(Debug, Clone, Copy)]
pub struct RopeInputs {
    pub positions: TensorId,
    pub inv_freq: TensorId,
    /// `[head_dim, rotary dims, traditional]` as the `Rope` op takes them.
    pub params: [i64; 3],
    pub mscale: f32,
}

impl SelfAttention {
    /// Resolves `{prefix}.{q,k,v,o}_proj` and, with `qk_norm`, `{prefix}.{q,k}_norm.weight`.
    pub fn load(
        table: &WeightTable,
        quant: Option<&Value>,
        prefix: &str,
        shape: AttentionShape,
    ) -> Result<SelfAttention, String> {
        let AttentionShape { hidden: d, n_heads: nh, n_kv_heads: nkv, head_dim: hd, .. } = shape;
        let lin = |name: &str, i: usize, o: usize, bias: bool| {
            Linear::load(table, quant, &format!("{prefix}.{name}"), i, o, bias)
        };
        let norm = |name: &str| -> Result<Option<WeightRef>, String> {
            if shape.qk_norm {
                table.float(&format!("{prefix}.{name}.weight"), &[hd as u64]).map(Some)
            } else {
                Ok(None)
            }
        };
        Ok(SelfAttention {
            q: lin("q_proj", d, nh * hd, shape.qkv_bias)?,
            k: lin("k_proj", d, nkv * hd, shape.qkv_bias)?,
            v: lin("v_proj", d, nkv * hd, shape.qkv_bias)?,
            o: lin("o_proj", nh * hd, d, shape.o_bias)?,
            q_norm: norm("q_norm")?,
            k_norm: norm("k_norm")?,
            shape,
        })
    }

    /// `o_proj(attention(rope(q), rope(k), v))` for `t` tokens of `x`, through KV cache `layer`.
    pub fn forward(
        &self,
        w: &mut GraphWriter,
        x: TensorId,
        t: u64,
        layer: usize,
        rope: &RopeInputs,
        eps: f32,
    ) -> TensorId {
        let s = self.shape;
        let (nh, nkv, hd) = (s.n_heads as u64, s.n_kv_heads as u64, s.head_dim as u64);
        let (q, k, v) = self.project(w, x, t, rope, eps);
        let attn = w.g.op_with(
            OpCode::Attention,
            &[t, nh * hd],
            &[q, k, v],
            &[layer as i64, nh as i64, nkv as i64, hd as i64, s.window as i64],
            &[s.scale.unwrap_or(1.0 / (hd as f32).sqrt()), s.softcap],
        );
        w.linear(attn, t, &self.o)
    }
}

impl Weights for SelfAttention {
    fn indices(&self) -> Vec<u32> {
        let mut v: Vec<u32> = [&self.q, &self.k, &self.v, &self.o].iter().flat_map(|l| l.indices()).collect();
        v.extend(self.q_norm.iter().chain(self.k_norm.iter()).map(|w| w.index));
        v
    }
}
