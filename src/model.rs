//! The engine's forward pass (Llama family), one token at a time.
//!
//! Weights stay in their file dtype (mmap) unless `--weights-dtype` asks for a
//! conversion; activations are f32. The numerics are those of
//! `tinygpt_reference::model` — only the kernels differ.

use crate::attention::{attend, AttnScratch, RopeTable};
use crate::config::Config;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kv_cache::{KvCache, KvConfig};
use crate::ops::{self, matmul, matvec, matvec_many, Matrix};
use crate::weights::{ModelFiles, Tensor};

/// Weight dtype the engine computes with (`--weights-dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightsDType {
    /// Keep each tensor as stored in the file (mmap, no copy).
    Native,
    /// Dequantise/convert every matrix to f32 at load.
    F32,
    /// Convert every matrix to bf16 at load.
    Bf16,
}

impl WeightsDType {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "native" => Some(WeightsDType::Native),
            "f32" => Some(WeightsDType::F32),
            "bf16" => Some(WeightsDType::Bf16),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            WeightsDType::Native => "native",
            WeightsDType::F32 => "f32",
            WeightsDType::Bf16 => "bf16",
        }
    }
}

/// The tensors of one decoder layer, looked up by Hugging Face name with shapes checked.
pub struct LayerTensors<'a> {
    pub attn_norm: &'a Tensor,
    pub wq: &'a Tensor,
    pub wk: &'a Tensor,
    pub wv: &'a Tensor,
    pub wo: &'a Tensor,
    pub bq: Option<&'a Tensor>,
    pub bk: Option<&'a Tensor>,
    pub bv: Option<&'a Tensor>,
    pub ffn_norm: &'a Tensor,
    pub w_gate: &'a Tensor,
    pub w_up: &'a Tensor,
    pub w_down: &'a Tensor,
}

/// All tensors the forward pass needs, shape-checked against the config.
pub struct ModelTensors<'a> {
    pub embed: &'a Tensor,
    pub layers: Vec<LayerTensors<'a>>,
    pub norm: &'a Tensor,
    /// `None` when tied to the embedding.
    pub lm_head: Option<&'a Tensor>,
}

