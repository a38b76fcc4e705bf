//! Every route and error shape over a real socket on an ephemeral port, against a scripted
//! [`Generator`] and a real (tiny, byte-level BPE) tokenizer with a ChatML template.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::args::ServerConfig;
use super::*;
use crate::engine::{CodeLimits, SamplingOverrides, Step};
use crate::engine::{
    EngineError, FinishReason, GenerationEvent, GenerationRequest, SamplingParams, TokenLogprob, Usage,
};
use crate::text::{ChatTemplate, TextTokenizer};

const CHATML: &str = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
const ANSWER: [&str; 4] = ["The capital", " of France", " is", " Paris."];

/// Answers every request with [`ANSWER`] (or, with stop strings, text that ends at the first one),
/// recording what it was asked.
#[derive(Default)]
struct Fake {
    requests: Mutex<Vec<GenerationRequest>>,
    refuse: Mutex<Option<EngineError>>,
    /// Send one piece every this many ms (0: at once), watching for the client going away.
    slow_ms: u64,
    cancelled: Arc<AtomicBool>,
    active: Arc<AtomicUsize>,
    text: Option<Arc<TextTokenizer>>,
    /// Pieces to answer with instead of [`ANSWER`].
    script: Option<Vec<&'static str>>,
    /// The requests from this one on (counted from 0) fail with the error once admitted.
    fail_from: Option<(usize, EngineError)>,
}

impl Generator for Fake {
    fn submit(&self, req: GenerationRequest) -> Result<EventStream, EngineError> {
        if let Some(e) = self.refuse.lock().unwrap().clone() {
            return Err(e);
        }
        let index = {
            let mut requests = self.requests.lock().unwrap();
            requests.push(req.clone());
            requests.len() - 1
        };
        let fail = self.fail_from.clone().filter(|(from, _)| index >= *from).map(|(_, e)| e);
        let (tx, rx) = mpsc::channel(16);
        let (slow, cancelled, active, tok) =
            (self.slow_ms, self.cancelled.clone(), self.active.clone(), self.text.clone().unwrap());
        let answer: Vec<&str> = self.script.clone().unwrap_or(ANSWER.to_vec());
        active.fetch_add(1, Ordering::SeqCst);
        tokio::spawn(async move {
            let _guard = Decrement(active);
            let _ = tx.send(GenerationEvent::Started { cached_tokens: 2, slot: 1 }).await;
            if let Some(e) = fail {
                let _ = tx.send(GenerationEvent::Error(e)).await;
                return;
            }
            // The prompt past the cached tokens in two chunks.
            let total = req.prompt.len();
            for processed in [(total + 2) / 2, total] {
                let elapsed = Duration::from_millis(processed as u64);
                let _ = tx.send(GenerationEvent::PromptProgress { processed, total, cached: 2, elapsed }).await;
            }
            let usage = |n| Usage {
                prompt_tokens: req.prompt.len(),
                cached_tokens: 2,
                completion_tokens: n,
                prompt_time: Duration::from_millis(10),
                generation_time: Duration::from_millis(20),
                queue_time: Duration::ZERO,
            };
            if let Some(stop) = req.stop.first() {
                let tokens = tok.encode(&format!("Paris{stop} and more"), false).unwrap();
                let _ = tx.send(GenerationEvent::Text { text: "Paris".into(), tokens, logprobs: vec![] }).await;
                let _ = tx.send(GenerationEvent::Done { finish: FinishReason::Stop, usage: usage(3) }).await;
                return;
            }
            let pieces = if slow > 0 { 1000 } else { answer.len() };
            for i in 0..pieces.min(req.max_tokens) {
                if slow > 0 {
                    tokio::time::sleep(Duration::from_millis(slow)).await;
                }
                let text = answer[i % answer.len()].to_string();
                let tokens = tok.encode(&text, false).unwrap();
                let logprobs = match req.logprobs {
                    Some(k) => tokens
                        .iter()
                        .map(|&t| TokenLogprob {
                            token: t,
                            logprob: -0.25,
                            top: (0..k as u32).map(|j| (t + j, -0.25 - j as f32)).collect(),
                        })
                        .collect(),
                    None => vec![],
                };
                if tx.send(GenerationEvent::Text { text, tokens, logprobs }).await.is_err() {
                    cancelled.store(true, Ordering::SeqCst);
                    return;
                }
            }
            let finish = if req.max_tokens < answer.len() { FinishReason::Length } else { FinishReason::Stop };
            let _ = tx.send(GenerationEvent::Done { finish, usage: usage(pieces.min(req.max_tokens)) }).await;
        });
        Ok(rx)
    }

    fn stats(&self) -> EngineStats {
        EngineStats {
            requests_processing: self.active.load(Ordering::SeqCst),
            kv_blocks_total: 64,
            kv_blocks_used: 16,
            kv_block_size: 16,
            n_decode_total: 10,
            n_busy_slots_total: 10,
            slots: vec![
                SlotStats { id: 0, ..Default::default() },
                SlotStats {
                    id: 1,
                    is_processing: true,
                    n_prompt_tokens: 9,
                    n_decoded: 3,
                    id_task: Some(42),
                    params: Some(SamplingParams { temperature: 0.25, ..Default::default() }),
                    n_remain: 5,
                },
            ],
            ..Default::default()
        }
    }
}

struct Decrement(Arc<AtomicUsize>);
impl Drop for Decrement {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn tokenizer() -> Arc<TextTokenizer> {
    let dir = crate::testing::workspace_root().join("families/llama/tests/fixtures/llama-f32");
    let config: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    let mut t = TextTokenizer::load(&dir, &config, None).unwrap();
    t.chat_template = Some(ChatTemplate::new(CHATML, "", "<|endoftext|>").unwrap());
    Arc::new(t)
}

fn config() -> ServerConfig {
    ServerConfig {
        model: "fixtures/tiny".into(),
        revision: None,
        alias: Some("tiny".into()),
        host: "127.0.0.1".into(),
        port: 0,
        ctx_size: None,
        parallel: 1,
        kv_pool_seqs: None,
        threads: 0,
        n_predict: None,
        batch_size: 2048,
        ubatch_size: 512,
        api_keys: vec![],
        tls: None,
        timeout: None,
        cors: Default::default(),
        metrics: true,
        slots: true,
        cache_prompt: true,
        swa_full: false,
        warmup: false,
        chat_template: None,
        chat_template_kwargs: Default::default(),
        reasoning_format: reasoning::ReasoningFormat::Split,
        reasoning_budget: None,
        backend: None,
        plugin_dirs: vec![],
        force: false,
        max_body_bytes: 64 * 1024,
        max_audio_bytes: 256 * 1024,
        cache_types: None,
        queue_limit: 16,
        sampling: SamplingOverrides::default(),
        embedding: None,
        embd_normalize: None,
        given: Vec::new(),
    }
}

struct Server {
    base: String,
    fake: Arc<Fake>,
    client: reqwest::Client,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    done: tokio::task::JoinHandle<()>,
}

impl Server {
    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }
    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self.client.post(self.url(path)).json(&body).send().await.unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }
    async fn get(&self, path: &str) -> (u16, String) {
        let r = self.client.get(self.url(path)).send().await.unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    }
    async fn post_text(&self, path: &str, body: Value) -> (u16, String, reqwest::header::HeaderMap) {
        let r = self.client.post(self.url(path)).json(&body).send().await.unwrap();
        let headers = r.headers().clone();
        (r.status().as_u16(), r.text().await.unwrap(), headers)
    }
    fn last_request(&self) -> GenerationRequest {
        self.fake.requests.lock().unwrap().last().unwrap().clone()
    }
}

async fn start_with(config: ServerConfig, fake: Fake, loaded: bool) -> Server {
    start_templated(config, fake, loaded, CHATML, 64).await
}

/// A server whose model has `template` and a context of `ctx_size` tokens.
async fn start_templated(config: ServerConfig, fake: Fake, loaded: bool, template: &str, ctx_size: usize) -> Server {
    start_tokenized(config, fake, loaded, template, ctx_size, tokenizer()).await
}

async fn start_tokenized(
    config: ServerConfig,
    fake: Fake,
    loaded: bool,
    template: &str,
    ctx_size: usize,
    mut text: Arc<TextTokenizer>,
) -> Server {
    Arc::get_mut(&mut text).unwrap().chat_template = Some(ChatTemplate::new(template, "", "<|endoftext|>").unwrap());
    let fake = Arc::new(Fake { text: Some(text.clone()), ..fake });
    let state = AppState::new(config);
    if loaded {
        let facts = ModelFacts {
            id: "tiny".into(),
            path: "/models/tiny".into(),
            architecture: "llama".into(),
            family: "llama".into(),
            backend: "cpu".into(),
            ctx_size,
            ctx_train: 2048,
            vocab_size: 320,
            weight_bytes: 1000,
            kv_bytes_per_token: 64,
            chat_template: Some(template.into()),
            default_sampling: SamplingParams::default(),
        };
        let _ = state.model.set(LoadedModel { generator: fake.clone(), text, facts, encoder: None });
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let read_timeout = listen::read_timeout(state.config.timeout);
    let app = router(state);
    let done = tokio::spawn(async move {
        listen::serve(
            vec![listen::Listener::Tcp(listener)],
            None,
            app,
            read_timeout,
            async {
                let _ = stopped.await;
            },
            || {},
        )
        .await
    });
    Server { base, fake, client: reqwest::Client::new(), stop: Some(stop), done }
}

async fn start() -> Server {
    start_with(config(), Fake::default(), true).await
}

/// The `data:` payloads of an SSE body, with the `event:` name before each (if any).
fn sse(body: &str) -> Vec<(Option<String>, String)> {
    assert!(body.ends_with("\n\n"), "SSE body must end with a blank line: {body:?}");
    body.split("\n\n")
        .filter(|e| !e.trim().is_empty() && !e.starts_with(':'))
        .map(|e| {
            let mut name = None;
            let mut data = String::new();
            for line in e.lines() {
                if let Some(n) = line.strip_prefix("event: ") {
                    name = Some(n.to_string());
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data.push_str(d);
                } else {
                    panic!("unexpected SSE line {line:?} in {body:?}");
                }
            }
            (name, data)
        })
        .collect()
}

#[tokio::test]
async fn chat_answers_with_usage_and_passes_the_request_through() {
    let s = start().await;
    let (status, v) = s
        .post(
            "/v1/chat/completions",
            json!({"model": "anything", "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]}
            ], "temperature": 0, "max_completion_tokens": 10, "seed": 7, "stop": "##", "top_p": 0.5, "user": "u-1"}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "anything");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["message"]["content"], "Paris");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
    assert_eq!(v["usage"]["completion_tokens"], 3);
    let r = s.last_request();
    let text = s.fake.text.as_ref().unwrap();
    let want = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is the capital\nof France?<|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(r.prompt, text.encode(want, false).unwrap());
    assert_eq!((r.sampling.temperature, r.sampling.top_p, r.sampling.seed), (0.0, 0.5, Some(7)));
    assert_eq!((r.max_tokens, r.stop.clone()), (10, vec!["##".to_string()]));

    // n = 2 runs two requests with different seeds.
    let (status, v) = s
        .post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "n": 2, "seed": 1}))
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 2);
    assert_eq!(v["choices"][1]["message"]["content"], ANSWER.concat());
    assert_eq!(v["model"], "tiny");
    // Streamed, each choice's chunks carry its index (OpenAI's stream with n).
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "n": 3, "stream": true,
        "stream_options": {"include_usage": true}});
    let (status, body, _) = s.post_text("/v1/chat/completions", body).await;
    assert_eq!(status, 200);
    let chunks: Vec<Value> =
        sse(&body).iter().filter(|e| e.1 != "[DONE]").map(|e| serde_json::from_str(&e.1).unwrap()).collect();
    for i in 0..3 {
        let mine = chunks.iter().filter(|c| c["choices"][0]["index"] == i);
        let text: String = mine.clone().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
        assert_eq!(text, ANSWER.concat(), "choice {i}");
        assert_eq!(mine.filter(|c| c["choices"][0]["finish_reason"] == "stop").count(), 1, "choice {i}");
    }
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["prompt_tokens"], v["usage"]["prompt_tokens"], "{usage} {v}");
    assert_eq!(usage["completion_tokens"].as_u64(), v["usage"]["completion_tokens"].as_u64().map(|c| c / 2 * 3));

    // More answers than the slots and the queue hold: refused by the field that asked for them.
    let small =
        start_templated(ServerConfig { parallel: 1, queue_limit: 2, ..config() }, Fake::default(), true, CHATML, 2048)
            .await;
    let hi = json!([{"role": "user", "content": "hi"}]);
    for (route, body, param) in [
        ("/v1/chat/completions", json!({"messages": hi, "n": 4}), "n"),
        ("/v1/completions", json!({"prompt": "a", "n": 4}), "n"),
        ("/v1/completions", json!({"prompt": "a", "n_cmpl": 4}), "n_cmpl"),
        ("/v1/completions", json!({"prompt": ["a", "b", "c", "d"]}), "prompt"),
    ] {
        let (status, v) = small.post(route, body).await;
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some(param)), "{route}: {v}");
        assert!(v["error"]["message"].as_str().unwrap().contains("at most 3"), "{v}");
    }
    // (llama-server's errors name no field.)
    let (status, v) = small.post("/completion", json!({"prompt": ["a", "b", "c", "d"]})).await;
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("at most 3"), "{v}");
}

#[tokio::test]
async fn chat_stream_is_sse_chunks_then_usage_then_done() {
    let s = start().await;
    let (status, body, headers) = s
        .post_text(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "stream": true, "stream_options": {"include_usage": true}}),
        )
        .await;
    assert_eq!(status, 200);
    assert!(headers["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    let events = sse(&body);
    assert_eq!(events.last().unwrap().1, "[DONE]");
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(&e.1).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"], json!({"role": "assistant", "content": null}));
    let text: String =
        chunks.iter().filter_map(|c| c["choices"].get(0)?["delta"]["content"].as_str().map(String::from)).collect();
    assert_eq!(text, ANSWER.concat());
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "stop");
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 4);
    assert!(chunks.iter().all(|c| c["object"] == "chat.completion.chunk" && c["id"] == chunks[0]["id"]));
}

#[tokio::test]
async fn completions_take_strings_token_ids_and_echo_and_refuse_suffix() {
    let s = start().await;
    let (status, v) = s.post("/v1/completions", json!({"prompt": "Once", "max_tokens": 2, "echo": true})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], "OnceThe capital of France");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    let (status, v) = s.post("/v1/completions", json!({"prompt": [[5, 6], [7]], "max_tokens": 50})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"].as_array().unwrap().len(), 2);
    assert_eq!(s.last_request().prompt, vec![7]);
    // `n` (and llama-server's `n_cmpl`): answers per prompt, listed prompt by prompt.
    let (status, v) = s.post("/v1/completions", json!({"prompt": ["a", "b"], "n_cmpl": 2, "seed": 3})).await;
    assert_eq!(status, 200, "{v}");
    let indexes: Vec<_> = v["choices"].as_array().unwrap().iter().map(|c| c["index"].as_u64()).collect();
    assert_eq!(indexes, [Some(0), Some(1), Some(2), Some(3)], "{v}");
    assert_eq!(s.last_request().sampling.seed, Some(4));
    // Streamed: each answer's chunks carry its index; the prompt counts once per prompt in the usage.
    let body = json!({"prompt": ["a", "b"], "n_cmpl": 2, "stream": true, "stream_options": {"include_usage": true}});
    let (status, body, _) = s.post_text("/v1/completions", body).await;
    assert_eq!(status, 200);
    let chunks: Vec<Value> =
        sse(&body).iter().filter(|e| e.1 != "[DONE]").map(|e| serde_json::from_str(&e.1).unwrap()).collect();
    for i in 0..4 {
        let text: String = chunks
            .iter()
            .filter(|c| c["choices"][0]["index"] == i)
            .map(|c| c["choices"][0]["text"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(text, ANSWER.concat(), "choice {i}");
    }
    let usage = &chunks.last().unwrap()["usage"];
    let (_, one) = s.post("/v1/completions", json!({"prompt": ["a", "b"]})).await;
    assert_eq!(usage["prompt_tokens"], one["usage"]["prompt_tokens"], "{usage} {one}");
    assert_eq!(usage["completion_tokens"], 4 * one["usage"]["completion_tokens"].as_u64().unwrap() / 2, "{usage}");
    let (status, v) = s.post("/v1/completions", json!({"prompt": "a", "suffix": "b"})).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("suffix")), "{v}");
    let (status, v) = s.post("/v1/completions", json!({"prompt": [100000]})).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("prompt")), "{v}");

    let (status, body, _) = s.post_text("/v1/completions", json!({"prompt": "a", "stream": true})).await;
    assert_eq!(status, 200);
    let events = sse(&body);
    assert_eq!(events.last().unwrap().1, "[DONE]");
    let text: String = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(&e.1).unwrap()["choices"][0]["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(text, ANSWER.concat());
}

#[tokio::test]
async fn logprobs_in_each_dialect_shape() {
    let s = start().await;
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 2});
    let (status, v) = s.post("/v1/chat/completions", chat.clone()).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(s.last_request().logprobs, Some(2));
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    let text: String = content.iter().map(|e| e["token"].as_str().unwrap().to_string()).collect();
    assert_eq!(text, ANSWER.concat());
    assert_eq!(content[0]["logprob"], -0.25);
    assert_eq!(content[0]["top_logprobs"].as_array().unwrap().len(), 2);
    assert!(content[0]["bytes"].is_array() && content[0]["top_logprobs"][1]["logprob"] == -1.25);
    let mut streamed = chat.clone();
    streamed["stream"] = json!(true);
    let (_, body, _) = s.post_text("/v1/chat/completions", streamed).await;
    let first: Value = serde_json::from_str(&sse(&body)[1].1).unwrap();
    assert!(first["choices"][0]["logprobs"]["content"][0]["token"].is_string(), "{first}");
    let (status, v) = s
        .post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}))
        .await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("top_logprobs")));

    let (status, v) = s.post("/v1/completions", json!({"prompt": "hi", "logprobs": 3})).await;
    assert_eq!(status, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    let n = lp["tokens"].as_array().unwrap().len();
    assert_eq!((lp["token_logprobs"].as_array().unwrap().len(), lp["text_offset"].as_array().unwrap().len()), (n, n));
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 3);
    assert_eq!(lp["text_offset"][0], 0);

    let (status, v) = s.post("/completion", json!({"prompt": "hi", "n_probs": 2})).await;
    assert_eq!(status, 200, "{v}");
    let probs = v["completion_probabilities"].as_array().unwrap();
    assert!(probs[0]["id"].is_number() && probs[0]["token"].is_string() && probs[0]["logprob"] == -0.25);
    assert_eq!(probs[0]["top_logprobs"].as_array().unwrap().len(), 2);
    // Each entry and its alternatives carry the token's bytes, as llama-server's do.
    for entry in [&probs[0], &probs[0]["top_logprobs"][0]] {
        let bytes: Vec<u8> = serde_json::from_value(entry["bytes"].clone()).unwrap();
        assert_eq!(String::from_utf8(bytes).unwrap(), entry["token"].as_str().unwrap(), "{entry}");
    }
}

