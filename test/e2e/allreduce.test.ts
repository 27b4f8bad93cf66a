// All-reduce mode on the whole mesh as a user runs it (a real nats-server, every service a
// process, no parameter-server shard): a short run that learns and exports its model, and the
// chaos test: SIGKILL a trainer mid-run, every rank rewinds to the newest snapshot of rank 0's
// replica, and the job finishes with every step once.
import { afterAll, describe, expect, test } from "bun:test";
import { join } from "node:path";
import { existsSync, readdirSync, readFileSync } from "node:fs";
import { EventKind, JobState } from "../../schemas/messages/job.ts";
import { planHere } from "../../services/data-loader/loader.ts";
import type { JobConfig } from "../../services/runtime/job/config.ts";
import { type JobStatus, MeshClient } from "../../sdk/client.ts";
import { statusLines } from "../../sdk/report.ts";
import type { MeshOptions } from "../../sdk/local-mesh.ts";
import { watchJob } from "../../sdk/watch.ts";
import { modelFileAccuracy } from "../helpers/jobs.ts";
import { removeTempDirs } from "../helpers/mesh.ts";
import {
  expectEveryStepOnce,
  mlpJob,
  runJob,
  runThroughSigkill,
  startMesh,
  stepLosses,
  stepPacer,
} from "../helpers/mesh-jobs.ts";

afterAll(removeTempDirs);

// 16 KB chunks and 16 KB buckets: the snapshot is cut into chunks, the gradient into buckets
const config = (over: Partial<JobConfig>): JobConfig =>
  mlpJob({ sync: "allreduce", bucketMb: 0.016, replicaCheckEvery: 25, ...over });

/** The mesh of these tests: 2 trainers (unless a test says otherwise) and no parameter-server shard. */
const allReduceMesh = { trainers: 2, shards: 0 };
const startAllReduceMesh = (prefix: string, o: Omit<MeshOptions, "jobsDir" | "logDir"> = {}) =>
  startMesh(prefix, { ...allReduceMesh, ...o });

/** Waits until no rank has sent a Step event of the job for `quietMs` (at most `maxMs`). */
async function untilQuiet(client: MeshClient, job: string, quietMs: number, maxMs: number): Promise<void> {
  const events = client.events(job, AbortSignal.timeout(maxMs));
  let last = performance.now();
  const heard = (async () => {
    for await (const e of events) if (e.kind === EventKind.Step) last = performance.now();
  })().catch(() => {});
  const started = performance.now();
  while (performance.now() - last < quietMs && performance.now() - started < maxMs) await Bun.sleep(100);
  await events.return?.();
  await heard;
}

