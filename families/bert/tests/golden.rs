//! Golden tests: the bert family on the staged backend against transformers' outputs for tiny random
//! checkpoints (see `fixtures/generate.py`): a `BertModel` with sentence-transformers mean pooling and
//! normalisation, a ModernBERT embedding model, and two cross-encoders (`BertForSequenceClassification`,
//! `XLMRobertaForSequenceClassification` with its position offset and single token type).
//!
//! Both sides compute in f32; differences are summation order only (measured ≤ 1e-6), so 1e-4.

use std::path::{Path, PathBuf};

use mlxcel::engine::embed::{forward, EncodedInput, EncoderTokenizer};
use mlxcel::engine::{ModelRunner, RunnerOptions};
use mlxcel_plugin_api::Task;
use serde_json::Value;

const TOLERANCE: f32 = 1e-4;

fn backend() -> Option<String> {
    std::env::var("MLXCEL_TEST_BACKEND").ok().filter(|b| !b.is_empty())
}

fn fixture(name: &str) -> (PathBuf, Value) {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name);
    let v = serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    (dir, v)
}

fn load(dir: &Path, task: Task) -> (ModelRunner, EncoderTokenizer) {
    let catalog = mlxcel::testing::staged_catalog();
    let opts = RunnerOptions { threads: 2, backend: backend(), ..Default::default() };
    let runner =
        ModelRunner::load_for(&catalog, dir, &opts, &[task]).unwrap_or_else(|e| panic!("{}: {e:#}", dir.display()));
    assert_eq!(runner.family_name, "bert");
    if let Some(b) = backend() {
        assert_eq!(runner.backend_name, b, "MLXCEL_TEST_BACKEND asked for `{b}`");
    }
    let tok = EncoderTokenizer::load(dir, &runner.checkpoint.config, runner.info.max_positions, runner.info.vocab_size)
        .unwrap();
    (runner, tok)
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

/// The golden inputs as the tokenizer gives them (checked against the reference's ids and types).
fn inputs(tok: &EncoderTokenizer, golden: &Value) -> Vec<EncodedInput> {
    golden["inputs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| {
            let text = i["text"].as_str().unwrap();
            let enc = match i.get("text_pair") {
                Some(b) => tok.encode_pair(text, b.as_str().unwrap()).unwrap(),
                None => tok.encode(text).unwrap(),
            };
            assert_eq!(enc.ids, ids(&i["input_ids"]), "token ids of {text:?}");
            assert_eq!(enc.types, ids(&i["token_type_ids"]), "token types of {text:?}");
            enc
        })
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Runs the inputs batched and each alone; both must equal `want` (one row per input).
fn check(name: &str, runner: &mut ModelRunner, inputs: &[EncodedInput], want: &[Vec<f32>]) {
    let all: Vec<&EncodedInput> = inputs.iter().collect();
    let batched = forward(runner, &all).unwrap();
    assert_eq!(batched.len(), want.len());
    for (i, (got, want)) in batched.iter().zip(want).enumerate() {
        let d = max_diff(got, want);
        eprintln!("{name}: input {i}: max |diff| {d:.2e}");
        assert!(d <= TOLERANCE, "{name}: input {i}: max |diff| {d} > {TOLERANCE}");
        // A sequence's result does not depend on its batch-mates, bit for bit.
        let alone = forward(runner, &[&inputs[i]]).unwrap();
        assert_eq!(&alone[0], got, "{name}: input {i} differs alone and batched");
    }
}

#[test]
fn bert_sentence_embeddings_match_transformers_mean_pooled_and_normalised() {
    let (dir, golden) = fixture("bert-model");
    let (mut runner, tok) = load(&dir, Task::Embed);
    assert_eq!(runner.info.output_dim, 64);
    let inputs = inputs(&tok, &golden);
    let want: Vec<Vec<f32>> = golden["embedding"].as_array().unwrap().iter().map(floats).collect();
    check("bert-model", &mut runner, &inputs, &want);
}

/// ModernBERT: rotary positions with a global and a local base, a local layer whose window (4 either
/// side) the 25-token input exceeds, GeGLU, bias-free LayerNorms; mean-pooled and normalised.
#[test]
fn modernbert_sentence_embeddings_match_transformers_through_global_and_local_layers() {
    let (dir, golden) = fixture("modernbert-model");
    let (mut runner, tok) = load(&dir, Task::Embed);
    assert_eq!(runner.info.output_dim, 64);
    let inputs = inputs(&tok, &golden);
    let want: Vec<Vec<f32>> = golden["embedding"].as_array().unwrap().iter().map(floats).collect();
    check("modernbert-model", &mut runner, &inputs, &want);
}

#[test]
fn bert_cross_encoder_scores_match_transformers() {
    let (dir, golden) = fixture("bert-rerank");
    let (mut runner, tok) = load(&dir, Task::Rerank);
    assert_eq!(runner.info.output_dim, 1);
    let inputs = inputs(&tok, &golden);
    let want: Vec<Vec<f32>> = floats(&golden["scores"]).into_iter().map(|s| vec![s]).collect();
    check("bert-rerank", &mut runner, &inputs, &want);
}

#[test]
fn xlm_roberta_cross_encoder_scores_match_transformers() {
    let (dir, golden) = fixture("xlmr-rerank");
    let (mut runner, tok) = load(&dir, Task::Rerank);
    let inputs = inputs(&tok, &golden);
    let want: Vec<Vec<f32>> = floats(&golden["scores"]).into_iter().map(|s| vec![s]).collect();
    check("xlmr-rerank", &mut runner, &inputs, &want);
}

#[test]
fn an_embedding_model_is_refused_where_text_generation_is_wanted() {
    let (dir, _) = fixture("bert-model");
    let catalog = mlxcel::testing::staged_catalog();
    let err = ModelRunner::load(&catalog, &dir, &RunnerOptions::default()).err().expect("refused");
    let msg = format!("{err:#}");
    assert!(msg.contains("is an embedding model") && msg.contains("mlxcel embed"), "{msg}");
}
