//! GGUF architectures beyond llama: tiny random Qwen2 (q/k/v biases, head_dim 32, MQA, tied
//! head) and Qwen3 (per-head q/k RMSNorm, head_dim ≠ hidden/heads: 64 with GQA and an untied
//! head, 256 with MQA and a tied head; F16 weights) and Gemma 3 (sandwich norms, GeGLU,
//! 5 sliding layers of window 8 with their own RoPE base and a global one, norm weights
//! stored as `w` in the Hugging Face directory and `1 + w` in the GGUF) made by
//! `fixtures/make_gguf_archs.py`, each as a Hugging Face directory and as a GGUF file written
//! with gguf-py under llama.cpp's names and keys. Goldens are transformers' (float32 on the
//! stored weights); the same script checked that llama.cpp decodes the same greedy ids from
//! the same GGUF files (recorded in `fixtures/golden/archs.json`, asserted below).
//!
//! Tolerance on logits: 1e-3 absolute. Both files hold the same values (the Qwen3 weights
//! were rounded to f16 before transformers ran), and every path computes in f32, so the
//! differences are summation-order rounding: measured at most 1e-5 on logits of magnitude
//! ~5; 1e-3 leaves room for other SIMD widths while a wrong norm, bias or rotation moves
//! logits by whole units.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use tinygpt_cpu::config::{AttentionType, HfConfig};
use tinygpt_cpu::generate::{Engine, EngineRun, ReferenceRun};
use tinygpt_cpu::gguf::GgufFile;
use tinygpt_cpu::kv_cache::KvConfig;
use tinygpt_cpu::model::{reference_model, Model, SeqStep, WeightsDType};
use tinygpt_cpu::tokenizer::Tokenizer;
use tinygpt_cpu::weights::ModelFiles;

const TOL: f32 = 1e-3;

/// Greedy ids may differ only at a step where transformers' own top-2 margin is tiny.
fn check_ids(what: &str, got: &[u32], want: &[u32], margins: &[f32]) {
    let m = prefix_match(got, want);
    if m < want.len() {
        assert!(
            margins[m] < 1e-4,
            "{what}: greedy ids diverge at step {m} (transformers margin {}): got {:?} want {:?}",
            margins[m],
            &got[m..],
            &want[m..]
        );
    }
}

