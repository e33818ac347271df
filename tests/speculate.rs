//! Speculative decoding (`--speculate ngram[:K]`, docs/design.md §3.3) against plain
//! decoding, which is its oracle:
//!
//! * greedy: the generated ids, the logits of every position the cache keeps, and the
//!   cache itself (every stored row, its position, the bytes) are bit-identical to plain
//!   decoding, for every cache mode (fp32, fp16, bf16, int8, int4, int2 + residual, K ≠ V,
//!   sink + window in both positions modes, rotation), the YOCO fixture with sliding
//!   layers, 1 and 2 threads, several draft lengths; drafts are accepted *and* rejected in
//!   every case (asserted), so both the kept and the dropped rows of a hold are exercised;
//! * a bounded cache stays bounded: sink 4 + window 252 + int4 over a long generation with
//!   drafts stores at most 256 rows;
//! * sampling: the distribution of the sampled tokens equals plain sampling's (a two-sample
//!   test over many seeds on the bundled model);
//! * the CLI: `sample --speculate` gives `sample`'s ids and reports its counts; bad values
//!   are refused naming the flag;
//! * a draft model (`--draft-model`): greedy ids, logits and cache bit-identical to plain
//!   decoding in every cache mode with a draft that is accepted and rejected (the bundled
//!   model's bf16 copy drafting for it), its own cache bounded under sink + window, the
//!   CLI's ids, and refusals of another vocabulary (naming both files) and of
//!   `--speculate` beside it.

mod common;

use common::{chi_square, chi_square_critical_1e4, cli, fixtures, json_of, pool};
use std::collections::BTreeMap;
use tinygpt_cpu::generate::{Engine, EngineRun, GenerateOptions, Generation};
use tinygpt_cpu::kv_cache::{KvConfig, PositionsMode, Precision};
use tinygpt_cpu::model::{Model, WeightsDType};
use tinygpt_cpu::sampler::SamplerConfig;
use tinygpt_cpu::speculate::{DraftModel, SpecConfig, SpecStats};
use tinygpt_cpu::weights::ModelFiles;

/// An engine that keeps the logits of every decode position whose row the cache keeps
/// (a position whose rows a release drops is forgotten, as the cache forgets it).
struct Recorder<'m> {
    run: EngineRun<&'m Model>,
    logits: BTreeMap<usize, Vec<u32>>,
    /// Where the held pass started (set by `forward_all` during a hold).
    held_from: Option<usize>,
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

impl Engine for Recorder<'_> {
    fn forward(&mut self, token: u32, pos: usize) -> tinygpt_cpu::Result<&[f32]> {
        let l = self.run.forward(token, pos)?;
        self.logits.insert(pos, bits(l));
        Ok(l)
    }
    fn forward_all(
        &mut self,
        tokens: &[u32],
        start: usize,
        out: &mut Vec<f32>,
    ) -> tinygpt_cpu::Result<()> {
        self.run.forward_all(tokens, start, out)?;
        let vocab = out.len() / tokens.len();
        for (i, row) in out.chunks_exact(vocab).enumerate() {
            self.logits.insert(start + i, bits(row));
        }
        self.held_from = Some(start);
        Ok(())
    }
    fn hold(&mut self) -> tinygpt_cpu::Result<()> {
        self.held_from = None;
        self.run.hold()
    }
    fn release(&mut self, keep: usize) {
        self.run.release(keep);
        if let Some(s) = self.held_from.take() {
            self.logits.retain(|&p, _| p < s + keep);
        }
    }
    fn kv_bytes(&self) -> usize {
        self.run.kv_bytes()
    }
    fn stored_tokens(&self) -> usize {
        self.run.stored_tokens()
    }
    fn layers_with_kv(&self) -> usize {
        self.run.layers_with_kv()
    }
    fn set_record_probs(&mut self, on: bool) {
        self.run.set_record_probs(on)
    }
    fn probs(&self) -> &[Vec<f32>] {
        self.run.probs()
    }
    fn positions(&self, l: usize) -> Vec<usize> {
        self.run.positions(l)
    }
    fn reset(&mut self) {
        self.run.reset()
    }
    fn prefill(&mut self, tokens: &[u32], start: usize) -> tinygpt_cpu::Result<&[f32]> {
        self.run.prefill(tokens, start)
    }
}

