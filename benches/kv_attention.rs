//! Attention-step benchmarks of the KV cache (criterion), single-threaded, CPU-time clock
//! (`-cpu`: robust to other processes on a shared machine). They were timing smoke tests
//! in tests/kv_cache.rs.
//!
//! * `kv_attend_vs_reference/{precision}-{positions}/{engine|reference}`: one `attend`
//!   (append + scores + softmax + weighted sum) at 8 query heads, 2 KV heads, head dim
//!   64, over a layer holding 1K rows: the engine against the scalar reference crate on
//!   the same inputs.
//! * `kv_attend_flagship/{layers}L-{rows}/{precision}-{positions}`: one `attend` per layer
//!   at the flagship shape (8 heads, 8 KV heads, head dim 32) over 4K and 16K stored rows,
//!   for one layer attended over and over (its cache can stay in the last-level cache:
//!   16K fp32 rows are 33.6 MB) and 12 layers in turn as the flagship model does per
//!   token (the caches stream from DRAM: 400 MB of fp32, 64 MB of int4). Time per layer
//!   step; throughput = bytes one layer's cache holds.
//!
//! * `kv_hold/{precision}/{plain|held}`: one speculative-decoding step's cache work on a
//!   SmolLM2-135M-shaped layer (3 KV heads, head dim 64) under sink 4 + window 508, full
//!   and wrapping: `plain` appends 5 rows; `held` holds, appends the same 5 rows and
//!   releases keeping 2 (docs/design.md §3.2). The difference is what a hold costs;
//!   it must not grow with the 512 stored rows.
//!
//! Run: `cargo bench --bench kv_attention` (about 6 minutes on 2 cores); one group:
//! `cargo bench --bench kv_attention -- kv_attend_vs_reference`.

mod common;

use common::{pool, Clock};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::time::Duration;
use tinygpt_cpu::attention::{attend, AttnScratch, RopeTable};
use tinygpt_cpu::config::{Config, RopeScaling};
use tinygpt_cpu::kv_cache::{KvConfig, LayerKv, PositionsMode, Precision};
use tinygpt_reference::kv_cache::LayerCache;
use tinygpt_reference::rope::Rope;

const CLOCK: Clock = Clock::ThreadCpu;
/// Rows appended past the filled length before a layer is restored (each step appends).
const REGROW: usize = 256;

fn config(n_heads: usize, n_kv_heads: usize, head_dim: usize) -> Config {
    Config {
        vocab_size: 16,
        hidden_size: n_heads * head_dim,
        n_layers: 1,
        n_heads,
        n_kv_heads,
        head_dim,
        intermediate_size: 16,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::None,
        max_position_embeddings: 1 << 20,
        tie_word_embeddings: true,
        sliding_window: None,
        layer_types: vec![],
        num_kv_shared_layers: 0,
        attention_bias: false,
        qk_norm: false,
        gemma: Default::default(),
        bos_token_id: None,
        eos_token_ids: vec![],
    }
}

/// Random tokens shaped like real K/V: per-channel K offsets and one outlier channel.
struct Inputs {
    rng: ChaCha8Rng,
    k_bias: Vec<f32>,
}

impl Inputs {
    fn new(seed: u64, kv_dim: usize) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut k_bias: Vec<f32> = (0..kv_dim).map(|_| rng.gen_range(-2.0..2.0)).collect();
        k_bias[kv_dim / 3] = 12.0;
        Inputs { rng, k_bias }
    }
    fn vec(&mut self, n: usize, amp: f32) -> Vec<f32> {
        (0..n).map(|_| self.rng.gen_range(-amp..amp)).collect()
    }
    /// (q, k, v) for one token.
    fn token(&mut self, q_dim: usize, kv_dim: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
        let q = self.vec(q_dim, 1.5);
        let mut k = self.vec(kv_dim, 1.0);
        for (x, b) in k.iter_mut().zip(&self.k_bias) {
            *x += b;
        }
        let v = self.vec(kv_dim, 2.0);
        (q, k, v)
    }
}

fn kv(precision: Precision, positions: PositionsMode) -> KvConfig {
    KvConfig {
        precision,
        positions,
        ..KvConfig::default()
    }
}

fn modes() -> impl Iterator<Item = (Precision, PositionsMode)> {
    Precision::ALL.into_iter().flat_map(|p| {
        [PositionsMode::Original, PositionsMode::Cache]
            .into_iter()
            .map(move |m| (p, m))
    })
}

