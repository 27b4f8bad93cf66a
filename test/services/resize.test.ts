// The control plane's resize (services/runtime/control/resize.ts) without a mesh: what it refuses
// before anything stops, and a pause that fails leaves the job as it was. A resize on a real
// mesh, trainers and shards joining and leaving: test/e2e/elastic.test.ts.
import { describe, expect, test } from "bun:test";
import type { DataPlan, Manifest } from "../../schemas/messages.ts";
import { resizeJob, type ResizeHost } from "../../services/runtime/control/resize.ts";
import { MemoryBus } from "../../services/runtime/mesh/bus.ts";
import { BadRequestError, JobStateError, NotReadyError } from "../../services/runtime/mesh/errors.ts";
import { type JobConfig, jobDefaults, parseJobConfig } from "../../services/runtime/job/job.ts";
import type { JobControl } from "../../services/runtime/job/jobs.ts";
import { expectRejected } from "../helpers/errors.ts";

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
