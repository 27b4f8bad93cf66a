// Causal self-attention on tensor cores (FlashAttention-2's tiling) for 2-byte q, k, v (bf16 or
// f16, `elem` 1 or 2) and head sizes 64 and 128: the `--attention kernel` path where cuDNN is
// missing or refuses a shape. The f32-FMA kernels of attention.cu stay the reference.
//
// Layouts as attention.cu's: qkv (B,T,3C) with head h's q, k, v at h*D, C + h*D, 2C + h*D;
// out (B,T,C); lse (B,H,T) f32; delta (B,H,T) f32 (dout_i . out_i, attention.cu's pre-pass).
//
// The products are mma.sync m16n8k16 (f32 accumulation) through mma16816(), whose host emulation
// (test/ffi/fixtures/cuda-emu) computes the same fragments, so the tiling and indexing below run
// in every CI against the float64 reference. A block is 4 warps; each warp owns 16 rows of a
// 64-row tile (queries forward and for dq, keys for dk and dv) and walks the other side's
// 64-row tiles, which the block stages in shared memory with 16-byte copies. A staged tile's
// 16-byte chunks are swizzled (chunk c of row r sits at chunk c ^ (r % 8)), so the 8 rows that one
// ldmatrix phase reads fall in 8 different bank groups, with no padding; the B operands come out
// of shared memory by ldmatrix.x4 (.trans for V-like operands, whose rows are the product's k).
// Tiles wholly above the diagonal are skipped; the diagonal tile is masked. The
// score tile's accumulator fragments are reused as the next product's A operand (rounded to the
// 2-byte type), as FlashAttention-2 does: P V, dS K, P^T dO and dS^T Q never touch shared memory.
//
// Fragments (PTX ISA, mma.m16n8k16 with .row A and .col B; g = lane / 4, t = lane % 4):
//   A 16x16: a0 (row g, cols 2t, 2t+1), a1 (row g+8, same), a2 (row g, cols 2t+8, +9), a3 (row g+8)
//   B 16x8:  b0 (k 2t, 2t+1; n g), b1 (k 2t+8, 2t+9; n g)
//   C 16x8:  c0, c1 (row g, cols 2t, 2t+1), c2, c3 (row g+8, same cols)
// Each 32-bit register holds two 2-byte values, the lower index in the low half.
#include "common.cuh"
#include "../../numerics.h"

#define FL_ROWS 64     // rows of a tile (4 warps x 16)
#define FL_THREADS 128
// fixed-count loops over fragments unrolled, so their arrays stay in registers
#ifdef __CUDACC__
#define FL_UNROLL _Pragma("unroll")
#else
#define FL_UNROLL
#endif

#ifndef __CUDACC__
void emu_mma_16816(float* d, const uint32_t* a, const uint32_t* b, int32_t elem);
void emu_ldmatrix_x4(uint32_t* r, const uint16_t* row, int32_t trans);
#endif

// d (16x8, f32) += a (16x16) b (16x8), both of `elem`
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2], int32_t elem) {
#ifdef __CUDACC__
  if (elem == 1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#else
  emu_mma_16816(d, a, b, elem);
#endif
}

// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16: lanes 8m..8m+7 give the addresses of matrix
// m's 8 rows (16 bytes each); r[m] is lane l's part of matrix m: row l/4, columns 2(l%4) and +1,
// or with `trans` column l/4 of rows 2(l%4) and +1 (the lower index in the low half).
template <bool trans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const uint16_t* row) {
#ifdef __CUDACC__
  const uint32_t addr = (uint32_t)__cvta_generic_to_shared(row);
  if (trans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }
#else
  emu_ldmatrix_x4(r, row, trans ? 1 : 0);
#endif
}

// A staged tile: FL_ROWS rows of D 2-byte elements, 16-byte chunks swizzled by row: chunk c of
// row r sits at chunk swizzle(c, r % 8). Aligned to 16 bytes: cp.async and ldmatrix move 16-byte chunks.
__device__ __forceinline__ int swizzle(int chunk, int x) { return (chunk & ~7) | ((chunk & 7) ^ x); }
template <int D>
struct alignas(16) Tile {
  uint16_t e[FL_ROWS * D];
  // the first element of chunk `chunk` (8 elements) of row r
  __device__ __forceinline__ uint16_t* at(int r, int chunk) { return e + r * D + swizzle(chunk, r & 7) * 8; }
};

