//! Bad input gets a one-line error naming the file/tensor/flag and a non-zero exit.

mod common;
use common::*;
use std::path::Path;

fn fails_with(args: &[&str], needles: &[&str]) {
    let out = common::cli().args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded");
    assert!(matches!(out.status.code(), Some(1) | Some(2)), "{err}");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    assert!(!err.contains("RUST_BACKTRACE"), "{err}");
    for n in needles {
        assert!(
            err.contains(n),
            "{args:?}: error {err:?} does not mention {n:?}"
        );
    }
    assert!(
        err.trim_end().lines().count() <= 8,
        "error is not short: {err}"
    );
}

fn p(x: &Path) -> &str {
    x.to_str().unwrap()
}

#[test]
fn missing_file() {
    fails_with(
        &["sample", "/nonexistent/model.gguf", "--prompt", "x"],
        &["/nonexistent/model.gguf"],
    );
}

#[test]
fn directory_without_config() {
    let d = tempfile::tempdir().unwrap();
    fails_with(&["sample", p(d.path()), "--prompt", "x"], &["config.json"]);
}

#[test]
fn unsupported_architecture() {
    let d = tiny_copy();
    let cfg = d.path().join("config.json");
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("LlamaForCausalLM", "GPT2LMHeadModel");
    std::fs::write(&cfg, text).unwrap();
    fails_with(
        &["sample", p(d.path()), "--prompt", "x"],
        &["config.json", "GPT2LMHeadModel"],
    );
}

#[test]
fn truncated_safetensors() {
    let d = tiny_copy();
    let m = d.path().join("model.safetensors");
    let bytes = std::fs::read(&m).unwrap();
    std::fs::write(&m, &bytes[..bytes.len() / 2]).unwrap();
    fails_with(
        &["sample", p(d.path()), "--prompt", "x"],
        &["model.safetensors"],
    );
}

#[test]
fn lying_safetensors_header() {
    let d = tiny_copy();
    let m = d.path().join("model.safetensors");
    let mut bytes = std::fs::read(&m).unwrap();
    // header length claims more bytes than the file has
    bytes[..8].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    std::fs::write(&m, &bytes).unwrap();
    fails_with(
        &["sample", p(d.path()), "--prompt", "x"],
        &["model.safetensors"],
    );
    // garbage JSON header
    let mut bytes = std::fs::read(fixtures().join("tiny/model.safetensors")).unwrap();
    bytes[8] = b'#';
    std::fs::write(&m, &bytes).unwrap();
    fails_with(
        &["sample", p(d.path()), "--prompt", "x"],
        &["model.safetensors"],
    );
}

#[test]
fn wrong_shape_names_the_tensor() {
    let d = tiny_copy();
    let cfg = d.path().join("config.json");
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("\"intermediate_size\": 384", "\"intermediate_size\": 380");
    std::fs::write(&cfg, text).unwrap();
    fails_with(
        &["sample", p(d.path()), "--prompt", "x"],
        &["gate_proj", "380"],
    );
}

#[test]
fn tokenizer_vocab_mismatch() {
    let d = tiny_copy();
    let cfg = d.path().join("config.json");
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("\"vocab_size\": 2048", "\"vocab_size\": 1000");
    std::fs::write(&cfg, text).unwrap();
    fails_with(
        &["sample", p(d.path()), "--prompt", "x"],
        &["tokenizer", "vocab"],
    );
}

#[test]
fn not_a_model_file() {
    let d = tempfile::tempdir().unwrap();
    let f = d.path().join("junk.bin");
    std::fs::write(&f, b"this is not a model at all, just some bytes").unwrap();
    fails_with(&["sample", p(&f), "--prompt", "x"], &["junk.bin"]);
}

#[test]
fn bad_flag_values() {
    fails_with(
        &["sample", "--prompt", "x", "--streaming-llm-window", "0"],
        &["--streaming-llm-window"],
    );
    fails_with(
        &["sample", "--prompt", "x", "--kv-group-size", "0"],
        &["--kv-group-size"],
    );
    fails_with(
        &["sample", "--prompt", "x", "--kv-quantize", "int3"],
        &["int3"],
    );
    fails_with(&["sample", "--prompt", "x", "--tokens", "-5"], &["-5"]);
    fails_with(&["sample", "--prompt", "x", "--top-p", "0"], &["--top-p"]);
    fails_with(
        &["sample", "--prompt", "x", "--threads", "0"],
        &["--threads"],
    );
    fails_with(
        &["sample", "--prompt", "x", "--streaming-llm-sink", "4"],
        &["--streaming-llm-window"],
    );
}

/// [`fails_with`] with `vars` set in the binary's environment.
fn fails_with_env(vars: &[(&str, &str)], args: &[&str], needles: &[&str]) {
    let out = common::cli()
        .envs(vars.iter().copied())
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{vars:?} {args:?} succeeded");
    assert!(matches!(out.status.code(), Some(1) | Some(2)), "{err}");
    assert!(
        !err.contains("panicked"),
        "{vars:?} {args:?} panicked: {err}"
    );
    for n in needles {
        assert!(
            err.contains(n),
            "{vars:?} {args:?}: error {err:?} does not mention {n:?}"
        );
    }
    assert!(
        err.trim_end().lines().count() <= 8,
        "error is not short: {err}"
    );
}

/// Each execution flag's bad value, given as the flag or through its `TINYGPT_*`
/// variable, is a short error naming the flag (and the value), for `sample`,
/// `perplexity` and `serve` alike.
#[test]
fn bad_exec_flag_values_name_the_flag() {
    let cases: [(&str, &str, &str); 5] = [
        ("--kernel", "TINYGPT_KERNEL", "avx9000"),
        ("--kv-kernel", "TINYGPT_KV_KERNEL", "slow"),
        ("--team", "TINYGPT_TEAM", "maybe"),
        ("--attn-split", "TINYGPT_ATTN_SPLIT", "sometimes"),
        ("--adaptive", "TINYGPT_ADAPTIVE", "perhaps"),
    ];
    for (flag, var, bad) in cases {
        fails_with(&["sample", "--prompt", "x", flag, bad], &[flag, bad]);
        fails_with_env(&[(var, bad)], &["sample", "--prompt", "x"], &[flag, bad]);
        fails_with(&["perplexity", "--text", "x", flag, bad], &[flag, bad]);
        if flag != "--adaptive" {
            fails_with(&["serve", "--port", "0", flag, bad], &[flag, bad]);
        }
    }
    // A weight kernel variant this CPU lacks is refused too (not silently replaced).
    let lacking = ["avx2", "avx512vnni", "neon-dotprod"]
        .into_iter()
        .find(|k| {
            let k = tinygpt_cpu::wkernels::Kernel::from_name(k).unwrap();
            !k.is_supported()
        });
    if let Some(k) = lacking {
        fails_with(
            &["sample", "--prompt", "x", "--kernel", k],
            &["--kernel", k],
        );
        fails_with_env(
            &[("TINYGPT_KERNEL", k)],
            &["sample", "--prompt", "x"],
            &["--kernel", k],
        );
    }
    let lacking = ["avx2", "avx512", "avx512-exact", "neon"]
        .into_iter()
        .find(|k| {
            !tinygpt_cpu::kivi::KvKernel::from_name(k)
                .unwrap()
                .is_supported()
        });
    if let Some(k) = lacking {
        fails_with(
            &["sample", "--prompt", "x", "--kv-kernel", k],
            &["--kv-kernel", k],
        );
    }
}
