//! `cargo xtask bench`: mlxcel and llama.cpp on the same SmolLM2-135M weights (MLX 4-bit folder vs the
//! bit-identical GGUF Q4_1), alternating runs, medians, ratios, and mlxcel's share of the memory
//! bandwidth floor. Prints a Markdown table for docs/benchmarks.md.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};

pub struct Options {
    pub models: Option<PathBuf>,
    pub reps: usize,
    pub threads: Vec<usize>,
    pub n_prompt: usize,
    pub n_gen: usize,
    pub no_peer: bool,
}

const LLAMA_CPP_PYTHON: &str = "llama-cpp-python==0.3.36";

fn models_dir(opt: &Option<PathBuf>) -> Result<PathBuf> {
    if let Some(p) = opt.clone().or_else(|| std::env::var_os("MLXCEL_TEST_MODELS").map(PathBuf::from)) {
        return Ok(p);
    }
    let fetch = crate::root().join("../shared/models/fetch.sh");
    let out = Command::new(&fetch).output().with_context(|| format!("running {}", fetch.display()))?;
    if !out.status.success() {
        bail!("{} failed: {}", fetch.display(), String::from_utf8_lossy(&out.stderr));
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).lines().last().unwrap_or("").trim()))
}

/// A venv with llama-cpp-python (compiled from source with native flags, ~4 minutes the first time).
fn peer_python() -> Result<PathBuf> {
    let venv = crate::root().join("target/bench-venv");
    let py = venv.join("bin/python");
    let ok = py.is_file()
        && Command::new(&py).args(["-c", "import llama_cpp"]).output().map(|o| o.status.success()).unwrap_or(false);
    if ok {
        return Ok(py);
    }
    eprintln!("installing {LLAMA_CPP_PYTHON} into {} (compiles llama.cpp; a few minutes)", venv.display());
    let mut c = Command::new("python3");
    c.args(["-m", "venv"]).arg(&venv);
    crate::run(c)?;
    let pip = venv.join("bin/pip");
    let mut c = Command::new(&pip);
    c.args(["install", "-q", "cmake", "ninja"]);
    crate::run(c)?;
    let mut c = Command::new(&pip);
    c.args(["install", "-q", "--no-cache-dir", LLAMA_CPP_PYTHON]);
    c.env("PATH", format!("{}:{}", venv.join("bin").display(), std::env::var("PATH").unwrap_or_default()));
    crate::run(c)?;
    Ok(py)
}

