//! The engine's dequantisers: a row of weights in its file type ([`DType`]) → f32, one
//! function per type, named in the type table ([`super::Entry::dequant`]).
//!
//! Used at load (norm vectors, `--weights-dtype f32`/`bf16` conversions, the finite-value
//! scan) and for embedding lookups ([`crate::ops::Matrix::row_f32`]); the products never
//! dequantise. Every multi-byte field is little-endian; each f16 scale (and minimum) is
//! widened to f32 first, then each value is one f32 product (plus the minimum, or minus
//! the scaled minimum for the K-quants), unfused, in the order written at each function:
//! the reference's dequantisers (`tinygpt_reference::ggml`, `ggml_more`, where the block
//! layouts are spelled out) give the same bits (`tests/dequant.rs`, every type), and both
//! match gguf-py's (`tests/dequant_types.rs`).
//!
//! Also here: the exact rewrites of Q5_0 and IQ4_NL blocks as Q8_0 blocks
//! ([`q5_0_to_q8_0`], [`iq4_nl_to_q8_0`]), which the tests use to hold the types' own
//! kernels to the Q8_0 kernels.

use super::blocks::{
    f16_at, iq4_xs_scale, k4_codes, nibbles, q3_k_codes, q3_k_scales, q5_codes, q6_k_codes,
    scale_min_k4, two_bit_codes, IQ4_VALUES, QK, QK_K,
};
use crate::dtype::DType;
use half::{bf16, f16};
pub use tinygpt_types::ggml::DequantError;

/// Dequantises `out.len()` values of `dtype` stored in `bytes`, checking that `bytes` holds
/// exactly that many values (an error, never a panic, on a mismatch).
pub fn dequantize_row(dtype: DType, bytes: &[u8], out: &mut [f32]) -> Result<(), DequantError> {
    dtype.check_len(out.len(), bytes.len())?;
    dequantize_into(dtype, bytes, out);
    Ok(())
}

/// Dequantises `bytes` of `dtype` into `out` with the table's dequantiser. Precondition
/// (unchecked beyond what slicing checks; see [`dequantize_row`] for the checked form):
/// `bytes` holds exactly `out.len()` values. Values past the shorter of the two are left
/// untouched.
pub fn dequantize_into(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    (super::entry(dtype).dequant)(bytes, out)
}

/// F32 values.
pub fn f32s(bytes: &[u8], out: &mut [f32]) {
    plain::<4>(bytes, out, f32::from_le_bytes)
}

/// F16 values, widened exactly.
pub fn f16s(bytes: &[u8], out: &mut [f32]) {
    plain::<2>(bytes, out, |b| f16::from_le_bytes(b).to_f32())
}

/// BF16 values, widened exactly.
pub fn bf16s(bytes: &[u8], out: &mut [f32]) {
    plain::<2>(bytes, out, |b| bf16::from_le_bytes(b).to_f32())
}

/// Q8_0 blocks (`d: f16 | q: [i8; 32]`): `x = d·q`.
pub fn q8_0(bytes: &[u8], out: &mut [f32]) {
    blocks(DType::Q8_0, bytes, out, q8_0_block)
}

/// Q4_0 blocks (`d: f16 | qs: [u8; 16]`): `x = d·(q − 8)`.
pub fn q4_0(bytes: &[u8], out: &mut [f32]) {
    blocks(DType::Q4_0, bytes, out, q4_0_block)
}

/// Q4_1 blocks (`d: f16 | m: f16 | qs: [u8; 16]`): `x = d·q + m`.
pub fn q4_1(bytes: &[u8], out: &mut [f32]) {
    blocks(DType::Q4_1, bytes, out, q4_1_block)
}

/// Q5_0 blocks (`d: f16 | qh: u32 | qs: [u8; 16]`): `x = d·(c − 16)`, `c` the nibble
/// with bit `i` of `qh` on top of value `i`.
pub fn q5_0(bytes: &[u8], out: &mut [f32]) {
    blocks(DType::Q5_0, bytes, out, |b, o| {
        let d = f16_at(b, 0);
        for (o, c) in o.iter_mut().zip(q5_codes(b, 2)) {
            *o = d * f32::from(c as i8 - 16);
        }
    })
}

