// The CPU kernels: memory, elementwise ops, activations, dropout, the loss, layernorm, the
// embedding, reductions, optimizer updates and casts (the conventions: kernels.h).
#include "kernels.h"

// ---------------------------------------------------------------------------------------------
// memory
// ---------------------------------------------------------------------------------------------

// Returns 64-byte aligned, zeroed memory (cache line and AVX-512 aligned), or NULL.
// Zeroed memory, 64-byte aligned. From MT_MMAP_MIN bytes up, fresh anonymous pages: zero without
// a memset, and resident only once written, so a large slab or arena chunk that is partly used
// costs only what is used (peak RSS).
#define MT_MMAP_MIN ((int64_t)1 << 20)
void* mt_alloc(int64_t bytes) {
  if (bytes >= MT_MMAP_MIN) {
    void* m = mmap(NULL, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return m == MAP_FAILED ? NULL : m;
  }
  void* p = NULL;
  size_t size = bytes > 0 ? (size_t)bytes : 64;
  size = (size + 63) & ~(size_t)63;
  if (posix_memalign(&p, 64, size) != 0) return NULL;
  memset(p, 0, size);
  return p;
}
// bytes: what mt_alloc was asked for
void mt_free(void* p, int64_t bytes) {
  if (bytes >= MT_MMAP_MIN) munmap(p, (size_t)bytes);
  else free(p);
}
// Large non-overlapping copies are split across threads (one core does not saturate memory
// bandwidth); overlapping ones keep memmove's semantics.
void mt_copy(void* dst, const void* src, int64_t bytes) {
  const int64_t block = 1 << 20;
  const char* s = (const char*)src;
  char* d = (char*)dst;
  const int overlap = d < s + bytes && s < d + bytes;
  if (bytes < 4 * block || overlap) {
    memmove(dst, src, (size_t)bytes);
    return;
  }
  const int64_t nblocks = (bytes + block - 1) / block;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < nblocks; b++) {
    const int64_t start = b * block, len = start + block <= bytes ? block : bytes - start;
    memcpy(d + start, s + start, (size_t)len);
  }
}
// large blocks are split across threads: one core does not saturate memory bandwidth
void mt_zero(void* dst, int64_t bytes) {
  const int64_t block = 1 << 20;
  if (bytes < 4 * block) {
    memset(dst, 0, (size_t)bytes);
    return;
  }
  const int64_t nblocks = (bytes + block - 1) / block;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < nblocks; b++) {
    const int64_t start = b * block, len = start + block <= bytes ? block : bytes - start;
    memset((char*)dst + start, 0, (size_t)len);
  }
}
void mt_fill_f32(float* dst, int64_t n, float value) {
  for (int64_t i = 0; i < n; i++) dst[i] = value;
}
int mt_num_threads(void) { return max_threads(); }

// ---------------------------------------------------------------------------------------------
// elementwise
// ---------------------------------------------------------------------------------------------

// out, a, b (n)
void mt_add_f32(float* out, const float* a, const float* b, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
  for (int64_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}
void mt_mul_f32(float* out, const float* a, const float* b, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
  for (int64_t i = 0; i < n; i++) out[i] = a[i] * b[i];
}
// dst += src, where src is n float32 read from any byte address: a collective's piece straight
// from a message payload, which NATS hands out at arbitrary offsets. memcpy loads are the
// defined way to read an unaligned float; the compiler turns them into plain vector loads.
// One thread: pieces are at most a few MB and the ranks of a ring already share the cores.
void mt_add_unaligned_f32(float* dst, const unsigned char* src, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    float v;
    memcpy(&v, src + 4 * i, sizeof v);
    dst[i] += v;
  }
}
// out[i] = lut[in[i]]   (n): 8-bit pixels to the inputs they stand for (a 256-entry table)
void mt_lut_u8_f32(float* out, const unsigned char* in, const float* lut, int64_t n) {
  for (int64_t i = 0; i < n; i++) out[i] = lut[in[i]];
}
// y += alpha * x   (n)
void mt_axpy_f32(float* y, const float* x, int64_t n, float alpha) {
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
  for (int64_t i = 0; i < n; i++) y[i] += alpha * x[i];
}
// x *= s   (n)
void mt_scale_f32(float* x, int64_t n, float s) {
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
  for (int64_t i = 0; i < n; i++) x[i] *= s;
}
// dinp += mul[i] * dout[0] * scale   (n); dout is a scalar on the device.
// Backward of sum/mean (mul == NULL) and of a scalar broadcast.
void mt_add_scalar_ptr_f32(float* dinp, const float* dout, float scale, int64_t n) {
  const float g = dout[0] * scale;
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
  for (int64_t i = 0; i < n; i++) dinp[i] += g;
}

