// Weight-streaming linear layers for the CPU: y = x W^T (+ bias) for a few rows of x, whose cost
// is reading W once (compiler/cpu_gemv.py builds and loads this; the reference each kernel is
// tested against is dequantise-then-F.linear, tests/test_cpu_gemv.py).
//
// Weight formats, each read in the layout it is kept in (rows of blocks, one output row after
// another; no copy made at call time):
//   dense       float32 / bfloat16 / float16 [N, K]
//   GGUF        the file's own blocks, [N, K / block * block_bytes] bytes: Q4_0, Q4_1, Q5_0, Q5_1,
//               Q8_0 (blocks of 32) and Q4_K, Q5_K, Q6_K (super-blocks of 256), ggml type ids
//   kiln int4   [N, K / 2] bytes, 16 per block of 32 in GGUF's nibble order, with a float32 scale
//               s and a uint8 zero point z per (row, group): w = s * (q - z) (GPTQ, AWQ,
//               compressed-tensors after the loader's repack)
//   kiln int8   [N, K] bytes, unsigned, the same scales and zero points
//
// Two activation paths for the quantised formats:
//   int    x quantised per block of 32 to int8 (scale amax / 127, round to nearest even), integer
//          dot products per block (vpmaddubsw or vpdpbusd), one float multiply-add per block: as
//          llama.cpp does. Cheapest arithmetic; adds the activations' rounding (~0.4% of a block's
//          largest value per element).
//   float  x stays float; each block's weights are converted to float in registers. Products are
//          exact, so results equal dequantise-then-matmul up to the order of the float sums.
//
// Threads: output rows in tiles of 4, the tiles split over the intra-op (OpenMP) threads, each
// running every activation row against its tile while it is in L1.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define KILN_X86 1
#else
#define KILN_X86 0
#endif

namespace kiln_gemv {

// ggml type ids for the GGUF formats; kiln's own layouts after them.
enum Format : int64_t {
  kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
  kInt4 = 1004, kInt8 = 1008,
};

struct WBf16 {};
struct WF16 {};

inline float bits_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}
inline float bf16_to_f32(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }
inline float f16_to_f32(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }
inline float weight_value(float v) { return v; }
inline float weight_value(c10::BFloat16 v) { return static_cast<float>(v); }
inline float weight_value(c10::Half v) { return static_cast<float>(v); }

// Activations quantised per block of 32: q [rows, K], per block the scale d, d * sum(q) and the
// sums of q's two halves (Q6_K's scales cover 16 values).
struct QAct {
  const int8_t* q;
  const float* d;
  const float* ds;
  const int32_t* s16;
  int64_t k;
};

// Float activations: row i at x + i * stride; per half block (16 values) its sum.
struct FAct {
  const float* x;
  int64_t stride;
  const float* half_sums;
};

struct QuantWeights {
  const uint8_t* data;
  int64_t n, k, row_bytes;
  const float* scales;  // kiln int4/int8: [N, groups]
  const uint8_t* zeros;
  int64_t groups;
};

// Writes out[m, n] = value + bias[n] in the output's dtype (bfloat16: round to nearest even).
struct Store {
  char* out;
  int64_t stride;  // elements
  bool bf16;
  const float* bias;
  inline void operator()(int64_t m, int64_t n, float v) const {
    if (bias != nullptr) v += bias[n];
    if (bf16) {
      uint32_t b;
      std::memcpy(&b, &v, sizeof b);
      const uint32_t rounded = (b + 0x7fffu + ((b >> 16) & 1u)) >> 16;
      const uint16_t h = (b & 0x7fffffffu) > 0x7f800000u ? 0x7fc0 : static_cast<uint16_t>(rounded);
      std::memcpy(out + (m * stride + n) * 2, &h, 2);
    } else {
      std::memcpy(out + (m * stride + n) * 4, &v, 4);
    }
  }
};

// Q4_K / Q5_K super-block header: d, dmin (f16), 12 bytes of 6-bit scales and mins (ggml's
// get_scale_min_k4) -> per block w = d * scale * q - dmin * min.
template <class F16>
inline void k4_header(const uint8_t* b, float* d, float* m, F16 f16) {
  const float dd = f16(b), dmin = f16(b + 2);
  const uint8_t* q = b + 4;
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    if (j < 4) {
      sc = q[j] & 63;
      mn = q[j + 4] & 63;
    } else {
      sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
      mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
    d[j] = dd * static_cast<float>(sc);
    m[j] = -dmin * static_cast<float>(mn);
  }
}

