//! The path every generating route shares once its dialect is translated: check the prompt against
//! the context, build the [`GenerationRequest`], submit it, and either collect the events into one
//! answer or relay them as server-sent events through the dialect's [`StreamDialect`].

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream;
use serde_json::json;
use tokio::sync::mpsc;

use super::error::{ApiError, ErrorKind};
use super::generator::EventStream;
use super::state::{AppState, LoadedModel, RequestLog};
use crate::engine::{
    CodeLimits, EngineError, FinishReason, GenerationEvent, GenerationRequest, SamplingParams, ThoughtBudget,
    TokenLogprob, Usage,
};
use crate::text::grammar::Constraint;
use crate::text::TextTokenizer;

/// A request after its dialect is translated, before the server's limits are applied.
#[derive(Debug, Clone)]
pub struct Job {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// None: the server's `-n`, else until EOS or the context is full.
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    pub cache_prompt: Option<bool>,
    pub logprobs: Option<usize>,
    /// Score the prompt too, with this many alternatives per token.
    pub prompt_logprobs: Option<usize>,
    /// The slot to run in (None: any).
    pub slot: Option<usize>,
    pub thought_budget: Option<ThoughtBudget>,
    /// Special tokens whose text the answer keeps (tags the dialect reads back).
    pub shown_special: Vec<u32>,
    /// Tokens that end the answer as end-of-sequence does.
    pub end_tokens: Vec<u32>,
    pub code_limits: CodeLimits,
    /// The JSON the answer must be (structured outputs).
    pub constraint: Option<Constraint>,
}

impl Job {
    pub fn new(prompt: Vec<u32>, sampling: SamplingParams) -> Job {
        let (max_tokens, stop, ignore_eos, cache_prompt, logprobs) = (None, vec![], false, None, None);
        let (thought_budget, shown_special, end_tokens, code_limits, constraint) =
            (None, Vec::new(), Vec::new(), CodeLimits::default(), None);
        Job {
            prompt,
            sampling,
            max_tokens,
            stop,
            ignore_eos,
            cache_prompt,
            logprobs,
            prompt_logprobs: None,
            slot: None,
            thought_budget,
            shown_special,
            end_tokens,
            code_limits,
            constraint,
        }
    }

    /// The `i`-th of several answers to one request: the same job with its seed (if any) moved on
    /// by `i`, as llama-server seeds its child tasks, so that seeded answers differ and stay
    /// reproducible.
    pub fn with_seed_offset(&self, i: usize) -> Job {
        let mut j = self.clone();
        if let Some(s) = j.sampling.seed {
            j.sampling.seed = Some(s.wrapping_add(i as u64));
        }
        // Only the first keeps the slot asked for; the others run where there is room, as
        // llama-server's child tasks (`n_cmpl`) do.
        if i > 0 {
            j.slot = None;
        }
        j
    }

    /// Applies the context size, `-n`, `--timeout` and `--cache-prompt`; `prompt_param` names the request
    /// field an over-long prompt came from.
    pub fn into_request(
        mut self,
        state: &AppState,
        model: &LoadedModel,
        prompt_param: &str,
    ) -> Result<GenerationRequest, ApiError> {
        let ctx = model.facts.ctx_size;
        if self.prompt.is_empty() {
            return Err(ApiError::field(prompt_param, "the prompt is empty"));
        }
        if self.prompt.len() >= ctx {
            return Err(ApiError::context_exceeded(Some(prompt_param), self.prompt.len(), ctx));
        }
        // Its messages start with the field at fault.
        self.sampling.validate().map_err(|e| {
            let field = e.split_whitespace().next().unwrap_or_default().to_owned();
            ApiError::field(&field, e)
        })?;
        let room = ctx - self.prompt.len();
        let max_tokens = self.max_tokens.or(state.config.n_predict).unwrap_or(room).min(room);
        if self.ignore_eos {
            // As llama-server does: the tokens that would end the answer are never sampled, rather
            // than sampled and passed over.
            let ends = model.text.eos_ids.iter().chain(&self.end_tokens);
            self.sampling.logit_bias.extend(ends.map(|&id| (id, f32::NEG_INFINITY)));
        }
        let mut r = GenerationRequest::new(self.prompt, self.sampling, max_tokens);
        r.stop = self.stop.into_iter().filter(|s| !s.is_empty()).collect();
        r.ignore_eos = self.ignore_eos;
        r.cache_prompt = state.config.cache_prompt && self.cache_prompt.unwrap_or(true);
        r.logprobs = self.logprobs;
        r.prompt_logprobs = self.prompt_logprobs;
        r.slot = self.slot;
        r.thought_budget = self.thought_budget;
        r.shown_special = self.shown_special;
        r.end_tokens = self.end_tokens;
        r.code_limits = self.code_limits;
        r.constraint = self.constraint;
        r.timeout = state.config.timeout;
        Ok(r)
    }
}