// Broadcast binary op over up to 4 dims: out[i0,i1,i2,i3] = a[i·as] op b[i·bs].
// Strides are in elements; a broadcast dim has stride 0. op: 0 add, 1 mul.
void mt_binary_bcast_f32(int32_t op, float* out, const float* a, const float* b,
                         int64_t d0, int64_t d1, int64_t d2, int64_t d3,
                         int64_t as0, int64_t as1, int64_t as2, int64_t as3,
                         int64_t bs0, int64_t bs1, int64_t bs2, int64_t bs3) {
  const int64_t rows = d0 * d1 * d2;
#pragma omp parallel for schedule(static) if (rows * d3 >= PAR_MIN)
  for (int64_t r = 0; r < rows; r++) {
    const int64_t i2 = r % d2, i1 = (r / d2) % d1, i0 = r / (d1 * d2);
    const float* ar = a + i0 * as0 + i1 * as1 + i2 * as2;
    const float* br = b + i0 * bs0 + i1 * bs1 + i2 * bs2;
    float* o = out + r * d3;
    if (op == 0) {
      for (int64_t i3 = 0; i3 < d3; i3++) o[i3] = ar[i3 * as3] + br[i3 * bs3];
    } else {
      for (int64_t i3 = 0; i3 < d3; i3++) o[i3] = ar[i3 * as3] * br[i3 * bs3];
    }
  }
}

// Sum a full-shape gradient down to a broadcast operand: out[i·os] += inp[i] over (d0..d3).
// Serial on purpose: outputs alias across rows, and a fixed order keeps results bit-exact.
void mt_reduce_bcast_f32(float* out, const float* inp,
                         int64_t d0, int64_t d1, int64_t d2, int64_t d3,
                         int64_t os0, int64_t os1, int64_t os2, int64_t os3) {
  const float* p = inp;
  for (int64_t i0 = 0; i0 < d0; i0++)
    for (int64_t i1 = 0; i1 < d1; i1++)
      for (int64_t i2 = 0; i2 < d2; i2++) {
        float* o = out + i0 * os0 + i1 * os1 + i2 * os2;
        if (os3 == 0) {
          double acc = 0.0;
          for (int64_t i3 = 0; i3 < d3; i3++) acc += p[i3];
          o[0] += (float)acc;
        } else {
          for (int64_t i3 = 0; i3 < d3; i3++) o[i3 * os3] += p[i3];
        }
        p += d3;
      }
}

// ---------------------------------------------------------------------------------------------
// bias, activations
// ---------------------------------------------------------------------------------------------

// out, inp (N,C) of elem (0 f32, 1 bf16, 2 f16: ffi/numerics.h mt_load_elem), bias (C) f32;
// out may be inp
MT_INLINE void bias_add_row(void* out, const void* inp, const float* bias, int64_t at, int64_t C, int32_t elem) {
  for (int64_t c = 0; c < C; c++) mt_store_elem(out, at + c, mt_load_elem(inp, at + c, elem) + bias[c], elem);
}
void mt_bias_add_f32(void* out, const void* inp, const float* bias, int64_t N, int64_t C, int32_t elem) {
#pragma omp parallel for schedule(static) if (N * C >= PAR_MIN)
  for (int64_t n = 0; n < N; n++) {
    MT_WITH_ELEM(elem, bias_add_row(out, inp, bias, n * C, C, E));
  }
}

