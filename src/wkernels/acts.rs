//! The activation side of the quantised products: the engine's own quantisers of an f32
//! vector into the formats the weight types read ([`super::Acts`]), as llama.cpp does (a
//! 4-bit model reads 4-bit weights against 8-bit activations):
//!
//! * 8-bit blocks of 32 ([`QuantizedActs`]'s `d`, `s`, `qsum`, `q`; ggml's Q8_0 and, with
//!   the sums, Q8_1 roles): `d = max|x| / 127`, `q = round(x / d)` (half away from zero,
//!   clamped to ±127; NaN codes 0; an all-zero block has `d = 0`), `s = d · Σ q`;
//! * Q8_K super-blocks of 256 ([`Q8K`]): `max` = the first value of largest magnitude,
//!   `iscale = −127 / max`, `q = min(127, round_ties_even(iscale · x))` (NaN codes 0),
//!   `d = 1 / iscale`, and the 16 sums of consecutive 16-code groups (`bsums`); an
//!   all-zero (or all-NaN) block has `d = 0` and zero codes.
//!
//! Both equal the reference's twins (`tinygpt_reference::ggml_dot::quantize_acts`,
//! `ggml_kdot::quantize_q8_k`) bit for bit (unit tests below; `tests/kernels.rs`).
//! [`ActsTile`] interleaves a few tokens' blocks for the AVX-512 tile kernel.

use super::blocks::QK_K;
use super::{Acts, QK};
use crate::dtype::DType;
use crate::ops::simd::load8;
use wide::{f32x8, i32x8, CmpGe, CmpLe};

/// An activation vector quantised to 8 bits per block.
#[derive(Debug, Clone, Default)]
pub struct QuantizedActs {
    /// Per block: scale `d_x`.
    pub d: Vec<f32>,
    /// Per block: `d_x · Σ q_x` (for Q4_1's min term).
    pub s: Vec<f32>,
    /// Per block: `Σ q_x` (integer; the kernels' offset corrections use it).
    pub qsum: Vec<i32>,
    /// Codes in `[-127, 127]`, one per value.
    pub q: Vec<i8>,
    /// The same vector as Q8_K super-blocks of 256 (for the K-quant and IQ4_XS weights);
    /// empty when the length is not a multiple of 256 or no matrix reads it.
    pub k: Q8K,
}

/// Which quantised forms of an activation vector the matrices reading it need: 8-bit
/// blocks of 32 ([`Acts::Q8_0`]) and/or Q8_K super-blocks ([`Acts::Q8K`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ActsForms {
    pub q8_0: bool,
    pub q8_k: bool,
}

impl ActsForms {
    /// Both forms.
    pub const ALL: ActsForms = ActsForms {
        q8_0: true,
        q8_k: true,
    };

    /// The form a matrix of `dtype` reads (none for float types): the type table's
    /// [`super::Entry::acts`].
    pub fn of(dtype: DType) -> ActsForms {
        ActsForms::from_acts(super::entry(dtype).acts)
    }

    /// The form kernels reading `acts` need.
    pub fn from_acts(acts: Acts) -> ActsForms {
        ActsForms {
            q8_0: acts == Acts::Q8_0,
            q8_k: acts == Acts::Q8K,
        }
    }

    /// Both sets of forms.
    pub fn union(self, o: ActsForms) -> ActsForms {
        ActsForms {
            q8_0: self.q8_0 || o.q8_0,
            q8_k: self.q8_k || o.q8_k,
        }
    }

    /// Whether any form is needed.
    pub fn any(self) -> bool {
        self.q8_0 || self.q8_k
    }
}

impl QuantizedActs {
    /// Quantises `x` (length a multiple of 32) into both forms ([`ActsForms::ALL`]).
    pub fn quantize(&mut self, x: &[f32]) {
        self.quantize_forms(x, ActsForms::ALL);
    }

    /// Quantises `x` into the forms `forms` names; the others are left empty (a kernel
    /// that would read them asserts their lengths). The Q8_K form exists only when the
    /// length is a multiple of 256.
    pub fn quantize_forms(&mut self, x: &[f32], forms: ActsForms) {
        if forms.q8_0 {
            self.quantize_q8_0(x);
        } else {
            self.d.clear();
            self.s.clear();
            self.qsum.clear();
            self.q.clear();
        }
        if forms.q8_k {
            self.k.quantize(x);
        } else {
            self.k.quantize(&[]);
        }
    }

