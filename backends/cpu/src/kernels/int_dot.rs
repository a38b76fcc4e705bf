//! Integer kernels for MLX affine weights (2/3/4/5/6/8 bits): the activation rows are quantized once per step to
//! int16 in blocks of 32 (one f32 scale per block, plus the exact f32 block sum for the affine bias
//! term), then every weight row is an integer dot product per block (`vpmaddwd`):
//!
//! `Σ x·(s·q + b) ≈ s · Σ_blocks d_x · Σ q·x16  +  b · Σ x`
//!
//! The bias term is exact; the `q·x` products see the rounding of `x` to 16 bits (≤ 1/65534 of each
//! block's largest value: well below the f16 rounding mlx-lm itself applies). llama.cpp uses int8
//! activations here; with SmolLM2's outlier channels that moved the first-step logits by up to 1.2,
//! while int16 stays within 0.01 of the f32 reference at almost the same speed.

use super::quantized::QuantMatrix;
use super::Floats;
use crate::isa::Isa;

/// An activation row set quantized for [`dot_row`]: `[t, k]` as int16 blocks of 32.
///
/// For 4-bit weights each block is stored even elements first, then odd ones, matching how the packed
/// nibbles split into low (even) and high (odd) halves; other widths use natural order.
/// `d` and `group_sums` carry [`PAD`] zeros past their end, so kernels may read whole vectors.
#[derive(Default)]
pub struct IntActs {
    /// What the buffers hold now: matmuls that read the same activations (q/k/v, gate/up) quantize
    /// them once. The owner clears it whenever the source could have changed.
    pub key: Option<ActsKey>,
    pub q: Vec<i16>,
    /// Per block: scale `d` (x ≈ d · q).
    pub d: Vec<f32>,
    /// Per weight group: exact Σx (for the affine bias term).
    pub group_sums: Vec<f32>,
}

/// Identifies one quantization of one activation tensor.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct ActsKey {
    /// The caller's name for the tensor (the executor uses its graph node).
    pub source: usize,
    pub t: usize,
    pub k: usize,
    pub group: usize,
    pub nibble_order: bool,
}

/// Zeros kept past the end of [`IntActs::d`] and [`IntActs::group_sums`].
pub const PAD: usize = 8;

/// Quantizes `x [t, k]` (k a multiple of `group`, itself a multiple of 32) to int16 blocks;
/// `nibble_order` for 4-bit weights.
pub fn quantize_acts(isa: Isa, x: &[f32], t: usize, k: usize, group: usize, nibble_order: bool, out: &mut IntActs) {
    let blocks = t * k / 32;
    let group_blocks = group / 32;
    out.q.resize(t * k, 0);
    out.d.clear();
    out.d.resize(blocks + PAD, 0.0);
    out.group_sums.clear();
    out.group_sums.resize(blocks / group_blocks + PAD, 0.0);
    for b in 0..blocks {
        let (d, sum) = quantize_block(isa, &x[b * 32..(b + 1) * 32], &mut out.q[b * 32..(b + 1) * 32], nibble_order);
        out.d[b] = d;
        out.group_sums[b / group_blocks] += sum;
    }
}

/// One block of 32: returns (scale, Σx) and writes the int16 values (`d = max|x| / 32767`).
#[inline]
fn quantize_block(isa: Isa, xs: &[f32], q: &mut [i16], nibble_order: bool) -> (f32, f32) {
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() {
        assert!(xs.len() >= 32 && q.len() >= 32);
        // SAFETY: AVX2 is present on these paths; both slices hold a whole block.
        return unsafe { x86::quantize_block_avx2(xs.as_ptr(), q.as_mut_ptr(), nibble_order) };
    }
    let _ = isa;
    quantize_block_scalar(xs, q, nibble_order)
}

fn quantize_block_scalar(xs: &[f32], q: &mut [i16], nibble_order: bool) -> (f32, f32) {
    let mut amax = 0f32;
    let mut sum = 0f32;
    for &v in &xs[..32] {
        amax = amax.max(v.abs());
        sum += v;
    }
    let d = amax / 32767.0;
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut tmp = [0i16; 32];
    for i in 0..32 {
        tmp[i] = (xs[i] * inv).round_ties_even() as i16;
    }
    if nibble_order {
        for i in 0..16 {
            q[i] = tmp[2 * i];
            q[16 + i] = tmp[2 * i + 1];
        }
    } else {
        q[..32].copy_from_slice(&tmp);
    }
    (d, sum)
}

/// One weight row's view for [`dot_row`]: packed words and this row's group scales and biases.
#[derive(Clone, Copy)]
pub struct QuantRow<'a> {
    pub words: &'a [u32],
    pub scales: Floats<'a>,
    pub biases: Floats<'a>,
    /// Index of this row's first group in `scales`/`biases`.
    pub group0: usize,
    pub bits: usize,
    /// Group size / 32.
    pub group_blocks: usize,
}

