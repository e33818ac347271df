//! The x86_64 kernels: `avx2` (AVX2 + FMA + F16C) and `avx512` (AVX-512 F/BW/VL + VNNI,
//! the `avx512vnni` variant, which runs the AVX2 code where it has none of its own: the
//! type table in `wkernels/mod.rs` says where). What both use is here: the interleaved
//! types' scale loads, float steps, offsets and prefetching, and the K-quant groups' walks
//! (`k4_group_with`, `q6_k_group_with`, `q5_1_group_body`), which each instruction set
//! compiles with its own per-block integer step.
//!
//! Everything here is an integer step whose sums are exact in any order, or the
//! reference's float steps with separate multiplies and adds (never fused): each lane
//! equals the scalar twin bit for bit.

use crate::dtype::DType;
use crate::wkernels::blocks::{Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, QK_K};
use crate::wkernels::{qs_bytes, Group, QuantizedActs, Q8K};
use half::f16;
use std::arch::x86_64::*;

pub mod avx2;
pub mod avx512;

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

/// The integer correction of block `b`: `Σ w·q_x = Σ stored·q_x − offset·Σ q_x` (0 for
/// the types without one, and for those that never reach these kernels: the AVX-512 loops
/// ask it per block with the type a run-time value, so no panic branch goes in there).
#[inline(always)]
fn offset(dtype: DType) -> i32 {
    match dtype {
        DType::Q4_0 => 8,
        DType::Q5_0 => 16,
        DType::Q8_0 | DType::IQ4_NL => 128,
        DType::Q4_1 | rows_or_float!() => 0,
    }
}

/// Codes this many blocks ahead of the block being read are prefetched (2048 bytes of
/// Q4 codes, 4096 of Q8), and scales (and minimums) [`PREFETCH_SCALES`] bytes ahead: a
/// fixed distance in each of a group's streams.
///
/// The AVX-512 VNNI one-token kernel no longer uses it: it prefetches one group ahead into
/// L2 in every matrix ([`prefetch_next_group_l2`], measured there). Before, it prefetched
/// at this distance in matrices of [`Group::stream`] size only (64 MiB or more), as
/// measured on a Zen 4 host: out of DRAM with huge pages (Q4_1, 16384x8192, best of 25)
/// 5.5 ms without, 4.9 ms at 1024/128 and 2048/256 bytes; no change out of L2, and
/// SmolLM2's decode was 10-15% slower with it in every matrix.
///
/// The AVX2 one-token kernel prefetched at this distance in every matrix until it too took
/// [`prefetch_next_group_l2`] (its multi-token kernel still does, in [`Group::stream`]
/// matrices): a model larger than the last-level
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

