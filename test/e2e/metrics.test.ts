// Prometheus metrics on the whole mesh: every service announces its /metrics endpoint in service
// discovery, and a scrape over HTTP while a job trains (and after) parses as the text format and
// carries what an operator watches: each trainer's step, loss and step split, the loader's
// batches, queue and wait, each shard's clocks and staleness, the checkpoint service's bytes and
// fsync latency, the bus traffic by subject kind, and the process metrics.
import { afterAll, describe, expect, test } from "bun:test";
import { join } from "node:path";
import parsePrometheus from "parse-prometheus-text-format";
import { EventKind, JobState } from "../../schemas/messages/job.ts";
import { MeshClient } from "../../sdk/client.ts";
import { watchJob } from "../../sdk/watch.ts";
import { removeTempDirs } from "../helpers/mesh.ts";
import { mlpJob, startMesh } from "../helpers/mesh-jobs.ts";

afterAll(removeTempDirs);

interface Family {
  name: string;
  type: string;
  metrics: {
    value?: string;
    labels?: Record<string, string>;
    buckets?: Record<string, string>;
    count?: string;
    sum?: string;
  }[];
}

async function scrapeAll(client: MeshClient): Promise<Map<string, Family[]>> {
  const out = new Map<string, Family[]>();
  for (const e of await client.metricsEndpoints()) {
    const res = await fetch(e.url);
    expect(res.status).toBe(200);
    expect(res.headers.get("content-type")).toContain("text/plain");
    out.set(e.service, parsePrometheus(await res.text()) as Family[]);
  }
  return out;
}

/** The values of a metric whose labels include `labels`. */
function values(families: Family[] | undefined, name: string, labels: Record<string, string> = {}): number[] {
  const f = families?.find((x) => x.name === name);
  if (f === undefined) return [];
  return f.metrics
    .filter((m) => Object.entries(labels).every(([k, v]) => m.labels?.[k] === v))
    .map((m) => Number(m.value ?? m.count));
}

describe("Prometheus metrics", () => {
  test("every service serves /metrics, found by service discovery; a scrape while a job trains and after it shows its steps, data, shards, snapshots and traffic", async () => {
    await using mesh = await startMesh("mt-metrics-", { trainers: 2, shards: 2 });
    await using client = await MeshClient.connect(mesh.url, mesh.auth());
    // mlpJob's small chunks: both shards own some
    const cfg = mlpJob({ job: "default.metrics", maxSteps: 150, checkpointEvery: 50 });
    await client.submit(cfg, { membersWaitMs: 60_000 });
    let during: Promise<Map<string, Family[]>> | null = null;
    const r = await watchJob(client, cfg.job, {
      quiet: true,
      onEvent: (e) => {
        if (during === null && e.kind === EventKind.Step && e.step >= 20) during = scrapeAll(client);
      },
    });
    expect(r.record.state).toBe(JobState.Done);
    const mid = await during!;
    const end = await scrapeAll(client);
    expect([...end.keys()]).toEqual([
      "checkpoint",
      "data-loader",
      "parameter-server 0",
      "parameter-server 1",
      "trainer 0",
      "trainer 1",
    ]);
    const job = { job: "default.metrics" };
    for (const [service, families] of end) {
      // the process and runtime, and the bus both ways
      expect(values(families, "process_resident_memory_bytes")[0]).toBeGreaterThan(10 << 20);
      expect(values(families, "mt_bus_bytes_total", { direction: "in" }).reduce((a, b) => a + b, 0)).toBeGreaterThan(0);
      expect(values(families, "mt_bus_bytes_total", { direction: "out" }).reduce((a, b) => a + b, 0)).toBeGreaterThan(
        0,
      );
      if (service.startsWith("trainer")) {
        expect(values(families, "mt_trainer_step", job)).toEqual([149]);
        expect(values(families, "mt_trainer_steps_total", job)[0]).toBeGreaterThanOrEqual(150);
        expect(values(families, "mt_trainer_step_seconds", { ...job, phase: "compute" })[0]).toBeGreaterThan(0);
        expect(values(families, "mt_trainer_loss", job)[0]).toBeLessThan(2.5);
        expect(values(families, "mt_trainer_samples_per_second", job)[0]).toBeGreaterThan(0);
        // a trainer pushes to the shards: its pushes' bytes under their kind
        expect(values(families, "mt_bus_bytes_total", { direction: "out", kind: "ps.push" })[0]).toBeGreaterThan(
          1 << 20,
        );
        // the backend's memory while the job ran (its context is freed with the job)
        expect(values(mid.get(service), "mt_device_memory_bytes", { device: "cpu" })[0]).toBeGreaterThan(0);
      }
    }
    const loader = mid.get("data-loader");
    expect(values(loader, "mt_loader_batches_total", job)[0]).toBeGreaterThanOrEqual(40);
    expect(values(loader, "mt_loader_queue_depth", job)).toHaveLength(1);
    expect(values(loader, "mt_loader_wait_seconds", { ...job, quantile: "0.99" })[0]).toBeGreaterThanOrEqual(0);
    for (const k of [0, 1]) {
      const shard = mid.get(`parameter-server ${k}`);
      const clocks = [0, 1].map(
        (t) => values(shard, "mt_shard_clock", { ...job, shard: String(k), trainer: String(t) })[0]!,
      );
      expect(Math.min(...clocks)).toBeGreaterThanOrEqual(20);
      expect(values(shard, "mt_shard_staleness", { ...job, shard: String(k) })[0]).toBeLessThanOrEqual(1); // BSP
      expect(
        values(end.get(`parameter-server ${k}`), "mt_bus_bytes_total", { direction: "in", kind: "ps.push" })[0],
      ).toBeGreaterThan(0);
    }
    const ckpt = end.get("checkpoint");
    expect(values(ckpt, "mt_checkpoint_snapshots_total", job)[0]).toBeGreaterThanOrEqual(3); // steps 50, 100 and the final
    expect(values(ckpt, "mt_checkpoint_bytes_total", job)[0]).toBeGreaterThan(100_000);
    expect(values(ckpt, "mt_checkpoint_fsync_seconds")[0]).toBeGreaterThan(0); // the histogram's count
    // `meshtrain metrics` lists them, one service a line
    const cli = Bun.spawnSync(
      [
        process.execPath,
        join(import.meta.dir, "..", "..", "sdk", "cli", "main.ts"),
        "metrics",
        "--nats-url",
        mesh.url,
        "--nats-nkey",
        mesh.auth("client").nkeyFile!,
      ],
      {
        stdout: "pipe",
        stderr: "pipe",
      },
    );
    expect(cli.exitCode).toBe(0);
    const lines = cli.stdout.toString().trim().split("\n");
    expect(lines.map((l) => l.split(/\s{2,}/)[0]!.trim())).toEqual([...end.keys()]);
    expect(lines.every((l) => /http:\/\/127\.0\.0\.1:\d+\/metrics$/.test(l))).toBe(true);
    // anything but /metrics is a 404
    const url = (await client.metricsEndpoints())[0]!.url;
    expect((await fetch(url.replace("/metrics", "/other"))).status).toBe(404);
  }, 180_000);
});
