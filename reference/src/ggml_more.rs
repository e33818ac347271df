//! Scalar dequantisers of the other GGML block types a small model's GGUF holds: the
//! 5-bit 32-wide types, the K-quants (super-blocks of 256) and the non-linear IQ4 types.
//! Plain loops, one block at a time, as ggml's `dequantize_row_*` (ggml-quants.c) define
//! them; every scale is converted from f16 to f32 first and each product is taken in f32
//! in the order written below. Checked against an independent implementation, the `gguf`
//! package's `gguf.quants.dequantize`, in `tests/dequant_types.rs`.
//!
//! ```text
//! Q5_0   (22 B / 32):  d: f16 | qh: u32 | qs: [u8; 16]
//!        x[j]      = d · ((qs[j] & 0xF | bit j of qh << 4) − 16)           j < 16
//!        x[j + 16] = d · ((qs[j] >> 4  | bit j+16 of qh << 4) − 16)
//! Q5_1   (24 B / 32):  d: f16 | m: f16 | qh: u32 | qs: [u8; 16]   as Q5_0 without −16, then + m
//! IQ4_NL (18 B / 32):  d: f16 | qs: [u8; 16]
//!        x[j] = d · K[qs[j] & 0xF],  x[j + 16] = d · K[qs[j] >> 4]     (K = IQ4_VALUES)
//! Q2_K   (84 B / 256): scales: [u8; 16] | qs: [u8; 64] | d: f16 | dmin: f16
//! Q3_K  (110 B / 256): hmask: [u8; 32] | qs: [u8; 64] | scales: [u8; 12] | d: f16
//! Q4_K  (144 B / 256): d: f16 | dmin: f16 | scales: [u8; 12] | qs: [u8; 128]
//! Q5_K  (176 B / 256): d: f16 | dmin: f16 | scales: [u8; 12] | qh: [u8; 32] | qs: [u8; 128]
//! Q6_K  (210 B / 256): ql: [u8; 128] | qh: [u8; 64] | scales: [i8; 16] | d: f16
//! IQ4_XS (136 B / 256): d: f16 | scales_h: u16 | scales_l: [u8; 4] | qs: [u8; 128]
//! ```
//!
//! The K-quant sub-block layouts are spelled out at each function.

use crate::ggml::f16_at;

/// Values per K-quant super-block, and the 16 levels of IQ4_NL and IQ4_XS codes (ggml's
/// `kvalues_iq4nl`): format constants shared with the engine through `tinygpt-types`.
pub use tinygpt_types::ggml::{IQ4_VALUES, QK_K};

/// Q5_0 row (blocks of 22 bytes, 32 values).
pub fn dequantize_q5_0(bytes: &[u8], out: &mut [f32]) {
    for (blk, o) in bytes.chunks_exact(22).zip(out.chunks_exact_mut(32)) {
        let d = f16_at(blk, 0);
        let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
        for j in 0..16 {
            let q = blk[6 + j];
            let lo = (q & 0x0F) as i32 | ((((qh >> j) & 1) as i32) << 4);
            let hi = (q >> 4) as i32 | ((((qh >> (j + 16)) & 1) as i32) << 4);
            o[j] = d * (lo - 16) as f32;
            o[j + 16] = d * (hi - 16) as f32;
        }
    }
}

/// Q5_1 row (blocks of 24 bytes, 32 values).
pub fn dequantize_q5_1(bytes: &[u8], out: &mut [f32]) {
    for (blk, o) in bytes.chunks_exact(24).zip(out.chunks_exact_mut(32)) {
        let d = f16_at(blk, 0);
        let m = f16_at(blk, 2);
        let qh = u32::from_le_bytes([blk[4], blk[5], blk[6], blk[7]]);
        for j in 0..16 {
            let q = blk[8 + j];
            let lo = (q & 0x0F) as u32 | (((qh >> j) & 1) << 4);
            let hi = (q >> 4) as u32 | (((qh >> (j + 16)) & 1) << 4);
            o[j] = d * lo as f32 + m;
            o[j + 16] = d * hi as f32 + m;
        }
    }
}

/// IQ4_NL row (blocks of 18 bytes, 32 values).
pub fn dequantize_iq4_nl(bytes: &[u8], out: &mut [f32]) {
    for (blk, o) in bytes.chunks_exact(18).zip(out.chunks_exact_mut(32)) {
        let d = f16_at(blk, 0);
        for j in 0..16 {
            let q = blk[2 + j];
            o[j] = d * IQ4_VALUES[(q & 0x0F) as usize] as f32;
            o[j + 16] = d * IQ4_VALUES[(q >> 4) as usize] as f32;
        }
    }
}

