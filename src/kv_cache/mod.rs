//! The engine's KV cache = eviction policy × storage (docs/design.md §2–§3, §6).
//!
//! * [`policy`]: which token rows survive StreamingLLM eviction (a pure function of the
//!   number of rows appended).
//! * `storage`: how rows are held: plain f32/f16/bf16 rows or KIVI int8/int4/int2 rows,
//!   K and V each at their own precision ([`KvConfig::key_precision`],
//!   [`KvConfig::value_precision`]).
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
//! copies nothing. K group `g = b / G` keeps its `(scale, zero)` in group slot
//! `g % (ceil(window / G) + 1)` (or `g`), written once when the group completes.
//!
//! Under KIVI with residual `R` (the newest `R` tokens of a KIVI side stay f32), K group
//! `g` is quantised at the append after which `T − R ≥ P + (g + 1)·G` (for R = 0: the
//! append of its `G`-th row), over those of its rows that are still stored after that
//! append's eviction (the reference does the same), so appending costs O(kv_dim) amortised
//! and no row is ever re-quantised. Until then K rows wait in an f32 ring of `R + G` rows.
//! A V row is quantised when it leaves the newest `R` (at append for R = 0); until then it
//! waits in an f32 ring of `min(R, window)` rows, slot `b % min(R, window)`, and it is
//! quantised from there just before the ring slot is reused.
//!
//! Every read dequantises into f32 (`read_key`, `read_value`, `gather_head`); integer
//! codes never leave `storage`. Attention does not read rows one by one: it walks
//! [`LayerKv::for_each_run`], which cuts the stored rows (oldest first) into runs of
//! consecutive slots of one region (prefix, body ring segment, one K group, the K
//! residual ring, the quantised V rows or the V residual ring) and hands out storage's
//! run views, whose fused kernels fold the KIVI scales
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
pub use tinygpt_reference::kv_cache::{KeyRope, KvConfig, PositionsMode, Precision};

/// Rows kept at full precision at the start of a KIVI cache (docs/design.md §2).
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
    if kv.residual > MAX_CACHE_ROWS {
        return Err(Error::flag(
            "--kv-residual",
            format!("{} is too large (at most {MAX_CACHE_ROWS})", kv.residual),
        ));
    }
    if cfg.head_dim == 0 || cfg.n_kv_heads == 0 {
        return Err(Error::flag("--kv-quantize", "model has no KV heads"));
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
        if p == Precision::Int4 && !cfg.head_dim.is_multiple_of(2) {
            return Err(Error::flag(
                flag,
                format!(
                    "int4 packs pairs along head_dim, which is odd ({})",
                    cfg.head_dim
                ),
            ));
        }
        if p == Precision::Int2 && !cfg.head_dim.is_multiple_of(4) {
            return Err(Error::flag(
                flag,
                format!(
                    "int2 packs four codes per byte along head_dim, which is not a multiple of 4 ({})",
                    cfg.head_dim
                ),
            ));
        }
    }
    Ok(())
}

/// KIVI code width of a precision, if it is a KIVI one.
fn kivi_bits(p: Precision) -> Option<Bits> {
    match p {
        Precision::Int8 => Some(Bits::Int8),
        Precision::Int4 => Some(Bits::Int4),
        Precision::Int2 => Some(Bits::Int2),
        _ => None,
    }
}

/// Element type of a plain (non-KIVI) side.
fn plain_kind(p: Precision) -> PlainKind {
    match p {
        Precision::Fp16 => PlainKind::F16,
        Precision::Bf16 => PlainKind::Bf16,
        _ => PlainKind::F32,
    }
}

