//! The KV cache inside the model: every precision × streaming × positions combination on
//! the bundled model, engine against reference (identical greedy ids), bounded bytes, and
//! KIVI quality against the fp32 cache.

mod common;
use common::*;
use tinygpt_cpu::generate::{Engine, EngineRun, ReferenceRun};
use tinygpt_cpu::kv_cache::{KeyRope, KvConfig, KvRotation, PositionsMode, Precision};
use tinygpt_cpu::model::{reference_model, Model, WeightsDType};
use tinygpt_cpu::weights::ModelFiles;

/// Whether the engine's KIVI kernels add in the reference's order (`portable`,
/// `avx512-exact`: docs/design.md §2.3): then ids and logits must be identical, bit for bit.
/// The engine runs the kernels this test's `TINYGPT_KV_KERNEL` names, else the fast ones
/// (`common::kv_kernel_opts`).
fn exact_kernels() -> bool {
    kv_kernel_opts().kv_kernel.resolve().is_exact()
}

fn load(files: &ModelFiles) -> Model {
    Model::load_opts(files, WeightsDType::Native, &kv_kernel_opts()).unwrap()
}

/// Engine vs reference logits with the same cache under kernels that add in other orders
/// (`avx512`, `avx2`, `neon`). Only summation order differs, but a last-bit difference in a K/V
/// value can flip one quantisation code (a whole step of the affine grid), so the budget
/// grows with the step size of the precision.
fn engine_vs_reference(p: Precision) -> f32 {
    match p {
        Precision::Fp32 => 1e-4,
        // a last-bit difference can round to a neighbouring fp16/bf16 value
        Precision::Fp16 => 5e-3,
        Precision::Bf16 => 2e-2,
        Precision::Int8 => 5e-2,
        Precision::Int4 => 0.25,
        // one flipped code is a third of the channel's range
        Precision::Int2 => 1.0,
    }
}
/// The budget of the coarser side (int2 V dominates K8V4's int8 K, and so on).
fn budget(kv: &KvConfig) -> f32 {
    engine_vs_reference(kv.key_precision()).max(engine_vs_reference(kv.value_precision()))
}
const STEPS: usize = 300;
/// An int4 greedy flip is accepted only where the fp32 top-2 margin is below this.
const INT4_FLIP_MARGIN: f32 = 0.25;
const SINK: usize = 4;
const WINDOW: usize = 60;

fn combos() -> Vec<KvConfig> {
    let mut v = Vec::new();
    for precision in Precision::ALL {
        for streaming in [false, true] {
            for positions in [PositionsMode::Original, PositionsMode::Cache] {
                v.push(KvConfig {
                    precision,
                    group_size: 32,
                    sink: if streaming { SINK } else { 0 },
                    window: streaming.then_some(WINDOW),
                    positions,
                    ..KvConfig::default()
                });
            }
        }
    }
    // KIVI as published and past it: residual, asymmetric K/V bits, pre-RoPE keys.
    for streaming in [false, true] {
        for (precision, v_precision, residual, key_rope) in [
            (Precision::Int2, None, 32, KeyRope::Post),
            (Precision::Int8, Some(Precision::Int4), 0, KeyRope::Post),
            (Precision::Int4, Some(Precision::Int2), 16, KeyRope::Pre),
            (Precision::Int4, None, 0, KeyRope::Pre),
        ] {
            v.push(KvConfig {
                precision,
                v_precision,
                residual,
                key_rope,
                group_size: 32,
                sink: if streaming { SINK } else { 0 },
                window: streaming.then_some(WINDOW),
                ..KvConfig::default()
            });
        }
    }
    // Hadamard-rotated K/V (head_dim 32): post- and pre-RoPE keys, both positions modes,
    // a residual, asymmetric bits, and an fp32 cache (where rotation changes rounding only).
    for streaming in [false, true] {
        for (precision, v_precision, residual, key_rope, positions) in [
            (
                Precision::Fp32,
                None,
                0,
                KeyRope::Post,
                PositionsMode::Original,
            ),
            (
                Precision::Int8,
                None,
                0,
                KeyRope::Post,
                PositionsMode::Original,
            ),
            (
                Precision::Int4,
                None,
                0,
                KeyRope::Post,
                PositionsMode::Original,
            ),
            (
                Precision::Int4,
                None,
                0,
                KeyRope::Pre,
                PositionsMode::Original,
            ),
            (
                Precision::Int4,
                None,
                0,
                KeyRope::Post,
                PositionsMode::Cache,
            ),
            (
                Precision::Int2,
                None,
                32,
                KeyRope::Post,
                PositionsMode::Original,
            ),
            (
                Precision::Int8,
                Some(Precision::Int4),
                0,
                KeyRope::Post,
                PositionsMode::Original,
            ),
        ] {
            v.push(KvConfig {
                precision,
                v_precision,
                residual,
                key_rope,
                positions,
                rotation: KvRotation::Hadamard,
                group_size: 32,
                sink: if streaming { SINK } else { 0 },
                window: streaming.then_some(WINDOW),
                ..KvConfig::default()
            });
        }
    }
    v
}

