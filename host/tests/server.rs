//! The `mlxcel-server` binary on the real SmolLM2 (skipped without `MLXCEL_TEST_MODELS`): chat plain and
//! streamed answer "Paris" over a socket, API keys, SIGTERM exits 0; then the official `openai` and
//! `anthropic` Python SDKs (pinned in tests/sdk/requirements.txt, installed into target/sdk-venv) run `tests/sdk/test_sdk.py`
//! against it. Refused llama-server flags need no model.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use mlxcel::testing::TestServer;

use serde_json::{json, Value};

const KEY: &str = "test-key";
const QUESTION: &str = "What is the capital of France?";

fn server_bin() -> Command {
    mlxcel::testing::server_command(env!("CARGO_BIN_EXE_mlxcel-server"))
}

/// Starts the server on an ephemeral port and waits until `/health` says the model is loaded.
fn start(model: &Path, extra: &[&str]) -> TestServer {
    let args = [&["-c", "2048", "--api-key", KEY, "--metrics"], extra].concat();
    TestServer::start(env!("CARGO_BIN_EXE_mlxcel-server"), model, &args)
}

/// The JSON payloads of an SSE body's `data:` lines, `[DONE]` left out.
fn sse_chunks(text: &str) -> Vec<Value> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

fn smollm2() -> Option<PathBuf> {
    Some(mlxcel::testing::test_models()?.join("smollm2-135m-instruct-mlx-4bit"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_answers_paris_plain_and_streamed_and_sigterm_exits_cleanly() {
    let Some(model) = smollm2() else { return };
    // One slot, so that a request sent during the long stream at the end waits for it.
    let mut server = tokio::task::spawn_blocking(move || start(&model, &["-np", "1"])).await.unwrap();
    let http = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", server.base);
    let body = json!({"messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": 32});

    let r = http.post(&url).json(&body).send().await.unwrap();
    assert_eq!(r.status(), 401, "no API key");
    let v: Value = http.post(&url).bearer_auth(KEY).json(&body).send().await.unwrap().json().await.unwrap();
    let answer = v["choices"][0]["message"]["content"].as_str().unwrap_or_default();
    assert!(answer.contains("Paris"), "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let text = http.post(&url).bearer_auth(KEY).json(&streamed).send().await.unwrap().text().await.unwrap();
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let answer: String = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| {
            serde_json::from_str::<Value>(d).ok()?["choices"][0]["delta"]["content"].as_str().map(String::from)
        })
        .collect();
    assert!(answer.contains("Paris"), "{answer}");
    // A stop string is cut from the text, and its tokens from the logprobs.
    let mut stopped = body.clone();
    stopped["stop"] = json!(["Paris"]);
    stopped["logprobs"] = json!(true);
    let v: Value = http.post(&url).bearer_auth(KEY).json(&stopped).send().await.unwrap().json().await.unwrap();
    let content = v["choices"][0]["message"]["content"].as_str().unwrap_or_default();
    let tokens: String = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"))
        .iter()
        .map(|t| t["token"].as_str().unwrap())
        .collect();
    assert!(!content.contains("Paris") && content.starts_with(&tokens) && !tokens.is_empty(), "{v}");
    assert!(content.len() - tokens.len() <= 1, "more than the stop string's tokens were dropped: {v}");
    // Structured output: held to a JSON schema, the answer is that JSON (and still right).
    let schema = json!({"type": "object", "properties": {"capital": {"type": "string", "maxLength": 40}},
        "required": ["capital"], "additionalProperties": false});
    let mut structured = body.clone();
    structured["response_format"] =
        json!({"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": true}});
    structured["max_tokens"] = json!(48);
    let v: Value = http.post(&url).bearer_auth(KEY).json(&structured).send().await.unwrap().json().await.unwrap();
    let content = v["choices"][0]["message"]["content"].as_str().unwrap_or_default();
    let answer: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("{e}: {v}"));
    assert!(
        answer["capital"].as_str().is_some_and(|c| c.contains("Paris")) && answer.as_object().unwrap().len() == 1,
        "{v}"
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    // SmolLM2 has no fill-in-the-middle tokens: /infill says so, in llama-server's words.
    let r = http
        .post(format!("{}/infill", server.base))
        .bearer_auth(KEY)
        .json(&json!({"input_prefix": "def f():"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 501);
    let v: Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"].as_str().unwrap_or_default().contains("Infill is not supported by this model"),
        "{v}"
    );
    // The second request shares the first one's prompt: its KV is reused.
    let m = http.get(format!("{}/metrics", server.base)).bearer_auth(KEY).send().await.unwrap().text().await.unwrap();
    assert!(m.contains("llamacpp:tokens_predicted_total"), "{m}");
    assert!(!m.contains("mlxcel_prompt_cached_tokens_total 0\n"), "{m}");

    // A stream still running at shutdown: a second signal ends the grace period at once, and the
    // stream is cut short in its dialect's shape (a last chunk with `length`, usage, `[DONE]`).
    let mut long = body.clone();
    long["stream"] = json!(true);
    long["max_tokens"] = json!(-1);
    long["ignore_eos"] = json!(true);
    long["stream_options"] = json!({"include_usage": true});
    let mut r = http.post(&url).bearer_auth(KEY).json(&long).send().await.unwrap();
    let mut text = String::new();
    while !text.contains("\"content\"") {
        text += &String::from_utf8_lossy(&r.chunk().await.unwrap().expect("the stream ended early"));
    }
    // A request queued behind it never starts: at the signal it gets a 503, not an empty answer.
    let queued = tokio::spawn(http.post(&url).bearer_auth(KEY).json(&body).send());
    let waiting = || async {
        let m = http.get(format!("{}/metrics", server.base)).bearer_auth(KEY).send().await.unwrap();
        m.text().await.unwrap().contains("llamacpp:requests_deferred 1")
    };
    let t0 = Instant::now();
    while !waiting().await {
        assert!(t0.elapsed() < Duration::from_secs(10), "the second request never queued");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let pid = server.child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    // It never starts: its 503 comes at once, while the running stream goes on.
    let refused =
        tokio::time::timeout(Duration::from_secs(5), queued).await.expect("no 503 at the signal").unwrap().unwrap();
    assert_eq!(refused.status(), 503);
    let v: Value = refused.json().await.unwrap();
    assert!(v["error"]["message"].as_str().unwrap_or_default().contains("shutting down"), "{v}");
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    while let Some(chunk) = r.chunk().await.unwrap() {
        text += &String::from_utf8_lossy(&chunk);
    }
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    let chunks = sse_chunks(&text);
    let ended = chunks.iter().find(|c| c["choices"][0]["finish_reason"].is_string()).expect("a last chunk");
    assert_eq!(ended["choices"][0]["finish_reason"], "length", "{ended}");
    let usage = &chunks.last().unwrap()["usage"];
    // Cut long before the context (2048 tokens) would have ended it.
    assert!(usage["completion_tokens"].as_u64().unwrap() < 1000, "{usage}");
    let status = tokio::task::spawn_blocking(move || server.child.wait().unwrap()).await.unwrap();
    assert_eq!(status.code(), Some(0), "SIGTERM should exit 0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_leaving_mid_stream_frees_the_slot_timeouts_cut_answers_and_the_template_file_is_used() {
    let Some(model) = smollm2() else { return };
    // A template of our own (ChatML without SmolLM's default system prompt) replaces the model's.
    let dir = tempfile::tempdir().unwrap();
    let template = dir.path().join("chatml.jinja");
    std::fs::write(&template, "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}").unwrap();
    let args = [
        "-to".to_string(),
        "1".into(),
        "-np".into(),
        "1".into(),
        "--chat-template-file".into(),
        template.display().to_string(),
    ];
    let server =
        tokio::task::spawn_blocking(move || start(&model, &args.iter().map(String::as_str).collect::<Vec<_>>()))
            .await
            .unwrap();
    let http = reqwest::Client::new();
    let v: Value = http
        .post(format!("{}/apply-template", server.base))
        .bearer_auth(KEY)
        .json(&json!({"messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["prompt"], "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    let story = json!({"messages": [{"role": "user", "content": "Tell me a very long story about dragons."}],
                       "max_tokens": 1500, "ignore_eos": true, "stream": true});
    for i in 0..3 {
        let mut r = http
            .post(format!("{}/v1/chat/completions", server.base))
            .bearer_auth(KEY)
            .json(&story)
            .send()
            .await
            .unwrap();
        r.chunk().await.unwrap().expect("a first chunk");
        if i == 0 {
            // The one slot is busy: llama-server's load-balancer check says so.
            let url = format!("{}/slots?fail_on_no_slot=1", server.base);
            let busy = http.get(&url).bearer_auth(KEY).send().await.unwrap();
            assert_eq!(busy.status(), 503);
            let v: Value = busy.json().await.unwrap();
            assert_eq!(v["error"]["type"], "unavailable_error", "{v}");
        }
        drop(r);
    }
    // The slot is free again within a moment of the last client leaving, and all three are counted
    // as cancelled (a request still queued when its client left is noticed when it is first written
    // to, so the slot may be free a moment before the third is counted).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let slots: Value =
            http.get(format!("{}/slots", server.base)).bearer_auth(KEY).send().await.unwrap().json().await.unwrap();
        let m =
            http.get(format!("{}/metrics", server.base)).bearer_auth(KEY).send().await.unwrap().text().await.unwrap();
        if slots[0]["is_processing"] == false && m.contains("mlxcel_requests_cancelled_total 3\n") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "slot still busy or not three cancelled after the clients left: {slots} {m}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // `-to 1`: a request that would run for long is cut after about a second.
    let t = Instant::now();
    let mut plain = story.clone();
    plain["stream"] = json!(false);
    let v: Value = http
        .post(format!("{}/v1/chat/completions", server.base))
        .bearer_auth(KEY)
        .json(&plain)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() < 1500, "{v}");
    assert!(t.elapsed() < Duration::from_secs(5), "the timeout did not cut the request: {:?}", t.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn by_default_four_slots_share_one_context_of_kv() {
    let Some(model) = smollm2() else { return };
    // llama-server's auto `-np`: four slots, one context's KV pool between them, each sequence
    // free to reach the whole context.
    let server = tokio::task::spawn_blocking(move || start(&model, &[])).await.unwrap();
    let http = reqwest::Client::new();
    let v: Value =
        http.get(format!("{}/props", server.base)).bearer_auth(KEY).send().await.unwrap().json().await.unwrap();
    let m = &v["mlxcel"];
    assert_eq!(
        (v["total_slots"].as_u64(), m["parallel"].as_u64(), m["n_ctx"].as_u64()),
        (Some(4), Some(4), Some(2048))
    );
    let pool = m["kv_blocks_total"].as_u64().unwrap() * m["kv_block_size"].as_u64().unwrap();
    assert_eq!(pool, 2048, "{v}");
}

/// `/v1/completions` with `echo` and `logprobs` scores the prompt, as evaluation harnesses
/// (lm-evaluation-harness's loglikelihood tasks) ask: against mlx-lm's scores of the same tokens
/// (fixtures/make_prompt_logprobs.py), plain and streamed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echoed_completions_score_the_prompt_as_mlx_lm_does() {
    let Some(model) = smollm2() else { return };
    let server = tokio::task::spawn_blocking(move || start(&model, &["-np", "2"])).await.unwrap();
    let http = reqwest::Client::new();
    let url = format!("{}/v1/completions", server.base);
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/smollm2-prompt-logprobs.json");
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(fixture).unwrap()).unwrap();
    for case in reference["cases"].as_array().unwrap() {
        let (ids, want) = (&case["ids"], case["logprobs"].as_array().unwrap());
        // As the harness asks: one more token, whose score it drops.
        let body = json!({"prompt": ids, "max_tokens": 1, "logprobs": 1, "echo": true, "temperature": 0});
        let v: Value = http.post(&url).bearer_auth(KEY).json(&body).send().await.unwrap().json().await.unwrap();
        let choice = &v["choices"][0];
        assert!(choice["text"].as_str().unwrap_or_default().starts_with(case["text"].as_str().unwrap()), "{v}");
        let lp = &choice["logprobs"];
        let scores = lp["token_logprobs"].as_array().unwrap_or_else(|| panic!("{v}"));
        assert_eq!(scores.len(), want.len() + 2, "the prompt's tokens and the one generated: {v}");
        assert!(scores[0].is_null() && lp["top_logprobs"][0].is_null(), "the first token has no score: {v}");
        for (p, (got, want)) in scores[1..].iter().zip(want).enumerate() {
            let (got, want) = (got.as_f64().unwrap(), want.as_f64().unwrap());
            assert!((got - want).abs() < 0.02, "token {}: {got} against mlx-lm's {want}", p + 1);
            // Where the prompt's token is the model's first choice, it heads the alternatives.
            let top = lp["top_logprobs"][p + 1].as_object().unwrap();
            if case["best"][p] == ids[p + 1] {
                assert_eq!(top.get(lp["tokens"][p + 1].as_str().unwrap()).and_then(Value::as_f64), Some(got), "{v}");
            }
        }
        // Each token's offset points at its text in the echoed answer (an end-of-sequence token
        // listed last shows none: its offset is the text's end).
        let text: Vec<char> = choice["text"].as_str().unwrap().chars().collect();
        for (token, offset) in lp["tokens"].as_array().unwrap().iter().zip(lp["text_offset"].as_array().unwrap()) {
            let (token, offset) = (token.as_str().unwrap(), offset.as_u64().unwrap() as usize);
            let at: String = text[offset.min(text.len())..].iter().collect();
            let shown = token.starts_with("bytes:") || at.starts_with(token) || offset == text.len();
            assert!(shown, "{token:?} at {offset}: {at:?}");
        }
    }

    // Streamed: the echo comes first and carries the prompt's scores; nothing generated at max_tokens 0.
    let case = &reference["cases"][0];
    let body = json!({"prompt": case["text"], "max_tokens": 0, "logprobs": 2, "echo": true, "stream": true});
    let text = http.post(&url).bearer_auth(KEY).json(&body).send().await.unwrap().text().await.unwrap();
    let chunks = sse_chunks(&text);
    let echo = &chunks[0]["choices"][0];
    assert_eq!(echo["text"], case["text"], "{text}");
    let scores = echo["logprobs"]["token_logprobs"].as_array().unwrap_or_else(|| panic!("{text}"));
    assert_eq!(scores.len(), case["ids"].as_array().unwrap().len(), "{text}");
    for (got, want) in scores[1..].iter().zip(case["logprobs"].as_array().unwrap()) {
        assert!((got.as_f64().unwrap() - want.as_f64().unwrap()).abs() < 0.02, "{text}");
    }
    assert!(echo["logprobs"]["top_logprobs"][1].as_object().is_some_and(|t| t.len() == 2), "{text}");
    let generated: String = chunks[1..].iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(generated, "", "{text}");
}

#[test]
fn openai_and_anthropic_sdks_get_right_answers_plain_and_streamed() {
    let Some(model) = smollm2() else { return };
    let py = mlxcel::testing::sdk_venv_python();
    let server = start(&model, &["-a", "smollm2"]);
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/test_sdk.py");
    let out = Command::new(py).arg(script).args([&server.base, KEY, "smollm2"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(out.status.success(), "SDK checks failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn unsupported_llama_server_flags_are_refused_by_name() {
    for (args, flag) in [(&["-m", "x", "-ngl", "99"][..], "-ngl"), (&["-m", "x", "--mmproj", "p.gguf"], "--mmproj")] {
        let out = server_bin().args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        assert!(stderr.starts_with(&format!("error: {flag} is a llama-server flag")), "{stderr}");
    }
    let out = server_bin().args(["-m", "x", "--lora", "a"]).env("LLAMA_ARG_N_GPU_LAYERS", "99").output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("--lora"));
    let out = server_bin().args(["-m", "x"]).env("LLAMA_ARG_N_GPU_LAYERS", "99").output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("LLAMA_ARG_N_GPU_LAYERS") && stderr.contains("-ngl"), "{stderr}");
    // `mlxcel serve` is the same program.
    let mlxcel = env!("CARGO_BIN_EXE_mlxcel-server").replace("mlxcel-server", "mlxcel");
    let out = Command::new(mlxcel).args(["serve", "-m", "x", "--flash-attn", "on"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.starts_with("error: --flash-attn is a llama-server flag"), "{stderr}");
}

#[test]
fn on_off_environment_variables_take_llama_cpp_spellings() {
    // The model does not load (an empty folder): the variables themselves were read.
    let dir = tempfile::tempdir().unwrap();
    let out = server_bin()
        .arg("-m")
        .arg(dir.path())
        .args(["--port", "0"])
        .envs([
            ("LLAMA_ARG_ENDPOINT_METRICS", "1"),
            ("LLAMA_ARG_NO_ENDPOINT_SLOTS", "on"),
            ("LLAMA_ARG_JINJA", "enabled"),
            ("LLAMA_ARG_CONT_BATCHING", "1"),
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("invalid value"), "{stderr}");
    assert!(stderr.lines().last().unwrap().starts_with("error: "), "{stderr}");
    let out = server_bin().args(["-m", "x"]).env("LLAMA_ARG_CONT_BATCHING", "0").output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("always on"), "{stderr}");
    // The key file's variable is read (a deployment that sets only it must not run without keys),
    // and so are the current names of the on/off pairs.
    let out = server_bin().args(["-m", "x"]).env("LLAMA_ARG_API_KEY_FILE", "/nonexistent/keys").output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("reading --api-key-file /nonexistent/keys"), "{stderr}");
    for var in ["LLAMA_ARG_ENDPOINT_SLOTS", "LLAMA_ARG_CACHE_PROMPT"] {
        let out = server_bin().args(["-m", "x"]).env(var, "maybe").output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("invalid value 'maybe'"), "{var}: {stderr}");
    }
    // One set to what mlxcel does anyway passes (the model then fails to load, as it is "x").
    let out = server_bin()
        .args(["-m", "x"])
        .envs([("LLAMA_ARG_NO_WEBUI", "1"), ("LLAMA_ARG_CONTEXT_SHIFT", "off")])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("LLAMA_ARG_"), "{stderr}");
    // A variable of a llama-server flag mlxcel does not implement is refused, not ignored.
    let out = server_bin().args(["-m", "x"]).env("LLAMA_ARG_CACHE_REUSE", "256").output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("LLAMA_ARG_CACHE_REUSE (llama-server's --cache-reuse) is set"), "{stderr}");
}

#[test]
fn a_model_that_does_not_load_ends_the_server_with_one_error_line() {
    let dir = tempfile::tempdir().unwrap();
    let out = server_bin().arg("-m").arg(dir.path()).args(["--port", "0"]).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.lines().last().unwrap().starts_with("error: "), "{stderr}");
}