#[tokio::test]
async fn an_answer_the_full_context_cut_short_is_truncated() {
    let s = start().await;
    // 61 prompt tokens leave three of the 64.
    let (status, v) = s.post("/completion", json!({"prompt": vec![5; 61]})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!((v["stop_type"].as_str(), v["truncated"].as_bool()), (Some("limit"), Some(true)), "{v}");
    let (_, v) = s.post("/completion", json!({"prompt": vec![5; 10], "n_predict": 3})).await;
    assert_eq!((v["stop_type"].as_str(), v["truncated"].as_bool()), (Some("limit"), Some(false)), "{v}");
    let body = s.post_text("/completion", json!({"prompt": vec![5; 61], "stream": true})).await.1;
    assert!(body.contains("\"truncated\":true"), "{body}");

    // The settings an answer reports hold the server's `-n` where the request has none.
    let s = start_with(ServerConfig { n_predict: Some(2), ..config() }, Fake::default(), true).await;
    let (_, v) = s.post("/completion", json!({"prompt": "x"})).await;
    assert_eq!((v["generation_settings"]["n_predict"].as_i64(), v["tokens_predicted"].as_u64()), (Some(2), Some(2)));
}

#[tokio::test]
async fn llama_server_alias_paths_answer_too() {
    let s = start().await;
    let (status, v) = s.post("/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}]})).await;
    assert_eq!((status, v["object"].as_str()), (200, Some("chat.completion")));
    let (status, v) = s.post("/completions", json!({"prompt": "hi"})).await;
    assert_eq!((status, v["content"].as_str()), (200, Some(ANSWER.concat().as_str())));
    assert_eq!(s.get("/v1/health").await.0, 200);
}

#[tokio::test]
async fn models_lists_the_served_model_on_both_paths() {
    let s = start().await;
    for path in ["/v1/models", "/models"] {
        let (status, body) = s.get(path).await;
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(status, 200);
        assert_eq!((v["object"].as_str(), v["data"][0]["id"].as_str()), (Some("list"), Some("tiny")));
        assert_eq!(v["data"][0]["object"], "model");
        // Anthropic's page of models in the same answer.
        assert_eq!((v["data"][0]["type"].as_str(), v["has_more"].as_bool()), (Some("model"), Some(false)));
        assert!(v["data"][0]["created_at"].as_str().unwrap().ends_with('Z'), "{v}");
    }
}

#[tokio::test]
async fn anthropic_messages_plain_and_stop_sequence() {
    let s = start().await;
    let (status, v) = s
        .post(
            "/v1/messages",
            json!({"model": "claude-x", "max_tokens": 20, "system": [{"type": "text", "text": "Short answers."}],
                   "messages": [{"role": "user", "content": "Capital of France?"}], "top_k": 5}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!((v["type"].as_str(), v["role"].as_str()), (Some("message"), Some("assistant")));
    assert_eq!(v["content"][0], json!({"type": "text", "text": ANSWER.concat()}));
    assert_eq!(v["stop_reason"], "end_turn");
    assert_eq!(v["stop_sequence"], Value::Null);
    assert_eq!(v["usage"]["cache_read_input_tokens"], 2);
    assert_eq!(s.last_request().sampling.top_k, 5);
    let (status, v) = s
        .post(
            "/v1/messages",
            json!({"max_tokens": 20, "stop_sequences": ["."], "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!((v["stop_reason"].as_str(), v["stop_sequence"].as_str()), (Some("stop_sequence"), Some(".")));
    let (status, v) =
        s.post("/v1/messages", json!({"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})).await;
    assert_eq!((status, v["stop_reason"].as_str()), (200, Some("max_tokens")));
    // An answer cut by the context filling up (64 here) says so, as Anthropic's API does.
    // (The longest prompt of whole words that fits.)
    let mut long = json!(null);
    for k in 1..64 {
        let m = json!([{"role": "user", "content": "word ".repeat(k)}]);
        let (_, v) = s.post("/v1/messages/count_tokens", json!({"messages": m})).await;
        if v["input_tokens"].as_u64().is_none_or(|n| n >= 63) {
            break;
        }
        long = m;
    }
    let (status, v) = s.post("/v1/messages", json!({"max_tokens": 30, "messages": long})).await;
    assert_eq!((status, v["stop_reason"].as_str()), (200, Some("model_context_window_exceeded")), "{v}");
}

#[tokio::test]
async fn anthropic_stream_follows_the_event_sequence() {
    let s = start().await;
    let (status, body, _) = s
        .post_text(
            "/v1/messages",
            json!({"max_tokens": 20, "stream": true, "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(status, 200);
    let events = sse(&body);
    let names: Vec<&str> = events.iter().map(|e| e.0.as_deref().unwrap()).collect();
    let mut want = vec!["message_start", "content_block_start", "ping"];
    want.extend(std::iter::repeat_n("content_block_delta", ANSWER.len()));
    want.extend(["content_block_stop", "message_delta", "message_stop"]);
    assert_eq!(names, want);
    for (name, data) in &events {
        let v: Value = serde_json::from_str(data).unwrap();
        assert_eq!(v["type"].as_str(), name.as_deref(), "the data's type names its event");
    }
    let delta: Value = serde_json::from_str(&events[events.len() - 2].1).unwrap();
    assert_eq!(delta["delta"]["stop_reason"], "end_turn");
    assert_eq!(delta["usage"]["output_tokens"], 4);
    // message_start already splits the prompt as the final usage does (the prefix cache served two).
    let start: Value = serde_json::from_str(&events[0].1).unwrap();
    let (opening, last) = (&start["message"]["usage"], &delta["usage"]);
    assert_eq!(opening["cache_read_input_tokens"], 2);
    assert_eq!(opening["input_tokens"], last["input_tokens"]);
    assert_eq!(opening["cache_read_input_tokens"], last["cache_read_input_tokens"]);
}

#[tokio::test]
async fn anthropic_errors_and_count_tokens() {
    let s = start().await;
    let (status, v) = s.post("/v1/messages", json!({"messages": [{"role": "user", "content": "hi"}]})).await;
    assert_eq!(status, 400);
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(v["error"]["message"].as_str().unwrap().contains("max_tokens"), "{v}");
    let (status, v) = s
        .post("/v1/messages", json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}))
        .await;
    assert_eq!((status, v["error"]["type"].as_str()), (400, Some("invalid_request_error")), "{v}");
    let (status, v) =
        s.post("/v1/messages/count_tokens", json!({"messages": [{"role": "user", "content": "hi"}]})).await;
    assert_eq!(status, 200);
    let want = s.fake.text.as_ref().unwrap().encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", false);
    assert_eq!(v["input_tokens"], want.unwrap().len());
}

/// Token counts before sending (OpenAI's `/v1/responses/input_tokens`, llama-server's chat one): the
/// prompt the request would take, tools and instructions included; bad requests fail as the
/// generating route would.
#[tokio::test]
async fn input_tokens_count_the_prompt_a_request_would_take() {
    let s = start().await;
    let ask = json!([{"role": "user", "content": "hi"}]);
    for path in ["/v1/chat/completions/input_tokens", "/chat/completions/input_tokens"] {
        let (status, v) = s.post(path, json!({"messages": ask})).await;
        assert_eq!((status, v["object"].as_str()), (200, Some("response.input_tokens")), "{v}");
        let (_, full) = s.post("/v1/chat/completions", json!({"messages": ask, "max_tokens": 1})).await;
        assert_eq!(v["input_tokens"], full["usage"]["prompt_tokens"], "{v} {full}");
    }
    for path in ["/v1/responses/input_tokens", "/responses/input_tokens"] {
        let body = json!({"input": "hi", "instructions": "Be brief."});
        let (status, v) = s.post(path, body.clone()).await;
        assert_eq!((status, v["object"].as_str()), (200, Some("response.input_tokens")), "{v}");
        let (_, full) = s.post("/v1/responses", body).await;
        assert_eq!(v["input_tokens"], full["usage"]["input_tokens"], "{v} {full}");
        assert!(v["input_tokens"].as_u64().unwrap() > 5, "{v}");
    }
    let tools = start_tools().await;
    let (_, bare) = tools.post("/v1/chat/completions/input_tokens", json!({"messages": ask})).await;
    let (_, with) =
        tools.post("/v1/chat/completions/input_tokens", json!({"messages": ask, "tools": weather_tools()})).await;
    assert!(with["input_tokens"].as_u64() > bare["input_tokens"].as_u64(), "{bare} {with}");
    let (status, v) = s.post("/v1/chat/completions/input_tokens", json!({"messages": "hi"})).await;
    assert_eq!((status, v["error"]["type"].as_str()), (400, Some("invalid_request_error")), "{v}");
    let (status, v) = s.post("/v1/responses/input_tokens", json!({"input": "hi", "store": true})).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("store")), "{v}");
}

#[tokio::test]
async fn llama_completion_plain_and_stream_with_timings() {
    let s = start().await;
    let (status, v) = s
        .post(
            "/completion",
            json!({"prompt": "Hello", "n_predict": 8, "temperature": 0, "top_k": 1, "cache_prompt": false, "seed": -1}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["content"], ANSWER.concat());
    assert_eq!((v["stop"].as_bool(), v["stop_type"].as_str()), (Some(true), Some("eos")));
    assert_eq!(v["timings"]["cache_n"], 2);
    assert!(v["timings"]["predicted_ms"].as_f64().unwrap() > 0.0);
    let r = s.last_request();
    assert_eq!((r.max_tokens, r.cache_prompt, r.sampling.top_k, r.sampling.seed), (8, false, 1, None));
    let (_, v) = s.post("/completion", json!({"prompt": "Hello", "stop": ["."]})).await;
    assert_eq!((v["stop_type"].as_str(), v["stopping_word"].as_str()), (Some("word"), Some(".")));

    let (status, body, _) = s.post_text("/completion", json!({"prompt": [1, 2, 3], "stream": true})).await;
    assert_eq!(status, 200);
    let events: Vec<Value> = sse(&body).iter().map(|e| serde_json::from_str(&e.1).unwrap()).collect();
    let last = events.last().unwrap();
    assert_eq!((last["stop"].as_bool(), last["stop_type"].as_str()), (Some(true), Some("eos")));
    assert!(last["timings"]["prompt_n"].is_number());
    let text: String = events.iter().map(|e| e["content"].as_str().unwrap().to_string()).collect();
    assert_eq!(text, ANSWER.concat());
    assert!(events[..events.len() - 1].iter().all(|e| e["stop"] == false));
}

#[tokio::test]
async fn tokenize_detokenize_and_apply_template() {
    let s = start().await;
    let (status, v) = s.post("/tokenize", json!({"content": "Hello world"})).await;
    assert_eq!(status, 200);
    let ids: Vec<u64> = v["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
    assert!(!ids.is_empty());
    let (_, v) = s.post("/tokenize", json!({"content": "Hello world", "with_pieces": true})).await;
    let pieces: String =
        v["tokens"].as_array().unwrap().iter().map(|t| t["piece"].as_str().unwrap().to_string()).collect();
    assert_eq!(pieces, "Hello world");
    let (_, v) = s.post("/detokenize", json!({"tokens": ids})).await;
    assert_eq!(v["content"], "Hello world");
    // Nothing to do is no error, as llama-server answers it.
    assert_eq!(s.post("/tokenize", json!({})).await, (200, json!({"tokens": []})));
    assert_eq!(s.post("/detokenize", json!({})).await, (200, json!({"content": ""})));
    // Ids and text mixed, as llama-server's tokenize_mixed: ids kept, text tokenized.
    let (status, v) = s.post("/tokenize", json!({"content": [ids[0], " world"]})).await;
    assert_eq!(status, 200, "{v}");
    let text = s.fake.text.as_ref().unwrap();
    let want: Vec<u64> =
        std::iter::once(ids[0]).chain(text.encode(" world", false).unwrap().into_iter().map(u64::from)).collect();
    assert_eq!(v["tokens"], json!(want));
    let (status, v) = s.post("/tokenize", json!({"content": [999_999]})).await;
    assert_eq!(
        (status, v["error"]["message"].as_str().map(|m| m.contains("outside the vocabulary"))),
        (400, Some(true))
    );
    let (_, v) = s.post("/apply-template", json!({"messages": [{"role": "user", "content": "hi"}]})).await;
    assert_eq!(v["prompt"], "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    // A last assistant message is a prefill: the answer continues it.
    let prefill = json!([{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]);
    let want = "<|im_start|>user\nCount<|im_end|>\n<|im_start|>assistant\n1, 2,";
    let (_, v) = s.post("/apply-template", json!({"messages": prefill})).await;
    assert_eq!(v["prompt"], want);
    let (status, _) = s.post("/v1/messages", json!({"max_tokens": 5, "messages": prefill})).await;
    let text = s.fake.text.as_ref().unwrap();
    assert_eq!((status, s.last_request().prompt), (200, text.encode(want, false).unwrap()));
    let (status, _) = s.post("/v1/chat/completions", json!({"messages": prefill})).await;
    assert_eq!((status, s.last_request().prompt), (200, text.encode(want, false).unwrap()));
}

#[tokio::test]
async fn how_a_prompt_ends_follows_llama_server() {
    let s = start().await;
    let user = json!([{"role": "user", "content": "hi"}]);
    let (_, v) = s.post("/apply-template", json!({"messages": user, "add_generation_prompt": false})).await;
    assert_eq!(v["prompt"], "<|im_start|>user\nhi<|im_end|>\n");
    // It reads any chat request, as llama-server's does.
    let chat = json!({"messages": user, "max_tokens": 5, "temperature": 0.2, "stream": true, "top_k": 3});
    let (status, v) = s.post("/apply-template", chat).await;
    assert_eq!((status, v["prompt"].as_str()), (200, Some("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")));
    let (status, v) = s.post("/apply-template", json!({"messages": user, "max_tokens": "five"})).await;
    assert_eq!((status, v["error"]["code"].as_u64()), (400, Some(400)), "a wrong type is still refused: {v}");
    // An explicit continuation, which needs add_generation_prompt off (its default is on).
    let prefill = json!([{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]);
    let want = "<|im_start|>user\nCount<|im_end|>\n<|im_start|>assistant\n1, 2,";
    let asked = json!({"messages": prefill, "continue_final_message": true, "add_generation_prompt": false});
    let (status, v) = s.post("/apply-template", asked.clone()).await;
    assert_eq!((status, v["prompt"].as_str()), (200, Some(want)));
    let (status, _) = s.post("/v1/chat/completions", asked).await;
    assert_eq!(status, 200);
    let both = json!({"messages": prefill, "continue_final_message": true});
    let (status, v) = s.post("/v1/chat/completions", both).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("add_generation_prompt")), "{v}");
    let nothing_to_continue =
        json!({"messages": user, "continue_final_message": "content", "add_generation_prompt": false});
    let (status, v) = s.post("/apply-template", nothing_to_continue).await;
    assert_eq!((status, v["error"]["message"].as_str().map(|m| m.contains("assistant"))), (400, Some(true)), "{v}");
    // A conversation of one assistant message is a prefill too; two at the end are refused.
    let (_, v) = s.post("/apply-template", json!({"messages": [{"role": "assistant", "content": "Once"}]})).await;
    assert!(v["prompt"].as_str().unwrap().ends_with("<|im_start|>assistant\nOnce"), "{v}");
    let two = json!([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "assistant", "content": "c"}]);
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": two})).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("messages")), "{v}");
    // Anthropic's API combines consecutive turns of one role instead.
    let (status, _) = s.post("/v1/messages", json!({"max_tokens": 5, "messages": two})).await;
    let text = s.fake.text.as_ref().unwrap();
    let want = "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb\nc";
    assert_eq!((status, s.last_request().prompt), (200, text.encode(want, false).unwrap()));
    // Turns with other blocks too; an empty last one adds nothing.
    let mixed = json!([
        {"role": "user", "content": "a"},
        {"role": "user", "content": [{"type": "text", "text": "a2"}]},
        {"role": "assistant", "content": "b"},
        {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]},
        {"role": "assistant", "content": ""}
    ]);
    let (status, v) = s.post("/v1/messages", json!({"max_tokens": 5, "messages": mixed})).await;
    let want = "<|im_start|>user\na\na2<|im_end|>\n<|im_start|>assistant\nb";
    assert_eq!((status, s.last_request().prompt), (200, text.encode(want, false).unwrap()), "{v}");
}

#[tokio::test]
async fn anthropic_refuses_what_its_api_refuses() {
    let s = start().await;
    let hi = json!([{"role": "user", "content": "hi"}]);
    for (body, param) in [
        (json!({"max_tokens": 5, "messages": [{"role": "user", "content": ""}]}), "messages[0].content"),
        (json!({"max_tokens": 5, "messages": [{"role": "user", "content": []}]}), "messages[0].content"),
    ] {
        let (status, v) = s.post("/v1/messages", body.clone()).await;
        assert_eq!((status, v["error"]["type"].as_str()), (400, Some("invalid_request_error")), "{body}: {v}");
        let m = v["error"]["message"].as_str().unwrap();
        assert!(m.starts_with("messages.0: all messages must have non-empty content"), "{param}: {v}");
    }
    // Empty or blank text blocks, a blank message and a prefill ending in whitespace, as Anthropic's
    // API words them.
    for (messages, want) in [
        (
            json!([{"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "hi"}]}]),
            "messages: text content blocks must be non-empty",
        ),
        (
            json!([{"role": "user", "content": [{"type": "text", "text": " \n"}]}]),
            "messages: text content blocks must contain non-whitespace text",
        ),
        (
            json!([{"role": "user", "content": "   "}, {"role": "assistant", "content": "a"}]),
            "messages: text content blocks must contain non-whitespace text",
        ),
        (
            json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is "}]),
            "messages: final assistant content cannot end with trailing whitespace",
        ),
    ] {
        let (status, v) = s.post("/v1/messages", json!({"max_tokens": 5, "messages": messages})).await;
        assert_eq!((status, v["error"]["message"].as_str()), (400, Some(want)), "{messages}: {v}");
    }
    // A final assistant message may be empty (it opens the answer), and thinking may be switched on
    // or off on any model (Anthropic clients send it whatever the model; one that does not think
    // answers without a thought).
    let empty_last = json!([{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""}]);
    let (status, _) = s.post("/v1/messages", json!({"max_tokens": 5, "messages": empty_last})).await;
    assert_eq!(status, 200);
    for kind in ["disabled", "adaptive"] {
        let (status, _) =
            s.post("/v1/messages", json!({"max_tokens": 5, "messages": hi, "thinking": {"type": kind}})).await;
        assert_eq!(status, 200);
    }
}

#[tokio::test]
async fn completion_reports_as_llama_server_reports() {
    let s = start().await;
    // The last streamed chunk says whether the answer held a line break, as the whole answer does.
    let (status, body, _) = s.post_text("/completion", json!({"prompt": "a", "stream": true})).await;
    assert_eq!(status, 200);
    let last: Value =
        serde_json::from_str(body.lines().filter_map(|l| l.strip_prefix("data: ")).next_back().unwrap()).unwrap();
    assert_eq!((last["stop"].as_bool(), last["has_new_line"].as_bool()), (Some(true), Some(false)), "{last}");
    // The cache holds the prompt and every sampled token but the last (an end-of-sequence token is
    // not counted among them).
    let (_, v) = s.post("/completion", json!({"prompt": "a", "n_predict": 2})).await;
    let (prompt, predicted) = (v["tokens_evaluated"].as_u64().unwrap(), v["tokens_predicted"].as_u64().unwrap());
    assert_eq!((v["stop_type"].as_str(), v["tokens_cached"].as_u64()), (Some("limit"), Some(prompt + predicted - 1)));
    let (_, v) = s.post("/completion", json!({"prompt": "a"})).await;
    let (prompt, predicted) = (v["tokens_evaluated"].as_u64().unwrap(), v["tokens_predicted"].as_u64().unwrap());
    assert_eq!((v["stop_type"].as_str(), v["tokens_cached"].as_u64()), (Some("eos"), Some(prompt + predicted)));
    // A random seed is llama-server's unsigned default; repeat_last_n below -1 is refused.
    assert_eq!(v["generation_settings"]["seed"].as_u64(), Some(u64::from(u32::MAX)), "{v}");
    let (status, v) = s.post("/completion", json!({"prompt": "a", "repeat_last_n": -2})).await;
    assert_eq!((status, v["error"]["code"].as_u64()), (400, Some(400)), "{v}");
    // The tokens wholly inside a text cut from their decoding (logprobs past a stop string go).
    let tok = s.fake.text.as_ref().unwrap();
    let paris = tok.encode("Paris", false).unwrap();
    let all = tok.encode("Paris and more", false).unwrap();
    assert_eq!(super::completion::tokens_within(&all, "Paris".len(), tok), paris.len());
    assert_eq!(super::completion::tokens_within(&all, 0, tok), 0);
    assert_eq!(super::completion::tokens_within(&all, 1000, tok), all.len());
}

#[tokio::test]
async fn health_props_slots_and_metrics() {
    let s = start().await;
    assert_eq!(s.get("/health").await, (200, r#"{"status":"ok"}"#.to_string()));
    let (status, body) = s.get("/props").await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status, 200);
    assert_eq!(v["total_slots"], 2);
    assert_eq!(v["default_generation_settings"]["n_ctx"], 64);
    assert_eq!(v["default_generation_settings"]["params"]["top_k"], v["default_generation_settings"]["top_k"]);
    assert_eq!(v["mlxcel"]["batch_size"], 2048);
    assert_eq!((v["endpoint_slots"].as_bool(), v["endpoint_props"].as_bool()), (Some(true), Some(false)));
    assert_eq!(v["mlxcel"]["kv_budget_bytes"], 64 * 16 * 64);
    // No LoRA adapters (--lora is refused): an empty list, and setting scales on none is a 400.
    assert_eq!(s.get("/lora-adapters").await, (200, "[]".to_string()));
    assert_eq!(s.post("/lora-adapters", json!([])).await, (200, json!([])));
    assert_eq!(s.post("/lora-adapters", json!([{"id": 0, "scale": 0.5}])).await.0, 400);
    let (status, body) = s.get("/slots").await;
    assert_eq!(status, 200);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (v[0]["id"].as_i64(), v[0]["id_task"].as_i64(), v[0]["next_token"][0]["n_remain"].as_i64()),
        (Some(0), Some(-1), Some(-1))
    );
    let busy = &v[1];
    assert_eq!((busy["id_task"].as_i64(), busy["is_processing"].as_bool()), (Some(42), Some(true)), "{busy}");
    assert_eq!((busy["params"]["temperature"].as_f64(), busy["params"]["n_predict"].as_i64()), (Some(0.25), Some(8)));
    assert_eq!(busy["next_token"], json!([{"has_next_token": true, "n_remain": 5, "n_decoded": 3}]));
    // A slot is idle: `fail_on_no_slot` answers as without it.
    assert_eq!(s.get("/slots?fail_on_no_slot=1").await.0, 200);
    s.post("/completion", json!({"prompt": "x"})).await;
    let (status, body) = s.get("/metrics").await;
    assert_eq!(status, 200);
    let r = s.client.get(s.url("/metrics")).send().await.unwrap();
    let started: u64 = r.headers()["process-start-time-unix"].to_str().unwrap().parse().unwrap();
    assert!(started.abs_diff(crate::server::completion::unix_time()) < 600, "{started}");
    for name in [
        "llamacpp:prompt_tokens_total",
        "llamacpp:tokens_predicted_total 4",
        "llamacpp:prompt_seconds_total",
        "llamacpp:tokens_predicted_seconds_total",
        "llamacpp:n_decode_total 10",
        "llamacpp:requests_processing",
        "llamacpp:requests_deferred",
        "llamacpp:kv_cache_usage_ratio 0.25",
        "mlxcel_prompt_cached_tokens_total 2",
        "llamacpp:prompt_tokens_cached_total 2",
        "llamacpp:n_tokens_max ",
        "# TYPE llamacpp:prompt_tokens_total counter",
    ] {
        assert!(body.contains(name), "/metrics lacks {name}: {body}");
    }
}

#[tokio::test]
async fn slots_and_metrics_answer_501_when_switched_off_and_health_503_while_loading() {
    let s = start_with(ServerConfig { slots: false, metrics: false, ..config() }, Fake::default(), true).await;
    for path in ["/slots", "/metrics"] {
        let (status, body) = s.get(path).await;
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!((status, v["error"]["type"].as_str()), (501, Some("not_supported_error")), "{path}");
    }
    let s = start_with(config(), Fake::default(), false).await;
    let (status, body) = s.get("/health").await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((status, v["error"]["message"].as_str()), (503, Some("Loading model")));
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": []})).await;
    assert_eq!((status, v["error"]["type"].as_str()), (503, Some("unavailable_error")));
}

#[tokio::test]
async fn bad_bodies_get_400_in_each_dialect() {
    let s = start().await;
    for (path, dialect) in [
        ("/v1/chat/completions", "openai"),
        ("/v1/messages", "anthropic"),
        ("/completion", "llama"),
        ("/tokenize", "llama"),
    ] {
        let r = s.client.post(s.url(path)).body("{\"messages\": [").send().await.unwrap();
        assert_eq!(r.status(), 400, "{path}");
        let v: Value = r.json().await.unwrap();
        match dialect {
            "anthropic" => assert_eq!(
                (v["type"].as_str(), v["error"]["type"].as_str()),
                (Some("error"), Some("invalid_request_error"))
            ),
            "openai" => assert!(
                v["error"]["message"].as_str().unwrap().contains("not valid JSON") && v["error"].get("param").is_some()
            ),
            _ => assert_eq!(v["error"]["code"], 400),
        }
    }
    let (status, v) = s
        .post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}))
        .await;
    assert_eq!(
        (status, v["error"]["param"].as_str(), v["error"]["code"].as_str()),
        (400, Some("temperature"), Some("invalid_type")),
        "{v}"
    );
    // Out of range, with OpenAI's code for the side.
    for (field, value, code) in [
        ("temperature", json!(2.5), "decimal_above_max_value"),
        ("presence_penalty", json!(-3), "decimal_below_min_value"),
        ("n", json!(0), "integer_below_min_value"),
        ("max_tokens", json!(0), "integer_below_min_value"),
    ] {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
        body[field] = value;
        let (status, v) = s.post("/v1/chat/completions", body).await;
        assert_eq!(
            (status, v["error"]["param"].as_str(), v["error"]["code"].as_str()),
            (400, Some(field), Some(code)),
            "{v}"
        );
    }
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": [{"role": "wizard", "content": "hi"}]})).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("messages[0].role")), "{v}");
    let (status, v) = s
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
        )
        .await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("messages[0].content[0].type")), "{v}");
    let (status, v) = s.post("/completion", json!({"prompt": "x", "n_predict": "lots"})).await;
    assert_eq!(status, 400);
    assert!(v["error"]["message"].as_str().unwrap().contains("n_predict"), "{v}");
    let (status, v) = s
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}),
        )
        .await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("tools[0].function.name")));
    // A required field left out is the parameter at fault, named with OpenAI's code for it.
    let (status, v) = s.post("/v1/chat/completions", json!({"model": "m"})).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("messages")), "{v}");
    assert_eq!(v["error"]["code"], "missing_required_parameter", "{v}");
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": [{"content": "hi"}]})).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("messages[0].role")), "{v}");
    // Anthropic's words for it.
    let (status, v) = s.post("/v1/messages", json!({"max_tokens": 3, "messages": [{"content": "hi"}]})).await;
    assert_eq!((status, v["error"]["message"].as_str()), (400, Some("messages.0.role: Field required")), "{v}");
    // A history's tool calls, as OpenAI checks them: ids, names, and an answer to each call.
    let user = json!({"role": "user", "content": "hi"});
    let call = |id: &str| json!({"id": id, "type": "function", "function": {"name": "f", "arguments": "{}"}});
    let asked = |calls: Value| json!({"role": "assistant", "content": null, "tool_calls": calls});
    let answer = |id: &str| json!({"role": "tool", "tool_call_id": id, "content": "r"});
    for (messages, param) in [
        (json!([user, {"role": "tool", "content": "r"}]), "messages[1].tool_call_id"),
        (json!([user, answer("c1")]), "messages[1].tool_call_id"),
        (json!([user, asked(json!([call("c1")])), answer("zzz")]), "messages[2].tool_call_id"),
        (json!([user, asked(json!([call("c1"), call("c2")])), answer("c1"), user]), "messages[3]"),
        (json!([user, asked(json!([call("c1"), call("c2")])), answer("c2")]), "messages"),
        (
            json!([user, asked(json!([{"type": "function", "function": {"name": "f"}}]))]),
            "messages[1].tool_calls[0].id",
        ),
        (json!([user, asked(json!([{"id": "c1", "type": "function"}]))]), "messages[1].tool_calls[0].function.name"),
    ] {
        let (status, v) = s.post("/v1/chat/completions", json!({"messages": messages})).await;
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some(param)), "{messages}: {v}");
    }
    let fine = json!([user, asked(json!([call("c1"), call("c2")])), answer("c2"), answer("c1"), user]);
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": fine})).await;
    assert_eq!(status, 200, "{v}");
}

