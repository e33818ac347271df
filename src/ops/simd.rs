//! Vector primitives over `wide::f32x8`, each with a scalar tail. Depends on nothing
//! else in the crate (`kivi` and the cache's kernels build on it, never the reverse).

use half::{bf16, f16, slice::HalfFloatSliceExt};
use wide::{f32x8, i32x8, u16x8};

const W: usize = 8;

/// The first 8 values of `s` as a vector (`s.len() >= 8`, checked by the slice).
#[inline(always)]
pub fn load8(s: &[f32]) -> f32x8 {
    let a: [f32; W] = s[..W].try_into().expect("slice of 8");
    f32x8::from(a)
}

/// Whether `wide::f32x8::mul_add` fuses the multiply and the add: `wide` 0.7 fuses only on
/// x86_64 builds with FMA enabled (`target-cpu=native` on any FMA CPU); elsewhere (aarch64
/// included) it multiplies, rounds, then adds. Every kernel whose order names a
/// multiply-add (the float weight rows, the exact KIVI kernels) follows it, and so do the
/// scalar twins ([`madd`]; found by `tests/float_dispatch.rs` under
/// `scripts/test-aarch64.sh`).
pub const FUSED: bool = cfg!(all(target_arch = "x86_64", target_feature = "fma"));

/// One multiply-add as `wide`'s `mul_add` does it on this build: `w · x + acc`, fused
/// iff [`FUSED`].
#[inline(always)]
pub fn madd(w: f32, x: f32, acc: f32) -> f32 {
    if FUSED {
        w.mul_add(x, acc)
    } else {
        w * x + acc
    }
}

/// Writes `v` to the first 8 values of `x`.
#[inline(always)]
pub fn store8(x: &mut [f32], v: f32x8) {
    x[..W].copy_from_slice(&v.to_array());
}

/// `Σ a[i]·b[i]` with four vector accumulators (lane order fixed, so deterministic).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let n = a.len();
    let mut acc = [f32x8::ZERO; 4];
    let mut i = 0;
    while i + 4 * W <= n {
        for (j, acc_j) in acc.iter_mut().enumerate() {
            let o = i + j * W;
            *acc_j = load8(&a[o..]).mul_add(load8(&b[o..]), *acc_j);
        }
        i += 4 * W;
    }
    while i + W <= n {
        acc[0] = load8(&a[i..]).mul_add(load8(&b[i..]), acc[0]);
        i += W;
    }
    let v = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    let mut s = v.reduce_add();
    while i < n {
        s += a[i] * b[i];
        i += 1;
    }
    s
}

/// `y[i] += alpha · x[i]`.
#[inline]
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    debug_assert_eq!(x.len(), y.len());
    let n = x.len();
    let a = f32x8::splat(alpha);
    let mut i = 0;
    while i + W <= n {
        let r = load8(&x[i..]).mul_add(a, load8(&y[i..]));
        store8(&mut y[i..], r);
        i += W;
    }
    while i < n {
        y[i] += alpha * x[i];
        i += 1;
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

/// Reduces eight rows' partial sums at once: `part[k] = (lanes, tail)` of row `k`, and
/// lane `k` of the result is row `k`'s total, always summed in the same order
/// (`((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) + tail`) so a row's value does
/// not depend on which block it was reduced in. One transpose instead of eight
/// horizontal reductions.
#[inline(always)]
pub fn reduce8(part: [(f32x8, f32); 8]) -> f32x8 {
    let t = f32x8::transpose(part.map(|x| x.0));
    let sum = ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
    sum + f32x8::from(part.map(|x| x.1))
}

/// Scalar twin of [`dot`] (sequential sum), for tests.
pub fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// A stored float element type (weights, plain cache rows) widened to f32 for compute.
pub trait Elem: Copy + Default + Send + Sync + 'static {
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
    /// Widens `src[..8]` in registers (exact for every element type).
    fn load8(src: &[Self]) -> f32x8;
    /// Widens a slice (exact for every element type).
    #[inline]
    fn widen(src: &[Self], out: &mut [f32]) {
        for (o, &s) in out.iter_mut().zip(src) {
            *o = s.to_f32();
        }
    }
}

impl Elem for f32 {
    #[inline]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn load8(src: &[Self]) -> f32x8 {
        load8(src)
    }
}

impl Elem for f16 {
    /// Saturating, so a value just beyond f16's range does not become infinite.
    #[inline]
    fn from_f32(x: f32) -> Self {
        f16_saturating(x)
    }
    #[inline]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline]
    fn widen(src: &[Self], out: &mut [f32]) {
        src.convert_to_f32_slice(out);
    }
    /// `half`'s 8-lane conversion (F16C `vcvtph2ps` / NEON `fcvtl` when compiled for them).
    #[inline(always)]
    fn load8(src: &[Self]) -> f32x8 {
        let mut a = [0.0f32; 8];
        src[..8].convert_to_f32_slice(&mut a);
        f32x8::from(a)
    }
}

impl Elem for bf16 {
    #[inline]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    #[inline]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    /// bf16 is the top half of an f32: widening is a shift, as `bf16::to_f32` does for
    /// every value `bf16::from_f32` produces (it only differs on signalling NaNs).
    #[inline]
    fn widen(src: &[Self], out: &mut [f32]) {
        for (o, s) in out.iter_mut().zip(src) {
            *o = f32::from_bits((s.to_bits() as u32) << 16);
        }
    }
    #[inline(always)]
    fn load8(src: &[Self]) -> f32x8 {
        let a: [u16; 8] = bytemuck::cast_slice::<bf16, u16>(&src[..8])
            .try_into()
            .expect("8 lanes");
        bytemuck::cast(i32x8::from_u16x8(u16x8::new(a)) << 16)
    }
}
