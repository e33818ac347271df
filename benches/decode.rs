//! Decode and prefill throughput (criterion; throughput = tokens).
//!
//! * `decode/{tiny,flagship}/{kv}-{dense,streaming}/{len}`: one single-token decode step
//!   with the cache already holding `len` tokens, all cores. `tiny` is the bundled default
//!   model (6 layers, hidden 128, 4 heads / 2 KV heads, vocab 2048); `flagship` the
//!   generated flagship-huge shape (12 layers, hidden 256, 8 heads / 8 KV heads, head dim
//!   32, intermediate 768, vocab 2048, f32 random weights; see `common`). The cache is
//!   filled through `LayerKv::append` with synthetic rows (the model's own code path for
//!   storing, quantising and evicting, minus the minutes a 16K-token prefill would take);
//!   then only `Model::forward` is timed. Streaming = 4 sinks + 252 recent tokens, so the
//!   stored rows stay at 256 whatever `len` is. The default model's context is 256: these
//!   direct API calls do not check it (as `--allow-past-context` does not).
//! * `engine_vs_reference/tiny-fp32/{reference,engine-1t,engine-Nt}/{len}`: the scalar
//!   reference crate (single-threaded by construction) beside the engine on a 1-thread and
//!   an all-cores rayon pool. The `-cpu` variants of the single-threaded runs read the
//!   thread's CPU-time clock instead of the wall clock, so their ratio holds on a shared
//!   machine where other processes take turns on the cores.
//! * `decode_kivi/smollm2/{mode}-{dense,streaming}/4K-cpu`: SmolLM2-135M (native Q4_1, when
//!   `TINYGPT_SMOLLM2` or the fetch script's cache path names it; skipped with a message
//!   otherwise), one decode step with 4,096 tokens seen, 1 thread, CPU-time clock, for every
//!   KIVI mode of README's 4,096-token table (`+rN` residual, `+pre` pre-RoPE keys, `kXvY`
//!   asymmetric; post-RoPE quantised modes are Hadamard-rotated by the default
//!   `--kv-rotation auto`, `+norot` is KIVI as published, `+pre+rot` forces rotation with
//!   pre-RoPE keys). This is the table's decode-speed column.
//! * `prefill/{tiny,flagship}/{batched,token-by-token}/256`: a 256-token prompt into an
//!   empty fp32 cache, through `forward_batch` or 256 calls of `forward`.
//!
//! Every decode step appends a row, so the timed loop restores the filled cache (outside
//! the timer) every `len / 32` steps: the measured length stays within 3% of `len`.
//!
//! Run: `cargo bench --bench decode` (about 6 minutes on 2 cores; the defaults below are
//! 1 s warm-up, 3 s measurement, 10 samples). Filter with a substring, e.g.
//! `cargo bench --bench decode -- engine_vs_reference`.

mod common;

use common::{
    all_cores, flagship_files, kv_config, len_label, pool, smollm2_path, Clock, SyntheticRows,
};
use criterion::{
    criterion_group, criterion_main, BatchSize, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use std::time::Duration;
use tinygpt_cpu::kv_cache::{KvCache, KvConfig, Precision};
use tinygpt_cpu::model::{reference_model, Model, Session, WeightsDType};
use tinygpt_cpu::weights::ModelFiles;

/// Cache lengths of the dense runs.
const LENGTHS: [usize; 4] = [128, 1024, 4096, 16384];
/// Sequence lengths of the StreamingLLM runs (the cache holds 256 rows at each).
const STREAMING_LENGTHS: [usize; 3] = [512, 4096, 16384];
/// Cache lengths of the engine-vs-reference runs (the reference is slow).
const REFERENCE_LENGTHS: [usize; 2] = [128, 1024];
const PRECISIONS: [Precision; 4] = [
    Precision::Fp32,
    Precision::Bf16,
    Precision::Int8,
    Precision::Int4,
];
/// The token fed at every decode step (any id works; timing does not depend on it).
const TOKEN: u32 = 42;
const PROMPT_LEN: usize = 256;

/// Decode steps between restorations of the filled cache.
fn reset_every(len: usize) -> usize {
    (len / 32).max(4)
}

/// A session whose cache holds `len` synthetic tokens, plus a pristine copy of that cache.
struct Filled {
    session: Session,
    base: KvCache,
    len: usize,
    steps: usize,
}

impl Filled {
    fn new(model: &Model, kv: &KvConfig, len: usize) -> Self {
        let mut session = model.session(kv);
        SyntheticRows::new(model.cfg.kv_dim()).fill(&mut session.cache, len);
        let base = session.cache.clone();
        Filled {
            session,
            base,
            len,
            steps: 0,
        }
    }

    /// Runs `iters` timed decode steps on `threads`; returns the time spent in `forward`
    /// as read on `clock`.
    fn run(
        &mut self,
        model: &Model,
        threads: &rayon::ThreadPool,
        iters: u64,
        clock: Clock,
    ) -> Duration {
        threads.install(|| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                if self.steps == reset_every(self.len) {
                    self.session.cache = self.base.clone();
                    self.steps = 0;
                }
                let t = clock.now();
                model
                    .forward(&mut self.session, TOKEN, self.len + self.steps)
                    .expect("forward");
                total += clock.now() - t;
                self.steps += 1;
            }
            total
        })
    }
}