__device__ __forceinline__ uint16_t to16(float v, int32_t elem) {
  return elem == 1 ? mt_f32_to_bf16_bits(v) : mt_f32_to_f16_bits(v);
}
__device__ __forceinline__ float from16(uint16_t v, int32_t elem) {
  return elem == 1 ? mt_bits_f32((uint32_t)v << 16) : mt_f16_bits_to_f32(v);
}
__device__ __forceinline__ uint32_t pack2(float lo, float hi, int32_t elem) {
  return (uint32_t)to16(lo, elem) | ((uint32_t)to16(hi, elem) << 16);
}
// two adjacent 2-byte elements as one 32-bit word (4-byte aligned: even element offsets); the
// host emulator copies bytes instead, as C++'s aliasing rules want of a compiler that optimizes
// on them
#ifdef __CUDACC__
__device__ __forceinline__ uint32_t load32(const uint16_t* p) { return *(const uint32_t*)p; }
__device__ __forceinline__ void store32(uint16_t* p, uint32_t v) { *(uint32_t*)p = v; }
#else
inline uint32_t load32(const uint16_t* p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}
inline void store32(uint16_t* p, uint32_t v) { memcpy(p, &v, 4); }
#endif
// 8 adjacent 2-byte elements (16-byte aligned) from global memory into shared memory, or zeros
__device__ __forceinline__ void copy16(uint16_t* dst, const uint16_t* src, bool zero) {
#ifdef __CUDACC__
  *(uint4*)dst = zero ? make_uint4(0, 0, 0, 0) : *(const uint4*)src;
#else
  if (zero) memset(dst, 0, 16);
  else memcpy(dst, src, 16);
#endif
}

// The A fragments of 16 rows (row0 + g, row0 + g + 8) of a (rows, stride) 2-byte matrix at
// `base`, over D columns; rows at or past `rows` are zero.
template <int D>
__device__ __forceinline__ void load_a_rows(uint32_t (&f)[D / 16][4], const uint16_t* base, int64_t stride,
                                            int64_t row0, int64_t rows, int lane) {
  const int g = lane / 4, t = lane % 4;
  FL_UNROLL
  for (int kc = 0; kc < D / 16; kc++) {
    FL_UNROLL
    for (int rr = 0; rr < 2; rr++) {
      const int64_t row = row0 + g + 8 * rr;
      const uint16_t* p = base + row * stride + kc * 16 + 2 * t;
      f[kc][rr] = row < rows ? load32(p) : 0u;
      f[kc][2 + rr] = row < rows ? load32(p + 8) : 0u;
    }
  }
}

// A tile of 64 rows of a (rows, stride) matrix at `base` (D columns, 16-byte aligned rows) into
// shared memory; rows at or past `rows` are zero. Every thread of the block takes part.
template <int D>
__device__ __forceinline__ void stage_rows(Tile<D>& s, const uint16_t* base, int64_t stride, int64_t row0,
                                           int64_t rows) {
  for (int idx = threadIdx.x; idx < FL_ROWS * D / 8; idx += FL_THREADS) {
    const int r = idx / (D / 8), c = idx % (D / 8);
    const int64_t row = row0 + r;
    copy16(s.at(r, c), base + row * stride + c * 8, row >= rows);
  }
}

// Keys [k0, k0 + 64) of the head whose q columns start at q in qkv (k at +C, v at +2C) into the
// k and v tiles that the query-side kernels (forward, dq) walk, between two barriers: no warp
// still reads the previous tile, and every warp sees the whole new one.
template <int D>
__device__ __forceinline__ void stage_kv(Tile<D>& k_s, Tile<D>& v_s, const uint16_t* q, int64_t C, int64_t k0,
                                         int64_t T) {
  const int64_t C3 = 3 * C;
  __syncthreads();
  stage_rows<D>(k_s, q + C, C3, k0, T);
  stage_rows<D>(v_s, q + 2 * C, C3, k0, T);
  __syncthreads();
}

