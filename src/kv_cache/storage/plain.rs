//! Plain rows: f32, f16 or bf16 ([`Elem`]), one store type for all three.
//!
//! ```text
//! Rows<E>        data[h]       (slots, head_dim)              E = f32 | f16 | bf16
//! ```
//!
//! The kernels widen `E` to f32 in registers inside the dot products and weighted sums
//! (no widened copy of the rows); head dims 32/64/128 get straight-line code. Other head
//! dims (256: Gemma 3) widen each row once for up to four queries of a group (scores) and
//! sum the values in L1-sized row tiles with the accumulators in registers; every query's
//! result keeps the order of the per-query kernels, bit for bit. A new
//! plain element type is one `Elem` impl plus its arm in `stores_for`. Writes go through
//! the store's hold journal (`journal.rs`).

use super::journal::{self, Journal};
use super::{heads_blocks, heads_bytes, load_heads, slots_needed};
use super::{Elem, KeyRun, KeyStore, Region, RowStore, ValueRun, ValueStore};
use crate::error::Result;
use crate::kivi::KvKernel;
use crate::ops::simd::reduce8;
use crate::state::{Reader, Wire, Writer};
use bytemuck::Pod;
use std::ops::Range;
use wide::f32x8;

/// `Σ q[c] · row[c]`, widening `row` in registers (f32x8 lanes, then a scalar tail).
#[cfg(test)]
pub(crate) fn dot_elem<E: Elem>(q: &[f32], row: &[E]) -> f32 {
    debug_assert_eq!(q.len(), row.len());
    let (v, tail) = dot_lanes_elem::<E, 0>(q, row);
    v.reduce_add() + tail
}

/// `acc[c] += alpha · row[c]`, widening `row` in registers.
#[inline]
pub(crate) fn axpy_elem<E: Elem>(alpha: f32, row: &[E], acc: &mut [f32]) {
    debug_assert_eq!(acc.len(), row.len());
    let n = acc.len();
    let a = f32x8::splat(alpha);
    let mut i = 0;
    while i + 8 <= n {
        let r = E::load8(&row[i..]).mul_add(a, crate::ops::simd::load8(&acc[i..]));
        acc[i..i + 8].copy_from_slice(&r.to_array());
        i += 8;
    }
    for j in i..n {
        acc[j] += alpha * row[j].to_f32();
    }
}

/// [`dot_elem`] before the final reduction: lane-wise partial sums of the first
/// `n - n % 8` elements and the scalar sum of the rest. `HD`: the length when known at
/// compile time (0: `q.len()`).
#[inline(always)]
fn dot_lanes_elem<E: Elem, const HD: usize>(q: &[f32], row: &[E]) -> (f32x8, f32) {
    let n = if HD != 0 { HD } else { q.len() };
    let (q, row) = (&q[..n], &row[..n]);
    let (mut a0, mut a1) = (f32x8::ZERO, f32x8::ZERO);
    let mut i = 0;
    while i + 16 <= n {
        a0 = E::load8(&row[i..]).mul_add(crate::ops::simd::load8(&q[i..]), a0);
        a1 = E::load8(&row[i + 8..]).mul_add(crate::ops::simd::load8(&q[i + 8..]), a1);
        i += 16;
    }
    if i + 8 <= n {
        a0 = E::load8(&row[i..]).mul_add(crate::ops::simd::load8(&q[i..]), a0);
        i += 8;
    }
    let mut tail = 0.0f32;
    for j in i..n {
        tail += q[j] * row[j].to_f32();
    }
    (a0 + a1, tail)
}

/// Scores of every query in `qs` against rows `d` (`(rows, hd)`), eight rows per
/// reduction; the last block pads with zeros so every row sums in the same order.
fn dot_rows_k<E: Elem, const HD: usize>(
    d: &[E],
    hd: usize,
    qs: &[f32],
    out: &mut [f32],
    stride: usize,
) {
    let hd = if HD != 0 { HD } else { hd };
    let rows = d.len() / hd;
    for (j, q) in qs.chunks_exact(hd).enumerate() {
        for (blk, o) in out[j * stride..j * stride + rows].chunks_mut(8).enumerate() {
            let r0 = blk * 8;
            let part: [(f32x8, f32); 8] = std::array::from_fn(|k| {
                if k < o.len() {
                    dot_lanes_elem::<E, HD>(q, &d[(r0 + k) * hd..])
                } else {
                    (f32x8::ZERO, 0.0)
                }
            });
            o.copy_from_slice(&reduce8(part).to_array()[..o.len()]);
        }
    }
}

