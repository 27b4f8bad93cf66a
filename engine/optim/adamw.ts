// AdamW (Loshchilov & Hutter) with PyTorch's torch.optim.AdamW semantics:
//   p *= 1 - lr * wd                                  (decoupled weight decay)
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
// Weight decay applies to the parameters that declared decay (matrices and embeddings).
//
// sparse: the gradients skip coordinates (top-k compression, engine/parallel/compress.ts). A
// third state, age, counts each coordinate's steps since its last gradient, and a gradient that
// arrives after tau steps is taken as tau steps of its mean (ffi/numerics.h, mt_adamw_update).
// With a gradient in every coordinate at every step this is AdamW, bit for bit.
import type { Allocation, Backend } from "../../ffi/backend.ts";
import { ConfigError } from "../../ffi/errors.ts";
import type { ParamStore } from "../params.ts";
import type { Context } from "../context.ts";
import { SlabOptimizer, type UpdatePlan, type UpdateRule, type UpdateRun } from "./optimizer.ts";

export interface AdamWConfig {
  beta1: number;
  beta2: number;
  eps: number;
  weightDecay: number;
  /** the gradients skip coordinates (top-k): keep an age per coordinate and catch up */
  sparse?: boolean;
}

export const adamwDefaults: AdamWConfig = { beta1: 0.9, beta2: 0.999, eps: 1e-8, weightDecay: 0.01 };

/** AdamW over a slab (or its ranges `plan` names): state slabs m and v, and (sparse) age. */
export class AdamW extends SlabOptimizer {
  constructor(
    ctx: Context,
    store: ParamStore,
    readonly config: AdamWConfig,
    plan?: UpdatePlan,
  ) {
    const { beta1, beta2, eps, weightDecay } = config;
    if (!(beta1 >= 0 && beta1 < 1) || !(beta2 >= 0 && beta2 < 1)) {
      throw new ConfigError(`adamw betas must be in [0, 1), got (${beta1}, ${beta2})`);
    }
    if (!(eps > 0)) throw new ConfigError(`adamw eps must be > 0, got ${eps}`);
    if (!(weightDecay >= 0)) throw new ConfigError(`adamw weightDecay must be >= 0, got ${weightDecay}`);
    super("adamw", ctx, store, adamwRule(config), weightDecay, plan);
  }
}

/** AdamW's rule: m, v and (sparse) age, and one launch over a decayed range and the rest after
 *  it (the whole slab's two), the clip's factor folded in. */
export const adamwRule = (c: AdamWConfig): UpdateRule => ({
  stateNames: ["m", "v", ...(c.sparse ? ["age"] : [])],
  mergeRanges: true,
  step: (be, run, lr, t, gradScale) => adamwRun(be, c, run, lr, t, gradScale),
});

/**
 * One AdamW step (the t-th; 1: the first, which the bias correction counts) of a run of
 * parameters whose first `decayNumel` take weight decay; `run.state`: m, v and (sparse) age.
 * What AdamW steps its slab's groups with, and a parameter-server shard its chunks.
 */
export function adamwRun(be: Backend, c: AdamWConfig, run: UpdateRun, lr: number, t: number, gradScale = 1): void {
  const { beta1, beta2, eps, weightDecay } = c;
  const [m, v, age] = run.state;
  const bc1 = 1 - beta1 ** t;
  const bc2 = 1 - beta2 ** t;
  be.adamwStep(
    run.param,
    run.grad,
    m!,
    v!,
    age ?? 0,
    run.numel,
    run.decayNumel,
    lr,
    beta1,
    beta2,
    eps,
    weightDecay,
    bc1,
    bc2,
    gradScale,
  );
}
