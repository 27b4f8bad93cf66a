// A job's world over time: how many trainers ran each step. A job starts with cfg.trainers; a
// resize (or a resume on another number of trainers) adds a change at the step it takes effect,
// so cfg.world lists every change, { from: 0, trainers } first, and cfg.trainers is the last one.
// A change may also say each trainer's batch from then on (a job that goes on without a lost
// host keeps its global batch: fewer trainers, each a larger batch); a world whose changes say
// none runs cfg.batchSize throughout, and one that says it says it in every change.
//
// The sampler follows the world: each step takes the next trainers x batchSize positions of the
// epoch's permutation (fewer in an epoch's last step), so when the world changes mid-epoch the
// rest of the epoch is re-split among the new ranks and every sample is still seen exactly
// once per epoch. An epoch ends when its permutation is used up; so the job's step count, and
// where each epoch starts, depend on the world. With one trainer count this is the plain
// DistributedSampler of services/data-loader/sampler.ts, which cuts each step's rows among its
// ranks (rankSlice).
import { BadRequestError } from "../mesh/errors.ts";

export interface WorldChange {
  /** the first step the count holds for */
  from: number;
  trainers: number;
  /** samples per trainer per step from then on (absent: the job's batchSize) */
  batchSize?: number;
}

/** How the trainers hold the model: its pipeline stages x tensor ranks (1 and 1 without model parallelism). */
export interface ModelCut {
  trainers: number;
  pipelineStages?: number;
  tensorParallel?: number;
}

/** The trainers that hold one copy of the model between them: its pipeline stages x tensor ranks. */
export const modelRanks = (cfg: Omit<ModelCut, "trainers">): number =>
  (cfg.pipelineStages ?? 1) * (cfg.tensorParallel ?? 1);

/** The data-parallel ranks: copies of the model, each training on its share of a step's samples
 *  (every trainer without model parallelism). The sampler and the data-loader split among these. */
export const dataRanks = (cfg: ModelCut): number => cfg.trainers / modelRanks(cfg);

/** The world of a job: its changes, or the one of a job that never changed, in data-parallel
 *  ranks (a model-parallel job never changes its world). */
export const worldOf = (cfg: ModelCut & { world?: readonly WorldChange[] }): readonly WorldChange[] =>
  cfg.world && cfg.world.length > 0 ? cfg.world : [{ from: 0, trainers: dataRanks(cfg) }];

/** A world's problems (empty: good): it starts at step 0, steps increase, and it ends at
 *  `trainers`; where its changes say batches, each says one, and the last is `batchSize`. */
export function worldProblems(world: readonly WorldChange[], trainers: number, batchSize?: number): string[] {
  const out: string[] = [];
  if (world.length === 0) return out;
  if (world[0]!.from !== 0) out.push(`the world starts at step ${world[0]!.from}, not 0`);
  for (let i = 1; i < world.length; i++)
    if (!(world[i]!.from > world[i - 1]!.from))
      out.push(`the world's change ${i} at step ${world[i]!.from} is not after step ${world[i - 1]!.from}`);
  if (world.at(-1)!.trainers !== trainers)
    out.push(`the world ends with ${world.at(-1)!.trainers} trainers, the job has ${trainers}`);
  const said = world.filter((c) => c.batchSize !== undefined).length;
  if (said > 0 && said < world.length) out.push("some of the world's changes say their batch, and some do not");
  const last = world.at(-1)!.batchSize;
  if (last !== undefined && batchSize !== undefined && last !== batchSize)
    out.push(`the world ends with batches of ${last}, the job's are ${batchSize}`);
  return out;
}

/**
 * The world with a change to `trainers` at `step` (changes at or after it are replaced); with
 * `batchSize` other than the job's, each trainer's batch changes too, and every change says its own.
 */
export function changeWorld(
  cfg: { trainers: number; batchSize?: number; world?: readonly WorldChange[] },
  step: number,
  trainers: number,
  batchSize = cfg.batchSize,
): WorldChange[] {
  const explicit = batchSize !== cfg.batchSize || worldOf(cfg).some((c) => c.batchSize !== undefined);
  const said = (c: WorldChange): WorldChange =>
    explicit ? { from: c.from, trainers: c.trainers, batchSize: c.batchSize ?? cfg.batchSize! } : c;
  const before = worldOf(cfg)
    .filter((c) => c.from < step)
    .map(said);
  const last = before.at(-1);
  if (last?.trainers === trainers && last.batchSize === (explicit ? batchSize : undefined)) return before;
  return [...before, explicit ? { from: step, trainers, batchSize: batchSize! } : { from: step, trainers }];
}

