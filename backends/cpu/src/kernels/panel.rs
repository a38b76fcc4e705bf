//! The panel kernel for 4-bit MLX weights on the `avx512vnni` path: sixteen weight rows at a time, one
//! row per vector lane, with `vpdpbusd` on byte operands.
//!
//! The arithmetic is [`int_dot`](super::int_dot)'s — int16 activations in blocks of 32, one scale per
//! block, exact integer block sums — on bytes: each int16 activation is split into its byte planes,
//! `x = 256·hi + lo` (the [`ActOrder::NibblePlanes`] copy `quantize_acts` makes), and a block's sum is
//! `256·Σ hi·q + Σ lo·q`, both exact in int32.
//!
//! A block of a panel (sixteen rows' 16 bytes of nibbles) is transposed by dword into eight operand
//! vectors: per lane (a row; lanes come out in the order `4·(r % 4) + r / 4` of the panel's rows,
//! undone when results are stored) four weights of one block position quad, low nibbles (the even
//! elements, the block's first 16 positions in nibble order) in the first four vectors and high
//! nibbles in the last four. Each token then needs sixteen `vpdpbusd` per block — its high-plane
//! quads (signed) and low-plane quads (unsigned) broadcast against the operands — and its integer
//! sums are already one lane per row: no horizontal reduction, and the operands are built once for
//! all the tokens of a pass. Per (row, token):
//!
//! `acc = Σ_g (b_g·Σx_g, then per block of g: f32(256·hi + lo)·(s_g·d))`, in that order,
//!
//! whatever the number of tokens in the pass or the rows beside it, so several sequences' tokens
//! share a pass with the bits each gets alone (batch invariance).
//!
//! AMX-INT8 tiles were measured for the multiply (Xeon, `tdpbsud`/`tdpbuud` on the same operands):
//! with one scale per 32 values, every block's sums must leave the tile unit through memory, and the
//! tile passes came out no faster than these vector ones (see docs/benchmarks.md).

use std::arch::x86_64::*;
use std::ops::Range;

use super::int_dot::{ActOrder, ActRow, Brain, Half, ScaleKind, Single};
use super::panel_pack::Panels;
use super::quantized::QuantMatrix;
use super::Floats;
use crate::isa::Isa;

/// Whether the panel kernel serves `bits`-bit weights in groups of `group` with activations in
/// `order` on `isa`.
pub fn applies(isa: Isa, bits: usize, group: usize, order: ActOrder) -> bool {
    isa.has_avx512vnni() && bits == 4 && matches!(group, 32 | 64 | 128) && order == ActOrder::NibblePlanes
}

/// `out[j * stride + r] = row r of w · token j` for `r` in `rows` and every token of `x` (in
/// [`ActOrder::NibblePlanes`]; `w` 4-bit in groups of 32, 64 or 128: see [`applies`]), up to eight
/// tokens per pass, from `w`'s [`Panels`] where it has them. False (nothing written) for scales and
/// biases stored in different types.
///
/// Tokens whose rows are evenly spaced in memory are read at one base address and a fixed distance,
/// so such rows must be views of one buffer (as [`IntActs::row`](super::int_dot::IntActs::row)
/// gives); others are copied first.
///
/// # Safety
/// `isa.has_avx512vnni()` must hold, and `out` must be valid for writes at every `j * stride + r`
/// (`out` itself may point outside its buffer, as where only `rows`' results are stored).
pub unsafe fn rows_tile(w: QuantMatrix, rows: Range<usize>, x: &[ActRow], out: *mut f32, stride: usize) -> bool {
    match (w.scales, w.biases) {
        (Floats::F16(_), Floats::F16(_)) => rows_of::<Half>(&w, rows, x, out, stride),
        (Floats::BF16(_), Floats::BF16(_)) => rows_of::<Brain>(&w, rows, x, out, stride),
        (Floats::F32(_), Floats::F32(_)) => rows_of::<Single>(&w, rows, x, out, stride),
        _ => return false,
    }
    true
}

