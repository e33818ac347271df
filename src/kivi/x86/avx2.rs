//! The `avx2` variant of the fused KIVI attention kernels ([`crate::kivi::dot_codes_groups`],
//! [`crate::kivi::axpy_codes_rows`] and their multi-query forms; AVX2 + FMA + F16C, the
//! [`crate::kivi::KvKernel`] for x86_64 CPUs without AVX-512), for the head dims of
//! [`takes`]. The scheme of the AVX-512 ones on 8 lanes: codes read as they lie, 32 bytes
//! at a time (`RPL = 32 / BPR` whole rows per load, or `BPR / 32` loads per row); code
//! `k` of every dword comes out with one shift, then a mask and `vcvtdq2ps` (int8, int4)
//! or one `vpermps` from the table `[0, 1, 2, 3, 0, 1, 2, 3]` (int2: the 8-entry lookup
//! reads a lane's low 3 bits, and the table repeats every 4). Lane `i` of extract `k` of
//! load `l` is element `(8l + i % LPR)·E + k` of row `i / LPR` (`LPR = 8 / RPL`); the
//! query is gathered into that order once per K group, the value accumulators put back
//! once per call.
//!
//! * Keys: blocks of 8 rows reduced by `vhaddps` (a row's lanes always go through the
//!   same adds, wherever the row sits) and one lane permutation.
//! * Values: weights `p_r s_r` and bias `Σ p_r z_r` eight rows at a time (F16C), spread
//!   over the lanes with one `vpermps` per vector of rows.
//!
//! Same products as the portable kernels; only the order of the sums differs.

use crate::kivi::{KRun, VRun};
use half::f16;
use std::arch::x86_64::*;

/// Whether these kernels take head dim `hd` (those of the AVX-512 variant).
#[inline]
pub(in crate::kivi) fn takes(hd: usize) -> bool {
    super::takes(hd)
}

/// Bytes per row of `HD` codes of width `W`.
#[inline(always)]
const fn bpr<const W: u8, const HD: usize>() -> usize {
    HD * W as usize / 8
}

/// Rows per 32-byte load (1 when a row takes one or more whole loads).
#[inline(always)]
const fn rpl<const W: u8, const HD: usize>() -> usize {
    let b = bpr::<W, HD>();
    if b >= 32 {
        1
    } else {
        32 / b
    }
}

/// 32-byte loads per row (1 when several rows share a load).
#[inline(always)]
const fn loads<const W: u8, const HD: usize>() -> usize {
    let b = bpr::<W, HD>();
    if b >= 32 {
        b / 32
    } else {
        1
    }
}

/// Codes per dword.
#[inline(always)]
const fn per_dword<const W: u8>() -> usize {
    32 / W as usize
}

/// Lane-order vectors per row: `loads · E` (at most 32 for the head dims taken).
#[inline(always)]
const fn nt<const W: u8, const HD: usize>() -> usize {
    loads::<W, HD>() * per_dword::<W>()
}

/// Which element of its row lane `i` of extract `k` of load `l` holds.
#[inline(always)]
const fn lane_element<const W: u8, const HD: usize>(l: usize, k: usize, i: usize) -> usize {
    let lpr = 8 / rpl::<W, HD>();
    (l * 8 + i % lpr) * per_dword::<W>() + k
}

/// `perm[8t + i]`: the query element that lane `i` of lane-order vector `t = l·E + k`
/// takes. Built at compile time per `(W, HD)`.
const fn perm<const W: u8, const HD: usize>() -> [u16; 256] {
    let mut p = [0u16; 256];
    let e = per_dword::<W>();
    let mut t = 0;
    while t < nt::<W, HD>() {
        let mut i = 0;
        while i < 8 {
            p[8 * t + i] = lane_element::<W, HD>(t / e, t % e, i) as u16;
            i += 1;
        }
        t += 1;
    }
    p
}

/// Extract `k` of every dword of `d` as f32 (see the module docs).
#[target_feature(enable = "avx2")]
#[inline]
fn extract<const W: u8>(d: __m256i, k: usize) -> __m256 {
    let x = if k == 0 {
        d
    } else {
        _mm256_srl_epi32(d, _mm_cvtsi32_si128((W as usize * k) as i32))
    };
    match W {
        2 => _mm256_permutevar8x32_ps(_mm256_setr_ps(0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0), x),
        _ => {
            let x = if k + 1 == per_dword::<W>() {
                x
            } else {
                _mm256_and_si256(x, _mm256_set1_epi32((1i32 << W) - 1))
            };
            _mm256_cvtepi32_ps(x)
        }
    }
}

