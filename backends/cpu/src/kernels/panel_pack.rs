//! The panel kernel's own layout of a 4-bit matrix ([`super::panel`]), built once from MLX's row
//! layout and kept with the weight's buffer: per panel of sixteen rows, each block's four operand
//! vectors exactly as the kernel would assemble them by a dword transpose of the sixteen rows'
//! bytes, and each group's sixteen scales (and biases) in the kernel's column order. A pass then
//! reads three sequential streams — which the hardware prefetchers follow — with plain vector loads
//! instead of sixteen 16-byte row loads and a transpose per block and a gather per pair of groups.
//! The values are the matrix's own, so a pass gives the same bits from either layout.

use super::quantized::QuantMatrix;
use super::Floats;
use crate::pool;

/// Panels per task of a build (a few hundred KB of weights each).
const PANELS_PER_TASK: usize = 64;

/// The kernel's column for panel row `r` (and the row at column `r`: the permutation is its own
/// inverse): column `4·(r % 4) + r / 4`.
#[inline(always)]
pub fn column(r: usize) -> usize {
    4 * (r % 4) + r / 4
}

/// A matrix's 4-bit weights in panel order: for panel `p` and block `blk`, sixteen words per
/// position quad `kq` (`0..4`), column `c` holding word `4·blk + kq` of panel row `column(c)`
/// (zero past the matrix's last row).
pub struct PanelWeights {
    n: usize,
    k: usize,
    words: Aligned<u32>,
}

impl PanelWeights {
    /// `packed`'s `n` rows of `k` 4-bit values in panel order (built across the current pool).
    pub fn new(packed: &[u32], n: usize, k: usize) -> PanelWeights {
        assert!(k.is_multiple_of(32), "4-bit rows of whole blocks");
        // Word `4·blk + kq` of a row goes to position `64·blk + 16·kq` = 16 × its index.
        let words = panel_order(packed, n, k / 8);
        PanelWeights { n, k, words }
    }

    /// Whether this panel order holds rows `first..first + n` of `k` values each, from a panel
    /// boundary.
    pub fn covers(&self, first: usize, n: usize, k: usize) -> bool {
        self.k == k && first.is_multiple_of(16) && first + n <= self.n
    }

    /// Rows, the last panel's zero padding not counted.
    pub fn rows(&self) -> usize {
        self.n
    }

    /// Word `j` of row `r` (as in the row layout: values `8·j..8·j + 8`).
    #[inline]
    pub fn word(&self, r: usize, j: usize) -> u32 {
        self.words.as_slice()[(r / 16 * (self.k / 8) + j) * 16 + column(r % 16)]
    }

    /// Block `blk` of the panel holding row `p0` (a multiple of 16), 64 words, for any panel: past
    /// the last one too (for prefetches).
    #[inline(always)]
    pub fn block_unchecked(&self, p0: usize, blk: usize) -> *const u32 {
        self.words.as_ptr().wrapping_add((p0 / 16 * (self.k / 32) + blk) * 64)
    }
}

/// A matrix's scales or biases in panel order: for panel `p` and group `g`, sixteen values, column
/// `c` holding panel row `column(c)`'s (zero past the matrix's last row), in the stored type.
pub struct PanelFactors {
    n: usize,
    groups: usize,
    values: PanelFloats,
}

/// [`PanelFactors`]' values in their stored type.
pub enum PanelFloats {
    F32(Aligned<f32>),
    F16(Aligned<u16>),
    BF16(Aligned<u16>),
}

impl PanelFactors {
    /// `src`'s `n` rows of `groups` factors each in panel order (built across the current pool).
    pub fn new(src: Floats, n: usize, groups: usize) -> PanelFactors {
        let values = match src {
            Floats::F32(s) => PanelFloats::F32(panel_order(s, n, groups)),
            Floats::F16(s) => PanelFloats::F16(panel_order(s, n, groups)),
            Floats::BF16(s) => PanelFloats::BF16(panel_order(s, n, groups)),
        };
        PanelFactors { n, groups, values }
    }

