// Seeded sample orders. Each epoch gets its own permutation from (seed, epoch), so a run can
// resume mid-epoch by recomputing the order and skipping what it already consumed.
import { ConfigError } from "../../ffi/errors.ts";
import { Rng } from "../rng.ts";

export function epochOrder(count: number, seed: number, epoch: number, shuffle = true): Uint32Array {
  const order = new Uint32Array(count);
  for (let i = 0; i < count; i++) order[i] = i;
  if (shuffle) new Rng((seed * 0x9e3779b1 + epoch * 0x85ebca6b) >>> 0).shuffle(order);
  return order;
}

/** The last split made: a data-loader makes the same one for every plan request of a job (a
 *  shuffle and two sorts of the whole data set each time) */
let lastSplit: { key: string; train: Uint32Array; val: Uint32Array } | null = null;

/**
 * A seeded split of sample ids 0..count-1 into train and validation sets (each sorted).
 * The same (count, valFraction, seed) always gives the same split.
 */
export function trainValSplit(
  count: number,
  valFraction: number,
  seed: number,
): { train: Uint32Array; val: Uint32Array } {
  if (!(valFraction >= 0 && valFraction < 1))
    throw new ConfigError(`valFraction must be in [0, 1), got ${valFraction}`);
  const key = `${count}:${valFraction}:${seed}`;
  if (lastSplit?.key !== key) {
    const valCount = Math.round(count * valFraction);
    const order = epochOrder(count, seed ^ 0x5eed, 0, true);
    lastSplit = { key, val: order.slice(0, valCount).sort(), train: order.slice(valCount).sort() };
  }
  // copies: the caller owns what it gets
  return { train: lastSplit.train.slice(), val: lastSplit.val.slice() };
}
