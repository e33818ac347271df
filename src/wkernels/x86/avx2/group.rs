//! AVX2 kernels of the interleaved types (Q8_0, Q4_0, Q4_1, Q5_0, IQ4_NL; layout:
//! [`crate::wkernels::packed`]).
//!
//! Per block, the eight rows' exact integer sums go into one 8-lane vector (lane `k` =
//! row `k`), then the reference's float steps run on the eight lanes:
//! `acc += isum · (d_w · d_x)` (Q4_1: `+ m_w · s_x` inside the bracket), with separate
//! multiplies and adds, never fused, so each lane equals the scalar twin bit for bit.
//!
//! Unsigned × signed byte products (`vpmaddubsw`) need unsigned weights: Q4 codes are 0..15
//! already (Q4_0's `− 8` is applied as `− 8 · Σ q_x`); Q5_0 codes are 0..31 (the nibbles
//! with the fifth bit ORed in as `0x10`, bytes spread from 32 bits by `vpshufb` + compare)
//! and its `− 16` is applied as `− 16 · Σ q_x`; Q8_0 codes are split into `|w|` and the
//! activation's sign-adjusted copy (whose 16-bit pair sums would saturate on
//! `255 · 127 · 2`; `128 · 127 · 2` fits). IQ4_NL nibbles are looked up (`vpshufb`, the 16
//! levels in every 128-bit lane) as Q8_0 codes `K[n]`, which then take Q8_0's `|w|` / sign
//! path.
//!
//! The multi-token kernel ([`group_tokens`]) runs the same per-block steps for
//! [`TOKENS`] activation vectors, loading and unpacking each weight block (and converting
//! its scales) once for all of them: every token's lanes see exactly the operations of the
//! one-token kernel, so the values are equal bit for bit.

use super::super::{combine, offset, prefetch_ahead, prefetch_next_group_l2, scales8};
use crate::dtype::DType;
use crate::wkernels::blocks::IQ4_VALUES;
use crate::wkernels::{qs_bytes, Group, QuantizedActs, GROUP, QK, TOKENS};
use std::arch::x86_64::*;

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
    match dtype {
        DType::Q8_0 | DType::IQ4_NL => true,
        DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | rows_or_float!() => false,
    }
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
/// memory, which cost the group kernels up to 47% (the 1536x768 `qdot` bench) after the
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
        DType::Q8_0 | DType::Q4_1 | DType::IQ4_NL | rows_or_float!() => isum,
    }
}

/// AVX2 group kernel.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `g` must be a group of a [`crate::wkernels::Packed`]
/// of `dtype` with as many blocks as `a`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn group_dot(dtype: DType, g: &Group, a: &QuantizedActs, out: &mut [f32; 8]) {
    // SAFETY: the caller's guarantees, passed on.
    unsafe { per_code_type!(dtype, group_dot_body, (g, a, out)) }
}

/// [`group_dot`]'s loop for one code type.
///
/// # Safety
/// As for [`group_dot`]; always inlined into it (which enables AVX2).
#[inline(always)]
unsafe fn group_dot_body(dtype: DType, g: &Group, a: &QuantizedActs, out: &mut [f32; 8]) {
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
            // In every matrix: see [`prefetch_next_group_l2`].
            prefetch_next_group_l2(dtype, g, qp, b, qsb);
            let v = unpack_avx2(dtype, qp);
            let isum = isum_avx2(dtype, &v, a.q.as_ptr().add(b * QK), a.qsum[b]);
            acc = combine(dtype, scales8(dtype, g, b), a, b, isum, acc);
        }
    }
    // SAFETY: `out` is 8 f32s; unaligned store.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc) };
}

/// AVX2 multi-token group kernel: [`group_dot`] for [`TOKENS`] tokens, each block
/// unpacked once.
///
/// # Safety
/// As for [`group_dot`], for every token.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn group_tokens(
    dtype: DType,
    g: &Group,
    acts: &[&QuantizedActs; TOKENS],
    out: &mut [[f32; GROUP]; TOKENS],
    n: usize,
) {
    by_live_tokens!(n, acts, |T, sub| {
        // SAFETY: the caller's guarantees, passed on (for the first `T` tokens).
        unsafe { per_code_type!(dtype, group_tokens_body::<T>, (g, sub, out)) }
    })
}

/// [`group_tokens`]'s loop for one code type.
///
/// # Safety
/// As for [`group_tokens`]; always inlined into it (which enables AVX2).
#[inline(always)]
unsafe fn group_tokens_body<const T: usize>(
    dtype: DType,
    g: &Group,
    acts: &[&QuantizedActs; T],
    out: &mut [[f32; GROUP]; TOKENS],
) {
    let qsb = qs_bytes(dtype);
    assert!(g.qs.len() >= g.nb * qsb);
    for a in acts {
        assert!(a.q.len() >= g.nb * QK && a.d.len() >= g.nb && a.qsum.len() >= g.nb);
    }
    let mut acc = [_mm256_setzero_ps(); T];
    for b in 0..g.nb {
        // SAFETY: block `b` of `g.qs` and of every `a.q` is in bounds (asserts above).
        unsafe {
            let qp = g.qs.as_ptr().add(b * qsb);
            // As the one-token kernel ([`prefetch_next_group_l2`]): forced AVX2 on the Zen 4
            // host, a SmolLM2 pass of 2 tokens 16.0 → 9.6 ms, of 4 tokens 25.5 → 14.5
            // (plain step 6.7–7.1 ms; `cargo bench --bench speculate`, 2 rounds).
            if g.stream {
                prefetch_ahead(dtype, g, qp, b, qsb);
            } else {
                prefetch_next_group_l2(dtype, g, qp, b, qsb);
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
