//! Accepting connections: on TCP addresses or Unix sockets (llama-server's `--host PATH.sock`),
//! plain HTTP/1.1 or HTTPS (rustls), each connection served by hyper, and a graceful shutdown: stop
//! accepting, let in-flight requests finish for a grace period, then end them as cut short.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio_rustls::rustls;
use tokio_rustls::TlsAcceptor;

/// The longest a client may take to send a request's head, or to send the next piece of its body,
/// before its connection is closed (`--timeout` where that is shorter): requests half sent and
/// left open would otherwise hold their connections for ever.
pub const READ_TIMEOUT: Duration = Duration::from_secs(30);

/// [`READ_TIMEOUT`], or the per-request `--timeout` where shorter.
pub fn read_timeout(request_timeout: Option<Duration>) -> Duration {
    request_timeout.map_or(READ_TIMEOUT, |t| t.min(READ_TIMEOUT))
}

/// How long in-flight requests may run after a shutdown signal before they are cut.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// A socket the server accepts connections on.
pub enum Listener {
    Tcp(TcpListener),
    /// A Unix socket, its file removed when the server stops.
    #[cfg(unix)]
    Unix(tokio::net::UnixListener, PathBuf),
}

impl Listener {
    /// Binds `--host` at `port`: one address, or several comma-separated as llama-server takes them
    /// (a port of 0 picks a free one, which the later addresses share); an address ending in `.sock`
    /// is a Unix socket there.
    pub async fn bind_all(hosts: &str, port: u16) -> Result<Vec<Listener>> {
        let mut out = Vec::new();
        let mut port = port;
        for host in hosts.split(',').map(str::trim).filter(|h| !h.is_empty()) {
            let listener = if host.ends_with(".sock") {
                Listener::bind_unix(Path::new(host))?
            } else {
                // `[::1]` as in a URL, or a bare address.
                let addr = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
                let tcp =
                    TcpListener::bind((addr, port)).await.with_context(|| format!("cannot listen on {host}:{port}"))?;
                port = tcp.local_addr()?.port();
                Listener::Tcp(tcp)
            };
            out.push(listener);
        }
        if out.is_empty() {
            anyhow::bail!("--host names no address");
        }
        Ok(out)
    }

