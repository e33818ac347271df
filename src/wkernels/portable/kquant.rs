//! The `portable` kernels of the whole-row types: the K-quants and IQ4_XS against Q8_K
//! activations, Q5_1 against the 8-bit blocks of 32 (layout: [`crate::wkernels::packed`]).
//!
//! Each weight super-block (block) is unpacked once into sixteen `i16x16` in value order
//! (`[i]` holds values `16i .. 16i + 16`), every code already multiplied by its sub-block
//! scale: Q4_K's nibbles and Q5_K's nibbles topped by their fifth bit (times the six-bit
//! scale: at most 31 · 63), Q6_K's six-bit codes minus 32 (times the signed eight-bit scale:
//! at most 32 · 128 in magnitude). Each token's 256 activation codes are widened to sixteen
//! `i16x16` once per block and group; `i16x16::dot` (`pmaddwd` on x86, `smull` + pairwise
//! add on NEON) multiplies and sums pairs into 32-bit lanes, sixteen of them are added
//! lane-wise and one horizontal add gives the block's integer sum. Every partial sum is
//! below `256 · 4096 · 128 < 2³¹`, so the sums are exact and equal the scalar twin's in
//! any order. Q4_K/Q5_K's `msum = Σ_j m_j · (bsums_2j + bsums_2j+1)` is one more `dot` of
//! the mins (each twice) with the sixteen bsums.
//!
//! The float steps then run per row in scalar f32, separate multiplies and adds in the
//! twin's order (Rust never fuses them): each value equals the scalar twins'
//! ([`crate::wkernels::scalar`]) and the reference's (`tinygpt_reference::ggml_kdot`)
//! bit for bit (`tests/kquant_dispatch.rs`).
//!
//! One kernel serves one token and several: each `*_group::<T>` walks the group's
//! super-block columns, widens the `T` tokens' codes of that column once, then unpacks each
//! of the eight rows' super-blocks once for all `T` tokens.

use super::LANE_BITS;
use crate::wkernels::blocks::{
    f16_at, iq4_xs_scale, q3_k_scales, scale_min_k4, IQ4_VALUES, IQ4_XS_BYTES, Q2_K_BYTES,
    Q3_K_BYTES, Q4_K_BYTES, Q5_1_BYTES, Q5_K_BYTES, Q6_K_BYTES, QK_K,
};
use crate::wkernels::{QuantizedActs, GROUP, Q8K};
use wide::{i16x16, i32x8, i8x16, u8x16, CmpEq};

/// One super-block's 256 values in 16-bit lanes: `[i]` = values `16i .. 16i + 16`.
type Lanes = [i16x16; 16];

/// Bytes `b[at .. at + 16]` zero-extended to 16-bit lanes.
#[inline(always)]
fn bytes16(b: &[u8], at: usize) -> i16x16 {
    let v: [u8; 16] = b[at..at + 16].try_into().expect("16 bytes");
    i16x16::from(u8x16::from(v))
}

/// One token's 256 activation codes widened to 16-bit lanes.
#[inline(always)]
fn widen(q8: &[i8]) -> Lanes {
    std::array::from_fn(|i| {
        i16x16::from_i8x16(i8x16::from_slice_unaligned(&q8[16 * i..16 * i + 16]))
    })
}

/// `Σ w · x` over the 256 values (exact: see the module docs).
#[inline(always)]
fn isum(w: &Lanes, x: &Lanes) -> i32 {
    let mut s = i32x8::ZERO;
    for (wi, xi) in w.iter().zip(x) {
        s += wi.dot(*xi);
    }
    s.reduce_add()
}

/// A Q4_K (`FIVE = false`) or Q5_K (`FIVE = true`) super-block: its codes times their
/// sub-block scales in value order, and the eight mins each twice (lanes `2j`, `2j + 1`:
/// `m_j`, to meet `bsums_2j`, `bsums_2j+1`).
#[inline(always)]
fn k4_unpack<const FIVE: bool>(blk: &[u8]) -> (Lanes, i16x16) {
    let mut sc = [0i16; 8];
    let mut mins = [0i16; 16];
    for j in 0..8 {
        let (s, m) = scale_min_k4(j, &blk[4..16]);
        sc[j] = s as i16;
        mins[2 * j] = m as i16;
        mins[2 * j + 1] = m as i16;
    }
    let qs_at = if FIVE { 48 } else { 16 };
    let m4 = i16x16::splat(0x0F);
    let one = i16x16::splat(1);
    let mut w = [i16x16::ZERO; 16];
    for i in 0..4 {
        for h in 0..2 {
            // Bytes 32i + 16h .. + 16: values 64i + 16h + l (low nibbles, sub-block 2i)
            // and 64i + 32 + 16h + l (high nibbles, sub-block 2i + 1).
            let v = bytes16(blk, qs_at + 32 * i + 16 * h);
            let mut lo = v & m4;
            let mut hi = v >> 4;
            if FIVE {
                // Bit 2i of qh[l] tops value 64i + l, bit 2i + 1 value 64i + 32 + l.
                let qh = bytes16(blk, 16 + 16 * h);
                lo |= ((qh >> (2 * i as i32)) & one) << 4;
                hi |= ((qh >> (2 * i as i32 + 1)) & one) << 4;
            }
            w[4 * i + h] = lo * i16x16::splat(sc[2 * i]);
            w[4 * i + 2 + h] = hi * i16x16::splat(sc[2 * i + 1]);
        }
    }
    (w, i16x16::from(mins))
}

