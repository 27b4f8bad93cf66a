// A TrainStep for tests: most train at a constant learning rate, and say the rest at the call.
import type { Model } from "../../engine/models/model.ts";
import type { Optimizer } from "../../engine/optim/optimizer.ts";
import type { Context } from "../../engine/context.ts";
import { type StepConfig, TrainStep } from "../../engine/train.ts";

/** A TrainStep of `model` by `optimizer` at the constant learning rate `config.lr`. */
export function constantLrStep(
  ctx: Context,
  model: Model,
  optimizer: Optimizer,
  config: Omit<StepConfig, "schedule">,
): TrainStep {
  return new TrainStep(ctx, model, optimizer, { ...config, schedule: { kind: "constant" } });
}
