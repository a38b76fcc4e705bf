//! The stable boundary between the mlxcel host and its plugins.
//!
//! Everything here is `#[repr(C)]` and crosses a shared-object boundary, so plugins built by another
//! compiler version (or in another language) keep working. The rules (see `docs/abi.md`):
//!
//! * A plugin exports one symbol, [`ROOT_SYMBOL`], a function returning a [`PluginRoot`].
//!   The first two fields of the root (`abi_major`, `abi_minor`) are frozen forever.
//! * Same [`ABI_MAJOR`] is required. A newer minor only appends fields at the end of a struct or vtable.
//!   Every struct that crosses starts with its own `size` ([`Versioned`]): a reader takes the prefix it
//!   knows and sees zeros past it, a writer fills no more than the reader's `size`. Arrays carry their
//!   element size (the first element's `size`, or [`GraphRef::node_size`]). A vtable from an older minor
//!   is shorter: the host treats its missing entries as unsupported.
//! * Every exported function catches panics ([`guard`]) and reports failures as a [`Status`] code plus a
//!   message written into a caller-owned [`ErrorBuf`]. Each side frees what it allocated.
//! * Plugins are never unloaded.
//!
//! Families never see devices, backends never see model configs: they meet only in the op graph of
//! [`graph`].

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod backend;
pub mod export;
pub mod family;
pub mod ffi;
pub mod graph;
pub mod op_spec;

#[cfg(test)]
mod tests;

pub use backend::*;
pub use export::*;
pub use family::*;
pub use ffi::*;
pub use graph::*;

/// Major version of the plugin ABI. A plugin with another major is refused.
pub const ABI_MAJOR: u32 = 2;
/// Minor version of the plugin ABI: fields appended since the last major. 2.1 added
/// [`BackendVTable::kv_alloc`] and [`BackendVTable::copy_blocks`]; 2.2 the feature rows of a step
/// ([`INPUT_FEATURES`], [`StepDesc::seq_n_features`]) and PyTorch-layout convolution weights
/// ([`CONV_WEIGHT_TORCH`]); 2.3 a V-cache dtype of its own ([`KvBinding::v_dtype`]); 2.4 asynchronous
/// execution ([`BackendVTable::submit`], [`BackendVTable::wait`]).
pub const ABI_MINOR: u32 = 4;

/// The symbol every plugin exports: `extern "C" fn() -> *const PluginRoot`.
pub const ROOT_SYMBOL: &[u8] = b"mlxcel_plugin_root\0";

/// The function type behind [`ROOT_SYMBOL`].
pub type RootFn = unsafe extern "C" fn() -> *const PluginRoot;

/// What a plugin provides.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PluginKind {
    /// Executes graphs on a device ([`BackendVTable`]).
    Backend = 1,
    /// Knows model architectures and builds graphs ([`FamilyVTable`]).
    Family = 2,
}

/// The root module of a plugin. Lives in the plugin's static memory for the life of the process.
#[repr(C)]
pub struct PluginRoot {
    /// Frozen: ABI major the plugin was built against.
    pub abi_major: u32,
    /// Frozen: ABI minor the plugin was built against.
    pub abi_minor: u32,
    /// `PluginKind` as a raw number, so that an unknown kind from a newer host is not undefined behaviour.
    pub kind: u32,
    /// Short unique name, e.g. `cpu`, `llama`.
    pub name: StrRef,
    /// The plugin's own version (semver text).
    pub version: StrRef,
    /// One line saying what it is.
    pub description: StrRef,
    /// Called once after loading, before anything else; a failure keeps the plugin out of the catalog.
    pub init: unsafe extern "C" fn(err: *mut ErrorBuf) -> Status,
    /// Non-null when `kind == Backend`.
    pub backend: *const BackendVTable,
    /// Non-null when `kind == Family`.
    pub family: *const FamilyVTable,
}

// SAFETY: the root only holds pointers to immutable statics.
unsafe impl Sync for PluginRoot {}
// SAFETY: as above.
unsafe impl Send for PluginRoot {}

/// Declares the exported root function of a plugin.
///
/// ```ignore
/// mlxcel_plugin_api::export_plugin!(ROOT);
/// static ROOT: PluginRoot = PluginRoot { .. };
/// ```
#[macro_export]
macro_rules! export_plugin {
    ($root:expr) => {
        #[no_mangle]
        pub unsafe extern "C" fn mlxcel_plugin_root() -> *const $crate::PluginRoot {
            &$root as *const $crate::PluginRoot
        }
    };
}