/// Submits `req` to the engine.
pub fn submit(model: &LoadedModel, req: GenerationRequest) -> Result<EventStream, ApiError> {
    model.generator.submit(req).map_err(ApiError::from)
}

/// The request fields [`submit_all`]'s refusals name: the prompt's (over the context), and the one
/// that asked for more completions than the server takes at once (`n`, or the list of prompts).
#[derive(Clone, Copy)]
pub struct Asked<'a> {
    pub prompt: &'a str,
    pub count: &'a str,
}

/// Checks and queues every job (the `n` choices of one or more prompts) before any answer is
/// awaited, so that they run together; a refusal drops those queued before it, which cancels them.
/// One request may ask for no more completions than the server's slots and queue hold.
pub fn submit_all(
    jobs: Vec<Job>,
    state: &AppState,
    model: &LoadedModel,
    asked: Asked,
) -> Result<Vec<(EventStream, Vec<String>)>, ApiError> {
    let (parallel, queue) = (state.config.parallel, state.config.queue_limit);
    if jobs.len() > parallel + queue {
        return Err(ApiError::field(
            asked.count,
            format!(
                "this request asks for {} completions; one request may ask for at most {} here (--parallel {parallel} plus a queue of {queue})",
                jobs.len(),
                parallel + queue
            ),
        ));
    }
    let mut pending = Vec::with_capacity(jobs.len());
    for job in jobs {
        let stops = job.stop.clone();
        let req = job.into_request(state, model, asked.prompt)?;
        pending.push((submit(model, req)?, stops));
    }
    Ok(pending)
}

/// [`submit_all`], then every answer, in order.
pub async fn run_all(
    jobs: Vec<Job>,
    state: &AppState,
    model: &LoadedModel,
    asked: Asked<'_>,
    log: &RequestLog,
) -> Result<Vec<Completion>, ApiError> {
    let mut out = Vec::with_capacity(jobs.len());
    let mut refused = None;
    for (events, stops) in submit_all(jobs, state, model, asked)? {
        match collect(events, &stops, &model.text, state, log).await {
            Ok(c) => out.push(c),
            // Shutdown fails the answers that had not started (the only failure that comes as
            // unavailable once submitted): beside an answer that had, each is an empty cut-short
            // one, so that the client keeps what it was given; with none started, the 503 stands.
            Err(e) if e.kind == ErrorKind::Unavailable => {
                refused.get_or_insert(e);
                let (text, tokens, logprobs) = (String::new(), Vec::new(), Vec::new());
                out.push(Completion {
                    text,
                    tokens,
                    logprobs,
                    prompt_logprobs: None,
                    end_token: None,
                    ending: Ending::Cancelled,
                    usage: Usage::default(),
                    slot: 0,
                });
            }
            Err(e) => return Err(e),
        }
    }
    match refused {
        Some(e) if out.iter().all(|c| c.tokens.is_empty()) => Err(e),
        _ => Ok(out),
    }
}

