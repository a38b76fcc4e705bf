//! The shim's C interface (`shim/mlx_shim.h`), declared for Rust. Every function returning `c_int`
//! returns 0 on success; otherwise `mlxb_last_error` holds the message.

use std::ffi::{c_char, c_int};

/// An MLX array owned by the shim (`mlxb_free` releases it).
#[repr(C)]
pub struct RawArray {
    _private: [u8; 0],
}

pub const UN_SCALE: c_int = 0;
pub const UN_SILU: c_int = 1;
pub const UN_GELU: c_int = 2;
pub const UN_GELU_TANH: c_int = 3;
pub const UN_RELU: c_int = 4;
pub const UN_SOFTCAP: c_int = 5;
pub const UN_SIGMOID: c_int = 6;

pub const BIN_ADD: c_int = 0;
pub const BIN_MUL: c_int = 1;
pub const BIN_SILU_MUL: c_int = 2;
pub const BIN_GELU_TANH_MUL: c_int = 3;

pub type Out = *mut *mut RawArray;

extern "C" {
    pub fn mlxb_last_error() -> *const c_char;
    pub fn mlxb_version() -> *const c_char;
    pub fn mlxb_default_device() -> *const c_char;
    pub fn mlxb_free(a: *mut RawArray);
    pub fn mlxb_from_host(data: *const u8, shape: *const i64, ndim: c_int, dtype: c_int, out: Out) -> c_int;
    pub fn mlxb_from_host_borrowed(
        data: *const u8,
        shape: *const i64,
        ndim: c_int,
        dtype: c_int,
        borrowed: *mut c_int,
        out: Out,
    ) -> c_int;
    pub fn mlxb_zeros(shape: *const i64, ndim: c_int, dtype: c_int, out: Out) -> c_int;
    pub fn mlxb_clone(a: *const RawArray, out: Out) -> c_int;
    pub fn mlxb_view(a: *const RawArray, dtype: c_int, shape: *const i64, ndim: c_int, out: Out) -> c_int;
    pub fn mlxb_nbytes(a: *const RawArray) -> i64;
    pub fn mlxb_eval(arrays: *const *mut RawArray, n: usize) -> c_int;
    pub fn mlxb_async_eval(arrays: *const *mut RawArray, n: usize) -> c_int;
    pub fn mlxb_read(a: *const RawArray, offset: usize, dst: *mut u8, len: usize) -> c_int;
    pub fn mlxb_astype_f32(a: *const RawArray, out: Out) -> c_int;
    pub fn mlxb_matmul(x: *const RawArray, w: *const RawArray, out: Out) -> c_int;
    pub fn mlxb_quant_matmul(
        x: *const RawArray,
        w: *const RawArray,
        scales: *const RawArray,
        biases: *const RawArray,
        bits: c_int,
        group: c_int,
        out: Out,
    ) -> c_int;
    pub fn mlxb_take_rows(x: *const RawArray, rows: *const RawArray, out: Out) -> c_int;
    pub fn mlxb_slice_rows(x: *const RawArray, start: i64, stop: i64, out: Out) -> c_int;
    pub fn mlxb_quant_embedding(
        ids: *const RawArray,
        w: *const RawArray,
        scales: *const RawArray,
        biases: *const RawArray,
        bits: c_int,
        group: c_int,
        out: Out,
    ) -> c_int;
    pub fn mlxb_unary(kind: c_int, x: *const RawArray, p: f32, out: Out) -> c_int;
    pub fn mlxb_binary(kind: c_int, a: *const RawArray, b: *const RawArray, out: Out) -> c_int;
    pub fn mlxb_rms_norm(x: *const RawArray, w: *const RawArray, eps: f32, unit: c_int, out: Out) -> c_int;
    pub fn mlxb_layer_norm(x: *const RawArray, w: *const RawArray, b: *const RawArray, eps: f32, out: Out) -> c_int;
    pub fn mlxb_rope(
        x: *const RawArray,
        positions: *const RawArray,
        inv_freq: *const RawArray,
        head_dim: c_int,
        rot_dims: c_int,
        traditional: c_int,
        mscale: f32,
        out: Out,
    ) -> c_int;
    pub fn mlxb_kv_write(
        k_cache: *const RawArray,
        v_cache: *const RawArray,
        k: *const RawArray,
        v: *const RawArray,
        slot_idx: *const RawArray,
        k_out: Out,
        v_out: Out,
    ) -> c_int;
    pub fn mlxb_attention_seq(
        q: *const RawArray,
        q_start: c_int,
        n_q: c_int,
        k_cache: *const RawArray,
        v_cache: *const RawArray,
        key_slots: *const RawArray,
        mask: *const RawArray,
        hq: c_int,
        hkv: c_int,
        dh: c_int,
        scale: f32,
        softcap: f32,
        out: Out,
    ) -> c_int;
    pub fn mlxb_concat_rows(arrays: *const *mut RawArray, n: usize, out: Out) -> c_int;
    pub fn mlxb_copy_block(cache: *const RawArray, src: i64, dst: i64, block_size: i64, out: Out) -> c_int;
    pub fn mlxb_slice_cols(x: *const RawArray, c0: i64, c1: i64, out: Out) -> c_int;
    pub fn mlxb_softmax_groups(x: *const RawArray, d: i64, out: Out) -> c_int;
    pub fn mlxb_l2_normalize(x: *const RawArray, eps: f32, out: Out) -> c_int;
    pub fn mlxb_topk(
        x: *const RawArray,
        k: c_int,
        indices: c_int,
        softmax: c_int,
        renormalize: c_int,
        out: Out,
    ) -> c_int;
    pub fn mlxb_gather_mm(
        x: *const RawArray,
        indices: *const RawArray,
        weights: *const *mut RawArray,
        n_weights: usize,
        first: i64,
        x_per_token: c_int,
        out: Out,
    ) -> c_int;
    pub fn mlxb_gather_qmm(
        x: *const RawArray,
        indices: *const RawArray,
        w: *const RawArray,
        scales: *const RawArray,
        biases: *const RawArray,
        bits: c_int,
        group: c_int,
        x_per_token: c_int,
        out: Out,
    ) -> c_int;
    pub fn mlxb_weighted_sum(y: *const RawArray, w: *const RawArray, t: c_int, k: c_int, out: Out) -> c_int;
    pub fn mlxb_pool_mean(x: *const RawArray, weights: *const RawArray, out: Out) -> c_int;
    pub fn mlxb_pool_pick(x: *const RawArray, rows: *const RawArray, present: *const RawArray, out: Out) -> c_int;
    pub fn mlxb_attend(
        q: *const RawArray,
        k: *const RawArray,
        v: *const RawArray,
        mask: *const RawArray,
        hq: c_int,
        hkv: c_int,
        dh: c_int,
        scale: f32,
        softcap: f32,
        out: Out,
    ) -> c_int;
    pub fn mlxb_conv1d(
        x: *const RawArray,
        w: *const RawArray,
        bias: *const RawArray,
        stride: c_int,
        padding: c_int,
        groups: c_int,
        torch_layout: c_int,
        out: Out,
    ) -> c_int;
    pub fn mlxb_flat_read(state: *const RawArray, offset: i64, len: i64, out: Out) -> c_int;
    pub fn mlxb_flat_write(state: *const RawArray, offset: i64, data: *const RawArray, out: Out) -> c_int;
    pub fn mlxb_concat_cols(a: *const RawArray, b: *const RawArray, out: Out) -> c_int;
    pub fn mlxb_cross_attend(
        q: *const RawArray,
        state: *const RawArray,
        row_offset: i64,
        max_len: c_int,
        header: c_int,
        hq: c_int,
        hkv: c_int,
        dh: c_int,
        scale: f32,
        softcap: f32,
        out: Out,
    ) -> c_int;
}
