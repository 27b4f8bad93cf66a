// Softmax cross-entropy, fused and numerically stable. N rows, V vocab.
// Row kernels: one block per row (grid-stride over rows), blockDim.x a multiple of 32; the
// block reductions combine in a fixed order, so results are deterministic.
#include "common.cuh"

// losses (N); probs, logits (N,V); targets (N) int32.
// probs = softmax(logits) per row; losses[n] = -log probs[n, targets[n]], or 0 for a target
// outside [0,V) (counted by mt_crossentropy_loss_f32; the caller turns that into an error).
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_crossentropy_forward_f32(float* losses, float* probs, const float* logits, const int32_t* targets, int64_t N,
                            int64_t V) {
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    const float* x = logits + n * V;
    float* p = probs + n * V;
    float maxv = -INFINITY;
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) maxv = fmaxf(maxv, x[v]);
    maxv = block_reduce(maxv, MaxOp());
    float sum = 0.0f;
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
      const float e = expf(x[v] - maxv);
      p[v] = e;
      sum += e;
    }
    sum = block_reduce(sum, SumOp());
    const float inv = 1.0f / sum;
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) p[v] *= inv;  // each thread rereads its own writes
    if (threadIdx.x == 0) {
      const int32_t t = targets[n];
      // -log p[t] computed as logsumexp - x[t], which stays finite when p[t] underflows
      losses[n] = (t < 0 || t >= V) ? 0.0f : logf(sum) + maxv - x[t];
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

// forward was: loss = mean_n(-log softmax(logits[n])[targets[n]])
// dlogits, probs (N,V); targets (N) int32; dloss (1):
// dlogits += (probs - onehot(targets)) * dloss[0] / N
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_crossentropy_backward_f32(float* dlogits, const float* probs, const int32_t* targets, const float* dloss,
                             int64_t N, int64_t V) {
  const float g = dloss[0] / (float)N;
  for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
    const float* p = probs + n * V;
    float* d = dlogits + n * V;
    const int64_t t = targets[n];
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) d[v] += (p[v] - (v == t ? 1.0f : 0.0f)) * g;
  }
}
