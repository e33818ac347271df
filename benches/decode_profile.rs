//! Where a decode step's time goes, per op and weight type, against a plain read loop
//! (issue 45's table): not a criterion bench, one run that prints a markdown table.
//!
//! ```text
//! cargo bench --bench decode_profile -- MODEL.gguf [--prompt-tokens 128] [--tokens 64]
//!     [--kv fp16] [--rounds 3]
//! ```
//!
//! The model runs on one thread (the rows path, `Model::forward_profiled`, whose values
//! are `forward`'s): a prompt of `--prompt-tokens` ids (the held-out text's, cycled) is
//! prefilled, then `--tokens` greedy steps are timed stage by stage (each stage's
//! weights' bytes counted in their file type), the sampler beside them (greedy, and the
//! CLI's default top-k 40 / top-p 0.95 / temperature 0.8 on the same logits). `--rounds`
//! repeats the decode (the cache reset to the prompt each time) and the table takes each
//! op's median round. The read probe is the same loop as `cargo bench --bench kernels --
//! read_bandwidth` (eight f32x8 accumulators), over a 256 MiB huge-page-advised mapping,
//! the best of 5 passes, on this thread, measured between rounds: an op's GB/s over the
//! probe's is how near it runs to what one core can read here.

mod common;

use common::sum_read;
use std::path::PathBuf;
use std::time::Instant;
use tinygpt_cpu::kv_cache::{KvConfig, Precision};
use tinygpt_cpu::model::{Model, StepProfile, WeightsDType};
use tinygpt_cpu::sampler::{Sampler, SamplerConfig};
use tinygpt_cpu::weights::ModelFiles;

struct Args {
    model: PathBuf,
    prompt_tokens: usize,
    tokens: usize,
    kv: Precision,
    rounds: usize,
}

fn args() -> Args {
    let mut a = Args {
        model: PathBuf::new(),
        prompt_tokens: 128,
        tokens: 64,
        kv: Precision::Fp16,
        rounds: 3,
    };
    let mut it = std::env::args().skip(1).filter(|s| s != "--bench");
    while let Some(s) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| panic!("{s} needs a value"));
        match s.as_str() {
            "--prompt-tokens" => a.prompt_tokens = val().parse().expect("--prompt-tokens"),
            "--tokens" => a.tokens = val().parse().expect("--tokens"),
            "--rounds" => a.rounds = val().parse().expect("--rounds"),
            "--kv" => a.kv = Precision::parse(&val()).expect("--kv: fp32, fp16, bf16, int8, int4"),
            p if !p.starts_with("--") => a.model = PathBuf::from(p),
            other => panic!("unknown argument {other}"),
        }
    }
    assert!(
        !a.model.as_os_str().is_empty(),
        "usage: cargo bench --bench decode_profile -- MODEL.gguf [--prompt-tokens N] [--tokens N] [--kv P] [--rounds N]"
    );
    a
}

/// One thread's read bandwidth, GB/s: the best of 5 passes over a 256 MiB mapping.
fn probe_gbs() -> f64 {
    let bytes = 256usize << 20;
    let mut map = memmap2::MmapMut::map_anon(bytes).expect("anonymous mapping");
    #[cfg(target_os = "linux")]
    let _ = map.advise(memmap2::Advice::HugePage);
    let x: &mut [f32] = bytemuck::cast_slice_mut(&mut map[..]);
    x.fill(1e-3);
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t0 = Instant::now();
        std::hint::black_box(sum_read(std::hint::black_box(x)));
        best = best.min(t0.elapsed().as_secs_f64());
    }
    bytes as f64 / best / 1e9
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let a = args();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("pool");
    pool.install(|| run(&a));
}

