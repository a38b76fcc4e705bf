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
/// so `'static` references into it stay valid. The tables are the host's own full-size copies of the
/// plugin's: entries an older minor lacks are `None`.
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
    // SAFETY: the symbol is the plugin root function, with the documented signature.
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
    // SAFETY: the root's name (a frozen leading field) is a static string of the plugin.
    let name = unsafe { root.name.as_str() }.to_string();
    if root.abi_major != ABI_MAJOR {
        let advice = if root.abi_major < ABI_MAJOR {
            "it is older than this mlxcel: rebuild the plugin against this mlxcel's plugin-api"
        } else {
            "it is newer than this mlxcel: upgrade mlxcel or install a plugin built for this one"
        };
        return Err(problem(format!(
            "plugin `{name}` was built for plugin ABI {}.{}, this mlxcel speaks ABI {}.{} (same major \
             required); {advice}",
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
        // SAFETY: static strings of a root of this major.
        version: unsafe { root.version.as_str() }.to_string(),
        // SAFETY: as above.
        description: unsafe { root.description.as_str() }.to_string(),
        kind,
        abi_major: root.abi_major,
        abi_minor: root.abi_minor,
        path: path.to_path_buf(),
    };

    let mut err = ErrorMessage::new();
    // SAFETY: `init` is called once, with a valid error buffer, before anything else.
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
            // SAFETY: a non-null table pointer of a checked root; `size` comes first.
            let vt = unsafe { root.backend.as_ref() }
                .ok_or_else(|| problem(format!("backend plugin `{name}` has no backend table")))?;
            check_table_size(&name, "backend", vt.size, BackendVTable::MIN_SIZE).map_err(problem)?;
            // SAFETY: the plugin's table has `vt.size >= MIN_SIZE` readable bytes, so every 2.0 entry
            // is filled; later entries are `Option`s, zero (absent) past the plugin's size.
            let table: BackendVTable = unsafe { copy_table(vt, vt.size) };
            Ok(Loaded::Backend(meta, Box::leak(Box::new(table))))
        }
        PluginKind::Family => {
            // SAFETY: as above.
            let vt = unsafe { root.family.as_ref() }
                .ok_or_else(|| problem(format!("family plugin `{name}` has no family table")))?;
            check_table_size(&name, "family", vt.size, FamilyVTable::MIN_SIZE).map_err(problem)?;
            // SAFETY: as above.
            let table: FamilyVTable = unsafe { copy_table(vt, vt.size) };
            Ok(Loaded::Family(meta, Box::leak(Box::new(table))))
        }
    }
}

/// The host's own full-size copy of a plugin's table: its first `size` bytes, zeros after.
///
/// # Safety
/// `size` covers every non-`Option` entry of `T` (checked against `MIN_SIZE` by the caller), so the
/// zero-filled rest are `None`s; the plugin's table has `size` readable bytes.
unsafe fn copy_table<T>(table: &T, size: usize) -> T {
    let mut out = std::mem::MaybeUninit::<T>::zeroed();
    let n = size.min(std::mem::size_of::<T>());
    // SAFETY: `table` has `size >= n` readable bytes; `out` has `size_of::<T>() >= n` writable bytes.
    unsafe { std::ptr::copy_nonoverlapping(table as *const T as *const u8, out.as_mut_ptr() as *mut u8, n) };
    // SAFETY: every required entry was copied; the rest are zero, a valid `None` (caller's contract).
    unsafe { out.assume_init() }
}

fn check_table_size(name: &str, kind: &str, size: usize, min: usize) -> Result<(), String> {
    if size < min {
        return Err(format!(
            "{kind} plugin `{name}` has a truncated function table ({size} < {min} bytes, the size of ABI \
             {ABI_MAJOR}.0's)"
        ));
    }
    Ok(())
}
