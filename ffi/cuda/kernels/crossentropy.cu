// Softmax cross-entropy, fused and numerically stable. N rows, V vocab. The logits (and their
// gradient) are of `elem` (0 f32, 1 bf16, 2 f16: bf16 under autocast, where the head's GEMM writes
// them so); every sum is f32.
// Row kernels: one block per row (grid-stride over rows), blockDim.x a multiple of 32; the
// block reductions combine in a fixed order, so results are deterministic.
#include "common.cuh"
#include "../../numerics.h"

// A running softmax denominator: sum of exp(x - m) over the values seen, m their maximum. Two
// combine exactly (up to rounding) into the pair over both; -inf means nothing seen yet.
struct MaxSum {
  float m, s;
};
__device__ __forceinline__ MaxSum max_sum_add(MaxSum a, float x) {
  if (x > a.m) return {x, a.s * expf(a.m - x) + 1.0f};
  return {a.m, a.s + expf(x - a.m)};  // NaN x: the sum becomes NaN, as it should
}
__device__ __forceinline__ MaxSum max_sum_combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.0f};
  return {m, (a.m == -INFINITY ? 0.0f : a.s * expf(a.m - m)) + (b.m == -INFINITY ? 0.0f : b.s * expf(b.m - m))};
}
struct MaxSumOp {
  __device__ __forceinline__ MaxSum operator()(MaxSum a, MaxSum b) const { return max_sum_combine(a, b); }
};
__device__ __forceinline__ MaxSum shfl_xor(MaxSum v, int offset) {
  return {shfl_xor(v.m, offset), shfl_xor(v.s, offset)};
}

// losses, lse (N); logits (N,V) of elem; targets (N) int32.
// lse[n] = log sum_v exp(logits[n,v]) (all that backward needs besides the logits), in one pass
// over the row (an online maximum); losses[n] = lse[n] - logits[n, targets[n]], or 0 for a target
// outside [0,V) (counted by mt_crossentropy_loss_f32; the caller turns that into an error).
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_crossentropy_forward_f32(float* losses, float* lse, const void* logits, const int32_t* targets, int64_t N,
                            int64_t V, int32_t elem) {
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    MaxSum ms = {-INFINITY, 0.0f};
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) ms = max_sum_add(ms, mt_load_elem(logits, n * V + v, elem));
    ms = block_reduce(ms, MaxSumOp());
    if (threadIdx.x == 0) {
      const float l = logf(ms.s) + ms.m;
      const int32_t t = targets[n];
      lse[n] = l;
      // -log p[t] computed as logsumexp - x[t], which stays finite when p[t] underflows
      losses[n] = (t < 0 || t >= V) ? 0.0f : l - mt_load_elem(logits, n * V + t, elem);
    }
  }
}

// loss (1) = mean of losses (N), summed in double; invalid (1) int64 = count of targets (N)
// outside [0,V). One block (the grid must be 1 block): a fixed-order reduction, deterministic.
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_crossentropy_loss_f32(float* loss, int64_t* invalid, const float* losses, const int32_t* targets, int64_t N,
                         int64_t V) {
  if (blockIdx.x != 0) return;
  double acc = 0.0;
  int64_t bad = 0;
  for (int64_t n = threadIdx.x; n < N; n += blockDim.x) {
    acc += losses[n];
    const int32_t t = targets[n];
    bad += (t < 0 || t >= V) ? 1 : 0;
  }
  acc = block_reduce(acc, SumOp());
  bad = block_reduce(bad, SumOp());
  if (threadIdx.x == 0) {
    loss[0] = (float)(acc / (double)N);
    invalid[0] = bad;
  }
}

// forward was: loss = mean_n(lse[n] - logits[n, targets[n]])
// dlogits, logits (N,V) of elem; lse, targets (N); dloss (1):
// dlogits (+)= (exp(logits - lse) - onehot(targets)) * dloss[0] / N. With accumulate 0 it
// overwrites, and dlogits may be the logits themselves (each element is read, then written, by
// one thread).
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_crossentropy_backward_f32(void* dlogits, const void* logits, const float* lse, const int32_t* targets,
                             const float* dloss, int64_t N, int64_t V, int32_t accumulate, int32_t elem) {
  const float g = dloss[0] / (float)N;
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    const float l = lse[n];
    const int64_t t = targets[n];
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
      const int64_t i = n * V + v;
      const float grad = (expf(mt_load_elem(logits, i, elem) - l) - (v == t ? 1.0f : 0.0f)) * g;
      mt_store_elem(dlogits, i, accumulate ? mt_load_elem(dlogits, i, elem) + grad : grad, elem);
    }
  }
}

// The argmax a strict > scan from v = 0 finds: the first of equal maxima; NaN never taken over
// (a pair with a NaN value loses), except a row's first element, which the caller checks.
struct ArgMax {
  float x;
  int64_t v;
};
__device__ __forceinline__ ArgMax arg_max(ArgMax a, ArgMax b) {
  if (isnan(a.x)) return b;
  if (isnan(b.x)) return a;
  return b.x > a.x || (b.x == a.x && b.v < a.v) ? b : a;
}
struct ArgMaxOp {
  __device__ __forceinline__ ArgMax operator()(ArgMax a, ArgMax b) const { return arg_max(a, b); }
};
__device__ __forceinline__ ArgMax shfl_xor(ArgMax a, int offset) {
  return {shfl_xor(a.x, offset), shfl_xor(a.v, offset)};
}

// partials (gridDim.x) int64 = per block, the rows n (grid-stride) of logits (N,V) of elem whose
// argmax (as mt_count_correct_f32 in ffi/cpu/kernels.c: the first largest, NaN passed over
// unless first) is targets[n]; mt_sum_partials_i64 adds them. Every block writes its partial.
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_count_correct_partial_f32(int64_t* partials, const void* logits, const int32_t* targets, int64_t N, int64_t V,
                             int32_t elem) {
  int64_t correct = 0;
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    ArgMax best = {NAN, V};
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) best = arg_max(best, {mt_load_elem(logits, n * V + v, elem), v});
    best = block_reduce(best, ArgMaxOp());
    const int64_t argmax = isnan(mt_load_elem(logits, n * V, elem)) || best.v == V ? 0 : best.v;
    correct += argmax == targets[n] ? 1 : 0;
  }
  if (threadIdx.x == 0) partials[blockIdx.x] = correct;
}
