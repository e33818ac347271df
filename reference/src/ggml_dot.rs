//! Scalar twins of the engine's quantised-weight dot products (`--weights-dtype native`).
//!
//! As in llama.cpp, the activation vector is itself quantised to 8 bits per block of 32
//! before it meets Q8_0/Q4_0/Q4_1 weight blocks, so the inner products are integer:
//!
//! * activation block: `d_x = max|x| / 127` (f32), `q_x = round(x / d_x)` (ties away from
//!   zero, as C's `roundf`), `q_x ∈ [-127, 127]`; `d_x = 0` and `q_x = 0` for an all-zero
//!   block. `s_x = d_x · Σ q_x` is kept per block for Q4_1.
//! * Q8_0 block: `Σ_i d_w·q_w[i] · d_x·q_x[i] = (d_w·d_x) · Σ q_w q_x`
//! * Q4_0 block: `(d_w·d_x) · Σ (q_w − 8) q_x`
//! * Q4_1 block: `(d_w·d_x) · Σ q_w q_x + m_w · s_x`
//! * Q5_0 block: `(d_w·d_x) · Σ (q_w − 16) q_x`, `q_w` the 5-bit code (nibble, plus bit
//!   `j` of `qh` on top of value `j`): exactly Q8_0's step on the block rewritten as Q8_0
//!   (`ggml_more::q5_0_to_q8_0`), as ggml's `ggml_vec_dot_q5_0_q8_0`
//! * IQ4_NL block: `(d_w·d_x) · Σ K[n_w] q_x`, `K` the 16 non-linear levels
//!   (`ggml_more::IQ4_VALUES`) and `n_w` the nibble: exactly Q8_0's step on the block
//!   rewritten as Q8_0 (`ggml_more::iq4_nl_to_q8_0`), as ggml's `ggml_vec_dot_iq4_nl_q8_0`
//!
//! The integer sums are exact. Each row's float terms are accumulated block by block in
//! the order written in the functions below (for Q4_1, `acc += isum · (d_w · d_x) +
//! m_w · s_x`), with separate multiplies and adds; the engine's kernels (every run-time
//! variant) do the same steps in vector lanes, one row per lane, so they equal this twin
//! bit for bit.

use crate::ggml::f16_at;
use crate::ggml_more::IQ4_VALUES;

/// Values per block.
pub use tinygpt_types::ggml::QK;

/// An activation vector quantised to 8 bits per block of [`QK`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct QuantizedActs {
    /// Per block: the scale `d_x`.
    pub d: Vec<f32>,
    /// Per block: `d_x · Σ q_x`.
    pub s: Vec<f32>,
    /// The codes, `[-127, 127]`, one per input value.
    pub q: Vec<i8>,
}

/// One block of [`QuantizedActs`].
pub struct ActBlock<'a> {
    /// `d_x`
    pub d: f32,
    /// `d_x · Σ q_x`
    pub s: f32,
    /// The block's [`QK`] codes.
    pub q: &'a [i8],
}

impl QuantizedActs {
    /// The blocks in order.
    pub fn blocks(&self) -> impl Iterator<Item = ActBlock<'_>> {
        self.q
            .chunks_exact(QK)
            .zip(self.d.iter().zip(&self.s))
            .map(|(q, (&d, &s))| ActBlock { d, s, q })
    }
}

/// Quantises `x` (length a multiple of 32) block by block.
pub fn quantize_acts(x: &[f32]) -> QuantizedActs {
    assert_eq!(x.len() % QK, 0);
    let mut out = QuantizedActs::default();
    for blk in x.chunks_exact(QK) {
        let mut amax = 0.0f32;
        for &v in blk {
            amax = amax.max(v.abs());
        }
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for &v in blk {
            let q = (v * id).round() as i32;
            let q = q.clamp(-127, 127);
            sum += q;
            out.q.push(q as i8);
        }
        out.d.push(d);
        out.s.push(d * sum as f32);
    }
    out
}

/// Q8_0 row · quantised activations.
pub fn dot_q8_0(row: &[u8], a: &QuantizedActs) -> f32 {
    assert_eq!(
        row.len(),
        a.d.len() * 34,
        "one weight block per activation block"
    );
    let mut acc = 0.0f32;
    for (blk, x) in row.chunks_exact(34).zip(a.blocks()) {
        let dw = f16_at(blk, 0);
        let mut isum = 0i32;
        for i in 0..QK {
            isum += (blk[2 + i] as i8) as i32 * x.q[i] as i32;
        }
        acc += isum as f32 * (dw * x.d);
    }
    acc
}

/// The 4-bit code of element `i` of a block's 16 nibble bytes: elements 0..16 are the low
/// nibbles, 16..32 the high nibbles.
fn nibble(qs: &[u8], i: usize) -> i32 {
    if i < 16 {
        (qs[i] & 0x0F) as i32
    } else {
        (qs[i - 16] >> 4) as i32
    }
}

/// Q4_0 row · quantised activations.
pub fn dot_q4_0(row: &[u8], a: &QuantizedActs) -> f32 {
    dot_nibble_blocks(row, a, |q| q - 8)
}

