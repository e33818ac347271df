//! Saved cache states (issue 49, `src/state/`, docs/design.md §5 "Saved states").
//!
//! * round trip: a decoded cache is bit for bit the saved one (its whole `Debug` form and
//!   its re-encoding equal), and stays equal through later decode steps (same logits
//!   bits), for every precision, K ≠ V, sink + window in both positions modes, residual,
//!   int2, rotation on and off, pre-RoPE keys, on the bundled model and on the YOCO
//!   fixture (shared layers, sliding layers);
//! * resume equals recompute: a generation resumed from a saved prefix (suffix prefilled,
//!   or nothing when the prompt is the state's ids: the saved logits) gives the ids and
//!   the logits of one uninterrupted run, bit for bit;
//! * hostile input: truncated at every byte, flipped bytes (with and without a valid
//!   checksum), another model, version, configuration, huge declared lengths,
//!   inconsistent contents, a cache that is holding rows → the right [`Problem`], never a
//!   panic; a decoded mutation that passes every check is usable;
//! * files: `save` never leaves a partial file, errors name the file;
//! * the CLI: `sample --save-state` / `--load-state` through the binary.

mod common;
use common::*;
use tinygpt_cpu::generate::{generate_from, generate_with, Engine, EngineRun, GenerateOptions};
use tinygpt_cpu::generate::{GenerateResult, Generation};
use tinygpt_cpu::kv_cache::{KeyRope, KvConfig, KvRotation, PositionsMode, Precision};
use tinygpt_cpu::model::{Model, Session, WeightsDType};
use tinygpt_cpu::sampler::SamplerConfig;
use tinygpt_cpu::state::{self, ModelIdentity, Problem};
use tinygpt_cpu::weights::{ModelFiles, TensorBytes};
use tinygpt_cpu::Error;

struct Fixture {
    files: ModelFiles,
    model: Model,
    id: ModelIdentity,
}

fn fixture(files: ModelFiles) -> Fixture {
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    let id = ModelIdentity::of(&files).unwrap();
    Fixture { files, model, id }
}

fn bundled() -> Fixture {
    fixture(ModelFiles::open(None).unwrap())
}

fn yoco() -> Fixture {
    fixture(ModelFiles::open(Some(&fixtures().join("yoco"))).unwrap())
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// Deterministic ids spread over the vocabulary.
fn tokens(n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|t| ((t * 7919 + 13) % vocab) as u32).collect()
}

/// Every cache mode the round trip covers.
fn modes() -> Vec<KvConfig> {
    let mut v = Vec::new();
    for precision in Precision::ALL {
        let group_size = 4;
        v.push(KvConfig {
            precision,
            group_size,
            ..KvConfig::default()
        });
        for positions in [PositionsMode::Original, PositionsMode::Cache] {
            v.push(KvConfig {
                precision,
                group_size,
                sink: 2,
                window: Some(11),
                positions,
                ..KvConfig::default()
            });
        }
    }
    let base = KvConfig {
        group_size: 4,
        sink: 2,
        window: Some(11),
        ..KvConfig::default()
    };
    v.extend([
        KvConfig {
            precision: Precision::Int8,
            v_precision: Some(Precision::Int4),
            ..base.clone()
        },
        KvConfig {
            precision: Precision::Fp16,
            v_precision: Some(Precision::Int2),
            window: None,
            sink: 0,
            ..base.clone()
        },
        KvConfig {
            precision: Precision::Int4,
            residual: 5,
            ..base.clone()
        },
        KvConfig {
            precision: Precision::Int2,
            residual: 7,
            window: None,
            sink: 0,
            ..base.clone()
        },
        KvConfig {
            precision: Precision::Int4,
            residual: 30,
            ..base.clone()
        },
        KvConfig {
            precision: Precision::Int4,
            rotation: KvRotation::None,
            ..base.clone()
        },
        KvConfig {
            precision: Precision::Fp32,
            rotation: KvRotation::Hadamard,
            ..base.clone()
        },
        KvConfig {
            precision: Precision::Int4,
            key_rope: KeyRope::Pre,
            ..base.clone()
        },
        KvConfig {
            precision: Precision::Int8,
            sink: 6,
            window: Some(3),
            group_size: 5,
            ..base
        },
    ]);
    v
}