/// A Q6_K super-block: its codes minus 32 times their sub-block scales, in value order.
#[inline(always)]
fn q6_k_unpack(blk: &[u8]) -> Lanes {
    let m4 = i16x16::splat(0x0F);
    let m30 = i16x16::splat(0x30);
    let m32 = i16x16::splat(32);
    let mut w = [i16x16::ZERO; 16];
    for n in 0..2 {
        for h in 0..2 {
            let qa = bytes16(blk, 64 * n + 16 * h);
            let qb = bytes16(blk, 64 * n + 32 + 16 * h);
            let qh = bytes16(blk, 128 + 32 * n + 16 * h);
            // Values 128n + 32m + 16h + l, m = 0..4: sub-block 8n + 2m + h.
            let codes = [
                (qa & m4) | ((qh << 4) & m30),
                (qb & m4) | ((qh << 2) & m30),
                (qa >> 4) | (qh & m30),
                (qb >> 4) | ((qh >> 2) & m30),
            ];
            for (m, c) in codes.into_iter().enumerate() {
                let k = 8 * n + 2 * m + h;
                w[k] = (c - m32) * i16x16::splat(blk[192 + k] as i8 as i16);
            }
        }
    }
    w
}

/// Asserts the group and the tokens hold `nb` super-blocks of `bytes` bytes.
fn check<const T: usize>(qs: &[u8], rb: usize, bytes: usize, ks: &[&Q8K; T]) -> usize {
    let nb = rb / bytes;
    assert_eq!(rb, nb * bytes, "row bytes vs super-block bytes");
    assert!(qs.len() >= GROUP * rb, "group holds eight rows");
    for k in ks {
        assert!(k.q.len() >= nb * QK_K && k.d.len() >= nb && k.bsums.len() >= nb * 16);
    }
    nb
}

/// `out[t][r] = row r · token t` for the eight rows of a Q4_K (`FIVE = false`) or Q5_K
/// (`FIVE = true`) group (`qs`: the rows one after another, `rb` bytes each) against `T`
/// tokens; so the other `*_group` functions for their types.
///
/// # Panics
/// If a token or row holds fewer super-blocks than `rb` implies.
pub fn k4_group<const T: usize, const FIVE: bool>(
    qs: &[u8],
    rb: usize,
    ks: &[&Q8K; T],
) -> [[f32; GROUP]; T] {
    let bytes = if FIVE { Q5_K_BYTES } else { Q4_K_BYTES };
    mins_group(qs, rb, ks, bytes, 0, k4_unpack::<FIVE>)
}

/// The walk of the types with mins (Q4_K, Q5_K, Q2_K): super-blocks of `bytes` bytes with
/// `d`, `dmin` at `d_at`, `d_at + 2`, each unpacked by `unpack` into its scaled codes and
/// its mins against the sixteen bsums; the twins' steps
/// `acc += isum · (d_w · d_x) − msum · (dmin_w · d_x)`.
#[inline(always)]
fn mins_group<const T: usize>(
    qs: &[u8],
    rb: usize,
    ks: &[&Q8K; T],
    bytes: usize,
    d_at: usize,
    unpack: impl Fn(&[u8]) -> (Lanes, i16x16),
) -> [[f32; GROUP]; T] {
    let nb = check(qs, rb, bytes, ks);
    let mut acc = [[0.0f32; GROUP]; T];
    for b in 0..nb {
        let xs: [Lanes; T] = std::array::from_fn(|t| widen(&ks[t].q[b * QK_K..(b + 1) * QK_K]));
        let bs: [i16x16; T] = std::array::from_fn(|t| {
            let s: [i16; 16] = ks[t].bsums[b * 16..(b + 1) * 16]
                .try_into()
                .expect("16 bsums");
            i16x16::from(s)
        });
        for r in 0..GROUP {
            let blk = &qs[r * rb + b * bytes..r * rb + (b + 1) * bytes];
            let (w, mins) = unpack(blk);
            let (d, dmin) = (f16_at(blk, d_at), f16_at(blk, d_at + 2));
            for t in 0..T {
                let isum = isum(&w, &xs[t]);
                let msum = mins.dot(bs[t]).reduce_add();
                let dx = ks[t].d[b];
                acc[t][r] += isum as f32 * (d * dx) - msum as f32 * (dmin * dx);
            }
        }
    }
    acc
}

