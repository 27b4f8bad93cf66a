// Causal self-attention, fused (flash-attention style), and the strided copy that permutes.
//
// qkv (B,T,3C) of `elem` (0 f32, 1 bf16, 2 f16): channels [q | k | v], head h at [h*D, (h+1)*D)
// of each, D = C/H <= ATT_D_MAX. out (B,T,C) of elem; lse (B,H,T) f32 = log sum_{j<=i} exp(scale
// q_i.k_j). Backward's dqkv, dout and out are of elem; dqkv += the gradient, or = without accumulate.
// Tiles of ATT_BC keys stream through shared memory with an online softmax, so no (T,T) matrix
// exists; backward recomputes the scores from lse. Under autocast (elem 1, 2) the products read
// 2-byte values as ffi/cpu/kernels.c's do: q, k, v as given; P, dout and dS rounded to elem.
//
// A block of ATT_THREADS threads serves one (b, h) and a tile of 32 rows: thread t owns row
// t / 4 and, of each row of length D or 32, the elements t % 4 + 4k. The 4 threads of a row are
// adjacent lanes of one warp, so row sums and maxima are two shuffles. Backward is two kernels,
// dK/dV by key tile and dQ by query tile, so every gradient element is summed by one thread in
// a fixed order (no atomics: results are bit-identical from run to run). Plain f32 FMAs, not
// tensor cores: correct everywhere, and the place to speed up (issue 27's GPU figures).
#include "common.cuh"
#include "../../numerics.h"

#define ATT_BR 32           // query rows per tile
#define ATT_BC 32           // key rows per tile
#define ATT_D_MAX 128       // largest head size (ffi/cuda/kernels.ts refuses larger)
#define ATT_THREADS 128     // 4 threads per row of a 32-row tile
#define ATT_PER (ATT_D_MAX / 4)  // a thread's share of a row of D

__device__ __forceinline__ float att_round(float x, int32_t elem) {
  if (elem == 1) return mt_bits_f32((uint32_t)mt_f32_to_bf16_bits(x) << 16);
  if (elem == 2) return mt_f16_bits_to_f32(mt_f32_to_f16_bits(x));
  return x;
}
// sum (or max) over the 4 adjacent lanes that share a row
__device__ __forceinline__ float row4_sum(float v) {
  v += __shfl_xor_sync(FULL_MASK, v, 1);
  return v + __shfl_xor_sync(FULL_MASK, v, 2);
}
__device__ __forceinline__ float row4_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 1));
  return fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 2));
}
// dst[r][d] (rows of pitch ATT_D_MAX or ATT_D_MAX + 1) = rows [row0, row0 + rows) of one head's
// part of qkv (from column col), zero past `rows`; the whole block takes part
template <int PITCH>
__device__ __forceinline__ void att_tile(float (*dst)[PITCH], const void* qkv, int64_t row0, int64_t rows,
                                         int64_t C3, int64_t col, int64_t D, int32_t elem) {
  for (int64_t e = threadIdx.x; e < 32 * D; e += blockDim.x) {
    const int64_t r = e / D, d = e % D;
    dst[r][d] = r < rows ? mt_load_elem(qkv, (row0 + r) * C3 + col + d, elem) : 0.0f;
  }
}

// The two dot products both backward kernels take for one (query row, key row) pair, s = q . k
// and dp = dout . v: for each, one side is a row of shared memory and the other the thread's
// registers (q and dout in shared memory for dk/dv, k and v for dq; a product's factors commute
// exactly). Each thread sums its elements g + 4kk of the head, then the row's 4 threads add up.
struct AttDots {
  float s, dp;
};
__device__ __forceinline__ AttDots att_dots(const float* s_row, const float (&s_reg)[ATT_PER], const float* dp_row,
                                            const float (&dp_reg)[ATT_PER], int g, int64_t D) {
  float s = 0.0f, dp = 0.0f;
#pragma unroll
  for (int kk = 0; kk < ATT_PER; kk++) {
    const int64_t d = g + 4 * kk;
    if (d < D) {
      s += s_row[d] * s_reg[kk];
      dp += dp_row[d] * dp_reg[kk];
    }
  }
  return {row4_sum(s), row4_sum(dp)};
}

