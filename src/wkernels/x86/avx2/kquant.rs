//! AVX2 kernels of the whole-row types: Q4_K, Q5_K, Q6_K and IQ4_XS against Q8_K
//! activations, Q5_1 against the 8-bit blocks of 32 (layout: [`crate::wkernels::packed`]).
//!
//! `vpmaddubsw` of the unsigned codes (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63 before its −32)
//! with the signed activation codes, `vpmaddwd` with the sub-block scales, summed in
//! 32-bit lanes; Q6_K's `−32` is applied as `−32 · Σ_k sc_k · bsums_k`. Same integers,
//! same floats as the scalar twins ([`crate::wkernels::scalar`]).
//!
//! * one token (decode), `*_group`: per super-block the eight rows' 32-bit lane sums are
//!   reduced together (`vphaddd` tree, exact) into one vector of eight row sums, Q4_K /
//!   Q5_K's six-bit scales and mins unpacked with 32-bit masks and `msum` taken with
//!   `vpmaddwd` against the bsum pairs, and the float step runs for the eight rows as
//!   8-lane `vmulps`/`vsubps`/`vaddps` (no FMA: lane r does the twin's separate multiplies
//!   and adds); the walk prefetches the same super-block of the next group;
//! * several tokens, `*_row::<T>`: one row at a time (a 144- or 210-byte super-block
//!   already fills several vectors), each super-block unpacked once for the `T` tokens,
//!   the integer sums reduced once per super-block, then the twin's float steps in scalar
//!   f32.

use super::super::{
    f16_at, f16x8, hsum, k4_group_with, k4_scales_mins, prefetch_next_group, q5_1_codes,
    q5_1_group_body, q6_k_group_with, reduce8,
};
use crate::wkernels::blocks::{
    iq4_xs_scale, scale_min_k4, IQ4_VALUES, IQ4_XS_BYTES, Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, QK_K,
};
use crate::wkernels::{QuantizedActs, Q8K};
use std::arch::x86_64::*;

/// One Q4_K/Q5_K super-block `blk` · the 256 codes at `q8`: the integer sum
/// `Σ sc_j · (codes · q8)_j` spread over eight 32-bit lanes, and `msum = Σ m_j ·
/// (bsums_2j + bsums_2j+1)` over four (`bp` holds the eight pair sums of the bsums).
/// The six-bit scales and mins unpacked with 32-bit masks (the same values as
/// `scale_min_k4`).
///
/// # Safety
/// AVX2 must be available; `blk` must point at a whole super-block, `q8` at 256 codes.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn k4_block<const FIVE: bool>(
    blk: *const u8,
    q8: *const i8,
    bp: __m128i,
) -> (__m256i, __m128i) {
    // SAFETY: the caller's (a whole super-block).
    let sm = unsafe { k4_scales_mins(blk) };
    let m = _mm_madd_epi16(_mm256_extracti128_si256(sm, 1), bp);
    let scales = _mm256_permute2x128_si256(sm, sm, 0x00);
    let m4 = _mm256_set1_epi8(0x0F);
    let qs_at = if FIVE { 48 } else { 16 };
    let qh = if FIVE {
        // SAFETY: bytes 16..48 are inside the 176-byte block.
        unsafe { _mm256_loadu_si256(blk.add(16).cast()) }
    } else {
        _mm256_setzero_si256()
    };
    let top = |bit: i32| {
        let mk = _mm256_set1_epi8((1u8 << bit) as i8);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, mk), mk);
        _mm256_and_si256(set, _mm256_set1_epi8(0x10))
    };
    let mut s = _mm256_setzero_si256();
    for j in 0..4 {
        // SAFETY: weight bytes qs_at + 32j .. + 32 are inside the block; codes
        // 64j .. 64j + 64 inside the 256.
        let (w, xl, xh) = unsafe {
            (
                _mm256_loadu_si256(blk.add(qs_at + 32 * j).cast()),
                _mm256_loadu_si256(q8.add(64 * j).cast()),
                _mm256_loadu_si256(q8.add(64 * j + 32).cast()),
            )
        };
        let mut lo = _mm256_and_si256(w, m4);
        let mut hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
        if FIVE {
            lo = _mm256_or_si256(lo, top(2 * j as i32));
            hi = _mm256_or_si256(hi, top(2 * j as i32 + 1));
        }
        // The i16 scale of sub-block 2j (2j + 1) in every lane.
        let sl = _mm256_shuffle_epi8(
            scales,
            _mm256_set1_epi16((((4 * j + 1) << 8) | (4 * j)) as i16),
        );
        let sh = _mm256_shuffle_epi8(
            scales,
            _mm256_set1_epi16((((4 * j + 3) << 8) | (4 * j + 2)) as i16),
        );
        // Pair sums ≤ 2·31·128: no saturation.
        let pl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xl), sl);
        let ph = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xh), sh);
        s = _mm256_add_epi32(s, _mm256_add_epi32(pl, ph));
    }
    (s, m)
}

