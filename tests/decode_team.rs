//! The decode team (`tinygpt_cpu::relay`): a step run by 2 or 3 threads, each claiming
//! parts of every product and KV heads of attention, gives the same logits, cache and
//! attention weights (`Session::record_probs`, as `perplexity --sink-report` records them)
//! bit for bit as the same step on one thread (the rows path), for every model shape the
//! fixtures have (head_dim 32, 64 and 256, GQA, MQA, biases, a sliding window, Gemma 3's
//! sliding layers, f16/bf16 weights, YOCO shared layers, GGML-block weights) and every
//! kind of cache — with attention split within KV heads (`AttnSplit::Always`, forced at
//! every context length) and not (`Never`, and `Auto` at these short contexts).

mod common;
use common::*;
use tinygpt_cpu::attention::AttnSplit;
use tinygpt_cpu::kv_cache::{KeyRope, KvConfig, Precision};
use tinygpt_cpu::model::{Model, WeightsDType};
use tinygpt_cpu::weights::ModelFiles;

const STEPS: usize = 40;

fn caches() -> Vec<(&'static str, KvConfig)> {
    vec![
        ("fp32 dense", KvConfig::default()),
        ("int4 sink 4 + window 20", int4_window()),
        (
            "int2 residual 8, pre-RoPE keys",
            KvConfig {
                precision: Precision::Int2,
                group_size: 8,
                residual: 8,
                key_rope: KeyRope::Pre,
                ..KvConfig::default()
            },
        ),
        (
            "fp16 cache positions, sink 2 + window 16",
            fp16_cache_window(),
        ),
        (
            "int8 K, bf16 V",
            KvConfig {
                precision: Precision::Int8,
                v_precision: Some(Precision::Bf16),
                group_size: 8,
                ..KvConfig::default()
            },
        ),
        (
            "bf16 dense",
            KvConfig {
                precision: Precision::Bf16,
                ..KvConfig::default()
            },
        ),
        (
            "int8 residual 4 (Hadamard-rotated where the head dim allows)",
            KvConfig {
                precision: Precision::Int8,
                group_size: 8,
                residual: 4,
                ..KvConfig::default()
            },
        ),
        (
            "fp16 sink 1 + window 12",
            KvConfig {
                precision: Precision::Fp16,
                sink: 1,
                window: Some(12),
                ..KvConfig::default()
            },
        ),
    ]
}

/// Logits (and, with `probs`, every layer's attention weights) of each step of a greedy
/// run of `STEPS` tokens on a pool of `threads` threads; the tokens fed are `feed` when
/// given (so every run sees the same inputs), else the run's own greedy picks.
fn run(
    model: &Model,
    kv: &KvConfig,
    threads: usize,
    probs: bool,
    feed: Option<&[u32]>,
    split: AttnSplit,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    pool(threads).install(|| {
        let mut s = model.session(kv);
        s.record_probs = probs;
        s.attn_split = split;
        let mut tokens = vec![1u32];
        let mut out = Vec::new();
        for pos in 0..STEPS {
            let t = feed.map_or(tokens[pos], |f| f[pos]);
            model.forward(&mut s, t, pos).expect("forward");
            let mut rec = s.logits.clone();
            if probs {
                rec.extend(s.probs.iter().flatten());
            }
            out.push(rec);
            tokens.push(argmax(&s.logits));
        }
        (tokens, out)
    })
}

fn check(name: &str, model: &Model) {
    for (cache, kv) in caches() {
        for probs in [false, true] {
            let (tokens, one) = run(model, &kv, 1, probs, None, AttnSplit::Never);
            for threads in [2, 3] {
                for split in [AttnSplit::Never, AttnSplit::Always, AttnSplit::Auto] {
                    let feed = Some(&tokens[..]);
                    let (_, team) = run(model, &kv, threads, probs, feed, split);
                    for (pos, (a, b)) in one.iter().zip(&team).enumerate() {
                        let same = a.len() == b.len()
                            && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                        assert!(
                            same,
                            "{name}, {cache}, probs {probs}, {split:?}: {threads} threads \
                             differ from 1 at step {pos} (max |diff| {})",
                            max_abs_diff(a, b)
                        );
                    }
                }
            }
        }
    }
}

fn load(files: &ModelFiles) -> Model {
    Model::load(files, WeightsDType::Native).expect("model loads")
}

#[test]
fn team_equals_one_thread_on_the_bundled_model() {
    check("bundled", &load(&ModelFiles::open(None).expect("bundled")));
}

#[test]
fn team_equals_one_thread_with_yoco_shared_layers() {
    let files = ModelFiles::open(Some(&fixtures().join("yoco"))).expect("yoco fixture");
    check("yoco", &load(&files));
}

#[test]
fn team_equals_one_thread_on_the_unseen_model_shapes() {
    for dir in [
        "qwen2-bias",
        "mistral-sliding-f16",
        "llama3-untied-bf16",
        "llama-linear-sharded",
    ] {
        let files = ModelFiles::open(Some(&fixtures().join("unseen").join(dir)))
            .unwrap_or_else(|e| panic!("{dir}: {e}"));
        check(dir, &load(&files));
    }
}

/// The tiny GGUF architecture fixtures: Gemma 3 (sliding and global layers, their own
/// RoPE bases), Qwen3 (q/k norms) and a head_dim 256 MQA model (one KV head: every member
/// shares it only when attention is split).
#[test]
fn team_equals_one_thread_on_the_gguf_archs() {
    for arch in ["gemma3", "qwen3", "qwen3-hd256-mqa"] {
        let path = fixtures().join(format!("archs/{arch}/{arch}.gguf"));
        let files = ModelFiles::open(Some(&path)).unwrap_or_else(|e| panic!("{arch}: {e}"));
        check(arch, &load(&files));
    }
}

#[test]
fn team_equals_one_thread_on_smollm2_q4_1() {
    let Some(path) = smollm2_path() else {
        eprintln!("SKIP: SmolLM2 GGUF not available (set TINYGPT_SMOLLM2)");
        return;
    };
    let files = ModelFiles::open(Some(&path)).expect("SmolLM2");
    let model = load(&files);
    // One cache per kind of store is enough at this size; the attention weights recorded
    // with the first.
    for (i, (cache, kv)) in caches().into_iter().take(3).enumerate() {
        let probs = i == 0;
        let (tokens, one) = run(&model, &kv, 1, probs, None, AttnSplit::Never);
        for split in [AttnSplit::Never, AttnSplit::Always] {
            let (_, team) = run(&model, &kv, 2, probs, Some(&tokens), split);
            for (pos, (a, b)) in one.iter().zip(&team).enumerate() {
                assert!(
                    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "SmolLM2, {cache}, probs {probs}, {split:?}: 2 threads differ from 1 at \
                     step {pos}"
                );
            }
        }
    }
}
