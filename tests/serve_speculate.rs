//! `serve` with speculative decoding (`--speculate`, the request's `speculate`;
//! docs/design.md §3.3, §4), through the binary: greedy requests batched together give
//! what they give without drafts in every cache mode, on 1 and 2 threads; a request
//! resuming from a speculated sequence's kept cache answers what recomputing answers; a
//! bounded cache keeps exactly the rows it keeps without drafts (its saved state is the
//! same file); the request field overrides the server's default and bad values are a 400
//! naming it; sampled requests with drafts have the distribution of sampled requests
//! without (a two-sample test over many seeds, four requests at a time). Each test reads
//! `/metrics` to make sure drafts were accepted, so it fails if speculation never ran.

mod common;
use common::server::*;
use common::*;
use serde_json::{json, Value};
use tinygpt_cpu::generate::EngineRun;
use tinygpt_cpu::kv_cache::{KvConfig, Precision};
use tinygpt_cpu::model::{Model, WeightsDType};
use tinygpt_cpu::weights::ModelFiles;

/// Prompts whose text repeats, so that prompt-lookup drafts are found (and, as the tiny
/// model soon loops, accepted).
const PROMPTS: [&str; 3] = [
    "one two three four five six. one two three four five six. one two three",
    "import os\nimport sys\nimport os\nimport sys\nimport os\n",
    "The cat sat on the mat. The dog sat on the mat. The cat sat on the",
];

/// The cache modes, as request fields: fp32, int8, int4, int2 + residual, int4 sink +
/// window in both position modes.
fn modes() -> Vec<Value> {
    vec![
        json!({}),
        json!({"kv_quantize": "int8"}),
        json!({"kv_quantize": "int4", "kv_group_size": 8}),
        json!({"kv_quantize": "int2", "kv_residual": 8, "kv_group_size": 8}),
        json!({"kv_quantize": "int4", "kv_group_size": 8, "streaming_llm_sink": 4,
            "streaming_llm_window": 20, "streaming_llm_positions": "original"}),
        json!({"kv_quantize": "int4", "kv_group_size": 8, "streaming_llm_sink": 4,
            "streaming_llm_window": 20, "streaming_llm_positions": "cache"}),
    ]
}

