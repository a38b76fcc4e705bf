//! Golden tests: mlxcel's llama family against mlx-lm's logits and greedy tokens for tiny random
//! checkpoints (see `fixtures/generate.py`), through the shared harness (`mlxcel::testing::golden`:
//! one-shot prefill, chunked prefill and decode, two sequences sharing steps, greedy tokens; f32 and
//! 4-bit, on `MLXCEL_TEST_BACKEND` or the host's choice), plus batch invariance through a
//! sliding-window layer and every usable backend in one process.

use std::path::PathBuf;
use std::sync::atomic::AtomicBool;

use mlxcel::engine::{
    GenerateOptions, Logits, ModelRunner, RunnerOptions, SamplingParams, SeqBlocks, SeqChunk, Session,
};
use mlxcel::testing::golden::{forward_alone, load_runner, run_case, Golden};
use mlxcel::text::TextTokenizer;
use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

#[test]
fn llama_matches_mlx_lm() {
    run_case(&fixtures(), "llama");
}

#[test]
fn mistral_matches_mlx_lm() {
    run_case(&fixtures(), "mistral");
}

/// Mistral with `sliding_window: 8` on alternating layers and a 66-token sequence: attention and the
/// cache's released window pages against mlx-lm past the window.
#[test]
fn mistral_sliding_window_matches_mlx_lm() {
    run_case(&fixtures(), "mistral-swa");
}

#[test]
fn qwen2_matches_mlx_lm() {
    run_case(&fixtures(), "qwen2");
}

#[test]
fn qwen3_matches_mlx_lm() {
    run_case(&fixtures(), "qwen3");
}

/// A copy of a fixture whose first layer attends through a sliding window of 8 positions (the
/// layer-types mechanism mlx-lm's llama uses): with blocks of 16, its window pages are released once a
/// sequence passes 24 tokens.
fn windowed_fixture(name: &str) -> tempfile::TempDir {
    let src = fixtures().join(name);
    let dir = tempfile::tempdir().unwrap();
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.path().join(f.file_name().unwrap())).unwrap();
    }
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let n = cfg["num_hidden_layers"].as_u64().unwrap() as usize;
    let types: Vec<&str> = (0..n).map(|i| if i % 2 == 0 { "sliding_attention" } else { "full_attention" }).collect();
    cfg["layer_types"] = serde_json::json!(types);
    cfg["sliding_window"] = serde_json::json!(8);
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).unwrap();
    dir
}

/// Batch invariance: a sequence's logits are bit-for-bit the same alone and inside mixed batches (one
/// decoding through a window layer whose early pages were released, another prefilling a long prompt
/// that takes other kernel paths), in either order.
#[test]
fn a_sequence_gives_the_same_logits_alone_and_in_mixed_batches() {
    for fixture_name in ["qwen3-q4", "llama-f32"] {
        let dir = windowed_fixture(fixture_name);
        let mut runner = load_runner(dir.path());
        let v = runner.info.vocab_size;
        let vocab = v as u32;
        let prompt_a: Vec<u32> = (0..30).map(|i| (i * 7 + 3) % vocab).collect();
        let decode_a: Vec<u32> = (0..4).map(|i| (i * 11 + 5) % vocab).collect();
        let prompt_b: Vec<u32> = (0..80).map(|i| (i * 13 + 1) % vocab).collect();

        // Alone: A's prompt, then A's decode steps; B's long prompt.
        let mut sa = SeqBlocks::default();
        runner.pool.reserve(&mut sa, prompt_a.len()).unwrap();
        runner.forward(&[SeqChunk { blocks: &sa, tokens: &prompt_a, start_pos: 0, logits: Logits::Last }]).unwrap();
        sa.len = prompt_a.len();
        let mut alone_a = Vec::new();
        for &tok in &decode_a {
            let next = sa.len + 1;
            runner.pool.reserve(&mut sa, next).unwrap();
            let out = runner
                .forward(&[SeqChunk { blocks: &sa, tokens: &[tok], start_pos: sa.len, logits: Logits::Last }])
                .unwrap();
            alone_a.push(out);
            sa.len += 1;
        }
        assert!(sa.released, "{fixture_name}: the window layer should have released pages by now");
        runner.pool.release(&mut sa);
        let alone_b = forward_alone(&mut runner, &prompt_b, Logits::Last);

        // Mixed: A decodes while B prefills (B first on even steps), then A alone with a second decoder.
        let mut sa = SeqBlocks::default();
        runner.pool.reserve(&mut sa, prompt_a.len()).unwrap();
        runner.forward(&[SeqChunk { blocks: &sa, tokens: &prompt_a, start_pos: 0, logits: Logits::Last }]).unwrap();
        sa.len = prompt_a.len();
        for (step, &tok) in decode_a.iter().enumerate() {
            let next = sa.len + 1;
            runner.pool.reserve(&mut sa, next).unwrap();
            let mut sb = SeqBlocks::default();
            runner.pool.reserve(&mut sb, prompt_b.len()).unwrap();
            let a_chunk =
                SeqChunk { blocks: &sa, tokens: std::slice::from_ref(&tok), start_pos: sa.len, logits: Logits::Last };
            let b_chunk = SeqChunk { blocks: &sb, tokens: &prompt_b, start_pos: 0, logits: Logits::Last };
            let (a_row, b_row) = if step % 2 == 0 {
                let out = runner.forward(&[a_chunk, b_chunk]).unwrap();
                (out[..v].to_vec(), out[v..].to_vec())
            } else {
                let out = runner.forward(&[b_chunk, a_chunk]).unwrap();
                (out[v..].to_vec(), out[..v].to_vec())
            };
            assert_eq!(a_row, alone_a[step], "{fixture_name}: decode step {step} of A changed in a mixed batch");
            assert_eq!(b_row, alone_b, "{fixture_name}: B's prompt logits changed in a mixed batch (step {step})");
            runner.pool.release(&mut sb);
            sa.len += 1;
        }
    }
}

/// Every usable staged backend in one process (the CPU plugin and, when built with libmlx, the MLX
/// one): each gives mlx-lm's greedy tokens, one after the other in the same host.
#[test]
fn every_usable_backend_in_one_process_gives_the_same_greedy_tokens() {
    let catalog = mlxcel::testing::staged_catalog();
    let names: Vec<String> =
        catalog.backends.iter().filter(|b| b.describe().score > 0).map(|b| b.name().to_string()).collect();
    for case in ["qwen3-q4", "llama-f32"] {
        let g = Golden::load(&fixtures(), case);
        for name in &names {
            let opts = RunnerOptions { ctx_size: 256, threads: 2, backend: Some(name.clone()), ..Default::default() };
            let mut runner = ModelRunner::load(&catalog, &g.dir, &opts).unwrap_or_else(|e| panic!("{name}: {e:#}"));
            let tok = TextTokenizer::load(&g.dir, &runner.checkpoint.config, None).unwrap();
            let opts = GenerateOptions {
                sampling: SamplingParams::greedy(),
                max_tokens: g.greedy.len(),
                ignore_eos: true,
                ..Default::default()
            };
            let out = Session::new()
                .generate(&mut runner, &tok, &g.tokens, &opts, &AtomicBool::new(false), &mut |_| {})
                .unwrap();
            assert_eq!(out.tokens, g.greedy, "{case} on backend {name}: greedy tokens differ from mlx-lm");
            eprintln!("{case}: backend {name} gives mlx-lm's greedy tokens");
        }
    }
}
