//! One continuous-batching step of `tinygpt-cpu serve` on SmolLM2-135M (issue 14):
//! `Model::forward_sequences` over B decoding sequences (one token each, every sequence
//! with its own sink 4 + window 252 int4 cache, 10–60 rows as in `serve_load.py`'s
//! rounds) followed by each sequence's greedy pick, as the scheduler runs it.
//!
//! * `serve_step/B{b}-1t-cpu`: B = 1, 4, 16, 64 on one thread, the thread's CPU-time clock
//!   (reproducible on a shared machine); throughput in tokens, so `B16` / `B1` tokens/s is
//!   what batching gains per core (the server's aggregate target is ≥ 4× at 16 streams);
//! * `serve_step/B{b}-2t`: the same on two threads, wall clock.
//!
//! Needs the model: `TINYGPT_SMOLLM2=/path/SmolLM2-135M-Instruct.Q4_1.gguf cargo bench
//! --bench serve_step` (skipped with a message without it).

mod common;

use common::{pool, smollm2_path, Clock};
use criterion::{black_box, criterion_group, criterion_main, Criterion, Throughput};
use std::time::Duration;
use tinygpt_cpu::kv_cache::{KvConfig, Precision};
use tinygpt_cpu::model::{Model, SeqStep, Session, WeightsDType};
use tinygpt_cpu::weights::ModelFiles;

/// B sessions whose distinct prompts have just been prefilled.
struct Batch {
    kv: KvConfig,
    sessions: Vec<Session>,
    next: Vec<u32>,
    pos: Vec<usize>,
}

impl Batch {
    fn new(model: &Model, kv: &KvConfig, b: usize) -> Batch {
        let mut batch = Batch {
            kv: kv.clone(),
            sessions: (0..b).map(|_| model.session(kv)).collect(),
            next: vec![0; b],
            pos: vec![0; b],
        };
        batch.reset(model);
        batch
    }

    fn reset(&mut self, model: &Model) {
        for (i, s) in self.sessions.iter_mut().enumerate() {
            *s = model.session(&self.kv);
            let prompt: Vec<u32> = (0..10).map(|t| 100 + 37 * i as u32 + 7 * t).collect();
            model.forward_batch(s, &prompt, 0, None).unwrap();
            self.next[i] = tinygpt_cpu::ops::argmax(&s.logits) as u32;
            self.pos[i] = prompt.len();
        }
    }

    /// One serve step: the batched forward, then every sequence's greedy pick.
    fn step(&mut self, model: &Model) {
        let toks = self.next.clone();
        let mut steps: Vec<SeqStep<'_>> = self
            .sessions
            .iter_mut()
            .zip(&toks)
            .zip(&self.pos)
            .map(|((session, t), &start)| SeqStep {
                session,
                tokens: std::slice::from_ref(t),
                start,
                all_logits: None,
            })
            .collect();
        model.forward_sequences(&mut steps).unwrap();
        for (i, s) in self.sessions.iter().enumerate() {
            self.next[i] = tinygpt_cpu::ops::argmax(black_box(&s.logits)) as u32;
            self.pos[i] += 1;
        }
    }
}

fn bench_serve_step(c: &mut Criterion) {
    let Some(path) = smollm2_path() else {
        eprintln!("serve_step: SmolLM2 GGUF not found (set TINYGPT_SMOLLM2); skipped");
        return;
    };
    let files = ModelFiles::open(Some(&path)).unwrap();
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    let kv = KvConfig {
        precision: Precision::Int4,
        sink: 4,
        window: Some(252),
        ..KvConfig::default()
    };
    let mut g = c.benchmark_group("serve_step");
    for (threads, clock) in [(1usize, Clock::ThreadCpu), (2, Clock::Wall)] {
        let p = pool(threads);
        for b in [1usize, 4, 16, 64] {
            let mut batch = p.install(|| Batch::new(&model, &kv, b));
            g.throughput(Throughput::Elements(b as u64));
            let id = format!("B{b}-{threads}t{}", clock.suffix());
            g.bench_function(id, |bench| {
                bench.iter_custom(|iters| {
                    p.install(|| {
                        let mut spent = Duration::ZERO;
                        for _ in 0..iters {
                            if batch.pos[0] >= 60 {
                                batch.reset(&model); // not timed
                            }
                            let t0 = clock.now();
                            batch.step(&model);
                            spent += clock.now() - t0;
                        }
                        spent
                    })
                })
            });
        }
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(4))
        .sample_size(10);
    targets = bench_serve_step
}
criterion_main!(benches);
