//! `serve`'s prompt cache through the binary: a request whose prompt starts with what a
//! finished one computed resumes from it (`usage.prompt_tokens_details.cached_tokens`
//! says from where) and answers exactly what recomputing answers (the same request with
//! `"cache_prompt": false`, which neither looks nor keeps); the metrics count it; a
//! different cache configuration or `--prompt-cache-bytes 0` never resumes. The
//! bit-identity of every cache mode at every resume point is tests/prompt_cache.rs.

mod common;
use common::server::*;
use common::*;
use serde_json::{json, Value};
use tinygpt_cpu::generate::EngineRun;
use tinygpt_cpu::kv_cache::{KvConfig, PositionsMode, Precision};
use tinygpt_cpu::model::{Model, WeightsDType};
use tinygpt_cpu::weights::ModelFiles;

fn cached(v: &Value) -> u64 {
    v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or_else(|| panic!("no usage.prompt_tokens_details.cached_tokens in {v}"))
}

fn text(v: &Value) -> &str {
    v["choices"][0]["text"].as_str().unwrap()
}

/// A greedy completion of token ids `prompt` with the cache fields `fields`.
fn complete(srv: &Server, prompt: &[u32], n: usize, fields: &Value, cache: bool) -> Value {
    let mut body = json!({"prompt": prompt, "max_tokens": n, "temperature": 0,
        "ignore_eos": true, "cache_prompt": cache});
    for (k, v) in fields.as_object().unwrap() {
        body[k] = v.clone();
    }
    let (code, v) = srv.post("/v1/completions", body);
    assert_eq!(code, 200, "{v}");
    v
}

/// Per cache mode (dense fp32; int4 sink + window whose window 20 A's run crosses; K int8
/// and V int2 with a residual in `cache` positions mode): request A, then requests B =
/// A's prompt + its first `m` generated ids + other tokens, for `m` from 0 to every fed
/// one (window and group boundaries among them). Each B resumes at exactly `|A| + m` and
/// answers what the same request recomputed answers.
#[test]
fn resumed_requests_answer_what_recomputing_answers() {
    let srv = Server::start(&[]);
    let files = ModelFiles::open(None).unwrap();
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    let a = files
        .tokenizer()
        .unwrap()
        .encode("import os\nimport sys\n")
        .unwrap();
    let gen = 30;
    let modes = [
        (json!({}), KvConfig::default()),
        (
            json!({"kv_quantize": "int4", "streaming_llm_sink": 4, "streaming_llm_window": 20,
                "kv_group_size": 8}),
            KvConfig {
                precision: Precision::Int4,
                group_size: 8,
                sink: 4,
                window: Some(20),
                ..KvConfig::default()
            },
        ),
        (
            json!({"kv_quantize_k": "int8", "kv_quantize_v": "int2", "kv_residual": 4,
                "kv_group_size": 8, "streaming_llm_window": 16, "streaming_llm_positions": "cache"}),
            KvConfig {
                k_precision: Some(Precision::Int8),
                v_precision: Some(Precision::Int2),
                residual: 4,
                group_size: 8,
                window: Some(16),
                positions: PositionsMode::Cache,
                ..KvConfig::default()
            },
        ),
    ];
    let (mut hits, mut reused) = (0u64, 0u64);
    for (fields, kv) in &modes {
        let first = complete(&srv, &a, gen, fields, true);
        assert_eq!(cached(&first), 0, "{fields}: nothing kept yet");
        let g = greedy(&mut EngineRun::new(&model, kv), &a, gen).ids;
        assert_eq!(
            text(&first),
            files.tokenizer().unwrap().decode(&g).unwrap(),
            "{fields}: the library's greedy ids are the server's"
        );
        for m in [0, 1, 7, 12, 16, 17, 24, gen - 1] {
            let mut b = a.clone();
            b.extend_from_slice(&g[..m]);
            let other = if g[m] == 9 { 10 } else { 9 };
            b.extend_from_slice(&[other, 11, 12]);
            let resumed = complete(&srv, &b, 12, fields, true);
            let fresh = complete(&srv, &b, 12, fields, false);
            assert_eq!(cached(&resumed), (a.len() + m) as u64, "{fields} m={m}");
            assert_eq!(cached(&fresh), 0, "{fields} m={m}: cache_prompt false");
            assert_eq!(text(&resumed), text(&fresh), "{fields} m={m}");
            assert_eq!(resumed["usage"]["prompt_tokens"], b.len(), "{fields}");
            hits += 1;
            reused += (a.len() + m) as u64;
        }
    }
    // The same ids under another cache configuration: computed as new.
    let mut b = a.clone();
    b.extend_from_slice(&[9, 11, 12]);
    let other = complete(&srv, &b, 4, &json!({"kv_quantize": "int8"}), true);
    assert_eq!(cached(&other), 0);
    assert_eq!(srv.metric("tinygpt_prompt_cache_hits_total"), hits as f64);
    assert_eq!(
        srv.metric("tinygpt_prompt_cache_reused_tokens_total"),
        reused as f64
    );
    // Misses: each mode's first request, the int8 one.
    assert_eq!(
        srv.metric("tinygpt_prompt_cache_misses_total"),
        (modes.len() + 1) as f64
    );
    let bytes = srv.metric("tinygpt_prompt_cache_bytes");
    assert!(bytes > 0.0 && bytes <= srv.metric("tinygpt_prompt_cache_limit_bytes"));
    assert!(srv.metric("tinygpt_prompt_cache_entries") >= 1.0);
    let idle = srv.metric_settled("tinygpt_prompt_cache_hold_bytes", 0.0);
    assert_eq!(idle, 0.0, "idle");
}

