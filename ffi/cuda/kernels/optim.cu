// Optimizer updates with PyTorch semantics, elementwise over n parameters (as ffi/cpu/kernels.c).
#include "common.cuh"
#include "../../numerics.h"

// param, grad, mom (n). g = grad + wd p; buf = first ? g : momentum buf + (1 - dampening) g;
// step = nesterov ? g + momentum buf : buf; p -= lr step. momentum == 0 means plain SGD (mom is
// then never touched and may be null).
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_sgd_step_f32(float* param, const float* grad, float* mom, int64_t n, float lr, float momentum,
                float dampening, float weight_decay, int32_t nesterov, int32_t first) {
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    mt_sgd_update(param, grad, mom, i, lr, momentum, dampening, weight_decay, nesterov, first);
  }
}

// param, grad, m, v (n), age (n, or null: see mt_adamw_update). Decoupled weight decay on the
// first decay_end elements: p *= 1 - lr wd; then the Adam step with bias corrections
// bc1 = 1 - beta1^t, bc2 = 1 - beta2^t, on the gradient times grad_scale (the clip's factor).
extern "C" __global__ void __launch_bounds__(BLOCK_THREADS_MAX)
mt_adamw_step_f32(float* param, const float* grad, float* m, float* v, float* age, int64_t n, int64_t decay_end,
                  float lr, float beta1, float beta2, float eps, float weight_decay, float bc1, float bc2,
                  float grad_scale) {
  const float decay = 1.0f - lr * weight_decay;
  const float inv_bc1 = 1.0f / bc1, inv_sqrt_bc2 = 1.0f / sqrtf(bc2);
  for (int64_t i = thread_index(); i < n; i += thread_count()) {
    mt_adamw_update(param, grad, m, v, age, i, lr, beta1, beta2, eps, i < decay_end ? decay : 1.0f, inv_bc1,
                    inv_sqrt_bc2, grad_scale);
  }
}
