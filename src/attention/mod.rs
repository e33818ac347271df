//! One attention step for one layer and one token: the engine twin of
//! `tinygpt_reference::attention::attend`, with the same contract.
//!
//! Attention reads the cache where it lies, one KV head at a time, through
//! `LayerKv::for_each_key_run` / `for_each_value_run`: runs of consecutive slots of one
//! store, each handed over as a view whose fused kernels are all attention calls
//! (`KeyRun::dot_rows` / `for_each_block`, `ValueRun::axpy_rows`; one dynamic dispatch
//! per run, the kernels inside monomorphised per element type, code width and head dim).
//! Attention never matches on a precision. Nothing is dequantised into a copy of the
//! cache; what the stores' kernels do (docs/design.md §2):
//!
//! * f32 rows (full-precision prefix, fp32 body, the K residual): direct SIMD dot/axpy.
//! * f16/bf16 rows: widened to f32 in registers inside the dot/axpy.
//! * KIVI K codes (one group per run, per-channel `s_c`, `z_c`):
//!   `q·k = Σ_c (q_c s_c) u_c + Σ_c q_c z_c`, so the scales are folded into the query once
//!   per group and every row is a dot product of integer codes (widened in registers)
//!   with the folded query, plus the group's bias.
//! * KIVI V codes (per-token `s_i`, `z_i`): `Σ_i p_i v_i = Σ_i (p_i s_i) u_i + (Σ_i p_i z_i)`,
//!   so each row's codes are accumulated with weight `p_i s_i` and the zeros sum into one
//!   bias per query head, added at the end.
//!
//! `cache` positions mode stores keys before RoPE and rotates them by their logical slot
//! at attention time; `original` mode with `key_rope = pre` stores them before RoPE too
//! and rotates each by its stored absolute position (cos/sin kept per row id in the
//! scratch, computed once per stored row, so a step computes no angles for old rows). A per-channel scale does not commute with that rotation (it mixes
//! channel `c` with `c + d/2`), so there keys are rebuilt eight rows at a time in a
//! `(8, head_dim)` buffer (widened or dequantised exactly as `LayerKv::key` returns
//! them), rotated by their slots and dotted with the group's queries: still no copy of
//! the cache, and keys bit-identical to the reference's. (The alternative, un-rotating
//! the query per key and folding the scales per key, costs the same O(head_dim) per row
//! but once per query head instead of once per KV head.) Values never rotate, so they
//! take the fused path in both modes.
//!
//! Scores are reduced eight rows at a time (`ops::simd::reduce8`; the AVX-512 KIVI kernels
//! sixteen, `kivi::x86::avx512`), always in the same order, so a row's score does not depend on
//! how the rows were cut into runs or blocks.
//! Folding changes the summation order, so results match the dequantise-then-dot path
//! (and the reference) to rounding, not bit for bit. Cost per step is O(stored rows).
//!
//! KV heads are independent, so they run on rayon when the step is large enough to pay
//! for it; nothing reduces across threads, so results do not depend on the thread count.
//!
//! RoPE uses [`RopeTable`], whose cos/sin are computed exactly as the reference computes
//! them (`angle = pos as f32 * inv_freq[i]`, then `angle.cos()`, `angle.sin()`), so rotated
//! keys are bit-identical to the reference's.
//!
//! Files: this one (the step: tables, scratch, scores, softmax weights, values), `kernels`
//! (the block scorers of keys rotated at read time, the softmax), `split` (attention split
//! within a KV head, for a decode team), `tests`.

use crate::config::Config;
use crate::kivi::{hadamard, KvKernel};
use crate::kv_cache::{EvictionPolicy, KvConfig, LayerKv, PositionsMode};
use crate::ops::simd::{load8, store8};
use rayon::prelude::*;
use std::ops::Range;

mod kernels;
mod split;
#[cfg(test)]
mod tests;

use kernels::{dot_block, rotate_dot_block, BLOCK};
pub use kernels::{softmax, softmax_portable};
pub use split::{mix_query_heads, score_rows, AttnSplit, SplitPlan, SPLIT_MIN_ROWS};

/// Work (stored rows × query heads × head_dim) below which heads run sequentially.
const PARALLEL_MIN_WORK: usize = 1 << 16;

