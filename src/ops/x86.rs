//! x86_64 variants of [`super::qdot`]'s group kernels (AVX2; AVX-512 BW + VNNI).
//!
//! Both compute, for each block, the eight rows' exact integer sums into one 8-lane
//! vector (lane `k` = row `k`), then do the reference's float steps on the eight lanes:
//! `acc += isum · (d_w · d_x)` (Q4_1: `+ m_w · s_x` inside the bracket), with separate
//! multiplies and adds, never fused, so each lane equals the scalar twin bit for bit.
//!
//! Unsigned × signed byte products (`vpmaddubsw`, `vpdpbusd`) need unsigned weights:
//! Q4 codes are 0..15 already (Q4_0's `− 8` is applied as `− 8 · Σ q_x`); Q8_0 codes are
//! flipped to `w + 128` for VNNI (then `− 128 · Σ q_x`) and split into `|w|` and the
//! activation's sign-adjusted copy for AVX2 (whose 16-bit pair sums would saturate on
//! `255 · 127 · 2`; `128 · 127 · 2` fits).

use super::qdot::{Group, QuantizedActs, QK};
use crate::dtype::DType;
use std::arch::x86_64::*;

/// The float steps of one block for eight rows (shared by both variants).
///
/// # Safety
/// `g.d` (and `g.m` for Q4_1) must hold block `b` (checked by debug assertions).
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn combine(
    dtype: DType,
    g: &Group,
    a: &QuantizedActs,
    b: usize,
    isum: __m256i,
    acc: __m256,
) -> __m256 {
    debug_assert!(g.d.len() >= (b + 1) * 16);
    // SAFETY: 16 bytes of block `b`'s scales are in bounds (above); unaligned load.
    let dw = _mm256_cvtph_ps(unsafe { _mm_loadu_si128(g.d.as_ptr().add(b * 16).cast()) });
    let scale = _mm256_mul_ps(dw, _mm256_set1_ps(a.d[b]));
    let mut t = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), scale);
    if dtype == DType::Q4_1 {
        debug_assert!(g.m.len() >= (b + 1) * 16);
        // SAFETY: as for the scales.
        let mw = _mm256_cvtph_ps(unsafe { _mm_loadu_si128(g.m.as_ptr().add(b * 16).cast()) });
        t = _mm256_add_ps(t, _mm256_mul_ps(mw, _mm256_set1_ps(a.s[b])));
    }
    _mm256_add_ps(acc, t)
}

/// The integer correction of block `b`: `Σ w·q_x = Σ stored·q_x − offset·Σ q_x`.
#[inline(always)]
fn offset(dtype: DType) -> i32 {
    match dtype {
        DType::Q4_0 => 8,
        DType::Q8_0 => 128,
        _ => 0,
    }
}

