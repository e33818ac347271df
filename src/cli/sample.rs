//! `tinygpt-cpu sample`: stream a continuation of a prompt.

use super::common::{human_bytes, open_model, CacheArgs, EngineArgs, EngineKind, Loaded};
use crate::error::Error;
use crate::generate::{generate_from, Engine, GenerateOptions, GenerateResult, Generation};
use crate::kv_cache::KvConfig;
use crate::sampler::SamplerConfig;
use crate::state::{self, ModelIdentity, SavedState};
use crate::weights::ModelFiles;
use crate::{errln, outln};
use clap::Args;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Args, Debug)]
pub struct SampleArgs {
    /// A .tinygpt file, a .gguf file, or a Hugging Face model directory (default: the bundled model).
    pub model: Option<PathBuf>,
    /// The text to continue (may start with '-').
    #[arg(long, allow_hyphen_values = true)]
    pub prompt: String,
    /// Maximum new tokens.
    #[arg(long, default_value_t = 128)]
    pub tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    pub temperature: f32,
    /// Keep only the K most likely tokens (0 = off).
    #[arg(long = "top-k", default_value_t = 40)]
    pub top_k: usize,
    /// Nucleus sampling: keep the smallest set of tokens with this much probability.
    #[arg(long = "top-p", default_value_t = 0.95, allow_negative_numbers = true)]
    pub top_p: f32,
    /// RNG seed (default: random; the report prints it).
    #[arg(long)]
    pub seed: Option<u64>,
    #[command(flatten)]
    pub cache: CacheArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Wrap the prompt in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Keep generating after the model's end-of-sequence token.
    #[arg(long = "ignore-eos")]
    pub ignore_eos: bool,
    /// Print one JSON object on stdout instead of streaming text. The object lists every
    /// generated id, so --json holds them (and the text) in memory until the end; without
    /// it nothing grows with the number of generated tokens.
    #[arg(long)]
    pub json: bool,
    /// Speculative decoding with prompt-lookup drafts: `ngram`, or `ngram:K` for drafts of
    /// at most K tokens (default 8). Greedy output is bit-identical to plain decoding;
    /// sampled output has the same distribution (docs/design.md §3.3).
    #[arg(long, value_name = "ngram[:K]")]
    pub speculate: Option<String>,
    /// Speculative decoding with drafts from a second model with the same tokenizer (a
    /// smaller sibling, or a more coarsely quantised copy of this model), run greedily on
    /// a cache with the same flags; drafts of at most 8 tokens, their length adapting to
    /// the acceptance rate. Same output guarantees as --speculate (docs/design.md §3.3).
    #[arg(long = "draft-model", value_name = "FILE")]
    pub draft_model: Option<PathBuf>,
    /// After the run, save the cache (the rows of the prompt and of every generated token
    /// fed through it, with the logits after the last) to FILE, for --load-state.
    #[arg(long = "save-state", value_name = "FILE")]
    pub save_state: Option<PathBuf>,
    /// Resume from a state saved by --save-state with the same model and cache flags: its
    /// tokens must be the start of this prompt's, and only the rest is prefilled.
    #[arg(long = "load-state", value_name = "FILE")]
    pub load_state: Option<PathBuf>,
}

pub fn run(a: SampleArgs) -> anyhow::Result<()> {
    let engine = a.engine.clone();
    crate::interrupt::install()
        .map_err(|e| Error::Generate(format!("cannot handle SIGINT: {e}")))?;
    engine.in_pool(move || run_in_pool(a))
}

