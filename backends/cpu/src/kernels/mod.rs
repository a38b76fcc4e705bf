//! CPU kernels, one file per kind of op. Each takes plain slices; the executor binds the graph to them.

pub mod attention;
pub mod attention_prefill;
pub mod elementwise;
pub mod experts;
pub mod int_dot;
pub mod matmul;
pub mod norm;
pub mod quantized;
pub mod rope;

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
