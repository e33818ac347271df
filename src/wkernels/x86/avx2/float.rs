//! The `avx2` float rows: AVX2 + FMA + F16C. They keep the 8-lane order of
//! [`crate::wkernels::float`] exactly (one multiply-add per term and lane, fused iff
//! `FUSED`, in increasing column), so they equal the scalar twin bit for bit.

use crate::ops::simd::Elem;
use crate::wkernels::float::{finish, tail, FUSED, RB};
use half::{bf16, f16};
use std::arch::x86_64::*;

/// An element type the x86 kernels widen in registers (exactly: f16 and bf16 values are
/// all representable in f32).
pub trait X86Elem: Elem {
    /// Eight values at `p` as f32.
    ///
    /// # Safety
    /// `p..p + 8` must be readable; the caller must have AVX2 and F16C.
    unsafe fn ld8(p: *const Self) -> __m256;
}

impl X86Elem for f32 {
    #[inline(always)]
    unsafe fn ld8(p: *const f32) -> __m256 {
        // SAFETY: 8 readable floats (caller).
        unsafe { _mm256_loadu_ps(p) }
    }
}

impl X86Elem for f16 {
    /// F16C `vcvtph2ps` (exact, subnormals and ±65504 included).
    #[inline(always)]
    unsafe fn ld8(p: *const f16) -> __m256 {
        // SAFETY: 8 readable f16 = 16 bytes (caller).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
}

impl X86Elem for bf16 {
    /// Zero-extend to 32 bits and shift up 16: bf16 is the top half of an f32.
    #[inline(always)]
    unsafe fn ld8(p: *const bf16) -> __m256 {
        // SAFETY: 8 readable bf16 = 16 bytes (caller).
        unsafe {
            let w = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(w))
        }
    }
}

/// `w · x + acc` per lane, fused iff [`FUSED`] (the order every variant shares).
#[target_feature(enable = "avx2,fma")]
#[inline]
fn fma8(w: __m256, x: __m256, acc: __m256) -> __m256 {
    if FUSED {
        _mm256_fmadd_ps(w, x, acc)
    } else {
        _mm256_add_ps(_mm256_mul_ps(w, x), acc)
    }
}

/// Row `r`'s start, rows past the last one clamped to it (their results are dropped).
#[inline(always)]
fn row_at<E>(w: &[E], cols: usize, r: usize) -> &[E] {
    let r = r.min(w.len() / cols - 1);
    &w[r * cols..(r + 1) * cols]
}

/// `out[j] = row (r0 + j) · x`, AVX2: eight rows in flight (one `ymm` accumulator each),
/// or one row at a time when `streamed`.
///
/// # Safety
/// AVX2, FMA and F16C must be available; rows `r0..r0 + out.len()` must be in `w` and
/// `x.len() >= cols` (checked by the slices).
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn float_rows<E: X86Elem>(
    w: &[E],
    cols: usize,
    r0: usize,
    x: &[f32],
    out: &mut [f32],
    streamed: bool,
) {
    let x = &x[..cols];
    let n8 = cols - cols % 8;
    if streamed {
        for (j, o) in out.iter_mut().enumerate() {
            let row = row_at(w, cols, r0 + j);
            let mut acc = _mm256_setzero_ps();
            let mut i = 0;
            while i < n8 {
                // SAFETY: `i + 8 <= n8 <= cols`, the length of `row` and `x`.
                unsafe {
                    let xv = _mm256_loadu_ps(x.as_ptr().add(i));
                    acc = fma8(E::ld8(row.as_ptr().add(i)), xv, acc);
                }
                i += 8;
            }
            *o = finish(lanes8(acc), tail(row, x, n8));
        }
        return;
    }
    for (b, o) in out.chunks_mut(RB).enumerate() {
        let rows: [&[E]; RB] = std::array::from_fn(|k| row_at(w, cols, r0 + b * RB + k));
        let mut acc = [_mm256_setzero_ps(); RB];
        let mut i = 0;
        while i < n8 {
            // SAFETY: `i + 8 <= n8 <= cols`, the length of every row and of `x`.
            unsafe {
                let xv = _mm256_loadu_ps(x.as_ptr().add(i));
                for (a, row) in acc.iter_mut().zip(&rows) {
                    *a = fma8(E::ld8(row.as_ptr().add(i)), xv, *a);
                }
            }
            i += 8;
        }
        for (k, ok) in o.iter_mut().enumerate() {
            *ok = finish(lanes8(acc[k]), tail(rows[k], x, n8));
        }
    }
}

#[inline(always)]
fn lanes8(v: __m256) -> [f32; 8] {
    // SAFETY: `__m256` and `[f32; 8]` have the same size, every bit pattern valid.
    unsafe { std::mem::transmute::<__m256, [f32; 8]>(v) }
}
