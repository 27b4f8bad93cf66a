// Broadcasting over up to 4 dims: a binary op with stride-0 operands, and its backward, which
// sums a full-shape gradient down onto the broadcast operand.
// Dims (d0,d1,d2,d3) are outermost first; strides are in elements; a broadcast dim has stride 0.
#include "common.cuh"

// out (d0,d1,d2,d3) contiguous; a, b read at i·as, i·bs. op: 0 add, 1 mul.
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_binary_bcast_f32(int32_t op, float* out, const float* a, const float* b,
                    int64_t d0, int64_t d1, int64_t d2, int64_t d3,
                    int64_t as0, int64_t as1, int64_t as2, int64_t as3,
                    int64_t bs0, int64_t bs1, int64_t bs2, int64_t bs3) {
  const int64_t n = d0 * d1 * d2 * d3;
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    const Coord4 c = unravel4(i, d1, d2, d3);
    const float x = a[offset4(c, as0, as1, as2, as3)], y = b[offset4(c, bs0, bs1, bs2, bs3)];
    out[i] = op == 0 ? x + y : x * y;
  }
}

// ---------------------------------------------------------------------------------------------
// reduceBroadcast: out[i·os] += inp[i] over dims, inp contiguous. The plan splits the dims into
// kept ones (out stride != 0: kd, with inp strides kis and out strides kos) and reduced ones
// (out stride 0: rd, with inp strides ris), each padded to 4 with leading size-1 dims, so every
// out element is the sum over the reduced index space at one kept index. No atomics: each out
// element is summed by one thread group in a fixed order (double accumulators), then added once.
// forward was: out[i] = a[i·as] op b[i·bs]  =>  da[i·as] += dout[i] (mul: dout * b, by the caller)
// ---------------------------------------------------------------------------------------------

// The parameters of both kernels (kernels.ts reduceBcastParams): out, inp; the kept dims kd with
// their inp strides kis and out strides kos; the reduced dims rd with their inp strides ris.
#define REDUCE_BCAST_PARAMS                               \
  float* out, const float* inp,                           \
  int64_t kd0, int64_t kd1, int64_t kd2, int64_t kd3,     \
  int64_t kis0, int64_t kis1, int64_t kis2, int64_t kis3, \
  int64_t kos0, int64_t kos1, int64_t kos2, int64_t kos3, \
  int64_t rd0, int64_t rd1, int64_t rd2, int64_t rd3,     \
  int64_t ris0, int64_t ris1, int64_t ris2, int64_t ris3

// Sum of a group of blockDim.x threads: a warp (blockDim.x == 32), or the whole block
// (blockDim.y == 1). All threads of the group must call it.
__device__ __forceinline__ double group_sum(double v) {
  return blockDim.x == WARP_SIZE ? warp_reduce(v, SumOp()) : block_reduce(v, SumOp());
}

// The innermost dim is reduced (contiguous in inp): one group of blockDim.x threads per out
// element, blockDim.y groups per block; the group's threads stride over the reduced index, so
// neighbouring lanes read neighbouring floats.
// out at kos over kept dims kd; inp contiguous over all dims.
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_reduce_bcast_rows_f32(REDUCE_BCAST_PARAMS) {
  const int64_t nOut = kd0 * kd1 * kd2 * kd3, nRed = rd0 * rd1 * rd2 * rd3;
  // o is uniform over a group (a warp, or the whole block when blockDim.y == 1)
  for (int64_t o = (int64_t)blockIdx.x * blockDim.y + threadIdx.y; o < nOut;
       o += (int64_t)gridDim.x * blockDim.y) {
    const Coord4 k = unravel4(o, kd1, kd2, kd3);
    const float* base = inp + offset4(k, kis0, kis1, kis2, kis3);
    double acc = 0.0;
    for (int64_t r = threadIdx.x; r < nRed; r += blockDim.x) {
      acc += base[offset4(unravel4(r, rd1, rd2, rd3), ris0, ris1, ris2, ris3)];
    }
    const double total = group_sum(acc);
    if (threadIdx.x == 0) out[offset4(k, kos0, kos1, kos2, kos3)] += (float)total;
  }
}

// The innermost dim is kept: a block (32, Y) takes 32 consecutive out elements (lanes read
// neighbouring floats); its Y rows of threads split the reduced index, and their partials are
// added in row order. out at kos over kept dims kd; inp contiguous over all dims.
#define COLS_Y_MAX 32
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_reduce_bcast_cols_f32(REDUCE_BCAST_PARAMS) {
  __shared__ double partial[COLS_Y_MAX][WARP_SIZE + 1];  // +1: no bank conflicts on the column sum
  const int64_t nOut = kd0 * kd1 * kd2 * kd3, nRed = rd0 * rd1 * rd2 * rd3;
  const int64_t chunks = (nOut + WARP_SIZE - 1) / WARP_SIZE;
  for (int64_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
    const int64_t o = chunk * WARP_SIZE + threadIdx.x;
    const Coord4 k = unravel4(o < nOut ? o : 0, kd1, kd2, kd3);
    double acc = 0.0;
    if (o < nOut) {
      const float* base = inp + offset4(k, kis0, kis1, kis2, kis3);
      for (int64_t r = threadIdx.y; r < nRed; r += blockDim.y) {
        acc += base[offset4(unravel4(r, rd1, rd2, rd3), ris0, ris1, ris2, ris3)];
      }
    }
    partial[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && o < nOut) {
      double total = 0.0;
      for (unsigned y = 0; y < blockDim.y; y++) total += partial[y][threadIdx.x];
      out[offset4(k, kos0, kos1, kos2, kos3)] += (float)total;
    }
    __syncthreads();  // partial is rewritten by the next chunk
  }
}
