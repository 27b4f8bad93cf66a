// Helpers shared by the kernel modules in this folder (each .cu is compiled on its own to PTX
// by ffi/cuda/build.ts and includes this header; the build stamps hash it too).
//
// Conventions, as in ffi/cpu/kernels.c:
//   - every buffer argument has its shape in a comment; N rows, C channels, V vocab,
//     BH batch*heads, T time.
//   - backward kernels ADD into their d-buffers (dinp += ...).
//   - sizes are int64_t and index math is 64-bit (N*C can exceed 2^31).
//   - every loop over elements, rows or column chunks is grid-stride, so a kernel is correct for
//     any grid the plan in ffi/cuda/kernels.ts picks (that file caps grids at the hardware limits).
//   - reductions combine in a fixed order (warp shuffles with a fixed pattern, then warps in
//     index order), so results are bit-identical from run to run for a given launch shape.
//   - accurate math only (expf, logf, tanhf, IEEE division and sqrt): no --use_fast_math.
#pragma once
#include <stdint.h>

#define WARP_SIZE 32
#define FULL_MASK 0xffffffffu
// Every kernel is declared __launch_bounds__(BLOCK_THREADS_MAX): the plans in kernels.ts pick
// blocks of up to 1024 threads, and the bound makes ptxas keep each kernel within 64 registers
// per thread, so no launch can fail for lack of registers (these simple kernels need far fewer).
#define BLOCK_THREADS_MAX 1024

// global index of this thread in a 1D grid, and the number of threads in the grid (64-bit)
__device__ __forceinline__ int64_t thread_index() {
  return (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t thread_count() {
  return (int64_t)gridDim.x * blockDim.x;
}

// Warp-per-row kernels (blockDim.x a multiple of 32): the first row of this warp, and the row
// step of the grid.
__device__ __forceinline__ int64_t warp_row() {
  return (int64_t)blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
}
__device__ __forceinline__ int64_t warp_row_step() {
  return (int64_t)gridDim.x * (blockDim.x / WARP_SIZE);
}

struct SumOp {
  template <class T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};

// v from lane ^ offset of the warp (all lanes must call it). A struct gives an overload of its
// own, beside the struct, that exchanges each field; the reductions below find it by its type.
template <class T>
__device__ __forceinline__ T shfl_xor(T v, int offset) {
  return __shfl_xor_sync(FULL_MASK, v, offset);
}

// Butterfly reduction over the 32 lanes of a warp; every lane gets the result. All lanes must
// call it (full mask).
template <class T, class Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
  for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) v = op(v, shfl_xor(v, offset));
  return v;
}

// Reduction over a 1D block (blockDim.x a multiple of 32, at most 1024, blockDim.y == 1); every
// thread gets the result. Warp results are combined in warp order. All threads must call it.
template <class T, class Op>
__device__ __forceinline__ T block_reduce(T v, Op op) {
  __shared__ T warp_partials[32];
  const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
  const int warps = blockDim.x / WARP_SIZE;
  v = warp_reduce(v, op);
  __syncthreads();  // readers of a previous call are done with warp_partials
  if (lane == 0) warp_partials[warp] = v;
  __syncthreads();
  T total = warp_partials[0];
  for (int w = 1; w < warps; w++) total = op(total, warp_partials[w]);
  return total;
}

// Column sums over row ranges (layers.cu's bias gradient, layernorm.cu's parameter gradients), as
// (chunk, split) tasks in grid-stride order: a block (32, Y) takes channels [chunk * 32, +32) of rows
// [split * rows_per, +rows_per) (rows_per >= 1). Calls task(split, c, n0, end): this thread's
// channel c (which may be past C) and the split's rows [n0, end).
template <class Task>
__device__ __forceinline__ void for_each_column_task(int64_t N, int64_t C, int64_t rows_per, Task&& task) {
  const int64_t chunks = (C + WARP_SIZE - 1) / WARP_SIZE;
  const int64_t splits = (N + rows_per - 1) / rows_per;
  for (int64_t i = blockIdx.x; i < chunks * splits; i += gridDim.x) {
    const int64_t chunk = i % chunks, split = i / chunks;
    const int64_t c = chunk * WARP_SIZE + threadIdx.x;
    const int64_t end = (split + 1) * rows_per < N ? (split + 1) * rows_per : N;
    task(split, c, split * rows_per, end);
  }
}

// Coordinates of flat index i over dims (d0,d1,d2,d3), row-major with d3 fastest; d0 is implied
// (whatever is left). Dims of size 1 cost a compare, not a division. The divisions are 64-bit
// (nvcc's routine takes a 32-bit path when both operands fit).
struct Coord4 {
  int64_t i0, i1, i2, i3;
};
__device__ __forceinline__ Coord4 unravel4(int64_t i, int64_t d1, int64_t d2, int64_t d3) {
  Coord4 c = {0, 0, 0, 0};
  if (d3 != 1) { c.i3 = i % d3; i /= d3; }
  if (d2 != 1) { c.i2 = i % d2; i /= d2; }
  if (d1 != 1) { c.i1 = i % d1; i /= d1; }
  c.i0 = i;
  return c;
}
// element offset of coordinates c under strides (s0,s1,s2,s3)
__device__ __forceinline__ int64_t offset4(Coord4 c, int64_t s0, int64_t s1, int64_t s2, int64_t s3) {
  return c.i0 * s0 + c.i1 * s1 + c.i2 * s2 + c.i3 * s3;
}
