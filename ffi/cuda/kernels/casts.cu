// Casts between float32 and the 2-byte formats (bf16, f16), n elements. Round to nearest even;
// NaN stays NaN. Written with the same bit manipulation as ffi/cpu/kernels.c (not the cuda_fp16
// intrinsics, whose NaN encodings differ), so results are bit-identical to the CPU backend.
#include "common.cuh"

// out (n) bf16 bits, inp (n) f32
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_f32_to_bf16(uint16_t* out, const float* inp, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const uint32_t u = __float_as_uint(inp[i]);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      out[i] = (uint16_t)((u >> 16) | 0x40u);  // quiet NaN
    } else {
      out[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  }
}

// out (n) f32, inp (n) bf16 bits: exact
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_bf16_to_f32(float* out, const uint16_t* inp, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) out[i] = __uint_as_float((uint32_t)inp[i] << 16);
}

__device__ __forceinline__ uint16_t f32_to_f16_bits(float f) {
  const uint32_t u = __float_as_uint(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t absu = u & 0x7fffffffu;
  if (absu > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);   // NaN
  if (absu >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // overflow (>= 65520) -> inf
  if (absu < 0x38800000u) {
    // subnormal half (or zero): value = mant * 2^-24; round |f| * 2^24 to nearest even
    if (absu < 0x33000000u) return (uint16_t)sign;  // < 2^-25: rounds to zero
    const uint32_t e = absu >> 23;                  // 102..112
    const uint32_t mant = (absu & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;  // 14..24
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u))) h++;
    return (uint16_t)(sign | h);
  }
  // normal: rebias exponent 127 -> 15, round the 13 dropped mantissa bits to nearest even
  uint32_t h = (absu - 0x38000000u) >> 13;
  const uint32_t rem = absu & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
  return (uint16_t)(sign | h);
}

// Exact for numbers. Subnormals are built from their bits (m * 2^-24 normalized), which equals kernels.c's
// sign + m * 2^-24 arithmetic without depending on how the compiler contracts it.
__device__ __forceinline__ float f16_bits_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {
    if (m == 0) return __uint_as_float(sign);  // +-0
    const int shift = __clz(m) - 21;           // moves the leading 1 of m to bit 10
    const uint32_t exponent = 113u - (uint32_t)shift;  // m * 2^-24 = 1.f * 2^(10-shift-24)
    return __uint_as_float(sign | (exponent << 23) | (((m << shift) & 0x3ffu) << 13));
  }
  // inf, or NaN made quiet (bit 22), as IEEE conversion and x86's F16C (kernels.c's main path) do
  if (e == 31) return __uint_as_float(sign | 0x7f800000u | (m << 13) | (m != 0 ? 0x400000u : 0u));
  return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
}

// out (n) f16 bits, inp (n) f32
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_f32_to_f16(uint16_t* out, const float* inp, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) out[i] = f32_to_f16_bits(inp[i]);
}

// out (n) f32, inp (n) f16 bits: exact
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_f16_to_f32(float* out, const uint16_t* inp, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) out[i] = f16_bits_to_f32(inp[i]);
}
