//! The backend side of the ABI: devices, buffers, KV caches and graph execution.

use std::ffi::c_void;

use crate::ffi::{ErrorBuf, Status, StrRef, Versioned};
use crate::graph::{GraphRef, StepBatch};

/// An opaque device buffer, created and freed by the backend.
pub type BufferHandle = *mut c_void;

/// What kind of device.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu = 1,
    Gpu = 2,
}

/// One device a backend can run on (an array element: the stride is its `size`). Strings are static
/// in the plugin.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DeviceInfo {
    pub size: usize,
    pub name: StrRef,
    /// [`DeviceKind`] as a raw number.
    pub kind: u32,
    /// Memory the device can use, in bytes (0 = unknown).
    pub memory_bytes: u64,
    /// Memory free for new allocations right now, in bytes (0 = unknown): what the host's fit check
    /// counts against.
    pub free_memory_bytes: u64,
}

// SAFETY: repr(C), `size` first, plain data.
unsafe impl Versioned for DeviceInfo {}

/// A cheap description of a backend on this machine, available without creating it.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BackendInfo {
    /// Set by the caller to its `size_of::<BackendInfo>()`; see [`crate::write_versioned`].
    pub size: usize,
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

// SAFETY: repr(C), `size` first, plain data.
unsafe impl Versioned for BackendInfo {}

/// Options for [`BackendVTable::create`].
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BackendOptions {
    pub size: usize,
    /// Worker threads (0 = the backend decides).
    pub n_threads: u32,
    /// Device index from [`BackendInfo::devices`].
    pub device: u32,
}

// SAFETY: repr(C), `size` first, plain data.
unsafe impl Versioned for BackendOptions {}

/// A host memory region for compute inputs/outputs.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct HostTensor {
    pub ptr: *mut u8,
    pub len: usize,
}

/// The state buffers of one layer (an array element: the stride is its `size`).
///
/// Attention layers have `k` and `v`, each `num_blocks × block_size` slots of their group in the layout
/// the backend chose at [`BackendVTable::kv_alloc`] (or, from a backend without `kv_alloc`, f32
/// `[num_blocks, block_size, n_kv_heads, head_dim]`). Recurrent layers have `state`: one row of the
/// layer's `state_elems` f32 values per state slot, updated in place.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvBinding {
    pub size: usize,
    pub k: BufferHandle,
    pub v: BufferHandle,
    /// [`crate::DType`] of the K cache as a raw number (and of the V cache from a host before 2.3).
    pub dtype: u32,
    /// Which [`crate::KvGroupTables`] of the step's batch this layer's block tables are.
    pub group: u32,
    /// Recurrent state, or null.
    pub state: BufferHandle,
    // ---- ABI 2.3 ----
    /// [`crate::DType`] of the V cache as a raw number (llama.cpp's `--cache-type-v` may differ from
    /// `-k`). Read it through [`KvBinding::value_dtype`], which knows a 2.2 host never wrote it.
    pub v_dtype: u32,
}

impl KvBinding {
    /// The K cache's dtype.
    pub fn key_dtype(&self) -> crate::DType {
        crate::DType::from_raw(self.dtype)
    }

    /// The V cache's dtype: `v_dtype` when the host's struct has it (2.3+), else the K cache's.
    pub fn value_dtype(&self) -> crate::DType {
        let has_v_dtype = self.size >= std::mem::offset_of!(KvBinding, v_dtype) + std::mem::size_of::<u32>();
        crate::DType::from_raw(if has_v_dtype { self.v_dtype } else { self.dtype })
    }
}

// SAFETY: repr(C), `size` first, plain data.
unsafe impl Versioned for KvBinding {}

/// Everything one `compute` call needs.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ComputeArgs {
    pub size: usize,
    pub graph: GraphRef,
    /// Host data for `Input` nodes, indexed by slot.
    pub inputs: *const HostTensor,
    pub n_inputs: usize,
    /// Device buffers for `Weight` nodes, indexed by weight index (null for unused entries).
    pub weights: *const BufferHandle,
    pub n_weights: usize,
    /// State buffers, indexed by the layer parameter of `Attention` (and other stateful) nodes.
    pub kv: *const KvBinding,
    pub n_kv: usize,
    /// Null when the graph has no node that reads the step's batch.
    pub batch: *const StepBatch,
    /// Host destinations for the graph outputs (as `F32`), in `graph.outputs` order.
    pub outputs: *const HostTensor,
    pub n_outputs: usize,
}

