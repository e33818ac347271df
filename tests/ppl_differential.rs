//! Engine vs reference *perplexity* through the cached decode path, for every KV precision,
//! with and without StreamingLLM, on two model shapes: the bundled model (head_dim 32,
//! 4 query heads over 2 KV heads) and SmolLM2-135M (head_dim 64, 9 query heads over 3 KV
//! heads, 30 layers; f32 weights so that the weights are not a source of difference).
//!
//! Exactness (design §2.4, §6). The reference adds every reduction in the order of the
//! engine's `portable` KIVI kernels, which `avx512-exact` follows bit for bit: under those
//! (this test's knob `TINYGPT_KV_KERNEL=portable`, `avx512-exact` or `exact`, passed to
//! the engine as its `ExecOptions::kv_kernel`) the two perplexities must be
//! **identical bits** (`exact_kernels`). The default `avx512` kernels (and `avx2`, `neon`)
//! add their partial sums in other orders (design §2.3), so their K/V values differ in the
//! last bits; under KIVI a value next to a code boundary then rounds the other way in one
//! of them, a whole quantisation step, and the difference cascades through later layers
//! and tokens. Under those kernels the budget therefore grows with the step:
//!
//! * fp32 / fp16 / bf16: the relative perplexity difference stays at float-rounding level.
//! * int8 / int4: it is bounded by a fraction of what the quantisation itself costs, and is
//!   measured over enough tokens to average the flips out. Measured (2026-12-01, x86_64,
//!   `avx512`): bundled model ≤ 1.4e-5 (int8) and ≤ 5.9e-5 (int4); SmolLM2
//!   5.8e-4 (int8) and 4.6e-3 / 7.6e-3 (int4 dense / sink 4 + window 40, where int4 itself
//!   costs ~4% over fp32 on these 96 tokens). The budgets are 2.5-3.5× the largest of
//!   those, to leave room for machines whose kernels round differently (no FMA, other
//!   vector widths). This test guards the model-level wiring (heads, GQA groups, layers,
//!   positions).
//!
//! Both sides must also be finite, and each KIVI run must stay within a sanity bound of the
//! same engine's fp32 run.

mod common;
use common::*;
use std::path::Path;
use tinygpt_cpu::eval::perplexity;
use tinygpt_cpu::exec::ExecOptions;
use tinygpt_cpu::generate::{Engine, EngineRun, ReferenceRun};
use tinygpt_cpu::kv_cache::{KeyRope, KvConfig, KvRotation, PositionsMode, Precision};
use tinygpt_cpu::model::{reference_model, Model, WeightsDType};
use tinygpt_cpu::weights::ModelFiles;

/// The engine's options (`common::kv_kernel_opts`: this test's `TINYGPT_KV_KERNEL`, else
/// the fast kernels).
fn opts() -> ExecOptions {
    kv_kernel_opts()
}

/// Whether the engine's KIVI kernels add in the reference's order (then the perplexities
/// must be identical bits).
fn exact_kernels() -> bool {
    opts().kv_kernel.resolve().is_exact()
}

/// Relative perplexity difference allowed between the engine and the reference (0: the
/// bits must be identical).
fn budget(kv: &KvConfig) -> f64 {
    if exact_kernels() {
        return 0.0;
    }
    // The coarser side sets the step.
    let (k, v) = (kv.key_precision(), kv.value_precision());
    budget_of(k).max(budget_of(v))
}

fn budget_of(p: Precision) -> f64 {
    match p {
        Precision::Fp32 | Precision::Fp16 | Precision::Bf16 => 2e-5,
        Precision::Int8 => 2e-3,
        Precision::Int4 => 2e-2,
        Precision::Int2 => 5e-2,
    }
}

/// A KIVI run may not cost more than this (relative) over fp32 on these texts.
fn quant_sanity(kv: &KvConfig) -> f64 {
    let of = |p: Precision| -> f64 {
        match p {
            Precision::Int8 => 0.01,
            Precision::Int4 => 0.08,
            Precision::Int2 => 0.5,
            _ => 0.01,
        }
    };
    of(kv.key_precision()).max(of(kv.value_precision()))
}

