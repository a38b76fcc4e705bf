//! `mlxcel-server` / `mlxcel serve`: the HTTP layer. It knows HTTP and the API dialects (OpenAI,
//! Anthropic, llama-server), each in its own module translating to and from one internal request
//! ([`crate::engine::GenerationRequest`]); it reaches the model only through a [`Generator`].
//!
//! Layers around the routes, outermost first: CORS, tracing spans, the per-request log line (which also
//! reshapes plain-text errors from the layers below into the dialect's JSON), API-key check, body limit.

pub mod anthropic;
pub mod args;
pub mod audio;
pub mod batch_engine;
pub mod completion;
pub mod cors;
pub mod embeddings;
pub mod error;
pub mod fields;
pub mod generator;
pub mod infill;
pub mod listen;
pub mod llama;
pub mod model;
pub mod openai;
pub mod reasoning;
pub mod responses;
pub mod samplers;
pub mod state;
pub mod structured;
#[cfg(test)]
mod tests;
pub mod tools;

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::StreamExt;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::timeout::RequestBodyTimeoutLayer;
use tower_http::trace::{DefaultOnFailure, TraceLayer};

pub use args::{ServerArgs, ServerConfig};
use error::{ApiError, Dialect, ErrorKind};
pub use generator::{EngineStats, EventStream, Generator, ModelFacts, SlotStats};
use state::LineHead;
pub use state::{AppState, LoadedModel, RequestLog};

/// Routes answered without an API key: llama-server's (health alone since the model list, public in
/// older versions, came to need the key), so that a probe can check liveness without one.
const PUBLIC_PATHS: &[&str] = &["/health", "/v1/health"];

/// Runs `work`, which may take milliseconds of CPU, telling the runtime (where it has other workers)
/// that it blocks, so that the worker's other connections move on meanwhile.
pub(crate) fn blocking<T>(work: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(RuntimeFlavor::MultiThread) => tokio::task::block_in_place(work),
        _ => work(),
    }
}

/// Every route, with the layers around them.
pub fn router(state: Arc<AppState>) -> Router {
    let limit = state.config.max_body_bytes;
    Router::new()
        .route("/v1/chat/completions", post(openai::chat))
        .route("/chat/completions", post(openai::chat))
        .route("/v1/chat/completions/input_tokens", post(openai::chat_input_tokens))
        .route("/chat/completions/input_tokens", post(openai::chat_input_tokens))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/responses", post(responses::responses))
        .route("/responses", post(responses::responses))
        .route("/v1/responses/input_tokens", post(responses::input_tokens))
        .route("/responses/input_tokens", post(responses::input_tokens))
        .route("/v1/models", get(openai::models))
        .route("/models", get(openai::models))
        // `{*id}`: names given as hub ids or paths hold slashes.
        .route("/v1/models/{*id}", get(openai::model))
        .route("/models/{*id}", get(openai::model))
        .route("/v1/messages", post(anthropic::messages))
        .route("/v1/messages/count_tokens", post(anthropic::count_tokens))
        .route("/completion", post(llama::completion))
        .route("/completions", post(llama::completion))
        .route("/infill", post(llama::infill))
        .route("/tokenize", post(llama::tokenize))
        .route("/detokenize", post(llama::detokenize))
        .route("/apply-template", post(llama::apply_template))
        .route("/health", get(llama::health))
        .route("/v1/health", get(llama::health))
        .route("/props", get(llama::props).post(llama::set_props))
        .route("/slots", get(llama::slots))
        .route("/slots/{id}", post(llama::slot_action))
        .route("/lora-adapters", get(llama::lora_adapters).post(llama::set_lora_adapters))
        .route("/metrics", get(llama::metrics))
        .route("/v1/embeddings", post(embeddings::openai_embeddings))
        .route("/embedding", post(embeddings::llama_embeddings))
        .route("/embeddings", post(embeddings::llama_embeddings))
        .route("/rerank", post(embeddings::rerank))
        .route("/v1/rerank", post(embeddings::rerank))
        .route("/reranking", post(embeddings::rerank))
        .route("/v1/reranking", post(embeddings::rerank))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(state.clone(), embeddings::task_gate))
        .layer(DefaultBodyLimit::disable())
        .layer(RequestBodyLimitLayer::new(limit))
        .merge(audio::routes(state.config.max_audio_bytes))
        // A body that stops coming fails its request instead of holding the connection.
        .layer(RequestBodyTimeoutLayer::new(listen::read_timeout(state.config.timeout)))
        .layer(middleware::from_fn_with_state(state.clone(), require_api_key))
        .layer(middleware::from_fn(log_request))
        // Each request's own line says its status (a 500's cause is logged where it happens), and
        // `/health` answers 503 while loading: tower-http's failure events stay at debug.
        .layer(TraceLayer::new_for_http().on_failure(DefaultOnFailure::new().level(tracing::Level::DEBUG)))
        .layer(state.config.cors.layer())
        .with_state(state)
}

