//! The engine's forward pass (Llama family), one token at a time.
//!
//! Weights stay in their file dtype (mmap) unless `--weights-dtype` asks for a
//! conversion; activations are f32. The numerics are those of
//! `tinygpt_reference::model` — only the kernels differ.
//!
//! YOCO sharing (`num_kv_shared_layers` = S): the session's cache holds one layer per
//! layer below `L − S` (each with its own [`Config::layer_kv_config`]: a sliding layer
//! keeps its last `window` tokens). A shared layer computes only its query and calls
//! [`attend_stored`] on the cache of [`Config::kv_source`], after that layer appended
//! the current token, so it sees exactly the rows that layer stores.

use crate::attention::{
    append_kv, attend, attend_heads, attend_stored, copy_probs, observe_step, prepare_step,
    AttnScratch, HeadScratch, RopeTable, StepTables,
};
use crate::config::Config;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::kv_cache::{KvCache, KvConfig, LayerKv};
use crate::ops::matvec::{needs_quantized_input, row_part, row_parts, rows_into};
use crate::ops::qdot::QuantizedActs;
use crate::ops::{self, matmul, matmul_many, matmul_rows, matvec, matvec_many, Matrix};
use crate::team::{self, Member, SharedCell, SharedSlice};
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
    /// `None` in a YOCO shared layer (which computes no K/V; the file may omit them).
    pub wk: Option<&'a Tensor>,
    pub wv: Option<&'a Tensor>,
    pub wo: &'a Tensor,
    pub bq: Option<&'a Tensor>,
    pub bk: Option<&'a Tensor>,
    pub bv: Option<&'a Tensor>,
    /// Per-head q/k RMSNorm weights, `(head_dim)` (when `qk_norm`; `k_norm` only in a layer
    /// that holds K/V).
    pub q_norm: Option<&'a Tensor>,
    pub k_norm: Option<&'a Tensor>,
    pub ffn_norm: &'a Tensor,
    /// Gemma's norms of the attention and MLP outputs (`sandwich_norms`).
    pub post_attn_norm: Option<&'a Tensor>,
    pub post_ffn_norm: Option<&'a Tensor>,
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
            // A shared layer's k_proj/v_proj (and biases) are ignored, present or not.
            let owns_kv = l < c.layers_with_kv();
            let kv_part = |name: &str, shape: &[usize]| -> Result<Option<&'a Tensor>> {
                match owns_kv {
                    true => files.get(&format!("{p}.self_attn.{name}"), shape).map(Some),
                    false => Ok(None),
                }
            };
            let kv_bias = |name: &str| match owns_kv {
                true => bias(name, kv),
                false => Ok(None),
            };
            let hd = c.head_dim;
            // Gemma names its norms differently: `post_attention_layernorm` is the norm of
            // the attention output, the MLP's input norm is `pre_feedforward_layernorm`.
            let ffn_norm = match c.gemma.sandwich_norms {
                true => "pre_feedforward_layernorm",
                false => "post_attention_layernorm",
            };
            let sandwich = |name: &str| -> Result<Option<&'a Tensor>> {
                match c.gemma.sandwich_norms {
                    true => files.get(&format!("{p}.{name}.weight"), &[h]).map(Some),
                    false => Ok(None),
                }
            };
            let norm = |name: &str, wanted: bool| -> Result<Option<&'a Tensor>> {
                match wanted {
                    true => files
                        .get(&format!("{p}.self_attn.{name}.weight"), &[hd])
                        .map(Some),
                    false => Ok(None),
                }
            };
            layers.push(LayerTensors {
                attn_norm: files.get(&format!("{p}.input_layernorm.weight"), &[h])?,
                wq: files.get(&format!("{p}.self_attn.q_proj.weight"), &[q, h])?,
                wk: kv_part("k_proj.weight", &[kv, h])?,
                wv: kv_part("v_proj.weight", &[kv, h])?,
                wo: files.get(&format!("{p}.self_attn.o_proj.weight"), &[h, q])?,
                bq: bias("q_proj", q)?,
                bk: kv_bias("k_proj")?,
                bv: kv_bias("v_proj")?,
                q_norm: norm("q_norm", c.qk_norm)?,
                k_norm: norm("k_norm", c.qk_norm && owns_kv)?,
                ffn_norm: files.get(&format!("{p}.{ffn_norm}.weight"), &[h])?,
                post_attn_norm: sandwich("post_attention_layernorm")?,
                post_ffn_norm: sandwich("post_feedforward_layernorm")?,
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
    /// `None` in a YOCO shared layer.
    wk: Option<Matrix>,
    wv: Option<Matrix>,
    wo: Matrix,
    bq: Option<Vec<f32>>,
    bk: Option<Vec<f32>>,
    bv: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    post_attn_norm: Option<Vec<f32>>,
    post_ffn_norm: Option<Vec<f32>>,
    w_gate: Matrix,
    w_up: Matrix,
    w_down: Matrix,
}

/// A loaded engine model.
pub struct Model {
    pub cfg: Config,
    layers: Vec<Layer>,
    /// `kv_source[l]`: the layer whose cache layer `l` attends over.
    kv_source: Vec<usize>,
    embed: Matrix,
    norm: Vec<f32>,
    lm_head: Matrix,
    /// One RoPE table per layer ([`Config::rope_config`]).
    ropes: Vec<RopeTable>,
}

/// The cache of one sequence: one layer per model layer that holds K/V
/// (`cfg.layers_with_kv()`), each configured by [`Config::layer_kv_config`].
pub fn new_cache(cfg: &Config, kv: &KvConfig) -> KvCache {
    let mut cache = KvCache::with_layers(cfg, kv, cfg.layers_with_kv());
    for l in 0..cfg.layers_with_kv() {
        let layer_kv = cfg.layer_kv_config(l, kv);
        if layer_kv != *kv {
            *cache.layer_mut(l) = LayerKv::new(&layer_kv, cfg.n_kv_heads, cfg.head_dim);
        }
    }
    cache
}

/// What a shared layer needs to replay a batch's appends of its source layer: the source
/// cache before the batch and the batch's `(tokens, kv_dim)` K (pre-RoPE) and V rows.
type Replay = (LayerKv, Vec<f32>, Vec<f32>);

/// Per-sequence state: the KV cache and scratch buffers.
pub struct Session {
    /// One layer per model layer that holds K/V (see [`new_cache`]).
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
    /// When set, `probs[l]` holds the last step's attention weights, `(n_heads, stored)`,
    /// for every model layer (a shared layer's over the rows of the cache it reads).
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

impl Session {
    /// Rows held by the layer that holds the most (a sliding layer holds at most its
    /// window, a full one what the StreamingLLM flags allow).
    pub fn stored_tokens(&self) -> usize {
        (0..self.cache.n_layers())
            .map(|l| self.cache.layer(l).len())
            .max()
            .unwrap_or(0)
    }
}

impl Model {
    /// Builds the engine model from loaded files.
    pub fn load(files: &ModelFiles, wdtype: WeightsDType) -> Result<Model> {
        let t = ModelTensors::collect(files)?;
        let cfg = files.config.clone();
        let vecf = |t: &Tensor| t.to_f32();
        // RMSNorm weights, with the offset a Hugging Face Gemma checkpoint leaves out.
        let norm = |t: &Tensor| {
            let mut w = t.to_f32();
            if cfg.gemma.norm_offset != 0.0 {
                w.iter_mut().for_each(|x| *x += cfg.gemma.norm_offset);
            }
            w
        };
        let mut layers: Vec<Layer> = t
            .layers
            .iter()
            .map(|l| Layer {
                attn_norm: norm(l.attn_norm),
                wq: matrix(l.wq, wdtype),
                wk: l.wk.map(|t| matrix(t, wdtype)),
                wv: l.wv.map(|t| matrix(t, wdtype)),
                wo: matrix(l.wo, wdtype),
                bq: l.bq.map(vecf),
                bk: l.bk.map(vecf),
                bv: l.bv.map(vecf),
                q_norm: l.q_norm.map(norm),
                k_norm: l.k_norm.map(norm),
                ffn_norm: norm(l.ffn_norm),
                post_attn_norm: l.post_attn_norm.map(norm),
                post_ffn_norm: l.post_ffn_norm.map(norm),
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
                &mut l.wo,
                &mut l.w_gate,
                &mut l.w_up,
                &mut l.w_down,
            ]);
            mats.extend(l.wk.as_mut());
            mats.extend(l.wv.as_mut());
        }
        let total: usize = mats.iter().map(|m| m.byte_len()).sum();
        for m in mats {
            m.set_streamed(total > ops::matvec::STREAM_BYTES);
        }
        let kv_source = (0..cfg.n_layers)
            .map(|l| {
                cfg.kv_source(l).ok_or_else(|| {
                    Error::config(
                        &files.path,
                        format!("layer {l} has no layer to share K/V from"),
                    )
                })
            })
            .collect::<Result<_>>()?;
        Ok(Model {
            ropes: (0..cfg.n_layers)
                .map(|l| RopeTable::new(&cfg.rope_config(l)))
                .collect(),
            layers,
            kv_source,
            embed,
            norm: norm(t.norm),
            lm_head,
            cfg,
        })
    }

    /// Token `t`'s embedding row, times the model's embedding scale (Gemma).
    fn embed_row(&self, t: u32, out: &mut [f32]) {
        self.embed.row_f32(t as usize, out);
        if let Some(scale) = self.cfg.gemma.embed_scale {
            out.iter_mut().for_each(|x| *x *= scale);
        }
    }

    /// The layer whose cache layer `l` attends over (`l` itself unless it is shared).
    pub fn kv_source(&self, l: usize) -> usize {
        self.kv_source[l]
    }

    /// A fresh decoding session with an empty cache.
    pub fn session(&self, kv: &KvConfig) -> Session {
        let c = &self.cfg;
        Session {
            cache: new_cache(c, kv),
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
    ///
    /// With more than one thread in the current rayon pool the step runs as a decode team
    /// ([`crate::team`]; same values bit for bit; `TINYGPT_TEAM=off` turns it off), so it
    /// must not be called from inside a parallel region of that pool.
    pub fn forward(&self, s: &mut Session, token: u32, pos: usize) -> Result<()> {
        if rayon::current_num_threads() > 1 && team::enabled() {
            return self.forward_team(s, token, pos);
        }
        self.forward_serial(s, token, pos)
    }

    /// [`forward`](Self::forward) on the calling thread and its pool's fork/joins.
    fn forward_serial(&self, s: &mut Session, token: u32, pos: usize) -> Result<()> {
        let c = &self.cfg;
        self.check_token(token)?;
        self.embed_row(token, &mut s.x);
        for (l, lw) in self.layers.iter().enumerate() {
            ops::rmsnorm(&s.x, &lw.attn_norm, c.rms_norm_eps, &mut s.h);
            self.attention_step(s, l, pos)?;
            matvec(&lw.wo, &s.att, &mut s.proj);
            post_norm_rows(&mut s.proj, &lw.post_attn_norm, c.rms_norm_eps);
            ops::add_assign(&mut s.x, &s.proj);

            ops::rmsnorm(&s.x, &lw.ffn_norm, c.rms_norm_eps, &mut s.h);
            matvec_many(&[&lw.w_gate, &lw.w_up], &s.h, &mut [&mut s.gate, &mut s.up]);
            glu(c, &mut s.gate, &s.up);
            matvec(&lw.w_down, &s.gate, &mut s.proj);
            post_norm_rows(&mut s.proj, &lw.post_ffn_norm, c.rms_norm_eps);
            ops::add_assign(&mut s.x, &s.proj);
        }
        ops::rmsnorm(&s.x, &self.norm, c.rms_norm_eps, &mut s.h);
        check_finite_hidden(&s.h, pos)?;
        matvec(&self.lm_head, &s.h, &mut s.logits);
        Ok(())
    }

    /// [`forward`](Self::forward) as a decode team: every thread of the pool runs the
    /// whole step on its share of each product (and of the KV heads), meeting at a spin
    /// barrier six times per layer, instead of a rayon fork/join per product.
    fn forward_team(&self, s: &mut Session, token: u32, pos: usize) -> Result<()> {
        self.check_token(token)?;
        self.embed_row(token, &mut s.x);
        let (tables, heads) = s.scratch.split_mut();
        let bufs = TeamBufs {
            x0: &s.x,
            q: SharedSlice::new(&mut s.q),
            k: SharedSlice::new(&mut s.k),
            v: SharedSlice::new(&mut s.v),
            att: SharedSlice::new(&mut s.att),
            proj: SharedSlice::new(&mut s.proj),
            gate: SharedSlice::new(&mut s.gate),
            up: SharedSlice::new(&mut s.up),
            logits: SharedSlice::new(&mut s.logits),
            cache: SharedCell::new(&mut s.cache),
            tables: SharedCell::new(tables),
            heads: SharedSlice::new(heads),
            probs: s.record_probs.then(|| SharedCell::new(&mut s.probs)),
        };
        // Every member takes the same branches, so all return the same error (or none).
        team::run(|m| self.team_member(m, &bufs, pos))
            .into_iter()
            .collect::<Result<Vec<()>>>()?;
        Ok(())
    }

    /// One member's run of a decode team step (see [`TeamBufs`] for who writes what
    /// between which syncs). The residual stream is private: every member adds each
    /// complete projection to its own copy and norms it itself, which saves a sync.
    fn team_member(&self, m: &Member, b: &TeamBufs, pos: usize) -> Result<()> {
        let c = &self.cfg;
        let mut x = b.x0.to_vec();
        let mut h = vec![0.0f32; c.hidden_size];
        let mut acts = QuantizedActs::default();
        for (l, lw) in self.layers.iter().enumerate() {
            ops::rmsnorm(&x, &lw.attn_norm, c.rms_norm_eps, &mut h);
            self.team_attention(m, b, l, &h, &mut acts, pos)?;
            // SAFETY: `att` was completed before the attention's last sync and is next
            // written in the next layer's attention, several syncs later.
            let att = unsafe { b.att.all() };
            team_product(m, &[&lw.wo], att, &mut acts, &[(&b.proj, &None)]);
            m.sync();
            // SAFETY: `proj` is complete; it is next written after the sync below.
            add_output(
                &mut x,
                unsafe { b.proj.all() },
                &lw.post_attn_norm,
                c.rms_norm_eps,
            );
            ops::rmsnorm(&x, &lw.ffn_norm, c.rms_norm_eps, &mut h);
            // Gate and up on the same rows, so SwiGLU needs no sync.
            let pair = [&lw.w_gate, &lw.w_up];
            let q = quantize_for(&pair, &h, &mut acts);
            let parts = row_parts(&pair[..1], m.n);
            m.claim_each(parts, |k| {
                row_part(&pair[..1], k, parts, |_, r| {
                    // SAFETY: each part is claimed once; `gate`/`up` are read only after
                    // the next sync.
                    let (g, u) =
                        unsafe { (b.gate.range_mut(r.clone()), b.up.range_mut(r.clone())) };
                    rows_into(&lw.w_gate, &h, q, r.start, g);
                    rows_into(&lw.w_up, &h, q, r.start, u);
                    // Parts start on multiples of 8 rows: the same 8-lane chunks as a
                    // whole vector's SwiGLU.
                    glu(c, g, u);
                })
            });
            m.sync();
            // SAFETY: `gate` is complete; it is next written in the next layer.
            let gate = unsafe { b.gate.all() };
            team_product(m, &[&lw.w_down], gate, &mut acts, &[(&b.proj, &None)]);
            m.sync();
            // SAFETY: `proj` is complete; it is next written after three more syncs.
            add_output(
                &mut x,
                unsafe { b.proj.all() },
                &lw.post_ffn_norm,
                c.rms_norm_eps,
            );
        }
        ops::rmsnorm(&x, &self.norm, c.rms_norm_eps, &mut h);
        check_finite_hidden(&h, pos)?;
        team_product(m, &[&self.lm_head], &h, &mut acts, &[(&b.logits, &None)]);
        Ok(())
    }

    /// Layer `l`'s attention in a decode team: projections (shared out), then member 0
    /// appends the K/V and prepares the step while the others wait, then each member
    /// attends over its KV heads. Ends after a sync, with `att` complete.
    fn team_attention(
        &self,
        m: &Member,
        b: &TeamBufs,
        l: usize,
        h: &[f32],
        acts: &mut QuantizedActs,
        pos: usize,
    ) -> Result<()> {
        let (c, lw) = (&self.cfg, &self.layers[l]);
        let has_kv = matches!((&lw.wk, &lw.wv), (Some(_), Some(_)));
        if let (Some(wk), Some(wv)) = (&lw.wk, &lw.wv) {
            let outs = [(&b.q, &lw.bq), (&b.k, &lw.bk), (&b.v, &lw.bv)];
            team_product(m, &[&lw.wq, wk, wv], h, acts, &outs);
        } else {
            team_product(m, &[&lw.wq], h, acts, &[(&b.q, &lw.bq)]);
        }
        m.sync();
        // SAFETY: q/k/v are complete and nobody writes them until the next layer.
        let (q, k, v) = unsafe { (b.q.all(), b.k.all(), b.v.all()) };
        if has_kv {
            check_finite_kv(k, v, l, pos)?;
        }
        let src = self.kv_source[l];
        if m.id == 0 {
            // SAFETY: the other members wait at the sync below and hold no reference to
            // the cache or the tables (their last ones ended before the previous sync).
            let (cache, tables) = unsafe { (b.cache.get_mut(), b.tables.get_mut()) };
            // Per-head q/k norms on member 0's own copies (the others may still be reading
            // `q`/`k` for the finiteness check above).
            let normed = |x: &[f32], w: &Option<Vec<f32>>| -> Option<Vec<f32>> {
                w.as_ref().map(|w| {
                    let mut x = x.to_vec();
                    ops::head_rmsnorm(&mut x, w, c.rms_norm_eps);
                    x
                })
            };
            let (qn, kn) = (normed(q, &lw.q_norm), normed(k, &lw.k_norm));
            let (q, k) = (qn.as_deref().unwrap_or(q), kn.as_deref().unwrap_or(k));
            if has_kv {
                append_kv(c, &self.ropes[l], cache.layer_mut(l), k, v, pos, tables);
            }
            prepare_step(c, &self.ropes[l], cache.layer(src), q, pos, tables);
        }
        m.sync();
        let width = c.group() * c.head_dim;
        m.claim_each(c.n_kv_heads, |h| {
            // SAFETY: nobody changes the cache or the tables until the sync below; each
            // KV head is claimed once, with its scratch and its rows of `att`.
            let (cache, tables) = unsafe { (b.cache.get(), b.tables.get()) };
            let hs: &mut [HeadScratch] = unsafe { b.heads.range_mut(h..h + 1) };
            let out = unsafe { b.att.range_mut(h * width..(h + 1) * width) };
            attend_heads(c, &self.ropes[l], cache.layer(src), tables, h, hs, out);
        });
        m.sync();
        if m.id == 0 {
            // SAFETY: the heads' scratch is complete; the others now only run `o_proj`,
            // which touches neither the cache nor the scratch, until later syncs.
            let (cache, heads) = unsafe { (b.cache.get_mut(), b.heads.all()) };
            if has_kv {
                observe_step(cache.layer_mut(l), heads);
            }
            if let Some(p) = &b.probs {
                // SAFETY: only member 0 ever touches the recorded weights.
                let probs = unsafe { p.get_mut() };
                let n = cache.layer(src).len();
                copy_probs(heads, c.group() * n, &mut probs[l]);
            }
        }
        Ok(())
    }

    /// Refuses a token id outside the vocabulary.
    fn check_token(&self, token: u32) -> Result<()> {
        if token as usize >= self.cfg.vocab_size {
            return Err(Error::Generate(format!(
                "token id {token} is outside the model's vocabulary ({})",
                self.cfg.vocab_size
            )));
        }
        Ok(())
    }

    /// Layer `l`'s attention for one token whose normed input is in `s.h`: projections,
    /// biases, then attention over the cache (appending this token's K/V, or reading the
    /// source layer's cache in a YOCO shared layer); the result lands in `s.att`.
    fn attention_step(&self, s: &mut Session, l: usize, pos: usize) -> Result<()> {
        let (c, lw) = (&self.cfg, &self.layers[l]);
        let probs = if s.record_probs {
            Some(&mut s.probs[l])
        } else {
            None
        };
        let (Some(wk), Some(wv)) = (&lw.wk, &lw.wv) else {
            // YOCO shared layer: the source layer already appended this token.
            matvec(&lw.wq, &s.h, &mut s.q);
            add_bias(&mut s.q, &lw.bq);
            head_norm(&mut s.q, &lw.q_norm, c.rms_norm_eps);
            let src = self.kv_source[l];
            attend_stored(
                c,
                &self.ropes[l],
                s.cache.layer(src),
                &s.q,
                pos,
                &mut s.att,
                &mut s.scratch,
                probs,
            );
            return Ok(());
        };
        matvec_many(&[&lw.wq, wk, wv], &s.h, &mut [&mut s.q, &mut s.k, &mut s.v]);
        add_bias(&mut s.q, &lw.bq);
        add_bias(&mut s.k, &lw.bk);
        add_bias(&mut s.v, &lw.bv);
        head_norm(&mut s.q, &lw.q_norm, c.rms_norm_eps);
        head_norm(&mut s.k, &lw.k_norm, c.rms_norm_eps);
        check_finite_kv(&s.k, &s.v, l, pos)?;
        attend(
            c,
            &self.ropes[l],
            s.cache.layer_mut(l),
            &s.q,
            &s.k,
            &s.v,
            pos,
            &mut s.att,
            &mut s.scratch,
            probs,
        );
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
            return self.forward_each(s, tokens, start, all_logits);
        }
        let mut b = BatchBufs::new(c, n);
        for (i, &t) in tokens.iter().enumerate() {
            self.check_token(t)?;
            self.embed_row(t, b.x_row(i));
        }
        // For each layer that shared layers read: its cache before this batch and the
        // batch's K/V rows (see `attention_rows`).
        let mut replay: Vec<Option<Replay>> = vec![None; self.layers.len()];
        for (l, lw) in self.layers.iter().enumerate() {
            norm_rows(&b.x, &lw.attn_norm, c.rms_norm_eps, &mut b.h);
            self.attention_rows(s, &mut b, l, start, &mut replay)?;
            matmul(&lw.wo, &b.att, n, &mut b.proj);
            post_norm_rows(&mut b.proj, &lw.post_attn_norm, c.rms_norm_eps);
            ops::add_assign(&mut b.x, &b.proj);
            norm_rows(&b.x, &lw.ffn_norm, c.rms_norm_eps, &mut b.h);
            matmul_many(
                &[&lw.w_gate, &lw.w_up],
                &b.h,
                n,
                &mut [&mut b.gate, &mut b.up],
            );
            b.gate
                .chunks_exact_mut(c.intermediate_size)
                .zip(b.up.chunks_exact(c.intermediate_size))
                .for_each(|(g, u)| glu(c, g, u));
            matmul(&lw.w_down, &b.gate, n, &mut b.proj);
            post_norm_rows(&mut b.proj, &lw.post_ffn_norm, c.rms_norm_eps);
            ops::add_assign(&mut b.x, &b.proj);
        }
        self.batch_logits(s, &mut b, start, all_logits)
    }

    /// [`forward_batch`](Self::forward_batch) one token at a time (when attention weights
    /// are recorded).
    fn forward_each(
        &self,
        s: &mut Session,
        tokens: &[u32],
        start: usize,
        mut all_logits: Option<&mut Vec<f32>>,
    ) -> Result<()> {
        for (i, &t) in tokens.iter().enumerate() {
            self.forward(s, t, start + i)?;
            if let Some(a) = all_logits.as_deref_mut() {
                if i == 0 {
                    a.clear();
                }
                a.extend_from_slice(&s.logits);
            }
        }
        Ok(())
    }

    /// Layer `l`'s attention for a batch of tokens whose normed inputs are in `b.h`: batched
    /// projections, then attention token by token in order (the result in `b.att`).
    ///
    /// A layer that shared layers read saves its cache before the batch and the batch's K/V
    /// rows in `replay`; a shared layer replays the appends on a copy, so its query `i` sees
    /// exactly the rows stored after token `i` (eviction and KIVI grouping included), as in
    /// token-by-token decoding.
    fn attention_rows(
        &self,
        s: &mut Session,
        b: &mut BatchBufs,
        l: usize,
        start: usize,
        replay: &mut [Option<Replay>],
    ) -> Result<()> {
        let (c, lw, n) = (&self.cfg, &self.layers[l], b.n);
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        if let (Some(wk), Some(wv)) = (&lw.wk, &lw.wv) {
            matmul_many(
                &[&lw.wq, wk, wv],
                &b.h,
                n,
                &mut [&mut b.q, &mut b.k, &mut b.v],
            );
        } else {
            matmul(&lw.wq, &b.h, n, &mut b.q);
        }
        b.q.chunks_exact_mut(qd).for_each(|r| add_bias(r, &lw.bq));
        head_norm(&mut b.q, &lw.q_norm, c.rms_norm_eps);
        let (Some(_), Some(_)) = (&lw.wk, &lw.wv) else {
            let Some((before, ks, vs)) = &replay[self.kv_source[l]] else {
                unreachable!("the source of a shared layer holds K/V and comes first");
            };
            let mut layer = before.clone();
            for i in 0..n {
                let row = i * kvd..(i + 1) * kvd;
                append_kv(
                    c,
                    &self.ropes[l],
                    &mut layer,
                    &ks[row.clone()],
                    &vs[row],
                    start + i,
                    s.scratch.split_mut().0,
                );
                attend_stored(
                    c,
                    &self.ropes[l],
                    &layer,
                    &b.q[i * qd..(i + 1) * qd],
                    start + i,
                    &mut b.att[i * qd..(i + 1) * qd],
                    &mut s.scratch,
                    None,
                );
            }
            return Ok(());
        };
        b.k.chunks_exact_mut(kvd).for_each(|r| add_bias(r, &lw.bk));
        b.v.chunks_exact_mut(kvd).for_each(|r| add_bias(r, &lw.bv));
        head_norm(&mut b.k, &lw.k_norm, c.rms_norm_eps);
        check_finite_kv(&b.k, &b.v, l, start)?;
        if self.kv_source.iter().skip(l + 1).any(|&src| src == l) {
            replay[l] = Some((s.cache.layer(l).clone(), b.k.clone(), b.v.clone()));
        }
        for i in 0..n {
            attend(
                c,
                &self.ropes[l],
                s.cache.layer_mut(l),
                &b.q[i * qd..(i + 1) * qd],
                &b.k[i * kvd..(i + 1) * kvd],
                &b.v[i * kvd..(i + 1) * kvd],
                start + i,
                &mut b.att[i * qd..(i + 1) * qd],
                &mut s.scratch,
                None,
            );
        }
        Ok(())
    }

    /// The final norm and LM head of a batch: every token's logits into `all_logits` (and
    /// the last one's into `s.logits`), or only the last token's.
    fn batch_logits(
        &self,
        s: &mut Session,
        b: &mut BatchBufs,
        start: usize,
        all_logits: Option<&mut Vec<f32>>,
    ) -> Result<()> {
        let (c, n, hd) = (&self.cfg, b.n, self.cfg.hidden_size);
        match all_logits {
            Some(all) => {
                norm_rows(&b.x, &self.norm, c.rms_norm_eps, &mut b.h);
                check_finite_hidden(&b.h, start)?;
                all.resize(n * c.vocab_size, 0.0);
                matmul(&self.lm_head, &b.h, n, all);
                s.logits
                    .copy_from_slice(&all[(n - 1) * c.vocab_size..n * c.vocab_size]);
            }
            None => {
                let last = &b.x[(n - 1) * hd..n * hd];
                ops::rmsnorm(last, &self.norm, c.rms_norm_eps, &mut s.h);
                check_finite_hidden(&s.h, start + n - 1)?;
                matvec(&self.lm_head, &s.h, &mut s.logits);
            }
        }
        Ok(())
    }
}

/// Activations of a [`Model::forward_batch`] call: `n` tokens' rows of each buffer.
struct BatchBufs {
    n: usize,
    hidden: usize,
    x: Vec<f32>,
    h: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
}

impl BatchBufs {
    fn new(c: &Config, n: usize) -> BatchBufs {
        let (hd, qd, kvd, ff) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        BatchBufs {
            n,
            hidden: hd,
            x: vec![0.0; n * hd],
            h: vec![0.0; n * hd],
            q: vec![0.0; n * qd],
            k: vec![0.0; n * kvd],
            v: vec![0.0; n * kvd],
            att: vec![0.0; n * qd],
            proj: vec![0.0; n * hd],
            gate: vec![0.0; n * ff],
            up: vec![0.0; n * ff],
        }
    }

    /// Token `i`'s residual-stream row.
    fn x_row(&mut self, i: usize) -> &mut [f32] {
        &mut self.x[i * self.hidden..(i + 1) * self.hidden]
    }
}

/// RMS-normalises each `w.len()`-wide row of `x` into the same row of `h`.
fn norm_rows(x: &[f32], w: &[f32], eps: f32, h: &mut [f32]) {
    let d = w.len();
    for (xr, hr) in x.chunks_exact(d).zip(h.chunks_exact_mut(d)) {
        ops::rmsnorm(xr, w, eps, hr);
    }
}

/// Adds the projection bias, if the layer has one.
fn add_bias(x: &mut [f32], bias: &Option<Vec<f32>>) {
    if let Some(b) = bias {
        ops::add_assign(x, b);
    }
}

/// The gated activation in place: SwiGLU, or Gemma's GeGLU (tanh-GELU).
fn glu(c: &Config, gate: &mut [f32], up: &[f32]) {
    match c.gemma.gelu_tanh {
        true => ops::geglu_tanh(gate, up),
        false => ops::swiglu(gate, up),
    }
}

/// Gemma's norm of each `hidden`-wide row of a block's output, if the layer has one.
fn post_norm_rows(x: &mut [f32], weight: &Option<Vec<f32>>, eps: f32) {
    if let Some(w) = weight {
        let mut normed = vec![0.0f32; w.len()];
        for row in x.chunks_exact_mut(w.len()) {
            ops::rmsnorm(row, w, eps, &mut normed);
            row.copy_from_slice(&normed);
        }
    }
}

/// `x += out`, `out` normed first when the layer has a post norm (a decode team member's
/// private residual stream; `out` is shared, so the norm goes through a copy).
fn add_output(x: &mut [f32], out: &[f32], post_norm: &Option<Vec<f32>>, eps: f32) {
    match post_norm {
        Some(w) => {
            let mut normed = vec![0.0f32; out.len()];
            ops::rmsnorm(out, w, eps, &mut normed);
            ops::add_assign(x, &normed);
        }
        None => ops::add_assign(x, out),
    }
}

/// Per-head RMSNorm of q or k rows (any number of whole heads), if the layer has one.
fn head_norm(x: &mut [f32], weight: &Option<Vec<f32>>, eps: f32) {
    if let Some(w) = weight {
        ops::head_rmsnorm(x, w, eps);
    }
}

/// The buffers of one decode team step, shared by its members ([`crate::team`]). Who
/// writes what, per layer (every other access is a read of a complete buffer):
///
/// 1. each member the rows it claims of `q`, `k`, `v` — sync;
/// 2. member 0 the cache (append) and `tables` (prepare) — sync;
/// 3. each member the KV heads it claims: their `heads` and rows of `att` — sync;
/// 4. member 0 the cache again (an observing policy) and `probs`; each member its rows
///    of `proj` — sync;
/// 5. each member its rows of `gate`, `up` — sync;
/// 6. each member its rows of `proj` — sync.
///
/// After the last layer each member writes its rows of `logits`.
struct TeamBufs<'a> {
    /// the token's embedding (each member copies it into its own residual stream)
    x0: &'a [f32],
    q: SharedSlice<'a, f32>,
    k: SharedSlice<'a, f32>,
    v: SharedSlice<'a, f32>,
    att: SharedSlice<'a, f32>,
    proj: SharedSlice<'a, f32>,
    gate: SharedSlice<'a, f32>,
    up: SharedSlice<'a, f32>,
    logits: SharedSlice<'a, f32>,
    cache: SharedCell<'a, KvCache>,
    tables: SharedCell<'a, StepTables>,
    heads: SharedSlice<'a, HeadScratch>,
    probs: Option<SharedCell<'a, Vec<Vec<f32>>>>,
}

/// `x` quantised into `acts` if any of `mats` reads 8-bit activations.
fn quantize_for<'a>(
    mats: &[&Matrix],
    x: &[f32],
    acts: &'a mut QuantizedActs,
) -> Option<&'a QuantizedActs> {
    needs_quantized_input(mats).then(|| {
        acts.quantize(x);
        &*acts
    })
}

