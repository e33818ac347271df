//! Vector primitives over `wide::f32x8`, each with a scalar tail. Depends on nothing
//! else in the crate (`quant` and the cache's kernels build on it, never the reverse).

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

/// Variants of the fused KIVI attention kernels (`quant::dot_codes_rows`,
/// `quant::axpy_codes_rows`): **the one dispatch point** for them. The engine uses
/// [`kv_kernel`]; tests call each supported variant through the `_with` functions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvKernel {
    /// `wide` vectors (whatever the build targets), any head dim.
    Portable,
    /// x86_64 AVX-512 F/BW/VL + F16C (`vpermps` nibble lookup), head dims 32/64/128/256;
    /// other head dims take the portable path.
    Avx512,
    /// x86_64 AVX-512 F/BW/VL + F16C in the `portable` kernels' order (and the portable
    /// softmax), bit for bit (docs/design.md §2.3), head dims 32/64/128/256; other head
    /// dims take the portable path. Slower than `avx512`, so not the default.
    Avx512Exact,
    /// x86_64 AVX2 + FMA + F16C (8 lanes, the scheme of `Avx512`), head dims
    /// 32/64/128/256; other head dims take the portable path.
    Avx2,
    /// aarch64 NEON (4 lanes, the same scheme), head dims 32/64/128/256; other head dims
    /// take the portable path.
    Neon,
}

impl KvKernel {
    /// Every variant, slowest first.
    pub const ALL: [KvKernel; 5] = [
        KvKernel::Portable,
        KvKernel::Neon,
        KvKernel::Avx2,
        KvKernel::Avx512Exact,
        KvKernel::Avx512,
    ];

    /// Whether the variant adds every sum in the `portable` kernels' order (the order the
    /// reference writes out), so its results are the portable kernels' bits.
    pub fn is_exact(self) -> bool {
        matches!(self, KvKernel::Portable | KvKernel::Avx512Exact)
    }

    pub fn name(self) -> &'static str {
        match self {
            KvKernel::Portable => "portable",
            KvKernel::Avx512 => "avx512",
            KvKernel::Avx512Exact => "avx512-exact",
            KvKernel::Avx2 => "avx2",
            KvKernel::Neon => "neon",
        }
    }

    pub fn from_name(s: &str) -> Option<KvKernel> {
        KvKernel::ALL.into_iter().find(|k| k.name() == s)
    }

    /// Whether this CPU can run the variant (run-time detection).
    pub fn is_supported(self) -> bool {
        match self {
            KvKernel::Portable => true,
            #[cfg(target_arch = "x86_64")]
            KvKernel::Avx512 | KvKernel::Avx512Exact => {
                is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            KvKernel::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "aarch64")]
            KvKernel::Neon => std::arch::is_aarch64_feature_detected!("neon"),
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The variants this CPU supports, slowest first.
    pub fn supported() -> Vec<KvKernel> {
        KvKernel::ALL
            .into_iter()
            .filter(|k| k.is_supported())
            .collect()
    }
}

/// The KIVI attention kernel the engine uses, chosen once: `TINYGPT_KV_KERNEL`
/// (`portable`, `neon`, `avx2`, `avx512`) if it names a supported variant, else the
/// fastest supported.
pub fn kv_kernel() -> KvKernel {
    static ACTIVE: std::sync::OnceLock<KvKernel> = std::sync::OnceLock::new();
    *ACTIVE.get_or_init(|| {
        std::env::var("TINYGPT_KV_KERNEL")
            .ok()
            .and_then(|s| KvKernel::from_name(s.trim()))
            .filter(|k| k.is_supported())
            .unwrap_or_else(|| *KvKernel::supported().last().expect("portable"))
    })
}

