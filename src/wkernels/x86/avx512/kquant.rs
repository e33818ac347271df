//! AVX-512 (F + BW) one-token groups of the whole-row types for the `avx512vnni` variant:
//! the AVX2 kernels' integer sums with 64 codes per instruction instead of 32 (Q4_K,
//! Q5_K, Q6_K), and Q5_1's AVX2 walk compiled with 32 vector registers. Integer sums are
//! exact in any order, and the float steps are the AVX2 kernels' (lane `r` = row `r`,
//! separate multiplies and adds), so every value is the twin's bit for bit.

use super::super::{k4_group_with, k4_scales_mins, q5_1_group_body, q6_k_group_with};
use crate::wkernels::{QuantizedActs, Q8K};
use std::arch::x86_64::*;

/// The AVX2 `q5_1_group` (its walk, `q5_1_group_body`) compiled with AVX-512 VL's 32 vector registers (the
/// AVX2 code spills with 16): the same instructions, the same values.
///
/// # Safety
/// AVX-512 F, BW and VL, AVX2, FMA and F16C must be available.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub unsafe fn q5_1_group(qs: &[u8], rb: usize, a: &QuantizedActs) -> [f32; 8] {
    // SAFETY: the caller's.
    unsafe { q5_1_group_body(qs, rb, a) }
}

/// The i16 scale lanes of one 64-code run starting at sub-block `4h`: lane `q` (the
/// `vpmaddubsw` pair `2q, 2q + 1`) belongs to sub-block `4h + q / 8`.
const fn scale_index(h: usize) -> [i16; 32] {
    let mut idx = [0i16; 32];
    let mut q = 0;
    while q < 32 {
        idx[q] = (4 * h + q / 8) as i16;
        q += 1;
    }
    idx
}

const SCALE_IDX: [[i16; 32]; 4] = [
    scale_index(0),
    scale_index(1),
    scale_index(2),
    scale_index(3),
];

/// One Q6_K super-block `blk` · the 256 codes at `q8` (`bs`: their 16 bsums): the
/// integer sum `Σ sc_k · (codes · q8)_k − 32 · Σ sc_k · bsums_k` spread over eight
/// 32-bit lanes (the same integer as the AVX2 `q6_k_block`'s).
///
/// # Safety
/// AVX-512 F and BW and AVX2 must be available; `blk` must point at a whole
/// super-block, `q8` at 256 codes.
#[target_feature(enable = "avx512f,avx512bw,avx2")]
#[inline]
unsafe fn q6_k_block(blk: *const u8, q8: *const i8, bs: __m256i) -> __m256i {
    let m4 = _mm512_set1_epi8(0x0F);
    let m30 = _mm512_set1_epi8(0x30);
    // Shift counts per 256-bit half: codes 0..32 of a 64-code run take qh's bits 0-1
    // (low half) or 2-3 (high half) for the first run, 4-5 or 6-7 for the second.
    let up = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_set1_epi16(4)),
        _mm256_set1_epi16(2),
        1,
    );
    let down = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_setzero_si256()),
        _mm256_set1_epi16(2),
        1,
    );
    // SAFETY: the 16 scale bytes 192..208 are inside the 210-byte block.
    let scb = unsafe { _mm_loadu_si128(blk.add(192).cast()) };
    let sc16 = _mm256_cvtepi8_epi16(scb);
    let off = _mm256_madd_epi16(sc16, bs);
    let s_off = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(off, 5));
    let sc16 = _mm512_castsi256_si512(sc16);
    let mut s = _mm512_setzero_si512();
    for n in 0..2 {
        // SAFETY: ql 64n..64n + 64 and qh 128 + 32n..160 + 32n are inside the block,
        // codes 128n..128n + 128 inside the 256.
        let (ql, qh, x0, x1) = unsafe {
            (
                _mm512_loadu_si512(blk.add(64 * n).cast()),
                _mm512_broadcast_i64x4(_mm256_loadu_si256(blk.add(128 + 32 * n).cast())),
                _mm512_loadu_si512(q8.add(128 * n).cast()),
                _mm512_loadu_si512(q8.add(128 * n + 64).cast()),
            )
        };
        // Codes 128n .. 128n + 64 (low nibbles) and 128n + 64 .. 128n + 128 (high),
        // unsigned 0..63.
        let c0 = _mm512_or_si512(
            _mm512_and_si512(ql, m4),
            _mm512_and_si512(_mm512_sllv_epi16(qh, up), m30),
        );
        let c1 = _mm512_or_si512(
            _mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
            _mm512_and_si512(_mm512_srlv_epi16(qh, down), m30),
        );
        for (h, (c, x)) in [(c0, x0), (c1, x1)].into_iter().enumerate() {
            // SAFETY: SCALE_IDX rows are 32 i16.
            let idx = unsafe { _mm512_loadu_si512(SCALE_IDX[2 * n + h].as_ptr().cast()) };
            let scv = _mm512_permutexvar_epi16(idx, sc16);
            // Pair sums ≤ 2·63·128: no saturation.
            let p = _mm512_maddubs_epi16(c, x);
            s = _mm512_add_epi32(s, _mm512_madd_epi16(p, scv));
        }
    }
    let folded = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
    _mm256_add_epi32(s_off, folded)
}