/// Q5_0 blocks rewritten as Q8_0 blocks (34 bytes: the same f16 `d`, then 32 signed
/// bytes): code `q − 16` of element `j` becomes byte `j`. Exact: every value `d · (q − 16)`
/// is unchanged, and so is ggml's dot product with a Q8_0 activation block, which for both
/// types is `(d_w · d_x) · Σ_j c_j · x_j` over the same signed codes `c_j`.
pub fn q5_0_to_q8_0(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len() / 22 * 34);
    for blk in bytes.chunks_exact(22) {
        out.extend_from_slice(&blk[0..2]);
        let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
        let mut codes = [0i8; 32];
        for j in 0..16 {
            let q = blk[6 + j];
            let lo = (q & 0x0F) as i32 | ((((qh >> j) & 1) as i32) << 4);
            let hi = (q >> 4) as i32 | ((((qh >> (j + 16)) & 1) as i32) << 4);
            codes[j] = (lo - 16) as i8;
            codes[j + 16] = (hi - 16) as i8;
        }
        out.extend(codes.iter().map(|&c| c as u8));
    }
    out
}

/// IQ4_NL blocks rewritten as Q8_0 blocks: code `K[n]` of each nibble `n` becomes a signed
/// byte (the levels span −127..113). Exact, as [`q5_0_to_q8_0`]: ggml's IQ4_NL dot product
/// is `(d_w · d_x) · Σ_j K[n_j] · x_j`, the Q8_0 one over the same codes.
pub fn iq4_nl_to_q8_0(bytes: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(bytes.len() / 18 * 34);
    for blk in bytes.chunks_exact(18) {
        out.extend_from_slice(&blk[0..2]);
        let mut codes = [0i8; 32];
        for j in 0..16 {
            let q = blk[2 + j];
            codes[j] = IQ4_VALUES[(q & 0x0F) as usize];
            codes[j + 16] = IQ4_VALUES[(q >> 4) as usize];
        }
        out.extend(codes.iter().map(|&c| c as u8));
    }
    out
}

/// Scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K super-block: 6 bits each, packed in
/// 12 bytes (ggml's `get_scale_min_k4`). Sub-blocks 0–3: low 6 bits of bytes `j` (scale)
/// and `j + 4` (min); 4–7: the low / high nibble of byte `j + 4` with the top two bits of
/// bytes `j − 4` / `j` above them.
pub fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// Q4_K row: 8 sub-blocks of 32; sub-block pair `(2i, 2i + 1)` reads the 32 bytes
/// `qs[32i..32i + 32]`, low nibbles then high nibbles; `x = d·sc · q − dmin·m`.
pub fn dequantize_q4_k(bytes: &[u8], out: &mut [f32]) {
    for (blk, o) in bytes.chunks_exact(144).zip(out.chunks_exact_mut(QK_K)) {
        k4_super_block(blk, None, &blk[16..144], o);
    }
}

/// Q5_K row: as Q4_K with a fifth bit from `qh`: for sub-block pair `i`, bit `2i` of
/// `qh[l]` tops the low-nibble value `l` and bit `2i + 1` the high-nibble one.
pub fn dequantize_q5_k(bytes: &[u8], out: &mut [f32]) {
    for (blk, o) in bytes.chunks_exact(176).zip(out.chunks_exact_mut(QK_K)) {
        k4_super_block(blk, Some(&blk[16..48]), &blk[48..176], o);
    }
}

/// One Q4_K / Q5_K super-block: `d`, `dmin` and the 12 scale bytes at the start of `blk`,
/// nibbles `qs`, and for Q5_K the fifth bits `qh`.
fn k4_super_block(blk: &[u8], qh: Option<&[u8]>, qs: &[u8], o: &mut [f32]) {
    let d = f16_at(blk, 0);
    let dmin = f16_at(blk, 2);
    let scales = &blk[4..16];
    let high = |l: usize, bit: usize| qh.map_or(0, |h| ((h[l] >> bit) & 1) << 4);
    for i in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * i, scales);
        let (sc2, m2) = scale_min_k4(2 * i + 1, scales);
        let (d1, min1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, min2) = (d * sc2 as f32, dmin * m2 as f32);
        for l in 0..32 {
            let q = qs[32 * i + l];
            o[64 * i + l] = d1 * ((q & 0x0F) | high(l, 2 * i)) as f32 - min1;
            o[64 * i + 32 + l] = d2 * ((q >> 4) | high(l, 2 * i + 1)) as f32 - min2;
        }
    }
}

/// Q6_K row: two halves of 128; in half `n`, with `ql = ql[64n..]`, `qh = qh[32n..]`,
/// `sc = scales[8n..]`, for `l < 32` the four values `l`, `l + 32`, `l + 64`, `l + 96` are
/// `(ql[l] & 0xF, ql[l + 32] & 0xF, ql[l] >> 4, ql[l + 32] >> 4)` each topped by two bits of
/// `qh[l]` (bits 0–1, 2–3, 4–5, 6–7), minus 32, times `d · sc[l / 16 + 0, 2, 4, 6]`.
pub fn dequantize_q6_k(bytes: &[u8], out: &mut [f32]) {
    for (blk, o) in bytes.chunks_exact(210).zip(out.chunks_exact_mut(QK_K)) {
        let ql = &blk[0..128];
        let qh = &blk[128..192];
        let scales = &blk[192..208];
        let d = f16_at(blk, 208);
        for n in 0..2 {
            let (ql, qh, sc, o) = (
                &ql[64 * n..],
                &qh[32 * n..],
                &scales[8 * n..],
                &mut o[128 * n..],
            );
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i32 - 32;
                let q2 = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                let s = |k: usize| d * (sc[is + k] as i8) as f32;
                o[l] = s(0) * q1 as f32;
                o[l + 32] = s(2) * q2 as f32;
                o[l + 64] = s(4) * q3 as f32;
                o[l + 96] = s(6) * q4 as f32;
            }
        }
    }
}