fn tokens(files: &ModelFiles, n: usize) -> Vec<u32> {
    let text = std::fs::read_to_string(fixtures().join("heldout.txt")).unwrap();
    // Skip the licence header: start at a later, ordinary paragraph.
    let start = text.len() / 3;
    let start = (start..text.len())
        .find(|&i| text.is_char_boundary(i) && text[..i].ends_with('\n'))
        .unwrap();
    let mut t = files.tokenizer().unwrap().encode(&text[start..]).unwrap();
    t.truncate(n);
    assert_eq!(t.len(), n, "held-out text too short");
    t
}

fn ppl(run: &mut dyn Engine, toks: &[u32]) -> f64 {
    let (r, _) = perplexity(run, toks, toks.len(), false, &mut |_| {}).unwrap();
    assert!(r.ppl.is_finite(), "non-finite perplexity");
    r.ppl
}

fn caches(window: usize) -> Vec<KvConfig> {
    let mut out = Vec::new();
    for precision in Precision::ALL {
        out.push(KvConfig {
            precision,
            ..KvConfig::default()
        });
        for positions in [PositionsMode::Original, PositionsMode::Cache] {
            out.push(KvConfig {
                precision,
                sink: 4,
                window: Some(window),
                positions,
                ..KvConfig::default()
            });
        }
    }
    // KIVI past the paper's defaults: a residual window, asymmetric bits, pre-RoPE keys.
    for (k, v, residual, key_rope) in [
        (Precision::Int4, Precision::Int4, 32, KeyRope::Post),
        (Precision::Int2, Precision::Int2, 32, KeyRope::Post),
        (Precision::Int8, Precision::Int4, 0, KeyRope::Post),
        (Precision::Int4, Precision::Int2, 16, KeyRope::Pre),
        (Precision::Int4, Precision::Int4, 0, KeyRope::Pre),
    ] {
        for w in [None, Some(window)] {
            out.push(KvConfig {
                precision: k,
                k_precision: Some(k),
                v_precision: Some(v),
                residual,
                key_rope,
                sink: if w.is_some() { 4 } else { 0 },
                window: w,
                ..KvConfig::default()
            });
        }
    }
    // Hadamard-rotated K/V (§2.5): post- and pre-RoPE keys, with and without a residual.
    for (precision, residual, key_rope) in [
        (Precision::Int8, 0, KeyRope::Post),
        (Precision::Int4, 0, KeyRope::Post),
        (Precision::Int4, 0, KeyRope::Pre),
        (Precision::Int2, 32, KeyRope::Post),
    ] {
        for w in [None, Some(window)] {
            out.push(KvConfig {
                precision,
                residual,
                key_rope,
                rotation: KvRotation::Hadamard,
                sink: if w.is_some() { 4 } else { 0 },
                window: w,
                ..KvConfig::default()
            });
        }
    }
    out
}

fn label(kv: &KvConfig) -> String {
    let (k, v) = (kv.key_precision(), kv.value_precision());
    let mut s = if k == v {
        k.name().to_string()
    } else {
        format!("K {} V {}", k.name(), v.name())
    };
    if kv.residual > 0 {
        s += &format!(" R {}", kv.residual);
    }
    if kv.key_rope == KeyRope::Pre {
        s += " pre-RoPE K";
    }
    if kv.rotation == KvRotation::Hadamard {
        s += " rotated";
    }
    match kv.window {
        None => s + " dense",
        Some(w) => format!("{s} sink {} window {w} {}", kv.sink, kv.positions.name()),
    }
}