/// Q6_K: the eight rows of a group · one token, as the AVX2 `q6_k_group` (lane r:
/// `acc += isum·(d·dx)`).
///
/// # Safety
/// AVX-512 F and BW, AVX2, FMA and F16C must be available.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub unsafe fn q6_k_group(qs: &[u8], rb: usize, k: &Q8K) -> [f32; 8] {
    // SAFETY: `q6_k_block` needs AVX-512 F/BW, which this function has; the driver
    // passes a whole super-block and 256 codes.
    let block = |blk, q8, bs| unsafe { q6_k_block(blk, q8, bs) };
    // SAFETY: the caller's.
    unsafe { q6_k_group_with(qs, rb, k, block) }
}

/// The i16 lanes of a Q4_K/Q5_K 64-code run pair `p` (sub-blocks `4p + o` in the low
/// half, `4p + o + 2` in the high half; `o` = 0 for low nibbles, 1 for high), as
/// indices into the 16 i16 of the unpacked scales.
const fn k4_scale_index(p: usize, o: usize) -> [i16; 32] {
    let mut idx = [0i16; 32];
    let mut q = 0;
    while q < 32 {
        idx[q] = (4 * p + o + if q < 16 { 0 } else { 2 }) as i16;
        q += 1;
    }
    idx
}

const K4_SCALE_IDX: [[i16; 32]; 4] = [
    k4_scale_index(0, 0),
    k4_scale_index(0, 1),
    k4_scale_index(1, 0),
    k4_scale_index(1, 1),
];