/// 32 bytes at `p`, of which only the first `n` are read; the rest are zero.
///
/// # Safety
/// AVX must be available and `p..p + min(n, 32)` readable.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn load(p: *const u8, n: usize) -> __m256i {
    if n >= 32 {
        // SAFETY: 32 bytes readable (caller); unaligned load.
        unsafe { _mm256_loadu_si256(p.cast()) }
    } else {
        let mut b = [0u8; 32];
        // SAFETY: `n < 32` bytes readable (caller) into a 32-byte buffer; then an
        // unaligned load of the buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(p, b.as_mut_ptr(), n);
            _mm256_loadu_si256(b.as_ptr().cast())
        }
    }
}

/// `8 / rpl` vectors of partial sums of 8 rows (rows `v·rpl..(v + 1)·rpl` in vector
/// `v`, `8 / rpl` consecutive lanes each) → one vector whose lane `r` is row `r`'s
/// total. Each row's lanes are added pairwise by `vhaddps` (`((l0 + l1) + (l2 + l3))
/// + ((l4 + l5) + (l6 + l7))` for 8 lanes), the same adds for every row.
#[target_feature(enable = "avx2")]
#[inline]
fn reduce(v: &[__m256; 8], rpl: usize) -> __m256 {
    match rpl {
        1 => {
            let h01 = _mm256_hadd_ps(v[0], v[1]);
            let h23 = _mm256_hadd_ps(v[2], v[3]);
            let h45 = _mm256_hadd_ps(v[4], v[5]);
            let h67 = _mm256_hadd_ps(v[6], v[7]);
            // Rows 0..4 in lanes 0..4 (their low halves) and 4..8 (high halves).
            let a = _mm256_hadd_ps(h01, h23);
            let b = _mm256_hadd_ps(h45, h67);
            _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(a, b),
                _mm256_permute2f128_ps::<0x31>(a, b),
            )
        }
        2 => {
            // Lanes hold rows [0, 2, 4, 6, 1, 3, 5, 7].
            let t = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
            _mm256_permutevar8x32_ps(t, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
        }
        4 => {
            // Lanes hold rows [0, 1, 4, 5, 2, 3, 6, 7].
            let t = _mm256_hadd_ps(v[0], v[1]);
            _mm256_permutevar8x32_ps(t, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7))
        }
        _ => v[0],
    }
}

/// Partial sums of the vector of rows at `p` (`n` valid bytes; the rest zero):
/// `Σ_k extract_k · qv[l·E + k]` over the row's loads `l`.
///
/// # Safety
/// As [`load`], for every load: `p..p + n` readable.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn vec_dot<const W: u8, const HD: usize>(
    p: *const u8,
    n: usize,
    qv: &[__m256; 32],
) -> __m256 {
    let mut acc = _mm256_setzero_ps();
    for l in 0..loads::<W, HD>() {
        // SAFETY: bytes [32l, min(n, 32l + 32)) of the vector are readable.
        let d = unsafe { load(p.add(32 * l), n.saturating_sub(32 * l).min(32)) };
        for k in 0..per_dword::<W>() {
            acc = _mm256_fmadd_ps(extract::<W>(d, k), qv[l * per_dword::<W>() + k], acc);
        }
    }
    acc
}

/// Scores of rows `[a, b)` of `codes` against lane-order query `qv` plus `bias` into
/// `o[a..b]`, in blocks of 8 rows from `a` (the last pads with zero bytes).
///
/// # Safety
/// AVX2/FMA must be available; `a ≤ b ≤ codes.len() / bpr`, `b ≤ o.len()`.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn score_rows<const W: u8, const HD: usize>(
    codes: &[u8],
    (a, b): (usize, usize),
    qv: &[__m256; 32],
    bias: f32,
    o: &mut [f32],
) {
    let (bpr, rpl) = (bpr::<W, HD>(), rpl::<W, HD>());
    debug_assert!(a <= b && b * bpr <= codes.len() && b <= o.len());
    let nv = 8 / rpl;
    let bv = _mm256_set1_ps(bias);
    let base = codes.as_ptr();
    let mut r0 = a;
    while r0 < b {
        let m = (b - r0).min(8);
        let mut part = [_mm256_setzero_ps(); 8];
        for (v, pv) in part.iter_mut().enumerate().take(nv) {
            let r = r0 + v * rpl;
            if r < r0 + m {
                let n = ((r0 + m - r) * bpr).min(rpl * bpr);
                // SAFETY: bytes [r·bpr, r·bpr + n) lie inside `codes` (r0 + m ≤ b).
                *pv = unsafe { vec_dot::<W, HD>(base.add(r * bpr), n, qv) };
            }
        }
        let s = _mm256_add_ps(reduce(&part, rpl), bv);
        if m == 8 {
            // SAFETY: o[r0..r0 + 8] is in bounds (r0 + 8 ≤ b ≤ o.len()); unaligned.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr().add(r0), s) };
        } else {
            let mut buf = [0.0f32; 8];
            // SAFETY: `buf` holds 8 floats; unaligned store.
            unsafe { _mm256_storeu_ps(buf.as_mut_ptr(), s) };
            o[r0..b].copy_from_slice(&buf[..m]);
        }
        r0 += m;
    }
}