/// (architecture, its golden entry) for every model of the golden file.
fn models() -> Vec<(String, serde_json::Value)> {
    let g = golden("archs.json");
    g["models"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// The Hugging Face directory and the GGUF file of a model.
fn paths(m: &serde_json::Value) -> [(&'static str, PathBuf); 2] {
    [
        ("hf", fixtures().join(m["hf_dir"].as_str().unwrap())),
        ("gguf", fixtures().join(m["gguf"].as_str().unwrap())),
    ]
}

/// Continuous batching: every prompt in one `forward_sequences` step, each in its own
/// session (each session then holds its prompt's last logits).
fn all_prompts_in_one_step(
    model: &Model,
    kv: &KvConfig,
    prompts: &[Vec<u32>],
) -> Vec<tinygpt_cpu::model::Session> {
    let mut sessions: Vec<_> = prompts.iter().map(|_| model.session(kv)).collect();
    let mut steps: Vec<SeqStep<'_>> = sessions
        .iter_mut()
        .zip(prompts)
        .map(|(session, tokens)| SeqStep {
            session,
            tokens,
            start: 0,
            all_logits: None,
        })
        .collect();
    model.forward_sequences(&mut steps).unwrap();
    drop(steps);
    sessions
}

#[test]
fn golden_file_records_llama_cpp_agreement() {
    // The generator ran llama.cpp on each GGUF: same tokenization, same greedy ids (as for
    // this engine, a difference is allowed only where transformers' own margin is tiny).
    for (name, m) in models() {
        let l = &m["llama_cpp"];
        assert_eq!(l["ran"], true, "{name}: llama.cpp cross-check not recorded");
        assert_eq!(l["tokenization_equal"], true, "{name}");
        for p in l["prompts"].as_array().unwrap() {
            assert_eq!(p["prompt_ids_equal"], true, "{name}");
            let tiny = p["margin_at_first_difference"]
                .as_f64()
                .is_some_and(|m| m < 1e-4);
            assert!(p["greedy_ids_equal"] == true || tiny, "{name}: {p}");
            let err = p["last_logits_max_abs_diff"].as_f64().unwrap();
            assert!(err < 1e-2, "{name}: llama.cpp logits off by {err}");
        }
    }
}

#[test]
fn gguf_metadata_is_read_per_architecture() {
    for (name, m) in models() {
        let [(_, hf), (_, gguf)] = paths(&m);
        let f = GgufFile::open(&gguf).unwrap();
        let arch = m["arch"].as_str().unwrap();
        assert_eq!(f.arch().name, arch, "{name}");
        let c = f.config().unwrap();
        let mut from_hf = ModelFiles::open(Some(&hf)).unwrap().config;
        // Same model either way, but: transformers writes `layer_types` (all full attention
        // for Qwen, which means what no entry means); a GGUF stores Gemma's norm weights
        // plus 1 (offset 0 at load), a Hugging Face checkpoint without (offset 1).
        if arch != "gemma3" {
            assert!(from_hf
                .layer_types
                .iter()
                .all(|t| *t == AttentionType::Full));
            from_hf.layer_types.clear();
        }
        assert_eq!(c.gemma.norm_offset, 0.0, "{name}");
        if arch == "gemma3" {
            assert_eq!(from_hf.gemma.norm_offset, 1.0, "{name}");
            from_hf.gemma.norm_offset = 0.0;
        }
        assert_eq!(c, from_hf, "{name}");
        match arch {
            "qwen2" => assert!(c.attention_bias && !c.qk_norm, "{name}"),
            "qwen3" => {
                assert!(!c.attention_bias && c.qk_norm, "{name}");
                // from qwen3.attention.key_length, not embedding_length / head_count
                assert_ne!(c.head_dim * c.n_heads, c.hidden_size, "{name}");
            }
            "gemma3" => {
                assert!(
                    c.qk_norm && c.gemma.sandwich_norms && c.gemma.gelu_tanh,
                    "{name}"
                );
                assert_eq!(c.gemma.embed_scale, Some(8.0), "{name}");
                assert_eq!(c.gemma.rope_local_theta, Some(10000.0), "{name}");
                assert_eq!(c.rope_theta, 1e6, "{name}");
                // every sixth layer global, the others sliding with window 8
                let s = AttentionType::Sliding { window: 8 };
                assert_eq!(
                    c.layer_types,
                    [s, s, s, s, s, AttentionType::Full],
                    "{name}"
                );
            }
            other => panic!("unexpected architecture {other}"),
        }
    }
}

#[test]
fn tokenizers_match_transformers() {
    let g = golden("archs.json");
    for (arch, m) in models() {
        for (fmt, path) in paths(&m) {
            let files = ModelFiles::open(Some(&path)).unwrap();
            let enc = |t: &str| files.tokenizer().unwrap().encode(t).unwrap();
            for c in g["tokenizer_cases"].as_array().unwrap() {
                let text = c["text"].as_str().unwrap();
                assert_eq!(enc(text), ids(&c["ids"]), "{arch} {fmt}: {text:?}");
            }
            for e in m["entries"].as_array().unwrap() {
                let p = e["prompt"].as_str().unwrap();
                assert_eq!(enc(p), ids(&e["prompt_ids"]), "{arch} {fmt}: {p:?}");
            }
        }
    }
}

/// Engine (token by token, serial and as a decode team) and reference greedy runs against
/// transformers' logits and ids, from both file formats.
#[test]
fn engine_and_reference_match_transformers() {
    for (arch, m) in models() {
        for (fmt, path) in paths(&m) {
            let files = ModelFiles::open(Some(&path)).unwrap();
            let model = Model::load(&files, WeightsDType::Native).unwrap();
            let reference = reference_model(&files, WeightsDType::Native).unwrap();
            for e in m["entries"].as_array().unwrap() {
                let prompt = ids(&e["prompt_ids"]);
                let want_ids = ids(&e["greedy_ids"]);
                let want = floats(&e["last_logits"]);
                let margins = floats(&e["margins"]);
                let kv = KvConfig::default();
                let mut runs: Vec<(String, Greedy)> = Vec::new();
                for threads in [1, 2] {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .unwrap();
                    let g = pool.install(|| {
                        let mut run = EngineRun::new(&model, &kv);
                        greedy(&mut run, &prompt, want_ids.len())
                    });
                    runs.push((format!("engine {threads} thread(s)"), g));
                }
                let mut r = ReferenceRun::new(&reference, &kv);
                runs.push(("reference".into(), greedy(&mut r, &prompt, want_ids.len())));
                for (which, g) in &runs {
                    let what = format!("{arch} {fmt} {which}");
                    let err = max_abs_diff(&g.logits[0], &want);
                    assert!(err < TOL, "{what}: last prompt logits off by {err}");
                    check_ids(&what, &g.ids, &want_ids, &margins);
                }
                // engine == reference: the differential check (same ids, close logits at
                // every step).
                let (engine, refr) = (&runs[0].1, &runs[2].1);
                assert_eq!(
                    engine.ids, refr.ids,
                    "{arch} {fmt}: engine vs reference ids"
                );
                for (a, b) in engine.logits.iter().zip(&refr.logits) {
                    assert!(
                        max_abs_diff(a, b) < TOL,
                        "{arch} {fmt}: engine vs reference"
                    );
                }
                // the decode team computes the same values as the serial step
                assert_eq!(runs[0].1.logits, runs[1].1.logits, "{arch} {fmt}: team");
            }
        }
    }
}

/// The batched paths (prefill in chunks, continuous batching of several sequences) and the
/// reference's cache-free full-sequence forward give the same last-prompt logits.
#[test]
fn batched_paths_match_transformers() {
    for (arch, m) in models() {
        for (fmt, path) in paths(&m) {
            let files = ModelFiles::open(Some(&path)).unwrap();
            let model = Model::load(&files, WeightsDType::Native).unwrap();
            let reference = reference_model(&files, WeightsDType::Native).unwrap();
            let entries = m["entries"].as_array().unwrap();
            let prompts: Vec<Vec<u32>> = entries.iter().map(|e| ids(&e["prompt_ids"])).collect();
            let wants: Vec<Vec<f32>> = entries.iter().map(|e| floats(&e["last_logits"])).collect();
            let kv = KvConfig::default();
            for (p, want) in prompts.iter().zip(&wants) {
                let mut run = EngineRun::new(&model, &kv);
                let got = run.prefill(p, 0).unwrap().to_vec();
                let err = max_abs_diff(&got, want);
                assert!(err < TOL, "{arch} {fmt} prefill: off by {err}");
                let seq = reference.forward_sequence(p);
                let err = max_abs_diff(seq.last().unwrap(), want);
                assert!(err < TOL, "{arch} {fmt} reference sequence: off by {err}");
            }
            let sessions = all_prompts_in_one_step(&model, &kv, &prompts);
            for (s, want) in sessions.iter().zip(&wants) {
                let err = max_abs_diff(&s.logits, want);
                assert!(err < TOL, "{arch} {fmt} forward_sequences: off by {err}");
            }
        }
    }
}

#[test]
fn cli_samples_gguf_greedy_as_transformers() {
    for (arch, m) in models() {
        let gguf = fixtures().join(m["gguf"].as_str().unwrap());
        let e = &m["entries"][1];
        let want = ids(&e["greedy_ids"]);
        let out = cli()
            .args(["sample", gguf.to_str().unwrap(), "--prompt"])
            .arg(e["prompt"].as_str().unwrap())
            .args(["--temperature", "0", "--ignore-eos", "--json", "--tokens"])
            .arg(want.len().to_string())
            .output()
            .unwrap();
        let v = json_of(&out);
        assert_eq!(ids(&v["prompt_ids"]), ids(&e["prompt_ids"]), "{arch}");
        check_ids(
            &format!("{arch} cli"),
            &ids(&v["generated_ids"]),
            &want,
            &floats(&e["margins"]),
        );
    }
}

/// The fixture's bytes with the string metadata value `from` (after key `key`) replaced by
/// `to` (same length).
fn patched(path: &Path, key: &str, from: &str, to: &str) -> Vec<u8> {
    assert_eq!(from.len(), to.len());
    let mut bytes = std::fs::read(path).unwrap();
    let mut pat = key.as_bytes().to_vec();
    pat.extend(8u32.to_le_bytes()); // value type: string
    pat.extend((from.len() as u64).to_le_bytes());
    pat.extend(from.as_bytes());
    let at = bytes
        .windows(pat.len())
        .position(|w| w == pat)
        .unwrap_or_else(|| panic!("{key} = {from:?} not found in {}", path.display()));
    let start = at + pat.len() - from.len();
    bytes[start..start + to.len()].copy_from_slice(to.as_bytes());
    bytes
}

#[test]
fn unknown_architecture_and_pre_tokenizer_are_named() {
    let path = fixtures().join("archs/qwen3/qwen3.gguf");
    let bytes = patched(&path, "general.architecture", "qwen3", "qwen9");
    let e = GgufFile::from_bytes(bytes, &path)
        .err()
        .expect("an unknown architecture must be refused")
        .to_string();
    assert!(
        e.contains("qwen3.gguf")
            && e.contains("general.architecture 'qwen9' is not supported")
            && e.contains("qwen2, qwen3"),
        "{e}"
    );

    let bytes = patched(&path, "tokenizer.ggml.pre", "qwen2", "qwen9");
    let f = GgufFile::from_bytes(bytes, &path).unwrap();
    f.config().unwrap();
    let e = f.tokenizer().unwrap_err().to_string();
    assert!(
        e.contains("qwen3.gguf") && e.contains("tokenizer.ggml.pre 'qwen9'"),
        "{e}"
    );
}

/// Gemma's `query_pre_attn_scalar` apart from `head_dim` (as in Gemma 3 27B): a tiny random
/// Gemma 3 with 48 against 64 (`fixtures/make_gemma3_qpas.py`), engine and reference against
/// transformers. The golden also holds transformers' logits for the same weights scaled by
/// `head_dim`, and the engine must be far from those: the fixture tells the scales apart.
#[test]
fn gemma3_query_pre_attn_scalar_matches_transformers() {
    let g = golden("gemma3_qpas.json");
    let path = fixtures().join(g["hf_dir"].as_str().unwrap());
    let files = ModelFiles::open(Some(&path)).unwrap();
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    assert_eq!(model.cfg.score_scale(), 1.0 / 48f32.sqrt());
    let reference = reference_model(&files, WeightsDType::Native).unwrap();
    let kv = KvConfig::default();
    for e in g["entries"].as_array().unwrap() {
        let prompt = ids(&e["prompt_ids"]);
        let want_ids = ids(&e["greedy_ids"]);
        let want = floats(&e["last_logits"]);
        let other_scale = floats(&e["last_logits_head_dim_scale"]);
        let margins = floats(&e["margins"]);
        let engine = greedy(&mut EngineRun::new(&model, &kv), &prompt, want_ids.len());
        let refr = greedy(
            &mut ReferenceRun::new(&reference, &kv),
            &prompt,
            want_ids.len(),
        );
        for (which, run) in [("engine", &engine), ("reference", &refr)] {
            let err = max_abs_diff(&run.logits[0], &want);
            assert!(err < TOL, "{which}: last prompt logits off by {err}");
            check_ids(which, &run.ids, &want_ids, &margins);
        }
        let apart = max_abs_diff(&engine.logits[0], &other_scale);
        assert!(
            apart > 100.0 * TOL,
            "the head_dim scale gives nearly the same logits ({apart}): the fixture cannot tell"
        );
        assert_eq!(engine.ids, refr.ids, "engine vs reference ids");
        for (a, b) in engine.logits.iter().zip(&refr.logits) {
            assert!(max_abs_diff(a, b) < TOL, "engine vs reference logits");
        }
    }
}

/// Gemma's final logit soft-capping (`logit = cap · tanh(logit / cap)` after the LM head): a
/// tiny random Gemma 3 with cap 4 (`fixtures/make_gemma3_softcap.py`; its uncapped logits
/// reach beyond 4), from its Hugging Face directory (`final_logit_softcapping`) and its GGUF
/// (`gemma3.final_logit_softcapping`). Engine (serial, decode team, prefill with every
/// position's logits, continuous batching) and reference within [`TOL`] of transformers, the
/// same greedy ids; the engine equals the reference bit for bit on f32 weights. The golden
/// also holds transformers' logits of the same weights without the cap, and the engine must
/// be far from those: the test fails if the cap is ignored. llama.cpp, run on the GGUF by the
/// generator, caps the same way (recorded in the golden).
#[test]
fn gemma3_final_logit_softcapping_matches_transformers() {
    let g = golden("gemma3_softcap.json");
    let cap = g["final_logit_softcapping"].as_f64().unwrap() as f32;
    // The generator ran llama.cpp on the GGUF: it caps too (close to the capped logits, far
    // from the uncapped ones, same greedy ids).
    let l = &g["llama_cpp"];
    assert_eq!(l["ran"], true, "llama.cpp cross-check not recorded");
    for p in l["prompts"].as_array().unwrap() {
        assert_eq!(p["greedy_ids_equal"], true, "{p}");
        assert!(
            p["last_logits_max_abs_diff"].as_f64().unwrap() < 1e-2,
            "{p}"
        );
        assert!(
            p["last_logits_max_abs_diff_to_uncapped"].as_f64().unwrap() > 1.0,
            "{p}"
        );
    }
    let kv = KvConfig::default();
    for (fmt, key) in [("hf", "hf_dir"), ("gguf", "gguf")] {
        let path = fixtures().join(g[key].as_str().unwrap());
        let files = ModelFiles::open(Some(&path)).unwrap();
        assert_eq!(
            files.config.gemma.final_logit_softcapping,
            Some(cap),
            "{fmt}"
        );
        let model = Model::load(&files, WeightsDType::Native).unwrap();
        let reference = reference_model(&files, WeightsDType::Native).unwrap();
        let entries = g["entries"].as_array().unwrap();
        for e in entries {
            let prompt = ids(&e["prompt_ids"]);
            let want_ids = ids(&e["greedy_ids"]);
            let want = floats(&e["last_logits"]);
            let uncapped = floats(&e["last_logits_uncapped"]);
            let margins = floats(&e["margins"]);
            let mut runs: Vec<(String, Greedy)> = Vec::new();
            for threads in [1, 2] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let g = pool
                    .install(|| greedy(&mut EngineRun::new(&model, &kv), &prompt, want_ids.len()));
                runs.push((format!("engine {threads} thread(s)"), g));
            }
            let mut r = ReferenceRun::new(&reference, &kv);
            runs.push(("reference".into(), greedy(&mut r, &prompt, want_ids.len())));
            for (which, run) in &runs {
                let what = format!("{fmt} {which}");
                let err = max_abs_diff(&run.logits[0], &want);
                assert!(err < TOL, "{what}: last prompt logits off by {err}");
                check_ids(&what, &run.ids, &want_ids, &margins);
                let top = run
                    .logits
                    .iter()
                    .flatten()
                    .fold(0f32, |m, v| m.max(v.abs()));
                assert!(top <= cap, "{what}: a logit of magnitude {top} > cap {cap}");
                // the control: without the cap transformers gives logits far from these
                let apart = max_abs_diff(&run.logits[0], &uncapped);
                assert!(
                    apart > 0.1,
                    "{what}: the uncapped logits are only {apart} away: the fixture cannot tell"
                );
            }
            let (engine, refr) = (&runs[0].1, &runs[2].1);
            assert_eq!(engine.ids, refr.ids, "{fmt}: engine vs reference ids");
            for (a, b) in engine.logits.iter().zip(&refr.logits) {
                assert!(
                    max_abs_diff(a, b) < TOL,
                    "{fmt}: engine vs reference logits"
                );
            }
            assert_eq!(runs[0].1.logits, runs[1].1.logits, "{fmt}: decode team");

            // prefill with every position's logits, and the reference's full-sequence forward
            let mut s = model.session(&kv);
            let mut all = Vec::new();
            model
                .forward_batch(&mut s, &prompt, 0, Some(&mut all))
                .unwrap();
            let seq = reference.forward_sequence(&prompt);
            for (i, (row, r)) in all.chunks_exact(model.cfg.vocab_size).zip(&seq).enumerate() {
                let err = max_abs_diff(row, r);
                assert!(
                    err < TOL,
                    "{fmt} prefill position {i}: off by {err} from the reference"
                );
                assert!(
                    row.iter().all(|v| v.abs() <= cap),
                    "{fmt} prefill position {i}"
                );
            }
            let err = max_abs_diff(&s.logits, &want);
            assert!(err < TOL, "{fmt} prefill: off by {err}");
            let err = max_abs_diff(seq.last().unwrap(), &want);
            assert!(err < TOL, "{fmt} reference sequence: off by {err}");
        }
        // continuous batching: every prompt in one step
        let prompts: Vec<Vec<u32>> = entries.iter().map(|e| ids(&e["prompt_ids"])).collect();
        let sessions = all_prompts_in_one_step(&model, &kv, &prompts);
        for (s, e) in sessions.iter().zip(entries) {
            let err = max_abs_diff(&s.logits, &floats(&e["last_logits"]));
            assert!(err < TOL, "{fmt} forward_sequences: off by {err}");
        }

        // engine == reference bit for bit (f32 weights; docs/design.md): the capping is the
        // same f32 expression in both
        let engine = Model::load(&files, WeightsDType::F32).unwrap();
        let reference = reference_model(&files, WeightsDType::F32).unwrap();
        let prompt = ids(&entries[2]["prompt_ids"]);
        let a = greedy(&mut EngineRun::new(&engine, &kv), &prompt, 16);
        let b = greedy(&mut ReferenceRun::new(&reference, &kv), &prompt, 16);
        let bits = |g: &Greedy| -> Vec<Vec<u32>> {
            g.logits
                .iter()
                .map(|l| l.iter().map(|v| v.to_bits()).collect())
                .collect()
        };
        assert_eq!(a.ids, b.ids, "{fmt}: engine vs reference ids (f32)");
        assert!(
            bits(&a) == bits(&b),
            "{fmt}: engine vs reference logit bits (f32)"
        );
    }
}

/// `final_logit_softcapping` in config.json: a finite number > 0, else an error naming the
/// key and the file; `attn_logit_softcapping` (attention score capping) is refused.
#[test]
fn gemma3_softcapping_config_values_are_checked() {
    let dir = fixtures().join(golden("gemma3_softcap.json")["hf_dir"].as_str().unwrap());
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let with = |key: &str, v: serde_json::Value| {
        let mut j: serde_json::Value = serde_json::from_str(&text).unwrap();
        j[key] = v;
        HfConfig::from_json(&j.to_string(), &path)
            .unwrap()
            .validate(&path)
    };
    let key = "final_logit_softcapping";
    assert_eq!(
        with(key, 30.0.into())
            .unwrap()
            .gemma
            .final_logit_softcapping,
        Some(30.0)
    );
    let off = with(key, serde_json::Value::Null).unwrap();
    assert_eq!(off.gemma.final_logit_softcapping, None);
    for bad in [0.0, -0.0, -4.0, 1e300, 1e-300] {
        let e = with(key, bad.into()).unwrap_err().to_string();
        assert!(
            e.contains("config.json") && e.contains(key) && e.contains("> 0"),
            "{bad}: {e}"
        );
    }
    let e = with("attn_logit_softcapping", 50.0.into())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("config.json")
            && e.contains("attn_logit_softcapping")
            && e.contains("not supported"),
        "{e}"
    );
}

/// `bytes` written to a file named `name` in a fresh temporary directory.
fn written(bytes: &[u8], name: &str) -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join(name);
    std::fs::write(&p, bytes).unwrap();
    (d, p)
}

