//! AVX-512 softmax pieces (the `avx512` [`KvKernel`](crate::kivi::KvKernel)): `wide`'s
//! `f32x8::exp` evaluated sixteen lanes at a time with the same operations in the same
//! order (so every lane equals it bit for bit), and the softmax loops around it. Attention
//! runs it (as `kivi::softmax_avx512`) when that variant is chosen; the other variants use
//! the portable softmax (`crate::attention::softmax`).

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
/// AVX-512 F must be available (run-time detection, [`crate::kivi::KvKernel`]).
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
        if !crate::kivi::KvKernel::Avx512.is_supported() {
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
