//! x86_64 variants of [`super::qdot`]'s group kernels (AVX2; AVX-512 BW + VNNI).
//!
//! Both compute, for each block, the eight rows' exact integer sums into one 8-lane
//! vector (lane `k` = row `k`), then do the reference's float steps on the eight lanes:
//! `acc += isum · (d_w · d_x)` (Q4_1: `+ m_w · s_x` inside the bracket), with separate
//! multiplies and adds, never fused, so each lane equals the scalar twin bit for bit.
//!
//! Unsigned × signed byte products (`vpmaddubsw`, `vpdpbusd`) need unsigned weights:
//! Q4 codes are 0..15 already (Q4_0's `− 8` is applied as `− 8 · Σ q_x`); Q5_0 codes are
//! 0..31 (the nibbles with the fifth bit ORed in as `0x10`: a masked OR from a 64-bit mask
//! register on AVX-512, bytes spread from 32 bits by `vpshufb` + compare on AVX2) and its
//! `− 16` is applied as `− 16 · Σ q_x`; Q8_0 codes are
//! flipped to `w + 128` for VNNI (then `− 128 · Σ q_x`) and split into `|w|` and the
//! activation's sign-adjusted copy for AVX2 (whose 16-bit pair sums would saturate on
//! `255 · 127 · 2`; `128 · 127 · 2` fits). IQ4_NL nibbles are looked up (`vpshufb`, the
//! 16 levels in every 128-bit lane) as Q8_0 codes: `K[n] + 128` for VNNI (then
//! `− 128 · Σ q_x`), `K[n]` for AVX2, which then takes Q8_0's `|w|` / sign path.
//!
//! The multi-token variants (`group_tokens_*`) run the same per-block steps for
//! [`TOKENS`] activation vectors, loading and unpacking each weight block (and converting
//! its scales) once for all of them: every token's lanes see exactly the operations of the
//! one-token kernel, so the values are equal bit for bit.

use super::qdot::{qs_bytes, Group, QuantizedActs, TileView, GROUP, QK, TILE, TOKENS};
use crate::dtype::DType;
use std::arch::x86_64::*;
use tinygpt_reference::ggml_more::IQ4_VALUES;

/// Block `b`'s eight f16 scales (and Q4_1 minimums; zero otherwise) as f32 lanes.
///
/// # Safety
/// `g.d` (and `g.m` for Q4_1) must hold block `b` (checked by debug assertions).
#[inline(always)]
unsafe fn scales8(dtype: DType, g: &Group, b: usize) -> (__m256, __m256) {
    debug_assert!(g.d.len() >= (b + 1) * 16);
    // SAFETY: 16 bytes of block `b`'s scales are in bounds (above); unaligned load.
    let dw = _mm256_cvtph_ps(unsafe { _mm_loadu_si128(g.d.as_ptr().add(b * 16).cast()) });
    let mw = if dtype == DType::Q4_1 {
        debug_assert!(g.m.len() >= (b + 1) * 16);
        // SAFETY: as for the scales.
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(g.m.as_ptr().add(b * 16).cast()) })
    } else {
        _mm256_setzero_ps()
    };
    (dw, mw)
}

/// The float steps of one block for eight rows (shared by every variant):
/// `acc + isum · (d_w · d_x)` (Q4_1: `+ m_w · s_x` inside the bracket).
///
/// # Safety
/// AVX2 must be available (always inlined into an AVX2 caller; see [`unpack_avx2`]).
#[inline(always)]
unsafe fn combine(
    dtype: DType,
    (dw, mw): (__m256, __m256),
    a: &QuantizedActs,
    b: usize,
    isum: __m256i,
    acc: __m256,
) -> __m256 {
    let scale = _mm256_mul_ps(dw, _mm256_set1_ps(a.d[b]));
    let mut t = _mm256_mul_ps(_mm256_cvtepi32_ps(isum), scale);
    if dtype == DType::Q4_1 {
        t = _mm256_add_ps(t, _mm256_mul_ps(mw, _mm256_set1_ps(a.s[b])));
    }
    _mm256_add_ps(acc, t)
}

/// The integer correction of block `b`: `Σ w·q_x = Σ stored·q_x − offset·Σ q_x`.
#[inline(always)]
fn offset(dtype: DType) -> i32 {
    match dtype {
        DType::Q4_0 => 8,
        DType::Q5_0 => 16,
        DType::Q8_0 | DType::IQ4_NL => 128,
        _ => 0,
    }
}