// Each level: its vector API, row cursors, tiles and entry points (templates/cpu_gemv_isa.inc).
#define KILN_DECLARE_LEVEL                                                                      \
  void to_float_rows(const at::BFloat16* x, int64_t rows, int64_t k, int64_t stride, float* out); \
  void half_sums(const float* x, int64_t rows, int64_t k, int64_t stride, float* out);          \
  void quantize_acts(const float* x, int64_t rows, int64_t k, int64_t stride, int8_t* q, float* d, \
                     float* ds, int32_t* s16);                                                   \
  void gemv_quant(int64_t format, const QuantWeights& w, const QAct* qa, const FAct* fa,         \
                  int64_t m_total, const Store& store, int64_t grain);                           \
  void gemv_dense(const at::Tensor& w, const FAct& fa, int64_t m_total, const Store& store, int64_t grain);

namespace isa_generic {
KILN_DECLARE_LEVEL
#define KILN_ISA 0
#include "cpu_gemv_isa.inc"
#undef KILN_ISA
}  // namespace isa_generic

#if KILN_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace isa_avx2 {
KILN_DECLARE_LEVEL
#define KILN_ISA 1
#include "cpu_gemv_isa.inc"
#undef KILN_ISA
}  // namespace isa_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avxvnni")
namespace isa_avx2_vnni {
KILN_DECLARE_LEVEL
#define KILN_ISA 2
#include "cpu_gemv_isa.inc"
#undef KILN_ISA
}  // namespace isa_avx2_vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
namespace isa_avx512 {
KILN_DECLARE_LEVEL
#define KILN_ISA 3
#include "cpu_gemv_isa.inc"
#undef KILN_ISA
}  // namespace isa_avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")
namespace isa_avx512_vnni {
KILN_DECLARE_LEVEL
#define KILN_ISA 4
#include "cpu_gemv_isa.inc"
#undef KILN_ISA
}  // namespace isa_avx512_vnni
#pragma GCC pop_options
#endif

constexpr const char* kLevelNames[] = {"generic", "avx2", "avx2_vnni", "avx512", "avx512_vnni"};
constexpr int64_t kLevels = 5;

// The highest level this CPU runs.
int64_t cpu_level() {
#if KILN_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (!avx2) return 0;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq"))
    return __builtin_cpu_supports("avx512vnni") ? 4 : 3;
  return __builtin_cpu_supports("avxvnni") ? 2 : 1;
#else
  return 0;
#endif
}

// Whether this CPU runs `level` (levels are not a strict ladder: AVX-VNNI without AVX-512).
bool level_runs(int64_t level) {
  const int64_t top = cpu_level();
  if (level == 0) return true;
#if KILN_X86
  if (level == 2) return top == 2 || (top >= 1 && __builtin_cpu_supports("avxvnni"));
  return level <= top;
#else
  return false;
#endif
}

struct Level {
  decltype(&isa_generic::to_float_rows) to_float_rows;
  decltype(&isa_generic::half_sums) half_sums;
  decltype(&isa_generic::quantize_acts) quantize_acts;
  decltype(&isa_generic::gemv_quant) gemv_quant;
  decltype(&isa_generic::gemv_dense) gemv_dense;
};

#define KILN_LEVEL_ENTRY(ns) Level{&ns::to_float_rows, &ns::half_sums, &ns::quantize_acts, &ns::gemv_quant, &ns::gemv_dense}

Level level_of(int64_t level) {
  TORCH_CHECK(level >= 0 && level < kLevels, "kiln_cpu_gemv: ISA level ", level, " does not exist (0..", kLevels - 1, ")");
  TORCH_CHECK(level_runs(level), "kiln_cpu_gemv: this CPU cannot run the ", kLevelNames[level], " kernels");
  switch (level) {
#if KILN_X86
    case 1: return KILN_LEVEL_ENTRY(isa_avx2);
    case 2: return KILN_LEVEL_ENTRY(isa_avx2_vnni);
    case 3: return KILN_LEVEL_ENTRY(isa_avx512);
    case 4: return KILN_LEVEL_ENTRY(isa_avx512_vnni);
#endif
    default: return KILN_LEVEL_ENTRY(isa_generic);
  }
}

