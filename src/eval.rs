//! Quality through the cache: teacher-forced perplexity along the exact decode path of
//! `sample`, and the attention-sink report.
//!
//! `ppl = exp(mean_{i≥1} −log p(t_i | t_<i))` where each `p` comes from the logits of
//! [`Engine::forward`] one token at a time — with whatever eviction and KV precision the
//! engine's cache applies (docs/design.md §4).

use crate::error::{Error, Result};
use crate::generate::Engine;

/// Perplexity over one chunk of predictions.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ChunkPpl {
    /// First predicted token index (inclusive).
    pub start: usize,
    /// Last predicted token index (exclusive).
    pub end: usize,
    pub ppl: f64,
}

/// The result of a teacher-forced run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PplResult {
    /// Tokens of text evaluated (the first is context only).
    pub tokens: usize,
    pub ppl: f64,
    pub nll_mean: f64,
    pub chunks: Vec<ChunkPpl>,
    /// `nll[i]` = −log p(t_{i+1} | t_≤i).
    #[serde(skip)]
    pub nll: Vec<f64>,
    /// Stopped early by SIGINT: the numbers cover the first `tokens` tokens only.
    #[serde(skip)]
    pub interrupted: bool,
}

/// Negative log-probability of `target` under `logits` (log-softmax in f64).
pub fn nll_of(logits: &[f32], target: u32) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    lse - logits[target as usize] as f64
}

/// Attention mass that queries put on the first [`SINK_POSITIONS`] absolute positions.
pub const SINK_POSITIONS: usize = 8;

/// Accumulated attention-sink statistics.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SinkReport {
    /// `mass[l][p]`: mean over queries and heads of the weight on position `p`, layer `l`.
    pub per_layer: Vec<[f64; SINK_POSITIONS]>,
    /// Mean over layers.
    pub overall: [f64; SINK_POSITIONS],
    /// Mean of `1 / stored` over the same queries: what a uniform attention would give.
    pub uniform: f64,
    /// Queries counted (per layer).
    pub queries: usize,
}

struct SinkAcc {
    mass: Vec<[f64; SINK_POSITIONS]>,
    uniform: f64,
    queries: usize,
}

impl SinkAcc {
    fn new(layers: usize) -> Self {
        SinkAcc {
            mass: vec![[0.0; SINK_POSITIONS]; layers],
            uniform: 0.0,
            queries: 0,
        }
    }

    /// Adds the last step's attention weights (only once the query can see all 8 positions).
    fn add(&mut self, engine: &dyn Engine, pos: usize) {
        if pos < SINK_POSITIONS {
            return;
        }
        let probs = engine.probs();
        let layers = probs.len().max(1) as f64;
        let mut counted = false;
        for (l, p) in probs.iter().enumerate() {
            let positions = engine.positions(l);
            let n = positions.len();
            if n == 0 || !p.len().is_multiple_of(n) {
                continue;
            }
            let heads = p.len() / n;
            for (slot, &ap) in positions.iter().enumerate() {
                if ap < SINK_POSITIONS {
                    let mut m = 0.0f64;
                    for h in 0..heads {
                        m += p[h * n + slot] as f64;
                    }
                    self.mass[l][ap] += m / heads as f64;
                }
            }
            // Mean over layers of 1/stored (layers may hold different row counts).
            self.uniform += 1.0 / n as f64 / layers;
            counted = true;
        }
        if counted {
            self.queries += 1;
        }
    }

    fn finish(self) -> SinkReport {
        let q = self.queries.max(1) as f64;
        let per_layer: Vec<[f64; SINK_POSITIONS]> = self
            .mass
            .iter()
            .map(|m| {
                let mut o = [0.0; SINK_POSITIONS];
                for p in 0..SINK_POSITIONS {
                    o[p] = m[p] / q;
                }
                o
            })
            .collect();
        let mut overall = [0.0; SINK_POSITIONS];
        for m in &per_layer {
            for p in 0..SINK_POSITIONS {
                overall[p] += m[p] / per_layer.len().max(1) as f64;
            }
        }
        SinkReport {
            per_layer,
            overall,
            uniform: self.uniform / q,
            queries: self.queries,
        }
    }
}

