//! The built binary, run as a user would.

mod common;
use common::*;
use std::process::{Command, Output};

fn bin() -> Command {
    common::cli()
}

fn run(args: &[&str]) -> Output {
    bin().args(args).output().expect("binary runs")
}

#[test]
fn sample_default_model_streams_text() {
    let out = run(&[
        "sample",
        "--prompt",
        "Once upon a time",
        "--tokens",
        "40",
        "--seed",
        "1",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.trim().len() > 20, "too little text: {text:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("decode") && err.contains("tok/s"),
        "report missing: {err}"
    );
    assert!(
        err.contains("fp32"),
        "kv precision missing from report: {err}"
    );
}

#[test]
fn json_has_the_design_fields() {
    let out = run(&[
        "sample",
        "--prompt",
        "The function",
        "--tokens",
        "12",
        "--temperature",
        "0",
        "--ignore-eos",
        "--json",
    ]);
    let v = json_of(&out);
    for k in ["prompt_ids", "generated_ids", "text", "kv", "timing"] {
        assert!(v.get(k).is_some(), "missing {k}: {v}");
    }
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
        assert!(v["kv"].get(k).is_some(), "missing kv.{k}: {v}");
    }
    for k in ["load_s", "prefill_tok_s", "decode_tok_s"] {
        assert!(v["timing"][k].as_f64().is_some(), "missing timing.{k}");
    }
    assert_eq!(v["generated_ids"].as_array().unwrap().len(), 12);
    assert_eq!(v["kv"]["quantize"], "fp32");
    let prompt_len = v["prompt_ids"].as_array().unwrap().len() as u64;
    // 12 generated: the last one is not fed back, so 11 went through the cache.
    assert_eq!(v["kv"]["current_length"].as_u64().unwrap(), prompt_len + 11);
    assert_eq!(v["kv"]["stored_tokens"], v["kv"]["current_length"]);
    // fp32 K and V rows: layers × tokens × kv_dim × 2 × 4 bytes (6 layers, kv_dim 64)
    assert_eq!(
        v["kv"]["bytes"].as_u64().unwrap(),
        6 * (prompt_len + 11) * 64 * 2 * 4
    );
}

#[test]
fn greedy_json_matches_transformers_golden() {
    let g = golden("tiny.json");
    let p = &g["prompts"][1];
    let want = ids(&p["greedy_ids"]);
    let model = fixtures().join("tiny");
    let out = run(&[
        "sample",
        model.to_str().unwrap(),
        "--prompt",
        p["prompt"].as_str().unwrap(),
        "--temperature",
        "0",
        "--tokens",
        &want.len().to_string(),
        "--ignore-eos",
        "--json",
    ]);
    let v = json_of(&out);
    assert_eq!(ids(&v["prompt_ids"]), ids(&p["prompt_ids"]));
    assert_eq!(ids(&v["generated_ids"]), want);
}

#[test]
fn same_seed_same_text_different_seed_different_text() {
    let go = |seed: &str| {
        let out = run(&[
            "sample",
            "--prompt",
            "In Python",
            "--tokens",
            "40",
            "--seed",
            seed,
            "--temperature",
            "1.0",
            "--ignore-eos",
            "--json",
        ]);
        json_of(&out)["generated_ids"].clone()
    };
    let (a, b, c) = (go("7"), go("7"), go("8"));
    assert_eq!(a, b);
    assert_ne!(a, c, "different seeds gave the same 40 sampled tokens");
}

#[test]
fn reference_engine_gives_same_greedy_ids() {
    let go = |engine: &str| {
        let out = run(&[
            "sample",
            "--prompt",
            "import os",
            "--tokens",
            "20",
            "--temperature",
            "0",
            "--ignore-eos",
            "--json",
            "--engine",
            engine,
        ]);
        json_of(&out)["generated_ids"].clone()
    };
    assert_eq!(go("optimized"), go("reference"));
}

