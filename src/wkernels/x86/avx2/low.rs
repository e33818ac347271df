//! AVX2 rows of Q2_K and Q3_K (super-blocks of 256, 2- and 3-bit codes in sub-blocks of
//! 16) against Q8_K activations: the 64 code bytes as two vectors, each 2-bit field shifted
//! down and masked (plus Q3_K's `hmask` bit as `+4`, so the codes are unsigned `0..=7`),
//! `vpmaddubsw` with the signed activation codes, `vpmaddwd` with the sub-block scales
//! (lanes 0–7 one sub-block of 16, lanes 8–15 the next), summed in 32-bit lanes. Q2_K's
//! mins come in as `Σ_k m_k · bsums_k`, Q3_K's `−4` as `−4 · Σ_k s_k · bsums_k`: the same
//! integers as the scalar twins; the float steps in scalar f32 (separate multiply and add).
//! One row against `T` tokens, each super-block unpacked once for all of them.

use super::super::{f16_at, hsum};
use crate::wkernels::blocks::{q3_k_scale_bytes, Q2_K_BYTES, Q3_K_BYTES, QK_K};
use crate::wkernels::Q8K;
use std::arch::x86_64::*;

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