/// `acc_j += Σ_r p_jr · row_r`, row by row in order. With `HD` known (a multiple of 8,
/// at most 128) the accumulator lives in registers across the whole run; otherwise it
/// is [`axpy_elem`] into memory. Same operations in the same order either way.
fn axpy_rows_k<E: Elem, const HD: usize>(
    d: &[E],
    hd: usize,
    p: &[f32],
    stride: usize,
    acc: &mut [f32],
) {
    if HD == 0 || !HD.is_multiple_of(8) || HD / 8 > MAX_LANES {
        for (j, a) in acc.chunks_exact_mut(hd).enumerate() {
            for (r, row) in d.chunks_exact(hd).enumerate() {
                let w = p[j * stride + r];
                if w != 0.0 {
                    axpy_elem(w, row, a);
                }
            }
        }
        return;
    }
    // With at most four lanes per row, one query leaves the FMA units half idle (four
    // dependent chains): two queries of the group then share each row load and run
    // eight chains. Each query's sum keeps its own row order either way.
    let nq = acc.len() / HD;
    let mut j = 0;
    while j < nq {
        if HD / 8 <= 4 && j + 1 < nq {
            axpy_rows_regs::<E, HD, 2, 4>(d, &p[j * stride..], stride, &mut acc[j * HD..]);
            j += 2;
        } else {
            axpy_rows_regs::<E, HD, 1, MAX_LANES>(d, &p[j * stride..], stride, &mut acc[j * HD..]);
            j += 1;
        }
    }
}

/// Most f32x8 lanes per row kept in registers by [`axpy_rows_regs`].
const MAX_LANES: usize = 16;

/// [`axpy_rows_k`] for `Q` consecutive queries (`acc`: their `(Q, HD)` rows first,
/// `p[q * stride + r]` their weights), accumulators in registers (`L ≥ HD / 8` lanes
/// each), each row loaded once.
#[inline(always)]
fn axpy_rows_regs<E: Elem, const HD: usize, const Q: usize, const L: usize>(
    d: &[E],
    p: &[f32],
    stride: usize,
    acc: &mut [f32],
) {
    let lanes = HD / 8;
    debug_assert!(lanes <= L);
    let mut regs = [[f32x8::ZERO; L]; Q];
    for (q, rq) in regs.iter_mut().enumerate() {
        for (c, v) in rq.iter_mut().enumerate().take(lanes) {
            *v = crate::ops::simd::load8(&acc[q * HD + c * 8..]);
        }
    }
    for (r, row) in d.chunks_exact(HD).enumerate() {
        let w: [f32; Q] = std::array::from_fn(|q| p[q * stride + r]);
        if w.iter().all(|&x| x == 0.0) {
            continue;
        }
        let rv: [f32x8; L] = std::array::from_fn(|c| {
            if c < lanes {
                E::load8(&row[c * 8..])
            } else {
                f32x8::ZERO
            }
        });
        for (rq, &wq) in regs.iter_mut().zip(&w) {
            if wq != 0.0 {
                let wv = f32x8::splat(wq);
                for c in 0..lanes {
                    rq[c] = rv[c].mul_add(wv, rq[c]);
                }
            }
        }
    }
    for (q, rq) in regs.iter().enumerate() {
        for (c, v) in rq.iter().enumerate().take(lanes) {
            crate::ops::simd::store8(&mut acc[q * HD + c * 8..], *v);
        }
    }
}

/// Most queries one pass of [`dot_rows_multi`] / [`axpy_rows_tiled`] serves (a GQA or MQA
/// group's query heads; Gemma 3 has four on one KV head).
const MAX_Q: usize = 4;

/// [`dot_rows_k`] with each row widened once for up to [`MAX_Q`] queries: the same lane
/// sums in the same order for every query ([`dot_lanes_elem`]'s), the same reductions, so
/// the same bits; the rows are read once per group of queries instead of once per query.
fn dot_rows_multi<E: Elem, const HD: usize>(
    d: &[E],
    hd: usize,
    qs: &[f32],
    out: &mut [f32],
    stride: usize,
) {
    let hd = if HD != 0 { HD } else { hd };
    let nq = qs.len() / hd;
    let mut j = 0;
    while j < nq {
        let take = (nq - j).min(MAX_Q);
        let q = &qs[j * hd..(j + take) * hd];
        let o = &mut out[j * stride..];
        match take {
            4 => dot_rows_q::<E, HD, 4>(d, hd, q, o, stride),
            3 => dot_rows_q::<E, HD, 3>(d, hd, q, o, stride),
            2 => dot_rows_q::<E, HD, 2>(d, hd, q, o, stride),
            _ => dot_rows_q::<E, HD, 1>(d, hd, q, o, stride),
        }
        j += take;
    }
}

