//! The llama-server (llama.cpp) native dialect: `/completion`, `/infill`, `/tokenize`, `/detokenize`,
//! `/apply-template`, `/health`, `/props`, `/slots` and `/metrics`, with llama-server's field names.

use std::fmt::Write;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Query, State};
use axum::http::{header, StatusCode};
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;
use serde_json::{json, Value};

use super::completion::{
    data, logit_bias, run_all, stream_many, submit_all, timings, Asked, Ending, Job, Live, StreamDialect, StreamExtras,
};
use super::error::{parse_body, parse_body_with, ApiError, Dialect, ErrorKind};
use super::infill::{self, ExtraChunk, Fim, InfillInput};
use super::openai::StopField;
use super::samplers::LlamaSamplers;
use super::state::{AppState, LoadedModel, RequestLog};
use super::structured;
use crate::engine::{CodeLimits, SamplingParams, TokenLogprob, Usage};

/// `prompt`, as llama-server reads it: a string, token ids, or ids and strings mixed (each string
/// tokenized in its place) — or several prompts: a list without ids at its top level (strings, or
/// lists of ids or mixed pieces), each answered on its own.
#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    /// With an id among them, one prompt; strings only, one prompt each.
    Mixed(Vec<Piece>),
    Many(Vec<Prompt>),
}

#[derive(Deserialize, Debug)]
#[serde(untagged)]
pub enum Piece {
    Token(u32),
    Text(String),
}

#[derive(Deserialize, Debug)]
pub struct CompletionRequest {
    /// Required on `/completion`; on `/infill`, text after the prefix (optional).
    pub prompt: Option<Prompt>,
    /// `/infill`: the code before and after the cursor, and other files for context.
    pub input_prefix: Option<String>,
    pub input_suffix: Option<String>,
    pub input_extra: Option<Vec<ExtraChunk>>,
    pub n_predict: Option<i64>,
    /// llama-server's other name for `n_predict` (OpenAI's).
    pub max_tokens: Option<i64>,
    pub stream: Option<bool>,
    pub cache_prompt: Option<bool>,
    pub temperature: Option<f32>,
    pub top_k: Option<i64>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub repeat_last_n: Option<i64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<StopField>,
    pub ignore_eos: Option<bool>,
    pub n_probs: Option<usize>,
    pub add_special: Option<bool>,
    pub return_tokens: Option<bool>,
    pub logit_bias: Option<Value>,
    /// Only these fields in the answer (`a/b` takes `b` out of `a`, keyed `"a/b"` as llama-server keys it).
    pub response_fields: Option<Vec<String>>,
    /// `timings` in every stream chunk, and prompt-progress chunks.
    pub timings_per_token: Option<bool>,
    pub return_progress: Option<bool>,
    /// Code completion's limits: a later line indented less than this ends the answer; past this
    /// many ms the answer ends at the next line break (see [`CodeLimits`]).
    pub n_indent: Option<f64>,
    pub t_max_predict_ms: Option<f64>,
    /// Answers per prompt (llama-server's `n_cmpl`, `n` its other name), each its own sequence.
    pub n_cmpl: Option<i64>,
    pub n: Option<i64>,
    /// The JSON schema the answer must follow (structured outputs).
    pub json_schema: Option<Value>,
}

impl CompletionRequest {
    /// The token limit, by either of its names (-1: none).
    fn n_predict(&self) -> Option<i64> {
        self.n_predict.or(self.max_tokens)
    }
}

/// The most candidates `n_probs` may ask for per token (each answer carries them all).
const MAX_N_PROBS: usize = 100;

fn sampling(r: &CompletionRequest, defaults: &SamplingParams, ctx: usize) -> Result<SamplingParams, ApiError> {
    let mut p = defaults.clone();
    // llama-server: a temperature below 0 is greedy, a top-k of 0 or less is off.
    p.temperature = r.temperature.map_or(p.temperature, |t| t.max(0.0));
    p.top_k = r.top_k.map_or(p.top_k, |k| usize::try_from(k).unwrap_or(0));
    p.top_p = r.top_p.unwrap_or(p.top_p);
    p.min_p = r.min_p.unwrap_or(p.min_p);
    p.repeat_penalty = r.repeat_penalty.unwrap_or(p.repeat_penalty);
    p.penalty_last_n = super::samplers::penalty_last_n(r.repeat_last_n, p.penalty_last_n, ctx)?;
    p.presence_penalty = r.presence_penalty.unwrap_or(p.presence_penalty);
    p.frequency_penalty = r.frequency_penalty.unwrap_or(p.frequency_penalty);
    // llama-server: -1 (or 0xFFFFFFFF) means a random seed.
    p.seed = match r.seed {
        Some(s) if s >= 0 && s != u32::MAX as i64 => Some(s as u64),
        Some(_) => None,
        None => p.seed,
    };
    Ok(p)
}

/// A prompt's text and token ids.
type PromptIds = (String, Vec<u32>);

