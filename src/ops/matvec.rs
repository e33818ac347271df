//! Matrix-vector products over weights kept in their file dtype.
//!
//! A [`Matrix`] is a row-major `(rows, cols)` view of a tensor's bytes (mmap or owned).
//! f16/bf16 rows are widened to f32 in registers, so weights are read once in their
//! stored width. Rows are split across rayon tasks; each row's dot product has one fixed
//! order (below), so the result does not depend on the thread count or on whether a
//! token is decoded alone ([`matvec`]) or inside a prefill batch ([`matmul`]).
//!
//! Every matrix resolves its type's kernels for one variant when it is built
//! ([`crate::wkernels::Kernels`], from the type table); a product calls them without
//! asking the type or the variant again.
//!
//! The order of a float row's dot product `w · x` (`n = cols`, `n8 = n - n % 8`): one
//! f32x8 accumulator with lane `l` holding `Σ_{i ≡ l (mod 8), i < n8} w_i·x_i`
//! (multiply-adds in increasing `i`, fused iff [`crate::ops::simd::FUSED`]), its lanes
//! summed as `((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))`, plus the scalar tail
//! `Σ_{i ≥ n8} w_i·x_i` summed from zero ([`crate::wkernels::float`]). The one-token
//! kernels come in variants (scalar, portable, AVX2 + F16C), all in this order; the prefill
//! micro-kernel ([`tile`]) keeps rows × tokens in flight, one accumulator each, and reduces
//! eight of them with one transpose ([`crate::ops::simd::reduce8`]).

use super::simd::{load8, reduce8, Elem};
use crate::dtype::DType;
use crate::weights::{Tensor, TensorBytes};
use crate::wkernels::float::tail;
use crate::wkernels::{
    dequantize_into, ActsForms, ActsTile, FloatRows, Kernel, Kernels, Packed, QuantizedActs, GROUP,
    RB, TILE,
};
use rayon::prelude::*;
use std::ops::Range;
use std::sync::Arc;
use wide::f32x8;

/// A row-major `(rows, cols)` weight matrix.
#[derive(Clone)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub dtype: DType,
    data: TensorBytes,
    /// GGML-block weights repacked at load into row groups (see [`Packed`]); the kernels
    /// read only this.
    packed: Option<Arc<Packed>>,
    /// The type's kernels, resolved for one variant at load.
    kernels: Kernels,
    /// Read rows one at a time (see [`Matrix::set_streamed`]).
    streamed: bool,
}

impl std::fmt::Debug for Matrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Matrix({}x{} {})", self.rows, self.cols, self.dtype)
    }
}

impl Matrix {
    /// Wraps a 2-D tensor, its products to run on `kernel`'s code for its type (a variant
    /// this CPU lacks runs the scalar twins). The loader has checked the shape and byte
    /// length. Matrices over [`STREAM_BYTES`] start out streamed. GGML-block matrices are
    /// repacked here (one copy of their bytes, made once at load, in parallel on the
    /// current rayon pool), and a mapped file's pages of them are released as they are
    /// copied ([`crate::weights::TensorBytes::release`]).
    pub fn from_tensor(t: &Tensor, kernel: Kernel) -> Matrix {
        debug_assert_eq!(t.shape.len(), 2);
        let (rows, cols) = (t.shape[0], t.shape[1]);
        let packed = t.dtype.is_quantized().then(|| {
            // The file's pages of each stretch are returned once copied: the packed
            // copy is what the kernels (and embedding lookups) read from then on.
            let release = |r: std::ops::Range<usize>| t.data.release(r);
            let bytes = t.data.bytes();
            Arc::new(Packed::new_releasing(t.dtype, rows, cols, bytes, &release))
        });
        Matrix {
            rows,
            cols,
            dtype: t.dtype,
            streamed: t.data.bytes().len() > STREAM_BYTES,
            data: t.data.clone(),
            packed,
            kernels: Kernels::new(kernel, t.dtype),
        }
    }

    /// The kernels this matrix's products run.
    pub fn kernels(&self) -> &Kernels {
        &self.kernels
    }

