//! One attention step for one layer and one token (the reference `attend`).
//!
//! Shapes: a query is `(n_heads, head_dim)`, a key or value `(n_kv_heads, head_dim)`, and
//! what the cache holds, as attention reads it, `(stored, n_kv_heads, head_dim)`. Query head
//! `h` reads key/value head `h / group` (GQA).

use crate::config::Config;
use crate::kv_cache::{LayerCache, PositionsMode};
use crate::rope::Rope;
use ndarray::{Array1, Array3, ArrayView2, ArrayViewMut1, ArrayViewMut2, Axis};

/// Appends this token's K/V to `cache` and attends over what is stored afterwards.
///
/// * `q`: `(n_heads, head_dim)` before RoPE; `k`, `v`: `(n_kv_heads, head_dim)`, `k` before RoPE.
/// * `pos`: the token's absolute position.
/// * `out`: `(n_heads, head_dim)`, the attention output before `o_proj`.
/// * `probs_out`: if given, receives each head's softmax weights over the stored rows,
///   `(n_heads, stored)` row-major (used by the sink report).
///
/// RoPE placement follows the cache's positions mode (docs/design.md §3) and, in `original`
/// mode, its `key_rope`: `post` stores keys rotated to their position; `pre` stores them
/// unrotated and rotates each stored key by its stored absolute position here.
#[allow(clippy::too_many_arguments)]
pub fn attend_heads(
    cfg: &Config,
    rope: &Rope,
    cache: &mut LayerCache,
    q: ArrayView2<f32>,
    k: ArrayView2<f32>,
    v: ArrayView2<f32>,
    pos: usize,
    out: ArrayViewMut2<f32>,
    probs_out: Option<&mut Vec<f32>>,
) {
    let mut k = k.to_owned();
    if !cache.config().keys_pre_rope() {
        rope.rotate_rows(k.view_mut(), pos);
    }
    // The cache stores rows flat, `n_kv_heads · head_dim` values in row-major order.
    cache.append(&k.flatten().to_vec(), &v.flatten().to_vec(), pos);
    attend_cached(cfg, rope, cache, q, pos, out, probs_out);
}

/// [`attend_heads`] for callers that hold flat slices: `q` and `out` are
/// `n_heads · head_dim` values, `k` and `v` `n_kv_heads · head_dim`, heads concatenated.
///
/// # Panics
/// If a slice's length does not match the config.
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
    let (q_heads, kv_heads) = ((cfg.n_heads, cfg.head_dim), (cfg.n_kv_heads, cfg.head_dim));
    let q = ArrayView2::from_shape(q_heads, q).expect("q is (n_heads, head_dim)");
    let k = ArrayView2::from_shape(kv_heads, k).expect("k is (n_kv_heads, head_dim)");
    let v = ArrayView2::from_shape(kv_heads, v).expect("v is (n_kv_heads, head_dim)");
    let out = ArrayViewMut2::from_shape(q_heads, out).expect("out is (n_heads, head_dim)");
    attend_heads(cfg, rope, cache, q, k, v, pos, out, probs_out);
}

/// The second half of [`attend_heads`]: the query `(n_heads, head_dim)` of the token at
/// absolute position `pos` attends over what `cache` stores, without appending, into
/// `out`, `(n_heads, head_dim)`. A YOCO shared layer calls this alone, on the cache of the
/// layer it reads.
pub fn attend_cached(
    cfg: &Config,
    rope: &Rope,
    cache: &LayerCache,
    q: ArrayView2<f32>,
    pos: usize,
    mut out: ArrayViewMut2<f32>,
    mut probs_out: Option<&mut Vec<f32>>,
) {
    let hd = cfg.head_dim;
    let mode = cache.config().positions;
    let pre_rope = cache.config().keys_pre_rope();
    let n = cache.len();
    let mut q = q.to_owned();
    let q_pos = match mode {
        PositionsMode::Original => pos,
        PositionsMode::Cache => n - 1,
    };
    rope.rotate_rows(q.view_mut(), q_pos);

    // Keys as attention sees them, `(stored, n_kv_heads, head_dim)`: rotated by slot in
    // cache mode, by their stored position for pre-RoPE keys in original mode.
    let mut keys = Array3::<f32>::zeros((n, cfg.n_kv_heads, hd));
    let mut values = Array3::<f32>::zeros((n, cfg.n_kv_heads, hd));
    for i in 0..n {
        let mut key = keys.index_axis_mut(Axis(0), i);
        copy_row(&cache.key(i), key.view_mut());
        match mode {
            PositionsMode::Cache => rope.rotate_rows(key, i),
            PositionsMode::Original if pre_rope => rope.rotate_rows(key, cache.position(i)),
            PositionsMode::Original => {}
        }
        copy_row(&cache.value(i), values.index_axis_mut(Axis(0), i));
    }
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
        let mut scores = Array1::from_elem(n, f32::NEG_INFINITY);
        for i in 0..n {
            if !visible[i] {
                continue;
            }
            let mut dot = 0.0f32;
            for d in 0..hd {
                dot += q[[h, d]] * keys[[i, kvh, d]];
            }
            scores[i] = dot * scale;
        }
        softmax(scores.view_mut());
        for d in 0..hd {
            out[[h, d]] = 0.0;
        }
        for i in 0..n {
            for d in 0..hd {
                out[[h, d]] += scores[i] * values[[i, kvh, d]];
            }
        }
        if let Some(p) = probs_out.as_deref_mut() {
            p.extend(scores.iter());
        }
    }
}

/// Copies one cache row (`n_kv_heads · head_dim` values, heads concatenated) into its
/// `(n_kv_heads, head_dim)` place.
fn copy_row(row: &[f32], mut dst: ArrayViewMut2<f32>) {
    assert_eq!(
        row.len(),
        dst.len(),
        "a cache row is (n_kv_heads, head_dim)"
    );
    for (d, &r) in dst.iter_mut().zip(row) {
        *d = r;
    }
}

/// In-place softmax with max subtraction; entries of `-inf` get weight 0.
///
/// Takes anything that views as a mutable 1-D array (`&mut Vec<f32>`, `&mut [f32]`, an
/// [`ArrayViewMut1`]).
pub fn softmax<'a>(x: impl Into<ArrayViewMut1<'a, f32>>) {
    let mut x = x.into();
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
