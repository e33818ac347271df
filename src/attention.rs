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

use crate::config::Config;
use crate::kivi::hadamard;
use crate::kv_cache::{EvictionPolicy, KvConfig, LayerKv, PositionsMode};
use crate::ops::simd::{load8, reduce8, store8};
use rayon::prelude::*;
use std::ops::Range;
use wide::f32x8;

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

/// Rows per block of rebuilt keys in `cache` positions mode (one f32x8 of scores).
const BLOCK: usize = 8;

/// `out[r] = q · rows[r]` for a block of `m = out.len() ≤ BLOCK` rows (`rows`:
/// `(m, head_dim)`). One accumulator per row, the eight reduced together with a
/// transpose, so eight scores cost one reduction. A partial block pads with zero rows,
/// so every row's score is summed in the same order whatever block it falls in (results
/// do not depend on how the rows are cut into runs).
#[inline]
fn dot_block(q: &[f32], rows: &[f32], out: &mut [f32]) {
    let hd = q.len();
    let m = out.len();
    debug_assert!(m <= BLOCK && rows.len() == m * hd);
    let mut acc = [f32x8::ZERO; BLOCK];
    let mut i = 0;
    while i + 8 <= hd {
        let qv = load8(&q[i..]);
        for (r, a) in acc.iter_mut().enumerate().take(m) {
            *a = load8(&rows[r * hd + i..]).mul_add(qv, *a);
        }
        i += 8;
    }
    let part: [(f32x8, f32); BLOCK] = std::array::from_fn(|r| {
        let tail = if r < m {
            let row = &rows[r * hd..(r + 1) * hd];
            (i..hd).map(|c| q[c] * row[c]).sum()
        } else {
            0.0
        };
        (acc[r], tail)
    });
    out.copy_from_slice(&reduce8(part).to_array()[..m]);
}

/// Scores of every query in `qs` (`(queries, head_dim)`, rotated) against a block of
/// `m ≤ BLOCK` stored keys `rows` (`(m, head_dim)`, not yet rotated) that RoPE rotates
/// at read time: `out[j * stride + r] = q_j · rot(rows[r])`, row `r` rotated by
/// `cos[r * half..]`, `sin[r * half..]` (`half = head_dim / 2`, a multiple of 8) as
/// [`rotate_inline`] rotates it. The rotated row stays in registers and each of its
/// chunks serves up to four queries (a GQA group's heads). A row's score is summed in one
/// fixed order — lane accumulators over the chunk pairs `(i, half + i)` in turn, then the
/// lanes as [`reduce8`] adds them — in a full block or not, so it does not depend on how
/// the rows were cut into runs or blocks.
#[inline]
fn rotate_dot_block(
    qs: &[f32],
    rows: &[f32],
    hd: usize,
    (cos, sin): (&[f32], &[f32]),
    out: &mut [f32],
    stride: usize,
) {
    let (m, half) = (rows.len() / hd, hd / 2);
    debug_assert!(half.is_multiple_of(8) && m <= BLOCK && qs.len().is_multiple_of(hd));
    let nq = qs.len() / hd;
    if m < BLOCK {
        for (j, q) in qs.chunks_exact(hd).enumerate() {
            let mut acc = [f32x8::ZERO; BLOCK];
            for (r, row) in rows.chunks_exact(hd).enumerate() {
                acc[r] = rotate_dot_lanes(q, row, (&cos[r * half..], &sin[r * half..]));
            }
            out[j * stride..j * stride + m].copy_from_slice(&reduce_rows(&acc)[..m]);
        }
        return;
    }
    let mut j = 0;
    while j < nq {
        let take = (nq - j).min(4);
        let q = &qs[j * hd..(j + take) * hd];
        let o = &mut out[j * stride..];
        match take {
            4 => rotate_dot_k::<4>(q, rows, (cos, sin), o, stride),
            3 => rotate_dot_k::<3>(q, rows, (cos, sin), o, stride),
            2 => rotate_dot_k::<2>(q, rows, (cos, sin), o, stride),
            _ => rotate_dot_k::<1>(q, rows, (cos, sin), o, stride),
        }
        j += take;
    }
}

/// One rotated chunk pair of a row: `(a·c − b·s, b·c + a·s)`, as [`rotate_inline`].
#[inline(always)]
fn rotate_chunk(row: &[f32], half: usize, i: usize, cos: &[f32], sin: &[f32]) -> (f32x8, f32x8) {
    let (a, b) = (load8(&row[i..]), load8(&row[half + i..]));
    let (c, s) = (load8(&cos[i..]), load8(&sin[i..]));
    (a * c - b * s, b * c + a * s)
}

/// The lane accumulators of one row's score in [`rotate_dot_block`]'s order.
#[inline(always)]
fn rotate_dot_lanes(q: &[f32], row: &[f32], (cos, sin): (&[f32], &[f32])) -> f32x8 {
    let half = row.len() / 2;
    let mut acc = f32x8::ZERO;
    let mut i = 0;
    while i + 8 <= half {
        let (ra, rb) = rotate_chunk(row, half, i, cos, sin);
        acc = ra.mul_add(load8(&q[i..]), acc);
        acc = rb.mul_add(load8(&q[half + i..]), acc);
        i += 8;
    }
    acc
}