/// [`dot_rows_multi`] for `Q` queries `qs` (`(Q, hd)`): eight rows per reduction, the
/// last block padded with zeros, as [`dot_rows_k`].
#[inline(always)]
fn dot_rows_q<E: Elem, const HD: usize, const Q: usize>(
    d: &[E],
    hd: usize,
    qs: &[f32],
    out: &mut [f32],
    stride: usize,
) {
    let rows = d.len() / hd;
    let q: [&[f32]; Q] = std::array::from_fn(|j| &qs[j * hd..(j + 1) * hd]);
    let mut r0 = 0;
    while r0 < rows {
        let m = (rows - r0).min(8);
        let mut part = [[(f32x8::ZERO, 0.0f32); 8]; Q];
        for k in 0..m {
            let lanes = dot_lanes_multi::<E, HD, Q>(&q, &d[(r0 + k) * hd..(r0 + k + 1) * hd]);
            for j in 0..Q {
                part[j][k] = lanes[j];
            }
        }
        for (j, pj) in part.iter().enumerate() {
            let o = &mut out[j * stride + r0..j * stride + r0 + m];
            o.copy_from_slice(&reduce8(*pj).to_array()[..m]);
        }
        r0 += m;
    }
}

/// [`dot_lanes_elem`] of each of `Q` queries against one row, every chunk of the row
/// widened once: per query the same two lane accumulators over alternating chunks of
/// eight (an odd last chunk to the first), the same tail.
#[inline(always)]
fn dot_lanes_multi<E: Elem, const HD: usize, const Q: usize>(
    q: &[&[f32]; Q],
    row: &[E],
) -> [(f32x8, f32); Q] {
    let n = if HD != 0 { HD } else { row.len() };
    let row = &row[..n];
    let q: [&[f32]; Q] = std::array::from_fn(|j| &q[j][..n]);
    let (mut a0, mut a1) = ([f32x8::ZERO; Q], [f32x8::ZERO; Q]);
    let mut i = 0;
    while i + 16 <= n {
        let (r0, r1) = (E::load8(&row[i..]), E::load8(&row[i + 8..]));
        for j in 0..Q {
            a0[j] = r0.mul_add(crate::ops::simd::load8(&q[j][i..]), a0[j]);
            a1[j] = r1.mul_add(crate::ops::simd::load8(&q[j][i + 8..]), a1[j]);
        }
        i += 16;
    }
    if i + 8 <= n {
        let r0 = E::load8(&row[i..]);
        for j in 0..Q {
            a0[j] = r0.mul_add(crate::ops::simd::load8(&q[j][i..]), a0[j]);
        }
        i += 8;
    }
    std::array::from_fn(|j| {
        let mut tail = 0.0f32;
        for c in i..n {
            tail += q[j][c] * row[c].to_f32();
        }
        (a0[j] + a1[j], tail)
    })
}

/// Bytes of rows one tile of [`axpy_rows_tiled`] covers (they stay in L1 while every
/// column chunk of the tile is summed).
const TILE_BYTES: usize = 16 << 10;

/// [`axpy_rows_k`] for a head dim that is a multiple of 16 and too wide for its
/// accumulators to live in registers across a run (256 in Gemma 3): rows in tiles of
/// about [`TILE_BYTES`], and within a tile sixteen columns at a time for up to
/// [`MAX_Q`] queries, whose accumulators stay in registers over the tile's rows. Each
/// element of each query's sum takes the same multiply-adds in the same row order as
/// [`axpy_elem`] row by row (rows of weight 0 skipped per query), so the same bits; each
/// row is read once per group of queries instead of once per query, and the accumulators
/// are loaded and stored once per tile instead of once per row.
fn axpy_rows_tiled<E: Elem, const HD: usize>(
    d: &[E],
    hd: usize,
    p: &[f32],
    stride: usize,
    acc: &mut [f32],
) {
    let hd = if HD != 0 { HD } else { hd };
    debug_assert!(hd.is_multiple_of(16));
    let (rows, nq) = (d.len() / hd, acc.len() / hd);
    let tile = (TILE_BYTES / (hd * std::mem::size_of::<E>())).clamp(8, 64);
    let mut t0 = 0;
    while t0 < rows {
        let t1 = (t0 + tile).min(rows);
        let dt = &d[t0 * hd..t1 * hd];
        let mut j = 0;
        while j < nq {
            let take = (nq - j).min(MAX_Q);
            let (pj, aj) = (&p[j * stride + t0..], &mut acc[j * hd..(j + take) * hd]);
            match take {
                4 => axpy_tile::<E, HD, 4>(dt, hd, pj, stride, aj),
                3 => axpy_tile::<E, HD, 3>(dt, hd, pj, stride, aj),
                2 => axpy_tile::<E, HD, 2>(dt, hd, pj, stride, aj),
                _ => axpy_tile::<E, HD, 1>(dt, hd, pj, stride, aj),
            }
            j += take;
        }
        t0 = t1;
    }
}