/// RoPE constants (Hugging Face rotate_half convention: pair `i` is `(x[i], x[i + d/2])`).
#[derive(Debug, Clone)]
pub struct RopeTable {
    /// (head_dim / 2)
    inv_freq: Vec<f32>,
}

impl RopeTable {
    pub fn new(cfg: &Config) -> Self {
        RopeTable {
            inv_freq: crate::rope::inv_freq(cfg),
        }
    }

    /// Rotated pairs per head (`head_dim / 2`).
    pub fn half(&self) -> usize {
        self.inv_freq.len()
    }

    /// cos/sin of every pair's angle at `pos` (`half()` values each).
    pub fn cos_sin(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        debug_assert_eq!(cos.len(), self.half());
        debug_assert_eq!(sin.len(), self.half());
        for i in 0..self.inv_freq.len() {
            let angle = pos as f32 * self.inv_freq[i];
            cos[i] = angle.cos();
            sin[i] = angle.sin();
        }
    }

    /// Rotates every head of a concatenated `(heads, head_dim)` vector to `pos`.
    pub fn rotate_heads(&self, x: &mut [f32], pos: usize) {
        let half = self.half();
        let mut buf = [0.0f32; 512];
        let mut heap = Vec::new();
        let cs: &mut [f32] = if 2 * half <= buf.len() {
            &mut buf[..2 * half]
        } else {
            heap.resize(2 * half, 0.0);
            &mut heap
        };
        let (cos, sin) = cs.split_at_mut(half);
        self.cos_sin(pos, cos, sin);
        rotate_each_head(x, cos, sin);
    }
}

/// Rotates every head of a concatenated `(heads, 2 · cos.len())` vector by `cos`/`sin`.
fn rotate_each_head(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    for head in x.chunks_exact_mut(2 * cos.len()) {
        rotate(head, cos, sin);
    }
}

/// Rotates one head by precomputed cos/sin: `(x1, x2) → (x1·c − x2·s, x2·c + x1·s)`.
#[inline]
pub fn rotate(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    rotate_inline(x, cos, sin)
}

#[inline(always)]
fn rotate_inline(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    debug_assert_eq!(x.len(), 2 * half);
    let (a, b) = x.split_at_mut(half);
    let mut i = 0;
    while i + 8 <= half {
        let x1 = load8(&a[i..]);
        let x2 = load8(&b[i..]);
        let c = load8(&cos[i..]);
        let s = load8(&sin[i..]);
        store8(&mut a[i..], x1 * c - x2 * s);
        store8(&mut b[i..], x2 * c + x1 * s);
        i += 8;
    }
    for j in i..half {
        let (x1, x2) = (a[j], b[j]);
        a[j] = x1 * cos[j] - x2 * sin[j];
        b[j] = x2 * cos[j] + x1 * sin[j];
    }
}

/// Per-KV-head working memory (all O(group × stored + head_dim), never a cache copy).
#[derive(Debug, Clone, Default)]
pub struct HeadScratch {
    /// (group, stored) scores, then softmax weights, of this KV head's query heads
    probs: Vec<f32>,
    /// (group, head_dim) queries with a K group's scales folded in
    fold: Vec<f32>,
    /// (BLOCK, head_dim) a few key rows, in `cache` positions mode
    block: Vec<f32>,
    /// (2, head_dim) a K group's f32 scale and zero, in `cache` positions mode
    params: Vec<f32>,
    /// (group) `Σ_i p_i z_i` of the KIVI value rows, per query head
    vbias: Vec<f32>,
}

/// Reusable buffers for [`attend`]; one per sequence (or per thread driving one).
#[derive(Debug, Clone)]
pub struct AttnScratch {
    /// What every KV head of a step reads (written by [`prepare_step`]).
    tables: StepTables,
    /// Each KV head's own working memory.
    heads: Vec<HeadScratch>,
}