// acc (C) += row `at` of g (of elem)
MT_INLINE void add_row(float* acc, const void* g, int64_t at, int64_t C, int32_t elem) {
#pragma omp simd
  for (int64_t c = 0; c < C; c++) acc[c] += mt_load_elem(g, at + c, elem);
}
// dbias (C) += sum over rows of dout (N,C). Each thread sums a contiguous range of rows into
// its own partial vector (streaming whole rows); partials are added in thread order, so the
// result is deterministic for a fixed thread count.
// dout of elem.
void mt_bias_backward_f32(float* dbias, const void* dout, int64_t N, int64_t C, int32_t elem) {
  const int nt = (N * C >= PAR_MIN && N >= 2) ? max_threads() : 1;
  float* partial = (float*)calloc((size_t)(C * nt), sizeof(float));
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    const int t = thread_id(), team = team_size();
    float* acc = partial + (int64_t)t * C;
    const int64_t n0 = N * t / team, n1 = N * (t + 1) / team;
    for (int64_t n = n0; n < n1; n++) {
      MT_WITH_ELEM(elem, add_row(acc, dout, n * C, C, E));
    }
  }
  for (int t = 0; t < nt; t++) {
    const float* acc = partial + (int64_t)t * C;
    for (int64_t c = 0; c < C; c++) dbias[c] += acc[c];
  }
  free(partial);
}

// A flat kernel over n elements: the statement `...` for each span [i0, i1) of MT_SPAN elements
// (it names i0 and i1), in parallel from `threshold` elements.
#define MT_SPAN_LOOP(n, threshold, ...)                                \
  do {                                                                 \
    const int64_t mt_n = (n);                                          \
    const int mt_par = mt_n >= (threshold);                            \
    _Pragma("omp parallel for schedule(static) if (mt_par)")           \
    for (int64_t i0 = 0; i0 < mt_n; i0 += MT_SPAN) {                   \
      const int64_t i1 = mt_n - i0 < MT_SPAN ? mt_n : i0 + MT_SPAN;    \
      __VA_ARGS__;                                                     \
    }                                                                  \
  } while (0)
// A flat kernel over n elements of elem: span(args..., i0, i1, E) for each span, E the type as a
// constant (MT_WITH_ELEM).
#define MT_SPANS(n, threshold, span, elem, ...) \
  MT_SPAN_LOOP(n, threshold, MT_WITH_ELEM(elem, span(__VA_ARGS__, i0, i1, E)))

// out, inp (n) of elem; written so NaN propagates (as torch.relu does): NaN < 0 is false. fmaxf
// would hide it.
MT_INLINE void relu_forward_span(void* out, const void* inp, int64_t i0, int64_t i1, int32_t elem) {
  for (int64_t i = i0; i < i1; i++) {
    const float x = mt_load_elem(inp, i, elem);
    mt_store_elem(out, i, x < 0.0f ? 0.0f : x, elem);
  }
}
void mt_relu_forward_f32(void* out, const void* inp, int64_t n, int32_t elem) {
  MT_SPANS(n, PAR_MIN, relu_forward_span, elem, out, inp);
}
// forward was: out = max(inp, 0). dinp, inp, dout of elem.
MT_INLINE void relu_backward_span(void* dinp, const void* inp, const void* dout, int64_t i0, int64_t i1, int32_t elem) {
  for (int64_t i = i0; i < i1; i++) {
    const float g = mt_load_elem(inp, i, elem) > 0.0f ? mt_load_elem(dout, i, elem) : 0.0f;
    mt_store_elem(dinp, i, mt_load_elem(dinp, i, elem) + g, elem);
  }
}
void mt_relu_backward_f32(void* dinp, const void* inp, const void* dout, int64_t n, int32_t elem) {
  MT_SPANS(n, PAR_MIN, relu_backward_span, elem, dinp, inp, dout);
}