pub fn q6_k_group<const T: usize>(qs: &[u8], rb: usize, ks: &[&Q8K; T]) -> [[f32; GROUP]; T] {
    let nb = check(qs, rb, Q6_K_BYTES, ks);
    let mut acc = [[0.0f32; GROUP]; T];
    for b in 0..nb {
        let xs: [Lanes; T] = std::array::from_fn(|t| widen(&ks[t].q[b * QK_K..(b + 1) * QK_K]));
        for r in 0..GROUP {
            let blk = &qs[r * rb + b * Q6_K_BYTES..r * rb + (b + 1) * Q6_K_BYTES];
            let w = q6_k_unpack(blk);
            let d = f16_at(blk, 208);
            for t in 0..T {
                let isum = isum(&w, &xs[t]);
                acc[t][r] += isum as f32 * (d * ks[t].d[b]);
            }
        }
    }
    acc
}

/// An IQ4_XS super-block: its levels (`IQ4_VALUES` looked up by nibble with a byte
/// shuffle) times their sub-block scales `ls − 32`, in value order.
#[inline(always)]
fn iq4_xs_unpack(blk: &[u8]) -> Lanes {
    let table = i8x16::from(IQ4_VALUES);
    let m4 = i16x16::splat(0x0F);
    let level = |idx: i16x16| i16x16::from_i8x16(table.swizzle(i8x16::from_i16x16_truncate(idx)));
    let mut w = [i16x16::ZERO; 16];
    for ib in 0..8 {
        // Bytes 8 + 16ib .. + 16: values 32ib + j (low nibbles), 32ib + 16 + j (high).
        let v = bytes16(blk, 8 + 16 * ib);
        let sc = i16x16::splat((iq4_xs_scale(blk, ib) - 32) as i16);
        w[2 * ib] = level(v & m4) * sc;
        w[2 * ib + 1] = level(v >> 4) * sc;
    }
    w
}

pub fn iq4_xs_group<const T: usize>(qs: &[u8], rb: usize, ks: &[&Q8K; T]) -> [[f32; GROUP]; T] {
    let nb = check(qs, rb, IQ4_XS_BYTES, ks);
    let mut acc = [[0.0f32; GROUP]; T];
    for b in 0..nb {
        let xs: [Lanes; T] = std::array::from_fn(|t| widen(&ks[t].q[b * QK_K..(b + 1) * QK_K]));
        for r in 0..GROUP {
            let blk = &qs[r * rb + b * IQ4_XS_BYTES..r * rb + (b + 1) * IQ4_XS_BYTES];
            let w = iq4_xs_unpack(blk);
            let d = f16_at(blk, 0);
            for t in 0..T {
                let isum = isum(&w, &xs[t]);
                acc[t][r] += isum as f32 * (d * ks[t].d[b]);
            }
        }
    }
    acc
}

/// The 2-bit codes of lanes `[i]` (values `16i .. 16i + 16`, sub-block `i`) of a Q2_K or
/// Q3_K super-block whose 64 code bytes start at `qs_at`: value `128n + 32j + l` is bits
/// `2j, 2j + 1` of byte `32n + l`.
#[inline(always)]
fn two_bit_lanes(blk: &[u8], qs_at: usize, i: usize) -> i16x16 {
    let (n, j, l0) = (i / 8, (i % 8) / 2, 16 * (i % 2));
    (bytes16(blk, qs_at + 32 * n + l0) >> (2 * j as i32)) & i16x16::splat(3)
}

/// A Q2_K super-block: its 2-bit codes times their sub-block scales (`scales[k] & 15`),
/// in value order, and the sixteen mins (`scales[k] >> 4`, to meet the sixteen bsums).
#[inline(always)]
fn q2_k_unpack(blk: &[u8]) -> (Lanes, i16x16) {
    let scales: [u8; 16] = blk[0..16].try_into().expect("16 scale bytes");
    let w = std::array::from_fn(|i| {
        two_bit_lanes(blk, 16, i) * i16x16::splat((scales[i] & 0x0F) as i16)
    });
    (w, i16x16::from(scales.map(|s| (s >> 4) as i16)))
}