fn files() -> ModelFiles {
    ModelFiles::open(None).unwrap()
}

fn prompts() -> Vec<(String, Vec<u32>)> {
    golden("tiny.json")["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["prompt"].as_str().unwrap().to_string(),
                ids(&p["prompt_ids"]),
            )
        })
        .collect()
}

#[test]
fn engine_and_reference_agree_for_every_cache_combination() {
    let files = files();
    let model = load(&files);
    let reference = reference_model(&files, WeightsDType::Native).unwrap();
    let combos = combos();
    let prompts = prompts();
    let worst = std::sync::Mutex::new(std::collections::BTreeMap::new());
    // The combinations are independent: two at a time, each checked exactly as alone.
    on_two_workers(&combos, |kv| {
        for (prompt, ids) in &prompts {
            let d = check_combination(&model, &reference, kv, prompt, ids);
            let mut w = worst.lock().unwrap();
            let w = w.entry(kv.quant_name()).or_insert(0.0f32);
            *w = w.max(d);
        }
    });
    eprintln!(
        "worst engine-vs-reference logit difference per precision: {:?}",
        worst.into_inner().unwrap()
    );
}

/// One cache combination and prompt, engine against reference: identical ids and logit
/// bits under exact kernels, otherwise logits within the budget and a greedy flip only at
/// a near-tie. Returns the largest logit difference before any flip.
fn check_combination(
    model: &Model,
    reference: &tinygpt_reference::Model,
    kv: &KvConfig,
    prompt: &str,
    ids: &[u32],
) -> f32 {
    let mut e = EngineRun::new(model, kv);
    let mut r = ReferenceRun::new(reference, kv);
    let ge = greedy(&mut e, ids, STEPS);
    let gr = greedy(&mut r, ids, STEPS);
    let m = prefix_match(&ge.ids, &gr.ids);
    if exact_kernels() {
        // The engine adds in the reference's order: identical ids and logit bits.
        assert_eq!(
            ge.ids, gr.ids,
            "{kv:?} prompt {prompt:?}: greedy ids differ"
        );
        for (i, (a, b)) in ge.logits.iter().zip(&gr.logits).enumerate() {
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(a),
                bits(b),
                "{kv:?} prompt {prompt:?} step {i}: logits differ"
            );
        }
    }
    if m < STEPS {
        let margin = common::margin(&gr.logits[m]);
        // a flip is explained only by a near-tie within the logit budget
        assert!(
            margin < budget(kv),
            "{kv:?} prompt {prompt:?}: engine and reference diverge at step {m} (reference margin {margin})"
        );
    }
    let mut worst = 0.0f32;
    for i in 0..m {
        let d = max_abs_diff(&ge.logits[i], &gr.logits[i]);
        worst = worst.max(d);
        assert!(
            d <= budget(kv),
            "{kv:?} prompt {prompt:?} step {i}: logits differ by {d}"
        );
    }
    assert_eq!(
        e.positions(0),
        r.positions(0),
        "{kv:?}: stored positions differ"
    );
    assert_eq!(e.kv_bytes(), r.kv_bytes(), "{kv:?}: byte counts differ");
    worst
}

#[test]
fn streaming_cache_stops_growing() {
    let files = files();
    let model = load(&files);
    for kv in combos().into_iter().filter(|k| k.window.is_some()) {
        let mut e = EngineRun::new(&model, &kv);
        let cap = SINK + WINDOW;
        let mut bytes_after_cap = Vec::new();
        let mut tok = 0u32;
        for pos in 0..cap + 3 * 32 + 5 {
            let logits = e.forward(tok, pos).unwrap();
            assert!(logits.iter().all(|x| x.is_finite()), "{kv:?} pos {pos}");
            tok = argmax(logits);
            let stored = e.stored_tokens();
            assert_eq!(stored, (pos + 1).min(cap), "{kv:?} pos {pos}");
            if pos + 1 >= cap {
                bytes_after_cap.push(e.kv_bytes());
                let want: Vec<usize> = (0..SINK).chain(pos + 1 - WINDOW..pos + 1).collect();
                assert_eq!(e.positions(0), want, "{kv:?} pos {pos}");
            }
        }
        // Bounded: after the cap, bytes only cycle with the K group (KIVI) or stay constant.
        let first_cycle_max = *bytes_after_cap[..33].iter().max().unwrap();
        assert!(
            bytes_after_cap.iter().all(|&b| b <= first_cycle_max),
            "{kv:?}: {bytes_after_cap:?}"
        );
        if matches!(
            kv.precision,
            Precision::Fp32 | Precision::Fp16 | Precision::Bf16
        ) {
            assert!(
                bytes_after_cap.windows(2).all(|w| w[0] == w[1]),
                "{kv:?}: {bytes_after_cap:?}"
            );
        }
    }
}

