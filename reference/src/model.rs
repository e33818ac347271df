//! The reference forward pass: one token at a time, f32 everywhere.
//!
//! Llama family: embed → for each layer { x += o_proj(attend(rope(q), rope(k), v)) on
//! rmsnorm(x); x += down(silu(gate(h)) * up(h)) on h = rmsnorm(x) } → rmsnorm → lm_head.
//! Qwen2 adds q/k/v biases; Qwen3 an RMSNorm of each q and k head before RoPE. Gemma 3
//! also scales the embedding by √hidden, norms each block's output before its residual add,
//! uses GeGLU (tanh-GELU), gives its sliding layers their own RoPE base and may soft-cap the
//! final logits ([`soft_cap`]).
//!
//! YOCO sharing (`num_kv_shared_layers` = S): layers `≥ L − S` compute no K/V; their query
//! attends over the cache of the layer [`Config::kv_source`] names, which that layer has
//! already filled for the current token. A sliding layer's cache holds its last `window`
//! tokens ([`Config::layer_kv_config`]).

use crate::attention::{attend_cached, attend_heads, head_row, softmax};
use crate::config::{AttentionType, Config};
use crate::ggml::GgmlType;
use crate::ggml_dot;
use crate::ggml_kdot;
use crate::kv_cache::{KvConfig, LayerCache};
use crate::order;
use crate::rope::Rope;
use ndarray::{
    Array1, Array2, Array3, ArrayView1, ArrayView2, ArrayViewMut, ArrayViewMut1, ArrayViewMut2,
    Axis, Dimension,
};

/// A weight matrix `(out_features, in_features)`.
#[derive(Debug, Clone)]
pub enum Linear {
    /// Plain f32 values.
    F32(Array2<f32>),
    /// GGML blocks kept as stored (Q8_0, Q4_0, Q4_1, Q5_1: `cols / 32` blocks per row;
    /// Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS: `cols / 256` super-blocks), rows one after
    /// another: multiplied through
    /// [`ggml_dot`] (8-bit activation blocks of 32) or [`ggml_kdot`] (Q8_K activations),
    /// as the engine's native path does.
    Ggml {
        ty: GgmlType,
        cols: usize,
        bytes: Vec<u8>,
    },
}

impl Linear {
    /// `out = self · x`. `out` holds the `out_features` results in row-major order, in
    /// whatever shape the caller reads them: `(hidden)`, or `(heads, head_dim)` for a
    /// projection to heads.
    pub fn matvec<D: Dimension>(&self, x: ArrayView1<f32>, out: ArrayViewMut<f32, D>) {
        match self {
            Linear::F32(w) => matvec_view(w.view(), x, out),
            Linear::Ggml { ty, cols, bytes } => {
                assert_eq!(x.len(), *cols);
                let row_bytes = cols / ty.block_len() * ty.block_bytes();
                assert_eq!(bytes.len(), out.len() * row_bytes);
                let xs = x.to_vec();
                match row_dot(*ty) {
                    RowDot::Blocks32(dot) => {
                        let acts = ggml_dot::quantize_acts(&xs);
                        for (row, o) in bytes.chunks_exact(row_bytes).zip(out) {
                            *o = dot(row, &acts);
                        }
                    }
                    RowDot::Q8K(dot) => {
                        let acts = ggml_kdot::quantize_q8_k(&xs);
                        for (row, o) in bytes.chunks_exact(row_bytes).zip(out) {
                            *o = dot(row, &acts);
                        }
                    }
                }
            }
        }
    }
}

/// How a row of a block type meets the activations: which quantisation of `x` it reads
/// and its dot product.
enum RowDot {
    /// 8-bit blocks of 32 ([`ggml_dot`]).
    Blocks32(fn(&[u8], &ggml_dot::QuantizedActs) -> f32),
    /// Q8_K super-blocks of 256 ([`ggml_kdot`]).
    Q8K(fn(&[u8], &ggml_kdot::Q8K) -> f32),
}