/// This member's share of `outs[i] = mats[i] · x` (plus bias), on the calling thread.
fn team_product(
    m: &Member,
    mats: &[&Matrix],
    x: &[f32],
    acts: &mut QuantizedActs,
    outs: &[(&SharedSlice<f32>, &Option<Vec<f32>>)],
) {
    let q = quantize_for(mats, x, acts);
    let parts = row_parts(mats, m.n);
    m.claim_each(parts, |k| {
        row_part(mats, k, parts, |i, r| {
            // SAFETY: each part is claimed once and the outputs are read only after the
            // caller's next sync.
            let o = unsafe { outs[i].0.range_mut(r.clone()) };
            rows_into(mats[i], x, q, r.start, o);
            if let Some(bias) = outs[i].1 {
                ops::add_assign(o, &bias[r]);
            }
        })
    });
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
/// Dequantisation here is the reference's own (`tinygpt_reference::ggml`), not the engine's
/// [`crate::dequant`], so a bug in either shows up as a difference.
pub fn reference_model(
    files: &ModelFiles,
    wdtype: WeightsDType,
) -> Result<tinygpt_reference::Model> {
    use tinygpt_reference::model::{LayerWeights, Linear, Weights};
    use tinygpt_reference::ndarray::Array2;
    // The reference model is built with the reference's own dequantisers, so a bug in
    // either side's block decoding shows up as a difference.
    let f32s = |t: &Tensor| -> Result<Vec<f32>> {
        let mut out = vec![0.0f32; t.numel()];
        tinygpt_reference::ggml::dequantize_row(t.dtype, t.data.bytes(), &mut out)
            .map_err(|e| Error::tensor(&files.path, &t.name, e.to_string()))?;
        Ok(out)
    };
    let t = ModelTensors::collect(files)?;
    let matrix = |t: &Tensor, values: Vec<f32>| -> Result<Array2<f32>> {
        let error = |msg: String| Error::tensor(&files.path, &t.name, msg);
        match t.shape[..] {
            [rows, cols] => {
                Array2::from_shape_vec((rows, cols), values).map_err(|e| error(e.to_string()))
            }
            _ => Err(error(format!("shape {:?} is not a matrix", t.shape))),
        }
    };
    let m = |t: &Tensor| -> Result<Linear> {
        Ok(match wdtype {
            WeightsDType::Native if t.dtype.is_quantized() => Linear::Ggml {
                ty: t.dtype,
                cols: t.shape[1],
                bytes: t.data.bytes().to_vec(),
            },
            WeightsDType::Bf16 => Linear::F32(matrix(t, f32s(&t.converted(DType::BF16))?)?),
            _ => Linear::F32(matrix(t, f32s(t)?)?),
        })
    };
    let embed_f32 = match wdtype {
        WeightsDType::Bf16 => f32s(&t.embed.converted(DType::BF16))?,
        _ => f32s(t.embed)?,
    };
    let offset = files.config.gemma.norm_offset;
    let norm = |t: &Tensor| -> Result<tinygpt_reference::ndarray::Array1<f32>> {
        let mut w = f32s(t)?;
        if offset != 0.0 {
            w.iter_mut().for_each(|x| *x += offset);
        }
        Ok(w.into())
    };
    let layers = t
        .layers
        .iter()
        .map(|l| {
            Ok(LayerWeights {
                attn_norm: norm(l.attn_norm)?,
                wq: m(l.wq)?,
                wk: l.wk.map(m).transpose()?,
                wv: l.wv.map(m).transpose()?,
                wo: m(l.wo)?,
                bq: l.bq.map(f32s).transpose()?.map(Into::into),
                bk: l.bk.map(f32s).transpose()?.map(Into::into),
                bv: l.bv.map(f32s).transpose()?.map(Into::into),
                q_norm: l.q_norm.map(norm).transpose()?,
                k_norm: l.k_norm.map(norm).transpose()?,
                post_attn_norm: l.post_attn_norm.map(norm).transpose()?,
                post_ffn_norm: l.post_ffn_norm.map(norm).transpose()?,
                ffn_norm: norm(l.ffn_norm)?,
                w_gate: m(l.w_gate)?,
                w_up: m(l.w_up)?,
                w_down: m(l.w_down)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let weights = Weights {
        tied_head: match t.lm_head {
            None if t.embed.dtype.is_quantized() && wdtype == WeightsDType::Native => {
                Some(m(t.embed)?)
            }
            _ => None,
        },
        embed: matrix(t.embed, embed_f32)?,
        layers,
        norm: norm(t.norm)?,
        lm_head: t.lm_head.map(m).transpose()?,
    };
    Ok(tinygpt_reference::Model::new(files.config.clone(), weights))
}

/// One sequence's share of a [`Model::forward_sequences`] step: `tokens` run at positions
/// `start..start + tokens.len()` against `session`'s own cache (a prompt chunk, or the one
/// token a decoding sequence sampled last).
pub struct SeqStep<'s> {
    pub session: &'s mut Session,
    pub tokens: &'s [u32],
    pub start: usize,
}

impl Model {
    /// Continuous batching: advances several independent sequences in one forward pass.
    /// The tokens of every sequence are stacked into one `(n, hidden)` activation, so each
    /// projection and MLP matrix is read once per step for all of them ([`matmul`];
    /// [`matmul_many`] for q/k/v and gate/up, which share one quantisation of the tokens);
    /// attention runs per sequence, token by token in order, against that sequence's cache
    /// at its own positions (sequences in parallel: they share nothing). The LM head is one
    /// product for every sequence's last token, written straight into each session's
    /// `logits` ([`matmul_rows`]).
    ///
    /// Every value equals what [`forward`](Self::forward) gives for that sequence alone,
    /// token after token, bit for bit ([`matmul`] computes each token's row as [`matvec`]
    /// does), so a sequence's output does not depend on what else is in the batch.
    pub fn forward_sequences(&self, steps: &mut [SeqStep<'_>]) -> Result<()> {
        use rayon::prelude::*;
        let c = &self.cfg;
        let (hd, qd, kvd, ff) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        // Row offset of each sequence's first token in the stacked activations.
        let mut offsets = Vec::with_capacity(steps.len());
        let mut n = 0usize;
        for st in steps.iter() {
            offsets.push(n);
            n += st.tokens.len();
        }
        if steps.iter().any(|st| st.tokens.is_empty()) {
            return Err(Error::Generate(
                "a sequence in a batched step has no token to run".into(),
            ));
        }
        if n == 0 {
            return Ok(());
        }
        if self.cfg.num_kv_shared_layers > 0 && steps.iter().any(|st| st.tokens.len() > 1) {
            // A YOCO shared layer's query `i` may see its source layer's rows only up to
            // token `i`, which `forward_batch` ensures by replaying the source's appends.
            // Multi-token steps (prompt chunks) go through it one sequence at a time; the
            // single-token steps stay batched.
            let mut singles = Vec::with_capacity(steps.len());
            for st in steps.iter_mut() {
                if st.tokens.len() > 1 {
                    self.forward_batch(st.session, st.tokens, st.start, None)?;
                } else {
                    singles.push(SeqStep {
                        session: &mut *st.session,
                        tokens: st.tokens,
                        start: st.start,
                    });
                }
            }
            return self.forward_sequences(&mut singles);
        }
        // (n, hidden) stacked residual stream
        let mut x = vec![0.0f32; n * hd];
        for (st, &o) in steps.iter().zip(&offsets) {
            for (i, &t) in st.tokens.iter().enumerate() {
                if t as usize >= c.vocab_size {
                    return Err(Error::Generate(format!(
                        "token id {t} is outside the model's vocabulary ({})",
                        c.vocab_size
                    )));
                }
                self.embed_row(t, &mut x[(o + i) * hd..(o + i + 1) * hd]);
            }
        }
        let mut h = vec![0.0f32; n * hd]; // (n, hidden)
        let mut q = vec![0.0f32; n * qd]; // (n, n_heads * head_dim)
        let mut k = vec![0.0f32; n * kvd]; // (n, n_kv_heads * head_dim)
        let mut v = vec![0.0f32; n * kvd];
        let mut att = vec![0.0f32; n * qd];
        let mut proj = vec![0.0f32; n * hd];
        let mut gate = vec![0.0f32; n * ff]; // (n, intermediate)
        let mut up = vec![0.0f32; n * ff];
        let norm_rows = |x: &[f32], w: &[f32], h: &mut [f32]| {
            for (xr, hr) in x.chunks_exact(hd).zip(h.chunks_exact_mut(hd)) {
                ops::rmsnorm(xr, w, c.rms_norm_eps, hr);
            }
        };
        for (l, lw) in self.layers.iter().enumerate() {
            norm_rows(&x, &lw.attn_norm, &mut h);
            // `None` in a YOCO shared layer: it computes no K/V (every step here has one
            // token then, see above) and reads its source layer's cache.
            let shared_source = match (&lw.wk, &lw.wv) {
                (Some(wk), Some(wv)) => {
                    matmul_many(&[&lw.wq, wk, wv], &h, n, &mut [&mut q, &mut k, &mut v]);
                    None
                }
                _ => {
                    matmul(&lw.wq, &h, n, &mut q);
                    Some(self.kv_source[l])
                }
            };
            let mut biases = vec![(&lw.bq, &mut q, qd)];
            if shared_source.is_none() {
                biases.extend([(&lw.bk, &mut k, kvd), (&lw.bv, &mut v, kvd)]);
            }
            for (b, buf, d) in biases {
                if let Some(b) = b {
                    buf.chunks_exact_mut(d).for_each(|r| ops::add_assign(r, b));
                }
            }
            head_norm(&mut q, &lw.q_norm, c.rms_norm_eps);
            if shared_source.is_none() {
                head_norm(&mut k, &lw.k_norm, c.rms_norm_eps);
            }
            if shared_source.is_none() {
                check_finite_kv(&k, &v, l, steps[0].start)?;
            }
            // Split `att` into each sequence's rows, then attend per sequence.
            let mut att_parts: Vec<&mut [f32]> = Vec::with_capacity(steps.len());
            let mut rest: &mut [f32] = &mut att;
            for st in steps.iter() {
                let (a, r) = rest.split_at_mut(st.tokens.len() * qd);
                att_parts.push(a);
                rest = r;
            }
            let (q, k, v) = (&q, &k, &v);
            let one = |(st, (o, a)): (&mut SeqStep<'_>, (&usize, &mut &mut [f32]))| {
                let s = &mut *st.session;
                for i in 0..st.tokens.len() {
                    let r = o + i;
                    let out = &mut a[i * qd..(i + 1) * qd];
                    let q = &q[r * qd..(r + 1) * qd];
                    match shared_source {
                        None => attend(
                            c,
                            &self.ropes[l],
                            s.cache.layer_mut(l),
                            q,
                            &k[r * kvd..(r + 1) * kvd],
                            &v[r * kvd..(r + 1) * kvd],
                            st.start + i,
                            out,
                            &mut s.scratch,
                            None,
                        ),
                        Some(src) => attend_stored(
                            c,
                            &self.ropes[l],
                            s.cache.layer(src),
                            q,
                            st.start + i,
                            out,
                            &mut s.scratch,
                            None,
                        ),
                    }
                }
            };
            if steps.len() > 1 && rayon::current_num_threads() > 1 {
                steps
                    .par_iter_mut()
                    .zip(offsets.par_iter().zip(att_parts.par_iter_mut()))
                    .for_each(one);
            } else {
                steps
                    .iter_mut()
                    .zip(offsets.iter().zip(att_parts.iter_mut()))
                    .for_each(one);
            }
            matmul(&lw.wo, &att, n, &mut proj);
            post_norm_rows(&mut proj, &lw.post_attn_norm, c.rms_norm_eps);
            ops::add_assign(&mut x, &proj);
            norm_rows(&x, &lw.ffn_norm, &mut h);
            matmul_many(&[&lw.w_gate, &lw.w_up], &h, n, &mut [&mut gate, &mut up]);
            // Row by row, so the SIMD/tail split of each row is the one `forward` sees.
            gate.chunks_exact_mut(ff)
                .zip(up.chunks_exact(ff))
                .for_each(|(g, u)| glu(c, g, u));
            matmul(&lw.w_down, &gate, n, &mut proj);
            post_norm_rows(&mut proj, &lw.post_ffn_norm, c.rms_norm_eps);
            ops::add_assign(&mut x, &proj);
        }
        // The LM head for each sequence's last token only: (B, hidden) -> (B, vocab).
        let b = steps.len();
        let mut last = vec![0.0f32; b * hd];
        for ((st, &o), hr) in steps.iter().zip(&offsets).zip(last.chunks_exact_mut(hd)) {
            let r = o + st.tokens.len() - 1;
            ops::rmsnorm(&x[r * hd..(r + 1) * hd], &self.norm, c.rms_norm_eps, hr);
            check_finite_hidden(hr, st.start + st.tokens.len() - 1)?;
        }
        let mut logits: Vec<&mut [f32]> = steps
            .iter_mut()
            .map(|st| &mut st.session.logits[..])
            .collect();
        matmul_rows(&self.lm_head, &last, &mut logits);
        Ok(())
    }
}
