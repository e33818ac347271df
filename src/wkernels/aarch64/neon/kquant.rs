//! NEON + dot-product (`sdot`) rows of the whole-row types: Q4_K, Q5_K, Q6_K and IQ4_XS
//! against Q8_K activations, Q5_1 against the 8-bit blocks of 32.
//!
//! Every weight super-block (block) is unpacked once into signed bytes in value order —
//! Q4_K's nibbles, Q5_K's nibbles topped by their fifth bit, Q6_K's six-bit codes minus 32
//! (in `[−32, 31]`), IQ4_XS's levels looked up with `tbl`, Q5_1's five-bit codes — and
//! then meets each of the `T` tokens' activation codes in `sdot`s (four-product sums in
//! 32-bit lanes). Pairwise adds fold the lanes into one 32-bit sum per sub-block; the
//! sub-block scales multiply those sums in 32-bit lanes and one horizontal add gives the
//! super-block's integer sum. All of this is integer arithmetic whose every partial sum
//! fits an `i32` (bounds in `tinygpt_reference::ggml_kdot`'s header), so the sums equal
//! the scalar twin's exactly whatever the order. The float steps then run in scalar f32,
//! separate multiplies and adds in the twin's order (Rust never fuses them): each value
//! equals `ggml_kdot::dot_q4_k` / `dot_q5_k` / `dot_q6_k` / `dot_iq4_xs` /
//! `ggml_dot::dot_q5_1` bit for bit (`tests/kquant_dispatch.rs`, run under qemu by
//! `scripts/test-aarch64.sh`).
//!
//! Q6_K subtracts its 32 from the codes before the products (`(q − 32) · x` exactly as the
//! twin writes it), so it needs no activation block sums.

use super::{f16_at, fold4, lanes, sdot};
use crate::wkernels::blocks::{
    iq4_xs_scale, scale_min_k4, IQ4_VALUES, IQ4_XS_BYTES, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, QK_K,
};
use crate::wkernels::{QuantizedActs, Q8K};
use std::arch::aarch64::*;

