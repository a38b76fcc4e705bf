//! Float linear layers: `out[T, N] = x[T, K] · w[N, K]ᵀ`. Prefill goes through `gemm` on tiles of weight
//! rows converted to f32 (no whole-matrix conversion); decode (`row_token_dots`) passes over each row once,
//! widening its bf16 or f16 values in registers, and dots it with every token of the step.

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
        dot_sum(&acc, s)
    }
}

/// The end of [`dot`]: its sixteen lanes folded in halves, added in order, after the remainder's sum
/// `s` (one function, so [`row_token_dots`] gives the same bits).
#[inline(always)]
fn dot_sum(acc: &[f32; 16], s: f32) -> f32 {
    let mut t = [0f32; 8];
    for k in 0..8 {
        t[k] = acc[k] + acc[k + 8];
    }
    s + t.iter().sum::<f32>()
}

/// `out[ti·n + r] = x[ti] · w[r]` for the tokens `0..t` and rows `r0..r1` of `w` (`[n, k]`), each
/// result with the bits [`dot`] gives on the row converted to f32. On the AVX2 and AVX-512 paths each
/// 16-value chunk of a row (f32, bf16 or f16) is widened once in registers and serves four tokens
/// (`x86::DOT_TOKENS`); on the others a bf16 or f16 row is converted into `scratch` and dotted with
/// each token.
///
/// # Safety
/// `out` points to a `[t, n]` row-major matrix whose columns `r0..r1` only this call writes.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn row_token_dots(
    isa: Isa,
    x: &[f32],
    t: usize,
    k: usize,
    w: Floats,
    r0: usize,
    r1: usize,
    n: usize,
    out: SharedMut<f32>,
    scratch: &mut Vec<f32>,
) {
    assert!(x.len() >= t * k && w.len() >= r1 * k && r1 <= n, "row_token_dots: operands smaller than their shapes");
    #[cfg(target_arch = "x86_64")]
    {
        use crate::isa::IsaPath;
        let wide = match isa.path() {
            IsaPath::Avx512 | IsaPath::Avx512Vnni => Some(true),
            IsaPath::Avx2 | IsaPath::AvxVnni => Some(false),
            _ => None,
        };
        if let Some(wide) = wide {
            for r in r0..r1 {
                if r + PF_ROWS < r1 {
                    prefetch_row(w, (r + PF_ROWS) * k, k);
                }
                let row = w.slice(r * k, k);
                // SAFETY: the path is this CPU's; `x` holds `t` rows of `k`, `row` `k` values; the
                // caller's `out` holds `[t, n]` and only this task writes row `r`'s column.
                unsafe {
                    if wide {
                        x86::row_tokens_512(x.as_ptr(), t, k, row, r, n, out)
                    } else {
                        x86::row_tokens_256(x.as_ptr(), t, k, row, r, n, out)
                    }
                }
            }
            return;
        }
    }
    for r in r0..r1 {
        let wr: &[f32] = match w {
            Floats::F32(s) => &s[r * k..(r + 1) * k],
            _ => {
                scratch.resize(k, 0.0);
                w.to_f32(r * k, scratch);
                scratch
            }
        };
        for ti in 0..t {
            let v = dot::run(isa, &x[ti * k..(ti + 1) * k], wr);
            // SAFETY: `ti < t` and `r < r1 <= n`; the caller's `out` holds `[t, n]`, column `r` this call's.
            unsafe { *out.ptr().add(ti * n + r) = v };
        }
    }
}

/// Rows ahead (inside a task's rows) whose values [`row_token_dots`] asks into L2 while it reads one:
/// a decode reads each weight once, and the hardware prefetchers alone kept a bf16 decode at about
/// half this VM's read bandwidth (SmolLM2 bf16, one server stream: 63–66 → 78–79 tok/s; prefetching
/// into L1, or a few rows ahead, gained nothing).
#[cfg(target_arch = "x86_64")]
const PF_ROWS: usize = 16;

