//! Safe wrappers over a backend plugin's vtable.
//!
//! A plugin context is single-threaded by contract, so the wrappers say so: [`BackendContext`] is
//! `Send` but not `Sync` and every call takes `&mut self`; buffers hold the context through a mutex, so
//! a buffer dropped on another thread still frees under the same lock as every other call. A context
//! whose plugin panicked is poisoned: every later call fails, and the owner must build a new one.

use std::cell::Cell;
use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, MutexGuard};

use mlxcel_plugin_api::{
    read_versioned_array, BackendInfo, BackendOptions, BackendVTable, BlockCopy, BufferHandle, ComputeArgs, DeviceInfo,
    DeviceKind, ErrorMessage, KvCacheDesc, Node, Status, Versioned,
};

use crate::{check, CallError, PluginMeta};

/// A loaded backend plugin (not yet initialised for a device).
#[derive(Clone)]
pub struct BackendPlugin {
    pub meta: PluginMeta,
    vt: &'static BackendVTable,
}

/// A device as a backend describes it.
#[derive(Debug, Clone)]
pub struct Device {
    pub name: String,
    pub kind: &'static str,
    pub memory_bytes: u64,
    /// Free for new allocations when described (0 = unknown).
    pub free_memory_bytes: u64,
}

/// The cheap, no-init description of a backend on this machine.
#[derive(Debug, Clone)]
pub struct BackendDescription {
    pub score: u32,
    pub features: String,
    pub reason: String,
    pub devices: Vec<Device>,
}

impl std::fmt::Debug for BackendPlugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackendPlugin").field("name", &self.meta.name).field("path", &self.meta.path).finish()
    }
}

impl BackendPlugin {
    pub(crate) fn new(meta: PluginMeta, vt: &'static BackendVTable) -> Self {
        BackendPlugin { meta, vt }
    }

    pub fn name(&self) -> &str {
        &self.meta.name
    }

    /// Whether the plugin manages KV caches itself (ABI 2.1 `kv_alloc` / `copy_blocks`).
    pub fn owns_kv_layout(&self) -> bool {
        self.vt.kv_alloc.is_some()
    }

    /// Whether the plugin copies KV blocks inside its caches (ABI 2.1 `copy_blocks`).
    pub fn copies_kv_blocks(&self) -> bool {
        self.vt.copy_blocks.is_some()
    }

    /// Score, features and devices; a plugin that fails to describe itself scores 0.
    pub fn describe(&self) -> BackendDescription {
        let mut info = BackendInfo::zeroed();
        // SAFETY: `info` is a zeroed struct with its size set, as the ABI asks.
        let status = unsafe { (self.vt.describe)(&mut info) };
        if !status.is_ok() {
            return BackendDescription {
                score: 0,
                features: String::new(),
                reason: "describe failed".into(),
                devices: vec![],
            };
        }
        // SAFETY: the plugin's description lives in its static memory.
        let devices = unsafe { read_versioned_array::<DeviceInfo>(info.devices, info.n_devices) }
            .iter()
            .map(|d| Device {
                // SAFETY: static strings of the plugin.
                name: unsafe { d.name.as_str() }.to_string(),
                kind: if d.kind == DeviceKind::Gpu as u32 { "gpu" } else { "cpu" },
                memory_bytes: d.memory_bytes,
                free_memory_bytes: d.free_memory_bytes,
            })
            .collect();
        BackendDescription {
            score: info.score,
            // SAFETY: static strings of the plugin.
            features: unsafe { info.features.as_str() }.to_string(),
            // SAFETY: as above.
            reason: unsafe { info.reason.as_str() }.to_string(),
            devices,
        }
    }

    /// Creates a context on device `device` with `n_threads` workers (0 = backend default).
    pub fn create(&self, n_threads: u32, device: u32) -> Result<BackendContext, CallError> {
        let opts = BackendOptions { n_threads, device, ..BackendOptions::zeroed() };
        let mut ctx: *mut c_void = std::ptr::null_mut();
        let mut err = ErrorMessage::new();
        // SAFETY: valid options and output slot.
        let status = unsafe { (self.vt.create)(&opts, &mut ctx, err.as_ptr()) };
        check(&self.meta.name, status, &err)?;
        Ok(BackendContext {
            raw: Arc::new(Mutex::new(RawContext {
                name: self.meta.name.clone(),
                vt: self.vt,
                ctx,
                poisoned: false,
                in_flight: false,
            })),
            name: self.meta.name.clone(),
            owns_kv_layout: self.owns_kv_layout(),
            not_sync: PhantomData,
        })
    }
}

struct RawContext {
    name: String,
    vt: &'static BackendVTable,
    ctx: *mut c_void,
    /// Set when a call panicked inside the plugin: its state may be half-written.
    poisoned: bool,
    /// A graph was submitted and not yet waited for.
    in_flight: bool,
}

// SAFETY: the plugin context may move between threads; calls are serialised by the mutex around it.
unsafe impl Send for RawContext {}