/// How a request ended, in the detail the dialects report.
#[derive(Debug, Clone, PartialEq)]
pub enum Ending {
    /// An end-of-sequence token.
    Eos,
    /// A stop string (not part of the text).
    StopWord(String),
    /// The token limit or the context size.
    Length,
    /// Cut short (timeout or shutdown); reported as a length stop by the dialects that lack a word for it.
    Cancelled,
}

impl Ending {
    /// Whether a length stop was the context filling up (not the token limit): the prompt and the
    /// answer fill `ctx_size` (llama-server's `truncated`, Anthropic's `model_context_window_exceeded`).
    pub fn out_of_context(&self, usage: &Usage, ctx_size: usize) -> bool {
        matches!(self, Ending::Length) && usage.prompt_tokens + usage.completion_tokens >= ctx_size
    }

    /// `finish_reason` of OpenAI and llama-server's OpenAI routes.
    pub fn openai(&self) -> &'static str {
        match self {
            Ending::Eos | Ending::StopWord(_) => "stop",
            Ending::Length | Ending::Cancelled => "length",
        }
    }
}

/// The whole answer of a request.
#[derive(Debug, Clone)]
pub struct Completion {
    pub text: String,
    pub tokens: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
    /// The prompt's scores (tokens after the first), where the request asked for them.
    pub prompt_logprobs: Option<Vec<TokenLogprob>>,
    /// The end-of-sequence token that ended it, with its logprob (where logprobs were asked for).
    pub end_token: Option<TokenLogprob>,
    pub ending: Ending,
    pub usage: Usage,
    /// The engine's slot that served it.
    pub slot: usize,
}

/// Text and tokens received so far, and how to tell which stop string ended them.
#[derive(Default)]
pub struct Received {
    pub text: String,
    pub tokens: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
}

impl Received {
    pub fn push(&mut self, text: &str, tokens: &[u32], logprobs: &[TokenLogprob]) {
        self.text.push_str(text);
        self.tokens.extend_from_slice(tokens);
        self.logprobs.extend_from_slice(logprobs);
    }

    /// The engine strips a matched stop string from the text; which one matched shows in the decoded
    /// tokens past the text.
    pub fn ending(&self, finish: FinishReason, stops: &[String], tok: &TextTokenizer) -> Ending {
        match finish {
            FinishReason::Length => Ending::Length,
            FinishReason::Cancelled => Ending::Cancelled,
            FinishReason::Stop if stops.is_empty() => Ending::Eos,
            FinishReason::Stop => {
                let decoded = tok.decode(&self.tokens).unwrap_or_default();
                let tail = decoded.strip_prefix(self.text.as_str()).unwrap_or(&decoded);
                stops
                    .iter()
                    .filter_map(|s| tail.find(s.as_str()).map(|at| (at, s)))
                    .min_by_key(|(at, _)| *at)
                    .map_or(Ending::Eos, |(_, s)| Ending::StopWord(s.clone()))
            }
        }
    }
}

/// Waits for the whole answer.
pub async fn collect(
    mut events: EventStream,
    stops: &[String],
    tok: &TextTokenizer,
    state: &AppState,
    log: &RequestLog,
) -> Result<Completion, ApiError> {
    let mut got = Received::default();
    let mut slot = 0;
    let (mut prompt_logprobs, mut end_token) = (None, None);
    while let Some(ev) = events.recv().await {
        match ev {
            GenerationEvent::Started { slot: s, .. } => slot = s,
            GenerationEvent::PromptProgress { .. } => {}
            GenerationEvent::PromptLogprobs(scores) => prompt_logprobs = Some(scores),
            GenerationEvent::EndToken(lp) => end_token = Some(lp),
            GenerationEvent::Text { text, tokens, logprobs } => got.push(&text, &tokens, &logprobs),
            GenerationEvent::Done { finish, usage } => {
                let ending = got.ending(finish, stops, tok);
                state.metrics.record(&usage);
                log.usage(&usage, ending.openai());
                if matches!(ending, Ending::StopWord(_)) && !got.logprobs.is_empty() {
                    // The stop string is not part of the text: neither are its tokens' logprobs
                    // (llama-server drops them too), so the logprobs describe the text returned.
                    let within = tokens_within(&got.tokens, got.text.len(), tok);
                    got.logprobs.truncate(within);
                }
                let (text, tokens, logprobs) = (got.text, got.tokens, got.logprobs);
                return Ok(Completion { text, tokens, logprobs, prompt_logprobs, end_token, ending, usage, slot });
            }
            GenerationEvent::Error(e) => {
                state.metrics.failed();
                return Err(e.into());
            }
        }
    }
    state.metrics.failed();
    Err(ApiError::internal("the engine ended the request without an answer"))
}