// the formula is ffi/numerics.h's, shared with the CUDA kernels; the tanh is fast_tanhf
MT_INLINE float gelu(float x) { return mt_gelu_from_tanh(x, fast_tanhf(mt_gelu_tanh_arg(x))); }
// out, inp (n) of elem; tanh approximation, as in GPT-2
MT_INLINE void gelu_forward_span(void* out, const void* inp, int64_t i0, int64_t i1, int32_t elem) {
  for (int64_t i = i0; i < i1; i++) mt_store_elem(out, i, gelu(mt_load_elem(inp, i, elem)), elem);
}
void mt_gelu_forward_f32(void* out, const void* inp, int64_t n, int32_t elem) {
  MT_SPANS(n, PAR_MIN / 8, gelu_forward_span, elem, out, inp);
}
// pre (N,C) += bias (C), in place; out (N,C) = gelu(pre): a layer's bias and its GELU in one
// pass over memory (the same bits as mt_bias_add_f32 then mt_gelu_forward_f32). pre, out of
// elem: GELU reads pre as stored (rounded), as the two kernels one after the other would.
MT_INLINE void bias_gelu_row(void* out, void* pre, const float* bias, int64_t at, int64_t C, int32_t elem) {
#pragma omp simd
  for (int64_t c = 0; c < C; c++) {
    mt_store_elem(pre, at + c, mt_load_elem(pre, at + c, elem) + bias[c], elem);
    mt_store_elem(out, at + c, gelu(mt_load_elem(pre, at + c, elem)), elem);
  }
}
void mt_bias_gelu_forward_f32(void* out, void* pre, const float* bias, int64_t N, int64_t C, int32_t elem) {
#pragma omp parallel for schedule(static) if (N * C >= PAR_MIN / 8)
  for (int64_t n = 0; n < N; n++) {
    MT_WITH_ELEM(elem, bias_gelu_row(out, pre, bias, n * C, C, E));
  }
}
// forward was: out = 0.5 x (1 + tanh(s (x + 0.044715 x^3))). dinp, inp, dout of elem.
MT_INLINE void gelu_backward_span(void* dinp, const void* inp, const void* dout, int64_t i0, int64_t i1,
                                  int32_t elem) {
  for (int64_t i = i0; i < i1; i++) {
    const float x = mt_load_elem(inp, i, elem);
    const float local = mt_gelu_grad_from_tanh(x, fast_tanhf(mt_gelu_tanh_arg(x)));
    mt_store_elem(dinp, i, mt_load_elem(dinp, i, elem) + local * mt_load_elem(dout, i, elem), elem);
  }
}
void mt_gelu_backward_f32(void* dinp, const void* inp, const void* dout, int64_t n, int32_t elem) {
  MT_SPANS(n, PAR_MIN / 8, gelu_backward_span, elem, dinp, inp, dout);
}

// ---------------------------------------------------------------------------------------------
// dropout: a counter-based hash decides each element (mt_dropout_uniform, ffi/numerics.h), so
// backward recomputes the mask from (seed, index) and no mask is stored.
// ---------------------------------------------------------------------------------------------

// out, inp (n); keep with probability 1-p, scale kept values by 1/(1-p)
void mt_dropout_forward_f32(float* out, const float* inp, int64_t n, float p, uint64_t seed) {
  const float scale = 1.0f / (1.0f - p);
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
  for (int64_t i = 0; i < n; i++) out[i] = mt_dropout_uniform(seed, i) >= p ? inp[i] * scale : 0.0f;
}
// forward was: out[i] = keep(i) ? inp[i] / (1-p) : 0
void mt_dropout_backward_f32(float* dinp, const float* dout, int64_t n, float p, uint64_t seed) {
  const float scale = 1.0f / (1.0f - p);
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
  for (int64_t i = 0; i < n; i++)
    if (mt_dropout_uniform(seed, i) >= p) dinp[i] += dout[i] * scale;
}

// ---------------------------------------------------------------------------------------------
// softmax cross-entropy, fused and numerically stable
// ---------------------------------------------------------------------------------------------