/// The prompts of a request.
fn prompt_list(model: &LoadedModel, p: &Prompt, add_special: bool) -> Result<Vec<PromptIds>, ApiError> {
    match p {
        Prompt::Mixed(pieces) if pieces.iter().all(|p| matches!(p, Piece::Text(_))) => pieces
            .iter()
            .map(|p| match p {
                Piece::Text(s) => prompt_ids(model, &Prompt::Text(s.clone()), add_special),
                Piece::Token(_) => unreachable!("strings only"),
            })
            .collect(),
        Prompt::Many(list) => list
            .iter()
            .map(|p| match p {
                Prompt::Many(_) => {
                    Err(ApiError::field("prompt", "a prompt in a list of prompts cannot itself be several prompts"))
                }
                p => prompt_ids(model, p, add_special),
            })
            .collect(),
        p => Ok(vec![prompt_ids(model, p, add_special)?]),
    }
}

/// One prompt's text and token ids.
fn prompt_ids(model: &LoadedModel, p: &Prompt, add_special: bool) -> Result<PromptIds, ApiError> {
    match p {
        Prompt::Text(s) => {
            Ok((s.clone(), model.text.encode(s, add_special).map_err(|e| ApiError::internal(e.to_string()))?))
        }
        Prompt::Tokens(ids) => {
            let vocab = model.facts.vocab_size as u32;
            if let Some(t) = ids.iter().find(|&&t| t >= vocab) {
                return Err(ApiError::field(
                    "prompt",
                    format!("token id {t} is outside the vocabulary (size {vocab})"),
                ));
            }
            Ok((model.text.decode(ids).unwrap_or_default(), ids.clone()))
        }
        Prompt::Mixed(pieces) => {
            let encode = |s: &str, add: bool| model.text.encode(s, add).map_err(|e| ApiError::internal(e.to_string()));
            prompt_ids(model, &Prompt::Tokens(mixed_ids(pieces, add_special, encode)?), add_special)
        }
        Prompt::Many(_) => Err(ApiError::field("prompt", "expected one prompt")),
    }
}

/// Ids and texts mixed, as llama-server's `tokenize_mixed` reads them: ids kept as they are, texts
/// through `encode`, with specials (BOS) only before a leading text.
fn mixed_ids(
    pieces: &[Piece],
    add_special: bool,
    encode: impl Fn(&str, bool) -> Result<Vec<u32>, ApiError>,
) -> Result<Vec<u32>, ApiError> {
    let mut ids = Vec::new();
    for (i, p) in pieces.iter().enumerate() {
        match p {
            Piece::Token(t) => ids.push(*t),
            Piece::Text(s) => ids.extend(encode(s, add_special && i == 0)?),
        }
    }
    Ok(ids)
}

fn stop_type(e: &Ending) -> (&'static str, String) {
    match e {
        Ending::Eos => ("eos", String::new()),
        Ending::StopWord(s) => ("word", s.clone()),
        Ending::Length => ("limit", String::new()),
        Ending::Cancelled => ("none", String::new()),
    }
}

/// One token in llama-server's probability lists: its id, text, bytes and log-probability.
fn llama_token_entry(tok: &crate::text::TextTokenizer, id: u32, logprob: f32) -> Value {
    let bytes = tok.token_bytes(id);
    json!({"id": id, "token": utf8_head(&bytes), "bytes": bytes, "logprob": logprob})
}

/// `bytes` as text, less an unfinished UTF-8 character at its end (a token that holds the first
/// bytes of a character shows none of it; `bytes` has them).
fn utf8_head(bytes: &[u8]) -> String {
    // The last byte that starts a character, and whether the bytes after it finish it.
    let start = bytes.iter().rposition(|b| b & 0xC0 != 0x80).unwrap_or(0);
    let needs = match bytes.get(start) {
        Some(b) if b & 0xE0 == 0xC0 => 2,
        Some(b) if b & 0xF0 == 0xE0 => 3,
        Some(b) if b & 0xF8 == 0xF0 => 4,
        _ => 1,
    };
    let end = if bytes.len() - start < needs { start } else { bytes.len() };
    String::from_utf8_lossy(&bytes[..end]).into_owned()
}

/// `completion_probabilities`: per token, its probability list in llama-server's shape.
fn probabilities(tok: &crate::text::TextTokenizer, lps: &[TokenLogprob]) -> Value {
    lps.iter()
        .map(|l| {
            let top: Vec<Value> = l.top.iter().map(|&(id, lp)| llama_token_entry(tok, id, lp)).collect();
            let mut entry = llama_token_entry(tok, l.token, l.logprob);
            entry["top_logprobs"] = top.into();
            entry
        })
        .collect()
}

