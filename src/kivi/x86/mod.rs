//! The x86_64 variants of the fused KIVI attention kernels, one module each with the same
//! functions (`takes`, `dot_codes_groups`, `axpy_codes_rows`, `dot_codes_groups_multi`,
//! `axpy_codes_rows_multi`): `avx512` (fast), `avx512_exact` (AVX-512 in the portable
//! order, the portable kernels' bits) and `avx2` (8 lanes, for CPUs without AVX-512). The
//! dispatch in `crate::kivi` chooses among them; none imports another.

pub(super) mod avx2;
pub(super) mod avx512;
pub(super) mod avx512_exact;

/// The head dims every x86 variant takes (32, 64, 128, 256); others run the portable
/// kernels.
#[inline]
fn takes(hd: usize) -> bool {
    matches!(hd, 32 | 64 | 128 | 256)
}
