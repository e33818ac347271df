//! The `portable` kernels of the interleaved types (Q8_0, Q4_0, Q4_1, Q5_0, IQ4_NL;
//! layout: [`crate::wkernels::packed`]).
//!
//! Per block, each row's 32 codes and the 32 activation codes are widened to 16-bit
//! lanes (`i16x16`), multiplied and summed in pairs into 32-bit lanes (`i16x16::dot`:
//! `pmaddwd` on x86, `smull` + pairwise add on NEON), giving eight partial sums per row;
//! an 8 × 8 transpose and seven adds turn the eight rows' partials into one `i32x8` whose
//! lane `k` is row `k`'s exact block sum. The reference's float steps then run on the
//! eight lanes with separate multiplies and adds (never fused), as in the other
//! variants, so each lane equals the scalar twin bit for bit. Q4 codes are 0..15 after
//! the nibble split; Q4_0's `− 8` is applied as `− 8 · Σ q_x`. Q5_0 codes are unpacked
//! signed (`(nibble | fifth bit << 4) − 16`, the fifth bits spread to lanes by a mask
//! compare) and IQ4_NL's levels come from a 16-entry table shuffle (`i8x16::swizzle`:
//! `pshufb` / `tbl`), both read from their own blocks (22 and 18 bytes per 32 weights). No
//! sum can overflow: a 32-bit lane holds at most `4 · 128 · 127`.
//!
//! The multi-token variant unpacks (widens) each 8-row block once for [`TOKENS`]
//! activation vectors and runs the one-token steps for each of them (equal values, bit
//! for bit).

use super::LANE_BITS;
use crate::dtype::DType;
use crate::wkernels::blocks::IQ4_VALUES;
use crate::wkernels::{qs_bytes, Group, QuantizedActs, GROUP, QK, TOKENS};
use wide::{f32x8, i16x16, i32x8, i8x16, u8x16, CmpEq};

/// One 8-row block of codes widened to 16 bits: `[k]` row `k`'s elements 0..16, `[8 + k]`
/// its elements 16..32 (Q4: the low and the high nibbles of its 16 bytes, 0..15; Q5_0:
/// those topped by their fifth bits, minus 16; IQ4_NL: the nibbles' levels).
#[inline(always)]
fn unpack(dtype: DType, qs: &[u8]) -> [i16x16; 16] {
    let mut w = [i16x16::ZERO; 16];
    for k in 0..GROUP {
        if dtype == DType::Q8_0 {
            // Layout: byte `(k / 4)·128 + (i / 16)·64 + (k % 4)·16 + i % 16` (`packed` docs).
            let base = (k / 4) * 128 + (k % 4) * 16;
            w[k] = i16x16::from_i8x16(i8x16::from_slice_unaligned(bytemuck::cast_slice(
                &qs[base..base + 16],
            )));
            w[8 + k] = i16x16::from_i8x16(i8x16::from_slice_unaligned(bytemuck::cast_slice(
                &qs[base + 64..base + 80],
            )));
        } else {
            let base = (k / 4) * 64 + (k % 4) * 16;
            let bytes: [u8; 16] = qs[base..base + 16].try_into().expect("16 code bytes");
            if dtype == DType::IQ4_NL {
                // Each nibble picks its level from the 16-entry table (one shuffle).
                let levels = i8x16::from(IQ4_VALUES);
                let (lo, hi) = (
                    bytes.map(|b| (b & 0x0F) as i8),
                    bytes.map(|b| (b >> 4) as i8),
                );
                w[k] = i16x16::from_i8x16(levels.swizzle(i8x16::from(lo)));
                w[8 + k] = i16x16::from_i8x16(levels.swizzle(i8x16::from(hi)));
                continue;
            }
            let v = i16x16::from(u8x16::from(bytes));
            let mask = i16x16::splat(0x0F);
            w[k] = v & mask;
            w[8 + k] = v >> 4;
            if dtype == DType::Q5_0 {
                // `(nibble | fifth bit << 4) − 16`: lane `i` of each half takes bit `i` of
                // its row's `u16` of fifth bits (the packed Q5_0 layout).
                for half in 0..2 {
                    let at = 128 + (k / 4) * 16 + half * 8 + (k % 4) * 2;
                    let bits = i16x16::splat(i16::from_le_bytes([qs[at], qs[at + 1]]));
                    let clear = (bits & LANE_BITS).cmp_eq(i16x16::ZERO);
                    let fifth = clear.blend(i16x16::ZERO, i16x16::splat(16));
                    w[8 * half + k] = w[8 * half + k] + fifth - i16x16::splat(16);
                }
            }
        }
    }
    w
}

