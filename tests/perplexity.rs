//! Perplexity through the cached decode path: against transformers, against a cache-free
//! full-sequence forward, and against the fixture script's PyTorch StreamingLLM.

mod common;
use common::*;
use tinygpt_cpu::eval::{nll_of, perplexity};
use tinygpt_cpu::generate::{EngineRun, ReferenceRun};
use tinygpt_cpu::kv_cache::KvConfig;
use tinygpt_cpu::model::{reference_model, Model, WeightsDType};
use tinygpt_cpu::weights::ModelFiles;

fn heldout_tokens(files: &ModelFiles, n: usize) -> Vec<u32> {
    let text = std::fs::read_to_string(fixtures().join("heldout.txt")).unwrap();
    let mut t = files.tokenizer().unwrap().encode(&text).unwrap();
    t.truncate(n);
    t
}

#[test]
fn dense_fp32_perplexity_matches_transformers() {
    let g = golden("tiny_ppl.json");
    let files = ModelFiles::open(Some(&fixtures().join("tiny"))).unwrap();
    let n = g["tokens"].as_u64().unwrap() as usize;
    let tokens = heldout_tokens(&files, n);
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    let mut run = EngineRun::new(&model, &KvConfig::default());
    let (r, _) = perplexity(&mut run, &tokens, 1024, false, &mut |_| {}).unwrap();
    let want = g["ppl"].as_f64().unwrap();
    let rel = (r.ppl / want - 1.0).abs();
    assert!(
        rel < 1e-3,
        "ppl {} vs transformers {want} ({:.4}%)",
        r.ppl,
        rel * 100.0
    );
    let lp = floats(&g["per_token_logprobs"]);
    for (i, (a, b)) in r.nll.iter().zip(&lp).enumerate() {
        assert!(
            (a + *b as f64).abs() < 1e-3,
            "token {}: nll {a} vs {}",
            i + 1,
            -b
        );
    }
}

#[test]
fn cached_path_equals_cache_free_full_sequence_forward() {
    let files = ModelFiles::open(Some(&fixtures().join("tiny"))).unwrap();
    let tokens = heldout_tokens(&files, 120);
    let reference = reference_model(&files, WeightsDType::Native).unwrap();
    let full = reference.forward_sequence(&tokens);
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    for (name, r) in [
        ("engine", {
            let mut e = EngineRun::new(&model, &KvConfig::default());
            perplexity(&mut e, &tokens, 1024, false, &mut |_| {})
                .unwrap()
                .0
        }),
        ("reference", {
            let mut e = ReferenceRun::new(&reference, &KvConfig::default());
            perplexity(&mut e, &tokens, 1024, false, &mut |_| {})
                .unwrap()
                .0
        }),
    ] {
        for i in 0..tokens.len() - 1 {
            let want = nll_of(&full[i], tokens[i + 1]);
            assert!(
                (r.nll[i] - want).abs() < 1e-4,
                "{name} token {}: {} vs {want}",
                i + 1,
                r.nll[i]
            );
        }
    }
}

#[test]
fn streaming_perplexity_matches_the_pytorch_eviction() {
    let g = golden("tiny_ppl.json");
    let files = ModelFiles::open(Some(&fixtures().join("tiny"))).unwrap();
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    for s in g["streaming"].as_array().unwrap() {
        let n = s["tokens"].as_u64().unwrap() as usize;
        let tokens = heldout_tokens(&files, n);
        let kv = if s["policy"] == "dense" {
            KvConfig::default()
        } else {
            KvConfig {
                sink: s["sink"].as_u64().unwrap() as usize,
                window: Some(s["window"].as_u64().unwrap() as usize),
                ..KvConfig::default()
            }
        };
        let mut run = EngineRun::new(&model, &kv);
        let (r, _) = perplexity(&mut run, &tokens, 256, false, &mut |_| {}).unwrap();
        let want = s["ppl"].as_f64().unwrap();
        let rel = (r.ppl / want - 1.0).abs();
        assert!(rel < 5e-3, "{kv:?}: ppl {} vs PyTorch {want}", r.ppl);
    }
}

fn cli(args: &[&str]) -> std::process::Output {
    common::cli().args(args).output().unwrap()
}

#[test]
fn cli_json_and_compare_modes() {
    let heldout = fixtures().join("heldout.txt");
    let out = cli(&[
        "perplexity",
        "--text",
        heldout.to_str().unwrap(),
        "--max-tokens",
        "200",
        "--chunk",
        "64",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["tokens"], 200);
    let chunks = v["chunks"].as_array().unwrap();
    assert_eq!(chunks.len(), 4, "{v}");
    assert_eq!(chunks[0]["start"], 1);
    assert_eq!(chunks[3]["end"], 200);
    let ppl = v["ppl"].as_f64().unwrap();
    assert!((v["nll_mean"].as_f64().unwrap().exp() - ppl).abs() < 1e-6 * ppl);

    let dir = tempfile::tempdir().unwrap();
    let plot = dir.path().join("nll.svg");
    let out = cli(&[
        "perplexity",
        "--text",
        heldout.to_str().unwrap(),
        "--max-tokens",
        "300",
        "--chunk",
        "100",
        "--compare-modes",
        "dense;sink=0,window=64;sink=4,window=60,kv=int8",
        "--allow-past-context",
        "--sink-report",
        "--plot",
        plot.to_str().unwrap(),
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let modes = v["modes"].as_array().unwrap();
    assert_eq!(modes.len(), 3);
    assert_eq!(modes[0]["ppl"], v["ppl"]);
    assert!(modes.iter().all(|m| m["ppl"].as_f64().unwrap().is_finite()));
    assert_ne!(modes[0]["ppl"], modes[1]["ppl"], "eviction changed nothing");
    let sinks = &v["sink_report"];
    assert_eq!(sinks["per_layer"].as_array().unwrap().len(), 6);
    let total: f64 = sinks["overall"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .sum();
    assert!(
        total > 0.0 && total <= 1.0 + 1e-6,
        "mass on 8 positions = {total}"
    );
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(
        svg.contains("<svg") && (svg.contains("polyline") || svg.contains("path")),
        "not a chart"
    );
}

#[test]
fn bad_texts_give_clear_errors() {
    let d = tempfile::tempdir().unwrap();
    let empty = d.path().join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    let one = d.path().join("one.txt");
    std::fs::write(&one, "a").unwrap();
    let bin = d.path().join("bin.dat");
    std::fs::write(&bin, [0u8, 159, 146, 150, 0, 1, 2]).unwrap();
    for (path, needle) in [
        (empty.to_str().unwrap().to_string(), "empty"),
        (bin.to_str().unwrap().to_string(), "binary"),
        ("/nonexistent/text.txt".to_string(), "/nonexistent/text.txt"),
    ] {
        let out = cli(&["perplexity", "--text", &path]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle) && err.contains(&path), "{err}");
        assert!(!err.contains("panicked"));
    }
    // "a" encodes to BOS + one token = 2 tokens: that is the minimum that works
    let out = cli(&[
        "perplexity",
        "--text",
        one.to_str().unwrap(),
        "--max-tokens",
        "1",
    ]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("at least 2"));
}
