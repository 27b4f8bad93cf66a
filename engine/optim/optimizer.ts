// An optimizer updates parameters from their gradients, keeping its state in slabs. What it
// updates is an UpdatePlan: by default the whole parameter slab (state slabs of the same layout,
// one kernel call per parameter group, decay / no decay); under ZeRO (engine/parallel/zero.ts)
// the ranges of the slab this rank owns, with state slabs holding only those ranges, packed.
import type { Allocation, Ptr } from "../../ffi/backend.ts";
import type { ParamStore } from "../params.ts";
import type { Context } from "../tensor.ts";

export interface Optimizer {
  readonly name: "sgd" | "adamw";
  /** steps taken so far */
  readonly stepCount: number;
  step(lr: number): void;
  /** named state slabs, each plan.stateNumel floats (for checkpoints) */
  stateSlabs(): { name: string; allocation: Allocation }[];
  /** restore the step counter (after loading state slabs) */
  setStepCount(n: number): void;
}

/** A range of the parameter slab an optimizer updates (elements). */
export interface UpdateRange {
  /** where the parameters are, in the parameter slab */
  paramOffset: number;
  /** where their state is, in the state slabs (and their gradients, in `grads` when it is set) */
  stateOffset: number;
  numel: number;
  decay: boolean;
}

export interface UpdatePlan {
  ranges: readonly UpdateRange[];
  /** elements of each state slab */
  stateNumel: number;
  /** the gradients: null, the store's gradient slab at paramOffset; else this buffer at stateOffset */
  grads: Allocation | null;
  /** the parameters: null or absent, the store's slab at paramOffset; else this buffer at stateOffset (ZeRO stage 3) */
  params?: Allocation | null;
}

/** The whole slab: state slabs of the slab's layout, gradients in the store's slab. */
export function wholeSlabPlan(store: ParamStore): UpdatePlan {
  const ranges = [
    {
      paramOffset: store.decayRange.offset,
      stateOffset: store.decayRange.offset,
      numel: store.decayRange.numel,
      decay: true,
    },
    {
      paramOffset: store.noDecayRange.offset,
      stateOffset: store.noDecayRange.offset,
      numel: store.noDecayRange.numel,
      decay: false,
    },
  ].filter((r) => r.numel > 0);
  return { ranges, stateNumel: store.slabNumel, grads: null };
}

export function allocStateSlab(ctx: Context, plan: UpdatePlan): Allocation {
  return ctx.allocPersistent(Math.max(plan.stateNumel, 1) * 4);
}

/** The kernel calls of a step: pointers to parameters and gradients, state byte offset, weight decay. */
export function updateGroups(
  store: ParamStore,
  plan: UpdatePlan,
  weightDecay: number,
): { param: Ptr; grad: Ptr; stateOffsetBytes: number; numel: number; weightDecay: number }[] {
  return plan.ranges.map((r) => ({
    param: plan.params ? plan.params.ptr + r.stateOffset * 4 : store.values.ptr + r.paramOffset * 4,
    grad: plan.grads === null ? store.grads.ptr + r.paramOffset * 4 : plan.grads.ptr + r.stateOffset * 4,
    stateOffsetBytes: r.stateOffset * 4,
    numel: r.numel,
    weightDecay: r.decay ? weightDecay : 0,
  }));
}
