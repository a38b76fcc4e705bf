//! The MLX backend plugin: runs mlxcel op graphs with MLX's C++ library (`libmlx`), CPU on Linux and
//! Metal on Apple silicon (and CUDA where the `mlx-cuda` wheel serves).
//!
//! A small C++ shim (`shim/mlx_shim.cpp`, compiled by `build.rs` against the MLX the build found) turns
//! each op into lazy MLX array operations; [`executor`] walks a graph, builds one lazy MLX graph for the
//! whole step and evaluates it once, then copies the outputs to the host. Weights stay as the
//! checkpoint stores them (MLX affine-quantized packs go to `quantized_matmul` as they are); the KV
//! cache lives in MLX arrays.
//!
//! Built without MLX (no `MLX_DIR`, no `mlx` Python package), the plugin still loads and describes
//! itself with score 0 and the reason, so hosts list it as unusable instead of failing.

#[cfg(mlx_found)]
mod array;
#[cfg(mlx_found)]
pub mod executor;
#[cfg(mlx_found)]
mod ffi;

#[cfg(mlx_found)]
mod present;
#[cfg(mlx_found)]
pub use present::*;

#[cfg(not(mlx_found))]
mod absent;
#[cfg(not(mlx_found))]
pub use absent::*;

use mlxcel_plugin_api::export_backend;

/// The MLX backend plugin.
pub struct MlxBackend;

export_backend!(MlxBackend);
