//! `tinygpt-cpu serve`: an OpenAI-shaped HTTP server over one model, with continuous
//! batching over bounded caches.
//!
//! ```text
//!  HTTP (axum on a 1-worker tokio runtime)        scheduler thread (rayon pool)
//!  ───────────────────────────────────────        ─────────────────────────────
//!  parse + validate the request (400 names the field)
//!  render the chat template, tokenize
//!  admission: reserve worst-case KV bytes ──429──▶ (full: Retry-After)
//!  send a Job ─────────── std mpsc ─────────────▶ joins the batch between two steps
//!  SSE chunks / one JSON body ◀── tokio mpsc ──── Text deltas, then Done
//!  client gone = receiver dropped ──────────────▶ sequence cancelled at the next step
//! ```
//!
//! * [`scheduler`]: the step loop. Every step runs all active sequences through one
//!   [`Model::forward_sequences`](crate::model::Model::forward_sequences) (weights read
//!   once per step), prompts in chunks so that a long prompt does not stall the others.
//! * [`http`]: the endpoints and the OpenAI request/response shapes.
//! * [`metrics`]: counters and gauges for `/metrics` (Prometheus text format).
//!
//! The server keeps no state between requests, so replicas scale behind any HTTP load
//! balancer.

pub mod http;
pub mod metrics;
pub mod scheduler;

use crate::config::Config;
use crate::kv_cache::{KvCache, KvConfig, LayerKv};
use crate::model::Model;
use crate::tokenizer::Tokenizer;
use metrics::Metrics;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Prompt tokens prefilled per scheduler step, summed over all sequences that are still
/// reading their prompt (decoding sequences always advance by one token as well).
pub const PREFILL_TOKENS_PER_STEP: usize = 64;

/// Server-wide settings (`serve` flags).
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Cache settings a request gets unless it overrides them.
    pub kv: KvConfig,
    /// Allow dense caches past the model's context length.
    pub allow_past_context: bool,
    /// Most sequences admitted at once (`--max-sequences`).
    pub max_sequences: usize,
    /// Most worst-case KV bytes admitted at once (`--kv-budget`).
    pub kv_budget: usize,
    /// The id `/v1/models` reports.
    pub model_name: String,
    /// See [`PREFILL_TOKENS_PER_STEP`].
    pub prefill_tokens_per_step: usize,
}

/// Worst-case bytes the whole cache of a sequence of `tokens` tokens holds at any
/// moment, with cache settings `kv`.
///
/// Measured, not estimated: one layer's real cache ([`LayerKv`], the same byte accounting
/// `sample --json` reports) receives zero rows one at a time and the peak of its
/// [`bytes`](LayerKv::bytes) is taken, times the number of layers that hold K/V. Under a
/// window the stored rows stop growing at `sink + window` and from then on the byte count
/// only cycles with the K group (period `group_size`), so appending
/// `2 · (sink + window + group_size) + 4` rows covers every state a longer sequence goes
/// through. Row values do not change byte counts.
pub fn worst_case_kv_bytes(cfg: &Config, kv: &KvConfig, tokens: usize) -> usize {
    let rows = match kv.window {
        Some(w) => tokens.min(2 * (kv.sink + w + kv.group_size.max(1) + kv.residual) + 4),
        None => tokens,
    };
    let kv_dim = cfg.n_kv_heads * cfg.head_dim;
    let zero = vec![0.0f32; kv_dim];
    let mut layer = LayerKv::new(kv, cfg.n_kv_heads, cfg.head_dim);
    let mut peak = 0;
    for t in 0..rows {
        layer.append(&zero, &zero, t);
        peak = peak.max(layer.bytes());
    }
    peak * KvCache::new(cfg, kv).n_layers()
}

/// Admission control: the sequences and worst-case cache bytes admitted so far.
#[derive(Debug)]
pub struct Budget {
    pub max_sequences: usize,
    pub max_bytes: usize,
    used: Mutex<(usize, usize)>,
}

/// Why a request was not admitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Admitting it would pass `--max-sequences`.
    Sequences,
    /// Its worst-case cache does not fit in what is left of `--kv-budget`.
    Bytes { need: usize, free: usize },
}

impl Budget {
    pub fn new(max_sequences: usize, max_bytes: usize) -> Arc<Budget> {
        Arc::new(Budget {
            max_sequences,
            max_bytes,
            used: Mutex::new((0, 0)),
        })
    }