describe("all-reduce mode on the mesh", () => {
  test("a short run with no parameter-server shard learns; the step split shows the all-reduce; its final snapshot of the replica is exported", async () => {
    await using mesh = await startAllReduceMesh("mt-ar-");
    await using client = await MeshClient.connect(mesh.url, mesh.auth());
    const cfg = config({
      job: "default.ar",
      checkpointEvery: 100,
      gradClip: 5,
      accumSteps: 2,
      scaleLr: true,
      lr: 0.05,
    });
    const r = await runJob(client, cfg);
    const seen = r.seen;
    expect(r.record.state).toBe(JobState.Done);
    expect(r.record.accuracy).toBeGreaterThan(0.9);
    expect(r.record.evaluated).toBe(10_000);
    expectEveryStepOnce(seen, 2, planHere(cfg).totalSteps);
    const stepEvents = seen.filter((e) => e.kind === EventKind.Step);
    expect(stepEvents.every((e) => e.pullMs === 0 && e.pushMs === 0)).toBe(true);
    expect(stepEvents.filter((e) => !(e.commMs > 0 && e.exposedCommMs >= 0 && e.exposedCommMs <= e.commMs))).toEqual(
      [],
    );
    // --scale-lr: the schedule peaks at lr x 2 trainers
    expect(Math.max(...stepEvents.map((e) => e.lr))).toBeCloseTo(0.1, 6);
    expect(seen.some((e) => e.kind === EventKind.Failed)).toBe(false);
    // snapshots of rank 0's replica, in parts; the final one exported as the model file
    const snapDir = join(r.record.snapshotDir, r.record.snapshot);
    expect(readdirSync(snapDir).filter((f) => f.startsWith("replica-")).length).toBeGreaterThan(0);
    expect(readdirSync(snapDir).some((f) => f.startsWith("ps-"))).toBe(false);
    expect(existsSync(r.record.modelPath)).toBe(true);
    expect(modelFileAccuracy(r.record.modelPath)).toBeCloseTo(r.record.accuracy, 6);
  }, 180_000);

  test("4 ranks labelled as 2 hosts x 2: the all-reduce is hierarchical, the replicas stay identical, the job learns", async () => {
    await using mesh = await startAllReduceMesh("mt-ar-hosts-", { trainers: 4, trainerHosts: ["a", "a", "b", "b"] });
    await using client = await MeshClient.connect(mesh.url, mesh.auth());
    const cfg = config({
      job: "default.ar-hosts",
      trainers: 4,
      maxSteps: 60,
      replicaCheckEvery: 20,
      checkpointEvery: 0,
    });
    const r = await runJob(client, cfg);
    expect(r.record.state).toBe(JobState.Done);
    expect(r.record.accuracy).toBeGreaterThan(0.85);
    // every 20 steps the ranks compared their parameters' hashes (a difference fails the job)
    expect(r.seen.some((e) => e.kind === EventKind.Failed)).toBe(false);
    expectEveryStepOnce(r.seen, 4, 60);
    for (const rank of [0, 1, 2, 3]) {
      const log = readFileSync(join(mesh.opts.logDir, `trainer-${rank}.log`), "utf8");
      expect(log).toContain("all-reduce: the ring, hierarchical: within each of 2 hosts");
    }
  }, 180_000);

  test("ZeRO stage 2 on the mesh: the job learns, each trainer logs its bytes per parameter, and a snapshot (each rank's partition in its own files) resumes at stage 1", async () => {
    await using mesh = await startAllReduceMesh("mt-ar-zero-");
    await using client = await MeshClient.connect(mesh.url, mesh.auth());
    const adamw = { kind: "adamw" as const, beta1: 0.9, beta2: 0.999, eps: 1e-8, weightDecay: 0.01 };
    const cfg = config({
      job: "default.ar-zero",
      zero: 2,
      maxSteps: 100,
      checkpointEvery: 20,
      optimizer: adamw,
      lr: 2e-3,
    });
    await client.submit(cfg, { membersWaitMs: 60_000 });
    let cancelled: Promise<unknown> | null = null;
    let status: Promise<JobStatus> | null = null;
    const first = await watchJob(client, cfg.job, {
      quiet: true,
      onEvent: (e) => {
        if (status === null && e.kind === EventKind.Step && e.step >= 10) status = client.status(cfg.job);
        if (cancelled === null && e.kind === EventKind.Checkpoint && e.step >= 40) cancelled = client.cancel(cfg.job);
      },
    }).catch((e: unknown) => e);
    await cancelled;
    expect(String(first)).toContain("cancelled");
    // status shows what each rank holds while the job runs
    const st = await status!;
    expect(st.trainers).toHaveLength(2);
    for (const t of st.trainers) {
      if ("error" in t) throw new Error(t.error);
      expect(t.zeroStage).toBe(2);
      expect(t.step).toBeGreaterThanOrEqual(10);
      expect((t.paramBytes + t.gradBytes + t.optimizerBytes) / t.paramCount).toBeCloseTo(10, 1);
      expect(t.arenaPeakBytes).toBeGreaterThan(0);
      expect(t.wireBytes).toBeGreaterThan(0);
    }
    expect(statusLines(st).join("\n")).toMatch(
      /trainer 1  step \d+; ZeRO stage 2 of 2 ranks: 10\.0\d bytes per parameter/,
    );
    for (const rank of [0, 1]) {
      const log = readFileSync(join(mesh.opts.logDir, `trainer-${rank}.log`), "utf8");
      // AdamW in f32 on 2 ranks at stage 2: 4 + 12/2 = 10 bytes per parameter
      expect(log).toMatch(/model state on this rank: 10\.0\d bytes per parameter \(ZeRO stage 2, 2 ranks\)/);
    }
    const newestSnap = (await client.checkpoints(cfg.job)).at(-1)!;
    const newest = newestSnap.step;
    expect(newest).toBeGreaterThanOrEqual(40);
    // one file per rank and part: no rank sent another's state
    const ranksSaved = new Set(newestSnap.files.map((f) => /^partition-(\d+)-\d+\.mtss$/.exec(f.name)?.[1]));
    expect([...ranksSaved].sort()).toEqual(["0", "1"]);
    // the same job at stage 1 resumes from that snapshot and finishes
    const r = await runJob(client, { ...cfg, zero: 1 });
    expect(r.record.state).toBe(JobState.Done);
    expect(r.record.accuracy).toBeGreaterThan(0.85);
    expect(r.seen.filter((e) => e.kind === EventKind.Restore).map((e) => e.step)).toEqual([newest]);
  }, 180_000);

  test("ZeRO 3 on the mesh: a snapshot of 4 trainers resumes on 2 (stage 3) and on 3 (stage 1) with the same global batch and continues on the 4-trainer stage-2 run's loss trajectory", async () => {
    // in the runs cancelled below each step sleeps 40 ms in the trainers: the cancel, sent when
    // the snapshot of step 20 is announced, must come before the job's end at step 60 (on a
    // loaded machine it once came after it). The other runs go at full speed.
    const pace = stepPacer(40);
    await using mesh = await startAllReduceMesh("mt-ar-regroup-", { trainers: 4, env: pace.env });
    await using client = await MeshClient.connect(mesh.url, mesh.auth());
    const adamw = { kind: "adamw" as const, beta1: 0.9, beta2: 0.999, eps: 1e-8, weightDecay: 0.01 };
    const base = {
      zero: 2 as 0 | 1 | 2 | 3,
      trainers: 4,
      batchSize: 48,
      maxSteps: 60,
      checkpointEvery: 20,
      evalEvery: 30,
      optimizer: adamw,
      lr: 2e-3,
      replicaCheckEvery: 20,
    };
    const refLoss = stepLosses((await runJob(client, config({ job: "default.ar-regroup-ref", ...base }))).seen);
    // saved at stage 3 (each rank's parameters and state in its own files), resumed at stage 3 on
    // 2 ranks and at stage 1 on 3
    for (const [trainers, batchSize, zero] of [
      [2, 96, 3],
      [3, 64, 1],
    ] as const) {
      const cfg = config({ job: `default.ar-regroup-${trainers}`, ...base, zero: 3 });
      pace.on();
      await client.submit(cfg, { membersWaitMs: 60_000 });
      let cancelled: Promise<unknown> | null = null;
      await watchJob(client, cfg.job, {
        quiet: true,
        onEvent: (e) => {
          if (cancelled === null && e.kind === EventKind.Checkpoint && e.step >= 20) cancelled = client.cancel(cfg.job);
        },
      }).catch(() => {});
      await cancelled;
      // the cancelled run's ranks stop at their next step boundary: the resumed run's events
      // are its own only once they did (a late Step of the old run would count as the new one's)
      await untilQuiet(client, cfg.job, 1_500, 30_000);
      pace.off();
      const newest = (await client.checkpoints(cfg.job)).at(-1)!.step;
      expect(newest).toBeGreaterThanOrEqual(20);
      expect(newest).toBeLessThan(60);
      const { record, seen } = await runJob(client, { ...cfg, trainers, batchSize, zero });
      expect(record.state).toBe(JobState.Done);
      expect(seen.filter((e) => e.kind === EventKind.Restore).map((e) => e.step)).toEqual([newest]);
      expect(new Set(seen.filter((e) => e.kind === EventKind.Step).map((e) => e.rank))).toEqual(
        new Set(Array.from({ length: trainers }, (_, i) => i)),
      );
      const loss = stepLosses(seen);
      let worst = 0;
      for (let s = newest; s < 60; s++)
        worst = Math.max(worst, Math.abs(loss.get(s)! - refLoss.get(s)!) / refLoss.get(s)!);
      expect(worst).toBeLessThan(2e-4);
    }
  }, 300_000);

  test("SIGKILL of a trainer mid-run: every rank rewinds to the newest snapshot of the replica and the job finishes, every step once", async () => {
    const cfg = config({ job: "default.ar-chaos", epochs: 2, checkpointEvery: 40 });
    const r = await runThroughSigkill("mt-ar-chaos-", allReduceMesh, cfg, ["trainer-1"]);
    expect(r.record.state).toBe(JobState.Done);
  }, 300_000);
});
