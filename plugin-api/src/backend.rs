//! The backend side of the ABI: devices, buffers and graph execution.

use std::ffi::c_void;

use crate::ffi::{ErrorBuf, Status, StrRef};
use crate::graph::{AttentionBatch, GraphRef};

/// An opaque device buffer, created and freed by the backend.
pub type BufferHandle = *mut c_void;

/// What kind of device.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu = 1,
    Gpu = 2,
}

/// One device a backend can run on. Strings are static in the plugin.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DeviceInfo {
    pub name: StrRef,
    /// [`DeviceKind`] as a raw number.
    pub kind: u32,
    /// Memory the device can use, in bytes (0 = unknown).
    pub memory_bytes: u64,
}

/// A cheap description of a backend on this machine, available without creating it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BackendInfo {
    /// How well the backend suits this machine; 0 = unusable here (no GPU, no driver, CPU too old).
    /// The host picks the highest score unless told otherwise.
    pub score: u32,
    /// SIMD / feature level in use, e.g. `avx512`, `avx2`, `neon`, `scalar`; or the driver version.
    pub features: StrRef,
    /// Why the score is what it is, in words (e.g. "no CUDA driver found").
    pub reason: StrRef,
    /// Devices, in plugin-static memory.
    pub devices: *const DeviceInfo,
    pub n_devices: usize,
}

/// Options for [`BackendVTable::create`].
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BackendOptions {
    /// Worker threads (0 = the backend decides).
    pub n_threads: u32,
    /// Device index from [`BackendInfo::devices`].
    pub device: u32,
}

/// A host memory region for compute inputs/outputs.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct HostTensor {
    pub ptr: *mut u8,
    pub len: usize,
}

/// The K and V cache buffers of one attention layer, each `[num_blocks, block_size, n_kv, head_dim]`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvBinding {
    pub k: BufferHandle,
    pub v: BufferHandle,
    /// [`crate::DType`] of the cache as a raw number (`F32` or `F16`).
    pub dtype: u32,
}

/// Everything one `compute` call needs.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ComputeArgs {
    pub graph: GraphRef,
    /// Host data for `Input` nodes, indexed by slot.
    pub inputs: *const HostTensor,
    pub n_inputs: usize,
    /// Device buffers for `Weight` nodes, indexed by weight index (null for unused entries).
    pub weights: *const BufferHandle,
    pub n_weights: usize,
    /// KV cache buffers, indexed by the `Attention` node's layer.
    pub kv: *const KvBinding,
    pub n_kv: usize,
    /// Null when the graph has no `Attention` node.
    pub batch: *const AttentionBatch,
    /// Host destinations for the graph outputs (as `F32`), in `graph.outputs` order.
    pub outputs: *const HostTensor,
    pub n_outputs: usize,
}

/// The function table a backend plugin exports.
///
/// Buffers from `buffer_from_host` may alias host memory (zero-copy on CPU); the host keeps that memory
/// alive and unchanged until `buffer_free`. A context is used by one thread at a time.
#[repr(C)]
pub struct BackendVTable {
    /// `size_of::<BackendVTable>()` in the plugin; fields beyond it are absent.
    pub size: usize,
    pub describe: unsafe extern "C" fn(out: *mut BackendInfo) -> Status,
    pub create: unsafe extern "C" fn(opts: *const BackendOptions, out: *mut *mut c_void, err: *mut ErrorBuf) -> Status,
    pub destroy: unsafe extern "C" fn(ctx: *mut c_void),
    pub buffer_from_host: unsafe extern "C" fn(
        ctx: *mut c_void,
        ptr: *const u8,
        len: usize,
        out: *mut BufferHandle,
        err: *mut ErrorBuf,
    ) -> Status,
    /// A zero-filled buffer.
    pub buffer_alloc:
        unsafe extern "C" fn(ctx: *mut c_void, len: usize, out: *mut BufferHandle, err: *mut ErrorBuf) -> Status,
    pub buffer_write: unsafe extern "C" fn(
        ctx: *mut c_void,
        buf: BufferHandle,
        offset: usize,
        src: *const u8,
        len: usize,
        err: *mut ErrorBuf,
    ) -> Status,
    pub buffer_read: unsafe extern "C" fn(
        ctx: *mut c_void,
        buf: BufferHandle,
        offset: usize,
        dst: *mut u8,
        len: usize,
        err: *mut ErrorBuf,
    ) -> Status,
    pub buffer_free: unsafe extern "C" fn(ctx: *mut c_void, buf: BufferHandle),
    /// 1 if the backend can execute this node (op, dtypes, parameters), else 0.
    pub supports_op: unsafe extern "C" fn(ctx: *mut c_void, node: *const crate::Node) -> u32,
    pub compute: unsafe extern "C" fn(ctx: *mut c_void, args: *const ComputeArgs, err: *mut ErrorBuf) -> Status,
}