/// `logit_bias` reaches the sampler from each dialect's shape, and bad ones are 400s naming it.
#[tokio::test]
async fn logit_bias_in_each_dialect_reaches_the_sampler() {
    let s = start().await;
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": -100, "7": 2.5}});
    let (status, v) = s.post("/v1/chat/completions", chat).await;
    assert_eq!(status, 200, "{v}");
    let mut got = s.last_request().sampling.logit_bias;
    got.sort_by_key(|b| b.0);
    assert_eq!(got, vec![(5, -100.0), (7, 2.5)]);
    let (status, _) = s.post("/v1/completions", json!({"prompt": "x", "logit_bias": {"9": 1}})).await;
    assert_eq!((status, s.last_request().sampling.logit_bias), (200, vec![(9, 1.0)]));
    let paris = s.fake.text.as_ref().unwrap().encode("Paris", false).unwrap();
    let (status, v) = s.post("/completion", json!({"prompt": "x", "logit_bias": [[3, false], ["Paris", -1.5]]})).await;
    assert_eq!(status, 200, "{v}");
    let mut want = vec![(3, f32::NEG_INFINITY)];
    want.extend(paris.iter().map(|&t| (t, -1.5)));
    assert_eq!(s.last_request().sampling.logit_bias, want);
    // llama-server's sampling fields on its Anthropic and Responses routes too, as it reads them there.
    let hi = json!([{"role": "user", "content": "hi"}]);
    let extra = json!({"logit_bias": {"9": 1}, "seed": 7, "min_p": 0.2, "repeat_penalty": 1.3,
        "presence_penalty": 0.5, "frequency_penalty": 0.25, "repeat_last_n": 8, "ignore_eos": true, "cache_prompt": false});
    for (path, mut body) in [
        ("/v1/messages", json!({"max_tokens": 5, "messages": hi})),
        ("/v1/responses", json!({"input": "hi", "top_k": 3})),
    ] {
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (status, v) = s.post(path, body).await;
        assert_eq!(status, 200, "{path}: {v}");
        let r = s.last_request();
        let p = &r.sampling;
        assert_eq!(
            (p.seed, p.min_p, p.repeat_penalty, p.presence_penalty, p.frequency_penalty, p.penalty_last_n),
            (Some(7), 0.2, 1.3, 0.5, 0.25, 8),
            "{path}"
        );
        assert!(p.logit_bias.contains(&(9, 1.0)) && r.ignore_eos && !r.cache_prompt, "{path}: {r:?}");
    }
    assert_eq!(s.last_request().sampling.top_k, 3);
    // An empty stop string would match anywhere: dropped (llama-server), refused (Anthropic's API).
    let (status, _) = s.post("/completion", json!({"prompt": "x", "stop": ["", "zz"]})).await;
    assert_eq!((status, s.last_request().stop), (200, vec!["zz".to_string()]));
    let (status, v) =
        s.post("/v1/messages", json!({"max_tokens": 5, "messages": hi, "stop_sequences": ["a", " "]})).await;
    assert_eq!(
        (status, v["error"]["message"].as_str()),
        (400, Some("stop_sequences: each stop sequence must contain non-whitespace")),
        "{v}"
    );
    for (path, body) in [
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": -101}})),
        ("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"Paris": 1}})),
        ("/v1/completions", json!({"prompt": "x", "logit_bias": {"99999999": 1}})),
        ("/completion", json!({"prompt": "x", "logit_bias": [[1]]})),
    ] {
        let (status, v) = s.post(path, body).await;
        assert_eq!(status, 400, "{path}: {v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains("logit_bias") || v["error"]["param"] == "logit_bias",
            "{v}"
        );
    }
}

/// Smaller points of each dialect: a model looked up by name, `stream_options` only with `stream`,
/// OpenAI's int64 seeds, Anthropic's temperature range, llama-server's "off" values and limits, and
/// range errors that name their field.
#[tokio::test]
async fn dialect_details_models_seeds_ranges_and_off_values() {
    let s = start().await;
    let (status, body) = s.get("/v1/models/tiny").await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((status, v["id"].as_str(), v["object"].as_str()), (200, Some("tiny"), Some("model")), "{v}");
    let (status, body) = s.get("/v1/models/gpt-9").await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((status, v["error"]["code"].as_str()), (404, Some("model_not_found")), "{v}");
    // An Anthropic client (its SDK sends anthropic-version) gets Anthropic's error shape.
    let r = s.client.get(s.url("/v1/models/gpt-9")).header("anthropic-version", "2023-06-01").send().await.unwrap();
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert_eq!((v["type"].as_str(), v["error"]["type"].as_str()), (Some("error"), Some("not_found_error")), "{v}");
    let hi = json!([{"role": "user", "content": "hi"}]);
    let (status, v) =
        s.post("/v1/chat/completions", json!({"messages": hi, "stream_options": {"include_usage": true}})).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("stream_options")), "{v}");
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": hi, "max_tokens": 0})).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("max_tokens")), "{v}");
    let (status, _) = s.post("/v1/chat/completions", json!({"messages": hi, "seed": -5})).await;
    assert_eq!((status, s.last_request().sampling.seed), (200, Some(-5i64 as u64)));
    // llama-server's -1s (no token limit, the whole context) and its n_predict, on its OpenAI routes too.
    let (status, v) =
        s.post("/v1/chat/completions", json!({"messages": hi, "max_tokens": -1, "repeat_last_n": -1})).await;
    let r = s.last_request();
    assert_eq!((status, r.max_tokens, r.sampling.penalty_last_n), (200, 64 - r.prompt.len(), 64), "{v}");
    let (status, _) = s.post("/v1/chat/completions", json!({"messages": hi, "n_predict": 3})).await;
    assert_eq!((status, s.last_request().max_tokens), (200, 3));
    let (status, v) = s.post("/v1/completions", json!({"prompt": "x", "max_tokens": -2})).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("max_tokens")), "{v}");
    // Fields a typed client sends as null are not sent; older llama-server clients' no-op values pass.
    let (status, v) =
        s.post("/v1/chat/completions", json!({"messages": hi, "reasoning_effort": null, "audio": null})).await;
    assert_eq!(status, 200, "{v}");
    let old =
        json!({"prompt": "x", "penalize_nl": false, "tfs_z": 1.0, "image_data": [], "slot_id": -1, "api_key": ""});
    let (status, v) = s.post("/completion", old).await;
    assert_eq!(status, 200, "{v}");
    // Anthropic's max_tokens 0 computes (and caches) the prompt, generating nothing.
    let (status, v) =
        s.post("/v1/messages", json!({"max_tokens": 0, "messages": hi, "cache_control": {"type": "ephemeral"}})).await;
    assert_eq!((status, s.last_request().max_tokens), (200, 0), "{v}");
    // -1 is llama-server's "random", on its OpenAI routes too.
    let (status, _) = s.post("/v1/chat/completions", json!({"messages": hi, "seed": -1})).await;
    assert_eq!((status, s.last_request().sampling.seed), (200, None));
    // Model names with slashes (hub ids, paths) reach the lookup, which finds no such model.
    let (status, body) = s.get("/v1/models/org/other").await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((status, v["error"]["code"].as_str()), (404, Some("model_not_found")), "{v}");
    // llama-server's /completion: `model` and `max_tokens` (its other name for n_predict) are read.
    let (status, v) = s.post("/completion", json!({"prompt": "x", "model": "m", "max_tokens": 3})).await;
    assert_eq!((status, s.last_request().max_tokens), (200, 3), "{v}");
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": hi, "top_p": 1.5})).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("top_p")), "{v}");
    let (status, v) = s.post("/v1/messages", json!({"max_tokens": 5, "messages": hi, "temperature": 1.5})).await;
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("temperature"), "{v}");
    let (status, _) = s.post("/completion", json!({"prompt": "x", "top_k": -1, "temperature": -1})).await;
    let p = s.last_request().sampling;
    assert_eq!((status, p.top_k, p.temperature), (200, 0, 0.0));
    let (status, v) = s.post("/completion", json!({"prompt": "x", "n_probs": 100000})).await;
    assert_eq!(status, 400, "{v}");
    // llama-server's mixed prompts: ids and strings, each string tokenized in its place.
    let (status, v) = s.post("/completion", json!({"prompt": [5, " hello", 7]})).await;
    assert_eq!(status, 200, "{v}");
    let mut want = vec![5];
    want.extend(s.fake.text.as_ref().unwrap().encode(" hello", false).unwrap());
    want.push(7);
    assert_eq!(s.last_request().prompt, want);
    let picked =
        json!({"prompt": "x", "response_fields": ["content", "generation_settings/n_predict", "nothing/here"]});
    let (status, v) = s.post("/completion", picked).await;
    assert_eq!((status, v), (200, json!({"content": ANSWER.concat(), "generation_settings/n_predict": -1})));
    let streamed = json!({"prompt": "x", "stream": true, "response_fields": ["content"]});
    let (status, v) = s.post("/completion", streamed).await;
    assert_eq!(status, 400, "{v}");
    // Several prompts: one answer each, in order, as a list.
    let (status, v) = s.post("/completion", json!({"prompt": ["abc", "def"]})).await;
    assert_eq!(status, 200, "{v}");
    let got: Vec<(u64, &str, &str)> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|a| (a["index"].as_u64().unwrap(), a["prompt"].as_str().unwrap(), a["content"].as_str().unwrap()))
        .collect();
    let answer = ANSWER.concat();
    assert_eq!(got, [(0, "abc", answer.as_str()), (1, "def", answer.as_str())]);
    let (status, v) = s.post("/completion", json!({"prompt": [[5, 6], "x", [7, "y"]], "n_predict": 1})).await;
    assert_eq!((status, v.as_array().map(Vec::len)), (200, Some(3)), "{v}");
    // A list with ids at its top is one prompt; one prompt in a list is one answer.
    let (status, v) = s.post("/completion", json!({"prompt": [5, "x"]})).await;
    assert_eq!((status, v["index"].as_u64()), (200, Some(0)), "{v}");
    let (status, v) = s.post("/completion", json!({"prompt": [[5, 6]]})).await;
    assert_eq!((status, v["id_slot"].as_u64()), (200, Some(1)), "{v}");
    // `id_slot` goes to the engine with the first answer; the others run where there is room.
    let (status, v) = s.post("/v1/completions", json!({"prompt": "x", "id_slot": 2, "n": 2})).await;
    assert_eq!(status, 200, "{v}");
    let asked: Vec<Option<usize>> = s.fake.requests.lock().unwrap().iter().rev().take(2).map(|r| r.slot).collect();
    assert_eq!(asked, [None, Some(2)]);
    let (status, v) =
        s.post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}], "slot_id": 0})).await;
    assert_eq!((status, s.last_request().slot), (200, Some(0)), "{v}");
    let (status, v) = s.post("/completion", json!({"prompt": "x", "id_slot": -2})).await;
    assert_eq!((status, v["error"]["message"].as_str().map(|m| m.contains("id_slot"))), (400, Some(true)), "{v}");
    // More prompts than the slots and the queue hold: a 400 that says so, not a 503 forever.
    let many: Vec<String> = (0..18).map(|i| format!("p{i}")).collect();
    let (status, v) = s.post("/completion", json!({"prompt": many})).await;
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("at most 17"), "{v}");
    let (status, v) = s.post("/completion", json!({"prompt": [[[5]]]})).await;
    assert_eq!((status, v["error"]["type"].as_str()), (400, Some("invalid_request_error")), "{v}");
}