/// How many of `tokens`, from the first, decode to at most `len` bytes: the tokens wholly inside a
/// text of that length cut from their decoding. Searched from the end (a stop string is a few
/// tokens), as a decoding does not always grow with its tokens: half a character decodes to a
/// three-byte replacement character; at most [`STOP_TOKENS_SEARCHED`] back, past which nothing is
/// cut (the text is then not the tokens' decoding, and each step decodes the whole answer).
pub(crate) fn tokens_within(tokens: &[u32], len: usize, tok: &TextTokenizer) -> usize {
    let lowest = tokens.len().saturating_sub(STOP_TOKENS_SEARCHED);
    (lowest..=tokens.len())
        .rev()
        .find(|&k| tok.decode(&tokens[..k]).is_ok_and(|t| t.len() <= len))
        .unwrap_or(tokens.len())
}

/// How far back [`tokens_within`] looks for the text's end.
const STOP_TOKENS_SEARCHED: usize = 256;

/// llama-server's `timings` object.
pub fn timings(u: &Usage) -> serde_json::Value {
    let prompt_n = u.prompt_tokens.saturating_sub(u.cached_tokens);
    let prompt_ms = u.prompt_time.as_secs_f64() * 1e3;
    let predicted_ms = u.generation_time.as_secs_f64() * 1e3;
    let per = |n: usize, ms: f64| if n == 0 { 0.0 } else { ms / n as f64 };
    let rate = |n: usize, ms: f64| if ms <= 0.0 { 0.0 } else { n as f64 * 1e3 / ms };
    json!({
        "cache_n": u.cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": per(prompt_n, prompt_ms),
        "prompt_per_second": rate(prompt_n, prompt_ms),
        "predicted_n": u.completion_tokens,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": per(u.completion_tokens, predicted_ms),
        // The first token starts the clock: one token alone has no rate (not a million a second).
        "predicted_per_second": if u.completion_tokens > 1 { rate(u.completion_tokens, predicted_ms) } else { 0.0 },
    })
}

/// Where a streamed request stands, for the chunks that report it as they go (llama-server's
/// `timings_per_token`, `id_slot`, `tokens_predicted`): the engine's counts, timed as the events
/// arrive (the last chunk's `timings` are the engine's own).
#[derive(Debug, Clone)]
pub struct Live {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub slot: usize,
    /// Tokens generated so far.
    pub generated: usize,
    admitted: std::time::Instant,
    first_token: Option<std::time::Instant>,
}

impl Live {
    pub fn new(prompt_tokens: usize) -> Live {
        let now = std::time::Instant::now();
        Live { prompt_tokens, cached_tokens: 0, slot: 0, generated: 0, admitted: now, first_token: None }
    }

    /// The usage so far (what [`timings`] reports).
    pub fn usage(&self) -> Usage {
        let now = std::time::Instant::now();
        Usage {
            prompt_tokens: self.prompt_tokens,
            cached_tokens: self.cached_tokens,
            completion_tokens: self.generated,
            prompt_time: self.first_token.unwrap_or(now).saturating_duration_since(self.admitted),
            generation_time: self.first_token.map_or(Duration::ZERO, |t| now.saturating_duration_since(t)),
            queue_time: Duration::ZERO,
        }
    }
}

