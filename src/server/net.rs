//! Connections and the drain: the accept loop (hyper's HTTP/1 server, one task per
//! connection), the connection cap and what happens when it is reached, the header/idle
//! timeout, the checks on a request's head, TLS, and what SIGTERM/SIGINT do.
//!
//! Every open connection is registered ([`Conns`]) with the number of its requests in
//! progress (from the head's arrival until hyper drops the response body), so the server
//! knows which connections are idle: never sent a request, half-way through a head,
//! between two keep-alive requests, or in a TLS handshake.
//!
//! * **Connection cap** (`--max-connections`): a connection is accepted only with a free
//!   slot; further ones wait in the kernel's backlog instead of exhausting file
//!   descriptors. The cap is lowered to fit the process's descriptor limit. While every
//!   slot is taken, connections idle for [`PRESSURE_IDLE`] are closed every
//!   [`PRESSURE_TICK`], so silent sockets cannot keep probes and new clients waiting:
//!   with the cap full of them, `/health` is answered within about half a second.
//! * **Header timeout** (`--header-timeout`): hyper's header-read timer runs whenever a
//!   connection is waiting for a request head, so it closes a connection that sends
//!   nothing, one that stalls half-way through its headers, and an idle keep-alive
//!   connection alike. TLS handshakes get the same deadline. Body and request deadlines
//!   are the handlers' ([`super::http`]) and the scheduler's.
//! * **Request heads**: one over [`MAX_HEAD_BYTES`] or with a header line over
//!   [`MAX_HEADER_LINE_BYTES`] is answered 431; an HTTP/1.1 request without exactly one
//!   `Host` header 400 (RFC 9112 §3.2).
//! * **Drain**: the first signal sets `draining` (`/health` answers 503 on connections
//!   that are open or opened now, new generations 503, queued ones leave with 503) and
//!   the listener keeps accepting for `--drain-grace`, so a load balancer sees the 503.
//!   Then the listener closes (new connections are refused), idle and half-sent
//!   connections close (bodies still arriving are answered 503), connections with a
//!   running request close as soon as it ends, and at `--drain-timeout` after the signal
//!   whatever is still running is cut. A second signal cuts at once.

use super::api::ApiError;
use super::Shared;
use crate::error::Error;
use axum::body::{Body, Bytes};
use axum::http::{header, Request, Response, StatusCode, Version};
use axum::response::IntoResponse;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use hyper_util::service::TowerToHyperService;
use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio_rustls::rustls;
use tokio_rustls::TlsAcceptor;

/// Largest request head (request line and headers); larger ones are answered 431.
pub const MAX_HEAD_BYTES: usize = 32 << 10;
/// Longest single header line (name, colon, value); longer ones are answered 431.
pub const MAX_HEADER_LINE_BYTES: usize = 8 << 10;
/// While every connection slot is taken, idle connections are closed this often...
pub const PRESSURE_TICK: Duration = Duration::from_millis(100);
/// ...once they have been idle this long.
pub const PRESSURE_IDLE: Duration = Duration::from_millis(250);
/// At the end of the drain's grace, hyper is first given this long to close the idle
/// keep-alive connections itself (after flushing what it was writing).
const DRAIN_SETTLE: Duration = Duration::from_millis(100);

/// How the server ended.
#[derive(Debug, Clone, PartialEq)]
pub struct DrainOutcome {
    /// Requests still running when the drain timeout passed or a second signal came;
    /// they were ended with an error event.
    pub cut: usize,
    /// A second signal ended the drain.
    pub forced: bool,
    /// Seconds from the first signal to the end.
    pub secs: f64,
}

/// Reads a PEM certificate chain and private key (`--tls-cert`, `--tls-key`).
pub fn load_tls(cert: &Path, key: &Path) -> crate::Result<TlsAcceptor> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let certs = CertificateDer::pem_file_iter(cert)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| {
            Error::flag(
                "--tls-cert",
                format!("{}: not a PEM certificate chain ({e})", cert.display()),
            )
        })?;
    if certs.is_empty() {
        return Err(Error::flag(
            "--tls-cert",
            format!("{}: holds no certificate", cert.display()),
        ));
    }
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| {
        Error::flag(
            "--tls-key",
            format!("{}: not a PEM private key ({e})", key.display()),
        )
    })?;
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| Error::flag("--tls-cert", e.to_string()))?
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .map_err(|e| {
        Error::flag(
            "--tls-key",
            format!("the key does not fit the certificate: {e}"),
        )
    })?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// The descriptor limit of this process (`RLIMIT_NOFILE`, soft), if known.
