// kiln common device helpers (inlined into every rendered kernel source by jinja2,
// so the content hash of a variant covers this text too).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
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

// ---- fp8 (e4m3) KV cache: 8 elements = 8 bytes (one uint2) ---------------------------------

// 8 e4m3 bytes -> 8 floats (exact: every e4m3 value is a half).
__device__ __forceinline__ void unpack8_e4m3(const uint2& v, float (&f)[8]) {
  const uint32_t w[2] = {v.x, v.y};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const __half2_raw hr = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(w[i] >> (16 * j)), __NV_E4M3);
      const float2 p = __half22float2(*reinterpret_cast<const __half2*>(&hr));
      f[4 * i + 2 * j] = p.x;
      f[4 * i + 2 * j + 1] = p.y;
    }
  }
}

// 8 e4m3 bytes -> 8 packed 16-bit elements (one 16-byte vector, exact), for tile loads into
// shared memory that tensor-core code reads as bf16/fp16.
template <typename T>
__device__ __forceinline__ uint4 e4m3x8_to16(const uint2& v) {
  float f[8];
  unpack8_e4m3(v, f);
  return make_uint4(pack2(f[0], f[1], T()), pack2(f[2], f[3], T()), pack2(f[4], f[5], T()), pack2(f[6], f[7], T()));
}

// 8 floats -> 8 e4m3 bytes: x / scale rounded to nearest even, saturated to +-448 (NaN stays NaN),
// as compiler/kernels/kv_quant.py quantize_fp8. IEEE division (__fdiv_rn) so the bytes match torch's.
__device__ __forceinline__ uint2 pack8_e4m3(const float (&f)[8], float scale) {
  uint32_t w[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    uint32_t word = 0;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float2 p = make_float2(__fdiv_rn(f[4 * i + 2 * j], scale), __fdiv_rn(f[4 * i + 2 * j + 1], scale));
      word |= (uint32_t)__nv_cvt_float2_to_fp8x2(p, __NV_SATFINITE, __NV_E4M3) << (16 * j);
    }
    w[i] = word;
  }
  return make_uint2(w[0], w[1]);
}

// Streaming 8-byte read-only load (an fp8 lane's 8 KV elements).
__device__ __forceinline__ uint2 ld_stream8(const void* p) {
  uint2 r;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];\n" : "=r"(r.x), "=r"(r.y) : "l"(p));
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
