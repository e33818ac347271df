//! The `avx512` variant of the fused KIVI attention kernels
//! ([`crate::kivi::dot_codes_groups`], [`crate::kivi::axpy_codes_rows`]; the multi-query
//! forms in [`multi`], the softmax in [`softmax`]) for head dims 32, 64, 128 and 256.
//!
//! Codes are read from the store as they lie (row-major, no layout change), 64 bytes at
//! a time: one `__m512i` holds `RPL = 64 / BPR` whole rows (`BPR` = bytes per row; a
//! row of 64 bytes or more takes `BPR / 64` loads). Each of its 16 dwords holds `E = 32 /
//! W` consecutive codes of one row; code `k` of every dword comes out with one shift,
//! one mask and one `vcvtdq2ps` (no shuffles, which are the scarce port on AVX-512
//! cores), so lane `i` of extract `k` is element `(i % LPR)·E + k` of row `i / LPR`
//! (`LPR = 16 / RPL` lanes per row) — see [`lane_element`]. The query (keys) is
//! permuted into that order once per call; the value accumulators are un-permuted once
//! per call.
//!
//! * Keys: one FMA per extract into a vector of partial sums (`RPL` rows, `LPR` lanes
//!   each); the 16 rows of a block are then reduced by a fixed tree of shuffles and adds
//!   ([`reduce`], entered at the level that matches `LPR`), so every row's lanes are
//!   summed in the same order wherever the row sits in its block (a partial block reads
//!   zero bytes past its end and drops those lanes): a row's score does not depend on how
//!   the rows were cut into runs.
//! * Values: the weights `p_r · s_r` and the bias `Σ p_r z_r` are computed sixteen rows at
//!   a time (F16C for the scales); each extract is multiplied by its rows' weights (one
//!   `vpermps` spreads them over the lanes) into one accumulator per extract, whose `RPL`
//!   row sets are added once per call, in order.
//!
//! Each computes exactly the products of the portable kernels; only the order of the
//! sums differs. The scalar twins are `crate::kivi::dot_codes_scalar` /
//! `crate::kivi::axpy_codes_scalar`; `tests/kv_cache.rs` runs every variant the CPU
//! supports against them.

use crate::kivi::{KRun, VRun};
use std::arch::x86_64::*;

/// The multi-query forms (`multi.rs`).
mod multi;
pub(in crate::kivi) use multi::{axpy_codes_rows_multi, dot_codes_groups_multi};
/// This variant's softmax (`softmax.rs`).
pub(in crate::kivi) mod softmax;

/// Whether the kernels here take head dim `hd` (those of every x86 variant).
#[inline]
pub(in crate::kivi) fn takes(hd: usize) -> bool {
    super::takes(hd)
}

/// Bytes per row of `hd` codes of width `W` (a power of two from 8 to 256 here).
#[inline(always)]
const fn bpr<const W: u8, const HD: usize>() -> usize {
    HD * W as usize / 8
}

/// Rows per 64-byte load (1 when a row takes one or more whole loads).
#[inline(always)]
const fn rpl<const W: u8, const HD: usize>() -> usize {
    let b = bpr::<W, HD>();
    if b >= 64 {
        1
    } else {
        64 / b
    }
}

/// 64-byte loads per row (1 when several rows share a load).
#[inline(always)]
const fn loads<const W: u8, const HD: usize>() -> usize {
    let b = bpr::<W, HD>();
    if b >= 64 {
        b / 64
    } else {
        1
    }
}

/// Codes per dword.
#[inline(always)]
const fn per_dword<const W: u8>() -> usize {
    32 / W as usize
}

/// Which element of its row lane `i` of extract `k` of load `l` (of the row's loads)
/// holds, for `W`-bit rows of `HD` codes: `(l·16 + i % LPR)·E + k`.
#[inline(always)]
const fn lane_element<const W: u8, const HD: usize>(l: usize, k: usize, i: usize) -> usize {
    let lpr = 16 / rpl::<W, HD>();
    (l * 16 + i % lpr) * per_dword::<W>() + k
}

