// The CPU kernels of causal self-attention (the conventions: kernels.h).
#include "kernels.h"

// ---------------------------------------------------------------------------------------------
// causal self-attention, fused (flash-attention style): tiles of K/V with an online softmax, so
// no (T,T) matrix exists; forward saves each row's log-sum-exp and backward recomputes the
// scores tile by tile from it.
//
// qkv (B,T,3C) of `elem` (0 f32, 1 bf16, 2 f16): channels [q | k | v], head h at [h*D, (h+1)*D)
// of each, D = C/H. out (B,T,C) of elem; lse (B,H,T) f32 = log sum_{j<=i} exp(scale q_i.k_j).
// Under autocast (elem 1 or 2) the products read 2-byte values, as tensor cores do: q, k, v as
// given, and the probabilities P, dout and dS rounded to elem before their GEMM; sums stay f32.
// Backward's dqkv, dout and out are of elem too.
//
// Threads take (b, h, query tile) tasks in forward and (b, h) in backward; a task owns its
// outputs, so there are no races, and every task's arithmetic is the same on any thread (a
// dynamic schedule balances the causal triangle without changing a bit).
// ---------------------------------------------------------------------------------------------

#define ATT_BR 64  // query rows per tile
#define ATT_BC 64  // key rows per tile

static inline float att_round(float x, int32_t elem) {
  if (elem == 1) return mt_bits_f32((uint32_t)mt_f32_to_bf16_bits(x) << 16);
  if (elem == 2) return mt_f16_bits_to_f32(mt_f32_to_f16_bits(x));
  return x;
}
// dst (rows,D) f32 = rows [row0, row0+rows) of one head's part of qkv (stride 3C per row)
static void att_tile(float* dst, const void* qkv, int64_t row0, int64_t rows, int64_t C3,
                     int64_t col, int64_t D, int32_t elem) {
  for (int64_t r = 0; r < rows; r++) {
    const int64_t at = (row0 + r) * C3 + col;
    if (elem == 0) {
      memcpy(dst + r * D, (const float*)qkv + at, (size_t)D * sizeof(float));
    } else {
      for (int64_t d = 0; d < D; d++) dst[r * D + d] = mt_load_elem(qkv, at + d, elem);
    }
  }
}

void mt_attention_forward_f32(void* out, float* lse, const void* qkv, int64_t B, int64_t T, int64_t C,
                              int64_t H, float scale, int32_t elem) {
  const int64_t D = C / H, C3 = 3 * C, tiles = (T + ATT_BR - 1) / ATT_BR;
#pragma omp parallel if (B * H * T * T * D >= PAR_MIN * 64)
  {
    float* q = malloc(sizeof(float) * (size_t)(ATT_BR * D));
    float* k = malloc(sizeof(float) * (size_t)(ATT_BC * D));
    float* v = malloc(sizeof(float) * (size_t)(ATT_BC * D));
    float* o = malloc(sizeof(float) * (size_t)(ATT_BR * D));
    float* s = malloc(sizeof(float) * (size_t)(ATT_BR * ATT_BC));
    float m[ATT_BR], l[ATT_BR];
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < B * H * tiles; task++) {
      // the longest (last) query tiles first: they finish together with the short ones
      const int64_t tile = tiles - 1 - task % tiles, bh = task / tiles, b = bh / H, h = bh % H;
      const int64_t i0 = tile * ATT_BR, br = T - i0 < ATT_BR ? T - i0 : ATT_BR;
      const void* base = (const char*)qkv + (size_t)(b * T * C3) * (elem == 0 ? 4 : 2);
      att_tile(q, base, i0, br, C3, h * D, D, elem);
      for (int64_t r = 0; r < br; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
      }
      memset(o, 0, sizeof(float) * (size_t)(br * D));
      for (int64_t j0 = 0; j0 < i0 + br; j0 += ATT_BC) {
        const int64_t bc = i0 + br - j0 < ATT_BC ? i0 + br - j0 : ATT_BC;
        att_tile(k, base, j0, bc, C3, C + h * D, D, elem);
        att_tile(v, base, j0, bc, C3, 2 * C + h * D, D, elem);
        // s (br,bc) = scale q k^T
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)br, (int)bc, (int)D, scale, q, (int)D, k,
                    (int)D, 0.0f, s, ATT_BC);
        for (int64_t r = 0; r < br; r++) {
          float* row = s + r * ATT_BC;
          const int64_t valid = i0 + r - j0 + 1 < bc ? i0 + r - j0 + 1 : bc;  // keys j <= i
          if (valid <= 0) {
            memset(row, 0, sizeof(float) * (size_t)bc);
            continue;
          }
          float mx = -INFINITY;
          for (int64_t c = 0; c < valid; c++) mx = row[c] > mx ? row[c] : mx;
          const float mnew = mx > m[r] ? mx : m[r];
          const float alpha = m[r] == -INFINITY ? 0.0f : fast_expf(m[r] - mnew);
          float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
          for (int64_t c = 0; c < valid; c++) {
            const float e = fast_expf(row[c] - mnew);
            sum += e;
            row[c] = e;
          }
          for (int64_t c = 0; c < valid; c++) row[c] = att_round(row[c], elem);
          for (int64_t c = valid; c < bc; c++) row[c] = 0.0f;
          l[r] = l[r] * alpha + sum;
          m[r] = mnew;
          if (alpha != 1.0f)
            for (int64_t d = 0; d < D; d++) o[r * D + d] *= alpha;
        }
        // o (br,D) += p v
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)br, (int)D, (int)bc, 1.0f, s, ATT_BC, v,
                    (int)D, 1.0f, o, (int)D);
      }
      for (int64_t r = 0; r < br; r++) {
        const float inv = 1.0f / l[r];
        const int64_t dst = (b * T + i0 + r) * C + h * D;
        for (int64_t d = 0; d < D; d++) mt_store_elem(out, dst + d, o[r * D + d] * inv, elem);
        lse[bh * T + i0 + r] = m[r] + logf(l[r]);
      }
    }
    free(q);
    free(k);
    free(v);
    free(o);
    free(s);
  }
}

