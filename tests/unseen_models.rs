//! Llama-family models the engine was not developed against (fixtures/make_unseen_models.py):
//! Llama 3 RoPE scaling + untied head + head_dim ≠ hidden/heads + one KV head in bf16,
//! Mistral sliding window in f16, Qwen2 biases, linear RoPE scaling with sharded weights.
//! Run as a new user would: the CLI's greedy ids must be transformers' greedy ids.

mod common;
use common::*;
use tinygpt_cpu::generate::{Engine, EngineRun, ReferenceRun};
use tinygpt_cpu::kv_cache::KvConfig;
use tinygpt_cpu::model::{reference_model, Model, WeightsDType};
use tinygpt_cpu::weights::ModelFiles;

/// Greedy ids may differ only at a step where transformers' own top-2 margin is tiny.
fn check_ids(name: &str, got: &[u32], want: &[u32], margins: &[f32], tol: f32) {
    let m = prefix_match(got, want);
    if m < want.len() {
        assert!(
            margins[m] < tol,
            "{name}: greedy ids diverge at step {m} (transformers margin {}): got {:?} want {:?}",
            margins[m],
            &got[m..],
            &want[m..]
        );
    }
}

#[test]
fn cli_greedy_matches_transformers_on_unseen_models() {
    let g = golden("unseen.json");
    for (name, entries) in g["models"].as_object().unwrap() {
        let dir = fixtures().join("unseen").join(name);
        for e in entries.as_array().unwrap() {
            let want = ids(&e["greedy_ids"]);
            let out = common::cli()
                .args([
                    "sample",
                    dir.to_str().unwrap(),
                    "--prompt",
                    e["prompt"].as_str().unwrap(),
                ])
                .args([
                    "--temperature",
                    "0",
                    "--tokens",
                    &want.len().to_string(),
                    "--ignore-eos",
                    "--json",
                ])
                .output()
                .unwrap();
            assert!(
                out.status.success(),
                "{name}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            assert_eq!(
                ids(&v["prompt_ids"]),
                ids(&e["prompt_ids"]),
                "{name}: prompt ids"
            );
            check_ids(
                name,
                &ids(&v["generated_ids"]),
                &want,
                &floats(&e["margins"]),
                1e-4,
            );
        }
    }
}

#[test]
fn both_engines_match_transformers_logits_on_unseen_models() {
    let g = golden("unseen.json");
    for (name, entries) in g["models"].as_object().unwrap() {
        let files = ModelFiles::open(Some(&fixtures().join("unseen").join(name))).unwrap();
        let model = Model::load(&files, WeightsDType::Native).unwrap();
        let reference = reference_model(&files, WeightsDType::Native).unwrap();
        for e in entries.as_array().unwrap() {
            let prompt = ids(&e["prompt_ids"]);
            let want = floats(&e["last_logits"]);
            let mut runs: Vec<(&str, Box<dyn Engine>)> = vec![
                (
                    "engine",
                    Box::new(EngineRun::new(&model, &KvConfig::default())),
                ),
                (
                    "reference",
                    Box::new(ReferenceRun::new(&reference, &KvConfig::default())),
                ),
            ];
            for (which, run) in runs.iter_mut() {
                let gr = greedy(run.as_mut(), &prompt, 60);
                let err = max_abs_diff(&gr.logits[0], &want);
                assert!(err < 1e-3, "{name} {which}: last logits off by {err}");
                check_ids(
                    name,
                    &gr.ids,
                    &ids(&e["greedy_ids"]),
                    &floats(&e["margins"]),
                    1e-4,
                );
            }
        }
    }
}
