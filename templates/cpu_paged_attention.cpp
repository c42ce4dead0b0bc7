// Paged attention for the CPU: decodes, prefill chunks and mixed steps in one pass over the
// paged KV cache (compiler/kernels/cpu_attention.py builds and loads it; compiler/kernels/reference_attention.py
// is the definition it is tested against), and the cache write (write_kv) in one call.
//
// Layouts (the reference's): q / out [T, Hq, D]; kv_cache [layers, 2, blocks, block_size, Hkv, D]
// (float32, bfloat16 or float8_e4m3fn); query_start_loc int32 [S + 1]; seq_lens int32 [S];
// block_tables int32 [S, W], read in place. Query row i of a chunk of length L in a sequence of
// length N sits at position p = N - L + i and sees keys 0 ..= p (with a sliding window W > 0 only
// keys > p - W). Rows that see no key, and rows no sequence claims, are written as zeros.
//
// Work item = (sequence, block of query rows, its KV heads: all of them, or one each when there are
// too few items for the threads). A decode row (attend_decode) reads each K row of all the item's
// heads once, contiguously, and serves every query head from it; other rows (one KV head at a time)
// serve every query head of the GQA group and every row of the block from one read of each K/V
// row, converted to float once, with an online softmax: for the common head dims as tiles, a block
// of keys against all the item's query vectors in two small matrix products (attend_tiles,
// cpu_prefill_tiles.inc), for any other one a row at a time over each cache block (attend). Items
// are handed out dynamically to the intra-op threads, the costliest first.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>  // (transpose_sum's 8-lane form; float16 conversions)
#endif

namespace {

constexpr int64_t kRows = 16;           // query rows per work item (prefill chunks, generic head dims)
#if defined(__AVX2__) && !defined(__AVX512F__)
// Partial sums per dot product, and the width of the vectors below: one register. (With 256-bit
// registers only, GCC lowers 64-byte generic vectors half by half and their two-source shuffles
// lane by lane, through memory: the decode attention ran ~4x slower on AVX2 with 16 lanes.)
constexpr int64_t kLanes = 8;
#else
constexpr int64_t kLanes = 16;          // partial sums per dot product: one AVX-512 register
#endif
constexpr double kSerialWork = 2.0e5;   // below this many multiply-adds one thread does it all
constexpr int64_t kAhead = 2;          // K / V blocks prefetched ahead of the one computed
constexpr int64_t kSplitKeys = 256;     // fewest keys in a chunk of a split decode row

// Every e4m3 byte as a float: a lookup the compiler can vectorise, unlike the bit arithmetic.
struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) {
      value[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    }
  }
};
const Fp8Table kFp8;

inline void to_float(const float* src, float* dst, int64_t n) { std::copy(src, src + n, dst); }

inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t wide = static_cast<uint32_t>(bits[i]) << 16;
    float f;
    std::memcpy(&f, &wide, sizeof f);
    dst[i] = f;
  }
}

inline void to_float(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {  // (c10's conversion is bit arithmetic that does not vectorise)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void to_float(const c10::Float8_e4m3fn* src, float* dst, int64_t n) {
  const uint8_t* bits = reinterpret_cast<const uint8_t*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = kFp8.value[bits[i]];
}

// The cache lines of `rows` K or V rows (`stride` elements apart, `row_bytes` each) asked for ahead
// of use: a block's rows sit on one page of the paged cache, away from the last block's, and the
// hardware prefetcher starts over at every block. A decode step's cache was last read a step ago
// (the weights streamed since have pushed it out of the caches): without this each block waits
// for memory a row at a time.
template <typename CT>
inline void prefetch_rows(const CT* first, int64_t rows, int64_t stride, int64_t row_bytes) {
  for (int64_t j = 0; j < rows; ++j) {
    const char* p = reinterpret_cast<const char*>(first + j * stride);
    for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
  }
}

template <typename T>
inline void from_float(const float* src, T* dst, int64_t n, float mul) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i] * mul);
}

// Reductions over kLanes fixed partial sums folded as a tree, never one running sum: the
// compiler vectorises them without -ffast-math (which would also change NaN and rounding
// behaviour), and no chain of dependent adds is left.
inline float fold_sum(float* lanes) {
  for (int64_t w = kLanes / 2; w > 0; w /= 2) {
    for (int64_t l = 0; l < w; ++l) lanes[l] += lanes[l + w];
  }
  return lanes[0];
}

inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += a[i + l] * b[i + l];
  }
  for (int64_t l = 0; i + l < n; ++l) lanes[l] += a[i + l] * b[i + l];
  return fold_sum(lanes);
}

inline float sum(const float* a, int64_t n) {
  float lanes[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += a[i + l];
  }
  for (int64_t l = 0; i + l < n; ++l) lanes[l] += a[i + l];
  return fold_sum(lanes);
}

// The largest value, NaN skipped (a NaN score still reaches the output through its exp).
inline float max_of(const float* a, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) m = a[i] > m ? a[i] : m;
  return m;
}

