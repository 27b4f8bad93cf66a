// Jobs on one long-running local mesh (3 trainers, 3 shards, each service limited to 2 jobs at
// once), as `meshtrain mesh up` runs it: any N of ranks runs, a job the mesh cannot run is
// refused or fails at once with the reason, every client request about a job ends with an
// answer, a job ends exactly once and is closed everywhere (also after every service restarts),
// a cancelled job resumes from its snapshots, and more jobs than any limit run one after another
// with flat memory.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { copyFileSync, existsSync, readFileSync, truncateSync } from "node:fs";
import { join } from "node:path";
import { defaultMnistDir } from "../../engine/data/mnist.ts";
import { readModelFile } from "../../engine/modelfile.ts";
import { encodeJobRequest, type Event, EventKind, JobState, SyncPolicy } from "../../schemas/messages/job.ts";
import { CapacityError, JobStateError, UnknownJobError } from "../../services/runtime/mesh/errors.ts";
import { ConfigError } from "../../ffi/errors.ts";
import { defaultOwner, subjects, qualifyJob } from "../../services/runtime/job/subjects.ts";
import { type JobConfig, jobConfigFromJson, jobDefaults, parseJobConfig } from "../../services/runtime/job/config.ts";
import { runningRecord } from "../../services/runtime/job/ledger.ts";
import { MeshClient } from "../../sdk/client.ts";
import { LocalMesh } from "../../sdk/local-mesh.ts";
import { JobFailedError, watchJob } from "../../sdk/watch.ts";
import { expectRejected } from "../helpers/errors.ts";
import { removeTempDirs, tempDir, waitFor } from "../helpers/mesh.ts";

let mesh: LocalMesh;
let client: MeshClient;
let dir: string;

/** 3 x 1000 samples per step: 20 steps an epoch. */
const small = (job: string, over: Partial<JobConfig> = {}): JobConfig =>
  parseJobConfig({
    ...jobDefaults,
    job: qualifyJob(job, defaultOwner),
    model: { kind: "mlp", widths: [784, 32, 10], dropout: 0 },
    trainers: 3,
    shards: 3,
    batchSize: 1000,
    epochs: 1,
    warmupSteps: 5,
    checkpointEvery: 10,
    chunkBytes: 16 << 10,
    ...over,
  });
const stepsPerEpoch = 20;

beforeAll(async () => {
  dir = tempDir("mt-life-");
  mesh = await LocalMesh.start({
    jobsDir: join(dir, "jobs"),
    logDir: join(dir, "logs"),
    jobLogs: true,
    trainers: 3,
    shards: 3,
    env: { MT_JOBS_MAX: "2" },
  });
  client = await MeshClient.connect(mesh.url, mesh.auth());
  await client.waitForMembers({ job: "default.any", trainers: 3, shards: 3 }, 60_000);
}, 90_000);

afterAll(async () => {
  await client?.close();
  await mesh?.stop();
  removeTempDirs();
});

/** Follows a job to its end, keeping its events; the failure of a failed or cancelled job is
 *  returned, not thrown. `stream`: its events, subscribed to before the submit (a resumed job's
 *  Restore can come before a watch started after the submit would). */
async function follow(job: string, onEvent?: (e: Event) => void, stream?: AsyncIterableIterator<Event>) {
  const events: Event[] = [];
  try {
    const o = await watchJob(client, job, {
      quiet: true,
      ...(stream === undefined ? {} : { events: stream }),
      onEvent: (e) => (events.push(e), onEvent?.(e)),
    });
    return { record: o.record, events, error: null };
  } catch (e) {
    if (!(e instanceof JobFailedError)) throw e;
    return { record: e.record!, events, error: e };
  }
}

const rssKb = (pid: number) => Number(/VmRSS:\s+(\d+)/.exec(readFileSync(`/proc/${pid}/status`, "utf8"))![1]);