/// One Q4_K/Q5_K super-block `blk` · the token's codes, already laid out per 64-byte
/// weight run pair (`x[2p]`: the codes of the low nibbles of weight bytes
/// `64p..64p + 64`, `x[2p + 1]`: of the high nibbles): the integer sum and `msum` of
/// the AVX2 `k4_block`'s, the same integers.
///
/// # Safety
/// AVX-512 F and BW and AVX2 must be available; `blk` must point at a whole super-block.
#[target_feature(enable = "avx512f,avx512bw,avx2")]
#[inline]
unsafe fn k4_block<const FIVE: bool>(
    blk: *const u8,
    x: &[__m512i; 4],
    bp: __m128i,
) -> (__m256i, __m128i) {
    // SAFETY: the caller's (a whole super-block).
    let sm = unsafe { k4_scales_mins(blk) };
    let m = _mm_madd_epi16(_mm256_extracti128_si256(sm, 1), bp);
    let sm = _mm512_castsi256_si512(sm);
    let m4 = _mm512_set1_epi8(0x0F);
    let qs_at = if FIVE { 48 } else { 16 };
    let qh = if FIVE {
        // SAFETY: bytes 16..48 are inside the 176-byte block.
        _mm512_broadcast_i64x4(unsafe { _mm256_loadu_si256(blk.add(16).cast()) })
    } else {
        _mm512_setzero_si512()
    };
    let mut s = _mm512_setzero_si512();
    for p in 0..2 {
        // SAFETY: weight bytes qs_at + 64p .. + 64 are inside the block.
        let w = unsafe { _mm512_loadu_si512(blk.add(qs_at + 64 * p).cast()) };
        let mut lo = _mm512_and_si512(w, m4);
        let mut hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
        if FIVE {
            // Sub-block 2j's fifth bits are bit 2j of qh, 2j + 1's bit 2j + 1; the
            // low half holds j = 2p, the high half j = 2p + 1.
            let bits = |o: u32| {
                let lo_bit = 1u8 << (4 * p as u32 + o);
                _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_set1_epi8(lo_bit as i8)),
                    _mm256_set1_epi8((lo_bit << 2) as i8),
                    1,
                )
            };
            let t16 = _mm512_set1_epi8(0x10);
            lo = _mm512_or_si512(
                lo,
                _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(qh, bits(0)), t16),
            );
            hi = _mm512_or_si512(
                hi,
                _mm512_maskz_mov_epi8(_mm512_test_epi8_mask(qh, bits(1)), t16),
            );
        }
        // SAFETY: K4_SCALE_IDX rows are 32 i16.
        let (il, ih) = unsafe {
            (
                _mm512_loadu_si512(K4_SCALE_IDX[2 * p].as_ptr().cast()),
                _mm512_loadu_si512(K4_SCALE_IDX[2 * p + 1].as_ptr().cast()),
            )
        };
        // Pair sums ≤ 2·31·128: no saturation.
        let pl = _mm512_madd_epi16(
            _mm512_maddubs_epi16(lo, x[2 * p]),
            _mm512_permutexvar_epi16(il, sm),
        );
        let ph = _mm512_madd_epi16(
            _mm512_maddubs_epi16(hi, x[2 * p + 1]),
            _mm512_permutexvar_epi16(ih, sm),
        );
        s = _mm512_add_epi32(s, _mm512_add_epi32(pl, ph));
    }
    let folded = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
    (folded, m)
}

/// Q4_K (`FIVE = false`) or Q5_K (`FIVE = true`): the eight rows of a group · one
/// token, as the AVX2 `k4_group` (lane r: `acc += isum·(d·dx) − msum·(dmin·dx)`).
///
/// # Safety
/// AVX-512 F and BW, AVX2, FMA and F16C must be available.
#[target_feature(enable = "avx512f,avx512bw,avx2,fma,f16c")]
pub unsafe fn k4_group<const FIVE: bool>(qs: &[u8], rb: usize, k: &Q8K) -> [f32; 8] {
    // Weight bytes 64p..64p + 64 hold codes 128p + 0..32 and 128p + 64..96 in their low
    // nibbles, 128p + 32..64 and 128p + 96..128 in their high ones.
    let prep = |q8: *const i8| {
        let pair = |a: usize, c: usize| {
            // SAFETY: `q8` points at the token's 256 codes of this super-block.
            unsafe {
                _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256(q8.add(a).cast())),
                    _mm256_loadu_si256(q8.add(c).cast()),
                    1,
                )
            }
        };
        [pair(0, 64), pair(32, 96), pair(128, 192), pair(160, 224)]
    };
    // SAFETY: `k4_block` needs AVX-512 F/BW, which this function has; the driver
    // passes a whole super-block.
    let block = |blk, x: &[__m512i; 4], bp| unsafe { k4_block::<FIVE>(blk, x, bp) };
    // SAFETY: the caller's.
    unsafe { k4_group_with::<FIVE, _>(qs, rb, k, prep, block) }
}