/// llama-server's `prompt_progress` object.
pub fn prompt_progress(processed: usize, total: usize, cached: usize, elapsed: Duration) -> serde_json::Value {
    json!({"total": total, "cache": cached, "processed": processed, "time_ms": elapsed.as_millis() as u64})
}

/// llama-server's stream extras: `timings` in every chunk, and chunks that report prompt processing
/// (which only a stream can carry).
#[derive(Clone, Copy, Default)]
pub struct StreamExtras {
    pub timings_per_token: bool,
    pub return_progress: bool,
}

impl StreamExtras {
    pub fn new(timings_per_token: Option<bool>, return_progress: Option<bool>, stream: bool) -> Result<Self, ApiError> {
        let return_progress = return_progress.unwrap_or(false);
        if return_progress && !stream {
            return Err(ApiError::field(
                "return_progress",
                "return_progress reports prompt processing in stream chunks; it needs stream: true",
            ));
        }
        // Without a stream the answer carries its timings anyway.
        Ok(StreamExtras { timings_per_token: timings_per_token.unwrap_or(false), return_progress })
    }

    /// `timings` so far in a stream chunk, if they were asked for.
    pub fn add_timings(&self, chunk: &mut serde_json::Value, live: &Live) {
        if self.timings_per_token {
            chunk["timings"] = timings(&live.usage());
        }
    }

    /// `chunk` as a progress chunk (with `prompt_progress`), if progress was asked for.
    pub fn progress(&self, mut chunk: serde_json::Value, progress: serde_json::Value, live: &Live) -> Vec<Event> {
        if !self.return_progress {
            return vec![];
        }
        chunk["prompt_progress"] = progress;
        self.add_timings(&mut chunk, live);
        vec![data(&chunk)]
    }
}

/// A dialect's streaming format: which server-sent events each stage of a request becomes.
pub trait StreamDialect: Send + 'static {
    /// Before any text, once the engine has admitted the request (`live` says what the prefix cache
    /// served and which slot runs it).
    fn start(&mut self, live: &Live) -> Vec<Event>;
    /// Prompt processing went on (llama-server's `return_progress`); nothing by default.
    fn progress(&mut self, _live: &Live, _progress: serde_json::Value) -> Vec<Event> {
        vec![]
    }
    /// The prompt's scores came (to a request that asked for them), before any text; nothing by default.
    fn prompt_logprobs(&mut self, _scores: &[TokenLogprob], _live: &Live) -> Vec<Event> {
        vec![]
    }
    fn text(&mut self, text: &str, tokens: &[u32], logprobs: &[TokenLogprob], live: &Live) -> Vec<Event>;
    /// The end-of-sequence token that ended the answer, with its logprob (where asked for); nothing
    /// by default (OpenAI's chat and Anthropic list no such token).
    fn end_token(&mut self, _token: &TokenLogprob, _live: &Live) -> Vec<Event> {
        vec![]
    }
    fn done(&mut self, ending: &Ending, usage: &Usage, live: &Live) -> Vec<Event>;
    /// After every request of the stream is done (the first request's dialect writes it): `total`
    /// is their usage summed. Nothing by default.
    fn end(&mut self, _total: &Usage) -> Vec<Event> {
        vec![]
    }
    /// The request failed after the stream began.
    fn error(&mut self, e: &ApiError) -> Vec<Event>;
}

/// A JSON `data:` event.
pub fn data(v: &serde_json::Value) -> Event {
    Event::default().data(v.to_string())
}

