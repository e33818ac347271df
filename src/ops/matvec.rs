//! Matrix-vector products over weights kept in their file dtype.
//!
//! A [`Matrix`] is a row-major `(rows, cols)` view of a tensor's bytes (mmap or owned).
//! f16/bf16 rows are widened to f32 in small stack chunks, so weights are read once in
//! their stored width. Rows are split across rayon tasks; each row's dot product is
//! sequential in a fixed order, so the result does not depend on the thread count.

use super::qdot::{self, QuantizedActs};
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

    /// Length of the partial sums a row's dot product is split into: f32 rows are one
    /// run, f16/bf16 rows are widened 64 values at a time, GGML blocks are 32 values.
    /// `matvec` and `matmul` use the same split, so a token gets bit-identical results
    /// whether it is processed alone (decode) or in a batch (prefill).
    fn dot_chunk(&self) -> usize {
        match self.dtype {
            DType::F32 => usize::MAX,
            DType::F16 | DType::BF16 => CHUNK,
            _ => self.dtype.block_len(),
        }
    }

    /// Row `r` widened/dequantised to f32 into `buf` (`cols` values).
    fn widen_row(&self, r: usize, buf: &mut [f32]) {
        let c = self.cols;
        match self.dtype {
            DType::F32 => {
                let w: &[f32] = bytemuck::cast_slice(self.bytes());
                buf.copy_from_slice(&w[r * c..(r + 1) * c]);
            }
            DType::F16 => {
                let w: &[f16] = bytemuck::cast_slice(self.bytes());
                widen_f16(&w[r * c..(r + 1) * c], buf);
            }
            DType::BF16 => {
                let w: &[bf16] = bytemuck::cast_slice(self.bytes());
                widen_bf16(&w[r * c..(r + 1) * c], buf);
            }
            _ => self.row_f32(r, buf),
        }
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
                dot_widen(&w[r * c..(r + 1) * c], x, widen_f16)
            }
            DType::BF16 => {
                let w: &[bf16] = bytemuck::cast_slice(self.bytes());
                dot_widen(&w[r * c..(r + 1) * c], x, widen_bf16)
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

impl Matrix {
    /// Dot product of quantised row `r` with activations quantised by
    /// [`QuantizedActs::quantize`] (GGML block types only).
    #[inline]
    pub fn row_dot_q(&self, r: usize, a: &QuantizedActs) -> f32 {
        let row_bytes = self.dtype.bytes_for(self.cols).expect("validated at load");
        let b = &self.bytes()[r * row_bytes..(r + 1) * row_bytes];
        match self.dtype {
            DType::Q8_0 => qdot::dot_q8_0(b, a),
            DType::Q4_0 => qdot::dot_q4_0(b, a),
            DType::Q4_1 => qdot::dot_q4_1(b, a),
            other => unreachable!("row_dot_q on {other}"),
        }
    }
}

/// One matrix input: f32 activations, plus their 8-bit quantisation when a GGML-block
/// matrix consumes them.
struct Input<'a> {
    x: &'a [f32],
    q: Option<QuantizedActs>,
}

impl<'a> Input<'a> {
    fn new(x: &'a [f32], mats: &[&Matrix]) -> Self {
        let q = mats
            .iter()
            .any(|m| m.dtype.is_quantized())
            .then(|| QuantizedActs::from_f32(x));
        Input { x, q }
    }
    #[inline]
    fn dot(&self, m: &Matrix, r: usize) -> f32 {
        match &self.q {
            Some(q) if m.dtype.is_quantized() => m.row_dot_q(r, q),
            _ => m.row_dot(r, self.x),
        }
    }
}

fn widen_f16(src: &[f16], dst: &mut [f32]) {
    use half::slice::HalfFloatSliceExt;
    src.convert_to_f32_slice(dst);
}

fn widen_bf16(src: &[bf16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits((s.to_bits() as u32) << 16);
    }
}

/// `Σ_chunks dot(w_chunk, x_chunk)` over an already-widened row: the same partial sums
/// as [`Matrix::row_dot`] for that dtype.
#[inline]
fn dot_chunked(w: &[f32], x: &[f32], chunk: usize) -> f32 {
    if chunk >= w.len() {
        return simd::dot(w, x);
    }
    let mut acc = 0.0f32;
    for (wc, xc) in w.chunks(chunk).zip(x.chunks(chunk)) {
        acc += simd::dot(wc, xc);
    }
    acc
}

#[inline]
fn dot_widen<T: Copy>(w: &[T], x: &[f32], widen: fn(&[T], &mut [f32])) -> f32 {
    let mut buf = [0.0f32; CHUNK];
    let mut acc = 0.0f32;
    for (wc, xc) in w.chunks(CHUNK).zip(x.chunks(CHUNK)) {
        let n = wc.len();
        widen(wc, &mut buf[..n]);
        acc += simd::dot(&buf[..n], xc);
    }
    acc
}

/// Below this many multiply-adds a product runs on the calling thread (rayon's wake-up
/// costs more than the work).
const PAR_MIN_WORK: usize = 1 << 16;

/// `out[r] = Σ_c w[r, c] · x[c]`.
pub fn matvec(w: &Matrix, x: &[f32], out: &mut [f32]) {
    debug_assert_eq!(x.len(), w.cols);
    debug_assert_eq!(out.len(), w.rows);
    matvec_many(&[w], x, &mut [out]);
}

