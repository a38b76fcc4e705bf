//! Writing a plugin in Rust without writing C glue: implement [`Family`] (or [`Backend`]) and call
//! [`export_family!`](crate::export_family) (or [`export_backend!`](crate::export_backend)). The macros
//! generate the root, the vtable and every `extern "C"` entry point, each inside a panic guard, with
//! versioned reads and writes of what crosses. A plugin in another language implements the same tables
//! by hand.

use std::ffi::c_void;

use crate::backend::*;
use crate::family::*;
use crate::ffi::*;
use crate::graph::{Graph, GraphRef, Node, WeightInfo};

// ---------------------------------------------------------------------------------------------------
// Families

/// What a loaded model is, owned by the model (the ABI's [`ModelDesc`] points into it).
#[derive(Debug, Clone)]
pub struct ModelDescription {
    pub task: Task,
    pub architecture: String,
    pub vocab_size: u64,
    pub hidden_size: u64,
    pub n_layers: u32,
    pub max_positions: u64,
    pub kv_layers: Vec<KvLayerDesc>,
    pub used_weights: Vec<u32>,
    pub activation_bytes_per_token: u64,
    pub quantization: String,
    pub output_kind: OutputKind,
    pub output_dim: u64,
}

/// One model of a family: describes itself and builds the graph of each step.
pub trait FamilyModel: Send + 'static {
    fn description(&self) -> ModelDescription;
    /// Builds the graph of one step; the family keeps it until the next call.
    fn build_graph(&mut self, step: &StepDesc) -> Result<&Graph, PluginError>;
}

/// A family plugin: the architectures it knows and how to make a model of one.
pub trait Family {
    const NAME: &'static str;
    const DESCRIPTION: &'static str;
    /// The `model_type` values handled.
    const ARCHITECTURES: &'static [&'static str];
    type Model: FamilyModel;
    /// How well a `config.json` matches (0 = not at all).
    fn match_config(config_json: &str) -> u32;
    fn create(config_json: &str, weights: &[WeightInfo]) -> Result<Self::Model, PluginError>;
}

/// A model behind the ABI: the model and the description its `ModelDesc` points into.
pub struct FamilyHandle<M> {
    pub model: M,
    pub description: ModelDescription,
}

/// The entry points [`export_family!`](crate::export_family) wires into a [`FamilyVTable`].
pub mod family_entry {
    use super::*;

    /// `StrRef`s of `F::ARCHITECTURES`, made once.
    ///
    /// # Safety
    /// `out_len` is null or writable (ABI contract of [`FamilyVTable::architectures`]).
    pub unsafe fn architectures<F: Family>(
        cache: &'static std::sync::OnceLock<Vec<StrRef>>,
        out_len: *mut usize,
    ) -> *const StrRef {
        let refs = cache.get_or_init(|| F::ARCHITECTURES.iter().map(|a| StrRef::from_static(a)).collect());
        // SAFETY: `out_len` is null or writable (ABI contract).
        if let Some(n) = unsafe { out_len.as_mut() } {
            *n = refs.len();
        }
        refs.as_ptr()
    }

    /// # Safety
    /// ABI contract of [`FamilyVTable::match_config`].
    pub unsafe fn match_config<F: Family>(config_json: StrRef) -> u32 {
        // SAFETY: the host passes a valid string for the call.
        guard_value(0, || F::match_config(unsafe { config_json.as_str() }))
    }

    /// # Safety
    /// ABI contract of [`FamilyVTable::model_create`].
    pub unsafe fn model_create<F: Family>(
        config_json: StrRef,
        weights: *const WeightInfo,
        n_weights: usize,
        out: *mut *mut c_void,
        err: *mut ErrorBuf,
    ) -> Status {
        let body = || {
            // SAFETY: the host passes a valid string and `n_weights` weight infos for the call.
            let (json, weights) = unsafe { (config_json.as_str(), slice_from(weights, n_weights)) };
            let model = F::create(json, weights)?;
            let description = model.description();
            let handle = Box::new(FamilyHandle { model, description });
            // SAFETY: `out` is writable (ABI contract).
            unsafe { *out = Box::into_raw(handle) as *mut c_void };
            Ok(())
        };
        // SAFETY: the host passes a valid or null error buffer (ABI contract).
        unsafe { guard(err, body) }
    }

