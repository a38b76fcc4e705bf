// The C interface of the MLX backend's shim over MLX's C++ API (mlx_shim.cpp). Rust sees only this:
// opaque array handles, plain numbers, and a status (0 = ok) with the message kept per thread.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mlxb_array mlxb_array;

// Element types, numbered as mlxcel's plugin-api DType.
enum { MLXB_F32 = 0, MLXB_F16 = 1, MLXB_BF16 = 2, MLXB_I32 = 3, MLXB_U32 = 4, MLXB_U8 = 5 };

enum {
  MLXB_UN_SCALE = 0, MLXB_UN_SILU, MLXB_UN_GELU, MLXB_UN_GELU_TANH, MLXB_UN_RELU, MLXB_UN_SOFTCAP, MLXB_UN_SIGMOID
};
enum { MLXB_BIN_ADD = 0, MLXB_BIN_MUL, MLXB_BIN_SILU_MUL, MLXB_BIN_GELU_TANH_MUL };

// The last error's message on this thread (valid until the next failing call on it).
const char* mlxb_last_error(void);
const char* mlxb_version(void);
// "cpu" or "gpu": the device MLX computes on by default.
const char* mlxb_default_device(void);

void mlxb_free(mlxb_array* a);
// A copy of host data as an array of `dtype` and `shape`.
int mlxb_from_host(const void* data, const int64_t* shape, int ndim, int dtype, mlxb_array** out);
// The host's bytes as an array of `dtype` and `shape` without a copy where libmlx can alias them
// (`*borrowed` = 1; the host keeps them alive and unchanged while the array lives), else a copy.
int mlxb_from_host_borrowed(const void* data, const int64_t* shape, int ndim, int dtype, int* borrowed,
                            mlxb_array** out);
int mlxb_zeros(const int64_t* shape, int ndim, int dtype, mlxb_array** out);
int mlxb_clone(const mlxb_array* a, mlxb_array** out);
// The same bytes seen as `dtype` and `shape` (a bit-cast and a reshape, lazy).
int mlxb_view(const mlxb_array* a, int dtype, const int64_t* shape, int ndim, mlxb_array** out);
int64_t mlxb_nbytes(const mlxb_array* a);
// Evaluates every array (one graph evaluation).
int mlxb_eval(mlxb_array* const* arrays, size_t n);
// Schedules every array's evaluation and returns at once (mlx's async_eval); a later eval or read waits.
int mlxb_async_eval(mlxb_array* const* arrays, size_t n);
// Evaluates `a` and copies `len` bytes from byte `offset` of its row-major contents.
int mlxb_read(const mlxb_array* a, size_t offset, void* dst, size_t len);

int mlxb_astype_f32(const mlxb_array* a, mlxb_array** out);

// Ops (all lazy; f32 results). Float weights of any float dtype are read as they are stored.
int mlxb_matmul(const mlxb_array* x, const mlxb_array* w, mlxb_array** out);
int mlxb_quant_matmul(const mlxb_array* x, const mlxb_array* w, const mlxb_array* scales, const mlxb_array* biases,
                      int bits, int group, mlxb_array** out);
int mlxb_take_rows(const mlxb_array* x, const mlxb_array* rows, mlxb_array** out);
/* Rows start..stop of x (any dtype, no cast): a view for one part of a fused weight. */
int mlxb_slice_rows(const mlxb_array* x, int64_t start, int64_t stop, mlxb_array** out);
int mlxb_quant_embedding(const mlxb_array* ids, const mlxb_array* w, const mlxb_array* scales,
                         const mlxb_array* biases, int bits, int group, mlxb_array** out);
int mlxb_unary(int kind, const mlxb_array* x, float p, mlxb_array** out);
int mlxb_binary(int kind, const mlxb_array* a, const mlxb_array* b, mlxb_array** out);
int mlxb_rms_norm(const mlxb_array* x, const mlxb_array* w, float eps, int unit_offset, mlxb_array** out);
int mlxb_layer_norm(const mlxb_array* x, const mlxb_array* w, const mlxb_array* b, float eps, mlxb_array** out);
int mlxb_rope(const mlxb_array* x, const mlxb_array* positions, const mlxb_array* inv_freq, int head_dim,
              int rot_dims, int traditional, float mscale, mlxb_array** out);
// Writes rows `k`/`v` ([T, row]) into caches ([slots, row]) at `slot_idx` (I32 [T]); new caches out.
int mlxb_kv_write(const mlxb_array* k_cache, const mlxb_array* v_cache, const mlxb_array* k, const mlxb_array* v,
                  const mlxb_array* slot_idx, mlxb_array** k_out, mlxb_array** v_out);
