//! Scalar dequantisation of GGML tensor rows (the element types a GGUF file may hold).
//!
//! Plain loops, one element at a time: this is the oracle the engine's dequantisers and
//! quantised matvec kernels are tested against. All multi-byte fields are little-endian.
//!
//! # Block layouts
//!
//! Plain types have a "block" of one element:
//!
//! | type | bytes/elem | value                                      |
//! |------|------------|--------------------------------------------|
//! | F32  | 4          | IEEE binary32                               |
//! | F16  | 2          | IEEE binary16                               |
//! | BF16 | 2          | the upper 16 bits of a binary32             |
//!
//! Block-quantised types hold 32 consecutive elements of a row per block (a row is always a
//! whole number of blocks):
//!
//! ```text
//! Q8_0  (34 bytes):  d: f16 | qs: [i8; 32]
//!                    x[i] = d * qs[i]                                   i = 0..32
//!
//! Q4_0  (18 bytes):  d: f16 | qs: [u8; 16]
//!                    x[j]      = d * ((qs[j] & 0x0F) as i32 - 8)        j = 0..16
//!                    x[j + 16] = d * ((qs[j] >> 4)   as i32 - 8)
//!
//! Q4_1  (20 bytes):  d: f16 | m: f16 | qs: [u8; 16]
//!                    x[j]      = d * (qs[j] & 0x0F) + m                 j = 0..16
//!                    x[j + 16] = d * (qs[j] >> 4)   + m
//! ```
//!
//! Nibble order (Q4_0, Q4_1): the LOW nibble of byte `j` is element `j` of the block and the
//! HIGH nibble is element `j + 16`; elements are not interleaved pairwise. This is ggml's
//! `dequantize_row_q4_0`/`_q4_1` order (and the order transformers' GGUF loader uses).
//! The scales `d`, `m` are converted to f32 first; the products are computed in f32.

use crate::ggml_more;
use half::{bf16, f16};

/// Elements per quantisation block of Q8_0, Q4_0 and Q4_1 (and the other 32-wide types),
/// the weight types with their format facts, and the dequantisers' error: shared with the
/// engine through `tinygpt-types` (the layouts of the types after Q4_1 are in
/// [`crate::ggml_more`]).
pub use tinygpt_types::ggml::{DequantError, GgmlType, QK};

/// Dequantises `out.len()` elements stored as `ty` in `bytes` into `out`.
///
/// `bytes` must hold exactly `out.len() / block_len` blocks (checked; returns an error, never
/// panics, on a mismatch).
pub fn dequantize_row(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), DequantError> {
    ty.check_len(out.len(), bytes.len())?;
    match ty {
        GgmlType::F32 => dequantize_f32(bytes, out),
        GgmlType::F16 => dequantize_f16(bytes, out),
        GgmlType::BF16 => dequantize_bf16(bytes, out),
        GgmlType::Q8_0 => dequantize_q8_0(bytes, out),
        GgmlType::Q4_0 => dequantize_q4_0(bytes, out),
        GgmlType::Q4_1 => dequantize_q4_1(bytes, out),
        GgmlType::Q5_0 => ggml_more::dequantize_q5_0(bytes, out),
        GgmlType::Q5_1 => ggml_more::dequantize_q5_1(bytes, out),
        GgmlType::IQ4_NL => ggml_more::dequantize_iq4_nl(bytes, out),
        GgmlType::Q2_K => ggml_more::dequantize_q2_k(bytes, out),
        GgmlType::Q3_K => ggml_more::dequantize_q3_k(bytes, out),
        GgmlType::Q4_K => ggml_more::dequantize_q4_k(bytes, out),
        GgmlType::Q5_K => ggml_more::dequantize_q5_k(bytes, out),
        GgmlType::Q6_K => ggml_more::dequantize_q6_k(bytes, out),
        GgmlType::IQ4_XS => ggml_more::dequantize_iq4_xs(bytes, out),
    }
    Ok(())
}

pub(crate) fn f16_at(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

/// F32 row. Precondition: `bytes.len() == 4 * out.len()`.
pub fn dequantize_f32(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

/// F16 row. Precondition: `bytes.len() == 2 * out.len()`.
pub fn dequantize_f16(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
    }
}

/// BF16 row. Precondition: `bytes.len() == 2 * out.len()`.
pub fn dequantize_bf16(bytes: &[u8], out: &mut [f32]) {
    for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
    }
}

/// Q8_0 row. Precondition: `out.len() % 32 == 0`, `bytes.len() == out.len() / 32 * 34`.
pub fn dequantize_q8_0(bytes: &[u8], out: &mut [f32]) {
    for (blk, o) in bytes.chunks_exact(34).zip(out.chunks_exact_mut(QK)) {
        let d = f16_at(blk, 0);
        for i in 0..QK {
            o[i] = d * (blk[2 + i] as i8) as f32;
        }
    }
}

/// Q4_0 row. Precondition: `out.len() % 32 == 0`, `bytes.len() == out.len() / 32 * 18`.
pub fn dequantize_q4_0(bytes: &[u8], out: &mut [f32]) {
    for (blk, o) in bytes.chunks_exact(18).zip(out.chunks_exact_mut(QK)) {
        let d = f16_at(blk, 0);
        for j in 0..QK / 2 {
            let q = blk[2 + j];
            o[j] = d * ((q & 0x0F) as i32 - 8) as f32;
            o[j + QK / 2] = d * ((q >> 4) as i32 - 8) as f32;
        }
    }
}

