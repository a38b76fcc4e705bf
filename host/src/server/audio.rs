//! OpenAI's audio routes, `POST /v1/audio/transcriptions` and `/v1/audio/translations`, served when the
//! model is a speech-recognition (Whisper) one: a multipart upload (`file`, `model`, `language`,
//! `prompt`, `response_format`, `temperature`, `best_of`, `timestamp_granularities[]`) decoded to
//! 16 kHz samples, queued to one thread that owns the [`Transcriber`], answered in the requested format.
//!
//! Upload problems (no file, an empty or undecodable one, a field this server does not know or a value
//! it cannot honour) are 400s naming the field; a full queue is a 503; one past `--timeout` is a 504.
//! A client that goes away, or the timeout, cancels its transcription: a queued one is dropped, a
//! running one stops before its next model step and frees its sequences. `/metrics` (with
//! `--metrics`) counts transcriptions, windows and steps.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;

use anyhow::Result;
use axum::extract::{DefaultBodyLimit, Multipart, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use mlxcel_plugins::Catalog;
use tower_http::limit::RequestBodyLimitLayer;

use super::args::ServerConfig;
use super::error::{ApiError, Dialect, ErrorKind};
use super::state::{within, AppState};
use crate::checkpoint::Checkpoint;
use crate::speech::transcribe::{Cancelled, DEFAULT_BEST_OF, MAX_BEST_OF};
use crate::speech::{load_transcriber, render, ResponseFormat, SpeechTask, TranscribeOptions, Transcript};

/// Transcriptions waiting beyond the one running before new ones get 503.
const QUEUE: usize = 8;

struct Job {
    samples: Vec<f32>,
    opts: TranscribeOptions,
    reply: tokio::sync::oneshot::Sender<Result<Transcript, ApiError>>,
}

/// The loaded speech model: its id and the queue of its transcription thread.
pub struct SpeechService {
    pub id: String,
    pub path: String,
    /// The decoder's context (prompt and generated tokens of one window).
    n_ctx: usize,
    /// The routes this model answers: translations only where it is multilingual.
    routes: &'static [&'static str],
    jobs: SyncSender<Job>,
    stats: Arc<SpeechStats>,
}

/// What the transcription thread did, for `/metrics`.
#[derive(Default)]
struct SpeechStats {
    answered: AtomicU64,
    failed: AtomicU64,
    cancelled: AtomicU64,
    windows: AtomicU64,
    steps: AtomicU64,
    processing: AtomicU64,
}

impl SpeechService {
    /// `GET /props` of a speech server: llama-server's shape where it applies (one slot, no chat
    /// template, audio in), so that clients probing the server at start-up get an answer.
    pub fn props(&self, config: &ServerConfig) -> serde_json::Value {
        serde_json::json!({
            "default_generation_settings": {"n_ctx": self.n_ctx, "params": {"n_ctx": self.n_ctx}},
            "total_slots": 1,
            "model_alias": self.id,
            "model_path": self.path,
            "chat_template": "",
            "modalities": {"vision": false, "audio": true},
            "build_info": format!("mlxcel {}", env!("CARGO_PKG_VERSION")),
            "mlxcel": {
                "task": "speech-recognition",
                "routes": self.routes,
                "timeout_s": config.timeout.map(|t| t.as_secs()),
            },
        })
    }

    /// The decoder's context (prompt and generated tokens of one window).
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// `GET /slots` of a speech server: its one transcription thread.
    pub fn slots(&self) -> serde_json::Value {
        let busy = self.stats.processing.load(Ordering::Relaxed) > 0;
        serde_json::json!([{"id": 0, "id_task": -1, "n_ctx": self.n_ctx, "is_processing": busy}])
    }

