// The mesh across hosts of the test bed (testbed/mesh.ts), links shaped to 1 Gbit/s: a NATS
// cluster of three servers on hosts 0, 1 and 3, the data-loader and the checkpoint service on
// host 0, a shard on each of hosts 1 and 2, two trainers on each of hosts 1 and 2 (host 2's
// services have host 3's server as their home). Every trainer reports its host, and a BSP job
// finishes Done at the accuracy it has on one host. A slow host (its link shaped to 20 Mbit/s):
// the straggler detector names its trainers, and an SSP job finishes Done. Skips where
// namespaces cannot be made.
import { afterAll, describe, expect, test } from "bun:test";
import { EventKind, JobState } from "../../schemas/messages/job.ts";
import { testBedProblem } from "../../testbed/hosts.ts";
import { hostLabel } from "../../testbed/mesh.ts";
import { fourHosts } from "../helpers/hosts.ts";
import { mlpJob, runJob } from "../helpers/mesh-jobs.ts";
import { removeTempDirs } from "../helpers/mesh.ts";
import { skip } from "../helpers/skip.ts";

afterAll(removeTempDirs);

describe.skipIf(skip("network namespaces", testBedProblem()))("the mesh across hosts", () => {
  test("a BSP job across 4 hosts on a NATS cluster of three: each trainer reports its host, the job finishes Done", async () => {
    await using up = await fourHosts();
    const { mesh, client } = up;
    expect((await client.members()).trainerHosts).toEqual({
      0: hostLabel(1),
      1: hostLabel(1),
      2: hostLabel(2),
      3: hostLabel(2),
    });
    const r = await runJob(client, mlpJob({ job: "default.hosts", trainers: 4, shards: 2, checkpointEvery: 40 }));
    expect(r.record.state).toBe(JobState.Done);
    expect(r.record.accuracy).toBeGreaterThan(0.9);
    // nothing ran on host 3 but its NATS server
    expect(mesh.pidsOn(3)).toEqual([mesh.nats.find((n) => n.host === 3)!.server.pid]);
  }, 300_000);

  test("a slow host (its link at 20 Mbit/s, the others at 1 Gbit/s): the straggler detector names its trainers, and an SSP job keeps the fast host ahead within its staleness and finishes Done", async () => {
    await using up = await fourHosts();
    const { bed, mesh, client } = up;
    bed.shape(2, { rateMbit: 20 });
    const r = await runJob(
      client,
      mlpJob({
        job: "default.hosts-slow",
        trainers: 4,
        // one shard, on host 1: the slow link carries host 2's trainers' pushes and pulls alone (a
        // shard on host 2 would slow every trainer's push to it)
        shards: 1,
        sync: "ssp",
        staleness: 4,
        // SSP applies each of the 4 trainers' pushes whole, where BSP applies their average: the
        // BSP job's lr over 4 takes the same step per sample. At the BSP job's 0.1 (with momentum
        // 0.9), stale pushes applied four times as hard overshot: 38% once in CI
        lr: 0.025,
        checkpointEvery: 0,
        maxSteps: 60,
      }),
    );
    const events = r.seen.filter((e) => e.kind === EventKind.Straggler && / is a straggler/.test(e.text));
    for (const e of events) console.log(e.text);
    const named = events.map((e) => Number(/^trainer (\d+)/.exec(e.text)?.[1]));
    console.log(`stragglers named: ${named.map((k) => `trainer ${k} (${hostLabel(k < 2 ? 1 : 2)})`).join(", ")}`);
    console.log(`accuracy ${(r.record.accuracy * 100).toFixed(2)}% after 60 steps of SSP`);
    expect(r.record.state).toBe(JobState.Done);
    // 60 steps of SSP, a third of them on stale parameters: it learns (chance is 10%; 93.7-93.8% in
    // three runs here beside a CPU load, where lr 0.1 gave 79-92% and once 38%). The fault-free
    // accuracy is the whole epoch's, above
    expect(r.record.accuracy).toBeGreaterThan(0.5);
    // the slow host's trainers (2 and 3), and no other
    expect(named.length).toBeGreaterThan(0);
    expect(named.every((k) => k === 2 || k === 3)).toBe(true);
    // SSP keeps the fast host's pace within its bound: its trainers run ahead of the slow host's,
    // and no trainer gets more than the staleness ahead of the slowest. The events show more than
    // the shards' clocks (a pull may run 1 step past the slowest's last push, a step's event is
    // sent after its push, and the slow host's events cross its slow link): up to 6 here, so 7 is
    // the bound (without SSP's bound the fast host would be tens of steps ahead by the end)
    const last = [-1, -1, -1, -1];
    let ahead = 0;
    let spread = 0;
    for (const e of r.seen) {
      if (e.kind !== EventKind.Step || e.rank > 3) continue;
      last[e.rank] = Math.max(last[e.rank]!, e.step);
      if (last.some((x) => x < 0)) continue;
      ahead = Math.max(ahead, Math.min(last[0]!, last[1]!) - Math.max(last[2]!, last[3]!));
      spread = Math.max(spread, Math.max(...last) - Math.min(...last));
    }
    console.log(
      `the fast host's trainers ran ahead of the slow host's by up to ${ahead} steps; the spread was at most ${spread} (staleness 4)`,
    );
    expect(ahead).toBeGreaterThan(0);
    expect(spread).toBeLessThanOrEqual(4 + 3);
  }, 300_000);
});