/// AVX2 group kernel.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `g` must be a group of a [`super::qdot::Packed`]
/// of `dtype` with as many blocks as `a`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn group_avx2(dtype: DType, g: &Group, a: &QuantizedActs, out: &mut [f32; 8]) {
    let q8 = dtype == DType::Q8_0;
    let qsb = if q8 { 256 } else { 128 };
    assert!(g.qs.len() >= g.nb * qsb && a.q.len() >= g.nb * QK);
    let mask = _mm256_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let mut acc = _mm256_setzero_ps();
    for b in 0..g.nb {
        // SAFETY: every pointer below stays inside block `b` of `g.qs` (qsb bytes) and
        // of `a.q` (32 bytes), checked by the assert above; loads are unaligned.
        unsafe {
            let qp = g.qs.as_ptr().add(b * qsb);
            let ap = a.q.as_ptr().add(b * QK);
            let alo = _mm256_broadcastsi128_si256(_mm_loadu_si128(ap.cast()));
            let ahi = _mm256_broadcastsi128_si256(_mm_loadu_si128(ap.add(16).cast()));
            // s[j]: rows 2j and 2j+1, four partial sums each (128-bit lane = row).
            let mut s = [_mm256_setzero_si256(); 4];
            for (j, sj) in s.iter_mut().enumerate() {
                *sj = if q8 {
                    let base = (j / 2) * 128 + (j % 2) * 32;
                    let wl = _mm256_loadu_si256(qp.add(base).cast());
                    let wh = _mm256_loadu_si256(qp.add(base + 64).cast());
                    let pl = _mm256_maddubs_epi16(_mm256_abs_epi8(wl), _mm256_sign_epi8(alo, wl));
                    let ph = _mm256_maddubs_epi16(_mm256_abs_epi8(wh), _mm256_sign_epi8(ahi, wh));
                    _mm256_add_epi32(_mm256_madd_epi16(pl, ones), _mm256_madd_epi16(ph, ones))
                } else {
                    let w = _mm256_loadu_si256(qp.add(j * 32).cast());
                    let lo = _mm256_and_si256(w, mask);
                    let hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), mask);
                    // 16-bit pair sums ≤ 2·15·127, and their sum ≤ 7620: no saturation.
                    let p = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, alo),
                        _mm256_maddubs_epi16(hi, ahi),
                    );
                    _mm256_madd_epi16(p, ones)
                };
            }
            let h01 = _mm256_hadd_epi32(s[0], s[1]);
            let h23 = _mm256_hadd_epi32(s[2], s[3]);
            // lanes: [r0 r2 r4 r6 | r1 r3 r5 r7]
            let h = _mm256_hadd_epi32(h01, h23);
            let mut isum = _mm256_permutevar8x32_epi32(h, order);
            if !q8 && dtype == DType::Q4_0 {
                isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(8 * a.qsum[b]));
            }
            acc = combine(dtype, g, a, b, isum, acc);
        }
    }
    // SAFETY: `out` is 8 f32s; unaligned store.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc) };
}

/// One block's integer partial sums for eight rows: `(rows 0..4, rows 4..8)`, 128-bit
/// lane `j` of each holding four partial sums of row `j` (resp. `4 + j`).
///
/// # Safety
/// AVX-512 F/BW/VNNI must be available; `qp` must point at a block of `qs_bytes` codes and
/// `ap` at 32 activation codes.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn block_sums_512(q8: bool, qp: *const u8, ap: *const i8) -> (__m512i, __m512i) {
    // SAFETY: the caller guarantees both ranges; loads are unaligned.
    unsafe {
        let alo = _mm512_broadcast_i32x4(_mm_loadu_si128(ap.cast()));
        let ahi = _mm512_broadcast_i32x4(_mm_loadu_si128(ap.add(16).cast()));
        let z = _mm512_setzero_si512();
        if q8 {
            let flip = _mm512_set1_epi8(-128);
            let w0 = _mm512_xor_si512(_mm512_loadu_si512(qp.cast()), flip);
            let w1 = _mm512_xor_si512(_mm512_loadu_si512(qp.add(64).cast()), flip);
            let w2 = _mm512_xor_si512(_mm512_loadu_si512(qp.add(128).cast()), flip);
            let w3 = _mm512_xor_si512(_mm512_loadu_si512(qp.add(192).cast()), flip);
            (
                _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, w0, alo), w1, ahi),
                _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, w2, alo), w3, ahi),
            )
        } else {
            let mask = _mm512_set1_epi8(0x0F);
            let w0 = _mm512_loadu_si512(qp.cast());
            let w1 = _mm512_loadu_si512(qp.add(64).cast());
            let lo0 = _mm512_and_si512(w0, mask);
            let hi0 = _mm512_and_si512(_mm512_srli_epi16(w0, 4), mask);
            let lo1 = _mm512_and_si512(w1, mask);
            let hi1 = _mm512_and_si512(_mm512_srli_epi16(w1, 4), mask);
            (
                _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, lo0, alo), hi0, ahi),
                _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, lo1, alo), hi1, ahi),
            )
        }
    }
}

