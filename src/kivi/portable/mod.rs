//! The `portable` KIVI kernels (the `portable` [`KvKernel`](super::KvKernel)): the fused
//! attention kernels over codes written on `wide::f32x8`, so they run on any CPU and head
//! dim, in **the canonical order** (docs/design.md §2.3): the order the reference writes
//! out, which the `avx512-exact` variant (`../x86/avx512_exact.rs`) reproduces lane for
//! lane. The single-query forms are here, the multi-query forms in [`multi`]; both carry
//! the names of every other variant's (`dot_codes_groups`, `axpy_codes_rows`, `…_multi`),
//! and the dispatch in `super` calls them for the head dims and CPUs the others do not take.
//!
//! Each kernel expands 16 codes at a time into two f32x8 in natural element order (int8:
//! 16 bytes zero-extended; int4: two groups of 4 bytes, each broadcast to every lane and
//! shifted by 4 bits per lane, see `nibbles8`), then a step of 8, then a scalar tail. The
//! scalar twins (`*_scalar`) are the executable definition.

use super::{fold_channels, get, Bits, KRun, VRun};
use crate::ops::simd::{load8, reduce8, store8};
use half::slice::HalfFloatSliceExt;
use wide::{f32x8, i32x8, u16x8, u32x8, u8x16};

/// Packed bytes of `n` codes of width `W`.
#[inline(always)]
const fn packed<const W: u8>(n: usize) -> usize {
    match W {
        4 => n.div_ceil(2),
        2 => n.div_ceil(4),
        _ => n,
    }
}

/// The [`Bits`] of code width `W`.
#[inline(always)]
const fn bits_of<const W: u8>() -> Bits {
    match W {
        4 => Bits::Int4,
        2 => Bits::Int2,
        _ => Bits::Int8,
    }
}

/// Codes of elements `[e, e + 16)` as two f32x8 (`e` a multiple of 8).
#[inline(always)]
fn codes16<const W: u8>(codes: &[u8], e: usize) -> (f32x8, f32x8) {
    match W {
        4 => (
            nibbles8(&codes[e / 2..e / 2 + 4]),
            nibbles8(&codes[e / 2 + 4..e / 2 + 8]),
        ),
        2 => {
            // One broadcast serves both halves: lanes shift by 2k and by 16 + 2k.
            let word = u32::from_le_bytes(codes[e / 4..e / 4 + 4].try_into().expect("4 bytes"));
            let w = u32x8::splat(word);
            let lo = u32x8::new([0, 2, 4, 6, 8, 10, 12, 14]);
            let hi = u32x8::new([16, 18, 20, 22, 24, 26, 28, 30]);
            let mask = u32x8::splat(0x3);
            (
                bytemuck::cast::<u32x8, i32x8>((w >> lo) & mask).round_float(),
                bytemuck::cast::<u32x8, i32x8>((w >> hi) & mask).round_float(),
            )
        }
        _ => {
            let a: [u8; 16] = codes[e..e + 16].try_into().expect("16 codes");
            let bytes = u8x16::new(a);
            (widen_lo(bytes), widen_hi(bytes))
        }
    }
}

/// Codes of elements `[e, e + 8)` as one f32x8 (`e` a multiple of 8).
#[inline(always)]
fn codes8<const W: u8>(codes: &[u8], e: usize) -> f32x8 {
    match W {
        4 => nibbles8(&codes[e / 2..e / 2 + 4]),
        2 => crumbs8(u16::from_le_bytes([codes[e / 4], codes[e / 4 + 1]]) as u32),
        _ => {
            let mut a = [0u8; 16];
            a[..8].copy_from_slice(&codes[e..e + 8]);
            widen_lo(u8x16::new(a))
        }
    }
}

#[inline(always)]
fn code_at<const W: u8>(codes: &[u8], j: usize) -> f32 {
    get(codes, j, bits_of::<W>()) as f32
}

/// 4 packed int4 bytes → their 8 offset codes in element order. Read as a little-endian
/// u32, element `k` is bits `4k..4k + 4` (byte `k / 2`, low nibble first), so one
/// broadcast, a per-lane shift by `4k` and a mask put element `k` in lane `k`.
#[inline(always)]
fn nibbles8(b: &[u8]) -> f32x8 {
    let word = u32::from_le_bytes(b[..4].try_into().expect("4 bytes"));
    let shifts = u32x8::new([0, 4, 8, 12, 16, 20, 24, 28]);
    let codes = (u32x8::splat(word) >> shifts) & u32x8::splat(0xF);
    bytemuck::cast::<u32x8, i32x8>(codes).round_float()
}

