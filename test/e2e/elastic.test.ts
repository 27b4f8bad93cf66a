// Trainers and shards that join and leave a running job, on a real mesh: a resize takes a
// snapshot at a step boundary, every service closes the job and opens it again with the new
// sizes from that snapshot. The sampler re-splits the rest of the epoch among the new ranks, so
// every sample is still seen exactly once per epoch; the shards take the snapshot's chunks as the
// new hash ring says, and every step is applied exactly once.
import { afterAll, describe, expect, test } from "bun:test";
import { loadMnist } from "../../engine/data/mnist.ts";
import { type Event, EventKind, JobState } from "../../schemas/messages/job.ts";
import { JobData, planHere } from "../../services/data-loader/loader.ts";
import { buildLayout } from "../../services/runtime/job/layout.ts";
import {
  type JobConfig,
  jobConfigFromJson,
  jobDefaults,
  parseJobConfig,
  lrAt,
  peakLr,
} from "../../services/runtime/job/config.ts";
import { MeshClient } from "../../sdk/client.ts";
import { JobFailedError, watchJob } from "../../sdk/watch.ts";
import { effectiveSteps, finalChunkVersions } from "../helpers/jobs.ts";
import { removeTempDirs } from "../helpers/mesh.ts";
import { startMesh } from "../helpers/mesh-jobs.ts";

afterAll(removeTempDirs);

const config = (over: Partial<JobConfig>): JobConfig =>
  parseJobConfig({
    ...jobDefaults,
    model: { kind: "mlp", widths: [784, 64, 10], dropout: 0 },
    epochs: 2,
    warmupSteps: 20,
    chunkBytes: 16 << 10,
    checkpointEvery: 50,
    scaleLr: true,
    lr: 0.05,
    ...over,
  });

/** The Step events that count: a restore to step T drops those of steps >= T before it. */
function effectiveEvents(seen: readonly Event[]): Event[] {
  let out: Event[] = [];
  for (const e of seen) {
    if (e.kind === EventKind.Restore) out = out.filter((x) => x.step < e.step);
    if (e.kind === EventKind.Step) out.push(e);
  }
  return out.sort((a, b) => a.step - b.step);
}

/** Each epoch's samples as the ranks took them, step by step, in the job's final world. */
function expectEverySampleOncePerEpoch(cfg: JobConfig, seen: readonly Event[]): void {
  const data = new JobData(cfg, { kind: "mnist", data: loadMnist() });
  const W = Math.max(...cfg.world.map((c) => c.trainers));
  const steps = effectiveSteps(seen, W);
  const sched = data.steps;
  for (let s = 0; s < data.totalSteps; s++)
    for (let r = 0; r < W; r++) expect(steps[r]!.includes(s)).toBe(r < sched.trainersAt(s)); // every step once, by its ranks only
  for (let epoch = 0; epoch < cfg.epochs; epoch++) {
    const ids: number[] = [];
    const end = sched.epochStarts[epoch + 1] ?? data.totalSteps;
    for (let s = sched.epochStarts[epoch]!; s < end; s++)
      for (let r = 0; r < sched.trainersAt(s); r++) ids.push(...data.trainIds(r, s));
    expect(ids.sort((a, b) => a - b)).toEqual([...data.train]);
  }
}

