//! CPU device buffers: either owned, zeroed memory, or a borrowed view of host memory (zero-copy mmap).

use std::any::Any;
use std::sync::OnceLock;

/// A buffer the CPU backend hands out as an opaque handle.
pub struct Buffer {
    memory: Memory,
    /// A layout a kernel derived from the bytes (the panel kernel's order of a weight: see
    /// `kernels::panel_pack`), built by the first kernel that asks and dropped with the buffer or at
    /// its next write.
    derived: OnceLock<Box<dyn Any + Send + Sync>>,
}

enum Memory {
    /// Owned, 16-byte aligned storage (KV cache, uploads).
    Owned(AlignedBytes),
    /// Host memory the host promised to keep alive and unchanged (weights from the mmap).
    Borrowed { ptr: *const u8, len: usize },
}

// Buffers are read concurrently by kernels; writes happen only through `&mut` on one thread.
unsafe impl Send for Buffer {}
unsafe impl Sync for Buffer {}

impl Buffer {
    pub fn owned(bytes: AlignedBytes) -> Buffer {
        Buffer { memory: Memory::Owned(bytes), derived: OnceLock::new() }
    }

    /// A view of host memory.
    ///
    /// # Safety
    /// `ptr` must stay readable for `len` bytes, unchanged, for the buffer's life.
    pub unsafe fn borrowed(ptr: *const u8, len: usize) -> Buffer {
        Buffer { memory: Memory::Borrowed { ptr, len }, derived: OnceLock::new() }
    }

    pub fn bytes(&self) -> &[u8] {
        match &self.memory {
            Memory::Owned(a) => a.as_slice(),
            Memory::Borrowed { ptr, len } => unsafe { std::slice::from_raw_parts(*ptr, *len) },
        }
    }

    /// The bytes, for writing (owned buffers only); whatever was derived from them is dropped.
    pub fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        match &mut self.memory {
            Memory::Owned(a) => {
                if self.derived.get().is_some() {
                    self.derived = OnceLock::new();
                }
                Some(a.as_mut_slice())
            }
            Memory::Borrowed { .. } => None,
        }
    }

    /// The `T` that `build` derives from this buffer's bytes, built once by the first caller (others
    /// wait for it); `None` where a value of another type was derived first.
    pub fn derived<T: Any + Send + Sync>(&self, build: impl FnOnce(&[u8]) -> T) -> Option<&T> {
        self.derived.get_or_init(|| Box::new(build(self.bytes()))).downcast_ref::<T>()
    }
}

/// Zeroed bytes aligned to 16, so `f32` and `u32` views are always valid (kernels use unaligned
/// loads). Allocated with `alloc_zeroed` at an alignment `calloc` serves, so untouched pages (most of
/// a fresh KV cache) cost no resident memory; a larger alignment would make std zero every page.
pub struct AlignedBytes {
    ptr: *mut u8,
    len: usize,
}

const ALIGN: usize = 16;

impl AlignedBytes {
    pub fn zeroed(len: usize) -> Option<AlignedBytes> {
        if len == 0 {
            return Some(AlignedBytes { ptr: std::ptr::null_mut(), len: 0 });
        }
        let layout = std::alloc::Layout::from_size_align(len, ALIGN).ok()?;
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        (!ptr.is_null()).then_some(AlignedBytes { ptr, len })
    }

    pub fn as_slice(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        if self.len == 0 {
            return &mut [];
        }
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for AlignedBytes {
    fn drop(&mut self) {
        if self.len > 0 {
            unsafe { std::alloc::dealloc(self.ptr, std::alloc::Layout::from_size_align_unchecked(self.len, ALIGN)) };
        }
    }
}

/// Views bytes as `f32` (they must be 4-byte aligned with a length multiple of 4). Empty views are
/// accepted at any address: an empty host tensor (a prefill chunk that asks for no logits) may come
/// from a pointer with no alignment.
pub fn as_f32(bytes: &[u8]) -> &[f32] {
    if bytes.is_empty() {
        return &[];
    }
    assert!((bytes.as_ptr() as usize).is_multiple_of(4) && bytes.len().is_multiple_of(4), "misaligned f32 data");
    unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const f32, bytes.len() / 4) }
}

pub fn as_f32_mut(bytes: &mut [u8]) -> &mut [f32] {
    if bytes.is_empty() {
        return &mut [];
    }
    assert!((bytes.as_ptr() as usize).is_multiple_of(4) && bytes.len().is_multiple_of(4), "misaligned f32 data");
    unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr() as *mut f32, bytes.len() / 4) }
}

pub fn as_i32(bytes: &[u8]) -> &[i32] {
    if bytes.is_empty() {
        return &[];
    }
    assert!((bytes.as_ptr() as usize).is_multiple_of(4) && bytes.len().is_multiple_of(4), "misaligned i32 data");
    unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const i32, bytes.len() / 4) }
}

pub fn as_u16(bytes: &[u8]) -> &[u16] {
    if bytes.is_empty() {
        return &[];
    }
    assert!((bytes.as_ptr() as usize).is_multiple_of(2) && bytes.len().is_multiple_of(2), "misaligned 16-bit data");
    unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const u16, bytes.len() / 2) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A derived layout is built once, by the first caller, from the buffer's bytes; a write drops it
    /// (the next caller builds it from the new bytes); a value of another type is not returned.
    #[test]
    fn derived_layouts_are_built_once_and_dropped_by_a_write() {
        let mut buf = Buffer::owned(AlignedBytes::zeroed(4).unwrap());
        let builds = std::cell::Cell::new(0);
        let sum = |b: &[u8]| {
            builds.set(builds.get() + 1);
            b.iter().map(|&x| x as u32).sum::<u32>()
        };
        assert_eq!(buf.derived(sum), Some(&0));
        assert_eq!(buf.derived(sum), Some(&0));
        assert_eq!(builds.get(), 1);
        assert_eq!(buf.derived(|_| 1u64), None, "another type was derived first");
        buf.bytes_mut().unwrap().copy_from_slice(&[1, 2, 3, 4]);
        assert_eq!(buf.derived(sum), Some(&10));
        assert_eq!(builds.get(), 2);
        let host = [7u8; 3];
        // SAFETY: `host` outlives `view`.
        let mut view = unsafe { Buffer::borrowed(host.as_ptr(), host.len()) };
        assert!(view.bytes_mut().is_none());
        assert_eq!(view.derived(sum), Some(&21));
    }
}