/// Q4_K (`FIVE = false`) or Q5_K (`FIVE = true`): the eight rows of a group (each
/// `rb` bytes, one after another in `qs`) · one token. Per super-block, the eight
/// rows' integer sums are reduced together into one vector, and the float step runs
/// as 8-lane separate multiplies, subtract and add: lane r does exactly the twin's
/// `acc += isum·(d·dx) − msum·(dmin·dx)`.
///
/// # Safety
/// AVX2, FMA and F16C must be available.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn k4_group<const FIVE: bool>(qs: &[u8], rb: usize, k: &Q8K) -> [f32; 8] {
    // SAFETY: `k4_block` needs AVX2, which this function has; the driver passes a
    // whole super-block and the token's 256 codes.
    let block = |blk, q8: &*const i8, bp| unsafe { k4_block::<FIVE>(blk, *q8, bp) };
    // SAFETY: the caller's.
    unsafe { k4_group_with::<FIVE, _>(qs, rb, k, |q8| q8, block) }
}

/// One Q6_K super-block `blk` · the 256 codes at `q8` (`bs`: their 16 bsums): the
/// integer sum `Σ sc_k · (codes · q8)_k − 32 · Σ sc_k · bsums_k` spread over eight
/// 32-bit lanes.
///
/// # Safety
/// AVX2 must be available; `blk` must point at a whole super-block, `q8` at 256 codes.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn q6_k_block(blk: *const u8, q8: *const i8, bs: __m256i) -> __m256i {
    let m4 = _mm256_set1_epi8(0x0F);
    let m30 = _mm256_set1_epi8(0x30);
    // SAFETY: the 16 scale bytes 192..208 are inside the 210-byte block.
    let scb = unsafe { _mm_loadu_si128(blk.add(192).cast()) };
    let off = _mm256_madd_epi16(_mm256_cvtepi8_epi16(scb), bs);
    let mut s = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(off, 5));
    for n in 0..2 {
        // SAFETY: ql 64n..64n + 64 and qh 128 + 32n..160 + 32n are inside the block.
        let (ql0, ql1, qh) = unsafe {
            (
                _mm256_loadu_si256(blk.add(64 * n).cast()),
                _mm256_loadu_si256(blk.add(64 * n + 32).cast()),
                _mm256_loadu_si256(blk.add(128 + 32 * n).cast()),
            )
        };
        // codes[t]: values 128n + 32t .. + 32, unsigned 0..63.
        let codes = [
            _mm256_or_si256(
                _mm256_and_si256(ql0, m4),
                _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30),
            ),
            _mm256_or_si256(
                _mm256_and_si256(ql1, m4),
                _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30),
            ),
            _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                _mm256_and_si256(qh, m30),
            ),
            _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30),
            ),
        ];
        for (t, c) in codes.into_iter().enumerate() {
            let i = 4 * n + t;
            // Scales of this 32-value run: lanes 0..8 sc[2i], lanes 8..16 sc[2i + 1].
            let idx = _mm_setr_epi8(
                2 * i as i8,
                2 * i as i8,
                2 * i as i8,
                2 * i as i8,
                2 * i as i8,
                2 * i as i8,
                2 * i as i8,
                2 * i as i8,
                2 * i as i8 + 1,
                2 * i as i8 + 1,
                2 * i as i8 + 1,
                2 * i as i8 + 1,
                2 * i as i8 + 1,
                2 * i as i8 + 1,
                2 * i as i8 + 1,
                2 * i as i8 + 1,
            );
            let scv = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scb, idx));
            // SAFETY: codes 32i .. 32i + 32 are inside the 256.
            let x = unsafe { _mm256_loadu_si256(q8.add(32 * i).cast()) };
            // Pair sums ≤ 2·63·128: no saturation.
            let p = _mm256_maddubs_epi16(c, x);
            s = _mm256_add_epi32(s, _mm256_madd_epi16(p, scv));
        }
    }
    s
}

