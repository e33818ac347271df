//! Reference = engine, bit for bit (issue 24; docs/design.md §2.1, §6). The scalar
//! reference computes every float reduction in the engine's canonical order
//! (`tinygpt_reference::order`), so the two give identical logits, identical K/V rows and
//! identical perplexity bits, not just agreement within a budget.
//!
//! The engine's KIVI attention kernels come in variants (`--kv-kernel`, design §2.3): the
//! reference writes out the `portable` order, which `avx512-exact` follows bit for bit, so
//! every engine model here is loaded with the fastest of those two the CPU supports
//! (`ExecOptions::exact`; this test's own `TINYGPT_KV_KERNEL` may name another exact one).

mod common;
use common::*;
use tinygpt_cpu::eval::perplexity;
use tinygpt_cpu::exec::{ExecOptions, KvKernelChoice};
use tinygpt_cpu::generate::{Engine, EngineRun, ReferenceRun};
use tinygpt_cpu::kivi::KvKernel;
use tinygpt_cpu::kv_cache::{KeyRope, KvConfig, PositionsMode, Precision};
use tinygpt_cpu::model::{reference_model, Model, WeightsDType};
use tinygpt_cpu::weights::ModelFiles;
use tinygpt_reference::order;

/// The options every engine model here is loaded with: the fastest KIVI kernels that add
/// in the reference's order (`KvKernel::is_exact`), unless `TINYGPT_KV_KERNEL` names
/// another exact one this CPU has. Asserts that they are exact.
fn exact() -> ExecOptions {
    let named = std::env::var("TINYGPT_KV_KERNEL")
        .ok()
        .and_then(|s| KvKernel::from_name(s.trim()))
        .filter(|k| k.is_exact() && k.is_supported());
    let opts = ExecOptions {
        kv_kernel: named.map_or(KvKernelChoice::Exact, KvKernelChoice::Named),
        ..ExecOptions::default()
    };
    let k = opts.kv_kernel.resolve();
    assert!(k.is_exact(), "KIVI kernels `{}` are not exact", k.name());
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| eprintln!("KIVI kernels: {}", k.name()));
    opts
}

/// [`Model::load_opts`] with [`exact`].
fn load(files: &ModelFiles, dtype: WeightsDType) -> Model {
    Model::load_opts(files, dtype, &exact()).unwrap()
}

