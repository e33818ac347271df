//! The `portable` multi-query (grouped-query attention) forms of the fused KIVI kernels:
//! the query heads that share one KV head (`nq` of them, at most
//! [`MULTI_MAX`](crate::kivi::MULTI_MAX)) read every code once: a block of codes is unpacked
//! once and applied to each head (K: one dot per head and row with that head's folded
//! query; V: one accumulator per head with that head's probability). Per head the
//! arithmetic and its order are exactly those of the single-query kernel (the parent
//! module), so every head's result equals it bit for bit (`tests/kv_gqa.rs`).

use super::*;
use crate::kivi::MULTI_MAX;

/// The portable twin of [`crate::kivi::dot_codes_groups_multi`] for `2 ..= MULTI_MAX`
/// queries (`q.len() / hd`): per group, every head's fold (as
/// [`dot_codes_groups`](super::dot_codes_groups)), then the group's rows against all of them.
#[inline]
pub(in crate::kivi) fn dot_codes_groups_multi(
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
    let g = q.len() / hd;
    let p = bits.packed_len(hd);
    let n = codes.len() / p;
    let mut bias = [0.0f32; MULTI_MAX];
    let (fold, bias) = (&mut fold[..g * hd], &mut bias[..g]);
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
        let (codes, out) = (&codes[a * p..b * p], &mut out[a..]);
        by_shape!(bits, hd, dot_rows_multi(g, codes, fold, bias, out, stride));
    }
}

/// [`dot_codes_rows_multi_k`] for `g` (2 ..= 8) heads.
fn dot_rows_multi<const W: u8, const HD: usize>(
    g: usize,
    codes: &[u8],
    qs: &[f32],
    bias: &[f32],
    out: &mut [f32],
    stride: usize,
) {
    by_group!(
        g,
        dot_codes_rows_multi_k < W,
        HD > (codes, qs, bias, out, stride)
    )
}

/// [`dot_codes_rows_k`] for exactly `G` folded queries (`qs`: `(G, hd)`): each block of 8
/// rows is unpacked once into floats (the exact values `codes16` / `codes8` / `code_at`
/// give), then every head runs `dot_codes_rows_k`'s block on them ([`dot_lanes_f`]: the
/// same FMAs in the same order), so head `j`'s scores equal it bit for bit.
fn dot_codes_rows_multi_k<const W: u8, const HD: usize, const G: usize>(
    codes: &[u8],
    qs: &[f32],
    bias: &[f32],
    out: &mut [f32],
    stride: usize,
) {
    let hd = if HD != 0 { HD } else { qs.len() / G };
    let p = packed::<W>(hd);
    let rows = codes.len() / p;
    assert!(qs.len() == G * hd && bias.len() == G && out.len() >= (G - 1) * stride + rows);
    let mut stack = [0.0f32; 8 * 128];
    let mut heap = Vec::new();
    let u: &mut [f32] = if hd <= 128 {
        &mut stack[..8 * hd]
    } else {
        heap.resize(8 * hd, 0.0);
        &mut heap
    };
    for r0 in (0..rows).step_by(8) {
        let m = (rows - r0).min(8);
        for (k, u) in u.chunks_exact_mut(hd).take(m).enumerate() {
            unpack_row::<W, HD>(&codes[(r0 + k) * p..], u);
        }
        for (j, (q, &b)) in qs.chunks_exact(hd).zip(bias).enumerate() {
            // Rows past the run pad with zeros, as in `dot_codes_rows_k`.
            let part: [(f32x8, f32); 8] = std::array::from_fn(|k| {
                if k < m {
                    dot_lanes_f::<HD>(&u[k * hd..(k + 1) * hd], q)
                } else {
                    (f32x8::ZERO, 0.0)
                }
            });
            let scores = (reduce8(part) + f32x8::splat(b)).to_array();
            out[j * stride + r0..j * stride + r0 + m].copy_from_slice(&scores[..m]);
        }
    }
}

/// The offset codes of one row as floats (`u.len()` of them), by the same steps as
/// [`dot_lanes`] reads them.
#[inline(always)]
fn unpack_row<const W: u8, const HD: usize>(codes: &[u8], u: &mut [f32]) {
    let n = if HD != 0 { HD } else { u.len() };
    let codes = &codes[..packed::<W>(n)];
    let mut e = 0;
    while e + 16 <= n {
        let (x0, x1) = codes16::<W>(codes, e);
        store8(&mut u[e..], x0);
        store8(&mut u[e + 8..], x1);
        e += 16;
    }
    if e + 8 <= n {
        store8(&mut u[e..], codes8::<W>(codes, e));
        e += 8;
    }
    for (j, x) in u[..n].iter_mut().enumerate().skip(e) {
        *x = code_at::<W>(codes, j);
    }
}

