//! The `neon` variant of the fused KIVI attention kernels
//! ([`crate::kivi::dot_codes_groups`], [`crate::kivi::axpy_codes_rows`] and their
//! multi-query forms) for head dims 32, 64, 128 and 256: the `neon`
//! [`KvKernel`](crate::kivi::KvKernel), the one Apple Silicon runs.
//!
//! The scheme of the AVX-512 kernels (`src/kivi/x86/avx512/`) on 4 lanes: codes are read as
//! they lie, 16 bytes at a time (`RPL = 16 / BPR` whole rows per load, or `BPR / 16`
//! loads per row, `BPR` = bytes per row). Each of the 4 words of a load holds `E = 32 / W`
//! consecutive codes of one row; code `k` of every word comes out with one shift
//! (`ushl`), one mask and one `ucvtf` — no shuffles. Lane `i` of extract `k` of load `l`
//! is element `(4l + i % LPR)·E + k` of row `i / LPR` (`LPR = 4 / RPL` lanes per row),
//! see [`lane_element`]. The query is gathered into that order once per K group (a
//! compile-time table), the value accumulators put back once per call.
//!
//! * Keys: one `fmla` per extract into a vector of partial sums; blocks of 4 rows are
//!   reduced by pairwise adds (`faddp`), so every row's lanes are added in the same order
//!   (`(l0 + l1) + (l2 + l3)`) wherever the row sits in its block or run (a partial block
//!   reads zero bytes past its end and drops those lanes).
//! * Values: the weights `p_r s_r` and the bias `Σ p_r z_r` four rows at a time; each
//!   vector of rows takes its rows' weights spread over its lanes with one `tbl`, and one
//!   `fmla` per extract into one accumulator per extract, whose `RPL` row sets are added
//!   once per call, in order.
//!
//! The same products as the portable kernels (`q_c s_c` and `p_r s_r` rounded to f32,
//! times the code); only the order of the sums differs. The scalar twins are
//! `crate::kivi::dot_codes_scalar` / `crate::kivi::axpy_codes_scalar`; `tests/kv_cache.rs`
//! runs every variant the CPU supports against them (under qemu: `scripts/test-aarch64.sh`).
//!
//! NEON is part of the aarch64 baseline (the dispatch still checks it); the softmax stays
//! the portable one (`wide` is NEON on aarch64 already).

use crate::kivi::{KRun, VRun};
use half::{f16, slice::HalfFloatSliceExt};
use std::arch::aarch64::*;

/// Whether the kernels here take rows of `hd` codes.
#[inline]
pub(in crate::kivi) fn takes(hd: usize) -> bool {
    matches!(hd, 32 | 64 | 128 | 256)
}

/// Bytes per row of `HD` codes of width `W`.
#[inline(always)]
const fn bpr<const W: u8, const HD: usize>() -> usize {
    HD * W as usize / 8
}

/// Rows per 16-byte load (1 when a row takes one or more whole loads).
#[inline(always)]
const fn rpl<const W: u8, const HD: usize>() -> usize {
    let b = bpr::<W, HD>();
    if b >= 16 {
        1
    } else {
        16 / b
    }
}

/// 16-byte loads per row (1 when several rows share a load).
#[inline(always)]
const fn loads<const W: u8, const HD: usize>() -> usize {
    let b = bpr::<W, HD>();
    if b >= 16 {
        b / 16
    } else {
        1
    }
}

/// Codes per 32-bit word.
#[inline(always)]
const fn per_word<const W: u8>() -> usize {
    32 / W as usize
}

/// Lane-order vectors per row: `loads · E` (at most 64 for the head dims taken).
#[inline(always)]
const fn nt<const W: u8, const HD: usize>() -> usize {
    loads::<W, HD>() * per_word::<W>()
}

/// Which element of its row lane `i` of extract `k` of load `l` (of the row's loads)
/// holds: `(4l + i % LPR)·E + k`.
#[inline(always)]
const fn lane_element<const W: u8, const HD: usize>(l: usize, k: usize, i: usize) -> usize {
    let lpr = 4 / rpl::<W, HD>();
    (l * 4 + i % lpr) * per_word::<W>() + k
}

