//! `cargo xtask bench --serve`: mlxcel-server beside llama.cpp's own `llama-server` on the same
//! SmolLM2-135M weights (MLX 4-bit folder vs the bit-identical GGUF Q4_1), with the same `--parallel`,
//! `--ctx-size` and threads, under the same load, one server at a time:
//!
//! - aggregate generation tokens/s for 1, 4 and 8 concurrent streams (`/completion`, greedy,
//!   `ignore_eos`, a different prompt per stream);
//! - time to first streamed token for a 1000-token prompt, cold and again with the same 1000-token
//!   prefix cached (a different question after it), with the cached tokens each server reports;
//! - peak resident memory of the server process over the whole run.
//!
//! llama-server is built with cmake from the llama.cpp sources that llama-cpp-python's source
//! distribution vendors (pinned and sha256-checked), once, into `target/bench-llama-server`.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};

use crate::bench::{machine_line, median, models_dir, path_with, tools_venv};

const LLAMA_SDIST_PACKAGE: &str = "llama-cpp-python";
const LLAMA_SDIST: &str = "llama_cpp_python-0.3.36.tar.gz";
const LLAMA_SDIST_SHA256: &str = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e";

pub struct ServeOptions {
    pub models: Option<PathBuf>,
    pub reps: usize,
    pub threads: usize,
    pub parallel: usize,
    pub ctx_size: usize,
    pub n_gen: usize,
    pub no_peer: bool,
}

/// Stream counts measured for aggregate throughput (capped at `--parallel`).
const STREAMS: [usize; 3] = [1, 4, 8];
/// Tokens of the shared prefix in the time-to-first-token measurement.
const PREFIX_TOKENS: usize = 1000;

