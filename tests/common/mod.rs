//! Shared helpers for the integration tests: fixture paths, golden files, greedy runs.
#![allow(dead_code)]

pub mod probe;
pub mod server;

use std::path::PathBuf;
use tinygpt_cpu::generate::Engine;
use tinygpt_cpu::kv_cache::{KvConfig, PositionsMode, Precision};

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn fixtures() -> PathBuf {
    root().join("fixtures")
}

/// The SmolLM2-135M GGUF fetched by scripts/fetch-smollm2.sh: `TINYGPT_SMOLLM2`, else
/// `$TINYGPT_CACHE` (or `~/.cache/tinygpt-cpu`)`/smollm2/...`. Without it a test skips
/// locally (printing why) and fails in CI (where `CI` is set), which must fetch it.
pub fn smollm2_path() -> Option<PathBuf> {
    let p = std::env::var_os("TINYGPT_SMOLLM2")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let cache = std::env::var_os("TINYGPT_CACHE")
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                        .join(".cache/tinygpt-cpu")
                });
            cache.join("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    if p.is_file() {
        return Some(p);
    }
    if std::env::var_os("CI").is_some() {
        panic!(
            "SmolLM2 GGUF not found at {}: CI must run scripts/fetch-smollm2.sh",
            p.display()
        );
    }
    eprintln!(
        "skipping: SmolLM2 not found at {} (run scripts/fetch-smollm2.sh)",
        p.display()
    );
    None
}

pub fn golden(name: &str) -> serde_json::Value {
    let p = fixtures().join("golden").join(name);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).unwrap()
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("array of ids")
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

pub fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .expect("array of floats")
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

pub fn argmax(x: &[f32]) -> u32 {
    tinygpt_cpu::ops::argmax(x) as u32
}

/// Top-1 minus top-2 of `x`.
pub fn margin(x: &[f32]) -> f32 {
    let mut v = x.to_vec();
    v.sort_by(|a, b| b.total_cmp(a));
    v[0] - v[1]
}

/// A greedy run: the prompt's last logits, then `n` tokens with the logits that chose each.
pub struct Greedy {
    pub ids: Vec<u32>,
    /// logits[i] chose ids[i]
    pub logits: Vec<Vec<f32>>,
}

pub fn greedy(e: &mut dyn Engine, prompt: &[u32], n: usize) -> Greedy {
    let mut pos = 0;
    let mut last = Vec::new();
    for &t in prompt {
        last = e.forward(t, pos).unwrap().to_vec();
        pos += 1;
    }
    let mut ids = Vec::new();
    let mut logits = Vec::new();
    for i in 0..n {
        let next = argmax(&last);
        ids.push(next);
        logits.push(last.clone());
        if i + 1 < n {
            last = e.forward(next, pos).unwrap().to_vec();
            pos += 1;
        }
    }
    Greedy { ids, logits }
}

/// Steps until two id sequences differ (their common prefix length).
pub fn prefix_match(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// A command running the CLI binary. On a cross-compiled test run (the test binary itself
/// started through a runner such as `qemu-aarch64`), the binary is started through the
/// same runner: cargo's `CARGO_TARGET_<TRIPLE>_RUNNER` (e.g. set by
/// scripts/test-aarch64.sh) is read from the environment.
pub fn cli() -> std::process::Command {
    let bin = env!("CARGO_BIN_EXE_tinygpt-cpu");
    let runner_var = match std::env::consts::ARCH {
        "aarch64" => Some("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER"),
        _ => None,
    };
    let runner = runner_var.and_then(|v| std::env::var(v).ok());
    match runner.as_deref().map(str::split_whitespace) {
        Some(mut parts) => match parts.next() {
            Some(first) => {
                let mut c = std::process::Command::new(first);
                c.args(parts).arg(bin);
                c
            }
            None => std::process::Command::new(bin),
        },
        None => std::process::Command::new(bin),
    }
}

/// Asserts a CLI run succeeded and parses its stdout as one JSON object.
pub fn json_of(out: &std::process::Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "exit {:?}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not one JSON object ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// Copies the tiny HF directory into a temp dir so a test can break one file.
pub fn tiny_copy() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::copy(fixtures().join("tiny").join(f), d.path().join(f)).unwrap();
    }
    d
}