// exp(x) for x <= 0 (a score minus the running max), in plain arithmetic so that a loop of it
// vectorises: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes' degree-6 polynomial (~1 ulp),
// 2^n by building the exponent bits. Below -87.3 the result is ~1e-38 instead of a denormal or 0:
// nothing next to the max term's 1. NaN stays NaN.
inline float exp_nonpositive(float x) {
  x = x < -87.3f ? -87.3f : x;
  // Round x / ln2 to an integer by adding 1.5 * 2^23 (no floor call: that would not vectorise);
  // the integer is then also in the low bits of the sum.
  const float shifted = x * 1.44269504088896341f + 12582912.f;
  const float n = shifted - 12582912.f;
  int32_t ni;
  std::memcpy(&ni, &shifted, sizeof ni);
  ni -= 0x4B400000;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.f;
  const int32_t bits = (ni + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return y * two_n;
}

// One query head of one row over keys k0[t], v0[t] (t < n, rows `stride` floats apart): the online
// softmax state (M, L, acc[D]) takes them in.
inline void take_keys(const float* qv, const float* k0, const float* v0, int64_t stride, int64_t n, int64_t D,
                      float softcap, float* sc, float& M, float& L, float* acc) {
  for (int64_t t = 0; t < n; ++t) sc[t] = dot(qv, k0 + t * stride, D);
  if (softcap > 0.f) {
    for (int64_t t = 0; t < n; ++t) sc[t] = softcap * std::tanh(sc[t] / softcap);
  }
  const float new_max = std::max(M, max_of(sc, n));
  float alpha = 1.f;
  if (new_max > M) {  // rescale what came before (nothing on the first block: M = -inf)
    alpha = exp_nonpositive(M - new_max);
    L *= alpha;
    M = new_max;
  }
  for (int64_t t = 0; t < n; ++t) sc[t] = exp_nonpositive(sc[t] - M);
  L += sum(sc, n);
  if (alpha != 1.f) {
    for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
  }
  for (int64_t t = 0; t < n; ++t) {
    const float p = sc[t];
    const float* vv = v0 + t * stride;
    for (int64_t d = 0; d < D; ++d) acc[d] += p * vv[d];
  }
}

// Whole vectors of kLanes floats (GCC vector extensions: one AVX-512 or AVX2 register, four SSE
// ones on a CPU with neither; the compiler picks the instructions for the flags). A decode row's
// scores against up to kLanes keys (head dim a multiple of kLanes) are reduced together by a shuffle
// tree (transpose_sum): ~3 operations a key instead of a horizontal sum each.
typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef int32_t vi __attribute__((vector_size(4 * kLanes)));

inline vf loadv(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vi lane_index() {  // {0, 1, ..., kLanes - 1}
  vi r;
  for (int l = 0; l < kLanes; ++l) r[l] = l;
  return r;
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// Lane t of the result: the sum of the lanes of x[t] (8 x 8: pairwise vhaddps twice, then the
// two 128-bit halves added across).
inline vf transpose_sum(const vf (&x)[kLanes]) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(__m256(x[0]), __m256(x[1])), _mm256_hadd_ps(__m256(x[2]), __m256(x[3])));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(__m256(x[4]), __m256(x[5])), _mm256_hadd_ps(__m256(x[6]), __m256(x[7])));
  return vf(_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
}
#else
inline vf pair_sum(vf a, vf b, vi first, vi second) {
  return __builtin_shuffle(a, b, first) + __builtin_shuffle(a, b, second);
}

// Lane t of the result: the sum of the lanes of x[t].
inline vf transpose_sum(const vf (&x)[16]) {
  const vi a1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const vi b1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const vi a2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const vi b2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  const vi a3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const vi b3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  const vi a4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  const vi b4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  vf two[8], four[4], eight[2];
  for (int m = 0; m < 8; ++m) two[m] = pair_sum(x[2 * m], x[2 * m + 1], a1, b1);
  for (int m = 0; m < 4; ++m) four[m] = pair_sum(two[2 * m], two[2 * m + 1], a2, b2);
  for (int m = 0; m < 2; ++m) eight[m] = pair_sum(four[2 * m], four[2 * m + 1], a3, b3);
  return pair_sum(eight[0], eight[1], a4, b4);
}
#endif

inline float lane_max(vf x) {
  float m = -std::numeric_limits<float>::infinity();
  for (int l = 0; l < kLanes; ++l) m = x[l] > m ? x[l] : m;
  return m;
}

inline float lane_sum(vf x) {
  float lanes[kLanes];
  std::memcpy(lanes, &x, sizeof x);
  return fold_sum(lanes);
}

inline vf exp_nonpositive(vf x) {  // exp_nonpositive(float), lane by lane
  const vf low = vf{} - 87.3f;
  x = x < low ? low : x;
  const vf shifted = x * 1.44269504088896341f + 12582912.f;
  const vf n = shifted - 12582912.f;
  const vi ni = reinterpret_cast<const vi&>(shifted) - 0x4B400000;
  const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const vf y = p * r * r + r + 1.f;
  const vi bits = (ni + 127) << 23;
  return y * reinterpret_cast<const vf&>(bits);
}

// The soft-capped scores of query `qv` (kD floats) against up to kLanes keys (rows `stride` floats
// apart), lane t for key t; lanes past n are -inf.
template <int64_t kD>
inline vf scores(const float* qv, const float* rows, int64_t stride, int64_t n, float softcap) {
  constexpr int64_t kV = kD / kLanes;
  vf q[kV];
  for (int64_t i = 0; i < kV; ++i) q[i] = loadv(qv + i * kLanes);
  vf parts[kLanes];
  for (int64_t t = 0; t < kLanes; ++t) {
    vf p = {};
    if (t < n) {
      for (int64_t i = 0; i < kV; ++i) p += q[i] * loadv(rows + t * stride + i * kLanes);
    }
    parts[t] = p;
  }
  vf s = transpose_sum(parts);
  if (softcap > 0.f) {
    for (int l = 0; l < kLanes; ++l) s[l] = softcap * std::tanh(s[l] / softcap);
  }
  const vf none = vf{} - std::numeric_limits<float>::infinity();
  return lane_index() < static_cast<int32_t>(n) ? s : none;
}

// Rows [row0, row0 + rows) of sequence `seq` for KV heads [kv_head, kv_head + heads) and their query heads.
// A chunk of a split decode row (part >= 0) sees only keys [key_lo, key_hi) and leaves its partial
// softmax state in part slot `part` for combine().
struct Item {
  int64_t seq, kv_head, row0, rows, cost, heads;
  int64_t key_lo = 0, key_hi = 0, part = -1;
};

// A decode row whose keys were split into `parts` chunks (part slots part0 ..): its token row `tok`.
struct Split {
  int64_t tok, part0, parts;
};

struct Problem {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, num_blocks;
  int64_t q_tok, q_head, o_tok, o_head;        // strides (elements); the last dim is contiguous
  int64_t k_block, k_slot, k_head;             // cache strides within one of K / V
  int64_t table_row, table_col, table_width;
  float q_mul, v_mul, softcap;
  int64_t window;
};

// Where column `col` of the item's sequence starts its KV head's rows in K (and in V): its block
// from the block table (0 past the table; clamped into the cache), plus the head's offset.
inline int64_t block_base(const Problem& P, const Item& it, const int32_t* table, int64_t col) {
  const int64_t block = std::clamp<int64_t>(
      col < P.table_width ? table[it.seq * P.table_row + col * P.table_col] : 0, 0, P.num_blocks - 1);
  return block * P.k_block + it.kv_head * P.k_head;
}

// One item: rows [row0, row0 + rows) of sequence `seq` (absolute token index `tok0` of row 0,
// position `pos0` of row 0, context `len`), all query heads of KV head `kv_head`, any head dim (the
// common ones go through attend_tiles), a row at a time over each cache block.
template <typename QT, typename CT>
void attend(const Problem& P, const Item& it, int64_t tok0, int64_t pos0, int64_t len, const QT* q, const CT* kc,
            const CT* vc, const int32_t* table, QT* out, std::vector<float>& scratch) {
  const int64_t G = P.group, D = P.head_dim, bs = P.block_size, R = it.rows;
  // scratch: q [R, G, D] | acc [R, G, D] | k, v rows of one block [bs, D] x 2 | scores [bs] | max, sum [R, G] x 2
  const size_t need = static_cast<size_t>(2 * R * G * D + 2 * bs * D + bs + 2 * R * G);
  if (scratch.size() < need) scratch.resize(need);
  float* qf = scratch.data();
  float* acc = qf + R * G * D;
  float* kf = acc + R * G * D;
  float* vf = kf + bs * D;
  float* sc = vf + bs * D;
  float* row_max = sc + bs;
  float* row_sum = row_max + R * G;

  int64_t lo_all = std::numeric_limits<int64_t>::max(), hi_all = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t pos = pos0 + r;
    const int64_t hi = std::min(pos + 1, len);
    const int64_t lo = P.window > 0 ? std::max<int64_t>(0, pos - P.window + 1) : 0;
    if (hi > lo) {
      lo_all = std::min(lo_all, lo);
      hi_all = std::max(hi_all, hi);
    }
    for (int64_t g = 0; g < G; ++g) {
      const QT* src = q + (tok0 + r) * P.q_tok + (it.kv_head * G + g) * P.q_head;
      float* dst = qf + (r * G + g) * D;
      to_float(src, dst, D);
      for (int64_t d = 0; d < D; ++d) dst[d] *= P.q_mul;
      row_max[r * G + g] = -std::numeric_limits<float>::infinity();
      row_sum[r * G + g] = 0.f;
    }
  }
  std::fill(acc, acc + R * G * D, 0.f);

  for (int64_t start = hi_all > 0 ? (lo_all / bs) * bs : 0; start < hi_all; start += bs) {
    const int64_t col = start / bs;
    const int64_t first = std::max(start, lo_all), last = std::min(start + bs, hi_all);  // keys read
    // The rows kAhead blocks on (at the first block also those before), while this one is computed.
    for (int64_t ahead = start == (lo_all / bs) * bs ? 1 : kAhead; ahead <= kAhead; ++ahead) {
      const int64_t nstart = (col + ahead) * bs;
      if (nstart >= hi_all) break;
      const int64_t nbase = block_base(P, it, table, col + ahead);
      const int64_t rows = std::min(bs, hi_all - nstart);
      prefetch_rows(kc + nbase, rows, P.k_slot, D * static_cast<int64_t>(sizeof(CT)));
      prefetch_rows(vc + nbase, rows, P.k_slot, D * static_cast<int64_t>(sizeof(CT)));
    }
    // K / V rows of this block as float: the cache itself for a float32 cache, else converted once
    // for every row and head of the item.
    const int64_t base = block_base(P, it, table, col);
    const float* krows;
    const float* vrows;
    int64_t row_stride;
    if constexpr (std::is_same_v<CT, float>) {
      krows = kc + base;
      vrows = vc + base;
      row_stride = P.k_slot;
    } else {
      for (int64_t j = first; j < last; ++j) {
        to_float(kc + base + (j - start) * P.k_slot, kf + (j - start) * D, D);
        to_float(vc + base + (j - start) * P.k_slot, vf + (j - start) * D, D);
      }
      krows = kf;
      vrows = vf;
      row_stride = D;
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t pos = pos0 + r;
      const int64_t hi = std::min({pos + 1, len, last});
      const int64_t lo = std::max(first, P.window > 0 ? pos - P.window + 1 : int64_t(0));
      if (hi <= lo) continue;
      const int64_t n = hi - lo;
      const float* k0 = krows + (lo - start) * row_stride;
      const float* v0 = vrows + (lo - start) * row_stride;
      for (int64_t g = 0; g < G; ++g) {
        const float* qv = qf + (r * G + g) * D;
        float* a = acc + (r * G + g) * D;
        take_keys(qv, k0, v0, row_stride, n, D, P.softcap, sc, row_max[r * G + g], row_sum[r * G + g], a);
      }
    }
  }

  for (int64_t r = 0; r < R; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      QT* dst = out + (tok0 + r) * P.o_tok + (it.kv_head * G + g) * P.o_head;
      const float L = row_sum[r * G + g];
      if (L > 0.f) {
        from_float(acc + (r * G + g) * D, dst, D, P.v_mul / L);
      } else {  // nothing to see (padding row, empty window)
        std::fill(dst, dst + D, static_cast<QT>(0.f));
      }
    }
  }
}