/// llama.cpp's `llama-server`, built once from the pinned source distribution.
fn llama_server() -> Result<PathBuf> {
    let dir = crate::root().join("target/bench-llama-server");
    let bin = dir.join("build/bin/llama-server");
    if bin.is_file() {
        return Ok(bin);
    }
    std::fs::create_dir_all(&dir)?;
    let sdist = dir.join(LLAMA_SDIST);
    if !sdist.is_file() || crate::fetch::sha256_file(&sdist)? != LLAMA_SDIST_SHA256 {
        crate::fetch::download_from_index(LLAMA_SDIST_PACKAGE, LLAMA_SDIST, LLAMA_SDIST_SHA256, &sdist)?;
    }
    let got = crate::fetch::sha256_file(&sdist)?;
    ensure!(got == LLAMA_SDIST_SHA256, "{} has sha256 {got}, pinned {LLAMA_SDIST_SHA256}", sdist.display());
    let src = dir.join("src");
    if !src.join("llama_cpp_python-0.3.36/vendor/llama.cpp/CMakeLists.txt").is_file() {
        std::fs::create_dir_all(&src)?;
        let mut c = Command::new("tar");
        c.arg("xzf").arg(&sdist).arg("-C").arg(&src);
        crate::run(c)?;
    }
    let tools = tools_venv()?;
    eprintln!("building llama.cpp's llama-server with cmake (a few minutes, once)");
    let mut c = Command::new(tools.join("cmake"));
    c.arg("-S").arg(src.join("llama_cpp_python-0.3.36/vendor/llama.cpp")).arg("-B").arg(dir.join("build"));
    c.args(["-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF"]);
    c.args(["-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]);
    c.args(crate::bench::llama_cmake_defines());
    c.env("PATH", path_with(&tools));
    crate::run(c)?;
    let mut c = Command::new(tools.join("cmake"));
    c.arg("--build").arg(dir.join("build")).args(["--target", "llama-server"]);
    c.env("PATH", path_with(&tools));
    crate::run(c)?;
    ensure!(bin.is_file(), "the llama.cpp build did not produce {}", bin.display());
    Ok(bin)
}

/// A server process on a free local port, killed when dropped.
struct Server {
    child: Child,
    base: String,
}

fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

impl Server {
    /// Starts `cmd` (which must listen on `port`) and waits until `/health` answers 200.
    fn start(name: &str, mut cmd: Command, port: u16) -> Result<Self> {
        let log_path = crate::root().join(format!("target/bench-serve-{name}.log"));
        let log = std::fs::File::create(&log_path)?;
        cmd.stdout(Stdio::from(log.try_clone()?)).stderr(Stdio::from(log));
        let child = cmd.spawn().with_context(|| format!("starting {name}"))?;
        let mut server = Server { child, base: format!("http://127.0.0.1:{port}") };
        let agent = ureq::AgentBuilder::new().timeout(Duration::from_secs(5)).build();
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            if let Some(status) = server.child.try_wait()? {
                bail!("{name} exited with {status} before it was ready; its log: {}", log_path.display());
            }
            if agent.get(&format!("{}/health", server.base)).call().is_ok() {
                return Ok(server);
            }
            ensure!(Instant::now() < deadline, "{name} was not ready in 300 s; its log: {}", log_path.display());
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Peak resident set size of the process so far (`VmHWM`), in bytes.
    fn peak_rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    }

    fn post(&self, route: &str, body: &Value) -> Result<ureq::Response> {
        let agent = ureq::AgentBuilder::new().timeout(Duration::from_secs(600)).build();
        agent
            .post(&format!("{}{route}", self.base))
            .set("Content-Type", "application/json")
            .send_string(&body.to_string())
            .with_context(|| format!("POST {route} to {}", self.base))
    }

    fn post_json(&self, route: &str, body: &Value) -> Result<Value> {
        Ok(serde_json::from_str(&self.post(route, body)?.into_string()?)?)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Distinct prompts, one per stream, so no stream reuses another's cache.
fn stream_prompt(i: usize, round: usize) -> String {
    const SUBJECTS: [&str; 8] =
        ["a lighthouse", "a fox", "a violin", "a glacier", "a bakery", "a comet", "a maze", "a ferry"];
    format!("Round {round}, story {i}. Write a long, detailed story about {}.", SUBJECTS[i % SUBJECTS.len()])
}

/// `streams` concurrent greedy completions of `n_gen` tokens each: generated tokens per wall second.
fn aggregate_tps(server: &Server, streams: usize, n_gen: usize, round: usize) -> Result<f64> {
    let t0 = Instant::now();
    let tokens = std::thread::scope(|s| -> Result<u64> {
        let handles: Vec<_> = (0..streams)
            .map(|i| {
                s.spawn(move || -> Result<u64> {
                    let body = json!({
                        "prompt": stream_prompt(i, round),
                        "n_predict": n_gen,
                        "temperature": 0.0,
                        "ignore_eos": true,
                        "cache_prompt": false,
                    });
                    let v = server.post_json("/completion", &body)?;
                    v["tokens_predicted"].as_u64().context("no tokens_predicted in the answer")
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("stream thread panicked")).sum()
    })?;
    let secs = t0.elapsed().as_secs_f64();
    ensure!(tokens >= (streams * n_gen) as u64 * 9 / 10, "only {tokens} tokens for {streams} × {n_gen}");
    Ok(tokens as f64 / secs)
}

/// A passage of at least [`PREFIX_TOKENS`] tokens (counted by the server's tokenizer), unique to `salt`.
fn long_prefix(server: &Server, salt: &str) -> Result<String> {
    let mut text = format!("Notebook {salt}.\n");
    let mut i = 0;
    loop {
        let v = server.post_json("/tokenize", &json!({"content": text}))?;
        let n = v["tokens"].as_array().map_or(0, |t| t.len());
        if n >= PREFIX_TOKENS {
            return Ok(text);
        }
        for _ in 0..((PREFIX_TOKENS - n) / 24).max(1) {
            i += 1;
            text.push_str(&format!("Entry {i}: the river passed mill number {} before it reached the sea.\n", i * 7));
        }
    }
}

/// Time to the first streamed token of `prompt` and the cached prompt tokens the server reports.
fn first_token(server: &Server, prompt: &str) -> Result<(f64, u64)> {
    let body = json!({"prompt": prompt, "n_predict": 4, "temperature": 0.0, "stream": true, "cache_prompt": true});
    let t0 = Instant::now();
    let resp = server.post("/completion", &body)?;
    let mut ttft = None;
    let mut cached = 0;
    for line in BufReader::new(resp.into_reader()).lines() {
        let line = line?;
        let Some(data) = line.strip_prefix("data: ") else { continue };
        let Ok(v) = serde_json::from_str::<Value>(data) else { continue };
        if ttft.is_none() && v["content"].as_str().is_some_and(|c| !c.is_empty()) {
            ttft = Some(t0.elapsed().as_secs_f64());
        }
        if let Some(n) = v["timings"]["cache_n"].as_u64() {
            cached = n;
        }
    }
    Ok((ttft.context("the stream carried no token")?, cached))
}

#[derive(Default)]
struct Figures {
    tps: Vec<Vec<f64>>,
    cold_ms: Vec<f64>,
    warm_ms: Vec<f64>,
    cached: u64,
    rss: u64,
}

/// One repetition of every measurement on `server`.
fn measure(server: &Server, o: &ServeOptions, streams: &[usize], rep: usize, f: &mut Figures) -> Result<()> {
    f.tps.resize(streams.len(), vec![]);
    for (k, &n) in streams.iter().enumerate() {
        f.tps[k].push(aggregate_tps(server, n, o.n_gen, rep)?);
    }
    let prefix = long_prefix(server, &format!("{rep}-{}", std::process::id()))?;
    let (cold, _) = first_token(server, &format!("{prefix}Question: which entry mentions mill 70?"))?;
    let (warm, cached) = first_token(server, &format!("{prefix}Question: where does the river end?"))?;
    f.cold_ms.push(cold * 1e3);
    f.warm_ms.push(warm * 1e3);
    f.cached = cached;
    f.rss = f.rss.max(server.peak_rss());
    Ok(())
}

pub fn run(o: &ServeOptions) -> Result<()> {
    let models = models_dir(&o.models)?;
    let mlx = models.join("smollm2-135m-instruct-mlx-4bit");
    let gguf = models.join("smollm2-135m-instruct-q4_1.gguf");
    if !mlx.is_dir() || !gguf.is_file() {
        bail!("{} lacks the SmolLM2 folders; run ../shared/models/fetch.sh", models.display());
    }
    let out = crate::build()?;
    let peer = if o.no_peer { None } else { Some(llama_server()?) };
    let streams: Vec<usize> = STREAMS.iter().copied().filter(|&n| n <= o.parallel).collect();
    let common = |c: &mut Command, port: u16| {
        c.args(["--host", "127.0.0.1", "--port", &port.to_string()]);
        c.args(["-np", &o.parallel.to_string(), "-c", &o.ctx_size.to_string(), "-t", &o.threads.to_string()]);
    };
    let (mut ours, mut theirs) = (Figures::default(), Figures::default());
    for rep in 0..o.reps {
        eprintln!("repetition {}/{}: mlxcel-server", rep + 1, o.reps);
        let port = free_port()?;
        let mut c = Command::new(out.join("mlxcel-server"));
        c.arg("-m").arg(&mlx);
        common(&mut c, port);
        let server = Server::start("mlxcel-server", c, port)?;
        measure(&server, o, &streams, rep, &mut ours)?;
        drop(server);
        if let Some(bin) = &peer {
            eprintln!("repetition {}/{}: llama-server", rep + 1, o.reps);
            let port = free_port()?;
            let mut c = Command::new(bin);
            c.arg("-m").arg(&gguf);
            common(&mut c, port);
            // One KV pool shared by all slots, as mlxcel's paged cache is (otherwise -c is split per slot
            // and a 1000-token prompt does not fit a slot at -np 8 -c 8192).
            c.arg("--kv-unified");
            let server = Server::start("llama-server", c, port)?;
            measure(&server, o, &streams, rep, &mut theirs)?;
        }
    }

    let have_peer = peer.is_some();
    let med = |v: &[f64]| if v.is_empty() { None } else { Some(median(v.to_vec())) };
    let num = |x: Option<f64>| x.map_or("—".to_string(), |x| format!("{x:.1}"));
    let ratio = |a: Option<f64>, b: Option<f64>, higher_better: bool| match (a, b) {
        (Some(a), Some(b)) if a > 0.0 && b > 0.0 => format!("{:.2}×", if higher_better { a / b } else { b / a }),
        _ => "—".to_string(),
    };
    println!();
    println!("{}", machine_line());
    println!(
        "Serving SmolLM2-135M-Instruct: mlxcel-server on the MLX 4-bit g32 folder, llama.cpp's llama-server \
         ({LLAMA_SDIST}, --kv-unified) on the bit-identical GGUF Q4_1; both -np {} -c {} -t {}. \
         Medians of {} runs; ratios are mlxcel's advantage (>1 is better).",
        o.parallel, o.ctx_size, o.threads, o.reps
    );
    println!();
    println!("| measure | mlxcel-server | llama-server | ratio |");
    println!("|---|---|---|---|");
    for (k, &n) in streams.iter().enumerate() {
        let (a, b) = (med(&ours.tps[k]), theirs.tps.get(k).and_then(|v| med(v)));
        println!(
            "| aggregate tok/s, {n} stream(s) × {} tokens | {} | {} | {} |",
            o.n_gen,
            num(a),
            num(b),
            ratio(a, b, true)
        );
    }
    if streams.len() > 1 {
        let last = streams.len() - 1;
        let scale = |f: &Figures| match (f.tps.first().and_then(|v| med(v)), f.tps.get(last).and_then(|v| med(v))) {
            (Some(one), Some(many)) if one > 0.0 => Some(many / one),
            _ => None,
        };
        let (a, b) = (scale(&ours), scale(&theirs));
        let x = |v: Option<f64>| v.map_or("—".to_string(), |v| format!("{v:.2}×"));
        println!("| {} streams vs 1 | {} | {} | |", streams[last], x(a), x(b));
    }
    let (a, b) = (med(&ours.cold_ms), med(&theirs.cold_ms));
    println!(
        "| first token, {PREFIX_TOKENS}-token prompt, cold (ms) | {} | {} | {} |",
        num(a),
        num(b),
        ratio(a, b, false)
    );
    let (a, b) = (med(&ours.warm_ms), med(&theirs.warm_ms));
    println!(
        "| first token, same {PREFIX_TOKENS}-token prefix cached (ms) | {} | {} | {} |",
        num(a),
        num(b),
        ratio(a, b, false)
    );
    let cached = |f: &Figures, ran: bool| if ran { f.cached.to_string() } else { "—".into() };
    println!("| prompt tokens reported cached | {} | {} | |", ours.cached, cached(&theirs, have_peer));
    let mb = |f: &Figures, ran: bool| if ran { format!("{:.0} MB", f.rss as f64 / 1e6) } else { "—".into() };
    let (a, b) = (Some(ours.rss as f64), have_peer.then_some(theirs.rss as f64));
    println!(
        "| peak RSS at -np {} -c {} | {} | {} | {} |",
        o.parallel,
        o.ctx_size,
        mb(&ours, true),
        mb(&theirs, have_peer),
        ratio(a, b, false)
    );
    Ok(())
}