fn prefill(fx: &Fixture, kv: &KvConfig, ids: &[u32]) -> Session {
    let mut s = fx.model.session(kv);
    fx.model.forward_batch(&mut s, ids, 0, None).unwrap();
    s
}

fn problem(r: Result<impl std::fmt::Debug, Error>) -> (Problem, String) {
    match r {
        Err(e @ Error::State { problem, .. }) => (problem, e.to_string()),
        other => panic!("expected a state error, got {other:?}"),
    }
}

/// Saves after `n` tokens, decodes, and checks the loaded cache is the saved one and
/// stays equal over `more` decode steps.
fn round_trip(fx: &Fixture, kv: &KvConfig, n: usize, more: usize) {
    let cfg = &fx.files.config;
    let ids = tokens(n + more, cfg.vocab_size);
    let ctx = format!("{} n={n}: {kv:?}", fx.files.path.display());
    let mut a = prefill(fx, kv, &ids[..n]);
    let bytes = state::encode(&fx.id, kv, &ids[..n], &a.cache).unwrap();
    let st = state::decode(&bytes, &fx.id, kv, cfg).unwrap_or_else(|e| panic!("{ctx}: {e}"));
    assert_eq!(st.ids, ids[..n], "{ctx}");
    assert!(st.logits.is_none(), "{ctx}");
    assert_eq!(format!("{:?}", st.cache), format!("{:?}", a.cache), "{ctx}");
    let again = state::encode(&fx.id, kv, &ids[..n], &st.cache).unwrap();
    assert!(again == bytes, "{ctx}: re-encoding differs");
    let mut b = fx.model.session(kv);
    b.cache = st.cache;
    for (t, &tok) in ids.iter().enumerate().skip(n) {
        fx.model.forward(&mut a, tok, t).unwrap();
        fx.model.forward(&mut b, tok, t).unwrap();
        assert_eq!(bits(&a.logits), bits(&b.logits), "{ctx}: logits at {t}");
    }
    let end = state::encode(&fx.id, kv, &ids, &a.cache).unwrap();
    assert!(
        end == state::encode(&fx.id, kv, &ids, &b.cache).unwrap(),
        "{ctx}: after {more} steps"
    );
}

#[test]
fn round_trip_is_bit_identical_and_continues_identically() {
    let fx = bundled();
    let jobs: Vec<(KvConfig, usize)> = modes()
        .into_iter()
        .flat_map(|kv| [0usize, 1, 3, 17, 40].map(|n| (kv.clone(), n)))
        .collect();
    on_two_workers(&jobs, |(kv, n)| round_trip(&fx, kv, *n, 13));
}

#[test]
fn round_trip_on_yoco_and_sliding_layers() {
    let fx = yoco();
    assert!(fx.files.config.num_kv_shared_layers > 0 && !fx.files.config.layer_types.is_empty());
    let jobs: Vec<(KvConfig, usize)> = modes()
        .into_iter()
        .step_by(2)
        .flat_map(|kv| [5usize, 70].map(|n| (kv.clone(), n)))
        .collect();
    on_two_workers(&jobs, |(kv, n)| round_trip(&fx, kv, *n, 8));
}

fn options(kv: &KvConfig, max_tokens: usize, context: usize) -> GenerateOptions {
    let sampler = SamplerConfig {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        seed: 5,
    };
    GenerateOptions::new(max_tokens, sampler, true, kv, context, false).unwrap()
}

fn run_all(
    fx: &Fixture,
    run: &mut EngineRun<&Model>,
    prompt: &[u32],
    gen: Generation,
) -> GenerateResult {
    generate_from(
        run,
        fx.files.tokenizer().unwrap(),
        prompt,
        gen,
        true,
        &mut |_| Ok(()),
    )
    .unwrap()
}