// Attention of one sequence: q [Ts, Hq*Dh] rows `q_start..q_start+Ts` of `q`, against the cache rows
// `key_slots` (I32 [L]), with an additive mask [Ts, L] (0 or -inf). Out [Ts, Hq*Dh].
int mlxb_attention_seq(const mlxb_array* q, int q_start, int n_q, const mlxb_array* k_cache,
                       const mlxb_array* v_cache, const mlxb_array* key_slots, const mlxb_array* mask, int hq,
                       int hkv, int dh, float scale, float softcap, mlxb_array** out);
// Rows of all arrays, in order (axis 0).
int mlxb_concat_rows(mlxb_array* const* arrays, size_t n, mlxb_array** out);
// Copies block `src` to block `dst` of a cache [slots, row] with `block_size` slots per block.
int mlxb_copy_block(const mlxb_array* cache, int64_t src, int64_t dst, int64_t block_size, mlxb_array** out);

// Columns c0..c1 of x [T, C].
int mlxb_slice_cols(const mlxb_array* x, int64_t c0, int64_t c1, mlxb_array** out);
// Softmax over groups of `d` columns.
int mlxb_softmax_groups(const mlxb_array* x, int64_t d, mlxb_array** out);
// x / max(|x|_2, eps) per row.
int mlxb_l2_normalize(const mlxb_array* x, float eps, mlxb_array** out);
// The k largest values of each row of x [T, C] (or their columns as f32), descending, ties by column.
int mlxb_topk(const mlxb_array* x, int k, int indices, int softmax, int renormalize, mlxb_array** out);
// Expert matmul: x [T, K] or [T*k, K], indices f32 [T, k], weights [E_i, N, K] or [N, K] holding experts
// first.. in order (rows whose expert is not held are zeros). Out [T*k, N].
int mlxb_gather_mm(const mlxb_array* x, const mlxb_array* indices, mlxb_array* const* weights, size_t n_weights,
                   int64_t first, int x_per_token, mlxb_array** out);
// Expert matmul over affine-quantized stacked experts [E, N, K*bits/32]. Out [T*k, N].
int mlxb_gather_qmm(const mlxb_array* x, const mlxb_array* indices, const mlxb_array* w, const mlxb_array* scales,
                    const mlxb_array* biases, int bits, int group, int x_per_token, mlxb_array** out);
// out[t] = sum_j w[t, j] * y[t*k + j]: y [T*k, N], w [T, k]. Out [T, N].
int mlxb_weighted_sum(const mlxb_array* y, const mlxb_array* w, int t, int k, mlxb_array** out);
// weights [N, T] · x [T, C] (mean pooling with per-sequence weights). Out [N, C].
int mlxb_pool_mean(const mlxb_array* x, const mlxb_array* weights, mlxb_array** out);
// Rows `rows` (I32 [N]) of x, zeros where `present` (F32 [N]) is 0. Out [N, C].
int mlxb_pool_pick(const mlxb_array* x, const mlxb_array* rows, const mlxb_array* present, mlxb_array** out);
// Attention of q [n, Hq*Dh] over k/v [L, Hkv*Dh] with an optional additive mask [n, L] (null: none).
int mlxb_attend(const mlxb_array* q, const mlxb_array* k, const mlxb_array* v, const mlxb_array* mask, int hq,
                int hkv, int dh, float scale, float softcap, mlxb_array** out);
// 1-D convolution of one sequence x [L, C_in] with w [C_out, K, C_in/g] (or PyTorch's [C_out, C_in/g, K]
// when torch_layout), zero padding on both sides, optional bias [C_out]. Out [L_out, C_out].
int mlxb_conv1d(const mlxb_array* x, const mlxb_array* w, const mlxb_array* bias, int stride, int padding, int groups,
                int torch_layout, mlxb_array** out);
// Elements offset..offset+len of the flattened array.
int mlxb_flat_read(const mlxb_array* state, int64_t offset, int64_t len, mlxb_array** out);
// The array with its flattened elements from `offset` replaced by `data`'s (cast to its dtype).
int mlxb_flat_write(const mlxb_array* state, int64_t offset, const mlxb_array* data, mlxb_array** out);
// [a b]: a [n, ca] and b [n, cb] side by side (f32). Out [n, ca + cb].
int mlxb_concat_cols(const mlxb_array* a, const mlxb_array* b, mlxb_array** out);
// Cross-attention of q [n, Hq*Dh] over the K/V rows of one StoreCrossKv state row that starts at flat
// element `row_offset` of `state` (f32): `header` elements (the first: stored length as u32 bits), then
// `max_len` rows of K then V. Zeros when nothing is stored.
int mlxb_cross_attend(const mlxb_array* q, const mlxb_array* state, int64_t row_offset, int max_len, int header,
                      int hq, int hkv, int dh, float scale, float softcap, mlxb_array** out);
#ifdef __cplusplus
}
#endif
