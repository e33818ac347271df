//! Issue 11: hostile input and endless runs. Every case of the issue, with the hostile file
//! built here in a temp dir: no panic, no silent garbage, one line naming the culprit.

mod common;
use common::*;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn bin() -> Command {
    common::cli()
}

fn run(args: &[&str]) -> Output {
    bin().args(args).output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts a clean refusal: exit 1 or 2, no panic, a short error mentioning every needle.
fn refused(o: &Output, what: &str, needles: &[&str]) {
    let err = stderr(o);
    assert!(
        matches!(o.status.code(), Some(1) | Some(2)),
        "{what}: {:?} {err}",
        o.status
    );
    assert!(!err.contains("panicked"), "{what} panicked: {err}");
    assert!(
        err.trim_end().lines().count() <= 3,
        "{what}: error is not short: {err}"
    );
    for n in needles {
        assert!(
            err.contains(n),
            "{what}: error {err:?} does not mention {n:?}"
        );
    }
}

fn fails_with(args: &[&str], needles: &[&str]) {
    refused(&run(args), &format!("{args:?}"), needles);
}

fn p(x: &Path) -> &str {
    x.to_str().unwrap()
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&path, serde_json::to_string_pretty(&v).unwrap()).unwrap();
}

/// Splits a safetensors file into (header JSON, data section).
fn read_st(path: &Path) -> (serde_json::Value, Vec<u8>) {
    let b = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    (
        serde_json::from_slice(&b[8..8 + n]).unwrap(),
        b[8 + n..].to_vec(),
    )
}

fn write_st(path: &Path, header: &serde_json::Value, data: &[u8]) {
    let h = serde_json::to_vec(header).unwrap();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(data);
    std::fs::write(path, out).unwrap();
}

/// Rewrites the f32 values of tensor `name` in a safetensors file.
fn patch_f32(path: &Path, name: &str, f: impl Fn(usize, f32) -> f32) {
    let (h, mut data) = read_st(path);
    assert_eq!(h[name]["dtype"], "F32", "{name}");
    let o = &h[name]["data_offsets"];
    let (b, e) = (
        o[0].as_u64().unwrap() as usize,
        o[1].as_u64().unwrap() as usize,
    );
    for (i, c) in data[b..e].chunks_exact_mut(4).enumerate() {
        let x = f32::from_le_bytes(c.try_into().unwrap());
        c.copy_from_slice(&f(i, x).to_le_bytes());
    }
    write_st(path, &h, &data);
}

/// The tiny GGUF seed (1 layer, F32 norms, F16 and Q8_0 weights, byte-level BPE).
fn gguf_seed() -> PathBuf {
    root().join("fuzz/seeds/tiny_v3.gguf")
}

/// A copy of the GGUF seed in `dir` with the data of `pick`'s tensor rewritten by `f`.
fn patched_gguf(
    dir: &Path,
    pick: impl Fn(&tinygpt_cpu::gguf::TensorInfo) -> bool,
    f: impl Fn(&mut [u8]),
) -> (PathBuf, String) {
    let g = tinygpt_cpu::gguf::GgufFile::open(&gguf_seed()).unwrap();
    let t = g
        .tensors()
        .iter()
        .find(|t| pick(t))
        .expect("a tensor to patch");
    let mut bytes = std::fs::read(gguf_seed()).unwrap();
    f(&mut bytes[t.start..t.start + t.n_bytes]);
    let out = dir.join("patched.gguf");
    std::fs::write(&out, bytes).unwrap();
    (out, t.name.clone())
}

