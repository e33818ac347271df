//! NEON + dot-product kernels of the interleaved types (layout:
//! [`crate::wkernels::packed`]).
//!
//! Per block, each row's 32 codes meet the activation block in two `sdot`s (four lanes of
//! four products each), pairwise adds fold the eight rows' lanes into two vectors of
//! four row sums, and the reference's float steps run on those lanes with separate
//! multiplies and adds (never fused): each lane equals the scalar twin bit for bit.
//! Q4 codes (0..15) are signed bytes already; Q4_0's `− 8` is applied as `− 8 · Σ q_x`.
//! Q5_0 codes are unpacked to their signed values `(nibble | fifth bit << 4) − 16` (the
//! fifth bits spread from the two bytes of each `u16` mask by `vtstq_u8` against the bit
//! of each lane); IQ4_NL nibbles are looked up in the 16 levels (`vqtbl1q_s8`), the signed
//! values `K[n]` (−127..113) as Q8_0 codes. Both need no correction after the `sdot`s.
//!
//! The multi-token kernel runs the same steps for [`TOKENS`] activation vectors,
//! unpacking each 8-row block once for all of them (equal values, bit for bit).

use super::sdot;
use crate::dtype::DType;
use crate::wkernels::blocks::IQ4_VALUES;
use crate::wkernels::{qs_bytes, Group, QuantizedActs, GROUP, QK, TOKENS};
use half::f16;
use std::arch::aarch64::*;

/// Eight f16 values at `b[at..at + 16]` as two f32x4 (exact conversion).
#[inline(always)]
fn f16x8(b: &[u8], at: usize) -> [f32; 8] {
    std::array::from_fn(|k| f16::from_le_bytes([b[at + 2 * k], b[at + 2 * k + 1]]).to_f32())
}

/// Byte `i` of the result is `0x10` if bit `i` of the little-endian `u16` at `p` is set,
/// else 0 (a Q5_0 fifth-bit mask of 16 elements).
///
/// # Safety
/// `p` must point at two readable bytes (NEON is baseline on aarch64).
#[inline(always)]
unsafe fn fifth_bits(p: *const u8) -> uint8x16_t {
    const BIT: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
    // SAFETY: the caller guarantees the two bytes; `BIT` is 16 bytes.
    unsafe {
        let m = vcombine_u8(vdup_n_u8(*p), vdup_n_u8(*p.add(1)));
        vandq_u8(vtstq_u8(m, vld1q_u8(BIT.as_ptr())), vdupq_n_u8(0x10))
    }
}

/// One 8-row block of codes as signed bytes: `[k]` row `k`'s elements 0..16, `[8 + k]`
/// its elements 16..32 (Q4: low / high nibbles; Q5_0: `(nibble | fifth bit << 4) − 16`;
/// IQ4_NL: the levels `K[nibble]`).
///
/// # Safety
/// `qp` must point at one block of codes of `dtype` (NEON is baseline on aarch64). Always
/// inlined: with `dtype` a constant (`per_code_type!`) its branches fold, and the codes
/// stay in registers instead of being returned through memory by a call per block.
#[inline(always)]
unsafe fn unpack(dtype: DType, qp: *const u8) -> [int8x16_t; 16] {
    let mut w = [vdupq_n_s8(0); 16];
    // SAFETY: `IQ4_VALUES` is 16 bytes.
    let table = unsafe { vld1q_s8(IQ4_VALUES.as_ptr()) };
    for k in 0..GROUP {
        // SAFETY: every load stays inside the block (the caller's guarantee).
        unsafe {
            if dtype == DType::Q8_0 {
                let base = (k / 4) * 128 + (k % 4) * 16;
                w[k] = vld1q_s8(qp.add(base).cast());
                w[8 + k] = vld1q_s8(qp.add(base + 64).cast());
                continue;
            }
            let v = vld1q_u8(qp.add((k / 4) * 64 + (k % 4) * 16));
            let (lo, hi) = (vandq_u8(v, vdupq_n_u8(0x0F)), vshrq_n_u8::<4>(v));
            match dtype {
                DType::IQ4_NL => {
                    w[k] = vqtbl1q_s8(table, lo);
                    w[8 + k] = vqtbl1q_s8(table, hi);
                }
                DType::Q5_0 => {
                    // row k's masks of elements 0..16 and 16..32 (`packed::q5_bits_pos`)
                    let at = 128 + (k / 4) * 16 + (k % 4) * 2;
                    let sixteen = vdupq_n_s8(16);
                    let l = vorrq_u8(lo, fifth_bits(qp.add(at)));
                    let h = vorrq_u8(hi, fifth_bits(qp.add(at + 8)));
                    w[k] = vsubq_s8(vreinterpretq_s8_u8(l), sixteen);
                    w[8 + k] = vsubq_s8(vreinterpretq_s8_u8(h), sixteen);
                }
                DType::Q4_0 | DType::Q4_1 => {
                    w[k] = vreinterpretq_s8_u8(lo);
                    w[8 + k] = vreinterpretq_s8_u8(hi);
                }
                other @ (DType::Q8_0 | rows_or_float!()) => {
                    unreachable!("{other}: not a nibble type")
                }
            }
        }
    }
    w
}