/// The activation side of [`dot_row`] for one token: int16 blocks, their scales, and Σx per group.
#[derive(Clone, Copy)]
pub struct ActRow<'a> {
    pub q: &'a [i16],
    pub d: &'a [f32],
    pub group_sums: &'a [f32],
}

/// `Σ x · (s·q + b)` for one packed row and one int16 activation row: per block `d_x · s_g · Σ q·x16`,
/// plus the exact `b_g · Σx` per group. AVX2 for 4 and 8 bits, the portable loop otherwise.
#[inline]
pub fn dot_row(isa: Isa, w: QuantRow, x: ActRow) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() && matches!(w.bits, 4 | 8) {
        // SAFETY: the context only selects these paths when the CPU has AVX2, FMA and F16C.
        return unsafe {
            match (w.scales, w.biases) {
                (Floats::F16(s), Floats::F16(b)) => x86::dot_row_avx2::<x86::Half>(w, s.as_ptr(), b.as_ptr(), x),
                (Floats::BF16(s), Floats::BF16(b)) => x86::dot_row_avx2::<x86::Brain>(w, s.as_ptr(), b.as_ptr(), x),
                (Floats::F32(s), Floats::F32(b)) => {
                    x86::dot_row_avx2::<x86::Single>(w, s.as_ptr() as *const u16, b.as_ptr() as *const u16, x)
                }
                _ => dot_row_scalar(w, x),
            }
        };
    }
    let _ = isa;
    dot_row_scalar(w, x)
}

/// [`dot_row`] for `NT` activation rows at once (4-bit weights share their unpacking).
#[inline]
pub fn dot_rows<const NT: usize>(isa: Isa, w: QuantRow, x: &[ActRow; NT], out: &mut [f32; NT]) {
    #[cfg(target_arch = "x86_64")]
    if w.bits == 4 && isa.has_avx2() {
        // SAFETY: as for `dot_row`.
        unsafe {
            match (w.scales, w.biases) {
                (Floats::F16(s), Floats::F16(b)) => {
                    return x86::dot_rows_q4_avx2::<x86::Half, NT>(w, s.as_ptr(), b.as_ptr(), x, out)
                }
                (Floats::BF16(s), Floats::BF16(b)) => {
                    return x86::dot_rows_q4_avx2::<x86::Brain, NT>(w, s.as_ptr(), b.as_ptr(), x, out)
                }
                (Floats::F32(s), Floats::F32(b)) => {
                    return x86::dot_rows_q4_avx2::<x86::Single, NT>(
                        w,
                        s.as_ptr() as *const u16,
                        b.as_ptr() as *const u16,
                        x,
                        out,
                    )
                }
                _ => {}
            }
        }
    }
    for t in 0..NT {
        out[t] = dot_row(isa, w, x[t]);
    }
}

impl<'a> QuantMatrix<'a> {
    /// Row `r` as [`dot_row`] takes it.
    pub fn row(&self, r: usize) -> QuantRow<'a> {
        let wpr = self.words_per_row();
        QuantRow {
            words: &self.packed[r * wpr..(r + 1) * wpr],
            scales: self.scales,
            biases: self.biases,
            group0: r * self.groups_per_row(),
            bits: self.bits,
            group_blocks: self.group / 32,
        }
    }
}

/// `out[i] = row(rows.start + i) · x` for a tile of rows against one activation row (the decode
/// path). Unlike a loop of [`dot_row`], the per-row setup is whole vectors (block factors and the bias
/// term eight lanes at a time, reading up to seven scales past the row: the matrix's last rows,
/// where that would leave the buffer, take [`dot_row`]) and four rows share one reduction.
pub fn dot_tile(isa: Isa, w: QuantMatrix, rows: std::ops::Range<usize>, x: ActRow, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if isa.has_avx2() && matches!(w.group, 32 | 64 | 128) {
        let gpr = w.groups_per_row();
        // Rows whose scale/bias vectors stay inside the buffers.
        // (and, for 2/3/5/6 bits, whose blocks are read eight bytes at a time, inside the weights).
        let row_bytes = w.words_per_row() * 4;
        let by_scales = w.scales.len().min(w.biases.len()).saturating_sub(PAD) / gpr;
        let by_words = (w.packed.len() * 4).saturating_sub(8) / row_bytes;
        let safe_end = by_scales.min(by_words).min(rows.end).max(rows.start);
        let fast = rows.start..safe_end;
        // SAFETY: AVX2/FMA/F16C are present on these paths; `fast` rows read inside the buffers and
        // `x` comes from an `IntActs` (padded).
        let done = unsafe {
            match (w.scales, w.biases) {
                (Floats::F16(s), Floats::F16(b)) => {
                    x86::dot_tile_avx2::<x86::Half>(w, s.as_ptr(), b.as_ptr(), fast.clone(), x, out);
                    true
                }
                (Floats::BF16(s), Floats::BF16(b)) => {
                    x86::dot_tile_avx2::<x86::Brain>(w, s.as_ptr(), b.as_ptr(), fast.clone(), x, out);
                    true
                }
                (Floats::F32(s), Floats::F32(b)) => {
                    x86::dot_tile_avx2::<x86::Single>(
                        w,
                        s.as_ptr() as *const u16,
                        b.as_ptr() as *const u16,
                        fast.clone(),
                        x,
                        out,
                    );
                    true
                }
                _ => false,
            }
        };
        if done {
            for r in fast.end..rows.end {
                out[r - rows.start] = dot_row(isa, w.row(r), x);
            }
            return;
        }
    }
    for r in rows.clone() {
        out[r - rows.start] = dot_row(isa, w.row(r), x);
    }
}

