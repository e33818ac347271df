//! Scalar twins of the engine's dot products over super-blocks of 256 (Q2_K, Q3_K, Q4_K,
//! Q5_K, Q6_K and IQ4_XS weights).
//!
//! As llama.cpp does for the K-quants, the activation vector is quantised to **Q8_K**:
//! super-blocks of 256 values, each with an f32 scale, 256 signed 8-bit codes and the 16
//! sums of consecutive 16-code groups (`bsums`), exactly as ggml's `quantize_row_q8_K_ref`:
//!
//! * `amax = max |x_j|`, `max` = the first `x_j` with `|x_j| = amax`;
//! * `amax = 0` (also when every value is NaN): `d = 0`, every code 0;
//! * otherwise `iscale = −127 / max`, `q_j = min(127, round_ties_even(iscale · x_j))`
//!   (ggml's `nearest_int`: ties to even; a NaN value codes 0), and `d = 1 / iscale`
//!   (so `d` carries the sign of `−max`: `x_j ≈ d · q_j`);
//! * `bsums[k] = Σ_{i<16} q_{16k + i}`.
//!
//! Then per weight super-block the inner products are **exact integer sums** and the
//! float part is a fixed sequence of separate f32 multiplies and adds (no fused
//! multiply-add), one accumulator per row starting at 0, super-blocks in order:
//!
//! * **Q4_K** (8 sub-blocks of 32, 6-bit scale `sc_j` and min `m_j`, 4-bit codes `q`):
//!   `isum = Σ_j sc_j · Σ_{i<32} q_{32j+i} · q8_{32j+i}`,
//!   `msum = Σ_j m_j · (bsums[2j] + bsums[2j+1])`, then
//!   `acc += isum as f32 · (d_w · d_x) − msum as f32 · (dmin_w · d_x)` (the difference
//!   first, then the add).
//! * **Q5_K**: as Q4_K over 5-bit codes (a fifth bit from `qh`), same float steps.
//! * **Q6_K** (16 sub-blocks of 16, signed 8-bit scale `sc_k`, codes `q − 32` in
//!   `[−32, 31]`): `isum = Σ_k sc_k · Σ_{i<16} (q_{16k+i} − 32) · q8_{16k+i}`, then
//!   `acc += isum as f32 · (d_w · d_x)`.
//!
//! * **IQ4_XS** (8 sub-blocks of 32, 6-bit scale `ls_j`, codes the IQ4 levels `K[n]`):
//!   `isum = Σ_j (ls_j − 32) · Σ_{i<32} K[n_{32j+i}] · q8_{32j+i}`, then
//!   `acc += isum as f32 · (d_w · d_x)`.
//!
//! * **Q2_K** (16 sub-blocks of 16, 4-bit scale `sc_k` = low nibble and 4-bit min `m_k`
//!   = high nibble of `scales[k]`, 2-bit codes `q` in `[0, 3]`):
//!   `isum = Σ_k sc_k · Σ_{i<16} q_{16k+i} · q8_{16k+i}`, `msum = Σ_k m_k · bsums[k]`,
//!   then Q4_K's float steps:
//!   `acc += isum as f32 · (d_w · d_x) − msum as f32 · (dmin_w · d_x)`.
//! * **Q3_K** (16 sub-blocks of 16, signed 6-bit scale `s_k` in `[−32, 31]`, codes in
//!   `[−4, 3]`: the 2-bit code minus 4 where the `hmask` bit is clear):
//!   `isum = Σ_k s_k · Σ_{i<16} q_{16k+i} · q8_{16k+i}`, then
//!   `acc += isum as f32 · (d_w · d_x)`.
//!
//! (`d_w`, `dmin_w`: the weight super-block's f16 scales widened to f32; `d_x`: the
//! activation super-block's scale.) Every sum fits an `i32`: for Q4_K
//! `|isum| ≤ 8·63·32·31·128` (Q5_K), for Q6_K `|isum| ≤ 16·128·16·32·128`, for IQ4_XS
//! `|isum| ≤ 8·32·32·127·128`, for Q2_K `|isum| ≤ 16·15·16·3·128` and
//! `|msum| ≤ 16·15·16·128`, for Q3_K `|isum| ≤ 16·32·16·4·128`.
//!
//! This is the value
//! llama.cpp's `ggml_vec_dot_q4_K_q8_K` / `ggml_vec_dot_q6_K_q8_K` compute up to the
//! order of their float additions (which differs between its own SIMD variants); the
//! engine's kernels (every run-time variant) follow the order above, bit for bit.
//!
//! For Q2_K this is the formula of llama.cpp's generic `ggml_vec_dot_q2_K_q8_K` (one
//! integer `isum` and `summs` per super-block, `sumf += dall·isum − dmin·summs` with
//! `dall = d_x·d_w`, `dmin = d_x·dmin_w`) with every product rounded separately; a build
//! of it that fuses a multiply into the subtraction differs in the last bits (7 of the 9
//! Q2_K goldens of `tests/kquant_ggml.rs` are bit-equal to the bundled libggml's generic
//! value). llama.cpp's Q3_K (generic and SIMD) keeps the integer sum in 8 lanes and
//! adds `d · lane` per lane to 8 float sums, summed at the end: the same integers, a
//! different rounding of the float part.

