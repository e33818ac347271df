//! The prefill/decode loop shared by both engines, with timing and cache statistics:
//! [`Generation`] steps it one token at a time for a caller that pulls (the Python
//! package's streaming iterator), and [`generate_with`] runs it to the end with a callback
//! (`sample`).

use crate::error::{Error, Result};
use crate::kv_cache::KvConfig;
use crate::model::{Model, Session};
use crate::sampler::{Sampler, SamplerConfig};
use crate::speculate::{DraftModel, SpecConfig, SpecStats, Speculator};
use crate::tokenizer::{StreamDecoder, Tokenizer};
use std::ops::Deref;
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
    /// The optimised engine's session (its cache and logits), to save or resume a state;
    /// `None` for an engine that has none (the reference).
    fn session(&mut self) -> Option<&mut Session> {
        None
    }
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
    /// Runs `tokens` at `start..` and writes every position's logits into `out`,
    /// `(tokens, vocab)`: the same values as [`forward`](Self::forward) token by token.
    fn forward_all(&mut self, tokens: &[u32], start: usize, out: &mut Vec<f32>) -> Result<()> {
        out.clear();
        for (i, &t) in tokens.iter().enumerate() {
            let logits = self.forward(t, start + i)?;
            out.extend_from_slice(logits);
        }
        Ok(())
    }
    /// Starts holding the rows appended from now on ([`KvCache::hold`](crate::kv_cache::KvCache::hold),
    /// docs/design.md §3.2). Engines without it refuse (speculative decoding needs it).
    fn hold(&mut self) -> Result<()> {
        Err(Error::Generate(
            "this engine cannot hold cache rows: --speculate needs the optimised engine".into(),
        ))
    }
    /// Ends the hold keeping its first `keep` rows ([`KvCache::release`](crate::kv_cache::KvCache::release)).
    fn release(&mut self, _keep: usize) {}
    /// After a release: `logits` (one row of a multi-token pass) are the logits after the
    /// last kept row, which the engine reports from now on as its last logits (a saved
    /// state stores them).
    fn keep_logits(&mut self, _logits: &[f32]) {}
}

/// The optimised engine with one session. `M` is how the run holds the model: borrowed
/// (`&Model`, as the CLI does) or shared (`Arc<Model>`, for a run that must own what it
/// uses, such as a Python iterator).
pub struct EngineRun<M: Deref<Target = Model>> {
    pub model: M,
    pub session: Session,
    kv: KvConfig,
}

impl<M: Deref<Target = Model>> EngineRun<M> {
    pub fn new(model: M, kv: &KvConfig) -> Self {
        EngineRun {
            session: model.session(kv),
            model,
            kv: kv.clone(),
        }
    }
}