/// Tokens that are only part of a UTF-8 character keep their own bytes: `/tokenize`'s pieces, the
/// logprobs' `bytes` and names (`bytes:\\x..`, never a shared U+FFFD); `parse_special: false` reads
/// special-token text as text.
#[tokio::test]
async fn partial_character_tokens_keep_their_bytes() {
    let s = start().await;
    let tok = s.fake.text.clone().unwrap();
    let ids = tok.encode("😀🙂", false).unwrap();
    let bytes: Vec<u8> = ids.iter().flat_map(|&id| tok.token_bytes(id)).collect();
    assert_eq!(bytes, "😀🙂".as_bytes());
    let labels: Vec<String> = ids.iter().map(|&id| completion::token_label(&tok, id)).collect();
    assert!(labels.iter().any(|l| l.starts_with("bytes:\\x")), "{labels:?}");
    assert!(labels.iter().all(|l| !l.contains('\u{FFFD}')), "{labels:?}");
    let (status, v) = s.post("/tokenize", json!({"content": "😀🙂", "with_pieces": true})).await;
    assert_eq!(status, 200);
    let mut got = Vec::new();
    for t in v["tokens"].as_array().unwrap() {
        match &t["piece"] {
            Value::String(p) => got.extend_from_slice(p.as_bytes()),
            Value::Array(b) => got.extend(b.iter().map(|x| x.as_u64().unwrap() as u8)),
            other => panic!("piece {other}"),
        }
    }
    assert_eq!(got, "😀🙂".as_bytes());
    let special = tok.encode("<|endoftext|>", false).unwrap();
    assert_eq!(special.len(), 1, "the fixture knows <|endoftext|> as one special token");
    let (_, v) = s.post("/tokenize", json!({"content": "<|endoftext|>", "parse_special": false})).await;
    assert!(v["tokens"].as_array().unwrap().len() > 1, "{v}");
}

/// An earlier tool use in the history reaches the template: the assistant's `tool_calls` (arguments
/// as an object) and the tool result's `tool_call_id`; echoed output-only fields are taken.
#[tokio::test]
async fn tool_call_history_reaches_the_template() {
    let s = start().await;
    let history = json!([
        {"role": "user", "content": "Weather in Paris?", "name": "ann"},
        {"role": "assistant", "content": null, "refusal": null, "annotations": [], "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]);
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": history})).await;
    assert_eq!(status, 200, "{v}");
    let msgs: Vec<openai::MessageIn> = serde_json::from_value(history).unwrap();
    let conv = openai::chat_messages(&msgs).unwrap();
    assert_eq!(conv[0].name.as_deref(), Some("ann"));
    assert_eq!(conv[2].tool_call_id.as_deref(), Some("call_1"));
    let t = ChatTemplate::new(
        "{% for m in messages %}{% if m.tool_calls %}{{ m.tool_calls[0].function.name }}({{ m.tool_calls[0].function.arguments.city }}){% endif %}{% if m.tool_call_id %}[{{ m.tool_call_id }}]{{ m.content }}{% endif %}{% endfor %}",
        "",
        "",
    )
    .unwrap();
    assert_eq!(t.render(&conv, false).unwrap(), "weather(Paris)[call_1]sunny");
    let (status, v) = s
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "assistant", "content": "x", "audio": {"id": "a"}}]}),
        )
        .await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("messages[0].audio")), "{v}");
}

/// A field a route does not read is refused by name in the route's dialect; llama-server's sampler
/// settings are read where its clients send them and pass elsewhere only while those samplers are off.
#[tokio::test]
async fn unread_fields_are_refused_by_name_and_inert_ones_pass() {
    let s = start().await;
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]});
    let (status, v) = s.post("/v1/chat/completions", chat).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("functions")), "{v}");
    assert_eq!(v["error"]["message"], "Unrecognized request argument supplied: functions");
    let (status, v) = s.post("/v1/messages", json!({"max_tokens": 5, "messages": [], "bogus": 1})).await;
    assert_eq!(
        (status, v["type"].as_str(), v["error"]["type"].as_str()),
        (400, Some("error"), Some("invalid_request_error"))
    );
    // In Anthropic's own words.
    assert_eq!(v["error"]["message"], "bogus: Extra inputs are not permitted", "{v}");
    // Its own fields this server does not implement are named as such; the standard speed passes.
    let hi_msg = |extra: Value| {
        let mut m = json!({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]});
        m.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        m
    };
    assert_eq!(s.post("/v1/messages", hi_msg(json!({"speed": "standard"}))).await.0, 200);
    assert_eq!(s.post("/v1/messages", hi_msg(json!({"mcp_servers": []}))).await.0, 200);
    let mcp = json!({"mcp_servers": [{"type": "url", "url": "https://example.com", "name": "x"}]});
    for extra in [json!({"speed": "fast"}), mcp, json!({"output_config": {"effort": "low"}})] {
        let (status, v) = s.post("/v1/messages", hi_msg(extra.clone())).await;
        let m = v["error"]["message"].as_str().unwrap_or_default();
        assert!(status == 400 && m.contains("is not supported by this server"), "{extra}: {v}");
    }
    // OpenAI's fields at the values that change nothing pass; others are refused by name.
    let hi = json!([{"role": "user", "content": "hi"}]);
    assert_eq!(s.post("/v1/chat/completions", json!({"messages": hi, "verbosity": "medium"})).await.0, 200);
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": hi, "verbosity": "low"})).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("verbosity")), "{v}");
    let quiet = json!({"input": "hi", "text": {"verbosity": "medium"}, "background": false});
    assert_eq!(s.post("/v1/responses", quiet).await.0, 200);
    let (status, v) = s.post("/v1/responses", json!({"input": "hi", "background": true})).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("background")), "{v}");
    // A message with no content (only an assistant turn that called tools may have none).
    for messages in [json!([{"role": "user"}]), json!([{"role": "user", "content": null}])] {
        let (status, v) = s.post("/v1/chat/completions", json!({"messages": messages})).await;
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some("messages[0].content")), "{v}");
    }
    let no_answer = json!([{"role": "user", "content": "hi"}, {"role": "assistant"}, {"role": "user", "content": "?"}]);
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": no_answer})).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("messages[1].content")), "{v}");
    let (status, v) = s.post("/completion", json!({"prompt": "x", "mirostat": 2, "mirostat_tau": 4})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!((s.last_request().sampling.mirostat, s.last_request().sampling.mirostat_tau), (2, 4.0));
    let (status, v) = s.post("/completion", json!({"prompt": "x", "mirostat": 3})).await;
    assert_eq!((status, v["error"]["code"].as_i64()), (400, Some(400)), "{v}");
    // Every generating route reads them (Anthropic's too, as llama-server does); others refuse them on.
    let msg = json!({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "dry_multiplier": 0.8});
    let (status, v) = s.post("/v1/messages", msg).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(s.last_request().sampling.dry.multiplier, 0.8);
    let (status, v) = s.post("/v1/responses", json!({"input": "hi", "mirostat": 2, "samplers": "kt"})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!((s.last_request().sampling.mirostat, s.last_request().sampling.chain.len()), (2, 2));
    // The token-count routes take the same bodies (and drop the settings, which change no count).
    for (route, body) in [
        ("/v1/messages/count_tokens", json!({"messages": [{"role": "user", "content": "hi"}], "dry_multiplier": 0.8})),
        (
            "/v1/chat/completions/input_tokens",
            json!({"messages": [{"role": "user", "content": "hi"}], "samplers": ["top_k"]}),
        ),
        ("/v1/responses/input_tokens", json!({"input": "hi", "typical_p": 0.5})),
    ] {
        let (status, v) = s.post(route, body).await;
        assert_eq!(status, 200, "{route}: {v}");
    }
    let (status, v) = s.post("/tokenize", json!({"content": "hi", "dry_multiplier": 0.8})).await;
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("routes that generate"), "{v}");
    let (status, v) = s.post("/v1/completions", json!({"prompt": "x", "grammar": "root ::= \"yes\""})).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("grammar")), "{v}");
    let webui = json!({"prompt": "x", "n_predict": 2, "mirostat": 0, "mirostat_tau": 5, "typical_p": 1, "dry_multiplier": 0,
        "dry_base": 1.75, "xtc_probability": 0, "xtc_threshold": 0.1, "samplers": "edskypmxt", "id_slot": -1, "n_keep": 0});
    let (status, v) = s.post("/completion", webui).await;
    assert_eq!(status, 200, "{v}");
    let (status, _) = s
        .post(
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "user": "u-1", "store": false}),
        )
        .await;
    assert_eq!(status, 200);
    // What llama.cpp's web UI sends with its defaults.
    let webui_chat = json!({"messages": [{"role": "user", "content": "hi"}], "stream": true, "typ_p": 1, "reasoning_format": "auto",
        "backend_sampling": false, "samplers": ["top_k", "typ_p", "top_p", "min_p", "temperature"], "prompt_cache_key": "k",
        "dry_multiplier": 0, "xtc_probability": 0, "timings_per_token": true, "return_progress": true,
        "chat_template_kwargs": {"enable_thinking": false}});
    let (status, body, _) = s.post_text("/v1/chat/completions", webui_chat).await;
    assert_eq!(status, 200, "{body}");
    assert!(body.ends_with("data: [DONE]\n\n") && !body.contains("\"error\""), "{body}");
    let bogus = json!({"messages": [{"role": "user", "content": "hi"}], "reasoning_format": "harmony"});
    let (status, v) = s.post("/v1/chat/completions", bogus).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("reasoning_format")), "{v}");
}

#[tokio::test]
async fn prompt_over_the_context_is_400_with_the_numbers() {
    let s = start().await;
    let long = "word ".repeat(100);
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": long}]})).await;
    assert_eq!(status, 400);
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(msg.contains("context size is 64") && msg.contains("tokens"), "{msg}");
    let (status, v) =
        s.post("/v1/messages", json!({"max_tokens": 5, "messages": [{"role": "user", "content": long}]})).await;
    assert_eq!((status, v["type"].as_str()), (400, Some("error")));
    // In Anthropic's words, which its clients look for (to compact a conversation).
    let m = v["error"]["message"].as_str().unwrap();
    assert!(m.starts_with("prompt is too long: ") && m.ends_with(" tokens > 63 maximum"), "{v}");
    // llama-server's own type, with both numbers as fields.
    let (status, v) = s.post("/completion", json!({"prompt": long})).await;
    let e = &v["error"];
    assert_eq!((status, e["type"].as_str(), e["n_ctx"].as_u64()), (400, Some("exceed_context_size_error"), Some(64)));
    assert!(e["n_prompt_tokens"].as_u64().unwrap() >= 64, "{v}");
}

#[tokio::test]
async fn api_keys_by_bearer_or_x_api_key_and_health_stays_public() {
    let s =
        start_with(ServerConfig { api_keys: vec!["k1".into(), "k2".into()], ..config() }, Fake::default(), true).await;
    let chat = json!({"messages": [{"role": "user", "content": "hi"}]});
    let r = s.client.post(s.url("/v1/chat/completions")).json(&chat).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let v: Value = r.json().await.unwrap();
    assert_eq!(
        (v["error"]["type"].as_str(), v["error"]["code"].as_str()),
        (Some("authentication_error"), Some("invalid_api_key"))
    );
    let r = s.client.post(s.url("/v1/chat/completions")).bearer_auth("wrong").json(&chat).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = s.client.post(s.url("/v1/chat/completions")).bearer_auth("k2").json(&chat).send().await.unwrap();
    assert_eq!(r.status(), 200);
    // The key alone, without `Bearer`, as llama-server takes it.
    let r =
        s.client.post(s.url("/v1/chat/completions")).header("Authorization", "k2").json(&chat).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let msg = json!({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]});
    let r = s.client.post(s.url("/v1/messages")).json(&msg).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let v: Value = r.json().await.unwrap();
    assert_eq!((v["type"].as_str(), v["error"]["type"].as_str()), (Some("error"), Some("authentication_error")));
    let r = s.client.post(s.url("/v1/messages")).header("x-api-key", "k1").json(&msg).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(s.get("/health").await.0, 200);
    // The model list needs the key, as current llama-server's and OpenAI's, as one model's details do.
    assert_eq!(
        (s.get("/v1/models").await.0, s.get("/models").await.0, s.get("/v1/models/tiny").await.0),
        (401, 401, 401)
    );
    let r = s.client.get(s.url("/v1/models")).bearer_auth("k1").send().await.unwrap();
    assert_eq!(r.status(), 200);
    // Slot actions need --slot-save-path in llama-server, which is refused here: its answer without it.
    let r = s.client.post(s.url("/slots/0?action=erase")).bearer_auth("k1").send().await.unwrap();
    assert_eq!(r.status(), 501);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "not_supported_error", "{v}");
    // So does changing global properties (`--props`).
    let r = s.client.post(s.url("/props")).bearer_auth("k1").json(&json!({})).send().await.unwrap();
    assert_eq!(r.status(), 501);
    assert_eq!(s.get("/v1/models/tiny").await.0, 401);
    assert_eq!(s.get("/slots").await.0, 401);
}

#[tokio::test]
async fn oversized_bodies_get_413_in_the_dialect_shape() {
    let s = start().await;
    let big = "x".repeat(100 * 1024);
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": [{"role": "user", "content": big}]})).await;
    assert_eq!((status, v["error"]["type"].as_str()), (413, Some("invalid_request_error")), "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("--max-body-bytes"), "{v}");
    let (status, v) =
        s.post("/v1/messages", json!({"max_tokens": 1, "messages": [{"role": "user", "content": big}]})).await;
    assert_eq!((status, v["error"]["type"].as_str()), (413, Some("request_too_large")), "{v}");
    let (status, v) = s.post("/completion", json!({"prompt": big})).await;
    assert_eq!((status, v["error"]["code"].as_u64()), (413, Some(413)), "{v}");
}

/// A scored prompt whose scores never came (cut by `--timeout` or shutdown first; the Fake never
/// scores) is an error, whole or streamed, not an answer that lacks them.
#[tokio::test]
async fn an_echoed_prompt_cut_before_its_scores_is_an_error() {
    let s = start().await;
    let body = json!({"prompt": "hello there", "max_tokens": 1, "logprobs": 1, "echo": true});
    let (status, v) = s.post("/v1/completions", body.clone()).await;
    assert_eq!(status, 504, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("before its prompt was scored"), "{v}");
    let mut streamed = body;
    streamed["stream"] = json!(true);
    let (status, text, _) = s.post_text("/v1/completions", streamed).await;
    assert_eq!(status, 200);
    assert!(text.contains("before its prompt was scored") && !text.contains("\"text\":\"hello there\""), "{text}");
    // Echo alone needs no scores.
    let (status, v) = s.post("/v1/completions", json!({"prompt": "hello there", "max_tokens": 1, "echo": true})).await;
    assert_eq!((status, v["choices"][0]["text"].as_str().map(|t| t.starts_with("hello there"))), (200, Some(true)));
}

/// `--host` takes llama-server's forms: several addresses, comma-separated, and Unix sockets
/// (`PATH.sock`), whose file a stopped server leaves behind is taken over.
#[cfg(unix)]
#[tokio::test]
async fn listens_on_unix_sockets_and_several_addresses() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("mlxcel.sock");
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    assert!(sock.exists(), "a stale socket file");
    let hosts = format!("{},127.0.0.1", sock.display());
    let listeners = listen::Listener::bind_all(&hosts, 0).await.unwrap();
    let urls: Vec<String> = listeners.iter().map(|l| l.url("http")).collect();
    assert_eq!(urls[0], format!("unix://{}", sock.display()));
    let tcp = urls[1].clone();
    let state = AppState::new(config());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let done = tokio::spawn(listen::serve(
        listeners,
        None,
        router(state),
        listen::READ_TIMEOUT,
        async {
            let _ = stopped.await;
        },
        || {},
    ));
    let mut unix = tokio::net::UnixStream::connect(&sock).await.unwrap();
    unix.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut got = String::new();
    unix.read_to_string(&mut got).await.unwrap();
    // (No model is loaded here: the health route answers that it is loading.)
    assert!(got.starts_with("HTTP/1.1 503") && got.contains("Loading model"), "{got}");
    let r = reqwest::get(format!("{tcp}/health")).await.unwrap();
    assert_eq!(r.status(), 503);
    // A second server on the same socket is refused while the first listens.
    let e = listen::Listener::bind_all(sock.to_str().unwrap(), 0).await.err().unwrap();
    assert!(e.to_string().contains("another server"), "{e}");
    let _ = stop.send(());
    done.await.unwrap();
    assert!(!sock.exists(), "the socket file is removed at the end");
    // A file that is not a socket is never replaced.
    std::fs::write(&sock, "data").unwrap();
    let e = listen::Listener::bind_all(sock.to_str().unwrap(), 0).await.err().unwrap();
    assert!(e.to_string().contains("not a socket"), "{e}");
}

/// A client that sends half a request and stalls loses its connection after the read timeout
/// (`--timeout` here): a half-sent head is closed, a half-sent body answered 408.
#[tokio::test]
async fn requests_that_stop_arriving_are_dropped() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut c = config();
    c.timeout = Some(std::time::Duration::from_secs(1));
    let s = start_with(c, Fake::default(), true).await;
    let addr = s.base.trim_start_matches("http://").to_string();
    let send = |bytes: &'static [u8]| {
        let addr = addr.clone();
        async move {
            let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            tcp.write_all(bytes).await.unwrap();
            let mut got = Vec::new();
            let read = tokio::time::timeout(std::time::Duration::from_secs(10), tcp.read_to_end(&mut got)).await;
            assert!(read.is_ok(), "the connection was still open after 10 s");
            String::from_utf8_lossy(&got).into_owned()
        }
    };
    assert_eq!(send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n").await, "");
    let got = send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"mess").await;
    assert!(got.starts_with("HTTP/1.1 408"), "{got}");
    assert!(got.contains("stopped arriving"), "{got}");
}

