// The control plane's resize (services/runtime/control/resize.ts) without a mesh: what it refuses
// before anything stops, and a pause that fails leaves the job as it was. A resize on a real
// mesh, trainers and shards joining and leaving: test/e2e/elastic.test.ts.
import { describe, expect, test } from "bun:test";
import { type DataPlan, encodeDataPlan } from "../../schemas/messages/data-loader.ts";
import { type JobSpec } from "../../schemas/messages/job.ts";
import { type Manifest } from "../../schemas/messages/checkpoint.ts";
import { keptBatch, resizeJob, type ResizeHost, shrinkWithout } from "../../services/runtime/control/resize.ts";
import { rankSlice } from "../../services/data-loader/sampler.ts";
import { MemoryBus } from "../../services/runtime/mesh/bus.ts";
import { BadRequestError, JobStateError, NotReadyError } from "../../services/runtime/mesh/errors.ts";
import {
  configOfSpec,
  gptJobDefaults,
  type JobConfig,
  jobDefaults,
  parseJobConfig,
  peakLr,
} from "../../services/runtime/job/config.ts";
import { trajectoryDiff } from "../../services/runtime/job/resume.ts";
import { StepSchedule, worldProblems } from "../../services/runtime/job/world.ts";
import type { JobControl } from "../../services/runtime/job/ledger.ts";
import { expectRejected } from "../helpers/errors.ts";

const plan = (totalSteps: number): DataPlan => ({
  job: "default.shrink",
  trainSamples: 60000,
  valSamples: 0,
  testSamples: 10000,
  stepsPerEpoch: totalSteps,
  totalSteps,
  vocabSize: 0,
  vocab: [],
  slabNumel: 64,
  decayElems: 0,
  paramCount: 64,
  tokenizer: "",
});
const limits = { snapshotWaitMs: 50, closeWaitMs: 50, planTimeoutMs: 50 };
const cfg = (over: Partial<JobConfig> = {}) =>
  parseJobConfig({ ...jobDefaults, job: "default.grow", trainers: 2, shards: 2, ...over });

/** A host whose job record answers pause and resume as given, counting the calls. */
function host(control: Partial<JobControl> | undefined, current = () => true) {
  const calls: string[] = [];
  const h: ResizeHost = {
    bus: new MemoryBus(),
    control:
      control === undefined
        ? undefined
        : ({
            ...control,
            pause: control.pause && ((...a) => (calls.push("pause"), control.pause!(...a))),
            resume: control.resume && ((...a) => (calls.push("resume"), control.resume!(...a))),
          } as JobControl),
    log: undefined,
    attempt: 1,
    plan: { totalSteps: 100 } as DataPlan,
    newestStep: () => 10,
    current,
    stopSaves: async () => void calls.push("stopSaves"),
    written: async () => {},
    resumable: () => ({ step: 10, id: "step-000000010" }) as Manifest,
    note: () => {},
  };
  return { h, calls };
}

