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

/// Zeroed bytes aligned to 64 (cache line / AVX-512 vector), so `f32` and `u32` views are always valid.
pub struct AlignedBytes {
    words: Vec<[u64; 8]>,
    len: usize,
}

impl AlignedBytes {
    pub fn zeroed(len: usize) -> Option<AlignedBytes> {
        let n = len.div_ceil(64);
        let mut words = Vec::new();
        words.try_reserve_exact(n).ok()?;
        // `vec![0; n]`-style zeroing lets the allocator hand out lazily-committed pages.
        words.resize(n, [0u64; 8]);
        Some(AlignedBytes { words, len })
    }

    pub fn as_slice(&self) -> &[u8] {
        unsafe { std::slice::from_raw_parts(self.words.as_ptr() as *const u8, self.len) }
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr() as *mut u8, self.len) }
    }
}

/// Views bytes as `f32` (they must be 4-byte aligned with a length multiple of 4).
pub fn as_f32(bytes: &[u8]) -> &[f32] {
    assert!(bytes.as_ptr() as usize % 4 == 0 && bytes.len() % 4 == 0, "misaligned f32 data");
    unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const f32, bytes.len() / 4) }
}

pub fn as_f32_mut(bytes: &mut [u8]) -> &mut [f32] {
    assert!(bytes.as_ptr() as usize % 4 == 0 && bytes.len() % 4 == 0, "misaligned f32 data");
    unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr() as *mut f32, bytes.len() / 4) }
}

pub fn as_i32(bytes: &[u8]) -> &[i32] {
    assert!(bytes.as_ptr() as usize % 4 == 0 && bytes.len() % 4 == 0, "misaligned i32 data");
    unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const i32, bytes.len() / 4) }
}

pub fn as_u16(bytes: &[u8]) -> &[u16] {
    assert!(bytes.as_ptr() as usize % 2 == 0 && bytes.len() % 2 == 0, "misaligned 16-bit data");
    unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const u16, bytes.len() / 2) }
}
