//! One attention step for one layer and one token (the reference `attend`).
//!
//! Shapes: a query is `(n_heads, head_dim)`, a key or value `(n_kv_heads, head_dim)`, and
//! what the cache holds, as attention reads it, `(stored, n_kv_heads, head_dim)`. Query head
//! `h` reads key/value head `h / group` (GQA).

use crate::config::Config;
use crate::hadamard;
use crate::kv_cache::{LayerCache, PositionsMode};
use crate::order;
use crate::rope::Rope;
use ndarray::{Array1, Array3, ArrayView1, ArrayView2, ArrayViewMut1, ArrayViewMut2, Axis};

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
    let (mut k, mut v) = (k.flatten().to_vec(), v.flatten().to_vec());
    if cache.config().rotates(cfg.head_dim) {
        // Stored as H·k (after RoPE) and H·v, head by head.
        hadamard::rotate_heads(&mut k, cfg.head_dim);
        hadamard::rotate_heads(&mut v, cfg.head_dim);
    }
    cache.append(&k, &v, pos);
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
    let rotated = cache.config().rotates(hd);
    if rotated && !pre_rope {
        // (H·q)·(H·k) = q·k: rotate each query head as the stored keys are.
        for mut qh in q.rows_mut() {
            let r = hadamard::rotate(&qh.to_vec());
            qh.assign(&ArrayView1::from(&r));
        }
    }

    // Keys as attention sees them, `(stored, n_kv_heads, head_dim)`: rotated by slot in
    // cache mode, by their stored position for pre-RoPE keys in original mode.
    let mut keys = Array3::<f32>::zeros((n, cfg.n_kv_heads, hd));
    let mut values = Array3::<f32>::zeros((n, cfg.n_kv_heads, hd));
    for i in 0..n {
        let mut key = keys.index_axis_mut(Axis(0), i);
        let mut stored = cache.key(i);
        if rotated && pre_rope {
            // Pre-RoPE keys were stored as H·k: undo the rotation (H·H = I), then RoPE.
            hadamard::rotate_heads(&mut stored, hd);
        }
        copy_row(&stored, key.view_mut());
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
    let scale = cfg.score_scale();
    // Keys rotated at read time are scored in the order of the engine's fused
    // rotate-and-dot, the others in its order for stored rows (crate::order).
    let read_rotated = mode == PositionsMode::Cache || pre_rope;
    let score = if read_rotated {
        order::dot_score_pairs
    } else {
        order::dot_score
    };
    // KIVI rows as codes: a quantised key (stored after RoPE, so never rotated at read
    // time) is scored with its group's scales folded into the query, a quantised value
    // accumulated from its codes (docs/design.md §2.3).
    let key_codes: Vec<_> = (0..n)
        .map(|i| cache.key_codes(i).filter(|_| !read_rotated))
        .collect();
    let value_codes: Vec<_> = (0..n).map(|i| cache.value_codes(i)).collect();
    for h in 0..cfg.n_heads {
        let kvh = h / cfg.group();
        let qh = q.row(h).to_vec();
        let ch = kvh * hd..(kvh + 1) * hd;
        let mut scores = Array1::from_elem(n, f32::NEG_INFINITY);
        for i in 0..n {
            if !visible[i] {
                continue;
            }
            scores[i] = match &key_codes[i] {
                Some((u, params)) => score_codes(&qh, &u[ch.clone()], &params[ch.clone()]),
                None => score(&qh, &head_row(&keys, i, kvh).to_vec()),
            } * scale;
        }
        softmax(scores.view_mut());
        let mut oh = out.row_mut(h);
        oh.fill(0.0);
        // Σ_i p_i z_i of the quantised values, added once at the end.
        let mut bias = 0.0f32;
        for i in 0..n {
            let p = scores[i];
            if p == 0.0 {
                continue;
            }
            // One multiply-add per element, row after row (order::axpy_term).
            match &value_codes[i] {
                Some((u, params)) => {
                    let (s, z) = (params[kvh].scale.to_f32(), params[kvh].zero.to_f32());
                    let ps = p * s;
                    for d in 0..hd {
                        oh[d] = order::axpy_term(u[ch.start + d] as f32, ps, oh[d], d, hd);
                    }
                    bias += p * z;
                }
                None => {
                    let vh = head_row(&values, i, kvh);
                    for d in 0..hd {
                        oh[d] = order::axpy_term(vh[d], p, oh[d], d, hd);
                    }
                }
            }
        }
        if bias != 0.0 {
            oh.iter_mut().for_each(|x| *x += bias);
        }
        if rotated {
            // The values were stored as H·v: Σ p_i H·v_i = H·o, and H·H = I.
            let r = hadamard::rotate(&oh.to_vec());
            oh.assign(&ArrayView1::from(&r));
        }
        if let Some(p) = probs_out.as_deref_mut() {
            p.extend(scores.iter());
        }
    }
}

