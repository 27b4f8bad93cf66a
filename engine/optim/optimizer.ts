// An optimizer updates parameters from their gradients, keeping its state in slabs. What it
// updates is an UpdatePlan: by default the whole parameter slab (state slabs of the same layout,
// decay then no decay: AdamW's one kernel call, SGD's two); under ZeRO (engine/parallel/zero.ts)
// the ranges of the slab this rank owns, with state slabs holding only those ranges, packed.
import type { Allocation, Backend, Ptr } from "../../ffi/backend.ts";
import type { ParamStore } from "../params.ts";
import type { Context } from "../context.ts";

export interface Optimizer {
  readonly name: "sgd" | "adamw";
  /** steps taken so far */
  readonly stepCount: number;
  /** One update; the gradients are read times gradScale (a global-norm clip's factor: AdamW
   *  folds it into its pass, SGD scales the gradients first). */
  step(lr: number, gradScale?: number): void;
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

/** One kernel call of a step: where its parameters, gradients and state are, and which of its
 *  elements (the first decayNumel) take weight decay. */
export interface UpdateGroup {
  param: Ptr;
  grad: Ptr;
  stateOffsetBytes: number;
  numel: number;
  weightDecay: number;
  decayNumel: number;
}

/** The kernel calls of a step, one per range; with `merge`, a decayed range directly followed by
 *  one without decay (in parameters, state and gradients: the whole slab's two) is one call. */
/** A run of parameters one optimizer step updates: pointers to its values, its gradient and its
 *  state vectors (the optimizer's order), its length, and how many of its first elements decay. */
export interface UpdateRun {
  param: number;
  grad: number;
  state: readonly number[];
  numel: number;
  decayNumel: number;
}

export function updateGroups(store: ParamStore, plan: UpdatePlan, weightDecay: number, merge = false): UpdateGroup[] {
  const groups: UpdateGroup[] = [];
  let last: UpdateRange | null = null;
  for (const r of plan.ranges) {
    const prev = groups.at(-1);
    const follows =
      last !== null &&
      last.paramOffset + last.numel === r.paramOffset &&
      last.stateOffset + last.numel === r.stateOffset;
    if (merge && prev !== undefined && last?.decay === true && !r.decay && prev.decayNumel === prev.numel && follows) {
      prev.numel += r.numel;
      last = r;
      continue;
    }
    groups.push({
      param: plan.params ? plan.params.ptr + r.stateOffset * 4 : store.values.ptr + r.paramOffset * 4,
      grad: plan.grads === null ? store.grads.ptr + r.paramOffset * 4 : plan.grads.ptr + r.stateOffset * 4,
      stateOffsetBytes: r.stateOffset * 4,
      numel: r.numel,
      weightDecay: r.decay ? weightDecay : 0,
      decayNumel: r.decay ? r.numel : 0,
    });
    last = r;
  }
  return groups;
}

/** An optimizer's arithmetic, for whatever memory holds the parameters (a ParamStore's slab or a
 *  parameter-server shard's chunks): the state vectors it keeps, in its order; whether a step may
 *  take a decayed range and the undecayed one after it as one call; one step of a run, the t-th
 *  (1: the first), its gradients read times gradScale. */
export interface UpdateRule {
  readonly stateNames: readonly string[];
  readonly mergeRanges: boolean;
  step(be: Backend, run: UpdateRun, lr: number, t: number, gradScale?: number): void;
}

/** An optimizer over a ParamStore's slab (or the ranges of it `plan` names; the whole slab where
 *  it is not given): a state slab per state vector of its rule, and the rule stepped over each
 *  kernel call's run (SGD and AdamW). */
export class SlabOptimizer implements Optimizer {
  readonly plan: UpdatePlan;
  #steps = 0;
  readonly #state: Allocation[];

  constructor(
    readonly name: Optimizer["name"],
    readonly ctx: Context,
    readonly store: ParamStore,
    readonly rule: UpdateRule,
    readonly weightDecay: number,
    plan?: UpdatePlan,
  ) {
    this.plan = plan ?? wholeSlabPlan(store);
    this.#state = rule.stateNames.map(() => allocStateSlab(ctx, this.plan));
  }

  get stepCount(): number {
    return this.#steps;
  }

  step(lr: number, gradScale = 1): void {
    const t = this.#steps + 1;
    for (const g of updateGroups(this.store, this.plan, this.weightDecay, this.rule.mergeRanges)) {
      const state = this.#state.map((a) => a.ptr + g.stateOffsetBytes);
      const run = { param: g.param, grad: g.grad, state, numel: g.numel, decayNumel: g.decayNumel };
      this.rule.step(this.ctx.backend, run, lr, t, gradScale);
    }
    this.#steps = t;
  }

  stateSlabs(): { name: string; allocation: Allocation }[] {
    return this.rule.stateNames.map((name, i) => ({ name, allocation: this.#state[i]! }));
  }

  setStepCount(n: number): void {
    this.#steps = n;
  }
}
