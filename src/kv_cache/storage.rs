//! How stored rows are held: plain rows (f32/f16/bf16) and KIVI rows (int8/int4/int2).
//!
//! Every buffer is split per KV head so one head's rows are contiguous (what a fused
//! attention kernel streams over); a *slot* is a row index inside these buffers.
//! Buffers grow lazily up to the slot written, so a bounded ring allocates at most
//! `window` slots and an unbounded cache grows amortised O(1) per row.
//!
//! ```text
//! Rows<E>        data[h]       (slots, head_dim)              E = f32 | f16 | bf16
//! TokenQuant     codes[h]      (slots, packed(head_dim))      V, offset-binary codes
//!                scale[h]      (slots)  f16                   one (scale, zero) per
//!                zero[h]       (slots)  f16                   token and KV head
//! ChannelQuant   codes[h]      (slots, packed(head_dim))      K, offset-binary codes
//!                scale[h]      (group_slots, head_dim) f16    one (scale, zero) per
//!                zero[h]       (group_slots, head_dim) f16    group and channel
//!                residual[h]   (R + G, head_dim) f32          rows not yet quantised,
//!                                                             ring slot b % (R + G)
//! ```
//!
//! `packed(n)` is `n` bytes for int8, `ceil(n / 2)` for int4, whose element `2j` is
//! the **low** nibble of byte `j` and element `2j + 1` the **high** nibble, and
//! `ceil(n / 4)` for int2, element `4j + i` in bits `2i..2i + 2` of byte `j` (see
//! [`crate::quant`]). Codes are never handed out: every read dequantises into f32, and
//! attention reads through *run views* ([`PlainRun`], [`ChannelRun`], [`TokenRun`]): a
//! run is a range of consecutive slots of one KV head (and, for K codes, of one group)
//! whose fields are private, so the only things attention can do with it are the fused
//! kernels below (scores of queries against the rows, probability-weighted sums of the
//! rows), which fold scales and zeros into the arithmetic instead of dequantising.
//!
//! Invariants (`ChannelQuant`): a row's codes are valid only once its group is quantised;
//! until then the row lives in `residual`, a ring of `R + G` rows (at most `R + G − 1`
//! rows wait at once, and a group's rows are still there when it is quantised). A group's `(scale, zero)` are written once,
//! when the group completes, and stay valid for every row of the group that is still
//! stored, whatever was evicted around it.

pub(crate) use crate::ops::simd::Elem;
use crate::quant::{self, Bits};
use half::{bf16, f16, slice::HalfFloatSliceExt};
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
            o.copy_from_slice(&quant::reduce8(part).to_array()[..o.len()]);
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

/// Makes `buf` hold at least `len` elements (growing with `Default` values).
#[inline]
fn ensure<T: Copy + Default>(buf: &mut Vec<T>, len: usize) {
    if buf.len() < len {
        buf.resize(len, T::default());
    }
}

/// Plain rows of one element type.
#[derive(Debug, Clone)]
pub(crate) struct Rows<E> {
    head_dim: usize,
    /// per KV head: (slots, head_dim)
    data: Vec<Vec<E>>,
}

impl<E: Elem> Rows<E> {
    fn new(kv_heads: usize, head_dim: usize) -> Self {
        Rows {
            head_dim,
            data: vec![Vec::new(); kv_heads],
        }
    }

    /// Stores a `(kv_heads, head_dim)` row at `slot`.
    fn write(&mut self, slot: usize, row: &[f32]) {
        let hd = self.head_dim;
        debug_assert_eq!(row.len(), self.data.len() * hd);
        for (buf, src) in self.data.iter_mut().zip(row.chunks_exact(hd)) {
            ensure(buf, (slot + 1) * hd);
            for (d, &s) in buf[slot * hd..(slot + 1) * hd].iter_mut().zip(src) {
                *d = E::from_f32(s);
            }
        }
    }