/** Samples per step of a world's change (its trainers' batches). */
const rowsOf = (c: WorldChange, batchSize: number): number => c.trainers * (c.batchSize ?? batchSize);

/**
 * Why a snapshot of step `step`, taken by a job configured `was`, cannot resume the job as
 * configured `now` (null: it can): `now` changes its trainers after that step (the steps between
 * would need the old ranks), or the two disagree on the world before it (the snapshot is of
 * another history: one taken by the old ranks after the step a resize took effect from).
 */
export function worldResumeProblem(
  now: { trainers: number; batchSize: number; world?: readonly WorldChange[] },
  was: { trainers: number; batchSize: number; world?: readonly WorldChange[] },
  step: number,
): string | null {
  const last = worldOf(now).at(-1)!;
  if (last.from > step)
    return `the job runs ${last.trainers} trainers from step ${last.from}, after this snapshot's step ${step}`;
  // what the steps before it took: samples per step (an all-reduce job regrouped onto other
  // trainers with the same global batch took the same ones)
  const before = (c: typeof now) =>
    JSON.stringify(
      worldOf(c)
        .filter((w) => w.from < step)
        .map((w) => [w.from, rowsOf(w, c.batchSize)]),
    );
  if (before(now) !== before(was))
    return `it was taken with trainers ${JSON.stringify(worldOf(was))}, and the job's are ${JSON.stringify(worldOf(now))}`;
  return null;
}

/** Where a step stands: its epoch, the first position of the epoch's permutation it takes, its ranks. */
export interface StepPlace {
  epoch: number;
  /** position in the epoch's permutation where the step's samples begin */
  cursor: number;
  /** samples the step takes, over all its ranks */
  rows: number;
  trainers: number;
  /** the step's index within its epoch */
  index: number;
  /** the epoch's last step */
  last: boolean;
}

/**
 * The steps of a job: for each, its epoch, cursor and world. Built once per job (a few thousand
 * steps of two small arrays).
 */
export class StepSchedule {
  readonly totalSteps: number;
  /** the first step of each epoch (one per epoch the job reaches) */
  readonly epochStarts: number[] = [];
  readonly #cursor: Int32Array;
  readonly #epoch: Int32Array;
  readonly #world: readonly WorldChange[];

  constructor(
    readonly samples: number,
    readonly batchSize: number,
    world: readonly WorldChange[],
    epochs: number,
    maxSteps = 0,
  ) {
    if (!(samples > 0 && batchSize > 0))
      throw new BadRequestError(`a schedule of ${samples} samples in batches of ${batchSize}`);
    this.#world = world;
    const cursors: number[] = [],
      epochOf: number[] = [];
    let step = 0;
    for (let e = 0; e < epochs && (maxSteps <= 0 || step < maxSteps); e++) {
      this.epochStarts.push(step);
      for (let c = 0; c < samples && (maxSteps <= 0 || step < maxSteps); step++) {
        cursors.push(c);
        epochOf.push(e);
        c += rowsOf(this.#changeAt(step), batchSize);
      }
    }
    this.totalSteps = step;
    this.#cursor = Int32Array.from(cursors);
    this.#epoch = Int32Array.from(epochOf);
  }

  /** The trainers of step `step` (the world's last count for steps past the job's end). */
  trainersAt(step: number): number {
    return this.#changeAt(step).trainers;
  }

  /** The world's change that holds at `step`. */
  #changeAt(step: number): WorldChange {
    let w = this.#world[0]!;
    for (const c of this.#world) if (c.from <= step) w = c;
    return w;
  }

  /** The most trainers any step has. */
  get trainersMax(): number {
    return Math.max(...this.#world.map((c) => c.trainers));
  }

  at(step: number): StepPlace {
    if (!(Number.isInteger(step) && step >= 0 && step < this.totalSteps))
      throw new BadRequestError(`step ${step}: the job runs steps 0 to ${this.totalSteps - 1}`);
    const cursor = this.#cursor[step]!,
      epoch = this.#epoch[step]!,
      change = this.#changeAt(step),
      trainers = change.trainers;
    const rows = Math.min(rowsOf(change, this.batchSize), this.samples - cursor);
    return {
      epoch,
      cursor,
      rows,
      trainers,
      index: step - this.epochStarts[epoch]!,
      last: cursor + rows >= this.samples,
    };
  }

  /** Whether `step` is the first of an epoch after the first (where an epoch's evaluation runs). */
  startsEpoch(step: number): boolean {
    return step > 0 && this.epochStarts.includes(step);
  }
}