// Calls task(tile, bh, b, h, q, row0) for each (b, h, 64-row tile) task this block takes, grid-stride
// over the B*H*tiles tasks: bh = b*H + h, q is where head h's q columns start in qkv (B,T,3C), and
// row0 is the first of the calling warp's 16 rows of the tile.
template <int D, class Task>
__device__ __forceinline__ void for_each_task(const uint16_t* qkv, int64_t B, int64_t T, int64_t C, int64_t H,
                                              Task&& task) {
  const int warp = threadIdx.x / WARP_SIZE;
  const int64_t tiles = (T + FL_ROWS - 1) / FL_ROWS, C3 = 3 * C;
  for (int64_t work = blockIdx.x; work < B * H * tiles; work += gridDim.x) {
    const int64_t tile = work % tiles, bh = work / tiles, b = bh / H, h = bh % H;
    task(tile, bh, b, h, qkv + b * T * C3 + h * D, tile * FL_ROWS + warp * 16);
  }
}

// s (16 x 64: 8 tiles of 8 columns) = the warp's A rows (D wide) times the staged rows' transpose:
// s[j] column n is staged row j*8 + n. The B fragments of two k-steps come from one ldmatrix.x4:
// lane l addresses row j*8 + l%8, chunk 2kc + l/8.
template <int D>
__device__ __forceinline__ void scores(float (&s)[8][4], const uint32_t (&a)[D / 16][4], const Tile<D>& rows, int lane,
                                       int32_t elem) {
  const uint16_t* base = rows.e + (lane % 8) * D;
  const int x = (lane / 8) ^ (lane % 8);
  FL_UNROLL
  for (int j = 0; j < 8; j++) {
    s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
    FL_UNROLL
    for (int kc = 0; kc < D / 16; kc += 2) {
      uint32_t b[4];  // chunk 2kc + l/8 = 2kc ^ l/8 (kc even) of a row r with r % 8 = l % 8
      ldmatrix_x4<false>(b, base + j * 8 * D + swizzle(2 * kc, x) * 8);
      const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
      mma16816(s[j], a[kc], b0, elem);
      mma16816(s[j], a[kc + 1], b1, elem);
    }
  }
}

// acc (16 x D) += p (16 x 64, accumulator fragments, rounded to elem) times the 64 staged rows
// (64 x D): p's columns index the staged rows. The B fragments of two 8-column slices come from
// one ldmatrix.x4.trans: lane l addresses row kk*16 + l%8 + 8((l/8)%2), chunk dn + l/16.
template <int D>
__device__ __forceinline__ void accumulate_pv(float (&acc)[D / 8][4], const float (&p)[8][4], const Tile<D>& rows,
                                              int lane, int32_t elem) {
  const uint16_t* base = rows.e + (lane % 8 + 8 * ((lane / 8) % 2)) * D;
  const int x = (lane / 16) ^ (lane % 8);
  FL_UNROLL
  for (int kk = 0; kk < 4; kk++) {
    const uint32_t a[4] = {pack2(p[2 * kk][0], p[2 * kk][1], elem), pack2(p[2 * kk][2], p[2 * kk][3], elem),
                           pack2(p[2 * kk + 1][0], p[2 * kk + 1][1], elem),
                           pack2(p[2 * kk + 1][2], p[2 * kk + 1][3], elem)};
    FL_UNROLL
    for (int dn = 0; dn < D / 8; dn += 2) {
      uint32_t b[4];  // chunk dn + l/16 = dn ^ l/16 (dn even) of a row r with r % 8 = l % 8
      ldmatrix_x4<true>(b, base + kk * 16 * D + swizzle(dn, x) * 8);
      const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
      mma16816(acc[dn], a, b0, elem);
      mma16816(acc[dn + 1], a, b1, elem);
    }
  }
}

