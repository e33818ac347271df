//! The score kernels of keys rebuilt in blocks (`cache` positions mode, pre-RoPE keys:
//! [`dot_block`], [`rotate_dot_block`]) and the softmax, for [`super`]'s attention.

use crate::ops::simd::{load8, reduce8, store8};
use wide::f32x8;

/// Rows per block of rebuilt keys in `cache` positions mode (one f32x8 of scores).
pub(super) const BLOCK: usize = 8;

/// `out[r] = q · rows[r]` for a block of `m = out.len() ≤ BLOCK` rows (`rows`:
/// `(m, head_dim)`). One accumulator per row, the eight reduced together with a
/// transpose, so eight scores cost one reduction. A partial block pads with zero rows,
/// so every row's score is summed in the same order whatever block it falls in (results
/// do not depend on how the rows are cut into runs).
#[inline]
pub(super) fn dot_block(q: &[f32], rows: &[f32], out: &mut [f32]) {
    let hd = q.len();
    let m = out.len();
    debug_assert!(m <= BLOCK && rows.len() == m * hd);
    let mut acc = [f32x8::ZERO; BLOCK];
    let mut i = 0;
    while i + 8 <= hd {
        let qv = load8(&q[i..]);
        for (r, a) in acc.iter_mut().enumerate().take(m) {
            *a = load8(&rows[r * hd + i..]).mul_add(qv, *a);
        }
        i += 8;
    }
    let part: [(f32x8, f32); BLOCK] = std::array::from_fn(|r| {
        let tail = if r < m {
            let row = &rows[r * hd..(r + 1) * hd];
            (i..hd).map(|c| q[c] * row[c]).sum()
        } else {
            0.0
        };
        (acc[r], tail)
    });
    out.copy_from_slice(&reduce8(part).to_array()[..m]);
}

/// Scores of every query in `qs` (`(queries, head_dim)`, rotated) against a block of
/// `m ≤ BLOCK` stored keys `rows` (`(m, head_dim)`, not yet rotated) that RoPE rotates
/// at read time: `out[j * stride + r] = q_j · rot(rows[r])`, row `r` rotated by
/// `cos[r * half..]`, `sin[r * half..]` (`half = head_dim / 2`, a multiple of 8) as
/// [`super::rotate_inline`] rotates it. The rotated row stays in registers and each of its
/// chunks serves up to four queries (a GQA group's heads). A row's score is summed in one
/// fixed order — lane accumulators over the chunk pairs `(i, half + i)` in turn, then the
/// lanes as [`reduce8`] adds them — in a full block or not, so it does not depend on how
/// the rows were cut into runs or blocks.
#[inline]
pub(super) fn rotate_dot_block(
    qs: &[f32],
    rows: &[f32],
    hd: usize,
    (cos, sin): (&[f32], &[f32]),
    out: &mut [f32],
    stride: usize,
) {
    let (m, half) = (rows.len() / hd, hd / 2);
    debug_assert!(half.is_multiple_of(8) && m <= BLOCK && qs.len().is_multiple_of(hd));
    let nq = qs.len() / hd;
    if m < BLOCK {
        for (j, q) in qs.chunks_exact(hd).enumerate() {
            let mut acc = [f32x8::ZERO; BLOCK];
            for (r, row) in rows.chunks_exact(hd).enumerate() {
                acc[r] = rotate_dot_lanes(q, row, (&cos[r * half..], &sin[r * half..]));
            }
            out[j * stride..j * stride + m].copy_from_slice(&reduce_rows(&acc)[..m]);
        }
        return;
    }
    let mut j = 0;
    while j < nq {
        let take = (nq - j).min(4);
        let q = &qs[j * hd..(j + take) * hd];
        let o = &mut out[j * stride..];
        match take {
            4 => rotate_dot_k::<4>(q, rows, (cos, sin), o, stride),
            3 => rotate_dot_k::<3>(q, rows, (cos, sin), o, stride),
            2 => rotate_dot_k::<2>(q, rows, (cos, sin), o, stride),
            _ => rotate_dot_k::<1>(q, rows, (cos, sin), o, stride),
        }
        j += take;
    }
}

/// One rotated chunk pair of a row: `(a·c − b·s, b·c + a·s)`, as [`super::rotate_inline`].
#[inline(always)]
fn rotate_chunk(row: &[f32], half: usize, i: usize, cos: &[f32], sin: &[f32]) -> (f32x8, f32x8) {
    let (a, b) = (load8(&row[i..]), load8(&row[half + i..]));
    let (c, s) = (load8(&cos[i..]), load8(&sin[i..]));
    (a * c - b * s, b * c + a * s)
}

