// Faults across hosts, on the mesh of four hosts of test/helpers/hosts.ts (links at 1 Gbit/s;
// host 2 runs trainers 2 and 3 and shard 1, and uses host 3's NATS server):
//   - host 3 cut off (one NATS server of three): the job names the server within 10 s, the
//     processes it served move to the other two, and the job carries on to Done without it;
//   - host 2 cut off mid-job (its link down, its processes running): the job names the host and
//     its ranks within 10 s. A BSP job waits for it and, once the link is back, carries on from
//     where it was; an all-reduce job's collective gives up (after the 15 s the helper's mesh
//     sets) and every rank restores from the newest snapshot once the host is back. Either ends
//     Done with every step once, at the fault-free accuracy within 0.3%;
//   - 1% of host 2's packets dropped: Done at the fault-free accuracy within 0.3%.
// Each job is the same MNIST MLP; its fault-free accuracy is measured on the same mesh first.
// Skips where namespaces cannot be made.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { type Event, EventKind, JobState } from "../../schemas/messages/job.ts";
import { type JobConfig, jobConfigFromJson } from "../../services/runtime/job/config.ts";
import { jobSpecsFollowedAgain } from "../../services/runtime/job/ledger.ts";
import { type HostBed, testBedProblem } from "../../testbed/hosts.ts";
import { type HostMesh, hostLabel } from "../../testbed/mesh.ts";
import { collTimeoutMs, fourHosts } from "../helpers/hosts.ts";
import { finalChunkVersions } from "../helpers/jobs.ts";
import { expectEveryStepOnce, mlpJob, runJob } from "../helpers/mesh-jobs.ts";
import { removeTempDirs, waitFor } from "../helpers/mesh.ts";
import { skip } from "../helpers/skip.ts";

afterAll(removeTempDirs);

const job = (name: string, over: Partial<JobConfig> = {}) =>
  mlpJob({ job: `default.${name}`, trainers: 4, shards: 2, checkpointEvery: 20, ...over });

/**
 * Cuts host `host` off at the first step event from `atStep` on, of any rank (one rank's events
 * can be late or lost: they are telemetry), and brings it back `forMs` later (never when forMs is
 * Infinity); remembers when the first event `named` accepts came, after the cut.
 */
function cutOff(bed: HostBed, host: number, atStep: number, forMs: number, named: (e: Event) => boolean) {
  let cutMs = -1;
  const said: { afterMs: number; text: string }[] = [];
  const healed = Promise.withResolvers<void>();
  const timers: ReturnType<typeof setTimeout>[] = [];
  return {
    said,
    healed: healed.promise,
    /** whether the host was cut off (the job may end before an event of the step reaches the test) */
    get done() {
      return cutMs >= 0;
    },
    onEvent(e: Event) {
      if (cutMs < 0 && e.kind === EventKind.Step && e.step >= atStep) {
        cutMs = performance.now();
        bed.cut(host);
        if (Number.isFinite(forMs))
          timers.push(
            setTimeout(() => {
              bed.heal(host);
              healed.resolve();
            }, forMs),
          );
      }
      if (cutMs >= 0 && named(e)) said.push({ afterMs: performance.now() - cutMs, text: e.text });
    },
    /** brings the host back now if it is still cut off */
    heal() {
      for (const t of timers) clearTimeout(t);
      if (!bed.linked(host)) bed.heal(host);
      healed.resolve();
    },
  };
}

/** A BSP job applied every step once: each chunk's version in the final snapshot counts the
 *  steps applied (its events are telemetry, and one sent as a link went down can be lost). */
function expectEveryStepApplied(record: Parameters<typeof finalChunkVersions>[0] & { totalSteps: number }): void {
  const versions = finalChunkVersions(record);
  expect(versions.size).toBe(2);
  for (const v of versions.values()) expect(new Set(v)).toEqual(new Set([record.totalSteps]));
}

/** How often each named process has said it follows the job specs again (it does once its connection is back). */
const followedAgain = (mesh: HostMesh, names: readonly string[]): number[] =>
  names.map((name) => readFileSync(join(mesh.logDir, `${name}.log`), "utf8").split(jobSpecsFollowedAgain).length - 1);

/** Back from a cut, the named processes follow the job specs again (`before`: followedAgain before the cut). */
async function backInService(mesh: HostMesh, names: readonly string[], before: number[]): Promise<void> {
  const t0 = performance.now();
  await waitFor("the processes of the host that was cut off to follow the job specs again", () =>
    followedAgain(mesh, names).every((n, i) => n > before[i]!),
  );
  console.log(`back, its processes follow the job specs again after ${((performance.now() - t0) / 1000).toFixed(1)} s`);
}

const hostNamed = (host: number) => (e: Event) =>
  e.kind === EventKind.Stalled && e.text.startsWith(`host ${hostLabel(host)} is cut off or down: `);

