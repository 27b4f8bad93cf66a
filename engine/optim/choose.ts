// The optimizer a spec names, built in one place: a job's `optimizer` setting, the single
// process's options, a parameter-server shard's arithmetic and the benches all name SGD or AdamW
// this way (PyTorch's: SGD without dampening, AdamW with decoupled weight decay).
import type { ParamStore } from "../params.ts";
import type { Context } from "../context.ts";
import { AdamW } from "./adamw.ts";
import type { Optimizer, UpdatePlan } from "./optimizer.ts";
import { Sgd } from "./sgd.ts";

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
