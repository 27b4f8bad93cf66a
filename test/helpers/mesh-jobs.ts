// Helpers of the end-to-end tests on a local mesh: the small MNIST job most of them run, a mesh
// in a fresh folder, a job watched to its end with its events kept, a fault fired at a step, the
// checks of a job's steps that several tests make, and the SIGKILL chaos run that the
// parameter-server and all-reduce tests share.
import { expect } from "bun:test";
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { type Event, EventKind } from "../../schemas/messages/job.ts";
import { planHere } from "../../services/data-loader/loader.ts";
import { type JobConfig, jobDefaults, parseJobConfig } from "../../services/runtime/job/config.ts";
import { MeshClient } from "../../sdk/client.ts";
import { LocalMesh, type MeshOptions } from "../../sdk/local-mesh.ts";
import { type JobOutcome, watchJob } from "../../sdk/watch.ts";
import { effectiveSteps } from "./jobs.ts";
import { tempDir } from "./mesh.ts";

/**
 * An MLP job on MNIST (784-64-10, one epoch, a 20-step warmup) with `over` on top. 16 KB chunks:
 * the 204 KB model is cut into 13 chunks, so both shards own some.
 */
export function mlpJob(over: Partial<JobConfig>): JobConfig {
  return parseJobConfig({
    ...jobDefaults,
    model: { kind: "mlp", widths: [784, 64, 10], dropout: 0 },
    epochs: 1,
    warmupSteps: 20,
    chunkBytes: 16 << 10,
    ...over,
  });
}

/**
 * A job's pace for a test: `env` gives the mesh's trainers a step delay they read from a file at
 * every step (MT_STEP_DELAY_FILE); on() makes every step sleep `ms` (while faults are to come, so
 * that the job outlasts them however fast the machine), off() lets it run at full speed. Off at first.
 */
export function stepPacer(ms: number): { env: Record<string, string>; on(): void; off(): void } {
  const file = join(tempDir("mt-pace-"), "step-delay-ms");
  return {
    env: { MT_STEP_DELAY_FILE: file },
    on: () => writeFileSync(file, String(ms)),
    off: () => writeFileSync(file, "0"),
  };
}

/** A local mesh whose jobs and logs live in a fresh temporary folder (the file calls afterAll(removeTempDirs)). */
export function startMesh(prefix: string, opts: Omit<MeshOptions, "jobsDir" | "logDir"> = {}): Promise<LocalMesh> {
  const dir = tempDir(prefix);
  return LocalMesh.start({ jobsDir: join(dir, "jobs"), logDir: join(dir, "logs"), ...opts });
}

/** Submits `cfg` and watches it to its end: its outcome, and every event it sent (each passed to `onEvent` too). */
export async function runJob(
  client: MeshClient,
  cfg: JobConfig,
  onEvent?: (e: Event) => void,
): Promise<JobOutcome & { seen: Event[] }> {
  const seen: Event[] = [];
  // subscribed before the submit: a resumed job's Restore can come before a watch would start
  const events = client.events(cfg.job);
  await client.submit(cfg, { membersWaitMs: 60_000 });
  const outcome = await watchJob(client, cfg.job, {
    quiet: true,
    events,
    onEvent: (e) => {
      seen.push(e);
      onEvent?.(e);
    },
  });
  return { ...outcome, seen };
}

/**
 * An onEvent that calls `act` once, at the first Step event of rank 0 from step `at` on (a
 * number), or the first that `at` accepts (a function); `step` is that event's step (-1 until
 * then), `atMs` when act was called (Date.now(), the clock the events' timeMs use).
 */
export function atRank0Step(
  at: number | ((e: Event) => boolean),
  act: () => void,
): { step: number; atMs: number; onEvent: (e: Event) => void } {
  const accepts = typeof at === "number" ? (e: Event) => e.step >= at : at;
  const trigger = {
    step: -1,
    atMs: -1,
    onEvent: (e: Event) => {
      if (trigger.step >= 0 || e.kind !== EventKind.Step || e.rank !== 0 || !accepts(e)) return;
      trigger.step = e.step;
      trigger.atMs = Date.now();
      act();
    },
  };
  return trigger;
}