/// One activation block widened to 16 bits: elements 0..16 and 16..32.
#[inline(always)]
fn widen_acts(q: &[i8]) -> (i16x16, i16x16) {
    (
        i16x16::from_i8x16(i8x16::from_slice_unaligned(&q[..16])),
        i16x16::from_i8x16(i8x16::from_slice_unaligned(&q[16..32])),
    )
}

/// The eight rows' exact integer sums of one unpacked block against one widened
/// activation block (lane `k` = row `k`), Q4_0's `− 8 · Σ q_x` applied.
#[inline(always)]
fn isum(dtype: DType, w: &[i16x16; 16], (lo, hi): (i16x16, i16x16), qsum: i32) -> i32x8 {
    // part[k]: row k's eight partial sums of four products each.
    // (A loop, not `array::from_fn`, which the compiler left as a call here.)
    let mut part = [i32x8::ZERO; GROUP];
    for (k, p) in part.iter_mut().enumerate() {
        *p = w[k].dot(lo) + w[8 + k].dot(hi);
    }
    let t = i32x8::transpose(part);
    let s = ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
    if dtype == DType::Q4_0 {
        s - i32x8::splat(8 * qsum)
    } else {
        s
    }
}

/// Eight f16 values at `b[at..at + 16]` as f32 lanes, in vector integer steps (no F16C
/// needed), equal bit for bit to `half`'s `f16::to_f32` for every pattern (the unit test
/// below tries all 65,536): a normal value moves its exponent and mantissa into place and
/// rebiases the exponent; a subnormal (or zero) is its mantissa times `2^-24`, an exact
/// product of normal floats (so flush-to-zero modes cannot change it); infinities keep
/// the all-ones exponent, and a NaN also gets the quiet bit, as `half` (and F16C) do.
#[inline(always)]
fn f16x8(b: &[u8], at: usize) -> f32x8 {
    let b = &b[at..at + 16];
    let mut h = [0i32; 8];
    for (k, o) in h.iter_mut().enumerate() {
        *o = u16::from_le_bytes([b[2 * k], b[2 * k + 1]]) as i32;
    }
    let h = i32x8::from(h);
    let sign = (h & i32x8::splat(0x8000)) << 16;
    let exp = h & i32x8::splat(0x7C00);
    let man = h & i32x8::splat(0x03FF);
    let normal = ((h & i32x8::splat(0x7FFF)) << 13) + i32x8::splat((127 - 15) << 23);
    let quiet = man
        .cmp_eq(i32x8::ZERO)
        .blend(i32x8::ZERO, i32x8::splat(0x0040_0000));
    let special = i32x8::splat(0x7F80_0000) | quiet | (man << 13);
    let tiny: i32x8 = bytemuck::cast(man.round_float() * f32x8::splat(1.0 / 16_777_216.0));
    let bits = exp.cmp_eq(i32x8::ZERO).blend(
        tiny,
        exp.cmp_eq(i32x8::splat(0x7C00)).blend(special, normal),
    );
    bytemuck::cast(bits | sign)
}

/// Block `b`'s eight scales and (Q4_1) minimums as f32 lanes; zero minimums otherwise.
#[inline(always)]
fn scales8(dtype: DType, g: &Group, b: usize) -> (f32x8, f32x8) {
    let dw = f16x8(g.d, b * 16);
    let mw = if dtype == DType::Q4_1 {
        f16x8(g.m, b * 16)
    } else {
        f32x8::ZERO
    };
    (dw, mw)
}