    /// # Safety
    /// ABI contract of [`FamilyVTable::model_describe`].
    pub unsafe fn model_describe<F: Family>(model: *mut c_void, out: *mut ModelDesc) -> Status {
        let body = || {
            // SAFETY: `model` came from `model_create` of this family.
            let h = unsafe { (model as *const FamilyHandle<F::Model>).as_ref() }
                .ok_or_else(|| PluginError::invalid("null model"))?;
            let d = &h.description;
            let desc = ModelDesc {
                task: d.task as u32,
                architecture: StrRef::new(&d.architecture),
                vocab_size: d.vocab_size,
                hidden_size: d.hidden_size,
                n_layers: d.n_layers,
                max_positions: d.max_positions,
                kv_layers: d.kv_layers.as_ptr(),
                n_kv_layers: d.kv_layers.len(),
                used_weights: d.used_weights.as_ptr(),
                n_used_weights: d.used_weights.len(),
                activation_bytes_per_token: d.activation_bytes_per_token,
                quantization: StrRef::new(&d.quantization),
                output_kind: d.output_kind as u32,
                output_dim: d.output_dim,
                ..ModelDesc::zeroed()
            };
            // SAFETY: `out` is the caller's struct with its size set (ABI contract).
            unsafe { write_versioned(out, &desc) };
            Ok(())
        };
        // SAFETY: a null error buffer is allowed.
        unsafe { guard(std::ptr::null_mut(), body) }
    }

    /// # Safety
    /// ABI contract of [`FamilyVTable::build_graph`].
    pub unsafe fn build_graph<F: Family>(
        model: *mut c_void,
        step: *const StepDesc,
        out: *mut GraphRef,
        err: *mut ErrorBuf,
    ) -> Status {
        let body = || {
            // SAFETY: `model` came from `model_create` of this family and is used by one thread.
            let h = unsafe { (model as *mut FamilyHandle<F::Model>).as_mut() }
                .ok_or_else(|| PluginError::invalid("null model"))?;
            // SAFETY: the host passes a valid step description.
            let step = unsafe { read_versioned(step) }.ok_or_else(|| PluginError::invalid("null step"))?;
            let graph = h.model.build_graph(&step)?.as_ref();
            // SAFETY: `out` is writable (ABI contract).
            unsafe { *out = graph };
            Ok(())
        };
        // SAFETY: the host passes a valid or null error buffer (ABI contract).
        unsafe { guard(err, body) }
    }

    /// # Safety
    /// ABI contract of [`FamilyVTable::model_destroy`].
    pub unsafe fn model_destroy<F: Family>(model: *mut c_void) {
        guard_value((), || {
            if !model.is_null() {
                // SAFETY: `model` came from `model_create` and is destroyed once.
                drop(unsafe { Box::from_raw(model as *mut FamilyHandle<F::Model>) });
            }
        })
    }
}

