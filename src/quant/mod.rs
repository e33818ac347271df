//! KIVI affine quantisation kernels (DESIGN.md §2); the scalar oracle is
//! `tinygpt_reference::quant`, and these must agree with it bit for bit.
//!
//! ```text
//!     scale = f16(max(1e-5, (hi - lo) / (qmax - qmin)))     zero = f16(lo)   (saturating)
//!     q     = clamp(round_ties_even((x - zero) / scale + qmin), qmin, qmax)
//!     x'    = (q - qmin) * scale + zero                     (f32, no FMA)
//! ```
//!
//! ## Code layout
//! Codes are stored offset-binary, `u = q - qmin` (int8: one byte, `u ∈ [0, 255]`;
//! int4: one nibble, `u ∈ [0, 15]`), so dequantisation is `u * scale + zero`.
//! int4 packs along the head dimension: element `2j` is the **low** nibble of byte `j`,
//! element `2j + 1` the **high** nibble. A slice of `n` codes takes
//! [`Bits::packed_len`]`(n)` bytes.
//!
//! Scale and zero are kept as `f16` and converted to f32 before any arithmetic. Values
//! beyond f16's range saturate the parameters to `±65504` instead of overflowing (see
//! the reference's module docs for the full list of edge cases).

use half::f16;

/// int8 codes: `q ∈ [INT8_QMIN, INT8_QMAX]`.
pub const INT8_QMIN: i32 = -128;
pub const INT8_QMAX: i32 = 127;
/// int4 codes: `q ∈ [INT4_QMIN, INT4_QMAX]`.
pub const INT4_QMIN: i32 = -8;
pub const INT4_QMAX: i32 = 7;
/// Lower bound of every scale, before the f16 rounding.
pub const MIN_SCALE: f32 = 1e-5;

/// A KIVI code width.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bits {
    Int8,
    Int4,
}

impl Bits {
    #[inline]
    pub fn qmin(self) -> i32 {
        match self {
            Bits::Int8 => INT8_QMIN,
            Bits::Int4 => INT4_QMIN,
        }
    }
    #[inline]
    pub fn qmax(self) -> i32 {
        match self {
            Bits::Int8 => INT8_QMAX,
            Bits::Int4 => INT4_QMAX,
        }
    }
    /// Bytes holding `n` packed codes.
    #[inline]
    pub fn packed_len(self, n: usize) -> usize {
        match self {
            Bits::Int8 => n,
            Bits::Int4 => n.div_ceil(2),
        }
    }
}

/// f16 with round-to-nearest-even, saturating at `±f16::MAX` instead of overflowing.
#[inline]
pub fn f16_saturating(x: f32) -> f16 {
    let h = f16::from_f32(x);
    if h.is_infinite() {
        if x > 0.0 {
            f16::MAX
        } else {
            f16::MIN
        }
    } else {
        h
    }
}

/// Stored `(scale, zero)` for a slice with minimum `lo` and maximum `hi`.
#[inline]
pub fn params(lo: f32, hi: f32, bits: Bits) -> (f16, f16) {
    let levels = (bits.qmax() - bits.qmin()) as f32;
    let scale = f32::max(MIN_SCALE, (hi - lo) / levels);
    (f16_saturating(scale), f16_saturating(lo))
}

/// `(min, max)` of a slice (NaNs ignored).
#[inline]
pub fn min_max(x: &[f32]) -> (f32, f32) {
    x.iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        })
}

/// Offset code `u = q - qmin` of one value, given f32 copies of the stored parameters.
#[inline]
fn code(x: f32, scale: f32, zero: f32, bits: Bits) -> u8 {
    let qmin = bits.qmin() as f32;
    let q = ((x - zero) / scale + qmin).round_ties_even();
    (q.clamp(qmin, bits.qmax() as f32) - qmin) as u8
}

/// Writes code `u` (already offset) at element `j` of a packed row.
#[inline]
fn put(out: &mut [u8], j: usize, u: u8, bits: Bits) {
    match bits {
        Bits::Int8 => out[j] = u,
        Bits::Int4 => {
            let b = &mut out[j / 2];
            if j.is_multiple_of(2) {
                *b = (*b & 0xf0) | u;
            } else {
                *b = (*b & 0x0f) | (u << 4);
            }
        }
    }
}

/// Offset code of element `j` of a packed row.
#[inline]
pub fn get(codes: &[u8], j: usize, bits: Bits) -> u8 {
    match bits {
        Bits::Int8 => codes[j],
        Bits::Int4 => {
            let b = codes[j / 2];
            if j.is_multiple_of(2) {
                b & 0x0f
            } else {
                b >> 4
            }
        }
    }
}

/// Quantises one token slice (a V row of one KV head) with parameters fitted to it.
/// `out` holds `bits.packed_len(x.len())` bytes.
pub fn quantize_token(x: &[f32], bits: Bits, out: &mut [u8]) -> (f16, f16) {
    debug_assert_eq!(out.len(), bits.packed_len(x.len()));
    let (lo, hi) = min_max(x);
    let (scale, zero) = params(lo, hi, bits);
    let (s, z) = (scale.to_f32(), zero.to_f32());
    if bits == Bits::Int4 && x.len() % 2 == 1 {
        out[x.len() / 2] = 0;
    }
    for (j, &v) in x.iter().enumerate() {
        put(out, j, code(v, s, z, bits), bits);
    }
    (scale, zero)
}