fn bench_vs_reference(c: &mut Criterion) {
    const ROWS: usize = 1024;
    let cfg = config(8, 2, 64);
    let (rope, table) = (Rope::new(&cfg), RopeTable::new(&cfg));
    let one = pool(1);
    let mut g = c.benchmark_group("kv_attend_vs_reference");
    for (precision, positions) in modes() {
        let kv = kv(precision, positions);
        let mut inputs = Inputs::new(1, cfg.kv_dim());
        let mut engine = LayerKv::new(&kv, 2, 64);
        let mut reference = LayerCache::new(&kv, 2, 64);
        for t in 0..ROWS {
            let (_, k, v) = inputs.token(cfg.q_dim(), cfg.kv_dim());
            engine.append(&k, &v, t);
            reference.append(&k, &v, t);
        }
        let (q, k, v) = inputs.token(cfg.q_dim(), cfg.kv_dim());
        let name = format!("{}-{}", precision.name(), positions.name());
        let mut out = vec![0.0; cfg.q_dim()];
        g.bench_function(BenchmarkId::new(&name, "engine"), |b| {
            let mut scratch = AttnScratch::new(&cfg, &kv);
            b.iter_custom(|iters| {
                one.install(|| {
                    let mut total = Duration::ZERO;
                    let mut layer = engine.clone();
                    for _ in 0..iters {
                        if layer.appended() >= ROWS + REGROW {
                            layer = engine.clone();
                        }
                        let pos = layer.appended();
                        let t = CLOCK.now();
                        attend(
                            &cfg,
                            &table,
                            &mut layer,
                            &q,
                            &k,
                            &v,
                            pos,
                            &mut out,
                            &mut scratch,
                            None,
                        );
                        total += CLOCK.now() - t;
                    }
                    total
                })
            });
        });
        g.bench_function(BenchmarkId::new(&name, "reference"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                let mut layer = reference.clone();
                for _ in 0..iters {
                    if layer.appended() >= ROWS + REGROW {
                        layer = reference.clone();
                    }
                    let pos = layer.appended();
                    let t = CLOCK.now();
                    tinygpt_reference::attention::attend(
                        &cfg, &rope, &mut layer, &q, &k, &v, pos, &mut out, None,
                    );
                    total += CLOCK.now() - t;
                }
                total
            });
        });
    }
    g.finish();
}

fn bench_flagship(c: &mut Criterion) {
    let cfg = config(8, 8, 32);
    let table = RopeTable::new(&cfg);
    let one = pool(1);
    let mut g = c.benchmark_group("kv_attend_flagship");
    for n_layers in [1usize, 12] {
        for rows in [4096usize, 16384] {
            for (precision, positions) in modes() {
                let kv = kv(precision, positions);
                let layers: Vec<LayerKv> = (0..n_layers)
                    .map(|l| {
                        let mut layer = LayerKv::new(&kv, 8, 32);
                        let mut inputs = Inputs::new(1 + l as u64, cfg.kv_dim());
                        for t in 0..rows {
                            let (_, k, v) = inputs.token(cfg.kv_dim(), cfg.kv_dim());
                            layer.append(&k, &v, t);
                        }
                        layer
                    })
                    .collect();
                let (q, k, v) = Inputs::new(99, cfg.kv_dim()).token(cfg.q_dim(), cfg.kv_dim());
                g.throughput(Throughput::Bytes(layers[0].bytes() as u64));
                let id = BenchmarkId::new(
                    format!("{n_layers}L-{rows}"),
                    format!("{}-{}", precision.name(), positions.name()),
                );
                let mut scratch = AttnScratch::new(&cfg, &kv);
                let mut out = vec![0.0; cfg.q_dim()];
                g.bench_function(id, |b| {
                    b.iter_custom(|iters| {
                        one.install(|| {
                            let mut live = layers.clone();
                            let step = |live: &mut [LayerKv],
                                        scratch: &mut AttnScratch,
                                        out: &mut [f32]| {
                                for layer in live.iter_mut() {
                                    let pos = layer.appended();
                                    attend(
                                        &cfg, &table, layer, &q, &k, &v, pos, out, scratch, None,
                                    );
                                }
                            };
                            // A clone has exact capacity: the first append reallocates
                            // every buffer, so it runs untimed.
                            step(&mut live, &mut scratch, &mut out);
                            let mut total = Duration::ZERO;
                            let mut i = 0;
                            while i < iters {
                                if live[0].appended() >= rows + REGROW {
                                    live = layers.clone();
                                    step(&mut live, &mut scratch, &mut out);
                                }
                                let t = CLOCK.now();
                                step(&mut live, &mut scratch, &mut out);
                                total += CLOCK.now() - t;
                                i += 1;
                            }
                            total / n_layers as u32
                        })
                    });
                });
            }
        }
    }
    g.finish();
}

fn bench_hold(c: &mut Criterion) {
    const ROWS: usize = 512;
    const DRAFT: usize = 5;
    let (kv_heads, hd) = (3usize, 64usize);
    let kv_dim = kv_heads * hd;
    let mut g = c.benchmark_group("kv_hold");
    for precision in Precision::ALL {
        let kv = KvConfig {
            precision,
            sink: 4,
            window: Some(ROWS - 4),
            ..KvConfig::default()
        };
        let mut inputs = Inputs::new(7, kv_dim);
        let mut full = LayerKv::new(&kv, kv_heads, hd);
        for t in 0..ROWS + 100 {
            let (_, k, v) = inputs.token(0, kv_dim);
            full.append(&k, &v, t);
        }
        let draft: Vec<(Vec<f32>, Vec<f32>)> = (0..DRAFT)
            .map(|_| {
                let (_, k, v) = inputs.token(0, kv_dim);
                (k, v)
            })
            .collect();
        for held in [false, true] {
            let id = BenchmarkId::new(precision.name(), if held { "held" } else { "plain" });
            g.bench_function(id, |b| {
                b.iter_custom(|iters| {
                    let mut layer = full.clone();
                    let mut total = Duration::ZERO;
                    for i in 0..=iters {
                        let t = CLOCK.now();
                        if held {
                            layer.hold();
                        }
                        for (k, v) in &draft {
                            let pos = layer.appended();
                            layer.append(k, v, pos);
                        }
                        if held {
                            layer.release(2);
                        }
                        // The first step reallocates the clone's exact-capacity buffers.
                        if i > 0 {
                            total += CLOCK.now() - t;
                        }
                    }
                    total
                });
            });
        }
    }
    g.finish();
}

fn criterion_config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(10)
}

criterion_group! {
    name = benches;
    config = criterion_config();
    targets = bench_vs_reference, bench_flagship, bench_hold
}
criterion_main!(benches);
