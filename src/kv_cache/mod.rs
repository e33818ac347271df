//! The engine's KV cache = eviction policy × storage (DESIGN.md §2–§3, §6).
//!
//! * [`policy`]: which token rows survive StreamingLLM eviction (a pure function of the
//!   number of rows appended).
//! * `storage`: how rows are held: plain f32/f16/bf16 rows or KIVI int8/int4 rows.
//!
//! ## Layer layout
//! A layer's rows are split by token index `t` into two regions:
//!
//! ```text
//! prefix  t < P           slot = t                       never overwritten
//! body    t ≥ P, b = t−P  slot = b % window  (ring)      or slot = b without a window
//! ```
//!
//! `P` is `max(4, sink)` for int8/int4 (the first rows stay at full precision, DESIGN.md
//! §2; K groups start after them) and `sink` otherwise. Prefix rows are f32 under KIVI and
//! at the cache precision otherwise. Since every body row is a non-sink row, at most
//! `window` body rows are ever stored, so writing body row `b` into ring slot
//! `b % window` overwrites exactly the row that eviction drops: eviction is O(1) and
//! copies nothing. K group `g = b / G` keeps its `(scale, zero)` in group slot
//! `g % (ceil(window / G) + 1)` (or `g`), written once when the group completes.
//!
//! Under KIVI a K group is quantised at the append of its `G`-th row, over those of
//! its rows that are still stored after that append's eviction (the reference does the
//! same), so appending costs O(kv_dim) amortised and no row is ever re-quantised. V rows
//! are quantised at append.
//!
//! Every read dequantises into f32 (`read_key`, `read_value`, `gather_head`); integer
//! codes never leave `storage`. Attention does not read rows one by one: it walks
//! [`LayerKv::for_each_run`], which cuts the stored rows (oldest first) into runs of
//! consecutive slots of one region (prefix, body ring segment, one K group or the K
//! residual) and hands out storage's run views, whose fused kernels fold the KIVI scales
//! and zeros into the dot products instead of dequantising the cache.
//!
//! Positions are stored explicitly per row (`prefix_pos`, `body_pos`).

pub mod policy;
pub(crate) mod storage;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::quant::Bits;
use policy::Policy;
use storage::{ChannelQuant, ChannelRun, Plain, PlainKind, PlainRun, TokenQuant, TokenRun};
pub use tinygpt_reference::kv_cache::{KvConfig, PositionsMode, Precision};

/// Rows kept at full precision at the start of an int8/int4 cache (DESIGN.md §2).
pub const FULL_PRECISION_ROWS: usize = 4;
/// Largest accepted `--kv-group-size`.
pub const MAX_GROUP_SIZE: usize = 1 << 16;
/// Largest accepted `sink + window` (rows per layer).
pub const MAX_CACHE_ROWS: usize = 1 << 26;

/// Checks a cache configuration against a model; errors name the offending flag.
pub fn validate(kv: &KvConfig, cfg: &Config) -> Result<()> {
    if kv.group_size == 0 {
        return Err(Error::flag("--kv-group-size", "must be at least 1"));
    }
    if kv.group_size > MAX_GROUP_SIZE {
        return Err(Error::flag(
            "--kv-group-size",
            format!("{} is too large (at most {MAX_GROUP_SIZE})", kv.group_size),
        ));
    }
    match kv.window {
        None if kv.sink > 0 => {
            return Err(Error::flag(
                "--streaming-llm-sink",
                "needs --streaming-llm-window (sinks only matter when the window evicts rows)",
            ))
        }
        None => {}
        Some(0) => {
            return Err(Error::flag(
                "--streaming-llm-window",
                "must be at least 1 (the current token must stay in the cache)",
            ))
        }
        Some(w) if kv.sink.checked_add(w).is_none_or(|c| c > MAX_CACHE_ROWS) => {
            return Err(Error::flag(
                "--streaming-llm-window",
                format!(
                    "sink {} + window {w} is too large (at most {MAX_CACHE_ROWS} rows)",
                    kv.sink
                ),
            ))
        }
        Some(_) => {}
    }
    if kv.sink > MAX_CACHE_ROWS {
        return Err(Error::flag(
            "--streaming-llm-sink",
            format!("{} is too large (at most {MAX_CACHE_ROWS})", kv.sink),
        ));
    }
    if cfg.head_dim == 0 || cfg.n_kv_heads == 0 {
        return Err(Error::flag("--kv-quantize", "model has no KV heads"));
    }
    if kv.precision == Precision::Int4 && !cfg.head_dim.is_multiple_of(2) {
        return Err(Error::flag(
            "--kv-quantize",
            format!(
                "int4 packs pairs along head_dim, which is odd ({})",
                cfg.head_dim
            ),
        ));
    }
    Ok(())
}