/// The dot product of each block type (every type listed: a new one must name its own).
///
/// # Panics
/// For the float types, which [`Linear::F32`] holds instead.
fn row_dot(ty: GgmlType) -> RowDot {
    match ty {
        GgmlType::Q8_0 => RowDot::Blocks32(ggml_dot::dot_q8_0),
        GgmlType::Q4_0 => RowDot::Blocks32(ggml_dot::dot_q4_0),
        GgmlType::Q4_1 => RowDot::Blocks32(ggml_dot::dot_q4_1),
        GgmlType::Q5_0 => RowDot::Blocks32(ggml_dot::dot_q5_0),
        GgmlType::Q5_1 => RowDot::Blocks32(ggml_dot::dot_q5_1),
        GgmlType::IQ4_NL => RowDot::Blocks32(ggml_dot::dot_iq4_nl),
        GgmlType::Q2_K => RowDot::Q8K(ggml_kdot::dot_q2_k),
        GgmlType::Q3_K => RowDot::Q8K(ggml_kdot::dot_q3_k),
        GgmlType::Q4_K => RowDot::Q8K(ggml_kdot::dot_q4_k),
        GgmlType::Q5_K => RowDot::Q8K(ggml_kdot::dot_q5_k),
        GgmlType::Q6_K => RowDot::Q8K(ggml_kdot::dot_q6_k),
        GgmlType::IQ4_XS => RowDot::Q8K(ggml_kdot::dot_iq4_xs),
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => {
            panic!("{ty} is not a block type (held as Linear::F32)")
        }
    }
}

/// One decoder layer's weights, matrices `(out_features, in_features)` as in HF files.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// (hidden)
    pub attn_norm: Array1<f32>,
    /// (q_dim, hidden)
    pub wq: Linear,
    /// (kv_dim, hidden); `None` in a YOCO shared layer
    pub wk: Option<Linear>,
    /// (kv_dim, hidden); `None` in a YOCO shared layer
    pub wv: Option<Linear>,
    /// (hidden, q_dim)
    pub wo: Linear,
    /// Qwen2-style projection biases: (q_dim), (kv_dim), (kv_dim).
    pub bq: Option<Array1<f32>>,
    pub bk: Option<Array1<f32>>,
    pub bv: Option<Array1<f32>>,
    /// Qwen3-style per-head RMSNorm weights of q and k, (head_dim) each, applied to every
    /// head after the bias and before RoPE (`k_norm` is unused in a YOCO shared layer).
    pub q_norm: Option<Array1<f32>>,
    pub k_norm: Option<Array1<f32>>,
    /// (hidden)
    pub ffn_norm: Array1<f32>,
    /// Gemma's norms of the attention output and of the MLP output, (hidden) each
    /// ([`crate::config::GemmaOptions::sandwich_norms`]).
    pub post_attn_norm: Option<Array1<f32>>,
    pub post_ffn_norm: Option<Array1<f32>>,
    /// (intermediate, hidden)
    pub w_gate: Linear,
    /// (intermediate, hidden)
    pub w_up: Linear,
    /// (hidden, intermediate)
    pub w_down: Linear,
}

/// All weights of a model, dequantised to f32.
#[derive(Debug, Clone)]
pub struct Weights {
    /// (vocab, hidden)
    pub embed: Array2<f32>,
    pub layers: Vec<LayerWeights>,
    /// (hidden)
    pub norm: Array1<f32>,
    /// (vocab, hidden); `None` when tied to `embed`.
    pub lm_head: Option<Linear>,
    /// The embedding as a matrix for the tied LM head (the file's own blocks when
    /// quantised), `None` to use `embed` as f32.
    pub tied_head: Option<Linear>,
}

/// A model ready to run.
#[derive(Debug, Clone)]
pub struct Model {
    pub cfg: Config,
    pub weights: Weights,
    /// One RoPE per layer ([`Config::rope_config`]: Gemma 3's sliding layers have their own
    /// base).
    pub ropes: Vec<Rope>,
}

/// Per-sequence decoding state: one cache per layer that holds K/V (`caches[l]` for
/// `l < cfg.layers_with_kv()`).
#[derive(Debug, Clone)]
pub struct State {
    pub caches: Vec<LayerCache>,
    /// When set, the last step's attention weights per layer (all `n_layers`; a shared
    /// layer's weights are over the rows of the cache it reads), `(n_heads, stored)`
    /// row-major.
    pub record_probs: bool,
    pub probs: Vec<Vec<f32>>,
}

impl State {
    pub fn new(cfg: &Config, kv: &KvConfig) -> Self {
        State {
            caches: (0..cfg.layers_with_kv())
                .map(|l| LayerCache::new(&cfg.layer_kv_config(l, kv), cfg.n_kv_heads, cfg.head_dim))
                .collect(),
            record_probs: false,
            probs: vec![Vec::new(); cfg.n_layers],
        }
    }
}

