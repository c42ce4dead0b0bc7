// Weight-streaming linear layers for the CPU: y = x W^T (+ bias) for a few rows of x, whose cost
// is reading W once (compiler/kernels/cpu_gemv.py builds and loads this; tests/compiler/test_cpu_gemv.py checks
// every kernel against dequantise-then-matmul).
//
// Dense weights (float32 / bfloat16 / float16 [N, K]) are read as they are. Quantised weights are
// repacked once, at load (`pack`), from the GGUF file's blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0;
// Q4_K, Q5_K, Q6_K) or from kiln's integer layouts (int4 / int8 values with a float32 scale and a
// uint8 zero point per group of columns: GPTQ, AWQ, compressed-tensors), into one layout:
//
//   groups of 16 output rows, one after another; each group a run of super-blocks (1 block of 32
//   values for the basic formats, 8 for the K-quants, one column group for kiln's int formats):
//   a header with the scales of the 16 rows, then per block of 32 values its quant planes, which
//   give 8 vectors V[kk] (kk = 0..7) of 64 bytes: byte 4r + i of V[kk] = value 4kk + i of row r.
//     4 bits: 4 x 64 bytes, low nibbles V[c], high nibbles V[c + 4]
//     5 bits: + 64 bytes, bit kk of byte b = the fifth bit of V[kk] byte b
//     6 bits: + 2 x 64 bytes, bits 2kk, 2kk + 1 (kk < 4; then kk - 4 in the second) = bits 4, 5
//     8 bits: V[0] .. V[7] (unsigned: Q8_0 stored as q + 128)
//   Headers, each field for the 16 rows in a row (w = d * q + m per value):
//     Q4_0 / Q5_0 / Q8_0: d f16      (m = -8 d / -16 d / -128 d)
//     Q4_1 / Q5_1:        d f16, m f16
//     Q4_K / Q5_K:        d f16, dmin f16, then per block scale u8, min u8 (d * scale, -dmin * min)
//     Q6_K:               d f16, then per block the int8 scales of its halves (d * scale, -32 d * scale)
//     kiln int:           s f32, z u8                                       (s, -s * z)
//   The same bytes per value as the file (the K-quants: their 6-bit scales unpacked, +3%).
//
// So one 512-bit vpdpbusd (two 256-bit ones; or vpmaddubsw + vpmaddwd) does 4 values of 16 rows
// against 4 activations broadcast, and each block's scales are applied to 16 rows at once.
//
// Two activation paths for the quantised formats:
//   int    x quantised per block of 32 to int8 (scale amax / 127, round to nearest even), integer
//          dot products per block, one float multiply-add per block: as llama.cpp does. Cheapest
//          arithmetic; adds the activations' rounding (~0.4% of a block's largest value).
//   float  x stays float; the weights are dequantised in registers (fma(q, d, m)) and multiplied
//          in float: dequantise-then-matmul up to the order of the float sums.
//
// Threads: row groups (quantised) or tiles of 4 rows (dense) split over the intra-op (OpenMP)
// threads, each running every activation row against its rows while they are in L1.
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

#include "cpu_bits.inc"  // float_bits, bits_float, bf16_bits
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

// Float activations: row i at x + i * stride.
struct FAct {
  const float* x;
  int64_t stride;
};

