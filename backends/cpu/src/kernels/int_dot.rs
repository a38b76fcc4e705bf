//! Integer kernels for MLX affine weights (2/3/4/5/6/8 bits): the activation rows are quantized once per step to
//! int16 in blocks of 32 (one f32 scale per block, plus the exact f32 block sum for the affine bias
//! term), then every weight row is an integer dot product per block (`vpmaddwd`, or `vpdpwssd` on the
//! VNNI paths):
//!
//! `Σ x·(s·q + b) ≈ s · Σ_blocks d_x · Σ q·x16  +  b · Σ x`
//!
//! The bias term is exact; the `q·x` products see the rounding of `x` to 16 bits (≤ 1/65534 of each
//! block's largest value: well below the f16 rounding mlx-lm itself applies). llama.cpp uses int8
//! activations here; with SmolLM2's outlier channels that moved the first-step logits by up to 1.2,
//! while int16 stays within 0.01 of the f32 reference at almost the same speed.
//!
//! Two families of x86 kernels: 256-bit (AVX2, every width) and 512-bit (the AVX-512 paths, 2/4/8-bit
//! weights, whose values tile a 16-bit word). Each is written once, generic over the step that
//! multiplies int16 pairs and accumulates them to int32 (`vpmaddwd` + `vpaddd`, or one `vpdpwssd`):
//! the integer sums are exact either way, so the VNNI builds give the same results bit for bit, and
//! the AVX-VNNI build (which this project's CI hosts may lack) differs from the tested ones only in
//! that step's encoding. On `avx512vnni`, 4-bit weights take the panel kernel instead
//! ([`panel`](super::panel): sixteen rows per pass, one per lane, `vpdpbusd` on the int16 values'
//! byte planes). On AArch64 one NEON kernel serves 4-bit weights (`arm`: the int16 values split into
//! byte planes for `udot`/`sdot`, or widening multiplies without the dot product).

use super::quantized::QuantMatrix;
use super::{Floats, SharedMut};
use crate::isa::Isa;

/// How an activation row's int16 values are ordered: the order in which the kernel for its weights
/// unpacks packed values, so that each vector of weights meets a contiguous run of activations.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum ActOrder {
    /// Element order (3/5/6/8-bit weights on the 256-bit kernels; every width on the portable path
    /// but 4 bits).
    Natural,
    /// Per block of 32: even elements, then odd ones (4-bit weights on the 256-bit kernels: the low
    /// and high nibbles of each byte).
    Nibbles,
    /// [`ActOrder::Nibbles`], plus a copy of each block split into byte planes for the NEON kernel
    /// and the x86 panel kernel (4-bit weights): the low bytes of its 32 values (unsigned), then
    /// their high bytes (signed), so that `x = 256·hi + lo` and each half is an 8-bit operand
    /// (`udot`/`sdot`, `vpdpbusd`).
    NibblePlanes,
    /// `bits`-bit weights (2, 4, 8) on the 512-bit kernels. Blocks go in sets of `16 / bits` (one
    /// 64-byte vector of packed weights; the row's last set may be shorter); within a set, value 0 of
    /// every 16-bit weight word of all its blocks (block by block), then value 1, and so on: the
    /// kernel splits the vector into its `16 / bits` fields with a shift and a mask each.
    Fields(usize),
}

impl ActOrder {
    /// The order the kernels of `isa` take for `bits`-bit weights in groups of `group`.
    pub fn for_weights(isa: Isa, bits: usize, group: usize) -> ActOrder {
        match bits {
            4 if isa.has_avx512vnni() && matches!(group, 32 | 64 | 128) => ActOrder::NibblePlanes,
            2 | 4 | 8 if isa.has_avx512() && matches!(group, 32 | 64 | 128) => ActOrder::Fields(bits),
            4 if isa.is_neon() => ActOrder::NibblePlanes,
            4 => ActOrder::Nibbles,
            _ => ActOrder::Natural,
        }
    }

    /// Where element `e` of a row of `nb` blocks is stored.
    pub fn position(self, nb: usize, e: usize) -> usize {
        let (blk, u) = (e / 32, e % 32);
        match self {
            ActOrder::Natural => e,
            ActOrder::Nibbles | ActOrder::NibblePlanes => blk * 32 + u % 2 * 16 + u / 2,
            ActOrder::Fields(bits) => {
                let per_word = 16 / bits; // values per 16-bit word, and blocks per set
                let words = 2 * bits; // 16-bit words per block
                let set0 = blk / per_word * per_word;
                let m = per_word.min(nb - set0);
                set0 * 32 + (u % per_word) * words * m + (blk - set0) * words + u / per_word
            }
        }
    }
}

/// An activation row set quantized for [`dot_row`]: `[t, k]` as int16 blocks of 32, each row in the
/// [`ActOrder`] its weights' kernel takes. `d` and `group_sums` carry [`PAD`] zeros past their end,
/// so kernels may read whole vectors.
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
    /// [`ActOrder::NibblePlanes`] only: 64 bytes per block (the low bytes of `q`'s 32 values, then
    /// their high bytes).
    pub planes: Vec<u8>,
}

impl IntActs {
    /// Token `ti`'s row of an input of `k` values per token quantized in `order`, with `gpr` weight
    /// groups per row.
    pub fn row(&self, ti: usize, k: usize, gpr: usize, order: ActOrder) -> ActRow<'_> {
        ActRow {
            q: &self.q[ti * k..(ti + 1) * k],
            d: &self.d[ti * k / 32..(ti + 1) * k / 32],
            group_sums: &self.group_sums[ti * gpr..(ti + 1) * gpr],
            order,
            planes: self.planes.get(ti * 2 * k..(ti + 1) * 2 * k).unwrap_or(&[]),
        }
    }
}

/// Identifies one quantization of one activation tensor.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct ActsKey {
    /// The caller's name for the tensor (the executor uses its graph node).
    pub source: usize,
    pub t: usize,
    pub k: usize,
    pub group: usize,
    pub order: ActOrder,
}

/// Zeros kept past the end of [`IntActs::d`] and [`IntActs::group_sums`].
pub const PAD: usize = 8;

/// Quantizes `x [t, k]` (k a multiple of `group`, itself a multiple of 32) to int16 blocks, each row
/// in `order`.
pub fn quantize_acts(isa: Isa, x: &[f32], t: usize, k: usize, group: usize, order: ActOrder, out: &mut IntActs) {
    let blocks = t * k / 32;
    let group_blocks = group / 32;
    let (nb, gpr) = (k / 32, k / group);
    out.q.resize(t * k, 0);
    out.d.clear();
    out.d.resize(blocks + PAD, 0.0);
    out.group_sums.clear();
    out.group_sums.resize(blocks / group_blocks + PAD, 0.0);
    let with_planes = order == ActOrder::NibblePlanes;
    out.planes.clear();
    if with_planes {
        out.planes.resize(t * k * 2, 0);
    }
    let (q, d, sums, planes) = (
        SharedMut(out.q.as_mut_ptr()),
        SharedMut(out.d.as_mut_ptr()),
        SharedMut(out.group_sums.as_mut_ptr()),
        SharedMut(out.planes.as_mut_ptr()),
    );
    // Rows (tokens) in parallel: several sequences' decode tokens are quantized while the other
    // threads would otherwise wait for the matmul.
    let rows_per_task = t.div_ceil(2 * crate::pool::threads()).max(1);
    crate::pool::for_each(t.div_ceil(rows_per_task), |task| {
        for row in task * rows_per_task..((task + 1) * rows_per_task).min(t) {
            // SAFETY: task rows are disjoint, and each writes only its row's values, scales, sums
            // and planes, all inside the buffers sized above.
            let (q, d, sums) = unsafe { (q.slice(row * k, k), d.slice(row * nb, nb), sums.slice(row * gpr, gpr)) };
            let planes = if with_planes { unsafe { planes.slice(row * 2 * k, 2 * k) } } else { &mut [][..] };
            quantize_row(isa, &x[row * k..(row + 1) * k], group_blocks, order, q, d, sums, planes);
        }
    });
}

/// [`quantize_acts`] for one row of `k = q.len()` values.
#[allow(clippy::too_many_arguments)]
fn quantize_row(
    isa: Isa,
    x: &[f32],
    group_blocks: usize,
    order: ActOrder,
    q: &mut [i16],
    d: &mut [f32],
    group_sums: &mut [f32],
    planes: &mut [u8],
) {
    let nb = q.len() / 32;
    for blk in 0..nb {
        let xs = &x[blk * 32..(blk + 1) * 32];
        let (scale, sum) = match order {
            ActOrder::Fields(bits) => {
                // Natural order, then each field's values to their run within the block's set.
                let mut tmp = [0i16; 32];
                let r = quantize_block(isa, xs, &mut tmp, false);
                let (per_word, words) = (16 / bits, 2 * bits);
                let set0 = blk / per_word * per_word;
                let m = per_word.min(nb - set0);
                let base = set0 * 32 + (blk - set0) * words;
                for f in 0..per_word {
                    for i in 0..words {
                        q[base + f * words * m + i] = tmp[i * per_word + f];
                    }
                }
                r
            }
            _ => {
                let nibbles = matches!(order, ActOrder::Nibbles | ActOrder::NibblePlanes);
                quantize_block(isa, xs, &mut q[blk * 32..(blk + 1) * 32], nibbles)
            }
        };
        d[blk] = scale;
        group_sums[blk / group_blocks] += sum;
    }
    if order == ActOrder::NibblePlanes {
        for (qb, p) in q.chunks_exact(32).zip(planes.chunks_exact_mut(64)) {
            for (i, v) in qb.iter().enumerate() {
                let [lo, hi] = v.to_le_bytes();
                p[i] = lo;
                p[32 + i] = hi;
            }
        }
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

/// The activation side of [`dot_row`] for one token: int16 blocks (in `order`), their scales, and Σx
/// per group.
#[derive(Clone, Copy)]
pub struct ActRow<'a> {
    pub q: &'a [i16],
    pub d: &'a [f32],
    pub group_sums: &'a [f32],
    pub order: ActOrder,
    /// The row's byte planes ([`ActOrder::NibblePlanes`]; else empty).
    pub planes: &'a [u8],
}

/// `Σ x · (s·q + b)` for one packed row and one int16 activation row: per block `d_x · s_g · Σ q·x16`,
/// plus the exact `b_g · Σx` per group. On x86 the 512-bit kernel for activations in
/// [`ActOrder::Fields`], the 256-bit one for 4 and 8 bits otherwise; on AArch64 the NEON kernel for
/// 4 bits; the portable loop for the rest.
#[inline]
pub fn dot_row(isa: Isa, w: QuantRow, x: ActRow) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if let Some(v) = x86::dot_row(isa, w, x) {
        return v;
    }
    #[cfg(target_arch = "aarch64")]
    {
        let mut out = [0f32];
        if arm::dot_rows(isa, w, &[x], &mut out) {
            return out[0];
        }
    }
    let _ = isa;
    dot_row_scalar(w, x)
}

