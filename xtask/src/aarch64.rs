//! AArch64 from an x86-64 host: `cargo clippy --target aarch64-unknown-linux-gnu` of the workspace
//! (a check, warnings as errors), then under `qemu-aarch64` the CPU backend's unit tests, the op
//! conformance suite once per kernel path (`scalar`, `neon`, `neondot`: qemu's CPU has the dot
//! product, and `MLXCEL_CPU_ISA=neon` forces the kernels without it) and the llama family's golden
//! tests (4-bit checkpoints against mlx-lm) on both NEON paths.
//!
//! rustup cannot fetch another target's standard library here, so this uses Debian's own Rust
//! (`rustc-web`, with `libstd-rust-web-dev:arm64`, and its clippy) for the target, the cross linker
//! `aarch64-linux-gnu-gcc`, and qemu-user running the binaries against the arm64 C library of
//! Debian's multiarch (`/lib/aarch64-linux-gnu`: the cross toolchain's own copy under
//! `/usr/aarch64-linux-gnu`, which `qemu-aarch64 -L` would use, hangs the first thread a program
//! starts under qemu 7.2).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::{root, run};

const TARGET: &str = "aarch64-unknown-linux-gnu";

/// What `.ci/run` installs (after `dpkg --add-architecture arm64`).
pub const PACKAGES: &str =
    "rustc-web cargo-web rust-web-clippy libstd-rust-web-dev:arm64 gcc-aarch64-linux-gnu qemu-user";

/// Debian's `rustc`, `cargo` and `cargo-clippy` (never rustup's proxies, which have no AArch64
/// standard library), all in `/usr/bin`.
struct Toolchain {
    rustc: PathBuf,
    cargo: PathBuf,
}

const BIN: &str = "/usr/bin";

/// The cross toolchain, or why it is missing.
fn toolchain() -> Result<Toolchain, String> {
    let (rustc, cargo) = (Path::new(BIN).join("rustc"), Path::new(BIN).join("cargo"));
    let sysroot = Command::new(&rustc)
        .args(["--print", "sysroot"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()));
    let Some(sysroot) = sysroot else { return Err(format!("{} is missing", rustc.display())) };
    if !sysroot.join("lib/rustlib").join(TARGET).join("lib").is_dir() {
        return Err(format!("no {TARGET} standard library for {}", rustc.display()));
    }
    for tool in ["aarch64-linux-gnu-gcc", "qemu-aarch64"] {
        if Command::new(tool).arg("--version").output().is_err() {
            return Err(format!("{tool} is missing"));
        }
    }
    for tool in [&cargo, &Path::new(BIN).join("cargo-clippy")] {
        if !tool.is_file() {
            return Err(format!("{} is missing", tool.display()));
        }
    }
    Ok(Toolchain { rustc, cargo })
}

/// Whether the cross toolchain is installed; else why not and how to install it.
pub fn available() -> Result<(), String> {
    toolchain().map(|_| ()).map_err(with_hint)
}

fn with_hint(why: String) -> String {
    format!("{why} (install: dpkg --add-architecture arm64 && apt-get update && apt-get install {PACKAGES})")
}

fn target_dir() -> PathBuf {
    root().join("target/aarch64")
}

impl Toolchain {
    fn cargo(&self) -> Command {
        let mut c = Command::new(&self.cargo);
        c.current_dir(root());
        c.env("RUSTC", &self.rustc).env_remove("RUSTC_WRAPPER").env_remove("CARGO");
        // `cargo clippy` runs the first `cargo-clippy` on PATH: Debian's, not rustup's proxy.
        let path = std::env::var_os("PATH").unwrap_or_default();
        let dirs = std::iter::once(PathBuf::from(BIN)).chain(std::env::split_paths(&path));
        c.env("PATH", std::env::join_paths(dirs).expect("PATH entries"));
        // `cargo xtask test` points MLX_DIR at this host's libmlx; the MLX plugin is checked without it.
        c.env_remove("MLX_DIR");
        c.env("CARGO_TARGET_DIR", target_dir());
        c.env("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER", "aarch64-linux-gnu-gcc");
        c.env("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER", "qemu-aarch64");
        // The same flags for every step, so that the release builds share their dependencies.
        c.env("RUSTFLAGS", "-D warnings");
        c
    }
}

/// Checks the workspace for AArch64; unless `check_only`, also runs the tests under qemu.
pub fn run_all(check_only: bool) -> Result<()> {
    let tc = toolchain().map_err(|why| anyhow::anyhow!(with_hint(why)))?;
    println!("== cargo clippy --target {TARGET} (Debian's Rust, warnings as errors)");
    let mut c = tc.cargo();
    c.args(["clippy", "--target", TARGET, "--workspace", "--all-targets", "--exclude", "xtask", "--quiet"]);
    c.args(["--", "-D", "warnings"]);
    run(c)?;
    if check_only {
        return Ok(());
    }
    println!("== the CPU backend's unit tests under qemu-aarch64");
    let mut c = tc.cargo();
    c.args(["build", "--release", "--target", TARGET, "-p", "mlxcel-backend-cpu", "-p", "mlxcel-family-llama"]);
    run(c)?;
    stage_plugins()?;
    let mut c = tc.cargo();
    c.args(["test", "--release", "--target", TARGET, "-p", "mlxcel-backend-cpu", "--lib"]);
    run(c)?;
    for isa in ["scalar", "neon", "neondot"] {
        println!("== op conformance under qemu-aarch64 with MLXCEL_CPU_ISA={isa}");
        let mut c = tc.cargo();
        c.env("MLXCEL_CPU_ISA", isa).env("MLXCEL_TEST_BACKEND", "cpu");
        c.args(["test", "--release", "--target", TARGET, "-p", "mlxcel-plugins", "--test", "op_conformance"]);
        run(c)?;
        if isa != "scalar" {
            println!("== llama family golden tests under qemu-aarch64 with MLXCEL_CPU_ISA={isa}");
            let mut c = tc.cargo();
            c.env("MLXCEL_CPU_ISA", isa).env("MLXCEL_TEST_BACKEND", "cpu");
            c.args(["test", "--release", "--target", TARGET, "-p", "mlxcel-family-llama", "--test", "golden"]);
            run(c)?;
        }
    }
    Ok(())
}

/// Puts the AArch64 CPU backend and llama family plugins where the tests look
/// (`$CARGO_TARGET_DIR/lib/mlxcel/plugins`), and nothing else.
fn stage_plugins() -> Result<()> {
    let staged: &Path = &target_dir().join("lib/mlxcel/plugins");
    std::fs::create_dir_all(staged).with_context(|| format!("creating {}", staged.display()))?;
    for entry in std::fs::read_dir(staged)? {
        std::fs::remove_file(entry?.path())?;
    }
    for lib in ["libmlxcel_backend_cpu.so", "libmlxcel_family_llama.so"] {
        let built = target_dir().join(TARGET).join("release").join(lib);
        if !built.is_file() {
            bail!("{} was not built", built.display());
        }
        std::fs::copy(&built, staged.join(lib)).with_context(|| format!("staging {}", built.display()))?;
    }
    Ok(())
}