/// Folds K group `k`'s parameters into query `qj` (`HD` floats): `qs = q ⊙ s` (natural
/// order, the portable fold's products) gathered into lane order `qv` with the
/// compile-time [`perm`] (`qs`, `lanes`: scratch, declared once per call); returns `bias = Σ_c q_c z_c` (eight lanes of FMAs, then a
/// fixed tree).
///
/// # Safety
/// AVX2, FMA and F16C must be available; `scale`/`zero` hold `(k + 1)·HD` values.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn fold_group<const W: u8, const HD: usize>(
    qj: &[f32],
    (scale, zero): (&[f16], &[f16]),
    k: usize,
    (qs, lanes): (&mut [f32; 256], &mut [f32; 256]),
    qv: &mut [__m256; 32],
) -> f32 {
    debug_assert!(qj.len() == HD && scale.len() >= (k + 1) * HD && zero.len() >= (k + 1) * HD);
    let perm = const { perm::<W, HD>() };
    let (sp, zp) = (scale.as_ptr().cast::<u16>(), zero.as_ptr().cast::<u16>());
    let mut zacc = _mm256_setzero_ps();
    for v in 0..HD / 8 {
        // SAFETY: qj[8v..8v + 8] and group k's parameters [k·HD + 8v..][..8] are in
        // bounds (caller); qs holds 256 ≥ HD floats; unaligned.
        unsafe {
            let qn = _mm256_loadu_ps(qj.as_ptr().add(8 * v));
            let sv = _mm256_cvtph_ps(_mm_loadu_si128(sp.add(k * HD + 8 * v).cast()));
            let zv = _mm256_cvtph_ps(_mm_loadu_si128(zp.add(k * HD + 8 * v).cast()));
            _mm256_storeu_ps(qs.as_mut_ptr().add(8 * v), _mm256_mul_ps(qn, sv));
            zacc = _mm256_fmadd_ps(qn, zv, zacc);
        }
    }
    let nl = 8 * nt::<W, HD>();
    for (x, &e) in lanes[..nl].iter_mut().zip(&perm[..nl]) {
        *x = qs[e as usize];
    }
    for (t, x) in qv.iter_mut().enumerate().take(nt::<W, HD>()) {
        // SAFETY: lanes[8t..8t + 8] is in bounds (8t + 8 ≤ nl ≤ 256).
        *x = unsafe { _mm256_loadu_ps(lanes.as_ptr().add(8 * t)) };
    }
    hsum(zacc)
}

/// The sum of a vector's lanes, `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`.
#[target_feature(enable = "avx")]
#[inline]
fn hsum(v: __m256) -> f32 {
    let mut l = [0.0f32; 8];
    // SAFETY: `l` holds 8 floats; unaligned store.
    unsafe { _mm256_storeu_ps(l.as_mut_ptr(), v) };
    ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))
}

