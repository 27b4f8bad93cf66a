// The optimizer a spec names, built in one place: a job's `optimizer` setting, the single
// process's options, a parameter-server shard's arithmetic and the benches all name SGD or AdamW
// this way (PyTorch's: SGD without dampening, AdamW with decoupled weight decay).
import type { ParamStore } from "../params.ts";
import type { Context } from "../context.ts";
import { AdamW, type AdamWConfig, adamwRule } from "./adamw.ts";
import type { Optimizer, UpdatePlan, UpdateRule } from "./optimizer.ts";
import { Sgd, type SgdConfig, sgdRule } from "./sgd.ts";

export type OptimizerSpec =
  | { kind: "sgd"; momentum: number; nesterov: boolean; weightDecay: number }
  | { kind: "adamw"; beta1: number; beta2: number; eps: number; weightDecay: number };

/** The settings of the optimizer `spec` names (SGD without dampening, as PyTorch's default). */
function configOf(
  spec: OptimizerSpec,
  sparse: boolean,
): { kind: "sgd"; c: SgdConfig } | { kind: "adamw"; c: AdamWConfig } {
  if (spec.kind === "sgd") {
    const { momentum, nesterov, weightDecay } = spec;
    return { kind: "sgd", c: { momentum, dampening: 0, nesterov, weightDecay } };
  }
  const { beta1, beta2, eps, weightDecay } = spec;
  return { kind: "adamw", c: { beta1, beta2, eps, weightDecay, sparse } };
}

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
  const x = configOf(spec, o.sparse ?? false);
  return x.kind === "sgd" ? new Sgd(ctx, store, x.c, o.plan) : new AdamW(ctx, store, x.c, o.plan);
}

/** SGD's or AdamW's rule, the very steps optimizerOf's optimizers take, for memory that no
 *  ParamStore holds (a parameter-server shard's chunks). */
export function updateRule(spec: OptimizerSpec, o: { sparse?: boolean } = {}): UpdateRule {
  const x = configOf(spec, o.sparse ?? false);
  return x.kind === "sgd" ? sgdRule(x.c) : adamwRule(x.c);
}