/// A stream's last chunk carries the same usage; `--prompt-cache-bytes 0` keeps nothing;
/// `cache_prompt` must be a boolean.
#[test]
fn usage_in_streams_the_off_switch_and_a_bad_field() {
    let srv = Server::start(&[]);
    let files = ModelFiles::open(None).unwrap();
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    let a = [1u32, 20, 30, 40, 50];
    let g = greedy(&mut EngineRun::new(&model, &KvConfig::default()), &a, 1).ids;
    let b = [&a[..], &[if g[0] == 60 { 61 } else { 60 }, 70]].concat();
    complete(&srv, &a, 8, &json!({}), true);
    let body = json!({"prompt": b, "max_tokens": 4, "temperature": 0, "stream": true});
    let r = post_json(&srv.url("/v1/completions"))
        .send_string(&body.to_string())
        .unwrap();
    let (chunks, done) = read_sse(r.into_reader());
    assert!(done);
    let last = chunks.last().unwrap();
    assert_eq!(last["usage"]["prompt_tokens"], 7);
    assert_eq!(last["usage"]["prompt_tokens_details"]["cached_tokens"], 5);
    let (code, v) = srv.post(
        "/v1/completions",
        json!({"prompt": "x", "cache_prompt": "yes"}),
    );
    assert_eq!(
        (code, v["error"]["param"].as_str()),
        (400, Some("cache_prompt"))
    );

    let off = Server::start(&["--prompt-cache-bytes", "0"]);
    complete(&off, &a, 8, &json!({}), true);
    let v = complete(&off, &b, 4, &json!({}), true);
    assert_eq!(cached(&v), 0);
    assert_eq!(off.metric("tinygpt_prompt_cache_misses_total"), 0.0);
    assert_eq!(off.metric("tinygpt_prompt_cache_entries"), 0.0);
}

/// SmolLM2 (skipped without it): a three-turn chat through the chat template, the reply
/// re-sent as the client got it. Each later turn resumes from the earlier one's cache and
/// answers what recomputing answers, with the flagship's int4 sink + window cache.
#[test]
fn smollm2_chat_turns_resume_from_the_previous_turn() {
    let Some(model) = smollm2_path() else {
        return;
    };
    let srv = Server::start(&[&[model.to_str().unwrap()][..], &FLAGSHIP_CACHE_FLAGS].concat());
    let mut messages = vec![json!({"role": "user", "content": "Name three rivers in Europe."})];
    let follow = [
        "Which one is the longest?",
        "Write one sentence about it.",
        "",
    ];
    for (turn, next) in follow.iter().enumerate() {
        let body = |cache: bool| {
            json!({"messages": messages, "max_tokens": 40, "temperature": 0,
                "cache_prompt": cache})
        };
        let (code, resumed) = srv.post("/v1/chat/completions", body(true));
        assert_eq!(code, 200, "{resumed}");
        let (_, fresh) = srv.post("/v1/chat/completions", body(false));
        let reply = resumed["choices"][0]["message"]["content"].clone();
        assert_eq!(
            reply, fresh["choices"][0]["message"]["content"],
            "turn {turn}"
        );
        let c = cached(&resumed);
        let prompt = resumed["usage"]["prompt_tokens"].as_u64().unwrap();
        if turn == 0 {
            assert_eq!(c, 0);
        } else {
            assert!(
                c > prompt / 2 && c < prompt,
                "turn {turn}: {c} of {prompt} cached"
            );
        }
        if !next.is_empty() {
            messages.push(json!({"role": "assistant", "content": reply}));
            messages.push(json!({"role": "user", "content": next}));
        }
    }
}

