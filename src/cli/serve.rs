//! `tinygpt-cpu serve`: the OpenAI-compatible server (see [`crate::server`]).

use super::common::{open_model, CacheArgs, ExecArgs, WeightsArg};
use crate::error::Error;
use crate::model::{Model, WeightsDType};
use crate::server::{serve, Access, Limits, ServerConfig, PREFILL_TOKENS_PER_STEP};
use clap::Args;
use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// A .tinygpt file, a .gguf file, or a Hugging Face model directory (default: the bundled model).
    pub model: Option<PathBuf>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port to listen on (0: any free port; the bound address is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Cache settings every request gets unless it overrides them.
    #[command(flatten)]
    pub cache: CacheArgs,
    /// Most sequences generating at once; more are answered 429.
    #[arg(long = "max-sequences", value_name = "N", default_value_t = 64)]
    pub max_sequences: usize,
    /// Most worst-case KV cache bytes admitted at once (sum over sequences); a request
    /// whose cache does not fit is answered 429 with Retry-After.
    #[arg(long = "kv-budget", value_name = "BYTES", default_value_t = 1 << 30)]
    pub kv_budget: usize,
    /// Most bytes of finished sequences' caches kept for reuse: a request whose prompt
    /// starts with what a kept one computed (a chat's next turn) resumes from it and
    /// prefills only the rest; least recently used dropped first (0: off; a request opts
    /// out with "cache_prompt": false).
    #[arg(long = "prompt-cache-bytes", value_name = "BYTES", default_value_t = 256 << 20)]
    pub prompt_cache_bytes: usize,
    /// Directory of saved conversation states: POST /v1/states/save {"id", "name"}
    /// writes the cache a completion left in the prompt cache to DIR/name, and
    /// /v1/states/restore {"name"} loads one back (without it: 404).
    #[arg(long = "state-dir", value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// Speculative decoding with prompt-lookup drafts for every request that does not set
    /// "speculate" itself: `ngram`, or `ngram:K` for drafts of at most K tokens (default
    /// 8); off when absent. Greedy output is bit-identical to plain decoding (docs/design.md
    /// §3.3).
    #[arg(long, value_name = "ngram[:K]")]
    pub speculate: Option<String>,
    /// A speculating sequence drafts only in steps where at most N sequences are decoding
    /// (default: in every step). A batch already reads each weight once for several
    /// tokens, which is what drafts buy: drafts in a batch add little and lengthen the
    /// step (docs/eval/speculate.md, "In serve": 4 SmolLM2 streams, inter-token p99
    /// 30–49 ms with drafts in every step, 11–16 ms with N = 1, the same tok/s). Like
    /// vLLM's speculative-disable-by-batch-size.
    #[arg(long = "speculate-max-batch", value_name = "N")]
    pub speculate_max_batch: Option<usize>,
    /// Weight dtype in memory: as stored (native), or converted at load.
    #[arg(long = "weights-dtype", value_enum)]
    pub weights_dtype: Option<WeightsArg>,
    /// Compute threads (default: all cores).
    #[arg(long, value_name = "N")]
    pub threads: Option<usize>,
    #[command(flatten)]
    pub exec: ExecArgs,
    /// Seconds a connection has to send a request's whole header; also closes idle
    /// keep-alive connections and stalled TLS handshakes.
    #[arg(long = "header-timeout", value_name = "SECS", default_value_t = 10.0)]
    pub header_timeout: f64,
    /// Seconds a request body has to arrive in full (408 after).
    #[arg(long = "body-timeout", value_name = "SECS", default_value_t = 30.0)]
    pub body_timeout: f64,
    /// Largest request body in bytes (413 above).
    #[arg(long = "max-body-bytes", value_name = "BYTES", default_value_t = 8 << 20)]
    pub max_body_bytes: usize,
    /// Seconds a generation may run after admission; then it ends with finish reason
    /// "length" (0: no limit).
    #[arg(long = "request-timeout", value_name = "SECS", default_value_t = 600.0)]
    pub request_timeout: f64,
    /// Most new tokens one request may ask for (max_tokens above it: 400).
    #[arg(long = "max-request-tokens", value_name = "N", default_value_t = 1 << 16)]
    pub max_request_tokens: usize,
    /// Longest prompt in tokens for a bounded cache (a dense cache is bounded by the
    /// model's context length).
    #[arg(long = "max-prompt-tokens", value_name = "N", default_value_t = 1 << 16)]
    pub max_prompt_tokens: usize,
    /// Open connections at most (lowered to fit the descriptor limit); more wait in the
    /// kernel's backlog.
    #[arg(long = "max-connections", value_name = "N", default_value_t = 256)]
    pub max_connections: usize,
    /// Requests that may wait for admission when sequences or the KV budget are full
    /// (0: answer 429 at once).
    #[arg(long = "max-queue", value_name = "N", default_value_t = 256)]
    pub max_queue: usize,
    /// Seconds a request may wait in the queue before 429.
    #[arg(long = "queue-timeout", value_name = "SECS", default_value_t = 60.0)]
    pub queue_timeout: f64,
    /// Seconds after SIGTERM during which /health answers 503 and new connections are
    /// still accepted (so load balancers see the server leave).
    #[arg(long = "drain-grace", value_name = "SECS", default_value_t = 5.0)]
    pub drain_grace: f64,
    /// Seconds after SIGTERM when requests still running are cut and the process exits;
    /// a second SIGTERM/SIGINT cuts at once.
    #[arg(long = "drain-timeout", value_name = "SECS", default_value_t = 30.0)]
    pub drain_timeout: f64,
    /// Require `Authorization: Bearer KEY` on /v1/* (401 otherwise).
    #[arg(long = "api-key", value_name = "KEY")]
    pub api_key: Option<String>,
    /// Like --api-key, with the keys read from a file (one per line).
    #[arg(long = "api-key-file", value_name = "FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Host header names accepted, comma-separated ("*": any). Default: the loopback
    /// names when --host is a loopback address (against DNS rebinding), else any.
    #[arg(long = "allowed-hosts", value_name = "LIST", value_delimiter = ',')]
    pub allowed_hosts: Vec<String>,
    /// Origin header values accepted, comma-separated ("*": any), besides origins on an
    /// allowed host. Requests from other origins get 403.
    #[arg(long = "allowed-origins", value_name = "LIST", value_delimiter = ',')]
    pub allowed_origins: Vec<String>,
    /// PEM certificate chain: serve HTTPS (with --tls-key).
    #[arg(long = "tls-cert", value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for --tls-cert.
    #[arg(long = "tls-key", value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
}