/// Quantises one row with per-element parameters (a K row of one KV head: one
/// `(scale, zero)` per channel). `scale`/`zero` are f32 copies of the stored f16 values.
pub fn quantize_channels(x: &[f32], scale: &[f32], zero: &[f32], bits: Bits, out: &mut [u8]) {
    debug_assert_eq!(scale.len(), x.len());
    debug_assert_eq!(zero.len(), x.len());
    debug_assert_eq!(out.len(), bits.packed_len(x.len()));
    if bits == Bits::Int4 && x.len() % 2 == 1 {
        out[x.len() / 2] = 0;
    }
    for j in 0..x.len() {
        put(out, j, code(x[j], scale[j], zero[j], bits), bits);
    }
}

/// Dequantises a token slice: `out[j] = u_j * scale + zero`.
pub fn dequantize_token(codes: &[u8], scale: f16, zero: f16, bits: Bits, out: &mut [f32]) {
    debug_assert_eq!(codes.len(), bits.packed_len(out.len()));
    let (s, z) = (scale.to_f32(), zero.to_f32());
    match bits {
        Bits::Int8 => {
            for (o, &u) in out.iter_mut().zip(codes) {
                *o = u as f32 * s + z;
            }
        }
        Bits::Int4 => {
            let mut pairs = out.chunks_exact_mut(2);
            for (o, &b) in (&mut pairs).zip(codes) {
                o[0] = (b & 0x0f) as f32 * s + z;
                o[1] = (b >> 4) as f32 * s + z;
            }
            if let [last] = pairs.into_remainder() {
                *last = (codes[codes.len() - 1] & 0x0f) as f32 * s + z;
            }
        }
    }
}

/// Dequantises a row with per-element parameters (f32 copies of the stored f16 values).
pub fn dequantize_channels(codes: &[u8], scale: &[f32], zero: &[f32], bits: Bits, out: &mut [f32]) {
    debug_assert_eq!(codes.len(), bits.packed_len(out.len()));
    debug_assert_eq!(scale.len(), out.len());
    debug_assert_eq!(zero.len(), out.len());
    match bits {
        Bits::Int8 => {
            for j in 0..out.len() {
                out[j] = codes[j] as f32 * scale[j] + zero[j];
            }
        }
        Bits::Int4 => {
            for j in 0..out.len() {
                out[j] = get(codes, j, bits) as f32 * scale[j] + zero[j];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tinygpt_reference::quant as r;

    fn rbits(b: Bits) -> r::Bits {
        match b {
            Bits::Int8 => r::Bits::Int8,
            Bits::Int4 => r::Bits::Int4,
        }
    }

    #[test]
    fn constants_match_reference() {
        assert_eq!(
            (INT8_QMIN, INT8_QMAX, INT4_QMIN, INT4_QMAX, MIN_SCALE),
            (
                r::INT8_QMIN,
                r::INT8_QMAX,
                r::INT4_QMIN,
                r::INT4_QMAX,
                r::MIN_SCALE
            )
        );
    }

    #[test]
    fn int4_layout_literal_bytes() {
        // q = [-8, 7, 0, -1, 3, 5] → u = [0, 15, 8, 7, 11, 13]: low nibble = even element.
        let x = [-8.0f32, 7.0, 0.0, -1.0, 3.0, 5.0];
        let s = [1.0f32; 6];
        let z = [-8.0f32; 6];
        let mut out = [0xAAu8; 3];
        quantize_channels(&x, &s, &z, Bits::Int4, &mut out);
        assert_eq!(out, [0xF0, 0x78, 0xDB]);
        let mut back = [0.0f32; 6];
        dequantize_channels(&out, &s, &z, Bits::Int4, &mut back);
        assert_eq!(back, x);
    }

    #[test]
    fn nibble_identity_all_codes_both_positions() {
        for u in 0..16u8 {
            for other in 0..16u8 {
                let mut b = [0u8; 1];
                put(&mut b, 0, u, Bits::Int4);
                put(&mut b, 1, other, Bits::Int4);
                assert_eq!((get(&b, 0, Bits::Int4), get(&b, 1, Bits::Int4)), (u, other));
                assert_eq!(b[0], u | (other << 4));
            }
        }
    }

    #[test]
    fn matches_reference_bitwise_on_odd_lengths() {
        let mut seed = 0x1234_5678u32;
        let mut rnd = || {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            (seed as f32 / u32::MAX as f32) * 8.0 - 4.0
        };
        for bits in [Bits::Int8, Bits::Int4] {
            for n in [1usize, 2, 3, 7, 17, 32, 33] {
                let x: Vec<f32> = (0..n).map(|_| rnd()).collect();
                let mut out = vec![0u8; bits.packed_len(n)];
                let (s, z) = quantize_token(&x, bits, &mut out);
                let (codes, a) = r::quantize_row(&x, rbits(bits));
                assert_eq!((s, z), (a.scale, a.zero), "bits={bits:?} n={n}");
                assert_eq!(
                    out,
                    r::pack_codes(&codes, rbits(bits)),
                    "bits={bits:?} n={n}"
                );
                let mut back = vec![0.0f32; n];
                dequantize_token(&out, s, z, bits, &mut back);
                for j in 0..n {
                    let want = a.dequantize(codes[j], rbits(bits));
                    assert_eq!(
                        back[j].to_bits(),
                        want.to_bits(),
                        "bits={bits:?} n={n} j={j}"
                    );
                }
            }
        }
    }
}