fn dot_row_scalar(w: QuantRow, x: ActRow) -> f32 {
    let per_block = 32 * w.bits / 32; // words per block of 32
    let mut acc = 0f32;
    for (blk, bw) in w.words.chunks_exact(per_block).enumerate() {
        let xb = &x.q[blk * 32..(blk + 1) * 32];
        let mut isum = 0i32;
        if w.bits == 4 {
            for (j, word) in bw.iter().enumerate() {
                for k in 0..4 {
                    let byte = (word >> (8 * k)) & 0xff;
                    let idx = j * 4 + k; // byte idx holds elements 2·idx (low) and 2·idx+1 (high)
                    isum += (byte & 0x0f) as i32 * xb[idx] as i32 + (byte >> 4) as i32 * xb[16 + idx] as i32;
                }
            }
        } else {
            // Natural order: value i is bits i·b .. i·b + b of the block's little-endian stream.
            let mask = (1u64 << w.bits) - 1;
            for (i, &xv) in xb.iter().enumerate() {
                let bit = i * w.bits;
                let lo = bw[bit / 32] as u64;
                let hi = bw.get(bit / 32 + 1).map_or(0, |&v| v as u64);
                isum += (((lo | (hi << 32)) >> (bit % 32)) & mask) as i32 * xv as i32;
            }
        }
        acc += x.d[blk] * w.scales.get(w.group0 + blk / w.group_blocks) * isum as f32;
    }
    for (g, gs) in x.group_sums.iter().enumerate() {
        acc += w.biases.get(w.group0 + g) * gs;
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// See [`super::quantize_block`]: for 4-bit weights the even elements are split from the odd
    /// ones in f32 (a shuffle per pair of vectors), then all are rounded (to nearest even, as the
    /// scalar path) and packed to int16 with saturation.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn quantize_block_avx2(xs: *const f32, q: *mut i16, nibble_order: bool) -> (f32, f32) {
        let x =
            [_mm256_loadu_ps(xs), _mm256_loadu_ps(xs.add(8)), _mm256_loadu_ps(xs.add(16)), _mm256_loadu_ps(xs.add(24))];
        let sign = _mm256_set1_ps(-0.0);
        let abs = |v| _mm256_andnot_ps(sign, v);
        let m = _mm256_max_ps(_mm256_max_ps(abs(x[0]), abs(x[1])), _mm256_max_ps(abs(x[2]), abs(x[3])));
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
        let sum = hsum(_mm256_add_ps(_mm256_add_ps(x[0], x[1]), _mm256_add_ps(x[2], x[3])));
        let d = amax / 32767.0;
        let inv = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
        let ints = |v: __m256| _mm256_cvtps_epi32(_mm256_mul_ps(v, inv));
        // packs_epi32 interleaves 128-bit lanes; the 64-bit permute puts them back in order.
        let pack = |a: __m256i, b: __m256i| _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
        if nibble_order {
            let evens =
                |a, b| _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
            let odds =
                |a, b| _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
            let e = pack(ints(evens(x[0], x[1])), ints(evens(x[2], x[3])));
            let o = pack(ints(odds(x[0], x[1])), ints(odds(x[2], x[3])));
            _mm256_storeu_si256(q as *mut __m256i, e);
            _mm256_storeu_si256(q.add(16) as *mut __m256i, o);
        } else {
            _mm256_storeu_si256(q as *mut __m256i, pack(ints(x[0]), ints(x[1])));
            _mm256_storeu_si256(q.add(16) as *mut __m256i, pack(ints(x[2]), ints(x[3])));
        }
        (d, sum)
    }

    /// How a scale/bias element is stored.
    pub trait ScaleKind {
        const IS_HALF: bool = false;
        const IS_BRAIN: bool = false;
        unsafe fn load(p: *const u16, i: usize) -> f32;
        /// `p` advanced by `n` elements.
        #[inline(always)]
        unsafe fn advance(p: *const u16, n: usize) -> *const u16 {
            p.add(n)
        }
    }
    pub struct Half;
    pub struct Brain;
    pub struct Single;
    impl ScaleKind for Half {
        const IS_HALF: bool = true;
        #[inline(always)]
        unsafe fn load(p: *const u16, i: usize) -> f32 {
            _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(*p.add(i) as i32)))
        }
    }
    impl ScaleKind for Brain {
        const IS_BRAIN: bool = true;
        #[inline(always)]
        unsafe fn load(p: *const u16, i: usize) -> f32 {
            f32::from_bits((*p.add(i) as u32) << 16)
        }
    }
    impl ScaleKind for Single {
        #[inline(always)]
        unsafe fn load(p: *const u16, i: usize) -> f32 {
            *(p as *const f32).add(i)
        }
        #[inline(always)]
        unsafe fn advance(p: *const u16, n: usize) -> *const u16 {
            (p as *const f32).add(n) as *const u16
        }
    }

    /// One 4-bit block: 16 bytes of nibbles (low = even elements, high = odd ones) widened to i16 and
    /// multiplied with the block's 32 int16 activations (stored even elements first) by `vpmaddwd`.
    /// Products fit easily: 15 · 32767 · 2 per lane pair.
    #[inline(always)]
    unsafe fn q4_block(wp: *const u8, xp: *const i16, blk: usize) -> __m256i {
        let (lo, hi) = q4_nibbles(wp, blk);
        let x_even = _mm256_loadu_si256(xp.add(blk * 32) as *const __m256i);
        let x_odd = _mm256_loadu_si256(xp.add(blk * 32 + 16) as *const __m256i);
        _mm256_add_epi32(_mm256_madd_epi16(lo, x_even), _mm256_madd_epi16(hi, x_odd))
    }

    /// Block `blk`'s 16 bytes as 16 words: low nibbles (even elements) and high nibbles (odd ones).
    /// Both 128-bit halves get the 16 bytes (a broadcast load, no shuffle); an in-lane byte shuffle
    /// zero-extends bytes 0-7 in the low half and 8-15 in the high half; a mask and a shift split
    /// the nibbles. (`vpmovzxbw` crosses lanes and is markedly slower on Zen.)
    #[inline(always)]
    unsafe fn q4_nibbles(wp: *const u8, blk: usize) -> (__m256i, __m256i) {
        let bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128(wp.add(blk * 16) as *const __m128i));
        let words = _mm256_shuffle_epi8(bytes, widen_bytes());
        (_mm256_and_si256(words, _mm256_set1_epi16(0x0f)), _mm256_srli_epi16(words, 4))
    }

    /// `vpshufb` control: bytes 0-7 of the low half and 8-15 of the high half, each into a word.
    #[inline(always)]
    unsafe fn widen_bytes() -> __m256i {
        #[rustfmt::skip]
        let c = _mm256_setr_epi8(
            0, -128, 1, -128, 2, -128, 3, -128, 4, -128, 5, -128, 6, -128, 7, -128,
            8, -128, 9, -128, 10, -128, 11, -128, 12, -128, 13, -128, 14, -128, 15, -128,
        );
        c
    }

    /// Loads 8 consecutive scales as f32.
    #[inline(always)]
    unsafe fn load8<S: ScaleKind>(p: *const u16, i: usize) -> __m256 {
        if S::IS_HALF {
            _mm256_cvtph_ps(_mm_loadu_si128(p.add(i) as *const __m128i))
        } else if S::IS_BRAIN {
            let h = _mm_loadu_si128(p.add(i) as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
        } else {
            _mm256_loadu_ps((p as *const f32).add(i))
        }
    }

    /// The affine bias term `Σ_g b_g · Σx_g` of one row.
    #[inline(always)]
    unsafe fn bias_term<S: ScaleKind>(bp: *const u16, g0: usize, group_sums: &[f32]) -> f32 {
        let groups = group_sums.len();
        let mut v = _mm256_setzero_ps();
        let mut g = 0;
        while g + 8 <= groups {
            v = _mm256_fmadd_ps(load8::<S>(bp, g0 + g), _mm256_loadu_ps(group_sums.as_ptr().add(g)), v);
            g += 8;
        }
        let mut bias = hsum(v);
        while g < groups {
            bias += S::load(bp, g0 + g) * *group_sums.get_unchecked(g);
            g += 1;
        }
        bias
    }

    /// Σ over blocks of `block(b0 + i) · comb[i]`, two accumulators to hide FMA latency.
    #[inline(always)]
    unsafe fn accumulate_blocks(comb: &[f32], b0: usize, nb: usize, block: impl Fn(usize) -> __m256) -> __m256 {
        let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i + 2 <= nb {
            a0 = _mm256_fmadd_ps(block(b0 + i), _mm256_set1_ps(*comb.get_unchecked(i)), a0);
            a1 = _mm256_fmadd_ps(block(b0 + i + 1), _mm256_set1_ps(*comb.get_unchecked(i + 1)), a1);
            i += 2;
        }
        if i < nb {
            a0 = _mm256_fmadd_ps(block(b0 + i), _mm256_set1_ps(*comb.get_unchecked(i)), a0);
        }
        _mm256_add_ps(a0, a1)
    }

    /// Σ over blocks of `Σ block(b0 + i) · comb[i]` where `block` gives a block's eight int32 partial
    /// sums: eight blocks at a time, their partial sums are reduced to one vector of eight block sums
    /// (a tree of horizontal adds) so one conversion and one FMA with eight factors serve eight
    /// blocks; the remaining blocks one at a time.
    #[inline(always)]
    unsafe fn accumulate_blocks_reduced<B: BlockDot>(comb: &[f32], b0: usize, nb: usize, blocks: &B) -> __m256 {
        let block = |b: usize| blocks.block(b);
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i + 8 <= nb {
            let b = b0 + i;
            let h01 = _mm256_hadd_epi32(block(b), block(b + 1));
            let h23 = _mm256_hadd_epi32(block(b + 2), block(b + 3));
            let h45 = _mm256_hadd_epi32(block(b + 4), block(b + 5));
            let h67 = _mm256_hadd_epi32(block(b + 6), block(b + 7));
            // Per 128-bit half: [Σ0, Σ1, Σ2, Σ3] of blocks 0-3 (low half of each block's lanes, high half).
            let h0123 = _mm256_hadd_epi32(h01, h23);
            let h4567 = _mm256_hadd_epi32(h45, h67);
            let sums = _mm256_add_epi32(
                _mm256_permute2x128_si256(h0123, h4567, 0x20),
                _mm256_permute2x128_si256(h0123, h4567, 0x31),
            );
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_loadu_ps(comb.as_ptr().add(i)), acc);
            i += 8;
        }
        while i < nb {
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block(b0 + i)), _mm256_set1_ps(*comb.get_unchecked(i)), acc);
            i += 1;
        }
        acc
    }

    /// One block's integer partial sums, by weight width. A trait with inlined methods rather than a
    /// closure: closures are compiled without the caller's AVX2, which keeps intrinsics out of line.
    trait BlockDot {
        unsafe fn block(&self, blk: usize) -> __m256i;
    }
    struct Q4 {
        wp: *const u8,
        xp: *const i16,
    }
    struct Q8 {
        wp: *const u8,
        xp: *const i16,
    }
    struct QN<'u> {
        wp: *const u8,
        xp: *const i16,
        unpack: &'u Unpack,
    }
    impl BlockDot for Q4 {
        #[inline(always)]
        unsafe fn block(&self, blk: usize) -> __m256i {
            q4_block(self.wp, self.xp, blk)
        }
    }
    impl BlockDot for Q8 {
        #[inline(always)]
        unsafe fn block(&self, blk: usize) -> __m256i {
            q8_block(self.wp, self.xp, blk)
        }
    }
    impl BlockDot for QN<'_> {
        #[inline(always)]
        unsafe fn block(&self, blk: usize) -> __m256i {
            qn_block(self.wp, self.xp, blk, self.unpack)
        }
    }

    /// How [`qn_block`] pulls `bits`-bit values (2, 3, 5, 6) out of a block: per 32-bit lane `i` of
    /// eight values, the two bytes holding value `i`, the shift that aligns it, and the value mask.
    pub struct Unpack {
        bits: usize,
        gather: __m256i,
        shifts: __m256i,
        mask: __m256i,
    }

    impl Unpack {
        #[target_feature(enable = "avx2")]
        pub unsafe fn new(bits: usize) -> Unpack {
            let mut gather = [-128i8; 32];
            let mut shifts = [0i32; 8];
            for i in 0..8 {
                let bit = i * bits;
                // Both 128-bit halves hold the same eight bytes, so in-lane indices are 0-7.
                gather[4 * i] = (bit / 8) as i8;
                gather[4 * i + 1] = (bit / 8 + 1).min(7) as i8;
                shifts[i] = (bit % 8) as i32;
            }
            Unpack {
                bits,
                gather: _mm256_loadu_si256(gather.as_ptr() as *const __m256i),
                shifts: _mm256_loadu_si256(shifts.as_ptr() as *const __m256i),
                mask: _mm256_set1_epi32((1 << bits) - 1),
            }
        }
    }

    /// Values `8g..8g + 8` of a block as int32 lanes (a function, not a closure, so it is compiled
    /// with its caller's AVX2 and the intrinsics inline).
    #[inline(always)]
    unsafe fn eight_values(base: *const u8, g: usize, u: &Unpack) -> __m256i {
        let v = _mm256_set1_epi64x((base.add(g * u.bits) as *const i64).read_unaligned());
        _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(v, u.gather), u.shifts), u.mask)
    }

    /// One block of 2/3/5/6-bit values in natural order times the block's int16 activations. A
    /// block is `4·bits` bytes; each run of eight values is `bits` whole bytes, read eight bytes at
    /// a time (up to six past the block: callers keep the last rows of a matrix off this path),
    /// gathered per 32-bit lane by an in-lane shuffle, shifted per lane and masked, then packed to
    /// int16 for `vpmaddwd`.
    #[inline(always)]
    unsafe fn qn_block(wp: *const u8, xp: *const i16, blk: usize, u: &Unpack) -> __m256i {
        let base = wp.add(blk * 4 * u.bits);
        // packs_epi32 interleaves 128-bit lanes; the 64-bit permute restores value order.
        let w_lo =
            _mm256_permute4x64_epi64(_mm256_packs_epi32(eight_values(base, 0, u), eight_values(base, 1, u)), 0xD8);
        let w_hi =
            _mm256_permute4x64_epi64(_mm256_packs_epi32(eight_values(base, 2, u), eight_values(base, 3, u)), 0xD8);
        let x_lo = _mm256_loadu_si256(xp.add(blk * 32) as *const __m256i);
        let x_hi = _mm256_loadu_si256(xp.add(blk * 32 + 16) as *const __m256i);
        _mm256_add_epi32(_mm256_madd_epi16(w_lo, x_lo), _mm256_madd_epi16(w_hi, x_hi))
    }

    /// One 8-bit block: bytes widened to i16 (`vpmaddubsw` could saturate at 2·255·32767), each half
    /// of 16 by a broadcast load and the in-lane shuffle of [`q4_nibbles`], times the block's int16
    /// activations in natural order.
    #[inline(always)]
    unsafe fn q8_block(wp: *const u8, xp: *const i16, blk: usize) -> __m256i {
        let half = |h: usize| {
            let bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128(wp.add(blk * 32 + h * 16) as *const __m128i));
            _mm256_shuffle_epi8(bytes, widen_bytes())
        };
        let x_lo = _mm256_loadu_si256(xp.add(blk * 32) as *const __m256i);
        let x_hi = _mm256_loadu_si256(xp.add(blk * 32 + 16) as *const __m256i);
        _mm256_add_epi32(_mm256_madd_epi16(half(0), x_lo), _mm256_madd_epi16(half(1), x_hi))
    }

    /// 4-bit: 32 nibbles per block widened to i16 and multiplied with int16 activations by `vpmaddwd`
    /// (see [`q4_block`]); 8-bit: bytes widened to i16 the same way. One FMA per block.
    /// Per-block factors `d_x · s_g` are formed 8 at a time up front; the bias term is a vector dot.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_row_avx2<S: ScaleKind>(
        w: super::QuantRow,
        sp: *const u16,
        bp: *const u16,
        x: super::ActRow,
    ) -> f32 {
        const CHUNK: usize = 64; // blocks per pass (a small stack buffer: cheap to zero)
        let groups = x.group_sums.len();
        let gb = w.group_blocks;
        let nb = groups * gb;
        let g0 = w.group0;

        let bias = bias_term::<S>(bp, g0, x.group_sums);

        let wp = w.words.as_ptr() as *const u8;
        let xp = x.q.as_ptr();
        let mut comb = [0f32; CHUNK];
        let mut acc = _mm256_setzero_ps();
        let mut b0 = 0;
        while b0 < nb {
            let n = CHUNK.min(nb - b0);
            // comb[i] = d_x[b0+i] · s[(b0+i)/gb]
            if gb == 1 {
                let mut i = 0;
                while i + 8 <= n {
                    let v = _mm256_mul_ps(load8::<S>(sp, g0 + b0 + i), _mm256_loadu_ps(x.d.as_ptr().add(b0 + i)));
                    _mm256_storeu_ps(comb.as_mut_ptr().add(i), v);
                    i += 8;
                }
                while i < n {
                    comb[i] = S::load(sp, g0 + b0 + i) * *x.d.get_unchecked(b0 + i);
                    i += 1;
                }
            } else {
                for (i, c) in comb.iter_mut().enumerate().take(n) {
                    *c = S::load(sp, g0 + (b0 + i) / gb) * *x.d.get_unchecked(b0 + i);
                }
            }
            let part = if w.bits == 4 {
                accumulate_blocks(&comb[..n], b0, n, |blk| _mm256_cvtepi32_ps(q4_block(wp, xp, blk)))
            } else {
                accumulate_blocks(&comb[..n], b0, n, |blk| _mm256_cvtepi32_ps(q8_block(wp, xp, blk)))
            };
            acc = _mm256_add_ps(acc, part);
            b0 += n;
        }
        hsum(acc) + bias
    }

    /// `NT` activation rows against one 4-bit weight row: each block's nibbles are unpacked once and
    /// used for all of them (the prefill path, where many tokens share every weight row).
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::needless_range_loop)] // `t` walks `x` and the matching `comb` stripe together
    pub unsafe fn dot_rows_q4_avx2<S: ScaleKind, const NT: usize>(
        w: super::QuantRow,
        sp: *const u16,
        bp: *const u16,
        x: &[super::ActRow; NT],
        out: &mut [f32; NT],
    ) {
        const CHUNK: usize = 256;
        let groups = x[0].group_sums.len();
        let gb = w.group_blocks;
        let nb = groups * gb;
        let g0 = w.group0;
        for (o, xt) in out.iter_mut().zip(x) {
            *o = bias_term::<S>(bp, g0, xt.group_sums);
        }
        let wp = w.words.as_ptr() as *const u8;
        // comb[t][i] = s[(b0+i)/gb] · d_t[b0+i], formed 8 at a time when groups are one block.
        let mut comb_buf = std::mem::MaybeUninit::<[[f32; CHUNK]; NT]>::uninit();
        let comb = comb_buf.as_mut_ptr() as *mut f32;
        let mut acc = [_mm256_setzero_ps(); NT];
        let mut b0 = 0;
        while b0 < nb {
            let n = CHUNK.min(nb - b0);
            for t in 0..NT {
                let c = comb.add(t * CHUNK);
                let d = x[t].d.as_ptr().add(b0);
                let mut i = 0;
                if gb == 1 {
                    while i + 8 <= n {
                        _mm256_storeu_ps(
                            c.add(i),
                            _mm256_mul_ps(load8::<S>(sp, g0 + b0 + i), _mm256_loadu_ps(d.add(i))),
                        );
                        i += 8;
                    }
                    while i < n {
                        *c.add(i) = S::load(sp, g0 + b0 + i) * *d.add(i);
                        i += 1;
                    }
                } else {
                    // Group boundaries by counting, not dividing.
                    let (mut g, mut left) = ((b0) / gb, gb - b0 % gb);
                    let mut sg = S::load(sp, g0 + g);
                    while i < n {
                        *c.add(i) = sg * *d.add(i);
                        i += 1;
                        left -= 1;
                        if left == 0 && i < n {
                            g += 1;
                            left = gb;
                            sg = S::load(sp, g0 + g);
                        }
                    }
                }
            }
            for i in 0..n {
                let blk = b0 + i;
                let (lo, hi) = q4_nibbles(wp, blk);
                for t in 0..NT {
                    let xp = x[t].q.as_ptr().add(blk * 32);
                    let x_even = _mm256_loadu_si256(xp as *const __m256i);
                    let x_odd = _mm256_loadu_si256(xp.add(16) as *const __m256i);
                    let p = _mm256_add_epi32(_mm256_madd_epi16(lo, x_even), _mm256_madd_epi16(hi, x_odd));
                    acc[t] =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(&*comb.add(t * CHUNK + i)), acc[t]);
                }
            }
            b0 += n;
        }
        for t in 0..NT {
            out[t] += hsum(acc[t]);
        }
    }
    /// Scales `b..b + 8` of the blocks of a row as f32, for groups of `gb` ∈ {1, 2, 4} blocks
    /// (each group's scale repeated over its blocks). Reads up to seven elements past the last group.
    #[inline(always)]
    unsafe fn block_scales8<S: ScaleKind>(p: *const u16, b: usize, gb: usize) -> __m256 {
        match gb {
            1 => load8::<S>(p, b),
            2 => {
                let v = if S::IS_HALF {
                    _mm_cvtph_ps(_mm_loadl_epi64(p.add(b / 2) as *const __m128i))
                } else if S::IS_BRAIN {
                    _mm_castsi128_ps(_mm_slli_epi32(
                        _mm_cvtepu16_epi32(_mm_loadl_epi64(p.add(b / 2) as *const __m128i)),
                        16,
                    ))
                } else {
                    _mm_loadu_ps((p as *const f32).add(b / 2))
                };
                _mm256_permutevar8x32_ps(_mm256_castps128_ps256(v), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3))
            }
            _ => {
                let v = if S::IS_HALF {
                    _mm_cvtph_ps(_mm_cvtsi32_si128((p.add(b / 4) as *const i32).read_unaligned()))
                } else if S::IS_BRAIN {
                    let two = _mm_cvtsi32_si128((p.add(b / 4) as *const i32).read_unaligned());
                    _mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(two), 16))
                } else {
                    _mm_castpd_ps(_mm_load_sd((p as *const f32).add(b / 4) as *const f64))
                };
                _mm256_permutevar8x32_ps(_mm256_castps128_ps256(v), _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1))
            }
        }
    }

    /// One row against one activation row, left as eight partial sums (the caller reduces rows
    /// together). Block factors `d_x · s` are formed eight at a time per chunk of blocks, the bias
    /// term `Σ b_g · Σx_g` eight groups at a time with the row's tail masked off.
    #[inline(always)]
    unsafe fn row_partials<S: ScaleKind>(
        w: &super::QuantMatrix,
        sp: *const u16,
        bp: *const u16,
        r: usize,
        x: &super::ActRow,
        tail: __m256,
        unpack: &Unpack,
    ) -> __m256 {
        const CHUNK: usize = 64;
        let gb = w.group / 32;
        let nb = w.k / 32;
        let groups = nb / gb;
        let (sp, bp) = (S::advance(sp, r * groups), S::advance(bp, r * groups));
        let bytes_per_block = 4 * w.bits;
        let wp = (w.packed.as_ptr() as *const u8).add(r * nb * bytes_per_block);
        let xp = x.q.as_ptr();
        let dp = x.d.as_ptr();
        let mut comb = [0f32; CHUNK];
        let mut acc = _mm256_setzero_ps();
        let mut b0 = 0;
        while b0 < nb {
            let n = CHUNK.min(nb - b0);
            let mut i = 0;
            while i < n {
                let v = _mm256_mul_ps(block_scales8::<S>(sp, b0 + i, gb), _mm256_loadu_ps(dp.add(b0 + i)));
                _mm256_storeu_ps(comb.as_mut_ptr().add(i), v);
                i += 8;
            }
            let part = match w.bits {
                4 => accumulate_blocks_reduced(&comb[..n], b0, n, &Q4 { wp, xp }),
                8 => accumulate_blocks_reduced(&comb[..n], b0, n, &Q8 { wp, xp }),
                _ => accumulate_blocks_reduced(&comb[..n], b0, n, &QN { wp, xp, unpack }),
            };
            acc = _mm256_add_ps(acc, part);
            b0 += n;
        }
        let gs = x.group_sums.as_ptr();
        let mut g = 0;
        while g + 8 <= groups {
            acc = _mm256_fmadd_ps(load8::<S>(bp, g), _mm256_loadu_ps(gs.add(g)), acc);
            g += 8;
        }
        if g < groups {
            let b = _mm256_and_ps(load8::<S>(bp, g), tail);
            acc = _mm256_fmadd_ps(b, _mm256_loadu_ps(gs.add(g)), acc);
        }
        acc
    }

    /// Sums each of four vectors: `[Σa, Σb, Σc, Σd]`.
    #[inline(always)]
    unsafe fn reduce4(a: __m256, b: __m256, c: __m256, d: __m256) -> __m128 {
        let ab = _mm256_hadd_ps(a, b);
        let cd = _mm256_hadd_ps(c, d);
        let abcd = _mm256_hadd_ps(ab, cd);
        _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1))
    }

    /// See [`super::dot_tile`]: rows four at a time, then one at a time.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_tile_avx2<S: ScaleKind>(
        w: super::QuantMatrix,
        sp: *const u16,
        bp: *const u16,
        rows: std::ops::Range<usize>,
        x: super::ActRow,
        out: &mut [f32],
    ) {
        let groups = w.groups_per_row();
        let rem = (groups % 8) as i32;
        let tail =
            _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(rem), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        let unpack = Unpack::new(w.bits);
        let o = out.as_mut_ptr().sub(rows.start);
        let mut r = rows.start;
        while r + 4 <= rows.end {
            let a = row_partials::<S>(&w, sp, bp, r, &x, tail, &unpack);
            let b = row_partials::<S>(&w, sp, bp, r + 1, &x, tail, &unpack);
            let c = row_partials::<S>(&w, sp, bp, r + 2, &x, tail, &unpack);
            let d = row_partials::<S>(&w, sp, bp, r + 3, &x, tail, &unpack);
            _mm_storeu_ps(o.add(r), reduce4(a, b, c, d));
            r += 4;
        }
        while r < rows.end {
            *o.add(r) = hsum(row_partials::<S>(&w, sp, bp, r, &x, tail, &unpack));
            r += 1;
        }
    }
}