impl RawContext {
    /// Runs a fallible call unless poisoned, after whatever graph is still in flight has finished (its
    /// error, if any, is this call's); a panic inside the plugin poisons the context.
    fn call(&mut self, f: impl FnOnce(&Self, *mut mlxcel_plugin_api::ErrorBuf) -> Status) -> Result<(), CallError> {
        self.wait()?;
        self.call_now(f)
    }

    fn call_now(&mut self, f: impl FnOnce(&Self, *mut mlxcel_plugin_api::ErrorBuf) -> Status) -> Result<(), CallError> {
        if self.poisoned {
            return Err(CallError {
                plugin: self.name.clone(),
                status: Status::PANIC.0,
                message: "this backend context is unusable after an earlier panic in the plugin; it must be rebuilt"
                    .into(),
            });
        }
        let mut err = ErrorMessage::new();
        let status = f(self, err.as_ptr());
        if status == Status::PANIC {
            self.poisoned = true;
        }
        check(&self.name, status, &err)
    }

    /// Waits for a submitted graph (ABI 2.4 `wait`); `Ok` at once with nothing in flight.
    fn wait(&mut self) -> Result<(), CallError> {
        if !std::mem::take(&mut self.in_flight) {
            return Ok(());
        }
        match self.vt.wait {
            // SAFETY: a live context with a graph in flight.
            Some(wait) => self.call_now(|r, err| unsafe { wait(r.ctx, err) }),
            None => Ok(()),
        }
    }

    /// [`RawContext::wait`] where there is no caller to hand the error to.
    fn settle(&mut self) {
        if let Err(e) = self.wait() {
            tracing::warn!("a graph in flight failed and nobody waited for it: {e}");
        }
    }
}

impl Drop for RawContext {
    fn drop(&mut self) {
        // A graph still in flight may write into memory its submitter is about to free: finish it first.
        self.settle();
        // SAFETY: the context came from `create`; no buffer outlives it (each holds the Arc).
        unsafe { (self.vt.destroy)(self.ctx) };
    }
}

fn lock(raw: &Mutex<RawContext>) -> MutexGuard<'_, RawContext> {
    // A panic while holding the lock happened on the host side, not in the plugin; the context itself
    // is as consistent as the plugin left it.
    raw.lock().unwrap_or_else(|e| e.into_inner())
}

/// A live backend context: one thread at a time (`Send`, not `Sync`), mutation through `&mut self`.
pub struct BackendContext {
    raw: Arc<Mutex<RawContext>>,
    name: String,
    owns_kv_layout: bool,
    not_sync: PhantomData<Cell<()>>,
}

/// A device buffer, freed on drop (under the context's lock, on whichever thread drops it).
pub struct DeviceBuffer {
    raw: Arc<Mutex<RawContext>>,
    handle: BufferHandle,
    len: usize,
}

// SAFETY: the handle is only used under the context's mutex (calls take the buffer through the context).
unsafe impl Send for DeviceBuffer {}

impl DeviceBuffer {
    /// The raw handle, for [`ComputeArgs`].
    pub fn handle(&self) -> BufferHandle {
        self.handle
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        let mut raw = lock(&self.raw);
        raw.settle();
        // SAFETY: a live handle of this context, freed once.
        unsafe { (raw.vt.buffer_free)(raw.ctx, self.handle) };
    }
}

impl BackendContext {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether the backend lays out KV caches itself (ABI 2.1); else the host allocates f32 caches.
    pub fn owns_kv_layout(&self) -> bool {
        self.owns_kv_layout
    }

    fn check_buffer(&self, buf: &DeviceBuffer) -> Result<(), CallError> {
        if Arc::ptr_eq(&self.raw, &buf.raw) {
            Ok(())
        } else {
            Err(CallError { plugin: self.name.clone(), status: 1, message: "buffer of another context".into() })
        }
    }

    fn buffer(&self, handle: BufferHandle, len: usize) -> DeviceBuffer {
        DeviceBuffer { raw: self.raw.clone(), handle, len }
    }

    /// Wraps host memory as a device buffer (zero-copy where the device shares host memory).
    ///
    /// # Safety
    /// `data` must stay alive and unchanged until the buffer is dropped.
    pub unsafe fn buffer_from_host(&mut self, data: &[u8]) -> Result<DeviceBuffer, CallError> {
        let mut handle: BufferHandle = std::ptr::null_mut();
        lock(&self.raw).call(|r, err| {
            // SAFETY: `data` outlives the buffer (caller's contract); valid output slot.
            unsafe { (r.vt.buffer_from_host)(r.ctx, data.as_ptr(), data.len(), &mut handle, err) }
        })?;
        Ok(self.buffer(handle, data.len()))
    }

    /// A zero-filled device buffer of `len` bytes.
    pub fn alloc(&mut self, len: usize) -> Result<DeviceBuffer, CallError> {
        let mut handle: BufferHandle = std::ptr::null_mut();
        // SAFETY: valid output slot.
        lock(&self.raw).call(|r, err| unsafe { (r.vt.buffer_alloc)(r.ctx, len, &mut handle, err) })?;
        Ok(self.buffer(handle, len))
    }

