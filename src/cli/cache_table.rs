//! `tinygpt-cpu cache-table`: bytes a real cache holds after T tokens, per cache mode.

use super::common::{human_bytes, open_model};
use super::plot::{line_chart, Series};
use crate::error::Error;
use crate::eval::apply_quant_mode;
use crate::kv_cache::{KvConfig, PositionsMode, Precision};
use crate::outln;
use clap::Args;
use std::path::PathBuf;

/// The cache flags here are not [`super::common::CacheArgs`]: the sink and window have
/// defaults (they size the bounded rows, which every table has), precisions come from
/// `--modes`, and positions and `--allow-past-context` do not apply to a byte count.
/// Flag names and value types are the shared ones.
#[derive(Args, Debug)]
pub struct CacheTableArgs {
    /// A .tinygpt file, a .gguf file, or a Hugging Face model directory (default: the bundled model).
    pub model: Option<PathBuf>,
    /// Token counts to measure, comma-separated.
    #[arg(long, default_value = "128,256,384,500")]
    pub lengths: String,
    /// Cache modes, comma-separated: fp32, fp16, bf16, int8, int4, int2, or kXvY for K
    /// bits then V bits (k8v4, k4v2), each optionally followed by +rN (KIVI residual of N
    /// tokens, overriding --kv-residual), e.g. "int4,int2+r128,k4v2+r32".
    #[arg(long, default_value = "fp32,fp16,bf16,int8,int4,int2")]
    pub modes: String,
    /// Tokens per K quantisation group.
    #[arg(long = "kv-group-size", default_value_t = 32)]
    pub group_size: usize,
    /// KIVI residual: the newest R tokens of a quantised side stay f32 (counted as f32).
    #[arg(
        long = "kv-residual",
        value_name = "R",
        default_value_t = 0,
        allow_hyphen_values = true
    )]
    pub residual: usize,
    /// Keys stored before or after RoPE (does not change the bytes; accepted for
    /// symmetry with the other commands).
    #[arg(long = "kv-key-rope", value_enum, default_value = "post")]
    pub key_rope: super::common::KeyRopeArg,
    /// Hadamard rotation of K/V (does not change the bytes; accepted for symmetry with the
    /// other commands).
    #[arg(long = "kv-rotation", value_enum, default_value = "auto")]
    pub rotation: super::common::RotationArg,
    /// StreamingLLM sink for the bounded rows (with --streaming-llm-window).
    #[arg(long = "streaming-llm-sink", default_value_t = 4)]
    pub sink: usize,
    /// StreamingLLM window for the bounded rows.
    #[arg(long = "streaming-llm-window", default_value_t = 252)]
    pub window: usize,
    /// Draw bytes vs tokens for each precision, with and without StreamingLLM.
    #[arg(long, value_name = "FILE")]
    pub plot: Option<PathBuf>,
    /// Print one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Fills a real cache with `t` tokens of deterministic pseudo-random K/V rows and returns
/// the bytes its buffers hold.
pub fn measure(cfg: &crate::config::Config, kv: &KvConfig, t: usize) -> usize {
    let mut cache = crate::model::new_cache(cfg, kv);
    let d = cfg.kv_dim();
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let mut k = vec![0.0f32; d];
    let mut v = vec![0.0f32; d];
    for pos in 0..t {
        for x in k.iter_mut().chain(v.iter_mut()) {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            *x = ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0;
        }
        for l in 0..cache.n_layers() {
            cache.layer_mut(l).append(&k, &v, pos);
        }
    }
    cache.bytes()
}

/// One row of the table: mode, the bytes the same eviction holds at fp32 and at bf16 (for
/// the ratio columns), tokens, bytes.
type Row = (String, usize, usize, usize, usize);

/// `cache-table`: checks the flags, opens the model, measures every mode at every length,
/// then draws `--plot` and prints the JSON object or the table.
pub fn run(a: CacheTableArgs) -> anyhow::Result<()> {
    let (lengths, names) = parse_lists(&a)?;
    if let Some(p) = &a.plot {
        super::plot::check_output(p)?;
    }
    let files = open_model(&a.model)?;
    // A model whose tokenizer cannot be built is refused here as by every command.
    files.tokenizer()?;
    let cfg = &files.config;
    // The largest cache measured is the dense fp32 one at the longest length.
    let longest = lengths.iter().copied().max().unwrap_or(0);
    let bytes = longest as u128
        * crate::memory::kv_bytes_per_token(cfg, Precision::Fp32)
        * crate::memory::GROWTH_SLACK;
    crate::memory::check_fits(bytes).map_err(|m| {
        Error::flag(
            "--lengths",
            format!("a dense fp32 cache of {longest} tokens of this model {m}"),
        )
    })?;
    let (rows, series) = measure_modes(&a, cfg, &lengths, &names)?;
    if let Some(path) = &a.plot {
        line_chart(
            path,
            "KV cache bytes vs tokens",
            "tokens",
            "KiB held by the cache",
            &series,
        )?;
    }
    if a.json {
        let v: Vec<serde_json::Value> = rows
            .iter()
            .map(|(m, _, _, t, b)| serde_json::json!({"mode": m, "tokens": t, "bytes": b}))
            .collect();
        outln!("{}", serde_json::json!({ "rows": v }))?;
        return Ok(());
    }
    print_table(&a, &files.path, cfg, &rows)
}