/// The per-step tables every KV head reads: the rotated query, the appended key and the
/// per-row RoPE tables and visibility.
#[derive(Debug, Clone)]
pub struct StepTables {
    /// (n_heads, head_dim) rotated query
    q: Vec<f32>,
    /// (n_kv_heads, head_dim) key as appended
    k: Vec<f32>,
    /// (n_kv_heads, head_dim) value as appended, when the cache rotates it
    v: Vec<f32>,
    /// (stored) Mistral sliding-window visibility; empty without a sliding window
    visible: Vec<bool>,
    /// (slots, head_dim / 2) cos/sin per cache slot, for `cache` positions mode
    slot_cos: Vec<f32>,
    slot_sin: Vec<f32>,
    /// (row ids, head_dim / 2) cos/sin of each stored row's absolute position, for
    /// pre-RoPE keys in `original` mode; `id_pos[id]` is the position they hold
    /// (`usize::MAX`: none)
    id_cos: Vec<f32>,
    id_sin: Vec<f32>,
    id_pos: Vec<usize>,
    /// how stored keys rotate in the prepared step
    rot: Rotation,
    /// cos/sin of the last position rotated (every layer of a step rotates its query and
    /// key at the same position)
    angles: Angles,
    /// The inverse frequencies every cached cos/sin above was computed with: a layer with
    /// another RoPE (Gemma 3's sliding layers have their own base) clears them.
    rope_freq: Vec<f32>,
    /// The KIVI kernel variant every KV head of the step runs (the session's choice,
    /// [`crate::exec::ExecOptions::kv_kernel`]), passed down to the stores and the
    /// softmax: chosen once per session, not read per row.
    kv_kernel: KvKernel,
}

/// cos/sin at one position, kept until another position is asked for.
#[derive(Debug, Clone)]
struct Angles {
    /// the position held (`usize::MAX`: none yet)
    pos: usize,
    /// `half` cos values, then `half` sin values
    cs: Vec<f32>,
}

impl Angles {
    /// Rotates every head of `x` (`(heads, head_dim)`) to `pos`, as
    /// [`RopeTable::rotate_heads`] does (the same cos/sin, the same [`rotate`]).
    fn rotate_heads(&mut self, rope: &RopeTable, x: &mut [f32], pos: usize) {
        let half = rope.half();
        if self.pos != pos || self.cs.len() != 2 * half {
            self.cs.resize(2 * half, 0.0);
            let (cos, sin) = self.cs.split_at_mut(half);
            rope.cos_sin(pos, cos, sin);
            self.pos = pos;
        }
        let (cos, sin) = self.cs.split_at(half);
        rotate_each_head(x, cos, sin);
    }
}

impl AttnScratch {
    /// Scratch for a model of `cfg`'s shape on the fast KIVI kernels
    /// ([`KvKernel::best`]`(false)`, the default of [`crate::exec::ExecOptions`]).
    pub fn new(cfg: &Config, kv: &KvConfig) -> Self {
        AttnScratch::with_kernel(cfg, kv, KvKernel::best(false))
    }

    /// Scratch whose steps run the KIVI kernel variant `kernel` (an unsupported variant
    /// runs the portable kernels).
    pub fn with_kernel(cfg: &Config, kv: &KvConfig, kernel: KvKernel) -> Self {
        let _ = kv;
        AttnScratch {
            tables: StepTables::new(cfg, kernel),
            heads: vec![HeadScratch::default(); cfg.n_kv_heads],
        }
    }

    /// The KIVI kernel variant this scratch's steps run.
    pub fn kv_kernel(&self) -> KvKernel {
        self.tables.kv_kernel
    }

    /// The step tables (written by [`prepare_step`], then read by every KV head) and the
    /// per-KV-head scratch.
    pub fn split_mut(&mut self) -> (&mut StepTables, &mut [HeadScratch]) {
        (&mut self.tables, &mut self.heads)
    }
}

/// Each stored row's softmax weight summed over every query head of the last step
/// (for [`EvictionPolicy::observe`]).
fn row_mass(heads: &[HeadScratch], n: usize) -> Vec<f32> {
    let mut mass = vec![0.0f32; n];
    for hs in heads {
        for p in hs.probs.chunks_exact(n) {
            mass.iter_mut().zip(p).for_each(|(m, x)| *m += x);
        }
    }
    mass
}

impl HeadScratch {
    /// The softmax weights [`attend_heads`] left for its KV head's query heads,
    /// `(group, stored)`.
    pub fn weights(&self) -> &[f32] {
        &self.probs
    }
}

