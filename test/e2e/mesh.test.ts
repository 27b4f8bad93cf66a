// The whole mesh as a user runs it: the launcher reads deploy/docker-compose.yml and starts a
// real nats-server and every service as a process; the SDK submits a job and streams its
// events. Then the chaos test: SIGKILL a parameter-server shard and a trainer mid-run.
import { afterAll, describe, expect, test } from "bun:test";
import { existsSync } from "node:fs";
import { join } from "node:path";
import { loadMnist } from "../../engine/data/mnist.ts";
import { type Event, EventKind, JobState } from "../../schemas/messages/job.ts";
import { JobData, planHere } from "../../services/data-loader/loader.ts";
import { buildLayout } from "../../services/runtime/job/layout.ts";
import { MeshClient } from "../../sdk/client.ts";
import { JobFailedError, watchJob } from "../../sdk/watch.ts";
import { finalChunkVersions, modelFileAccuracy } from "../helpers/jobs.ts";
import { removeTempDirs } from "../helpers/mesh.ts";
import {
  atRank0Step,
  expectEveryStepOnce,
  mlpJob,
  runJob,
  runThroughSigkill,
  startMesh,
} from "../helpers/mesh-jobs.ts";

afterAll(removeTempDirs);

describe("mesh", () => {
  test("a short BSP run on the local mesh learns, its events reach the SDK, and its final snapshot is exported as a model file", async () => {
    await using mesh = await startMesh("mt-e2e-");
    await using client = await MeshClient.connect(mesh.url, mesh.auth());
    // 2 micro-batches of 64 per step (gradient accumulation on the trainers), bf16 autocast
    // GEMMs on the trainers (the chaos test below runs f32)
    // gradClip: the shards agree on the global norm of each step's averaged gradient (ps.<k>.norm)
    const cfg = mlpJob({
      job: "default.e2e",
      checkpointEvery: 100,
      evalEvery: 100,
      accumSteps: 2,
      precision: "bf16",
      gradClip: 1,
    });
    const total = planHere(cfg).totalSteps;
    let asked: Promise<Event> | null = null;
    const r = await runJob(client, cfg, (e) => {
      if (asked === null && e.kind === EventKind.Step && e.step === 30) asked = client.saveCheckpoint(cfg.job);
    });
    const seen = r.seen;
    expect(r.record.state).toBe(JobState.Done);
    expect(r.record.accuracy).toBeGreaterThan(0.9); // chance is 0.1
    expect(r.record.evaluated).toBe(10_000);
    expect(r.record.totalSteps).toBe(total);
    expectEveryStepOnce(seen, 2, total);
    expect(seen.filter((e) => e.kind === EventKind.Eval && e.step === 100)).toHaveLength(2); // both ranks evaluated at step 100
    // the scheduled snapshots, the one asked for at step 30 (taken at rank 0's next step), the final one
    const onDemand = await asked!;
    expect(onDemand.step).toBeGreaterThanOrEqual(30); // rank 1 may report step 30 before rank 0 reaches its snapshot point
    expect(onDemand.step % 100).not.toBe(0);
    expect(r.checkpoints).toBe(Math.ceil(total / 100) + 2);
    expect(seen.at(-1)!.kind).toBe(EventKind.Ended);
    const step = seen.find((e) => e.kind === EventKind.Step)!;
    expect(step.pullMs).toBeGreaterThan(0);
    expect(step.computeMs).toBeGreaterThan(0);
    // the final snapshot and its model file: the same parameters the trainers evaluated
    expect(r.record.snapshot).toBe(`step-${String(total).padStart(9, "0")}`);
    expect(r.record.modelPath).toBe(join(r.record.snapshotDir, "model.mtm"));
    expect(modelFileAccuracy(r.record.modelPath, cfg.precision)).toBeCloseTo(r.record.accuracy, 6);
    const status = await client.status(cfg.job);
    expect(status.config.precision).toBe("bf16");
    expect(status.shards).toEqual([]); // an ended job is closed on every service
    expect(status.checkpoints.at(-1)!.modelPath).toBe(r.record.modelPath);
    expect(status.checkpoints.length).toBeLessThanOrEqual(cfg.keepLast + 1);
  }, 180_000);

  test("SIGKILL of a parameter-server shard and a trainer mid-run: the job restores from its last snapshot and finishes; no sample is repeated or skipped", async () => {
    // 64 KB chunks: the hash ring gives all 4 to shard 1 and none to shard 0, whose clocks then
    // never move. Its part of a snapshot must still be of the snapshot's step, or the killed
    // shard 1 finds no snapshot to restore it from (and served the seed's parameters)
    const cfg = mlpJob({ job: "default.chaos", epochs: 2, checkpointEvery: 40, chunkBytes: 64 << 10 });
    const plan = planHere(cfg);
    const layout = buildLayout(cfg.job, plan.slabNumel, plan.decayElems, cfg.chunkBytes, cfg.shards);
    expect(layout.byShard.map((ids) => ids.length)).toEqual([0, 4]);
    // the effective history of every rank is every step exactly once; batches are a pure
    // function of (rank, step), so each epoch visits every training sample exactly once
    const { steps } = await runThroughSigkill("mt-chaos-", {}, cfg, ["parameter-server-1", "trainer-1"]);
    const data = new JobData(cfg, { kind: "mnist", data: loadMnist() });
    for (let epoch = 0; epoch < cfg.epochs; epoch++) {
      const ids: number[] = [];
      for (let s = epoch * data.stepsPerEpoch; s < (epoch + 1) * data.stepsPerEpoch; s++)
        for (const rank of [0, 1]) ids.push(...data.trainIds(rank, steps[rank]![s]!));
      expect(ids.sort((a, b) => a - b)).toEqual([...data.train]);
    }
  }, 300_000);

  test("a shard and a trainer SIGKILLed while a slow snapshot is written: the restarted shard takes no push until it is restored, and the job finishes with every step applied once", async () => {
    // the snapshot's write takes 4 s: the restarted shard's ask to be restored waits behind it,
    // while the restarted trainer (whose step comes from the fresh shard's clock: 0) pushes. A
    // shard that took that push would look trained, the restore would pass it by, and the other
    // trainer would wait forever on its step
    const launcherLines: string[] = [];
    await using mesh = await startMesh("mt-slowsave-", {
      onEvent: (l) => launcherLines.push(l),
      serviceEnv: { checkpoint: { MT_WRITE_DELAY_MS: "4000" } },
    });
    await using client = await MeshClient.connect(mesh.url, mesh.auth());
    // 120 steps: every snapshot takes its 4 s, so the job ends two snapshots after the restore
    const cfg = mlpJob({ job: "default.slowsave", epochs: 1, maxSteps: 120, checkpointEvery: 40, evalEvery: 0 });
    const total = planHere(cfg).totalSteps;
    const restores: Event[] = [];
    const kill = atRank0Step(
      (e) => e.step === 80 && e.snapshotMs > 0,
      () => {
        mesh.kill("parameter-server-1", "SIGKILL");
        mesh.kill("trainer-1", "SIGKILL");
      },
    );
    await client.submit(cfg, { membersWaitMs: 60_000 });
    const r = await watchJob(client, cfg.job, {
      quiet: true,
      signal: AbortSignal.timeout(150_000),
      onEvent: (e) => {
        if (e.kind === EventKind.Restore) restores.push(e);
        kill.onEvent(e);
      },
    });
    expect(kill.step).toBe(80);
    expect(r.record.state).toBe(JobState.Done);
    // step 80's snapshot, or step 40's when the kill cut the shard's part of 80 short
    expect(restores.length).toBe(1);
    expect([40, 80]).toContain(restores[0]!.step);
    expect(new Set([...finalChunkVersions(r.record).values()].flat())).toEqual(new Set([total]));
  }, 180_000);

  test("a trainer stopped with SIGSTOP is reported by a Stalled event naming it, its step and phase; after SIGCONT it is back and the job finishes", async () => {
    await using mesh = await startMesh("mt-stall-");
    await using client = await MeshClient.connect(mesh.url, mesh.auth());
    const cfg = mlpJob({ job: "default.stall", epochs: 1, checkpointEvery: 0 });
    const stalled: Event[] = [];
    const stop = atRank0Step(100, () => mesh.kill("trainer-1", "SIGSTOP"));
    const r = await runJob(client, cfg, (e) => {
      stop.onEvent(e);
      if (e.kind === EventKind.Stalled) {
        stalled.push(e);
        if (stalled.length === 1) mesh.kill("trainer-1", "SIGCONT");
      }
    });
    const stoppedAt = stop.step;
    expect(stoppedAt).toBeGreaterThan(0);
    expect(r.record.state).toBe(JobState.Done);
    // no snapshot before the final one (checkpointEvery 0): the final one still makes the job's folder and model file
    expect(r.record.reason).toBe("");
    expect(existsSync(r.record.modelPath)).toBe(true);
    expect(stalled[0]!.text).toMatch(
      /^trainer 1 has sent no heartbeat for \d+ s \(stopped, wedged or dead\); it was at step \d+, \w+/,
    );
    // what it said last, at most half a second before it stopped (heartbeats go out at phase
    // changes, at most every 0.5 s, and every 2 s)
    expect(stalled[0]!.step, stalled[0]!.text).toBeGreaterThan(0);
    expect(stalled[0]!.step, stalled[0]!.text).toBeLessThanOrEqual(stoppedAt + 2);
    expect(stalled.some((e) => e.text.startsWith("trainer 1 is back after"))).toBe(true);
    // nothing else went quiet
    expect(stalled.filter((e) => !e.text.startsWith("trainer 1 ")).map((e) => e.text)).toEqual([]);
  }, 180_000);

  test("nats-server SIGKILLed mid-run: the launcher restarts it on its port with its store, the services reconnect, and every step is applied once", async () => {
    const launcherLines: string[] = [];
    await using mesh = await startMesh("mt-natskill-", { onEvent: (l) => launcherLines.push(l) });
    await using client = await MeshClient.connect(mesh.url, mesh.auth());
    const cfg = mlpJob({ job: "default.natskill", epochs: 1, checkpointEvery: 50 });
    const total = planHere(cfg).totalSteps;
    const kill = atRank0Step(80, () => process.kill(mesh.nats.pid, "SIGKILL"));
    const r = await runJob(client, cfg, kill.onEvent);
    expect(kill.step).toBeGreaterThanOrEqual(80);
    expect(launcherLines.some((l) => l.startsWith("nats-server died"))).toBe(true);
    expect(launcherLines.some((l) => l.startsWith("nats-server is back"))).toBe(true);
    expect(r.record.state).toBe(JobState.Done);
    expect(r.record.accuracy).toBeGreaterThan(0.9);
    // under BSP each step updates every chunk once: the final snapshot's versions count the steps applied
    expect(new Set([...finalChunkVersions(r.record).values()].flat())).toEqual(new Set([total]));
  }, 180_000);

  test("a snapshot of 2 shards resumes on 3 (its chunks resharded by the hash ring): the steps after the snapshot repeat the first run's losses", async () => {
    await using mesh = await startMesh("mt-reshard-", { shards: 3 });
    await using client = await MeshClient.connect(mesh.url, mesh.auth());
    const cfg = mlpJob({ job: "default.reshard", shards: 2, maxSteps: 60, checkpointEvery: 20, evalEvery: 0 });
    const first = new Map<string, number>();
    let cancelled = false;
    await client.submit(cfg, { membersWaitMs: 60_000 });
    const stopped = await watchJob(client, cfg.job, {
      quiet: true,
      onEvent: (e) => {
        if (e.kind !== EventKind.Step) return;
        first.set(`${e.rank}:${e.step}`, e.loss);
        // cancel once both ranks have reported the steps compared below (rank 1's events may trail rank 0's)
        if (!cancelled && first.has("0:44") && first.has("1:44")) {
          cancelled = true;
          void client.cancel(cfg.job);
        }
      },
    }).catch((e: unknown) => e);
    expect(stopped).toBeInstanceOf(JobFailedError);
    const { record, seen: again } = await runJob(client, { ...cfg, shards: 3 });
    expect(record.state).toBe(JobState.Done);
    const restore = again.find((e) => e.kind === EventKind.Restore)!;
    expect(restore.step).toBe(40);
    // the same parameters and optimizer state, and the same batches: the same losses
    for (const rank of [0, 1]) {
      for (let step = 40; step < 45; step++) {
        const loss = again.find((e) => e.kind === EventKind.Step && e.rank === rank && e.step === step)!.loss;
        expect(Math.abs(loss - first.get(`${rank}:${step}`)!)).toBeLessThan(1e-5);
      }
    }
  }, 180_000);

  test("a trainer made slow (a test-only delay in its compute) gets a straggler event naming it and its step split", async () => {
    await using mesh = await startMesh("mt-straggler-", { serviceEnv: { "trainer-1": { MT_STEP_DELAY_MS: "40" } } });
    await using client = await MeshClient.connect(mesh.url, mesh.auth());
    const cfg = mlpJob({ job: "default.straggler", maxSteps: 80, checkpointEvery: 0, evalEvery: 0 });
    const r = await runJob(client, cfg);
    const stragglers = r.seen.filter((e) => e.kind === EventKind.Straggler);
    expect(r.record.state).toBe(JobState.Done);
    expect(stragglers.length).toBeGreaterThanOrEqual(1);
    expect(stragglers[0]!.text).toMatch(
      /^trainer 1 is a straggler: its own time per step is [\d.]+x the other ranks' over the last 20 steps \(data [\d.]+ ms, compute [\d.]+ ms, push [\d.]+ ms; the others: data/,
    );
    // the one made slow, and no other
    expect(stragglers.filter((e) => !e.text.startsWith("trainer 1 ")).map((e) => e.text)).toEqual([]);
  }, 120_000);

  test("a shard killed in a job with no snapshot to restore it from: the job fails at once, saying so, instead of waiting on it", async () => {
    await using mesh = await startMesh("mt-nosnap-");
    await using client = await MeshClient.connect(mesh.url, mesh.auth());
    const cfg = mlpJob({ job: "default.nosnap", epochs: 2, checkpointEvery: 0 });
    const kill = atRank0Step(20, () => mesh.kill("parameter-server-1", "SIGKILL"));
    const failed = await runJob(client, cfg, kill.onEvent).catch((e: unknown) => e);
    expect(kill.step).toBeGreaterThan(0);
    expect(failed).toBeInstanceOf(JobFailedError);
    const record = (failed as JobFailedError).record!;
    expect(record.state).toBe(JobState.Failed);
    expect(record.reason).toContain(
      "shard 1 restarted and lost its state, and job default.nosnap has no snapshot to restore it from (checkpointEvery is 0)",
    );
  }, 120_000);

  test("compressed pushes and pulls: bf16 moves half the bytes of f32, int8 pushes a quarter; both learn", async () => {
    await using mesh = await startMesh("mt-e2e-compress-");
    await using client = await MeshClient.connect(mesh.url, mesh.auth());
    const perStep: Record<string, number> = {};
    for (const compress of ["none", "bf16", "int8"]) {
      const cfg = mlpJob({
        job: `default.e2e-compress-${compress}`,
        maxSteps: 60,
        checkpointEvery: 0,
        evalEvery: 0,
        compress,
      });
      const r = await runJob(client, cfg);
      expect(r.record.state).toBe(JobState.Done);
      expect(r.record.accuracy).toBeGreaterThan(0.8);
      perStep[compress] = r.wireBytesPerStep;
    }
    // pulls and pushes each carry the 50,890 parameters: f32 both ways, bf16 both ways, f32
    // pulls and int8 pushes (plus the messages' headers)
    const f32 = perStep.none!;
    expect(f32).toBeGreaterThan(2 * 4 * 50_890);
    expect(f32).toBeLessThan(2 * 4 * 50_890 * 1.05);
    expect(perStep.bf16! / f32).toBeCloseTo(0.5, 1);
    expect(perStep.int8! / f32).toBeCloseTo(0.625, 1);
  }, 180_000);
});
