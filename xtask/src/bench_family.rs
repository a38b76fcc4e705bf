//! `cargo xtask bench --family`: prefill and decode speed of every architecture family on random MLX
//! 4-bit checkpoints of one shape (xtask/bench_family.py writes them with mlx-lm into
//! target/bench-families), side by side with llama, so a family much slower than llama at equal size
//! shows; and a mixture of experts (qwen3_moe, top-2 of 8) beside its dense equivalent (a llama whose MLP
//! is all 8 experts wide), whose time per token must stay well under half of the dense one's: the MoE
//! path computes only the routed experts.
//!
//! mlx-lm runs in a venv of its own, target/bench-mlx-venv (mlx-cpu, mlx and mlx-lm from the package
//! registry, pinned below).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::bench::{json_of, machine_line, median};

/// What the fixture generators (tools/fixtures/golden_common.py) are pinned to.
pub const MLX_LM_PACKAGES: [&str; 3] = ["mlx-cpu==0.32.4", "mlx==0.32.4", "mlx-lm==0.32.2"];
pub const N_PROMPT: usize = 256;
pub const N_GEN: usize = 64;

pub struct Options {
    pub reps: usize,
    pub threads: Vec<usize>,
}

/// The Python of target/bench-mlx-venv, made (and mlx-lm installed into it) on first use.
fn mlx_lm_python() -> Result<PathBuf> {
    let venv = crate::root().join("target").join("bench-mlx-venv");
    let py = venv.join("bin").join("python");
    let ok = |py: &Path| {
        Command::new(py).args(["-c", "import mlx_lm, tokenizers"]).output().map(|o| o.status.success()).unwrap_or(false)
    };
    if ok(&py) {
        return Ok(py);
    }
    eprintln!("== creating {} with {}", venv.display(), MLX_LM_PACKAGES.join(" "));
    let mut c = Command::new("python3");
    c.args(["-m", "venv"]).arg(&venv);
    crate::run(c).context("python3 with venv is needed for the family bench")?;
    let mut c = Command::new(venv.join("bin").join("pip"));
    c.args(["install", "-q"]).args(MLX_LM_PACKAGES);
    crate::run(c)?;
    if !ok(&py) {
        bail!("{} still cannot import mlx_lm", py.display());
    }
    Ok(py)
}

/// One checkpoint of families.json plus what mlxcel made of it.
struct Case {
    name: String,
    model_type: String,
    dir: PathBuf,
    params: u64,
    active_params: u64,
    /// The plugin that serves it (`mlxcel inspect --json`), or why it could not be opened.
    family: std::result::Result<String, String>,
    weight_bytes: u64,
    /// Per thread count: prefill and decode runs.
    pp: Vec<Vec<f64>>,
    tg: Vec<Vec<f64>>,
    error: Option<String>,
}

/// The last non-empty line of an error (its stderr ends with the reason).
fn last_line(e: &anyhow::Error) -> String {
    let s = format!("{e:#}");
    s.lines().map(str::trim).rfind(|l| !l.is_empty()).unwrap_or("").to_string()
}