impl StepTables {
    /// Empty tables for a model of `cfg`'s shape ([`prepare_step`] fills them), whose
    /// steps run the KIVI kernel variant `kv_kernel`.
    pub fn new(cfg: &Config, kv_kernel: KvKernel) -> Self {
        StepTables {
            q: vec![0.0; cfg.q_dim()],
            k: vec![0.0; cfg.kv_dim()],
            v: vec![0.0; cfg.kv_dim()],
            visible: Vec::new(),
            slot_cos: Vec::new(),
            slot_sin: Vec::new(),
            id_cos: Vec::new(),
            id_sin: Vec::new(),
            id_pos: Vec::new(),
            rot: Rotation::None,
            angles: Angles {
                pos: usize::MAX,
                cs: Vec::new(),
            },
            rope_freq: Vec::new(),
            kv_kernel,
        }
    }

    /// Drops every cached cos/sin if they were computed with another RoPE than `rope`.
    fn use_rope(&mut self, rope: &RopeTable) {
        if self.rope_freq != rope.inv_freq {
            self.rope_freq.clone_from(&rope.inv_freq);
            self.angles.pos = usize::MAX;
            self.slot_cos.clear();
            self.slot_sin.clear();
            self.id_pos.iter_mut().for_each(|p| *p = usize::MAX);
        }
    }

    /// Makes the per-slot cos/sin table cover slots `[0, n)`.
    fn ensure_slots(&mut self, rope: &RopeTable, n: usize) {
        let half = rope.half();
        let have = self.slot_cos.len().checked_div(half).unwrap_or(n);
        if have >= n {
            return;
        }
        self.slot_cos.resize(n * half, 0.0);
        self.slot_sin.resize(n * half, 0.0);
        for s in have..n {
            let (c, sn) = (
                &mut self.slot_cos[s * half..(s + 1) * half],
                &mut self.slot_sin[s * half..(s + 1) * half],
            );
            rope.cos_sin(s, c, sn);
        }
    }

    /// Makes the per-row-id cos/sin table hold every stored row's position.
    fn ensure_row_angles<P: EvictionPolicy + Clone>(
        &mut self,
        rope: &RopeTable,
        layer: &LayerKv<P>,
    ) {
        let half = rope.half();
        let bound = layer.row_id_bound();
        if self.id_pos.len() < bound {
            self.id_pos.resize(bound, usize::MAX);
            self.id_cos.resize(bound * half, 0.0);
            self.id_sin.resize(bound * half, 0.0);
        }
        for i in 0..layer.len() {
            let (id, pos) = (layer.row_id(i), layer.position(i));
            if self.id_pos[id] != pos {
                self.id_pos[id] = pos;
                rope.cos_sin(
                    pos,
                    &mut self.id_cos[id * half..(id + 1) * half],
                    &mut self.id_sin[id * half..(id + 1) * half],
                );
            }
        }
    }
}

/// Appends this token's K/V to `layer` and attends over what is stored afterwards.
///
/// * `q`: `(n_heads, head_dim)` before RoPE; `k`, `v`: `(n_kv_heads, head_dim)`, `k`
///   before RoPE. `pos`: the token's absolute position.
/// * `out`: `(n_heads, head_dim)`, the attention output before `o_proj`.
/// * `probs_out`: if given, receives each head's softmax weights over the stored rows,
///   `(n_heads, stored)`.
///
/// RoPE placement follows the cache's positions mode (docs/design.md §3); Mistral's
/// `sliding_window` hides keys with `pos − key_pos ≥ sliding_window`.
#[allow(clippy::too_many_arguments)]
pub fn attend<P: EvictionPolicy + Clone>(
    cfg: &Config,
    rope: &RopeTable,
    layer: &mut LayerKv<P>,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    pos: usize,
    out: &mut [f32],
    scratch: &mut AttnScratch,
    probs_out: Option<&mut Vec<f32>>,
) {
    append_kv(cfg, rope, layer, k, v, pos, &mut scratch.tables);
    attend_stored(cfg, rope, layer, q, pos, out, scratch, probs_out);
    observe_step(layer, &scratch.heads);
}

/// Hands the step's softmax weights to an observing eviction policy (a no-op for the
/// others).
fn observe_step<P: EvictionPolicy + Clone>(layer: &mut LayerKv<P>, heads: &[HeadScratch]) {
    if layer.observes() {
        let mass = row_mass(heads, layer.len());
        layer.observe(&mass);
    }
}