describe("elastic world size", () => {
  test("parameter-server mode (BSP): trainers 2 -> 3 at one step and 3 -> 2 at another while shards go 2 -> 3; every sample once per epoch, every step applied once", async () => {
    await using mesh = await startMesh("mt-elastic-ps-", { trainers: 3, shards: 3 });
    await using client = await MeshClient.connect(mesh.url, mesh.auth());
    const cfg = config({ job: "default.elastic-ps", trainers: 2, shards: 2 });
    const seen: Event[] = [];
    const resizes: Promise<unknown>[] = [];
    let phase = 0;
    await client.submit(cfg, { membersWaitMs: 60_000 });
    const r = await watchJob(client, cfg.job, {
      quiet: true,
      onEvent: (e) => {
        seen.push(e);
        if (e.kind !== EventKind.Step || e.rank !== 0) return;
        if (phase === 0 && e.step >= 60) {
          phase = 1;
          resizes.push(client.resize(cfg.job, { trainers: 3 }));
        } else if (phase === 1 && e.step >= 250 && seen.some((x) => x.kind === EventKind.Step && x.rank === 2)) {
          phase = 2;
          resizes.push(client.resize(cfg.job, { trainers: 2, shards: 3 }));
        }
      },
    });
    const manifests = (await Promise.all(resizes)) as { step: number }[];
    expect(r.record.state).toBe(JobState.Done);
    const final = jobConfigFromJson(r.record.configJson);
    const [t1, t2] = manifests.map((m) => m.step);
    expect(final.world).toEqual([
      { from: 0, trainers: 2 },
      { from: t1!, trainers: 3 },
      { from: t2!, trainers: 2 },
    ]);
    expect([final.trainers, final.shards]).toEqual([2, 3]);
    console.log(
      `trainers 2 -> 3 from step ${t1}, 3 -> 2 and shards 2 -> 3 from step ${t2}; ${r.record.totalSteps} steps; accuracy ${(r.record.accuracy * 100).toFixed(2)}%`,
    );
    expect(r.record.accuracy).toBeGreaterThan(0.93);
    expectEverySampleOncePerEpoch(final, seen);
    // the learning rate follows the trainers (scaleLr: lr x trainers), on the schedule of the job's steps as they stood then
    const cfgAt = (step: number) => {
      const world = final.world.filter((c) => c.from <= step);
      return parseJobConfig({ ...final, world, trainers: world.at(-1)!.trainers });
    };
    // the plan of each world the job went through (planHere reads the data set: once per world, not per step)
    const plans = new Map<number, ReturnType<typeof planHere>>();
    const planAt = (step: number) => {
      const c = cfgAt(step);
      const key = c.world.length;
      if (!plans.has(key)) plans.set(key, planHere(c));
      return { c, plan: plans.get(key)! };
    };
    const lrs = effectiveEvents(seen).filter((e) => e.rank === 0);
    expect(lrs.length).toBe(r.record.totalSteps);
    for (const e of lrs) {
      const { c, plan } = planAt(e.step);
      expect(e.lr).toBeCloseTo(lrAt(c, plan, e.step), 6);
    }
    // 2 -> 3 trainers: the peak x1.5, so the rate jumps at t1 (by less than 1.5: the cosine runs over the new, shorter step count)
    expect(peakLr(cfgAt(t1!)) / peakLr(cfgAt(t1! - 1))).toBeCloseTo(1.5, 12);
    expect(lrs[t1!]!.lr).toBeGreaterThan(lrs[t1! - 1]!.lr);
    // the shards took the snapshot's chunks as the 3-shard ring says: about a third moved, all to the new shard
    const plan = planHere(final);
    const before = buildLayout(cfg.job, plan.slabNumel, plan.decayElems, cfg.chunkBytes, 2),
      after = buildLayout(cfg.job, plan.slabNumel, plan.decayElems, cfg.chunkBytes, 3);
    const moved = after.byShard[2]!.length / after.chunks.length;
    expect(after.byShard.slice(0, 2).every((ids, k) => ids.every((id) => before.byShard[k]!.includes(id)))).toBe(true);
    console.log(
      `shards 2 -> 3: ${after.byShard[2]!.length} of ${after.chunks.length} chunks moved (${(moved * 100).toFixed(0)}%)`,
    );
    // under BSP each step updates every chunk once: the final snapshot's versions count the steps applied
    const byShard = finalChunkVersions(r.record);
    expect([...byShard.keys()].map((n) => n.split("-")[1]).sort()).toEqual(["0", "1", "2"]);
    const versions = [...byShard.values()].flat();
    expect(versions.length).toBe(after.chunks.length);
    expect(new Set(versions)).toEqual(new Set([r.record.totalSteps]));
  }, 600_000);

  test("all-reduce mode: trainers 2 -> 3 live, then the job is stopped and resumed on 2 (its loader cursors translated); every sample once per epoch", async () => {
    await using mesh = await startMesh("mt-elastic-ar-", { trainers: 3 });
    await using client = await MeshClient.connect(mesh.url, mesh.auth());
    const cfg = config({ job: "default.elastic-ar", sync: "allreduce", trainers: 2 });
    const seen: Event[] = [];
    let grown: Promise<{ step: number }> | null = null;
    let grownAt = -1;
    let stopped = false;
    await client.submit(cfg, { membersWaitMs: 60_000 });
    const first = await watchJob(client, cfg.job, {
      quiet: true,
      onEvent: (e) => {
        seen.push(e);
        if (grown === null && e.kind === EventKind.Step && e.rank === 0 && e.step >= 60) {
          grown = client.resize(cfg.job, { trainers: 3 });
          void grown.then((m) => (grownAt = m.step));
        }
        // stopped once a snapshot of the 3 trainers' steps is on disk
        if (!stopped && grownAt >= 0 && e.kind === EventKind.Checkpoint && e.step > grownAt) {
          stopped = true;
          void client.cancel(cfg.job);
        }
      },
    }).catch((e: unknown) => {
      if (!(e instanceof JobFailedError)) throw e;
      return { record: e.record };
    });
    expect(first.record!.state).toBe(JobState.Cancelled);
    const t1 = (await grown!)!.step;
    // resumed on 2 trainers: the world changes at the newest snapshot's step
    await client.submit({ ...cfg, trainers: 2 }, { membersWaitMs: 60_000 });
    const r = await watchJob(client, cfg.job, { quiet: true, onEvent: (e) => seen.push(e) });
    expect(r.record.state).toBe(JobState.Done);
    const final = jobConfigFromJson(r.record.configJson);
    expect(final.world.map((c) => c.trainers)).toEqual([2, 3, 2]);
    expect(final.world[1]!.from).toBe(t1);
    console.log(
      `all-reduce: trainers 2 -> 3 from step ${t1}, resumed on 2 from step ${final.world[2]!.from}; ${r.record.totalSteps} steps; accuracy ${(r.record.accuracy * 100).toFixed(2)}%`,
    );
    expect(r.record.accuracy).toBeGreaterThan(0.93);
    expectEverySampleOncePerEpoch(final, seen);
  }, 600_000);
});