// Packed quantised weights: n rows of k values in row groups of nsb super-blocks of sub blocks,
// head_bytes of header and sb_bytes in all per super-block.
struct Geometry {
  int64_t n, k, nsb;
  int sub, bits, head_bytes;
  int64_t sb_bytes;
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

// Whether the CPU has AVX-512 BF16 (vdpbf16ps), asked once.
bool cpu_has_bf16_dot() {
#if KILN_X86
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

// One activation row (batch-1 decode) of dense weights: one sequential weight stream per thread
// (row_dense) on AMD, where it beat the tiles by 1.2x (Zen 5, benchmarks/2026-12-02.md session 11); tiles of
// kRows rows on Intel, where the tiles (each prefetching the next into every cache level) stream
// 1.15-1.35x faster than the single stream (Sapphire Rapids, benchmarks/2026-12-03.md session 14). The same sums either way.
bool one_row_as_tiles() {
#if KILN_X86
  static const bool intel = __builtin_cpu_is("intel");
  return intel;
#else
  return false;
#endif
}

// Each level: its vector API, row cursors, tiles and entry points (templates/cpu_gemv_isa.inc).
#define KILN_DECLARE_LEVEL                                                                      \
  void to_float_rows(const at::BFloat16* x, int64_t rows, int64_t k, int64_t stride, float* out); \
  void quantize_acts(const float* x, int64_t rows, int64_t k, int64_t stride, int8_t* q, float* d, \
                     float* ds, int32_t* s16);                                                   \
  void gemv_quant(int64_t format, const uint8_t* data, const Geometry& g, const QAct* qa, const FAct* fa, \
                  int64_t m_total, const Store& store, int64_t grain);                           \
  void gemv_dense(const at::Tensor& w, const FAct& fa, int64_t m_total, const Store& store, int64_t grain); \
  bool gemv_dense_bf16(const at::Tensor& w, const at::Tensor& x, int64_t m_total, const Store& store, int64_t grain); \
  void dequant(int64_t format, const uint8_t* data, const Geometry& g, char* out, bool bf16, int64_t grain);

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

// The highest level this CPU runs (asked once).
int64_t detect_level() {
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

int64_t cpu_level() {
  static const int64_t level = detect_level();
  return level;
}

// Whether this CPU runs `level` (levels are not a strict ladder: AVX-VNNI without AVX-512).
bool detect_runs(int64_t level) {
  const int64_t top = cpu_level();
  if (level == 0) return true;
#if KILN_X86
  if (level == 2) return top == 2 || (top >= 1 && __builtin_cpu_supports("avxvnni"));
  return level <= top;
#else
  return false;
#endif
}

bool level_runs(int64_t level) {
  static const bool runs[] = {detect_runs(0), detect_runs(1), detect_runs(2), detect_runs(3), detect_runs(4)};
  return runs[level];
}

struct Level {
  decltype(&isa_generic::dequant) dequant;
  decltype(&isa_generic::gemv_dense_bf16) gemv_dense_bf16;
  decltype(&isa_generic::to_float_rows) to_float_rows;
  decltype(&isa_generic::quantize_acts) quantize_acts;
  decltype(&isa_generic::gemv_quant) gemv_quant;
  decltype(&isa_generic::gemv_dense) gemv_dense;
};

#define KILN_LEVEL_ENTRY(ns) Level{&ns::dequant, &ns::gemv_dense_bf16, &ns::to_float_rows, &ns::quantize_acts, &ns::gemv_quant, &ns::gemv_dense}

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

// Per-thread scratch reused from call to call (no allocation per decode step).
template <class T>
T* scratch(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  return v.data();
}

struct Scratch {
  std::vector<float> x;
  std::vector<int8_t> q;
  std::vector<float> d, ds;
  std::vector<int32_t> s16;
};

Scratch& scratch() {
  static thread_local Scratch s;
  return s;
}

// Float activations: x itself (float32) or a float32 copy of it in the scratch.
FAct float_acts(const Level& lv, const at::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1), stride = m > 1 ? x.stride(0) : k;
  if (x.scalar_type() == at::kFloat) return FAct{x.data_ptr<float>(), stride};
  float* buf = scratch(scratch().x, m * k);
  lv.to_float_rows(x.data_ptr<at::BFloat16>(), m, k, stride, buf);
  return FAct{buf, k};
}

// out = x @ weight^T + bias, weight float32 / bfloat16 / float16 [N, K] (contiguous).
void linear_dense_out(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias, int64_t isa,
                      at::Tensor out) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.device().is_cpu(),
              "kiln_cpu_gemv: weight must be a contiguous CPU [N, K] tensor");
  const int64_t n = weight.size(0), k = weight.size(1), m = x.size(0);
  check_acts(x, k);
  check_out(out, m, n);
  if (m == 0 || n == 0) return;
  const Level lv = level_of(isa);
  const Bias b(bias, n);
  const Store store = make_store(out, b);
  const int64_t grain = grain_tiles(n, k * weight.element_size());
  if (x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
      lv.gemv_dense_bf16(weight, x, m, store, grain))
    return;
  lv.gemv_dense(weight, float_acts(lv, x), m, store, grain);
}

