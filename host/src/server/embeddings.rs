//! Embedding and reranking routes, and what the server does with an encoder model.
//!
//! - `POST /v1/embeddings` (OpenAI: `input` as a string, strings, token ids or lists of them;
//!   `encoding_format` `float` or `base64`; `dimensions` shortens the vectors to their first N values,
//!   normalised again when the model normalises, as OpenAI's Matryoshka models do), and
//!   llama-server's `POST /embedding` and `/embeddings` (`content` or `input`; each result's
//!   `embedding` is a list holding the pooled vector, as llama-server writes it for pooled models).
//! - `POST /rerank` and `/v1/rerank` (Jina / Cohere: `query`, `documents`, `top_n`,
//!   `return_documents`; results with `index` and `relevance_score`, best first).
//!
//! A server started on an embedding or reranking model runs it on an [`Encoder`] and serves these
//! routes without flags; the text-generation routes answer it with a 400 in their dialect
//! ([`task_gate`]), and these routes answer a text model (or the other encoder task) the same way.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use anyhow::Result;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{json, Value};

use super::args::ServerConfig;
use super::error::{parse_body, ApiError, Dialect};
use super::generator::{EngineStats, EventStream, Generator, ModelFacts, SlotStats};
use super::openai::PromptField;
use super::state::{within, AppState, LoadedModel, RequestLog};
use crate::engine::embed::{check_dimensions, normalize_by, relevance_score, shorten, EncoderInfo};
use crate::engine::{
    EncodedInput, Encoder, EncoderOptions, EncoderTokenizer, EngineError, GenerationRequest, ModelRunner, Usage,
};
use crate::text::TextTokenizer;
use mlxcel_plugin_api::Task;

/// An encoder model as the routes use it: the thread that runs it and its tokenizer.
pub struct EncoderModel {
    pub encoder: Encoder,
    pub tokenizer: Arc<EncoderTokenizer>,
}

impl EncoderModel {
    pub fn info(&self) -> &EncoderInfo {
        &self.encoder.info
    }
}

/// Starts an [`Encoder`] on an embedding or reranking model [`super::model::load`] loaded.
pub fn start_encoder(
    config: &ServerConfig,
    runner: ModelRunner,
    text: TextTokenizer,
    mut facts: ModelFacts,
) -> Result<LoadedModel> {
    let tokenizer = EncoderTokenizer::load(
        &runner.checkpoint.dir,
        &runner.checkpoint.config,
        runner.info.max_positions.min(runner.ctx_size),
        runner.info.vocab_size,
    )?;
    // The context `/props` and `/slots` report is the longest input the model takes (all-MiniLM-L6-v2
    // truncates to 256 of its 512 positions), not the positions.
    facts.ctx_size = tokenizer.max_tokens;
    if let Some(asked) = config.ctx_size.filter(|&c| c > tokenizer.max_tokens && c <= runner.info.max_positions) {
        // (Over the positions, the runner's own warning has said so.)
        tracing::warn!(
            "-c {asked} is over the longest input this model takes ({} tokens, as its sentence-transformers or \
             tokenizer files cut texts); using {}",
            tokenizer.max_tokens,
            tokenizer.max_tokens
        );
    }
    let max_batch_tokens = config.batch_size.max(tokenizer.max_tokens);
    let options = EncoderOptions { max_batch_tokens, max_queue: config.queue_limit.max(1) };
    let encoder = Encoder::start(runner, tokenizer.max_tokens, options)?;
    if let Some(p) = config.embd_normalize {
        // Refused at start, not by every request that leaves it to the server.
        normalization(Some(p), &encoder.info).map_err(|e| anyhow::anyhow!("--embd-normalize {p}: {}", e.message))?;
    }
    let generator = Arc::new(NoGeneration { id: facts.id.clone(), encoder: encoder.clone() });
    let encoder = EncoderModel { encoder, tokenizer: Arc::new(tokenizer) };
    Ok(LoadedModel { generator, text: Arc::new(text), facts, encoder: Some(encoder) })
}