/// One tile of [`axpy_rows_tiled`] for `Q` queries: `acc` `(Q, hd)`, `p[q * stride + r]`
/// the weight of query `q` on the tile's row `r`.
#[inline(always)]
fn axpy_tile<E: Elem, const HD: usize, const Q: usize>(
    d: &[E],
    hd: usize,
    p: &[f32],
    stride: usize,
    acc: &mut [f32],
) {
    use crate::ops::simd::{load8, store8};
    let rows = d.len() / hd;
    let w: [&[f32]; Q] = std::array::from_fn(|q| &p[q * stride..q * stride + rows]);
    let mut c = 0;
    while c + 16 <= hd {
        let mut regs: [[f32x8; 2]; Q] = std::array::from_fn(|q| {
            let a = &acc[q * hd + c..q * hd + c + 16];
            [load8(a), load8(&a[8..])]
        });
        for r in 0..rows {
            let wr: [f32; Q] = std::array::from_fn(|q| w[q][r]);
            if wr.iter().all(|&x| x == 0.0) {
                continue;
            }
            let row = &d[r * hd + c..r * hd + c + 16];
            let (v0, v1) = (E::load8(row), E::load8(&row[8..]));
            for (rq, &wq) in regs.iter_mut().zip(&wr) {
                if wq != 0.0 {
                    let wv = f32x8::splat(wq);
                    rq[0] = v0.mul_add(wv, rq[0]);
                    rq[1] = v1.mul_add(wv, rq[1]);
                }
            }
        }
        for (q, rq) in regs.iter().enumerate() {
            let a = &mut acc[q * hd + c..q * hd + c + 16];
            store8(a, rq[0]);
            store8(&mut a[8..], rq[1]);
        }
        c += 16;
    }
}

/// Scalar twin of [`dot_elem`] (sequential sum).
#[cfg(test)]
pub(crate) fn dot_elem_scalar<E: Elem>(q: &[f32], row: &[E]) -> f32 {
    q.iter().zip(row).map(|(a, b)| a * b.to_f32()).sum()
}

/// Scalar twin of [`axpy_elem`].
#[cfg(test)]
pub(crate) fn axpy_elem_scalar<E: Elem>(alpha: f32, row: &[E], acc: &mut [f32]) {
    for (o, r) in acc.iter_mut().zip(row) {
        *o += alpha * r.to_f32();
    }
}

/// Plain rows of one element type (also the f32 residual rings of the KIVI stores).
#[derive(Debug, Clone)]
pub(crate) struct Rows<E> {
    head_dim: usize,
    /// per KV head: (slots, head_dim)
    data: Vec<Vec<E>>,
    /// hold bookkeeping, empty when not holding (`journal.rs`)
    journal: Journal,
}

impl<E: Elem + Pod> Rows<E> {
    pub(crate) fn new(kv_heads: usize, head_dim: usize) -> Self {
        Rows {
            head_dim,
            data: vec![Vec::new(); kv_heads],
            journal: Journal::default(),
        }
    }

    /// Stores a `(kv_heads, head_dim)` row at `slot`.
    pub(crate) fn write(&mut self, slot: usize, row: &[f32]) {
        let journal = &mut self.journal;
        Self::write_to(&mut self.data, self.head_dim, journal, 0, slot, row);
    }

    /// [`Rows::write`] journaled in `journal` as field `field` (a store holding these
    /// rows as one of its buffers: the KIVI V residual ring).
    pub(crate) fn write_in(&mut self, journal: &mut Journal, field: u8, slot: usize, row: &[f32]) {
        Self::write_to(&mut self.data, self.head_dim, journal, field, slot, row);
    }

    fn write_to(
        data: &mut [Vec<E>],
        hd: usize,
        journal: &mut Journal,
        field: u8,
        slot: usize,
        row: &[f32],
    ) {
        debug_assert_eq!(row.len(), data.len() * hd);
        for (h, (buf, src)) in data.iter_mut().zip(row.chunks_exact(hd)).enumerate() {
            let dst = journal.write(field, h, buf, slot * hd..(slot + 1) * hd);
            for (d, &s) in dst.iter_mut().zip(src) {
                *d = E::from_f32(s);
            }
        }
    }

    /// Undoes one journal entry of KV head `h`'s buffer ([`journal::restore`]).
    pub(crate) fn restore(&mut self, h: usize, at: usize, old: &[u8], old_len: usize) {
        journal::restore(&mut self.data[h], at, old, old_len);
    }