// kLanes consecutive cache elements as floats (bf16: widened in registers).
template <typename CT>
inline vf load_as_float(const CT* p) {
  if constexpr (std::is_same_v<CT, float>) {
    return loadv(p);
  } else if constexpr (std::is_same_v<CT, c10::BFloat16>) {
    typedef uint16_t vh __attribute__((vector_size(2 * kLanes)));
    vh h;
    std::memcpy(&h, p, sizeof h);
    const vi wide = __builtin_convertvector(h, vi) << 16;
    return reinterpret_cast<const vf&>(wide);
  } else {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<CT, c10::Half> && kLanes == 16) {
      return vf(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
    }
#elif defined(__F16C__)
    if constexpr (std::is_same_v<CT, c10::Half> && kLanes == 8) {
      return vf(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    }
#endif
    float tmp[kLanes];
    to_float(p, tmp, kLanes);
    return loadv(tmp);
  }
}

// One decode row over KV heads [kv_head, kv_head + heads) and all their query heads (F = heads x
// group of them), any cache dtype, head dim a multiple of kLanes. Two passes: every score of the row
// kept, so the max is known before any exp and nothing is rescaled. Pass 1 walks each K row once
// (all the item's heads: a contiguous read), widens a head's 16 rows at a time into an L1 tile and
// scores them against the group's queries; pass 2 reads each V row once per kGS query heads, whose
// sums stay in registers.
template <typename QT, typename CT, int64_t kD>
void attend_decode(const Problem& P, const Item& it, int64_t tok0, int64_t lo, int64_t hi, const QT* q,
                   const CT* kc, const CT* vc, const int32_t* table, QT* out, std::vector<float>& scratch,
                   float* part) {
  constexpr int64_t kV = kD / kLanes;
  constexpr int64_t kGS = std::max<int64_t>(1, (kLanes == 16 ? 24 : 12) / kV);
  const int64_t G = P.group, H = it.heads, F = H * G, bs = P.block_size, n_all = hi - lo;
  const int64_t padded = (n_all + kLanes - 1) / kLanes * kLanes + kLanes;  // room for a whole last chunk
  const size_t need = static_cast<size_t>(F * padded + F * kD + kLanes * kD + F * kLanes + 2 * F);
  if (scratch.size() < need) scratch.resize(need);
  float* sc = scratch.data();                // [F, padded] scores, then softmax numerators
  float* qf = sc + F * padded;               // [F, kD]
  float* kt = qf + F * kD;                   // [kLanes, kD] one head's chunk of K rows as floats
  float* vmaxs = kt + kLanes * kD;           // [F, kLanes]
  float* M = vmaxs + F * kLanes;             // [F]
  float* L = M + F;                          // [F]
  const int64_t q0 = it.kv_head * G;         // the item's first query head
  for (int64_t f = 0; f < F; ++f) {
    to_float(q + tok0 * P.q_tok + (q0 + f) * P.q_head, qf + f * kD, kD);
    for (int64_t d = 0; d < kD; ++d) qf[f * kD + d] *= P.q_mul;
  }
  const int64_t first_col = lo / bs, last_col = (hi - 1) / bs;
  const int64_t row_bytes = H * P.k_head * int64_t(sizeof(CT));  // the item's heads of one slot
  const vi lane = lane_index();
  const vf zero = {}, none = zero - std::numeric_limits<float>::infinity();
  for (int64_t f = 0; f < F; ++f) std::memcpy(vmaxs + f * kLanes, &none, sizeof none);
  // Pass 1: the scores, 16 keys at a time within each block, and their running lane-wise max.
  for (int64_t col = first_col; col <= last_col; ++col) {
    const CT* kb = kc + block_base(P, it, table, col);
    const int64_t start = col * bs, a = std::max(lo, start), b = std::min(hi, start + bs);
    for (int64_t ahead = col == first_col ? 1 : kAhead; ahead <= kAhead && col + ahead <= last_col; ++ahead)
      prefetch_rows(kc + block_base(P, it, table, col + ahead), bs, P.k_slot, row_bytes);
    for (int64_t t = a; t < b; t += kLanes) {
      const int64_t n = std::min(kLanes, b - t);
      for (int64_t h = 0; h < H; ++h) {
        const CT* kh = kb + (t - start) * P.k_slot + h * P.k_head;
        const float* rows;
        int64_t stride;
        if constexpr (std::is_same_v<CT, float>) {
          rows = kh;
          stride = P.k_slot;
        } else {
          for (int64_t j = 0; j < n; ++j) {
            for (int64_t i = 0; i < kV; ++i) {
              const vf x = load_as_float(kh + j * P.k_slot + i * kLanes);
              std::memcpy(kt + j * kD + i * kLanes, &x, sizeof x);
            }
          }
          rows = kt;
          stride = kD;
        }
        for (int64_t f = h * G; f < (h + 1) * G; ++f) {
          const vf s = scores<kD>(qf + f * kD, rows, stride, n, P.softcap);
          vf vmax = loadv(vmaxs + f * kLanes);
          vmax = s > vmax ? s : vmax;  // (a NaN score is skipped here and still reaches the output)
          std::memcpy(vmaxs + f * kLanes, &vmax, sizeof vmax);
          std::memcpy(sc + f * padded + (t - lo), &s, sizeof s);  // lanes past n: overwritten by the next chunk
        }
      }
    }
  }
  // The softmax numerators of each query head, vectorised over the row's scores.
  for (int64_t f = 0; f < F; ++f) {
    M[f] = lane_max(loadv(vmaxs + f * kLanes));
    float* row = sc + f * padded;
    if (!(M[f] > -std::numeric_limits<float>::infinity())) {  // every score NaN or -inf: NaN, as the online path
      std::fill(row, row + padded, 0.f);
      L[f] = 0.f;
      continue;
    }
    vf lsum = {};
    for (int64_t t = 0; t < n_all; t += kLanes) {
      vf p = exp_nonpositive(loadv(row + t) - M[f]);
      p = lane < static_cast<int32_t>(n_all - t) ? p : zero;  // lanes past n_all are no keys
      lsum += p;
      std::memcpy(row + t, &p, sizeof p);
    }
    L[f] = lane_sum(lsum);
  }
  // Pass 2: the weighted sums of the V rows, each row read once per kGS query heads of its KV head
  // (the first walk prefetches all the item's heads: the later walks find them in the caches).
  for (int64_t f0 = 0; f0 < F; f0 += std::min(kGS, G - f0 % G)) {
    const int64_t fs = std::min(kGS, G - f0 % G), voff = (f0 / G) * P.k_head;
    vf acc[kGS][kV] = {};
    for (int64_t col = first_col; col <= last_col; ++col) {
      const CT* vb = vc + block_base(P, it, table, col) + voff;
      if (f0 == 0) {
        for (int64_t ahead = col == first_col ? 1 : kAhead; ahead <= kAhead && col + ahead <= last_col; ++ahead)
          prefetch_rows(vc + block_base(P, it, table, col + ahead), bs, P.k_slot, row_bytes);
      }
      const int64_t start = col * bs, a = std::max(lo, start), b = std::min(hi, start + bs);
      for (int64_t t = a; t < b; ++t) {
        const CT* vr = vb + (t - start) * P.k_slot;
        vf v[kV];
        for (int64_t i = 0; i < kV; ++i) v[i] = load_as_float(vr + i * kLanes);
        for (int64_t g = 0; g < kGS; ++g) {
          if (g < fs) {
            const float w = sc[(f0 + g) * padded + (t - lo)];
            for (int64_t i = 0; i < kV; ++i) acc[g][i] += w * v[i];
          }
        }
      }
    }
    for (int64_t g = 0; g < fs; ++g) {
      if (part != nullptr) {  // a chunk of a split row: the unnormalised sums
        std::memcpy(part + (f0 + g) * kD, acc[g], sizeof acc[g]);
        continue;
      }
      QT* dst = out + tok0 * P.o_tok + (q0 + f0 + g) * P.o_head;
      if (L[f0 + g] > 0.f) {
        float res[kD];
        std::memcpy(res, acc[g], sizeof res);
        from_float(res, dst, kD, P.v_mul / L[f0 + g]);
      } else {
        std::fill(dst, dst + kD, static_cast<QT>(std::numeric_limits<float>::quiet_NaN()));
      }
    }
  }
  if (part != nullptr) {  // then each head's max and sum (NaN where the unsplit row gives NaN)
    for (int64_t f = 0; f < F; ++f) {
      part[F * kD + f] = M[f];
      part[F * kD + F + f] = M[f] > -std::numeric_limits<float>::infinity()
                                 ? L[f] : std::numeric_limits<float>::quiet_NaN();
    }
  }
}

// A split decode row from its chunks' parts (each [F, D] unnormalised sums, then F maxima, F sums;
// F = every query head): out = v_mul sum_c acc_c e^(M_c - M) / sum_c L_c e^(M_c - M), M = max_c M_c.
template <typename QT>
void combine(const Problem& P, const Split& s, const float* parts, QT* out) {
  const int64_t F = P.num_heads, D = P.head_dim, stride = F * (D + 2);
  std::vector<float> acc(static_cast<size_t>(D));
  for (int64_t f = 0; f < F; ++f) {
    float M = -std::numeric_limits<float>::infinity(), L = 0.f;
    for (int64_t c = 0; c < s.parts; ++c) M = std::max(M, parts[(s.part0 + c) * stride + F * D + f]);
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t c = 0; c < s.parts; ++c) {
      const float* pc = parts + (s.part0 + c) * stride;
      const float Mc = pc[F * D + f], Lc = pc[F * D + F + f];
      if (!(Mc > -std::numeric_limits<float>::infinity())) {
        L += Lc;  // (NaN: a chunk of NaN scores, which makes the row NaN as unsplit)
        continue;
      }
      const float w = std::exp(Mc - M);
      L += Lc * w;
      for (int64_t d = 0; d < D; ++d) acc[d] += w * pc[f * D + d];
    }
    QT* dst = out + s.tok * P.o_tok + f * P.o_head;
    if (L > 0.f) {
      from_float(acc.data(), dst, D, P.v_mul / L);
    } else {
      std::fill(dst, dst + D, static_cast<QT>(std::numeric_limits<float>::quiet_NaN()));
    }
  }
}

