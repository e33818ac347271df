//! The prefill/decode loop shared by both engines, with timing and cache statistics.

use crate::error::{Error, Result};
use crate::kv_cache::KvConfig;
use crate::model::{Model, Session};
use crate::sampler::{Sampler, SamplerConfig};
use crate::tokenizer::{StreamDecoder, Tokenizer};
use std::time::Instant;

/// Something that turns (token, position) into logits while keeping a KV cache.
pub trait Engine {
    /// Runs one token; returns the logits over the vocabulary.
    fn forward(&mut self, token: u32, pos: usize) -> Result<&[f32]>;
    /// Bytes the KV cache holds now, counted from its buffers.
    fn kv_bytes(&self) -> usize;
    /// Rows held now by the layer that holds the most.
    fn stored_tokens(&self) -> usize;
    /// Layers that hold their own K/V (`n_layers − num_kv_shared_layers`).
    fn layers_with_kv(&self) -> usize;
    /// Turns on recording of attention weights (sink report).
    fn set_record_probs(&mut self, on: bool);
    /// Last step's attention weights per model layer, `(n_heads, stored)`.
    fn probs(&self) -> &[Vec<f32>];
    /// Absolute positions of the rows model layer `l` attends over (its own cache, or for a
    /// YOCO shared layer the cache it reads), oldest first.
    fn positions(&self, l: usize) -> Vec<usize>;
    /// Empties the cache (a new sequence).
    fn reset(&mut self);
    /// Runs a run of prompt tokens starting at `start`; returns the last token's logits.
    /// Engines with a batched path override this; the result must equal stepping
    /// through [`forward`](Self::forward).
    fn prefill(&mut self, tokens: &[u32], start: usize) -> Result<&[f32]> {
        debug_assert!(!tokens.is_empty());
        for (i, &t) in tokens[..tokens.len() - 1].iter().enumerate() {
            self.forward(t, start + i)?;
        }
        self.forward(tokens[tokens.len() - 1], start + tokens.len() - 1)
    }
}

/// The optimised engine with one session.
pub struct EngineRun<'a> {
    pub model: &'a Model,
    pub session: Session,
    kv: KvConfig,
}

impl<'a> EngineRun<'a> {
    pub fn new(model: &'a Model, kv: &KvConfig) -> Self {
        EngineRun {
            session: model.session(kv),
            model,
            kv: kv.clone(),
        }
    }
}

impl Engine for EngineRun<'_> {
    fn forward(&mut self, token: u32, pos: usize) -> Result<&[f32]> {
        self.model.forward(&mut self.session, token, pos)?;
        Ok(&self.session.logits)
    }
    fn kv_bytes(&self) -> usize {
        self.session.cache.bytes()
    }
    fn stored_tokens(&self) -> usize {
        self.session.stored_tokens()
    }
    fn layers_with_kv(&self) -> usize {
        self.model.cfg.layers_with_kv()
    }
    fn set_record_probs(&mut self, on: bool) {
        self.session.record_probs = on;
    }
    fn probs(&self) -> &[Vec<f32>] {
        &self.session.probs
    }
    fn positions(&self, l: usize) -> Vec<usize> {
        let src = self.model.kv_source(l);
        self.session.cache.layer(src).positions()
    }
    fn reset(&mut self) {
        self.session = self.model.session(&self.kv);
    }
    fn prefill(&mut self, tokens: &[u32], start: usize) -> Result<&[f32]> {
        // Bounded batches keep the activation buffers small for long prompts.
        const BATCH: usize = 256;
        for (i, chunk) in tokens.chunks(BATCH).enumerate() {
            self.model
                .forward_batch(&mut self.session, chunk, start + i * BATCH, None)?;
        }
        Ok(&self.session.logits)
    }
}

/// The scalar reference with one state (`--engine reference`; in builds with the
/// `reference-engine` feature).
#[cfg(feature = "reference-engine")]
pub struct ReferenceRun<'a> {
    pub model: &'a tinygpt_reference::Model,
    pub state: tinygpt_reference::State,
    logits: Vec<f32>,
    kv: KvConfig,
}

#[cfg(feature = "reference-engine")]
impl<'a> ReferenceRun<'a> {
    pub fn new(model: &'a tinygpt_reference::Model, kv: &KvConfig) -> Self {
        let state = tinygpt_reference::State::new(&model.cfg, kv);
        ReferenceRun {
            model,
            state,
            logits: Vec::new(),
            kv: kv.clone(),
        }
    }
}