    #[inline]
    fn read(&self, h: usize, slot: usize, out: &mut [f32]) {
        let hd = self.head_dim;
        debug_assert_eq!(out.len(), hd);
        E::widen(&self.data[h][slot * hd..(slot + 1) * hd], out);
    }

    /// Bytes one stored row occupies across all heads.
    fn row_bytes(&self) -> usize {
        self.data.len() * self.head_dim * std::mem::size_of::<E>()
    }

    /// Slots `slots` of KV head `h`, `(slots.len(), head_dim)`.
    #[inline]
    fn slice(&self, h: usize, slots: std::ops::Range<usize>) -> &[E] {
        let hd = self.head_dim;
        &self.data[h][slots.start * hd..slots.end * hd]
    }
}

/// Plain rows at the cache's precision.
#[derive(Debug, Clone)]
pub(crate) enum Plain {
    F32(Rows<f32>),
    F16(Rows<f16>),
    Bf16(Rows<bf16>),
}

macro_rules! plain_dispatch {
    ($self:expr, $r:ident => $e:expr) => {
        match $self {
            Plain::F32($r) => $e,
            Plain::F16($r) => $e,
            Plain::Bf16($r) => $e,
        }
    };
}

/// Element type of a [`Plain`] store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PlainKind {
    F32,
    F16,
    Bf16,
}

impl Plain {
    pub(crate) fn new(kind: PlainKind, kv_heads: usize, head_dim: usize) -> Self {
        match kind {
            PlainKind::F32 => Plain::F32(Rows::new(kv_heads, head_dim)),
            PlainKind::F16 => Plain::F16(Rows::new(kv_heads, head_dim)),
            PlainKind::Bf16 => Plain::Bf16(Rows::new(kv_heads, head_dim)),
        }
    }
    pub(crate) fn write(&mut self, slot: usize, row: &[f32]) {
        plain_dispatch!(self, r => r.write(slot, row))
    }
    #[inline]
    pub(crate) fn read(&self, h: usize, slot: usize, out: &mut [f32]) {
        plain_dispatch!(self, r => r.read(h, slot, out))
    }
    pub(crate) fn row_bytes(&self) -> usize {
        plain_dispatch!(self, r => r.row_bytes())
    }
    /// A view of slots `slots` of KV head `h`.
    #[inline]
    pub(crate) fn run(&self, h: usize, slots: std::ops::Range<usize>) -> PlainRun<'_> {
        let hd = match self {
            Plain::F32(r) => r.head_dim,
            Plain::F16(r) => r.head_dim,
            Plain::Bf16(r) => r.head_dim,
        };
        let data = match self {
            Plain::F32(r) => PlainData::F32(r.slice(h, slots)),
            Plain::F16(r) => PlainData::F16(r.slice(h, slots)),
            Plain::Bf16(r) => PlainData::Bf16(r.slice(h, slots)),
        };
        PlainRun { hd, data }
    }
}

#[derive(Debug, Clone, Copy)]
enum PlainData<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    Bf16(&'a [bf16]),
}

/// Consecutive plain rows of one KV head: `(len, head_dim)` at f32, f16 or bf16 (prefix
/// rows, plain body rows, or the f32 K residual).
#[derive(Debug, Clone, Copy)]
pub(crate) struct PlainRun<'a> {
    hd: usize,
    data: PlainData<'a>,
}

macro_rules! run_dispatch {
    ($self:expr, $d:ident => $e:expr) => {
        match $self.data {
            PlainData::F32($d) => $e,
            PlainData::F16($d) => $e,
            PlainData::Bf16($d) => $e,
        }
    };
}