/// Exports a [`Family`] as this library's plugin root.
///
/// ```ignore
/// struct Llama;
/// impl mlxcel_plugin_api::Family for Llama { /* … */ }
/// mlxcel_plugin_api::export_family!(Llama);
/// ```
#[macro_export]
macro_rules! export_family {
    ($family:ty) => {
        const _: () = {
            use $crate::export::family_entry as e;
            static ARCHS: ::std::sync::OnceLock<Vec<$crate::StrRef>> = ::std::sync::OnceLock::new();
            unsafe extern "C" fn init(err: *mut $crate::ErrorBuf) -> $crate::Status {
                // SAFETY: the host passes a valid or null error buffer.
                unsafe { $crate::guard(err, || Ok(())) }
            }
            unsafe extern "C" fn architectures(out_len: *mut usize) -> *const $crate::StrRef {
                unsafe { e::architectures::<$family>(&ARCHS, out_len) }
            }
            unsafe extern "C" fn match_config(c: $crate::StrRef) -> u32 {
                unsafe { e::match_config::<$family>(c) }
            }
            unsafe extern "C" fn model_create(
                c: $crate::StrRef,
                w: *const $crate::WeightInfo,
                n: usize,
                out: *mut *mut ::std::ffi::c_void,
                err: *mut $crate::ErrorBuf,
            ) -> $crate::Status {
                unsafe { e::model_create::<$family>(c, w, n, out, err) }
            }
            unsafe extern "C" fn model_describe(
                m: *mut ::std::ffi::c_void,
                out: *mut $crate::ModelDesc,
            ) -> $crate::Status {
                unsafe { e::model_describe::<$family>(m, out) }
            }
            unsafe extern "C" fn build_graph(
                m: *mut ::std::ffi::c_void,
                s: *const $crate::StepDesc,
                out: *mut $crate::GraphRef,
                err: *mut $crate::ErrorBuf,
            ) -> $crate::Status {
                unsafe { e::build_graph::<$family>(m, s, out, err) }
            }
            unsafe extern "C" fn model_destroy(m: *mut ::std::ffi::c_void) {
                unsafe { e::model_destroy::<$family>(m) }
            }
            static VTABLE: $crate::FamilyVTable = $crate::FamilyVTable {
                size: ::std::mem::size_of::<$crate::FamilyVTable>(),
                architectures,
                match_config,
                model_create,
                model_describe,
                build_graph,
                model_destroy,
            };
            static ROOT: $crate::PluginRoot = $crate::PluginRoot {
                abi_major: $crate::ABI_MAJOR,
                abi_minor: $crate::ABI_MINOR,
                kind: $crate::PluginKind::Family as u32,
                name: $crate::StrRef::from_static(<$family as $crate::Family>::NAME),
                version: $crate::StrRef::from_static(env!("CARGO_PKG_VERSION")),
                description: $crate::StrRef::from_static(<$family as $crate::Family>::DESCRIPTION),
                init,
                backend: ::std::ptr::null(),
                family: &VTABLE,
            };
            $crate::export_plugin!(ROOT);
        };
    };
}

// ---------------------------------------------------------------------------------------------------
// Backends

/// A device as a backend describes it (static for the life of the process).
#[derive(Debug, Clone)]
pub struct DeviceDescription {
    pub name: String,
    pub kind: DeviceKind,
    pub memory_bytes: u64,
    pub free_memory_bytes: u64,
}

/// What a backend says of itself on this machine, without being created.
#[derive(Debug, Clone)]
pub struct BackendDescription {
    pub score: u32,
    pub features: String,
    pub reason: String,
    pub devices: Vec<DeviceDescription>,
}

/// One backend context: buffers and graph execution on one device, used by one thread at a time.
pub trait BackendContext: Send + 'static {
    /// The backend's buffer; the ABI hands out `Box<Buffer>` pointers as handles.
    type Buffer: 'static;
    /// Wraps host memory (zero-copy where possible); the host keeps it alive until the buffer is freed.
    ///
    /// # Safety
    /// `ptr` is readable for `len` bytes until the buffer is dropped.
    unsafe fn buffer_from_host(&mut self, ptr: *const u8, len: usize) -> Result<Self::Buffer, PluginError>;
    fn buffer_alloc(&mut self, len: usize) -> Result<Self::Buffer, PluginError>;
    fn buffer_write(&mut self, buf: &mut Self::Buffer, offset: usize, src: &[u8]) -> Result<(), PluginError>;
    fn buffer_read(&mut self, buf: &Self::Buffer, offset: usize, dst: &mut [u8]) -> Result<(), PluginError>;
    fn supports(&self, node: &Node) -> bool;
    /// Runs a graph. Buffers named in `args` are `Box<Self::Buffer>` handles of this context.
    ///
    /// # Safety
    /// Every pointer in `args` is valid for the sizes the graph implies (ABI contract).
    unsafe fn compute(&mut self, args: &ComputeArgs) -> Result<(), PluginError>;
    /// Starts a graph without waiting for it (ABI 2.4). The default computes it at once: right for a
    /// device that is synchronous anyway, such as the CPU.
    ///
    /// # Safety
    /// As for [`BackendContext::compute`], and the pointers stay valid until [`BackendContext::wait`]
    /// returns.
    unsafe fn submit(&mut self, args: &ComputeArgs) -> Result<(), PluginError> {
        // SAFETY: the caller's contract.
        unsafe { self.compute(args) }
    }
    /// Finishes what [`BackendContext::submit`] started (its outputs written); nothing in flight: `Ok`.
    fn wait(&mut self) -> Result<(), PluginError> {
        Ok(())
    }
    /// One layer's K or V cache in the backend's own layout, and its bytes.
    fn kv_alloc(&mut self, desc: &KvCacheDesc) -> Result<(Self::Buffer, u64), PluginError>;
    /// Copies whole blocks inside a cache made by [`BackendContext::kv_alloc`].
    fn copy_blocks(
        &mut self,
        buf: &mut Self::Buffer,
        desc: &KvCacheDesc,
        copies: &[BlockCopy],
    ) -> Result<(), PluginError>;
}