#include "cpu_prefill_tiles.inc"

template <typename QT, typename CT>
void run(const Problem& P, const at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_layer,
         const std::vector<Item>& items, const std::vector<Split>& splits, const int32_t* qsl, const int32_t* lens,
         const int32_t* table) {
  const QT* qp = q.data_ptr<QT>();
  QT* op = out.data_ptr<QT>();
  const CT* kc = kv_layer[0].data_ptr<CT>();
  const CT* vc = kv_layer[1].data_ptr<CT>();
  double work = 0;
  for (const Item& it : items) work += static_cast<double>(it.cost);
  work *= static_cast<double>(P.group * P.head_dim);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size()));
  const int64_t workers = work < kSerialWork ? 1 : std::max<int64_t>(threads, 1);
  const int64_t part_stride = P.num_heads * (P.head_dim + 2);
  int64_t num_parts = 0;
  for (const Split& s : splits) num_parts += s.parts;
  std::vector<float> parts(static_cast<size_t>(num_parts * part_stride));
  std::atomic<size_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> scratch;
    for (size_t i = next.fetch_add(1); i < items.size(); i = next.fetch_add(1)) {
      const Item& item = items[i];
      const int64_t q_len = qsl[item.seq + 1] - qsl[item.seq];
      const int64_t len = lens[item.seq];
      const int64_t tok0 = qsl[item.seq] + item.row0, pos0 = len - q_len + item.row0;
      // A single row with keys to see (a decode): the two-pass path for the vector head dims.
      const bool chunk = item.part >= 0;  // (a chunk of a split row: its keys only)
      const int64_t hi = chunk ? item.key_hi : std::min(pos0 + 1, len);
      const int64_t lo = chunk ? item.key_lo : P.window > 0 ? std::max<int64_t>(0, pos0 - P.window + 1) : 0;
      if (item.rows == 1 && hi > lo) {
        float* part = chunk ? parts.data() + item.part * part_stride : nullptr;
        bool done = true;
        switch (P.head_dim) {
          case 32: attend_decode<QT, CT, 32>(P, item, tok0, lo, hi, qp, kc, vc, table, op, scratch, part); break;
          case 64: attend_decode<QT, CT, 64>(P, item, tok0, lo, hi, qp, kc, vc, table, op, scratch, part); break;
          case 128: attend_decode<QT, CT, 128>(P, item, tok0, lo, hi, qp, kc, vc, table, op, scratch, part); break;
          case 256: attend_decode<QT, CT, 256>(P, item, tok0, lo, hi, qp, kc, vc, table, op, scratch, part); break;
          default: done = false;
        }
        if (done) continue;
      }
      for (int64_t h = 0; h < item.heads; ++h) {
        Item it = item;
        it.kv_head += h;
        it.heads = 1;
        switch (P.head_dim) {  // the common head dims compiled for their size, any other one generically
          case 32: attend_tiles<QT, CT, 32>(P, it, tok0, pos0, len, qp, kc, vc, table, op, scratch); break;
          case 64: attend_tiles<QT, CT, 64>(P, it, tok0, pos0, len, qp, kc, vc, table, op, scratch); break;
          case 96: attend_tiles<QT, CT, 96>(P, it, tok0, pos0, len, qp, kc, vc, table, op, scratch); break;
          case 128: attend_tiles<QT, CT, 128>(P, it, tok0, pos0, len, qp, kc, vc, table, op, scratch); break;
          case 256: attend_tiles<QT, CT, 256>(P, it, tok0, pos0, len, qp, kc, vc, table, op, scratch); break;
          default: attend<QT, CT>(P, it, tok0, pos0, len, qp, kc, vc, table, op, scratch);
        }
      }
    }
  });
  for (const Split& s : splits) combine(P, s, parts.data(), op);
}

