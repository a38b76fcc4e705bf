//! Plain C-compatible building blocks: borrowed strings and slices, status codes, error buffers, and the
//! panic guard every exported function runs inside.

use std::panic::{catch_unwind, AssertUnwindSafe};

/// A borrowed UTF-8 string: pointer and length, not NUL-terminated. The owner is stated where it is used.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct StrRef {
    pub ptr: *const u8,
    pub len: usize,
}

// SAFETY: a borrowed, immutable view; its owner is stated where it is used.
unsafe impl Sync for StrRef {}
// SAFETY: as above.
unsafe impl Send for StrRef {}

impl StrRef {
    /// A reference to a `'static` string (usable in statics).
    pub const fn from_static(s: &'static str) -> Self {
        StrRef { ptr: s.as_ptr(), len: s.len() }
    }

    /// A reference to any string; the caller keeps `s` alive while the reference is used.
    pub fn new(s: &str) -> Self {
        StrRef { ptr: s.as_ptr(), len: s.len() }
    }

    pub const fn empty() -> Self {
        StrRef { ptr: std::ptr::null(), len: 0 }
    }

    /// # Safety
    /// `ptr..ptr+len` must be valid UTF-8 that outlives `'a`.
    pub unsafe fn as_str<'a>(&self) -> &'a str {
        if self.ptr.is_null() || self.len == 0 {
            return "";
        }
        // SAFETY: the caller guarantees `ptr..ptr+len` is readable for `'a`.
        let bytes = unsafe { std::slice::from_raw_parts(self.ptr, self.len) };
        std::str::from_utf8(bytes).unwrap_or("<invalid utf-8>")
    }
}

/// Result of every fallible ABI call.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Status(pub i32);

impl Status {
    pub const OK: Status = Status(0);
    /// Bad argument or unsupported request; the message says which.
    pub const INVALID: Status = Status(1);
    /// Out of memory on the device.
    pub const OUT_OF_MEMORY: Status = Status(2);
    /// The plugin panicked; the panic was caught at the boundary.
    pub const PANIC: Status = Status(3);
    /// Anything else.
    pub const FAILED: Status = Status(4);

    pub fn is_ok(self) -> bool {
        self.0 == 0
    }
}

/// A caller-owned buffer the callee writes an error message into (truncated to `cap`).
#[repr(C)]
pub struct ErrorBuf {
    pub ptr: *mut u8,
    pub cap: usize,
    pub len: usize,
}

impl ErrorBuf {
    /// Writes `msg` (truncated at a char boundary) into the buffer. Null buffers are ignored.
    ///
    /// # Safety
    /// `this` is null or points to a valid `ErrorBuf` whose `ptr` has `cap` writable bytes.
    pub unsafe fn write(this: *mut ErrorBuf, msg: &str) {
        // SAFETY: `this` is null or valid (caller's contract).
        let Some(buf) = (unsafe { this.as_mut() }) else { return };
        if buf.ptr.is_null() {
            return;
        }
        let mut n = msg.len().min(buf.cap);
        while n > 0 && !msg.is_char_boundary(n) {
            n -= 1;
        }
        // SAFETY: `buf.ptr` has `cap >= n` writable bytes (caller's contract).
        unsafe { std::ptr::copy_nonoverlapping(msg.as_ptr(), buf.ptr, n) };
        buf.len = n;
    }
}

/// An owned message buffer on the caller side, to pass as `*mut ErrorBuf`.
pub struct ErrorMessage {
    storage: Vec<u8>,
    buf: ErrorBuf,
}

impl Default for ErrorMessage {
    fn default() -> Self {
        Self::new()
    }
}

impl ErrorMessage {
    pub fn new() -> Self {
        let mut storage = vec![0u8; 4096];
        let buf = ErrorBuf { ptr: storage.as_mut_ptr(), cap: storage.len(), len: 0 };
        ErrorMessage { storage, buf }
    }

    pub fn as_ptr(&mut self) -> *mut ErrorBuf {
        self.buf.len = 0;
        self.buf.ptr = self.storage.as_mut_ptr();
        &mut self.buf
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.storage[..self.buf.len.min(self.storage.len())]).into_owned()
    }
}

/// A failure inside a plugin: a status and a message.
#[derive(Debug, Clone)]
pub struct PluginError {
    pub status: Status,
    pub message: String,
}

impl PluginError {
    pub fn invalid(message: impl Into<String>) -> Self {
        PluginError { status: Status::INVALID, message: message.into() }
    }
    pub fn failed(message: impl Into<String>) -> Self {
        PluginError { status: Status::FAILED, message: message.into() }
    }
}

impl std::fmt::Display for PluginError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for PluginError {}

/// Runs `f` for an exported function: a returned error or a panic becomes a status plus message in
/// `err`, so nothing unwinds across the boundary.
///
/// # Safety
/// `err` is null or points to a valid [`ErrorBuf`] whose `ptr` has `cap` writable bytes (what the
/// caller of every exported function passes).
pub unsafe fn guard(err: *mut ErrorBuf, f: impl FnOnce() -> Result<(), PluginError>) -> Status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => Status::OK,
        Ok(Err(e)) => {
            // SAFETY: `err` is null or valid (this function's contract).
            unsafe { ErrorBuf::write(err, &e.message) };
            if e.status.is_ok() {
                Status::FAILED
            } else {
                e.status
            }
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            // SAFETY: as above.
            unsafe { ErrorBuf::write(err, &format!("plugin panicked: {what}")) };
            Status::PANIC
        }
    }
}