// The sum over the 4 lanes of a quad (the lanes holding one row's columns)
__device__ __forceinline__ float quad_sum(float v) {
  v += shfl_xor(v, 1);
  return v + shfl_xor(v, 2);
}
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, shfl_xor(v, 1));
  return fmaxf(v, shfl_xor(v, 2));
}

// Writes the warp's 16 x D accumulator (times `mul`) as rows row0 + g (+8) of a 2-byte matrix
// (stride), adding to what is there when `accumulate`; rows at or past `rows` are left alone.
template <int D>
__device__ __forceinline__ void store_rows(uint16_t* base, int64_t stride, int64_t row0, int64_t rows,
                                           const float (&acc)[D / 8][4], const float (&mul)[2], int accumulate,
                                           int lane, int32_t elem) {
  const int g = lane / 4, t = lane % 4;
  FL_UNROLL
  for (int rr = 0; rr < 2; rr++) {
    const int64_t row = row0 + g + 8 * rr;
    if (row >= rows) continue;
    FL_UNROLL
    for (int dn = 0; dn < D / 8; dn++) {
      uint16_t* p = base + row * stride + dn * 8 + 2 * t;
      float lo = acc[dn][2 * rr] * mul[rr], hi = acc[dn][2 * rr + 1] * mul[rr];
      if (accumulate) {
        lo += from16(p[0], elem);
        hi += from16(p[1], elem);
      }
      store32(p, pack2(lo, hi, elem));
    }
  }
}

// forward: out_i = sum_{j<=i} softmax_j(scale q_i.k_j) v_j, lse_i = log sum_j exp(scale q_i.k_j).
// A block per (b, h, 64-query tile), grid-stride.
template <int D>
__device__ void flash_forward(uint16_t* out, float* lse, const uint16_t* qkv, int64_t B, int64_t T, int64_t C,
                              int64_t H, float scale, int32_t elem) {
  __shared__ Tile<D> k_s;
  __shared__ Tile<D> v_s;
  const int lane = threadIdx.x % WARP_SIZE, g = lane / 4, t = lane % 4;
  const auto task = [&](int64_t tile, int64_t bh, int64_t b, int64_t h, const uint16_t* q, int64_t q0) {
    const int64_t C3 = 3 * C;
    uint32_t qf[D / 16][4];
    load_a_rows<D>(qf, q, C3, q0, T, lane);
    float o[D / 8][4] = {};
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    const int64_t last = (tile + 1) * FL_ROWS - 1;  // the tile's last query
    for (int64_t k0 = 0; k0 <= last && k0 < T; k0 += FL_ROWS) {
      stage_kv<D>(k_s, v_s, q, C, k0, T);
      float s[8][4];
      scores<D>(s, qf, k_s, lane, elem);
      FL_UNROLL
      for (int rr = 0; rr < 2; rr++) {
        const int64_t row = q0 + g + 8 * rr;
        float mx = -INFINITY;
        FL_UNROLL
        for (int j = 0; j < 8; j++) {
          FL_UNROLL
          for (int e = 0; e < 2; e++) {
            const int64_t key = k0 + j * 8 + 2 * t + e;
            const float x = key > row || key >= T ? -INFINITY : s[j][2 * rr + e] * scale;
            s[j][2 * rr + e] = x;
            mx = fmaxf(mx, x);
          }
        }
        const float mnew = fmaxf(m[rr], quad_max(mx));
        const float base = mnew == -INFINITY ? 0.0f : mnew;  // a row with no key yet
        const float corr = m[rr] == -INFINITY ? 0.0f : expf(m[rr] - base);
        l[rr] *= corr;
        FL_UNROLL
        for (int dn = 0; dn < D / 8; dn++) {
          o[dn][2 * rr] *= corr;
          o[dn][2 * rr + 1] *= corr;
        }
        FL_UNROLL
        for (int j = 0; j < 8; j++) {
          FL_UNROLL
          for (int e = 0; e < 2; e++) {
            const float p = expf(s[j][2 * rr + e] - base);
            s[j][2 * rr + e] = p;
            l[rr] += p;
          }
        }
        m[rr] = mnew;
      }
      accumulate_pv<D>(o, s, v_s, lane, elem);
    }
    float inv[2];
    FL_UNROLL
    for (int rr = 0; rr < 2; rr++) {
      const float sum = quad_sum(l[rr]);
      inv[rr] = 1.0f / sum;
      const int64_t row = q0 + g + 8 * rr;
      if (t == 0 && row < T) lse[bh * T + row] = m[rr] + logf(sum);
    }
    store_rows<D>(out + b * T * C + h * D, C, q0, T, o, inv, 0, lane, elem);
  };
  for_each_task<D>(qkv, B, T, C, H, task);
}