/// Length of the prefix region (see the module docs).
pub fn prefix_len(kv: &KvConfig) -> usize {
    if kv.is_kivi() {
        kv.sink.max(FULL_PRECISION_ROWS)
    } else {
        kv.sink
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
    /// Codes, plus the f32 residual ring (`min(R, window)` rows) when R > 0.
    Kivi(TokenQuant, Option<Plain>),
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
    /// Row id of the first row: prefix row `t` is `t`, body ring slot `s` is `P + s`; the
    /// run's rows have ids `id..id + len` (for per-row tables such as RoPE angles).
    pub id: usize,
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
    /// KIVI residual R.
    residual: usize,
    /// Rows of the V residual ring (`min(R, window)`), when V is KIVI and R > 0.
    v_res_cap: usize,
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
        let g = kv.group_size.max(1);
        let r = kv.residual;
        let v_res_cap = kv.window.map_or(r, |w| r.min(w));
        let (kp, vp) = (kv.key_precision(), kv.value_precision());
        let body_k = match kivi_bits(kp) {
            Some(bits) => BodyK::Kivi(ChannelQuant::new(bits, n_kv_heads, head_dim, g, r)),
            None => BodyK::Plain(Plain::new(plain_kind(kp), n_kv_heads, head_dim)),
        };
        let body_v = match kivi_bits(vp) {
            Some(bits) => BodyV::Kivi(
                TokenQuant::new(bits, n_kv_heads, head_dim),
                (v_res_cap > 0).then(|| Plain::new(PlainKind::F32, n_kv_heads, head_dim)),
            ),
            None => BodyV::Plain(Plain::new(plain_kind(vp), n_kv_heads, head_dim)),
        };
        // Prefix rows are f32 under KIVI (either side), else at each side's precision.
        let (pk, pv) = if kv.is_kivi() {
            (PlainKind::F32, PlainKind::F32)
        } else {
            (plain_kind(kp), plain_kind(vp))
        };
        LayerKv {
            kv: kv.clone(),
            policy: Policy::new(kv),
            kv_heads: n_kv_heads,
            head_dim,
            prefix: prefix_len(kv),
            ring: kv.window,
            group_ring: kv.window.map(|w| w.div_ceil(g) + 1),
            residual: r,
            v_res_cap,
            appended: 0,
            prefix_pos: Vec::new(),
            body_pos: Vec::new(),
            prefix_k: Plain::new(pk, n_kv_heads, head_dim),
            prefix_v: Plain::new(pv, n_kv_heads, head_dim),
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

    /// Body rows that have left the newest R (`max(0, T − R − P)`): KIVI V rows below it
    /// are quantised.
    #[inline]
    fn body_left(&self) -> usize {
        self.appended
            .saturating_sub(self.residual)
            .saturating_sub(self.prefix)
    }

    /// Number of quantised K groups so far (the groups that have left the newest R).
    #[inline]
    fn groups_done(&self) -> usize {
        self.body_left() / self.kv.group_size.max(1)
    }

    /// Appends one token's rows (`(kv_heads, head_dim)` each; `k` already rotated in
    /// `original` positions mode with post-RoPE keys) at absolute position `pos`, then
    /// evicts per the policy and quantises what leaves the newest R rows.
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
        let (ring, prefix, hd) = (self.ring, self.prefix, self.head_dim);
        let slot_of = move |b: usize| match ring {
            Some(m) => b % m,
            None => b,
        };
        let first_stored = self
            .policy
            .window_start(self.appended)
            .saturating_sub(prefix);
        // The body row that has just left the newest R rows, if any.
        let leaving = (t >= self.residual + prefix).then(|| t - self.residual - prefix);
        let v_cap = self.v_res_cap;
        match &mut self.body_v {
            BodyV::Plain(p) => p.write(slot, v),
            BodyV::Kivi(q, None) => q.write(slot, v),
            BodyV::Kivi(q, Some(res)) => {
                // Quantise the leaving row (if still stored) before its ring slot is reused.
                if let Some(lb) = leaving.filter(|&lb| lb >= first_stored) {
                    let mut row = [0.0f32; 256];
                    let mut heap = Vec::new();
                    let row: &mut [f32] = if hd <= row.len() {
                        &mut row[..hd]
                    } else {
                        heap.resize(hd, 0.0);
                        &mut heap
                    };
                    for h in 0..self.kv_heads {
                        res.read(h, lb % v_cap, row);
                        q.write_head(h, slot_of(lb), row);
                    }
                }
                res.write(b % v_cap, v);
            }
        }
        let g = self.kv.group_size.max(1);
        match &mut self.body_k {
            BodyK::Plain(p) => p.write(slot, k),
            BodyK::Kivi(q) => {
                q.write_residual(b, k);
                if let Some(lb) = leaving.filter(|&lb| (lb + 1).is_multiple_of(g)) {
                    // The group has left the newest R: quantise its stored rows once.
                    let rows = (lb + 1 - g).max(first_stored)..lb + 1;
                    if !rows.is_empty() {
                        let group_slot = match self.group_ring {
                            Some(m) => (lb / g) % m,
                            None => lb / g,
                        };
                        q.complete_group(rows, group_slot, slot_of);
                    }
                }
            }
        }
    }

    /// Row id of stored row `i` (prefix row `t`: `t`; body ring slot `s`: `P + s`; see
    /// [`Run::id`]).
    #[inline]
    pub(crate) fn row_id(&self, i: usize) -> usize {
        match self.loc(i) {
            Loc::Prefix(t) => t,
            Loc::Body { slot, .. } => self.prefix + slot,
        }
    }

    /// One past the largest row id a stored row can have now.
    pub(crate) fn row_id_bound(&self) -> usize {
        self.prefix
            + match self.ring {
                Some(m) => m,
                None => self.appended.saturating_sub(self.prefix),
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
            Loc::Body { b, slot } => match &self.body_v {
                BodyV::Plain(p) => p.read(h, slot, out),
                BodyV::Kivi(_, Some(res)) if b >= self.body_left() => {
                    res.read(h, b % self.v_res_cap, out)
                }
                BodyV::Kivi(q, _) => q.read(h, slot, out),
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
    /// at the sink/recent seam, the prefix/body border, the ring's wrap, the start of
    /// the K residual and the wrap of its ring, the start of the V residual and the wrap
    /// of its ring; under a group ring (StreamingLLM) also at every K group border,
    /// whereas a dense cache's complete groups share one run (its parameter slots are
    /// consecutive; `ChannelRun` walks the groups itself), so a 16K-row dense step costs a
    /// handful of runs instead of 512 per head.
    pub(crate) fn for_each_run<'a>(&'a self, h: usize, mut f: impl FnMut(Run<'a>)) {
        let t = self.appended;
        let p = self.prefix;
        let g = self.kv.group_size.max(1);
        let k_res_cap = match &self.body_k {
            BodyK::Kivi(q) => Some(q.residual_cap()),
            BodyK::Plain(_) => None,
        };
        let v_res = matches!(self.body_v, BodyV::Kivi(_, Some(_)));
        let done = self.groups_done();
        let left = self.body_left();
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
                    id: a,
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
                if let Some(cap) = k_res_cap {
                    end = if bi / g < done {
                        // Quantised K groups share a run while their parameter slots are
                        // consecutive (no group ring).
                        if self.group_ring.is_none() {
                            end.min(done * g)
                        } else {
                            end.min((bi / g + 1) * g)
                        }
                    } else {
                        // The K residual, up to its ring's wrap.
                        end.min((bi / cap + 1) * cap)
                    };
                }
                if v_res {
                    let cap = self.v_res_cap;
                    end = if bi < left {
                        end.min(left)
                    } else {
                        end.min((bi / cap + 1) * cap)
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
                    BodyV::Kivi(_, Some(res)) if bi >= left => {
                        let r0 = bi % self.v_res_cap;
                        ValueRun::Plain(res.run(h, r0..r0 + len))
                    }
                    BodyV::Kivi(q, _) => ValueRun::Token(q.run(h, slots)),
                };
                debug_assert_eq!((key.len(), value.len()), (len, len));
                f(Run {
                    first,
                    len,
                    id: p + slot,
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
        match &self.body_v {
            BodyV::Plain(v) => total += body_rows * v.row_bytes(),
            BodyV::Kivi(v, res) => {
                // Rows still in the residual are f32.
                let (res_rows, res_row_bytes) = match res {
                    Some(r) => (
                        self.policy.stored_in(t, p + self.body_left(), t),
                        r.row_bytes(),
                    ),
                    None => (0, 0),
                };
                total += (body_rows - res_rows) * v.row_bytes() + res_rows * res_row_bytes;
            }
        }
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