/// A row of 18-byte blocks (`d`, 16 nibble bytes: Q4_0, IQ4_NL) · quantised activations,
/// each nibble read as the weight code `level(nibble)`.
fn dot_nibble_blocks(row: &[u8], a: &QuantizedActs, level: impl Fn(i32) -> i32) -> f32 {
    assert_eq!(
        row.len(),
        a.d.len() * 18,
        "one weight block per activation block"
    );
    let mut acc = 0.0f32;
    for (blk, x) in row.chunks_exact(18).zip(a.blocks()) {
        let dw = f16_at(blk, 0);
        let qs = &blk[2..18];
        let mut isum = 0i32;
        for i in 0..QK {
            isum += level(nibble(qs, i)) * x.q[i] as i32;
        }
        acc += isum as f32 * (dw * x.d);
    }
    acc
}

/// Q4_1 row · quantised activations.
pub fn dot_q4_1(row: &[u8], a: &QuantizedActs) -> f32 {
    assert_eq!(
        row.len(),
        a.d.len() * 20,
        "one weight block per activation block"
    );
    let mut acc = 0.0f32;
    for (blk, x) in row.chunks_exact(20).zip(a.blocks()) {
        let dw = f16_at(blk, 0);
        let mw = f16_at(blk, 2);
        let qs = &blk[4..20];
        let mut isum = 0i32;
        for i in 0..QK {
            isum += nibble(qs, i) * x.q[i] as i32;
        }
        acc += isum as f32 * (dw * x.d) + mw * x.s;
    }
    acc
}