/// Byte `i` of the result is `0x10` if bit `i` of `bits` is set, else 0 (128-bit lane 0:
/// bits 0..16, lane 1: bits 16..32).
#[target_feature(enable = "avx2")]
#[inline]
fn fifth_bits_avx2(bits: u32) -> __m256i {
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits as i32),
        _mm256_setr_epi64x(
            0x0000_0000_0000_0000,
            0x0101_0101_0101_0101,
            0x0202_0202_0202_0202,
            0x0303_0303_0303_0303,
        ),
    );
    // every bit but bit `i % 8` set in byte `i`: the byte is all ones iff that bit is set
    let others = _mm256_set1_epi64x(0x7FBF_DFEF_F7FB_FDFEu64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi8(-1));
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

/// The 16 IQ4_NL levels `K[n]` (`flip` = 0) or `K[n] + 128` as unsigned bytes
/// (`flip` = 0x80) in both 128-bit lanes: a `vpshufb` table indexed by the nibble.
#[target_feature(enable = "avx2")]
#[inline]
fn iq4_table_avx2(flip: u8) -> __m256i {
    // SAFETY: reads 16 bytes of a 16-byte array; unaligned load.
    let t = unsafe { _mm_loadu_si128(IQ4_VALUES.as_ptr().cast()) };
    _mm256_xor_si256(_mm256_broadcastsi128_si256(t), _mm256_set1_epi8(flip as i8))
}

/// Whether `dtype`'s codes take the signed Q8_0 path on AVX2 (`|w|` and the sign).
#[inline(always)]
fn signed_codes(dtype: DType) -> bool {
    matches!(dtype, DType::Q8_0 | DType::IQ4_NL)
}

/// [`unpack_avx2`] for IQ4_NL: the levels of the low and high nibbles looked up, laid out
/// as Q8_0's `|w|` / `w` pairs.
///
/// # Safety
/// AVX2 must be available; `qp` must point at one 8-row block of IQ4_NL codes.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn unpack_iq4_nl_avx2(qp: *const u8) -> [__m256i; 16] {
    let mask = _mm256_set1_epi8(0x0F);
    let table = iq4_table_avx2(0);
    let mut v = [_mm256_setzero_si256(); 16];
    for j in 0..4 {
        // SAFETY: 32 bytes at `qp + 32j` are inside the 128-byte block; unaligned.
        let w = unsafe { _mm256_loadu_si256(qp.add(j * 32).cast()) };
        let wl = _mm256_shuffle_epi8(table, _mm256_and_si256(w, mask));
        let wh = _mm256_shuffle_epi8(table, _mm256_and_si256(_mm256_srli_epi16(w, 4), mask));
        v[4 * j] = _mm256_abs_epi8(wl);
        v[4 * j + 1] = wl;
        v[4 * j + 2] = _mm256_abs_epi8(wh);
        v[4 * j + 3] = wh;
    }
    v
}

/// One 8-row block of codes unpacked for AVX2, `j` = rows `2j` and `2j + 1`:
/// Q4 `[4j]` low nibbles, `[4j + 1]` high nibbles (Q5_0: with the fifth bits, 0..31);
/// Q8 `[4j]` `|w|` and `[4j + 1]` `w` of elements 0..16, `[4j + 2]`, `[4j + 3]` the same
/// for elements 16..32 (IQ4_NL: the same, `w` the looked-up levels of the low and high
/// nibbles).
///
/// Always inlined (so without `#[target_feature]`, which Rust does not allow with
/// `inline(always)`; its callers enable AVX2): out of line it returns its 16 vectors through
/// memory, which cost the group kernels up to 47% (the 1536x768 qdot bench) after the
/// IQ4_NL branch made it too large for the inliner's choice.
///
/// # Safety
/// AVX2 must be available; `qp` must point at one block of codes of `dtype`.
#[inline(always)]
unsafe fn unpack_avx2(dtype: DType, qp: *const u8) -> [__m256i; 16] {
    // SAFETY: AVX2 is available and every load stays inside the block (the caller's
    // guarantee); unaligned loads.
    unsafe {
        if dtype == DType::IQ4_NL {
            return unpack_iq4_nl_avx2(qp);
        }
        let q8 = dtype == DType::Q8_0;
        let mask = _mm256_set1_epi8(0x0F);
        let mut v = [_mm256_setzero_si256(); 16];
        for j in 0..4 {
            if q8 {
                let base = (j / 2) * 128 + (j % 2) * 32;
                let wl = _mm256_loadu_si256(qp.add(base).cast());
                let wh = _mm256_loadu_si256(qp.add(base + 64).cast());
                v[4 * j] = _mm256_abs_epi8(wl);
                v[4 * j + 1] = wl;
                v[4 * j + 2] = _mm256_abs_epi8(wh);
                v[4 * j + 3] = wh;
            } else {
                let w = _mm256_loadu_si256(qp.add(j * 32).cast());
                v[4 * j] = _mm256_and_si256(w, mask);
                v[4 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(w, 4), mask);
                if dtype == DType::Q5_0 {
                    // rows 2j, 2j + 1: their two u16 masks of elements 0..16, then 16..32
                    let at = 128 + (j / 2) * 16 + (j % 2) * 4;
                    let lo = qp.add(at).cast::<u32>().read_unaligned();
                    let hi = qp.add(at + 8).cast::<u32>().read_unaligned();
                    v[4 * j] = _mm256_or_si256(v[4 * j], fifth_bits_avx2(lo));
                    v[4 * j + 1] = _mm256_or_si256(v[4 * j + 1], fifth_bits_avx2(hi));
                }
            }
        }
        v
    }
}

