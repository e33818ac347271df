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
//! codes never leave `storage`.
//!
//! Positions are stored explicitly per row (`prefix_pos`, `body_pos`).

pub mod policy;
pub(crate) mod storage;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::quant::Bits;
use policy::Policy;
use storage::{ChannelQuant, Plain, PlainKind, TokenQuant};
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