/// Asks for the lines of the same place in the next group, into L2 (`_MM_HINT_T1`):
/// codes `bytes` from `qp` (block `b`'s) and, once per 64-byte line of them, the scales
/// (and minimums) of block `b`, one group further. The interleaved one-token kernels call
/// it in every matrix (AVX-512 VNNI every pair of blocks, AVX2 every block): the distance
/// is one group, so the lines arrive about a group's time early whatever the matrix's
/// width.
///
/// Measured on the 2-vCPU Zen 4 host (AVX-512 VNNI), `cargo bench --bench decode_profile`
/// on the Qwen2.5-0.5B-shaped Q4_K_M (the same binary, a switch alternated, 2 rounds each
/// twice): Q8_0 head 151,936x896 10.0–10.2 GB/s with [`prefetch_ahead`] in it (the only
/// matrix of [`Group::stream`] size) → 19.4–20.5; Q5_0 gate/up, 4,864x896, 10.9–11.0
/// without a prefetch → 15.2–15.6; the step 26.2–26.6 → 37.6–37.8 tok/s. Into L1
/// (`_MM_HINT_T0`) at the same distance the head ran at 9.6–11.0 GB/s: a group of 8 rows
/// is 7.6 KiB here and up to 64 KiB in wide matrices, more than L1 keeps. Two and three
/// groups ahead made no difference the noise could resolve (steps 46.3–48.9 tok/s for
/// one, two and three groups, alternated twice, idle host).
///
/// The AVX2 one-token kernel, forced on the same Zen 4 host (`sample --kernel avx2
/// --threads 1`, 64 greedy tokens, the same binary with a switch, three alternated
/// rounds): the 0.5B-shaped file 24.2–25.3 tok/s with [`prefetch_ahead`] → 44.0–46.4,
/// SmolLM2-135M Q4_1 98.9–112.7 → 140.5–152.9. Not measured on the Zen 1 host where
/// [`PREFETCH_BLOCKS`] was tuned, nor on an Intel CPU.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn prefetch_next_group_l2(
    dtype: DType,
    g: &Group,
    qp: *const u8,
    b: usize,
    bytes: usize,
) {
    let group_bytes = (g.qs.len() + g.d.len() + g.m.len()).next_multiple_of(64);
    let p = qp.wrapping_add(group_bytes);
    // `_mm_prefetch` is a hint (a safe function): it does not fault on any address.
    for l in (0..bytes).step_by(64) {
        _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(l).cast());
    }
    if b.is_multiple_of(4) {
        let at = b * 16 + group_bytes;
        _mm_prefetch::<_MM_HINT_T1>(g.d.as_ptr().wrapping_add(at).cast());
        if dtype == DType::Q4_1 {
            _mm_prefetch::<_MM_HINT_T1>(g.m.as_ptr().wrapping_add(at).cast());
        }
    }
}

#[inline(always)]
pub(super) fn f16_at(b: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
}

/// The eight 32-bit lanes summed (exact: integer addition).
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn hsum(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
    _mm_cvtsi128_si32(s)
}

/// Asks for the cache lines of the super-block at `blk + ahead` (the same place in the
/// next group), into L2 (`_MM_HINT_T1`): eight rows walked together are eight streams,
/// more than the hardware prefetcher follows. A hint; past the end of the matrix it is
/// dropped. Into L2 rather than L1: Q6_K `ffn_down` (896x4864) of the Qwen2.5-0.5B-shaped
/// file read 11.9–12.0 GB/s with `_MM_HINT_T0`, 17.2 with T1 (`benches/decode_profile.rs`,
/// alternated twice on the Zen 4 host); Q4_K 11.9–12.4 → 12.4–13.3.
#[inline(always)]
pub(super) fn prefetch_next_group(blk: *const u8, ahead: usize, bytes: usize) {
    let p = blk.wrapping_add(ahead);
    let mut at = 0;
    while at < bytes {
        // SAFETY: a prefetch never faults, whatever the address.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(at).cast()) };
        at += 64;
    }
}

/// Lane `r` of the result = the sum of the eight 32-bit lanes of `v[r]` (exact:
/// integer additions, in any order).
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn reduce8(v: &[__m256i; 8]) -> __m256i {
    let h01 = _mm256_hadd_epi32(v[0], v[1]);
    let h23 = _mm256_hadd_epi32(v[2], v[3]);
    let h45 = _mm256_hadd_epi32(v[4], v[5]);
    let h67 = _mm256_hadd_epi32(v[6], v[7]);
    // Per 128-bit half: [v0, v1, v2, v3] (resp. v4..v8) partial sums.
    let a = _mm256_hadd_epi32(h01, h23);
    let b = _mm256_hadd_epi32(h45, h67);
    _mm256_add_epi32(
        _mm256_permute2x128_si256(a, b, 0x20),
        _mm256_permute2x128_si256(a, b, 0x31),
    )
}

/// Lane `r` of the result = the sum of the four 32-bit lanes of `v[r]` (exact).
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn reduce8_128(v: &[__m128i; 8]) -> __m256i {
    let a = _mm_hadd_epi32(_mm_hadd_epi32(v[0], v[1]), _mm_hadd_epi32(v[2], v[3]));
    let b = _mm_hadd_epi32(_mm_hadd_epi32(v[4], v[5]), _mm_hadd_epi32(v[6], v[7]));
    _mm256_setr_m128i(a, b)
}

