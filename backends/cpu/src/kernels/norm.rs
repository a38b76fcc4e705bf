//! RMS norm and layer norm.

use crate::isa::Isa;
use crate::pool;
use crate::simd_kernel;

use super::Floats;

/// Values per task of the row-wise norms: a decode step's few rows are one task (a fan-out costs
/// more than normalising them).
const CHUNK: usize = 16 * 1024;

simd_kernel! {
    /// RMS-normalises each row of `w.len()` values of `x` into `out`, times `w`.
    pub fn rms_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
        let d = w.len();
        for (o, xs) in out.chunks_exact_mut(d).zip(x.chunks_exact(d)) {
            let mut acc = [0f32; 8];
            let mut chunks = xs.chunks_exact(8);
            for c in &mut chunks {
                for k in 0..8 {
                    acc[k] += c[k] * c[k];
                }
            }
            let mut ss: f32 = acc.iter().sum();
            ss += chunks.remainder().iter().map(|v| v * v).sum::<f32>();
            let inv = 1.0 / (ss / d as f32 + eps).sqrt();
            for ((o, &xv), &wv) in o.iter_mut().zip(xs).zip(w) {
                *o = xv * inv * wv;
            }
        }
    }
}

/// RMS norm over groups of `w.len()` columns; `unit_offset` scales by `1 + w` (Gemma).
pub fn rms_norm(isa: Isa, x: &[f32], w: Floats, eps: f32, unit_offset: bool, out: &mut [f32]) {
    let d = w.len();
    if d == 0 {
        return;
    }
    let mut wf = vec![0f32; d];
    w.to_f32(0, &mut wf);
    if unit_offset {
        wf.iter_mut().for_each(|v| *v += 1.0);
    }
    let rows = (CHUNK / d).max(1) * d;
    pool::zip_chunks(out, rows, x, rows, |_, o, xs| rms_rows::run(isa, xs, &wf, eps, o));
}

/// Layer norm over the last `w.len()` columns.
pub fn layer_norm(x: &[f32], w: Floats, b: Floats, eps: f32, out: &mut [f32]) {
    let d = w.len();
    let mut wf = vec![0f32; d];
    let mut bf = vec![0f32; d];
    w.to_f32(0, &mut wf);
    b.to_f32(0, &mut bf);
    pool::zip_chunks(out, d, x, d, |_, o, xs| {
        let mean = xs.iter().sum::<f32>() / d as f32;
        let var = xs.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d as f32;
        let inv = 1.0 / (var + eps).sqrt();
        for i in 0..d {
            o[i] = (xs[i] - mean) * inv * wf[i] + bf[i];
        }
    });
}

/// `x / max(‖x‖₂, eps)` per row of `c` columns.
pub fn l2_normalize(x: &[f32], c: usize, eps: f32, out: &mut [f32]) {
    pool::zip_chunks(out, c, x, c, |_, o, xs| {
        let mut acc = [0f32; 8];
        let mut chunks = xs.chunks_exact(8);
        for ch in &mut chunks {
            for k in 0..8 {
                acc[k] += ch[k] * ch[k];
            }
        }
        let ss = acc.iter().sum::<f32>() + chunks.remainder().iter().map(|v| v * v).sum::<f32>();
        let inv = 1.0 / ss.sqrt().max(eps);
        for (o, &v) in o.iter_mut().zip(xs) {
            *o = v * inv;
        }
    });
}