/// [`rotate_dot_block`] for a full block and `Q` queries.
#[inline(always)]
fn rotate_dot_k<const Q: usize>(
    qs: &[f32],
    rows: &[f32],
    (cos, sin): (&[f32], &[f32]),
    out: &mut [f32],
    stride: usize,
) {
    let hd = qs.len() / Q;
    let half = hd / 2;
    let rows: &[f32] = &rows[..BLOCK * hd];
    let (cos, sin) = (&cos[..BLOCK * half], &sin[..BLOCK * half]);
    let mut acc = [[f32x8::ZERO; BLOCK]; Q];
    let mut i = 0;
    while i + 8 <= half {
        let qa: [f32x8; Q] = std::array::from_fn(|j| load8(&qs[j * hd + i..]));
        let qb: [f32x8; Q] = std::array::from_fn(|j| load8(&qs[j * hd + half + i..]));
        for r in 0..BLOCK {
            let row = &rows[r * hd..(r + 1) * hd];
            let (ra, rb) = rotate_chunk(row, half, i, &cos[r * half..], &sin[r * half..]);
            for j in 0..Q {
                acc[j][r] = ra.mul_add(qa[j], acc[j][r]);
                acc[j][r] = rb.mul_add(qb[j], acc[j][r]);
            }
        }
        i += 8;
    }
    for (j, a) in acc.iter().enumerate() {
        out[j * stride..j * stride + BLOCK].copy_from_slice(&reduce_rows(a));
    }
}

/// Each row's lane accumulator summed to its score with [`reduce8`] (no scalar tail: an
/// empty sum, as [`dot_block`] adds for a row without one). A row's sum does not depend
/// on the other rows of the block.
#[inline(always)]
fn reduce_rows(acc: &[f32x8; BLOCK]) -> [f32; BLOCK] {
    let tail: f32 = std::iter::empty::<f32>().sum();
    reduce8(std::array::from_fn(|r| (acc[r], tail))).to_array()
}

/// In-place softmax with max subtraction; entries of `-inf` get weight 0.
///
/// Vectorised: the max over eight independent chains (exact in any order), `exp` eight
/// lanes at a time (`wide`'s polynomial, within 2 ulp of libm's; `exp(−inf) = 0`), the
/// sum over eight lane accumulators, one division per value. Differs from the
/// reference's scalar loop by rounding only (the attention tests bound it). The
/// `avx512` variant (`kivi::KvKernel`) computes the same `exp` per value sixteen
/// lanes at a time and adds the sum in another order.
pub fn softmax(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::kivi::kv_kernel() == crate::kivi::KvKernel::Avx512 {
        // SAFETY: `kv_kernel` picks the AVX-512 variant only when the CPU has AVX-512 F.
        unsafe { crate::kivi::softmax_avx512(x) };
        return;
    }
    softmax_portable(x)
}