/// The eight f16 values at `p[r·stride]` (r = 0..8), as f32 (exact conversion).
///
/// # Safety
/// AVX2 and F16C must be available; every `p + r·stride .. + 2` must be readable.
#[target_feature(enable = "avx2,f16c")]
#[inline]
pub(super) unsafe fn f16x8(p: *const u8, stride: usize) -> __m256 {
    // SAFETY: the caller's bounds.
    let h: [u16; 8] =
        std::array::from_fn(|r| unsafe { p.add(r * stride).cast::<u16>().read_unaligned() });
    // SAFETY: `h` is 16 bytes.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(h.as_ptr().cast()) })
}

/// A Q4_K/Q5_K super-block's eight six-bit scales (i16 lanes 0..8) and mins (lanes
/// 8..16), unpacked with 32-bit masks (the same values as `scale_min_k4`).
///
/// # Safety
/// AVX2 must be available; `blk` must point at a whole super-block.
#[inline(always)]
pub(super) unsafe fn k4_scales_mins(blk: *const u8) -> __m256i {
    const K1: u32 = 0x3f3f_3f3f;
    const K2: u32 = 0x0f0f_0f0f;
    const K3: u32 = 0x0303_0303;
    // SAFETY: bytes 4..16 are inside the block.
    let (u0, u1, u2) = unsafe {
        (
            blk.add(4).cast::<u32>().read_unaligned(),
            blk.add(8).cast::<u32>().read_unaligned(),
            blk.add(12).cast::<u32>().read_unaligned(),
        )
    };
    // Bytes: scales 0..4 (s[j] & 63), scales 4..8, mins 0..4, mins 4..8.
    let sc03 = u0 & K1;
    let sc47 = (u2 & K2) | (((u0 >> 6) & K3) << 4);
    let mn03 = u1 & K1;
    let mn47 = ((u2 >> 4) & K2) | (((u1 >> 6) & K3) << 4);
    _mm256_cvtepu8_epi16(_mm_setr_epi32(
        sc03 as i32,
        sc47 as i32,
        mn03 as i32,
        mn47 as i32,
    ))
}

/// [`k4_group`]'s walk with the per-row integer step `block` (given the token's
/// super-block as `prep` lays it out once per super-block): the AVX2 and AVX-512
/// kernels share everything else, compiled into each caller's instruction set.
///
/// # Safety
/// AVX2, FMA and F16C must be available; `block` must be sound for a whole super-block.
#[inline(always)]
pub(super) unsafe fn k4_group_with<const FIVE: bool, S>(
    qs: &[u8],
    rb: usize,
    k: &Q8K,
    prep: impl Fn(*const i8) -> S,
    block: impl Fn(*const u8, &S, __m128i) -> (__m256i, __m128i),
) -> [f32; 8] {
    let bytes = if FIVE { Q5_K_BYTES } else { Q4_K_BYTES };
    let nb = rb / bytes;
    assert_eq!(rb, nb * bytes);
    assert!(qs.len() >= 8 * rb);
    assert!(k.q.len() >= nb * QK_K && k.d.len() >= nb && k.bsums.len() >= nb * 16);
    // The next group starts after eight rows, padded to 64 bytes (`Packed` layout).
    let ahead = (8 * rb).next_multiple_of(64);
    let mut acc = _mm256_setzero_ps();
    for b in 0..nb {
        // SAFETY: super-block b of every row and of the token is inside the slices
        // (asserted above).
        unsafe {
            let q8 = prep(k.q.as_ptr().add(b * QK_K));
            let bsp = k.bsums.as_ptr().add(b * 16);
            let bp = _mm_hadd_epi16(
                _mm_loadu_si128(bsp.cast()),
                _mm_loadu_si128(bsp.add(8).cast()),
            );
            let base = qs.as_ptr().add(b * bytes);
            let mut s = [_mm256_setzero_si256(); 8];
            let mut m = [_mm_setzero_si128(); 8];
            for r in 0..8 {
                prefetch_next_group(base.add(r * rb), ahead, bytes);
                (s[r], m[r]) = block(base.add(r * rb), &q8, bp);
            }
            let isum = _mm256_cvtepi32_ps(reduce8(&s));
            let msum = _mm256_cvtepi32_ps(reduce8_128(&m));
            let d = f16x8(base, rb);
            let dmin = f16x8(base.add(2), rb);
            let dx = _mm256_set1_ps(k.d[b]);
            acc = _mm256_add_ps(
                acc,
                _mm256_sub_ps(
                    _mm256_mul_ps(isum, _mm256_mul_ps(d, dx)),
                    _mm256_mul_ps(msum, _mm256_mul_ps(dmin, dx)),
                ),
            );
        }
    }
    let mut out = [0.0f32; 8];
    // SAFETY: `out` is 8 floats.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc) };
    out
}

