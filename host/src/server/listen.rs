//! Accepting connections: plain HTTP/1.1 or HTTPS (rustls), each connection served by hyper, and a
//! graceful shutdown: stop accepting, let in-flight requests finish for a grace period, then end
//! them as cut short.

use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
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
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    app: Router,
    read_timeout: Duration,
    shutdown: impl Future<Output = ()>,
    cut: impl FnOnce() + Send + 'static,
) {
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
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
        let _ = tcp.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let watcher = graceful.watcher();
        let tls = tls.clone();
        tokio::spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.timer(TokioTimer::new()).header_read_timeout(read_timeout);
            let result = match tls {
                Some(acceptor) => {
                    let stream = match tokio::time::timeout(Duration::from_secs(10), acceptor.accept(tcp)).await {
                        Ok(Ok(s)) => s,
                        Ok(Err(e)) => return tracing::debug!("TLS handshake with {peer} failed: {e}"),
                        Err(_) => return tracing::debug!("TLS handshake with {peer} timed out"),
                    };
                    let conn = builder.serve_connection(TokioIo::new(stream), service);
                    watcher.watch(conn).await
                }
                None => {
                    let conn = builder.serve_connection(TokioIo::new(tcp), service);
                    watcher.watch(conn).await
                }
            };
            if let Err(e) = result {
                tracing::debug!("connection from {peer}: {e}");
            }
        });
    }
    drop(listener);
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