/// The low 16 bits of `word` (2 packed int2 bytes, little-endian) → their 8 offset codes
/// in element order: element `k` is bits `2k..2k + 2`, so one broadcast, a per-lane shift
/// by `2k` and a mask put element `k` in lane `k`.
#[inline(always)]
fn crumbs8(word: u32) -> f32x8 {
    let shifts = u32x8::new([0, 2, 4, 6, 8, 10, 12, 14]);
    let codes = (u32x8::splat(word) >> shifts) & u32x8::splat(0x3);
    bytemuck::cast::<u32x8, i32x8>(codes).round_float()
}

#[inline(always)]
fn widen_lo(b: u8x16) -> f32x8 {
    i32x8::from_u16x8(u16x8::from_u8x16_low(b)).round_float()
}

#[inline(always)]
fn widen_hi(b: u8x16) -> f32x8 {
    i32x8::from_u16x8(u16x8::from_u8x16_high(b)).round_float()
}

/// `Σ_j w[j] · u_j` over a packed row of `w.len()` codes (the offset codes themselves,
/// no scale or zero: the caller folded them into `w`).
#[inline]
pub fn dot_codes(codes: &[u8], w: &[f32], bits: Bits) -> f32 {
    debug_assert_eq!(codes.len(), bits.packed_len(w.len()));
    match bits {
        Bits::Int8 => dot_codes_k::<8>(codes, w),
        Bits::Int4 => dot_codes_k::<4>(codes, w),
        Bits::Int2 => dot_codes_k::<2>(codes, w),
    }
}

#[inline(always)]
fn dot_codes_k<const W: u8>(codes: &[u8], w: &[f32]) -> f32 {
    let (v, tail) = dot_lanes::<W, 0>(codes, w);
    v.reduce_add() + tail
}

/// [`dot_codes`] before the final reduction: the lane-wise partial sums of the first
/// `n - n % 8` elements and the scalar sum of the rest. `HD` is the row length when
/// known at compile time (0: `w.len()`), so the common head dims compile to straight
/// code with no loop or bounds checks.
#[inline(always)]
fn dot_lanes<const W: u8, const HD: usize>(codes: &[u8], w: &[f32]) -> (f32x8, f32) {
    let n = if HD != 0 { HD } else { w.len() };
    let w = &w[..n];
    let codes = &codes[..packed::<W>(n)];
    let (mut a0, mut a1) = (f32x8::ZERO, f32x8::ZERO);
    let mut e = 0;
    while e + 16 <= n {
        let (x0, x1) = codes16::<W>(codes, e);
        a0 = x0.mul_add(load8(&w[e..]), a0);
        a1 = x1.mul_add(load8(&w[e + 8..]), a1);
        e += 16;
    }
    if e + 8 <= n {
        a0 = codes8::<W>(codes, e).mul_add(load8(&w[e..]), a0);
        e += 8;
    }
    let mut tail = 0.0f32;
    for (j, &wj) in w.iter().enumerate().skip(e) {
        tail += code_at::<W>(codes, j) * wj;
    }
    (a0 + a1, tail)
}

/// Scalar twin of [`dot_codes`] (sequential sum).
pub fn dot_codes_scalar(codes: &[u8], w: &[f32], bits: Bits) -> f32 {
    let mut s = 0.0f32;
    for (j, &wj) in w.iter().enumerate() {
        s += get(codes, j, bits) as f32 * wj;
    }
    s
}

/// `acc[j] += alpha · u_j` over a packed row of `acc.len()` codes.
#[inline]
pub fn axpy_codes(alpha: f32, codes: &[u8], acc: &mut [f32], bits: Bits) {
    debug_assert_eq!(codes.len(), bits.packed_len(acc.len()));
    match bits {
        Bits::Int8 => axpy_codes_k::<8>(alpha, codes, acc),
        Bits::Int4 => axpy_codes_k::<4>(alpha, codes, acc),
        Bits::Int2 => axpy_codes_k::<2>(alpha, codes, acc),
    }
}

#[inline(always)]
fn axpy_codes_k<const W: u8>(alpha: f32, codes: &[u8], acc: &mut [f32]) {
    let n = acc.len();
    let a = f32x8::splat(alpha);
    let mut e = 0;
    while e + 16 <= n {
        let (x0, x1) = codes16::<W>(codes, e);
        let v = x0.mul_add(a, load8(&acc[e..]));
        store8(&mut acc[e..], v);
        let v = x1.mul_add(a, load8(&acc[e + 8..]));
        store8(&mut acc[e + 8..], v);
        e += 16;
    }
    if e + 8 <= n {
        let v = codes8::<W>(codes, e).mul_add(a, load8(&acc[e..]));
        store8(&mut acc[e..], v);
        e += 8;
    }
    for (j, o) in acc.iter_mut().enumerate().skip(e) {
        *o += alpha * code_at::<W>(codes, j);
    }
}