pub fn run(o: &Options) -> Result<()> {
    if o.reps == 0 || o.threads.is_empty() {
        bail!("--reps and --threads must not be empty");
    }
    let out = crate::build()?;
    let mlxcel = out.join("mlxcel");
    let py = mlx_lm_python()?;
    let dir = crate::root().join("target").join("bench-families");
    eprintln!("== writing the family checkpoints into {} (kept when unchanged)", dir.display());
    let mut c = Command::new(&py);
    c.arg(crate::root().join("xtask").join("bench_family.py")).arg(&dir);
    crate::run(c)?;
    let listing: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("families.json")).context("bench_family.py wrote no families.json")?,
    )?;
    let mut cases: Vec<Case> = listing
        .as_array()
        .context("bench_family.py: expected a JSON list")?
        .iter()
        .map(|v| {
            let dir = PathBuf::from(v["dir"].as_str().unwrap_or_default());
            let family = Command::new(&mlxcel)
                .arg("inspect")
                .arg(&dir)
                .arg("--json")
                .output()
                .map_err(anyhow::Error::from)
                .and_then(|out| {
                    if !out.status.success() {
                        bail!("{}", String::from_utf8_lossy(&out.stderr));
                    }
                    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
                    Ok(v["family"].as_str().unwrap_or("?").to_string())
                })
                .map_err(|e| last_line(&e));
            Case {
                name: v["name"].as_str().unwrap_or_default().to_string(),
                model_type: v["model_type"].as_str().unwrap_or_default().to_string(),
                dir,
                params: v["params"].as_u64().unwrap_or(0),
                active_params: v["active_params"].as_u64().unwrap_or(0),
                family,
                weight_bytes: 0,
                pp: vec![vec![]; o.threads.len()],
                tg: vec![vec![]; o.threads.len()],
                error: None,
            }
        })
        .collect();

    // The machine's load says how far to trust the figures.
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| "unknown".into());
    // Repetitions outermost, so that a change in the machine's load spreads over every family.
    for rep in 0..o.reps {
        for (ti, &t) in o.threads.iter().enumerate() {
            for c in cases.iter_mut().filter(|c| c.error.is_none()) {
                eprintln!("{} ({}), threads {t}, repetition {}/{}", c.name, c.model_type, rep + 1, o.reps);
                let r = Command::new(&mlxcel)
                    .arg("bench")
                    .arg(&c.dir)
                    .args(["-t", &t.to_string(), "-r", "1", "-p", &N_PROMPT.to_string(), "-n", &N_GEN.to_string()])
                    .arg("--json")
                    .output()
                    .map_err(anyhow::Error::from)
                    .and_then(|out| json_of(out, "mlxcel bench"));
                match r {
                    Ok(v) => {
                        c.pp[ti].push(v["pp_tps"].as_f64().unwrap_or(0.0));
                        c.tg[ti].push(v["tg_tps"].as_f64().unwrap_or(0.0));
                        c.weight_bytes = v["weight_bytes"].as_u64().unwrap_or(0);
                    }
                    Err(e) => {
                        eprintln!("  failed: {e:#}");
                        c.error = Some(last_line(&e));
                    }
                }
            }
        }
    }

    println!();
    println!("{}", machine_line());
    println!(
        "Random MLX 4-bit (group 64) checkpoints from mlx-lm, all hidden 512, 8 layers, 8/4 heads of 64, MLP 1536, \
         vocabulary 32000 (xtask/bench_family.py); pp{N_PROMPT} and tg{N_GEN}, median of {} run(s) each; \
         load average {load} before the runs.",
        o.reps
    );
    let mb = |n: u64| format!("{:.1}", n as f64 / 1e6);
    for (ti, &t) in o.threads.iter().enumerate() {
        let speed = |c: &Case| {
            (c.error.is_none() && !c.tg[ti].is_empty()).then(|| (median(c.pp[ti].clone()), median(c.tg[ti].clone())))
        };
        let llama = cases.iter().find(|c| c.name == "llama").and_then(speed);
        println!();
        println!("threads {t}:");
        println!();
        println!("| case | family | model_type | params (M) | used per token (M) | weights (MB) | pp{N_PROMPT} tok/s | pp vs llama | tg{N_GEN} tok/s | tg vs llama |");
        println!("|---|---|---|---|---|---|---|---|---|---|");
        for c in &cases {
            let family = c.family.clone().unwrap_or_else(|_| "—".into());
            let head =
                format!("| {} | {family} | {} | {} | {} |", c.name, c.model_type, mb(c.params), mb(c.active_params));
            match (speed(c), &c.error, &c.family) {
                (Some((pp, tg)), _, _) => {
                    let r = |x: f64, l: Option<f64>| l.map_or("—".to_string(), |l| format!("{:.2}×", x / l));
                    println!(
                        "{head} {} | {pp:.1} | {} | {tg:.1} | {} |",
                        mb(c.weight_bytes),
                        r(pp, llama.map(|l| l.0)),
                        r(tg, llama.map(|l| l.1))
                    );
                }
                (_, Some(e), _) | (_, None, Err(e)) => println!("{head} — | FAILED: {e} | | | |"),
                _ => println!("{head} — | — | | | |"),
            }
        }
        let moe = cases.iter().find(|c| c.name == "qwen3_moe").and_then(speed);
        let dense = cases.iter().find(|c| c.name == "llama-dense8").and_then(speed);
        println!();
        match (moe, dense) {
            (Some((mpp, mtg)), Some((dpp, dtg))) => println!(
                "qwen3_moe top-2 of 8: tg {mtg:.1} tok/s vs dense-equivalent {dtg:.1} tok/s: time per token {:.2}× of dense \
                 (goal: well under 0.5; prefill {:.2}×)",
                dtg / mtg,
                dpp / mpp
            ),
            _ => println!("qwen3_moe top-2 of 8 vs dense-equivalent: not measured (a run failed, see above)"),
        }
    }
    if let Some(c) = cases.iter().find(|c| c.error.is_some() || c.family.is_err()) {
        bail!("{} ({}) did not run in mlxcel", c.name, c.model_type);
    }
    Ok(())
}