/// [`rows_tile`] for scales and biases stored as `S`.
unsafe fn rows_of<S: ScaleKind>(w: &QuantMatrix, rows: Range<usize>, x: &[ActRow], out: *mut f32, stride: usize) {
    debug_assert!(x.iter().all(|a| a.order == ActOrder::NibblePlanes && a.planes.len() >= w.k * 2));
    if rows.is_empty() {
        return;
    }
    if let Some(panels) = w.panels {
        // The pack's panels start at multiples of 16 and its last one is zero-padded: whole panels
        // over `rows`, results kept for `rows` only.
        let first = rows.start / 16 * 16;
        return passes::<S, _>(&PackSource { panels, gb: w.group / 32 }, first..rows.end, rows, x, out, stride);
    }
    // Whole panels from the matrix itself; a last panel cut short from a zero-padded copy of its rows,
    // as is the matrix's own last panel (so that no gather reads past its scales' end).
    let mut full_end = rows.start + rows.len() / 16 * 16;
    if full_end > rows.start && full_end == w.packed.len() / w.words_per_row() {
        full_end -= 16;
    }
    if full_end > rows.start {
        passes::<S, _>(&MatrixSource::new(w), rows.start..full_end, rows.start..full_end, x, out, stride);
    }
    if full_end < rows.end {
        let tail = TailPanel::new(w, full_end..rows.end);
        let t = tail.matrix(w);
        let kept = rows.end - full_end;
        passes::<S, _>(&MatrixSource::new(&t), 0..16, 0..kept, x, out.wrapping_add(full_end), stride);
    }
}

/// Every token of `x` against the panels starting at `rows.start`, `rows.start + 16`, … below
/// `rows.end`, whose results are stored for the rows in `keep` only: eight tokens per pass while
/// they last, then four, two, one.
unsafe fn passes<S: ScaleKind, Src: Source>(
    src: &Src,
    rows: Range<usize>,
    keep: Range<usize>,
    x: &[ActRow],
    out: *mut f32,
    stride: usize,
) {
    let mut j = 0;
    while j < x.len() {
        let m = [8, 4, 2].into_iter().find(|&m| x.len() - j >= m).unwrap_or(1);
        let (xs, o, r) = (&x[j..j + m], out.wrapping_add(j * stride), (rows.clone(), keep.clone()));
        match m {
            8 => pass::<S, Src, 8>(src, r, xs, o, stride),
            4 => pass::<S, Src, 4>(src, r, xs, o, stride),
            2 => pass::<S, Src, 2>(src, r, xs, o, stride),
            _ => pass::<S, Src, 1>(src, r, xs, o, stride),
        }
        j += m;
    }
}

/// Asks for the start of the panel of `w`'s panel copy that holds row `row` (its weights, scales and
/// biases), so that a task that has other work first (quantizing its input) finds it in cache;
/// nothing without a copy.
pub fn prefetch_panel(w: &QuantMatrix, row: usize) {
    let Some(panels) = w.panels else { return };
    let src = PackSource { panels, gb: w.group / 32 };
    // SAFETY: prefetches only hint addresses; `panel` computes them without reading.
    unsafe { src.prefetch_panel(row / 16 * 16) }
}

/// The rows of a panel cut short by the end of a tile, padded with zero rows (weights, scales and
/// biases) to sixteen.
struct TailPanel {
    packed: Vec<u32>,
    scales: Padded,
    biases: Padded,
}

/// A copy of some rows' scales or biases in their own storage type.
enum Padded {
    F32(Vec<f32>),
    F16(Vec<u16>),
    BF16(Vec<u16>),
}

impl Padded {
    fn new(src: Floats, from: usize, len: usize, padded: usize) -> Padded {
        fn copy<T: Copy + Default>(s: &[T], from: usize, len: usize, padded: usize) -> Vec<T> {
            let mut v = vec![T::default(); padded];
            v[..len].copy_from_slice(&s[from..from + len]);
            v
        }
        match src {
            Floats::F32(s) => Padded::F32(copy(s, from, len, padded)),
            Floats::F16(s) => Padded::F16(copy(s, from, len, padded)),
            Floats::BF16(s) => Padded::BF16(copy(s, from, len, padded)),
        }
    }

    fn floats(&self) -> Floats<'_> {
        match self {
            Padded::F32(v) => Floats::F32(v),
            Padded::F16(v) => Floats::F16(v),
            Padded::BF16(v) => Floats::BF16(v),
        }
    }
}

impl TailPanel {
    fn new(w: &QuantMatrix, rows: Range<usize>) -> TailPanel {
        let (wpr, gpr) = (w.words_per_row(), w.groups_per_row());
        let mut packed = vec![0u32; 16 * wpr];
        packed[..rows.len() * wpr].copy_from_slice(&w.packed[rows.start * wpr..rows.end * wpr]);
        let (from, len) = (rows.start * gpr, rows.len() * gpr);
        TailPanel {
            packed,
            // One element more than the panel's, for the gathers' 32-bit reads.
            scales: Padded::new(w.scales, from, len, 16 * gpr + 1),
            biases: Padded::new(w.biases, from, len, 16 * gpr + 1),
        }
    }