    /// Whether these panel-ordered factors hold rows `first..first + n` of `groups` each, from a panel
    /// boundary, in `src`'s type.
    pub fn covers(&self, src: Floats, first: usize, n: usize, groups: usize) -> bool {
        let same_type = matches!(
            (&self.values, src),
            (PanelFloats::F32(_), Floats::F32(_))
                | (PanelFloats::F16(_), Floats::F16(_))
                | (PanelFloats::BF16(_), Floats::BF16(_))
        );
        same_type && self.groups == groups && first.is_multiple_of(16) && first + n <= self.n
    }

    /// Groups per row.
    pub fn groups(&self) -> usize {
        self.groups
    }

    /// Bytes of one stored value.
    pub fn value_bytes(&self) -> usize {
        match self.values {
            PanelFloats::F32(_) => 4,
            PanelFloats::F16(_) | PanelFloats::BF16(_) => 2,
        }
    }

    /// Row `r`'s factor of group `g`.
    #[inline]
    pub fn get(&self, r: usize, g: usize) -> f32 {
        let at = (r / 16 * self.groups + g) * 16 + column(r % 16);
        match &self.values {
            PanelFloats::F32(v) => v.as_slice()[at],
            PanelFloats::F16(v) => half::f16::from_bits(v.as_slice()[at]).to_f32(),
            PanelFloats::BF16(v) => half::bf16::from_bits(v.as_slice()[at]).to_f32(),
        }
    }

    /// Group `g`'s sixteen values of the panel holding row `p0` (a multiple of 16), as 16-bit
    /// elements ([`ScaleKind`](super::int_dot::ScaleKind) addressing: an f32 is two), for any panel:
    /// past the last one too (for prefetches).
    #[inline(always)]
    pub fn group_unchecked(&self, p0: usize, g: usize) -> *const u16 {
        let at = (p0 / 16 * self.groups + g) * 16;
        match &self.values {
            PanelFloats::F32(v) => v.as_ptr().wrapping_add(at) as *const u16,
            PanelFloats::F16(v) | PanelFloats::BF16(v) => v.as_ptr().wrapping_add(at),
        }
    }
}

/// `src`'s `n` rows of `per_row` values in panel order, built across the current pool: per panel of
/// sixteen rows, value `j` of the panel's row `r` at `16·j + column(r)` (zero past row `n`).
fn panel_order<T: Copy + Default + Send + Sync>(src: &[T], n: usize, per_row: usize) -> Aligned<T> {
    assert!(src.len() >= n * per_row, "{n} rows of {per_row}");
    let mut out = Aligned::zeroed(n.div_ceil(16) * per_row * 16);
    let panel_len = per_row * 16;
    pool::chunks_mut(out.as_mut_slice(), panel_len * PANELS_PER_TASK, |task, out| {
        for (i, panel) in out.chunks_exact_mut(panel_len).enumerate() {
            let p0 = (task * PANELS_PER_TASK + i) * 16;
            for r in 0..16.min(n - p0) {
                let c = column(r);
                for (j, &v) in src[(p0 + r) * per_row..(p0 + r + 1) * per_row].iter().enumerate() {
                    panel[16 * j + c] = v;
                }
            }
        }
    });
    out
}

/// A matrix's panel-ordered weights, scales and biases, as [`QuantMatrix::panels`] carries them: the
/// matrix is rows `first..` of the copies (a row view of a fused tensor, such as `qkv_proj`'s `k`
/// rows, starts at a panel boundary of the whole tensor's copy; a whole tensor at 0).
#[derive(Clone, Copy)]
pub struct Panels<'a> {
    pub weights: &'a PanelWeights,
    pub scales: &'a PanelFactors,
    pub biases: &'a PanelFactors,
    pub first: usize,
}

