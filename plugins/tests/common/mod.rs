//! Where the integration tests find built plugins.
#![allow(dead_code)]

use std::path::PathBuf;

pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().join("target"))
}

pub fn lib(stem: &str) -> String {
    format!("{}{stem}{}", std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX)
}

/// `target/lib/mlxcel/plugins`, filled by `cargo xtask build`.
pub fn staged_dir() -> PathBuf {
    let d = target_dir().join("lib/mlxcel/plugins");
    assert!(
        d.join(lib("mlxcel_backend_cpu")).is_file(),
        "plugins not staged in {}: run `cargo xtask build` first",
        d.display()
    );
    d
}

/// A built library from `target/release` (test plugins are built there but never staged).
pub fn built(stem: &str) -> PathBuf {
    let p = target_dir().join("release").join(lib(stem));
    assert!(p.is_file(), "{} not built: run `cargo xtask build` first", p.display());
    p
}