    /// The padded rows as a 16-row matrix shaped like `w`.
    fn matrix<'a>(&'a self, w: &QuantMatrix) -> QuantMatrix<'a> {
        QuantMatrix {
            packed: &self.packed,
            scales: self.scales.floats(),
            biases: self.biases.floats(),
            panels: None,
            ..*w
        }
    }
}

/// `M` tokens against the panels starting at `rows.start`, `rows.start + 16`, … (results for the rows
/// in `keep`).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn pass<S: ScaleKind, Src: Source, const M: usize>(
    src: &Src,
    (rows, keep): (Range<usize>, Range<usize>),
    x: &[ActRow],
    out: *mut f32,
    stride: usize,
) {
    let gpr = src.groups();
    let toks = Tokens::new(x);
    let mut p0 = rows.start;
    while p0 < rows.end {
        let mut acc = [_mm512_setzero_ps(); M];
        let panel = src.panel(p0);
        // Scales and biases come two groups at a time, each pair's groups written out (an index into
        // the pair kept it on the stack).
        for g in (0..gpr).step_by(2) {
            let [(s0, b0), (s1, b1)] = src.factor_pair::<S>(&panel, g);
            add_group::<S, Src, M>(src, &panel, &toks, g, (s0, b0), &mut acc);
            if g + 1 < gpr {
                add_group::<S, Src, M>(src, &panel, &toks, g + 1, (s1, b1), &mut acc);
            }
        }
        let lanes = kept_lanes(p0, &keep);
        for (t, a) in acc.iter().enumerate() {
            store_results(*a, out.wrapping_add(t * stride + p0), lanes);
        }
        p0 += 16;
    }
}

/// Group `g` of a panel, with its scales `s` and biases `b`, added to each token's `acc`.
#[inline(always)]
unsafe fn add_group<S: ScaleKind, Src: Source, const M: usize>(
    src: &Src,
    panel: &Src::Panel,
    toks: &Tokens<'_>,
    g: usize,
    (s, b): (__m512, __m512),
    acc: &mut [__m512; M],
) {
    toks.bias_term(b, g, acc);
    let gb = src.blocks_per_group();
    for blk in g * gb..(g + 1) * gb {
        src.prefetch(panel, blk, (blk == g * gb).then_some(g));
        let dwords = src.dwords(panel, blk);
        // Per token one chain per plane, the tokens' chains side by side.
        let mut sh = [_mm512_setzero_si512(); M];
        let mut sl = [_mm512_setzero_si512(); M];
        // Each operand built just before its products, the quads written out: as a loop over eight
        // operands built up front, the compiler kept the operands on the stack.
        let planes = toks.planes.add(blk * 64);
        let mut products = |kq: usize, op: __m512i| {
            for t in 0..M {
                let quad =
                    |plane: usize| (planes.add(t * toks.plane_step + plane + 4 * kq) as *const i32).read_unaligned();
                // High bytes are signed (the second operand); low bytes and weights unsigned.
                sh[t] = _mm512_dpbusd_epi32(sh[t], op, _mm512_set1_epi32(quad(32)));
                sl[t] = _mm512_dpbusd_epi32(sl[t], _mm512_set1_epi32(quad(0)), op);
            }
        };
        products(0, low_nibbles(dwords[0]));
        products(1, low_nibbles(dwords[1]));
        products(2, low_nibbles(dwords[2]));
        products(3, low_nibbles(dwords[3]));
        products(4, high_nibbles(dwords[0]));
        products(5, high_nibbles(dwords[1]));
        products(6, high_nibbles(dwords[2]));
        products(7, high_nibbles(dwords[3]));
        for t in 0..M {
            acc[t] = block_term(sh[t], sl[t], s, toks.d.add(t * toks.d_step + blk), acc[t]);
        }
    }
}

/// A block's contribution to one token's sixteen rows: `acc + f32(256·hi + lo) · (s · d)`.
#[inline(always)]
unsafe fn block_term(hi: __m512i, lo: __m512i, s: __m512, d: *const f32, acc: __m512) -> __m512 {
    let isum = _mm512_add_epi32(_mm512_slli_epi32::<8>(hi), lo);
    _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(s, _mm512_set1_ps(*d)), acc)
}

/// The lanes of the panel from row `p0` whose rows are in `keep`.
#[inline(always)]
fn kept_lanes(p0: usize, keep: &Range<usize>) -> __mmask16 {
    let below = |r: usize| {
        if r <= p0 {
            0
        } else if r >= p0 + 16 {
            0xFFFF
        } else {
            (1u32 << (r - p0)) - 1
        }
    };
    (below(keep.end) & !below(keep.start)) as __mmask16
}