/// Teacher-forced perplexity of `tokens` through `engine` (fresh cache), one token at a
/// time. `on_step(i)` is called after each prediction (progress bars).
pub fn perplexity(
    engine: &mut dyn Engine,
    tokens: &[u32],
    chunk: usize,
    sink_report: bool,
    on_step: &mut dyn FnMut(usize),
) -> Result<(PplResult, Option<SinkReport>)> {
    if tokens.len() < 2 {
        return Err(Error::Generate(format!(
            "perplexity needs at least 2 tokens of text, got {}",
            tokens.len()
        )));
    }
    if chunk == 0 {
        return Err(Error::flag("--chunk", "must be > 0"));
    }
    engine.reset();
    engine.set_record_probs(sink_report);
    // One row per attention layer: shared layers attend too (over another layer's rows).
    let mut sinks = sink_report.then(|| SinkAcc::new(engine.probs().len()));
    let mut nll = Vec::with_capacity(tokens.len() - 1);
    let mut interrupted = false;
    for i in 0..tokens.len() - 1 {
        if crate::interrupt::requested() {
            interrupted = true;
            break;
        }
        let logits = engine.forward(tokens[i], i)?;
        crate::generate::check_finite(logits, i)?;
        nll.push(nll_of(logits, tokens[i + 1]));
        if let Some(s) = sinks.as_mut() {
            s.add(engine, i);
        }
        on_step(i + 1);
    }
    engine.set_record_probs(false);
    if nll.is_empty() {
        return Err(Error::Interrupted("before the first prediction".into()));
    }
    // After an interruption the result covers the tokens evaluated so far.
    let tokens = &tokens[..nll.len() + 1];
    let nll_mean = nll.iter().sum::<f64>() / nll.len() as f64;
    // Chunk c holds the predictions of tokens [c·chunk, (c+1)·chunk) (token 0 is never
    // predicted, so the first chunk starts at 1).
    let mut chunks = Vec::new();
    let mut start = 1;
    while start < tokens.len() {
        let end = ((start / chunk + 1) * chunk).min(tokens.len());
        let seg = &nll[start - 1..end - 1];
        let m = seg.iter().sum::<f64>() / seg.len() as f64;
        chunks.push(ChunkPpl {
            start,
            end,
            ppl: m.exp(),
        });
        start = end;
    }
    Ok((
        PplResult {
            tokens: tokens.len(),
            ppl: nll_mean.exp(),
            nll_mean,
            chunks,
            nll,
            interrupted,
        },
        sinks.map(SinkAcc::finish),
    ))
}

/// Reads an evaluation text (`--text`): see [`read_text_for`].
pub fn read_text(path: &std::path::Path) -> Result<String> {
    read_text_for(path, "--text")
}

/// Largest text file read (`--text`, `--prompts`).
pub const MAX_TEXT_BYTES: u64 = 256 << 20;

/// Reads a UTF-8 text file given to `flag`: a clear error for a missing, binary, empty or
/// endless file. It is read in pieces, so `/dev/zero` is refused at its first NUL and an
/// endless pipe at [`MAX_TEXT_BYTES`], before either fills memory.
pub fn read_text_for(path: &std::path::Path, flag: &str) -> Result<String> {
    use std::io::Read;
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if meta.is_dir() {
        return Err(Error::format(
            path,
            format!("is a directory; {flag} takes a UTF-8 text file"),
        ));
    }
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut reader = file.take(MAX_TEXT_BYTES + 1);
    let mut bytes = Vec::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(Error::io(path, e)),
        };
        if buf[..n].contains(&0) {
            return Err(Error::format(
                path,
                format!("looks binary (contains NUL bytes); {flag} takes a UTF-8 text file"),
            ));
        }
        bytes.extend_from_slice(&buf[..n]);
        if bytes.len() as u64 > MAX_TEXT_BYTES {
            return Err(Error::format(
                path,
                format!(
                    "is larger than {} MiB; {flag} takes a text file of at most that size",
                    MAX_TEXT_BYTES >> 20
                ),
            ));
        }
    }
    let text = String::from_utf8(bytes).map_err(|e| {
        Error::format(
            path,
            format!("is not UTF-8 text ({e}); {flag} takes a UTF-8 text file"),
        )
    })?;
    if text.trim().is_empty() {
        return Err(Error::format(path, "is empty"));
    }
    Ok(text)
}

/// Applies a quantisation mode name to `kv`: a precision (`fp32`, `fp16`, `bf16`, `int8`,
/// `int4`, `int2`) or `kXvY` with K bits then V bits (`X`, `Y` ∈ {8, 4, 2}, e.g. `k8v4`,
/// `k4v2`), then optional suffixes `+rN` (residual N), `+pre` / `+post` (key RoPE) and
/// `+rot` / `+norot` (Hadamard rotation forced on / off), e.g. `int2+r128`, `k4v2+r32+pre`, `int4+rot`. The error says what was expected.
pub fn apply_quant_mode(
    name: &str,
    kv: &mut crate::kv_cache::KvConfig,
) -> std::result::Result<(), String> {
    use crate::kv_cache::{KeyRope, Precision};
    let expected = "expected fp32, fp16, bf16, int8, int4, int2 or kXvY (X, Y in 8/4/2, e.g. k8v4), optionally followed by +rN, +pre/+post and +rot/+norot";
    let mut parts = name.split('+');
    let head = parts.next().unwrap_or("");
    // `X`/`Y` name a KIVI width by its bits per code.
    let bits = |c: char| {
        Precision::ALL
            .into_iter()
            .find(|p| p.kivi_bits().is_some() && c.to_digit(10) == Some(p.bits()))
    };
    if let Some(p) = Precision::parse(head) {
        kv.precision = p;
        kv.k_precision = None;
        kv.v_precision = None;
    } else {
        let c: Vec<char> = head.chars().collect();
        match c.as_slice() {
            ['k', x, 'v', y] => match (bits(*x), bits(*y)) {
                (Some(k), Some(v)) => {
                    kv.precision = k;
                    kv.k_precision = None;
                    kv.v_precision = (v != k).then_some(v);
                }
                _ => return Err(format!("'{name}': {expected}")),
            },
            _ => return Err(format!("'{name}': {expected}")),
        }
    }
    for suffix in parts {
        if suffix == "rot" {
            kv.rotation = crate::kv_cache::KvRotation::Hadamard;
        } else if suffix == "norot" {
            kv.rotation = crate::kv_cache::KvRotation::None;
        } else if let Some(r) = suffix.strip_prefix('r') {
            kv.residual = r.parse().map_err(|_| {
                format!("'{name}': +{suffix} is not +r followed by a residual in tokens")
            })?;
        } else if let Some(k) = KeyRope::parse(suffix) {
            kv.key_rope = k;
        } else {
            return Err(format!("'{name}': unknown suffix +{suffix} ({expected})"));
        }
    }
    Ok(())
}