// Calls task(b, h, bh, i0, br, i) for each (batch, head, query tile) task this block takes,
// grid-stride over the B*H*tiles tasks: bh = b*H + h, the tile's rows are [i0, i0 + br), and i is
// the row of thread (r, g), i0 + r. The longest (last) tiles of the causal triangle come first, so
// they finish together with the short ones.
template <class Task>
__device__ __forceinline__ void for_each_query_tile(int64_t B, int64_t T, int64_t H, Task&& task) {
  const int64_t tiles = (T + ATT_BR - 1) / ATT_BR;
  const int r = threadIdx.x / 4;
  for (int64_t n = blockIdx.x; n < B * H * tiles; n += gridDim.x) {
    const int64_t tile = tiles - 1 - n % tiles, bh = n / tiles, i0 = tile * ATT_BR;
    task(bh / H, bh % H, bh, i0, T - i0 < ATT_BR ? T - i0 : ATT_BR, i0 + r);
  }
}

extern "C" __global__ void __launch_bounds__(ATT_THREADS)
mt_attention_forward_f32(void* out, float* lse, const void* qkv, int64_t B, int64_t T, int64_t C, int64_t H,
                         float scale, int32_t elem) {
  __shared__ float q_s[ATT_BR][ATT_D_MAX];
  __shared__ float kv_s[ATT_BC][ATT_D_MAX + 1];
  __shared__ float p_s[ATT_BR][ATT_BC + 1];
  const int64_t D = C / H, C3 = 3 * C;
  const int r = threadIdx.x / 4, g = threadIdx.x % 4;
  for_each_query_tile(B, T, H, [&](int64_t b, int64_t h, int64_t bh, int64_t i0, int64_t br, int64_t i) {
    att_tile<ATT_D_MAX>(q_s, qkv, b * T + i0, br, C3, h * D, D, elem);
    float o[ATT_PER];
#pragma unroll
    for (int k = 0; k < ATT_PER; k++) o[k] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    __syncthreads();
    for (int64_t j0 = 0; j0 < i0 + br; j0 += ATT_BC) {
      const int64_t bc = i0 + br - j0 < ATT_BC ? i0 + br - j0 : ATT_BC;
      att_tile<ATT_D_MAX + 1>(kv_s, qkv, b * T + j0, bc, C3, C + h * D, D, elem);
      __syncthreads();
      // scores of this thread's keys c = g + 4kk
      float s[ATT_BC / 4];
      float mx = -INFINITY;
#pragma unroll
      for (int kk = 0; kk < ATT_BC / 4; kk++) {
        const int c = g + 4 * kk;
        s[kk] = -INFINITY;
        if (r < br && c < bc && j0 + c <= i) {
          float dot = 0.0f;
          for (int64_t d = 0; d < D; d++) dot += q_s[r][d] * kv_s[c][d];
          s[kk] = dot * scale;
          mx = fmaxf(mx, s[kk]);
        }
      }
      mx = row4_max(mx);
      const float mnew = fmaxf(m, mx);
      const float alpha = m == -INFINITY ? 0.0f : expf(m - mnew);
      float sum = 0.0f;
#pragma unroll
      for (int kk = 0; kk < ATT_BC / 4; kk++) {
        const float p = s[kk] == -INFINITY ? 0.0f : expf(s[kk] - mnew);
        sum += p;
        p_s[r][g + 4 * kk] = att_round(p, elem);
      }
      sum = row4_sum(sum);
      l = l * alpha + sum;
      m = mnew;
#pragma unroll
      for (int k = 0; k < ATT_PER; k++) o[k] *= alpha;
      __syncthreads();  // every read of K is done
      att_tile<ATT_D_MAX + 1>(kv_s, qkv, b * T + j0, bc, C3, 2 * C + h * D, D, elem);
      __syncthreads();
      for (int64_t c = 0; c < bc; c++) {
        const float p = p_s[r][c];
#pragma unroll
        for (int k = 0; k < ATT_PER; k++)
          if (g + 4 * k < D) o[k] += p * kv_s[c][g + 4 * k];
      }
      __syncthreads();  // every read of V and P is done
    }
    if (r < br) {
      const float inv = 1.0f / l;
      const int64_t dst = (b * T + i) * C + h * D;
#pragma unroll
      for (int k = 0; k < ATT_PER; k++)
        if (g + 4 * k < D) mt_store_elem(out, dst + g + 4 * k, o[k] * inv, elem);
      if (g == 0) lse[bh * T + i] = m + logf(l);
    }
    __syncthreads();  // q_s is read no more
  });
}