/// What a run leaves behind: ids, recorded logits, the cache's rows (bits, per layer) and
/// positions, its bytes, and the speculative counts.
struct Outcome {
    ids: Vec<u32>,
    logits: BTreeMap<usize, Vec<u32>>,
    rows: Vec<Vec<u32>>,
    positions: Vec<Vec<usize>>,
    bytes: usize,
    spec: SpecStats,
}

fn run(
    model: &Model,
    files: &ModelFiles,
    kv: &KvConfig,
    prompt: &[u32],
    tokens: usize,
    sampler: SamplerConfig,
    spec: Option<SpecConfig>,
) -> Outcome {
    run_with(model, files, kv, prompt, tokens, sampler, spec, None)
}

/// [`run`], drafting with `draft` when given.
#[allow(clippy::too_many_arguments)]
fn run_with(
    model: &Model,
    files: &ModelFiles,
    kv: &KvConfig,
    prompt: &[u32],
    tokens: usize,
    sampler: SamplerConfig,
    spec: Option<SpecConfig>,
    draft: Option<DraftModel>,
) -> Outcome {
    let opts = GenerateOptions::new(tokens, sampler, true, kv, 1 << 20, true)
        .unwrap()
        .with_speculation(spec);
    let mut e = Recorder {
        run: EngineRun::new(model, kv),
        logits: BTreeMap::new(),
        held_from: None,
    };
    let mut gen = Generation::new(prompt, &opts).unwrap();
    if let Some(d) = draft {
        gen = gen.with_draft_model(d).unwrap();
    }
    let mut ids = Vec::new();
    while let Some(step) = gen.step(&mut e, files.tokenizer().unwrap()).unwrap() {
        ids.push(step.id);
    }
    let cache = &e.run.session.cache;
    let mut rows = Vec::new();
    let mut positions = Vec::new();
    for l in 0..cache.n_layers() {
        let layer = cache.layer(l);
        positions.push(layer.positions());
        for i in 0..layer.len() {
            rows.push(bits(&layer.key(i)));
            rows.push(bits(&layer.value(i)));
        }
    }
    Outcome {
        ids,
        logits: e.logits,
        rows,
        positions,
        bytes: cache.bytes(),
        spec: gen.spec_stats(),
    }
}

/// The bundled model's files and model.
fn bundled() -> (ModelFiles, Model) {
    let files = ModelFiles::open(None).unwrap();
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    (files, model)
}

/// The flagship cache: sink 4 + window 252, int4.
fn flagship_cache() -> KvConfig {
    KvConfig {
        precision: Precision::Int4,
        sink: 4,
        window: Some(252),
        ..KvConfig::default()
    }
}

/// A prompt that repeats (drafts find matches at once) followed by greedy output of the
/// model (which, random or not, soon repeats too).
fn repetitive_prompt(files: &ModelFiles) -> Vec<u32> {
    let text = "one two three four five six. one two three four five six. one two three";
    files.tokenizer().unwrap().encode(text).unwrap()
}

fn modes() -> Vec<(String, KvConfig)> {
    let mut v = Vec::new();
    for name in [
        "fp32",
        "fp16",
        "bf16",
        "int8",
        "int4",
        "int2+r16",
        "k8v4",
        "int4+norot",
    ] {
        let mut kv = KvConfig {
            group_size: 8,
            ..KvConfig::default()
        };
        tinygpt_cpu::eval::apply_quant_mode(name, &mut kv).unwrap();
        v.push((name.to_string(), kv.clone()));
        for positions in [PositionsMode::Original, PositionsMode::Cache] {
            let windowed = KvConfig {
                sink: 4,
                window: Some(13),
                positions,
                ..kv.clone()
            };
            v.push((
                format!("{name} sink 4 window 13 {}", positions.name()),
                windowed,
            ));
        }
    }
    v
}

