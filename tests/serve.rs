//! `tinygpt-cpu serve`: the batched multi-sequence step against the solo path, and the
//! HTTP server run as a user runs it (the binary on an ephemeral loopback port).

mod common;
use common::server::*;
use common::*;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};
use tinygpt_cpu::generate::EngineRun;
use tinygpt_cpu::kv_cache::{KvConfig, PositionsMode, Precision};
use tinygpt_cpu::model::{Model, SeqStep, WeightsDType};
use tinygpt_cpu::weights::ModelFiles;

// ---------------------------------------------------------------------------------------
// Engine: Model::forward_sequences

/// Every cache mode: precision × {dense, sink + window (both positions modes)}. The
/// window is small enough that the longest sequence evicts rows.
fn cache_modes() -> Vec<KvConfig> {
    let mut modes = Vec::new();
    for p in Precision::ALL {
        let base = KvConfig {
            precision: p,
            group_size: 8,
            ..KvConfig::default()
        };
        modes.push(base.clone());
        for positions in [PositionsMode::Original, PositionsMode::Cache] {
            modes.push(KvConfig {
                sink: 4,
                window: Some(20),
                positions,
                ..base.clone()
            });
        }
    }
    modes
}

/// Runs sequences as the server's scheduler does: sequence `i` joins at step `3 i`, its
/// prompt is prefilled in chunks of at most `chunk` tokens (mixed with the others'
/// decode tokens in one batched step), then it decodes greedily. Returns, per sequence,
/// the greedy ids and the logits that chose each.
fn batched_greedy(
    model: &Model,
    kv: &KvConfig,
    prompts: &[Vec<u32>],
    n: usize,
    chunk: usize,
) -> Vec<Greedy> {
    let mut sessions: Vec<_> = prompts.iter().map(|_| model.session(kv)).collect();
    let mut done_prompt = vec![0usize; prompts.len()];
    let mut next = vec![0u32; prompts.len()];
    let mut out: Vec<Greedy> = prompts
        .iter()
        .map(|_| Greedy {
            ids: Vec::new(),
            logits: Vec::new(),
        })
        .collect();
    let mut step = 0;
    while out.iter().any(|g| g.ids.len() < n) {
        let mut steps = Vec::new();
        let mut who = Vec::new();
        for (i, s) in sessions.iter_mut().enumerate() {
            if step < 3 * i || out[i].ids.len() >= n {
                continue;
            }
            let p = &prompts[i];
            if done_prompt[i] < p.len() {
                let take = (p.len() - done_prompt[i]).min(chunk);
                steps.push(SeqStep {
                    session: s,
                    tokens: &p[done_prompt[i]..done_prompt[i] + take],
                    start: done_prompt[i],
                    all_logits: None,
                });
                who.push((i, take));
            } else {
                steps.push(SeqStep {
                    session: s,
                    tokens: std::slice::from_ref(&next[i]),
                    start: p.len() + out[i].ids.len() - 1,
                    all_logits: None,
                });
                who.push((i, 1));
            }
        }
        model.forward_sequences(&mut steps).unwrap();
        drop(steps);
        for (i, take) in who {
            if done_prompt[i] < prompts[i].len() {
                done_prompt[i] += take;
                if done_prompt[i] < prompts[i].len() {
                    continue;
                }
            }
            let logits = sessions[i].logits.clone();
            next[i] = argmax(&logits);
            out[i].ids.push(next[i]);
            out[i].logits.push(logits);
        }
        step += 1;
    }
    out
}

#[test]
fn batched_step_equals_solo_for_every_cache_mode() {
    batched_equals_solo(&ModelFiles::open(None).unwrap(), cache_modes());
}

/// The same on the YOCO fixture (3 of 6 layers share K/V, sliding lower layers): a shared
/// layer reads its source's cache, and a prompt chunk must not let its queries see the
/// chunk's later rows.
#[test]
fn batched_step_equals_solo_with_shared_kv_layers() {
    let files = ModelFiles::open(Some(&fixtures().join("yoco"))).unwrap();
    assert!(files.config.num_kv_shared_layers > 0);
    let modes = cache_modes()
        .into_iter()
        .filter(|kv| matches!(kv.precision, Precision::Fp32 | Precision::Int4))
        .collect();
    batched_equals_solo(&files, modes);
}

