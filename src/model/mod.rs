//! The engine's forward pass (Llama, Qwen2/3, Gemma 3 families), written once.
//!
//! [`Model::step`] is the layer program: every stage of every layer in order. It runs on an
//! execution strategy ([`Exec`]): [`rows`] holds every token of a set of sequences as rows
//! (a decode step, a prefill chunk and a serve batch are the same code with different row
//! counts, each product a rayon fork/join); [`relay_step`] is one member of the decode
//! team (one token, every member running the whole step and taking items of each product
//! and of attention, without barriers: [`crate::relay`]). The entry points
//! [`Model::forward`] (one token), [`Model::forward_batch`] (a prompt chunk) and
//! [`Model::forward_sequences`] (a serve step) only pick the strategy and the rows. Every
//! strategy gives the same values bit for bit.
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

use crate::attention::{AttnScratch, RopeTable};
use crate::config::Config;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::exec::ExecOptions;
use crate::kv_cache::{KvCache, KvConfig, LayerKv};
use crate::ops::{self, Matrix};
use crate::threads;
use crate::weights::ModelTensors;
use crate::weights::{ModelFiles, Tensor};
use crate::wkernels::Kernel;

pub mod profile;
#[cfg(feature = "reference-engine")]
mod reference;
mod relay_step;
mod rows;

pub use profile::{OpTime, StepProfile};
#[cfg(feature = "reference-engine")]
pub use reference::reference_model;

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
    /// How it executes: the weight kernel it was loaded for, and what each new session
    /// starts with (KIVI kernel, team, split, adaptive choice).
    opts: ExecOptions,
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
    /// What this sequence's team steps keep from step to step (made at the first one,
    /// [`relay_step`]).
    relay: relay_step::RelayScratch,
    /// One token's activations, kept from step to step (a decode step's buffers; a
    /// multi-token step allocates its own).
    bufs: StepBufs,
    /// The adaptive thread choice of this sequence's decode steps.
    pace: threads::Pace,
    pub logits: Vec<f32>,
    /// When set, `probs[l]` holds the last step's attention weights, `(n_heads, stored)`,
    /// for every model layer (a shared layer's over the rows of the cache it reads).
    pub record_probs: bool,
    pub probs: Vec<Vec<f32>>,
    /// Whether a decode team splits attention within KV heads (the same results bit for
    /// bit either way; tests force both paths). Starts as the model's
    /// [`ExecOptions::attn_split`].
    pub attn_split: crate::attention::AttnSplit,
    /// Whether a decode step may run as a team (same bits either way). Starts as the
    /// model's [`ExecOptions::team`].
    pub team: bool,
    /// Whether steps choose between the team and one thread by measured speed, and
    /// batches run alone on a crowded machine (same bits either way). Starts as the
    /// model's [`ExecOptions::adaptive`].
    pub adaptive: bool,
}

fn matrix(t: &Tensor, want: WeightsDType, kernel: Kernel) -> Matrix {
    let target = match want {
        WeightsDType::Native => t.dtype,
        WeightsDType::F32 => DType::F32,
        WeightsDType::Bf16 => DType::BF16,
    };
    Matrix::from_tensor(&t.converted(target), kernel)
}

impl Session {
    /// The adaptive thread choice of this sequence's decode steps (how many ran as a team
    /// and alone: [`threads::Pace::runs`]).
    pub fn pace(&self) -> &threads::Pace {
        &self.pace
    }

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
    /// Builds the engine model from loaded files with the default options
    /// ([`ExecOptions::default`]: the fastest kernels, the team on).
    pub fn load(files: &ModelFiles, wdtype: WeightsDType) -> Result<Model> {
        Model::load_opts(files, wdtype, &ExecOptions::default())
    }

    /// Builds the engine model from loaded files with the default options but the weight
    /// kernel variant `kernel` (a variant this CPU lacks runs the scalar twins).
    pub fn load_with(files: &ModelFiles, wdtype: WeightsDType, kernel: Kernel) -> Result<Model> {
        Model::load_kernel(files, wdtype, kernel, ExecOptions::default())
    }

    /// Builds the engine model from loaded files with `opts`: every weight matrix's kernels
    /// resolved once, here, for `opts.kernel`; its sessions start with `opts`' KIVI
    /// kernel, team, split and adaptive choice. An invalid `opts` is an error naming its
    /// flag ([`ExecOptions::validate`]).
    pub fn load_opts(
        files: &ModelFiles,
        wdtype: WeightsDType,
        opts: &ExecOptions,
    ) -> Result<Model> {
        opts.validate()?;
        Model::load_kernel(files, wdtype, opts.kernel.resolve(), *opts)
    }

