//! One attention step for one layer and one token: the engine twin of
//! `tinygpt_reference::attention::attend`, with the same contract.
//!
//! Per KV head, the stored rows are dequantised (and in `cache` positions mode rotated by
//! their slot) into a small per-head scratch, `(stored, head_dim)`, then every query head
//! of the GQA group scores, softmaxes and mixes them. KV heads are independent, so they
//! run on rayon when the step is large enough to pay for it; nothing reduces across
//! threads, so results do not depend on the thread count.
//!
//! RoPE uses [`RopeTable`], whose cos/sin are computed exactly as the reference computes
//! them (`angle = pos as f32 * inv_freq[i]`, then `angle.cos()`, `angle.sin()`), so rotated
//! keys are bit-identical to the reference's.

use crate::config::Config;
use crate::kv_cache::{KvConfig, LayerKv, PositionsMode};
use rayon::prelude::*;
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
            inv_freq: cfg.rope_inv_freq(),
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
        for head in x.chunks_exact_mut(2 * half) {
            rotate(head, cos, sin);
        }
    }
}

/// Rotates one head by precomputed cos/sin: `(x1, x2) → (x1·c − x2·s, x2·c + x1·s)`.
#[inline]
pub fn rotate(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    debug_assert_eq!(x.len(), 2 * half);
    let (a, b) = x.split_at_mut(half);
    let mut i = 0;
    while i + 8 <= half {
        let x1 = load(&a[i..]);
        let x2 = load(&b[i..]);
        let c = load(&cos[i..]);
        let s = load(&sin[i..]);
        store(&mut a[i..], x1 * c - x2 * s);
        store(&mut b[i..], x2 * c + x1 * s);
        i += 8;
    }
    for j in i..half {
        let (x1, x2) = (a[j], b[j]);
        a[j] = x1 * cos[j] - x2 * sin[j];
        b[j] = x2 * cos[j] + x1 * sin[j];
    }
}

#[inline(always)]
fn load(x: &[f32]) -> f32x8 {
    let a: [f32; 8] = x[..8].try_into().expect("8 lanes");
    f32x8::from(a)
}

#[inline(always)]
fn store(x: &mut [f32], v: f32x8) {
    x[..8].copy_from_slice(&v.to_array());
}

/// `Σ a[i]·b[i]` (f32x8 lanes, then a scalar tail).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let n = a.len();
    let mut acc = f32x8::ZERO;
    let mut i = 0;
    while i + 8 <= n {
        acc += load(&a[i..]) * load(&b[i..]);
        i += 8;
    }
    let mut s = acc.reduce_add();
    for j in i..n {
        s += a[j] * b[j];
    }
    s
}

/// `y += alpha · x` (f32x8 lanes, then a scalar tail).
#[inline]
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    debug_assert_eq!(x.len(), y.len());
    let n = x.len();
    let av = f32x8::splat(alpha);
    let mut i = 0;
    while i + 8 <= n {
        let r = load(&y[i..]) + av * load(&x[i..]);
        store(&mut y[i..], r);
        i += 8;
    }
    for j in i..n {
        y[j] += alpha * x[j];
    }
}

/// In-place softmax with max subtraction; entries of `-inf` get weight 0.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// Per-KV-head working memory.
#[derive(Debug, Clone, Default)]
struct HeadScratch {
    /// (stored, head_dim) keys as attention sees them (dequantised, rotated)
    keys: Vec<f32>,
    /// (stored, head_dim)
    values: Vec<f32>,
    /// (group, stored) softmax weights of this KV head's query heads
    probs: Vec<f32>,
    /// (2, head_dim) a K group's f32 scale and zero
    params: Vec<f32>,
}

/// Reusable buffers for [`attend`]; one per sequence (or per thread driving one).
#[derive(Debug, Clone)]
pub struct AttnScratch {
    /// (n_heads, head_dim) rotated query
    q: Vec<f32>,
    /// (n_kv_heads, head_dim) key as appended
    k: Vec<f32>,
    /// (stored) Mistral sliding-window visibility
    visible: Vec<bool>,
    /// (slots, head_dim / 2) cos/sin per cache slot, for `cache` positions mode
    slot_cos: Vec<f32>,
    slot_sin: Vec<f32>,
    heads: Vec<HeadScratch>,
}

