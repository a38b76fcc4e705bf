//! Real trained checkpoints against independent references: SmolLM2-135M-Instruct (4-bit and bf16)
//! against `fixtures/smollm2-reference.json` (a copy of `../shared/models/smollm2-reference.json`) and
//! the reference numbers in `../shared/models/README.md`; Gemma 3 270M converted with mlx-lm against
//! mlx-lm's own answers (`tools/models/fetch_gemma3.sh`). Skipped without `MLXCEL_TEST_MODELS`.
//! `MLXCEL_TEST_BACKEND=mlx` runs them on another staged backend (unset: the host's choice).

use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::AtomicBool;

use mlxcel::engine::{
    GenerateOptions, KvCacheType, KvCacheTypes, Logits, ModelRunner, RunnerOptions, SamplingParams, SeqBlocks,
    SeqChunk, Session,
};
use mlxcel::text::{ChatMessage, TextTokenizer};
use serde_json::Value;

const QUESTION: &str = "What is the capital of France?";
const ANSWER: &str = "The capital of France is Paris.";

fn reference() -> Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/smollm2-reference.json");
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn prompt_ids() -> Vec<u32> {
    reference()["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect()
}

/// The backend under test: `MLXCEL_TEST_BACKEND`, else the host's choice.
fn backend() -> Option<String> {
    std::env::var("MLXCEL_TEST_BACKEND").ok().filter(|b| !b.is_empty())
}

/// Whether logits come from the CPU backend's int16-activation path.
fn cpu_int16() -> bool {
    backend().is_none_or(|b| b == "cpu") && std::env::var("MLXCEL_CPU_INT16").map_or(true, |v| v != "0")
}

/// The KV cache type under test: `MLXCEL_TEST_CACHE_TYPE` (unset: the engine's default, f16).
fn cache_types() -> Option<KvCacheTypes> {
    let t: KvCacheType = std::env::var("MLXCEL_TEST_CACHE_TYPE").ok().filter(|v| !v.is_empty())?.parse().unwrap();
    Some(KvCacheTypes { k: t, v: t })
}

fn load(folder: &str) -> Option<(ModelRunner, TextTokenizer)> {
    load_with(folder, RunnerOptions::default())
}

/// [`load`] with `opts` (the backend and cache types still from the environment).
fn load_with(folder: &str, opts: RunnerOptions) -> Option<(ModelRunner, TextTokenizer)> {
    let dir = mlxcel::testing::test_models()?.join(folder);
    let opts = RunnerOptions { backend: backend(), cache_types: cache_types(), ..opts };
    let runner = ModelRunner::load(&mlxcel::testing::staged_catalog(), &dir, &opts)
        .unwrap_or_else(|e| panic!("{}: {e:#}", dir.display()));
    let tok =
        TextTokenizer::load(&dir, &runner.checkpoint.config, runner.checkpoint.generation_config.as_ref()).unwrap();
    Some((runner, tok))
}

fn top5(runner: &mut ModelRunner, ids: &[u32]) -> Vec<(u32, f32)> {
    let mut s = SeqBlocks::default();
    runner.pool.reserve(&mut s, ids.len()).unwrap();
    let l = runner.forward(&[SeqChunk { blocks: &s, tokens: ids, start_pos: 0, logits: Logits::Last }]).unwrap();
    runner.pool.release(&mut s);
    let mut idx: Vec<usize> = (0..l.len()).collect();
    idx.sort_by(|a, b| l[*b].total_cmp(&l[*a]));
    idx[..5].iter().map(|&i| (i as u32, l[i])).collect()
}

/// What the runner's KV cache type adds to a logit tolerance: nothing for f32, the given measured
/// margins for f16 and bf16 keys and values (they round the attention's inputs).
fn kv_cache_tolerance(runner: &ModelRunner, f16: f32, bf16: f32) -> f32 {
    match runner.cache_types().k.coarser(runner.cache_types().v) {
        KvCacheType::F32 => 0.0,
        KvCacheType::F16 => f16,
        KvCacheType::Bf16 => bf16,
    }
}

fn check_model(folder: &str, want_top5: &[(u32, f32)], tolerance: f32) {
    let Some((mut runner, tok)) = load(folder) else { return };
    // The chat template (with SmolLM's default system prompt) gives exactly the reference ids.
    let ids = tok.chat_prompt(&[ChatMessage::new("user", QUESTION)]).unwrap();
    assert_eq!(ids, prompt_ids(), "{folder}: chat prompt token ids");
    let text = reference()["prompt_text"].as_str().unwrap().to_string();
    assert_eq!(tok.encode(&text, false).unwrap(), prompt_ids(), "{folder}: tokenizing the reference text");

    // Keys and values kept in f16 (the default) or bf16 round the attention's inputs: measured on the
    // 4-bit folder against the f32 reference, f16 moves these logits by ≤ 0.015 and bf16 by ≤ 0.06.
    let tolerance = tolerance + kv_cache_tolerance(&runner, 0.02, 0.08);
    let got = top5(&mut runner, &ids);
    let got_set: std::collections::BTreeSet<u32> = got.iter().map(|g| g.0).collect();
    let want_set: std::collections::BTreeSet<u32> = want_top5.iter().map(|w| w.0).collect();
    assert_eq!(got_set, want_set, "{folder}: first-step top-5 token set (got {got:?})");
    for (id, want) in want_top5 {
        let (_, v) = got.iter().find(|g| g.0 == *id).unwrap();
        assert!((v - want).abs() <= tolerance, "{folder}: logit of token {id}: got {v}, reference {want}");
    }

    let opts = GenerateOptions { sampling: SamplingParams::greedy(), max_tokens: 24, ..Default::default() };
    let out = Session::new().generate(&mut runner, &tok, &ids, &opts, &AtomicBool::new(false), &mut |_| {}).unwrap();
    assert_eq!(out.text, ANSWER, "{folder}: greedy answer");
    // A prompt longer than the prefill chunk: the chunks before the last ask for no logits.
    let chunked = GenerateOptions { prefill_chunk: 8, ..opts };
    let out = Session::new().generate(&mut runner, &tok, &ids, &chunked, &AtomicBool::new(false), &mut |_| {}).unwrap();
    assert_eq!(out.text, ANSWER, "{folder}: greedy answer after a prefill in chunks of 8");
}

/// The 4-bit folder: top-5 from a float32 reference forward of the same 4-bit weights (README).
#[test]
fn smollm2_4bit_answers_paris_and_matches_reference_logits() {
    // The reference is given to two decimals (±0.005). On the exact f32 path (`MLXCEL_CPU_INT16=0`)
    // the same weights land within 0.004 of it; the default path rounds activations to int16, which
    // moves logits by up to 0.03 over the whole vocabulary (docs/benchmarks.md) and by ≈0.01 on these.
    let int16 = cpu_int16();
    check_model(
        "smollm2-135m-instruct-mlx-4bit",
        &[(504, 25.71), (60, 25.67), (15319, 25.48), (7026, 24.97), (14925, 24.52)],
        if int16 { 0.02 } else { 0.01 },
    );
}

/// The bf16 folder holds the dequantized GGUF weights rounded to bf16; the reference is the f32
/// dequantized GGUF, so bf16 rounding of the weights (~0.4% each) moves logits by a few hundredths.
#[test]
fn smollm2_bf16_answers_paris_and_matches_reference_logits() {
    let r = reference();
    let want: Vec<(u32, f32)> = r["reference_top5_f32_dequantized_gguf"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p[0].as_u64().unwrap() as u32, p[1].as_f64().unwrap() as f32))
        .collect();
    check_model("smollm2-135m-instruct-bf16", &want, 0.1);
}

