//! The fields of the block formats, decoded: the engine's own readers of what a GGML block
//! holds besides its codes (f16 scales, packed sub-block scales and minimums, fifth bits),
//! shared by the dequantisers ([`super::dequant`]) and the kernels of every instruction
//! set. The reference has its own (`tinygpt_reference::ggml_more`, `ggml_kdot`); the two
//! are compared through everything built on them (`tests/dequant.rs`,
//! `tests/kquant_dispatch.rs`). Layouts: `reference/src/ggml_more.rs`.

use crate::dtype::DType;
pub use tinygpt_types::ggml::{IQ4_VALUES, QK, QK_K};

/// Bytes of one block of each type read here.
pub const Q5_1_BYTES: usize = DType::Q5_1.block_bytes();
pub const Q2_K_BYTES: usize = DType::Q2_K.block_bytes();
pub const Q3_K_BYTES: usize = DType::Q3_K.block_bytes();
pub const Q4_K_BYTES: usize = DType::Q4_K.block_bytes();
pub const Q5_K_BYTES: usize = DType::Q5_K.block_bytes();
pub const Q6_K_BYTES: usize = DType::Q6_K.block_bytes();
pub const IQ4_XS_BYTES: usize = DType::IQ4_XS.block_bytes();

/// The little-endian f16 at `b[at..at + 2]`, widened to f32 (exact).
#[inline(always)]
pub fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// Scale and minimum of sub-block `j` (0..8) of a Q4_K / Q5_K super-block, from its 12
/// scale bytes `s`: six bits each. Sub-blocks 0–3 keep them in the low six bits of bytes
/// `j` (scale) and `j + 4` (minimum); sub-blocks 4–7 in the low and high nibbles of byte
/// `j + 4`, topped by the high two bits of bytes `j − 4` and `j`.
#[inline]
pub fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        return (s[j] & 0x3F, s[j + 4] & 0x3F);
    }
    let low = s[j + 4];
    (
        (low & 0x0F) | ((s[j - 4] >> 6) << 4),
        (low >> 4) | ((s[j] >> 6) << 4),
    )
}

/// The 16 signed six-bit scales of a Q3_K super-block (12 bytes `s`), each stored as
/// `scale + 32`: the low four bits are the low (sub-blocks 0–7) or high (8–15) nibble of
/// byte `k mod 8`, the high two bits come from bytes 8–11.
#[inline]
pub fn q3_k_scales(s: &[u8]) -> [i32; 16] {
    std::array::from_fn(|k| {
        let low = if k < 8 { s[k] & 0x0F } else { s[k - 8] >> 4 };
        let high = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
        i32::from(low | (high << 4)) - 32
    })
}

