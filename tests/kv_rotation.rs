//! `--kv-rotation hadamard` (docs/design.md §2.5): the engine's fast transform against the
//! reference's matrix product (identical bits), the rotation leaving attention unchanged
//! up to rounding, what it buys a per-token quantiser, and how it is asked for and refused.

mod common;
use common::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tinygpt_cpu::generate::{Engine, EngineRun, ReferenceRun};
use tinygpt_cpu::kivi::hadamard;
use tinygpt_cpu::kv_cache::{KvConfig, KvRotation, Precision};
use tinygpt_cpu::model::{reference_model, Model, WeightsDType};
use tinygpt_cpu::weights::ModelFiles;
use tinygpt_reference::hadamard as reference;
use tinygpt_reference::quant::{Affine, Bits};

fn vector(rng: &mut ChaCha8Rng, d: usize, shape: &str) -> Vec<f32> {
    (0..d)
        .map(|i| match shape {
            "random" => rng.gen_range(-3.0f32..3.0),
            "constant" => 0.75,
            // magnitudes from 1e-30 to 1e30, both signs: cancellation and absorption
            "extreme" => {
                let e = rng.gen_range(-30i32..30);
                let s = if rng.gen_bool(0.5) { 1.0 } else { -1.0 };
                s * rng.gen_range(1.0f32..10.0) * 10f32.powi(e)
            }
            // one outlier channel, as real keys and values have
            "outlier" => {
                if i == 3 {
                    20.0
                } else {
                    rng.gen_range(-1.0f32..1.0)
                }
            }
            _ => unreachable!(),
        })
        .collect()
}