// Generation's new token: out (B,C) of elem = the last query row's (T-1) attention over keys [0, T),
// as mt_attention_forward_f32 computes that row (P rounded to elem). One warp per (b, h): lane t
// takes keys t + 32k, first for the row's max, then for its exponentials and their sum of v; the
// lanes' sums are then reduced. ffi/cpu/attention.c mt_attention_decode_f32 is the same on the host.
struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_attention_decode_f32(void* out, const void* qkv, int64_t B, int64_t T, int64_t C, int64_t H, float scale,
                        int32_t elem) {
  const int lane = threadIdx.x % WARP_SIZE;
  const int64_t D = C / H, C3 = 3 * C;
  for (int64_t bh = warp_row(); bh < B * H; bh += warp_row_step()) {
    const int64_t b = bh / H, h = bh % H, q0 = (b * T + T - 1) * C3 + h * D;
    float mx = -INFINITY;
    for (int64_t j = lane; j < T; j += WARP_SIZE) {
      const int64_t k0 = (b * T + j) * C3 + C + h * D;
      float dot = 0.0f;
      for (int64_t d = 0; d < D; d++) dot += mt_load_elem(qkv, q0 + d, elem) * mt_load_elem(qkv, k0 + d, elem);
      mx = fmaxf(mx, scale * dot);
    }
    mx = warp_reduce(mx, MaxOp());
    float o[ATT_D_MAX];
    for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
    float l = 0.0f;
    for (int64_t j = lane; j < T; j += WARP_SIZE) {
      const int64_t k0 = (b * T + j) * C3 + C + h * D, v0 = k0 + C;
      float dot = 0.0f;
      for (int64_t d = 0; d < D; d++) dot += mt_load_elem(qkv, q0 + d, elem) * mt_load_elem(qkv, k0 + d, elem);
      const float e = expf(scale * dot - mx);
      l += e;
      const float p = att_round(e, elem);
      for (int64_t d = 0; d < D; d++) o[d] += p * mt_load_elem(qkv, v0 + d, elem);
    }
    l = warp_reduce(l, SumOp());
    for (int64_t d = 0; d < D; d++) {
      const float od = warp_reduce(o[d], SumOp());
      if (lane == 0) mt_store_elem(out, b * C + h * D + d, od / l, elem);
    }
  }
}

// delta (B,H,T) = dout_i . out_i per head (backward's row term), dout and out of elem; one warp
// per (b, h, i)
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_attention_delta_f32(float* delta, const void* dout, const void* out, int64_t B, int64_t T, int64_t C,
                       int64_t H, int32_t elem) {
  const int lane = threadIdx.x % WARP_SIZE;
  const int64_t D = C / H;
  for (int64_t row = warp_row(); row < B * H * T; row += warp_row_step()) {
    const int64_t i = row % T, bh = row / T, b = bh / H, h = bh % H;
    const int64_t at = (b * T + i) * C + h * D;
    float acc = 0.0f;
    for (int64_t d = lane; d < D; d += WARP_SIZE) acc += mt_load_elem(dout, at + d, elem) * mt_load_elem(out, at + d, elem);
    acc = warp_reduce(acc, SumOp());
    if (lane == 0) delta[row] = acc;
  }
}

