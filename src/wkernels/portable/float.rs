//! The `portable` float rows: `wide::f32x8` (f16 widened through `half`'s slice
//! conversion, bf16 with an integer shift: [`Elem::load8`]), in the order of
//! [`crate::wkernels::float`]; also what `neon-dotprod` runs for floats (NEON through
//! `wide`).

use crate::ops::simd::{load8, reduce8, Elem};
use crate::wkernels::float::{finish, tail, RB};
use wide::f32x8;

/// `out[j] = row (r0 + j) · x` for float rows of `cols` values in `w`: rows interleaved
/// eight at a time, or streamed one by one (`streamed`), in the order of
/// [`crate::wkernels::float`].
pub fn float_rows<E: Elem>(
    w: &[E],
    cols: usize,
    r0: usize,
    x: &[f32],
    out: &mut [f32],
    streamed: bool,
) {
    if streamed {
        for (j, o) in out.iter_mut().enumerate() {
            let r = r0 + j;
            *o = row1(&w[r * cols..(r + 1) * cols], x);
        }
    } else {
        for (b, o) in out.chunks_mut(RB).enumerate() {
            rows8(w, cols, r0 + b * RB, x, o);
        }
    }
}

/// `out[k] = row (r0 + k) · x` for `k < out.len() ≤ 8`, in the canonical order. Rows
/// past the end are computed on a repeat of the last row and dropped, so every row is
/// reduced the same way wherever it falls.
#[inline(always)]
fn rows8<E: Elem>(w: &[E], cols: usize, r0: usize, x: &[f32], out: &mut [f32]) {
    let last = w.len() / cols - 1;
    let rows: [&[E]; RB] = std::array::from_fn(|k| {
        let r = (r0 + k).min(last);
        &w[r * cols..(r + 1) * cols]
    });
    let x = &x[..cols];
    let n8 = cols - cols % 8;
    let mut acc = [f32x8::ZERO; RB];
    let mut i = 0;
    while i < n8 {
        let xv = load8(&x[i..]);
        for (a, row) in acc.iter_mut().zip(&rows) {
            *a = E::load8(&row[i..]).mul_add(xv, *a);
        }
        i += 8;
    }
    let part: [(f32x8, f32); RB] = std::array::from_fn(|k| (acc[k], tail(rows[k], x, n8)));
    let n = out.len();
    out.copy_from_slice(&reduce8(part).to_array()[..n]);
}

/// One row's dot product in the canonical order: one accumulator, then the same lane
/// tree and tail as [`rows8`] (equal values, bit for bit).
#[inline(always)]
fn row1<E: Elem>(row: &[E], x: &[f32]) -> f32 {
    let cols = row.len();
    let x = &x[..cols];
    let n8 = cols - cols % 8;
    let mut acc = f32x8::ZERO;
    let mut i = 0;
    while i < n8 {
        acc = E::load8(&row[i..]).mul_add(load8(&x[i..]), acc);
        i += 8;
    }
    finish(acc.to_array(), tail(row, x, n8))
}