void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_cache, int64_t layer,
                     const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const at::Tensor& block_tables,
                     double scale, int64_t sliding_window, double softcap, const c10::optional<at::Tensor>& k_scale,
                     const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "kiln_cpu::paged_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "kiln_cpu::paged_attention: q and out must be [tokens, heads, head_dim] of one dtype, got ",
              q.sizes(), " and ", out.sizes());
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "kiln_cpu::paged_attention: head_dim must be contiguous");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(1) == 2, "kiln_cpu::paged_attention: kv_cache must be "
              "[layers, 2, blocks, block_size, kv_heads, head_dim], got ", kv_cache.sizes());
  TORCH_CHECK(layer >= 0 && layer < kv_cache.size(0), "kiln_cpu::paged_attention: layer ", layer, " out of range");
  const at::Tensor kv = kv_cache[layer];
  // kv: [2, blocks, block_size, kv_heads, head_dim]
  TORCH_CHECK(kv.stride(4) == 1, "kiln_cpu::paged_attention: the cache's head_dim must be contiguous");
  TORCH_CHECK(kv.size(4) == q.size(2), "kiln_cpu::paged_attention: head_dim of q (", q.size(2),
              ") and of the cache (", kv.size(4), ") differ");
  TORCH_CHECK(q.size(1) % kv.size(3) == 0, "kiln_cpu::paged_attention: ", q.size(1), " query heads are not a "
              "multiple of ", kv.size(3), " KV heads");
  for (const at::Tensor* t : {&query_start_loc, &seq_lens, &block_tables}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->device().is_cpu(),
                "kiln_cpu::paged_attention: query_start_loc, seq_lens and block_tables must be int32 CPU tensors");
  }
  const int64_t S = seq_lens.size(0), T = q.size(0);
  TORCH_CHECK(query_start_loc.numel() >= S + 1 && block_tables.dim() == 2 && block_tables.size(0) >= S,
              "kiln_cpu::paged_attention: query_start_loc needs num_seqs + 1 entries and block_tables num_seqs rows");
  const at::Tensor qsl_c = query_start_loc.contiguous(), lens_c = seq_lens.contiguous();
  const int32_t* qsl = qsl_c.data_ptr<int32_t>();
  const int32_t* lens = lens_c.data_ptr<int32_t>();

  Problem P;
  P.num_heads = q.size(1);
  P.num_kv_heads = kv.size(3);
  P.group = P.num_heads / P.num_kv_heads;
  P.head_dim = q.size(2);
  P.block_size = kv.size(2);
  P.num_blocks = kv.size(1);
  P.q_tok = q.stride(0);
  P.q_head = q.stride(1);
  P.o_tok = out.stride(0);
  P.o_head = out.stride(1);
  P.k_block = kv.stride(1);
  P.k_slot = kv.stride(2);
  P.k_head = kv.stride(3);
  P.table_row = block_tables.stride(0);
  P.table_col = block_tables.stride(1);
  P.table_width = block_tables.size(1);
  P.window = sliding_window;
  P.softcap = static_cast<float>(softcap);
  // An fp8 cache's K scale folds into q, its V scale into the output (the kernel reads the raw
  // elements): softmax(q.(s k)) (s' v) = s' softmax((s q).k) v.
  P.q_mul = static_cast<float>(scale) * (k_scale.has_value() ? k_scale->item<float>() : 1.f);
  P.v_mul = v_scale.has_value() ? v_scale->item<float>() : 1.f;

  std::vector<Item> items;
  items.reserve(static_cast<size_t>(S * P.num_kv_heads));
  int64_t claimed_lo = T, claimed_hi = 0;
  // Prefill rows per item: kRows for the generic head dims (attend), whole register blocks of query
  // vectors for the compiled ones (attend_tiles).
  const bool tiled = P.head_dim == 32 || P.head_dim == 64 || P.head_dim == 96 || P.head_dim == 128 || P.head_dim == 256;
  const int64_t rows_per_item = tiled ? tile_rows(P.group) : kRows;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t begin = qsl[s], end = qsl[s + 1], len = lens[s];
    TORCH_CHECK(0 <= begin && begin <= end && end <= T, "kiln_cpu::paged_attention: query_start_loc must be "
                "non-decreasing within [0, num_tokens]; sequence ", s, " has [", begin, ", ", end, ")");
    TORCH_CHECK(len >= 0 && (len + P.block_size - 1) / P.block_size <= P.table_width || len == 0,
                "kiln_cpu::paged_attention: sequence ", s, " of length ", len, " needs more than the ",
                P.table_width, " block-table columns");
    if (end > begin) {
      claimed_lo = std::min(claimed_lo, begin);
      claimed_hi = std::max(claimed_hi, end);
    }
    for (int64_t row0 = 0; row0 < end - begin; row0 += rows_per_item) {
      const int64_t rows = std::min(rows_per_item, end - begin - row0);
      const int64_t last_pos = len - (end - begin) + row0 + rows;  // keys the last row sees
      const int64_t keys = std::max<int64_t>(0, P.window > 0 ? std::min(last_pos, P.window) : last_pos);
      items.push_back({s, 0, row0, rows, (rows * keys + 1) * P.num_kv_heads, P.num_kv_heads});
    }
  }
  // (Called inside a parallel region -- the decoder stack's team -- the kernel runs on this thread alone.)
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  std::vector<Split> splits;
  if (static_cast<int64_t>(items.size()) < 4 * threads) {
    // Too few (sequence, row block) items to keep every thread busy: one item per KV head instead,
    // and a decode row with a long context split into chunks of keys (every head of a chunk read
    // in one contiguous pass), combined once all are done -- one long sequence alone is read by
    // every thread, not one thread per KV head.
    double work = 0;
    int64_t decodes = 0;
    for (const Item& it : items) {
      work += static_cast<double>(it.cost) * static_cast<double>(P.group * P.head_dim);
      decodes += it.rows == 1;
    }
    const bool split = threads > 1 && work >= kSerialWork &&
                       (P.head_dim == 32 || P.head_dim == 64 || P.head_dim == 128 || P.head_dim == 256);
    const int64_t want = (4 * threads + std::max<int64_t>(decodes, 1) - 1) / std::max<int64_t>(decodes, 1);
    std::vector<Item> per_head;
    per_head.reserve(items.size() * static_cast<size_t>(P.num_kv_heads));
    int64_t num_parts = 0;
    for (const Item& it : items) {
      if (split && it.rows == 1) {
        const int64_t q_len = qsl[it.seq + 1] - qsl[it.seq], len = lens[it.seq];
        const int64_t pos = len - q_len + it.row0, hi = std::min(pos + 1, len);
        const int64_t lo = P.window > 0 ? std::max<int64_t>(0, pos - P.window + 1) : 0;
        const int64_t chunks = std::min(want, (hi - lo) / kSplitKeys);
        if (chunks >= 2) {
          const int64_t step = ((hi - lo + chunks - 1) / chunks + P.block_size - 1) / P.block_size * P.block_size;
          const int64_t part0 = num_parts;
          for (int64_t a = lo; a < hi;) {  // chunk ends on block boundaries
            const int64_t b = std::min(hi, (a + step) / P.block_size * P.block_size);
            per_head.push_back({it.seq, 0, it.row0, 1, (b - a) * P.num_kv_heads + 1, P.num_kv_heads, a, b, num_parts++});
            a = b;
          }
          splits.push_back({qsl[it.seq] + it.row0, part0, num_parts - part0});
          continue;
        }
      }
      for (int64_t h = 0; h < it.heads; ++h) per_head.push_back({it.seq, h, it.row0, it.rows, it.cost / it.heads, 1});
    }
    items.swap(per_head);
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  // Rows no sequence claims (padding tokens) are zeros, as in the reference.
  if (claimed_hi <= claimed_lo) {
    out.zero_();
  } else {
    if (claimed_lo > 0) out.narrow(0, 0, claimed_lo).zero_();
    if (claimed_hi < T) out.narrow(0, claimed_hi, T - claimed_hi).zero_();
  }
  const int32_t* table = block_tables.data_ptr<int32_t>();

  const auto cache = kv.scalar_type();
  const auto qt = q.scalar_type();
  TORCH_CHECK(qt == at::kFloat || qt == at::kBFloat16 || qt == at::kHalf,
              "kiln_cpu::paged_attention: q must be float32, bfloat16 or float16, got ", qt);
#define KILN_CACHE_CASE(QT, CT) run<QT, CT>(P, out, q, kv, items, splits, qsl, lens, table)
#define KILN_Q_CASE(QT)                                                                               \
  if (cache == at::kFloat) KILN_CACHE_CASE(QT, float);                                                \
  else if (cache == at::kBFloat16) KILN_CACHE_CASE(QT, c10::BFloat16);                                \
  else if (cache == at::kHalf) KILN_CACHE_CASE(QT, c10::Half);                                        \
  else if (cache == at::kFloat8_e4m3fn) KILN_CACHE_CASE(QT, c10::Float8_e4m3fn);                      \
  else TORCH_CHECK(false, "kiln_cpu::paged_attention: unsupported KV cache dtype ", cache);
  if (qt == at::kFloat) {
    KILN_Q_CASE(float)
  } else if (qt == at::kBFloat16) {
    KILN_Q_CASE(c10::BFloat16)
  } else {
    KILN_Q_CASE(c10::Half)
  }
#undef KILN_Q_CASE
#undef KILN_CACHE_CASE
}

