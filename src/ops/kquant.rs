//! Weights in super-blocks of 256 (the K-quants Q4_K, Q5_K, Q6_K, and IQ4_XS) multiplied
//! natively against Q8_K activations; and Q5_1, kept in the same whole-row layout but read
//! against the 8-bit blocks of 32 with Q4_1's steps (`ggml_dot::dot_q5_1`).
//!
//! Numerics are exactly those of `tinygpt_reference::ggml_kdot` (read its header; also
//! docs/design.md §2.2): per weight super-block of 256 values, exact integer sums, then
//! one row accumulator updated with separate f32 multiplies and adds
//! (Q4_K, Q5_K: `acc += isum·(d_w·d_x) − msum·(dmin_w·d_x)`, Q6_K: `acc += isum·(d_w·d_x)`).
//! Every variant equals the reference twin bit for bit (`tests/kquant_dispatch.rs`).
//!
//! # Layout
//!
//! [`super::qdot::Packed`] keeps a K-quant matrix in groups of [`GROUP`] rows as for the
//! other block types, but the rows of a group are **not** interleaved: each group is its
//! eight rows' super-blocks exactly as in the file, one row after another (each row
//! `cols / 256 · block_bytes` long), padded to 64 bytes. The multi-token kernels walk one
//! row at a time (a 144- or 210-byte super-block already fills several vectors); the x86
//! one-token kernels walk the eight rows together, super-block by super-block.
//!
//! # Variants
//!
//! * `scalar`: the reference's loops (`ggml_kdot::dot_q4_k` / `dot_q6_k`) per row;
//! * `avx2` (and `avx512vnni`, which runs the AVX2 code for these types except the
//!   one-token Q4_K/Q5_K/Q6_K groups, whose [`avx512`] twins do the same integer steps 64
//!   codes at a time with per-half shifts and `vpermw` scale lanes, and the Q5_1 group,
//!   compiled there with 32 vector registers): `vpmaddubsw`
//!   of the unsigned codes (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63 before its −32) with the signed
//!   activation codes, `vpmaddwd` with the sub-block scales, summed in 32-bit lanes;
//!   Q6_K's `−32` is applied as `−32 · Σ_k sc_k · bsums_k`. Same integers, same floats.
//!   One token (decode): per super-block the eight rows' 32-bit lane sums are reduced
//!   together (`vphaddd` tree, exact) into one vector of eight row sums, Q4_K/Q5_K's six-bit
//!   scales and mins unpacked with 32-bit masks and `msum` taken with `vpmaddwd` against the
//!   bsum pairs, and the float step runs for the eight rows as 8-lane `vmulps`/`vsubps`/
//!   `vaddps` (no FMA: lane r does the twin's separate multiplies and adds);
//! * `neon-dotprod` (`super::kquant_neon`): each super-block unpacked once into signed
//!   bytes in value order (Q6_K's codes already minus 32, IQ4_XS's levels by `tbl`), `sdot`
//!   with the activation codes, one 32-bit sum per sub-block by pairwise adds, the
//!   sub-block scales applied in 32-bit lanes. Same integers, same floats;
//! * `portable` (`super::kquant_portable`, `wide` only): each super-block unpacked once
//!   into `i16x16` lanes in value order with every code already times its sub-block
//!   scale, `i16x16::dot` with the widened activation codes, the lanes added and reduced
//!   once per super-block (exact integers), the twin's float steps per row in scalar f32;
//!   8 rows × [`TOKENS`] tokens per unpacked super-block column. Same integers, same floats.
//!   Q2_K and Q3_K too (their 2-bit fields shifted out of 16-byte lanes, Q3_K's `hmask`
//!   bit added as `+4` before the `−4`; Q2_K's mins as one more `dot` with the bsums).
//!
//! [`has_simd_kquant`] says which variant runs SIMD code for which type on this machine.
//!
//! The multi-token kernels unpack each weight super-block once for [`TOKENS`] tokens;
//! every token's value is the one-token value, bit for bit.

use super::qdot::{Group, Kernel, QuantizedActs, GROUP, TOKENS};
use crate::dtype::DType;
use tinygpt_reference::ggml_kdot::{self, Q8K};
use tinygpt_reference::ggml_more::QK_K;

/// Whether `dtype` is multiplied by this module's kernels.
pub fn is_kquant(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::Q4_K | DType::Q5_K | DType::Q6_K | DType::IQ4_XS
    ) || super::kquant_low::is_low(dtype)
}

/// Whether a [`super::qdot::Packed`] of `dtype` keeps whole rows (this module's layout and
/// kernels): the Q8_K-read types and Q5_1 (which reads the 8-bit blocks of 32, as Q4_1).
pub fn is_row_packed(dtype: DType) -> bool {
    is_kquant(dtype) || dtype == DType::Q5_1
}

/// Bytes of one row of `nb` (super-)blocks.
pub fn row_bytes(dtype: DType, nb: usize) -> usize {
    nb * dtype.block_bytes()
}

/// Quantises `x` into `k` when its length is a whole number of super-blocks (else `k`
/// is left empty: no K-quant matrix can have that many columns). The engine's Q8_K is the
/// reference's, block by block.
pub fn quantize_into(x: &[f32], k: &mut Q8K) {
    if !x.len().is_multiple_of(QK_K) || x.is_empty() {
        k.d.clear();
        k.q.clear();
        k.bsums.clear();
        return;
    }
    let nb = x.len() / QK_K;
    k.d.resize(nb, 0.0);
    k.q.resize(x.len(), 0);
    k.bsums.resize(nb * 16, 0);
    for (b, blk) in x.chunks_exact(QK_K).enumerate() {
        k.d[b] = ggml_kdot::quantize_q8_k_block(
            blk,
            &mut k.q[b * QK_K..(b + 1) * QK_K],
            &mut k.bsums[b * 16..(b + 1) * 16],
        );
    }
}

/// Whether `kernel` runs [`super::kquant_portable`]'s `wide` kernels for `dtype`.
fn use_portable(kernel: Kernel, dtype: DType) -> bool {
    kernel == Kernel::Portable && super::kquant_portable::has(dtype)
}

/// Whether `kernel` has a SIMD K-quant path here (else the scalar one runs).
#[cfg(target_arch = "x86_64")]
fn use_avx2(kernel: Kernel) -> bool {
    matches!(kernel, Kernel::Avx2 | Kernel::Avx512Vnni) && Kernel::Avx2.is_supported()
}

/// Whether `kernel` runs this module's AVX-512 one-token groups here (Q4_K, Q5_K, Q6_K,
/// Q5_1; the other code of `avx512vnni` is the AVX2 code).
#[cfg(target_arch = "x86_64")]
fn use_avx512(kernel: Kernel) -> bool {
    kernel == Kernel::Avx512Vnni && kernel.is_supported()
}

/// Whether `kernel` runs the NEON + dot-product rows ([`super::kquant_neon`]) here.
#[cfg(target_arch = "aarch64")]
fn use_neon(kernel: Kernel) -> bool {
    kernel == Kernel::NeonDotprod && kernel.is_supported()
}

/// A NEON row kernel: one row against `T` tokens' Q8_K super-blocks.
#[cfg(target_arch = "aarch64")]
type NeonRow<const T: usize> = unsafe fn(&[u8], &[&Q8K; T]) -> [f32; T];

/// The NEON row kernel `kernel` runs for `dtype` on this machine (`None`: scalar). The
/// dispatch ([`row_dots`]) and [`has_simd_kquant`] both ask this one function.
#[cfg(target_arch = "aarch64")]
fn neon_row<const T: usize>(kernel: Kernel, dtype: DType) -> Option<NeonRow<T>> {
    use super::kquant_neon as neon;
    if !use_neon(kernel) {
        return None;
    }
    Some(match dtype {
        DType::Q4_K => neon::k4_row::<T, false> as NeonRow<T>,
        DType::Q5_K => neon::k4_row::<T, true>,
        DType::Q6_K => neon::q6_k_row::<T>,
        DType::IQ4_XS => neon::iq4_xs_row::<T>,
        _ => return None,
    })
}