/// A state saved after `k` prompt tokens, loaded into a fresh session, resumed: same ids
/// and logits as the uninterrupted run, and a state saved after it equal to the
/// uninterrupted run's.
fn resume_equals_recompute(fx: &Fixture, kv: &KvConfig, prompt: &[u32], k: usize) {
    let cfg = &fx.files.config;
    let ctx = format!("k={k} {kv:?}");
    let opts = options(kv, 12, cfg.max_position_embeddings);
    let mut full = EngineRun::new(&fx.model, kv);
    let want = generate_with(
        &mut full,
        fx.files.tokenizer().unwrap(),
        prompt,
        &opts,
        true,
        &mut |_| Ok(()),
    )
    .unwrap();

    let mut first = EngineRun::new(&fx.model, kv);
    let logits = first.prefill(&prompt[..k], 0).unwrap().to_vec();
    let s = &first.session;
    let bytes =
        state::encode_with_logits(&fx.id, kv, &prompt[..k], &s.cache, Some(&logits)).unwrap();
    let st = state::decode(&bytes, &fx.id, kv, cfg).unwrap();
    state::check_prefix(&st.ids, prompt).unwrap();
    assert_eq!(bits(st.logits.as_deref().unwrap()), bits(&logits), "{ctx}");

    let mut resumed = EngineRun::new(&fx.model, kv);
    resumed.session.cache = st.cache;
    let gen = Generation::new(prompt, &opts)
        .unwrap()
        .resume(k, st.logits)
        .unwrap();
    let got = run_all(fx, &mut resumed, prompt, gen);
    assert_eq!(got.generated_ids, want.generated_ids, "{ctx}");
    assert_eq!(got.prompt_tokens_reused, k, "{ctx}");
    assert_eq!(got.current_length, want.current_length, "{ctx}");
    assert_eq!(
        bits(&resumed.session.logits),
        bits(&full.session.logits),
        "{ctx}: last logits"
    );
    let fed = want.current_length - prompt.len();
    let ids: Vec<u32> = prompt
        .iter()
        .chain(&want.generated_ids[..fed])
        .copied()
        .collect();
    assert!(
        state::encode(&fx.id, kv, &ids, &resumed.session.cache).unwrap()
            == state::encode(&fx.id, kv, &ids, &full.session.cache).unwrap(),
        "{ctx}: caches after the run"
    );
}

#[test]
fn resume_equals_recompute_in_every_mode() {
    let fx = bundled();
    let prompt = tokens(30, fx.files.config.vocab_size);
    let jobs: Vec<(KvConfig, usize)> = modes()
        .into_iter()
        .flat_map(|kv| [1usize, 12, 29, 30].map(|k| (kv.clone(), k)))
        .collect();
    on_two_workers(&jobs, |(kv, k)| {
        resume_equals_recompute(&fx, kv, &prompt, *k)
    });
}

#[test]
fn resume_equals_recompute_on_yoco_and_sliding_layers() {
    let fx = yoco();
    let prompt = tokens(90, fx.files.config.vocab_size);
    let jobs: Vec<(KvConfig, usize)> = modes()
        .into_iter()
        .step_by(3)
        .flat_map(|kv| [40usize, 70, 90].map(|k| (kv.clone(), k)))
        .collect();
    on_two_workers(&jobs, |(kv, k)| {
        resume_equals_recompute(&fx, kv, &prompt, *k)
    });
}

/// The real models, when their files are given (`TINYGPT_SMOLLM2`, `TINYGPT_GEMMA3`):
/// one dense and one int4 + sink + window mode each.
#[test]
fn resume_equals_recompute_on_real_models() {
    let mut paths = Vec::new();
    if let Some(p) = smollm2_path() {
        paths.push(p);
    }
    if let Some(p) = std::env::var_os("TINYGPT_GEMMA3") {
        paths.push(p.into());
    }
    for p in paths {
        let fx = fixture(ModelFiles::open(Some(&p)).unwrap());
        let prompt = tokens(40, fx.files.config.vocab_size.min(20000));
        for kv in [
            KvConfig::default(),
            KvConfig {
                precision: Precision::Int4,
                sink: 4,
                window: Some(20),
                ..KvConfig::default()
            },
        ] {
            resume_equals_recompute(&fx, &kv, &prompt, 25);
        }
    }
}

/// A small state with every kind of store (f32 prefix, KIVI K with groups and residual,
/// KIVI V with residual, a wrapped ring) and a dense fp16 one.
fn small_states(fx: &Fixture) -> Vec<(KvConfig, Vec<u8>)> {
    let kvs = [
        KvConfig {
            precision: Precision::Int4,
            v_precision: Some(Precision::Int8),
            group_size: 3,
            residual: 2,
            sink: 1,
            window: Some(7),
            ..KvConfig::default()
        },
        KvConfig {
            precision: Precision::Fp16,
            ..KvConfig::default()
        },
    ];
    kvs.into_iter()
        .map(|kv| {
            let ids = tokens(12, fx.files.config.vocab_size);
            let mut s = prefill(fx, &kv, &ids);
            fx.model.forward(&mut s, 5, 12).unwrap();
            let ids: Vec<u32> = ids.into_iter().chain([5]).collect();
            let b =
                state::encode_with_logits(&fx.id, &kv, &ids, &s.cache, Some(&s.logits)).unwrap();
            (kv, b)
        })
        .collect()
}

