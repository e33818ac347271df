//! `Model::forward_profiled` (the decode-step profiler of benches/decode_profile.rs):
//! the same logits and cache as `forward` on one thread, bit for bit, and every stage of
//! every layer counted once per step with the bytes of the weights it reads.

mod common;
use common::*;
use tinygpt_cpu::kv_cache::KvConfig;
use tinygpt_cpu::model::{Model, StepProfile, WeightsDType};
use tinygpt_cpu::weights::ModelFiles;

fn check(files: &ModelFiles, kv: &KvConfig, what: &str) {
    let model = Model::load(files, WeightsDType::Native).unwrap();
    let c = &files.config;
    let prompt: Vec<u32> = (0..9).map(|i| (i * 37 + 5) % c.vocab_size as u32).collect();
    let steps = 12;
    pool(1).install(|| {
        let (mut plain, mut timed) = (model.session(kv), model.session(kv));
        model.forward_batch(&mut plain, &prompt, 0, None).unwrap();
        model.forward_batch(&mut timed, &prompt, 0, None).unwrap();
        let mut prof = StepProfile::default();
        let mut tok = argmax(&plain.logits);
        for i in 0..steps {
            let pos = prompt.len() + i;
            model.forward(&mut plain, tok, pos).unwrap();
            model
                .forward_profiled(&mut timed, tok, pos, &mut prof)
                .unwrap();
            let same = plain
                .logits
                .iter()
                .zip(&timed.logits)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{what}: step {i}: logits differ");
            assert_eq!(
                plain.cache.stored_tokens(),
                timed.cache.stored_tokens(),
                "{what}"
            );
            assert_eq!(plain.cache.bytes(), timed.cache.bytes(), "{what}");
            tok = argmax(&plain.logits);
        }
        assert_eq!(prof.steps, steps as u64, "{what}");
        let n = steps as u64;
        let calls = |prefix: &str| -> u64 {
            prof.ops
                .iter()
                .filter(|(k, _)| k.starts_with(prefix))
                .map(|(_, o)| o.calls)
                .sum()
        };
        let layers = c.n_layers as u64;
        assert_eq!(
            calls("attention"),
            n * layers,
            "{what}: {:?}",
            prof.ops.keys()
        );
        assert_eq!(calls("gate+up "), n * layers, "{what}");
        assert_eq!(calls("down "), n * layers, "{what}");
        assert_eq!(calls("o_proj "), n * layers, "{what}");
        assert_eq!(calls("q/k/v ") + calls("q "), n * layers, "{what}");
        assert_eq!(calls("head "), n, "{what}");
        // Every weight matrix read once a step: the bytes of the file's matrices (the
        // embedding is looked up by row, and a tied head is the embedding).
        let weights: u64 = prof.ops.values().map(|o| o.bytes).sum();
        let per_step: u64 = files
            .tensors
            .values()
            .filter(|t| t.shape.len() == 2 && !t.name.contains("embed_tokens"))
            .map(|t| t.data.bytes().len() as u64)
            .sum();
        let tied_head = match files.tensors.keys().any(|k| k == "lm_head.weight") {
            true => 0,
            false => files.tensors["model.embed_tokens.weight"]
                .data
                .bytes()
                .len() as u64,
        };
        assert_eq!(weights, n * (per_step + tied_head), "{what}");
        assert!(prof.total_secs() > 0.0, "{what}");
    });
}

#[test]
fn profiled_steps_equal_plain_steps_and_count_every_stage() {
    let files = ModelFiles::open(None).unwrap();
    check(&files, &KvConfig::default(), "bundled, fp32");
    check(&files, &int4_window(), "bundled, int4 window");
    // YOCO: shared layers project q only ("q <type>"), attend over their source's cache.
    let yoco = ModelFiles::open(Some(&fixtures().join("yoco"))).unwrap();
    check(&yoco, &KvConfig::default(), "yoco");
}