/// The AVX2 twin of [`crate::kivi::dot_codes_groups`] (same arguments and contract): per
/// group, `qs = q ⊙ s` (natural order, the portable fold's products), gathered into
/// lane order with the compile-time [`perm`], `bias = Σ_c q_c z_c`, then
/// [`score_rows`] over the group's rows.
///
/// # Safety
/// AVX2, FMA and F16C must be available (run-time detection,
/// [`crate::kivi::KvKernel`]). Lengths are checked by assertions.
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::kivi) unsafe fn dot_codes_groups<const W: u8, const HD: usize>(
    run: &KRun<'_>,
    q: &[f32],
    out: &mut [f32],
    stride: usize,
) {
    let KRun {
        codes,
        scale,
        zero,
        group,
        offset,
        ..
    } = *run;
    let nq = q.len() / HD;
    let bpr = bpr::<W, HD>();
    assert!(takes(HD) && q.len() == nq * HD && nt::<W, HD>() <= 32);
    assert!(group > 0 && offset < group);
    let rows = codes.len() / bpr;
    assert_eq!(codes.len(), rows * bpr);
    if rows == 0 || nq == 0 {
        return;
    }
    let groups = (offset + rows).div_ceil(group);
    assert!(scale.len() >= groups * HD && zero.len() >= groups * HD);
    assert!(out.len() >= (nq - 1) * stride + rows);
    let (mut qs, mut lanes) = ([0.0f32; 256], [0.0f32; 256]);
    let mut qv = [_mm256_setzero_ps(); 32];
    for j in 0..nq {
        let qj = &q[j * HD..(j + 1) * HD];
        let o = &mut out[j * stride..j * stride + rows];
        for k in 0..groups {
            let a = (k * group).saturating_sub(offset);
            let b = ((k + 1) * group - offset).min(rows);
            // SAFETY: group k's parameters are in bounds (assert above).
            let bias = unsafe {
                fold_group::<W, HD>(qj, (scale, zero), k, (&mut qs, &mut lanes), &mut qv)
            };
            // SAFETY: a ≤ b ≤ rows; `codes` holds rows · bpr bytes, `o` rows floats.
            unsafe { score_rows::<W, HD>(codes, (a, b), &qv, bias, o) };
        }
    }
}

/// `acc += extract_k · wv` for every extract of the vector of rows at `p` (`n` valid
/// bytes; the rest zero).
///
/// # Safety
/// As [`vec_dot`].
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn vec_axpy<const W: u8, const HD: usize>(
    p: *const u8,
    n: usize,
    wv: __m256,
    acc: &mut [__m256; 32],
) {
    for l in 0..loads::<W, HD>() {
        // SAFETY: bytes [32l, min(n, 32l + 32)) of the vector are readable.
        let d = unsafe { load(p.add(32 * l), n.saturating_sub(32 * l).min(32)) };
        for k in 0..per_dword::<W>() {
            let a = &mut acc[l * per_dword::<W>() + k];
            *a = _mm256_fmadd_ps(extract::<W>(d, k), wv, *a);
        }
    }
}

/// The AVX2 twin of [`crate::kivi::axpy_codes_rows`] (same arguments and contract).
///
/// # Safety
/// AVX2, FMA and F16C must be available (run-time detection,
/// [`crate::kivi::KvKernel`]). Lengths are checked by assertions.
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::kivi) unsafe fn axpy_codes_rows<const W: u8, const HD: usize>(
    run: &VRun<'_>,
    p: &[f32],
    stride: usize,
    acc: &mut [f32],
    bias: &mut [f32],
) {
    let VRun {
        codes, scale, zero, ..
    } = *run;
    let nq = bias.len();
    let (bpr, rpl) = (bpr::<W, HD>(), rpl::<W, HD>());
    assert!(takes(HD) && acc.len() == nq * HD && nt::<W, HD>() <= 32);
    let rows = scale.len();
    assert!(zero.len() == rows && codes.len() == rows * bpr);
    if rows == 0 || nq == 0 {
        return;
    }
    assert!(p.len() >= (nq - 1) * stride + rows);
    let base = codes.as_ptr();
    let nv = 8 / rpl;
    let spread = spread::<W, HD>();
    for (j, (a, bj)) in acc.chunks_exact_mut(HD).zip(bias.iter_mut()).enumerate() {
        let pj = &p[j * stride..j * stride + rows];
        let mut sums = [_mm256_setzero_ps(); 32];
        let mut zsum = _mm256_setzero_ps();
        let mut r0 = 0;
        while r0 < rows {
            let m = (rows - r0).min(8);
            // SAFETY: rows r0..r0 + m of `pj`, `scale`, `zero` are in bounds.
            let (pv, (sv, zv)) = unsafe {
                (
                    load_f32(&pj[r0..r0 + m]),
                    load_params(&scale[r0..r0 + m], &zero[r0..r0 + m]),
                )
            };
            zsum = _mm256_fmadd_ps(pv, zv, zsum);
            let w = _mm256_mul_ps(pv, sv);
            for (v, idx) in spread.iter().enumerate().take(nv) {
                let r = r0 + v * rpl;
                if r >= r0 + m {
                    break;
                }
                let n = ((r0 + m - r) * bpr).min(rpl * bpr);
                let wv = _mm256_permutevar8x32_ps(w, *idx);
                // SAFETY: bytes [r·bpr, r·bpr + n) lie inside `codes` (r0 + m ≤ rows).
                unsafe { vec_axpy::<W, HD>(base.add(r * bpr), n, wv, &mut sums) };
            }
            r0 += m;
        }
        add_row_sets::<W, HD>(&sums, a);
        *bj += hsum(zsum);
    }
}