// One query row per (b, h): the last, T-1, over keys [0, T) (generation's new token; the keys and
// values are those of the tokens before it, cached). s (T) = scale q.k_j; out = sum_j p_j v_j / l
// with p_j = exp(s_j - max) rounded to elem as forward's tiles round them, l = sum of the unrounded.
void mt_attention_decode_f32(void* out, const void* qkv, int64_t B, int64_t T, int64_t C, int64_t H, float scale,
                             int32_t elem) {
  const int64_t D = C / H, C3 = 3 * C;
#pragma omp parallel if (B * H * T * D >= PAR_MIN)
  {
    float* q = malloc(sizeof(float) * (size_t)D);
    float* kv = malloc(sizeof(float) * (size_t)D);
    float* o = malloc(sizeof(float) * (size_t)D);
    float* s = malloc(sizeof(float) * (size_t)T);
#pragma omp for schedule(static)
    for (int64_t bh = 0; bh < B * H; bh++) {
      const int64_t b = bh / H, h = bh % H;
      const void* base = (const char*)qkv + (size_t)(b * T * C3) * (elem == 0 ? 4 : 2);
      att_tile(q, base, T - 1, 1, C3, h * D, D, elem);
      float mx = -INFINITY;
      for (int64_t j = 0; j < T; j++) {
        att_tile(kv, base, j, 1, C3, C + h * D, D, elem);
        float dot = 0.0f;
        for (int64_t d = 0; d < D; d++) dot += q[d] * kv[d];
        s[j] = scale * dot;
        mx = s[j] > mx ? s[j] : mx;
      }
      float l = 0.0f;
      memset(o, 0, sizeof(float) * (size_t)D);
      for (int64_t j = 0; j < T; j++) {
        const float e = fast_expf(s[j] - mx);
        l += e;
        const float pj = att_round(e, elem);
        att_tile(kv, base, j, 1, C3, 2 * C + h * D, D, elem);
        for (int64_t d = 0; d < D; d++) o[d] += pj * kv[d];
      }
      const float inv = 1.0f / l;
      for (int64_t d = 0; d < D; d++) mt_store_elem(out, b * C + h * D + d, o[d] * inv, elem);
    }
    free(q);
    free(kv);
    free(o);
    free(s);
  }
}