// ---------------------------------------------------------------- ops

constexpr int64_t kMinBytesPerThread = 48 * 1024;  // below this much weight per thread: fewer threads

int64_t grain_tiles(int64_t n, int64_t row_bytes) {
  const int64_t tile_bytes = std::max<int64_t>(1, 4 * row_bytes);
  return std::max<int64_t>(1, kMinBytesPerThread / tile_bytes);
}

void check_acts(const at::Tensor& x, int64_t k) {
  TORCH_CHECK(x.device().is_cpu(), "kiln_cpu_gemv: x must be a CPU tensor");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == k, "kiln_cpu_gemv: x must be [M, ", k, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "kiln_cpu_gemv: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.size(0) <= 1 || x.stride(0) >= k, "kiln_cpu_gemv: x's rows overlap");
  TORCH_CHECK(x.stride(1) == 1, "kiln_cpu_gemv: x must have contiguous rows");
}

void check_out(const at::Tensor& out, int64_t m, int64_t n) {
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 2 && out.size(0) == m && out.size(1) == n,
              "kiln_cpu_gemv: out must be a CPU [", m, ", ", n, "] tensor, got ", out.sizes());
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16,
              "kiln_cpu_gemv: out must be float32 or bfloat16");
  TORCH_CHECK(out.stride(1) == 1 && (m <= 1 || out.stride(0) >= n), "kiln_cpu_gemv: out must have contiguous rows");
}

// Float activations, converted from bfloat16 into `storage` when needed.
FAct float_acts(const Level& lv, const at::Tensor& x, std::vector<float>& storage) {
  const int64_t m = x.size(0), k = x.size(1);
  if (x.scalar_type() == at::kFloat) return FAct{x.data_ptr<float>(), m > 1 ? x.stride(0) : k, nullptr};
  storage.resize(m * k);
  lv.to_float_rows(x.data_ptr<at::BFloat16>(), m, k, m > 1 ? x.stride(0) : k, storage.data());
  return FAct{storage.data(), k, nullptr};
}

struct Bias {
  std::vector<float> values;
  const float* ptr = nullptr;
  Bias(const c10::optional<at::Tensor>& bias, int64_t n) {
    if (!bias.has_value() || !bias->defined()) return;
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n, "kiln_cpu_gemv: bias must be [", n, "]");
    at::Tensor b = bias->to(at::kFloat).contiguous();
    values.assign(b.data_ptr<float>(), b.data_ptr<float>() + n);
    ptr = values.data();
  }
};

Store make_store(at::Tensor& out, const Bias& bias) {
  return Store{static_cast<char*>(out.data_ptr()), out.size(0) > 1 ? out.stride(0) : out.size(1),
               out.scalar_type() == at::kBFloat16, bias.ptr};
}

// out = x @ weight^T + bias, weight float32 / bfloat16 / float16 [N, K] (contiguous).
void linear_dense(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, int64_t isa,
                  at::Tensor out) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.device().is_cpu(),
              "kiln_cpu_gemv: weight must be a contiguous CPU [N, K] tensor");
  const int64_t n = weight.size(0), k = weight.size(1), m = x.size(0);
  check_acts(x, k);
  check_out(out, m, n);
  if (m == 0 || n == 0) return;
  const Level lv = level_of(isa);
  std::vector<float> storage;
  const FAct fa = float_acts(lv, x, storage);
  const Bias b(bias, n);
  lv.gemv_dense(weight, fa, m, make_store(out, b), grain_tiles(n, k * weight.element_size()));
}

int64_t block_bytes(int64_t format, int64_t* block) {
  *block = 32;
  switch (format) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ8_0: return 34;
    case kQ4_K: *block = 256; return 144;
    case kQ5_K: *block = 256; return 176;
    case kQ6_K: *block = 256; return 210;
    case kInt4: return 16;
    case kInt8: return 32;
    default: TORCH_CHECK(false, "kiln_cpu_gemv: unknown weight format ", format);
  }
}

