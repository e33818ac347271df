//! Q2_K and Q3_K weights (super-blocks of 256, 2- and 3-bit codes in sub-blocks of 16)
//! multiplied natively against Q8_K activations: the row kernels [`super::kquant`]
//! dispatches to for these two types (same whole-row layout, same callers).
//!
//! Numerics are exactly those of `tinygpt_reference::ggml_kdot::{dot_q2_k, dot_q3_k}`
//! (read its header; also docs/design.md §2.2): per weight super-block exact integer sums,
//! then one row accumulator updated with separate f32 multiplies and adds
//! (Q2_K: `acc += isum·(d_w·d_x) − msum·(dmin_w·d_x)`, Q3_K: `acc += isum·(d_w·d_x)`).
//! Every variant equals the twin bit for bit (`tests/kquant_dispatch.rs`).
//!
//! # Variants
//!
//! * `scalar`: the twin's loops per row;
//! * `avx2` (and `avx512vnni`, which runs the AVX2 code for these types): the 64 code
//!   bytes as two vectors, each 2-bit field shifted down and masked (plus Q3_K's `hmask`
//!   bit as `+4`, so the codes are unsigned `0..=7`), `vpmaddubsw` with the signed
//!   activation codes, `vpmaddwd` with the sub-block scales (lanes 0–7 one sub-block of
//!   16, lanes 8–15 the next), summed in 32-bit lanes. Q2_K's mins come in as
//!   `Σ_k m_k · bsums_k`, Q3_K's `−4` as `−4 · Σ_k s_k · bsums_k`: the same integers;
//! * `neon-dotprod`: each super-block unpacked once into 16 vectors of signed bytes, one
//!   per sub-block of 16 (Q2_K's codes `0..=3`; Q3_K's codes directly signed, `−4..=3`:
//!   the 2-bit code minus 4 where the `hmask` bit is clear), one `sdot` per sub-block and
//!   token, pairwise adds to one 32-bit sum per sub-block, the scales multiplied in
//!   32-bit lanes. Q2_K's mins come in as `Σ_k m_k · bsums_k` (widening 16-bit
//!   multiplies); Q3_K needs no block sums. The same integers as the twin;
//! * `portable`: in `super::kquant_portable` (on `wide`, with the other K-quants).
//!
//! The multi-token form unpacks each weight super-block once for `T` tokens; every
//! token's value is the one-token value, bit for bit.

use super::qdot::Kernel;
use crate::dtype::DType;
use tinygpt_reference::ggml_kdot::{self, Q8K};

/// Whether `dtype` is one of this module's types.
pub fn is_low(dtype: DType) -> bool {
    matches!(dtype, DType::Q2_K | DType::Q3_K)
}

/// Whether `kernel` runs this module's NEON + dot-product rows here.
#[cfg(target_arch = "aarch64")]
fn use_neon(kernel: Kernel) -> bool {
    kernel == Kernel::NeonDotprod && kernel.is_supported()
}

/// One Q2_K or Q3_K row against `T` tokens' Q8_K activations (each token with as many
/// super-blocks as the row: checked by the callers, and again by the kernels).
#[inline]
pub fn row_dots<const T: usize>(
    kernel: Kernel,
    dtype: DType,
    row: &[u8],
    ks: &[&Q8K; T],
) -> [f32; T] {
    debug_assert!(is_low(dtype));
    #[cfg(target_arch = "x86_64")]
    if matches!(kernel, Kernel::Avx2 | Kernel::Avx512Vnni) && Kernel::Avx2.is_supported() {
        // SAFETY: AVX2 (with FMA and F16C) was detected at run time just above; the
        // kernels assert the row and activation lengths.
        return unsafe {
            if dtype == DType::Q2_K {
                avx2::q2_k_row::<T>(row, ks)
            } else {
                avx2::q3_k_row::<T>(row, ks)
            }
        };
    }
    #[cfg(target_arch = "aarch64")]
    if use_neon(kernel) {
        // SAFETY: `dotprod` was detected at run time in `use_neon` (NEON is baseline); the
        // kernels assert the row and activation lengths.
        return unsafe {
            if dtype == DType::Q2_K {
                neon::q2_k_row::<T>(row, ks)
            } else {
                neon::q3_k_row::<T>(row, ks)
            }
        };
    }
    let _ = kernel;
    std::array::from_fn(|t| {
        if dtype == DType::Q2_K {
            ggml_kdot::dot_q2_k(row, ks[t])
        } else {
            ggml_kdot::dot_q3_k(row, ks[t])
        }
    })
}