/// The first half of [`attend`]: rotates `k` (`original` positions mode) and appends
/// this token's K/V, evicting per the policy.
pub fn append_kv<P: EvictionPolicy + Clone>(
    cfg: &Config,
    rope: &RopeTable,
    layer: &mut LayerKv<P>,
    k: &[f32],
    v: &[f32],
    pos: usize,
    scratch: &mut StepTables,
) {
    debug_assert_eq!(k.len(), cfg.kv_dim());
    debug_assert_eq!(v.len(), cfg.kv_dim());
    debug_assert_eq!(layer.kv_heads(), cfg.n_kv_heads);
    debug_assert_eq!(layer.head_dim(), cfg.head_dim);
    scratch.use_rope(rope);
    scratch.k.copy_from_slice(k);
    if !layer.config().keys_pre_rope() {
        scratch.angles.rotate_heads(rope, &mut scratch.k, pos);
    }
    if layer.config().rotates(cfg.head_dim) {
        // Stored as H·k (after RoPE unless keys are kept before it) and H·v.
        hadamard::rotate_heads(&mut scratch.k, cfg.head_dim);
        scratch.v.copy_from_slice(v);
        hadamard::rotate_heads(&mut scratch.v, cfg.head_dim);
        layer.append(&scratch.k, &scratch.v, pos);
        return;
    }
    layer.append(&scratch.k, v, pos);
}

/// The second half of [`attend`]: the query of the token at absolute position `pos`
/// (already appended) attends over the stored rows without changing the cache. Layers
/// that read another layer's K/V (YOCO-style cross-decoders) call this alone.
///
/// Steps: [`prepare_step`] (rotate the query, per-row RoPE tables, sliding-window
/// visibility), then per KV head [`attend_head`] (scores, softmax, weighted sum), on
/// rayon when the step is large enough.
#[allow(clippy::too_many_arguments)]
pub fn attend_stored<P: EvictionPolicy + Clone>(
    cfg: &Config,
    rope: &RopeTable,
    layer: &LayerKv<P>,
    q: &[f32],
    pos: usize,
    out: &mut [f32],
    scratch: &mut AttnScratch,
    probs_out: Option<&mut Vec<f32>>,
) {
    let hd = cfg.head_dim;
    let group = cfg.group();
    debug_assert_eq!(q.len(), cfg.q_dim());
    debug_assert_eq!(out.len(), cfg.q_dim());
    debug_assert_eq!(layer.kv_heads(), cfg.n_kv_heads);
    debug_assert_eq!(layer.head_dim(), hd);
    debug_assert!(!layer.is_empty(), "attend_stored on an empty cache");
    prepare_step(cfg, rope, layer, q, pos, &mut scratch.tables);
    let AttnScratch { tables, heads } = scratch;
    let parallel = cfg.n_kv_heads > 1
        && layer.len() * cfg.n_heads * hd >= PARALLEL_MIN_WORK
        && crate::threads::current() > 1;
    if parallel {
        heads
            .par_iter_mut()
            .zip(out.par_chunks_mut(group * hd))
            .enumerate()
            .for_each(|(h, (hs, oh))| {
                attend_heads(cfg, rope, layer, tables, h, std::slice::from_mut(hs), oh)
            });
    } else {
        attend_heads(cfg, rope, layer, tables, 0, heads, out);
    }
    if let Some(p) = probs_out {
        copy_probs(heads, group * layer.len(), p);
    }
}

/// Every query head's softmax weights, `(n_heads, stored)`, from the KV heads' scratch
/// (`per_head`: `group × stored` values each).
fn copy_probs(heads: &[HeadScratch], per_head: usize, p: &mut Vec<f32>) {
    p.clear();
    for hs in heads {
        p.extend_from_slice(&hs.probs[..per_head]);
    }
}

/// KV heads `h0..h0 + heads.len()` of a step [`prepare_step`] has prepared in `tables`:
/// scores, softmax and the weighted sum of the values into `out` (those heads' query
/// heads, `(heads × group, head_dim)`). Heads are independent: a decode team gives each
/// member its own range.
pub fn attend_heads<P: EvictionPolicy + Clone>(
    cfg: &Config,
    rope: &RopeTable,
    layer: &LayerKv<P>,
    tables: &StepTables,
    h0: usize,
    heads: &mut [HeadScratch],
    out: &mut [f32],
) {
    let (hd, group) = (cfg.head_dim, cfg.group());
    debug_assert_eq!(out.len(), heads.len() * group * hd);
    let step = Step::new(cfg, rope, layer, tables);
    let rotated = layer.config().rotates(hd);
    for (i, (hs, oh)) in heads.iter_mut().zip(out.chunks_mut(group * hd)).enumerate() {
        let h = h0 + i;
        attend_head(
            &step,
            h,
            &tables.q[h * group * hd..(h + 1) * group * hd],
            hs,
            oh,
        );
        if rotated {
            // Values were stored as H·v: Σ p_i H·v_i = H·o, and H·H = I.
            hadamard::rotate_heads(oh, hd);
        }
    }
}

