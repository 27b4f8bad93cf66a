// A chaos test across hosts, seeded (MT_CHAOS_SEED), on the mesh of four hosts of
// test/helpers/hosts.ts: while a BSP job of two epochs runs, three faults one after another,
// each drawn from
//   - host 2 (trainers 2 and 3, shard 1) cut off for 6-12 s;
//   - host 3 (one NATS server of three) cut off for 6-12 s;
//   - 1% of host 1's or host 2's packets dropped for 4 s;
//   - a trainer or a shard SIGKILLed and started again on its host (an orchestrator's restart);
// at seeded steps of rank 0. It prints what it did. The job ends Done with every step applied
// once, at its fault-free accuracy (measured on the same mesh first) within 0.3%. Skips where
// namespaces cannot be made.
import { afterAll, describe, expect, test } from "bun:test";
import { Rng } from "../../engine/rng.ts";
import { type Event, EventKind, JobState } from "../../schemas/messages/job.ts";
import { testBedProblem } from "../../testbed/hosts.ts";
import { fourHosts } from "../helpers/hosts.ts";
import { finalChunkVersions } from "../helpers/jobs.ts";
import { mlpJob, runJob } from "../helpers/mesh-jobs.ts";
import { removeTempDirs } from "../helpers/mesh.ts";
import { skip } from "../helpers/skip.ts";

afterAll(removeTempDirs);

const seed = Number(process.env.MT_CHAOS_SEED ?? 41);

type Mesh = Awaited<ReturnType<typeof fourHosts>>;

interface Fault {
  what: string;
  /** does it; resolves once the fault is over (the link back, the process started again) */
  run(up: Mesh): Promise<void>;
}

function drawFault(rng: Rng): Fault {
  const secs = 6 + rng.int(7);
  const services = ["trainer-0", "trainer-1", "trainer-2", "trainer-3", "parameter-server-0", "parameter-server-1"];
  const cut = (host: number, why: string): Fault => ({
    what: `host ${host} (${why}) cut off for ${secs} s`,
    async run({ bed, mesh }) {
      bed.cut(host);
      await Bun.sleep(secs * 1000);
      bed.heal(host);
      if (host === 3) await mesh.untilClustered();
    },
  });
  switch (rng.int(4)) {
    case 0:
      return cut(2, "trainers 2 and 3, shard 1");
    case 1:
      return cut(3, "a NATS server");
    case 2: {
      const host = 1 + rng.int(2);
      return {
        what: `1% of host ${host}'s packets dropped for 4 s`,
        async run({ bed }) {
          bed.shape(host, { rateMbit: 1000, loss: 0.01 });
          await Bun.sleep(4000);
          bed.shape(host, { rateMbit: 1000 });
        },
      };
    }
    default: {
      const name = services[rng.int(services.length)]!;
      return { what: `${name} SIGKILLed and started again`, run: ({ mesh }) => mesh.restart(name) };
    }
  }
}

describe.skipIf(skip("network namespaces", testBedProblem()))("chaos across hosts", () => {
  test(`three faults drawn with seed ${seed} (cuts, a NATS server's host, loss, restarts) during a BSP job: Done, every step applied once, at the fault-free accuracy`, async () => {
    await using up = await fourHosts();
    const job = (name: string) =>
      mlpJob({ job: `default.${name}`, trainers: 4, shards: 2, epochs: 2, checkpointEvery: 20 });
    const free = await runJob(up.client, job("chaos-free"));
    expect(free.record.state).toBe(JobState.Done);
    const rng = new Rng(seed);
    const total = free.record.totalSteps;
    const faults = [0, 1, 2].map((i) => ({
      atStep: Math.floor(((i + 0.2 + rng.uniform() * 0.6) * total) / 4),
      fault: drawFault(rng),
    }));
    const did: string[] = [];
    let next = 0;
    let running: Promise<void> = Promise.resolve();
    const onEvent = (e: Event) => {
      // one fault at a time: the next one's step counts once the one before is over
      if (next >= faults.length || e.kind !== EventKind.Step || e.rank !== 0 || e.step < faults[next]!.atStep) return;
      const { atStep, fault } = faults[next++]!;
      running = running.then(async () => {
        const t0 = performance.now();
        await fault.run(up);
        did.push(`at step ${atStep}: ${fault.what} (${((performance.now() - t0) / 1000).toFixed(1)} s)`);
      });
    };
    const r = await runJob(up.client, job("chaos"), onEvent);
    await running;
    console.log(`seed ${seed}:\n  ${did.join("\n  ")}`);
    console.log(`accuracy ${r.record.accuracy} (fault-free ${free.record.accuracy})`);
    expect(r.record.state).toBe(JobState.Done);
    expect(did.length).toBe(faults.length);
    const versions = finalChunkVersions(r.record);
    for (const v of versions.values()) expect(new Set(v)).toEqual(new Set([r.record.totalSteps]));
    expect(Math.abs(r.record.accuracy - free.record.accuracy)).toBeLessThanOrEqual(0.003);
  }, 240_000);
});