/// The command a user types, end to end.
#[test]
fn mlxcel_run_prints_paris_for_both_checkpoints() {
    let Some(models) = mlxcel::testing::test_models() else { return };
    mlxcel::testing::staged_plugin_dir();
    for folder in ["smollm2-135m-instruct-mlx-4bit", "smollm2-135m-instruct-bf16"] {
        let out = Command::new(env!("CARGO_BIN_EXE_mlxcel"))
            .args(["run"])
            .arg(models.join(folder))
            .args(["-p", QUESTION, "-n", "24", "--temp", "0"])
            .args(backend().map(|b| vec!["--backend".to_string(), b]).unwrap_or_default())
            .env_remove("MLXCEL_PLUGIN_PATH")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{folder}: {stderr}");
        assert!(stdout.contains("Paris"), "{folder}: stdout was {stdout:?}");
        assert!(stderr.contains("tok/s"), "{folder}: speed goes to stderr: {stderr:?}");
    }
}

/// Same seed, same output, through the sampler with a high temperature.
#[test]
fn same_seed_gives_same_answer() {
    let Some((mut runner, tok)) = load("smollm2-135m-instruct-mlx-4bit") else { return };
    let ids = prompt_ids();
    let opts = GenerateOptions {
        sampling: SamplingParams { temperature: 1.2, seed: Some(42), ..Default::default() },
        max_tokens: 12,
        ..Default::default()
    };
    let a = Session::new().generate(&mut runner, &tok, &ids, &opts, &AtomicBool::new(false), &mut |_| {}).unwrap();
    let b = Session::new().generate(&mut runner, &tok, &ids, &opts, &AtomicBool::new(false), &mut |_| {}).unwrap();
    assert_eq!(a.tokens, b.tokens);
}

