// Element functions whose results must be bit-identical on every backend, written once and
// compiled by both ffi/cpu/kernels.c (C11) and ffi/cuda/kernels/*.cu (nvcc): the dropout
// mask hash and the conversions between f32 and the 2-byte formats. Integer arithmetic and
// bit manipulation only, so the compilers cannot make them disagree; and the optimizer updates
// and GELU's formula, so both backends apply the same rule (their float results agree to rounding).
#ifndef MT_NUMERICS_H
#define MT_NUMERICS_H
#include <stdint.h>
#ifndef __CUDACC__
#include <math.h>
#endif

#ifdef __CUDACC__
#define MT_FN static __host__ __device__ __forceinline__
MT_FN uint32_t mt_f32_bits(float f) { return __float_as_uint(f); }
MT_FN float mt_bits_f32(uint32_t u) { return __uint_as_float(u); }
#else
#include <string.h>
#define MT_FN static inline
MT_FN uint32_t mt_f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
MT_FN float mt_bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}
#endif

// ---- dropout: a counter-based hash decides each element, so backward recomputes the mask from
// (seed, index) and no mask is stored. engine/ops/dropout.ts has the same hash (reference).
MT_FN uint64_t mt_splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
// uniform in [0,1) with 24 bits, exactly representable in float32
MT_FN float mt_dropout_uniform(uint64_t seed, int64_t i) {
  return (float)(mt_splitmix64(seed ^ ((uint64_t)i * 0xD1B54A32D192ED03ull)) >> 40) * (1.0f / 16777216.0f);
}

// ---- casts: round to nearest even; NaN stays NaN (quiet) -----------------------------------
MT_FN uint16_t mt_f32_to_bf16_bits(float f) {
  const uint32_t u = mt_f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);  // quiet NaN
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

MT_FN uint16_t mt_f32_to_f16_bits(float f) {
  const uint32_t u = mt_f32_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t absu = u & 0x7fffffffu;
  if (absu > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);   // NaN
  if (absu >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // overflow (>= 65520) -> inf
  if (absu < 0x38800000u) {
    // subnormal half (or zero): value = mant * 2^-24; round |f| * 2^24 to nearest even
    if (absu < 0x33000000u) return (uint16_t)sign;  // < 2^-25: rounds to zero
    const uint32_t e = absu >> 23;                  // 102..112
    const uint32_t mant = (absu & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;  // 14..24
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (h & 1u))) h++;
    return (uint16_t)(sign | h);
  }
  // normal: rebias exponent 127 -> 15, round the 13 dropped mantissa bits to nearest even
  uint32_t h = (absu - 0x38000000u) >> 13;
  const uint32_t rem = absu & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
  return (uint16_t)(sign | h);
}

// Exact for numbers. Subnormals are built from their bits (m * 2^-24 normalized), so no
// compiler's contraction of float arithmetic can change them; a NaN is made quiet (bit 22), as
// IEEE conversion and x86's F16C do.
MT_FN float mt_f16_bits_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {
    if (m == 0) return mt_bits_f32(sign);  // +-0
    int shift = 0;                         // moves the leading 1 of m to bit 10
    while (((m << shift) & 0x400u) == 0) shift++;
    const uint32_t exponent = 113u - (uint32_t)shift;  // m * 2^-24 = 1.f * 2^(10-shift-24)
    return mt_bits_f32(sign | (exponent << 23) | (((m << shift) & 0x3ffu) << 13));
  }
  if (e == 31) return mt_bits_f32(sign | 0x7f800000u | (m << 13) | (m != 0 ? 0x400000u : 0u));
  return mt_bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

// ---- elements of a buffer that holds f32 or a 2-byte type ---------------------------------
// elem: 0 f32, 1 bf16, 2 f16 (ffi/ops.ts elemCodes). A kernel whose activations may be stored in
// the autocast type reads and writes them through these; its sums stay f32.
MT_FN float mt_load_elem(const void* base, int64_t i, int32_t elem) {
  if (elem == 1) return mt_bits_f32((uint32_t)((const uint16_t*)base)[i] << 16);
  if (elem == 2) return mt_f16_bits_to_f32(((const uint16_t*)base)[i]);
  return ((const float*)base)[i];
}
// rounds to nearest even for the 2-byte types
MT_FN void mt_store_elem(void* base, int64_t i, float v, int32_t elem) {
  if (elem == 1)
    ((uint16_t*)base)[i] = mt_f32_to_bf16_bits(v);
  else if (elem == 2)
    ((uint16_t*)base)[i] = mt_f32_to_f16_bits(v);
  else
    ((float*)base)[i] = v;
}