/// [`dot_row`] for `NT` activation rows at once (4-bit weights in groups of 32, 64 or 128, and all
/// widths on the 512-bit kernels, share their unpacking).
#[inline]
pub fn dot_rows<const NT: usize>(isa: Isa, w: QuantRow, x: &[ActRow; NT], out: &mut [f32; NT]) {
    #[cfg(target_arch = "x86_64")]
    if x86::dot_rows(isa, w, x, out) {
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if arm::dot_rows(isa, w, x, out) {
        return;
    }
    for t in 0..NT {
        out[t] = dot_row(isa, w, x[t]);
    }
}

/// [`dot_rows`] for every row of `rows` of `w`: token `j`'s result for row `r` goes to
/// `out[j * stride + r]`, the same bits `dot_rows` gives, with one dispatch for the whole tile
/// instead of one per row (a tenth of an eight-token pass on rows of 576).
///
/// # Safety
/// `out` must be valid for writes at every `j * stride + r`, `j < NT`, `r` in `rows`.
pub unsafe fn dot_rows_tile<const NT: usize>(
    isa: Isa,
    w: QuantMatrix,
    rows: std::ops::Range<usize>,
    x: &[ActRow; NT],
    out: *mut f32,
    stride: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if x86::dot_rows_tile(isa, w, rows.clone(), x, out, stride) {
        return;
    }
    for r in rows {
        let mut o = [0f32; NT];
        dot_rows(isa, w.row(r), x, &mut o);
        // SAFETY: the caller's promise.
        unsafe { store_row(o, out, stride, r) };
    }
}

/// Row `r`'s results for `NT` tokens into [`dot_rows_tile`]'s `out` (token `j` at `j * stride + r`).
///
/// # Safety
/// As [`dot_rows_tile`].
#[inline(always)]
unsafe fn store_row<const NT: usize>(o: [f32; NT], out: *mut f32, stride: usize, r: usize) {
    for (j, v) in o.into_iter().enumerate() {
        *out.add(j * stride + r) = v;
    }
}

/// Whether [`dot_rows`] gives every token exactly the bits [`dot_tile`] gives it alone, for weights
/// of `bits` and `group` and activations in `order`: then several sequences' tokens may share a
/// pass (each block unpacked once for all of them) without a sequence's result depending on its
/// batch-mates. True of the 512-bit kernels, the 256-bit 4-bit one and the NEON one, whose
/// per-token arithmetic does not depend on how many tokens a pass takes and whose reductions share
/// one order.
pub fn passes_match_tile(isa: Isa, bits: usize, group: usize, order: ActOrder) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        x86::wide(isa, bits, group, order)
            || super::panel::applies(isa, bits, group, order)
            || x86::q4_applies(isa, bits, group, order)
    }
    #[cfg(target_arch = "aarch64")]
    {
        let _ = group;
        arm::applies(isa, bits, order)
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        let _ = (isa, bits, group, order);
        false
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
/// term eight or sixteen lanes at a time) and four rows share one reduction. The 256-bit kernel reads
/// up to seven scales past a row (and, for 2/3/5/6 bits, up to six bytes past its weights): the
/// matrix's last rows, where that would leave the buffers, take [`dot_row`]. The 512-bit kernel
/// masks its loads instead.
pub fn dot_tile(isa: Isa, w: QuantMatrix, rows: std::ops::Range<usize>, x: ActRow, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if x86::dot_tile(isa, w, rows.clone(), x, out) {
        return;
    }
    for r in rows.clone() {
        out[r - rows.start] = dot_row(isa, w.row(r), x);
    }
}

fn dot_row_scalar(w: QuantRow, x: ActRow) -> f32 {
    let per_block = 32 * w.bits / 32; // words per block of 32
    let nb = x.d.len();
    let mut acc = 0f32;
    for (blk, bw) in w.words.chunks_exact(per_block).enumerate() {
        let mut isum = 0i32;
        if w.bits == 4 && matches!(x.order, ActOrder::Nibbles | ActOrder::NibblePlanes) {
            let xb = &x.q[blk * 32..(blk + 1) * 32];
            for (j, word) in bw.iter().enumerate() {
                for k in 0..4 {
                    let byte = (word >> (8 * k)) & 0xff;
                    let idx = j * 4 + k; // byte idx holds elements 2·idx (low) and 2·idx+1 (high)
                    isum += (byte & 0x0f) as i32 * xb[idx] as i32 + (byte >> 4) as i32 * xb[16 + idx] as i32;
                }
            }
        } else {
            // Value i is bits i·b .. i·b + b of the block's little-endian stream; its activation is
            // where `x.order` put element i.
            let mask = (1u64 << w.bits) - 1;
            for i in 0..32 {
                let bit = i * w.bits;
                let lo = bw[bit / 32] as u64;
                let hi = bw.get(bit / 32 + 1).map_or(0, |&v| v as u64);
                let xv = x.q[x.order.position(nb, blk * 32 + i)];
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

/// Entry points of a kernel body generic over its dot-product step (x86's `Dot256`/`Dot512`,
/// NEON's `udot`/`sdot` or widening step), one per step, each compiled with the features that step
/// (and its path) needs: a `#[target_feature]` function cannot depend on a type parameter.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! entries {
    ($body:ident [$($decl:tt)*] [$($arg:tt)*] ($($p:ident: $t:ty),*) $(-> $ret:ty)?;) => {};
    ($body:ident [$($decl:tt)*] [$($arg:tt)*] ($($p:ident: $t:ty),*) $(-> $ret:ty)?;
     $entry:ident: $dot:ty, $features:literal; $($rest:tt)*) => {
        /// # Safety
        /// The CPU must have the features this entry enables; the pointers and activation rows
        /// as the kernel body reads them.
        #[target_feature(enable = $features)]
        pub unsafe fn $entry<$($decl)*>($($p: $t),*) $(-> $ret)? {
            $body::<$dot, $($arg)*>($($p),*)
        }
        entries!($body [$($decl)*] [$($arg)*] ($($p: $t),*) $(-> $ret)?; $($rest)*);
    };
}

/// The scale storage types of the x86 kernels (the panel kernel's too).
#[cfg(target_arch = "x86_64")]
pub(super) use x86::{Brain, Half, ScaleKind, Single};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::marker::PhantomData;

    use super::{ActOrder, ActRow, Floats, QuantMatrix, QuantRow};
    use crate::isa::{Isa, IsaPath};
    use crate::kernels::panel;

    /// The step that multiplies int16 pairs and adds them to int32 lanes, `acc + a₀·b₀ + a₁·b₁`: the
    /// only place the VNNI kernels differ from the others. Weights are at most 255 and activations
    /// at most 32767 in magnitude, so no form overflows and all give the same integers.
    pub trait Dot256 {
        unsafe fn dot(acc: __m256i, a: __m256i, b: __m256i) -> __m256i;
    }
    /// 512-bit [`Dot256`].
    pub trait Dot512 {
        unsafe fn dot(acc: __m512i, a: __m512i, b: __m512i) -> __m512i;
    }
    /// `vpmaddwd` then `vpaddd` (AVX2, AVX-512 BW).
    pub struct Madd;
    /// `vpdpwssd`, VEX-encoded (AVX-VNNI).
    pub struct VnniVex;
    /// `vpdpwssd`, EVEX-encoded (AVX-512 VNNI; VL for 256 bits).
    pub struct VnniEvex;
    impl Dot256 for Madd {
        #[inline(always)]
        unsafe fn dot(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
            _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
        }
    }
    impl Dot256 for VnniVex {
        #[inline(always)]
        unsafe fn dot(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
            _mm256_dpwssd_avx_epi32(acc, a, b)
        }
    }
    impl Dot256 for VnniEvex {
        #[inline(always)]
        unsafe fn dot(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
            _mm256_dpwssd_epi32(acc, a, b)
        }
    }
    impl Dot512 for Madd {
        #[inline(always)]
        unsafe fn dot(acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
            _mm512_add_epi32(acc, _mm512_madd_epi16(a, b))
        }
    }
    // Inline assembly rather than the intrinsic: LLVM's default tuning splits the several-token
    // kernel's `vpdpwssd` chains back into `vpmaddwd` + `vpaddd`, twice the vector work where eight
    // tokens' chains already run side by side (an 8-token 4-bit pass on Zen 4: 7-12% slower). The
    // 256-bit kernels keep the intrinsic: their one-token chains gain from the split's shorter
    // latency (6-bit decode 13% faster with it). The integers are the same either way.
    impl Dot512 for VnniEvex {
        #[inline]
        #[target_feature(enable = "avx512f,avx512vnni")]
        unsafe fn dot(mut acc: __m512i, a: __m512i, b: __m512i) -> __m512i {
            std::arch::asm!("vpdpwssd {acc}, {a}, {b}", acc = inout(zmm_reg) acc, a = in(zmm_reg) a,
                b = in(zmm_reg) b, options(pure, nomem, nostack, preserves_flags));
            acc
        }
    }

    /// Runs `$body` with `$S` the scale type of `$scales`/`$biases` and `$sp`/`$bp` their pointers:
    /// `Some` of its value, `None` for mixed storage (the portable path's).
    macro_rules! with_scales {
        ($scales:expr, $biases:expr, $S:ident, $sp:ident, $bp:ident => $body:expr) => {
            match ($scales, $biases) {
                (Floats::F16(s), Floats::F16(b)) => {
                    type $S = Half;
                    let ($sp, $bp) = (s.as_ptr(), b.as_ptr());
                    Some($body)
                }
                (Floats::BF16(s), Floats::BF16(b)) => {
                    type $S = Brain;
                    let ($sp, $bp) = (s.as_ptr(), b.as_ptr());
                    Some($body)
                }
                (Floats::F32(s), Floats::F32(b)) => {
                    type $S = Single;
                    let ($sp, $bp) = (s.as_ptr() as *const u16, b.as_ptr() as *const u16);
                    Some($body)
                }
                _ => None,
            }
        };
    }

    /// The 256-bit entry `$avx2`/`$avxvnni`/`$evex` for `$isa`'s path.
    macro_rules! call_256 {
        ($isa:expr, $avx2:ident, $avxvnni:ident, $evex:ident, <$($g:tt),*> ($($a:expr),*)) => {
            match $isa.path() {
                IsaPath::AvxVnni => $avxvnni::<$($g),*>($($a),*),
                IsaPath::Avx512Vnni => $evex::<$($g),*>($($a),*),
                _ => $avx2::<$($g),*>($($a),*),
            }
        };
    }

    /// The 512-bit entry `$plain`/`$vnni` for `$isa`'s path and `$bits`-bit weights (2, 4 or 8).
    macro_rules! call_512 {
        ($isa:expr, $bits:expr, $plain:ident, $vnni:ident, <$S:ty $(, $g:tt)*> ($($a:expr),*)) => {
            match ($isa.has_avx512vnni(), $bits) {
                (false, 2) => $plain::<$S, 2 $(, $g)*>($($a),*),
                (false, 4) => $plain::<$S, 4 $(, $g)*>($($a),*),
                (false, _) => $plain::<$S, 8 $(, $g)*>($($a),*),
                (true, 2) => $vnni::<$S, 2 $(, $g)*>($($a),*),
                (true, 4) => $vnni::<$S, 4 $(, $g)*>($($a),*),
                (true, _) => $vnni::<$S, 8 $(, $g)*>($($a),*),
            }
        };
    }

    /// Rows past the one being read whose weights the one-row kernels request (about 2-5 KB ahead
    /// on typical rows). Rows are short next to memory's latency, and rows read side by side (or
    /// between their scales and biases) lose the hardware prefetcher: 15-17% of a one-thread
    /// 4-bit decode's matmuls (`qmatmul_bench`, AVX2 and AVX-512 alike).
    const PF_ROWS: usize = 8;

    /// Requests the weights of `rows` rows of `row_bytes` each, [`PF_ROWS`] rows past the row at
    /// `wp` (rows are contiguous; addresses past the matrix are only hinted, never read).
    #[inline(always)]
    unsafe fn prefetch_rows_ahead(wp: *const u8, row_bytes: usize, rows: usize) {
        let ahead = wp.wrapping_add(PF_ROWS * row_bytes);
        let mut o = 0;
        while o < rows * row_bytes {
            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(o) as *const i8);
            o += 64;
        }
    }

    /// The order the 256-bit kernels take for `bits`-bit weights.
    fn order_256(bits: usize) -> ActOrder {
        if bits == 4 {
            ActOrder::Nibbles
        } else {
            ActOrder::Natural
        }
    }

    /// Whether the 512-bit kernels apply: activations in their order for these weights, on an
    /// AVX-512 path.
    pub fn wide(isa: Isa, bits: usize, group: usize, order: ActOrder) -> bool {
        isa.has_avx512() && matches!(group, 32 | 64 | 128) && order == ActOrder::Fields(bits)
    }

    /// Whether the 256-bit 4-bit kernel of several tokens ([`q4_row`]) serves these weights and
    /// activations: it gives each token the bits of the one-token tile, so passes may cross
    /// sequences ([`super::passes_match_tile`]).
    pub fn q4_applies(isa: Isa, bits: usize, group: usize, order: ActOrder) -> bool {
        isa.has_avx2() && bits == 4 && order == ActOrder::Nibbles && matches!(group, 32 | 64 | 128)
    }

    /// Row `w` as a one-row matrix (for the panel kernel, which takes rows of a matrix).
    fn one_row(w: QuantRow) -> QuantMatrix {
        let (k, group) = (w.words.len() * 32 / w.bits, 32 * w.group_blocks);
        QuantMatrix {
            packed: w.words,
            scales: w.scales.slice(w.group0, k / group),
            biases: w.biases.slice(w.group0, k / group),
            bits: w.bits,
            group,
            k,
            panels: None,
        }
    }

    /// [`super::dot_row`] on x86; `None` where the portable loop runs.
    pub fn dot_row(isa: Isa, w: QuantRow, x: ActRow) -> Option<f32> {
        if panel::applies(isa, w.bits, w.group_blocks * 32, x.order) {
            let mut out = [0f32];
            // SAFETY: AVX-512 (F/BW/VL) and its VNNI are present; `out` holds the one result.
            if unsafe { panel::rows_tile(one_row(w), 0..1, &[x], out.as_mut_ptr(), 1) } {
                return Some(out[0]);
            }
        }
        if wide(isa, w.bits, w.group_blocks * 32, x.order) {
            let mut out = [0f32];
            // SAFETY: AVX-512 F/BW/VL (and VNNI on its path) are present: an `Isa` exists only for a
            // path this CPU supports. The kernel's loads are masked to the row and `x`.
            with_scales!(w.scales, w.biases, S, sp, bp => unsafe {
                call_512!(isa, w.bits, dot_rows_wide_avx512, dot_rows_wide_avx512vnni, <S, 1>(w, sp, bp, &[x], &mut out))
            })?;
            return Some(out[0]);
        }
        if !isa.has_avx2() || !matches!(w.bits, 4 | 8) || x.order != order_256(w.bits) {
            return None;
        }
        if q4_applies(isa, w.bits, w.group_blocks * 32, x.order) {
            let mut out = [0f32];
            // SAFETY: as below; `q4_row` keeps its reads inside the scales and biases, and reads
            // up to seven block factors and group sums past `x`'s (an `IntActs` row: padded).
            with_scales!(w.scales, w.biases, S, sp, bp => unsafe {
                call_256!(isa, dot_rows_q4_avx2, dot_rows_q4_avxvnni, dot_rows_q4_avx512vnni, <S, 1>(w, sp, bp, &[x], &mut out))
            })?;
            return Some(out[0]);
        }
        // SAFETY: AVX2/FMA/F16C (and the VNNI of a VNNI path) are present, as above.
        with_scales!(w.scales, w.biases, S, sp, bp => unsafe {
            call_256!(isa, dot_row_avx2, dot_row_avxvnni, dot_row_avx512vnni, <S>(w, sp, bp, x))
        })
    }

    /// [`super::dot_rows`] on x86; false where it falls back to one row at a time.
    pub fn dot_rows<const NT: usize>(isa: Isa, w: QuantRow, x: &[ActRow; NT], out: &mut [f32; NT]) -> bool {
        let order = x[0].order;
        if x.iter().any(|r| r.order != order) {
            return false;
        }
        if panel::applies(isa, w.bits, w.group_blocks * 32, order) {
            // SAFETY: as in `dot_row`; token j's result goes to `out[j]`.
            return unsafe { panel::rows_tile(one_row(w), 0..1, x, out.as_mut_ptr(), 1) };
        }
        if wide(isa, w.bits, w.group_blocks * 32, order) {
            // SAFETY: as in `dot_row`.
            return with_scales!(w.scales, w.biases, S, sp, bp => unsafe {
                call_512!(isa, w.bits, dot_rows_wide_avx512, dot_rows_wide_avx512vnni, <S, NT>(w, sp, bp, x, out))
            })
            .is_some();
        }
        if !q4_applies(isa, w.bits, w.group_blocks * 32, order) {
            return false;
        }
        // SAFETY: as in `dot_row`.
        with_scales!(w.scales, w.biases, S, sp, bp => unsafe {
            call_256!(isa, dot_rows_q4_avx2, dot_rows_q4_avxvnni, dot_rows_q4_avx512vnni, <S, NT>(w, sp, bp, x, out))
        })
        .is_some()
    }

    /// [`super::dot_rows_tile`] on x86; false where it falls back to [`super::dot_rows`] per row.
    ///
    /// # Safety
    /// As [`super::dot_rows_tile`].
    pub unsafe fn dot_rows_tile<const NT: usize>(
        isa: Isa,
        w: QuantMatrix,
        rows: std::ops::Range<usize>,
        x: &[ActRow; NT],
        out: *mut f32,
        stride: usize,
    ) -> bool {
        let order = x[0].order;
        if x.iter().any(|r| r.order != order) {
            return false;
        }
        if panel::applies(isa, w.bits, w.group, order) {
            // SAFETY: as in `dot_row`; `out` as the caller promises.
            return unsafe { panel::rows_tile(w, rows, x, out, stride) };
        }
        if wide(isa, w.bits, w.group, order) {
            // SAFETY: as in `dot_row`; `out` as the caller promises.
            return with_scales!(w.scales, w.biases, S, sp, bp => unsafe {
                call_512!(isa, w.bits, rows_tile_wide_avx512, rows_tile_wide_avx512vnni,
                    <S, NT>(w, sp, bp, rows.clone(), x, out, stride))
            })
            .is_some();
        }
        if !q4_applies(isa, w.bits, w.group, order) {
            return false;
        }
        // SAFETY: as in `dot_row`; `out` as the caller promises.
        with_scales!(w.scales, w.biases, S, sp, bp => unsafe {
            call_256!(isa, rows_tile_q4_avx2, rows_tile_q4_avxvnni, rows_tile_q4_avx512vnni,
                <S, NT>(w, sp, bp, rows.clone(), x, out, stride))
        })
        .is_some()
    }

    /// [`super::dot_tile`] on x86; false where it runs [`super::dot_row`] per row.
    pub fn dot_tile(isa: Isa, w: QuantMatrix, rows: std::ops::Range<usize>, x: ActRow, out: &mut [f32]) -> bool {
        if panel::applies(isa, w.bits, w.group, x.order) {
            assert!(out.len() >= rows.len());
            // SAFETY: as in `dot_row`; `out` holds a result per row.
            return unsafe { panel::rows_tile(w, rows.clone(), &[x], out.as_mut_ptr().wrapping_sub(rows.start), 0) };
        }
        if wide(isa, w.bits, w.group, x.order) {
            // SAFETY: as in `dot_row`; the loads are masked to each row's weights, scales and biases.
            return with_scales!(w.scales, w.biases, S, sp, bp => unsafe {
                call_512!(isa, w.bits, dot_tile_wide_avx512, dot_tile_wide_avx512vnni, <S>(w, sp, bp, rows.clone(), x, out))
            })
            .is_some();
        }
        if !isa.has_avx2() || !matches!(w.group, 32 | 64 | 128) || x.order != order_256(w.bits) {
            return false;
        }
        let gpr = w.groups_per_row();
        // Rows whose scale/bias vectors stay inside the buffers.
        // (and, for 2/3/5/6 bits, whose blocks are read eight bytes at a time, inside the weights).
        let row_bytes = w.words_per_row() * 4;
        let by_scales = w.scales.len().min(w.biases.len()).saturating_sub(super::PAD) / gpr;
        let by_words = (w.packed.len() * 4).saturating_sub(8) / row_bytes;
        let safe_end = by_scales.min(by_words).min(rows.end).max(rows.start);
        let fast = rows.start..safe_end;
        // SAFETY: AVX2/FMA/F16C (and the VNNI of a VNNI path) are present, as in `dot_row`; `fast`
        // rows read inside the buffers and `x` comes from an `IntActs` (padded).
        let done = with_scales!(w.scales, w.biases, S, sp, bp => unsafe {
            call_256!(isa, dot_tile_avx2, dot_tile_avxvnni, dot_tile_avx512vnni, <S>(w, sp, bp, fast.clone(), x, out))
        })
        .is_some();
        if done {
            for r in fast.end..rows.end {
                out[r - rows.start] = super::dot_row(isa, w.row(r), x);
            }
        }
        done
    }

    /// The sum of eight lanes in [`reduce4`]'s order, `((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7))`:
    /// a row reduced alone equals the same row reduced four at a time, bit for bit, so kernels that
    /// take tokens several at a time can match the one-token tile (batch invariance).
    #[inline(always)]
    unsafe fn hsum_pairs(v: __m256) -> f32 {
        let h = _mm256_hadd_ps(v, v);
        let h = _mm256_hadd_ps(h, h);
        _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)))
    }

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
        /// The elements at the sixteen indices `idx` (a gather, on AVX-512 F; the 16-bit kinds read
        /// 32 bits each, two bytes past their element).
        unsafe fn gather16(p: *const u16, idx: __m512i) -> __m512;
        /// [`ScaleKind::gather16`] at `idx` and at `idx + 1`: one gather for the 16-bit kinds (each
        /// lane's 32-bit read holds both), two for f32 (which reads the element past `idx + 1`'s
        /// too, like the 16-bit kinds' read past theirs).
        #[inline(always)]
        unsafe fn gather16_pair(p: *const u16, idx: __m512i) -> [__m512; 2] {
            [Self::gather16(p, idx), Self::gather16(p, _mm512_add_epi32(idx, _mm512_set1_epi32(1)))]
        }
        /// The sixteen elements from `p` (an f32 is two 16-bit elements of `p`).
        unsafe fn load16(p: *const u16) -> __m512;
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
        #[inline(always)]
        unsafe fn gather16(p: *const u16, idx: __m512i) -> __m512 {
            let words = _mm512_i32gather_epi32::<2>(idx, p as *const i32);
            _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words))
        }
        #[inline(always)]
        unsafe fn gather16_pair(p: *const u16, idx: __m512i) -> [__m512; 2] {
            let words = _mm512_i32gather_epi32::<2>(idx, p as *const i32);
            let high = _mm512_srli_epi32::<16>(words);
            [_mm512_cvtph_ps(_mm512_cvtepi32_epi16(words)), _mm512_cvtph_ps(_mm512_cvtepi32_epi16(high))]
        }
        #[inline(always)]
        unsafe fn load16(p: *const u16) -> __m512 {
            _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
        }
    }
    impl ScaleKind for Brain {
        const IS_BRAIN: bool = true;
        #[inline(always)]
        unsafe fn load(p: *const u16, i: usize) -> f32 {
            f32::from_bits((*p.add(i) as u32) << 16)
        }
        #[inline(always)]
        unsafe fn gather16(p: *const u16, idx: __m512i) -> __m512 {
            let words = _mm512_i32gather_epi32::<2>(idx, p as *const i32);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(words))
        }
        #[inline(always)]
        unsafe fn gather16_pair(p: *const u16, idx: __m512i) -> [__m512; 2] {
            let words = _mm512_i32gather_epi32::<2>(idx, p as *const i32);
            let high = _mm512_and_si512(words, _mm512_set1_epi32(0xFFFF_0000u32 as i32));
            [_mm512_castsi512_ps(_mm512_slli_epi32::<16>(words)), _mm512_castsi512_ps(high)]
        }
        #[inline(always)]
        unsafe fn load16(p: *const u16) -> __m512 {
            let words = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(words))
        }
    }
    impl ScaleKind for Single {
        #[inline(always)]
        unsafe fn load(p: *const u16, i: usize) -> f32 {
            *(p as *const f32).add(i)
        }
        #[inline(always)]
        unsafe fn gather16(p: *const u16, idx: __m512i) -> __m512 {
            _mm512_i32gather_ps::<4>(idx, p as *const f32)
        }
        #[inline(always)]
        unsafe fn load16(p: *const u16) -> __m512 {
            _mm512_loadu_ps(p as *const f32)
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
    unsafe fn q4_block<D: Dot256>(wp: *const u8, xp: *const i16, blk: usize) -> __m256i {
        q4_block_with::<D>(wp, blk, block_acts(xp, blk))
    }

    /// Block `blk`'s int16 activations: even elements, then odd ones.
    #[inline(always)]
    unsafe fn block_acts(xp: *const i16, blk: usize) -> (__m256i, __m256i) {
        let x_even = _mm256_loadu_si256(xp.add(blk * 32) as *const __m256i);
        let x_odd = _mm256_loadu_si256(xp.add(blk * 32 + 16) as *const __m256i);
        (x_even, x_odd)
    }

    /// [`q4_block`] with the block's activations already loaded (rows that share them).
    #[inline(always)]
    unsafe fn q4_block_with<D: Dot256>(wp: *const u8, blk: usize, (x_even, x_odd): (__m256i, __m256i)) -> __m256i {
        let (lo, hi) = q4_nibbles(wp, blk);
        D::dot(D::dot(_mm256_setzero_si256(), lo, x_even), hi, x_odd)
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

    /// Eight blocks' sums, lane `j` block `j`, from the horizontal sums of their pairs
    /// (`hadd(block 2i, block 2i + 1)` for `i` in 0..4): the end of the reduction tree.
    #[inline(always)]
    unsafe fn block_sums8(pairs: [__m256i; 4]) -> __m256i {
        // Per 128-bit half: [Σ0, Σ1, Σ2, Σ3] of blocks 0-3 (low half of each block's lanes, high half).
        let h0123 = _mm256_hadd_epi32(pairs[0], pairs[1]);
        let h4567 = _mm256_hadd_epi32(pairs[2], pairs[3]);
        _mm256_add_epi32(_mm256_permute2x128_si256(h0123, h4567, 0x20), _mm256_permute2x128_si256(h0123, h4567, 0x31))
    }

    /// Lanes `0..groups % 8` set: the last, partial set of eight groups of a row's bias term.
    #[inline(always)]
    unsafe fn tail_mask(groups: usize) -> __m256 {
        let rem = _mm256_set1_epi32((groups % 8) as i32);
        _mm256_castsi256_ps(_mm256_cmpgt_epi32(rem, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)))
    }

    /// `acc` plus a row's bias term `b_g · Σx_g` in eight lanes: eight groups at a time, the last
    /// set masked by `tail` ([`tail_mask`]). Reads up to seven biases and group sums past the row.
    #[inline(always)]
    unsafe fn add_bias_lanes<S: ScaleKind>(
        mut acc: __m256,
        bp: *const u16,
        gs: *const f32,
        groups: usize,
        tail: __m256,
    ) -> __m256 {
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
            let sums = block_sums8([h01, h23, h45, h67]);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_loadu_ps(comb.as_ptr().add(i)), acc);
            i += 8;
        }
        while i < nb {
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block(b0 + i)), _mm256_set1_ps(*comb.get_unchecked(i)), acc);
            i += 1;
        }
        acc
    }

    /// [`accumulate_blocks_reduced`] for `R` rows of 4-bit weights at once (`wp[j]` row `j`'s blocks,
    /// `comb[j]` its factors), each block's activations loaded once for all of them: the same
    /// arithmetic per row, with half the activation loads for a pair (the one-token kernel is
    /// bound by its loads and shuffles, not its multiplies).
    #[inline(always)]
    unsafe fn accumulate_q4_rows<D: Dot256, const R: usize>(
        comb: &[[f32; ROW_CHUNK]; R],
        b0: usize,
        nb: usize,
        wp: [*const u8; R],
        xp: *const i16,
    ) -> [__m256; R] {
        let mut acc = [_mm256_setzero_ps(); R];
        let mut i = 0;
        while i + 8 <= nb {
            let b = b0 + i;
            // Per row: the horizontal sums of block pairs (0,1), (2,3), (4,5), (6,7).
            let mut pairs = [[_mm256_setzero_si256(); 4]; R];
            for (j, pair) in (0..4).map(|j| (j, b + 2 * j)) {
                let (x0, x1) = (block_acts(xp, pair), block_acts(xp, pair + 1));
                for (p, &w) in pairs.iter_mut().zip(&wp) {
                    p[j] = _mm256_hadd_epi32(q4_block_with::<D>(w, pair, x0), q4_block_with::<D>(w, pair + 1, x1));
                }
            }
            for ((acc, p), c) in acc.iter_mut().zip(&pairs).zip(comb) {
                let sums = block_sums8(*p);
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_loadu_ps(c.as_ptr().add(i)), *acc);
            }
            i += 8;
        }
        while i < nb {
            let x = block_acts(xp, b0 + i);
            for ((acc, &w), c) in acc.iter_mut().zip(&wp).zip(comb) {
                let p = q4_block_with::<D>(w, b0 + i, x);
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(*c.get_unchecked(i)), *acc);
            }
            i += 1;
        }
        acc
    }

    /// One block's integer partial sums, by weight width. A trait with inlined methods rather than a
    /// closure: closures are compiled without the caller's AVX2, which keeps intrinsics out of line.
    trait BlockDot {
        unsafe fn block(&self, blk: usize) -> __m256i;
    }
    struct Q8<D> {
        wp: *const u8,
        xp: *const i16,
        dot: PhantomData<D>,
    }
    struct QN<'u, D> {
        wp: *const u8,
        xp: *const i16,
        unpack: &'u Unpack,
        dot: PhantomData<D>,
    }
    impl<D: Dot256> BlockDot for Q8<D> {
        #[inline(always)]
        unsafe fn block(&self, blk: usize) -> __m256i {
            q8_block::<D>(self.wp, self.xp, blk)
        }
    }
    impl<D: Dot256> BlockDot for QN<'_, D> {
        #[inline(always)]
        unsafe fn block(&self, blk: usize) -> __m256i {
            qn_block::<D>(self.wp, self.xp, blk, self.unpack)
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
    unsafe fn qn_block<D: Dot256>(wp: *const u8, xp: *const i16, blk: usize, u: &Unpack) -> __m256i {
        let base = wp.add(blk * 4 * u.bits);
        // packs_epi32 interleaves 128-bit lanes; the 64-bit permute restores value order.
        let w_lo =
            _mm256_permute4x64_epi64(_mm256_packs_epi32(eight_values(base, 0, u), eight_values(base, 1, u)), 0xD8);
        let w_hi =
            _mm256_permute4x64_epi64(_mm256_packs_epi32(eight_values(base, 2, u), eight_values(base, 3, u)), 0xD8);
        let x_lo = _mm256_loadu_si256(xp.add(blk * 32) as *const __m256i);
        let x_hi = _mm256_loadu_si256(xp.add(blk * 32 + 16) as *const __m256i);
        D::dot(D::dot(_mm256_setzero_si256(), w_lo, x_lo), w_hi, x_hi)
    }

    /// One 8-bit block: bytes widened to i16 (`vpmaddubsw` could saturate at 2·255·32767), each half
    /// of 16 by a broadcast load and the in-lane shuffle of [`q4_nibbles`], times the block's int16
    /// activations in natural order.
    #[inline(always)]
    unsafe fn q8_block<D: Dot256>(wp: *const u8, xp: *const i16, blk: usize) -> __m256i {
        let half = |h: usize| {
            let bytes = _mm256_broadcastsi128_si256(_mm_loadu_si128(wp.add(blk * 32 + h * 16) as *const __m128i));
            _mm256_shuffle_epi8(bytes, widen_bytes())
        };
        let x_lo = _mm256_loadu_si256(xp.add(blk * 32) as *const __m256i);
        let x_hi = _mm256_loadu_si256(xp.add(blk * 32 + 16) as *const __m256i);
        D::dot(D::dot(_mm256_setzero_si256(), half(0), x_lo), half(1), x_hi)
    }

    /// 8-bit (and 4-bit in groups other than 32, 64, 128, which [`q4_row`] takes): bytes or
    /// nibbles widened to i16 and multiplied with int16 activations by `vpmaddwd` (see
    /// [`q4_block`], [`q8_block`]). One FMA per block.
    /// Per-block factors `d_x · s_g` are formed 8 at a time up front; the bias term is a vector dot.
    #[inline(always)]
    unsafe fn dot_row_256<D: Dot256, S: ScaleKind>(
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
                accumulate_blocks(&comb[..n], b0, n, |blk| _mm256_cvtepi32_ps(q4_block::<D>(wp, xp, blk)))
            } else {
                accumulate_blocks(&comb[..n], b0, n, |blk| _mm256_cvtepi32_ps(q8_block::<D>(wp, xp, blk)))
            };
            acc = _mm256_add_ps(acc, part);
            b0 += n;
        }
        hsum(acc) + bias
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

    /// Blocks per chunk of [`row_partials`]: its block factors are formed a chunk at a time.
    const ROW_CHUNK: usize = 64;

    /// `R` consecutive rows from `r` against one activation row, each left as eight partial sums
    /// (the caller reduces rows together). Block factors `d_x · s` are formed eight at a time per
    /// chunk of blocks, the bias term `Σ b_g · Σx_g` eight groups at a time with the row's tail
    /// masked off. More than one row only for 4-bit weights (they share activation loads).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn row_partials<D: Dot256, S: ScaleKind, const R: usize>(
        w: &super::QuantMatrix,
        sp: *const u16,
        bp: *const u16,
        r: usize,
        x: &super::ActRow,
        tail: __m256,
        unpack: &Unpack,
    ) -> [__m256; R] {
        debug_assert!(R == 1 || w.bits == 4, "rows share activation loads only for 4-bit weights");
        let gb = w.group / 32;
        let nb = w.k / 32;
        let groups = nb / gb;
        let sp: [*const u16; R] = std::array::from_fn(|j| S::advance(sp, (r + j) * groups));
        let bp: [*const u16; R] = std::array::from_fn(|j| S::advance(bp, (r + j) * groups));
        let bytes_per_block = 4 * w.bits;
        let wp: [*const u8; R] =
            std::array::from_fn(|j| (w.packed.as_ptr() as *const u8).add((r + j) * nb * bytes_per_block));
        let xp = x.q.as_ptr();
        let dp = x.d.as_ptr();
        prefetch_rows_ahead(wp[0], nb * bytes_per_block, R);
        let mut comb = [[0f32; ROW_CHUNK]; R];
        let mut acc = [_mm256_setzero_ps(); R];
        let mut b0 = 0;
        while b0 < nb {
            let n = ROW_CHUNK.min(nb - b0);
            for (c, &sp) in comb.iter_mut().zip(&sp) {
                let mut i = 0;
                while i < n {
                    let v = _mm256_mul_ps(block_scales8::<S>(sp, b0 + i, gb), _mm256_loadu_ps(dp.add(b0 + i)));
                    _mm256_storeu_ps(c.as_mut_ptr().add(i), v);
                    i += 8;
                }
            }
            let part = match w.bits {
                4 => accumulate_q4_rows::<D, R>(&comb, b0, n, wp, xp),
                8 => [accumulate_blocks_reduced(&comb[0][..n], b0, n, &Q8::<D> { wp: wp[0], xp, dot: PhantomData }); R],
                _ => {
                    [accumulate_blocks_reduced(
                        &comb[0][..n],
                        b0,
                        n,
                        &QN::<D> { wp: wp[0], xp, unpack, dot: PhantomData },
                    ); R]
                }
            };
            for (a, p) in acc.iter_mut().zip(part) {
                *a = _mm256_add_ps(*a, p);
            }
            b0 += n;
        }
        let gs = x.group_sums.as_ptr();
        for (acc, &bp) in acc.iter_mut().zip(&bp) {
            *acc = add_bias_lanes::<S>(*acc, bp, gs, groups, tail);
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
    #[inline(always)]
    unsafe fn dot_tile_256<D: Dot256, S: ScaleKind>(
        w: super::QuantMatrix,
        sp: *const u16,
        bp: *const u16,
        rows: std::ops::Range<usize>,
        x: super::ActRow,
        out: &mut [f32],
    ) {
        let tail = tail_mask(w.groups_per_row());
        let unpack = Unpack::new(w.bits);
        let o = out.as_mut_ptr().sub(rows.start);
        let mut r = rows.start;
        while r + 4 <= rows.end {
            let [a, b, c, d] = if w.bits == 4 {
                let [a, b] = row_partials::<D, S, 2>(&w, sp, bp, r, &x, tail, &unpack);
                let [c, d] = row_partials::<D, S, 2>(&w, sp, bp, r + 2, &x, tail, &unpack);
                [a, b, c, d]
            } else {
                // (Not `array::from_fn`: a closure is compiled without this function's features.)
                let [a] = row_partials::<D, S, 1>(&w, sp, bp, r, &x, tail, &unpack);
                let [b] = row_partials::<D, S, 1>(&w, sp, bp, r + 1, &x, tail, &unpack);
                let [c] = row_partials::<D, S, 1>(&w, sp, bp, r + 2, &x, tail, &unpack);
                let [d] = row_partials::<D, S, 1>(&w, sp, bp, r + 3, &x, tail, &unpack);
                [a, b, c, d]
            };
            _mm_storeu_ps(o.add(r), reduce4(a, b, c, d));
            r += 4;
        }
        while r < rows.end {
            // In `reduce4`'s order, so a row's bits do not depend on where its tile starts.
            *o.add(r) = hsum_pairs(row_partials::<D, S, 1>(&w, sp, bp, r, &x, tail, &unpack)[0]);
            r += 1;
        }
    }

    entries!(dot_row_256 [S: ScaleKind] [S] (w: QuantRow, sp: *const u16, bp: *const u16, x: ActRow) -> f32;
        dot_row_avx2: Madd, "avx2,fma,f16c";
        dot_row_avxvnni: VnniVex, "avx2,fma,f16c,avxvnni";
        dot_row_avx512vnni: VnniEvex, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni";
    );
    /// `NT` tokens against one 4-bit row (`wp` its blocks, `sp`/`bp` its scales and biases), each
    /// token left as eight lanes for [`hsum_pairs`]: per token exactly [`row_partials`]'s arithmetic
    /// for a row (the same exact block sums, then the same float operations in the same order), so
    /// a token's result does not depend on how many share the pass; each block's nibbles are unpacked
    /// once for all of them. A run of eight blocks' sums comes from the reduction tree, or with `XT`
    /// from one block per lane against `xt` (the same integers, fewer shuffles per token). Reads up
    /// to seven scales and biases past the row, and seven block factors and group sums past each
    /// token's (an `IntActs` row carries [`super::PAD`] zeros).
    #[inline(always)]
    #[allow(clippy::needless_range_loop)] // `t` walks `x`, `part` and `acc` together
    unsafe fn q4_tokens<D: Dot256, S: ScaleKind, const NT: usize, const XT: bool>(
        wp: *const u8,
        sp: *const u16,
        bp: *const u16,
        (nb, gb): (usize, usize),
        x: &[super::ActRow; NT],
        xt: BlockLanes,
        tail: __m256,
    ) -> [__m256; NT] {
        let groups = nb / gb;
        prefetch_rows_ahead(wp, nb * 16, 1);
        // Per token a chunk's block factors `s · d_x`; only the first `n` (rounded up to 8) of a
        // chunk are written and read.
        let mut comb = std::mem::MaybeUninit::<[[f32; ROW_CHUNK]; NT]>::uninit();
        let cp = comb.as_mut_ptr() as *mut f32;
        let mut acc = [_mm256_setzero_ps(); NT];
        let mut b0 = 0;
        while b0 < nb {
            let n = ROW_CHUNK.min(nb - b0);
            let mut i = 0;
            while i < n {
                let s = block_scales8::<S>(sp, b0 + i, gb);
                for t in 0..NT {
                    let d = _mm256_loadu_ps(x[t].d.as_ptr().add(b0 + i));
                    _mm256_storeu_ps(cp.add(t * ROW_CHUNK + i), _mm256_mul_ps(s, d));
                }
                i += 8;
            }
            let mut part = [_mm256_setzero_ps(); NT];
            let mut i = 0;
            while XT && i + 8 <= n {
                // The eight blocks' words with one block per lane, then each token's sums as sixteen
                // multiply-adds against its activations in the same order: no reduction tree.
                let b = b0 + i;
                let mut wt = [_mm256_setzero_si256(); 16];
                block_lanes_words(wp.add(b * 16), &mut wt);
                let wt = wt.as_ptr();
                for t in 0..NT {
                    let sums = block_lanes_sums::<D>(wt, xt.group(t, b / 8));
                    let c = _mm256_loadu_ps(cp.add(t * ROW_CHUNK + i));
                    part[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), c, part[t]);
                }
                i += 8;
            }
            while !XT && i + 8 <= n {
                let b = b0 + i;
                // The eight blocks' words once, then each token's block sums from them.
                let mut nib = [_mm256_setzero_si256(); 16];
                for j in 0..8 {
                    (nib[2 * j], nib[2 * j + 1]) = q4_nibbles(wp, b + j);
                }
                let np = nib.as_ptr();
                for t in 0..NT {
                    let xp = x[t].q.as_ptr();
                    let h01 = _mm256_hadd_epi32(nib_block::<D>(np, xp, b, 0), nib_block::<D>(np, xp, b, 1));
                    let h23 = _mm256_hadd_epi32(nib_block::<D>(np, xp, b, 2), nib_block::<D>(np, xp, b, 3));
                    let h45 = _mm256_hadd_epi32(nib_block::<D>(np, xp, b, 4), nib_block::<D>(np, xp, b, 5));
                    let h67 = _mm256_hadd_epi32(nib_block::<D>(np, xp, b, 6), nib_block::<D>(np, xp, b, 7));
                    let sums = block_sums8([h01, h23, h45, h67]);
                    let c = _mm256_loadu_ps(cp.add(t * ROW_CHUNK + i));
                    part[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), c, part[t]);
                }
                i += 8;
            }
            while i < n {
                let (lo, hi) = q4_nibbles(wp, b0 + i);
                for t in 0..NT {
                    let (e, o) = block_acts(x[t].q.as_ptr(), b0 + i);
                    let p = D::dot(D::dot(_mm256_setzero_si256(), lo, e), hi, o);
                    let c = _mm256_set1_ps(*cp.add(t * ROW_CHUNK + i));
                    part[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), c, part[t]);
                }
                i += 1;
            }
            for t in 0..NT {
                acc[t] = _mm256_add_ps(acc[t], part[t]);
            }
            b0 += n;
        }
        for t in 0..NT {
            acc[t] = add_bias_lanes::<S>(acc[t], bp, x[t].group_sums.as_ptr(), groups, tail);
        }
        acc
    }

    /// Tokens' 4-bit activations with one block per lane: per token and run of eight blocks, sixteen
    /// vectors, vector `m` holding dword `m` of each block's sixteen (dword `m < 8`: its even
    /// elements `4m`, `4m + 2`; `m ≥ 8`: the odd ones `4(m−8) + 1`, `+ 3`, [`ActOrder::Nibbles`]'s
    /// pairs). Built per tile of rows from the tokens' rows ([`BlockLanes::fill`]).
    #[derive(Clone, Copy)]
    struct BlockLanes {
        p: *const i32,
        /// Dwords per token.
        stride: usize,
    }

    impl BlockLanes {
        const NONE: BlockLanes = BlockLanes { p: std::ptr::null(), stride: 0 };

        /// The `NT` tokens' whole runs of eight blocks (`k / 256` per token) into `buf`.
        #[inline(always)]
        fn fill<const NT: usize>(x: &[super::ActRow; NT], k: usize, buf: &mut Vec<i32>) -> BlockLanes {
            let runs = k / 256;
            let stride = runs * 128;
            // Every value is written below: no need to clear what the last tile left.
            buf.resize(NT * stride, 0);
            for (t, xr) in x.iter().enumerate() {
                let out = &mut buf[t * stride..(t + 1) * stride];
                for (run, o) in out.chunks_exact_mut(128).enumerate() {
                    for (l, blk) in xr.q[run * 256..(run + 1) * 256].chunks_exact(32).enumerate() {
                        for (m, pair) in blk.chunks_exact(2).enumerate() {
                            o[m * 8 + l] = (pair[0] as u16 as u32 | (pair[1] as u16 as u32) << 16) as i32;
                        }
                    }
                }
            }
            BlockLanes { p: buf.as_ptr(), stride }
        }

        /// Token `t`'s run of eight blocks number `run`.
        #[inline(always)]
        unsafe fn group(self, t: usize, run: usize) -> *const i32 {
            self.p.add(t * self.stride + run * 128)
        }
    }

    /// The 128 bytes of eight consecutive 4-bit blocks at `wp` as words with one block per lane:
    /// `w[m]` holds the low nibbles of bytes `2m`, `2m + 1` of each block, `w[8 + m]` their high ones
    /// (the pairs [`q4_nibbles`] puts in dword `m` of a block's two vectors). An 8×8 transpose of the
    /// blocks' 16-bit pairs, then the usual widening per pair position.
    #[inline(always)]
    unsafe fn block_lanes_words(wp: *const u8, w: &mut [__m256i; 16]) {
        let r = |l: usize| _mm_loadu_si128(wp.add(l * 16) as *const __m128i);
        let (r0, r1, r2, r3, r4, r5, r6, r7) = (r(0), r(1), r(2), r(3), r(4), r(5), r(6), r(7));
        let (a0, a1) = (_mm_unpacklo_epi16(r0, r1), _mm_unpackhi_epi16(r0, r1));
        let (a2, a3) = (_mm_unpacklo_epi16(r2, r3), _mm_unpackhi_epi16(r2, r3));
        let (a4, a5) = (_mm_unpacklo_epi16(r4, r5), _mm_unpackhi_epi16(r4, r5));
        let (a6, a7) = (_mm_unpacklo_epi16(r6, r7), _mm_unpackhi_epi16(r6, r7));
        let (b0, b1) = (_mm_unpacklo_epi32(a0, a2), _mm_unpackhi_epi32(a0, a2));
        let (b2, b3) = (_mm_unpacklo_epi32(a1, a3), _mm_unpackhi_epi32(a1, a3));
        let (b4, b5) = (_mm_unpacklo_epi32(a4, a6), _mm_unpackhi_epi32(a4, a6));
        let (b6, b7) = (_mm_unpacklo_epi32(a5, a7), _mm_unpackhi_epi32(a5, a7));
        let pairs = [
            _mm_unpacklo_epi64(b0, b4),
            _mm_unpackhi_epi64(b0, b4),
            _mm_unpacklo_epi64(b1, b5),
            _mm_unpackhi_epi64(b1, b5),
            _mm_unpacklo_epi64(b2, b6),
            _mm_unpackhi_epi64(b2, b6),
            _mm_unpacklo_epi64(b3, b7),
            _mm_unpackhi_epi64(b3, b7),
        ];
        for (m, &p) in pairs.iter().enumerate() {
            let words = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(p), widen_bytes());
            w[m] = _mm256_and_si256(words, _mm256_set1_epi16(0x0f));
            w[8 + m] = _mm256_srli_epi16(words, 4);
        }
    }

    /// The exact sums of eight blocks, lane `l` block `l`: sixteen multiply-adds of the words of
    /// [`block_lanes_words`] against a token's run of [`BlockLanes`].
    #[inline(always)]
    unsafe fn block_lanes_sums<D: Dot256>(w: *const __m256i, x: *const i32) -> __m256i {
        let (mut even, mut odd) = (_mm256_setzero_si256(), _mm256_setzero_si256());
        for m in 0..8 {
            even = D::dot(even, *w.add(m), _mm256_loadu_si256(x.add(8 * m) as *const __m256i));
            odd = D::dot(odd, *w.add(8 + m), _mm256_loadu_si256(x.add(64 + 8 * m) as *const __m256i));
        }
        _mm256_add_epi32(even, odd)
    }

    /// Block `b + j`'s eight int32 partial sums (as [`q4_block`]) from its words unpacked at
    /// `nib[2j]` (low nibbles) and `nib[2j + 1]` (high ones).
    #[inline(always)]
    unsafe fn nib_block<D: Dot256>(nib: *const __m256i, xp: *const i16, b: usize, j: usize) -> __m256i {
        let (e, o) = block_acts(xp, b + j);
        D::dot(D::dot(_mm256_setzero_si256(), *nib.add(2 * j), e), *nib.add(2 * j + 1), o)
    }

    /// `NT` tokens against one 4-bit row (groups of 1, 2 or 4 blocks), each token's result the bits
    /// [`dot_tile_256`] gives it alone: [`q4_tokens`], reduced in [`reduce4`]'s order. A row whose
    /// scales or biases end fewer than [`super::PAD`] elements before their buffer's end (a matrix's
    /// last rows) is read from a zero-padded copy of them, the same values.
    #[inline(always)]
    unsafe fn q4_row<D: Dot256, S: ScaleKind, const NT: usize, const XT: bool>(
        w: super::QuantRow,
        sp: *const u16,
        bp: *const u16,
        x: &[super::ActRow; NT],
        xt: BlockLanes,
        out: &mut [f32; NT],
    ) {
        let (gb, nb) = (w.group_blocks, w.words.len() / 4);
        let groups = nb / gb;
        let tail = tail_mask(groups);
        let wp = w.words.as_ptr() as *const u8;
        let (sp, bp) = (S::advance(sp, w.group0), S::advance(bp, w.group0));
        let acc = if w.group0 + groups + super::PAD <= w.scales.len().min(w.biases.len()) {
            q4_tokens::<D, S, NT, XT>(wp, sp, bp, (nb, gb), x, xt, tail)
        } else {
            let bytes = groups * if S::IS_HALF || S::IS_BRAIN { 2 } else { 4 };
            // On the stack for rows of up to 64 groups (every decode step reads a last row).
            let (mut stack, mut heap) = ([0u32; 2 * (64 + super::PAD)], Vec::new());
            let copy = if groups <= 64 {
                &mut stack[..2 * (groups + super::PAD)]
            } else {
                heap.resize(2 * (groups + super::PAD), 0u32);
                &mut heap[..]
            };
            let (cs, cb) = copy.split_at_mut(groups + super::PAD);
            std::ptr::copy_nonoverlapping(sp as *const u8, cs.as_mut_ptr() as *mut u8, bytes);
            std::ptr::copy_nonoverlapping(bp as *const u8, cb.as_mut_ptr() as *mut u8, bytes);
            let (cs, cb) = (cs.as_ptr() as *const u16, cb.as_ptr() as *const u16);
            q4_tokens::<D, S, NT, XT>(wp, cs, cb, (nb, gb), x, xt, tail)
        };
        for (o, a) in out.iter_mut().zip(acc) {
            *o = hsum_pairs(a);
        }
    }

    /// [`q4_row`] from the tokens' rows alone (block sums by the reduction tree).
    #[inline(always)]
    unsafe fn q4_row_alone<D: Dot256, S: ScaleKind, const NT: usize>(
        w: super::QuantRow,
        sp: *const u16,
        bp: *const u16,
        x: &[super::ActRow; NT],
        out: &mut [f32; NT],
    ) {
        q4_row::<D, S, NT, false>(w, sp, bp, x, BlockLanes::NONE, out)
    }

    entries!(q4_row_alone [S: ScaleKind, const NT: usize] [S, NT]
        (w: QuantRow, sp: *const u16, bp: *const u16, x: &[ActRow; NT], out: &mut [f32; NT]);
        dot_rows_q4_avx2: Madd, "avx2,fma,f16c";
        dot_rows_q4_avxvnni: VnniVex, "avx2,fma,f16c,avxvnni";
        dot_rows_q4_avx512vnni: VnniEvex, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni";
    );
    /// [`q4_row`] for every row of `rows` (see [`super::dot_rows_tile`]), the block sums from
    /// [`BlockLanes`].
    #[inline(always)]
    unsafe fn rows_tile_q4_256<D: Dot256, S: ScaleKind, const NT: usize>(
        w: super::QuantMatrix,
        sp: *const u16,
        bp: *const u16,
        rows: std::ops::Range<usize>,
        x: &[super::ActRow; NT],
        out: *mut f32,
        stride: usize,
    ) {
        // The tokens' activations with one block per lane, once for the tile's rows. (The loop not
        // in a closure: one would be compiled without this function's features.)
        // SAFETY: the buffer is this thread's, and nothing below calls back into this kernel.
        let buf = unsafe { &mut *BLOCK_LANES.with(|b| b.get()) };
        let xt = BlockLanes::fill(x, w.k, buf);
        for r in rows {
            let mut o = [0f32; NT];
            q4_row::<D, S, NT, true>(w.row(r), sp, bp, x, xt, &mut o);
            super::store_row(o, out, stride, r);
        }
    }

    thread_local! {
        /// [`rows_tile_q4_256`]'s [`BlockLanes`] buffer.
        static BLOCK_LANES: std::cell::UnsafeCell<Vec<i32>> = const { std::cell::UnsafeCell::new(Vec::new()) };
    }

    entries!(rows_tile_q4_256 [S: ScaleKind, const NT: usize] [S, NT]
        (w: QuantMatrix, sp: *const u16, bp: *const u16, rows: std::ops::Range<usize>, x: &[ActRow; NT],
            out: *mut f32, stride: usize);
        rows_tile_q4_avx2: Madd, "avx2,fma,f16c";
        rows_tile_q4_avxvnni: VnniVex, "avx2,fma,f16c,avxvnni";
        rows_tile_q4_avx512vnni: VnniEvex, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni";
    );
    entries!(dot_tile_256 [S: ScaleKind] [S]
        (w: QuantMatrix, sp: *const u16, bp: *const u16, rows: std::ops::Range<usize>, x: ActRow, out: &mut [f32]);
        dot_tile_avx2: Madd, "avx2,fma,f16c";
        dot_tile_avxvnni: VnniVex, "avx2,fma,f16c,avxvnni";
        dot_tile_avx512vnni: VnniEvex, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni";
    );

    // ---- 512-bit kernels: 2/4/8-bit weights, activations in `ActOrder::Fields` order. ----

    /// Lanes `0..n` of sixteen.
    #[inline(always)]
    fn lanes(n: usize) -> __mmask16 {
        if n >= 16 {
            !0
        } else {
            ((1u32 << n) - 1) as __mmask16
        }
    }

    #[inline(always)]
    unsafe fn iota() -> __m512i {
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
    }

    /// `n ≤ 16` consecutive scales from `p + i` as f32; the lanes past `n` are zero and nothing past
    /// them is read.
    #[inline(always)]
    unsafe fn load16<S: ScaleKind>(p: *const u16, i: usize, n: usize) -> __m512 {
        if S::IS_HALF {
            _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes(n), p.add(i) as *const i16))
        } else if S::IS_BRAIN {
            let h = _mm256_maskz_loadu_epi16(lanes(n), p.add(i) as *const i16);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        } else {
            _mm512_maskz_loadu_ps(lanes(n), (p as *const f32).add(i))
        }
    }

    /// The scales of blocks `b0..b0 + n` (`b0` a multiple of 16, `n ≤ 16`) for groups of `gb` ∈
    /// {1, 2, 4} blocks: each group's scale repeated over its blocks.
    #[inline(always)]
    unsafe fn block_scales16<S: ScaleKind>(p: *const u16, b0: usize, gb: usize, n: usize) -> __m512 {
        if gb == 1 {
            return load16::<S>(p, b0, n);
        }
        let v = load16::<S>(p, b0 / gb, n.div_ceil(gb));
        _mm512_permutexvar_ps(_mm512_srlv_epi32(iota(), _mm512_set1_epi32(gb.trailing_zeros() as i32)), v)
    }

    /// A set's 64 bytes, or for a row's shorter last set only its `lanes` (the rest zero).
    #[inline(always)]
    unsafe fn load_set<const FULL: bool>(p: *const u8, lanes: __mmask16) -> __m512i {
        if FULL {
            _mm512_loadu_si512(p as *const _)
        } else {
            _mm512_maskz_loadu_epi32(lanes, p as *const i32)
        }
    }

    /// Sixteen lanes summed to eight.
    #[inline(always)]
    unsafe fn fold(v: __m512) -> __m256 {
        _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))))
    }

    /// One set of `m` blocks from block `blk` (`16 / BITS` blocks, or fewer for a row's last set):
    /// a single load of packed weights split into its `16 / BITS` fields (a mask, and a shift for
    /// the next), each field times its contiguous run of activations, per token; then the set's
    /// integer sums (lane `l` belongs to the set's block `l / BITS`) converted and multiplied by
    /// their blocks' factors (`comb` spread over the lanes by `idx`). Four 4-bit blocks take
    /// three shifts, three masks and four dot steps; the 256-bit kernel spends six instructions
    /// and a share of a reduction tree on each block.
    #[inline(always)]
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
    unsafe fn set_wide<D: Dot512, const BITS: u32, const NT: usize, const FULL: bool>(
        wp: *const u8,
        x: &[ActRow; NT],
        blk: usize,
        m: usize,
        comb: &[__m512; NT],
        idx: __m512i,
        acc: &mut [__m512; NT],
    ) {
        let bits = BITS as usize;
        let per_word = 16 / bits;
        let lanes = lanes(m * bits); // a block is `bits` 32-bit lanes of weights, and of each field's run
        let mask = _mm512_set1_epi16((1i16 << BITS) - 1);
        let mut field = [_mm512_setzero_si512(); 8];
        let mut rest = load_set::<FULL>(wp.add(blk * 4 * bits), lanes);
        for f in 0..per_word {
            if f + 1 < per_word {
                field[f] = _mm512_and_si512(rest, mask);
                rest = _mm512_srli_epi16::<BITS>(rest);
            } else {
                field[f] = rest; // the top field is alone in its bits after the shifts
            }
        }
        let run = 2 * bits * m; // int16 activations per field
        for t in 0..NT {
            let xp = x[t].q.as_ptr().add(blk * 32);
            let mut sum = _mm512_setzero_si512();
            for f in 0..per_word {
                sum = D::dot(sum, field[f], load_set::<FULL>(xp.add(f * run) as *const u8, lanes));
            }
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_permutexvar_ps(idx, comb[t]), acc[t]);
        }
    }

    /// `NT` activation rows against one row of `nb` blocks of `BITS`-bit weights (`wp`, and its
    /// first scale and bias at `sp`, `bp`): per token sixteen partial sums of the bias term and the
    /// block terms. Block factors `d_x · s` and the bias term go sixteen lanes at a time; every load
    /// past the row's end is masked off.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)]
    unsafe fn rows_wide<D: Dot512, S: ScaleKind, const BITS: u32, const NT: usize>(
        wp: *const u8,
        sp: *const u16,
        bp: *const u16,
        nb: usize,
        gb: usize,
        x: &[ActRow; NT],
    ) -> [__m512; NT] {
        let per_set = 16 / BITS as usize;
        let groups = nb / gb;
        prefetch_rows_ahead(wp, nb * 4 * BITS as usize, 1);
        let mut acc = [_mm512_setzero_ps(); NT];
        let mut g = 0;
        while g < groups {
            let n = 16.min(groups - g);
            let b = load16::<S>(bp, g, n);
            for t in 0..NT {
                let gs = _mm512_maskz_loadu_ps(lanes(n), x[t].group_sums.as_ptr().add(g));
                acc[t] = _mm512_fmadd_ps(b, gs, acc[t]);
            }
            g += 16;
        }
        let lane_block = _mm512_srlv_epi32(iota(), _mm512_set1_epi32(BITS.trailing_zeros() as i32));
        let mut b0 = 0;
        while b0 < nb {
            let n = 16.min(nb - b0);
            let s = block_scales16::<S>(sp, b0, gb, n);
            let mut comb = [_mm512_setzero_ps(); NT];
            for t in 0..NT {
                comb[t] = _mm512_mul_ps(s, _mm512_maskz_loadu_ps(lanes(n), x[t].d.as_ptr().add(b0)));
            }
            let mut j = 0;
            while j + per_set <= n {
                let idx = _mm512_add_epi32(lane_block, _mm512_set1_epi32(j as i32));
                set_wide::<D, BITS, NT, true>(wp, x, b0 + j, per_set, &comb, idx, &mut acc);
                j += per_set;
            }
            if j < n {
                let idx = _mm512_add_epi32(lane_block, _mm512_set1_epi32(j as i32));
                set_wide::<D, BITS, NT, false>(wp, x, b0 + j, n - j, &comb, idx, &mut acc);
            }
            b0 += 16;
        }
        acc
    }

    /// [`super::dot_rows`] (and, with one row, [`super::dot_row`]) on the 512-bit kernel.
    #[inline(always)]
    unsafe fn dot_rows_wide<D: Dot512, S: ScaleKind, const BITS: u32, const NT: usize>(
        w: QuantRow,
        sp: *const u16,
        bp: *const u16,
        x: &[ActRow; NT],
        out: &mut [f32; NT],
    ) {
        let nb = w.words.len() / BITS as usize; // a block is `BITS` words
        let (sp, bp) = (S::advance(sp, w.group0), S::advance(bp, w.group0));
        let acc = rows_wide::<D, S, BITS, NT>(w.words.as_ptr() as *const u8, sp, bp, nb, w.group_blocks, x);
        for (o, a) in out.iter_mut().zip(acc) {
            *o = hsum_pairs(fold(a));
        }
    }

    /// [`dot_rows_wide`] for every row of `rows` (see [`super::dot_rows_tile`]).
    #[inline(always)]
    unsafe fn rows_tile_wide<D: Dot512, S: ScaleKind, const BITS: u32, const NT: usize>(
        w: QuantMatrix,
        sp: *const u16,
        bp: *const u16,
        rows: std::ops::Range<usize>,
        x: &[ActRow; NT],
        out: *mut f32,
        stride: usize,
    ) {
        for r in rows {
            let mut o = [0f32; NT];
            dot_rows_wide::<D, S, BITS, NT>(w.row(r), sp, bp, x, &mut o);
            super::store_row(o, out, stride, r);
        }
    }

    /// [`super::dot_tile`] on the 512-bit kernel: rows four at a time, then one at a time.
    #[inline(always)]
    unsafe fn dot_tile_wide<D: Dot512, S: ScaleKind, const BITS: u32>(
        w: QuantMatrix,
        sp: *const u16,
        bp: *const u16,
        rows: std::ops::Range<usize>,
        x: ActRow,
        out: &mut [f32],
    ) {
        let xs = [x];
        let mut r = rows.start;
        while r + 4 <= rows.end {
            let a = fold(tile_row::<D, S, BITS>(&w, sp, bp, r, &xs));
            let b = fold(tile_row::<D, S, BITS>(&w, sp, bp, r + 1, &xs));
            let c = fold(tile_row::<D, S, BITS>(&w, sp, bp, r + 2, &xs));
            let d = fold(tile_row::<D, S, BITS>(&w, sp, bp, r + 3, &xs));
            let sums = reduce4(a, b, c, d);
            _mm_storeu_ps(out.as_mut_ptr().add(r - rows.start), sums);
            r += 4;
        }
        while r < rows.end {
            out[r - rows.start] = hsum_pairs(fold(tile_row::<D, S, BITS>(&w, sp, bp, r, &xs)));
            r += 1;
        }
    }

    /// Row `r` of `w` against one activation row: sixteen partial sums.
    #[inline(always)]
    unsafe fn tile_row<D: Dot512, S: ScaleKind, const BITS: u32>(
        w: &QuantMatrix,
        sp: *const u16,
        bp: *const u16,
        r: usize,
        x: &[ActRow; 1],
    ) -> __m512 {
        let (nb, gb, groups) = (w.k / 32, w.group / 32, w.groups_per_row());
        let wp = (w.packed.as_ptr() as *const u8).add(r * nb * 4 * BITS as usize);
        let (sp, bp) = (S::advance(sp, r * groups), S::advance(bp, r * groups));
        rows_wide::<D, S, BITS, 1>(wp, sp, bp, nb, gb, x)[0]
    }

    entries!(dot_rows_wide [S: ScaleKind, const BITS: u32, const NT: usize] [S, BITS, NT]
        (w: QuantRow, sp: *const u16, bp: *const u16, x: &[ActRow; NT], out: &mut [f32; NT]);
        dot_rows_wide_avx512: Madd, "avx2,fma,f16c,avx512f,avx512bw,avx512vl";
        dot_rows_wide_avx512vnni: VnniEvex, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni";
    );
    entries!(rows_tile_wide [S: ScaleKind, const BITS: u32, const NT: usize] [S, BITS, NT]
        (w: QuantMatrix, sp: *const u16, bp: *const u16, rows: std::ops::Range<usize>, x: &[ActRow; NT],
            out: *mut f32, stride: usize);
        rows_tile_wide_avx512: Madd, "avx2,fma,f16c,avx512f,avx512bw,avx512vl";
        rows_tile_wide_avx512vnni: VnniEvex, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni";
    );
    entries!(dot_tile_wide [S: ScaleKind, const BITS: u32] [S, BITS]
        (w: QuantMatrix, sp: *const u16, bp: *const u16, rows: std::ops::Range<usize>, x: ActRow, out: &mut [f32]);
        dot_tile_wide_avx512: Madd, "avx2,fma,f16c,avx512f,avx512bw,avx512vl";
        dot_tile_wide_avx512vnni: VnniEvex, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni";
    );
}

