//! Float-weight row dot products (`f32`, `f16`, `bf16` rows × an f32 vector) in kernel
//! variants chosen once at run time, behind the same dispatch point as the quantised
//! kernels ([`Kernel`], [`super::qdot::active`], `TINYGPT_KERNEL`).
//!
//! # One order for every variant
//!
//! A row's dot product `w · x` (`n = cols`, `n8 = n − n % 8`) is, in every variant:
//!
//! 1. eight lane sums, lane `l` = `Σ_{i ≡ l (mod 8), i < n8} w_i · x_i` accumulated from
//!    zero with one multiply-add per term (fused iff [`FUSED`]), in increasing `i`;
//! 2. the lanes added as `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`;
//! 3. plus the tail `Σ_{i ≥ n8} x_i · w_i` (separate multiply and add, summed from zero).
//!
//! f16 and bf16 are widened to f32 exactly before any arithmetic, so every variant equals
//! the scalar twin ([`Kernel::Scalar`], plain loops) bit for bit: the property tests in
//! `tests/float_dispatch.rs` hold each supported variant to it.
//!
//! * `scalar`: the twin (plain loops, [`madd`]);
//! * `portable`: `wide::f32x8` (any target; f16 widened through `half`'s slice conversion,
//!   bf16 with an integer shift); also what `neon-dotprod` runs (NEON through `wide`);
//! * `avx2` (`super::float_x86`): AVX2 + FMA, f16 widened by F16C `vcvtph2ps`, bf16 by
//!   `vpmovzxwd` + a 16-bit shift; 8 rows in flight, one `ymm` accumulator each, or one
//!   row at a time (`streamed`); `avx512vnni` runs this form as well. A 512-bit form that
//!   keeps the order (two rows' 8 lanes per register, row `2k` in the low half) was
//!   measured and dropped: 25% slower out of L2, no faster out of DRAM (benches/README.md).
//!
//! Not used: AVX512-BF16 `vdpbf16ps` multiplies bf16 by bf16, so it would round the
//! *activations* to bf16 (and it adds pairs of products before accumulating), a different
//! numerical contract from the reference's; the exact widen + FMA path already reads bf16
//! weights from DRAM at the read-bandwidth probe's speed (benches/README.md), so the
//! contract is kept (`docs/design.md`, summation order).

use super::qdot::Kernel;
use super::simd::{load8, reduce8, Elem};
use half::{bf16, f16};
use wide::f32x8;

/// The weights of a float matrix as their element type (row-major, `cols` per row).
#[derive(Clone, Copy)]
pub enum FloatRows<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    Bf16(&'a [bf16]),
}

/// Rows one interleaved kernel call keeps in flight (one accumulator each).
pub const RB: usize = 8;

/// Whether step 1's multiply-adds are fused: what `wide::f32x8::mul_add` (the `portable`
/// variant, and the engine's prefill micro-kernel) compiles to. `wide` 0.7 fuses only on
/// x86_64 builds with FMA enabled (`target-cpu=native` on any FMA CPU); elsewhere (aarch64
/// included) it multiplies, rounds, then adds, and so do the twin and every variant
/// (found by `tests/float_dispatch.rs` under `scripts/test-aarch64.sh`).
pub const FUSED: bool = cfg!(all(target_arch = "x86_64", target_feature = "fma"));

/// One term of step 1: `w · x + acc`, fused iff [`FUSED`].
#[inline(always)]
pub fn madd(w: f32, x: f32, acc: f32) -> f32 {
    if FUSED {
        w.mul_add(x, acc)
    } else {
        w * x + acc
    }
}

/// Steps 2 and 3 of the order (module docs): one row's eight lane sums and tail.
#[inline(always)]
pub fn finish(l: [f32; 8], tail: f32) -> f32 {
    (((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]))) + tail
}

/// `Σ_{i ≥ n8} x_i · w_i`, summed from zero (step 3 of the order).
#[inline(always)]
pub(crate) fn tail<E: Elem>(w: &[E], x: &[f32], n8: usize) -> f32 {
    let mut t = 0.0f32;
    for (wi, xi) in w[n8..].iter().zip(&x[n8..]) {
        t += xi * wi.to_f32();
    }
    t
}

/// `out[j] = row (r0 + j) · x` for every `j < out.len()` (rows of `cols` values in `w`),
/// with kernel `kernel`: the order in the module docs, whichever variant runs. `streamed`
/// chooses how the rows are walked (see `Matrix::set_streamed`), never the values. A
/// variant this CPU does not support runs the scalar twin.
pub fn rows_with(
    kernel: Kernel,
    w: FloatRows,
    cols: usize,
    r0: usize,
    x: &[f32],
    out: &mut [f32],
    streamed: bool,
) {
    match w {
        FloatRows::F32(w) => rows_elem(kernel, w, cols, r0, x, out, streamed),
        FloatRows::F16(w) => rows_elem(kernel, w, cols, r0, x, out, streamed),
        FloatRows::Bf16(w) => rows_elem(kernel, w, cols, r0, x, out, streamed),
    }
}

#[cfg(target_arch = "x86_64")]
use super::float_x86::X86Elem as ArchElem;

/// Without an x86 variant every element type qualifies.
#[cfg(not(target_arch = "x86_64"))]
trait ArchElem: Elem {}
#[cfg(not(target_arch = "x86_64"))]
impl<E: Elem> ArchElem for E {}

#[inline(always)]
fn rows_elem<E: ArchElem>(
    kernel: Kernel,
    w: &[E],
    cols: usize,
    r0: usize,
    x: &[f32],
    out: &mut [f32],
    streamed: bool,
) {
    debug_assert!(x.len() >= cols);
    debug_assert!((r0 + out.len()) * cols <= w.len());
    if out.is_empty() {
        return;
    }
    match kernel {
        // `avx512vnni` runs the AVX2 form too: 16 lanes holding two rows' 8-lane sums
        // (the only 512-bit layout that keeps the order) read 25% slower out of L2 and no
        // faster out of DRAM on the AVX-512 machine measured (benches/README.md).
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 | Kernel::Avx512Vnni
            if kernel.is_supported() && Kernel::Avx2.is_supported() =>
        {
            // SAFETY: AVX2, FMA and F16C were detected at run time just above; the rows
            // read are `r0..r0 + out.len()` (in `w`, checked above) and `x[..cols]`.
            unsafe { super::float_x86::rows_avx2(w, cols, r0, x, out, streamed) }
        }
        Kernel::Scalar => {
            for (j, o) in out.iter_mut().enumerate() {
                let r = r0 + j;
                *o = row_scalar(&w[r * cols..(r + 1) * cols], x);
            }
        }
        _ => rows_portable(w, cols, r0, x, out, streamed),
    }
}

/// The scalar twin: one row in the order of the module docs, with plain loops.
pub fn row_scalar<E: Elem>(row: &[E], x: &[f32]) -> f32 {
    let cols = row.len();
    let n8 = cols - cols % 8;
    let mut l = [0.0f32; 8];
    for (wc, xc) in row[..n8].chunks_exact(8).zip(x[..n8].chunks_exact(8)) {
        for ((li, wi), xi) in l.iter_mut().zip(wc).zip(xc) {
            *li = madd(wi.to_f32(), *xi, *li);
        }
    }
    finish(l, tail(row, x, n8))
}

/// The `portable` variant: rows interleaved eight at a time, or streamed one by one.
fn rows_portable<E: Elem>(
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