use crate::ggml::f16_at;
use crate::ggml_more::{q3_k_scales, scale_min_k4, IQ4_VALUES, QK_K};

/// An activation vector quantised to Q8_K super-blocks of [`QK_K`] values.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Q8K {
    /// Per super-block: the scale `d_x`.
    pub d: Vec<f32>,
    /// The codes, one per input value.
    pub q: Vec<i8>,
    /// Per 16 codes: their sum.
    pub bsums: Vec<i16>,
}

impl Q8K {
    /// Number of super-blocks.
    pub fn blocks(&self) -> usize {
        self.d.len()
    }
}

/// ggml's `nearest_int` for the range it is used on (`|v| ≤ 127.0…`): round half to
/// even; NaN gives 0 (as the bit trick gives for a quiet NaN).
pub fn nearest_int(v: f32) -> i32 {
    if v.is_nan() {
        0
    } else {
        v.round_ties_even() as i32
    }
}

/// Quantises one super-block of 256 values into `q` (256 codes) and `bsums` (16 sums);
/// returns the scale `d`.
pub fn quantize_q8_k_block(x: &[f32], q: &mut [i8], bsums: &mut [i16]) -> f32 {
    assert_eq!(x.len(), QK_K);
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        let av = v.abs();
        if av > amax {
            amax = av;
            max = v;
        }
    }
    if amax == 0.0 {
        q.iter_mut().for_each(|c| *c = 0);
        bsums.iter_mut().for_each(|s| *s = 0);
        return 0.0;
    }
    let iscale = -127.0f32 / max;
    for (c, &v) in q.iter_mut().zip(x) {
        *c = nearest_int(iscale * v).clamp(-128, 127) as i8;
    }
    for (s, g) in bsums.iter_mut().zip(q.chunks_exact(16)) {
        *s = g.iter().map(|&c| c as i16).sum();
    }
    1.0 / iscale
}

/// Quantises `x` (length a multiple of 256) super-block by super-block.
pub fn quantize_q8_k(x: &[f32]) -> Q8K {
    assert_eq!(x.len() % QK_K, 0, "Q8_K needs whole super-blocks of 256");
    let nb = x.len() / QK_K;
    let mut out = Q8K {
        d: vec![0.0; nb],
        q: vec![0; x.len()],
        bsums: vec![0; nb * 16],
    };
    for (b, blk) in x.chunks_exact(QK_K).enumerate() {
        out.d[b] = quantize_q8_k_block(
            blk,
            &mut out.q[b * QK_K..(b + 1) * QK_K],
            &mut out.bsums[b * 16..(b + 1) * 16],
        );
    }
    out
}

/// Bytes of one Q4_K super-block.
pub const Q4_K_BYTES: usize = 144;
/// Bytes of one Q5_K super-block.
pub const Q5_K_BYTES: usize = 176;
/// Bytes of one Q6_K super-block.
pub const Q6_K_BYTES: usize = 210;

/// The 256 4-bit codes of a Q4_K super-block in value order: sub-block pair `(2i, 2i+1)`
/// reads bytes `qs[32i..32i + 32]`, low nibbles (values `64i..64i + 32`) then high
/// nibbles (values `64i + 32..64i + 64`).
pub fn q4_k_codes(blk: &[u8]) -> [u8; QK_K] {
    let qs = &blk[16..144];
    let mut out = [0u8; QK_K];
    for i in 0..4 {
        for l in 0..32 {
            out[64 * i + l] = qs[32 * i + l] & 0x0F;
            out[64 * i + 32 + l] = qs[32 * i + l] >> 4;
        }
    }
    out
}

/// The integer parts of one Q4_K super-block against one Q8_K super-block:
/// `(isum, msum)` as in the module docs.
pub fn q4_k_isums(blk: &[u8], q8: &[i8], bsums: &[i16]) -> (i32, i32) {
    k4_isums(&q4_k_codes(blk), &blk[4..16], q8, bsums)
}

/// The 256 5-bit codes of a Q5_K super-block in value order: Q4_K's nibbles (from
/// `qs = blk[48..176]`) topped by a fifth bit from `qh = blk[16..48]`: for sub-block pair
/// `i`, bit `2i` of `qh[l]` for value `64i + l` and bit `2i + 1` for value `64i + 32 + l`.
pub fn q5_k_codes(blk: &[u8]) -> [u8; QK_K] {
    let (qh, qs) = (&blk[16..48], &blk[48..176]);
    let mut out = [0u8; QK_K];
    for i in 0..4 {
        for l in 0..32 {
            out[64 * i + l] = (qs[32 * i + l] & 0x0F) | (((qh[l] >> (2 * i)) & 1) << 4);
            out[64 * i + 32 + l] = (qs[32 * i + l] >> 4) | (((qh[l] >> (2 * i + 1)) & 1) << 4);
        }
    }
    out
}

