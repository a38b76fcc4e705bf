//! `cargo xtask`: build and stage plugins, install a release layout, run the tests.
//!
//!   cargo xtask build               build everything (release) and stage plugins beside the binaries
//!   cargo xtask install --prefix D  D/bin/{mlxcel,mlxcel-server} + D/lib/mlxcel/plugins/*
//!   cargo xtask test                build, stage, then run every test (what CI runs)

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

mod bench;
use clap::{Parser, Subcommand};

#[derive(Parser)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Build the workspace in release mode and stage the plugins in target/lib/mlxcel/plugins.
    Build,
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
        #[arg(long, default_value_t = 512)]
        n_prompt: usize,
        #[arg(long, default_value_t = 128)]
        n_gen: usize,
        /// Only mlxcel (no llama.cpp install or runs).
        #[arg(long)]
        no_peer: bool,
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
    let mut v = Vec::new();
    for p in plugin_packages()? {
        let golden =
            p["targets"].as_array().into_iter().flatten().any(|t| t["name"] == "golden" && t["kind"][0] == "test");
        if p["metadata"]["mlxcel"]["plugin"] == "family" && golden {
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

pub(crate) fn build() -> Result<PathBuf> {
    let mut c = cargo();
    c.args(["build", "--release", "--workspace", "--exclude", "xtask"]);
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
    Ok(out)
}

fn install(prefix: &Path) -> Result<()> {
    let out = build()?;
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
    println!("installed into {}", prefix.display());
    Ok(())
}

/// The CPU kernel paths this machine can run (see `backends/cpu/src/isa.rs`).
fn supported_isas() -> Vec<&'static str> {
    #[allow(unused_mut)]
    let mut v = vec!["scalar"];
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 =
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
        if avx2 {
            v.push("avx2");
        }
        if avx2
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
        {
            v.push("avx512");
        }
    }
    #[cfg(target_arch = "aarch64")]
    v.push("neon");
    v
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Bench { models, reps, threads, n_prompt, n_gen, no_peer } => {
            bench::run(&bench::Options { models, reps, threads, n_prompt, n_gen, no_peer })
        }
        Cmd::Build => build().map(|_| ()),
        Cmd::Install { prefix } => install(&prefix),
        Cmd::Test { rest } => {
            build()?;
            let mut c = cargo();
            c.args(["test", "--release", "--workspace", "--exclude", "xtask"]);
            c.args(&rest);
            run(c)?;
            // Every CPU kernel path this machine supports goes through the op conformance suite and
            // the golden tests (the run above used the best one).
            let golden = family_golden_tests()?;
            for isa in supported_isas() {
                println!("== op conformance and golden tests with MLXCEL_CPU_ISA={isa}");
                let suites = [("mlxcel-plugins", "op_conformance"), ("mlxcel-plugins", "quant_mlx")];
                for (package, test) in suites.into_iter().chain(golden.iter().map(|p| (p.as_str(), "golden"))) {
                    let mut c = cargo();
                    c.env("MLXCEL_CPU_ISA", isa).args(["test", "--release", "-p", package, "--test", test]);
                    run(c)?;
                }
            }
            // The exact path: f32 activations everywhere, held to the f64 op reference, to mlx-lm's
            // logits at 1e-4 and its greedy tokens exactly, and to the real-model reference at 0.01.
            println!("== golden and real-model tests with MLXCEL_CPU_INT16=0");
            let suites = [("mlxcel-plugins", "op_conformance"), ("mlxcel", "real_models")];
            for (package, test) in suites.into_iter().chain(golden.iter().map(|p| (p.as_str(), "golden"))) {
                let mut c = cargo();
                c.env("MLXCEL_CPU_INT16", "0").args(["test", "--release", "-p", package, "--test", test]);
                run(c)?;
            }
            Ok(())
        }
    }
}
