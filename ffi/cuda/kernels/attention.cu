// Attention pieces: the causal softmax over (BH,T,T) score matrices, and the strided copy that
// splits, merges and permutes heads. BH batch*heads, T time.
#include "common.cuh"

// out, inp (BH,T,T): out[b,i,j] = softmax_{j<=i}(scale * inp[b,i,j]); 0 for j > i.
// One warp per row (BH*T rows), looping over the row, so any T works.
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_causal_softmax_forward_f32(float* out, const float* inp, int64_t BH, int64_t T, float scale) {
  const int lane = threadIdx.x % WARP_SIZE;
  const int64_t rows = BH * T;
  for (int64_t r = warp_row(); r < rows; r += warp_row_step()) {
    const int64_t i = r % T;
    const float* x = inp + r * T;
    float* o = out + r * T;
    // __fmul_rn: the product is rounded before the subtraction (no fma contraction), as on the
    // CPU, so the max element gets exp(0) = 1 exactly
    float maxv = -INFINITY;
    for (int64_t j = lane; j <= i; j += WARP_SIZE) maxv = fmaxf(maxv, __fmul_rn(scale, x[j]));
    maxv = warp_reduce(maxv, MaxOp());
    float sum = 0.0f;
    for (int64_t j = lane; j <= i; j += WARP_SIZE) {
      const float e = expf(__fmul_rn(scale, x[j]) - maxv);
      o[j] = e;
      sum += e;
    }
    const float inv = 1.0f / warp_reduce(sum, SumOp());
    for (int64_t j = lane; j <= i; j += WARP_SIZE) o[j] *= inv;  // each lane rereads its own writes
    for (int64_t j = i + 1 + lane; j < T; j += WARP_SIZE) o[j] = 0.0f;
  }
}

// forward was: out[j] = exp(scale x[j]) / sum_k<=i exp(scale x[k])
// dinp, out, dout (BH,T,T): dinp[j] += scale * out[j] * (dout[j] - sum_k<=i out[k] dout[k]), j <= i
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_causal_softmax_backward_f32(float* dinp, const float* out, const float* dout, int64_t BH, int64_t T,
                               float scale) {
  const int lane = threadIdx.x % WARP_SIZE;
  const int64_t rows = BH * T;
  for (int64_t r = warp_row(); r < rows; r += warp_row_step()) {
    const int64_t i = r % T;
    const float* y = out + r * T;
    const float* g = dout + r * T;
    float* d = dinp + r * T;
    float dot = 0.0f;
    for (int64_t j = lane; j <= i; j += WARP_SIZE) dot += y[j] * g[j];
    dot = warp_reduce(dot, SumOp());
    for (int64_t j = lane; j <= i; j += WARP_SIZE) d[j] += scale * y[j] * (g[j] - dot);
  }
}

// out[i·os] (= or +=) inp[i·is] for i over (d0,d1,d2,d3); strides in elements. Permute,
// transpose, the q/k/v split and merge of attention, and with accumulate their backward. The
// caller guarantees no two indices write the same out element, so threads never race.
// Flat grid-stride over the index space.
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_strided_copy_f32(float* out, const float* inp,
                    int64_t d0, int64_t d1, int64_t d2, int64_t d3,
                    int64_t os0, int64_t os1, int64_t os2, int64_t os3,
                    int64_t is0, int64_t is1, int64_t is2, int64_t is3, int32_t accumulate) {
  const int64_t n = d0 * d1 * d2 * d3;
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const Coord4 c = unravel4(i, d1, d2, d3);
    const float x = inp[offset4(c, is0, is1, is2, is3)];
    float* o = out + offset4(c, os0, os1, os2, os3);
    if (accumulate) *o += x;
    else *o = x;
  }
}