/// Scalar twin of [`axpy_codes`].
pub fn axpy_codes_scalar(alpha: f32, codes: &[u8], acc: &mut [f32], bits: Bits) {
    for (j, o) in acc.iter_mut().enumerate() {
        *o += alpha * get(codes, j, bits) as f32;
    }
}

/// Calls `$f::<W, HD>(args)` with `HD` the head dim if it is one of the common ones
/// (compiled as straight-line code), else 0 (any length).
macro_rules! by_shape {
    ($bits:expr, $hd:expr, $f:ident($($a:expr),* $(,)?)) => {
        match ($bits, $hd) {
            (Bits::Int8, 32) => $f::<8, 32>($($a),*),
            (Bits::Int8, 64) => $f::<8, 64>($($a),*),
            (Bits::Int8, 128) => $f::<8, 128>($($a),*),
            (Bits::Int8, _) => $f::<8, 0>($($a),*),
            (Bits::Int4, 32) => $f::<4, 32>($($a),*),
            (Bits::Int4, 64) => $f::<4, 64>($($a),*),
            (Bits::Int4, 128) => $f::<4, 128>($($a),*),
            (Bits::Int4, _) => $f::<4, 0>($($a),*),
            (Bits::Int2, 32) => $f::<2, 32>($($a),*),
            (Bits::Int2, 64) => $f::<2, 64>($($a),*),
            (Bits::Int2, 128) => $f::<2, 128>($($a),*),
            (Bits::Int2, _) => $f::<2, 0>($($a),*),
        }
    };
}

/// Scores of a run of K rows of one group against `nq = bias.len()` folded queries:
/// `out[j * stride + r] = dot_codes(row_r, qs_j) + bias[j]`. `codes`: `(rows, packed)`;
/// `qs`: `(nq, head_dim)` from [`fold_channels`]. Eight rows at a time: their lane sums
/// are transposed and added so one vector store writes eight scores.
pub fn dot_codes_rows(
    codes: &[u8],
    qs: &[f32],
    bias: &[f32],
    bits: Bits,
    out: &mut [f32],
    stride: usize,
) {
    let hd = qs.len() / bias.len();
    debug_assert_eq!(codes.len() % bits.packed_len(hd), 0);
    by_shape!(bits, hd, dot_codes_rows_k(codes, qs, bias, out, stride))
}

/// The portable twin of [`super::dot_codes_groups`] (same arguments and contract): per
/// group, every query's fold ([`fold_channels`]), then [`dot_codes_rows`] over the group's
/// rows.
#[inline]
pub(super) fn dot_codes_groups(
    run: &KRun<'_>,
    q: &[f32],
    fold: &mut [f32],
    out: &mut [f32],
    stride: usize,
) {
    let KRun {
        codes,
        hd,
        scale,
        zero,
        group,
        offset,
        bits,
    } = *run;
    let p = bits.packed_len(hd);
    let (nq, n) = (q.len() / hd, codes.len() / p);
    let mut bias = [0.0f32; 16];
    let mut heap = Vec::new();
    let bias: &mut [f32] = if nq <= bias.len() {
        &mut bias[..nq]
    } else {
        heap.resize(nq, 0.0);
        &mut heap
    };
    let fold = &mut fold[..nq * hd];
    for k in 0..(offset + n).div_ceil(group) {
        let a = (k * group).saturating_sub(offset);
        let b = ((k + 1) * group - offset).min(n);
        let (s, z) = (&scale[k * hd..(k + 1) * hd], &zero[k * hd..(k + 1) * hd]);
        for ((q, f), b) in q
            .chunks_exact(hd)
            .zip(fold.chunks_exact_mut(hd))
            .zip(bias.iter_mut())
        {
            *b = fold_channels(q, s, z, f);
        }
        dot_codes_rows(
            &codes[a * p..b * p],
            fold,
            bias,
            bits,
            &mut out[a..],
            stride,
        );
    }
}

fn dot_codes_rows_k<const W: u8, const HD: usize>(
    codes: &[u8],
    qs: &[f32],
    bias: &[f32],
    out: &mut [f32],
    stride: usize,
) {
    let hd = if HD != 0 { HD } else { qs.len() / bias.len() };
    let p = packed::<W>(hd);
    let rows = codes.len() / p;
    for (j, (q, &b)) in qs.chunks_exact(hd).zip(bias).enumerate() {
        let o = &mut out[j * stride..j * stride + rows];
        // Blocks of 8 rows; the last block pads with zeros, so every row is summed in
        // the same order wherever it falls.
        for (blk, o) in o.chunks_mut(8).enumerate() {
            let r0 = blk * 8;
            let part: [(f32x8, f32); 8] = std::array::from_fn(|k| {
                if k < o.len() {
                    dot_lanes::<W, HD>(&codes[(r0 + k) * p..], q)
                } else {
                    (f32x8::ZERO, 0.0)
                }
            });
            let scores = (reduce8(part) + f32x8::splat(b)).to_array();
            o.copy_from_slice(&scores[..o.len()]);
        }
    }
}

