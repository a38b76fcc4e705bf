//! Vectorisable math shared by the kernels: the compiler turns these into SIMD inside a
//! `simd_kernel!` (libm's `expf` is a scalar call per element).

/// `exp`'s argument range: below, e^−87; above, e^88 (a larger argument would build a garbage
/// exponent in [`pow2`]).
const EXP_MIN: f32 = -87.0;
const EXP_MAX: f32 = 88.0;
/// ln 2 split for the Cody–Waite reduction: `LN2_HI` has trailing zero bits, so `n·LN2_HI` is exact.
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// The degree-7 Taylor coefficients of `e^r`, highest order first (Horner's order).
const TAYLOR: [f32; 8] = [1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0];
/// Added to an integer-valued `n`, leaves `n + 127` in the low mantissa bits (1.5·2²³ + 127).
const POW2_BIAS: f32 = 127.0 + 12_582_912.0;

/// `e^x` (clamped to −87..=88, so larger arguments give `e^88`, not a garbage exponent), written so
/// the compiler vectorises it: Cody–Waite range reduction `x = n·ln2 + r` with |r| ≤ ln2/2, a
/// degree-7 Taylor polynomial for `e^r`, and `2^n` built in the exponent bits; relative error below
/// 1e-6.
#[inline(always)]
pub fn exp_approx(x: f32) -> f32 {
    // Not `clamp`: a NaN argument becomes e^−87 here, as it always has, instead of spreading.
    #[allow(clippy::manual_clamp)]
    let x = x.max(EXP_MIN).min(EXP_MAX);
    let n = (x * std::f32::consts::LOG2_E + 0.5).floor();
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut p = TAYLOR[0];
    for c in &TAYLOR[1..] {
        p = p * r + c;
    }
    p * pow2(n)
}

/// `2^n` for an integer-valued `n` in −126..=127, straight into the exponent bits: adding 1.5·2²³
/// leaves `n + 127` in the low mantissa bits, which the shift moves into the exponent. (An `as i32`
/// cast would be exact too, but Rust's saturating casts turn a vectorised loop into one scalar
/// conversion per lane.)
#[inline(always)]
fn pow2(n: f32) -> f32 {
    f32::from_bits((n + POW2_BIAS).to_bits() << 23)
}

/// [`exp_approx`]'s arithmetic in sixteen lanes (AVX-512 F), its multiply-adds fused (so its last
/// bit may differ from the portable function's); relative error below 1e-6.
///
/// # Safety
/// The CPU has AVX-512 F (the caller runs with it enabled: the function is inlined into it).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub unsafe fn exp16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(EXP_MIN)), _mm512_set1_ps(EXP_MAX));
    let t = _mm512_fmadd_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E), _mm512_set1_ps(0.5));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(t);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
    let mut p = _mm512_set1_ps(TAYLOR[0]);
    for &c in &TAYLOR[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    // 2^n into the exponent bits, as `pow2` does.
    let bits = _mm512_castps_si512(_mm512_add_ps(n, _mm512_set1_ps(POW2_BIAS)));
    _mm512_mul_ps(p, _mm512_castsi512_ps(_mm512_slli_epi32::<23>(bits)))
}

/// [`exp16`] in eight lanes (AVX2 and FMA).
///
/// # Safety
/// The CPU has AVX2 and FMA (the caller runs with them enabled: the function is inlined into it).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub unsafe fn exp8(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(EXP_MIN)), _mm256_set1_ps(EXP_MAX));
    let t = _mm256_fmadd_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E), _mm256_set1_ps(0.5));
    let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC }>(t);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
    let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
    let mut p = _mm256_set1_ps(TAYLOR[0]);
    for &c in &TAYLOR[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let bits = _mm256_castps_si256(_mm256_add_ps(n, _mm256_set1_ps(POW2_BIAS)));
    _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32::<23>(bits)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn exp8_is_accurate_over_its_range() {
        if !(std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")) {
            eprintln!("exp8: SKIPPED (no AVX2/FMA on this CPU)");
            return;
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn eight(x: &[f32; 8]) -> [f32; 8] {
            let mut out = [0f32; 8];
            std::arch::x86_64::_mm256_storeu_ps(out.as_mut_ptr(), exp8(std::arch::x86_64::_mm256_loadu_ps(x.as_ptr())));
            out
        }
        let mut worst = 0f64;
        for i in (-100_000..=100_000).step_by(8) {
            let x: [f32; 8] = std::array::from_fn(|l| (i + l as i32) as f32 * 0.00087);
            // SAFETY: AVX2 and FMA checked above.
            let got = unsafe { eight(&x) };
            for (&x, &g) in x.iter().zip(&got) {
                let want = (x as f64).exp();
                worst = worst.max(((g as f64 - want) / want).abs());
            }
        }
        assert!(worst < 1e-6, "relative error {worst}");
        let edge = unsafe { eight(&[100.0, -100.0, 0.0, 1.0, -1.0, 0.5, 2.0, 3.0]) };
        assert_eq!(edge[2], 1.0);
        assert!((edge[0] / exp_approx(88.0) - 1.0).abs() < 1e-6 && (edge[1] / exp_approx(-87.0) - 1.0).abs() < 1e-6);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn exp16_is_accurate_over_its_range() {
        if !std::arch::is_x86_feature_detected!("avx512f") {
            eprintln!("exp16: SKIPPED (no AVX-512 F on this CPU)");
            return;
        }
        #[target_feature(enable = "avx512f")]
        unsafe fn sixteen(x: &[f32; 16]) -> [f32; 16] {
            let mut out = [0f32; 16];
            std::arch::x86_64::_mm512_storeu_ps(
                out.as_mut_ptr(),
                exp16(std::arch::x86_64::_mm512_loadu_ps(x.as_ptr())),
            );
            out
        }
        let mut worst = 0f64;
        for i in (-100_000..=100_000).step_by(16) {
            let x: [f32; 16] = std::array::from_fn(|l| (i + l as i32) as f32 * 0.00087);
            // SAFETY: AVX-512 F checked above.
            let got = unsafe { sixteen(&x) };
            for (&x, &g) in x.iter().zip(&got) {
                let want = (x as f64).exp();
                worst = worst.max(((g as f64 - want) / want).abs());
            }
        }
        assert!(worst < 1e-6, "relative error {worst}");
        // Clamped like `exp_approx`: e^88 for larger arguments, e^-87 for smaller ones (and NaN).
        let edge = unsafe {
            sixteen(&[100.0, -100.0, 88.0, -87.0, 0.0, 1.0, -1.0, 0.5, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0])
        };
        assert_eq!(edge[4], 1.0);
        assert!((edge[0] / exp_approx(88.0) - 1.0).abs() < 1e-6 && (edge[1] / exp_approx(-87.0) - 1.0).abs() < 1e-6);
    }

    #[test]
    fn pow2_is_exact_over_the_normal_exponents() {
        for n in -126..=127 {
            assert_eq!(pow2(n as f32), 2f32.powi(n), "2^{n}");
        }
    }

    #[test]
    fn exp_approx_is_accurate_over_its_range() {
        let mut worst = 0f64;
        for i in -100_000..=100_000 {
            let x = i as f32 * 0.00087; // [-87, 87]: softmax's arguments, and the activations'
            let want = (x as f64).exp();
            let got = exp_approx(x) as f64;
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 1e-6, "relative error {worst}");
    }
}