/// `perm[4t + i]`: the query element lane `i` of lane-order vector `t = l·E + k` takes.
/// Built at compile time per `(W, HD)`.
const fn perm<const W: u8, const HD: usize>() -> [u16; 256] {
    let mut p = [0u16; 256];
    let e = per_word::<W>();
    let mut t = 0;
    while t < nt::<W, HD>() {
        let mut i = 0;
        while i < 4 {
            p[4 * t + i] = lane_element::<W, HD>(t / e, t % e, i) as u16;
            i += 1;
        }
        t += 1;
    }
    p
}

/// Extract `k` of every word of `d` (code `k` of each group of `32 / W`) as f32: a shift
/// right by `W·k`, a mask (not needed for the top code), a conversion.
#[target_feature(enable = "neon")]
#[inline]
fn extract<const W: u8>(d: uint32x4_t, k: usize) -> float32x4_t {
    let x = if k == 0 {
        d
    } else {
        vshlq_u32(d, vdupq_n_s32(-((W as usize * k) as i32)))
    };
    let x = if k + 1 == per_word::<W>() {
        x
    } else {
        vandq_u32(x, vdupq_n_u32((1u32 << W) - 1))
    };
    vcvtq_f32_u32(x)
}

/// 16 bytes at `p`, of which only the first `n` are read; the rest are zero.
///
/// # Safety
/// `p..p + min(n, 16)` must be readable.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn load(p: *const u8, n: usize) -> uint32x4_t {
    if n >= 16 {
        // SAFETY: 16 bytes readable (caller); `ld1` has no alignment requirement.
        vreinterpretq_u32_u8(unsafe { vld1q_u8(p) })
    } else {
        let mut b = [0u8; 16];
        // SAFETY: `n < 16` bytes readable (caller) into a 16-byte buffer, then loaded.
        unsafe {
            std::ptr::copy_nonoverlapping(p, b.as_mut_ptr(), n);
            vreinterpretq_u32_u8(vld1q_u8(b.as_ptr()))
        }
    }
}

/// `4 / rpl` vectors of partial sums of 4 rows (rows `v·rpl..(v + 1)·rpl` in vector `v`,
/// `4 / rpl` consecutive lanes each) → one vector whose lane `r` is row `r`'s total,
/// `(l0 + l1) + (l2 + l3)` for every row (pairwise adds keep the rows in order).
#[target_feature(enable = "neon")]
#[inline]
fn reduce(v: &[float32x4_t; 4], rpl: usize) -> float32x4_t {
    match rpl {
        1 => vpaddq_f32(vpaddq_f32(v[0], v[1]), vpaddq_f32(v[2], v[3])),
        2 => vpaddq_f32(v[0], v[1]),
        _ => v[0],
    }
}

/// Partial sums of the vector of rows at `p` (`n` valid bytes; the rest zero):
/// `Σ_k extract_k · qv[l·E + k]` over the row's loads `l`.
///
/// # Safety
/// As [`load`], for every load of the vector: `p..p + n` readable.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn vec_dot<const W: u8, const HD: usize>(
    p: *const u8,
    n: usize,
    qv: &[float32x4_t; 64],
) -> float32x4_t {
    let mut acc = vdupq_n_f32(0.0);
    for l in 0..loads::<W, HD>() {
        // SAFETY: bytes [16l, min(n, 16l + 16)) of the vector are readable.
        let d = unsafe { load(p.add(16 * l), n.saturating_sub(16 * l).min(16)) };
        for k in 0..per_word::<W>() {
            acc = vfmaq_f32(acc, extract::<W>(d, k), qv[l * per_word::<W>() + k]);
        }
    }
    acc
}

