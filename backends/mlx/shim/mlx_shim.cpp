// The MLX backend's shim: each function builds lazy MLX ops (or evaluates them) and turns every C++
// exception into a status and a per-thread message, so nothing unwinds into Rust.
#include "mlx_shim.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "mlx/mlx.h"

namespace mx = mlx::core;

struct mlxb_array {
  mx::array a;
};

namespace {

thread_local std::string last_error;

int fail(const char* what) {
  last_error = what;
  return 1;
}

// MLX keeps a default stream per thread, and a stream made by one thread cannot be evaluated on
// another, but the host may call from any thread (the engine runs on its own; a context is used by
// one thread at a time). So all work goes to one stream usable from any thread, made the calling
// thread's default at every entry point.
void ensure_stream() {
  auto d = mx::default_device();
  static const mx::Stream shared = mx::new_thread_unsafe_stream(d);
  auto current = mx::peek_default_stream(d);
  if (!current || !(*current == shared)) mx::set_default_stream(shared);
}

#define MLXB_TRY(...)                           \
  try {                                         \
    ensure_stream();                            \
    __VA_ARGS__;                                \
    return 0;                                   \
  } catch (const std::exception& e) {           \
    return fail(e.what());                      \
  } catch (...) {                               \
    return fail("unknown C++ exception in MLX"); \
  }

mx::Dtype to_dtype(int d) {
  switch (d) {
    case MLXB_F32: return mx::float32;
    case MLXB_F16: return mx::float16;
    case MLXB_BF16: return mx::bfloat16;
    case MLXB_I32: return mx::int32;
    case MLXB_U32: return mx::uint32;
    case MLXB_U8: return mx::uint8;
    default: throw std::invalid_argument("dtype " + std::to_string(d) + " is not one the MLX backend keeps");
  }
}

mx::Shape to_shape(const int64_t* shape, int ndim) {
  mx::Shape s;
  for (int i = 0; i < ndim; ++i) {
    if (shape[i] < 0 || shape[i] > INT32_MAX) throw std::invalid_argument("dimension out of MLX's range");
    s.push_back(static_cast<int32_t>(shape[i]));
  }
  return s;
}

mlxb_array* wrap(mx::array a) { return new mlxb_array{std::move(a)}; }

mx::array f32(const mx::array& a) { return a.dtype() == mx::float32 ? a : mx::astype(a, mx::float32); }

mx::array gelu_tanh(const mx::array& x) {
  const float c = std::sqrt(2.0f / static_cast<float>(M_PI));
  auto inner = mx::multiply(mx::array(c), mx::add(x, mx::multiply(mx::array(0.044715f), mx::power(x, mx::array(3.0f)))));
  return mx::multiply(mx::multiply(mx::array(0.5f), x), mx::add(mx::array(1.0f), mx::tanh(inner)));
}

mx::array silu(const mx::array& x) { return mx::multiply(x, mx::sigmoid(x)); }

mx::array softcapped(mx::array scores, float softcap) {
  if (softcap > 0.0f) {
    scores = mx::multiply(mx::array(softcap), mx::tanh(mx::divide(scores, mx::array(softcap))));
  }
  return scores;
}

// Attention of queries `q` [n, Hq*Dh] over keys/values [L, Hkv*Dh] (f32), with an optional additive
// mask broadcastable to [n, L]. Out [n, Hq*Dh].
mx::array attend(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array* mask, int hq, int hkv,
                 int dh, float scale, float softcap) {
  int g = hq / hkv;
  int n = q.shape(0), len = k.shape(0);
  auto qs = mx::transpose(mx::reshape(f32(q), {n, hkv, g, dh}), {1, 2, 0, 3});    // [Hkv, G, n, Dh]
  auto keys = mx::transpose(mx::reshape(f32(k), {len, hkv, 1, dh}), {1, 2, 3, 0});  // [Hkv, 1, Dh, L]
  auto vals = mx::transpose(mx::reshape(f32(v), {len, hkv, 1, dh}), {1, 2, 0, 3});  // [Hkv, 1, L, Dh]
  auto scores = softcapped(mx::multiply(mx::matmul(qs, keys), mx::array(scale)), softcap);
  if (mask) scores = mx::add(scores, *mask);
  auto p = mx::softmax(scores, -1, true);
  auto o = mx::matmul(p, vals);  // [Hkv, G, n, Dh]
  return mx::reshape(mx::transpose(o, {2, 0, 1, 3}), {n, hq * dh});
}

}  // namespace