impl<'a> Panels<'a> {
    /// Whether these hold `w`'s `n` rows (a copy of another shape or type is never used).
    pub fn fit(&self, w: &QuantMatrix, n: usize) -> bool {
        let groups = w.groups_per_row();
        w.bits == 4
            && matches!(w.group, 32 | 64 | 128)
            && self.weights.covers(self.first, n, w.k)
            && self.scales.covers(w.scales, self.first, n, groups)
            && self.biases.covers(w.biases, self.first, n, groups)
    }
}

/// `len` zeroed values starting at a 64-byte boundary (where `align_offset` finds one, as it does
/// for heap memory), so that a block's four vectors are four cache lines, never eight.
pub struct Aligned<T> {
    buf: Vec<T>,
    start: usize,
    len: usize,
}

impl<T: Copy + Default> Aligned<T> {
    fn zeroed(len: usize) -> Aligned<T> {
        let slack = 64 / std::mem::size_of::<T>();
        let buf = vec![T::default(); len + slack];
        let start = buf.as_ptr().align_offset(64).min(slack);
        Aligned { buf, start, len }
    }

    pub fn as_slice(&self) -> &[T] {
        &self.buf[self.start..self.start + self.len]
    }

    /// The first value's address, without [`Aligned::as_slice`]'s range check (kernels' hot loops
    /// compute their addresses from it).
    #[inline(always)]
    pub fn as_ptr(&self) -> *const T {
        self.buf.as_ptr().wrapping_add(self.start)
    }

    fn as_mut_slice(&mut self) -> &mut [T] {
        &mut self.buf[self.start..self.start + self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isa::Isa;

    /// Rows dequantized from the panel order are the row layout's, bit for bit, for every storage type
    /// of the factors, a last panel cut short and groups of 32, 64 and 128; the row layout's words and
    /// factors come back from their panel places.
    #[test]
    fn rows_from_the_panel_order_are_the_row_layouts() {
        let mut rng = crate::kernels::TestRng(0x853C49E6748FEA9Bu64);
        let mut next = move || rng.next();
        for (n, group, groups, kind) in [(37, 32, 5, 0), (16, 64, 3, 1), (21, 128, 2, 2)] {
            let k = group * groups;
            let packed: Vec<u32> = (0..n * k / 8).map(|_| next() as u32).collect();
            let f: Vec<f32> = (0..2 * n * groups).map(|_| (next() % 2001) as f32 * 1e-4 - 0.1).collect();
            let halves: Vec<u16> = f.iter().map(|&v| half::f16::from_f32(v).to_bits()).collect();
            let brains: Vec<u16> = f.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
            let ng = n * groups;
            let (scales, biases) = match kind {
                0 => (Floats::F16(&halves[..ng]), Floats::F16(&halves[ng..])),
                1 => (Floats::BF16(&brains[..ng]), Floats::BF16(&brains[ng..])),
                _ => (Floats::F32(&f[..ng]), Floats::F32(&f[ng..])),
            };
            let w = QuantMatrix { packed: &packed, scales, biases, bits: 4, group, k, panels: None };
            let (pw, ps, pb) = (
                PanelWeights::new(&packed, n, k),
                PanelFactors::new(scales, n, groups),
                PanelFactors::new(biases, n, groups),
            );
            let panels = Panels { weights: &pw, scales: &ps, biases: &pb, first: 0 };
            assert!(panels.fit(&w, n));
            let from_panels = QuantMatrix { panels: Some(panels), ..w };
            let (mut a, mut b) = (vec![0f32; k], vec![0f32; k]);
            for r in 0..n {
                for j in 0..k / 8 {
                    assert_eq!(pw.word(r, j), packed[r * k / 8 + j], "n {n} row {r} word {j}");
                }
                for g in 0..groups {
                    assert_eq!(ps.get(r, g).to_bits(), scales.get(r * groups + g).to_bits());
                    assert_eq!(pb.get(r, g).to_bits(), biases.get(r * groups + g).to_bits());
                }
                w.dequantize_row(Isa::SCALAR, r, &mut a);
                from_panels.dequantize_row(Isa::SCALAR, r, &mut b);
                assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()), "n {n} group {group}: row {r}");
            }
        }
    }
}
