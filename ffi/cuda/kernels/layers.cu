// Bias, activations and dropout. N rows, C channels; n is an element count. Activations and their
// gradients are of `elem` (0 f32, 1 bf16, 2 f16; ffi/numerics.h mt_load_elem / mt_store_elem)
// where a kernel takes it; biases and sums are f32. Dropout is f32.
#include "common.cuh"
#include "../../numerics.h"

// ---------------------------------------------------------------------------------------------
// bias
// ---------------------------------------------------------------------------------------------

// out, inp (N,C) of elem, bias (C): out = inp + bias (out may be inp)
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_bias_add_f32(void* out, const void* inp, const float* bias, int64_t N, int64_t C, int32_t elem) {
  const int64_t n = N * C;
  for (int64_t i = thread_index(); i < n; i += thread_count())
    mt_store_elem(out, i, mt_load_elem(inp, i, elem) + bias[i % C], elem);
}

// forward was: out[n,c] = inp[n,c] + bias[c]
// Column sums of dout (N,C) of elem over row ranges: task (chunk, split) is a block (32, Y) over 32
// consecutive channels and rows [split * rows_per, +rows_per); its Y rows of threads take every
// Y-th row and their partials are added in row order, so the result is deterministic without
// atomics. The sum goes to out[split * C + c], added when `accumulate`. Needs blockDim.x == 32,
// blockDim.y <= 32, rows_per >= 1.
#define BIAS_Y_MAX 32
__device__ __forceinline__ void bias_column_sums(float* out, const void* dout, int64_t N, int64_t C,
                                                 int64_t rows_per, bool accumulate, int32_t elem) {
  __shared__ float partial[BIAS_Y_MAX][WARP_SIZE + 1];  // +1: no bank conflicts on the column sum
  for_each_column_task(N, C, rows_per, [&](int64_t split, int64_t c, int64_t n0, int64_t end) {
    float acc = 0.0f;
    if (c < C) {
      for (int64_t n = n0 + threadIdx.y; n < end; n += blockDim.y)
        acc += mt_load_elem(dout, n * C + c, elem);
    }
    partial[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
      float total = 0.0f;
      for (unsigned y = 0; y < blockDim.y; y++) total += partial[y][threadIdx.x];
      float* o = out + split * C + c;
      *o = accumulate ? *o + total : total;
    }
    __syncthreads();  // partial is rewritten by the next task
  });
}

// dbias (C) += sum over rows of dout (N,C) of elem, in one pass: a block per 32 channels
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_bias_backward_f32(float* dbias, const void* dout, int64_t N, int64_t C, int32_t elem) {
  bias_column_sums(dbias, dout, N, C, N > 0 ? N : 1, true, elem);
}

// The same sum split over row ranges too, for when C / 32 blocks would leave most SMs idle (C = 768
// is 24 blocks): partials[split * C + c] (overwritten) is the sum of rows [split * rows_per,
// +rows_per); mt_column_partials_add_f32 then adds the splits in order. The split count is the
// plan's, from N and C alone, so the order is fixed.
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_bias_backward_partial_f32(float* partials, const void* dout, int64_t N, int64_t C, int64_t rows_per,
                             int32_t elem) {
  bias_column_sums(partials, dout, N, C, rows_per, false, elem);
}

// ---------------------------------------------------------------------------------------------
// relu, gelu
// ---------------------------------------------------------------------------------------------

// out, inp (n): out = max(inp, 0), written so NaN propagates (NaN < 0 is false), as torch.relu
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_relu_forward_f32(void* out, const void* inp, int64_t n, int32_t elem) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const float x = mt_load_elem(inp, i, elem);
    mt_store_elem(out, i, x < 0.0f ? 0.0f : x, elem);
  }
}
// forward was: out = max(inp, 0)
// dinp, inp, dout (n): dinp += inp > 0 ? dout : 0
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_relu_backward_f32(void* dinp, const void* inp, const void* dout, int64_t n, int32_t elem) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const float g = mt_load_elem(inp, i, elem) > 0.0f ? mt_load_elem(dout, i, elem) : 0.0f;
    mt_store_elem(dinp, i, mt_load_elem(dinp, i, elem) + g, elem);
  }
}

// the formula is ffi/numerics.h's, shared with kernels.c; the tanh is CUDA's
__device__ __forceinline__ float gelu(float x) { return mt_gelu_from_tanh(x, tanhf(mt_gelu_tanh_arg(x))); }
// out, inp (n); tanh approximation, as in GPT-2: out = 0.5 x (1 + tanh(s (x + 0.044715 x^3)))
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_gelu_forward_f32(void* out, const void* inp, int64_t n, int32_t elem) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) mt_store_elem(out, i, gelu(mt_load_elem(inp, i, elem)), elem);
}
// out, pre (N,C) of elem, bias (C): pre += bias in place, out = gelu(pre); the bits of
// mt_bias_add_f32 then mt_gelu_forward_f32 (GELU reads pre as stored), in one pass over memory
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_bias_gelu_forward_f32(void* out, void* pre, const float* bias, int64_t N, int64_t C, int32_t elem) {
  for (int64_t i = thread_index(); i < N * C; i += thread_count()) {
    mt_store_elem(pre, i, mt_load_elem(pre, i, elem) + bias[i % C], elem);
    mt_store_elem(out, i, gelu(mt_load_elem(pre, i, elem)), elem);
  }
}
// forward was: out = 0.5 x (1 + tanh(s (x + 0.044715 x^3)))
// dinp, inp, dout (n) of elem: dinp += gelu'(inp) * dout
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_gelu_backward_f32(void* dinp, const void* inp, const void* dout, int64_t n, int32_t elem) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const float x = mt_load_elem(inp, i, elem);
    const float local = mt_gelu_grad_from_tanh(x, tanhf(mt_gelu_tanh_arg(x)));
    mt_store_elem(dinp, i, mt_load_elem(dinp, i, elem) + local * mt_load_elem(dout, i, elem), elem);
  }
}

// ---------------------------------------------------------------------------------------------
// dropout: a counter-based hash decides each element, so backward recomputes the mask from
// (seed, index) and no mask is stored. The hash is ffi/numerics.h, shared with ffi/cpu/kernels.c
// (integer arithmetic only), so masks match the CPU bit for bit.
// ---------------------------------------------------------------------------------------------

// out, inp (n); keep with probability 1-p, scale kept values by 1/(1-p)
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_dropout_forward_f32(float* out, const float* inp, int64_t n, float p, uint64_t seed) {
  const float scale = 1.0f / (1.0f - p);
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    out[i] = mt_dropout_uniform(seed, i) >= p ? inp[i] * scale : 0.0f;
  }
}
// forward was: out[i] = keep(i) ? inp[i] / (1-p) : 0
// dinp, dout (n): dinp += keep(i) ? dout / (1-p) : 0
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_dropout_backward_f32(float* dinp, const float* dout, int64_t n, float p, uint64_t seed) {
  const float scale = 1.0f / (1.0f - p);
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    if (mt_dropout_uniform(seed, i) >= p) dinp[i] += dout[i] * scale;
  }
}