/// KIVI code width of a precision, if it is a KIVI one.
fn kivi_bits(p: Precision) -> Option<Bits> {
    match p {
        Precision::Int8 => Some(Bits::Int8),
        Precision::Int4 => Some(Bits::Int4),
        _ => None,
    }
}

/// Length of the prefix region (see the module docs).
pub fn prefix_len(kv: &KvConfig) -> usize {
    match kivi_bits(kv.precision) {
        Some(_) => kv.sink.max(FULL_PRECISION_ROWS),
        None => kv.sink,
    }
}

#[derive(Debug, Clone)]
enum BodyK {
    Plain(Plain),
    Kivi(ChannelQuant),
}

#[derive(Debug, Clone)]
enum BodyV {
    Plain(Plain),
    Kivi(TokenQuant),
}

/// A run's keys as storage holds them.
#[derive(Debug, Clone, Copy)]
pub(crate) enum KeyRun<'a> {
    /// f32/f16/bf16 rows: prefix rows, plain body rows, or the f32 K residual.
    Plain(PlainRun<'a>),
    /// KIVI codes of one complete K group.
    Channel(ChannelRun<'a>),
}

/// A run's values as storage holds them.
#[derive(Debug, Clone, Copy)]
pub(crate) enum ValueRun<'a> {
    Plain(PlainRun<'a>),
    /// KIVI codes with one `(scale, zero)` per row.
    Token(TokenRun<'a>),
}

impl KeyRun<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            KeyRun::Plain(r) => r.len(),
            KeyRun::Channel(r) => r.len(),
        }
    }
}

impl ValueRun<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            ValueRun::Plain(r) => r.len(),
            ValueRun::Token(r) => r.len(),
        }
    }
}

/// Stored rows `first..first + len` (logical slots, oldest first) of one KV head, held
/// in consecutive storage slots of one region (and one K group).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Run<'a> {
    pub first: usize,
    pub len: usize,
    pub key: KeyRun<'a>,
    pub value: ValueRun<'a>,
}

/// Where a stored row lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Loc {
    /// Prefix row `t` (slot `t`).
    Prefix(usize),
    /// Body row `b` in ring slot `slot`.
    Body { b: usize, slot: usize },
}

/// One layer's cache: K and V of every stored token, all KV heads.
#[derive(Debug, Clone)]
pub struct LayerKv {
    kv: KvConfig,
    policy: Policy,
    kv_heads: usize,
    head_dim: usize,
    /// Prefix length `P`.
    prefix: usize,
    /// Ring capacity of the body (`window`), or `None` to grow.
    ring: Option<usize>,
    /// Group-parameter slots of the K ring, or `None` to grow.
    group_ring: Option<usize>,
    /// Rows appended so far (`T`).
    appended: usize,
    /// (prefix slots) absolute positions
    prefix_pos: Vec<usize>,
    /// (body slots) absolute positions
    body_pos: Vec<usize>,
    /// (kv_heads, prefix slots, head_dim): f32 under KIVI, else the cache precision
    prefix_k: Plain,
    /// (kv_heads, prefix slots, head_dim)
    prefix_v: Plain,
    /// (kv_heads, body slots, head_dim) plain, or KIVI codes + group params + residual
    body_k: BodyK,
    /// (kv_heads, body slots, head_dim) plain, or KIVI codes + per-token params
    body_v: BodyV,
}

