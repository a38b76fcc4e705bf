//! Rotary position embedding.

use crate::pool;

/// Rotates each head of `x [T, H*head_dim]` by `positions[t] * inv_freq`.
/// `traditional` pairs (2i, 2i+1); otherwise (i, i + rot/2) as in NeoX/HF. Dims past `rot` pass through.
#[allow(clippy::too_many_arguments)] // the op's operands and attributes, kept flat for the hot path
pub fn rope(
    x: &[f32],
    positions: &[i32],
    inv_freq: &[f32],
    head_dim: usize,
    rot: usize,
    traditional: bool,
    mscale: f32,
    out: &mut [f32],
) {
    let cols = x.len() / positions.len().max(1);
    let half = rot / 2;
    pool::zip_chunks(out, cols, x, cols, |t, o, xs| {
        let p = positions[t] as f32;
        let mut cs = vec![(0f32, 0f32); half];
        for (i, c) in cs.iter_mut().enumerate() {
            let theta = p * inv_freq[i];
            *c = (theta.cos() * mscale, theta.sin() * mscale);
        }
        for h in 0..cols / head_dim {
            let xo = &xs[h * head_dim..(h + 1) * head_dim];
            let oo = &mut o[h * head_dim..(h + 1) * head_dim];
            for (i, &(c, s)) in cs.iter().enumerate() {
                let (a, b) = if traditional { (2 * i, 2 * i + 1) } else { (i, i + half) };
                let (x1, x2) = (xo[a], xo[b]);
                oo[a] = x1 * c - x2 * s;
                oo[b] = x2 * c + x1 * s;
            }
            oo[rot..].copy_from_slice(&xo[rot..]);
        }
    });
}