    /// `/metrics` rows of a speech server: `(name, type, help, value)`.
    pub fn metrics_rows(&self, uptime_seconds: f64) -> Vec<(&'static str, &'static str, &'static str, f64)> {
        let s = &self.stats;
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed) as f64;
        vec![
            ("mlxcel_requests_total", "counter", "Transcriptions that finished with an answer.", get(&s.answered)),
            ("mlxcel_requests_failed_total", "counter", "Transcriptions that failed.", get(&s.failed)),
            (
                "mlxcel_requests_cancelled_total",
                "counter",
                "Transcriptions stopped because their client went away or --timeout passed.",
                get(&s.cancelled),
            ),
            ("llamacpp:requests_processing", "gauge", "Number of requests processing.", get(&s.processing)),
            (
                "mlxcel_transcription_windows_total",
                "counter",
                "30 s audio windows transcribed (each a whole decoding).",
                get(&s.windows),
            ),
            (
                "mlxcel_transcription_steps_total",
                "counter",
                "Model steps run for transcriptions (encoder with prompt, and decoding).",
                get(&s.steps),
            ),
            ("mlxcel_uptime_seconds", "gauge", "Seconds since the server started.", uptime_seconds),
        ]
    }
}

/// Starts the transcription thread on the speech model of `checkpoint` (see [`super::model::start`]).
pub fn start(config: &ServerConfig, catalog: &Catalog, checkpoint: Checkpoint) -> Result<SpeechService> {
    let dir = checkpoint.dir.clone();
    // Sequence rows for the default best_of's candidates to decode together; more run in groups.
    let mut transcriber =
        load_transcriber(catalog, checkpoint, config.backend.clone(), config.threads, DEFAULT_BEST_OF)?;
    let n_ctx = transcriber.text_context();
    let routes: &'static [&'static str] = if transcriber.vocab.multilingual {
        &["/v1/audio/transcriptions", "/v1/audio/translations"]
    } else {
        &["/v1/audio/transcriptions"]
    };
    let (tx, rx) = sync_channel::<Job>(QUEUE);
    let stats = Arc::new(SpeechStats::default());
    let st = stats.clone();
    std::thread::Builder::new().name("mlxcel-speech".into()).spawn(move || {
        let count = |c: &AtomicU64| c.fetch_add(1, Ordering::Relaxed);
        for job in rx {
            if job.reply.is_closed() {
                count(&st.cancelled);
                tracing::info!("dropped a queued transcription: its client went away or --timeout passed");
                continue;
            }
            if let Err(e) = transcriber.check_options(&job.opts) {
                count(&st.failed);
                // Timestamps are asked for by the response format.
                let field = if e.field == "timestamps" { "response_format" } else { e.field };
                let _ = job.reply.send(Err(ApiError::field(field, e.message)));
                continue;
            }
            st.processing.store(1, Ordering::Relaxed);
            // Asked before every model step: a closed reply channel means the client left.
            let stop = || {
                let gone = job.reply.is_closed();
                if !gone {
                    count(&st.steps);
                }
                gone
            };
            let result = transcriber.transcribe(
                &job.samples,
                &job.opts,
                &mut |_, _| {
                    count(&st.windows);
                },
                &stop,
            );
            st.processing.store(0, Ordering::Relaxed);
            let result = match result {
                Err(e) if e.is::<Cancelled>() => {
                    count(&st.cancelled);
                    tracing::info!("stopped a transcription: its client went away or --timeout passed");
                    continue;
                }
                Err(e) => {
                    count(&st.failed);
                    Err(ApiError::internal(format!("transcription failed: {e:#}")))
                }
                Ok(t) => {
                    count(&st.answered);
                    Ok(t)
                }
            };
            let _ = job.reply.send(result);
        }
    })?;
    tracing::info!("loaded speech model {} for {}", dir.display(), routes.join(" and "));
    Ok(SpeechService {
        id: config.alias.clone().unwrap_or_else(|| config.model.clone()),
        path: dir.display().to_string(),
        n_ctx,
        routes,
        jobs: tx,
        stats,
    })
}

/// Bytes a form may hold beside its file: its other fields, part headers and boundaries.
const FORM_FIELDS_BYTES: usize = 64 << 10;

/// The audio routes with their own body limit: `--max-audio-bytes` is the file's (as OpenAI's 25 MB
/// is), so the form around it may be [`FORM_FIELDS_BYTES`] larger; the file itself is checked as it
/// is read.
pub fn routes(limit: usize) -> Router<Arc<AppState>> {
    Router::new()
        .route("/v1/audio/transcriptions", post(transcriptions))
        .route("/v1/audio/translations", post(translations))
        .layer(DefaultBodyLimit::disable())
        .layer(RequestBodyLimitLayer::new(limit.saturating_add(FORM_FIELDS_BYTES)))
}

