//! CPU device buffers: either owned, zeroed memory, or a borrowed view of host memory (zero-copy mmap).

/// A buffer the CPU backend hands out as an opaque handle.
pub enum Buffer {
    /// Owned, 64-byte aligned storage (KV cache, uploads).
    Owned(AlignedBytes),
    /// Host memory the host promised to keep alive and unchanged (weights from the mmap).
    Borrowed { ptr: *const u8, len: usize },
}

// Buffers are read concurrently by kernels; writes happen only through `&mut` on one thread.
unsafe impl Send for Buffer {}
unsafe impl Sync for Buffer {}

impl Buffer {
    pub fn bytes(&self) -> &[u8] {
        match self {
            Buffer::Owned(a) => a.as_slice(),
            Buffer::Borrowed { ptr, len } => unsafe { std::slice::from_raw_parts(*ptr, *len) },
        }
    }

    pub fn bytes_mut(&mut self) -> Option<&mut [u8]> {
        match self {
            Buffer::Owned(a) => Some(a.as_mut_slice()),
            Buffer::Borrowed { .. } => None,
        }
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