// Cache elements from float values: cast (round to nearest even), or for an fp8 cache x / scale
// saturated to +-448 (NaN stays NaN), exactly as compiler/kernels/kv_quant.py's to_cache.
template <typename CT>
inline CT to_cache(float x, float scale) {
  if constexpr (std::is_same_v<CT, c10::Float8_e4m3fn>) {
    float y = x / scale;
    y = y > 448.f ? 448.f : (y < -448.f ? -448.f : y);
    return c10::Float8_e4m3fn(y);
  } else {
    return static_cast<CT>(x);
  }
}

// A row of `n` float values into cache elements (to_cache), float16 eight at a time where F16C is there.
template <typename CT>
inline void store_row(const float* src, CT* dst, int64_t n, float scale) {
  int64_t i = 0;
#if defined(__F16C__)
  if constexpr (std::is_same_v<CT, c10::Half>) {  // round to nearest even, as c10's conversion
    for (; i + 8 <= n; i += 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    }
  }
#endif
  for (; i < n; ++i) dst[i] = to_cache<CT>(src[i], scale);
}

template <typename XT, typename CT>
void write_rows(const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv, const int64_t* slots, float k_scale,
                float v_scale) {
  const int64_t T = k.size(0), H = k.size(1), D = k.size(2);
  const int64_t bs = kv.size(2), capacity = kv.size(1) * bs;
  CT* kc = kv[0].data_ptr<CT>();
  CT* vc = kv[1].data_ptr<CT>();
  const XT* kp = k.data_ptr<XT>();
  const XT* vp = v.data_ptr<XT>();
  std::vector<float> row(static_cast<size_t>(D));
  for (int64_t t = 0; t < T; ++t) {
    const int64_t slot = slots[t];
    if (slot < 0) continue;  // padding: nothing to write
    TORCH_CHECK(slot < capacity, "kiln_cpu::write_kv: slot ", slot, " is past the cache's ", capacity, " slots");
    const int64_t base = (slot / bs) * kv.stride(1) + (slot % bs) * kv.stride(2);
    for (int64_t h = 0; h < H; ++h) {
      CT* kd = kc + base + h * kv.stride(3);
      CT* vd = vc + base + h * kv.stride(3);
      const XT* ks = kp + t * k.stride(0) + h * k.stride(1);
      const XT* vs = vp + t * v.stride(0) + h * v.stride(1);
      to_float(ks, row.data(), D);
      store_row(row.data(), kd, D, k_scale);
      to_float(vs, row.data(), D);
      store_row(row.data(), vd, D, v_scale);
    }
  }
}

