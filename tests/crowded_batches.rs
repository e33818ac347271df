//! Batches (prefill chunks, steps of several sequences) on a crowded machine
//! (`tinygpt_cpu::threads::batch`): with the adaptive choice on they run on one thread, and the
//! values are those of one thread and of the whole pool, bit for bit; `--threads N` (the
//! adaptive choice off) keeps the pool. Its own test binary: the crowd check is
//! process-wide.

mod common;
use common::*;
use tinygpt_cpu::kv_cache::KvConfig;
use tinygpt_cpu::model::{Model, WeightsDType};
use tinygpt_cpu::threads::{self, CrowdCheck};
use tinygpt_cpu::weights::ModelFiles;

/// Prefills `prompt` in chunks of 16, then feeds the tokens `decode` one at
/// a time; returns every logits vector and the batches run alone meanwhile.
fn run(
    model: &Model,
    kv: &KvConfig,
    threads: usize,
    adaptive: bool,
    prompt: &[u32],
    decode: &[u32],
) -> (Vec<Vec<f32>>, usize) {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool");
    let before = threads::alone_batches();
    let out = pool.install(|| {
        let mut s = model.session(kv);
        s.adaptive = adaptive;
        let mut out = Vec::new();
        for (i, chunk) in prompt.chunks(16).enumerate() {
            model
                .forward_batch(&mut s, chunk, i * 16, None)
                .expect("prefill");
            out.push(s.logits.clone());
        }
        for (j, &t) in decode.iter().enumerate() {
            model.forward(&mut s, t, prompt.len() + j).expect("decode");
            out.push(s.logits.clone());
        }
        out
    });
    (out, threads::alone_batches() - before)
}

fn same_bits(a: &[Vec<f32>], b: &[Vec<f32>]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())
        })
}

#[test]
fn a_crowded_machine_runs_batches_alone_with_the_same_bits() {
    for dir in [None, Some(fixtures().join("yoco"))] {
        let files = ModelFiles::open(dir.as_deref()).expect("model");
        let model = Model::load(&files, WeightsDType::Native).expect("load");
        let vocab = model.cfg.vocab_size as u32;
        let prompt: Vec<u32> = (0..40u32).map(|i| (i * 11 + 3) % vocab).collect();
        let decode: Vec<u32> = (0..6u32).map(|i| (i * 5 + 2) % vocab).collect();
        for kv in [KvConfig::default(), int4_window()] {
            threads::set_crowd_check(CrowdCheck::Never);
            let (one, _) = run(&model, &kv, 1, false, &prompt, &decode);
            let (pool, alone) = run(&model, &kv, 2, false, &prompt, &decode);
            assert_eq!(alone, 0, "uncrowded: no batch runs alone");
            assert!(
                same_bits(&one, &pool),
                "{dir:?} {kv:?}: 2 threads differ from 1"
            );

            // Crowded, threads forced (adaptive off): the pool is kept.
            threads::set_crowd_check(CrowdCheck::Always);
            let (forced, alone) = run(&model, &kv, 2, false, &prompt, &decode);
            assert_eq!(alone, 0, "--threads forces the pool");
            assert!(same_bits(&one, &forced));

            // Crowded, adaptive: every prefill chunk runs alone, same bits.
            let (crowded, alone) = run(&model, &kv, 2, true, &prompt, &decode);
            assert_eq!(alone, prompt.len().div_ceil(16), "each prefill chunk alone");
            assert!(same_bits(&one, &crowded), "{dir:?} {kv:?}: alone differs");

            // Uncrowded, adaptive: the pool again.
            threads::set_crowd_check(CrowdCheck::Never);
            let (calm, alone) = run(&model, &kv, 2, true, &prompt, &decode);
            assert_eq!(alone, 0);
            assert!(same_bits(&one, &calm));
        }
    }
}