#[tokio::test]
async fn unknown_routes_wrong_methods_and_cors_preflight() {
    let s = start().await;
    let (status, body) = s.get("/v1/nothing").await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((status, v["error"]["type"].as_str()), (404, Some("not_found_error")));
    let (status, body) = s.get("/v1/chat/completions").await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(status, 405);
    assert!(v["error"]["message"].is_string());
    let r = s
        .client
        .request(reqwest::Method::OPTIONS, s.url("/v1/chat/completions"))
        .header("Origin", "http://example.test")
        .header("Access-Control-Request-Method", "POST")
        .header("Access-Control-Request-Headers", "authorization, content-type")
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    // llama-server's defaults: any origin, with credentials, so the origin is named back.
    assert_eq!(r.headers()["access-control-allow-origin"], "http://example.test");
    assert_eq!(r.headers()["access-control-allow-credentials"], "true");
    // The requested headers named back (a browser does not count `Authorization` as covered by `*`).
    let allowed = r.headers()["access-control-allow-headers"].to_str().unwrap().to_ascii_lowercase();
    assert!(allowed.contains("authorization") && allowed.contains("content-type"), "{allowed}");
    let r = s.client.get(s.url("/health")).header("Origin", "http://example.test").send().await.unwrap();
    assert_eq!(r.headers()["access-control-allow-origin"], "http://example.test");

    // `--cors-origins localhost --no-cors-credentials`: other origins get no grant.
    let mut c = config();
    c.cors = super::cors::CorsConfig::parse("localhost", "GET, POST", "*", false).unwrap();
    let s = start_with(c, Fake::default(), true).await;
    let preflight = |origin: &'static str| {
        s.client
            .request(reqwest::Method::OPTIONS, s.url("/v1/chat/completions"))
            .header("Origin", origin)
            .header("Access-Control-Request-Method", "POST")
            .send()
    };
    let r = preflight("http://localhost:5173").await.unwrap();
    assert_eq!(r.headers()["access-control-allow-origin"], "http://localhost:5173");
    assert!(r.headers().get("access-control-allow-credentials").is_none());
    assert_eq!(r.headers()["access-control-allow-methods"], "GET,POST");
    let r = preflight("http://example.test").await.unwrap();
    assert!(r.headers().get("access-control-allow-origin").is_none());
}

/// At shutdown the engine fails the answers that never started: beside one that had, the client
/// keeps it (the others are empty and cut short); with none started it is a 503.
#[tokio::test]
async fn shutdown_keeps_the_answers_that_started() {
    let ask = json!({"messages": [{"role": "user", "content": "hi"}], "n": 2});
    let fake = Fake { fail_from: Some((1, EngineError::ShuttingDown)), ..Default::default() };
    let s = start_with(config(), fake, true).await;
    let (status, v) = s.post("/v1/chat/completions", ask.clone()).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], ANSWER.concat(), "{v}");
    assert_eq!(
        (v["choices"][1]["message"]["content"].as_str(), v["choices"][1]["finish_reason"].as_str()),
        (Some(""), Some("length")),
        "{v}"
    );
    let fake = Fake { fail_from: Some((0, EngineError::ShuttingDown)), ..Default::default() };
    let s = start_with(config(), fake, true).await;
    let (status, v) = s.post("/v1/chat/completions", ask).await;
    assert_eq!(status, 503, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("shutting down"), "{v}");
}

/// The same in a stream of several answers: the ones that never started end empty and cut short
/// beside the one that had; with none started, the stream ends in the error.
#[tokio::test]
async fn a_stream_at_shutdown_keeps_the_answers_that_started() {
    let ask = json!({"messages": [{"role": "user", "content": "hi"}], "n": 2, "stream": true});
    let fake = Fake { fail_from: Some((1, EngineError::ShuttingDown)), ..Default::default() };
    let s = start_with(config(), fake, true).await;
    let (status, body, _) = s.post_text("/v1/chat/completions", ask.clone()).await;
    assert_eq!(status, 200, "{body}");
    let events = sse(&body);
    assert_eq!(events.last().map(|e| e.1.as_str()), Some("[DONE]"), "{body}");
    let chunks: Vec<Value> = events.iter().filter_map(|e| serde_json::from_str(&e.1).ok()).collect();
    assert!(chunks.iter().all(|c| c.get("error").is_none()), "{body}");
    let of = |index: u64| {
        chunks
            .iter()
            .flat_map(|c| c["choices"].as_array().cloned().unwrap_or_default())
            .filter(move |c| c["index"] == index)
    };
    let text: String = of(0).filter_map(|c| c["delta"]["content"].as_str().map(str::to_string)).collect();
    assert_eq!(text, ANSWER.concat(), "{body}");
    assert!(of(1).all(|c| c["delta"]["content"].as_str().is_none_or(str::is_empty)), "{body}");
    let finish: Vec<Value> = of(1).map(|c| c["finish_reason"].clone()).filter(|f| !f.is_null()).collect();
    assert_eq!(finish, vec![json!("length")], "{body}");
    // The answer that never started counts as failed, as it does unstreamed.
    let (_, metrics) = s.get("/metrics").await;
    assert!(metrics.contains("mlxcel_requests_failed_total 1\n"), "{metrics}");

    let fake = Fake { fail_from: Some((0, EngineError::ShuttingDown)), ..Default::default() };
    let s = start_with(config(), fake, true).await;
    let (_, body, _) = s.post_text("/v1/chat/completions", ask).await;
    let errors: Vec<Value> = sse(&body)
        .iter()
        .filter_map(|e| serde_json::from_str::<Value>(&e.1).ok())
        .filter(|c| c.get("error").is_some())
        .collect();
    assert_eq!(errors.len(), 1, "{body}");
    assert!(errors[0]["error"]["message"].as_str().unwrap().contains("shutting down"), "{body}");
}