#[cfg(feature = "reference-engine")]
impl Engine for ReferenceRun<'_> {
    fn forward(&mut self, token: u32, pos: usize) -> Result<&[f32]> {
        if token as usize >= self.model.cfg.vocab_size {
            return Err(Error::Generate(format!(
                "token id {token} is outside the model's vocabulary ({})",
                self.model.cfg.vocab_size
            )));
        }
        self.logits = self.model.forward(&mut self.state, token, pos);
        Ok(&self.logits)
    }
    fn kv_bytes(&self) -> usize {
        self.state.caches.iter().map(|c| c.bytes()).sum()
    }
    fn stored_tokens(&self) -> usize {
        self.state.caches.iter().map(|c| c.len()).max().unwrap_or(0)
    }
    fn layers_with_kv(&self) -> usize {
        self.model.cfg.layers_with_kv()
    }
    fn set_record_probs(&mut self, on: bool) {
        self.state.record_probs = on;
    }
    fn probs(&self) -> &[Vec<f32>] {
        &self.state.probs
    }
    fn positions(&self, l: usize) -> Vec<usize> {
        let src = self.model.cfg.kv_source(l).unwrap_or(l);
        let c = &self.state.caches[src];
        (0..c.len()).map(|i| c.position(i)).collect()
    }
    fn reset(&mut self) {
        self.state = tinygpt_reference::State::new(&self.model.cfg, &self.kv);
    }
}

/// Settings of one generation, built (and checked) only by [`GenerateOptions::new`].
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// New tokens to generate at most.
    pub(crate) max_tokens: usize,
    /// Validated by [`GenerateOptions::new`].
    pub(crate) sampler: SamplerConfig,
    pub(crate) ignore_eos: bool,
    /// The model's context length, enforced unless the cache is bounded or
    /// `allow_past_context` is set.
    pub(crate) context_length: usize,
    pub(crate) allow_past_context: bool,
    /// The cache configuration the run will use (whether it is bounded, and how many rows
    /// it can keep).
    pub(crate) kv: KvConfig,
}

impl GenerateOptions {
    /// Settings for generating up to `max_tokens` tokens with `sampler` on a model of
    /// `context_length` positions, through a cache configured as `kv`. The sampler is
    /// validated here (the one place it is); the prompt is checked against the context
    /// with [`check_prompt`](Self::check_prompt) once its length is known.
    pub fn new(
        max_tokens: usize,
        sampler: SamplerConfig,
        ignore_eos: bool,
        kv: &KvConfig,
        context_length: usize,
        allow_past_context: bool,
    ) -> Result<GenerateOptions> {
        sampler.validate()?;
        Ok(GenerateOptions {
            max_tokens,
            sampler,
            ignore_eos,
            context_length,
            allow_past_context,
            kv: kv.clone(),
        })
    }

    /// Refuses a run of a `prompt_len`-token prompt that would pass the model's context
    /// length: with a dense cache ([`check_context`]), or with a bounded cache that keeps
    /// more rows than the context ([`check_cache_rows`]). Callers run it once, before the
    /// model is loaded where they can.
    pub fn check_prompt(&self, prompt_len: usize) -> Result<()> {
        self.check_prompt_on(prompt_len, Surface::Cli)
    }

    /// The most prompt tokens a run can take: the context length with a dense cache
    /// (unless `allow_past_context`), else `None` (a bounded cache takes any prompt).
    pub fn prompt_token_limit(&self) -> Option<usize> {
        (self.kv.window.is_none() && !self.allow_past_context).then_some(self.context_length)
    }

    /// Refuses a prompt of `bytes` bytes that cannot fit in `limit` tokens (the
    /// [`prompt_token_limit`](Self::prompt_token_limit) unless given) whatever it encodes
    /// to ([`Tokenizer::max_text_bytes`]), before spending time and memory tokenising it.
    pub fn check_prompt_bytes(
        &self,
        bytes: usize,
        tok: &crate::tokenizer::Tokenizer,
        limit: Option<usize>,
        surface: Surface,
    ) -> Result<()> {
        let Some(limit) = limit.or(self.prompt_token_limit()) else {
            return Ok(());
        };
        let max = tok.max_text_bytes(limit);
        if bytes > max {
            let (field, hint) = match surface {
                Surface::Cli => ("--prompt", "--streaming-llm-window"),
                Surface::Http => ("prompt", "streaming_llm_window"),
            };
            return Err(Error::flag(
                field,
                format!(
                    "{bytes} bytes cannot fit in {limit} tokens (this tokenizer needs at least one \
                     token per {} bytes); shorten it{}",
                    max / limit.max(1),
                    if self.prompt_token_limit() == Some(limit) {
                        format!(" or bound the cache with {hint}")
                    } else {
                        String::new()
                    }
                ),
            ));
        }
        Ok(())
    }

