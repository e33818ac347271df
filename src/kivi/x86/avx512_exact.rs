//! The `avx512-exact` variant of the fused KIVI attention kernels
//! ([`crate::kivi::dot_codes_groups`], [`crate::kivi::axpy_codes_rows`] and their
//! multi-query forms; AVX-512 F/BW/VL + F16C) for head dims 32, 64, 128 and 256: AVX-512
//! in the portable order. They add exactly the terms of the portable kernels
//! (`../portable/`) in exactly their order, so every score, weighted sum and bias equals
//! the portable kernels' bit for bit (`tests/kv_cache.rs`, `tests/kv_gqa.rs`); only the
//! way codes reach the lanes differs.
//!
//! The portable order (docs/design.md §2.1, §2.3) puts element `16m + c` of a row (`c <
//! 16`) into lane `c % 8` of accumulator `c / 8`: in one 512-bit register, lane `c` holds
//! the chain `Σ_m q_{16m+c} u_{16m+c}` (multiply-adds in increasing `m`). So a row is read
//! 16 codes ("chunk" `m`) at a time: the chunk's bytes are broadcast from memory (int8: 16
//! bytes, int4: 8, int2: 4 — a load, no shuffle), each lane shifts its own code down
//! (`vpsrlvd`) and turns it into a float (int8: mask and `vcvtdq2ps`; int4/int2: a
//! `vpermps` lookup in `[0.0, 1.0, …]`). Lane `i` then holds element [`chan`]`(i)` of the
//! chunk, a fixed permutation; the query is put in that order once per K group.
//!
//! * Keys: per row and query one accumulator of `HD / 16` multiply-adds; sixteen rows are
//!   then reduced by the portable tree — lanes `c` and `c + 8` first, then
//!   `((t0+t1)+(t2+t3))+((t4+t5)+(t6+t7))` — laid out as four levels of `vpermt2ps` pairs
//!   that also transpose the block ([`reduce`]), plus the portable tail (`+ 0.0`) and the
//!   fold's bias (computed by the portable fold, `crate::kivi::fold_channels`, itself).
//! * Values: per element one chain over the rows in order, starting from the caller's
//!   accumulator (permuted into lane order once per call and back at the end), a row with
//!   weight exactly 0 skipped, and the bias `Σ p_r z_r` added row by row — as the portable
//!   kernel does. Under grouped-query attention each chunk is extracted once for all
//!   heads.
//!
//! Multiply-adds are fused exactly when the portable kernels' are (`simd::FUSED`).

use crate::kivi::{KRun, VRun};
use crate::ops::simd::FUSED;
use std::arch::x86_64::*;

/// Whether the kernels here take head dim `hd` (those of every x86 variant).
#[inline]
pub(in crate::kivi) fn takes(hd: usize) -> bool {
    super::takes(hd)
}

/// Bytes per row of `hd` codes of width `W`.
#[inline(always)]
const fn bpr<const W: u8, const HD: usize>() -> usize {
    HD * W as usize / 8
}

/// The element of its 16-code chunk that lane `i` holds after [`chunk`]: int8 reads 4
/// dwords (lane `i`: dword `i % 4`, byte `i / 4`), int4 2 dwords (dword `i % 2`, nibble
/// `i / 2`), int2 one dword (crumb `i`).
#[inline(always)]
const fn chan<const W: u8>(i: usize) -> usize {
    match W {
        8 => 4 * (i % 4) + i / 4,
        4 => 8 * (i % 2) + i / 2,
        _ => i,
    }
}

/// The lane holding element `c` of a chunk (the inverse of [`chan`]).
#[inline(always)]
const fn lane_of<const W: u8>(c: usize) -> usize {
    let mut i = 0;
    while chan::<W>(i) != c {
        i += 1;
    }
    i
}

/// Per-lane right shift (bits) that brings lane `i`'s code to the bottom of its dword.
#[inline(always)]
const fn shift_of<const W: u8>(i: usize) -> usize {
    match W {
        8 => 8 * (i / 4),
        4 => 4 * (i / 2),
        _ => 2 * i,
    }
}

/// Compile-time index tables of one `(W)`: `chan` (natural → lane order, a `vpermps`
/// index), `inv` (lane → natural order), `shift` (per-lane shifts) and `tree` (the
/// `vpermt2ps` indices of [`reduce`]: level `l`, first and second operand).
struct Tables {
    chan: [i32; 16],
    inv: [i32; 16],
    shift: [i32; 16],
    tree: [[[i32; 16]; 2]; 4],
}