/// The portable twin of [`super::axpy_codes_rows`] (same arguments and contract).
#[inline]
pub(super) fn axpy_codes_rows(
    run: &VRun<'_>,
    p: &[f32],
    stride: usize,
    acc: &mut [f32],
    bias: &mut [f32],
) {
    let hd = acc.len() / bias.len();
    by_shape!(run.bits, hd, axpy_codes_rows_k(run, p, stride, acc, bias))
}

fn axpy_codes_rows_k<const W: u8, const HD: usize>(
    run: &VRun<'_>,
    p: &[f32],
    stride: usize,
    acc: &mut [f32],
    bias: &mut [f32],
) {
    let VRun {
        codes, scale, zero, ..
    } = *run;
    const CHUNK: usize = 64;
    const MAX_LANES: usize = 16;
    let hd = if HD != 0 { HD } else { acc.len() / bias.len() };
    let pk = packed::<W>(hd);
    let rows = scale.len();
    let (mut s, mut z) = ([0.0f32; CHUNK], [0.0f32; CHUNK]);
    let mut r0 = 0;
    while r0 < rows {
        let m = (rows - r0).min(CHUNK);
        scale[r0..r0 + m].convert_to_f32_slice(&mut s[..m]);
        zero[r0..r0 + m].convert_to_f32_slice(&mut z[..m]);
        let codes = &codes[r0 * pk..(r0 + m) * pk];
        for (j, (a, b)) in acc.chunks_exact_mut(hd).zip(bias.iter_mut()).enumerate() {
            let pj = &p[j * stride + r0..j * stride + r0 + m];
            let rows = pj.iter().zip(codes.chunks_exact(pk)).enumerate();
            if HD == 0 || !HD.is_multiple_of(16) || HD / 8 > MAX_LANES {
                for (r, (&w, row)) in rows {
                    if w != 0.0 {
                        axpy_codes_k::<W>(w * s[r], row, a);
                        *b += w * z[r];
                    }
                }
                continue;
            }
            // Known head dim: the accumulator stays in registers for the whole chunk.
            let lanes = HD / 8;
            let mut regs = [f32x8::ZERO; MAX_LANES];
            for (c, v) in regs.iter_mut().enumerate().take(lanes) {
                *v = load8(&a[c * 8..]);
            }
            for (r, (&w, row)) in rows {
                if w != 0.0 {
                    let ws = f32x8::splat(w * s[r]);
                    for e in (0..HD).step_by(16) {
                        let (x0, x1) = codes16::<W>(row, e);
                        regs[e / 8] = x0.mul_add(ws, regs[e / 8]);
                        regs[e / 8 + 1] = x1.mul_add(ws, regs[e / 8 + 1]);
                    }
                    *b += w * z[r];
                }
            }
            for (c, v) in regs.iter().enumerate().take(lanes) {
                store8(&mut a[c * 8..], *v);
            }
        }
        r0 += m;
    }
}

/// SIMD twin of [`dequantize_channels`], bit-identical to it (multiply, then add: no FMA).
#[inline]
pub fn dequantize_channels_simd(
    codes: &[u8],
    scale: &[f32],
    zero: &[f32],
    bits: Bits,
    out: &mut [f32],
) {
    let n = out.len();
    debug_assert_eq!(codes.len(), bits.packed_len(n));
    debug_assert_eq!(scale.len(), n);
    debug_assert_eq!(zero.len(), n);
    match bits {
        Bits::Int8 => dequantize_channels_k::<8>(codes, scale, zero, out),
        Bits::Int4 => dequantize_channels_k::<4>(codes, scale, zero, out),
        Bits::Int2 => dequantize_channels_k::<2>(codes, scale, zero, out),
    }
}

#[inline(always)]
fn dequantize_channels_k<const W: u8>(codes: &[u8], scale: &[f32], zero: &[f32], out: &mut [f32]) {
    let n = out.len();
    let mut e = 0;
    while e + 16 <= n {
        let (x0, x1) = codes16::<W>(codes, e);
        store8(&mut out[e..], x0 * load8(&scale[e..]) + load8(&zero[e..]));
        store8(
            &mut out[e + 8..],
            x1 * load8(&scale[e + 8..]) + load8(&zero[e + 8..]),
        );
        e += 16;
    }
    if e + 8 <= n {
        let x = codes8::<W>(codes, e);
        store8(&mut out[e..], x * load8(&scale[e..]) + load8(&zero[e..]));
        e += 8;
    }
    for j in e..n {
        out[j] = code_at::<W>(codes, j) * scale[j] + zero[j];
    }
}

// Declared after the macro above, which the multi-query forms use too.
mod multi;
pub(super) use multi::{axpy_codes_rows_multi, dot_codes_groups_multi};