/// Q6_K: the eight rows of a group · one token, as [`k4_group`] (lane r:
/// `acc += isum·(d·dx)`).
///
/// # Safety
/// AVX2, FMA and F16C must be available.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q6_k_group(qs: &[u8], rb: usize, k: &Q8K) -> [f32; 8] {
    // SAFETY: `q6_k_block` needs AVX2, which this function has; the driver passes a
    // whole super-block and 256 codes.
    let block = |blk, q8, bs| unsafe { q6_k_block(blk, q8, bs) };
    // SAFETY: the caller's.
    unsafe { q6_k_group_with(qs, rb, k, block) }
}

/// IQ4_XS: the eight rows of a group · one token, as [`k4_group`] (lane r:
/// `acc += isum·(d·dx)`; the integer sums as [`iq4_xs_row`]).
///
/// # Safety
/// AVX2, FMA and F16C must be available.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn iq4_xs_group(qs: &[u8], rb: usize, k: &Q8K) -> [f32; 8] {
    let nb = rb / IQ4_XS_BYTES;
    assert_eq!(rb, nb * IQ4_XS_BYTES);
    assert!(qs.len() >= 8 * rb);
    assert!(k.q.len() >= nb * QK_K && k.d.len() >= nb);
    let m4 = _mm256_set1_epi8(0x0F);
    // SAFETY: IQ4_VALUES is 16 bytes; unaligned load.
    let table = _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(IQ4_VALUES.as_ptr().cast()) });
    // The next group starts after eight rows, padded to 64 bytes (`Packed` layout).
    let ahead = (8 * rb).next_multiple_of(64);
    let mut acc = _mm256_setzero_ps();
    for b in 0..nb {
        let q8 = &k.q[b * QK_K..(b + 1) * QK_K];
        let mut s = [_mm256_setzero_si256(); 8];
        for (r, sr) in s.iter_mut().enumerate() {
            let at = r * rb + b * IQ4_XS_BYTES;
            let blk = &qs[at..at + IQ4_XS_BYTES];
            prefetch_next_group(blk.as_ptr(), ahead, IQ4_XS_BYTES);
            let mut v = _mm256_setzero_si256();
            for p in 0..4 {
                // SAFETY: bytes 8 + 32p .. 40 + 32p are inside the 136-byte block;
                // codes 64p .. 64p + 64 inside the token's 256.
                let (q, x0, x1) = unsafe {
                    (
                        _mm256_loadu_si256(blk.as_ptr().add(8 + 32 * p).cast()),
                        _mm256_loadu_si256(q8.as_ptr().add(64 * p).cast()),
                        _mm256_loadu_si256(q8.as_ptr().add(64 * p + 32).cast()),
                    )
                };
                let lo = _mm256_and_si256(q, m4);
                let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
                let w0 = _mm256_shuffle_epi8(table, _mm256_permute2x128_si256(lo, hi, 0x20));
                let w1 = _mm256_shuffle_epi8(table, _mm256_permute2x128_si256(lo, hi, 0x31));
                let s0 = (iq4_xs_scale(blk, 2 * p) - 32) as i16;
                let s1 = (iq4_xs_scale(blk, 2 * p + 1) - 32) as i16;
                // Pair sums ≤ 2·127·127: no saturation.
                let p0 = _mm256_maddubs_epi16(_mm256_abs_epi8(w0), _mm256_sign_epi8(x0, w0));
                let p1 = _mm256_maddubs_epi16(_mm256_abs_epi8(w1), _mm256_sign_epi8(x1, w1));
                v = _mm256_add_epi32(
                    v,
                    _mm256_add_epi32(
                        _mm256_madd_epi16(p0, _mm256_set1_epi16(s0)),
                        _mm256_madd_epi16(p1, _mm256_set1_epi16(s1)),
                    ),
                );
            }
            *sr = v;
        }
        let isum = _mm256_cvtepi32_ps(reduce8(&s));
        // SAFETY: the d of super-block b of every row is inside `qs` (asserted).
        let d = unsafe { f16x8(qs.as_ptr().add(b * IQ4_XS_BYTES), rb) };
        let dx = _mm256_set1_ps(k.d[b]);
        acc = _mm256_add_ps(acc, _mm256_mul_ps(isum, _mm256_mul_ps(d, dx)));
    }
    let mut out = [0.0f32; 8];
    // SAFETY: `out` is 8 floats.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc) };
    out
}

