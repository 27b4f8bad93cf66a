// Elementwise f32 kernels: add, mul, axpy, scale, addScalarFrom (fill is the driver's cuMemsetD32Async).
// n is an element count; 1D grid-stride loops, so any 1D grid works.
#include "common.cuh"

// out, a, b (n): out = a + b
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_add_f32(float* out, const float* a, const float* b, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) out[i] = a[i] + b[i];
}

// out, a, b (n): out = a * b
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_mul_f32(float* out, const float* a, const float* b, int64_t n) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) out[i] = a[i] * b[i];
}

// y, x (n): y += alpha * x
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_axpy_f32(float* y, const float* x, int64_t n, float alpha) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) y[i] += alpha * x[i];
}

// x (n): x *= s
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_scale_f32(float* x, int64_t n, float s) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) x[i] *= s;
}

// dinp (n) += dout[0] * scale; dout (1) is a scalar in device memory.
// Backward of sum/mean and of a scalar broadcast.
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_add_scalar_ptr_f32(float* dinp, const float* dout, float scale, int64_t n) {
  const float g = dout[0] * scale;
  for (int64_t i = thread_index(); i < n; i += thread_count()) dinp[i] += g;
}