void write_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv_cache, int64_t layer,
              const at::Tensor& slot_mapping, const c10::optional<at::Tensor>& k_scale,
              const c10::optional<at::Tensor>& v_scale) {
  TORCH_CHECK(k.device().is_cpu() && kv_cache.device().is_cpu(), "kiln_cpu::write_kv: CPU tensors only");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(1) == 2, "kiln_cpu::write_kv: kv_cache must be "
              "[layers, 2, blocks, block_size, kv_heads, head_dim], got ", kv_cache.sizes());
  TORCH_CHECK(layer >= 0 && layer < kv_cache.size(0), "kiln_cpu::write_kv: layer ", layer, " out of range");
  const at::Tensor kv = kv_cache[layer];
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && v.scalar_type() == k.scalar_type() &&
              k.size(1) == kv.size(3) && k.size(2) == kv.size(4),
              "kiln_cpu::write_kv: k and v must be [tokens, kv_heads, head_dim] matching the cache, got ",
              k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && kv.stride(4) == 1,
              "kiln_cpu::write_kv: head_dim must be contiguous");
  TORCH_CHECK(slot_mapping.numel() == k.size(0), "kiln_cpu::write_kv: one slot per token");
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const float ks = k_scale.has_value() ? k_scale->item<float>() : 1.f;
  const float vs = v_scale.has_value() ? v_scale->item<float>() : 1.f;
  const auto cache = kv.scalar_type();
