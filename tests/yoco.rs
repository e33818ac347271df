//! YOCO cross-layer KV sharing and per-layer attention types (issue 12).
//!
//! * config validation of `num_kv_shared_layers`, `layer_types`, `sliding_window`;
//! * the fixture `fixtures/yoco/` (S = 3 of 6 layers, sliding layers 0, 1, 3 with window 64)
//!   against the goldens of its own PyTorch forward (`fixtures/make_yoco_fixture.py`), for
//!   both engines and for batched prefill;
//! * engine == reference for every precision × streaming × positions combination, on the
//!   fixture and on the bundled model turned into a plain YOCO model (no layer types);
//! * batched prefill == token by token, bit for bit, with shared layers;
//! * a sliding layer's bounded cache == Mistral's `sliding_window` mask;
//! * what the CLI reports (`sample --json` `kv.layers_with_kv`/`kv.bytes`, `cache-table`,
//!   `inspect`, the sink report).

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use tinygpt_cpu::config::{AttentionType, HfConfig};
use tinygpt_cpu::generate::{Engine, EngineRun, ReferenceRun};
use tinygpt_cpu::kv_cache::{KvConfig, PositionsMode, Precision};
use tinygpt_cpu::model::{reference_model, Model, WeightsDType};
use tinygpt_cpu::weights::ModelFiles;

const W: usize = 64;
const SINK: usize = 4;
const WINDOW: usize = 60;
const STEPS: usize = 200;

fn yoco_dir() -> PathBuf {
    fixtures().join("yoco")
}

fn yoco_files() -> ModelFiles {
    ModelFiles::open(Some(&yoco_dir())).unwrap()
}

fn yoco_golden() -> serde_json::Value {
    let p = yoco_dir().join("golden.json");
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

/// The bundled model with its upper half sharing layer 2's K/V (k_proj/v_proj of layers
/// 3..5 are present in the file and ignored).
fn bundled_shared() -> ModelFiles {
    let mut f = ModelFiles::open(None).unwrap();
    f.config.num_kv_shared_layers = 3;
    f
}

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
    v
}

/// Same budgets as tests/kv_model.rs: only the summation order differs between the engines,
/// but a last-bit difference can move a value to a neighbouring code of the cache format.
fn engine_vs_reference(p: Precision) -> f32 {
    match p {
        Precision::Fp32 => 1e-4,
        Precision::Fp16 => 5e-3,
        Precision::Bf16 => 2e-2,
        Precision::Int8 => 5e-2,
        Precision::Int4 => 0.25,
        Precision::Int2 => 1.0,
    }
}

fn parse(json: &str) -> Result<tinygpt_cpu::config::Config, String> {
    let p = Path::new("config.json");
    HfConfig::from_json(json, p)
        .and_then(|h| h.validate(p))
        .map_err(|e| e.to_string())
}

fn base_json(extra: &str) -> String {
    format!(
        r#"{{"vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 4, "num_attention_heads": 2,
            "num_key_value_heads": 1, "intermediate_size": 32{extra}}}"#
    )
}