/// Q4_K (`FIVE = false`) or Q5_K (`FIVE = true`) row · `T` tokens.
///
/// # Safety
/// NEON and `dotprod` must be available.
#[target_feature(enable = "neon,dotprod")]
pub unsafe fn k4_row<const T: usize, const FIVE: bool>(row: &[u8], ks: &[&Q8K; T]) -> [f32; T] {
    let bytes = if FIVE { Q5_K_BYTES } else { Q4_K_BYTES };
    let qs_at = if FIVE { 48 } else { 16 };
    let nb = row.len() / bytes;
    assert_eq!(row.len(), nb * bytes);
    for k in ks {
        assert!(k.q.len() >= nb * QK_K && k.d.len() >= nb && k.bsums.len() >= nb * 16);
    }
    let m4 = vdupq_n_u8(0x0F);
    let m10 = vdupq_n_u8(0x10);
    let mut acc = [0.0f32; T];
    for b in 0..nb {
        let blk = &row[b * bytes..(b + 1) * bytes];
        let mut sc = [0i32; 8];
        let mut mn = [0i16; 8];
        for j in 0..8 {
            let (s, m) = scale_min_k4(j, &blk[4..16]);
            sc[j] = s as i32;
            mn[j] = m as i16;
        }
        let (sc_lo, sc_hi) = (
            lanes([sc[0], sc[1], sc[2], sc[3]]),
            lanes([sc[4], sc[5], sc[6], sc[7]]),
        );
        // SAFETY: `mn` is eight i16s.
        let mnv = unsafe { vld1q_s16(mn.as_ptr()) };
        // w[2j + h]: sub-block j's values 16h .. 16h + 16 (j 0..8, h 0..2).
        let mut w = [vdupq_n_s8(0); 16];
        // SAFETY: bytes 16..48 (Q5_K's qh) are inside the 176-byte block.
        let qh = if FIVE {
            unsafe {
                [
                    vld1q_u8(blk.as_ptr().add(16)),
                    vld1q_u8(blk.as_ptr().add(32)),
                ]
            }
        } else {
            [vdupq_n_u8(0); 2]
        };
        for i in 0..4 {
            for h in 0..2 {
                // SAFETY: bytes qs_at + 32i + 16h .. + 16 are inside the block.
                let v = unsafe { vld1q_u8(blk.as_ptr().add(qs_at + 32 * i + 16 * h)) };
                let mut lo = vandq_u8(v, m4);
                let mut hi = vshrq_n_u8::<4>(v);
                if FIVE {
                    // Bit 2i of qh[l] tops value 64i + l, bit 2i + 1 value 64i + 32 + l:
                    // shifted to bit 4 (a negative count shifts right).
                    let up = |bit: i32| vandq_u8(vshlq_u8(qh[h], vdupq_n_s8((4 - bit) as i8)), m10);
                    lo = vorrq_u8(lo, up(2 * i as i32));
                    hi = vorrq_u8(hi, up(2 * i as i32 + 1));
                }
                w[4 * i + h] = vreinterpretq_s8_u8(lo);
                w[4 * i + 2 + h] = vreinterpretq_s8_u8(hi);
            }
        }
        let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
        for (t, k) in ks.iter().enumerate() {
            let q8 = k.q[b * QK_K..(b + 1) * QK_K].as_ptr();
            let z = vdupq_n_s32(0);
            let mut p = [z; 8];
            for (j, pj) in p.iter_mut().enumerate() {
                // SAFETY: 32j .. 32j + 32 is inside the token's 256 codes (asserted).
                let (x0, x1) = unsafe { (vld1q_s8(q8.add(32 * j)), vld1q_s8(q8.add(32 * j + 16))) };
                *pj = sdot(sdot(z, w[2 * j], x0), w[2 * j + 1], x1);
            }
            let s_lo = fold4([p[0], p[1], p[2], p[3]]);
            let s_hi = fold4([p[4], p[5], p[6], p[7]]);
            let isum = vaddvq_s32(vmlaq_s32(vmulq_s32(s_lo, sc_lo), s_hi, sc_hi));
            // msum = Σ_j m_j · (bsums[2j] + bsums[2j + 1]); pair sums ≤ 2·16·128 fit i16.
            let bs = k.bsums[b * 16..(b + 1) * 16].as_ptr();
            // SAFETY: 16 i16s of the token's bsums for block b (asserted).
            let (b0, b1) = unsafe { (vld1q_s16(bs), vld1q_s16(bs.add(8))) };
            let pairs = vpaddq_s16(b0, b1);
            let mw = vmlal_high_s16(
                vmull_s16(vget_low_s16(pairs), vget_low_s16(mnv)),
                pairs,
                mnv,
            );
            let msum = vaddvq_s32(mw);
            let dx = k.d[b];
            acc[t] += isum as f32 * (d * dx) - msum as f32 * (dmin * dx);
        }
    }
    acc
}