// forward was: out_i = sum_j p_ij v_j, p_ij = exp(scale q_i.k_j - lse_i), j <= i
// dv_j += sum_i p_ij dout_i; dk_j += scale sum_i ds_ij q_i, ds_ij = p_ij (dout_i.v_j - delta_i).
// A block per (b, h, key tile): thread (c, g) sums key row c's gradient over every query tile.
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
mt_attention_backward_kv_f32(void* dqkv, const float* delta, const void* dout, const float* lse,
                             const void* qkv, int64_t B, int64_t T, int64_t C, int64_t H, float scale,
                             int32_t elem, int32_t accumulate) {
  __shared__ float q_s[ATT_BR][ATT_D_MAX];
  __shared__ float g_s[ATT_BR][ATT_D_MAX];
  __shared__ float row_s[2][ATT_BR];  // lse, delta of the query tile
  const int64_t D = C / H, C3 = 3 * C, tiles = (T + ATT_BC - 1) / ATT_BC;
  const int c = threadIdx.x / 4, g = threadIdx.x % 4;
  for (int64_t task = blockIdx.x; task < B * H * tiles; task += gridDim.x) {
    // the first key tiles see the most query tiles: first
    const int64_t tile = task % tiles, bh = task / tiles, b = bh / H, h = bh % H;
    const int64_t j0 = tile * ATT_BC, bc = T - j0 < ATT_BC ? T - j0 : ATT_BC, j = j0 + c;
    float k[ATT_PER], v[ATT_PER], dk[ATT_PER], dv[ATT_PER];
#pragma unroll
    for (int kk = 0; kk < ATT_PER; kk++) {
      const int64_t d = g + 4 * kk;
      const bool in = c < bc && d < D;
      k[kk] = in ? mt_load_elem(qkv, (b * T + j) * C3 + C + h * D + d, elem) : 0.0f;
      v[kk] = in ? mt_load_elem(qkv, (b * T + j) * C3 + 2 * C + h * D + d, elem) : 0.0f;
      dk[kk] = 0.0f;
      dv[kk] = 0.0f;
    }
    for (int64_t i0 = j0 - j0 % ATT_BR; i0 < T; i0 += ATT_BR) {
      const int64_t br = T - i0 < ATT_BR ? T - i0 : ATT_BR;
      __syncthreads();  // the previous tile's reads of q_s, g_s, row_s are done
      att_tile<ATT_D_MAX>(q_s, qkv, b * T + i0, br, C3, h * D, D, elem);
      for (int64_t e = threadIdx.x; e < ATT_BR * D; e += blockDim.x) {
        const int64_t rr = e / D, d = e % D;
        g_s[rr][d] = rr < br ? mt_load_elem(dout, (b * T + i0 + rr) * C + h * D + d, elem) : 0.0f;
      }
      if (threadIdx.x < ATT_BR) {
        const int64_t rr = threadIdx.x;
        row_s[0][rr] = rr < br ? lse[bh * T + i0 + rr] : 0.0f;
        row_s[1][rr] = rr < br ? delta[bh * T + i0 + rr] : 0.0f;
      }
      __syncthreads();
      for (int rr = 0; rr < ATT_BR; rr++) {
        const AttDots x = att_dots(q_s[rr], k, g_s[rr], v, g, D);  // q_rr . k_c, dout_rr . v_c
        const bool valid = rr < br && c < bc && j <= i0 + rr;
        const float p = valid ? expf(x.s * scale - row_s[0][rr]) : 0.0f;
        const float pr = att_round(p, elem);
        const float ds = att_round(p * (x.dp - row_s[1][rr]), elem);
#pragma unroll
        for (int kk = 0; kk < ATT_PER; kk++) {
          const int64_t d = g + 4 * kk;
          if (d < D) {
            dv[kk] += pr * g_s[rr][d];
            dk[kk] += ds * q_s[rr][d];
          }
        }
      }
    }
    if (c < bc) {
      const int64_t dkr = (b * T + j) * C3 + C + h * D, dvr = dkr + C;
#pragma unroll
      for (int kk = 0; kk < ATT_PER; kk++) {
        const int64_t d = g + 4 * kk;
        if (d < D) {
          const float k0 = accumulate ? mt_load_elem(dqkv, dkr + d, elem) : 0.0f;
          const float v0 = accumulate ? mt_load_elem(dqkv, dvr + d, elem) : 0.0f;
          mt_store_elem(dqkv, dkr + d, k0 + scale * dk[kk], elem);
          mt_store_elem(dqkv, dvr + d, v0 + dv[kk], elem);
        }
      }
    }
  }
}