/// A duration flag in seconds: finite, positive (or 0 where `zero_ok`, meaning none).
fn secs(flag: &str, v: f64, zero_ok: bool) -> crate::Result<Option<Duration>> {
    if zero_ok && v == 0.0 {
        return Ok(None);
    }
    if !(v.is_finite() && v > 0.0 && v <= 1e7) {
        return Err(Error::flag(
            flag,
            format!(
                "must be a number of seconds above 0{}, got {v}",
                if zero_ok { " (or 0 for none)" } else { "" }
            ),
        ));
    }
    Ok(Some(Duration::from_secs_f64(v)))
}

fn positive(flag: &str, v: usize) -> crate::Result<usize> {
    if v == 0 {
        return Err(Error::flag(flag, "must be at least 1"));
    }
    Ok(v)
}

fn limits(a: &ServeArgs) -> crate::Result<Limits> {
    let need = |flag: &str, v: f64| -> crate::Result<Duration> {
        secs(flag, v, false).map(|d| d.unwrap_or_default())
    };
    let l = Limits {
        header_timeout: need("--header-timeout", a.header_timeout)?,
        body_timeout: need("--body-timeout", a.body_timeout)?,
        max_body_bytes: positive("--max-body-bytes", a.max_body_bytes)?,
        request_timeout: secs("--request-timeout", a.request_timeout, true)?,
        max_request_tokens: positive("--max-request-tokens", a.max_request_tokens)?,
        max_prompt_tokens: positive("--max-prompt-tokens", a.max_prompt_tokens)?,
        max_connections: positive("--max-connections", a.max_connections)?,
        max_queue: a.max_queue,
        queue_timeout: need("--queue-timeout", a.queue_timeout)?,
        drain_grace: secs("--drain-grace", a.drain_grace, true)?.unwrap_or_default(),
        drain_timeout: need("--drain-timeout", a.drain_timeout)?,
    };
    if l.drain_grace > l.drain_timeout {
        return Err(Error::flag(
            "--drain-grace",
            format!(
                "{} s is longer than --drain-timeout ({} s)",
                a.drain_grace, a.drain_timeout
            ),
        ));
    }
    Ok(l)
}