/// [`q6_k_group`]'s walk with the per-row integer step `block`, shared by the AVX2
/// and AVX-512 kernels (compiled into each caller's instruction set).
///
/// # Safety
/// AVX2, FMA and F16C must be available; `block` must be sound for a whole super-block
/// and 256 codes.
#[inline(always)]
pub(super) unsafe fn q6_k_group_with(
    qs: &[u8],
    rb: usize,
    k: &Q8K,
    block: impl Fn(*const u8, *const i8, __m256i) -> __m256i,
) -> [f32; 8] {
    let nb = rb / Q6_K_BYTES;
    assert_eq!(rb, nb * Q6_K_BYTES);
    assert!(qs.len() >= 8 * rb);
    assert!(k.q.len() >= nb * QK_K && k.d.len() >= nb && k.bsums.len() >= nb * 16);
    // The next group starts after eight rows, padded to 64 bytes (`Packed` layout).
    let ahead = (8 * rb).next_multiple_of(64);
    let mut acc = _mm256_setzero_ps();
    for b in 0..nb {
        // SAFETY: super-block b of every row and of the token is inside the slices
        // (asserted above).
        unsafe {
            let q8 = k.q.as_ptr().add(b * QK_K);
            let bs = _mm256_loadu_si256(k.bsums.as_ptr().add(b * 16).cast());
            let base = qs.as_ptr().add(b * Q6_K_BYTES);
            let mut s = [_mm256_setzero_si256(); 8];
            for (r, sr) in s.iter_mut().enumerate() {
                prefetch_next_group(base.add(r * rb), ahead, Q6_K_BYTES);
                *sr = block(base.add(r * rb), q8, bs);
            }
            let isum = _mm256_cvtepi32_ps(reduce8(&s));
            let d = f16x8(base.add(208), rb);
            let dx = _mm256_set1_ps(k.d[b]);
            acc = _mm256_add_ps(acc, _mm256_mul_ps(isum, _mm256_mul_ps(d, dx)));
        }
    }
    let mut out = [0.0f32; 8];
    // SAFETY: `out` is 8 floats.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc) };
    out
}

/// The 32 unsigned five-bit codes (0..=31) of the Q5_1 block at `blk`, in value order:
/// the nibbles of bytes 8..24 with bit `j` of the `qh` word at bytes 4..8 as `+16`.
///
/// # Safety
/// AVX2 must be available; `blk` must point at a whole 24-byte block.
#[inline(always)]
unsafe fn q5_1_codes(blk: *const u8) -> __m256i {
    let m4 = _mm_set1_epi8(0x0F);
    // Byte j of the spread: byte j / 8 of qh, tested against bit j % 8.
    let spread = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3,
        3, 3,
    );
    let bits = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    // SAFETY: bytes 4..24 are inside the block.
    let (q, qh) = unsafe {
        (
            _mm_loadu_si128(blk.add(8).cast()),
            blk.add(4).cast::<i32>().read_unaligned(),
        )
    };
    let nib = _mm256_setr_m128i(
        _mm_and_si128(q, m4),
        _mm_and_si128(_mm_srli_epi16(q, 4), m4),
    );
    let h = _mm256_shuffle_epi8(_mm256_set1_epi32(qh), spread);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(h, bits), bits);
    _mm256_or_si256(nib, _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
}

