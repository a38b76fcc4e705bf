//! Softmax over groups of columns (router probabilities, classifier heads).

use crate::pool;

use super::math::exp_approx;
use crate::isa::Isa;
use crate::simd_kernel;

/// Elements per parallel task (rounded to whole groups).
const CHUNK: usize = 16 * 1024;

/// `out[g] = softmax(x[g])` for every group of `d` consecutive values.
pub fn softmax(isa: Isa, x: &[f32], d: usize, out: &mut [f32]) {
    let per_task = CHUNK.div_ceil(d).max(1) * d;
    pool::zip_chunks(out, per_task, x, per_task, |_, o, xs| {
        for (og, xg) in o.chunks_exact_mut(d).zip(xs.chunks_exact(d)) {
            softmax_group::run(isa, xg, og);
        }
    });
}

simd_kernel! {
    /// `out = e^(x − max x) / Σ e^(x − max x)`, with eight-lane reductions so the loops vectorise.
    pub fn softmax_group(x: &[f32], out: &mut [f32]) {
        let mut lanes = [f32::NEG_INFINITY; 8];
        let mut chunks = x.chunks_exact(8);
        for c in &mut chunks {
            for l in 0..8 {
                lanes[l] = if c[l] > lanes[l] { c[l] } else { lanes[l] };
            }
        }
        let m = chunks.remainder().iter().chain(&lanes).fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let mut sums = [0f32; 8];
        let mut oc = out.chunks_exact_mut(8);
        let mut xc = x.chunks_exact(8);
        for (o, c) in (&mut oc).zip(&mut xc) {
            for l in 0..8 {
                o[l] = exp_approx(c[l] - m);
                sums[l] += o[l];
            }
        }
        let mut sum = sums.iter().sum::<f32>();
        for (o, &v) in oc.into_remainder().iter_mut().zip(xc.remainder()) {
            *o = exp_approx(v - m);
            sum += *o;
        }
        let inv = 1.0 / sum;
        out.iter_mut().for_each(|o| *o *= inv);
    }
}