fn batched_equals_solo(files: &ModelFiles, modes: Vec<KvConfig>) {
    let model = Model::load(files, WeightsDType::Native).unwrap();
    let texts = [
        "The",
        "import os\nimport sys\n",
        "The following methods are defined for the objects of this module, \
         and they return a new list of the items in the order given.",
    ];
    let prompts: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| files.tokenizer().unwrap().encode(t).unwrap())
        .collect();
    assert!(
        prompts[2].len() > 20,
        "the long prompt spans several chunks"
    );
    let n = 48;
    for kv in modes {
        let batched = batched_greedy(&model, &kv, &prompts, n, 8);
        for (i, p) in prompts.iter().enumerate() {
            // The solo path `sample` runs (token by token through `Model::forward`).
            let mut run = EngineRun::new(&model, &kv);
            let solo = greedy(&mut run, p, n);
            assert_eq!(
                batched[i].ids,
                solo.ids,
                "sequence {i} (prompt {} tokens), {kv:?}",
                p.len()
            );
            for (s, (a, b)) in batched[i].logits.iter().zip(&solo.logits).enumerate() {
                assert!(
                    a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "sequence {i} step {s}: logits differ in bits, {kv:?}"
                );
            }
        }
    }
}

#[test]
fn batched_step_rejects_out_of_vocabulary_tokens() {
    let files = ModelFiles::open(None).unwrap();
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    let mut s = model.session(&KvConfig::default());
    let bad = [model.cfg.vocab_size as u32];
    let err = model
        .forward_sequences(&mut [SeqStep {
            session: &mut s,
            tokens: &bad,
            start: 0,
            all_logits: None,
        }])
        .unwrap_err();
    assert!(
        err.to_string().contains("outside the model's vocabulary"),
        "{err}"
    );
}