/// The NEON kernel: 4-bit weights (groups of 32, 64 or 128) against activations in
/// [`ActOrder::NibblePlanes`]. A block's integer sum `Σ q·x16` is `256·Σ q·hi + Σ q·lo` over its
/// byte planes: two `udot` and two `sdot` where the CPU has them (`neondot`), widening multiplies
/// and pairwise adds otherwise (`neon`). Either gives each block's exact sum, and four blocks are
/// reduced to one vector of their totals before anything is rounded, so both builds give the same
/// bits, and a token's arithmetic does not depend on how many tokens share its pass.
#[cfg(target_arch = "aarch64")]
mod arm {
    use std::arch::aarch64::*;
    use std::arch::asm;

    use super::{ActOrder, ActRow, Floats, QuantRow};
    use crate::isa::Isa;

    /// Whether the NEON kernel serves `bits`-bit weights with activations in `order`.
    pub fn applies(isa: Isa, bits: usize, order: ActOrder) -> bool {
        isa.is_neon() && bits == 4 && order == ActOrder::NibblePlanes
    }

    /// [`super::dot_rows`] (and, with one row, [`super::dot_row`]) on NEON; false where the portable
    /// loop runs.
    pub fn dot_rows<const NT: usize>(isa: Isa, w: QuantRow, x: &[ActRow; NT], out: &mut [f32; NT]) -> bool {
        if !applies(isa, w.bits, x[0].order)
            || !matches!(w.group_blocks, 1 | 2 | 4)
            || x.iter().any(|r| {
                let nb = w.words.len() / 4;
                r.order != x[0].order
                    || r.planes.len() < nb * 64
                    || r.d.len() < nb
                    || r.group_sums.len() < nb / w.group_blocks
            })
        {
            return false;
        }
        // SAFETY: NEON (and the dot product on its path) are present: an `Isa` exists only for a
        // path this CPU supports. Every load stays inside the row's words, scales and biases and
        // each token's planes, block scales and group sums (checked above).
        unsafe {
            match (w.scales, w.biases, isa.has_dotprod()) {
                (Floats::F16(s), Floats::F16(b), true) => rows_dotprod::<Half, NT>(w, s.as_ptr(), b.as_ptr(), x, out),
                (Floats::F16(s), Floats::F16(b), false) => rows_neon::<Half, NT>(w, s.as_ptr(), b.as_ptr(), x, out),
                (Floats::BF16(s), Floats::BF16(b), true) => {
                    rows_dotprod::<Brain, NT>(w, s.as_ptr(), b.as_ptr(), x, out)
                }
                (Floats::BF16(s), Floats::BF16(b), false) => rows_neon::<Brain, NT>(w, s.as_ptr(), b.as_ptr(), x, out),
                (Floats::F32(s), Floats::F32(b), dp) => {
                    let (sp, bp) = (s.as_ptr() as *const u16, b.as_ptr() as *const u16);
                    if dp {
                        rows_dotprod::<Single, NT>(w, sp, bp, x, out)
                    } else {
                        rows_neon::<Single, NT>(w, sp, bp, x, out)
                    }
                }
                _ => return false, // mixed storage: the portable path's
            }
        }
        true
    }

