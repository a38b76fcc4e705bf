//! Golden tests: mlxcel's llama family against mlx-lm's logits and greedy tokens for tiny random
//! checkpoints (see `fixtures/generate.py`), through the shared harness (`mlxcel::testing::golden`:
//! one-shot prefill, chunked prefill and decode, two sequences sharing steps, greedy tokens; f32 and
//! 4-bit, on `MLXCEL_TEST_BACKEND` or the host's choice), plus batch invariance through a
//! sliding-window layer and every usable backend in one process; and a Qwen3 body run as an embedding
//! model against sentence-transformers (`fixtures/generate_embedding.py`).

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
/// that takes other kernel paths — the float tiles of 64 tokens or more, except for 4-bit weights on
/// AVX-512 VNNI, whose panel kernel takes every step: the forced paths of `cargo xtask test` cover
/// the mixed case there), in either order.
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

/// The Qwen3-Embedding-style fixture (`fixtures/generate_embedding.py`): a Qwen3 body saved without the
/// `model.` prefix, with sentence-transformers files (last-token pooling, Normalize, max_seq_length).
mod embedding {
    use std::path::{Path, PathBuf};

    use mlxcel::engine::embed::{forward, shorten, EncodedInput, EncoderTokenizer};
    use mlxcel::engine::{EmbeddingFlags, ModelRunner, RunnerOptions};
    use mlxcel_plugin_api::Task;
    use serde_json::Value;

    use mlxcel::checkpoint::sentence_transformers::PoolingFlag;

    /// Both sides compute in f32; the differences are summation order only.
    const TOLERANCE: f32 = 1e-4;

    fn fixture() -> (PathBuf, Value) {
        let dir = super::fixtures().join("qwen3-embedding");
        let v = serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
        (dir, v)
    }

    fn load(dir: &Path, embedding: Option<EmbeddingFlags>) -> (ModelRunner, EncoderTokenizer) {
        let catalog = mlxcel::testing::staged_catalog();
        let backend = std::env::var("MLXCEL_TEST_BACKEND").ok().filter(|b| !b.is_empty());
        let opts = RunnerOptions { threads: 2, backend, embedding, ..Default::default() };
        let runner = ModelRunner::load_for(&catalog, dir, &opts, &[Task::Embed])
            .unwrap_or_else(|e| panic!("{}: {e:#}", dir.display()));
        assert_eq!((runner.family_name.as_str(), runner.info.output_dim), ("llama", 64));
        if let Some(b) = &opts.backend {
            assert_eq!(&runner.backend_name, b, "MLXCEL_TEST_BACKEND asked for `{b}`");
        }
        assert!(runner.info.kv_layers.is_empty(), "an embedding model keeps no KV");
        let tok =
            EncoderTokenizer::load(dir, &runner.checkpoint.config, runner.info.max_positions, runner.info.vocab_size)
                .unwrap();
        (runner, tok)
    }

    fn rows(v: &Value) -> Vec<Vec<f32>> {
        let row = |r: &Value| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect();
        v.as_array().unwrap().iter().map(row).collect()
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
    }

    /// The golden inputs as the tokenizer gives them, checked against the reference's ids (the long one
    /// truncated to max_seq_length, keeping the post-processor's `<|endoftext|>`).
    fn inputs(tok: &EncoderTokenizer, golden: &Value) -> Vec<EncodedInput> {
        golden["inputs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| {
                let enc = tok.encode(i["text"].as_str().unwrap()).unwrap();
                let want: Vec<u32> =
                    i["input_ids"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
                assert_eq!(enc.ids, want, "token ids of {:?}", i["text"]);
                enc
            })
            .collect()
    }

    /// Runs the inputs batched and each alone: both equal `want`, and each other bit for bit.
    fn check(name: &str, runner: &mut ModelRunner, inputs: &[EncodedInput], want: &[Vec<f32>]) -> Vec<Vec<f32>> {
        let all: Vec<&EncodedInput> = inputs.iter().collect();
        let batched = forward(runner, &all).unwrap();
        assert_eq!(batched.len(), want.len());
        for (i, (got, want)) in batched.iter().zip(want).enumerate() {
            let d = max_diff(got, want);
            eprintln!("{name}: input {i} ({} tokens): max |diff| {d:.2e}", inputs[i].ids.len());
            assert!(d <= TOLERANCE, "{name}: input {i}: max |diff| {d} > {TOLERANCE}");
            let alone = forward(runner, &[&inputs[i]]).unwrap();
            assert_eq!(&alone[0], got, "{name}: input {i} differs alone and batched");
        }
        batched
    }

    #[test]
    fn qwen3_embedding_matches_sentence_transformers_last_token_pooled_and_normalised() {
        let (dir, golden) = fixture();
        let (mut runner, tok) = load(&dir, None);
        assert_eq!(tok.max_tokens, golden["max_seq_length"].as_u64().unwrap() as usize);
        let inputs = inputs(&tok, &golden);
        let got = check("qwen3-embedding", &mut runner, &inputs, &rows(&golden["embedding"]));
        // Matryoshka: the first 16 values normalised again equal sentence-transformers' truncate_dim.
        for (i, (v, want)) in got.into_iter().zip(rows(&golden["embedding_16"])).enumerate() {
            let mut v = v;
            shorten(&mut v, 16, true);
            assert!(max_diff(&v, &want) <= TOLERANCE, "input {i} shortened to 16");
        }
    }

    /// A copy of the fixture without its sentence-transformers files: a plain Qwen3 checkpoint.
    fn bare_copy() -> tempfile::TempDir {
        let (src, _) = fixture();
        let dir = tempfile::tempdir().unwrap();
        for f in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
        }
        dir
    }

    #[test]
    fn a_plain_qwen3_checkpoint_embeds_when_asked_as_llama_servers_embedding_and_pooling_flags_say() {
        let (_, golden) = fixture();
        let dir = bare_copy();
        // Without a flag it is a text model (the bare body's names are read with the `model.` prefix).
        let catalog = mlxcel::testing::staged_catalog();
        let opts = RunnerOptions { threads: 2, ..Default::default() };
        let text = ModelRunner::load(&catalog, dir.path(), &opts).unwrap();
        assert_eq!(text.info.task, Task::Text);
        drop(text);

        // `--embedding`: the last token, normalised. Without sentence_bert_config.json texts are cut
        // at the positions (128; tokenizer_config's model_max_length is larger), not at the
        // reference's 96, so only the inputs the reference did not truncate are compared.
        let (mut runner, tok) = load(dir.path(), Some(EmbeddingFlags::default()));
        assert_eq!(tok.max_tokens, 128);
        let want = rows(&golden["embedding"]);
        let short: Vec<usize> =
            (0..want.len()).filter(|&i| golden["inputs"][i]["input_ids"].as_array().unwrap().len() < 96).collect();
        let texts: Vec<EncodedInput> =
            short.iter().map(|&i| tok.encode(golden["inputs"][i]["text"].as_str().unwrap()).unwrap()).collect();
        let want_short: Vec<Vec<f32>> = short.iter().map(|&i| want[i].clone()).collect();
        check("--embedding", &mut runner, &texts, &want_short);

        // `--pooling mean`: the mean of the final-norm rows, normalised.
        let (mut runner, _) = load(dir.path(), Some(EmbeddingFlags { pooling: Some(PoolingFlag::Mean) }));
        let mean = rows(&golden["mean_pooled"]);
        let want_mean: Vec<Vec<f32>> = short.iter().map(|&i| mean[i].clone()).collect();
        check("--pooling mean", &mut runner, &texts, &want_mean);
    }
}