impl PlainRun<'_> {
    /// Rows in the run.
    #[inline]
    pub(crate) fn len(&self) -> usize {
        run_dispatch!(self, d => d.len() / self.hd)
    }

    /// Scores `out[j * stride + r] = q_j · row_r` of the `qs.len() / head_dim` queries
    /// `qs` against every row, eight rows at a time ([`quant::reduce8`]).
    pub(crate) fn dot_rows(&self, qs: &[f32], out: &mut [f32], stride: usize) {
        let hd = self.hd;
        run_dispatch!(self, d => match hd {
            32 => dot_rows_k::<_, 32>(d, hd, qs, out, stride),
            64 => dot_rows_k::<_, 64>(d, hd, qs, out, stride),
            128 => dot_rows_k::<_, 128>(d, hd, qs, out, stride),
            _ => dot_rows_k::<_, 0>(d, hd, qs, out, stride),
        })
    }

    /// `acc_j += Σ_r p[j * stride + r] · row_r` for every query `j` (`acc` holds
    /// `(queries, head_dim)`), row by row in order; rows of weight 0 are skipped. For
    /// head dims 32/64/128 the accumulator stays in registers across the run.
    pub(crate) fn axpy_rows(&self, p: &[f32], stride: usize, acc: &mut [f32]) {
        let hd = self.hd;
        run_dispatch!(self, d => match hd {
            32 => axpy_rows_k::<_, 32>(d, hd, p, stride, acc),
            64 => axpy_rows_k::<_, 64>(d, hd, p, stride, acc),
            128 => axpy_rows_k::<_, 128>(d, hd, p, stride, acc),
            _ => axpy_rows_k::<_, 0>(d, hd, p, stride, acc),
        })
    }

    /// Row `r` widened to f32 (for tests of the run enumeration).
    #[cfg(test)]
    pub(crate) fn read(&self, r: usize, out: &mut [f32]) {
        let hd = self.hd;
        run_dispatch!(self, d => Elem::widen(&d[r * hd..(r + 1) * hd], out))
    }

    /// Calls `f(r0, rows)` with the rows widened to f32 in `buf`, a block of up to
    /// `buf.len() / head_dim` rows at a time (`rows`: `(m, head_dim)`, rows `r0..r0 + m`).
    pub(crate) fn for_each_block(&self, buf: &mut [f32], mut f: impl FnMut(usize, &mut [f32])) {
        let hd = self.hd;
        let block = buf.len() / hd;
        debug_assert!(block > 0);
        run_dispatch!(self, d => {
            for (b, rows) in d.chunks(block * hd).enumerate() {
                let out = &mut buf[..rows.len()];
                Elem::widen(rows, out);
                f(b * block, out);
            }
        })
    }
}

/// KIVI V rows: quantised per token and KV head when they leave the residual (at
/// append for R = 0).
#[derive(Debug, Clone)]
pub(crate) struct TokenQuant {
    bits: Bits,
    head_dim: usize,
    /// packed bytes of one head's row
    packed: usize,
    /// per KV head: (slots, packed)
    codes: Vec<Vec<u8>>,
    /// per KV head: (slots)
    scale: Vec<Vec<f16>>,
    /// per KV head: (slots)
    zero: Vec<Vec<f16>>,
}

impl TokenQuant {
    pub(crate) fn new(bits: Bits, kv_heads: usize, head_dim: usize) -> Self {
        TokenQuant {
            bits,
            head_dim,
            packed: bits.packed_len(head_dim),
            codes: vec![Vec::new(); kv_heads],
            scale: vec![Vec::new(); kv_heads],
            zero: vec![Vec::new(); kv_heads],
        }
    }

    pub(crate) fn write(&mut self, slot: usize, row: &[f32]) {
        let hd = self.head_dim;
        debug_assert_eq!(row.len(), self.codes.len() * hd);
        for (h, src) in row.chunks_exact(hd).enumerate() {
            self.write_head(h, slot, src);
        }
    }