/// The lane accumulators of one row's score in [`rotate_dot_block`]'s order.
#[inline(always)]
fn rotate_dot_lanes(q: &[f32], row: &[f32], (cos, sin): (&[f32], &[f32])) -> f32x8 {
    let half = row.len() / 2;
    let mut acc = f32x8::ZERO;
    let mut i = 0;
    while i + 8 <= half {
        let (ra, rb) = rotate_chunk(row, half, i, cos, sin);
        acc = ra.mul_add(load8(&q[i..]), acc);
        acc = rb.mul_add(load8(&q[half + i..]), acc);
        i += 8;
    }
    acc
}

/// [`rotate_dot_block`] for a full block and `Q` queries.
#[inline(always)]
fn rotate_dot_k<const Q: usize>(
    qs: &[f32],
    rows: &[f32],
    (cos, sin): (&[f32], &[f32]),
    out: &mut [f32],
    stride: usize,
) {
    let hd = qs.len() / Q;
    let half = hd / 2;
    let rows: &[f32] = &rows[..BLOCK * hd];
    let (cos, sin) = (&cos[..BLOCK * half], &sin[..BLOCK * half]);
    let mut acc = [[f32x8::ZERO; BLOCK]; Q];
    let mut i = 0;
    while i + 8 <= half {
        let qa: [f32x8; Q] = std::array::from_fn(|j| load8(&qs[j * hd + i..]));
        let qb: [f32x8; Q] = std::array::from_fn(|j| load8(&qs[j * hd + half + i..]));
        for r in 0..BLOCK {
            let row = &rows[r * hd..(r + 1) * hd];
            let (ra, rb) = rotate_chunk(row, half, i, &cos[r * half..], &sin[r * half..]);
            for j in 0..Q {
                acc[j][r] = ra.mul_add(qa[j], acc[j][r]);
                acc[j][r] = rb.mul_add(qb[j], acc[j][r]);
            }
        }
        i += 8;
    }
    for (j, a) in acc.iter().enumerate() {
        out[j * stride..j * stride + BLOCK].copy_from_slice(&reduce_rows(a));
    }
}

/// Each row's lane accumulator summed to its score with [`reduce8`] (no scalar tail: an
/// empty sum, as [`dot_block`] adds for a row without one). A row's sum does not depend
/// on the other rows of the block.
#[inline(always)]
fn reduce_rows(acc: &[f32x8; BLOCK]) -> [f32; BLOCK] {
    let tail: f32 = std::iter::empty::<f32>().sum();
    reduce8(std::array::from_fn(|r| (acc[r], tail))).to_array()
}

/// In-place softmax with max subtraction; entries of `-inf` get weight 0.
///
/// Vectorised: the max over eight independent chains (exact in any order), `exp` eight
/// lanes at a time (`wide`'s polynomial, within 2 ulp of libm's; `exp(−inf) = 0`), the
/// sum over eight lane accumulators, one division per value. Differs from the
/// reference's scalar loop by rounding only (the attention tests bound it). The
/// `avx512` variant (`kivi::KvKernel`) computes the same `exp` per value sixteen
/// lanes at a time and adds the sum in another order.
///
/// `kernel` is the session's KIVI kernel variant ([`crate::exec::ExecOptions::kv_kernel`]):
/// `avx512` runs its own softmax, every other variant [`softmax_portable`].
pub fn softmax(x: &mut [f32], kernel: crate::kivi::KvKernel) {
    #[cfg(target_arch = "x86_64")]
    if kernel == crate::kivi::KvKernel::Avx512 && kernel.is_supported() {
        // SAFETY: the AVX-512 variant runs only when the CPU has AVX-512 F (checked just
        // above; the options only name supported variants, so this check never fails).
        unsafe { crate::kivi::softmax_avx512(x) };
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = kernel;
    softmax_portable(x)
}

/// [`softmax`] on `wide` vectors (the portable variant).
pub fn softmax_portable(x: &mut [f32]) {
    let n = x.len();
    let n8 = n - n % 8;
    let mut mv = f32x8::splat(f32::NEG_INFINITY);
    for c in x[..n8].chunks_exact(8) {
        mv = mv.max(load8(c));
    }
    let max = x[n8..].iter().copied().fold(
        mv.to_array().into_iter().fold(f32::NEG_INFINITY, f32::max),
        f32::max,
    );
    let m = f32x8::splat(max);
    let mut sv = f32x8::ZERO;
    for c in x[..n8].chunks_exact_mut(8) {
        let e = (load8(c) - m).exp();
        sv += e;
        store8(c, e);
    }
    let mut sum = sv.reduce_add();
    for v in x[n8..].iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let total = f32x8::splat(sum);
    for c in x[..n8].chunks_exact_mut(8) {
        store8(c, load8(c) / total);
    }
    for v in x[n8..].iter_mut() {
        *v /= sum;
    }
}