/// Q2_K row: 16 sub-blocks of 16; byte `scales[k]` holds sub-block `k`'s scale (low nibble)
/// and min (high nibble). Halves of 128 read `qs[32n..32n + 32]`; within a half, pass
/// `j < 4` takes bits `2j..2j + 2` of those 32 bytes (sub-blocks `8n + 2j` for bytes 0–15,
/// `8n + 2j + 1` for bytes 16–31). `x = d·sc · q − dmin·m`.
pub fn dequantize_q2_k(bytes: &[u8], out: &mut [f32]) {
    for (blk, o) in bytes.chunks_exact(84).zip(out.chunks_exact_mut(QK_K)) {
        let scales = &blk[0..16];
        let qs = &blk[16..80];
        let d = f16_at(blk, 80);
        let dmin = f16_at(blk, 82);
        let mut y = 0;
        let mut is = 0;
        for n in 0..2 {
            let q = &qs[32 * n..];
            for j in 0..4 {
                let shift = 2 * j;
                for half in 0..2 {
                    let sc = scales[is];
                    is += 1;
                    let dl = d * (sc & 0x0F) as f32;
                    let ml = dmin * (sc >> 4) as f32;
                    for l in 0..16 {
                        o[y] = dl * ((q[16 * half + l] >> shift) & 3) as f32 - ml;
                        y += 1;
                    }
                }
            }
        }
    }
}

/// The 16 signed 6-bit scales of a Q3_K super-block (each stored as `s + 32`): low nibbles
/// from bytes 0–7, high two bits from bytes 8–11 (ggml's `kmask` unpacking).
pub fn q3_k_scales(s: &[u8]) -> [i32; 16] {
    let mut out = [0i32; 16];
    for (k, v) in out.iter_mut().enumerate() {
        let low = if k < 8 { s[k] & 0x0F } else { s[k - 8] >> 4 };
        let high = (s[8 + k % 4] >> (2 * (k / 4))) & 3;
        *v = (low | (high << 4)) as i32 - 32;
    }
    out
}

/// Q3_K row: 16 sub-blocks of 16 laid out as Q2_K's, with a third bit from `hmask`: in
/// pass `m = 4n + j` (half `n`, pass `j`), a clear bit `m` of `hmask[l]` subtracts 4 from
/// the 2-bit value of position `l` (bytes 0–15) or `l + 16` (bytes 16–31). `x = d·s · q`.
pub fn dequantize_q3_k(bytes: &[u8], out: &mut [f32]) {
    for (blk, o) in bytes.chunks_exact(110).zip(out.chunks_exact_mut(QK_K)) {
        let hmask = &blk[0..32];
        let qs = &blk[32..96];
        let scales = q3_k_scales(&blk[96..108]);
        let d = f16_at(blk, 108);
        let mut y = 0;
        let mut is = 0;
        for n in 0..2 {
            let q = &qs[32 * n..];
            for j in 0..4 {
                let shift = 2 * j;
                let m = 1u8 << (4 * n + j);
                for half in 0..2 {
                    let dl = d * scales[is] as f32;
                    is += 1;
                    for l in 0..16 {
                        let p = 16 * half + l;
                        let v =
                            ((q[p] >> shift) & 3) as i32 - if hmask[p] & m != 0 { 0 } else { 4 };
                        o[y] = dl * v as f32;
                        y += 1;
                    }
                }
            }
        }
    }
}

/// IQ4_XS row: 8 sub-blocks of 32, each with a 6-bit scale `ls` (low 4 bits from
/// `scales_l`, two high bits from `scales_h`), `x = d·(ls − 32) · K[q]` with nibbles as
/// IQ4_NL (low nibble of byte `j` is value `j`, high nibble value `j + 16`).
pub fn dequantize_iq4_xs(bytes: &[u8], out: &mut [f32]) {
    for (blk, o) in bytes.chunks_exact(136).zip(out.chunks_exact_mut(QK_K)) {
        let d = f16_at(blk, 0);
        let scales_h = u16::from_le_bytes([blk[2], blk[3]]);
        let scales_l = &blk[4..8];
        let qs = &blk[8..136];
        for ib in 0..8 {
            let ls = ((scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0F) as i32
                | ((((scales_h >> (2 * ib)) & 3) as i32) << 4);
            let dl = d * (ls - 32) as f32;
            for j in 0..16 {
                let q = qs[16 * ib + j];
                o[32 * ib + j] = dl * IQ4_VALUES[(q & 0x0F) as usize] as f32;
                o[32 * ib + j + 16] = dl * IQ4_VALUES[(q >> 4) as usize] as f32;
            }
        }
    }
}
