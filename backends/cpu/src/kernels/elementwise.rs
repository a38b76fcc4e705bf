//! Elementwise ops and activations.

use super::math::exp_approx;
use crate::isa::Isa;
use crate::pool;
use crate::simd_kernel;

const CHUNK: usize = 16 * 1024;

/// A two-input elementwise op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Binary {
    Add,
    Mul,
    /// `silu(a) · b` (SwiGLU).
    SiluMul,
    /// `gelu_tanh(a) · b` (GeGLU).
    GeluTanhMul,
}

simd_kernel! {
    /// `out = op(a, b)` over equal-length runs, one loop per op so each vectorises.
    pub fn binary_run(op: Binary, a: &[f32], b: &[f32], out: &mut [f32]) {
        let ab = a.iter().zip(b);
        match op {
            Binary::Add => out.iter_mut().zip(ab).for_each(|(o, (x, y))| *o = x + y),
            Binary::Mul => out.iter_mut().zip(ab).for_each(|(o, (x, y))| *o = x * y),
            Binary::SiluMul => out.iter_mut().zip(ab).for_each(|(o, (x, y))| *o = silu(*x) * y),
            Binary::GeluTanhMul => out.iter_mut().zip(ab).for_each(|(o, (x, y))| *o = gelu_tanh(*x) * y),
        }
    }
}

/// `out[i] = op(a[i], b[i % b.len()])` (b is the same shape as `a` or one broadcast row), in chunks
/// of about [`CHUNK`] values (a decode step's few rows are one task: a fan-out costs more).
pub fn binary(isa: Isa, op: Binary, a: &[f32], b: &[f32], out: &mut [f32]) {
    let bl = b.len();
    if bl == 0 {
        return;
    }
    if bl == a.len() {
        pool::chunks_mut(out, CHUNK, |c, o| {
            let base = c * CHUNK;
            binary_run::run(isa, op, &a[base..base + o.len()], &b[base..base + o.len()], o);
        });
    } else {
        let rows = (CHUNK / bl).max(1) * bl;
        pool::zip_chunks(out, rows, a, rows, |_, o, ar| {
            for (o, ar) in o.chunks_mut(bl).zip(ar.chunks(bl)) {
                binary_run::run(isa, op, ar, b, o);
            }
        });
    }
}

/// `out[i] = f(x[i])`.
pub fn unary(x: &[f32], out: &mut [f32], f: impl Fn(f32) -> f32 + Sync) {
    pool::zip_chunks(out, CHUNK, x, CHUNK, |_, o, xs| {
        for (v, &xv) in o.iter_mut().zip(xs) {
            *v = f(xv);
        }
    });
}

#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp_approx(-x))
}

#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp_approx(-x))
}

#[inline(always)]
pub fn gelu_tanh(x: f32) -> f32 {
    // 0.5 x (1 + tanh(u)) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): one `exp` instead of
    // libm's `tanhf`, several times slower (GeGLU prefill spent a quarter of its time there).
    const C2: f32 = 2.0 * 0.797_884_6; // 2 sqrt(2/pi)
    x / (1.0 + exp_approx(-C2 * (x + 0.044715 * x * x * x)))
}

#[inline(always)]
pub fn gelu_erf(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x / std::f32::consts::SQRT_2))
}

/// erf with max error about 1.2e-7 (Numerical Recipes erfc by Chebyshev fit, computed in f64).
pub fn erf(x: f32) -> f32 {
    let x = x as f64;
    let z = x.abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let r = t
        * (-z * z - 1.265_512_23
            + t * (1.000_023_68
                + t * (0.374_091_96
                    + t * (0.096_784_18
                        + t * (-0.186_288_06
                            + t * (0.278_868_07
                                + t * (-1.135_203_98
                                    + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77)))))))))
            .exp();
    (if x >= 0.0 { 1.0 - r } else { r - 1.0 }) as f32
}