    /// Chooses how a float matvec walks the rows; the values are bit-identical either way.
    ///
    /// * cache-resident weights (a model whose matrices fit in the last-level cache and
    ///   are re-read every token): eight rows interleaved, so eight independent FMA chains
    ///   hide the latency (about 1.5x the bandwidth of one row at a time, out of L3);
    /// * weights streamed from DRAM (`streamed = true`): one row after another, one
    ///   sequential stream the hardware prefetcher follows (about 1.2x the bandwidth of
    ///   eight interleaved streams, out of DRAM). The model loader sets this from the
    ///   total weight bytes.
    pub fn set_streamed(&mut self, streamed: bool) {
        self.streamed = streamed;
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

    /// The type of the load-time repacked copy (`None` for float matrices): the file's
    /// (every type is packed as its own blocks).
    pub fn packed_dtype(&self) -> Option<DType> {
        self.packed.as_ref().map(|p| p.dtype)
    }

    /// Bytes of the load-time repacked copy (0 for float matrices).
    pub fn packed_bytes(&self) -> usize {
        self.packed.as_ref().map_or(0, |p| p.byte_len())
    }

    /// Row `r` as f32 (embedding lookup). A repacked matrix is read from its packed copy,
    /// so the file's pages are not touched again after load.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        debug_assert_eq!(out.len(), self.cols);
        if let Some(p) = &self.packed {
            let row_bytes = p.dtype.bytes_for(self.cols).expect("validated at load");
            let mut b = vec![0u8; row_bytes];
            p.row_bytes(r, &mut b);
            return dequantize_into(p.dtype, &b, out);
        }
        let row_bytes = self.dtype.bytes_for(self.cols).expect("validated at load");
        let b = &self.bytes()[r * row_bytes..(r + 1) * row_bytes];
        dequantize_into(self.dtype, b, out);
    }

    /// `out[j] = row (r0 + j) · a` for a repacked matrix, `r0` a multiple of [`GROUP`].
    fn rows_q(&self, r0: usize, a: &QuantizedActs, out: &mut [f32]) {
        let p = self.packed.as_ref().expect("quantised matrices are packed");
        debug_assert_eq!(r0 % GROUP, 0);
        let mut buf = [0.0f32; GROUP];
        for (i, o) in out.chunks_mut(GROUP).enumerate() {
            self.kernels.group_dot(p, r0 / GROUP + i, a, &mut buf);
            o.copy_from_slice(&buf[..o.len()]);
        }
    }
}

/// Rows × tokens of the [`matmul`] micro-kernel (one accumulator each, 12 in all: with
/// the two weight vectors they fit AVX2's 16 registers and NEON's 32). Measured on the
/// flagship prefill (256 tokens, 2 threads): 2×6 58 ms, 2×8 60, 2×5 64, 3×4 67,
/// 3×5 72, 4×3 79, 4×2 80, 1×8 81.
const MR: usize = 2;
const MT: usize = 6;

/// `out[(t0 + j) * rows + r0 + k] = row (r0 + k) · xs[t0 + j]` for `k < MR`, `j < MT`
/// within the matrix's rows and the tile's tokens (`xs`: `(tokens, cols)`, `out`:
/// `(tokens, rows)`). Each value is summed in the canonical order, so it equals
/// [`rows8`]'s. Each widened weight vector feeds `MT` tokens and each activation vector
/// `MR` rows.
#[inline(always)]
fn tile<E: Elem>(w: &[E], cols: usize, r0: usize, xs: &[f32], t0: usize, out: &mut [f32]) {
    let rows_total = w.len() / cols;
    let n = xs.len() / cols;
    let rows: [&[E]; MR] = std::array::from_fn(|k| {
        let r = (r0 + k).min(rows_total - 1);
        &w[r * cols..(r + 1) * cols]
    });
    let toks: [&[f32]; MT] = std::array::from_fn(|j| {
        let t = (t0 + j).min(n - 1);
        &xs[t * cols..(t + 1) * cols]
    });
    let n8 = cols - cols % 8;
    let mut acc = [[f32x8::ZERO; MT]; MR];
    let mut i = 0;
    while i < n8 {
        let xv: [f32x8; MT] = std::array::from_fn(|j| load8(&toks[j][i..]));
        for (ar, row) in acc.iter_mut().zip(&rows) {
            let wv = E::load8(&row[i..]);
            for (a, x) in ar.iter_mut().zip(&xv) {
                *a = wv.mul_add(*x, *a);
            }
        }
        i += 8;
    }
    let mut sums = [0.0f32; MR * MT];
    for (c, chunk) in sums.chunks_mut(8).enumerate() {
        let part: [(f32x8, f32); 8] = std::array::from_fn(|l| {
            let q = c * 8 + l;
            if q < MR * MT {
                let (k, j) = (q / MT, q % MT);
                (acc[k][j], tail(rows[k], toks[j], n8))
            } else {
                (f32x8::ZERO, 0.0)
            }
        });
        let m = chunk.len();
        chunk.copy_from_slice(&reduce8(part).to_array()[..m]);
    }
    for j in 0..MT.min(n - t0) {
        for k in 0..MR.min(rows_total - r0) {
            out[(t0 + j) * rows_total + r0 + k] = sums[k * MT + j];
        }
    }
}