fn generation_settings(model: &LoadedModel, p: &SamplingParams, n_predict: i64) -> Value {
    // How many recent tokens a penalty reads, -1 for all of them (as llama-server writes it).
    let last_n = |n: usize| if n == usize::MAX { -1 } else { n as i64 };
    json!({
        "n_predict": n_predict,
        "max_tokens": n_predict,
        // The context never shifts here (generation stops at its end), so nothing is kept or dropped.
        "n_keep": 0,
        "n_discard": 0,
        "temperature": p.temperature,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "min_p": p.min_p,
        "repeat_penalty": p.repeat_penalty,
        "repeat_last_n": last_n(p.penalty_last_n),
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "dynatemp_range": p.dynatemp_range,
        "dynatemp_exponent": p.dynatemp_exponent,
        "typical_p": p.typical_p,
        "top_n_sigma": p.top_n_sigma,
        "xtc_probability": p.xtc_probability,
        "xtc_threshold": p.xtc_threshold,
        "min_keep": p.min_keep,
        "dry_multiplier": p.dry.multiplier,
        "dry_base": p.dry.base,
        "dry_allowed_length": p.dry.allowed_length,
        "dry_penalty_last_n": last_n(p.dry.last_n),
        "dry_sequence_breakers": p.dry.sequence_breakers,
        "mirostat": p.mirostat,
        "mirostat_tau": p.mirostat_tau,
        "mirostat_eta": p.mirostat_eta,
        "samplers": p.chain.iter().map(|s| s.name()).collect::<Vec<_>>(),
        // A random seed as llama-server reports it: its unsigned 32-bit "default" seed.
        "seed": p.seed.unwrap_or(u64::from(u32::MAX)),
        // Its shape too (a banned token's bias, minus infinity, is null there).
        "logit_bias": p.logit_bias.iter().map(|(t, b)| json!({"bias": if b.is_finite() { json!(b) } else { Value::Null }, "token": t})).collect::<Vec<_>>(),
        "n_ctx": model.facts.ctx_size,
        "model": model.facts.id,
    })
}

pub async fn completion(
    State(state): State<Arc<AppState>>,
    Extension(log): Extension<RequestLog>,
    body: Bytes,
) -> Response {
    completion_inner(state, log, &body, false).await.unwrap_or_else(|e| e.in_dialect(Dialect::Llama).into_response())
}

/// `/infill`: `/completion` with a fill-in-the-middle prompt made of `input_prefix`, `input_suffix`,
/// `input_extra` and `prompt` (see [`infill`](super::infill)).
pub async fn infill(
    State(state): State<Arc<AppState>>,
    Extension(log): Extension<RequestLog>,
    body: Bytes,
) -> Response {
    completion_inner(state, log, &body, true).await.unwrap_or_else(|e| e.in_dialect(Dialect::Llama).into_response())
}

/// The FIM prompt of an `/infill` request (text as llama-server shows it, with the FIM tokens), and
/// the tokens that end its answer.
fn infill_prompt(
    state: &AppState,
    model: &LoadedModel,
    r: &CompletionRequest,
) -> Result<(PromptIds, Vec<u32>), ApiError> {
    let fim = Fim::of(&model.text).map_err(|e| ApiError::new(ErrorKind::NotSupported, e))?;
    for (field, given) in [("input_prefix", r.input_prefix.is_some()), ("input_suffix", r.input_suffix.is_some())] {
        if !given {
            return Err(ApiError::field(field, format!("\"{field}\" is required")));
        }
    }
    if r.add_special.is_some() {
        return Err(ApiError::field(
            "add_special",
            "add_special does not apply to /infill (the FIM prompt adds what the model needs)",
        ));
    }
    let prompt = match &r.prompt {
        None => "",
        Some(Prompt::Text(s)) => s.as_str(),
        Some(_) => return Err(ApiError::field("prompt", "\"prompt\" must be a string")),
    };
    let input = InfillInput {
        prefix: r.input_prefix.as_deref().unwrap_or_default(),
        suffix: r.input_suffix.as_deref().unwrap_or_default(),
        extra: r.input_extra.as_deref().unwrap_or_default(),
        prompt,
    };
    let n_predict = r.n_predict().and_then(|n| usize::try_from(n).ok()).or(state.config.n_predict);
    let (batch, ctx) = (state.config.batch_size, model.facts.ctx_size);
    let ids = infill::prompt(&model.text, &fim, &input, batch, n_predict.unwrap_or(0), ctx)
        .map_err(|e| ApiError::internal(e.to_string()))?;
    let text = model.text.inner.decode(&ids, false).map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(((text, ids), fim.end_tokens()))
}