describe("resize refuses before anything stops", () => {
  const records = { pause: async () => true, resume: async () => null };
  test.each([
    ["a tag that names no sizes", cfg(), "trainers 3", BadRequestError, 'names its sizes as "trainers <n> shards <m>"'],
    [
      "the sizes it runs already",
      cfg(),
      "trainers 2 shards 2",
      BadRequestError,
      "runs 2 trainers and 2 shards already",
    ],
    [
      "shards of an all-reduce job",
      cfg({ sync: "allreduce" }),
      "trainers 2 shards 3",
      BadRequestError,
      "has no shards",
    ],
  ] as const)("%s", async (_, c, tag, cls, text) => {
    const { h, calls } = host(records);
    await expectRejected(() => resizeJob(c, tag, h, limits), cls, text);
    expect(calls).toEqual([]);
  });

  test("sizes that make no job (0 trainers): the job config's own error", async () => {
    const { h, calls } = host(records);
    await expect(resizeJob(cfg(), "trainers 0 shards 2", h, limits)).rejects.toThrow();
    expect(calls).toEqual([]);
  });

  test("a service that keeps no job records cannot pause a job", async () => {
    const { h } = host(undefined);
    await expectRejected(
      () => resizeJob(cfg(), "trainers 3 shards 2", h, limits),
      NotReadyError,
      "keeps no job records",
    );
  });

  test("a job that ended while the snapshot was awaited is left alone", async () => {
    const { h, calls } = host(records, () => false);
    await expectRejected(
      () => resizeJob(cfg(), "trainers 3 shards 2", h, limits),
      JobStateError,
      "ended or was reopened",
    );
    expect(calls).toEqual([]);
  });

  test("a pause the record refuses (another submission runs): nothing resumed", async () => {
    const { h, calls } = host({ pause: async () => false, resume: async () => null });
    await expectRejected(
      () => resizeJob(cfg(), "trainers 3 shards 2", h, limits),
      JobStateError,
      "not running as submission 1",
    );
    expect(calls).toEqual(["stopSaves", "pause"]);
  });

  test("a failure after the pause (a service does not close the job) resumes it as it was", async () => {
    const { h, calls } = host(records);
    // a trainer still answers its stats subject: the job is not closed there
    h.bus.handle("mt.default.grow.trainer.0.stats", async () => new Uint8Array(0));
    await expect(resizeJob(cfg(), "trainers 3 shards 2", h, limits)).rejects.toThrow("still run job default.grow");
    expect(calls).toEqual(["stopSaves", "pause", "resume"]);
  });
});

describe("going on without a lost host", () => {
  const four = (over: Partial<JobConfig> = {}) => cfg({ job: "default.shrink", trainers: 4, shards: 2, ...over });

  test.each([
    ["its trainers and shard are the highest", four(), ["shard 1", "trainer 2", "trainer 3"], "trainers 2 shards 1"],
    ["trainers only", four(), ["trainer 3"], "trainers 3 shards 2"],
    [
      "an all-reduce job's trainers (no shards)",
      four({ sync: "allreduce" }),
      ["trainer 2", "trainer 3"],
      "trainers 2 shards 2",
    ],
  ] as const)("%s: a resize to the others", (_, c, who, tag) => {
    const plan = shrinkWithout(c, "host-2", who);
    expect("tag" in plan && plan.tag).toBe(tag);
  });

  test.each([
    ["the data-loader", four(), ["data-loader", "trainer 3"], "runs the data-loader"],
    ["trainer 0 (a rank is its process's identity)", four(), ["trainer 0", "trainer 1"], "runs trainer 0, trainer 1"],
    ["shard 0 while shard 1 lives", four(), ["shard 0", "trainer 3"], "runs shard 0"],
    ["every trainer", four({ trainers: 2 }), ["trainer 0", "trainer 1"], "runs every trainer"],
    ["every shard", four({ shards: 1 }), ["shard 0", "trainer 3"], "runs every shard"],
    [
      "a model-parallel job",
      parseJobConfig({ ...gptJobDefaults, job: "default.mp", trainers: 4, sync: "allreduce", pipelineStages: 2 }),
      ["trainer 3"],
      "model-parallel",
    ],
    ["none of the job's ranks", four(), ["shard 5", "trainer 9"], "runs none of the job's ranks"],
  ] as const)("refused where the host runs %s, saying the job waits", (_, c, who, text) => {
    const plan = shrinkWithout(c, "host-2", who);
    expect("refused" in plan && plan.refused).toContain(text);
    if ("refused" in plan && !/none of/.test(plan.refused))
      expect(plan.refused).toEndWith("the job waits for the host");
  });

  test("the global batch is kept where it splits into whole micro-batches", () => {
    expect(keptBatch(four(), 2)).toEqual({ batchSize: 256, accumSteps: 2 });
    expect(keptBatch(four({ batchSize: 128, accumSteps: 2 }), 2)).toEqual({ batchSize: 256, accumSteps: 4 });
    expect(keptBatch(four(), 3)).toBeNull(); // 512 samples over 3 trainers
    // 4 x 96 = 384 over 3: 128 each, not a whole number of micro-batches of 96
    expect(keptBatch(four({ batchSize: 96, accumSteps: 1 }), 3)).toBeNull();
    expect(keptBatch(four({ batchSize: 96, accumSteps: 3 }), 3)).toEqual({ batchSize: 128, accumSteps: 4 });
  });

  test("the resize asks for no snapshot, does not wait for the lost ranks, and keeps the global batch in the world", async () => {
    let spec: JobSpec | null = null;
    const { h, calls } = host({
      pause: async () => true,
      resume: async (s) => ((spec = s), {} as never),
    });
    const published: string[] = [];
    const publish = h.bus.publish.bind(h.bus);
    h.bus.publish = (subject, data) => (published.push(subject), publish(subject, data));
    // the lost ranks never answer; the others have closed the job
    for (const who of ["trainer.2.stats", "trainer.3.stats", "ps.1.stats"])
      h.bus.handle(`mt.default.shrink.${who}`, () => new Promise<Uint8Array>(() => {}));
    h.bus.handle("mt.ctl.plan", async () => encodeDataPlan(plan(118)));
    const manifest = await resizeJob(four(), "trainers 2 shards 1", h, limits, { trainers: [2, 3], shards: [1] });
    expect(manifest.step).toBe(10);
    expect(published.filter((s) => s.endsWith("checkpoint.now"))).toEqual([]);
    expect(calls).toEqual(["stopSaves", "pause", "resume"]);
    const next = configOfSpec(spec!);
    expect({
      trainers: next.trainers,
      shards: next.shards,
      batchSize: next.batchSize,
      accumSteps: next.accumSteps,
    }).toEqual({
      trainers: 2,
      shards: 1,
      batchSize: 256,
      accumSteps: 2,
    });
    expect(next.world).toEqual([
      { from: 0, trainers: 4, batchSize: 128 },
      { from: 10, trainers: 2, batchSize: 256 },
    ]);
    // the same trajectory: another number of trainers and their batch from the resize on, nothing else
    expect(trajectoryDiff(four(), next)).toEqual([]);
    expect(peakLr({ ...next, scaleLr: true })).toBe(peakLr({ ...four(), scaleLr: true }));
  });
});