/// `spread[v]`: the `vpermps` index that gives lane `i` the weight of row
/// `v·rpl + i / lpr` of a block of 8 rows.
#[target_feature(enable = "avx")]
#[inline]
fn spread<const W: u8, const HD: usize>() -> [__m256i; 8] {
    let rpl = rpl::<W, HD>();
    let lpr = 8 / rpl;
    let mut spread = [_mm256_setzero_si256(); 8];
    for (v, sv) in spread.iter_mut().enumerate().take(8 / rpl) {
        let mut idx = [0i32; 8];
        for (i, x) in idx.iter_mut().enumerate() {
            *x = (v * rpl + i / lpr) as i32;
        }
        // SAFETY: `idx` holds 8 i32; unaligned load.
        *sv = unsafe { _mm256_loadu_si256(idx.as_ptr().cast()) };
    }
    spread
}

/// Up to 8 floats as a vector, zero-padded.
///
/// # Safety
/// AVX must be available.
#[target_feature(enable = "avx")]
#[inline]
unsafe fn load_f32(x: &[f32]) -> __m256 {
    if x.len() >= 8 {
        // SAFETY: 8 floats in bounds; unaligned load.
        unsafe { _mm256_loadu_ps(x.as_ptr()) }
    } else {
        let mut b = [0.0f32; 8];
        b[..x.len()].copy_from_slice(x);
        // SAFETY: `b` holds 8 floats; unaligned load.
        unsafe { _mm256_loadu_ps(b.as_ptr()) }
    }
}

/// Up to 8 rows' `(scale, zero)` (stored f16) as f32 vectors, zero-padded.
///
/// # Safety
/// AVX and F16C must be available.
#[target_feature(enable = "avx,f16c")]
#[inline]
unsafe fn load_params(scale: &[f16], zero: &[f16]) -> (__m256, __m256) {
    let m = scale.len().min(8);
    debug_assert!(zero.len() >= m);
    let (sp, zp) = (scale.as_ptr().cast::<u16>(), zero.as_ptr().cast::<u16>());
    // SAFETY: `m` values of each are in bounds; a partial block is copied into
    // zero-padded buffers first; unaligned loads.
    unsafe {
        if m == 8 {
            (
                _mm256_cvtph_ps(_mm_loadu_si128(sp.cast())),
                _mm256_cvtph_ps(_mm_loadu_si128(zp.cast())),
            )
        } else {
            let (mut sb, mut zb) = ([0u16; 8], [0u16; 8]);
            std::ptr::copy_nonoverlapping(sp, sb.as_mut_ptr(), m);
            std::ptr::copy_nonoverlapping(zp, zb.as_mut_ptr(), m);
            (
                _mm256_cvtph_ps(_mm_loadu_si128(sb.as_ptr().cast())),
                _mm256_cvtph_ps(_mm_loadu_si128(zb.as_ptr().cast())),
            )
        }
    }
}

/// `a[e] += Σ_s` (row set `s`'s lanes holding element `e`), in row-set order: lane `i`
/// of `sums[l·E + k]` is element `lane_element(l, k, i)` of row set `i / lpr`.
#[target_feature(enable = "avx")]
#[inline]
fn add_row_sets<const W: u8, const HD: usize>(sums: &[__m256; 32], a: &mut [f32]) {
    let (rpl, e) = (rpl::<W, HD>(), per_dword::<W>());
    let lpr = 8 / rpl;
    let mut lanes = [0.0f32; 8];
    for l in 0..loads::<W, HD>() {
        for k in 0..e {
            // SAFETY: `lanes` holds 8 floats; unaligned store.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), sums[l * e + k]) };
            for i in 0..lpr {
                let mut t = lanes[i];
                for s in 1..rpl {
                    t += lanes[s * lpr + i];
                }
                a[lane_element::<W, HD>(l, k, i)] += t;
            }
        }
    }
}

// -----------------------------------------------------------------------------------
// Multi-query forms: the `G` query heads of one KV head take each 32-byte load of
// codes, and each of its extracts, once. Per head the operations and their order are
// exactly the single-query kernels' above (the same FMA chain per lane, the same
// `reduce`, the same row-set sums), so every head's result equals theirs bit for bit.
// -----------------------------------------------------------------------------------