/// `out[o] = Σ_i w[o, i] · x[i]`, each row summed in the engine's canonical order
/// ([`order::dot8`]: eight lane sums, a fixed tree, the tail; not `.dot()`, whose order
/// is the BLAS kernel's). `out` is any shape holding the `out_features` results in
/// row-major order.
pub fn matvec_view<D: Dimension>(
    w: ArrayView2<f32>,
    x: ArrayView1<f32>,
    out: ArrayViewMut<f32, D>,
) {
    let (rows, cols) = w.dim();
    assert_eq!((out.len(), x.len()), (rows, cols), "matvec shapes");
    let x: Vec<f32> = x.iter().copied().collect();
    let mut buf = Vec::new();
    for (o, out_o) in out.into_iter().enumerate() {
        let row = w.row(o);
        let row = match row.as_slice() {
            Some(r) => r,
            None => {
                buf.clear();
                buf.extend(row.iter().copied());
                &buf
            }
        };
        *out_o = order::dot8(row, &x);
    }
}

/// [`matvec_view`] for callers that hold flat slices: `w` is row-major
/// `(out.len(), x.len())`.
///
/// # Panics
/// If `w.len() != out.len() · x.len()`.
pub fn matvec(w: &[f32], x: &[f32], out: &mut [f32]) {
    let w = ArrayView2::from_shape((out.len(), x.len()), w).expect("w is (out.len(), x.len())");
    matvec_view(w, ArrayView1::from(x), out.into());
}

/// RMSNorm: `out = x / sqrt(mean(x²) + eps) · weight`, the sum of squares in the
/// engine's order ([`order::dot_norm`]).
///
/// Vectors are anything that views as a 1-D array (`&Vec<f32>`, `&[f32]`, an
/// [`ArrayView1`] / `ArrayViewMut1`).
pub fn rmsnorm<'x, 'w, 'o>(
    x: impl Into<ArrayView1<'x, f32>>,
    weight: impl Into<ArrayView1<'w, f32>>,
    eps: f32,
    out: impl Into<ArrayViewMut1<'o, f32>>,
) {
    let (x, weight, mut out) = (x.into(), weight.into(), out.into());
    let xs: Vec<f32> = x.iter().copied().collect();
    let ss = order::dot_norm(&xs, &xs);
    let inv = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    for i in 0..x.len() {
        out[i] = weight[i] * (x[i] * inv);
    }
}