/// A backend plugin.
pub trait Backend {
    const NAME: &'static str;
    const DESCRIPTION: &'static str;
    type Context: BackendContext;
    fn describe() -> BackendDescription;
    fn create(n_threads: u32, device: u32) -> Result<Self::Context, PluginError>;
}

/// The entry points [`export_backend!`](crate::export_backend) wires into a [`BackendVTable`].
pub mod backend_entry {
    use super::*;

    type Buf<B> = <<B as Backend>::Context as BackendContext>::Buffer;

    /// The description in ABI form, made once (its strings and devices live for the process).
    pub struct StaticInfo {
        info: BackendInfo,
        _devices: Vec<DeviceInfo>,
        _strings: Vec<String>,
    }
    // SAFETY: immutable after construction; the pointers are to data it owns.
    unsafe impl Sync for StaticInfo {}
    // SAFETY: as above.
    unsafe impl Send for StaticInfo {}

    /// # Safety
    /// ABI contract of [`BackendVTable::describe`].
    pub unsafe fn describe<B: Backend>(
        cache: &'static std::sync::OnceLock<StaticInfo>,
        out: *mut BackendInfo,
    ) -> Status {
        let body = || {
            let s = cache.get_or_init(|| {
                let d = B::describe();
                let strings: Vec<String> = std::iter::once(d.features.clone())
                    .chain(std::iter::once(d.reason.clone()))
                    .chain(d.devices.iter().map(|dev| dev.name.clone()))
                    .collect();
                let devices: Vec<DeviceInfo> = d
                    .devices
                    .iter()
                    .zip(&strings[2..])
                    .map(|(dev, name)| DeviceInfo {
                        name: StrRef::new(name),
                        kind: dev.kind as u32,
                        memory_bytes: dev.memory_bytes,
                        free_memory_bytes: dev.free_memory_bytes,
                        ..DeviceInfo::zeroed()
                    })
                    .collect();
                let info = BackendInfo {
                    score: d.score,
                    features: StrRef::new(&strings[0]),
                    reason: StrRef::new(&strings[1]),
                    devices: devices.as_ptr(),
                    n_devices: devices.len(),
                    ..BackendInfo::zeroed()
                };
                StaticInfo { info, _devices: devices, _strings: strings }
            });
            // SAFETY: `out` is the caller's struct with its size set (ABI contract).
            unsafe { write_versioned(out, &s.info) };
            Ok(())
        };
        // SAFETY: a null error buffer is allowed.
        unsafe { guard(std::ptr::null_mut(), body) }
    }

    /// # Safety
    /// ABI contract of [`BackendVTable::create`].
    pub unsafe fn create<B: Backend>(opts: *const BackendOptions, out: *mut *mut c_void, err: *mut ErrorBuf) -> Status {
        let body = || {
            // SAFETY: the host passes valid options.
            let o = unsafe { read_versioned(opts) }.ok_or_else(|| PluginError::invalid("null options"))?;
            let ctx = Box::new(B::create(o.n_threads, o.device)?);
            // SAFETY: `out` is writable (ABI contract).
            unsafe { *out = Box::into_raw(ctx) as *mut c_void };
            Ok(())
        };
        // SAFETY: the host passes a valid or null error buffer (ABI contract).
        unsafe { guard(err, body) }
    }

