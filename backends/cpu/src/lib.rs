//! The CPU backend plugin: executes mlxcel op graphs on the host CPU.
//!
//! [`CpuBackend`] implements the plugin API's [`Backend`] trait and `export_backend!` generates the C
//! entry points; [`executor`] runs graphs, [`buffer`] holds memory, and kernels live in [`kernels`], one
//! file per kind of op, each compiled per SIMD path ([`isa`]).

pub mod buffer;
pub mod executor;
pub mod isa;
pub mod kernels;
pub mod pool;
pub mod profile;

use std::sync::OnceLock;

use mlxcel_plugin_api::*;

use buffer::{AlignedBytes, Buffer};
use executor::CpuContext;
use isa::Isa;

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

/// A `/proc/meminfo` field in bytes (0 where unknown).
fn meminfo(field: &str) -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The CPU backend plugin.
pub struct CpuBackend;

impl Backend for CpuBackend {
    const NAME: &'static str = "cpu";
    const DESCRIPTION: &'static str = "host CPU (AVX-512 / AVX2 / NEON / scalar kernels, chosen at run time)";
    type Context = CpuContext;

    fn describe() -> BackendDescription {
        let features = match Isa::from_env() {
            Ok(i) => i.name().to_string(),
            Err(e) => format!("invalid ({e})"),
        };
        // Always usable, but ranked below any accelerator backend that can run here.
        BackendDescription {
            score: 10,
            features,
            reason: "the host CPU is always available".into(),
            devices: vec![DeviceDescription {
                name: cpu_name().to_string(),
                kind: DeviceKind::Cpu,
                memory_bytes: meminfo("MemTotal:"),
                free_memory_bytes: meminfo("MemAvailable:"),
            }],
        }
    }

    fn create(n_threads: u32, device: u32) -> Result<CpuContext, PluginError> {
        if device != 0 {
            return Err(PluginError::invalid(format!("the cpu backend has one device (0), not {device}")));
        }
        let isa = Isa::from_env().map_err(PluginError::invalid)?;
        let threads = if n_threads == 0 { default_threads() } else { n_threads as usize };
        CpuContext::new(threads, isa).map_err(PluginError::failed)
    }
}

fn out_of_memory(len: usize) -> PluginError {
    PluginError { status: Status::OUT_OF_MEMORY, message: format!("cannot allocate {len} bytes") }
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

/// Bytes per cache slot of a layer, or an error for a cache type the CPU backend does not keep.
fn kv_slot_bytes(desc: &KvCacheDesc) -> Result<usize, PluginError> {
    let dtype = DType::from_raw(desc.dtype);
    let elem = kernels::kv_elem::elem_bytes(dtype).ok_or_else(|| {
        PluginError::invalid(format!("the cpu backend keeps KV caches in f32, f16 or bf16, not {}", dtype.name()))
    })?;
    Ok(desc.n_kv_heads as usize * desc.head_dim as usize * elem)
}

impl BackendContext for CpuContext {
    type Buffer = Buffer;

    unsafe fn buffer_from_host(&mut self, ptr: *const u8, len: usize) -> Result<Buffer, PluginError> {
        // Zero-copy when aligned for the widest element type; otherwise a private aligned copy.
        if len == 0 || (ptr as usize).is_multiple_of(8) {
            // SAFETY: the host keeps `ptr` readable and unchanged for the buffer's life (trait contract).
            return Ok(unsafe { Buffer::borrowed(ptr, len) });
        }
        let mut a = AlignedBytes::zeroed(len).ok_or_else(|| out_of_memory(len))?;
        // SAFETY: the host keeps `ptr` readable for `len` bytes (trait contract).
        a.as_mut_slice().copy_from_slice(unsafe { std::slice::from_raw_parts(ptr, len) });
        Ok(Buffer::owned(a))
    }

    fn buffer_alloc(&mut self, len: usize) -> Result<Buffer, PluginError> {
        Ok(Buffer::owned(AlignedBytes::zeroed(len).ok_or_else(|| out_of_memory(len))?))
    }

    fn buffer_write(&mut self, buf: &mut Buffer, offset: usize, src: &[u8]) -> Result<(), PluginError> {
        range_check(buf, offset, src.len())?;
        let dst = buf.bytes_mut().ok_or_else(|| PluginError::invalid("cannot write into a borrowed host buffer"))?;
        dst[offset..offset + src.len()].copy_from_slice(src);
        Ok(())
    }

    fn buffer_read(&mut self, buf: &Buffer, offset: usize, dst: &mut [u8]) -> Result<(), PluginError> {
        range_check(buf, offset, dst.len())?;
        dst.copy_from_slice(&buf.bytes()[offset..offset + dst.len()]);
        Ok(())
    }

    fn supports(&self, node: &Node) -> bool {
        executor::supports(node)
    }

    unsafe fn compute(&mut self, args: &ComputeArgs) -> Result<(), PluginError> {
        executor::compute(self, args)
    }

    fn kv_alloc(&mut self, desc: &KvCacheDesc) -> Result<(Buffer, u64), PluginError> {
        let bytes = desc.num_blocks as usize * desc.block_size as usize * kv_slot_bytes(desc)?;
        Ok((self.buffer_alloc(bytes)?, bytes as u64))
    }

    fn copy_blocks(&mut self, buf: &mut Buffer, desc: &KvCacheDesc, copies: &[BlockCopy]) -> Result<(), PluginError> {
        let block_bytes = desc.block_size as usize * kv_slot_bytes(desc)?;
        let bytes = buf.bytes_mut().ok_or_else(|| PluginError::invalid("not a KV cache buffer"))?;
        let n_blocks = bytes.len() / block_bytes.max(1);
        for c in copies {
            let (s, d) = (c.src as usize, c.dst as usize);
            if s >= n_blocks || d >= n_blocks {
                return Err(PluginError::invalid(format!(
                    "block copy {s} -> {d} outside a cache of {n_blocks} blocks"
                )));
            }
            bytes.copy_within(s * block_bytes..(s + 1) * block_bytes, d * block_bytes);
        }
        Ok(())
    }
}

export_backend!(CpuBackend);