// forward was: out_i = sum_j p_ij v_j, p_ij = exp(scale q_i.k_j - lse_i) for j <= i
// dv_j += sum_i p_ij dout_i;  dp_ij = dout_i.v_j;  ds_ij = p_ij (dp_ij - dout_i.out_i)
// dq_i += scale sum_j ds_ij k_j;  dk_j += scale sum_i ds_ij q_i
// dqkv (B,T,3C) of elem: += the gradient with accumulate, = without; delta (B,H,T) scratch
// (dout_i.out_i); dout, out (B,T,C) of elem; lse (B,H,T) f32; qkv as in forward. Each task sums
// its head's dq in f32 over every key tile, and dk, dv over every query tile, before storing.
void mt_attention_backward_f32(void* dqkv, float* delta, const void* dout, const void* out, const float* lse,
                               const void* qkv, int64_t B, int64_t T, int64_t C, int64_t H, float scale,
                               int32_t elem, int32_t accumulate) {
  const int64_t D = C / H, C3 = 3 * C;
#pragma omp parallel if (B * H * T * T * D >= PAR_MIN * 64)
  {
    float* q = malloc(sizeof(float) * (size_t)(ATT_BR * D));
    float* g = malloc(sizeof(float) * (size_t)(ATT_BR * D));
    float* k = malloc(sizeof(float) * (size_t)(ATT_BC * D));
    float* v = malloc(sizeof(float) * (size_t)(ATT_BC * D));
    float* dk = malloc(sizeof(float) * (size_t)(ATT_BC * D));
    float* dv = malloc(sizeof(float) * (size_t)(ATT_BC * D));
    float* p = malloc(sizeof(float) * (size_t)(ATT_BR * ATT_BC));
    float* pr = malloc(sizeof(float) * (size_t)(ATT_BR * ATT_BC));
    float* dp = malloc(sizeof(float) * (size_t)(ATT_BR * ATT_BC));
    float* dq = malloc(sizeof(float) * (size_t)(T * D));
#pragma omp for schedule(dynamic, 1)
    for (int64_t bh = 0; bh < B * H; bh++) {
      const int64_t b = bh / H, h = bh % H;
      const void* base = (const char*)qkv + (size_t)(b * T * C3) * (elem == 0 ? 4 : 2);
      const float* lrow = lse + bh * T;
      float* rowdot = delta + bh * T;
      for (int64_t i = 0; i < T; i++) {
        const int64_t at = (b * T + i) * C + h * D;
        float acc = 0.0f;
        for (int64_t d = 0; d < D; d++) acc += mt_load_elem(dout, at + d, elem) * mt_load_elem(out, at + d, elem);
        rowdot[i] = acc;
      }
      memset(dq, 0, sizeof(float) * (size_t)(T * D));
      // element offset of this batch's rows in dqkv; a head's q, k, v columns at h*D, C + h*D, 2C + h*D
      const int64_t dbase = b * T * C3;
      for (int64_t j0 = 0; j0 < T; j0 += ATT_BC) {
        const int64_t bc = T - j0 < ATT_BC ? T - j0 : ATT_BC;
        att_tile(k, base, j0, bc, C3, C + h * D, D, elem);
        att_tile(v, base, j0, bc, C3, 2 * C + h * D, D, elem);
        memset(dk, 0, sizeof(float) * (size_t)(bc * D));
        memset(dv, 0, sizeof(float) * (size_t)(bc * D));
        for (int64_t i0 = (j0 / ATT_BR) * ATT_BR; i0 < T; i0 += ATT_BR) {
          const int64_t br = T - i0 < ATT_BR ? T - i0 : ATT_BR;
          att_tile(q, base, i0, br, C3, h * D, D, elem);
          for (int64_t r = 0; r < br; r++) {
            const int64_t at = (b * T + i0 + r) * C + h * D;
            for (int64_t d = 0; d < D; d++) g[r * D + d] = mt_load_elem(dout, at + d, elem);
          }
          // p (br,bc) = exp(scale q k^T - lse), 0 above the diagonal
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)br, (int)bc, (int)D, scale, q, (int)D, k,
                      (int)D, 0.0f, p, ATT_BC);
          for (int64_t r = 0; r < br; r++) {
            float* row = p + r * ATT_BC;
            const int64_t valid = i0 + r - j0 + 1 < bc ? i0 + r - j0 + 1 : bc;
            const float lr = lrow[i0 + r];
            for (int64_t c = 0; c < bc; c++) {
              row[c] = c < valid ? fast_expf(row[c] - lr) : 0.0f;
              pr[r * ATT_BC + c] = att_round(row[c], elem);
            }
          }
          // dv (bc,D) += p^T dout
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)bc, (int)D, (int)br, 1.0f, pr, ATT_BC, g,
                      (int)D, 1.0f, dv, (int)D);
          // dp (br,bc) = dout v^T
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)br, (int)bc, (int)D, 1.0f, g, (int)D, v,
                      (int)D, 0.0f, dp, ATT_BC);
          for (int64_t r = 0; r < br; r++) {
            const float di = rowdot[i0 + r];
            for (int64_t c = 0; c < bc; c++) {
              const int64_t at = r * ATT_BC + c;
              dp[at] = att_round(p[at] * (dp[at] - di), elem);
            }
          }
          // dq (br,D) += scale ds k
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)br, (int)D, (int)bc, scale, dp, ATT_BC, k,
                      (int)D, 1.0f, dq + i0 * D, (int)D);
          // dk (bc,D) += scale ds^T q
          cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)bc, (int)D, (int)br, scale, dp, ATT_BC, q,
                      (int)D, 1.0f, dk, (int)D);
        }
        for (int64_t c = 0; c < bc; c++) {
          const int64_t dkr = dbase + (j0 + c) * C3 + C + h * D, dvr = dkr + C;
          for (int64_t d = 0; d < D; d++) {
            const float k0 = accumulate ? mt_load_elem(dqkv, dkr + d, elem) : 0.0f;
            const float v0 = accumulate ? mt_load_elem(dqkv, dvr + d, elem) : 0.0f;
            mt_store_elem(dqkv, dkr + d, k0 + dk[c * D + d], elem);
            mt_store_elem(dqkv, dvr + d, v0 + dv[c * D + d], elem);
          }
        }
      }
      for (int64_t i = 0; i < T; i++) {
        const int64_t dqr = dbase + i * C3 + h * D;
        for (int64_t d = 0; d < D; d++) {
          const float q0 = accumulate ? mt_load_elem(dqkv, dqr + d, elem) : 0.0f;
          mt_store_elem(dqkv, dqr + d, q0 + dq[i * D + d], elem);
        }
      }
    }
    free(q);
    free(g);
    free(k);
    free(v);
    free(dk);
    free(dv);
    free(p);
    free(pr);
    free(dp);
    free(dq);
  }
}