fn decode_matrix(c: &mut Criterion, name: &str, model: &Model) {
    let threads = pool(all_cores());
    let mut g = c.benchmark_group(format!("decode/{name}"));
    g.throughput(Throughput::Elements(1));
    for p in PRECISIONS {
        for (streaming, lengths) in [(false, &LENGTHS[..]), (true, &STREAMING_LENGTHS[..])] {
            let kv = kv_config(p, streaming);
            let mode = if streaming { "streaming" } else { "dense" };
            for &len in lengths {
                let id = BenchmarkId::new(format!("{}-{mode}", p.name()), len_label(len));
                let mut state: Option<Filled> = None;
                g.bench_function(id, |b| {
                    let st = state.get_or_insert_with(|| Filled::new(model, &kv, len));
                    b.iter_custom(|iters| st.run(model, &threads, iters, Clock::Wall));
                });
            }
        }
    }
    g.finish();
}

fn decode_tiny(c: &mut Criterion) {
    let files = ModelFiles::open(None).expect("bundled model");
    let model = Model::load(&files, WeightsDType::Native).expect("load");
    decode_matrix(c, "tiny", &model);
}

fn decode_flagship(c: &mut Criterion) {
    let (_dir, files) = flagship_files();
    let model = Model::load(&files, WeightsDType::Native).expect("load");
    decode_matrix(c, "flagship", &model);
}

fn engine_vs_reference(c: &mut Criterion) {
    let files = ModelFiles::open(None).expect("bundled model");
    let model = Model::load(&files, WeightsDType::Native).expect("load");
    let reference = reference_model(&files, WeightsDType::Native).expect("reference");
    let kv = kv_config(Precision::Fp32, false);
    let n = all_cores();
    let pools = [(1usize, pool(1)), (n, pool(n))];
    let mut g = c.benchmark_group("engine_vs_reference/tiny-fp32");
    g.throughput(Throughput::Elements(1));
    for len in REFERENCE_LENGTHS {
        for clock in [Clock::Wall, Clock::ThreadCpu] {
            let mut state: Option<(tinygpt_reference::State, Vec<_>, usize)> = None;
            let id = BenchmarkId::new(format!("reference{}", clock.suffix()), len_label(len));
            g.bench_function(id, |b| {
                let (st, base, steps) = state.get_or_insert_with(|| {
                    let mut st = tinygpt_reference::State::new(&reference.cfg, &kv);
                    SyntheticRows::new(reference.cfg.kv_dim()).fill_reference(&mut st.caches, len);
                    let base = st.caches.clone();
                    (st, base, 0)
                });
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        if *steps == reset_every(len) {
                            st.caches = base.clone();
                            *steps = 0;
                        }
                        let t = clock.now();
                        let logits = reference.forward(st, TOKEN, len + *steps);
                        total += clock.now() - t;
                        drop(logits);
                        *steps += 1;
                    }
                    total
                });
            });
        }
        for (threads, p) in &pools {
            let clocks: &[Clock] = if *threads == 1 {
                &[Clock::Wall, Clock::ThreadCpu]
            } else {
                &[Clock::Wall]
            };
            for &clock in clocks {
                let mut state: Option<Filled> = None;
                let id = BenchmarkId::new(
                    format!("engine-{threads}t{}", clock.suffix()),
                    len_label(len),
                );
                g.bench_function(id, |b| {
                    let st = state.get_or_insert_with(|| Filled::new(&model, &kv, len));
                    b.iter_custom(|iters| st.run(&model, p, iters, clock));
                });
            }
        }
    }
    g.finish();
}