/// The tokenizer is built on its own thread while the weights are checked and repacked
/// (`ModelFiles::open`). A file whose tokenizer metadata cannot make a tokenizer is still
/// refused with the build's own message naming the file: by `ModelFiles::tokenizer`, every
/// time it is asked; by `sample` (after the weights load, the message word for word as
/// when the tokenizer was built first); and by `open` itself when the weights are refused
/// too (the tokenizer's problem is the one named, as when it was checked first).
#[test]
fn a_bad_tokenizer_built_concurrently_is_refused_with_its_own_message() {
    let path = fixtures().join("archs/qwen3/qwen3.gguf");
    let bad = patched(&path, "tokenizer.ggml.pre", "qwen2", "qwen9");
    let (_dir, file) = written(&bad, "qwen3-bad-tokenizer.gguf");
    let want = format!(
        "{}: tokenizer: tokenizer.ggml.pre 'qwen9' is not a pre-tokenizer this engine knows (known: ",
        file.display()
    );

    // The library: the weights open and load; the tokenizer is the error, each time.
    let files = ModelFiles::open(Some(&file)).unwrap();
    let model = Model::load(&files, WeightsDType::Native);
    assert!(model.is_ok(), "the weights are fine");
    let e = files
        .tokenizer()
        .err()
        .expect("a bad tokenizer")
        .to_string();
    assert!(e.starts_with(&want), "{e}");
    let again = files.tokenizer().err().expect("still a bad tokenizer");
    assert!(matches!(again, tinygpt_cpu::Error::Tokenizer { .. }));
    assert_eq!(again.to_string(), e);
    // The message of the build in place, word for word.
    let g = GgufFile::from_bytes(bad.clone(), &file).unwrap();
    assert_eq!(e, g.tokenizer().expect_err("a bad tokenizer").to_string());

    // The CLI: one line on stderr, nothing on stdout, exit status 1.
    for args in [
        &["sample", "--prompt", "x", "--tokens", "2"][..],
        &["inspect"],
    ] {
        let out = cli()
            .arg(args[0])
            .arg(&file)
            .args(&args[1..])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert!(out.stdout.is_empty(), "{args:?}");
        assert_eq!(err.trim_end(), format!("error: {e}"), "{args:?}");
    }

    // Bad weights too (a NaN in the first f16 tensor): `open` names the tokenizer.
    let mut both = bad;
    let t = g
        .tensors()
        .iter()
        .find(|t| t.dtype == tinygpt_cpu::dtype::DType::F16)
        .expect("an f16 tensor");
    both[t.start..t.start + 2].copy_from_slice(&0x7e00u16.to_le_bytes());
    let (_dir2, file2) = written(&both, "qwen3-bad-tokenizer.gguf");
    let e2 = ModelFiles::open(Some(&file2))
        .expect_err("refused")
        .to_string();
    assert!(e2.contains("tokenizer.ggml.pre 'qwen9'"), "{e2}");
    // The NaN alone is refused naming its tensor (so the check above saw both problems).
    let mut nan = std::fs::read(&path).unwrap();
    nan[t.start..t.start + 2].copy_from_slice(&0x7e00u16.to_le_bytes());
    let (_dir3, file3) = written(&nan, "qwen3-nan.gguf");
    let e3 = ModelFiles::open(Some(&file3))
        .expect_err("refused")
        .to_string();
    assert!(e3.contains("non-finite"), "{e3}");
}