/// Relays `events` as SSE through `dialect`. A client that goes away drops the engine's stream, which
/// cancels the request.
pub fn stream_response(
    events: EventStream,
    dialect: impl StreamDialect,
    prompt_tokens: usize,
    stops: Vec<String>,
    tok: Arc<TextTokenizer>,
    state: Arc<AppState>,
    log: RequestLog,
) -> Response {
    stream_many(vec![(events, dialect, prompt_tokens)], 1, stops, tok, state, log)
}

/// [`stream_response`] for several requests of one HTTP request (several prompts, several answers
/// to each), their events interleaved as they come, each through its own dialect (which says its
/// index). `per_prompt`: the answers to each prompt, adjacent in `requests`.
pub fn stream_many<D: StreamDialect>(
    requests: Vec<(EventStream, D, usize)>,
    per_prompt: usize,
    stops: Vec<String>,
    tok: Arc<TextTokenizer>,
    state: Arc<AppState>,
    log: RequestLog,
) -> Response {
    use futures_util::StreamExt;
    log.update(|l| l.stream = true);
    let (tx, rx) = mpsc::channel::<Event>(64);
    let mut relays: Vec<Relay<D>> = Vec::with_capacity(requests.len());
    let mut sources = Vec::with_capacity(requests.len());
    for (i, (events, dialect, prompt_tokens)) in requests.into_iter().enumerate() {
        let live = Live::new(prompt_tokens);
        let (got, usage) = (Received::default(), Usage::default());
        relays.push(Relay { dialect, got, started: false, over: false, failed: false, live, usage });
        // Each request's events, then `None` once its channel closes.
        let events = stream::unfold(events, |mut rx| async move { rx.recv().await.map(|e| (Some(e), rx)) })
            .chain(stream::once(async { None }))
            .map(move |e| (i, e));
        sources.push(Box::pin(events));
    }
    tokio::spawn(async move {
        let mut merged = stream::select_all(sources);
        let mut open = relays.len();
        // A client that goes away: what its requests had done goes to the log line.
        let hung_up = |relays: &[Relay<D>]| {
            for r in relays.iter().filter(|r| !r.over) {
                log.usage(&r.live.usage(), "cancelled");
            }
        };
        // Answers that shutdown failed before they started, held back: beside one that had started
        // each becomes an empty cut-short answer (as `run_all` keeps them); with none started, the
        // stream ends in the error.
        let mut shut = Vec::new();
        let several = relays.len() > 1;
        while open > 0 {
            let next = tokio::select! {
                next = merged.next() => next,
                _ = tx.closed() => return hung_up(&relays),
            };
            let Some((i, ev)) = next else { return };
            let relay = &mut relays[i];
            if relay.over {
                continue;
            }
            if several && matches!(ev, Some(GenerationEvent::Error(EngineError::ShuttingDown))) {
                // Failed either way (as `run_all` counts it); what the client sees waits for the others.
                state.metrics.failed();
                (relay.over, open) = (true, open - 1);
                shut.push(i);
                continue;
            }
            let out = relay.on(ev, &stops, &tok, &state, &log);
            if relay.over {
                open -= 1;
            }
            let failed = relay.failed;
            for e in out {
                if tx.send(e).await.is_err() {
                    return hung_up(&relays);
                }
            }
            // One request's failure ends the stream (as llama-server's does); dropping the others'
            // receivers cancels them.
            if failed {
                return;
            }
        }
        let any_started = relays.iter().any(|r| r.live.generated > 0);
        for i in shut {
            let relay = &mut relays[i];
            let mut out = relay.open(None);
            if any_started {
                out.extend(relay.dialect.done(&Ending::Cancelled, &Usage::default(), &relay.live));
            } else {
                out.extend(relay.dialect.error(&EngineError::ShuttingDown.into()));
            }
            for e in out {
                if tx.send(e).await.is_err() {
                    return;
                }
            }
            if !any_started {
                return;
            }
        }
        // A prompt answered several times counts once (as OpenAI counts it for `n`).
        let total = relays.iter().enumerate().fold(Usage::default(), |mut t, (i, r)| {
            if i % per_prompt.max(1) == 0 {
                t.prompt_tokens += r.usage.prompt_tokens;
                t.cached_tokens += r.usage.cached_tokens;
            }
            t.completion_tokens += r.usage.completion_tokens;
            t
        });
        if let Some(first) = relays.first_mut() {
            for e in first.dialect.end(&total) {
                if tx.send(e).await.is_err() {
                    return;
                }
            }
        }
    });
    let body = stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (Ok::<_, Infallible>(e), rx)) });
    Sse::new(body).keep_alive(KeepAlive::default()).into_response()
}