/// The eight rows' exact integer sums of one unpacked block against one activation block
/// (lane `k` = row `k`), Q4_0's `− 8 · Σ q_x` (Q5_0's `− 16 · Σ q_x`) applied.
///
/// # Safety
/// AVX2 must be available; `ap` must point at 32 activation codes.
#[inline(always)]
unsafe fn isum_avx2(dtype: DType, v: &[__m256i; 16], ap: *const i8, qsum: i32) -> __m256i {
    let q8 = signed_codes(dtype);
    let ones = _mm256_set1_epi16(1);
    // SAFETY: the caller guarantees 32 bytes at `ap`; unaligned loads.
    let (alo, ahi) = unsafe {
        (
            _mm256_broadcastsi128_si256(_mm_loadu_si128(ap.cast())),
            _mm256_broadcastsi128_si256(_mm_loadu_si128(ap.add(16).cast())),
        )
    };
    // s[j]: rows 2j and 2j+1, four partial sums each (128-bit lane = row).
    let s: [__m256i; 4] = std::array::from_fn(|j| {
        if q8 {
            let pl = _mm256_maddubs_epi16(v[4 * j], _mm256_sign_epi8(alo, v[4 * j + 1]));
            let ph = _mm256_maddubs_epi16(v[4 * j + 2], _mm256_sign_epi8(ahi, v[4 * j + 3]));
            _mm256_add_epi32(_mm256_madd_epi16(pl, ones), _mm256_madd_epi16(ph, ones))
        } else {
            // 16-bit pair sums ≤ 2·31·127 (Q5_0; Q4: 2·15·127), and their sum ≤ 15748:
            // no saturation.
            let p = _mm256_add_epi16(
                _mm256_maddubs_epi16(v[4 * j], alo),
                _mm256_maddubs_epi16(v[4 * j + 1], ahi),
            );
            _mm256_madd_epi16(p, ones)
        }
    });
    let h01 = _mm256_hadd_epi32(s[0], s[1]);
    let h23 = _mm256_hadd_epi32(s[2], s[3]);
    // lanes: [r0 r2 r4 r6 | r1 r3 r5 r7]
    let h = _mm256_hadd_epi32(h01, h23);
    let isum = _mm256_permutevar8x32_epi32(h, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    match dtype {
        DType::Q4_0 | DType::Q5_0 => {
            _mm256_sub_epi32(isum, _mm256_set1_epi32(offset(dtype) * qsum))
        }
        _ => isum,
    }
}

/// AVX2 group kernel.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `g` must be a group of a [`super::qdot::Packed`]
/// of `dtype` with as many blocks as `a`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn group_avx2(dtype: DType, g: &Group, a: &QuantizedActs, out: &mut [f32; 8]) {
    // SAFETY: the caller's guarantees, passed on.
    unsafe { per_code_type!(dtype, group_avx2_body, (g, a, out)) }
}

/// [`group_avx2`]'s loop for one code type.
///
/// # Safety
/// As for [`group_avx2`]; always inlined into it (which enables AVX2).
#[inline(always)]
unsafe fn group_avx2_body(dtype: DType, g: &Group, a: &QuantizedActs, out: &mut [f32; 8]) {
    let qsb = qs_bytes(dtype);
    assert!(g.qs.len() >= g.nb * qsb && a.q.len() >= g.nb * QK);
    assert!(a.d.len() >= g.nb && a.qsum.len() >= g.nb);
    assert!(dtype != DType::Q4_1 || a.s.len() >= g.nb);
    let mut acc = _mm256_setzero_ps();
    for b in 0..g.nb {
        // SAFETY: every pointer below stays inside block `b` of `g.qs` (qsb bytes) and
        // of `a.q` (32 bytes), checked by the assert above.
        unsafe {
            let qp = g.qs.as_ptr().add(b * qsb);
            // In every matrix, not only those of `g.stream`: see [`PREFETCH_BLOCKS`].
            prefetch_ahead(dtype, g, qp, b, qsb);
            let v = unpack_avx2(dtype, qp);
            let isum = isum_avx2(dtype, &v, a.q.as_ptr().add(b * QK), a.qsum[b]);
            acc = combine(dtype, scales8(dtype, g, b), a, b, isum, acc);
        }
    }
    // SAFETY: `out` is 8 f32s; unaligned store.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc) };
}

