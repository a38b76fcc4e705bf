//! `cargo xtask bench --embeddings`: all-MiniLM-L6-v2 embeddings per second, mlxcel (`mlxcel
//! bench-embed`) beside sentence-transformers on CPU PyTorch (`xtask/bench_sentence_transformers.py`,
//! run by `--peer-python`), on the same folder and the same texts: a batch of 32 short sentences and a
//! batch of 32 passages truncated to 256 tokens (the model's max_seq_length). Alternating runs, medians.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{bail, Result};

pub struct Options {
    pub models: Option<PathBuf>,
    pub reps: usize,
    pub threads: Vec<usize>,
    pub no_peer: bool,
    pub peer_python: PathBuf,
}

const SUBJECTS: &[&str] =
    &["A man", "The woman", "A child", "Our team", "The old dog", "A student", "My neighbour", "The pilot"];
const ACTIONS: &[&str] =
    &["is eating", "reads", "paints", "is fixing", "writes about", "photographs", "sells", "plans"];
const OBJECTS: &[&str] =
    &["a piece of bread.", "the morning news.", "a small boat.", "an old bicycle.", "the city at night."];
const WORDS: &[&str] = &[
    "river", "market", "theory", "window", "quietly", "engine", "history", "between", "garden", "signal", "winter",
    "measure", "careful", "network", "village", "language", "silver", "because", "mountain", "protein", "harbour",
    "several", "library", "through", "problem", "evening", "pattern", "kitchen", "although", "science", "journey",
    "balance", "weather", "chapter", "control", "surface", "morning", "develop", "current", "support",
];

/// 32 short sentences and 32 passages of ~350 words (more than 256 tokens each), deterministic.
fn texts() -> serde_json::Value {
    let short: Vec<String> =
        (0..32).map(|i| format!("{} {} {}", SUBJECTS[i % 8], ACTIONS[(i / 8 + i) % 8], OBJECTS[i % 5])).collect();
    let mut state = 0x9E3779B97F4A7C15u64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let passages: Vec<String> = (0..32)
        .map(|_| {
            let words: Vec<&str> = (0..350).map(|_| WORDS[(next() % WORDS.len() as u64) as usize]).collect();
            words.join(" ") + "."
        })
        .collect();
    serde_json::json!({"short": short, "passages": passages})
}

fn json_of(out: std::process::Output, what: &str) -> Result<serde_json::Value> {
    if !out.status.success() {
        bail!("{what} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().rev().find(|l| l.trim_start().starts_with('{'));
    match line {
        Some(l) => Ok(serde_json::from_str(l)?),
        None => bail!("{what} printed no JSON"),
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

pub fn run(o: &Options) -> Result<()> {
    let models = match o.models.clone().or_else(|| std::env::var_os("MLXCEL_TEST_MODELS").map(PathBuf::from)) {
        Some(m) => m,
        None => bail!("--embeddings needs --models or MLXCEL_TEST_MODELS (a folder holding all-minilm-l6-v2)"),
    };
    let model = models.join("all-minilm-l6-v2");
    if !model.join("config.json").is_file() {
        bail!("{} is not a model folder (expected all-MiniLM-L6-v2 there)", model.display());
    }
    if !o.no_peer {
        let ok = Command::new(&o.peer_python).args(["-c", "import torch, transformers"]).output();
        if !ok.is_ok_and(|o| o.status.success()) {
            bail!(
                "{} cannot import torch and transformers; pass --peer-python PYTHON (with torch and \
                 sentence-transformers or transformers) or --no-peer",
                o.peer_python.display()
            );
        }
    }
    let out = crate::build()?;
    let mlxcel = out.join("mlxcel");
    let texts_path = crate::root().join("target/bench-embed-texts.json");
    std::fs::write(&texts_path, serde_json::to_vec(&texts())?)?;
    let script = crate::root().join("xtask/bench_sentence_transformers.py");
    let sets = ["short", "passages"];
    let mut peer_impl = String::new();
    println!("| threads | texts | mlxcel embeddings/s | peer embeddings/s | ratio |");
    println!("|---|---|---|---|---|");
    for &t in &o.threads {
        let mut mine: Vec<Vec<f64>> = vec![Vec::new(); sets.len()];
        let mut peer: Vec<Vec<f64>> = vec![Vec::new(); sets.len()];
        let mut tokens = vec![0u64; sets.len()];
        for rep in 0..o.reps {
            eprintln!("threads {t}, repetition {}/{}", rep + 1, o.reps);
            let v = json_of(
                Command::new(&mlxcel)
                    .args(["bench-embed", "-m"])
                    .arg(&model)
                    .arg("--texts")
                    .arg(&texts_path)
                    .args(["-t", &t.to_string(), "-r", "3", "--json"])
                    .output()?,
                "mlxcel bench-embed",
            )?;
            for (i, s) in sets.iter().enumerate() {
                mine[i].push(v["sets"][s]["embeddings_per_s"].as_f64().unwrap_or(0.0));
                tokens[i] = v["sets"][s]["tokens"].as_u64().unwrap_or(0);
            }
            if !o.no_peer {
                let v = json_of(
                    Command::new(&o.peer_python)
                        .arg(&script)
                        .arg(&model)
                        .arg(&texts_path)
                        .args([t.to_string(), "3".to_string()])
                        .output()?,
                    "the sentence-transformers peer",
                )?;
                peer_impl =
                    format!("{} (torch {})", v["impl"].as_str().unwrap_or("?"), v["torch"].as_str().unwrap_or("?"));
                for (i, s) in sets.iter().enumerate() {
                    peer[i].push(v["sets"][s]["embeddings_per_s"].as_f64().unwrap_or(0.0));
                }
            }
        }
        for (i, s) in sets.iter().enumerate() {
            let m = median(mine[i].clone());
            let p = (!peer[i].is_empty()).then(|| median(peer[i].clone()));
            println!(
                "| {t} | 32 {s} ({} tokens) | {m:.1} | {} | {} |",
                tokens[i],
                p.map_or("—".into(), |p| format!("{p:.1}")),
                p.map_or("—".into(), |p| format!("{:.2}×", m / p))
            );
        }
    }
    if !peer_impl.is_empty() {
        println!(
            "\nPeer: {peer_impl} on CPU, float32, the same folder and texts; medians of {} alternating runs.",
            o.reps
        );
    }
    Ok(())
}