// The parameters of both backward kernels (kernels.ts attentionBackwardParams): dqkv (B,T,3C),
// delta (B,H,T), dout (B,T,C), lse (B,H,T), qkv (B,T,3C); the sizes; the scale; elem, accumulate.
#define FL_BACKWARD_PARAMS                                                                        \
  uint16_t* dqkv, const float* delta, const uint16_t* dout, const float* lse, const uint16_t* qkv, \
  int64_t B, int64_t T, int64_t C, int64_t H, float scale, int32_t elem, int32_t accumulate
#define FL_BACKWARD_ARGS dqkv, delta, dout, lse, qkv, B, T, C, H, scale, elem, accumulate

// backward, queries' side: dq_i = scale sum_{j<=i} ds_ij k_j, ds_ij = p_ij (dout_i.v_j - delta_i),
// p_ij = exp(scale q_i.k_j - lse_i). A block per (b, h, 64-query tile).
template <int D>
__device__ void flash_backward_q(FL_BACKWARD_PARAMS) {
  __shared__ Tile<D> k_s;
  __shared__ Tile<D> v_s;
  const int lane = threadIdx.x % WARP_SIZE, g = lane / 4, t = lane % 4;
  const auto task = [&](int64_t tile, int64_t bh, int64_t b, int64_t h, const uint16_t* q, int64_t q0) {
    const int64_t C3 = 3 * C;
    uint32_t qf[D / 16][4], gf[D / 16][4];
    load_a_rows<D>(qf, q, C3, q0, T, lane);
    load_a_rows<D>(gf, dout + b * T * C + h * D, C, q0, T, lane);
    float rl[2], rd[2];
    FL_UNROLL
    for (int rr = 0; rr < 2; rr++) {
      const int64_t row = q0 + g + 8 * rr;
      rl[rr] = row < T ? lse[bh * T + row] : 0.0f;
      rd[rr] = row < T ? delta[bh * T + row] : 0.0f;
    }
    float dq[D / 8][4] = {};
    const int64_t last = (tile + 1) * FL_ROWS - 1;
    for (int64_t k0 = 0; k0 <= last && k0 < T; k0 += FL_ROWS) {
      stage_kv<D>(k_s, v_s, q, C, k0, T);
      float s[8][4], dp[8][4];
      scores<D>(s, qf, k_s, lane, elem);
      scores<D>(dp, gf, v_s, lane, elem);
      FL_UNROLL
      for (int j = 0; j < 8; j++) {
        FL_UNROLL
        for (int e = 0; e < 4; e++) {
          const int rr = e / 2;
          const int64_t row = q0 + g + 8 * rr, key = k0 + j * 8 + 2 * t + (e & 1);
          const float p = key > row || key >= T || row >= T ? 0.0f : expf(s[j][e] * scale - rl[rr]);
          s[j][e] = p * (dp[j][e] - rd[rr]);  // ds
        }
      }
      accumulate_pv<D>(dq, s, k_s, lane, elem);
    }
    const float mul[2] = {scale, scale};
    store_rows<D>(dqkv + b * T * C3 + h * D, C3, q0, T, dq, mul, accumulate, lane, elem);
  };
  for_each_task<D>(qkv, B, T, C, H, task);
}

