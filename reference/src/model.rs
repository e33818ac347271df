//! The reference forward pass: one token at a time, f32 everywhere.
//!
//! Llama family: embed → for each layer { x += o_proj(attend(rope(q), rope(k), v)) on
//! rmsnorm(x); x += down(silu(gate(h)) * up(h)) on h = rmsnorm(x) } → rmsnorm → lm_head.
//!
//! YOCO sharing (`num_kv_shared_layers` = S): layers `≥ L − S` compute no K/V; their query
//! attends over the cache of the layer [`Config::kv_source`] names, which that layer has
//! already filled for the current token. A sliding layer's cache holds its last `window`
//! tokens ([`Config::layer_kv_config`]).

use crate::attention::{attend, attend_cached};
use crate::config::{AttentionType, Config};
use crate::ggml::GgmlType;
use crate::ggml_dot;
use crate::kv_cache::{KvConfig, LayerCache};
use crate::rope::Rope;

/// A weight matrix, row-major `(rows, cols)`.
#[derive(Debug, Clone)]
pub enum Linear {
    /// Plain f32 values.
    F32(Vec<f32>),
    /// GGML blocks kept as stored (Q8_0, Q4_0, Q4_1): multiplied through
    /// [`ggml_dot`] with 8-bit activations, as the engine's native path does.
    Ggml {
        ty: GgmlType,
        cols: usize,
        bytes: Vec<u8>,
    },
}

impl Linear {
    /// `out = self · x`.
    pub fn matvec(&self, x: &[f32], out: &mut [f32]) {
        match self {
            Linear::F32(w) => matvec(w, x, out),
            Linear::Ggml { ty, cols, bytes } => {
                assert_eq!(x.len(), *cols);
                let row_bytes = cols / ty.block_len() * ty.block_bytes();
                let acts = ggml_dot::quantize_acts(x);
                for (r, o) in out.iter_mut().enumerate() {
                    let row = &bytes[r * row_bytes..(r + 1) * row_bytes];
                    *o = match ty {
                        GgmlType::Q8_0 => ggml_dot::dot_q8_0(row, &acts),
                        GgmlType::Q4_0 => ggml_dot::dot_q4_0(row, &acts),
                        GgmlType::Q4_1 => ggml_dot::dot_q4_1(row, &acts),
                        other => panic!("{other:?} is not a block type"),
                    };
                }
            }
        }
    }
}

/// One decoder layer's weights, row-major `(out_features, in_features)` as in HF files.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// (hidden)
    pub attn_norm: Vec<f32>,
    /// (q_dim, hidden)
    pub wq: Linear,
    /// (kv_dim, hidden); `None` in a YOCO shared layer
    pub wk: Option<Linear>,
    /// (kv_dim, hidden); `None` in a YOCO shared layer
    pub wv: Option<Linear>,
    /// (hidden, q_dim)
    pub wo: Linear,
    /// Qwen2-style projection biases: (q_dim), (kv_dim), (kv_dim).
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    /// (hidden)
    pub ffn_norm: Vec<f32>,
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
    pub embed: Vec<f32>,
    pub layers: Vec<LayerWeights>,
    /// (hidden)
    pub norm: Vec<f32>,
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
    pub rope: Rope,
}

/// Per-sequence decoding state: one cache per layer that holds K/V (`caches[l]` for
/// `l < cfg.layers_with_kv()`).
#[derive(Debug, Clone)]
pub struct State {
    pub caches: Vec<LayerCache>,
    /// When set, the last step's attention weights per layer (all `n_layers`; a shared
    /// layer's weights are over the rows of the cache it reads), `(n_heads, stored)`.
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

/// `out[r] = Σ_c w[r, c] · x[c]` for a row-major `(rows, x.len())` matrix.
pub fn matvec(w: &[f32], x: &[f32], out: &mut [f32]) {
    let cols = x.len();
    assert_eq!(w.len(), out.len() * cols);
    for (r, o) in out.iter_mut().enumerate() {
        let row = &w[r * cols..(r + 1) * cols];
        let mut acc = 0.0f32;
        for c in 0..cols {
            acc += row[c] * x[c];
        }
        *o = acc;
    }
}

/// RMSNorm: `out = x / sqrt(mean(x²) + eps) · weight`.
pub fn rmsnorm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let mut ss = 0.0f32;
    for v in x {
        ss += v * v;
    }
    let inv = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    for i in 0..x.len() {
        out[i] = weight[i] * (x[i] * inv);
    }
}