/// AVX2 multi-token group kernel: [`group_avx2`] for [`TOKENS`] tokens, each block
/// unpacked once.
///
/// # Safety
/// As for [`group_avx2`], for every token.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn group_tokens_avx2(
    dtype: DType,
    g: &Group,
    acts: &[&QuantizedActs; TOKENS],
    out: &mut [[f32; GROUP]; TOKENS],
) {
    // SAFETY: the caller's guarantees, passed on.
    unsafe { per_code_type!(dtype, group_tokens_avx2_body, (g, acts, out)) }
}

/// [`group_tokens_avx2`]'s loop for one code type.
///
/// # Safety
/// As for [`group_tokens_avx2`]; always inlined into it (which enables AVX2).
#[inline(always)]
unsafe fn group_tokens_avx2_body(
    dtype: DType,
    g: &Group,
    acts: &[&QuantizedActs; TOKENS],
    out: &mut [[f32; GROUP]; TOKENS],
) {
    let qsb = qs_bytes(dtype);
    assert!(g.qs.len() >= g.nb * qsb);
    for a in acts {
        assert!(a.q.len() >= g.nb * QK && a.d.len() >= g.nb && a.qsum.len() >= g.nb);
    }
    let mut acc = [_mm256_setzero_ps(); TOKENS];
    for b in 0..g.nb {
        // SAFETY: block `b` of `g.qs` and of every `a.q` is in bounds (asserts above).
        unsafe {
            let qp = g.qs.as_ptr().add(b * qsb);
            if g.stream {
                prefetch_ahead(dtype, g, qp, b, qsb);
            }
            let v = unpack_avx2(dtype, qp);
            let sc = scales8(dtype, g, b);
            for (a, acc_t) in acts.iter().zip(acc.iter_mut()) {
                let isum = isum_avx2(dtype, &v, a.q.as_ptr().add(b * QK), a.qsum[b]);
                *acc_t = combine(dtype, sc, a, b, isum, *acc_t);
            }
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        // SAFETY: `o` is 8 f32s; unaligned store.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), a) };
    }
}

/// One 8-row block of codes as the four unsigned byte vectors `vpdpbusd` takes: rows
/// 0..4 elements 0..16 / 16..32, then rows 4..8 the same (Q4: nibbles; Q5_0: nibbles
/// with the fifth bits ORed in as `0x10`, under the block's four 64-bit masks; Q8:
/// `w + 128`; IQ4_NL: the nibbles' levels `K[n] + 128`).
///
/// # Safety
/// AVX-512 F/BW must be available; `qp` must point at one block of codes of `dtype`.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn unpack_512(dtype: DType, qp: *const u8) -> [__m512i; 4] {
    // SAFETY: the caller guarantees the block; loads are unaligned.
    unsafe {
        if dtype == DType::Q8_0 {
            let flip = _mm512_set1_epi8(-128);
            [
                _mm512_xor_si512(_mm512_loadu_si512(qp.cast()), flip),
                _mm512_xor_si512(_mm512_loadu_si512(qp.add(64).cast()), flip),
                _mm512_xor_si512(_mm512_loadu_si512(qp.add(128).cast()), flip),
                _mm512_xor_si512(_mm512_loadu_si512(qp.add(192).cast()), flip),
            ]
        } else {
            let mask = _mm512_set1_epi8(0x0F);
            let w0 = _mm512_loadu_si512(qp.cast());
            let w1 = _mm512_loadu_si512(qp.add(64).cast());
            let mut w = [
                _mm512_and_si512(w0, mask),
                _mm512_and_si512(_mm512_srli_epi16(w0, 4), mask),
                _mm512_and_si512(w1, mask),
                _mm512_and_si512(_mm512_srli_epi16(w1, 4), mask),
            ];
            if dtype == DType::IQ4_NL {
                let t = _mm_loadu_si128(IQ4_VALUES.as_ptr().cast());
                let table = _mm512_xor_si512(_mm512_broadcast_i32x4(t), _mm512_set1_epi8(-128));
                for wi in w.iter_mut() {
                    *wi = _mm512_shuffle_epi8(table, *wi);
                }
            }
            if dtype == DType::Q5_0 {
                let fifth = _mm512_set1_epi8(0x10);
                for (i, wi) in w.iter_mut().enumerate() {
                    let bits = qp.add(128 + 8 * i).cast::<u64>().read_unaligned();
                    // nibbles are ≤ 15: adding 0x10 under the mask is the OR
                    *wi = _mm512_mask_add_epi8(*wi, bits, *wi, fifth);
                }
            }
            w
        }
    }
}