    /// KV head `h` of the row in `slot`, widened to f32.
    #[inline]
    pub(crate) fn read_slot(&self, h: usize, slot: usize, out: &mut [f32]) {
        let hd = self.head_dim;
        debug_assert_eq!(out.len(), hd);
        E::widen(&self.data[h][slot * hd..(slot + 1) * hd], out);
    }

    /// Bytes one stored row occupies across all heads.
    pub(crate) fn row_bytes(&self) -> usize {
        self.data.len() * self.head_dim * std::mem::size_of::<E>()
    }

    /// A view of slots `slots` of KV head `h`.
    #[inline]
    pub(crate) fn run(&self, h: usize, slots: Range<usize>) -> PlainRun<'_, E> {
        let hd = self.head_dim;
        PlainRun {
            hd,
            data: &self.data[h][slots.start * hd..slots.end * hd],
        }
    }
}

impl<E: Wire> Rows<E> {
    /// Writes every head's slots (a saved state).
    pub(crate) fn save_rows(&self, w: &mut Writer) {
        self.data.iter().for_each(|d| w.vec(d));
    }

    /// Reads what [`Rows::save_rows`] wrote: at least `need` and at most `max` slots.
    pub(crate) fn load_rows(
        &mut self,
        r: &mut Reader<'_>,
        need: usize,
        max: usize,
        what: &dyn Fn() -> String,
    ) -> Result<()> {
        self.data = load_heads(r, self.data.len(), self.head_dim, need, max, what)?;
        Ok(())
    }
}

impl<E: Elem + Pod + std::fmt::Debug + Wire> RowStore for Rows<E> {
    fn append(&mut self, _b: usize, slot: Option<usize>, row: &[f32], _at: &Region<'_>) {
        self.journal.mark();
        if let Some(slot) = slot {
            self.write(slot, row);
        }
    }
    fn hold(&mut self) {
        self.journal.hold();
    }
    fn stop_holding(&mut self) {
        self.journal.stop();
    }

    fn rewind(&mut self, keep: usize) {
        let data = &mut self.data;
        self.journal.rewind(keep, |_, h, at, old, len| {
            journal::restore(&mut data[h], at, old, len)
        });
    }
    fn hold_bytes(&self) -> usize {
        self.journal.bytes()
    }
    fn read(&self, h: usize, b: usize, at: &Region<'_>, out: &mut [f32]) {
        self.read_slot(h, at.slot(b), out)
    }
    fn run_end(&self, _b: usize, end: usize, _at: &Region<'_>) -> usize {
        end
    }
    fn bytes(&self, at: &Region<'_>) -> usize {
        at.stored() * self.row_bytes()
    }
    fn buffer_bytes(&self) -> usize {
        heads_bytes(&self.data)
    }
    fn copy_blocks(&self, f: &mut dyn FnMut(usize)) {
        heads_blocks(&self.data, f);
        self.journal.copy_blocks(f);
    }
    fn save(&self, w: &mut Writer) {
        self.save_rows(w)
    }
    /// Slots: every stored row's, at most one per row appended.
    fn load(
        &mut self,
        r: &mut Reader<'_>,
        at: &Region<'_>,
        stored: &[Range<usize>],
        what: &str,
    ) -> Result<()> {
        let need = slots_needed(at, stored);
        self.load_rows(r, need, at.appended(), &|| format!("{what} rows"))
    }
}

impl<E: Elem + Pod + std::fmt::Debug + Wire> KeyStore for Rows<E> {
    fn clone_box(&self) -> Box<dyn KeyStore> {
        Box::new(self.clone())
    }
    fn with_run(
        &self,
        h: usize,
        rows: Range<usize>,
        at: &Region<'_>,
        f: &mut dyn FnMut(&dyn KeyRun),
    ) {
        let s = at.slot(rows.start);
        f(&self.run(h, s..s + rows.len()))
    }
}

impl<E: Elem + Pod + std::fmt::Debug + Wire> ValueStore for Rows<E> {
    fn clone_box(&self) -> Box<dyn ValueStore> {
        Box::new(self.clone())
    }
    fn with_run(
        &self,
        h: usize,
        rows: Range<usize>,
        at: &Region<'_>,
        f: &mut dyn FnMut(&dyn ValueRun),
    ) {
        let s = at.slot(rows.start);
        f(&self.run(h, s..s + rows.len()))
    }
}

/// Consecutive plain rows of one KV head: `(len, head_dim)` of `E` (prefix rows, plain
/// body rows, or an f32 residual ring's rows).
#[derive(Debug, Clone, Copy)]
pub(crate) struct PlainRun<'a, E> {
    hd: usize,
    data: &'a [E],
}