/// A decoded state is usable: every row reads, and two steps run.
fn use_state(fx: &Fixture, kv: &KvConfig, st: state::SavedState) {
    for l in 0..st.cache.n_layers() {
        let layer = st.cache.layer(l);
        for i in 0..layer.len() {
            assert!(layer
                .key(i)
                .iter()
                .chain(&layer.value(i))
                .all(|x| x.is_finite()));
        }
    }
    let mut s = fx.model.session(kv);
    s.cache = st.cache;
    let n = st.ids.len();
    let _ = fx.model.forward(&mut s, 3, n);
    let _ = fx.model.forward(&mut s, 4, n + 1);
}

#[test]
fn truncated_at_every_byte_is_refused() {
    let fx = bundled();
    for (kv, bytes) in small_states(&fx) {
        let cfg = &fx.files.config;
        for cut in 0..bytes.len() {
            let (p, msg) = problem(state::decode(&bytes[..cut], &fx.id, &kv, cfg));
            let want = if cut < 8 {
                Problem::Magic
            } else {
                Problem::Truncated
            };
            assert_eq!(p, want, "cut at {cut}: {msg}");
            // The same body with a header that agrees: the parser meets the end mid-section.
            if cut >= state::HEADER_LEN {
                let mut short = bytes[..cut].to_vec();
                state::reseal(&mut short);
                let (p, msg) = problem(state::decode(&short, &fx.id, &kv, cfg));
                assert!(
                    matches!(p, Problem::Malformed | Problem::Inconsistent),
                    "resealed cut at {cut}: {p:?} {msg}"
                );
            }
        }
    }
}

#[test]
fn flipped_bytes_are_refused_or_harmless() {
    let fx = bundled();
    let cfg = &fx.files.config;
    for (kv, bytes) in small_states(&fx) {
        for i in 0..bytes.len() {
            if i % 5 != 0 && i > 200 {
                continue;
            }
            let mut bad = bytes.clone();
            bad[i] ^= 0x10;
            let (p, msg) = problem(state::decode(&bad, &fx.id, &kv, cfg));
            let want = match i {
                0..8 => Problem::Magic,
                8..12 => Problem::Version,
                16..24 => p, // a length: Truncated or Malformed, checked below
                _ => Problem::Checksum,
            };
            assert_eq!(p, want, "byte {i}: {msg}");
            if (16..24).contains(&i) {
                assert!(
                    matches!(p, Problem::Truncated | Problem::Malformed),
                    "{msg}"
                );
            }
            // With a valid checksum: refused by a later check, or a state that works.
            state::reseal(&mut bad);
            match state::decode(&bad, &fx.id, &kv, cfg) {
                Ok(st) => use_state(&fx, &kv, st),
                Err(Error::State { .. }) => {}
                Err(e) => panic!("byte {i}: not a state error: {e}"),
            }
        }
    }
}