#[test]
fn config_keys_are_parsed_and_validated() {
    // Plain YOCO: the last S layers read layer L − S − 1.
    let c = parse(&base_json(r#", "num_kv_shared_layers": 2"#)).unwrap();
    assert_eq!(c.num_kv_shared_layers, 2);
    assert_eq!(c.layers_with_kv(), 2);
    let src: Vec<_> = (0..4).map(|l| c.kv_source(l)).collect();
    assert_eq!(src, [Some(0), Some(1), Some(1), Some(1)]);
    assert!(c.layer_types.is_empty());

    // Per-layer types: a shared layer reads the last non-shared layer of its own type, and
    // the Mistral mask is off (the window belongs to the sliding layers only).
    let c = parse(&base_json(
        r#", "num_kv_shared_layers": 2, "sliding_window": 8,
           "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]"#,
    ))
    .unwrap();
    assert_eq!(c.sliding_window, None);
    assert_eq!(c.attention_type(0), AttentionType::Sliding { window: 8 });
    assert_eq!(c.attention_type(1), AttentionType::Full);
    let src: Vec<_> = (0..4).map(|l| c.kv_source(l)).collect();
    assert_eq!(src, [Some(0), Some(1), Some(0), Some(1)]);
    let user = KvConfig {
        sink: 4,
        window: Some(100),
        precision: Precision::Int4,
        ..KvConfig::default()
    };
    let sliding = c.layer_kv_config(0, &user);
    assert_eq!((sliding.sink, sliding.window), (0, Some(8)));
    assert_eq!(sliding.precision, Precision::Int4);
    assert_eq!(c.layer_kv_config(1, &user), user);
    // A StreamingLLM budget below the model's window bounds the sliding layers too: they
    // keep the last sink + window rows (2 + 3 = 5 < 8), the full layers sink 2 + window 3.
    let small = KvConfig {
        sink: 2,
        window: Some(3),
        ..user.clone()
    };
    let sliding = c.layer_kv_config(0, &small);
    assert_eq!((sliding.sink, sliding.window), (0, Some(5)));
    assert_eq!(c.layer_kv_config(1, &small), small);

    // Mistral's sliding_window without layer_types keeps masking every layer.
    let c = parse(&base_json(r#", "sliding_window": 8"#)).unwrap();
    assert_eq!(c.sliding_window, Some(8));
    assert!(c.layer_types.is_empty());

    // S = 0 and null are the same as no key.
    for extra in [
        r#", "num_kv_shared_layers": 0"#,
        r#", "num_kv_shared_layers": null"#,
    ] {
        assert_eq!(parse(&base_json(extra)).unwrap().layers_with_kv(), 4);
    }

    let bad = [
        (r#", "num_kv_shared_layers": 4"#, "num_kv_shared_layers"),
        (r#", "num_kv_shared_layers": -1"#, "num_kv_shared_layers"),
        (r#", "num_kv_shared_layers": 1.5"#, "num_kv_shared_layers"),
        (r#", "num_kv_shared_layers": "2""#, "num_kv_shared_layers"),
        (
            r#", "num_kv_shared_layers": 18446744073709551615"#,
            "num_kv_shared_layers",
        ),
        (r#", "layer_types": ["full_attention"]"#, "layer_types"),
        (r#", "layer_types": "full_attention""#, "layer_types"),
        (
            r#", "layer_types": ["full_attention", "full_attention", "global", "full_attention"]"#,
            "layer_types[2]",
        ),
        (
            r#", "layer_types": ["sliding_attention", "full_attention", "full_attention", "full_attention"]"#,
            "sliding_window",
        ),
        (
            r#", "sliding_window": 0, "layer_types": ["sliding_attention", "full_attention", "full_attention", "full_attention"]"#,
            "sliding_window",
        ),
        (
            r#", "sliding_window": 8, "num_kv_shared_layers": 1,
               "layer_types": ["full_attention", "full_attention", "full_attention", "sliding_attention"]"#,
            "layer 3 shares K/V",
        ),
    ];
    for (extra, needle) in bad {
        let err = parse(&base_json(extra)).expect_err(extra);
        assert!(err.contains(needle), "{extra}: {err}");
        assert!(err.contains("config.json"), "{err}");
        assert!(!err.contains('\n'), "one line: {err}");
    }
}

#[test]
fn fixture_loads_without_shared_kv_projections() {
    let f = yoco_files();
    let c = &f.config;
    assert_eq!(
        (c.n_layers, c.num_kv_shared_layers, c.layers_with_kv()),
        (6, 3, 3)
    );
    let sliding = AttentionType::Sliding { window: W };
    let types: Vec<_> = (0..6).map(|l| c.attention_type(l)).collect();
    use AttentionType::Full;
    assert_eq!(types, [sliding, sliding, Full, sliding, Full, Full]);
    let src: Vec<_> = (0..6).map(|l| c.kv_source(l).unwrap()).collect();
    assert_eq!(src, [0, 1, 2, 1, 2, 2]);
    for l in 3..6 {
        let k = format!("model.layers.{l}.self_attn.k_proj.weight");
        assert!(
            !f.tensors.contains_key(&k),
            "{k} should not be in the fixture"
        );
    }
    // A model whose non-shared layer lacks k_proj is refused, naming the tensor.
    let mut broken = yoco_files();
    broken.config.num_kv_shared_layers = 2;
    let err = Model::load(&broken, WeightsDType::Native)
        .err()
        .expect("refused");
    assert!(
        err.to_string()
            .contains("model.layers.3.self_attn.k_proj.weight"),
        "{err}"
    );
}

/// Tolerance for logits against the PyTorch goldens (float32 both, different summation
/// order and a cached vs full-sequence forward): 1e-4 absolute on logits of magnitude ~10.
const GOLDEN_TOL: f32 = 1e-4;

#[test]
fn both_engines_reproduce_the_pytorch_goldens() {
    let files = yoco_files();
    let g = yoco_golden();
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    let reference = reference_model(&files, WeightsDType::Native).unwrap();
    let kv = KvConfig::default();
    let n = g["new_tokens"].as_u64().unwrap() as usize;
    for p in g["prompts"].as_array().unwrap() {
        let prompt = ids(&p["prompt_ids"]);
        let want = ids(&p["greedy_ids"]);
        let margins = floats(&p["margins"]);
        for (name, e) in [
            (
                "engine",
                &mut EngineRun::new(&model, &kv) as &mut dyn Engine,
            ),
            ("reference", &mut ReferenceRun::new(&reference, &kv)),
        ] {
            let got = greedy(e, &prompt, n);
            let m = prefix_match(&got.ids, &want);
            assert!(
                m == n || margins[m] < GOLDEN_TOL,
                "{name} {:?}: greedy ids diverge from PyTorch at step {m} (margin {})\n got  {:?}\n want {want:?}",
                p["prompt"],
                margins[m],
                got.ids
            );
        }
    }
    // Logits of a 200-token held-out prompt (sliding windows of 64 are full from 64 on),
    // token by token in both engines and through the engine's batched prefill.
    let long = ids(&g["long_prompt_ids"]);
    let mut e = EngineRun::new(&model, &kv);
    let mut r = ReferenceRun::new(&reference, &kv);
    let mut by_token = Vec::new();
    let mut worst = 0.0f32;
    for (pos, &t) in long.iter().enumerate() {
        let le = e.forward(t, pos).unwrap().to_vec();
        let lr = r.forward(t, pos).unwrap().to_vec();
        worst = worst.max(max_abs_diff(&le, &lr));
        by_token.push((le, lr));
    }
    let mut session = model.session(&kv);
    let mut batched = Vec::new();
    model
        .forward_batch(&mut session, &long, 0, Some(&mut batched))
        .unwrap();
    let vocab = model.cfg.vocab_size;
    let full = reference.forward_sequence(&long);
    for entry in g["long_prompt_logits"].as_array().unwrap() {
        let pos = entry["position"].as_u64().unwrap() as usize;
        let want = floats(&entry["logits"]);
        let (le, lr) = &by_token[pos];
        for (name, got) in [
            ("engine", &le[..]),
            ("reference", &lr[..]),
            ("engine batched", &batched[pos * vocab..(pos + 1) * vocab]),
            ("reference forward_sequence", &full[pos][..]),
        ] {
            let d = max_abs_diff(got, &want);
            assert!(d < GOLDEN_TOL, "{name} position {pos}: |Δlogit| {d}");
        }
    }
    eprintln!("engine vs reference over the long prompt: {worst:e}");
    // Perplexity through the cache == the golden's full-sequence perplexity.
    let text = std::fs::read_to_string(fixtures().join("heldout.txt")).unwrap();
    let mut tokens = files.tokenizer().unwrap().encode(&text).unwrap();
    tokens.truncate(g["ppl_tokens"].as_u64().unwrap() as usize);
    let mut e = EngineRun::new(&model, &kv);
    let (res, _) = tinygpt_cpu::eval::perplexity(&mut e, &tokens, 256, false, &mut |_| {}).unwrap();
    let want = g["ppl"].as_f64().unwrap();
    eprintln!(
        "ppl through the cache {} (PyTorch {want}), tokens {:?}",
        res.ppl,
        &tokens[..4]
    );
    assert!(
        (res.ppl / want - 1.0).abs() < 1e-4,
        "ppl {} vs PyTorch {want}",
        res.ppl
    );
}

/// Engine and reference on one model, one cache configuration: identical greedy ids (or
/// a divergence explained by a near-tie), logits within the budget, identical stored
/// positions in every layer (shared layers through their source), identical bytes.
fn differential(
    model: &Model,
    reference: &tinygpt_reference::Model,
    kv: &KvConfig,
    prompt: &[u32],
) {
    let mut e = EngineRun::new(model, kv);
    let mut r = ReferenceRun::new(reference, kv);
    let ge = greedy(&mut e, prompt, STEPS);
    let gr = greedy(&mut r, prompt, STEPS);
    let m = prefix_match(&ge.ids, &gr.ids);
    let budget = engine_vs_reference(kv.precision);
    if m < STEPS {
        let margin = margin(&gr.logits[m]);
        assert!(
            margin < budget,
            "{kv:?}: engine and reference diverge at step {m} (reference margin {margin})"
        );
    }
    for i in 0..m {
        let d = max_abs_diff(&ge.logits[i], &gr.logits[i]);
        assert!(d <= budget, "{kv:?} step {i}: logits differ by {d}");
    }
    for l in 0..model.cfg.n_layers {
        assert_eq!(
            e.positions(l),
            r.positions(l),
            "{kv:?}: layer {l} positions"
        );
    }
    assert_eq!(e.kv_bytes(), r.kv_bytes(), "{kv:?}: byte counts differ");
    assert_eq!(e.stored_tokens(), r.stored_tokens(), "{kv:?}");
    assert_eq!(e.layers_with_kv(), model.cfg.layers_with_kv());
}

#[test]
fn engine_equals_reference_on_the_fixture_for_every_cache_combination() {
    let files = yoco_files();
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    let reference = reference_model(&files, WeightsDType::Native).unwrap();
    let g = yoco_golden();
    let prompts: Vec<Vec<u32>> = g["prompts"].as_array().unwrap()[..2]
        .iter()
        .map(|p| ids(&p["prompt_ids"]))
        .collect();
    for kv in combos() {
        for prompt in &prompts {
            differential(&model, &reference, &kv, prompt);
        }
        // The sliding layers hold their window, the global one what the flags allow.
        let mut e = EngineRun::new(&model, &kv);
        greedy(&mut e, &prompts[0], STEPS);
        let len = prompts[0].len() + STEPS - 1;
        let global = kv.window.map_or(len, |w| (SINK + w).min(len));
        for (l, want) in [
            (0, W),
            (1, W),
            (2, global),
            (3, W),
            (4, global),
            (5, global),
        ] {
            assert_eq!(e.positions(l).len(), want, "{kv:?} layer {l}");
        }
        assert_eq!(e.stored_tokens(), global.max(W));
    }
}

#[test]
fn engine_equals_reference_for_plain_yoco_on_the_bundled_model() {
    let files = bundled_shared();
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    let reference = reference_model(&files, WeightsDType::Native).unwrap();
    let prompt = ids(&golden("tiny.json")["prompts"][0]["prompt_ids"]);
    for kv in combos() {
        differential(&model, &reference, &kv, &prompt);
    }
    // Sharing changes the model: the shared layers' own K/V are not used.
    let plain = ModelFiles::open(None).unwrap();
    let plain = Model::load(&plain, WeightsDType::Native).unwrap();
    let kv = KvConfig::default();
    let a = greedy(&mut EngineRun::new(&model, &kv), &prompt, 1);
    let b = greedy(&mut EngineRun::new(&plain, &kv), &prompt, 1);
    assert!(max_abs_diff(&a.logits[0], &b.logits[0]) > 1e-2);
}

#[test]
fn batched_prefill_equals_token_by_token_with_shared_layers() {
    let files = yoco_files();
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    let text = std::fs::read_to_string(fixtures().join("heldout.txt")).unwrap();
    let mut tokens = files.tokenizer().unwrap().encode(&text).unwrap();
    tokens.truncate(150);
    for kv in combos() {
        let mut one = model.session(&kv);
        let mut want = Vec::new();
        for (pos, &t) in tokens.iter().enumerate() {
            model.forward(&mut one, t, pos).unwrap();
            want.extend_from_slice(&one.logits);
        }
        // Uneven chunks: the shared layers replay appends onto a cache that already holds
        // rows (and, with a window, evicts during the chunk).
        let mut s = model.session(&kv);
        let mut got = Vec::new();
        let mut start = 0;
        for len in [37, 1, 64, 48] {
            let mut chunk_logits = Vec::new();
            model
                .forward_batch(
                    &mut s,
                    &tokens[start..start + len],
                    start,
                    Some(&mut chunk_logits),
                )
                .unwrap();
            got.extend_from_slice(&chunk_logits);
            start += len;
        }
        assert_eq!(start, tokens.len());
        assert!(
            got == want,
            "{kv:?}: batched prefill differs from token by token"
        );
        assert_eq!(s.cache.bytes(), one.cache.bytes(), "{kv:?}");
        for l in 0..s.cache.n_layers() {
            assert_eq!(
                s.cache.layer(l).positions(),
                one.cache.layer(l).positions(),
                "{kv:?} layer {l}"
            );
        }
    }
}

#[test]
fn sliding_layers_equal_the_mistral_mask() {
    // The bundled model read (a) with every layer "sliding_attention" (bounded caches of
    // W rows) and (b) as a Mistral model with sliding_window W (dense cache, keys with
    // pos − key_pos ≥ W masked): the same function, computed two ways.
    let w = 16;
    let mut sliding = ModelFiles::open(None).unwrap();
    sliding.config.layer_types = vec![AttentionType::Sliding { window: w }; 6];
    let mut masked = ModelFiles::open(None).unwrap();
    masked.config.sliding_window = Some(w);
    let prompt = ids(&golden("tiny.json")["prompts"][1]["prompt_ids"]);
    // Original positions only: in `cache` mode keys rotate by slot, and slots differ by
    // design between a window of W rows and a dense cache. Plain row precisions only: KIVI
    // groups are cut by token index within each cache, so they differ too.
    let wd = WeightsDType::Native;
    let (a, b) = (
        Model::load(&sliding, wd).unwrap(),
        Model::load(&masked, wd).unwrap(),
    );
    let ra = reference_model(&sliding, wd).unwrap();
    let rb = reference_model(&masked, wd).unwrap();
    for precision in [Precision::Fp32, Precision::Bf16] {
        let kv = KvConfig {
            precision,
            ..KvConfig::default()
        };
        let mut ea = EngineRun::new(&a, &kv);
        let ga = greedy(&mut ea, &prompt, 80);
        let gb = greedy(&mut EngineRun::new(&b, &kv), &prompt, 80);
        let gra = greedy(&mut ReferenceRun::new(&ra, &kv), &prompt, 80);
        let grb = greedy(&mut ReferenceRun::new(&rb, &kv), &prompt, 80);
        assert_eq!(ga.ids, gb.ids, "{precision:?}");
        assert_eq!(gra.ids, grb.ids, "{precision:?}");
        let mut worst = 0.0f32;
        for i in 0..80 {
            worst = worst.max(max_abs_diff(&ga.logits[i], &gb.logits[i]));
            worst = worst.max(max_abs_diff(&gra.logits[i], &grb.logits[i]));
        }
        eprintln!("{precision:?}: sliding cache vs Mistral mask: max |Δlogit| {worst:e}");
        // fp32: only the order of summing exp(−inf) = 0 terms differs. bf16: that last-bit
        // difference can round a later K/V value to a neighbouring bf16 (budget as above).
        let budget = match precision {
            Precision::Fp32 => 1e-5,
            p => engine_vs_reference(p),
        };
        assert!(worst < budget, "{precision:?}: {worst}");
        assert_eq!(ea.stored_tokens(), w);
    }
}

fn run(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tinygpt-cpu"))
        .args(args)
        .output()
        .expect("binary runs")
}

fn stdout_json(out: &std::process::Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn cli_reports_account_for_sharing() {
    let dir = yoco_dir();
    let dir = dir.to_str().unwrap();
    let kv_row = 2 * 64 * 4; // K + V, kv_dim 64, f32
                             // sample --json: 3 layers hold K/V; the sliding ones hold at most 64 rows.
    let out = run(&[
        "sample",
        dir,
        "--prompt",
        "Once upon a time",
        "--tokens",
        "100",
        "--temperature",
        "0",
        "--ignore-eos",
        "--json",
    ]);
    let v = stdout_json(&out);
    let len = v["kv"]["current_length"].as_u64().unwrap() as usize;
    assert_eq!(v["kv"]["layers_with_kv"], 3);
    assert_eq!(v["kv"]["stored_tokens"].as_u64().unwrap() as usize, len);
    assert_eq!(
        v["kv"]["bytes"].as_u64().unwrap() as usize,
        (2 * W.min(len) + len) * kv_row
    );
    // The bundled model: every layer holds K/V.
    let v = stdout_json(&run(&[
        "sample", "--prompt", "a", "--tokens", "3", "--json",
    ]));
    assert_eq!(v["kv"]["layers_with_kv"], 6);

    // cache-table counts only the layers that hold K/V, sliding ones at their window.
    let v = stdout_json(&run(&[
        "cache-table",
        dir,
        "--lengths",
        "100,2048",
        "--json",
    ]));
    let rows = v["rows"].as_array().unwrap();
    let bytes = |mode: &str, t: u64| {
        rows.iter()
            .find(|r| r["mode"] == mode && r["tokens"] == t)
            .unwrap()["bytes"]
            .as_u64()
            .unwrap() as usize
    };
    assert_eq!(bytes("fp32", 2048), (2 * W + 2048) * kv_row);
    assert_eq!(bytes("fp32", 100), (2 * W + 100) * kv_row);
    assert_eq!(
        bytes("fp32,sink=4,window=252", 2048),
        (2 * W + 256) * kv_row
    );

    // inspect shows the sharing and the layer types.
    let out = run(&["inspect", dir]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    assert!(
        text.contains("layer types: sliding(64), sliding(64), full, sliding(64), full, full"),
        "{text}"
    );
    assert!(
        text.contains("3 of 6 layers hold K/V; shared (layer<-source): 3<-1, 4<-2, 5<-2"),
        "{text}"
    );

    // convert carries the keys into .tinygpt metadata (and writes no k/v for shared layers).
    let out_path = std::env::temp_dir().join(format!("yoco-{}.tinygpt", std::process::id()));
    let out = run(&["convert", dir, out_path.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let converted = ModelFiles::open(Some(&out_path)).unwrap();
    assert_eq!(converted.config, yoco_files().config);
    std::fs::remove_file(&out_path).unwrap();

    // The sink report covers all 6 attention layers (shared ones over their source's rows).
    let heldout = fixtures().join("heldout.txt");
    let out = run(&[
        "perplexity",
        dir,
        "--text",
        heldout.to_str().unwrap(),
        "--max-tokens",
        "100",
        "--sink-report",
        "--json",
    ]);
    let v = stdout_json(&out);
    let per_layer = v["sink_report"]["per_layer"].as_array().unwrap();
    assert_eq!(per_layer.len(), 6);
    for (l, row) in per_layer.iter().enumerate() {
        let mass: f64 = row
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .sum();
        assert!(mass > 0.0 && mass <= 1.0 + 1e-9, "layer {l}: {mass}");
    }
}