/// The integer parts of one Q5_K super-block against one Q8_K super-block (as Q4_K's,
/// over 5-bit codes).
pub fn q5_k_isums(blk: &[u8], q8: &[i8], bsums: &[i16]) -> (i32, i32) {
    k4_isums(&q5_k_codes(blk), &blk[4..16], q8, bsums)
}

/// `(isum, msum)` of a Q4_K / Q5_K super-block given its codes and 12 scale bytes.
fn k4_isums(codes: &[u8; QK_K], scales: &[u8], q8: &[i8], bsums: &[i16]) -> (i32, i32) {
    let (mut isum, mut msum) = (0i32, 0i32);
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, scales);
        let mut s = 0i32;
        for i in 0..32 {
            s += codes[32 * j + i] as i32 * q8[32 * j + i] as i32;
        }
        isum += sc as i32 * s;
        msum += m as i32 * (bsums[2 * j] as i32 + bsums[2 * j + 1] as i32);
    }
    (isum, msum)
}

/// Q4_K row · Q8_K activations.
pub fn dot_q4_k(row: &[u8], a: &Q8K) -> f32 {
    dot_k4(row, a, Q4_K_BYTES, q4_k_isums)
}

/// Q5_K row · Q8_K activations (Q4_K's float steps).
pub fn dot_q5_k(row: &[u8], a: &Q8K) -> f32 {
    dot_k4(row, a, Q5_K_BYTES, q5_k_isums)
}

type K4Isums = fn(&[u8], &[i8], &[i16]) -> (i32, i32);

fn dot_k4(row: &[u8], a: &Q8K, bytes: usize, isums: K4Isums) -> f32 {
    assert_eq!(
        row.len(),
        a.blocks() * bytes,
        "one weight super-block per activation super-block"
    );
    let mut acc = 0.0f32;
    for (b, blk) in row.chunks_exact(bytes).enumerate() {
        let (isum, msum) = isums(
            blk,
            &a.q[b * QK_K..(b + 1) * QK_K],
            &a.bsums[b * 16..(b + 1) * 16],
        );
        let d = f16_at(blk, 0);
        let dmin = f16_at(blk, 2);
        let dx = a.d[b];
        acc += isum as f32 * (d * dx) - msum as f32 * (dmin * dx);
    }
    acc
}

