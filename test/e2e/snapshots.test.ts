// Snapshots in the background, on a real mesh with a slow disk (the checkpoint service's
// test-only write delay): trainer rank 0 waits at a snapshot's step boundary only for the state
// to be cut, not for the write; a checkpoint service SIGKILLed in the middle of a background
// write leaves every snapshot on disk good, and the job finishes.
import { afterAll, expect, test } from "bun:test";
import { readdirSync } from "node:fs";
import { join } from "node:path";
import { type Event, EventKind, JobState } from "../../schemas/messages.ts";
import { CheckpointStore } from "../../services/checkpoint/store.ts";
import { jobDefaults, parseJobConfig } from "../../services/runtime/job/job.ts";
import { MeshClient } from "../../sdk/client.ts";
import { LocalMesh } from "../../sdk/launcher.ts";
import { watchJob } from "../../sdk/watch.ts";
import { effectiveSteps } from "../helpers/jobs.ts";
import { removeTempDirs, tempDir } from "../helpers/mesh.ts";

afterAll(removeTempDirs);

// a write takes longer than any cut, and less than the 100 steps between snapshots (about 1.5 s here)
const writeDelayMs = 600;

test("rank 0 waits only for a snapshot's cut, not its write; a checkpoint service killed mid-write leaves every snapshot good and the job finishes", async () => {
  const dir = tempDir("mt-snapshots-");
  const lines: string[] = [];
  await using mesh = await LocalMesh.start({
    jobsDir: join(dir, "jobs"),
    logDir: join(dir, "logs"),
    serviceEnv: { checkpoint: { MT_WRITE_DELAY_MS: String(writeDelayMs) } },
    onEvent: (l) => lines.push(l),
  });
  await using client = await MeshClient.connect(mesh.url, mesh.auth());
  const cfg = parseJobConfig({
    ...jobDefaults,
    job: "default.snapshots",
    model: { kind: "mlp", widths: [784, 64, 10], dropout: 0 },
    epochs: 2,
    warmupSteps: 20,
    chunkBytes: 16 << 10,
    checkpointEvery: 100,
  });
  const seen: Event[] = [];
  let killedAt = -1;
  await client.submit(cfg, { membersWaitMs: 60_000 });
  const r = await watchJob(client, cfg.job, {
    quiet: true,
    onEvent: (e) => {
      seen.push(e);
      // the snapshot of step 200 is being written (for 0.6 s at least): kill the checkpoint service now
      if (killedAt < 0 && e.kind === EventKind.Step && e.rank === 0 && e.step === 200 && e.snapshotMs > 0) {
        killedAt = e.step;
        mesh.kill("checkpoint", "SIGKILL");
      }
    },
  });
  expect(r.record.state).toBe(JobState.Done);
  expect(killedAt).toBe(200);
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
  const store = new CheckpointStore(join(dir, "jobs"));
  const listed = store.list(cfg.job);
  expect(listed.map((m) => m.step)).not.toContain(200);
  for (const m of listed) expect(store.read(cfg.job, m.id).manifest.id).toBe(m.id);
  expect(readdirSync(join(dir, "jobs", cfg.job)).filter((f) => f.startsWith(".tmp-"))).toEqual([]);
  // every step once
  const steps = effectiveSteps(seen, 2);
  for (const rank of [0, 1]) expect(steps[rank]).toEqual(Array.from({ length: r.record.totalSteps }, (_, i) => i));
}, 300_000);