    /// The 8-bit blocks of 32: same rounding as the reference twin (`round` half away
    /// from zero, then clamped to ±127; NaN codes 0), eight lanes at a time.
    fn quantize_q8_0(&mut self, x: &[f32]) {
        debug_assert_eq!(x.len() % QK, 0);
        let nb = x.len() / QK;
        self.d.resize(nb, 0.0);
        self.s.resize(nb, 0.0);
        self.qsum.resize(nb, 0);
        self.q.resize(x.len(), 0);
        let (half, one, lim) = (f32x8::splat(0.5), f32x8::ONE, f32x8::splat(128.0));
        for (b, blk) in x.chunks_exact(QK).enumerate() {
            let v: [f32x8; 4] = std::array::from_fn(|i| load8(&blk[i * 8..]));
            // `wide`'s `max` ignores a NaN lane as `f32::max` does; the maximum of the
            // other values does not depend on the order.
            let amax = v
                .iter()
                .fold(f32x8::ZERO, |m, vi| m.max(vi.abs()))
                .to_array()
                .into_iter()
                .fold(0.0f32, f32::max);
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            let idv = f32x8::splat(id);
            let mut sum = i32x8::ZERO;
            for (vi, out) in v
                .iter()
                .zip(self.q[b * QK..(b + 1) * QK].chunks_exact_mut(8))
            {
                // NaN codes 0 (as `NaN as i32`); the rest is clamped to ±128, then rounded
                // half away from zero exactly (`y − trunc(y)` is exact for |y| ≤ 128).
                let y = *vi * idv;
                let y = y.is_nan().blend(f32x8::ZERO, y).max(-lim).min(lim);
                let t = y.trunc_int();
                let frac = y - t.round_float();
                let up = frac.cmp_ge(half).blend(one, f32x8::ZERO)
                    - frac.cmp_le(-half).blend(one, f32x8::ZERO);
                let q = (t + up.round_int())
                    .max(i32x8::splat(-127))
                    .min(i32x8::splat(127));
                sum += q;
                for (o, qi) in out.iter_mut().zip(q.to_array()) {
                    *o = qi as i8;
                }
            }
            let sum = sum.reduce_add();
            self.d[b] = d;
            self.s[b] = d * sum as f32;
            self.qsum[b] = sum;
        }
    }

    pub fn from_f32(x: &[f32]) -> Self {
        let mut a = QuantizedActs::default();
        a.quantize(x);
        a
    }

    /// Number of blocks.
    pub fn blocks(&self) -> usize {
        self.d.len()
    }
}

/// An activation vector quantised to Q8_K super-blocks of [`QK_K`] values (module docs).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Q8K {
    /// Per super-block: the scale `d_x` (its sign is that of `−max`).
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

    /// Quantises `x` when its length is a whole number of super-blocks; else (no K-quant
    /// matrix can have that many columns) leaves every field empty.
    pub fn quantize(&mut self, x: &[f32]) {
        if x.is_empty() || !x.len().is_multiple_of(QK_K) {
            self.d.clear();
            self.q.clear();
            self.bsums.clear();
            return;
        }
        let nb = x.len() / QK_K;
        self.d.resize(nb, 0.0);
        self.q.resize(x.len(), 0);
        self.bsums.resize(nb * 16, 0);
        let blocks = x
            .chunks_exact(QK_K)
            .zip(self.q.chunks_exact_mut(QK_K))
            .zip(self.bsums.chunks_exact_mut(16));
        for (d, ((xb, qb), sb)) in self.d.iter_mut().zip(blocks) {
            *d = q8_k_block(xb, qb, sb);
        }
    }

    /// `x` quantised (see [`Q8K::quantize`]).
    pub fn from_f32(x: &[f32]) -> Q8K {
        let mut k = Q8K::default();
        k.quantize(x);
        k
    }
}

/// One Q8_K super-block: codes into `q`, the 16 group sums into `bsums`; returns `d`.
fn q8_k_block(x: &[f32], q: &mut [i8], bsums: &mut [i16]) -> f32 {
    // The first value of the largest magnitude (a NaN never compares larger).
    let max = x
        .iter()
        .fold(0.0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
    if max == 0.0 {
        q.fill(0);
        bsums.fill(0);
        return 0.0;
    }
    let iscale = -127.0f32 / max;
    for (c, &v) in q.iter_mut().zip(x) {
        let y = iscale * v;
        // ggml's `nearest_int`: ties to even; a NaN codes 0.
        let n = if y.is_nan() {
            0
        } else {
            y.round_ties_even() as i32
        };
        *c = n.clamp(-128, 127) as i8;
    }
    for (s, g) in bsums.iter_mut().zip(q.chunks_exact(16)) {
        *s = g.iter().map(|&c| i16::from(c)).sum();
    }
    1.0 / iscale
}

/// Tokens of one [`ActsTile`].
pub const TILE: usize = 8;

/// Up to [`TILE`] tokens' quantised activations, plus a copy interleaved by token for
/// the AVX-512 tile kernel: per block `b`, per 4-byte word `e` of the block (elements
/// `4e..4e + 4`), the tile's tokens' words side by side, so one 16-byte broadcast gives a
/// vector whose lane `(row j, token t)` holds token `t`'s word for every row `j`. Built
/// once per batched product; a short tile repeats its last token (results dropped).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub struct ActsTile<'a> {
    acts: Vec<&'a QuantizedActs>,
    nb: usize,
    /// `[nb][8][TILE][4]` codes.
    q: Vec<i8>,
    /// `[nb][TILE]` scales `d_x`, sums `s_x` and integer sums `Σ q_x`.
    d: Vec<f32>,
    s: Vec<f32>,
    qsum: Vec<i32>,
}

