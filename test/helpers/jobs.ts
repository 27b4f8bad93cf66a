// Helpers of the job tests: a job's spec with its plan, a model file's accuracy evaluated in
// this process, and each rank's effective step history from a job's events.
import { ImageBatcher } from "../../engine/data/images.ts";
import { loadMnist } from "../../engine/data/mnist.ts";
import { loadSlabInto, readModelFile } from "../../engine/modelfile.ts";
import { MlpModel } from "../../engine/models/mlp.ts";
import { Context } from "../../engine/context.ts";
import { evaluate } from "../../engine/train.ts";
import { CpuBackend } from "../../ffi/cpu/backend.ts";
import { join } from "node:path";
import { decodeShardState } from "../../schemas/messages/parameter-server.ts";
import { type Event, EventKind, type JobRecord, type JobSpec } from "../../schemas/messages/job.ts";
import { CheckpointStore } from "../../services/checkpoint/store.ts";
import { specOfConfig } from "../../sdk/client.ts";
import { planHere } from "../../services/data-loader/loader.ts";
import type { JobConfig } from "../../services/runtime/job/config.ts";

/** What buildModel needs of an image job's plan (no vocabulary). */
export const imagePlan = { vocabSize: 0, vocab: [] as number[] };

/** The spec a client submits for `cfg`, with the plan its data set gives (read here). */
export function specOf(cfg: JobConfig, over: Partial<JobSpec> = {}): JobSpec {
  return { ...specOfConfig(cfg), ...over, plan: over.plan ?? planHere(cfg) };
}

/** The test accuracy of a model file, evaluated in this process with the job's GEMM precision. */
export function modelFileAccuracy(path: string, precision: JobConfig["precision"] = "f32"): number {
  const loaded = readModelFile(path);
  const ctx = new Context(new CpuBackend(), { seed: 0, precision });
  try {
    const model = new MlpModel(ctx, loaded.header.config as ConstructorParameters<typeof MlpModel>[1], 0);
    loadSlabInto(path, model.store, loaded);
    return evaluate(ctx, model, new ImageBatcher(loadMnist().test, 1000).epoch(0, 0, false, false)).accuracy;
  } finally {
    ctx.dispose();
  }
}

/** Each rank's steps as they stand at the end: a restore to T discards the steps >= T run before it. */
export function effectiveSteps(events: readonly Event[], trainers: number): number[][] {
  const steps: number[][] = Array.from({ length: trainers }, () => []);
  for (const e of events) {
    if (e.kind === EventKind.Restore) for (const r of steps) r.splice(0, r.length, ...r.filter((s) => s < e.step));
    if (e.kind === EventKind.Step) steps[e.rank]!.push(e.step);
  }
  return steps;
}

/**
 * The parameter-server chunks' versions in a job's final snapshot, by shard file (ps-<k>): under
 * BSP each step updates every chunk once, so every version counts the steps applied.
 */
export function finalChunkVersions(record: Pick<JobRecord, "job" | "snapshot" | "snapshotDir">): Map<string, number[]> {
  const snap = new CheckpointStore(join(record.snapshotDir, "..")).read(record.job, record.snapshot);
  return new Map(
    [...snap.files.entries()]
      .filter(([name]) => name.startsWith("ps-"))
      .map(([name, bytes]) => [name, decodeShardState(bytes, 1 << 30).chunks.map((c) => c.version)]),
  );
}

/** The `n` longest waits between two of rank 0's Step events of a job: where a slow run stalled. */
export function longestWaits(events: readonly Event[], n = 1): string {
  const steps = events.filter((e) => e.kind === EventKind.Step && e.rank === 0);
  const waits: { ms: number; step: number }[] = [];
  for (let i = 1; i < steps.length; i++)
    waits.push({ ms: steps[i]!.timeMs - steps[i - 1]!.timeMs, step: steps[i]!.step });
  waits.sort((a, b) => b.ms - a.ms);
  return waits
    .slice(0, n)
    .map((w) => `${(w.ms / 1000).toFixed(1)} s before step ${w.step}`)
    .join(", ");
}
