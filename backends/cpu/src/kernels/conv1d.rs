//! 1-D convolution over rows, channels last, for one sequence's padded input `p [rows, C_in]`:
//! `out[t, o] = bias[o] + Σ_k Σ_c w[o, k, c] · p[t·stride + k, g·C_in/groups + c]` with weights in
//! MLX's `[C_out, K, C_in/groups]` layout. With one group, a window of `K` consecutive input rows is
//! `K·C_in` contiguous floats, so the whole convolution is one `gemm` whose left operand's rows overlap
//! (rows `stride·C_in` apart) against the weights seen as `[C_out, K·C_in]`: no im2col copy.
//! Depthwise convolutions (LFM2's short conv) multiply and add per channel; other group counts copy
//! each group's windows (im2col) and `gemm` them.

use crate::pool;

use super::matmul::{gemm_strided, tile_rows};
use super::{Segment, SharedMut};
use crate::isa::Isa;
use crate::simd_kernel;

/// Output rows per task.
const ROWS_PER_TASK: usize = 32;

#[derive(Clone, Copy, Debug)]
pub struct ConvShape {
    pub c_in: usize,
    pub c_out: usize,
    pub kernel: usize,
    pub stride: usize,
    pub groups: usize,
}

impl ConvShape {
    /// Output rows of an input of `rows` padded rows.
    pub fn out_rows(&self, rows: usize) -> usize {
        if rows < self.kernel {
            0
        } else {
            (rows - self.kernel) / self.stride + 1
        }
    }
}

/// What comes before (and after) each sequence's rows.
pub enum Padding<'a> {
    /// This many zero rows on each side.
    Zeros(usize),
    /// Causal: the `K − 1` input rows carried from the sequence's earlier steps (`[K − 1, C_in]` at
    /// row `rows[i]` of `state` for segment `i`), replaced by its last `K − 1` rows after the step.
    Carried { state: &'a mut [f32], rows: &'a [usize] },
}

impl Padding<'_> {
    /// Rows before and after a sequence's own.
    fn rows(&self, sh: &ConvShape) -> (usize, usize) {
        match self {
            Padding::Zeros(p) => (*p, *p),
            Padding::Carried { .. } => (sh.kernel - 1, 0),
        }
    }

    /// Output rows of each segment.
    pub fn out_rows(&self, sh: &ConvShape, segs: &[Segment]) -> Vec<usize> {
        let (before, after) = self.rows(sh);
        segs.iter().map(|s| sh.out_rows(before + s.len() + after)).collect()
    }
}

/// Convolves each segment of `x [T, C_in]` over its padded rows into consecutive rows of `out`
/// (`Padding::out_rows` rows per segment, which the caller checked `out` holds). `padded` is scratch.
#[allow(clippy::too_many_arguments)]
pub fn conv1d_segments(
    isa: Isa,
    threads: usize,
    sh: ConvShape,
    x: &[f32],
    segs: &[Segment],
    mut padding: Padding,
    w: &[f32],
    bias: &[f32],
    out: &mut [f32],
    padded: &mut Vec<f32>,
) {
    let (c_in, c_out) = (sh.c_in, sh.c_out);
    let (before, after) = padding.rows(&sh);
    let carry = (sh.kernel - 1) * c_in;
    let out_rows = padding.out_rows(&sh, segs);
    let mut o0 = 0;
    for (i, s) in segs.iter().enumerate() {
        padded.clear();
        padded.resize((before + s.len() + after) * c_in, 0.0);
        if let Padding::Carried { state, rows } = &padding {
            padded[..carry].copy_from_slice(&state[rows[i] * carry..][..carry]);
        }
        padded[before * c_in..(before + s.len()) * c_in].copy_from_slice(&x[s.start * c_in..s.end * c_in]);
        conv1d(isa, threads, sh, padded, w, bias, &mut out[o0 * c_out..(o0 + out_rows[i]) * c_out]);
        o0 += out_rows[i];
        if let Padding::Carried { state, rows } = &mut padding {
            state[rows[i] * carry..][..carry].copy_from_slice(&padded[padded.len() - carry..]);
        }
    }
}

