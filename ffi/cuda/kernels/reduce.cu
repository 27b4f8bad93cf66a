// Reductions over n elements: sum, sum of squares, count of non-finite values (the inf/nan
// check of fp16 loss scaling). All deterministic: block partials combined in a fixed order,
// no atomics. The partial count is chosen by the plan from n alone, so a given n always
// reduces in the same order.
#include "common.cuh"

// out (1) = sum of inp (n), accumulated in double. One block (the grid must be 1 block): the
// method gets no scratch memory for block partials. One SM streams roughly 100-200 GB/s, so
// 1e8 floats take a few ms; if engine sum/mean on big tensors shows in profiles, give this
// plan scratch and the two-pass scheme of sumSquares.
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_sum_f32(float* out, const float* inp, int64_t n) {
  if (blockIdx.x != 0) return;
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) acc += inp[i];
  acc = block_reduce(acc, SumOp());
  if (threadIdx.x == 0) out[0] = (float)acc;
}

// partials (gridDim.x) double = per-block sums of x*x over x (n), in double
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_sum_squares_partial_f32(double* partials, const float* x, int64_t n) {
  double acc = 0.0;
  for (int64_t i = thread_index(); i < n; i += thread_count()) acc += (double)x[i] * (double)x[i];
  acc = block_reduce(acc, SumOp());
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// partials (gridDim.x) int64 = per-block counts of NaN or +-Inf in x (n). A bit test (exponent
// all ones), exact whatever the compiler flags.
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_count_nonfinite_partial_f32(int64_t* partials, const float* x, int64_t n) {
  int64_t bad = 0;
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    bad += (__float_as_uint(x[i]) & 0x7f800000u) == 0x7f800000u ? 1 : 0;
  }
  bad = block_reduce(bad, SumOp());
  if (threadIdx.x == 0) partials[blockIdx.x] = bad;
}

// result (1) = sum of partials (count), in a fixed order. One block.
template <class T>
__device__ __forceinline__ void sum_partials(T* result, const T* partials, int64_t count) {
  if (blockIdx.x != 0) return;
  T acc = 0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) acc += partials[i];
  acc = block_reduce(acc, SumOp());
  if (threadIdx.x == 0) result[0] = acc;
}
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_sum_partials_f64(double* result, const double* partials, int64_t count) {
  sum_partials(result, partials, count);
}
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_sum_partials_i64(int64_t* result, const int64_t* partials, int64_t count) {
  sum_partials(result, partials, count);
}

// out (C) += sum over s of partials (splits, C), in split order: the second pass of the split
// column sums (bias and LayerNorm parameter gradients). A thread per column.
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_column_partials_add_f32(float* out, const float* partials, int64_t splits, int64_t C) {
  for (int64_t c = thread_index(); c < C; c += thread_count()) {
    float total = 0.0f;
    for (int64_t s = 0; s < splits; s++) total += partials[s * C + c];
    out[c] += total;
  }
}

// Keeps the stream busy for ns nanoseconds of the GPU's global timer (one thread spins), so that
// work queued behind it runs back to back however slowly the host queued it: bench engine's
// measure of what kernel launches cost a step. The host emulator has no such timer: it returns.
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX) mt_hold_ns(int64_t ns) {
#ifdef __CUDACC__
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while ((int64_t)(now - start) < ns);
#else
  (void)ns;
#endif
}
