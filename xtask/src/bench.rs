//! `cargo xtask bench`: mlxcel and llama.cpp on the same SmolLM2-135M weights (MLX 4-bit folder vs the
//! bit-identical GGUF Q4_1), alternating runs, medians, ratios, and mlxcel's share of the memory
//! bandwidth floor. Prints a Markdown table for docs/benchmarks.md.
//!
//! `--backend mlx` measures mlxcel's MLX backend instead, beside mlx-lm (`xtask/bench_mlx_lm.py`, run
//! by `--mlx-lm-python`, default `python3`) on the same MLX folder: both on the same libmlx.

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
    /// Contexts at which generation is also timed (llama-bench's `-d`).
    pub depths: Vec<usize>,
    pub no_peer: bool,
    /// `mlx`: mlxcel's MLX backend against mlx-lm; otherwise the host's default against llama.cpp.
    pub backend: Option<String>,
    pub mlx_lm_python: PathBuf,
}

pub const LLAMA_CPP_PYTHON: &str = "llama-cpp-python==0.3.36";

pub fn models_dir(opt: &Option<PathBuf>) -> Result<PathBuf> {
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

/// The bench venv (`target/bench-venv`) with cmake and ninja from the package registry; its `bin`.
pub fn tools_venv() -> Result<PathBuf> {
    let venv = crate::root().join("target/bench-venv");
    let bin = venv.join("bin");
    if bin.join("cmake").is_file() && bin.join("ninja").is_file() {
        return Ok(bin);
    }
    let mut c = Command::new("python3");
    c.args(["-m", "venv"]).arg(&venv);
    crate::run(c)?;
    let mut c = Command::new(bin.join("pip"));
    c.args(["install", "-q", "cmake", "ninja"]);
    crate::run(c)?;
    Ok(bin)
}

/// `PATH` with the bench venv's tools first.
pub fn path_with(bin: &Path) -> String {
    format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default())
}

/// Compiler flags for the llama.cpp peers (llama-cpp-python and llama-server) beyond the native
/// ones: on hosts with AMX-INT8, ggml's AMX matmul (built whenever `-march=native` defines
/// `__AMX_INT8__`) crashed on the bench's Q4_1 model (SIGSEGV in `ggml_backend_amx_mul_mat`, Xeon
/// with AMX, llama.cpp of llama-cpp-python 0.3.36), so the peers are built without it there and use
/// their AVX-512 kernels.
pub fn llama_cmake_defines() -> Vec<&'static str> {
    #[cfg(target_arch = "x86_64")]
    if std::arch::x86_64::__cpuid_count(7, 0).edx >> 25 & 1 == 1 {
        return vec!["-DCMAKE_C_FLAGS=-mno-amx-int8", "-DCMAKE_CXX_FLAGS=-mno-amx-int8"];
    }
    Vec::new()
}

/// A venv with llama-cpp-python (compiled from source with native flags, ~4 minutes the first time).
fn peer_python() -> Result<PathBuf> {
    let bin = tools_venv()?;
    let py = bin.join("python");
    let ok = Command::new(&py).args(["-c", "import llama_cpp"]).output().map(|o| o.status.success()).unwrap_or(false);
    if ok {
        return Ok(py);
    }
    eprintln!("installing {LLAMA_CPP_PYTHON} into the bench venv (compiles llama.cpp; a few minutes)");
    let mut c = Command::new(bin.join("pip"));
    c.args(["install", "-q", "--no-cache-dir", LLAMA_CPP_PYTHON]);
    c.env("PATH", path_with(&bin));
    let defines = llama_cmake_defines();
    if !defines.is_empty() {
        // After any the caller set (as for the AVX2 stand-in build in docs/benchmarks.md).
        let user = std::env::var("CMAKE_ARGS").unwrap_or_default();
        c.env("CMAKE_ARGS", format!("{user} {}", defines.join(" ")).trim());
    }
    crate::run(c)?;
    Ok(py)
}