fn run_in_pool(a: SampleArgs) -> anyhow::Result<()> {
    let kv = a.cache.kv_config()?;
    let t_load = Instant::now();
    let files = open_model(&a.model)?;
    crate::kv_cache::validate(&kv, &files.config)?;
    let (opts, seed) = options(&a, &files, &kv)?;
    let wdtype = a.engine.weights_dtype(files.format);
    crate::memory::check_weights_fit(&files, wdtype, a.engine.engine == EngineKind::Reference)?;
    let identity = state_identity(&a, &files, wdtype)?;
    // The weights load while the tokenizer is still being built (`ModelFiles::open`); the
    // prompt is read once both are ready. A file refused by both names the tokenizer's
    // problem, as when the tokenizer was built first.
    let loaded = Loaded::load(&files, &a.engine).map_err(|e| files.tokenizer_error_or(e))?;
    let prompt_text = prompt_text(&a, &files)?;
    let prompt_ids = prompt_ids(&a, &files, &opts, &prompt_text)?;
    check_kv_fits(&a, &files, &kv, prompt_ids.len())?;
    let resume = match (&a.load_state, &identity) {
        (Some(path), Some(id)) => Some(load_state(path, id, &kv, &files, &prompt_ids)?),
        _ => None,
    };
    let load_secs = t_load.elapsed().as_secs_f64();

    let json = a.json;
    let mut on_text = |s: &str| -> crate::Result<()> {
        if json {
            Ok(())
        } else {
            crate::cli::out::stream(s)
        }
    };
    let exec = match &loaded {
        Loaded::Optimized(m) => Some(*m.options()),
        #[cfg(feature = "reference-engine")]
        Loaded::Reference(_) => None,
    };
    if a.speculate.is_some() && a.draft_model.is_some() {
        return Err(Error::flag(
            "--draft-model",
            "drafts come from a draft model or from prompt lookup (--speculate), not both",
        )
        .into());
    }
    for (flag, set) in [
        ("--speculate", a.speculate.is_some()),
        ("--draft-model", a.draft_model.is_some()),
    ] {
        if set && exec.is_none() {
            return Err(Error::flag(
                flag,
                "needs the optimised engine (the reference engine cannot hold cache rows)",
            )
            .into());
        }
    }
    let draft = match &a.draft_model {
        Some(path) => Some(load_draft(path, &files, &kv, &a.engine)?),
        None => None,
    };
    let mut run = loaded.run(&kv);
    let layers_with_kv = run.layers_with_kv();
    let mut gen = Generation::new(&prompt_ids, &opts)?;
    if let Some(d) = draft {
        gen = gen.with_draft_model(d)?;
    }
    let gen = resumed(gen, &mut *run, resume)?;
    let keep = json || a.save_state.is_some();
    let res = generate_from(
        &mut *run,
        files.tokenizer()?,
        &prompt_ids,
        gen,
        keep,
        &mut on_text,
    )?;
    if let (Some(path), Some(id)) = (&a.save_state, &identity) {
        save_state(path, id, &kv, &res, &mut *run)?;
    }
    if json {
        let v = json_report(&res, &kv, layers_with_kv, files.config.head_dim, load_secs);
        outln!("{}", serde_json::to_string(&v)?)?;
    } else {
        outln!()?;
    }
    crate::cli::out::flush()?;
    report(
        &res,
        &kv,
        &files.path.display().to_string(),
        load_secs,
        seed,
        a.temperature,
    )?;
    if let Some(exec) = exec {
        errln!("[exec] {exec}")?;
    }
    if res.interrupted {
        return Err(Error::Interrupted(format!(
            "stopped after {} generated tokens",
            res.generated_tokens
        ))
        .into());
    }
    Ok(())
}

/// The draft model at `path` for the target `target` (`--draft-model`): loaded as the
/// target is (`engine`'s weights type and threads), with its own cache of settings `kv`;
/// [`DraftModel::new`](crate::speculate::DraftModel::new) checks the vocabulary. Errors
/// name `--draft-model` and the file.
fn load_draft(
    path: &std::path::Path,
    target: &ModelFiles,
    kv: &KvConfig,
    engine: &EngineArgs,
) -> crate::Result<crate::speculate::DraftModel> {
    let named = |e: Error| match e {
        Error::Flag { .. } => e,
        e => Error::flag("--draft-model", format!("{}: {e}", path.display())),
    };
    let files = ModelFiles::open(Some(path)).map_err(named)?;
    let model = Loaded::load(&files, engine)
        .and_then(|l| l.into_optimized("--draft-model"))
        .and_then(|m| files.tokenizer().map(|_| m))
        .map_err(|e| named(files.tokenizer_error_or(e)))?;
    crate::speculate::DraftModel::new(std::sync::Arc::new(model), &files, target, kv)
}

/// The model's identity when `a` saves or loads a state (the optimised engine only).
fn state_identity(
    a: &SampleArgs,
    files: &ModelFiles,
    wdtype: crate::model::WeightsDType,
) -> crate::Result<Option<ModelIdentity>> {
    let flag = match (&a.load_state, &a.save_state) {
        (Some(_), _) => "--load-state",
        (None, Some(_)) => "--save-state",
        (None, None) => return Ok(None),
    };
    if a.engine.engine == EngineKind::Reference {
        return Err(Error::flag(flag, "needs --engine optimized"));
    }
    Ok(Some(ModelIdentity::of(files)?.with_weights(wdtype)))
}

