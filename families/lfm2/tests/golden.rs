//! Golden tests: the lfm2 family against mlx-lm's logits and greedy tokens for tiny random
//! checkpoints (see `fixtures/generate.py`), through the shared harness (`mlxcel::testing::golden`):
//! one-shot prefill, chunked prefill and decode, two sequences sharing steps, greedy tokens; f32 and
//! 4-bit.
//!
//! What the fixtures exercise: convolution and attention layers in both orders; `lfm2`'s 3-tap window
//! (as the real models) cut by the harness's prefill chunks (7, 13, 5, then chunks of 5), its kernel in
//! the Hugging Face layout `[C, 1, K]` (f32) and the MLX one `[C, K, 1]` (q4), the auto-adjusted MLP
//! width; `lfm2-conv6`'s 6-tap window, whose 5-row state spans a whole 5-token chunk, with biases on
//! `in_proj`, the convolution and `out_proj`. Each sequence of a batch carries its own window.
//!
//! And the engine with a recurrent family: the prefix cache cannot share a prefix's pages when the
//! convolution state lies outside them, so it says so and recomputes; requests sharing a prefix give
//! what each gives alone.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use mlxcel::engine::{
    Engine, EngineHandle, EngineOptions, GenerationEvent, GenerationRequest, ModelRunner, RequestStream, RunnerOptions,
    SamplingParams,
};
use mlxcel::testing::golden::{backend, run_case};
use mlxcel::text::TextTokenizer;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

#[test]
fn lfm2_matches_mlx_lm() {
    run_case(&fixtures(), "lfm2");
}

#[test]
fn lfm2_with_a_window_spanning_a_prefill_chunk_and_biases_matches_mlx_lm() {
    run_case(&fixtures(), "lfm2-conv6");
}

/// `mlxcel arch` lists what the staged plugins report: this plugin and its architectures.
#[test]
fn the_lfm2_plugin_lists_its_architectures() {
    let catalog = mlxcel::testing::staged_catalog();
    let family = catalog.families.iter().find(|f| f.meta.name == "lfm2").expect("the lfm2 plugin is staged");
    assert_eq!(family.architectures(), ["lfm2"]);
}

fn start(dir: &Path, parallel: usize) -> EngineHandle {
    let ropts = RunnerOptions { ctx_size: 256, parallel, threads: 2, backend: backend(), ..Default::default() };
    let runner = ModelRunner::load(&mlxcel::testing::staged_catalog(), dir, &ropts)
        .unwrap_or_else(|e| panic!("{}: {e:#}", dir.display()));
    assert!(!runner.pool.prefix_reusable(), "a model with convolution state must not share prefix pages");
    let tok =
        TextTokenizer::load(dir, &runner.checkpoint.config, runner.checkpoint.generation_config.as_ref()).unwrap();
    Engine::start(runner, Arc::new(tok), EngineOptions { parallel, ..Default::default() }).unwrap()
}

/// Tokens and cached prompt tokens of one request.
fn collect(mut s: RequestStream) -> (Vec<u32>, usize) {
    let mut tokens = Vec::new();
    let mut cached = usize::MAX;
    while let Some(e) = s.blocking_next() {
        match e {
            GenerationEvent::Text { tokens: t, .. } => tokens.extend(t),
            GenerationEvent::Started { .. }
            | GenerationEvent::PromptProgress { .. }
            | GenerationEvent::PromptLogprobs(_)
            | GenerationEvent::EndToken(_) => {}
            GenerationEvent::Done { usage, .. } => cached = usage.cached_tokens,
            GenerationEvent::Error(e) => panic!("request failed: {e}"),
        }
    }
    (tokens, cached)
}

#[test]
fn requests_sharing_a_prefix_recompute_it_and_answer_as_alone() {
    let dir = fixtures().join("lfm2-f32");
    let prefix: Vec<u32> = (0..150).map(|i| 3 + (i * 37 % 310) as u32).collect();
    let req = |tail: &[u32]| {
        let mut r = GenerationRequest::new([&prefix[..], tail].concat(), SamplingParams::greedy(), 12);
        r.ignore_eos = true;
        r
    };
    let reqs = [req(&[5, 6, 7]), req(&[9, 8]), req(&[11])];

    let solo = start(&dir, 1);
    let want: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| {
            let (tokens, cached) = collect(solo.submit(r.clone()).unwrap());
            assert_eq!(cached, 0, "a prefix was reused although the model keeps state outside its pages");
            tokens
        })
        .collect();
    solo.shutdown();

    // Together, each prefilling the shared prefix beside the others, and again after they finished.
    let engine = start(&dir, 3);
    for round in 0..2 {
        let streams: Vec<RequestStream> = reqs.iter().map(|r| engine.submit(r.clone()).unwrap()).collect();
        for (i, (s, w)) in streams.into_iter().zip(&want).enumerate() {
            let (tokens, cached) = collect(s);
            assert_eq!(cached, 0, "round {round}, request {i}: no prefix reuse");
            assert_eq!(&tokens, w, "round {round}, request {i}: with others vs alone");
        }
    }
    engine.shutdown();
}