at::Tensor linear_dense(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                        int64_t isa) {
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  linear_dense_out(x, weight, bias, isa, out);
  return out;
}

// ---------------------------------------------------------------- layout: geometry, pack, dequantize

int qbytes_of(int bits) { return bits == 4 ? 256 : bits == 5 ? 320 : bits == 6 ? 384 : 512; }

// groups: kiln int formats' column groups per row (0 for the GGUF formats).
Geometry geometry(int64_t format, int64_t n, int64_t k, int64_t groups) {
  int sub = 1, bits = 4, head = 32, values = 32;
  switch (format) {
    case kQ4_0: break;
    case kQ4_1: head = 64; break;
    case kQ5_0: bits = 5; break;
    case kQ5_1: bits = 5; head = 64; break;
    case kQ8_0: bits = 8; break;
    case kQ4_K: sub = 8; head = 320; values = 256; break;
    case kQ5_K: bits = 5; sub = 8; head = 320; values = 256; break;
    case kQ6_K: bits = 6; sub = 8; head = 288; values = 256; break;
    case kInt4:
    case kInt8:
      TORCH_CHECK(groups > 0 && k % 32 == 0 && (k / 32) % groups == 0, "kiln_cpu_gemv: ", groups,
                  " groups do not split K = ", k, " into blocks of 32");
      bits = format == kInt4 ? 4 : 8;
      sub = static_cast<int>(k / 32 / groups);
      head = 80;
      values = 32 * sub;
      break;
    default: TORCH_CHECK(false, "kiln_cpu_gemv: unknown weight format ", format);
  }
  TORCH_CHECK(n > 0 && k > 0 && k % values == 0, "kiln_cpu_gemv: K = ", k, " is not a whole number of blocks of ",
              values);
  return Geometry{n, k, k / values, sub, bits, head, head + static_cast<int64_t>(sub) * qbytes_of(bits)};
}

int64_t group_bytes(const Geometry& g) { return g.nsb * g.sb_bytes; }

int64_t gguf_block_bytes(int64_t format) {
  switch (format) {
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ8_0: return 34;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    default: return 0;
  }
}

constexpr int kGroup = 16;  // output rows interleaved per row group