// Strided copy over 4 dims: out[i·os] (=|+=) inp[i·is] for i in (d0,d1,d2,d3). Strides are in
// elements. This is permute/transpose (contiguous out, permuted input strides), the q/k/v
// split and merge of attention, and, with accumulate, their backward. The caller guarantees
// that no two indices write the same out element (so rows can go to different threads).
void mt_strided_copy_f32(float* out, const float* inp, int64_t d0, int64_t d1, int64_t d2, int64_t d3,
                         int64_t os0, int64_t os1, int64_t os2, int64_t os3,
                         int64_t is0, int64_t is1, int64_t is2, int64_t is3, int32_t accumulate) {
  const int64_t rows = d0 * d1 * d2;
#pragma omp parallel for schedule(static) if (rows * d3 >= PAR_MIN)
  for (int64_t r = 0; r < rows; r++) {
    const int64_t i2 = r % d2, i1 = (r / d2) % d1, i0 = r / (d1 * d2);
    const float* x = inp + i0 * is0 + i1 * is1 + i2 * is2;
    float* o = out + i0 * os0 + i1 * os1 + i2 * os2;
    if (accumulate) {
      for (int64_t i3 = 0; i3 < d3; i3++) o[i3 * os3] += x[i3 * is3];
    } else if (os3 == 1 && is3 == 1) {
      memcpy(o, x, (size_t)d3 * sizeof(float));
    } else {
      for (int64_t i3 = 0; i3 < d3; i3++) o[i3 * os3] = x[i3 * is3];
    }
  }
}

// Row-major strided batched GEMM: C[b] = alpha op(A[b]) op(B[b]) + beta C[b], b < batch.
// OpenBLAS has no batched sgemm in Debian's 0.3.21; we loop, and spread the batch over
// OpenMP threads (OpenBLAS's OpenMP build runs each call single-threaded inside a parallel
// region, which is what small per-head GEMMs want).
void mt_sgemm_strided_batched(int32_t transA, int32_t transB, int64_t M, int64_t N, int64_t K,
                              float alpha, const float* A, int64_t lda, int64_t strideA,
                              const float* B, int64_t ldb, int64_t strideB, float beta, float* C,
                              int64_t ldc, int64_t strideC, int64_t batch) {
  const int ta = transA ? CblasTrans : CblasNoTrans, tb = transB ? CblasTrans : CblasNoTrans;
  const int parallel = batch > 1 && M * N * K < 512 * 512 * 512;
#pragma omp parallel for schedule(static) if (parallel)
  for (int64_t b = 0; b < batch; b++)
    cblas_sgemm(CblasRowMajor, ta, tb, (int)M, (int)N, (int)K, alpha, A + b * strideA, (int)lda,
                B + b * strideB, (int)ldb, beta, C + b * strideC, (int)ldc);
}