/// The state of `path`, refused unless made by this model and cache configuration and
/// its ids start `prompt_ids`.
fn load_state(
    path: &std::path::Path,
    id: &ModelIdentity,
    kv: &KvConfig,
    files: &ModelFiles,
    prompt_ids: &[u32],
) -> crate::Result<SavedState> {
    let st = state::load(path, id, kv, &files.config)?;
    state::check_prefix_of(path, &st.ids, prompt_ids)?;
    Ok(st)
}

/// `gen` resuming the state `st` (its cache and logits moved into `run`'s session).
fn resumed(
    gen: Generation,
    run: &mut dyn Engine,
    st: Option<SavedState>,
) -> crate::Result<Generation> {
    let Some(st) = st else { return Ok(gen) };
    let s = run
        .session()
        .ok_or_else(|| Error::flag("--load-state", "needs --engine optimized"))?;
    s.cache = st.cache;
    if let Some(l) = &st.logits {
        s.logits.clone_from(l);
    }
    gen.resume(st.ids.len(), st.logits)
}

/// Saves the state after `res`: the ids of the tokens fed through the cache (the prompt,
/// then every generated token but the last, which was never fed), the cache, and the
/// logits after the last of them.
fn save_state(
    path: &std::path::Path,
    id: &ModelIdentity,
    kv: &KvConfig,
    res: &GenerateResult,
    run: &mut dyn Engine,
) -> crate::Result<()> {
    let fed = res.current_length - res.prompt_ids.len();
    let mut ids = res.prompt_ids.clone();
    let generated = res.generated_ids.get(..fed).ok_or_else(|| {
        Error::flag(
            "--save-state",
            format!(
                "the cache holds {fed} generated tokens, {} were returned",
                res.generated_ids.len()
            ),
        )
    })?;
    ids.extend_from_slice(generated);
    let s = run
        .session()
        .ok_or_else(|| Error::flag("--save-state", "needs --engine optimized"))?;
    state::save_with_logits(path, id, kv, &ids, &s.cache, Some(&s.logits))
}

/// The generation settings `a` asks for on `files` through `kv` (the sampler validated),
/// and the seed: `--seed`, else one from the clock.
pub fn options(
    a: &SampleArgs,
    files: &ModelFiles,
    kv: &KvConfig,
) -> crate::Result<(GenerateOptions, u64)> {
    let seed = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0)
    });
    let sampler = SamplerConfig {
        temperature: a.temperature,
        top_k: a.top_k,
        top_p: a.top_p,
        seed,
    };
    let spec = a
        .speculate
        .as_deref()
        .map(|s| crate::speculate::SpecConfig::parse(s, "--speculate"))
        .transpose()?;
    let opts = a
        .cache
        .generate_options(kv, &files.config, a.tokens, sampler, a.ignore_eos)?
        .with_speculation(spec);
    Ok((opts, seed))
}

/// The text `sample` feeds the model: `--prompt`, wrapped in the model's chat template
/// with `--chat`.
pub fn prompt_text(a: &SampleArgs, files: &ModelFiles) -> crate::Result<String> {
    if !a.chat {
        return Ok(a.prompt.clone());
    }
    let template = files.chat_template.as_deref().ok_or_else(|| {
        Error::flag(
            "--chat",
            format!("{} has no chat template", files.path.display()),
        )
    })?;
    let (bos, eos) = crate::chat::special_tokens(files.tokenizer()?);
    crate::chat::render_chat(template, &a.prompt, &bos, &eos)
}

/// The ids of `text` (what [`prompt_text`] gave, or a chat its caller rendered when
/// `a.chat`), checked against the context: a text that cannot fit is refused unread.
pub fn prompt_ids(
    a: &SampleArgs,
    files: &ModelFiles,
    opts: &GenerateOptions,
    text: &str,
) -> crate::Result<Vec<u32>> {
    // A prompt that cannot fit the context whatever it encodes to is refused unread.
    let tokenizer = files.tokenizer()?;
    opts.check_prompt_bytes(text.len(), tokenizer, None, crate::generate::Surface::Cli)?;
    let ids = if a.chat {
        // The template already spells out BOS and control tokens.
        tokenizer.encode_with(text, false)?
    } else {
        tokenizer.encode(text)?
    };
    opts.check_prompt(ids.len())?;
    Ok(ids)
}