    /// Quantises KV head `h`'s slice of a row (`head_dim` values) into `slot`.
    pub(crate) fn write_head(&mut self, h: usize, slot: usize, src: &[f32]) {
        let p = self.packed;
        ensure(&mut self.codes[h], (slot + 1) * p);
        ensure(&mut self.scale[h], slot + 1);
        ensure(&mut self.zero[h], slot + 1);
        let (s, z) =
            quant::quantize_token(src, self.bits, &mut self.codes[h][slot * p..(slot + 1) * p]);
        self.scale[h][slot] = s;
        self.zero[h][slot] = z;
    }

    #[inline]
    pub(crate) fn read(&self, h: usize, slot: usize, out: &mut [f32]) {
        let p = self.packed;
        quant::dequantize_token(
            &self.codes[h][slot * p..(slot + 1) * p],
            self.scale[h][slot],
            self.zero[h][slot],
            self.bits,
            out,
        );
    }

    /// Bytes one stored row occupies across all heads: codes + scale + zero.
    pub(crate) fn row_bytes(&self) -> usize {
        self.codes.len() * (self.packed + 2 * std::mem::size_of::<f16>())
    }

    /// A view of slots `slots` of KV head `h`.
    #[inline]
    pub(crate) fn run(&self, h: usize, slots: std::ops::Range<usize>) -> TokenRun<'_> {
        let p = self.packed;
        TokenRun {
            bits: self.bits,
            hd: self.head_dim,
            packed: p,
            codes: &self.codes[h][slots.start * p..slots.end * p],
            scale: &self.scale[h][slots.clone()],
            zero: &self.zero[h][slots],
        }
    }
}

/// Consecutive KIVI V rows of one KV head, each with its own `(scale, zero)`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TokenRun<'a> {
    bits: Bits,
    hd: usize,
    packed: usize,
    /// (len, packed)
    codes: &'a [u8],
    /// (len)
    scale: &'a [f16],
    /// (len)
    zero: &'a [f16],
}

impl TokenRun<'_> {
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.scale.len()
    }

    /// Row `r` dequantised (for tests of the run enumeration).
    #[cfg(test)]
    pub(crate) fn read(&self, r: usize, out: &mut [f32]) {
        let p = self.packed;
        quant::dequantize_token(
            &self.codes[r * p..(r + 1) * p],
            self.scale[r],
            self.zero[r],
            self.bits,
            out,
        );
    }

    /// `acc_j += Σ_r p_jr · v_r` for every query `j`, with `v_r = u_r·s_r + z_r` folded:
    /// the codes are accumulated with weight `p_jr·s_r` and `Σ_r p_jr·z_r` is added to
    /// `bias[j]` (the caller adds `bias[j]` to every element of `acc_j` at the end).
    pub(crate) fn axpy_rows(&self, p: &[f32], stride: usize, acc: &mut [f32], bias: &mut [f32]) {
        debug_assert_eq!(acc.len(), bias.len() * self.hd);
        debug_assert_eq!(self.codes.len(), self.len() * self.packed);
        quant::axpy_codes_rows(
            self.codes, self.scale, self.zero, p, stride, acc, bias, self.bits,
        );
    }
}

/// KIVI K rows: quantised per channel over groups of `group_size` rows.
#[derive(Debug, Clone)]
pub(crate) struct ChannelQuant {
    bits: Bits,
    head_dim: usize,
    packed: usize,
    group_size: usize,
    /// rows of the residual ring: `R + G`
    res_cap: usize,
    /// per KV head: (slots, packed); valid only for rows of quantised groups
    codes: Vec<Vec<u8>>,
    /// per KV head: (group_slots, head_dim)
    scale: Vec<Vec<f16>>,
    /// per KV head: (group_slots, head_dim)
    zero: Vec<Vec<f16>>,
    /// per KV head: (R + G, head_dim), body row `b` of a group not yet quantised in ring
    /// slot `b % (R + G)`
    residual: Vec<Vec<f32>>,
}