fn with(fields: &Value, mut body: Value) -> Value {
    for (k, v) in fields.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// A completion's (text, finish reason, completion tokens).
fn outcome(v: &Value) -> (String, String, u64) {
    (
        v["choices"][0]["text"].as_str().unwrap().to_string(),
        v["choices"][0]["finish_reason"]
            .as_str()
            .unwrap()
            .to_string(),
        v["usage"]["completion_tokens"].as_u64().unwrap(),
    )
}

fn post_ok(srv: &Server, body: Value) -> Value {
    let (code, v) = srv.post("/v1/completions", body);
    assert_eq!(code, 200, "{v}");
    v
}

fn accepted(srv: &Server) -> f64 {
    srv.metric("tinygpt_speculate_accepted_total")
}

/// Per cache mode, every prompt twice at once, with drafts and with `"speculate": false`
/// (six sequences batched, joining as they come; with the prompt cache on, so passes run
/// under its hold and later requests may resume from earlier ones): the same text, finish
/// reason and token count, and drafts were accepted in that mode. `extra_args`: server
/// flags.
fn greedy_equal_with_and_without(extra_args: &[&str], modes: &[Value], n: usize) {
    let mut args = vec!["--speculate", "ngram"];
    args.extend_from_slice(extra_args);
    let srv = Server::start(&args);
    for fields in modes {
        let before = accepted(&srv);
        std::thread::scope(|sc| {
            let runs: Vec<_> = PROMPTS
                .iter()
                .flat_map(|p| [(p, true), (p, false)])
                .map(|(prompt, spec)| {
                    let srv = &srv;
                    sc.spawn(move || {
                        let mut body = with(
                            fields,
                            json!({"prompt": prompt, "max_tokens": n, "temperature": 0,
                                "ignore_eos": true}),
                        );
                        if !spec {
                            body["speculate"] = json!(false);
                        }
                        outcome(&post_ok(srv, body))
                    })
                })
                .collect();
            let got: Vec<_> = runs.into_iter().map(|h| h.join().unwrap()).collect();
            for (i, pair) in got.chunks(2).enumerate() {
                assert_eq!(
                    pair[0], pair[1],
                    "{extra_args:?} {fields}: prompt {:?} with drafts, then without",
                    PROMPTS[i]
                );
                assert_eq!(pair[0].2, n as u64);
            }
        });
        let gained = accepted(&srv) - before;
        assert!(gained > 0.0, "{extra_args:?} {fields}: no draft accepted");
    }
    let (drafted, passes) = (
        srv.metric("tinygpt_speculate_drafted_total"),
        srv.metric("tinygpt_speculate_passes_total"),
    );
    assert!(drafted >= accepted(&srv) && passes > 0.0);
    assert_eq!(srv.metric_settled("tinygpt_admitted_sequences", 0.0), 0.0);
}

#[test]
fn greedy_with_drafts_equals_without_in_every_cache_mode_one_thread() {
    greedy_equal_with_and_without(&["--threads", "1"], &modes(), 48);
}

#[test]
fn greedy_with_drafts_equals_without_in_every_cache_mode_two_threads() {
    greedy_equal_with_and_without(&["--threads", "2"], &modes(), 48);
}

/// YOCO (shared K/V layers, sliding lower layers): a pass of several tokens replays the
/// source layer's appends for the shared layers, as a prompt chunk does.
#[test]
fn greedy_with_drafts_equals_without_on_yoco() {
    let yoco = fixtures().join("yoco");
    let modes = [
        json!({}),
        json!({"kv_quantize": "int4", "kv_group_size": 8, "streaming_llm_sink": 4,
            "streaming_llm_window": 20}),
    ];
    for threads in ["1", "2"] {
        greedy_equal_with_and_without(&[yoco.to_str().unwrap(), "--threads", threads], &modes, 40);
    }
}

/// The library's greedy ids are what a speculating server answers (drafts or not, the
/// text is the plain run's), for the dense default.
#[test]
fn speculating_server_answers_the_plain_greedy_text() {
    let files = ModelFiles::open(None).unwrap();
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    let srv = Server::start(&["--speculate", "ngram:4"]);
    for prompt in PROMPTS {
        let ids = files.tokenizer().unwrap().encode(prompt).unwrap();
        let g = greedy(&mut EngineRun::new(&model, &KvConfig::default()), &ids, 40).ids;
        let v = post_ok(
            &srv,
            json!({"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": true}),
        );
        assert_eq!(
            outcome(&v).0,
            files.tokenizer().unwrap().decode(&g).unwrap(),
            "{prompt:?}"
        );
    }
    assert!(accepted(&srv) > 0.0);
}

/// A speculated sequence's kept cache (its rows held under the prompt cache's hold, each
/// pass rewound inside it): requests resuming from it at points inside the generated part
/// answer what the same request recomputed (`cache_prompt: false`) answers, dense and
/// with an int4 sink + window cache.
#[test]
fn resuming_a_speculated_sequence_answers_what_recomputing_answers() {
    let files = ModelFiles::open(None).unwrap();
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    let srv = Server::start(&["--speculate", "ngram"]);
    let a = files.tokenizer().unwrap().encode(PROMPTS[0]).unwrap();
    let gen = 40;
    let modes = [
        (json!({}), KvConfig::default()),
        (
            json!({"kv_quantize": "int4", "streaming_llm_sink": 4, "streaming_llm_window": 20,
                "kv_group_size": 8}),
            int4_window(),
        ),
    ];
    for (fields, kv) in &modes {
        let before = accepted(&srv);
        let body = |prompt: &[u32], n: usize, cache: bool| {
            with(
                fields,
                json!({"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": true,
                    "cache_prompt": cache}),
            )
        };
        let first = post_ok(&srv, body(&a, gen, true));
        assert!(accepted(&srv) > before, "{fields}: no draft accepted");
        let g = greedy(&mut EngineRun::new(&model, kv), &a, gen).ids;
        assert_eq!(
            outcome(&first).0,
            files.tokenizer().unwrap().decode(&g).unwrap()
        );
        for m in [0, 1, 5, 13, 21, 30, gen - 1] {
            let mut b = a.clone();
            b.extend_from_slice(&g[..m]);
            let other = if g[m] == 9 { 10 } else { 9 };
            b.extend_from_slice(&[other, 11, 12]);
            let resumed = post_ok(&srv, body(&b, 16, true));
            let fresh = post_ok(&srv, body(&b, 16, false));
            let cached = &resumed["usage"]["prompt_tokens_details"]["cached_tokens"];
            assert_eq!(cached, (a.len() + m) as u64, "{fields} m={m}");
            assert_eq!(outcome(&resumed), outcome(&fresh), "{fields} m={m}");
        }
    }
}

/// A bounded cache (sink 4 + window 60, int4): a long generation with drafts leaves
/// exactly the cache it leaves without (the saved states of the two runs are the same
/// file, byte for byte), so it never stores more rows; drafts were accepted.
#[test]
fn a_bounded_cache_keeps_the_rows_it_keeps_without_drafts() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let flags = [
        "--kv-quantize",
        "int4",
        "--streaming-llm-sink",
        "4",
        "--streaming-llm-window",
        "60",
        "--state-dir",
        d,
    ];
    let n = 300;
    let run = |spec: bool, name: &str| {
        let mut args = flags.to_vec();
        if spec {
            args.extend(["--speculate", "ngram"]);
        }
        let srv = Server::start(&args);
        let v = post_ok(
            &srv,
            json!({"prompt": PROMPTS[1], "max_tokens": n, "temperature": 0, "ignore_eos": true}),
        );
        let (code, saved) = srv.post("/v1/states/save", json!({"id": v["id"], "name": name}));
        assert_eq!(code, 200, "{saved}");
        if spec {
            assert!(accepted(&srv) > 0.0, "no draft accepted");
        } else {
            assert_eq!(srv.metric("tinygpt_speculate_passes_total"), 0.0);
        }
        (outcome(&v), saved["tokens"].clone())
    };
    let with_drafts = run(true, "spec.state");
    let without = run(false, "plain.state");
    assert_eq!(with_drafts, without);
    let a = std::fs::read(dir.path().join("spec.state")).unwrap();
    let b = std::fs::read(dir.path().join("plain.state")).unwrap();
    assert!(
        a == b,
        "the saved states differ ({} and {} bytes)",
        a.len(),
        b.len()
    );
}

