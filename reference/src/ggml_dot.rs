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
//!
//! The integer sums are exact. Each row's float terms are accumulated block by block in
//! the order written in the functions below (for Q4_1, `acc += isum · (d_w · d_x) +
//! m_w · s_x`), with separate multiplies and adds; the engine's kernels (every run-time
//! variant) do the same steps in vector lanes, one row per lane, so they equal this twin
//! bit for bit.

use crate::ggml::f16_at;

/// Values per block.
pub const QK: usize = 32;

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
            isum += (nibble(qs, i) - 8) * x.q[i] as i32;
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