impl Matrix {
    fn float_rows(&self) -> Option<FloatRows<'_>> {
        FloatRows::of(self.dtype, self.bytes())
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
        let forms = quantized_forms(mats);
        let q = forms.any().then(|| {
            let mut a = QuantizedActs::default();
            a.quantize_forms(x, forms);
            a
        });
        Input { x, q }
    }

    /// `out[j] = row (r0 + j) · x` for every `j < out.len()`.
    fn rows(&self, m: &Matrix, r0: usize, out: &mut [f32]) {
        rows_into(m, self.x, self.q.as_ref(), r0, out)
    }
}

/// `out[j] = row (r0 + j) · x` for every `j < out.len()`, on the calling thread; `q` is
/// `x` quantised to 8-bit blocks, which GGML-block matrices read (`r0` a multiple of
/// [`RB`] for them). A decode team member computes its share of a product with this.
pub fn rows_into(m: &Matrix, x: &[f32], q: Option<&QuantizedActs>, r0: usize, out: &mut [f32]) {
    debug_assert_eq!(x.len(), m.cols);
    match (&m.packed, q) {
        (None, _) => m
            .kernels
            .float_rows(m.bytes(), m.cols, r0, x, out, m.streamed),
        (Some(_), Some(q)) => m.rows_q(r0, q, out),
        (Some(_), None) => unreachable!("quantised matrix without quantised input"),
    }
}

/// Row blocks per thread of a decode team product ([`row_parts`]): enough that a member
/// whose core is slower for a moment takes fewer, few enough that claiming them (one
/// atomic add each) stays negligible.
const PARTS_PER_THREAD: usize = 4;

/// How many parts [`row_part`] cuts a product of `mats` into for `threads` threads.
pub fn row_parts(mats: &[&Matrix], threads: usize) -> usize {
    let blocks: usize = mats.iter().map(|m| m.rows.div_ceil(RB)).sum();
    (PARTS_PER_THREAD * threads).min(blocks).max(1)
}

/// Part `k` of `parts` of a product of `mats` (which take the same input, so have the
/// same columns): their rows concatenated, each matrix's padded to a multiple of [`RB`],
/// cut into `parts` nearly equal ranges on multiples of `RB`. Calls `f(i, rows)` for each
/// piece of matrix `i` in the part; parts `0..parts` cover every row once, and every piece
/// starts on a multiple of `RB`.
pub fn row_part(mats: &[&Matrix], k: usize, parts: usize, mut f: impl FnMut(usize, Range<usize>)) {
    let padded = |m: &Matrix| m.rows.next_multiple_of(RB);
    let total: usize = mats.iter().map(|m| padded(m)).sum();
    let cut = |k: usize| (total / RB * k / parts * RB).min(total);
    let (lo, hi) = (cut(k), cut(k + 1));
    let mut off = 0;
    for (i, m) in mats.iter().enumerate() {
        let (a, b) = (lo.max(off), hi.min(off + padded(m)));
        if a < b && a - off < m.rows {
            f(i, a - off..(b - off).min(m.rows));
        }
        off += padded(m);
    }
}

/// Whether any of `mats` reads 8-bit quantised activations.
pub fn needs_quantized_input(mats: &[&Matrix]) -> bool {
    quantized_forms(mats).any()
}

/// The quantised forms of their input that `mats` read (Q8_0-style blocks of 32 and/or
/// Q8_K super-blocks): quantise with [`QuantizedActs::quantize_forms`].
pub fn quantized_forms(mats: &[&Matrix]) -> ActsForms {
    mats.iter().fold(ActsForms::default(), |f, m| {
        f.union(ActsForms::from_acts(m.kernels.acts()))
    })
}

