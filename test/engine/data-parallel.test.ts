// engine/parallel/data-parallel.ts without a mesh: N ranks in one process over in-memory rings
// (inProcessRings), against one process that trains on the whole batch (TrainStep), at every
// ZeRO stage, with compression and with offload. The trainer service's replicas over NATS:
// test/services/replica.test.ts, zero.test.ts, offload.test.ts.
import { describe, expect, test } from "bun:test";
import { type DataParallelOptions, DataParallel } from "../../engine/parallel/data-parallel.ts";
import { inProcessRings } from "../../engine/parallel/ring.ts";
import { Context } from "../../engine/context.ts";
import { CpuBackend } from "../../ffi/cpu/backend.ts";
import { batch, dpOptions, lr, singleProcess } from "./fixtures/dp-batches.ts";

/** `steps` steps of `ranks` data-parallel ranks (rank r takes rows [r*b, (r+1)*b) of each step's batch) against one process
 *  with the whole batch: the worst relative difference in loss and norm, or absolute in the final parameters. */
async function compare(
  ranks: number,
  over: Partial<DataParallelOptions>,
  steps: number,
): Promise<{ worst: number; identical: boolean }> {
  const b = 6;
  const rings = inProcessRings(ranks, { progressTimeoutMs: 5_000 }, 256);
  const ctxs = rings.map(() => new Context(new CpuBackend(), { seed: 0 }));
  const dps = rings.map((ring, rank) => new DataParallel(dpOptions(ctxs[rank]!, rank, ranks, ring, over)));
  const ctx = new Context(new CpuBackend(), { seed: 0 });
  const { model: single, train } = singleProcess(ctx);
  let worst = 0;
  try {
    for (let s = 0; s < steps; s++) {
      const whole = train.run([batch(s * ranks * b, ranks * b)]);
      // rank r's rows, in accumSteps equal micro-batches
      const k = over.accumSteps ?? 1;
      const micro = (r: number) =>
        Array.from({ length: k }, (_, j) => batch(s * ranks * b + r * b + (j * b) / k, b / k));
      const results = await Promise.all(dps.map((dp, r) => dp.step(s, micro(r), b, ranks * b, lr)));
      const loss = results.reduce((sum, x) => sum + x.loss, 0) / ranks;
      worst = Math.max(
        worst,
        Math.abs(loss - whole.loss) / Math.abs(whole.loss),
        Math.abs(results[0]!.gradNorm - whole.gradNorm) / whole.gradNorm,
      );
      for (const x of results) expect(x.gradNorm).toBe(results[0]!.gradNorm);
    }
    const values = await Promise.all(dps.map((dp) => dp.readValues(steps)));
    const ref = single.store.readValues();
    for (let i = 0; i < ref.length; i++) worst = Math.max(worst, Math.abs(values[0]![i]! - ref[i]!));
    const identical = values.every((v) => Buffer.from(v.buffer).equals(Buffer.from(values[0]!.buffer)));
    return { worst, identical };
  } finally {
    for (const dp of dps) dp.dispose();
    for (const r of rings) r.close("done");
    for (const c of [...ctxs, ctx]) c.dispose();
  }
}

describe("data parallelism in one process", () => {
  test.each([
    ["ZeRO 0", { zero: 0 }],
    ["ZeRO 1", { zero: 1 }],
    ["ZeRO 2", { zero: 2 }],
    ["ZeRO 3", { zero: 3 }],
    ["offload", { offload: true }],
    ["ZeRO 2 with offload", { zero: 2, offload: true }],
    ["ZeRO 0, 2 micro-batches", { accumSteps: 2 }],
    ["ZeRO 1, 2 micro-batches", { zero: 1, accumSteps: 2 }],
    ["ZeRO 2, 3 micro-batches", { zero: 2, accumSteps: 3 }],
    ["ZeRO 3, 2 micro-batches", { zero: 3, accumSteps: 2 }],
  ] as [string, Partial<DataParallelOptions>][])(
    "%s: 3 ranks follow one process with the whole batch for 8 steps (<= 1e-4); the replicas agree bit for bit",
    async (_, over) => {
      const { worst, identical } = await compare(3, over, 8);
      expect(worst).toBeLessThanOrEqual(1e-4);
      expect(identical).toBe(true);
    },
  );

  test("fp16 compression with error feedback stays close to the exact step; the replicas agree bit for bit", async () => {
    const { worst, identical } = await compare(2, { compress: "fp16" }, 8);
    expect(worst).toBeLessThanOrEqual(2e-3);
    expect(identical).toBe(true);
  });
});
