//! The catalog: every plugin that loaded, every file that was refused, and the choice of backend and
//! family for a model. Architectures come only from the plugins themselves.

use std::path::PathBuf;

use crate::backend::BackendPlugin;
use crate::discovery::{find_plugin_files, PluginSearch};
use crate::family::FamilyPlugin;
use crate::loader::{load_plugin, LoadProblem, Loaded};

/// Loaded plugins and refused files.
#[derive(Default, Clone)]
pub struct Catalog {
    pub backends: Vec<BackendPlugin>,
    pub families: Vec<FamilyPlugin>,
    pub problems: Vec<LoadProblem>,
    pub searched: Vec<PathBuf>,
}

/// Why no plugin could be chosen.
#[derive(Debug, thiserror::Error)]
pub enum SelectError {
    #[error(
        "no backend plugin is installed (searched: {searched}); install mlxcel with its plugins or pass --plugin-dir"
    )]
    NoBackends { searched: String },
    #[error("backend `{wanted}` is not installed; installed backends: {available}")]
    UnknownBackend { wanted: String, available: String },
    #[error("backend `{name}` cannot run on this machine: {reason}")]
    BackendUnusable { name: String, reason: String },
    #[error("no installed backend can run on this machine ({details})")]
    NoUsableBackend { details: String },
    #[error(
        "unsupported model_type `{model_type}`: no installed family plugin handles it; installed architectures: \
         {available}. A family plugin for `{model_type}` would be needed"
    )]
    UnknownArchitecture { model_type: String, available: String },
}

impl Catalog {
    /// Finds and loads every plugin in the search folders. Never fails: refused files land in `problems`.
    pub fn load(search: &PluginSearch) -> Catalog {
        let mut cat = Catalog { searched: search.dirs.clone(), ..Default::default() };
        for path in find_plugin_files(search) {
            match load_plugin(&path) {
                Ok(Loaded::Backend(meta, vt)) => {
                    if cat.backends.iter().any(|b| b.meta.name == meta.name) {
                        tracing::debug!("skipping {}: backend `{}` already loaded", path.display(), meta.name);
                        continue;
                    }
                    cat.backends.push(BackendPlugin::new(meta, vt));
                }
                Ok(Loaded::Family(meta, vt)) => {
                    if cat.families.iter().any(|f| f.meta.name == meta.name) {
                        tracing::debug!("skipping {}: family `{}` already loaded", path.display(), meta.name);
                        continue;
                    }
                    cat.families.push(FamilyPlugin::new(meta, vt));
                }
                Err(problem) => {
                    tracing::warn!("plugin refused: {problem}");
                    cat.problems.push(problem);
                }
            }
        }
        cat
    }

    /// All architectures the installed families provide, sorted.
    pub fn architectures(&self) -> Vec<String> {
        let mut all: Vec<String> = self.families.iter().flat_map(|f| f.architectures()).collect();
        all.sort();
        all.dedup();
        all
    }

    /// The backend named `wanted`, or the best-scoring one on this machine.
    pub fn select_backend(&self, wanted: Option<&str>) -> Result<&BackendPlugin, SelectError> {
        if self.backends.is_empty() {
            let searched = self.searched.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ");
            return Err(SelectError::NoBackends { searched });
        }
        if let Some(name) = wanted {
            let b = self.backends.iter().find(|b| b.name() == name).ok_or_else(|| SelectError::UnknownBackend {
                wanted: name.to_string(),
                available: self.backends.iter().map(|b| b.name().to_string()).collect::<Vec<_>>().join(", "),
            })?;
            let d = b.describe();
            if d.score == 0 {
                return Err(SelectError::BackendUnusable { name: name.to_string(), reason: d.reason });
            }
            return Ok(b);
        }
        let scored: Vec<(u32, &BackendPlugin, String)> = self
            .backends
            .iter()
            .map(|b| {
                let d = b.describe();
                (d.score, b, d.reason)
            })
            .collect();
        scored.iter().filter(|(s, _, _)| *s > 0).max_by_key(|(s, _, _)| *s).map(|(_, b, _)| *b).ok_or_else(|| {
            SelectError::NoUsableBackend {
                details: scored.iter().map(|(_, b, r)| format!("{}: {}", b.name(), r)).collect::<Vec<_>>().join("; "),
            }
        })
    }

    /// The family that matches a config best.
    pub fn select_family(&self, config_json: &str, model_type: &str) -> Result<&FamilyPlugin, SelectError> {
        self.families
            .iter()
            .map(|f| (f.match_config(config_json), f))
            .filter(|(s, _)| *s > 0)
            .max_by_key(|(s, _)| *s)
            .map(|(_, f)| f)
            .ok_or_else(|| SelectError::UnknownArchitecture {
                model_type: model_type.to_string(),
                available: {
                    let a = self.architectures();
                    if a.is_empty() {
                        "none (no family plugin loaded)".to_string()
                    } else {
                        a.join(", ")
                    }
                },
            })
    }
}