/// Waits for `child` at most `limit`; kills it and fails the test when it hangs.
fn wait_for(mut child: std::process::Child, limit: Duration, what: &str) -> Output {
    let t0 = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if t0.elapsed() > limit {
            child.kill().unwrap();
            panic!("{what}: still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

// ---- write errors ------------------------------------------------------------------

/// Every subcommand with its stdout closed before it writes: exits 0, says nothing.
#[test]
fn closed_stdout_is_quiet_in_every_subcommand() {
    let d = tempfile::tempdir().unwrap();
    let prompts = d.path().join("prompts.txt");
    std::fs::write(&prompts, "The quick brown fox\n").unwrap();
    let text = fixtures().join("heldout.txt");
    let cases: Vec<Vec<&str>> = vec![
        vec![
            "sample",
            "--prompt",
            "Once upon a time",
            "--tokens",
            "200",
            "--streaming-llm-window",
            "64",
            "--ignore-eos",
        ],
        vec!["sample", "--prompt", "Once", "--tokens", "20", "--json"],
        vec!["inspect"],
        vec!["cache-table"],
        vec!["compare", "--prompts", p(&prompts), "--tokens", "5"],
        vec![
            "perplexity",
            "--text",
            p(&text),
            "--max-tokens",
            "64",
            "--json",
        ],
    ];
    for args in cases {
        let mut child = bin()
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take()); // the reader goes away, as `| head -c 0` does
        let o = wait_for(child, Duration::from_secs(120), &format!("{args:?}"));
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(0), "{args:?}: {err}");
        assert!(
            !err.contains("panicked") && !err.contains("Broken pipe"),
            "{args:?}: {err}"
        );
    }
}

/// A closed stderr (the report's stream) is no panic either.
#[test]
fn closed_stderr_is_quiet() {
    let mut child = bin()
        .args(["sample", "--prompt", "Once", "--tokens", "10"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stderr.take());
    let o = wait_for(child, Duration::from_secs(60), "sample with closed stderr");
    assert_eq!(o.status.code(), Some(0), "{:?}", o.status);
}

/// A full disk is one line, exit 1.
#[test]
fn full_disk_is_one_line() {
    if !Path::new("/dev/full").exists() {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let text = fixtures().join("heldout.txt");
    let _ = d;
    for args in [
        vec!["sample", "--prompt", "Once", "--tokens", "10", "--json"],
        vec!["sample", "--prompt", "Once", "--tokens", "10"],
        vec![
            "perplexity",
            "--text",
            p(&text),
            "--max-tokens",
            "32",
            "--json",
        ],
        vec!["inspect"],
        vec!["cache-table"],
    ] {
        let o = bin()
            .args(&args)
            .stdout(
                std::fs::OpenOptions::new()
                    .write(true)
                    .open("/dev/full")
                    .unwrap(),
            )
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(1), "{args:?}");
        assert_eq!(
            stderr(&o),
            "error: writing to stdout: No space left on device\n",
            "{args:?}"
        );
    }
}

// ---- sizes that would abort in the allocator ----------------------------------------

#[test]
fn absurd_layer_count_is_refused_naming_the_key() {
    for layers in [1u64 << 40, 7] {
        let d = tiny_copy();
        edit_config(d.path(), |v| v["num_hidden_layers"] = layers.into());
        for cmd in ["inspect", "cache-table"] {
            fails_with(&[cmd, p(d.path())], &["config.json", "num_hidden_layers"]);
        }
        fails_with(
            &["sample", p(d.path()), "--prompt", "x"],
            &["num_hidden_layers"],
        );
    }
    let d = tiny_copy();
    edit_config(d.path(), |v| v["hidden_size"] = (1u64 << 50).into());
    fails_with(&["inspect", p(d.path())], &["hidden_size"]);
}

/// Runs the binary with its address space limited to 4 GiB (`ulimit -v`).
fn run_limited(args: &[&str]) -> Output {
    use std::os::unix::process::CommandExt;
    let mut cmd = bin();
    cmd.args(args);
    // SAFETY: between fork and exec only setrlimit runs, which is async-signal-safe; no
    // allocation, lock or other thread is touched.
    unsafe {
        cmd.pre_exec(|| {
            let lim = libc::rlimit {
                rlim_cur: 4 << 30,
                rlim_max: 4 << 30,
            };
            if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.output().unwrap()
}

#[test]
fn caches_that_cannot_fit_are_refused_before_allocating() {
    // The largest --lengths value: a 12 GiB fp32 cache of the bundled model.
    let o = run_limited(&["cache-table", "--lengths", "4194304"]);
    refused(
        &o,
        "cache-table --lengths 4194304",
        &["--lengths", "available"],
    );
    // A dense run of a billion tokens past the context.
    let o = run_limited(&[
        "sample",
        "--prompt",
        "x",
        "--tokens",
        "1000000000",
        "--allow-past-context",
    ]);
    refused(&o, "sample --tokens 1e9", &["--tokens", "available"]);
}

// ---- special files ------------------------------------------------------------------

#[test]
fn special_files_are_refused_at_once() {
    let d = tempfile::tempdir().unwrap();
    let fifo = d.path().join("model.gguf");
    let c = std::ffi::CString::new(p(&fifo)).unwrap();
    // SAFETY: a valid NUL-terminated path; mkfifo only creates the file.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    for args in [
        vec!["sample", p(&fifo), "--prompt", "x"],
        vec!["inspect", p(&fifo)],
        vec!["inspect", "/dev/null"],
        vec!["perplexity", "--text", "/dev/zero"],
        vec!["compare", "--prompts", "/dev/zero"],
    ] {
        let child = bin()
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let o = wait_for(child, Duration::from_secs(30), &format!("{args:?}"));
        refused(
            &o,
            &format!("{args:?}"),
            &[args[1..].iter().find(|a| a.starts_with('/')).unwrap()],
        );
        let err = stderr(&o);
        assert!(
            err.matches("os error").count() <= 1,
            "{args:?}: repeated cause: {err}"
        );
    }
    // A model directory whose config.json is a FIFO.
    let hf = tiny_copy();
    let cfg = hf.path().join("config.json");
    std::fs::remove_file(&cfg).unwrap();
    let c = std::ffi::CString::new(p(&cfg)).unwrap();
    // SAFETY: as above.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let child = bin()
        .args(["inspect", p(hf.path())])
        .stderr(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let o = wait_for(child, Duration::from_secs(30), "config.json FIFO");
    refused(
        &o,
        "config.json FIFO",
        &["config.json", "not a regular file"],
    );
}

#[test]
fn text_from_a_pipe_is_still_read() {
    let text = std::fs::read(fixtures().join("heldout.txt")).unwrap();
    let mut child = bin()
        .args(["perplexity", "--text", "/dev/stdin", "--max-tokens", "40"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    std::thread::spawn(move || {
        use std::io::Write;
        let _ = stdin.write_all(&text[..20_000]);
    });
    let o = wait_for(child, Duration::from_secs(60), "perplexity from a pipe");
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(String::from_utf8_lossy(&o.stdout).contains("perplexity"));
}

// ---- non-finite weights -------------------------------------------------------------

#[test]
fn nan_weights_are_refused_on_every_path() {
    let d = tempfile::tempdir().unwrap();
    let nan_first = |b: &mut [u8]| b[..4].copy_from_slice(&f32::NAN.to_le_bytes());
    // GGUF, F32 norm: the case (native quantised weights gave exit 0 and garbage).
    let (g, name) = patched_gguf(d.path(), |t| t.name == "output_norm.weight", nan_first);
    assert_eq!(name, "output_norm.weight");
    for wd in ["native", "f32", "bf16"] {
        for cmd in [
            vec![
                "sample",
                p(&g),
                "--prompt",
                "ab",
                "--tokens",
                "3",
                "--weights-dtype",
                wd,
            ],
            vec!["inspect", p(&g)],
        ] {
            fails_with(&cmd, &["model.norm.weight", "non-finite"]);
        }
    }
    // GGUF, a Q8_0 block whose f16 scale is NaN.
    let (g, name) = patched_gguf(
        d.path(),
        |t| t.dtype == tinygpt_cpu::dtype::DType::Q8_0,
        |b| b[..2].copy_from_slice(&0x7e00u16.to_le_bytes()),
    );
    let _ = name;
    fails_with(&["sample", p(&g), "--prompt", "ab"], &["non-finite"]);
    // GGUF, an F16 tensor holding +Inf.
    let (g, _) = patched_gguf(
        d.path(),
        |t| t.dtype == tinygpt_cpu::dtype::DType::F16,
        |b| b[..2].copy_from_slice(&0x7c00u16.to_le_bytes()),
    );
    fails_with(&["sample", p(&g), "--prompt", "ab"], &["non-finite"]);
    // Safetensors: NaN in one element of a projection, through both engines.
    let hf = tiny_copy();
    let st = hf.path().join("model.safetensors");
    patch_f32(&st, "model.layers.3.self_attn.k_proj.weight", |i, x| {
        if i == 100 {
            f32::NAN
        } else {
            x
        }
    });
    for engine in ["optimized", "reference"] {
        fails_with(
            &["sample", p(hf.path()), "--prompt", "x", "--engine", engine],
            &["model.layers.3.self_attn.k_proj.weight", "non-finite"],
        );
    }
}

/// Finite weights whose activations overflow: caught by the per-step check, named.
#[test]
fn overflowing_activations_are_caught_per_step() {
    let hf = tiny_copy();
    let st = hf.path().join("model.safetensors");
    patch_f32(&st, "model.norm.weight", |_, _| f32::MAX);
    let text = fixtures().join("heldout.txt");
    for kv in ["fp32", "int4"] {
        for args in [
            vec![
                "sample",
                p(hf.path()),
                "--prompt",
                "x",
                "--tokens",
                "3",
                "--kv-quantize",
                kv,
            ],
            vec![
                "perplexity",
                p(hf.path()),
                "--text",
                p(&text),
                "--max-tokens",
                "8",
                "--kv-quantize",
                kv,
            ],
            vec![
                "sample",
                p(hf.path()),
                "--prompt",
                "x",
                "--tokens",
                "3",
                "--engine",
                "reference",
            ],
        ] {
            fails_with(&args, &["non-finite"]);
        }
    }
}

// ---- memory flat ---------------------------------------------------------------------

#[test]
fn nothing_grows_per_token_without_json() {
    use tinygpt_cpu::generate::{generate_with, EngineRun, GenerateOptions};
    use tinygpt_cpu::kv_cache::{KvConfig, PositionsMode, Precision};
    let files = tinygpt_cpu::weights::ModelFiles::open(None).unwrap();
    let model =
        tinygpt_cpu::model::Model::load(&files, tinygpt_cpu::model::WeightsDType::Native).unwrap();
    let kv = KvConfig {
        precision: Precision::Int4,
        group_size: 32,
        sink: 4,
        window: Some(60),
        positions: PositionsMode::Original,
        ..KvConfig::default()
    };
    let prompt = files
        .tokenizer()
        .unwrap()
        .encode("Once upon a time")
        .unwrap();
    let sampler = tinygpt_cpu::sampler::SamplerConfig {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        seed: 7,
    };
    let opts = GenerateOptions::new(2000, sampler, true, &kv, 256, false).unwrap();
    opts.check_prompt(prompt.len()).unwrap();
    let mut run = EngineRun::new(&model, &kv);
    let mut streamed = 0usize;
    let res = generate_with(
        &mut run,
        files.tokenizer().unwrap(),
        &prompt,
        &opts,
        false,
        &mut |s| {
            streamed += s.len();
            Ok(())
        },
    )
    .unwrap();
    assert_eq!(res.generated_tokens, 2000);
    assert!(res.generated_ids.is_empty() && res.text.is_empty());
    assert!(streamed > 0);
    // With keep, the same run holds the ids and text, and the text is what was streamed.
    let mut run = EngineRun::new(&model, &kv);
    let mut text = String::new();
    let res = generate_with(
        &mut run,
        files.tokenizer().unwrap(),
        &prompt,
        &opts,
        true,
        &mut |s| {
            text.push_str(s);
            Ok(())
        },
    )
    .unwrap();
    assert_eq!(res.generated_ids.len(), 2000);
    assert!(res.text.starts_with(&text[..text.len().min(200)]));
}

#[test]
fn stream_decoder_holds_a_bounded_tail() {
    let files = tinygpt_cpu::weights::ModelFiles::open(None).unwrap();
    let tok = files.tokenizer().unwrap();
    let ids = tok
        .encode(&std::fs::read_to_string(fixtures().join("heldout.txt")).unwrap()[..20_000])
        .unwrap();
    let mut dec = tinygpt_cpu::tokenizer::StreamDecoder::new();
    let mut out = String::new();
    let mut max_held = 0;
    for &id in &ids {
        out.push_str(&dec.push(tok, id).unwrap());
        max_held = max_held.max(dec.held());
    }
    assert!(max_held <= 8, "held {max_held} ids");
    let full = tok.decode(&ids).unwrap();
    assert!(
        full.starts_with(out.trim_end()),
        "streamed text differs from decode"
    );
    // Ids that decode to nothing (EOS, a special token) do not pile up either.
    let eos = tok.eos_ids[0];
    let mut dec = tinygpt_cpu::tokenizer::StreamDecoder::new();
    for _ in 0..10_000 {
        dec.push(tok, eos).unwrap();
    }
    assert!(dec.held() <= tinygpt_cpu::tokenizer::StreamDecoder::MAX_PENDING + 1);
}

// ---- the context length under StreamingLLM --------------------------------------------

#[test]
fn a_window_larger_than_the_context_is_no_bound() {
    // The bundled model's context is 256.
    for args in [
        vec![
            "sample",
            "--prompt",
            "x",
            "--streaming-llm-window",
            "1000",
            "--tokens",
            "600",
        ],
        vec![
            "sample",
            "--prompt",
            "x",
            "--streaming-llm-sink",
            "300",
            "--streaming-llm-window",
            "10",
            "--tokens",
            "600",
        ],
    ] {
        fails_with(&args, &["--streaming-llm-window", "context length (256)"]);
    }
    let text = fixtures().join("heldout.txt");
    fails_with(
        &[
            "perplexity",
            "--text",
            p(&text),
            "--max-tokens",
            "600",
            "--streaming-llm-window",
            "1000",
        ],
        &["--streaming-llm-window", "256"],
    );
    // Allowed: explicitly past the context, or a window that never fills past it.
    let o = run(&[
        "sample",
        "--prompt",
        "x",
        "--streaming-llm-window",
        "1000",
        "--tokens",
        "300",
        "--allow-past-context",
        "--temperature",
        "0",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = run(&[
        "sample",
        "--prompt",
        "x",
        "--streaming-llm-window",
        "1000",
        "--tokens",
        "100",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn zero_context_length_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let mut bytes = std::fs::read(gguf_seed()).unwrap();
    let key = b"llama.context_length";
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap() + key.len();
    assert_eq!(u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()), 4); // GGUF u32
    bytes[at + 4..at + 8].copy_from_slice(&0u32.to_le_bytes());
    let g = d.path().join("ctx0.gguf");
    std::fs::write(&g, bytes).unwrap();
    fails_with(
        &[
            "sample",
            p(&g),
            "--prompt",
            "ab",
            "--streaming-llm-window",
            "8",
        ],
        &["llama.context_length"],
    );
    let hf = tiny_copy();
    edit_config(hf.path(), |v| v["max_position_embeddings"] = 0.into());
    fails_with(
        &[
            "sample",
            p(hf.path()),
            "--prompt",
            "x",
            "--streaming-llm-window",
            "8",
        ],
        &["max_position_embeddings"],
    );
}

// ---- silent acceptance ----------------------------------------------------------------

#[test]
fn inconsistent_configs_are_refused() {
    let hf = tiny_copy();
    edit_config(hf.path(), |v| v["eos_token_id"] = 5000.into());
    fails_with(&["inspect", p(hf.path())], &["eos_token_id", "5000"]);
    let hf = tiny_copy();
    edit_config(hf.path(), |v| {
        v["eos_token_id"] = serde_json::json!([1, 2048])
    });
    fails_with(&["inspect", p(hf.path())], &["eos_token_id", "2048"]);
    let hf = tiny_copy();
    edit_config(hf.path(), |v| v["model_type"] = "gpt_neox".into());
    fails_with(&["sample", p(hf.path()), "--prompt", "x"], &["gpt_neox"]);
    let hf = tiny_copy();
    edit_config(hf.path(), |v| {
        v["rope_theta"] = 500000.0.into();
    });
    fails_with(&["inspect", p(hf.path())], &["rope_theta"]);
}

/// transformers: `rope_parameters = rope_scaling or rope_parameters`.
#[test]
fn rope_scaling_wins_over_rope_parameters_as_in_transformers() {
    use tinygpt_cpu::config::{HfConfig, RopeScaling};
    let mut v: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("tiny/config.json")).unwrap(),
    )
    .unwrap();
    v["rope_scaling"] = serde_json::json!({"rope_type": "linear", "factor": 2.0});
    let cfg = HfConfig::from_json(&v.to_string(), Path::new("c.json"))
        .unwrap()
        .validate(Path::new("c.json"))
        .unwrap();
    assert_eq!(cfg.rope_scaling, RopeScaling::Linear { factor: 2.0 });
    assert_eq!(cfg.rope_theta, 10000.0);
    // An empty rope_scaling does not hide rope_parameters.
    v["rope_scaling"] = serde_json::json!({});
    v["rope_parameters"] =
        serde_json::json!({"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0});
    let cfg = HfConfig::from_json(&v.to_string(), Path::new("c.json"))
        .unwrap()
        .validate(Path::new("c.json"))
        .unwrap();
    assert_eq!(cfg.rope_scaling, RopeScaling::Linear { factor: 4.0 });
    assert_eq!(cfg.rope_theta, 500.0);
}

#[test]
fn convert_never_overwrites_its_input() {
    let hf = tiny_copy();
    for f in ["tokenizer.json", "model.safetensors", "config.json"] {
        let target = hf.path().join(f);
        let before = std::fs::read(&target).unwrap();
        fails_with(&["convert", p(hf.path()), p(&target)], &[f]);
        assert_eq!(std::fs::read(&target).unwrap(), before, "{f} was modified");
    }
    // Another spelling of the same file.
    let other = hf
        .path()
        .join("..")
        .join(hf.path().file_name().unwrap())
        .join("config.json");
    fails_with(&["convert", p(hf.path()), p(&other)], &["config.json"]);
    fails_with(&["convert", p(hf.path()), p(hf.path())], &["directory"]);
    let o = run(&["inspect", p(hf.path())]);
    assert!(o.status.success(), "{}", stderr(&o));
    // A fresh output is still written.
    let out = hf.path().join("out.tinygpt");
    let o = run(&["convert", p(hf.path()), p(&out)]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(run(&["inspect", p(&out)]).status.success());
}

#[test]
fn meaningless_requests_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let short = d.path().join("short.txt");
    std::fs::write(&short, "a b").unwrap();
    fails_with(
        &["perplexity", "--text", p(&short), "--sink-report"],
        &["--sink-report"],
    );
    let prompts = d.path().join("prompts.txt");
    std::fs::write(&prompts, "The cat\n").unwrap();
    fails_with(
        &["compare", "--prompts", p(&prompts), "--tokens", "0"],
        &["--tokens"],
    );
    let text = fixtures().join("heldout.txt");
    for spec in [
        "sink=4,sink=8,window=16",
        "dense;dense",
        "window=8, window=9",
    ] {
        fails_with(
            &[
                "perplexity",
                "--text",
                p(&text),
                "--max-tokens",
                "20",
                "--compare-modes",
                spec,
            ],
            &["--compare-modes"],
        );
    }
}

// ---- misleading errors ----------------------------------------------------------------

#[test]
fn errors_name_the_real_culprit() {
    let d = tempfile::tempdir().unwrap();
    // A .gguf without the magic.
    let fake = d.path().join("model.gguf");
    std::fs::copy(fixtures().join("tiny.tinygpt"), &fake).unwrap();
    fails_with(&["inspect", p(&fake)], &["model.gguf", "not a GGUF file"]);
    // Safetensors shape and offset errors name the tensor.
    let hf = tiny_copy();
    let st = hf.path().join("model.safetensors");
    let (mut h, data) = read_st(&st);
    h["model.norm.weight"]["shape"] = serde_json::json!([129]);
    write_st(&st, &h, &data);
    fails_with(&["inspect", p(hf.path())], &["model.norm.weight", "shape"]);
    let (mut h, data) = read_st(&st);
    h["model.norm.weight"]["shape"] = serde_json::json!([128]);
    h["model.norm.weight"]["data_offsets"] = serde_json::json!([0, 1u64 << 40]);
    write_st(&st, &h, &data);
    fails_with(
        &["inspect", p(hf.path())],
        &["model.norm.weight", "data_offsets"],
    );
    // Perplexity over the context talks about the text, not a prompt.
    let text = fixtures().join("heldout.txt");
    let o = run(&["perplexity", "--text", p(&text), "--max-tokens", "600"]);
    refused(
        &o,
        "perplexity past the context",
        &["heldout.txt", "--max-tokens"],
    );
    assert!(!stderr(&o).contains("prompt") && !stderr(&o).contains("--tokens"));
    // --max-tokens 1 blames the flag.
    fails_with(
        &["perplexity", "--text", p(&text), "--max-tokens", "1"],
        &["--max-tokens"],
    );
    // A bad --plot path is refused before the evaluation, and after it the results stay.
    let t0 = Instant::now();
    fails_with(
        &[
            "perplexity",
            "--text",
            p(&text),
            "--max-tokens",
            "200",
            "--plot",
            "/nonexistent/dir/x.png",
        ],
        &["--plot", "/nonexistent/dir/x.png"],
    );
    assert!(t0.elapsed() < Duration::from_secs(20));
    fails_with(
        &["cache-table", "--plot", "/nonexistent/dir/x.svg"],
        &["--plot"],
    );
    // Negative numbers reach validation instead of clap's '-- -1' tip.
    let o = run(&["sample", "--prompt", "x", "--temperature", "-1"]);
    refused(&o, "--temperature -1", &["--temperature", "-1"]);
    assert!(!stderr(&o).contains("-- -1"));
    fails_with(
        &["sample", "--prompt", "x", "--top-p", "-0.5"],
        &["--top-p"],
    );
    // A prompt may start with '-'.
    let o = run(&["sample", "--prompt", "-x", "--tokens", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // compare --prompts BINARY names --prompts.
    let bin_file = d.path().join("prompts.bin");
    std::fs::write(&bin_file, [0u8, 1, 2, 3]).unwrap();
    let o = run(&["compare", "--prompts", p(&bin_file)]);
    refused(&o, "compare --prompts BINARY", &["--prompts"]);
    assert!(!stderr(&o).contains("--text"));
}

/// A GGUF token list shorter than the merges need: the metadata key, not a JSON position.
#[test]
fn gguf_tokenizer_errors_name_the_metadata() {
    use std::collections::BTreeMap;
    use tinygpt_cpu::gguf::{GgufArray, GgufValue};
    let g = tinygpt_cpu::gguf::GgufFile::open(&gguf_seed()).unwrap();
    let mut meta: BTreeMap<String, GgufValue> = g.metadata().clone();
    let Some(GgufValue::Array(GgufArray::String(tokens))) =
        meta.get("tokenizer.ggml.tokens").cloned()
    else {
        panic!("seed has a token list")
    };
    let short: Vec<String> = tokens
        .iter()
        .filter(|t| t.as_str() != "ab")
        .cloned()
        .collect();
    meta.insert(
        "tokenizer.ggml.tokens".into(),
        GgufValue::Array(GgufArray::String(short.clone())),
    );
    meta.insert(
        "tokenizer.ggml.token_type".into(),
        GgufValue::Array(GgufArray::I32(vec![1; short.len()])),
    );
    let e = tinygpt_cpu::gguf::tokenizer::build(&meta, Path::new("m.gguf"))
        .expect_err("refused")
        .to_string();
    assert!(
        e.contains("tokenizer.ggml.merges") && e.contains("\"ab\""),
        "{e}"
    );
    assert!(!e.contains("line 1"), "{e}");
}

// ---- SIGINT -----------------------------------------------------------------------------

/// CPU time (user + system) a process has used, from /proc/PID/stat.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the parenthesised command name; utime and stime are the 14th and 15th.
    let rest = stat.rsplit_once(')').map_or("", |r| r.1);
    let f: Vec<f64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0.0))
        .collect();
    // SAFETY: sysconf has no preconditions.
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (f.get(11).unwrap_or(&0.0) + f.get(12).unwrap_or(&0.0)) / tick
}

fn interrupt_after(
    mut child: std::process::Child,
    first_output: bool,
    what: &str,
) -> (Output, String) {
    let mut out = child.stdout.take().unwrap();
    let mut seen = Vec::new();
    if first_output {
        // Wait until text streams: the decode loop is running.
        let mut b = [0u8; 64];
        let n = out.read(&mut b).unwrap();
        seen.extend_from_slice(&b[..n]);
    } else {
        // Wait until it has run for a while on the CPU (past loading and tokenising,
        // whatever the machine's load).
        while cpu_seconds(child.id()) < 1.5 {
            assert!(child.try_wait().unwrap().is_none(), "{what} ended early");
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    // SAFETY: kill() with a pid we spawned and a valid signal number.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGINT) }, 0);
    let t0 = Instant::now();
    out.read_to_end(&mut seen).unwrap();
    let o = wait_for(child, Duration::from_secs(30), what);
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "{what}: slow to stop"
    );
    (o, String::from_utf8_lossy(&seen).into_owned())
}

#[test]
fn ctrl_c_stops_with_the_partial_report() {
    let child = bin()
        .args([
            "sample",
            "--prompt",
            "Once upon a time",
            "--tokens",
            "100000000",
            "--ignore-eos",
        ])
        .args(FLAGSHIP_CACHE_FLAGS)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (o, _) = interrupt_after(child, true, "sample");
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(130), "{err}");
    assert!(
        err.contains("generated") && err.contains("[kv] int4"),
        "{err}"
    );
    assert!(
        err.contains("interrupted") && !err.contains("panicked"),
        "{err}"
    );

    // perplexity over a long text: the partial perplexity is printed.
    let d = tempfile::tempdir().unwrap();
    let long = d.path().join("long.txt");
    let text = std::fs::read_to_string(fixtures().join("heldout.txt")).unwrap();
    // ~10K tokens: tokenised at once, tens of seconds for the scalar reference engine.
    let cut = (40_000..).find(|&i| text.is_char_boundary(i)).unwrap();
    std::fs::write(&long, &text[..cut]).unwrap();
    let child = bin()
        .args([
            "perplexity",
            "--text",
            p(&long),
            "--streaming-llm-window",
            "256",
            "--engine",
            "reference",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (o, out) = interrupt_after(child, false, "perplexity");
    let err = stderr(&o);
    assert_eq!(o.status.code(), Some(130), "{err}");
    assert!(out.contains("perplexity"), "no partial result: {out}");
    assert!(err.contains("interrupted"), "{err}");
}

// ---- crashes found by the fuzzers -----------------------------------------------------

/// Every input in fuzz/regressions/TARGET/ goes through what that fuzz target runs: an
/// error is fine, a panic is not.
#[test]
fn fuzz_regressions_do_not_panic() {
    let dir = root().join("fuzz/regressions");
    let mut n = 0;
    for target in std::fs::read_dir(&dir).unwrap() {
        let target = target.unwrap().path();
        for f in std::fs::read_dir(&target).unwrap() {
            let f = f.unwrap().path();
            let data = std::fs::read(&f).unwrap();
            match target.file_name().unwrap().to_str().unwrap() {
                "safetensors_load" => {
                    // Refused by the checks or, built on its own thread, by the tokenizer.
                    let r = tinygpt_cpu::weights::ModelFiles::from_tinygpt_bytes(
                        &data,
                        Path::new("fuzz.tinygpt"),
                    )
                    .and_then(|files| files.tokenizer().map(|_| ()));
                    assert!(r.is_err(), "{}", f.display());
                }
                "config_json" => {
                    let text = String::from_utf8_lossy(&data);
                    if let Ok(c) = tinygpt_cpu::config::HfConfig::from_json(&text, &f) {
                        let _ = c.validate(&f);
                    }
                }
                other => panic!("no runner for fuzz target {other}"),
            }
            n += 1;
        }
    }
    assert!(n >= 1);
}

/// The first crash: a syntax error inside tokenizer.json's "decoder" object made the
/// tokenizers crate panic ("Helper") instead of returning an error.
#[test]
fn tokenizer_json_syntax_error_in_the_decoder_is_an_error() {
    let hf = tiny_copy();
    let path = hf.path().join("tokenizer.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let at = text.find("\"decoder\"").expect("a decoder");
    let broken = format!(
        "{}\"decoder\": {{\"type\": \"ByteLevel\", \"add_prefix_space\": treu}}, \"_x\":{}",
        &text[..at],
        &text[at + "\"decoder\":".len()..]
    );
    std::fs::write(&path, broken).unwrap();
    fails_with(
        &["inspect", p(hf.path())],
        &["tokenizer.json", "not valid JSON"],
    );
}