async fn completion_inner(
    state: Arc<AppState>,
    log: RequestLog,
    body: &[u8],
    infill: bool,
) -> Result<Response, ApiError> {
    let model = state.ready()?;
    let (r, llama_samplers): (CompletionRequest, LlamaSamplers) = parse_body_with(body)?;
    let (prompts, end_tokens) = if infill {
        let (prompt, ends) = infill_prompt(&state, model, &r)?;
        (vec![prompt], ends)
    } else {
        let fim_fields = [
            ("input_prefix", r.input_prefix.is_some()),
            ("input_suffix", r.input_suffix.is_some()),
            ("input_extra", r.input_extra.is_some()),
        ];
        if let Some((field, _)) = fim_fields.iter().find(|(_, given)| *given) {
            return Err(ApiError::field(
                field,
                format!("{field} belongs to /infill (fill-in-the-middle), not /completion"),
            ));
        }
        let prompt = r.prompt.as_ref().ok_or_else(|| ApiError {
            code: Some("missing_required_parameter"),
            ..ApiError::field("prompt", "missing required parameter `prompt`")
        })?;
        (prompt_list(model, prompt, r.add_special.unwrap_or(true))?, Vec::new())
    };
    let stream = r.stream.unwrap_or(false);
    let extras = StreamExtras::new(r.timings_per_token, r.return_progress, stream)?;
    let mut params = sampling(&r, &model.facts.default_sampling, model.facts.ctx_size)?;
    if let Some(b) = &r.logit_bias {
        params.logit_bias = logit_bias(b, model, false)?;
    }
    llama_samplers.apply(&mut params)?;
    // (Numbers of either kind, as llama-server converts them; 0 or less is off.)
    let code_limits = CodeLimits::new(
        r.n_indent.filter(|n| n.is_finite() && *n > 0.0).map_or(0, |n| n as usize),
        r.t_max_predict_ms.filter(|ms| *ms > 0.0).and_then(|ms| Duration::try_from_secs_f64(ms / 1e3).ok()),
    );
    if r.n_probs.is_some_and(|n| n > MAX_N_PROBS) {
        return Err(ApiError::field("n_probs", format!("n_probs must be at most {MAX_N_PROBS}")));
    }
    let n_cmpl = answers_per_prompt(&r, state.config.parallel)?;
    let constraint = structured::constraint(model, r.json_schema.clone().filter(|s| !s.is_null()), "json_schema")?;
    let n_predict = r.n_predict();
    let stops = r.stop.map(StopField::into_vec).unwrap_or_default();
    let response_fields = r.response_fields.clone().filter(|f| !f.is_empty());
    if response_fields.is_some() && stream {
        return Err(ApiError::field("response_fields", "response_fields applies to answers without stream: true"));
    }
    let with_probs = r.n_probs.is_some_and(|n| n > 0);
    let slot = llama_samplers.slot()?;
    let mut texts = Vec::with_capacity(prompts.len() * n_cmpl);
    let mut jobs = Vec::with_capacity(prompts.len() * n_cmpl);
    for (text, ids) in prompts {
        let mut job = Job::new(ids, params.clone());
        // Each prompt's first answer runs in the slot asked for (see `Job::with_seed_offset`).
        job.slot = slot;
        job.max_tokens = n_predict.and_then(|n| usize::try_from(n).ok());
        job.stop = stops.clone();
        job.cache_prompt = r.cache_prompt;
        job.ignore_eos = r.ignore_eos.unwrap_or(false);
        job.logprobs = r.n_probs.filter(|&n| n > 0);
        job.end_tokens = end_tokens.clone();
        job.code_limits = code_limits.clone();
        job.constraint = constraint.clone();
        // A prompt's answers follow one another (llama-server's indices), each with its own seed.
        for i in 0..n_cmpl {
            let answer = job.with_seed_offset(i);
            // The request's limit, else the server's `-n`.
            let limit = n_predict.or(state.config.n_predict.and_then(|n| i64::try_from(n).ok()));
            let settings = generation_settings(model, &answer.sampling, limit.unwrap_or(-1));
            texts.push((text.clone(), job.prompt.len(), settings));
            jobs.push(answer);
        }
    }

    // (n_cmpl alone is held to the slots: too many answers come from the list of prompts.)
    let asked = Asked { prompt: "prompt", count: "prompt" };
    if stream {
        let pending = submit_all(jobs, &state, model, asked)?;
        let streams = pending
            .into_iter()
            .zip(texts)
            .enumerate()
            .map(|(index, ((events, _), (prompt, prompt_n, settings)))| {
                let dialect = CompletionStream {
                    index,
                    model: model.facts.id.clone(),
                    settings,
                    prompt,
                    with_probs,
                    extras,
                    tok: model.text.clone(),
                    ctx_size: model.facts.ctx_size,
                    new_line: false,
                };
                (events, dialect, prompt_n)
            })
            .collect();
        return Ok(stream_many(streams, n_cmpl, stops, model.text.clone(), state.clone(), log));
    }
    let done = run_all(jobs, &state, model, asked, &log).await?;
    let several = done.len() > 1;
    let mut answers = Vec::with_capacity(done.len());
    for (index, (c, (prompt, _, settings))) in done.into_iter().zip(texts).enumerate() {
        let (kind, word) = stop_type(&c.ending);
        let mut out = json!({
            "index": index,
            "content": c.text,
            "tokens": if r.return_tokens.unwrap_or(false) { json!(c.tokens) } else { json!([]) },
            "id_slot": c.slot,
            "stop": true,
            "model": model.facts.id,
            "tokens_predicted": c.usage.completion_tokens,
            "tokens_evaluated": c.usage.prompt_tokens,
            "generation_settings": settings,
            "prompt": prompt,
            "has_new_line": c.text.contains('\n'),
            "truncated": c.ending.out_of_context(&c.usage, model.facts.ctx_size),
            "stop_type": kind,
            "stopping_word": word,
            "tokens_cached": tokens_cached(&c.usage, &c.ending),
            "timings": timings(&c.usage),
        });
        if with_probs {
            // The end-of-sequence token it ended at is listed too, as llama-server lists it.
            let all: Vec<TokenLogprob> = c.logprobs.iter().chain(&c.end_token).cloned().collect();
            out["completion_probabilities"] = probabilities(&model.text, &all);
        }
        if let Some(fields) = &response_fields {
            out = pick_fields(&out, fields);
        }
        answers.push(out);
    }
    // One prompt, one answer; several, a list of them (as llama-server answers).
    Ok(if several { Json(json!(answers)) } else { Json(answers.remove(0)) }.into_response())
}

