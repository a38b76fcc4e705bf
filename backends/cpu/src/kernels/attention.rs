//! Causal attention over the paged KV cache with an online softmax: one pass over the keys per query
//! head, never a full score matrix.

use rayon::prelude::*;

use super::matmul::{axpy, dot};
use crate::isa::Isa;

/// Where keys live: the step's sequence bookkeeping, borrowed from the host.
pub struct PagedLayout<'a> {
    pub token_seq: &'a [u32],
    pub positions: &'a [i32],
    pub slot_mapping: &'a [i64],
    pub block_tables: &'a [u32],
    pub max_blocks_per_seq: usize,
    pub block_size: usize,
}

impl PagedLayout<'_> {
    #[inline]
    fn slot(&self, seq: usize, pos: usize) -> usize {
        let block = self.block_tables[seq * self.max_blocks_per_seq + pos / self.block_size] as usize;
        block * self.block_size + pos % self.block_size
    }
}

/// Copies each token's K and V rows (`[Hkv*Dh]`) into its cache slot.
pub fn write_kv(layout: &PagedLayout, k: &[f32], v: &[f32], row: usize, k_cache: &mut [f32], v_cache: &mut [f32]) {
    for (t, &slot) in layout.slot_mapping.iter().enumerate() {
        let dst = slot as usize * row;
        k_cache[dst..dst + row].copy_from_slice(&k[t * row..(t + 1) * row]);
        v_cache[dst..dst + row].copy_from_slice(&v[t * row..(t + 1) * row]);
    }
}

/// Attention parameters of one layer.
#[derive(Clone, Copy)]
pub struct AttentionShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Attend only to positions `p` with `pos - p < window` (0 = all).
    pub window: usize,
    pub scale: f32,
    /// `cap * tanh(score / cap)` on scores when > 0.
    pub softcap: f32,
}

/// `out[t, h*Dh..]` = softmax over the context of token `t` of `q·k` times `v`.
pub fn attention(
    isa: Isa,
    layout: &PagedLayout,
    shape: AttentionShape,
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    out: &mut [f32],
) {
    let AttentionShape { n_heads, n_kv_heads, head_dim: dh, window, scale, softcap } = shape;
    let group = n_heads / n_kv_heads;
    let kv_row = n_kv_heads * dh;
    out.par_chunks_mut(dh).enumerate().for_each_init(
        || vec![0f32; dh],
        |acc, (i, o)| {
            let (t, h) = (i / n_heads, i % n_heads);
            let kvh = h / group;
            let seq = layout.token_seq[t] as usize;
            let pos = layout.positions[t].max(0) as usize;
            let start = if window > 0 { (pos + 1).saturating_sub(window) } else { 0 };
            let qh = &q[t * n_heads * dh + h * dh..][..dh];
            acc.fill(0.0);
            let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
            for p in start..=pos {
                let base = layout.slot(seq, p) * kv_row + kvh * dh;
                let mut s = dot::run(isa, qh, &k_cache[base..base + dh]) * scale;
                if softcap > 0.0 {
                    s = softcap * (s / softcap).tanh();
                }
                if s > m {
                    let c = (m - s).exp();
                    l *= c;
                    acc.iter_mut().for_each(|a| *a *= c);
                    m = s;
                }
                let e = (s - m).exp();
                l += e;
                axpy::run(isa, e, &v_cache[base..base + dh], acc);
            }
            let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
            for (ov, a) in o.iter_mut().zip(acc.iter()) {
                *ov = a * inv;
            }
        },
    );
}