    /// How scales and biases are stored; `load` reads `m ≤ 4` of them from element `i` as f32 (the
    /// lanes past `m` zero, nothing past them read).
    pub trait ScaleKind {
        unsafe fn load(p: *const u16, i: usize, m: usize) -> float32x4_t;
    }
    struct Half;
    struct Brain;
    struct Single;

    /// Four 16-bit values from `p + i`, or the first `m` and zeros.
    #[inline(always)]
    unsafe fn load_u16x4(p: *const u16, i: usize, m: usize) -> uint16x4_t {
        if m == 4 {
            return vld1_u16(p.add(i));
        }
        let mut a = [0u16; 4];
        std::ptr::copy_nonoverlapping(p.add(i), a.as_mut_ptr(), m);
        vld1_u16(a.as_ptr())
    }

    impl ScaleKind for Half {
        #[inline(always)]
        unsafe fn load(p: *const u16, i: usize, m: usize) -> float32x4_t {
            let h = load_u16x4(p, i, m);
            let f: float32x4_t;
            // `fcvtl` is base Armv8 (the f16 intrinsics are not stable Rust).
            asm!("fcvtl {0:v}.4s, {1:v}.4h", out(vreg) f, in(vreg) h, options(pure, nomem, nostack));
            f
        }
    }
    impl ScaleKind for Brain {
        #[inline(always)]
        unsafe fn load(p: *const u16, i: usize, m: usize) -> float32x4_t {
            vreinterpretq_f32_u32(vshll_n_u16::<16>(load_u16x4(p, i, m)))
        }
    }
    impl ScaleKind for Single {
        #[inline(always)]
        unsafe fn load(p: *const u16, i: usize, m: usize) -> float32x4_t {
            load_f32x4(p as *const f32, i, m)
        }
    }

