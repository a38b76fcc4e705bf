//! `mlxcel bench MODEL`: prompt-processing and generation speed in the shape of llama-bench's pp/tg
//! tests, so `cargo xtask bench` can set it beside llama.cpp on the same weights.

use std::time::Instant;

use anyhow::Result;
use clap::Args;

use super::cache_type::CacheTypeArgs;
use super::run::resolve_model;
use super::GlobalArgs;
use crate::engine::{Logits, ModelRunner, RunnerOptions, SeqBlocks, SeqChunk};

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Model folder.
    pub model: String,
    /// Prompt tokens for the prompt-processing test (pp).
    #[arg(short = 'p', long = "n-prompt", default_value_t = 512)]
    pub n_prompt: usize,
    /// Generated tokens for the generation test (tg).
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    pub n_gen: usize,
    /// Repetitions; the median is reported.
    #[arg(short = 'r', long, default_value_t = 3, value_parser = repetitions)]
    pub repetitions: usize,
    /// Worker threads (0: one per core).
    #[arg(short = 't', long, default_value_t = 0, value_parser = crate::cli::thread_count)]
    pub threads: u32,
    /// Prefill chunk (tokens per step).
    #[arg(short = 'b', long = "batch-size", default_value_t = 512, value_parser = crate::cli::at_least_one)]
    pub batch: u64,
    /// Also time generation after this many tokens of context (comma-separated, as llama-bench's
    /// `-d`): the context is prefilled untimed, then n-gen tokens are decoded on top of it.
    #[arg(short = 'd', long = "n-depth", value_delimiter = ',')]
    pub depths: Vec<usize>,
    /// Backend to run on (default: the best-scoring one; `mlxcel arch` lists them).
    #[arg(long)]
    pub backend: Option<String>,
    /// One JSON object on stdout.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub cache_types: CacheTypeArgs,
}

/// At least one measured repetition (none would report nothing as zeros).
pub fn repetitions(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("at least one repetition is needed".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2]
    }
}

/// Peak resident memory of this process in bytes (Linux), 0 elsewhere.
pub fn peak_rss() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