/// Q5_1 blocks (`d: f16 | m: f16 | qh: u32 | qs: [u8; 16]`): `x = d·c + m`.
pub fn q5_1(bytes: &[u8], out: &mut [f32]) {
    blocks(DType::Q5_1, bytes, out, |b, o| {
        let (d, m) = (f16_at(b, 0), f16_at(b, 2));
        for (o, c) in o.iter_mut().zip(q5_codes(b, 4)) {
            *o = d * f32::from(c) + m;
        }
    })
}

/// IQ4_NL blocks (`d: f16 | qs: [u8; 16]`): `x = d·K[n]`, `K` = [`IQ4_VALUES`].
pub fn iq4_nl(bytes: &[u8], out: &mut [f32]) {
    blocks(DType::IQ4_NL, bytes, out, |b, o| {
        let d = f16_at(b, 0);
        for (o, n) in o.iter_mut().zip(nibbles(&b[2..])) {
            *o = d * f32::from(IQ4_VALUES[n as usize]);
        }
    })
}

/// Q2_K super-blocks (`scales: [u8; 16] | qs: [u8; 64] | d | dmin`): sub-block `k` of 16
/// has scale `scales[k] & 15` and minimum `scales[k] >> 4`; `x = (d·sc)·q − (dmin·m)`, the
/// 2-bit codes in [`two_bit_codes`]' order.
pub fn q2_k(bytes: &[u8], out: &mut [f32]) {
    super_blocks(DType::Q2_K, bytes, out, |b, o| {
        let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
        let codes = two_bit_codes(&b[16..80]);
        for (k, (o, c)) in o
            .chunks_exact_mut(16)
            .zip(codes.chunks_exact(16))
            .enumerate()
        {
            let (dl, ml) = (d * f32::from(b[k] & 0x0F), dmin * f32::from(b[k] >> 4));
            for (o, &c) in o.iter_mut().zip(c) {
                *o = dl * f32::from(c) - ml;
            }
        }
    })
}

/// Q3_K super-blocks (`hmask: [u8; 32] | qs: [u8; 64] | scales: [u8; 12] | d`): the 2-bit
/// code minus 4 where its `hmask` bit is clear, times `d·s_k` of its sub-block of 16.
pub fn q3_k(bytes: &[u8], out: &mut [f32]) {
    super_blocks(DType::Q3_K, bytes, out, |b, o| {
        let d = f16_at(b, 108);
        let scales = q3_k_scales(&b[96..108]);
        for (v, (o, c)) in o.iter_mut().zip(q3_k_codes(b)).enumerate() {
            *o = (d * scales[v / 16] as f32) * f32::from(c);
        }
    })
}

/// Q4_K super-blocks (`d | dmin | scales: [u8; 12] | qs: [u8; 128]`): sub-block pair
/// `(2i, 2i + 1)` reads bytes `qs[32i..32i + 32]`, low nibbles then high nibbles;
/// `x = (d·sc)·q − (dmin·m)`.
pub fn q4_k(bytes: &[u8], out: &mut [f32]) {
    super_blocks(DType::Q4_K, bytes, out, |b, o| k4_super_block(b, false, o))
}

/// Q5_K super-blocks (`d | dmin | scales: [u8; 12] | qh: [u8; 32] | qs: [u8; 128]`): as
/// Q4_K with a fifth bit: bit `2i` (`2i + 1`) of `qh[l]` tops value `l` of sub-block `2i`
/// (`2i + 1`).
pub fn q5_k(bytes: &[u8], out: &mut [f32]) {
    super_blocks(DType::Q5_K, bytes, out, |b, o| k4_super_block(b, true, o))
}

/// Q6_K super-blocks (`ql: [u8; 128] | qh: [u8; 64] | scales: [i8; 16] | d`): six-bit codes
/// (a nibble of `ql`, two bits of `qh`) minus 32, times `d·sc` of their sub-block of 16.
pub fn q6_k(bytes: &[u8], out: &mut [f32]) {
    super_blocks(DType::Q6_K, bytes, out, |b, o| {
        let d = f16_at(b, 208);
        for (v, (o, c)) in o.iter_mut().zip(q6_k_codes(b)).enumerate() {
            *o = (d * f32::from(b[192 + v / 16] as i8)) * f32::from(c as i8 - 32);
        }
    })
}