/// `"speculate": false` and `"off"` turn the server's default off (no pass runs); a
/// request turns drafts on in a server without a default; bad values are a 400 naming
/// `speculate`; a bad `--speculate` stops the server with one line naming the flag.
#[test]
fn the_request_field_overrides_the_default_and_bad_values_are_refused() {
    let body = |spec: Option<Value>| {
        let mut b = json!({"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0,
            "ignore_eos": true, "cache_prompt": false});
        if let Some(s) = spec {
            b["speculate"] = s;
        }
        b
    };
    let srv = Server::start(&["--speculate", "ngram:6"]);
    let passes = |srv: &Server| srv.metric("tinygpt_speculate_passes_total");
    let off = post_ok(&srv, body(Some(json!(false))));
    post_ok(&srv, body(Some(json!("off"))));
    assert_eq!(passes(&srv), 0.0, "turned off per request");
    let on = post_ok(&srv, body(Some(Value::Null)));
    assert!(passes(&srv) > 0.0, "null: the server's default");
    assert_eq!(outcome(&on), outcome(&off));
    for bad in [
        json!("draft"),
        json!("ngram:0"),
        json!("ngram:65"),
        json!("ngram:x"),
        json!(true),
        json!(4),
        json!({"kind": "ngram"}),
    ] {
        let (code, v) = srv.post("/v1/completions", body(Some(bad.clone())));
        assert_eq!(
            (code, v["error"]["param"].as_str()),
            (400, Some("speculate")),
            "{bad}: {v}"
        );
    }
    let (code, v) = srv.post(
        "/v1/chat/completions",
        json!({"messages": [{"role": "user", "content": "hi"}], "speculate": "ngram:"}),
    );
    assert_eq!(
        (code, v["error"]["param"].as_str()),
        (400, Some("speculate")),
        "{v}"
    );

    let plain = Server::start(&[]);
    post_ok(&plain, body(None));
    assert_eq!(passes(&plain), 0.0, "off without --speculate");
    let v = post_ok(&plain, body(Some(json!("ngram:4"))));
    assert!(passes(&plain) > 0.0, "on per request");
    assert_eq!(outcome(&v), outcome(&off));

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tinygpt-cpu"))
        .args(["serve", "--speculate", "ngram:99", "--port", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--speculate"), "{err}");
}

/// `--speculate-max-batch 1`: a request alone drafts (drafts accepted) and answers the
/// plain text; three prompts at once, with drafts and without, answer the same texts
/// (drafts only in the steps that decode one sequence). `0` is refused naming the flag.
/// (That a batched step leaves a sequence's drafting state untouched holds by
/// construction, `plan_pass` not consulting its `Speculator`; a later request has a
/// `Speculator` of its own, so this test could not see it.)
#[test]
fn a_batch_limit_drafts_alone_and_keeps_the_text() {
    let srv = Server::start(&["--speculate", "ngram", "--speculate-max-batch", "1"]);
    let body = |prompt: &str, spec: bool| {
        let mut b = json!({"prompt": prompt, "max_tokens": 32, "temperature": 0,
            "ignore_eos": true, "cache_prompt": false});
        if !spec {
            b["speculate"] = json!(false);
        }
        b
    };
    let alone = outcome(&post_ok(&srv, body(PROMPTS[0], true)));
    assert!(accepted(&srv) > 0.0, "a request alone drafts");
    assert_eq!(alone, outcome(&post_ok(&srv, body(PROMPTS[0], false))));
    std::thread::scope(|sc| {
        let runs: Vec<_> = PROMPTS
            .iter()
            .flat_map(|p| [(p, true), (p, false)])
            .map(|(p, spec)| {
                let srv = &srv;
                sc.spawn(move || outcome(&post_ok(srv, body(p, spec))))
            })
            .collect();
        let got: Vec<_> = runs.into_iter().map(|h| h.join().unwrap()).collect();
        for (i, pair) in got.chunks(2).enumerate() {
            assert_eq!(pair[0], pair[1], "prompt {:?}", PROMPTS[i]);
        }
    });

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tinygpt-cpu"))
        .args([
            "serve",
            "--speculate",
            "ngram",
            "--speculate-max-batch",
            "0",
        ])
        .args(["--port", "0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--speculate-max-batch"), "{err}");
}

/// SmolLM2 (skipped without it), the flagship int4 sink + window cache: chat requests
/// that pay (rewrite a paragraph, quote) batched with drafts and without give the same
/// replies, and drafts are accepted.
#[test]
fn smollm2_greedy_chat_with_drafts_equals_without() {
    let Some(model) = smollm2_path() else {
        return;
    };
    let model = model.to_str().unwrap();
    let srv = Server::start(
        &[
            &[model][..],
            &FLAGSHIP_CACHE_FLAGS,
            &["--speculate", "ngram"],
        ]
        .concat(),
    );
    let asks = [
        "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog, and the \
         lazy dog sleeps.",
        "Rewrite with the spelling fixed, nothing else: The old lighthouse stood at the edge \
         of the cliff for more then two hundred years.",
    ];
    std::thread::scope(|sc| {
        let runs: Vec<_> = asks
            .iter()
            .flat_map(|a| [(a, true), (a, false)])
            .map(|(ask, spec)| {
                let srv = &srv;
                sc.spawn(move || {
                    let (code, v) = srv.post(
                        "/v1/chat/completions",
                        json!({"messages": [{"role": "user", "content": ask}],
                            "max_tokens": 60, "temperature": 0,
                            "speculate": if spec { json!("ngram") } else { json!(false) }}),
                    );
                    assert_eq!(code, 200, "{v}");
                    v["choices"][0]["message"]["content"].clone()
                })
            })
            .collect();
        let got: Vec<_> = runs.into_iter().map(|h| h.join().unwrap()).collect();
        for pair in got.chunks(2) {
            assert_eq!(pair[0], pair[1]);
        }
    });
    assert!(accepted(&srv) > 0.0);
}

/// Admission's bound on what a verification pass holds beside the cache
/// (`worst_case_hold_bytes`) against real passes of 9 rows started at every position of a
/// 90-token run, in dense and bounded, quantised and residual caches.
#[test]
fn admission_bounds_what_a_pass_holds() {
    let files = ModelFiles::open(None).unwrap();
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    let modes = [
        KvConfig::default(),
        KvConfig {
            precision: Precision::Int4,
            group_size: 8,
            ..KvConfig::default()
        },
        KvConfig {
            precision: Precision::Int2,
            residual: 8,
            group_size: 8,
            ..KvConfig::default()
        },
        int4_window(),
    ];
    let (k, n) = (8usize, 90usize);
    for kv in modes {
        let bound = tinygpt_cpu::server::worst_case_hold_bytes(&model.cfg, &kv, n, k + 1);
        let mut s = model.session(&kv);
        let mut peak = 0;
        for pos in 0..n - k - 1 {
            s.cache.hold();
            let tokens: Vec<u32> = (0..=k as u32).map(|i| 3 + (pos as u32 + i) % 50).collect();
            model.forward_batch(&mut s, &tokens, pos, None).unwrap();
            peak = peak.max(s.cache.hold_bytes());
            s.cache.release(0);
            model.forward(&mut s, 3 + pos as u32 % 50, pos).unwrap();
        }
        assert!(peak > 0 && peak <= bound, "{kv:?}: {peak} > {bound}");
    }
}

/// Sampling with drafts under continuous batching keeps the distribution: after a prompt
/// that loops (the bundled model's greedy continuation appended), 1,200 seeded requests of 6
/// tokens at temperature 0.6 with drafts and 1,200 without, each set four at a time, are
/// compared by a chi-square two-sample test on their whole 6-token texts (texts seen at
/// least 15 times overall, the rest pooled), which must stay under the 1e-4 critical
/// value; drafts were accepted and rejected (from `/metrics`).
#[test]
fn sampled_requests_with_drafts_keep_the_distribution() {
    let files = ModelFiles::open(None).unwrap();
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    let mut ids = files.tokenizer().unwrap().encode(PROMPTS[0]).unwrap();
    let g = greedy(&mut EngineRun::new(&model, &KvConfig::default()), &ids, 30).ids;
    ids.extend(&g);
    let prompt = files.tokenizer().unwrap().decode(&ids).unwrap();
    let srv = Server::start(&["--speculate", "ngram:4", "--max-sequences", "4"]);
    let n = 1200u64;
    let texts = |spec: bool| -> Vec<String> {
        let out = std::sync::Mutex::new(Vec::new());
        let next = std::sync::atomic::AtomicU64::new(0);
        std::thread::scope(|sc| {
            for _ in 0..4 {
                sc.spawn(|| loop {
                    let seed = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if seed >= n {
                        break;
                    }
                    let mut body = json!({"prompt": prompt, "max_tokens": 6,
                        "temperature": 0.6, "top_k": 0, "top_p": 1.0, "ignore_eos": true,
                        "cache_prompt": false,
                        "seed": seed + if spec { 1_000_000 } else { 0 }});
                    if !spec {
                        body["speculate"] = json!(false);
                    }
                    let t = outcome(&post_ok(&srv, body)).0;
                    out.lock().unwrap().push(t);
                });
            }
        });
        out.into_inner().unwrap()
    };
    let (plain, drafted) = (texts(false), texts(true));
    let (acc, dr) = (
        accepted(&srv),
        srv.metric("tinygpt_speculate_drafted_total"),
    );
    assert!(acc > 100.0, "accepted {acc} of {dr}");
    assert!(acc + 100.0 < dr, "accepted {acc} of {dr}");
    let (stat, df) = chi_square(&plain, &drafted, 15);
    let critical = chi_square_critical_1e4(df);
    assert!(df >= 3, "too few distinct continuations to test ({df})");
    assert!(
        stat < critical,
        "chi-square {stat:.1} over {df} degrees of freedom (critical {critical:.1})"
    );
}
