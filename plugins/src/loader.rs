//! Opens one plugin file and checks it before anything else runs: the root symbol, the ABI version, the
//! kind and vtable sizes, then `init`. Every refusal names the file and the reason.

use std::path::{Path, PathBuf};

use mlxcel_plugin_api::{
    BackendVTable, ErrorMessage, FamilyVTable, PluginKind, PluginRoot, RootFn, ABI_MAJOR, ABI_MINOR, ROOT_SYMBOL,
};

/// What the host knows of a loaded plugin.
#[derive(Debug, Clone)]
pub struct PluginMeta {
    pub name: String,
    pub version: String,
    pub description: String,
    pub kind: PluginKind,
    pub abi_major: u32,
    pub abi_minor: u32,
    pub path: PathBuf,
}

/// A plugin file that was refused, and why.
#[derive(Debug, Clone)]
pub struct LoadProblem {
    pub path: PathBuf,
    pub reason: String,
}

impl std::fmt::Display for LoadProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.reason)
    }
}

/// A plugin that passed every check. Its library is leaked on purpose: plugins are never unloaded,
/// so `'static` references into it stay valid.
pub enum Loaded {
    Backend(PluginMeta, &'static BackendVTable),
    Family(PluginMeta, &'static FamilyVTable),
}

/// Loads and checks one file.
pub fn load_plugin(path: &Path) -> Result<Loaded, LoadProblem> {
    let problem = |reason: String| LoadProblem { path: path.to_path_buf(), reason };

    // SAFETY: loading a shared object runs its initialisers; that is the point of a plugin folder.
    let lib = unsafe { libloading::Library::new(path) }
        .map_err(|e| problem(format!("not a loadable shared object ({e})")))?;
    let root_fn: RootFn = unsafe {
        match lib.get::<RootFn>(ROOT_SYMBOL) {
            Ok(sym) => *sym,
            Err(_) => return Err(problem("not an mlxcel plugin (no `mlxcel_plugin_root` symbol)".to_string())),
        }
    };
    let lib: &'static libloading::Library = Box::leak(Box::new(lib));
    let _ = lib;

    // SAFETY: the symbol has the documented signature; its first two fields are frozen forever.
    let root: &'static PluginRoot = match unsafe { root_fn().as_ref() } {
        Some(r) => r,
        None => return Err(problem("plugin root is null".to_string())),
    };
    let name = unsafe { root.name.as_str() }.to_string();
    if root.abi_major != ABI_MAJOR {
        return Err(problem(format!(
            "plugin `{name}` was built for plugin ABI {}.{}, this mlxcel speaks ABI {}.{} (same major \
             required); rebuild the plugin against this mlxcel or install a matching mlxcel",
            root.abi_major, root.abi_minor, ABI_MAJOR, ABI_MINOR
        )));
    }
    let kind = match root.kind {
        1 => PluginKind::Backend,
        2 => PluginKind::Family,
        other => return Err(problem(format!("plugin `{name}` has unknown kind {other}"))),
    };
    let meta = PluginMeta {
        name: name.clone(),
        version: unsafe { root.version.as_str() }.to_string(),
        description: unsafe { root.description.as_str() }.to_string(),
        kind,
        abi_major: root.abi_major,
        abi_minor: root.abi_minor,
        path: path.to_path_buf(),
    };

    let mut err = ErrorMessage::new();
    let status = unsafe { (root.init)(err.as_ptr()) };
    if !status.is_ok() {
        let msg = err.text();
        return Err(problem(format!(
            "plugin `{name}` failed to initialise: {}",
            if msg.is_empty() { format!("status {}", status.0) } else { msg }
        )));
    }

    match kind {
        PluginKind::Backend => {
            let vt = unsafe { root.backend.as_ref() }
                .ok_or_else(|| problem(format!("backend plugin `{name}` has no backend table")))?;
            if vt.size < std::mem::size_of::<BackendVTable>() {
                return Err(problem(format!(
                    "backend plugin `{name}` has a truncated function table ({} < {} bytes)",
                    vt.size,
                    std::mem::size_of::<BackendVTable>()
                )));
            }
            Ok(Loaded::Backend(meta, vt))
        }
        PluginKind::Family => {
            let vt = unsafe { root.family.as_ref() }
                .ok_or_else(|| problem(format!("family plugin `{name}` has no family table")))?;
            if vt.size < std::mem::size_of::<FamilyVTable>() {
                return Err(problem(format!(
                    "family plugin `{name}` has a truncated function table ({} < {} bytes)",
                    vt.size,
                    std::mem::size_of::<FamilyVTable>()
                )));
            }
            Ok(Loaded::Family(meta, vt))
        }
    }
}