impl<'a> ModelTensors<'a> {
    /// Looks up and checks every tensor (shared by the engine and the reference loader).
    pub fn collect(files: &'a ModelFiles) -> Result<Self> {
        let c = &files.config;
        let (h, q, kv, ff) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let mut layers = Vec::with_capacity(c.n_layers);
        for l in 0..c.n_layers {
            let p = format!("model.layers.{l}");
            let bias = |n: &str, d: usize| files.get_opt(&format!("{p}.self_attn.{n}.bias"), &[d]);
            layers.push(LayerTensors {
                attn_norm: files.get(&format!("{p}.input_layernorm.weight"), &[h])?,
                wq: files.get(&format!("{p}.self_attn.q_proj.weight"), &[q, h])?,
                wk: files.get(&format!("{p}.self_attn.k_proj.weight"), &[kv, h])?,
                wv: files.get(&format!("{p}.self_attn.v_proj.weight"), &[kv, h])?,
                wo: files.get(&format!("{p}.self_attn.o_proj.weight"), &[h, q])?,
                bq: bias("q_proj", q)?,
                bk: bias("k_proj", kv)?,
                bv: bias("v_proj", kv)?,
                ffn_norm: files.get(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                w_gate: files.get(&format!("{p}.mlp.gate_proj.weight"), &[ff, h])?,
                w_up: files.get(&format!("{p}.mlp.up_proj.weight"), &[ff, h])?,
                w_down: files.get(&format!("{p}.mlp.down_proj.weight"), &[h, ff])?,
            });
        }
        if c.attention_bias && layers.first().is_some_and(|l| l.bq.is_none()) {
            return Err(Error::tensor(
                &files.path,
                "model.layers.0.self_attn.q_proj.bias",
                "missing (the config says attention_bias = true)",
            ));
        }
        let embed = files.get("model.embed_tokens.weight", &[c.vocab_size, h])?;
        let norm = files.get("model.norm.weight", &[h])?;
        let lm_head = if files.tensors.contains_key("lm_head.weight") {
            Some(files.get("lm_head.weight", &[c.vocab_size, h])?)
        } else if c.tie_word_embeddings {
            None
        } else {
            return Err(Error::tensor(
                &files.path,
                "lm_head.weight",
                "missing (and tie_word_embeddings is false)",
            ));
        };
        for t in files.tensors.values() {
            if t.dtype.is_quantized()
                && t.shape
                    .last()
                    .is_some_and(|&c| !c.is_multiple_of(t.dtype.block_len()))
            {
                return Err(Error::tensor(
                    &files.path,
                    &t.name,
                    format!(
                        "row length {:?} is not a multiple of the {} block",
                        t.shape, t.dtype
                    ),
                ));
            }
            let want = t.dtype.bytes_for(t.numel());
            if want != Some(t.data.bytes().len()) {
                return Err(Error::tensor(
                    &files.path,
                    &t.name,
                    format!(
                        "holds {} bytes but shape {:?} of {} needs {:?}",
                        t.data.bytes().len(),
                        t.shape,
                        t.dtype,
                        want
                    ),
                ));
            }
        }
        Ok(ModelTensors {
            embed,
            layers,
            norm,
            lm_head,
        })
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    wq: Matrix,
    wk: Matrix,
    wv: Matrix,
    wo: Matrix,
    bq: Option<Vec<f32>>,
    bk: Option<Vec<f32>>,
    bv: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    w_gate: Matrix,
    w_up: Matrix,
    w_down: Matrix,
}

/// A loaded engine model.
pub struct Model {
    pub cfg: Config,
    layers: Vec<Layer>,
    embed: Matrix,
    norm: Vec<f32>,
    lm_head: Matrix,
    rope: RopeTable,
}

/// Per-sequence state: the KV cache and scratch buffers.
pub struct Session {
    pub cache: KvCache,
    scratch: AttnScratch,
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    pub logits: Vec<f32>,
    /// When set, `probs[l]` holds the last step's attention weights, `(n_heads, stored)`.
    pub record_probs: bool,
    pub probs: Vec<Vec<f32>>,
}

fn matrix(t: &Tensor, want: WeightsDType) -> Matrix {
    let target = match want {
        WeightsDType::Native => t.dtype,
        WeightsDType::F32 => DType::F32,
        WeightsDType::Bf16 => DType::BF16,
    };
    Matrix::from_tensor(&t.converted(target))
}

impl Model {
    /// Builds the engine model from loaded files.
    pub fn load(files: &ModelFiles, wdtype: WeightsDType) -> Result<Model> {
        let t = ModelTensors::collect(files)?;
        let cfg = files.config.clone();
        let vecf = |t: &Tensor| t.to_f32();
        let mut layers: Vec<Layer> = t
            .layers
            .iter()
            .map(|l| Layer {
                attn_norm: vecf(l.attn_norm),
                wq: matrix(l.wq, wdtype),
                wk: matrix(l.wk, wdtype),
                wv: matrix(l.wv, wdtype),
                wo: matrix(l.wo, wdtype),
                bq: l.bq.map(vecf),
                bk: l.bk.map(vecf),
                bv: l.bv.map(vecf),
                ffn_norm: vecf(l.ffn_norm),
                w_gate: matrix(l.w_gate, wdtype),
                w_up: matrix(l.w_up, wdtype),
                w_down: matrix(l.w_down, wdtype),
            })
            .collect();
        let embed = matrix(t.embed, wdtype);
        let mut lm_head = match t.lm_head {
            Some(h) => matrix(h, wdtype),
            None => embed.clone(),
        };
        // Weights that do not fit in cache are re-read from DRAM every token: walk their
        // rows as one sequential stream (values are the same either way). The embedding
        // is only looked up by row, so it does not count.
        let mut mats: Vec<&mut Matrix> = vec![&mut lm_head];
        for l in layers.iter_mut() {
            mats.extend([
                &mut l.wq,
                &mut l.wk,
                &mut l.wv,
                &mut l.wo,
                &mut l.w_gate,
                &mut l.w_up,
                &mut l.w_down,
            ]);
        }
        let total: usize = mats.iter().map(|m| m.byte_len()).sum();
        for m in mats {
            m.set_streamed(total > ops::matvec::STREAM_BYTES);
        }
        Ok(Model {
            rope: RopeTable::new(&cfg),
            layers,
            embed,
            norm: vecf(t.norm),
            lm_head,
            cfg,
        })
    }

    /// A fresh decoding session with an empty cache.
    pub fn session(&self, kv: &KvConfig) -> Session {
        let c = &self.cfg;
        Session {
            cache: KvCache::new(c, kv),
            scratch: AttnScratch::new(c, kv),
            x: vec![0.0; c.hidden_size],
            h: vec![0.0; c.hidden_size],
            q: vec![0.0; c.q_dim()],
            k: vec![0.0; c.kv_dim()],
            v: vec![0.0; c.kv_dim()],
            att: vec![0.0; c.q_dim()],
            proj: vec![0.0; c.hidden_size],
            gate: vec![0.0; c.intermediate_size],
            up: vec![0.0; c.intermediate_size],
            logits: vec![0.0; c.vocab_size],
            record_probs: false,
            probs: vec![Vec::new(); c.n_layers],
        }
    }

    /// Runs token `token` at absolute position `pos`; the logits land in `s.logits`.
    pub fn forward(&self, s: &mut Session, token: u32, pos: usize) -> Result<()> {
        let c = &self.cfg;
        if token as usize >= c.vocab_size {
            return Err(Error::Generate(format!(
                "token id {token} is outside the model's vocabulary ({})",
                c.vocab_size
            )));
        }
        self.embed.row_f32(token as usize, &mut s.x);
        for (l, lw) in self.layers.iter().enumerate() {
            ops::rmsnorm(&s.x, &lw.attn_norm, c.rms_norm_eps, &mut s.h);
            matvec_many(
                &[&lw.wq, &lw.wk, &lw.wv],
                &s.h,
                &mut [&mut s.q, &mut s.k, &mut s.v],
            );
            if let Some(b) = &lw.bq {
                ops::add_assign(&mut s.q, b);
            }
            if let Some(b) = &lw.bk {
                ops::add_assign(&mut s.k, b);
            }
            if let Some(b) = &lw.bv {
                ops::add_assign(&mut s.v, b);
            }
            check_finite_kv(&s.k, &s.v, l, pos)?;
            let probs = if s.record_probs {
                Some(&mut s.probs[l])
            } else {
                None
            };
            attend(
                c,
                &self.rope,
                s.cache.layer_mut(l),
                &s.q,
                &s.k,
                &s.v,
                pos,
                &mut s.att,
                &mut s.scratch,
                probs,
            );
            matvec(&lw.wo, &s.att, &mut s.proj);
            ops::add_assign(&mut s.x, &s.proj);

            ops::rmsnorm(&s.x, &lw.ffn_norm, c.rms_norm_eps, &mut s.h);
            matvec_many(&[&lw.w_gate, &lw.w_up], &s.h, &mut [&mut s.gate, &mut s.up]);
            ops::swiglu(&mut s.gate, &s.up);
            matvec(&lw.w_down, &s.gate, &mut s.proj);
            ops::add_assign(&mut s.x, &s.proj);
        }
        ops::rmsnorm(&s.x, &self.norm, c.rms_norm_eps, &mut s.h);
        check_finite_hidden(&s.h, pos)?;
        matvec(&self.lm_head, &s.h, &mut s.logits);
        Ok(())
    }

    /// Prefill: runs `tokens` at positions `start..start + tokens.len()` with batched
    /// matrix products (each weight row read once per tile of tokens) and per-token
    /// attention in order, so the cache ends exactly as after token-by-token decoding.
    /// `s.logits` receives the last token's logits; `all_logits`, if given, receives
    /// `(tokens, vocab)`. Every value equals the token-by-token forward's bit for bit.
    pub fn forward_batch(
        &self,
        s: &mut Session,
        tokens: &[u32],
        start: usize,
        all_logits: Option<&mut Vec<f32>>,
    ) -> Result<()> {
        let c = &self.cfg;
        let n = tokens.len();
        if n == 0 {
            return Ok(());
        }
        if s.record_probs {
            // Attention weights are recorded per step: run the steps one by one.
            let mut all = all_logits;
            for (i, &t) in tokens.iter().enumerate() {
                self.forward(s, t, start + i)?;
                if let Some(a) = all.as_deref_mut() {
                    if i == 0 {
                        a.clear();
                    }
                    a.extend_from_slice(&s.logits);
                }
            }
            return Ok(());
        }
        let (hd, qd, kvd, ff) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        let mut x = vec![0.0f32; n * hd];
        for (i, &t) in tokens.iter().enumerate() {
            if t as usize >= c.vocab_size {
                return Err(Error::Generate(format!(
                    "token id {t} is outside the model's vocabulary ({})",
                    c.vocab_size
                )));
            }
            self.embed.row_f32(t as usize, &mut x[i * hd..(i + 1) * hd]);
        }
        let mut h = vec![0.0f32; n * hd];
        let mut q = vec![0.0f32; n * qd];
        let mut k = vec![0.0f32; n * kvd];
        let mut v = vec![0.0f32; n * kvd];
        let mut att = vec![0.0f32; n * qd];
        let mut proj = vec![0.0f32; n * hd];
        let mut gate = vec![0.0f32; n * ff];
        let mut up = vec![0.0f32; n * ff];
        let norm_rows = |x: &[f32], w: &[f32], h: &mut [f32]| {
            for (xr, hr) in x.chunks_exact(hd).zip(h.chunks_exact_mut(hd)) {
                ops::rmsnorm(xr, w, c.rms_norm_eps, hr);
            }
        };
        for (l, lw) in self.layers.iter().enumerate() {
            norm_rows(&x, &lw.attn_norm, &mut h);
            matmul(&lw.wq, &h, n, &mut q);
            matmul(&lw.wk, &h, n, &mut k);
            matmul(&lw.wv, &h, n, &mut v);
            for (b, buf, d) in [
                (&lw.bq, &mut q, qd),
                (&lw.bk, &mut k, kvd),
                (&lw.bv, &mut v, kvd),
            ] {
                if let Some(b) = b {
                    buf.chunks_exact_mut(d).for_each(|r| ops::add_assign(r, b));
                }
            }
            check_finite_kv(&k, &v, l, start)?;
            for i in 0..n {
                attend(
                    c,
                    &self.rope,
                    s.cache.layer_mut(l),
                    &q[i * qd..(i + 1) * qd],
                    &k[i * kvd..(i + 1) * kvd],
                    &v[i * kvd..(i + 1) * kvd],
                    start + i,
                    &mut att[i * qd..(i + 1) * qd],
                    &mut s.scratch,
                    None,
                );
            }
            matmul(&lw.wo, &att, n, &mut proj);
            ops::add_assign(&mut x, &proj);
            norm_rows(&x, &lw.ffn_norm, &mut h);
            matmul(&lw.w_gate, &h, n, &mut gate);
            matmul(&lw.w_up, &h, n, &mut up);
            ops::swiglu(&mut gate, &up);
            matmul(&lw.w_down, &gate, n, &mut proj);
            ops::add_assign(&mut x, &proj);
        }
        match all_logits {
            Some(all) => {
                norm_rows(&x, &self.norm, &mut h);
                check_finite_hidden(&h, start)?;
                all.resize(n * c.vocab_size, 0.0);
                matmul(&self.lm_head, &h, n, all);
                s.logits
                    .copy_from_slice(&all[(n - 1) * c.vocab_size..n * c.vocab_size]);
            }
            None => {
                let last = &x[(n - 1) * hd..n * hd];
                ops::rmsnorm(last, &self.norm, c.rms_norm_eps, &mut s.h);
                check_finite_hidden(&s.h, start + n - 1)?;
                matvec(&self.lm_head, &s.h, &mut s.logits);
            }
        }
        Ok(())
    }
}

/// Per-step NaN/Inf checks (a few hundred compares per token). They matter on the native
/// quantised path: its matvec quantises the activation, and the KIVI cache its rows, with
/// scales taken by `f32::max`, which skips NaN, so NaN would silently become zeros.
fn check_finite_hidden(h: &[f32], pos: usize) -> Result<()> {
    if h.iter().any(|x| !x.is_finite()) {
        return Err(Error::NonFinite(format!(
            "non-finite hidden state at position {pos} after the final norm (model.norm.weight): \
             check the model's weights, or an activation overflowed"
        )));
    }
    Ok(())
}

fn check_finite_kv(k: &[f32], v: &[f32], layer: usize, pos: usize) -> Result<()> {
    if k.iter().chain(v).any(|x| !x.is_finite()) {
        return Err(Error::NonFinite(format!(
            "non-finite K/V row in layer {layer} at position {pos} (model.layers.{layer}.self_attn): \
             check the model's weights, or an activation overflowed"
        )));
    }
    Ok(())
}

/// Builds the scalar reference model from the same files: every weight dequantised to f32
/// after the same `--weights-dtype` conversion the engine applies, so both see equal values.
pub fn reference_model(
    files: &ModelFiles,
    wdtype: WeightsDType,
) -> Result<tinygpt_reference::Model> {
    use tinygpt_reference::ggml::GgmlType;
    use tinygpt_reference::model::{LayerWeights, Linear, Weights};
    let t = ModelTensors::collect(files)?;
    let m = |t: &Tensor| -> Linear {
        let ggml = match t.dtype {
            DType::Q8_0 => Some(GgmlType::Q8_0),
            DType::Q4_0 => Some(GgmlType::Q4_0),
            DType::Q4_1 => Some(GgmlType::Q4_1),
            _ => None,
        };
        match (wdtype, ggml) {
            (WeightsDType::Native, Some(ty)) => Linear::Ggml {
                ty,
                cols: t.shape[1],
                bytes: t.data.bytes().to_vec(),
            },
            (WeightsDType::Bf16, _) => Linear::F32(t.converted(DType::BF16).to_f32()),
            _ => Linear::F32(t.to_f32()),
        }
    };
    let embed_f32 = match wdtype {
        WeightsDType::Bf16 => t.embed.converted(DType::BF16).to_f32(),
        _ => t.embed.to_f32(),
    };
    let layers = t
        .layers
        .iter()
        .map(|l| LayerWeights {
            attn_norm: l.attn_norm.to_f32(),
            wq: m(l.wq),
            wk: m(l.wk),
            wv: m(l.wv),
            wo: m(l.wo),
            bq: l.bq.map(|b| b.to_f32()),
            bk: l.bk.map(|b| b.to_f32()),
            bv: l.bv.map(|b| b.to_f32()),
            ffn_norm: l.ffn_norm.to_f32(),
            w_gate: m(l.w_gate),
            w_up: m(l.w_up),
            w_down: m(l.w_down),
        })
        .collect();
    let weights = Weights {
        tied_head: match t.lm_head {
            None if t.embed.dtype.is_quantized() && wdtype == WeightsDType::Native => {
                Some(m(t.embed))
            }
            _ => None,
        },
        embed: embed_f32,
        layers,
        norm: t.norm.to_f32(),
        lm_head: t.lm_head.map(m),
    };
    Ok(tinygpt_reference::Model::new(files.config.clone(), weights))
}