impl LayerKv {
    pub fn new(kv: &KvConfig, n_kv_heads: usize, head_dim: usize) -> Self {
        let kind = match kv.precision {
            Precision::Fp16 => PlainKind::F16,
            Precision::Bf16 => PlainKind::Bf16,
            _ => PlainKind::F32,
        };
        let (body_k, body_v) = match kivi_bits(kv.precision) {
            Some(bits) => (
                BodyK::Kivi(ChannelQuant::new(
                    bits,
                    n_kv_heads,
                    head_dim,
                    kv.group_size.max(1),
                )),
                BodyV::Kivi(TokenQuant::new(bits, n_kv_heads, head_dim)),
            ),
            None => (
                BodyK::Plain(Plain::new(kind, n_kv_heads, head_dim)),
                BodyV::Plain(Plain::new(kind, n_kv_heads, head_dim)),
            ),
        };
        let g = kv.group_size.max(1);
        LayerKv {
            kv: kv.clone(),
            policy: Policy::new(kv),
            kv_heads: n_kv_heads,
            head_dim,
            prefix: prefix_len(kv),
            ring: kv.window,
            group_ring: kv.window.map(|w| w.div_ceil(g) + 1),
            appended: 0,
            prefix_pos: Vec::new(),
            body_pos: Vec::new(),
            prefix_k: Plain::new(kind, n_kv_heads, head_dim),
            prefix_v: Plain::new(kind, n_kv_heads, head_dim),
            body_k,
            body_v,
        }
    }