/// IQ4_XS super-blocks (`d | scales_h: u16 | scales_l: [u8; 4] | qs: [u8; 128]`): eight
/// sub-blocks of 32 with six-bit scales `ls`; `x = (d·(ls − 32))·K[n]`, nibbles as IQ4_NL's.
pub fn iq4_xs(bytes: &[u8], out: &mut [f32]) {
    super_blocks(DType::IQ4_XS, bytes, out, |b, o| {
        let d = f16_at(b, 0);
        for (ib, o) in o.chunks_exact_mut(32).enumerate() {
            let dl = d * (iq4_xs_scale(b, ib) - 32) as f32;
            for (o, n) in o.iter_mut().zip(nibbles(&b[8 + 16 * ib..])) {
                *o = dl * f32::from(IQ4_VALUES[n as usize]);
            }
        }
    })
}

/// A rewrite of whole blocks of one type as blocks of another.
pub type Rewrite = fn(&[u8]) -> Vec<u8>;

/// The exact rewrite of `dtype`'s blocks as Q8_0 blocks, for the types that have one
/// (Q5_0: [`q5_0_to_q8_0`], IQ4_NL: [`iq4_nl_to_q8_0`]); `None` for the others.
pub fn q8_0_rewrite(dtype: DType) -> Option<Rewrite> {
    match dtype {
        DType::Q5_0 => Some(q5_0_to_q8_0),
        DType::IQ4_NL => Some(iq4_nl_to_q8_0),
        DType::F32
        | DType::F16
        | DType::BF16
        | DType::Q8_0
        | DType::Q4_0
        | DType::Q4_1
        | DType::Q5_1
        | DType::Q2_K
        | DType::Q3_K
        | DType::Q4_K
        | DType::Q5_K
        | DType::Q6_K
        | DType::IQ4_XS => None,
    }
}

/// Q5_0 blocks rewritten as Q8_0 blocks (34 bytes: the same f16 `d`, then the 32 signed
/// codes `c − 16`). Exact: every value `d·(c − 16)` is unchanged, and so is the dot
/// product with an activation block, `(d_w·d_x) · Σ (c − 16)·q_x` for both types.
/// `bytes` holds whole blocks (a partial last block is dropped).
pub fn q5_0_to_q8_0(bytes: &[u8]) -> Vec<u8> {
    as_q8_0(bytes, DType::Q5_0, |b| q5_codes(b, 2).map(|c| c as i8 - 16))
}

/// IQ4_NL blocks rewritten as Q8_0 blocks: each nibble `n` becomes the signed byte
/// `K[n]` (the levels span −127..113). Exact, as [`q5_0_to_q8_0`].
pub fn iq4_nl_to_q8_0(bytes: &[u8]) -> Vec<u8> {
    as_q8_0(bytes, DType::IQ4_NL, |b| {
        nibbles(&b[2..]).map(|n| IQ4_VALUES[n as usize])
    })
}

/// Whole blocks of `from` as Q8_0 blocks: the f16 scale, then `codes(block)`.
fn as_q8_0(bytes: &[u8], from: DType, codes: impl Fn(&[u8]) -> [i8; QK]) -> Vec<u8> {
    let bs = from.block_bytes();
    let mut out = Vec::with_capacity(bytes.len() / bs * DType::Q8_0.block_bytes());
    for b in bytes.chunks_exact(bs) {
        out.extend_from_slice(&b[..2]);
        out.extend(codes(b).map(|c| c as u8));
    }
    out
}

/// One value per `W` bytes.
#[inline]
fn plain<const W: usize>(bytes: &[u8], out: &mut [f32], decode: impl Fn([u8; W]) -> f32) {
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(W)) {
        *o = decode(c.try_into().expect("chunk of W bytes"));
    }
}

/// [`QK`] values per `dtype.block_bytes()` bytes.
#[inline]
fn blocks(dtype: DType, bytes: &[u8], out: &mut [f32], block: fn(&[u8], &mut [f32; QK])) {
    chunks(dtype, bytes, out, block)
}

/// [`QK_K`] values per `dtype.block_bytes()` bytes.
#[inline]
fn super_blocks(dtype: DType, bytes: &[u8], out: &mut [f32], block: fn(&[u8], &mut [f32; QK_K])) {
    chunks(dtype, bytes, out, block)
}

#[inline(always)]
fn chunks<const N: usize>(
    dtype: DType,
    bytes: &[u8],
    out: &mut [f32],
    f: fn(&[u8], &mut [f32; N]),
) {
    for (b, o) in bytes
        .chunks_exact(dtype.block_bytes())
        .zip(out.chunks_exact_mut(N))
    {
        f(b, o.try_into().expect("chunk of N values"));
    }
}