/// [`vec_dot`] of two vectors of rows (at `p0`, `p1`, with `n0`, `n1` valid bytes) for
/// `G` lane-order queries: one load and one extract per code word, then `G` FMAs, so
/// `2G` independent chains are in flight; head `g`'s chain for each vector is exactly
/// [`vec_dot`]'s with `qv[g]`.
///
/// # Safety
/// As [`vec_dot`], for both vectors (`n = 0`: nothing is read, the vector is zero).
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn vec_dot_pair_multi<const W: u8, const HD: usize, const G: usize>(
    (p0, n0): (*const u8, usize),
    (p1, n1): (*const u8, usize),
    qv: &[[__m256; 32]; G],
) -> ([__m256; G], [__m256; G]) {
    let mut acc0 = [_mm256_setzero_ps(); G];
    let mut acc1 = [_mm256_setzero_ps(); G];
    for l in 0..loads::<W, HD>() {
        // SAFETY: bytes [32l, min(n, 32l + 32)) of each vector are readable (none when
        // that is empty: `load` copies 0 bytes).
        let (d0, d1) = unsafe {
            (
                load(p0.wrapping_add(32 * l), n0.saturating_sub(32 * l).min(32)),
                load(p1.wrapping_add(32 * l), n1.saturating_sub(32 * l).min(32)),
            )
        };
        for k in 0..per_dword::<W>() {
            let (x0, x1) = (extract::<W>(d0, k), extract::<W>(d1, k));
            let t = l * per_dword::<W>() + k;
            for ((a0, a1), q) in acc0.iter_mut().zip(acc1.iter_mut()).zip(qv) {
                *a0 = _mm256_fmadd_ps(x0, q[t], *a0);
                *a1 = _mm256_fmadd_ps(x1, q[t], *a1);
            }
        }
    }
    (acc0, acc1)
}

/// [`score_rows`] for `G` queries: head `g`'s scores of rows `[a, b)` go to
/// `out[g·stride + a..g·stride + b]`.
///
/// # Safety
/// AVX2/FMA must be available; `a ≤ b ≤ codes.len() / bpr`,
/// `(G − 1)·stride + b ≤ out.len()`.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn score_rows_multi<const W: u8, const HD: usize, const G: usize>(
    codes: &[u8],
    (a, b): (usize, usize),
    qv: &[[__m256; 32]; G],
    bias: &[f32; G],
    out: &mut [f32],
    stride: usize,
) {
    let (bpr, rpl) = (bpr::<W, HD>(), rpl::<W, HD>());
    assert!(a <= b && b * bpr <= codes.len() && (G - 1) * stride + b <= out.len());
    // Vectors per block: 8 / rpl, even for every shape `takes` accepts (rpl ≤ 4).
    let nv = 8 / rpl;
    let base = codes.as_ptr();
    let mut r0 = a;
    while r0 < b {
        let m = (b - r0).min(8);
        // The vector of rows starting at r: its pointer and valid bytes (none past
        // the block's last row, whose lanes then stay zero as in `score_rows`).
        let vector = |r: usize| {
            if r < r0 + m {
                (
                    base.wrapping_add(r * bpr),
                    ((r0 + m - r) * bpr).min(rpl * bpr),
                )
            } else {
                (base, 0)
            }
        };
        let mut part = [[_mm256_setzero_ps(); 8]; G];
        for v in (0..nv).step_by(2) {
            let r = r0 + v * rpl;
            if r >= r0 + m {
                break;
            }
            // SAFETY: `vector` gives bytes [r·bpr, r·bpr + n) inside `codes`
            // (r0 + m ≤ b, b·bpr ≤ len), or n = 0.
            let (s0, s1) =
                unsafe { vec_dot_pair_multi::<W, HD, G>(vector(r), vector(r + rpl), qv) };
            for ((pg, s0), s1) in part.iter_mut().zip(s0).zip(s1) {
                pg[v] = s0;
                pg[v + 1] = s1;
            }
        }
        for (g, pg) in part.iter().enumerate() {
            let s = _mm256_add_ps(reduce(pg, rpl), _mm256_set1_ps(bias[g]));
            let o = &mut out[g * stride + r0..g * stride + r0 + m];
            if m == 8 {
                // SAFETY: `o` holds 8 floats; unaligned store.
                unsafe { _mm256_storeu_ps(o.as_mut_ptr(), s) };
            } else {
                let mut buf = [0.0f32; 8];
                // SAFETY: `buf` holds 8 floats; unaligned store.
                unsafe { _mm256_storeu_ps(buf.as_mut_ptr(), s) };
                o.copy_from_slice(&buf[..m]);
            }
        }
        r0 += m;
    }
}