describe.skipIf(skip("network namespaces", testBedProblem()))("faults across hosts", () => {
  let up: Awaited<ReturnType<typeof fourHosts>>;
  let faultFree = Number.NaN;
  const allreduce = { sync: "allreduce" as const, shards: 1 };
  let allReduceRun: Promise<number> | null = null;
  /** the all-reduce job's fault-free accuracy, measured on the same mesh before the tests */
  const allReduceFree = () =>
    (allReduceRun ??= runJob(up.client, job("hosts-ar-free", allreduce)).then((free) => {
      expect(free.record.state).toBe(JobState.Done);
      return free.record.accuracy;
    }));

  beforeAll(async () => {
    up = await fourHosts();
    // both fault-free jobs at once, before any fault
    const [r] = await Promise.all([runJob(up.client, job("hosts-free")), allReduceFree()]);
    expect(r.record.state).toBe(JobState.Done);
    faultFree = r.record.accuracy;
  }, 120_000);

  afterAll(async () => {
    await up?.[Symbol.asyncDispose]();
  });

  // first: host 2's processes have host 3's server as their home until a fault moves them
  test("one NATS server's host cut off: the job names the server within 10 s, its processes move to the other two, and the job ends Done without it at the fault-free accuracy", async () => {
    const { bed, client, mesh } = up;
    // the cluster's INFO names its servers host:port
    const url = mesh.nats.find((n) => n.host === 3)!.server.url.replace(/^nats:\/\//, "");
    const cut = cutOff(
      bed,
      3,
      40,
      Number.POSITIVE_INFINITY,
      (e) => e.kind === EventKind.Stalled && e.text.startsWith(`NATS server ${url} left the cluster`),
    );
    try {
      const r = await runJob(client, job("hosts-nats-cut"), (e) => cut.onEvent(e));
      console.log(`named: ${cut.said[0]?.text} (after ${cut.said[0]?.afterMs.toFixed(0)} ms)`);
      expect(r.record.state).toBe(JobState.Done);
      expect(bed.linked(3)).toBe(false); // it ended without the server
      expect(cut.said[0]!.afterMs).toBeLessThan(10_000);
      expectEveryStepApplied(r.record);
      expect(Math.abs(r.record.accuracy - faultFree)).toBeLessThanOrEqual(0.003);
    } finally {
      cut.heal();
      // the next tests start on a whole cluster again
      await mesh.untilClustered();
    }
  }, 120_000);

  test("a host of trainers and a shard cut off for 12 s (BSP): named with its ranks within 10 s; once it is back the job carries on, every step once, at the fault-free accuracy", async () => {
    const { bed, client } = up;
    const cut = cutOff(bed, 2, 40, 12_000, hostNamed(2));
    const r = await runJob(client, job("hosts-cut"), (e) => cut.onEvent(e));
    cut.heal();
    console.log(`named: ${cut.said[0]?.text} (after ${cut.said[0]?.afterMs.toFixed(0)} ms)`);
    expect(cut.done, "a step event from step 40 on reached the test before the job ended").toBe(true);
    expect(r.record.state).toBe(JobState.Done);
    expect(cut.said.length).toBeGreaterThan(0);
    expect(cut.said[0]!.afterMs).toBeLessThan(10_000);
    expect(cut.said[0]!.text).toMatch(/: shard 1, trainer 2, trainer 3 silent for \d+ s$/);
    expectEveryStepApplied(r.record);
    console.log(`accuracy ${r.record.accuracy} (fault-free ${faultFree})`);
    expect(Math.abs(r.record.accuracy - faultFree)).toBeLessThanOrEqual(0.003);
  }, 120_000);

  test("a host of trainers and a shard cut off for good, the job set to shrink after 10 s: it goes on without them from its newest snapshot, every step once, at the fault-free accuracy; back, they stay out of it", async () => {
    const { bed, client, mesh } = up;
    const cut = cutOff(bed, 2, 40, Number.POSITIVE_INFINITY, hostNamed(2));
    const seen: string[] = [];
    const followed = followedAgain(mesh, ["trainer-2", "trainer-3", "parameter-server-1"]);
    const t0 = performance.now();
    const r = await runJob(client, job("hosts-shrink", { shrinkAfterS: 10 }), (e) => {
      cut.onEvent(e);
      if (e.kind === EventKind.Log || e.kind === EventKind.Stalled) seen.push(e.text);
    });
    try {
      expect(cut.done, "a step event from step 40 on reached the test before the job ended").toBe(true);
      expect(r.record.state, r.record.reason).toBe(JobState.Done);
      expect(bed.linked(2)).toBe(false); // it ended without the host
      const goesOn = seen.find((t) => t.startsWith(`host ${hostLabel(2)} silent for `));
      console.log(`${goesOn}\n${seen.find((t) => t.startsWith("resized from step"))}`);
      console.log(`the job took ${((performance.now() - t0) / 1000).toFixed(1)} s`);
      expect(goesOn).toMatch(/: the job goes on without shard 1, trainer 2, trainer 3 \(trainers 2 shards 1\)$/);
      const final = jobConfigFromJson(r.record.configJson);
      expect([final.trainers, final.shards]).toEqual([2, 1]);
      // under BSP each step updates every chunk once, and shard 0 holds every chunk now
      const versions = finalChunkVersions(r.record);
      expect([...versions.keys()].length).toBe(1);
      expect(new Set([...versions.values()].flat())).toEqual(new Set([r.record.totalSteps]));
      console.log(`accuracy ${r.record.accuracy} over ${r.record.totalSteps} steps (fault-free ${faultFree})`);
      expect(Math.abs(r.record.accuracy - faultFree)).toBeLessThanOrEqual(0.003);
    } finally {
      cut.heal();
    }
    await backInService(mesh, ["trainer-2", "trainer-3", "parameter-server-1"], followed);
  }, 150_000);

  test("1% of a host's packets dropped: the job ends Done at the fault-free accuracy", async () => {
    const { bed, client } = up;
    bed.shape(2, { rateMbit: 1000, loss: 0.01 });
    try {
      const r = await runJob(client, job("hosts-lossy"));
      expect(r.record.state).toBe(JobState.Done);
      expectEveryStepApplied(r.record);
      console.log(`accuracy with 1% loss ${r.record.accuracy} (fault-free ${faultFree})`);
      expect(Math.abs(r.record.accuracy - faultFree)).toBeLessThanOrEqual(0.003);
    } finally {
      bed.shape(2, { rateMbit: 1000 });
    }
  }, 120_000);

  test("all-reduce: a host of trainers cut off for 5 s longer than the collective's timeout: named within 10 s; the collective gives up, and once the host is back every rank restores from the newest snapshot and the job ends Done at the fault-free accuracy", async () => {
    const { bed, client, mesh } = up;
    const free = await allReduceFree();
    const cut = cutOff(bed, 2, 40, collTimeoutMs + 5_000, hostNamed(2));
    const r = await runJob(client, job("hosts-ar-cut", allreduce), (e) => cut.onEvent(e));
    cut.heal();
    expect(r.record.state).toBe(JobState.Done);
    expect(cut.said[0]!.afterMs).toBeLessThan(10_000);
    expect(cut.said[0]!.text).toMatch(/: trainer 2, trainer 3 silent for \d+ s$/);
    const restores = r.seen.filter((e) => e.kind === EventKind.Restore);
    expect(restores.length).toBeGreaterThan(0);
    expect(restores[0]!.step).toBeLessThanOrEqual(40);
    expectEveryStepOnce(r.seen, 4, r.record.totalSteps);
    // the ranks that were cut off took the restore too: the world had moved on without them
    expect(readFileSync(join(mesh.logDir, "trainer-2.log"), "utf8")).toContain("job restored from a checkpoint");
    console.log(`accuracy ${r.record.accuracy} (fault-free ${free})`);
    expect(Math.abs(r.record.accuracy - free)).toBeLessThanOrEqual(0.003);
  }, 150_000);

  test("all-reduce: a host of trainers cut off for good, the job set to shrink after 10 s: it goes on with the other host's two, each a batch twice as large, at the fault-free accuracy", async () => {
    const { bed, client, mesh } = up;
    const cut = cutOff(bed, 2, 40, Number.POSITIVE_INFINITY, hostNamed(2));
    const followed = followedAgain(mesh, ["trainer-2", "trainer-3"]);
    const seen: string[] = [];
    const free = await allReduceFree();
    const cfg = job("hosts-ar-shrink", { ...allreduce, shrinkAfterS: 10 });
    const r = await runJob(client, cfg, (e) => {
      cut.onEvent(e);
      if (e.kind === EventKind.Log) seen.push(e.text);
    });
    try {
      expect(cut.done, "a step event from step 40 on reached the test before the job ended").toBe(true);
      expect(r.record.state, r.record.reason).toBe(JobState.Done);
      expect(seen.find((t) => t.startsWith(`host ${hostLabel(2)} silent for `))).toMatch(
        /: the job goes on without trainer 2, trainer 3 \(trainers 2 shards 1\)$/,
      );
      const resized = seen.find((t) => t.startsWith("resized from step"));
      console.log(resized);
      expect(resized).toMatch(/trainers 4 -> 2, shards 1 -> 1, each trainer's batch 128 -> 256/);
      const final = jobConfigFromJson(r.record.configJson);
      expect([final.trainers, final.batchSize, final.accumSteps]).toEqual([2, 256, 2]);
      console.log(`accuracy ${r.record.accuracy} (fault-free ${free})`);
      expect(Math.abs(r.record.accuracy - free)).toBeLessThanOrEqual(0.003);
    } finally {
      cut.heal();
    }
    await backInService(mesh, ["trainer-2", "trainer-3"], followed);
  }, 150_000);
});
