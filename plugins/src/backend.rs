//! Safe wrappers over a backend plugin's vtable.

use std::ffi::c_void;
use std::sync::Arc;

use mlxcel_plugin_api::{
    BackendInfo, BackendOptions, BackendVTable, BufferHandle, ComputeArgs, DeviceKind, ErrorMessage, Node,
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

    /// Score, features and devices; a plugin that fails to describe itself scores 0.
    pub fn describe(&self) -> BackendDescription {
        let mut info = BackendInfo {
            score: 0,
            features: mlxcel_plugin_api::StrRef::empty(),
            reason: mlxcel_plugin_api::StrRef::empty(),
            devices: std::ptr::null(),
            n_devices: 0,
        };
        let status = unsafe { (self.vt.describe)(&mut info) };
        if !status.is_ok() {
            return BackendDescription {
                score: 0,
                features: String::new(),
                reason: "describe failed".into(),
                devices: vec![],
            };
        }
        let devices = unsafe { mlxcel_plugin_api::slice_from(info.devices, info.n_devices) }
            .iter()
            .map(|d| Device {
                name: unsafe { d.name.as_str() }.to_string(),
                kind: if d.kind == DeviceKind::Gpu as u32 { "gpu" } else { "cpu" },
                memory_bytes: d.memory_bytes,
            })
            .collect();
        BackendDescription {
            score: info.score,
            features: unsafe { info.features.as_str() }.to_string(),
            reason: unsafe { info.reason.as_str() }.to_string(),
            devices,
        }
    }

    /// Creates a context on device `device` with `n_threads` workers (0 = backend default).
    pub fn create(&self, n_threads: u32, device: u32) -> Result<BackendContext, CallError> {
        let opts = BackendOptions { n_threads, device };
        let mut ctx: *mut c_void = std::ptr::null_mut();
        let mut err = ErrorMessage::new();
        let status = unsafe { (self.vt.create)(&opts, &mut ctx, err.as_ptr()) };
        check(&self.meta.name, status, &err)?;
        Ok(BackendContext(Arc::new(ContextInner { name: self.meta.name.clone(), vt: self.vt, ctx })))
    }
}

struct ContextInner {
    name: String,
    vt: &'static BackendVTable,
    ctx: *mut c_void,
}

// A context is only used behind `&mut`-free calls that the plugin serialises per context; the engine
// drives one context from one thread at a time.
unsafe impl Send for ContextInner {}
unsafe impl Sync for ContextInner {}

impl Drop for ContextInner {
    fn drop(&mut self) {
        unsafe { (self.vt.destroy)(self.ctx) };
    }
}

/// A live backend context. Cheap to clone; destroyed when the last clone and buffer are gone.
#[derive(Clone)]
pub struct BackendContext(Arc<ContextInner>);

/// A device buffer, freed on drop.
pub struct DeviceBuffer {
    ctx: Arc<ContextInner>,
    handle: BufferHandle,
    len: usize,
}

unsafe impl Send for DeviceBuffer {}
unsafe impl Sync for DeviceBuffer {}

impl DeviceBuffer {
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
        unsafe { (self.ctx.vt.buffer_free)(self.ctx.ctx, self.handle) };
    }
}

impl BackendContext {
    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// Wraps host memory as a device buffer (zero-copy where the device shares host memory).
    ///
    /// # Safety
    /// `data` must stay alive and unchanged until the buffer is dropped.
    pub unsafe fn buffer_from_host(&self, data: &[u8]) -> Result<DeviceBuffer, CallError> {
        let mut handle: BufferHandle = std::ptr::null_mut();
        let mut err = ErrorMessage::new();
        let status = (self.0.vt.buffer_from_host)(self.0.ctx, data.as_ptr(), data.len(), &mut handle, err.as_ptr());
        check(&self.0.name, status, &err)?;
        Ok(DeviceBuffer { ctx: self.0.clone(), handle, len: data.len() })
    }

    /// A zero-filled device buffer of `len` bytes.
    pub fn alloc(&self, len: usize) -> Result<DeviceBuffer, CallError> {
        let mut handle: BufferHandle = std::ptr::null_mut();
        let mut err = ErrorMessage::new();
        let status = unsafe { (self.0.vt.buffer_alloc)(self.0.ctx, len, &mut handle, err.as_ptr()) };
        check(&self.0.name, status, &err)?;
        Ok(DeviceBuffer { ctx: self.0.clone(), handle, len })
    }

    pub fn write(&self, buf: &DeviceBuffer, offset: usize, data: &[u8]) -> Result<(), CallError> {
        let mut err = ErrorMessage::new();
        let status = unsafe {
            (self.0.vt.buffer_write)(self.0.ctx, buf.handle, offset, data.as_ptr(), data.len(), err.as_ptr())
        };
        check(&self.0.name, status, &err)
    }

    pub fn read(&self, buf: &DeviceBuffer, offset: usize, out: &mut [u8]) -> Result<(), CallError> {
        let mut err = ErrorMessage::new();
        let status = unsafe {
            (self.0.vt.buffer_read)(self.0.ctx, buf.handle, offset, out.as_mut_ptr(), out.len(), err.as_ptr())
        };
        check(&self.0.name, status, &err)
    }

    pub fn supports(&self, node: &Node) -> bool {
        unsafe { (self.0.vt.supports_op)(self.0.ctx, node) != 0 }
    }

    /// Runs a graph.
    ///
    /// # Safety
    /// Every pointer in `args` must be valid for the sizes the graph implies.
    pub unsafe fn compute(&self, args: &ComputeArgs) -> Result<(), CallError> {
        let mut err = ErrorMessage::new();
        let status = (self.0.vt.compute)(self.0.ctx, args, err.as_ptr());
        check(&self.0.name, status, &err)
    }
}