/// One request of a stream: its dialect and what it has received.
struct Relay<D> {
    dialect: D,
    got: Received,
    /// Whether the dialect's opening events went out.
    started: bool,
    /// Whether its last event went out, and whether that was an error.
    over: bool,
    failed: bool,
    live: Live,
    /// The engine's usage, once done.
    usage: Usage,
}

impl<D: StreamDialect> Relay<D> {
    /// The dialect's opening events, the first time. The stream opens when the engine admits the
    /// request (so the opening event can say what the prefix cache served), or with whatever comes
    /// first from an engine that does not say.
    fn open(&mut self, ev: Option<&GenerationEvent>) -> Vec<Event> {
        let mut out = Vec::new();
        if !self.started {
            self.started = true;
            self.live.admitted = std::time::Instant::now();
            if let Some(&GenerationEvent::Started { cached_tokens, slot }) = ev {
                (self.live.cached_tokens, self.live.slot) = (cached_tokens, slot);
            }
            out.extend(self.dialect.start(&self.live));
            // Prompt processing starts from what the prefix cache served.
            let (cached, total) = (self.live.cached_tokens, self.live.prompt_tokens);
            out.extend(self.dialect.progress(&self.live, prompt_progress(cached, total, cached, Duration::ZERO)));
        }
        out
    }

    /// The SSE events for one engine event (`None`: the engine's stream closed).
    fn on(
        &mut self,
        ev: Option<GenerationEvent>,
        stops: &[String],
        tok: &TextTokenizer,
        state: &AppState,
        log: &RequestLog,
    ) -> Vec<Event> {
        let mut out = self.open(ev.as_ref());
        let live = &mut self.live;
        match ev {
            Some(GenerationEvent::Started { .. }) => {}
            Some(GenerationEvent::PromptProgress { processed, total, cached, elapsed }) => {
                out.extend(self.dialect.progress(live, prompt_progress(processed, total, cached, elapsed)))
            }
            Some(GenerationEvent::PromptLogprobs(scores)) => out.extend(self.dialect.prompt_logprobs(&scores, live)),
            Some(GenerationEvent::EndToken(lp)) => out.extend(self.dialect.end_token(&lp, live)),
            Some(GenerationEvent::Text { text, tokens, logprobs }) => {
                self.got.push(&text, &tokens, &logprobs);
                live.generated += tokens.len();
                if !tokens.is_empty() && live.first_token.is_none() {
                    live.first_token = Some(std::time::Instant::now());
                }
                if !text.is_empty() || !logprobs.is_empty() {
                    out.extend(self.dialect.text(&text, &tokens, &logprobs, live));
                }
            }
            Some(GenerationEvent::Done { finish, usage }) => {
                let ending = self.got.ending(finish, stops, tok);
                state.metrics.record(&usage);
                log.usage(&usage, ending.openai());
                out.extend(self.dialect.done(&ending, &usage, live));
                self.usage = usage;
                self.over = true;
            }
            Some(GenerationEvent::Error(e)) => {
                state.metrics.failed();
                out.extend(self.dialect.error(&e.into()));
                (self.over, self.failed) = (true, true);
            }
            None => {
                state.metrics.failed();
                out.extend(self.dialect.error(&ApiError::internal("the engine ended the request without an answer")));
                (self.over, self.failed) = (true, true);
            }
        }
        out
    }
}