#[test]
fn kivi_greedy_quality_against_fp32() {
    let files = files();
    let model = load(&files);
    let g = golden("tiny.json");
    let n = 150;
    let mut int4_matches = Vec::new();
    let (mut near_ties, mut steps) = (0usize, 0usize);
    for p in g["prompts"].as_array().unwrap() {
        let ids = ids(&p["prompt_ids"]);
        let run = |precision| {
            let kv = KvConfig {
                precision,
                ..KvConfig::default()
            };
            let mut e = EngineRun::new(&model, &kv);
            greedy(&mut e, &ids, n)
        };
        let base = run(Precision::Fp32);
        near_ties += base
            .logits
            .iter()
            .filter(|l| common::margin(l) < INT4_FLIP_MARGIN)
            .count();
        steps += base.logits.len();
        let int8 = run(Precision::Int8);
        let m = prefix_match(&int8.ids, &base.ids);
        if m < n {
            let margin = common::margin(&base.logits[m]);
            assert!(
                margin < 0.05,
                "prompt {:?}: int8 diverges from fp32 at step {m} where the fp32 margin is {margin}",
                p["prompt"]
            );
            eprintln!(
                "int8 diverged at a near-tie: prompt {:?} step {m} margin {margin}",
                p["prompt"]
            );
        }
        let int4 = run(Precision::Int4);
        let m4 = prefix_match(&int4.ids, &base.ids);
        if m4 < n {
            let margin = common::margin(&base.logits[m4]);
            eprintln!(
                "int4 diverges for {:?} at step {m4}: fp32 margin {margin}",
                p["prompt"]
            );
            // int4 noise may flip close calls, never a confident choice.
            assert!(
                margin < INT4_FLIP_MARGIN,
                "prompt {:?}: int4 diverges from fp32 at step {m4} where the fp32 margin is {margin}",
                p["prompt"]
            );
        }
        int4_matches.push(m4 as f64 / n as f64);
    }
    let mean = int4_matches.iter().sum::<f64>() / int4_matches.len() as f64;
    eprintln!("int4 prefix match per prompt: {int4_matches:?}, mean {mean:.3}");
    eprintln!(
        "fp32 steps with a top-2 margin below {INT4_FLIP_MARGIN}: {near_ties} of {steps} ({:.1}%)",
        100.0 * near_ties as f64 / steps as f64
    );
    // Issue 13's target is a mean prefix match >= 0.80 over 150 tokens. At R = 0 the bundled
    // model reaches ~0.32: a fifth of its fp32 steps are near-ties (top-2 margin < 0.25,
    // printed above), a greedy prefix ends at the first flipped near-tie, and the assert
    // above checks that every int4 divergence is such a near-tie. Perplexity is the real
    // quality measure (below); the shortfall is reported in the README rather than hidden
    // by a lower bar.
    let text = std::fs::read_to_string(fixtures().join("heldout.txt")).unwrap();
    let mut tokens = files.tokenizer().unwrap().encode(&text).unwrap();
    tokens.truncate(1024);
    let ppl = |precision| {
        let kv = KvConfig {
            precision,
            sink: 4,
            window: Some(252),
            ..KvConfig::default()
        };
        let mut e = EngineRun::new(&model, &kv);
        tinygpt_cpu::eval::perplexity(&mut e, &tokens, 1024, false, &mut |_| {})
            .unwrap()
            .0
            .ppl
    };
    let (p32, p8, p4) = (
        ppl(Precision::Fp32),
        ppl(Precision::Int8),
        ppl(Precision::Int4),
    );
    eprintln!(
        "perplexity over 1024 tokens, sink 4 + window 252: fp32 {p32:.4} int8 {p8:.4} int4 {p4:.4}"
    );
    assert!(
        (p8 / p32 - 1.0).abs() < 0.005,
        "int8 perplexity {p8} vs fp32 {p32}"
    );
    assert!(
        (p4 / p32 - 1.0).abs() < 0.03,
        "int4 perplexity {p4} vs fp32 {p32}"
    );
}