fn access(a: &ServeArgs) -> crate::Result<Access> {
    let mut api_keys = Vec::new();
    if let Some(k) = &a.api_key {
        if k.trim().is_empty() {
            return Err(Error::flag("--api-key", "is empty"));
        }
        api_keys.push(k.trim().to_string());
    }
    if let Some(f) = &a.api_key_file {
        let text = std::fs::read_to_string(f).map_err(|e| {
            Error::flag(
                "--api-key-file",
                format!("cannot read {}: {e}", f.display()),
            )
        })?;
        let before = api_keys.len();
        api_keys.extend(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .map(String::from),
        );
        if api_keys.len() == before {
            return Err(Error::flag(
                "--api-key-file",
                format!("{} holds no key", f.display()),
            ));
        }
    }
    let clean = |v: &[String]| -> Vec<String> {
        v.iter()
            .map(|h| h.trim().to_ascii_lowercase())
            .filter(|h| !h.is_empty())
            .collect()
    };
    let mut allowed_hosts = clean(&a.allowed_hosts);
    if allowed_hosts.iter().any(|h| h == "*") {
        allowed_hosts.clear();
    } else if allowed_hosts.is_empty() && a.host.is_loopback() {
        allowed_hosts = ["localhost", "127.0.0.1", "[::1]"]
            .map(String::from)
            .to_vec();
    }
    let allowed_origins = clean(&a.allowed_origins)
        .into_iter()
        .map(|o| o.trim_end_matches('/').to_string())
        .collect();
    Ok(Access {
        api_keys,
        allowed_hosts,
        allowed_origins,
    })
}

pub fn run(a: ServeArgs) -> anyhow::Result<()> {
    let kv = a.cache.kv_config()?;
    let limits = limits(&a)?;
    let access = access(&a)?;
    let tls = a.tls_cert.clone().zip(a.tls_key.clone());
    if let Some((cert, key)) = &tls {
        // Checked before the model loads, so a bad file fails fast.
        crate::server::net::load_tls(cert, key)?;
    }
    if a.max_sequences == 0 {
        return Err(Error::flag("--max-sequences", "must be at least 1").into());
    }
    if a.kv_budget == 0 {
        return Err(Error::flag("--kv-budget", "must be at least 1 byte").into());
    }
    if let Some(n) = a.threads {
        if n == 0 || n > 1024 {
            return Err(
                Error::flag("--threads", format!("must be between 1 and 1024, got {n}")).into(),
            );
        }
    }
    if let Some(d) = &a.state_dir {
        if !d.is_dir() {
            return Err(
                Error::flag("--state-dir", format!("{} is not a directory", d.display())).into(),
            );
        }
    }
    let speculate = a
        .speculate
        .as_deref()
        .map(|s| crate::speculate::SpecConfig::parse(s, "--speculate"))
        .transpose()?;
    if a.speculate_max_batch == Some(0) {
        return Err(Error::flag("--speculate-max-batch", "must be at least 1, got 0").into());
    }
    let files = open_model(&a.model)?;
    crate::kv_cache::validate(&kv, &files.config)?;
    let wdtype = match a.weights_dtype {
        Some(WeightsArg::Native) | None => WeightsDType::Native,
        Some(WeightsArg::F32) => WeightsDType::F32,
        Some(WeightsArg::Bf16) => WeightsDType::Bf16,
    };
    // The server runs batches of sequences on the whole pool: no adaptive choice.
    // The weights load while the tokenizer is being built (`ModelFiles::open`).
    let model = Model::load_opts(&files, wdtype, &a.exec.options(a.threads, false))
        .map_err(|e| files.tokenizer_error_or(e))?;
    let tokenizer = files.tokenizer()?.clone();
    let model_identity = match &a.state_dir {
        Some(_) => Some(crate::state::ModelIdentity::of(&files)?.with_weights(wdtype)),
        None => None,
    };
    let model_name = match &a.model {
        Some(p) => p
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| p.display().to_string()),
        None => "tinygpt-cpu-default".to_string(),
    };
    let cfg = ServerConfig {
        kv,
        allow_past_context: a.cache.allow_past_context,
        max_sequences: a.max_sequences,
        kv_budget: a.kv_budget,
        prompt_cache_bytes: a.prompt_cache_bytes,
        state_dir: a.state_dir.clone(),
        model_identity,
        model_name: model_name.clone(),
        prefill_tokens_per_step: PREFILL_TOKENS_PER_STEP,
        speculate,
        speculate_max_batch: a.speculate_max_batch.unwrap_or(usize::MAX),
        limits,
        access,
        tls: tls.clone(),
    };
    let scheme = if tls.is_some() { "https" } else { "http" };
    let addr = SocketAddr::new(a.host, a.port);
    let out = serve(
        model,
        tokenizer,
        files.chat_template.clone(),
        cfg,
        addr,
        a.threads,
        |bound| {
            // Scripts and tests read this line to find the port.
            println!("listening on {scheme}://{bound} (model {model_name})");
            let _ = std::io::stdout().flush();
        },
    )?;
    if out.cut > 0 {
        eprintln!(
            "{}: {} running requests cut after {:.1} s, exiting",
            if out.forced {
                "second signal"
            } else {
                "drain timeout"
            },
            out.cut,
            out.secs
        );
    } else {
        eprintln!("drained in {:.1} s, exiting", out.secs);
    }
    Ok(())
}