/// One block's integer partial sums for eight rows: `(rows 0..4, rows 4..8)`, 128-bit
/// lane `j` of each holding four partial sums of row `j` (resp. `4 + j`).
///
/// # Safety
/// AVX-512 F/BW/VNNI must be available; `ap` must point at 32 activation codes.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn block_sums_512(w: &[__m512i; 4], ap: *const i8) -> (__m512i, __m512i) {
    // SAFETY: the caller guarantees 32 bytes at `ap`; loads are unaligned.
    let (alo, ahi) = unsafe {
        (
            _mm512_broadcast_i32x4(_mm_loadu_si128(ap.cast())),
            _mm512_broadcast_i32x4(_mm_loadu_si128(ap.add(16).cast())),
        )
    };
    let z = _mm512_setzero_si512();
    (
        _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, w[0], alo), w[1], ahi),
        _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, w[2], alo), w[3], ahi),
    )
}

/// lane 4j = row j, lane 4j + 1 = row 4 + j, lanes 4j + 2/3 the same for the 2nd block
#[target_feature(enable = "avx512f")]
#[inline]
fn pair_order() -> __m512i {
    _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15)
}

/// Blocks `b` and `b + 1` of one token: reduces their partial sums `(s0, s1)`, `(p0, p1)`
/// with one shuffle tree, then runs the float steps on 16 lanes (0..8 block `b`, 8..16
/// block `b + 1`) and adds them to `acc` in that order. `dw`, `mw`: the two blocks'
/// scales and minimums (16 lanes).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
#[inline]
#[allow(clippy::too_many_arguments)]
fn pair_step(
    dtype: DType,
    sums: (__m512i, __m512i, __m512i, __m512i),
    dw: __m512,
    mw: __m512,
    a: &QuantizedActs,
    b: usize,
    acc: __m256,
) -> __m256 {
    let (s0, s1, p0, p1) = sums;
    // per 128-bit lane j: [r_j, r_4+j, r'_j, r'_4+j] after two folds
    let t = _mm512_add_epi32(_mm512_unpacklo_epi32(s0, s1), _mm512_unpackhi_epi32(s0, s1));
    let tp = _mm512_add_epi32(_mm512_unpacklo_epi32(p0, p1), _mm512_unpackhi_epi32(p0, p1));
    let v = _mm512_add_epi32(_mm512_unpacklo_epi64(t, tp), _mm512_unpackhi_epi64(t, tp));
    let mut isum = _mm512_permutexvar_epi32(pair_order(), v);
    let hi = 0xFF00;
    let off = offset(dtype);
    if off != 0 {
        let c0 = _mm512_set1_epi32(off * a.qsum[b]);
        let c1 = _mm512_set1_epi32(off * a.qsum[b + 1]);
        isum = _mm512_sub_epi32(isum, _mm512_mask_blend_epi32(hi, c0, c1));
    }
    let dx = _mm512_mask_blend_ps(hi, _mm512_set1_ps(a.d[b]), _mm512_set1_ps(a.d[b + 1]));
    let mut t = _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, dx));
    if dtype == DType::Q4_1 {
        let sx = _mm512_mask_blend_ps(hi, _mm512_set1_ps(a.s[b]), _mm512_set1_ps(a.s[b + 1]));
        t = _mm512_add_ps(t, _mm512_mul_ps(mw, sx));
    }
    let t_hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(t)));
    _mm256_add_ps(_mm256_add_ps(acc, _mm512_castps512_ps256(t)), t_hi)
}

/// One block of one token (the odd last block): reduction of `(s0, s1)` to eight lanes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
#[inline]
fn single_isum(dtype: DType, (s0, s1): (__m512i, __m512i), qsum: i32) -> __m256i {
    let t = _mm512_add_epi32(_mm512_unpacklo_epi32(s0, s1), _mm512_unpackhi_epi32(s0, s1));
    let u = _mm512_add_epi32(t, _mm512_shuffle_epi32::<0x4E>(t));
    let isum = _mm512_castsi512_si256(_mm512_permutexvar_epi32(pair_order(), u));
    let off = offset(dtype);
    if off != 0 {
        _mm256_sub_epi32(isum, _mm256_set1_epi32(off * qsum))
    } else {
        isum
    }
}