/// AVX-512 BW + VNNI group kernel: one 512-bit `vpdpbusd` covers four rows × 16 values;
/// two blocks share one reduction and one 16-lane pass of the float steps (lanes 0..8
/// block `b`, 8..16 block `b + 1`, added to the accumulator in that order).
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/VNNI and F16C; `g` as for [`group_avx2`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn group_avx512vnni(dtype: DType, g: &Group, a: &QuantizedActs, out: &mut [f32; 8]) {
    let q8 = dtype == DType::Q8_0;
    let qsb = if q8 { 256 } else { 128 };
    let nb = g.nb;
    assert!(g.qs.len() >= nb * qsb && a.q.len() >= nb * QK);
    assert!(g.d.len() >= nb * 16 && (dtype != DType::Q4_1 || g.m.len() >= nb * 16));
    // lane 4j = row j, lane 4j + 1 = row 4 + j, lanes 4j + 2/3 the same for the 2nd block
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    let off = offset(dtype);
    let mut acc = _mm256_setzero_ps();
    let mut b = 0;
    while b + 2 <= nb {
        // SAFETY: blocks `b` and `b + 1` are in bounds of `g.qs`, `g.d`, `g.m` and `a.q`
        // (asserts above); loads are unaligned.
        unsafe {
            let qp = g.qs.as_ptr().add(b * qsb);
            let ap = a.q.as_ptr().add(b * QK);
            let (s0, s1) = block_sums_512(q8, qp, ap);
            let (p0, p1) = block_sums_512(q8, qp.add(qsb), ap.add(QK));
            // per 128-bit lane j: [r_j, r_4+j, r'_j, r'_4+j] after two folds
            let t = _mm512_add_epi32(_mm512_unpacklo_epi32(s0, s1), _mm512_unpackhi_epi32(s0, s1));
            let tp = _mm512_add_epi32(_mm512_unpacklo_epi32(p0, p1), _mm512_unpackhi_epi32(p0, p1));
            let v = _mm512_add_epi32(_mm512_unpacklo_epi64(t, tp), _mm512_unpackhi_epi64(t, tp));
            let mut isum = _mm512_permutexvar_epi32(order, v);
            let hi = 0xFF00;
            if off != 0 {
                let c0 = _mm512_set1_epi32(off * a.qsum[b]);
                let c1 = _mm512_set1_epi32(off * a.qsum[b + 1]);
                isum = _mm512_sub_epi32(isum, _mm512_mask_blend_epi32(hi, c0, c1));
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(g.d.as_ptr().add(b * 16).cast()));
            let dx = _mm512_mask_blend_ps(hi, _mm512_set1_ps(a.d[b]), _mm512_set1_ps(a.d[b + 1]));
            let mut t = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, dx));
            if dtype == DType::Q4_1 {
                let mw = _mm512_cvtph_ps(_mm256_loadu_si256(g.m.as_ptr().add(b * 16).cast()));
                let sx =
                    _mm512_mask_blend_ps(hi, _mm512_set1_ps(a.s[b]), _mm512_set1_ps(a.s[b + 1]));
                t = _mm512_add_ps(t, _mm512_mul_ps(mw, sx));
            }
            let t_hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(t)));
            acc = _mm256_add_ps(_mm256_add_ps(acc, _mm512_castps512_ps256(t)), t_hi);
        }
        b += 2;
    }
    if b < nb {
        // SAFETY: block `b` is in bounds (asserts above).
        unsafe {
            let (s0, s1) = block_sums_512(q8, g.qs.as_ptr().add(b * qsb), a.q.as_ptr().add(b * QK));
            let t = _mm512_add_epi32(_mm512_unpacklo_epi32(s0, s1), _mm512_unpackhi_epi32(s0, s1));
            let u = _mm512_add_epi32(t, _mm512_shuffle_epi32::<0x4E>(t));
            let mut isum = _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, u));
            if off != 0 {
                isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(off * a.qsum[b]));
            }
            acc = combine(dtype, g, a, b, isum, acc);
        }
    }
    // SAFETY: `out` is 8 f32s; unaligned store.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc) };
}
