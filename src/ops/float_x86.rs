//! x86_64 variants of [`super::float_dot`]'s row dot products: AVX2 + FMA + F16C, and
//! AVX-512 F with two rows per 512-bit register. Both keep the 8-lane order of the module
//! docs there exactly (one fused multiply-add per term and lane, in increasing column),
//! so they equal the scalar twin bit for bit.

use super::float_dot::{finish, tail, RB};
use super::simd::Elem;
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

    /// Eight values at `a` in lanes 0–7 and eight at `b` in lanes 8–15, as f32.
    ///
    /// # Safety
    /// `a..a + 8` and `b..b + 8` must be readable; the caller must have AVX-512 F.
    unsafe fn ld2x8(a: *const Self, b: *const Self) -> __m512;
}

/// Two 16-byte loads into the halves of one 256-bit register (`a` low, `b` high).
///
/// # Safety
/// 16 bytes at `a` and at `b` must be readable; AVX2.
#[inline(always)]
unsafe fn two_halves<T>(a: *const T, b: *const T) -> __m256i {
    // SAFETY: the caller guarantees 16 readable bytes at each (unaligned loads).
    unsafe {
        _mm256_inserti128_si256::<1>(
            _mm256_castsi128_si256(_mm_loadu_si128(a.cast())),
            _mm_loadu_si128(b.cast()),
        )
    }
}

impl X86Elem for f32 {
    #[inline(always)]
    unsafe fn ld8(p: *const f32) -> __m256 {
        // SAFETY: 8 readable floats (caller).
        unsafe { _mm256_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn ld2x8(a: *const f32, b: *const f32) -> __m512 {
        // SAFETY: 8 readable floats at each (caller).
        unsafe {
            let lo = _mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(a)));
            _mm512_castpd_ps(_mm512_insertf64x4::<1>(
                lo,
                _mm256_castps_pd(_mm256_loadu_ps(b)),
            ))
        }
    }
}

impl X86Elem for f16 {
    /// F16C `vcvtph2ps` (exact, subnormals and ±65504 included).
    #[inline(always)]
    unsafe fn ld8(p: *const f16) -> __m256 {
        // SAFETY: 8 readable f16 = 16 bytes (caller).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
    #[inline(always)]
    unsafe fn ld2x8(a: *const f16, b: *const f16) -> __m512 {
        // SAFETY: 16 bytes at each (caller).
        unsafe { _mm512_cvtph_ps(two_halves(a, b)) }
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
    #[inline(always)]
    unsafe fn ld2x8(a: *const bf16, b: *const bf16) -> __m512 {
        // SAFETY: 16 bytes at each (caller).
        unsafe {
            let w = _mm512_cvtepu16_epi32(two_halves(a, b));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(w))
        }
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
pub unsafe fn rows_avx2<E: X86Elem>(
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
                    acc = _mm256_fmadd_ps(E::ld8(row.as_ptr().add(i)), xv, acc);
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
                    *a = _mm256_fmadd_ps(E::ld8(row.as_ptr().add(i)), xv, *a);
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

#[inline(always)]
fn lanes16(v: __m512) -> [f32; 16] {
    // SAFETY: `__m512` and `[f32; 16]` have the same size, every bit pattern valid.
    unsafe { std::mem::transmute::<__m512, [f32; 16]>(v) }
}

/// `x[i..i + 8]` in both 256-bit halves.
///
/// # Safety
/// `i + 8 <= x.len()`; AVX-512 F.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn x_twice(x: &[f32], i: usize) -> __m512 {
    // SAFETY: 8 readable floats at `i` (caller).
    let h = _mm256_castps_pd(unsafe { _mm256_loadu_ps(x.as_ptr().add(i)) });
    _mm512_castpd_ps(_mm512_insertf64x4::<1>(_mm512_castpd256_pd512(h), h))
}

/// `out[j] = row (r0 + j) · x`, AVX-512 F: two rows per `zmm` accumulator (row `2k` in
/// lanes 0–7, row `2k + 1` in lanes 8–15, each half exactly the 8-lane order), eight rows
/// in flight, or two at a time when `streamed`.
///
/// # Safety
/// AVX-512 F and F16C must be available; rows `r0..r0 + out.len()` must be in `w` and
/// `x.len() >= cols` (checked by the slices).
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub unsafe fn rows_avx512<E: X86Elem>(
    w: &[E],
    cols: usize,
    r0: usize,
    x: &[f32],
    out: &mut [f32],
    streamed: bool,
) {
    let x = &x[..cols];
    let n8 = cols - cols % 8;
    let per = if streamed { 2 } else { RB };
    for (b, o) in out.chunks_mut(per).enumerate() {
        let rows: [&[E]; RB] = std::array::from_fn(|k| row_at(w, cols, r0 + b * per + k));
        if streamed {
            let mut acc = _mm512_setzero_ps();
            let mut i = 0;
            while i < n8 {
                // SAFETY: `i + 8 <= n8 <= cols`, the length of both rows and of `x`.
                unsafe {
                    let xv = x_twice(x, i);
                    let wv = E::ld2x8(rows[0].as_ptr().add(i), rows[1].as_ptr().add(i));
                    acc = _mm512_fmadd_ps(wv, xv, acc);
                }
                i += 8;
            }
            let l = lanes16(acc);
            for (k, ok) in o.iter_mut().enumerate() {
                let lk: [f32; 8] = l[8 * k..8 * k + 8].try_into().expect("8 lanes");
                *ok = finish(lk, tail(rows[k], x, n8));
            }
            continue;
        }
        let mut acc = [_mm512_setzero_ps(); RB / 2];
        let mut i = 0;
        while i < n8 {
            // SAFETY: `i + 8 <= n8 <= cols`, the length of every row and of `x`.
            unsafe {
                let xv = x_twice(x, i);
                for (k, a) in acc.iter_mut().enumerate() {
                    let wv = E::ld2x8(rows[2 * k].as_ptr().add(i), rows[2 * k + 1].as_ptr().add(i));
                    *a = _mm512_fmadd_ps(wv, xv, *a);
                }
            }
            i += 8;
        }
        for (k, ok) in o.iter_mut().enumerate() {
            let l = lanes16(acc[k / 2]);
            let h = 8 * (k % 2);
            let lk: [f32; 8] = l[h..h + 8].try_into().expect("8 lanes");
            *ok = finish(lk, tail(rows[k], x, n8));
        }
    }
}
