// Fused element-wise ops of the Llama-family forward on the CPU (compiler/kernels/cpu_fused.py builds and
// loads this; the eager torch ops in engine/models/llama.py are the definition they are tested
// against). Each op reads and writes its rows once instead of the 3-8 eager ops it replaces.
//
// Rounding follows the eager ops exactly, so float32 results are the same products and sums
// (built with -ffp-contract=off: no fused multiply-adds the eager code does not do), and
// bfloat16 results round where the eager ops round (every torch op's output is bfloat16):
//   rms_norm:     y = w * bf16(x * r)           (offset: bf16(x * r * (offset + w)))
//   add_rms_norm: residual = bf16(residual + delta), then rms_norm of it
//   silu_and_mul: y = bf16(bf16(silu(gate)) * up)
//   rope_:        x = bf16(bf16(x * c) + bf16(rot * s)), c and s rounded to bf16 first
// r = 1 / sqrt(mean(x^2) + eps) is accumulated in float32, 16 partial sums (eager sums in another order:
// results agree to float32 rounding, not bit for bit).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <thread>
#include <vector>

namespace {

constexpr int64_t kGrainElements = 16384;  // below this many elements per thread: one thread
constexpr int64_t kLanes = 16;             // partial sums of a row's squares: one AVX-512 register

#include "cpu_bits.inc"  // float_bits, bits_float, bf16_bits

template <typename T>
inline float round_to(float v) { return v; }
template <>
inline float round_to<c10::BFloat16>(float v) { return bits_float(bf16_bits(v)); }

inline void load_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void load_row(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* b = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = bits_float(static_cast<uint32_t>(b[i]) << 16);
}
inline void store_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_row(const float* src, c10::BFloat16* dst, int64_t n) {
  uint16_t* b = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) b[i] = static_cast<uint16_t>(bf16_bits(src[i]) >> 16);
}

// f(T{}) for the tensor dtypes these ops take: float32 and bfloat16.
template <typename F>
void dispatch(at::ScalarType type, F f) {
  if (type == at::kFloat) f(float{});
  else if (type == at::kBFloat16) f(c10::BFloat16{});
  else TORCH_CHECK(false, "kiln_cpu_fused: float32 or bfloat16 only, got ", type);
}

int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name,
              " must be float32 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() >= 1 && t.stride(-1) == 1, name, " must have a contiguous last dimension");
}

void check_weight(const at::Tensor& weight, const at::Tensor& x, int64_t n) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == n && weight.is_contiguous(), "weight must be a contiguous [", n,
              "] tensor");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight must have the activations' dtype");
}

// One row of RMSNorm from its float values v: y = norm(v) * w as the eager RMSNorm rounds it.
template <typename T>
inline void norm_row(const float* v, const float* w, T* y, float* out, int64_t n, float eps, float offset) {
  float acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) acc[l] += v[j + l] * v[j + l];
  for (int64_t l = 0; j < n; ++j, ++l) acc[l] += v[j] * v[j];
  float sum = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) sum += acc[l];
  const float r = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  if (offset != 0.f) {
    for (int64_t i = 0; i < n; ++i) out[i] = v[i] * r * (offset + w[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = w[i] * round_to<T>(v[i] * r);
  }
  store_row(out, y, n);
}

// The rows of x (any leading shape, rows at a fixed stride) normalised into a new contiguous tensor.
at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& weight, double eps, double offset) {
  check_rows(x_in, "x");
  const int64_t n = x_in.size(-1);
  check_weight(weight, x_in, n);
  at::Tensor x = x_in.reshape({-1, n});
  if (x.stride(1) != 1) x = x.contiguous();
  at::Tensor y = at::empty(x_in.sizes(), x_in.options());
  const int64_t rows = x.size(0), x_stride = x.stride(0);
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
      std::vector<float> buf(3 * n);
      float *v = buf.data(), *w = v + n, *out = w + n;
      load_row(wp, w, n);
      for (int64_t i = begin; i < end; ++i) {
        load_row(xp + i * x_stride, v, n);
        norm_row(v, w, yp + i * n, out, n, static_cast<float>(eps), static_cast<float>(offset));
      }
    });
  });
  return y;
}

