// Distributed sampling with the semantics of PyTorch's DistributedSampler (shuffle=True,
// seeded per epoch, disjoint slices per rank), but without padding or dropping: every
// training sample is visited exactly once per epoch across the W ranks.
//
// Step s of an epoch covers the next W*B positions of the epoch's permutation; rank r takes its
// share of that range (B each; in the last, shorter step the remainder is split as evenly as
// possible, so a rank may get fewer, or none, when fewer than W samples remain). W may change
// between steps (services/runtime/job/world.ts: StepSchedule): a cursor is still just the step.
import { epochOrder } from "../../engine/data/sampler.ts";
import type { StepPlace } from "../runtime/job/world.ts";

/** Sample ids of one epoch in training order (a seeded permutation of `ids`). */
export function epochIds(ids: Uint32Array, seed: number, epoch: number): Uint32Array {
  // mapped in place: one array of the epoch's length, not two (a 2 GiB token corpus has 16.7M
  // windows of 64)
  const out = epochOrder(ids.length, seed, epoch, true);
  for (let i = 0; i < ids.length; i++) out[i] = ids[out[i]!]!;
  return out;
}

/**
 * [start, start+count) positions of the epoch's permutation that rank `rank` takes in the step
 * at `p` (StepSchedule.at): the step's rows split evenly, so each rank's batch, and in an epoch's
 * last step the remainder as evenly as possible.
 */
export function rankSlice(p: StepPlace, rank: number): { start: number; count: number } {
  if (!(rank < p.trainers)) return { start: p.cursor, count: 0 };
  const q = Math.floor(p.rows / p.trainers),
    rem = p.rows % p.trainers;
  return { start: p.cursor + rank * q + Math.min(rank, rem), count: q + (rank < rem ? 1 : 0) };
}