/// SiLU: `x · sigmoid(x)`.
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

impl Model {
    pub fn new(cfg: Config, weights: Weights) -> Self {
        let rope = Rope::new(&cfg);
        Model { cfg, weights, rope }
    }

    /// Runs one token at absolute position `pos` and returns the logits over the vocabulary.
    pub fn forward(&self, state: &mut State, token: u32, pos: usize) -> Vec<f32> {
        let cfg = &self.cfg;
        let (hidden, hd) = (cfg.hidden_size, cfg.head_dim);
        let t = token as usize;
        assert!(t < cfg.vocab_size, "token id {t} out of range");
        let mut x = self.weights.embed[t * hidden..(t + 1) * hidden].to_vec();
        let mut h = vec![0.0f32; hidden];
        let mut q = vec![0.0f32; cfg.q_dim()];
        let mut k = vec![0.0f32; cfg.kv_dim()];
        let mut v = vec![0.0f32; cfg.kv_dim()];
        let mut att = vec![0.0f32; cfg.q_dim()];
        let mut proj = vec![0.0f32; hidden];
        let mut gate = vec![0.0f32; cfg.intermediate_size];
        let mut up = vec![0.0f32; cfg.intermediate_size];
        let _ = hd;

        for (l, lw) in self.weights.layers.iter().enumerate() {
            rmsnorm(&x, &lw.attn_norm, cfg.rms_norm_eps, &mut h);
            lw.wq.matvec(&h, &mut q);
            add_bias(&mut q, lw.bq.as_deref());
            let probs = if state.record_probs {
                Some(&mut state.probs[l])
            } else {
                None
            };
            if l < cfg.layers_with_kv() {
                let (wk, wv) = (lw.wk.as_ref(), lw.wv.as_ref());
                wk.expect("a layer that holds K/V has k_proj")
                    .matvec(&h, &mut k);
                wv.expect("a layer that holds K/V has v_proj")
                    .matvec(&h, &mut v);
                add_bias(&mut k, lw.bk.as_deref());
                add_bias(&mut v, lw.bv.as_deref());
                attend(
                    cfg,
                    &self.rope,
                    &mut state.caches[l],
                    &q,
                    &k,
                    &v,
                    pos,
                    &mut att,
                    probs,
                );
            } else {
                let src = cfg.kv_source(l).expect("validated config");
                attend_cached(
                    cfg,
                    &self.rope,
                    &state.caches[src],
                    &q,
                    pos,
                    &mut att,
                    probs,
                );
            }
            lw.wo.matvec(&att, &mut proj);
            for i in 0..hidden {
                x[i] += proj[i];
            }

            rmsnorm(&x, &lw.ffn_norm, cfg.rms_norm_eps, &mut h);
            lw.w_gate.matvec(&h, &mut gate);
            lw.w_up.matvec(&h, &mut up);
            for i in 0..gate.len() {
                gate[i] = silu(gate[i]) * up[i];
            }
            lw.w_down.matvec(&gate, &mut proj);
            for i in 0..hidden {
                x[i] += proj[i];
            }
        }
        rmsnorm(&x, &self.weights.norm, cfg.rms_norm_eps, &mut h);
        let mut logits = vec![0.0f32; cfg.vocab_size];
        match (&self.weights.lm_head, &self.weights.tied_head) {
            (Some(head), _) | (None, Some(head)) => head.matvec(&h, &mut logits),
            (None, None) => matvec(&self.weights.embed, &h, &mut logits),
        }
        logits
    }
}

fn add_bias(x: &mut [f32], b: Option<&[f32]>) {
    if let Some(b) = b {
        for (xi, bi) in x.iter_mut().zip(b) {
            *xi += bi;
        }
    }
}