/// The permutation from a natural-order query to the lane-order vectors `qv[t]`, `t =
/// l·E + k`: `idx[t][i]` is lane `i`'s element modulo 32 (a `vpermt2ps` index into the
/// pair of source vectors holding elements `32c..32c + 32`), `mask[t][c]` the lanes
/// whose element lies in pair `c`. Built at compile time per `(W, HD)`.
const fn perm_tables<const W: u8, const HD: usize>() -> ([[i32; 16]; 16], [[u16; 8]; 16]) {
    let mut idx = [[0i32; 16]; 16];
    let mut mask = [[0u16; 8]; 16];
    let e = per_dword::<W>();
    let mut t = 0;
    while t < loads::<W, HD>() * e {
        let mut i = 0;
        while i < 16 {
            let el = lane_element::<W, HD>(t / e, t % e, i);
            idx[t][i] = (el % 32) as i32;
            mask[t][el / 32] |= 1 << i;
            i += 1;
        }
        t += 1;
    }
    (idx, mask)
}

/// Extract `k` of every dword of `d` (codes `k` of each group of `32 / W`) as f32.
/// int4/int2: a shift, then `vpermps` from the table `[0.0, 1.0, …, 15.0]` (int2: lane
/// `i` holds `i % 4`), which reads only a lane's low 4 bits (no mask, no convert);
/// int8: shift, mask, `vcvtdq2ps`.
#[target_feature(enable = "avx512f")]
#[inline]
fn extract<const W: u8>(d: __m512i, k: usize) -> __m512 {
    let x = if k == 0 {
        d
    } else {
        _mm512_srl_epi32(d, _mm_cvtsi32_si128((W as usize * k) as i32))
    };
    match W {
        4 => _mm512_permutexvar_ps(
            x,
            _mm512_setr_ps(
                0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0,
                15.0,
            ),
        ),
        2 => _mm512_permutexvar_ps(
            x,
            _mm512_setr_ps(
                0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0,
            ),
        ),
        _ => {
            let x = if k + 1 == per_dword::<W>() {
                x
            } else {
                _mm512_and_si512(x, _mm512_set1_epi32(0xFF))
            };
            _mm512_cvtepi32_ps(x)
        }
    }
}

/// 64 bytes at `p`, of which only the first `n` (≤ 64) are read; the rest are zero.
///
/// # Safety
/// AVX-512 BW must be available and `p..p + n` readable.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn load(p: *const u8, n: usize) -> __m512i {
    if n >= 64 {
        // SAFETY: 64 bytes readable (caller); unaligned load.
        unsafe { _mm512_loadu_si512(p.cast()) }
    } else {
        let mask: __mmask64 = (1u64 << n) - 1;
        // SAFETY: masked-off bytes are not accessed (fault suppression); the first `n`
        // are readable (caller).
        unsafe { _mm512_maskz_loadu_epi8(mask, p.cast()) }
    }
}

/// `(16 / rpl)` vectors of partial sums of 16 rows (rows `v·rpl..(v + 1)·rpl` in
/// vector `v`, `16 / rpl` consecutive lanes each) → one vector whose lane `r` is row
/// `r`'s total. The tree of [`reduce16`] entered at the level where each row has that
/// many lanes; every row's lanes go through the same adds.
#[target_feature(enable = "avx512f")]
#[inline]
fn reduce(p: &[__m512; 16], rpl: usize) -> __m512 {
    // No closures here: they would not inherit the target features.
    let mut v = *p;
    if rpl == 1 {
        // 16 → 8: vector i holds row i (lanes 0..8) and row i + 8 (lanes 8..16).
        for i in 0..8 {
            let a = _mm512_shuffle_f32x4::<0b01_00_01_00>(v[i], v[i + 8]);
            let b = _mm512_shuffle_f32x4::<0b11_10_11_10>(v[i], v[i + 8]);
            v[i] = _mm512_add_ps(a, b);
        }
    }
    if rpl <= 2 {
        // 8 → 4: 4 lanes per row.
        for i in 0..4 {
            let a = _mm512_shuffle_f32x4::<0b10_00_10_00>(v[i], v[i + 4]);
            let b = _mm512_shuffle_f32x4::<0b11_01_11_01>(v[i], v[i + 4]);
            v[i] = _mm512_add_ps(a, b);
        }
    }
    if rpl <= 4 {
        // 4 → 2: 2 lanes per row.
        for i in 0..2 {
            let a = _mm512_shuffle_ps::<0x44>(v[i], v[i + 2]);
            let b = _mm512_shuffle_ps::<0xEE>(v[i], v[i + 2]);
            v[i] = _mm512_add_ps(a, b);
        }
    }
    // 2 → 1.
    let t = _mm512_add_ps(
        _mm512_shuffle_ps::<0x88>(v[0], v[1]),
        _mm512_shuffle_ps::<0xDD>(v[0], v[1]),
    );
    // `order[r]`: the lane of the tree's last vector that holds row r (worked out by
    // following the shuffles; `tests/kv_cache.rs` checks every row).
    let order = match rpl {
        1 => _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15),
        2 => _mm512_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7, 8, 12, 10, 14, 9, 13, 11, 15),
        4 => _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15),
        _ => _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15),
    };
    _mm512_permutexvar_ps(order, t)
}