    /// # Safety
    /// ABI contract of [`BackendVTable::destroy`].
    pub unsafe fn destroy<B: Backend>(ctx: *mut c_void) {
        guard_value((), || {
            if !ctx.is_null() {
                // SAFETY: `ctx` came from `create` and is destroyed once.
                drop(unsafe { Box::from_raw(ctx as *mut B::Context) });
            }
        })
    }

    /// The context behind a handle.
    ///
    /// # Safety
    /// `ctx` is null or came from `create` and is used by one thread at a time.
    pub unsafe fn context<'a, B: Backend>(ctx: *mut c_void) -> Result<&'a mut B::Context, PluginError> {
        // SAFETY: caller's contract.
        unsafe { (ctx as *mut B::Context).as_mut() }.ok_or_else(|| PluginError::invalid("null context"))
    }

    /// Hands out a buffer as an ABI handle.
    ///
    /// # Safety
    /// `out` is null (an error) or a writable handle slot.
    pub unsafe fn into_handle<B: Backend>(buf: Buf<B>, out: *mut BufferHandle) -> Result<(), PluginError> {
        if out.is_null() {
            return Err(PluginError::invalid("null output"));
        }
        // SAFETY: checked non-null; the host passes a writable handle slot.
        unsafe { *out = Box::into_raw(Box::new(buf)) as BufferHandle };
        Ok(())
    }

    /// The buffer behind a handle.
    ///
    /// # Safety
    /// `buf` is null or a live handle of this backend, used by one thread at a time.
    pub unsafe fn buffer<'a, B: Backend>(buf: BufferHandle) -> Result<&'a mut Buf<B>, PluginError> {
        // SAFETY: caller's contract.
        unsafe { (buf as *mut Buf<B>).as_mut() }.ok_or_else(|| PluginError::invalid("null buffer"))
    }

    /// # Safety
    /// ABI contract of [`BackendVTable::buffer_from_host`].
    pub unsafe fn buffer_from_host<B: Backend>(
        ctx: *mut c_void,
        ptr: *const u8,
        len: usize,
        out: *mut BufferHandle,
        err: *mut ErrorBuf,
    ) -> Status {
        let body = || {
            // SAFETY: ABI contract: live context; `ptr` readable for `len` until the buffer is freed.
            let buf = unsafe { context::<B>(ctx)?.buffer_from_host(ptr, len)? };
            // SAFETY: `out` is a writable handle slot (ABI contract).
            unsafe { into_handle::<B>(buf, out) }
        };
        // SAFETY: the host passes a valid or null error buffer (ABI contract).
        unsafe { guard(err, body) }
    }

    /// # Safety
    /// ABI contract of [`BackendVTable::buffer_alloc`].
    pub unsafe fn buffer_alloc<B: Backend>(
        ctx: *mut c_void,
        len: usize,
        out: *mut BufferHandle,
        err: *mut ErrorBuf,
    ) -> Status {
        let body = || {
            // SAFETY: ABI contract: live context.
            let buf = unsafe { context::<B>(ctx)? }.buffer_alloc(len)?;
            // SAFETY: `out` is a writable handle slot (ABI contract).
            unsafe { into_handle::<B>(buf, out) }
        };
        // SAFETY: the host passes a valid or null error buffer (ABI contract).
        unsafe { guard(err, body) }
    }

    /// # Safety
    /// ABI contract of [`BackendVTable::buffer_write`].
    pub unsafe fn buffer_write<B: Backend>(
        ctx: *mut c_void,
        buf: BufferHandle,
        offset: usize,
        src: *const u8,
        len: usize,
        err: *mut ErrorBuf,
    ) -> Status {
        let body = || {
            // SAFETY: ABI contract: live context and buffer; `src` readable for `len` bytes.
            unsafe { context::<B>(ctx)?.buffer_write(buffer::<B>(buf)?, offset, slice_from(src, len)) }
        };
        // SAFETY: the host passes a valid or null error buffer (ABI contract).
        unsafe { guard(err, body) }
    }

