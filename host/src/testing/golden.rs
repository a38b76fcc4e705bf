//! The golden-test harness every family shares: a fixture folder made by the reference implementation
//! (`config.json`, weights, tokenizer and `golden.json` with `tokens`, per-position `logits` and
//! `greedy` tokens, see `tools/fixtures/golden_common.py`), run on a staged backend through the
//! runner the way the engine drives it: one-shot prefill, prefill in uneven chunks then token-by-token
//! decode (window pages released as the sequence grows), two sequences sharing steps, and greedy
//! generation.
//!
//! Tolerance: 1e-4 absolute on logits of magnitude ~1–10. Both sides compute in f32 and dequantize
//! 4-bit weights exactly, so differences are float summation order and `exp`/`tanh`/`sin`/`cos`
//! implementations: measured ≤ 1.4e-5 over every family's fixtures. 4-bit weights on the CPU's default
//! path round activations to int16 per block of 32 (backends/cpu/src/kernels/int_dot.rs), so `-q4`
//! fixtures get [`INT16_TOLERANCE`] there (or a family's own bound, [`run_case_within`]) unless
//! `MLXCEL_CPU_INT16=0` (`cargo xtask test` runs both).
//!
//! The KV cache is f32 like the reference's; `MLXCEL_TEST_CACHE_TYPE=f16|bf16` keeps it in that type
//! instead, and the bound grows by [`cache_type_tolerance`] (`cargo xtask test` runs both).
//!
//! `MLXCEL_TEST_BACKEND=NAME` runs the same checks on another staged backend (`cargo xtask test` does
//! so for the MLX plugin when it was built with libmlx); unset, the host picks (the CPU backend).

use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use serde_json::Value;

use crate::engine::{
    GenerateOptions, KvCacheType, KvCacheTypes, Logits, ModelRunner, RowsWanted, RunnerOptions, SamplingParams,
    SeqBlocks, SeqChunk, Session, StepRows,
};
use crate::text::TextTokenizer;

pub const TOLERANCE: f32 = 1e-4;
/// The int16 path's bound: measured ≤ 5.4e-4 on the llama, moe, phi and glm fixtures.
pub const INT16_TOLERANCE: f32 = 1e-3;

/// A fixture's reference outputs.
pub struct Golden {
    pub name: String,
    pub dir: PathBuf,
    pub tokens: Vec<u32>,
    /// One row of vocabulary logits per token of `tokens`.
    pub logits: Vec<Vec<f32>>,
    pub greedy: Vec<u32>,
    /// The largest difference any check has seen so far.
    pub worst: Cell<f32>,
    /// The bound of a `-q4` fixture on the CPU's int16 path.
    pub int16_tolerance: f32,
}