/// Like [`guard`] for functions that cannot report errors: a panic yields `fallback`.
pub fn guard_value<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(fallback)
}

/// A `#[repr(C)]` struct that crosses the boundary with its own byte size in its first field, so that
/// either side can be a newer minor than the other: a reader takes the prefix both know and sees zeros
/// for the rest; a writer fills only what the reader has room for.
///
/// # Safety
/// The implementing type is `#[repr(C)]`, its first field is `size: usize`, and every field is valid when
/// zero-filled (integers, floats, raw pointers, `Option` of function pointers).
pub unsafe trait Versioned: Copy {
    /// An all-zero value with `size` set to this build's `size_of::<Self>()`.
    fn zeroed() -> Self {
        // SAFETY: the trait's contract says all-zero bytes are a valid value.
        let mut v: Self = unsafe { std::mem::zeroed() };
        // SAFETY: the first field is a `usize` (trait contract).
        unsafe { *(&mut v as *mut Self as *mut usize) = std::mem::size_of::<Self>() };
        v
    }
}

/// Reads a struct the other side wrote: its first `(*ptr).size` bytes (at most ours), zeros after.
/// Returns `None` for a null pointer or a size too small to hold even the `size` field.
///
/// # Safety
/// `ptr` is null or points to a struct of the other side's version whose `size` bytes are readable.
pub unsafe fn read_versioned<T: Versioned>(ptr: *const T) -> Option<T> {
    if ptr.is_null() {
        return None;
    }
    // SAFETY: the first field of every `Versioned` struct is its size (caller's contract).
    let theirs = unsafe { *(ptr as *const usize) };
    if theirs < std::mem::size_of::<usize>() {
        return None;
    }
    // SAFETY: the writer's struct has `theirs` readable bytes (caller's contract).
    Some(unsafe { read_prefix(ptr as *const u8, theirs) })
}

/// Reads element `i` of an array the other side laid out with `stride` bytes per element: the prefix
/// both sides know, zeros after. Used for arrays of plain structs (nodes, layers, devices), whose element
/// size the enclosing struct states.
///
/// # Safety
/// `base` points to at least `i + 1` elements of `stride` bytes each.
pub unsafe fn read_element<T: Copy>(base: *const u8, stride: usize, i: usize) -> T {
    // SAFETY: the caller guarantees the element is readable for `stride` bytes.
    unsafe { read_prefix(base.add(i * stride), stride) }
}

/// Reads an array of versioned structs the other side wrote: each element's stride is the `size` of
/// the first one (all elements of one array have the writer's layout).
///
/// # Safety
/// `ptr` is null or points to `n` elements of the writer's layout.
pub unsafe fn read_versioned_array<T: Versioned>(ptr: *const T, n: usize) -> Vec<T> {
    if ptr.is_null() || n == 0 {
        return Vec::new();
    }
    // SAFETY: the first element starts with its size (caller's contract).
    let stride = unsafe { *(ptr as *const usize) };
    // SAFETY: `n` elements of `stride` bytes (caller's contract).
    (0..n).map(|i| unsafe { read_element(ptr as *const u8, stride, i) }).collect()
}

/// Copies `min(len, size_of::<T>())` bytes from `src` into a zero-filled `T`.
///
/// # Safety
/// `src` is readable for `len` bytes and all-zero bytes are a valid `T`.
unsafe fn read_prefix<T: Copy>(src: *const u8, len: usize) -> T {
    // SAFETY: zero bytes are valid for the plain `repr(C)` types this is used with (caller's contract).
    let mut v: T = unsafe { std::mem::zeroed() };
    let n = len.min(std::mem::size_of::<T>());
    // SAFETY: `src` has `len >= n` readable bytes; `v` has `size_of::<T>() >= n` writable bytes.
    unsafe { std::ptr::copy_nonoverlapping(src, &mut v as *mut T as *mut u8, n) };
    v
}

/// Writes `value` into a struct the caller sized (its `size` field, set before the call, says how much
/// room it has): only the prefix the caller knows is written, and `size` then tells the caller how many
/// bytes were filled. A null `out` is ignored.
///
/// # Safety
/// `out` is null or points to a caller struct whose `size` field states how many bytes are writable.
pub unsafe fn write_versioned<T: Versioned>(out: *mut T, value: &T) {
    if out.is_null() {
        return;
    }
    // SAFETY: the first field is the caller's size (caller's contract).
    let room = unsafe { *(out as *const usize) };
    let n = room.min(std::mem::size_of::<T>());
    // SAFETY: the caller has `room >= n` writable bytes; `value` has `size_of::<T>() >= n`.
    unsafe {
        std::ptr::copy_nonoverlapping(value as *const T as *const u8, out as *mut u8, n);
        if n >= std::mem::size_of::<usize>() {
            *(out as *mut usize) = n;
        }
    }
}

/// Borrows a C array as a slice (empty when null).
///
/// # Safety
/// `ptr` is null or valid for `len` elements for `'a`.
pub unsafe fn slice_from<'a, T>(ptr: *const T, len: usize) -> &'a [T] {
    if ptr.is_null() || len == 0 {
        &[]
    } else {
        // SAFETY: non-null and valid for `len` elements (caller's contract).
        unsafe { std::slice::from_raw_parts(ptr, len) }
    }
}