/// A panel's sixteen results (lane `c` for the row at column `c`) to the rows of `lanes` (bit `r`
/// for row `r` of the panel) at `out`.
#[inline(always)]
unsafe fn store_results(acc: __m512, out: *mut f32, lanes: __mmask16) {
    // The permutation of columns is its own inverse.
    _mm512_mask_storeu_ps(out, lanes, _mm512_permutexvar_ps(column_rows(), acc));
}

/// The panel row at each column: column c holds row 4·(c % 4) + c / 4.
#[inline(always)]
unsafe fn column_rows() -> __m512i {
    _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15)
}

/// The tokens of a pass: their byte planes, per-block scales and per-group sums, each at one base
/// address and one distance between tokens, so that the block loop holds three addresses for them,
/// not three per token (with eight tokens, per-token addresses left the compiler short of
/// registers: they were kept on the stack and reloaded at every block). Rows of one quantized
/// input are evenly spaced (views of one buffer, as [`rows_tile`]'s callers pass); tokens that are
/// not are copied so that they are.
struct Tokens<'a> {
    planes: *const u8,
    plane_step: usize,
    d: *const f32,
    d_step: usize,
    sums: *const f32,
    sum_step: usize,
    /// The copy, where one was needed (the addresses above point into it).
    _copy: Option<(Vec<u8>, Vec<f32>, Vec<f32>)>,
    /// The rows the addresses point into, where no copy was made.
    _rows: std::marker::PhantomData<&'a [u8]>,
}

impl<'a> Tokens<'a> {
    fn new(x: &[ActRow<'a>]) -> Tokens<'a> {
        fn step<T>(x: &[ActRow], at: impl Fn(&ActRow) -> *const T) -> Option<usize> {
            let size = std::mem::size_of::<T>();
            let first = at(&x[0]) as usize;
            let step = x.get(1).map_or(Some(0), |r| (at(r) as usize).checked_sub(first))?;
            (step % size == 0 && x.iter().enumerate().all(|(t, r)| at(r) as usize == first + t * step))
                .then_some(step / size)
        }
        let steps = (step(x, |r| r.planes.as_ptr()), step(x, |r| r.d.as_ptr()), step(x, |r| r.group_sums.as_ptr()));
        if let (Some(plane_step), Some(d_step), Some(sum_step)) = steps {
            return Tokens {
                planes: x[0].planes.as_ptr(),
                plane_step,
                d: x[0].d.as_ptr(),
                d_step,
                sums: x[0].group_sums.as_ptr(),
                sum_step,
                _copy: None,
                _rows: std::marker::PhantomData,
            };
        }
        let (plane_step, d_step, sum_step) = (x[0].planes.len(), x[0].d.len(), x[0].group_sums.len());
        let copy: (Vec<u8>, Vec<f32>, Vec<f32>) = (
            x.iter().flat_map(|r| &r.planes[..plane_step]).copied().collect(),
            x.iter().flat_map(|r| &r.d[..d_step]).copied().collect(),
            x.iter().flat_map(|r| &r.group_sums[..sum_step]).copied().collect(),
        );
        Tokens {
            planes: copy.0.as_ptr(),
            plane_step,
            d: copy.1.as_ptr(),
            d_step,
            sums: copy.2.as_ptr(),
            sum_step,
            _copy: Some(copy),
            _rows: std::marker::PhantomData,
        }
    }

    /// Group `g`'s bias term, `acc + b · Σx`, for every token.
    #[inline(always)]
    unsafe fn bias_term<const M: usize>(&self, b: __m512, g: usize, acc: &mut [__m512; M]) {
        for (t, a) in acc.iter_mut().enumerate() {
            *a = _mm512_fmadd_ps(b, _mm512_set1_ps(*self.sums.add(t * self.sum_step + g)), *a);
        }
    }
}

/// Where a pass reads its panels' weights, scales and biases: the matrix in MLX's row layout
/// ([`MatrixSource`]) or its [`Panels`] ([`PackSource`]). Both give the same values.
trait Source {
    /// What a source keeps per panel.
    type Panel;
    fn groups(&self) -> usize;
    fn blocks_per_group(&self) -> usize;
    /// The panel of rows `p0..p0 + 16`.
    unsafe fn panel(&self, p0: usize) -> Self::Panel;
    /// Block `blk` of a panel as four vectors: `dword[kq]` holds, per column, bytes `4·kq..4·kq + 4`
    /// of that column's row's block.
    unsafe fn dwords(&self, panel: &Self::Panel, blk: usize) -> [__m512i; 4];
    /// Groups `g` and `g + 1`'s scales and biases of a panel's rows, at their columns (past a row's
    /// last group, the second pair is never used).
    unsafe fn factor_pair<S: ScaleKind>(&self, panel: &Self::Panel, g: usize) -> [(__m512, __m512); 2];
    /// Asks for the weights a later block will need, where the hardware would not (`starts`: the
    /// group whose first block `blk` is, if it is one).
    unsafe fn prefetch(&self, panel: &Self::Panel, blk: usize, starts: Option<usize>);
}

/// A block's dword vector `kq` as the weight operand for block positions `4·kq..` (the even
/// elements): per column, the low nibbles of bytes `4·kq..4·kq + 4` of that column's row.
#[inline(always)]
unsafe fn low_nibbles(dword: __m512i) -> __m512i {
    _mm512_and_si512(dword, _mm512_set1_epi8(0x0F))
}

/// The operand for positions `16 + 4·kq..`: the same bytes' high nibbles.
#[inline(always)]
unsafe fn high_nibbles(dword: __m512i) -> __m512i {
    _mm512_and_si512(_mm512_srli_epi16::<4>(dword), _mm512_set1_epi8(0x0F))
}

/// A matrix in MLX's row layout, as the panel kernel walks it.
struct MatrixSource<'a> {
    w: &'a QuantMatrix<'a>,
    /// Groups per row, blocks per group, bytes per row.
    gpr: usize,
    gb: usize,
    row_bytes: usize,
}

impl<'a> MatrixSource<'a> {
    fn new(w: &'a QuantMatrix<'a>) -> Self {
        MatrixSource { w, gpr: w.groups_per_row(), gb: w.group / 32, row_bytes: w.words_per_row() * 4 }
    }
}

/// A panel of a [`MatrixSource`]: its first row and the index of each column's row's first group
/// in the scales (a matrix has fewer than 2³¹ of them).
struct MatrixPanel {
    p0: usize,
    index: __m512i,
}

impl Source for MatrixSource<'_> {
    type Panel = MatrixPanel;

