//! NEON variants of the fused KIVI attention kernels ([`super::dot_codes_groups`],
//! [`super::axpy_codes_rows`]) for head dims 32, 64, 128 and 256: the `neon`
//! [`KvKernel`](crate::ops::simd::KvKernel), the one Apple Silicon runs.
//!
//! The scheme of the AVX-512 kernels (`src/quant/x86.rs`) on 4 lanes: codes are read as
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
//! `super::dot_codes_scalar` / `super::axpy_codes_scalar`; `tests/kv_cache.rs` runs every
//! variant the CPU supports against them (under qemu: `scripts/test-aarch64.sh`).
//!
//! NEON is part of the aarch64 baseline (the dispatch still checks it); the softmax stays
//! the portable one (`wide` is NEON on aarch64 already).

use half::{f16, slice::HalfFloatSliceExt};
use std::arch::aarch64::*;

/// Whether the kernels here take rows of `hd` codes.
#[inline]
pub(super) fn takes(hd: usize) -> bool {
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

/// The NEON twin of [`super::dot_codes_groups`] (same arguments and contract): per group,
/// `qs = q ⊙ s` (natural order, exactly the portable fold's products) gathered into lane
/// order with the compile-time [`perm`], `bias = Σ_c q_c z_c`, then [`score_rows`] over
/// the group's rows.
///
/// # Safety
/// NEON must be available (run-time detection, [`crate::ops::simd::KvKernel`]).
/// Lengths are checked by assertions.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "neon")]
pub(super) unsafe fn dot_codes_groups<const W: u8, const HD: usize>(
    codes: &[u8],
    q: &[f32],
    scale: &[f16],
    zero: &[f16],
    group: usize,
    offset: usize,
    out: &mut [f32],
    stride: usize,
) {
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
    let perm = const { perm::<W, HD>() };
    let nl = 4 * nt::<W, HD>();
    let (mut s, mut z) = ([0.0f32; 256], [0.0f32; 256]);
    let (mut qs, mut lanes) = ([0.0f32; 256], [0.0f32; 256]);
    let mut qv = [vdupq_n_f32(0.0); 64];
    for j in 0..nq {
        let qj = &q[j * HD..(j + 1) * HD];
        let o = &mut out[j * stride..j * stride + rows];
        for k in 0..groups {
            let a = (k * group).saturating_sub(offset);
            let b = ((k + 1) * group - offset).min(rows);
            scale[k * HD..(k + 1) * HD].convert_to_f32_slice(&mut s[..HD]);
            zero[k * HD..(k + 1) * HD].convert_to_f32_slice(&mut z[..HD]);
            let mut zacc = vdupq_n_f32(0.0);
            for v in 0..HD / 4 {
                // SAFETY: qj, s, z hold HD ≥ 4v + 4 floats, qs 256 ≥ HD.
                unsafe {
                    let qn = vld1q_f32(qj.as_ptr().add(4 * v));
                    let sv = vld1q_f32(s.as_ptr().add(4 * v));
                    let zv = vld1q_f32(z.as_ptr().add(4 * v));
                    vst1q_f32(qs.as_mut_ptr().add(4 * v), vmulq_f32(qn, sv));
                    zacc = vfmaq_f32(zacc, qn, zv);
                }
            }
            for (x, &e) in lanes[..nl].iter_mut().zip(&perm[..nl]) {
                *x = qs[e as usize];
            }
            for (t, x) in qv.iter_mut().enumerate().take(nt::<W, HD>()) {
                // SAFETY: lanes[4t..4t + 4] is in bounds (4t + 4 ≤ nl ≤ 256).
                *x = unsafe { vld1q_f32(lanes.as_ptr().add(4 * t)) };
            }
            // SAFETY: a ≤ b ≤ rows; `codes` holds rows · bpr bytes, `o` rows floats.
            unsafe { score_rows::<W, HD>(codes, (a, b), &qv, hsum(zacc), o) };
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

/// The NEON twin of [`super::axpy_codes_rows`] (same arguments and contract):
/// `acc_j += Σ_r (p_jr s_r) u_r`, `bias[j] += Σ_r p_jr z_r`.
///
/// # Safety
/// NEON must be available (run-time detection, [`crate::ops::simd::KvKernel`]).
/// Lengths are checked by assertions.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "neon")]
pub(super) unsafe fn axpy_codes_rows<const W: u8, const HD: usize>(
    codes: &[u8],
    scale: &[f16],
    zero: &[f16],
    p: &[f32],
    stride: usize,
    acc: &mut [f32],
    bias: &mut [f32],
) {
    const CHUNK: usize = 64;
    let nq = bias.len();
    let (bpr, rpl, e) = (bpr::<W, HD>(), rpl::<W, HD>(), per_word::<W>());
    assert!(takes(HD) && acc.len() == nq * HD && nt::<W, HD>() <= 64);
    let rows = scale.len();
    assert!(zero.len() == rows && codes.len() == rows * bpr);
    if rows == 0 || nq == 0 {
        return;
    }
    assert!(p.len() >= (nq - 1) * stride + rows);
    let base = codes.as_ptr();
    let lpr = 4 / rpl;
    let nv = 4 / rpl;
    // spread[v]: lane i takes the weight of row v·rpl + i / lpr of the block (a byte
    // table for `tbl`: the 4 bytes of that float).
    let mut spread = [vdupq_n_u8(0); 4];
    for (v, sv) in spread.iter_mut().enumerate().take(nv) {
        let mut idx = [0u8; 16];
        for (b, x) in idx.iter_mut().enumerate() {
            *x = (4 * (v * rpl + (b / 4) / lpr) + b % 4) as u8;
        }
        // SAFETY: `idx` holds 16 bytes.
        *sv = unsafe { vld1q_u8(idx.as_ptr()) };
    }
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
            let cm = (rows - c0).min(CHUNK);
            scale[c0..c0 + cm].convert_to_f32_slice(&mut s[..cm]);
            zero[c0..c0 + cm].convert_to_f32_slice(&mut z[..cm]);
            s[cm..].fill(0.0);
            z[cm..].fill(0.0);
            let mut r0 = c0;
            while r0 < c0 + cm {
                let m = (c0 + cm - r0).min(4);
                let mut pb = [0.0f32; 4];
                pb[..m].copy_from_slice(&pj[r0..r0 + m]);
                // SAFETY: `pb` holds 4 floats; s/z hold CHUNK floats and r0 - c0 + 4 ≤
                // CHUNK (chunks of 64 rows, blocks of 4 from the chunk's start).
                let (pv, sv, zv) = unsafe {
                    (
                        vld1q_f32(pb.as_ptr()),
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
        // Lane i of sums[l·E + k] is element `lane_element(l, k, i)` of row set i / lpr:
        // add the row sets in order, then into the accumulator.
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
        *bj += hsum(zsum);
    }
}