/// [`dot_lanes`] on codes already unpacked to floats (`u` from [`unpack_row`]): the same
/// FMAs, accumulators and tail, so the same bits.
#[inline(always)]
fn dot_lanes_f<const HD: usize>(u: &[f32], w: &[f32]) -> (f32x8, f32) {
    let n = if HD != 0 { HD } else { w.len() };
    let (u, w) = (&u[..n], &w[..n]);
    let (mut a0, mut a1) = (f32x8::ZERO, f32x8::ZERO);
    let mut e = 0;
    while e + 16 <= n {
        a0 = load8(&u[e..]).mul_add(load8(&w[e..]), a0);
        a1 = load8(&u[e + 8..]).mul_add(load8(&w[e + 8..]), a1);
        e += 16;
    }
    if e + 8 <= n {
        a0 = load8(&u[e..]).mul_add(load8(&w[e..]), a0);
        e += 8;
    }
    let mut tail = 0.0f32;
    for (&x, &wj) in u.iter().zip(w).skip(e) {
        tail += x * wj;
    }
    (a0 + a1, tail)
}

/// The portable twin of [`crate::kivi::axpy_codes_rows_multi`] for `2 ..= MULTI_MAX`
/// queries (`bias.len()`).
#[inline]
pub(in crate::kivi) fn axpy_codes_rows_multi(
    run: &VRun<'_>,
    p: &[f32],
    stride: usize,
    acc: &mut [f32],
    bias: &mut [f32],
) {
    let g = bias.len();
    let hd = acc.len() / g;
    by_shape!(run.bits, hd, axpy_rows_multi(g, run, p, stride, acc, bias));
}

/// [`axpy_codes_rows_multi_k`] for `g` (2 ..= 8) heads.
fn axpy_rows_multi<const W: u8, const HD: usize>(
    g: usize,
    run: &VRun<'_>,
    p: &[f32],
    stride: usize,
    acc: &mut [f32],
    bias: &mut [f32],
) {
    by_group!(
        g,
        axpy_codes_rows_multi_k < W,
        HD > (run, p, stride, acc, bias)
    )
}

/// [`axpy_codes_rows_k`] for exactly `G` queries, each row's codes unpacked once for all
/// of them (its register form; head dims without one run the single-query kernel head by
/// head). Head `j` gets exactly `axpy_codes_rows_k`'s operations, including skipping rows
/// whose weight is zero.
fn axpy_codes_rows_multi_k<const W: u8, const HD: usize, const G: usize>(
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
    let hd = if HD != 0 { HD } else { acc.len() / G };
    let rows = scale.len();
    assert!(acc.len() == G * hd && bias.len() == G);
    if HD == 0 || !HD.is_multiple_of(16) || HD / 8 > MAX_LANES {
        for (j, (a, b)) in acc
            .chunks_exact_mut(hd)
            .zip(bias.chunks_exact_mut(1))
            .enumerate()
        {
            axpy_codes_rows_k::<W, HD>(run, &p[j * stride..], stride, a, b);
        }
        return;
    }
    assert!(p.len() >= (G - 1) * stride + rows);
    let lanes = HD / 8;
    let pk = packed::<W>(HD);
    let (mut s, mut z) = ([0.0f32; CHUNK], [0.0f32; CHUNK]);
    let mut r0 = 0;
    while r0 < rows {
        let m = (rows - r0).min(CHUNK);
        scale[r0..r0 + m].convert_to_f32_slice(&mut s[..m]);
        zero[r0..r0 + m].convert_to_f32_slice(&mut z[..m]);
        let codes = &codes[r0 * pk..(r0 + m) * pk];
        let mut regs = [[f32x8::ZERO; MAX_LANES]; G];
        for (j, rj) in regs.iter_mut().enumerate() {
            for (c, v) in rj.iter_mut().enumerate().take(lanes) {
                *v = load8(&acc[j * HD + c * 8..]);
            }
        }
        for (r, row) in codes.chunks_exact(pk).enumerate() {
            let w: [f32; G] = std::array::from_fn(|j| p[j * stride + r0 + r]);
            if w.iter().all(|&x| x == 0.0) {
                continue;
            }
            let ws: [f32x8; G] = std::array::from_fn(|j| f32x8::splat(w[j] * s[r]));
            for e in (0..HD).step_by(16) {
                let (x0, x1) = codes16::<W>(row, e);
                for j in 0..G {
                    if w[j] != 0.0 {
                        regs[j][e / 8] = x0.mul_add(ws[j], regs[j][e / 8]);
                        regs[j][e / 8 + 1] = x1.mul_add(ws[j], regs[j][e / 8 + 1]);
                    }
                }
            }
            for j in 0..G {
                if w[j] != 0.0 {
                    bias[j] += w[j] * z[r];
                }
            }
        }
        for (j, rj) in regs.iter().enumerate() {
            for (c, v) in rj.iter().enumerate().take(lanes) {
                store8(&mut acc[j * HD + c * 8..], *v);
            }
        }
        r0 += m;
    }
}
