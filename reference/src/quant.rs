//! KIVI affine quantisation (docs/design.md §2), written to be read.
//!
//! Over a slice `x` (a K channel within a token group, or one KV head's slice of a V row):
//!
//! ```text
//!     lo, hi = min(x), max(x)
//!     scale  = max(1e-5, (hi - lo) / (qmax - qmin))      in f32
//!     zero   = lo
//!     scale, zero stored as f16 (round to nearest even) and used as those f16 values,
//!     converted back to f32 before any arithmetic
//!     q  = clamp(round_ties_even((x - zero) / scale + qmin), qmin, qmax)
//!     x' = (q - qmin) * scale + zero                     in f32, no fused multiply-add
//! ```
//!
//! ## Stored codes
//! A code is stored *offset-binary*: the byte (or nibble, or bit pair) holds `u = q - qmin`,
//! so `u ∈ [0, 255]` for int8, `u ∈ [0, 15]` for int4 and `u ∈ [0, 3]` for int2, and
//! `x' = u * scale + zero`.
//! int4 packs two codes per byte along the head dimension: element `2j` goes in the
//! **low** nibble of byte `j`, element `2j + 1` in the **high** nibble. A row of odd
//! length leaves the last high nibble zero (head_dim is always even in practice).
//! int2 packs four codes per byte: element `4j + i` goes in bits `2i..2i + 2` of byte `j`
//! (element `4j` in the lowest two bits). Unused bit pairs of a last partial byte are zero
//! (head_dim must be a multiple of 4 for int2, so this does not arise in a cache).
//!
//! ## f16 edge cases (documented choices)
//! * Underflow: the smallest scale, `1e-5`, is below f16's smallest normal (6.1e-5) and
//!   is stored as the subnormal `168 · 2^-24 ≈ 1.0014e-5`: never zero, so no division by
//!   zero and no NaN. Zeros near `1e-7` round to a multiple of `2^-24 ≈ 6e-8`.
//! * Rounding the scale to f16 may make it slightly *smaller* than `(hi - lo) / (qmax -
//!   qmin)`; values near `hi` then clamp to `qmax`. The round-trip error is bounded by
//!   [`Affine::error_bound`]: `scale/2 + (qmax-qmin)·max(0, scale32 - scale) + |lo - zero|`
//!   (plus a few f32 ulps).
//! * Overflow: values with `|x| ≥ 65520` (beyond f16's range) would make `zero` or
//!   `scale` infinite. Both are stored *saturated* to `±65504` ([`f16_saturating`]),
//!   so every stored parameter is finite; such out-of-range values then clamp to
//!   the nearest representable code instead of producing Inf/NaN. Every value
//!   within f16's range is unaffected by the saturation.

use half::f16;

/// The code widths and their named ranges (`q ∈ [INT8_QMIN, INT8_QMAX]`, ...), shared with
/// the engine through `tinygpt-types`.
pub use tinygpt_types::kv::{
    Bits, INT2_QMAX, INT2_QMIN, INT4_QMAX, INT4_QMIN, INT8_QMAX, INT8_QMIN,
};
/// Lower bound of every scale, before the f16 rounding.
pub const MIN_SCALE: f32 = 1e-5;

/// Converts to f16 with round-to-nearest-even, saturating at `±f16::MAX` instead of
/// overflowing to infinity. NaN stays NaN.
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

/// The stored parameters of one quantised slice.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Affine {
    pub scale: f16,
    pub zero: f16,
}

impl Affine {
    /// Parameters for a slice whose minimum is `lo` and maximum `hi`.
    pub fn from_range(lo: f32, hi: f32, bits: Bits) -> Affine {
        let levels = (bits.qmax() - bits.qmin()) as f32;
        let scale = f32::max(MIN_SCALE, (hi - lo) / levels);
        Affine {
            scale: f16_saturating(scale),
            zero: f16_saturating(lo),
        }
    }

    /// Parameters fitted to `x` (min and max over the slice).
    pub fn fit(x: &[f32], bits: Bits) -> Affine {
        let mut lo = f32::INFINITY;
        let mut hi = f32::NEG_INFINITY;
        for &v in x {
            lo = lo.min(v);
            hi = hi.max(v);
        }
        Affine::from_range(lo, hi, bits)
    }

    /// Quantises one value to its signed code `q ∈ [qmin, qmax]`.
    pub fn quantize(self, x: f32, bits: Bits) -> i32 {
        let scale = self.scale.to_f32();
        let zero = self.zero.to_f32();
        let qmin = bits.qmin() as f32;
        let qmax = bits.qmax() as f32;
        let q = ((x - zero) / scale + qmin).round_ties_even();
        q.clamp(qmin, qmax) as i32
    }

    /// Dequantises a signed code.
    pub fn dequantize(self, q: i32, bits: Bits) -> f32 {
        let scale = self.scale.to_f32();
        let zero = self.zero.to_f32();
        (q - bits.qmin()) as f32 * scale + zero
    }