/// [`dot_codes_groups`] for exactly `G` queries (`q`: `(G, HD)`), each code unpacked
/// once for all of them. Per group every head is folded by [`fold_group`], as
/// [`dot_codes_groups`] does it, so head `g`'s scores equal its bit for bit.
///
/// # Safety
/// As [`dot_codes_groups`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::kivi) unsafe fn dot_codes_groups_multi<
    const W: u8,
    const HD: usize,
    const G: usize,
>(
    run: &KRun<'_>,
    q: &[f32],
    out: &mut [f32],
    stride: usize,
) {
    let KRun {
        codes,
        scale,
        zero,
        group,
        offset,
        ..
    } = *run;
    let bpr = bpr::<W, HD>();
    assert!(takes(HD) && G > 0 && q.len() == G * HD && nt::<W, HD>() <= 32);
    assert!(group > 0 && offset < group);
    let rows = codes.len() / bpr;
    assert_eq!(codes.len(), rows * bpr);
    if rows == 0 {
        return;
    }
    let groups = (offset + rows).div_ceil(group);
    assert!(scale.len() >= groups * HD && zero.len() >= groups * HD);
    assert!(out.len() >= (G - 1) * stride + rows);
    let (mut qs, mut lanes) = ([0.0f32; 256], [0.0f32; 256]);
    let mut qv = [[_mm256_setzero_ps(); 32]; G];
    let mut bias = [0.0f32; G];
    for k in 0..groups {
        let a = (k * group).saturating_sub(offset);
        let b = ((k + 1) * group - offset).min(rows);
        for (j, (qvj, bj)) in qv.iter_mut().zip(bias.iter_mut()).enumerate() {
            let qj = &q[j * HD..(j + 1) * HD];
            // SAFETY: group k's parameters are in bounds (assert above).
            *bj = unsafe { fold_group::<W, HD>(qj, (scale, zero), k, (&mut qs, &mut lanes), qvj) };
        }
        // SAFETY: a ≤ b ≤ rows; `codes` holds rows · bpr bytes; out ≥ (G − 1)·stride +
        // rows.
        unsafe { score_rows_multi::<W, HD, G>(codes, (a, b), &qv, &bias, out, stride) };
    }
}

/// Rows per super-block of [`axpy_codes_rows_multi`]: the weights `p_jr s_r` of this
/// many rows of every head, already spread over the lanes of each vector of rows, are
/// computed once into a stack buffer (`2G` KiB).
const SUPER: usize = 64;

/// Extracts per pass of [`axpy_codes_rows_multi`] for `G` heads: its `G × chunk`
/// accumulators stay in registers (at most 12 of the 16).
const fn chunk<const G: usize>() -> usize {
    if G <= 1 {
        8
    } else if G <= 3 {
        4
    } else if G <= 6 {
        2
    } else {
        1
    }
}

/// `acc[g][i] += extract_{t0 + i} · wv[g]` for `i < c` and every head `g`, for the
/// vector of rows at `p` (`n` valid bytes; the rest zero): extracts `t0..t0 + c` of
/// the vector, each computed once.
///
/// # Safety
/// As [`vec_dot`]; `t0 + c ≤ nt`, `c ≤ 8`.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn vec_axpy_chunk<const W: u8, const HD: usize, const G: usize>(
    p: *const u8,
    n: usize,
    (t0, c): (usize, usize),
    wv: &[__m256; G],
    acc: &mut [[__m256; 8]; G],
) {
    let e = per_dword::<W>();
    let mut d = _mm256_setzero_si256();
    for i in 0..c {
        let (l, k) = ((t0 + i) / e, (t0 + i) % e);
        if i == 0 || k == 0 {
            // SAFETY: bytes [32l, min(n, 32l + 32)) of the vector are readable.
            d = unsafe { load(p.wrapping_add(32 * l), n.saturating_sub(32 * l).min(32)) };
        }
        let x = extract::<W>(d, k);
        for (a, w) in acc.iter_mut().zip(wv) {
            a[i] = _mm256_fmadd_ps(x, *w, a[i]);
        }
    }
}

