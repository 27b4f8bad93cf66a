// LayerNorm over the last dim C. N rows.
// Row kernels: one warp per row (blockDim.x a multiple of 32, grid-stride over rows), loops
// over the row, so any C works; warp shuffles in a fixed pattern keep results deterministic.
#include "common.cuh"
#include "../../numerics.h"

// out (N,C) of elem (0 f32, 1 bf16, 2 f16), inp (N,C) f32; mean, rstd (N); weight, bias (C)
// out[n,c] = (inp[n,c] - mean[n]) * rstd[n] * weight[c] + bias[c], with the two-pass mean and
// (biased) variance of kernels.c: mean first, then the mean of squared deviations.
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_layernorm_forward_f32(void* out, float* mean, float* rstd, const float* inp, const float* weight,
                         const float* bias, int64_t N, int64_t C, float eps, int32_t elem) {
  const int lane = threadIdx.x % WARP_SIZE;
  for (int64_t n = warp_row(); n < N; n += warp_row_step()) {
    const float* x = inp + n * C;
    float m = 0.0f;
    for (int64_t c = lane; c < C; c += WARP_SIZE) m += x[c];
    m = warp_reduce(m, SumOp()) / (float)C;
    float var = 0.0f;
    for (int64_t c = lane; c < C; c += WARP_SIZE) {
      const float d = x[c] - m;
      var += d * d;
    }
    var = warp_reduce(var, SumOp()) / (float)C;
    const float s = 1.0f / sqrtf(var + eps);
    for (int64_t c = lane; c < C; c += WARP_SIZE) mt_store_elem(out, n * C + c, (x[c] - m) * s * weight[c] + bias[c], elem);
    if (lane == 0) {
      mean[n] = m;
      rstd[n] = s;
    }
  }
}

// sum = x + d, then out = layernorm(sum) as above, mean and rstd: a residual add and the
// LayerNorm that reads it in one pass over memory. sum, x, d (N,C) f32, out (N,C) of elem;
// mean, rstd (N).
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_residual_layernorm_forward_f32(float* sum, void* out, float* mean, float* rstd, const float* x,
                                  const float* d, const float* weight, const float* bias, int64_t N, int64_t C,
                                  float eps, int32_t elem) {
  const int lane = threadIdx.x % WARP_SIZE;
  for (int64_t n = warp_row(); n < N; n += warp_row_step()) {
    float* sr = sum + n * C;
    float m = 0.0f;
    for (int64_t c = lane; c < C; c += WARP_SIZE) {
      const float v = x[n * C + c] + d[n * C + c];
      sr[c] = v;
      m += v;
    }
    m = warp_reduce(m, SumOp()) / (float)C;
    float var = 0.0f;
    for (int64_t c = lane; c < C; c += WARP_SIZE) {  // each lane rereads its own writes
      const float dv = sr[c] - m;
      var += dv * dv;
    }
    var = warp_reduce(var, SumOp()) / (float)C;
    const float s = 1.0f / sqrtf(var + eps);
    for (int64_t c = lane; c < C; c += WARP_SIZE) mt_store_elem(out, n * C + c, (sr[c] - m) * s * weight[c] + bias[c], elem);
    if (lane == 0) {
      mean[n] = m;
      rstd[n] = s;
    }
  }
}

// forward was: out[n,c] = (inp[n,c] - mean[n]) * rstd[n] * weight[c] + bias[c]
// dinp, inp (N,C) f32, dout (N,C) of elem; weight (C); mean, rstd (N). One warp per row:
// dinp += (dnorm - mean_c(dnorm) - norm * mean_c(dnorm * norm)) * rstd, dnorm = weight * dout.
// dweight and dbias are mt_layernorm_backward_params_f32's.
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_layernorm_backward_f32(float* dinp, const void* dout, const float* inp, const float* weight,
                          const float* mean, const float* rstd, int64_t N, int64_t C, int32_t elem) {
  const int lane = threadIdx.x % WARP_SIZE;
  for (int64_t n = warp_row(); n < N; n += warp_row_step()) {
    const float* x = inp + n * C;
    const float m = mean[n], s = rstd[n];
    float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
    for (int64_t c = lane; c < C; c += WARP_SIZE) {
      const float norm = (x[c] - m) * s;
      const float dnorm = weight[c] * mt_load_elem(dout, n * C + c, elem);
      dnorm_mean += dnorm;
      dnorm_norm_mean += dnorm * norm;
    }
    dnorm_mean = warp_reduce(dnorm_mean, SumOp()) / (float)C;
    dnorm_norm_mean = warp_reduce(dnorm_norm_mean, SumOp()) / (float)C;
    float* dx = dinp + n * C;
    for (int64_t c = lane; c < C; c += WARP_SIZE) {
      const float norm = (x[c] - m) * s;
      const float dnorm = weight[c] * mt_load_elem(dout, n * C + c, elem);
      dx[c] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
    }
  }
}