async fn not_found(req: Request) -> Response {
    let path = req.uri().path().to_string();
    ApiError::new(ErrorKind::NotFound, format!("no route {} {path}", req.method()))
        .in_dialect(Dialect::of_path(&path))
        .into_response()
}

/// `Authorization: Bearer KEY` or `x-api-key: KEY`, when the server has keys.
async fn require_api_key(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let keys = &state.config.api_keys;
    let path = req.uri().path();
    if keys.is_empty() || PUBLIC_PATHS.contains(&path) || req.method() == Method::OPTIONS {
        return next.run(req).await;
    }
    let h = req.headers();
    // The key alone is taken too, as llama-server takes it.
    let bearer = h
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")).unwrap_or(v))
        .map(str::trim);
    let x_key = h.get("x-api-key").and_then(|v| v.to_str().ok()).map(str::trim);
    let given: Vec<&str> = bearer.into_iter().chain(x_key).collect();
    if given.iter().any(|g| keys.iter().any(|k| same_key(k.as_bytes(), g.as_bytes()))) {
        return next.run(req).await;
    }
    let message = if given.is_empty() {
        "Missing API key: send it as `Authorization: Bearer KEY` or `x-api-key: KEY`"
    } else {
        "Invalid API Key"
    };
    ApiError::new(ErrorKind::Authentication, message)
        .with_code("invalid_api_key")
        .in_dialect(Dialect::of_request(path, h))
        .into_response()
}

