//! Embeddings and reranking end to end: `mlxcel-server` and the `embed` / `rerank` commands on the bert
//! family's tiny fixtures (transformers goldens, families/bert/tests/fixtures), every route shape and
//! refusal; then the real all-MiniLM-L6-v2 (with `MLXCEL_TEST_MODELS`) against an independent numpy
//! reference (tools/fixtures/minilm_reference.py → tests/fixtures/minilm-reference.json) over HTTP
//! and through the official `openai` SDK (tests/sdk/test_embeddings_sdk.py).

use std::path::{Path, PathBuf};
use std::process::Command;

use mlxcel::testing::TestServer;

use serde_json::{json, Value};

fn fixture(name: &str) -> PathBuf {
    mlxcel::testing::workspace_root().join("families/bert/tests/fixtures").join(name)
}

fn golden(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name).join("golden.json")).unwrap()).unwrap()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

fn cos(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    dot / (a.iter().map(|x| x * x).sum::<f32>().sqrt() * b.iter().map(|x| x * x).sum::<f32>().sqrt())
}

/// The server under test, with the calls these tests make.
struct Server(TestServer);

impl std::ops::Deref for Server {
    type Target = TestServer;
    fn deref(&self) -> &TestServer {
        &self.0
    }
}

/// Starts the server on an ephemeral port (no flags beyond the model) and waits for `/health`.
fn start(model: &Path) -> Server {
    start_with(model, &[])
}

/// [`start`] with more flags.
fn start_with(model: &Path, flags: &[&str]) -> Server {
    let args: Vec<&str> = ["-a", "test-model"].into_iter().chain(flags.iter().copied()).collect();
    Server(TestServer::start(env!("CARGO_BIN_EXE_mlxcel-server"), model, &args))
}

/// Blocking calls over reqwest's async client (the crate is built without its blocking API).
mod http {
    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
    }

    /// POSTs every body at once (concurrent requests); the answers in order.
    pub fn post_all(url: &str, bodies: &[serde_json::Value]) -> Vec<(u16, serde_json::Value)> {
        rt().block_on(async {
            let c = reqwest::Client::new();
            let calls = bodies.iter().map(|b| {
                let c = c.clone();
                async move {
                    let r = c.post(url).json(b).send().await.unwrap();
                    (r.status().as_u16(), r.json().await.unwrap())
                }
            });
            futures_util::future::join_all(calls).await
        })
    }

    /// GETs a JSON body.
    pub fn get(url: &str) -> serde_json::Value {
        rt().block_on(async { reqwest::get(url).await.unwrap().json().await.unwrap() })
    }

    /// POSTs JSON; the status and the body as JSON.
    pub fn post(url: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
        rt().block_on(async {
            let r = reqwest::Client::new().post(url).json(body).send().await.unwrap();
            let status = r.status().as_u16();
            (status, r.json().await.unwrap())
        })
    }
}

impl Server {
    fn post(&self, path: &str, body: Value) -> (u16, Value) {
        http::post(&format!("{}{path}", self.base), &body)
    }

    /// A request that must fail with `status`; returns the error's message.
    fn refused(&self, path: &str, body: Value, status: u16) -> String {
        let (s, v) = self.post(path, body.clone());
        assert_eq!(s, status, "{path} {body}: {v}");
        v["error"]["message"].as_str().unwrap_or_else(|| panic!("{path}: no error message in {v}")).to_string()
    }
}

/// The little-endian f32 vector in OpenAI's base64 `embedding`.
fn decode_base64(s: &str) -> Vec<f32> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("not base64: {c}"),
    } as u32;
    let mut bytes = Vec::new();
    for chunk in s.as_bytes().chunks(4) {
        let n = chunk.iter().filter(|&&c| c != b'=').fold(0u32, |acc, &c| acc << 6 | val(c));
        let valid = chunk.iter().filter(|&&c| c != b'=').count();
        let n = n << (6 * (4 - valid));
        bytes.extend(&[(n >> 16) as u8, (n >> 8) as u8, n as u8][..valid - 1]);
    }
    bytes.chunks(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
}