/// Q4_K (`FIVE = false`) or Q5_K (`FIVE = true`) row · `T` tokens.
///
/// # Safety
/// AVX2 must be available.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn k4_row<const T: usize, const FIVE: bool>(row: &[u8], ks: &[&Q8K; T]) -> [f32; T] {
    let bytes = if FIVE { Q5_K_BYTES } else { Q4_K_BYTES };
    let qs_at = if FIVE { 48 } else { 16 };
    let nb = row.len() / bytes;
    assert_eq!(row.len(), nb * bytes);
    for k in ks {
        assert!(k.q.len() >= nb * QK_K && k.d.len() >= nb && k.bsums.len() >= nb * 16);
    }
    let m4 = _mm256_set1_epi8(0x0F);
    let mut acc = [0.0f32; T];
    for b in 0..nb {
        let blk = &row[b * bytes..(b + 1) * bytes];
        let mut sc = [0i16; 8];
        let mut mn = [0i32; 8];
        for j in 0..8 {
            let (s, m) = scale_min_k4(j, &blk[4..16]);
            sc[j] = s as i16;
            mn[j] = m as i32;
        }
        let mut lo = [_mm256_setzero_si256(); 4];
        let mut hi = [_mm256_setzero_si256(); 4];
        // Q5_K's fifth bits: byte l of `qh` tops value 64j + l (bit 2j) and
        // 64j + 32 + l (bit 2j + 1).
        let qh = if FIVE {
            // SAFETY: bytes 16..48 are inside the 176-byte block.
            unsafe { _mm256_loadu_si256(blk.as_ptr().add(16).cast()) }
        } else {
            _mm256_setzero_si256()
        };
        let top = |bit: i32| {
            let m = _mm256_set1_epi8((1u8 << bit) as i8);
            let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, m), m);
            _mm256_and_si256(set, _mm256_set1_epi8(0x10))
        };
        for j in 0..4 {
            // SAFETY: bytes qs_at + 32j .. qs_at + 32j + 32 are inside the block.
            let w = unsafe { _mm256_loadu_si256(blk.as_ptr().add(qs_at + 32 * j).cast()) };
            lo[j] = _mm256_and_si256(w, m4);
            hi[j] = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
            if FIVE {
                lo[j] = _mm256_or_si256(lo[j], top(2 * j as i32));
                hi[j] = _mm256_or_si256(hi[j], top(2 * j as i32 + 1));
            }
        }
        let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
        for (t, k) in ks.iter().enumerate() {
            let q8 = k.q[b * QK_K..(b + 1) * QK_K].as_ptr();
            let mut s = _mm256_setzero_si256();
            for j in 0..4 {
                // SAFETY: 64j .. 64j + 64 is inside the token's 256 codes (asserted).
                let (xl, xh) = unsafe {
                    (
                        _mm256_loadu_si256(q8.add(64 * j).cast()),
                        _mm256_loadu_si256(q8.add(64 * j + 32).cast()),
                    )
                };
                // Pair sums ≤ 2·31·128: no saturation.
                let pl = _mm256_maddubs_epi16(lo[j], xl);
                let ph = _mm256_maddubs_epi16(hi[j], xh);
                s = _mm256_add_epi32(
                    s,
                    _mm256_add_epi32(
                        _mm256_madd_epi16(pl, _mm256_set1_epi16(sc[2 * j])),
                        _mm256_madd_epi16(ph, _mm256_set1_epi16(sc[2 * j + 1])),
                    ),
                );
            }
            let isum = hsum(s);
            let bs = &k.bsums[b * 16..(b + 1) * 16];
            let mut msum = 0i32;
            for j in 0..8 {
                msum += mn[j] * (bs[2 * j] as i32 + bs[2 * j + 1] as i32);
            }
            let dx = k.d[b];
            acc[t] += isum as f32 * (d * dx) - msum as f32 * (dmin * dx);
        }
    }
    acc
}

