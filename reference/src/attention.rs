//! One attention step for one layer and one token (the reference `attend`).

use crate::config::Config;
use crate::kv_cache::{LayerCache, PositionsMode};
use crate::rope::Rope;

/// Appends this token's K/V to `cache` and attends over what is stored afterwards.
///
/// * `q`: `(n_heads, head_dim)` before RoPE; `k`, `v`: `(n_kv_heads, head_dim)`, `k` before RoPE.
/// * `pos`: the token's absolute position.
/// * `out`: `(n_heads, head_dim)`, the attention output before `o_proj`.
/// * `probs_out`: if given, receives each head's softmax weights over the stored rows,
///   `(n_heads, stored)` (used by the sink report).
///
/// RoPE placement follows the cache's positions mode (docs/design.md §3) and, in `original`
/// mode, its `key_rope`: `post` stores keys rotated to their position; `pre` stores them
/// unrotated and rotates each stored key by its stored absolute position here.
#[allow(clippy::too_many_arguments)]
pub fn attend(
    cfg: &Config,
    rope: &Rope,
    cache: &mut LayerCache,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    pos: usize,
    out: &mut [f32],
    probs_out: Option<&mut Vec<f32>>,
) {
    let pre_rope = cache.config().keys_pre_rope();
    let mut k = k.to_vec();
    if !pre_rope {
        rope.rotate_heads(&mut k, pos);
    }
    cache.append(&k, v, pos);
    attend_cached(cfg, rope, cache, q, pos, out, probs_out);
}

/// The second half of [`attend`]: the query of the token at absolute position `pos`
/// attends over what `cache` stores, without appending. A YOCO shared layer calls this
/// alone, on the cache of the layer it reads.
pub fn attend_cached(
    cfg: &Config,
    rope: &Rope,
    cache: &LayerCache,
    q: &[f32],
    pos: usize,
    out: &mut [f32],
    mut probs_out: Option<&mut Vec<f32>>,
) {
    let hd = cfg.head_dim;
    let mode = cache.config().positions;
    let pre_rope = cache.config().keys_pre_rope();
    let n = cache.len();
    let mut q = q.to_vec();
    let q_pos = match mode {
        PositionsMode::Original => pos,
        PositionsMode::Cache => n - 1,
    };
    rope.rotate_heads(&mut q, q_pos);

    // Keys as attention sees them: rotated by slot in cache mode, by their stored
    // position for pre-RoPE keys in original mode.
    let mut keys: Vec<Vec<f32>> = Vec::with_capacity(n);
    for i in 0..n {
        let mut key = cache.key(i);
        match mode {
            PositionsMode::Cache => rope.rotate_heads(&mut key, i),
            PositionsMode::Original if pre_rope => rope.rotate_heads(&mut key, cache.position(i)),
            PositionsMode::Original => {}
        }
        keys.push(key);
    }
    let values: Vec<Vec<f32>> = (0..n).map(|i| cache.value(i)).collect();
    // Mistral sliding window: a key is visible if pos - key_pos < sliding_window.
    let visible: Vec<bool> = (0..n)
        .map(|i| match cfg.sliding_window {
            Some(w) => pos - cache.position(i) < w,
            None => true,
        })
        .collect();

    if let Some(p) = probs_out.as_deref_mut() {
        p.clear();
    }
    let scale = 1.0 / (hd as f32).sqrt();
    for h in 0..cfg.n_heads {
        let kvh = h / cfg.group();
        let qh = &q[h * hd..(h + 1) * hd];
        let mut scores = vec![f32::NEG_INFINITY; n];
        for i in 0..n {
            if !visible[i] {
                continue;
            }
            let kh = &keys[i][kvh * hd..(kvh + 1) * hd];
            let mut dot = 0.0f32;
            for d in 0..hd {
                dot += qh[d] * kh[d];
            }
            scores[i] = dot * scale;
        }
        softmax(&mut scores);
        let oh = &mut out[h * hd..(h + 1) * hd];
        oh.iter_mut().for_each(|x| *x = 0.0);
        for i in 0..n {
            let vh = &values[i][kvh * hd..(kvh + 1) * hd];
            for d in 0..hd {
                oh[d] += scores[i] * vh[d];
            }
        }
        if let Some(p) = probs_out.as_deref_mut() {
            p.extend_from_slice(&scores);
        }
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
