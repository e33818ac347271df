//! Connections and the drain: the accept loop (hyper's HTTP/1 server, one task per
//! connection), the connection cap, the header/idle timeout, TLS, and what SIGTERM/SIGINT
//! do.
//!
//! * **Connection cap** (`--max-connections`): a connection is accepted only with a free
//!   slot; further ones wait in the kernel's backlog instead of exhausting file
//!   descriptors. The cap is lowered to fit the process's descriptor limit.
//! * **Header timeout** (`--header-timeout`): hyper's header-read timer runs whenever a
//!   connection is waiting for a request head, so it closes a connection that sends
//!   nothing, one that stalls half-way through its headers, and an idle keep-alive
//!   connection alike. TLS handshakes get the same deadline. Body and request deadlines
//!   are the handlers' ([`super::http`]) and the scheduler's.
//! * **Drain**: the first signal sets `draining` (`/health` answers 503 on connections
//!   that are open or opened now, new generations 503, queued ones leave with 503) and
//!   the listener keeps accepting for `--drain-grace`, so a load balancer sees the 503.
//!   Then the listener closes (new connections are refused), connections close as soon as
//!   their running request ends, and at `--drain-timeout` after the signal whatever is
//!   still running is cut. A second signal cuts at once.

use super::Shared;
use crate::error::Error;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::{GracefulShutdown, Watcher};
use hyper_util::service::TowerToHyperService;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_rustls::rustls;
use tokio_rustls::TlsAcceptor;

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

/// Waits for a connection slot, then for a connection.
async fn accept(
    listener: &TcpListener,
    slots: &Arc<Semaphore>,
) -> Option<(TcpStream, OwnedSemaphorePermit)> {
    let permit = Arc::clone(slots).acquire_owned().await.ok()?;
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

/// Serves one connection until it closes; the slot is held until then.
fn spawn_connection(
    stream: TcpStream,
    permit: OwnedSemaphorePermit,
    app: axum::Router,
    tls: Option<TlsAcceptor>,
    watcher: Watcher,
    header_timeout: Duration,
) {
    tokio::spawn(async move {
        match tls {
            None => serve_io(stream, app, watcher, header_timeout).await,
            Some(acceptor) => {
                if let Ok(Ok(s)) =
                    tokio::time::timeout(header_timeout, acceptor.accept(stream)).await
                {
                    serve_io(s, app, watcher, header_timeout).await;
                }
            }
        }
        drop(permit);
    });
}

async fn serve_io<I>(io: I, app: axum::Router, watcher: Watcher, header_timeout: Duration)
where
    I: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(header_timeout)
        .max_buf_size(64 << 10)
        .serve_connection(TokioIo::new(io), TowerToHyperService::new(app));
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
    let app = super::http::router(Arc::clone(&shared));
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(connection_cap(limits.max_connections)));
    let mut signals = Signals::new();
    let spawn = |(stream, permit): (TcpStream, OwnedSemaphorePermit)| {
        spawn_connection(
            stream,
            permit,
            app.clone(),
            tls.clone(),
            graceful.watcher(),
            limits.header_timeout,
        )
    };

    loop {
        tokio::select! {
            _ = signals.next() => break,
            c = accept(&listener, &slots) => if let Some(c) = c { spawn(c) },
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
            c = accept(&listener, &slots) => if let Some(c) = c { spawn(c) },
        }
    }
    drop(listener);
    // Connections close as their running request ends (idle ones now).
    let all_closed = graceful.shutdown();
    tokio::pin!(all_closed);
    if !forced {
        let deadline = tokio::time::sleep(limits.drain_timeout.saturating_sub(t0.elapsed()));
        tokio::select! {
            _ = &mut all_closed => return Ok(DrainOutcome {
                cut: 0,
                forced: false,
                secs: t0.elapsed().as_secs_f64(),
            }),
            _ = deadline => {}
            _ = signals.next() => forced = true,
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