    /// # Safety
    /// ABI contract of [`BackendVTable::buffer_read`].
    pub unsafe fn buffer_read<B: Backend>(
        ctx: *mut c_void,
        buf: BufferHandle,
        offset: usize,
        dst: *mut u8,
        len: usize,
        err: *mut ErrorBuf,
    ) -> Status {
        let body = || {
            let dst = if len == 0 {
                &mut [][..]
            } else if dst.is_null() {
                return Err(PluginError::invalid("null destination"));
            } else {
                // SAFETY: ABI contract: `dst` writable for `len` bytes.
                unsafe { std::slice::from_raw_parts_mut(dst, len) }
            };
            // SAFETY: ABI contract: live context and buffer.
            unsafe { context::<B>(ctx)?.buffer_read(buffer::<B>(buf)?, offset, dst) }
        };
        // SAFETY: the host passes a valid or null error buffer (ABI contract).
        unsafe { guard(err, body) }
    }

    /// # Safety
    /// ABI contract of [`BackendVTable::buffer_free`].
    pub unsafe fn buffer_free<B: Backend>(buf: BufferHandle) {
        guard_value((), || {
            if !buf.is_null() {
                // SAFETY: a live handle, freed once.
                drop(unsafe { Box::from_raw(buf as *mut Buf<B>) });
            }
        })
    }

    /// # Safety
    /// ABI contract of [`BackendVTable::supports_op`].
    pub unsafe fn supports_op<B: Backend>(ctx: *mut c_void, node: *const Node, node_size: usize) -> u32 {
        guard_value(0, || {
            if node.is_null() {
                return 0;
            }
            // SAFETY: the host passes one node of `node_size` bytes.
            let node: Node = unsafe { read_element(node as *const u8, node_size, 0) };
            // SAFETY: ABI contract: live context.
            unsafe { context::<B>(ctx) }.is_ok_and(|c| c.supports(&node)) as u32
        })
    }

    /// # Safety
    /// ABI contract of [`BackendVTable::compute`].
    pub unsafe fn compute<B: Backend>(ctx: *mut c_void, args: *const ComputeArgs, err: *mut ErrorBuf) -> Status {
        let body = || {
            // SAFETY: ABI contract: valid arguments and a live context.
            let args = unsafe { read_versioned(args) }.ok_or_else(|| PluginError::invalid("null arguments"))?;
            // SAFETY: a live context; the arguments' pointers are valid (ABI contract).
            unsafe { context::<B>(ctx)?.compute(&args) }
        };
        // SAFETY: the host passes a valid or null error buffer (ABI contract).
        unsafe { guard(err, body) }
    }

    /// # Safety
    /// ABI contract of [`BackendVTable::submit`].
    pub unsafe fn submit<B: Backend>(ctx: *mut c_void, args: *const ComputeArgs, err: *mut ErrorBuf) -> Status {
        let body = || {
            // SAFETY: ABI contract: valid arguments and a live context.
            let args = unsafe { read_versioned(args) }.ok_or_else(|| PluginError::invalid("null arguments"))?;
            // SAFETY: a live context; the arguments' pointers stay valid until `wait` (ABI contract).
            unsafe { context::<B>(ctx)?.submit(&args) }
        };
        // SAFETY: the host passes a valid or null error buffer (ABI contract).
        unsafe { guard(err, body) }
    }

    /// # Safety
    /// ABI contract of [`BackendVTable::wait`].
    pub unsafe fn wait<B: Backend>(ctx: *mut c_void, err: *mut ErrorBuf) -> Status {
        // SAFETY: ABI contract: a live context; the host passes a valid or null error buffer.
        unsafe { guard(err, || context::<B>(ctx)?.wait()) }
    }