inline uint32_t u32_at(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Row r (of the 16 of a row group) of one super-block, straight from its source into the packed
// layout (this file's header) at `out`, the super-block of the 16 rows: `b` the GGUF row's blocks
// of this super-block (ggml's layouts, as engine/layers/quant/gguf_blocks.py dequantises them), or
// for kiln's int formats the row's 32 * sub values with its scale s and zero point z. Every byte of
// the row's fields and plane bytes is written, so a padding row passes zeros (zero scales, zero
// values). Whole bytes moved, nibbles swapped and bit planes gathered 4 bytes at a time, no
// value-by-value decoding (that was most of a K-quant model's load: issue 40).
template <int64_t F>
void pack_row(const Geometry& g, const uint8_t* b, int r, uint8_t* out, float s = 0.f, uint8_t z = 0) {
  constexpr bool kquant = F == kQ4_K || F == kQ5_K || F == kQ6_K;
  constexpr int bits = F == kQ5_0 || F == kQ5_1 || F == kQ5_K ? 5 : F == kQ6_K ? 6 : F == kInt8 ? 8 : 4;
  constexpr int qb = bits == 4 ? 256 : bits == 5 ? 320 : bits == 6 ? 384 : 512;  // (qbytes_of)
  uint8_t* h = out;
  auto put16 = [&](int at, const uint8_t* from) { std::memcpy(h + at + 2 * r, from, 2); };
  const uint8_t* qs = b;  // 4-bit planes' source
  const uint8_t* qh = nullptr;  // fifth / sixth bits' source
  if constexpr (F == kQ4_0) {
    put16(0, b);
    qs = b + 2;
  } else if constexpr (F == kQ4_1) {
    put16(0, b);
    put16(32, b + 2);
    qs = b + 4;
  } else if constexpr (F == kQ5_0) {
    put16(0, b);
    qh = b + 2;
    qs = b + 6;
  } else if constexpr (F == kQ5_1) {
    put16(0, b);
    put16(32, b + 2);
    qh = b + 4;
    qs = b + 8;
  } else if constexpr (F == kQ4_K || F == kQ5_K) {
    put16(0, b);
    put16(32, b + 2);
    const uint8_t* sc = b + 4;  // ggml's get_scale_min_k4
    for (int j = 0; j < 8; ++j) {
      const bool low = j < 4;
      h[64 + 32 * j + r] = low ? sc[j] & 63 : (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
      h[80 + 32 * j + r] = low ? sc[j + 4] & 63 : (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
    }
    qh = b + 16;
    qs = b + (F == kQ4_K ? 16 : 48);
  } else if constexpr (F == kQ6_K) {
    put16(0, b + 208);
    for (int j = 0; j < 8; ++j) {
      h[32 + 32 * j + r] = b[192 + 2 * j];
      h[48 + 32 * j + r] = b[192 + 2 * j + 1];
    }
    qh = b + 128;  // (qs: ql, at b)
  } else {  // kiln int: b holds the values
    std::memcpy(h + 4 * r, &s, 4);
    h[64 + r] = z;
  }
  uint8_t* p = out + g.head_bytes;
  for (int j = 0; j < g.sub; ++j, p += qb) {
    if constexpr (F == kInt8) {  // byte 4r + i of V[kk]: value 4 kk + i
      for (int kk = 0; kk < 8; ++kk) std::memcpy(p + 64 * kk + 4 * r, b + 32 * j + 4 * kk, 4);
      continue;
    }
    // t[x]: value x in the low nibble, value 16 + x in the high one; byte 4r + i of V[c] / V[c + 4]
    // is value 4c + i / 16 + 4c + i, so t goes in runs of 4 bytes, one per 64-byte vector
    uint8_t t[16];
    const uint8_t* q = qs;  // this block's 32 bytes of nibbles, `nib` the one of them its values are in
    int nib = 2;  // 0: low, 1: high, 2: both (value x low, 16 + x high: the bytes as they are)
    if constexpr (kquant) {
      const int run = F == kQ6_K ? j % 4 : j;  // Q6_K: value 128 half + 32 run + l is in ql[64 half + 32 (run % 2) + l]
      q = F == kQ6_K ? qs + 64 * (j / 4) + 32 * (run & 1) : qs + 32 * (j / 2);  // Q4_K / Q5_K: byte 32 (j / 2) + l
      nib = F == kQ6_K ? run >> 1 : j & 1;
    } else if constexpr (F == kInt4) {
      q = b + 32 * j;
    }
    if (nib == 2) {
      if constexpr (F == kInt4) {
        for (int x = 0; x < 16; ++x) t[x] = q[x] | (q[16 + x] << 4);
      } else {
        std::memcpy(t, q, 16);
      }
    } else if (nib == 1) {
      for (int x = 0; x < 16; ++x) t[x] = (q[x] >> 4) | (q[16 + x] & 0xF0);
    } else {
      for (int x = 0; x < 16; ++x) t[x] = (q[x] & 15) | (q[16 + x] << 4);
    }
    for (int c = 0; c < 4; ++c) std::memcpy(p + 64 * c + 4 * r, t + 4 * c, 4);
    if constexpr (bits == 5) {  // bit kk of byte 4r + i: the fifth bit of value 4 kk + i
      uint32_t v = 0;
      for (int kk = 0; kk < 8; ++kk) {
        uint32_t w;  // byte i: value 4 kk + i's fifth bit
        if constexpr (F == kQ5_K) {
          w = (u32_at(qh + 4 * kk) >> j) & 0x01010101u;
        } else {  // Q5_0 / Q5_1: bit l of a 32-bit field
          const uint32_t nibble = (u32_at(qh) >> (4 * kk)) & 15;
          w = (nibble & 1) | ((nibble >> 1 & 1) << 8) | ((nibble >> 2 & 1) << 16) | ((nibble >> 3 & 1) << 24);
        }
        v |= w << kk;
      }
      std::memcpy(p + 256 + 4 * r, &v, 4);
    } else if constexpr (bits == 6) {  // bits 2m, 2m + 1 of byte 4r + i of plane hh: bits 4, 5 of value 16 hh + 4m + i
      const int half = j / 4, shift = 2 * (j % 4);  // (bits 4, 5 of value 32 run + l: qh[32 half + l] >> 2 run)
      for (int hh = 0; hh < 2; ++hh) {
        uint32_t v = 0;
        for (int m = 0; m < 4; ++m) v |= ((u32_at(qh + 32 * half + 16 * hh + 4 * m) >> shift) & 0x03030303u) << (2 * m);
        std::memcpy(p + 256 + 64 * hh + 4 * r, &v, 4);
      }
    }
  }
}

// pack_row of every row of row groups [g0, g1) of a layer of n rows, each row's super-blocks
// block_bytes apart in its source row (row_stride bytes); padding rows from zeros.
template <int64_t F>
void pack_groups(const Geometry& g, const uint8_t* src, int64_t row_stride, int64_t block_bytes, const float* s,
                 const uint8_t* z, int64_t groups, uint8_t* dst, int64_t g0, int64_t g1) {
  const std::vector<uint8_t> zero(std::max<int64_t>(block_bytes, 256), 0);  // a padding row's source
  for (int64_t gi = g0; gi < g1; ++gi)
    for (int r = 0; r < kGroup; ++r) {  // (row by row: each row's source read once, in order)
      const int64_t row = gi * kGroup + r;
      const bool real = row < g.n;
      for (int64_t sb = 0; sb < g.nsb; ++sb) {
        const uint8_t* b = real ? src + row * row_stride + sb * block_bytes : zero.data();
        uint8_t* o = dst + gi * group_bytes(g) + sb * g.sb_bytes;
        if (s != nullptr)
          pack_row<F>(g, b, r, o, real ? s[row * groups + sb] : 0.f, real ? z[row * groups + sb] : 0);
        else
          pack_row<F>(g, b, r, o);
      }
    }
}

// Checks pack's inputs (below); returns the layout's geometry.
Geometry pack_geometry(const at::Tensor& data, int64_t format, int64_t k, const c10::optional<at::Tensor>& scales,
                       const c10::optional<at::Tensor>& zeros) {
  TORCH_CHECK(data.device().is_cpu() && data.scalar_type() == at::kByte && data.dim() == 2 && data.is_contiguous(),
              "kiln_cpu_gemv: data must be a contiguous CPU uint8 [N, row bytes] tensor");
  const bool kiln_int = format == kInt4 || format == kInt8;
  const int64_t n = data.size(0);
  int64_t groups = 0;
  if (kiln_int) {
    TORCH_CHECK(scales.has_value() && zeros.has_value(), "kiln_cpu_gemv: int formats need scales and zeros");
    TORCH_CHECK(scales->scalar_type() == at::kFloat && scales->is_contiguous() && scales->dim() == 2 &&
                    scales->size(0) == n,
                "kiln_cpu_gemv: scales must be a contiguous float32 [N, groups] tensor");
    TORCH_CHECK(zeros->scalar_type() == at::kByte && zeros->is_contiguous() && zeros->sizes() == scales->sizes(),
                "kiln_cpu_gemv: zeros must be a contiguous uint8 tensor shaped like scales");
    groups = scales->size(1);
    TORCH_CHECK(data.size(1) == k, "kiln_cpu_gemv: int values must be [N, ", k, "]");
    if (format == kInt4) TORCH_CHECK(data.max().item<uint8_t>() < 16, "kiln_cpu_gemv: int4 values above 15");
  }
  const Geometry g = geometry(format, n, k, groups);
  if (!kiln_int) {
    const int64_t row_bytes = g.nsb * gguf_block_bytes(format);
    TORCH_CHECK(data.size(1) == row_bytes, "kiln_cpu_gemv: GGUF rows of ", data.size(1), " bytes, expected ",
                row_bytes, " for K = ", k);
  }
  return g;
}

// GGUF blocks [N, K / block * block bytes] or kiln int values [N, K] (uint8, with scales float32
// and zeros uint8 [N, groups]) -> the packed layout [ceil(N / 16), group bytes], written into `out`
// (uint8, contiguous, that shape: the caller's buffer, e.g. one advised onto huge pages before any
// byte of it is written, or whole row groups of a larger layer's).
void pack_out(const at::Tensor& data, int64_t format, int64_t k, const c10::optional<at::Tensor>& scales,
              const c10::optional<at::Tensor>& zeros, at::Tensor out) {
  const Geometry g = pack_geometry(data, format, k, scales, zeros);
  const bool kiln_int = format == kInt4 || format == kInt8;
  const int64_t n = g.n, groups = kiln_int ? scales->size(1) : 0;
  const int64_t ngroups = (n + kGroup - 1) / kGroup;
  TORCH_CHECK(out.device().is_cpu() && out.scalar_type() == at::kByte && out.is_contiguous() && out.dim() == 2 &&
                  out.size(0) == ngroups && out.size(1) == group_bytes(g),
              "kiln_cpu_gemv: pack into a contiguous uint8 [", ngroups, ", ", group_bytes(g), "] tensor");
  uint8_t* dst = out.data_ptr<uint8_t>();
  const uint8_t* src = data.data_ptr<uint8_t>();
  const int64_t row_stride = data.size(1);
  const float* s = kiln_int ? scales->data_ptr<float>() : nullptr;
  const uint8_t* z = kiln_int ? zeros->data_ptr<uint8_t>() : nullptr;
  if (format == kQ8_0) {  // (the file's bytes moved straight into place: pack_row's layout, no decoding)
    at::parallel_for(0, ngroups, 1, [&](int64_t g0, int64_t g1) {
      for (int64_t gi = g0; gi < g1; ++gi)
        for (int64_t sb = 0; sb < g.nsb; ++sb) {
          uint8_t* o = dst + gi * group_bytes(g) + sb * g.sb_bytes;
          for (int r = 0; r < kGroup; ++r) {
            const int64_t row = gi * kGroup + r;
            const uint8_t* b = row < n ? src + row * row_stride + sb * 34 : nullptr;
            o[2 * r] = b ? b[0] : 0;  // d (f16)
            o[2 * r + 1] = b ? b[1] : 0;
            for (int kk = 0; kk < 8; ++kk)
              for (int i = 0; i < 4; ++i) o[g.head_bytes + 64 * kk + 4 * r + i] = b ? b[2 + 4 * kk + i] ^ 0x80 : 0;
          }
        }
    });
    return;
  }
  const int64_t block_bytes = kiln_int ? 32 * g.sub : gguf_block_bytes(format);  // source bytes per super-block
  at::parallel_for(0, ngroups, 1, [&](int64_t g0, int64_t g1) {
    auto run = [&](auto f) { pack_groups<decltype(f)::value>(g, src, row_stride, block_bytes, s, z, groups, dst, g0, g1); };
    switch (format) {
      case kQ4_0: run(std::integral_constant<int64_t, kQ4_0>{}); break;
      case kQ4_1: run(std::integral_constant<int64_t, kQ4_1>{}); break;
      case kQ5_0: run(std::integral_constant<int64_t, kQ5_0>{}); break;
      case kQ5_1: run(std::integral_constant<int64_t, kQ5_1>{}); break;
      case kQ4_K: run(std::integral_constant<int64_t, kQ4_K>{}); break;
      case kQ5_K: run(std::integral_constant<int64_t, kQ5_K>{}); break;
      case kQ6_K: run(std::integral_constant<int64_t, kQ6_K>{}); break;
      case kInt4: run(std::integral_constant<int64_t, kInt4>{}); break;
      default: run(std::integral_constant<int64_t, kInt8>{});
    }
  });
}

// Bytes of one packed row group (16 rows) of K columns in `format`: pack's output is [ceil(N / 16), this].
int64_t packed_group_bytes(int64_t format, int64_t k, int64_t groups) {
  return group_bytes(geometry(format, kGroup, k, groups));
}

// pack_out into a new tensor.
at::Tensor pack(const at::Tensor& data, int64_t format, int64_t k, const c10::optional<at::Tensor>& scales,
                const c10::optional<at::Tensor>& zeros) {
  const Geometry g = pack_geometry(data, format, k, scales, zeros);
  at::Tensor out = at::empty({(g.n + kGroup - 1) / kGroup, group_bytes(g)}, data.options());
  pack_out(data, format, k, scales, zeros, out);
  return out;
}

// The packed weights as [N, K] float32 (or bfloat16: rounded to nearest even) into `out`, each
// value fma(q, d, m) as the float path computes it, at ISA level `isa`. `packed` may be a slice of
// whole row groups of a larger layer (its rows 16 g0 .. 16 g0 + N): a GEMM over a layer's rows
// in slices dequantises each slice into one reused scratch, not the whole layer at once.
void dequantize_out(const at::Tensor& packed, int64_t format, int64_t n, int64_t k, int64_t groups, int64_t isa,
                    at::Tensor out) {
  const Geometry g = geometry(format, n, k, groups);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.dim() == 2 && packed.size(0) == (n + kGroup - 1) / kGroup && packed.size(1) == group_bytes(g),
              "kiln_cpu_gemv: packed weights of the wrong shape for this format");
  const bool bf16 = out.scalar_type() == at::kBFloat16;
  TORCH_CHECK(out.device().is_cpu() && (bf16 || out.scalar_type() == at::kFloat) && out.is_contiguous() &&
                  out.dim() == 2 && out.size(0) == n && out.size(1) == k,
              "kiln_cpu_gemv: dequantize into a contiguous float32 or bfloat16 [", n, ", ", k, "] tensor");
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerThread / std::max<int64_t>(1, group_bytes(g)));
  level_of(isa).dequant(format, packed.data_ptr<uint8_t>(), g, static_cast<char*>(out.data_ptr()), bf16, grain);
}

at::Tensor dequantize(const at::Tensor& packed, int64_t format, int64_t n, int64_t k, int64_t groups,
                      c10::optional<at::ScalarType> dtype, int64_t isa) {
  const bool bf16 = dtype.has_value() && *dtype == at::kBFloat16;
  TORCH_CHECK(!dtype.has_value() || bf16 || *dtype == at::kFloat, "kiln_cpu_gemv: dequantize to float32 or bfloat16");
  at::Tensor out = at::empty({n, k}, packed.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  dequantize_out(packed, format, n, k, groups, isa, out);
  return out;
}

// out = x @ W^T + bias for W packed in `format` (pack). int_acts: the int path, else the float path.
void linear_quant_out(const at::Tensor& x, const at::Tensor& packed, int64_t format, int64_t n, int64_t k,
                      int64_t groups, const c10::optional<at::Tensor>& bias, int64_t isa, bool int_acts, at::Tensor out) {
  const Geometry g = geometry(format, n, k, groups);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.dim() == 2 && packed.size(0) == (n + kGroup - 1) / kGroup && packed.size(1) == group_bytes(g),
              "kiln_cpu_gemv: packed weights of the wrong shape for this format (pack them with pack())");
  check_acts(x, k);
  const int64_t m = x.size(0);
  check_out(out, m, n);
  if (m == 0) return;
  const Level lv = level_of(isa);
  const FAct fa = float_acts(lv, x);
  const Bias b(bias, n);
  const Store store = make_store(out, b);
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerThread / std::max<int64_t>(1, group_bytes(g)));
  if (int_acts) {
    const int64_t nb = k / 32;
    Scratch& s = scratch();
    int8_t* q = scratch(s.q, m * k);
    float *d = scratch(s.d, m * nb), *ds = scratch(s.ds, m * nb);
    int32_t* s16 = scratch(s.s16, 2 * m * nb);
    lv.quantize_acts(fa.x, m, k, fa.stride, q, d, ds, s16);
    const QAct qa{q, d, ds, s16, k};
    lv.gemv_quant(format, packed.data_ptr<uint8_t>(), g, &qa, nullptr, m, store, grain);
  } else {
    lv.gemv_quant(format, packed.data_ptr<uint8_t>(), g, nullptr, &fa, m, store, grain);
  }
}