fn fd_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes one rlimit into the struct we pass.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) } == 0 {
            // rlim_t is u64 on Linux and macOS, narrower on some 32-bit targets.
            #[allow(clippy::unnecessary_cast)]
            return Some(r.rlim_cur as u64);
        }
    }
    None
}

/// `--max-connections`, lowered so that connections plus the descriptors the process
/// holds anyway (model file, pipes, runtime) stay under the descriptor limit.
pub fn connection_cap(requested: usize) -> usize {
    const RESERVED: u64 = 64;
    match fd_limit() {
        Some(lim) if lim > RESERVED => requested.min((lim - RESERVED) as usize).max(1),
        Some(_) => 1,
        None => requested.max(1),
    }
}

/// SIGTERM and SIGINT, as a stream.
struct Signals {
    #[cfg(unix)]
    term: Option<tokio::signal::unix::Signal>,
}

impl Signals {
    fn new() -> Self {
        Signals {
            #[cfg(unix)]
            term: tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok(),
        }
    }

    async fn next(&mut self) {
        #[cfg(unix)]
        if let Some(term) = &mut self.term {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            return;
        }
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// The open connections.
pub struct Conns {
    epoch: Instant,
    next: AtomicU64,
    open: Mutex<HashMap<u64, Arc<Conn>>>,
}

/// One open connection.
pub struct Conn {
    /// Requests in progress on it: from the head's arrival until hyper drops the response
    /// body (HTTP/1 has at most one).
    busy: AtomicUsize,
    /// Milliseconds after [`Conns::epoch`] when it last became idle (accepted, or its last
    /// response done).
    idle_since: AtomicU64,
    /// Notified to close it now.
    close: Notify,
}

impl Conns {
    fn new() -> Arc<Conns> {
        Arc::new(Conns {
            epoch: Instant::now(),
            next: AtomicU64::new(0),
            open: Mutex::new(HashMap::new()),
        })
    }

    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Conn>>> {
        self.open.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn add(&self) -> (u64, Arc<Conn>) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn {
            busy: AtomicUsize::new(0),
            idle_since: AtomicU64::new(self.now_ms()),
            close: Notify::new(),
        });
        self.lock().insert(id, Arc::clone(&conn));
        (id, conn)
    }

    fn remove(&self, id: u64) {
        self.lock().remove(&id);
    }

    /// Closes every connection with no request in progress that has been idle for at
    /// least `idle`; returns how many.
    fn close_idle(&self, idle: Duration) -> usize {
        let now = self.now_ms();
        let idle = idle.as_millis() as u64;
        let mut n = 0;
        for c in self.lock().values() {
            if c.busy.load(Ordering::SeqCst) == 0
                && now.saturating_sub(c.idle_since.load(Ordering::SeqCst)) >= idle
            {
                c.close.notify_one();
                n += 1;
            }
        }
        n
    }
}

/// A request in progress on a connection; its drop marks the connection idle again.
struct Busy {
    conn: Arc<Conn>,
    conns: Arc<Conns>,
}

impl Busy {
    fn new(conn: &Arc<Conn>, conns: &Arc<Conns>) -> Busy {
        conn.busy.fetch_add(1, Ordering::SeqCst);
        Busy {
            conn: Arc::clone(conn),
            conns: Arc::clone(conns),
        }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.conn
            .idle_since
            .store(self.conns.now_ms(), Ordering::SeqCst);
        self.conn.busy.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A response body that keeps its connection marked busy until hyper drops it.
pub struct Guarded {
    body: Body,
    _busy: Option<Busy>,
}

impl hyper::body::Body for Guarded {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// The service of one connection: the head checks, then the router, with the connection
/// marked busy while a request is in progress.
#[derive(Clone)]
struct ConnService {
    app: TowerToHyperService<axum::Router>,
    conn: Arc<Conn>,
    conns: Arc<Conns>,
}

type ResponseFuture = Pin<Box<dyn Future<Output = Result<Response<Guarded>, Infallible>> + Send>>;

impl hyper::service::Service<Request<Incoming>> for ConnService {
    type Response = Response<Guarded>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn call(&self, req: Request<Incoming>) -> ResponseFuture {
        if let Err(e) = check_head(&req) {
            let resp = e.into_response().map(|body| Guarded { body, _busy: None });
            return Box::pin(std::future::ready(Ok(resp)));
        }
        let busy = Busy::new(&self.conn, &self.conns);
        let fut = hyper::service::Service::call(&self.app, req);
        Box::pin(async move {
            let resp = fut.await?;
            Ok(resp.map(|body| Guarded {
                body,
                _busy: Some(busy),
            }))
        })
    }
}
/// What a request head must be before it is routed: no header line over
/// [`MAX_HEADER_LINE_BYTES`] (431), and for HTTP/1.1 exactly one `Host` header (400, as
/// RFC 9112 §3.2 requires).
fn check_head<B>(req: &Request<B>) -> Result<(), ApiError> {
    if let Some((name, _)) = req
        .headers()
        .iter()
        .find(|(n, v)| n.as_str().len() + 2 + v.len() > MAX_HEADER_LINE_BYTES)
    {
        return Err(ApiError::status(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            format!("header '{name}' is longer than {MAX_HEADER_LINE_BYTES} bytes"),
        ));
    }
    let hosts = req.headers().get_all(header::HOST).iter().count();
    if req.version() == Version::HTTP_11 && hosts != 1 {
        return Err(ApiError::status(
            StatusCode::BAD_REQUEST,
            if hosts == 0 {
                "an HTTP/1.1 request needs a Host header"
            } else {
                "a request may have only one Host header"
            },
        ));
    }
    Ok(())
}

/// Waits for a connection slot, then for a connection. While every slot is taken,
/// connections idle for [`PRESSURE_IDLE`] are closed every [`PRESSURE_TICK`].
async fn accept(
    listener: &TcpListener,
    slots: &Arc<Semaphore>,
    conns: &Conns,
) -> Option<(TcpStream, OwnedSemaphorePermit)> {
    let permit = loop {
        tokio::select! {
            p = Arc::clone(slots).acquire_owned() => break p.ok()?,
            _ = tokio::time::sleep(PRESSURE_TICK) => {
                conns.close_idle(PRESSURE_IDLE);
            }
        }
    };
    match listener.accept().await {
        Ok((stream, _)) => {
            let _ = stream.set_nodelay(true);
            Some((stream, permit))
        }
        Err(e) => {
            // EMFILE and friends: back off instead of spinning; the slot is released.
            eprintln!("serve: accept failed: {e}");
            tokio::time::sleep(Duration::from_millis(100)).await;
            None
        }
    }
}

/// What a connection's task needs besides its stream.
#[derive(Clone)]
struct ConnSetup {
    app: axum::Router,
    tls: Option<TlsAcceptor>,
    conns: Arc<Conns>,
    header_timeout: Duration,
}

/// Serves one connection until it closes or is closed ([`Conn::close`]); it stays
/// registered, and holds its slot, until then.
fn spawn_connection(
    stream: TcpStream,
    permit: OwnedSemaphorePermit,
    setup: ConnSetup,
    watcher: Watcher,
) {
    tokio::spawn(async move {
        let (id, conn) = setup.conns.add();
        let service = ConnService {
            app: TowerToHyperService::new(setup.app),
            conn: Arc::clone(&conn),
            conns: Arc::clone(&setup.conns),
        };
        let timeout = setup.header_timeout;
        let serve = async {
            match setup.tls {
                None => serve_io(stream, service, watcher, timeout).await,
                Some(acceptor) => {
                    if let Ok(Ok(s)) = tokio::time::timeout(timeout, acceptor.accept(stream)).await
                    {
                        serve_io(s, service, watcher, timeout).await;
                    }
                }
            }
        };
        tokio::select! {
            _ = serve => {}
            _ = conn.close.notified() => {}
        }
        setup.conns.remove(id);
        drop(permit);
    });
}

async fn serve_io<I>(io: I, service: ConnService, watcher: Watcher, header_timeout: Duration)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .max_header_size(MAX_HEAD_BYTES)
        .max_buf_size(64 << 10)
        .serve_connection(TokioIo::new(io), service);
    // Errors here are the client's (reset, timeout, malformed head): nothing to report.
    let _ = watcher.watch(conn).await;
}

/// Serves until a signal, then drains (see the module docs).
pub async fn run(
    listener: TcpListener,
    shared: Arc<Shared>,
    tls: Option<TlsAcceptor>,
) -> crate::Result<DrainOutcome> {
    let limits = shared.cfg.limits.clone();
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(connection_cap(limits.max_connections)));
    let conns = Conns::new();
    let setup = ConnSetup {
        app: super::http::router(Arc::clone(&shared)),
        tls,
        conns: Arc::clone(&conns),
        header_timeout: limits.header_timeout,
    };
    let mut signals = Signals::new();
    let spawn = |(stream, permit): (TcpStream, OwnedSemaphorePermit)| {
        spawn_connection(stream, permit, setup.clone(), graceful.watcher())
    };

    loop {
        tokio::select! {
            _ = signals.next() => break,
            c = accept(&listener, &slots, &conns) => if let Some(c) = c { spawn(c) },
        }
    }
    let t0 = Instant::now();
    shared.draining.store(true, Ordering::SeqCst);
    shared.budget.wake_all();
    eprintln!(
        "draining: /health answers 503; running requests finish (at most {:.0} s; a second signal ends them now)",
        limits.drain_timeout.as_secs_f64()
    );
    let grace = tokio::time::sleep(limits.drain_grace.min(limits.drain_timeout));
    tokio::pin!(grace);
    let mut forced = false;
    loop {
        tokio::select! {
            _ = &mut grace => break,
            _ = signals.next() => { forced = true; break }
            c = accept(&listener, &slots, &conns) => if let Some(c) = c { spawn(c) },
        }
    }
    drop(listener);
    finish(&shared, graceful, &conns, &mut signals, forced, t0).await
}

/// The end of the drain, once the grace is over (or a second signal came): closes what
/// is idle or half-sent, waits for running requests until the drain timeout, then cuts
/// them.
async fn finish(
    shared: &Shared,
    graceful: GracefulShutdown,
    conns: &Conns,
    signals: &mut Signals,
    mut forced: bool,
    t0: Instant,
) -> crate::Result<DrainOutcome> {
    let limits = &shared.cfg.limits;
    // Bodies still arriving are answered 503; hyper closes idle keep-alive connections
    // and closes the others after their running request.
    shared.closing.set();
    let all_closed = graceful.shutdown();
    tokio::pin!(all_closed);
    if !forced {
        let settle = tokio::time::sleep(DRAIN_SETTLE);
        let deadline = tokio::time::sleep(limits.drain_timeout.saturating_sub(t0.elapsed()));
        tokio::pin!(settle, deadline);
        let mut settled = false;
        loop {
            tokio::select! {
                _ = &mut all_closed => return Ok(DrainOutcome {
                    cut: 0,
                    forced: false,
                    secs: t0.elapsed().as_secs_f64(),
                }),
                // What is still idle now is silent or half-sent: closed.
                _ = &mut settle, if !settled => {
                    settled = true;
                    conns.close_idle(Duration::ZERO);
                }
                _ = &mut deadline => break,
                _ = signals.next() => { forced = true; break }
            }
        }
    }
    // Cut what still runs: the scheduler ends it at its next step; give the streams a
    // moment to carry the error and close.
    let running = shared.budget.used().0;
    shared.abort.store(true, Ordering::SeqCst);
    let _ = tokio::time::timeout(Duration::from_secs(1), all_closed).await;
    Ok(DrainOutcome {
        cut: running,
        forced,
        secs: t0.elapsed().as_secs_f64(),
    })
}