impl Golden {
    /// Reads `<fixtures>/<name>/golden.json`.
    pub fn load(fixtures: &Path, name: &str) -> Golden {
        let dir = fixtures.join(name);
        let text = std::fs::read_to_string(dir.join("golden.json"))
            .unwrap_or_else(|e| panic!("{}: {e}", dir.join("golden.json").display()));
        let v: Value = serde_json::from_str(&text).unwrap();
        let ids = |k: &str| v[k].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect::<Vec<_>>();
        let logits = v["logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect())
            .collect();
        Golden {
            name: name.to_string(),
            dir,
            tokens: ids("tokens"),
            logits,
            greedy: ids("greedy"),
            worst: Cell::new(0.0),
            int16_tolerance: INT16_TOLERANCE,
        }
    }

    pub fn tolerance(&self) -> f32 {
        let on_cpu = backend().is_none_or(|b| b == "cpu");
        let int16 = on_cpu && std::env::var("MLXCEL_CPU_INT16").map_or(true, |v| v != "0");
        let base = if self.name.ends_with("-q4") && int16 { self.int16_tolerance } else { TOLERANCE };
        base + cache_type_tolerance(cache_type())
    }

    /// Asserts one row of logits against position `pos`'s reference; returns the largest difference.
    pub fn check_row(&self, what: &str, pos: usize, got: &[f32]) -> f32 {
        let want = &self.logits[pos];
        assert_eq!(got.len(), want.len(), "{}: {what}: vocabulary size", self.name);
        let d = got.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
        self.worst.set(self.worst.get().max(d));
        let tol = self.tolerance();
        assert!(d <= tol, "{}: {what}: position {pos}: max |logit diff| {d} > {tol}", self.name);
        d
    }
}

/// The KV cache type under test: `MLXCEL_TEST_CACHE_TYPE`, else f32 (the reference's).
pub fn cache_type() -> KvCacheType {
    match std::env::var("MLXCEL_TEST_CACHE_TYPE") {
        Ok(v) if !v.is_empty() => v.parse().unwrap_or_else(|e| panic!("MLXCEL_TEST_CACHE_TYPE: {e}")),
        _ => KvCacheType::F32,
    }
}

/// What rounding the cache's keys and values adds to a logit: f16 keeps 11 significant bits, bf16 8
/// (relative steps 4.9e-4 and 3.9e-3 per value). Measured over every family's fixtures, greedy tokens
/// unchanged: f16 ≤ 5.1e-3 (gemma3_text-q4; ≤ 7.6e-4 outside gemma, whose logits are larger), bf16 ≤
/// 4.6e-2 (gemma2-swa; ≤ 6.2e-3 outside gemma).
pub fn cache_type_tolerance(t: KvCacheType) -> f32 {
    match t {
        KvCacheType::F32 => 0.0,
        KvCacheType::F16 => 1e-2,
        KvCacheType::Bf16 => 1e-1,
    }
}

/// The backend under test: `MLXCEL_TEST_BACKEND`, else the host's choice.
pub fn backend() -> Option<String> {
    std::env::var("MLXCEL_TEST_BACKEND").ok().filter(|b| !b.is_empty())
}

/// A runner over the staged plugins for a fixture folder (room for four sequences), on [`backend`].
pub fn load_runner(dir: &Path) -> ModelRunner {
    let catalog = super::staged_catalog();
    let t = cache_type();
    let opts = RunnerOptions {
        ctx_size: 256,
        threads: 2,
        parallel: 4,
        backend: backend(),
        cache_types: Some(KvCacheTypes { k: t, v: t }),
        ..Default::default()
    };
    let runner = ModelRunner::load(&catalog, dir, &opts).unwrap_or_else(|e| panic!("{}: {e:#}", dir.display()));
    if let Some(b) = backend() {
        assert_eq!(runner.backend_name, b, "MLXCEL_TEST_BACKEND asked for `{b}`");
    }
    runner
}

/// A sequence alone in a step, from position 0, with its KV released afterwards: its logits.
pub fn forward_alone(runner: &mut ModelRunner, tokens: &[u32], logits: Logits) -> Vec<f32> {
    let mut s = SeqBlocks::default();
    runner.pool.reserve(&mut s, tokens.len()).unwrap();
    let out = runner.forward(&[SeqChunk { blocks: &s, tokens, start_pos: 0, logits }]).unwrap();
    runner.pool.release(&mut s);
    out
}

/// Prefill of the whole sequence in one step matches the reference at every position.
pub fn check_one_shot(runner: &mut ModelRunner, g: &Golden) -> f32 {
    let out = forward_alone(runner, &g.tokens, Logits::All);
    let v = runner.info.vocab_size;
    (0..g.tokens.len()).map(|i| g.check_row("one-shot", i, &out[i * v..(i + 1) * v])).fold(0.0, f32::max)
}

/// Prefill in uneven chunks, then one token at a time through the KV cache: same logits. The sequence
/// length is advanced after each step, so sliding-window groups release the pages behind the window.
pub fn check_chunked_and_decode(runner: &mut ModelRunner, g: &Golden) {
    let mut seq = SeqBlocks::default();
    let v = runner.info.vocab_size;
    let n = g.tokens.len();
    let mut pos = 0;
    for chunk in [7usize, 13, 5] {
        let end = (pos + chunk).min(n);
        runner.pool.reserve(&mut seq, end).unwrap();
        let out = runner
            .forward(&[SeqChunk { blocks: &seq, tokens: &g.tokens[pos..end], start_pos: pos, logits: Logits::All }])
            .unwrap();
        for i in pos..end {
            g.check_row("chunked prefill", i, &out[(i - pos) * v..(i - pos + 1) * v]);
        }
        pos = end;
        seq.len = end;
    }
    while pos < n {
        runner.pool.reserve(&mut seq, pos + 1).unwrap();
        let out = runner
            .forward(&[SeqChunk {
                blocks: &seq,
                tokens: &g.tokens[pos..pos + 1],
                start_pos: pos,
                logits: Logits::Last,
            }])
            .unwrap();
        g.check_row("decode", pos, &out);
        pos += 1;
        seq.len = pos;
    }
    runner.pool.release(&mut seq);
}

/// Two sequences share every step: A prefills 30 tokens while B prefills 17, then both decode one
/// token per step (A runs ahead of B) to the end of the reference sequence; every row matches the
/// reference. A third, different sequence (the tokens reversed) rides along in the prefill and must
/// give bit-for-bit what it gives alone.
pub fn check_two_sequences_share_steps(runner: &mut ModelRunner, g: &Golden) {
    let v = runner.info.vocab_size;
    let n = g.tokens.len();
    let other: Vec<u32> = g.tokens.iter().rev().take(23).copied().collect();
    let alone = forward_alone(runner, &other, Logits::Last);

    let (mut sa, mut sb, mut sc) = (SeqBlocks::default(), SeqBlocks::default(), SeqBlocks::default());
    let (mut pa, mut pb) = (30.min(n), 17.min(n));
    runner.pool.reserve(&mut sa, pa).unwrap();
    runner.pool.reserve(&mut sb, pb).unwrap();
    runner.pool.reserve(&mut sc, other.len()).unwrap();
    let out = runner
        .forward(&[
            SeqChunk { blocks: &sa, tokens: &g.tokens[..pa], start_pos: 0, logits: Logits::All },
            SeqChunk { blocks: &sb, tokens: &g.tokens[..pb], start_pos: 0, logits: Logits::Last },
            SeqChunk { blocks: &sc, tokens: &other, start_pos: 0, logits: Logits::Last },
        ])
        .unwrap();
    for i in 0..pa {
        g.check_row("batched prefill, sequence A", i, &out[i * v..(i + 1) * v]);
    }
    g.check_row("batched prefill, sequence B", pb - 1, &out[pa * v..(pa + 1) * v]);
    assert_eq!(&out[(pa + 1) * v..], &alone[..], "{}: a sequence's logits changed when batched", g.name);
    runner.pool.release(&mut sc);
    (sa.len, sb.len) = (pa, pb);

    while pa < n {
        runner.pool.reserve(&mut sa, pa + 1).unwrap();
        runner.pool.reserve(&mut sb, pb + 1).unwrap();
        let out = runner
            .forward(&[
                SeqChunk { blocks: &sb, tokens: &g.tokens[pb..pb + 1], start_pos: pb, logits: Logits::Last },
                SeqChunk { blocks: &sa, tokens: &g.tokens[pa..pa + 1], start_pos: pa, logits: Logits::Last },
            ])
            .unwrap();
        g.check_row("batched decode, sequence B", pb, &out[..v]);
        g.check_row("batched decode, sequence A", pa, &out[v..]);
        pa += 1;
        pb += 1;
        (sa.len, sb.len) = (pa, pb);
    }
    runner.pool.release(&mut sa);
    runner.pool.release(&mut sb);
}

/// The backend's top-k of every row (what greedy and top-k sampling bring back instead of whole rows)
/// is the whole rows' top-k: the same ids in the same order, the same values.
pub fn check_top_k_on_backend(runner: &mut ModelRunner, g: &Golden) {
    let full = forward_alone(runner, &g.tokens, Logits::All);
    let vocab = runner.info.output_dim;
    for k in [1, 5] {
        let mut s = SeqBlocks::default();
        runner.pool.reserve(&mut s, g.tokens.len()).unwrap();
        let chunk = SeqChunk { blocks: &s, tokens: &g.tokens, start_pos: 0, logits: Logits::All };
        runner.submit(&[chunk], RowsWanted::Top(k)).unwrap();
        let got = runner.wait().unwrap();
        runner.pool.release(&mut s);
        let StepRows::Top { ids, values, .. } = &got else {
            panic!("{}: backend `{}` brought whole rows back for a top-{k}", g.name, runner.backend_name)
        };
        let StepRows::Top { ids: want_ids, values: want_values, .. } =
            StepRows::select(full.clone(), vocab, RowsWanted::Top(k))
        else {
            unreachable!()
        };
        assert_eq!(ids, &want_ids, "{}: top-{k} ids on the backend differ from the whole rows'", g.name);
        let worst = values.iter().zip(&want_values).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(worst <= 1e-5, "{}: top-{k} values differ by {worst} from the whole rows'", g.name);
    }
}

/// Greedy generation through the engine gives the reference's tokens, with the prompt in one step and
/// in chunks of 5 (every chunk but the last asks for no logits).
pub fn check_greedy(runner: &mut ModelRunner, g: &Golden) {
    let tok = TextTokenizer::load(&g.dir, &runner.checkpoint.config, None).unwrap();
    let opts = GenerateOptions {
        sampling: SamplingParams::greedy(),
        max_tokens: g.greedy.len(),
        ignore_eos: true,
        ..Default::default()
    };
    let stop = AtomicBool::new(false);
    let out = Session::new().generate(runner, &tok, &g.tokens, &opts, &stop, &mut |_| {}).unwrap();
    assert_eq!(out.tokens, g.greedy, "{}: greedy tokens differ from the reference", g.name);
    let chunked = GenerateOptions { prefill_chunk: 5, ..opts };
    let out = Session::new().generate(runner, &tok, &g.tokens, &chunked, &stop, &mut |_| {}).unwrap();
    assert_eq!(out.tokens, g.greedy, "{}: greedy tokens after a prefill in chunks of 5 differ", g.name);
}

/// Every check above on `<fixtures>/<case>-f32` and `<case>-q4`.
pub fn run_case(fixtures: &Path, case: &str) {
    run_case_within(fixtures, case, INT16_TOLERANCE);
}

/// [`run_case`] with the family's own bound for 4-bit fixtures on the CPU's int16 path (whose rounding
/// error grows with the activations).
pub fn run_case_within(fixtures: &Path, case: &str, int16_tolerance: f32) {
    for dtype in ["f32", "q4"] {
        let g = Golden { int16_tolerance, ..Golden::load(fixtures, &format!("{case}-{dtype}")) };
        let mut runner = load_runner(&g.dir);
        check_one_shot(&mut runner, &g);
        check_chunked_and_decode(&mut runner, &g);
        check_two_sequences_share_steps(&mut runner, &g);
        check_top_k_on_backend(&mut runner, &g);
        check_greedy(&mut runner, &g);
        eprintln!("{}: max |logit diff| vs the reference {:.2e} (bound {:.1e})", g.name, g.worst.get(), g.tolerance());
    }
}
