// The whole mesh as a user runs it: the launcher reads deploy/docker-compose.yml and starts a
// real nats-server and every service as a process; the SDK submits a job and streams its
// events. Then the chaos test: SIGKILL a parameter-server shard and a trainer mid-run.
import { afterAll, describe, expect, test } from "bun:test";
import { loadMnist } from "../../engine/data/mnist.ts";
import { type Event, EventKind } from "../../schemas/messages.ts";
import { JobData } from "../../services/data-loader/loader.ts";
import { totalSteps as jobTotalSteps } from "../../services/data-loader/sampler.ts";
import { type JobConfig, jobDefaults, parseJobConfig } from "../../services/runtime/job.ts";
import { MeshClient } from "../../sdk/client.ts";
import { LocalMesh } from "../../sdk/launcher.ts";
import { watchJob } from "../../sdk/watch.ts";
import { removeTempDirs, tempDir } from "../helpers/mesh.ts";

afterAll(removeTempDirs);

const config = (over: Partial<JobConfig>): JobConfig => parseJobConfig({
  // 16 KB chunks: the 204 KB model is cut into 13 chunks, so both shards own some
  ...jobDefaults, model: { kind: "mlp", widths: [784, 64, 10], dropout: 0 }, epochs: 1, warmupSteps: 20, chunkBytes: 16 << 10, ...over,
});

/** Passes events through while recording them. */
async function* tap(events: AsyncIterable<Event>, seen: Event[], onEvent?: (e: Event) => void): AsyncGenerator<Event> {
  for await (const e of events) {
    seen.push(e);
    onEvent?.(e);
    yield e;
  }
}

/** Each rank's steps as they stand at the end: a restore to T discards the steps >= T run before it. */
function effectiveSteps(events: readonly Event[], trainers: number): number[][] {
  const steps: number[][] = Array.from({ length: trainers }, () => []);
  for (const e of events) {
    if (e.kind === EventKind.Restore) for (const r of steps) r.splice(0, r.length, ...r.filter((s) => s < e.step));
    if (e.kind === EventKind.Step) steps[e.rank]!.push(e.step);
  }
  return steps;
}

describe("mesh", () => {
  test("a short BSP run on the local mesh learns, and its events reach the SDK", async () => {
    const dir = tempDir("mt-e2e-");
    await using mesh = await LocalMesh.start({ dir });
    await using client = await MeshClient.connect(mesh.url);
    // 2 micro-batches of 64 per step (gradient accumulation on the trainers), bf16 autocast
    // GEMMs on the trainers (the chaos test below runs f32)
    const cfg = config({ job: "e2e", checkpointEvery: 100, evalEvery: 100, accumSteps: 2, precision: "bf16" });
    const total = jobTotalSteps(cfg);
    const seen: Event[] = [];
    let asked: Promise<Event> | null = null;
    const events = tap(client.events(cfg.job), seen, (e) => {
      if (asked === null && e.kind === EventKind.Step && e.step === 30) asked = client.saveCheckpoint(cfg.job);
    });
    await client.submit(cfg);
    const r = await watchJob(events, { trainers: 2, totalSteps: total, quiet: true });
    expect(r.accuracy).toBeGreaterThan(0.9); // chance is 0.1
    expect(r.evaluated).toBe(10_000);
    const steps = effectiveSteps(seen, 2);
    for (const rank of [0, 1]) expect(steps[rank]).toEqual(Array.from({ length: total }, (_, i) => i));
    expect(seen.filter((e) => e.kind === EventKind.Eval && e.step === 100)).toHaveLength(2); // both ranks evaluated at step 100
    // the scheduled snapshots, and the one asked for at step 30 (taken at rank 0's next step)
    const onDemand = await asked!;
    expect(onDemand.step).toBeGreaterThanOrEqual(30); // rank 1 may report step 30 before rank 0 reaches its snapshot point
    expect(onDemand.step % 100).not.toBe(0);
    expect(r.checkpoints).toBe(Math.ceil(total / 100) + 1);
    const step = seen.find((e) => e.kind === EventKind.Step)!;
    expect(step.pullMs).toBeGreaterThan(0);
    expect(step.computeMs).toBeGreaterThan(0);
    const status = await client.status(cfg.job);
    expect(status!.config.precision).toBe("bf16");
    expect(status!.shards.map((s) => ("clocks" in s ? s.clocks : s.error))).toEqual([[total, total], [total, total]]);
    expect(status!.checkpoints.length).toBeLessThanOrEqual(cfg.keepLast + 1);
  }, 180_000);

  test("SIGKILL of a parameter-server shard and a trainer mid-run: the job restores from its last snapshot and finishes; no sample is repeated or skipped", async () => {
    const dir = tempDir("mt-chaos-");
    const launcherLines: string[] = [];
    await using mesh = await LocalMesh.start({ dir, onEvent: (l) => launcherLines.push(l) });
    await using client = await MeshClient.connect(mesh.url);
    const cfg = config({ job: "chaos", epochs: 2, checkpointEvery: 40 });
    const total = jobTotalSteps(cfg);
    const seen: Event[] = [];
    let killedAt = -1;
    const events = tap(client.events(cfg.job), seen, (e) => {
      if (killedAt < 0 && e.kind === EventKind.Step && e.rank === 0 && e.step >= 150) {
        killedAt = e.step;
        mesh.kill("parameter-server-1", "SIGKILL");
        mesh.kill("trainer-1", "SIGKILL");
      }
    });
    await client.submit(cfg);
    const r = await watchJob(events, { trainers: 2, totalSteps: total, quiet: true });
    expect(killedAt).toBeGreaterThan(0);
    expect(launcherLines.some((l) => l.includes("parameter-server-1 died (signal SIGKILL); restarting"))).toBe(true);
    expect(launcherLines.some((l) => l.includes("trainer-1 died (signal SIGKILL); restarting"))).toBe(true);
    const restores = seen.filter((e) => e.kind === EventKind.Restore);
    expect(restores.length).toBeGreaterThanOrEqual(1);
    expect(restores[0]!.step % 40).toBe(0);
    expect(restores[0]!.step).toBeLessThanOrEqual(killedAt + 1);
    expect(r.accuracy).toBeGreaterThan(0.93);
    // the effective history of every rank is every step exactly once; batches are a pure
    // function of (rank, step), so each epoch visits every training sample exactly once
    const steps = effectiveSteps(seen, 2);
    for (const rank of [0, 1]) expect(steps[rank]).toEqual(Array.from({ length: total }, (_, i) => i));
    const data = new JobData(cfg, loadMnist());
    for (let epoch = 0; epoch < cfg.epochs; epoch++) {
      const ids: number[] = [];
      for (let s = epoch * data.stepsPerEpoch; s < (epoch + 1) * data.stepsPerEpoch; s++) for (const rank of [0, 1]) ids.push(...data.trainIds(rank, steps[rank]![s]!));
      expect(ids.sort((a, b) => a - b)).toEqual([...data.train]);
    }
  }, 300_000);
});
