// Snapshots in the background, on a real mesh with a slow disk (the checkpoint service's
// test-only write delay): trainer rank 0 waits at a snapshot's step boundary only for the state
// to be cut, not for the write; a checkpoint service SIGKILLed in the middle of a background
// write leaves every snapshot on disk good, and the job finishes.
import { afterAll, expect, test } from "bun:test";
import { readdirSync } from "node:fs";
import { join } from "node:path";
import { EventKind, JobState } from "../../schemas/messages/job.ts";
import { CheckpointStore } from "../../services/checkpoint/store.ts";
import { MeshClient } from "../../sdk/client.ts";
import { removeTempDirs } from "../helpers/mesh.ts";
import { atRank0Step, expectEveryStepOnce, mlpJob, runJob, startMesh } from "../helpers/mesh-jobs.ts";

afterAll(removeTempDirs);

// a write takes longer than any cut, and less than the 100 steps between snapshots (about 1.5 s here)
const writeDelayMs = 600;

test("rank 0 waits only for a snapshot's cut, not its write; a checkpoint service killed mid-write leaves every snapshot good and the job finishes", async () => {
  const lines: string[] = [];
  await using mesh = await startMesh("mt-snapshots-", {
    serviceEnv: { checkpoint: { MT_WRITE_DELAY_MS: String(writeDelayMs) } },
    onEvent: (l) => lines.push(l),
  });
  await using client = await MeshClient.connect(mesh.url, mesh.auth());
  const cfg = mlpJob({ job: "default.snapshots", epochs: 2, checkpointEvery: 100 });
  // the snapshot of step 200 is being written (for 0.6 s at least): kill the checkpoint service now
  const kill = atRank0Step(
    (e) => e.step === 200 && e.snapshotMs > 0,
    () => mesh.kill("checkpoint", "SIGKILL"),
  );
  const r = await runJob(client, cfg, kill.onEvent);
  const seen = r.seen;
  expect(r.record.state).toBe(JobState.Done);
  expect(kill.step).toBe(200);
  expect(lines.some((l) => l.includes("checkpoint died (signal SIGKILL); restarting"))).toBe(true);
  // rank 0's waits at its snapshot boundaries: each far shorter than a write
  const waits = seen
    .filter((e) => e.kind === EventKind.Step && e.rank === 0 && e.snapshotMs > 0)
    .map((e) => e.snapshotMs);
  console.log(
    `rank 0 waited ${waits.map((w) => w.toFixed(0)).join(", ")} ms at its snapshots (each write takes over ${writeDelayMs} ms)`,
  );
  expect(waits.length).toBeGreaterThanOrEqual(3);
  for (const w of waits) expect(w).toBeLessThan(writeDelayMs / 2);
  // the snapshot cut at step 200 never reached the disk; no half-written one is listed, every one listed verifies
  const store = new CheckpointStore(mesh.opts.jobsDir);
  const listed = store.list(cfg.job);
  expect(listed.map((m) => m.step)).not.toContain(200);
  for (const m of listed) expect(store.read(cfg.job, m.id).manifest.id).toBe(m.id);
  expect(readdirSync(join(mesh.opts.jobsDir, cfg.job)).filter((f) => f.startsWith(".tmp-"))).toEqual([]);
  // every step once
  expectEveryStepOnce(seen, 2, r.record.totalSteps);
}, 300_000);