#[test]
fn inspect_and_convert_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("t.tinygpt");
    let tiny = fixtures().join("tiny");
    let out = run(&[
        "convert",
        tiny.to_str().unwrap(),
        out_path.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run(&["inspect", out_path.to_str().unwrap()]);
    assert!(out.status.success());
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        s.contains("layers:      6") && s.contains("kv heads 2"),
        "{s}"
    );
    // the converted file samples exactly like the directory
    let go = |m: &str| {
        json_of(&run(&[
            "sample",
            m,
            "--prompt",
            "The",
            "--tokens",
            "10",
            "--temperature",
            "0",
            "--ignore-eos",
            "--json",
        ]))["generated_ids"]
            .clone()
    };
    assert_eq!(go(out_path.to_str().unwrap()), go(tiny.to_str().unwrap()));
    // the data section starts on a cache line, so mmapped rows are 64-byte aligned
    let bytes = std::fs::read(&out_path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    assert_eq!(
        (8 + n) % 64,
        0,
        "data section of the converted file at {}",
        8 + n
    );
    let files = tinygpt_cpu::weights::ModelFiles::open(Some(&out_path)).unwrap();
    for t in files.tensors.values() {
        let addr = t.data.bytes().as_ptr() as usize;
        assert_eq!(
            addr % 64,
            0,
            "{} is not 64-byte aligned in the mmap",
            t.name
        );
    }
}

#[test]
fn past_context_is_refused_with_the_flags_named() {
    let out = run(&[
        "sample",
        "--prompt",
        "a",
        "--tokens",
        "400",
        "--temperature",
        "0",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("context length")
            && err.contains("--streaming-llm-window")
            && err.contains("--allow-past-context"),
        "{err}"
    );
}

/// The execution flags' `TINYGPT_*` variables are the CLI's defaults: the `[exec]` line of
/// `sample` reports what they chose; a flag given on the command line wins over its
/// variable; `--threads` turns the adaptive choice off.
#[test]
fn exec_variables_are_flag_defaults() {
    let args = [
        "sample",
        "--prompt",
        "Once upon",
        "--tokens",
        "2",
        "--temperature",
        "0",
    ];
    let exec_line = |vars: &[(&str, &str)], extra: &[&str]| -> String {
        let out = bin()
            .env_remove("TINYGPT_KERNEL")
            .env_remove("TINYGPT_KV_KERNEL")
            .env_remove("TINYGPT_TEAM")
            .env_remove("TINYGPT_ATTN_SPLIT")
            .env_remove("TINYGPT_ADAPTIVE")
            .envs(vars.iter().copied())
            .args(args)
            .args(extra)
            .output()
            .expect("binary runs");
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{vars:?} {extra:?}: {err}");
        err.lines()
            .find(|l| l.starts_with("[exec] "))
            .unwrap_or_else(|| panic!("no [exec] line in {err:?}"))
            .to_string()
    };
    let best_kv = tinygpt_cpu::kivi::KvKernel::best(false).name();
    let best = tinygpt_cpu::wkernels::Kernel::best().name();
    let default = exec_line(&[], &[]);
    assert_eq!(
        default,
        format!(
            "[exec] kernel {best} | kv-kernel {best_kv} | team on | attn-split auto | adaptive on | threads all"
        )
    );
    let set = exec_line(
        &[
            ("TINYGPT_KERNEL", "scalar"),
            ("TINYGPT_KV_KERNEL", "portable"),
            ("TINYGPT_TEAM", "off"),
            ("TINYGPT_ATTN_SPLIT", "never"),
            ("TINYGPT_ADAPTIVE", "off"),
        ],
        &[],
    );
    assert_eq!(
        set,
        "[exec] kernel scalar | kv-kernel portable | team off | attn-split never | adaptive off | threads all"
    );
    // The flag wins over its variable (which is then not even parsed).
    let flag = exec_line(
        &[("TINYGPT_KERNEL", "bogus"), ("TINYGPT_ATTN_SPLIT", "never")],
        &[
            "--kernel",
            "portable",
            "--attn-split",
            "always",
            "--threads",
            "2",
        ],
    );
    assert_eq!(
        flag,
        format!(
            "[exec] kernel portable | kv-kernel {best_kv} | team on | attn-split always | adaptive off | threads 2"
        )
    );
    // `exact` is the fastest variant that adds in the reference's order.
    let exact = exec_line(&[], &["--kv-kernel", "exact"]);
    let want = tinygpt_cpu::kivi::KvKernel::best(true).name();
    assert!(exact.contains(&format!("| kv-kernel {want} |")), "{exact}");
}

/// `--help` of the engine's subcommands lists every execution flag with its variable.
#[test]
fn help_lists_the_exec_variables() {
    for cmd in ["sample", "perplexity", "serve"] {
        let out = run(&[cmd, "--help"]);
        assert!(out.status.success());
        let help = String::from_utf8_lossy(&out.stdout);
        let mut want = vec![
            ("--kernel", "TINYGPT_KERNEL"),
            ("--kv-kernel", "TINYGPT_KV_KERNEL"),
            ("--team", "TINYGPT_TEAM"),
            ("--attn-split", "TINYGPT_ATTN_SPLIT"),
        ];
        if cmd != "serve" {
            want.push(("--adaptive", "TINYGPT_ADAPTIVE"));
        }
        for (flag, var) in want {
            assert!(help.contains(flag), "{cmd} --help lacks {flag}");
            assert!(
                help.contains(&format!("[env: {var}=")),
                "{cmd} --help lacks {var}: {help}"
            );
        }
    }
}
