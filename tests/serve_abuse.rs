//! `serve` under abuse: one test per numbered case of issue 27 (sections 1–9), then
//! bounded tokenising (10) and one hostile request against the others (11, issue 50),
//! against the binary on an ephemeral loopback port, with raw sockets where a well-behaved
//! client cannot misbehave enough. Every wait is bounded; timing bounds leave wide margins
//! for a loaded machine (each is several times what an idle one takes, and far below what
//! the old server took).

mod common;
use common::server::*;
use common::*;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, ErrorKind, Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

fn addr(srv: &Server) -> String {
    srv.base.trim_start_matches("http://").to_string()
}

/// Whether the server closes `s` within `within` (EOF or reset), reading and discarding
/// whatever it sends first.
fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let t0 = Instant::now();
    let mut buf = [0u8; 4096];
    while t0.elapsed() < within {
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return true,
        }
    }
    false
}

/// Sends raw bytes, then reads the response head (status line) within `within`.
fn raw_status(a: &str, req: &[u8], within: Duration) -> Option<(u16, String)> {
    let mut s = TcpStream::connect(a).ok()?;
    s.set_read_timeout(Some(within)).unwrap();
    s.write_all(req).ok()?;
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    let code = text.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, text))
}

fn sigterm(srv: &Server) {
    // SAFETY: plain kill(2) on our own child's pid.
    assert_eq!(
        unsafe { libc::kill(srv.child.id() as i32, libc::SIGTERM) },
        0
    );
}