// out = x @ W^T + bias for W quantised in `format` (data: [N, row bytes] uint8; scales / zeros
// [N, groups] for kiln's int4 / int8). int_acts: the int path, else the float path.
void linear_quant(const at::Tensor& x, const at::Tensor& data, int64_t format, int64_t k,
                  const c10::optional<at::Tensor>& scales, const c10::optional<at::Tensor>& zeros,
                  const c10::optional<at::Tensor>& bias, int64_t isa, bool int_acts, at::Tensor out) {
  int64_t block;
  const int64_t bb = block_bytes(format, &block);
  TORCH_CHECK(k > 0 && k % block == 0, "kiln_cpu_gemv: K = ", k, " is not a whole number of blocks of ", block);
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == at::kByte && data.dim() == 2 && data.is_contiguous(),
              "kiln_cpu_gemv: data must be a contiguous CPU uint8 [N, row bytes] tensor");
  const int64_t n = data.size(0), m = x.size(0), row_bytes = k / block * bb;
  TORCH_CHECK(data.size(1) == row_bytes, "kiln_cpu_gemv: rows of ", data.size(1), " bytes, expected ", row_bytes,
              " for K = ", k);
  check_acts(x, k);
  check_out(out, m, n);
  QuantWeights w{data.data_ptr<uint8_t>(), n, k, row_bytes, nullptr, nullptr, 0};
  if (format == kInt4 || format == kInt8) {
    TORCH_CHECK(scales.has_value() && zeros.has_value(), "kiln_cpu_gemv: int formats need scales and zeros");
    TORCH_CHECK(scales->scalar_type() == at::kFloat && scales->is_contiguous() && scales->dim() == 2 &&
                    scales->size(0) == n,
                "kiln_cpu_gemv: scales must be a contiguous float32 [N, groups] tensor");
    const int64_t g = scales->size(1);
    TORCH_CHECK(g > 0 && (k / 32) % g == 0, "kiln_cpu_gemv: ", g, " groups do not split K = ", k, " into blocks of 32");
    TORCH_CHECK(zeros->scalar_type() == at::kByte && zeros->is_contiguous() && zeros->sizes() == scales->sizes(),
                "kiln_cpu_gemv: zeros must be a contiguous uint8 tensor shaped like scales");
    w.scales = scales->data_ptr<float>();
    w.zeros = zeros->data_ptr<uint8_t>();
    w.groups = g;
  }
  if (m == 0 || n == 0) return;
  const Level lv = level_of(isa);
  std::vector<float> storage, sums_f;
  const FAct fa0 = float_acts(lv, x, storage);
  const Bias b(bias, n);
  const Store store = make_store(out, b);
  const int64_t grain = grain_tiles(n, row_bytes);
  if (int_acts) {
    const int64_t nb = k / 32;
    std::vector<int8_t> q(m * k);
    std::vector<float> d(m * nb), ds(m * nb);
    std::vector<int32_t> s16(m * nb * 2);
    lv.quantize_acts(fa0.x, m, k, fa0.stride, q.data(), d.data(), ds.data(), s16.data());
    const QAct qa{q.data(), d.data(), ds.data(), s16.data(), k};
    lv.gemv_quant(format, w, &qa, nullptr, m, store, grain);
  } else {
    sums_f.resize(m * (k / 16));
    lv.half_sums(fa0.x, m, k, fa0.stride, sums_f.data());
    const FAct fa{fa0.x, fa0.stride, sums_f.data()};
    lv.gemv_quant(format, w, nullptr, &fa, m, store, grain);
  }
}

int64_t best_level() { return cpu_level(); }

std::vector<int64_t> levels() {
  std::vector<int64_t> out;
  for (int64_t l = 0; l < kLevels; ++l)
    if (level_runs(l)) out.push_back(l);
  return out;
}

}  // namespace kiln_gemv

TORCH_LIBRARY(kiln_cpu_gemv, m) {
  m.def("levels() -> int[]", &kiln_gemv::levels);
  m.def("linear_dense(Tensor x, Tensor weight, Tensor? bias, int isa, Tensor(a!) out) -> ()");
  m.def("linear_quant(Tensor x, Tensor data, int format, int k, Tensor? scales, Tensor? zeros, Tensor? bias, "
        "int isa, bool int_acts, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(kiln_cpu_gemv, CPU, m) {
  m.impl("linear_dense", &kiln_gemv::linear_dense);
  m.impl("linear_quant", &kiln_gemv::linear_quant);
}