/// How many answers each prompt gets: llama-server's `n_cmpl` (or `n`), at most one per slot as
/// there (the answers run side by side, sharing the prompt's cached pages).
fn answers_per_prompt(r: &CompletionRequest, parallel: usize) -> Result<usize, ApiError> {
    let (field, n) = match (r.n_cmpl, r.n) {
        (Some(n), _) => ("n_cmpl", n),
        (None, Some(n)) => ("n", n),
        (None, None) => return Ok(1),
    };
    if n < 1 {
        return Err(ApiError::field(field, format!("{field} must be at least 1, got {n}")));
    }
    if n as u64 > parallel as u64 {
        return Err(ApiError::field(
            field,
            format!("{field} ({n}) cannot be greater than the number of slots ({parallel}), please increase -np"),
        ));
    }
    Ok(n as usize)
}

/// llama-server's `response_fields`: the answer's fields at these paths, each under its path as
/// the key (`"generation_settings/n_predict"`, as llama-server and the editors that read it name
/// it), missing ones left out.
fn pick_fields(answer: &Value, paths: &[String]) -> Value {
    let mut out = serde_json::Map::new();
    for path in paths {
        let found = path.split('/').try_fold(answer, |v, key| v.get(key));
        if let Some(v) = found {
            out.insert(path.clone(), v.clone());
        }
    }
    Value::Object(out)
}

struct CompletionStream {
    /// Which of the request's prompts this is.
    index: usize,
    model: String,
    settings: Value,
    prompt: String,
    with_probs: bool,
    extras: StreamExtras,
    tok: Arc<crate::text::TextTokenizer>,
    ctx_size: usize,
    /// Whether the text so far holds a line break (`has_new_line` of the last chunk).
    new_line: bool,
}

impl CompletionStream {
    /// A chunk before the end, as llama-server streams them.
    fn partial(&self, text: &str, tokens: &[u32], live: &Live) -> Value {
        json!({
            "index": self.index,
            "content": text,
            "tokens": tokens,
            "stop": false,
            "id_slot": live.slot,
            "tokens_predicted": live.generated,
            "tokens_evaluated": live.prompt_tokens,
        })
    }
}

impl StreamDialect for CompletionStream {
    fn start(&mut self, _live: &Live) -> Vec<Event> {
        vec![]
    }

    fn progress(&mut self, live: &Live, progress: Value) -> Vec<Event> {
        self.extras.progress(self.partial("", &[], live), progress, live)
    }

    fn text(&mut self, text: &str, tokens: &[u32], logprobs: &[TokenLogprob], live: &Live) -> Vec<Event> {
        self.new_line |= text.contains('\n');
        let mut v = self.partial(text, tokens, live);
        if self.with_probs {
            v["completion_probabilities"] = probabilities(&self.tok, logprobs);
        }
        self.extras.add_timings(&mut v, live);
        vec![data(&v)]
    }

    /// A chunk of no text for the end-of-sequence token, as llama-server streams it.
    fn end_token(&mut self, token: &TokenLogprob, live: &Live) -> Vec<Event> {
        match self.with_probs {
            true => self.text("", &[], std::slice::from_ref(token), live),
            false => vec![],
        }
    }

    fn done(&mut self, ending: &Ending, usage: &Usage, live: &Live) -> Vec<Event> {
        let (kind, word) = stop_type(ending);
        vec![data(&json!({
            "index": self.index,
            "content": "",
            "tokens": [],
            "id_slot": live.slot,
            "stop": true,
            "model": self.model,
            "tokens_predicted": usage.completion_tokens,
            "tokens_evaluated": usage.prompt_tokens,
            "generation_settings": self.settings,
            "prompt": self.prompt,
            "has_new_line": self.new_line,
            "truncated": ending.out_of_context(usage, self.ctx_size),
            "stop_type": kind,
            "stopping_word": word,
            "tokens_cached": tokens_cached(usage, ending),
            "timings": timings(usage),
        }))]
    }

    fn error(&mut self, e: &ApiError) -> Vec<Event> {
        vec![data(&e.clone().in_dialect(Dialect::Llama).body())]
    }
}

/// The tokens a finished request leaves in its cache, as llama-server counts them: the prompt and
/// every sampled token but the last, which was never fed back — except an end-of-sequence token,
/// which the completion tokens do not count.
fn tokens_cached(usage: &Usage, ending: &Ending) -> usize {
    match ending {
        Ending::Eos => usage.prompt_tokens + usage.completion_tokens,
        _ => usage.prompt_tokens + usage.completion_tokens.saturating_sub(1),
    }
}

fn llama_err(e: ApiError) -> Response {
    e.in_dialect(Dialect::Llama).into_response()
}