/// `--lengths` and `--modes` as lists, after checking them and the other numeric flags.
fn parse_lists(a: &CacheTableArgs) -> anyhow::Result<(Vec<usize>, Vec<&str>)> {
    let lengths: Vec<usize> = a
        .lengths
        .split(',')
        .map(|s| s.trim().parse::<usize>())
        .collect::<Result<_, _>>()
        .map_err(|_| {
            Error::flag(
                "--lengths",
                format!(
                    "'{}' is not a comma-separated list of token counts",
                    a.lengths
                ),
            )
        })?;
    if lengths.is_empty() || lengths.iter().any(|&t| t == 0 || t > 1 << 22) {
        return Err(Error::flag("--lengths", "each length must be between 1 and 4194304").into());
    }
    if a.group_size == 0 {
        return Err(Error::flag("--kv-group-size", "must be > 0").into());
    }
    if a.window == 0 && a.sink == 0 {
        return Err(Error::flag("--streaming-llm-window", "must be > 0 when the sink is 0").into());
    }
    if a.residual > 1 << 26 {
        return Err(
            Error::flag("--kv-residual", format!("{} is absurdly large", a.residual)).into(),
        );
    }
    let names: Vec<&str> = a
        .modes
        .split(',')
        .map(str::trim)
        .filter(|m| !m.is_empty())
        .collect();
    if names.is_empty() {
        return Err(Error::flag("--modes", "no modes given").into());
    }
    Ok((lengths, names))
}

/// Measures every mode, dense then with StreamingLLM's sink and window, at every length:
/// the table's rows and the plot's series.
fn measure_modes(
    a: &CacheTableArgs,
    cfg: &crate::config::Config,
    lengths: &[usize],
    names: &[&str],
) -> anyhow::Result<(Vec<Row>, Vec<Series>)> {
    let mut rows = Vec::new();
    let mut series = Vec::new();
    for streaming in [false, true] {
        for name in names {
            let mut kv = KvConfig {
                group_size: a.group_size,
                sink: if streaming { a.sink } else { 0 },
                window: streaming.then_some(a.window),
                positions: PositionsMode::Original,
                residual: a.residual,
                key_rope: a.key_rope.into(),
                rotation: a.rotation.into(),
                ..KvConfig::default()
            };
            apply_quant_mode(name, &mut kv).map_err(|e| Error::flag("--modes", e))?;
            crate::kv_cache::validate(&kv, cfg)?;
            let mode = if streaming {
                format!("{},sink={},window={}", kv.quant_name(), a.sink, a.window)
            } else {
                kv.quant_name()
            };
            let mut pts = Vec::new();
            for &t in lengths {
                let bytes = measure(cfg, &kv, t);
                pts.push((t as f64, bytes as f64 / 1024.0));
                // the same eviction at fp32 and bf16, for the ratio columns
                let plain = |p: Precision| {
                    measure(
                        cfg,
                        &KvConfig {
                            precision: p,
                            k_precision: None,
                            v_precision: None,
                            ..kv.clone()
                        },
                        t,
                    )
                };
                rows.push((
                    mode.clone(),
                    plain(Precision::Fp32),
                    plain(Precision::Bf16),
                    t,
                    bytes,
                ));
            }
            series.push(Series {
                name: mode,
                points: pts,
            });
        }
    }
    Ok((rows, series))
}

/// The text table: a header naming the model and its cache shape, then one line per row.
fn print_table(
    a: &CacheTableArgs,
    path: &std::path::Path,
    cfg: &crate::config::Config,
    rows: &[Row],
) -> anyhow::Result<()> {
    let sliding = (0..cfg.layers_with_kv())
        .filter(|&l| cfg.attention_type(l) != crate::config::AttentionType::Full)
        .count();
    let layers = if cfg.layers_with_kv() == cfg.n_layers && sliding == 0 {
        format!("{} layers", cfg.n_layers)
    } else {
        // YOCO: only the layers that hold K/V count; a sliding one holds its last window.
        format!(
            "{} of {} layers hold K/V, {sliding} of them sliding",
            cfg.layers_with_kv(),
            cfg.n_layers
        )
    };
    outln!(
        "KV cache of {} ({layers} x {} KV heads x head_dim {}), group {}; bytes measured from filled caches",
        path.display(),
        cfg.n_kv_heads,
        cfg.head_dim,
        a.group_size
    )?;
    outln!(
        "{:<28} {:>8} {:>14} {:>12} {:>9} {:>9}",
        "mode",
        "tokens",
        "bytes",
        "",
        "vs fp32",
        "vs bf16"
    )?;
    for (m, fp32, bf16, t, b) in rows {
        outln!(
            "{:<28} {:>8} {:>14} {:>12} {:>9.3} {:>9.3}",
            m,
            t,
            b,
            human_bytes(*b as u64),
            *b as f64 / (*fp32).max(1) as f64,
            *b as f64 / (*bf16).max(1) as f64
        )?;
    }
    Ok(())
}