/// IQ4_XS row · `T` tokens: the levels looked up with `vpshufb`, then signed × signed
/// byte products as `|w| · (q8 · sign w)` (pair sums ≤ 2·127·127).
///
/// # Safety
/// AVX2 must be available.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn iq4_xs_row<const T: usize>(row: &[u8], ks: &[&Q8K; T]) -> [f32; T] {
    let nb = row.len() / IQ4_XS_BYTES;
    assert_eq!(row.len(), nb * IQ4_XS_BYTES);
    for k in ks {
        assert!(k.q.len() >= nb * QK_K && k.d.len() >= nb);
    }
    let m4 = _mm256_set1_epi8(0x0F);
    // SAFETY: IQ4_VALUES is 16 bytes; unaligned load.
    let table = _mm256_broadcastsi128_si256(unsafe { _mm_loadu_si128(IQ4_VALUES.as_ptr().cast()) });
    let mut acc = [0.0f32; T];
    for b in 0..nb {
        let blk = &row[b * IQ4_XS_BYTES..(b + 1) * IQ4_XS_BYTES];
        // w[ib]: sub-block ib's 32 levels in value order, as |w| and w.
        let mut wabs = [_mm256_setzero_si256(); 8];
        let mut wsgn = [_mm256_setzero_si256(); 8];
        for p in 0..4 {
            // SAFETY: bytes 8 + 32p .. 40 + 32p are inside the 136-byte block.
            let q = unsafe { _mm256_loadu_si256(blk.as_ptr().add(8 + 32 * p).cast()) };
            let lo = _mm256_and_si256(q, m4);
            let hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            // Sub-block 2p: low nibbles of bytes 0..16 then their high nibbles.
            let a = _mm256_permute2x128_si256(lo, hi, 0x20);
            let c = _mm256_permute2x128_si256(lo, hi, 0x31);
            for (i, v) in [(2 * p, a), (2 * p + 1, c)] {
                let w = _mm256_shuffle_epi8(table, v);
                wabs[i] = _mm256_abs_epi8(w);
                wsgn[i] = w;
            }
        }
        let sc: [i16; 8] = std::array::from_fn(|ib| (iq4_xs_scale(blk, ib) - 32) as i16);
        let d = f16_at(blk, 0);
        for (t, k) in ks.iter().enumerate() {
            let q8 = k.q[b * QK_K..(b + 1) * QK_K].as_ptr();
            let mut s = _mm256_setzero_si256();
            for ib in 0..8 {
                // SAFETY: 32ib .. 32ib + 32 is inside the token's 256 codes (asserted).
                let x = unsafe { _mm256_loadu_si256(q8.add(32 * ib).cast()) };
                let p = _mm256_maddubs_epi16(wabs[ib], _mm256_sign_epi8(x, wsgn[ib]));
                s = _mm256_add_epi32(s, _mm256_madd_epi16(p, _mm256_set1_epi16(sc[ib])));
            }
            acc[t] += hsum(s) as f32 * (d * k.d[b]);
        }
    }
    acc
}

/// Q5_1 row · `T` tokens' 8-bit blocks of 32: the 32 five-bit codes of a block in one
/// vector (nibbles, then each `qh` bit spread to its byte as 0x10), `vpmaddubsw` with
/// the activation codes, summed exactly; the float steps as the twin.
///
/// # Safety
/// AVX2 must be available.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q5_1_row<const T: usize>(row: &[u8], acts: &[&QuantizedActs; T]) -> [f32; T] {
    let nb = row.len() / 24;
    assert_eq!(row.len(), nb * 24);
    for a in acts {
        assert!(a.q.len() >= nb * 32 && a.d.len() >= nb && a.s.len() >= nb);
    }
    let ones = _mm256_set1_epi16(1);
    let mut acc = [0.0f32; T];
    for b in 0..nb {
        let blk = &row[b * 24..(b + 1) * 24];
        // SAFETY: `blk` is a whole 24-byte block.
        let codes = unsafe { q5_1_codes(blk.as_ptr()) };
        let dw = f16_at(blk, 0);
        let mw = f16_at(blk, 2);
        for (t, a) in acts.iter().enumerate() {
            // SAFETY: 32 codes of block b are inside `a.q` (asserted).
            let x = unsafe { _mm256_loadu_si256(a.q.as_ptr().add(32 * b).cast()) };
            // Pair sums ≤ 2·31·127: no saturation.
            let p = _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), ones);
            acc[t] += hsum(p) as f32 * (dw * a.d[b]) + mw * a.s[b];
        }
    }
    acc
}