/// Every power-of-two width from 2 to 512, random, constant, extreme-range and outlier
/// vectors: the butterflies give the matrix product's bits (the pairwise order).
#[test]
fn fast_transform_equals_the_reference_bit_for_bit() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x4841_4441);
    for m in 1..=9 {
        let d = 1usize << m;
        for shape in ["random", "constant", "extreme", "outlier"] {
            for _ in 0..8 {
                let x = vector(&mut rng, d, shape);
                let want = reference::rotate(&x);
                let mut got = x.clone();
                hadamard::rotate(&mut got);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "d={d} {shape} element {i}: engine {g} vs reference {w}"
                    );
                }
                // and it is an involution to rounding
                hadamard::rotate(&mut got);
                if shape != "extreme" {
                    for (a, b) in got.iter().zip(&x) {
                        assert!(
                            (a - b).abs() <= 1e-4 * b.abs().max(1.0),
                            "d={d}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }
}

/// Concatenated heads rotate one by one.
#[test]
fn heads_rotate_independently() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let x = vector(&mut rng, 3 * 64, "random");
    let mut all = x.clone();
    hadamard::rotate_heads(&mut all, 64);
    for h in 0..3 {
        let want = reference::rotate(&x[h * 64..(h + 1) * 64]);
        assert_eq!(&all[h * 64..(h + 1) * 64], &want[..]);
    }
}

/// With an fp32 cache the rotation changes only rounding: `(H·q)·(H·k) = q·k` and
/// `H·Σ p_i H·v_i = Σ p_i v_i`. Logits of the bundled model (f32 weights) over 40 steps.
#[test]
fn rotation_leaves_an_fp32_cache_unchanged_to_rounding() {
    let files = ModelFiles::open(None).unwrap();
    let model = Model::load(&files, WeightsDType::F32).unwrap();
    let reference = reference_model(&files, WeightsDType::F32).unwrap();
    let ids: Vec<u32> = golden("tiny.json")["prompts"][0]["prompt_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let plain = KvConfig {
        rotation: KvRotation::None,
        ..KvConfig::default()
    };
    let rotated = KvConfig {
        rotation: KvRotation::Hadamard,
        ..KvConfig::default()
    };
    let check = |name: &str, a: &mut dyn Engine, b: &mut dyn Engine| {
        let ga = greedy(a, &ids, 40);
        let gb = greedy(b, &ids, 40);
        assert_eq!(ga.ids, gb.ids, "{name}: greedy ids changed by the rotation");
        for (la, lb) in ga.logits.iter().zip(&gb.logits) {
            let d = max_abs_diff(la, lb);
            assert!(d < 1e-4, "{name}: logits moved by {d}");
        }
    };
    check(
        "engine",
        &mut EngineRun::new(&model, &plain),
        &mut EngineRun::new(&model, &rotated),
    );
    check(
        "reference",
        &mut ReferenceRun::new(&reference, &plain),
        &mut ReferenceRun::new(&reference, &rotated),
    );
}

/// What the rotation is for: a V row with an outlier channel (20 against values in ±1)
/// quantised per token. The outlier sets the step for every other channel; rotated, its
/// energy is spread over the head, the range shrinks, and the round-trip error of the
/// whole row (the same in either basis: `H` is orthogonal) drops.
#[test]
fn rotation_shrinks_per_token_error_on_outlier_rows() {
    let mut rng = ChaCha8Rng::seed_from_u64(0x6f75_746c);
    for bits in [Bits::Int4, Bits::Int2] {
        let (mut plain, mut rotated) = (0.0f64, 0.0f64);
        for _ in 0..64 {
            let v = vector(&mut rng, 64, "outlier");
            let round_trip = |x: &[f32]| -> Vec<f32> {
                let a = Affine::fit(x, bits);
                x.iter()
                    .map(|&e| a.dequantize(a.quantize(e, bits), bits))
                    .collect()
            };
            let err = |a: &[f32]| -> f64 {
                a.iter()
                    .zip(&v)
                    .map(|(x, y)| ((x - y) as f64).powi(2))
                    .sum()
            };
            plain += err(&round_trip(&v));
            let back = reference::rotate(&round_trip(&reference::rotate(&v)));
            rotated += err(&back);
        }
        println!("{bits:?}: squared round-trip error rotated {rotated:.2} plain {plain:.2}");
        assert!(
            rotated < 0.6 * plain,
            "{bits:?}: squared round-trip error, rotated {rotated} vs plain {plain}"
        );
    }
}

/// `+rot` in a mode name, `rotation=` in a mode spec, and the refusal of a head_dim
/// without a Hadamard matrix.
#[test]
fn rotation_is_named_parsed_and_refused_where_it_cannot_apply() {
    let mut kv = KvConfig::default();
    tinygpt_cpu::eval::apply_quant_mode("int4+r32+rot", &mut kv).unwrap();
    assert_eq!(kv.rotation, KvRotation::Hadamard);
    assert_eq!(kv.residual, 32);
    assert_eq!(kv.precision, Precision::Int4);
    assert_eq!(kv.quant_name(), "int4+r32+rot");
    let modes =
        tinygpt_cpu::eval::parse_modes("kv=int4,rotation=hadamard;kv=int4", &KvConfig::default())
            .unwrap();
    assert_eq!(modes[0].1.rotation, KvRotation::Hadamard);
    assert_eq!(modes[1].1.rotation, KvRotation::Auto);
    let mut kv = KvConfig::default();
    tinygpt_cpu::eval::apply_quant_mode("int4+norot", &mut kv).unwrap();
    assert_eq!(kv.rotation, KvRotation::None);
    assert_eq!(kv.quant_name(), "int4+norot");
    assert!(
        tinygpt_cpu::eval::parse_modes("kv=int4,rotation=givens", &KvConfig::default()).is_err()
    );

    let files = ModelFiles::open(None).unwrap();
    let mut cfg = files.config.clone();
    let rot = KvConfig {
        rotation: KvRotation::Hadamard,
        ..KvConfig::default()
    };
    assert!(tinygpt_cpu::kv_cache::validate(&rot, &cfg).is_ok());
    cfg.head_dim = 48;
    let err = tinygpt_cpu::kv_cache::validate(&rot, &cfg)
        .unwrap_err()
        .to_string();
    assert!(err.contains("--kv-rotation") && err.contains("48"), "{err}");
}

/// `auto` (the default) rotates exactly when a side is KIVI-quantised, keys are stored
/// after RoPE and head_dim is a power of two.
#[test]
fn auto_rotates_quantised_post_rope_caches_only() {
    let kv = |precision, v_precision, key_rope| KvConfig {
        precision,
        v_precision,
        key_rope,
        ..KvConfig::default()
    };
    use tinygpt_cpu::kv_cache::{KeyRope, PositionsMode};
    assert_eq!(KvConfig::default().rotation, KvRotation::Auto);
    for p in [Precision::Fp32, Precision::Fp16, Precision::Bf16] {
        assert!(!kv(p, None, KeyRope::Post).rotates(64), "{p:?}");
    }
    for p in [Precision::Int8, Precision::Int4, Precision::Int2] {
        assert!(kv(p, None, KeyRope::Post).rotates(64), "{p:?}");
        assert!(kv(p, None, KeyRope::Post).rotates(256), "{p:?}");
        assert!(
            !kv(p, None, KeyRope::Post).rotates(48),
            "{p:?} at head_dim 48"
        );
        assert!(!kv(p, None, KeyRope::Pre).rotates(64), "{p:?} pre-RoPE");
    }
    assert!(kv(Precision::Fp16, Some(Precision::Int4), KeyRope::Post).rotates(32));
    let cache_mode = KvConfig {
        precision: Precision::Int4,
        positions: PositionsMode::Cache,
        ..KvConfig::default()
    };
    assert!(!cache_mode.rotates(64));
    let forced = KvConfig {
        rotation: KvRotation::Hadamard,
        ..cache_mode
    };
    assert!(forced.rotates(64));
    let off = KvConfig {
        precision: Precision::Int4,
        rotation: KvRotation::None,
        ..KvConfig::default()
    };
    assert!(!off.rotates(64));
}

/// The CLI: the flag reaches the cache (the JSON names it) and a bad value is one error.
#[test]
fn cli_flag_and_json() {
    let out = cli()
        .args([
            "sample",
            "--prompt",
            "Once upon a time",
            "--tokens",
            "4",
            "--kv-quantize",
            "int4",
            "--kv-rotation",
            "hadamard",
            "--json",
        ])
        .output()
        .unwrap();
    let j = json_of(&out);
    assert_eq!(j["kv"]["rotation"], "hadamard");
    // auto: rotated at int4, not at fp32
    for (p, want) in [("int4", "hadamard"), ("fp32", "none")] {
        let out = cli()
            .args([
                "sample",
                "--prompt",
                "Once",
                "--tokens",
                "2",
                "--kv-quantize",
                p,
                "--json",
            ])
            .output()
            .unwrap();
        assert_eq!(json_of(&out)["kv"]["rotation"], want, "{p}");
    }
    // cache-table: the rotation is named in the mode and costs no bytes
    let bytes = |rot: &str| -> (String, u64) {
        let out = cli()
            .args([
                "cache-table",
                "--lengths",
                "300",
                "--modes",
                "int4",
                "--json",
            ])
            .args(["--kv-rotation", rot])
            .output()
            .unwrap();
        let v = json_of(&out);
        let row = &v["rows"][0];
        (
            row["mode"].as_str().unwrap().to_string(),
            row["bytes"].as_u64().unwrap(),
        )
    };
    let (on, off) = (bytes("hadamard"), bytes("none"));
    assert_eq!((on.0.as_str(), off.0.as_str()), ("int4+rot", "int4+norot"));
    assert_eq!(on.1, off.1);
    let out = cli()
        .args(["sample", "--prompt", "x", "--kv-rotation", "givens"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--kv-rotation"), "{err}");
}
