//! The bundled tiny model against transformers (golden fixtures written by
//! fixtures/make_fixtures.py), and the engine against the scalar reference.

mod common;
use common::*;
use tinygpt_cpu::generate::{EngineRun, ReferenceRun};
use tinygpt_cpu::kv_cache::KvConfig;
use tinygpt_cpu::model::{reference_model, Model, WeightsDType};
use tinygpt_cpu::weights::ModelFiles;

/// Reference vs transformers logits (f32 both sides; different summation order).
const LOGITS_VS_TORCH: f32 = 1e-3;
/// Engine vs reference logits (SIMD lane sums vs sequential sums).
const ENGINE_VS_REFERENCE: f32 = 1e-4;

fn hf_dir() -> ModelFiles {
    ModelFiles::open(Some(&fixtures().join("tiny"))).unwrap()
}

fn check_against_golden(e: &mut dyn tinygpt_cpu::generate::Engine, name: &str) {
    let g = golden("tiny.json");
    let prompts = g["prompts"].as_array().unwrap();
    assert!(prompts.len() >= 4);
    for p in prompts {
        let prompt = p["prompt"].as_str().unwrap();
        let prompt_ids = ids(&p["prompt_ids"]);
        let want = ids(&p["greedy_ids"]);
        let margins = floats(&p["margins"]);
        // fresh cache per prompt
        e.reset();
        let got = greedy(e, &prompt_ids, want.len());
        let last = floats(&p["last_logits"]);
        let err = max_abs_diff(&got.logits[0], &last);
        assert!(
            err <= LOGITS_VS_TORCH,
            "{name}: prompt {prompt:?}: last-position logits differ from transformers by {err}"
        );
        let m = prefix_match(&got.ids, &want);
        if m < want.len() {
            // A divergence is only acceptable at a genuine near-tie of transformers' logits.
            assert!(
                margins[m] < 1e-4,
                "{name}: prompt {prompt:?}: greedy ids diverge at step {m} (margin {}): got {:?} want {:?}",
                margins[m],
                &got.ids[m..],
                &want[m..]
            );
        }
    }
}

#[test]
fn reference_matches_transformers() {
    let files = hf_dir();
    let model = reference_model(&files, WeightsDType::Native).unwrap();
    let mut run = ReferenceRun::new(&model, &KvConfig::default());
    check_against_golden(&mut run, "reference");
}

#[test]
fn engine_matches_transformers() {
    let files = hf_dir();
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    let mut run = EngineRun::new(&model, &KvConfig::default());
    check_against_golden(&mut run, "engine");
}

#[test]
fn long_prompt_prefill_logits_match_transformers() {
    let g = golden("tiny.json");
    let prompt_ids = ids(&g["long_prompt_ids"]);
    let want = g["long_prompt_logits"].as_object().unwrap();
    let files = hf_dir();
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    let mut run = EngineRun::new(&model, &KvConfig::default());
    use tinygpt_cpu::generate::Engine;
    for (pos, &t) in prompt_ids.iter().enumerate() {
        let logits = run.forward(t, pos).unwrap().to_vec();
        if let Some(w) = want.get(&pos.to_string()) {
            let err = max_abs_diff(&logits, &floats(w));
            assert!(
                err <= LOGITS_VS_TORCH,
                "position {pos}: logits differ by {err}"
            );
        }
    }
}

#[test]
fn engine_matches_reference_per_step() {
    let files = hf_dir();
    let g = golden("tiny.json");
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    let reference = reference_model(&files, WeightsDType::Native).unwrap();
    for p in g["prompts"].as_array().unwrap() {
        let prompt_ids = ids(&p["prompt_ids"]);
        let mut e = EngineRun::new(&model, &KvConfig::default());
        let mut r = ReferenceRun::new(&reference, &KvConfig::default());
        let ge = greedy(&mut e, &prompt_ids, 60);
        let gr = greedy(&mut r, &prompt_ids, 60);
        assert_eq!(ge.ids, gr.ids, "prompt {:?}", p["prompt"]);
        for (i, (a, b)) in ge.logits.iter().zip(&gr.logits).enumerate() {
            let err = max_abs_diff(a, b);
            assert!(
                err <= ENGINE_VS_REFERENCE,
                "step {i}: engine vs reference logits differ by {err}"
            );
        }
    }
}

#[test]
fn hf_dir_and_tinygpt_give_identical_logits() {
    let a = hf_dir();
    let b = ModelFiles::open(Some(&fixtures().join("tiny.tinygpt"))).unwrap();
    let bundled = ModelFiles::open(None).unwrap();
    assert_eq!(a.config, b.config);
    assert_eq!(a.config, bundled.config);
    let g = golden("tiny.json");
    let prompt_ids = ids(&g["prompts"][0]["prompt_ids"]);
    let run = |f: &ModelFiles| {
        let m = Model::load(f, WeightsDType::Native).unwrap();
        let mut e = EngineRun::new(&m, &KvConfig::default());
        greedy(&mut e, &prompt_ids, 30)
    };
    let (ga, gb, gc) = (run(&a), run(&b), run(&bundled));
    assert_eq!(ga.ids, gb.ids);
    assert_eq!(ga.logits, gb.logits, "bit-identical logits expected");
    assert_eq!(
        ga.logits, gc.logits,
        "bundled model differs from fixtures/tiny.tinygpt"
    );
    // the tokenizer is the same too
    let text = "In Python, a list is a mutable sequence.";
    assert_eq!(
        a.tokenizer().unwrap().encode(text).unwrap(),
        b.tokenizer().unwrap().encode(text).unwrap()
    );
}

#[test]
fn batched_prefill_is_bit_identical_to_token_by_token() {
    use tinygpt_cpu::generate::Engine;
    let g = golden("tiny.json");
    let prompt = ids(&g["long_prompt_ids"]);
    let files = hf_dir();
    for w in [WeightsDType::Native, WeightsDType::Bf16] {
        let model = Model::load(&files, w).unwrap();
        for kv in [
            KvConfig::default(),
            KvConfig {
                sink: 4,
                window: Some(60),
                ..KvConfig::default()
            },
        ] {
            let mut a = EngineRun::new(&model, &kv);
            let mut b = EngineRun::new(&model, &kv);
            let batched = a.prefill(&prompt, 0).unwrap().to_vec();
            let mut stepped = Vec::new();
            for (i, &t) in prompt.iter().enumerate() {
                stepped = b.forward(t, i).unwrap().to_vec();
            }
            assert_eq!(batched, stepped, "{w:?} {kv:?}");
            assert_eq!(a.positions(0), b.positions(0));
            // and the caches continue identically
            let n = prompt.len();
            assert_eq!(a.forward(5, n).unwrap(), b.forward(5, n).unwrap());
        }
    }
}