// loss (1) = mean over rows; losses, lse (N); logits (N,V) of elem; targets (N) int32.
// lse[n] = log sum_v exp(logits[n,v]): all that backward needs besides the logits, so no second
// (N,V) array is kept. Returns the number of targets outside [0,V) (their rows get loss 0); the
// caller turns a nonzero count into an error.
// row `at` of logits: its log-sum-exp
MT_INLINE float logsumexp_row(const void* logits, int64_t at, int64_t V, int32_t elem) {
  float maxv = -INFINITY;
#pragma omp simd reduction(max : maxv)
  for (int64_t v = 0; v < V; v++) {
    const float x = mt_load_elem(logits, at + v, elem);
    maxv = x > maxv ? x : maxv;
  }
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t v = 0; v < V; v++) sum += fast_expf(mt_load_elem(logits, at + v, elem) - maxv);
  return logf(sum) + maxv;
}
int64_t mt_crossentropy_forward_f32(float* loss, float* losses, float* lse, const void* logits,
                                    const int32_t* targets, int64_t N, int64_t V, int32_t elem) {
  int64_t invalid = 0;
#pragma omp parallel for schedule(static) reduction(+ : invalid) if (N * V >= PAR_MIN / 4)
  for (int64_t n = 0; n < N; n++) {
    MT_WITH_ELEM(elem, lse[n] = logsumexp_row(logits, n * V, V, E));
    const int32_t t = targets[n];
    if (t < 0 || t >= V) {
      invalid++;
      losses[n] = 0.0f;
    } else {
      // -log p[t] computed as logsumexp - x[t], which stays finite when p[t] underflows
      losses[n] = lse[n] - mt_load_elem(logits, n * V + t, elem);
    }
  }
  double acc = 0.0;
  for (int64_t n = 0; n < N; n++) acc += losses[n];
  loss[0] = (float)(acc / (double)N);
  return invalid;
}
// forward was: loss = mean_n(lse[n] - logits[n, targets[n]])
// dlogits (N,V) (+)= (exp(logits - lse) - onehot(targets)) * dloss[0] / N; dlogits and logits of
// elem. With accumulate 0 it overwrites dlogits, which may then be the logits themselves (each
// element is read before it is written): the engine gives the logits' memory to their gradient
// when nothing else reads them.
MT_INLINE void crossentropy_backward_row(void* dlogits, const void* logits, float l, int32_t t, float g, int64_t at,
                                         int64_t V, int32_t accumulate, int32_t elem) {
#pragma omp simd
  for (int64_t v = 0; v < V; v++) {
    const float grad = (fast_expf(mt_load_elem(logits, at + v, elem) - l) - (v == t ? 1.0f : 0.0f)) * g;
    mt_store_elem(dlogits, at + v, accumulate ? mt_load_elem(dlogits, at + v, elem) + grad : grad, elem);
  }
}
void mt_crossentropy_backward_f32(void* dlogits, const void* logits, const float* lse, const int32_t* targets,
                                  const float* dloss, int64_t N, int64_t V, int32_t accumulate, int32_t elem) {
  const float g = dloss[0] / (float)N;
#pragma omp parallel for schedule(static) if (N * V >= PAR_MIN)
  for (int64_t n = 0; n < N; n++) {
    MT_WITH_ELEM(elem, crossentropy_backward_row(dlogits, logits, lse[n], targets[n], g, n * V, V, accumulate, E));
  }
}

// The index of row `at`'s largest logit by a strict > scan from v = 0 (so the first of equal
// maxima, NaN never taking over, and a NaN first element staying)
MT_INLINE int64_t argmax_row(const void* logits, int64_t at, int64_t V, int32_t elem) {
  int64_t best = 0;
  float top = mt_load_elem(logits, at, elem);
  for (int64_t v = 1; v < V; v++) {
    const float x = mt_load_elem(logits, at + v, elem);
    if (x > top) {
      top = x;
      best = v;
    }
  }
  return best;
}
// rows of logits (N,V) of elem whose argmax is targets[n]: an evaluation's accuracy without the
// logits leaving the backend
int64_t mt_count_correct_f32(const void* logits, const int32_t* targets, int64_t N, int64_t V, int32_t elem) {
  int64_t correct = 0;
#pragma omp parallel for schedule(static) reduction(+ : correct) if (N * V >= PAR_MIN)
  for (int64_t n = 0; n < N; n++) {
    int64_t best = 0;
    MT_WITH_ELEM(elem, best = argmax_row(logits, n * V, V, E));
    correct += best == targets[n] ? 1 : 0;
  }
  return correct;
}

// ---------------------------------------------------------------------------------------------
// layernorm (over the last dim C)
// ---------------------------------------------------------------------------------------------

