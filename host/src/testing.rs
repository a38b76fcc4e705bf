//! Helpers shared by the integration tests of the host and the plugins (not used by the binaries).

use std::path::PathBuf;

use mlxcel_plugins::{Catalog, PluginSearch};

pub mod golden;

/// The workspace root.
pub fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// Where `cargo xtask build` stages the plugins (`target/lib/mlxcel/plugins`).
pub fn staged_plugin_dir() -> PathBuf {
    let target =
        std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| workspace_root().join("target"));
    let dir = target.join("lib").join("mlxcel").join("plugins");
    assert!(
        dir.join(format!("{}mlxcel_backend_cpu{}", std::env::consts::DLL_PREFIX, std::env::consts::DLL_SUFFIX))
            .is_file(),
        "plugins are not staged in {}: run `cargo xtask build` (or `cargo xtask test`) first",
        dir.display()
    );
    dir
}

/// A catalog of exactly the staged plugins (ignores MLXCEL_PLUGIN_PATH and user folders).
pub fn staged_catalog() -> Catalog {
    Catalog::load(&PluginSearch { dirs: vec![staged_plugin_dir()] })
}

/// The real test models folder, if `MLXCEL_TEST_MODELS` points at one (see ../shared/models/fetch.sh).
/// Without it, real-model tests skip with a message; with `MLXCEL_REQUIRE_TEST_MODELS=1` (CI) they fail.
pub fn test_models() -> Option<PathBuf> {
    match std::env::var_os("MLXCEL_TEST_MODELS").map(PathBuf::from) {
        Some(p) if p.is_dir() => Some(p),
        _ => {
            if std::env::var_os("MLXCEL_REQUIRE_TEST_MODELS").is_some() {
                panic!(
                    "MLXCEL_REQUIRE_TEST_MODELS is set but MLXCEL_TEST_MODELS does not name a folder of test models"
                );
            }
            eprintln!(
                "skipping: real-model test needs MLXCEL_TEST_MODELS (run ../shared/models/fetch.sh and export MLXCEL_TEST_MODELS=<the folder it prints>)"
            );
            None
        }
    }
}