/// `out [t_out, C_out]` from the padded input `p [rows, C_in]` (`t_out` = [`ConvShape::out_rows`]);
/// `w` is f32 `[C_out, K, C_in/groups]`, `bias` empty or `[C_out]`.
pub fn conv1d(isa: Isa, threads: usize, sh: ConvShape, p: &[f32], w: &[f32], bias: &[f32], out: &mut [f32]) {
    let ConvShape { c_in, c_out, kernel, stride, groups } = sh;
    let t_out = out.len() / c_out;
    if t_out == 0 {
        return;
    }
    let (cin_g, cout_g) = (c_in / groups, c_out / groups);
    if cin_g == 1 && cout_g == 1 {
        // Depthwise: weights as [K, C] so each tap is a contiguous row of per-channel factors.
        let mut wt = vec![0f32; kernel * c_in];
        for c in 0..c_in {
            for k in 0..kernel {
                wt[k * c_in + c] = w[c * kernel + k];
            }
        }
        pool::chunks_mut(out, ROWS_PER_TASK * c_out, |chunk, o| {
            for (i, row) in o.chunks_exact_mut(c_out).enumerate() {
                let t = chunk * ROWS_PER_TASK + i;
                let win = &p[t * stride * c_in..(t * stride + kernel) * c_in];
                depthwise_row::run(isa, win, &wt, bias, row);
            }
        });
        return;
    }
    let kk = kernel * cin_g;
    let out_ptr = SharedMut(out.as_mut_ptr());
    // Each task: a chunk of output rows × a tile of output channels inside one group.
    let nc = if groups == 1 { tile_rows(c_out, threads) } else { cout_g };
    let tiles_per_group = cout_g.div_ceil(nc);
    let n_tasks = t_out.div_ceil(ROWS_PER_TASK) * groups * tiles_per_group;
    pool::for_each_init(n_tasks, Vec::<f32>::new, |cols, task| {
        let (chunk, rest) = (task / (groups * tiles_per_group), task % (groups * tiles_per_group));
        let (g, tile) = (rest / tiles_per_group, rest % tiles_per_group);
        let r0 = chunk * ROWS_PER_TASK;
        let m = ROWS_PER_TASK.min(t_out - r0);
        let n0 = g * cout_g + tile * nc;
        let n = nc.min((g + 1) * cout_g - n0);
        // SAFETY: this task alone writes rows r0..r0+m, columns n0..n0+n of `out`.
        let dst = unsafe { out_ptr.ptr().add(r0 * c_out + n0) };
        if !bias.is_empty() {
            for r in 0..m {
                // SAFETY: as above.
                unsafe { out_ptr.slice((r0 + r) * c_out + n0, n) }.copy_from_slice(&bias[n0..n0 + n]);
            }
        }
        let rhs = w[n0 * kk..(n0 + n) * kk].as_ptr();
        if groups == 1 {
            // Window t is p[t·stride·C_in ..][..K·C_in]: rows of the left operand, `stride·C_in` apart.
            let lhs = &p[r0 * stride * c_in..((r0 + m - 1) * stride + kernel) * c_in];
            // SAFETY: `lhs` holds m rows of `kk` at that stride; `rhs` n rows of `kk`; `dst` is ours.
            unsafe { gemm_strided(m, n, kk, dst, c_out, !bias.is_empty(), lhs.as_ptr(), stride * c_in, rhs, true) };
        } else {
            cols.resize(m * kk, 0.0);
            for r in 0..m {
                let t = (r0 + r) * stride;
                for k in 0..kernel {
                    let src = &p[(t + k) * c_in + g * cin_g..][..cin_g];
                    cols[r * kk + k * cin_g..][..cin_g].copy_from_slice(src);
                }
            }
            // SAFETY: `cols` is [m, kk]; `rhs` n rows of `kk`; `dst` is ours.
            unsafe { gemm_strided(m, n, kk, dst, c_out, !bias.is_empty(), cols.as_ptr(), kk, rhs, true) };
        }
    });
}

simd_kernel! {
    /// One output row of a depthwise convolution: `out[c] = bias[c] + Σ_k win[k, c] · wt[k, c]`
    /// (`bias` empty for none).
    pub fn depthwise_row(win: &[f32], wt: &[f32], bias: &[f32], out: &mut [f32]) {
        let c = out.len();
        if bias.is_empty() {
            out.fill(0.0);
        } else {
            out.copy_from_slice(bias);
        }
        for (x, w) in win.chunks_exact(c).zip(wt.chunks_exact(c)) {
            for i in 0..c {
                out[i] = x[i].mul_add(w[i], out[i]);
            }
        }
    }
}

/// PyTorch's conv weight `[C_out, C_in/g, K]` rearranged to the `[C_out, K, C_in/g]` the kernels read.
pub fn torch_to_mlx_layout(w: &[f32], c_out: usize, c_in_g: usize, kernel: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; c_out * kernel * c_in_g];
    for (src, dst) in w.chunks_exact(c_in_g * kernel).zip(out.chunks_exact_mut(kernel * c_in_g)) {
        for c in 0..c_in_g {
            for k in 0..kernel {
                dst[k * c_in_g + c] = src[c * kernel + k];
            }
        }
    }
    out
}
