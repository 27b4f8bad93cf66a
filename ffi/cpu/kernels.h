// meshtrain CPU kernel library, loaded by ffi/cpu/backend.ts through bun:ffi: what its sources
// (kernels.c, attention.c, compress.c; ffi/cpu/build.ts compiles them into one library) share.
//
// Conventions (llm.c style):
//   - every buffer argument has its shape in a comment; N rows, C channels, V vocab,
//     BH batch*heads, T time.
//   - backward kernels ADD into their d-buffers (dinp += ...), so a tensor used twice
//     accumulates both gradients; the engine zeroes gradient buffers before backward.
//   - all sizes are int64_t; all floating point data is float32 unless the name says so.
//   - threading: OpenMP with static schedules only, and reductions combined in a fixed order,
//     so results are bit-identical from run to run on the same thread count.
//   - nothing here allocates memory that outlives a call except mt_alloc.
#define _POSIX_C_SOURCE 200809L  // posix_memalign under -std=c11
#define _DEFAULT_SOURCE          // MAP_ANONYMOUS
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include "../numerics.h"
#ifdef _OPENMP
#include <omp.h>
#endif

// Kernels whose activations may be f32 or a 2-byte type (ffi/numerics.h mt_load_elem) call an
// always-inlined span or row function through MT_WITH_ELEM, which passes the type as a constant:
// each copy's loads and stores are then plain, and the f32 one vectorizes as it did before types
// were added (a loop that branched on the type per element did not, and ran 10x slower). The
// switch sits inside each parallel loop, around a row or a chunk: OpenMP outlines a parallel
// region before anything is inlined, so a switch around the region would not specialize it.
#define MT_WITH_ELEM(elem, ...) \
  switch (elem) {               \
    case 0: {                   \
      enum { E = 0 };           \
      __VA_ARGS__;              \
      break;                    \
    }                           \
    case 1: {                   \
      enum { E = 1 };           \
      __VA_ARGS__;              \
      break;                    \
    }                           \
    default: {                  \
      enum { E = 2 };           \
      __VA_ARGS__;              \
      break;                    \
    }                           \
  }
#define MT_INLINE static inline __attribute__((always_inline))
// elements a flat elementwise kernel hands to one MT_WITH_ELEM call
#define MT_SPAN 4096

// Below this many elements a parallel region costs more than it saves (measured: a region
// costs ~1-2 us on the 2-core build machine; a memory-bound pass moves ~8 bytes/element/ns).
#define PAR_MIN 32768

// cblas_sgemm from OpenBLAS (we link against the same libopenblas.so.0 that JS dlopens).
enum { CblasRowMajor = 101, CblasNoTrans = 111, CblasTrans = 112 };
void cblas_sgemm(int order, int transA, int transB, int M, int N, int K, float alpha,
                 const float* A, int lda, const float* B, int ldb, float beta, float* C, int ldc);

static inline int max_threads(void) {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}
static inline int thread_id(void) {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}
// The team actually running the current region: it can be smaller than requested (nested
// regions, OMP_THREAD_LIMIT, OMP_DYNAMIC), so manual work splits must use this, never the request.
static inline int team_size(void) {
#ifdef _OPENMP
  return omp_get_num_threads();
#else
  return 1;
#endif
}

// ---------------------------------------------------------------------------------------------
// fast math: expf and tanhf that the compiler can vectorize (libm's are calls it cannot).
// exp: Cephes' expf polynomial after range reduction x = n ln2 + r, |r| <= ln2/2; max relative
// error ~2 ulp over the clamped range. The input is clamped to [-87.3, 88.0] (so the exponent
// n stays in [-126, 127]), so underflow
// gives ~1e-38 instead of 0 and overflow ~1.7e38 instead of inf; NaN stays NaN.
// ---------------------------------------------------------------------------------------------

static inline float fast_expf(float x) {
  x = x < -87.3f ? -87.3f : x;
  x = x > 88.0f ? 88.0f : x;
  // n = round(x / ln2) with the 1.5 * 2^23 trick (exact in round-to-nearest float arithmetic)
  const float shifter = 12582912.0f;
  const float n = (x * 1.44269504088896341f + shifter) - shifter;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t e = (int32_t)n + 127;
  uint32_t bits = (uint32_t)e << 23;
  float scale;
  memcpy(&scale, &bits, 4);
  return p * scale;
}

// tanh(u) = 1 - 2 / (exp(2u) + 1): absolute error ~1e-7 (relative error grows for |u| < 1e-3,
// where GELU adds it to 1 anyway).
static inline float fast_tanhf(float u) { return 1.0f - 2.0f / (fast_expf(2.0f * u) + 1.0f); }
