//! The engine's dequantisers: a row of weights in its file type ([`DType`]) → f32.
//!
//! A leaf module (it depends on nothing but the type enum), so the kernels in [`crate::ops`]
//! (embedding lookup) and the loaders ([`crate::weights`], [`crate::gguf`]) can both use it.
//! Block layouts are in [`crate::dtype`]; every multi-byte field is little-endian. For the
//! block types the f16 scale (and minimum) is widened to f32 first, then each value is one f32
//! product (plus the minimum for Q4_1), unfused: `x = d·q`, `x = d·(q − 8)`, `x = d·q + m`.
//! Nibble order: the low nibble of byte `j` of a block is value `j`, the high nibble value
//! `j + 16`.
//!
//! The scalar reference crate has its own dequantisers (`tinygpt_reference::ggml`); the
//! engine does not call them for the types it multiplies natively (F32, F16, BF16, Q8_0,
//! Q4_0, Q4_1), and `tests/dequant.rs` checks that the two agree bit for bit. The other
//! GGML types (Q5_0, Q5_1, IQ4_NL, the K-quants, IQ4_XS) are dequantised once at load with
//! the reference's loops (`tinygpt_reference::ggml_more`), checked against gguf-py in
//! `tests/dequant_types.rs`.

use crate::dtype::DType;
use half::{bf16, f16};
pub use tinygpt_reference::ggml::DequantError;
use tinygpt_reference::ggml_more as more;

/// Values per block of the block-quantised types.
const BLOCK: usize = 32;

/// The native type a tensor of `dtype` runs as when that is an exact rewrite of its blocks
/// into a type with kernels, and the rewritten bytes: Q5_0 and IQ4_NL become Q8_0
/// (`tinygpt_reference::ggml_more::{q5_0_to_q8_0, iq4_nl_to_q8_0}`; same values, same dot
/// products, 34 bytes per 32 values instead of 22 / 18). `None` for other types. `bytes`
/// must hold whole blocks (an error names the lengths otherwise). Both types have kernels
/// of their own and reach the packer as blocks, which rewrites them the same way only for a
/// kernel variant without code for them (`ops::qdot::Packed::new_for`).
pub fn repack_native(dtype: DType, bytes: &[u8]) -> Option<Result<(DType, Vec<u8>), DequantError>> {
    type Rewrite = fn(&[u8]) -> Vec<u8>;
    let (block, f): (usize, Rewrite) = match dtype {
        DType::Q5_0 => (22, more::q5_0_to_q8_0),
        DType::IQ4_NL => (18, more::iq4_nl_to_q8_0),
        _ => return None,
    };
    if !bytes.len().is_multiple_of(block) {
        let n = bytes.len() / block * BLOCK;
        return Some(Err(DequantError::Length {
            ty: dtype,
            n,
            need: n / BLOCK * block,
            got: bytes.len(),
        }));
    }
    Some(Ok((DType::Q8_0, f(bytes))))
}

/// Dequantises `out.len()` values of `dtype` stored in `bytes`, checking that `bytes` holds
/// exactly that many values (an error, never a panic, on a mismatch).
pub fn dequantize_row(dtype: DType, bytes: &[u8], out: &mut [f32]) -> Result<(), DequantError> {
    let n = out.len();
    let need = dtype.bytes_for(n).ok_or(DequantError::PartialBlock {
        ty: dtype,
        n,
        block: dtype.block_len(),
    })?;
    if bytes.len() != need {
        return Err(DequantError::Length {
            ty: dtype,
            n,
            need,
            got: bytes.len(),
        });
    }
    dequantize_into(dtype, bytes, out);
    Ok(())
}

/// Dequantises `bytes` of `dtype` into `out`. Precondition (unchecked beyond what slicing
/// checks; see [`dequantize_row`] for the checked form): `bytes` holds exactly
/// `out.len()` values. Values past the shorter of the two are left untouched.
pub fn dequantize_into(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        DType::F32 => plain::<4>(bytes, out, f32::from_le_bytes),
        DType::F16 => plain::<2>(bytes, out, |b| f16::from_le_bytes(b).to_f32()),
        DType::BF16 => plain::<2>(bytes, out, |b| bf16::from_le_bytes(b).to_f32()),
        DType::Q8_0 => blocks(dtype, bytes, out, q8_0_block),
        DType::Q4_0 => blocks(dtype, bytes, out, q4_0_block),
        DType::Q4_1 => blocks(dtype, bytes, out, q4_1_block),
        // Types without native kernels are dequantised once, when the model is loaded: no
        // hot path, so the engine runs the reference's plain loops (docs/design.md §2.2).
        DType::Q5_0 => more::dequantize_q5_0(bytes, out),
        DType::Q5_1 => more::dequantize_q5_1(bytes, out),
        DType::IQ4_NL => more::dequantize_iq4_nl(bytes, out),
        DType::Q2_K => more::dequantize_q2_k(bytes, out),
        DType::Q3_K => more::dequantize_q3_k(bytes, out),
        DType::Q4_K => more::dequantize_q4_k(bytes, out),
        DType::Q5_K => more::dequantize_q5_k(bytes, out),
        DType::Q6_K => more::dequantize_q6_k(bytes, out),
        DType::IQ4_XS => more::dequantize_iq4_xs(bytes, out),
    }
}

/// One value per `W` bytes.
#[inline]
fn plain<const W: usize>(bytes: &[u8], out: &mut [f32], decode: impl Fn([u8; W]) -> f32) {
    for (o, c) in out.iter_mut().zip(bytes.chunks_exact(W)) {
        *o = decode(c.try_into().expect("chunk of W bytes"));
    }
}

/// [`BLOCK`] values per `dtype.block_bytes()` bytes.
#[inline]
fn blocks(dtype: DType, bytes: &[u8], out: &mut [f32], block: fn(&[u8], &mut [f32; BLOCK])) {
    for (b, o) in bytes
        .chunks_exact(dtype.block_bytes())
        .zip(out.chunks_exact_mut(BLOCK))
    {
        block(b, o.try_into().expect("chunk of BLOCK values"));
    }
}

#[inline]
fn half_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Q8_0: `d: f16 | q: [i8; 32]`, `x = d·q`.
#[inline]
fn q8_0_block(b: &[u8], out: &mut [f32; BLOCK]) {
    let d = half_at(b, 0);
    for (o, &q) in out.iter_mut().zip(&b[2..2 + BLOCK]) {
        *o = d * f32::from(q as i8);
    }
}

/// The two nibbles of each of 16 bytes: low nibbles → values 0..16, high → 16..32.
#[inline]
fn nibbles(qs: &[u8]) -> [u8; BLOCK] {
    let mut n = [0u8; BLOCK];
    let (lo, hi) = n.split_at_mut(BLOCK / 2);
    for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&qs[..BLOCK / 2]) {
        *l = q & 0x0F;
        *h = q >> 4;
    }
    n
}

/// Q4_0: `d: f16 | qs: [u8; 16]`, `x = d·(q − 8)`.
#[inline]
fn q4_0_block(b: &[u8], out: &mut [f32; BLOCK]) {
    let d = half_at(b, 0);
    for (o, q) in out.iter_mut().zip(nibbles(&b[2..])) {
        *o = d * f32::from(q as i8 - 8);
    }
}

/// Q4_1: `d: f16 | m: f16 | qs: [u8; 16]`, `x = d·q + m`.
#[inline]
fn q4_1_block(b: &[u8], out: &mut [f32; BLOCK]) {
    let (d, m) = (half_at(b, 0), half_at(b, 2));
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