#[test]
fn embedding_server_matches_transformers_on_every_route_and_refuses_bad_input() {
    let g = golden("bert-model");
    let texts: Vec<&str> = g["inputs"].as_array().unwrap().iter().map(|i| i["text"].as_str().unwrap()).collect();
    let ids: Vec<Value> = g["inputs"].as_array().unwrap().iter().map(|i| i["input_ids"].clone()).collect();
    let want: Vec<Vec<f32>> = g["embedding"].as_array().unwrap().iter().map(floats).collect();
    let n_tokens: usize = ids.iter().map(|i| i.as_array().unwrap().len()).sum();
    let server = start(&fixture("bert-model"));

    // OpenAI: a list of strings, floats, usage counted.
    let (s, v) = server.post("/v1/embeddings", json!({"input": texts, "model": "x"}));
    assert_eq!(s, 200, "{v}");
    assert_eq!((v["object"].as_str(), v["model"].as_str()), (Some("list"), Some("x")));
    assert_eq!(v["usage"], json!({"prompt_tokens": n_tokens, "total_tokens": n_tokens}));
    for (i, d) in v["data"].as_array().unwrap().iter().enumerate() {
        assert_eq!((d["object"].as_str(), d["index"].as_u64()), (Some("embedding"), Some(i as u64)));
        let diff = max_diff(&floats(&d["embedding"]), &want[i]);
        assert!(diff <= 1e-4, "input {i}: {diff}");
    }
    // One string; token ids; lists of token ids; base64 — all the same vectors.
    let (_, one) = server.post("/v1/embeddings", json!({"input": texts[2]}));
    assert!(max_diff(&floats(&one["data"][0]["embedding"]), &want[2]) <= 1e-4);
    let (_, by_ids) = server.post("/v1/embeddings", json!({"input": ids[1]}));
    assert!(max_diff(&floats(&by_ids["data"][0]["embedding"]), &want[1]) <= 1e-4);
    let (_, lists) = server.post("/v1/embeddings", json!({"input": ids, "encoding_format": "base64"}));
    for (i, d) in lists["data"].as_array().unwrap().iter().enumerate() {
        let v = decode_base64(d["embedding"].as_str().unwrap());
        assert!(max_diff(&v, &want[i]) <= 1e-4, "base64 input {i}");
    }
    let (s, _) = server.post("/v1/embeddings", json!({"input": "hi", "dimensions": 64}));
    assert_eq!(s, 200, "the model's own width is accepted");
    // Matryoshka `dimensions`: the first N values, normalised again (the fixture normalises).
    let (s, v) = server.post("/v1/embeddings", json!({"input": texts, "dimensions": 16}));
    assert_eq!(s, 200, "{v}");
    for (i, d) in v["data"].as_array().unwrap().iter().enumerate() {
        let got = floats(&d["embedding"]);
        let norm = want[i][..16].iter().map(|x| x * x).sum::<f32>().sqrt();
        let expected: Vec<f32> = want[i][..16].iter().map(|x| x / norm).collect();
        assert!(max_diff(&got, &expected) <= 1e-4, "shortened input {i}: {got:?}");
    }

    // llama-server's shape, under both names, with `content` or `input`.
    for path in ["/embedding", "/embeddings"] {
        let (s, v) = server.post(path, json!({"content": texts[0]}));
        assert_eq!(s, 200, "{v}");
        assert_eq!(v[0]["index"], 0);
        assert!(max_diff(&floats(&v[0]["embedding"][0]), &want[0]) <= 1e-4);
        let (_, v) = server.post(path, json!({"input": [texts[0], texts[1]]}));
        assert_eq!(v.as_array().unwrap().len(), 2);
    }
    // llama-server's embd_normalize: the same direction, scaled to the norm asked for.
    let (s, v) = server.post("/embedding", json!({"content": texts[0], "embd_normalize": 0}));
    assert_eq!(s, 200, "{v}");
    let int16 = floats(&v[0]["embedding"][0]);
    assert!((int16.iter().fold(0.0f32, |m, x| m.max(x.abs())) - 32760.0).abs() < 0.1, "{int16:?}");
    assert!(cos(&int16, &want[0]) > 0.9999);
    let (_, v) = server.post("/v1/embeddings", json!({"input": texts[0], "embd_normalize": 1}));
    let taxicab = floats(&v["data"][0]["embedding"]);
    assert!((taxicab.iter().map(|x| x.abs()).sum::<f32>() - 1.0).abs() < 1e-4);
    assert!(cos(&taxicab, &want[0]) > 0.9999);
    let m = server.refused("/embedding", json!({"content": "x", "embd_normalize": -1}), 400);
    assert!(m.contains("normalises its vectors"), "the fixture's pipeline normalises: {m}");
    let m = server.refused("/v1/embeddings", json!({"input": "x", "embd_normalize": -2}), 400);
    assert!(m.contains("embd_normalize"), "{m}");
    // llama-server's --embd-normalize: the norm of requests that name none.
    let taxicab_server = start_with(&fixture("bert-model"), &["--embd-normalize", "1"]);
    let (_, v) = taxicab_server.post("/embedding", json!({"content": texts[0]}));
    assert!((floats(&v[0]["embedding"][0]).iter().map(|x| x.abs()).sum::<f32>() - 1.0).abs() < 1e-4, "{v}");
    drop(taxicab_server);
    let out = mlxcel::testing::server_command(env!("CARGO_BIN_EXE_mlxcel-server"))
        .arg("-m")
        .arg(fixture("bert-model"))
        .args(["--port", "0", "--embd-normalize", "-1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--embd-normalize -1") && err.contains("normalises"), "{err}");

    // Bad input: clear 400s naming the field, never a crash.
    let m = server.refused("/v1/embeddings", json!({"input": []}), 400);
    assert!(m.contains("empty list"), "{m}");
    let m = server.refused("/v1/embeddings", json!({"input": ""}), 400);
    assert!(m.contains("empty string"), "{m}");
    let m = server.refused("/v1/embeddings", json!({"input": ["ok", ""]}), 400);
    assert!(m.contains("input[1]"), "{m}");
    let m = server.refused("/v1/embeddings", json!({"input": [[2, 100000]]}), 400);
    assert!(m.contains("100000") && m.contains("vocabulary"), "{m}");
    let m = server.refused("/v1/embeddings", json!({"input": [2, -1]}), 400);
    assert!(m.contains("input"), "{m}");
    // The fixture has no max_seq_length and its tokenizer.json no truncation: a longer text is cut at
    // its tokenizer_config's model_max_length (64, its positions), as sentence-transformers cuts it;
    // token ids over it are refused.
    let (long, longer) = ("the quick brown fox ".repeat(40), "the quick brown fox ".repeat(50));
    let (s, v) = server.post("/v1/embeddings", json!({"input": [long, longer]}));
    assert_eq!((s, v["usage"]["prompt_tokens"].as_u64()), (200, Some(128)), "{v}");
    assert_eq!(v["data"][0]["embedding"], v["data"][1]["embedding"]);
    let m = server.refused("/v1/embeddings", json!({"input": vec![2; 65]}), 400);
    assert!(m.contains("at most 64"), "{m}");
    let (s, v) = server.post("/v1/embeddings", json!({"input": "x", "dimensions": 65}));
    assert_eq!(s, 400, "{v}");
    assert_eq!(v["error"]["param"], "dimensions", "OpenAI's error shape: {v}");
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("only 64 dimensions"), "{v}");
    let m = server.refused("/v1/embeddings", json!({"input": "x", "dimensions": 0}), 400);
    assert!(m.contains("at least 1"), "{m}");
    let m = server.refused("/v1/embeddings", json!({"input": "x", "encoding_format": "int8"}), 400);
    assert!(m.contains("encoding_format"), "{m}");
    let m = server.refused("/embedding", json!({}), 400);
    assert!(m.contains("content"), "{m}");

    // What the model cannot do: a 400 in each dialect's shape.
    let m = server.refused("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}]}), 400);
    assert!(m.contains("embedding model") && m.contains("/v1/embeddings"), "{m}");
    let (s, v) = server.post("/v1/messages", json!({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}));
    assert_eq!((s, v["type"].as_str()), (400, Some("error")), "{v}");
    let (s, v) = server.post("/completion", json!({"prompt": "hi"}));
    assert_eq!((s, v["error"]["code"].as_u64()), (400, Some(400)), "{v}");
    let m = server.refused("/v1/responses", json!({"input": "hi"}), 400);
    assert!(m.contains("embedding model"), "{m}");
    let m = server.refused(
        "/v1/chat/completions/input_tokens",
        json!({"messages": [{"role": "user", "content": "hi"}]}),
        400,
    );
    assert!(m.contains("embedding model"), "{m}");
    let (s, v) = server.post("/infill", json!({"input_prefix": "a", "input_suffix": "b"}));
    assert_eq!((s, v["error"]["code"].as_u64()), (400, Some(400)), "{v}");
    let m = server.refused("/v1/rerank", json!({"query": "a", "documents": ["b"]}), 400);
    assert!(m.contains("cross-encoder"), "{m}");
    // The server still works after all that, and concurrent requests (which the encoder may gather into
    // shared passes) get exactly what each input gets alone.
    let bodies: Vec<Value> = (0..12).map(|i| json!({"input": [texts[i % 3], texts[(i + 1) % 3]]})).collect();
    let answers = http::post_all(&format!("{}/v1/embeddings", server.base), &bodies);
    for (i, (s, v)) in answers.iter().enumerate() {
        assert_eq!(*s, 200, "{v}");
        for (j, k) in [(0, i % 3), (1, (i + 1) % 3)] {
            let (_, alone) = server.post("/v1/embeddings", json!({"input": texts[k]}));
            assert_eq!(v["data"][j]["embedding"], alone["data"][0]["embedding"], "request {i}, input {j}");
        }
    }
    drop(server);
    // An embedding pass keeps no KV: the cache types are refused by name, not accepted and ignored.
    let out = mlxcel::testing::server_command(env!("CARGO_BIN_EXE_mlxcel-server"))
        .arg("-m")
        .arg(fixture("bert-model"))
        .args(["--port", "0", "-ctk", "bf16"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--cache-type-k: an embedding model does not use this flag"),
        "{err}"
    );
}

#[test]
fn rerank_server_orders_documents_by_the_cross_encoders_scores() {
    for name in ["bert-rerank", "xlmr-rerank"] {
        let g = golden(name);
        let pairs = g["inputs"].as_array().unwrap();
        let scores = floats(&g["scores"]);
        // The first two golden pairs share their query.
        let query = pairs[0]["text"].as_str().unwrap();
        let docs = [pairs[0]["text_pair"].as_str().unwrap(), pairs[1]["text_pair"].as_str().unwrap()];
        let sigmoid = |x: f32| 1.0 / (1.0 + (-x).exp());
        let best = if scores[0] >= scores[1] { 0 } else { 1 };
        let server = start(&fixture(name));

        for path in ["/rerank", "/v1/rerank", "/reranking", "/v1/reranking"] {
            let (s, v) = server.post(path, json!({"query": query, "documents": docs}));
            assert_eq!(s, 200, "{name} {path}: {v}");
            let results = v["results"].as_array().unwrap();
            assert_eq!(results.len(), 2);
            assert_eq!(results[0]["index"], best, "{name}: best first: {v}");
            for r in results {
                let i = r["index"].as_u64().unwrap() as usize;
                let got = r["relevance_score"].as_f64().unwrap() as f32;
                assert!((got - sigmoid(scores[i])).abs() <= 1e-4, "{name}: document {i}: {got}");
                assert!(r.get("document").is_none());
            }
            assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 0);
        }
        let (_, v) = server.post(
            "/v1/rerank",
            json!({"query": query, "documents": [{"text": docs[0]}, docs[1]], "top_n": 1, "return_documents": true}),
        );
        let results = v["results"].as_array().unwrap();
        assert_eq!(results.len(), 1, "{v}");
        assert_eq!(results[0]["document"]["text"], docs[best]);
        // Hugging Face TEI's shape, as llama-server takes it: `texts` in, a bare list of scores out.
        let (s, v) = server.post("/rerank", json!({"query": query, "texts": docs, "return_text": true}));
        assert_eq!(s, 200, "{v}");
        let list = v.as_array().unwrap_or_else(|| panic!("a bare list: {v}"));
        assert_eq!(
            (list.len(), list[0]["index"].as_u64(), &list[0]["text"]),
            (docs.len(), Some(best as u64), &json!(docs[best]))
        );
        assert!((list[0]["score"].as_f64().unwrap() as f32 - sigmoid(scores[best])).abs() <= 1e-4, "{v}");
        // A document field that would not be scored is refused, not dropped.
        let m = server.refused("/rerank", json!({"query": query, "documents": [{"text": "b", "title": "t"}]}), 400);
        assert!(m.contains("documents[0]") && m.contains("no other field"), "{m}");

        let m = server.refused("/rerank", json!({"query": query, "documents": []}), 400);
        assert!(m.contains("documents"), "{m}");
        let m = server.refused("/rerank", json!({"query": "", "documents": ["a"]}), 400);
        assert!(m.contains("query"), "{m}");
        let m = server.refused("/v1/rerank", json!({"query": "a", "documents": ["b"], "top_n": 0}), 400);
        assert!(m.contains("top_n"), "{m}");
        let m = server.refused("/v1/embeddings", json!({"input": "a"}), 400);
        assert!(m.contains("reranker"), "{m}");
        let m = server.refused("/completion", json!({"prompt": "a"}), 400);
        assert!(m.contains("/v1/rerank"), "{m}");
    }
}