impl ChannelQuant {
    pub(crate) fn new(
        bits: Bits,
        kv_heads: usize,
        head_dim: usize,
        group_size: usize,
        residual: usize,
    ) -> Self {
        debug_assert!(group_size > 0);
        ChannelQuant {
            bits,
            head_dim,
            packed: bits.packed_len(head_dim),
            group_size,
            res_cap: group_size + residual,
            codes: vec![Vec::new(); kv_heads],
            scale: vec![Vec::new(); kv_heads],
            zero: vec![Vec::new(); kv_heads],
            residual: vec![Vec::new(); kv_heads],
        }
    }

    /// Rows of the residual ring (`R + G`).
    pub(crate) fn residual_cap(&self) -> usize {
        self.res_cap
    }

    /// Stores body row `b` (its `b`-th row after the full-precision prefix) in the residual.
    pub(crate) fn write_residual(&mut self, b: usize, row: &[f32]) {
        let hd = self.head_dim;
        let r = b % self.res_cap;
        for (buf, src) in self.residual.iter_mut().zip(row.chunks_exact(hd)) {
            ensure(buf, (r + 1) * hd);
            buf[r * hd..(r + 1) * hd].copy_from_slice(src);
        }
    }

    /// Quantises the complete group whose stored rows are body rows `rows` (a sub-range
    /// of the group): fits `(scale, zero)` per channel over those rows, stores them at
    /// `group_slot`, and writes each row's codes at `slot_of(b)`.
    pub(crate) fn complete_group(
        &mut self,
        rows: std::ops::Range<usize>,
        group_slot: usize,
        slot_of: impl Fn(usize) -> usize,
    ) {
        let (hd, p, g, cap) = (self.head_dim, self.packed, self.group_size, self.res_cap);
        debug_assert!(!rows.is_empty() && rows.len() <= g);
        debug_assert_eq!(rows.start / g, (rows.end - 1) / g, "rows span two groups");
        let mut lo = vec![f32::INFINITY; hd];
        let mut hi = vec![f32::NEG_INFINITY; hd];
        let mut s32 = vec![0.0f32; hd];
        let mut z32 = vec![0.0f32; hd];
        for h in 0..self.residual.len() {
            lo.fill(f32::INFINITY);
            hi.fill(f32::NEG_INFINITY);
            let res = &self.residual[h];
            for b in rows.clone() {
                let r = b % cap;
                for (c, &x) in res[r * hd..(r + 1) * hd].iter().enumerate() {
                    lo[c] = lo[c].min(x);
                    hi[c] = hi[c].max(x);
                }
            }
            ensure(&mut self.scale[h], (group_slot + 1) * hd);
            ensure(&mut self.zero[h], (group_slot + 1) * hd);
            for c in 0..hd {
                let (s, z) = quant::params(lo[c], hi[c], self.bits);
                self.scale[h][group_slot * hd + c] = s;
                self.zero[h][group_slot * hd + c] = z;
                s32[c] = s.to_f32();
                z32[c] = z.to_f32();
            }
            for b in rows.clone() {
                let r = b % cap;
                let slot = slot_of(b);
                ensure(&mut self.codes[h], (slot + 1) * p);
                quant::quantize_channels(
                    &res[r * hd..(r + 1) * hd],
                    &s32,
                    &z32,
                    self.bits,
                    &mut self.codes[h][slot * p..(slot + 1) * p],
                );
            }
        }
    }

    /// f32 copies of a group's parameters for KV head `h` (`head_dim` values each).
    #[inline]
    pub(crate) fn load_params(
        &self,
        h: usize,
        group_slot: usize,
        scale: &mut [f32],
        zero: &mut [f32],
    ) {
        let hd = self.head_dim;
        self.scale[h][group_slot * hd..(group_slot + 1) * hd].convert_to_f32_slice(scale);
        self.zero[h][group_slot * hd..(group_slot + 1) * hd].convert_to_f32_slice(zero);
    }

