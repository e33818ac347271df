//! The float weight types (F32, F16, BF16 rows × an f32 vector): the one summation order
//! every variant's [`float_rows`](super::scalar::float_rows) keeps, and its pieces.
//!
//! # One order for every variant
//!
//! A row's dot product `w · x` (`n = cols`, `n8 = n − n % 8`) is, in every variant:
//!
//! 1. eight lane sums, lane `l` = `Σ_{i ≡ l (mod 8), i < n8} w_i · x_i` accumulated from
//!    zero with one multiply-add per term (fused iff [`FUSED`]), in increasing `i`;
//! 2. the lanes added as `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))` ([`finish`]);
//! 3. plus the tail `Σ_{i ≥ n8} x_i · w_i` (separate multiply and add, summed from zero:
//!    [`tail`]).
//!
//! f16 and bf16 are widened to f32 exactly before any arithmetic, so every variant equals
//! the scalar twin ([`super::scalar::float_row`], plain loops) bit for bit: the property
//! tests in `tests/float_dispatch.rs` hold each supported variant to it.
//!
//! * `scalar`: the twin (plain loops, [`madd`]);
//! * `portable` (`portable/float.rs`): `wide::f32x8` (any target; f16 widened through
//!   `half`'s slice conversion, bf16 with an integer shift); also what `neon-dotprod` runs
//!   (NEON through `wide`);
//! * `avx2` (`x86/avx2/float.rs`): AVX2 + FMA, f16 widened by F16C `vcvtph2ps`, bf16 by
//!   `vpmovzxwd` + a 16-bit shift; 8 rows in flight, one `ymm` accumulator each, or one
//!   row at a time (`streamed`); `avx512vnni` runs this form as well. A 512-bit form that
//!   keeps the order (two rows' 8 lanes per register, row `2k` in the low half) was
//!   measured and dropped: 25% slower out of L2, no faster out of DRAM (benches/README.md).
//!
//! Not used: AVX512-BF16 `vdpbf16ps` multiplies bf16 by bf16, so it would round the
//! *activations* to bf16 (and it adds pairs of products before accumulating), a different
//! numerical contract from the reference's; the exact widen + FMA path already reads bf16
//! weights from DRAM at the read-bandwidth probe's speed (benches/README.md), so the
//! contract is kept (`docs/design.md`, summation order).

use crate::dtype::DType;
use crate::ops::simd::Elem;
pub use crate::ops::simd::{madd, FUSED};
use half::{bf16, f16};

/// The weights of a float matrix as their element type (row-major, `cols` per row).
#[derive(Clone, Copy)]
pub enum FloatRows<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    Bf16(&'a [bf16]),
}

impl<'a> FloatRows<'a> {
    /// `bytes` of `dtype` as float elements, or `None` for a block type.
    ///
    /// # Panics
    /// If `bytes` is not a whole number of elements or not aligned to one (the loaders
    /// keep every tensor aligned).
    pub fn of(dtype: DType, bytes: &'a [u8]) -> Option<FloatRows<'a>> {
        match dtype {
            DType::F32 => Some(FloatRows::F32(bytemuck::cast_slice(bytes))),
            DType::F16 => Some(FloatRows::F16(bytemuck::cast_slice(bytes))),
            DType::BF16 => Some(FloatRows::Bf16(bytemuck::cast_slice(bytes))),
            DType::Q8_0
            | DType::Q4_0
            | DType::Q4_1
            | DType::Q5_0
            | DType::Q5_1
            | DType::IQ4_NL
            | DType::Q2_K
            | DType::Q3_K
            | DType::Q4_K
            | DType::Q5_K
            | DType::Q6_K
            | DType::IQ4_XS => None,
        }
    }
}

/// Rows one interleaved float kernel call keeps in flight (one accumulator each); row
/// ranges handed to the kernels start on multiples of it.
pub const RB: usize = 8;

/// Steps 2 and 3 of the order (module docs): one row's eight lane sums and tail.
#[inline(always)]
pub fn finish(l: [f32; 8], tail: f32) -> f32 {
    (((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))) + tail
}

/// `Σ_{i ≥ n8} x_i · w_i`, summed from zero (step 3 of the order).
#[inline(always)]
pub fn tail<E: Elem>(w: &[E], x: &[f32], n8: usize) -> f32 {
    let mut t = 0.0f32;
    for (wi, xi) in w[n8..].iter().zip(&x[n8..]) {
        t += xi * wi.to_f32();
    }
    t
}
