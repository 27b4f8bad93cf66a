// Model-parallel GPT jobs on the whole mesh (a real nats-server, every service and trainer a
// process): pipeline x tensor and data x pipeline layouts of 4 trainers repeat the plain
// all-reduce job's losses step by step, snapshot in the whole model's layout (exported as a
// model file that `eval` reads), and a stage SIGKILLed mid-run restores and finishes on the
// same trajectory.
import { afterAll, describe, expect, test } from "bun:test";
import { type Event, EventKind, JobState } from "../../schemas/messages/job.ts";
import { type JobConfig, gptJobDefaults, parseJobConfig } from "../../services/runtime/job/config.ts";
import { MeshClient } from "../../sdk/client.ts";
import { watchJob } from "../../sdk/watch.ts";
import { removeTempDirs } from "../helpers/mesh.ts";
import { runJob, startMesh, stepLosses } from "../helpers/mesh-jobs.ts";

afterAll(removeTempDirs);

/** Steps of every job: a snapshot every 6, a validation pass every 12. */
const steps = 24;

const config = (over: Partial<JobConfig>): JobConfig =>
  parseJobConfig({
    ...gptJobDefaults,
    sync: "allreduce",
    model: { kind: "gpt", blockSize: 32, nLayer: 4, nHead: 4, nEmbd: 64, dropout: 0, vocabSize: 0 },
    batchSize: 16,
    accumSteps: 4,
    maxSteps: steps,
    evalEvery: 12,
    // validation over 8 micro-batches, not the whole split (that took 4 s to 11 s a pass)
    evalBatches: 8,
    checkpointEvery: 6,
    warmupSteps: 6,
    replicaCheckEvery: 12,
    chunkBytes: 16 << 10,
    ...over,
  });

/** Each step's loss over every copy's rows, in step order, as the run ends (a restore drops what it rewound). */
function losses(events: readonly Event[]): number[] {
  return [...stepLosses(events)].sort((a, b) => a[0] - b[0]).map(([, loss]) => loss);
}

const relDiff = (a: number, b: number) => Math.abs(a - b) / Math.max(Math.abs(b), 1e-30);

describe("model-parallel jobs on the mesh", () => {
  test("1 trainer, 1x2x2 (pipeline x tensor) and 2x2x1 (data x pipeline) on 4 trainers: the same losses step by step and the same validation; a stage killed mid-run restores and finishes alike; a snapshot resumes in another layout", async () => {
    await using mesh = await startMesh("mt-mp-", { trainers: 4, shards: 0 });
    await using client = await MeshClient.connect(mesh.url, mesh.auth());
    const run = async (cfg: JobConfig, onEvent?: (e: Event) => void) => {
      const { record, seen } = await runJob(client, cfg, onEvent);
      expect(record.state).toBe(JobState.Done);
      return { record, seen, losses: losses(seen) };
    };
    // the global batch: 16 windows a step in 4 micro-batches, on one copy or two of 8
    const plain = await run(config({ job: "default.mp-plain", trainers: 1 }));
    const pt = await run(config({ job: "default.mp-pt", trainers: 4, pipelineStages: 2, tensorParallel: 2 }));
    const dp = await run(
      config({
        job: "default.mp-dp",
        trainers: 4,
        pipelineStages: 2,
        batchSize: 8,
        accumSteps: 2,
        pipeSchedule: "gpipe",
      }),
    );
    let killed = false;
    const chaos = await run(
      config({ job: "default.mp-kill", trainers: 4, pipelineStages: 2, tensorParallel: 2 }),
      (e) => {
        if (!killed && e.kind === EventKind.Step && e.step >= 9) {
          killed = true;
          mesh.kill("trainer-2"); // stage 1, tensor rank 0: the rank that speaks for the copy
        }
      },
    );
    // a snapshot of 1x2x2 resumed as 1x4x1: the whole model's layout restores into any cut
    const relayout = config({ job: "default.mp-relayout", trainers: 4, pipelineStages: 2, tensorParallel: 2 });
    await client.submit(relayout, { membersWaitMs: 60_000 });
    let cancelled: Promise<unknown> | null = null;
    const firstPart: Event[] = [];
    await watchJob(client, relayout.job, {
      quiet: true,
      onEvent: (e) => {
        firstPart.push(e);
        if (cancelled === null && e.kind === EventKind.Checkpoint && e.step >= 12)
          cancelled = client.cancel(relayout.job);
      },
    }).catch(() => {});
    await cancelled;
    const resumed = await run({ ...relayout, pipelineStages: 4, tensorParallel: 1 });
    const restoredAt = resumed.seen.find((e) => e.kind === EventKind.Restore)!.step;
    expect(restoredAt).toBeGreaterThanOrEqual(12);
    const stitched = [...losses(firstPart).slice(0, restoredAt), ...losses(resumed.seen)]; // the resumed run's steps start at its restore
    expect(plain.losses.length).toBe(steps);
    for (const [name, r] of [
      ["1x2x2", pt],
      ["2x2x1", dp],
      ["1x2x2 with a SIGKILL", chaos],
      ["1x2x2, resumed as 1x4x1", { ...resumed, losses: stitched }],
    ] as const) {
      expect(r.losses.length).toBe(steps);
      const worst = Math.max(...r.losses.map((l, i) => relDiff(l, plain.losses[i]!)));
      console.log(
        `${name}: worst relative loss difference to 1 trainer over ${steps} steps ${worst.toExponential(2)}; val loss ${r.record.loss.toFixed(5)} ` +
          `(1 trainer ${plain.record.loss.toFixed(5)}); restores ${r.seen.filter((e) => e.kind === EventKind.Restore).length}`,
      );
      expect(worst).toBeLessThan(1e-4);
      expect(relDiff(r.record.loss, plain.record.loss)).toBeLessThan(1e-4);
      expect(r.seen.some((e) => e.kind === EventKind.Failed)).toBe(false);
      expect(r.record.modelPath).not.toBe("");
    }
    expect(plain.losses.at(-1)!).toBeLessThan(plain.losses[0]! - 0.5);
    // one rank of each copy speaks for it: Step events of rank 0 (one copy) or 0 and 1 (two), once a step
    const speakers = (r: { seen: Event[] }) =>
      r.seen.filter((e) => e.kind === EventKind.Step).map((e) => `${e.rank}@${e.step}`);
    expect(speakers(pt)).toEqual(Array.from({ length: steps }, (_, s) => `0@${s}`));
    expect(new Set(speakers(dp)).size).toBe(2 * steps);
    expect(new Set(dp.seen.filter((e) => e.kind === EventKind.Step).map((e) => e.rank))).toEqual(new Set([0, 1]));
    expect(chaos.seen.filter((e) => e.kind === EventKind.Restore).length).toBeGreaterThan(0);
    // the snapshot is the whole model's: every rank of the first copy served its share
    const snap = (await client.checkpoints("mp-pt")).at(-1)!;
    const ranks = new Set(snap.files.map((f) => /^partition-(\d+)-\d+\.mtss$/.exec(f.name)?.[1]));
    expect([...ranks].sort()).toEqual(["0", "1", "2", "3"]);
  }, 600_000);
});
