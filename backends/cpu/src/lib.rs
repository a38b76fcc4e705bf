//! The CPU backend plugin: executes mlxcel op graphs on the host CPU.
//!
//! Every exported function is a thin, panic-guarded shim over [`executor`] and [`buffer`]; kernels live
//! in [`kernels`], one file per kind of op, each compiled per SIMD path ([`isa`]).

pub mod buffer;
pub mod executor;
pub mod isa;
pub mod kernels;

use std::ffi::c_void;
use std::sync::OnceLock;

use mlxcel_plugin_api::*;

use buffer::{AlignedBytes, Buffer};
use executor::CpuContext;
use isa::Isa;

unsafe extern "C" fn init(err: *mut ErrorBuf) -> Status {
    guard(err, || Ok(()))
}

fn cpu_name() -> &'static str {
    static NAME: OnceLock<String> = OnceLock::new();
    NAME.get_or_init(|| {
        std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split(':').nth(1))
                    .map(|s| s.trim().to_string())
            })
            .unwrap_or_else(|| format!("{} cpu", std::env::consts::ARCH))
    })
}

fn total_memory() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

unsafe extern "C" fn describe(out: *mut BackendInfo) -> Status {
    static DEVICES: OnceLock<[DeviceInfo; 1]> = OnceLock::new();
    static FEATURES: OnceLock<String> = OnceLock::new();
    guard(std::ptr::null_mut(), || {
        let devices = DEVICES.get_or_init(|| {
            [DeviceInfo {
                name: StrRef::from_static(cpu_name()),
                kind: DeviceKind::Cpu as u32,
                memory_bytes: total_memory(),
            }]
        });
        let features = FEATURES.get_or_init(|| match Isa::from_env() {
            Ok(i) => i.name().to_string(),
            Err(e) => format!("invalid ({e})"),
        });
        // Always usable, but ranked below any accelerator backend that can run here.
        let info = BackendInfo {
            score: 10,
            features: StrRef::from_static(features),
            reason: StrRef::from_static("the host CPU is always available"),
            devices: devices.as_ptr(),
            n_devices: devices.len(),
        };
        if let Some(o) = out.as_mut() {
            *o = info;
        }
        Ok(())
    })
}

fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

unsafe extern "C" fn create(opts: *const BackendOptions, out: *mut *mut c_void, err: *mut ErrorBuf) -> Status {
    guard(err, || {
        let opts = opts.as_ref().ok_or_else(|| PluginError::invalid("null options"))?;
        if opts.device != 0 {
            return Err(PluginError::invalid(format!("the cpu backend has one device (0), not {}", opts.device)));
        }
        let isa = Isa::from_env().map_err(PluginError::invalid)?;
        let threads = if opts.n_threads == 0 { default_threads() } else { opts.n_threads as usize };
        let ctx = CpuContext::new(threads, isa).map_err(PluginError::failed)?;
        *out = Box::into_raw(Box::new(ctx)) as *mut c_void;
        Ok(())
    })
}

unsafe extern "C" fn destroy(ctx: *mut c_void) {
    guard_value((), || {
        if !ctx.is_null() {
            drop(Box::from_raw(ctx as *mut CpuContext));
        }
    })
}

unsafe extern "C" fn buffer_from_host(
    _ctx: *mut c_void,
    ptr: *const u8,
    len: usize,
    out: *mut BufferHandle,
    err: *mut ErrorBuf,
) -> Status {
    guard(err, || {
        // Zero-copy when aligned for the widest element type; otherwise a private aligned copy.
        let buf = if len == 0 || ptr as usize % 8 == 0 {
            Buffer::Borrowed { ptr, len }
        } else {
            let mut a = AlignedBytes::zeroed(len).ok_or_else(|| PluginError {
                status: Status::OUT_OF_MEMORY,
                message: format!("cannot allocate {len} bytes"),
            })?;
            a.as_mut_slice().copy_from_slice(std::slice::from_raw_parts(ptr, len));
            Buffer::Owned(a)
        };
        *out = Box::into_raw(Box::new(buf)) as BufferHandle;
        Ok(())
    })
}

