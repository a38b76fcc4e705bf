//! The plugin as built with MLX: description, context, buffers and KV caches.

use std::ffi::CStr;
use std::sync::{Mutex, MutexGuard};

use mlxcel_plugin_api::*;

use crate::array::Array;
use crate::{ffi, MlxBackend};

/// Where the build found MLX.
const MLX_DIR: &str = env!("MLXCEL_MLX_DIR");

/// MLX keeps global state (streams, the scheduler, the allocator's caches); contexts on different
/// threads take turns through this lock for everything that builds or evaluates arrays.
static MLX: Mutex<()> = Mutex::new(());

pub(crate) fn mlx_lock() -> MutexGuard<'static, ()> {
    MLX.lock().unwrap_or_else(|e| e.into_inner())
}

fn version() -> String {
    // SAFETY: a static NUL-terminated string of libmlx.
    unsafe { CStr::from_ptr(ffi::mlxb_version()) }.to_string_lossy().into_owned()
}

fn default_device() -> &'static str {
    // SAFETY: a static NUL-terminated string of the shim.
    match unsafe { CStr::from_ptr(ffi::mlxb_default_device()) }.to_bytes() {
        b"gpu" => "gpu",
        _ => "cpu",
    }
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

impl Backend for MlxBackend {
    const NAME: &'static str = "mlx";
    const DESCRIPTION: &'static str = "MLX (libmlx): Metal on Apple silicon, CPU on Linux";
    type Context = MlxContext;

    fn describe() -> BackendDescription {
        let device = default_device();
        let (score, kind, why) = if device == "gpu" {
            (50, DeviceKind::Gpu, "MLX runs on the GPU here")
        } else {
            // Usable, but MLX's CPU kernels are slower than the cpu plugin's: picked only by name.
            (5, DeviceKind::Cpu, "MLX runs on the CPU here (ranked below the cpu backend; select with --backend mlx)")
        };
        BackendDescription {
            score,
            features: format!("mlx {} {device}", version()),
            reason: format!("{why}; libmlx from {MLX_DIR}"),
            devices: vec![DeviceDescription {
                name: format!("MLX {device}"),
                kind,
                memory_bytes: meminfo("MemTotal:"),
                free_memory_bytes: meminfo("MemAvailable:"),
            }],
        }
    }

    fn create(_n_threads: u32, device: u32) -> Result<MlxContext, PluginError> {
        if device != 0 {
            return Err(PluginError::invalid(format!("the mlx backend has one device (0), not {device}")));
        }
        Ok(MlxContext { in_flight: None })
    }
}

/// A context: MLX keeps its own threads and memory, so there is nothing per context yet.
pub struct MlxContext {
    /// The graph `submit` scheduled and `wait` has not finished.
    in_flight: Option<crate::executor::Launched>,
}

impl Drop for MlxContext {
    fn drop(&mut self) {
        // The scheduled evaluation may read host memory the host frees after this context: finish it.
        if let Some(l) = self.in_flight.take() {
            let _g = mlx_lock();
            let _ = l.finish();
        }
    }
}

/// A buffer the MLX backend hands out as an opaque handle.
pub enum MlxBuffer {
    /// Host memory the host keeps alive and unchanged (weights from the mmap). The MLX array is made at
    /// first use, with the dtype and shape of the graph node that reads it, as the bytes are stored:
    /// over the mapped bytes themselves where libmlx can alias host memory (the mlx-cpu build, and
    /// aligned tensors on Metal), so weights are not copied; else a copy.
    Host { ptr: *const u8, len: usize, array: Option<(DType, Vec<i64>, Array)> },
    /// An MLX array of `len` bytes (allocations, KV caches, uploads). Its dtype and shape are whatever
    /// its last writer left; readers view the bytes as they need.
    Device { array: Array, len: usize },
}

// SAFETY: the host pointer is only read, under the host's promise that it stays valid; arrays are
// reference-counted handles used under `mlx_lock`.
unsafe impl Send for MlxBuffer {}

impl MlxBuffer {
    pub fn byte_len(&self) -> usize {
        match self {
            MlxBuffer::Host { len, .. } | MlxBuffer::Device { len, .. } => *len,
        }
    }