/// Waits for the server process to exit; its exit status and seconds waited.
fn wait_exit(srv: &mut Server, within: Duration) -> (std::process::ExitStatus, f64) {
    let t0 = Instant::now();
    loop {
        if let Some(s) = srv.child.try_wait().unwrap() {
            return (s, t0.elapsed().as_secs_f64());
        }
        assert!(
            t0.elapsed() < within,
            "server still running after {within:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A request with a JSON body; (status, body as JSON).
fn post(srv: &Server, path: &str, headers: &[(&str, &str)], body: &str) -> (u16, Value) {
    let mut r = ureq::post(&srv.url(path)).timeout(Duration::from_secs(60));
    for (k, v) in headers {
        r = r.set(k, v);
    }
    let (code, text) = match r.send_string(body) {
        Ok(r) => (r.status(), r.into_string().unwrap()),
        Err(ureq::Error::Status(c, r)) => (c, r.into_string().unwrap()),
        Err(e) => panic!("{path}: {e}"),
    };
    (code, serde_json::from_str(&text).unwrap_or(Value::Null))
}

const JSON: (&str, &str) = ("Content-Type", "application/json");

/// A stream that keeps generating (bounded cache, EOS ignored): its reader after the
/// first chunk.
fn long_stream(srv: &Server) -> BufReader<Box<dyn Read + Send + Sync>> {
    let body = json!({"prompt": "The", "max_tokens": 100000, "ignore_eos": true,
        "streaming_llm_window": 64, "temperature": 0, "stream": true});
    let r = post_json(&srv.url("/v1/completions"))
        .send_string(&body.to_string())
        .unwrap();
    let mut reader = BufReader::new(r.into_reader());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    assert!(line.starts_with("data: "), "{line}");
    reader
}

// ---- 1. connection timeouts and the connection cap ------------------------------------

#[test]
fn silent_half_sent_and_idle_connections_are_closed_and_stalled_bodies_get_408() {
    let srv = Server::start(&["--header-timeout", "1", "--body-timeout", "1"]);
    let a = addr(&srv);
    // Sends nothing.
    let mut silent = TcpStream::connect(&a).unwrap();
    // Half a header.
    let mut half = TcpStream::connect(&a).unwrap();
    half.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow:")
        .unwrap();
    // A full request, then idle on keep-alive.
    let mut idle = TcpStream::connect(&a).unwrap();
    idle.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .unwrap();
    let mut head = [0u8; 12];
    idle.read_exact(&mut head).unwrap();
    assert_eq!(&head, b"HTTP/1.1 200");
    for (name, s) in [
        ("silent", &mut silent),
        ("half header", &mut half),
        ("idle keep-alive", &mut idle),
    ] {
        assert!(
            closed_within(s, Duration::from_secs(8)),
            "{name} stayed open"
        );
    }
    // Content-Length 100, 10 bytes sent: 408 after the body timeout.
    let t0 = Instant::now();
    let (code, text) = raw_status(
        &a,
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":",
        Duration::from_secs(10),
    )
    .expect("a response");
    assert_eq!(code, 408, "{text}");
    assert!(text.contains("--body-timeout"), "{text}");
    assert!(t0.elapsed() < Duration::from_secs(8));
}

#[cfg(unix)]
#[test]
fn idle_connections_past_the_descriptor_limit_do_not_lock_out_health() {
    // 200 idle sockets against a process limited to 128 descriptors: the cap keeps the
    // surplus in the backlog, the header timeout frees slots, /health still answers.
    let bin = env!("CARGO_BIN_EXE_tinygpt-cpu");
    let mut child = Command::new("sh")
        .args([
            "-c",
            &format!(
                "ulimit -n 128 && exec {bin} serve --host 127.0.0.1 --port 0 --header-timeout 1"
            ),
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let base = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap_or_else(|| panic!("no address in {line:?}"))
        .to_string();
    let srv = Server { child, base };
    let a = addr(&srv);
    let idle: Vec<TcpStream> = (0..200)
        .filter_map(|_| TcpStream::connect(&a).ok())
        .collect();
    assert!(idle.len() >= 100, "only {} connected", idle.len());
    let t0 = Instant::now();
    let (code, _) = raw_status(
        &a,
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
        Duration::from_secs(20),
    )
    .expect("/health answers");
    assert_eq!(code, 200);
    assert!(t0.elapsed() < Duration::from_secs(20));
    drop(idle);
}

// ---- 2 and 3. drain ----------------------------------------------------------------------

#[cfg(unix)]
#[test]
fn sigterm_answers_503_on_health_then_exits_within_the_drain_timeout_despite_stalled_clients() {
    let mut srv = Server::start(&[
        "--header-timeout",
        "60",
        "--body-timeout",
        "60",
        "--drain-grace",
        "1.5",
        "--drain-timeout",
        "4",
        "--max-request-tokens",
        "200000",
    ]);
    let a = addr(&srv);
    let mut half = TcpStream::connect(&a).unwrap();
    half.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow:")
        .unwrap();
    let mut stalled = TcpStream::connect(&a).unwrap();
    stalled
        .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pro")
        .unwrap();
    // A keep-alive connection opened before the signal.
    let mut kept = TcpStream::connect(&a).unwrap();
    kept.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .unwrap();
    let mut head = [0u8; 12];
    kept.read_exact(&mut head).unwrap();
    // Drain the rest of that response.
    kept.set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let mut sink = [0u8; 1024];
    let _ = kept.read(&mut sink);
    // The client reads the stream as it comes, as a real one does: one that stops reading
    // fills the socket buffers, and what the server could not write before it exits is lost.
    let stream = long_stream(&srv);
    let reader = std::thread::spawn(move || read_sse(stream));
    let t0 = Instant::now();
    sigterm(&srv);
    std::thread::sleep(Duration::from_millis(300));
    // During the grace period: /health is 503 on a new connection and on the open one.
    let (code, text) = raw_status(
        &a,
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
        Duration::from_secs(5),
    )
    .expect("a new connection is still accepted during the grace period");
    assert_eq!(code, 503, "{text}");
    assert!(text.contains("draining"), "{text}");
    kept.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        .unwrap();
    kept.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 12];
    kept.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"HTTP/1.1 503");
    // New generations are refused.
    let (code, v) = post(
        &srv,
        "/v1/completions",
        &[JSON],
        r#"{"prompt": "The", "max_tokens": 2}"#,
    );
    assert_eq!(code, 503, "{v}");
    // The endless stream is cut at the drain timeout (an error chunk, then the end), and
    // the process exits although two clients still hold half-sent requests.
    let (status, _) = wait_exit(&mut srv, Duration::from_secs(15));
    let secs = t0.elapsed().as_secs_f64();
    assert!(status.success(), "{status:?}");
    assert!(secs < 4.0 + 3.0, "exited {secs:.1} s after SIGTERM");
    let (chunks, _) = reader.join().unwrap();
    assert!(
        chunks.iter().any(|c| c["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("drain timeout"))),
        "no drain-timeout error in the stream's last chunks"
    );
    assert!(TcpStream::connect(&a).is_err(), "still accepting");
    drop((half, stalled));
}

#[cfg(unix)]
#[test]
fn a_second_signal_ends_the_drain_at_once() {
    let mut srv = Server::start(&[
        "--drain-grace",
        "0",
        "--drain-timeout",
        "120",
        "--max-request-tokens",
        "200000",
    ]);
    let stream = long_stream(&srv);
    sigterm(&srv);
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        srv.child.try_wait().unwrap().is_none(),
        "exited on one signal"
    );
    sigterm(&srv);
    let (status, secs) = wait_exit(&mut srv, Duration::from_secs(10));
    assert!(status.success(), "{status:?}");
    assert!(secs < 5.0, "{secs:.1} s after the second signal");
    drop(stream);
}

// ---- 4–7. validation shared with `sample` -------------------------------------------------

#[test]
fn server_refuses_what_sample_refuses_and_what_it_would_ignore() {
    let srv = Server::start(&[]);
    let bad = |body: Value, param: &str| {
        let (code, v) = post(&srv, "/v1/completions", &[JSON], &body.to_string());
        assert_eq!(code, 400, "{body}: {v}");
        assert_eq!(v["error"]["param"].as_str(), Some(param), "{body}: {v}");
        v["error"]["message"].as_str().unwrap().to_string()
    };
    // 4. A window past the model's context (256) is no bound: refused as `sample` does.
    let m = bad(
        json!({"prompt": "The", "streaming_llm_window": 1000, "max_tokens": 400}),
        "streaming_llm_window",
    );
    assert!(m.contains("context length (256)"), "{m}");
    let sample = cli()
        .args(["sample", "--prompt", "The", "--tokens", "400"])
        .args(["--streaming-llm-window", "1000"])
        .output()
        .unwrap();
    assert!(!sample.status.success());
    assert!(String::from_utf8_lossy(&sample.stderr).contains("context length (256)"));
    // Inside the context it runs.
    let (code, v) = post(
        &srv,
        "/v1/completions",
        &[JSON],
        r#"{"prompt": "The", "streaming_llm_window": 100, "max_tokens": 300, "ignore_eos": true}"#,
    );
    assert_eq!(code, 200, "{v}");
    // 5. A 2 MB prompt is refused by its size, before tokenising.
    let huge = "word ".repeat(400_000);
    let m = bad(json!({"prompt": huge, "max_tokens": 1}), "prompt");
    assert!(m.contains("bytes cannot fit in 256 tokens"), "{m}");
    // `sample` makes the same check (a 60 kB argument: command lines cap one at 128 kB).
    let out = cli()
        .args([
            "sample",
            "--prompt",
            &"word ".repeat(12_000),
            "--tokens",
            "1",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--prompt") && err.contains("bytes cannot fit in 256 tokens"),
        "{err}"
    );
    // A body over --max-body-bytes (8 MiB): 413 as soon as the header says so.
    let (code, text) = raw_status(
        &addr(&srv),
        format!(
            "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{{\"prompt\": \"",
            9 << 20
        )
        .as_bytes(),
        Duration::from_secs(10),
    )
    .expect("a response");
    assert_eq!(code, 413, "{text}");
    // And when the length is not declared (chunked): 413 once the limit is passed.
    let srv_small = Server::start(&["--max-body-bytes", "1000"]);
    let (code, v) = post(
        &srv_small,
        "/v1/completions",
        &[JSON, ("Transfer-Encoding", "chunked")],
        &json!({"prompt": "x".repeat(2000)}).to_string(),
    );
    assert_eq!(code, 413, "{v}");
    // 6. A tiny positive temperature is greedy: the same text as temperature 0.
    let text = |t: f64| {
        let (code, v) = post(
            &srv,
            "/v1/completions",
            &[JSON],
            &json!({"prompt": "The", "max_tokens": 24, "temperature": t, "seed": 5}).to_string(),
        );
        assert_eq!(code, 200, "{v}");
        v["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let greedy = text(0.0);
    for t in [1e-45, 1e-40, 1e-8] {
        assert_eq!(text(t), greedy, "temperature {t}");
    }
    // 7. Unknown chat roles and unimplemented fields are named, not ignored.
    let (code, v) = post(
        &srv,
        "/v1/chat/completions",
        &[JSON],
        r#"{"messages": [{"role": "wizard", "content": "hi"}]}"#,
    );
    assert_eq!(code, 400, "{v}");
    assert_eq!(v["error"]["param"], "messages[0].role");
    for (field, value) in [
        ("logprobs", json!(true)),
        ("echo", json!(true)),
        (
            "tools",
            json!([{"type": "function", "function": {"name": "f"}}]),
        ),
        ("response_format", json!({"type": "json_object"})),
        ("logit_bias", json!({"5": 10})),
        ("frequency_penalty", json!(0.5)),
    ] {
        let mut body = json!({"prompt": "The", "max_tokens": 2});
        body[field] = value;
        bad(body, field);
    }
    // Their no-op values are accepted, as clients send them.
    let (code, v) = post(
        &srv,
        "/v1/completions",
        &[JSON],
        r#"{"prompt": "The", "max_tokens": 2, "logprobs": null, "echo": false,
            "frequency_penalty": 0, "response_format": {"type": "text"}}"#,
    );
    assert_eq!(code, 200, "{v}");
}

#[test]
fn sample_treats_tiny_temperatures_as_greedy() {
    let run = |t: &str| {
        let out = cli()
            .args(["sample", "--prompt", "The", "--tokens", "24", "--json"])
            .args(["--temperature", t, "--seed", "9"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        json_of(&out)["text"].as_str().unwrap().to_string()
    };
    let greedy = run("0");
    assert_eq!(run("1e-40"), greedy);
    assert_eq!(run("1e-45"), greedy);
}

// ---- 8. access control --------------------------------------------------------------------

#[test]
fn api_keys_hosts_origins_and_content_types() {
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "first-key\n\nsecond-key\n").unwrap();
    let srv = Server::start(&["--api-key-file", keys.to_str().unwrap()]);
    let body = r#"{"prompt": "The", "max_tokens": 2}"#;
    let (code, v) = post(&srv, "/v1/completions", &[JSON], body);
    assert_eq!(code, 401, "{v}");
    assert_eq!(v["error"]["type"], "authentication_error");
    let (code, _) = post(
        &srv,
        "/v1/completions",
        &[JSON, ("Authorization", "Bearer first-keyX")],
        body,
    );
    assert_eq!(code, 401);
    for key in ["first-key", "second-key"] {
        let auth = format!("Bearer {key}");
        let (code, v) = post(
            &srv,
            "/v1/completions",
            &[JSON, ("Authorization", &auth)],
            body,
        );
        assert_eq!(code, 200, "{v}");
    }
    // /v1/models needs the key; /health (probes) does not.
    match ureq::get(&srv.url("/v1/models")).call() {
        Err(ureq::Error::Status(401, _)) => {}
        other => panic!("expected 401, got {:?}", other.map(|r| r.status())),
    }
    assert_eq!(srv.get("/health"), r#"{"status":"ok"}"#);
    let ok = ("Authorization", "Bearer second-key");
    // Content-Type must be JSON: 415.
    let (code, v) = post(
        &srv,
        "/v1/completions",
        &[("Content-Type", "text/plain"), ok],
        body,
    );
    assert_eq!(code, 415, "{v}");
    // DNS rebinding: a loopback server refuses foreign Host names.
    let (code, text) = raw_status(
        &addr(&srv),
        b"GET /health HTTP/1.1\r\nHost: attacker.example:8080\r\nConnection: close\r\n\r\n",
        Duration::from_secs(10),
    )
    .unwrap();
    assert_eq!(code, 403, "{text}");
    // A page on another origin cannot drive it; one on localhost can.
    let (code, v) = post(
        &srv,
        "/v1/completions",
        &[JSON, ok, ("Origin", "https://attacker.example")],
        body,
    );
    assert_eq!(code, 403, "{v}");
    let (code, v) = post(
        &srv,
        "/v1/completions",
        &[JSON, ok, ("Origin", "http://localhost:3000")],
        body,
    );
    assert_eq!(code, 200, "{v}");
    // --allowed-origins adds one.
    let srv = Server::start(&["--allowed-origins", "https://app.example"]);
    let (code, v) = post(
        &srv,
        "/v1/completions",
        &[JSON, ("Origin", "https://app.example")],
        body,
    );
    assert_eq!(code, 200, "{v}");
}

#[test]
fn bad_access_flags_are_refused_by_name() {
    for (args, needle) in [
        (
            vec!["--api-key-file", "/nonexistent/keys"],
            "--api-key-file",
        ),
        (
            vec!["--drain-grace", "40", "--drain-timeout", "30"],
            "--drain-grace",
        ),
        (vec!["--header-timeout", "0"], "--header-timeout"),
        (
            vec![
                "--tls-cert",
                "/nonexistent.crt",
                "--tls-key",
                "/nonexistent.key",
            ],
            "--tls-cert",
        ),
    ] {
        let out = cli().arg("serve").args(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(needle) && !err.contains("panicked"),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn https_with_tls_cert_and_key() {
    let Ok(py) = Command::new("python3").arg("--version").output() else {
        eprintln!("skipped: no python3 to act as the TLS client");
        return;
    };
    assert!(py.status.success());
    let tls = fixtures().join("tls");
    let (cert, key) = (tls.join("localhost.crt"), tls.join("localhost.key"));
    let srv = Server::start(&[
        "--tls-cert",
        cert.to_str().unwrap(),
        "--tls-key",
        key.to_str().unwrap(),
    ]);
    assert!(srv.base.starts_with("https://"), "{}", srv.base);
    let script = r#"
import json, ssl, sys, urllib.request
ctx = ssl.create_default_context(cafile=sys.argv[2])
req = urllib.request.Request(sys.argv[1] + "/v1/completions",
    data=json.dumps({"prompt": "The", "max_tokens": 3, "temperature": 0}).encode(),
    headers={"Content-Type": "application/json"})
print(json.load(urllib.request.urlopen(req, context=ctx, timeout=60))["usage"]["completion_tokens"])
"#;
    let out = Command::new("python3")
        .args(["-c", script, &srv.base, cert.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "3");
    // Plain HTTP on the TLS port gets no HTTP answer.
    let plain = raw_status(
        &srv.base.replace("https://", ""),
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        Duration::from_secs(15),
    );
    assert!(plain.as_ref().is_none_or(|(c, _)| *c != 200), "{plain:?}");
}

// ---- 9. the admission queue and the request timeout -------------------------------------

#[test]
fn over_capacity_requests_wait_in_a_bounded_queue() {
    let srv = Server::start(&[
        "--max-sequences",
        "1",
        "--max-queue",
        "1",
        "--queue-timeout",
        "30",
        "--max-request-tokens",
        "200000",
    ]);
    // Long enough (a bounded window keeps it inside the bundled model's context) that the
    // second request arrives while it runs, however fast the machine: 120 tokens once
    // finished first on an idle host, and nothing was ever queued.
    let body = json!({"prompt": "The", "max_tokens": 3000, "ignore_eos": true,
        "streaming_llm_window": 64, "temperature": 0, "stream": true});
    let first = post_json(&srv.url("/v1/completions"))
        .send_string(&body.to_string())
        .unwrap();
    let mut first = BufReader::new(first.into_reader());
    let mut line = String::new();
    first.read_line(&mut line).unwrap();
    // The second waits (no 429) and completes once the first is done.
    let url = srv.url("/v1/completions");
    let waiter = std::thread::spawn(move || {
        let r = post_json(&url)
            .send_string(r#"{"prompt": "The", "max_tokens": 3, "temperature": 0}"#)
            .unwrap();
        (r.status(), r.into_string().unwrap())
    });
    let t0 = Instant::now();
    while srv.metric("tinygpt_waiting_requests") != 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(20), "never queued");
        std::thread::sleep(Duration::from_millis(20));
    }
    // The queue holds one: a third is refused at once.
    let (code, v) = post(
        &srv,
        "/v1/completions",
        &[JSON],
        r#"{"prompt": "The", "max_tokens": 3}"#,
    );
    assert_eq!(code, 429, "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("--max-queue"));
    let (chunks, done) = read_sse(first);
    assert!(done && chunks.last().unwrap()["usage"]["completion_tokens"] == 3000);
    let (code, text) = waiter.join().unwrap();
    assert_eq!(code, 200, "{text}");
    assert_eq!(srv.metric("tinygpt_waiting_requests"), 0.0);
    assert!(srv.metric("tinygpt_queue_wait_seconds_count") >= 1.0);

    // A queue timeout: 429 after waiting.
    let srv = Server::start(&[
        "--max-sequences",
        "1",
        "--queue-timeout",
        "0.5",
        "--max-request-tokens",
        "200000",
    ]);
    let hold = long_stream(&srv);
    let t0 = Instant::now();
    let (code, v) = post(
        &srv,
        "/v1/completions",
        &[JSON],
        r#"{"prompt": "The", "max_tokens": 3}"#,
    );
    assert_eq!(code, 429, "{v}");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("--queue-timeout"));
    assert!(t0.elapsed() >= Duration::from_millis(500));
    drop(hold);
}

#[test]
fn request_timeout_ends_a_generation_with_length() {
    let srv = Server::start(&["--request-timeout", "0.5", "--max-request-tokens", "200000"]);
    let (code, v) = post(
        &srv,
        "/v1/completions",
        &[JSON],
        r#"{"prompt": "The", "max_tokens": 100000, "ignore_eos": true, "temperature": 0,
            "streaming_llm_window": 64}"#,
    );
    assert_eq!(code, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let n = v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(n > 0 && n < 100000, "{n}");
    assert_eq!(srv.metric("tinygpt_requests_timed_out_total"), 1.0);
    // max_tokens over --max-request-tokens is a 400 naming it.
    let (code, v) = post(
        &srv,
        "/v1/completions",
        &[JSON],
        r#"{"prompt": "The", "max_tokens": 300000}"#,
    );
    assert_eq!(code, 400);
    assert_eq!(v["error"]["param"], "max_tokens");
}

// ---- 10. bounded tokenising (issue 50) ----------------------------------------------------

/// Texts that stress the places a text may be cut: words and runs of spaces, tabs and
/// newlines, long runs without a space (letters, digits, punctuation), multi-byte UTF-8
/// (accents, CJK, emoji, combining marks, NBSP, ideographic space), special-token text
/// next to spaces, and `> </` (a Gemma 3 entry joins `>` to the following space).
fn boundary_texts() -> Vec<String> {
    let pieces = [
        "hello",
        " world",
        "  ",
        "     ",
        "\t",
        "\n",
        "\r\n",
        "\n\n   ",
        " \n",
        "a.",
        " b",
        "it's",
        " don't",
        "'s",
        "123",
        " 4567",
        "9999999999",
        "x",
        "é",
        " café",
        "中文",
        " 中文",
        "😀",
        " 😀😀",
        "e\u{301}",
        "\u{a0}",
        "\u{a0}word",
        "\u{3000}",
        " ǅ",
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "<start_of_turn>",
        "<end_of_turn>",
        "<bos>",
        "<eos>",
        "</s>",
        "<s>",
        " > </",
        ">",
        " </b>",
        "-->",
        " ==",
        "(x)",
        " [1]",
        "ß",
        " ÅNGSTRÖM",
    ];
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = |n: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % n as u64) as usize
    };
    let mut texts = vec![
        "a ".repeat(3000),
        "word ".repeat(2000),
        "a".repeat(5000),
        " ".repeat(3000),
        "x ".repeat(100) + &"y".repeat(3000) + &" z".repeat(100),
        "中文 ".repeat(500),
        "> </".repeat(400),
        "<|im_start|>user\nhello there<|im_end|>\n".repeat(60),
    ];
    for _ in 0..8 {
        let mut t = String::new();
        while t.len() < 3000 {
            t.push_str(pieces[next(pieces.len())]);
            if next(3) == 0 {
                t.push(' ');
            }
        }
        texts.push(t);
    }
    texts
}

/// Within the limit, `encode_bounded` gives exactly the ids of encoding the text whole,
/// however small the chunks; over it, it says so with a count that is never above the
/// true one.
fn check_bounded_tokenizing(name: &str, tok: &tinygpt_cpu::tokenizer::Tokenizer) {
    use tinygpt_cpu::tokenizer::Bounded;
    for (i, text) in boundary_texts().iter().enumerate() {
        for add in [false, true] {
            let whole = tok.encode_with(text, add).unwrap();
            let n = whole.len();
            for chunk in [1, 5, 64, 1000, 1 << 20] {
                let got = tok.encode_bounded_in(text, add, n, chunk).unwrap();
                assert_eq!(
                    got,
                    Bounded::Ids(whole.clone()),
                    "{name}: text {i}, chunk {chunk}"
                );
                for limit in [0, n / 3, n.saturating_sub(1)] {
                    if limit >= n || chunk < 64 {
                        continue;
                    }
                    match tok.encode_bounded_in(text, add, limit, chunk).unwrap() {
                        Bounded::Over { at_least, exact } => {
                            assert!(
                                at_least > limit && at_least <= n && (!exact || at_least == n),
                                "{name}: text {i}, chunk {chunk}, limit {limit}: at least {at_least} of {n}"
                            );
                        }
                        other => panic!("{name}: text {i}, limit {limit} < {n}: {other:?}"),
                    }
                }
            }
        }
    }
}

/// Runs of 100 kB and more with no place to cut (letters, spaces, newlines, CJK, a
/// base64-like mix, `> </`): bounded by the fewest vocabulary entries that spell them, a
/// bound that must never exceed the true count, and exact within the limit.
fn check_long_runs(name: &str, tok: &tinygpt_cpu::tokenizer::Tokenizer) {
    use tinygpt_cpu::tokenizer::Bounded;
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let base64: String = (0..120_000)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
                [(state % 64) as usize] as char
        })
        .collect();
    let runs = [
        "a".repeat(150_000),
        " ".repeat(120_000),
        "\n".repeat(100_000),
        "中".repeat(40_000),
        base64,
        ">".repeat(60_000) + &" </".repeat(30_000),
    ];
    for (i, text) in runs.iter().enumerate() {
        let whole = tok.encode_with(text, true).unwrap();
        let n = whole.len();
        assert_eq!(
            tok.encode_bounded(text, true, n).unwrap(),
            Bounded::Ids(whole),
            "{name}: run {i}"
        );
        for limit in [n / 10, n / 2, n - 1] {
            match tok.encode_bounded(text, true, limit).unwrap() {
                Bounded::Over { at_least, .. } => assert!(
                    at_least > limit && at_least <= n,
                    "{name}: run {i}, limit {limit}: at least {at_least} of {n}"
                ),
                other => panic!("{name}: run {i}, limit {limit} < {n}: {other:?}"),
            }
        }
    }
}

#[test]
fn bounded_tokenizing_equals_whole_text_tokenizing_on_the_bundled_model() {
    let files = tinygpt_cpu::weights::ModelFiles::open(None).unwrap();
    assert!(files.tokenizer().unwrap().cuts_texts());
    check_bounded_tokenizing("bundled", files.tokenizer().unwrap());
    check_long_runs("bundled", files.tokenizer().unwrap());
}

#[test]
fn bounded_tokenizing_equals_whole_text_tokenizing_on_smollm2_and_gemma3() {
    if let Some(p) = smollm2_path() {
        let files = tinygpt_cpu::weights::ModelFiles::open(Some(&p)).unwrap();
        assert!(files.tokenizer().unwrap().cuts_texts());
        check_bounded_tokenizing("SmolLM2", files.tokenizer().unwrap());
        check_long_runs("SmolLM2", files.tokenizer().unwrap());
    }
    let gemma = std::env::var_os("TINYGPT_GEMMA3")
        .map(std::path::PathBuf::from)
        .filter(|p| p.is_file());
    match gemma {
        Some(p) => {
            let files = tinygpt_cpu::weights::ModelFiles::open(Some(&p)).unwrap();
            assert!(files.tokenizer().unwrap().cuts_texts());
            check_bounded_tokenizing("Gemma 3", files.tokenizer().unwrap());
            check_long_runs("Gemma 3", files.tokenizer().unwrap());
        }
        None => eprintln!("skipping Gemma 3: TINYGPT_GEMMA3 is not set to its GGUF"),
    }
}

// ---- 11. one hostile request against the others (issue 50) -------------------------------

/// The server's resident set in MiB (Linux).
#[cfg(target_os = "linux")]
fn rss_mib(srv: &Server) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", srv.child.id())).unwrap();
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    kib / 1024.0
}

/// Seconds a `GET /health` on a new connection takes to answer 200.
fn health_secs(a: &str, within: Duration) -> f64 {
    let t0 = Instant::now();
    let (code, text) = raw_status(
        a,
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
        within,
    )
    .expect("/health answers");
    assert_eq!(code, 200, "{text}");
    t0.elapsed().as_secs_f64()
}

#[cfg(target_os = "linux")]
#[test]
fn huge_prompts_are_refused_with_bounded_work_while_a_stream_and_health_go_on() {
    // A bounded cache: the limit is --max-prompt-tokens, set so that the prompts below pass
    // the byte-length check (64 bytes per token for the bundled vocabulary) and must be
    // tokenised. The old server tokenised them whole, on the thread that answers /health:
    // seconds each, and hundreds of MiB it kept.
    let srv = Server::start(&[
        "--streaming-llm-sink",
        "4",
        "--streaming-llm-window",
        "60",
        "--max-prompt-tokens",
        "131072",
        "--max-request-tokens",
        "200000",
    ]);
    let a = addr(&srv);
    let mut stream = long_stream(&srv);
    // Chunk arrival times, read as they come.
    let reader = std::thread::spawn(move || {
        let mut times = Vec::new();
        let mut line = String::new();
        while times.len() < 100_000 {
            line.clear();
            match stream.read_line(&mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) if line.starts_with("data: ") => times.push(Instant::now()),
                Ok(_) => {}
            }
        }
        times
    });
    std::thread::sleep(Duration::from_millis(500));
    let before = rss_mib(&srv);
    let t0 = Instant::now();
    for prompt in ["a ".repeat(3_900_000), "a".repeat(7_800_000)] {
        let body = json!({ "prompt": prompt }).to_string();
        let url = srv.url("/v1/completions");
        let big = std::thread::spawn(move || {
            let t = Instant::now();
            let r = post_json(&url)
                .timeout(Duration::from_secs(120))
                .send_string(&body);
            let text = match r {
                Err(ureq::Error::Status(code, r)) => (code, r.into_string().unwrap()),
                other => panic!("{other:?}"),
            };
            (text, t.elapsed().as_secs_f64())
        });
        // /health, polled while the prompt is read and refused.
        let mut slowest = 0.0f64;
        while !big.is_finished() {
            slowest = slowest.max(health_secs(&a, Duration::from_secs(30)));
            std::thread::sleep(Duration::from_millis(20));
        }
        let ((code, text), secs) = big.join().unwrap();
        assert_eq!(code, 400, "{text}");
        assert!(text.contains("--max-prompt-tokens (131072)"), "{text}");
        // Milliseconds on an idle machine; the bounds leave room for a loaded CI host.
        assert!(secs < 3.0, "refused after {secs:.2} s");
        assert!(slowest < 1.0, "/health took {slowest:.2} s meanwhile");
    }
    let window = (t0, Instant::now());
    for _ in 0..4 {
        let (code, _) = post(
            &srv,
            "/v1/completions",
            &[JSON],
            &json!({ "prompt": "a ".repeat(3_900_000) }).to_string(),
        );
        assert_eq!(code, 400);
    }
    std::thread::sleep(Duration::from_millis(300));
    let after = rss_mib(&srv);
    assert!(
        after - before < 64.0,
        "RSS {before:.0} -> {after:.0} MiB after six 7.8 MB prompts"
    );
    drop(srv);
    let times = reader.join().unwrap();
    let gap = times
        .windows(2)
        .filter(|w| w[1] >= window.0 && w[0] <= window.1)
        .map(|w| (w[1] - w[0]).as_secs_f64())
        .fold(0.0, f64::max);
    assert!(
        times
            .iter()
            .filter(|&&t| t > window.0 && t < window.1)
            .count()
            > 0,
        "the stream stalled while the prompts were refused"
    );
    assert!(gap < 1.5, "the stream's longest gap was {gap:.2} s");
}

#[test]
fn silent_sockets_at_the_connection_cap_do_not_keep_health_waiting() {
    // The old server left new connections in the kernel's backlog until a slot's header
    // timeout (here 30 s) expired.
    let srv = Server::start(&["--max-connections", "32", "--header-timeout", "30"]);
    let a = addr(&srv);
    let silent: Vec<TcpStream> = (0..60).map(|_| TcpStream::connect(&a).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(200));
    let secs = health_secs(&a, Duration::from_secs(40));
    assert!(secs < 5.0, "/health took {secs:.1} s");
    // A generation too.
    let t0 = Instant::now();
    let (code, v) = post(
        &srv,
        "/v1/completions",
        &[JSON],
        r#"{"prompt": "The", "max_tokens": 2}"#,
    );
    assert_eq!(code, 200, "{v}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    drop(silent);
}

#[cfg(unix)]
#[test]
fn sigterm_closes_half_sent_connections_when_the_grace_ends() {
    // No stream runs: the process exits at the end of the grace, not at the header or body
    // timeout (60 s here) nor the drain timeout (30 s).
    let mut srv = Server::start(&[
        "--header-timeout",
        "60",
        "--body-timeout",
        "60",
        "--drain-grace",
        "1",
    ]);
    let a = addr(&srv);
    let mut half = TcpStream::connect(&a).unwrap();
    half.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow:")
        .unwrap();
    let mut body = TcpStream::connect(&a).unwrap();
    body.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"pro")
        .unwrap();
    let silent = TcpStream::connect(&a).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    sigterm(&srv);
    let (status, secs) = wait_exit(&mut srv, Duration::from_secs(40));
    assert!(status.success(), "{status:?}");
    assert!(
        secs < 1.0 + 3.0,
        "exited {secs:.1} s after SIGTERM (grace 1 s)"
    );
    // The stalled body was told why.
    body.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut text = String::new();
    let _ = body.read_to_string(&mut text);
    assert!(text.starts_with("HTTP/1.1 503"), "{text}");
    drop((half, silent));
}

#[test]
fn request_heads_follow_the_rfcs() {
    let srv = Server::start(&["--api-key", "KEY"]);
    let a = addr(&srv);
    let status = |req: &[u8]| raw_status(&a, req, Duration::from_secs(10)).expect("an answer");
    // RFC 9112 §3.2: HTTP/1.1 needs exactly one Host; HTTP/1.0 may leave it out.
    let (code, text) = status(b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n");
    assert_eq!(code, 400, "{text}");
    assert!(text.contains("Host"), "{text}");
    let (code, text) = status(
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(code, 400, "{text}");
    assert_eq!(status(b"GET /health HTTP/1.0\r\n\r\n").0, 200);
    // RFC 9110 §11.1: the auth scheme is case-insensitive.
    for auth in ["bearer KEY", "BEARER KEY", "Bearer   KEY "] {
        let req = format!(
            "GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: {auth}\r\nConnection: close\r\n\r\n"
        );
        assert_eq!(status(req.as_bytes()).0, 200, "{auth}");
    }
    let req = "GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Basic KEY\r\nConnection: close\r\n\r\n";
    assert_eq!(status(req.as_bytes()).0, 401);
    // A header line over 8 KiB, and a head over 32 KiB: 431.
    for n in [10_000, 100_000] {
        let req = format!(
            "GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: {}\r\nConnection: close\r\n\r\n",
            "a".repeat(n)
        );
        assert_eq!(status(req.as_bytes()).0, 431, "a {n}-byte header line");
    }
}
