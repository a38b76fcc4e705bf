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
                self.derived.take();
                Some(a.as_mut_slice())
            }
            Memory::Borrowed { .. } => None,
        }
    }

    /// The `T` that `build` derives from this buffer's bytes, built once by the first caller (others
    /// wait for it; `None` where a value of another type was derived first), for a layout that
    /// serves the kernels' reads of the bytes from then on: once it is built, a borrowed buffer's
    /// pages are dropped from this process where they are a shared mapping (a checkpoint's mmap) —
    /// a reader that still wants them faults the same bytes back in.
    pub fn derived_in_place_of_bytes<T: Any + Send + Sync>(&self, build: impl FnOnce(&[u8]) -> T) -> Option<&T> {
        self.derived
            .get_or_init(|| {
                let value = Box::new(build(self.bytes()));
                if let Memory::Borrowed { ptr, len } = self.memory {
                    release_shared_pages(ptr, len);
                }
                value
            })
            .downcast_ref::<T>()
    }

    /// Whether anything was derived from the bytes.
    pub fn has_derived(&self) -> bool {
        self.derived.get().is_some()
    }

    /// What was derived from the bytes, if it is a `T` (never builds anything).
    pub fn derived_if_built<T: Any + Send + Sync>(&self) -> Option<&T> {
        self.derived.get()?.downcast_ref::<T>()
    }
}

/// Drops this process's page-table entries for the whole pages of `ptr..ptr + len` where they lie in
/// one shared mapping (`/proc/self/maps`: a file, as the checkpoint's mmap, or shared memory), so
/// they stop counting as its resident memory: the mapping's object keeps the bytes, and a later
/// read maps them again. Private or anonymous memory, whose pages `MADV_DONTNEED` would discard, is
/// left alone.
#[cfg(target_os = "linux")]
fn release_shared_pages(ptr: *const u8, len: usize) {
    let (start, end) = (ptr as usize, ptr as usize + len);
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else { return };
    let shared = maps.lines().any(|line| {
        // `lo-hi perms offset dev inode [path]`
        let mut f = line.split_ascii_whitespace();
        let (Some(range), Some(perms), Some(_), Some(_), Some(inode)) =
            (f.next(), f.next(), f.next(), f.next(), f.next())
        else {
            return false;
        };
        let Some((lo, hi)) = range.split_once('-') else { return false };
        let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16)) else { return false };
        lo <= start && end <= hi && perms.ends_with('s') && inode != "0"
    });
    // SAFETY: `sysconf` has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
    let (first, last) = (start.next_multiple_of(page), end / page * page);
    if shared && first < last {
        // SAFETY: whole pages of a shared mapping: after `MADV_DONTNEED` a read maps its object's
        // (unchanged) bytes again, so the memory's contents stay what the host promised.
        unsafe { libc::madvise(first as *mut libc::c_void, last - first, libc::MADV_DONTNEED) };
    }
}

#[cfg(not(target_os = "linux"))]
fn release_shared_pages(_: *const u8, _: usize) {}

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

pub fn as_u32(bytes: &[u8]) -> &[u32] {
    if bytes.is_empty() {
        return &[];
    }
    assert!((bytes.as_ptr() as usize).is_multiple_of(4) && bytes.len().is_multiple_of(4), "misaligned u32 data");
    unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const u32, bytes.len() / 4) }
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
        assert!(!buf.has_derived() && buf.derived_if_built::<u32>().is_none());
        assert_eq!(buf.derived_in_place_of_bytes(sum), Some(&0));
        assert_eq!(buf.derived_in_place_of_bytes(sum), Some(&0));
        assert_eq!(builds.get(), 1);
        assert_eq!(buf.derived_if_built::<u32>(), Some(&0));
        assert_eq!(buf.derived_in_place_of_bytes(|_| 1u64), None, "another type was derived first");
        assert_eq!(buf.derived_if_built::<u64>(), None);
        buf.bytes_mut().unwrap().copy_from_slice(&[1, 2, 3, 4]);
        assert!(!buf.has_derived());
        assert_eq!(buf.derived_in_place_of_bytes(sum), Some(&10));
        assert_eq!(builds.get(), 2);
        let host = [7u8; 3];
        // SAFETY: `host` outlives `view`.
        let mut view = unsafe { Buffer::borrowed(host.as_ptr(), host.len()) };
        assert!(view.bytes_mut().is_none());
        assert_eq!(view.derived_in_place_of_bytes(sum), Some(&21));
    }

    /// A borrowed shared file mapping gives its resident pages back once a layout in place of its
    /// bytes is built, and still reads the same bytes; anonymous memory keeps its pages (and
    /// contents: `MADV_DONTNEED` would have zeroed them).
    #[cfg(target_os = "linux")]
    #[test]
    fn a_layout_in_place_of_a_file_mapping_releases_its_pages() {
        use std::io::Write;
        use std::os::fd::AsRawFd;
        let len = 64 * 4096;
        let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        let path = std::env::temp_dir().join(format!("mlxcel-buffer-test-{}", std::process::id()));
        std::fs::File::create(&path).unwrap().write_all(&data).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        // SAFETY: a read-only shared mapping of the whole file, unmapped below.
        let map =
            unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ, libc::MAP_SHARED, file.as_raw_fd(), 0) };
        assert_ne!(map, libc::MAP_FAILED);
        let resident_kb = |addr: usize| {
            let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
            let mut lines = smaps.lines().skip_while(|l| !l.starts_with(&format!("{addr:x}-")));
            lines
                .find_map(|l| l.strip_prefix("Rss:"))
                .map(|v| v.trim().trim_end_matches(" kB").parse::<usize>().unwrap())
        };
        // SAFETY: the mapping outlives `buf`.
        let buf = unsafe { Buffer::borrowed(map as *const u8, len) };
        let sum = buf.bytes().iter().map(|&b| b as u64).sum::<u64>();
        assert_eq!(resident_kb(map as usize), Some(len / 1024));
        assert_eq!(buf.derived_in_place_of_bytes(|b| b.len()), Some(&len));
        assert_eq!(resident_kb(map as usize), Some(0), "the mapping's pages are released");
        assert_eq!(buf.bytes(), &data[..], "and read back the same");
        assert_eq!(buf.bytes().iter().map(|&b| b as u64).sum::<u64>(), sum);
        // SAFETY: `buf` is not used after this.
        drop(buf);
        unsafe { libc::munmap(map, len) };
        std::fs::remove_file(&path).unwrap();

        let anon = data.clone();
        // SAFETY: `anon` outlives `view`.
        let view = unsafe { Buffer::borrowed(anon.as_ptr(), anon.len()) };
        assert_eq!(view.derived_in_place_of_bytes(|b| b.len()), Some(&len));
        assert_eq!(view.bytes(), &data[..], "anonymous memory keeps its contents");
    }
}