// forward was: out[n,c] = norm[n,c] * weight[c] + bias[c], norm = (inp - mean) * rstd
// The column sums of norm * dout and dout, dout (N,C) of elem, inp (N,C), mean, rstd (N), over row
// ranges: task (chunk, split) is a block (32, Y) over 32 consecutive channels and rows
// [split * rows_per, +rows_per); its Y rows of threads split the rows and their partials are added
// in row order: deterministic, no atomics. The sums go to dw[split * C + c] and db[split * C + c],
// added when `accumulate`. Needs blockDim.x == 32, Y <= 32, rows_per >= 1.
#define PARAMS_Y_MAX 32
__device__ __forceinline__ void layernorm_param_sums(float* dw_out, float* db_out, const void* dout, const float* inp,
                                                     const float* mean, const float* rstd, int64_t N, int64_t C,
                                                     int64_t rows_per, bool accumulate, int32_t elem) {
  __shared__ float dw_partial[PARAMS_Y_MAX][WARP_SIZE + 1];  // +1: no bank conflicts on the column sum
  __shared__ float db_partial[PARAMS_Y_MAX][WARP_SIZE + 1];
  for_each_column_task(N, C, rows_per, [&](int64_t split, int64_t c, int64_t n0, int64_t end) {
    float dw = 0.0f, db = 0.0f;
    if (c < C) {
      for (int64_t n = n0 + threadIdx.y; n < end; n += blockDim.y) {
        const float g = mt_load_elem(dout, n * C + c, elem);
        const float norm = (inp[n * C + c] - mean[n]) * rstd[n];
        dw += norm * g;
        db += g;
      }
    }
    dw_partial[threadIdx.y][threadIdx.x] = dw;
    db_partial[threadIdx.y][threadIdx.x] = db;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
      float dw_total = 0.0f, db_total = 0.0f;
      for (unsigned y = 0; y < blockDim.y; y++) {
        dw_total += dw_partial[y][threadIdx.x];
        db_total += db_partial[y][threadIdx.x];
      }
      float* w = dw_out + split * C + c;
      float* b = db_out + split * C + c;
      *w = accumulate ? *w + dw_total : dw_total;
      *b = accumulate ? *b + db_total : db_total;
    }
    __syncthreads();  // the partials are rewritten by the next task
  });
}

// dweight, dbias (C) += those sums over every row, in one pass: a block per 32 channels
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_layernorm_backward_params_f32(float* dweight, float* dbias, const void* dout, const float* inp,
                                 const float* mean, const float* rstd, int64_t N, int64_t C, int32_t elem) {
  layernorm_param_sums(dweight, dbias, dout, inp, mean, rstd, N, C, N > 0 ? N : 1, true, elem);
}

// The same sums split over row ranges too (as mt_bias_backward_partial_f32 in layers.cu): dweight's
// at partials[split * C + c], dbias's at [(splits + split) * C + c], overwritten;
// mt_column_partials_add_f32 adds the splits in order.
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_layernorm_params_partial_f32(float* partials, const void* dout, const float* inp, const float* mean,
                                const float* rstd, int64_t N, int64_t C, int64_t rows_per, int32_t elem) {
  const int64_t splits = (N + rows_per - 1) / rows_per;
  layernorm_param_sums(partials, partials + splits * C, dout, inp, mean, rstd, N, C, rows_per, false, elem);
}