/// IQ4_XS row · `T` tokens: the levels looked up with `tbl` (signed bytes), signed ×
/// signed `sdot` with the activation codes.
///
/// # Safety
/// NEON and `dotprod` must be available.
#[target_feature(enable = "neon,dotprod")]
pub unsafe fn iq4_xs_row<const T: usize>(row: &[u8], ks: &[&Q8K; T]) -> [f32; T] {
    let nb = row.len() / IQ4_XS_BYTES;
    assert_eq!(row.len(), nb * IQ4_XS_BYTES);
    for k in ks {
        assert!(k.q.len() >= nb * QK_K && k.d.len() >= nb);
    }
    let m4 = vdupq_n_u8(0x0F);
    // SAFETY: IQ4_VALUES is 16 bytes.
    let table = unsafe { vld1q_s8(IQ4_VALUES.as_ptr()) };
    let mut acc = [0.0f32; T];
    for b in 0..nb {
        let blk = &row[b * IQ4_XS_BYTES..(b + 1) * IQ4_XS_BYTES];
        // w[2ib + h]: sub-block ib's values 16h .. 16h + 16.
        let mut w = [vdupq_n_s8(0); 16];
        for ib in 0..8 {
            // SAFETY: bytes 8 + 16ib .. 24 + 16ib are inside the 136-byte block.
            let q = unsafe { vld1q_u8(blk.as_ptr().add(8 + 16 * ib)) };
            w[2 * ib] = vqtbl1q_s8(table, vandq_u8(q, m4));
            w[2 * ib + 1] = vqtbl1q_s8(table, vshrq_n_u8::<4>(q));
        }
        let sc: [i32; 8] = std::array::from_fn(|ib| iq4_xs_scale(blk, ib) - 32);
        let (sc_lo, sc_hi) = (
            lanes([sc[0], sc[1], sc[2], sc[3]]),
            lanes([sc[4], sc[5], sc[6], sc[7]]),
        );
        let d = f16_at(blk, 0);
        for (t, k) in ks.iter().enumerate() {
            let q8 = k.q[b * QK_K..(b + 1) * QK_K].as_ptr();
            let z = vdupq_n_s32(0);
            let mut p = [z; 8];
            for (ib, pi) in p.iter_mut().enumerate() {
                // SAFETY: 32ib .. 32ib + 32 is inside the token's 256 codes (asserted).
                let (x0, x1) =
                    unsafe { (vld1q_s8(q8.add(32 * ib)), vld1q_s8(q8.add(32 * ib + 16))) };
                *pi = sdot(sdot(z, w[2 * ib], x0), w[2 * ib + 1], x1);
            }
            let s_lo = fold4([p[0], p[1], p[2], p[3]]);
            let s_hi = fold4([p[4], p[5], p[6], p[7]]);
            let isum = vaddvq_s32(vmlaq_s32(vmulq_s32(s_lo, sc_lo), s_hi, sc_hi));
            acc[t] += isum as f32 * (d * k.d[b]);
        }
    }
    acc
}

/// Q6_K row · `T` tokens.
///
/// # Safety
/// NEON and `dotprod` must be available.
#[target_feature(enable = "neon,dotprod")]
pub unsafe fn q6_k_row<const T: usize>(row: &[u8], ks: &[&Q8K; T]) -> [f32; T] {
    let nb = row.len() / Q6_K_BYTES;
    assert_eq!(row.len(), nb * Q6_K_BYTES);
    for k in ks {
        assert!(k.q.len() >= nb * QK_K && k.d.len() >= nb);
    }
    let m4 = vdupq_n_u8(0x0F);
    let m30 = vdupq_n_u8(0x30);
    let m32 = vdupq_n_s8(32);
    let mut acc = [0.0f32; T];
    for b in 0..nb {
        let blk = &row[b * Q6_K_BYTES..(b + 1) * Q6_K_BYTES];
        // w[k]: sub-block k's 16 codes minus 32 (values 16k .. 16k + 16).
        let mut w = [vdupq_n_s8(0); 16];
        for n in 0..2 {
            for h in 0..2 {
                // SAFETY: ql bytes 64n + 16h (+32) .. + 16 and qh bytes 128 + 32n + 16h
                // .. + 16 are inside the 210-byte block.
                let (qa, qb, qh) = unsafe {
                    let p = blk.as_ptr();
                    (
                        vld1q_u8(p.add(64 * n + 16 * h)),
                        vld1q_u8(p.add(64 * n + 32 + 16 * h)),
                        vld1q_u8(p.add(128 + 32 * n + 16 * h)),
                    )
                };
                // Values 128n + 32m + 16h + l, m = 0..4: sub-block 8n + 2m + h.
                let codes = [
                    vorrq_u8(vandq_u8(qa, m4), vandq_u8(vshlq_n_u8::<4>(qh), m30)),
                    vorrq_u8(vandq_u8(qb, m4), vandq_u8(vshlq_n_u8::<2>(qh), m30)),
                    vorrq_u8(vshrq_n_u8::<4>(qa), vandq_u8(qh, m30)),
                    vorrq_u8(vshrq_n_u8::<4>(qb), vandq_u8(vshrq_n_u8::<2>(qh), m30)),
                ];
                for (m, c) in codes.into_iter().enumerate() {
                    w[8 * n + 2 * m + h] = vsubq_s8(vreinterpretq_s8_u8(c), m32);
                }
            }
        }
        let scv: [int32x4_t; 4] = std::array::from_fn(|i| {
            lanes(std::array::from_fn(|l| blk[192 + 4 * i + l] as i8 as i32))
        });
        let d = f16_at(blk, 208);
        for (t, k) in ks.iter().enumerate() {
            let q8 = k.q[b * QK_K..(b + 1) * QK_K].as_ptr();
            let z = vdupq_n_s32(0);
            let mut s = z;
            for (i, sc) in scv.iter().enumerate() {
                // SAFETY: 64i .. 64i + 64 is inside the token's 256 codes (asserted).
                let p: [int32x4_t; 4] = std::array::from_fn(|l| {
                    let x = unsafe { vld1q_s8(q8.add(64 * i + 16 * l)) };
                    sdot(z, w[4 * i + l], x)
                });
                s = vmlaq_s32(s, fold4(p), *sc);
            }
            let isum = vaddvq_s32(s);
            acc[t] += isum as f32 * (d * k.d[b]);
        }
    }
    acc
}