#define KILN_WRITE_CASE(XT)                                                                         \
  if (cache == at::kFloat) write_rows<XT, float>(k, v, kv, sp, ks, vs);                             \
  else if (cache == at::kBFloat16) write_rows<XT, c10::BFloat16>(k, v, kv, sp, ks, vs);             \
  else if (cache == at::kHalf) write_rows<XT, c10::Half>(k, v, kv, sp, ks, vs);                     \
  else if (cache == at::kFloat8_e4m3fn) write_rows<XT, c10::Float8_e4m3fn>(k, v, kv, sp, ks, vs);   \
  else TORCH_CHECK(false, "kiln_cpu::write_kv: unsupported KV cache dtype ", cache);
  if (k.scalar_type() == at::kFloat) {
    KILN_WRITE_CASE(float)
  } else if (k.scalar_type() == at::kBFloat16) {
    KILN_WRITE_CASE(c10::BFloat16)
  } else if (k.scalar_type() == at::kHalf) {
    KILN_WRITE_CASE(c10::Half)
  } else {
    TORCH_CHECK(false, "kiln_cpu::write_kv: k and v must be float32, bfloat16 or float16, got ", k.scalar_type());
  }
#undef KILN_WRITE_CASE
}

}  // namespace

TORCH_LIBRARY(kiln_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, int layer, Tensor query_start_loc, "
        "Tensor seq_lens, Tensor block_tables, float scale, int sliding_window, float softcap, "
        "Tensor? k_scale, Tensor? v_scale) -> ()");
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) kv_cache, int layer, Tensor slot_mapping, Tensor? k_scale, "
        "Tensor? v_scale) -> ()");
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("write_kv", &write_kv);
}