// residual += delta (in place, residual's dtype), returns rms_norm(residual).
at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& delta, const at::Tensor& weight, double eps,
                        double offset) {
  check_rows(residual, "residual");
  check_rows(delta, "delta");
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous(), "residual must be a contiguous [T, H] tensor");
  TORCH_CHECK(delta.dim() == 2 && delta.sizes() == residual.sizes() && delta.scalar_type() == residual.scalar_type(),
              "delta must match residual's shape and dtype");
  const int64_t rows = residual.size(0), n = residual.size(1), d_stride = delta.stride(0);
  check_weight(weight, residual, n);
  at::Tensor y = at::empty_like(residual);
  dispatch(residual.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    T* rp = residual.data_ptr<T>();
    const T* dp = delta.data_ptr<T>();
    const T* wp = weight.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t begin, int64_t end) {
      std::vector<float> buf(4 * n);
      float *v = buf.data(), *d = v + n, *w = d + n, *out = w + n;
      load_row(wp, w, n);
      for (int64_t i = begin; i < end; ++i) {
        load_row(rp + i * n, v, n);
        load_row(dp + i * d_stride, d, n);
        for (int64_t j = 0; j < n; ++j) v[j] = round_to<T>(v[j] + d[j]);
        store_row(v, rp + i * n, n);
        norm_row(v, w, yp + i * n, out, n, static_cast<float>(eps), static_cast<float>(offset));
      }
    });
  });
  return y;
}

// exp(x) in plain arithmetic (Cephes' expf: range reduction by ln 2, degree-6 polynomial, ~1 ulp)
// so that the compiler vectorises the activation loops; std::exp is a scalar libm call (~4 ns).
inline float exp_approx(float x) {
  x = std::min(88.3762626647949f, std::max(-87.3365447505531f, x));
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest (1.5 * 2^23)
  x = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * x + 1.3981999507e-3f;
  p = p * x + 8.3334519073e-3f;
  p = p * x + 4.1665795894e-2f;
  p = p * x + 1.6666665459e-1f;
  p = p * x + 5.0000001201e-1f;
  p = p * x * x + x + 1.f;
  return p * bits_float(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
}

inline float silu(float v) { return v / (1.f + exp_approx(-v)); }

inline float gelu_tanh(float v) {
  const float z = 0.7978845608028654f * (v + 0.044715f * v * v * v);  // sqrt(2 / pi) (v + 0.044715 v^3)
  const float tanh_z = 1.f - 2.f / (exp_approx(2.f * z) + 1.f);
  return 0.5f * v * (1.f + tanh_z);
}

template <typename T, float (*Act)(float)>
inline void act_mul_row(float* g, float* u, int64_t n) {
  for (int64_t j = 0; j < n; ++j) g[j] = round_to<T>(Act(g[j])) * u[j];
}

// [T, 2I] (gate columns, then up columns) -> [T, I] = act(gate) * up.
at::Tensor silu_and_mul(const at::Tensor& x, bool gelu) {
  check_rows(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "x must be [T, 2 * I]");
  const int64_t rows = x.size(0), inter = x.size(1) / 2, x_stride = x.stride(0);
  at::Tensor y = at::empty({rows, inter}, x.options());
  dispatch(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* xp = x.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    at::parallel_for(0, rows, grain_rows(inter), [&](int64_t begin, int64_t end) {
      std::vector<float> buf(2 * inter);
      float *g = buf.data(), *u = g + inter;
      for (int64_t i = begin; i < end; ++i) {
        load_row(xp + i * x_stride, buf.data(), 2 * inter);
        if (gelu) act_mul_row<T, gelu_tanh>(g, u, inter);
        else act_mul_row<T, silu>(g, u, inter);
        store_row(g, yp + i * inter, inter);
      }
    });
  });
  return y;
}