/** Each rank's effective history (see effectiveSteps) is every step of the job once, in order; returns it. */
export function expectEveryStepOnce(seen: readonly Event[], trainers: number, totalSteps: number): number[][] {
  const steps = effectiveSteps(seen, trainers);
  const all = Array.from({ length: totalSteps }, (_, i) => i);
  expect(steps).toEqual(Array.from({ length: trainers }, () => all));
  return steps;
}

/** The job rewound at least once, first to a scheduled snapshot (every `checkpointEvery` steps) no newer than the kill at `killedAt`. */
function expectRestoredFromSnapshot(seen: readonly Event[], checkpointEvery: number, killedAt: number): void {
  const restores = seen.filter((e) => e.kind === EventKind.Restore);
  expect(restores.length).toBeGreaterThanOrEqual(1);
  expect(restores[0]!.step % checkpointEvery).toBe(0);
  expect(restores[0]!.step).toBeLessThanOrEqual(killedAt + 1);
}

/** Each step's loss over every rank's samples (weighted by their count), as the run ends: a restore drops the steps it rewound. */
export function stepLosses(events: readonly Event[]): Map<number, number> {
  const at = new Map<number, { sum: number; n: number }>();
  for (const e of events) {
    if (e.kind === EventKind.Restore) for (const k of [...at.keys()]) if (k >= e.step) at.delete(k);
    if (e.kind !== EventKind.Step || e.count === 0) continue;
    const a = at.get(e.step) ?? { sum: 0, n: 0 };
    a.sum += e.loss * e.count;
    a.n += e.count;
    at.set(e.step, a);
  }
  return new Map([...at].map(([k, a]) => [k, a.sum / a.n]));
}

/**
 * Runs `cfg` on a fresh mesh (startMesh with `meshOpts`) and SIGKILLs the services named in
 * `victims`, in that order, at rank 0's step 150. Checks that the kill came, that the launcher
 * restarted each victim, that the job rewound to a scheduled snapshot no newer than the kill,
 * learned (accuracy over 0.93), and that each rank's effective history is every step once;
 * returns the job's outcome and those histories.
 */
export async function runThroughSigkill(
  prefix: string,
  meshOpts: Omit<MeshOptions, "jobsDir" | "logDir" | "onEvent">,
  cfg: JobConfig,
  victims: readonly string[],
): Promise<JobOutcome & { steps: number[][] }> {
  const launcherLines: string[] = [];
  await using mesh = await startMesh(prefix, { ...meshOpts, onEvent: (l) => launcherLines.push(l) });
  await using client = await MeshClient.connect(mesh.url, mesh.auth());
  const kill = atRank0Step(150, () => {
    for (const name of victims) mesh.kill(name, "SIGKILL");
  });
  const r = await runJob(client, cfg, kill.onEvent);
  expect(kill.step).toBeGreaterThan(0);
  for (const name of victims)
    expect(launcherLines.some((l) => l.includes(`${name} died (signal SIGKILL); restarting`))).toBe(true);
  // the job's step when the kill came: the event of rank 0 that set it off reaches the test some
  // steps after it was sent on a loaded machine (a run restored step 160's snapshot, taken before
  // the kill, though the test saw step 150), so the newest step any rank made before that moment,
  // by the events' own clocks (this machine's)
  const killedAt = Math.max(
    kill.step,
    ...r.seen.filter((e) => e.kind === EventKind.Step && e.timeMs <= kill.atMs).map((e) => e.step),
  );
  expectRestoredFromSnapshot(r.seen, cfg.checkpointEvery, killedAt);
  expect(r.record.accuracy).toBeGreaterThan(0.93);
  return { ...r, steps: expectEveryStepOnce(r.seen, cfg.trainers, planHere(cfg).totalSteps) };
}
