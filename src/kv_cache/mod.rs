//! The engine's KV cache = eviction policy × storage (docs/design.md §2–§3, §6).
//!
//! * [`policy`]: which token rows survive and in which slot each one lives
//!   ([`EvictionPolicy`]; the project's policy is [`StreamingLlm`] sink + window).
//! * `storage`: how rows are held, one store per side and region behind
//!   [`storage::KeyStore`] / [`storage::ValueStore`]: plain f32/f16/bf16 rows or KIVI
//!   int8/int4/int2 rows, K and V each at their own precision
//!   ([`KvConfig::key_precision`], [`KvConfig::value_precision`]).
//!
//! ## Layer layout
//! A layer's rows are split by token index `t` into two regions:
//!
//! ```text
//! prefix  t < P           slot = t                       never overwritten
//! body    t ≥ P, b = t−P  slot = b % window  (ring)      or slot = b without a window
//! ```
//!
//! `P` is `max(4, sink)` when K or V is KIVI (the first rows stay at full precision,
//! docs/design.md §2; K groups start after them) and `sink` otherwise. Prefix rows are f32 under
//! KIVI and at each side's precision otherwise. Since every body row is a non-sink row, at most
//! `window` body rows are ever stored, so writing body row `b` into ring slot
//! `b % window` overwrites exactly the row that eviction drops: eviction is O(1) and
//! copies nothing. The policy gives the slots ([`EvictionPolicy::append`],
//! [`EvictionPolicy::slot`]); a store sees its region's rows through `storage::Region`
//! and keeps its own bookkeeping (KIVI K groups and residual, the KIVI V residual: see
//! `storage/kivi_k.rs` and `storage/kivi_v.rs`).
//!
//! Every read dequantises into f32 (`read_key`, `read_value`, `gather_head`); integer
//! codes never leave `storage`. Attention does not read rows one by one: it walks
//! [`LayerKv::for_each_key_run`] and [`LayerKv::for_each_value_run`], which cut the
//! stored rows (oldest first) into runs of consecutive slots of one store (where the
//! policy's runs break, and where the store's do) and hand out the store's run views,
//! whose fused kernels fold the KIVI scales and zeros into the dot products instead of
//! dequantising the cache.
//!
//! Positions are stored explicitly per row (`prefix_pos`, `body_pos`).
//!
//! `state.rs` writes a cache's contents and reads them back bit for bit (saved states,
//! [`crate::state`]).

mod hold;
pub mod policy;
mod state;
pub(crate) mod storage;

use crate::config::Config;
use crate::error::{Error, Result};
pub use policy::{EvictionPolicy, StreamingLlm};
use storage::{stores_for, KeyRun, KeyStore, Region, Shape, ValueRun, ValueStore};
pub use tinygpt_types::kv::{KeyRope, KvConfig, KvRotation, PositionsMode, Precision};

