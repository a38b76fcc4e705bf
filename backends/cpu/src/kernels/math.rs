//! Vectorisable math shared by the kernels: the compiler turns these into SIMD inside a
//! `simd_kernel!` (libm's `expf` is a scalar call per element).

/// `e^x` (clamped to −87..=88, so larger arguments give `e^88`, not a garbage exponent), written so
/// the compiler vectorises it: Cody–Waite range reduction `x = n·ln2 + r` with |r| ≤ ln2/2, a
/// degree-7 Taylor polynomial for `e^r`, and `2^n` built in the exponent bits; relative error below
/// 1e-6.
#[inline(always)]
pub fn exp_approx(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Not `clamp`: a NaN argument becomes e^−87 here, as it always has, instead of spreading.
    #[allow(clippy::manual_clamp)]
    let x = x.max(-87.0).min(88.0);
    let n = (x * std::f32::consts::LOG2_E + 0.5).floor();
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    p * pow2(n)
}

/// `2^n` for an integer-valued `n` in −126..=127, straight into the exponent bits: adding 1.5·2²³
/// leaves `n + 127` in the low mantissa bits, which the shift moves into the exponent. (An `as i32`
/// cast would be exact too, but Rust's saturating casts turn a vectorised loop into one scalar
/// conversion per lane.)
#[inline(always)]
fn pow2(n: f32) -> f32 {
    f32::from_bits((n + (127.0 + 12_582_912.0)).to_bits() << 23)
}

#[cfg(test)]
mod tests {
    use super::*;

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