#[test]
fn a_text_model_answers_embedding_and_rerank_routes_with_a_clear_400() {
    let model = mlxcel::testing::workspace_root().join("families/llama/tests/fixtures/llama-f32");
    let server = start(&model);
    let m = server.refused("/v1/embeddings", json!({"input": "hello"}), 400);
    assert!(m.contains("text-generation model") && m.contains("embedding model") && m.contains("--embedding"), "{m}");
    let (s, v) = server.post("/embedding", json!({"content": "hello"}));
    assert_eq!((s, v["error"]["code"].as_u64()), (400, Some(400)), "llama-server's shape: {v}");
    let m = server.refused("/rerank", json!({"query": "a", "documents": ["b"]}), 400);
    assert!(m.contains("reranking needs a cross-encoder model"), "{m}");
}

fn mlxcel(args: &[&str]) -> (bool, Value, String) {
    mlxcel::testing::staged_plugin_dir();
    let out = Command::new(env!("CARGO_BIN_EXE_mlxcel")).args(args).env_remove("MLXCEL_PLUGIN_PATH").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let v = serde_json::from_str(&stdout).unwrap_or(Value::Null);
    (out.status.success(), v, String::from_utf8_lossy(&out.stderr).to_string())
}

#[test]
fn embed_and_rerank_commands_print_json_and_refuse_the_wrong_model() {
    let g = golden("bert-model");
    let texts: Vec<&str> = g["inputs"].as_array().unwrap().iter().map(|i| i["text"].as_str().unwrap()).collect();
    let want: Vec<Vec<f32>> = g["embedding"].as_array().unwrap().iter().map(floats).collect();
    let model = fixture("bert-model");
    let mut args = vec!["embed", "-m", model.to_str().unwrap(), "-p"];
    args.extend(&texts);
    let (ok, v, err) = mlxcel(&args);
    assert!(ok, "{err}");
    assert_eq!(v["dimensions"], 64);
    for (i, d) in v["data"].as_array().unwrap().iter().enumerate() {
        assert_eq!(d["text"], texts[i]);
        assert!(max_diff(&floats(&d["embedding"]), &want[i]) <= 1e-4, "input {i}");
    }
    let (ok, v, err) = mlxcel(&["embed", "-m", model.to_str().unwrap(), "--dimensions", "8", "-p", texts[0]]);
    assert!(ok, "{err}");
    assert_eq!(v["dimensions"], 8);
    let got = floats(&v["data"][0]["embedding"]);
    let norm = want[0][..8].iter().map(|x| x * x).sum::<f32>().sqrt();
    let expected: Vec<f32> = want[0][..8].iter().map(|x| x / norm).collect();
    assert!(max_diff(&got, &expected) <= 1e-4, "{got:?}");
    let (ok, _, err) = mlxcel(&["embed", "-m", model.to_str().unwrap(), "--dimensions", "65", "-p", "x"]);
    assert!(!ok && err.contains("--dimensions") && err.contains("only 64"), "{err}");

    let g = golden("bert-rerank");
    let pairs = g["inputs"].as_array().unwrap();
    let scores = floats(&g["scores"]);
    let rerank = fixture("bert-rerank");
    let (q, d0, d1) = (
        pairs[0]["text"].as_str().unwrap(),
        pairs[0]["text_pair"].as_str().unwrap(),
        pairs[1]["text_pair"].as_str().unwrap(),
    );
    let (ok, v, err) = mlxcel(&["rerank", "-m", rerank.to_str().unwrap(), "-q", q, "-d", d1, d0]);
    assert!(ok, "{err}");
    let order: Vec<u64> = v["results"].as_array().unwrap().iter().map(|r| r["index"].as_u64().unwrap()).collect();
    // d1 was given first (index 0), d0 second (index 1).
    assert_eq!(order, if scores[0] >= scores[1] { [1, 0] } else { [0, 1] }, "{v}");
    assert_eq!(v["results"][0]["document"], if scores[0] >= scores[1] { d0 } else { d1 });

    let (ok, _, err) = mlxcel(&["embed", "-m", rerank.to_str().unwrap(), "-p", "x"]);
    assert!(!ok && err.contains("mlxcel rerank"), "{err}");
    let (ok, _, err) = mlxcel(&["rerank", "-m", model.to_str().unwrap(), "-q", "a", "-d", "b"]);
    assert!(!ok && err.contains("mlxcel embed"), "{err}");
    let (ok, _, err) = mlxcel(&["embed", "-m", model.to_str().unwrap(), "-p", ""]);
    assert!(!ok && err.contains("empty string") && !err.contains("panicked"), "{err}");
}