/// Saved states: a completion's kept cache saved by id to `--state-dir`, the server
/// restarted, the state restored, and the next request resumes from it (all its tokens)
/// and answers what recomputing answers. Names that are paths, unknown ids and files, a
/// corrupted file, a state of another model or another cache configuration, and a server
/// without `--state-dir` are refused, each saying why.
#[test]
fn saved_states_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let files = ModelFiles::open(None).unwrap();
    let model = Model::load(&files, WeightsDType::Native).unwrap();
    let kv = KvConfig {
        precision: Precision::Int4,
        group_size: 8,
        sink: 4,
        window: Some(20),
        ..KvConfig::default()
    };
    let fields = json!({"kv_quantize": "int4", "kv_group_size": 8, "streaming_llm_sink": 4,
        "streaming_llm_window": 20});
    let a = files
        .tokenizer()
        .unwrap()
        .encode("import os\nimport sys\n")
        .unwrap();
    let g = greedy(&mut EngineRun::new(&model, &kv), &a, 24).ids;
    let state_tokens = a.len() + 23;
    let mut b = a.clone();
    b.extend_from_slice(&g[..23]);
    b.extend_from_slice(&[9, 11, 12]);
    let id = {
        let srv = Server::start(&["--state-dir", d]);
        let first = complete(&srv, &a, 24, &fields, true);
        let id = first["id"].as_str().unwrap().to_string();
        for (name, param) in [
            ("../x", "name"),
            ("a/b", "name"),
            (".hidden", "name"),
            ("", "name"),
        ] {
            let (code, v) = srv.post("/v1/states/save", json!({"id": id, "name": name}));
            assert_eq!(
                (code, v["error"]["param"].as_str()),
                (400, Some(param)),
                "{name}: {v}"
            );
        }
        let (code, v) = srv.post("/v1/states/save", json!({"id": "cmpl-999", "name": "x"}));
        assert_eq!(code, 404, "{v}");
        let (code, v) = srv.post("/v1/states/save", json!({"id": id, "name": "conv-1.state"}));
        assert_eq!(code, 200, "{v}");
        assert_eq!(v["tokens"], state_tokens);
        assert!(dir.path().join("conv-1.state").is_file());
        id
    };
    assert!(id.starts_with("cmpl-"));
    // A new server: nothing kept until the state is restored.
    let srv = Server::start(&["--state-dir", d]);
    let restore = |name: &str, extra: &Value| {
        let mut body = json!({"name": name});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        srv.post("/v1/states/restore", body)
    };
    let (code, v) = restore("missing", &fields);
    assert_eq!(code, 404, "{v}");
    // Another cache configuration (the server's default, fp32 dense): refused, named.
    let (code, v) = restore("conv-1.state", &json!({}));
    assert_eq!(code, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("conv-1.state"),
        "{v}"
    );
    assert_eq!(srv.metric("tinygpt_prompt_cache_entries"), 0.0);
    let (code, v) = restore("conv-1.state", &fields);
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["tokens"], state_tokens);
    let resumed = complete(&srv, &b, 12, &fields, true);
    let fresh = complete(&srv, &b, 12, &fields, false);
    assert_eq!(cached(&resumed), state_tokens as u64);
    assert_eq!(text(&resumed), text(&fresh));
    // A corrupted copy: refused (checksum), nothing kept from it.
    let mut bytes = std::fs::read(dir.path().join("conv-1.state")).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(dir.path().join("bad.state"), &bytes).unwrap();
    let (code, v) = restore("bad.state", &fields);
    assert_eq!(code, 400, "{v}");
    let msg = v["error"]["message"].as_str().unwrap().to_lowercase();
    assert!(msg.contains("bad.state") && msg.contains("checksum"), "{v}");
    // Another model (the YOCO fixture) refuses it.
    let yoco = fixtures().join("yoco");
    let other = Server::start(&[yoco.to_str().unwrap(), "--state-dir", d]);
    let mut body = fields.clone();
    body["name"] = json!("conv-1.state");
    let (code, v) = other.post("/v1/states/restore", body);
    assert_eq!(code, 400, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("model"),
        "{v}"
    );
    // Without --state-dir: 404 saying so.
    let none = Server::start(&[]);
    let (code, v) = none.post("/v1/states/restore", json!({"name": "conv-1.state"}));
    assert_eq!(code, 404, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--state-dir"),
        "{v}"
    );
}