describe("jobs on one long-running mesh", () => {
  test("a job on 3 trainers and 3 shards runs to the end; its record, final snapshot, model file and per-job logs are where it says", async () => {
    await client.submit(small("three"));
    const { record, events } = await follow("three");
    expect(record.state).toBe(JobState.Done);
    expect([record.totalSteps, record.evalStep, record.evaluated, record.attempts]).toEqual([
      stepsPerEpoch,
      stepsPerEpoch,
      10_000,
      1,
    ]);
    expect(record.accuracy).toBeGreaterThan(0.8);
    expect(new Set(events.filter((e) => e.kind === EventKind.Step).map((e) => e.rank))).toEqual(new Set([0, 1, 2]));
    expect(events.filter((e) => e.kind === EventKind.Ended)).toHaveLength(1);
    expect(record.snapshotDir).toBe(join(dir, "jobs", "default.three"));
    expect(readModelFile(record.modelPath).header.step).toBe(stepsPerEpoch);
    for (const s of ["data-loader", "parameter-server-2", "trainer-2", "checkpoint"])
      expect(existsSync(join(record.snapshotDir, "logs", `${s}.log`))).toBe(true);
    // closed everywhere (each service hears of the deleted spec on its own): no service answers for it any more
    const closed = (subject: string) =>
      client.bus.request(subject, encodeJobRequest({ job: "default.three", step: 0, tag: "" }), 5000).then(
        () => false,
        (e: unknown) => e instanceof UnknownJobError,
      );
    await waitFor(
      "the loader and the shards to close the job",
      async () =>
        (await closed(subjects.dataPlan("default.three"))) && (await closed(subjects.psStats("default.three", 2))),
      10_000,
    );
    // a finished job is not run again under its name
    await expect(client.submit(small("three"))).rejects.toThrow("job default.three done at");
  }, 120_000);

  test("a job that needs more ranks than the mesh runs is refused at once, naming them; nothing is stored", async () => {
    const e = await client.submit(small("too-big", { trainers: 4, shards: 5 })).catch((x: unknown) => x);
    expect(e).toBeInstanceOf(CapacityError);
    expect((e as Error).message).toContain("needs trainer rank 3, parameter-server shards 3-4");
    expect((e as Error).message).toContain("meshtrain mesh up --trainers 4 --shards 5");
    expect((await client.list()).map((r) => r.job)).not.toContain("default.too-big");
    expect(await client.jobs.spec("default.too-big")).toBeNull();
  });

  test.each([
    [
      "a folder that does not exist",
      () => "/nonexistent-mnist",
      "/nonexistent-mnist/train-images-idx3-ubyte: file not found",
    ],
    [
      "a truncated idx file",
      () => {
        const d = tempDir("mt-trunc-");
        for (const f of [
          "train-images-idx3-ubyte",
          "train-labels-idx1-ubyte",
          "t10k-images-idx3-ubyte",
          "t10k-labels-idx1-ubyte",
        ])
          copyFileSync(join(defaultMnistDir(), f), join(d, f));
        truncateSync(join(d, "train-images-idx3-ubyte"), 5000);
        return d;
      },
      "train-images-idx3-ubyte",
    ],
    // "at once": within the test's limit, not after the trainers' 5-minute wait for a job to start
  ])(
    "data the loader cannot read (%s): the submission is refused with the loader's reason; a spec written past it fails the job at once",
    async (_, dataDir, fragment) => {
      const job = `default.bad-data-${Date.now()}`;
      const cfg = small(job, { dataDir: dataDir() });
      // the plan is made at submission, by the data-loader: its refusal is the submission's, and no job is left behind
      await expectRejected(() => client.submit(cfg), ConfigError, `the data-loader cannot plan job ${job}`, fragment);
      expect(await client.jobs.record(job)).toBeNull();
      // a script that writes the spec itself, with a plan made for readable data: the loader fails the job
      await client.jobs.createRecord(runningRecord(job, JSON.stringify(cfg), 1));
      await client.jobs.putSpec({
        job,
        trainers: 3,
        shards: 3,
        sync: SyncPolicy.BSP,
        staleness: 0,
        configJson: JSON.stringify(cfg),
        attempt: 1,
        plan: await client.plan(small(job)),
      });
      const { record, error } = await follow(job);
      expect(record.state).toBe(JobState.Failed);
      expect(record.reason).toContain(`data-loader cannot open job ${job}`);
      expect(record.reason).toContain(fragment);
      expect(error!.message).toContain(fragment);
      expect(await client.jobs.spec(job)).toBeNull();
    },
    30_000,
  );

  test("cancel; every request about an unknown or ended job answers at once; resubmitting resumes from the newest snapshot and ends done", async () => {
    const cfg = small("resumable", { epochs: 2 });
    await client.submit(cfg);
    let cancelled: Promise<unknown> | null = null;
    const first = await follow(cfg.job, (e) => {
      if (cancelled === null && e.kind === EventKind.Checkpoint && e.step >= 10) cancelled = client.cancel(cfg.job);
    });
    await cancelled;
    expect(first.record.state).toBe(JobState.Cancelled);
    expect(first.record.reason).toStartWith("cancelled by ");
    expect(first.record.reason).not.toStartWith("cancelled by unknown@"); // Bun's userInfo() under root
    const snaps = await client.checkpoints(cfg.job); // from disk: the job is closed
    expect(snaps.length).toBeGreaterThan(0);
    const newest = snaps.at(-1)!.step;

    await expectRejected(
      () => client.cancel(cfg.job),
      JobStateError,
      "job default.resumable cancelled at",
      "nothing to cancel",
    );
    await expectRejected(() => client.cancel("nosuch"), UnknownJobError, "no job default.nosuch");
    await expectRejected(() => client.saveCheckpoint("nosuch"), UnknownJobError, "no job default.nosuch");
    await expectRejected(() => client.saveCheckpoint(cfg.job), JobStateError, "needs a running job");
    await expectRejected(() => client.restore(cfg.job), JobStateError, "restore needs a running job");
    await expectRejected(() => client.checkpoints("nosuch"), UnknownJobError, "no snapshots");
    await expectRejected(() => client.status("nosuch"), UnknownJobError, "no job default.nosuch");
    await expectRejected(
      () => watchJob(client, cfg.job, { quiet: true }),
      JobFailedError,
      "job default.resumable cancelled",
    );

    await expectRejected(
      () => client.submit({ ...cfg, lr: 0.2 }),
      JobStateError,
      "ran before with other settings (lr: 0.1 -> 0.2)",
    );
    // past the SDK's check (a script that writes the spec itself): the checkpoint service refuses
    // to open it over the snapshots, so the job fails with the differences
    const other = { ...cfg, lr: 0.2 };
    await client.jobs.updateRecord(cfg.job, (r) => ({
      ...r,
      state: JobState.Running,
      configJson: JSON.stringify(other),
    }));
    await client.jobs.putSpec({
      job: cfg.job,
      trainers: 3,
      shards: 3,
      sync: SyncPolicy.BSP,
      staleness: 0,
      configJson: JSON.stringify(other),
      plan: await client.plan(other),
    });
    const refused = await follow(cfg.job);
    expect(refused.record.state).toBe(JobState.Failed);
    expect(refused.record.reason).toContain(
      "checkpoint cannot open job default.resumable: job default.resumable has snapshots taken with other settings",
    );
    expect(refused.record.reason).toContain("lr: 0.1 -> 0.2");
    expect(await client.checkpoints(cfg.job)).toEqual(snaps); // untouched
    const resumed = client.events(cfg.job); // before the submit: the restore is the run's first event
    const rec = await client.submit(cfg);
    expect(rec.attempts).toBe(2); // the refused spec above went around the SDK: not an attempt
    const second = await follow(cfg.job, undefined, resumed);
    expect(second.record.state).toBe(JobState.Done);
    // one restore loads every shard; the shards that asked later find theirs loaded (no rewind)
    const restores = second.events.filter((e) => e.kind === EventKind.Restore);
    expect(restores.map((e) => e.step)).toEqual([newest]);
    const restore = restores[0]!;
    // every step of the second run from the snapshot on, on every rank, exactly once after the restore
    const after = second.events.slice(second.events.indexOf(restore)).filter((e) => e.kind === EventKind.Step);
    for (const rank of [0, 1, 2]) {
      expect(after.filter((e) => e.rank === rank).map((e) => e.step)).toEqual(
        Array.from({ length: 2 * stepsPerEpoch - newest }, (_, i) => newest + i),
      );
    }
  }, 180_000);

  test.each(["bsp", "allreduce"] as const)(
    "%s: restores on the last step and during the final evaluation: the ranks train the last steps again, the job ends done, steps run twice give the same losses",
    async (sync) => {
      const cfg = small(`end-restore-${sync}`, { sync, epochs: 2 });
      const total = 2 * stepsPerEpoch;
      await client.submit(cfg);
      const restores: Promise<unknown>[] = [];
      const r = await follow(cfg.job, (e) => {
        // the first: as rank 0 reports the last step; the second: as the first rank reports its final evaluation after it
        const at =
          restores.length === 0
            ? e.kind === EventKind.Step && e.rank === 0 && e.step === total - 1
            : restores.length === 1 && e.kind === EventKind.Eval && e.step === total;
        if (at) restores.push(client.restore(cfg.job));
      });
      const manifests = (await Promise.all(restores)) as { step: number }[];
      expect([r.error?.message ?? null, r.record.state]).toEqual([null, JobState.Done]);
      expect(manifests.map((m) => m.step)).toEqual([30, 30]);
      expect(r.events.filter((e) => e.kind === EventKind.Restore).map((e) => e.step)).toEqual([30, 30]);
      // the steps from the snapshot on ran three times on every rank, with the same loss each time
      const losses = new Map<string, number[]>();
      for (const e of r.events)
        if (e.kind === EventKind.Step)
          losses.set(`${e.rank}:${e.step}`, [...(losses.get(`${e.rank}:${e.step}`) ?? []), e.loss]);
      for (const rank of [0, 1, 2]) {
        for (let step = 30; step < total; step++) {
          const l = losses.get(`${rank}:${step}`) ?? [];
          expect([rank, step, l.length >= 2]).toEqual([rank, step, true]);
          for (const x of l) expect(Math.abs(x - l[0]!)).toBeLessThanOrEqual(1e-6 * Math.max(1, Math.abs(l[0]!)));
        }
      }
      expect(r.record.accuracy).toBeGreaterThan(0.8);
      expect(r.record.snapshot).not.toBe("");
    },
    180_000,
  );

  test("snapshots by time as well as by steps: with none by steps, a job takes them every checkpointMinutes while it trains", async () => {
    const cfg = small("timed-snapshots", { epochs: 3, checkpointEvery: 0, checkpointMinutes: 0.005 }); // every 0.3 s
    await client.submit(cfg);
    const r = await follow(cfg.job);
    expect(r.record.state).toBe(JobState.Done);
    const during = r.events
      .filter((e) => e.kind === EventKind.Checkpoint && e.step > 0 && e.step < 3 * stepsPerEpoch)
      .map((e) => e.step);
    expect(during.length).toBeGreaterThanOrEqual(2);
    expect(new Set(during).size).toBe(during.length);
  }, 120_000);

  test("a record left running without a spec (a submission cut off): watch says so; submitting it again runs it", async () => {
    const cfg = small("cut-off");
    await client.jobs.createRecord(runningRecord(cfg.job, JSON.stringify(cfg), 1));
    await expectRejected(
      () => watchJob(client, cfg.job, { quiet: true }),
      JobStateError,
      "is recorded as running, but no service runs it",
    );
    const rec = await client.submit(cfg);
    expect(rec.attempts).toBe(2);
    expect((await follow(cfg.job)).record.state).toBe(JobState.Done);
  }, 60_000);

  test("more jobs one after another than any service's limit (2) run to the end, with flat data-loader memory; after every service restarts, ended jobs stay closed", async () => {
    const rss: number[] = [];
    for (let i = 0; i < 5; i++) {
      await client.submit(small(`seq-${i}`));
      expect((await follow(`seq-${i}`)).record.state).toBe(JobState.Done);
      rss.push(rssKb(mesh.pid("data-loader")));
    }
    // a leak of each job's data set would add 55 MB a job: the fourth and fifth readings would be
    // 110 and 165 MB or more above the second. What the allocator keeps of freed pages varies with
    // the machine's load, one reading at a time (up to 145 MB above the second seen, and the third
    // to fifth all 53 MB above it in one CI-like run): the lower of the last two is the one to judge
    console.log(`data-loader RSS after each job: ${rss.map((kb) => `${Math.round(kb / 1024)} MB`).join(", ")}`);
    expect(Math.min(rss[3]!, rss[4]!) - rss[1]!).toBeLessThan(100 * 1024);
    for (const s of ["data-loader", "parameter-server-0", "trainer-0", "checkpoint"]) mesh.kill(s, "SIGKILL");
    await waitFor(
      "the services to be back",
      async () => {
        await client.waitForMembers({ job: "default.any", trainers: 3, shards: 3 }, 0);
        return true;
      },
      60_000,
    );
    // a job that runs to its end on the restarted services: by then they have read every spec in
    // the bucket (a watch delivers the ones there before new ones)
    await client.submit(small("after-restart"));
    expect((await follow("after-restart")).record.state).toBe(JobState.Done);
    // a spec left behind by a crash between the record's end and the spec's delete: no service
    // opens it, and it is removed
    const ended = await client.record("seq-4");
    await client.jobs.putSpec({
      job: "default.seq-4",
      trainers: 3,
      shards: 3,
      sync: SyncPolicy.BSP,
      staleness: 0,
      configJson: ended.configJson,
      attempt: ended.attempts,
      plan: await client.plan(jobConfigFromJson(ended.configJson)),
    });
    await waitFor(
      "the stale spec to be removed",
      async () => (await client.jobs.spec("default.seq-4")) === null,
      10_000,
    );
    for (const job of ["default.three", "default.seq-4"]) {
      await expect(
        client.bus.request(subjects.dataPlan(job), encodeJobRequest({ job, step: 0, tag: "" }), 5000),
      ).rejects.toBeInstanceOf(UnknownJobError);
      expect((await client.record(job)).state).toBe(JobState.Done);
    }
  }, 240_000);
});
