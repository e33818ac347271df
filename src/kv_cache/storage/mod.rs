//! How stored rows are held: one *store* per side (K or V) and region (prefix or body).
//!
//! A store implements [`KeyStore`] (for K) or [`ValueStore`] (for V), both on top of
//! [`RowStore`]. The layer hands each store its rows by *region row* `b` (the store's
//! `b`-th appended row; the region says which rows are still stored and which slot each
//! one has, see [`Region`]), and reads them back through *run views*: a run is a range of
//! consecutive region rows held in consecutive slots of one KV head, and its view
//! ([`KeyRun`], [`ValueRun`]) is all attention sees of it: fused kernels (scores of
//! queries against the rows, probability-weighted sums of the rows) that fold any scales
//! and zeros into the arithmetic instead of dequantising. Stores are chosen once per
//! layer, in [`stores_for`], the one place that maps a [`Precision`] to its storage.
//!
//! | store | file | rows |
//! |---|---|---|
//! | [`plain::Rows<E>`] | `plain.rs` | f32 / f16 / bf16 rows, `E` widened to f32 in registers |
//! | [`kivi_k::ChannelQuant`] | `kivi_k.rs` | KIVI K: per-channel `(scale, zero)` per group of G rows, f32 residual ring |
//! | [`kivi_v::TokenQuant`] | `kivi_v.rs` | KIVI V: per-token `(scale, zero)`, optional f32 residual ring |
//!
//! Every buffer is split per KV head so one head's rows are contiguous (what a fused
//! attention kernel streams over); a *slot* is a row index inside these buffers.
//! Buffers grow lazily up to the slot written, so a bounded ring allocates at most
//! `window` slots and an unbounded cache grows amortised O(1) per row. Every write to a
//! buffer goes through the store's [`journal::Journal`], which, while a hold runs
//! (`kv_cache/hold.rs`), saves what the write overwrites so [`RowStore::rewind`] can
//! undo it.
//!
//! Code packing: `packed(n)` is `n` bytes for int8, `ceil(n / 2)` for int4, whose
//! element `2j` is the **low** nibble of byte `j` and element `2j + 1` the **high**
//! nibble, and `ceil(n / 4)` for int2, element `4j + i` in bits `2i..2i + 2` of byte `j`
//! (see [`crate::kivi`]). Codes are never handed out: every read dequantises into f32.

pub(crate) mod journal;
pub(crate) mod kivi_k;
pub(crate) mod kivi_v;
pub(crate) mod plain;

use super::policy::EvictionPolicy;
use crate::error::Result;
use crate::kivi::{Bits, KvKernel};
use crate::kv_cache::Precision;
use crate::state::{refuse, Problem, Reader, Wire, Writer};
use half::{bf16, f16};
use std::fmt::Debug;
use std::ops::Range;

pub(crate) use crate::ops::simd::Elem;

/// Shape and settings shared by every store of a layer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    pub kv_heads: usize,
    pub head_dim: usize,
    /// KIVI K group length G (≥ 1).
    pub group_size: usize,
    /// KIVI residual R.
    pub residual: usize,
    /// Slots of the region's ring, or `None` to grow.
    pub capacity: Option<usize>,
}

/// The K store and the V store of a precision. **The one place that maps a precision to
/// its storage**: a new precision is one store type (implementing [`KeyStore`] and/or
/// [`ValueStore`]) plus one arm here (and its arm in [`Precision`]).
pub(crate) fn stores_for(p: Precision, s: Shape) -> (Box<dyn KeyStore>, Box<dyn ValueStore>) {
    fn plain<E: Elem + bytemuck::Pod + Debug + Wire>(
        s: Shape,
    ) -> (Box<dyn KeyStore>, Box<dyn ValueStore>) {
        (
            Box::new(plain::Rows::<E>::new(s.kv_heads, s.head_dim)),
            Box::new(plain::Rows::<E>::new(s.kv_heads, s.head_dim)),
        )
    }
    fn kivi(bits: Bits, s: Shape) -> (Box<dyn KeyStore>, Box<dyn ValueStore>) {
        (
            Box::new(kivi_k::ChannelQuant::new(bits, s)),
            Box::new(kivi_v::TokenQuant::new(bits, s)),
        )
    }
    match p {
        Precision::Fp32 => plain::<f32>(s),
        Precision::Fp16 => plain::<f16>(s),
        Precision::Bf16 => plain::<bf16>(s),
        Precision::Int8 => kivi(Bits::Int8, s),
        Precision::Int4 => kivi(Bits::Int4, s),
        Precision::Int2 => kivi(Bits::Int2, s),
    }
}