/// Partial sums of the vector of rows at `p` (`n` valid bytes of its first load; the
/// rest zero): `Σ_k extract_k · qv[l·E + k]` over the row's loads `l`.
///
/// # Safety
/// As [`load`], for every load of the vector: `p..p + n` readable, `n ≤ loads · 64`.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn vec_dot<const W: u8, const HD: usize>(
    p: *const u8,
    n: usize,
    qv: &[__m512; 16],
) -> __m512 {
    let mut acc = _mm512_setzero_ps();
    for l in 0..loads::<W, HD>() {
        // SAFETY: load l of the vector: bytes [64l, min(n, 64l + 64)) are readable.
        let d = unsafe { load(p.add(64 * l), n.saturating_sub(64 * l).min(64)) };
        for k in 0..per_dword::<W>() {
            acc = _mm512_fmadd_ps(extract::<W>(d, k), qv[l * per_dword::<W>() + k], acc);
        }
    }
    acc
}

/// Scores of `16·nv`-row blocks `[a, b)` of `codes` (run rows) against lane-order query
/// `qv` plus `bias`, into `o[a..b]`. Blocks start at `a`; the last pads with zero bytes.
///
/// # Safety
/// AVX-512 F/BW must be available; `a ≤ b ≤ codes.len() / bpr`, `b ≤ o.len()`.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn score_rows<const W: u8, const HD: usize>(
    codes: &[u8],
    (a, b): (usize, usize),
    qv: &[__m512; 16],
    bias: f32,
    o: &mut [f32],
) {
    let (bpr, rpl) = (bpr::<W, HD>(), rpl::<W, HD>());
    debug_assert!(a <= b && b * bpr <= codes.len() && b <= o.len());
    let nv = 16 / rpl;
    let bv = _mm512_set1_ps(bias);
    let base = codes.as_ptr();
    let mut r0 = a;
    while r0 + 16 <= b {
        let mut part = [_mm512_setzero_ps(); 16];
        for (v, pv) in part.iter_mut().enumerate().take(nv) {
            // SAFETY: rows r0 + v·rpl.. of this full block lie inside `codes` (caller).
            *pv = unsafe { vec_dot::<W, HD>(base.add((r0 + v * rpl) * bpr), rpl * bpr, qv) };
        }
        let s = _mm512_add_ps(reduce(&part, rpl), bv);
        // SAFETY: o[r0..r0 + 16] is in bounds (r0 + 16 ≤ b ≤ o.len()); unaligned.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr().add(r0), s) };
        r0 += 16;
    }
    if r0 < b {
        // A partial block: bytes past row b read as zero, their lanes dropped.
        let mut part = [_mm512_setzero_ps(); 16];
        for (v, pv) in part.iter_mut().enumerate().take(nv) {
            let r = r0 + v * rpl;
            if r < b {
                let n = ((b - r) * bpr).min(rpl * bpr);
                // SAFETY: bytes [r·bpr, r·bpr + n) lie inside `codes` (b·bpr ≤ len).
                *pv = unsafe { vec_dot::<W, HD>(base.add(r * bpr), n, qv) };
            }
        }
        let s = _mm512_add_ps(reduce(&part, rpl), bv);
        let mut buf = [0.0f32; 16];
        // SAFETY: `buf` holds 16 floats; unaligned store.
        unsafe { _mm512_storeu_ps(buf.as_mut_ptr(), s) };
        o[r0..b].copy_from_slice(&buf[..b - r0]);
    }
}