impl AttnScratch {
    pub fn new(cfg: &Config, kv: &KvConfig) -> Self {
        let _ = kv;
        AttnScratch {
            q: vec![0.0; cfg.q_dim()],
            k: vec![0.0; cfg.kv_dim()],
            visible: Vec::new(),
            slot_cos: Vec::new(),
            slot_sin: Vec::new(),
            heads: vec![HeadScratch::default(); cfg.n_kv_heads],
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
}

/// Appends this token's K/V to `layer` and attends over what is stored afterwards.
///
/// * `q`: `(n_heads, head_dim)` before RoPE; `k`, `v`: `(n_kv_heads, head_dim)`, `k`
///   before RoPE. `pos`: the token's absolute position.
/// * `out`: `(n_heads, head_dim)`, the attention output before `o_proj`.
/// * `probs_out`: if given, receives each head's softmax weights over the stored rows,
///   `(n_heads, stored)`.
///
/// RoPE placement follows the cache's positions mode (DESIGN.md §3); Mistral's
/// `sliding_window` hides keys with `pos − key_pos ≥ sliding_window`.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    cfg: &Config,
    rope: &RopeTable,
    layer: &mut LayerKv,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    pos: usize,
    out: &mut [f32],
    scratch: &mut AttnScratch,
    probs_out: Option<&mut Vec<f32>>,
) {
    append_kv(cfg, rope, layer, k, v, pos, scratch);
    attend_stored(cfg, rope, layer, q, pos, out, scratch, probs_out);
}

/// The first half of [`attend`]: rotates `k` (`original` positions mode) and appends
/// this token's K/V, evicting per the policy.
pub fn append_kv(
    cfg: &Config,
    rope: &RopeTable,
    layer: &mut LayerKv,
    k: &[f32],
    v: &[f32],
    pos: usize,
    scratch: &mut AttnScratch,
) {
    debug_assert_eq!(k.len(), cfg.kv_dim());
    debug_assert_eq!(v.len(), cfg.kv_dim());
    debug_assert_eq!(layer.kv_heads(), cfg.n_kv_heads);
    debug_assert_eq!(layer.head_dim(), cfg.head_dim);
    scratch.k.copy_from_slice(k);
    if layer.config().positions == PositionsMode::Original {
        rope.rotate_heads(&mut scratch.k, pos);
    }
    layer.append(&scratch.k, v, pos);
}

/// The second half of [`attend`]: the query of the token at absolute position `pos`
/// (already appended) attends over the stored rows without changing the cache. Layers
/// that read another layer's K/V (YOCO-style cross-decoders) call this alone.
#[allow(clippy::too_many_arguments)]
pub fn attend_stored(
    cfg: &Config,
    rope: &RopeTable,
    layer: &LayerKv,
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
    let mode = layer.config().positions;

    let n = layer.len();
    scratch.q.copy_from_slice(q);
    let q_pos = match mode {
        PositionsMode::Original => pos,
        PositionsMode::Cache => n - 1,
    };
    rope.rotate_heads(&mut scratch.q, q_pos);
    if mode == PositionsMode::Cache {
        scratch.ensure_slots(rope, n);
    }
    scratch.visible.clear();
    scratch
        .visible
        .extend((0..n).map(|i| match cfg.sliding_window {
            Some(w) => pos.saturating_sub(layer.position(i)) < w,
            None => true,
        }));

    let AttnScratch {
        q: qr,
        visible,
        slot_cos,
        slot_sin,
        heads,
        ..
    } = scratch;
    let half = rope.half();
    let slots = (mode == PositionsMode::Cache).then_some((&slot_cos[..], &slot_sin[..]));
    let score_scale = 1.0 / (hd as f32).sqrt();

    let work = |(h, (hs, oh)): (usize, (&mut HeadScratch, &mut [f32]))| {
        hs.keys.resize(n * hd, 0.0);
        hs.values.resize(n * hd, 0.0);
        hs.probs.resize(group * n, 0.0);
        layer.gather_head(h, &mut hs.keys, &mut hs.values, &mut hs.params);
        if let Some((c, s)) = slots {
            for (i, key) in hs.keys.chunks_exact_mut(hd).enumerate() {
                rotate(
                    key,
                    &c[i * half..(i + 1) * half],
                    &s[i * half..(i + 1) * half],
                );
            }
        }
        for j in 0..group {
            let qh = &qr[(h * group + j) * hd..(h * group + j + 1) * hd];
            let scores = &mut hs.probs[j * n..(j + 1) * n];
            for i in 0..n {
                scores[i] = if visible[i] {
                    dot(qh, &hs.keys[i * hd..(i + 1) * hd]) * score_scale
                } else {
                    f32::NEG_INFINITY
                };
            }
            softmax(scores);
            let o = &mut oh[j * hd..(j + 1) * hd];
            o.fill(0.0);
            for (&p, row) in scores.iter().zip(hs.values.chunks_exact(hd)) {
                if p != 0.0 {
                    axpy(p, row, o);
                }
            }
        }
    };

    let parallel = cfg.n_kv_heads > 1
        && n * cfg.n_heads * hd >= PARALLEL_MIN_WORK
        && rayon::current_num_threads() > 1;
    let chunks = out.chunks_mut(group * hd);
    if parallel {
        heads
            .par_iter_mut()
            .zip(out.par_chunks_mut(group * hd))
            .enumerate()
            .for_each(work);
    } else {
        heads.iter_mut().zip(chunks).enumerate().for_each(work);
    }

    if let Some(p) = probs_out {
        p.clear();
        for hs in heads.iter() {
            p.extend_from_slice(&hs.probs[..group * n]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernels_match_scalar_at_odd_lengths() {
        for n in [1usize, 3, 7, 8, 9, 17, 33] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot(&a, &b) as f64 - want).abs() < 1e-5, "n={n}");
            let mut y = b.clone();
            axpy(0.5, &a, &mut y);
            for i in 0..n {
                assert_eq!(y[i], b[i] + 0.5 * a[i], "n={n} i={i}");
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
                attention_bias: false,
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
