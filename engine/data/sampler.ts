// Seeded sample orders. Each epoch gets its own permutation from (seed, epoch), so a run can
// resume mid-epoch by recomputing the order and skipping what it already consumed.
import { Rng } from "../rng.ts";

export function epochOrder(count: number, seed: number, epoch: number, shuffle = true): Uint32Array {
  const order = new Uint32Array(count);
  for (let i = 0; i < count; i++) order[i] = i;
  if (shuffle) new Rng((seed * 0x9e3779b1 + epoch * 0x85ebca6b) >>> 0).shuffle(order);
  return order;
}
