// Casts between float32 and the 2-byte formats (bf16, f16), n elements. Round to nearest even;
// NaN stays NaN. The element conversions are ffi/numerics.h, shared with ffi/cpu/kernels.c (not
// the cuda_fp16 intrinsics, whose NaN encodings differ), so results are bit-identical to the CPU.
#include "common.cuh"
#include "../../numerics.h"

// out (n) bf16 bits, inp (n) f32
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_f32_to_bf16(uint16_t* out, const float* inp, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) out[i] = mt_f32_to_bf16_bits(inp[i]);
}

// out (n) f32, inp (n) bf16 bits: exact
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_bf16_to_f32(float* out, const uint16_t* inp, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) out[i] = __uint_as_float((uint32_t)inp[i] << 16);
}

// out (n) f16 bits, inp (n) f32
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_f32_to_f16(uint16_t* out, const float* inp, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) out[i] = mt_f32_to_f16_bits(inp[i]);
}

// out (n) f32, inp (n) f16 bits: exact
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_f16_to_f32(float* out, const uint16_t* inp, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) out[i] = mt_f16_bits_to_f32(inp[i]);
}

// out (n) += inp (n), both of elem (0 f32, 1 bf16, 2 f16), summed in f32: a gradient a library
// wrote (cuDNN's attention backward) added into one that already holds something
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_accumulate_elem(void* out, const void* inp, int64_t n, int32_t elem) {
  for (int64_t i = thread_index(); i < n; i += thread_count())
    mt_store_elem(out, i, mt_load_elem(out, i, elem) + mt_load_elem(inp, i, elem), elem);
}