    /// The buffer's bytes as an array of `dtype` and `shape` (which must span them exactly).
    pub fn typed(&mut self, dtype: DType, shape: &[i64]) -> Result<Array, String> {
        match self {
            MlxBuffer::Host { ptr, len, array } => {
                if let Some((d, s, a)) = array {
                    if *d == dtype && s == shape {
                        return a.share();
                    }
                }
                let bytes: &[u8] = if *len == 0 {
                    &[]
                } else {
                    // SAFETY: the host keeps `ptr` readable for `len` bytes until the buffer is freed.
                    unsafe { std::slice::from_raw_parts(*ptr, *len) }
                };
                // SAFETY: the host keeps the bytes alive and unchanged until `buffer_free`, which drops
                // this buffer and its array; arrays sharing its memory live only during one `compute`.
                let (a, _borrowed) = unsafe { Array::from_host_borrowed(bytes, dtype, shape)? };
                let shared = a.share()?;
                *array = Some((dtype, shape.to_vec(), a));
                Ok(shared)
            }
            MlxBuffer::Device { array, .. } => array.view(dtype, shape),
        }
    }
}

fn range_check(len: usize, offset: usize, n: usize) -> Result<(), PluginError> {
    if offset.checked_add(n).is_none_or(|e| e > len) {
        return Err(PluginError::invalid(format!(
            "range {offset}..{} outside a buffer of {len} bytes",
            offset.saturating_add(n)
        )));
    }
    Ok(())
}

fn failed(msg: String) -> PluginError {
    PluginError::failed(msg)
}

/// The dtype and bytes per value of a KV cache this backend keeps.
fn kv_dtype(desc: &KvCacheDesc) -> Result<DType, PluginError> {
    match DType::from_raw(desc.dtype) {
        d @ (DType::F32 | DType::F16 | DType::BF16) => Ok(d),
        d => {
            Err(PluginError::invalid(format!("the mlx backend keeps KV caches in f32, f16 or bf16, not {}", d.name())))
        }
    }
}

impl BackendContext for MlxContext {
    type Buffer = MlxBuffer;

    unsafe fn buffer_from_host(&mut self, ptr: *const u8, len: usize) -> Result<MlxBuffer, PluginError> {
        Ok(MlxBuffer::Host { ptr, len, array: None })
    }

    fn buffer_alloc(&mut self, len: usize) -> Result<MlxBuffer, PluginError> {
        let _g = mlx_lock();
        let array = Array::zeros(DType::U8, &[len as i64]).map_err(failed)?;
        Ok(MlxBuffer::Device { array, len })
    }

    fn buffer_write(&mut self, buf: &mut MlxBuffer, offset: usize, src: &[u8]) -> Result<(), PluginError> {
        range_check(buf.byte_len(), offset, src.len())?;
        let MlxBuffer::Device { array, len } = buf else {
            return Err(PluginError::invalid("cannot write into a borrowed host buffer"));
        };
        let _g = mlx_lock();
        // Arrays are immutable: the written buffer is a new array of the old bytes with the range replaced.
        let mut bytes = vec![0u8; *len];
        array.read(0, &mut bytes).map_err(failed)?;
        bytes[offset..offset + src.len()].copy_from_slice(src);
        *array = Array::from_host(&bytes, DType::U8, &[*len as i64]).map_err(failed)?;
        Ok(())
    }

    fn buffer_read(&mut self, buf: &MlxBuffer, offset: usize, dst: &mut [u8]) -> Result<(), PluginError> {
        range_check(buf.byte_len(), offset, dst.len())?;
        match buf {
            MlxBuffer::Host { ptr, .. } => {
                // SAFETY: in range of host memory the host keeps alive (checked above).
                dst.copy_from_slice(unsafe { std::slice::from_raw_parts(ptr.add(offset), dst.len()) });
                Ok(())
            }
            MlxBuffer::Device { array, .. } => {
                let _g = mlx_lock();
                array.read(offset, dst).map_err(failed)
            }
        }
    }

    fn supports(&self, node: &Node) -> bool {
        crate::executor::supports(node)
    }

    unsafe fn compute(&mut self, args: &ComputeArgs) -> Result<(), PluginError> {
        self.wait()?;
        let _g = mlx_lock();
        // SAFETY: the caller's contract on `args`.
        unsafe { crate::executor::compute(args) }
    }

    unsafe fn submit(&mut self, args: &ComputeArgs) -> Result<(), PluginError> {
        self.wait()?;
        let _g = mlx_lock();
        // SAFETY: the caller's contract on `args` (valid until `wait`).
        self.in_flight = Some(unsafe { crate::executor::launch(args) }?);
        Ok(())
    }

    fn wait(&mut self) -> Result<(), PluginError> {
        match self.in_flight.take() {
            Some(l) => {
                let _g = mlx_lock();
                l.finish()
            }
            None => Ok(()),
        }
    }

