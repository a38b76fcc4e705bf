//! What every route shares: the configuration, the model once it is loaded (engine, tokenizer, facts),
//! the server's own counters for `/metrics`, and the per-request record behind the log line.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::args::ServerConfig;
use super::error::{ApiError, ErrorKind};
use super::generator::{Generator, ModelFacts};
use crate::engine::Usage;
use crate::text::TextTokenizer;

/// A loaded model: the engine that runs it and the text side the routes need (tokenizer, template).
pub struct LoadedModel {
    pub generator: Arc<dyn Generator>,
    pub text: Arc<TextTokenizer>,
    pub facts: ModelFacts,
    /// Set for an embedding or reranking model (its `generator` then refuses to generate).
    pub encoder: Option<super::embeddings::EncoderModel>,
}

pub struct AppState {
    pub config: ServerConfig,
    /// Set once loading finishes; until then generation routes and `/health` answer 503 (529 on
    /// Anthropic's routes).
    pub model: OnceLock<LoadedModel>,
    /// Set instead of `model` when the served model is a speech-recognition one (`/v1/audio/*`).
    pub speech: OnceLock<super::audio::SpeechService>,
    pub metrics: Metrics,
    pub started: Instant,
    /// Start time in seconds since the Unix epoch (`created` of /v1/models).
    pub started_unix: u64,
}

impl AppState {
    pub fn new(config: ServerConfig) -> Arc<AppState> {
        Arc::new(AppState {
            config,
            model: OnceLock::new(),
            speech: OnceLock::new(),
            metrics: Metrics::default(),
            started: Instant::now(),
            started_unix: super::completion::unix_time(),
        })
    }

