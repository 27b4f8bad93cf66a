// SGD with momentum, dampening, Nesterov momentum and (coupled, L2) weight decay, with
// PyTorch's torch.optim.SGD semantics:
//   g = grad + wd * p
//   buf = g on the first step, else momentum * buf + (1 - dampening) * g
//   p -= lr * (nesterov ? g + momentum * buf : buf)
// Weight decay applies to the parameters that declared decay (matrices), not biases.
import type { Allocation, Backend } from "../../ffi/backend.ts";
import { ConfigError } from "../../ffi/errors.ts";
import type { ParamStore } from "../params.ts";
import type { Context } from "../context.ts";
import { SlabOptimizer, type UpdatePlan, type UpdateRule, type UpdateRun } from "./optimizer.ts";

export interface SgdConfig {
  momentum: number;
  dampening: number;
  nesterov: boolean;
  weightDecay: number;
}

export const sgdDefaults: SgdConfig = { momentum: 0.9, dampening: 0, nesterov: false, weightDecay: 0 };

/** SGD over a slab (or its ranges `plan` names): one state slab, the momentum. */
export class Sgd extends SlabOptimizer {
  constructor(
    ctx: Context,
    store: ParamStore,
    readonly config: SgdConfig,
    plan?: UpdatePlan,
  ) {
    const { momentum, dampening, nesterov, weightDecay } = config;
    if (!(momentum >= 0 && momentum < 1)) throw new ConfigError(`sgd momentum must be in [0, 1), got ${momentum}`);
    if (!(dampening >= 0 && dampening <= 1)) throw new ConfigError(`sgd dampening must be in [0, 1], got ${dampening}`);
    if (!(weightDecay >= 0)) throw new ConfigError(`sgd weightDecay must be >= 0, got ${weightDecay}`);
    if (nesterov && (momentum === 0 || dampening !== 0)) {
      throw new ConfigError("sgd nesterov needs momentum > 0 and dampening = 0");
    }
    super("sgd", ctx, store, sgdRule(config), weightDecay, plan);
  }
}

/** SGD's rule: the momentum, and each range its own call (the decayed one scales its gradient first). */
export const sgdRule = (c: SgdConfig): UpdateRule => ({
  stateNames: ["momentum"],
  mergeRanges: false,
  step: (be, run, lr, t, gradScale) => sgdRun(be, c, run, lr, t, gradScale),
});

/**
 * One SGD step (the t-th; 1: the first) of a run of parameters whose first `decayNumel` take
 * weight decay: what Sgd steps its slab's groups with, and a parameter-server shard its chunks.
 */
export function sgdRun(be: Backend, c: SgdConfig, run: UpdateRun, lr: number, t: number, gradScale = 1): void {
  if (gradScale !== 1) be.scale(run.grad, run.numel, gradScale);
  const segments = [
    { at: 0, n: run.decayNumel, wd: c.weightDecay },
    { at: run.decayNumel, n: run.numel - run.decayNumel, wd: 0 },
  ];
  for (const seg of segments) {
    if (seg.n === 0) continue;
    const off = seg.at * 4;
    be.sgdStep(
      run.param + off,
      run.grad + off,
      run.state[0]! + off,
      seg.n,
      lr,
      c.momentum,
      c.dampening,
      seg.wd,
      c.nesterov,
      t === 1,
    );
  }
}