/// Deterministic pseudo-random f32s in `[-scale, scale)`.
fn noise(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The reference's scalar `exp` is the engine's vector `exp`, bit for bit, over the whole
/// range softmax and SwiGLU use (and past it, where both give 0).
#[test]
fn exp_equals_the_vector_exp() {
    let mut xs: Vec<f32> = (-1_000_000..=1_000_000).map(|i| i as f32 * 1e-4).collect();
    xs.extend(noise(100_000, 1, 90.0));
    xs.extend([f32::NEG_INFINITY, -87.3, -87.29, 87.29, 87.3, 0.0, -0.0]);
    for c in xs.chunks_exact(8) {
        let a: [f32; 8] = c.try_into().unwrap();
        let want = wide::f32x8::from(a).exp().to_array();
        for (x, w) in a.iter().zip(want) {
            assert_eq!(order::exp(*x).to_bits(), w.to_bits(), "exp({x:e})");
        }
    }
}

/// Weight rows (`dot8`, against the float kernels' scalar twin, which every variant equals:
/// `tests/float_dispatch.rs`), RMSNorm's sum of squares (`dot_norm`) and softmax: the
/// reference's loops against the engine's, every length 1..=300.
#[test]
fn reductions_equal_the_engine_kernels() {
    for n in 1..=300 {
        let (a, b) = (noise(n, n as u64, 3.0), noise(n, 7 * n as u64, 2.0));
        let want = tinygpt_cpu::wkernels::scalar::float_row(&a, &b);
        assert_eq!(order::dot8(&a, &b).to_bits(), want.to_bits(), "dot8 n={n}");
        let want = tinygpt_cpu::ops::simd::dot(&a, &b);
        assert_eq!(
            order::dot_norm(&a, &b).to_bits(),
            want.to_bits(),
            "dot_norm n={n}"
        );
        let mut e = a.iter().map(|x| x * 4.0).collect::<Vec<_>>();
        e[n / 2] = f32::NEG_INFINITY;
        let mut r = e.clone();
        tinygpt_cpu::attention::softmax(&mut e, exact().kv_kernel.resolve());
        tinygpt_reference::attention::softmax(&mut r);
        assert_eq!(bits(&e), bits(&r), "softmax n={n}");
    }
}

fn tokens(files: &ModelFiles, n: usize) -> Vec<u32> {
    let text = std::fs::read_to_string(fixtures().join("heldout.txt")).unwrap();
    let start = text.len() / 3;
    let start = (start..text.len())
        .find(|&i| text.is_char_boundary(i) && text[..i].ends_with('\n'))
        .unwrap();
    let mut t = files.tokenizer().unwrap().encode(&text[start..]).unwrap();
    t.truncate(n);
    assert_eq!(t.len(), n, "held-out text too short");
    t
}

/// Runs `toks` through both with `kv`: identical logits at every step, identical
/// perplexity bits.
fn assert_identical(
    engine: &Model,
    reference: &tinygpt_reference::Model,
    kv: &KvConfig,
    toks: &[u32],
    what: &str,
) {
    let mut e = EngineRun::new(engine, kv);
    let mut r = ReferenceRun::new(reference, kv);
    for (pos, &t) in toks.iter().enumerate() {
        let a = bits(e.forward(t, pos).unwrap());
        let b = bits(r.forward(t, pos).unwrap());
        if a != b {
            let i = a.iter().zip(&b).position(|(x, y)| x != y).unwrap();
            panic!(
                "{what} {}: logits differ at step {pos}, logit {i}: engine {} reference {}",
                kv.quant_name(),
                f32::from_bits(a[i]),
                f32::from_bits(b[i])
            );
        }
    }
    let pe = perplexity(
        &mut EngineRun::new(engine, kv),
        toks,
        toks.len(),
        false,
        &mut |_| {},
    )
    .unwrap()
    .0
    .ppl;
    let pr = perplexity(
        &mut ReferenceRun::new(reference, kv),
        toks,
        toks.len(),
        false,
        &mut |_| {},
    )
    .unwrap()
    .0
    .ppl;
    assert_eq!(
        pe.to_bits(),
        pr.to_bits(),
        "{what} {}: perplexity {pe} vs {pr}",
        kv.quant_name()
    );
}

/// The float caches (fp32, fp16, bf16), dense and under StreamingLLM in both position
/// modes, pre-RoPE keys: on the bundled model (head_dim 32, GQA 2).
#[test]
fn bundled_model_float_caches_are_identical() {
    let files = ModelFiles::open(Some(&fixtures().join("tiny"))).unwrap();
    let engine = load(&files, WeightsDType::F32);
    let reference = reference_model(&files, WeightsDType::F32).unwrap();
    let toks = tokens(&files, 96);
    for precision in [Precision::Fp32, Precision::Fp16, Precision::Bf16] {
        for (window, positions, key_rope) in [
            (None, PositionsMode::Original, KeyRope::Post),
            (None, PositionsMode::Original, KeyRope::Pre),
            (Some(40), PositionsMode::Original, KeyRope::Post),
            (Some(40), PositionsMode::Cache, KeyRope::Post),
        ] {
            let kv = KvConfig {
                precision,
                sink: if window.is_some() { 4 } else { 0 },
                window,
                positions,
                key_rope,
                ..KvConfig::default()
            };
            assert_identical(&engine, &reference, &kv, &toks, "bundled");
        }
    }
}

/// The KIVI cache modes of the exact matrix: every width, asymmetric K/V, a residual,
/// pre-RoPE keys, StreamingLLM in both position modes, group sizes 16/32/64, with and
/// without the Hadamard rotation.
fn kivi_modes(window: usize) -> Vec<KvConfig> {
    use tinygpt_cpu::kv_cache::KvRotation;
    let mut out = Vec::new();
    let mut push = |kv: KvConfig| out.push(kv);
    for precision in [Precision::Int8, Precision::Int4, Precision::Int2] {
        for rotation in [KvRotation::Auto, KvRotation::None] {
            push(KvConfig {
                precision,
                rotation,
                ..KvConfig::default()
            });
        }
        for positions in [PositionsMode::Original, PositionsMode::Cache] {
            push(KvConfig {
                precision,
                sink: 4,
                window: Some(window),
                positions,
                ..KvConfig::default()
            });
        }
    }
    for (k, v, residual, key_rope, group_size) in [
        (Precision::Int8, Precision::Int4, 0, KeyRope::Post, 32),
        (Precision::Int4, Precision::Int2, 16, KeyRope::Pre, 32),
        (Precision::Int4, Precision::Int4, 0, KeyRope::Pre, 16),
        (Precision::Int2, Precision::Int2, 32, KeyRope::Post, 64),
        (Precision::Int4, Precision::Int4, 8, KeyRope::Post, 16),
        (Precision::Fp16, Precision::Int4, 0, KeyRope::Post, 32),
        (Precision::Int8, Precision::Bf16, 0, KeyRope::Post, 64),
    ] {
        push(KvConfig {
            precision: k,
            k_precision: Some(k),
            v_precision: Some(v),
            residual,
            key_rope,
            group_size,
            ..KvConfig::default()
        });
    }
    out
}

/// Every KIVI mode on the bundled model (head_dim 32, GQA 2): 96 tokens, so K groups of
/// 16/32/64 complete and a 40-row window evicts.
#[test]
fn bundled_model_kivi_caches_are_identical() {
    let files = ModelFiles::open(Some(&fixtures().join("tiny"))).unwrap();
    let engine = load(&files, WeightsDType::F32);
    let reference = reference_model(&files, WeightsDType::F32).unwrap();
    let toks = tokens(&files, 96);
    for kv in kivi_modes(40) {
        assert_identical(&engine, &reference, &kv, &toks, "bundled");
    }
}

/// The engine in a pool of `n` threads (2: the decode team).
fn pool(n: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(n)
        .build()
        .unwrap()
}

/// Runs `toks` through the reference once and the engine on 1 and 2 threads, comparing
/// the logits bit for bit at every step (so perplexity and greedy choices agree too), then
/// a greedy continuation of `greedy` tokens from the first 8: identical ids.
fn assert_identical_threads(
    engine: &Model,
    reference: &tinygpt_reference::Model,
    kv: &KvConfig,
    toks: &[u32],
    greedy_n: usize,
    what: &str,
) {
    let (p1, p2) = (pool(1), pool(2));
    let mut r = ReferenceRun::new(reference, kv);
    let mut e1 = EngineRun::new(engine, kv);
    let mut e2 = EngineRun::new(engine, kv);
    let name = kv.quant_name();
    let window = kv.window.map_or("dense".to_string(), |w| {
        format!("sink {} window {w} {}", kv.sink, kv.positions.name())
    });
    for (pos, &t) in toks.iter().enumerate() {
        let want = bits(r.forward(t, pos).unwrap());
        for (threads, p, e) in [(1, &p1, &mut e1), (2, &p2, &mut e2)] {
            let got = p.install(|| bits(e.forward(t, pos).unwrap()));
            if got != want {
                let i = got.iter().zip(&want).position(|(x, y)| x != y).unwrap();
                panic!(
                    "{what} {name} G{} {window}, {threads} thread(s): logits differ at step {pos}, logit {i}: engine {} reference {}",
                    kv.group_size,
                    f32::from_bits(got[i]),
                    f32::from_bits(want[i])
                );
            }
        }
    }
    if greedy_n > 0 {
        let prompt = &toks[..8];
        let g_r = greedy(&mut ReferenceRun::new(reference, kv), prompt, greedy_n);
        let g_e = p2.install(|| greedy(&mut EngineRun::new(engine, kv), prompt, greedy_n));
        assert_eq!(g_e.ids, g_r.ids, "{what} {name} {window}: greedy ids");
    }
    eprintln!(
        "{what} {name} G{} {window}: identical over {} tokens",
        kv.group_size,
        toks.len()
    );
}

/// SmolLM2 (head_dim 64, GQA 3, 30 layers) with f32 weights: every cache precision and the
/// KIVI variations, 128 tokens (K groups of 16 and 32 complete and fill again; StreamingLLM
/// with a 24-row window evicts from token 28 on), engine on 1 and 2 threads; native (Q4_1)
/// weights and YOCO sharing on a few modes. The CI cut of [`smollm2_full_matrix`].
#[test]
fn smollm2_cache_modes_are_identical() {
    let Some(p) = smollm2_path() else { return };
    run_smollm2(&p, 128, &smollm2_modes(false), 8, false);
}

/// The full matrix (every precision dense and under StreamingLLM in both position modes;
/// asymmetric, residual, pre-RoPE, groups 16/32/64 with a residual and with pre-RoPE
/// unrotated keys, no rotation; native and YOCO with four precisions; 128 tokens). Run by
/// hand:
/// `cargo test --release --test ref_exact -- --ignored --nocapture`.
#[test]
#[ignore = "slow (the scalar reference on SmolLM2, 38 runs); run by hand"]
fn smollm2_full_matrix() {
    let Some(p) = smollm2_path() else { return };
    run_smollm2(&p, 128, &smollm2_modes(true), 16, true);
}

fn smollm2_modes(full: bool) -> Vec<KvConfig> {
    use tinygpt_cpu::kv_cache::KvRotation;
    let mut out = Vec::new();
    let windows: &[(Option<usize>, PositionsMode)] = if full {
        &[
            (None, PositionsMode::Original),
            (Some(24), PositionsMode::Original),
            (Some(24), PositionsMode::Cache),
        ]
    } else {
        &[(None, PositionsMode::Original)]
    };
    let mut kivi = vec![];
    for precision in Precision::ALL {
        kivi.push(KvConfig {
            precision,
            ..KvConfig::default()
        });
    }
    kivi.extend([
        KvConfig {
            precision: Precision::Int8,
            v_precision: Some(Precision::Int4),
            ..KvConfig::default()
        },
        KvConfig {
            precision: Precision::Int2,
            residual: 32,
            ..KvConfig::default()
        },
        KvConfig {
            precision: Precision::Int4,
            key_rope: KeyRope::Pre,
            group_size: 16,
            ..KvConfig::default()
        },
    ]);
    if full {
        kivi.extend([
            KvConfig {
                precision: Precision::Int4,
                group_size: 16,
                residual: 8,
                ..KvConfig::default()
            },
            KvConfig {
                precision: Precision::Int8,
                group_size: 64,
                ..KvConfig::default()
            },
            KvConfig {
                precision: Precision::Int4,
                rotation: KvRotation::None,
                ..KvConfig::default()
            },
        ]);
    }
    if full {
        for g in [16, 32, 64] {
            kivi.push(KvConfig {
                precision: Precision::Int4,
                group_size: g,
                residual: 16,
                ..KvConfig::default()
            });
            kivi.push(KvConfig {
                precision: Precision::Int4,
                group_size: g,
                key_rope: KeyRope::Pre,
                rotation: KvRotation::None,
                ..KvConfig::default()
            });
        }
    }
    for (i, kv) in kivi.into_iter().enumerate() {
        // StreamingLLM for the six plain precisions; the variations dense.
        let windows = if i < Precision::ALL.len() {
            windows
        } else {
            &windows[..1]
        };
        for &(window, positions) in windows {
            out.push(KvConfig {
                sink: if window.is_some() { 4 } else { 0 },
                window,
                positions,
                ..kv.clone()
            });
        }
    }
    if !full {
        // StreamingLLM in both position modes, int4.
        for positions in [PositionsMode::Original, PositionsMode::Cache] {
            out.push(KvConfig {
                precision: Precision::Int4,
                sink: 4,
                window: Some(24),
                positions,
                ..KvConfig::default()
            });
        }
    }
    out
}

fn run_smollm2(path: &std::path::Path, n: usize, modes: &[KvConfig], greedy_n: usize, full: bool) {
    let files = ModelFiles::open(Some(path)).unwrap();
    let toks = tokens(&files, n);
    let t0 = std::time::Instant::now();
    // f32 weights; native Q4_1 weights (integer block dots with 8-bit activations, design
    // §2.2); YOCO: the upper 10 of 30 layers read layer 19's K/V.
    let mut shared = ModelFiles::open(Some(path)).unwrap();
    shared.config.num_kv_shared_layers = 10;
    let pairs = [
        ("smollm2 f32", &files, WeightsDType::F32),
        ("smollm2 native", &files, WeightsDType::Native),
        ("smollm2 yoco", &shared, WeightsDType::F32),
    ]
    .map(|(what, f, dtype)| (what, load(f, dtype), reference_model(f, dtype).unwrap()));
    let (native, yoco): (&[Precision], &[Precision]) = if full {
        let four = &[
            Precision::Fp32,
            Precision::Int8,
            Precision::Int4,
            Precision::Int2,
        ];
        (four, four)
    } else {
        (&[Precision::Fp32, Precision::Int4], &[Precision::Int4])
    };
    // (which pair, cache, greedy tokens): greedy runs on every fifth f32 mode (each costs
    // the reference greedy_n tokens).
    let mut jobs: Vec<(usize, KvConfig, usize)> = modes
        .iter()
        .enumerate()
        .map(|(i, kv)| (0, kv.clone(), if i % 5 == 0 { greedy_n } else { 0 }))
        .collect();
    for (pair, precisions) in [(1, native), (2, yoco)] {
        for &precision in precisions {
            let kv = KvConfig {
                precision,
                ..KvConfig::default()
            };
            jobs.push((pair, kv, 0));
        }
    }
    // The jobs are independent (each its own runs and caches): two at a time, so the
    // 2-core CI machine runs two scalar references at once. Each job compares exactly as
    // alone; the engine's second run is in its own 2-thread pool.
    on_two_workers(&jobs, |(pair, kv, g)| {
        let (what, engine, reference) = &pairs[*pair];
        assert_identical_threads(engine, reference, kv, &toks, *g, what);
    });
    eprintln!(
        "smollm2: {} f32 modes, {} native, {} YOCO over {n} tokens in {:.0?}",
        modes.len(),
        native.len(),
        yoco.len(),
        t0.elapsed()
    );
}

/// The tiny GGUF architecture fixtures (fixtures/make_gguf_archs.py): Qwen2 (q/k/v biases,
/// head_dim 32, MQA), Qwen3 (per-head q/k norms, head_dim 64 with GQA 2, and 256 with MQA),
/// Gemma 3 (sandwich norms, GeGLU, sliding layers with their own RoPE base): fp32, fp16,
/// int8 and int4 (dense and StreamingLLM), 64 tokens.
#[test]
fn arch_fixtures_are_identical() {
    for arch in ["qwen2", "qwen3", "qwen3-hd256-mqa", "gemma3"] {
        let path = fixtures().join(format!("archs/{arch}/{arch}.gguf"));
        let files = ModelFiles::open(Some(&path)).unwrap();
        let engine = load(&files, WeightsDType::F32);
        let reference = reference_model(&files, WeightsDType::F32).unwrap();
        let toks = tokens(&files, 64);
        for precision in [
            Precision::Fp32,
            Precision::Fp16,
            Precision::Int8,
            Precision::Int4,
        ] {
            for window in [None, Some(24)] {
                let kv = KvConfig {
                    precision,
                    sink: if window.is_some() { 4 } else { 0 },
                    window,
                    ..KvConfig::default()
                };
                assert_identical(&engine, &reference, &kv, &toks, arch);
            }
        }
    }
}