/// Q5_1: the eight rows of a group (each `rb` bytes of 24-byte blocks, one after
/// another in `qs`) · one token. Per block the eight rows' integer sums are reduced
/// together into one vector and the float step runs as 8-lane separate multiplies and
/// adds: lane r does exactly [`q5_1_row`]'s (the twin's)
/// `acc += isum·(dw·dx) + mw·s`.
///
/// # Safety
/// AVX2, FMA and F16C must be available.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q5_1_group(qs: &[u8], rb: usize, a: &QuantizedActs) -> [f32; 8] {
    // SAFETY: the caller's.
    unsafe { q5_1_group_body(qs, rb, a) }
}

/// Q6_K row · `T` tokens.
///
/// # Safety
/// AVX2 must be available.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q6_k_row<const T: usize>(row: &[u8], ks: &[&Q8K; T]) -> [f32; T] {
    let nb = row.len() / Q6_K_BYTES;
    assert_eq!(row.len(), nb * Q6_K_BYTES);
    for k in ks {
        assert!(k.q.len() >= nb * QK_K && k.d.len() >= nb && k.bsums.len() >= nb * 16);
    }
    let m4 = _mm256_set1_epi8(0x0F);
    let m30 = _mm256_set1_epi8(0x30);
    let mut acc = [0.0f32; T];
    for b in 0..nb {
        let blk = &row[b * Q6_K_BYTES..(b + 1) * Q6_K_BYTES];
        let sc: [i16; 16] = std::array::from_fn(|k| blk[192 + k] as i8 as i16);
        // codes[4n + t]: values 128n + 32t .. 128n + 32t + 32, unsigned 0..63.
        let mut codes = [_mm256_setzero_si256(); 8];
        for n in 0..2 {
            // SAFETY: ql 64n..64n + 64 and qh 128 + 32n..160 + 32n are inside the
            // 210-byte block.
            let (ql0, ql1, qh) = unsafe {
                let p = blk.as_ptr();
                (
                    _mm256_loadu_si256(p.add(64 * n).cast()),
                    _mm256_loadu_si256(p.add(64 * n + 32).cast()),
                    _mm256_loadu_si256(p.add(128 + 32 * n).cast()),
                )
            };
            // 16-bit shifts move bits across byte edges only outside the 0x30 mask.
            codes[4 * n] = _mm256_or_si256(
                _mm256_and_si256(ql0, m4),
                _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30),
            );
            codes[4 * n + 1] = _mm256_or_si256(
                _mm256_and_si256(ql1, m4),
                _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30),
            );
            codes[4 * n + 2] = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                _mm256_and_si256(qh, m30),
            );
            codes[4 * n + 3] = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30),
            );
        }
        // Scales of each 32-value run: lanes 0..8 its first 16 values, 8..16 the rest.
        let scv: [__m256i; 8] = std::array::from_fn(|i| {
            _mm256_setr_m128i(_mm_set1_epi16(sc[2 * i]), _mm_set1_epi16(sc[2 * i + 1]))
        });
        let d = f16_at(blk, 208);
        for (t, k) in ks.iter().enumerate() {
            let q8 = k.q[b * QK_K..(b + 1) * QK_K].as_ptr();
            let mut s = _mm256_setzero_si256();
            for i in 0..8 {
                // SAFETY: 32i .. 32i + 32 is inside the token's 256 codes (asserted).
                let x = unsafe { _mm256_loadu_si256(q8.add(32 * i).cast()) };
                // Pair sums ≤ 2·63·128: no saturation.
                let p = _mm256_maddubs_epi16(codes[i], x);
                s = _mm256_add_epi32(s, _mm256_madd_epi16(p, scv[i]));
            }
            let bs = &k.bsums[b * 16..(b + 1) * 16];
            let mut off = 0i32;
            for (c, &bsum) in sc.iter().zip(bs) {
                off += *c as i32 * bsum as i32;
            }
            let isum = hsum(s) - 32 * off;
            acc[t] += isum as f32 * (d * k.d[b]);
        }
    }
    acc
}
