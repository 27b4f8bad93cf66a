// Distributed sampling with the semantics of PyTorch's DistributedSampler (shuffle=True,
// seeded per epoch, disjoint slices per rank), but without padding or dropping: every
// training sample is visited exactly once per epoch across the W ranks.
//
// Step s of an epoch covers positions [s*W*B, (s+1)*W*B) of the epoch's permutation; rank r
// takes its share of that range (B each; in the last, shorter step the remainder is split as
// evenly as possible, so a rank may get fewer, or none, when fewer than W samples remain).
// A cursor is therefore just (epoch, step): nothing else is needed to resume exactly.
import { epochOrder } from "../../engine/data/sampler.ts";

/** [start, start+count) positions of the epoch permutation that rank r trains on at step s. */
export function rankSlice(samples: number, W: number, B: number, step: number, rank: number): { start: number; count: number } {
  const base = step * W * B;
  const R = Math.max(0, Math.min(W * B, samples - base));
  const q = Math.floor(R / W),
    rem = R % W;
  return { start: base + rank * q + Math.min(rank, rem), count: q + (rank < rem ? 1 : 0) };
}

/** Sample ids of one epoch in training order (a seeded permutation of `ids`). */
export function epochIds(ids: Uint32Array, seed: number, epoch: number): Uint32Array {
  const order = epochOrder(ids.length, seed, epoch, true);
  const out = new Uint32Array(ids.length);
  for (let i = 0; i < ids.length; i++) out[i] = ids[order[i]!]!;
  return out;
}
