//! Which SIMD path the kernels take, chosen at run time from what this CPU supports.
//! `MLXCEL_CPU_ISA=scalar|avx2|avx512|neon` forces one (for tests and comparisons); forcing a path the
//! CPU lacks is an error, never a silent fallback.

/// A kernel path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Portable Rust compiled for the target's baseline (no extra features enabled).
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// x86-64 AVX-512 (F, BW, VL) on top of AVX2.
    Avx512,
    /// AArch64 Advanced SIMD.
    Neon,
}

impl Isa {
    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
            Isa::Neon => "neon",
        }
    }

    pub fn parse(s: &str) -> Option<Isa> {
        match s.trim().to_ascii_lowercase().as_str() {
            "scalar" => Some(Isa::Scalar),
            "avx2" => Some(Isa::Avx2),
            "avx512" => Some(Isa::Avx512),
            "neon" => Some(Isa::Neon),
            _ => None,
        }
    }

    /// Whether this CPU can run the path.
    pub fn supported(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                Isa::Avx2.supported()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
            }
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The best path this CPU supports.
    pub fn best() -> Isa {
        [Isa::Avx512, Isa::Avx2, Isa::Neon].into_iter().find(|i| i.supported()).unwrap_or(Isa::Scalar)
    }

    /// Every path this CPU supports.
    pub fn all_supported() -> Vec<Isa> {
        [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Neon].into_iter().filter(|i| i.supported()).collect()
    }

    /// The path to use: `MLXCEL_CPU_ISA` if set, else the best.
    pub fn from_env() -> Result<Isa, String> {
        match std::env::var("MLXCEL_CPU_ISA") {
            Ok(v) if !v.trim().is_empty() => {
                let isa = Isa::parse(&v)
                    .ok_or_else(|| format!("MLXCEL_CPU_ISA=`{v}` is not one of scalar, avx2, avx512, neon"))?;
                if !isa.supported() {
                    return Err(format!(
                        "MLXCEL_CPU_ISA={} is not supported by this CPU (supported: {})",
                        isa.name(),
                        Isa::all_supported().iter().map(|i| i.name()).collect::<Vec<_>>().join(", ")
                    ));
                }
                Ok(isa)
            }
            _ => Ok(Isa::best()),
        }
    }
}

/// Defines a kernel once and compiles it per SIMD path: `$name::scalar`, `$name::avx2`,
/// `$name::avx512` (x86-64) and `$name::neon` (AArch64), plus `$name::run(isa, ..)` to dispatch.
/// The body is written so the compiler vectorises it (independent accumulators, no early exits).
#[macro_export]
macro_rules! simd_kernel {
    ($(#[$m:meta])* pub fn $name:ident($($p:ident : $t:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$m])*
        #[allow(non_snake_case, clippy::too_many_arguments)]
        pub mod $name {
            #[allow(unused_imports)]
            use super::*;
            #[inline(always)]
            fn body($($p: $t),*) $(-> $ret)? $body
            pub fn scalar($($p: $t),*) $(-> $ret)? { body($($p),*) }
            /// # Safety
            /// The CPU must have AVX2, FMA and F16C.
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma,f16c")]
            pub unsafe fn avx2($($p: $t),*) $(-> $ret)? { body($($p),*) }
            /// # Safety
            /// The CPU must have AVX-512 F/BW/VL, AVX2, FMA and F16C.
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
            pub unsafe fn avx512($($p: $t),*) $(-> $ret)? { body($($p),*) }
            /// # Safety
            /// The CPU must have NEON.
            #[cfg(target_arch = "aarch64")]
            #[target_feature(enable = "neon")]
            pub unsafe fn neon($($p: $t),*) $(-> $ret)? { body($($p),*) }
            /// Runs the path `isa` (which the context checked is supported).
            #[inline]
            pub fn run(isa: $crate::isa::Isa, $($p: $t),*) $(-> $ret)? {
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    $crate::isa::Isa::Avx2 => unsafe { avx2($($p),*) },
                    #[cfg(target_arch = "x86_64")]
                    $crate::isa::Isa::Avx512 => unsafe { avx512($($p),*) },
                    #[cfg(target_arch = "aarch64")]
                    $crate::isa::Isa::Neon => unsafe { neon($($p),*) },
                    _ => scalar($($p),*),
                }
            }
        }
    };
}