    /// Reserves one sequence slot and `bytes`; released when the guard is dropped.
    pub fn reserve(self: &Arc<Self>, bytes: usize) -> Result<Reservation, Refusal> {
        let mut u = self.used.lock().unwrap_or_else(|e| e.into_inner());
        if u.0 >= self.max_sequences {
            return Err(Refusal::Sequences);
        }
        let free = self.max_bytes.saturating_sub(u.1);
        if bytes > free {
            return Err(Refusal::Bytes { need: bytes, free });
        }
        u.0 += 1;
        u.1 += bytes;
        Ok(Reservation {
            budget: Arc::clone(self),
            bytes,
        })
    }

    /// (sequences, bytes) reserved now.
    pub fn used(&self) -> (usize, usize) {
        *self.used.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// A sequence's admission; dropping it (the sequence finished, failed or was cancelled)
/// gives the slot and bytes back.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<Budget>,
    bytes: usize,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        let mut u = self.budget.used.lock().unwrap_or_else(|e| e.into_inner());
        u.0 -= 1;
        u.1 -= self.bytes;
    }
}

/// What the HTTP handlers share.
pub struct Shared {
    pub cfg: ServerConfig,
    pub model_cfg: Config,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<String>,
    pub metrics: Metrics,
    pub budget: Arc<Budget>,
    /// Set when SIGTERM/SIGINT arrives: new requests get 503, running ones finish.
    pub draining: AtomicBool,
    jobs: Mutex<Option<std::sync::mpsc::Sender<scheduler::Job>>>,
    /// Memo of [`worst_case_kv_bytes`] by (cache settings, length).
    estimates: Mutex<HashMap<(String, usize), usize>>,
}

impl Shared {
    /// [`worst_case_kv_bytes`], memoised.
    pub fn worst_case_bytes(&self, kv: &KvConfig, tokens: usize) -> usize {
        let key = (format!("{kv:?}"), tokens);
        if let Some(&b) = self
            .estimates
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
        {
            return b;
        }
        let b = worst_case_kv_bytes(&self.model_cfg, kv, tokens);
        let mut m = self.estimates.lock().unwrap_or_else(|e| e.into_inner());
        if m.len() > 4096 {
            m.clear();
        }
        m.insert(key, b);
        b
    }

    /// Hands a job to the scheduler; `false` once shutdown has begun.
    pub fn submit(&self, job: scheduler::Job) -> bool {
        match &*self.jobs.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(tx) => tx.send(job).is_ok(),
            None => false,
        }
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::SeqCst)
    }
}

/// Runs the server until SIGTERM/SIGINT: binds `addr` (port 0 = any free port), calls
/// `on_bound` with the bound address, serves, then drains (stops accepting, lets running
/// requests finish) and returns. `threads` sizes the compute pool (default: all cores).
pub fn serve(
    model: Model,
    tokenizer: Tokenizer,
    chat_template: Option<String>,
    cfg: ServerConfig,
    addr: SocketAddr,
    threads: Option<usize>,
    on_bound: impl FnOnce(SocketAddr),
) -> crate::Result<()> {
    use crate::error::Error;
    let io = |e: std::io::Error| Error::Generate(format!("serve: {e}"));
    let (tx, rx) = std::sync::mpsc::channel();
    let shared = Arc::new(Shared {
        budget: Budget::new(cfg.max_sequences, cfg.kv_budget),
        model_cfg: model.cfg.clone(),
        cfg,
        tokenizer,
        chat_template,
        metrics: Metrics::default(),
        draining: AtomicBool::new(false),
        jobs: Mutex::new(Some(tx)),
        estimates: Mutex::new(HashMap::new()),
    });
    let mut pool = rayon::ThreadPoolBuilder::new().thread_name(|i| format!("compute-{i}"));
    if let Some(n) = threads {
        pool = pool.num_threads(n);
    }
    let pool = pool
        .build()
        .map_err(|e| Error::flag("--threads", e.to_string()))?;
    let sched_shared = Arc::clone(&shared);
    let scheduler = std::thread::Builder::new()
        .name("scheduler".into())
        .spawn(move || pool.install(|| scheduler::run(&model, &sched_shared, rx)))
        .map_err(io)?;

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("http")
        .enable_all()
        .build()
        .map_err(io)?;
    let result = rt.block_on(async {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| Error::flag("--port", format!("cannot bind {addr}: {e}")))?;
        on_bound(listener.local_addr().map_err(io)?);
        let app = http::router(Arc::clone(&shared));
        let drain = Arc::clone(&shared);
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                shutdown_signal().await;
                drain.draining.store(true, Ordering::SeqCst);
            })
            .await
            .map_err(io)
    });
    // No more jobs: the scheduler finishes what it holds and returns.
    shared.jobs.lock().unwrap_or_else(|e| e.into_inner()).take();
    let _ = scheduler.join();
    result
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
