// The optimizer a spec names, built in one place: a job's `optimizer` setting, the single
// process's options, a parameter-server shard's arithmetic and the benches all name SGD or AdamW
// this way (PyTorch's: SGD without dampening, AdamW with decoupled weight decay).
import type { Backend } from "../../ffi/backend.ts";
import type { ParamStore } from "../params.ts";
import type { Context } from "../context.ts";
import { AdamW, adamwRun } from "./adamw.ts";
import type { Optimizer, UpdatePlan, UpdateRun } from "./optimizer.ts";
import { Sgd, sgdRun } from "./sgd.ts";

export type OptimizerSpec =
  | { kind: "sgd"; momentum: number; nesterov: boolean; weightDecay: number }
  | { kind: "adamw"; beta1: number; beta2: number; eps: number; weightDecay: number };

/**
 * SGD or AdamW as `spec` says, over `store` (or the part of it `o.plan` names: ZeRO's ranges);
 * `o.sparse`: the gradients skip coordinates (top-k), so AdamW keeps each one's age.
 */
export function optimizerOf(
  ctx: Context,
  store: ParamStore,
  spec: OptimizerSpec,
  o: { plan?: UpdatePlan; sparse?: boolean } = {},
): Optimizer {
  if (spec.kind === "sgd")
    return new Sgd(
      ctx,
      store,
      { momentum: spec.momentum, dampening: 0, nesterov: spec.nesterov, weightDecay: spec.weightDecay },
      o.plan,
    );
  const { beta1, beta2, eps, weightDecay } = spec;
  return new AdamW(ctx, store, { beta1, beta2, eps, weightDecay, sparse: o.sparse ?? false }, o.plan);
}

/** The update rule of a spec, for memory that no ParamStore holds (a parameter-server shard's
 *  chunks): the state vectors it keeps, and one step of a run, the t-th (1: the first). */
export interface UpdateRule {
  readonly stateNames: readonly string[];
  step(be: Backend, run: UpdateRun, lr: number, t: number): void;
}

/** SGD's or AdamW's rule, the very steps optimizerOf's optimizers take. */
export function updateRule(spec: OptimizerSpec, o: { sparse?: boolean } = {}): UpdateRule {
  if (spec.kind === "sgd") {
    const c = { momentum: spec.momentum, dampening: 0, nesterov: spec.nesterov, weightDecay: spec.weightDecay };
    return { stateNames: ["momentum"], step: (be, run, lr, t) => sgdRun(be, c, run, lr, t) };
  }
  const { beta1, beta2, eps, weightDecay } = spec;
  const c = { beta1, beta2, eps, weightDecay };
  return {
    stateNames: ["m", "v", ...(o.sparse ? ["age"] : [])],
    step: (be, run, lr, t) => adamwRun(be, c, run, lr, t),
  };
}