// out (N,C) of elem, inp (N,C) f32; mean, rstd (N); weight, bias (C)
// one row of layernorm: row n of out from x (C); its mean and rstd
MT_INLINE void layernorm_row(void* out, int64_t n, float* mean, float* rstd, const float* x,
                                 const float* weight, const float* bias, int64_t C, float eps, int32_t elem) {
  // omp simd: let the compiler vectorize the sums (a fixed reassociation per build, so
  // results stay deterministic)
  float m = 0.0f;
#pragma omp simd reduction(+ : m)
  for (int64_t c = 0; c < C; c++) m += x[c];
  m /= (float)C;
  float var = 0.0f;
#pragma omp simd reduction(+ : var)
  for (int64_t c = 0; c < C; c++) {
    const float d = x[c] - m;
    var += d * d;
  }
  var /= (float)C;
  const float s = 1.0f / sqrtf(var + eps);
  for (int64_t c = 0; c < C; c++) mt_store_elem(out, n * C + c, (x[c] - m) * s * weight[c] + bias[c], elem);
  *mean = m;
  *rstd = s;
}

void mt_layernorm_forward_f32(void* out, float* mean, float* rstd, const float* inp, const float* weight,
                              const float* bias, int64_t N, int64_t C, float eps, int32_t elem) {
#pragma omp parallel for schedule(static) if (N * C >= PAR_MIN)
  for (int64_t n = 0; n < N; n++) {
    MT_WITH_ELEM(elem, layernorm_row(out, n, mean + n, rstd + n, inp + n * C, weight, bias, C, eps, E));
  }
}

// sum (N,C) = x + d (f32), and out (of elem) = layernorm(sum) as above: a residual add and the
// LayerNorm that reads it in one pass over memory (the same bits as the two kernels one after
// the other).
void mt_residual_layernorm_forward_f32(float* sum, void* out, float* mean, float* rstd, const float* x,
                                       const float* d, const float* weight, const float* bias, int64_t N,
                                       int64_t C, float eps, int32_t elem) {
#pragma omp parallel for schedule(static) if (N * C >= PAR_MIN)
  for (int64_t n = 0; n < N; n++) {
    float* sr = sum + n * C;
#pragma omp simd
    for (int64_t c = 0; c < C; c++) sr[c] = x[n * C + c] + d[n * C + c];
    MT_WITH_ELEM(elem, layernorm_row(out, n, mean + n, rstd + n, sr, weight, bias, C, eps, E));
  }
}

// forward was: out[n,c] = (inp[n,c] - mean[n]) * rstd[n] * weight[c] + bias[c]
// dinp (N,C), dweight/dbias (C) accumulate; dout (N,C) of elem (out's type), the rest f32.
// dweight/dbias: per-thread partial sums, added in thread order at the end (deterministic for a
// fixed thread count).
// one row of the backward: dx (C) += its gradient, dw and db (C) += its parameter gradients
MT_INLINE void layernorm_backward_row(float* dx, float* dw, float* db, const void* dout, const float* x,
                                      const float* weight, float m, float s, int64_t at, int64_t C, int32_t elem) {
  float dnorm_mean = 0.0f, dnorm_norm_mean = 0.0f;
#pragma omp simd reduction(+ : dnorm_mean, dnorm_norm_mean)
  for (int64_t c = 0; c < C; c++) {
    const float norm = (x[c] - m) * s;
    const float dnorm = weight[c] * mt_load_elem(dout, at + c, elem);
    dnorm_mean += dnorm;
    dnorm_norm_mean += dnorm * norm;
  }
  dnorm_mean /= (float)C;
  dnorm_norm_mean /= (float)C;
  // omp simd: dx, dw, db never alias (the caller passes distinct buffers)
#pragma omp simd
  for (int64_t c = 0; c < C; c++) {
    const float g = mt_load_elem(dout, at + c, elem);
    const float norm = (x[c] - m) * s;
    const float dnorm = weight[c] * g;
    db[c] += g;
    dw[c] += norm * g;
    dx[c] += (dnorm - dnorm_mean - norm * dnorm_norm_mean) * s;
  }
}
void mt_layernorm_backward_f32(float* dinp, float* dweight, float* dbias, const void* dout,
                               const float* inp, const float* weight, const float* mean,
                               const float* rstd, int64_t N, int64_t C, int32_t elem) {
  const int nt = (N * C >= PAR_MIN) ? max_threads() : 1;
  float* partial = (float*)calloc((size_t)(2 * C * nt), sizeof(float));
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    float* dw = partial + (int64_t)thread_id() * 2 * C;
    float* db = dw + C;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; n++) {
      MT_WITH_ELEM(elem, layernorm_backward_row(dinp + n * C, dw, db, dout, inp + n * C, weight, mean[n], rstd[n],
                                                n * C, C, E));
    }
  }
  for (int t = 0; t < nt; t++) {
    const float* dw = partial + (int64_t)t * 2 * C;
    for (int64_t c = 0; c < C; c++) {
      dweight[c] += dw[c];
      dbias[c] += dw[C + c];
    }
  }
  free(partial);
}