/// The 16 Q3_K scales `s_k + 32` (bytes `0..=63`) from the 12 packed bytes, four at a
/// time as ggml's `kmask` unpacking does (the same values as `ggml_more::q3_k_scales`,
/// without its per-scale branches); shared by the AVX2 and NEON rows.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
fn q3_k_scale_bytes(s: &[u8]) -> [u8; 16] {
    let w = |i: usize| u32::from_le_bytes([s[i], s[i + 1], s[i + 2], s[i + 3]]);
    let (a0, a1, h) = (w(0), w(4), w(8));
    let (lo, hi) = (0x0F0F_0F0Fu32, 0x0303_0303u32);
    let r = [
        (a0 & lo) | ((h & hi) << 4),
        (a1 & lo) | (((h >> 2) & hi) << 4),
        ((a0 >> 4) & lo) | (((h >> 4) & hi) << 4),
        ((a1 >> 4) & lo) | (((h >> 6) & hi) << 4),
    ];
    let mut out = [0u8; 16];
    for (o, v) in out.chunks_exact_mut(4).zip(r) {
        o.copy_from_slice(&v.to_le_bytes());
    }
    out
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! AVX2 Q2_K / Q3_K rows: integer sums in 32-bit lanes, reduced once per
    //! super-block, then the twin's float steps in scalar f32 (separate multiply and add).

    use super::super::kquant::avx2::{f16_at, hsum};
    use super::{q3_k_scale_bytes, Q8K};
    use std::arch::x86_64::*;
    use tinygpt_reference::ggml_kdot::{Q2_K_BYTES, Q3_K_BYTES};
    use tinygpt_reference::ggml_more::QK_K;

    /// `Σ_k w_k · bsums[k]` over a super-block's 16 block sums as eight 32-bit lanes
    /// (`|w_k| ≤ 128`, `|bsums[k]| ≤ 2048`: exact).
    ///
    /// # Safety
    /// AVX2 must be available; `bs` holds at least 16 sums.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn bsums_dot(bs: &[i16], w: __m256i) -> __m256i {
        assert!(bs.len() >= 16);
        // SAFETY: 16 i16 = 32 bytes are inside `bs` (asserted).
        let b = unsafe { _mm256_loadu_si256(bs.as_ptr().cast()) };
        _mm256_madd_epi16(b, w)
    }

    /// The eight 32-value runs of a super-block's 2-bit codes (`qs`: 64 bytes), unsigned:
    /// run `4n + j` is bits `2j..2j + 2` of bytes `32n..32n + 32`.
    ///
    /// # Safety
    /// AVX2 must be available; `qs` holds at least 64 bytes.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn two_bit_runs(qs: &[u8]) -> [__m256i; 8] {
        assert!(qs.len() >= 64);
        let m3 = _mm256_set1_epi8(3);
        let mut out = [_mm256_setzero_si256(); 8];
        for n in 0..2 {
            // SAFETY: bytes 32n..32n + 32 are inside `qs` (asserted).
            let q = unsafe { _mm256_loadu_si256(qs.as_ptr().add(32 * n).cast()) };
            // 16-bit shifts by ≤ 6 move bits across byte edges only above the mask.
            out[4 * n] = _mm256_and_si256(q, m3);
            out[4 * n + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 2), m3);
            out[4 * n + 2] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m3);
            out[4 * n + 3] = _mm256_and_si256(_mm256_srli_epi16(q, 6), m3);
        }
        out
    }

    /// Scale vectors of the eight runs: lanes 0..8 the first sub-block of 16, 8..16 the
    /// second.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn run_scales(sc: &[i16; 16]) -> [__m256i; 8] {
        std::array::from_fn(|i| {
            _mm256_setr_m128i(_mm_set1_epi16(sc[2 * i]), _mm_set1_epi16(sc[2 * i + 1]))
        })
    }

    /// `Σ_i runs[i] · q8[32i..32i + 32]`, each pair of 16-bit products weighted by its
    /// sub-block's scale, as eight 32-bit lanes.
    ///
    /// # Safety
    /// AVX2 must be available; `q8` points at 256 readable codes.
    #[target_feature(enable = "avx2")]
    #[inline]
    unsafe fn weighted(runs: &[__m256i; 8], scv: &[__m256i; 8], q8: *const i8) -> __m256i {
        let mut s = _mm256_setzero_si256();
        for i in 0..8 {
            // SAFETY: 32i .. 32i + 32 is inside the 256 codes (the caller's contract).
            let x = unsafe { _mm256_loadu_si256(q8.add(32 * i).cast()) };
            // Codes ≤ 7: pair sums ≤ 2·7·128, no saturation.
            let p = _mm256_maddubs_epi16(runs[i], x);
            s = _mm256_add_epi32(s, _mm256_madd_epi16(p, scv[i]));
        }
        s
    }

    /// Q2_K row · `T` tokens.
    ///
    /// # Safety
    /// AVX2 must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q2_k_row<const T: usize>(row: &[u8], ks: &[&Q8K; T]) -> [f32; T] {
        let nb = row.len() / Q2_K_BYTES;
        assert_eq!(row.len(), nb * Q2_K_BYTES);
        for k in ks {
            assert!(k.q.len() >= nb * QK_K && k.d.len() >= nb && k.bsums.len() >= nb * 16);
        }
        let mut acc = [0.0f32; T];
        for b in 0..nb {
            let blk = &row[b * Q2_K_BYTES..(b + 1) * Q2_K_BYTES];
            // SAFETY: bytes 16..80 are the 64 code bytes.
            let runs = unsafe { two_bit_runs(&blk[16..80]) };
            let sc: [i16; 16] = std::array::from_fn(|k| (blk[k] & 0x0F) as i16);
            let scv = run_scales(&sc);
            let mins: [i16; 16] = std::array::from_fn(|k| (blk[k] >> 4) as i16);
            // SAFETY: 16 i16 = 32 bytes.
            let minv = unsafe { _mm256_loadu_si256(mins.as_ptr().cast()) };
            let (d, dmin) = (f16_at(blk, 80), f16_at(blk, 82));
            for (t, k) in ks.iter().enumerate() {
                // SAFETY: the token holds nb·256 codes and nb·16 sums (asserted).
                let (s, m) = unsafe {
                    (
                        weighted(&runs, &scv, k.q[b * QK_K..].as_ptr()),
                        bsums_dot(&k.bsums[b * 16..], minv),
                    )
                };
                let msum = hsum(m);
                let dx = k.d[b];
                acc[t] += hsum(s) as f32 * (d * dx) - msum as f32 * (dmin * dx);
            }
        }
        acc
    }

    /// Q3_K row · `T` tokens: codes `+ 4` (unsigned `0..=7`), the offset removed as
    /// `−4 · Σ_k s_k · bsums_k`.
    ///
    /// # Safety
    /// AVX2 must be available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q3_k_row<const T: usize>(row: &[u8], ks: &[&Q8K; T]) -> [f32; T] {
        let nb = row.len() / Q3_K_BYTES;
        assert_eq!(row.len(), nb * Q3_K_BYTES);
        for k in ks {
            assert!(k.q.len() >= nb * QK_K && k.d.len() >= nb && k.bsums.len() >= nb * 16);
        }
        let mut acc = [0.0f32; T];
        for b in 0..nb {
            let blk = &row[b * Q3_K_BYTES..(b + 1) * Q3_K_BYTES];
            // SAFETY: bytes 32..96 are the 64 code bytes.
            let mut runs = unsafe { two_bit_runs(&blk[32..96]) };
            // SAFETY: bytes 0..32 (hmask) are inside the 110-byte block.
            let hm = unsafe { _mm256_loadu_si256(blk.as_ptr().cast()) };
            for (m, r) in runs.iter_mut().enumerate() {
                // Run m = 4n + j takes bit m of hmask[l]: set means no −4, i.e. +4 here.
                let bit = _mm256_set1_epi8((1u8 << m) as i8);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
                *r = _mm256_or_si256(*r, _mm256_and_si256(set, _mm256_set1_epi8(4)));
            }
            let sb = q3_k_scale_bytes(&blk[96..108]);
            let sc: [i16; 16] = std::array::from_fn(|k| sb[k] as i16 - 32);
            let scv = run_scales(&sc);
            // 4·s_k, for the offset term −4·Σ_k s_k·bsums[k] (|4·s_k| ≤ 128).
            let sc4: [i16; 16] = std::array::from_fn(|k| 4 * sc[k]);
            // SAFETY: 16 i16 = 32 bytes.
            let sc4v = unsafe { _mm256_loadu_si256(sc4.as_ptr().cast()) };
            let d = f16_at(blk, 108);
            for (t, k) in ks.iter().enumerate() {
                // SAFETY: the token holds nb·256 codes and nb·16 sums (asserted).
                let (s, off) = unsafe {
                    (
                        weighted(&runs, &scv, k.q[b * QK_K..].as_ptr()),
                        bsums_dot(&k.bsums[b * 16..], sc4v),
                    )
                };
                // Exact: every lane and the total stay far inside i32.
                let isum = hsum(_mm256_sub_epi32(s, off));
                acc[t] += isum as f32 * (d * k.d[b]);
            }
        }
        acc
    }
}