    /// [`check_prompt`](Self::check_prompt), with errors naming `surface`'s flags or
    /// request fields (`serve` runs the same check on every request).
    pub fn check_prompt_on(&self, prompt_len: usize, surface: Surface) -> Result<()> {
        check_context(prompt_len, self, surface)?;
        check_cache_rows_on(
            &self.kv,
            prompt_len.saturating_add(self.max_tokens),
            self.context_length,
            self.allow_past_context,
            surface,
        )
    }
}

/// What a generation produced, with its measurements.
#[derive(Debug, Clone)]
pub struct GenerateResult {
    pub prompt_ids: Vec<u32>,
    /// Empty when the run did not keep its ids ([`generate_with`]).
    pub generated_ids: Vec<u32>,
    /// Tokens generated (EOS included when generation stopped on it).
    pub generated_tokens: usize,
    /// The continuation; empty when the run did not keep it.
    pub text: String,
    pub prefill_secs: f64,
    pub decode_secs: f64,
    /// Tokens whose forward pass was timed in the decode phase.
    pub decode_steps: usize,
    pub stored_tokens: usize,
    pub current_length: usize,
    pub kv_bytes: usize,
    pub stopped_at_eos: bool,
    /// Stopped early by SIGINT.
    pub interrupted: bool,
}

impl GenerateResult {
    pub fn prefill_tok_s(&self) -> f64 {
        rate(self.prompt_ids.len(), self.prefill_secs)
    }
    pub fn decode_tok_s(&self) -> f64 {
        rate(self.decode_steps, self.decode_secs)
    }
}

fn rate(n: usize, secs: f64) -> f64 {
    if n == 0 || secs <= 0.0 {
        0.0
    } else {
        n as f64 / secs
    }
}

/// Refuses a run that would pass the context length with an unbounded cache.
/// Where a generation's settings came from: the names a refusal uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Surface {
    /// `sample` and the other subcommands: flags.
    Cli,
    /// `serve`: request fields (the server's own flags where a request cannot change them).
    Http,
}

impl Surface {
    fn tokens(self) -> &'static str {
        match self {
            Surface::Cli => "--tokens",
            Surface::Http => "max_tokens",
        }
    }
    fn window(self) -> &'static str {
        match self {
            Surface::Cli => "--streaming-llm-window",
            Surface::Http => "streaming_llm_window",
        }
    }
    fn bound_hint(self) -> &'static str {
        match self {
            Surface::Cli => "bound the cache with --streaming-llm-sink N --streaming-llm-window M",
            Surface::Http => "bound the cache with streaming_llm_sink and streaming_llm_window",
        }
    }
    fn allow_hint(self) -> &'static str {
        match self {
            Surface::Cli => "pass --allow-past-context",
            Surface::Http => "start the server with --allow-past-context",
        }
    }
}

fn check_context(prompt_len: usize, opts: &GenerateOptions, surface: Surface) -> Result<()> {
    let total = prompt_len.saturating_add(opts.max_tokens);
    let bounded_cache = opts.kv.window.is_some();
    if !bounded_cache && !opts.allow_past_context && total > opts.context_length {
        let msg = format!(
            "prompt ({prompt_len} tokens) + {} {} = {total} tokens exceeds the model's context length ({}); \
             {}, or {} to run dense attention past it anyway",
            surface.tokens(),
            opts.max_tokens,
            opts.context_length,
            surface.bound_hint(),
            surface.allow_hint(),
        );
        return Err(match surface {
            Surface::Cli => Error::Generate(msg),
            Surface::Http => Error::flag(
                if prompt_len >= opts.context_length {
                    "prompt"
                } else {
                    "max_tokens"
                },
                msg,
            ),
        });
    }
    Ok(())
}

/// Refuses a bounded (StreamingLLM) cache that would still hold more rows than the model's
/// context length: `total` tokens run, of which at most sink + window stay. A window larger
/// than the context is no bound at all (`--allow-past-context` says so explicitly).
pub fn check_cache_rows(
    kv: &KvConfig,
    total: usize,
    context_length: usize,
    allow_past_context: bool,
) -> Result<()> {
    check_cache_rows_on(kv, total, context_length, allow_past_context, Surface::Cli)
}