/// Parses `--compare-modes`: `;`-separated modes, each `dense` or `key=value` pairs
/// separated by `,` with keys `sink`, `window`, `kv`, `group`, `positions`, `residual`,
/// `kv_k`, `kv_v`, `key_rope`, `rotation`. `kv` takes a precision or a mode name as in
/// [`apply_quant_mode`] (`kv=k8v4`, `kv=int2+r128`); `kv_k`/`kv_v` override one side's
/// precision. Every mode starts from `base` (the cache flags); `dense` and a mode without
/// `window` keep no window.
pub fn parse_modes(
    spec: &str,
    base: &crate::kv_cache::KvConfig,
) -> Result<Vec<(String, crate::kv_cache::KvConfig)>> {
    use crate::kv_cache::{PositionsMode, Precision};
    let bad = |m: String| Error::flag("--compare-modes", m);
    let mut out = Vec::new();
    for mode in spec.split(';').map(str::trim).filter(|m| !m.is_empty()) {
        let mut kv = base.clone();
        kv.window = None;
        kv.sink = 0;
        if mode != "dense" {
            let mut seen: Vec<&str> = Vec::new();
            for kvp in mode.split(',').map(str::trim) {
                let (k, v) = kvp.split_once('=').ok_or_else(|| {
                    bad(format!(
                        "'{kvp}' in mode '{mode}' is not key=value (or 'dense')"
                    ))
                })?;
                let (k, v) = (k.trim(), v.trim());
                if seen.contains(&k) {
                    return Err(bad(format!("mode '{mode}' gives '{k}' twice")));
                }
                seen.push(k);
                let num = || -> Result<usize> {
                    v.parse::<usize>().map_err(|_| {
                        bad(format!(
                            "'{k}={v}' in mode '{mode}': not a non-negative integer"
                        ))
                    })
                };
                match k {
                    "sink" => kv.sink = num()?,
                    "window" => kv.window = Some(num()?),
                    "group" => kv.group_size = num()?,
                    "kv" => apply_quant_mode(v, &mut kv).map_err(|e| bad(format!("kv={e}")))?,
                    "kv_k" | "kv_v" => {
                        let p = Precision::parse(v).ok_or_else(|| {
                            bad(format!(
                                "{k}={v}: expected fp32, fp16, bf16, int8, int4 or int2"
                            ))
                        })?;
                        if k == "kv_k" {
                            kv.k_precision = Some(p);
                        } else {
                            kv.v_precision = Some(p);
                        }
                    }
                    "residual" => kv.residual = num()?,
                    "key_rope" => {
                        kv.key_rope = crate::kv_cache::KeyRope::parse(v).ok_or_else(|| {
                            bad(format!("key_rope={v}: expected pre or post"))
                        })?
                    }
                    "rotation" => {
                        kv.rotation = crate::kv_cache::KvRotation::parse(v).ok_or_else(|| {
                            bad(format!("rotation={v}: expected auto, none or hadamard"))
                        })?
                    }
                    "positions" => {
                        kv.positions = match v {
                            "original" => PositionsMode::Original,
                            "cache" => PositionsMode::Cache,
                            _ => {
                                return Err(bad(format!(
                                    "positions={v}: expected original or cache"
                                )))
                            }
                        }
                    }
                    _ => {
                        return Err(bad(format!(
                        "unknown key '{k}' in mode '{mode}' (sink, window, kv, group, positions, residual, kv_k, kv_v, key_rope, rotation)"
                    )))
                    }
                }
            }
            if kv.sink > 0 && kv.window.is_none() {
                return Err(bad(format!("mode '{mode}': sink needs a window")));
            }
            if kv.window == Some(0) && kv.sink == 0 {
                return Err(bad(format!(
                    "mode '{mode}': window 0 with sink 0 keeps nothing"
                )));
            }
            if kv.group_size == 0 {
                return Err(bad(format!("mode '{mode}': group must be > 0")));
            }
        }
        if out.iter().any(|(m, _)| m == mode) {
            return Err(bad(format!("mode '{mode}' is listed twice")));
        }
        out.push((mode.to_string(), kv));
    }
    if out.is_empty() {
        return Err(bad("no modes given".into()));
    }
    Ok(out)
}