impl<'a, E: Elem> PlainRun<'a, E> {
    /// `(len, head_dim)` rows.
    pub(crate) fn new(hd: usize, data: &'a [E]) -> Self {
        PlainRun { hd, data }
    }
}

impl<E: Elem> KeyRun for PlainRun<'_, E> {
    #[inline]
    fn len(&self) -> usize {
        self.data.len() / self.hd
    }

    /// Eight rows per reduction ([`reduce8`]).
    fn dot_rows(
        &self,
        _kernel: KvKernel,
        qs: &[f32],
        _fold: &mut [f32],
        out: &mut [f32],
        stride: usize,
    ) {
        let (hd, d) = (self.hd, self.data);
        match hd {
            32 => dot_rows_k::<_, 32>(d, hd, qs, out, stride),
            64 => dot_rows_k::<_, 64>(d, hd, qs, out, stride),
            128 => dot_rows_k::<_, 128>(d, hd, qs, out, stride),
            256 => dot_rows_multi::<_, 256>(d, hd, qs, out, stride),
            _ => dot_rows_multi::<_, 0>(d, hd, qs, out, stride),
        }
    }

    fn for_each_block(
        &self,
        buf: &mut [f32],
        _params: &mut [f32],
        f: &mut dyn FnMut(usize, &mut [f32]),
    ) {
        let hd = self.hd;
        let block = buf.len() / hd;
        debug_assert!(block > 0);
        for (b, rows) in self.data.chunks(block * hd).enumerate() {
            let out = &mut buf[..rows.len()];
            Elem::widen(rows, out);
            f(b * block, out);
        }
    }
}