impl<M: Deref<Target = Model>> Engine for EngineRun<M> {
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
    fn forward_all(&mut self, tokens: &[u32], start: usize, out: &mut Vec<f32>) -> Result<()> {
        self.model
            .forward_batch(&mut self.session, tokens, start, Some(out))
    }
    fn hold(&mut self) -> Result<()> {
        self.session.cache.hold();
        Ok(())
    }
    fn release(&mut self, keep: usize) {
        self.session.cache.release(keep);
    }
    fn keep_logits(&mut self, logits: &[f32]) {
        self.session.logits.copy_from_slice(logits);
    }
    fn session(&mut self) -> Option<&mut Session> {
        Some(&mut self.session)
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
    /// Speculative decoding ([`GenerateOptions::with_speculation`]).
    pub(crate) speculate: Option<SpecConfig>,
}

impl GenerateOptions {
    /// The same settings, decoding with prompt-lookup drafts when `spec` is set
    /// (`--speculate`, [`crate::speculate`]).
    pub fn with_speculation(mut self, spec: Option<SpecConfig>) -> Self {
        self.speculate = spec;
        self
    }

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
            speculate: None,
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
    /// Prompt tokens whose rows a loaded state already held (not prefilled;
    /// [`Generation::resume`]).
    pub prompt_tokens_reused: usize,
    /// Tokens whose forward pass was timed in the decode phase.
    pub decode_steps: usize,
    pub stored_tokens: usize,
    pub current_length: usize,
    pub kv_bytes: usize,
    pub stopped_at_eos: bool,
    /// Speculative decoding's counts (all 0 without `--speculate`).
    pub spec: SpecStats,
    /// Stopped early by SIGINT.
    pub interrupted: bool,
}

impl GenerateResult {
    /// Prompt tokens prefilled (those a loaded state held not counted) per second.
    pub fn prefill_tok_s(&self) -> f64 {
        rate(
            self.prompt_ids.len() - self.prompt_tokens_reused,
            self.prefill_secs,
        )
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
/// early, with `interrupted` set, once [`crate::interrupt::requested`]. A loop over
/// [`Generation::step`].
pub fn generate_with(
    engine: &mut dyn Engine,
    tok: &Tokenizer,
    prompt_ids: &[u32],
    opts: &GenerateOptions,
    keep: bool,
    on_text: &mut dyn FnMut(&str) -> Result<()>,
) -> Result<GenerateResult> {
    let gen = Generation::new(prompt_ids, opts)?;
    generate_from(engine, tok, prompt_ids, gen, keep, on_text)
}

/// [`generate_with`] for a generation its caller built from `prompt_ids` (e.g. one
/// resuming a loaded state: [`Generation::resume`]).
pub fn generate_from(
    engine: &mut dyn Engine,
    tok: &Tokenizer,
    prompt_ids: &[u32],
    mut gen: Generation,
    keep: bool,
    on_text: &mut dyn FnMut(&str) -> Result<()>,
) -> Result<GenerateResult> {
    gen.prefill(engine)?;
    let mut generated = Vec::new();
    let mut interrupted = false;
    let t1 = Instant::now();
    loop {
        // Tokens a verification pass already fed are given out first (they cost nothing
        // and the cache holds their rows).
        if crate::interrupt::requested() && gen.queued() == 0 {
            interrupted = !gen.finished();
            break;
        }
        let Some(step) = gen.step(engine, tok)? else {
            break;
        };
        if keep {
            generated.push(step.id);
        }
        if !step.text.is_empty() {
            on_text(&step.text)?;
        }
    }
    let decode_secs = t1.elapsed().as_secs_f64();
    let text = if keep {
        let n = generated.len() - usize::from(gen.stopped_at_eos());
        tok.decode(&generated[..n])?
    } else {
        String::new()
    };
    Ok(GenerateResult {
        prompt_ids: prompt_ids.to_vec(),
        generated_ids: generated,
        generated_tokens: gen.generated(),
        text,
        prefill_secs: gen.prefill_secs(),
        decode_secs,
        prompt_tokens_reused: gen.reused,
        decode_steps: gen.decode_steps(),
        stored_tokens: engine.stored_tokens(),
        current_length: gen.current_length(),
        kv_bytes: engine.kv_bytes(),
        stopped_at_eos: gen.stopped_at_eos(),
        spec: gen.spec_stats(),
        interrupted,
    })
}

/// One token of a [`Generation`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// The token generated.
    pub id: u32,
    /// The text it completes, as `sample` streams it ([`StreamDecoder`]): possibly empty
    /// (part of a UTF-8 character, a special token, the end-of-sequence token).
    pub text: String,
    /// `id` ended the generation as the model's end-of-sequence token (`ignore_eos` off);
    /// its `text` is empty.
    pub eos: bool,
}

/// A generation its caller advances one token at a time: the pull form of
/// [`generate_with`], which loops over it. The first [`step`](Self::step) prefills the
/// prompt (unless [`prefill`](Self::prefill) did) and returns the first token; each later
/// step feeds the previous token through the cache and samples the next, so a caller that
/// stops pulling has computed nothing it was not given. The engine and tokenizer are the
/// caller's, passed to each call: the same ones every time.
pub struct Generation {
    sampler: Sampler,
    stream: StreamDecoder,
    /// The prompt, until it is prefilled.
    prompt: Vec<u32>,
    /// Prompt tokens whose rows the cache already holds ([`Generation::resume`]).
    reused: usize,
    /// The logits after the prompt's last token, when the cache holds the whole prompt.
    resume_logits: Option<Vec<f32>>,
    max_tokens: usize,
    ignore_eos: bool,
    /// Tokens in the cache (the prompt's length once prefilled, then one more per step).
    pos: usize,
    /// The token sampled but not returned yet (after the prefill, or after a step's
    /// forward pass).
    next: Option<u32>,
    /// The last token returned, fed through the cache at the next step.
    last: Option<u32>,
    generated: usize,
    finished: bool,
    stopped_at_eos: bool,
    prefill_secs: f64,
    decode_secs: f64,
    decode_steps: usize,
    /// Drafting state under `--speculate` ([`crate::speculate`]).
    spec: Option<Speculator>,
    /// A verification pass's logits, `(k + 1, vocab)`.
    all_logits: Vec<f32>,
    /// Drafts come from this model instead of prompt lookup ([`Generation::with_draft_model`]).
    draft: Option<DraftModel>,
}

impl Generation {
    /// A generation of up to `opts`' `max_tokens` tokens after `prompt_ids`. Refuses an
    /// empty prompt; the prompt's length against the context is the caller's to check
    /// ([`GenerateOptions::check_prompt`]).
    pub fn new(prompt_ids: &[u32], opts: &GenerateOptions) -> Result<Generation> {
        if prompt_ids.is_empty() {
            return Err(Error::Generate(
                "the prompt encodes to zero tokens and the tokenizer adds no BOS: give a non-empty --prompt".into(),
            ));
        }
        Ok(Generation {
            sampler: Sampler::new(opts.sampler.clone()),
            stream: StreamDecoder::new(),
            prompt: prompt_ids.to_vec(),
            reused: 0,
            resume_logits: None,
            max_tokens: opts.max_tokens,
            ignore_eos: opts.ignore_eos,
            pos: 0,
            next: None,
            last: None,
            generated: 0,
            finished: false,
            stopped_at_eos: false,
            prefill_secs: 0.0,
            decode_secs: 0.0,
            decode_steps: 0,
            spec: opts.speculate.map(|c| Speculator::new(c, prompt_ids)),
            all_logits: Vec::new(),
            draft: None,
        })
    }