    pub fn config(&self) -> &KvConfig {
        &self.kv
    }
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// Rows stored.
    pub fn len(&self) -> usize {
        self.policy.stored(self.appended)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Rows appended since creation (the sequence length seen by this layer).
    pub fn appended(&self) -> usize {
        self.appended
    }

    #[inline]
    fn body_slot(&self, b: usize) -> usize {
        match self.ring {
            Some(m) => b % m,
            None => b,
        }
    }

    #[inline]
    fn group_slot(&self, g: usize) -> usize {
        match self.group_ring {
            Some(m) => g % m,
            None => g,
        }
    }

    #[inline]
    fn loc(&self, i: usize) -> Loc {
        let t = self.policy.token_at(self.appended, i);
        if t < self.prefix {
            Loc::Prefix(t)
        } else {
            let b = t - self.prefix;
            Loc::Body {
                b,
                slot: self.body_slot(b),
            }
        }
    }

    /// Number of complete K groups so far.
    fn groups_done(&self) -> usize {
        self.appended.saturating_sub(self.prefix) / self.kv.group_size.max(1)
    }

    /// Appends one token's rows (`(kv_heads, head_dim)` each; `k` already rotated in
    /// `original` positions mode) at absolute position `pos`, then evicts per the policy.
    pub fn append(&mut self, k: &[f32], v: &[f32], pos: usize) {
        let kv_dim = self.kv_heads * self.head_dim;
        debug_assert_eq!(k.len(), kv_dim);
        debug_assert_eq!(v.len(), kv_dim);
        let t = self.appended;
        self.appended += 1;
        if t < self.prefix {
            self.prefix_k.write(t, k);
            self.prefix_v.write(t, v);
            storage_set(&mut self.prefix_pos, t, pos);
            return;
        }
        let b = t - self.prefix;
        let slot = self.body_slot(b);
        storage_set(&mut self.body_pos, slot, pos);
        match &mut self.body_v {
            BodyV::Plain(p) => p.write(slot, v),
            BodyV::Kivi(q) => q.write(slot, v),
        }
        let g = self.kv.group_size.max(1);
        let group_slot = self.group_slot(b / g);
        let (ring, prefix) = (self.ring, self.prefix);
        let first_stored = self
            .policy
            .window_start(self.appended)
            .saturating_sub(prefix);
        match &mut self.body_k {
            BodyK::Plain(p) => p.write(slot, k),
            BodyK::Kivi(q) => {
                q.write_residual(b, k);
                if (b + 1).is_multiple_of(g) {
                    // The group is complete: quantise its stored rows once.
                    let rows = (b + 1 - g).max(first_stored)..b + 1;
                    let slot_of = |b: usize| match ring {
                        Some(m) => b % m,
                        None => b,
                    };
                    q.complete_group(rows, group_slot, slot_of);
                }
            }
        }
    }

    /// Absolute positions of the stored rows, oldest first.
    pub fn positions(&self) -> Vec<usize> {
        (0..self.len()).map(|i| self.position(i)).collect()
    }

    /// Absolute position of stored row `i` (0 = oldest).
    #[inline]
    pub fn position(&self, i: usize) -> usize {
        match self.loc(i) {
            Loc::Prefix(t) => self.prefix_pos[t],
            Loc::Body { slot, .. } => self.body_pos[slot],
        }
    }

    /// Dequantises KV head `h` of stored row `i`'s key into `out` (`head_dim` values;
    /// pre-RoPE in `cache` positions mode).
    pub fn read_key(&self, i: usize, h: usize, out: &mut [f32]) {
        debug_assert_eq!(out.len(), self.head_dim);
        let mut params = vec![0.0; 2 * self.head_dim];
        let (s, z) = params.split_at_mut(self.head_dim);
        let mut none = usize::MAX;
        self.read_key_at(self.loc(i), h, out, &mut none, s, z);
    }

    /// Reads the key at `loc`; `cur_group` caches which group's f32 parameters are in
    /// `scale`/`zero` (usize::MAX for none), so consecutive rows reuse them.
    #[inline]
    fn read_key_at(
        &self,
        loc: Loc,
        h: usize,
        out: &mut [f32],
        cur_group: &mut usize,
        scale: &mut [f32],
        zero: &mut [f32],
    ) {
        match loc {
            Loc::Prefix(t) => self.prefix_k.read(h, t, out),
            Loc::Body { b, slot } => match &self.body_k {
                BodyK::Plain(p) => p.read(h, slot, out),
                BodyK::Kivi(q) => {
                    let g = b / self.kv.group_size.max(1);
                    if g < self.groups_done() {
                        if *cur_group != g {
                            q.load_params(h, self.group_slot(g), scale, zero);
                            *cur_group = g;
                        }
                        q.read_quant(h, slot, scale, zero, out)
                    } else {
                        q.read_residual(h, b, out)
                    }
                }
            },
        }
    }

    #[inline]
    fn read_value_at(&self, loc: Loc, h: usize, out: &mut [f32]) {
        match loc {
            Loc::Prefix(t) => self.prefix_v.read(h, t, out),
            Loc::Body { slot, .. } => match &self.body_v {
                BodyV::Plain(p) => p.read(h, slot, out),
                BodyV::Kivi(q) => q.read(h, slot, out),
            },
        }
    }

    /// Dequantises KV head `h` of every stored row, oldest first, into `keys` and
    /// `values` (`(stored, head_dim)` each). `params` is scratch for a K group's f32
    /// parameters.
    pub fn gather_head(
        &self,
        h: usize,
        keys: &mut [f32],
        values: &mut [f32],
        params: &mut Vec<f32>,
    ) {
        let hd = self.head_dim;
        let n = self.len();
        debug_assert!(keys.len() >= n * hd && values.len() >= n * hd);
        params.resize(2 * hd, 0.0);
        let (scale, zero) = params.split_at_mut(hd);
        let mut cur_group = usize::MAX;
        let t = self.appended;
        let sinks = 0..self.policy.sinks_stored(t);
        let recent = self.policy.window_start(t)..t;
        for (i, tok) in sinks.chain(recent).enumerate() {
            let loc = if tok < self.prefix {
                Loc::Prefix(tok)
            } else {
                let b = tok - self.prefix;
                Loc::Body {
                    b,
                    slot: self.body_slot(b),
                }
            };
            let (k, v) = (
                &mut keys[i * hd..(i + 1) * hd],
                &mut values[i * hd..(i + 1) * hd],
            );
            self.read_key_at(loc, h, k, &mut cur_group, scale, zero);
            self.read_value_at(loc, h, v);
        }
    }

    /// Calls `f` on the runs that make up KV head `h`'s stored rows, in logical order
    /// (their `first` fields are `0, len_0, len_0 + len_1, ...` up to `len()`). Runs break
    /// at the sink/recent seam, the prefix/body border, the ring's wrap and the start of
    /// the K residual; under a group ring (StreamingLLM) also at every K group border,
    /// whereas a dense cache's complete groups share one run (its parameter slots are
    /// consecutive; `ChannelRun` walks the groups itself), so a 16K-row dense step costs a
    /// handful of runs instead of 512 per head.
    pub(crate) fn for_each_run<'a>(&'a self, h: usize, mut f: impl FnMut(Run<'a>)) {
        let t = self.appended;
        let p = self.prefix;
        let g = self.kv.group_size.max(1);
        let kivi = matches!(self.body_k, BodyK::Kivi(_));
        let done = self.groups_done();
        let mut first = 0;
        let sinks = (0, self.policy.sinks_stored(t));
        let recent = (self.policy.window_start(t), t);
        for (a, b) in [sinks, recent] {
            let pe = b.min(p);
            if a < pe {
                let len = pe - a;
                f(Run {
                    first,
                    len,
                    key: KeyRun::Plain(self.prefix_k.run(h, a..pe)),
                    value: ValueRun::Plain(self.prefix_v.run(h, a..pe)),
                });
                first += len;
            }
            let (mut bi, b_end) = (a.max(p).saturating_sub(p), b.saturating_sub(p));
            while bi < b_end {
                let mut end = b_end;
                if let Some(m) = self.ring {
                    end = end.min((bi / m + 1) * m);
                }
                if kivi {
                    // Complete K groups share a run while their parameter slots are
                    // consecutive (no group ring); the incomplete group is its own run.
                    end = if bi / g < done && self.group_ring.is_none() {
                        end.min(done * g)
                    } else {
                        end.min((bi / g + 1) * g)
                    };
                }
                let len = end - bi;
                let slot = self.body_slot(bi);
                let slots = slot..slot + len;
                let key = match &self.body_k {
                    BodyK::Plain(q) => KeyRun::Plain(q.run(h, slots.clone())),
                    BodyK::Kivi(q) if bi / g < done => {
                        KeyRun::Channel(q.run(h, slots.clone(), self.group_slot(bi / g), bi % g))
                    }
                    BodyK::Kivi(q) => KeyRun::Plain(q.residual_run(h, bi..end)),
                };
                let value = match &self.body_v {
                    BodyV::Plain(q) => ValueRun::Plain(q.run(h, slots)),
                    BodyV::Kivi(q) => ValueRun::Token(q.run(h, slots)),
                };
                debug_assert_eq!((key.len(), value.len()), (len, len));
                f(Run {
                    first,
                    len,
                    key,
                    value,
                });
                first += len;
                bi = end;
            }
        }
        debug_assert_eq!(first, self.len());
    }

    /// Dequantises KV head `h` of stored row `i`'s value into `out`.
    pub fn read_value(&self, i: usize, h: usize, out: &mut [f32]) {
        debug_assert_eq!(out.len(), self.head_dim);
        self.read_value_at(self.loc(i), h, out);
    }

    /// Stored row `i`'s key, all KV heads, as f32 (`kv_heads * head_dim` values).
    pub fn key(&self, i: usize) -> Vec<f32> {
        let hd = self.head_dim;
        let mut out = vec![0.0; self.kv_heads * hd];
        for (h, o) in out.chunks_exact_mut(hd).enumerate() {
            self.read_key(i, h, o);
        }
        out
    }

    /// Stored row `i`'s value, all KV heads, as f32.
    pub fn value(&self, i: usize) -> Vec<f32> {
        let hd = self.head_dim;
        let mut out = vec![0.0; self.kv_heads * hd];
        for (h, o) in out.chunks_exact_mut(hd).enumerate() {
            self.read_value(i, h, o);
        }
        out
    }

    /// Bytes the buffers hold for the stored rows: data, scales, zeros and
    /// full-precision prefix/residual rows (positions are bookkeeping and not counted).
    /// Ring slots that hold no stored row are not counted.
    pub fn bytes(&self) -> usize {
        let t = self.appended;
        let p = self.prefix;
        let prefix_rows = self.policy.stored_in(t, 0, p);
        let body_rows = self.policy.stored_in(t, p, t);
        let mut total = prefix_rows * (self.prefix_k.row_bytes() + self.prefix_v.row_bytes());
        total += body_rows
            * match &self.body_v {
                BodyV::Plain(v) => v.row_bytes(),
                BodyV::Kivi(v) => v.row_bytes(),
            };
        match &self.body_k {
            BodyK::Plain(k) => total += body_rows * k.row_bytes(),
            BodyK::Kivi(k) => {
                let g = self.kv.group_size.max(1);
                let done = self.groups_done();
                let quant_end = p + done * g;
                let residual_rows = self.policy.stored_in(t, quant_end, t);
                let quant_rows = body_rows - residual_rows;
                // Complete groups that still have a stored row.
                let first_b = self.policy.window_start(t).max(p) - p;
                let live_groups = done.saturating_sub(first_b / g);
                total += quant_rows * k.code_row_bytes()
                    + residual_rows * k.residual_row_bytes()
                    + live_groups * k.group_bytes();
            }
        }
        total
    }
}

/// `buf[i] = x`, growing `buf` if needed.
#[inline]
fn storage_set(buf: &mut Vec<usize>, i: usize, x: usize) {
    if buf.len() <= i {
        buf.resize(i + 1, 0);
    }
    buf[i] = x;
}

/// The whole cache: one [`LayerKv`] per layer that holds K/V.
#[derive(Debug, Clone)]
pub struct KvCache {
    kv: KvConfig,
    layers: Vec<LayerKv>,
}

impl KvCache {
    /// One layer cache per model layer.
    pub fn new(cfg: &Config, kv: &KvConfig) -> KvCache {
        Self::with_layers(cfg, kv, cfg.n_layers)
    }