unsafe extern "C" fn buffer_alloc(_ctx: *mut c_void, len: usize, out: *mut BufferHandle, err: *mut ErrorBuf) -> Status {
    guard(err, || {
        let a = AlignedBytes::zeroed(len).ok_or_else(|| PluginError {
            status: Status::OUT_OF_MEMORY,
            message: format!("cannot allocate {len} bytes"),
        })?;
        *out = Box::into_raw(Box::new(Buffer::Owned(a))) as BufferHandle;
        Ok(())
    })
}

fn range_check(buf: &Buffer, offset: usize, len: usize) -> Result<(), PluginError> {
    if offset.checked_add(len).is_none_or(|e| e > buf.bytes().len()) {
        return Err(PluginError::invalid(format!(
            "range {offset}..{} outside a buffer of {} bytes",
            offset.saturating_add(len),
            buf.bytes().len()
        )));
    }
    Ok(())
}

unsafe extern "C" fn buffer_write(
    _ctx: *mut c_void,
    buf: BufferHandle,
    offset: usize,
    src: *const u8,
    len: usize,
    err: *mut ErrorBuf,
) -> Status {
    guard(err, || {
        let b = (buf as *mut Buffer).as_mut().ok_or_else(|| PluginError::invalid("null buffer"))?;
        range_check(b, offset, len)?;
        let dst = b.bytes_mut().ok_or_else(|| PluginError::invalid("cannot write into a borrowed host buffer"))?;
        dst[offset..offset + len].copy_from_slice(std::slice::from_raw_parts(src, len));
        Ok(())
    })
}

unsafe extern "C" fn buffer_read(
    _ctx: *mut c_void,
    buf: BufferHandle,
    offset: usize,
    dst: *mut u8,
    len: usize,
    err: *mut ErrorBuf,
) -> Status {
    guard(err, || {
        let b = (buf as *const Buffer).as_ref().ok_or_else(|| PluginError::invalid("null buffer"))?;
        range_check(b, offset, len)?;
        std::ptr::copy_nonoverlapping(b.bytes()[offset..].as_ptr(), dst, len);
        Ok(())
    })
}

unsafe extern "C" fn buffer_free(_ctx: *mut c_void, buf: BufferHandle) {
    guard_value((), || {
        if !buf.is_null() {
            drop(Box::from_raw(buf as *mut Buffer));
        }
    })
}

unsafe extern "C" fn supports_op(_ctx: *mut c_void, node: *const Node) -> u32 {
    guard_value(0, || node.as_ref().is_some_and(executor::supports) as u32)
}

unsafe extern "C" fn compute(ctx: *mut c_void, args: *const ComputeArgs, err: *mut ErrorBuf) -> Status {
    guard(err, || {
        let ctx = (ctx as *mut CpuContext).as_mut().ok_or_else(|| PluginError::invalid("null context"))?;
        let args = args.as_ref().ok_or_else(|| PluginError::invalid("null arguments"))?;
        executor::compute(ctx, args)
    })
}

static VTABLE: BackendVTable = BackendVTable {
    size: std::mem::size_of::<BackendVTable>(),
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
};

static ROOT: PluginRoot = PluginRoot {
    abi_major: ABI_MAJOR,
    abi_minor: ABI_MINOR,
    kind: PluginKind::Backend as u32,
    name: StrRef::from_static("cpu"),
    version: StrRef::from_static(env!("CARGO_PKG_VERSION")),
    description: StrRef::from_static("host CPU (AVX-512 / AVX2 / NEON / scalar kernels, chosen at run time)"),
    init,
    backend: &VTABLE,
    family: std::ptr::null(),
};

export_plugin!(ROOT);