/// GELU, tanh approximation (`gelu_pytorch_tanh`):
/// `0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))`.
pub fn gelu_tanh(x: f32) -> f32 {
    let c = (2.0f32 / std::f32::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
}

/// SiLU: `x · sigmoid(x)` with `f32::exp` (SwiGLU uses [`order::silu_at`], the engine's
/// vector `exp`).
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `x += b` element by element, `b` flat over `x`'s row-major order (a projection's bias
/// over its `(heads, head_dim)` output).
fn add_bias<D: Dimension>(x: ArrayViewMut<f32, D>, b: Option<&Array1<f32>>) {
    if let Some(b) = b {
        assert_eq!(x.len(), b.len());
        for (xi, bi) in x.into_iter().zip(b) {
            *xi += bi;
        }
    }
}

/// Gemma's norm of a block's output before the residual add, when the layer has one.
fn post_norm(x: &mut Array1<f32>, w: Option<&Array1<f32>>, eps: f32) {
    if let Some(w) = w {
        let input = x.clone();
        rmsnorm(&input, w, eps, x);
    }
}

/// Per-head RMSNorm: each row of `x` (one head, `(heads, head_dim)`) normalised in place
/// with `w`, when the layer has the weights.
fn head_norm(mut x: ArrayViewMut2<f32>, w: Option<&Array1<f32>>, eps: f32) {
    if let Some(w) = w {
        for mut row in x.rows_mut() {
            let input = row.to_owned();
            rmsnorm(&input, w, eps, &mut row);
        }
    }
}

/// The gated feed-forward: `gate = act(gate(h)) · up(h)`, `out = down(gate)`, with `act`
/// Final logit soft-capping of one logit (Gemma's `final_logit_softcapping`):
/// `cap · tanh(x / cap)` in f32 — a division, `f32::tanh`, a multiplication, each rounded
/// once. Bounds the logit to `[−cap, cap]` and leaves small ones nearly unchanged.
pub fn soft_cap(x: f32, cap: f32) -> f32 {
    cap * (x / cap).tanh()
}

/// SiLU (SwiGLU) or tanh-GELU (Gemma's GeGLU).
struct Mlp {
    gate: Array1<f32>,
    up: Array1<f32>,
    gelu: bool,
}

impl Mlp {
    fn new(cfg: &Config) -> Self {
        Mlp {
            gate: Array1::zeros(cfg.intermediate_size),
            up: Array1::zeros(cfg.intermediate_size),
            gelu: cfg.gemma.gelu_tanh,
        }
    }

    fn run(&mut self, lw: &LayerWeights, h: ArrayView1<f32>, out: ArrayViewMut1<f32>) {
        lw.w_gate.matvec(h, self.gate.view_mut());
        lw.w_up.matvec(h, self.up.view_mut());
        let n = self.gate.len();
        for (i, (g, u)) in self.gate.iter_mut().zip(&self.up).enumerate() {
            let a = if self.gelu {
                gelu_tanh(*g)
            } else {
                order::silu_at(*g, i, n)
            };
            *g = a * u;
        }
        lw.w_down.matvec(self.gate.view(), out);
    }
}

impl Model {
    pub fn new(cfg: Config, weights: Weights) -> Self {
        let ropes = (0..cfg.n_layers)
            .map(|l| Rope::new(&cfg.rope_config(l)))
            .collect();
        Model {
            cfg,
            weights,
            ropes,
        }
    }

    /// The embedding row of `t`, times the model's embedding scale.
    fn embed(&self, t: usize) -> Array1<f32> {
        let mut x = self.weights.embed.row(t).to_owned();
        if let Some(s) = self.cfg.gemma.embed_scale {
            x.mapv_inplace(|v| v * s);
        }
        x
    }

    /// The final norm and LM head: logits `(vocab)` of the last hidden state `x`, soft-capped
    /// where the model says so ([`soft_cap`]).
    fn logits(&self, x: ArrayView1<f32>) -> Vec<f32> {
        let cfg = &self.cfg;
        let mut h = Array1::zeros(cfg.hidden_size);
        rmsnorm(x, &self.weights.norm, cfg.rms_norm_eps, &mut h);
        let mut logits = Array1::zeros(cfg.vocab_size);
        match (&self.weights.lm_head, &self.weights.tied_head) {
            (Some(head), _) | (None, Some(head)) => head.matvec(h.view(), logits.view_mut()),
            (None, None) => matvec_view(self.weights.embed.view(), h.view(), logits.view_mut()),
        }
        if let Some(cap) = cfg.gemma.final_logit_softcapping {
            logits.mapv_inplace(|v| soft_cap(v, cap));
        }
        logits.to_vec()
    }

    /// Runs one token at absolute position `pos` and returns the logits over the vocabulary.
    pub fn forward(&self, state: &mut State, token: u32, pos: usize) -> Vec<f32> {
        let cfg = &self.cfg;
        let (hidden, hd) = (cfg.hidden_size, cfg.head_dim);
        let t = token as usize;
        assert!(t < cfg.vocab_size, "token id {t} out of range");
        let mut x: Array1<f32> = self.embed(t);
        let mut h = Array1::<f32>::zeros(hidden);
        let mut q = Array2::<f32>::zeros((cfg.n_heads, hd));
        let mut k = Array2::<f32>::zeros((cfg.n_kv_heads, hd));
        let mut v = Array2::<f32>::zeros((cfg.n_kv_heads, hd));
        let mut att = Array2::<f32>::zeros((cfg.n_heads, hd));
        let mut proj = Array1::<f32>::zeros(hidden);
        let mut mlp = Mlp::new(cfg);

        for (l, lw) in self.weights.layers.iter().enumerate() {
            rmsnorm(&x, &lw.attn_norm, cfg.rms_norm_eps, &mut h);
            lw.wq.matvec(h.view(), q.view_mut());
            add_bias(q.view_mut(), lw.bq.as_ref());
            head_norm(q.view_mut(), lw.q_norm.as_ref(), cfg.rms_norm_eps);
            let probs = if state.record_probs {
                Some(&mut state.probs[l])
            } else {
                None
            };
            if l < cfg.layers_with_kv() {
                let (wk, wv) = (lw.wk.as_ref(), lw.wv.as_ref());
                wk.expect("a layer that holds K/V has k_proj")
                    .matvec(h.view(), k.view_mut());
                wv.expect("a layer that holds K/V has v_proj")
                    .matvec(h.view(), v.view_mut());
                add_bias(k.view_mut(), lw.bk.as_ref());
                add_bias(v.view_mut(), lw.bv.as_ref());
                head_norm(k.view_mut(), lw.k_norm.as_ref(), cfg.rms_norm_eps);
                attend_heads(
                    cfg,
                    &self.ropes[l],
                    &mut state.caches[l],
                    q.view(),
                    k.view(),
                    v.view(),
                    pos,
                    att.view_mut(),
                    probs,
                );
            } else {
                let src = cfg.kv_source(l).expect("validated config");
                attend_cached(
                    cfg,
                    &self.ropes[l],
                    &state.caches[src],
                    q.view(),
                    pos,
                    att.view_mut(),
                    probs,
                );
            }
            lw.wo.matvec(att.flatten().view(), proj.view_mut());
            post_norm(&mut proj, lw.post_attn_norm.as_ref(), cfg.rms_norm_eps);
            x += &proj;

            rmsnorm(&x, &lw.ffn_norm, cfg.rms_norm_eps, &mut h);
            mlp.run(lw, h.view(), proj.view_mut());
            post_norm(&mut proj, lw.post_ffn_norm.as_ref(), cfg.rms_norm_eps);
            x += &proj;
        }
        self.logits(x.view())
    }

    /// Full-sequence causal forward without any KV cache: every layer that holds K/V
    /// computes K and V for all positions (a shared layer uses its source layer's), then
    /// each position attends to positions `≤` itself (and, in a sliding layer or under
    /// Mistral's `sliding_window`, `> pos − window`). Returns the
    /// logits at every position, `(tokens, vocab)`. An independent check of the cached
    /// path (no eviction, no quantisation, RoPE at absolute positions).
    pub fn forward_sequence(&self, tokens: &[u32]) -> Vec<Vec<f32>> {
        let cfg = &self.cfg;
        let (hidden, hd, n) = (cfg.hidden_size, cfg.head_dim, tokens.len());
        // (tokens, hidden): the residual stream of every position.
        let mut xs = Array2::<f32>::zeros((n, hidden));
        for (mut x, &t) in xs.rows_mut().into_iter().zip(tokens) {
            x.assign(&self.embed(t as usize));
        }
        let mut h = Array1::<f32>::zeros(hidden);
        let mut proj = Array1::<f32>::zeros(hidden);
        let mut mlp = Mlp::new(cfg);
        // Per layer that holds K/V: rotated keys and values, (tokens, n_kv_heads, head_dim).
        let mut layer_ks: Vec<Array3<f32>> = Vec::new();
        let mut layer_vs: Vec<Array3<f32>> = Vec::new();
        for (l, lw) in self.weights.layers.iter().enumerate() {
            let owns_kv = l < cfg.layers_with_kv();
            // (tokens, n_heads, head_dim), rotated
            let mut qs = Array3::<f32>::zeros((n, cfg.n_heads, hd));
            let mut ks = Array3::<f32>::zeros((n, cfg.n_kv_heads, hd));
            let mut vs = Array3::<f32>::zeros((n, cfg.n_kv_heads, hd));
            for pos in 0..n {
                rmsnorm(xs.row(pos), &lw.attn_norm, cfg.rms_norm_eps, &mut h);
                let mut q = qs.index_axis_mut(Axis(0), pos);
                lw.wq.matvec(h.view(), q.view_mut());
                add_bias(q.view_mut(), lw.bq.as_ref());
                head_norm(q.view_mut(), lw.q_norm.as_ref(), cfg.rms_norm_eps);
                self.ropes[l].rotate_rows(q, pos);
                if owns_kv {
                    let mut k = ks.index_axis_mut(Axis(0), pos);
                    let mut v = vs.index_axis_mut(Axis(0), pos);
                    lw.wk
                        .as_ref()
                        .expect("k_proj")
                        .matvec(h.view(), k.view_mut());
                    lw.wv
                        .as_ref()
                        .expect("v_proj")
                        .matvec(h.view(), v.view_mut());
                    add_bias(k.view_mut(), lw.bk.as_ref());
                    add_bias(v.view_mut(), lw.bv.as_ref());
                    head_norm(k.view_mut(), lw.k_norm.as_ref(), cfg.rms_norm_eps);
                    self.ropes[l].rotate_rows(k, pos);
                }
            }
            if owns_kv {
                layer_ks.push(ks);
                layer_vs.push(vs);
            }
            let src = cfg.kv_source(l).expect("validated config");
            let (ks, vs) = (&layer_ks[src], &layer_vs[src]);
            // Keys visible to a query at `pos`: Mistral's mask, and a sliding layer's window.
            let window = match cfg.attention_type(l) {
                AttentionType::Full => cfg.sliding_window,
                AttentionType::Sliding { window } => Some(window),
            };
            for pos in 0..n {
                let mut att = Array2::<f32>::zeros((cfg.n_heads, hd));
                for head in 0..cfg.n_heads {
                    let kvh = head / cfg.group();
                    let q = head_row(&qs, pos, head);
                    let mut scores: Array1<f32> = (0..=pos)
                        .map(|j| {
                            let visible = window.is_none_or(|w| pos - j < w);
                            if !visible {
                                return f32::NEG_INFINITY;
                            }
                            let k = head_row(ks, j, kvh).to_vec();
                            order::dot_score(&q.to_vec(), &k) * cfg.score_scale()
                        })
                        .collect();
                    softmax(scores.view_mut());
                    let mut out = att.row_mut(head);
                    for (j, &p) in scores.iter().enumerate() {
                        if p == 0.0 {
                            continue;
                        }
                        let v = head_row(vs, j, kvh);
                        for i in 0..hd {
                            out[i] = order::axpy_term(v[i], p, out[i], i, hd);
                        }
                    }
                }
                let mut x = xs.row_mut(pos);
                lw.wo.matvec(att.flatten().view(), proj.view_mut());
                post_norm(&mut proj, lw.post_attn_norm.as_ref(), cfg.rms_norm_eps);
                x += &proj;
                rmsnorm(&x, &lw.ffn_norm, cfg.rms_norm_eps, &mut h);
                mlp.run(lw, h.view(), proj.view_mut());
                post_norm(&mut proj, lw.post_ffn_norm.as_ref(), cfg.rms_norm_eps);
                x += &proj;
            }
        }
        xs.rows().into_iter().map(|x| self.logits(x)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::array;

    /// The sum runs in eight lanes (element `i` into lane `i mod 8`), then the fixed
    /// tree: lane 0 holds `1e8` (its seven ones round away), lanes 1..6 hold 8 each, lane
    /// 7 holds `7 − 1e8 = −99999992` (f32 values near 1e8 are 8 apart); the tree adds
    /// `((1e8 + 8) + 16) + (16 + (8 − 99999992)) = 100000024 − 99999968 = 56`, where a
    /// sequential sum gives 0 and the exact sum is 62.
    #[test]
    fn matvec_sums_in_lanes_then_a_tree() {
        let mut row = vec![1.0f32; 64];
        row[0] = 1e8;
        row[63] = -1e8;
        let w = Array2::from_shape_vec((1, 64), row).unwrap();
        let x = Array1::from_elem(64, 1.0f32);
        let mut out = Array1::zeros(1);
        matvec_view(w.view(), x.view(), out.view_mut());
        assert_eq!(out[0], 56.0);
        // the slice form is the same function
        let mut flat = [f32::NAN];
        matvec(w.as_slice().unwrap(), x.as_slice().unwrap(), &mut flat);
        assert_eq!(flat[0], 56.0);
    }

    /// A projection to heads fills `(heads, head_dim)` in row-major order: output feature
    /// `o` is element `o % head_dim` of head `o / head_dim`.
    #[test]
    fn projection_to_heads_is_row_major() {
        // row o = [o, 1], x = [1, 10]: out[o] = o + 10
        let w = Array2::from_shape_fn((6, 2), |(o, i)| if i == 0 { o as f32 } else { 1.0 });
        let x = array![1.0f32, 10.0];
        let mut heads = Array2::zeros((3, 2));
        Linear::F32(w).matvec(x.view(), heads.view_mut());
        assert_eq!(heads, array![[10.0, 11.0], [12.0, 13.0], [14.0, 15.0]]);
        let mut biased = heads.clone();
        add_bias(
            biased.view_mut(),
            Some(&array![0.5, 0.0, 0.0, 0.0, 0.0, -0.5]),
        );
        assert_eq!(biased, array![[10.5, 11.0], [12.0, 13.0], [14.0, 14.5]]);
    }
}