#[tokio::test]
async fn a_full_queue_is_503_with_retry_after_and_529_for_anthropic() {
    let fake = Fake { refuse: Mutex::new(Some(EngineError::QueueFull { queued: 3 })), ..Default::default() };
    let s = start_with(config(), fake, true).await;
    let (status, body, headers) =
        s.post_text("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}]})).await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(headers["retry-after"], "1");
    let (status, body, _) =
        s.post_text("/v1/messages", json!({"max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    // Anthropic's status for "overloaded", which its SDK retries.
    assert_eq!((status, v["error"]["type"].as_str()), (529, Some("overloaded_error")));
}

#[tokio::test]
async fn a_client_that_leaves_mid_stream_cancels_its_request() {
    let s = start_with(config(), Fake { slow_ms: 20, ..Default::default() }, true).await;
    let mut r = s
        .client
        .post(s.url("/v1/chat/completions"))
        .json(&json!({"messages": [{"role": "user", "content": "hi"}], "stream": true}))
        .send()
        .await
        .unwrap();
    let first = r.chunk().await.unwrap().unwrap();
    assert!(first.starts_with(b"data: "));
    drop(r);
    for _ in 0..200 {
        if s.fake.cancelled.load(Ordering::SeqCst) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(s.fake.cancelled.load(Ordering::SeqCst), "the engine stream was not dropped");
    assert_eq!(s.get("/health").await.0, 200, "the server keeps serving");
}

#[tokio::test]
async fn shutdown_lets_a_running_stream_finish_and_stops_accepting() {
    let mut s = start().await;
    let r = s
        .client
        .post(s.url("/v1/messages"))
        .json(&json!({"max_tokens": 10, "stream": true, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    s.stop.take().unwrap().send(()).unwrap();
    let body = r.text().await.unwrap();
    assert!(body.contains("event: message_stop"), "{body}");
    tokio::time::timeout(Duration::from_secs(5), &mut s.done).await.expect("serve returns after shutdown").unwrap();
    assert!(s.client.get(s.url("/health")).send().await.is_err(), "no longer accepting");
}

#[tokio::test]
async fn https_with_a_pem_certificate() {
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    let made = std::process::Command::new("openssl")
        .args(["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1"])
        .args(["-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"])
        .args(["-addext", "basicConstraints=critical,CA:FALSE", "-addext", "extendedKeyUsage=serverAuth"])
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .output();
    if !made.is_ok_and(|o| o.status.success()) {
        eprintln!("skipping: the openssl command is needed to make a test certificate");
        return;
    }
    let acceptor = listen::tls_acceptor(&cert, &key).unwrap();
    let state = AppState::new(config());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(listen::serve(
        vec![listen::Listener::Tcp(listener)],
        Some(acceptor),
        router(state),
        listen::READ_TIMEOUT,
        std::future::pending(),
        || {},
    ));
    let ca = reqwest::Certificate::from_pem(&std::fs::read(&cert).unwrap()).unwrap();
    let client = reqwest::Client::builder().add_root_certificate(ca).build().unwrap();
    let r = client.get(format!("https://localhost:{port}/health")).send().await.unwrap();
    // No model in this state: the TLS path works when /health answers its loading 503.
    assert_eq!(r.status(), 503);
    assert!(listen::tls_acceptor(&key, &cert).is_err(), "a key given as the certificate is refused");
}

/// A multipart form of text fields (reqwest here has no multipart feature).
fn audio_form(s: &Server, fields: &[(&str, String)]) -> reqwest::RequestBuilder {
    let mut body = String::new();
    for (k, v) in fields {
        body += &format!("--B0undary\r\nContent-Disposition: form-data; name=\"{k}\"\r\n\r\n{v}\r\n");
    }
    body += "--B0undary--\r\n";
    s.client
        .post(s.url("/v1/audio/transcriptions"))
        .header("content-type", "multipart/form-data; boundary=B0undary")
        .body(body)
}

#[tokio::test]
async fn audio_routes_on_a_text_model_are_a_400_with_their_own_body_limit() {
    let s = start().await;
    // 100 kB: over --max-body-bytes (64 KiB) but under --max-audio-bytes (256 KiB), so the route answers.
    let r = audio_form(&s, &[("model", "whisper-1".into()), ("prompt", "x".repeat(100_000))]).send().await.unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("not a speech-recognition model"), "{v}");
    let r = audio_form(&s, &[("prompt", "x".repeat(400_000))]).send().await.unwrap();
    assert_eq!(r.status(), 413);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("--max-audio-bytes"), "its own flag: {v}");

    let loading = start_with(config(), Fake::default(), false).await;
    let r = audio_form(&loading, &[("model", "whisper-1".into())]).send().await.unwrap();
    assert_eq!(r.status(), 503);
}

/// A generation that thinks first: the Fake's pieces.
const THOUGHT: [&str; 5] = ["<thi", "nk>\nFrance's capital", " is well known.\n</th", "ink>\n\n", "Paris."];

/// The `data:` payloads of a stream as JSON (without `[DONE]`).
fn chunks(body: &str) -> Vec<Value> {
    sse(body).into_iter().filter(|(_, d)| d != "[DONE]").map(|(_, d)| serde_json::from_str(&d).unwrap()).collect()
}

/// A thought at the start of the answer comes back as `reasoning_content` (OpenAI dialect, whole
/// and streamed), or left in the content with `reasoning_format: none`.
#[tokio::test]
async fn reasoning_is_split_from_the_answer() {
    let s = start_with(config(), Fake { script: Some(THOUGHT.to_vec()), ..Default::default() }, true).await;
    let hi = json!([{"role": "user", "content": "hi"}]);
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": hi})).await;
    assert_eq!(status, 200, "{v}");
    let m = &v["choices"][0]["message"];
    assert_eq!(
        (m["reasoning_content"].as_str(), m["content"].as_str()),
        (Some("France's capital is well known."), Some("Paris."))
    );
    let (_, v) = s.post("/v1/chat/completions", json!({"messages": hi, "reasoning_format": "none"})).await;
    let m = &v["choices"][0]["message"];
    assert_eq!((m.get("reasoning_content"), m["content"].as_str()), (None, Some(THOUGHT.concat().as_str())));
    let (_, v) = s.post("/v1/chat/completions", json!({"messages": hi, "reasoning_format": "deepseek-legacy"})).await;
    let m = &v["choices"][0]["message"];
    assert_eq!(
        (m["reasoning_content"].as_str(), m["content"].as_str()),
        (Some("France's capital is well known."), Some(THOUGHT.concat().as_str()))
    );

    let (status, body, _) = s.post_text("/v1/chat/completions", json!({"messages": hi, "stream": true})).await;
    assert_eq!(status, 200);
    let (mut reasoning, mut content) = (String::new(), String::new());
    for c in chunks(&body) {
        let d = &c["choices"][0]["delta"];
        reasoning += d["reasoning_content"].as_str().unwrap_or("");
        content += d["content"].as_str().unwrap_or("");
        assert!(
            c.get("timings").is_none() || c["choices"][0]["finish_reason"].is_string(),
            "no per-token timings unasked: {c}"
        );
    }
    assert_eq!((reasoning.as_str(), content.as_str()), ("France's capital is well known.", "Paris."));
}

/// Anthropic: the thought is a `thinking` block before the text (whole and streamed, with its
/// signature delta), thinking blocks in the history reach the template, and `thinking: disabled`
/// turns the template's thinking off.
#[tokio::test]
async fn anthropic_thinking_blocks() {
    let s = start_with(config(), Fake { script: Some(THOUGHT.to_vec()), ..Default::default() }, true).await;
    let hi = json!([{"role": "user", "content": "hi"}]);
    let (status, v) = s.post("/v1/messages", json!({"max_tokens": 20, "messages": hi})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v["content"],
        json!([{"type": "thinking", "thinking": "France's capital is well known.", "signature": ""}, {"type": "text", "text": "Paris."}])
    );
    let (status, body, _) =
        s.post_text("/v1/messages", json!({"max_tokens": 20, "messages": hi, "stream": true})).await;
    assert_eq!(status, 200);
    let events: Vec<Value> = sse(&body).into_iter().map(|(_, d)| serde_json::from_str(&d).unwrap()).collect();
    let kinds: Vec<String> = events
        .iter()
        .map(|e| {
            let t = e["type"].as_str().unwrap().to_string();
            match (e["index"].as_u64(), e["delta"]["type"].as_str(), e["content_block"]["type"].as_str()) {
                (Some(i), Some(d), _) => format!("{t}[{i}]:{d}"),
                (Some(i), None, Some(b)) => format!("{t}[{i}]:{b}"),
                (Some(i), _, _) => format!("{t}[{i}]"),
                _ => t,
            }
        })
        .collect();
    let want = [
        "message_start",
        "content_block_start[0]:thinking",
        "ping",
        "content_block_delta[0]:thinking_delta",
        "content_block_delta[0]:thinking_delta",
        "content_block_delta[0]:signature_delta",
        "content_block_stop[0]",
        "content_block_start[1]:text",
        "content_block_delta[1]:text_delta",
        "content_block_stop[1]",
        "message_delta",
        "message_stop",
    ];
    assert_eq!(kinds, want);
    let thought: String = events.iter().filter_map(|e| e["delta"]["thinking"].as_str()).collect();
    assert_eq!(thought, "France's capital is well known.");
    // llama-server's reasoning_format here too: none leaves the thought in the text.
    let (_, v) = s.post("/v1/messages", json!({"max_tokens": 20, "messages": hi, "reasoning_format": "none"})).await;
    assert_eq!(v["content"], json!([{"type": "text", "text": THOUGHT.concat()}]), "{v}");

    let history = json!([
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "x"}, {"type": "redacted_thinking", "data": "x"}, {"type": "text", "text": "Hello"}]},
        {"role": "user", "content": "again"}
    ]);
    let (status, v) =
        s.post("/v1/messages", json!({"max_tokens": 5, "messages": history, "thinking": {"type": "disabled"}})).await;
    assert_eq!(status, 200, "{v}");
    let user_thinking = json!([{"role": "user", "content": [{"type": "thinking", "thinking": "t", "signature": "x"}]}]);
    let (status, v) = s.post("/v1/messages", json!({"max_tokens": 5, "messages": user_thinking})).await;
    assert_eq!((status, v["error"]["type"].as_str()), (400, Some("invalid_request_error")), "{v}");
    // A thinking budget caps the thought (the engine closes it once spent); it must leave room for
    // the answer, as Anthropic requires.
    let budget = json!({"max_tokens": 5, "messages": hi, "thinking": {"type": "enabled", "budget_tokens": 1024}});
    let (status, v) = s.post("/v1/messages", budget).await;
    assert_eq!((status, v["error"]["type"].as_str()), (400, Some("invalid_request_error")), "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("less than max_tokens (5)"), "{v}");
    let budget = json!({"max_tokens": 50, "messages": hi, "thinking": {"type": "enabled", "budget_tokens": 16}});
    let (status, v) = s.post("/v1/messages", budget).await;
    assert_eq!(status, 200, "{v}");
    let b = s.last_request().thought_budget.unwrap();
    assert_eq!((b.budget, b.open_at_start), (16, false));
    let tok = s.fake.text.as_ref().unwrap();
    assert_eq!(tok.decode(&b.close).unwrap(), "\n</think>\n\n");
    let (status, _) =
        s.post("/v1/messages", json!({"max_tokens": 50, "messages": hi, "thinking": {"type": "adaptive"}})).await;
    assert_eq!((status, s.last_request().thought_budget), (200, None));
}

/// llama-server's stream extras in all three of its dialects: prompt-progress chunks before the
/// text (`return_progress`), `timings` in every chunk (`timings_per_token`), the serving slot.
#[tokio::test]
async fn stream_progress_and_per_token_timings() {
    let s = start().await;
    let extras = json!({"stream": true, "timings_per_token": true, "return_progress": true});
    let with = |mut body: Value| {
        for (k, v) in extras.as_object().unwrap() {
            body[k] = v.clone();
        }
        body
    };
    for (path, body) in [
        ("/v1/chat/completions", with(json!({"messages": [{"role": "user", "content": "hi"}]}))),
        ("/v1/completions", with(json!({"prompt": "hello there"}))),
        ("/completion", with(json!({"prompt": "hello there"}))),
    ] {
        let (status, text, _) = s.post_text(path, body).await;
        assert_eq!(status, 200, "{path}: {text}");
        let got = chunks(&text);
        let total = s.last_request().prompt.len() as u64;
        let progress: Vec<&Value> = got.iter().filter_map(|c| c.get("prompt_progress")).collect();
        // From what the cache served, then after each of the Fake's two prompt chunks.
        assert_eq!(progress.len(), 3, "{path}: {text}");
        assert_eq!(progress[0]["processed"].as_u64(), Some(2), "{path}");
        assert_eq!(progress[2]["processed"].as_u64(), Some(total), "{path}");
        assert_eq!((progress[0]["total"].as_u64(), progress[0]["cache"].as_u64()), (Some(total), Some(2)), "{path}");
        let first_text =
            got.iter().position(|c| c.get("prompt_progress").is_none() && c.to_string().contains("capital"));
        let last_progress = got.iter().rposition(|c| c.get("prompt_progress").is_some());
        assert!(last_progress < first_text, "{path}: progress comes before the text");
        let texts: Vec<&Value> = got.iter().filter(|c| c.to_string().contains("France")).collect();
        assert!(!texts.is_empty());
        for c in texts {
            let t = &c["timings"];
            assert!(
                t["predicted_n"].as_u64().unwrap() >= 1 && t["prompt_n"].as_u64() == Some(total - 2),
                "{path}: {c}"
            );
            // One token has no generation rate yet.
            if t["predicted_n"] == 1 {
                assert_eq!(t["predicted_per_second"], 0.0, "{path}: {c}");
            }
        }
        if path == "/completion" {
            assert!(got.iter().all(|c| c["id_slot"] == 1), "{text}");
        }
    }
    // Progress can only be streamed.
    let (status, v) = s.post("/completion", json!({"prompt": "x", "return_progress": true})).await;
    assert_eq!((status, v["error"]["type"].as_str()), (400, Some("invalid_request_error")), "{v}");
    // Several prompts stream together, each chunk saying which.
    let (status, text, _) = s.post_text("/completion", json!({"prompt": ["a", "b"], "stream": true})).await;
    assert_eq!(status, 200);
    let got = chunks(&text);
    for i in 0..2 {
        let mine: String = got.iter().filter(|c| c["index"] == i).map(|c| c["content"].as_str().unwrap()).collect();
        assert_eq!(mine, ANSWER.concat());
        assert_eq!(got.iter().filter(|c| c["index"] == i && c["stop"] == true).count(), 1);
    }
}

/// A ChatML template that takes tools the way Qwen2.5's does (Hermes `<tool_call>` tags).
const HERMES: &str = "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n{% endif %}{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n{% elif m.tool_calls %}<|im_start|>assistant\n{{ m.content }}{% for c in m.tool_calls %}<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

const CALLS: [&str; 4] = [
    "I'll check.",
    "\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool",
    "_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>",
    "\n",
];

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    ])
}

async fn start_tools() -> Server {
    start_templated(config(), Fake { script: Some(CALLS.to_vec()), ..Default::default() }, true, HERMES, 2048).await
}

impl Server {
    /// The last request's prompt as text.
    fn last_prompt(&self) -> String {
        self.fake.text.as_ref().unwrap().decode(&self.last_request().prompt).unwrap()
    }

    /// The last prompt holds a `get_weather` call for Paris and its result, "22 C", as the Hermes
    /// template writes them.
    fn assert_weather_call_and_result_rendered(&self) {
        let prompt = self.last_prompt();
        let call = "<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}</tool_call>";
        assert!(prompt.contains(call), "{prompt}");
        assert!(prompt.contains("<tool_response>22 C</tool_response>"), "{prompt}");
    }
}

/// The test tokenizer with Qwen2.5-Coder's fill-in-the-middle tokens (special) added.
fn fim_tokenizer() -> Arc<TextTokenizer> {
    let mut t = Arc::try_unwrap(tokenizer()).ok().unwrap();
    let names = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"];
    let added: Vec<tokenizers::AddedToken> = names.iter().map(|n| tokenizers::AddedToken::from(*n, true)).collect();
    t.inner.add_special_tokens(&added);
    Arc::new(t)
}

/// llama-server's `/infill`: the editor's extra files, prefix, prompt and suffix framed by the
/// model's FIM tokens in llama-server's order, the FIM separators ending the answer; a model without
/// FIM tokens is told so (501), and the FIM fields are refused on `/completion`.
#[tokio::test]
async fn infill_frames_the_code_with_fim_tokens() {
    // (Extra files take what the context leaves past a batch and twice n_predict.)
    let s = start_tokenized(
        ServerConfig { batch_size: 512, ..config() },
        Fake::default(),
        true,
        CHATML,
        2048,
        fim_tokenizer(),
    )
    .await;
    let body = json!({"input_prefix": "def add(a, b):\n    ", "input_suffix": "\n\nprint(add(1, 2))\n", "prompt": "return",
        "input_extra": [{"filename": "util.py", "text": "X = 1\n", "time": 1733450000}], "n_predict": 8});
    let (status, v) = s.post("/infill", body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["content"], ANSWER.concat());
    let tok = s.fake.text.as_ref().unwrap();
    let id = |n: &str| tok.inner.token_to_id(n).unwrap();
    let r = s.last_request();
    let shown = tok.inner.decode(&r.prompt, false).unwrap();
    assert_eq!(
        shown,
        tok.inner
            .decode(
                &tok.encode(
                    "<|repo_name|>myproject\n<|file_sep|>util.py\nX = 1\n<|file_sep|>filename\n<|fim_prefix|>def add(a, b):\n    return<|fim_suffix|>\n\nprint(add(1, 2))\n<|fim_middle|>",
                    false
                )
                .unwrap(),
                false
            )
            .unwrap()
    );
    assert_eq!(r.prompt.last(), Some(&id("<|fim_middle|>")));
    // (The fixture's <|endoftext|> and <|im_end|> end every fill too, as in llama.cpp.)
    let ends = ["<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<|endoftext|>", "<|im_end|>"].map(id);
    assert_eq!(r.end_tokens, ends);
    assert_eq!(v["prompt"], shown);
    // Special-token names in the code are text, not tokens.
    let (status, _) = s.post("/infill", json!({"input_prefix": "<|fim_middle|>", "input_suffix": ""})).await;
    assert_eq!(status, 200);
    assert_eq!(s.last_request().prompt.iter().filter(|&&t| t == id("<|fim_middle|>")).count(), 1);
    // Streamed as /completion streams.
    let (status, body, _) =
        s.post_text("/infill", json!({"input_prefix": "x = ", "input_suffix": "", "stream": true})).await;
    assert_eq!(status, 200);
    assert!(body.contains("\"stop\":true"), "{body}");

    for (body, param) in [
        (json!({"input_prefix": "a", "input_suffix": "", "prompt": [1, 2]}), "prompt"),
        (json!({"input_prefix": "a", "input_suffix": "", "input_extra": [{"filename": "f"}]}), "input_extra[0]"),
        (json!({"input_prefix": "a"}), "input_suffix"),
        (json!({"input_prefix": "a", "input_suffix": "", "add_special": true}), "add_special"),
    ] {
        let (status, v) = s.post("/infill", body).await;
        assert_eq!(status, 400, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(param.split('[').next().unwrap()), "{v}");
    }
    let (status, v) = s.post("/completion", json!({"prompt": "a", "input_prefix": "b"})).await;
    assert_eq!((status, v["error"]["message"].as_str().map(|m| m.contains("/infill"))), (400, Some(true)), "{v}");
    let (status, v) = s.post("/completion", json!({"n_predict": 2})).await;
    assert_eq!(status, 400, "{v}");

    // llama.vim's requests, as it sends them: its fill (with llama.cpp's infill sampler, n_indent and
    // a time limit), its cache warm-up, and its chat warm-up.
    let fields = [
        "content",
        "timings/prompt_n",
        "timings/prompt_ms",
        "timings/prompt_per_token_ms",
        "timings/prompt_per_second",
        "timings/predicted_n",
        "timings/predicted_ms",
        "timings/predicted_per_token_ms",
        "timings/predicted_per_second",
        "truncated",
        "tokens_cached",
    ];
    let fill = json!({"id_slot": 0, "input_prefix": "def f():\n", "input_suffix": "\n", "prompt": "    ",
        "input_extra": [{"text": "X = 1\n", "time": 12.5, "filename": "a.py"}], "n_predict": 128, "stop": [],
        "n_indent": 4.0, "top_k": 40, "top_p": 0.90, "samplers": ["top_k", "top_p", "infill"], "stream": false,
        "cache_prompt": true, "t_max_prompt_ms": 500, "t_max_predict_ms": 250, "response_fields": fields});
    let (status, v) = s.post("/infill", fill).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["content"], ANSWER.concat());
    assert!(v["timings/prompt_n"].is_u64() && v.get("timings").is_none(), "{v}");
    let r = s.last_request();
    let p = &r.sampling;
    assert_eq!((p.infill(), p.top_k, p.top_p), (true, 40, 0.9));
    assert_eq!(p.chain, [Step::TopK, Step::TopP, Step::Infill]);
    assert_eq!(r.code_limits, CodeLimits::new(4, Some(Duration::from_millis(250))));
    let warm = json!({"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": [], "prompt": "",
        "n_predict": 0, "temperature": 0.0, "samplers": [], "stream": false, "cache_prompt": true,
        "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""]});
    let (status, v) = s.post("/infill", warm).await;
    assert_eq!((status, v), (200, json!({})));
    let chat = json!({"id_slot": 3, "messages": [{"role": "user", "content": "hi"}], "samplers": ["min_p", "temperature"],
        "min_p": 0.1, "temperature": 0.1, "n_predict": 0, "stream": false, "cache_prompt": true, "response_fields": [""]});
    let (status, v) = s.post("/v1/chat/completions", chat).await;
    assert_eq!(status, 200, "{v}");
    let p = &s.last_request().sampling;
    assert_eq!((p.min_p, p.temperature, p.infill()), (0.1, 0.1, false));
    assert_eq!(p.chain, [Step::MinP, Step::Temperature]);
    // The infill sampler compares every pair of candidates: it needs a top-k before it.
    let (status, v) =
        s.post("/infill", json!({"input_prefix": "", "input_suffix": "", "samplers": ["top_p", "infill"]})).await;
    assert_eq!((status, v["error"]["message"].as_str().map(|m| m.contains("top_k"))), (400, Some(true)), "{v}");

    let plain = start_templated(config(), Fake::default(), true, CHATML, 2048).await;
    let (status, v) = plain.post("/infill", json!({"input_prefix": "a", "input_suffix": "b"})).await;
    assert_eq!(status, 501, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("prefix token is missing"), "{v}");
    assert_eq!(v["error"]["type"], "not_supported_error");
}

/// llama-server's `n_cmpl` (and `n`): several answers per prompt, each its own sequence with its own
/// seed, listed prompt by prompt — llama.vscode's fill, as it sends it, asks for three.
#[tokio::test]
async fn n_cmpl_answers_each_prompt_several_times() {
    let s =
        start_tokenized(ServerConfig { parallel: 4, ..config() }, Fake::default(), true, CHATML, 2048, fim_tokenizer())
            .await;
    let fill = json!({"id_slot": 0, "input_prefix": "def f():\n", "input_suffix": "\n", "input_extra": [],
        "prompt": "    ", "n_predict": 128, "n_cmpl": 3, "top_k": 40, "top_p": 0.99, "stream": false,
        "samplers": ["top_k", "top_p", "infill"], "cache_prompt": true, "n_indent": 4,
        "t_max_prompt_ms": 500, "t_max_predict_ms": 1000});
    let (status, v) = s.post("/infill", fill).await;
    assert_eq!(status, 200, "{v}");
    let answers = v.as_array().expect("a list of answers");
    assert_eq!(answers.iter().map(|a| a["index"].as_u64().unwrap()).collect::<Vec<_>>(), [0, 1, 2]);
    assert!(answers.iter().all(|a| a["content"] == ANSWER.concat()), "{v}");
    let reqs = s.fake.requests.lock().unwrap().clone();
    assert_eq!(reqs.len(), 3);
    assert!(reqs.iter().all(|r| r.prompt == reqs[0].prompt && r.sampling.infill()));

    // Two prompts, two answers each (`n`, n_cmpl's other name), seeds moved on per answer.
    let (status, v) = s.post("/completion", json!({"prompt": ["a", "b"], "n": 2, "seed": 7, "n_predict": 2})).await;
    assert_eq!(status, 200, "{v}");
    let seeds: Vec<Option<u64>> =
        v.as_array().unwrap().iter().map(|a| a["generation_settings"]["seed"].as_u64()).collect();
    assert_eq!(seeds, [Some(7), Some(8), Some(7), Some(8)], "{v}");
    let reqs = s.fake.requests.lock().unwrap().clone();
    let tok = s.fake.text.as_ref().unwrap();
    let asked: Vec<(String, Option<u64>)> =
        reqs[3..].iter().map(|r| (tok.decode(&r.prompt).unwrap(), r.sampling.seed)).collect();
    let want = [("a", 7), ("a", 8), ("b", 7), ("b", 8)].map(|(p, seed)| (p.to_string(), Some(seed)));
    assert_eq!(asked, want);
    // Streamed, each chunk says which answer it belongs to.
    let (status, body, _) = s.post_text("/completion", json!({"prompt": "a", "n_cmpl": 2, "stream": true})).await;
    assert_eq!(status, 200);
    assert!(body.contains("\"index\":1") && body.contains("\"index\":0"), "{body}");

    // ignore_eos bans the tokens that would end the answer (the FIM ends on /infill too), as
    // llama-server does, rather than passing over them once sampled.
    let (status, _) = s.post("/infill", json!({"input_prefix": "a", "input_suffix": "", "ignore_eos": true})).await;
    assert_eq!(status, 200);
    let r = s.last_request();
    let mut ends: Vec<u32> = tok.eos_ids.iter().chain(&r.end_tokens).copied().collect();
    let mut banned: Vec<u32> =
        r.sampling.logit_bias.iter().map(|&(id, b)| (b == f32::NEG_INFINITY).then_some(id).unwrap()).collect();
    ends.sort();
    banned.sort();
    assert_eq!((banned.len() > 1, banned), (true, ends));

    for (body, words) in [
        (json!({"prompt": "a", "n_cmpl": 5}), "please increase -np"),
        (json!({"prompt": "a", "n_cmpl": 0}), "at least 1"),
        (json!({"prompt": "a", "n": -1}), "at least 1"),
    ] {
        let (status, v) = s.post("/completion", body).await;
        assert_eq!(status, 400, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(words), "{v}");
    }
}

/// Structured outputs as each dialect asks for them: chat's `response_format` (and llama-server's
/// `json_schema`), the Responses API's `text.format`, `/completion`'s `json_schema`; a schema that
/// cannot be compiled, an unknown format, and tools beside a format are refused by name.
#[tokio::test]
async fn structured_outputs_hold_answers_to_json_schemas() {
    let s = start().await;
    let schema = json!({"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"]});
    let ask = json!([{"role": "user", "content": "hi"}]);
    for format in [
        json!({"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": true}}),
        json!({"type": "json_object"}),
    ] {
        let (status, v) = s.post("/v1/chat/completions", json!({"messages": ask, "response_format": format})).await;
        assert_eq!(status, 200, "{v}");
        assert!(s.last_request().constraint.is_some(), "{format}");
    }
    let (status, _) =
        s.post("/v1/chat/completions", json!({"messages": ask, "response_format": {"type": "text"}})).await;
    assert_eq!(status, 200);
    assert!(s.last_request().constraint.is_none());
    let (status, _) = s.post("/v1/chat/completions", json!({"messages": ask, "json_schema": schema})).await;
    assert_eq!((status, s.last_request().constraint.is_some()), (200, true));
    let (status, _) = s.post("/completion", json!({"prompt": "a", "json_schema": schema})).await;
    assert_eq!((status, s.last_request().constraint.is_some()), (200, true));
    let format = json!({"format": {"type": "json_schema", "name": "a", "schema": schema}});
    let (status, v) = s.post("/v1/responses", json!({"input": "hi", "text": format})).await;
    assert_eq!((status, s.last_request().constraint.is_some()), (200, true), "{v}");
    assert_eq!(v["text"], format);

    let bad = json!({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}, "required": ["a"]});
    for (route, body, param) in [
        (
            "/v1/chat/completions",
            json!({"messages": ask, "response_format": {"type": "json_schema", "json_schema": {"schema": bad}}}),
            "response_format",
        ),
        ("/v1/chat/completions", json!({"messages": ask, "response_format": {"type": "xml"}}), "response_format.type"),
        (
            "/v1/chat/completions",
            json!({"messages": ask, "response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}),
            "response_format.json_schema.schema",
        ),
        ("/completion", json!({"prompt": "a", "json_schema": bad}), "json_schema"),
        // A schema that only refers to itself compiles, but no text can match it.
        ("/completion", json!({"prompt": "a", "json_schema": {"$ref": "#"}}), "json_schema"),
        ("/completion", json!({"prompt": "a", "grammar": "root ::= \"a\""}), "grammar"),
        (
            "/v1/responses",
            json!({"input": "hi", "text": {"format": {"type": "json_schema", "schema": bad}}}),
            "text.format",
        ),
        (
            "/v1/messages",
            json!({"messages": ask, "max_tokens": 4, "response_format": {"type": "json_object"}}),
            "response_format",
        ),
    ] {
        let (status, v) = s.post(route, body).await;
        assert_eq!(status, 400, "{route}: {v}");
        let named = v["error"]["param"].as_str().or(v["error"]["message"].as_str()).unwrap_or_default();
        assert!(named.contains(param), "{route}: {v}");
    }
    let tools = start_tools().await;
    let body = json!({"messages": ask, "tools": weather_tools(), "response_format": {"type": "json_object"}});
    let (status, v) = tools.post("/v1/chat/completions", body).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("response_format")), "{v}");
}

/// A Qwen3-Coder-style template (XML calls).
const QWEN_CODER: &str = "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools> Call as <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// A Mistral-style template that takes only nine-character call ids, as Mistral's do.
const MISTRAL: &str = "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}{% for m in messages %}{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]{% elif m.tool_calls %}{% for c in m.tool_calls %}{% if c.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}[TOOL_CALLS]{{ c.function.name }}[CALL_ID]{{ c.id }}[ARGS]{{ c.function.arguments | tojson }}{% endfor %}</s>{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.tool_call_id }}[TOOL_CONTENT]{{ m.content }}[/TOOL_RESULTS]{% else %}{{ m.content }}</s>{% endif %}{% endfor %}";

/// An LFM2-style template, which leaves calls out of the history (the model's text holds them).
const LFM2: &str = "{% if tools %}<|im_start|>system\nList of tools: <|tool_list_start|>{{ tools | tojson }}<|tool_list_end|><|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// Calls in the other formats the server reads: Qwen3-Coder's XML (values typed by the tool's
/// schema), Mistral's `[TOOL_CALLS]name[ARGS]{…}` and LFM2's Python calls come back in each
/// dialect's shape, and their histories reach templates the way those take them.
#[tokio::test]
async fn tool_calls_in_other_formats() {
    let ask = json!([{"role": "user", "content": "Weather in Paris?"}]);
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]);
    let history = json!([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"}
    ]);
    let calls_of = |v: &Value| -> Vec<(String, Value)> {
        v["choices"][0]["message"]["tool_calls"]
            .as_array()
            .unwrap_or_else(|| panic!("no calls: {v}"))
            .iter()
            .map(|c| {
                let args = serde_json::from_str(c["function"]["arguments"].as_str().unwrap()).unwrap();
                (c["function"]["name"].as_str().unwrap().to_string(), args)
            })
            .collect()
    };

    let xml = [
        "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\n",
        "Paris\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
    ];
    let s =
        start_templated(config(), Fake { script: Some(xml.to_vec()), ..Default::default() }, true, QWEN_CODER, 2048)
            .await;
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": ask, "tools": tools})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(calls_of(&v), [("get_weather".to_string(), json!({"city": "Paris", "days": 2}))]);
    assert_eq!(
        (v["choices"][0]["message"]["content"].as_str(), v["choices"][0]["finish_reason"].as_str()),
        (Some("Sure."), Some("tool_calls"))
    );

    let mistral = ["[TOOL_CALLS]get_weather[ARGS]{\"city\": ", "\"Paris\"}"];
    let s =
        start_templated(config(), Fake { script: Some(mistral.to_vec()), ..Default::default() }, true, MISTRAL, 2048)
            .await;
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": ask, "tools": tools})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(calls_of(&v), [("get_weather".to_string(), json!({"city": "Paris"}))]);
    // The client's ids become nine characters, the call's and its result's alike.
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": history, "tools": tools})).await;
    assert_eq!(status, 200, "{v}");
    let prompt = s.last_prompt();
    let id = prompt.split("[CALL_ID]").nth(1).and_then(|r| r.split("[ARGS]").next()).unwrap_or_default().to_string();
    assert!(id.len() == 9 && prompt.contains(&format!("[TOOL_RESULTS]{id}[TOOL_CONTENT]22 C")), "{prompt}");

    let lfm2 = ["Checking.<|tool_call_start|>[get_weather(city=", "\"Paris\", days=3)]<|tool_call_end|>"];
    let s =
        start_templated(config(), Fake { script: Some(lfm2.to_vec()), ..Default::default() }, true, LFM2, 2048).await;
    let anthropic_tools = json!([{"name": "get_weather", "input_schema": tools[0]["function"]["parameters"]}]);
    let (status, v) =
        s.post("/v1/messages", json!({"max_tokens": 50, "messages": ask, "tools": anthropic_tools})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["stop_reason"], "tool_use", "{v}");
    assert_eq!(v["content"][0], json!({"type": "text", "text": "Checking."}));
    assert_eq!(
        (v["content"][1]["name"].as_str(), &v["content"][1]["input"]),
        (Some("get_weather"), &json!({"city": "Paris", "days": 3}))
    );
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": history, "tools": tools})).await;
    assert_eq!(status, 200, "{v}");
    let prompt = s.last_prompt();
    assert!(
        prompt.contains("assistant\n<|tool_call_start|>[get_weather(city=\"Paris\")]<|tool_call_end|>"),
        "{prompt}"
    );
}