/// A Q3_K super-block: its signed 3-bit codes (the 2-bit code, minus 4 unless bit
/// `4n + j` of `hmask[l]` is set) times their signed sub-block scales, in value order.
#[inline(always)]
fn q3_k_unpack(blk: &[u8]) -> Lanes {
    let scales = q3_k_scales(&blk[96..108]);
    let one = i16x16::splat(1);
    std::array::from_fn(|i| {
        let (n, j, l0) = (i / 8, (i % 8) / 2, 16 * (i % 2));
        let high = (bytes16(blk, l0) >> (4 * n + j) as i32) & one;
        let code = two_bit_lanes(blk, 32, i) + (high << 2) - i16x16::splat(4);
        code * i16x16::splat(scales[i] as i16)
    })
}

/// Q2_K: the twin's steps (`d`, `dmin` at 80, 82).
pub fn q2_k_group<const T: usize>(qs: &[u8], rb: usize, ks: &[&Q8K; T]) -> [[f32; GROUP]; T] {
    mins_group(qs, rb, ks, Q2_K_BYTES, 80, q2_k_unpack)
}

/// Q3_K: the twin's steps, `acc += isum · (d_w · d_x)`.
pub fn q3_k_group<const T: usize>(qs: &[u8], rb: usize, ks: &[&Q8K; T]) -> [[f32; GROUP]; T] {
    let nb = check(qs, rb, Q3_K_BYTES, ks);
    let mut acc = [[0.0f32; GROUP]; T];
    for b in 0..nb {
        let xs: [Lanes; T] = std::array::from_fn(|t| widen(&ks[t].q[b * QK_K..(b + 1) * QK_K]));
        for r in 0..GROUP {
            let blk = &qs[r * rb + b * Q3_K_BYTES..r * rb + (b + 1) * Q3_K_BYTES];
            let w = q3_k_unpack(blk);
            let d = f16_at(blk, 108);
            for t in 0..T {
                let isum = isum(&w, &xs[t]);
                acc[t][r] += isum as f32 * (d * ks[t].d[b]);
            }
        }
    }
    acc
}

/// The 32 five-bit codes of a Q5_1 block in value order (`[0]`: values 0..16, `[1]`:
/// 16..32): nibbles, each `qh` bit spread to its lane as 0x10.
#[inline(always)]
fn q5_1_unpack(blk: &[u8]) -> [i16x16; 2] {
    // Lane l tests bit l of a 16-bit half of qh.
    let bits = LANE_BITS;
    let spread = |h: u16| (i16x16::splat(h as i16) & bits).cmp_eq(bits) & i16x16::splat(0x10);
    let v = bytes16(blk, 8);
    [
        (v & i16x16::splat(0x0F)) | spread(u16::from_le_bytes([blk[4], blk[5]])),
        (v >> 4) | spread(u16::from_le_bytes([blk[6], blk[7]])),
    ]
}

/// `out[t][r] = row r · token t` for the eight rows of a Q5_1 group (`qs`: the rows one
/// after another, `rb` bytes each) against `T` tokens' 8-bit blocks of 32: the twin's
/// steps, `acc += isum · (d_w · d_x) + m_w · s_x`.
///
/// # Panics
/// If a token or row holds fewer blocks than `rb` implies.
pub fn q5_1_group<const T: usize>(
    qs: &[u8],
    rb: usize,
    acts: &[&QuantizedActs; T],
) -> [[f32; GROUP]; T] {
    let nb = rb / Q5_1_BYTES;
    assert_eq!(rb, nb * Q5_1_BYTES, "row bytes vs block bytes");
    assert!(qs.len() >= GROUP * rb, "group holds eight rows");
    for a in acts {
        assert!(a.q.len() >= nb * 32 && a.d.len() >= nb && a.s.len() >= nb);
    }
    let mut acc = [[0.0f32; GROUP]; T];
    for b in 0..nb {
        let xs: [[i16x16; 2]; T] = std::array::from_fn(|t| {
            let q = &acts[t].q[32 * b..32 * b + 32];
            [
                i16x16::from_i8x16(i8x16::from_slice_unaligned(&q[..16])),
                i16x16::from_i8x16(i8x16::from_slice_unaligned(&q[16..])),
            ]
        });
        for r in 0..GROUP {
            let blk = &qs[r * rb + b * Q5_1_BYTES..r * rb + (b + 1) * Q5_1_BYTES];
            let w = q5_1_unpack(blk);
            let (dw, mw) = (f16_at(blk, 0), f16_at(blk, 2));
            for t in 0..T {
                let isum = (w[0].dot(xs[t][0]) + w[1].dot(xs[t][1])).reduce_add();
                let a = acts[t];
                acc[t][r] += isum as f32 * (dw * a.d[b]) + mw * a.s[b];
            }
        }
    }
    acc
}