    /// One layer's K or V cache: in the backend's own layout when it has `kv_alloc` (ABI 2.1), else
    /// f32 `[blocks, block_size, heads, head_dim]` the host sizes. Returns the buffer and its bytes.
    pub fn kv_alloc(&mut self, desc: &KvCacheDesc) -> Result<DeviceBuffer, CallError> {
        let mut raw = lock(&self.raw);
        match raw.vt.kv_alloc {
            Some(kv_alloc) => {
                let mut handle: BufferHandle = std::ptr::null_mut();
                let mut bytes = 0u64;
                // SAFETY: valid description and output slots.
                raw.call(|r, err| unsafe { kv_alloc(r.ctx, desc, &mut handle, &mut bytes, err) })?;
                drop(raw);
                Ok(self.buffer(handle, bytes as usize))
            }
            None => {
                drop(raw);
                if desc.dtype != mlxcel_plugin_api::DType::F32 as u32 {
                    return Err(CallError {
                        plugin: self.name.clone(),
                        status: 1,
                        message: "this backend (ABI 2.0) only has f32 KV caches".into(),
                    });
                }
                let slots = desc.num_blocks as usize * desc.block_size as usize;
                self.alloc(slots * desc.n_kv_heads as usize * desc.head_dim as usize * 4)
            }
        }
    }

    /// Copies whole blocks inside a cache from [`BackendContext::kv_alloc`].
    pub fn copy_blocks(
        &mut self,
        buf: &mut DeviceBuffer,
        desc: &KvCacheDesc,
        copies: &[BlockCopy],
    ) -> Result<(), CallError> {
        self.check_buffer(buf)?;
        let mut raw = lock(&self.raw);
        let Some(copy) = raw.vt.copy_blocks else {
            return Err(CallError {
                plugin: self.name.clone(),
                status: 1,
                message: "this backend cannot copy KV blocks (ABI 2.0)".into(),
            });
        };
        // SAFETY: a live buffer of this context and `copies.len()` copies.
        raw.call(|r, err| unsafe { copy(r.ctx, buf.handle, desc, copies.as_ptr(), copies.len(), err) })
    }

    pub fn write(&mut self, buf: &mut DeviceBuffer, offset: usize, data: &[u8]) -> Result<(), CallError> {
        self.check_buffer(buf)?;
        // SAFETY: a live buffer of this context; `data` readable for its length.
        lock(&self.raw)
            .call(|r, err| unsafe { (r.vt.buffer_write)(r.ctx, buf.handle, offset, data.as_ptr(), data.len(), err) })
    }

    pub fn read(&mut self, buf: &DeviceBuffer, offset: usize, out: &mut [u8]) -> Result<(), CallError> {
        self.check_buffer(buf)?;
        // SAFETY: a live buffer of this context; `out` writable for its length.
        lock(&self.raw)
            .call(|r, err| unsafe { (r.vt.buffer_read)(r.ctx, buf.handle, offset, out.as_mut_ptr(), out.len(), err) })
    }

    /// Whether the backend can run this node.
    pub fn supports(&mut self, node: &Node) -> bool {
        let mut raw = lock(&self.raw);
        raw.settle();
        // SAFETY: one node of our layout.
        !raw.poisoned && unsafe { (raw.vt.supports_op)(raw.ctx, node, std::mem::size_of::<Node>()) != 0 }
    }

    /// Runs a graph.
    ///
    /// # Safety
    /// Every pointer in `args` must be valid for the sizes the graph implies, and every buffer it names
    /// must belong to this context.
    pub unsafe fn compute(&mut self, args: &ComputeArgs) -> Result<(), CallError> {
        // SAFETY: caller's contract.
        lock(&self.raw).call(|r, err| unsafe { (r.vt.compute)(r.ctx, args, err) })
    }

    /// Starts a graph without waiting for it (ABI 2.4 `submit`; a backend without it computes here and
    /// now). Finish it with [`BackendContext::wait`]; any other call on the context waits first.
    ///
    /// # Safety
    /// As for [`BackendContext::compute`], and every pointer in `args` stays valid (and the outputs
    /// unread) until `wait` returns — or until the context is dropped, which waits too.
    pub unsafe fn submit(&mut self, args: &ComputeArgs) -> Result<(), CallError> {
        let mut raw = lock(&self.raw);
        match raw.vt.submit {
            Some(submit) => {
                // SAFETY: caller's contract.
                raw.call(|r, err| unsafe { submit(r.ctx, args, err) })?;
                raw.in_flight = true;
                Ok(())
            }
            // SAFETY: caller's contract.
            None => raw.call(|r, err| unsafe { (r.vt.compute)(r.ctx, args, err) }),
        }
    }

    /// Waits for the graph [`BackendContext::submit`] started: its outputs are written when this
    /// returns `Ok`, and its error, if it failed, is returned here.
    pub fn wait(&mut self) -> Result<(), CallError> {
        lock(&self.raw).wait()
    }

    /// Whether the backend runs graphs asynchronously (ABI 2.4 `submit` / `wait`).
    pub fn is_async(&self) -> bool {
        lock(&self.raw).vt.submit.is_some()
    }
}