    /// # Safety
    /// ABI contract of [`BackendVTable::kv_alloc`].
    pub unsafe fn kv_alloc<B: Backend>(
        ctx: *mut c_void,
        desc: *const KvCacheDesc,
        out: *mut BufferHandle,
        out_bytes: *mut u64,
        err: *mut ErrorBuf,
    ) -> Status {
        let body = || {
            // SAFETY: ABI contract: valid description and a live context.
            let desc = unsafe { read_versioned(desc) }.ok_or_else(|| PluginError::invalid("null cache description"))?;
            // SAFETY: a live context (ABI contract).
            let (buf, bytes) = unsafe { context::<B>(ctx)? }.kv_alloc(&desc)?;
            // SAFETY: `out_bytes` is null or writable.
            if let Some(b) = unsafe { out_bytes.as_mut() } {
                *b = bytes;
            }
            // SAFETY: `out` is a writable handle slot (ABI contract).
            unsafe { into_handle::<B>(buf, out) }
        };
        // SAFETY: the host passes a valid or null error buffer (ABI contract).
        unsafe { guard(err, body) }
    }

    /// # Safety
    /// ABI contract of [`BackendVTable::copy_blocks`].
    pub unsafe fn copy_blocks<B: Backend>(
        ctx: *mut c_void,
        buf: BufferHandle,
        desc: *const KvCacheDesc,
        copies: *const BlockCopy,
        n_copies: usize,
        err: *mut ErrorBuf,
    ) -> Status {
        let body = || {
            // SAFETY: ABI contract: live context and buffer, valid description and `n_copies` copies.
            unsafe {
                let desc = read_versioned(desc).ok_or_else(|| PluginError::invalid("null cache description"))?;
                context::<B>(ctx)?.copy_blocks(buffer::<B>(buf)?, &desc, slice_from(copies, n_copies))
            }
        };
        // SAFETY: the host passes a valid or null error buffer (ABI contract).
        unsafe { guard(err, body) }
    }
}