/// Blocks `b` and `b + 1`'s scales and minimums (zero unless Q4_1) as 16 f32 lanes.
///
/// # Safety
/// Both blocks must be in bounds of `g.d` (and `g.m` for Q4_1).
#[target_feature(enable = "avx512f,avx2,f16c")]
#[inline]
unsafe fn scales16(dtype: DType, g: &Group, b: usize) -> (__m512, __m512) {
    debug_assert!(g.d.len() >= (b + 2) * 16);
    // SAFETY: the caller guarantees both blocks; unaligned loads.
    unsafe {
        let dw = _mm512_cvtph_ps(_mm256_loadu_si256(g.d.as_ptr().add(b * 16).cast()));
        let mw = if dtype == DType::Q4_1 {
            _mm512_cvtph_ps(_mm256_loadu_si256(g.m.as_ptr().add(b * 16).cast()))
        } else {
            _mm512_setzero_ps()
        };
        (dw, mw)
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
    let mut o = [[0.0f32; GROUP]; TOKENS];
    // SAFETY: the caller's guarantees are the multi-token kernel's, for one token.
    unsafe { tokens_512::<1>(dtype, g, &[a], &mut o) };
    *out = o[0];
}

/// AVX-512 BW + VNNI multi-token group kernel: [`group_avx512vnni`] for [`TOKENS`]
/// tokens, each pair of blocks unpacked (and its scales converted) once.
///
/// # Safety
/// As for [`group_avx512vnni`], for every token.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn group_tokens_avx512vnni(
    dtype: DType,
    g: &Group,
    acts: &[&QuantizedActs; TOKENS],
    out: &mut [[f32; GROUP]; TOKENS],
) {
    // SAFETY: forwarded from the caller.
    unsafe { tokens_512::<TOKENS>(dtype, g, acts, out) }
}

/// Codes this many blocks ahead of the block being read are prefetched (2048 bytes of
/// Q4 codes, 4096 of Q8), and scales (and minimums) [`PREFETCH_SCALES`] bytes ahead: a
/// fixed distance in each of a group's streams.
///
/// The AVX-512 VNNI one-token kernels prefetch only in matrices of [`Group::stream`]
/// (64 MiB or more), as measured on a Zen 4 host: out of DRAM with huge pages (Q4_1,
/// 16384x8192, best of 25) 5.5 ms without, 4.9 ms at 1024/128 and 2048/256 bytes; no
/// change out of L2, and SmolLM2's decode was 10-15% slower with it in every matrix.
///
/// The AVX2 one-token kernel prefetches in every matrix: a model larger than the last-level
/// cache streams each of its small matrices from DRAM every token, and a weaker hardware
/// prefetcher does not keep up with a group's three streams (codes, scales, minimums). On
/// a 2-vCPU Zen 1 EPYC (AVX2, 8 MiB L3), SmolLM2-135M Q4_1 decode, 129 tokens after an
/// 89-token prompt, binaries alternating for three rounds: one thread 61-67 tok/s with it
/// in every matrix against 47-50 without, two threads 101-106 against 67-76;
/// `qdot/1536x576` (L2-resident) unchanged within noise (Q4_1 7.6 GiB/s, Q8_0 11.7).
const PREFETCH_BLOCKS: usize = 16;
const PREFETCH_SCALES: usize = 256;

/// Prefetches (into L1) the `bytes` of codes [`PREFETCH_BLOCKS`] blocks past `qp` and
/// the scales (minimums) [`PREFETCH_SCALES`] bytes past block `b`'s. Addresses past the
/// group's end are those of the next group or past the buffer: a prefetch never faults,
/// and the pointers are formed with `wrapping_add`, never dereferenced.
#[target_feature(enable = "avx2")]
#[inline]
fn prefetch_ahead(dtype: DType, g: &Group, qp: *const u8, b: usize, bytes: usize) {
    let qsb = qs_bytes(dtype);
    let p = qp.wrapping_add(PREFETCH_BLOCKS * qsb);
    // `_mm_prefetch` is a hint (a safe function): it does not fault on any address.
    for l in (0..bytes).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(l).cast());
    }
    let at = b * 16 + PREFETCH_SCALES;
    _mm_prefetch::<_MM_HINT_T0>(g.d.as_ptr().wrapping_add(at).cast());
    if dtype == DType::Q4_1 {
        _mm_prefetch::<_MM_HINT_T0>(g.m.as_ptr().wrapping_add(at).cast());
    }
}

