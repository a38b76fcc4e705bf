//! Rotary position embedding.

use crate::isa::Isa;
use crate::pool;
use crate::simd_kernel;

/// Values per task: a decode step's few rows are one task (a fan-out costs more than rotating them).
const CHUNK: usize = 16 * 1024;

/// The rotation of each position: `(cos θ, sin θ) · mscale` for `θ = position · inv_freq[i]`, kept
/// between calls: every layer's q and k of a step rotate by the same positions and frequencies, so
/// a step computes its sines once instead of twice per layer.
#[derive(Default)]
pub struct RopeTable {
    positions: Vec<i32>,
    inv_freq: Vec<f32>,
    mscale: f32,
    /// `[positions, rot / 2]` cosines, then as many sines.
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl RopeTable {
    /// The table for these arguments (recomputed only when they changed).
    fn update(&mut self, positions: &[i32], inv_freq: &[f32], mscale: f32) {
        if self.positions == positions && self.inv_freq == inv_freq && self.mscale.to_bits() == mscale.to_bits() {
            return;
        }
        let half = inv_freq.len();
        self.cos.clear();
        self.sin.clear();
        for &p in positions {
            for &f in inv_freq {
                let theta = p as f32 * f;
                self.cos.push(theta.cos() * mscale);
                self.sin.push(theta.sin() * mscale);
            }
        }
        debug_assert_eq!(self.cos.len(), positions.len() * half);
        self.positions.clear();
        self.positions.extend_from_slice(positions);
        self.inv_freq.clear();
        self.inv_freq.extend_from_slice(inv_freq);
        self.mscale = mscale;
    }
}

simd_kernel! {
    /// Rotates the heads of rows of `cols` values, row `t` by `cos`/`sin` row `t` (`rot / 2` each).
    pub fn rotate_rows(
        x: &[f32],
        cols: usize,
        cos: &[f32],
        sin: &[f32],
        head_dim: usize,
        rot: usize,
        traditional: bool,
        out: &mut [f32],
    ) {
        let half = rot / 2;
        for (t, (o, xs)) in out.chunks_exact_mut(cols).zip(x.chunks_exact(cols)).enumerate() {
            let (c, s) = (&cos[t * half..(t + 1) * half], &sin[t * half..(t + 1) * half]);
            for (oo, xo) in o.chunks_exact_mut(head_dim).zip(xs.chunks_exact(head_dim)) {
                if traditional {
                    for i in 0..half {
                        let (x1, x2) = (xo[2 * i], xo[2 * i + 1]);
                        oo[2 * i] = x1 * c[i] - x2 * s[i];
                        oo[2 * i + 1] = x2 * c[i] + x1 * s[i];
                    }
                } else {
                    let (x1, x2) = (&xo[..half], &xo[half..rot]);
                    let (o1, rest) = oo.split_at_mut(half);
                    for i in 0..half {
                        o1[i] = x1[i] * c[i] - x2[i] * s[i];
                    }
                    for i in 0..half {
                        rest[i] = x2[i] * c[i] + x1[i] * s[i];
                    }
                }
                oo[rot..].copy_from_slice(&xo[rot..]);
            }
        }
    }
}

/// Rotates each head of `x [T, H*head_dim]` by `positions[t] * inv_freq`.
/// `traditional` pairs (2i, 2i+1); otherwise (i, i + rot/2) as in NeoX/HF. Dims past `rot` pass through.
#[allow(clippy::too_many_arguments)] // the op's operands and attributes, kept flat for the hot path
pub fn rope(
    isa: Isa,
    table: &mut RopeTable,
    x: &[f32],
    positions: &[i32],
    inv_freq: &[f32],
    head_dim: usize,
    rot: usize,
    traditional: bool,
    mscale: f32,
    out: &mut [f32],
) {
    if positions.is_empty() || x.is_empty() {
        return;
    }
    table.update(positions, inv_freq, mscale);
    let cols = x.len() / positions.len();
    let half = rot / 2;
    let rows = (CHUNK / cols.max(1)).max(1);
    let table = &*table;
    pool::zip_chunks(out, rows * cols, x, rows * cols, |i, o, xs| {
        let (t0, n) = (i * rows, xs.len() / cols);
        let (c, s) = (&table.cos[t0 * half..(t0 + n) * half], &table.sin[t0 * half..(t0 + n) * half]);
        rotate_rows::run(isa, xs, cols, c, s, head_dim, rot, traditional, o);
    });
}