/// Exports a [`Backend`] as this library's plugin root.
///
/// `export_backend!(Cpu)` exports the current ABI. `export_backend!(Cpu, minor = 0, name = "…")` exports
/// the table as an older minor had it (shorter, the later entries absent), which is how the loader's
/// evolution test builds a plugin "of an older minor".
#[macro_export]
macro_rules! export_backend {
    ($backend:ty) => {
        $crate::export_backend!(@root $backend, $crate::ABI_MINOR, ::std::mem::size_of::<$crate::BackendVTable>(),
            <$backend as $crate::Backend>::NAME);
    };
    ($backend:ty, minor = 0, name = $name:expr) => {
        $crate::export_backend!(@root $backend, 0, $crate::BackendVTable::MIN_SIZE, $name);
    };
    (@root $backend:ty, $minor:expr, $size:expr, $name:expr) => {
        const _: () = {
            use $crate::export::backend_entry as e;
            type B = $backend;
            static INFO: ::std::sync::OnceLock<e::StaticInfo> = ::std::sync::OnceLock::new();
            unsafe extern "C" fn init(err: *mut $crate::ErrorBuf) -> $crate::Status {
                // SAFETY: the host passes a valid or null error buffer.
                unsafe { $crate::guard(err, || Ok(())) }
            }
            unsafe extern "C" fn describe(out: *mut $crate::BackendInfo) -> $crate::Status {
                unsafe { e::describe::<B>(&INFO, out) }
            }
            unsafe extern "C" fn create(
                o: *const $crate::BackendOptions,
                out: *mut *mut ::std::ffi::c_void,
                err: *mut $crate::ErrorBuf,
            ) -> $crate::Status {
                unsafe { e::create::<B>(o, out, err) }
            }
            unsafe extern "C" fn destroy(c: *mut ::std::ffi::c_void) {
                unsafe { e::destroy::<B>(c) }
            }
            unsafe extern "C" fn buffer_from_host(
                c: *mut ::std::ffi::c_void,
                p: *const u8,
                n: usize,
                out: *mut $crate::BufferHandle,
                err: *mut $crate::ErrorBuf,
            ) -> $crate::Status {
                unsafe { e::buffer_from_host::<B>(c, p, n, out, err) }
            }
            unsafe extern "C" fn buffer_alloc(
                c: *mut ::std::ffi::c_void,
                n: usize,
                out: *mut $crate::BufferHandle,
                err: *mut $crate::ErrorBuf,
            ) -> $crate::Status {
                unsafe { e::buffer_alloc::<B>(c, n, out, err) }
            }
            unsafe extern "C" fn buffer_write(
                c: *mut ::std::ffi::c_void,
                b: $crate::BufferHandle,
                off: usize,
                p: *const u8,
                n: usize,
                err: *mut $crate::ErrorBuf,
            ) -> $crate::Status {
                unsafe { e::buffer_write::<B>(c, b, off, p, n, err) }
            }
            unsafe extern "C" fn buffer_read(
                c: *mut ::std::ffi::c_void,
                b: $crate::BufferHandle,
                off: usize,
                p: *mut u8,
                n: usize,
                err: *mut $crate::ErrorBuf,
            ) -> $crate::Status {
                unsafe { e::buffer_read::<B>(c, b, off, p, n, err) }
            }
            unsafe extern "C" fn buffer_free(_c: *mut ::std::ffi::c_void, b: $crate::BufferHandle) {
                unsafe { e::buffer_free::<B>(b) }
            }
            unsafe extern "C" fn supports_op(c: *mut ::std::ffi::c_void, n: *const $crate::Node, sz: usize) -> u32 {
                unsafe { e::supports_op::<B>(c, n, sz) }
            }
            unsafe extern "C" fn compute(
                c: *mut ::std::ffi::c_void,
                a: *const $crate::ComputeArgs,
                err: *mut $crate::ErrorBuf,
            ) -> $crate::Status {
                unsafe { e::compute::<B>(c, a, err) }
            }
            unsafe extern "C" fn kv_alloc(
                c: *mut ::std::ffi::c_void,
                d: *const $crate::KvCacheDesc,
                out: *mut $crate::BufferHandle,
                bytes: *mut u64,
                err: *mut $crate::ErrorBuf,
            ) -> $crate::Status {
                unsafe { e::kv_alloc::<B>(c, d, out, bytes, err) }
            }
            unsafe extern "C" fn copy_blocks(
                c: *mut ::std::ffi::c_void,
                b: $crate::BufferHandle,
                d: *const $crate::KvCacheDesc,
                cp: *const $crate::BlockCopy,
                n: usize,
                err: *mut $crate::ErrorBuf,
            ) -> $crate::Status {
                unsafe { e::copy_blocks::<B>(c, b, d, cp, n, err) }
            }
            unsafe extern "C" fn submit(
                c: *mut ::std::ffi::c_void,
                a: *const $crate::ComputeArgs,
                err: *mut $crate::ErrorBuf,
            ) -> $crate::Status {
                unsafe { e::submit::<B>(c, a, err) }
            }
            unsafe extern "C" fn wait(c: *mut ::std::ffi::c_void, err: *mut $crate::ErrorBuf) -> $crate::Status {
                unsafe { e::wait::<B>(c, err) }
            }
            static VTABLE: $crate::BackendVTable = $crate::BackendVTable {
                size: $size,
                describe,
                create,
                destroy,
                buffer_from_host,
                buffer_alloc,
                buffer_write,
                buffer_read,
                buffer_free,
                supports_op,
                compute,
                kv_alloc: Some(kv_alloc),
                copy_blocks: Some(copy_blocks),
                submit: Some(submit),
                wait: Some(wait),
            };
            static ROOT: $crate::PluginRoot = $crate::PluginRoot {
                abi_major: $crate::ABI_MAJOR,
                abi_minor: $minor,
                kind: $crate::PluginKind::Backend as u32,
                name: $crate::StrRef::from_static($name),
                version: $crate::StrRef::from_static(env!("CARGO_PKG_VERSION")),
                description: $crate::StrRef::from_static(<B as $crate::Backend>::DESCRIPTION),
                init,
                backend: &VTABLE,
                family: ::std::ptr::null(),
            };
            $crate::export_plugin!(ROOT);
        };
    };
}