    fn groups(&self) -> usize {
        self.gpr
    }

    fn blocks_per_group(&self) -> usize {
        self.gb
    }

    #[inline(always)]
    unsafe fn panel(&self, p0: usize) -> MatrixPanel {
        debug_assert!((p0 + 16) * self.gpr <= i32::MAX as usize);
        let rows = _mm512_add_epi32(column_rows(), _mm512_set1_epi32(p0 as i32));
        MatrixPanel { p0, index: _mm512_mullo_epi32(rows, _mm512_set1_epi32(self.gpr as i32)) }
    }

    #[inline(always)]
    unsafe fn dwords(&self, panel: &MatrixPanel, blk: usize) -> [__m512i; 4] {
        let src = (self.w.packed.as_ptr() as *const u8).add(panel.p0 * self.row_bytes + blk * 16);
        let (z0, z1, z2, z3) = (
            quad(src, self.row_bytes),
            quad(src.add(4 * self.row_bytes), self.row_bytes),
            quad(src.add(8 * self.row_bytes), self.row_bytes),
            quad(src.add(12 * self.row_bytes), self.row_bytes),
        );
        // A dword transpose within each lane: `dword[kq]` holds dword kq of every row, lane i position
        // j from row 4·j + i (column 4·i + j).
        let (t0, t1) = (_mm512_unpacklo_epi32(z0, z1), _mm512_unpackhi_epi32(z0, z1));
        let (t2, t3) = (_mm512_unpacklo_epi32(z2, z3), _mm512_unpackhi_epi32(z2, z3));
        [
            _mm512_unpacklo_epi64(t0, t2),
            _mm512_unpackhi_epi64(t0, t2),
            _mm512_unpacklo_epi64(t1, t3),
            _mm512_unpackhi_epi64(t1, t3),
        ]
    }

    /// Two gathers (one per 16-bit kind: see [`column_pair`]).
    #[inline(always)]
    unsafe fn factor_pair<S: ScaleKind>(&self, panel: &MatrixPanel, g: usize) -> [(__m512, __m512); 2] {
        let idx = _mm512_add_epi32(panel.index, _mm512_set1_epi32(g as i32));
        let ([s0, s1], [b0, b1]) = (column_pair::<S>(self.w.scales, idx), column_pair::<S>(self.w.biases, idx));
        [(s0, b0), (s1, b1)]
    }

