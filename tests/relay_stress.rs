//! The relay team (`tinygpt_cpu::relay`) with members made late on purpose
//! (`relay::set_stress`: random sleeps before publishing and inside serial phases, items
//! taken over without grace): take-overs, skipped phases and late publishers on every
//! step, and still the logits of one thread bit for bit, for models with GQA, MQA, q/k
//! norms, sliding layers and YOCO shared layers, dense and windowed caches, split and
//! whole-head attention, on 2 and 3 threads (on 3, with the attention weights recorded,
//! and those too equal one thread's).

mod common;
use common::*;
use tinygpt_cpu::attention::AttnSplit;
use tinygpt_cpu::kv_cache::KvConfig;
use tinygpt_cpu::model::{Model, WeightsDType};
use tinygpt_cpu::relay;
use tinygpt_cpu::weights::ModelFiles;

const STEPS: usize = 24;

/// Each step's logits of `tokens` fed in order, on `threads` threads, followed by every
/// layer's attention weights when `probs`.
fn logits(
    model: &Model,
    kv: &KvConfig,
    tokens: &[u32],
    threads: usize,
    split: AttnSplit,
    probs: bool,
) -> Vec<Vec<f32>> {
    pool(threads).install(|| {
        let mut s = model.session(kv);
        s.attn_split = split;
        s.record_probs = probs;
        tokens
            .iter()
            .enumerate()
            .map(|(pos, &t)| {
                model.forward(&mut s, t, pos).expect("forward");
                let mut rec = s.logits.clone();
                if probs {
                    rec.extend(s.probs.iter().flatten());
                }
                rec
            })
            .collect()
    })
}

#[test]
fn late_relay_members_change_no_bit() {
    relay::set_stress(true);
    let caches = [
        ("fp32 dense", KvConfig::default()),
        ("int4 sink 4 + window 20", int4_window()),
        (
            "fp16 cache positions, sink 2 + window 16",
            fp16_cache_window(),
        ),
    ];
    let mut models = vec![
        ("bundled", ModelFiles::open(None).expect("bundled")),
        (
            "yoco",
            ModelFiles::open(Some(&fixtures().join("yoco"))).expect("yoco"),
        ),
    ];
    for arch in ["gemma3", "qwen3", "qwen3-hd256-mqa"] {
        let path = fixtures().join(format!("archs/{arch}/{arch}.gguf"));
        models.push((arch, ModelFiles::open(Some(&path)).expect("arch fixture")));
    }
    let before = relay::taken_over_total();
    for (name, files) in &models {
        let model = Model::load(files, WeightsDType::Native).expect("model loads");
        let tokens: Vec<u32> = (0..STEPS as u32)
            .map(|i| (i * 7 + 1) % model.cfg.vocab_size as u32)
            .collect();
        let vocab = model.cfg.vocab_size;
        for (cache, kv) in &caches {
            let one = logits(&model, kv, &tokens, 1, AttnSplit::Never, true);
            for threads in [2, 3] {
                let probs = threads == 3;
                for split in [AttnSplit::Never, AttnSplit::Always] {
                    let got = logits(&model, kv, &tokens, threads, split, probs);
                    for (pos, (a, b)) in one.iter().zip(&got).enumerate() {
                        // Without recorded weights: the logits, one thread's record's start.
                        let a = if probs { &a[..] } else { &a[..vocab] };
                        assert!(
                            a.len() == b.len()
                                && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                            "{name}, {cache}, {split:?}: a stressed relay of {threads} \
                             differs from one thread at step {pos} (max |diff| {})",
                            max_abs_diff(a, b)
                        );
                    }
                }
            }
        }
    }
    assert!(
        relay::taken_over_total() > before,
        "no item was taken over: the stress did not make any member late"
    );
}