fn check_cache_rows_on(
    kv: &KvConfig,
    total: usize,
    context_length: usize,
    allow_past_context: bool,
    surface: Surface,
) -> Result<()> {
    let Some(window) = kv.window else {
        return Ok(());
    };
    let cap = kv.sink.saturating_add(window);
    let rows = total.min(cap);
    if !allow_past_context && rows > context_length {
        return Err(Error::flag(
            surface.window(),
            format!(
                "sink {} + window {window} would keep {rows} tokens in the cache, more than the \
                 model's context length ({context_length}); make sink + window at most \
                 {context_length}, or {}",
                kv.sink,
                surface.allow_hint()
            ),
        ));
    }
    Ok(())
}

/// Refuses non-finite logits (NaN/Inf weights, or an overflow) instead of sampling garbage.
pub fn check_finite(logits: &[f32], pos: usize) -> Result<()> {
    if let Some(i) = logits.iter().position(|x| !x.is_finite()) {
        return Err(Error::NonFinite(format!(
            "non-finite logits at position {pos} (logit {i} = {}): check the model's weights \
             (NaN/Inf in a tensor) or its activations (an overflow)",
            logits[i]
        )));
    }
    Ok(())
}

/// Prefills `prompt_ids`, then samples up to `max_tokens` new tokens. `on_text` receives
/// the decoded text as it is produced. Keeps the generated ids and text in the result
/// (memory grows with the tokens; see [`generate_with`] for a run that holds nothing).
pub fn generate(
    engine: &mut dyn Engine,
    tok: &Tokenizer,
    prompt_ids: &[u32],
    opts: &GenerateOptions,
    on_text: &mut dyn FnMut(&str),
) -> Result<GenerateResult> {
    generate_with(engine, tok, prompt_ids, opts, true, &mut |s| {
        on_text(s);
        Ok(())
    })
}

/// [`generate`] with a fallible `on_text` (an error stops the run and is returned) and a
/// choice (the prompt's length against the context is the caller's to check, with
/// [`GenerateOptions::check_prompt`]): `keep` holds `generated_ids` and `text` in the result; without it nothing grows
/// with the number of generated tokens (both stay empty; `generated_tokens` counts). Stops
/// early, with `interrupted` set, once [`crate::interrupt::requested`].
pub fn generate_with(
    engine: &mut dyn Engine,
    tok: &Tokenizer,
    prompt_ids: &[u32],
    opts: &GenerateOptions,
    keep: bool,
    on_text: &mut dyn FnMut(&str) -> Result<()>,
) -> Result<GenerateResult> {
    if prompt_ids.is_empty() {
        return Err(Error::Generate(
            "the prompt encodes to zero tokens and the tokenizer adds no BOS: give a non-empty --prompt".into(),
        ));
    }
    let mut sampler = Sampler::new(opts.sampler.clone());

    let t0 = Instant::now();
    let mut pos = prompt_ids.len();
    let logits = engine.prefill(prompt_ids, 0)?;
    check_finite(logits, pos - 1)?;
    let mut next = sampler.sample(logits);
    let prefill_secs = t0.elapsed().as_secs_f64();

    let mut generated = Vec::new();
    let mut n_generated = 0usize;
    let mut stream = StreamDecoder::new();
    let mut stopped_at_eos = false;
    let mut interrupted = false;
    let t1 = Instant::now();
    let mut decode_steps = 0usize;
    while n_generated < opts.max_tokens {
        if crate::interrupt::requested() {
            interrupted = true;
            break;
        }
        n_generated += 1;
        if keep {
            generated.push(next);
        }
        if tok.is_eos(next) && !opts.ignore_eos {
            stopped_at_eos = true;
            break;
        }
        let delta = stream.push(tok, next)?;
        if !delta.is_empty() {
            on_text(&delta)?;
        }
        if n_generated == opts.max_tokens {
            break;
        }
        let logits = engine.forward(next, pos)?;
        check_finite(logits, pos)?;
        pos += 1;
        decode_steps += 1;
        next = sampler.sample(logits);
    }
    let decode_secs = t1.elapsed().as_secs_f64();
    let text = if keep {
        let n = generated.len() - usize::from(stopped_at_eos);
        tok.decode(&generated[..n])?
    } else {
        String::new()
    };
    Ok(GenerateResult {
        prompt_ids: prompt_ids.to_vec(),
        generated_ids: generated,
        generated_tokens: n_generated,
        text,
        prefill_secs,
        decode_secs,
        decode_steps,
        stored_tokens: engine.stored_tokens(),
        current_length: pos,
        kv_bytes: engine.kv_bytes(),
        stopped_at_eos,
        interrupted,
    })
}