/// [`q5_1_group`]'s code, compiled into each caller's instruction set (the AVX-512
/// caller gets sixteen more vector registers for the same instructions).
///
/// # Safety
/// AVX2, FMA and F16C must be available.
#[inline(always)]
pub(super) unsafe fn q5_1_group_body(qs: &[u8], rb: usize, a: &QuantizedActs) -> [f32; 8] {
    let nb = rb / 24;
    assert_eq!(rb, nb * 24);
    assert!(qs.len() >= 8 * rb);
    assert!(a.q.len() >= nb * 32 && a.d.len() >= nb && a.s.len() >= nb);
    let ones = _mm256_set1_epi16(1);
    // The next group starts after eight rows, padded to 64 bytes (`Packed` layout).
    let ahead = (8 * rb).next_multiple_of(64);
    let mut acc = _mm256_setzero_ps();
    for b in 0..nb {
        // SAFETY: block b of every row and of the token is inside the slices (asserted
        // above).
        unsafe {
            let x = _mm256_loadu_si256(a.q.as_ptr().add(32 * b).cast());
            let base = qs.as_ptr().add(24 * b);
            let mut s = [_mm256_setzero_si256(); 8];
            for (r, sr) in s.iter_mut().enumerate() {
                let blk = base.add(r * rb);
                // Eight 24-byte-step streams are too many for the hardware
                // prefetcher: ask for the same place in the next group (a hint;
                // past the end of the matrix it is dropped).
                _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(ahead).cast());
                let codes = q5_1_codes(blk);
                // Pair sums ≤ 2·31·127: no saturation.
                *sr = _mm256_madd_epi16(_mm256_maddubs_epi16(codes, x), ones);
            }
            let isum = _mm256_cvtepi32_ps(reduce8(&s));
            // The eight rows' (d, m) f16 pairs as dwords, then d and m apart (in
            // registers: a store of eight u16 read back as one vector would stall).
            let dm = _mm256_setr_epi32(
                base.cast::<i32>().read_unaligned(),
                base.add(rb).cast::<i32>().read_unaligned(),
                base.add(2 * rb).cast::<i32>().read_unaligned(),
                base.add(3 * rb).cast::<i32>().read_unaligned(),
                base.add(4 * rb).cast::<i32>().read_unaligned(),
                base.add(5 * rb).cast::<i32>().read_unaligned(),
                base.add(6 * rb).cast::<i32>().read_unaligned(),
                base.add(7 * rb).cast::<i32>().read_unaligned(),
            );
            // packus per 128-bit half: [d0..4, m0..4 | d4..8, m4..8] (values ≤ 0xFFFF:
            // no saturation), then the halves' quarters in order.
            let dm = _mm256_permute4x64_epi64(
                _mm256_packus_epi32(
                    _mm256_and_si256(dm, _mm256_set1_epi32(0xFFFF)),
                    _mm256_srli_epi32(dm, 16),
                ),
                0b11_01_10_00,
            );
            let dw = _mm256_cvtph_ps(_mm256_castsi256_si128(dm));
            let mw = _mm256_cvtph_ps(_mm256_extracti128_si256(dm, 1));
            let dx = _mm256_set1_ps(a.d[b]);
            let sx = _mm256_set1_ps(a.s[b]);
            acc = _mm256_add_ps(
                acc,
                _mm256_add_ps(
                    _mm256_mul_ps(isum, _mm256_mul_ps(dw, dx)),
                    _mm256_mul_ps(mw, sx),
                ),
            );
        }
    }
    let mut out = [0.0f32; 8];
    // SAFETY: `out` is 8 floats.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), acc) };
    out
}