const fn tables<const W: u8>() -> Tables {
    let mut t = Tables {
        chan: [0; 16],
        inv: [0; 16],
        shift: [0; 16],
        tree: [[[0; 16]; 2]; 4],
    };
    let mut i = 0;
    while i < 16 {
        t.chan[i] = chan::<W>(i) as i32;
        t.inv[i] = lane_of::<W>(i) as i32;
        t.shift[i] = shift_of::<W>(i) as i32;
        i += 1;
    }
    // Level l (1..=4) combines two vectors of level l − 1, each holding S = 2^(l−1) rows
    // ("slots") of 16 >> (l − 1) partial sums, into one holding 2S rows of 16 >> l: output
    // lane o = slot·(16 >> l) + node. Node n of level 1 adds chunk elements n and n + 8
    // (the portable a0 + a1); node n of level l ≥ 2 adds nodes 2n and 2n + 1 of level l − 1
    // (the portable tree). Level 0 holds one row, element c in lane `lane_of(c)`.
    let mut l = 1;
    while l <= 4 {
        let slots_in = 1usize << (l - 1);
        let (per_out, per_in) = (16usize >> l, 16usize >> (l - 1));
        let mut o = 0;
        while o < 16 {
            let (s, n) = (o / per_out, o % per_out);
            let (from_b, s_in) = (s >= slots_in, s % slots_in);
            let (c1, c2) = if l == 1 {
                (n, n + 8)
            } else {
                (2 * n, 2 * n + 1)
            };
            let (p1, p2) = if l == 1 {
                (lane_of::<W>(c1), lane_of::<W>(c2))
            } else {
                (s_in * per_in + c1, s_in * per_in + c2)
            };
            let off = if from_b { 16 } else { 0 };
            t.tree[l - 1][0][o] = (p1 + off) as i32;
            t.tree[l - 1][1][o] = (p2 + off) as i32;
            o += 1;
        }
        l += 1;
    }
    t
}

/// The tables of [`tables`] as vectors.
#[derive(Clone, Copy)]
struct Idx {
    chan: __m512i,
    inv: __m512i,
    shift: __m512i,
    tree: [[__m512i; 2]; 4],
}

#[target_feature(enable = "avx512f")]
#[inline]
fn idx<const W: u8>() -> Idx {
    let t = const { tables::<W>() };
    let v = |a: &[i32; 16]| {
        // SAFETY: `a` holds 16 i32; unaligned load.
        unsafe { _mm512_loadu_si512(a.as_ptr().cast()) }
    };
    Idx {
        chan: v(&t.chan),
        inv: v(&t.inv),
        shift: v(&t.shift),
        tree: [
            [v(&t.tree[0][0]), v(&t.tree[0][1])],
            [v(&t.tree[1][0]), v(&t.tree[1][1])],
            [v(&t.tree[2][0]), v(&t.tree[2][1])],
            [v(&t.tree[3][0]), v(&t.tree[3][1])],
        ],
    }
}

/// `a · b + c`, fused exactly when the portable kernels' `mul_add` is.
#[target_feature(enable = "avx512f")]
#[inline]
fn madd(a: __m512, b: __m512, c: __m512) -> __m512 {
    if FUSED {
        _mm512_fmadd_ps(a, b, c)
    } else {
        _mm512_add_ps(_mm512_mul_ps(a, b), c)
    }
}

/// Chunk `m` (codes `16m .. 16m + 16`) of the `W`-bit row at `row` as floats, lane `i`
/// holding element [`chan`]`(i)`.
///
/// # Safety
/// AVX-512 F must be available; the chunk's bytes (`2W` from `row + 2W·m`) readable.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn chunk<const W: u8>(row: *const u8, m: usize, shift: __m512i) -> __m512 {
    let n = 2 * W as usize;
    // SAFETY: `n` bytes at row + n·m are readable (caller); unaligned reads.
    let d = unsafe {
        match W {
            8 => _mm512_broadcast_i32x4(_mm_loadu_si128(row.add(n * m).cast())),
            4 => _mm512_broadcastq_epi64(_mm_loadl_epi64(row.add(n * m).cast())),
            _ => _mm512_broadcastd_epi32(_mm_loadu_si32(row.add(n * m).cast())),
        }
    };
    let x = _mm512_srlv_epi32(d, shift);
    match W {
        8 => _mm512_cvtepi32_ps(_mm512_and_si512(x, _mm512_set1_epi32(0xFF))),
        // `vpermps` reads a lane's low 4 bits: the nibble itself, or (int2) the crumb and
        // the next one, whose table entry repeats the crumb's value.
        4 => _mm512_permutexvar_ps(
            x,
            _mm512_setr_ps(
                0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0,
                15.0,
            ),
        ),
        _ => _mm512_permutexvar_ps(
            x,
            _mm512_setr_ps(
                0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0, 3.0,
            ),
        ),
    }
}