/// Greedy with drafts of at most `k` against plain greedy, every mode, on `threads`.
fn greedy_matches_plain(files: &ModelFiles, model: &Model, threads: usize, ks: &[usize]) {
    let prompt = repetitive_prompt(files);
    for (name, kv) in modes() {
        pool(threads).install(|| {
            let plain = run(
                model,
                files,
                &kv,
                &prompt,
                70,
                SamplerConfig::greedy(),
                None,
            );
            for &k in ks {
                let ctx = format!("{name}, K = {k}, {threads} thread(s)");
                let spec = Some(SpecConfig { max_draft: k });
                let got = run(
                    model,
                    files,
                    &kv,
                    &prompt,
                    70,
                    SamplerConfig::greedy(),
                    spec,
                );
                assert_eq!(got.ids, plain.ids, "{ctx}: ids");
                assert_eq!(
                    got.logits, plain.logits,
                    "{ctx}: logits of the kept positions"
                );
                assert_eq!(got.positions, plain.positions, "{ctx}: stored positions");
                assert!(got.rows == plain.rows, "{ctx}: stored rows differ");
                assert_eq!(got.bytes, plain.bytes, "{ctx}: bytes");
                let s = got.spec;
                assert!(s.accepted > 0, "{ctx}: no draft accepted ({s:?})");
                assert!(s.accepted < s.drafted, "{ctx}: no draft rejected ({s:?})");
                assert_eq!(s.produced, 69, "{ctx}: every decoded token counted ({s:?})");
            }
        });
    }
}

#[test]
fn greedy_is_bit_identical_on_the_bundled_model() {
    let files = ModelFiles::open(None).unwrap();
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    for threads in [1, 2] {
        greedy_matches_plain(&files, &model, threads, &[2, 8]);
    }
}

/// YOCO (the last layers read another layer's cache) with sliding-window layers.
#[test]
fn greedy_is_bit_identical_on_the_yoco_fixture() {
    let files = ModelFiles::open(Some(&fixtures().join("yoco"))).unwrap();
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    greedy_matches_plain(&files, &model, 2, &[4]);
}

/// A bounded cache with drafts holds what it holds without them: sink 4 + window 252 +
/// int4 over 2,000 generated tokens stores at most 256 rows per layer (and exactly the plain
/// run's rows).
#[test]
fn a_bounded_cache_stays_bounded() {
    let (files, model) = bundled();
    let kv = flagship_cache();
    let prompt = repetitive_prompt(&files);
    let spec = Some(SpecConfig { max_draft: 8 });
    let got = run(
        &model,
        &files,
        &kv,
        &prompt,
        2000,
        SamplerConfig::greedy(),
        spec,
    );
    let plain = run(
        &model,
        &files,
        &kv,
        &prompt,
        2000,
        SamplerConfig::greedy(),
        None,
    );
    assert!(got.positions.iter().all(|p| p.len() <= 256));
    assert_eq!(got.positions, plain.positions);
    assert!(got.rows == plain.rows);
    assert!(got.spec.accepted > 0, "{:?}", got.spec);
}

