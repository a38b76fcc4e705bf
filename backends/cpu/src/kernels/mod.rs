//! CPU kernels, one file per kind of op. Each takes plain slices; the executor binds the graph to them.

pub mod attention;
pub mod attention_prefill;
pub mod attention_step;
pub mod conv1d;
pub mod cross_attention;
pub mod elementwise;
pub mod experts;
pub mod int_dot;
pub mod kv_elem;
pub mod math;
pub mod matmul;
pub mod norm;
#[cfg(target_arch = "x86_64")]
pub mod panel;
pub mod panel_pack;
pub mod pooling;
pub mod quantized;
pub mod rope;
pub mod softmax;

use half::{bf16, f16};

/// A read-only run of floats in a weight's own dtype.
#[derive(Clone, Copy)]
pub enum Floats<'a> {
    F32(&'a [f32]),
    F16(&'a [u16]),
    BF16(&'a [u16]),
}

impl<'a> Floats<'a> {
    pub fn len(&self) -> usize {
        match self {
            Floats::F32(s) => s.len(),
            Floats::F16(s) | Floats::BF16(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Elements `start..start + len` (panics outside, like slicing).
    pub fn slice(&self, start: usize, len: usize) -> Floats<'a> {
        match self {
            Floats::F32(s) => Floats::F32(&s[start..start + len]),
            Floats::F16(s) => Floats::F16(&s[start..start + len]),
            Floats::BF16(s) => Floats::BF16(&s[start..start + len]),
        }
    }

    #[inline(always)]
    pub fn get(&self, i: usize) -> f32 {
        match self {
            Floats::F32(s) => s[i],
            Floats::F16(s) => f16::from_bits(s[i]).to_f32(),
            Floats::BF16(s) => bf16::from_bits(s[i]).to_f32(),
        }
    }

    /// Converts `self[start..start + out.len()]` into `out`.
    pub fn to_f32(&self, start: usize, out: &mut [f32]) {
        let n = out.len();
        match self {
            Floats::F32(s) => out.copy_from_slice(&s[start..start + n]),
            Floats::F16(s) => {
                let src: &[f16] = unsafe { std::slice::from_raw_parts(s[start..].as_ptr() as *const f16, n) };
                half::slice::HalfFloatSliceExt::convert_to_f32_slice(src, out);
            }
            Floats::BF16(s) => {
                for (o, &b) in out.iter_mut().zip(&s[start..start + n]) {
                    *o = f32::from_bits((b as u32) << 16);
                }
            }
        }
    }
}

/// A raw pointer that may be shared across worker threads writing disjoint regions.
#[derive(Clone, Copy)]
pub struct SharedMut<T>(pub *mut T);
unsafe impl<T> Send for SharedMut<T> {}
unsafe impl<T> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    /// The raw pointer (a method, so closures capture the whole `Send` wrapper).
    #[inline(always)]
    pub fn ptr(&self) -> *mut T {
        self.0
    }

    /// # Safety
    /// Callers on different threads must touch disjoint ranges.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice(&self, start: usize, len: usize) -> &mut [T] {
        std::slice::from_raw_parts_mut(self.0.add(start), len)
    }
}

/// Rows `start..end` of a step that belong to sequence `seq`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Segment {
    pub seq: usize,
    pub start: usize,
    pub end: usize,
}

impl Segment {
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }
}

/// Each sequence's rows from a per-row sequence index (`I32 [T]`), in order. The rows of one sequence
/// must be contiguous and every index in `0..n_seqs`; anything else is an error naming the row.
pub fn segments(seq: &[i32], n_seqs: usize) -> Result<Vec<Segment>, String> {
    let mut out: Vec<Segment> = Vec::new();
    let mut seen = vec![false; n_seqs];
    for (t, &s) in seq.iter().enumerate() {
        if s < 0 || s as usize >= n_seqs {
            return Err(format!("row {t}: sequence index {s} out of range for {n_seqs} sequences"));
        }
        let s = s as usize;
        match out.last_mut() {
            Some(g) if g.seq == s => g.end = t + 1,
            _ => {
                if std::mem::replace(&mut seen[s], true) {
                    return Err(format!("row {t}: the rows of sequence {s} are not contiguous"));
                }
                out.push(Segment { seq: s, start: t, end: t + 1 });
            }
        }
    }
    Ok(out)
}

/// Deterministic random numbers for the kernels' tests (xorshift64*).
#[cfg(test)]
pub(crate) struct TestRng(pub u64);

#[cfg(test)]
impl TestRng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545F4914F6CDD1D)
    }

    /// Uniform in [−1, 1).
    pub fn uniform(&mut self) -> f32 {
        ((self.next() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
    }
}