/// Compares without an early exit, so the time taken says nothing about how much of a key matched.
fn same_key(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Writes one log line per request (for a stream: when it ends) and turns the plain-text errors of
/// the layers below (body limit, method not allowed) into the dialect's JSON error.
async fn log_request(mut req: Request, next: Next) -> Response {
    let start = Instant::now();
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let log = RequestLog::default();
    // Until the answer is known, the line says 499 (nginx's "client closed request"): a client that
    // leaves before it drops the handler, and the line is written then.
    let closed = StatusCode::from_u16(499).expect("499 is a valid status");
    log.update(|f| f.head = Some(LineHead { start, method, path: path.clone(), status: closed }));
    req.extensions_mut().insert(log.clone());
    let mut resp = next.run(req).await;
    let status = resp.status();
    if (status.is_client_error() || status.is_server_error()) && !is_json(&resp) {
        // (A plain-text error is a line or two: what the layer said, to tell a stalled body by.)
        let said = axum::body::to_bytes(resp.into_body(), 4096).await.unwrap_or_default();
        resp = reshape_error(status, &path, &String::from_utf8_lossy(&said));
    }
    let status = resp.status();
    log.update(|f| f.head.as_mut().expect("set above").status = status);
    let is_stream =
        resp.headers().get(header::CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    if !is_stream {
        return resp;
    }
    // A stream's line waits for its body to end (or the client to go away).
    let (parts, body) = resp.into_parts();
    let body = Body::from_stream(body.into_data_stream().map(move |chunk| {
        let _ = &log;
        chunk
    }));
    Response::from_parts(parts, body)
}

fn is_json(r: &Response) -> bool {
    r.headers().get(header::CONTENT_TYPE).is_some_and(|v| v.as_bytes().starts_with(b"application/json"))
}

/// What tower-http's body timeout says, inside axum's refusal of the body.
const BODY_TIMED_OUT: &str = "data was not received within the designated timeout";

fn reshape_error(status: StatusCode, path: &str, said: &str) -> Response {
    if status == StatusCode::BAD_REQUEST && said.contains(BODY_TIMED_OUT) {
        let message = "the request body stopped arriving before it was complete (the server waits for the next part of a body as long as --timeout, at most 30 s)";
        let mut r =
            ApiError::new(ErrorKind::InvalidRequest, message).in_dialect(Dialect::of_path(path)).into_response();
        *r.status_mut() = StatusCode::REQUEST_TIMEOUT;
        return r;
    }
    let (kind, message) = match status {
        StatusCode::PAYLOAD_TOO_LARGE => {
            // The audio routes have their own limit.
            let flag = if path.starts_with("/v1/audio/") { "--max-audio-bytes" } else { "--max-body-bytes" };
            (ErrorKind::TooLarge, format!("the request body is larger than the server accepts ({flag})"))
        }
        StatusCode::METHOD_NOT_ALLOWED => (ErrorKind::MethodNotAllowed, format!("{path} does not accept this method")),
        StatusCode::NOT_FOUND => (ErrorKind::NotFound, format!("no route {path}")),
        // (The audio routes' multipart extractor refuses any other body.)
        StatusCode::UNSUPPORTED_MEDIA_TYPE | StatusCode::BAD_REQUEST if path.starts_with("/v1/audio/") => (
            ErrorKind::InvalidRequest,
            "the request must be a multipart/form-data upload with the audio in its `file` field".to_string(),
        ),
        StatusCode::UNSUPPORTED_MEDIA_TYPE | StatusCode::BAD_REQUEST | StatusCode::UNPROCESSABLE_ENTITY => {
            (ErrorKind::InvalidRequest, "the request could not be read".to_string())
        }
        _ => (ErrorKind::Internal, format!("request failed with status {status}")),
    };
    let e = ApiError::new(kind, message).in_dialect(Dialect::of_path(path));
    let mut r = e.into_response();
    *r.status_mut() = status;
    r
}

/// Runs the server until Ctrl-C or SIGTERM: listens at once (so `/health` answers 503 while the model
/// loads), loads the model on the engine thread, then serves.
pub fn run(config: ServerConfig) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("mlxcel-http")
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let result = runtime.block_on(serve(config));
    // Connections still open after the grace period are dropped here (cancelling their requests); a
    // model still loading on a blocking thread is not waited for.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    result
}

async fn serve(config: ServerConfig) -> Result<()> {
    let tls = match &config.tls {
        Some((cert, key)) => Some(listen::tls_acceptor(cert, key)?),
        None => None,
    };
    let listeners = listen::Listener::bind_all(&config.host, config.port).await?;
    let scheme = if tls.is_some() { "https" } else { "http" };
    let urls: Vec<String> = listeners.iter().map(|l| l.url(scheme)).collect();
    eprintln!("mlxcel-server: listening on {} (loading {})", urls.join(", "), config.model);

    let state = AppState::new(config);
    let (failed_tx, failed_rx) = tokio::sync::oneshot::channel::<String>();
    let loader = state.clone();
    // What serves the model depends on its task (see `model::start`).
    tokio::task::spawn_blocking(move || match model::start(&loader) {
        Ok(ready) => eprintln!("mlxcel-server: {ready}"),
        Err(e) => {
            let _ = failed_tx.send(crate::logging::one_line(&e));
        }
    });

    let app = router(state.clone());
    let read_timeout = listen::read_timeout(state.config.timeout);
    let failure = Arc::new(std::sync::Mutex::new(None::<String>));
    let failed = failure.clone();
    let stopping = state.clone();
    let stop = async move {
        // A model that fails to load stops the server; a loader that succeeded drops its sender.
        let load_failed = async {
            match failed_rx.await {
                Ok(e) => *failed.lock().unwrap() = Some(e),
                Err(_) => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = listen::shutdown_signal() => {
                eprintln!("mlxcel-server: shutting down");
                // Requests still waiting for a slot get their 503 now; the running ones may finish.
                if let Some(model) = stopping.model.get() {
                    model.generator.refuse_waiting();
                }
            }
            _ = load_failed => {},
        }
    };
    let cut = move || {
        if let Some(model) = state.model.get() {
            model.generator.cut_all();
        }
    };
    listen::serve(listeners, tls, app, read_timeout, stop, cut).await;
    let failure = failure.lock().unwrap().take();
    match failure {
        Some(e) => Err(anyhow::anyhow!(e)),
        None => Ok(()),
    }
}