// dq_i += scale sum_j ds_ij k_j: a block per (b, h, query tile); thread (r, g) sums row r's.
extern "C" __global__ void __launch_bounds__(ATT_THREADS)
mt_attention_backward_q_f32(void* dqkv, const float* delta, const void* dout, const float* lse,
                            const void* qkv, int64_t B, int64_t T, int64_t C, int64_t H, float scale,
                            int32_t elem, int32_t accumulate) {
  __shared__ float k_s[ATT_BC][ATT_D_MAX + 1];
  __shared__ float v_s[ATT_BC][ATT_D_MAX + 1];
  const int64_t D = C / H, C3 = 3 * C;
  const int r = threadIdx.x / 4, g = threadIdx.x % 4;
  for_each_query_tile(B, T, H, [&](int64_t b, int64_t h, int64_t bh, int64_t i0, int64_t br, int64_t i) {
    float q[ATT_PER], go[ATT_PER], dq[ATT_PER];
#pragma unroll
    for (int kk = 0; kk < ATT_PER; kk++) {
      const int64_t d = g + 4 * kk;
      const bool in = r < br && d < D;
      q[kk] = in ? mt_load_elem(qkv, (b * T + i) * C3 + h * D + d, elem) : 0.0f;
      go[kk] = in ? mt_load_elem(dout, (b * T + i) * C + h * D + d, elem) : 0.0f;
      dq[kk] = 0.0f;
    }
    const float li = r < br ? lse[bh * T + i] : 0.0f;
    const float di = r < br ? delta[bh * T + i] : 0.0f;
    for (int64_t j0 = 0; j0 < i0 + br; j0 += ATT_BC) {
      const int64_t bc = i0 + br - j0 < ATT_BC ? i0 + br - j0 : ATT_BC;
      __syncthreads();  // the previous tile's reads are done
      att_tile<ATT_D_MAX + 1>(k_s, qkv, b * T + j0, bc, C3, C + h * D, D, elem);
      att_tile<ATT_D_MAX + 1>(v_s, qkv, b * T + j0, bc, C3, 2 * C + h * D, D, elem);
      __syncthreads();
      for (int cc = 0; cc < ATT_BC; cc++) {
        const AttDots x = att_dots(k_s[cc], q, v_s[cc], go, g, D);  // q_r . k_cc, dout_r . v_cc
        const bool valid = r < br && cc < bc && j0 + cc <= i;
        const float p = valid ? expf(x.s * scale - li) : 0.0f;
        const float ds = att_round(p * (x.dp - di), elem);
#pragma unroll
        for (int kk = 0; kk < ATT_PER; kk++) {
          const int64_t d = g + 4 * kk;
          if (d < D) dq[kk] += ds * k_s[cc][d];
        }
      }
    }
    if (r < br) {
      const int64_t dqr = (b * T + i) * C3 + h * D;
#pragma unroll
      for (int kk = 0; kk < ATT_PER; kk++) {
        const int64_t d = g + 4 * kk;
        if (d < D) mt_store_elem(dqkv, dqr + d, (accumulate ? mt_load_elem(dqkv, dqr + d, elem) : 0.0f) + scale * dq[kk], elem);
      }
    }
  });
}

// out[i·os] (= or +=) inp[i·is] for i over (d0,d1,d2,d3); strides in elements. Permute,
// transpose, and with accumulate their backward. The caller guarantees no two indices write the
// same out element, so threads never race. Flat grid-stride over the index space.
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