/// OpenAI tool calling: the tools reach the template, the model's `<tool_call>`s come back as
/// `tool_calls` (whole and streamed), a tool-use history is rendered, and what cannot be honoured
/// (forcing a call, a template without tools) is refused by name.
#[tokio::test]
async fn openai_tool_calls() {
    let s = start_tools().await;
    let ask = json!([{"role": "user", "content": "Weather in Paris, and the time?"}]);
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": ask, "tools": weather_tools()})).await;
    assert_eq!(status, 200, "{v}");
    assert!(
        s.last_prompt().contains("<tools>{\"type\": \"function\", \"function\": {\"name\": \"get_weather\""),
        "{}",
        s.last_prompt()
    );
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    // (The break before the first call is not text.)
    assert_eq!(choice["message"]["content"], "I'll check.");
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    let named: Vec<(&str, Value)> = calls
        .iter()
        .map(|c| {
            assert!(c["id"].as_str().unwrap().starts_with("call_") && c["type"] == "function", "{c}");
            let args = serde_json::from_str(c["function"]["arguments"].as_str().unwrap()).unwrap();
            (c["function"]["name"].as_str().unwrap(), args)
        })
        .collect();
    assert_eq!(named, [("get_weather", json!({"city": "Paris"})), ("get_time", json!({}))]);

    // parallel_tool_calls: false keeps the first call.
    let one = json!({"messages": ask, "tools": weather_tools(), "parallel_tool_calls": false});
    let (_, v) = s.post("/v1/chat/completions", one).await;
    assert_eq!(v["choices"][0]["message"]["tool_calls"].as_array().map(Vec::len), Some(1), "{v}");

    // allowed_tools (auto) shows the model only those tools; a call to another is text.
    let allowed = json!({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {"name": "get_time"}}]}});
    let (status, v) = s
        .post("/v1/chat/completions", json!({"messages": ask, "tools": weather_tools(), "tool_choice": allowed}))
        .await;
    assert_eq!(status, 200, "{v}");
    assert!(!s.last_prompt().contains("get_weather"), "{}", s.last_prompt());
    let calls = v["choices"][0]["message"]["tool_calls"].as_array().unwrap();
    assert_eq!((calls.len(), calls[0]["function"]["name"].as_str()), (1, Some("get_time")), "{v}");
    // A forced call (required, allowed_tools in mode required, a named function) holds the answer
    // to a grammar of calls.
    for choice in [
        json!("required"),
        json!({"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [{"type": "function", "function": {"name": "get_time"}}]}}),
        json!({"type": "function", "function": {"name": "get_weather"}}),
    ] {
        let body = json!({"messages": ask, "tools": weather_tools(), "tool_choice": choice, "stop": ["Paris"]});
        let (status, v) = s.post("/v1/chat/completions", body).await;
        assert_eq!((status, s.last_request().constraint.is_some()), (200, true), "{choice}: {v}");
        // Stop strings do not cut the call the grammar holds.
        assert!(s.last_request().stop.is_empty(), "{choice}");
    }
    for choice in [
        json!({"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [{"type": "function", "function": {"name": "nope"}}]}}),
        json!({"type": "function", "function": {"name": "nope"}}),
        json!({"type": "allowed_tools", "allowed_tools": {"mode": "sometimes", "tools": []}}),
    ] {
        let (status, v) = s
            .post("/v1/chat/completions", json!({"messages": ask, "tools": weather_tools(), "tool_choice": choice}))
            .await;
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some("tool_choice")), "{v}");
    }

    // Streamed: the text, then each call whole in its own delta.
    let (status, body, _) =
        s.post_text("/v1/chat/completions", json!({"messages": ask, "tools": weather_tools(), "stream": true})).await;
    assert_eq!(status, 200);
    let got = chunks(&body);
    let content: String = got.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(content, "I'll check.");
    let deltas: Vec<&Value> = got.iter().filter_map(|c| c["choices"][0]["delta"]["tool_calls"].get(0)).collect();
    assert_eq!(deltas.len(), 2, "{body}");
    assert_eq!((deltas[0]["index"].as_u64(), deltas[1]["index"].as_u64()), (Some(0), Some(1)));
    assert_eq!(deltas[1]["function"]["name"], "get_time");
    let first = deltas[0];
    assert!(first["id"].as_str().unwrap().starts_with("call_") && first["type"] == "function", "{first}");
    assert_eq!(
        (first["function"]["name"].as_str(), first["function"]["arguments"].as_str()),
        (Some("get_weather"), Some("{\"city\":\"Paris\"}"))
    );
    let finish: Vec<&str> = got.iter().filter_map(|c| c["choices"][0]["finish_reason"].as_str()).collect();
    assert_eq!(finish, ["tool_calls"]);

    // The history of a call and its result reaches the template.
    let history = json!([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"}
    ]);
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": history, "tools": weather_tools()})).await;
    assert_eq!(status, 200, "{v}");
    s.assert_weather_call_and_result_rendered();

    // tool_choice none: no tools in the prompt, the text as it came.
    let (_, v) =
        s.post("/v1/chat/completions", json!({"messages": ask, "tools": weather_tools(), "tool_choice": "none"})).await;
    assert!(!s.last_prompt().contains("<tools>") && v["choices"][0]["message"]["tool_calls"].is_null(), "{v}");
    assert_eq!(v["choices"][0]["message"]["content"].as_str(), Some(CALLS.concat().as_str()), "{v}");
    // An answer that is only calls has no content.
    let only_calls = Fake { script: Some(CALLS[1..].to_vec()), ..Default::default() };
    let oc = start_templated(config(), only_calls, true, HERMES, 2048).await;
    let (_, v) = oc.post("/v1/chat/completions", json!({"messages": ask, "tools": weather_tools()})).await;
    assert_eq!(
        (
            v["choices"][0]["message"]["content"].clone(),
            v["choices"][0]["message"]["tool_calls"].as_array().map(Vec::len)
        ),
        (Value::Null, Some(2)),
        "{v}"
    );
    for (body, param) in [
        (json!({"messages": ask, "tool_choice": "required"}), "tool_choice"),
        (json!({"messages": ask, "tools": [{"type": "custom", "custom": {"name": "x"}}]}), "tools[0].type"),
    ] {
        let (status, v) = s.post("/v1/chat/completions", body).await;
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some(param)), "{v}");
    }
    // A template without tools refuses them.
    let plain = start().await;
    let (status, v) = plain.post("/v1/chat/completions", json!({"messages": ask, "tools": weather_tools()})).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("tools")), "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("does not take tools"), "{v}");
}

/// Anthropic tool use: `tool_use` blocks and `stop_reason: tool_use` (whole and streamed with
/// `input_json_delta`), `tool_use`/`tool_result` history rendered, forced calls held to a grammar of calls.
#[tokio::test]
async fn anthropic_tool_use() {
    let s = start_tools().await;
    let tools = json!([
        {"name": "get_weather", "description": "Weather now", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
        {"name": "get_time", "input_schema": {"type": "object"}}
    ]);
    let ask = json!([{"role": "user", "content": "Weather in Paris?"}]);
    let (status, v) = s.post("/v1/messages", json!({"max_tokens": 50, "messages": ask, "tools": tools})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["stop_reason"], "tool_use");
    let content = v["content"].as_array().unwrap();
    assert_eq!(content[0], json!({"type": "text", "text": "I'll check."}));
    assert_eq!((content[1]["type"].as_str(), content[1]["name"].as_str()), (Some("tool_use"), Some("get_weather")));
    assert!(content[1]["id"].as_str().unwrap().starts_with("toolu_"));
    assert_eq!(content[1]["input"], json!({"city": "Paris"}));
    assert_eq!(content.len(), 3);
    assert!(s.last_prompt().contains("\"description\": \"Weather now\""), "{}", s.last_prompt());
    // A tool's input schema is required and describes an object, in every dialect.
    for (route, tool, param) in [
        ("/v1/messages", json!({"name": "f"}), "tools.0.input_schema: Field required"),
        ("/v1/messages", json!({"name": "f", "input_schema": {"type": "string"}}), "tools.0.input_schema"),
        (
            "/v1/chat/completions",
            json!({"type": "function", "function": {"name": "f", "parameters": "object"}}),
            "tools[0].function.parameters",
        ),
        (
            "/v1/responses",
            json!({"type": "function", "name": "f", "parameters": {"type": "array"}}),
            "tools[0].parameters",
        ),
        // Names as Anthropic allows them: letters, digits, `_` and `-`, up to 128 characters.
        ("/v1/messages", json!({"name": "get.weather", "input_schema": {}}), "tools.0.name: String should match"),
        ("/v1/messages", json!({"name": "x".repeat(129), "input_schema": {}}), "{1,128}"),
    ] {
        let body = match route {
            "/v1/messages" => json!({"max_tokens": 50, "messages": ask, "tools": [tool]}),
            "/v1/responses" => json!({"input": "hi", "tools": [tool]}),
            _ => json!({"messages": ask, "tools": [tool]}),
        };
        let (status, v) = s.post(route, body).await;
        assert_eq!(status, 400, "{route}: {v}");
        // (Anthropic's error shape has no `param`: the message names the field.)
        let named = v["error"]["param"].as_str().or(v["error"]["message"].as_str()).unwrap_or_default();
        assert!(named.contains(param), "{route}: {v}");
    }
    // A name given twice: a call could not say which tool it is.
    let twice = json!([{"name": "f", "input_schema": {}}, {"name": "f", "input_schema": {}}]);
    let (status, v) = s.post("/v1/messages", json!({"max_tokens": 50, "messages": ask, "tools": twice})).await;
    assert!(status == 400 && v["error"]["message"].as_str().unwrap().contains("must be unique"), "{v}");
    // The longest name Anthropic allows is served; OpenAI's route takes what llama-server takes.
    let long = json!([{"name": "a-b_c".repeat(25) + "123", "input_schema": {}}]);
    let (status, v) = s.post("/v1/messages", json!({"max_tokens": 50, "messages": ask, "tools": long})).await;
    assert_eq!(status, 200, "{v}");
    let dotted_name = json!({"type": "function", "function": {"name": "server.get_weather"}});
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": ask, "tools": [dotted_name]})).await;
    assert_eq!(status, 200, "{v}");

    let one = json!({"max_tokens": 50, "messages": ask, "tools": tools, "stream": true,
                     "tool_choice": {"type": "auto", "disable_parallel_tool_use": true}});
    let (status, body, _) = s.post_text("/v1/messages", one).await;
    assert_eq!(status, 200);
    let events: Vec<Value> = sse(&body).into_iter().map(|(_, d)| serde_json::from_str(&d).unwrap()).collect();
    let starts: Vec<&str> = events.iter().filter_map(|e| e["content_block"]["type"].as_str()).collect();
    assert_eq!(starts, ["text", "tool_use"], "{body}");
    let input: String = events.iter().filter_map(|e| e["delta"]["partial_json"].as_str()).collect();
    assert_eq!(serde_json::from_str::<Value>(&input).unwrap(), json!({"city": "Paris"}));
    let stop = events.iter().find(|e| e["type"] == "message_delta").unwrap();
    assert_eq!(stop["delta"]["stop_reason"], "tool_use");
    let stops = events.iter().filter(|e| e["type"] == "content_block_stop").count();
    assert_eq!(stops, 2, "every block opened is closed");
    // Both calls, each its own block, indexed in order.
    let both = json!({"max_tokens": 50, "messages": ask, "tools": tools, "stream": true});
    let (_, body, _) = s.post_text("/v1/messages", both).await;
    let events: Vec<Value> = sse(&body).into_iter().map(|(_, d)| serde_json::from_str(&d).unwrap()).collect();
    let starts: Vec<(u64, &str)> = events
        .iter()
        .filter(|e| e["type"] == "content_block_start")
        .map(|e| (e["index"].as_u64().unwrap(), e["content_block"]["name"].as_str().unwrap_or("text")))
        .collect();
    assert_eq!(starts, [(0, "text"), (1, "get_weather"), (2, "get_time")], "{body}");
    let stopped: Vec<u64> =
        events.iter().filter(|e| e["type"] == "content_block_stop").map(|e| e["index"].as_u64().unwrap()).collect();
    assert_eq!(stopped, [0, 1, 2]);

    let history = json!([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "22 C"}]}, {"type": "text", "text": "Thanks"}]}
    ]);
    let (status, v) = s.post("/v1/messages", json!({"max_tokens": 5, "messages": history, "tools": tools})).await;
    assert_eq!(status, 200, "{v}");
    let prompt = s.last_prompt();
    assert!(
        prompt.contains(
            "Checking.<tool_call>{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}</tool_call>"
        ),
        "{prompt}"
    );
    assert!(prompt.contains("<tool_response>22 C</tool_response>\nuser\nThanks"), "{prompt}");
    // A result must answer a call of the message before it, as Anthropic's API checks.
    let mut orphan = history.clone();
    orphan[2]["content"][0]["tool_use_id"] = json!("toolu_9");
    let (status, v) = s.post("/v1/messages", json!({"max_tokens": 5, "messages": orphan, "tools": tools})).await;
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("messages.2.content.0: unexpected `tool_use_id`"), "{v}");
    // The call answered in its turn, and the same result again two turns after it.
    let mut late = history.clone();
    late.as_array_mut().unwrap().insert(2, json!({"role": "assistant", "content": "More."}));
    late.as_array_mut().unwrap().insert(2, history[2].clone());
    let (status, v) = s.post("/v1/messages", json!({"max_tokens": 5, "messages": late, "tools": tools})).await;
    assert_eq!(status, 400, "a result two turns after its call: {v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("messages.4.content.0: unexpected `tool_use_id`"), "{v}");
    // Every call is answered in the turn right after it, and a call's input is an object.
    let mut unanswered = history.clone();
    unanswered[2]["content"] = json!("Thanks");
    let (status, v) = s.post("/v1/messages", json!({"max_tokens": 5, "messages": unanswered, "tools": tools})).await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("without `tool_result` blocks immediately after: toolu_1"),
        "{v}"
    );
    let mut listed = history.clone();
    listed[1]["content"][1]["input"] = json!([1, 2]);
    let (status, v) = s.post("/v1/messages", json!({"max_tokens": 5, "messages": listed, "tools": tools})).await;
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("valid dictionary"), "{v}");
    // Consecutive messages of one role are one turn: calls over two messages, results over two.
    let split = json!([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "25 C"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "22 C"}]}
    ]);
    let (status, v) = s.post("/v1/messages", json!({"max_tokens": 5, "messages": split, "tools": tools})).await;
    assert_eq!(status, 200, "{v}");
    for choice in [json!({"type": "any"}), json!({"type": "tool", "name": "get_weather"})] {
        let (status, v) = s
            .post(
                "/v1/messages",
                json!({"max_tokens": 5, "messages": ask, "tools": tools, "tool_choice": choice, "stop_sequences": ["Paris"]}),
            )
            .await;
        assert_eq!((status, s.last_request().constraint.is_some()), (200, true), "{choice}: {v}");
        assert!(s.last_request().stop.is_empty(), "{choice}");
    }
    let choice = json!({"type": "tool", "name": "nope"});
    let (status, v) =
        s.post("/v1/messages", json!({"max_tokens": 5, "messages": ask, "tools": tools, "tool_choice": choice})).await;
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("nope"), "{v}");
    let (status, v) =
        s.post("/v1/messages", json!({"max_tokens": 5, "messages": ask, "tools": tools, "tool_choice": "auto"})).await;
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("must be an object"), "{v}");
    let server_tool = json!([{"type": "web_search_20250305", "name": "web_search"}]);
    let (status, _) = s.post("/v1/messages", json!({"max_tokens": 5, "messages": ask, "tools": server_tool})).await;
    assert_eq!(status, 400);
}

/// A template that leaves the thought open (as DeepSeek-R1's does), shows earlier thoughts, and
/// says when thinking is switched off.
const OPEN_THOUGHT: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}{% if enable_thinking is defined and not enable_thinking %}[quiet]{% endif %}<|im_start|>assistant\n<think>\n";