fn run(a: &Args) {
    let files = ModelFiles::open(Some(&a.model)).unwrap_or_else(|e| panic!("{e}"));
    let model = Model::load(&files, WeightsDType::Native).unwrap_or_else(|e| panic!("{e}"));
    let text =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/heldout.txt"))
            .expect("fixtures/heldout.txt");
    let ids = files
        .tokenizer()
        .and_then(|t| t.encode(&text))
        .expect("encode");
    let prompt: Vec<u32> = ids.iter().copied().cycle().take(a.prompt_tokens).collect();
    let kv = KvConfig {
        precision: a.kv,
        ..KvConfig::default()
    };
    let default_sampling = SamplerConfig {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        seed: 1,
    };
    let mut rounds: Vec<(StepProfile, f64, f64, f64)> = Vec::new();
    let mut probes = Vec::new();
    for _ in 0..a.rounds {
        probes.push(probe_gbs());
        let mut s = model.session(&kv);
        model
            .forward_batch(&mut s, &prompt, 0, None)
            .unwrap_or_else(|e| panic!("{e}"));
        let mut prof = StepProfile::default();
        let (mut greedy, mut sampled) = (
            Sampler::new(SamplerConfig::greedy()),
            Sampler::new(default_sampling.clone()),
        );
        let (mut t_greedy, mut t_sampled) = (0.0, 0.0);
        let mut tok = greedy.sample(&s.logits);
        let t_all = Instant::now();
        for i in 0..a.tokens {
            model
                .forward_profiled(&mut s, tok, prompt.len() + i, &mut prof)
                .unwrap_or_else(|e| panic!("{e}"));
            let t0 = Instant::now();
            tok = greedy.sample(&s.logits);
            t_greedy += t0.elapsed().as_secs_f64();
            let t0 = Instant::now();
            std::hint::black_box(sampled.sample(&s.logits));
            t_sampled += t0.elapsed().as_secs_f64();
        }
        let wall = t_all.elapsed().as_secs_f64() - t_sampled;
        rounds.push((prof, t_greedy, t_sampled, wall));
    }
    probes.push(probe_gbs());
    let probe = median(probes.clone());
    let n = a.tokens as f64;
    let labels: Vec<String> = rounds[0].0.ops.keys().cloned().collect();
    let step_ms = median(rounds.iter().map(|r| r.3 / n * 1e3).collect());
    println!(
        "# {} — {} prompt tokens, {} greedy steps, {} cache, 1 thread, median of {} rounds",
        a.model.display(),
        a.prompt_tokens,
        a.tokens,
        a.kv.name(),
        a.rounds
    );
    println!(
        "# read probe (1 thread, 256 MiB): {probe:.1} GB/s (passes {}); step {step_ms:.2} ms = {:.1} tok/s",
        probes.iter().map(|p| format!("{p:.1}")).collect::<Vec<_>>().join(", "),
        1e3 / step_ms
    );
    println!("| op | calls/step | ms/step | share | MB/step | GB/s | of probe |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let mut total_bytes = 0.0;
    for l in &labels {
        let ms = median(rounds.iter().map(|r| r.0.ops[l].secs / n * 1e3).collect());
        let o = rounds[0].0.ops[l];
        let mb = o.bytes as f64 / n / 1e6;
        total_bytes += mb;
        let (gbs, of) = if o.bytes > 0 {
            let g = mb / ms;
            (format!("{g:.1}"), format!("{:.0}%", 100.0 * g / probe))
        } else {
            ("".into(), "".into())
        };
        println!(
            "| {l} | {} | {ms:.3} | {:.1}% | {mb:.1} | {gbs} | {of} |",
            o.calls as f64 / n,
            100.0 * ms / step_ms
        );
    }
    let greedy_ms = median(rounds.iter().map(|r| r.1 / n * 1e3).collect());
    let sampled_ms = median(rounds.iter().map(|r| r.2 / n * 1e3).collect());
    println!(
        "| sampling (greedy) | 1 | {greedy_ms:.3} | {:.1}% | | | |",
        100.0 * greedy_ms / step_ms
    );
    println!(
        "| sampling (top-k 40, top-p 0.95, T 0.8; not in the step) | 1 | {sampled_ms:.3} | | | | |"
    );
    let ops_ms = median(rounds.iter().map(|r| r.0.total_secs() / n * 1e3).collect());
    println!(
        "| **step** (ops {ops_ms:.2} ms + greedy sampling + the rest) | | {step_ms:.3} | 100% | {total_bytes:.1} | {:.1} | {:.0}% |",
        total_bytes / step_ms,
        100.0 * total_bytes / step_ms / probe
    );
}