/// One region of a layer (prefix or body) as a store sees it: region row `b` is token
/// `start + b`; which rows are stored and in which slot is the eviction policy's answer.
#[derive(Clone, Copy)]
pub(crate) struct Region<'a> {
    pub(crate) policy: &'a dyn EvictionPolicy,
    /// Token index of region row 0.
    pub(crate) start: usize,
    /// One past the region's last token index (`usize::MAX`: unbounded).
    pub(crate) end: usize,
}

impl Region<'_> {
    /// Region rows appended so far.
    #[inline]
    pub(crate) fn appended(&self) -> usize {
        self.policy
            .appended()
            .min(self.end)
            .saturating_sub(self.start)
    }
    /// Slot of stored region row `b`.
    #[inline]
    pub(crate) fn slot(&self, b: usize) -> usize {
        self.policy.slot(self.start + b)
    }
    /// Whether region row `b` is stored.
    #[inline]
    pub(crate) fn is_stored(&self, b: usize) -> bool {
        self.policy.is_stored(self.start + b)
    }
    /// How many of region rows `[lo, hi)` are stored.
    #[inline]
    pub(crate) fn stored_in(&self, lo: usize, hi: usize) -> usize {
        let cap = |x: usize| self.start.saturating_add(x).min(self.end);
        self.policy.stored_in(cap(lo), cap(hi))
    }
    /// Region rows stored.
    #[inline]
    pub(crate) fn stored(&self) -> usize {
        self.stored_in(0, self.appended())
    }
    /// The oldest stored region row (`appended()` if none).
    #[inline]
    pub(crate) fn first_stored(&self) -> usize {
        self.policy
            .first_stored_from(self.start)
            .saturating_sub(self.start)
            .min(self.appended())
    }
}