    /// Dequantises a row of a complete group, given its group's f32 parameters.
    #[inline]
    pub(crate) fn read_quant(
        &self,
        h: usize,
        slot: usize,
        scale: &[f32],
        zero: &[f32],
        out: &mut [f32],
    ) {
        let p = self.packed;
        quant::dequantize_channels(
            &self.codes[h][slot * p..(slot + 1) * p],
            scale,
            zero,
            self.bits,
            out,
        );
    }

    /// Reads body row `b` of a group not yet quantised.
    #[inline]
    pub(crate) fn read_residual(&self, h: usize, b: usize, out: &mut [f32]) {
        let hd = self.head_dim;
        let r = b % self.res_cap;
        out.copy_from_slice(&self.residual[h][r * hd..(r + 1) * hd]);
    }

    /// A view of the quantised rows in slots `slots` of KV head `h`: complete groups in
    /// consecutive group slots from `group_slot` on, the first row being row `offset` of
    /// its group (earlier rows of that group may have been evicted).
    #[inline]
    pub(crate) fn run(
        &self,
        h: usize,
        slots: std::ops::Range<usize>,
        group_slot: usize,
        offset: usize,
    ) -> ChannelRun<'_> {
        let (hd, p, g) = (self.head_dim, self.packed, self.group_size);
        let groups = (offset + slots.len()).div_ceil(g);
        let params = group_slot * hd..(group_slot + groups) * hd;
        ChannelRun {
            bits: self.bits,
            hd,
            packed: p,
            group: g,
            offset,
            codes: &self.codes[h][slots.start * p..slots.end * p],
            scale: &self.scale[h][params.clone()],
            zero: &self.zero[h][params],
        }
    }

    /// A view of body rows `b` (of groups not yet quantised) of KV head `h`.
    #[inline]
    pub(crate) fn residual_run(&self, h: usize, b: std::ops::Range<usize>) -> PlainRun<'_> {
        let (hd, cap) = (self.head_dim, self.res_cap);
        let r0 = b.start % cap;
        debug_assert!(r0 + b.len() <= cap, "residual run crosses the ring's wrap");
        PlainRun {
            hd,
            data: PlainData::F32(&self.residual[h][r0 * hd..(r0 + b.len()) * hd]),
        }
    }

    /// Bytes of one quantised row's codes across all heads.
    pub(crate) fn code_row_bytes(&self) -> usize {
        self.codes.len() * self.packed
    }
    /// Bytes of one residual row across all heads.
    pub(crate) fn residual_row_bytes(&self) -> usize {
        self.residual.len() * self.head_dim * std::mem::size_of::<f32>()
    }
    /// Bytes of one group's parameters across all heads: scale + zero per channel.
    pub(crate) fn group_bytes(&self) -> usize {
        self.scale.len() * self.head_dim * 2 * std::mem::size_of::<f16>()
    }
}

/// Consecutive quantised K rows of one KV head, all of one group (one `(scale, zero)`
/// per channel).
#[derive(Debug, Clone, Copy)]
pub(crate) struct ChannelRun<'a> {
    bits: Bits,
    hd: usize,
    packed: usize,
    /// rows per group
    group: usize,
    /// row of the first group at which the run starts
    offset: usize,
    /// (len, packed)
    codes: &'a [u8],
    /// (groups, head_dim)
    scale: &'a [f16],
    /// (groups, head_dim)
    zero: &'a [f16],
}

