// kiln common device helpers (inlined into every rendered kernel source by jinja2,
// so the content hash of a variant covers this text too).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace kiln {

// 8 packed 16-bit values (one 16-byte vector) -> 8 floats.
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8], __nv_bfloat16) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    // bf16 -> fp32 is a 16-bit left shift of the bit pattern.
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8], __half) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __half2 h = *reinterpret_cast<const __half2*>(&w[i]);
    float2 p = __half22float2(h);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

__device__ __forceinline__ uint32_t pack2(float a, float b, __nv_bfloat16) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}

__device__ __forceinline__ uint32_t pack2(float a, float b, __half) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&h);
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// Streaming 16-byte read-only load (KV is read once: do not pollute L1).
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// Zero output rows [begin, end) (tokens no sequence claims: query_start_loc[S] < T).
template <typename T>
__device__ __forceinline__ void zero_rows(T* out, int begin, int end, int num_heads, int head_dim,
                                          int64_t o_stride_t, int64_t o_stride_h, int tid, int nthreads) {
  const int per_row = num_heads * head_dim;
  for (int64_t i = tid; i < (int64_t)(end - begin) * per_row; i += nthreads) {
    const int r = (int)(i / per_row);
    const int rem = (int)(i - (int64_t)r * per_row);
    const int hh = rem / head_dim;
    out[(int64_t)(begin + r) * o_stride_t + (int64_t)hh * o_stride_h + (rem - hh * head_dim)] = from_float<T>(0.f);
  }
}

}  // namespace kiln
