// Token windows for GPT tests: a seeded stream of `windows` (context + 1)-token windows over a
// vocabulary of V, served as (inputs, targets) batches of n windows from window `from` on.
import { Rng } from "../../engine/rng.ts";
import type { HostBatch } from "../../engine/train.ts";

export function tokenWindows(o: {
  V: number;
  T: number;
  seed: number;
  windows: number;
}): (from: number, n: number) => HostBatch {
  const { V, T, windows } = o;
  const rng = new Rng(o.seed);
  const stream = Int32Array.from({ length: (windows + 10) * (T + 1) }, () => rng.int(V));
  return (from, n) => {
    const inputs = new Int32Array(n * T),
      targets = new Int32Array(n * T);
    for (let w = 0; w < n; w++) {
      const at = ((from + w) % windows) * (T + 1);
      inputs.set(stream.subarray(at, at + T), w * T);
      targets.set(stream.subarray(at + 1, at + T + 1), w * T);
    }
    return { inputs, inputShape: [n, T], targets, targetShape: [n, T] };
  };
}