/// What every store does: hold rows, read them back as f32, say where runs must break,
/// count bytes.
pub(crate) trait RowStore: Debug + Send + Sync {
    /// Takes region row `b` (`(kv_heads, head_dim)` values), stored in `slot`, or not
    /// stored at all (`None`: a policy may refuse a row), after the policy has evicted
    /// for this append; quantises whatever this append makes due.
    fn append(&mut self, b: usize, slot: Option<usize>, row: &[f32], at: &Region<'_>);
    /// Stored region row `b` of KV head `h` as f32 (`head_dim` values).
    fn read(&self, h: usize, b: usize, at: &Region<'_>, out: &mut [f32]);
    /// The end (≤ `end`) of the longest run from region row `b` that this store can hand
    /// out as one view (rows `b..end` are stored in consecutive slots).
    fn run_end(&self, b: usize, end: usize, at: &Region<'_>) -> usize;
    /// Bytes held for the region's stored rows (data, scales, zeros, f32 residual rows).
    fn bytes(&self, at: &Region<'_>) -> usize;
    /// Bytes the store's buffers take, whatever they hold: [`RowStore::bytes`] plus ring
    /// slots and group parameters that hold no stored row (not the hold's journal).
    fn buffer_bytes(&self) -> usize;
    /// Calls `f` with the size of each heap block a copy of the store allocates, beside
    /// the store itself (its buffers, their per-head lists, the hold's journal); sizes
    /// of 0 stand for no block. The oracle is a counting allocator (`tests/kv_cache.rs`).
    fn copy_blocks(&self, f: &mut dyn FnMut(usize));
    /// Hold bookkeeping (docs/design.md §3.2): from now on, journal what each append
    /// overwrites ([`journal::Journal`]; a running hold is committed first).
    fn hold(&mut self);
    /// Undoes the appends after the first `keep` this store saw since [`RowStore::hold`],
    /// newest first, and holds on: every buffer is then byte for byte as it was after the
    /// kept appends, and the journal records those only. Not holding, does nothing.
    fn rewind(&mut self, keep: usize);
    /// Ends the hold keeping every append (empties the journal); a release of the first
    /// `keep` appends is a [`RowStore::rewind`]`(keep)`, then this.
    fn stop_holding(&mut self);
    /// Bytes the running hold's journal keeps (0 without a hold).
    fn hold_bytes(&self) -> usize;
    /// Writes the store's buffers, exactly as held (a saved state, docs/design.md §5).
    fn save(&self, w: &mut Writer);
    /// Reads what [`RowStore::save`] wrote into a store fresh from [`stores_for`] for the
    /// same configuration, whose region `at` has had its appends replayed in the policy.
    /// `stored`: the region rows `at` stores, in runs of consecutive slots. Every buffer's
    /// length is checked against what the configuration allows and what reading the
    /// stored rows (and every later append) needs, so nothing indexes out of bounds later;
    /// floats must be finite. `what` names the store in errors.
    fn load(
        &mut self,
        r: &mut Reader<'_>,
        at: &Region<'_>,
        stored: &[Range<usize>],
        what: &str,
    ) -> Result<()>;
}

/// One past the highest slot of the rows in `rows` (runs of region rows in consecutive
/// slots); 0 when there are none.
pub(crate) fn slots_needed(at: &Region<'_>, rows: &[Range<usize>]) -> usize {
    rows.iter()
        .filter(|r| !r.is_empty())
        .map(|r| at.slot(r.start) + r.len())
        .max()
        .unwrap_or(0)
}

/// One past the highest `b % cap` over the rows `b` in `rows` (`cap > 0`).
pub(crate) fn ring_needed(rows: &[Range<usize>], cap: usize) -> usize {
    rows.iter()
        .filter(|r| !r.is_empty())
        .map(|r| {
            let (s, e) = (r.start % cap, (r.end - 1) % cap);
            if r.len() >= cap || s > e {
                cap
            } else {
                e + 1
            }
        })
        .max()
        .unwrap_or(0)
}

/// `rows` cut to `lo..hi` (empty runs dropped).
pub(crate) fn clip(rows: &[Range<usize>], lo: usize, hi: usize) -> Vec<Range<usize>> {
    rows.iter()
        .map(|r| r.start.max(lo)..r.end.min(hi))
        .filter(|r| !r.is_empty())
        .collect()
}

/// Reads one buffer per KV head (as [`RowStore::save`] wrote them): each the same length,
/// a whole number of `unit`-element rows, at least `need` and at most `max` rows.
pub(crate) fn load_heads<T: Wire>(
    r: &mut Reader<'_>,
    heads: usize,
    unit: usize,
    need: usize,
    max: usize,
    what: &dyn Fn() -> String,
) -> Result<Vec<Vec<T>>> {
    if need > max {
        return Err(refuse(
            Problem::Inconsistent,
            format!(
                "{}: the stored rows need {need} slots, more than the {max} this store can hold",
                what()
            ),
        ));
    }
    let mut out: Vec<Vec<T>> = Vec::with_capacity(heads);
    for h in 0..heads {
        let v = r.vec::<T>(max.saturating_mul(unit), &|| {
            format!("{} (KV head {h})", what())
        })?;
        let rows = v.len() / unit.max(1);
        let bad = if !v.len().is_multiple_of(unit.max(1)) {
            Some(format!("{} values, not whole rows of {unit}", v.len()))
        } else if rows < need {
            Some(format!("{rows} rows, but the stored rows need {need}"))
        } else if out.first().is_some_and(|f| f.len() != v.len()) {
            Some(format!("{rows} rows, unlike KV head 0"))
        } else {
            None
        };
        if let Some(msg) = bad {
            return Err(refuse(
                Problem::Inconsistent,
                format!("{} (KV head {h}) holds {msg}", what()),
            ));
        }
        out.push(v);
    }
    Ok(out)
}

/// A K store: runs are scored against queries.
pub(crate) trait KeyStore: RowStore {
    fn clone_box(&self) -> Box<dyn KeyStore>;
    /// Calls `f` with a view of region rows `rows` of KV head `h` (a range accepted by
    /// [`RowStore::run_end`]).
    fn with_run(
        &self,
        h: usize,
        rows: Range<usize>,
        at: &Region<'_>,
        f: &mut dyn FnMut(&dyn KeyRun),
    );
}

/// A V store: runs are summed with probability weights.
pub(crate) trait ValueStore: RowStore {
    fn clone_box(&self) -> Box<dyn ValueStore>;
    /// As [`KeyStore::with_run`].
    fn with_run(
        &self,
        h: usize,
        rows: Range<usize>,
        at: &Region<'_>,
        f: &mut dyn FnMut(&dyn ValueRun),
    );
}

impl Clone for Box<dyn KeyStore> {
    fn clone(&self) -> Self {
        self.clone_box()
    }
}

impl Clone for Box<dyn ValueStore> {
    fn clone(&self) -> Self {
        self.clone_box()
    }
}

/// Consecutive stored K rows of one KV head, as one store holds them.
pub(crate) trait KeyRun {
    /// Rows in the run.
    fn len(&self) -> usize;
    /// Scores `out[j * stride + r] = q_j · k_r` of the `qs.len() / head_dim` queries `qs`
    /// against every row. A row's score must not depend on how the rows were cut into
    /// runs (blocks of eight pad with zeros, see `ops::simd::reduce8`). `fold` is
    /// `(queries, head_dim)` scratch. `kernel`: the KIVI kernel variant a store of codes
    /// runs (plain stores ignore it), chosen per session (`crate::exec::ExecOptions`).
    fn dot_rows(
        &self,
        kernel: KvKernel,
        qs: &[f32],
        fold: &mut [f32],
        out: &mut [f32],
        stride: usize,
    );
    /// Calls `f(r0, rows)` with the rows as f32 (exactly what `LayerKv::read_key`
    /// returns) in `buf`, a block of up to `buf.len() / head_dim` rows at a time (`rows`:
    /// `(m, head_dim)`, run rows `r0..r0 + m`). `params` is `2 * head_dim` scratch.
    fn for_each_block(
        &self,
        buf: &mut [f32],
        params: &mut [f32],
        f: &mut dyn FnMut(usize, &mut [f32]),
    );
}

/// Consecutive stored V rows of one KV head, as one store holds them.
pub(crate) trait ValueRun {
    /// Rows in the run.
    fn len(&self) -> usize;
    /// `acc_j += Σ_r p[j * stride + r] · v_r` for every query `j` (`acc`: `(queries,
    /// head_dim)`), in an order fixed by the store and its kernel variant (row by row, or
    /// interleaved row sets added at the end of the run); rows of weight 0 may be skipped. A store may
    /// defer a per-query constant into `bias[j]`, which the caller adds to every element
    /// of `acc_j` once all runs are summed. `kernel` as in [`KeyRun::dot_rows`].
    fn axpy_rows(
        &self,
        kernel: KvKernel,
        p: &[f32],
        stride: usize,
        acc: &mut [f32],
        bias: &mut [f32],
    );
    /// Row `r` as f32 (tests of the run enumeration).
    #[cfg(test)]
    fn read(&self, r: usize, out: &mut [f32]);
}

/// Makes `buf` hold at least `len` elements (growing with `Default` values).
#[inline]
pub(crate) fn ensure<T: Copy + Default>(buf: &mut Vec<T>, len: usize) {
    if buf.len() < len {
        buf.resize(len, T::default());
    }
}

/// Bytes of the elements of per-head buffers (their lengths, not their capacities).
/// The blocks a copy of per-head buffers allocates: the list, then each buffer.
pub(crate) fn heads_blocks<E>(bufs: &[Vec<E>], f: &mut dyn FnMut(usize)) {
    f(std::mem::size_of_val(bufs));
    bufs.iter()
        .for_each(|b| f(std::mem::size_of_val(b.as_slice())));
}

pub(crate) fn heads_bytes<E>(bufs: &[Vec<E>]) -> usize {
    bufs.iter()
        .map(|b| std::mem::size_of_val(b.as_slice()))
        .sum()
}
