// The CPU kernels of gradient compression (the conventions: kernels.h).
#include "kernels.h"

// ---------------------------------------------------------------------------------------------
// gradient compression (engine/parallel/compress.ts): int8 with a power-of-two scale per block,
// top-k selection, and decode-and-add for the all-gathered contributions
// ---------------------------------------------------------------------------------------------

// x (n) in blocks of `block`: scales[b] = 2^ceil(log2(max|x| / 127)) (0 for an all-zero block,
// NaN when the block holds a NaN or an Inf), q = round(x / scale) in [-127, 127]. A power of
// two keeps x - q * scale exact in f32 (what error feedback needs), at the cost of at most one
// bit of range. Returns the blocks that were not finite.
int64_t mt_encode_i8(int8_t* q, float* scales, const float* x, int64_t n, int64_t block) {
  const int64_t blocks = (n + block - 1) / block;
  int64_t bad = 0;
#pragma omp parallel for schedule(static) reduction(+ : bad) if (n >= PAR_MIN)
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t lo = b * block, hi = lo + block < n ? lo + block : n;
    float amax = 0.0f;
    int finite = 1;
    for (int64_t i = lo; i < hi; i++) {
      const float a = fabsf(x[i]);
      if (!isfinite(a)) finite = 0;
      else if (a > amax) amax = a;
    }
    if (!finite) {
      scales[b] = NAN;
      for (int64_t i = lo; i < hi; i++) q[i] = 0;
      bad++;
      continue;
    }
    if (amax == 0.0f) {
      scales[b] = 0.0f;
      for (int64_t i = lo; i < hi; i++) q[i] = 0;
      continue;
    }
    int e;
    // amax/127 = m 2^e with m in [0.5, 1): 2^e >= amax/127, and 2^(e-1) when m is exactly 0.5
    if (frexpf(amax / 127.0f, &e) == 0.5f) e--;
    float s = ldexpf(1.0f, e);
    if (amax / s > 127.0f) s *= 2.0f; // rounding of amax/127 (never taken in practice)
    const float inv = 1.0f / s;       // exact: a power of two
    scales[b] = s;
    for (int64_t i = lo; i < hi; i++) {
      float v = rintf(x[i] * inv); // round half to even
      if (v > 127.0f) v = 127.0f;
      if (v < -127.0f) v = -127.0f;
      q[i] = (int8_t)v;
    }
  }
  return bad;
}

// out (n) = q * scales[block] (add != 0: out += that)
void mt_decode_i8(float* out, const int8_t* q, const float* scales, int64_t n, int64_t block, int32_t add) {
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
  for (int64_t i = 0; i < n; i++) {
    const float v = (float)q[i] * scales[i / block];
    out[i] = add ? out[i] + v : v;
  }
}

// out (n) += bf16 or f16 values (f16 != 0: f16)
void mt_add_bf16(float* out, const uint16_t* inp, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
  for (int64_t i = 0; i < n; i++) out[i] += mt_bits_f32((uint32_t)inp[i] << 16);
}
void mt_add_f16(float* out, const uint16_t* inp, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
  for (int64_t i = 0; i < n; i++) out[i] += mt_f16_bits_to_f32(inp[i]);
}

static int cmp_desc_f32(const void* a, const void* b) {
  const float x = *(const float*)a, y = *(const float*)b;
  return (x < y) - (x > y);
}

// The k-th largest of v (n, destroyed): quickselect.
static float kth_largest(float* v, int64_t n, int64_t k) {
  int64_t lo = 0, hi = n - 1, want = k - 1;
  uint64_t seed = 0x9e3779b97f4a7c15ull;
  while (hi - lo > 16) {
    seed ^= seed << 13, seed ^= seed >> 7, seed ^= seed << 17;
    const float pivot = v[lo + (int64_t)(seed % (uint64_t)(hi - lo + 1))];
    int64_t i = lo, j = hi;
    while (i <= j) {
      while (v[i] > pivot) i++;
      while (v[j] < pivot) j--;
      if (i <= j) {
        const float t = v[i];
        v[i] = v[j], v[j] = t;
        i++, j--;
      }
    }
    if (want <= j) hi = j;
    else if (want >= i) lo = i;
    else return v[want];
  }
  qsort(v + lo, (size_t)(hi - lo + 1), sizeof(float), cmp_desc_f32);
  return v[want];
}

// The k (1 <= k <= n) entries of x (n) largest in magnitude, NaN and Inf first: their indices
// ascending in idx and their values in val. Ties at the threshold go to the lowest indices.
// scratch holds n floats.
void mt_topk_f32(uint32_t* idx, float* val, const float* x, int64_t n, int64_t k, float* scratch) {
  for (int64_t i = 0; i < n; i++) {
    const float a = fabsf(x[i]);
    scratch[i] = isnan(a) ? INFINITY : a;
  }
  const float thr = kth_largest(scratch, n, k);
  int64_t above = 0;
  for (int64_t i = 0; i < n; i++) {
    const float a = isnan(x[i]) ? INFINITY : fabsf(x[i]);
    above += a > thr;
  }
  int64_t ties = k - above, m = 0;
  for (int64_t i = 0; i < n && m < k; i++) {
    const float a = isnan(x[i]) ? INFINITY : fabsf(x[i]);
    if (a > thr || (a == thr && ties-- > 0)) {
      idx[m] = (uint32_t)i;
      val[m] = x[i];
      m++;
    }
  }
}

// out[idx[i]] += val[i] for i < k (indices checked by the caller)
void mt_scatter_add_f32(float* out, const uint32_t* idx, const float* val, int64_t k) {
  for (int64_t i = 0; i < k; i++) out[idx[i]] += val[i];
}

// error feedback: r = x - sent where that is finite, else 0 (x, sent, r: n)
void mt_residual_f32(float* r, const float* x, const float* sent, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
  for (int64_t i = 0; i < n; i++) {
    const float d = x[i] - sent[i];
    r[i] = isfinite(d) ? d : 0.0f;
  }
}