/// Weight rows per task of a decode matmul: 16 to 64, at least four tasks per thread where the matrix
/// allows. Only tasks longer than `PF_ROWS` (16) prefetch: on two threads every matrix of over 512
/// rows; on many threads small matrices go without.
fn dot_task_rows(n: usize, threads: usize) -> usize {
    n.div_ceil(4 * threads.max(1)).clamp(16, 64).next_multiple_of(16)
}

/// Asks for the `k` values of `w` from element `start` into L2 (a hint: never reads, never faults).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_row(w: Floats, start: usize, k: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
    let (base, size) = match w {
        Floats::F32(s) => (s.as_ptr() as *const u8, 4),
        Floats::F16(s) | Floats::BF16(s) => (s.as_ptr() as *const u8, 2),
    };
    let p = base.wrapping_add(start * size);
    let mut o = 0;
    while o < k * size {
        // SAFETY: a prefetch is a hint; the address is inside `w` (the caller's row is).
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(o) as *const i8) };
        o += 64;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use half::{bf16, f16};

    use super::{dot_sum, Floats, SharedMut};

    /// Tokens one pass over a weight row serves, each with its own sixteen lanes (four registers on
    /// AVX-512, eight of AVX2's sixteen).
    pub const DOT_TOKENS: usize = 4;

    /// A weight element type, widened to f32 sixteen at a time in registers (a bf16 is an f32's upper
    /// half; an f16 widens exactly) and one at a time as [`Floats::get`] does.
    trait Element: Copy {
        fn widen(self) -> f32;
        /// Elements `p..p + 16`, needing AVX-512F (and F16C for f16).
        unsafe fn chunk_512(p: *const Self) -> __m512;
        /// Elements `p..p + 16` as two halves, needing AVX2 (and F16C for f16).
        unsafe fn chunk_256(p: *const Self) -> (__m256, __m256);
    }

    impl Element for f32 {
        fn widen(self) -> f32 {
            self
        }
        #[inline(always)]
        unsafe fn chunk_512(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn chunk_256(p: *const f32) -> (__m256, __m256) {
            (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
        }
    }

    impl Element for bf16 {
        fn widen(self) -> f32 {
            self.to_f32()
        }
        #[inline(always)]
        unsafe fn chunk_512(p: *const bf16) -> __m512 {
            let h = _mm256_loadu_si256(p as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
        #[inline(always)]
        unsafe fn chunk_256(p: *const bf16) -> (__m256, __m256) {
            let q = p as *const __m128i;
            let widen = |h: __m128i| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)));
            (widen(_mm_loadu_si128(q)), widen(_mm_loadu_si128(q.add(1))))
        }
    }

    impl Element for f16 {
        fn widen(self) -> f32 {
            self.to_f32()
        }
        #[inline(always)]
        unsafe fn chunk_512(p: *const f16) -> __m512 {
            _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
        }
        #[inline(always)]
        unsafe fn chunk_256(p: *const f16) -> (__m256, __m256) {
            let q = p as *const __m128i;
            (_mm256_cvtph_ps(_mm_loadu_si128(q)), _mm256_cvtph_ps(_mm_loadu_si128(q.add(1))))
        }
    }

    /// Calls `$kernel::<E, G>` on the tokens `0..t` in groups of [`DOT_TOKENS`] (the last one smaller).
    macro_rules! by_token_groups {
        ($kernel:ident::<$e:ident>, $x:expr, $t:expr, $k:expr, $row:expr, $r:expr, $n:expr, $out:expr) => {{
            let mut t0 = 0;
            while t0 < $t {
                match $t - t0 {
                    1 => $kernel::<$e, 1>($x, t0, $k, $row, $r, $n, $out),
                    2 => $kernel::<$e, 2>($x, t0, $k, $row, $r, $n, $out),
                    3 => $kernel::<$e, 3>($x, t0, $k, $row, $r, $n, $out),
                    _ => $kernel::<$e, DOT_TOKENS>($x, t0, $k, $row, $r, $n, $out),
                }
                t0 += DOT_TOKENS;
            }
        }};
    }

    /// Calls `$f::<E>` with `row`'s pointer typed by its storage: one match per row, none in the
    /// kernels' loops.
    macro_rules! by_element {
        ($f:ident, $x:expr, $t:expr, $k:expr, $row:expr, $r:expr, $n:expr, $out:expr) => {
            match $row {
                Floats::F32(s) => $f($x, $t, $k, s.as_ptr(), $r, $n, $out),
                Floats::BF16(s) => $f($x, $t, $k, s.as_ptr() as *const bf16, $r, $n, $out),
                Floats::F16(s) => $f($x, $t, $k, s.as_ptr() as *const f16, $r, $n, $out),
            }
        };
    }

    /// The remainder past the last full chunk and the final sum, as [`super::dot`] does them.
    #[inline(always)]
    unsafe fn finish<E: Element>(lanes: &[f32; 16], x: *const f32, k: usize, row: *const E) -> f32 {
        let mut s = 0f32;
        for i in k / 16 * 16..k {
            s += *x.add(i) * (*row.add(i)).widen();
        }
        dot_sum(lanes, s)
    }

    /// Every token's dot with `row`, [`DOT_TOKENS`] per pass, 512-bit.
    ///
    /// # Safety
    /// AVX-512F; `x` holds `t` rows of `k`, `row` `k` values, `out` `[t, n]` with column `r` this call's.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn row_tokens_512(
        x: *const f32,
        t: usize,
        k: usize,
        row: Floats,
        r: usize,
        n: usize,
        out: SharedMut<f32>,
    ) {
        by_element!(row_512, x, t, k, row, r, n, out)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn row_512<E: Element>(
        x: *const f32,
        t: usize,
        k: usize,
        row: *const E,
        r: usize,
        n: usize,
        out: SharedMut<f32>,
    ) {
        by_token_groups!(tokens_512::<E>, x, t, k, row, r, n, out);
    }

    #[inline(always)]
    unsafe fn tokens_512<E: Element, const G: usize>(
        x: *const f32,
        t0: usize,
        k: usize,
        row: *const E,
        r: usize,
        n: usize,
        out: SharedMut<f32>,
    ) {
        let mut acc = [_mm512_setzero_ps(); G];
        for j in 0..k / 16 {
            let wv = E::chunk_512(row.add(16 * j));
            for (g, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(_mm512_loadu_ps(x.add((t0 + g) * k + 16 * j)), wv, *a);
            }
        }
        for (g, a) in acc.iter().enumerate() {
            let mut lanes = [0f32; 16];
            _mm512_storeu_ps(lanes.as_mut_ptr(), *a);
            *out.ptr().add((t0 + g) * n + r) = finish(&lanes, x.add((t0 + g) * k), k, row);
        }
    }

    /// [`row_tokens_512`] with each token's sixteen lanes in two 256-bit halves.
    ///
    /// # Safety
    /// AVX2 and FMA; as for [`row_tokens_512`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn row_tokens_256(
        x: *const f32,
        t: usize,
        k: usize,
        row: Floats,
        r: usize,
        n: usize,
        out: SharedMut<f32>,
    ) {
        by_element!(row_256, x, t, k, row, r, n, out)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn row_256<E: Element>(
        x: *const f32,
        t: usize,
        k: usize,
        row: *const E,
        r: usize,
        n: usize,
        out: SharedMut<f32>,
    ) {
        by_token_groups!(tokens_256::<E>, x, t, k, row, r, n, out);
    }

    #[inline(always)]
    unsafe fn tokens_256<E: Element, const G: usize>(
        x: *const f32,
        t0: usize,
        k: usize,
        row: *const E,
        r: usize,
        n: usize,
        out: SharedMut<f32>,
    ) {
        let mut acc = [(_mm256_setzero_ps(), _mm256_setzero_ps()); G];
        for j in 0..k / 16 {
            let (w0, w1) = E::chunk_256(row.add(16 * j));
            for (g, a) in acc.iter_mut().enumerate() {
                let xp = x.add((t0 + g) * k + 16 * j);
                a.0 = _mm256_fmadd_ps(_mm256_loadu_ps(xp), w0, a.0);
                a.1 = _mm256_fmadd_ps(_mm256_loadu_ps(xp.add(8)), w1, a.1);
            }
        }
        for (g, a) in acc.iter().enumerate() {
            let mut lanes = [0f32; 16];
            _mm256_storeu_ps(lanes.as_mut_ptr(), a.0);
            _mm256_storeu_ps(lanes.as_mut_ptr().add(8), a.1);
            *out.ptr().add((t0 + g) * n + r) = finish(&lanes, x.add((t0 + g) * k), k, row);
        }
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
    assert!(out.len() >= t * n, "matmul: output smaller than [{t}, {n}]");
    if row_dots {
        // Decode: one pass over the weights, each row dotted with every token.
        let rows_per_task = dot_task_rows(n, threads);
        let out_ptr = SharedMut(out.as_mut_ptr());
        pool::for_each_init(n.div_ceil(rows_per_task), Vec::new, |scratch, chunk| {
            let (r0, r1) = (chunk * rows_per_task, ((chunk + 1) * rows_per_task).min(n));
            // SAFETY: `out` holds `[t, n]`, and each task writes only its own rows' columns.
            unsafe { row_token_dots(isa, x, t, k, w, r0, r1, n, out_ptr, scratch) };
        });
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::TestRng;

    /// The decode kernel gives every (token, row) the bits of `dot::scalar` on the row converted to f32
    /// — on every ISA path this CPU has, for f32, bf16 and f16 rows, any number of tokens (passes of
    /// one to four) and rows whose length is or is not a multiple of 16. A result that depended on the
    /// tokens beside it, or summed in another order, would differ here.
    #[test]
    fn row_token_dots_match_dot_bit_for_bit() {
        let mut rng = TestRng(7);
        for k in [5, 16, 40, 640, 650] {
            let n = 7;
            let w32: Vec<f32> = (0..n * k).map(|_| rng.uniform()).collect();
            let bf: Vec<u16> = w32.iter().map(|v| half::bf16::from_f32(*v).to_bits()).collect();
            let hf: Vec<u16> = w32.iter().map(|v| half::f16::from_f32(*v).to_bits()).collect();
            for t in [1, 2, 3, 4, 5, 8, 9] {
                let x: Vec<f32> = (0..t * k).map(|_| rng.uniform() * 3.0).collect();
                for w in [Floats::F32(&w32), Floats::BF16(&bf), Floats::F16(&hf)] {
                    let mut row = vec![0f32; k];
                    let want: Vec<f32> = (0..t * n)
                        .map(|i| {
                            let (ti, r) = (i / n, i % n);
                            w.to_f32(r * k, &mut row);
                            dot::scalar(&x[ti * k..(ti + 1) * k], &row)
                        })
                        .collect();
                    for isa in Isa::all_supported() {
                        let mut out = vec![f32::NAN; t * n];
                        let ptr = SharedMut(out.as_mut_ptr());
                        // Rows in two calls, as two tasks would take them.
                        // SAFETY: `out` is `[t, n]`.
                        unsafe {
                            row_token_dots(isa, &x, t, k, w, 0, 3, n, ptr, &mut Vec::new());
                            row_token_dots(isa, &x, t, k, w, 3, n, n, ptr, &mut Vec::new());
                        }
                        for i in 0..t * n {
                            assert_eq!(
                                out[i].to_bits(),
                                want[i].to_bits(),
                                "{} k {k} t {t} token {} row {}: {} vs {}",
                                isa.name(),
                                i / n,
                                i % n,
                                out[i],
                                want[i]
                            );
                        }
                    }
                }
            }
        }
    }
}
