//! Every GGML block type against an independent dequantiser: `fixtures/dequant/TYPE.blocks`
//! holds random valid blocks (every code byte value, all-zero and all-0xFF blocks, f16
//! scales from subnormal to ±65504), `TYPE.f32` the values the `gguf` package's
//! `gguf.quants.dequantize` gives for them (`fixtures/make_dequant_cases.py`). The engine's
//! `dequant::dequantize_row` and the reference's `ggml::dequantize_row` must match those
//! values (to f32 rounding of a differently ordered product) and each other bit for bit.

mod common;
use common::fixtures;
use tinygpt_cpu::dtype::DType;

fn read_f32(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn every_block_type_matches_gguf_py() {
    let dir = fixtures().join("dequant");
    let mut checked = 0;
    for ty in DType::ALL.into_iter().filter(|t| t.is_quantized()) {
        let blocks = std::fs::read(dir.join(format!("{}.blocks", ty.name())))
            .unwrap_or_else(|e| panic!("{ty}: {e} (run fixtures/make_dequant_cases.py)"));
        let want = read_f32(&std::fs::read(dir.join(format!("{}.f32", ty.name()))).unwrap());
        let mut got = vec![f32::NAN; want.len()];
        tinygpt_cpu::dequant::dequantize_row(ty, &blocks, &mut got).unwrap();
        let mut reference = vec![f32::NAN; want.len()];
        tinygpt_reference::ggml::dequantize_row(ty, &blocks, &mut reference).unwrap();
        let mut worst = 0.0f64;
        for (i, ((&g, &r), &w)) in got.iter().zip(&reference).zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                r.to_bits(),
                "{ty} value {i}: engine {g} vs reference {r}"
            );
            assert!(g.is_finite(), "{ty} value {i}: {g}");
            // gguf-py multiplies in another order (scale products in f32 or f64): a few ulps.
            let err = (g as f64 - w as f64).abs();
            let tol = 4.0 * f32::EPSILON as f64 * (g.abs().max(w.abs()) as f64) + 1e-37;
            worst = worst.max(err / (g.abs().max(w.abs()) as f64).max(1e-30));
            assert!(
                err <= tol,
                "{ty} value {i} (block {}): ours {g} vs gguf-py {w}",
                i / ty.block_len()
            );
        }
        eprintln!(
            "{ty}: {} values, worst relative difference {worst:.2e}",
            want.len()
        );
        checked += 1;
    }
    assert_eq!(checked, 12, "every block type has a fixture");
}

/// Unsupported GGML types (IQ2/IQ3/IQ1, TQ) are named in the error, with the tensor.
#[test]
fn unsupported_types_are_one_clear_error() {
    for (id, name) in [
        (16u32, "IQ2_XXS"),
        (19, "IQ1_S"),
        (21, "IQ3_S"),
        (34, "TQ1_0"),
    ] {
        assert!(
            tinygpt_cpu::gguf::reader::dtype_from_ggml(id).is_none(),
            "{name}"
        );
        assert_eq!(tinygpt_cpu::gguf::reader::ggml_type_name(id), Some(name));
    }
}

/// The re-quantised SmolLM2 files (`~/.cache/tinygpt-cpu/requant/`, made with llama.cpp's
/// quantiser; skipped when absent): every `_K` / IQ4 mix loads, `inspect`'s summary names
/// the file's types, and perplexity over 64 held-out tokens stays within 15% of the Q8_0
/// file's (llama.cpp measures the same spread, docs/eval/quant-types.md).
#[test]
fn requantised_files_load_and_evaluate() {
    let dir = std::env::var_os("HOME")
        .map(std::path::PathBuf::from)
        .unwrap_or_default()
        .join(".cache/tinygpt-cpu/requant");
    let path = |q: &str| dir.join(format!("SmolLM2-135M-Instruct.{q}.gguf"));
    if !path("Q8_0").exists() {
        eprintln!("skipped: {} not present", path("Q8_0").display());
        return;
    }
    let text = fixtures().join("heldout.txt");
    let ppl = |q: &str| -> f64 {
        let out = common::cli()
            .args(["perplexity"])
            .arg(path(q))
            .arg("--text")
            .arg(&text)
            .args(["--max-tokens", "64", "--json"])
            .output()
            .unwrap();
        common::json_of(&out)["ppl"].as_f64().unwrap()
    };
    let base = ppl("Q8_0");
    for (q, types) in [
        ("Q4_K_M", &["Q4_K", "Q5_0", "Q6_K"][..]),
        ("Q5_K_M", &["Q5_1", "Q5_K", "Q6_K"]),
        ("IQ4_XS", &["IQ4_NL", "IQ4_XS", "Q5_K"]),
        ("Q3_K_M", &["Q4_K", "Q5_0", "Q5_1", "Q5_K"]),
    ] {
        if !path(q).exists() {
            eprintln!("skipped {q}: not present");
            continue;
        }
        let files = tinygpt_cpu::weights::ModelFiles::open(Some(&path(q))).unwrap();
        let summary = files.dtype_summary();
        for t in types {
            assert!(summary.contains_key(*t), "{q}: {summary:?} lacks {t}");
        }
        let p = ppl(q);
        assert!(
            p.is_finite() && (p / base - 1.0).abs() < 0.15,
            "{q}: perplexity {p} vs Q8_0 {base}"
        );
        eprintln!("{q}: perplexity {p:.4} (Q8_0 {base:.4})");
    }
}