/// [`softmax`] on `wide` vectors (the portable variant).
pub fn softmax_portable(x: &mut [f32]) {
    let n = x.len();
    let n8 = n - n % 8;
    let mut mv = f32x8::splat(f32::NEG_INFINITY);
    for c in x[..n8].chunks_exact(8) {
        mv = mv.max(load8(c));
    }
    let max = x[n8..].iter().copied().fold(
        mv.to_array().into_iter().fold(f32::NEG_INFINITY, f32::max),
        f32::max,
    );
    let m = f32x8::splat(max);
    let mut sv = f32x8::ZERO;
    for c in x[..n8].chunks_exact_mut(8) {
        let e = (load8(c) - m).exp();
        sv += e;
        store8(c, e);
    }
    let mut sum = sv.reduce_add();
    for v in x[n8..].iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let total = f32x8::splat(sum);
    for c in x[..n8].chunks_exact_mut(8) {
        store8(c, load8(c) / total);
    }
    for v in x[n8..].iter_mut() {
        *v /= sum;
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
    pub fn new(cfg: &Config, kv: &KvConfig) -> Self {
        let _ = kv;
        AttnScratch {
            tables: StepTables {
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
            },
            heads: vec![HeadScratch::default(); cfg.n_kv_heads],
        }
    }

    /// The two halves a decode team shares out: the step tables (written by one member in
    /// [`prepare_step`], then read by all) and the per-KV-head scratch (one member each).
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

impl StepTables {
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
pub fn observe_step<P: EvictionPolicy + Clone>(layer: &mut LayerKv<P>, heads: &[HeadScratch]) {
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
        && crate::team::threads() > 1;
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
pub fn copy_probs(heads: &[HeadScratch], per_head: usize, p: &mut Vec<f32>) {
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

/// Whether a decode team splits each KV head's attention between its members
/// ([`score_rows`], then [`mix_query_heads`]) instead of giving each member whole KV heads
/// ([`attend_heads`]). The results are the same bit for bit either way; only the balance
/// between members (and one more sync per layer) differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttnSplit {
    /// When it pays: at least [`SPLIT_MIN_ROWS`] stored rows, and whole KV heads would
    /// leave the members unevenly loaded (the KV heads are not a multiple of the team
    /// size, e.g. SmolLM2's 3 or Gemma 3's 1 on 2 threads).
    #[default]
    Auto,
    /// Always (tests).
    Always,
    /// Never (tests, A/B runs).
    Never,
}

/// Stored rows from which [`AttnSplit::Auto`] splits a KV head. Below it attention is a
/// small part of the step and one more sync per layer costs about what the balance gains.
pub const SPLIT_MIN_ROWS: usize = 256;

impl AttnSplit {
    /// The default of new sessions: `TINYGPT_ATTN_SPLIT` = `always` / `never` (A/B runs),
    /// else [`AttnSplit::Auto`].
    pub fn from_env() -> Self {
        static SPLIT: std::sync::OnceLock<AttnSplit> = std::sync::OnceLock::new();
        *SPLIT.get_or_init(|| match std::env::var("TINYGPT_ATTN_SPLIT").as_deref() {
            Ok("always") => AttnSplit::Always,
            Ok("never") => AttnSplit::Never,
            _ => AttnSplit::Auto,
        })
    }

    /// Whether a team of `members` splits a layer of `n_kv_heads` KV heads holding
    /// `stored` rows.
    pub fn splits(self, n_kv_heads: usize, members: usize, stored: usize) -> bool {
        match self {
            AttnSplit::Always => true,
            AttnSplit::Never => false,
            AttnSplit::Auto => {
                members > 1 && !n_kv_heads.is_multiple_of(members) && stored >= SPLIT_MIN_ROWS
            }
        }
    }
}

/// Raw scores (before the `1/√d` scale) of KV head `h`'s query heads against stored rows
/// `rows` of a step [`prepare_step`] has prepared: `out[j * stride + i - rows.start]` for
/// query head `j` of the group and row `i`. Each row's score is bit for bit the one
/// [`attend_heads`] computes, whatever the range (the kernels' contract), so a decode
/// team can score one KV head in several ranges. `hs` is the caller's scratch (only its
/// `fold`, `block` and `params` are used).
#[allow(clippy::too_many_arguments)]
pub fn score_rows<P: EvictionPolicy + Clone>(
    cfg: &Config,
    rope: &RopeTable,
    layer: &LayerKv<P>,
    tables: &StepTables,
    h: usize,
    rows: Range<usize>,
    hs: &mut HeadScratch,
    out: &mut [f32],
    stride: usize,
) {
    let (hd, group) = (cfg.head_dim, cfg.group());
    debug_assert!(rows.end <= layer.len() && rows.len() <= stride);
    debug_assert!(out.len() >= (group - 1) * stride + rows.len());
    let step = Step::new(cfg, rope, layer, tables);
    hs.fold.resize(group * hd, 0.0);
    hs.block.resize(BLOCK * hd, 0.0);
    hs.params.resize(2 * hd, 0.0);
    let qh = &tables.q[h * group * hd..(h + 1) * group * hd];
    let scratch = (&mut hs.fold[..], &mut hs.block[..], &mut hs.params[..]);
    score_range(&step, h, qh, rows, scratch, out, stride);
}

/// Consecutive query heads of KV head `h`, after [`score_rows`]: `p` (their raw scores
/// over every stored row, `(k, stored)`) becomes their softmax weights in place, and
/// `out` (`(k, head_dim)`) their attention output — bit for bit what [`attend_heads`]
/// computes for those query heads (each query's sum of values does not depend on how many
/// queries share the kernel call, which reads each value row once for all of them).
pub fn mix_query_heads<P: EvictionPolicy + Clone>(
    cfg: &Config,
    rope: &RopeTable,
    layer: &LayerKv<P>,
    tables: &StepTables,
    h: usize,
    p: &mut [f32],
    out: &mut [f32],
) {
    let (hd, n) = (cfg.head_dim, layer.len());
    let k = out.len() / hd;
    debug_assert!(p.len() == k * n && out.len() == k * hd && k > 0);
    let step = Step::new(cfg, rope, layer, tables);
    for scores in p.chunks_exact_mut(n) {
        weigh(&step, scores);
    }
    out.fill(0.0);
    let mut bias = vec![0.0f32; k];
    step.layer.for_each_value_run(h, |run| {
        run.rows.axpy_rows(&p[run.first..], n, out, &mut bias);
    });
    for (o, &b) in out.chunks_exact_mut(hd).zip(&bias) {
        if b != 0.0 {
            o.iter_mut().for_each(|x| *x += b);
        }
    }
    if layer.config().rotates(hd) {
        hadamard::rotate_heads(out, hd);
    }
}

/// The size of the scratch a decode team resizes before its members share
/// [`HeadScratch::probs`] out by rows: `(group, stored)` scores of each KV head.
pub fn size_probs(heads: &mut [HeadScratch], group: usize, stored: usize) {
    for hs in heads {
        hs.probs.resize(group * stored, 0.0);
    }
}

/// The `(group, stored)` scores (then weights) buffer of a KV head's scratch.
pub fn probs_mut(hs: &mut HeadScratch) -> &mut [f32] {
    &mut hs.probs
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
    softmax(scores);
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
            run.rows.dot_rows(qh, fold, out, n);
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
        run.rows.axpy_rows(&probs[run.first..], n, oh, vbias);
    });
    for (o, &b) in oh.chunks_exact_mut(hd).zip(vbias.iter()) {
        if b != 0.0 {
            o.iter_mut().for_each(|x| *x += b);
        }
    }
}

/// The unfused twin of [`attend_stored`], as the engine did it before the fused kernels:
/// dequantise (and in `cache` mode rotate) every stored row of a KV head into an
/// `(stored, head_dim)` copy, then score, softmax and mix. Kept as the differential
/// oracle for the fused path.
#[cfg(test)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn attend_stored_dequant(
    cfg: &Config,
    rope: &RopeTable,
    layer: &LayerKv,
    q: &[f32],
    pos: usize,
    out: &mut [f32],
    probs_out: Option<&mut Vec<f32>>,
) {
    let hd = cfg.head_dim;
    let group = cfg.group();
    let mode = layer.config().positions;
    let n = layer.len();
    let mut qr = q.to_vec();
    let q_pos = match mode {
        PositionsMode::Original => pos,
        PositionsMode::Cache => n - 1,
    };
    rope.rotate_heads(&mut qr, q_pos);
    let rotated = layer.config().rotates(hd);
    if rotated && !layer.config().keys_pre_rope() {
        hadamard::rotate_heads(&mut qr, hd);
    }
    let half = rope.half();
    let (mut cos, mut sin) = (vec![0.0; half], vec![0.0; half]);
    let score_scale = cfg.score_scale();
    let (mut keys, mut values) = (vec![0.0; n * hd], vec![0.0; n * hd]);
    let mut all_probs = Vec::new();
    for h in 0..cfg.n_kv_heads {
        layer.gather_head(h, &mut keys, &mut values);
        if layer.config().keys_pre_rope() {
            for (i, key) in keys.chunks_exact_mut(hd).enumerate() {
                if rotated {
                    hadamard::rotate(key);
                }
                let at = match mode {
                    PositionsMode::Cache => i,
                    PositionsMode::Original => layer.position(i),
                };
                rope.cos_sin(at, &mut cos, &mut sin);
                rotate(key, &cos, &sin);
            }
        }
        for j in 0..group {
            let qh = &qr[(h * group + j) * hd..(h * group + j + 1) * hd];
            let mut scores: Vec<f32> = (0..n)
                .map(|i| match cfg.sliding_window {
                    Some(w) if pos.saturating_sub(layer.position(i)) >= w => f32::NEG_INFINITY,
                    _ => crate::ops::simd::dot(qh, &keys[i * hd..(i + 1) * hd]) * score_scale,
                })
                .collect();
            softmax(&mut scores);
            let o = &mut out[(h * group + j) * hd..(h * group + j + 1) * hd];
            o.fill(0.0);
            for (&p, row) in scores.iter().zip(values.chunks_exact(hd)) {
                if p != 0.0 {
                    crate::ops::simd::axpy(p, row, o);
                }
            }
            if rotated {
                hadamard::rotate(o);
            }
            all_probs.extend_from_slice(&scores);
        }
    }
    if let Some(p) = probs_out {
        *p = all_probs;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::{KeyRope, KvConfig, KvRotation, Precision};
    use proptest::prelude::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use tinygpt_reference::kv_cache::LayerCache;

    /// Fused attention vs the unfused (dequantise-then-dot) twin, and vs the reference:
    /// max |a − b| over outputs and softmax weights, relative to the vector's largest
    /// magnitude (at least 1). Folding the scales changes the summation order, so the
    /// fused path and its unfused twin are not bit-equal; the observed worst case over the
    /// sweep below is printed (about 2e-6 when written). The reference computes the
    /// `portable` kernels' order (`tinygpt_reference::order`): under
    /// `TINYGPT_KV_KERNEL=portable` it is bit-identical (checked below); the other KIVI
    /// kernels add in other orders, hence the budget (same value as tests/kv_cache.rs's
    /// `ENGINE_VS_REFERENCE`).
    const FUSED_VS_UNFUSED: f32 = 1e-5;
    const ENGINE_VS_REFERENCE: f32 = 3e-5;

    fn test_config(n_heads: usize, n_kv_heads: usize, hd: usize, sliding: Option<usize>) -> Config {
        Config {
            vocab_size: 8,
            hidden_size: n_heads * hd,
            n_layers: 1,
            n_heads,
            n_kv_heads,
            head_dim: hd,
            intermediate_size: 8,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: tinygpt_reference::RopeScaling::None,
            max_position_embeddings: 4096,
            tie_word_embeddings: true,
            sliding_window: sliding,
            layer_types: vec![],
            num_kv_shared_layers: 0,
            attention_bias: false,
            qk_norm: false,
            gemma: Default::default(),
            bos_token_id: None,
            eos_token_ids: vec![],
        }
    }

    fn max_rel_err(got: &[f32], want: &[f32]) -> f32 {
        assert_eq!(got.len(), want.len());
        let scale = want.iter().fold(1.0f32, |m, x| m.max(x.abs()));
        got.iter()
            .zip(want)
            .map(|(a, b)| if a == b { 0.0 } else { (a - b).abs() / scale })
            .fold(0.0, f32::max)
    }

    /// One differential case; `Debug` prints every parameter on failure.
    #[derive(Debug, Clone)]
    struct Case {
        precision: Precision,
        /// V's precision when it differs from `precision`
        v_precision: Option<Precision>,
        residual: usize,
        key_rope: KeyRope,
        positions: PositionsMode,
        head_dim: usize,
        n_kv_heads: usize,
        /// query heads per KV head (GQA)
        group: usize,
        group_size: usize,
        sink: usize,
        window: Option<usize>,
        sliding_window: Option<usize>,
        steps: usize,
        seed: u64,
        rotation: KvRotation,
    }

    /// [`score_rows`] over random cuts of every KV head's rows (any length, not only the
    /// team's multiples of 16), then [`mix_query_heads`] over random runs of each KV
    /// head's query heads: the output and the weights, `(n_heads, stored)`, of a prepared
    /// step.
    fn split_attend(
        cfg: &Config,
        rope: &RopeTable,
        layer: &LayerKv,
        tables: &StepTables,
        rng: &mut ChaCha8Rng,
    ) -> (Vec<f32>, Vec<f32>) {
        let (hd, group, n) = (cfg.head_dim, cfg.group(), layer.len());
        let mut probs = vec![f32::NAN; cfg.n_heads * n];
        let mut out = vec![f32::NAN; cfg.q_dim()];
        let mut hs = HeadScratch::default();
        for h in 0..cfg.n_kv_heads {
            let head = &mut probs[h * group * n..(h + 1) * group * n];
            let mut lo = 0;
            while lo < n {
                let hi = (lo + rng.gen_range(1..=9)).min(n);
                let len = hi - lo;
                let mut part = vec![0.0f32; group * len];
                score_rows(cfg, rope, layer, tables, h, lo..hi, &mut hs, &mut part, len);
                for j in 0..group {
                    head[j * n + lo..j * n + hi].copy_from_slice(&part[j * len..(j + 1) * len]);
                }
                lo = hi;
            }
            let mut j = 0;
            while j < group {
                let k = rng.gen_range(1..=group - j);
                let (q0, q1) = (h * group + j, h * group + j + k);
                let o = &mut out[q0 * hd..q1 * hd];
                let p = &mut head[j * n..(j + k) * n];
                mix_query_heads(cfg, rope, layer, tables, h, p, o);
                j += k;
            }
        }
        (out, probs)
    }

    /// Runs fused, unfused and reference side by side, comparing after every step (so
    /// every T from 1 to `steps`: T = G − 1, G, G + 1 after the prefix, the window's
    /// fill and every ring wrap are all visited). Returns the worst (fused vs unfused,
    /// fused vs reference) errors.
    fn run_case(c: &Case) -> (f32, f32) {
        let n_heads = c.n_kv_heads * c.group;
        let cfg = test_config(n_heads, c.n_kv_heads, c.head_dim, c.sliding_window);
        let kv = KvConfig {
            precision: c.precision,
            v_precision: c.v_precision,
            residual: c.residual,
            key_rope: c.key_rope,
            group_size: c.group_size,
            sink: c.sink,
            window: c.window,
            positions: c.positions,
            rotation: c.rotation,
            ..KvConfig::default()
        };
        crate::kv_cache::validate(&kv, &cfg).unwrap_or_else(|e| panic!("{c:?}: {e}"));
        let rope = RopeTable::new(&cfg);
        let ref_rope = tinygpt_reference::rope::Rope::new(&cfg);
        let mut layer = LayerKv::new(&kv, c.n_kv_heads, c.head_dim);
        let mut reference = LayerCache::new(&kv, c.n_kv_heads, c.head_dim);
        let mut scratch = AttnScratch::new(&cfg, &kv);
        let mut rng = ChaCha8Rng::seed_from_u64(c.seed);
        let mut cuts = ChaCha8Rng::seed_from_u64(c.seed ^ 0x5eed);
        let kv_dim = cfg.kv_dim();
        // Per-channel K offsets and one outlier channel, as real K has.
        let mut k_bias: Vec<f32> = (0..kv_dim).map(|_| rng.gen_range(-2.0..2.0)).collect();
        k_bias[kv_dim / 3] = 12.0;
        let (mut out_f, mut out_u, mut out_r) = (
            vec![0.0; cfg.q_dim()],
            vec![0.0; cfg.q_dim()],
            vec![0.0; cfg.q_dim()],
        );
        let (mut p_f, mut p_u, mut p_r) = (Vec::new(), Vec::new(), Vec::new());
        let (mut worst_u, mut worst_r) = (0.0f32, 0.0f32);
        for pos in 0..c.steps {
            let q: Vec<f32> = (0..cfg.q_dim()).map(|_| rng.gen_range(-1.5..1.5)).collect();
            let k: Vec<f32> = k_bias
                .iter()
                .map(|b| b + rng.gen_range(-1.0..1.0))
                .collect();
            let v: Vec<f32> = (0..kv_dim).map(|_| rng.gen_range(-2.0..2.0)).collect();
            append_kv(&cfg, &rope, &mut layer, &k, &v, pos, scratch.split_mut().0);
            attend_stored(
                &cfg,
                &rope,
                &layer,
                &q,
                pos,
                &mut out_f,
                &mut scratch,
                Some(&mut p_f),
            );
            // The split path (a decode team's): scores in random row ranges, then each
            // query head alone — bit for bit the whole-head path.
            let (out_s, p_s) = split_attend(&cfg, &rope, &layer, scratch.split_mut().0, &mut cuts);
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&out_s), bits(&out_f), "{c:?} pos={pos}: split output");
            assert_eq!(bits(&p_s), bits(&p_f), "{c:?} pos={pos}: split weights");
            attend_stored_dequant(&cfg, &rope, &layer, &q, pos, &mut out_u, Some(&mut p_u));
            tinygpt_reference::attention::attend(
                &cfg,
                &ref_rope,
                &mut reference,
                &q,
                &k,
                &v,
                pos,
                &mut out_r,
                Some(&mut p_r),
            );
            assert_eq!(p_f.len(), n_heads * layer.len(), "{c:?} pos={pos}");
            assert!(
                out_f.iter().all(|x| x.is_finite()),
                "{c:?} pos={pos}: non-finite"
            );
            if crate::kivi::kv_kernel() == crate::kivi::KvKernel::Portable {
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&out_f), bits(&out_r), "{c:?} pos={pos}: output");
                assert_eq!(bits(&p_f), bits(&p_r), "{c:?} pos={pos}: weights");
            }
            let eu = max_rel_err(&out_f, &out_u).max(max_rel_err(&p_f, &p_u));
            let er = max_rel_err(&out_f, &out_r).max(max_rel_err(&p_f, &p_r));
            assert!(
                eu <= FUSED_VS_UNFUSED,
                "{c:?} pos={pos}: fused vs unfused {eu}"
            );
            assert!(
                er <= ENGINE_VS_REFERENCE,
                "{c:?} pos={pos}: fused vs reference {er}"
            );
            worst_u = worst_u.max(eu);
            worst_r = worst_r.max(er);
        }
        (worst_u, worst_r)
    }

    /// Every precision × positions mode × head dim (odd multiples of 2 and the
    /// specialised 32/64) × GQA group, over shapes placed around group and window
    /// boundaries.
    #[test]
    fn fused_matches_unfused_and_reference_on_sweep() {
        // (group_size, sink, window, sliding_window, steps)
        type Shape = (usize, usize, Option<usize>, Option<usize>, usize);
        let shapes: &[Shape] = &[
            (4, 0, None, None, 4 + 2 * 4 + 2), // T = 1 .. P + 2G + 2
            (3, 2, Some(5), None, 30),         // ring wraps mid-group
            (8, 0, Some(8), None, 30),         // window = G
            (32, 4, Some(40), None, 90),       // default G; long runs, 8-row blocks
            (4, 2, Some(9), Some(5), 24),      // Mistral sliding window
        ];
        let (mut worst_u, mut worst_r) = (0.0f32, 0.0f32);
        let mut seed = 7;
        // (K precision, V override, residual, key_rope): every precision, asymmetric pairs,
        // residuals and pre-RoPE keys.
        let mut sides: Vec<(Precision, Option<Precision>, usize, KeyRope)> = Precision::ALL
            .iter()
            .map(|&p| (p, None, 0, KeyRope::Post))
            .collect();
        sides.extend([
            (Precision::Int8, Some(Precision::Int4), 0, KeyRope::Post),
            (Precision::Int4, Some(Precision::Int2), 5, KeyRope::Post),
            (Precision::Fp16, Some(Precision::Int4), 3, KeyRope::Post),
            (Precision::Int2, None, 6, KeyRope::Pre),
            (Precision::Int4, None, 0, KeyRope::Pre),
            (Precision::Bf16, None, 0, KeyRope::Pre),
        ]);
        for (precision, v_precision, residual, key_rope) in sides {
            for positions in [PositionsMode::Original, PositionsMode::Cache] {
                for head_dim in [2usize, 6, 18, 32, 34, 64] {
                    let int2 = [Some(precision), v_precision].contains(&Some(Precision::Int2));
                    if int2 && head_dim % 4 != 0 {
                        continue;
                    }
                    for group in [1usize, 2, 3] {
                        for &(group_size, sink, window, sliding_window, steps) in shapes {
                            seed += 1;
                            let (u, r) = run_case(&Case {
                                precision,
                                v_precision,
                                residual,
                                key_rope,
                                positions,
                                head_dim,
                                n_kv_heads: 2,
                                group,
                                group_size,
                                sink,
                                window,
                                sliding_window,
                                steps,
                                seed,
                                // every other power-of-two case rotated (§2.5)
                                rotation: if head_dim.is_power_of_two() && seed % 2 == 0 {
                                    KvRotation::Hadamard
                                } else {
                                    KvRotation::None
                                },
                            });
                            worst_u = worst_u.max(u);
                            worst_r = worst_r.max(r);
                        }
                    }
                }
            }
        }
        eprintln!(
            "worst relative error: fused vs unfused {worst_u:e}, fused vs reference {worst_r:e}"
        );
    }

    fn case_strategy() -> impl Strategy<Value = Case> {
        (
            (
                prop::sample::select(Precision::ALL.to_vec()),
                any::<bool>(),
                prop::sample::select(vec![2usize, 4, 6, 10, 16, 18, 32, 34, 48, 64, 66, 128]),
                1usize..4,
                1usize..4,
            ),
            (
                1usize..12,
                0usize..6,
                prop::option::of(1usize..14),
                prop::option::weighted(0.2, 1usize..8),
                1usize..45,
                any::<u64>(),
            ),
            (
                prop::option::weighted(0.3, prop::sample::select(Precision::ALL.to_vec())),
                prop::sample::select(vec![0usize, 0, 1, 2, 5, 9, 20]),
                any::<bool>(),
                any::<bool>(),
            ),
        )
            .prop_map(
                |(
                    (precision, cache, head_dim, n_kv_heads, group),
                    (g, sink, window, sliding, steps, seed),
                    (v_precision, residual, pre, rot),
                )| Case {
                    precision,
                    v_precision,
                    residual,
                    key_rope: if pre { KeyRope::Pre } else { KeyRope::Post },
                    positions: if cache {
                        PositionsMode::Cache
                    } else {
                        PositionsMode::Original
                    },
                    // int2 needs head_dim a multiple of 4
                    head_dim: if [Some(precision), v_precision].contains(&Some(Precision::Int2)) {
                        head_dim.div_ceil(4) * 4
                    } else {
                        head_dim
                    },
                    n_kv_heads,
                    group,
                    group_size: g,
                    sink: if window.is_some() { sink } else { 0 },
                    window,
                    sliding_window: sliding,
                    steps,
                    seed,
                    rotation: if rot && head_dim.is_power_of_two() {
                        KvRotation::Hadamard
                    } else {
                        KvRotation::None
                    },
                },
            )
    }

    proptest! {
        #![proptest_config(ProptestConfig {
            cases: 96,
            failure_persistence: None,
            rng_algorithm: proptest::test_runner::RngAlgorithm::ChaCha,
            ..ProptestConfig::default()
        })]

        /// Random shapes, caches and GQA groups: fused = unfused = reference within budget.
        #[test]
        fn fused_matches_unfused_and_reference_on_random_cases(c in case_strategy()) {
            run_case(&c);
        }
    }

    /// The engine's vectorised softmax against the reference's scalar one: every weight
    /// within 2e-6 relative (`wide`'s `exp` is within a few ulp of libm's), masked (−inf)
    /// entries exactly 0, ties at ±0, spreads wide enough to underflow, lengths around
    /// the 8-lane boundaries.
    #[test]
    fn softmax_matches_reference() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        for n in [1usize, 2, 7, 8, 9, 15, 16, 17, 33, 100, 1000] {
            for case in 0..5 {
                let mut x: Vec<f32> = (0..n).map(|_| rng.gen_range(-20.0..20.0)).collect();
                match case {
                    1 => x.iter_mut().step_by(3).for_each(|v| *v = f32::NEG_INFINITY),
                    2 => {
                        x.iter_mut().for_each(|v| *v = -v.abs());
                        x[n / 2] = -0.0;
                        x[n - 1] = 0.0;
                    }
                    3 => x.iter_mut().for_each(|v| *v *= 1e-3),
                    4 => x.iter_mut().for_each(|v| *v *= 10.0),
                    _ => {}
                }
                if x.iter().all(|v| *v == f32::NEG_INFINITY) {
                    x[0] = 1.0;
                }
                let masked: Vec<bool> = x.iter().map(|v| *v == f32::NEG_INFINITY).collect();
                let (mut a, mut b) = (x.clone(), x);
                softmax(&mut a);
                tinygpt_reference::attention::softmax(&mut b);
                for i in 0..n {
                    if masked[i] {
                        assert_eq!(a[i], 0.0, "n={n} case={case} i={i}: masked entry");
                    }
                    let tol = 2e-6 * b[i] + 1e-37;
                    assert!(
                        (a[i] - b[i]).abs() <= tol,
                        "n={n} case={case} i={i}: {} vs {}",
                        a[i],
                        b[i]
                    );
                }
                let total: f32 = a.iter().sum();
                assert!((total - 1.0).abs() < 1e-5, "n={n} case={case}: sum {total}");
            }
        }
    }

    /// The block scorer against per-row dots, full and partial blocks, odd head dims.
    #[test]
    fn dot_block_matches_per_row_dots() {
        for hd in [2usize, 6, 8, 18, 32, 34, 64] {
            for m in 1..=BLOCK {
                let q: Vec<f32> = (0..hd).map(|i| (i as f32 * 0.37).sin()).collect();
                let rows: Vec<f32> = (0..m * hd).map(|i| (i as f32 * 0.11).cos() * 4.0).collect();
                let mut out = vec![0.0f32; m];
                dot_block(&q, &rows, &mut out);
                for r in 0..m {
                    let row = &rows[r * hd..(r + 1) * hd];
                    let want: f64 = q.iter().zip(row).map(|(a, b)| *a as f64 * *b as f64).sum();
                    let mag: f64 = q
                        .iter()
                        .zip(row)
                        .map(|(a, b)| (*a as f64 * *b as f64).abs())
                        .sum();
                    assert!(
                        (out[r] as f64 - want).abs() <= 1e-6 * mag.max(1.0),
                        "hd={hd} m={m} r={r}: {} vs {want}",
                        out[r]
                    );
                }
            }
        }
    }

    #[test]
    fn rotate_dot_block_matches_rotate_then_dot() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        for hd in [16usize, 32, 64, 96, 128, 256] {
            let half = hd / 2;
            for nq in 1..=9 {
                let stride = BLOCK + 3;
                let qs: Vec<f32> = (0..nq * hd).map(|_| rng.gen_range(-3.0..3.0)).collect();
                let mut rows: Vec<f32> =
                    (0..BLOCK * hd).map(|_| rng.gen_range(-8.0..8.0)).collect();
                // an extreme row and a constant one
                rows[..hd].fill(65504.0);
                rows[hd..2 * hd].fill(0.0);
                let angles: Vec<f32> = (0..BLOCK * half)
                    .map(|_| rng.gen_range(-7.0..7.0))
                    .collect();
                let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
                let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
                let mut full = vec![f32::NAN; nq * stride];
                rotate_dot_block(&qs, &rows, hd, (&cos, &sin), &mut full, stride);
                for (j, q) in qs.chunks_exact(hd).enumerate() {
                    for r in 0..BLOCK {
                        let mut row = rows[r * hd..(r + 1) * hd].to_vec();
                        rotate_inline(
                            &mut row,
                            &cos[r * half..(r + 1) * half],
                            &sin[r * half..(r + 1) * half],
                        );
                        let want: f64 =
                            q.iter().zip(&row).map(|(a, b)| *a as f64 * *b as f64).sum();
                        let mag: f64 = q
                            .iter()
                            .zip(&row)
                            .map(|(a, b)| (*a as f64 * *b as f64).abs())
                            .sum();
                        let got = full[j * stride + r];
                        assert!(
                            (got as f64 - want).abs() <= 1e-6 * mag.max(1.0),
                            "hd={hd} queries={nq} j={j} r={r}: {got} vs {want}"
                        );
                    }
                    assert!(full[j * stride + BLOCK..(j + 1) * stride]
                        .iter()
                        .all(|x| x.is_nan()));
                }
                // The same rows cut into smaller blocks score bit for bit the same.
                for m in 1..BLOCK {
                    for r0 in (0..BLOCK).step_by(m) {
                        let k = m.min(BLOCK - r0);
                        let mut part = vec![0.0f32; nq * stride];
                        rotate_dot_block(
                            &qs,
                            &rows[r0 * hd..(r0 + k) * hd],
                            hd,
                            (&cos[r0 * half..], &sin[r0 * half..]),
                            &mut part,
                            stride,
                        );
                        for j in 0..nq {
                            for r in 0..k {
                                assert_eq!(
                                    part[j * stride + r].to_bits(),
                                    full[j * stride + r0 + r].to_bits(),
                                    "hd={hd} queries={nq} block {m} row {}",
                                    r0 + r
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn rotate_matches_reference_bitwise() {
        for hd in [2usize, 6, 16, 32, 34, 64] {
            let cfg = Config {
                vocab_size: 8,
                hidden_size: hd,
                n_layers: 1,
                n_heads: 1,
                n_kv_heads: 1,
                head_dim: hd,
                intermediate_size: 8,
                rms_norm_eps: 1e-5,
                rope_theta: 10000.0,
                rope_scaling: tinygpt_reference::RopeScaling::None,
                max_position_embeddings: 128,
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
            let table = RopeTable::new(&cfg);
            let r = tinygpt_reference::rope::Rope::new(&cfg);
            for pos in [0usize, 1, 7, 1000, 123_456] {
                let x: Vec<f32> = (0..2 * hd).map(|i| (i as f32 * 0.7).sin()).collect();
                let (mut a, mut b) = (x.clone(), x);
                table.rotate_heads(&mut a, pos);
                r.rotate_heads(&mut b, pos);
                let (ab, bb): (Vec<u32>, Vec<u32>) = (
                    a.iter().map(|v| v.to_bits()).collect(),
                    b.iter().map(|v| v.to_bits()).collect(),
                );
                assert_eq!(ab, bb, "hd={hd} pos={pos}");
            }
        }
    }
}