/// Q4_1 row. Precondition: `out.len() % 32 == 0`, `bytes.len() == out.len() / 32 * 20`.
pub fn dequantize_q4_1(bytes: &[u8], out: &mut [f32]) {
    for (blk, o) in bytes.chunks_exact(20).zip(out.chunks_exact_mut(QK)) {
        let d = f16_at(blk, 0);
        let m = f16_at(blk, 2);
        for j in 0..QK / 2 {
            let q = blk[4 + j];
            o[j] = d * (q & 0x0F) as f32 + m;
            o[j + QK / 2] = d * (q >> 4) as f32 + m;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // f16 bit patterns used below: 0x3800 = 0.5, 0x3C00 = 1.0, 0x4000 = 2.0, 0xBC00 = -1.0,
    // 0x3400 = 0.25.

    #[test]
    fn f32_f16_bf16_literal_bytes() {
        let mut out = [0.0f32; 2];
        dequantize_row(GgmlType::F32, &[0, 0, 0x80, 0x3F, 0, 0, 0, 0xC0], &mut out).unwrap();
        assert_eq!(out, [1.0, -2.0]);
        dequantize_row(GgmlType::F16, &[0x00, 0x3C, 0x00, 0xC0], &mut out).unwrap();
        assert_eq!(out, [1.0, -2.0]);
        // bf16 0x3F80 = 1.0, 0x4049 = 3.140625
        dequantize_row(GgmlType::BF16, &[0x80, 0x3F, 0x49, 0x40], &mut out).unwrap();
        assert_eq!(out, [1.0, 3.140625]);
    }

    #[test]
    fn q8_0_literal_block() {
        let mut blk = vec![0x00, 0x38]; // d = 0.5
        for i in 0..32i32 {
            blk.push((i - 16) as i8 as u8); // q = -16..16
        }
        let mut out = [0.0f32; 32];
        dequantize_row(GgmlType::Q8_0, &blk, &mut out).unwrap();
        for (i, &x) in out.iter().enumerate() {
            assert_eq!(x, 0.5 * (i as f32 - 16.0), "element {i}");
        }
        // extreme codes
        blk[2] = 0x80; // -128
        blk[3] = 0x7F; // 127
        dequantize_row(GgmlType::Q8_0, &blk, &mut out).unwrap();
        assert_eq!(out[0], -64.0);
        assert_eq!(out[1], 63.5);
    }

    #[test]
    fn q4_0_literal_block_low_nibble_first_half() {
        // d = 2.0; byte j = (hi << 4) | lo with lo = j, hi = 15 - j.
        let mut blk = vec![0x00, 0x40];
        for j in 0..16u8 {
            blk.push(((15 - j) << 4) | j);
        }
        let mut out = [0.0f32; 32];
        dequantize_row(GgmlType::Q4_0, &blk, &mut out).unwrap();
        for j in 0..16 {
            assert_eq!(out[j], 2.0 * (j as f32 - 8.0), "low nibble -> element {j}");
            assert_eq!(
                out[j + 16],
                2.0 * ((15 - j) as f32 - 8.0),
                "high nibble -> element {}",
                j + 16
            );
        }
        // hand-computed spot values: byte 0 = 0xF0 -> x[0] = 2*(0-8) = -16, x[16] = 2*(15-8) = 14
        assert_eq!(out[0], -16.0);
        assert_eq!(out[16], 14.0);
    }

    #[test]
    fn q4_1_literal_block() {
        // d = 0.25, m = -1.0; bytes 0x21 everywhere: low nibble 1, high nibble 2.
        let mut blk = vec![0x00, 0x34, 0x00, 0xBC];
        blk.extend([0x21; 16]);
        let mut out = [0.0f32; 32];
        dequantize_row(GgmlType::Q4_1, &blk, &mut out).unwrap();
        assert!(out[..16].iter().all(|&x| x == 0.25 * 1.0 - 1.0));
        assert!(out[16..].iter().all(|&x| x == 0.25 * 2.0 - 1.0));
        // Two blocks in a row: the second block's data follows the first's 20 bytes.
        let mut two = blk.clone();
        two.extend([0x00, 0x3C, 0x00, 0x00]); // d = 1, m = 0
        two.extend((0..16u8).map(|j| (j << 4) | (15 - j)));
        let mut out2 = [0.0f32; 64];
        dequantize_row(GgmlType::Q4_1, &two, &mut out2).unwrap();
        assert_eq!(&out2[..32], &out[..]);
        for j in 0..16 {
            assert_eq!(out2[32 + j], (15 - j) as f32);
            assert_eq!(out2[48 + j], j as f32);
        }
    }

    #[test]
    fn length_errors_do_not_panic() {
        let mut out = [0.0f32; 31];
        assert!(matches!(
            dequantize_row(GgmlType::Q8_0, &[0; 34], &mut out),
            Err(DequantError::PartialBlock { .. })
        ));
        let mut out = [0.0f32; 32];
        assert!(matches!(
            dequantize_row(GgmlType::Q4_1, &[0; 19], &mut out),
            Err(DequantError::Length {
                need: 20,
                got: 19,
                ..
            })
        ));
        assert!(dequantize_row(GgmlType::F32, &[0; 3], &mut [0.0; 1]).is_err());
    }

    #[test]
    fn block_sizes() {
        assert_eq!(GgmlType::Q8_0.block_bytes(), 34);
        assert_eq!(GgmlType::Q4_0.block_bytes(), 18);
        assert_eq!(GgmlType::Q4_1.block_bytes(), 20);
        assert_eq!(GgmlType::BF16.block_len(), 1);
    }
}