#[test]
fn worst_case_bytes_bound_a_real_run() {
    // The admission estimate against the bytes a real cache reports during generation.
    let files = ModelFiles::open(None).unwrap();
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    let prompt = files.tokenizer().unwrap().encode("The").unwrap();
    for kv in cache_modes() {
        let n = 60;
        let bound = tinygpt_cpu::server::worst_case_kv_bytes(&model.cfg, &kv, prompt.len() + n);
        let mut s = model.session(&kv);
        let mut peak = 0;
        let mut t = prompt[0];
        for pos in 0..prompt.len() + n {
            if pos < prompt.len() {
                t = prompt[pos];
            }
            model.forward(&mut s, t, pos).unwrap();
            t = argmax(&s.logits);
            peak = peak.max(s.cache.bytes());
        }
        assert_eq!(bound, peak, "{kv:?}");
        if kv.window.is_some() {
            // Bounded: a 100x longer request costs the same.
            assert_eq!(
                tinygpt_cpu::server::worst_case_kv_bytes(&model.cfg, &kv, 100 * (prompt.len() + n)),
                bound,
                "{kv:?}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// The server binary

fn stream_text(chunks: &[serde_json::Value]) -> String {
    chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect()
}

/// `sample --temperature 0 --json` text for `prompt` with extra cache flags.
fn sample_text(
    model: Option<&PathBuf>,
    prompt: &str,
    tokens: usize,
    flags: &[&str],
    chat: bool,
) -> String {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tinygpt-cpu"));
    c.arg("sample");
    if let Some(m) = model {
        c.arg(m);
    }
    c.args([
        "--prompt",
        prompt,
        "--temperature",
        "0",
        "--json",
        "--tokens",
    ])
    .arg(tokens.to_string())
    .args(flags);
    if chat {
        c.arg("--chat");
    }
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["text"].as_str().unwrap().to_string()
}

#[test]
fn greedy_completions_equal_sample_while_other_requests_run() {
    let srv = Server::start(&[]);
    let cases: [(&str, usize, serde_json::Value, &[&str]); 5] = [
        ("The", 40, serde_json::json!({}), &[]),
        (
            "import os\n",
            60,
            serde_json::json!({"kv_quantize": "int4", "streaming_llm_sink": 4, "streaming_llm_window": 24, "kv_group_size": 8}),
            &[
                "--kv-quantize",
                "int4",
                "--streaming-llm-sink",
                "4",
                "--streaming-llm-window",
                "24",
                "--kv-group-size",
                "8",
            ],
        ),
        (
            "The following methods are defined for the objects",
            50,
            serde_json::json!({"kv_quantize": "int8", "streaming_llm_window": 16, "streaming_llm_positions": "cache"}),
            &[
                "--kv-quantize",
                "int8",
                "--streaming-llm-window",
                "16",
                "--streaming-llm-positions",
                "cache",
            ],
        ),
        (
            "def main():\n",
            50,
            serde_json::json!({"kv_quantize_k": "int4", "kv_quantize_v": "int2", "kv_residual": 8,
                "kv_key_rope": "pre", "streaming_llm_sink": 4, "streaming_llm_window": 28, "kv_group_size": 8}),
            &[
                "--kv-quantize-k",
                "int4",
                "--kv-quantize-v",
                "int2",
                "--kv-residual",
                "8",
                "--kv-key-rope",
                "pre",
                "--streaming-llm-sink",
                "4",
                "--streaming-llm-window",
                "28",
                "--kv-group-size",
                "8",
            ],
        ),
        (
            "class Foo:\n",
            40,
            serde_json::json!({"kv_quantize": "int4", "kv_rotation": "none", "kv_group_size": 8}),
            &[
                "--kv-quantize",
                "int4",
                "--kv-rotation",
                "none",
                "--kv-group-size",
                "8",
            ],
        ),
    ];
    std::thread::scope(|sc| {
        // Background load: sampled streams with different lengths and seeds.
        let noise: Vec<_> = (0..5)
            .map(|i| {
                let srv = &srv;
                sc.spawn(move || {
                    let r = post_json(&srv.url("/v1/completions"))
                        .send_string(
                            &serde_json::json!({"prompt": "In the", "max_tokens": 30 + 10 * i,
                                "temperature": 0.9, "seed": i, "stream": true, "ignore_eos": true})
                            .to_string(),
                        )
                        .unwrap();
                    let (chunks, done) = read_sse(r.into_reader());
                    assert!(done);
                    chunks.len()
                })
            })
            .collect();
        let greedy: Vec<_> = cases
            .iter()
            .map(|(prompt, n, extra, _)| {
                let srv = &srv;
                sc.spawn(move || {
                    let mut body =
                        serde_json::json!({"prompt": prompt, "max_tokens": n, "temperature": 0});
                    for (k, v) in extra.as_object().unwrap() {
                        body[k] = v.clone();
                    }
                    let (code, v) = srv.post("/v1/completions", body);
                    assert_eq!(code, 200, "{v}");
                    v["choices"][0]["text"].as_str().unwrap().to_string()
                })
            })
            .collect();
        for ((prompt, n, _, flags), h) in cases.iter().zip(greedy) {
            let got = h.join().unwrap();
            let want = sample_text(None, prompt, *n, flags, false);
            assert_eq!(got, want, "prompt {prompt:?} flags {flags:?}");
        }
        for h in noise {
            assert!(h.join().unwrap() > 1);
        }
    });
    assert!(srv.metric("tinygpt_tokens_generated_total") >= 150.0);
    assert_eq!(srv.metric_settled("tinygpt_admitted_sequences", 0.0), 0.0);
}

#[test]
fn streaming_equals_non_streaming_and_ends_with_done() {
    let srv = Server::start(&["--kv-quantize", "int4"]);
    let body = serde_json::json!({"prompt": "The", "max_tokens": 30, "temperature": 0.8, "seed": 7,
        "top_k": 20, "top_p": 0.9});
    let (code, whole) = srv.post("/v1/completions", body.clone());
    assert_eq!(code, 200);
    let mut sbody = body.clone();
    sbody["stream"] = serde_json::json!(true);
    let r = post_json(&srv.url("/v1/completions"))
        .send_string(&sbody.to_string())
        .unwrap();
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let (chunks, done) = read_sse(r.into_reader());
    assert!(done, "the stream ends with data: [DONE]");
    assert_eq!(
        stream_text(&chunks),
        whole["choices"][0]["text"].as_str().unwrap()
    );
    let last = chunks.last().unwrap();
    assert_eq!(
        last["choices"][0]["finish_reason"],
        whole["choices"][0]["finish_reason"]
    );
    assert_eq!(last["usage"], whole["usage"]);
    assert_eq!(whole["usage"]["completion_tokens"], 30);
    // Same seed, same text; a stop string cuts it.
    let (_, again) = srv.post("/v1/completions", body.clone());
    assert_eq!(again["choices"][0]["text"], whole["choices"][0]["text"]);
    let text = whole["choices"][0]["text"].as_str().unwrap();
    let stop: String = text.chars().skip(5).take(3).collect();
    let cut = text.find(&stop).unwrap();
    let mut b = body.clone();
    b["stop"] = serde_json::json!([stop]);
    let (_, stopped) = srv.post("/v1/completions", b.clone());
    assert_eq!(stopped["choices"][0]["text"], &text[..cut]);
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    b["stream"] = serde_json::json!(true);
    let r = post_json(&srv.url("/v1/completions"))
        .send_string(&b.to_string())
        .unwrap();
    let (chunks, _) = read_sse(r.into_reader());
    assert_eq!(
        stream_text(&chunks),
        &text[..cut],
        "streamed text holds back a partial stop string"
    );
}

#[test]
fn bad_requests_get_400_naming_the_field() {
    let srv = Server::start(&["--streaming-llm-sink", "4", "--streaming-llm-window", "60"]);
    let cases = [
        (
            serde_json::json!({"prompt": "x", "temperature": "hot"}),
            "temperature",
        ),
        (
            serde_json::json!({"prompt": "x", "temperature": -1}),
            "temperature",
        ),
        (serde_json::json!({"prompt": "x", "top_p": 0}), "top_p"),
        (serde_json::json!({"prompt": "x", "top_k": -3}), "top_k"),
        (
            serde_json::json!({"prompt": "x", "max_tokens": 0}),
            "max_tokens",
        ),
        (serde_json::json!({"prompt": "x", "seed": "s"}), "seed"),
        (serde_json::json!({"prompt": "x", "stop": [1]}), "stop"),
        (
            serde_json::json!({"prompt": "x", "kv_quantize": "int3"}),
            "kv_quantize",
        ),
        (
            serde_json::json!({"prompt": "x", "kv_quantize_k": "int5"}),
            "kv_quantize_k",
        ),
        (
            serde_json::json!({"prompt": "x", "kv_quantize_v": 4}),
            "kv_quantize_v",
        ),
        (
            serde_json::json!({"prompt": "x", "kv_residual": -1}),
            "kv_residual",
        ),
        (
            serde_json::json!({"prompt": "x", "kv_key_rope": "both"}),
            "kv_key_rope",
        ),
        (
            serde_json::json!({"prompt": "x", "kv_rotation": "givens"}),
            "kv_rotation",
        ),
        (
            serde_json::json!({"prompt": "x", "kv_group_size": 0}),
            "kv_group_size",
        ),
        (
            serde_json::json!({"prompt": "x", "streaming_llm_window": 0}),
            "streaming_llm_window",
        ),
        (
            serde_json::json!({"prompt": "x", "streaming_llm_positions": "sideways"}),
            "streaming_llm_positions",
        ),
        (
            serde_json::json!({"prompt": "x", "ignore_eos": "yes"}),
            "ignore_eos",
        ),
        (serde_json::json!({"prompt": "x", "n": 2}), "n"),
        (serde_json::json!({"prompt": [999999]}), "prompt"),
        (serde_json::json!({"max_tokens": 3}), "prompt"),
        (serde_json::json!({"prompt": {"a": 1}}), "prompt"),
        (serde_json::json!(["not an object"]), "body"),
    ];
    for (body, param) in cases {
        let (code, v) = srv.post("/v1/completions", body.clone());
        assert_eq!(code, 400, "{body} -> {v}");
        assert_eq!(v["error"]["param"], param, "{body} -> {v}");
        assert!(
            v["error"]["message"].as_str().unwrap().starts_with(param),
            "{v}"
        );
    }
    // Dense override past the bundled model's context (256) names max_tokens.
    let (code, v) = srv.post(
        "/v1/completions",
        serde_json::json!({"prompt": "x", "max_tokens": 300, "kv_quantize": "fp32"}),
    );
    assert_eq!(code, 200, "the server default is bounded: {v}");
    let srv2 = Server::start(&[]);
    let (code, v) = srv2.post(
        "/v1/completions",
        serde_json::json!({"prompt": "x", "max_tokens": 300}),
    );
    assert_eq!(code, 400);
    assert_eq!(v["error"]["param"], "max_tokens");
    // Chat without a chat template, wrong model name.
    let (code, v) = srv.post(
        "/v1/chat/completions",
        serde_json::json!({"messages": [{"role": "user", "content": "hi"}]}),
    );
    assert_eq!(
        (code, v["error"]["param"].as_str()),
        (400, Some("messages"))
    );
    let (code, v) = srv.post(
        "/v1/completions",
        serde_json::json!({"prompt": "x", "model": "gpt-4"}),
    );
    assert_eq!((code, v["error"]["param"].as_str()), (404, Some("model")));
    let models: serde_json::Value = serde_json::from_str(&srv.get("/v1/models")).unwrap();
    assert_eq!(models["data"][0]["id"], "tinygpt-cpu-default");
    assert_eq!(srv.get("/health"), r#"{"status":"ok"}"#);
}

#[test]
fn admission_answers_429_with_retry_after_and_cancel_frees_the_slot() {
    // Room for exactly one 200-token fp32 sequence of the bundled model.
    let one = tinygpt_cpu::server::worst_case_kv_bytes(
        &ModelFiles::open(None).unwrap().config,
        &KvConfig::default(),
        2 + 200,
    );
    let budget = (one + one / 2).to_string();
    let srv = Server::start(&[
        "--kv-budget",
        &budget,
        "--max-sequences",
        "2",
        "--max-queue",
        "0",
    ]);
    let long = serde_json::json!({"prompt": "The", "max_tokens": 200, "ignore_eos": true,
        "temperature": 0.8, "seed": 1, "stream": true});
    let r = post_json(&srv.url("/v1/completions"))
        .send_string(&long.to_string())
        .unwrap();
    let mut reader = BufReader::new(r.into_reader());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(line.starts_with("data: "), "{line}");
    // A second one does not fit in what is left: 429 + Retry-After.
    match post_json(&srv.url("/v1/completions")).send_string(&long.to_string()) {
        Err(ureq::Error::Status(429, r)) => {
            assert_eq!(r.header("retry-after"), Some("1"));
            let v: serde_json::Value = serde_json::from_str(&r.into_string().unwrap()).unwrap();
            assert!(
                v["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("KV budget"),
                "{v}"
            );
        }
        other => panic!("expected 429, got {:?}", other.map(|r| r.status())),
    }
    // A small one fits beside it.
    let (code, _) = srv.post(
        "/v1/completions",
        serde_json::json!({"prompt": "The", "max_tokens": 4}),
    );
    assert_eq!(code, 200);
    assert_eq!(srv.metric("tinygpt_admitted_sequences"), 1.0);
    assert!(srv.metric("tinygpt_requests_rejected_total") >= 1.0);
    // The client goes away: the scheduler cancels the sequence and frees its admission.
    drop(reader);
    let t0 = Instant::now();
    while srv.metric("tinygpt_admitted_sequences") != 0.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "cancellation not seen"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(srv.metric("tinygpt_requests_cancelled_total"), 1.0);
    assert_eq!(srv.metric("tinygpt_kv_bytes_reserved"), 0.0);
    // --max-sequences: two long ones fill the slots (budget permitting is not the limit here).
    let srv = Server::start(&["--max-sequences", "1", "--max-queue", "0"]);
    let r = post_json(&srv.url("/v1/completions"))
        .send_string(&long.to_string())
        .unwrap();
    let mut reader = BufReader::new(r.into_reader());
    reader.read_line(&mut line).unwrap();
    match post_json(&srv.url("/v1/completions")).send_string(&long.to_string()) {
        Err(ureq::Error::Status(429, r)) => assert_eq!(r.header("retry-after"), Some("1")),
        other => panic!("expected 429, got {:?}", other.map(|r| r.status())),
    }
}

#[cfg(unix)]
#[test]
fn sigterm_drains_running_requests_then_exits() {
    let mut srv = Server::start(&[]);
    let body = serde_json::json!({"prompt": "The", "max_tokens": 150, "ignore_eos": true,
        "temperature": 0, "stream": true});
    let r = post_json(&srv.url("/v1/completions"))
        .send_string(&body.to_string())
        .unwrap();
    let mut reader = BufReader::new(r.into_reader());
    let mut first = String::new();
    reader.read_line(&mut first).unwrap();
    // SAFETY: plain kill(2) on our own child's pid.
    let rc = unsafe { libc::kill(srv.child.id() as i32, libc::SIGTERM) };
    assert_eq!(rc, 0);
    // The running request still completes.
    let (chunks, done) = read_sse(reader);
    assert!(done, "drained request ends with [DONE]");
    let last = chunks.last().unwrap();
    assert_eq!(last["usage"]["completion_tokens"], 150);
    // Then the process exits cleanly and stops accepting.
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = srv.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "server did not exit"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
    assert!(ureq::get(&srv.url("/health")).call().is_err());
}

// ---------------------------------------------------------------------------------------
// SmolLM2 (skipped without the GGUF): chat through the model's template.

#[test]
fn smollm2_greedy_chat_equals_sample_chat_under_load() {
    let Some(model) = smollm2_path() else {
        return;
    };
    let m = model.to_str().unwrap();
    let flags = FLAGSHIP_CACHE_FLAGS;
    let mut args = vec![m];
    args.extend(flags);
    let srv = Server::start(&args);
    let models: serde_json::Value = serde_json::from_str(&srv.get("/v1/models")).unwrap();
    let id = models["data"][0]["id"].as_str().unwrap().to_string();
    let questions = [
        "What is the capital of France?",
        "Name three colours.",
        "What is 2+2?",
    ];
    std::thread::scope(|sc| {
        let hs: Vec<_> = questions
            .iter()
            .map(|q| {
                let (srv, id) = (&srv, &id);
                sc.spawn(move || {
                    let (code, v) = srv.post(
                        "/v1/chat/completions",
                        serde_json::json!({"model": id, "messages": [{"role": "user", "content": q}],
                            "max_tokens": 40, "temperature": 0}),
                    );
                    assert_eq!(code, 200, "{v}");
                    v["choices"][0]["message"]["content"].as_str().unwrap().to_string()
                })
            })
            .collect();
        let noise: Vec<_> = (0..4)
            .map(|i| {
                let srv = &srv;
                sc.spawn(move || {
                    srv.post(
                        "/v1/completions",
                        serde_json::json!({"prompt": "Once upon a time", "max_tokens": 40,
                            "temperature": 1.0, "seed": i, "ignore_eos": true}),
                    )
                    .0
                })
            })
            .collect();
        for (q, h) in questions.iter().zip(hs) {
            let got = h.join().unwrap();
            let want = sample_text(Some(&model), q, 40, &flags, true);
            assert_eq!(got, want, "{q}");
        }
        for h in noise {
            assert_eq!(h.join().unwrap(), 200);
        }
    });
}