/// With the thought opened by the prompt, the answer is reasoning until `</think>`; earlier
/// thoughts reach the template from both dialects; thinking switched off (`enable_thinking:
/// false`, Anthropic's `thinking: disabled`) closes the opened thought in the prompt.
#[tokio::test]
async fn a_thought_the_prompt_opens() {
    let fake = Fake { script: Some(vec!["Let me see.", "</think>", "\n\nParis."]), ..Default::default() };
    let s = start_templated(config(), fake, true, OPEN_THOUGHT, 2048).await;
    let hi = json!([{"role": "user", "content": "hi"}]);
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": hi})).await;
    assert_eq!(status, 200, "{v}");
    let m = &v["choices"][0]["message"];
    assert_eq!((m["reasoning_content"].as_str(), m["content"].as_str()), (Some("Let me see."), Some("Paris.")), "{v}");
    assert!(s.last_prompt().ends_with("assistant\n<think>"), "{}", s.last_prompt());
    // --reasoning-budget caps every answer's thought, here opened by the prompt.
    let capped = ServerConfig { reasoning_budget: Some(8), ..config() };
    let c = start_templated(capped, Fake::default(), true, OPEN_THOUGHT, 2048).await;
    c.post("/v1/chat/completions", json!({"messages": hi})).await;
    assert_eq!(c.last_request().thought_budget.map(|b| (b.budget, b.open_at_start)), Some((8, true)));
    // llama-server's thinking_budget_tokens: a request's cap where the server sets none.
    c.post("/v1/chat/completions", json!({"messages": hi, "thinking_budget_tokens": 3})).await;
    assert_eq!(c.last_request().thought_budget.map(|b| b.budget), Some(8), "the server's wins");
    s.post("/v1/chat/completions", json!({"messages": hi, "thinking_budget_tokens": 3})).await;
    assert_eq!(s.last_request().thought_budget.map(|b| b.budget), Some(3));
    s.post("/v1/chat/completions", json!({"messages": hi, "thinking_budget_tokens": -1})).await;
    assert_eq!(s.last_request().thought_budget.map(|b| b.budget), None);
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": hi, "thinking_budget_tokens": -2})).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("thinking_budget_tokens")));
    // --reasoning-budget 0 (thinking off) gives way to a request that switches thinking on; an
    // Anthropic budget or `adaptive` replaces the server's.
    let off = ServerConfig { reasoning_budget: Some(0), ..config() };
    let c = start_templated(off, Fake::default(), true, OPEN_THOUGHT, 2048).await;
    let budget = |c: &Server| c.last_request().thought_budget.map(|b| b.budget);
    c.post("/v1/chat/completions", json!({"messages": hi})).await;
    assert_eq!(budget(&c), Some(0));
    c.post("/v1/chat/completions", json!({"messages": hi, "chat_template_kwargs": {"enable_thinking": true}})).await;
    assert_eq!(budget(&c), None);
    c.post("/v1/messages", json!({"max_tokens": 20, "messages": hi})).await;
    assert_eq!(budget(&c), Some(0));
    c.post("/v1/messages", json!({"max_tokens": 20, "messages": hi, "thinking": {"type": "adaptive"}})).await;
    assert_eq!(budget(&c), None);
    c.post(
        "/v1/messages",
        json!({"max_tokens": 20, "messages": hi, "thinking": {"type": "enabled", "budget_tokens": 5}}),
    )
    .await;
    assert_eq!(budget(&c), Some(5));
    // count_tokens has no max_tokens to weigh a budget against.
    let (status, v) = c
        .post(
            "/v1/messages/count_tokens",
            json!({"messages": hi, "thinking": {"type": "enabled", "budget_tokens": 1024}}),
        )
        .await;
    assert_eq!(status, 200, "{v}");

    let history = json!([{"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello", "reasoning_content": "greet"}, {"role": "user", "content": "again"}]);
    s.post("/v1/chat/completions", json!({"messages": history})).await;
    assert!(s.last_prompt().contains("<think>greet</think>Hello"), "{}", s.last_prompt());
    let history = json!([{"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "greet", "signature": ""}, {"type": "text", "text": "Hello"}]},
        {"role": "user", "content": "again"}]);
    let (status, v) = s.post("/v1/messages", json!({"max_tokens": 20, "messages": history})).await;
    assert_eq!(status, 200, "{v}");
    assert!(s.last_prompt().contains("<think>greet</think>Hello"), "{}", s.last_prompt());
    assert_eq!(v["content"][0]["thinking"], "Let me see.", "{v}");

    let off = json!({"messages": hi, "chat_template_kwargs": {"enable_thinking": false}});
    s.post("/v1/chat/completions", off).await;
    assert!(s.last_prompt().ends_with("[quiet]assistant\n<think>\n</think>\n\n"), "{:?}", s.last_prompt());
    let (status, v) =
        s.post("/v1/messages", json!({"max_tokens": 20, "messages": hi, "thinking": {"type": "disabled"}})).await;
    assert_eq!(status, 200, "{v}");
    // Off: the thought the template opens is closed in the prompt, and one the model starts anyway is
    // closed at once.
    assert_eq!(s.last_request().thought_budget.map(|b| (b.budget, b.open_at_start)), Some((0, false)));
    assert!(s.last_prompt().ends_with("[quiet]assistant\n<think>\n</think>\n\n"), "{:?}", s.last_prompt());

    // A JSON format where the template opens a thought holds only what follows the thought: the
    // engine watches for its end (no cap unless a budget gives one); with thinking off, from the start.
    // That needs `</think>` to be one token (this tokenizer writes it in pieces: refused).
    let json_format = json!({"type": "json_object"});
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": hi, "response_format": json_format})).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("response_format")), "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("in pieces"), "{v}");
    let (status, v) = s.post("/v1/responses", json!({"input": "hi", "text": {"format": json_format}})).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("text.format")), "{v}");
    let mut text = tokenizer();
    Arc::get_mut(&mut text).unwrap().inner.add_tokens(&[tokenizers::AddedToken::from("</think>", true)]);
    let t = start_tokenized(config(), Fake::default(), true, OPEN_THOUGHT, 2048, text).await;
    let (status, v) = t.post("/v1/chat/completions", json!({"messages": hi, "response_format": json_format})).await;
    assert_eq!(status, 200, "{v}");
    let r = t.last_request();
    assert!(r.constraint.is_some());
    assert_eq!(r.thought_budget.map(|b| (b.budget, b.open_at_start)), Some((usize::MAX, true)));
    let quiet =
        json!({"messages": hi, "response_format": json_format, "chat_template_kwargs": {"enable_thinking": false}});
    let (status, v) = t.post("/v1/chat/completions", quiet).await;
    assert_eq!(status, 200, "{v}");
    let r = t.last_request();
    assert!(r.constraint.is_some() && r.thought_budget.is_none());
    let (status, v) = t.post("/v1/responses", json!({"input": "hi", "text": {"format": json_format}})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(t.last_request().thought_budget.map(|b| b.open_at_start), Some(true));
    // Capped by a budget as any thought is.
    let low = json!({"messages": hi, "response_format": json_format, "reasoning_effort": "low"});
    let (status, v) = t.post("/v1/chat/completions", low).await;
    assert_eq!((status, t.last_request().thought_budget.map(|b| b.budget)), (200, Some(1024)), "{v}");
    // A thought left in the content would spoil the JSON.
    let raw = json!({"messages": hi, "response_format": json_format, "reasoning_format": "none"});
    let (status, v) = t.post("/v1/chat/completions", raw).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("reasoning_format")), "{v}");

    // OpenAI's reasoning effort, for a template with Qwen3's thinking switch: none and minimal
    // switch thinking off, low and medium cap the thought, high leaves it; the request's own
    // template variables win; a template without a switch refuses it.
    let budget = |s: &Server| s.last_request().thought_budget.map(|b| b.budget);
    for (effort, quiet, cap) in [
        ("none", true, Some(0)),
        ("minimal", true, Some(0)),
        ("low", false, Some(1024)),
        ("medium", false, Some(4096)),
        ("high", false, None),
    ] {
        let (status, v) = s.post("/v1/chat/completions", json!({"messages": hi, "reasoning_effort": effort})).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!((s.last_prompt().contains("[quiet]"), budget(&s)), (quiet, cap), "{effort}");
        let (status, v) = s.post("/v1/responses", json!({"input": "hi", "reasoning": {"effort": effort}})).await;
        assert_eq!((status, &v["reasoning"]["effort"]), (200, &json!(effort)), "{v}");
        assert_eq!((s.last_prompt().contains("[quiet]"), budget(&s)), (quiet, cap), "{effort}");
    }
    let explicit =
        json!({"messages": hi, "reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": true}});
    s.post("/v1/chat/completions", explicit).await;
    assert_eq!((s.last_prompt().contains("[quiet]"), budget(&s)), (false, None), "{}", s.last_prompt());
    // The server's --reasoning-budget and the effort's cap: the tighter holds.
    let c = start_templated(capped_config(8), Fake::default(), true, OPEN_THOUGHT, 2048).await;
    c.post("/v1/chat/completions", json!({"messages": hi, "reasoning_effort": "low"})).await;
    assert_eq!(budget(&c), Some(8));
    let (status, v) = s.post("/v1/chat/completions", json!({"messages": hi, "reasoning_effort": "max"})).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("reasoning_effort")), "{v}");
    let plain = start().await;
    let (status, v) = plain.post("/v1/chat/completions", json!({"messages": hi, "reasoning_effort": "low"})).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("reasoning_effort")), "{v}");
    let (status, v) = plain.post("/v1/responses", json!({"input": "hi", "reasoning": {"effort": "low"}})).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("reasoning.effort")), "{v}");
}

fn capped_config(budget: usize) -> ServerConfig {
    ServerConfig { reasoning_budget: Some(budget), ..config() }
}

/// OpenAI's Responses API: a string or items in, output items out (reasoning, a message, function
/// calls), whole and streamed as Responses events; what needs storage or constrained decoding is
/// refused by name.
#[tokio::test]
async fn responses_api() {
    let s = start().await;
    let (status, v) = s.post("/v1/responses", json!({"input": "hi", "instructions": "Be brief."})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!((v["object"].as_str(), v["status"].as_str()), (Some("response"), Some("completed")), "{v}");
    assert!(v["id"].as_str().unwrap().starts_with("resp_"));
    let out = v["output"].as_array().unwrap();
    assert_eq!(out.len(), 1, "{v}");
    assert_eq!((out[0]["type"].as_str(), out[0]["role"].as_str()), (Some("message"), Some("assistant")));
    assert_eq!(
        out[0]["content"][0],
        json!({"type": "output_text", "text": ANSWER.concat(), "annotations": [], "logprobs": []})
    );
    assert_eq!(v["usage"]["output_tokens"], 4);
    assert!(s.last_prompt().starts_with("system\nBe brief.\nuser\nhi\n"), "{}", s.last_prompt());
    let (_, v) = s.post("/v1/responses", json!({"input": "hi", "max_output_tokens": 2})).await;
    assert_eq!(
        (v["status"].as_str(), v["incomplete_details"]["reason"].as_str()),
        (Some("incomplete"), Some("max_output_tokens"))
    );
    for (body, param) in [
        (json!({"input": "hi", "previous_response_id": "resp_1"}), "previous_response_id"),
        (json!({"input": "hi", "text": {"format": {"type": "yaml"}}}), "text.format.type"),
        (json!({"input": "hi", "store": true}), "store"),
        (json!({"input": "hi", "max_output_tokens": 0}), "max_output_tokens"),
        (json!({"input": "hi", "reasoning": {"summary": "concise"}}), "reasoning.summary"),
        (json!({"input": "hi", "reasoning": {"summary": 1}}), "reasoning.summary"),
        (json!({"input": "hi", "include": ["message.output_text.logprobs"]}), "include[0]"),
        (json!({"input": "hi", "text": {"verbosity": "low"}}), "text.verbosity"),
        (json!({"input": [{"type": "input_image", "image_url": "x"}]}), "input[0].type"),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}),
            "input[0].content[0].type",
        ),
    ] {
        let (status, v) = s.post("/v1/responses", body).await;
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some(param)), "{v}");
    }

    // Streamed: every event in order with its sequence number, the text in deltas.
    let (status, body, _) = s.post_text("/v1/responses", json!({"input": "hi", "stream": true})).await;
    assert_eq!(status, 200);
    let events = sse(&body);
    let names: Vec<&str> = events.iter().map(|e| e.0.as_deref().unwrap()).collect();
    let mut want =
        vec!["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"];
    want.extend(std::iter::repeat_n("response.output_text.delta", ANSWER.len()));
    want.extend([
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]);
    assert_eq!(names, want);
    let data: Vec<Value> = events.iter().map(|e| serde_json::from_str(&e.1).unwrap()).collect();
    for (i, d) in data.iter().enumerate() {
        assert_eq!((d["sequence_number"].as_u64(), d["type"].as_str()), (Some(i as u64), Some(names[i])));
    }
    let text: String = data.iter().filter_map(|d| d["delta"].as_str()).collect();
    assert_eq!(text, ANSWER.concat());
    let done = &data.last().unwrap()["response"];
    assert_eq!(
        (done["status"].as_str(), done["output"][0]["content"][0]["text"].as_str()),
        (Some("completed"), Some(ANSWER.concat().as_str()))
    );
}

#[tokio::test]
async fn responses_api_function_calls_and_reasoning() {
    let s = start_tools().await;
    let tools = json!([
        {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
        {"type": "function", "name": "get_time", "parameters": {"type": "object"}}
    ]);
    let (status, v) = s.post("/v1/responses", json!({"input": "Weather?", "tools": tools})).await;
    assert_eq!(status, 200, "{v}");
    let out = v["output"].as_array().unwrap();
    let kinds: Vec<&str> = out.iter().map(|o| o["type"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["message", "function_call", "function_call"], "{v}");
    assert_eq!(out[0]["content"][0]["text"], "I'll check.");
    assert_eq!(
        (out[1]["name"].as_str(), out[1]["arguments"].as_str()),
        (Some("get_weather"), Some("{\"city\":\"Paris\"}"))
    );
    assert!(
        out[1]["call_id"].as_str().unwrap().starts_with("call_") && out[1]["id"].as_str().unwrap().starts_with("fc_")
    );
    assert!(
        s.last_prompt().contains("<tools>{\"type\": \"function\", \"function\": {\"name\": \"get_weather\""),
        "{}",
        s.last_prompt()
    );
    // The call and its output, sent back as items, reach the template.
    let items = json!([
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "22 C"}
    ]);
    let (status, v) = s.post("/v1/responses", json!({"input": items, "tools": tools})).await;
    assert_eq!(status, 200, "{v}");
    s.assert_weather_call_and_result_rendered();
    // A call never answered, or answered after another message, or made twice, is refused as OpenAI
    // refuses it.
    let call = json!({"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"});
    let output = json!({"type": "function_call_output", "call_id": "call_1", "output": "22 C"});
    let user = json!({"role": "user", "content": "And?"});
    for (input, at) in [
        (json!([user, call]), "input"),
        (json!([user, call, user, output]), "input[2]"),
        (json!([user, call, output, call]), "input[3].call_id"),
    ] {
        let (status, v) = s.post("/v1/responses", json!({"input": input, "tools": tools})).await;
        assert_eq!((status, v["error"]["param"].as_str()), (400, Some(at)), "{input}: {v}");
    }
    // The model's own text after its call, as this server's output lists it, may come between.
    let said = json!({"role": "assistant", "content": "Checking."});
    let (status, v) = s.post("/v1/responses", json!({"input": [user, call, said, output], "tools": tools})).await;
    assert_eq!(status, 200, "{v}");
    // Streamed: each call an item of its own, whole.
    let (_, body, _) = s.post_text("/v1/responses", json!({"input": "Weather?", "tools": tools, "stream": true})).await;
    let data: Vec<Value> = sse(&body).into_iter().map(|e| serde_json::from_str(&e.1).unwrap()).collect();
    let added: Vec<&str> = data
        .iter()
        .filter(|d| d["type"] == "response.output_item.added")
        .map(|d| d["item"]["type"].as_str().unwrap())
        .collect();
    assert_eq!(added, ["message", "function_call", "function_call"], "{body}");
    let args: Vec<&str> = data
        .iter()
        .filter(|d| d["type"] == "response.function_call_arguments.done")
        .map(|d| d["arguments"].as_str().unwrap())
        .collect();
    assert_eq!(args, ["{\"city\":\"Paris\"}", "{}"]);
    let indexes: Vec<u64> = data
        .iter()
        .filter(|d| d["type"] == "response.output_item.done")
        .map(|d| d["output_index"].as_u64().unwrap())
        .collect();
    assert_eq!(indexes, [0, 1, 2]);

    // A thought is a reasoning item before the message.
    let t = start_with(config(), Fake { script: Some(THOUGHT.to_vec()), ..Default::default() }, true).await;
    let (_, v) = t.post("/v1/responses", json!({"input": "hi"})).await;
    let out = v["output"].as_array().unwrap();
    assert_eq!(
        (out[0]["type"].as_str(), out[0]["content"][0]["text"].as_str()),
        (Some("reasoning"), Some("France's capital is well known.")),
        "{v}"
    );
    assert_eq!(out[1]["content"][0]["text"], "Paris.");
    assert!(out[0]["summary"] == json!([]) && out[0].get("encrypted_content").is_none(), "{v}");
    // As Codex asks with a reasoning model: the thought as the summary too (whole and streamed), and
    // as encrypted_content, which brings it back to the model when the item is sent back.
    let codex = json!({"input": "hi", "reasoning": {"effort": null, "summary": "auto"}, "store": false,
        "include": ["reasoning.encrypted_content"], "stream": true, "prompt_cache_key": "c1"});
    let (status, body, _) = t.post_text("/v1/responses", codex).await;
    assert_eq!(status, 200, "{body}");
    let data: Vec<Value> = sse(&body).into_iter().map(|e| serde_json::from_str(&e.1).unwrap()).collect();
    let kinds: Vec<&str> = data.iter().map(|d| d["type"].as_str().unwrap()).collect();
    let at = |k: &str| kinds.iter().position(|x| *x == k).unwrap_or_else(|| panic!("no {k}: {kinds:?}"));
    assert!(at("response.reasoning_summary_part.added") < at("response.reasoning_summary_text.delta"));
    assert!(at("response.reasoning_summary_text.done") < at("response.reasoning_summary_part.done"));
    assert!(at("response.reasoning_summary_part.done") < at("response.output_item.done"));
    let summary: String = data
        .iter()
        .filter(|d| d["type"] == "response.reasoning_summary_text.delta")
        .map(|d| d["delta"].as_str().unwrap())
        .collect();
    assert_eq!(summary, "France's capital is well known.");
    let done = &data.last().unwrap()["response"];
    let item = &done["output"][0];
    assert_eq!(item["summary"], json!([{"type": "summary_text", "text": "France's capital is well known."}]));
    assert_eq!(item["encrypted_content"], "mlxcel-thought:France's capital is well known.");
    assert_eq!(done["reasoning"]["summary"], "auto");
    // Sent back with only its encrypted_content, the thought reaches the template.
    let back = json!([{"role": "user", "content": "hi"},
        {"type": "reasoning", "id": item["id"], "summary": [], "encrypted_content": item["encrypted_content"]},
        {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And Spain?"}]);
    let shows = start_templated(config(), Fake::default(), true, OPEN_THOUGHT, 2048).await;
    let (status, v) = shows.post("/v1/responses", json!({"input": back})).await;
    assert_eq!(status, 200, "{v}");
    let prompt = shows.last_prompt();
    assert!(prompt.contains("<think>France's capital is well known.</think>Paris."), "{prompt}");
    // Another server's (OpenAI's opaque blob) is not shown to the model.
    let mut foreign = back.clone();
    foreign[1]["encrypted_content"] = json!("gAAAAB-opaque");
    let (status, _) = shows.post("/v1/responses", json!({"input": foreign})).await;
    assert_eq!(status, 200);
    assert!(!shows.last_prompt().contains("opaque"), "{}", shows.last_prompt());
    // llama-server's reasoning_format here too: none leaves the thought in the message.
    let (_, v) = t.post("/v1/responses", json!({"input": "hi", "reasoning_format": "none"})).await;
    assert_eq!(
        (v["output"].as_array().map(Vec::len), v["output"][0]["content"][0]["text"].as_str()),
        (Some(1), Some(THOUGHT.concat().as_str())),
        "{v}"
    );
}

/// `/v1/completions` streams several prompts as choices of one stream, then one usage chunk and one
/// `[DONE]`.
#[tokio::test]
async fn completions_stream_several_prompts_as_choices() {
    let s = start().await;
    let body = json!({"prompt": ["a", "b"], "stream": true, "stream_options": {"include_usage": true}});
    let (status, text, _) = s.post_text("/v1/completions", body).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(text.matches("[DONE]").count(), 1);
    assert!(text.ends_with("data: [DONE]\n\n"));
    let got = chunks(&text);
    for i in 0..2 {
        let mine: String = got
            .iter()
            .filter_map(|c| c["choices"].get(0).filter(|ch| ch["index"] == i))
            .filter_map(|ch| ch["text"].as_str())
            .collect();
        assert_eq!(mine, ANSWER.concat(), "choice {i}");
    }
    let usage: Vec<&Value> = got.iter().filter(|c| !c["usage"].is_null()).map(|c| &c["usage"]).collect();
    assert_eq!(usage.len(), 1, "{text}");
    assert_eq!(usage[0]["completion_tokens"], 8);
}