fn json_of(out: std::process::Output, what: &str) -> Result<serde_json::Value> {
    if !out.status.success() {
        bail!("{what} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().rev().find(|l| l.trim_start().starts_with('{')).context("no JSON output")?;
    Ok(serde_json::from_str(line)?)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Read bandwidth in bytes/s with `threads` threads over a 512 MiB buffer (best of 3).
fn read_bandwidth(threads: usize) -> f64 {
    let n = 64 << 20; // u64 words
    let buf: Vec<u64> = (0..n as u64).collect();
    let chunk = n / threads;
    let mut best = 0f64;
    for _ in 0..3 {
        let t0 = Instant::now();
        let sums: Vec<u64> = std::thread::scope(|s| {
            let hs: Vec<_> =
                buf.chunks(chunk).map(|c| s.spawn(move || c.iter().fold(0u64, |a, &b| a.wrapping_add(b)))).collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        std::hint::black_box(sums);
        best = best.max((n * 8) as f64 / t0.elapsed().as_secs_f64());
    }
    best
}

fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

fn git_commit(root: &Path) -> String {
    Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .current_dir(root)
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

pub fn run(o: &Options) -> Result<()> {
    let models = models_dir(&o.models)?;
    let mlx = models.join("smollm2-135m-instruct-mlx-4bit");
    let gguf = models.join("smollm2-135m-instruct-q4_1.gguf");
    if !mlx.is_dir() || !gguf.is_file() {
        bail!("{} lacks the SmolLM2 folders; run ../shared/models/fetch.sh", models.display());
    }
    let out = crate::build()?;
    let mlxcel = out.join("mlxcel");
    let peer = if o.no_peer { None } else { Some(peer_python()?) };
    let script = crate::root().join("xtask/bench_llama_cpp.py");

    let mut rows = Vec::new();
    for &t in &o.threads {
        let (mut m_pp, mut m_tg, mut l_pp, mut l_tg) = (vec![], vec![], vec![], vec![]);
        let mut rss = 0u64;
        let mut weights = 0u64;
        let mut kv = 0u64;
        let mut features = String::new();
        for rep in 0..o.reps {
            eprintln!("threads {t}, repetition {}/{}", rep + 1, o.reps);
            let v = json_of(
                Command::new(&mlxcel)
                    .arg("bench")
                    .arg(&mlx)
                    .args([
                        "-t",
                        &t.to_string(),
                        "-r",
                        "1",
                        "-p",
                        &o.n_prompt.to_string(),
                        "-n",
                        &o.n_gen.to_string(),
                        "--json",
                    ])
                    .output()?,
                "mlxcel bench",
            )?;
            m_pp.push(v["pp_tps"].as_f64().unwrap_or(0.0));
            m_tg.push(v["tg_tps"].as_f64().unwrap_or(0.0));
            rss = rss.max(v["peak_rss_bytes"].as_u64().unwrap_or(0));
            weights = v["weight_bytes"].as_u64().unwrap_or(0);
            kv = v["kv_bytes"].as_u64().unwrap_or(0);
            features = v["features"].as_str().unwrap_or("").to_string();
            if let Some(py) = &peer {
                let v = json_of(
                    Command::new(py)
                        .arg(&script)
                        .arg(&gguf)
                        .args([t.to_string(), o.n_prompt.to_string(), o.n_gen.to_string()])
                        .output()?,
                    "llama.cpp bench",
                )?;
                l_pp.push(v["pp_tps"].as_f64().unwrap_or(0.0));
                l_tg.push(v["tg_tps"].as_f64().unwrap_or(0.0));
            }
        }
        let bw = read_bandwidth(t);
        rows.push((
            t,
            median(m_pp),
            median(m_tg),
            (!l_pp.is_empty()).then(|| median(l_pp)),
            (!l_tg.is_empty()).then(|| median(l_tg)),
            bw,
            rss,
            weights,
            kv,
            features,
        ));
    }

    println!();
    println!(
        "Machine: {} ({} logical cores), commit {}, {}",
        cpu_name(),
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        git_commit(&crate::root()),
        chrono_free_date()
    );
    println!("Model: SmolLM2-135M-Instruct — mlxcel on the MLX 4-bit g32 folder, llama.cpp ({LLAMA_CPP_PYTHON}) on the bit-identical GGUF Q4_1. Medians of {} alternating runs.", o.reps);
    println!();
    println!("| threads | mlxcel pp{} | llama.cpp pp{} | ratio | mlxcel tg{} | llama.cpp tg{} | ratio | read bandwidth | tg floor | mlxcel share of floor | peak RSS (weights + KV) | cpu path |", o.n_prompt, o.n_prompt, o.n_gen, o.n_gen);
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (t, mpp, mtg, lpp, ltg, bw, rss, weights, kv, features) in rows {
        // Decode reads every weight byte once per token: floor = weights / bandwidth.
        let floor = bw / weights as f64;
        let r = |m: f64, l: Option<f64>| l.map_or("—".to_string(), |l| format!("{:.2}×", m / l));
        let f = |l: Option<f64>| l.map_or("—".to_string(), |l| format!("{l:.1}"));
        println!(
            "| {t} | {mpp:.1} | {} | {} | {mtg:.1} | {} | {} | {:.1} GB/s | {floor:.0} tok/s | {:.0}% | {:.0} MB ({:.0} + {:.0}) | {features} |",
            f(lpp),
            r(mpp, lpp),
            f(ltg),
            r(mtg, ltg),
            bw / 1e9,
            100.0 * mtg / floor,
            rss as f64 / 1e6,
            weights as f64 / 1e6,
            kv as f64 / 1e6
        );
    }
    Ok(())
}

fn chrono_free_date() -> String {
    Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%d")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}