/// The score `q · k` of a query head against a KIVI key row given as offset codes `u`
/// and per-channel parameters, with the scales folded into the query:
///
/// ```text
/// q · k = Σ_c (q_c s_c) u_c + Σ_c q_c z_c
/// ```
///
/// `q_c s_c` rounded to f32 (a plain multiply); the first sum in [`order::dot_score`]'s
/// order (codes as the key); the bias `Σ_c q_c z_c` in eight lanes of multiply-adds
/// reduced by [`order::reduce_add`], then the tail; the score is `first + bias`.
pub fn score_codes(q: &[f32], u: &[u8], params: &[crate::quant::Affine]) -> f32 {
    let n = q.len();
    let n8 = n - n % 8;
    let s: Vec<f32> = params.iter().map(|a| a.scale.to_f32()).collect();
    let z: Vec<f32> = params.iter().map(|a| a.zero.to_f32()).collect();
    let qs: Vec<f32> = (0..n).map(|c| q[c] * s[c]).collect();
    let mut lanes = [0.0f32; 8];
    for c in 0..n8 {
        lanes[c % 8] = order::madd(q[c], z[c], lanes[c % 8]);
    }
    let mut bias = order::reduce_add(lanes);
    for c in n8..n {
        bias += q[c] * z[c];
    }
    let u: Vec<f32> = u.iter().map(|&x| x as f32).collect();
    order::dot_score(&qs, &u) + bias
}

/// Head `head`'s `(head_dim)` row of token `t` in a `(tokens, heads, head_dim)` array:
/// `a[[t, head, ..]]`.
pub(crate) fn head_row(a: &Array3<f32>, t: usize, head: usize) -> ArrayView1<'_, f32> {
    a.index_axis(Axis(0), t).index_axis_move(Axis(0), head)
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
/// In the engine's order: `e_i = exp(x_i − max)` with [`order::exp`] (the vector `exp`)
/// for the first `n − n % 8` entries, summed in eight lanes (entry `i` into lane
/// `i mod 8`) reduced by [`order::reduce_add`], then the tail entries with `f32::exp`
/// added one by one; every weight is `e_i / sum`.
///
/// Takes anything that views as a mutable 1-D array (`&mut Vec<f32>`, `&mut [f32]`, an
/// [`ArrayViewMut1`]).
pub fn softmax<'a>(x: impl Into<ArrayViewMut1<'a, f32>>) {
    let mut x = x.into();
    let n = x.len();
    let n8 = n - n % 8;
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut lanes = [0.0f32; 8];
    for i in 0..n8 {
        x[i] = order::exp(x[i] - max);
        lanes[i % 8] += x[i];
    }
    let mut sum = order::reduce_add(lanes);
    for i in n8..n {
        x[i] = (x[i] - max).exp();
        sum += x[i];
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::RopeScaling;
    use crate::kv_cache::KvConfig;
    use ndarray::{array, Array2};

    fn config(sliding_window: Option<usize>) -> Config {
        Config {
            vocab_size: 8,
            hidden_size: 16,
            n_layers: 1,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 4,
            intermediate_size: 8,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            rope_scaling: RopeScaling::None,
            max_position_embeddings: 64,
            tie_word_embeddings: true,
            sliding_window,
            layer_types: vec![],
            num_kv_shared_layers: 0,
            attention_bias: false,
            qk_norm: false,
            gemma: Default::default(),
            bos_token_id: None,
            eos_token_ids: vec![],
        }
    }

    /// Where only one stored key is visible its softmax weight is exactly 1, so each query
    /// head returns its KV head's value row unchanged: heads 0, 1 read KV head 0 and heads
    /// 2, 3 read KV head 1 (GQA). The second step runs under a sliding window of 1, which
    /// hides the first token.
    #[test]
    fn one_visible_key_returns_each_heads_value_row() {
        let cfg = config(Some(1));
        let rope = Rope::new(&cfg);
        let mut cache = LayerCache::new(&KvConfig::default(), 2, 4);
        let q = Array2::from_shape_fn((4, 4), |(h, d)| (h + d) as f32 * 0.3 - 0.4);
        let k = Array2::from_shape_fn((2, 4), |(h, d)| (4 * h + d) as f32 * 0.1 - 0.5);
        let mut out = Array2::zeros((4, 4));
        let mut probs = Vec::new();
        for (pos, v) in [
            array![[1.0f32, 2.0, 3.0, 4.0], [-1.0, -2.0, -3.0, -4.0]],
            array![[0.5f32, 0.25, 8.0, -16.0], [7.0, 0.0, -0.125, 3.0]],
        ]
        .into_iter()
        .enumerate()
        {
            let (q, k) = (q.view(), k.view());
            attend_heads(
                &cfg,
                &rope,
                &mut cache,
                q,
                k,
                v.view(),
                pos,
                out.view_mut(),
                Some(&mut probs),
            );
            let (v0, v1) = (v.row(0), v.row(1));
            assert_eq!(out, ndarray::stack![Axis(0), v0, v0, v1, v1], "pos {pos}");
            let want: &[f32] = if pos == 0 {
                &[1.0; 4]
            } else {
                &[0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
            };
            assert_eq!(probs, want, "pos {pos}: (n_heads, stored) weights");
        }
        // the slice form agrees
        let mut flat = vec![0.0f32; 16];
        let v = array![[1.0f32, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0]];
        let (q, k) = (
            q.iter().copied().collect::<Vec<_>>(),
            k.iter().copied().collect::<Vec<_>>(),
        );
        attend(
            &cfg,
            &rope,
            &mut cache,
            &q,
            &k,
            &v.iter().copied().collect::<Vec<_>>(),
            2,
            &mut flat,
            None,
        );
        assert_eq!(
            flat,
            [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
        );
    }
}
