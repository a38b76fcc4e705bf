//! Host side of the plugin boundary: finds plugin files, loads and checks them, and wraps their C
//! vtables in safe Rust types. Nothing here knows a model architecture or a device.

#![deny(unsafe_op_in_unsafe_fn)]
#![warn(clippy::undocumented_unsafe_blocks)]

mod backend;
mod catalog;
mod discovery;
mod family;
mod loader;

pub use backend::{BackendContext, BackendPlugin, DeviceBuffer};
pub use catalog::{Catalog, SelectError};
pub use discovery::{default_plugin_dirs, find_plugin_files, PluginSearch};
pub use family::{FamilyModel, FamilyPlugin, ModelInfo};
pub use loader::{load_plugin, LoadProblem, PluginMeta};

use mlxcel_plugin_api::{ErrorMessage, Status};

/// An error reported by a plugin call, with the plugin's name for context.
#[derive(Debug, thiserror::Error)]
#[error("{plugin}: {message}")]
pub struct CallError {
    pub plugin: String,
    pub status: i32,
    pub message: String,
}

pub(crate) fn check(plugin: &str, status: Status, err: &ErrorMessage) -> Result<(), CallError> {
    if status.is_ok() {
        Ok(())
    } else {
        let mut message = err.text();
        if message.is_empty() {
            message = format!("call failed with status {}", status.0);
        }
        Err(CallError { plugin: plugin.to_string(), status: status.0, message })
    }
}