/// The 16 Q3_K scales plus 32 (bytes `0..=63`) from the 12 packed bytes, four at a time
/// with 32-bit masks (the values of [`q3_k_scales`], plus 32, without its per-scale
/// branches): what the AVX2 and NEON rows read.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[inline(always)]
pub fn q3_k_scale_bytes(s: &[u8]) -> [u8; 16] {
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

/// The six-bit scale `ls` of sub-block `ib` (0..8) of an IQ4_XS super-block `blk`: the low
/// four bits are nibble `ib mod 2` of `scales_l[ib / 2]` (`blk[4..8]`), the high two bits
/// `2·ib` of `scales_h` (`blk[2..4]`, little-endian). The sub-block's scale is `ls − 32`.
#[inline]
pub fn iq4_xs_scale(blk: &[u8], ib: usize) -> i32 {
    let low = (blk[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F;
    let scales_h = u16::from_le_bytes([blk[2], blk[3]]);
    let high = ((scales_h >> (2 * ib)) & 3) as u8;
    i32::from(low | (high << 4))
}

/// The two nibbles of each of 16 bytes in value order: low nibbles → values 0..16, high
/// nibbles → values 16..32 (Q4_0, Q4_1, Q5_x, IQ4_NL, each IQ4_XS sub-block).
#[inline]
pub fn nibbles(qs: &[u8]) -> [u8; QK] {
    let mut n = [0u8; QK];
    let (lo, hi) = n.split_at_mut(QK / 2);
    for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&qs[..QK / 2]) {
        *l = q & 0x0F;
        *h = q >> 4;
    }
    n
}

/// The 32 five-bit codes (0..32) of a Q5_0 / Q5_1 block whose `qh: u32` is at `at` (2 for
/// Q5_0, 4 for Q5_1) with its 16 nibble bytes right after: the nibbles in value order, bit
/// `i` of `qh` on top of value `i` as `0x10`.
#[inline]
pub fn q5_codes(b: &[u8], at: usize) -> [u8; QK] {
    let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
    let mut c = nibbles(&b[at + 4..]);
    for (i, c) in c.iter_mut().enumerate() {
        *c |= (((qh >> i) & 1) as u8) << 4;
    }
    c
}

/// The 256 two-bit codes (0..4) of a Q2_K / Q3_K super-block's 64 code bytes in value
/// order: value `128n + 32j + l` is bits `2j..2j + 2` of `qs[32n + l]`.
#[inline]
pub fn two_bit_codes(qs: &[u8]) -> [u8; QK_K] {
    std::array::from_fn(|v| (qs[32 * (v / 128) + v % 32] >> (2 * (v % 128 / 32))) & 3)
}

/// The 256 signed three-bit codes (−4..4) of a Q3_K super-block in value order: the
/// two-bit code of `qs = blk[32..96]`, minus 4 unless bit `4n + j` of `hmask[l]`
/// (`hmask = blk[0..32]`) is set, for value `128n + 32j + l`.
#[inline]
pub fn q3_k_codes(blk: &[u8]) -> [i8; QK_K] {
    let low = two_bit_codes(&blk[32..96]);
    std::array::from_fn(|v| {
        let high = (blk[v % 32] >> (4 * (v / 128) + v % 128 / 32)) & 1;
        low[v] as i8 - if high == 1 { 0 } else { 4 }
    })
}

/// The 256 codes of a Q4_K (`five = false`, 0..16) or Q5_K (`five = true`, 0..32)
/// super-block in value order: sub-block pair `(2i, 2i + 1)` reads bytes
/// `qs[32i..32i + 32]` (Q4_K `blk[16..144]`, Q5_K `blk[48..176]`), low nibbles then high
/// nibbles; Q5_K tops value `l` of sub-block `k` with bit `k` of `qh[l]` (`blk[16..48]`).
#[inline]
pub fn k4_codes(blk: &[u8], five: bool) -> [u8; QK_K] {
    let qs = if five { &blk[48..176] } else { &blk[16..144] };
    std::array::from_fn(|v| {
        let (k, l) = (v / 32, v % 32);
        let byte = qs[32 * (k / 2) + l];
        let nibble = if k % 2 == 0 { byte & 0x0F } else { byte >> 4 };
        let fifth = if five {
            ((blk[16 + l] >> k) & 1) << 4
        } else {
            0
        };
        nibble | fifth
    })
}

/// The 256 six-bit codes (0..64, before Q6_K's −32) of a Q6_K super-block in value order:
/// in half `n` (values `128n..`), with `ql = blk[64n..]`, `qh = blk[128 + 32n..]`, value
/// `l + 32k` (`l < 32`, `k < 4`) is a nibble of `ql[l]` (k = 0, 2) or `ql[l + 32]`
/// (k = 1, 3), low for k < 2, topped by bits `2k..2k + 2` of `qh[l]`.
#[inline]
pub fn q6_k_codes(blk: &[u8]) -> [u8; QK_K] {
    std::array::from_fn(|v| {
        let (n, k, l) = (v / 128, v % 128 / 32, v % 32);
        let byte = blk[64 * n + l + 32 * (k % 2)];
        let nibble = if k < 2 { byte & 0x0F } else { byte >> 4 };
        nibble | (((blk[128 + 32 * n + l] >> (2 * k)) & 3) << 4)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use tinygpt_reference::{ggml_dot, ggml_kdot, ggml_more};

    /// A small deterministic byte stream (xorshift64*).
    fn bytes(seed: u64, n: usize) -> Vec<u8> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s ^= s >> 12;
                s ^= s << 25;
                s ^= s >> 27;
                (s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 56) as u8
            })
            .collect()
    }

    /// Every field reader equals the reference's on random bytes and on all-zero and
    /// all-one bytes.
    #[test]
    fn fields_equal_the_reference() {
        let mut cases: Vec<Vec<u8>> = (0..500).map(|i| bytes(i + 1, 210)).collect();
        cases.push(vec![0; 210]);
        cases.push(vec![0xFF; 210]);
        for b in &cases {
            for j in 0..8 {
                assert_eq!(
                    scale_min_k4(j, &b[4..16]),
                    ggml_more::scale_min_k4(j, &b[4..16])
                );
                assert_eq!(iq4_xs_scale(b, j), ggml_kdot::iq4_xs_scale(b, j));
            }
            let want = ggml_more::q3_k_scales(&b[96..108]);
            assert_eq!(q3_k_scales(&b[96..108]), want);
            #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
            assert_eq!(q3_k_scale_bytes(&b[96..108]).map(|v| v as i32 - 32), want);
            assert_eq!(q5_codes(&b[..24], 4), ggml_dot::q5_1_codes(&b[..24]));
            assert_eq!(q5_codes(&b[..22], 2), ggml_dot::q5_0_codes(&b[..22]));
            assert_eq!(
                two_bit_codes(&b[16..80]),
                ggml_kdot::two_bit_codes(&b[16..80])
            );
            assert_eq!(q3_k_codes(&b[..110]), ggml_kdot::q3_k_codes(&b[..110]));
            assert_eq!(k4_codes(&b[..144], false), ggml_kdot::q4_k_codes(&b[..144]));
            assert_eq!(k4_codes(&b[..176], true), ggml_kdot::q5_k_codes(&b[..176]));
            assert_eq!(q6_k_codes(b), ggml_kdot::q6_k_codes(b));
            assert_eq!(f16_at(b, 6).to_bits(), ggml_more_f16(b, 6).to_bits());
        }
    }

    fn ggml_more_f16(b: &[u8], at: usize) -> f32 {
        half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
    }

    #[test]
    fn byte_counts_are_the_formats() {
        assert_eq!(
            [
                Q5_1_BYTES,
                Q2_K_BYTES,
                Q3_K_BYTES,
                Q4_K_BYTES,
                Q5_K_BYTES,
                Q6_K_BYTES,
                IQ4_XS_BYTES
            ],
            [24, 84, 110, 144, 176, 210, 136]
        );
        assert_eq!(ggml_kdot::Q4_K_BYTES, Q4_K_BYTES);
        assert_eq!(ggml_kdot::Q6_K_BYTES, Q6_K_BYTES);
    }
}