/// [`axpy_codes_rows`] for exactly `G` queries (`p` rows `g·stride..`, `acc`:
/// `(G, HD)`, `bias`: `G`), each code extract computed once for all of them. Per
/// super-block of rows the weights of every head are computed once (as
/// `axpy_codes_rows` does, eight rows at a time); then the extracts are taken in chunks
/// whose accumulators for all `G` heads stay in registers. Each accumulator receives
/// exactly `axpy_codes_rows`'s FMAs in its order (rows in order), so head `g`'s result
/// equals it bit for bit.
///
/// # Safety
/// As [`axpy_codes_rows`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(in crate::kivi) unsafe fn axpy_codes_rows_multi<
    const W: u8,
    const HD: usize,
    const G: usize,
>(
    run: &VRun<'_>,
    p: &[f32],
    stride: usize,
    acc: &mut [f32],
    bias: &mut [f32],
) {
    let VRun {
        codes, scale, zero, ..
    } = *run;
    let (bpr, rpl) = (bpr::<W, HD>(), rpl::<W, HD>());
    let nt = nt::<W, HD>();
    assert!(takes(HD) && G > 0 && bias.len() == G && acc.len() == G * HD && nt <= 32);
    let rows = scale.len();
    assert!(zero.len() == rows && codes.len() == rows * bpr);
    if rows == 0 {
        return;
    }
    assert!(p.len() >= (G - 1) * stride + rows);
    let base = codes.as_ptr();
    let nv = 8 / rpl;
    // Both powers of two (nt a multiple of 4), so chunks tile the extracts.
    let c = chunk::<G>().min(nt);
    let spread = spread::<W, HD>();
    let mut sums = [[_mm256_setzero_ps(); 32]; G];
    let mut zsum = [_mm256_setzero_ps(); G];
    // wbuf[8·blk + v][g]: head g's weights of vector v of block blk, spread.
    let mut wbuf = [[_mm256_setzero_ps(); G]; SUPER];
    let mut s0 = 0;
    while s0 < rows {
        let blocks = (rows - s0).min(SUPER).div_ceil(8);
        for blk in 0..blocks {
            let r0 = s0 + 8 * blk;
            let m = (rows - r0).min(8);
            // SAFETY: rows r0..r0 + m of `scale`, `zero`, and of every head's `p`
            // (assert above), are in bounds.
            let (sv, zv) = unsafe { load_params(&scale[r0..r0 + m], &zero[r0..r0 + m]) };
            for (j, zj) in zsum.iter_mut().enumerate() {
                // SAFETY: as above.
                let pv = unsafe { load_f32(&p[j * stride + r0..j * stride + r0 + m]) };
                *zj = _mm256_fmadd_ps(pv, zv, *zj);
                let w = _mm256_mul_ps(pv, sv);
                for (v, idx) in spread.iter().enumerate().take(nv) {
                    wbuf[8 * blk + v][j] = _mm256_permutevar8x32_ps(w, *idx);
                }
            }
        }
        for t0 in (0..nt).step_by(c) {
            let mut regs = [[_mm256_setzero_ps(); 8]; G];
            for (r, s) in regs.iter_mut().zip(&sums) {
                r[..c].copy_from_slice(&s[t0..t0 + c]);
            }
            for blk in 0..blocks {
                let r0 = s0 + 8 * blk;
                let m = (rows - r0).min(8);
                for v in 0..nv {
                    let r = r0 + v * rpl;
                    if r >= r0 + m {
                        break;
                    }
                    let n = ((r0 + m - r) * bpr).min(rpl * bpr);
                    let wv = &wbuf[8 * blk + v];
                    // SAFETY: bytes [r·bpr, r·bpr + n) lie inside `codes`
                    // (r0 + m ≤ rows); t0 + c ≤ nt, c ≤ 8.
                    unsafe {
                        vec_axpy_chunk::<W, HD, G>(base.add(r * bpr), n, (t0, c), wv, &mut regs)
                    };
                }
            }
            for (s, r) in sums.iter_mut().zip(&regs) {
                s[t0..t0 + c].copy_from_slice(&r[..c]);
            }
        }
        s0 += blocks * 8;
    }
    // As `axpy_codes_rows`: add each head's row sets in order, then into its accumulator.
    for ((a, bj), (sj, zj)) in acc
        .chunks_exact_mut(HD)
        .zip(bias.iter_mut())
        .zip(sums.iter().zip(&zsum))
    {
        add_row_sets::<W, HD>(sj, a);
        *bj += hsum(*zj);
    }
}
