//! NEON + dot-product (`sdot`) rows of Q2_K and Q3_K: each weight super-block unpacked
//! once into 16 vectors of signed bytes (`w[k]`: sub-block `k`, values `16k..16k + 16`;
//! Q2_K's codes `0..=3`, Q3_K's directly signed, `−4..=3`: the 2-bit code minus 4 where
//! the `hmask` bit is clear), one `sdot` per sub-block and token, pairwise adds to one
//! 32-bit sum per sub-block, the scales applied in 32-bit lanes, one horizontal add; then
//! the twin's float steps in scalar f32 (separate multiply and add). Q2_K's mins come in
//! as `Σ_k m_k · bsums_k` (widening 16-bit multiplies); Q3_K needs no block sums.

use super::{f16_at, fold4, lanes, sdot};
use crate::wkernels::blocks::{q3_k_scale_bytes, Q2_K_BYTES, Q3_K_BYTES, QK_K};
use crate::wkernels::Q8K;
use std::arch::aarch64::*;

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