// ---- GELU, the tanh approximation (GPT-2): gelu(x) = 0.5 x (1 + tanh(s (x + 0.044715 x^3))),
// s = sqrt(2/pi). The tanh is the caller's: kernels.c has a vectorizable one, the CUDA kernels tanhf.
#define MT_GELU_SCALE 0.7978845608028654f  // sqrt(2/pi)
// the tanh's argument: s (x + 0.044715 x^3)
MT_FN float mt_gelu_tanh_arg(float x) {
  const float cube = 0.044715f * x * x * x;
  return MT_GELU_SCALE * (x + cube);
}
// gelu(x), given t = tanh(mt_gelu_tanh_arg(x))
MT_FN float mt_gelu_from_tanh(float x, float t) { return 0.5f * x * (1.0f + t); }
// forward was: gelu(x) = 0.5 x (1 + t)
// gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) s (1 + 3 * 0.044715 x^2), given t as above
MT_FN float mt_gelu_grad_from_tanh(float x, float t) {
  const float sech2 = 1.0f - t * t;
  return 0.5f * (1.0f + t) + x * 0.5f * sech2 * MT_GELU_SCALE * (1.0f + 3.0f * 0.044715f * x * x);
}

// ---- optimizer updates of one parameter (PyTorch semantics) ---------------------------------
// SGD: g = grad + wd p; buf = first ? g : momentum buf + (1 - dampening) g;
// step = nesterov ? g + momentum buf : buf; p -= lr step. momentum == 0 means plain SGD (mom
// is then never touched and may be null).
MT_FN void mt_sgd_update(float* param, const float* grad, float* mom, int64_t i, float lr, float momentum,
                         float dampening, float weight_decay, int32_t nesterov, int32_t first) {
  float g = grad[i] + weight_decay * param[i];
  if (momentum != 0.0f) {
    const float buf = first ? g : momentum * mom[i] + (1.0f - dampening) * g;
    mom[i] = buf;
    g = nesterov ? g + momentum * buf : buf;
  }
  param[i] -= lr * g;
}

// AdamW with decoupled weight decay: decay = 1 - lr wd (1 for a parameter without decay),
// inv_bc1 = 1 / (1 - beta1^t), inv_sqrt_bc2 = 1 / sqrt(1 - beta2^t), computed once per step by
// the caller; the gradient is read times gscale (the global-norm clip's factor, folded in).
//
// age (may be null): for a gradient that skips coordinates, as top-k compression's does (a
// coordinate left at 0 has its gradient waiting in the senders' error-feedback residuals). age[i]
// counts the steps since coordinate i last had a gradient. A 0 gradient only decays the parameter
// and counts the step; a gradient g that arrives after tau = age + 1 steps is tau steps' worth,
// taken as tau steps of g / tau: the moments move by beta^tau, and the parameter moves tau steps.
// (Plain AdamW would move such a coordinate by about sqrt(tau) steps in tau: it normalizes the
// burst by its own size.) With a gradient every step (tau = 1) this is AdamW, bit for bit.
MT_FN void mt_adamw_update(float* param, const float* grad, float* m, float* v, float* age, int64_t i, float lr,
                           float beta1, float beta2, float eps, float decay, float inv_bc1, float inv_sqrt_bc2,
                           float gscale) {
  float g = grad[i] * gscale, b1 = beta1, b2 = beta2, steps = 1.0f;
  if (age != 0) {
    if (g == 0.0f) {
      age[i] += 1.0f;
      param[i] *= decay;
      return;
    }
    steps = age[i] + 1.0f;
    age[i] = 0.0f;
    if (steps != 1.0f) {
      g /= steps;
      b1 = powf(beta1, steps);
      b2 = powf(beta2, steps);
    }
  }
  const float mi = b1 * m[i] + (1.0f - b1) * g;
  const float vi = b2 * v[i] + (1.0f - b2) * g * g;
  m[i] = mi;
  v[i] = vi;
  // PyTorch: p -= lr * (m / bc1) / (sqrt(v) / sqrt(bc2) + eps)
  param[i] = param[i] * decay - steps * lr * (mi * inv_bc1) / (sqrtf(vi) * inv_sqrt_bc2 + eps);
}

#endif
