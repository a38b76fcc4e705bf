//! Which SIMD path the kernels take, chosen at run time from what this CPU supports.
//! `MLXCEL_CPU_ISA=scalar|avx2|avxvnni|avx512|avx512vnni|neon|neondot` forces one (for tests and comparisons);
//! forcing a path the CPU lacks is an error, never a silent fallback.

/// A SIMD instruction set a kernel can be compiled for (a name; it proves nothing about this CPU).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IsaPath {
    /// Portable Rust compiled for the target's baseline (no extra features enabled).
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// AVX2 plus AVX-VNNI (Alder Lake and later, Zen 5): the 256-bit integer kernels multiply and
    /// accumulate int16 pairs with VEX `vpdpwssd`.
    AvxVnni,
    /// x86-64 AVX-512 (F, BW, VL) on top of AVX2.
    Avx512,
    /// AVX-512 plus AVX-512 VNNI: the integer kernels use `vpdpwssd` (512-bit, and the EVEX 256-bit
    /// form where they stay 256-bit).
    Avx512Vnni,
    /// AArch64 Advanced SIMD.
    Neon,
    /// AArch64 Advanced SIMD plus the dot-product instructions (Armv8.2 `dotprod`: Cortex-A55/A76 and
    /// later, Apple M1, Graviton 2): the integer kernels use `sdot`/`udot`.
    NeonDot,
}

impl IsaPath {
    /// Every path, in order of preference within an architecture (worst first).
    pub const ALL: [IsaPath; 7] = [
        IsaPath::Scalar,
        IsaPath::Avx2,
        IsaPath::AvxVnni,
        IsaPath::Avx512,
        IsaPath::Avx512Vnni,
        IsaPath::Neon,
        IsaPath::NeonDot,
    ];

