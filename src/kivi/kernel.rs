//! The choice among the KIVI kernel variants: [`KvKernel`] (one per ISA module, detected
//! at run time) and the mapping from "exact" / "fast" to a variant ([`KvKernel::best`]).
//! Which one a session runs is the caller's choice, passed in
//! ([`crate::exec::ExecOptions::kv_kernel`]); nothing here reads the environment.

/// Variants of the fused KIVI attention kernels ([`super::dot_codes_groups`],
/// [`super::axpy_codes_rows`] and their multi-query forms), each a module of the same
/// functions (`portable/`, `x86/avx512/`, `x86/avx512_exact.rs`, `x86/avx2.rs`,
/// `aarch64/neon.rs`). The engine passes each session's variant down to the `_with`
/// functions; tests call each supported variant through them too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvKernel {
    /// `wide` vectors (whatever the build targets), any head dim.
    Portable,
    /// x86_64 AVX-512 F/BW/VL + F16C (`vpermps` nibble lookup), head dims 32/64/128/256;
    /// other head dims take the portable path.
    Avx512,
    /// x86_64 AVX-512 F/BW/VL + F16C in the `portable` kernels' order (and the portable
    /// softmax), bit for bit (docs/design.md §2.3), head dims 32/64/128/256; other head
    /// dims take the portable path. Slower than `avx512`, so not the default.
    Avx512Exact,
    /// x86_64 AVX2 + FMA + F16C (8 lanes, the scheme of `Avx512`), head dims
    /// 32/64/128/256; other head dims take the portable path.
    Avx2,
    /// aarch64 NEON (4 lanes, the same scheme), head dims 32/64/128/256; other head dims
    /// take the portable path.
    Neon,
}

impl KvKernel {
    /// Every variant, slowest first.
    pub const ALL: [KvKernel; 5] = [
        KvKernel::Portable,
        KvKernel::Neon,
        KvKernel::Avx2,
        KvKernel::Avx512Exact,
        KvKernel::Avx512,
    ];

    /// Whether the variant adds every sum in the `portable` kernels' order (the order the
    /// reference writes out), so its results are the portable kernels' bits.
    pub fn is_exact(self) -> bool {
        matches!(self, KvKernel::Portable | KvKernel::Avx512Exact)
    }

    pub fn name(self) -> &'static str {
        match self {
            KvKernel::Portable => "portable",
            KvKernel::Avx512 => "avx512",
            KvKernel::Avx512Exact => "avx512-exact",
            KvKernel::Avx2 => "avx2",
            KvKernel::Neon => "neon",
        }
    }

    pub fn from_name(s: &str) -> Option<KvKernel> {
        KvKernel::ALL.into_iter().find(|k| k.name() == s)
    }

    /// Whether this CPU can run the variant (run-time detection).
    pub fn is_supported(self) -> bool {
        match self {
            KvKernel::Portable => true,
            #[cfg(target_arch = "x86_64")]
            KvKernel::Avx512 | KvKernel::Avx512Exact => {
                is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            KvKernel::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "aarch64")]
            KvKernel::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The variants this CPU supports, slowest first.
    pub fn supported() -> Vec<KvKernel> {
        KvKernel::ALL
            .into_iter()
            .filter(|k| k.is_supported())
            .collect()
    }

    /// The variant for a choice between exact and fast KIVI kernels: with `exact`, the
    /// fastest supported variant in the portable order ([`is_exact`](Self::is_exact):
    /// `avx512-exact` where the CPU has AVX-512, else `portable`), whose results are the
    /// reference's bits; without, the fastest supported variant.
    pub fn best(exact: bool) -> KvKernel {
        KvKernel::ALL
            .into_iter()
            .rev()
            .find(|k| k.is_supported() && (k.is_exact() || !exact))
            .unwrap_or(KvKernel::Portable)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Exact is `avx512-exact` where the CPU has AVX-512, else `portable` (the bits of
    /// the portable order either way); fast is the last (fastest) supported variant.
    #[test]
    fn best_maps_exact_and_fast_to_a_variant() {
        let want_exact = if KvKernel::Avx512Exact.is_supported() {
            KvKernel::Avx512Exact
        } else {
            KvKernel::Portable
        };
        assert_eq!(KvKernel::best(true), want_exact);
        assert!(KvKernel::best(true).is_exact());
        let fast = KvKernel::best(false);
        assert!(fast.is_supported());
        #[cfg(target_arch = "x86_64")]
        if KvKernel::Avx512.is_supported() {
            assert_eq!(fast, KvKernel::Avx512);
        } else if KvKernel::Avx2.is_supported() {
            assert_eq!(fast, KvKernel::Avx2);
        }
        #[cfg(target_arch = "aarch64")]
        assert_eq!(fast, KvKernel::Neon);
        assert_eq!(Some(&fast), KvKernel::supported().last());
    }
}