    /// This generation drafting with `draft` (`--draft-model`, [`DraftModel`]) instead of
    /// prompt lookup: speculative decoding with drafts of at most `opts`' draft length
    /// ([`GenerateOptions::with_speculation`]; [`crate::speculate::DEFAULT_DRAFT`] when
    /// it was not set). Before the prefill only.
    pub fn with_draft_model(mut self, draft: DraftModel) -> Result<Generation> {
        if self.pos > 0 || self.next.is_some() {
            return Err(Error::Generate(
                "a draft model must be set before the prefill".into(),
            ));
        }
        let spec = match self.spec.take() {
            Some(s) => s,
            None => Speculator::new(
                SpecConfig {
                    max_draft: crate::speculate::DEFAULT_DRAFT,
                },
                &self.prompt,
            ),
        };
        self.spec = Some(spec.with_draft_step_cost(draft.step_cost));
        self.draft = Some(draft);
        Ok(self)
    }

    /// This generation resuming a cache that already holds the rows of the prompt's first
    /// `reused` tokens (a loaded state whose ids are that prefix): the prefill runs only
    /// the rest, at positions from `reused` on, which gives the bits a run of the whole
    /// prompt gives (prefill equals token-by-token decoding, docs/design.md §2.1). When the
    /// cache holds the whole prompt, nothing is run and the first token is sampled from
    /// `logits`, the logits after the prompt's last token (saved with the state; an
    /// error without them).
    pub fn resume(mut self, reused: usize, logits: Option<Vec<f32>>) -> Result<Generation> {
        if reused > self.prompt.len() {
            return Err(Error::Generate(format!(
                "cannot resume after {reused} tokens of a {}-token prompt",
                self.prompt.len()
            )));
        }
        if reused == self.prompt.len() && logits.is_none() {
            return Err(Error::Generate(
                "the cache holds the whole prompt and no logits after it: \
                 the prompt must add at least one token"
                    .into(),
            ));
        }
        self.reused = reused;
        self.resume_logits = logits;
        Ok(self)
    }