impl<E: Elem> ValueRun for PlainRun<'_, E> {
    #[inline]
    fn len(&self) -> usize {
        self.data.len() / self.hd
    }

    /// For head dims 32/64/128 the accumulator stays in registers across the run; for
    /// other multiples of 16 (256) across a tile of rows ([`axpy_rows_tiled`]).
    fn axpy_rows(
        &self,
        _kernel: KvKernel,
        p: &[f32],
        stride: usize,
        acc: &mut [f32],
        _bias: &mut [f32],
    ) {
        let (hd, d) = (self.hd, self.data);
        match hd {
            32 => axpy_rows_k::<_, 32>(d, hd, p, stride, acc),
            64 => axpy_rows_k::<_, 64>(d, hd, p, stride, acc),
            128 => axpy_rows_k::<_, 128>(d, hd, p, stride, acc),
            256 => axpy_rows_tiled::<_, 256>(d, hd, p, stride, acc),
            _ if hd.is_multiple_of(16) => axpy_rows_tiled::<_, 0>(d, hd, p, stride, acc),
            _ => axpy_rows_k::<_, 0>(d, hd, p, stride, acc),
        }
    }

    #[cfg(test)]
    fn read(&self, r: usize, out: &mut [f32]) {
        let hd = self.hd;
        Elem::widen(&self.data[r * hd..(r + 1) * hd], out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::{bf16, f16};

    /// The in-register widening kernels against their scalar twins at odd lengths, for
    /// every element type (values chosen so f16/bf16 rounding is exercised).
    #[test]
    fn plain_kernels_match_scalar_twins() {
        fn check<E: Elem + std::fmt::Debug>(name: &str) {
            for n in [
                1usize, 2, 3, 6, 7, 8, 9, 15, 16, 17, 18, 31, 32, 33, 34, 64, 65,
            ] {
                let row: Vec<E> = (0..n)
                    .map(|i| E::from_f32((i as f32 * 0.731).sin() * 3.0 + 1e-6 * i as f32))
                    .collect();
                let q: Vec<f32> = (0..n).map(|i| (i as f32 * 0.377).cos()).collect();
                let exact: f64 = q
                    .iter()
                    .zip(&row)
                    .map(|(a, b)| *a as f64 * b.to_f32() as f64)
                    .sum();
                let mag: f64 = q
                    .iter()
                    .zip(&row)
                    .map(|(a, b)| (*a as f64 * b.to_f32() as f64).abs())
                    .sum();
                let bound = 1e-6 * mag.max(1.0);
                let (fused, scalar) = (dot_elem(&q, &row), dot_elem_scalar(&q, &row));
                assert!(
                    (fused as f64 - exact).abs() <= bound,
                    "{name} n={n}: {fused} vs {exact}"
                );
                assert!((scalar as f64 - exact).abs() <= bound, "{name} n={n}");
                let (mut a, mut b) = (q.clone(), q.clone());
                axpy_elem(-0.61, &row, &mut a);
                axpy_elem_scalar(-0.61, &row, &mut b);
                for i in 0..n {
                    assert!(
                        (a[i] - b[i]).abs() <= 1e-6 * b[i].abs().max(1.0),
                        "{name} n={n} i={i}"
                    );
                }
                // Widening in registers is exact: load8 equals to_f32 lane by lane.
                if n >= 8 {
                    let lanes = E::load8(&row).to_array();
                    for i in 0..8 {
                        assert_eq!(
                            lanes[i].to_bits(),
                            row[i].to_f32().to_bits(),
                            "{name} lane {i}"
                        );
                    }
                }
            }
        }
        check::<f32>("f32");
        check::<f16>("f16");
        check::<bf16>("bf16");
    }

    /// Run-level scoring and weighted sums over plain rows (head dims 32/64/128 take
    /// their own specialisations) against scalar twins: full and partial blocks of 8,
    /// zero weights, several queries, every element type.
    #[test]
    fn plain_run_kernels_match_scalar_twins() {
        fn check<E: Elem + Pod>(name: &str) {
            for hd in [2usize, 6, 18, 32, 34, 64, 128, 256] {
                for rows in [1usize, 7, 8, 9, 19] {
                    for nq in [1usize, 3] {
                        let ctx = format!("{name} hd={hd} rows={rows} nq={nq}");
                        let mut store = Rows::<E>::new(1, hd);
                        for r in 0..rows {
                            let row: Vec<f32> = (0..hd)
                                .map(|c| ((r * hd + c) as f32 * 0.613).sin() * 2.0)
                                .collect();
                            store.write(r, &row);
                        }
                        let run = store.run(0, 0..rows);
                        let widened = |r: usize| -> Vec<f32> {
                            let mut o = vec![0.0; hd];
                            ValueRun::read(&run, r, &mut o);
                            o
                        };
                        let qs: Vec<f32> = (0..nq * hd).map(|i| (i as f32 * 0.29).cos()).collect();
                        let stride = rows + 3;
                        let mut out = vec![f32::NAN; nq * stride];
                        run.dot_rows(KvKernel::Portable, &qs, &mut [], &mut out, stride);
                        for j in 0..nq {
                            let q = &qs[j * hd..(j + 1) * hd];
                            for r in 0..rows {
                                let k = widened(r);
                                let want = dot_elem_scalar(q, &k);
                                let mag: f32 = q.iter().zip(&k).map(|(a, b)| (a * b).abs()).sum();
                                let got = out[j * stride + r];
                                assert!(
                                    (got - want).abs() <= 1e-6 * mag.max(1.0),
                                    "{ctx} j={j} r={r}"
                                );
                            }
                        }
                        let p: Vec<f32> = (0..nq * stride)
                            .map(|i| {
                                if i % 4 == 1 {
                                    0.0
                                } else {
                                    (i as f32 * 0.7).sin().abs()
                                }
                            })
                            .collect();
                        let acc0: Vec<f32> = (0..nq * hd).map(|i| i as f32 * 0.01).collect();
                        let (mut a, mut b) = (acc0.clone(), acc0);
                        run.axpy_rows(KvKernel::Portable, &p, stride, &mut a, &mut []);
                        for j in 0..nq {
                            for r in 0..rows {
                                let w = p[j * stride + r];
                                if w != 0.0 {
                                    axpy_elem_scalar(w, &widened(r), &mut b[j * hd..(j + 1) * hd]);
                                }
                            }
                        }
                        for i in 0..nq * hd {
                            assert!(
                                (a[i] - b[i]).abs() <= 1e-5 * b[i].abs().max(1.0),
                                "{ctx} i={i}"
                            );
                        }
                    }
                }
            }
        }
        check::<f32>("f32");
        check::<f16>("f16");
        check::<bf16>("bf16");
    }

    /// The multi-query kernels ([`dot_rows_multi`], [`axpy_rows_tiled`]) against the
    /// per-query kernels they replace ([`dot_rows_k`], [`axpy_rows_k`] with the head dim
    /// at run time), bit for bit, for one element type: `rows` rows of `hd` values drawn
    /// in `±scale`, `nq` queries, weights of which every `zero_every`-th (and, with
    /// `zero_every` = 1, whole rows) are 0.
    fn check_multi_bitwise<E: Elem>(
        hd: usize,
        rows: usize,
        nq: usize,
        scale: f32,
        zero_every: usize,
        seed: u64,
    ) {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let d: Vec<E> = (0..rows * hd)
            .map(|_| E::from_f32(rng.gen_range(-scale..scale)))
            .collect();
        let qs: Vec<f32> = (0..nq * hd).map(|_| rng.gen_range(-3.0..3.0)).collect();
        let stride = rows + 5;
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        // scores: the per-query kernel, the generic multi-query one and the dispatched one
        let mut want = vec![f32::NAN; nq * stride];
        dot_rows_k::<E, 0>(&d, hd, &qs, &mut want, stride);
        let mut got = vec![f32::NAN; nq * stride];
        dot_rows_multi::<E, 0>(&d, hd, &qs, &mut got, stride);
        assert_eq!(bits(&got), bits(&want), "dot hd={hd} rows={rows} nq={nq}");
        let mut got = vec![f32::NAN; nq * stride];
        PlainRun::new(hd, &d).dot_rows(KvKernel::Portable, &qs, &mut [], &mut got, stride);
        assert_eq!(
            bits(&got),
            bits(&want),
            "dot_rows hd={hd} rows={rows} nq={nq}"
        );
        // weighted sums
        let p: Vec<f32> = (0..nq * stride)
            .map(|i| {
                let (q, r) = (i / stride, i % stride);
                let zero = match zero_every {
                    0 => false,
                    1 => r % 3 == 1 || (q + r) % 5 == 0,
                    z => i % z == 0,
                };
                if zero {
                    0.0
                } else {
                    rng.gen_range(0.0..1.0)
                }
            })
            .collect();
        let acc0: Vec<f32> = (0..nq * hd).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let mut want = acc0.clone();
        axpy_rows_k::<E, 0>(&d, hd, &p, stride, &mut want);
        let mut got = acc0.clone();
        PlainRun::new(hd, &d).axpy_rows(KvKernel::Portable, &p, stride, &mut got, &mut []);
        assert_eq!(
            bits(&got),
            bits(&want),
            "axpy_rows hd={hd} rows={rows} nq={nq}"
        );
        if hd.is_multiple_of(16) {
            let mut got = acc0;
            axpy_rows_tiled::<E, 0>(&d, hd, &p, stride, &mut got);
            assert_eq!(bits(&got), bits(&want), "tiled hd={hd} rows={rows} nq={nq}");
        }
    }

    /// Boundaries of the multi-query kernels: one row, one query, a full and a partial
    /// block of eight, a tile and one row more, five queries (a group of four and one),
    /// Gemma 3's head dim 256 with its four query heads, the f16 extremes.
    #[test]
    fn multi_query_kernels_equal_per_query_kernels_on_boundaries() {
        for hd in [16usize, 48, 256] {
            for rows in [1usize, 7, 8, 9, 32, 33, 65] {
                for nq in [1usize, 4, 5] {
                    for (scale, zero_every) in [(1.0, 0), (65504.0, 1), (1e-3, 3)] {
                        check_multi_bitwise::<f32>(hd, rows, nq, scale, zero_every, 1);
                        check_multi_bitwise::<f16>(hd, rows, nq, scale, zero_every, 2);
                        check_multi_bitwise::<bf16>(hd, rows, nq, scale, zero_every, 3);
                    }
                }
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config {
            cases: 48,
            failure_persistence: None,
            rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha,
            ..proptest::test_runner::Config::default()
        })]

        /// Random shapes: the multi-query kernels equal the per-query ones bit for bit.
        #[test]
        fn multi_query_kernels_equal_per_query_kernels(
            hd in proptest::sample::select(vec![2usize, 6, 8, 16, 18, 24, 48, 96, 256]),
            rows in 1usize..150,
            nq in 1usize..10,
            scale in proptest::sample::select(vec![1e-3f32, 1.0, 100.0, 65504.0]),
            zero_every in 0usize..5,
            seed in proptest::prelude::any::<u64>(),
        ) {
            check_multi_bitwise::<f32>(hd, rows, nq, scale, zero_every, seed);
            check_multi_bitwise::<f16>(hd, rows, nq, scale, zero_every, seed);
            check_multi_bitwise::<bf16>(hd, rows, nq, scale, zero_every, seed);
        }
    }

    /// f16 widening covers subnormals, ±0, the saturated extremes and infinities/NaN.
    #[test]
    fn f16_and_bf16_load8_are_exact_on_special_values() {
        let specials = [
            0.0f32,
            -0.0,
            6.0e-8,
            -6.0e-8,
            1e-5,
            65504.0,
            -65504.0,
            f32::INFINITY,
        ];
        let h: Vec<f16> = specials.iter().map(|&x| f16::from_f32(x)).collect();
        let got = f16::load8(&h).to_array();
        for i in 0..8 {
            assert_eq!(
                got[i].to_bits(),
                h[i].to_f32().to_bits(),
                "f16 {}",
                specials[i]
            );
        }
        let b: Vec<bf16> = specials.iter().map(|&x| bf16::from_f32(x)).collect();
        let got = bf16::load8(&b).to_array();
        for i in 0..8 {
            assert_eq!(
                got[i].to_bits(),
                b[i].to_f32().to_bits(),
                "bf16 {}",
                specials[i]
            );
        }
    }
}
