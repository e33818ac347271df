//! The kernel variants ([`Kernel`]): one instruction set each, detected at run time, and
//! the default one ([`default_kernel`]).

/// A kernel variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// Plain Rust loops over the packed layout (every CPU).
    Scalar,
    /// `wide` vectors (`i16x16` pair products): every CPU, any target.
    Portable,
    /// x86_64 AVX2 (`vpmaddubsw` + `vpmaddwd`), F16C for the scales.
    Avx2,
    /// x86_64 AVX-512 BW + VNNI (`vpdpbusd` on 512-bit vectors).
    Avx512Vnni,
    /// aarch64 NEON with the dot-product extension (`sdot`).
    NeonDotprod,
}

impl Kernel {
    /// Every variant, slowest first.
    pub const ALL: [Kernel; 5] = [
        Kernel::Scalar,
        Kernel::Portable,
        Kernel::Avx2,
        Kernel::Avx512Vnni,
        Kernel::NeonDotprod,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kernel::Scalar => "scalar",
            Kernel::Portable => "portable",
            Kernel::Avx2 => "avx2",
            Kernel::Avx512Vnni => "avx512vnni",
            Kernel::NeonDotprod => "neon-dotprod",
        }
    }

    pub fn from_name(s: &str) -> Option<Kernel> {
        Kernel::ALL.into_iter().find(|k| k.name() == s)
    }

    /// Whether this CPU can run the variant (run-time detection).
    pub fn is_supported(self) -> bool {
        match self {
            Kernel::Scalar | Kernel::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            // The `avx512vnni` variant runs the AVX2 code where it has no AVX-512 code of
            // its own (the type table), so it needs AVX2 and FMA too (every AVX-512 CPU
            // has them).
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Vnni => {
                Kernel::Avx2.is_supported()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "aarch64")]
            Kernel::NeonDotprod => std::arch::is_aarch64_feature_detected!("dotprod"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The variants this CPU supports, slowest first.
    pub fn supported() -> Vec<Kernel> {
        Kernel::ALL
            .into_iter()
            .filter(|k| k.is_supported())
            .collect()
    }

    /// The fastest supported variant.
    pub fn best() -> Kernel {
        *Kernel::supported()
            .last()
            .expect("scalar is always supported")
    }
}

/// The default variant: [`Kernel::best`] (what [`crate::exec::KernelChoice::Auto`] runs).
/// The loaders take the variant as a parameter ([`crate::model::Model::load_opts`],
/// [`crate::ops::Matrix::from_tensor`]); the caller names one with `--kernel`
/// ([`crate::exec::ExecOptions::kernel`]). Nothing here reads the environment.
pub fn default_kernel() -> Kernel {
    Kernel::best()
}