async fn transcriptions(State(state): State<Arc<AppState>>, form: Multipart) -> Response {
    handle(state, form, SpeechTask::Transcribe).await.unwrap_or_else(|e| e.in_dialect(Dialect::OpenAi).into_response())
}

async fn translations(State(state): State<Arc<AppState>>, form: Multipart) -> Response {
    handle(state, form, SpeechTask::Translate).await.unwrap_or_else(|e| e.in_dialect(Dialect::OpenAi).into_response())
}

/// The multipart fields of one request.
struct Upload {
    file: Option<(String, Vec<u8>)>,
    language: Option<String>,
    prompt: Option<String>,
    format: ResponseFormat,
    temperature: f32,
    best_of: usize,
}

/// Reads the whole form. A field refused is answered only once the rest of the form is read (and
/// dropped), so that the connection stays usable: clients send the file after the other fields, and
/// answering in the middle of its upload left them a reset connection instead of the 400.
async fn read_upload(mut form: Multipart, task: SpeechTask, max_file_bytes: usize) -> Result<Upload, ApiError> {
    let mut up = Upload {
        file: None,
        language: None,
        prompt: None,
        format: ResponseFormat::Json,
        temperature: 0.0,
        best_of: DEFAULT_BEST_OF,
    };
    let bad_form = |e: axum::extract::multipart::MultipartError| {
        let status = e.status();
        let kind = if status.as_u16() == 413 { ErrorKind::TooLarge } else { ErrorKind::InvalidRequest };
        ApiError::new(kind, format!("the multipart form could not be read: {}", e.body_text()))
    };
    let mut seen: Vec<String> = Vec::new();
    let mut refused: Option<ApiError> = None;
    while let Some(field) = form.next_field().await.map_err(bad_form)? {
        let name = field.name().unwrap_or_default().to_string();
        if refused.is_some() {
            field.bytes().await.map_err(bad_form)?;
            continue;
        }
        // One value per field (a second file or format would be silently dropped); granularities
        // are a list.
        if seen.contains(&name) && name != "timestamp_granularities[]" {
            refused = Some(ApiError::field(&name, format!("`{name}` is given more than once")));
            field.bytes().await.map_err(bad_form)?;
            continue;
        }
        seen.push(name.clone());
        if name == "file" {
            let filename = field.file_name().unwrap_or("the uploaded file").to_string();
            let bytes = field.bytes().await.map_err(bad_form)?;
            if bytes.len() > max_file_bytes {
                let message =
                    format!("the file is {} bytes, over the {max_file_bytes} of --max-audio-bytes", bytes.len());
                refused = Some(ApiError { param: Some("file".into()), ..ApiError::new(ErrorKind::TooLarge, message) });
                continue;
            }
            up.file = Some((filename, bytes.to_vec()));
            continue;
        }
        // (Read as bytes: axum's text() would replace bytes that are not UTF-8 without a word.)
        let bytes = field.bytes().await.map_err(bad_form)?;
        let Ok(value) = String::from_utf8(bytes.to_vec()) else {
            refused = Some(ApiError::field(&name, format!("`{name}` is not UTF-8 text")));
            continue;
        };
        if let Err(e) = take_field(&mut up, task, &name, &value) {
            refused = Some(e);
        }
    }
    match refused {
        Some(e) => Err(e),
        None => Ok(up),
    }
}