/// One unpacked block against one activation block: the float steps added to `acc`
/// (`acc[0]` rows 0..4, `acc[1]` rows 4..8). `dw`, `mw`: the block's scales / minimums.
///
/// # Safety
/// `ap` must point at 32 activation codes; only inlined into the kernels below, which
/// enable `dotprod` (the `sdot`s).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn block_step(
    dtype: DType,
    w: &[int8x16_t; 16],
    ap: *const i8,
    a: &QuantizedActs,
    b: usize,
    dw: &[f32; 8],
    mw: &[f32; 8],
    acc: &mut [float32x4_t; 2],
) {
    // SAFETY: the caller guarantees 32 bytes at `ap`.
    let (alo, ahi) = unsafe { (vld1q_s8(ap), vld1q_s8(ap.add(16))) };
    let z = vdupq_n_s32(0);
    let row = |k: usize| -> int32x4_t { sdot(sdot(z, w[k], alo), w[8 + k], ahi) };
    let half = |k0: usize| -> int32x4_t {
        let p01 = vpaddq_s32(row(k0), row(k0 + 1));
        let p23 = vpaddq_s32(row(k0 + 2), row(k0 + 3));
        let s = vpaddq_s32(p01, p23);
        if dtype == DType::Q4_0 {
            vsubq_s32(s, vdupq_n_s32(8 * a.qsum[b]))
        } else {
            s
        }
    };
    let isum = [half(0), half(4)];
    for h in 0..2 {
        // SAFETY: the loads read 4 f32s from 8-element arrays at offset 0 or 4.
        unsafe {
            let scale = vmulq_f32(vld1q_f32(dw.as_ptr().add(4 * h)), vdupq_n_f32(a.d[b]));
            let mut t = vmulq_f32(vcvtq_f32_s32(isum[h]), scale);
            if dtype == DType::Q4_1 {
                let m = vld1q_f32(mw.as_ptr().add(4 * h));
                t = vaddq_f32(t, vmulq_f32(m, vdupq_n_f32(a.s[b])));
            }
            acc[h] = vaddq_f32(acc[h], t);
        }
    }
}

/// NEON + dotprod group kernel.
///
/// # Safety
/// The CPU must support `dotprod`; `g` must be a group of a [`crate::wkernels::Packed`] of
/// `dtype` with as many blocks as `a`.
#[target_feature(enable = "neon,dotprod")]
pub unsafe fn group_dot(dtype: DType, g: &Group, a: &QuantizedActs, out: &mut [f32; 8]) {
    let mut o = [[0.0f32; GROUP]; TOKENS];
    // SAFETY: the caller's guarantees are the multi-token body's, for one token.
    unsafe { per_code_type!(dtype, tokens::<1>, (g, &[a], &mut o)) };
    *out = o[0];
}

/// NEON + dotprod multi-token group kernel: [`group_dot`] for [`TOKENS`]
/// tokens, each block unpacked once.
///
/// # Safety
/// As for [`group_dot`], for every token.
#[target_feature(enable = "neon,dotprod")]
pub unsafe fn group_tokens(
    dtype: DType,
    g: &Group,
    acts: &[&QuantizedActs; TOKENS],
    out: &mut [[f32; GROUP]; TOKENS],
    n: usize,
) {
    by_live_tokens!(n, acts, |T, sub| {
        // SAFETY: forwarded from the caller (for the first `T` tokens).
        unsafe { per_code_type!(dtype, tokens::<T>, (g, sub, out)) }
    })
}

/// The kernel body for `T ≤ TOKENS` tokens (results in `out[..T]`), called with `dtype` a
/// constant (`per_code_type!`).
///
/// # Safety
/// As for [`group_dot`], for every token; always inlined into it or into
/// [`group_tokens`] (which enable `dotprod`).
#[inline(always)]
unsafe fn tokens<const T: usize>(
    dtype: DType,
    g: &Group,
    acts: &[&QuantizedActs; T],
    out: &mut [[f32; GROUP]; TOKENS],
) {
    let qsb = qs_bytes(dtype);
    assert!(g.qs.len() >= g.nb * qsb);
    for a in acts {
        assert!(a.q.len() >= g.nb * QK && a.d.len() >= g.nb && a.s.len() >= g.nb);
    }
    let mut acc = [[vdupq_n_f32(0.0); 2]; T];
    for b in 0..g.nb {
        let dw = f16x8(g.d, b * 16);
        let mw = if dtype == DType::Q4_1 {
            f16x8(g.m, b * 16)
        } else {
            [0.0; 8]
        };
        // SAFETY: every pointer stays inside block `b` of `g.qs` (qsb bytes) and of each
        // `a.q` (32 bytes), checked by the asserts above; NEON loads need no alignment.
        unsafe {
            let w = unpack(dtype, g.qs.as_ptr().add(b * qsb));
            for (a, acc_t) in acts.iter().zip(acc.iter_mut()) {
                block_step(dtype, &w, a.q.as_ptr().add(b * QK), a, b, &dw, &mw, acc_t);
            }
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        // SAFETY: `o` is 8 f32s: two stores of 4.
        unsafe {
            vst1q_f32(o.as_mut_ptr(), a[0]);
            vst1q_f32(o.as_mut_ptr().add(4), a[1]);
        }
    }
}