/// The [`Generator`] of an encoder model: it generates nothing (the routes refuse before reaching
/// it), and reports the encoder's queue for `/slots`, `/metrics` and `/props`.
struct NoGeneration {
    id: String,
    encoder: Encoder,
}

impl Generator for NoGeneration {
    fn submit(&self, _req: GenerationRequest) -> Result<EventStream, EngineError> {
        Err(EngineError::Invalid(cannot_generate(&self.id, self.encoder.info.task)))
    }

    fn stats(&self) -> EngineStats {
        let c = &self.encoder.counters;
        let running = c.running.load(Ordering::Relaxed);
        EngineStats {
            requests_processing: running,
            requests_deferred: c.queued.load(Ordering::Relaxed),
            n_decode_total: c.passes.load(Ordering::Relaxed),
            n_busy_slots_total: c.inputs.load(Ordering::Relaxed),
            requests_cancelled: c.cancelled.load(Ordering::Relaxed),
            slots: vec![SlotStats { id: 0, is_processing: running > 0, ..Default::default() }],
            ..Default::default()
        }
    }
}

fn cannot_generate(id: &str, task: Task) -> String {
    match task {
        Task::Rerank => {
            format!("model `{id}` is a reranker (cross-encoder) and cannot generate text; use POST /v1/rerank")
        }
        _ => format!("model `{id}` is an embedding model and cannot generate text; use POST /v1/embeddings"),
    }
}

/// The text-generation routes (and their token counts).
const GENERATION_PATHS: &[&str] = &[
    "/v1/chat/completions",
    "/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/chat/completions/input_tokens",
    "/chat/completions/input_tokens",
    "/v1/responses",
    "/v1/responses/input_tokens",
    "/responses/input_tokens",
    "/responses",
    "/completion",
    "/completions",
    "/infill",
];

/// Answers the text-generation routes with a 400 in their dialect when the model is an encoder.
pub async fn task_gate(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    if GENERATION_PATHS.contains(&path) {
        if let Some(model) = state.model.get() {
            if let Some(enc) = &model.encoder {
                return ApiError::invalid(cannot_generate(&model.facts.id, enc.info().task))
                    .with_code("model_not_supported")
                    .in_dialect(Dialect::of_path(path))
                    .into_response();
            }
        }
    }
    next.run(req).await
}

/// The loaded encoder for `task`, or a 400 saying what the model is.
fn encoder_for(model: &LoadedModel, task: Task) -> Result<&EncoderModel, ApiError> {
    let id = &model.facts.id;
    match &model.encoder {
        Some(e) if e.info().task == task => Ok(e),
        Some(_) if task == Task::Embed => Err(ApiError::invalid(format!(
            "model `{id}` is a reranker (cross-encoder): it scores query-document pairs (POST /v1/rerank) but \
             makes no embeddings"
        ))),
        Some(_) => Err(ApiError::invalid(format!(
            "model `{id}` is an embedding model; reranking needs a cross-encoder model (e.g. \
             cross-encoder/ms-marco-MiniLM-L6-v2)"
        ))),
        None if task == Task::Embed => Err(ApiError::invalid(format!(
            "model `{id}` is a text-generation model; embeddings need an embedding model (e.g. \
             sentence-transformers/all-MiniLM-L6-v2), or this one served with --embedding"
        ))),
        None => Err(ApiError::invalid(format!(
            "model `{id}` is a text-generation model; reranking needs a cross-encoder model (e.g. \
             cross-encoder/ms-marco-MiniLM-L6-v2)"
        ))),
    }
    .map_err(|e| e.with_code("model_not_supported"))
}