/// The AVX-512 kernel body for `T ≤ TOKENS` tokens (results in `out[..T]`).
///
/// # Safety
/// As for [`group_avx512vnni`], for every token.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn tokens_512<const T: usize>(
    dtype: DType,
    g: &Group,
    acts: &[&QuantizedActs; T],
    out: &mut [[f32; GROUP]; TOKENS],
) {
    let qsb = qs_bytes(dtype);
    let nb = g.nb;
    assert!(g.qs.len() >= nb * qsb);
    assert!(g.d.len() >= nb * 16 && (dtype != DType::Q4_1 || g.m.len() >= nb * 16));
    for a in acts {
        assert!(a.q.len() >= nb * QK && a.d.len() >= nb && a.s.len() >= nb && a.qsum.len() >= nb);
    }
    let mut acc = [_mm256_setzero_ps(); T];
    let mut b = 0;
    while b + 2 <= nb {
        // SAFETY: blocks `b` and `b + 1` are in bounds of `g.qs`, `g.d`, `g.m` and every
        // `a.q` (asserts above).
        unsafe {
            let qp = g.qs.as_ptr().add(b * qsb);
            if T == 1 && g.stream {
                prefetch_ahead(dtype, g, qp, b, 2 * qsb);
            }
            let w0 = unpack_512(dtype, qp);
            let w1 = unpack_512(dtype, qp.add(qsb));
            let (dw, mw) = scales16(dtype, g, b);
            for (a, acc_t) in acts.iter().zip(acc.iter_mut()) {
                let ap = a.q.as_ptr().add(b * QK);
                let (s0, s1) = block_sums_512(&w0, ap);
                let (p0, p1) = block_sums_512(&w1, ap.add(QK));
                *acc_t = pair_step(dtype, (s0, s1, p0, p1), dw, mw, a, b, *acc_t);
            }
        }
        b += 2;
    }
    if b < nb {
        // SAFETY: block `b` is in bounds (asserts above).
        unsafe {
            let w = unpack_512(dtype, g.qs.as_ptr().add(b * qsb));
            let sc = scales8(dtype, g, b);
            for (a, acc_t) in acts.iter().zip(acc.iter_mut()) {
                let sums = block_sums_512(&w, a.q.as_ptr().add(b * QK));
                let isum = single_isum(dtype, sums, a.qsum[b]);
                *acc_t = combine(dtype, sc, a, b, isum, *acc_t);
            }
        }
    }
    for (o, a) in out.iter_mut().zip(acc) {
        // SAFETY: `o` is 8 f32s; unaligned store.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), a) };
    }
}

/// Lane `(j, t)` (128-bit lane `j`, dword `t`) gets dword `D` of lane `j`: row `j`'s
/// codes of word `D`, once per token.
#[target_feature(enable = "avx512f")]
#[inline]
fn spread<const IMM: i32>(v: __m512i) -> __m512i {
    _mm512_shuffle_epi32::<IMM>(v)
}

/// The tile kernel's integer work for word pair `(d, 4 + d)` of one block: both token
/// halves, both row halves (`w` = rows 0..4 low/high, rows 4..8 low/high).
///
/// # Safety
/// AVX-512 F/BW/VNNI must be available; `qb` must point at the block's `8 × TILE × 4`
/// interleaved codes.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn tile_words<const IMM: i32, const H: usize>(
    d: usize,
    w: &[__m512i; 4],
    qb: *const i8,
    isum: &mut [[__m512i; 2]; H],
) {
    let (l0, h0, l1, h1) = (
        spread::<IMM>(w[0]),
        spread::<IMM>(w[1]),
        spread::<IMM>(w[2]),
        spread::<IMM>(w[3]),
    );
    for (h, acc) in isum.iter_mut().enumerate() {
        // SAFETY: words `d` and `4 + d` of tokens `4h..4h + 4` are inside the block (the
        // caller's guarantee); unaligned loads.
        let (alo, ahi) = unsafe {
            (
                _mm512_broadcast_i32x4(_mm_loadu_si128(qb.add((d * TILE + 4 * h) * 4).cast())),
                _mm512_broadcast_i32x4(_mm_loadu_si128(
                    qb.add(((4 + d) * TILE + 4 * h) * 4).cast(),
                )),
            )
        };
        acc[0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[0], l0, alo), h0, ahi);
        acc[1] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[1], l1, alo), h1, ahi);
    }
}