/// Runs `f` on every job, two jobs at a time (the CI machine has 2 cores; each job is a
/// scalar reference run that would otherwise leave one idle). Jobs are independent and each
/// checks exactly what it would alone; a panic in one fails the test.
#[allow(dead_code)]
pub fn on_two_workers<T: Sync>(jobs: &[T], f: impl Fn(&T) + Sync) {
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                while let Some(job) =
                    jobs.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed))
                {
                    f(job);
                }
            });
        }
    });
}

/// The small windowed cache the thread-count tests run beside the dense one: int4 in
/// groups of 8, StreamingLLM sink 4 + window 20 (eviction and requantisation within 70
/// steps).
/// The flagship cache's flags (StreamingLLM sink 4 + window 252, int4 KIVI), as a server
/// or `sample` takes them.
pub const FLAGSHIP_CACHE_FLAGS: [&str; 6] = [
    "--streaming-llm-sink",
    "4",
    "--streaming-llm-window",
    "252",
    "--kv-quantize",
    "int4",
];

pub fn int4_window() -> KvConfig {
    KvConfig {
        precision: Precision::Int4,
        group_size: 8,
        sink: 4,
        window: Some(20),
        ..KvConfig::default()
    }
}

/// An fp16 cache in `cache` positions mode with StreamingLLM sink 2 + window 16 (keys
/// rotated by slot at read time), as the thread-count tests run it.
pub fn fp16_cache_window() -> KvConfig {
    KvConfig {
        precision: Precision::Fp16,
        sink: 2,
        window: Some(16),
        positions: PositionsMode::Cache,
        ..KvConfig::default()
    }
}

/// A rayon pool of `n` threads.
pub fn pool(n: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build()
        .expect("thread pool")
}

/// The engine options of the tests that compare with the reference: the KIVI kernels the
/// test's own knob `TINYGPT_KV_KERNEL` names (`fast`, `exact` or a variant this CPU has; a
/// bad value fails the test), else the fast ones. The engine itself reads no environment:
/// the test passes these to `Model::load_opts`.
pub fn kv_kernel_opts() -> tinygpt_cpu::exec::ExecOptions {
    let kv_kernel = match std::env::var("TINYGPT_KV_KERNEL") {
        Ok(s) => s.parse().expect("TINYGPT_KV_KERNEL"),
        Err(_) => tinygpt_cpu::exec::KvKernelChoice::Fast,
    };
    tinygpt_cpu::exec::ExecOptions {
        kv_kernel,
        ..Default::default()
    }
}

/// Chi-square statistic of two equal-size samples over the categories seen at least `min`
/// times in both together (the others pooled into one), and its degrees of freedom.
pub fn chi_square<T: Ord>(a: &[T], b: &[T], min: usize) -> (f64, usize) {
    let mut counts: std::collections::BTreeMap<&T, (usize, usize)> =
        std::collections::BTreeMap::new();
    for x in a {
        counts.entry(x).or_default().0 += 1;
    }
    for x in b {
        counts.entry(x).or_default().1 += 1;
    }
    let mut cells: Vec<(usize, usize)> = Vec::new();
    let mut rest = (0, 0);
    for (_, (x, y)) in counts {
        if x + y >= min {
            cells.push((x, y));
        } else {
            rest.0 += x;
            rest.1 += y;
        }
    }
    if rest.0 + rest.1 > 0 {
        cells.push(rest);
    }
    let stat = cells
        .iter()
        .map(|&(x, y)| {
            let (x, y) = (x as f64, y as f64);
            (x - y).powi(2) / (x + y)
        })
        .sum();
    (stat, cells.len().saturating_sub(1).max(1))
}

/// The 1e-4 upper quantile of chi-square with `df` degrees of freedom, by the
/// Wilson–Hilferty approximation (z = 3.719).
pub fn chi_square_critical_1e4(df: usize) -> f64 {
    let z = 3.719;
    let a = 2.0 / (9.0 * df as f64);
    df as f64 * (1.0 - a + z * a.sqrt()).powi(3)
}