/// The 256 6-bit codes of a Q6_K super-block in value order, before the −32 offset (the
/// layout of `ggml_more::dequantize_q6_k`).
pub fn q6_k_codes(blk: &[u8]) -> [u8; QK_K] {
    let (ql, qh) = (&blk[0..128], &blk[128..192]);
    let mut out = [0u8; QK_K];
    for n in 0..2 {
        let (ql, qh, o) = (&ql[64 * n..], &qh[32 * n..], &mut out[128 * n..]);
        for l in 0..32 {
            o[l] = (ql[l] & 0x0F) | ((qh[l] & 3) << 4);
            o[l + 32] = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
            o[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            o[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
    out
}

/// The integer sum of one Q6_K super-block against one Q8_K super-block (module docs).
pub fn q6_k_isum(blk: &[u8], q8: &[i8]) -> i32 {
    let codes = q6_k_codes(blk);
    let scales = &blk[192..208];
    let mut isum = 0i32;
    for k in 0..16 {
        let mut s = 0i32;
        for i in 0..16 {
            s += (codes[16 * k + i] as i32 - 32) * q8[16 * k + i] as i32;
        }
        isum += (scales[k] as i8) as i32 * s;
    }
    isum
}

/// Bytes of one IQ4_XS super-block.
pub const IQ4_XS_BYTES: usize = 136;

/// The 6-bit scale `ls` of sub-block `ib` (0..8) of an IQ4_XS super-block: low 4 bits
/// from `scales_l` (`blk[4..8]`), two high bits from `scales_h` (`blk[2..4]`).
pub fn iq4_xs_scale(blk: &[u8], ib: usize) -> i32 {
    let scales_h = u16::from_le_bytes([blk[2], blk[3]]);
    ((blk[4 + ib / 2] >> (4 * (ib % 2))) & 0x0F) as i32
        | ((((scales_h >> (2 * ib)) & 3) as i32) << 4)
}

/// The integer sum of one IQ4_XS super-block against one Q8_K super-block (module docs).
pub fn iq4_xs_isum(blk: &[u8], q8: &[i8]) -> i32 {
    let qs = &blk[8..136];
    let mut isum = 0i32;
    for ib in 0..8 {
        let mut s = 0i32;
        for j in 0..16 {
            let q = qs[16 * ib + j];
            s += IQ4_VALUES[(q & 0x0F) as usize] as i32 * q8[32 * ib + j] as i32;
            s += IQ4_VALUES[(q >> 4) as usize] as i32 * q8[32 * ib + 16 + j] as i32;
        }
        isum += (iq4_xs_scale(blk, ib) - 32) * s;
    }
    isum
}

/// IQ4_XS row · Q8_K activations.
pub fn dot_iq4_xs(row: &[u8], a: &Q8K) -> f32 {
    assert_eq!(
        row.len(),
        a.blocks() * IQ4_XS_BYTES,
        "one weight super-block per activation super-block"
    );
    let mut acc = 0.0f32;
    for (b, blk) in row.chunks_exact(IQ4_XS_BYTES).enumerate() {
        let isum = iq4_xs_isum(blk, &a.q[b * QK_K..(b + 1) * QK_K]);
        acc += isum as f32 * (f16_at(blk, 0) * a.d[b]);
    }
    acc
}

/// Q6_K row · Q8_K activations.
pub fn dot_q6_k(row: &[u8], a: &Q8K) -> f32 {
    assert_eq!(
        row.len(),
        a.blocks() * Q6_K_BYTES,
        "one weight super-block per activation super-block"
    );
    let mut acc = 0.0f32;
    for (b, blk) in row.chunks_exact(Q6_K_BYTES).enumerate() {
        let isum = q6_k_isum(blk, &a.q[b * QK_K..(b + 1) * QK_K]);
        let d = f16_at(blk, 208);
        acc += isum as f32 * (d * a.d[b]);
    }
    acc
}

/// Bytes of one Q2_K super-block.
pub const Q2_K_BYTES: usize = 84;
/// Bytes of one Q3_K super-block.
pub const Q3_K_BYTES: usize = 110;

/// The 256 2-bit codes of a Q2_K or Q3_K super-block in value order (`qs` = the 64 code
/// bytes): value `128n + 32j + l` is bits `2j..2j + 2` of `qs[32n + l]` (the layout of
/// `ggml_more::dequantize_q2_k`).
pub fn two_bit_codes(qs: &[u8]) -> [u8; QK_K] {
    let mut out = [0u8; QK_K];
    for n in 0..2 {
        for j in 0..4 {
            for l in 0..32 {
                out[128 * n + 32 * j + l] = (qs[32 * n + l] >> (2 * j)) & 3;
            }
        }
    }
    out
}

/// The integer parts of one Q2_K super-block against one Q8_K super-block (module docs):
/// `(isum, msum)` with `isum = Σ_k (scales[k] & 15) · Σ_i q · q8` and
/// `msum = Σ_k (scales[k] >> 4) · bsums[k]`.
pub fn q2_k_isums(blk: &[u8], q8: &[i8], bsums: &[i16]) -> (i32, i32) {
    let codes = two_bit_codes(&blk[16..80]);
    let scales = &blk[0..16];
    let (mut isum, mut msum) = (0i32, 0i32);
    for k in 0..16 {
        let mut s = 0i32;
        for i in 0..16 {
            s += codes[16 * k + i] as i32 * q8[16 * k + i] as i32;
        }
        isum += (scales[k] & 0x0F) as i32 * s;
        msum += (scales[k] >> 4) as i32 * bsums[k] as i32;
    }
    (isum, msum)
}

/// Q2_K row · Q8_K activations: `acc += isum · (d_w · d_x) − msum · (dmin_w · d_x)`.
pub fn dot_q2_k(row: &[u8], a: &Q8K) -> f32 {
    assert_eq!(
        row.len(),
        a.blocks() * Q2_K_BYTES,
        "one weight super-block per activation super-block"
    );
    let mut acc = 0.0f32;
    for (b, blk) in row.chunks_exact(Q2_K_BYTES).enumerate() {
        let (isum, msum) = q2_k_isums(
            blk,
            &a.q[b * QK_K..(b + 1) * QK_K],
            &a.bsums[b * 16..(b + 1) * 16],
        );
        let d = f16_at(blk, 80);
        let dmin = f16_at(blk, 82);
        let dx = a.d[b];
        acc += isum as f32 * (d * dx) - msum as f32 * (dmin * dx);
    }
    acc
}

/// The 256 signed 3-bit codes (`−4..=3`) of a Q3_K super-block in value order: the 2-bit
/// code of [`two_bit_codes`] (from `qs = blk[32..96]`), minus 4 unless bit `4n + j` of
/// `hmask[l]` (`hmask = blk[0..32]`) is set, for value `128n + 32j + l`.
pub fn q3_k_codes(blk: &[u8]) -> [i8; QK_K] {
    let low = two_bit_codes(&blk[32..96]);
    let hmask = &blk[0..32];
    let mut out = [0i8; QK_K];
    for n in 0..2 {
        for j in 0..4 {
            for (l, &h) in hmask.iter().enumerate() {
                let v = 128 * n + 32 * j + l;
                let high = (h >> (4 * n + j)) & 1;
                out[v] = low[v] as i8 - if high == 1 { 0 } else { 4 };
            }
        }
    }
    out
}

/// The integer sum of one Q3_K super-block against one Q8_K super-block (module docs):
/// `Σ_k s_k · Σ_i q · q8` with the signed 6-bit scales `s_k` of
/// `ggml_more::q3_k_scales`.
pub fn q3_k_isum(blk: &[u8], q8: &[i8]) -> i32 {
    let codes = q3_k_codes(blk);
    let scales = q3_k_scales(&blk[96..108]);
    let mut isum = 0i32;
    for k in 0..16 {
        let mut s = 0i32;
        for i in 0..16 {
            s += codes[16 * k + i] as i32 * q8[16 * k + i] as i32;
        }
        isum += scales[k] * s;
    }
    isum
}

/// Q3_K row · Q8_K activations: `acc += isum · (d_w · d_x)`.
pub fn dot_q3_k(row: &[u8], a: &Q8K) -> f32 {
    assert_eq!(
        row.len(),
        a.blocks() * Q3_K_BYTES,
        "one weight super-block per activation super-block"
    );
    let mut acc = 0.0f32;
    for (b, blk) in row.chunks_exact(Q3_K_BYTES).enumerate() {
        let isum = q3_k_isum(blk, &a.q[b * QK_K..(b + 1) * QK_K]);
        acc += isum as f32 * (f16_at(blk, 108) * a.d[b]);
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ggml_more::{dequantize_q4_k, dequantize_q6_k};
    use half::f16;

    use crate::test_rng::Rng;

    fn put_f16(b: &mut [u8], at: usize, v: f32) {
        b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
    }

    fn random_q4_k(rng: &mut Rng, d: f32, dmin: f32) -> Vec<u8> {
        let mut b: Vec<u8> = (0..Q4_K_BYTES).map(|_| rng.byte()).collect();
        put_f16(&mut b, 0, d);
        put_f16(&mut b, 2, dmin);
        b
    }

    fn random_q6_k(rng: &mut Rng, d: f32) -> Vec<u8> {
        let mut b: Vec<u8> = (0..Q6_K_BYTES).map(|_| rng.byte()).collect();
        put_f16(&mut b, 208, d);
        b
    }

    /// The exact value of the quantised problem: `Σ w_i · (d_x q_i)` in f64 over the
    /// dequantised weights (each an exact f32), and a bound on how far an f32 evaluation
    /// in the documented order can be from it.
    fn exact_and_bound(w: &[f32], a: &Q8K, terms_per_block: f64) -> (f64, f64) {
        let mut exact = 0.0f64;
        let mut mag = 0.0f64;
        for (i, &wi) in w.iter().enumerate() {
            let x = a.d[i / QK_K] as f64 * a.q[i] as f64;
            exact += wi as f64 * x;
            mag += (wi as f64 * x).abs();
        }
        // Each super-block: integer sums exact, one int→f32 rounding, the scale product
        // (two roundings), the subtraction and the accumulation: a few ulps of the
        // block's magnitude; the dequantised weights themselves are f32 products of the
        // same factors (another few ulps each). 2^-24 per rounding, generously counted.
        let eps = f32::EPSILON as f64;
        (exact, mag * eps * (8.0 + terms_per_block) + 1e-30)
    }

    fn x_values(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| rng.unit() * scale).collect()
    }

    #[test]
    fn q8_k_follows_ggml() {
        // max is negative: iscale positive; codes ±127 at the extremes, ties to even.
        let mut x = vec![0.0f32; QK_K];
        x[0] = -127.0;
        x[1] = 127.0;
        x[2] = 0.5;
        x[3] = 1.5;
        x[4] = -2.5;
        x[5] = f32::NAN;
        let a = quantize_q8_k(&x);
        assert_eq!(a.d[0], 1.0 / (-127.0f32 / -127.0));
        assert_eq!(&a.q[..6], &[-127, 127, 0, 2, -2, 0]);
        assert_eq!(a.bsums[0], 0);
        // The first of two equal magnitudes sets the sign of d.
        let mut y = vec![0.0f32; QK_K];
        y[7] = 3.0;
        y[9] = -3.0;
        let b = quantize_q8_k(&y);
        assert!(b.d[0] < 0.0);
        assert_eq!((b.q[7], b.q[9]), (-127, 127));
        // All zero (and all NaN): d = 0, codes 0.
        let z = quantize_q8_k(&[0.0; 2 * QK_K]);
        assert_eq!(z.d, vec![0.0, 0.0]);
        assert!(z.q.iter().all(|&c| c == 0) && z.bsums.iter().all(|&s| s == 0));
        let n = quantize_q8_k(&[f32::NAN; QK_K]);
        assert_eq!(n.d[0], 0.0);
    }

    #[test]
    fn q8_k_round_trips_within_half_a_step() {
        let mut rng = Rng(0x9E3779B97F4A7C15);
        for scale in [1e-30f32, 1e-3, 1.0, 1e4, 1e30] {
            let x = x_values(&mut rng, 3 * QK_K, scale);
            let a = quantize_q8_k(&x);
            for (i, &v) in x.iter().enumerate() {
                let d = a.d[i / QK_K];
                let back = d * a.q[i] as f32;
                assert!((back - v).abs() <= d.abs() * 0.5001, "{v} vs {back}");
            }
            for (k, s) in a.bsums.iter().enumerate() {
                let t: i32 = a.q[16 * k..16 * k + 16].iter().map(|&c| c as i32).sum();
                assert_eq!(*s as i32, t);
            }
        }
    }

    #[test]
    fn q4_k_dot_equals_dequantised_dot_within_bound() {
        let mut rng = Rng(0x1234_5678_9ABC_DEF1);
        for (d, dmin, xs) in [
            (0.01f32, 0.02f32, 1.0f32),
            (1.0, 0.5, 1e-3),
            (65504.0, 65504.0, 1e-6),
            (6e-8, 6e-8, 1e4),
            (0.0, 0.3, 1.0),
            (0.3, 0.0, 1.0),
        ] {
            for nb in 1..4 {
                let row: Vec<u8> = (0..nb)
                    .flat_map(|_| random_q4_k(&mut rng, d, dmin))
                    .collect();
                let x = x_values(&mut rng, nb * QK_K, xs);
                let a = quantize_q8_k(&x);
                let mut w = vec![0.0f32; nb * QK_K];
                dequantize_q4_k(&row, &mut w);
                let (exact, bound) = exact_and_bound(&w, &a, 8.0);
                let got = dot_q4_k(&row, &a) as f64;
                assert!(
                    (got - exact).abs() <= bound,
                    "d {d} dmin {dmin}: {got} vs {exact} (bound {bound})"
                );
            }
        }
    }

    #[test]
    fn q5_k_dot_equals_dequantised_dot_within_bound() {
        let mut rng = Rng(0xFEED_F00D_1234_0001);
        for (d, dmin, xs) in [
            (0.01f32, 0.02f32, 1.0f32),
            (65504.0, 65504.0, 1e-6),
            (6e-8, 6e-8, 1e4),
            (0.3, 0.0, 1.0),
        ] {
            for nb in 1..4 {
                let row: Vec<u8> = (0..nb)
                    .flat_map(|_| {
                        let mut b: Vec<u8> = (0..Q5_K_BYTES).map(|_| rng.byte()).collect();
                        put_f16(&mut b, 0, d);
                        put_f16(&mut b, 2, dmin);
                        b
                    })
                    .collect();
                let x = x_values(&mut rng, nb * QK_K, xs);
                let a = quantize_q8_k(&x);
                let mut w = vec![0.0f32; nb * QK_K];
                crate::ggml_more::dequantize_q5_k(&row, &mut w);
                let (exact, bound) = exact_and_bound(&w, &a, 8.0);
                let got = dot_q5_k(&row, &a) as f64;
                assert!(
                    (got - exact).abs() <= bound,
                    "d {d} dmin {dmin}: {got} vs {exact} (bound {bound})"
                );
            }
        }
        // Every 5-bit code occurs when qh is all ones and all zeros over the nibbles.
        let mut blk = vec![0u8; Q5_K_BYTES];
        for (i, b) in blk[48..].iter_mut().enumerate() {
            *b = (i as u8 % 16) | ((i as u8 % 16) << 4);
        }
        blk[16..32].fill(0xFF);
        let codes = q5_k_codes(&blk);
        for v in 0..32u8 {
            assert!(codes.contains(&v), "code {v}");
        }
    }

    #[test]
    fn iq4_xs_dot_equals_dequantised_dot_within_bound() {
        let mut rng = Rng(0xABCD_EF01_2345_6789);
        for (d, xs) in [(0.01f32, 1.0f32), (65504.0, 1e-6), (6e-8, 1e4), (1.0, 1e-3)] {
            for nb in 1..4 {
                let row: Vec<u8> = (0..nb)
                    .flat_map(|_| {
                        let mut b: Vec<u8> = (0..IQ4_XS_BYTES).map(|_| rng.byte()).collect();
                        put_f16(&mut b, 0, d);
                        b
                    })
                    .collect();
                let x = x_values(&mut rng, nb * QK_K, xs);
                let a = quantize_q8_k(&x);
                let mut w = vec![0.0f32; nb * QK_K];
                crate::ggml_more::dequantize_iq4_xs(&row, &mut w);
                let (exact, bound) = exact_and_bound(&w, &a, 4.0);
                let got = dot_iq4_xs(&row, &a) as f64;
                assert!(
                    (got - exact).abs() <= bound,
                    "d {d}: {got} vs {exact} (bound {bound})"
                );
            }
        }
    }

    #[test]
    fn q6_k_dot_equals_dequantised_dot_within_bound() {
        let mut rng = Rng(0x0DDB_1A5E_5BAD_5EED);
        for (d, xs) in [(0.01f32, 1.0f32), (65504.0, 1e-6), (6e-8, 1e4), (1.0, 1e-3)] {
            for nb in 1..4 {
                let row: Vec<u8> = (0..nb).flat_map(|_| random_q6_k(&mut rng, d)).collect();
                let x = x_values(&mut rng, nb * QK_K, xs);
                let a = quantize_q8_k(&x);
                let mut w = vec![0.0f32; nb * QK_K];
                dequantize_q6_k(&row, &mut w);
                let (exact, bound) = exact_and_bound(&w, &a, 4.0);
                let got = dot_q6_k(&row, &a) as f64;
                assert!(
                    (got - exact).abs() <= bound,
                    "d {d}: {got} vs {exact} (bound {bound})"
                );
            }
        }
    }

    #[test]
    fn every_code_meets_every_activation_code() {
        // Q4_K: all 16 codes in every sub-block, scales and mins 1, d = dmin = 1, against
        // activations whose codes are ±127 and 0: the integer sums are checked directly.
        let mut blk = vec![0u8; Q4_K_BYTES];
        put_f16(&mut blk, 0, 1.0);
        put_f16(&mut blk, 2, 1.0);
        // Scale bytes: 0..4 the scales of sub-blocks 0..4, 4..8 their mins, 8..12 the
        // scale (low nibble) and min (high nibble) of sub-blocks 4..8.
        let sc = [1u8; 8];
        let mn = [2u8; 8];
        for j in 0..4 {
            blk[4 + j] = sc[j];
            blk[8 + j] = mn[j];
            blk[12 + j] = sc[4 + j] | (mn[4 + j] << 4);
        }
        for (i, b) in blk[16..].iter_mut().enumerate() {
            *b = (i as u8 % 16) | ((15 - i as u8 % 16) << 4);
        }
        let q8: Vec<i8> = (0..QK_K).map(|i| [127i8, -127, 0, 1][i % 4]).collect();
        let bsums: Vec<i16> = q8
            .chunks_exact(16)
            .map(|g| g.iter().map(|&c| c as i16).sum())
            .collect();
        let codes = q4_k_codes(&blk);
        let want: i32 = codes
            .iter()
            .zip(&q8)
            .map(|(&c, &q)| c as i32 * q as i32)
            .sum();
        let (isum, msum) = q4_k_isums(&blk, &q8, &bsums);
        assert_eq!(isum, want);
        assert_eq!(msum, 2 * bsums.iter().map(|&s| s as i32).sum::<i32>());
        for v in 0..16u8 {
            assert!(codes.contains(&v));
        }
        // Q6_K: every 6-bit code, scales ±127 and ±1.
        let mut rng = Rng(77);
        let mut b6 = random_q6_k(&mut rng, 1.0);
        for (k, s) in b6[192..208].iter_mut().enumerate() {
            *s = [127i8, -128, 1, -1][k % 4] as u8;
        }
        for (i, b) in b6[..128].iter_mut().enumerate() {
            // Both nibbles of ql[i] are i mod 16 and the qh fields of half 0 are 0 and 1,
            // of half 1 2 and 3: all 64 codes occur.
            *b = (i as u8 & 0x0F) | ((i as u8 & 0x0F) << 4);
        }
        for i in 0..64 {
            b6[128 + i] = (i as u8 >> 4) * 0x55;
        }
        let codes6 = q6_k_codes(&b6);
        for v in 0..64u8 {
            assert!(codes6.contains(&v), "code {v}");
        }
        let want6: i32 = (0..16)
            .map(|k| {
                (b6[192 + k] as i8) as i32
                    * (0..16)
                        .map(|i| (codes6[16 * k + i] as i32 - 32) * q8[16 * k + i] as i32)
                        .sum::<i32>()
            })
            .sum();
        assert_eq!(q6_k_isum(&b6, &q8), want6);
    }

    #[test]
    fn q2_k_and_q3_k_dots_equal_dequantised_dots_within_bound() {
        let mut rng = Rng(0x2233_4455_6677_8899);
        for (d, dmin, xs) in [
            (0.01f32, 0.02f32, 1.0f32),
            (65504.0, 65504.0, 1e-6),
            (6e-8, 6e-8, 1e4),
            (0.3, 0.0, 1.0),
            (-0.5, -0.25, 1e-3),
        ] {
            for nb in 1..4 {
                let mut row2 = Vec::new();
                let mut row3 = Vec::new();
                for _ in 0..nb {
                    let mut b: Vec<u8> = (0..Q2_K_BYTES).map(|_| rng.byte()).collect();
                    put_f16(&mut b, 80, d);
                    put_f16(&mut b, 82, dmin);
                    row2.extend(b);
                    let mut b: Vec<u8> = (0..Q3_K_BYTES).map(|_| rng.byte()).collect();
                    put_f16(&mut b, 108, d);
                    row3.extend(b);
                }
                let x = x_values(&mut rng, nb * QK_K, xs);
                let a = quantize_q8_k(&x);
                let mut w = vec![0.0f32; nb * QK_K];
                crate::ggml_more::dequantize_q2_k(&row2, &mut w);
                let (exact, bound) = exact_and_bound(&w, &a, 8.0);
                let got = dot_q2_k(&row2, &a) as f64;
                assert!(
                    (got - exact).abs() <= bound,
                    "Q2_K d {d} dmin {dmin}: {got} vs {exact} (bound {bound})"
                );
                crate::ggml_more::dequantize_q3_k(&row3, &mut w);
                let (exact, bound) = exact_and_bound(&w, &a, 4.0);
                let got = dot_q3_k(&row3, &a) as f64;
                assert!(
                    (got - exact).abs() <= bound,
                    "Q3_K d {d}: {got} vs {exact} (bound {bound})"
                );
            }
        }
    }

    #[test]
    fn q2_k_and_q3_k_every_code() {
        // qs byte i holds the four 2-bit fields i, i + 1, i + 2, i + 3 (mod 4): every
        // code in every pass; hmask alternates in pairs of bytes so each 3-bit code occurs.
        let mut b3 = vec![0u8; Q3_K_BYTES];
        for (i, b) in b3[32..96].iter_mut().enumerate() {
            let f = |k: usize| ((i + k) % 4) as u8;
            *b = f(0) | (f(1) << 2) | (f(2) << 4) | (f(3) << 6);
        }
        for (l, h) in b3[0..32].iter_mut().enumerate() {
            *h = if (l / 2) % 2 == 0 { 0x55 } else { 0xAA };
        }
        let c3 = q3_k_codes(&b3);
        for v in -4i8..=3 {
            assert!(c3.contains(&v), "Q3_K code {v}");
        }
        let c2 = two_bit_codes(&b3[32..96]);
        for v in 0..4u8 {
            assert!(c2.contains(&v));
        }
        // Integer sums against a direct evaluation, scales at their extremes.
        let q8: Vec<i8> = (0..QK_K).map(|i| [127i8, -128, 0, 1, -1][i % 5]).collect();
        let bsums: Vec<i16> = q8
            .chunks_exact(16)
            .map(|g| g.iter().map(|&c| c as i16).sum())
            .collect();
        let mut b2 = vec![0u8; Q2_K_BYTES];
        b2[16..80].copy_from_slice(&b3[32..96]);
        for (k, s) in b2[0..16].iter_mut().enumerate() {
            *s = [0xFFu8, 0x0F, 0xF0, 0x00, 0x3C][k % 5];
        }
        let (isum, msum) = q2_k_isums(&b2, &q8, &bsums);
        let want: i32 = (0..QK_K)
            .map(|i| (b2[i / 16] & 15) as i32 * c2[i] as i32 * q8[i] as i32)
            .sum();
        let want_m: i32 = (0..16).map(|k| (b2[k] >> 4) as i32 * bsums[k] as i32).sum();
        assert_eq!((isum, msum), (want, want_m));
        // Q3_K scales all −32 (bytes 0x00), all 31 (0xFF), and mixed.
        for (p, pattern) in [[0x00u8; 3], [0xFF; 3], [0x00, 0xFF, 0x5A]]
            .iter()
            .enumerate()
        {
            for (k, s) in b3[96..108].iter_mut().enumerate() {
                *s = pattern[k % 3];
            }
            let sc = q3_k_scales(&b3[96..108]);
            match p {
                0 => assert!(sc.iter().all(|&s| s == -32)),
                1 => assert!(sc.iter().all(|&s| s == 31)),
                _ => {}
            }
            let want3: i32 = (0..QK_K)
                .map(|i| sc[i / 16] * c3[i] as i32 * q8[i] as i32)
                .sum();
            assert_eq!(q3_k_isum(&b3, &q8), want3);
        }
    }

    #[test]
    fn constant_blocks() {
        // Q6_K codes all 32 + 1 (value +1), scale 1, d 1: the dot is Σ d_x·q8.
        let mut b6 = vec![0u8; Q6_K_BYTES];
        b6[0..128].fill(0x11); // low nibbles 1
        b6[128..192].fill(0xAA); // high bits 2 → +32
        b6[192..208].fill(1);
        put_f16(&mut b6, 208, 1.0);
        let x = vec![0.25f32; QK_K];
        let a = quantize_q8_k(&x);
        let want: i32 = a.q.iter().map(|&c| c as i32).sum();
        assert_eq!(dot_q6_k(&b6, &a), want as f32 * a.d[0]);
        assert!((dot_q6_k(&b6, &a) - 64.0).abs() < 1e-4);
        // Q4_K: codes 0 everywhere, mins 1, dmin 1: the dot is −Σ x (through the bsums).
        let mut b4 = vec![0u8; Q4_K_BYTES];
        put_f16(&mut b4, 2, 1.0);
        for j in 0..4 {
            b4[8 + j] = 1;
            b4[12 + j] = 1 << 4;
        }
        let got = dot_q4_k(&b4, &a);
        assert!((got + 64.0).abs() < 1e-4, "{got}");
    }
}
