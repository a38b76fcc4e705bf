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

unsafe impl Sync for StrRef {}
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
        let bytes = std::slice::from_raw_parts(self.ptr, self.len);
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
        let Some(buf) = this.as_mut() else { return };
        if buf.ptr.is_null() {
            return;
        }
        let mut n = msg.len().min(buf.cap);
        while n > 0 && !msg.is_char_boundary(n) {
            n -= 1;
        }
        std::ptr::copy_nonoverlapping(msg.as_ptr(), buf.ptr, n);
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
pub fn guard(err: *mut ErrorBuf, f: impl FnOnce() -> Result<(), PluginError>) -> Status {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => Status::OK,
        Ok(Err(e)) => {
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
            unsafe { ErrorBuf::write(err, &format!("plugin panicked: {what}")) };
            Status::PANIC
        }
    }
}

/// Like [`guard`] for functions that cannot report errors: a panic yields `fallback`.
pub fn guard_value<T>(fallback: T, f: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(fallback)
}

/// Borrows a C array as a slice (empty when null).
///
/// # Safety
/// `ptr` is null or valid for `len` elements for `'a`.
pub unsafe fn slice_from<'a, T>(ptr: *const T, len: usize) -> &'a [T] {
    if ptr.is_null() || len == 0 {
        &[]
    } else {
        std::slice::from_raw_parts(ptr, len)
    }
}