// SAFETY: repr(C), `size` first, plain data.
unsafe impl Versioned for ComputeArgs {}

/// One layer's K or V cache as the host asks for it (ABI 2.1, [`BackendVTable::kv_alloc`]).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct KvCacheDesc {
    pub size: usize,
    pub num_blocks: u32,
    pub block_size: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    /// [`crate::DType`] the host would like (`F32`, `F16`, `BF16`); the backend may refuse one it lacks.
    pub dtype: u32,
}

// SAFETY: repr(C), `size` first, plain data.
unsafe impl Versioned for KvCacheDesc {}

/// Copy block `src` to block `dst` (same cache, all slots of the block).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockCopy {
    pub src: u32,
    pub dst: u32,
}

/// The function table a backend plugin exports.
///
/// Buffers from `buffer_from_host` may alias host memory (zero-copy on CPU); the host keeps that memory
/// alive and unchanged until `buffer_free`. A context and its buffers are used by one thread at a time.
/// Entries after the 2.0 ones are `Option`s: absent when `size` ends before them (an older minor) or
/// when null.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct BackendVTable {
    /// `size_of::<BackendVTable>()` in the plugin; fields beyond it are absent.
    pub size: usize,
    /// Writes a [`BackendInfo`] (the caller sets its `size` first).
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
    /// 1 if the backend can execute this node (op, dtypes, parameters), else 0. `node_size` is the
    /// caller's `size_of::<Node>()`.
    pub supports_op: unsafe extern "C" fn(ctx: *mut c_void, node: *const crate::Node, node_size: usize) -> u32,
    pub compute: unsafe extern "C" fn(ctx: *mut c_void, args: *const ComputeArgs, err: *mut ErrorBuf) -> Status,

    // ---- ABI 2.1 ----
    /// Allocates one layer's K or V cache in a layout private to the backend and reports its bytes.
    /// Absent: the host allocates f32 `[num_blocks, block_size, n_kv_heads, head_dim]` with
    /// `buffer_alloc`.
    pub kv_alloc: Option<
        unsafe extern "C" fn(
            ctx: *mut c_void,
            desc: *const KvCacheDesc,
            out: *mut BufferHandle,
            out_bytes: *mut u64,
            err: *mut ErrorBuf,
        ) -> Status,
    >,
    /// Copies whole blocks inside one cache buffer made by `kv_alloc` (copy-on-write for shared
    /// prefixes). Absent: the host cannot copy blocks on this backend.
    pub copy_blocks: Option<
        unsafe extern "C" fn(
            ctx: *mut c_void,
            buf: BufferHandle,
            desc: *const KvCacheDesc,
            copies: *const BlockCopy,
            n_copies: usize,
            err: *mut ErrorBuf,
        ) -> Status,
    >,

    // ---- ABI 2.4 ----
    /// Starts a graph and returns without waiting for it (an asynchronous device queues it). Every
    /// pointer in `args` stays valid, and the host neither reads the outputs nor touches the context,
    /// until `wait` returns; `args` itself is read before `submit` returns. One graph is in flight per
    /// context. Absent: the host calls `compute`, and `wait` is a no-op (a synchronous device).
    pub submit: Option<unsafe extern "C" fn(ctx: *mut c_void, args: *const ComputeArgs, err: *mut ErrorBuf) -> Status>,
    /// Blocks until the graph `submit` started has finished: its outputs are written when it returns
    /// `OK` (an error of the computation is reported here). With nothing in flight it returns `OK`.
    pub wait: Option<unsafe extern "C" fn(ctx: *mut c_void, err: *mut ErrorBuf) -> Status>,
}

impl BackendVTable {
    /// The size of the table of ABI 2.0, the smallest a major-2 host accepts.
    pub const MIN_SIZE: usize = std::mem::offset_of!(BackendVTable, kv_alloc);
}
