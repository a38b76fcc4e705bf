//! The plugin as built where MLX was not found: it loads, says why it cannot run, and refuses to start.

use mlxcel_plugin_api::*;

use crate::MlxBackend;

/// Why the build had no MLX (set by build.rs).
const ABSENT: &str = env!("MLXCEL_MLX_ABSENT_REASON");

fn reason() -> String {
    format!(
        "libmlx not found at build time ({ABSENT}); rebuild with MLX_DIR set or the mlx-cpu/mlx-metal wheel \
         installed: `cargo xtask build --backend mlx`"
    )
}

/// A context that never exists: `create` always fails.
pub struct AbsentContext;

impl Backend for MlxBackend {
    const NAME: &'static str = "mlx";
    const DESCRIPTION: &'static str = "MLX (built without libmlx: unusable)";
    type Context = AbsentContext;

    fn describe() -> BackendDescription {
        BackendDescription { score: 0, features: "none".into(), reason: reason(), devices: vec![] }
    }

    fn create(_n_threads: u32, _device: u32) -> Result<AbsentContext, PluginError> {
        Err(PluginError::failed(reason()))
    }
}

fn absent<T>() -> Result<T, PluginError> {
    Err(PluginError::failed(reason()))
}

impl BackendContext for AbsentContext {
    type Buffer = ();

    unsafe fn buffer_from_host(&mut self, _ptr: *const u8, _len: usize) -> Result<(), PluginError> {
        absent()
    }
    fn buffer_alloc(&mut self, _len: usize) -> Result<(), PluginError> {
        absent()
    }
    fn buffer_write(&mut self, _buf: &mut (), _offset: usize, _src: &[u8]) -> Result<(), PluginError> {
        absent()
    }
    fn buffer_read(&mut self, _buf: &(), _offset: usize, _dst: &mut [u8]) -> Result<(), PluginError> {
        absent()
    }
    fn supports(&self, _node: &Node) -> bool {
        false
    }
    unsafe fn compute(&mut self, _args: &ComputeArgs) -> Result<(), PluginError> {
        absent()
    }
    fn kv_alloc(&mut self, _desc: &KvCacheDesc) -> Result<((), u64), PluginError> {
        absent()
    }
    fn copy_blocks(&mut self, _buf: &mut (), _desc: &KvCacheDesc, _copies: &[BlockCopy]) -> Result<(), PluginError> {
        absent()
    }
}