/// A random id with a prefix (`chatcmpl-…`, `msg_…`).
pub fn new_id(prefix: &str) -> String {
    use rand::Rng;
    let mut r = rand::thread_rng();
    let s: String = (0..24).map(|_| char::from(b"abcdefghijklmnopqrstuvwxyz0123456789"[r.gen_range(0..36)])).collect();
    format!("{prefix}{s}")
}

/// Seconds since the Unix epoch.
pub fn unix_time() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// A token as OpenAI's logprobs name it: its text, or for a token that is only part of a UTF-8
/// character, `bytes:` and its bytes escaped (`bytes:\xf0\x9f`), so that two such tokens never
/// share a name.
pub fn token_label(tok: &TextTokenizer, id: u32) -> String {
    let bytes = tok.token_bytes(id);
    match String::from_utf8(bytes) {
        Ok(s) => s,
        Err(e) => e.into_bytes().iter().fold("bytes:".to_string(), |mut s, b| {
            s.push_str(&format!("\\x{b:02x}"));
            s
        }),
    }
}

/// `logit_bias` as the dialects send it: OpenAI's `{"token id": bias}` with biases in [-100, 100];
/// llama-server's also `[[token, bias], …]` where a token is an id or a string (each of its tokens
/// biased) and a bias `false` bans the token.
pub fn logit_bias(v: &serde_json::Value, model: &LoadedModel, openai: bool) -> Result<Vec<(u32, f32)>, ApiError> {
    use serde_json::Value;
    let vocab = model.facts.vocab_size as u32;
    let err = |m: String| ApiError::field("logit_bias", format!("invalid logit_bias: {m}"));
    let tokens = |key: &Value| -> Result<Vec<u32>, ApiError> {
        let id = match key {
            Value::Number(n) => n.as_u64(),
            Value::String(s) => s.parse::<u64>().ok(),
            _ => None,
        };
        match (id, key) {
            (Some(id), _) if id < vocab as u64 => Ok(vec![id as u32]),
            (Some(id), _) => Err(err(format!("token id {id} is outside the vocabulary (size {vocab})"))),
            (None, Value::String(s)) if !openai => {
                model.text.encode(s, false).map_err(|e| ApiError::internal(e.to_string()))
            }
            _ => Err(err(format!("expected token ids as keys, got {key}"))),
        }
    };
    let bias = |b: &Value| -> Result<f32, ApiError> {
        match b {
            Value::Bool(false) if !openai => Ok(f32::NEG_INFINITY),
            Value::Number(n) => {
                let x = n.as_f64().unwrap_or(f64::NAN) as f32;
                if openai && !(-100.0..=100.0).contains(&x) {
                    return Err(err(format!("biases must be in [-100, 100], got {x}")));
                }
                if x.is_finite() {
                    Ok(x)
                } else {
                    Err(err(format!("bias {n} is out of range")))
                }
            }
            _ => Err(err(format!("expected a number{} as a bias, got {b}", if openai { "" } else { " or false" }))),
        }
    };
    let pairs: Vec<(&Value, &Value)> = match v {
        Value::Null => vec![],
        Value::Object(m) => {
            let mut out = Vec::new();
            for (k, b) in m {
                let b = bias(b)?;
                out.extend(tokens(&Value::String(k.clone()))?.into_iter().map(|t| (t, b)));
            }
            return Ok(out);
        }
        Value::Array(a) if !openai => a
            .iter()
            .map(|e| match e.as_array().map(Vec::as_slice) {
                Some([t, b]) => Ok((t, b)),
                _ => Err(err(format!("expected [token, bias] pairs, got {e}"))),
            })
            .collect::<Result<_, _>>()?,
        _ => return Err(err("expected an object of token ids to biases".into())),
    };
    let mut out = Vec::new();
    for (t, b) in pairs {
        let b = bias(b)?;
        out.extend(tokens(t)?.into_iter().map(|t| (t, b)));
    }
    Ok(out)
}
