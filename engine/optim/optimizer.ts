// An optimizer updates the parameter slab from the gradient slab, keeping its state in slabs
// of the same layout. step() makes one kernel call per parameter group (decay / no decay).
import type { Allocation } from "../../ffi/backend.ts";
import type { ParamStore } from "../params.ts";
import type { Context } from "../tensor.ts";

export interface Optimizer {
  readonly name: "sgd" | "adamw";
  /** steps taken so far */
  readonly stepCount: number;
  step(lr: number): void;
  /** named state slabs, each store.slabNumel floats (for checkpoints) */
  stateSlabs(): { name: string; allocation: Allocation }[];
  /** restore the step counter (after loading state slabs) */
  setStepCount(n: number): void;
}

export function allocStateSlab(ctx: Context, store: ParamStore): Allocation {
  return ctx.allocPersistent(store.slabNumel * 4);
}

/**
 * The two parameter groups as (byte offset, element count, weight decay): decayed parameters
 * take `weightDecay`, the rest 0. Empty groups are skipped.
 */
export function decayGroups(store: ParamStore, weightDecay: number): { offsetBytes: number; numel: number; weightDecay: number }[] {
  return [
    { offsetBytes: store.decayRange.offset * 4, numel: store.decayRange.numel, weightDecay },
    { offsetBytes: store.noDecayRange.offset * 4, numel: store.noDecayRange.numel, weightDecay: 0 },
  ].filter((g) => g.numel > 0);
}