/// Q5_1 row · `T` tokens' 8-bit blocks of 32: the 32 five-bit codes of a block in two
/// vectors (nibbles, each `qh` bit spread to its byte as 0x10), `sdot` with the
/// activation codes; the float steps as `ggml_dot::dot_q5_1`.
///
/// # Safety
/// NEON and `dotprod` must be available.
#[target_feature(enable = "neon,dotprod")]
pub unsafe fn q5_1_row<const T: usize>(row: &[u8], acts: &[&QuantizedActs; T]) -> [f32; T] {
    let nb = row.len() / 24;
    assert_eq!(row.len(), nb * 24);
    for a in acts {
        assert!(a.q.len() >= nb * 32 && a.d.len() >= nb && a.s.len() >= nb);
    }
    let m4 = vdupq_n_u8(0x0F);
    let m10 = vdupq_n_u8(0x10);
    // Lane l of a spread tests bit l % 8 of its byte.
    const BITS: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
    // SAFETY: BITS is 16 bytes.
    let bits = unsafe { vld1q_u8(BITS.as_ptr()) };
    // Bytes `lo`, `hi` of qh to lanes 0..8 / 8..16, each lane 0x10 where its bit is set.
    let spread = |lo: u8, hi: u8| {
        let v = vcombine_u8(vdup_n_u8(lo), vdup_n_u8(hi));
        vandq_u8(vtstq_u8(v, bits), m10)
    };
    let mut acc = [0.0f32; T];
    for b in 0..nb {
        let blk = &row[b * 24..(b + 1) * 24];
        // SAFETY: bytes 8..24 are inside the 24-byte block.
        let qs = unsafe { vld1q_u8(blk.as_ptr().add(8)) };
        let w0 = vreinterpretq_s8_u8(vorrq_u8(vandq_u8(qs, m4), spread(blk[4], blk[5])));
        let w1 = vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8::<4>(qs), spread(blk[6], blk[7])));
        let dw = f16_at(blk, 0);
        let mw = f16_at(blk, 2);
        for (t, a) in acts.iter().enumerate() {
            // SAFETY: the 32 codes of block b are inside `a.q` (asserted).
            let (x0, x1) = unsafe {
                let p = a.q.as_ptr().add(32 * b);
                (vld1q_s8(p), vld1q_s8(p.add(16)))
            };
            let isum = vaddvq_s32(sdot(sdot(vdupq_n_s32(0), w0, x0), w1, x1));
            acc[t] += isum as f32 * (dw * a.d[b]) + mw * a.s[b];
        }
    }
    acc
}