/// The llama family's Qwen3-Embedding-style fixture (families/llama/tests/fixtures/generate_embedding.py).
fn qwen3_embedding() -> (PathBuf, Value) {
    let dir = mlxcel::testing::workspace_root().join("families/llama/tests/fixtures/qwen3-embedding");
    let g = serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    (dir, g)
}

#[test]
fn a_decoder_embedding_model_is_served_without_flags_and_a_plain_decoder_with_embedding_or_pooling() {
    let (dir, g) = qwen3_embedding();
    let texts: Vec<&str> = g["inputs"].as_array().unwrap().iter().map(|i| i["text"].as_str().unwrap()).collect();
    let want: Vec<Vec<f32>> = g["embedding"].as_array().unwrap().iter().map(floats).collect();
    let want16: Vec<Vec<f32>> = g["embedding_16"].as_array().unwrap().iter().map(floats).collect();
    let server = start(&dir);
    let (s, v) = server.post("/v1/embeddings", json!({"input": texts}));
    assert_eq!(s, 200, "{v}");
    for (i, d) in v["data"].as_array().unwrap().iter().enumerate() {
        assert!(max_diff(&floats(&d["embedding"]), &want[i]) <= 1e-4, "input {i}");
    }
    // Matryoshka against sentence-transformers' truncate_dim (then normalised).
    let (s, v) = server.post("/v1/embeddings", json!({"input": texts, "dimensions": 16}));
    assert_eq!(s, 200, "{v}");
    for (i, d) in v["data"].as_array().unwrap().iter().enumerate() {
        assert!(max_diff(&floats(&d["embedding"]), &want16[i]) <= 1e-4, "input {i} at 16 dimensions");
    }
    let m = server.refused("/v1/chat/completions", json!({"messages": [{"role": "user", "content": "hi"}]}), 400);
    assert!(m.contains("embedding model"), "{m}");
    drop(server);
    // Text-generation flags are refused by name, not accepted and ignored.
    let out = mlxcel::testing::server_command(env!("CARGO_BIN_EXE_mlxcel-server"))
        .arg("-m")
        .arg(&dir)
        .args(["--port", "0", "-c", "64", "-n", "16", "--top-k", "5", "--reasoning-budget", "0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("an embedding model does not use these flags") && !err.contains("--ctx-size"), "{err}");
    for flag in ["--n-predict", "--top-k", "--reasoning-budget"] {
        assert!(err.contains(flag), "{flag}: {err}");
    }

    // The same weights without sentence-transformers files: a text model, unless asked.
    let bare = tempfile::tempdir().unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(dir.join(f), bare.path().join(f)).unwrap();
    }
    let m = bare.path().to_str().unwrap();
    let (ok, _, err) = mlxcel(&["embed", "-m", m, "-p", texts[1]]);
    assert!(!ok && err.contains("text-generation model"), "{err}");
    let (ok, v, err) = mlxcel(&["embed", "-m", m, "--pooling", "last", "-p", texts[1], texts[2]]);
    assert!(ok, "{err}");
    for (i, d) in v["data"].as_array().unwrap().iter().enumerate() {
        assert!(max_diff(&floats(&d["embedding"]), &want[i + 1]) <= 1e-4, "mlxcel embed --pooling last: input {i}");
    }
    // A family that has no embedding mode says so rather than serving text.
    let gemma = mlxcel::testing::workspace_root().join("families/gemma/tests/fixtures/gemma-f32");
    let (ok, _, err) = mlxcel(&["embed", "-m", gemma.to_str().unwrap(), "--pooling", "last", "-p", "x"]);
    assert!(!ok && err.contains("cannot run") && err.contains("as an embedding model"), "{err}");
    let server = start_with(bare.path(), &["--embedding"]);
    let (s, v) = server.post("/v1/embeddings", json!({"input": texts[2]}));
    assert_eq!(s, 200, "{v}");
    assert!(max_diff(&floats(&v["data"][0]["embedding"]), &want[2]) <= 1e-4, "mlxcel-server --embedding");
}

fn minilm() -> Option<PathBuf> {
    Some(mlxcel::testing::test_models()?.join("all-minilm-l6-v2"))
}

fn reference() -> (PathBuf, Value) {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/minilm-reference.json");
    let v = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    (path, v)
}

/// A short request that arrives while a long one runs is answered in the next pass, not after the
/// long one: passes take each waiting request's next inputs in turn.
#[test]
fn a_short_request_is_not_held_behind_a_long_one() {
    let Some(model) = minilm() else { return };
    // Small passes (-b 256: about 25 of these inputs), so the long request takes many.
    let server = start_with(&model, &["-b", "256"]);
    let url = format!("{}/v1/embeddings", server.base);
    let busy = || http::get(&format!("{}/slots", server.base))[0]["is_processing"] == true;
    let long: Vec<String> = (0..2000).map(|i| format!("sentence number {i} is about the weather")).collect();
    std::thread::scope(|s| {
        s.spawn(|| {
            let (status, v) = http::post(&url, &json!({"input": long}));
            assert_eq!((status, v["data"].as_array().map(Vec::len)), (200, Some(2000)));
        });
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while !busy() {
            assert!(std::time::Instant::now() < deadline, "the long request never started");
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        let (status, v) = http::post(&url, &json!({"input": "a short one"}));
        assert_eq!((status, v["data"].as_array().map(Vec::len)), (200, Some(1)));
        // Held behind it, the short request would have been answered after the long one's passes.
        assert!(busy(), "the long request had finished before the short one was answered");
    });
}

#[test]
fn all_minilm_embeddings_match_the_numpy_reference_and_sentence_similarity() {
    let Some(model) = minilm() else { return };
    let (_, r) = reference();
    let texts: Vec<&str> = r["inputs"].as_array().unwrap().iter().map(|i| i["text"].as_str().unwrap()).collect();
    let want: Vec<Vec<f32>> = r["embeddings"].as_array().unwrap().iter().map(floats).collect();
    let server = start(&model);
    let (s, v) = server.post("/v1/embeddings", json!({"input": texts}));
    assert_eq!(s, 200, "{v}");
    let got: Vec<Vec<f32>> = v["data"].as_array().unwrap().iter().map(|d| floats(&d["embedding"])).collect();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.len(), 384);
        let d = max_diff(g, w);
        eprintln!("all-MiniLM-L6-v2: {:?}: max |diff| {d:.2e}", texts[i]);
        assert!(d <= 1e-4, "input {i}: {d}");
    }
    // The tokenizer is the reference's too.
    let ids: usize = r["inputs"].as_array().unwrap().iter().map(|i| i["input_ids"].as_array().unwrap().len()).sum();
    assert_eq!(v["usage"]["prompt_tokens"], ids);
    let c = cos(&got[0], &got[1]);
    assert!((c - 0.755).abs() <= 0.005, "cos(eating food, eating bread) = {c}");
    for (a, b) in [(0, 2), (0, 3), (0, 4), (1, 2), (2, 4)] {
        assert!(cos(&got[a], &got[b]) < 0.2, "{a} vs {b}: {}", cos(&got[a], &got[b]));
    }
    // sentence-transformers truncates at max_seq_length 256 (tokenizer.json says 128; its fixed padding
    // to 128 is off): a long text counts 256 tokens, a short one its own length.
    let long = "word ".repeat(600);
    let (s, v) = server.post("/v1/embeddings", json!({"input": long}));
    assert_eq!((s, v["usage"]["prompt_tokens"].as_u64()), (200, Some(256)), "{v}");
    let (_, v) = server.post("/v1/embeddings", json!({"input": "hello"}));
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    // `/props` reports that limit as the context, not the model's 512 positions.
    let props = http::get(&format!("{}/props", server.base));
    assert_eq!(props["default_generation_settings"]["n_ctx"], 256, "{props}");
}