/// Sampling with drafts keeps the distribution: after a prompt that loops, the 2nd to 6th
/// sampled tokens (temperature 0.6) of 1,500 seeded runs with drafts and 1,500 without are compared position by position with a
/// chi-square two-sample test on the tokens seen at least 20 times overall (the rest
/// pooled); each statistic must stay under the 1e-4 critical value. Draft tokens are
/// accepted and rejected in the speculative runs (asserted).
#[test]
fn sampling_keeps_the_distribution() {
    let files = ModelFiles::open(None).unwrap();
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    let kv = KvConfig::default();
    // The prompt and the model's own greedy continuation (which loops), so that sampled
    // continuations often follow the loop and drafts are proposed, accepted and rejected.
    let mut prompt = repetitive_prompt(&files);
    let greedy = run(
        &model,
        &files,
        &kv,
        &prompt,
        30,
        SamplerConfig::greedy(),
        None,
    );
    prompt.extend(&greedy.ids);
    let n = 1500;
    let sample = |seed: u64, spec: Option<SpecConfig>| {
        let cfg = SamplerConfig {
            temperature: 0.6,
            top_k: 0,
            top_p: 1.0,
            seed,
        };
        run(&model, &files, &kv, &prompt, 6, cfg, spec)
    };
    let mut plain: Vec<Vec<u32>> = vec![Vec::new(); 6];
    let mut drafted: Vec<Vec<u32>> = vec![Vec::new(); 6];
    let mut stats = SpecStats::default();
    for seed in 0..n {
        let p = sample(seed, None);
        let d = sample(1_000_000 + seed, Some(SpecConfig { max_draft: 4 }));
        for i in 1..6 {
            plain[i].push(p.ids[i]);
            drafted[i].push(d.ids[i]);
        }
        stats.drafted += d.spec.drafted;
        stats.accepted += d.spec.accepted;
    }
    assert!(stats.accepted > 100, "{stats:?}");
    assert!(stats.accepted + 100 < stats.drafted, "{stats:?}");
    for i in 1..6 {
        let (stat, df) = chi_square(&plain[i], &drafted[i], 20);
        let critical = chi_square_critical_1e4(df);
        assert!(
            stat < critical,
            "token {i}: chi-square {stat:.1} over {df} degrees of freedom (critical {critical:.1})"
        );
    }
}

/// `sample --json` of 60 greedy tokens after `prompt` (EOS ignored), with `extra` flags.
fn greedy_json(prompt: &str, extra: &[&std::ffi::OsStr]) -> serde_json::Value {
    let out = cli()
        .args(["sample", "--prompt", prompt, "--tokens", "60"])
        .args(["--temperature", "0", "--ignore-eos", "--json"])
        .args(extra)
        .output()
        .unwrap();
    json_of(&out)
}