#[derive(Deserialize)]
struct TokenizeRequest {
    /// Text, or token ids and texts mixed (llama-server's `tokenize_mixed`: ids kept as they are);
    /// none: no tokens, as llama-server answers.
    content: Option<TokenizeContent>,
    add_special: Option<bool>,
    /// Special-token text read as special tokens (llama-server's default) or as plain text.
    parse_special: Option<bool>,
    with_pieces: Option<bool>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum TokenizeContent {
    Text(String),
    Pieces(Vec<Piece>),
}

pub async fn tokenize(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let run = || -> Result<Response, ApiError> {
        let model = state.ready()?;
        let r: TokenizeRequest = parse_body(&body)?;
        let add_special = r.add_special.unwrap_or(false);
        let encode = |text: &str, add_special: bool| {
            match r.parse_special.unwrap_or(true) {
                true => model.text.encode(text, add_special),
                false => model.text.encode_literal(text, add_special),
            }
            .map_err(|e| ApiError::internal(e.to_string()))
        };
        let ids = match &r.content {
            None => vec![],
            Some(TokenizeContent::Text(text)) => encode(text, add_special)?,
            Some(TokenizeContent::Pieces(pieces)) => {
                let vocab = model.facts.vocab_size as u32;
                let outside = pieces.iter().enumerate().find_map(|(i, p)| match p {
                    Piece::Token(t) if *t >= vocab => Some((i, *t)),
                    _ => None,
                });
                if let Some((i, t)) = outside {
                    return Err(ApiError::field(
                        &format!("content[{i}]"),
                        format!("token id {t} is outside the vocabulary (size {vocab})"),
                    ));
                }
                mixed_ids(pieces, add_special, encode)?
            }
        };
        if !r.with_pieces.unwrap_or(false) {
            return Ok(Json(json!({"tokens": ids})).into_response());
        }
        // A piece that is not valid UTF-8 by itself (part of a multi-byte character) is given as its
        // bytes, as llama-server gives it.
        let tokens: Vec<Value> = ids
            .iter()
            .map(|&id| match String::from_utf8(model.text.token_bytes(id)) {
                Ok(piece) => json!({"id": id, "piece": piece}),
                Err(e) => json!({"id": id, "piece": e.into_bytes()}),
            })
            .collect();
        Ok(Json(json!({"tokens": tokens})).into_response())
    };
    run().unwrap_or_else(llama_err)
}

#[derive(Deserialize)]
struct DetokenizeRequest {
    /// None: `""`, as llama-server answers.
    #[serde(default)]
    tokens: Vec<u32>,
}

pub async fn detokenize(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let run = || -> Result<Response, ApiError> {
        let model = state.ready()?;
        let r: DetokenizeRequest = parse_body(&body)?;
        let vocab = model.facts.vocab_size as u32;
        if let Some(t) = r.tokens.iter().find(|&&t| t >= vocab) {
            return Err(ApiError::field("tokens", format!("token id {t} is outside the vocabulary (size {vocab})")));
        }
        let content = model.text.inner.decode(&r.tokens, false).map_err(|e| ApiError::internal(e.to_string()))?;
        Ok(Json(json!({"content": content})).into_response())
    };
    run().unwrap_or_else(llama_err)
}

/// `POST /apply-template`: the prompt a chat request would be answered from (any chat request body,
/// as llama-server reads it).
pub async fn apply_template(State(state): State<Arc<AppState>>, body: Bytes) -> Response {
    let run = || -> Result<Response, ApiError> {
        let model = state.ready()?;
        let prompt = super::openai::templated_chat_body(&state, model, &body)?.text;
        Ok(Json(json!({"prompt": prompt})).into_response())
    };
    run().unwrap_or_else(llama_err)
}

/// `GET /lora-adapters`: the adapters loaded — none (`--lora` is refused at start-up).
pub async fn lora_adapters() -> Response {
    Json(json!([])).into_response()
}

/// `POST /slots/{id}?action=save|restore|erase`: llama-server answers these only when started with
/// `--slot-save-path`, which is refused here, so they get its answer without one.
pub async fn slot_action() -> Response {
    llama_err(ApiError::new(
        ErrorKind::NotSupported,
        "This server does not support slots action (saving, restoring or erasing a slot's cache; --slot-save-path is not supported)",
    ))
}

/// `POST /props`: llama-server changes no global property either, and without `--props` it answers
/// this way (`--props` is refused at start).
pub async fn set_props() -> Response {
    llama_err(ApiError::new(
        ErrorKind::NotSupported,
        "This server does not support changing global properties (--props is not supported)",
    ))
}

/// `POST /lora-adapters`: setting adapter scales; with no adapters loaded, only an empty list.
pub async fn set_lora_adapters(body: Bytes) -> Response {
    match parse_body::<Vec<Value>>(&body) {
        Ok(list) if list.is_empty() => Json(json!([])).into_response(),
        Ok(_) => llama_err(ApiError::field("lora", "no LoRA adapters are loaded (--lora is not supported)")),
        Err(e) => llama_err(e),
    }
}

/// `/health`: 200 `{"status": "ok"}` once the model is loaded, 503 before. Public (no API key).
pub async fn health(State(state): State<Arc<AppState>>) -> Response {
    if state.speech.get().is_some() {
        return Json(json!({"status": "ok"})).into_response();
    }
    match state.ready() {
        Ok(_) => Json(json!({"status": "ok"})).into_response(),
        Err(e) => llama_err(e),
    }
}

pub async fn props(State(state): State<Arc<AppState>>) -> Response {
    if let Some(speech) = state.speech.get() {
        return Json(speech.props(&state.config)).into_response();
    }
    let model = match state.ready() {
        Ok(m) => m,
        Err(e) => return llama_err(e),
    };
    let f = &model.facts;
    let c = &state.config;
    let stats = model.generator.stats();
    let n_predict = c.n_predict.map_or(-1, |n| n as i64);
    // llama-server's shape (`n_ctx` and `params`), the settings also at the top as before.
    let mut defaults = generation_settings(model, &f.default_sampling, n_predict);
    defaults["params"] = defaults.clone();
    Json(json!({
        "default_generation_settings": defaults,
        "total_slots": stats.slots.len().max(1),
        "model_alias": f.id,
        "model_path": f.path,
        "chat_template": f.chat_template.clone().unwrap_or_default(),
        "bos_token": model.text.bos_token.clone().unwrap_or_default(),
        "eos_token": model.text.eos_token.clone().unwrap_or_default(),
        "modalities": {"vision": false, "audio": false},
        "endpoint_slots": c.slots,
        "endpoint_props": false,
        "endpoint_metrics": c.metrics,
        "is_sleeping": false,
        "build_info": format!("mlxcel {}", env!("CARGO_PKG_VERSION")),
        "mlxcel": {
            "architecture": f.architecture,
            "family": f.family,
            "backend": f.backend,
            "n_ctx": f.ctx_size,
            "n_ctx_train": f.ctx_train,
            "parallel": c.parallel,
            "batch_size": c.batch_size,
            "ubatch_size": c.ubatch_size,
            "cache_prompt": c.cache_prompt,
            "queue_limit": c.queue_limit,
            "timeout_s": c.timeout.map(|t| t.as_secs()),
            "weight_bytes": f.weight_bytes,
            "kv_bytes_per_token": f.kv_bytes_per_token,
            "kv_blocks_total": stats.kv_blocks_total,
            "kv_block_size": stats.kv_block_size,
            "kv_budget_bytes": (stats.kv_blocks_total * stats.kv_block_size * f.kv_bytes_per_token),
        },
    }))
    .into_response()
}

pub async fn slots(
    State(state): State<Arc<AppState>>,
    Query(query): Query<std::collections::HashMap<String, String>>,
) -> Response {
    if !state.config.slots {
        return llama_err(ApiError::new(ErrorKind::NotSupported, "This server does not support slots endpoint."));
    }
    if let Some(speech) = state.speech.get() {
        return Json(speech.slots()).into_response();
    }
    let model = match state.ready() {
        Ok(m) => m,
        Err(e) => return llama_err(e),
    };
    let stats = model.generator.stats();
    // `?fail_on_no_slot=1`: 503 when every slot is busy (llama-server's check for load balancers).
    if query.get("fail_on_no_slot").is_some_and(|v| !v.is_empty()) && stats.slots.iter().all(|s| s.is_processing) {
        return llama_err(ApiError::new(ErrorKind::Unavailable, "no slot available"));
    }
    let n_ctx = model.facts.ctx_size;
    let slots: Vec<Value> = stats
        .slots
        .iter()
        .map(|s| {
            let params = s.params.as_ref().unwrap_or(&model.facts.default_sampling);
            json!({
                "id": s.id,
                "id_task": s.id_task.map_or(-1, |t| t as i64),
                "n_ctx": n_ctx,
                "speculative": false,
                "is_processing": s.is_processing,
                "params": generation_settings(model, params, if s.is_processing { (s.n_remain + s.n_decoded) as i64 } else { -1 }),
                "n_prompt_tokens": s.n_prompt_tokens,
                // (An array of one, as llama-server writes it.)
                "next_token": [{
                    "has_next_token": s.is_processing,
                    "n_remain": if s.is_processing { s.n_remain as i64 } else { -1 },
                    "n_decoded": s.n_decoded,
                }],
            })
        })
        .collect();
    Json(json!(slots)).into_response()
}

/// `/metrics`: Prometheus text with llama-server's `llamacpp:*` names and mlxcel's own.
pub async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    if !state.config.metrics {
        return llama_err(ApiError::new(
            ErrorKind::NotSupported,
            "This server does not support metrics endpoint. Start it with --metrics",
        ));
    }
    if let Some(speech) = state.speech.get() {
        return prometheus(speech.metrics_rows(state.started.elapsed().as_secs_f64()), state.started_unix);
    }
    let model = match state.ready() {
        Ok(m) => m,
        Err(e) => return llama_err(e),
    };
    let m = &state.metrics;
    let s = model.generator.stats();
    let r = Ordering::Relaxed;
    let prompt_tokens = m.prompt_tokens_total.load(r);
    let predicted = m.tokens_predicted_total.load(r);
    let (prompt_s, predicted_s) = (m.prompt_seconds(), m.predicted_seconds());
    let rate = |n: u64, secs: f64| if secs > 0.0 { n as f64 / secs } else { 0.0 };
    let busy = if s.n_decode_total > 0 { s.n_busy_slots_total as f64 / s.n_decode_total as f64 } else { 0.0 };
    let kv_tokens = s.kv_blocks_used * s.kv_block_size;
    let rows: Vec<(&str, &str, &str, f64)> = vec![
        ("llamacpp:prompt_tokens_total", "counter", "Number of prompt tokens processed.", prompt_tokens as f64),
        ("llamacpp:prompt_seconds_total", "counter", "Prompt process time", prompt_s),
        ("llamacpp:tokens_predicted_total", "counter", "Number of generation tokens processed.", predicted as f64),
        ("llamacpp:tokens_predicted_seconds_total", "counter", "Predict process time", predicted_s),
        ("llamacpp:n_decode_total", "counter", "Total number of llama_decode() calls", s.n_decode_total as f64),
        (
            "llamacpp:n_tokens_max",
            "counter",
            "Largest observed sequence length (prompt + generation)",
            m.n_tokens_max.load(r) as f64,
        ),
        (
            "llamacpp:prompt_tokens_cached_total",
            "counter",
            "Number of prompt tokens reused from the cache",
            m.cached_tokens_total.load(r) as f64,
        ),
        ("llamacpp:n_busy_slots_per_decode", "counter", "Average number of busy slots per llama_decode() call", busy),
        (
            "llamacpp:prompt_tokens_seconds",
            "gauge",
            "Average prompt throughput in tokens/s.",
            rate(prompt_tokens, prompt_s),
        ),
        (
            "llamacpp:predicted_tokens_seconds",
            "gauge",
            "Average generation throughput in tokens/s.",
            rate(predicted, predicted_s),
        ),
        ("llamacpp:kv_cache_usage_ratio", "gauge", "KV-cache usage. 1 means 100 percent usage.", s.kv_usage_ratio()),
        ("llamacpp:kv_cache_tokens", "gauge", "KV-cache tokens.", kv_tokens as f64),
        ("llamacpp:requests_processing", "gauge", "Number of requests processing.", s.requests_processing as f64),
        ("llamacpp:requests_deferred", "gauge", "Number of requests deferred.", s.requests_deferred as f64),
        ("mlxcel_requests_total", "counter", "Requests that finished with an answer.", m.requests_total.load(r) as f64),
        ("mlxcel_requests_failed_total", "counter", "Requests the engine failed.", m.requests_failed.load(r) as f64),
        (
            "mlxcel_requests_cancelled_total",
            "counter",
            "Requests stopped before their end: the client left, the timeout, or shutdown cut them short.",
            s.requests_cancelled as f64,
        ),
        (
            "mlxcel_prompt_cached_tokens_total",
            "counter",
            "Prompt tokens served from the prefix cache.",
            m.cached_tokens_total.load(r) as f64,
        ),
        ("mlxcel_queue_seconds_total", "counter", "Time requests waited in the queue.", m.queue_seconds()),
        (
            "mlxcel_kv_blocks_used",
            "gauge",
            "KV blocks held by sequences and the prefix cache.",
            s.kv_blocks_used as f64,
        ),
        ("mlxcel_kv_blocks_total", "gauge", "KV blocks in the pool.", s.kv_blocks_total as f64),
        ("mlxcel_uptime_seconds", "gauge", "Seconds since the server started.", state.started.elapsed().as_secs_f64()),
    ];
    prometheus(rows, state.started_unix)
}