#[test]
fn another_model_version_or_configuration_is_refused() {
    let fx = bundled();
    let cfg = &fx.files.config;
    let (kv, bytes) = small_states(&fx).remove(0);
    state::decode(&bytes, &fx.id, &kv, cfg).unwrap();

    // Another model: the same weights with shared layers; one weight changed; converted weights.
    let mut shared = ModelFiles::open(None).unwrap();
    shared.config.num_kv_shared_layers = 3;
    let mut changed = ModelFiles::open(None).unwrap();
    let t = changed
        .tensors
        .get_mut("model.layers.0.mlp.up_proj.weight")
        .unwrap();
    let mut b = t.data.bytes().to_vec();
    b[0] ^= 1;
    t.data = TensorBytes::owned(&b);
    for other in [
        ModelIdentity::of(&shared).unwrap(),
        ModelIdentity::of(&changed).unwrap(),
        fx.id.clone().with_weights(WeightsDType::F32),
    ] {
        assert_ne!(other, fx.id);
        let (p, msg) = problem(state::decode(&bytes, &other, &kv, cfg));
        assert_eq!(p, Problem::Model, "{msg}");
        assert!(
            msg.contains(&format!("{:016x}", fx.id.fingerprint)),
            "{msg}"
        );
        assert!(!msg.contains('\n'), "{msg}");
    }
    assert_eq!(
        ModelIdentity::of(&ModelFiles::open(None).unwrap()).unwrap(),
        fx.id
    );

    // Another version.
    let mut v2 = bytes.clone();
    v2[8] = 2;
    let (p, msg) = problem(state::decode(&v2, &fx.id, &kv, cfg));
    assert_eq!(p, Problem::Version, "{msg}");
    assert!(
        msg.contains("version 2") && msg.contains("version 1"),
        "{msg}"
    );

    // Another configuration: each setting names its flag.
    let cases: Vec<(KvConfig, &str)> = vec![
        (
            KvConfig {
                precision: Precision::Int8,
                ..kv.clone()
            },
            "--kv-quantize-k",
        ),
        (
            KvConfig {
                v_precision: Some(Precision::Int4),
                ..kv.clone()
            },
            "--kv-quantize-v",
        ),
        (
            KvConfig {
                group_size: 4,
                ..kv.clone()
            },
            "--kv-group-size",
        ),
        (
            KvConfig {
                sink: 2,
                ..kv.clone()
            },
            "--streaming-llm-sink",
        ),
        (
            KvConfig {
                window: Some(8),
                ..kv.clone()
            },
            "--streaming-llm-window",
        ),
        (
            KvConfig {
                positions: PositionsMode::Cache,
                ..kv.clone()
            },
            "--streaming-llm-positions",
        ),
        (
            KvConfig {
                residual: 3,
                ..kv.clone()
            },
            "--kv-residual",
        ),
        (
            KvConfig {
                key_rope: KeyRope::Pre,
                ..kv.clone()
            },
            "--kv-key-rope",
        ),
        (
            KvConfig {
                rotation: KvRotation::None,
                ..kv.clone()
            },
            "--kv-rotation",
        ),
    ];
    for (other, flag) in cases {
        let (p, msg) = problem(state::decode(&bytes, &fx.id, &other, cfg));
        assert_eq!(p, Problem::Config, "{msg}");
        assert!(msg.contains(flag), "{flag}: {msg}");
    }
    // The same cache spelled otherwise is accepted.
    let same = KvConfig {
        k_precision: Some(Precision::Int4),
        rotation: KvRotation::Hadamard,
        ..kv.clone()
    };
    state::decode(&bytes, &fx.id, &same, cfg).unwrap();
}

/// Offset of the ids vector's count in `bytes` (a `small_states` state of `n` ids).
fn ids_offset(bytes: &[u8], ids: &[u32]) -> usize {
    let mut pat = (ids.len() as u64).to_le_bytes().to_vec();
    pat.extend(ids[0].to_le_bytes());
    bytes.windows(pat.len()).position(|w| w == pat).unwrap()
}

#[test]
fn huge_lengths_and_inconsistent_contents_are_refused() {
    let fx = bundled();
    let cfg = &fx.files.config;
    let (kv, bytes) = small_states(&fx).remove(0);
    let st = state::decode(&bytes, &fx.id, &kv, cfg).unwrap();
    let at = ids_offset(&bytes, &st.ids);
    let edit = |f: &dyn Fn(&mut Vec<u8>)| {
        let mut b = bytes.clone();
        f(&mut b);
        state::reseal(&mut b);
        problem(state::decode(&b, &fx.id, &kv, cfg))
    };
    for huge in [u64::MAX, 1 << 40, (bytes.len() as u64) / 4 + 1] {
        let (p, msg) = edit(&|b| b[at..at + 8].copy_from_slice(&huge.to_le_bytes()));
        assert_eq!(p, Problem::Malformed, "{huge}: {msg}");
        assert!(msg.contains("the token ids"), "{msg}");
    }
    // The model name's length (right after fingerprint, parameters, weights dtype).
    let (p, msg) = edit(&|b| b[41..49].copy_from_slice(&u64::MAX.to_le_bytes()));
    assert_eq!(p, Problem::Malformed, "{msg}");
    // The first layer's first position vector: past its count, a count of 2^62.
    let n = st.ids.len();
    let layers_at = bytes.len() - bytes[at..].len() + 8 + 4 * n + 1 + 8 + 4 * cfg.vocab_size + 4;
    assert_eq!(bytes[layers_at - 4..layers_at], 6u32.to_le_bytes());
    assert_eq!(bytes[layers_at..layers_at + 8], (n as u64).to_le_bytes());
    let (p, msg) =
        edit(&|b| b[layers_at + 8..layers_at + 16].copy_from_slice(&(1u64 << 62).to_le_bytes()));
    assert_eq!(p, Problem::Malformed, "{msg}");
    assert!(msg.contains("layer 0 prefix positions"), "{msg}");
    // Fewer ids than rows appended.
    let (p, msg) = edit(&|b| {
        b[at..at + 8].copy_from_slice(&((n - 1) as u64).to_le_bytes());
        b.drain(at + 8 + 4 * (n - 1)..at + 8 + 4 * n);
    });
    assert_eq!(p, Problem::Inconsistent, "{msg}");
    assert!(msg.contains(&format!("appended {n} rows")), "{msg}");
    // An id outside the vocabulary.
    let (p, msg) = edit(&|b| b[at + 8..at + 12].copy_from_slice(&u32::MAX.to_le_bytes()));
    assert_eq!(p, Problem::Inconsistent, "{msg}");
    // Bytes after the last section.
    let (p, msg) = edit(&|b| b.push(0));
    assert_eq!(p, Problem::Malformed, "{msg}");
    // Not a state at all.
    let (p, _) = problem(state::decode(
        b"GGUF\x03\0\0\0 and more bytes",
        &fx.id,
        &kv,
        cfg,
    ));
    assert_eq!(p, Problem::Magic);
}