// Rotates the first rot dims of every head of x [T, H, D] in place, as the eager apply_rope
// (halves: (x[j], x[j + rot/2]) together) or apply_interleaved_rope (pairs (x[2i], x[2i+1])).
// cos_sin [positions, 2 * rot]: cos then sin of each dim's angle.
template <typename T, typename C>
void rope_heads(at::Tensor& x, const int64_t* pos, const C* table, int64_t rot, bool interleaved) {
  const int64_t tokens = x.size(0), heads = x.size(1);
  const int64_t t_stride = x.stride(0), h_stride = x.stride(1);
  T* xp = x.data_ptr<T>();
  const int64_t half = rot / 2;
  at::parallel_for(0, tokens, grain_rows(heads * rot), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(4 * rot);
    float *cs = buf.data(), *v = cs + 2 * rot, *o = v + rot;
    const float *c = cs, *s = cs + rot;
    for (int64_t t = begin; t < end; ++t) {
      load_row(table + pos[t] * 2 * rot, cs, 2 * rot);
      for (int64_t j = 0; j < 2 * rot; ++j) cs[j] = round_to<T>(cs[j]);
      for (int64_t h = 0; h < heads; ++h) {
        T* head = xp + t * t_stride + h * h_stride;
        load_row(head, v, rot);
        if (interleaved) {  // (x0, x1) -> (-x1, x0)
          for (int64_t j = 0; j < rot; j += 2) {
            o[j] = -v[j + 1];
            o[j + 1] = v[j];
          }
        } else {  // (lo, hi) -> (-hi, lo)
          for (int64_t j = 0; j < half; ++j) {
            o[j] = -v[j + half];
            o[j + half] = v[j];
          }
        }
        for (int64_t j = 0; j < rot; ++j) v[j] = round_to<T>(v[j] * c[j]) + round_to<T>(o[j] * s[j]);
        store_row(v, head, rot);
      }
    }
  });
}

void check_rope_target(const at::Tensor& x, const at::Tensor& positions, int64_t rot, const char* name) {
  check_rows(x, name);
  TORCH_CHECK(x.dim() == 3 && x.size(0) == positions.size(0), name, " must be [T, heads, head_dim]");
  TORCH_CHECK(rot <= x.size(2) && rot % 2 == 0, name, ": rotary dims ", rot, " do not fit");
}

void rope_(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& cos_sin, bool interleaved) {
  TORCH_CHECK(positions.dim() == 1 && positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "positions must be a contiguous int64 [T] tensor");
  TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.is_contiguous() && cos_sin.size(1) % 2 == 0, "cos_sin must be [P, 2 * rot]");
  const int64_t rot = cos_sin.size(1) / 2;
  check_rope_target(q, positions, rot, "q");
  check_rope_target(k, positions, rot, "k");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "q and k must have one dtype");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos_sin.size(0);
  for (int64_t t = 0; t < positions.size(0); ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position ", pos[t], " outside the rotary table [0, ", max_pos, ")");
  dispatch(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    dispatch(cos_sin.scalar_type(), [&](auto table_tag) {
      using C = decltype(table_tag);
      const C* table = cos_sin.data_ptr<C>();
      rope_heads<T, C>(q, pos, table, rot, interleaved);
      rope_heads<T, C>(k, pos, table, rot, interleaved);
    });
  });
}

#include "cpu_decoder_stack.inc"

}  // namespace

TORCH_LIBRARY(kiln_cpu_fused, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, float offset) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) residual, Tensor delta, Tensor weight, float eps, float offset) -> Tensor");
  m.def("silu_and_mul(Tensor x, bool gelu_tanh) -> Tensor");
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos_sin, bool interleaved) -> ()");
  m.class_<stack::DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, bool, bool, int64_t, at::Tensor,
                       at::Tensor>())
      .def("add_layer", &stack::DecoderStack::add_layer)
      .def("add_dense", &stack::DecoderStack::add_dense)
      .def("add_packed", &stack::DecoderStack::add_packed)
      .def("num_layers", &stack::DecoderStack::num_layers)
      .def("set_team_rows", &stack::DecoderStack::set_team_rows)
      .def("team_rows", &stack::DecoderStack::team_rows)
      .def("set_team_max_keys", &stack::DecoderStack::set_team_max_keys)
      .def("team_max_keys", &stack::DecoderStack::team_max_keys)
      .def("forward", &stack::DecoderStack::forward);
}

TORCH_LIBRARY_IMPL(kiln_cpu_fused, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rope_", &rope_);
}
