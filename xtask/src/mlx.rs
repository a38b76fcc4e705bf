//! MLX for the `mlx` backend plugin: where this machine has it, and the pinned wheel CI fetches.
//!
//! The plugin's build script finds MLX by itself (`MLX_DIR`, else Python's `mlx` package); `cargo xtask`
//! looks in the same places plus the wheel `fetch-mlx` unpacked under `target/mlx-wheel`, and passes
//! what it found as `MLX_DIR`, so the two always agree and `xtask test` knows whether to run the MLX
//! suites.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

use crate::root;

/// The pinned wheel (manylinux x86_64): libmlx, its headers and its BLAS/LAPACK.
pub const WHEEL_PIN: &str = "mlx-cpu==0.32.4";
const WHEEL_FILE: &str = "mlx_cpu-0.32.4-py3-none-manylinux_2_35_x86_64.whl";
const WHEEL_SHA256: &str = "0e0a24fa2ce8b6b94d2e6a90604e8813aa8e29fcb918bb2aa01cfb6d133d8cee";

/// Where `fetch-mlx` downloads and unpacks the wheel.
pub fn wheel_dir() -> PathBuf {
    root().join("target").join("mlx-wheel")
}

fn usable(dir: &Path) -> bool {
    dir.join("include/mlx/mlx.h").is_file()
        && ["libmlx.so", "libmlx.dylib"].iter().any(|f| dir.join("lib").join(f).is_file())
}

/// An MLX install: its `mlx` folder (`include/`, `lib/`) and how it was found.
pub struct MlxInstall {
    pub dir: PathBuf,
    pub how: String,
}

/// MLX on this machine: `MLX_DIR`, else the fetched wheel, else Python's `mlx` package.
pub fn find() -> Result<Option<MlxInstall>> {
    if let Some(dir) = std::env::var_os("MLX_DIR").map(PathBuf::from) {
        if !usable(&dir) {
            bail!("MLX_DIR={} has no include/mlx/mlx.h and lib/libmlx", dir.display());
        }
        return Ok(Some(MlxInstall { dir, how: "MLX_DIR".into() }));
    }
    let fetched = wheel_dir().join("mlx");
    if usable(&fetched) {
        return Ok(Some(MlxInstall {
            dir: fetched,
            how: format!("the {WHEEL_PIN} wheel from `cargo xtask fetch-mlx`"),
        }));
    }
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    if let Ok(out) = Command::new(&python).args(["-c", "import mlx; print(list(mlx.__path__)[0])"]).output() {
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if out.status.success() && usable(&dir) {
            return Ok(Some(MlxInstall { dir, how: format!("the Python package `mlx` of {python}") }));
        }
    }
    Ok(None)
}

fn sha256(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect())
}

/// Downloads the pinned wheel with pip, checks its SHA-256 and unpacks it into `target/mlx-wheel`.
pub fn fetch() -> Result<PathBuf> {
    if !(cfg!(target_os = "linux") && cfg!(target_arch = "x86_64")) {
        bail!(
            "the pinned wheel is {WHEEL_PIN} for Linux x86_64; elsewhere `pip install mlx-metal` (macOS) or \
             `mlx-cuda` and point MLX_DIR at its `mlx` folder"
        );
    }
    let dir = wheel_dir();
    std::fs::create_dir_all(&dir)?;
    let wheel = dir.join(WHEEL_FILE);
    if !wheel.is_file() {
        let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
        let mut c = Command::new(&python);
        c.args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--platform"])
            .args(["manylinux_2_35_x86_64", "--python-version", "3.11", "-d"])
            .arg(&dir)
            .arg(WHEEL_PIN);
        crate::run(c).context("downloading the MLX wheel with pip (is pip installed and the index reachable?)")?;
    }
    let got = sha256(&wheel)?;
    if got != WHEEL_SHA256 {
        bail!("{} has SHA-256 {got}, expected {WHEEL_SHA256}: delete it and fetch again", wheel.display());
    }
    if !usable(&dir.join("mlx")) {
        let mut c = Command::new(std::env::var("PYTHON").unwrap_or_else(|_| "python3".into()));
        c.args(["-m", "zipfile", "-e"]).arg(&wheel).arg(&dir);
        crate::run(c).context("unpacking the MLX wheel")?;
    }
    println!("{WHEEL_PIN} (sha256 {WHEEL_SHA256}) unpacked in {}", dir.display());
    Ok(dir.join("mlx"))
}

/// Copies libmlx (and the libraries it loads from beside its package) next to an installed plugin:
/// `<plugins>/mlx/lib/libmlx.*`, which the plugin's run path names, and `<plugins>/<wheel>.libs/`,
/// which libmlx's own run path (`$ORIGIN/../../<wheel>.libs`) names.
pub fn install_runtime(mlx: &MlxInstall, plugins: &Path) -> Result<()> {
    let lib = plugins.join("mlx").join("lib");
    std::fs::create_dir_all(&lib)?;
    for entry in std::fs::read_dir(mlx.dir.join("lib"))? {
        let p = entry?.path();
        if p.is_file() {
            std::fs::copy(&p, lib.join(p.file_name().unwrap())).with_context(|| format!("copying {}", p.display()))?;
        }
    }
    if let Some(site) = mlx.dir.parent() {
        for entry in std::fs::read_dir(site)? {
            let p = entry?.path();
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            if p.is_dir() && name.starts_with("mlx") && name.ends_with(".libs") {
                let dst = plugins.join(&name);
                std::fs::create_dir_all(&dst)?;
                for f in std::fs::read_dir(&p)? {
                    let f = f?.path();
                    std::fs::copy(&f, dst.join(f.file_name().unwrap()))?;
                }
            }
        }
    }
    Ok(())
}