/// `(name, type, help, value)` rows in Prometheus' text format.
/// The rows as Prometheus text, with llama-server's `Process-Start-Time-Unix` header (a scraper
/// tells a restart by it).
fn prometheus(rows: Vec<(&str, &str, &str, f64)>, started_unix: u64) -> Response {
    let mut text = String::new();
    for (name, kind, help, value) in rows {
        let _ = writeln!(text, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
    }
    let started = started_unix.to_string();
    let headers = [(header::CONTENT_TYPE, "text/plain; version=0.0.4"), (PROCESS_START, started.as_str())];
    (StatusCode::OK, headers, text).into_response()
}

const PROCESS_START: header::HeaderName = header::HeaderName::from_static("process-start-time-unix");

#[cfg(test)]
mod tests {
    use super::utf8_head;

    #[test]
    fn a_token_shows_its_text_up_to_an_unfinished_character() {
        let smile = "🙂".as_bytes();
        assert_eq!(utf8_head(smile), "🙂");
        assert_eq!(utf8_head(&smile[..2]), "", "the first bytes of a character alone");
        assert_eq!(utf8_head(&[b"ab".as_slice(), &smile[..3]].concat()), "ab");
        assert_eq!(utf8_head(&[0xff, b'a']), "\u{fffd}a", "a byte that starts no character");
        assert_eq!(utf8_head(&[0xff, smile[0], smile[1]]), "\u{fffd}", "a bad byte, then an unfinished character");
    }
}
