//! The `serve` binary as a user runs it, on an ephemeral loopback port.

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A running `tinygpt-cpu serve` child; killed when dropped.
pub struct Server {
    pub child: Child,
    pub base: String,
}

impl Server {
    pub fn start(args: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_tinygpt-cpu"))
            .arg("serve")
            .args(args)
            .args(["--host", "127.0.0.1", "--port", "0"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the binary starts");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let base = line
            .split_whitespace()
            .find(|w| w.starts_with("http://") || w.starts_with("https://"))
            .unwrap_or_else(|| {
                let mut err = String::new();
                let _ = child.stderr.take().unwrap().read_to_string(&mut err);
                panic!("no address in {line:?}; stderr: {err}")
            })
            .to_string();
        Server { child, base }
    }
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }
    pub fn post(&self, path: &str, body: serde_json::Value) -> (u16, serde_json::Value) {
        match post_json(&self.url(path))
            .timeout(Duration::from_secs(120))
            .send_string(&body.to_string())
        {
            Ok(r) => (
                r.status(),
                serde_json::from_str(&r.into_string().unwrap()).unwrap(),
            ),
            Err(ureq::Error::Status(code, r)) => (
                code,
                serde_json::from_str(&r.into_string().unwrap()).unwrap(),
            ),
            Err(e) => panic!("{path}: {e}"),
        }
    }
    pub fn get(&self, path: &str) -> String {
        ureq::get(&self.url(path))
            .timeout(Duration::from_secs(30))
            .call()
            .unwrap()
            .into_string()
            .unwrap()
    }
    /// A metric's value from `/metrics`.
    /// [`metric`](Self::metric) once it equals `want`, polled for up to 10 s (a gauge the
    /// scheduler updates after the response that a test waited for was sent); the last
    /// value read otherwise.
    pub fn metric_settled(&self, name: &str, want: f64) -> f64 {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let v = self.metric(name);
            if v == want || std::time::Instant::now() >= deadline {
                return v;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn metric(&self, name: &str) -> f64 {
        let text = self.get("/metrics");
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .unwrap_or_else(|| panic!("{name} missing from /metrics:\n{text}"))
            .parse()
            .unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads an SSE body: the JSON chunks, and whether it ended with `data: [DONE]`.
pub fn read_sse(r: impl Read) -> (Vec<serde_json::Value>, bool) {
    let mut chunks = Vec::new();
    for line in BufReader::new(r).lines() {
        let line = line.unwrap();
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            return (chunks, true);
        }
        chunks.push(serde_json::from_str(data).unwrap());
    }
    (chunks, false)
}

/// A POST with `Content-Type: application/json` (the server answers 415 without it).
pub fn post_json(url: &str) -> ureq::Request {
    ureq::post(url).set("Content-Type", "application/json")
}