#[test]
fn openai_sdk_embeddings_create_gets_the_reference_vectors() {
    let Some(model) = minilm() else { return };
    let py = mlxcel::testing::sdk_venv_python();
    let server = start(&model);
    let (reference, _) = reference();
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/sdk/test_embeddings_sdk.py");
    let out = Command::new(py).arg(script).arg(&server.base).arg("test-model").arg(reference).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    assert!(out.status.success(), "SDK checks failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
}

/// A request past `--timeout` is a 504 naming it, and one whose client leaves runs no more passes;
/// the server goes on serving (two hundred 256-token inputs in passes of 256 tokens: seconds of
/// work on any machine these tests run on).
#[test]
fn an_embedding_request_stops_at_its_timeout_or_when_its_client_leaves() {
    let Some(model) = minilm() else { return };
    let server = start_with(&model, &["--timeout", "1", "-b", "256", "--metrics"]);
    let big = json!({"input": vec!["word ".repeat(300); 200]});
    let (s, v) = server.post("/v1/embeddings", big.clone());
    assert_eq!(s, 504, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("--timeout (1s)"), "{v}");
    let metric = |name: &str| {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let m = rt
            .block_on(async { reqwest::get(format!("{}/metrics", server.base)).await.unwrap().text().await.unwrap() });
        let line = m.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap().to_string();
        line.split_whitespace().nth(1).unwrap().parse::<f64>().unwrap()
    };
    let passes = || metric("llamacpp:n_decode_total");
    // A client that gives up after 300 ms: fewer passes than its 200 inputs run.
    let before = passes();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let url = format!("{}/v1/embeddings", server.base);
    let client = reqwest::Client::builder().timeout(std::time::Duration::from_millis(300)).build().unwrap();
    assert!(rt.block_on(async { client.post(&url).json(&big).send().await }).is_err());
    // (The connection's task lives in this runtime: dropping it closes the socket.)
    drop((client, rt));
    // Passes stop once the server sees the socket close (a pass under way finishes): wait until
    // the count holds still (were the passes to run on, until all 200 have run).
    let mut last = passes();
    for _ in 0..100 {
        std::thread::sleep(std::time::Duration::from_millis(500));
        let now = passes();
        if now == last {
            break;
        }
        last = now;
    }
    assert!(last - before < 200.0, "{before} → {last}: the whole request ran for a client that left");
    assert_eq!(metric("mlxcel_requests_cancelled_total"), 2.0, "the timed-out request and the one left");
    let (s, v) = server.post("/v1/embeddings", json!({"input": "hello"}));
    assert_eq!(s, 200, "{v}");
}
