//! Matrix-vector products over weights kept in their file dtype.
//!
//! A [`Matrix`] is a row-major `(rows, cols)` view of a tensor's bytes (mmap or owned).
//! f16/bf16 rows are widened to f32 in small stack chunks, so weights are read once in
//! their stored width. Rows are split across rayon tasks; each row's dot product is
//! sequential in a fixed order, so the result does not depend on the thread count.

use super::simd;
use crate::dtype::DType;
use crate::weights::{dequantize_into, Tensor, TensorBytes};
use half::{bf16, f16};
use rayon::prelude::*;

/// A row-major `(rows, cols)` weight matrix.
#[derive(Clone)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub dtype: DType,
    data: TensorBytes,
}

impl std::fmt::Debug for Matrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Matrix({}x{} {})", self.rows, self.cols, self.dtype)
    }
}

/// Widening chunk: values converted to f32 on the stack at a time.
const CHUNK: usize = 64;

impl Matrix {
    /// Wraps a 2-D tensor. The loader has checked the shape and byte length.
    pub fn from_tensor(t: &Tensor) -> Matrix {
        debug_assert_eq!(t.shape.len(), 2);
        Matrix {
            rows: t.shape[0],
            cols: t.shape[1],
            dtype: t.dtype,
            data: t.data.clone(),
        }
    }

    pub fn bytes(&self) -> &[u8] {
        self.data.bytes()
    }

    /// Bytes read per full matvec.
    pub fn byte_len(&self) -> usize {
        self.data.bytes().len()
    }

    pub fn is_mapped(&self) -> bool {
        self.data.is_mapped()
    }

    /// Row `r` as f32 (embedding lookup).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        debug_assert_eq!(out.len(), self.cols);
        let row_bytes = self.dtype.bytes_for(self.cols).expect("validated at load");
        let b = &self.bytes()[r * row_bytes..(r + 1) * row_bytes];
        dequantize_into(self.dtype, b, out);
    }

    /// Dot product of row `r` with `x`.
    #[inline]
    pub fn row_dot(&self, r: usize, x: &[f32]) -> f32 {
        let c = self.cols;
        match self.dtype {
            DType::F32 => {
                let w: &[f32] = bytemuck::cast_slice(self.bytes());
                simd::dot(&w[r * c..(r + 1) * c], x)
            }
            DType::F16 => {
                let w: &[f16] = bytemuck::cast_slice(self.bytes());
                dot_widen(&w[r * c..(r + 1) * c], x, |src, dst| {
                    for (d, s) in dst.iter_mut().zip(src) {
                        *d = s.to_f32();
                    }
                })
            }
            DType::BF16 => {
                let w: &[bf16] = bytemuck::cast_slice(self.bytes());
                dot_widen(&w[r * c..(r + 1) * c], x, |src, dst| {
                    for (d, s) in dst.iter_mut().zip(src) {
                        *d = f32::from_bits((s.to_bits() as u32) << 16);
                    }
                })
            }
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => {
                let row_bytes = self.dtype.bytes_for(c).expect("validated at load");
                let b = &self.bytes()[r * row_bytes..(r + 1) * row_bytes];
                let mut buf = [0.0f32; 32];
                let bb = self.dtype.block_bytes();
                let mut acc = 0.0f32;
                for (k, blk) in b.chunks_exact(bb).enumerate() {
                    dequantize_into(self.dtype, blk, &mut buf);
                    acc += simd::dot(&buf, &x[k * 32..(k + 1) * 32]);
                }
                acc
            }
        }
    }
}

#[inline]
fn dot_widen<T: Copy>(w: &[T], x: &[f32], widen: impl Fn(&[T], &mut [f32])) -> f32 {
    let mut buf = [0.0f32; CHUNK];
    let mut acc = 0.0f32;
    for (wc, xc) in w.chunks(CHUNK).zip(x.chunks(CHUNK)) {
        let n = wc.len();
        widen(wc, &mut buf[..n]);
        acc += simd::dot(&buf[..n], xc);
    }
    acc
}

/// Below this many weights a matvec runs on the calling thread (rayon overhead dominates).
const PAR_MIN_WORK: usize = 1 << 15;

/// `out[r] = Σ_c w[r, c] · x[c]`.
pub fn matvec(w: &Matrix, x: &[f32], out: &mut [f32]) {
    debug_assert_eq!(x.len(), w.cols);
    debug_assert_eq!(out.len(), w.rows);
    if w.rows * w.cols < PAR_MIN_WORK || rayon::current_num_threads() == 1 {
        for (r, o) in out.iter_mut().enumerate() {
            *o = w.row_dot(r, x);
        }
        return;
    }
    let chunk = (w.rows / (rayon::current_num_threads() * 8)).clamp(4, 256);
    out.par_chunks_mut(chunk).enumerate().for_each(|(ci, oc)| {
        let base = ci * chunk;
        for (j, o) in oc.iter_mut().enumerate() {
            *o = w.row_dot(base + j, x);
        }
    });
}