impl Model {
    /// Full-sequence causal forward without any KV cache: every layer that holds K/V
    /// computes K and V for all positions (a shared layer uses its source layer's), then
    /// each position attends to positions `≤` itself (and, in a sliding layer or under
    /// Mistral's `sliding_window`, `> pos − window`). Returns the
    /// logits at every position, `(tokens, vocab)`. An independent check of the cached
    /// path (no eviction, no quantisation, RoPE at absolute positions).
    pub fn forward_sequence(&self, tokens: &[u32]) -> Vec<Vec<f32>> {
        let cfg = &self.cfg;
        let (hidden, hd, n) = (cfg.hidden_size, cfg.head_dim, tokens.len());
        let mut xs: Vec<Vec<f32>> = tokens
            .iter()
            .map(|&t| self.weights.embed[t as usize * hidden..(t as usize + 1) * hidden].to_vec())
            .collect();
        let mut h = vec![0.0f32; hidden];
        // (layer) → (tokens) rotated keys and values of the layers that hold K/V.
        let mut layer_ks: Vec<Vec<Vec<f32>>> = Vec::new();
        let mut layer_vs: Vec<Vec<Vec<f32>>> = Vec::new();
        for (l, lw) in self.weights.layers.iter().enumerate() {
            let owns_kv = l < cfg.layers_with_kv();
            let mut qs = Vec::with_capacity(n);
            let mut ks = Vec::with_capacity(n);
            let mut vs = Vec::with_capacity(n);
            for (pos, x) in xs.iter().enumerate() {
                rmsnorm(x, &lw.attn_norm, cfg.rms_norm_eps, &mut h);
                let mut q = vec![0.0f32; cfg.q_dim()];
                lw.wq.matvec(&h, &mut q);
                add_bias(&mut q, lw.bq.as_deref());
                self.rope.rotate_heads(&mut q, pos);
                qs.push(q);
                if owns_kv {
                    let mut k = vec![0.0f32; cfg.kv_dim()];
                    let mut v = vec![0.0f32; cfg.kv_dim()];
                    lw.wk.as_ref().expect("k_proj").matvec(&h, &mut k);
                    lw.wv.as_ref().expect("v_proj").matvec(&h, &mut v);
                    add_bias(&mut k, lw.bk.as_deref());
                    add_bias(&mut v, lw.bv.as_deref());
                    self.rope.rotate_heads(&mut k, pos);
                    ks.push(k);
                    vs.push(v);
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
            for (pos, x) in xs.iter_mut().enumerate() {
                let mut att = vec![0.0f32; cfg.q_dim()];
                for head in 0..cfg.n_heads {
                    let kvh = head / cfg.group();
                    let q = &qs[pos][head * hd..(head + 1) * hd];
                    let mut scores: Vec<f32> = (0..=pos)
                        .map(|j| {
                            let visible = window.is_none_or(|w| pos - j < w);
                            if !visible {
                                return f32::NEG_INFINITY;
                            }
                            let k = &ks[j][kvh * hd..(kvh + 1) * hd];
                            let mut d = 0.0f32;
                            for i in 0..hd {
                                d += q[i] * k[i];
                            }
                            d / (hd as f32).sqrt()
                        })
                        .collect();
                    crate::attention::softmax(&mut scores);
                    for (j, p) in scores.iter().enumerate() {
                        let v = &vs[j][kvh * hd..(kvh + 1) * hd];
                        for i in 0..hd {
                            att[head * hd + i] += p * v[i];
                        }
                    }
                }
                let mut proj = vec![0.0f32; hidden];
                lw.wo.matvec(&att, &mut proj);
                for i in 0..hidden {
                    x[i] += proj[i];
                }
                rmsnorm(x, &lw.ffn_norm, cfg.rms_norm_eps, &mut h);
                let mut gate = vec![0.0f32; cfg.intermediate_size];
                let mut up = vec![0.0f32; cfg.intermediate_size];
                lw.w_gate.matvec(&h, &mut gate);
                lw.w_up.matvec(&h, &mut up);
                for i in 0..gate.len() {
                    gate[i] = silu(gate[i]) * up[i];
                }
                lw.w_down.matvec(&gate, &mut proj);
                for i in 0..hidden {
                    x[i] += proj[i];
                }
            }
        }
        xs.iter()
            .map(|x| {
                rmsnorm(x, &self.weights.norm, cfg.rms_norm_eps, &mut h);
                let mut logits = vec![0.0f32; cfg.vocab_size];
                match (&self.weights.lm_head, &self.weights.tied_head) {
                    (Some(head), _) | (None, Some(head)) => head.matvec(&h, &mut logits),
                    (None, None) => matvec(&self.weights.embed, &h, &mut logits),
                }
                logits
            })
            .collect()
    }
}