/// The float steps of one block for eight rows, as the scalar twin:
/// `acc + isum · (d_w · d_x)` (Q4_1: `+ m_w · s_x` inside the bracket); `wide`'s `*` and
/// `+` are separate instructions (Rust never contracts them into a fused multiply-add).
#[inline(always)]
fn combine(
    dtype: DType,
    (dw, mw): (f32x8, f32x8),
    a: &QuantizedActs,
    b: usize,
    isum: i32x8,
    acc: f32x8,
) -> f32x8 {
    let mut t = isum.round_float() * (dw * f32x8::splat(a.d[b]));
    if dtype == DType::Q4_1 {
        t += mw * f32x8::splat(a.s[b]);
    }
    acc + t
}

/// `out[k] = row (8g + k) · a` for the group's eight rows.
pub fn group_dot(dtype: DType, g: &Group, a: &QuantizedActs, out: &mut [f32; GROUP]) {
    let qsb = qs_bytes(dtype);
    assert!(g.qs.len() >= g.nb * qsb && a.q.len() >= g.nb * QK && a.d.len() >= g.nb);
    let mut acc = f32x8::ZERO;
    for b in 0..g.nb {
        let w = unpack(dtype, &g.qs[b * qsb..(b + 1) * qsb]);
        let s = isum(dtype, &w, widen_acts(&a.q[b * QK..]), a.qsum[b]);
        acc = combine(dtype, scales8(dtype, g, b), a, b, s, acc);
    }
    *out = acc.to_array();
}

/// [`group_dot`] for [`TOKENS`] tokens, each 8-row block unpacked (and its scales
/// converted) once for all of them.
pub fn group_tokens(
    dtype: DType,
    g: &Group,
    acts: &[&QuantizedActs; TOKENS],
    out: &mut [[f32; GROUP]; TOKENS],
    n: usize,
) {
    by_live_tokens!(n, acts, |T, sub| { tokens::<T>(dtype, g, sub, out) })
}

/// [`group_tokens`] for its first `T` tokens (results in `out[..T]`).
fn tokens<const T: usize>(
    dtype: DType,
    g: &Group,
    acts: &[&QuantizedActs; T],
    out: &mut [[f32; GROUP]; TOKENS],
) {
    let qsb = qs_bytes(dtype);
    assert!(g.qs.len() >= g.nb * qsb);
    for a in acts {
        assert!(a.q.len() >= g.nb * QK && a.d.len() >= g.nb && a.qsum.len() >= g.nb);
    }
    let mut acc = [f32x8::ZERO; T];
    for b in 0..g.nb {
        let w = unpack(dtype, &g.qs[b * qsb..(b + 1) * qsb]);
        let sc = scales8(dtype, g, b);
        for (a, acc_t) in acts.iter().zip(acc.iter_mut()) {
            let s = isum(dtype, &w, widen_acts(&a.q[b * QK..]), a.qsum[b]);
            *acc_t = combine(dtype, sc, a, b, s, *acc_t);
        }
    }
    for (o, acc_t) in out.iter_mut().zip(acc) {
        *o = acc_t.to_array();
    }
}

#[cfg(test)]
mod tests {
    use super::f16x8;
    use half::f16;

    /// Every f16 bit pattern, in every lane position, against `half`'s conversion.
    #[test]
    fn f16_conversion_equals_half_for_every_pattern() {
        let mut bytes = vec![0u8; 2 * 65_536 + 2];
        for h in 0..=u16::MAX {
            let at = 2 + 2 * h as usize;
            bytes[at..at + 2].copy_from_slice(&h.to_le_bytes());
        }
        // offset 2: lane k holds pattern 8i + k; offset 0: shifted by one lane
        for start in [0usize, 2] {
            for chunk in 0..(65_536 / 8) {
                let at = start + 16 * chunk;
                let got = f16x8(&bytes, at).to_array();
                for (k, g) in got.iter().enumerate() {
                    let raw = u16::from_le_bytes([bytes[at + 2 * k], bytes[at + 2 * k + 1]]);
                    let want = f16::from_bits(raw).to_f32();
                    assert_eq!(g.to_bits(), want.to_bits(), "f16 {raw:#06x}");
                }
            }
        }
    }
}