/// Sixteen rows' accumulators (row `r` in `p[r]`, element `c` of the chunk order in lane
/// `lane_of(c)`) → one vector whose lane `r` is row `r`'s sum, by the portable tree (see
/// [`tables`]): four levels of `vpermt2ps` pairs and adds.
#[target_feature(enable = "avx512f")]
#[inline]
fn reduce(p: &[__m512; 16], tree: &[[__m512i; 2]; 4]) -> __m512 {
    let mut v = *p;
    let mut n = 16;
    for t in tree {
        n /= 2;
        for r in 0..n {
            let (a, b) = (v[2 * r], v[2 * r + 1]);
            v[r] = _mm512_add_ps(
                _mm512_permutex2var_ps(a, t[0], b),
                _mm512_permutex2var_ps(a, t[1], b),
            );
        }
    }
    v[0]
}

/// Scores of a run of KIVI K rows against `nq = q.len() / HD` queries (see
/// [`crate::kivi::dot_codes_groups`]), one query at a time.
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
    let nq = q.len() / HD;
    assert_eq!(q.len(), nq * HD);
    for j in 0..nq {
        // SAFETY: as this function's (the caller's) contract.
        unsafe {
            dot_codes_groups_multi::<W, HD, 1>(
                run,
                &q[j * HD..(j + 1) * HD],
                &mut out[j * stride..],
                stride,
            )
        };
    }
}

/// [`dot_codes_groups`] for exactly `G` queries (`q`: `(G, HD)`), each chunk of codes
/// extracted once for all of them. Per K group every head's query is folded by the
/// portable `fold_channels` (the same products and bias bits) and put in lane order; per
/// row and head one accumulator of `HD / 16` multiply-adds; blocks of sixteen rows are
/// reduced by [`reduce`]. Head `g`'s scores go to `out[g·stride..]`.
///
/// # Safety
/// As [`dot_codes_groups`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
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
    let nc = HD / 16;
    assert!(takes(HD) && G > 0 && q.len() == G * HD && group > 0 && offset < group);
    let rows = codes.len() / bpr;
    assert_eq!(codes.len(), rows * bpr);
    if rows == 0 {
        return;
    }
    let groups = (offset + rows).div_ceil(group);
    assert!(scale.len() >= groups * HD && zero.len() >= groups * HD);
    assert!(out.len() >= (G - 1) * stride + rows);
    let ix = idx::<W>();
    let mut qv = [[_mm512_setzero_ps(); 16]; G];
    let mut bias = [0.0f32; G];
    let mut qs = [0.0f32; 256];
    let mut part = [[_mm512_setzero_ps(); 16]; G];
    let base = codes.as_ptr();
    for k in 0..groups {
        let a = (k * group).saturating_sub(offset);
        let b = ((k + 1) * group - offset).min(rows);
        let (s, z) = (&scale[k * HD..(k + 1) * HD], &zero[k * HD..(k + 1) * HD]);
        for (g, (qvg, bg)) in qv.iter_mut().zip(bias.iter_mut()).enumerate() {
            *bg = crate::kivi::fold_channels(&q[g * HD..(g + 1) * HD], s, z, &mut qs[..HD]);
            for (m, x) in qvg.iter_mut().enumerate().take(nc) {
                // SAFETY: qs[16m..16m + 16] is in bounds (16m + 16 ≤ HD ≤ 256); unaligned.
                *x = _mm512_permutexvar_ps(ix.chan, unsafe {
                    _mm512_loadu_ps(qs.as_ptr().add(16 * m))
                });
            }
        }
        let mut r0 = a;
        while r0 < b {
            let n = (b - r0).min(16);
            for i in 0..16 {
                let mut acc = [_mm512_setzero_ps(); G];
                if i < n {
                    // Row r0 + i < b ≤ rows: its bpr bytes lie inside `codes`.
                    let row = base.wrapping_add((r0 + i) * bpr);
                    for m in 0..nc {
                        // SAFETY: chunk m of the row is inside it (16m + 16 ≤ HD).
                        let x = unsafe { chunk::<W>(row, m, ix.shift) };
                        for (ag, qvg) in acc.iter_mut().zip(&qv) {
                            *ag = madd(x, qvg[m], *ag);
                        }
                    }
                }
                for (pg, ag) in part.iter_mut().zip(acc) {
                    pg[i] = ag;
                }
            }
            let mask: __mmask16 = if n == 16 { 0xFFFF } else { (1u16 << n) - 1 };
            for (g, pg) in part.iter().enumerate() {
                // The portable tail (+ 0.0: no element past the 8-lane part), then the bias.
                let t = _mm512_add_ps(reduce(pg, &ix.tree), _mm512_setzero_ps());
                let sv = _mm512_add_ps(t, _mm512_set1_ps(bias[g]));
                let o = &mut out[g * stride + r0..g * stride + r0 + n];
                // SAFETY: the lanes of `mask` are o[..n], in bounds; the rest not written.
                unsafe { _mm512_mask_storeu_ps(o.as_mut_ptr(), mask, sv) };
            }
            r0 += n;
        }
    }
}