extern "C" {

const char* mlxb_last_error(void) { return last_error.c_str(); }

const char* mlxb_version(void) { return mx::version(); }

const char* mlxb_default_device(void) {
  try {
    return mx::default_device().type == mx::Device::gpu ? "gpu" : "cpu";
  } catch (...) {
    return "cpu";
  }
}

void mlxb_free(mlxb_array* a) { delete a; }

int mlxb_from_host(const void* data, const int64_t* shape, int ndim, int dtype, mlxb_array** out) {
  MLXB_TRY({
    auto s = to_shape(shape, ndim);
    auto dt = to_dtype(dtype);
    size_t n = 1;
    for (auto d : s) n *= static_cast<size_t>(d);
    size_t bytes = n * mx::size_of(dt);
    if (bytes == 0) {
      *out = wrap(mx::zeros(s, dt));
    } else {
      auto buf = mx::allocator::malloc(bytes);
      std::memcpy(buf.buffer().raw_ptr(), data, bytes);
      *out = wrap(mx::array(std::move(buf), s, dt));
    }
  })
}

int mlxb_from_host_borrowed(const void* data, const int64_t* shape, int ndim, int dtype, int* borrowed,
                            mlxb_array** out) {
  MLXB_TRY({
    *borrowed = 0;
    auto s = to_shape(shape, ndim);
    auto dt = to_dtype(dtype);
    size_t n = 1;
    for (auto d : s) n *= static_cast<size_t>(d);
    size_t bytes = n * mx::size_of(dt);
    void* p = const_cast<void*>(data);
    if (bytes == 0) {
      *out = wrap(mx::zeros(s, dt));
      return 0;
    }
    if (reinterpret_cast<uintptr_t>(p) % mx::size_of(dt) == 0) {
      if (!mx::is_available(mx::Device::gpu)) {
        // A CPU-only libmlx (the mlx-cpu wheel) cannot wrap foreign memory through the public
        // constructor (its allocator's make_buffer declines, so that copies), but its buffers are
        // plain pointers whose data starts one size_t in (Buffer::raw_ptr). A buffer placed one
        // size_t before the host's bytes therefore reads them in place; it is not owned, so MLX never
        // frees it nor donates it to an op's output (never writes the read-only mapping). Checked
        // below: a libmlx laid out otherwise falls back to the copy.
        mx::allocator::Data d(mx::allocator::Buffer(static_cast<char*>(p) - sizeof(size_t)),
                              [](mx::allocator::Buffer) {});
        mx::array a(std::move(d), s, dt);
        if (a.data<uint8_t>() == static_cast<uint8_t*>(p)) {
          *borrowed = 1;
          *out = wrap(std::move(a));
          return 0;
        }
      } else {
        // Metal/CUDA: the public no-copy constructor (it copies where the device cannot alias).
        mx::array a(p, s, dt, [](void*) {});
        *borrowed = a.data<uint8_t>() == static_cast<uint8_t*>(p) ? 1 : 0;
        *out = wrap(std::move(a));
        return 0;
      }
    }
    auto buf = mx::allocator::malloc(bytes);
    std::memcpy(buf.buffer().raw_ptr(), data, bytes);
    *out = wrap(mx::array(std::move(buf), s, dt));
  })
}

int mlxb_zeros(const int64_t* shape, int ndim, int dtype, mlxb_array** out) {
  MLXB_TRY({ *out = wrap(mx::zeros(to_shape(shape, ndim), to_dtype(dtype))); })
}

int mlxb_clone(const mlxb_array* a, mlxb_array** out) { MLXB_TRY({ *out = wrap(a->a); }) }

int mlxb_view(const mlxb_array* a, int dtype, const int64_t* shape, int ndim, mlxb_array** out) {
  MLXB_TRY({
    auto dt = to_dtype(dtype);
    auto s = to_shape(shape, ndim);
    if (a->a.dtype() == dt && a->a.shape() == s) {
      *out = wrap(a->a);
    } else {
      auto flat = mx::reshape(a->a, {-1});
      auto v = a->a.dtype() == dt ? flat : mx::view(flat, dt);
      *out = wrap(mx::reshape(v, s));
    }
  })
}

int64_t mlxb_nbytes(const mlxb_array* a) { return static_cast<int64_t>(a->a.nbytes()); }

int mlxb_eval(mlxb_array* const* arrays, size_t n) {
  MLXB_TRY({
    std::vector<mx::array> v;
    v.reserve(n);
    for (size_t i = 0; i < n; ++i) v.push_back(arrays[i]->a);
    mx::eval(v);
  })
}

int mlxb_async_eval(mlxb_array* const* arrays, size_t n) {
  MLXB_TRY({
    std::vector<mx::array> v;
    v.reserve(n);
    for (size_t i = 0; i < n; ++i) v.push_back(arrays[i]->a);
    mx::async_eval(v);
  })
}

int mlxb_read(const mlxb_array* a, size_t offset, void* dst, size_t len) {
  MLXB_TRY({
    auto x = a->a;
    mx::eval(x);
    if (!x.flags().row_contiguous) {
      x = mx::contiguous(x);
      mx::eval(x);
    }
    if (offset + len > x.nbytes()) throw std::out_of_range("read past the end of an MLX array");
    if (len > 0) std::memcpy(dst, x.data<uint8_t>() + offset, len);
  })
}

int mlxb_astype_f32(const mlxb_array* a, mlxb_array** out) { MLXB_TRY({ *out = wrap(f32(a->a)); }) }

int mlxb_matmul(const mlxb_array* x, const mlxb_array* w, mlxb_array** out) {
  MLXB_TRY({ *out = wrap(mx::matmul(f32(x->a), mx::transpose(f32(w->a)))); })
}

int mlxb_quant_matmul(const mlxb_array* x, const mlxb_array* w, const mlxb_array* scales, const mlxb_array* biases,
                      int bits, int group, mlxb_array** out) {
  MLXB_TRY({
    *out = wrap(mx::quantized_matmul(f32(x->a), w->a, f32(scales->a), f32(biases->a), true, group, bits, "affine"));
  })
}

int mlxb_take_rows(const mlxb_array* x, const mlxb_array* rows, mlxb_array** out) {
  MLXB_TRY({ *out = wrap(f32(mx::take(x->a, rows->a, 0))); })
}

int mlxb_slice_rows(const mlxb_array* x, int64_t start, int64_t stop, mlxb_array** out) {
  MLXB_TRY({
    auto shape = x->a.shape();
    mx::Shape lo(shape.size(), 0), hi(shape.begin(), shape.end());
    lo[0] = static_cast<int>(start);
    hi[0] = static_cast<int>(stop);
    *out = wrap(mx::slice(x->a, lo, hi));
  })
}

int mlxb_quant_embedding(const mlxb_array* ids, const mlxb_array* w, const mlxb_array* scales,
                         const mlxb_array* biases, int bits, int group, mlxb_array** out) {
  MLXB_TRY({
    auto wr = mx::take(w->a, ids->a, 0);
    auto sr = f32(mx::take(scales->a, ids->a, 0));
    auto br = f32(mx::take(biases->a, ids->a, 0));
    *out = wrap(f32(mx::dequantize(wr, sr, br, group, bits, "affine")));
  })
}

int mlxb_unary(int kind, const mlxb_array* x, float p, mlxb_array** out) {
  MLXB_TRY({
    const auto& a = x->a;
    switch (kind) {
      case MLXB_UN_SCALE: *out = wrap(mx::multiply(a, mx::array(p))); break;
      case MLXB_UN_SILU: *out = wrap(silu(a)); break;
      case MLXB_UN_GELU:
        *out = wrap(mx::multiply(mx::multiply(mx::array(0.5f), a),
                                 mx::add(mx::array(1.0f), mx::erf(mx::multiply(a, mx::array(float(M_SQRT1_2)))))));
        break;
      case MLXB_UN_GELU_TANH: *out = wrap(gelu_tanh(a)); break;
      case MLXB_UN_RELU: *out = wrap(mx::maximum(a, mx::array(0.0f))); break;
      case MLXB_UN_SOFTCAP: *out = wrap(mx::multiply(mx::array(p), mx::tanh(mx::divide(a, mx::array(p))))); break;
      case MLXB_UN_SIGMOID: *out = wrap(mx::sigmoid(a)); break;
      default: throw std::invalid_argument("unknown unary op");
    }
  })
}

int mlxb_binary(int kind, const mlxb_array* a, const mlxb_array* b, mlxb_array** out) {
  MLXB_TRY({
    auto x = f32(a->a);
    auto y = f32(b->a);
    switch (kind) {
      case MLXB_BIN_ADD: *out = wrap(mx::add(x, y)); break;
      case MLXB_BIN_MUL: *out = wrap(mx::multiply(x, y)); break;
      case MLXB_BIN_SILU_MUL: *out = wrap(mx::multiply(silu(x), y)); break;
      case MLXB_BIN_GELU_TANH_MUL: *out = wrap(mx::multiply(gelu_tanh(x), y)); break;
      default: throw std::invalid_argument("unknown binary op");
    }
  })
}

int mlxb_rms_norm(const mlxb_array* x, const mlxb_array* w, float eps, int unit_offset, mlxb_array** out) {
  MLXB_TRY({
    auto shape = x->a.shape();
    int d = static_cast<int>(w->a.size());
    auto wf = f32(w->a);
    if (unit_offset) wf = mx::add(wf, mx::array(1.0f));
    auto groups = mx::reshape(f32(x->a), {-1, d});
    *out = wrap(mx::reshape(mx::fast::rms_norm(groups, wf, eps), shape));
  })
}

int mlxb_layer_norm(const mlxb_array* x, const mlxb_array* w, const mlxb_array* b, float eps, mlxb_array** out) {
  MLXB_TRY({ *out = wrap(mx::fast::layer_norm(f32(x->a), f32(w->a), f32(b->a), eps)); })
}

int mlxb_rope(const mlxb_array* x, const mlxb_array* positions, const mlxb_array* inv_freq, int head_dim,
              int rot_dims, int traditional, float mscale, mlxb_array** out) {
  MLXB_TRY({
    auto shape = x->a.shape();
    int t = shape[0];
    if (t == 0 || head_dim <= 0) {
      *out = wrap(f32(x->a));
      return 0;
    }
    int heads = static_cast<int>(x->a.size() / (static_cast<size_t>(t) * head_dim));
    int half = rot_dims / 2;
    auto xs = mx::reshape(f32(x->a), {t, heads, head_dim});
    // Angles [T, 1, half]: one row of frequencies shared, or one per token.
    auto pos = mx::astype(mx::reshape(positions->a, {t, 1}), mx::float32);
    auto freqs = mx::reshape(f32(inv_freq->a), {-1, half});
    auto theta = mx::reshape(mx::multiply(pos, freqs), {t, 1, half});
    auto c = mx::multiply(mx::cos(theta), mx::array(mscale));
    auto s = mx::multiply(mx::sin(theta), mx::array(mscale));
    mx::array rotated = xs;
    if (traditional) {
      auto pairs = mx::reshape(mx::slice(xs, {0, 0, 0}, {t, heads, rot_dims}), {t, heads, half, 2});
      auto x1 = mx::reshape(mx::slice(pairs, {0, 0, 0, 0}, {t, heads, half, 1}), {t, heads, half});
      auto x2 = mx::reshape(mx::slice(pairs, {0, 0, 0, 1}, {t, heads, half, 2}), {t, heads, half});
      auto o1 = mx::subtract(mx::multiply(x1, c), mx::multiply(x2, s));
      auto o2 = mx::add(mx::multiply(x2, c), mx::multiply(x1, s));
      rotated = mx::reshape(mx::stack({o1, o2}, -1), {t, heads, rot_dims});
    } else {
      auto x1 = mx::slice(xs, {0, 0, 0}, {t, heads, half});
      auto x2 = mx::slice(xs, {0, 0, half}, {t, heads, rot_dims});
      auto o1 = mx::subtract(mx::multiply(x1, c), mx::multiply(x2, s));
      auto o2 = mx::add(mx::multiply(x2, c), mx::multiply(x1, s));
      rotated = mx::concatenate({o1, o2}, -1);
    }
    if (rot_dims < head_dim) {
      rotated = mx::concatenate({rotated, mx::slice(xs, {0, 0, rot_dims}, {t, heads, head_dim})}, -1);
    }
    *out = wrap(mx::reshape(rotated, shape));
  })
}

int mlxb_kv_write(const mlxb_array* k_cache, const mlxb_array* v_cache, const mlxb_array* k, const mlxb_array* v,
                  const mlxb_array* slot_idx, mlxb_array** k_out, mlxb_array** v_out) {
  MLXB_TRY({
    int t = slot_idx->a.shape(0);
    if (t == 0) {
      *k_out = wrap(k_cache->a);
      *v_out = wrap(v_cache->a);
    } else {
      int row = k_cache->a.shape(1);
      auto ku = mx::reshape(mx::astype(k->a, k_cache->a.dtype()), {t, 1, row});
      auto vu = mx::reshape(mx::astype(v->a, v_cache->a.dtype()), {t, 1, row});
      auto kn = mx::scatter(k_cache->a, slot_idx->a, ku, 0);
      auto vn = mx::scatter(v_cache->a, slot_idx->a, vu, 0);
      *k_out = wrap(kn);
      *v_out = wrap(vn);
    }
  })
}

int mlxb_attention_seq(const mlxb_array* q, int q_start, int n_q, const mlxb_array* k_cache,
                       const mlxb_array* v_cache, const mlxb_array* key_slots, const mlxb_array* mask, int hq,
                       int hkv, int dh, float scale, float softcap, mlxb_array** out) {
  MLXB_TRY({
    int g = hq / hkv;
    int len = key_slots->a.shape(0);
    auto qs = mx::slice(q->a, {q_start, 0}, {q_start + n_q, hq * dh});
    qs = mx::transpose(mx::reshape(qs, {n_q, hkv, g, dh}), {1, 2, 0, 3});  // [Hkv, G, Ts, Dh]
    auto keys = f32(mx::take(k_cache->a, key_slots->a, 0));
    keys = mx::transpose(mx::reshape(keys, {len, hkv, 1, dh}), {1, 2, 3, 0});  // [Hkv, 1, Dh, L]
    auto vals = f32(mx::take(v_cache->a, key_slots->a, 0));
    vals = mx::transpose(mx::reshape(vals, {len, hkv, 1, dh}), {1, 2, 0, 3});  // [Hkv, 1, L, Dh]
    auto scores = mx::multiply(mx::matmul(qs, keys), mx::array(scale));       // [Hkv, G, Ts, L]
    if (softcap > 0.0f) {
      scores = mx::multiply(mx::array(softcap), mx::tanh(mx::divide(scores, mx::array(softcap))));
    }
    scores = mx::add(scores, mask->a);
    auto p = mx::softmax(scores, -1, true);
    auto o = mx::matmul(p, vals);  // [Hkv, G, Ts, Dh]
    *out = wrap(mx::reshape(mx::transpose(o, {2, 0, 1, 3}), {n_q, hq * dh}));
  })
}

int mlxb_concat_rows(mlxb_array* const* arrays, size_t n, mlxb_array** out) {
  MLXB_TRY({
    std::vector<mx::array> v;
    for (size_t i = 0; i < n; ++i) v.push_back(arrays[i]->a);
    *out = wrap(v.size() == 1 ? v[0] : mx::concatenate(v, 0));
  })
}

int mlxb_copy_block(const mlxb_array* cache, int64_t src, int64_t dst, int64_t block_size, mlxb_array** out) {
  MLXB_TRY({
    int row = cache->a.shape(1);
    int s0 = static_cast<int>(src * block_size), d0 = static_cast<int>(dst * block_size);
    int bs = static_cast<int>(block_size);
    auto block = mx::slice(cache->a, {s0, 0}, {s0 + bs, row});
    *out = wrap(mx::slice_update(cache->a, block, mx::Shape{d0, 0}, mx::Shape{d0 + bs, row}));
  })
}

int mlxb_slice_cols(const mlxb_array* x, int64_t c0, int64_t c1, mlxb_array** out) {
  MLXB_TRY({
    int t = x->a.shape(0);
    *out = wrap(mx::slice(f32(x->a), {0, static_cast<int>(c0)}, {t, static_cast<int>(c1)}));
  })
}

int mlxb_softmax_groups(const mlxb_array* x, int64_t d, mlxb_array** out) {
  MLXB_TRY({
    auto shape = x->a.shape();
    auto g = mx::reshape(f32(x->a), {-1, static_cast<int>(d)});
    *out = wrap(mx::reshape(mx::softmax(g, -1, true), shape));
  })
}

int mlxb_l2_normalize(const mlxb_array* x, float eps, mlxb_array** out) {
  MLXB_TRY({
    auto a = f32(x->a);
    auto norm = mx::sqrt(mx::sum(mx::square(a), -1, true));
    *out = wrap(mx::multiply(a, mx::reciprocal(mx::maximum(norm, mx::array(eps)))));
  })
}

int mlxb_topk(const mlxb_array* x, int k, int indices, int softmax, int renormalize, mlxb_array** out) {
  MLXB_TRY({
    auto v = f32(x->a);
    if (softmax) v = mx::softmax(v, -1, true);
    int rows = v.shape(0);
    // A stable sort of the negated values: descending, equal values by ascending column.
    auto order = mx::argsort(mx::negative(v), -1);
    auto chosen = mx::slice(order, {0, 0}, {rows, k});
    if (indices) {
      *out = wrap(mx::astype(chosen, mx::float32));
    } else {
      auto vals = mx::take_along_axis(v, chosen, -1);
      if (renormalize) vals = mx::divide(vals, mx::sum(vals, -1, true));
      *out = wrap(vals);
    }
  })
}

int mlxb_gather_mm(const mlxb_array* x, const mlxb_array* indices, mlxb_array* const* weights, size_t n_weights,
                   int64_t first, int x_per_token, mlxb_array** out) {
  MLXB_TRY({
    int t = indices->a.shape(0), k = indices->a.shape(1);
    int kdim = x->a.shape(1);
    std::vector<mx::array> stack;
    for (size_t i = 0; i < n_weights; ++i) {
      auto w = f32(weights[i]->a);
      if (w.ndim() == 2) w = mx::expand_dims(w, 0);
      stack.push_back(w);
    }
    auto w = stack.size() == 1 ? stack[0] : mx::concatenate(stack, 0);  // [E, N, K]
    int held = w.shape(0), n = w.shape(1);
    auto local = mx::subtract(f32(indices->a), mx::array(static_cast<float>(first)));
    auto valid = mx::logical_and(mx::greater_equal(local, mx::array(0.0f)),
                                 mx::less(local, mx::array(static_cast<float>(held))));
    auto idx = mx::astype(mx::clip(local, mx::array(0.0f), mx::array(static_cast<float>(held - 1))), mx::uint32);
    auto xs = x_per_token ? mx::reshape(f32(x->a), {t, 1, 1, kdim}) : mx::reshape(f32(x->a), {t, k, 1, kdim});
    auto y = mx::gather_mm(xs, mx::swapaxes(w, -1, -2), std::nullopt, idx);  // [T, k, 1, N]
    y = mx::reshape(y, {t, k, n});
    y = mx::where(mx::expand_dims(valid, -1), y, mx::array(0.0f));
    *out = wrap(mx::reshape(y, {t * k, n}));
  })
}

int mlxb_gather_qmm(const mlxb_array* x, const mlxb_array* indices, const mlxb_array* w, const mlxb_array* scales,
                    const mlxb_array* biases, int bits, int group, int x_per_token, mlxb_array** out) {
  MLXB_TRY({
    int t = indices->a.shape(0), k = indices->a.shape(1);
    int kdim = x->a.shape(1);
    int n = w->a.shape(1);
    int experts = w->a.shape(0);
    // Clamped: MLX does not bound-check the gather (the executor checks indices it can see).
    auto idx = mx::astype(mx::clip(f32(indices->a), mx::array(0.0f), mx::array(static_cast<float>(experts - 1))),
                          mx::uint32);
    auto xs = x_per_token ? mx::reshape(f32(x->a), {t, 1, 1, kdim}) : mx::reshape(f32(x->a), {t, k, 1, kdim});
    auto y = mx::gather_qmm(xs, w->a, f32(scales->a), f32(biases->a), std::nullopt, idx, true, group, bits, "affine");
    *out = wrap(mx::reshape(y, {t * k, n}));
  })
}

int mlxb_weighted_sum(const mlxb_array* y, const mlxb_array* w, int t, int k, mlxb_array** out) {
  MLXB_TRY({
    int n = y->a.shape(1);
    auto ys = mx::reshape(f32(y->a), {t, k, n});
    auto ws = mx::reshape(f32(w->a), {t, k, 1});
    *out = wrap(mx::sum(mx::multiply(ys, ws), 1));
  })
}

int mlxb_pool_mean(const mlxb_array* x, const mlxb_array* weights, mlxb_array** out) {
  MLXB_TRY({ *out = wrap(mx::matmul(f32(weights->a), f32(x->a))); })
}

int mlxb_pool_pick(const mlxb_array* x, const mlxb_array* rows, const mlxb_array* present, mlxb_array** out) {
  MLXB_TRY({
    auto picked = mx::take(f32(x->a), rows->a, 0);
    auto keep = mx::expand_dims(mx::greater(f32(present->a), mx::array(0.0f)), -1);
    *out = wrap(mx::where(keep, picked, mx::array(0.0f)));
  })
}

int mlxb_attend(const mlxb_array* q, const mlxb_array* k, const mlxb_array* v, const mlxb_array* mask, int hq,
                int hkv, int dh, float scale, float softcap, mlxb_array** out) {
  MLXB_TRY({
    const mx::array* m = mask ? &mask->a : nullptr;
    *out = wrap(attend(q->a, k->a, v->a, m, hq, hkv, dh, scale, softcap));
  })
}

int mlxb_conv1d(const mlxb_array* x, const mlxb_array* w, const mlxb_array* bias, int stride, int padding, int groups,
                int torch_layout, mlxb_array** out) {
  MLXB_TRY({
    auto wf = f32(w->a);
    if (torch_layout) wf = mx::swapaxes(wf, 1, 2);  // [C_out, C_in/g, K] -> [C_out, K, C_in/g]
    auto xs = mx::expand_dims(f32(x->a), 0);      // [1, L, C_in]
    auto y = mx::conv1d(xs, wf, stride, padding, 1, groups);
    y = mx::squeeze(y, 0);  // [L_out, C_out]
    if (bias) y = mx::add(y, f32(bias->a));
    *out = wrap(y);
  })
}

int mlxb_flat_read(const mlxb_array* state, int64_t offset, int64_t len, mlxb_array** out) {
  MLXB_TRY({
    auto flat = mx::reshape(state->a, {-1});
    *out = wrap(mx::slice(flat, {static_cast<int>(offset)}, {static_cast<int>(offset + len)}));
  })
}

int mlxb_flat_write(const mlxb_array* state, int64_t offset, const mlxb_array* data, mlxb_array** out) {
  MLXB_TRY({
    auto shape = state->a.shape();
    auto flat = mx::reshape(state->a, {-1});
    auto d = mx::astype(mx::reshape(data->a, {-1}), flat.dtype());
    int off = static_cast<int>(offset);
    flat = mx::slice_update(flat, d, mx::Shape{off}, mx::Shape{off + static_cast<int>(d.size())});
    *out = wrap(mx::reshape(flat, shape));
  })
}

int mlxb_concat_cols(const mlxb_array* a, const mlxb_array* b, mlxb_array** out) {
  MLXB_TRY({ *out = wrap(mx::concatenate({f32(a->a), f32(b->a)}, 1)); })
}

int mlxb_cross_attend(const mlxb_array* q, const mlxb_array* state, int64_t row_offset, int max_len, int header,
                      int hq, int hkv, int dh, float scale, float softcap, mlxb_array** out) {
  MLXB_TRY({
    int kv_row = hkv * dh;
    int base = static_cast<int>(row_offset);
    auto flat = mx::reshape(state->a, {-1});
    auto len = mx::view(mx::slice(flat, {base}, {base + 1}), mx::uint32);  // [1]
    auto rows = mx::reshape(mx::slice(flat, {base + header}, {base + header + max_len * 2 * kv_row}),
                            {max_len, 2 * kv_row});
    auto k = mx::slice(rows, {0, 0}, {max_len, kv_row});
    auto v = mx::slice(rows, {0, kv_row}, {max_len, 2 * kv_row});
    auto visible = mx::less(mx::arange(0, max_len, mx::uint32), len);  // [L]
    auto mask = mx::reshape(mx::where(visible, mx::array(0.0f), mx::array(-INFINITY)), {1, max_len});
    auto o = attend(q->a, k, v, &mask, hq, hkv, dh, scale, softcap);
    *out = wrap(mx::where(mx::greater(len, mx::array(0u, mx::uint32)), o, mx::array(0.0f)));
  })
}

}  // extern "C"