#[test]
fn a_cache_holding_rows_is_not_saved() {
    let fx = bundled();
    let kv = int4_window();
    let ids = tokens(9, fx.files.config.vocab_size);
    let mut s = prefill(&fx, &kv, &ids[..5]);
    s.cache.hold();
    fx.model.forward_batch(&mut s, &ids[5..], 5, None).unwrap();
    let (p, msg) = problem(state::encode(&fx.id, &kv, &ids, &s.cache));
    assert_eq!(p, Problem::Busy, "{msg}");
    s.cache.release(2);
    let bytes = state::encode(&fx.id, &kv, &ids[..7], &s.cache).unwrap();
    let st = state::decode(&bytes, &fx.id, &kv, &fx.files.config).unwrap();
    let want = prefill(&fx, &kv, &ids[..7]);
    assert_eq!(format!("{:?}", st.cache), format!("{:?}", want.cache));
    // The ids must be the rows appended.
    let (p, _) = problem(state::encode(&fx.id, &kv, &ids[..6], &s.cache));
    assert_eq!(p, Problem::Inconsistent);
}

#[test]
fn prefix_rule() {
    state::check_prefix(&[1, 2], &[1, 2, 3]).unwrap();
    state::check_prefix(&[1, 2], &[1, 2]).unwrap();
    state::check_prefix(&[], &[7]).unwrap();
    let (p, msg) = problem(state::check_prefix(&[1, 2, 3], &[1, 5, 3, 4]));
    assert_eq!(p, Problem::Prefix);
    assert!(
        msg.contains("at token 1") && msg.contains("id 2 in the state, 5 in the prompt"),
        "{msg}"
    );
    let (p, msg) = problem(state::check_prefix(&[1, 2, 3], &[1, 2]));
    assert_eq!(p, Problem::Prefix);
    assert!(msg.contains("more than the prompt's 2"), "{msg}");
}

#[test]
fn files_are_written_whole_and_errors_name_them() {
    let fx = bundled();
    let cfg = &fx.files.config;
    let kv = KvConfig::default();
    let ids = tokens(6, cfg.vocab_size);
    let s = prefill(&fx, &kv, &ids);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.state");
    state::save(&path, &fx.id, &kv, &ids, &s.cache).unwrap();
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["a.state"], "no temporary file left");
    let st = state::load(&path, &fx.id, &kv, cfg).unwrap();
    assert_eq!(st.ids, ids);
    // Overwritten in place, still whole.
    state::save(&path, &fx.id, &kv, &ids, &s.cache).unwrap();
    assert_eq!(
        std::fs::read(&path).unwrap(),
        state::encode(&fx.id, &kv, &ids, &s.cache).unwrap()
    );
    // Errors name the file.
    let other = KvConfig {
        precision: Precision::Fp16,
        ..kv.clone()
    };
    let e = state::load(&path, &fx.id, &other, cfg)
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with(&path.display().to_string()) && e.contains("--kv-quantize-k"),
        "{e}"
    );
    let missing = dir.path().join("no/such/dir/b.state");
    let e = state::save(&missing, &fx.id, &kv, &ids, &s.cache)
        .unwrap_err()
        .to_string();
    assert!(e.contains("b.state"), "{e}");
    assert!(state::load(&dir.path().join("none.state"), &fx.id, &kv, cfg).is_err());
    std::fs::write(dir.path().join("junk.state"), b"hello").unwrap();
    let (p, msg) = problem(state::load(
        &dir.path().join("junk.state"),
        &fx.id,
        &kv,
        cfg,
    ));
    assert_eq!(p, Problem::Magic);
    assert!(msg.contains("junk.state"), "{msg}");
}