/// The inputs of a request as model sequences; `field` names the request field in errors.
fn encode_inputs(tok: &EncoderTokenizer, input: PromptField, field: &str) -> Result<Vec<EncodedInput>, ApiError> {
    let at = |i: usize, e: EngineError| ApiError::field(field, format!("`{field}[{i}]`: {e}"));
    let empty = match &input {
        PromptField::Tokens(v) => v.is_empty(),
        PromptField::Texts(v) => v.is_empty(),
        PromptField::TokenLists(v) => v.is_empty(),
        PromptField::Text(_) => false,
    };
    if empty {
        return Err(ApiError::field(field, format!("`{field}` is an empty list; send at least one input")));
    }
    let out = match input {
        PromptField::Text(s) => vec![tok.encode(&s).map_err(|e| ApiError::field(field, format!("`{field}`: {e}")))?],
        PromptField::Tokens(ids) => {
            vec![tok.from_ids(ids).map_err(|e| ApiError::field(field, format!("`{field}`: {e}")))?]
        }
        PromptField::Texts(v) => {
            v.iter().enumerate().map(|(i, s)| tok.encode(s).map_err(|e| at(i, e))).collect::<Result<_, _>>()?
        }
        PromptField::TokenLists(v) => v
            .into_iter()
            .enumerate()
            .map(|(i, ids)| tok.from_ids(ids).map_err(|e| at(i, e)))
            .collect::<Result<_, _>>()?,
    };
    Ok(out)
}

fn tokens(inputs: &[EncodedInput]) -> usize {
    inputs.iter().map(|i| i.ids.len()).sum()
}

/// Counts the request for `/metrics` and its log line.
fn record(state: &AppState, log: &RequestLog, prompt_tokens: usize, started: std::time::Instant) {
    let usage = Usage { prompt_tokens, prompt_time: started.elapsed(), ..Default::default() };
    state.metrics.record(&usage);
    log.usage(&usage, "stop");
}

#[derive(Deserialize, Debug)]
pub struct EmbeddingsRequest {
    pub input: PromptField,
    pub model: Option<String>,
    pub encoding_format: Option<String>,
    pub dimensions: Option<u64>,
    /// OpenAI's end-user id (for abuse monitoring upstream); it changes no result.
    pub user: Option<String>,
    /// llama-server's normalisation (see [`normalize_by`]); without it, the model's own.
    pub embd_normalize: Option<i64>,
}

/// `POST /v1/embeddings`.
pub async fn openai_embeddings(
    State(state): State<Arc<AppState>>,
    Extension(log): Extension<RequestLog>,
    body: Bytes,
) -> Response {
    openai_inner(state, log, &body).await.unwrap_or_else(|e| e.in_dialect(Dialect::OpenAi).into_response())
}

async fn openai_inner(state: Arc<AppState>, log: RequestLog, body: &[u8]) -> Result<Response, ApiError> {
    let started = std::time::Instant::now();
    let model = state.ready()?;
    let r: EmbeddingsRequest = parse_body(body)?;
    let enc = encoder_for(model, Task::Embed)?;
    let base64 = match r.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::field(
                "encoding_format",
                format!("`encoding_format` must be `float` or `base64`, not `{other}`"),
            ))
        }
    };
    let dims = r
        .dimensions
        .map(|d| {
            check_dimensions(d, enc.info().output_dim)
                .map_err(|m| ApiError::field("dimensions", format!("`dimensions` {m}")))
        })
        .transpose()?;
    let norm = normalization(r.embd_normalize.or(state.config.embd_normalize), enc.info())?;
    let inputs = encode_inputs(&enc.tokenizer, r.input, "input")?;
    let n_tokens = tokens(&inputs);
    let mut vectors = within(state.config.timeout, enc.encoder.run(inputs)).await?;
    if let Some(dims) = dims {
        vectors.iter_mut().for_each(|v| shorten(v, dims, enc.info().normalized));
    }
    if let Some(p) = norm {
        vectors.iter_mut().for_each(|v| normalize_by(v, p));
    }
    record(&state, &log, n_tokens, started);
    let data: Vec<Value> = vectors
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let embedding = if base64 { json!(base64_f32(v)) } else { json!(v) };
            json!({"object": "embedding", "index": i, "embedding": embedding})
        })
        .collect();
    Ok(Json(json!({
        "object": "list",
        "data": data,
        // The request's name echoed back, as on the chat routes (any name is the served model).
        "model": r.model.as_deref().filter(|m| !m.is_empty()).unwrap_or(&model.facts.id),
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
    }))
    .into_response())
}