impl<'a> ActsTile<'a> {
    /// Interleaves `acts` (1 to [`TILE`] tokens, equal block counts).
    pub fn new(acts: &[&'a QuantizedActs]) -> ActsTile<'a> {
        assert!(
            !acts.is_empty() && acts.len() <= TILE,
            "1..={TILE} tokens per tile"
        );
        let nb = acts[0].blocks();
        let tok = |t: usize| acts[t.min(acts.len() - 1)];
        let mut q = vec![0i8; nb * 8 * TILE * 4];
        let (mut d, mut s, mut qsum) = (
            vec![0.0; nb * TILE],
            vec![0.0; nb * TILE],
            vec![0; nb * TILE],
        );
        for b in 0..nb {
            for t in 0..TILE {
                let a = tok(t);
                assert_eq!(a.blocks(), nb, "activation blocks differ within a tile");
                for e in 0..8 {
                    let at = ((b * 8 + e) * TILE + t) * 4;
                    q[at..at + 4].copy_from_slice(&a.q[b * QK + e * 4..b * QK + e * 4 + 4]);
                }
                d[b * TILE + t] = a.d[b];
                s[b * TILE + t] = a.s[b];
                qsum[b * TILE + t] = a.qsum[b];
            }
        }
        ActsTile {
            acts: acts.to_vec(),
            nb,
            q,
            d,
            s,
            qsum,
        }
    }

    /// Number of (real) tokens.
    pub fn len(&self) -> usize {
        self.acts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.acts.is_empty()
    }

    /// The tile's tokens (without the repeats).
    pub fn tokens(&self) -> &[&'a QuantizedActs] {
        &self.acts
    }

    /// The interleaved arrays, for the tile kernel.
    pub fn view(&self) -> TileView<'_> {
        TileView {
            nb: self.nb,
            q: &self.q,
            d: &self.d,
            s: &self.s,
            qsum: &self.qsum,
        }
    }
}

/// The interleaved arrays of an [`ActsTile`], for the kernels.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub struct TileView<'t> {
    pub nb: usize,
    pub q: &'t [i8],
    pub d: &'t [f32],
    pub s: &'t [f32],
    pub qsum: &'t [i32],
}

#[cfg(test)]
mod tests {
    use super::*;
    use tinygpt_reference::{ggml_dot, ggml_kdot};

    /// Vectors of 256·n values: random at several magnitudes, constant, zero, a lone
    /// extreme, NaN and ±Inf sprinkled in, ties (`k + 0.5` steps).
    fn vectors() -> Vec<Vec<f32>> {
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
        };
        let mut out = Vec::new();
        for scale in [1e-38f32, 1e-6, 1.0, 3e4, 1e38] {
            for n in [1usize, 2, 3] {
                out.push((0..256 * n).map(|_| next() * scale).collect());
            }
        }
        out.push(vec![0.25; 256]);
        out.push(vec![-7.0; 512]);
        out.push(vec![0.0; 256]);
        out.push(vec![f32::NAN; 256]);
        let mut lone = vec![0.0f32; 256];
        lone[77] = -1e30;
        out.push(lone);
        let mut odd: Vec<f32> = (0..256).map(|i| (i as f32 - 128.0) * 0.5).collect();
        odd[3] = f32::NAN;
        odd[9] = f32::INFINITY;
        out.push(odd.clone());
        odd[9] = 127.0;
        out.push(odd);
        out.push(
            (0..256)
                .map(|i| (i % 17) as f32 * 127.0 / 16.0 + 0.5)
                .collect(),
        );
        out
    }

    fn same(a: &[f32], b: &[f32]) -> bool {
        a.iter()
            .zip(b)
            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
    }

    #[test]
    fn q8_k_equals_the_reference() {
        for x in vectors() {
            let ours = Q8K::from_f32(&x);
            let theirs = ggml_kdot::quantize_q8_k(&x);
            assert!(same(&ours.d, &theirs.d), "d {:?} vs {:?}", ours.d, theirs.d);
            assert_eq!(ours.q, theirs.q);
            assert_eq!(ours.bsums, theirs.bsums);
        }
        assert_eq!(Q8K::from_f32(&[1.0; 100]).blocks(), 0);
    }

    #[test]
    fn blocks_of_32_equal_the_reference() {
        for x in vectors() {
            let ours = QuantizedActs::from_f32(&x);
            let theirs = ggml_dot::quantize_acts(&x);
            assert!(same(&ours.d, &theirs.d));
            assert!(same(&ours.s, &theirs.s));
            assert_eq!(ours.q, theirs.q);
            for (b, &sum) in ours.qsum.iter().enumerate() {
                let want: i32 = theirs.q[32 * b..32 * b + 32]
                    .iter()
                    .map(|&c| c as i32)
                    .sum();
                assert_eq!(sum, want);
            }
        }
    }
}