fn run_table(path: &Path, n_tokens: usize, kvs: &[KvConfig]) {
    let files = ModelFiles::open(Some(path)).unwrap();
    let engine = Model::load_opts(&files, WeightsDType::F32, &opts()).unwrap();
    let reference = reference_model(&files, WeightsDType::F32).unwrap();
    let toks = tokens(&files, n_tokens);
    // Every cache mode's pair of runs on two workers (the reference is the slow side),
    // then the checks in table order.
    let runs: Vec<std::sync::OnceLock<(f64, f64)>> =
        kvs.iter().map(|_| std::sync::OnceLock::new()).collect();
    let jobs: Vec<usize> = (0..kvs.len()).collect();
    on_two_workers(&jobs, |&i| {
        let e = ppl(&mut EngineRun::new(&engine, &kvs[i]), &toks);
        let r = ppl(&mut ReferenceRun::new(&reference, &kvs[i]), &toks);
        runs[i].set((e, r)).expect("each cache mode runs once");
    });
    let mut failures = Vec::new();
    let mut fp32 = std::collections::HashMap::new();
    for (kv, run) in kvs.iter().zip(&runs) {
        let (e, r) = *run.get().expect("every cache mode ran");
        let rel = (e / r - 1.0).abs();
        let key = (kv.window, kv.positions);
        if kv.precision == Precision::Fp32 && !kv.is_kivi() {
            fp32.insert(key, e);
        }
        let cost = fp32.get(&key).map_or(0.0, |f| e / f - 1.0);
        eprintln!(
            "{} {:<36} engine {e:>10.5} reference {r:>10.5} rel diff {rel:.2e} (budget {:.0e}), vs fp32 {:+.3}%",
            path.file_name().unwrap().to_string_lossy(),
            label(kv),
            budget(kv),
            cost * 100.0
        );
        if rel > budget(kv) || (budget(kv) == 0.0 && e.to_bits() != r.to_bits()) {
            failures.push(format!(
                "{}: engine {e} vs reference {r}: rel {rel:.3e} > {:.0e}",
                label(kv),
                budget(kv)
            ));
        }
        if cost.abs() > quant_sanity(kv) {
            failures.push(format!(
                "{}: {:+.3}% vs fp32 is beyond the sanity bound",
                label(kv),
                cost * 100.0
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// head_dim 32, GQA 2: 320 tokens, so StreamingLLM (sink 4 + window 60) evicts for most
/// of them and the int8/int4 K groups (32) complete and get evicted many times.
#[test]
fn bundled_model_engine_and_reference_perplexity_agree() {
    run_table(&fixtures().join("tiny"), 320, &caches(60));
}

/// head_dim 64, GQA 3 (SmolLM2): the shape where the issue saw the two sides disagree.
/// 96 tokens (the scalar reference runs ~10 tokens/s on this model), so K groups of 32
/// complete twice; a 40-row window evicts from token 44 on.
#[test]
fn smollm2_engine_and_reference_perplexity_agree() {
    let Some(p) = smollm2_path() else { return };
    let kvs: Vec<KvConfig> = caches(40)
        .into_iter()
        .filter(|kv| kv.positions == PositionsMode::Original)
        .filter(|kv| {
            matches!(
                kv.precision,
                Precision::Fp32 | Precision::Int8 | Precision::Int4
            )
        })
        // of the rotated modes only int4 with post-RoPE keys (the reference's time)
        .filter(|kv| {
            kv.rotation == KvRotation::None
                || (kv.precision == Precision::Int4 && kv.key_rope == KeyRope::Post)
        })
        .collect();
    run_table(&p, 96, &kvs);
}

/// The tiny Qwen2 (q/k/v biases, head_dim 32, MQA), Qwen3 (per-head q/k norms before
/// RoPE, head_dim ≠ hidden/heads: 64 with GQA 2, 256 with MQA) and Gemma 3 (sandwich
/// norms, GeGLU, sliding layers of window 8 with their own RoPE base) GGUF fixtures
/// (fixtures/make_gguf_archs.py): the architecture-specific steps happen before the cache,
/// so every cache mode must agree with the reference as on a Llama. 160 tokens, sink 4 +
/// window 40.
#[test]
fn gguf_archs_engine_and_reference_perplexity_agree() {
    for arch in ["qwen2", "qwen3", "qwen3-hd256-mqa", "gemma3"] {
        let kvs: Vec<KvConfig> = caches(40)
            .into_iter()
            .filter(|kv| kv.positions == PositionsMode::Original)
            .collect();
        run_table(
            &fixtures().join(format!("archs/{arch}/{arch}.gguf")),
            160,
            &kvs,
        );
    }
}
