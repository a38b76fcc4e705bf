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
            let (a, b) = (&a[base..base + o.len()], &b[base..base + o.len()]);
            #[cfg(target_arch = "x86_64")]
            if isa.has_avx512() && matches!(op, Binary::SiluMul | Binary::GeluTanhMul) {
                // SAFETY: AVX-512 F is present (an `Isa` exists only for a path this CPU runs).
                unsafe { x86::gated_avx512(op == Binary::GeluTanhMul, a, b, o) };
                return;
            }
            binary_run::run(isa, op, a, b, o);
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

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use crate::kernels::math::exp16;

    /// SwiGLU (`silu(a)·b`) or GeGLU (`gelu_tanh(a)·b`, when `gelu`) in sixteen lanes: the gate is
    /// `a / (1 + e^−u)` (`u = a`, or `2√(2/π)·(a + 0.044715a³)`), with `exp16` and a reciprocal
    /// estimate refined by one Newton step instead of a division (a divide unit's throughput bound
    /// the portable loop); within a few ulps of the portable functions.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn gated_avx512(gelu: bool, a: &[f32], b: &[f32], out: &mut [f32]) {
        let n = out.len().min(a.len()).min(b.len());
        let (one, two) = (_mm512_set1_ps(1.0), _mm512_set1_ps(2.0));
        let mut i = 0;
        while i < n {
            let lanes = if n - i >= 16 { !0 } else { ((1u32 << (n - i)) - 1) as __mmask16 };
            let x = _mm512_maskz_loadu_ps(lanes, a.as_ptr().add(i));
            let y = _mm512_maskz_loadu_ps(lanes, b.as_ptr().add(i));
            let u = if gelu {
                let x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
                _mm512_mul_ps(_mm512_set1_ps(2.0 * 0.797_884_6), _mm512_fmadd_ps(x3, _mm512_set1_ps(0.044715), x))
            } else {
                x
            };
            let d = _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), u)));
            let r = _mm512_rcp14_ps(d);
            let r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, two));
            _mm512_mask_storeu_ps(out.as_mut_ptr().add(i), lanes, _mm512_mul_ps(_mm512_mul_ps(x, r), y));
            i += 16;
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isa::IsaPath;

    /// The AVX-512 SwiGLU/GeGLU kernel against the portable functions, over every tail length.
    /// Skipped without AVX-512 (printed).
    #[test]
    fn gated_units_match_the_portable_functions() {
        let Some(isa) = Isa::detect(IsaPath::Avx512) else {
            eprintln!("gated units: AVX-512 kernel SKIPPED (no AVX-512 on this CPU)");
            return;
        };
        for n in [1, 15, 16, 17, 100, 1536] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 12.0).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos() * 3.0).collect();
            for (op, f) in [(Binary::SiluMul, silu as fn(f32) -> f32), (Binary::GeluTanhMul, gelu_tanh)] {
                let mut out = vec![f32::NAN; n];
                binary(isa, op, &a, &b, &mut out);
                for i in 0..n {
                    let want = f(a[i]) * b[i];
                    assert!(
                        (out[i] - want).abs() <= 2e-6 * want.abs().max(1e-3),
                        "{op:?} n {n} [{i}]: {} vs {want}",
                        out[i]
                    );
                }
            }
        }
    }
}