/// Refuses a run of `a.tokens` tokens after a `prompt_len`-token prompt whose KV cache
/// would not fit in memory (naming `--streaming-llm-window`, or `--tokens` for a dense
/// cache).
pub fn check_kv_fits(
    a: &SampleArgs,
    files: &ModelFiles,
    kv: &KvConfig,
    prompt_len: usize,
) -> crate::Result<()> {
    let total = prompt_len.saturating_add(a.tokens);
    let rows = kv
        .window
        .map_or(total, |w| total.min(kv.sink.saturating_add(w)));
    let kv_bytes = rows as u128
        * crate::memory::kv_bytes_per_token(&files.config, crate::memory::widest_precision(kv))
        * crate::memory::GROWTH_SLACK;
    crate::memory::check_fits(kv_bytes).map_err(|m| {
        let flag = if kv.window.is_some() {
            "--streaming-llm-window"
        } else {
            "--tokens"
        };
        Error::flag(flag, format!("a KV cache of {rows} tokens {m}"))
    })
}

/// The `--json` object of docs/design.md §4.
pub fn json_report(
    res: &GenerateResult,
    kv: &KvConfig,
    layers_with_kv: usize,
    head_dim: usize,
    load_secs: f64,
) -> serde_json::Value {
    serde_json::json!({
        "prompt_ids": res.prompt_ids,
        "prompt_tokens_reused": res.prompt_tokens_reused,
        "generated_ids": res.generated_ids,
        "text": res.text,
        "kv": kv_json(
            kv,
            head_dim,
            layers_with_kv,
            res.stored_tokens,
            res.current_length,
            res.kv_bytes
        ),
        "timing": {
            "load_s": load_secs,
            "prefill_tok_s": res.prefill_tok_s(),
            "decode_tok_s": res.decode_tok_s(),
            "drafted": res.spec.drafted,
            "accepted": res.spec.accepted,
            "tokens_per_step": res.spec.tokens_per_step(),
        }
    })
}

/// The `kv` object of the `--json` report: the cache's settings (`rotation` as `auto`
/// resolved for `head_dim`) and what it holds after a run.
pub fn kv_json(
    kv: &KvConfig,
    head_dim: usize,
    layers_with_kv: usize,
    stored_tokens: usize,
    current_length: usize,
    bytes: usize,
) -> serde_json::Value {
    serde_json::json!({
        "quantize": kv.precision.name(),
        "group_size": kv.group_size,
        "sink": kv.sink,
        "window": kv.window,
        "positions": kv.positions.name(),
        "quantize_k": kv.key_precision().name(),
        "quantize_v": kv.value_precision().name(),
        "residual": kv.residual,
        "key_rope": kv.key_rope.name(),
        // what `auto` resolved to
        "rotation": if kv.rotates(head_dim) { "hadamard" } else { "none" },
        "stored_tokens": stored_tokens,
        "current_length": current_length,
        "bytes": bytes,
        "layers_with_kv": layers_with_kv,
    })
}

fn report(
    res: &GenerateResult,
    kv: &KvConfig,
    model: &str,
    load_secs: f64,
    seed: u64,
    temperature: f32,
) -> crate::Result<()> {
    let stored = if res.stored_tokens < res.current_length {
        format!("stored {} (StreamingLLM cap)", res.stored_tokens)
    } else {
        format!("stored {}", res.stored_tokens)
    };
    let sampling = if temperature < crate::sampler::GREEDY_BELOW {
        "greedy".to_string()
    } else {
        format!("seed {seed}")
    };
    let reused = match res.prompt_tokens_reused {
        0 => String::new(),
        n => format!(" ({n} reused from the state)"),
    };
    errln!(
        "[{model}] load {:.2}s | prompt {} tok{reused}, prefill {:.1} tok/s | generated {} tok, decode {:.1} tok/s{} | {sampling}",
        load_secs,
        res.prompt_ids.len(),
        res.prefill_tok_s(),
        res.generated_tokens,
        res.decode_tok_s(),
        if res.stopped_at_eos { " (EOS)" } else { "" },
    )?;
    if res.spec.forwards > 0 {
        errln!(
            "[speculate] drafted {} | accepted {} ({:.0}%) | {} verification passes | {:.2} tokens per step",
            res.spec.drafted,
            res.spec.accepted,
            100.0 * res.spec.accepted as f64 / res.spec.drafted.max(1) as f64,
            res.spec.passes,
            res.spec.tokens_per_step(),
        )?;
    }
    errln!(
        "[kv] {} | {} | current length {} | {}",
        kv.quant_name(),
        human_bytes(res.kv_bytes as u64),
        res.current_length,
        stored
    )
}