/// How stored keys are rotated at read time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rotation {
    /// Keys are stored after RoPE.
    None,
    /// `cache` positions mode: by logical slot.
    BySlot,
    /// `original` mode with pre-RoPE keys: by each row id's stored position.
    ById,
}

/// Rotates the query (`scratch.q`), fills the per-row RoPE tables the keys need and the
/// Mistral sliding-window visibility of every stored row (the first half of
/// [`attend_stored`]; [`attend_heads`] is the second).
pub fn prepare_step<P: EvictionPolicy + Clone>(
    cfg: &Config,
    rope: &RopeTable,
    layer: &LayerKv<P>,
    q: &[f32],
    pos: usize,
    scratch: &mut StepTables,
) {
    let mode = layer.config().positions;
    let n = layer.len();
    scratch.use_rope(rope);
    scratch.q.copy_from_slice(q);
    let q_pos = match mode {
        PositionsMode::Original => pos,
        PositionsMode::Cache => n - 1,
    };
    scratch.angles.rotate_heads(rope, &mut scratch.q, q_pos);
    if layer.config().rotates(cfg.head_dim) && !layer.config().keys_pre_rope() {
        // (H·q)·(H·k) = q·k: the query meets the stored keys in the rotated basis.
        hadamard::rotate_heads(&mut scratch.q, cfg.head_dim);
    }
    scratch.rot = if mode == PositionsMode::Cache {
        scratch.ensure_slots(rope, n);
        Rotation::BySlot
    } else if layer.config().keys_pre_rope() {
        scratch.ensure_row_angles(rope, layer);
        Rotation::ById
    } else {
        Rotation::None
    };
    scratch.visible.clear();
    if let Some(w) = cfg.sliding_window {
        scratch
            .visible
            .extend((0..n).map(|i| pos.saturating_sub(layer.position(i)) < w));
    }
}

/// What every KV head of one step shares.
struct Step<'a, P> {
    layer: &'a LayerKv<P>,
    hd: usize,
    /// stored rows
    n: usize,
    /// rotated pairs per head
    half: usize,
    score_scale: f32,
    /// (stored) sliding-window visibility; empty without a sliding window
    visible: &'a [bool],
    /// per-row cos/sin tables and whether they are indexed by row id (else by logical
    /// slot), when keys rotate at read time
    rot: Option<(&'a [f32], &'a [f32], bool)>,
    /// the KIVI kernel variant ([`StepTables`]'s)
    kv: KvKernel,
}

impl<'a, P: EvictionPolicy + Clone> Step<'a, P> {
    fn new(cfg: &Config, rope: &RopeTable, layer: &'a LayerKv<P>, tables: &'a StepTables) -> Self {
        let hd = cfg.head_dim;
        Step {
            layer,
            hd,
            n: layer.len(),
            half: rope.half(),
            score_scale: cfg.score_scale(),
            visible: &tables.visible,
            rot: match tables.rot {
                Rotation::None => None,
                Rotation::BySlot => Some((&tables.slot_cos[..], &tables.slot_sin[..], false)),
                Rotation::ById => Some((&tables.id_cos[..], &tables.id_sin[..], true)),
            },
            kv: tables.kv_kernel,
        }
    }
}

/// One KV head: scores of its query heads `qh` (`(group, head_dim)`, rotated) against
/// the stored keys, softmax, and the weighted sum of the values into `oh`.
fn attend_head<P: EvictionPolicy + Clone>(
    step: &Step<'_, P>,
    h: usize,
    qh: &[f32],
    hs: &mut HeadScratch,
    oh: &mut [f32],
) {
    let (hd, n) = (step.hd, step.n);
    let group = qh.len() / hd;
    hs.probs.resize(group * n, 0.0);
    hs.fold.resize(group * hd, 0.0);
    hs.block.resize(BLOCK * hd, 0.0);
    hs.params.resize(2 * hd, 0.0);
    hs.vbias.clear();
    hs.vbias.resize(group, 0.0);
    let HeadScratch {
        probs,
        fold,
        block,
        params,
        ..
    } = hs;
    let scratch = (
        fold.as_mut_slice(),
        block.as_mut_slice(),
        params.as_mut_slice(),
    );
    score_range(step, h, qh, 0..n, scratch, probs, n);
    for scores in hs.probs.chunks_exact_mut(n) {
        weigh(step, scores);
    }
    mix_head(step, h, hs, oh);
}

