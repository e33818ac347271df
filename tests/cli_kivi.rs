//! The KIVI cache flags through the built binary: `--kv-quantize int2`,
//! `--kv-quantize-k/-v`, `--kv-residual`, `--kv-key-rope` on sample, perplexity, compare
//! and cache-table; the new `--compare-modes` keys and mode names; bad values get a short
//! error naming the flag.

mod common;
use common::*;
use std::process::Output;

fn run(args: &[&str]) -> Output {
    cli().args(args).output().expect("binary runs")
}

fn fails_naming(args: &[&str], needle: &str) {
    let out = run(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded");
    assert!(matches!(out.status.code(), Some(1) | Some(2)), "{err}");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    assert!(
        err.contains(needle),
        "{args:?}: {err:?} does not name {needle:?}"
    );
    assert!(
        err.trim_end().lines().count() <= 8,
        "error is not short: {err}"
    );
}

/// `sample --json` reports the new fields next to the old ones, and the bytes are those of
/// the contract, computed here by hand for the bundled model (6 layers, 2 KV heads,
/// head_dim 32): 4 prefix rows f32; K int4 in groups of 32 that leave the newest R = 16
/// (none does in this short run, so every K row is f32); V int2 once it leaves the newest
/// 16 (2 heads × (8 code bytes + f16 scale + f16 zero) = 24 bytes), else f32.
#[test]
fn sample_json_reports_asymmetric_residual_and_key_rope() {
    let out = run(&[
        "sample",
        "--prompt",
        "The function",
        "--tokens",
        "30",
        "--temperature",
        "0",
        "--ignore-eos",
        "--json",
        "--kv-quantize",
        "int4",
        "--kv-quantize-v",
        "int2",
        "--kv-residual",
        "16",
        "--kv-key-rope",
        "pre",
    ]);
    let v = json_of(&out);
    let kv = &v["kv"];
    for k in [
        "quantize",
        "group_size",
        "sink",
        "window",
        "positions",
        "stored_tokens",
        "current_length",
        "bytes",
        "layers_with_kv",
    ] {
        assert!(kv.get(k).is_some(), "missing kv.{k}: {v}");
    }
    assert_eq!(kv["quantize"], "int4");
    assert_eq!(kv["quantize_k"], "int4");
    assert_eq!(kv["quantize_v"], "int2");
    assert_eq!(kv["residual"], 16);
    assert_eq!(kv["key_rope"], "pre");
    let t = kv["current_length"].as_u64().unwrap();
    assert!(
        t > 20 && t < 4 + 16 + 32,
        "length {t} outside the hand computation"
    );
    let quantised_v = t - 16 - 4;
    let per_layer = t * 256 + (t - quantised_v) * 256 + quantised_v * 24;
    assert_eq!(kv["bytes"].as_u64().unwrap(), 6 * per_layer);
}

#[test]
fn sample_defaults_report_symmetric_fields() {
    let out = run(&[
        "sample",
        "--prompt",
        "Hi",
        "--tokens",
        "3",
        "--json",
        "--kv-quantize",
        "int2",
    ]);
    let v = json_of(&out);
    assert_eq!(v["kv"]["quantize"], "int2");
    assert_eq!(v["kv"]["quantize_k"], "int2");
    assert_eq!(v["kv"]["quantize_v"], "int2");
    assert_eq!(v["kv"]["residual"], 0);
    assert_eq!(v["kv"]["key_rope"], "post");
}

/// `--compare-modes` with every new key and mode names; results are finite and the
/// names come back in order.
#[test]
fn perplexity_compare_modes_accepts_the_new_keys() {
    let text = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/heldout.txt");
    let spec = "dense;kv=int2+r32;kv=k8v4;kv_k=int4,kv_v=int2,residual=8,key_rope=pre;\
                sink=4,window=40,kv=int4,key_rope=pre";
    let out = run(&[
        "perplexity",
        "--text",
        text,
        "--max-tokens",
        "80",
        "--json",
        "--compare-modes",
        spec,
    ]);
    let v = json_of(&out);
    let modes = v["modes"].as_array().expect("modes array");
    assert_eq!(modes.len(), 5, "{v}");
    for m in modes {
        let ppl = m["ppl"].as_f64().unwrap();
        assert!(ppl.is_finite() && ppl > 1.0, "{m}");
    }
}

#[test]
fn compare_and_cache_table_accept_mode_names() {
    let dir = tempfile::tempdir().unwrap();
    let prompts = dir.path().join("p.txt");
    std::fs::write(&prompts, "Once upon a time\n").unwrap();
    let out = run(&[
        "compare",
        "--prompts",
        prompts.to_str().unwrap(),
        "--tokens",
        "8",
        "--modes",
        "int8,k8v4,k4v2+r16,int2+r32+pre",
        "--json",
    ]);
    let v = json_of(&out);
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 4, "{v}");
    assert_eq!(rows[3]["mode"], "int2+r32+pre");

    let out = run(&[
        "cache-table",
        "--lengths",
        "256",
        "--modes",
        "int4,int2,k8v4,int2+r64",
        "--json",
    ]);
    let v = json_of(&out);
    let rows = v["rows"].as_array().unwrap();
    let bytes = |mode: &str| -> u64 {
        rows.iter()
            .find(|r| r["mode"] == mode)
            .unwrap_or_else(|| panic!("no row {mode}: {v}"))["bytes"]
            .as_u64()
            .unwrap()
    };
    assert!(bytes("int2") < bytes("int4"), "{v}");
    assert!(bytes("int4") < bytes("k8v4"), "{v}");
    // 64 more f32 V rows and up to 64 more f32 K rows than plain int2
    assert!(bytes("int2+r64") > bytes("int2"), "{v}");
}

#[test]
fn bad_values_name_the_flag() {
    let s = ["sample", "--prompt", "x", "--tokens", "2"];
    let with =
        |extra: &[&'static str]| -> Vec<&'static str> { s.iter().chain(extra).copied().collect() };
    fails_naming(&with(&["--kv-quantize-k", "int3"]), "--kv-quantize-k");
    fails_naming(&with(&["--kv-quantize-v", "q4"]), "--kv-quantize-v");
    fails_naming(&with(&["--kv-residual", "-1"]), "--kv-residual");
    fails_naming(&with(&["--kv-residual", "999999999999"]), "--kv-residual");
    fails_naming(&with(&["--kv-key-rope", "sideways"]), "--kv-key-rope");
    let text = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/heldout.txt");
    for spec in [
        "kv=int3",
        "kv=k9v4",
        "kv=int2+r",
        "kv=int2+x",
        "kv_v=int5",
        "key_rope=up",
        "residual=-2",
    ] {
        fails_naming(
            &[
                "perplexity",
                "--text",
                text,
                "--max-tokens",
                "8",
                "--compare-modes",
                spec,
            ],
            "--compare-modes",
        );
    }
    fails_naming(
        &["compare", "--prompts", text, "--modes", "int4,k8v3"],
        "--modes",
    );
    fails_naming(&["cache-table", "--modes", "int2+rr"], "--modes");
}