/// One text field of the form into `up`, or the 400 that names it.
fn take_field(up: &mut Upload, task: SpeechTask, name: &str, value: &str) -> Result<(), ApiError> {
    match name {
        // Any id is accepted: the server serves one model, as the chat routes do.
        "model" => {}
        "language" if task == SpeechTask::Transcribe => {
            up.language = Some(value.trim().to_lowercase()).filter(|l| !l.is_empty())
        }
        "language" => {
            return Err(ApiError::field("language", "translations take no `language`: the output is English"))
        }
        "prompt" => up.prompt = Some(value.to_string()),
        "response_format" => {
            up.format =
                ResponseFormat::parse(value.trim()).map_err(|e| ApiError::field("response_format", e.to_string()))?
        }
        "temperature" => {
            up.temperature = value.trim().parse::<f32>().ok().filter(|t| (0.0..=1.0).contains(t)).ok_or_else(|| {
                ApiError::field("temperature", format!("temperature `{value}` is not a number in 0..1"))
            })?
        }
        "best_of" => {
            up.best_of =
                value.trim().parse::<usize>().ok().filter(|n| (1..=MAX_BEST_OF).contains(n)).ok_or_else(|| {
                    ApiError::field("best_of", format!("best_of `{value}` is not a whole number in 1..{MAX_BEST_OF}"))
                })?
        }
        // Segments are what every format's timestamps are (as OpenAI's API, any format takes it);
        // word timestamps are not produced.
        "timestamp_granularities[]" | "timestamp_granularities" if value.trim() == "segment" => {}
        "timestamp_granularities[]" | "timestamp_granularities" => {
            return Err(ApiError::field(
                "timestamp_granularities",
                format!("timestamp granularity `{value}` is not supported (segment)"),
            ))
        }
        "stream" => match value.trim() {
            "false" | "" => {}
            "true" => return Err(ApiError::field("stream", "streaming transcriptions are not supported")),
            v => return Err(ApiError::field("stream", format!("`stream` must be true or false, got `{v}`"))),
        },
        other => return Err(ApiError::unknown_field(other)),
    }
    Ok(())
}

async fn handle(state: Arc<AppState>, form: Multipart, task: SpeechTask) -> Result<Response, ApiError> {
    let Some(service) = state.speech.get() else {
        return Err(match state.model.get() {
            Some(m) => ApiError::invalid(format!(
                "the served model `{}` is not a speech-recognition model; start the server on a Whisper model",
                m.facts.id
            )),
            None => ApiError { retry_after: Some(5), ..ApiError::new(ErrorKind::Unavailable, "Loading model") },
        });
    };
    let up = read_upload(form, task, state.config.max_audio_bytes).await?;
    // Before the upload is decoded (the transcription thread checks it again, as it does every
    // option).
    if task == SpeechTask::Translate && !service.routes.contains(&"/v1/audio/translations") {
        return Err(ApiError::field(
            "model",
            "this is an English-only Whisper model: it cannot translate (use a multilingual model)",
        ));
    }
    let (name, bytes) = up.file.ok_or_else(|| ApiError::field("file", "the form has no `file` field"))?;
    if bytes.is_empty() {
        return Err(ApiError::field("file", format!("`{name}` is empty")));
    }
    let samples =
        tokio::task::spawn_blocking(move || mlxcel_audio::decode_audio_bytes(&bytes, &name).map_err(|e| (name, e)))
            .await
            .map_err(|e| ApiError::internal(format!("decoding task failed: {e}")))?
            .map_err(|(name, e)| ApiError::field("file", format!("`{name}` could not be read as audio: {e}")))?;
    if samples.is_empty() {
        return Err(ApiError::field("file", "the audio has no samples"));
    }
    let opts = TranscribeOptions {
        language: up.language,
        task,
        timestamps: up.format.needs_timestamps(),
        temperature: up.temperature,
        best_of: up.best_of,
        prompt: up.prompt,
        seed: 0,
    };
    let (reply, answer) = tokio::sync::oneshot::channel();
    match service.jobs.try_send(Job { samples, opts, reply }) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) => {
            return Err(ApiError {
                retry_after: Some(5),
                ..ApiError::new(ErrorKind::Unavailable, "too many transcriptions are waiting; try again shortly")
            })
        }
        Err(TrySendError::Disconnected(_)) => return Err(ApiError::internal("the transcription thread has stopped")),
    }
    // `--timeout` holds here as on every route (a long recording on slow hardware needs it raised,
    // or 0); dropping the answer's receiver stops the transcription at its next window.
    let answer = async { answer.await.map_err(|_| ApiError::internal("the transcription thread has stopped"))? };
    let transcript = within(state.config.timeout, answer).await?;
    let task_name = if task == SpeechTask::Translate { "translate" } else { "transcribe" };
    let body = render(&transcript, up.format, task_name);
    Ok(([(header::CONTENT_TYPE, up.format.content_type())], body).into_response())
}

/// What the chat, completion and token routes answer on a speech model.
pub fn not_a_text_model(service: &SpeechService) -> ApiError {
    ApiError::invalid(format!(
        "the served model `{}` is a speech-recognition model: it answers POST {}, not this route",
        service.id,
        service.routes.join(" and POST ")
    ))
}