/// A stop string ends the answer and is not printed.
#[test]
fn stop_string_ends_generation() {
    let Some((mut runner, tok)) = load("smollm2-135m-instruct-mlx-4bit") else { return };
    let opts = GenerateOptions {
        sampling: SamplingParams::greedy(),
        max_tokens: 24,
        stop: vec![" of France".into()],
        ..Default::default()
    };
    let out =
        Session::new().generate(&mut runner, &tok, &prompt_ids(), &opts, &AtomicBool::new(false), &mut |_| {}).unwrap();
    assert_eq!(out.text, "The capital");
    assert_eq!(out.finish, mlxcel::engine::FinishReason::Stop);
}

/// `inspect --json` on the real folder: weight bytes equal the safetensors payload exactly.
#[test]
fn inspect_reports_exact_weight_bytes_for_smollm2() {
    let Some(models) = mlxcel::testing::test_models() else { return };
    mlxcel::testing::staged_plugin_dir();
    let dir = models.join("smollm2-135m-instruct-mlx-4bit");
    let out = Command::new(env!("CARGO_BIN_EXE_mlxcel")).arg("inspect").arg(&dir).arg("--json").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap());
    assert_eq!(v["memory"]["weight_bytes"].as_u64().unwrap(), bytes.len() as u64 - 8 - header);
    // 30 layers × K,V × 3 KV heads × 64 × 2 bytes (f16, the default cache type).
    assert_eq!(v["memory"]["kv_bytes_per_token"].as_u64().unwrap(), 30 * 2 * 3 * 64 * 2);
}

/// Gemma 3 270M, converted with mlx-lm (`tools/models/fetch_gemma3.sh`: the GGUF of google/gemma-3-270m
/// from the package registry, back to a Hugging Face folder, then `mlx_lm convert -q`), against mlx-lm's
/// own float32 answers for that folder (`mlx_lm_reference.json`, written by `gemma3_reference.py`).
const GEMMA3: &str = "gemma-3-270m-mlx-4bit";

/// How far mlxcel's logits may sit from mlx-lm's float32 ones on this model, by path. Measured (largest
/// difference over every position and each reference top-8 logit): the exact path with an f32 KV cache
/// 1e-4; with the default f16 cache 0.009 (also the MLX backend); int16 activations 0.010 (f32 cache) to
/// 0.018 (f16 cache, the scalar path); the bf16 cache 0.064.
fn gemma3_tolerance(runner: &ModelRunner) -> f32 {
    kv_cache_tolerance(runner, 0.01, 0.07) + if cpu_int16() { 0.03 } else { 0.005 }
}

/// `--swa-full`: Gemma 3's sliding-window layers keep the whole context's KV, so prefixes can be
/// reused (the prefix cache is off without it), and past the window they still attend only within
/// it: the logits of a prompt computed in chunks across the window are those of the windowed cache.
#[test]
fn gemma3_with_whole_window_layers_answers_as_with_windowed_ones() {
    let Some(models) = mlxcel::testing::test_models() else { return };
    if !models.join(GEMMA3).join(".done").exists() {
        assert!(std::env::var_os("MLXCEL_REQUIRE_TEST_MODELS").is_none(), "{GEMMA3} missing");
        return;
    }
    let opts = |swa_full| RunnerOptions { ctx_size: 2048, swa_full, ..Default::default() };
    let (mut windowed, tok) = load_with(GEMMA3, opts(false)).unwrap();
    let (mut whole, _) = load_with(GEMMA3, opts(true)).unwrap();
    assert!(!windowed.pool.prefix_reusable() && whole.pool.prefix_reusable());
    let text = "The history of the river valley is long and full of change; each age left its mark. ".repeat(48);
    let ids = tok.encode(&text, true).unwrap();
    // Gemma 3's window is 512 tokens: the last chunks' local layers see only part of the prompt.
    assert!(ids.len() > 512 + 256, "{} tokens: the window must be passed", ids.len());
    // Each chunk's last row (262k logits each: whole chunks' rows would cost the lm_head 256 times).
    let last_rows = |runner: &mut ModelRunner| {
        let mut s = SeqBlocks::default();
        let mut rows = Vec::new();
        for start in (0..ids.len()).step_by(256) {
            let end = (start + 256).min(ids.len());
            runner.pool.reserve(&mut s, end).unwrap();
            let chunk = SeqChunk { blocks: &s, tokens: &ids[start..end], start_pos: start, logits: Logits::Last };
            rows.extend(runner.forward(&[chunk]).unwrap());
        }
        runner.pool.release(&mut s);
        rows
    };
    let (a, b) = (last_rows(&mut windowed), last_rows(&mut whole));
    assert_eq!(a.len(), b.len());
    let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    assert!(worst < 1e-3, "logits differ by {worst} between the windowed and the whole cache");
}