#[test]
fn cli_speculate_gives_the_same_ids_and_reports_counts() {
    let prompt = "one two three four five six. one two three four five six. one two three";
    let plain = greedy_json(prompt, &[]);
    let spec = greedy_json(prompt, &["--speculate".as_ref(), "ngram:6".as_ref()]);
    assert_eq!(spec["generated_ids"], plain["generated_ids"]);
    assert_eq!(spec["kv"], plain["kv"]);
    let t = &spec["timing"];
    let (drafted, accepted) = (
        t["drafted"].as_u64().unwrap(),
        t["accepted"].as_u64().unwrap(),
    );
    assert!(accepted > 0 && accepted <= drafted, "{t}");
    assert!(t["tokens_per_step"].as_f64().unwrap() > 1.0, "{t}");
    assert_eq!(plain["timing"]["drafted"], 0);
    assert_eq!(plain["timing"]["tokens_per_step"], 1.0);
    for bad in ["draft", "ngram:0", "ngram:x"] {
        let out = cli()
            .args(["sample", "--prompt", "hi", "--speculate", bad])
            .output()
            .unwrap();
        assert!(!out.status.success(), "{bad}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("--speculate"), "{bad}: {err}");
    }
}

/// A state saved after a speculative run is the plain run's state, byte for byte: the
/// same rows and the same logits after the last fed token (the logits of a verification
/// pass's last kept row, not of its last drafted one).
#[test]
fn a_saved_state_after_drafts_is_the_plain_runs() {
    let dir = tempfile::tempdir().unwrap();
    let prompt = "one two three four five six. one two three four five six. one two three";
    let mut files = Vec::new();
    for (i, extra) in [&[][..], &["--speculate", "ngram:5"][..]]
        .iter()
        .enumerate()
    {
        let path = dir.path().join(format!("s{i}.state"));
        let out = cli()
            .args([
                "sample",
                "--prompt",
                prompt,
                "--tokens",
                "40",
                "--temperature",
                "0",
            ])
            .args(["--ignore-eos", "--json", "--kv-quantize", "int4"])
            .args(["--streaming-llm-sink", "4", "--streaming-llm-window", "20"])
            .arg("--save-state")
            .arg(&path)
            .args(*extra)
            .output()
            .unwrap();
        let v = json_of(&out);
        if i == 1 {
            assert!(v["timing"]["accepted"].as_u64().unwrap() > 0, "{v}");
        }
        files.push(std::fs::read(&path).unwrap());
    }
    assert!(files[0] == files[1], "the saved states differ");
}

/// A fixture with the bundled model's tokenizer drafting for the bundled model: the YOCO
/// fixture (other weights, shared and sliding layers of its own) agrees with it on the
/// repetitive prompt about two times in three. Its step cost is set to `step_cost`
/// (by the files' byte ratio drafting would rarely pay for a model this size).
fn fixture_draft(name: &str, target: &ModelFiles, kv: &KvConfig, step_cost: f64) -> DraftModel {
    let files = ModelFiles::open(Some(&fixtures().join(name))).unwrap();
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    DraftModel::new(std::sync::Arc::new(model), &files, target, kv)
        .unwrap()
        .with_step_cost(step_cost)
}

/// Greedy with a draft model equals plain greedy in every cache mode (ids, kept logits,
/// stored rows and positions, bytes), on 1 and 2 threads, with drafts accepted and
/// rejected; the draft model's own cache follows the same flags.
#[test]
fn draft_model_greedy_is_bit_identical() {
    let files = ModelFiles::open(None).unwrap();
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    let prompt = repetitive_prompt(&files);
    for threads in [1, 2] {
        for (name, kv) in modes() {
            pool(threads).install(|| {
                let g = SamplerConfig::greedy();
                let plain = run(&model, &files, &kv, &prompt, 70, g.clone(), None);
                for k in [3, 8] {
                    let ctx = format!("{name}, K = {k}, {threads} thread(s)");
                    let spec = Some(SpecConfig { max_draft: k });
                    let draft = Some(fixture_draft("yoco", &files, &kv, 0.0));
                    let got = run_with(&model, &files, &kv, &prompt, 70, g.clone(), spec, draft);
                    assert_eq!(got.ids, plain.ids, "{ctx}: ids");
                    assert_eq!(got.logits, plain.logits, "{ctx}: logits");
                    assert_eq!(got.positions, plain.positions, "{ctx}: positions");
                    assert!(got.rows == plain.rows, "{ctx}: stored rows differ");
                    assert_eq!(got.bytes, plain.bytes, "{ctx}: bytes");
                    let s = got.spec;
                    assert!(s.accepted > 0, "{ctx}: no draft accepted ({s:?})");
                    assert!(s.accepted < s.drafted, "{ctx}: no draft rejected ({s:?})");
                    // The target's own weights drafting: every draft is right exactly
                    // when the draft cache holds the text's rows at their positions.
                    let own = Some(fixture_draft("tiny", &files, &kv, 0.0));
                    let got = run_with(&model, &files, &kv, &prompt, 70, g.clone(), spec, own);
                    assert_eq!(got.ids, plain.ids, "{ctx}: ids, drafting for itself");
                    let s = got.spec;
                    assert!(s.drafted > 30, "{ctx}: {s:?}");
                    assert_eq!(s.accepted, s.drafted, "{ctx}: drafting for itself");
                }
            });
        }
    }
}

/// A draft model whose drafts are never right leaves the output alone and stops drafting
/// by itself (the self-stop), and a long generation under sink 4 + window 252 + int4
/// keeps both caches bounded.
#[test]
fn draft_model_bounded_and_self_stopping() {
    let (files, model) = bundled();
    let kv = flagship_cache();
    let prompt = repetitive_prompt(&files);
    let g = SamplerConfig::greedy();
    let spec = Some(SpecConfig { max_draft: 8 });
    let plain = run(&model, &files, &kv, &prompt, 1000, g.clone(), None);
    let got = run_with(
        &model,
        &files,
        &kv,
        &prompt,
        1000,
        g.clone(),
        spec,
        Some(fixture_draft("yoco", &files, &kv, 0.0)),
    );
    assert!(got.positions.iter().all(|p| p.len() <= 256));
    assert_eq!(got.positions, plain.positions);
    assert!(got.rows == plain.rows);
    assert_eq!(got.ids, plain.ids);
    assert!(got.spec.accepted > 0, "{:?}", got.spec);
    // A draft model that is seldom right stops drafting by itself.
    let free = files
        .tokenizer()
        .unwrap()
        .encode("The little robot said")
        .unwrap();
    let plain = run(&model, &files, &kv, &free, 1000, g.clone(), None);
    let d = fixture_draft(SELDOM_RIGHT, &files, &kv, 0.2);
    let got = run_with(&model, &files, &kv, &free, 1000, g, spec, Some(d));
    assert_eq!(got.ids, plain.ids);
    let s = got.spec;
    eprintln!("{SELDOM_RIGHT} drafting on a free prompt: {s:?}");
    assert!(
        s.accepted * 2 < s.drafted,
        "not a seldom-right drafter: {s:?}"
    );
    assert!(
        s.drafted < 100,
        "drafting goes on though drafts are rejected: {s:?}"
    );
}

/// A fixture with the bundled model's tokenizer whose greedy tokens seldom match the
/// bundled model's after a free prompt.
const SELDOM_RIGHT: &str = "unseen/llama3-untied-bf16";

#[test]
fn cli_draft_model_gives_the_same_ids_and_refuses_another_vocabulary() {
    let prompt = "one two three four five six. one two three four five six. one two three";
    let plain = greedy_json(prompt, &[]);
    // A draft model a ninth of the target's bytes: it drafts; the ids are plain decoding's.
    let small = fixtures().join(SELDOM_RIGHT);
    let spec = greedy_json(prompt, &["--draft-model".as_ref(), small.as_os_str()]);
    assert_eq!(spec["generated_ids"], plain["generated_ids"]);
    assert_eq!(spec["kv"], plain["kv"]);
    let t = &spec["timing"];
    assert!(t["drafted"].as_u64().unwrap() > 0, "{t}");
    // The target's own file as the draft costs a whole step a draft: drafting cannot pay
    // and never runs (design §3.3), the output unchanged.
    let tiny = fixtures().join("tiny");
    let same = greedy_json(prompt, &["--draft-model".as_ref(), tiny.as_os_str()]);
    assert_eq!(same["generated_ids"], plain["generated_ids"]);
    assert_eq!(same["timing"]["drafted"], 0, "{}", same["timing"]);
    // Another vocabulary (the bundled model's with two ids swapped): one line naming
    // the flag and both files.
    let dir = tempfile::tempdir().unwrap();
    let other = dir.path().join("swapped");
    std::fs::create_dir(&other).unwrap();
    for f in std::fs::read_dir(&tiny).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, other.join(f.file_name().unwrap())).unwrap();
    }
    let tok_path = other.join("tokenizer.json");
    let mut tok: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&tok_path).unwrap()).unwrap();
    let vocab = tok["model"]["vocab"].as_object_mut().unwrap();
    let (a, b) = ("the".to_string(), "and".to_string());
    let (ia, ib) = (vocab[&a].clone(), vocab[&b].clone());
    vocab.insert(a, ib);
    vocab.insert(b, ia);
    std::fs::write(&tok_path, serde_json::to_vec(&tok).unwrap()).unwrap();
    let out = cli()
        .args(["sample", "--prompt", "hi", "--draft-model"])
        .arg(&other)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--draft-model"), "{err}");
    assert!(err.contains(&other.display().to_string()), "{err}");
    assert!(err.contains("bundled"), "names the target: {err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    // Not beside --speculate; not a missing file.
    let out = cli()
        .args([
            "sample",
            "--prompt",
            "hi",
            "--speculate",
            "ngram",
            "--draft-model",
        ])
        .arg(&tiny)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--draft-model"));
    let out = cli()
        .args([
            "sample",
            "--prompt",
            "hi",
            "--draft-model",
            "/nonexistent/x.gguf",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/x.gguf"), "{err}");
}