    fn kv_alloc(&mut self, desc: &KvCacheDesc) -> Result<(MlxBuffer, u64), PluginError> {
        let dtype = kv_dtype(desc)?;
        let slots = desc.num_blocks as i64 * desc.block_size as i64;
        let row = desc.n_kv_heads as i64 * desc.head_dim as i64;
        let len = (slots * row) as usize * dtype.size();
        let _g = mlx_lock();
        // Layout: [slots, n_kv_heads * head_dim] in `dtype`, slot = block * block_size + offset.
        let array = Array::zeros(dtype, &[slots, row]).map_err(failed)?;
        Ok((MlxBuffer::Device { array, len }, len as u64))
    }

    fn copy_blocks(
        &mut self,
        buf: &mut MlxBuffer,
        desc: &KvCacheDesc,
        copies: &[BlockCopy],
    ) -> Result<(), PluginError> {
        let dtype = kv_dtype(desc)?;
        let slots = desc.num_blocks as i64 * desc.block_size as i64;
        let row = desc.n_kv_heads as i64 * desc.head_dim as i64;
        if buf.byte_len() != (slots * row) as usize * dtype.size() {
            return Err(PluginError::invalid("not a KV cache of this description"));
        }
        let _g = mlx_lock();
        let mut cache = buf.typed(dtype, &[slots, row]).map_err(failed)?;
        for c in copies {
            if c.src >= desc.num_blocks || c.dst >= desc.num_blocks {
                return Err(PluginError::invalid(format!(
                    "block copy {} -> {} outside a cache of {} blocks",
                    c.src, c.dst, desc.num_blocks
                )));
            }
            // SAFETY: a live handle.
            cache = crate::array::make(|o| unsafe {
                ffi::mlxb_copy_block(cache.raw(), c.src as i64, c.dst as i64, desc.block_size as i64, o)
            })
            .map_err(failed)?;
        }
        Array::eval(&[&cache]).map_err(failed)?;
        let len = buf.byte_len();
        *buf = MlxBuffer::Device { array: cache, len };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Weights bound from host memory are read in place where libmlx can alias it (the mlx-cpu build
    /// does), and still read right where it cannot (a misaligned tensor is copied).
    #[test]
    fn host_weights_are_read_in_place_without_a_copy() {
        let _g = mlx_lock();
        let values: Vec<f32> = (0..12).map(|i| i as f32 * 0.5 - 1.0).collect();
        // SAFETY: the floats seen as their (f32-aligned) bytes; `values` outlives every array below.
        let bytes: &[u8] = unsafe { std::slice::from_raw_parts(values.as_ptr() as *const u8, values.len() * 4) };
        // SAFETY: as above.
        let (a, borrowed) = unsafe { Array::from_host_borrowed(bytes, DType::F32, &[3, 4]) }.unwrap();
        if default_device() == "cpu" {
            assert!(borrowed, "a CPU libmlx should alias aligned host memory");
        }
        let same = a.f32().unwrap();
        let mut back = vec![0u8; bytes.len()];
        same.read(0, &mut back).unwrap();
        assert_eq!(back, bytes);

        // Misaligned for f32: a copy, with the same values.
        let mut shifted = vec![0u8; bytes.len() + 1];
        shifted[1..].copy_from_slice(bytes);
        // SAFETY: as above.
        let (b, borrowed) = unsafe { Array::from_host_borrowed(&shifted[1..], DType::F32, &[3, 4]) }.unwrap();
        assert!(!borrowed);
        let mut back = vec![0u8; bytes.len()];
        b.read(0, &mut back).unwrap();
        assert_eq!(back, bytes);

        // An op over an aliased weight leaves the host bytes as they were (MLX never donates memory it
        // does not own to an op's output).
        let mut buf = MlxBuffer::Host { ptr: bytes.as_ptr(), len: bytes.len(), array: None };
        let w = buf.typed(DType::F32, &[3, 4]).unwrap();
        // SAFETY: a live handle.
        let doubled = crate::array::make(|o| unsafe { ffi::mlxb_unary(ffi::UN_SCALE, w.raw(), 2.0, o) }).unwrap();
        drop(w);
        drop(buf);
        let mut out = vec![0u8; bytes.len()];
        doubled.read(0, &mut out).unwrap();
        let got: Vec<f32> = out.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        assert_eq!(got, values.iter().map(|v| v * 2.0).collect::<Vec<_>>());
        assert_eq!(values, (0..12).map(|i| i as f32 * 0.5 - 1.0).collect::<Vec<_>>());
    }
}