/// Q8_0: `d: f16 | q: [i8; 32]`, `x = d·q`.
#[inline]
fn q8_0_block(b: &[u8], out: &mut [f32; QK]) {
    let d = f16_at(b, 0);
    for (o, &q) in out.iter_mut().zip(&b[2..2 + QK]) {
        *o = d * f32::from(q as i8);
    }
}

/// One Q4_K / Q5_K super-block: `x = (d·sc)·q − (dmin·m)` per sub-block of 32.
#[inline]
fn k4_super_block(b: &[u8], five: bool, o: &mut [f32; QK_K]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let codes = k4_codes(b, five);
    for (j, (o, c)) in o
        .chunks_exact_mut(32)
        .zip(codes.chunks_exact(32))
        .enumerate()
    {
        let (sc, m) = scale_min_k4(j, &b[4..16]);
        let (dl, ml) = (d * f32::from(sc), dmin * f32::from(m));
        for (o, &c) in o.iter_mut().zip(c) {
            *o = dl * f32::from(c) - ml;
        }
    }
}

/// Q4_0: `d: f16 | qs: [u8; 16]`, `x = d·(q − 8)`.
#[inline]
fn q4_0_block(b: &[u8], out: &mut [f32; QK]) {
    let d = f16_at(b, 0);
    for (o, q) in out.iter_mut().zip(nibbles(&b[2..])) {
        *o = d * f32::from(q as i8 - 8);
    }
}

/// Q4_1: `d: f16 | m: f16 | qs: [u8; 16]`, `x = d·q + m`.
#[inline]
fn q4_1_block(b: &[u8], out: &mut [f32; QK]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for (o, q) in out.iter_mut().zip(nibbles(&b[4..])) {
        *o = d * f32::from(q) + m;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed_blocks() {
        // Q4_0, d = 2.0 (f16 0x4000); byte j = (15 − j) << 4 | j.
        let mut b = vec![0x00, 0x40];
        b.extend((0..16u8).map(|j| ((15 - j) << 4) | j));
        let mut out = [0.0f32; 32];
        dequantize_row(DType::Q4_0, &b, &mut out).unwrap();
        assert_eq!(out[0], -16.0); // 2·(0 − 8)
        assert_eq!(out[15], 14.0); // 2·(15 − 8)
        assert_eq!(out[16], 14.0); // high nibble of byte 0 = 15
        assert_eq!(out[31], -16.0);
        // Q4_1, d = 0.5 (0x3800), m = −1 (0xBC00), every byte 0x31: lo 1, hi 3.
        let mut b = vec![0x00, 0x38, 0x00, 0xBC];
        b.extend([0x31; 16]);
        dequantize_row(DType::Q4_1, &b, &mut out).unwrap();
        assert!(out[..16].iter().all(|&x| x == -0.5));
        assert!(out[16..].iter().all(|&x| x == 0.5));
        // Q8_0, d = 0.25 (0x3400), q = −128, 127, 0, ...
        let mut b = vec![0x00, 0x34, 0x80, 0x7F];
        b.extend([0u8; 30]);
        dequantize_row(DType::Q8_0, &b, &mut out).unwrap();
        assert_eq!(&out[..3], &[-32.0, 31.75, 0.0]);
        // BF16 0x4049 = 3.140625, F16 0xC000 = −2, F32 1.0.
        let mut two = [0.0f32; 2];
        dequantize_row(DType::BF16, &[0x49, 0x40, 0x80, 0x3F], &mut two).unwrap();
        assert_eq!(two, [3.140625, 1.0]);
        dequantize_row(DType::F16, &[0x00, 0xC0, 0x00, 0x3C], &mut two).unwrap();
        assert_eq!(two, [-2.0, 1.0]);
        dequantize_row(DType::F32, &[0, 0, 0x80, 0x3F, 0, 0, 0, 0], &mut two).unwrap();
        assert_eq!(two, [1.0, 0.0]);
    }

    #[test]
    fn bad_lengths_are_errors() {
        let mut out = [0.0f32; 33];
        assert!(matches!(
            dequantize_row(DType::Q4_0, &[0; 36], &mut out),
            Err(DequantError::PartialBlock { .. })
        ));
        let mut out = [0.0f32; 32];
        assert!(matches!(
            dequantize_row(DType::Q8_0, &[0; 33], &mut out),
            Err(DequantError::Length {
                need: 34,
                got: 33,
                ..
            })
        ));
        assert!(dequantize_row(DType::BF16, &[0; 3], &mut [0.0; 2]).is_err());
    }
}