/// Several matrices applied to the same input in one parallel region
/// (`q/k/v`, `gate/up`): `outs[i] = mats[i] · x`.
pub fn matvec_many(mats: &[&Matrix], x: &[f32], outs: &mut [&mut [f32]]) {
    debug_assert_eq!(mats.len(), outs.len());
    let input = Input::new(x, mats);
    let work: usize = mats.iter().map(|m| m.rows * m.cols).sum();
    if work < PAR_MIN_WORK || rayon::current_num_threads() == 1 {
        for (m, o) in mats.iter().zip(outs.iter_mut()) {
            for (r, v) in o.iter_mut().enumerate() {
                *v = input.dot(m, r);
            }
        }
        return;
    }
    let threads = rayon::current_num_threads();
    let mut tasks: Vec<(&Matrix, usize, &mut [f32])> = Vec::new();
    for (m, o) in mats.iter().zip(outs.iter_mut()) {
        let chunk = (m.rows / (threads * 4)).clamp(4, 256);
        for (ci, oc) in o.chunks_mut(chunk).enumerate() {
            tasks.push((m, ci * chunk, oc));
        }
    }
    tasks.into_par_iter().for_each(|(m, base, oc)| {
        for (j, v) in oc.iter_mut().enumerate() {
            *v = input.dot(m, base + j);
        }
    });
}

/// Tokens per tile in [`matmul`]: a widened weight row is reused across this many
/// activations while it is in L1.
const TOKEN_TILE: usize = 64;

/// Batched product for prefill: `out[t, r] = Σ_c w[r, c] · xs[t, c]` for `t < n_tokens`,
/// with `xs` `(n_tokens, cols)` and `out` `(n_tokens, rows)`. Each weight row is read
/// (and widened) once per tile of tokens; every `(t, r)` value equals what [`matvec`]
/// gives for token `t` alone.
pub fn matmul(w: &Matrix, xs: &[f32], n_tokens: usize, out: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    debug_assert_eq!(xs.len(), n_tokens * cols);
    debug_assert_eq!(out.len(), n_tokens * rows);
    if n_tokens == 1 {
        return matvec(w, xs, out);
    }
    if w.dtype.is_quantized() {
        return matmul_quantized(w, xs, n_tokens, out);
    }
    let chunk = w.dot_chunk();
    // (rows, n_tokens): each task owns whole rows, so writes stay disjoint.
    let mut tr = vec![0.0f32; rows * n_tokens];
    let row_block = 16usize;
    let body = |(bi, block): (usize, &mut [f32])| {
        let mut buf = vec![0.0f32; cols];
        let r0 = bi * row_block;
        for (j, orow) in block.chunks_mut(n_tokens).enumerate() {
            w.widen_row(r0 + j, &mut buf);
            for t0 in (0..n_tokens).step_by(TOKEN_TILE) {
                let t1 = (t0 + TOKEN_TILE).min(n_tokens);
                for t in t0..t1 {
                    orow[t] = dot_chunked(&buf, &xs[t * cols..(t + 1) * cols], chunk);
                }
            }
        }
    };
    run_row_blocks(&mut tr, row_block, rows * cols, n_tokens, body);
    transpose_into(&tr, rows, n_tokens, out);
}

/// [`matmul`] for GGML-block weights: each token's activations are quantised once, then
/// every row meets every token (values equal [`matvec`]'s).
fn matmul_quantized(w: &Matrix, xs: &[f32], n_tokens: usize, out: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    let acts: Vec<QuantizedActs> = xs.chunks_exact(cols).map(QuantizedActs::from_f32).collect();
    let mut tr = vec![0.0f32; rows * n_tokens];
    let row_block = 16usize;
    let body = |(bi, block): (usize, &mut [f32])| {
        let r0 = bi * row_block;
        for (j, orow) in block.chunks_mut(n_tokens).enumerate() {
            for (t, o) in orow.iter_mut().enumerate() {
                *o = w.row_dot_q(r0 + j, &acts[t]);
            }
        }
    };
    run_row_blocks(&mut tr, row_block, rows * cols, n_tokens, body);
    transpose_into(&tr, rows, n_tokens, out);
}

/// Runs `body(block_index, block)` over blocks of `row_block` rows of a `(rows, n_tokens)`
/// buffer, in parallel when the work (`weights · n_tokens`) pays for it.
fn run_row_blocks(
    tr: &mut [f32],
    row_block: usize,
    weights: usize,
    n_tokens: usize,
    body: impl Fn((usize, &mut [f32])) + Sync + Send,
) {
    if weights * n_tokens < PAR_MIN_WORK || rayon::current_num_threads() == 1 {
        tr.chunks_mut(row_block * n_tokens)
            .enumerate()
            .for_each(body);
    } else {
        tr.par_chunks_mut(row_block * n_tokens)
            .enumerate()
            .for_each(body);
    }
}

/// `(rows, n_tokens)` → `(n_tokens, rows)`.
fn transpose_into(tr: &[f32], rows: usize, n_tokens: usize, out: &mut [f32]) {
    for r in 0..rows {
        for t in 0..n_tokens {
            out[t * rows + r] = tr[r * n_tokens + t];
        }
    }
}