    /// Four f32 from `p + i`, or the first `m` and zeros.
    #[inline(always)]
    unsafe fn load_f32x4(p: *const f32, i: usize, m: usize) -> float32x4_t {
        if m == 4 {
            return vld1q_f32(p.add(i));
        }
        let mut a = [0f32; 4];
        std::ptr::copy_nonoverlapping(p.add(i), a.as_mut_ptr(), m);
        vld1q_f32(a.as_ptr())
    }

    /// One block's products as four lanes that sum to `Σ q·x16` (how the sum is split over the
    /// lanes differs between the implementations; the total does not). `even`/`odd` are the block's
    /// low and high nibbles, `p` its 64 bytes of planes (low bytes of the even and odd elements,
    /// then their high bytes).
    trait BlockDot {
        unsafe fn block(even: uint8x16_t, odd: uint8x16_t, p: *const u8) -> int32x4_t;
    }
    /// `udot`/`sdot` (through `asm!`: the dot-product intrinsics are not stable Rust).
    struct DotProd;
    /// Widening multiplies and pairwise adds (every NEON CPU).
    struct Widen;

    impl BlockDot for DotProd {
        #[inline(always)]
        unsafe fn block(even: uint8x16_t, odd: uint8x16_t, p: *const u8) -> int32x4_t {
            let (le, lo_odd) = (vld1q_u8(p), vld1q_u8(p.add(16)));
            let (he, ho) = (vld1q_u8(p.add(32)), vld1q_u8(p.add(48)));
            let mut lo = vdupq_n_u32(0);
            let mut hi = vdupq_n_s32(0);
            // Weights are 0..=15, so they are the same bytes as signed operands of `sdot`.
            asm!(
                "udot {lo:v}.4s, {e:v}.16b, {le:v}.16b",
                "udot {lo:v}.4s, {o:v}.16b, {lodd:v}.16b",
                "sdot {hi:v}.4s, {e:v}.16b, {he:v}.16b",
                "sdot {hi:v}.4s, {o:v}.16b, {ho:v}.16b",
                lo = inout(vreg) lo,
                hi = inout(vreg) hi,
                e = in(vreg) even,
                o = in(vreg) odd,
                le = in(vreg) le,
                lodd = in(vreg) lo_odd,
                he = in(vreg) he,
                ho = in(vreg) ho,
                options(pure, nomem, nostack),
            );
            vmlaq_n_s32(vreinterpretq_s32_u32(lo), hi, 256)
        }
    }