/// The 32 five-bit codes (0..32) of a Q5_0 block (22 bytes: `d`, `qh: u32`, 16 nibble
/// bytes) in value order: nibbles as Q4_0's, bit `j` of `qh` on top of value `j`.
pub fn q5_0_codes(blk: &[u8]) -> [u8; QK] {
    let qh = u32::from_le_bytes([blk[2], blk[3], blk[4], blk[5]]);
    let mut out = [0u8; QK];
    for j in 0..16 {
        let q = blk[6 + j];
        out[j] = (q & 0x0F) | ((((qh >> j) & 1) as u8) << 4);
        out[j + 16] = (q >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
    }
    out
}

/// Q5_0 row · quantised activations: Q4_0's steps over 5-bit codes minus 16,
/// `acc += isum · (d_w · d_x)`.
pub fn dot_q5_0(row: &[u8], a: &QuantizedActs) -> f32 {
    assert_eq!(
        row.len(),
        a.d.len() * 22,
        "one weight block per activation block"
    );
    let mut acc = 0.0f32;
    for (blk, x) in row.chunks_exact(22).zip(a.blocks()) {
        let dw = f16_at(blk, 0);
        let codes = q5_0_codes(blk);
        let mut isum = 0i32;
        for (&c, &q) in codes.iter().zip(x.q) {
            isum += (c as i32 - 16) * q as i32;
        }
        acc += isum as f32 * (dw * x.d);
    }
    acc
}

/// IQ4_NL row · quantised activations (18-byte blocks: `d`, 16 nibble bytes as Q4_0's):
/// Q4_0's steps over the levels `K[nibble]` (`ggml_more::IQ4_VALUES`),
/// `acc += isum · (d_w · d_x)`.
pub fn dot_iq4_nl(row: &[u8], a: &QuantizedActs) -> f32 {
    dot_nibble_blocks(row, a, |q| IQ4_VALUES[q as usize] as i32)
}

/// The 32 five-bit codes of a Q5_1 block (24 bytes: `d`, `m`, `qh: u32`, 16 nibble
/// bytes) in value order: nibbles as Q4_1's, bit `j` of `qh` on top of value `j`.
pub fn q5_1_codes(blk: &[u8]) -> [u8; QK] {
    let qh = u32::from_le_bytes([blk[4], blk[5], blk[6], blk[7]]);
    let mut out = [0u8; QK];
    for j in 0..16 {
        let q = blk[8 + j];
        out[j] = (q & 0x0F) | ((((qh >> j) & 1) as u8) << 4);
        out[j + 16] = (q >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
    }
    out
}

/// Q5_1 row · quantised activations: Q4_1's steps over 5-bit codes,
/// `acc += isum · (d_w · d_x) + m_w · s_x` (as ggml's `ggml_vec_dot_q5_1_q8_1`, with `d_x`
/// and `s_x` kept in f32 as for Q4_1).
pub fn dot_q5_1(row: &[u8], a: &QuantizedActs) -> f32 {
    assert_eq!(
        row.len(),
        a.d.len() * 24,
        "one weight block per activation block"
    );
    let mut acc = 0.0f32;
    for (blk, x) in row.chunks_exact(24).zip(a.blocks()) {
        let dw = f16_at(blk, 0);
        let mw = f16_at(blk, 2);
        let codes = q5_1_codes(blk);
        let mut isum = 0i32;
        for (&c, &q) in codes.iter().zip(x.q) {
            isum += c as i32 * q as i32;
        }
        acc += isum as f32 * (dw * x.d) + mw * x.s;
    }
    acc
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ggml_more::{iq4_nl_to_q8_0, q5_0_to_q8_0};

    use crate::test_rng::Rng;

    /// Checks `dot(row) == dot_q8_0(rewrite(row))` bit for bit (or both NaN) on 3000 rows
    /// of 1 to 9 blocks of `1 + payload` f16-scaled blocks: f16 scales that are zero,
    /// subnormal, ordinary, huge (±65504) or random bit patterns (non-finite included);
    /// payload bytes random or one of `fills` for a whole block; ordinary, huge, tiny and
    /// zero activations.
    fn equals_dot_q8_0_on_the_rewrite(
        seed: u64,
        payload: usize,
        fills: &[u8],
        dot: fn(&[u8], &QuantizedActs) -> f32,
        rewrite: fn(&[u8]) -> Vec<u8>,
    ) {
        let mut rng = Rng(seed);
        let scales = [
            0x0000u16, 0x0001, 0x03FF, 0x3C00, 0x2E66, 0x7BFF, 0xFBFF, 0x8001,
        ];
        for case in 0..3000 {
            let nb = 1 + case % 9;
            let mut row = Vec::with_capacity(nb * (2 + payload));
            for _ in 0..nb {
                let r = rng.next();
                let d = match r % 4 {
                    0 => scales[(r >> 8) as usize % scales.len()],
                    _ => (r >> 16) as u16,
                };
                row.extend_from_slice(&d.to_le_bytes());
                // a fixed fill for one block in (fills + 4)
                let fill = fills.get(((r >> 40) % (fills.len() as u64 + 4)) as usize);
                for _ in 0..payload {
                    let b = fill.copied().unwrap_or(rng.next() as u8);
                    row.push(b);
                }
            }
            let scale = match case % 4 {
                0 => 1.0f32,
                1 => 1e30,
                2 => 1e-38,
                _ => 0.0,
            };
            let x: Vec<f32> = (0..nb * QK)
                .map(|_| ((rng.next() % 20001) as f32 / 1e4 - 1.0) * scale)
                .collect();
            let a = quantize_acts(&x);
            let got = dot(&row, &a);
            let want = dot_q8_0(&rewrite(&row), &a);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "case {case}: {got} vs {want}"
            );
        }
    }

    /// `dot_q5_0` equals `dot_q8_0` on the blocks rewritten as Q8_0, bit for bit: random and
    /// extreme codes (every byte value, all-zero and all-one `qh` and nibbles).
    #[test]
    fn dot_q5_0_equals_dot_q8_0_on_the_rewrite() {
        equals_dot_q8_0_on_the_rewrite(
            0x5EED_0005_0000_0022,
            20,
            &[0x00, 0xFF],
            dot_q5_0,
            q5_0_to_q8_0,
        );
    }

    /// `dot_iq4_nl` equals `dot_q8_0` on the blocks rewritten as Q8_0, bit for bit: random
    /// and extreme nibbles (all 0x00, all 0xFF, all 0x0F / 0xF0, every byte value).
    #[test]
    fn dot_iq4_nl_equals_dot_q8_0_on_the_rewrite() {
        equals_dot_q8_0_on_the_rewrite(
            0x5EED_0004_4E4C_0018,
            16,
            &[0x00, 0xFF, 0x0F, 0xF0],
            dot_iq4_nl,
            iq4_nl_to_q8_0,
        );
    }

    /// A hand-computed block: d = 0.5, nibble `j % 16` at element `j` (byte `j` =
    /// `j << 4 | j`), activations all 127 (d_x = 1): `Σ 127 · 2 · K[n]` over the 16 levels
    /// (−127 −104 −83 −65 −49 −35 −22 −10 +1 +13 +25 +38 +53 +69 +89 +113 = −94),
    /// `127 · 2 · −94 = −23876`, times 0.5.
    #[test]
    fn dot_iq4_nl_hand_computed() {
        let mut blk = vec![0x00, 0x38]; // 0.5
        blk.extend((0..16u8).map(|j| (j << 4) | j));
        let a = quantize_acts(&[127.0f32; 32]);
        assert_eq!(a.d[0], 1.0);
        assert_eq!(dot_iq4_nl(&blk, &a), -11938.0);
    }

    /// A hand-computed block: d = 0.5, codes 0..32 in value order (nibble `j % 16`, the
    /// fifth bit set for values 16..32), activations all 127 (d_x = 1):
    /// `Σ (c − 16) · 127 = 127 · (−16 − 15 − … + 15) = −2032`, times 0.5.
    #[test]
    fn dot_q5_0_hand_computed() {
        let mut blk = vec![0x00, 0x38]; // 0.5
        blk.extend_from_slice(&0xFFFF_0000u32.to_le_bytes());
        blk.extend((0..16u8).map(|j| (j << 4) | j));
        let a = quantize_acts(&[127.0f32; 32]);
        assert_eq!(a.d[0], 1.0);
        let codes = q5_0_codes(&blk);
        assert_eq!(codes[0], 0);
        assert_eq!(codes[15], 15);
        assert_eq!(codes[16], 16);
        assert_eq!(codes[31], 31);
        assert_eq!(dot_q5_0(&blk, &a), -1016.0);
    }
}
