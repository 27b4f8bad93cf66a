// Softmax cross-entropy, fused and numerically stable. N rows, V vocab.
// Row kernels: one block per row (grid-stride over rows), blockDim.x a multiple of 32; the
// block reductions combine in a fixed order, so results are deterministic.
#include "common.cuh"

// losses, lse (N); logits (N,V); targets (N) int32.
// lse[n] = log sum_v exp(logits[n,v]) (all that backward needs besides the logits);
// losses[n] = lse[n] - logits[n, targets[n]], or 0 for a target outside [0,V) (counted by
// mt_crossentropy_loss_f32; the caller turns that into an error).
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_crossentropy_forward_f32(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N,
                            int64_t V) {
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    const float* x = logits + n * V;
    float maxv = -INFINITY;
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) maxv = fmaxf(maxv, x[v]);
    maxv = block_reduce(maxv, MaxOp());
    float sum = 0.0f;
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) sum += expf(x[v] - maxv);
    sum = block_reduce(sum, SumOp());
    if (threadIdx.x == 0) {
      const float l = logf(sum) + maxv;
      const int32_t t = targets[n];
      lse[n] = l;
      // -log p[t] computed as logsumexp - x[t], which stays finite when p[t] underflows
      losses[n] = (t < 0 || t >= V) ? 0.0f : l - x[t];
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
// dlogits, logits (N,V); lse, targets (N); dloss (1):
// dlogits (+)= (exp(logits - lse) - onehot(targets)) * dloss[0] / N. With accumulate 0 it
// overwrites, and dlogits may be the logits themselves (each element is read, then written, by
// one thread).
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_crossentropy_backward_f32(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                             const float* dloss, int64_t N, int64_t V, int32_t accumulate) {
  const float g = dloss[0] / (float)N;
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    const float* x = logits + n * V;
    float* d = dlogits + n * V;
    const float l = lse[n];
    const int64_t t = targets[n];
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
      const float grad = (expf(x[v] - l) - (v == t ? 1.0f : 0.0f)) * g;
      d[v] = accumulate ? d[v] + grad : grad;
    }
  }
}