/// Scores of a run of KIVI K rows against `nq = q.len() / HD` queries (see
/// [`crate::kivi::dot_codes_groups`]): per group, `qs = q ⊙ s` (natural order, exactly the
/// portable fold's products) permuted into lane order by `vpermt2ps` with the
/// compile-time [`perm_tables`], `bias = Σ_c q_c z_c`, then [`score_rows`] over the
/// group's rows.
///
/// # Safety
/// AVX-512 F/BW/VL and F16C must be available (run-time detection,
/// [`crate::kivi::KvKernel`]). Lengths are checked by assertions.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
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
    let (bpr, e) = (bpr::<W, HD>(), per_dword::<W>());
    let nt = loads::<W, HD>() * e;
    assert!(takes(HD) && q.len() == nq * HD && nt <= 16 && group > 0 && offset < group);
    let rows = codes.len() / bpr;
    assert_eq!(codes.len(), rows * bpr);
    if rows == 0 || nq == 0 {
        return;
    }
    let groups = (offset + rows).div_ceil(group);
    assert!(scale.len() >= groups * HD && zero.len() >= groups * HD);
    assert!(out.len() >= (nq - 1) * stride + rows);
    let (idx_t, mask_t) = const { perm_tables::<W, HD>() };
    let mut idx = [_mm512_setzero_si512(); 16];
    for (t, v) in idx.iter_mut().enumerate().take(nt) {
        // SAFETY: a row of the table holds 16 i32; unaligned load.
        *v = unsafe { _mm512_loadu_si512(idx_t[t].as_ptr().cast()) };
    }
    let nv = HD / 16;
    let (sp, zp) = (scale.as_ptr().cast::<u16>(), zero.as_ptr().cast::<u16>());
    for j in 0..nq {
        let mut qn = [_mm512_setzero_ps(); 16];
        for (v, x) in qn.iter_mut().enumerate().take(nv) {
            // SAFETY: q[j·HD + 16v..][..16] is in bounds (q.len() = nq·HD); unaligned.
            *x = unsafe { _mm512_loadu_ps(q.as_ptr().add(j * HD + 16 * v)) };
        }
        let o = &mut out[j * stride..j * stride + rows];
        for k in 0..groups {
            let a = (k * group).saturating_sub(offset);
            let b = ((k + 1) * group - offset).min(rows);
            let mut qs = [_mm512_setzero_ps(); 16];
            let mut zacc = _mm512_setzero_ps();
            for v in 0..nv {
                // SAFETY: group k's parameters [k·HD, (k + 1)·HD) are in bounds (assert).
                let (sv, zv) = unsafe {
                    (
                        _mm512_cvtph_ps(_mm256_loadu_si256(sp.add(k * HD + 16 * v).cast())),
                        _mm512_cvtph_ps(_mm256_loadu_si256(zp.add(k * HD + 16 * v).cast())),
                    )
                };
                qs[v] = _mm512_mul_ps(qn[v], sv);
                zacc = _mm512_fmadd_ps(qn[v], zv, zacc);
            }
            let mut qv = [_mm512_setzero_ps(); 16];
            for t in 0..nt {
                let mut r = _mm512_setzero_ps();
                for c in 0..HD / 32 {
                    if mask_t[t][c] != 0 {
                        let x = _mm512_permutex2var_ps(qs[2 * c], idx[t], qs[2 * c + 1]);
                        r = _mm512_mask_mov_ps(r, mask_t[t][c], x);
                    }
                }
                qv[t] = r;
            }
            // SAFETY: a ≤ b ≤ rows; `codes` holds rows · bpr bytes, `o` rows floats.
            unsafe { score_rows::<W, HD>(codes, (a, b), &qv, _mm512_reduce_add_ps(zacc), o) };
        }
    }
}

/// `acc += extract_k · wv` for every extract of the vector of rows at `p` (`n` valid
/// bytes; the rest zero).
///
/// # Safety
/// As [`vec_dot`].
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn vec_axpy<const W: u8, const HD: usize>(
    p: *const u8,
    n: usize,
    wv: __m512,
    acc: &mut [__m512; 16],
) {
    for l in 0..loads::<W, HD>() {
        // SAFETY: load l of the vector: bytes [64l, min(n, 64l + 64)) are readable.
        let d = unsafe { load(p.add(64 * l), n.saturating_sub(64 * l).min(64)) };
        for k in 0..per_dword::<W>() {
            let a = &mut acc[l * per_dword::<W>() + k];
            *a = _mm512_fmadd_ps(extract::<W>(d, k), wv, *a);
        }
    }
}