    impl BlockDot for Widen {
        #[inline(always)]
        unsafe fn block(even: uint8x16_t, odd: uint8x16_t, p: *const u8) -> int32x4_t {
            let (le, lo_odd) = (vld1q_u8(p), vld1q_u8(p.add(16)));
            let (he, ho) = (vld1q_s8(p.add(32) as *const i8), vld1q_s8(p.add(48) as *const i8));
            // Four products per 16-bit lane: at most 4·15·255 unsigned, 4·15·128 in magnitude signed.
            let mut lo = vmull_u8(vget_low_u8(even), vget_low_u8(le));
            lo = vmlal_high_u8(lo, even, le);
            lo = vmlal_u8(lo, vget_low_u8(odd), vget_low_u8(lo_odd));
            lo = vmlal_high_u8(lo, odd, lo_odd);
            let (es, os) = (vreinterpretq_s8_u8(even), vreinterpretq_s8_u8(odd));
            let mut hi = vmull_s8(vget_low_s8(es), vget_low_s8(he));
            hi = vmlal_high_s8(hi, es, he);
            hi = vmlal_s8(hi, vget_low_s8(os), vget_low_s8(ho));
            hi = vmlal_high_s8(hi, os, ho);
            vmlaq_n_s32(vreinterpretq_s32_u32(vpaddlq_u16(lo)), vpaddlq_s16(hi), 256)
        }
    }

