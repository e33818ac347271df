//! `tinygpt-cpu serve`: an OpenAI-shaped HTTP server over one model, with continuous
//! batching over bounded caches.
//!
//! ```text
//!  HTTP (axum on a 1-worker tokio runtime)        scheduler thread (rayon pool)
//!  ───────────────────────────────────────        ─────────────────────────────
//!  accept (connection cap, idle connections closed under pressure, TLS)   [net]
//!  head checks (Host, 431), header/idle timeout                           [net]
//!  host/origin/api-key/content-type checks, body read (timeout, size cap) [access]
//!  ┄┄ blocking pool, one request at a time per two cores ┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄
//!  parse + validate the request (400 names the field)                     [params]
//!  render the chat template, tokenize (refused once past its token limit)
//!  give freed memory back after a large body
//!  ┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄┄
//!  admission: reserve worst-case KV bytes, or wait in the bounded queue
//!             ──429──▶ (queue full or queue timeout: Retry-After)
//!  send a Job ─────────── std mpsc ─────────────▶ joins the batch between two steps
//!  SSE chunks / one JSON body ◀── tokio mpsc ──── Text deltas, then Done
//!  client gone = receiver dropped ──────────────▶ sequence cancelled at the next step
//! ```
//!
//! * [`scheduler`]: the step loop. Every step runs all active sequences through one
//!   [`Model::forward_sequences`](crate::model::Model::forward_sequences) (weights read
//!   once per step), prompts in chunks so that a long prompt does not stall the others.
//! * [`http`]: the endpoints, admission, and the response shapes (JSON or server-sent
//!   events); `access` (who may call, the body's limits), `params` (a request's fields and
//!   its prompt as ids) and `api` (the OpenAI error shape, field readers) serve it.
//! * [`metrics`]: counters and gauges for `/metrics` (Prometheus text format).
//! * [`net`]: the accept loop (hyper, one task per connection), timeouts, the connection
//!   cap and what happens when it is reached, the checks on a request's head, TLS, and the
//!   drain on SIGTERM/SIGINT.
//!
//! The work of one request that is not generation (parsing, tokenising) is bounded by its
//! limits and runs off the runtime's thread, so one request never stalls another's stream
//! or `/health`. Each request carries its whole prompt, so replicas scale behind any
//! HTTP load balancer; the one thing kept between requests is an optimisation, the
//! [`prompt_cache`] (finished sequences' caches, from which a later request whose prompt
//! starts with the same ids resumes, with the same bits).

mod access;
mod api;
pub mod http;
pub mod metrics;
pub mod net;
mod params;
pub mod prompt_cache;
pub mod scheduler;
mod states;

use crate::config::Config;
use crate::kv_cache::{KvCache, KvConfig, LayerKv};
use crate::model::Model;
use crate::tokenizer::Tokenizer;
use metrics::Metrics;
use std::collections::HashMap;
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Prompt tokens prefilled per scheduler step, summed over all sequences that are still
/// reading their prompt (decoding sequences always advance by one token as well); the
/// drafted tokens of speculating sequences use what the prompts leave of it.
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
    /// Most bytes the prompt cache keeps (`--prompt-cache-bytes`; 0: no prompt cache).
    pub prompt_cache_bytes: usize,
    /// Where `/v1/states/save` writes and `/v1/states/restore` reads (`--state-dir`;
    /// `None`: those endpoints answer 404).
    pub state_dir: Option<PathBuf>,
    /// The served model's identity, recorded in and checked against saved states (set
    /// with `state_dir`).
    pub model_identity: Option<crate::state::ModelIdentity>,
    /// The id `/v1/models` reports.
    pub model_name: String,
    /// See [`PREFILL_TOKENS_PER_STEP`].
    pub prefill_tokens_per_step: usize,
    /// Speculative decoding a request gets unless it sets `speculate` (`--speculate`;
    /// `None`: off).
    pub speculate: Option<crate::speculate::SpecConfig>,
    /// Most sequences decoding in a step in which a sequence still drafts
    /// (`--speculate-max-batch`, at least 1; `usize::MAX` without it).
    pub speculate_max_batch: usize,
    /// Connection, request and drain limits.
    pub limits: Limits,
    /// Who may call the server.
    pub access: Access,
    /// PEM certificate chain and private key (`--tls-cert`, `--tls-key`): HTTPS when set.
    pub tls: Option<(PathBuf, PathBuf)>,
}

