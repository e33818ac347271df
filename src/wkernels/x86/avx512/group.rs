//! AVX-512 BW + VNNI kernels of the interleaved types (layout:
//! [`crate::wkernels::packed`]): one 512-bit `vpdpbusd` covers four rows × 16 values; two
//! blocks share one reduction and one 16-lane pass of the float steps.
//!
//! `vpdpbusd` needs unsigned weights: Q4 codes are 0..15 (Q4_0's `− 8` applied as
//! `− 8 · Σ q_x`); Q5_0's fifth bits are ORed in as `0x10` from a 64-bit mask register
//! (its `− 16` applied as `− 16 · Σ q_x`); Q8_0 codes are flipped to `w + 128` (then
//! `− 128 · Σ q_x`); IQ4_NL nibbles are looked up as `K[n] + 128` (then `− 128 · Σ q_x`).
//! The float steps are the scalar twin's per lane (separate multiplies and adds), so every
//! value equals it bit for bit.

use super::super::{combine, offset, prefetch_next_group_l2, scales8};
use crate::dtype::DType;
use crate::wkernels::blocks::IQ4_VALUES;
use crate::wkernels::{qs_bytes, Group, QuantizedActs, TileView, GROUP, QK, TILE, TOKENS};
use std::arch::x86_64::*;

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
/// The CPU must support AVX-512 F/BW/VL/VNNI and F16C; `g` a group of a [`crate::wkernels::Packed`] of `dtype` with as many blocks as `a`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn group_dot(dtype: DType, g: &Group, a: &QuantizedActs, out: &mut [f32; 8]) {
    let mut o = [[0.0f32; GROUP]; TOKENS];
    // SAFETY: the caller's guarantees are the multi-token kernel's, for one token.
    unsafe { tokens_512::<1>(dtype, g, &[a], &mut o) };
    *out = o[0];
}

/// AVX-512 BW + VNNI multi-token group kernel: [`group_dot`] for [`TOKENS`]
/// tokens, each pair of blocks unpacked (and its scales converted) once.
///
/// # Safety
/// As for [`group_dot`], for every token.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn group_tokens(
    dtype: DType,
    g: &Group,
    acts: &[&QuantizedActs; TOKENS],
    out: &mut [[f32; GROUP]; TOKENS],
    n: usize,
) {
    by_live_tokens!(n, acts, |T, sub| {
        // SAFETY: forwarded from the caller (for the first `T` tokens).
        unsafe { tokens_512::<T>(dtype, g, sub, out) }
    })
}

/// The AVX-512 kernel body for `T ≤ TOKENS` tokens (results in `out[..T]`).
///
/// # Safety
/// As for [`group_dot`], for every token.
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
            // For every token count: a SmolLM2 pass of 2 tokens without it cost 1.8 plain
            // steps, with it 1.3 (`cargo bench --bench speculate`, 2 alternated rounds).
            prefetch_next_group_l2(dtype, g, qp, b, 2 * qsb);
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

/// The tile kernel for a tile's first `tokens` tokens (`out[..tokens]`): one vector per
/// row half for four tokens or fewer, two for more; `prefetch`: ask for the next group's
/// lines (into L2) as the blocks go by.
///
/// # Safety
/// As for [`tile`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn group_tile(
    dtype: DType,
    g: &Group,
    t: &TileView,
    out: &mut [[f32; GROUP]; TILE],
    tokens: usize,
    prefetch: bool,
) {
    // SAFETY: the caller's.
    unsafe {
        match (tokens <= 4, prefetch) {
            (true, false) => tile::<1, false>(dtype, g, t, out),
            (true, true) => tile::<1, true>(dtype, g, t, out),
            (false, false) => tile::<2, false>(dtype, g, t, out),
            (false, true) => tile::<2, true>(dtype, g, t, out),
        }
    }
}

/// AVX-512 BW + VNNI tile kernel: eight rows × `4H` tokens (`H` = 1 or 2; `out[..4H]`),
/// with no cross-lane reduction. Each vector holds four rows × four tokens (lane `(j, t)`); a row's word
/// `e` is spread to its four token lanes with one in-lane shuffle per block (shared by all
/// tokens), the tokens' words come pre-interleaved ([`crate::wkernels::ActsTile`]), and each
/// `vpdpbusd` lane accumulates one row × one token, so the block sum is complete after the
/// eight words. The float steps are the scalar twin's per lane (separate multiplies and
/// adds), so every value equals it bit for bit.
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/VNNI and F16C; `g` must be a group of a
/// [`crate::wkernels::Packed`] of `dtype` with `t.nb` blocks, and `t` a view of an
/// [`crate::wkernels::ActsTile`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile<const H: usize, const PREFETCH: bool>(
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
            // The next group's lines, as the one-token kernel asks for them: a SmolLM2
            // pass of 4 tokens 13.3 → 10.8 ms, of 8 tokens 21.8 → 17.3.
            if PREFETCH {
                prefetch_next_group_l2(dtype, g, qp, b, qsb);
            }
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