    /// `NT` activation rows against one row of 4-bit weights (its first scale and bias at `sp`,
    /// `bp`): per token, the bias term and the block terms four at a time into four lanes, then
    /// their sum. Each block's weights are unpacked once for all tokens.
    #[inline(always)]
    #[allow(clippy::needless_range_loop)]
    unsafe fn rows<D: BlockDot, S: ScaleKind, const NT: usize>(
        w: QuantRow,
        sp: *const u16,
        bp: *const u16,
        x: &[ActRow; NT],
        out: &mut [f32; NT],
    ) {
        let nb = w.words.len() / 4; // 16 bytes per block of 32
        let gb = w.group_blocks;
        let groups = nb / gb;
        let wp = w.words.as_ptr() as *const u8;
        let mut acc = [vdupq_n_f32(0.0); NT];
        let mut g = 0;
        while g < groups {
            let m = 4.min(groups - g);
            let b = S::load(bp, w.group0 + g, m);
            for t in 0..NT {
                acc[t] = vfmaq_f32(acc[t], b, load_f32x4(x[t].group_sums.as_ptr(), g, m));
            }
            g += 4;
        }
        let mut b0 = 0;
        while b0 < nb {
            let m = 4.min(nb - b0);
            // The four blocks' scales (groups of 64 and 128 span two and four blocks).
            let s = match gb {
                1 => S::load(sp, w.group0 + b0, m),
                2 => {
                    let v = S::load(sp, w.group0 + b0 / 2, m.div_ceil(2));
                    vzip1q_f32(v, v)
                }
                _ => vdupq_laneq_f32::<0>(S::load(sp, w.group0 + b0 / 4, 1)),
            };
            let mut even = [vdupq_n_u8(0); 4];
            let mut odd = [vdupq_n_u8(0); 4];
            for j in 0..m {
                let v = vld1q_u8(wp.add((b0 + j) * 16));
                even[j] = vandq_u8(v, vdupq_n_u8(15));
                odd[j] = vshrq_n_u8::<4>(v);
            }
            for t in 0..NT {
                let p = x[t].planes.as_ptr().add(b0 * 64);
                let mut ints = [vdupq_n_s32(0); 4];
                for j in 0..m {
                    ints[j] = D::block(even[j], odd[j], p.add(j * 64));
                }
                // Lane j: block b0 + j's exact sum (below 2²⁴, so exact in f32 too).
                let sums = vpaddq_s32(vpaddq_s32(ints[0], ints[1]), vpaddq_s32(ints[2], ints[3]));
                let factor = vmulq_f32(s, load_f32x4(x[t].d.as_ptr(), b0, m));
                acc[t] = vfmaq_f32(acc[t], vcvtq_f32_s32(sums), factor);
            }
            b0 += 4;
        }
        for t in 0..NT {
            out[t] = vaddvq_f32(acc[t]);
        }
    }