/// The fuzz target's seeds (fuzz/make_state_seeds.sh) are states of this format: each
/// decodes with the configuration it records, as the target decodes them.
#[test]
fn fuzz_seeds_decode() {
    let fx = bundled();
    let mut n = 0;
    for f in std::fs::read_dir(root().join("fuzz/seeds_state_decode")).unwrap() {
        let path = f.unwrap().path();
        let data = std::fs::read(&path).unwrap();
        assert_eq!(data[0], 1, "{}: the mode byte", path.display());
        let kv = state::peek_config(&data[1..]).unwrap();
        let st = state::decode(&data[1..], &fx.id, &kv, &fx.files.config)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(st.logits.is_some() && !st.ids.is_empty());
        use_state(&fx, &kv, st);
        n += 1;
    }
    assert!(n >= 6, "{n} seeds");
}

fn sample(args: &[&str]) -> std::process::Output {
    cli().arg("sample").args(args).output().unwrap()
}

#[test]
fn cli_save_and_load_state() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("s.state");
    let f = f.to_str().unwrap();
    let head = "The os module provides";
    let whole = "The os module provides a portable way of using operating system";
    // (tokens, K/V precision, extra flags)
    let run_with = |prompt: &str, tokens: &str, kv: &str, extra: &[&str]| {
        let mut a = vec!["--prompt", prompt, "--tokens", tokens, "--kv-quantize", kv];
        a.extend(["--temperature", "0.8", "--seed", "11", "--json"]);
        a.extend(["--streaming-llm-sink", "4", "--streaming-llm-window", "16"]);
        a.extend(extra);
        sample(&a)
    };
    let run = |prompt: &str, extra: &[&str]| run_with(prompt, "12", "int4", extra);
    let saved = json_of(&run_with(head, "0", "int4", &["--save-state", f]));
    let head_ids = ids(&saved["prompt_ids"]);
    assert_eq!(saved["prompt_tokens_reused"], 0);
    let plain = json_of(&run(whole, &[]));
    assert_eq!(
        prefix_match(&ids(&plain["prompt_ids"]), &head_ids),
        head_ids.len(),
        "the longer prompt starts with the shorter's ids"
    );
    let resumed = json_of(&run(whole, &["--load-state", f]));
    assert_eq!(resumed["generated_ids"], plain["generated_ids"]);
    assert_eq!(resumed["prompt_tokens_reused"], head_ids.len());
    // The prompt the state holds exactly: sampled from the saved logits.
    let exact = json_of(&run(head, &["--load-state", f]));
    assert_eq!(
        exact["generated_ids"],
        json_of(&run(head, &[]))["generated_ids"]
    );
    // Saved after generating, resumed with the same tokens: the state holds the prompt and
    // every generated token but the last.
    let g = dir.path().join("g.state");
    let g = g.to_str().unwrap();
    let first = json_of(&run(whole, &["--save-state", g]));
    let n = ids(&first["prompt_ids"]).len() + ids(&first["generated_ids"]).len() - 1;
    let bytes = std::fs::read(g).unwrap();
    assert!(bytes.starts_with(&state::MAGIC));
    // Errors: another prompt, another cache flag; one line each, naming the file.
    let out = run("Something else entirely", &["--load-state", f]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("s.state") && err.contains("differ from the prompt's at token"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    let out = run_with(whole, "12", "int8", &["--load-state", f]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--kv-quantize-k is int4 in the state, int8"),
        "{err}"
    );
    let out = run(whole, &["--load-state", g]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains(&format!("holds {n} tokens")),
        "{err}"
    );
}