/// One query head's raw scores over the stored rows scaled, masked by the sliding window
/// and turned into softmax weights, in place.
fn weigh<P>(step: &Step<'_, P>, scores: &mut [f32]) {
    scores.iter_mut().for_each(|x| *x *= step.score_scale);
    // Mistral sliding window: hidden keys get weight 0.
    for (x, &vis) in scores.iter_mut().zip(step.visible) {
        if !vis {
            *x = f32::NEG_INFINITY;
        }
    }
    softmax(scores, step.kv);
}

/// Raw scores `q·k` of KV head `h`'s query heads against stored rows `span`:
/// `out[j * stride + i - span.start]` for query `j` and row `i`, straight from storage:
/// through each run's fused kernel, or (keys rotated at read time) rebuilt [`BLOCK`] rows
/// at a time, rotated by their slots or positions, scored. A row's score does not depend
/// on `span` (the kernels' contract, [`crate::kv_cache`]'s `KeyRun::dot_rows`): a decode
/// team may score one KV head in several ranges. Scratch: `(fold, block, params)` as in
/// [`HeadScratch`], sized.
fn score_range<P: EvictionPolicy + Clone>(
    step: &Step<'_, P>,
    h: usize,
    qh: &[f32],
    span: Range<usize>,
    (fold, block, params): (&mut [f32], &mut [f32], &mut [f32]),
    out: &mut [f32],
    stride: usize,
) {
    let (hd, half) = (step.hd, step.half);
    let unrotate = step.layer.config().rotates(hd);
    let n = stride;
    step.layer.for_each_key_run_in(h, span.clone(), |run| {
        debug_assert!(run.first >= span.start && run.first + run.rows.len() <= span.end);
        let out = &mut out[run.first - span.start..];
        let Some((c, s, by_id)) = step.rot else {
            run.rows.dot_rows(step.kv, qh, fold, out, n);
            return;
        };
        let base = if by_id { run.id } else { run.first };
        let fused = half.is_multiple_of(8);
        run.rows.for_each_block(block, params, &mut |r0, rows| {
            if unrotate {
                // Pre-RoPE keys stored as H·k: back to k (H·H = I) before RoPE.
                hadamard::rotate_heads(rows, hd);
            }
            let (c, s) = (&c[(base + r0) * half..], &s[(base + r0) * half..]);
            if fused {
                rotate_dot_block(qh, rows, hd, (c, s), &mut out[r0..], n);
                return;
            }
            for (r, row) in rows.chunks_exact_mut(hd).enumerate() {
                rotate_inline(
                    row,
                    &c[r * half..(r + 1) * half],
                    &s[r * half..(r + 1) * half],
                );
            }
            let m = rows.len() / hd;
            for (j, q) in qh.chunks_exact(hd).enumerate() {
                dot_block(q, rows, &mut out[j * n + r0..j * n + r0 + m]);
            }
        });
    });
}

/// `oh = Σ_i p_i v_i` for KV head `h`'s query heads, straight from storage (a store may
/// defer a per-query constant into `hs.vbias`, added at the end).
fn mix_head<P: EvictionPolicy + Clone>(
    step: &Step<'_, P>,
    h: usize,
    hs: &mut HeadScratch,
    oh: &mut [f32],
) {
    let (hd, n) = (step.hd, step.n);
    oh.fill(0.0);
    let (probs, vbias) = (&hs.probs, &mut hs.vbias);
    step.layer.for_each_value_run(h, |run| {
        run.rows
            .axpy_rows(step.kv, &probs[run.first..], n, oh, vbias);
    });
    for (o, &b) in oh.chunks_exact_mut(hd).zip(vbias.iter()) {
        if b != 0.0 {
            o.iter_mut().for_each(|x| *x += b);
        }
    }
}