// ---------------------------------------------------------------------------------------------
// embedding
// ---------------------------------------------------------------------------------------------

// out (N,C) = table (V,C) [ids (N)]. Returns the count of ids outside [0,V) (rows left zero).
int64_t mt_embedding_forward_f32(float* out, const int32_t* ids, const float* table, int64_t N,
                                 int64_t C, int64_t V) {
  int64_t invalid = 0;
  for (int64_t n = 0; n < N; n++) {
    const int32_t id = ids[n];
    if (id < 0 || id >= V) {
      invalid++;
      memset(out + n * C, 0, (size_t)C * sizeof(float));
    } else {
      memcpy(out + n * C, table + (int64_t)id * C, (size_t)C * sizeof(float));
    }
  }
  return invalid;
}
// forward was: out[n,:] = table[ids[n],:]
// dtable (V,C) += scatter of dout (N,C). Threads split the columns: no races, row order kept.
void mt_embedding_backward_f32(float* dtable, const int32_t* ids, const float* dout, int64_t N,
                               int64_t C) {
  const int nt = (N * C >= PAR_MIN && C >= 32) ? max_threads() : 1;
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    const int t = thread_id(), team = team_size();
    const int64_t c0 = C * t / team, c1 = C * (t + 1) / team;
    for (int64_t n = 0; n < N; n++) {
      float* d = dtable + (int64_t)ids[n] * C;
      const float* g = dout + n * C;
      for (int64_t c = c0; c < c1; c++) d[c] += g[c];
    }
  }
}

// ---------------------------------------------------------------------------------------------
// reductions
// ---------------------------------------------------------------------------------------------

// out (1) = sum of inp (n), accumulated in double
void mt_sum_f32(float* out, const float* inp, int64_t n) {
  double acc = 0.0;
  for (int64_t i = 0; i < n; i++) acc += inp[i];
  out[0] = (float)acc;
}

// sum of squares of x (n), in double; per-thread partials combined in order.
double mt_sum_squares_f32(const float* x, int64_t n) {
  const int nt = n >= PAR_MIN ? max_threads() : 1;
  double partial[256] = {0};
  const int used = nt < 256 ? nt : 256;
#pragma omp parallel num_threads(used) if (used > 1)
  {
    const int t = thread_id(), team = team_size();
    const int64_t i0 = n * t / team, i1 = n * (t + 1) / team;
    double acc = 0.0;
    float accf[16] = {0};
    int64_t i = i0;
    // blocks of 16 in float (vectorizes), flushed to double every 4096 elements
    while (i < i1) {
      const int64_t end = i + 4096 < i1 ? i + 4096 : i1;
      for (; i + 16 <= end; i += 16)
        for (int k = 0; k < 16; k++) accf[k] += x[i + k] * x[i + k];
      for (; i < end; i++) acc += (double)x[i] * (double)x[i];
      for (int k = 0; k < 16; k++) {
        acc += accf[k];
        accf[k] = 0.0f;
      }
    }
    partial[t] = acc;
  }
  double total = 0.0;
  for (int t = 0; t < used; t++) total += partial[t];
  return total;
}

// number of NaN or +-Inf values in x (n)
int64_t mt_count_nonfinite_f32(const float* x, int64_t n) {
  int64_t bad = 0;
#pragma omp parallel for schedule(static) reduction(+ : bad) if (n >= PAR_MIN)
  for (int64_t i = 0; i < n; i++) bad += !isfinite(x[i]);
  return bad;
}