#[test]
fn gemma3_converted_with_mlx_lm_answers_like_mlx_lm() {
    let Some(models) = mlxcel::testing::test_models() else { return };
    if !models.join(GEMMA3).join(".done").exists() {
        assert!(
            std::env::var_os("MLXCEL_REQUIRE_TEST_MODELS").is_none(),
            "MLXCEL_REQUIRE_TEST_MODELS is set but {} lacks {GEMMA3}: run tools/models/fetch_gemma3.sh {0}",
            models.display()
        );
        eprintln!("skipping: {GEMMA3} not in {} (tools/models/fetch_gemma3.sh makes it)", models.display());
        return;
    }
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(models.join(GEMMA3).join("mlx_lm_reference.json")).unwrap())
            .unwrap();
    let (mut runner, tok) = load(GEMMA3).unwrap();
    let tolerance = gemma3_tolerance(&runner);
    let vocab = runner.info.vocab_size;
    let ids_of = |v: &Value| v.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect::<Vec<_>>();
    let (mut compared, mut worst) = (0usize, 0f32);
    for case in reference["cases"].as_array().unwrap() {
        let prompt = case["prompt"].as_str().unwrap();
        let ids = ids_of(&case["ids"]);
        let greedy = ids_of(&case["greedy"]);
        assert_eq!(tok.encode(prompt, true).unwrap(), ids, "{prompt:?}: token ids (mlx-lm's)");

        // Teacher-forced: every position of prompt + mlx-lm's continuation in one pass, against the
        // reference's top logits there; where the reference's choice is clear, the same choice.
        let seq: Vec<u32> = ids.iter().chain(&greedy).copied().collect();
        let mut s = SeqBlocks::default();
        runner.pool.reserve(&mut s, seq.len()).unwrap();
        let logits =
            runner.forward(&[SeqChunk { blocks: &s, tokens: &seq, start_pos: 0, logits: Logits::All }]).unwrap();
        runner.pool.release(&mut s);
        assert_eq!(logits.len(), seq.len() * vocab);
        let mut clear_until = greedy.len();
        for (pos, top) in case["top"].as_array().unwrap().iter().enumerate() {
            let row = &logits[pos * vocab..(pos + 1) * vocab];
            let top: Vec<(usize, f32)> = top
                .as_array()
                .unwrap()
                .iter()
                .map(|p| (p[0].as_u64().unwrap() as usize, p[1].as_f64().unwrap() as f32))
                .collect();
            for &(id, want) in &top {
                worst = worst.max((row[id] - want).abs());
                assert!(
                    (row[id] - want).abs() <= tolerance,
                    "{prompt:?} position {pos}: logit of token {id} is {}, mlx-lm's {want}",
                    row[id]
                );
            }
            let argmax = (0..vocab).max_by(|a, b| row[*a].total_cmp(&row[*b])).unwrap();
            if top[0].1 - top[1].1 > 2.0 * tolerance {
                assert_eq!(argmax, top[0].0, "{prompt:?} position {pos}: argmax");
            } else if pos + 1 >= ids.len() {
                clear_until = clear_until.min(pos + 1 - ids.len());
            }
        }

        // Free-running greedy decoding through the cache gives mlx-lm's tokens up to its first near-tie
        // (mlx-lm stopped only at its EOS ids, never inside `greedy`; mlxcel must not stop earlier).
        let opts = GenerateOptions {
            sampling: SamplingParams::greedy(),
            max_tokens: greedy.len(),
            ignore_eos: true,
            ..Default::default()
        };
        let out =
            Session::new().generate(&mut runner, &tok, &ids, &opts, &AtomicBool::new(false), &mut |_| {}).unwrap();
        assert!(out.tokens.len() >= clear_until, "{prompt:?}: only {} tokens generated", out.tokens.len());
        assert_eq!(
            out.tokens[..clear_until],
            greedy[..clear_until],
            "{prompt:?}: greedy tokens (mlx-lm: {:?})",
            case["text"]
        );
        compared += clear_until;
    }
    eprintln!("{GEMMA3}: largest logit difference from mlx-lm {worst} (tolerance {tolerance}); {compared} greedy tokens compared");
    assert!(compared >= 30, "only {compared} greedy tokens before near-ties: the check says little");
}