    /// A request's chat-template variables: the server's `--chat-template-kwargs`, then the request's
    /// own by name.
    pub fn template_kwargs(
        &self,
        request: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> Option<serde_json::Map<String, serde_json::Value>> {
        self.template_kwargs_with(&serde_json::Map::new(), request)
    }

    /// [`template_kwargs`](Self::template_kwargs) with the variables a request's reasoning effort
    /// sets between the server's and the request's own (which win).
    pub fn template_kwargs_with(
        &self,
        effort: &serde_json::Map<String, serde_json::Value>,
        request: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> Option<serde_json::Map<String, serde_json::Value>> {
        let mut kwargs = self.config.chat_template_kwargs.clone();
        kwargs.extend(effort.iter().map(|(k, v)| (k.clone(), v.clone())));
        kwargs.extend(request.into_iter().flatten().map(|(k, v)| (k.clone(), v.clone())));
        (!kwargs.is_empty()).then_some(kwargs)
    }

    /// The model, or 503 (Anthropic's 529) while it is loading.
    pub fn ready(&self) -> Result<&LoadedModel, ApiError> {
        if let Some(speech) = self.speech.get() {
            return Err(super::audio::not_a_text_model(speech));
        }
        self.model
            .get()
            .ok_or_else(|| ApiError { retry_after: Some(5), ..ApiError::new(ErrorKind::Unavailable, "Loading model") })
    }
}

/// Counters since start, kept by the HTTP layer from each finished request's usage.
#[derive(Default)]
pub struct Metrics {
    pub requests_total: AtomicU64,
    pub requests_failed: AtomicU64,
    pub prompt_tokens_total: AtomicU64,
    pub cached_tokens_total: AtomicU64,
    pub tokens_predicted_total: AtomicU64,
    prompt_micros_total: AtomicU64,
    predicted_micros_total: AtomicU64,
    queue_micros_total: AtomicU64,
    /// The longest sequence a request made (prompt and answer), llama-server's `n_tokens_max`.
    pub n_tokens_max: AtomicU64,
}

impl Metrics {
    pub fn record(&self, u: &Usage) {
        let r = Ordering::Relaxed;
        self.requests_total.fetch_add(1, r);
        self.prompt_tokens_total.fetch_add(u.prompt_tokens.saturating_sub(u.cached_tokens) as u64, r);
        self.cached_tokens_total.fetch_add(u.cached_tokens as u64, r);
        self.tokens_predicted_total.fetch_add(u.completion_tokens as u64, r);
        self.prompt_micros_total.fetch_add(u.prompt_time.as_micros() as u64, r);
        self.predicted_micros_total.fetch_add(u.generation_time.as_micros() as u64, r);
        self.queue_micros_total.fetch_add(u.queue_time.as_micros() as u64, r);
        self.n_tokens_max.fetch_max((u.prompt_tokens + u.completion_tokens) as u64, r);
    }
    pub fn failed(&self) {
        self.requests_failed.fetch_add(1, Ordering::Relaxed);
    }
    pub fn prompt_seconds(&self) -> f64 {
        self.prompt_micros_total.load(Ordering::Relaxed) as f64 / 1e6
    }
    pub fn predicted_seconds(&self) -> f64 {
        self.predicted_micros_total.load(Ordering::Relaxed) as f64 / 1e6
    }
    pub fn queue_seconds(&self) -> f64 {
        self.queue_micros_total.load(Ordering::Relaxed) as f64 / 1e6
    }
}

/// What a route learned about its request, for the one log line written when the last holder
/// lets go: the route, the response body (a stream's ends when its last event is sent or the client
/// goes away) and any task still relaying the request's events, which records what was done first.
#[derive(Clone, Default)]
pub struct RequestLog(Arc<LogCell>);

#[derive(Default)]
pub struct LogCell(Mutex<LogFields>);

impl Drop for LogCell {
    fn drop(&mut self) {
        let f = self.0.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(head) = f.head.take() {
            head.write(f);
        }
    }
}

/// The request a log line is about (set by the logging layer; without it nothing is written).
#[derive(Clone)]
pub struct LineHead {
    pub start: Instant,
    pub method: axum::http::Method,
    pub path: String,
    pub status: axum::http::StatusCode,
}

impl LineHead {
    fn write(&self, f: &LogFields) {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let (method, route, status) = (self.method.as_str(), self.path.as_str(), self.status.as_u16());
        let total_ms = ms(self.start.elapsed());
        if route == "/health" || route == "/metrics" {
            tracing::debug!(method, route, status, total_ms, "request");
            return;
        }
        tracing::info!(
            method,
            route,
            status,
            prompt_tokens = f.prompt_tokens,
            cached_tokens = f.cached_tokens,
            completion_tokens = f.completion_tokens,
            prompt_ms = ms(f.prompt_time),
            generation_ms = ms(f.generation_time),
            total_ms,
            finish = f.finish.unwrap_or("-"),
            stream = f.stream,
            "request"
        );
    }
}

#[derive(Default)]
pub struct LogFields {
    pub head: Option<LineHead>,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub prompt_time: Duration,
    pub generation_time: Duration,
    pub finish: Option<&'static str>,
    pub stream: bool,
}

impl RequestLog {
    pub fn update(&self, f: impl FnOnce(&mut LogFields)) {
        if let Ok(mut g) = self.0 .0.lock() {
            f(&mut g);
        }
    }
    /// Adds one completion's usage (a request with several completions logs their sums, and the
    /// longest times).
    pub fn usage(&self, u: &Usage, finish: &'static str) {
        self.update(|l| {
            l.prompt_tokens += u.prompt_tokens;
            l.cached_tokens += u.cached_tokens;
            l.completion_tokens += u.completion_tokens;
            l.prompt_time = l.prompt_time.max(u.prompt_time);
            l.generation_time = l.generation_time.max(u.generation_time);
            l.finish = Some(finish);
        });
    }
}

/// `work` cut off after `timeout` (the server's `--timeout`) with a 504 naming it; dropping `work`
/// stops it (the encoder thread looks before each pass).
pub async fn within<T, E: Into<ApiError>>(
    timeout: Option<Duration>,
    work: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, ApiError> {
    match timeout {
        None => work.await.map_err(Into::into),
        Some(t) => match tokio::time::timeout(t, work).await {
            Ok(done) => done.map_err(Into::into),
            Err(_) => Err(crate::engine::EngineError::TimedOut(t).into()),
        },
    }
}