#[cfg(target_arch = "aarch64")]
pub(super) mod neon {
    //! NEON + dot-product (`sdot`) Q2_K / Q3_K rows: each weight super-block unpacked once
    //! into 16 vectors of signed bytes (`w[k]`: sub-block `k`, values `16k..16k + 16`),
    //! one `sdot` per sub-block and token, pairwise adds to one 32-bit sum per sub-block,
    //! the scales applied in 32-bit lanes, one horizontal add; then the twin's float
    //! steps in scalar f32 (separate multiply and add).

    use super::super::aarch64::sdot;
    use super::super::kquant_neon::{f16_at, fold4, lanes};
    use super::{q3_k_scale_bytes, Q8K};
    use std::arch::aarch64::*;
    use tinygpt_reference::ggml_kdot::{Q2_K_BYTES, Q3_K_BYTES};
    use tinygpt_reference::ggml_more::QK_K;

    /// The 2-bit codes of a super-block (`qs`: 64 bytes) as 16 vectors of bytes `0..=3`:
    /// `[8n + 2j + h]` holds bits `2j..2j + 2` of bytes `32n + 16h .. 32n + 16h + 16`, the
    /// values `128n + 32j + 16h ..` (sub-block `8n + 2j + h`).
    #[target_feature(enable = "neon")]
    #[inline]
    fn two_bit_subblocks(qs: &[u8]) -> [uint8x16_t; 16] {
        assert!(qs.len() >= 64);
        let m3 = vdupq_n_u8(3);
        let mut out = [vdupq_n_u8(0); 16];
        for n in 0..2 {
            for h in 0..2 {
                // SAFETY: bytes 32n + 16h .. + 16 are inside `qs` (asserted).
                let q = unsafe { vld1q_u8(qs.as_ptr().add(32 * n + 16 * h)) };
                out[8 * n + h] = vandq_u8(q, m3);
                out[8 * n + 2 + h] = vandq_u8(vshrq_n_u8::<2>(q), m3);
                out[8 * n + 4 + h] = vandq_u8(vshrq_n_u8::<4>(q), m3);
                out[8 * n + 6 + h] = vshrq_n_u8::<6>(q);
            }
        }
        out
    }