    /// Block `blk`'s share of the next panel's weights (every block of a panel asks for the same
    /// share of the next one, so it arrives whole): sixteen rows read side by side, sixteen bytes
    /// at a time, lose the hardware prefetchers. Addresses past the matrix are only hinted, never
    /// read.
    #[inline(always)]
    unsafe fn prefetch(&self, panel: &MatrixPanel, blk: usize, _starts: Option<usize>) {
        let share = (16 * self.row_bytes).div_ceil(self.gpr * self.gb);
        let next = panel.p0 + 16;
        let start = (self.w.packed.as_ptr() as *const u8).wrapping_add(next * self.row_bytes + blk * share);
        let mut o = 0;
        while o < share {
            _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(o) as *const i8);
            o += 64;
        }
    }
}

/// A matrix's [`Panels`]: each block's dword vectors are four loads, each group's factors
/// one load (and a conversion) per kind, in order.
struct PackSource<'a> {
    panels: Panels<'a>,
    gb: usize,
}

impl PackSource<'_> {
    /// Asks for the start of the panel of row `p0` (a multiple of 16): its first 32 blocks (8 KiB, a
    /// whole panel up to k = 1024) and their groups' factors; the pass's own prefetches take over
    /// from there.
    #[inline(always)]
    unsafe fn prefetch_panel(&self, p0: usize) {
        let panel = self.panel(p0);
        let lines = |p: *const i8, bytes: usize| {
            for o in (0..bytes).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(o));
            }
        };
        let blocks = (self.groups() * self.gb).min(32);
        lines(panel.weights as *const i8, 256 * blocks);
        lines(panel.scales as *const i8, blocks.div_ceil(self.gb) * panel.group_bytes);
        lines(panel.biases as *const i8, blocks.div_ceil(self.gb) * panel.group_bytes);
    }
}

/// A panel of a [`PackSource`]: the addresses of its first block and group, and of the next
/// panel's (for prefetches; never read past the last panel), computed once so that the block loop
/// only adds offsets.
struct PackPanel {
    weights: *const __m512i,
    scales: *const u16,
    biases: *const u16,
    next_weights: *const i8,
    next_scales: *const i8,
    next_biases: *const i8,
    /// Bytes of a group's sixteen factors (32 for 16-bit types, 64 for f32).
    group_bytes: usize,
}

impl Source for PackSource<'_> {
    type Panel = PackPanel;

    fn groups(&self) -> usize {
        self.panels.scales.groups()
    }

    fn blocks_per_group(&self) -> usize {
        self.gb
    }

    #[inline(always)]
    unsafe fn panel(&self, p0: usize) -> PackPanel {
        let (p0, weights) = (self.panels.first + p0, self.panels.weights);
        let (scales, biases) = (self.panels.scales, self.panels.biases);
        debug_assert!(p0 < weights.rows());
        PackPanel {
            weights: weights.block_unchecked(p0, 0) as *const __m512i,
            scales: scales.group_unchecked(p0, 0),
            biases: biases.group_unchecked(p0, 0),
            next_weights: weights.block_unchecked(p0 + 16, 0) as *const i8,
            next_scales: scales.group_unchecked(p0 + 16, 0) as *const i8,
            next_biases: biases.group_unchecked(p0 + 16, 0) as *const i8,
            group_bytes: 16 * scales.value_bytes(),
        }
    }

    #[inline(always)]
    unsafe fn dwords(&self, panel: &PackPanel, blk: usize) -> [__m512i; 4] {
        debug_assert!(blk < self.groups() * self.gb);
        // Unaligned loads, as fast on the copy's 64-byte aligned blocks, and sound whatever the
        // allocator gave.
        let at = panel.weights.add(4 * blk);
        [
            _mm512_loadu_si512(at),
            _mm512_loadu_si512(at.add(1)),
            _mm512_loadu_si512(at.add(2)),
            _mm512_loadu_si512(at.add(3)),
        ]
    }

    #[inline(always)]
    unsafe fn factor_pair<S: ScaleKind>(&self, panel: &PackPanel, g: usize) -> [(__m512, __m512); 2] {
        debug_assert!(g < self.groups());
        let load =
            |g: usize| (S::load16(S::advance(panel.scales, 16 * g)), S::load16(S::advance(panel.biases, 16 * g)));
        let second = if g + 1 < self.groups() { load(g + 1) } else { (_mm512_setzero_ps(), _mm512_setzero_ps()) };
        [load(g), second]
    }

    /// The same block of the next panel, and at a group's first block that group's factors there:
    /// one panel ahead, as the hardware prefetchers alone do not keep up with a pass.
    #[inline(always)]
    unsafe fn prefetch(&self, panel: &PackPanel, blk: usize, starts: Option<usize>) {
        let next = panel.next_weights.wrapping_add(256 * blk);
        for line in 0..4 {
            _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(64 * line));
        }
        if let Some(g) = starts {
            _mm_prefetch::<_MM_HINT_T0>(panel.next_scales.wrapping_add(g * panel.group_bytes));
            _mm_prefetch::<_MM_HINT_T0>(panel.next_biases.wrapping_add(g * panel.group_bytes));
        }
    }
}