/// Rows kept at full precision at the start of a KIVI cache (docs/design.md §2).
pub use tinygpt_types::kv::FULL_PRECISION_ROWS;
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
    if kv.residual > MAX_CACHE_ROWS {
        return Err(Error::flag(
            "--kv-residual",
            format!("{} is too large (at most {MAX_CACHE_ROWS})", kv.residual),
        ));
    }
    if cfg.head_dim == 0 || cfg.n_kv_heads == 0 {
        return Err(Error::flag("--kv-quantize", "model has no KV heads"));
    }
    if kv.rotation == KvRotation::Hadamard && !crate::kivi::hadamard::supported(cfg.head_dim) {
        return Err(Error::flag(
            "--kv-rotation",
            format!(
                "hadamard needs a power-of-two head_dim; this model's is {}",
                cfg.head_dim
            ),
        ));
    }
    for (p, over, flag) in [
        (kv.key_precision(), kv.k_precision, "--kv-quantize-k"),
        (kv.value_precision(), kv.v_precision, "--kv-quantize-v"),
    ] {
        let flag = if over.is_some() {
            flag
        } else {
            "--kv-quantize"
        };
        if let Some(bits) = p.kivi_bits() {
            // Codes are packed along head_dim, 8 / width codes per byte.
            let per_byte = (8 / bits.width()) as usize;
            if !cfg.head_dim.is_multiple_of(per_byte) {
                return Err(Error::flag(
                    flag,
                    format!(
                        "{} packs {per_byte} codes per byte along head_dim, which is not a multiple of {per_byte} ({})",
                        p.name(),
                        cfg.head_dim
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Length of the prefix region (see the module docs).
pub fn prefix_len(kv: &KvConfig) -> usize {
    if kv.is_kivi() {
        kv.sink.max(FULL_PRECISION_ROWS)
    } else {
        kv.sink
    }
}

/// One layer's cache: K and V of every stored token, all KV heads. `P` decides which
/// rows are kept and where ([`EvictionPolicy`]); the stores hold them ([`storage`]).
#[derive(Debug, Clone)]
pub struct LayerKv<P = StreamingLlm> {
    kv: KvConfig,
    policy: P,
    kv_heads: usize,
    head_dim: usize,
    /// Prefix length `P` (the policy's `body_start`).
    prefix: usize,
    /// (prefix slots) absolute positions
    prefix_pos: Vec<usize>,
    /// (body slots) absolute positions
    body_pos: Vec<usize>,
    /// (kv_heads, prefix slots, head_dim): f32 under KIVI, else each side's precision
    prefix_k: Box<dyn KeyStore>,
    prefix_v: Box<dyn ValueStore>,
    /// the body rows at each side's precision
    body_k: Box<dyn KeyStore>,
    body_v: Box<dyn ValueStore>,
    /// When set ([`LayerKv::probe_appends`]), the K and V rows of the last append as they
    /// arrived: a debugging aid for the reference-vs-engine probe, off by default.
    probe: Option<Box<(Vec<f32>, Vec<f32>)>>,
    /// While holding rows ([`LayerKv::hold`]): what undoes them.
    held: Option<Box<hold::Held<P>>>,
}

/// A run of stored rows handed to attention: logical slots `first..first + rows.len()`
/// of one KV head, held in consecutive slots of one store.
pub(crate) struct RunAt<'r, R: ?Sized> {
    pub first: usize,
    /// Row id of the first row: prefix row `t` is `t`, body slot `s` is `P + s`; the
    /// run's rows have ids `id..id + len` (for per-row tables such as RoPE angles).
    pub id: usize,
    pub rows: &'r R,
}

fn region(policy: &dyn EvictionPolicy, start: usize, end: usize) -> Region<'_> {
    Region { policy, start, end }
}

impl LayerKv<StreamingLlm> {
    /// A layer under the StreamingLLM policy of `kv` (`sink`, `window`).
    pub fn new(kv: &KvConfig, n_kv_heads: usize, head_dim: usize) -> Self {
        let policy = StreamingLlm::new(kv.sink, kv.window, prefix_len(kv));
        Self::with_policy(kv, n_kv_heads, head_dim, policy)
    }
}

impl<P: EvictionPolicy + Clone> LayerKv<P> {
    /// A layer under any eviction policy; `policy.body_start()` must be
    /// [`prefix_len`]`(kv)`.
    pub fn with_policy(kv: &KvConfig, n_kv_heads: usize, head_dim: usize, policy: P) -> Self {
        let prefix = prefix_len(kv);
        assert_eq!(policy.body_start(), prefix, "policy's body_start");
        let body = Shape {
            kv_heads: n_kv_heads,
            head_dim,
            group_size: kv.group_size.max(1),
            residual: kv.residual,
            capacity: policy.body_slots(),
        };
        let (kp, vp) = (kv.key_precision(), kv.value_precision());
        // Prefix rows are f32 under KIVI (either side), else at each side's precision.
        let (pk, pv) = if kv.is_kivi() {
            (Precision::Fp32, Precision::Fp32)
        } else {
            (kp, vp)
        };
        let pre = Shape {
            capacity: None,
            ..body
        };
        LayerKv {
            kv: kv.clone(),
            policy,
            kv_heads: n_kv_heads,
            head_dim,
            prefix,
            prefix_pos: Vec::new(),
            body_pos: Vec::new(),
            prefix_k: stores_for(pk, pre).0,
            prefix_v: stores_for(pv, pre).1,
            body_k: stores_for(kp, body).0,
            body_v: stores_for(vp, body).1,
            probe: None,
            held: None,
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
    /// The eviction policy.
    pub fn policy(&self) -> &P {
        &self.policy
    }

    /// Rows stored.
    pub fn len(&self) -> usize {
        self.policy.stored()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Rows appended since creation (the sequence length seen by this layer).
    pub fn appended(&self) -> usize {
        self.policy.appended()
    }

    /// Where stored row `i` lives: `(in the prefix, region row)`.
    #[inline]
    fn loc(&self, i: usize) -> (bool, usize) {
        let t = self.policy.token_at(i);
        if t < self.prefix {
            (true, t)
        } else {
            (false, t - self.prefix)
        }
    }

    #[inline]
    fn prefix_region(&self) -> Region<'_> {
        region(&self.policy, 0, self.prefix)
    }

    #[inline]
    fn body_region(&self) -> Region<'_> {
        region(&self.policy, self.prefix, usize::MAX)
    }

    /// Appends one token's rows (`(kv_heads, head_dim)` each; `k` already rotated in
    /// `original` positions mode with post-RoPE keys) at absolute position `pos`: the
    /// policy evicts and picks the row's slot, then the stores take the row (and
    /// quantise what leaves the newest R rows).
    pub fn append(&mut self, k: &[f32], v: &[f32], pos: usize) {
        let kv_dim = self.kv_heads * self.head_dim;
        debug_assert_eq!(k.len(), kv_dim);
        debug_assert_eq!(v.len(), kv_dim);
        if let Some(p) = self.probe.as_deref_mut() {
            p.0.clear();
            p.0.extend_from_slice(k);
            p.1.clear();
            p.1.extend_from_slice(v);
        }
        if let Some(h) = self.held.as_deref_mut() {
            h.record(&self.policy);
        }
        let t = self.policy.appended();
        let slot = self.policy.append();
        let p = self.prefix;
        let (b, at, pos_buf, ks, vs) = if t < p {
            let at = region(&self.policy, 0, p);
            (
                t,
                at,
                &mut self.prefix_pos,
                &mut self.prefix_k,
                &mut self.prefix_v,
            )
        } else {
            let at = region(&self.policy, p, usize::MAX);
            (
                t - p,
                at,
                &mut self.body_pos,
                &mut self.body_k,
                &mut self.body_v,
            )
        };
        if let Some(s) = slot {
            hold::set_position(self.held.as_deref_mut(), t >= p, pos_buf, s, pos);
        }
        vs.append(b, slot, v, &at);
        ks.append(b, slot, k, &at);
    }

    /// From now on, keeps a copy of each appended K and V row as it arrived (before any
    /// cast or quantisation), returned by [`LayerKv::last_appended`]. A debugging aid
    /// for the differential probe; it changes no stored value.
    #[doc(hidden)]
    pub fn probe_appends(&mut self) {
        self.probe.get_or_insert_with(Default::default);
    }

    /// The K and V rows of the last append, when [`LayerKv::probe_appends`] is on.
    #[doc(hidden)]
    pub fn last_appended(&self) -> Option<(&[f32], &[f32])> {
        self.probe.as_deref().map(|p| (&p.0[..], &p.1[..]))
    }

    /// Row id of stored row `i` (prefix row `t`: `t`; body slot `s`: `P + s`; see
    /// [`RunAt::id`]).
    #[inline]
    pub(crate) fn row_id(&self, i: usize) -> usize {
        match self.loc(i) {
            (true, t) => t,
            (false, b) => self.prefix + self.policy.slot(self.prefix + b),
        }
    }

    /// One past the largest row id a stored row can have now.
    pub(crate) fn row_id_bound(&self) -> usize {
        self.prefix
            + match self.policy.body_slots() {
                Some(m) => m,
                None => self.appended().saturating_sub(self.prefix),
            }
    }

    /// Absolute positions of the stored rows, oldest first.
    pub fn positions(&self) -> Vec<usize> {
        (0..self.len()).map(|i| self.position(i)).collect()
    }

    /// Absolute position of stored row `i` (0 = oldest).
    #[inline]
    pub fn position(&self, i: usize) -> usize {
        let t = self.policy.token_at(i);
        let slot = self.policy.slot(t);
        if t < self.prefix {
            self.prefix_pos[slot]
        } else {
            self.body_pos[slot]
        }
    }

    /// Dequantises KV head `h` of stored row `i`'s key into `out` (`head_dim` values;
    /// pre-RoPE in `cache` positions mode).
    pub fn read_key(&self, i: usize, h: usize, out: &mut [f32]) {
        debug_assert_eq!(out.len(), self.head_dim);
        match self.loc(i) {
            (true, t) => self.prefix_k.read(h, t, &self.prefix_region(), out),
            (false, b) => self.body_k.read(h, b, &self.body_region(), out),
        }
    }

    /// Dequantises KV head `h` of stored row `i`'s value into `out`.
    pub fn read_value(&self, i: usize, h: usize, out: &mut [f32]) {
        debug_assert_eq!(out.len(), self.head_dim);
        match self.loc(i) {
            (true, t) => self.prefix_v.read(h, t, &self.prefix_region(), out),
            (false, b) => self.body_v.read(h, b, &self.body_region(), out),
        }
    }

    /// Dequantises KV head `h` of every stored row, oldest first, into `keys` and
    /// `values` (`(stored, head_dim)` each).
    pub fn gather_head(&self, h: usize, keys: &mut [f32], values: &mut [f32]) {
        let hd = self.head_dim;
        let n = self.len();
        debug_assert!(keys.len() >= n * hd && values.len() >= n * hd);
        for i in 0..n {
            self.read_key(i, h, &mut keys[i * hd..(i + 1) * hd]);
            self.read_value(i, h, &mut values[i * hd..(i + 1) * hd]);
        }
    }

    /// Calls `f(first, in_prefix, region rows)` for the policy's runs: stored rows
    /// `first..first + rows.len()` (logical order) are consecutive rows of one region in
    /// consecutive slots.
    fn for_each_span(&self, mut f: impl FnMut(usize, bool, std::ops::Range<usize>)) {
        let (n, p) = (self.len(), self.prefix);
        let mut i = 0;
        while i < n {
            let e = self.policy.run_end(i, n);
            let t = self.policy.token_at(i);
            let (in_prefix, b) = if t < p { (true, t) } else { (false, t - p) };
            f(i, in_prefix, b..b + (e - i));
            i = e;
        }
        debug_assert_eq!(i, n);
    }

    /// Calls `f` on the key runs that make up KV head `h`'s stored rows, in logical order
    /// (their `first` fields are `0, len_0, len_0 + len_1, ...` up to `len()`). Runs break
    /// where the policy's do (sink/recent seam, prefix/body border, ring wrap) and where
    /// the store's do (e.g. KIVI K: group borders under a ring, the residual and its
    /// ring's wrap).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn for_each_key_run(
        &self,
        h: usize,
        f: impl for<'r> FnMut(RunAt<'r, dyn KeyRun + 'r>),
    ) {
        self.for_each_key_run_in(h, 0..self.len(), f)
    }

    /// As [`LayerKv::for_each_key_run`], for the stored rows `within` only (logical
    /// indices; `first` stays logical). Each run is the store's run from its first row
    /// ([`storage::RowStore::run_end`] asked from there, up to `within.end`), so every view is one
    /// the store hands out. Lets a decode team score one KV head's rows in several ranges
    /// (a row's score does not depend on the cut, [`KeyRun::dot_rows`]).
    pub(crate) fn for_each_key_run_in(
        &self,
        h: usize,
        within: std::ops::Range<usize>,
        mut f: impl for<'r> FnMut(RunAt<'r, dyn KeyRun + 'r>),
    ) {
        self.for_each_span(|span, in_prefix, rows| {
            let (lo, hi) = (within.start.max(span), within.end.min(span + rows.len()));
            if lo >= hi {
                return;
            }
            let (mut first, rows) = (lo, rows.start + (lo - span)..rows.start + (hi - span));
            let (store, at, base) = if in_prefix {
                (&self.prefix_k, self.prefix_region(), 0)
            } else {
                (&self.body_k, self.body_region(), self.prefix)
            };
            let mut b = rows.start;
            while b < rows.end {
                let e = store.run_end(b, rows.end, &at);
                let id = base + at.slot(b);
                store.with_run(h, b..e, &at, &mut |r| f(RunAt { first, id, rows: r }));
                first += e - b;
                b = e;
            }
        })
    }

    /// As [`LayerKv::for_each_key_run`], for the value runs (cut by V's store).
    pub(crate) fn for_each_value_run(
        &self,
        h: usize,
        mut f: impl for<'r> FnMut(RunAt<'r, dyn ValueRun + 'r>),
    ) {
        self.for_each_span(|mut first, in_prefix, rows| {
            let (store, at, base) = if in_prefix {
                (&self.prefix_v, self.prefix_region(), 0)
            } else {
                (&self.body_v, self.body_region(), self.prefix)
            };
            let mut b = rows.start;
            while b < rows.end {
                let e = store.run_end(b, rows.end, &at);
                let id = base + at.slot(b);
                store.with_run(h, b..e, &at, &mut |r| f(RunAt { first, id, rows: r }));
                first += e - b;
                b = e;
            }
        })
    }

    /// Passes attention's per-row probability mass to the policy, if it wants it.
    pub(crate) fn observe(&mut self, mass: &[f32]) {
        self.policy.observe(mass)
    }

    /// Whether the policy wants [`LayerKv::observe`].
    pub(crate) fn observes(&self) -> bool {
        self.policy.observes()
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
        let (pre, body) = (self.prefix_region(), self.body_region());
        self.prefix_k.bytes(&pre)
            + self.prefix_v.bytes(&pre)
            + self.body_k.bytes(&body)
            + self.body_v.bytes(&body)
    }

    /// Bytes the layer's buffers take, whatever they hold: [`LayerKv::bytes`] plus ring
    /// slots and KIVI group parameters holding no stored row, and the rows' positions
    /// (not the hold's journal: [`LayerKv::hold_bytes`]). What a kept copy costs in memory.
    pub fn buffer_bytes(&self) -> usize {
        self.prefix_k.buffer_bytes()
            + self.prefix_v.buffer_bytes()
            + self.body_k.buffer_bytes()
            + self.body_v.buffer_bytes()
            + std::mem::size_of_val(self.prefix_pos.as_slice())
            + std::mem::size_of_val(self.body_pos.as_slice())
    }
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
    /// Every layer, to be changed one by one (a relay step appends to one layer while
    /// late members still read another).
    pub fn layers_mut(&mut self) -> &mut [LayerKv] {
        &mut self.layers
    }
    /// Bytes held by every layer (see [`LayerKv::bytes`]).
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(LayerKv::bytes).sum()
    }
    /// Bytes every layer's buffers take (see [`LayerKv::buffer_bytes`]).
    pub fn buffer_bytes(&self) -> usize {
        self.layers.iter().map(LayerKv::buffer_bytes).sum()
    }
    /// Calls `f` with the size of each heap block a copy of the cache allocates (0
    /// stands for no block): the layer list, then every layer's blocks
    /// ([`LayerKv::copy_blocks`]). Beside [`KvCache::buffer_bytes`] and
    /// [`KvCache::hold_bytes`], these are the bookkeeping (per-head lists, the stores
    /// themselves, journals' entries) and each block's own allocator overhead, which a
    /// bound on kept copies must count too (`memory::heap_footprint`).
    pub fn copy_blocks(&self, f: &mut dyn FnMut(usize)) {
        f(std::mem::size_of_val(self.layers.as_slice()));
        self.layers.iter().for_each(|l| l.copy_blocks(f));
    }
    /// Rows held by layer 0.
    pub fn stored_tokens(&self) -> usize {
        self.layers.first().map_or(0, LayerKv::len)
    }
    pub fn config(&self) -> &KvConfig {
        &self.kv
    }

    /// Starts holding rows in every layer ([`LayerKv::hold`], docs/design.md §3.2).
    pub fn hold(&mut self) {
        self.layers.iter_mut().for_each(LayerKv::hold);
    }
    /// Rows held since [`KvCache::hold`] (every layer holds the same count), or `None`.
    pub fn held(&self) -> Option<usize> {
        self.layers.first().and_then(LayerKv::held)
    }
    /// Ends the hold in every layer keeping the first `keep` held rows
    /// ([`LayerKv::release`]).
    pub fn release(&mut self, keep: usize) {
        self.layers.iter_mut().for_each(|l| l.release(keep));
    }
    /// Drops the held rows after the first `keep` in every layer and holds on
    /// ([`LayerKv::rewind`]): speculative decoding inside a running hold.
    pub fn rewind(&mut self, keep: usize) {
        self.layers.iter_mut().for_each(|l| l.rewind(keep));
    }
    /// Bytes the running hold keeps beside the stored rows ([`LayerKv::hold_bytes`]).
    pub fn hold_bytes(&self) -> usize {
        self.layers.iter().map(LayerKv::hold_bytes).sum()
    }
    /// The cache with every buffer the size of what it holds, as a copy would have them
    /// ([`KvCache::copy_blocks`]), but copied layer by layer, each running layer freed
    /// once copied: at most one layer is in memory twice (a finished sequence's cache
    /// becoming a prompt-cache entry; its buffers grew by doubling).
    pub fn into_compact(self) -> KvCache {
        let KvCache { kv, layers } = self;
        let mut out = Vec::with_capacity(layers.len());
        for layer in layers {
            out.push(layer.clone());
        }
        KvCache { kv, layers: out }
    }
    /// The cache as [`release`](Self::release)`(keep)` would leave it, this one unchanged
    /// ([`LayerKv::released_copy`]).
    pub fn released_copy(&mut self, keep: usize) -> KvCache {
        KvCache {
            kv: self.kv.clone(),
            layers: self
                .layers
                .iter_mut()
                .map(|l| l.released_copy(keep))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The key runs and the value runs each tile the stored rows in logical order, never
    /// cross a ring wrap (nor a K group under a group ring; dense KIVI runs span many
    /// complete groups), and their rows (read through the run views) are bit-identical to
    /// `key(i)` / `value(i)`, across prefix, sinks, ring wraps, complete groups and the
    /// residual, for every precision.
    #[test]
    fn runs_tile_the_stored_rows_exactly() {
        let (kv_heads, hd) = (2usize, 8usize);
        let sides = Precision::ALL.iter().map(|&p| (p, None)).chain([
            (Precision::Int8, Some(Precision::Int4)),
            (Precision::Fp16, Some(Precision::Int2)),
            (Precision::Int2, Some(Precision::Bf16)),
        ]);
        for (precision, v_precision) in sides {
            for (g, sink, window, residual) in [
                (4usize, 0usize, None, 0usize),
                (3, 0, None, 0),
                (3, 0, None, 5),
                (4, 2, Some(7), 0),
                (4, 2, Some(7), 3),
                (4, 2, Some(7), 9),
                (5, 6, Some(5), 0),
                (5, 6, Some(5), 4),
                (8, 4, Some(3), 0),
                (8, 4, Some(3), 2),
                (2, 1, Some(1), 0),
                (2, 1, Some(1), 1),
            ] {
                let kv = KvConfig {
                    precision,
                    v_precision,
                    group_size: g,
                    sink,
                    window,
                    residual,
                    positions: PositionsMode::Cache,
                    ..KvConfig::default()
                };
                let mut layer = LayerKv::new(&kv, kv_heads, hd);
                for t in 0..40usize {
                    let row = |salt: f32| -> Vec<f32> {
                        (0..kv_heads * hd)
                            .map(|c| ((t * 31 + c * 7) as f32 * 0.37 + salt).sin() * 3.0)
                            .collect()
                    };
                    layer.append(&row(0.0), &row(1.0), t);
                    let ctx = format!(
                        "{precision:?}/{v_precision:?} G={g} R={residual} sink={sink} window={window:?} t={t}"
                    );
                    for h in 0..kv_heads {
                        let mut buf = vec![0.0f32; 3 * hd];
                        let mut params = vec![0.0f32; 2 * hd];
                        let mut want = vec![0.0f32; hd];
                        let mut next = 0;
                        layer.for_each_key_run(h, |run| {
                            assert_eq!(run.first, next, "{ctx}: key runs out of order");
                            assert!(run.rows.len() > 0, "{ctx}: empty key run");
                            next += run.rows.len();
                            run.rows
                                .for_each_block(&mut buf, &mut params, &mut |r0, rows| {
                                    for (r, k) in rows.chunks_exact(hd).enumerate() {
                                        let i = run.first + r0 + r;
                                        layer.read_key(i, h, &mut want);
                                        assert_eq!(bits(k), bits(&want), "{ctx} h={h} key row {i}");
                                        assert_eq!(
                                            run.id + r0 + r,
                                            layer.row_id(i),
                                            "{ctx} id {i}"
                                        );
                                    }
                                });
                        });
                        assert_eq!(next, layer.len(), "{ctx}: key runs do not cover the rows");
                        let mut got = vec![0.0f32; hd];
                        let mut next = 0;
                        layer.for_each_value_run(h, |run| {
                            assert_eq!(run.first, next, "{ctx}: value runs out of order");
                            assert!(run.rows.len() > 0, "{ctx}: empty value run");
                            next += run.rows.len();
                            for r in 0..run.rows.len() {
                                let i = run.first + r;
                                run.rows.read(r, &mut got);
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

    /// A second, trivial policy: keep the first `n` rows, refuse every later one. Not a
    /// function of a window, and it refuses rows: proves `EvictionPolicy` is enough for a
    /// policy `StreamingLlm` is not, and that attention's `observe` hook reaches it.
    #[derive(Debug, Clone)]
    struct KeepFirst {
        n: usize,
        prefix: usize,
        appended: usize,
        /// (observe calls, last mass)
        seen: (usize, Vec<f32>),
    }

    impl EvictionPolicy for KeepFirst {
        fn body_start(&self) -> usize {
            self.prefix
        }
        fn body_slots(&self) -> Option<usize> {
            None
        }
        fn append(&mut self) -> Option<usize> {
            let t = self.appended;
            self.appended += 1;
            (t < self.n).then(|| self.slot(t))
        }
        fn appended(&self) -> usize {
            self.appended
        }
        fn stored(&self) -> usize {
            self.n.min(self.appended)
        }
        fn token_at(&self, i: usize) -> usize {
            i
        }
        fn is_stored(&self, tok: usize) -> bool {
            tok < self.stored()
        }
        fn stored_in(&self, lo: usize, hi: usize) -> usize {
            hi.min(self.stored()).saturating_sub(lo)
        }
        fn first_stored_from(&self, tok: usize) -> usize {
            if tok < self.stored() {
                tok
            } else {
                self.appended
            }
        }
        fn slot(&self, tok: usize) -> usize {
            if tok < self.prefix {
                tok
            } else {
                tok - self.prefix
            }
        }
        fn run_end(&self, i: usize, end: usize) -> usize {
            if i < self.prefix {
                end.min(self.prefix)
            } else {
                end
            }
        }
        fn observes(&self) -> bool {
            true
        }
        fn observe(&mut self, mass: &[f32]) {
            self.seen.0 += 1;
            self.seen.1 = mass.to_vec();
        }
    }

    /// A layer under `KeepFirst(n)` holds, reads, counts and attends exactly like a dense
    /// layer that was only ever given the first `n` rows (bit for bit), and attention
    /// reports each stored row's probability mass to the policy after every step.
    #[test]
    fn a_second_policy_through_the_trait() {
        use crate::attention::{append_kv, attend, attend_stored, AttnScratch, RopeTable};
        let (kv_heads, hd, group, n) = (2usize, 8usize, 2usize, 11usize);
        let cfg = Config {
            vocab_size: 8,
            hidden_size: kv_heads * group * hd,
            n_layers: 1,
            n_heads: kv_heads * group,
            n_kv_heads: kv_heads,
            head_dim: hd,
            intermediate_size: 8,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: tinygpt_reference::RopeScaling::None,
            max_position_embeddings: 4096,
            tie_word_embeddings: true,
            sliding_window: None,
            layer_types: vec![],
            num_kv_shared_layers: 0,
            attention_bias: false,
            qk_norm: false,
            gemma: Default::default(),
            bos_token_id: None,
            eos_token_ids: vec![],
        };
        let rope = RopeTable::new(&cfg);
        for precision in [Precision::Fp32, Precision::Fp16, Precision::Bf16] {
            for positions in [PositionsMode::Original, PositionsMode::Cache] {
                let kv = KvConfig {
                    precision,
                    positions,
                    ..KvConfig::default()
                };
                let policy = KeepFirst {
                    n,
                    prefix: prefix_len(&kv),
                    appended: 0,
                    seen: (0, Vec::new()),
                };
                let mut kept = LayerKv::with_policy(&kv, kv_heads, hd, policy);
                let mut dense = LayerKv::new(&kv, kv_heads, hd);
                let mut scratch = AttnScratch::new(&cfg, &kv);
                let row = |t: usize, salt: f32, len: usize| -> Vec<f32> {
                    (0..len)
                        .map(|c| ((t * 31 + c * 7) as f32 * 0.37 + salt).sin() * 3.0)
                        .collect()
                };
                let (mut a, mut b) = (vec![0.0; cfg.q_dim()], vec![0.0; cfg.q_dim()]);
                for t in 0..25usize {
                    let (k, v, q) = (
                        row(t, 0.0, cfg.kv_dim()),
                        row(t, 1.0, cfg.kv_dim()),
                        row(t, 2.0, cfg.q_dim()),
                    );
                    attend(
                        &cfg,
                        &rope,
                        &mut kept,
                        &q,
                        &k,
                        &v,
                        t,
                        &mut a,
                        &mut scratch,
                        None,
                    );
                    if t < n {
                        append_kv(&cfg, &rope, &mut dense, &k, &v, t, scratch.split_mut().0);
                    }
                    attend_stored(&cfg, &rope, &dense, &q, t, &mut b, &mut scratch, None);
                    let ctx = format!("{precision:?} {positions:?} t={t}");
                    assert_eq!(kept.len(), dense.len(), "{ctx}");
                    assert_eq!(kept.positions(), dense.positions(), "{ctx}");
                    assert_eq!(kept.bytes(), dense.bytes(), "{ctx}");
                    for i in 0..kept.len() {
                        assert_eq!(bits(&kept.key(i)), bits(&dense.key(i)), "{ctx} key {i}");
                        assert_eq!(bits(&kept.value(i)), bits(&dense.value(i)), "{ctx} v {i}");
                    }
                    assert_eq!(bits(&a), bits(&b), "{ctx}: attention output");
                    let (calls, mass) = &kept.policy().seen;
                    assert_eq!(*calls, t + 1, "{ctx}");
                    assert_eq!(mass.len(), kept.len(), "{ctx}");
                    let total: f32 = mass.iter().sum();
                    assert!((total - cfg.n_heads as f32).abs() < 1e-4, "{ctx}: {total}");
                }
            }
        }
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }
}
