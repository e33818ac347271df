//! `tinygpt-cpu compare`: greedy agreement of KV precisions with the fp32 baseline.

use super::common::{open_model, CacheArgs, EngineArgs, Loaded};
use super::perplexity::mode_name;
use crate::error::Error;
use crate::eval::{apply_quant_mode, parse_modes};
use crate::generate::generate;
use crate::kv_cache::{KvConfig, Precision};
use crate::outln;
use crate::sampler::SamplerConfig;
use clap::Args;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct CompareArgs {
    /// A .tinygpt file, a .gguf file, or a Hugging Face model directory (default: the bundled model).
    pub model: Option<PathBuf>,
    /// A text file with one prompt per line.
    #[arg(long)]
    pub prompts: PathBuf,
    /// Greedy tokens per prompt.
    #[arg(long, default_value_t = 60)]
    pub tokens: usize,
    /// KV modes to compare against an fp32 cache with the same eviction, comma-separated:
    /// fp32, fp16, bf16, int8, int4, int2, or kXvY for K bits then V bits (k8v4, k4v2),
    /// each optionally followed by +rN (KIVI residual of N tokens) and +pre/+post (key
    /// RoPE), e.g. "int4,int2+r128,k4v2+r32+pre". Or full mode specs separated by ';' as
    /// in `perplexity --compare-modes`.
    #[arg(long, default_value = "fp32,bf16,int8,int4")]
    pub modes: String,
    #[command(flatten)]
    pub cache: CacheArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Print one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// One (prompt, mode) result: the `rows` entries of `compare --json` (docs/design.md §4).
/// Fields are in alphabetical order, the order the JSON has always had.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompareRow {
    /// The mode's name as given in `--modes`.
    pub mode: String,
    /// Leading generated tokens equal to the baseline's.
    pub prefix_match: usize,
    pub prompt: String,
    /// Tokens the mode generated.
    pub tokens: usize,
}

impl CompareRow {
    /// `prefix_match / tokens` (0 for an empty run).
    pub fn agreement(&self) -> f64 {
        self.prefix_match as f64 / self.tokens.max(1) as f64
    }
}

/// The `compare --json` object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompareReport {
    /// Name of the fp32 baseline cache mode.
    pub baseline: String,
    pub rows: Vec<CompareRow>,
}

pub fn run(a: CompareArgs) -> anyhow::Result<()> {
    let engine = a.engine.clone();
    engine.in_pool(move || run_in_pool(a))
}

fn run_in_pool(a: CompareArgs) -> anyhow::Result<()> {
    let base = a.cache.kv_config()?;
    if a.tokens == 0 {
        return Err(Error::flag(
            "--tokens",
            "must be at least 1 (agreement over zero tokens means nothing)",
        )
        .into());
    }
    let text = crate::eval::read_text_for(&a.prompts, "--prompts")?;
    let prompts: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let mut modes = Vec::new();
    if a.modes.contains(';') || a.modes.contains('=') {
        modes = parse_modes(&a.modes, &base)?;
    } else {
        for m in a.modes.split(',').map(str::trim).filter(|m| !m.is_empty()) {
            let mut kv = base.clone();
            apply_quant_mode(m, &mut kv).map_err(|e| Error::flag("--modes", e))?;
            modes.push((m.to_string(), kv));
        }
    }
    if modes.is_empty() {
        return Err(Error::flag("--modes", "no modes given").into());
    }
    // The baseline: full-precision cache with the same eviction.
    let mut baseline = base.clone();
    baseline.precision = Precision::Fp32;
    baseline.k_precision = None;
    baseline.v_precision = None;
    baseline.residual = 0;
    baseline.key_rope = crate::kv_cache::KeyRope::Post;
    baseline.rotation = crate::kv_cache::KvRotation::None;
    let files = open_model(&a.model)?;
    for (_, kv) in modes
        .iter()
        .chain([(String::new(), baseline.clone())].iter())
    {
        crate::kv_cache::validate(kv, &files.config)?;
    }
    // The weights load while the tokenizer is being built (`ModelFiles::open`).
    let loaded = Loaded::load(&files, &a.engine).map_err(|e| files.tokenizer_error_or(e))?;
    let tokenizer = files.tokenizer()?;
    let mut rows = Vec::new();
    for prompt in &prompts {
        let ids = tokenizer.encode(prompt)?;
        let options = |kv: &KvConfig| {
            a.cache
                .generate_options(kv, &files.config, a.tokens, SamplerConfig::greedy(), true)
        };
        for (_, kv) in modes
            .iter()
            .chain([(String::new(), baseline.clone())].iter())
        {
            options(kv)?.check_prompt(ids.len())?;
        }
        let greedy = |kv: &KvConfig| -> anyhow::Result<Vec<u32>> {
            let opts = options(kv)?;
            let mut run = loaded.run(kv);
            Ok(generate(run.as_mut(), tokenizer, &ids, &opts, &mut |_| {})?.generated_ids)
        };
        let base_ids = greedy(&baseline)?;
        for (name, kv) in &modes {
            let got = if *kv == baseline {
                base_ids.clone()
            } else {
                greedy(kv)?
            };
            let m = got
                .iter()
                .zip(&base_ids)
                .take_while(|(x, y)| x == y)
                .count();
            rows.push(CompareRow {
                mode: name.clone(),
                prefix_match: m,
                prompt: prompt.to_string(),
                tokens: got.len(),
            });
        }
    }
    let report = CompareReport {
        baseline: mode_name(&baseline),
        rows,
    };
    if a.json {
        outln!("{}", serde_json::to_string(&report)?)?;
        return Ok(());
    }
    // the mode column as wide as the longest name (`int2+r128+rot` is 13)
    let w = modes
        .iter()
        .map(|(n, _)| n.len())
        .max()
        .unwrap_or(0)
        .max(10);
    outln!("{:<w$} {:>6} {:>8}  prompt", "mode", "match", "tokens")?;
    for r in &report.rows {
        let short: String = r.prompt.chars().take(50).collect();
        outln!(
            "{:<w$} {:>6} {:>8}  {short}",
            r.mode,
            r.prefix_match,
            r.tokens
        )?;
    }
    outln!()?;
    outln!("{:<w$} {:>18}", "mode", "mean prefix match")?;
    for (name, _) in &modes {
        let ms: Vec<f64> = report
            .rows
            .iter()
            .filter(|r| r.mode == *name)
            .map(CompareRow::agreement)
            .collect();
        let mean = ms.iter().sum::<f64>() / ms.len().max(1) as f64;
        outln!("{:<w$} {:>17.1}%", name, mean * 100.0)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_is_the_documented_shape() {
        // docs/design.md §4: `compare --json` is {`baseline`, `rows` of {`mode`, `prompt`,
        // `prefix_match`, `tokens`}}, keys in alphabetical order as before.
        let report = CompareReport {
            baseline: "fp32".into(),
            rows: vec![CompareRow {
                mode: "int4".into(),
                prefix_match: 3,
                prompt: "Once upon a time".into(),
                tokens: 8,
            }],
        };
        let text = serde_json::to_string(&report).unwrap();
        assert_eq!(
            text,
            r#"{"baseline":"fp32","rows":[{"mode":"int4","prefix_match":3,"prompt":"Once upon a time","tokens":8}]}"#
        );
        let back: CompareReport = serde_json::from_str(&text).unwrap();
        assert_eq!(back, report);
        assert_eq!(report.rows[0].agreement(), 0.375);
    }
}