    /// Runs the prompt (the part the cache does not hold yet) through `engine` and samples
    /// the first token, unless that was done already. An error ends the generation.
    pub fn prefill(&mut self, engine: &mut dyn Engine) -> Result<()> {
        if self.finished || self.next.is_some() || self.last.is_some() {
            return Ok(());
        }
        let t0 = Instant::now();
        let (last, start) = (self.prompt.len() - 1, self.reused);
        let r = match self.resume_logits.take() {
            Some(logits) if start == self.prompt.len() => Ok(logits),
            _ => engine
                .prefill(&self.prompt[start..], start)
                .map(|l| l.to_vec()),
        }
        .and_then(|logits| {
            check_finite(&logits, last)?;
            Ok(self.sampler.sample(&logits))
        })
        .and_then(|t| {
            // The draft model reads the prompt too (its part of the time to first token).
            if let Some(d) = self.draft.as_mut() {
                d.catch_up(&self.prompt)?;
            }
            Ok(t)
        });
        self.prefill_secs = t0.elapsed().as_secs_f64();
        match r {
            Ok(t) => {
                self.pos = self.prompt.len();
                self.prompt = Vec::new();
                self.next = Some(t);
                Ok(())
            }
            Err(e) => {
                self.finished = true;
                Err(e)
            }
        }
    }

    /// The next token, or `None` once the generation has ended (end-of-sequence, or
    /// `max_tokens` tokens). An error ends the generation.
    pub fn step(&mut self, engine: &mut dyn Engine, tok: &Tokenizer) -> Result<Option<Step>> {
        self.prefill(engine)?;
        let r = self.advance(engine, tok);
        if r.is_err() {
            self.finished = true;
        }
        r
    }

    fn advance(&mut self, engine: &mut dyn Engine, tok: &Tokenizer) -> Result<Option<Step>> {
        if self.finished || self.generated >= self.max_tokens {
            self.finished = true;
            return Ok(None);
        }
        let queued = self.spec.as_mut().and_then(|s| s.queue.pop_front());
        let id = match (self.next.take(), self.last, queued) {
            (Some(t), _, _) | (None, _, Some(t)) => t,
            (None, Some(prev), None) => {
                let t = Instant::now();
                let next = self.decode(engine, tok, prev)?;
                self.decode_secs += t.elapsed().as_secs_f64();
                next
            }
            (None, None, None) => {
                return Err(Error::Generate("generation was not prefilled".into()))
            }
        };
        self.generated += 1;
        self.last = Some(id);
        if let Some(s) = self.spec.as_mut() {
            s.context.push(id);
        }
        if tok.is_eos(id) && !self.ignore_eos {
            self.finished = true;
            self.stopped_at_eos = true;
            return Ok(Some(Step {
                id,
                text: String::new(),
                eos: true,
            }));
        }
        let text = self.stream.push(tok, id)?;
        if self.generated == self.max_tokens {
            self.finished = true;
        }
        Ok(Some(Step {
            id,
            text,
            eos: false,
        }))
    }

    /// Feeds `prev` and returns the next token: one plain step, or under `--speculate` a
    /// verification pass of `prev` and a draft when one is worth it.
    fn decode(&mut self, engine: &mut dyn Engine, tok: &Tokenizer, prev: u32) -> Result<u32> {
        let budget = self.max_tokens - self.generated - 1;
        let draft = match self.spec.as_mut() {
            Some(s) => match (s.draft_len(budget), self.draft.as_mut()) {
                (0, _) => Vec::new(),
                (k, Some(d)) => d.propose(&s.context, k)?,
                (k, None) => s.draft(k),
            },
            None => Vec::new(),
        };
        if !draft.is_empty() {
            return self.verify(engine, tok, prev, &draft);
        }
        let logits = engine.forward(prev, self.pos)?;
        check_finite(logits, self.pos)?;
        self.pos += 1;
        self.decode_steps += 1;
        if let Some(s) = self.spec.as_mut() {
            s.forward_done(1);
        }
        Ok(self.sampler.sample(logits))
    }