/// Whether `kernel` multiplies `dtype` (a row-packed type, see [`is_row_packed`]) with
/// SIMD code on this machine rather than the scalar loops: `avx2` / `avx512vnni` on x86_64
/// with AVX2, `neon-dotprod` on aarch64 with the dot-product extension, `portable` (its
/// `wide` kernels, every CPU) for the types of `super::kquant_portable`; never `scalar`.
/// Tests assert it so that a dispatch falling back to scalar fails them.
pub fn has_simd_kquant(kernel: Kernel, dtype: DType) -> bool {
    #[cfg(target_arch = "x86_64")]
    let simd = use_avx2(kernel)
        && matches!(
            dtype,
            DType::Q4_K
                | DType::Q5_K
                | DType::Q6_K
                | DType::IQ4_XS
                | DType::Q5_1
                | DType::Q2_K
                | DType::Q3_K
        );
    #[cfg(target_arch = "aarch64")]
    let simd = if dtype == DType::Q5_1 || super::kquant_low::is_low(dtype) {
        use_neon(kernel)
    } else {
        neon_row::<1>(kernel, dtype).is_some()
    };
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let simd = false;
    simd || use_portable(kernel, dtype)
}

/// `out[k] = row (8g + k) · a` for a K-quant group (see [`super::qdot::dot_group`]).
pub fn group(kernel: Kernel, dtype: DType, g: &Group, a: &QuantizedActs, out: &mut [f32; GROUP]) {
    let rb = row_bytes(dtype, g.nb);
    if dtype == DType::Q5_1 {
        assert_eq!(a.blocks(), g.nb, "activation blocks vs matrix blocks");
        if use_portable(kernel, dtype) {
            *out = super::kquant_portable::q5_1_group::<1>(g.qs, rb, &[a])[0];
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if use_avx2(kernel) {
            // SAFETY: AVX2 (with FMA and F16C) was detected at run time in `use_avx2`; the
            // group holds eight rows of `g.nb` blocks and the activations as many
            // (asserted above; the kernel asserts the lengths again).
            *out = unsafe {
                if use_avx512(kernel) {
                    avx512::q5_1_group(g.qs, rb, a)
                } else {
                    avx2::q5_1_group(g.qs, rb, a)
                }
            };
            return;
        }
        for (k, o) in out.iter_mut().enumerate() {
            *o = q5_1_dots::<1>(kernel, &g.qs[k * rb..(k + 1) * rb], &[a])[0];
        }
        return;
    }
    assert_eq!(
        a.k.blocks(),
        g.nb,
        "Q8_K activation super-blocks vs matrix super-blocks"
    );
    if use_portable(kernel, dtype) {
        *out = super::kquant_portable::group_tokens::<1>(dtype, g.qs, rb, &[&a.k])[0];
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if use_avx2(kernel)
        && matches!(
            dtype,
            DType::Q4_K | DType::Q5_K | DType::IQ4_XS | DType::Q6_K
        )
    {
        // SAFETY: AVX2 (with FMA and F16C) was detected at run time in `use_avx2`, and
        // AVX-512 F/BW by `is_supported` for the `avx512` kernel; the group holds eight rows of `g.nb` super-blocks of `dtype` and the activations as
        // many (asserted above; the kernels assert the lengths again).
        *out = unsafe {
            match dtype {
                DType::Q6_K if use_avx512(kernel) => avx512::q6_k_group(g.qs, rb, &a.k),
                DType::Q4_K if use_avx512(kernel) => avx512::k4_group::<false>(g.qs, rb, &a.k),
                DType::Q5_K if use_avx512(kernel) => avx512::k4_group::<true>(g.qs, rb, &a.k),
                DType::Q4_K => avx2::k4_group::<false>(g.qs, rb, &a.k),
                DType::Q5_K => avx2::k4_group::<true>(g.qs, rb, &a.k),
                DType::IQ4_XS => avx2::iq4_xs_group(g.qs, rb, &a.k),
                _ => avx2::q6_k_group(g.qs, rb, &a.k),
            }
        };
        return;
    }
    for (k, o) in out.iter_mut().enumerate() {
        let row = &g.qs[k * rb..(k + 1) * rb];
        *o = row_dots::<1>(kernel, dtype, row, &[&a.k])[0];
    }
}

/// `out[t][k] = row (8g + k) · acts[t]` for [`TOKENS`] tokens, each super-block unpacked
/// once for all of them (see [`super::qdot::dot_group_tokens`]).
pub fn group_tokens(
    kernel: Kernel,
    dtype: DType,
    g: &Group,
    acts: &[&QuantizedActs; TOKENS],
    out: &mut [[f32; GROUP]; TOKENS],
) {
    let rb = row_bytes(dtype, g.nb);
    if dtype == DType::Q5_1 {
        for a in acts {
            assert_eq!(a.blocks(), g.nb, "activation blocks vs matrix blocks");
        }
        if use_portable(kernel, dtype) {
            *out = super::kquant_portable::q5_1_group::<TOKENS>(g.qs, rb, acts);
            return;
        }
        for r in 0..GROUP {
            let v = q5_1_dots::<TOKENS>(kernel, &g.qs[r * rb..(r + 1) * rb], acts);
            for (o, vt) in out.iter_mut().zip(v) {
                o[r] = vt;
            }
        }
        return;
    }
    let ks: [&Q8K; TOKENS] = std::array::from_fn(|t| &acts[t].k);
    for k in &ks {
        assert_eq!(
            k.blocks(),
            g.nb,
            "Q8_K activation super-blocks vs matrix super-blocks"
        );
    }
    if use_portable(kernel, dtype) {
        *out = super::kquant_portable::group_tokens::<TOKENS>(dtype, g.qs, rb, &ks);
        return;
    }
    for r in 0..GROUP {
        let row = &g.qs[r * rb..(r + 1) * rb];
        let v = row_dots::<TOKENS>(kernel, dtype, row, &ks);
        for (o, vt) in out.iter_mut().zip(v) {
            o[r] = vt;
        }
    }
}

/// One Q5_1 row against `T` tokens' 8-bit blocks of 32 (block counts checked by the
/// callers): `tinygpt_reference::ggml_dot::dot_q5_1`'s steps.
#[inline]
fn q5_1_dots<const T: usize>(kernel: Kernel, row: &[u8], acts: &[&QuantizedActs; T]) -> [f32; T] {
    #[cfg(target_arch = "x86_64")]
    if use_avx2(kernel) {
        // SAFETY: AVX2 (with FMA and F16C) was detected at run time in `use_avx2`; every
        // token has as many blocks as the row (asserted by the callers and again inside).
        return unsafe { avx2::q5_1_row::<T>(row, acts) };
    }
    #[cfg(target_arch = "aarch64")]
    if use_neon(kernel) {
        // SAFETY: NEON is baseline on aarch64 and `dotprod` was detected in `use_neon`;
        // every token has as many blocks as the row (asserted by the callers and inside).
        return unsafe { super::kquant_neon::q5_1_row::<T>(row, acts) };
    }
    let _ = kernel;
    std::array::from_fn(|t| {
        let a = acts[t];
        let mut acc = 0.0f32;
        for (b, blk) in row.chunks_exact(24).enumerate() {
            let codes = tinygpt_reference::ggml_dot::q5_1_codes(blk);
            let mut isum = 0i32;
            for (c, &q) in codes.iter().zip(&a.q[b * 32..(b + 1) * 32]) {
                isum += *c as i32 * q as i32;
            }
            let dw = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
            let mw = half::f16::from_le_bytes([blk[2], blk[3]]).to_f32();
            acc += isum as f32 * (dw * a.d[b]) + mw * a.s[b];
        }
        acc
    })
}

/// One row against `T` tokens (block counts checked by the callers).
#[inline]
fn row_dots<const T: usize>(kernel: Kernel, dtype: DType, row: &[u8], ks: &[&Q8K; T]) -> [f32; T] {
    if super::kquant_low::is_low(dtype) {
        return super::kquant_low::row_dots::<T>(kernel, dtype, row, ks);
    }
    #[cfg(target_arch = "x86_64")]
    if use_avx2(kernel) {
        // SAFETY: AVX2 (with FMA and F16C) was detected at run time in `use_avx2`; `row`
        // holds `ks[t].blocks()` super-blocks of `dtype` and every token as many
        // (asserted by the callers; the kernels assert the lengths again).
        return unsafe {
            match dtype {
                DType::Q4_K => avx2::k4_row::<T, false>(row, ks),
                DType::Q5_K => avx2::k4_row::<T, true>(row, ks),
                DType::IQ4_XS => avx2::iq4_xs_row::<T>(row, ks),
                _ => avx2::q6_k_row::<T>(row, ks),
            }
        };
    }
    #[cfg(target_arch = "aarch64")]
    if let Some(f) = neon_row::<T>(kernel, dtype) {
        // SAFETY: `neon_row` returns a kernel only when `dotprod` was detected (NEON is
        // baseline); `row` holds `ks[t].blocks()` super-blocks of `dtype` and every token
        // as many (asserted by the callers; the kernels assert the lengths again).
        return unsafe { f(row, ks) };
    }
    let _ = kernel;
    std::array::from_fn(|t| match dtype {
        DType::Q4_K => ggml_kdot::dot_q4_k(row, ks[t]),
        DType::Q5_K => ggml_kdot::dot_q5_k(row, ks[t]),
        DType::IQ4_XS => ggml_kdot::dot_iq4_xs(row, ks[t]),
        _ => ggml_kdot::dot_q6_k(row, ks[t]),
    })
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    //! AVX2 K-quant rows: integer sums in 32-bit lanes, reduced once per super-block,
    //! then the reference's float steps in scalar f32 (separate multiply and add).

    use super::{Q8K, QK_K};
    use half::f16;
    use std::arch::x86_64::*;
    use tinygpt_reference::ggml_kdot::{
        iq4_xs_scale, IQ4_XS_BYTES, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES,
    };
    use tinygpt_reference::ggml_more::scale_min_k4;
    use tinygpt_reference::ggml_more::IQ4_VALUES;

    #[inline(always)]
    pub(in crate::ops) fn f16_at(b: &[u8], at: usize) -> f32 {
        f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
    }

    /// The eight 32-bit lanes summed (exact: integer addition).
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(in crate::ops) fn hsum(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        _mm_cvtsi128_si32(s)
    }

    /// Asks for the cache lines of the super-block at `blk + ahead` (the same place in the
    /// next group): eight rows walked together are eight streams, more than the hardware
    /// prefetcher follows. A hint; past the end of the matrix it is dropped.
    #[inline(always)]
    pub(super) fn prefetch_next_group(blk: *const u8, ahead: usize, bytes: usize) {
        let p = blk.wrapping_add(ahead);
        let mut at = 0;
        while at < bytes {
            // SAFETY: a prefetch never faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(at).cast()) };
            at += 64;
        }
    }

    /// Lane `r` of the result = the sum of the eight 32-bit lanes of `v[r]` (exact:
    /// integer additions, in any order).
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) fn reduce8(v: &[__m256i; 8]) -> __m256i {
        let h01 = _mm256_hadd_epi32(v[0], v[1]);
        let h23 = _mm256_hadd_epi32(v[2], v[3]);
        let h45 = _mm256_hadd_epi32(v[4], v[5]);
        let h67 = _mm256_hadd_epi32(v[6], v[7]);
        // Per 128-bit half: [v0, v1, v2, v3] (resp. v4..v8) partial sums.
        let a = _mm256_hadd_epi32(h01, h23);
        let b = _mm256_hadd_epi32(h45, h67);
        _mm256_add_epi32(
            _mm256_permute2x128_si256(a, b, 0x20),
            _mm256_permute2x128_si256(a, b, 0x31),
        )
    }

    /// Lane `r` of the result = the sum of the four 32-bit lanes of `v[r]` (exact).
    #[target_feature(enable = "avx2")]
    #[inline]
    pub(super) fn reduce8_128(v: &[__m128i; 8]) -> __m256i {
        let a = _mm_hadd_epi32(_mm_hadd_epi32(v[0], v[1]), _mm_hadd_epi32(v[2], v[3]));
        let b = _mm_hadd_epi32(_mm_hadd_epi32(v[4], v[5]), _mm_hadd_epi32(v[6], v[7]));
        _mm256_setr_m128i(a, b)
    }

    /// The eight f16 values at `p[r·stride]` (r = 0..8), as f32 (exact conversion).
    ///
    /// # Safety
    /// AVX2 and F16C must be available; every `p + r·stride .. + 2` must be readable.
    #[target_feature(enable = "avx2,f16c")]
    #[inline]
    pub(super) unsafe fn f16x8(p: *const u8, stride: usize) -> __m256 {
        // SAFETY: the caller's bounds.
        let h: [u16; 8] =
            std::array::from_fn(|r| unsafe { p.add(r * stride).cast::<u16>().read_unaligned() });
        // SAFETY: `h` is 16 bytes.
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(h.as_ptr().cast()) })
    }

    /// A Q4_K/Q5_K super-block's eight six-bit scales (i16 lanes 0..8) and mins (lanes
    /// 8..16), unpacked with 32-bit masks (the same values as `scale_min_k4`).
    ///
    /// # Safety
    /// AVX2 must be available; `blk` must point at a whole super-block.
    #[inline(always)]
    pub(super) unsafe fn k4_scales_mins(blk: *const u8) -> __m256i {
        const K1: u32 = 0x3f3f_3f3f;
        const K2: u32 = 0x0f0f_0f0f;
        const K3: u32 = 0x0303_0303;
        // SAFETY: bytes 4..16 are inside the block.
        let (u0, u1, u2) = unsafe {
            (
                blk.add(4).cast::<u32>().read_unaligned(),
                blk.add(8).cast::<u32>().read_unaligned(),
                blk.add(12).cast::<u32>().read_unaligned(),
            )
        };
        // Bytes: scales 0..4 (s[j] & 63), scales 4..8, mins 0..4, mins 4..8.
        let sc03 = u0 & K1;
        let sc47 = (u2 & K2) | (((u0 >> 6) & K3) << 4);
        let mn03 = u1 & K1;
        let mn47 = ((u2 >> 4) & K2) | (((u1 >> 6) & K3) << 4);
        _mm256_cvtepu8_epi16(_mm_setr_epi32(
            sc03 as i32,
            sc47 as i32,
            mn03 as i32,
            mn47 as i32,
        ))
    }

    /// One Q4_K/Q5_K super-block `blk` · the 256 codes at `q8`: the integer sum
    /// `Σ sc_j · (codes · q8)_j` spread over eight 32-bit lanes, and `msum = Σ m_j ·
    /// (bsums_2j + bsums_2j+1)` over four (`bp` holds the eight pair sums of the bsums).
    /// The six-bit scales and mins unpacked with 32-bit masks (the same values as
    /// `scale_min_k4`).
    ///
    /// # Safety
    /// AVX2 must be available; `blk` must point at a whole super-block, `q8` at 256 codes.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn k4_block<const FIVE: bool>(
        blk: *const u8,
        q8: *const i8,
        bp: __m128i,
    ) -> (__m256i, __m128i) {
        // SAFETY: the caller's (a whole super-block).
        let sm = unsafe { k4_scales_mins(blk) };
        let m = _mm_madd_epi16(_mm256_extracti128_si256(sm, 1), bp);
        let scales = _mm256_permute2x128_si256(sm, sm, 0x00);
        let m4 = _mm256_set1_epi8(0x0F);
        let qs_at = if FIVE { 48 } else { 16 };
        let qh = if FIVE {
            // SAFETY: bytes 16..48 are inside the 176-byte block.
            unsafe { _mm256_loadu_si256(blk.add(16).cast()) }
        } else {
            _mm256_setzero_si256()
        };
        let top = |bit: i32| {
            let mk = _mm256_set1_epi8((1u8 << bit) as i8);
            let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, mk), mk);
            _mm256_and_si256(set, _mm256_set1_epi8(0x10))
        };
        let mut s = _mm256_setzero_si256();
        for j in 0..4 {
            // SAFETY: weight bytes qs_at + 32j .. + 32 are inside the block; codes
            // 64j .. 64j + 64 inside the 256.
            let (w, xl, xh) = unsafe {
                (
                    _mm256_loadu_si256(blk.add(qs_at + 32 * j).cast()),
                    _mm256_loadu_si256(q8.add(64 * j).cast()),
                    _mm256_loadu_si256(q8.add(64 * j + 32).cast()),
                )
            };
            let mut lo = _mm256_and_si256(w, m4);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
            if FIVE {
                lo = _mm256_or_si256(lo, top(2 * j as i32));
                hi = _mm256_or_si256(hi, top(2 * j as i32 + 1));
            }
            // The i16 scale of sub-block 2j (2j + 1) in every lane.
            let sl = _mm256_shuffle_epi8(
                scales,
                _mm256_set1_epi16((((4 * j + 1) << 8) | (4 * j)) as i16),
            );
            let sh = _mm256_shuffle_epi8(
                scales,
                _mm256_set1_epi16((((4 * j + 3) << 8) | (4 * j + 2)) as i16),
            );
            // Pair sums ≤ 2·31·128: no saturation.
            let pl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xl), sl);
            let ph = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xh), sh);
            s = _mm256_add_epi32(s, _mm256_add_epi32(pl, ph));
        }
        (s, m)
    }

    /// Q4_K (`FIVE = false`) or Q5_K (`FIVE = true`): the eight rows of a group (each
    /// `rb` bytes, one after another in `qs`) · one token. Per super-block, the eight
    /// rows' integer sums are reduced together into one vector, and the float step runs
    /// as 8-lane separate multiplies, subtract and add: lane r does exactly the twin's
    /// `acc += isum·(d·dx) − msum·(dmin·dx)`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn k4_group<const FIVE: bool>(qs: &[u8], rb: usize, k: &Q8K) -> [f32; 8] {
        // SAFETY: `k4_block` needs AVX2, which this function has; the driver passes a
        // whole super-block and the token's 256 codes.
        let block = |blk, q8: &*const i8, bp| unsafe { k4_block::<FIVE>(blk, *q8, bp) };
        // SAFETY: the caller's.
        unsafe { k4_group_with::<FIVE, _>(qs, rb, k, |q8| q8, block) }
    }

    /// [`k4_group`]'s walk with the per-row integer step `block` (given the token's
    /// super-block as `prep` lays it out once per super-block): the AVX2 and AVX-512
    /// kernels share everything else, compiled into each caller's instruction set.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available; `block` must be sound for a whole super-block.
    #[inline(always)]
    pub(super) unsafe fn k4_group_with<const FIVE: bool, S>(
        qs: &[u8],
        rb: usize,
        k: &Q8K,
        prep: impl Fn(*const i8) -> S,
        block: impl Fn(*const u8, &S, __m128i) -> (__m256i, __m128i),
    ) -> [f32; 8] {
        let bytes = if FIVE { Q5_K_BYTES } else { Q4_K_BYTES };
        let nb = rb / bytes;
        assert_eq!(rb, nb * bytes);
        assert!(qs.len() >= 8 * rb);
        assert!(k.q.len() >= nb * QK_K && k.d.len() >= nb && k.bsums.len() >= nb * 16);
        // The next group starts after eight rows, padded to 64 bytes (`Packed` layout).
        let ahead = (8 * rb).next_multiple_of(64);
        let mut acc = _mm256_setzero_ps();
        for b in 0..nb {
            // SAFETY: super-block b of every row and of the token is inside the slices
            // (asserted above).
            unsafe {
                let q8 = prep(k.q.as_ptr().add(b * QK_K));
                let bsp = k.bsums.as_ptr().add(b * 16);
                let bp = _mm_hadd_epi16(
                    _mm_loadu_si128(bsp.cast()),
                    _mm_loadu_si128(bsp.add(8).cast()),
                );
                let base = qs.as_ptr().add(b * bytes);
                let mut s = [_mm256_setzero_si256(); 8];
                let mut m = [_mm_setzero_si128(); 8];
                for r in 0..8 {
                    prefetch_next_group(base.add(r * rb), ahead, bytes);
                    (s[r], m[r]) = block(base.add(r * rb), &q8, bp);
                }
                let isum = _mm256_cvtepi32_ps(reduce8(&s));
                let msum = _mm256_cvtepi32_ps(reduce8_128(&m));
                let d = f16x8(base, rb);
                let dmin = f16x8(base.add(2), rb);
                let dx = _mm256_set1_ps(k.d[b]);
                acc = _mm256_add_ps(
                    acc,
                    _mm256_sub_ps(
                        _mm256_mul_ps(isum, _mm256_mul_ps(d, dx)),
                        _mm256_mul_ps(msum, _mm256_mul_ps(dmin, dx)),
                    ),
                );
            }
        }
        let mut out = [0.0f32; 8];
        // SAFETY: `out` is 8 floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc) };
        out
    }

    /// One Q6_K super-block `blk` · the 256 codes at `q8` (`bs`: their 16 bsums): the
    /// integer sum `Σ sc_k · (codes · q8)_k − 32 · Σ sc_k · bsums_k` spread over eight
    /// 32-bit lanes.
    ///
    /// # Safety
    /// AVX2 must be available; `blk` must point at a whole super-block, `q8` at 256 codes.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn q6_k_block(blk: *const u8, q8: *const i8, bs: __m256i) -> __m256i {
        let m4 = _mm256_set1_epi8(0x0F);
        let m30 = _mm256_set1_epi8(0x30);
        // SAFETY: the 16 scale bytes 192..208 are inside the 210-byte block.
        let scb = unsafe { _mm_loadu_si128(blk.add(192).cast()) };
        let off = _mm256_madd_epi16(_mm256_cvtepi8_epi16(scb), bs);
        let mut s = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(off, 5));
        for n in 0..2 {
            // SAFETY: ql 64n..64n + 64 and qh 128 + 32n..160 + 32n are inside the block.
            let (ql0, ql1, qh) = unsafe {
                (
                    _mm256_loadu_si256(blk.add(64 * n).cast()),
                    _mm256_loadu_si256(blk.add(64 * n + 32).cast()),
                    _mm256_loadu_si256(blk.add(128 + 32 * n).cast()),
                )
            };
            // codes[t]: values 128n + 32t .. + 32, unsigned 0..63.
            let codes = [
                _mm256_or_si256(
                    _mm256_and_si256(ql0, m4),
                    _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(ql1, m4),
                    _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                    _mm256_and_si256(qh, m30),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                    _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30),
                ),
            ];
            for (t, c) in codes.into_iter().enumerate() {
                let i = 4 * n + t;
                // Scales of this 32-value run: lanes 0..8 sc[2i], lanes 8..16 sc[2i + 1].
                let idx = _mm_setr_epi8(
                    2 * i as i8,
                    2 * i as i8,
                    2 * i as i8,
                    2 * i as i8,
                    2 * i as i8,
                    2 * i as i8,
                    2 * i as i8,
                    2 * i as i8,
                    2 * i as i8 + 1,
                    2 * i as i8 + 1,
                    2 * i as i8 + 1,
                    2 * i as i8 + 1,
                    2 * i as i8 + 1,
                    2 * i as i8 + 1,
                    2 * i as i8 + 1,
                    2 * i as i8 + 1,
                );
                let scv = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scb, idx));
                // SAFETY: codes 32i .. 32i + 32 are inside the 256.
                let x = unsafe { _mm256_loadu_si256(q8.add(32 * i).cast()) };
                // Pair sums ≤ 2·63·128: no saturation.
                let p = _mm256_maddubs_epi16(c, x);
                s = _mm256_add_epi32(s, _mm256_madd_epi16(p, scv));
            }
        }
        s
    }

    /// Q6_K: the eight rows of a group · one token, as [`k4_group`] (lane r:
    /// `acc += isum·(d·dx)`).
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q6_k_group(qs: &[u8], rb: usize, k: &Q8K) -> [f32; 8] {
        // SAFETY: `q6_k_block` needs AVX2, which this function has; the driver passes a
        // whole super-block and 256 codes.
        let block = |blk, q8, bs| unsafe { q6_k_block(blk, q8, bs) };
        // SAFETY: the caller's.
        unsafe { q6_k_group_with(qs, rb, k, block) }
    }

    /// [`q6_k_group`]'s walk with the per-row integer step `block`, shared by the AVX2
    /// and AVX-512 kernels (compiled into each caller's instruction set).
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available; `block` must be sound for a whole super-block
    /// and 256 codes.
    #[inline(always)]
    pub(super) unsafe fn q6_k_group_with(
        qs: &[u8],
        rb: usize,
        k: &Q8K,
        block: impl Fn(*const u8, *const i8, __m256i) -> __m256i,
    ) -> [f32; 8] {
        let nb = rb / Q6_K_BYTES;
        assert_eq!(rb, nb * Q6_K_BYTES);
        assert!(qs.len() >= 8 * rb);
        assert!(k.q.len() >= nb * QK_K && k.d.len() >= nb && k.bsums.len() >= nb * 16);
        // The next group starts after eight rows, padded to 64 bytes (`Packed` layout).
        let ahead = (8 * rb).next_multiple_of(64);
        let mut acc = _mm256_setzero_ps();
        for b in 0..nb {
            // SAFETY: super-block b of every row and of the token is inside the slices
            // (asserted above).
            unsafe {
                let q8 = k.q.as_ptr().add(b * QK_K);
                let bs = _mm256_loadu_si256(k.bsums.as_ptr().add(b * 16).cast());
                let base = qs.as_ptr().add(b * Q6_K_BYTES);
                let mut s = [_mm256_setzero_si256(); 8];
                for (r, sr) in s.iter_mut().enumerate() {
                    prefetch_next_group(base.add(r * rb), ahead, Q6_K_BYTES);
                    *sr = block(base.add(r * rb), q8, bs);
                }
                let isum = _mm256_cvtepi32_ps(reduce8(&s));
                let d = f16x8(base.add(208), rb);
                let dx = _mm256_set1_ps(k.d[b]);
                acc = _mm256_add_ps(acc, _mm256_mul_ps(isum, _mm256_mul_ps(d, dx)));
            }
        }
        let mut out = [0.0f32; 8];
        // SAFETY: `out` is 8 floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc) };
        out
    }

    /// IQ4_XS: the eight rows of a group · one token, as [`k4_group`] (lane r:
    /// `acc += isum·(d·dx)`; the integer sums as [`iq4_xs_row`]).
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn iq4_xs_group(qs: &[u8], rb: usize, k: &Q8K) -> [f32; 8] {
        let nb = rb / IQ4_XS_BYTES;
        assert_eq!(rb, nb * IQ4_XS_BYTES);
        assert!(qs.len() >= 8 * rb);
        assert!(k.q.len() >= nb * QK_K && k.d.len() >= nb);
        let m4 = _mm256_set1_epi8(0x0F);
        // SAFETY: IQ4_VALUES is 16 bytes; unaligned load.
        let table =
            _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(IQ4_VALUES.as_ptr().cast()) });
        // The next group starts after eight rows, padded to 64 bytes (`Packed` layout).
        let ahead = (8 * rb).next_multiple_of(64);
        let mut acc = _mm256_setzero_ps();
        for b in 0..nb {
            let q8 = &k.q[b * QK_K..(b + 1) * QK_K];
            let mut s = [_mm256_setzero_si256(); 8];
            for (r, sr) in s.iter_mut().enumerate() {
                let at = r * rb + b * IQ4_XS_BYTES;
                let blk = &qs[at..at + IQ4_XS_BYTES];
                prefetch_next_group(blk.as_ptr(), ahead, IQ4_XS_BYTES);
                let mut v = _mm256_setzero_si256();
                for p in 0..4 {
                    // SAFETY: bytes 8 + 32p .. 40 + 32p are inside the 136-byte block;
                    // codes 64p .. 64p + 64 inside the token's 256.
                    let (q, x0, x1) = unsafe {
                        (
                            _mm256_loadu_si256(blk.as_ptr().add(8 + 32 * p).cast()),
                            _mm256_loadu_si256(q8.as_ptr().add(64 * p).cast()),
                            _mm256_loadu_si256(q8.as_ptr().add(64 * p + 32).cast()),
                        )
                    };
                    let lo = _mm256_and_si256(q, m4);
                    let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                    let w0 = _mm256_shuffle_epi8(table, _mm256_permute2x128_si256(lo, hi, 0x20));
                    let w1 = _mm256_shuffle_epi8(table, _mm256_permute2x128_si256(lo, hi, 0x31));
                    let s0 = (iq4_xs_scale(blk, 2 * p) - 32) as i16;
                    let s1 = (iq4_xs_scale(blk, 2 * p + 1) - 32) as i16;
                    // Pair sums ≤ 2·127·127: no saturation.
                    let p0 = _mm256_maddubs_epi16(_mm256_abs_epi8(w0), _mm256_sign_epi8(x0, w0));
                    let p1 = _mm256_maddubs_epi16(_mm256_abs_epi8(w1), _mm256_sign_epi8(x1, w1));
                    v = _mm256_add_epi32(
                        v,
                        _mm256_add_epi32(
                            _mm256_madd_epi16(p0, _mm256_set1_epi16(s0)),
                            _mm256_madd_epi16(p1, _mm256_set1_epi16(s1)),
                        ),
                    );
                }
                *sr = v;
            }
            let isum = _mm256_cvtepi32_ps(reduce8(&s));
            // SAFETY: the d of super-block b of every row is inside `qs` (asserted).
            let d = unsafe { f16x8(qs.as_ptr().add(b * IQ4_XS_BYTES), rb) };
            let dx = _mm256_set1_ps(k.d[b]);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(isum, _mm256_mul_ps(d, dx)));
        }
        let mut out = [0.0f32; 8];
        // SAFETY: `out` is 8 floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc) };
        out
    }

    /// Q4_K (`FIVE = false`) or Q5_K (`FIVE = true`) row · `T` tokens.
    ///
    /// # Safety
    /// AVX2 must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn k4_row<const T: usize, const FIVE: bool>(row: &[u8], ks: &[&Q8K; T]) -> [f32; T] {
        let bytes = if FIVE { Q5_K_BYTES } else { Q4_K_BYTES };
        let qs_at = if FIVE { 48 } else { 16 };
        let nb = row.len() / bytes;
        assert_eq!(row.len(), nb * bytes);
        for k in ks {
            assert!(k.q.len() >= nb * QK_K && k.d.len() >= nb && k.bsums.len() >= nb * 16);
        }
        let m4 = _mm256_set1_epi8(0x0F);
        let mut acc = [0.0f32; T];
        for b in 0..nb {
            let blk = &row[b * bytes..(b + 1) * bytes];
            let mut sc = [0i16; 8];
            let mut mn = [0i32; 8];
            for j in 0..8 {
                let (s, m) = scale_min_k4(j, &blk[4..16]);
                sc[j] = s as i16;
                mn[j] = m as i32;
            }
            let mut lo = [_mm256_setzero_si256(); 4];
            let mut hi = [_mm256_setzero_si256(); 4];
            // Q5_K's fifth bits: byte l of `qh` tops value 64j + l (bit 2j) and
            // 64j + 32 + l (bit 2j + 1).
            let qh = if FIVE {
                // SAFETY: bytes 16..48 are inside the 176-byte block.
                unsafe { _mm256_loadu_si256(blk.as_ptr().add(16).cast()) }
            } else {
                _mm256_setzero_si256()
            };
            let top = |bit: i32| {
                let m = _mm256_set1_epi8((1u8 << bit) as i8);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, m), m);
                _mm256_and_si256(set, _mm256_set1_epi8(0x10))
            };
            for j in 0..4 {
                // SAFETY: bytes qs_at + 32j .. qs_at + 32j + 32 are inside the block.
                let w = unsafe { _mm256_loadu_si256(blk.as_ptr().add(qs_at + 32 * j).cast()) };
                lo[j] = _mm256_and_si256(w, m4);
                hi[j] = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
                if FIVE {
                    lo[j] = _mm256_or_si256(lo[j], top(2 * j as i32));
                    hi[j] = _mm256_or_si256(hi[j], top(2 * j as i32 + 1));
                }
            }
            let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
            for (t, k) in ks.iter().enumerate() {
                let q8 = k.q[b * QK_K..(b + 1) * QK_K].as_ptr();
                let mut s = _mm256_setzero_si256();
                for j in 0..4 {
                    // SAFETY: 64j .. 64j + 64 is inside the token's 256 codes (asserted).
                    let (xl, xh) = unsafe {
                        (
                            _mm256_loadu_si256(q8.add(64 * j).cast()),
                            _mm256_loadu_si256(q8.add(64 * j + 32).cast()),
                        )
                    };
                    // Pair sums ≤ 2·31·128: no saturation.
                    let pl = _mm256_maddubs_epi16(lo[j], xl);
                    let ph = _mm256_maddubs_epi16(hi[j], xh);
                    s = _mm256_add_epi32(
                        s,
                        _mm256_add_epi32(
                            _mm256_madd_epi16(pl, _mm256_set1_epi16(sc[2 * j])),
                            _mm256_madd_epi16(ph, _mm256_set1_epi16(sc[2 * j + 1])),
                        ),
                    );
                }
                let isum = hsum(s);
                let bs = &k.bsums[b * 16..(b + 1) * 16];
                let mut msum = 0i32;
                for j in 0..8 {
                    msum += mn[j] * (bs[2 * j] as i32 + bs[2 * j + 1] as i32);
                }
                let dx = k.d[b];
                acc[t] += isum as f32 * (d * dx) - msum as f32 * (dmin * dx);
            }
        }
        acc
    }

    /// IQ4_XS row · `T` tokens: the levels looked up with `vpshufb`, then signed × signed
    /// byte products as `|w| · (q8 · sign w)` (pair sums ≤ 2·127·127).
    ///
    /// # Safety
    /// AVX2 must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn iq4_xs_row<const T: usize>(row: &[u8], ks: &[&Q8K; T]) -> [f32; T] {
        let nb = row.len() / IQ4_XS_BYTES;
        assert_eq!(row.len(), nb * IQ4_XS_BYTES);
        for k in ks {
            assert!(k.q.len() >= nb * QK_K && k.d.len() >= nb);
        }
        let m4 = _mm256_set1_epi8(0x0F);
        // SAFETY: IQ4_VALUES is 16 bytes; unaligned load.
        let table =
            _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(IQ4_VALUES.as_ptr().cast()) });
        let mut acc = [0.0f32; T];
        for b in 0..nb {
            let blk = &row[b * IQ4_XS_BYTES..(b + 1) * IQ4_XS_BYTES];
            // w[ib]: sub-block ib's 32 levels in value order, as |w| and w.
            let mut wabs = [_mm256_setzero_si256(); 8];
            let mut wsgn = [_mm256_setzero_si256(); 8];
            for p in 0..4 {
                // SAFETY: bytes 8 + 32p .. 40 + 32p are inside the 136-byte block.
                let q = unsafe { _mm256_loadu_si256(blk.as_ptr().add(8 + 32 * p).cast()) };
                let lo = _mm256_and_si256(q, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                // Sub-block 2p: low nibbles of bytes 0..16 then their high nibbles.
                let a = _mm256_permute2x128_si256(lo, hi, 0x20);
                let c = _mm256_permute2x128_si256(lo, hi, 0x31);
                for (i, v) in [(2 * p, a), (2 * p + 1, c)] {
                    let w = _mm256_shuffle_epi8(table, v);
                    wabs[i] = _mm256_abs_epi8(w);
                    wsgn[i] = w;
                }
            }
            let sc: [i16; 8] = std::array::from_fn(|ib| (iq4_xs_scale(blk, ib) - 32) as i16);
            let d = f16_at(blk, 0);
            for (t, k) in ks.iter().enumerate() {
                let q8 = k.q[b * QK_K..(b + 1) * QK_K].as_ptr();
                let mut s = _mm256_setzero_si256();
                for ib in 0..8 {
                    // SAFETY: 32ib .. 32ib + 32 is inside the token's 256 codes (asserted).
                    let x = unsafe { _mm256_loadu_si256(q8.add(32 * ib).cast()) };
                    let p = _mm256_maddubs_epi16(wabs[ib], _mm256_sign_epi8(x, wsgn[ib]));
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(p, _mm256_set1_epi16(sc[ib])));
                }
                acc[t] += hsum(s) as f32 * (d * k.d[b]);
            }
        }
        acc
    }

    /// Q5_1 row · `T` tokens' 8-bit blocks of 32: the 32 five-bit codes of a block in one
    /// vector (nibbles, then each `qh` bit spread to its byte as 0x10), `vpmaddubsw` with
    /// the activation codes, summed exactly; the float steps as the twin.
    ///
    /// # Safety
    /// AVX2 must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q5_1_row<const T: usize>(
        row: &[u8],
        acts: &[&super::QuantizedActs; T],
    ) -> [f32; T] {
        let nb = row.len() / 24;
        assert_eq!(row.len(), nb * 24);
        for a in acts {
            assert!(a.q.len() >= nb * 32 && a.d.len() >= nb && a.s.len() >= nb);
        }
        let ones = _mm256_set1_epi16(1);
        let mut acc = [0.0f32; T];
        for b in 0..nb {
            let blk = &row[b * 24..(b + 1) * 24];
            // SAFETY: `blk` is a whole 24-byte block.
            let codes = unsafe { q5_1_codes(blk.as_ptr()) };
            let dw = f16_at(blk, 0);
            let mw = f16_at(blk, 2);
            for (t, a) in acts.iter().enumerate() {
                // SAFETY: 32 codes of block b are inside `a.q` (asserted).
                let x = unsafe { _mm256_loadu_si256(a.q.as_ptr().add(32 * b).cast()) };
                // Pair sums ≤ 2·31·127: no saturation.
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), ones);
                acc[t] += hsum(p) as f32 * (dw * a.d[b]) + mw * a.s[b];
            }
        }
        acc
    }

    /// The 32 unsigned five-bit codes (0..=31) of the Q5_1 block at `blk`, in value order:
    /// the nibbles of bytes 8..24 with bit `j` of the `qh` word at bytes 4..8 as `+16`.
    ///
    /// # Safety
    /// AVX2 must be available; `blk` must point at a whole 24-byte block.
    #[inline(always)]
    unsafe fn q5_1_codes(blk: *const u8) -> __m256i {
        let m4 = _mm_set1_epi8(0x0F);
        // Byte j of the spread: byte j / 8 of qh, tested against bit j % 8.
        let spread = _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
            3, 3, 3,
        );
        let bits = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
        // SAFETY: bytes 4..24 are inside the block.
        let (q, qh) = unsafe {
            (
                _mm_loadu_si128(blk.add(8).cast()),
                blk.add(4).cast::<i32>().read_unaligned(),
            )
        };
        let nib = _mm256_setr_m128i(
            _mm_and_si128(q, m4),
            _mm_and_si128(_mm_srli_epi16(q, 4), m4),
        );
        let h = _mm256_shuffle_epi8(_mm256_set1_epi32(qh), spread);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(h, bits), bits);
        _mm256_or_si256(nib, _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
    }

    /// Q5_1: the eight rows of a group (each `rb` bytes of 24-byte blocks, one after
    /// another in `qs`) · one token. Per block the eight rows' integer sums are reduced
    /// together into one vector and the float step runs as 8-lane separate multiplies and
    /// adds: lane r does exactly [`q5_1_row`]'s (the twin's)
    /// `acc += isum·(dw·dx) + mw·s`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q5_1_group(qs: &[u8], rb: usize, a: &super::QuantizedActs) -> [f32; 8] {
        // SAFETY: the caller's.
        unsafe { q5_1_group_body(qs, rb, a) }
    }

    /// [`q5_1_group`]'s code, compiled into each caller's instruction set (the AVX-512
    /// caller gets sixteen more vector registers for the same instructions).
    ///
    /// # Safety
    /// AVX2, FMA and F16C must be available.
    #[inline(always)]
    pub(super) unsafe fn q5_1_group_body(
        qs: &[u8],
        rb: usize,
        a: &super::QuantizedActs,
    ) -> [f32; 8] {
        let nb = rb / 24;
        assert_eq!(rb, nb * 24);
        assert!(qs.len() >= 8 * rb);
        assert!(a.q.len() >= nb * 32 && a.d.len() >= nb && a.s.len() >= nb);
        let ones = _mm256_set1_epi16(1);
        // The next group starts after eight rows, padded to 64 bytes (`Packed` layout).
        let ahead = (8 * rb).next_multiple_of(64);
        let mut acc = _mm256_setzero_ps();
        for b in 0..nb {
            // SAFETY: block b of every row and of the token is inside the slices (asserted
            // above).
            unsafe {
                let x = _mm256_loadu_si256(a.q.as_ptr().add(32 * b).cast());
                let base = qs.as_ptr().add(24 * b);
                let mut s = [_mm256_setzero_si256(); 8];
                for (r, sr) in s.iter_mut().enumerate() {
                    let blk = base.add(r * rb);
                    // Eight 24-byte-step streams are too many for the hardware
                    // prefetcher: ask for the same place in the next group (a hint;
                    // past the end of the matrix it is dropped).
                    _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(ahead).cast());
                    let codes = q5_1_codes(blk);
                    // Pair sums ≤ 2·31·127: no saturation.
                    *sr = _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), ones);
                }
                let isum = _mm256_cvtepi32_ps(reduce8(&s));
                // The eight rows' (d, m) f16 pairs as dwords, then d and m apart (in
                // registers: a store of eight u16 read back as one vector would stall).
                let dm = _mm256_setr_epi32(
                    base.cast::<i32>().read_unaligned(),
                    base.add(rb).cast::<i32>().read_unaligned(),
                    base.add(2 * rb).cast::<i32>().read_unaligned(),
                    base.add(3 * rb).cast::<i32>().read_unaligned(),
                    base.add(4 * rb).cast::<i32>().read_unaligned(),
                    base.add(5 * rb).cast::<i32>().read_unaligned(),
                    base.add(6 * rb).cast::<i32>().read_unaligned(),
                    base.add(7 * rb).cast::<i32>().read_unaligned(),
                );
                // packus per 128-bit half: [d0..4, m0..4 | d4..8, m4..8] (values ≤ 0xFFFF:
                // no saturation), then the halves' quarters in order.
                let dm = _mm256_permute4x64_epi64(
                    _mm256_packus_epi32(
                        _mm256_and_si256(dm, _mm256_set1_epi32(0xFFFF)),
                        _mm256_srli_epi32(dm, 16),
                    ),
                    0b11_01_10_00,
                );
                let dw = _mm256_cvtph_ps(_mm256_castsi256_si128(dm));
                let mw = _mm256_cvtph_ps(_mm256_extracti128_si256(dm, 1));
                let dx = _mm256_set1_ps(a.d[b]);
                let sx = _mm256_set1_ps(a.s[b]);
                acc = _mm256_add_ps(
                    acc,
                    _mm256_add_ps(
                        _mm256_mul_ps(isum, _mm256_mul_ps(dw, dx)),
                        _mm256_mul_ps(mw, sx),
                    ),
                );
            }
        }
        let mut out = [0.0f32; 8];
        // SAFETY: `out` is 8 floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc) };
        out
    }

    /// Q6_K row · `T` tokens.
    ///
    /// # Safety
    /// AVX2 must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q6_k_row<const T: usize>(row: &[u8], ks: &[&Q8K; T]) -> [f32; T] {
        let nb = row.len() / Q6_K_BYTES;
        assert_eq!(row.len(), nb * Q6_K_BYTES);
        for k in ks {
            assert!(k.q.len() >= nb * QK_K && k.d.len() >= nb && k.bsums.len() >= nb * 16);
        }
        let m4 = _mm256_set1_epi8(0x0F);
        let m30 = _mm256_set1_epi8(0x30);
        let mut acc = [0.0f32; T];
        for b in 0..nb {
            let blk = &row[b * Q6_K_BYTES..(b + 1) * Q6_K_BYTES];
            let sc: [i16; 16] = std::array::from_fn(|k| blk[192 + k] as i8 as i16);
            // codes[4n + t]: values 128n + 32t .. 128n + 32t + 32, unsigned 0..63.
            let mut codes = [_mm256_setzero_si256(); 8];
            for n in 0..2 {
                // SAFETY: ql 64n..64n + 64 and qh 128 + 32n..160 + 32n are inside the
                // 210-byte block.
                let (ql0, ql1, qh) = unsafe {
                    let p = blk.as_ptr();
                    (
                        _mm256_loadu_si256(p.add(64 * n).cast()),
                        _mm256_loadu_si256(p.add(64 * n + 32).cast()),
                        _mm256_loadu_si256(p.add(128 + 32 * n).cast()),
                    )
                };
                // 16-bit shifts move bits across byte edges only outside the 0x30 mask.
                codes[4 * n] = _mm256_or_si256(
                    _mm256_and_si256(ql0, m4),
                    _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30),
                );
                codes[4 * n + 1] = _mm256_or_si256(
                    _mm256_and_si256(ql1, m4),
                    _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30),
                );
                codes[4 * n + 2] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                    _mm256_and_si256(qh, m30),
                );
                codes[4 * n + 3] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                    _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30),
                );
            }
            // Scales of each 32-value run: lanes 0..8 its first 16 values, 8..16 the rest.
            let scv: [__m256i; 8] = std::array::from_fn(|i| {
                _mm256_setr_m128i(_mm_set1_epi16(sc[2 * i]), _mm_set1_epi16(sc[2 * i + 1]))
            });
            let d = f16_at(blk, 208);
            for (t, k) in ks.iter().enumerate() {
                let q8 = k.q[b * QK_K..(b + 1) * QK_K].as_ptr();
                let mut s = _mm256_setzero_si256();
                for i in 0..8 {
                    // SAFETY: 32i .. 32i + 32 is inside the token's 256 codes (asserted).
                    let x = unsafe { _mm256_loadu_si256(q8.add(32 * i).cast()) };
                    // Pair sums ≤ 2·63·128: no saturation.
                    let p = _mm256_maddubs_epi16(codes[i], x);
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(p, scv[i]));
                }
                let bs = &k.bsums[b * 16..(b + 1) * 16];
                let mut off = 0i32;
                for (c, &bsum) in sc.iter().zip(bs) {
                    off += *c as i32 * bsum as i32;
                }
                let isum = hsum(s) - 32 * off;
                acc[t] += isum as f32 * (d * k.d[b]);
            }
        }
        acc
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx512 {
    //! AVX-512 (F + BW) one-token K-quant groups for the `avx512vnni` variant: the AVX2
    //! kernels' integer sums with 64 codes per instruction instead of 32. Integer sums are
    //! exact in any order, and the float steps are the AVX2 kernels' (lane `r` = row `r`,
    //! separate multiplies and adds), so every value is the twin's bit for bit.

    use super::avx2::{k4_group_with, k4_scales_mins, q6_k_group_with};
    use super::Q8K;
    use std::arch::x86_64::*;

    /// `super::avx2::q5_1_group` compiled with AVX-512 VL's 32 vector registers (the
    /// AVX2 code spills with 16): the same instructions, the same values.
    ///
    /// # Safety
    /// AVX-512 F, BW and VL, AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub unsafe fn q5_1_group(qs: &[u8], rb: usize, a: &super::QuantizedActs) -> [f32; 8] {
        // SAFETY: the caller's.
        unsafe { super::avx2::q5_1_group_body(qs, rb, a) }
    }

    /// The i16 scale lanes of one 64-code run starting at sub-block `4h`: lane `q` (the
    /// `vpmaddubsw` pair `2q, 2q + 1`) belongs to sub-block `4h + q / 8`.
    const fn scale_index(h: usize) -> [i16; 32] {
        let mut idx = [0i16; 32];
        let mut q = 0;
        while q < 32 {
            idx[q] = (4 * h + q / 8) as i16;
            q += 1;
        }
        idx
    }

    const SCALE_IDX: [[i16; 32]; 4] = [
        scale_index(0),
        scale_index(1),
        scale_index(2),
        scale_index(3),
    ];

    /// One Q6_K super-block `blk` · the 256 codes at `q8` (`bs`: their 16 bsums): the
    /// integer sum `Σ sc_k · (codes · q8)_k − 32 · Σ sc_k · bsums_k` spread over eight
    /// 32-bit lanes (the same integer as `super::avx2`'s `q6_k_block`).
    ///
    /// # Safety
    /// AVX-512 F and BW and AVX2 must be available; `blk` must point at a whole
    /// super-block, `q8` at 256 codes.
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    #[inline]
    unsafe fn q6_k_block(blk: *const u8, q8: *const i8, bs: __m256i) -> __m256i {
        let m4 = _mm512_set1_epi8(0x0F);
        let m30 = _mm512_set1_epi8(0x30);
        // Shift counts per 256-bit half: codes 0..32 of a 64-code run take qh's bits 0-1
        // (low half) or 2-3 (high half) for the first run, 4-5 or 6-7 for the second.
        let up = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_set1_epi16(4)),
            _mm256_set1_epi16(2),
            1,
        );
        let down = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_setzero_si256()),
            _mm256_set1_epi16(2),
            1,
        );
        // SAFETY: the 16 scale bytes 192..208 are inside the 210-byte block.
        let scb = unsafe { _mm_loadu_si128(blk.add(192).cast()) };
        let sc16 = _mm256_cvtepi8_epi16(scb);
        let off = _mm256_madd_epi16(sc16, bs);
        let s_off = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(off, 5));
        let sc16 = _mm512_castsi256_si512(sc16);
        let mut s = _mm512_setzero_si512();
        for n in 0..2 {
            // SAFETY: ql 64n..64n + 64 and qh 128 + 32n..160 + 32n are inside the block,
            // codes 128n..128n + 128 inside the 256.
            let (ql, qh, x0, x1) = unsafe {
                (
                    _mm512_loadu_si512(blk.add(64 * n).cast()),
                    _mm512_broadcast_i64x4(_mm256_loadu_si256(blk.add(128 + 32 * n).cast())),
                    _mm512_loadu_si512(q8.add(128 * n).cast()),
                    _mm512_loadu_si512(q8.add(128 * n + 64).cast()),
                )
            };
            // Codes 128n .. 128n + 64 (low nibbles) and 128n + 64 .. 128n + 128 (high),
            // unsigned 0..63.
            let c0 = _mm512_or_si512(
                _mm512_and_si512(ql, m4),
                _mm512_and_si512(_mm512_sllv_epi16(qh, up), m30),
            );
            let c1 = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                _mm512_and_si512(_mm512_srlv_epi16(qh, down), m30),
            );
            for (h, (c, x)) in [(c0, x0), (c1, x1)].into_iter().enumerate() {
                // SAFETY: SCALE_IDX rows are 32 i16.
                let idx = unsafe { _mm512_loadu_si512(SCALE_IDX[2 * n + h].as_ptr().cast()) };
                let scv = _mm512_permutexvar_epi16(idx, sc16);
                // Pair sums ≤ 2·63·128: no saturation.
                let p = _mm512_maddubs_epi16(c, x);
                s = _mm512_add_epi32(s, _mm512_madd_epi16(p, scv));
            }
        }
        let folded = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
        _mm256_add_epi32(s_off, folded)
    }

    /// Q6_K: the eight rows of a group · one token, as `super::avx2::q6_k_group` (lane r:
    /// `acc += isum·(d·dx)`).
    ///
    /// # Safety
    /// AVX-512 F and BW, AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub unsafe fn q6_k_group(qs: &[u8], rb: usize, k: &Q8K) -> [f32; 8] {
        // SAFETY: `q6_k_block` needs AVX-512 F/BW, which this function has; the driver
        // passes a whole super-block and 256 codes.
        let block = |blk, q8, bs| unsafe { q6_k_block(blk, q8, bs) };
        // SAFETY: the caller's.
        unsafe { q6_k_group_with(qs, rb, k, block) }
    }

    /// The i16 lanes of a Q4_K/Q5_K 64-code run pair `p` (sub-blocks `4p + o` in the low
    /// half, `4p + o + 2` in the high half; `o` = 0 for low nibbles, 1 for high), as
    /// indices into the 16 i16 of the unpacked scales.
    const fn k4_scale_index(p: usize, o: usize) -> [i16; 32] {
        let mut idx = [0i16; 32];
        let mut q = 0;
        while q < 32 {
            idx[q] = (4 * p + o + if q < 16 { 0 } else { 2 }) as i16;
            q += 1;
        }
        idx
    }

    const K4_SCALE_IDX: [[i16; 32]; 4] = [
        k4_scale_index(0, 0),
        k4_scale_index(0, 1),
        k4_scale_index(1, 0),
        k4_scale_index(1, 1),
    ];

    /// One Q4_K/Q5_K super-block `blk` · the token's codes, already laid out per 64-byte
    /// weight run pair (`x[2p]`: the codes of the low nibbles of weight bytes
    /// `64p..64p + 64`, `x[2p + 1]`: of the high nibbles): the integer sum and `msum` of
    /// `super::avx2`'s `k4_block`, the same integers.
    ///
    /// # Safety
    /// AVX-512 F and BW and AVX2 must be available; `blk` must point at a whole super-block.
    #[target_feature(enable = "avx512f,avx512bw,avx2")]
    #[inline]
    unsafe fn k4_block<const FIVE: bool>(
        blk: *const u8,
        x: &[__m512i; 4],
        bp: __m128i,
    ) -> (__m256i, __m128i) {
        // SAFETY: the caller's (a whole super-block).
        let sm = unsafe { k4_scales_mins(blk) };
        let m = _mm_madd_epi16(_mm256_extracti128_si256(sm, 1), bp);
        let sm = _mm512_castsi256_si512(sm);
        let m4 = _mm512_set1_epi8(0x0F);
        let qs_at = if FIVE { 48 } else { 16 };
        let qh = if FIVE {
            // SAFETY: bytes 16..48 are inside the 176-byte block.
            _mm512_broadcast_i64x4(unsafe { _mm256_loadu_si256(blk.add(16).cast()) })
        } else {
            _mm512_setzero_si512()
        };
        let mut s = _mm512_setzero_si512();
        for p in 0..2 {
            // SAFETY: weight bytes qs_at + 64p .. + 64 are inside the block.
            let w = unsafe { _mm512_loadu_si512(blk.add(qs_at + 64 * p).cast()) };
            let mut lo = _mm512_and_si512(w, m4);
            let mut hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
            if FIVE {
                // Sub-block 2j's fifth bits are bit 2j of qh, 2j + 1's bit 2j + 1; the
                // low half holds j = 2p, the high half j = 2p + 1.
                let bits = |o: u32| {
                    let lo_bit = 1u8 << (4 * p as u32 + o);
                    _mm512_inserti64x4(
                        _mm512_castsi256_si512(_mm256_set1_epi8(lo_bit as i8)),
                        _mm256_set1_epi8((lo_bit << 2) as i8),
                        1,
                    )
                };
                let t16 = _mm512_set1_epi8(0x10);
                lo = _mm512_or_si512(
                    lo,
                    _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(qh, bits(0)), t16),
                );
                hi = _mm512_or_si512(
                    hi,
                    _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(qh, bits(1)), t16),
                );
            }
            // SAFETY: K4_SCALE_IDX rows are 32 i16.
            let (il, ih) = unsafe {
                (
                    _mm512_loadu_si512(K4_SCALE_IDX[2 * p].as_ptr().cast()),
                    _mm512_loadu_si512(K4_SCALE_IDX[2 * p + 1].as_ptr().cast()),
                )
            };
            // Pair sums ≤ 2·31·128: no saturation.
            let pl = _mm512_madd_epi16(
                _mm512_maddubs_epi16(lo, x[2 * p]),
                _mm512_permutexvar_epi16(il, sm),
            );
            let ph = _mm512_madd_epi16(
                _mm512_maddubs_epi16(hi, x[2 * p + 1]),
                _mm512_permutexvar_epi16(ih, sm),
            );
            s = _mm512_add_epi32(s, _mm512_add_epi32(pl, ph));
        }
        let folded = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
        (folded, m)
    }

    /// Q4_K (`FIVE = false`) or Q5_K (`FIVE = true`): the eight rows of a group · one
    /// token, as `super::avx2::k4_group` (lane r: `acc += isum·(d·dx) − msum·(dmin·dx)`).
    ///
    /// # Safety
    /// AVX-512 F and BW, AVX2, FMA and F16C must be available.
    #[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
    pub unsafe fn k4_group<const FIVE: bool>(qs: &[u8], rb: usize, k: &Q8K) -> [f32; 8] {
        // Weight bytes 64p..64p + 64 hold codes 128p + 0..32 and 128p + 64..96 in their low
        // nibbles, 128p + 32..64 and 128p + 96..128 in their high ones.
        let prep = |q8: *const i8| {
            let pair = |a: usize, c: usize| {
                // SAFETY: `q8` points at the token's 256 codes of this super-block.
                unsafe {
                    _mm512_inserti64x4(
                        _mm512_castsi256_si512(_mm256_loadu_si256(q8.add(a).cast())),
                        _mm256_loadu_si256(q8.add(c).cast()),
                        1,
                    )
                }
            };
            [pair(0, 64), pair(32, 96), pair(128, 192), pair(160, 224)]
        };
        // SAFETY: `k4_block` needs AVX-512 F/BW, which this function has; the driver
        // passes a whole super-block.
        let block = |blk, x: &[__m512i; 4], bp| unsafe { k4_block::<FIVE>(blk, x, bp) };
        // SAFETY: the caller's.
        unsafe { k4_group_with::<FIVE, _>(qs, rb, k, prep, block) }
    }
}