/// Time and size limits (`serve` flags; defaults in [`Limits::default`]).
#[derive(Debug, Clone)]
pub struct Limits {
    /// A connection must deliver a request's whole header within this time from when the
    /// server starts reading it: a fresh connection that sends nothing, half-sent headers
    /// and an idle keep-alive connection are all closed after it (`--header-timeout`).
    pub header_timeout: Duration,
    /// The whole request body must arrive within this time (`--body-timeout`; 408).
    pub body_timeout: Duration,
    /// Largest request body (`--max-body-bytes`; 413).
    pub max_body_bytes: usize,
    /// A generation is cut (finish reason `length`) this long after it was admitted
    /// (`--request-timeout`; `None` = never).
    pub request_timeout: Option<Duration>,
    /// Most new tokens one request may ask for (`--max-request-tokens`).
    pub max_request_tokens: usize,
    /// Longest prompt in tokens when the cache is bounded or `--allow-past-context` is set
    /// (a dense cache is bounded by the model's context length anyway).
    pub max_prompt_tokens: usize,
    /// Open connections at most (`--max-connections`); further ones wait in the kernel's
    /// accept backlog.
    pub max_connections: usize,
    /// Requests waiting for admission at most (`--max-queue`; 0 = answer 429 at once).
    pub max_queue: usize,
    /// How long a request waits in the queue before 429 (`--queue-timeout`).
    pub queue_timeout: Duration,
    /// After SIGTERM, `/health` answers 503 and new connections are still accepted for
    /// this long, so load balancers see the server leave (`--drain-grace`).
    pub drain_grace: Duration,
    /// After SIGTERM, running requests are cut when this much time has passed
    /// (`--drain-timeout`); the process exits then at the latest.
    pub drain_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            max_body_bytes: 8 << 20,
            request_timeout: Some(Duration::from_secs(600)),
            max_request_tokens: 1 << 16,
            max_prompt_tokens: 1 << 16,
            max_connections: 256,
            max_queue: 256,
            queue_timeout: Duration::from_secs(60),
            drain_grace: Duration::from_secs(5),
            drain_timeout: Duration::from_secs(30),
        }
    }
}