    /// Worst-case `|x - x'|` for any `x ∈ [lo, hi]` quantised with `self` (fitted to
    /// `[lo, hi]`), including the f16 rounding of scale and zero and f32 rounding.
    pub fn error_bound(self, lo: f32, hi: f32, bits: Bits) -> f32 {
        let levels = (bits.qmax() - bits.qmin()) as f32;
        let s = self.scale.to_f32();
        let s32 = f32::max(MIN_SCALE, (hi - lo) / levels);
        let z = self.zero.to_f32();
        let ulps = 4.0 * f32::EPSILON * (lo.abs().max(hi.abs()) + levels * s);
        s / 2.0 + levels * (s32 - s).max(0.0) + (lo - z).abs() + ulps
    }
}

/// Quantises `x` with one set of parameters fitted to it; returns signed codes.
pub fn quantize_row(x: &[f32], bits: Bits) -> (Vec<i32>, Affine) {
    let a = Affine::fit(x, bits);
    (x.iter().map(|&v| a.quantize(v, bits)).collect(), a)
}

/// Stores signed codes as bytes: offset-binary `q - qmin`, packed two per byte for int4
/// (element `2j` in the low nibble of byte `j`) and four per byte for int2 (element
/// `4j + i` in bits `2i..2i + 2` of byte `j`).
pub fn pack_codes(codes: &[i32], bits: Bits) -> Vec<u8> {
    let mut out = vec![0u8; bits.packed_len(codes.len())];
    for (j, &q) in codes.iter().enumerate() {
        debug_assert!(
            (bits.qmin()..=bits.qmax()).contains(&q),
            "code {q} out of range"
        );
        let u = (q - bits.qmin()) as u8;
        match bits {
            Bits::Int8 => out[j] = u,
            Bits::Int4 => {
                if j % 2 == 0 {
                    out[j / 2] |= u;
                } else {
                    out[j / 2] |= u << 4;
                }
            }
            Bits::Int2 => out[j / 4] |= u << (2 * (j % 4)),
        }
    }
    out
}

/// Inverse of [`pack_codes`]: the first `n` signed codes held by `bytes`.
pub fn unpack_codes(bytes: &[u8], n: usize, bits: Bits) -> Vec<i32> {
    (0..n)
        .map(|j| {
            let u = match bits {
                Bits::Int8 => bytes[j],
                Bits::Int4 => {
                    if j % 2 == 0 {
                        bytes[j / 2] & 0x0f
                    } else {
                        bytes[j / 2] >> 4
                    }
                }
                Bits::Int2 => (bytes[j / 4] >> (2 * (j % 4))) & 0x03,
            };
            u as i32 + bits.qmin()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constants_and_layout() {
        assert_eq!(
            (INT8_QMIN, INT8_QMAX, INT4_QMIN, INT4_QMAX),
            (-128, 127, -8, 7)
        );
        // q = [-8, 7, 0, -1, 3] → u = [0, 15, 8, 7, 11] → bytes [0xF0, 0x78, 0x0B]
        assert_eq!(
            pack_codes(&[-8, 7, 0, -1, 3], Bits::Int4),
            vec![0xF0, 0x78, 0x0B]
        );
        assert_eq!(
            pack_codes(&[-128, 127, 0], Bits::Int8),
            vec![0x00, 0xFF, 0x80]
        );
        assert_eq!(
            unpack_codes(&[0xF0, 0x78, 0x0B], 5, Bits::Int4),
            vec![-8, 7, 0, -1, 3]
        );
        assert_eq!((INT2_QMIN, INT2_QMAX), (-2, 1));
        // q = [-2, 1, 0, -1, 1, -2] → u = [0, 3, 2, 1, 3, 0]
        // byte 0 = 0 | 3<<2 | 2<<4 | 1<<6 = 0x6C; byte 1 = 3 | 0<<2 = 0x03
        assert_eq!(
            pack_codes(&[-2, 1, 0, -1, 1, -2], Bits::Int2),
            vec![0x6C, 0x03]
        );
        assert_eq!(
            unpack_codes(&[0x6C, 0x03], 6, Bits::Int2),
            vec![-2, 1, 0, -1, 1, -2]
        );
    }

    #[test]
    fn widths_match_ranges_and_packing() {
        for (bits, w, per_byte) in [(Bits::Int8, 8, 1), (Bits::Int4, 4, 2), (Bits::Int2, 2, 4)] {
            assert_eq!(bits.width(), w, "{bits:?}");
            assert_eq!(bits.packed_len(8 * per_byte), 8, "{bits:?}");
        }
    }

    #[test]
    fn min_scale_survives_f16() {
        let a = Affine::from_range(3.0, 3.0, Bits::Int8);
        assert!(a.scale.to_f32() > 0.0);
        assert!((a.scale.to_f32() - 1e-5).abs() < 1e-7, "{}", a.scale);
    }

    #[test]
    fn saturation() {
        let a = Affine::from_range(-1e6, 1e6, Bits::Int4);
        assert!(a.scale.is_finite() && a.zero.is_finite());
        assert_eq!(a.zero, f16::MIN);
        assert!(a
            .dequantize(a.quantize(1e6, Bits::Int4), Bits::Int4)
            .is_finite());
    }
}