/// AVX-512 BW + VNNI tile kernel: eight rows × `4H` tokens (`H` = 1 or 2; `out[..4H]`),
/// with no cross-lane reduction. Each vector holds four rows × four tokens (lane `(j, t)`); a row's word
/// `e` is spread to its four token lanes with one in-lane shuffle per block (shared by all
/// tokens), the tokens' words come pre-interleaved ([`super::qdot::ActsTile`]), and each
/// `vpdpbusd` lane accumulates one row × one token, so the block sum is complete after the
/// eight words. The float steps are the scalar twin's per lane (separate multiplies and
/// adds), so every value equals it bit for bit.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/VNNI and F16C; `g` must be a group of a
/// [`super::qdot::Packed`] of `dtype` with `t.nb` blocks, and `t` a view of an
/// [`super::qdot::ActsTile`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn group_tile_avx512vnni<const H: usize>(
    dtype: DType,
    g: &Group,
    t: &TileView,
    out: &mut [[f32; GROUP]; TILE],
) {
    let qsb = qs_bytes(dtype);
    let nb = g.nb;
    assert!(H * 4 <= TILE && nb == t.nb && g.qs.len() >= nb * qsb);
    assert!(g.d.len() >= nb * 16 && (dtype != DType::Q4_1 || g.m.len() >= nb * 16));
    assert!(t.q.len() >= nb * 8 * TILE * 4 && t.d.len() >= nb * TILE);
    assert!(t.s.len() >= nb * TILE && t.qsum.len() >= nb * TILE);
    let idx = [
        _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
        _mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7),
    ];
    let off = offset(dtype);
    // acc[h][r]: tokens 4h..4h + 4 × rows 4r..4r + 4 (tokens past 4H are not computed)
    let mut acc = [[_mm512_setzero_ps(); 2]; H];
    for b in 0..nb {
        // SAFETY: block `b` is in bounds of `g.qs`, `g.d`, `g.m` and of the tile's
        // arrays (asserts above); loads are unaligned.
        unsafe {
            let qp = g.qs.as_ptr().add(b * qsb);
            // rows 0..4 elements 0..16 / 16..32 (Q4: low / high nibbles), then rows 4..8
            let w = unpack_512(dtype, qp);
            let qb = t.q.as_ptr().add(b * 8 * TILE * 4);
            let mut isum = [[_mm512_setzero_si512(); 2]; H];
            tile_words::<0x00, H>(0, &w, qb, &mut isum);
            tile_words::<0x55, H>(1, &w, qb, &mut isum);
            tile_words::<0xAA, H>(2, &w, qb, &mut isum);
            tile_words::<0xFF, H>(3, &w, qb, &mut isum);
            let dw8 = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128(
                g.d.as_ptr().add(b * 16).cast(),
            )));
            let mw8 = if dtype == DType::Q4_1 {
                _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128(
                    g.m.as_ptr().add(b * 16).cast(),
                )))
            } else {
                _mm512_setzero_ps()
            };
            let dw = [
                _mm512_permutexvar_ps(idx[0], dw8),
                _mm512_permutexvar_ps(idx[1], dw8),
            ];
            let mw = [
                _mm512_permutexvar_ps(idx[0], mw8),
                _mm512_permutexvar_ps(idx[1], mw8),
            ];
            for (h, (acc_h, isum_h)) in acc.iter_mut().zip(&isum).enumerate() {
                let at = b * TILE + 4 * h;
                let dx = _mm512_broadcast_f32x4(_mm_loadu_ps(t.d.as_ptr().add(at)));
                let sx = _mm512_broadcast_f32x4(_mm_loadu_ps(t.s.as_ptr().add(at)));
                let corr = if off != 0 {
                    let qs =
                        _mm512_broadcast_i32x4(_mm_loadu_si128(t.qsum.as_ptr().add(at).cast()));
                    _mm512_mullo_epi32(qs, _mm512_set1_epi32(off))
                } else {
                    _mm512_setzero_si512()
                };
                for r in 0..2 {
                    let is = _mm512_sub_epi32(isum_h[r], corr);
                    let mut tt = _mm512_mul_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(dw[r], dx));
                    if dtype == DType::Q4_1 {
                        tt = _mm512_add_ps(tt, _mm512_mul_ps(mw[r], sx));
                    }
                    acc_h[r] = _mm512_add_ps(acc_h[r], tt);
                }
            }
        }
    }
    for (h, acc_h) in acc.iter().enumerate() {
        for (r, &v) in acc_h.iter().enumerate() {
            let mut lanes = [0.0f32; 16];
            // SAFETY: `lanes` is 16 f32s; unaligned store.
            unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), v) };
            for j in 0..4 {
                for tt in 0..4 {
                    out[4 * h + tt][4 * r + j] = lanes[4 * j + tt];
                }
            }
        }
    }
}