/// Access control (`--api-key`, `--api-key-file`, `--allowed-hosts`, `--allowed-origins`).
#[derive(Debug, Clone, Default)]
pub struct Access {
    /// Bearer keys accepted on `/v1/*`; empty = no key needed.
    pub api_keys: Vec<String>,
    /// Host header names (without port, lower case) accepted; empty = any. `serve` fills
    /// it with the loopback names when bound to a loopback address and no list is given.
    pub allowed_hosts: Vec<String>,
    /// Origin header values accepted besides those whose host is an allowed host;
    /// `"*"` = any.
    pub allowed_origins: Vec<String>,
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

/// Worst-case bytes a verification pass keeps in its hold beside the cache
/// (docs/design.md §3.3): `rows` rows (a draft of `rows - 1` tokens and the token before
/// it) appended under a hold, in a sequence of `tokens` tokens with cache settings `kv`.
///
/// Measured like [`worst_case_kv_bytes`]: one layer's real cache receives zero rows, and
/// before each of them `rows` rows are held and dropped again (`release(0)`), the peak of
/// [`hold_bytes`](LayerKv::hold_bytes) taken, times the layers that hold K/V. What a held
/// append journals depends on the ring slots, the K group and the residual ring it
/// writes, which repeat after `sink + window + group_size + residual` rows (without a
/// window, `group_size + residual`), so twice that many starting points cover every case.
pub fn worst_case_hold_bytes(cfg: &Config, kv: &KvConfig, tokens: usize, rows: usize) -> usize {
    let g = kv.group_size.max(1);
    let period = kv.sink + kv.window.unwrap_or(0) + g + kv.residual;
    let points = tokens.min(2 * period + 4);
    let kv_dim = cfg.n_kv_heads * cfg.head_dim;
    let zero = vec![0.0f32; kv_dim];
    let mut layer = LayerKv::new(kv, cfg.n_kv_heads, cfg.head_dim);
    let mut peak = 0;
    for t in 0..points {
        layer.hold();
        for i in 0..rows.min(tokens - t) {
            layer.append(&zero, &zero, t + i);
            peak = peak.max(layer.hold_bytes());
        }
        layer.release(0);
        layer.append(&zero, &zero, t);
    }
    peak * KvCache::new(cfg, kv).n_layers()
}

/// Admission control: the sequences and worst-case cache bytes admitted so far, and a
/// first-come-first-served queue of requests waiting for room.
#[derive(Debug)]
pub struct Budget {
    pub max_sequences: usize,
    pub max_bytes: usize,
    state: Mutex<BudgetState>,
    /// Woken when room may have appeared (a reservation ended, the head of the queue
    /// left, or the server started draining).
    room: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct BudgetState {
    sequences: usize,
    bytes: usize,
    /// Tickets of waiting requests, oldest first; only the oldest may take room, so a
    /// large request is not starved by small ones arriving after it.
    queue: VecDeque<u64>,
    next_ticket: u64,
    /// Requests that waited (admitted, refused or gone) and their total wait.
    waited: u64,
    wait_secs: f64,
}

/// Why a request was not admitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// Admitting it would pass `--max-sequences`.
    Sequences,
    /// Its worst-case cache does not fit in what is left of `--kv-budget`.
    Bytes { need: usize, free: usize },
    /// `--max-queue` requests are already waiting.
    QueueFull { waiting: usize },
    /// It waited `--queue-timeout` without room appearing.
    QueueTimeout { waited: Duration },
    /// The server began draining while it waited.
    Draining,
}

impl BudgetState {
    fn try_take(&mut self, budget: &Budget, bytes: usize) -> Result<(), Refusal> {
        if self.sequences >= budget.max_sequences {
            return Err(Refusal::Sequences);
        }
        let free = budget.max_bytes.saturating_sub(self.bytes);
        if bytes > free {
            return Err(Refusal::Bytes { need: bytes, free });
        }
        self.sequences += 1;
        self.bytes += bytes;
        Ok(())
    }
}

impl Budget {
    pub fn new(max_sequences: usize, max_bytes: usize) -> Arc<Budget> {
        Arc::new(Budget {
            max_sequences,
            max_bytes,
            state: Mutex::new(BudgetState::default()),
            room: tokio::sync::Notify::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BudgetState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reserves one sequence slot and `bytes` (released when the guard is dropped): at
    /// once if nobody is waiting and they fit, else after waiting in FIFO order. At most
    /// `max_queue` requests wait (0: refuse at once), each at most `timeout`; `draining`
    /// ends every wait.
    pub async fn reserve_or_wait(
        self: &Arc<Self>,
        bytes: usize,
        max_queue: usize,
        timeout: Duration,
        draining: &AtomicBool,
    ) -> Result<Reservation, Refusal> {
        let ticket = {
            let mut st = self.lock();
            if st.queue.is_empty() {
                match st.try_take(self, bytes) {
                    Ok(()) => {
                        return Ok(Reservation {
                            budget: Arc::clone(self),
                            bytes,
                        })
                    }
                    Err(r) if max_queue == 0 => return Err(r),
                    Err(_) => {}
                }
            }
            if st.queue.len() >= max_queue {
                return Err(Refusal::QueueFull {
                    waiting: st.queue.len(),
                });
            }
            let t = st.next_ticket;
            st.next_ticket += 1;
            st.queue.push_back(t);
            t
        };
        let waiting = Waiting {
            budget: self,
            ticket,
            since: Instant::now(),
        };
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.room.notified();
            tokio::pin!(notified);
            // Registered before the check, so a release between the two is not missed.
            notified.as_mut().enable();
            if draining.load(Ordering::SeqCst) {
                return Err(Refusal::Draining);
            }
            {
                let mut st = self.lock();
                if st.queue.front() == Some(&ticket) && st.try_take(self, bytes).is_ok() {
                    drop(st);
                    drop(waiting);
                    return Ok(Reservation {
                        budget: Arc::clone(self),
                        bytes,
                    });
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(Refusal::QueueTimeout {
                    waited: waiting.since.elapsed(),
                });
            }
        }
    }

    /// Wakes every waiting request (to see the drain, or new room).
    pub fn wake_all(&self) {
        self.room.notify_waiters();
    }

    /// (sequences, bytes) reserved now.
    pub fn used(&self) -> (usize, usize) {
        let st = self.lock();
        (st.sequences, st.bytes)
    }

    /// (requests waiting now, requests that waited so far, their total seconds waited).
    pub fn queue_stats(&self) -> (usize, u64, f64) {
        let st = self.lock();
        (st.queue.len(), st.waited, st.wait_secs)
    }
}

/// A request's place in the queue; leaving it (admitted, timed out, or the client went
/// away and the handler was dropped) lets the next one try.
struct Waiting<'a> {
    budget: &'a Budget,
    ticket: u64,
    since: Instant,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut st = self.budget.lock();
        st.queue.retain(|&t| t != self.ticket);
        st.waited += 1;
        st.wait_secs += self.since.elapsed().as_secs_f64();
        drop(st);
        self.budget.room.notify_waiters();
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
        let mut st = self.budget.lock();
        st.sequences -= 1;
        st.bytes -= self.bytes;
        drop(st);
        self.budget.room.notify_waiters();
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
    /// Set when the drain timeout passes or a second signal arrives: the scheduler ends
    /// every sequence at its next step.
    pub abort: AtomicBool,
    /// Set when the drain's grace ends: request bodies still arriving are abandoned (503).
    pub closing: Flag,
    /// Turns for a request's CPU work off the runtime (parsing, tokenising): half the
    /// cores, at least one, so that generation keeps the rest.
    pub prep: tokio::sync::Semaphore,
    jobs: Mutex<Option<std::sync::mpsc::Sender<scheduler::Job>>>,
    /// Memo of [`worst_case_kv_bytes`] and [`worst_case_hold_bytes`] by (cache settings,
    /// length, held rows; 0 for the former).
    estimates: Mutex<HashMap<(String, usize, usize), usize>>,
    /// Finished sequences' caches ([`prompt_cache`]).
    prompt_cache: Mutex<prompt_cache::PromptCache>,
}

/// A flag that can be awaited.
#[derive(Debug, Default)]
pub struct Flag {
    set: AtomicBool,
    notify: tokio::sync::Notify,
}

impl Flag {
    pub fn set(&self) {
        self.set.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    pub fn is_set(&self) -> bool {
        self.set.load(Ordering::SeqCst)
    }

    /// Returns once the flag is set.
    pub async fn wait(&self) {
        let notified = self.notify.notified();
        tokio::pin!(notified);
        // Registered before the check, so a `set` between the two is not missed.
        notified.as_mut().enable();
        if self.is_set() {
            return;
        }
        notified.await;
    }
}

impl Shared {
    /// [`worst_case_kv_bytes`], memoised.
    pub fn worst_case_bytes(&self, kv: &KvConfig, tokens: usize) -> usize {
        self.memo(kv, tokens, 0)
    }

    /// What a sequence of `tokens` tokens with cache settings `kv` is admitted for: its
    /// worst-case cache bytes, plus with speculation the worst-case bytes a verification
    /// pass of a full draft holds beside them ([`worst_case_hold_bytes`]).
    pub fn admission_bytes(
        &self,
        kv: &KvConfig,
        tokens: usize,
        spec: Option<crate::speculate::SpecConfig>,
    ) -> usize {
        let draft = spec.map_or(0, |c| c.max_draft);
        let hold = if draft > 0 {
            self.memo(kv, tokens, draft + 1)
        } else {
            0
        };
        self.worst_case_bytes(kv, tokens) + hold
    }

    /// [`worst_case_kv_bytes`] (`held` 0) or [`worst_case_hold_bytes`] of `held` rows,
    /// memoised.
    fn memo(&self, kv: &KvConfig, tokens: usize, held: usize) -> usize {
        let key = (format!("{kv:?}"), tokens, held);
        if let Some(&b) = self
            .estimates
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
        {
            return b;
        }
        let b = match held {
            0 => worst_case_kv_bytes(&self.model_cfg, kv, tokens),
            _ => worst_case_hold_bytes(&self.model_cfg, kv, tokens, held),
        };
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

    /// The prompt cache, locked.
    pub fn prompt_cache(&self) -> std::sync::MutexGuard<'_, prompt_cache::PromptCache> {
        self.prompt_cache.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Requests whose CPU work may run at once: half the cores, at least one.
fn prep_turns() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1))
}

/// Runs the server until SIGTERM/SIGINT: binds `addr` (port 0 = any free port), calls
/// `on_bound` with the bound address, serves, then drains ([`net::run`]) and returns.
/// `threads` sizes the compute pool (default: all cores).
pub fn serve(
    model: Model,
    tokenizer: Tokenizer,
    chat_template: Option<String>,
    cfg: ServerConfig,
    addr: SocketAddr,
    threads: Option<usize>,
    on_bound: impl FnOnce(SocketAddr),
) -> crate::Result<net::DrainOutcome> {
    use crate::error::Error;
    let io = |e: std::io::Error| Error::Generate(format!("serve: {e}"));
    let tls = match &cfg.tls {
        Some((cert, key)) => Some(net::load_tls(cert, key)?),
        None => None,
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let cfg_prompt_cache_bytes = cfg.prompt_cache_bytes;
    let shared = Arc::new(Shared {
        budget: Budget::new(cfg.max_sequences, cfg.kv_budget),
        model_cfg: model.cfg.clone(),
        cfg,
        tokenizer,
        chat_template,
        metrics: Metrics::default(),
        draining: AtomicBool::new(false),
        abort: AtomicBool::new(false),
        closing: Flag::default(),
        prep: tokio::sync::Semaphore::new(prep_turns()),
        jobs: Mutex::new(Some(tx)),
        estimates: Mutex::new(HashMap::new()),
        prompt_cache: Mutex::new(prompt_cache::PromptCache::new(cfg_prompt_cache_bytes)),
    });
    let mut pool = rayon::ThreadPoolBuilder::new().thread_name(|i| format!("compute-{i}"));
    if let Some(n) = threads {
        pool = pool.num_threads(n);
    }
    let pool = pool
        .build()
        .map_err(|e| Error::flag("--threads", e.to_string()))?;
    // The tokenizer's trie for long prompts, built while the server starts.
    let tokenizer = shared.tokenizer.clone();
    std::thread::Builder::new()
        .name("prepare-bounds".into())
        .spawn(move || {
            tokenizer.prepare_bounds();
            crate::memory::release_free_memory();
        })
        .map_err(io)?;
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
        net::run(listener, Arc::clone(&shared), tls).await
    });
    // No more jobs: the scheduler finishes what it holds (or, after an abort, drops it at
    // its next step) and returns.
    shared.jobs.lock().unwrap_or_else(|e| e.into_inner()).take();
    // Connections still open after an abort are dropped with the runtime.
    rt.shutdown_timeout(Duration::from_millis(500));
    let _ = scheduler.join();
    result
}
