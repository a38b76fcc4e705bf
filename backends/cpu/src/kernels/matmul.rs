//! Float linear layers: `out[T, N] = x[T, K] · w[N, K]ᵀ`. Prefill goes through `gemm` on tiles of weight
//! rows converted to f32 (no whole-matrix conversion); decode uses a row-wise dot product.

use crate::pool;

use super::{Floats, SharedMut};
use crate::isa::Isa;
use crate::simd_kernel;

simd_kernel! {
    /// `Σ a[i]·b[i]` with 16 independent accumulators so it vectorises.
    pub fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (a, b) = (&a[..n], &b[..n]);
        let mut acc = [0f32; 16];
        let mut ca = a.chunks_exact(16);
        let mut cb = b.chunks_exact(16);
        for (x, y) in (&mut ca).zip(&mut cb) {
            for k in 0..16 {
                acc[k] = x[k].mul_add(y[k], acc[k]);
            }
        }
        let mut s = 0f32;
        for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
            s += x * y;
        }
        let mut t = [0f32; 8];
        for k in 0..8 {
            t[k] = acc[k] + acc[k + 8];
        }
        s + t.iter().sum::<f32>()
    }
}

/// Number of weight rows per tile: enough tiles to keep every thread busy, small enough for cache.
pub fn tile_rows(n: usize, threads: usize) -> usize {
    let want = n.div_ceil(4 * threads.max(1));
    want.clamp(16, 256).div_ceil(16) * 16
}

/// Single-threaded `dst[m, n] = lhs[m, k] · rhs` with `gemm` (`+=` when `accumulate`), all row-major:
/// `lhs` rows are `k` apart, `dst` rows `dst_stride` apart; `rhs` is `[n, k]` used transposed (a
/// weight matrix, or keys) when `rhs_transposed`, else `[k, n]`.
///
/// # Safety
/// The pointers must hold those shapes, and no other thread may write the `dst` elements.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_rows(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_stride: usize,
    accumulate: bool,
    lhs: *const f32,
    rhs: *const f32,
    rhs_transposed: bool,
) {
    // SAFETY: the caller's contract, with `lhs` rows `k` apart.
    unsafe { gemm_strided(m, n, k, dst, dst_stride, accumulate, lhs, k, rhs, rhs_transposed) }
}

/// [`gemm_rows`] with `lhs` rows `lhs_stride` apart (they may overlap: a convolution's windows over
/// consecutive input rows).
///
/// # Safety
/// As for [`gemm_rows`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_strided(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_stride: usize,
    accumulate: bool,
    lhs: *const f32,
    lhs_stride: usize,
    rhs: *const f32,
    rhs_transposed: bool,
) {
    // gemm's strides: (column stride, row stride) per operand; `rhs` is viewed as [k, n].
    let (rhs_cs, rhs_rs) = if rhs_transposed { (k as isize, 1) } else { (1, n as isize) };
    // SAFETY: the caller's contract.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            dst_stride as isize,
            accumulate,
            lhs,
            1,
            lhs_stride as isize,
            rhs,
            rhs_cs,
            rhs_rs,
            if accumulate { 1.0 } else { 0.0 },
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    };
}

/// `out[t, n0..n0+nc] = x[t, :] · tile[nc, K]ᵀ` with gemm, single-threaded (callers parallelise tiles).
///
/// # Safety
/// `out` points to a `[T, n]` row-major matrix whose columns `n0..n0+nc` only this call writes.
#[allow(clippy::too_many_arguments)] // a kernel's shape, strides and destination, kept flat for the hot path
pub unsafe fn gemm_tile(
    x: &[f32],
    t: usize,
    k: usize,
    tile: &[f32],
    nc: usize,
    out: SharedMut<f32>,
    n: usize,
    n0: usize,
) {
    gemm_rows(t, nc, k, out.ptr().add(n0), n, false, x.as_ptr(), tile.as_ptr(), true);
}

/// `out[T, N] = x[T, K] · w[N, K]ᵀ` for float weights.
/// Below this many tokens of a sequence, float matmuls take per-row dots instead of gemm tiles.
pub const ROW_DOT_MAX_TOKENS: usize = 3;

/// `out[t, n] = x[t, k] · wᵀ`; `row_dots` picks per-row dots (few tokens) over gemm tiles. The caller
/// chooses it per sequence (see [`ROW_DOT_MAX_TOKENS`]) so results do not depend on batch-mates.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    isa: Isa,
    threads: usize,
    x: &[f32],
    t: usize,
    k: usize,
    w: Floats,
    n: usize,
    out: &mut [f32],
    row_dots: bool,
) {
    if row_dots {
        // Decode: one pass over the weights, each row dotted with every token.
        let rows_per_task = 16;
        out.fill(0.0);
        let out_ptr = SharedMut(out.as_mut_ptr());
        pool::for_each_init(
            n.div_ceil(rows_per_task),
            || vec![0f32; k],
            |row, chunk| {
                for r in chunk * rows_per_task..((chunk + 1) * rows_per_task).min(n) {
                    let wr: &[f32] = match w {
                        Floats::F32(s) => &s[r * k..(r + 1) * k],
                        _ => {
                            w.to_f32(r * k, row);
                            row
                        }
                    };
                    for ti in 0..t {
                        let v = dot::run(isa, &x[ti * k..(ti + 1) * k], wr);
                        unsafe { *out_ptr.ptr().add(ti * n + r) = v };
                    }
                }
            },
        );
        return;
    }
    let nc = tile_rows(n, threads);
    let out_ptr = SharedMut(out.as_mut_ptr());
    pool::for_each_init(n.div_ceil(nc), Vec::<f32>::new, |scratch, ti| {
        let n0 = ti * nc;
        let rows = nc.min(n - n0);
        let tile: &[f32] = match w {
            Floats::F32(s) => &s[n0 * k..(n0 + rows) * k],
            _ => {
                scratch.resize(rows * k, 0.0);
                w.to_f32(n0 * k, scratch);
                scratch
            }
        };
        unsafe { gemm_tile(x, t, k, tile, rows, out_ptr, n, n0) };
    });
}