describe("a world whose changes say their batch", () => {
  test("the steps take trainers x batch samples each, so a kept global batch keeps every step's samples", () => {
    const before = new StepSchedule(1000, 128, [{ from: 0, trainers: 4 }], 2);
    const after = new StepSchedule(
      1000,
      256,
      [
        { from: 0, trainers: 4, batchSize: 128 },
        { from: 1, trainers: 2, batchSize: 256 },
      ],
      2,
    );
    expect(after.totalSteps).toBe(before.totalSteps);
    for (let s = 0; s < before.totalSteps; s++) {
      const [a, b] = [before.at(s), after.at(s)];
      expect([b.cursor, b.rows, b.epoch]).toEqual([a.cursor, a.rows, a.epoch]);
    }
    expect(rankSlice(after.at(1), 1)).toEqual({ start: 512 + 244, count: 244 }); // the epoch's last 488, split evenly
  });

  test("a world that says some batches and not others, or ends on another batch than the job's, is refused", () => {
    expect(
      worldProblems(
        [
          { from: 0, trainers: 4, batchSize: 128 },
          { from: 5, trainers: 2 },
        ],
        2,
        256,
      ),
    ).toEqual(["some of the world's changes say their batch, and some do not"]);
    expect(
      worldProblems(
        [
          { from: 0, trainers: 4, batchSize: 128 },
          { from: 5, trainers: 2, batchSize: 256 },
        ],
        2,
        128,
      ),
    ).toEqual(["the world ends with batches of 256, the job's are 128"]);
    expect(() =>
      parseJobConfig({
        ...jobDefaults,
        job: "default.w",
        trainers: 2,
        world: [
          { from: 0, trainers: 4, batchSize: 128 },
          { from: 5, trainers: 2, batchSize: 256 },
        ],
      }),
    ).toThrow("the world ends with batches of 256, the job's are 128");
  });
});