pub fn run(global: &GlobalArgs, args: &BenchArgs) -> Result<()> {
    // As llama-bench, a test of 0 tokens is not run; with neither there is nothing to measure.
    if args.n_prompt == 0 && args.n_gen == 0 {
        anyhow::bail!("nothing to measure: -p (prompt tokens) and -n (generated tokens) are both 0");
    }
    if args.n_gen == 0 && !args.depths.is_empty() {
        anyhow::bail!("-d measures generation at a depth, so it needs -n above 0");
    }
    let dir = resolve_model(&args.model, None)?;
    let opts = RunnerOptions {
        backend: args.backend.clone(),
        threads: args.threads,
        ctx_size: args.n_prompt.max(args.depths.iter().copied().max().unwrap_or(0)) + args.n_gen + 16,
        cache_types: args.cache_types.types(),
        ..Default::default()
    };
    let mut runner = ModelRunner::load(&global.catalog(), &dir, &opts)?;
    // The deepest test must fit in the model's context (loading cuts the context to it).
    let deepest = args.n_prompt.max(args.depths.iter().copied().max().unwrap_or(0) + args.n_gen);
    if deepest > runner.ctx_size {
        anyhow::bail!(
            "the tests need {deepest} tokens of context (-p, or -d + -n), more than the model's maximum ({} tokens)",
            runner.ctx_size
        );
    }
    let vocab = runner.info.vocab_size as u32;
    // Deterministic pseudo-random tokens, as llama-bench uses random tokens.
    let mut state = 0x2545F4914F6CDD1Du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state % vocab as u64) as u32
    };
    let prompt: Vec<u32> = (0..args.n_prompt).map(|_| next()).collect();
    let gen_tokens: Vec<u32> = (0..args.n_gen).map(|_| next()).collect();
    let context: Vec<u32> = (0..args.depths.iter().copied().max().unwrap_or(0)).map(|_| next()).collect();

    let mut pp = Vec::new();
    let mut tg = Vec::new();
    // One warm-up round (page in the weights), then the measured repetitions.
    for rep in 0..=args.repetitions {
        let mut seq = SeqBlocks::default();
        runner.pool.reserve(&mut seq, args.n_prompt)?;
        let t0 = Instant::now();
        let mut pos = 0;
        while pos < prompt.len() {
            let end = pos.saturating_add(args.batch as usize).min(prompt.len());
            let want = if end == prompt.len() { Logits::Last } else { Logits::None };
            runner.forward(&[SeqChunk { blocks: &seq, tokens: &prompt[pos..end], start_pos: pos, logits: want }])?;
            pos = end;
        }
        let pp_s = t0.elapsed().as_secs_f64();
        runner.pool.release(&mut seq);

        // Generation from an empty context, one token per step (as llama-bench's tg).
        runner.pool.reserve(&mut seq, args.n_gen)?;
        let t1 = Instant::now();
        for (i, tok) in gen_tokens.iter().enumerate() {
            runner.forward(&[SeqChunk {
                blocks: &seq,
                tokens: std::slice::from_ref(tok),
                start_pos: i,
                logits: Logits::Last,
            }])?;
        }
        let tg_s = t1.elapsed().as_secs_f64();
        runner.pool.release(&mut seq);
        if rep > 0 {
            if args.n_prompt > 0 {
                pp.push(args.n_prompt as f64 / pp_s);
            }
            if args.n_gen > 0 {
                tg.push(args.n_gen as f64 / tg_s);
            }
        }
    }
    // Generation on top of a context of each depth (prefilled untimed, in chunks of --batch-size).
    let mut at_depth = Vec::new();
    for &depth in &args.depths {
        let mut runs = Vec::new();
        for rep in 0..=args.repetitions {
            let mut seq = SeqBlocks::default();
            runner.pool.reserve(&mut seq, depth + args.n_gen)?;
            for start in (0..depth).step_by(args.batch as usize) {
                let end = start.saturating_add(args.batch as usize).min(depth);
                let want = if end == depth { Logits::Last } else { Logits::None };
                runner.forward(&[SeqChunk {
                    blocks: &seq,
                    tokens: &context[start..end],
                    start_pos: start,
                    logits: want,
                }])?;
            }
            let t = Instant::now();
            for (i, tok) in gen_tokens.iter().enumerate() {
                let chunk = SeqChunk {
                    blocks: &seq,
                    tokens: std::slice::from_ref(tok),
                    start_pos: depth + i,
                    logits: Logits::Last,
                };
                runner.forward(&[chunk])?;
            }
            let s = t.elapsed().as_secs_f64();
            runner.pool.release(&mut seq);
            if rep > 0 {
                runs.push(args.n_gen as f64 / s);
            }
        }
        at_depth.push((depth, median(runs)));
    }
    // None for a test that was not run (0 tokens).
    let (pp_m, tg_m) = ((args.n_prompt > 0).then(|| median(pp.clone())), (args.n_gen > 0).then(|| median(tg.clone())));
    let rss = peak_rss();
    if args.json {
        let v = serde_json::json!({
            "model": dir.display().to_string(),
            "backend": runner.backend_name,
            "features": runner.backend_features,
            "threads": args.threads,
            "n_prompt": args.n_prompt,
            "n_gen": args.n_gen,
            "pp_tps": pp_m,
            "tg_tps": tg_m,
            "pp_runs": pp,
            "tg_runs": tg,
            "tg_at_depth": at_depth.iter().map(|(d, t)| serde_json::json!({"depth": d, "tg_tps": t})).collect::<Vec<_>>(),
            "cache_type_k": runner.cache_types().k.name(),
            "cache_type_v": runner.cache_types().v.name(),
            "weight_bytes": runner.checkpoint.weight_bytes(),
            "kv_bytes": runner.kv_bytes_per_token() * (args.n_prompt + args.n_gen + 16),
            "peak_rss_bytes": rss,
        });
        println!("{v}");
    } else {
        let tests = [
            pp_m.map(|t| format!("pp{} {t:.1} tok/s", args.n_prompt)),
            tg_m.map(|t| format!("tg{} {t:.1} tok/s", args.n_gen)),
        ];
        println!(
            "{}: {} | backend {} [{}] | peak RSS {:.0} MB",
            dir.display(),
            tests.into_iter().flatten().collect::<Vec<_>>().join(" | "),
            runner.backend_name,
            runner.backend_features,
            rss as f64 / 1e6
        );
        for (d, t) in &at_depth {
            println!("  tg{} @ d{d}: {t:.1} tok/s (KV cache {})", args.n_gen, runner.cache_types());
        }
    }
    Ok(())
}
