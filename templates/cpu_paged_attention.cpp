// Paged attention for the CPU: decodes, prefill chunks and mixed steps in one pass over the
// paged KV cache (compiler/cpu_attention.py builds and loads it; compiler/reference_attention.py
// is the definition it is tested against).
//
// Layouts (the reference's): q / out [T, Hq, D]; kv_cache [layers, 2, blocks, block_size, Hkv, D]
// (float32, bfloat16 or float8_e4m3fn); query_start_loc int32 [S + 1]; seq_lens int32 [S];
// block_tables int32 [S, W], read in place. Query row i of a chunk of length L in a sequence of
// length N sits at position p = N - L + i and sees keys 0 ..= p (with a sliding window W > 0 only
// keys > p - W). Rows that see no key, and rows no sequence claims, are written as zeros.
//
// Work item = (sequence, KV head, block of up to kRows query rows): every query head of the GQA
// group and every row of the block is served by one read of each K/V row, converted to float
// once. Online softmax one cache block at a time (one block-table lookup per block). Items are
// handed out dynamically to the intra-op threads, the costliest first.
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
#include <vector>

namespace {

constexpr int64_t kRows = 16;           // query rows per work item (prefill chunks)
constexpr int64_t kLanes = 16;          // partial sums per dot product: one AVX-512 register
constexpr double kSerialWork = 2.0e5;   // below this many multiply-adds one thread does it all

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
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void to_float(const c10::Float8_e4m3fn* src, float* dst, int64_t n) {
  const uint8_t* bits = reinterpret_cast<const uint8_t*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = kFp8.value[bits[i]];
}

template <typename T>
inline void from_float(const float* src, T* dst, int64_t n, float mul) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i] * mul);
}

// Fixed partial sums instead of one running sum: vectorises without -ffast-math (which would
// also change NaN and rounding behaviour).
inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += a[i + l] * b[i + l];
  }
  float sum = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) sum += lanes[l];
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

struct Item {
  int64_t seq, kv_head, row0, rows, cost;
};

struct Problem {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, num_blocks;
  int64_t q_tok, q_head, o_tok, o_head;        // strides (elements); the last dim is contiguous
  int64_t k_block, k_slot, k_head;             // cache strides within one of K / V
  int64_t table_row, table_col, table_width;
  float q_mul, v_mul, softcap;
  int64_t window;
};

// One item: rows [row0, row0 + rows) of sequence `seq` (absolute token index `tok0` of row 0,
// position `pos0` of row 0, context `len`), all query heads of KV head `kv_head`.
template <typename QT, typename CT, typename OT>
void attend(const Problem& P, const Item& it, int64_t tok0, int64_t pos0, int64_t len, const QT* q, const CT* kc,
            const CT* vc, const int32_t* table, OT* out, std::vector<float>& scratch) {
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
    const int64_t block = std::clamp<int64_t>(
        col < P.table_width ? table[it.seq * P.table_row + col * P.table_col] : 0, 0, P.num_blocks - 1);
    const int64_t first = std::max(start, lo_all), last = std::min(start + bs, hi_all);  // keys read
    for (int64_t j = first; j < last; ++j) {
      const int64_t off = block * P.k_block + (j - start) * P.k_slot + it.kv_head * P.k_head;
      to_float(kc + off, kf + (j - start) * D, D);
      to_float(vc + off, vf + (j - start) * D, D);
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t pos = pos0 + r;
      const int64_t hi = std::min({pos + 1, len, last});
      const int64_t lo = std::max(first, P.window > 0 ? pos - P.window + 1 : int64_t(0));
      if (hi <= lo) continue;
      for (int64_t g = 0; g < G; ++g) {
        const float* qv = qf + (r * G + g) * D;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = lo; j < hi; ++j) {
          float s = dot(qv, kf + (j - start) * D, D);
          if (P.softcap > 0.f) s = P.softcap * std::tanh(s / P.softcap);
          sc[j - lo] = s;
          m = std::max(m, s);
        }
        float& M = row_max[r * G + g];
        float& L = row_sum[r * G + g];
        float* a = acc + (r * G + g) * D;
        const float new_max = std::max(M, m);
        if (new_max > M) {  // rescale what came before (nothing on the first block: M = -inf)
          const float alpha = std::exp(M - new_max);
          L *= alpha;
          for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
          M = new_max;
        }
        for (int64_t j = lo; j < hi; ++j) {
          const float p = std::exp(sc[j - lo] - M);
          L += p;
          const float* vv = vf + (j - start) * D;
          for (int64_t d = 0; d < D; ++d) a[d] += p * vv[d];
        }
      }
    }
  }

  for (int64_t r = 0; r < R; ++r) {
    for (int64_t g = 0; g < G; ++g) {
      OT* dst = out + (tok0 + r) * P.o_tok + (it.kv_head * G + g) * P.o_head;
      const float L = row_sum[r * G + g];
      if (L > 0.f) {
        from_float(acc + (r * G + g) * D, dst, D, P.v_mul / L);
      } else {  // nothing to see (padding row, empty window)
        std::fill(dst, dst + D, static_cast<OT>(0.f));
      }
    }
  }
}

template <typename QT, typename CT>
void run(const Problem& P, const at::Tensor& out, const at::Tensor& q, const at::Tensor& kv_layer,
         const std::vector<Item>& items, const int32_t* qsl, const int32_t* lens, const int32_t* table) {
  const QT* qp = q.data_ptr<QT>();
  QT* op = out.data_ptr<QT>();
  const CT* kc = kv_layer[0].data_ptr<CT>();
  const CT* vc = kv_layer[1].data_ptr<CT>();
  double work = 0;
  for (const Item& it : items) work += static_cast<double>(it.cost);
  work *= static_cast<double>(P.group * P.head_dim);
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(items.size()));
  const int64_t workers = work < kSerialWork ? 1 : std::max<int64_t>(threads, 1);
  std::atomic<size_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> scratch;
    for (size_t i = next.fetch_add(1); i < items.size(); i = next.fetch_add(1)) {
      const Item& it = items[i];
      const int64_t q_len = qsl[it.seq + 1] - qsl[it.seq];
      const int64_t len = lens[it.seq];
      attend<QT, CT, QT>(P, it, qsl[it.seq] + it.row0, len - q_len + it.row0, len, qp, kc, vc, table, op, scratch);
    }
  });
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
    for (int64_t row0 = 0; row0 < end - begin; row0 += kRows) {
      const int64_t rows = std::min(kRows, end - begin - row0);
      const int64_t last_pos = len - (end - begin) + row0 + rows;  // keys the last row sees
      const int64_t keys = std::max<int64_t>(0, P.window > 0 ? std::min(last_pos, P.window) : last_pos);
      for (int64_t h = 0; h < P.num_kv_heads; ++h) items.push_back({s, h, row0, rows, rows * keys + 1});
    }
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
#define KILN_CACHE_CASE(QT, CT) run<QT, CT>(P, out, q, kv, items, qsl, lens, table)
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

}  // namespace

TORCH_LIBRARY(kiln_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor q, Tensor kv_cache, int layer, Tensor query_start_loc, "
        "Tensor seq_lens, Tensor block_tables, float scale, int sliding_window, float softcap, "
        "Tensor? k_scale, Tensor? v_scale) -> ()");
}

TORCH_LIBRARY_IMPL(kiln_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