    entries!(rows [S: ScaleKind, const NT: usize] [S, NT]
        (w: QuantRow, sp: *const u16, bp: *const u16, x: &[ActRow; NT], out: &mut [f32; NT]);
        rows_dotprod: DotProd, "neon,dotprod";
        rows_neon: Widen, "neon";
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isa::IsaPath;

    use crate::kernels::TestRng as Rng;

    enum Store {
        F32(Vec<f32>),
        F16(Vec<u16>),
        BF16(Vec<u16>),
    }
    impl Store {
        fn new(kind: usize, v: &[f32]) -> Store {
            match kind {
                0 => Store::F32(v.to_vec()),
                1 => Store::F16(v.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect()),
                _ => Store::BF16(v.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect()),
            }
        }
        fn floats(&self) -> Floats<'_> {
            match self {
                Store::F32(v) => Floats::F32(v),
                Store::F16(v) => Floats::F16(v),
                Store::BF16(v) => Floats::BF16(v),
            }
        }
    }

    /// `Σ x·(s·q + b)` in f64 from the same int16 activations, and the sum of its terms' magnitudes
    /// (what f32 rounding of the kernels' sums is relative to).
    fn reference(w: QuantRow, x: ActRow) -> (f64, f64) {
        let nb = x.d.len();
        let (mut sum, mut mag) = (0f64, 0f64);
        for blk in 0..nb {
            let mut isum = 0i64;
            for i in 0..32 {
                let bit = (blk * 32 + i) * w.bits;
                let wd = |j: usize| w.words.get(j).map_or(0u64, |&v| v as u64);
                let q = ((wd(bit / 32) | (wd(bit / 32 + 1) << 32)) >> (bit % 32)) & ((1 << w.bits) - 1);
                isum += q as i64 * x.q[x.order.position(nb, blk * 32 + i)] as i64;
            }
            let term = x.d[blk] as f64 * w.scales.get(w.group0 + blk / w.group_blocks) as f64 * isum as f64;
            sum += term;
            mag += term.abs();
        }
        for (g, &gs) in x.group_sums.iter().enumerate() {
            let term = w.biases.get(w.group0 + g) as f64 * gs as f64;
            sum += term;
            mag += term.abs();
        }
        (sum, mag)
    }

    #[test]
    fn act_orders_place_every_element_once() {
        for order in [
            ActOrder::Natural,
            ActOrder::Nibbles,
            ActOrder::NibblePlanes,
            ActOrder::Fields(2),
            ActOrder::Fields(4),
            ActOrder::Fields(8),
        ] {
            for nb in [1, 2, 3, 5, 8, 9, 17, 18] {
                let mut seen = vec![false; nb * 32];
                for e in 0..nb * 32 {
                    let p = order.position(nb, e);
                    assert!(p < nb * 32 && !seen[p], "{order:?} nb {nb}: element {e} at {p}");
                    seen[p] = true;
                }
            }
        }
    }

    /// Every kernel path this CPU has against the portable one (and the exact f64 value of the same
    /// integer formula) on random weights: every width, groups of 32/64/128, f32/f16/bf16 scales,
    /// odd row counts and rows of 1 to 76 blocks (sets of the 512-bit kernels cut short). Paths that
    /// share a kernel family and activation order (the VNNI builds and their twins) must agree bit
    /// for bit. Prints which paths ran and which were skipped for lack of hardware.
    #[test]
    fn every_isa_path_matches_the_scalar_path() {
        let mut rng = Rng(0x9E3779B97F4A7C15);
        let isas: Vec<Isa> = IsaPath::ALL.into_iter().filter_map(Isa::detect).collect();
        let (n, t) = (37, 8);
        let mut checked = 0;
        for bits in [2, 3, 4, 5, 6, 8] {
            for group in [32, 64, 128] {
                // 70 groups: a 4-bit row whose scales outgrow the 256-bit kernel's stack copy.
                let long = if bits == 4 && group == 32 { Some(70) } else { None };
                for blocks in [1, 3, 9, 19].into_iter().chain(long) {
                    let k = group * blocks;
                    let kind = checked % 3;
                    checked += 1;
                    let packed: Vec<u32> = (0..n * k * bits / 32).map(|_| rng.next() as u32).collect();
                    let gcount = n * k / group;
                    let sv: Vec<f32> = (0..gcount).map(|_| 0.01 + 0.02 * rng.uniform().abs()).collect();
                    let bv: Vec<f32> = (0..gcount).map(|_| 0.05 * rng.uniform()).collect();
                    let (scales, biases) = (Store::new(kind, &sv), Store::new(kind, &bv));
                    let w = QuantMatrix {
                        packed: &packed,
                        scales: scales.floats(),
                        biases: biases.floats(),
                        bits,
                        group,
                        k,
                        panels: None,
                    };
                    // Activations with an outlier channel, as real models have.
                    let x: Vec<f32> = (0..t * k).map(|i| rng.uniform() * if i % k == 7 { 30.0 } else { 1.0 }).collect();
                    // Per activation order: the first SIMD path's results, which the others must equal.
                    let mut seen: Vec<(ActOrder, Vec<f32>)> = Vec::new();
                    let what = format!("bits {bits} group {group} k {k} scales {kind}");
                    let mut want = None;
                    for &isa in std::iter::once(&Isa::SCALAR).chain(&isas) {
                        // Each path's own order, and on AVX-512 paths also the 256-bit kernels' order.
                        let mut orders = vec![ActOrder::for_weights(isa, bits, group)];
                        if isa.has_avx512() {
                            orders.push(ActOrder::for_weights(Isa::SCALAR, bits, group));
                        }
                        for order in orders {
                            let mut acts = IntActs::default();
                            quantize_acts(isa, &x, t, k, group, order, &mut acts);
                            let gpr = k / group;
                            let act = |ti: usize| acts.row(ti, k, gpr, order);
                            // Results, and the (token, row) each is for.
                            let (mut got, mut at) = (Vec::new(), Vec::new());
                            for ti in 0..t {
                                let mut tile = vec![0f32; n];
                                dot_tile(isa, w, 0..n, act(ti), &mut tile);
                                let mut part = vec![0f32; n - 7];
                                dot_tile(isa, w, 5..n - 2, act(ti), &mut part);
                                got.extend(tile.iter().chain(&part));
                                got.extend((0..n).map(|r| dot_row(isa, w.row(r), act(ti))));
                                at.extend((0..n).chain(5..n - 2).chain(0..n).map(|r| (ti, r)));
                            }
                            for r in 0..n {
                                let mut four = [0f32; 4];
                                dot_rows(isa, w.row(r), &std::array::from_fn(act), &mut four);
                                let mut eight = [0f32; 8];
                                dot_rows(isa, w.row(r), &std::array::from_fn(act), &mut eight);
                                got.extend(four.iter().chain(&eight));
                                at.extend((0..4).chain(0..8).map(|ti| (ti, r)));
                            }
                            // A tile of rows in one call: the bits of `dot_rows` row by row.
                            for rows in [0..n, 5..n - 2] {
                                let mut tiled = vec![f32::NAN; 8 * n];
                                // SAFETY: `tiled` holds 8 rows of `n`.
                                unsafe {
                                    dot_rows_tile(
                                        isa,
                                        w,
                                        rows.clone(),
                                        &std::array::from_fn::<_, 8, _>(act),
                                        tiled.as_mut_ptr(),
                                        n,
                                    )
                                };
                                for r in rows {
                                    let mut eight = [0f32; 8];
                                    dot_rows(isa, w.row(r), &std::array::from_fn(act), &mut eight);
                                    for (ti, v) in eight.iter().enumerate() {
                                        assert_eq!(
                                            tiled[ti * n + r].to_bits(),
                                            v.to_bits(),
                                            "{what} {} tile row {r} token {ti}",
                                            isa.name()
                                        );
                                    }
                                }
                            }
                            // Where passes may cross sequences, a token's result is the same bits
                            // in a pass of eight, of four, alone, and at any place in a tile.
                            if passes_match_tile(isa, bits, group, order) {
                                let tiles: Vec<(Vec<f32>, Vec<f32>)> = (0..t)
                                    .map(|ti| {
                                        let (mut whole, mut part) = (vec![0f32; n], vec![0f32; n - 7]);
                                        dot_tile(isa, w, 0..n, act(ti), &mut whole);
                                        dot_tile(isa, w, 5..n - 2, act(ti), &mut part);
                                        (whole, part)
                                    })
                                    .collect();
                                for r in 0..n {
                                    let mut eight = [0f32; 8];
                                    dot_rows(isa, w.row(r), &std::array::from_fn(act), &mut eight);
                                    let mut four = [0f32; 4];
                                    dot_rows(isa, w.row(r), &std::array::from_fn(|j| act(4 + j)), &mut four);
                                    for ti in 0..t {
                                        let (whole, part) = &tiles[ti];
                                        let bits_of = |v: f32| v.to_bits();
                                        let alone = bits_of(dot_row(isa, w.row(r), act(ti)));
                                        let want = bits_of(whole[r]);
                                        assert_eq!(
                                            bits_of(eight[ti]),
                                            want,
                                            "{what} {} row {r} token {ti}",
                                            isa.name()
                                        );
                                        assert_eq!(alone, want, "{what} {} row {r} token {ti} alone", isa.name());
                                        if ti >= 4 {
                                            assert_eq!(bits_of(four[ti - 4]), want, "{what} {} row {r}", isa.name());
                                        }
                                        if (5..n - 2).contains(&r) {
                                            assert_eq!(bits_of(part[r - 5]), want, "{what} {} row {r}", isa.name());
                                        }
                                    }
                                }
                            }
                            // The x86 kernels ran (not the portable loop behind them).
                            #[cfg(target_arch = "x86_64")]
                            if isa.has_avx2() {
                                let wide = matches!(order, ActOrder::Fields(_));
                                let mut tile = vec![0f32; n];
                                assert!(x86::dot_tile(isa, w, 0..n, act(0), &mut tile), "{what} {}", isa.name());
                                let row = x86::dot_row(isa, w.row(0), act(0));
                                assert_eq!(row.is_some(), wide || matches!(bits, 4 | 8), "{what} {}", isa.name());
                                let rows = x86::dot_rows(isa, w.row(0), &std::array::from_fn(act), &mut [0f32; 4]);
                                assert_eq!(rows, wide || bits == 4, "{what} {}", isa.name());
                            }
                            // The NEON kernel ran where it applies.
                            #[cfg(target_arch = "aarch64")]
                            if isa.is_neon() {
                                let ran = arm::dot_rows(isa, w.row(0), &[act(0)], &mut [0f32]);
                                assert_eq!(ran, bits == 4, "{what} {}", isa.name());
                            }
                            // Against the exact value of the formula, and the portable path's result.
                            let exact: Vec<(f64, f64)> =
                                at.iter().map(|&(ti, r)| reference(w.row(r), act(ti))).collect();
                            let scalar = want.get_or_insert_with(|| got.clone());
                            for (i, (&g, &(e, mag))) in got.iter().zip(&exact).enumerate() {
                                let bound = 1e-5 * mag + 1e-30;
                                assert!(
                                    (g as f64 - e).abs() <= bound && (g - scalar[i]).abs() as f64 <= 2.0 * bound,
                                    "{what} {} {order:?}: result {i}: got {g}, exact {e}, scalar {} (bound {bound:e})",
                                    isa.name(),
                                    scalar[i]
                                );
                            }
                            if isa.has_avx2() || isa.is_neon() {
                                match seen.iter().find(|(o, _)| *o == order) {
                                    Some((_, first)) => assert!(
                                        first == &got,
                                        "{what} {} {order:?}: differs from another build of the same kernel",
                                        isa.name()
                                    ),
                                    None => seen.push((order, got)),
                                }
                            }
                        }
                    }
                }
            }
        }
        let ran: Vec<_> = isas.iter().map(|i| i.name()).collect();
        let skipped: Vec<_> = IsaPath::ALL.into_iter().filter(|p| !p.supported()).map(|p| p.name()).collect();
        eprintln!(
            "int_dot kernels vs scalar: ran {}; skipped (not on this CPU): {}",
            ran.join(", "),
            skipped.join(", ")
        );
    }
}