    /// `n_layers` layer caches (e.g. fewer than the model's layers for YOCO-style
    /// models whose upper layers share one K/V).
    pub fn with_layers(cfg: &Config, kv: &KvConfig, n_layers: usize) -> KvCache {
        KvCache {
            kv: kv.clone(),
            layers: (0..n_layers)
                .map(|_| LayerKv::new(kv, cfg.n_kv_heads, cfg.head_dim))
                .collect(),
        }
    }

    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }
    pub fn layer_mut(&mut self, l: usize) -> &mut LayerKv {
        &mut self.layers[l]
    }
    pub fn layer(&self, l: usize) -> &LayerKv {
        &self.layers[l]
    }
    /// Bytes held by every layer (see [`LayerKv::bytes`]).
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(LayerKv::bytes).sum()
    }
    /// Rows held by layer 0.
    pub fn stored_tokens(&self) -> usize {
        self.layers.first().map_or(0, LayerKv::len)
    }
    pub fn config(&self) -> &KvConfig {
        &self.kv
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The runs tile the stored rows in logical order, never cross a ring wrap (nor a K
    /// group under a group ring; dense KIVI runs span many complete groups), and their rows (read through the run views) are bit-identical to
    /// `key(i)` / `value(i)`, across prefix, sinks, ring wraps, complete groups and the
    /// residual, for every precision.
    #[test]
    fn runs_tile_the_stored_rows_exactly() {
        let (kv_heads, hd) = (2usize, 6usize);
        for precision in Precision::ALL {
            for (g, sink, window) in [
                (4usize, 0usize, None),
                (3, 0, None),
                (4, 2, Some(7)),
                (5, 6, Some(5)),
                (8, 4, Some(3)),
                (2, 1, Some(1)),
            ] {
                let kv = KvConfig {
                    precision,
                    group_size: g,
                    sink,
                    window,
                    positions: PositionsMode::Cache,
                };
                let mut layer = LayerKv::new(&kv, kv_heads, hd);
                for t in 0..40usize {
                    let row = |salt: f32| -> Vec<f32> {
                        (0..kv_heads * hd)
                            .map(|c| ((t * 31 + c * 7) as f32 * 0.37 + salt).sin() * 3.0)
                            .collect()
                    };
                    layer.append(&row(0.0), &row(1.0), t);
                    let ctx = format!("{precision:?} G={g} sink={sink} window={window:?} t={t}");
                    for h in 0..kv_heads {
                        let mut next = 0;
                        let (mut got, mut want) = (vec![0.0f32; hd], vec![0.0f32; hd]);
                        let mut buf = vec![0.0f32; 3 * hd];
                        let mut params = vec![0.0f32; 2 * hd];
                        layer.for_each_run(h, |run| {
                            assert_eq!(run.first, next, "{ctx}: runs out of order");
                            assert!(run.len > 0, "{ctx}: empty run");
                            next += run.len;
                            let check_key = |r0: usize, rows: &mut [f32]| {
                                for (r, k) in rows.chunks_exact(hd).enumerate() {
                                    let i = run.first + r0 + r;
                                    layer.read_key(i, h, &mut want);
                                    assert_eq!(bits(k), bits(&want), "{ctx} h={h} key row {i}");
                                }
                            };
                            match run.key {
                                KeyRun::Plain(k) => k.for_each_block(&mut buf, check_key),
                                KeyRun::Channel(k) => {
                                    k.for_each_block(&mut buf, &mut params, check_key)
                                }
                            }
                            for r in 0..run.len {
                                let i = run.first + r;
                                match run.value {
                                    ValueRun::Plain(v) => v.read(r, &mut got),
                                    ValueRun::Token(v) => v.read(r, &mut got),
                                }
                                layer.read_value(i, h, &mut want);
                                assert_eq!(bits(&got), bits(&want), "{ctx} h={h} value row {i}");
                            }
                        });
                        assert_eq!(next, layer.len(), "{ctx}: runs do not cover the rows");
                    }
                }
            }
        }
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }
}