at::Tensor linear_quant(const at::Tensor& x, const at::Tensor& packed, int64_t format, int64_t n, int64_t k,
                        int64_t groups, const c10::optional<at::Tensor>& bias, int64_t isa, bool int_acts) {
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  linear_quant_out(x, packed, format, n, k, groups, bias, isa, int_acts, out);
  return out;
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
  m.def("linear_dense(Tensor x, Tensor weight, Tensor? bias, int isa) -> Tensor");
  m.def("linear_dense_out(Tensor x, Tensor weight, Tensor? bias, int isa, Tensor(a!) out) -> ()");
  m.def("pack(Tensor data, int format, int k, Tensor? scales, Tensor? zeros) -> Tensor");
  m.def("packed_group_bytes(int format, int k, int groups) -> int", &kiln_gemv::packed_group_bytes);
  m.def("pack_out(Tensor data, int format, int k, Tensor? scales, Tensor? zeros, Tensor(a!) out) -> ()");
  m.def("dequantize(Tensor packed, int format, int n, int k, int groups, ScalarType? dtype=None, int isa=0) -> Tensor");
  m.def("dequantize_out(Tensor packed, int format, int n, int k, int groups, int isa, Tensor(a!) out) -> ()");
  m.def("linear_quant(Tensor x, Tensor packed, int format, int n, int k, int groups, Tensor? bias, int isa, "
        "bool int_acts) -> Tensor");
  m.def("linear_quant_out(Tensor x, Tensor packed, int format, int n, int k, int groups, Tensor? bias, int isa, "
        "bool int_acts, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(kiln_cpu_gemv, CPU, m) {
  m.impl("linear_dense", &kiln_gemv::linear_dense);
  m.impl("linear_dense_out", &kiln_gemv::linear_dense_out);
  m.impl("pack", &kiln_gemv::pack);
  m.impl("pack_out", &kiln_gemv::pack_out);
  m.impl("dequantize", &kiln_gemv::dequantize);
  m.impl("dequantize_out", &kiln_gemv::dequantize_out);
  m.impl("linear_quant", &kiln_gemv::linear_quant);
  m.impl("linear_quant_out", &kiln_gemv::linear_quant_out);
}