    /// `Σ_k sc[k] · (w[k] · q8[16k..16k + 16])` over the 16 sub-blocks (exact in `i32`:
    /// `|code| ≤ 4`, `|scale| ≤ 32`, `|q8| ≤ 128`).
    ///
    /// # Safety
    /// NEON and `dotprod` must be available; `q8` points at 256 readable codes.
    #[target_feature(enable = "neon,dotprod")]
    #[inline]
    unsafe fn weighted(w: &[int8x16_t; 16], scv: &[int32x4_t; 4], q8: *const i8) -> i32 {
        let z = vdupq_n_s32(0);
        let mut s = z;
        for (i, sc) in scv.iter().enumerate() {
            let p: [int32x4_t; 4] = std::array::from_fn(|l| {
                // SAFETY: 64i + 16l .. + 16 is inside the 256 codes (the caller's contract).
                let x = unsafe { vld1q_s8(q8.add(64 * i + 16 * l)) };
                sdot(z, w[4 * i + l], x)
            });
            s = vmlaq_s32(s, fold4(p), *sc);
        }
        vaddvq_s32(s)
    }

    /// The 16 sub-block scales as four vectors of 32-bit lanes.
    #[target_feature(enable = "neon")]
    #[inline]
    fn scale_lanes(sc: &[i32; 16]) -> [int32x4_t; 4] {
        std::array::from_fn(|i| lanes([sc[4 * i], sc[4 * i + 1], sc[4 * i + 2], sc[4 * i + 3]]))
    }

