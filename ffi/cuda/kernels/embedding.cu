// Embedding lookup. N rows (tokens), C channels, V vocab; ids are int32.
#include "common.cuh"

// out (N,C) = table (V,C) [ids (N)]; rows of ids outside [0,V) are left zero (counted by
// mt_embedding_count_invalid_i32). One warp per row, grid-stride over rows.
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_embedding_forward_f32(float* out, const int32_t* ids, const float* table, int64_t N, int64_t C, int64_t V) {
  const int lane = threadIdx.x % WARP_SIZE;
  for (int64_t n = warp_row(); n < N; n += warp_row_step()) {
    const int64_t id = ids[n];
    float* o = out + n * C;
    if (id < 0 || id >= V) {
      for (int64_t c = lane; c < C; c += WARP_SIZE) o[c] = 0.0f;
    } else {
      const float* row = table + id * C;
      for (int64_t c = lane; c < C; c += WARP_SIZE) o[c] = row[c];
    }
  }
}

// invalid (1) int64 = count of ids (N) outside [0,V). One block (the grid must be 1 block);
// integer sums, so the order does not matter.
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_embedding_count_invalid_i32(int64_t* invalid, const int32_t* ids, int64_t N, int64_t V) {
  if (blockIdx.x != 0) return;
  int64_t bad = 0;
  for (int64_t n = threadIdx.x; n < N; n += blockDim.x) bad += (ids[n] < 0 || ids[n] >= V) ? 1 : 0;
  bad = block_reduce(bad, SumOp());
  if (threadIdx.x == 0) invalid[0] = bad;
}

// forward was: out[n,:] = table[ids[n],:]
// dtable (V,C) += scatter of dout (N,C) by ids (N).
// ATOMICS: a token repeated in the batch adds several rows of dout into one row of dtable, and
// which thread gets there first varies, so float atomicAdd makes those rows' sums vary in the
// last bits from run to run (rows of tokens seen once are exact and deterministic). The
// deterministic alternatives cost too much without scratch memory: kernels.c's split by columns
// gives only C threads, each walking all N rows with a dependent read-modify-write (tens of ms
// for N = 1e5), and sorting ids needs temporary buffers. Flat grid-stride over N*C, so
// neighbouring lanes hit neighbouring addresses. Negative ids are skipped (the forward has
// already reported them); ids >= V cannot be checked here (no V), as on the CPU.
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_embedding_backward_f32(float* dtable, const int32_t* ids, const float* dout, int64_t N, int64_t C) {
  const int64_t n_total = N * C;
  for (int64_t i = thread_index(); i < n_total; i += thread_count()) {
    const int64_t id = ids[i / C];
    if (id >= 0) atomicAdd(dtable + id * C + i % C, dout[i]);
  }
}
