//! Dot products of GGML-quantised weight rows (Q8_0, Q4_0, Q4_1) with an activation vector
//! quantised to 8 bits per block, as llama.cpp does: a 4-bit model reads 4-bit weights.
//!
//! Numerics are those of `tinygpt_reference::ggml_dot` (read its header); the only
//! difference is summation order: per block, the integer products are summed exactly in
//! `i16x16::dot` lanes (`pmaddwd`), then each block's eight lane sums are scaled and
//! accumulated in an `f32x8`, reduced once per row.
//!
//! Block layouts (little-endian): Q8_0 = f16 d, 32 × i8; Q4_0 = f16 d, 16 nibble bytes;
//! Q4_1 = f16 d, f16 m, 16 nibble bytes. Nibbles: byte `i` holds element `i` in its low
//! nibble and element `i + 16` in its high nibble.

use half::f16;
use wide::{f32x8, i16x16, i32x8, i8x16};

/// Values per block.
pub const QK: usize = 32;

/// An activation vector quantised to 8 bits per block, widened to i16 for `pmaddwd`.
#[derive(Debug, Clone, Default)]
pub struct QuantizedActs {
    /// Per block: scale `d_x`.
    pub d: Vec<f32>,
    /// Per block: `d_x · Σ q_x` (for Q4_1's min term).
    pub s: Vec<f32>,
    /// Codes in `[-127, 127]`, one per value, as i16.
    pub q: Vec<i16>,
}

impl QuantizedActs {
    /// Quantises `x` (length a multiple of 32): same rounding as the reference twin.
    pub fn quantize(&mut self, x: &[f32]) {
        debug_assert_eq!(x.len() % QK, 0);
        let nb = x.len() / QK;
        self.d.resize(nb, 0.0);
        self.s.resize(nb, 0.0);
        self.q.resize(x.len(), 0);
        for (b, blk) in x.chunks_exact(QK).enumerate() {
            let amax = blk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let mut sum = 0i32;
            for (o, &v) in self.q[b * QK..(b + 1) * QK].iter_mut().zip(blk) {
                let q = ((v * id).round() as i32).clamp(-127, 127);
                sum += q;
                *o = q as i16;
            }
            self.d[b] = d;
            self.s[b] = d * sum as f32;
        }
    }

    pub fn from_f32(x: &[f32]) -> Self {
        let mut a = QuantizedActs::default();
        a.quantize(x);
        a
    }
}

#[inline(always)]
fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

#[inline(always)]
fn load_i16(q: &[i16]) -> i16x16 {
    i16x16::new(q[..16].try_into().expect("16 lanes"))
}

#[inline(always)]
fn load_i8_as_i16(b: &[u8]) -> i16x16 {
    let a: [u8; 16] = b[..16].try_into().expect("16 bytes");
    i16x16::from_i8x16(i8x16::new(bytemuck::cast(a)))
}

#[inline(always)]
fn reduce(acc: f32x8) -> f32 {
    acc.reduce_add()
}

/// Q8_0 row · activations.
pub fn dot_q8_0(row: &[u8], a: &QuantizedActs) -> f32 {
    let mut acc = f32x8::ZERO;
    for (b, blk) in row.chunks_exact(34).enumerate() {
        let scale = f16_at(blk, 0) * a.d[b];
        let q = &a.q[b * QK..];
        let s: i32x8 = load_i8_as_i16(&blk[2..]).dot(load_i16(q))
            + load_i8_as_i16(&blk[18..]).dot(load_i16(&q[16..]));
        acc = f32x8::from_i32x8(s).mul_add(f32x8::splat(scale), acc);
    }
    reduce(acc)
}

/// Splits 16 nibble bytes into (elements 0..16, elements 16..32) as i16 codes 0..15.
#[inline(always)]
fn nibbles(qs: &[u8]) -> (i16x16, i16x16) {
    let v = load_i8_as_i16(qs); // sign-extended bytes: the low 8 bits are intact
    let m = i16x16::splat(0x0F);
    (v & m, (v >> 4) & m)
}

/// Q4_0 row · activations.
pub fn dot_q4_0(row: &[u8], a: &QuantizedActs) -> f32 {
    let mut acc = f32x8::ZERO;
    let eight = i16x16::splat(8);
    for (b, blk) in row.chunks_exact(18).enumerate() {
        let scale = f16_at(blk, 0) * a.d[b];
        let q = &a.q[b * QK..];
        let (lo, hi) = nibbles(&blk[2..18]);
        let s = (lo - eight).dot(load_i16(q)) + (hi - eight).dot(load_i16(&q[16..]));
        acc = f32x8::from_i32x8(s).mul_add(f32x8::splat(scale), acc);
    }
    reduce(acc)
}

/// Q4_1 row · activations.
pub fn dot_q4_1(row: &[u8], a: &QuantizedActs) -> f32 {
    let mut acc = f32x8::ZERO;
    let mut mins = 0.0f32;
    for (b, blk) in row.chunks_exact(20).enumerate() {
        let scale = f16_at(blk, 0) * a.d[b];
        mins += f16_at(blk, 2) * a.s[b];
        let q = &a.q[b * QK..];
        let (lo, hi) = nibbles(&blk[4..20]);
        let s = lo.dot(load_i16(q)) + hi.dot(load_i16(&q[16..]));
        acc = f32x8::from_i32x8(s).mul_add(f32x8::splat(scale), acc);
    }
    reduce(acc) + mins
}
