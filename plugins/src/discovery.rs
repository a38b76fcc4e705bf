//! Where plugins are looked for: explicit folders first, then `MLXCEL_PLUGIN_PATH`, then the default
//! folders beside the executable and under the user's data dir.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

/// The folders to search, in order.
#[derive(Debug, Clone, Default)]
pub struct PluginSearch {
    pub dirs: Vec<PathBuf>,
}

impl PluginSearch {
    /// `explicit` (from `--plugin-dir`) first, then `MLXCEL_PLUGIN_PATH`, then the defaults.
    pub fn from_env(explicit: &[PathBuf]) -> Self {
        let mut dirs: Vec<PathBuf> = explicit.to_vec();
        if let Some(p) = std::env::var_os("MLXCEL_PLUGIN_PATH") {
            dirs.extend(std::env::split_paths(&p).filter(|p| !p.as_os_str().is_empty()));
        }
        dirs.extend(default_plugin_dirs());
        PluginSearch { dirs }
    }
}

/// `<exe dir>/../lib/mlxcel/plugins` and `<data dir>/mlxcel/plugins`.
pub fn default_plugin_dirs() -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        if let Some(dir) = exe.parent() {
            out.push(dir.join("..").join("lib").join("mlxcel").join("plugins"));
        }
    }
    let data = std::env::var_os("XDG_DATA_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local").join("share")));
    if let Some(d) = data {
        out.push(d.join("mlxcel").join("plugins"));
    }
    out
}

fn is_shared_object(path: &Path) -> bool {
    matches!(path.extension().and_then(|e| e.to_str()), Some("so" | "dylib" | "dll"))
}

/// Plugin files in the search folders, each once (by canonical path), in search order; files within a
/// folder sorted by name so the order is stable.
pub fn find_plugin_files(search: &PluginSearch) -> Vec<PathBuf> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for dir in &search.dirs {
        let Ok(entries) = std::fs::read_dir(dir) else { continue };
        let mut files: Vec<PathBuf> =
            entries.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.is_file() && is_shared_object(p)).collect();
        files.sort();
        for f in files {
            let key = f.canonicalize().unwrap_or_else(|_| f.clone());
            if seen.insert(key) {
                out.push(f);
            }
        }
    }
    out
}