impl ChannelRun<'_> {
    #[inline]
    pub(crate) fn len(&self) -> usize {
        self.codes.len() / self.packed
    }

    /// The run cut at group boundaries: `(k, rows)` for its `k`-th group, `rows` the
    /// run-relative row range in it.
    fn segments(&self) -> impl Iterator<Item = (usize, std::ops::Range<usize>)> + '_ {
        let (g, off, n) = (self.group, self.offset, self.len());
        (0..(off + n).div_ceil(g)).map(move |k| {
            let a = (k * g).saturating_sub(off);
            let b = ((k + 1) * g - off).min(n);
            (k, a..b)
        })
    }

    /// Scores `out[j * stride + r] = q_j · k_r`: per group, its scales folded into the
    /// queries once (`fold`: `(queries, head_dim)` scratch), then one code dot product
    /// per row and query: `q·k = Σ_c (q_c s_c) u_c + Σ_c q_c z_c`. A row's score does not
    /// depend on how many groups the run spans.
    pub(crate) fn dot_rows(&self, qs: &[f32], fold: &mut [f32], out: &mut [f32], stride: usize) {
        let (hd, p) = (self.hd, self.packed);
        let nq = qs.len() / hd;
        let mut bias = [0.0f32; 16];
        let mut heap = Vec::new();
        let bias: &mut [f32] = if nq <= bias.len() {
            &mut bias[..nq]
        } else {
            heap.resize(nq, 0.0);
            &mut heap
        };
        let fold = &mut fold[..nq * hd];
        for (k, rows) in self.segments() {
            let (scale, zero) = (
                &self.scale[k * hd..(k + 1) * hd],
                &self.zero[k * hd..(k + 1) * hd],
            );
            for ((q, f), b) in qs
                .chunks_exact(hd)
                .zip(fold.chunks_exact_mut(hd))
                .zip(bias.iter_mut())
            {
                *b = quant::fold_channels(q, scale, zero, f);
            }
            quant::dot_codes_rows(
                &self.codes[rows.start * p..rows.end * p],
                fold,
                bias,
                self.bits,
                &mut out[rows.start..],
                stride,
            );
        }
    }

    /// Calls `f(r0, rows)` with the rows dequantised into `buf` (exactly what `read_key`
    /// returns), a block of up to `buf.len() / head_dim` rows of one group at a time
    /// (`rows`: `(m, head_dim)`, run rows `r0..r0 + m`). `params` is `2 * head_dim`
    /// scratch.
    pub(crate) fn for_each_block(
        &self,
        buf: &mut [f32],
        params: &mut [f32],
        mut f: impl FnMut(usize, &mut [f32]),
    ) {
        let (hd, p) = (self.hd, self.packed);
        let block = buf.len() / hd;
        debug_assert!(block > 0);
        let (s, z) = params[..2 * hd].split_at_mut(hd);
        for (k, rows) in self.segments() {
            self.scale[k * hd..(k + 1) * hd].convert_to_f32_slice(s);
            self.zero[k * hd..(k + 1) * hd].convert_to_f32_slice(z);
            let codes = &self.codes[rows.start * p..rows.end * p];
            for (b, codes) in codes.chunks(block * p).enumerate() {
                let m = codes.len() / p;
                let out = &mut buf[..m * hd];
                for (row, c) in out.chunks_exact_mut(hd).zip(codes.chunks_exact(p)) {
                    quant::dequantize_channels_simd(c, s, z, self.bits, row);
                }
                f(rows.start + b * block, out);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        fn check<E: Elem>(name: &str, wrap: fn(Rows<E>) -> Plain) {
            for hd in [2usize, 6, 18, 32, 34, 64, 128] {
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
                        let plain = wrap(store);
                        let run = plain.run(0, 0..rows);
                        let widened = |r: usize| -> Vec<f32> {
                            let mut o = vec![0.0; hd];
                            run.read(r, &mut o);
                            o
                        };
                        let qs: Vec<f32> = (0..nq * hd).map(|i| (i as f32 * 0.29).cos()).collect();
                        let stride = rows + 3;
                        let mut out = vec![f32::NAN; nq * stride];
                        run.dot_rows(&qs, &mut out, stride);
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
                        run.axpy_rows(&p, stride, &mut a);
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
        check::<f32>("f32", Plain::F32);
        check::<f16>("f16", Plain::F16);
        check::<bf16>("bf16", Plain::Bf16);
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