/// Scores of rows `[a, b)` of `codes` against lane-order query `qv` plus `bias` into
/// `o[a..b]`, in blocks of 4 rows from `a` (the last pads with zero bytes).
///
/// # Safety
/// `a ≤ b ≤ codes.len() / bpr` and `b ≤ o.len()`.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn score_rows<const W: u8, const HD: usize>(
    codes: &[u8],
    (a, b): (usize, usize),
    qv: &[float32x4_t; 64],
    bias: f32,
    o: &mut [f32],
) {
    let (bpr, rpl) = (bpr::<W, HD>(), rpl::<W, HD>());
    debug_assert!(a <= b && b * bpr <= codes.len() && b <= o.len());
    let nv = 4 / rpl;
    let bv = vdupq_n_f32(bias);
    let base = codes.as_ptr();
    let mut r0 = a;
    while r0 < b {
        let m = (b - r0).min(4);
        let mut part = [vdupq_n_f32(0.0); 4];
        for (v, pv) in part.iter_mut().enumerate().take(nv) {
            let r = r0 + v * rpl;
            if r < r0 + m {
                let n = ((r0 + m - r) * bpr).min(rpl * bpr);
                // SAFETY: bytes [r·bpr, r·bpr + n) lie inside `codes` (r0 + m ≤ b).
                *pv = unsafe { vec_dot::<W, HD>(base.add(r * bpr), n, qv) };
            }
        }
        let s = vaddq_f32(reduce(&part, rpl), bv);
        if m == 4 {
            // SAFETY: o[r0..r0 + 4] is in bounds (r0 + 4 ≤ b ≤ o.len()).
            unsafe { vst1q_f32(o.as_mut_ptr().add(r0), s) };
        } else {
            let mut buf = [0.0f32; 4];
            // SAFETY: `buf` holds 4 floats.
            unsafe { vst1q_f32(buf.as_mut_ptr(), s) };
            o[r0..b].copy_from_slice(&buf[..m]);
        }
        r0 += m;
    }
}

/// The sum of a vector's lanes, `(l0 + l1) + (l2 + l3)`.
#[target_feature(enable = "neon")]
#[inline]
fn hsum(v: float32x4_t) -> f32 {
    let mut l = [0.0f32; 4];
    // SAFETY: `l` holds 4 floats.
    unsafe { vst1q_f32(l.as_mut_ptr(), v) };
    (l[0] + l[1]) + (l[2] + l[3])
}

/// Scratch of [`fold_group`] (declared once per call, not per group).
struct FoldScratch {
    s: [f32; 256],
    z: [f32; 256],
    qs: [f32; 256],
    lanes: [f32; 256],
}

impl FoldScratch {
    fn new() -> Self {
        FoldScratch {
            s: [0.0; 256],
            z: [0.0; 256],
            qs: [0.0; 256],
            lanes: [0.0; 256],
        }
    }
}

/// Folds K group `k`'s parameters into query `qj` (`HD` floats): `qs = q ⊙ s` (natural
/// order, exactly the portable fold's products) gathered into lane order `qv` with the
/// compile-time [`perm`]; returns `bias = Σ_c q_c z_c` (four lanes of FMAs, then
/// [`hsum`]). `scale`/`zero` hold at least `(k + 1)·HD` values (sliced, so checked).
#[target_feature(enable = "neon")]
#[inline]
fn fold_group<const W: u8, const HD: usize>(
    qj: &[f32],
    (scale, zero): (&[f16], &[f16]),
    k: usize,
    f: &mut FoldScratch,
    qv: &mut [float32x4_t; 64],
) -> f32 {
    let perm = const { perm::<W, HD>() };
    let nl = 4 * nt::<W, HD>();
    let qj = &qj[..HD];
    scale[k * HD..(k + 1) * HD].convert_to_f32_slice(&mut f.s[..HD]);
    zero[k * HD..(k + 1) * HD].convert_to_f32_slice(&mut f.z[..HD]);
    let mut zacc = vdupq_n_f32(0.0);
    for v in 0..HD / 4 {
        // SAFETY: qj, s, z hold HD ≥ 4v + 4 floats, qs 256 ≥ HD.
        unsafe {
            let qn = vld1q_f32(qj.as_ptr().add(4 * v));
            let sv = vld1q_f32(f.s.as_ptr().add(4 * v));
            let zv = vld1q_f32(f.z.as_ptr().add(4 * v));
            vst1q_f32(f.qs.as_mut_ptr().add(4 * v), vmulq_f32(qn, sv));
            zacc = vfmaq_f32(zacc, qn, zv);
        }
    }
    for (x, &e) in f.lanes[..nl].iter_mut().zip(&perm[..nl]) {
        *x = f.qs[e as usize];
    }
    for (t, x) in qv.iter_mut().enumerate().take(nt::<W, HD>()) {
        // SAFETY: lanes[4t..4t + 4] is in bounds (4t + 4 ≤ nl ≤ 256).
        *x = unsafe { vld1q_f32(f.lanes.as_ptr().add(4 * t)) };
    }
    hsum(zacc)
}

