//! The element types a KV cache is kept in — f32, f16 and bf16, as llama.cpp's `--cache-type-k/-v` —
//! written from the step's f32 rows (rounded to nearest even) and read back as f32 by the attention
//! kernels, which compute in f32 whatever the cache holds.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use mlxcel_plugin_api::DType;

/// One value of a KV cache.
pub trait KvElem: Copy + Send + Sync + 'static {
    const DTYPE: DType;

    /// `dst[i] = src[i]` rounded to this type.
    fn store(src: &[f32], dst: &mut [Self]);

    /// `dst[i] = src[i]` as f32 (exact).
    fn load(src: &[Self], dst: &mut [f32]);

    fn to_f32(self) -> f32;

    /// Eight values from `p` as f32 lanes.
    ///
    /// # Safety
    /// The CPU has AVX2 and F16C; `p` points to eight readable values.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;

    /// Sixteen values from `p` as f32 lanes.
    ///
    /// # Safety
    /// The CPU has AVX-512 F; `p` points to sixteen readable values.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

impl KvElem for f32 {
    const DTYPE: DType = DType::F32;

    fn store(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }

    fn load(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }

    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(p) }
    }
}

impl KvElem for f16 {
    const DTYPE: DType = DType::F16;

    fn store(src: &[f32], dst: &mut [f16]) {
        dst.convert_from_f32_slice(src);
    }

    fn load(src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }

    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract (F16C present, eight values readable).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract (AVX-512 F present, sixteen values readable).
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
    }
}

impl KvElem for bf16 {
    const DTYPE: DType = DType::BF16;

    fn store(src: &[f32], dst: &mut [bf16]) {
        dst.convert_from_f32_slice(src);
    }

    fn load(src: &[bf16], dst: &mut [f32]) {
        // bf16 is the top half of an f32: a shift the compiler vectorises.
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits((s.to_bits() as u32) << 16);
        }
    }

    #[inline(always)]
    fn to_f32(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const bf16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract (AVX2 present, eight values readable).
        unsafe {
            _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i)), 16))
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const bf16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract (AVX-512 F present, sixteen values readable).
        unsafe {
            _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i)), 16))
        }
    }
}

/// Bytes of one value of a cache kept in `dtype`, or `None` for a type the CPU backend does not keep.
pub fn elem_bytes(dtype: DType) -> Option<usize> {
    match dtype {
        DType::F32 => Some(4),
        DType::F16 | DType::BF16 => Some(2),
        _ => None,
    }
}

/// A cache buffer's bytes as values of `T`.
///
/// # Panics
/// If `bytes` is not aligned for `T` (cache buffers are allocated 64-byte aligned).
pub fn cast_mut<T: KvElem>(bytes: &mut [u8]) -> &mut [T] {
    assert!((bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()), "misaligned KV cache buffer");
    let n = bytes.len() / std::mem::size_of::<T>();
    // SAFETY: aligned (checked), in bounds, and every bit pattern is a valid f32/f16/bf16.
    unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr() as *mut T, n) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_round_trip_through_each_type_rounded_to_nearest_even() {
        let src: Vec<f32> = (0..37).map(|i| (i as f32 - 18.0) * 0.37 + 1e-3).collect();
        let mut h = vec![f16::ZERO; src.len()];
        let mut b = vec![bf16::ZERO; src.len()];
        f16::store(&src, &mut h);
        bf16::store(&src, &mut b);
        let (mut hf, mut bf) = (vec![0f32; src.len()], vec![0f32; src.len()]);
        f16::load(&h, &mut hf);
        bf16::load(&b, &mut bf);
        for i in 0..src.len() {
            assert_eq!(hf[i], f16::from_f32(src[i]).to_f32());
            assert_eq!(bf[i], bf16::from_f32(src[i]).to_f32());
            assert_eq!(hf[i], h[i].to_f32());
            assert_eq!(bf[i], KvElem::to_f32(b[i]));
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn simd_loads_match_the_scalar_conversion() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")) {
            eprintln!("kv_elem load8: skipped (no AVX2/F16C on this host)");
            return;
        }
        let src: Vec<f32> = (0..8).map(|i| (i as f32 - 3.5) * 1.7).collect();
        let h: Vec<f16> = src.iter().map(|&x| f16::from_f32(x)).collect();
        let b: Vec<bf16> = src.iter().map(|&x| bf16::from_f32(x)).collect();
        let mut out = [0f32; 8];
        // SAFETY: AVX2 and F16C checked above; eight values each.
        unsafe {
            std::arch::x86_64::_mm256_storeu_ps(out.as_mut_ptr(), f16::load8(h.as_ptr()));
            assert_eq!(out.to_vec(), h.iter().map(|x| x.to_f32()).collect::<Vec<_>>());
            std::arch::x86_64::_mm256_storeu_ps(out.as_mut_ptr(), bf16::load8(b.as_ptr()));
            assert_eq!(out.to_vec(), b.iter().map(|x| x.to_f32()).collect::<Vec<_>>());
        }
    }
}
