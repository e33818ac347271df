//! `tinygpt-cpu perplexity`: teacher-forced quality through the cached decode path.

use super::common::{open_model, progress, CacheArgs, EngineArgs, Loaded};
use super::plot::{line_chart, Series};
use crate::error::Error;
use crate::eval::{parse_modes, perplexity, read_text, PplResult, SinkReport, SINK_POSITIONS};
use crate::generate::check_cache_rows;
use crate::kv_cache::KvConfig;
use crate::outln;
use crate::weights::ModelFiles;
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct PerplexityArgs {
    /// A .tinygpt file, a .gguf file, or a Hugging Face model directory (default: the bundled model).
    pub model: Option<PathBuf>,
    /// UTF-8 text to evaluate.
    #[arg(long)]
    pub text: PathBuf,
    #[command(flatten)]
    pub cache: CacheArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Evaluate at most this many tokens of the text.
    #[arg(long = "max-tokens", value_name = "N")]
    pub max_tokens: Option<usize>,
    /// Tokens per reported chunk.
    #[arg(long, default_value_t = 1024)]
    pub chunk: usize,
    /// Several cache configurations on the same text, e.g.
    /// "dense;sink=0,window=256;sink=4,window=252;sink=4,window=252,kv=int4"
    /// (keys: sink, window, kv, group, positions, residual, kv_k, kv_v, key_rope, rotation; kv takes
    /// a precision or a name like k8v4, k4v2, int2+r128, int4+pre; each mode starts from
    /// the cache flags).
    #[arg(long = "compare-modes", value_name = "SPEC")]
    pub compare_modes: Option<String>,
    /// Report the attention mass on the first 8 positions (attention sinks).
    #[arg(long = "sink-report")]
    pub sink_report: bool,
    /// Draw NLL vs token position (smoothed per chunk) to FILE.png or FILE.svg.
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
    /// Print one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

pub fn run(a: PerplexityArgs) -> anyhow::Result<()> {
    let engine = a.engine.clone();
    crate::interrupt::install()
        .map_err(|e| Error::Generate(format!("cannot handle SIGINT: {e}")))?;
    engine.in_pool(move || run_in_pool(a))
}

fn run_in_pool(a: PerplexityArgs) -> anyhow::Result<()> {
    let base = a.cache.kv_config()?;
    check_flags(&a)?;
    let text = read_text(&a.text)?;
    let files = open_model(&a.model)?;
    let tokens = tokens_of(&a, &files, &text)?;
    let modes = match &a.compare_modes {
        Some(spec) => parse_modes(spec, &base)?,
        None => vec![(mode_name(&base), base.clone())],
    };
    for (_, kv) in &modes {
        check_mode(&a, &files, kv, tokens.len())?;
    }
    let loaded = Loaded::load(&files, &a.engine)?;
    let results = evaluate(&a, &loaded, &modes, &tokens)?;

    print_results(&a, &results)?;
    crate::cli::out::flush()?;
    if let Some(p) = &a.plot {
        plot_nll(&a, p, &results, tokens.len())?;
    }
    if let Some((name, r, _)) = results.iter().find(|r| r.1.interrupted) {
        return Err(Error::Interrupted(format!(
            "mode {name} stopped after {} of {} tokens; the results above cover the tokens evaluated",
            r.tokens,
            tokens.len()
        ))
        .into());
    }
    Ok(())
}

/// The checks that need neither the text nor the model.
pub fn check_flags(a: &PerplexityArgs) -> crate::Result<()> {
    if a.chunk == 0 {
        return Err(Error::flag("--chunk", "must be > 0"));
    }
    if let Some(n) = a.max_tokens.filter(|&n| n < 2) {
        return Err(Error::flag(
            "--max-tokens",
            format!("must be at least 2 (perplexity predicts each token from the ones before it), got {n}"),
        ));
    }
    if let Some(p) = &a.plot {
        // Before the evaluation, not after it: a bad path must not cost the results.
        super::plot::check_output(p)?;
    }
    Ok(())
}

/// The text's tokens (at most `--max-tokens`), enough of them for what was asked.
pub fn tokens_of(a: &PerplexityArgs, files: &ModelFiles, text: &str) -> crate::Result<Vec<u32>> {
    let mut tokens = files.tokenizer()?.encode(text)?;
    if let Some(n) = a.max_tokens {
        tokens.truncate(n);
    }
    if tokens.len() < 2 {
        return Err(Error::format(
            &a.text,
            format!(
                "encodes to {} token(s); perplexity needs at least 2",
                tokens.len()
            ),
        ));
    }
    if a.sink_report && tokens.len() < SINK_POSITIONS + 2 {
        return Err(Error::flag(
            "--sink-report",
            format!(
                "needs at least {} tokens of text (queries that can see the first {SINK_POSITIONS} positions); {} has {}",
                SINK_POSITIONS + 2,
                a.text.display(),
                tokens.len()
            ),
        ));
    }
    Ok(tokens)
}

/// Refuses a mode the model cannot run over `n_tokens` tokens: an invalid cache, a run
/// past the context length, or a cache that would not fit in memory.
pub fn check_mode(
    a: &PerplexityArgs,
    files: &ModelFiles,
    kv: &KvConfig,
    n_tokens: usize,
) -> crate::Result<()> {
    let ctx = files.config.max_position_embeddings;
    crate::kv_cache::validate(kv, &files.config)?;
    // The cache holds n_tokens - 1 rows at most (the last token is only predicted).
    let rows = n_tokens - 1;
    if kv.window.is_none() && !a.cache.allow_past_context && rows > ctx {
        return Err(Error::Generate(format!(
            "{} is {} tokens, more than the model's context length ({ctx}) with a dense cache; \
             evaluate fewer with --max-tokens {}, bound the cache with \
             --streaming-llm-sink N --streaming-llm-window M, or pass --allow-past-context",
            a.text.display(),
            n_tokens,
            ctx + 1
        )));
    }
    check_cache_rows(kv, rows, ctx, a.cache.allow_past_context)?;
    let bytes = rows.min(kv.window.map_or(usize::MAX, |w| kv.sink.saturating_add(w))) as u128
        * crate::memory::kv_bytes_per_token(&files.config, crate::memory::widest_precision(kv))
        * crate::memory::GROWTH_SLACK;
    crate::memory::check_fits(bytes)
        .map_err(|m| Error::flag("--max-tokens", format!("the KV cache {m}")))
}

/// Runs each mode over `tokens` in turn (stopping after a mode SIGINT interrupted).
fn evaluate(
    a: &PerplexityArgs,
    loaded: &Loaded,
    modes: &[(String, KvConfig)],
    tokens: &[u32],
) -> crate::Result<Vec<ModeResult>> {
    let mut results = Vec::new();
    for (name, kv) in modes {
        let pb = progress((tokens.len() - 1) as u64, a.json, name);
        let mut run = loaded.run(kv);
        let (r, s) = perplexity(run.as_mut(), tokens, a.chunk, a.sink_report, &mut |i| {
            if i.is_multiple_of(16) {
                pb.set_position(i as u64)
            }
        })?;
        pb.finish_and_clear();
        let stop = r.interrupted;
        results.push((name.clone(), r, s));
        if stop {
            break;
        }
    }
    Ok(results)
}

/// `--plot`: each mode's NLL, smoothed over `--chunk` tokens, against position.
fn plot_nll(
    a: &PerplexityArgs,
    path: &std::path::Path,
    results: &[ModeResult],
    n_tokens: usize,
) -> crate::Result<()> {
    let series: Vec<Series> = results
        .iter()
        .map(|(name, r, _)| Series {
            name: name.clone(),
            points: smooth_nll(&r.nll, a.chunk.min(r.nll.len()).max(1)),
        })
        .collect();
    line_chart(
        path,
        &format!("NLL vs position ({n_tokens} tokens)"),
        "token position",
        &format!("NLL (mean over {} tokens)", a.chunk),
        &series,
    )
}

type ModeResult = (String, PplResult, Option<SinkReport>);

fn print_results(a: &PerplexityArgs, results: &[ModeResult]) -> anyhow::Result<()> {
    if a.json {
        let first = &results[0];
        let mut v = result_json(&first.1);
        if a.compare_modes.is_some() {
            v["modes"] = serde_json::Value::Array(
                results
                    .iter()
                    .map(|(name, r, s)| {
                        let mut m = serde_json::json!({"mode": name, "tokens": r.tokens, "ppl": r.ppl, "nll_mean": r.nll_mean, "chunks": r.chunks});
                        if let Some(s) = s {
                            m["sink_report"] = serde_json::to_value(s).unwrap_or_default();
                        }
                        m
                    })
                    .collect(),
            );
        }
        if let Some(s) = &first.2 {
            v["sink_report"] = serde_json::to_value(s)?;
        }
        outln!("{}", serde_json::to_string(&v)?)?;
        return Ok(());
    }
    for (name, r, s) in results {
        outln!(
            "{name}: perplexity {:.4} (nll {:.4}) over {} tokens",
            r.ppl,
            r.nll_mean,
            r.tokens
        )?;
        for c in &r.chunks {
            outln!("  tokens [{:>6}, {:>6})  ppl {:.4}", c.start, c.end, c.ppl)?;
        }
        if let Some(s) = s {
            print_sinks(s)?;
        }
    }
    if results.len() > 1 {
        outln!()?;
        outln!("{:<40} {:>12} {:>10}", "mode", "perplexity", "vs first")?;
        for (name, r, _) in results {
            outln!(
                "{:<40} {:>12.4} {:>+9.2}%",
                name,
                r.ppl,
                (r.ppl / results[0].1.ppl - 1.0) * 100.0
            )?;
        }
    }
    Ok(())
}

/// The `--json` object of one run (docs/design.md §4): `tokens`, `ppl`, `nll_mean`, `chunks`.
pub fn result_json(r: &PplResult) -> serde_json::Value {
    serde_json::json!({
        "tokens": r.tokens,
        "ppl": r.ppl,
        "nll_mean": r.nll_mean,
        "chunks": r.chunks,
    })
}

/// A short name for one cache configuration.
pub fn mode_name(kv: &crate::kv_cache::KvConfig) -> String {
    let mut s = kv.quant_name();
    if let Some(w) = kv.window {
        s += &format!(",sink={},window={w}", kv.sink);
        if kv.positions == crate::kv_cache::PositionsMode::Cache {
            s += ",positions=cache";
        }
    }
    s
}

/// Mean NLL over consecutive windows of `w` predictions, plotted at the window's end.
fn smooth_nll(nll: &[f64], w: usize) -> Vec<(f64, f64)> {
    let w = w.clamp(1, 256).min(nll.len().max(1));
    nll.chunks(w)
        .enumerate()
        .map(|(i, c)| {
            (
                ((i * w) + c.len()) as f64,
                c.iter().sum::<f64>() / c.len() as f64,
            )
        })
        .collect()
}

fn print_sinks(s: &SinkReport) -> crate::Result<()> {
    outln!(
        "  attention mass on the first {SINK_POSITIONS} positions (mean over {} queries and heads; uniform = {:.4}):",
        s.queries, s.uniform
    )?;
    let head: Vec<String> = (0..SINK_POSITIONS).map(|p| format!("{p:>7}")).collect();
    outln!("  {:<8}{}", "layer", head.join(""))?;
    for (l, m) in s.per_layer.iter().enumerate() {
        let row: Vec<String> = m.iter().map(|v| format!("{v:>7.3}")).collect();
        outln!("  {:<8}{}", l, row.join(""))?;
    }
    let row: Vec<String> = s.overall.iter().map(|v| format!("{v:>7.3}")).collect();
    outln!("  {:<8}{}", "all", row.join(""))?;
    outln!(
        "  position 0 gets {:.1}x the uniform share",
        s.overall[0] / s.uniform.max(1e-12)
    )
}