/// The NEON twin of [`crate::kivi::dot_codes_groups`] (same arguments and contract): per group,
/// `qs = q ⊙ s` (natural order, exactly the portable fold's products) gathered into lane
/// order with the compile-time [`perm`], `bias = Σ_c q_c z_c`, then [`score_rows`] over
/// the group's rows.
///
/// # Safety
/// NEON must be available (run-time detection, [`crate::kivi::KvKernel`]).
/// Lengths are checked by assertions.
#[target_feature(enable = "neon")]
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
    assert!(takes(HD) && q.len() == nq * HD && nt::<W, HD>() <= 64);
    assert!(group > 0 && offset < group);
    let rows = codes.len() / bpr;
    assert_eq!(codes.len(), rows * bpr);
    if rows == 0 || nq == 0 {
        return;
    }
    let groups = (offset + rows).div_ceil(group);
    assert!(scale.len() >= groups * HD && zero.len() >= groups * HD);
    assert!(out.len() >= (nq - 1) * stride + rows);
    let mut scratch = FoldScratch::new();
    let mut qv = [vdupq_n_f32(0.0); 64];
    for j in 0..nq {
        let qj = &q[j * HD..(j + 1) * HD];
        let o = &mut out[j * stride..j * stride + rows];
        for k in 0..groups {
            let a = (k * group).saturating_sub(offset);
            let b = ((k + 1) * group - offset).min(rows);
            let bias = fold_group::<W, HD>(qj, (scale, zero), k, &mut scratch, &mut qv);
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
#[target_feature(enable = "neon")]
#[inline]
unsafe fn vec_axpy<const W: u8, const HD: usize>(
    p: *const u8,
    n: usize,
    wv: float32x4_t,
    acc: &mut [float32x4_t; 64],
) {
    for l in 0..loads::<W, HD>() {
        // SAFETY: bytes [16l, min(n, 16l + 16)) of the vector are readable.
        let d = unsafe { load(p.add(16 * l), n.saturating_sub(16 * l).min(16)) };
        for k in 0..per_word::<W>() {
            let a = &mut acc[l * per_word::<W>() + k];
            *a = vfmaq_f32(*a, extract::<W>(d, k), wv);
        }
    }
}

/// The NEON twin of [`crate::kivi::axpy_codes_rows`] (same arguments and contract):
/// `acc_j += Σ_r (p_jr s_r) u_r`, `bias[j] += Σ_r p_jr z_r`.
///
/// # Safety
/// NEON must be available (run-time detection, [`crate::kivi::KvKernel`]).
/// Lengths are checked by assertions.
#[target_feature(enable = "neon")]
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
    assert!(takes(HD) && acc.len() == nq * HD && nt::<W, HD>() <= 64);
    let rows = scale.len();
    assert!(zero.len() == rows && codes.len() == rows * bpr);
    if rows == 0 || nq == 0 {
        return;
    }
    assert!(p.len() >= (nq - 1) * stride + rows);
    let base = codes.as_ptr();
    let nv = 4 / rpl;
    let spread = spread::<W, HD>();
    let (mut s, mut z) = ([0.0f32; CHUNK], [0.0f32; CHUNK]);
    let mut sums = [vdupq_n_f32(0.0); 64];
    for (j, (a, bj)) in acc.chunks_exact_mut(HD).zip(bias.iter_mut()).enumerate() {
        let pj = &p[j * stride..j * stride + rows];
        sums.iter_mut()
            .take(nt::<W, HD>())
            .for_each(|x| *x = vdupq_n_f32(0.0));
        let mut zsum = vdupq_n_f32(0.0);
        let mut c0 = 0;
        while c0 < rows {
            let cm = chunk_params(scale, zero, c0, (&mut s, &mut z));
            let mut r0 = c0;
            while r0 < c0 + cm {
                let m = (c0 + cm - r0).min(4);
                // SAFETY: s/z hold CHUNK floats and r0 - c0 + 4 ≤ CHUNK (chunks of 64
                // rows, blocks of 4 from the chunk's start).
                let (pv, sv, zv) = unsafe {
                    (
                        load_f32(&pj[r0..r0 + m]),
                        vld1q_f32(s.as_ptr().add(r0 - c0)),
                        vld1q_f32(z.as_ptr().add(r0 - c0)),
                    )
                };
                zsum = vfmaq_f32(zsum, pv, zv);
                let w = vreinterpretq_u8_f32(vmulq_f32(pv, sv));
                for (v, idx) in spread.iter().enumerate().take(nv) {
                    let r = r0 + v * rpl;
                    if r >= r0 + m {
                        break;
                    }
                    let n = ((r0 + m - r) * bpr).min(rpl * bpr);
                    let wv = vreinterpretq_f32_u8(vqtbl1q_u8(w, *idx));
                    // SAFETY: bytes [r·bpr, r·bpr + n) lie inside `codes` (r0 + m ≤ rows).
                    unsafe { vec_axpy::<W, HD>(base.add(r * bpr), n, wv, &mut sums) };
                }
                r0 += m;
            }
            c0 += cm;
        }
        add_row_sets::<W, HD>(&sums, a);
        *bj += hsum(zsum);
    }
}

/// Rows whose `(scale, zero)` the value kernels convert to f32 at a time.
const CHUNK: usize = 64;

/// Converts the `(scale, zero)` of rows `c0..c0 + cm` (`cm = min(CHUNK, rows − c0)`) into
/// `s[..cm]`, `z[..cm]` and zeroes the rest; returns `cm`.
#[inline]
fn chunk_params(
    scale: &[f16],
    zero: &[f16],
    c0: usize,
    (s, z): (&mut [f32; CHUNK], &mut [f32; CHUNK]),
) -> usize {
    let cm = (scale.len() - c0).min(CHUNK);
    scale[c0..c0 + cm].convert_to_f32_slice(&mut s[..cm]);
    zero[c0..c0 + cm].convert_to_f32_slice(&mut z[..cm]);
    s[cm..].fill(0.0);
    z[cm..].fill(0.0);
    cm
}

/// Up to 4 floats as a vector, zero-padded.
#[target_feature(enable = "neon")]
#[inline]
fn load_f32(x: &[f32]) -> float32x4_t {
    let mut b = [0.0f32; 4];
    let m = x.len().min(4);
    b[..m].copy_from_slice(&x[..m]);
    // SAFETY: `b` holds 4 floats.
    unsafe { vld1q_f32(b.as_ptr()) }
}

/// `spread[v]`: the `tbl` byte table that gives lane `i` the weight of row
/// `v·rpl + i / lpr` of a block of 4 rows (the 4 bytes of that float).
#[target_feature(enable = "neon")]
#[inline]
fn spread<const W: u8, const HD: usize>() -> [uint8x16_t; 4] {
    let rpl = rpl::<W, HD>();
    let lpr = 4 / rpl;
    let mut spread = [vdupq_n_u8(0); 4];
    for (v, sv) in spread.iter_mut().enumerate().take(4 / rpl) {
        let mut idx = [0u8; 16];
        for (b, x) in idx.iter_mut().enumerate() {
            *x = (4 * (v * rpl + (b / 4) / lpr) + b % 4) as u8;
        }
        // SAFETY: `idx` holds 16 bytes.
        *sv = unsafe { vld1q_u8(idx.as_ptr()) };
    }
    spread
}

/// `a[e] += Σ_s` (row set `s`'s lanes holding element `e`), in row-set order: lane `i` of
/// `sums[l·E + k]` is element `lane_element(l, k, i)` of row set `i / lpr`.
#[target_feature(enable = "neon")]
#[inline]
fn add_row_sets<const W: u8, const HD: usize>(sums: &[float32x4_t; 64], a: &mut [f32]) {
    let (rpl, e) = (rpl::<W, HD>(), per_word::<W>());
    let lpr = 4 / rpl;
    let mut lanes = [0.0f32; 4];
    for l in 0..loads::<W, HD>() {
        for k in 0..e {
            // SAFETY: `lanes` holds 4 floats.
            unsafe { vst1q_f32(lanes.as_mut_ptr(), sums[l * e + k]) };
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

// ---------------------------------------------------------------------------------------
// Multi-query forms (grouped-query attention): the `G` query heads of one KV head take
// each 16-byte load of codes, and each of its extracts, once. Per head the operations and
// their order are exactly the single-query kernels' above (the same FMA chain per lane,
// the same `reduce`, the same row-set sums), so every head's result equals theirs bit for
// bit.
// ---------------------------------------------------------------------------------------

/// [`vec_dot`] of two vectors of rows (at `p0`, `p1`, with `n0`, `n1` valid bytes) for `G`
/// lane-order queries: one load and one extract per code word, then `G` FMAs, so `2G`
/// independent chains are in flight; head `g`'s chain for each vector is exactly
/// [`vec_dot`]'s with `qv[g]`.
///
/// # Safety
/// As [`vec_dot`], for both vectors (`n = 0`: nothing is read, the vector is zero).
#[target_feature(enable = "neon")]
#[inline]
unsafe fn vec_dot_pair_multi<const W: u8, const HD: usize, const G: usize>(
    (p0, n0): (*const u8, usize),
    (p1, n1): (*const u8, usize),
    qv: &[[float32x4_t; 64]; G],
) -> ([float32x4_t; G], [float32x4_t; G]) {
    let mut acc0 = [vdupq_n_f32(0.0); G];
    let mut acc1 = [vdupq_n_f32(0.0); G];
    for l in 0..loads::<W, HD>() {
        // SAFETY: bytes [16l, min(n, 16l + 16)) of each vector are readable (none when that
        // is empty: `load` copies 0 bytes).
        let (d0, d1) = unsafe {
            (
                load(p0.wrapping_add(16 * l), n0.saturating_sub(16 * l).min(16)),
                load(p1.wrapping_add(16 * l), n1.saturating_sub(16 * l).min(16)),
            )
        };
        for k in 0..per_word::<W>() {
            let (x0, x1) = (extract::<W>(d0, k), extract::<W>(d1, k));
            let t = l * per_word::<W>() + k;
            for ((a0, a1), q) in acc0.iter_mut().zip(acc1.iter_mut()).zip(qv) {
                *a0 = vfmaq_f32(*a0, x0, q[t]);
                *a1 = vfmaq_f32(*a1, x1, q[t]);
            }
        }
    }
    (acc0, acc1)
}

/// [`score_rows`] for `G` queries: head `g`'s scores of rows `[a, b)` go to
/// `out[g·stride + a..g·stride + b]`.
///
/// # Safety
/// `a ≤ b ≤ codes.len() / bpr` and `(G − 1)·stride + b ≤ out.len()` (asserted).
#[target_feature(enable = "neon")]
#[inline]
unsafe fn score_rows_multi<const W: u8, const HD: usize, const G: usize>(
    codes: &[u8],
    (a, b): (usize, usize),
    qv: &[[float32x4_t; 64]; G],
    bias: &[f32; G],
    out: &mut [f32],
    stride: usize,
) {
    let (bpr, rpl) = (bpr::<W, HD>(), rpl::<W, HD>());
    assert!(a <= b && b * bpr <= codes.len() && (G - 1) * stride + b <= out.len());
    // Vectors per block: 4 / rpl, even for every shape `takes` accepts (rpl ≤ 2).
    let nv = 4 / rpl;
    let base = codes.as_ptr();
    let mut r0 = a;
    while r0 < b {
        let m = (b - r0).min(4);
        // The vector of rows starting at r: its pointer and valid bytes (none past the
        // block's last row, whose lanes then stay zero as in `score_rows`).
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
        let mut part = [[vdupq_n_f32(0.0); 4]; G];
        for v in (0..nv).step_by(2) {
            let r = r0 + v * rpl;
            if r >= r0 + m {
                break;
            }
            // SAFETY: `vector` gives bytes [r·bpr, r·bpr + n) inside `codes` (r0 + m ≤ b,
            // b·bpr ≤ len), or n = 0.
            let (s0, s1) =
                unsafe { vec_dot_pair_multi::<W, HD, G>(vector(r), vector(r + rpl), qv) };
            for ((pg, s0), s1) in part.iter_mut().zip(s0).zip(s1) {
                pg[v] = s0;
                pg[v + 1] = s1;
            }
        }
        for (g, pg) in part.iter().enumerate() {
            let s = vaddq_f32(reduce(pg, rpl), vdupq_n_f32(bias[g]));
            let o = &mut out[g * stride + r0..g * stride + r0 + m];
            if m == 4 {
                // SAFETY: `o` holds 4 floats.
                unsafe { vst1q_f32(o.as_mut_ptr(), s) };
            } else {
                let mut buf = [0.0f32; 4];
                // SAFETY: `buf` holds 4 floats.
                unsafe { vst1q_f32(buf.as_mut_ptr(), s) };
                o.copy_from_slice(&buf[..m]);
            }
        }
        r0 += m;
    }
}

/// [`dot_codes_groups`] for exactly `G` queries (`q`: `(G, HD)`), each code unpacked once
/// for all of them. Per group every head is folded by [`fold_group`], as
/// [`dot_codes_groups`] does it, so head `g`'s scores equal its bit for bit.
///
/// # Safety
/// As [`dot_codes_groups`].
#[target_feature(enable = "neon")]
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
    assert!(takes(HD) && G > 0 && q.len() == G * HD && nt::<W, HD>() <= 64);
    assert!(group > 0 && offset < group);
    let rows = codes.len() / bpr;
    assert_eq!(codes.len(), rows * bpr);
    if rows == 0 {
        return;
    }
    let groups = (offset + rows).div_ceil(group);
    assert!(scale.len() >= groups * HD && zero.len() >= groups * HD);
    assert!(out.len() >= (G - 1) * stride + rows);
    let mut scratch = FoldScratch::new();
    let mut qv = [[vdupq_n_f32(0.0); 64]; G];
    let mut bias = [0.0f32; G];
    for k in 0..groups {
        let a = (k * group).saturating_sub(offset);
        let b = ((k + 1) * group - offset).min(rows);
        for (j, (qvj, bj)) in qv.iter_mut().zip(bias.iter_mut()).enumerate() {
            let qj = &q[j * HD..(j + 1) * HD];
            *bj = fold_group::<W, HD>(qj, (scale, zero), k, &mut scratch, qvj);
        }
        // SAFETY: a ≤ b ≤ rows; `codes` holds rows · bpr bytes; out ≥ (G − 1)·stride + rows.
        unsafe { score_rows_multi::<W, HD, G>(codes, (a, b), &qv, &bias, out, stride) };
    }
}

/// Extracts per pass of [`axpy_codes_rows_multi`] for `G` heads: its `G × chunk`
/// accumulators stay in registers (at most 24 of the 32).
const fn chunk<const G: usize>() -> usize {
    if G <= 3 {
        8
    } else if G <= 6 {
        4
    } else {
        2
    }
}

/// `acc[g][i] += extract_{t0 + i} · wv[g]` for `i < c` and every head `g`, for the vector
/// of rows at `p` (`n` valid bytes; the rest zero): extracts `t0..t0 + c` of the vector,
/// each computed once.
///
/// # Safety
/// As [`vec_dot`]; `t0 + c ≤ nt`, `c ≤ 8`.
#[target_feature(enable = "neon")]
#[inline]
unsafe fn vec_axpy_chunk<const W: u8, const HD: usize, const G: usize>(
    p: *const u8,
    n: usize,
    (t0, c): (usize, usize),
    wv: &[float32x4_t; G],
    acc: &mut [[float32x4_t; 8]; G],
) {
    let e = per_word::<W>();
    let mut d = vdupq_n_u32(0);
    for i in 0..c {
        let (l, k) = ((t0 + i) / e, (t0 + i) % e);
        if i == 0 || k == 0 {
            // SAFETY: bytes [16l, min(n, 16l + 16)) of the vector are readable.
            d = unsafe { load(p.wrapping_add(16 * l), n.saturating_sub(16 * l).min(16)) };
        }
        let x = extract::<W>(d, k);
        for (a, w) in acc.iter_mut().zip(wv) {
            a[i] = vfmaq_f32(a[i], x, *w);
        }
    }
}

/// [`axpy_codes_rows`] for exactly `G` queries (`p` rows `g·stride..`, `acc`: `(G, HD)`,
/// `bias`: `G`), each code extract computed once for all of them. Per chunk of
/// [`CHUNK`] rows the weights of every head are computed once (as `axpy_codes_rows` does,
/// four rows at a time); then the extracts are taken in chunks whose accumulators for all
/// `G` heads stay in registers. Each accumulator receives exactly `axpy_codes_rows`'s FMAs
/// in its order (rows in order), so head `g`'s result equals it bit for bit.
///
/// # Safety
/// As [`axpy_codes_rows`].
#[target_feature(enable = "neon")]
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
    assert!(takes(HD) && G > 0 && bias.len() == G && acc.len() == G * HD && nt <= 64);
    let rows = scale.len();
    assert!(zero.len() == rows && codes.len() == rows * bpr);
    if rows == 0 {
        return;
    }
    assert!(p.len() >= (G - 1) * stride + rows);
    let base = codes.as_ptr();
    let nv = 4 / rpl;
    // Both powers of two (nt a multiple of 4), so chunks tile the extracts.
    let c = chunk::<G>().min(nt);
    let spread = spread::<W, HD>();
    let (mut s, mut z) = ([0.0f32; CHUNK], [0.0f32; CHUNK]);
    let mut sums = [[vdupq_n_f32(0.0); 64]; G];
    let mut zsum = [vdupq_n_f32(0.0); G];
    let mut wbuf = [[vdupq_n_f32(0.0); CHUNK / 4]; G];
    let mut c0 = 0;
    while c0 < rows {
        let cm = chunk_params(scale, zero, c0, (&mut s, &mut z));
        let blocks = cm.div_ceil(4);
        for blk in 0..blocks {
            let r0 = c0 + 4 * blk;
            let m = (c0 + cm - r0).min(4);
            // SAFETY: s/z hold CHUNK floats and 4·blk + 4 ≤ CHUNK.
            let (sv, zv) = unsafe {
                (
                    vld1q_f32(s.as_ptr().add(4 * blk)),
                    vld1q_f32(z.as_ptr().add(4 * blk)),
                )
            };
            for (j, (wj, zj)) in wbuf.iter_mut().zip(zsum.iter_mut()).enumerate() {
                let pv = load_f32(&p[j * stride + r0..j * stride + r0 + m]);
                *zj = vfmaq_f32(*zj, pv, zv);
                wj[blk] = vmulq_f32(pv, sv);
            }
        }
        for t0 in (0..nt).step_by(c) {
            let mut regs = [[vdupq_n_f32(0.0); 8]; G];
            for (r, sj) in regs.iter_mut().zip(&sums) {
                r[..c].copy_from_slice(&sj[t0..t0 + c]);
            }
            for blk in 0..blocks {
                let r0 = c0 + 4 * blk;
                let m = (c0 + cm - r0).min(4);
                for (v, idx) in spread.iter().enumerate().take(nv) {
                    let r = r0 + v * rpl;
                    if r >= r0 + m {
                        break;
                    }
                    let n = ((r0 + m - r) * bpr).min(rpl * bpr);
                    let mut wv = [vdupq_n_f32(0.0); G];
                    for (x, wj) in wv.iter_mut().zip(&wbuf) {
                        let w = vreinterpretq_u8_f32(wj[blk]);
                        *x = vreinterpretq_f32_u8(vqtbl1q_u8(w, *idx));
                    }
                    // SAFETY: bytes [r·bpr, r·bpr + n) lie inside `codes` (r0 + m ≤ rows);
                    // t0 + c ≤ nt, c ≤ 8.
                    unsafe {
                        vec_axpy_chunk::<W, HD, G>(base.add(r * bpr), n, (t0, c), &wv, &mut regs)
                    };
                }
            }
            for (sj, r) in sums.iter_mut().zip(&regs) {
                sj[t0..t0 + c].copy_from_slice(&r[..c]);
            }
        }
        c0 += cm;
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