/// Weights above this many bytes are assumed to come from DRAM on every token (they do
/// not stay in a last-level cache between tokens): see [`Matrix::set_streamed`].
pub const STREAM_BYTES: usize = 16 << 20;

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
    let threads = crate::threads::current();
    if work < PAR_MIN_WORK || threads == 1 {
        for (m, o) in mats.iter().zip(outs.iter_mut()) {
            input.rows(m, 0, o);
        }
        return;
    }
    tasks_of_equal_work(mats, outs, work.div_ceil(2 * threads))
        .into_par_iter()
        .for_each(|segs| {
            for (m, base, oc) in segs {
                input.rows(m, base, oc);
            }
        });
}

/// One [`matvec_many`] task: row ranges `(matrix, first row, outputs)`.
type Task<'m, 'o> = Vec<(&'m Matrix, usize, &'o mut [f32])>;

/// Cuts the matrices' rows, in order, into tasks of about `per` multiply-adds each
/// (`rows × cols`), every cut on a multiple of [`RB`] rows (a packed row group); a task
/// may end one matrix and start the next. Equal tasks keep the threads' shares equal
/// when the matrices differ in size (`q` 576 rows, `k` and `v` 192 each: per-matrix chunks
/// gave one thread 576 rows and the other 384).
fn tasks_of_equal_work<'m, 'o>(
    mats: &[&'m Matrix],
    outs: &'o mut [&mut [f32]],
    per: usize,
) -> Vec<Task<'m, 'o>> {
    let mut tasks = Vec::new();
    let (mut cur, mut cur_work): (Task, usize) = (Vec::new(), 0);
    for (m, o) in mats.iter().zip(outs.iter_mut()) {
        let mut rest: &'o mut [f32] = o;
        let mut r0 = 0;
        while !rest.is_empty() {
            let room = per.saturating_sub(cur_work).max(1);
            let n = room
                .div_ceil(m.cols.max(1))
                .next_multiple_of(RB)
                .min(rest.len());
            let (head, tail) = std::mem::take(&mut rest).split_at_mut(n);
            rest = tail;
            cur.push((*m, r0, head));
            r0 += n;
            cur_work += n * m.cols;
            if cur_work >= per {
                tasks.push(std::mem::take(&mut cur));
                cur_work = 0;
            }
        }
    }
    if !cur.is_empty() {
        tasks.push(cur);
    }
    tasks
}

/// Most tokens per [`matmul`] task: a tile's activations stay in L2 while each block of
/// `MR` weight rows (in L1) meets all of them.
const TOKEN_TILE: usize = 64;

/// Tokens per [`matmul`] task: at most [`TOKEN_TILE`], small enough that every thread
/// gets a tile, a multiple of `MT`.
fn token_tile(n_tokens: usize) -> usize {
    let threads = crate::threads::current();
    n_tokens
        .div_ceil(threads)
        .clamp(MT, TOKEN_TILE)
        .next_multiple_of(MT)
}

/// Batched product for prefill: `out[t, r] = Σ_c w[r, c] · xs[t, c]` for `t < n_tokens`,
/// with `xs` `(n_tokens, cols)` and `out` `(n_tokens, rows)`. Tasks own tiles of tokens
/// (contiguous in `out`); inside, a register-blocked kernel over 2 rows × 6 tokens.
/// Every `(t, r)` value equals what [`matvec`] gives for token `t` alone, bit for bit.
pub fn matmul(w: &Matrix, xs: &[f32], n_tokens: usize, out: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    debug_assert_eq!(xs.len(), n_tokens * cols);
    debug_assert_eq!(out.len(), n_tokens * rows);
    if n_tokens == 1 {
        return matvec(w, xs, out);
    }
    let Some(fw) = w.float_rows() else {
        return matmul_quantized(&[w], xs, vec![out.chunks_exact_mut(rows).collect()]);
    };
    fn run<E: Elem>(w: &[E], cols: usize, xs: &[f32], out: &mut [f32]) {
        let rows = w.len() / cols;
        for r in (0..rows).step_by(MR) {
            for t in (0..xs.len() / cols).step_by(MT) {
                tile(w, cols, r, xs, t, out);
            }
        }
    }
    let body = |(xt, ot): (&[f32], &mut [f32])| match fw {
        FloatRows::F32(w) => run(w, cols, xt, ot),
        FloatRows::F16(w) => run(w, cols, xt, ot),
        FloatRows::Bf16(w) => run(w, cols, xt, ot),
    };
    for_each_token_tile(xs, cols, out, rows, rows * cols, body);
}

/// Several matrices applied to the same `n_tokens` tokens (`q/k/v`, `gate/up`):
/// `outs[i] = mats[i] · xs`, each `(n_tokens, mats[i].rows)`. Over GGML blocks the tokens
/// are quantised once for all of them and every matrix's row groups share one parallel
/// region; otherwise (float weights, or one token) it is [`matmul`] per matrix
/// ([`matvec_many`] for one token). Values equal [`matvec`]'s, bit for bit.
pub fn matmul_many(mats: &[&Matrix], xs: &[f32], n_tokens: usize, outs: &mut [&mut [f32]]) {
    debug_assert_eq!(mats.len(), outs.len());
    if n_tokens == 1 {
        return matvec_many(mats, xs, outs);
    }
    if mats.iter().any(|m| m.packed.is_none()) {
        for (m, o) in mats.iter().zip(outs.iter_mut()) {
            matmul(m, xs, n_tokens, o);
        }
        return;
    }
    let rows = mats
        .iter()
        .zip(outs.iter_mut())
        .map(|(m, o)| o.chunks_exact_mut(m.rows).collect())
        .collect();
    matmul_quantized(mats, xs, rows);
}

/// [`matmul`] with each token's output row in a slice of its own (`outs[t]`, `w.rows`
/// long): the LM head of a serve step writes every sequence's logits in place.
pub fn matmul_rows(w: &Matrix, xs: &[f32], outs: &mut [&mut [f32]]) {
    let n = outs.len();
    debug_assert_eq!(xs.len(), n * w.cols);
    if n == 1 {
        return matvec(w, xs, outs[0]);
    }
    if w.packed.is_none() {
        let mut out = vec![0.0f32; n * w.rows];
        matmul(w, xs, n, &mut out);
        for (o, r) in outs.iter_mut().zip(out.chunks_exact(w.rows)) {
            o.copy_from_slice(r);
        }
        return;
    }
    let rows = outs.iter_mut().map(|o| &mut **o).collect();
    matmul_quantized(&[w], xs, vec![rows]);
}

/// [`matmul`] for GGML-block weights: `out[m][t] = mats[m] · token t` (each `mats[m].rows`
/// long). Every token is quantised to 8 bits once for all the matrices (and interleaved
/// into tiles of [`TILE`] tokens); rayon tasks own ranges of one matrix's row groups
/// (as [`matvec_many`] splits rows, so a handful of tokens still uses every thread) and
/// the matching pieces of every token's output row, so results land in place; inside a
/// task, each group meets a tile at a time through the multi-token kernels, which load and
/// unpack a weight block once for all its tokens. Values equal [`matvec`]'s, bit for bit.
fn matmul_quantized(mats: &[&Matrix], xs: &[f32], out: Vec<Vec<&mut [f32]>>) {
    let cols = mats[0].cols;
    debug_assert!(mats.iter().all(|m| m.cols == cols));
    let n = xs.len() / cols;
    let threads = crate::threads::current();
    let work: usize = mats.iter().map(|m| m.rows * cols * n).sum();
    let parallel = work >= PAR_MIN_WORK && threads > 1;
    // The quantised tokens go into buffers this thread keeps from one product to the next
    // (a serve step runs a few hundred products; their allocations showed in profiles).
    let mut acts = ACTS.with(|a| std::mem::take(&mut *a.borrow_mut()));
    acts.resize_with(n, QuantizedActs::default);
    let forms = quantized_forms(mats);
    let quantize = |(a, x): (&mut QuantizedActs, &[f32])| a.quantize_forms(x, forms);
    // In parallel only when it pays: a serve step's 16 tokens take microseconds, less than
    // waking the other threads.
    if parallel && n * cols >= PAR_MIN_QUANT {
        acts[..n]
            .par_iter_mut()
            .zip(xs.par_chunks_exact(cols))
            .for_each(quantize);
    } else {
        acts[..n]
            .iter_mut()
            .zip(xs.chunks_exact(cols))
            .for_each(quantize);
    }
    let act_refs: Vec<&QuantizedActs> = acts[..n].iter().collect();
    let tiles: Vec<ActsTile> = act_refs.chunks(TILE).map(ActsTile::new).collect();
    // Groups per task: about four tasks per thread over all the matrices (rayon balances
    // them when another process holds a core), at least two groups each.
    let total_groups: usize = mats.iter().map(|m| m.rows.div_ceil(GROUP)).sum();
    let per = if parallel {
        total_groups.div_ceil(4 * threads).max(2)
    } else {
        total_groups
    };
    // Task = (matrix, first group, its rows of every token's output).
    let mut tasks: Vec<(&Matrix, usize, Vec<&mut [f32]>)> = Vec::new();
    for (m, rows_out) in mats.iter().zip(out) {
        let first = tasks.len();
        let n_tasks = m.rows.div_ceil(GROUP).div_ceil(per);
        tasks.extend((0..n_tasks).map(|i| (*m, i * per, Vec::with_capacity(n))));
        for row in rows_out {
            debug_assert_eq!(row.len(), m.rows);
            for (i, piece) in row.chunks_mut(per * GROUP).enumerate() {
                tasks[first + i].2.push(piece);
            }
        }
    }
    let body = |(m, g0, mut rows_out): (&Matrix, usize, Vec<&mut [f32]>)| {
        let p = m.packed.as_ref().expect("quantised matrices are packed");
        let span = rows_out[0].len();
        let mut buf = [[0.0f32; GROUP]; TILE];
        // Token tiles bound the activations a task streams per group (they stay in L2).
        for (ti, ts) in tiles.chunks(TOKEN_TILE / TILE).enumerate() {
            for (i, r0) in (0..span).step_by(GROUP).enumerate() {
                let r1 = (r0 + GROUP).min(span);
                let mut t0 = ti * TOKEN_TILE;
                for (k, tile) in ts.iter().enumerate() {
                    let got = &mut buf[..tile.len()];
                    m.kernels
                        .group_tile(p, g0 + i, tile, got, k + 1 == ts.len());
                    for (o, v) in rows_out[t0..t0 + tile.len()].iter_mut().zip(got.iter()) {
                        if r1 - r0 == GROUP {
                            // A fixed length: two vector moves, not a `memmove` call.
                            o[r0..r0 + GROUP].copy_from_slice(v);
                        } else {
                            o[r0..r1].copy_from_slice(&v[..r1 - r0]);
                        }
                    }
                    t0 += tile.len();
                }
            }
        }
    };
    if parallel {
        tasks.into_par_iter().for_each(body);
    } else {
        tasks.into_iter().for_each(body);
    }
    drop((tiles, act_refs));
    // A long prompt's prefill does not keep its thousands of rows alive.
    acts.truncate(KEEP_ACTS);
    ACTS.with(|a| *a.borrow_mut() = acts);
}

/// Activations (tokens × columns) from which [`matmul_quantized`] quantises its tokens in
/// parallel.
const PAR_MIN_QUANT: usize = 1 << 16;

/// Most quantised tokens [`ACTS`] keeps (a serve step of 64 sequences plus a 64-token
/// prompt chunk is 128; each token is `cols` bytes plus four floats per 32 columns).
const KEEP_ACTS: usize = 256;

thread_local! {
    /// [`matmul_quantized`]'s quantised tokens, kept for the next product on this thread
    /// (taken out while in use, so a nested call just allocates its own).
    static ACTS: std::cell::RefCell<Vec<QuantizedActs>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `body(xs_tile, out_tile)` over tiles of [`token_tile`] tokens (`xs`:
/// `(n, cols)`, `out`: `(n, rows)`), in parallel when the work (`weights · n`) pays.
fn for_each_token_tile(
    xs: &[f32],
    cols: usize,
    out: &mut [f32],
    rows: usize,
    weights: usize,
    body: impl Fn((&[f32], &mut [f32])) + Sync + Send,
) {
    let n = xs.len() / cols;
    let tt = token_tile(n);
    if weights * n < PAR_MIN_WORK || crate::threads::current() == 1 {
        xs.chunks(tt * cols)
            .zip(out.chunks_mut(tt * rows))
            .for_each(body);
    } else {
        xs.par_chunks(tt * cols)
            .zip(out.par_chunks_mut(tt * rows))
            .for_each(body);
    }
}