    /// Q2_K row · `T` tokens: unsigned codes `0..=3` as signed bytes, the mins as
    /// `Σ_k m_k · bsums_k` (widening 16-bit multiplies, exact).
    ///
    /// # Safety
    /// NEON and `dotprod` must be available.
    #[target_feature(enable = "neon,dotprod")]
    pub unsafe fn q2_k_row<const T: usize>(row: &[u8], ks: &[&Q8K; T]) -> [f32; T] {
        let nb = row.len() / Q2_K_BYTES;
        assert_eq!(row.len(), nb * Q2_K_BYTES);
        for k in ks {
            assert!(k.q.len() >= nb * QK_K && k.d.len() >= nb && k.bsums.len() >= nb * 16);
        }
        let mut acc = [0.0f32; T];
        for b in 0..nb {
            let blk = &row[b * Q2_K_BYTES..(b + 1) * Q2_K_BYTES];
            let w = two_bit_subblocks(&blk[16..80]).map(|v| vreinterpretq_s8_u8(v));
            let sc: [i32; 16] = std::array::from_fn(|k| (blk[k] & 0x0F) as i32);
            let scv = scale_lanes(&sc);
            let mins: [i16; 16] = std::array::from_fn(|k| (blk[k] >> 4) as i16);
            // SAFETY: `mins` is 16 i16s.
            let (m0, m1) = unsafe { (vld1q_s16(mins.as_ptr()), vld1q_s16(mins.as_ptr().add(8))) };
            let (d, dmin) = (f16_at(blk, 80), f16_at(blk, 82));
            for (t, k) in ks.iter().enumerate() {
                // SAFETY: the token holds nb·256 codes (asserted).
                let isum = unsafe { weighted(&w, &scv, k.q[b * QK_K..].as_ptr()) };
                let bs = k.bsums[b * 16..(b + 1) * 16].as_ptr();
                // SAFETY: 16 i16s of the token's bsums for block b (asserted).
                let (b0, b1) = unsafe { (vld1q_s16(bs), vld1q_s16(bs.add(8))) };
                // |m_k · bsums_k| ≤ 15 · 2048 and 16 of them: exact in 32-bit lanes.
                let mw = vmlal_high_s16(vmull_s16(vget_low_s16(b0), vget_low_s16(m0)), b0, m0);
                let mw = vmlal_high_s16(vmlal_s16(mw, vget_low_s16(b1), vget_low_s16(m1)), b1, m1);
                let msum = vaddvq_s32(mw);
                let dx = k.d[b];
                acc[t] += isum as f32 * (d * dx) - msum as f32 * (dmin * dx);
            }
        }
        acc
    }

    /// Q3_K row · `T` tokens: the signed codes `−4..=3` directly (the 2-bit code minus 4
    /// where the `hmask` bit is clear), signed × signed `sdot`; no block sums.
    ///
    /// # Safety
    /// NEON and `dotprod` must be available.
    #[target_feature(enable = "neon,dotprod")]
    pub unsafe fn q3_k_row<const T: usize>(row: &[u8], ks: &[&Q8K; T]) -> [f32; T] {
        let nb = row.len() / Q3_K_BYTES;
        assert_eq!(row.len(), nb * Q3_K_BYTES);
        for k in ks {
            assert!(k.q.len() >= nb * QK_K && k.d.len() >= nb);
        }
        let four = vdupq_n_u8(4);
        let mut acc = [0.0f32; T];
        for b in 0..nb {
            let blk = &row[b * Q3_K_BYTES..(b + 1) * Q3_K_BYTES];
            let low = two_bit_subblocks(&blk[32..96]);
            // SAFETY: bytes 0..32 (hmask) are inside the 110-byte block.
            let hm = unsafe { [vld1q_u8(blk.as_ptr()), vld1q_u8(blk.as_ptr().add(16))] };
            // Sub-block 8n + 2j + h takes bit 4n + j of hmask[16h + l]: clear means −4.
            let w: [int8x16_t; 16] = std::array::from_fn(|k| {
                let (n, j, h) = (k / 8, (k % 8) / 2, k % 2);
                let set = vtstq_u8(hm[h], vdupq_n_u8(1u8 << (4 * n + j)));
                // Wrapping byte subtraction: the two's-complement signed code.
                vreinterpretq_s8_u8(vsubq_u8(low[k], vbicq_u8(four, set)))
            });
            let sb = q3_k_scale_bytes(&blk[96..108]);
            let scv = scale_lanes(&std::array::from_fn(|k| sb[k] as i32 - 32));
            let d = f16_at(blk, 108);
            for (t, k) in ks.iter().enumerate() {
                // SAFETY: the token holds nb·256 codes (asserted).
                let isum = unsafe { weighted(&w, &scv, k.q[b * QK_K..].as_ptr()) };
                acc[t] += isum as f32 * (d * k.d[b]);
            }
        }
        acc
    }
}