/// The tokenizer built on its own thread by `ModelFiles::open` is the one built in place
/// from the same metadata: the same ids (with and without the special tokens), text,
/// special ids and sizes, for every GGUF fixture and, when their files are present
/// (`TINYGPT_SMOLLM2`, `TINYGPT_GEMMA3`), SmolLM2 and Gemma 3.
#[test]
fn the_tokenizer_built_concurrently_equals_the_one_built_in_place() {
    let texts = [
        "Hello, world! The quick brown fox jumps over 12345 lazy dogs.",
        "  leading spaces,\ttabs\nand\n\nnewlines  ",
        "unicode: naïve café 東京 🦀 ½ ١٢٣",
        "<|im_start|>user\nhi<|im_end|>\n<start_of_turn>model\n<bos><eos>",
        "",
    ];
    let mut files: Vec<PathBuf> = models()
        .iter()
        .map(|(_, m)| fixtures().join(m["gguf"].as_str().unwrap()))
        .collect();
    files.extend(smollm2_path());
    // `TINYGPT_GEMMA3`, else the cache path of scripts/fetch-gemma3.sh (as tests/gemma3.rs).
    let gemma = std::env::var_os("TINYGPT_GEMMA3")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::var_os("TINYGPT_CACHE")
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    PathBuf::from(std::env::var_os("HOME").unwrap_or_default())
                        .join(".cache/tinygpt-cpu")
                })
                .join("gemma3/gemma-3-270m-q4_k_m.gguf")
        });
    match gemma.is_file() {
        true => files.push(gemma),
        false => eprintln!("skipping Gemma 3: not found at {}", gemma.display()),
    }
    for path in files {
        let opened = ModelFiles::open(Some(&path)).unwrap();
        let concurrent = opened.tokenizer().unwrap();
        let g = GgufFile::open(&path).unwrap();
        let cfg = g.config().unwrap();
        let in_place = Tokenizer::new(g.tokenizer().unwrap(), &path, &cfg).unwrap();
        let p = path.display();
        assert_eq!(concurrent.vocab_size(), in_place.vocab_size(), "{p}");
        assert_eq!(concurrent.eos_ids, in_place.eos_ids, "{p}");
        assert_eq!(concurrent.bos_id, in_place.bos_id, "{p}");
        assert_eq!(
            concurrent.max_text_bytes(7),
            in_place.max_text_bytes(7),
            "{p}"
        );
        for text in texts {
            for special in [true, false] {
                let a = concurrent.encode_with(text, special).unwrap();
                assert_eq!(
                    a,
                    in_place.encode_with(text, special).unwrap(),
                    "{p}: {text:?}"
                );
                assert_eq!(concurrent.decode(&a).unwrap(), in_place.decode(&a).unwrap());
            }
        }
    }
}