/// `acc_j += Σ_r (p_jr s_r) u_r`, `bias[j] += Σ_r p_jr z_r` (see
/// [`crate::kivi::axpy_codes_rows`]), for `W`-bit rows of `HD` codes.
///
/// # Safety
/// AVX-512 F/BW/VL and F16C must be available (run-time detection,
/// [`crate::kivi::KvKernel`]). Lengths are checked by assertions.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
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
    let (bpr, rpl, e) = (bpr::<W, HD>(), rpl::<W, HD>(), per_dword::<W>());
    assert!(takes(HD) && acc.len() == nq * HD && loads::<W, HD>() * e <= 16);
    let rows = scale.len();
    assert!(zero.len() == rows && codes.len() == rows * bpr);
    if rows == 0 || nq == 0 {
        return;
    }
    assert!(p.len() >= (nq - 1) * stride + rows);
    let (sp, zp) = (scale.as_ptr().cast::<u16>(), zero.as_ptr().cast::<u16>());
    let base = codes.as_ptr();
    let lpr = 16 / rpl;
    let nv = 16 / rpl;
    // spread[v]: lane i takes the weight of row v·rpl + i / lpr of the block.
    let mut spread = [_mm512_setzero_si512(); 16];
    for (v, sv) in spread.iter_mut().enumerate().take(nv) {
        let mut idx = [0i32; 16];
        for (i, x) in idx.iter_mut().enumerate() {
            *x = ((v * rpl + i / lpr) % 16) as i32;
        }
        // SAFETY: `idx` holds 16 i32; unaligned load.
        *sv = unsafe { _mm512_loadu_si512(idx.as_ptr().cast()) };
    }
    for (j, (a, bj)) in acc.chunks_exact_mut(HD).zip(bias.iter_mut()).enumerate() {
        let pj = &p[j * stride..j * stride + rows];
        let mut sums = [_mm512_setzero_ps(); 16];
        let mut zsum = _mm512_setzero_ps();
        let mut r0 = 0;
        while r0 < rows {
            let m = (rows - r0).min(16);
            let mask: __mmask16 = if m == 16 { 0xFFFF } else { (1u16 << m) - 1 };
            // SAFETY: lanes < m are rows r0..r0 + m of `pj`, `scale`, `zero` (in bounds);
            // masked-off lanes are not read.
            let (pv, sv, zv) = unsafe {
                (
                    _mm512_maskz_loadu_ps(mask, pj.as_ptr().add(r0)),
                    _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, sp.add(r0).cast())),
                    _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, zp.add(r0).cast())),
                )
            };
            zsum = _mm512_fmadd_ps(pv, zv, zsum);
            let w = _mm512_mul_ps(pv, sv);
            for (v, idx) in spread.iter().enumerate().take(nv) {
                let r = r0 + v * rpl;
                if r >= r0 + m {
                    break;
                }
                let n = ((r0 + m - r) * bpr).min(rpl * bpr);
                let wv = _mm512_permutexvar_ps(*idx, w);
                // SAFETY: bytes [r·bpr, r·bpr + n) lie inside `codes` (r0 + m ≤ rows).
                unsafe { vec_axpy::<W, HD>(base.add(r * bpr), n, wv, &mut sums) };
            }
            r0 += m;
        }
        // Lane i of sums[l·E + k] is element `lane_element(l, k, i)` of row set i / lpr:
        // add the row sets in order, then into the accumulator.
        let mut lanes = [0.0f32; 16];
        for l in 0..loads::<W, HD>() {
            for k in 0..e {
                // SAFETY: `lanes` holds 16 floats; unaligned store.
                unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), sums[l * e + k]) };
                for i in 0..lpr {
                    let mut t = lanes[i];
                    for s in 1..rpl {
                        t += lanes[s * lpr + i];
                    }
                    a[lane_element::<W, HD>(l, k, i)] += t;
                }
            }
        }
        *bj += _mm512_reduce_add_ps(zsum);
    }
}
