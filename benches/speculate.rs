//! What a speculative verification pass costs against a plain decode step (criterion).
//!
//! * `verify/{model}/{n}tok-cpu`: one multi-token forward of `n` tokens
//!   (`Model::forward_batch` with every position's logits, as a verification of `n − 1`
//!   drafts runs it) under a cache hold, then `release(0)`; `n = 1` is one plain
//!   `Model::forward`. The cache holds 256 prompt tokens (fp32, dense) before each pass;
//!   1 thread, the thread's CPU-time clock (reproducible on a shared machine). Throughput
//!   is one element per pass, so the reported times compare directly: `time(n) / time(1)`
//!   is the pass's cost in plain steps, which `src/speculate.rs` models as
//!   `1 + COST_PER_DRAFT · (n − 1)`.
//!
//! Models: SmolLM2-135M Q4_1 (`TINYGPT_SMOLLM2`) and Gemma 3 270M Q4_K_M
//! (`TINYGPT_GEMMA3`), each skipped with a message when absent.
//!
//! Run: `cargo bench --bench speculate` (about a minute).

mod common;

use common::{pool, smollm2_path, Clock};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::time::Duration;
use tinygpt_cpu::kv_cache::KvConfig;
use tinygpt_cpu::model::{Model, WeightsDType};
use tinygpt_cpu::weights::ModelFiles;

fn models() -> Vec<(&'static str, std::path::PathBuf)> {
    let mut out = Vec::new();
    match smollm2_path() {
        Some(p) => out.push(("smollm2", p)),
        None => eprintln!("verify: SmolLM2 GGUF not found (set TINYGPT_SMOLLM2); skipped"),
    }
    match std::env::var_os("TINYGPT_GEMMA3").map(std::path::PathBuf::from) {
        Some(p) if p.is_file() => out.push(("gemma3", p)),
        _ => eprintln!("verify: Gemma 3 GGUF not found (set TINYGPT_GEMMA3); skipped"),
    }
    out
}

fn verify(c: &mut Criterion) {
    let threads = pool(1);
    for (name, path) in models() {
        let files = ModelFiles::open(Some(&path)).expect("GGUF");
        let model = Model::load(&files, WeightsDType::Native).expect("load");
        let kv = KvConfig::default();
        let prompt: Vec<u32> = (0..256u32).map(|i| 100 + (i * 37) % 5000).collect();
        let mut s = model.session(&kv);
        threads.install(|| {
            model
                .forward_batch(&mut s, &prompt, 0, None)
                .expect("prefill")
        });
        let mut g = c.benchmark_group(format!("verify/{name}"));
        g.throughput(Throughput::Elements(1));
        g.warm_up_time(Duration::from_millis(500));
        g.measurement_time(Duration::from_secs(3));
        g.sample_size(10);
        let mut all = Vec::new();
        for n in [1usize, 2, 3, 5, 9] {
            let tokens: Vec<u32> = (0..n as u32).map(|i| 200 + i).collect();
            g.bench_function(BenchmarkId::new(format!("{n}tok"), "cpu"), |b| {
                b.iter_custom(|iters| {
                    threads.install(|| {
                        let mut total = Duration::ZERO;
                        for _ in 0..iters {
                            s.cache.hold();
                            let t = Clock::ThreadCpu.now();
                            if n == 1 {
                                model.forward(&mut s, tokens[0], 256).expect("forward");
                            } else {
                                model
                                    .forward_batch(&mut s, &tokens, 256, Some(&mut all))
                                    .expect("verify");
                            }
                            total += Clock::ThreadCpu.now() - t;
                            s.cache.release(0);
                        }
                        total
                    })
                });
            });
        }
        g.finish();
    }
}

criterion_group!(benches, verify);
criterion_main!(benches);