// ---------------------------------------------------------------------------------------------
// optimizer updates (PyTorch semantics): the element rules are in ffi/numerics.h
// ---------------------------------------------------------------------------------------------

// param, grad, mom (n). g = grad + wd p; buf = first ? g : momentum buf + (1 - dampening) g;
// step = nesterov ? g + momentum buf : buf; p -= lr step. momentum == 0 means plain SGD.
void mt_sgd_step_f32(float* param, const float* grad, float* mom, int64_t n, float lr, float momentum,
                     float dampening, float weight_decay, int32_t nesterov, int32_t first) {
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
  for (int64_t i = 0; i < n; i++) mt_sgd_update(param, grad, mom, i, lr, momentum, dampening, weight_decay, nesterov, first);
}

// param, grad, m, v (n), age (n, or null: see mt_adamw_update). Decoupled weight decay on the
// first decay_end elements: p *= 1 - lr wd; then the Adam step with bias corrections
// bc1 = 1 - beta1^t, bc2 = 1 - beta2^t, on the gradient times grad_scale (the clip's factor).
void mt_adamw_step_f32(float* param, const float* grad, float* m, float* v, float* age, int64_t n, int64_t decay_end,
                       float lr, float beta1, float beta2, float eps, float weight_decay, float bc1, float bc2,
                       float grad_scale) {
  const float decay = 1.0f - lr * weight_decay;
  const float inv_bc1 = 1.0f / bc1, inv_sqrt_bc2 = 1.0f / sqrtf(bc2);
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
  for (int64_t i = 0; i < n; i++)
    mt_adamw_update(param, grad, m, v, age, i, lr, beta1, beta2, eps, i < decay_end ? decay : 1.0f, inv_bc1,
                    inv_sqrt_bc2, grad_scale);
}

// ---------------------------------------------------------------------------------------------
// casts (round to nearest even; NaN stays NaN): the element conversions are in ffi/numerics.h
// ---------------------------------------------------------------------------------------------

void mt_f32_to_bf16(uint16_t* out, const float* inp, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
  for (int64_t i = 0; i < n; i++) out[i] = mt_f32_to_bf16_bits(inp[i]);
}
void mt_bf16_to_f32(float* out, const uint16_t* inp, int64_t n) {
#pragma omp parallel for schedule(static) if (n >= PAR_MIN)
  for (int64_t i = 0; i < n; i++) out[i] = mt_bits_f32((uint32_t)inp[i] << 16);
}

// With F16C (x86 since 2012) the hardware converts 8 at a time with the same IEEE rounding
// (round to nearest even, subnormals kept); the portable bit-twiddling versions (ffi/numerics.h) cover the
// tails and other machines. Both agree bit for bit (tested against Float16Array).
#ifdef __F16C__
#include <immintrin.h>
#endif
// out (n) f16 bits of inp (n) over the span [i, end): 8 at a time with F16C, the rest one at a time
MT_INLINE void f32_to_f16_span(uint16_t* out, const float* inp, int64_t i, int64_t end) {
#ifdef __F16C__
  for (; i + 8 <= end; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(inp + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128((__m128i*)(out + i), h);
  }
#endif
  for (; i < end; i++) out[i] = mt_f32_to_f16_bits(inp[i]);
}
void mt_f32_to_f16(uint16_t* out, const float* inp, int64_t n) {
  MT_SPAN_LOOP(n, PAR_MIN, f32_to_f16_span(out, inp, i0, i1));
}
// out (n) f32 of the f16 bits inp (n), likewise
MT_INLINE void f16_to_f32_span(float* out, const uint16_t* inp, int64_t i, int64_t end) {
#ifdef __F16C__
  for (; i + 8 <= end; i += 8) _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(inp + i))));
#endif
  for (; i < end; i++) out[i] = mt_f16_bits_to_f32(inp[i]);
}
void mt_f16_to_f32(float* out, const uint16_t* inp, int64_t n) {
  MT_SPAN_LOOP(n, PAR_MIN, f16_to_f32_span(out, inp, i0, i1));
}