/// AVX-512 softmax pieces (the `avx512` [`KvKernel`]): `wide`'s `f32x8::exp` evaluated
/// sixteen lanes at a time with the same operations in the same order (so every lane
/// equals it bit for bit), and the softmax loops around it.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512 {
    use std::arch::x86_64::*;

    /// `wide::f32x8::exp` on 16 lanes: `r = round(x·log2 e)`, `t = x − r·ln2` (two FMA
    /// steps), the degree-5 polynomial in `wide`'s evaluation order, `(p + 1)·2^r`, and 0
    /// where `|x| ≥ 87.3` or `x` is not finite.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub(crate) fn exp16(x: __m512) -> __m512 {
        let s = _mm512_set1_ps;
        let r = _mm512_roundscale_ps::<0x08>(_mm512_mul_ps(x, s(std::f32::consts::LOG2_E)));
        let t = _mm512_fnmadd_ps(r, s(0.693_359_4), x);
        let t = _mm512_fnmadd_ps(r, s(-2.121_944_4e-4), t);
        let t2 = _mm512_mul_ps(t, t);
        let t4 = _mm512_mul_ps(t2, t2);
        let inner = _mm512_fmadd_ps(
            _mm512_fmadd_ps(s(1.0 / 5040.0), t, s(1.0 / 720.0)),
            t4,
            _mm512_fmadd_ps(s(1.0 / 6.0), t, s(1.0 / 2.0)),
        );
        let z = _mm512_fmadd_ps(_mm512_fmadd_ps(s(1.0 / 120.0), t, s(1.0 / 24.0)), t2, inner);
        let z = _mm512_fmadd_ps(z, _mm512_mul_ps(t, t), t);
        let n2 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_castps_si512(_mm512_add_ps(
            r,
            _mm512_add_ps(s(127.0), s(8388608.0)),
        ))));
        let z = _mm512_mul_ps(_mm512_add_ps(z, s(1.0)), n2);
        let bits = _mm512_castps_si512(x);
        let abs = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(i32::MAX)));
        let small = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(abs, s(87.3));
        let exp_bits = _mm512_and_si512(
            _mm512_slli_epi32::<1>(bits),
            _mm512_set1_epi32(0xFF00_0000u32 as i32),
        );
        let finite = _mm512_cmpneq_epi32_mask(exp_bits, _mm512_set1_epi32(0xFF00_0000u32 as i32));
        _mm512_maskz_mov_ps(small & finite, z)
    }

    /// [`crate::attention::softmax`] with [`exp16`]: every weight equals the portable
    /// one's before the division (the same `exp` per element: the polynomial on the
    /// first `n − n % 8` values, `f32::exp` on the rest); only the sum is added in a
    /// different order (16 lanes).
    ///
    /// # Safety
    /// AVX-512 F must be available (run-time detection, [`super::KvKernel`]).
    #[target_feature(enable = "avx512f")]
    pub(crate) unsafe fn softmax(x: &mut [f32]) {
        let n = x.len();
        let n8 = n - n % 8;
        let p = x.as_mut_ptr();
        let mask = |i: usize| -> __mmask16 {
            if n8 - i >= 16 {
                0xFFFF
            } else {
                0x00FF
            }
        };
        let mut mv = _mm512_set1_ps(f32::NEG_INFINITY);
        let mut i = 0;
        while i < n8 {
            // SAFETY: lanes of `mask(i)` are x[i..min(i + 16, n8)], in bounds; the rest
            // are not read.
            let v = unsafe { _mm512_mask_loadu_ps(mv, mask(i), p.add(i)) };
            mv = _mm512_max_ps(mv, v);
            i += 16;
        }
        let max = x[n8..]
            .iter()
            .copied()
            .fold(_mm512_reduce_max_ps(mv), f32::max);
        let m = _mm512_set1_ps(max);
        let mut sv = _mm512_setzero_ps();
        let mut i = 0;
        while i < n8 {
            let k = mask(i);
            // SAFETY: as above; the masked store writes only those lanes.
            unsafe {
                let v = _mm512_maskz_loadu_ps(k, p.add(i));
                let e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(v, m)));
                sv = _mm512_add_ps(sv, e);
                _mm512_mask_storeu_ps(p.add(i), k, e);
            }
            i += 16;
        }
        let mut sum = _mm512_reduce_add_ps(sv);
        for v in x[n8..].iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        let total = _mm512_set1_ps(sum);
        let mut i = 0;
        while i < n8 {
            let k = mask(i);
            // SAFETY: as above.
            unsafe {
                let v = _mm512_maskz_loadu_ps(k, p.add(i));
                _mm512_mask_storeu_ps(p.add(i), k, _mm512_div_ps(v, total));
            }
            i += 16;
        }
        for v in x[n8..].iter_mut() {
            *v /= sum;
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;
        use wide::f32x8;

        /// [`exp16`] equals `wide::f32x8::exp` bit for bit: a sweep of the whole useful
        /// range, both ends of it, 0, ±inf, NaN, subnormals.
        #[test]
        fn exp16_equals_wide_exp_bitwise() {
            if !super::super::KvKernel::Avx512.is_supported() {
                eprintln!("skipped: no AVX-512 on this CPU");
                return;
            }
            let mut xs: Vec<f32> = (0..40_000).map(|i| -100.0 + i as f32 * 0.005).collect();
            xs.extend([
                0.0,
                -0.0,
                87.29,
                87.3,
                87.31,
                -87.29,
                -87.3,
                -87.31,
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::NAN,
                1e-40,
                -1e-40,
                f32::MAX,
                f32::MIN,
            ]);
            while !xs.len().is_multiple_of(16) {
                xs.push(1.5);
            }
            for c in xs.chunks_exact(16) {
                let mut got = [0.0f32; 16];
                // SAFETY: AVX-512 F checked above; `c`/`got` hold 16 floats.
                unsafe {
                    _mm512_storeu_ps(got.as_mut_ptr(), exp16(_mm512_loadu_ps(c.as_ptr())));
                }
                for h in 0..2 {
                    let a: [f32; 8] = c[8 * h..8 * h + 8].try_into().unwrap();
                    let want = f32x8::from(a).exp().to_array();
                    for l in 0..8 {
                        assert_eq!(got[8 * h + l].to_bits(), want[l].to_bits(), "x = {}", a[l]);
                    }
                }
            }
        }
    }
}
