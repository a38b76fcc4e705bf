//! Finds MLX and compiles the C++ shim against it.
//!
//! Where MLX comes from, first match wins:
//! 1. `MLX_DIR`: a folder holding `include/mlx/mlx.h` and `lib/libmlx.{so,dylib}` (a wheel's `mlx`
//!    package folder, or a system install prefix);
//! 2. an installed Python package `mlx` (from the `mlx-cpu`, `mlx-metal` or `mlx-cuda` wheels), found
//!    with `python3` (or `PYTHON`); not for a cross build, which that package's library cannot serve.
//!
//! Without MLX the crate still builds: the `mlx_found` cfg stays off and the plugin describes itself
//! with score 0 and the reason "libmlx not found at build time", so the workspace builds and tests
//! everywhere. With MLX the plugin links `libmlx` and records its folder as a run-time search path
//! (plus `$ORIGIN/mlx/lib`, where `cargo xtask install` copies the library).

use std::path::{Path, PathBuf};
use std::process::Command;

fn lib_file(dir: &Path) -> Option<PathBuf> {
    ["libmlx.so", "libmlx.dylib"].iter().map(|f| dir.join("lib").join(f)).find(|p| p.is_file())
}

fn usable(dir: &Path) -> bool {
    dir.join("include/mlx/mlx.h").is_file() && lib_file(dir).is_some()
}

fn from_python() -> Option<PathBuf> {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let out = Command::new(python)
        .args(["-c", "import mlx; print(list(mlx.__path__)[0])"])
        .output()
        .ok()
        .filter(|o| o.status.success())?;
    let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    usable(&dir).then_some(dir)
}

fn find_mlx() -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os("MLX_DIR").map(PathBuf::from) {
        return if usable(&dir) {
            Ok(dir)
        } else {
            Err(format!("MLX_DIR={} has no include/mlx/mlx.h and lib/libmlx", dir.display()))
        };
    }
    // The Python package holds an MLX for the machine that builds, which a cross build cannot link.
    let (target, host) = (std::env::var("TARGET").unwrap_or_default(), std::env::var("HOST").unwrap_or_default());
    if target != host {
        return Err(format!("a cross build for {target} and no MLX_DIR (an MLX built for {target})"));
    }
    from_python().ok_or_else(|| "no MLX_DIR and no `mlx` Python package with include/ and lib/libmlx".into())
}

fn main() {
    println!("cargo:rustc-check-cfg=cfg(mlx_found)");
    println!("cargo:rerun-if-env-changed=MLX_DIR");
    println!("cargo:rerun-if-env-changed=PYTHON");
    println!("cargo:rerun-if-changed=shim/mlx_shim.cpp");
    println!("cargo:rerun-if-changed=shim/mlx_shim.h");
    let dir = match find_mlx() {
        Ok(dir) => dir,
        Err(why) => {
            println!("cargo:warning=MLX backend built without MLX ({why}); it will report score 0");
            println!("cargo:rustc-env=MLXCEL_MLX_ABSENT_REASON={why}");
            return;
        }
    };
    let lib_dir = dir.join("lib");
    println!("cargo:rerun-if-changed={}", lib_file(&dir).unwrap().display());
    cc::Build::new()
        .cpp(true)
        .std("c++20")
        .file("shim/mlx_shim.cpp")
        .include(dir.join("include"))
        .flag_if_supported("-Wno-unused-parameter")
        .opt_level(2)
        .compile("mlxcel_mlx_shim");
    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    let origin = if cfg!(target_os = "macos") { "@loader_path" } else { "$ORIGIN" };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{origin}/mlx/lib");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());
    println!("cargo:rustc-cfg=mlx_found");
    println!("cargo:rustc-env=MLXCEL_MLX_DIR={}", dir.display());
}
