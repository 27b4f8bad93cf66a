// The chaos test: one BSP job during which every kind of process of the mesh (trainers, shards,
// the data-loader, the checkpoint service and the NATS server) is SIGKILLed, twelve times at
// seeded moments, some within 2 s of each other. The job finishes within 0.3% of the same job's
// fault-free accuracy; every step is applied exactly once (each chunk's version in the final
// snapshot counts the updates applied to it: one per step under BSP), and with batches a pure
// function of (rank, step), every sample is seen exactly once per epoch. The schedule is printed;
// MT_CHAOS_SEED replays it.
import { afterAll, expect, test } from "bun:test";
import { Rng } from "../../engine/rng.ts";
import { loadMnist } from "../../engine/data/mnist.ts";
import { EventKind, JobState } from "../../schemas/messages/job.ts";
import { JobData } from "../../services/data-loader/loader.ts";
import { defaultOwner, qualifyJob } from "../../services/runtime/job/subjects.ts";
import { type JobConfig } from "../../services/runtime/job/config.ts";
import { MeshClient } from "../../sdk/client.ts";
import { finalChunkVersions, longestWaits } from "../helpers/jobs.ts";
import { removeTempDirs } from "../helpers/mesh.ts";
import { mlpJob, runJob, startMesh, stepPacer } from "../helpers/mesh-jobs.ts";

afterAll(removeTempDirs);

const seed = Number(process.env.MT_CHAOS_SEED ?? 1123);
const targets = [
  "trainer-0",
  "trainer-1",
  "parameter-server-0",
  "parameter-server-1",
  "data-loader",
  "checkpoint",
  "nats-server",
] as const;

interface Fault {
  target: (typeof targets)[number];
  /** fires when rank 0 reports this step (again, after a restore rewound it) ... */
  atStep?: number;
  /** ... or this long after the fault before it */
  afterMs?: number;
}

/** Twelve faults: every target once, five more at random; four of them within 2 s of the one before. */
function schedule(rng: Rng, totalSteps: number): Fault[] {
  const picks: Fault["target"][] = [...targets, ...Array.from({ length: 5 }, () => targets[rng.int(targets.length)]!)];
  for (let i = picks.length - 1; i > 0; i--) {
    const j = rng.int(i + 1);
    [picks[i], picks[j]] = [picks[j]!, picks[i]!];
  }
  const close = new Set<number>();
  while (close.size < 4) close.add(1 + rng.int(picks.length - 1));
  const steps = Array.from({ length: picks.length }, () => 20 + rng.int(Math.floor(totalSteps * 0.75))).sort(
    (a, b) => a - b,
  );
  return picks.map((target, i) =>
    close.has(i) ? { target, afterMs: 300 + rng.int(1500) } : { target, atStep: steps[i]! },
  );
}

/** At most 50 steps/s until the last fault has fired: the 703-step job lasts 14 s or more, where a
 *  chain of faults takes under 8 s. The fault-free run, and the chaos run after its last fault,
 *  go at full speed (the trainers read the delay from a file at every step). */
const stepDelayMs = 20;

const describeFault = (f: Fault) =>
  `${f.target} ${f.atStep !== undefined ? `at step ${f.atStep}` : `${f.afterMs} ms after the one before`}`;

test("twelve SIGKILLs of every kind of process, some within 2 s of each other: the job finishes within 0.3% of the fault-free accuracy, every step applied once, every sample once per epoch", async () => {
  const lines: string[] = [];
  // while faults are to come every step takes at least stepDelayMs: the job must outlast its faults
  // (a fault that waits for its target's restart, then the ones timed after it, take seconds),
  // however fast the machine
  const pace = stepPacer(stepDelayMs);
  await using mesh = await startMesh("mt-chaos-all-", {
    env: pace.env,
    onEvent: (l) => lines.push(l),
  });
  await using client = await MeshClient.connect(mesh.url, mesh.auth());
  const config = (job: string): JobConfig =>
    mlpJob({ job: qualifyJob(job, defaultOwner), epochs: 3, checkpointEvery: 25 });

  const clean = await runJob(client, config("chaos-ref"));
  expect(clean.record.state).toBe(JobState.Done);

  const cfg = config("chaos-all");
  const data = new JobData(cfg, { kind: "mnist", data: loadMnist() });
  const faults = schedule(new Rng(seed), data.totalSteps);
  console.log(`chaos schedule (MT_CHAOS_SEED=${seed}): ${faults.map(describeFault).join("; ")}`);
  pace.on();
  const fired: string[] = [];
  let next = 0,
    timer: ReturnType<typeof setTimeout> | null = null;
  // a target the launcher is still restarting (killed just before) is killed once it is back
  const fire = async () => {
    const f = faults[next++]!;
    timer = setTimeout(() => {}, 1 << 30); // no other fault fires meanwhile
    const deadline = Date.now() + 60_000;
    for (;;) {
      const pid = f.target === "nats-server" ? mesh.nats.pid : mesh.pid(f.target);
      try {
        process.kill(pid, "SIGKILL");
        fired.push(`${describeFault(f)} (pid ${pid})`);
        break;
      } catch (e) {
        if ((e as { code?: string }).code !== "ESRCH" || Date.now() > deadline) throw e;
        await Bun.sleep(100);
      }
    }
    clearTimeout(timer);
    timer = null;
    if (next === faults.length) pace.off();
    const after = faults[next];
    if (after?.afterMs !== undefined) timer = setTimeout(() => void fire(), after.afterMs);
  };
  const r = await runJob(client, cfg, (e) => {
    const f = faults[next];
    if (timer === null && f?.atStep !== undefined && e.kind === EventKind.Step && e.rank === 0 && e.step >= f.atStep)
      void fire();
  });
  if (timer !== null) clearTimeout(timer);
  console.log(`fired: ${fired.join("; ")}`);
  console.log(
    `accuracy ${(r.record.accuracy * 100).toFixed(2)}% (fault-free ${(clean.record.accuracy * 100).toFixed(2)}%); ${r.seen.filter((e) => e.kind === EventKind.Restore).length} restores`,
  );
  console.log(`longest waits between two steps: ${longestWaits(r.seen, 4)}`);
  expect(r.record.state).toBe(JobState.Done);
  expect(fired.length).toBe(faults.length);
  for (const t of targets) expect(fired.some((f) => f.startsWith(`${t} `))).toBe(true);
  expect(Math.abs(r.record.accuracy - clean.record.accuracy)).toBeLessThanOrEqual(0.003);
  // every step applied exactly once: under BSP each step updates every chunk once, so the final
  // snapshot's versions all count the job's steps
  expect(new Set([...finalChunkVersions(r.record).values()].flat())).toEqual(new Set([data.totalSteps]));
  // each step's update took each rank's batch of that step (a pure function of rank and step): so
  // each epoch's samples went into the model exactly once
  for (let epoch = 0; epoch < cfg.epochs; epoch++) {
    const ids: number[] = [];
    const end = data.steps.epochStarts[epoch + 1] ?? data.totalSteps;
    for (let s = data.steps.epochStarts[epoch]!; s < end; s++)
      for (const rank of [0, 1]) ids.push(...data.trainIds(rank, s));
    expect(ids.sort((a, b) => a - b)).toEqual([...data.train]);
  }
}, 900_000);
