//! [`Array`]: an owned handle of one MLX array, freed on drop, and the checked calls that make them.

use std::ffi::{c_int, CStr};

use mlxcel_plugin_api::DType;

use crate::ffi::{self, RawArray};

/// One MLX array (lazy or evaluated), owned.
pub struct Array(*mut RawArray);

// SAFETY: an MLX array is a reference-counted handle; the plugin uses each context from one thread at a
// time and serialises every evaluation behind one process-wide lock (see `present.rs`).
unsafe impl Send for Array {}

impl Drop for Array {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: the handle came from the shim and is released once.
            unsafe { ffi::mlxb_free(self.0) }
        }
    }
}

/// The shim's last error on this thread.
pub fn last_error() -> String {
    // SAFETY: the shim returns a NUL-terminated string that lives until its next failing call.
    unsafe { CStr::from_ptr(ffi::mlxb_last_error()) }.to_string_lossy().into_owned()
}

/// Runs a shim call that writes one array, turning a failure into MLX's message.
pub fn make(f: impl FnOnce(ffi::Out) -> c_int) -> Result<Array, String> {
    let mut out: *mut RawArray = std::ptr::null_mut();
    if f(&mut out) != 0 || out.is_null() {
        return Err(format!("MLX: {}", last_error()));
    }
    Ok(Array(out))
}

/// Turns a status into a result.
pub fn status(rc: c_int) -> Result<(), String> {
    if rc == 0 {
        Ok(())
    } else {
        Err(format!("MLX: {}", last_error()))
    }
}

/// The shim's number for a dtype it keeps.
pub fn dtype_code(d: DType) -> Result<c_int, String> {
    match d {
        DType::F32 | DType::F16 | DType::BF16 | DType::I32 | DType::U32 | DType::U8 => Ok(d as u32 as c_int),
        other => Err(format!("the mlx backend does not keep {} tensors", other.name())),
    }
}

impl Array {
    pub fn raw(&self) -> *const RawArray {
        self.0
    }

    /// Takes ownership of a handle the shim returned.
    pub fn from_raw(raw: *mut RawArray) -> Array {
        Array(raw)
    }

    /// No array: holds a buffer's place while its array is being replaced (never passed to the shim).
    pub fn placeholder() -> Array {
        Array(std::ptr::null_mut())
    }

    /// The array as f32 (itself when it already is).
    pub fn f32(&self) -> Result<Array, String> {
        // SAFETY: a live handle.
        make(|o| unsafe { ffi::mlxb_astype_f32(self.0, o) })
    }

    /// The values of a `dtype` tensor as f32 `[rows, cols]`.
    pub fn view_f32_2d(&self, dtype: DType, rows: i64, cols: i64) -> Result<Array, String> {
        self.view(dtype, &[rows, cols])?.f32()
    }

    /// A copy of `bytes` as an array of `dtype` and `shape`.
    pub fn from_host(bytes: &[u8], dtype: DType, shape: &[i64]) -> Result<Array, String> {
        let code = dtype_code(dtype)?;
        let n: i64 = shape.iter().product();
        if n as usize * dtype.size() != bytes.len() {
            return Err(format!("{} bytes cannot be a {} tensor of shape {shape:?}", bytes.len(), dtype.name()));
        }
        // SAFETY: `bytes` holds exactly the elements `shape` names; the shim copies them.
        make(|o| unsafe { ffi::mlxb_from_host(bytes.as_ptr(), shape.as_ptr(), shape.len() as c_int, code, o) })
    }

    /// `bytes` as an array of `dtype` and `shape`, read in place where libmlx can alias host memory
    /// (then `true`), else copied.
    ///
    /// # Safety
    /// Where aliased, `bytes` must stay alive and unchanged until the array and every array that
    /// shares its memory are dropped.
    pub unsafe fn from_host_borrowed(bytes: &[u8], dtype: DType, shape: &[i64]) -> Result<(Array, bool), String> {
        let code = dtype_code(dtype)?;
        let n: i64 = shape.iter().product();
        if n as usize * dtype.size() != bytes.len() {
            return Err(format!("{} bytes cannot be a {} tensor of shape {shape:?}", bytes.len(), dtype.name()));
        }
        let mut borrowed: c_int = 0;
        // SAFETY: `bytes` holds exactly the elements `shape` names; the caller keeps them alive.
        let a = make(|o| unsafe {
            ffi::mlxb_from_host_borrowed(bytes.as_ptr(), shape.as_ptr(), shape.len() as c_int, code, &mut borrowed, o)
        })?;
        Ok((a, borrowed != 0))
    }

    pub fn from_i32(values: &[i32], shape: &[i64]) -> Result<Array, String> {
        // SAFETY: plain integers seen as their bytes.
        let bytes = unsafe { std::slice::from_raw_parts(values.as_ptr() as *const u8, std::mem::size_of_val(values)) };
        Array::from_host(bytes, DType::I32, shape)
    }

    pub fn from_f32(values: &[f32], shape: &[i64]) -> Result<Array, String> {
        // SAFETY: plain floats seen as their bytes.
        let bytes = unsafe { std::slice::from_raw_parts(values.as_ptr() as *const u8, std::mem::size_of_val(values)) };
        Array::from_host(bytes, DType::F32, shape)
    }

    pub fn zeros(dtype: DType, shape: &[i64]) -> Result<Array, String> {
        let code = dtype_code(dtype)?;
        // SAFETY: `shape` is valid for its length.
        make(|o| unsafe { ffi::mlxb_zeros(shape.as_ptr(), shape.len() as c_int, code, o) })
    }

    /// Another handle of the same array.
    pub fn share(&self) -> Result<Array, String> {
        // SAFETY: a live handle.
        make(|o| unsafe { ffi::mlxb_clone(self.0, o) })
    }

    /// The same bytes as `dtype` and `shape`.
    pub fn view(&self, dtype: DType, shape: &[i64]) -> Result<Array, String> {
        let code = dtype_code(dtype)?;
        // SAFETY: a live handle; `shape` valid for its length.
        make(|o| unsafe { ffi::mlxb_view(self.0, code, shape.as_ptr(), shape.len() as c_int, o) })
    }

    pub fn nbytes(&self) -> usize {
        // SAFETY: a live handle.
        unsafe { ffi::mlxb_nbytes(self.0) as usize }
    }

    /// Copies bytes `offset..offset + dst.len()` of the evaluated array.
    pub fn read(&self, offset: usize, dst: &mut [u8]) -> Result<(), String> {
        // SAFETY: a live handle; `dst` is writable for its length.
        status(unsafe { ffi::mlxb_read(self.0, offset, dst.as_mut_ptr(), dst.len()) })
    }

    /// Evaluates all arrays together (one MLX graph evaluation).
    pub fn eval(arrays: &[&Array]) -> Result<(), String> {
        let raw: Vec<*mut RawArray> = arrays.iter().map(|a| a.0).collect();
        // SAFETY: live handles.
        status(unsafe { ffi::mlxb_eval(raw.as_ptr(), raw.len()) })
    }

    /// Schedules the arrays' evaluation and returns without waiting ([`Array::eval`] or a read waits).
    pub fn async_eval(arrays: &[&Array]) -> Result<(), String> {
        let raw: Vec<*mut RawArray> = arrays.iter().map(|a| a.0).collect();
        // SAFETY: live handles.
        status(unsafe { ffi::mlxb_async_eval(raw.as_ptr(), raw.len()) })
    }
}