    #[cfg(unix)]
    fn bind_unix(path: &Path) -> Result<Listener> {
        // A socket file left by a server that is gone is taken over; one in use, or any other file,
        // is not.
        if let Ok(meta) = std::fs::symlink_metadata(path) {
            use std::os::unix::fs::FileTypeExt;
            if !meta.file_type().is_socket() {
                anyhow::bail!("cannot listen on {}: a file that is not a socket is there", path.display());
            }
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                anyhow::bail!("cannot listen on {}: another server is listening there", path.display());
            }
            std::fs::remove_file(path).with_context(|| format!("removing the stale socket {}", path.display()))?;
        }
        let l = tokio::net::UnixListener::bind(path).with_context(|| format!("cannot listen on {}", path.display()))?;
        Ok(Listener::Unix(l, path.to_path_buf()))
    }

    #[cfg(not(unix))]
    fn bind_unix(path: &Path) -> Result<Listener> {
        anyhow::bail!("cannot listen on {}: Unix sockets need a Unix system", path.display())
    }

    /// Where it listens, as a URL (`http://127.0.0.1:8080`, `unix:///run/mlxcel.sock`).
    pub fn url(&self, scheme: &str) -> String {
        match self {
            Listener::Tcp(l) => match l.local_addr() {
                Ok(a) => format!("{scheme}://{a}"),
                Err(_) => format!("{scheme}://?"),
            },
            #[cfg(unix)]
            Listener::Unix(_, path) => format!("unix://{}", path.display()),
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        #[cfg(unix)]
        if let Listener::Unix(_, path) = self {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// An accepted connection and who is at its other end.
enum Accepted {
    Tcp(tokio::net::TcpStream),
    #[cfg(unix)]
    Unix(tokio::net::UnixStream),
}

/// The next connection on any of `listeners`.
async fn accept_any(listeners: &[Listener]) -> std::io::Result<(Accepted, String)> {
    let accepts = listeners.iter().map(|l| {
        Box::pin(async move {
            match l {
                Listener::Tcp(t) => t.accept().await.map(|(s, peer)| (Accepted::Tcp(s), peer.to_string())),
                #[cfg(unix)]
                Listener::Unix(u, path) => {
                    u.accept().await.map(|(s, _)| (Accepted::Unix(s), format!("unix://{}", path.display())))
                }
            }
        })
    });
    futures_util::future::select_all(accepts).await.0
}

/// A TLS acceptor from PEM files (certificate chain, private key).
pub fn tls_acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(cert)
        .with_context(|| format!("reading --ssl-cert-file {}", cert.display()))?
        .collect::<Result<_, _>>()
        .with_context(|| format!("--ssl-cert-file {} is not a PEM certificate chain", cert.display()))?;
    if certs.is_empty() {
        anyhow::bail!("--ssl-cert-file {} holds no certificate", cert.display());
    }
    let key = PrivateKeyDer::from_pem_file(key)
        .with_context(|| format!("--ssl-key-file {} holds no PEM private key", key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("TLS setup")?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .context("the TLS certificate and key do not match or are not supported")?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// How long requests cut short at the end of the grace period have to send their last words.
const CUT_FLUSH: Duration = Duration::from_secs(3);

/// Serves `app` on `listener` until `shutdown` resolves (a request's head must arrive within
/// `read_timeout`), then shuts down gracefully: requests in
/// flight may finish for [`SHUTDOWN_GRACE`] (a second signal ends that at once); then `cut` ends
/// those left as cut short, so each answer still ends in its dialect's shape (a final chunk,
/// `[DONE]`, `message_stop`), and what has not ended [`CUT_FLUSH`] later is dropped.
pub async fn serve(
    listeners: Vec<Listener>,
    tls: Option<TlsAcceptor>,
    app: Router,
    read_timeout: Duration,
    shutdown: impl Future<Output = ()>,
    cut: impl FnOnce() + Send + 'static,
) {
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (conn, peer) = tokio::select! {
            accepted = accept_any(&listeners) => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of file descriptors and the like: pause instead of spinning.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = &mut shutdown => break,
        };
        let service = TowerToHyperService::new(app.clone());
        let watcher = graceful.watcher();
        let tls = tls.clone();
        match conn {
            Accepted::Tcp(tcp) => {
                let _ = tcp.set_nodelay(true);
                tokio::spawn(serve_connection(tcp, peer, tls, service, watcher, read_timeout));
            }
            #[cfg(unix)]
            Accepted::Unix(unix) => {
                tokio::spawn(serve_connection(unix, peer, tls, service, watcher, read_timeout));
            }
        }
    }
    drop(listeners);
    tracing::info!("shutting down: waiting up to {}s for {} connection(s)", SHUTDOWN_GRACE.as_secs(), graceful.count());
    let mut finished = std::pin::pin!(graceful.shutdown());
    tokio::select! {
        _ = &mut finished => return,
        _ = tokio::time::sleep(SHUTDOWN_GRACE) => tracing::warn!(
            "in-flight requests did not finish within {}s; cutting them short",
            SHUTDOWN_GRACE.as_secs()
        ),
        _ = shutdown_signal() => tracing::warn!("a second signal: cutting in-flight requests short"),
    }
    let _ = tokio::task::spawn_blocking(cut).await;
    if tokio::time::timeout(CUT_FLUSH, finished).await.is_err() {
        tracing::warn!("connections still open {}s after the cut; dropping them", CUT_FLUSH.as_secs());
    }
}

/// Serves one connection (after its TLS handshake, with TLS) until it closes or the shutdown ends it.
async fn serve_connection<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    stream: S,
    peer: String,
    tls: Option<TlsAcceptor>,
    service: TowerToHyperService<Router>,
    watcher: hyper_util::server::graceful::Watcher,
    read_timeout: Duration,
) {
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder.timer(TokioTimer::new()).header_read_timeout(read_timeout);
    let result = match tls {
        Some(acceptor) => {
            let stream = match tokio::time::timeout(Duration::from_secs(10), acceptor.accept(stream)).await {
                Ok(Ok(s)) => s,
                Ok(Err(e)) => return tracing::debug!("TLS handshake with {peer} failed: {e}"),
                Err(_) => return tracing::debug!("TLS handshake with {peer} timed out"),
            };
            watcher.watch(builder.serve_connection(TokioIo::new(stream), service)).await
        }
        None => watcher.watch(builder.serve_connection(TokioIo::new(stream), service)).await,
    };
    if let Err(e) = result {
        tracing::debug!("connection from {peer}: {e}");
    }
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