    pub fn name(self) -> &'static str {
        match self {
            IsaPath::Scalar => "scalar",
            IsaPath::Avx2 => "avx2",
            IsaPath::AvxVnni => "avxvnni",
            IsaPath::Avx512 => "avx512",
            IsaPath::Avx512Vnni => "avx512vnni",
            IsaPath::Neon => "neon",
            IsaPath::NeonDot => "neondot",
        }
    }

    pub fn parse(s: &str) -> Option<IsaPath> {
        match s.trim().to_ascii_lowercase().as_str() {
            "scalar" => Some(IsaPath::Scalar),
            "avx2" => Some(IsaPath::Avx2),
            "avxvnni" => Some(IsaPath::AvxVnni),
            "avx512" => Some(IsaPath::Avx512),
            "avx512vnni" => Some(IsaPath::Avx512Vnni),
            "neon" => Some(IsaPath::Neon),
            "neondot" => Some(IsaPath::NeonDot),
            _ => None,
        }
    }

    /// Whether this CPU can run the path.
    pub fn supported(self) -> bool {
        match self {
            IsaPath::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            IsaPath::Avx2 => {
                is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            IsaPath::AvxVnni => IsaPath::Avx2.supported() && is_x86_feature_detected!("avxvnni"),
            #[cfg(target_arch = "x86_64")]
            IsaPath::Avx512 => {
                IsaPath::Avx2.supported()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
            }
            #[cfg(target_arch = "x86_64")]
            IsaPath::Avx512Vnni => IsaPath::Avx512.supported() && is_x86_feature_detected!("avx512vnni"),
            #[cfg(target_arch = "aarch64")]
            IsaPath::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[cfg(target_arch = "aarch64")]
            IsaPath::NeonDot => IsaPath::Neon.supported() && std::arch::is_aarch64_feature_detected!("dotprod"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }
}

/// A kernel path this CPU was found to support: only detection makes one (the field is private), so
/// holding an `Isa` is what makes calling its `#[target_feature]` kernels sound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Isa(IsaPath);

impl Isa {
    /// The portable path, which every CPU runs.
    pub const SCALAR: Isa = Isa(IsaPath::Scalar);

    /// `path`, when this CPU supports it.
    pub fn detect(path: IsaPath) -> Option<Isa> {
        path.supported().then_some(Isa(path))
    }

    pub fn path(self) -> IsaPath {
        self.0
    }

    pub fn name(self) -> &'static str {
        self.0.name()
    }

    /// AVX2, FMA and F16C are there (every x86 path but scalar).
    pub fn has_avx2(self) -> bool {
        matches!(self.0, IsaPath::Avx2 | IsaPath::AvxVnni | IsaPath::Avx512 | IsaPath::Avx512Vnni)
    }

    /// AVX-512 F, BW and VL are there (the two AVX-512 paths).
    pub fn has_avx512(self) -> bool {
        matches!(self.0, IsaPath::Avx512 | IsaPath::Avx512Vnni)
    }

    /// AVX-512 VNNI is there.
    pub fn has_avx512vnni(self) -> bool {
        self.0 == IsaPath::Avx512Vnni
    }

    /// NEON is there (both AArch64 paths).
    pub fn is_neon(self) -> bool {
        matches!(self.0, IsaPath::Neon | IsaPath::NeonDot)
    }

    /// The Armv8.2 dot-product instructions are there.
    pub fn has_dotprod(self) -> bool {
        self.0 == IsaPath::NeonDot
    }

    /// The best path this CPU supports.
    pub fn best() -> Isa {
        IsaPath::ALL.into_iter().rev().find_map(Isa::detect).unwrap_or(Isa::SCALAR)
    }

    /// Every path this CPU supports.
    pub fn all_supported() -> Vec<Isa> {
        IsaPath::ALL.into_iter().filter_map(Isa::detect).collect()
    }

    /// The path to use: `MLXCEL_CPU_ISA` if set, else the best.
    pub fn from_env() -> Result<Isa, String> {
        match std::env::var("MLXCEL_CPU_ISA") {
            Ok(v) if !v.trim().is_empty() => {
                let path = IsaPath::parse(&v).ok_or_else(|| {
                    format!(
                        "MLXCEL_CPU_ISA=`{v}` is not one of scalar, avx2, avxvnni, avx512, avx512vnni, neon, neondot"
                    )
                })?;
                Isa::detect(path).ok_or_else(|| {
                    format!(
                        "MLXCEL_CPU_ISA={} is not supported by this CPU (supported: {})",
                        path.name(),
                        Isa::all_supported().iter().map(|i| i.name()).collect::<Vec<_>>().join(", ")
                    )
                })
            }
            _ => Ok(Isa::best()),
        }
    }
}

/// Defines a kernel once and compiles it per SIMD path: `$name::scalar`, `$name::avx2`,
/// `$name::avx512` (x86-64) and `$name::neon` (AArch64), plus `$name::run(isa, ..)` to dispatch (the
/// VNNI paths run the AVX2 and AVX-512 builds, `neondot` the NEON one: the dot-product instructions
/// only matter to the integer kernels).
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
            /// Runs the path `isa` (an `Isa` exists only for a path this CPU supports).
            #[inline]
            pub fn run(isa: $crate::isa::Isa, $($p: $t),*) $(-> $ret)? {
                match isa.path() {
                    #[cfg(target_arch = "x86_64")]
                    $crate::isa::IsaPath::Avx2 | $crate::isa::IsaPath::AvxVnni => unsafe { avx2($($p),*) },
                    #[cfg(target_arch = "x86_64")]
                    $crate::isa::IsaPath::Avx512 | $crate::isa::IsaPath::Avx512Vnni => unsafe { avx512($($p),*) },
                    #[cfg(target_arch = "aarch64")]
                    $crate::isa::IsaPath::Neon | $crate::isa::IsaPath::NeonDot => unsafe { neon($($p),*) },
                    _ => scalar($($p),*),
                }
            }
        }
    };
}