// backward, keys' side: dv_j = sum_{i>=j} p_ij dout_i, dk_j = scale sum_{i>=j} ds_ij q_i. A block
// per (b, h, 64-key tile); each warp's 16 keys hold p and ds transposed (rows keys, columns queries).
template <int D>
__device__ void flash_backward_kv(FL_BACKWARD_PARAMS) {
  __shared__ Tile<D> q_s;
  __shared__ Tile<D> g_s;
  __shared__ float row_s[2][FL_ROWS];  // lse, delta of the query tile
  const int lane = threadIdx.x % WARP_SIZE, g = lane / 4, t = lane % 4;
  const auto task = [&](int64_t tile, int64_t bh, int64_t b, int64_t h, const uint16_t* q, int64_t k0) {
    const int64_t C3 = 3 * C;
    const uint16_t* go = dout + b * T * C + h * D;
    uint32_t kf[D / 16][4], vf[D / 16][4];
    load_a_rows<D>(kf, q + C, C3, k0, T, lane);
    load_a_rows<D>(vf, q + 2 * C, C3, k0, T, lane);
    float dk[D / 8][4] = {}, dv[D / 8][4] = {};
    // the query tiles at or below the diagonal: from this key tile's own on
    for (int64_t i0 = tile * FL_ROWS; i0 < T; i0 += FL_ROWS) {
      __syncthreads();
      stage_rows<D>(q_s, q, C3, i0, T);
      stage_rows<D>(g_s, go, C, i0, T);
      for (int r = threadIdx.x; r < FL_ROWS; r += FL_THREADS) {
        const int64_t row = i0 + r;
        row_s[0][r] = row < T ? lse[bh * T + row] : 0.0f;
        row_s[1][r] = row < T ? delta[bh * T + row] : 0.0f;
      }
      __syncthreads();
      float s[8][4], dp[8][4];
      scores<D>(s, kf, q_s, lane, elem);   // s^T: rows keys, columns queries
      scores<D>(dp, vf, g_s, lane, elem);  // dp^T
      FL_UNROLL
      for (int j = 0; j < 8; j++) {
        FL_UNROLL
        for (int e = 0; e < 4; e++) {
          const int64_t key = k0 + g + 8 * (e / 2);
          const int c = j * 8 + 2 * t + (e & 1);
          const int64_t row = i0 + c;
          const float p = row < key || row >= T || key >= T ? 0.0f : expf(s[j][e] * scale - row_s[0][c]);
          s[j][e] = p;
          dp[j][e] = p * (dp[j][e] - row_s[1][c]);  // ds^T
        }
      }
      accumulate_pv<D>(dv, s, g_s, lane, elem);
      accumulate_pv<D>(dk, dp, q_s, lane, elem);
    }
    const float one[2] = {1.0f, 1.0f}, mul[2] = {scale, scale};
    store_rows<D>(dqkv + b * T * C3 + C + h * D, C3, k0, T, dk, mul, accumulate, lane, elem);
    store_rows<D>(dqkv + b * T * C3 + 2 * C + h * D, C3, k0, T, dv, one, accumulate, lane, elem);
  };
  for_each_task<D>(qkv, B, T, C, H, task);
}

#define FLASH_KERNELS(D)                                                                                        \
  extern "C" __global__ void __launch_bounds__(FL_THREADS)                                                      \
      mt_flash_forward_d##D(void* out, float* lse, const void* qkv, int64_t B, int64_t T, int64_t C, int64_t H, \
                            float scale, int32_t elem) {                                                        \
    flash_forward<D>((uint16_t*)out, lse, (const uint16_t*)qkv, B, T, C, H, scale, elem);                       \
  }                                                                                                             \
  extern "C" __global__ void __launch_bounds__(FL_THREADS) mt_flash_backward_q_d##D(FL_BACKWARD_PARAMS) {       \
    flash_backward_q<D>(FL_BACKWARD_ARGS);                                                                      \
  }                                                                                                             \
  extern "C" __global__ void __launch_bounds__(FL_THREADS) mt_flash_backward_kv_d##D(FL_BACKWARD_PARAMS) {      \
    flash_backward_kv<D>(FL_BACKWARD_ARGS);                                                                     \
  }

FLASH_KERNELS(64)
FLASH_KERNELS(128)