    /// The options the model was loaded with.
    pub fn options(&self) -> &ExecOptions {
        &self.opts
    }

    fn load_kernel(
        files: &ModelFiles,
        wdtype: WeightsDType,
        kernel: Kernel,
        opts: ExecOptions,
    ) -> Result<Model> {
        let mat = |t: &Tensor| matrix(t, wdtype, kernel);
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
                wq: mat(l.wq),
                wk: l.wk.map(mat),
                wv: l.wv.map(mat),
                wo: mat(l.wo),
                bq: l.bq.map(vecf),
                bk: l.bk.map(vecf),
                bv: l.bv.map(vecf),
                q_norm: l.q_norm.map(norm),
                k_norm: l.k_norm.map(norm),
                ffn_norm: norm(l.ffn_norm),
                post_attn_norm: l.post_attn_norm.map(norm),
                post_ffn_norm: l.post_ffn_norm.map(norm),
                w_gate: mat(l.w_gate),
                w_up: mat(l.w_up),
                w_down: mat(l.w_down),
            })
            .collect();
        let embed = mat(t.embed);
        let mut lm_head = match t.lm_head {
            Some(h) => mat(h),
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
            opts,
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

    /// A fresh decoding session with an empty cache, on the model's options (its KIVI
    /// kernel variant, resolved here once for the session; its team, split and adaptive
    /// choice, which the session may change).
    pub fn session(&self, kv: &KvConfig) -> Session {
        let c = &self.cfg;
        let o = &self.opts;
        Session {
            cache: new_cache(c, kv),
            scratch: AttnScratch::with_kernel(c, kv, o.kv_kernel.resolve()),
            relay: relay_step::RelayScratch::default(),
            bufs: StepBufs::new(c, 1),
            pace: threads::Pace::default(),
            logits: vec![0.0; c.vocab_size],
            record_probs: false,
            probs: vec![Vec::new(); c.n_layers],
            attn_split: o.attn_split,
            team: o.team,
            adaptive: o.adaptive,
        }
    }

    /// Runs token `token` at absolute position `pos`; the logits land in `s.logits`.
    ///
    /// One sequence, one token: a case of [`step`](Self::step). With more than one thread
    /// in the current rayon pool it runs as a decode team ([`relay_step`]; same values bit
    /// for bit; [`Session::team`] off turns it off: one fork/join per product), so it must not
    /// be called from inside a parallel region of that pool. A session whose eviction
    /// policy observes attention's weights runs on the pool as rows; a step whose team
    /// cannot start its helper threads runs on the calling thread alone.
    ///
    /// With [`Session::adaptive`] on (the CLI's default when `--threads` is not given), each
    /// step runs either as the team or on the calling thread alone, whichever the
    /// session's measured step times say is faster just now ([`threads::Pace`]): a team
    /// whose member lost its core to another process can be slower than one thread.
    pub fn forward(&self, s: &mut Session, token: u32, pos: usize) -> Result<()> {
        let n = threads::current();
        if n == 1 || !s.team || !relay_step::supports(s, n) {
            return self.forward_rows(s, token, pos);
        }
        self.check_token(token)?;
        let mode = match s.adaptive {
            // The relay takes a late member's work over instead of waiting for it: it is
            // probed, and chosen when faster, crowded or not.
            true => s.pace.next(|| false),
            false => threads::Mode::Team,
        };
        let t0 = std::time::Instant::now();
        let team = match mode {
            threads::Mode::Team => relay_step::run_step(self, s, token, pos, n),
            threads::Mode::Solo => None,
        };
        let (ran, result) = match team {
            Some(result) => (threads::Mode::Team, result),
            // One thread: chosen, or the team's helper threads could not be started.
            None => (
                threads::Mode::Solo,
                threads::solo(|| self.forward_rows(s, token, pos)),
            ),
        };
        s.pace.record(ran, t0.elapsed());
        result
    }

    /// [`forward`](Self::forward) as rows (one sequence, one token).
    fn forward_rows(&self, s: &mut Session, token: u32, pos: usize) -> Result<()> {
        let mut steps = [SeqStep {
            session: s,
            tokens: &[token],
            start: pos,
            all_logits: None,
        }];
        self.forward_sequences(&mut steps)
    }

    /// Prefill: runs `tokens` at positions `start..start + tokens.len()` with batched
    /// matrix products (each weight row read once per tile of tokens) and per-token
    /// attention in order, so the cache ends exactly as after token-by-token decoding.
    /// `s.logits` receives the last token's logits; `all_logits`, if given, receives
    /// `(tokens, vocab)`. Every value equals the token-by-token forward's bit for bit.
    ///
    /// With [`Session::adaptive`] on and another process holding a core the pool needs, the
    /// batch runs on the calling thread alone ([`threads::batch`]; same values).
    pub fn forward_batch(
        &self,
        s: &mut Session,
        tokens: &[u32],
        start: usize,
        all_logits: Option<&mut Vec<f32>>,
    ) -> Result<()> {
        if tokens.is_empty() {
            return Ok(());
        }
        let adaptive = s.adaptive;
        let mut steps = [SeqStep {
            session: s,
            tokens,
            start,
            all_logits,
        }];
        threads::batch(adaptive, || rows::run(self, &mut steps))
    }

    /// Continuous batching: advances several independent sequences in one forward pass.
    /// The tokens of every sequence are stacked into one `(n, hidden)` activation, so each
    /// projection and MLP matrix is read once per step for all of them ([`matmul`];
    /// [`matmul_many`] for q/k/v and gate/up, which share one quantisation of the tokens);
    /// attention runs per sequence, token by token in order, against that sequence's cache
    /// at its own positions (sequences in parallel: they share nothing). The LM head is one
    /// product for every sequence's last token, written straight into each session's
    /// `logits` ([`matmul_rows`]), and for every token of a sequence whose
    /// [`SeqStep::all_logits`] is set (a speculative verification pass in `serve`).
    ///
    /// Every value equals what [`forward`](Self::forward) gives for that sequence alone,
    /// token after token, bit for bit ([`matmul`] computes each token's row as [`matvec`]
    /// does), so a sequence's output does not depend on what else is in the batch. Like
    /// [`forward_batch`](Self::forward_batch), it runs alone on a crowded machine
    /// ([`threads::batch`]) when every session's [`Session::adaptive`] is on.
    pub fn forward_sequences(&self, steps: &mut [SeqStep<'_>]) -> Result<()> {
        let adaptive = !steps.is_empty() && steps.iter().all(|st| st.session.adaptive);
        threads::batch(adaptive, || rows::run(self, steps))
    }

    /// The forward pass, written once: every layer's stages in order, each run by the
    /// strategy `e` ([`Exec`]) on the rows it holds. [`rows`] holds every token of a set of
    /// sequences (serial decode, prefill, serve batches); [`relay_step`] is one member of
    /// the decode team running one token. Stages that need a token's whole vector (norms,
    /// residual adds) see it in full in either.
    fn step<'m, E: Exec<'m>>(&'m self, e: &mut E) -> Result<()> {
        let eps = self.cfg.rms_norm_eps;
        for (l, lw) in self.layers.iter().enumerate() {
            e.norm(&lw.attn_norm, eps);
            match (&lw.wk, &lw.wv) {
                (Some(wk), Some(wv)) => {
                    e.project(&[&lw.wq, wk, wv], [&lw.bq, &lw.bk, &lw.bv]);
                    e.check_kv(l)?;
                    e.head_norms(&lw.q_norm, &lw.k_norm, eps);
                    e.attend(self, l, Kv::Own)?;
                }
                // YOCO shared layer: no K/V of its own; its source layer already appended
                // this step's rows.
                _ => {
                    e.project(&[&lw.wq], [&lw.bq, &None, &None]);
                    e.head_norms(&lw.q_norm, &None, eps);
                    e.attend(self, l, Kv::Shared(self.kv_source[l]))?;
                }
            }
            e.residual(&lw.wo, Input::Att, &lw.post_attn_norm, eps);
            e.norm(&lw.ffn_norm, eps);
            e.gated(&self.cfg, &lw.w_gate, &lw.w_up);
            e.residual(&lw.w_down, Input::Gate, &lw.post_ffn_norm, eps);
        }
        let cap = self.cfg.gemma.final_logit_softcapping;
        e.logits(&self.norm, eps, &self.lm_head, cap)
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
}

/// Which cache a layer's attention reads.
#[derive(Clone, Copy)]
enum Kv {
    /// Its own: append this step's K/V, then attend.
    Own,
    /// That of the layer given (YOCO), which appended this step's rows already.
    Shared(usize),
}

/// The input of a [`Exec::residual`] product.
#[derive(Clone, Copy)]
enum Input {
    /// the attention output (`o_proj`)
    Att,
    /// the gated MLP activation (`down_proj`)
    Gate,
}

/// An execution strategy of [`Model::step`]: the rows it holds and how it runs each
/// stage on them. Buffers: `x` the residual stream, `h` its normed copy, `q`/`k`/`v`,
/// `att` the attention output, `gate`/`up` the MLP, `proj` a block's output. `'m` is the
/// model's borrow: a strategy may keep its weights from one stage to a later one.
trait Exec<'m> {
    /// `h = rmsnorm(x) · w`, row by row.
    fn norm(&mut self, w: &'m [f32], eps: f32);
    /// `q, k, v = mats · h + biases` (`q` only when `mats` has one matrix).
    fn project(&mut self, mats: &[&'m Matrix], biases: [&'m Option<Vec<f32>>; 3]);
    /// Refuses a non-finite K/V row of layer `l`.
    fn check_kv(&mut self, l: usize) -> Result<()>;
    /// Per-head RMSNorm of `q` and `k` (Qwen3, Gemma 3), where the layer has one.
    fn head_norms(&mut self, q_norm: &'m Option<Vec<f32>>, k_norm: &'m Option<Vec<f32>>, eps: f32);
    /// Layer `l`'s attention: this step's K/V appended (`Kv::Own`), then every query
    /// attends over the cache it reads, token by token in order, into `att`.
    fn attend(&mut self, model: &'m Model, l: usize, kv: Kv) -> Result<()>;
    /// `x += post_norm(w · input)`.
    fn residual(&mut self, w: &'m Matrix, input: Input, post_norm: &'m Option<Vec<f32>>, eps: f32);
    /// `gate = glu(w_gate · h, w_up · h)` (SwiGLU or GeGLU, [`glu`]).
    fn gated(&mut self, c: &'m Config, w_gate: &'m Matrix, w_up: &'m Matrix);
    /// The final norm, its finiteness check and the LM head into the logits, soft-capped
    /// when `cap` is given ([`soft_cap`]).
    fn logits(
        &mut self,
        norm: &'m [f32],
        eps: f32,
        lm_head: &'m Matrix,
        cap: Option<f32>,
    ) -> Result<()>;
}

/// One sequence's share of a [`Model::forward_sequences`] step: `tokens` run at positions
/// `start..start + tokens.len()` against `session`'s own cache (a prompt chunk, or the one
/// token a decoding sequence sampled last).
pub struct SeqStep<'s> {
    pub session: &'s mut Session,
    pub tokens: &'s [u32],
    pub start: usize,
    /// When set, receives every token's logits, `(tokens, vocab)` (a speculative
    /// verification pass); `None`, only the last token's are computed, into
    /// `session.logits` (which gets the last row in either case).
    pub all_logits: Option<&'s mut Vec<f32>>,
}

/// Activations of a step: `n` tokens' rows of each buffer.
#[derive(Default)]
struct StepBufs {
    n: usize,
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

impl StepBufs {
    fn new(c: &Config, n: usize) -> StepBufs {
        let (hd, qd, kvd, ff) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
        StepBufs {
            n,
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

    /// `old` if it holds `n` rows, else new buffers.
    fn reuse(old: StepBufs, c: &Config, n: usize) -> StepBufs {
        match old.n == n && !old.x.is_empty() {
            true => old,
            false => StepBufs::new(c, n),
        }
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

/// Final logit soft-capping (Gemma's `final_logit_softcapping`) in place, when `cap` is
/// given: each logit `v` becomes [`ops::soft_cap`]`(v, cap)` (`cap · tanh(v / cap)`, the
/// reference's steps, bit for bit). Element by element, so how the logits are split
/// between threads does not change them.
fn soft_cap(logits: &mut [f32], cap: Option<f32>) {
    if let Some(cap) = cap {
        for v in logits {
            *v = ops::soft_cap(*v, cap);
        }
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

/// `x += out`, `out` normed first (into `normed`) when the layer has a post norm (the
/// decode team's residual stream; `out` is shared, so the norm goes through a copy).
fn add_output(
    x: &mut [f32],
    out: &[f32],
    post_norm: &Option<Vec<f32>>,
    eps: f32,
    normed: &mut Vec<f32>,
) {
    match post_norm {
        Some(w) => {
            normed.resize(out.len(), 0.0);
            ops::rmsnorm(out, w, eps, normed);
            ops::add_assign(x, normed);
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