    /// One verification pass (docs/design.md §3.3): `[prev, draft…]` through the cache in
    /// one multi-token forward under a hold; the accepted drafts and the token after them
    /// are the output (cut after an end-of-sequence token), and the hold keeps the rows
    /// plain decoding would have appended to produce them: `prev` and every output token
    /// but the last. Returns the first output token and queues the rest.
    fn verify(
        &mut self,
        engine: &mut dyn Engine,
        tok: &Tokenizer,
        prev: u32,
        draft: &[u32],
    ) -> Result<u32> {
        let mut tokens = Vec::with_capacity(draft.len() + 1);
        tokens.push(prev);
        tokens.extend_from_slice(draft);
        engine.hold()?;
        let mut all = std::mem::take(&mut self.all_logits);
        let out = self.check_draft(engine, tok, &tokens, &mut all);
        self.all_logits = all;
        let (out, accepted) = match out {
            Ok(x) => x,
            Err(e) => {
                engine.release(0);
                if let Some(d) = self.draft.as_mut() {
                    d.settle(0);
                }
                return Err(e);
            }
        };
        engine.release(out.len());
        if let Some(d) = self.draft.as_mut() {
            d.settle(accepted);
        }
        let vocab = self.all_logits.len() / (draft.len() + 1);
        engine.keep_logits(&self.all_logits[(out.len() - 1) * vocab..out.len() * vocab]);
        self.pos += out.len();
        self.decode_steps += out.len();
        if let Some(s) = self.spec.as_mut() {
            s.record(draft.len(), accepted);
            s.forward_done(out.len());
            s.queue.extend(&out[1..]);
        }
        Ok(out[0])
    }

    /// The forward pass of a verification and the check of its draft: the output tokens
    /// and how many drafts were accepted.
    fn check_draft(
        &mut self,
        engine: &mut dyn Engine,
        tok: &Tokenizer,
        tokens: &[u32],
        all: &mut Vec<f32>,
    ) -> Result<(Vec<u32>, usize)> {
        engine.forward_all(tokens, self.pos, all)?;
        let ignore_eos = self.ignore_eos;
        crate::speculate::check(&mut self.sampler, all, &tokens[1..], self.pos, |t| {
            tok.is_eos(t) && !ignore_eos
        })
    }

    /// Tokens a verification pass produced (and fed through the cache, all but the last)
    /// that [`step`](Self::step) has not returned yet.
    pub fn queued(&self) -> usize {
        self.spec.as_ref().map_or(0, |s| s.queue.len())
    }

    /// Speculative decoding's counts so far (all 0 without `--speculate`).
    pub fn spec_stats(&self) -> SpecStats {
        self.spec.as_ref().map(|s| s.stats).unwrap_or_default()
    }

    /// Whether the generation has ended ([`step`](Self::step) returns `None` from now on).
    pub fn finished(&self) -> bool {
        self.finished
    }
    /// Tokens returned so far (the end-of-sequence token included).
    pub fn generated(&self) -> usize {
        self.generated
    }
    /// Whether the generation ended on the end-of-sequence token.
    pub fn stopped_at_eos(&self) -> bool {
        self.stopped_at_eos
    }
    /// Tokens that went through the cache: the prompt and every returned token but the
    /// last (which is only fed at the next step).
    pub fn current_length(&self) -> usize {
        self.pos
    }
    /// Seconds the prefill and the first sample took.
    pub fn prefill_secs(&self) -> f64 {
        self.prefill_secs
    }
    /// Seconds the decode steps (forward pass and sample) took, summed.
    pub fn decode_secs(&self) -> f64 {
        self.decode_secs
    }
    /// Tokens fed through the cache after the prompt.
    pub fn decode_steps(&self) -> usize {
        self.decode_steps
    }
}