/// `acc_j += Σ_r (p_jr s_r) u_r`, `bias[j] += Σ_r p_jr z_r` (see
/// [`crate::kivi::axpy_codes_rows`]) for `nq = bias.len()` queries, one at a time.
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
    let nq = bias.len();
    assert_eq!(acc.len(), nq * HD);
    for j in 0..nq {
        // SAFETY: as this function's (the caller's) contract.
        unsafe {
            axpy_codes_rows_multi::<W, HD, 1>(
                run,
                &p[j * stride..],
                stride,
                &mut acc[j * HD..(j + 1) * HD],
                &mut bias[j..j + 1],
            )
        };
    }
}

/// Chunks per pass of [`axpy_codes_rows_multi`] for `G` heads: its `G × pass`
/// accumulators stay in registers (at most 24 of the 32).
const fn pass<const G: usize>() -> usize {
    if G <= 3 {
        8
    } else if G <= 6 {
        4
    } else {
        2
    }
}

/// [`axpy_codes_rows`] for exactly `G` queries (`p` rows `g·stride..`, `acc`: `(G, HD)`,
/// `bias`: `G`). In passes over the chunks of a row (as many as keep every head's
/// accumulators in registers), the rows in order: each chunk extracted once, then per head
/// with a nonzero weight `p_gr` one multiply-add by `p_gr · s_r` per chunk, and (first
/// pass) `bias[g] += p_gr · z_r` — per element and head exactly the portable chain.
///
/// # Safety
/// As [`axpy_codes_rows`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
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
    let bpr = bpr::<W, HD>();
    let nc = HD / 16;
    assert!(takes(HD) && G > 0 && bias.len() == G && acc.len() == G * HD);
    let rows = scale.len();
    assert!(zero.len() == rows && codes.len() == rows * bpr);
    if rows == 0 {
        return;
    }
    assert!(p.len() >= (G - 1) * stride + rows);
    let ix = idx::<W>();
    let c = pass::<G>().min(nc);
    let base = codes.as_ptr();
    // The biases in registers (through memory, each row's add would wait for the last
    // row's store).
    let mut bsum = [0.0f32; G];
    bsum.copy_from_slice(bias);
    let mut c0 = 0;
    while c0 < nc {
        let mut av = [[_mm512_setzero_ps(); 8]; G];
        for (g, avg) in av.iter_mut().enumerate() {
            for (i, x) in avg.iter_mut().enumerate().take(c) {
                // SAFETY: acc[g·HD + 16(c0 + i)..][..16] is in bounds (c0 + i < nc).
                *x = _mm512_permutexvar_ps(ix.chan, unsafe {
                    _mm512_loadu_ps(acc.as_ptr().add(g * HD + 16 * (c0 + i)))
                });
            }
        }
        for r in 0..rows {
            let row = base.wrapping_add(r * bpr);
            let mut xs = [_mm512_setzero_ps(); 8];
            for (i, x) in xs.iter_mut().enumerate().take(c) {
                // SAFETY: row r < rows lies inside `codes`; chunk c0 + i < nc inside it.
                *x = unsafe { chunk::<W>(row, c0 + i, ix.shift) };
            }
            let s = scale[r].to_f32();
            for (g, avg) in av.iter_mut().enumerate() {
                // SAFETY: g·stride + r < (G − 1)·stride + rows ≤ p.len() (assert).
                let w = unsafe { *p.get_unchecked(g * stride + r) };
                if w != 0.0 {
                    let ws = _mm512_set1_ps(w * s);
                    for (a, x) in avg.iter_mut().zip(&xs).take(c) {
                        *a = madd(*x, ws, *a);
                    }
                    if c0 == 0 {
                        bsum[g] += w * zero[r].to_f32();
                    }
                }
            }
        }
        for (g, avg) in av.iter().enumerate() {
            for (i, x) in avg.iter().enumerate().take(c) {
                // SAFETY: as the load above.
                unsafe {
                    _mm512_storeu_ps(
                        acc.as_mut_ptr().add(g * HD + 16 * (c0 + i)),
                        _mm512_permutexvar_ps(ix.inv, *x),
                    )
                };
            }
        }
        c0 += c;
    }
    bias.copy_from_slice(&bsum);
}
