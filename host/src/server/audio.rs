//! OpenAI's audio routes, `POST /v1/audio/transcriptions` and `/v1/audio/translations`, served when the
//! model is a speech-recognition (Whisper) one: a multipart upload (`file`, `model`, `language`,
//! `prompt`, `response_format`, `temperature`, `timestamp_granularities[]`) decoded to 16 kHz samples,
//! queued to one thread that owns the [`Transcriber`], answered in the requested format.
//!
//! Upload problems (no file, an empty or undecodable one, a field this server does not know or a value
//! it cannot honour) are 400s naming the field; a full queue is a 503.

use std::path::Path;
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;

use anyhow::Result;
use axum::extract::{DefaultBodyLimit, Multipart, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::Router;
use mlxcel_plugins::{Catalog, PluginSearch};
use tower_http::limit::RequestBodyLimitLayer;

use super::args::ServerConfig;
use super::error::{ApiError, Dialect, ErrorKind};
use super::state::AppState;
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
    jobs: SyncSender<Job>,
}

/// Starts the transcription thread on the speech model in `dir` (see [`super::model::start`]).
pub fn start(config: &ServerConfig, dir: &Path) -> Result<SpeechService> {
    let catalog = Catalog::load(&PluginSearch::from_env(&config.plugin_dirs));
    let mut transcriber = load_transcriber(&catalog, dir, config.backend.clone(), config.threads)?;
    let (tx, rx) = sync_channel::<Job>(QUEUE);
    std::thread::Builder::new().name("mlxcel-speech".into()).spawn(move || {
        for job in rx {
            if job.reply.is_closed() {
                continue; // the client went away while the job waited
            }
            let result = transcriber.check_options(&job.opts).map_err(|e| ApiError::invalid(format!("{e:#}")));
            let result = result.and_then(|()| {
                transcriber
                    .transcribe(&job.samples, &job.opts, &mut |_, _| {})
                    .map_err(|e| ApiError::internal(format!("transcription failed: {e:#}")))
            });
            let _ = job.reply.send(result);
        }
    })?;
    tracing::info!("loaded speech model {} for /v1/audio/transcriptions and /v1/audio/translations", dir.display());
    Ok(SpeechService {
        id: config.alias.clone().unwrap_or_else(|| config.model.clone()),
        path: dir.display().to_string(),
        jobs: tx,
    })
}

/// The audio routes with their own body limit (`--max-audio-bytes`; uploads are larger than chat JSON).
pub fn routes(limit: usize) -> Router<Arc<AppState>> {
    Router::new()
        .route("/v1/audio/transcriptions", post(transcriptions))
        .route("/v1/audio/translations", post(translations))
        .layer(DefaultBodyLimit::disable())
        .layer(RequestBodyLimitLayer::new(limit))
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
}

async fn read_upload(mut form: Multipart, task: SpeechTask) -> Result<Upload, ApiError> {
    let mut up = Upload { file: None, language: None, prompt: None, format: ResponseFormat::Json, temperature: 0.0 };
    let bad_form = |e: axum::extract::multipart::MultipartError| {
        let status = e.status();
        let kind = if status.as_u16() == 413 { ErrorKind::TooLarge } else { ErrorKind::InvalidRequest };
        ApiError::new(kind, format!("the multipart form could not be read: {}", e.body_text()))
    };
    while let Some(field) = form.next_field().await.map_err(bad_form)? {
        let name = field.name().unwrap_or_default().to_string();
        if name == "file" {
            let filename = field.file_name().unwrap_or("audio").to_string();
            let bytes = field.bytes().await.map_err(bad_form)?;
            up.file = Some((filename, bytes.to_vec()));
            continue;
        }
        let value = field.text().await.map_err(bad_form)?;
        match name.as_str() {
            // Any id is accepted: the server serves one model, as the chat routes do.
            "model" => {}
            "language" if task == SpeechTask::Transcribe => {
                up.language = Some(value.trim().to_lowercase()).filter(|l| !l.is_empty())
            }
            "language" => {
                return Err(ApiError::field("language", "translations take no `language`: the output is English"))
            }
            "prompt" => up.prompt = Some(value),
            "response_format" => {
                up.format = ResponseFormat::parse(value.trim())
                    .map_err(|e| ApiError::field("response_format", e.to_string()))?
            }
            "temperature" => {
                up.temperature =
                    value.trim().parse::<f32>().ok().filter(|t| (0.0..=1.0).contains(t)).ok_or_else(|| {
                        ApiError::field("temperature", format!("temperature `{value}` is not a number in 0..1"))
                    })?
            }
            "timestamp_granularities[]" | "timestamp_granularities" => {
                if value.trim() != "segment" {
                    return Err(ApiError::field(
                        "timestamp_granularities",
                        format!("timestamp granularity `{value}` is not supported (segment)"),
                    ));
                }
            }
            "stream" if matches!(value.trim(), "false" | "") => {}
            "stream" => return Err(ApiError::field("stream", "streaming transcriptions are not supported")),
            other => return Err(ApiError::field(other, format!("unknown field `{other}`"))),
        }
    }
    Ok(up)
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
    let up = read_upload(form, task).await?;
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
    let transcript = answer.await.map_err(|_| ApiError::internal("the transcription thread has stopped"))??;
    let task_name = if task == SpeechTask::Translate { "translate" } else { "transcribe" };
    let body = render(&transcript, up.format, task_name);
    Ok(([(header::CONTENT_TYPE, up.format.content_type())], body).into_response())
}

/// What the chat, completion and token routes answer on a speech model.
pub fn not_a_text_model(service: &SpeechService) -> ApiError {
    ApiError::invalid(format!(
        "the served model `{}` is a speech-recognition model: it answers POST /v1/audio/transcriptions and \
         /v1/audio/translations, not this route",
        service.id
    ))
}