/// The elements of `src` (stored as `S`) at each lane's index and the one after it: a gather per
/// 16-bit kind, whose 32-bit reads take both (and never read past the buffer: see [`rows_of`]).
#[inline(always)]
unsafe fn column_pair<S: ScaleKind>(src: Floats, idx: __m512i) -> [__m512; 2] {
    let p = match src {
        Floats::F32(v) => v.as_ptr() as *const u16,
        Floats::F16(v) | Floats::BF16(v) => v.as_ptr(),
    };
    debug_assert!(match src {
        Floats::F32(_) => !S::IS_HALF && !S::IS_BRAIN,
        Floats::F16(_) => S::IS_HALF,
        Floats::BF16(_) => S::IS_BRAIN,
    });
    S::gather16_pair(p, idx)
}

/// Four rows' 16 bytes (`row_bytes` apart from `src`) in one register: lane i is row i.
#[inline(always)]
unsafe fn quad(src: *const u8, row_bytes: usize) -> __m512i {
    let row = |r: usize| _mm_loadu_si128(src.add(r * row_bytes) as *const __m128i);
    let z = _mm512_castsi128_si512(row(0));
    let z = _mm512_inserti32x4::<1>(z, row(1));
    let z = _mm512_inserti32x4::<2>(z, row(2));
    _mm512_inserti32x4::<3>(z, row(3))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isa::IsaPath;
    use crate::kernels::int_dot::{dot_row, quantize_acts, IntActs};
    use crate::kernels::panel_pack::{PanelFactors, PanelWeights};

    /// Every row range (whole panels, a cut-short last one, the matrix's own last panel) and every
    /// number of tokens (passes of eight, four, two and one) give each (row, token) the bits it gets
    /// alone, and those are the portable path's result within f32 rounding. Skipped without AVX-512
    /// VNNI (printed).
    #[test]
    fn passes_give_every_token_its_own_bits() {
        let Some(isa) = Isa::detect(IsaPath::Avx512Vnni) else {
            eprintln!("panel kernel: SKIPPED (no AVX-512 VNNI on this CPU)");
            return;
        };
        let mut rng = crate::kernels::TestRng(0x2545F4914F6CDD1Du64);
        let mut next = move || rng.next();
        // Scales and biases in each storage type (f16, bf16, f32), even and odd groups per row.
        let shapes = [
            (48, 32, 18, 0),
            (32, 64, 6, 1),
            (16, 128, 4, 2),
            (48, 32, 9, 1),
            (32, 64, 3, 2),
            (16, 32, 5, 0),
            (40, 32, 7, 0),
            (24, 64, 5, 2),
        ];
        for (n, group, blocks, kind) in shapes {
            let k = group * blocks;
            let packed: Vec<u32> = (0..n * k / 8).map(|_| next() as u32).collect();
            let factor = |v: u64, base: f32| base + (v % 1000) as f32 * 1e-5;
            let sv: Vec<f32> = (0..n * k / group).map(|_| factor(next(), 0.01)).collect();
            let bv: Vec<f32> = (0..n * k / group).map(|_| factor(next(), -0.005)).collect();
            let halves = |v: &[f32]| v.iter().map(|&x| half::f16::from_f32(x).to_bits()).collect::<Vec<u16>>();
            let brains = |v: &[f32]| v.iter().map(|&x| half::bf16::from_f32(x).to_bits()).collect::<Vec<u16>>();
            let (sh, bh, sb, bb) = (halves(&sv), halves(&bv), brains(&sv), brains(&bv));
            let (scales, biases) = match kind {
                0 => (Floats::F16(&sh), Floats::F16(&bh)),
                1 => (Floats::BF16(&sb), Floats::BF16(&bb)),
                _ => (Floats::F32(&sv), Floats::F32(&bv)),
            };
            let w = QuantMatrix { packed: &packed, scales, biases, bits: 4, group, k, panels: None };
            let t = 8;
            let x: Vec<f32> = (0..t * k)
                .map(|i| ((next() % 2001) as f32 / 1000.0 - 1.0) * if i % k == 3 { 20.0 } else { 1.0 })
                .collect();
            let mut acts = IntActs::default();
            quantize_acts(isa, &x, t, k, group, ActOrder::NibblePlanes, &mut acts);
            let gpr = k / group;
            let act = |j: usize| acts.row(j, k, gpr, ActOrder::NibblePlanes);
            let rows: Vec<ActRow> = (0..t).map(act).collect();
            // Each token alone over the whole matrix.
            let mut alone = vec![0f32; t * n];
            for j in 0..t {
                assert!(unsafe { rows_tile(w, 0..n, &rows[j..j + 1], alone.as_mut_ptr().add(j * n), n) });
                for r in 0..n {
                    let scalar = dot_row(Isa::SCALAR, w.row(r), act(j));
                    let got = alone[j * n + r];
                    assert!(
                        (got - scalar).abs() <= 1e-4 * scalar.abs().max(1.0),
                        "n {n} row {r} token {j}: {got} vs {scalar}"
                    );
                }
            }
            // The same matrix from its panel-ordered copy: the same bits.
            let (weights, scales, biases) = (
                PanelWeights::new(&packed, n, k),
                PanelFactors::new(w.scales, n, k / group),
                PanelFactors::new(w.biases, n, k / group),
            );
            let panels = Panels { weights: &weights, scales: &scales, biases: &biases, first: 0 };
            assert!(panels.fit(&w, n) && !panels.fit(&w, n + 1));
            let packed_w = QuantMatrix { panels: Some(panels), ..w };
            // Rows 16.. alone, as a row view starting at a panel boundary reads the copy.
            let (gpr, wpr) = (k / group, k / 8);
            let tail_panels = Panels { first: 16, ..panels };
            let tail = QuantMatrix {
                packed: &packed[16 * wpr..],
                scales: w.scales.slice(16 * gpr, (n - 16) * gpr),
                biases: w.biases.slice(16 * gpr, (n - 16) * gpr),
                panels: Some(tail_panels),
                ..w
            };
            assert!(tail_panels.fit(&tail, n - 16) && !tail_panels.fit(&tail, n - 15));
            if n > 16 {
                for tokens in 1..=t {
                    let mut out = vec![f32::NAN; tokens * n];
                    let o = out.as_mut_ptr().wrapping_add(16);
                    assert!(unsafe { rows_tile(tail, 0..n - 16, &rows[..tokens], o, n) });
                    for j in 0..tokens {
                        for r in 16..n {
                            let (got, want) = (out[j * n + r], alone[j * n + r]);
                            assert_eq!(got.to_bits(), want.to_bits(), "rows 16..{n} from the copy: row {r} token {j}");
                        }
                    }
                }
            }
            // Tokens not evenly spaced in memory are read from a copy: the same bits. Reversed (a
            // negative distance), out of order though ascending at first, and seven of them (passes
            // of four, two and one).
            for order in [vec![7, 6, 5, 4, 3, 2, 1, 0], vec![0, 1, 3, 4, 5, 6, 7, 2], vec![6, 5, 4, 3, 2, 1, 0]] {
                let picked: Vec<ActRow> = order.iter().map(|&j| rows[j]).collect();
                for m in [w, packed_w] {
                    let mut out = vec![f32::NAN; picked.len() * n];
                    assert!(unsafe { rows_tile(m, 0..n, &picked, out.as_mut_ptr(), n) });
                    for (j, &from) in order.iter().enumerate() {
                        for r in 0..n {
                            let (got, want) = (out[j * n + r], alone[from * n + r]);
                            assert_eq!(got.to_bits(), want.to_bits(), "tokens {order:?}: n {n} row {r} token {j}");
                        }
                    }
                }
            }
            for (layout, m) in [("rows", w), ("panels", packed_w)] {
                for range in [0..n, 16..n, 0..16, 3..n, 5..n - 2, 17..20].into_iter().filter(|r| r.end <= n) {
                    for tokens in 1..=t {
                        let mut out = vec![f32::NAN; tokens * n];
                        assert!(unsafe { rows_tile(m, range.clone(), &rows[..tokens], out.as_mut_ptr(), n) });
                        for j in 0..tokens {
                            for r in 0..n {
                                let (got, want) = (out[j * n + r], alone[j * n + r]);
                                let what =
                                    format!("{layout}: n {n} rows {range:?}, {tokens} tokens: row {r} token {j}");
                                if range.contains(&r) {
                                    assert_eq!(got.to_bits(), want.to_bits(), "{what}");
                                } else {
                                    assert!(got.is_nan(), "{what}: written outside the range");
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