fn prefill_pair(c: &mut Criterion, name: &str, model: &Model, flat: bool) {
    let threads = pool(all_cores());
    let kv = kv_config(Precision::Fp32, false);
    let vocab = model.cfg.vocab_size as u32;
    let tokens: Vec<u32> = (0..PROMPT_LEN as u32)
        .map(|i| (i * 37 + 5) % vocab)
        .collect();
    let mut g = c.benchmark_group(format!("prefill/{name}"));
    g.throughput(Throughput::Elements(PROMPT_LEN as u64));
    if flat {
        g.sampling_mode(SamplingMode::Flat);
    }
    let id = |what: &str| BenchmarkId::new(what, PROMPT_LEN);
    g.bench_function(id("batched"), |b| {
        b.iter_batched(
            || model.session(&kv),
            |mut s| {
                threads
                    .install(|| model.forward_batch(&mut s, &tokens, 0, None))
                    .expect("forward_batch");
                s
            },
            BatchSize::PerIteration,
        )
    });
    g.bench_function(id("token-by-token"), |b| {
        b.iter_batched(
            || model.session(&kv),
            |mut s| {
                threads.install(|| {
                    for (i, &t) in tokens.iter().enumerate() {
                        model.forward(&mut s, t, i).expect("forward");
                    }
                });
                s
            },
            BatchSize::PerIteration,
        )
    });
    g.finish();
}

fn prefill(c: &mut Criterion) {
    let files = ModelFiles::open(None).expect("bundled model");
    let model = Model::load(&files, WeightsDType::Native).expect("load");
    prefill_pair(c, "tiny", &model, false);
    let (_dir, files) = flagship_files();
    let model = Model::load(&files, WeightsDType::Native).expect("load");
    prefill_pair(c, "flagship", &model, true);
}

/// The KV modes of README's 4,096-token KIVI table (names as `cache-table --modes` takes them).
const KIVI_MODES: [&str; 16] = [
    "fp32",
    "int8",
    "int4",
    "int4+pre",
    "int4+r128",
    "int4+r128+pre",
    "k8v4",
    "int2+r32",
    "int2+r128",
    "int2+r128+pre",
    "k4v2+r128",
    "int8+norot",
    "int4+norot",
    "int4+pre+rot",
    "k8v4+norot",
    "int2+r128+norot",
];

fn decode_kivi(c: &mut Criterion) {
    let Some(path) = smollm2_path() else {
        eprintln!("decode_kivi: SmolLM2 GGUF not found (set TINYGPT_SMOLLM2); skipped");
        return;
    };
    let files = ModelFiles::open(Some(&path)).expect("SmolLM2 GGUF");
    let model = Model::load(&files, WeightsDType::Native).expect("load");
    let threads = pool(1);
    let len = 4096;
    let mut g = c.benchmark_group("decode_kivi/smollm2");
    g.throughput(Throughput::Elements(1));
    for mode in KIVI_MODES {
        for streaming in [false, true] {
            let mut kv = kv_config(Precision::Fp32, streaming);
            tinygpt_cpu::eval::apply_quant_mode(mode, &mut kv).expect("mode name");
            let region = if streaming { "streaming" } else { "dense" };
            let id = BenchmarkId::new(format!("{mode}-{region}"), "4K-cpu");
            let mut state: Option<Filled> = None;
            g.bench_function(id, |b| {
                let st = state.get_or_insert_with(|| Filled::new(&model, &kv, len));
                b.iter_custom(|iters| st.run(&model, &threads, iters, Clock::ThreadCpu));
            });
        }
    }
    g.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(10)
}

criterion_group! {
    name = benches;
    config = config();
    targets = engine_vs_reference, prefill, decode_tiny, decode_flagship, decode_kivi
}
criterion_main!(benches);