/// The vector as little-endian f32 bytes in standard base64 (what OpenAI's `base64` format holds).
fn base64_f32(v: &[f32]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (b[0] as u32) << 16 | (b[1] as u32) << 8 | b[2] as u32;
        for k in 0..4 {
            if k <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * k) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[derive(Deserialize, Debug)]
pub struct LlamaEmbeddingRequest {
    pub content: Option<PromptField>,
    pub input: Option<PromptField>,
    pub embd_normalize: Option<i64>,
}

/// A request's `embd_normalize`, checked against what the model gives: its `-1` (none) cannot undo
/// the normalisation a model's sentence-transformers pipeline does.
fn normalization(p: Option<i64>, info: &EncoderInfo) -> Result<Option<i64>, ApiError> {
    match p {
        Some(p) if p < -1 => Err(ApiError::field(
            "embd_normalize",
            format!("embd_normalize must be -1 (none), 0 (int16 range), 1 (taxicab), 2 (Euclidean) or a larger p-norm, got {p}"),
        )),
        Some(-1) if info.normalized => Err(ApiError::field(
            "embd_normalize",
            "embd_normalize -1 (none) is not available: this model's pipeline normalises its vectors (a sentence-transformers Normalize module, or --embedding's normalised pooling)",
        )),
        p => Ok(p),
    }
}

/// llama-server's `POST /embedding` and `/embeddings`: `[{"index": i, "embedding": [[...]]}]`.
pub async fn llama_embeddings(
    State(state): State<Arc<AppState>>,
    Extension(log): Extension<RequestLog>,
    body: Bytes,
) -> Response {
    llama_inner(state, log, &body).await.unwrap_or_else(|e| e.in_dialect(Dialect::Llama).into_response())
}

async fn llama_inner(state: Arc<AppState>, log: RequestLog, body: &[u8]) -> Result<Response, ApiError> {
    let started = std::time::Instant::now();
    let model = state.ready()?;
    let r: LlamaEmbeddingRequest = parse_body(body)?;
    let enc = encoder_for(model, Task::Embed)?;
    let (input, field) = match (r.content, r.input) {
        (Some(c), None) => (c, "content"),
        (None, Some(i)) => (i, "input"),
        (Some(_), Some(_)) => return Err(ApiError::invalid("send `content` or `input`, not both")),
        (None, None) => return Err(ApiError::field("content", "`content` is required")),
    };
    let norm = normalization(r.embd_normalize.or(state.config.embd_normalize), enc.info())?;
    let inputs = encode_inputs(&enc.tokenizer, input, field)?;
    let n_tokens = tokens(&inputs);
    let mut vectors = within(state.config.timeout, enc.encoder.run(inputs)).await?;
    if let Some(p) = norm {
        vectors.iter_mut().for_each(|v| normalize_by(v, p));
    }
    record(&state, &log, n_tokens, started);
    let out: Vec<Value> = vectors.into_iter().enumerate().map(|(i, v)| json!({"index": i, "embedding": [v]})).collect();
    Ok(Json(Value::Array(out)).into_response())
}

/// A document to rerank: a string, or `{"text": ...}` (Jina's object form; other fields, such as
/// Cohere's `title`, are refused rather than left out of what is scored).
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Document {
    Text(String),
    Object(DocumentObject),
}

#[derive(Deserialize, Debug)]
#[serde(deny_unknown_fields)]
pub struct DocumentObject {
    text: String,
}

impl Document {
    fn text(&self) -> &str {
        match self {
            Document::Text(t) | Document::Object(DocumentObject { text: t }) => t,
        }
    }
}

#[derive(Deserialize, Debug)]
pub struct RerankRequest {
    pub model: Option<String>,
    pub query: String,
    pub documents: Option<Vec<Document>>,
    /// Hugging Face TEI's name for the documents, which llama-server takes too: the answer is then
    /// TEI's, a bare list of `{index, score}` (and `text` with `return_text`).
    pub texts: Option<Vec<Document>>,
    pub return_text: Option<bool>,
    pub top_n: Option<usize>,
    pub return_documents: Option<bool>,
}

/// `POST /rerank` and `/v1/rerank`.
pub async fn rerank(
    State(state): State<Arc<AppState>>,
    Extension(log): Extension<RequestLog>,
    uri: axum::http::Uri,
    body: Bytes,
) -> Response {
    let dialect = Dialect::of_path(uri.path());
    rerank_inner(state, log, &body).await.unwrap_or_else(|e| e.in_dialect(dialect).into_response())
}

async fn rerank_inner(state: Arc<AppState>, log: RequestLog, body: &[u8]) -> Result<Response, ApiError> {
    let started = std::time::Instant::now();
    let model = state.ready()?;
    let r: RerankRequest = parse_body(body)?;
    let enc = encoder_for(model, Task::Rerank)?;
    if r.query.is_empty() {
        return Err(ApiError::field("query", "`query` is an empty string"));
    }
    let (documents, field, tei) = match (&r.documents, &r.texts) {
        (Some(d), None) => (d, "documents", false),
        (None, Some(t)) => (t, "texts", true),
        (Some(_), Some(_)) => return Err(ApiError::field("texts", "send `documents` or TEI's `texts`, not both")),
        (None, None) => {
            return Err(ApiError {
                code: Some("missing_required_parameter"),
                ..ApiError::field("documents", "missing required parameter `documents`")
            })
        }
    };
    // Each shape's own switch for the documents in the answer.
    let (given, wrong, goes_with, own) = match tei {
        true => (r.return_documents.is_some(), "return_documents", "documents", "return_text"),
        false => (r.return_text.is_some(), "return_text", "texts", "return_documents"),
    };
    if given {
        return Err(ApiError::field(wrong, format!("`{wrong}` goes with `{goes_with}`; with `{field}` send `{own}`")));
    }
    if documents.is_empty() {
        return Err(ApiError::field(field, format!("`{field}` is an empty list; send at least one document")));
    }
    if r.top_n == Some(0) {
        return Err(ApiError::field("top_n", "`top_n` must be at least 1"));
    }
    let inputs: Vec<EncodedInput> = documents
        .iter()
        .enumerate()
        .map(|(i, d)| {
            enc.tokenizer
                .encode_pair(&r.query, d.text())
                .map_err(|e| ApiError::field(&format!("{field}[{i}]"), format!("`{field}[{i}]`: {e}")))
        })
        .collect::<Result<_, _>>()?;
    let n_tokens = tokens(&inputs);
    let logits = within(state.config.timeout, enc.encoder.run(inputs)).await?;
    record(&state, &log, n_tokens, started);
    let mut order: Vec<(usize, f32)> = logits.iter().map(|row| relevance_score(row[0])).enumerate().collect();
    // Best first; equal scores keep the documents' order.
    order.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    order.truncate(r.top_n.unwrap_or(order.len()));
    if tei {
        let with_text = r.return_text.unwrap_or(false);
        let results: Vec<Value> = order
            .iter()
            .map(|&(i, score)| match with_text {
                true => json!({"index": i, "score": score, "text": documents[i].text()}),
                false => json!({"index": i, "score": score}),
            })
            .collect();
        return Ok(Json(Value::Array(results)).into_response());
    }
    let with_docs = r.return_documents.unwrap_or(false);
    let results: Vec<Value> = order
        .iter()
        .map(|&(i, score)| {
            let mut v = json!({"index": i, "relevance_score": score});
            if with_docs {
                v["document"] = json!({"text": documents[i].text()});
            }
            v
        })
        .collect();
    Ok(Json(json!({
        "object": "list",
        // The request's name echoed back, as on the chat routes (any name is the served model).
        "model": r.model.as_deref().filter(|m| !m.is_empty()).unwrap_or(&model.facts.id),
        "results": results,
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens},
    }))
    .into_response())
}

#[cfg(test)]
mod tests {
    use super::base64_f32;

    #[test]
    fn base64_holds_little_endian_f32_with_padding() {
        // 1.0f32 = 00 00 80 3f
        assert_eq!(base64_f32(&[1.0]), "AACAPw==");
        assert_eq!(base64_f32(&[1.0, -2.0]), "AACAPwAAAMA=");
        assert_eq!(base64_f32(&[]), "");
    }
}