pub(crate) fn json_of(out: std::process::Output, what: &str) -> Result<serde_json::Value> {
    if !out.status.success() {
        bail!("{what} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().rev().find(|l| l.trim_start().starts_with('{')).context("no JSON output")?;
    Ok(serde_json::from_str(line)?)
}

pub fn median(mut v: Vec<f64>) -> f64 {
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

pub fn cpu_name() -> String {
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

pub fn git_commit(root: &Path) -> String {
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
    let on_mlx = o.backend.as_deref() == Some("mlx");
    let out = crate::build()?;
    let mlxcel = out.join("mlxcel");
    let peer = match (o.no_peer, on_mlx) {
        (true, _) => None,
        (false, true) => Some(o.mlx_lm_python.clone()),
        (false, false) => Some(peer_python()?),
    };
    let peer_name = if on_mlx { "mlx-lm" } else { "llama.cpp" };
    let script = crate::root().join(if on_mlx { "xtask/bench_mlx_lm.py" } else { "xtask/bench_llama_cpp.py" });
    let backend_args: Vec<String> = o.backend.iter().flat_map(|b| ["--backend".to_string(), b.clone()]).collect();

    let depth_list = o.depths.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(",");
    let depth_args: Vec<String> = if o.depths.is_empty() { vec![] } else { vec!["-d".to_string(), depth_list.clone()] };
    let mut rows = Vec::new();
    // (threads, depth, mlxcel tg runs, peer tg runs)
    let mut depth_rows: Vec<(usize, usize, Vec<f64>, Vec<f64>)> = Vec::new();
    for &t in &o.threads {
        let (mut m_pp, mut m_tg, mut l_pp, mut l_tg) = (vec![], vec![], vec![], vec![]);
        let first_depth_row = depth_rows.len();
        depth_rows.extend(o.depths.iter().map(|&d| (t, d, vec![], vec![])));
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
                    .args(&backend_args)
                    .args(&depth_args)
                    .output()?,
                "mlxcel bench",
            )?;
            for (row, d) in
                depth_rows[first_depth_row..].iter_mut().zip(v["tg_at_depth"].as_array().into_iter().flatten())
            {
                row.2.push(d["tg_tps"].as_f64().unwrap_or(0.0));
            }
            m_pp.push(v["pp_tps"].as_f64().unwrap_or(0.0));
            m_tg.push(v["tg_tps"].as_f64().unwrap_or(0.0));
            rss = rss.max(v["peak_rss_bytes"].as_u64().unwrap_or(0));
            weights = v["weight_bytes"].as_u64().unwrap_or(0);
            kv = v["kv_bytes"].as_u64().unwrap_or(0);
            features = v["features"].as_str().unwrap_or("").to_string();
            if let Some(py) = &peer {
                let mut c = Command::new(py);
                c.arg(&script);
                if on_mlx {
                    c.arg(&mlx).args([o.n_prompt.to_string(), o.n_gen.to_string()]);
                } else {
                    c.arg(&gguf).args([t.to_string(), o.n_prompt.to_string(), o.n_gen.to_string()]);
                    c.arg(&depth_list);
                }
                let v = json_of(c.output()?, &format!("{peer_name} bench"))?;
                l_pp.push(v["pp_tps"].as_f64().unwrap_or(0.0));
                l_tg.push(v["tg_tps"].as_f64().unwrap_or(0.0));
                // mlx-lm's script times no depths: its column stays empty.
                for (row, d) in
                    depth_rows[first_depth_row..].iter_mut().zip(v["tg_at_depth"].as_array().into_iter().flatten())
                {
                    row.3.push(d["tg_tps"].as_f64().unwrap_or(0.0));
                }
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
    println!("{}", machine_line());
    if on_mlx {
        println!("Model: SmolLM2-135M-Instruct — mlxcel --backend mlx and mlx-lm on the same MLX 4-bit g32 folder. Medians of {} alternating runs.", o.reps);
    } else {
        println!("Model: SmolLM2-135M-Instruct — mlxcel on the MLX 4-bit g32 folder, llama.cpp ({LLAMA_CPP_PYTHON}) on the bit-identical GGUF Q4_1. Medians of {} alternating runs.", o.reps);
    }
    println!();
    println!("| threads | mlxcel pp{} | {peer_name} pp{} | ratio | mlxcel tg{} | {peer_name} tg{} | ratio | read bandwidth | tg floor | mlxcel share of floor | peak RSS (weights + KV) | backend |", o.n_prompt, o.n_prompt, o.n_gen, o.n_gen);
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (t, mpp, mtg, lpp, ltg, bw, rss, weights, kv, features) in rows {
        // Decode reads every weight byte once per token: floor = weights / bandwidth.
        let floor = bw / weights as f64;
        let r = |m: f64, l: Option<f64>| l.map_or("—".to_string(), |l| format!("{:.2}×", m / l));
        let f =
            |l: Option<f64>| l.map_or("—".to_string(), |l| if l < 1.0 { format!("{l:.3}") } else { format!("{l:.1}") });
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
    if !depth_rows.is_empty() {
        println!();
        println!("Generation on top of a filled context (tg{} after d tokens, prefilled untimed):", o.n_gen);
        println!();
        println!("| threads | depth | mlxcel tg{} | {peer_name} tg{} | ratio |", o.n_gen, o.n_gen);
        println!("|---|---|---|---|---|");
        for (t, d, m, l) in depth_rows {
            let m = median(m);
            let (l, ratio) = if l.is_empty() {
                ("—".to_string(), "—".to_string())
            } else {
                let l = median(l);
                (format!("{l:.1}"), format!("{:.2}×", m / l))
            };
            println!("| {t} | {d} | {m:.1} | {l} | {ratio} |");
        }
    }
    Ok(())
}

/// The line every bench prints before its table: CPU, logical cores, commit and date.
pub fn machine_line() -> String {
    format!(
        "Machine: {} ({} logical cores), commit {}, {}",
        cpu_name(),
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        git_commit(&crate::root()),
        chrono_free_date()
    )
}

pub fn chrono_free_date() -> String {
    Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%d")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}
