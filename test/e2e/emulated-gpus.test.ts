// All-reduce jobs on "GPUs" without GPUs: the mesh's trainers load the fake libcuda, cuBLAS and
// cuBLASLt (kernels on the host emulator) and the emulated NCCL, as scripts/emulated-gpus.sh
// sets them up, so every trainer has a GPU of its own and NCCL carries the job. Checked:
//   - 2 and 4 ranks over NCCL, at ZeRO stages 0 to 3 and with gradient accumulation, follow one
//     process with the whole batch (a one-rank job) within 1e-5, and their replicas stay
//     bit-identical (the replica check every few steps fails the job otherwise);
//   - ranks that share a GPU take the ring, and the submission and the trainers say why;
//   - a trainer SIGKILLed mid-step, and one SIGSTOPped: the survivors' communicator is aborted
//     (by the restore, or by the liveness watch naming the stopped one), every rank restores at a
//     new communicator generation, and the job finishes with every step once.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { EventKind, JobState } from "../../schemas/messages/job.ts";
import { planHere } from "../../services/data-loader/loader.ts";
import type { JobConfig } from "../../services/runtime/job/config.ts";
import { MeshClient } from "../../sdk/client.ts";
import { type Built, emulatedLibraries } from "../helpers/emulated-cuda.ts";
import { removeTempDirs } from "../helpers/mesh.ts";
import { atRank0Step, expectEveryStepOnce, mlpJob, runJob, startMesh, stepLosses } from "../helpers/mesh-jobs.ts";

afterAll(removeTempDirs);

let libs: Built | null = null;
let skip: string | null = null;
beforeAll(async () => {
  try {
    libs = await emulatedLibraries();
  } catch (e) {
    skip = `the emulated CUDA libraries cannot be built here: ${(e as Error).message}`;
    console.log(skip);
  }
}, 300_000);

/** The environment scripts/emulated-gpus.ts gives a command: `gpus` GPUs per host. */
function gpuEnv(gpus: number): Record<string, string> {
  const l = libs!;
  return {
    MT_DEVICE: "cuda",
    MESHTRAIN_LIBCUDA: l.fakeCuda,
    MESHTRAIN_CUBLAS: l.fakeCublas,
    MESHTRAIN_CUBLASLT: l.fakeCublasLt,
    MESHTRAIN_NCCL: l.emulatedNccl,
    FAKE_CUDA_EMULATOR: l.emulator,
    FAKE_CUDA_DEVICES: String(gpus),
  };
}

const rowsPerRank = 16;
const steps = 4;
const job = (over: Partial<JobConfig>): JobConfig =>
  mlpJob({
    sync: "allreduce",
    model: { kind: "mlp", widths: [784, 32, 10], dropout: 0 },
    batchSize: rowsPerRank,
    maxSteps: steps,
    evalEvery: 0,
    // one batch of the test set at the end: the emulator runs each CUDA thread on a host thread
    evalBatches: 1,
    valFraction: 0,
    bucketMb: 0.008,
    replicaCheckEvery: 3,
    warmupSteps: 0,
    lr: 0.05,
    ...over,
  });

const relDiff = (a: Map<number, number>, b: Map<number, number>, n: number) => {
  let worst = 0;
  for (let s = 0; s < n; s++) worst = Math.max(worst, Math.abs(a.get(s)! - b.get(s)!) / Math.abs(b.get(s)!));
  return worst;
};

/** Trainer `rank`'s log lines about job `jobId` (the mesh's service log, one file per service). */
function trainerLog(logDir: string, jobId: string, rank: number): string {
  return readFileSync(join(logDir, `trainer-${rank}.log`), "utf8")
    .split("\n")
    .filter((l) => l.includes(`"job":"${jobId}"`))
    .join("\n");
}

describe("all-reduce over NCCL on emulated GPUs", () => {
  test("2 and 4 ranks at ZeRO 0-3, with and without accumulation, follow one process with the whole batch within 1e-5; replicas identical", async () => {
    if (skip) return;
    await using mesh = await startMesh("mt-emu-gpus-", { trainers: 4, shards: 0, env: gpuEnv(8) });
    await using client = await MeshClient.connect(mesh.url, mesh.auth());
    const reference = new Map<number, Map<number, number>>();
    for (const ranks of [2, 4]) {
      const r = await runJob(
        client,
        job({ job: `default.emu-ref${ranks}`, trainers: 1, batchSize: ranks * rowsPerRank }),
      );
      expect(r.record.state).toBe(JobState.Done);
      reference.set(ranks, stepLosses(r.seen));
    }
    // each stage once, each rank count and accumulation twice (test/engine/data-parallel-nccl.test.ts
    // runs stage 0 at both rank counts, with and without accumulation, in the engine alone)
    const cases: [number, 0 | 1 | 2 | 3, number][] = [
      [2, 0, 2],
      [4, 1, 1],
      [2, 2, 4],
      [4, 3, 2],
    ];
    for (const [ranks, zero, accumSteps] of cases) {
      const cfg = job({ job: `default.emu-${ranks}-z${zero}-a${accumSteps}`, trainers: ranks, zero, accumSteps });
      const plan = await client.collectivePlan(cfg);
      expect(plan?.carrier).toBe("nccl");
      expect(plan?.deviceBuckets).toBe(true);
      const r = await runJob(client, cfg);
      expect(r.record.state).toBe(JobState.Done);
      expectEveryStepOnce(r.seen, ranks, steps);
      const diff = relDiff(stepLosses(r.seen), reference.get(ranks)!, steps);
      console.log(
        `${ranks} ranks, ZeRO ${zero}, ${accumSteps} micro-batches: loss within ${diff.toExponential(2)} of one process`,
      );
      expect(diff).toBeLessThan(1e-5);
      expect(trainerLog(mesh.opts.logDir, cfg.job, 0)).toContain(
        `all-reduce: NCCL among the ${ranks} GPUs of one host`,
      );
    }
  }, 600_000);

  test("4 ranks labelled 2 hosts x 2: NCCL within each host, the ring between the leaders; the loss follows one process within 1e-5; with --compress bf16 half the bytes cross hosts", async () => {
    if (skip) return;
    await using mesh = await startMesh("mt-emu-hosts-", {
      trainers: 4,
      shards: 0,
      env: gpuEnv(2),
      trainerHosts: ["a", "a", "b", "b"],
    });
    await using client = await MeshClient.connect(mesh.url, mesh.auth());
    const ref = await runJob(client, job({ job: "default.emu-hosts-ref", trainers: 1, batchSize: 4 * rowsPerRank }));
    const cfg = job({ job: "default.emu-hosts", trainers: 4, accumSteps: 2 });
    expect(await client.waitForMembers(cfg, 60_000)).toBe(true);
    const plan = await client.collectivePlan(cfg);
    expect(plan?.carrier).toBe("nccl-ring");
    const r = await runJob(client, cfg);
    expect(r.record.state).toBe(JobState.Done);
    expectEveryStepOnce(r.seen, 4, steps);
    const diff = relDiff(stepLosses(r.seen), stepLosses(ref.seen), steps);
    console.log(`4 ranks on 2 hosts: loss within ${diff.toExponential(2)} of one process`);
    expect(diff).toBeLessThan(1e-5);
    expect(trainerLog(mesh.opts.logDir, cfg.job, 2)).toContain("all-reduce: NCCL among the GPUs of each of 2 hosts");
    // bf16 compression where the bytes cross hosts (the leaders' ring, with error feedback);
    // NCCL within each host still moves f32
    const bf16 = job({ job: "default.emu-hosts-bf16", trainers: 4, accumSteps: 2, compress: "bf16" });
    expect((await client.collectivePlan(bf16))?.text).toContain("--compress bf16 between hosts");
    const c = await runJob(client, bf16);
    expect(c.record.state).toBe(JobState.Done);
    expectEveryStepOnce(c.seen, 4, steps);
    const wire = (seen: typeof c.seen) =>
      seen.filter((e) => e.kind === EventKind.Step).reduce((sum, e) => sum + e.wireBytes, 0);
    const ratio = wire(c.seen) / wire(r.seen);
    const lossDiff = relDiff(stepLosses(c.seen), stepLosses(ref.seen), steps);
    console.log(
      `bf16 between 2 hosts: ${ratio.toFixed(3)} of f32's bytes between hosts; loss within ${lossDiff.toExponential(2)}`,
    );
    expect(ratio).toBeGreaterThan(0.4);
    expect(ratio).toBeLessThan(0.6);
    expect(lossDiff).toBeLessThan(1e-2);
  }, 300_000);

  test("ranks that share a GPU take the ring: the plan and the trainers say why", async () => {
    if (skip) return;
    await using mesh = await startMesh("mt-emu-shared-", { trainers: 2, shards: 0, env: gpuEnv(1) });
    await using client = await MeshClient.connect(mesh.url, mesh.auth());
    const cfg = job({ job: "default.emu-shared", trainers: 2, maxSteps: 3 });
    expect(await client.waitForMembers(cfg, 60_000)).toBe(true);
    const plan = await client.collectivePlan(cfg);
    expect(plan?.carrier).toBe("ring");
    expect(plan?.text).toContain("not NCCL: ranks 0 and 1 share GPU GPU-");
    const r = await runJob(client, cfg);
    expect(r.record.state).toBe(JobState.Done);
    expect(trainerLog(mesh.opts.logDir, cfg.job, 1)).toContain("not NCCL: ranks 0 and 1 share GPU");
  }, 300_000);

  test("a trainer SIGKILLed mid-step: the survivors' communicator is aborted, every rank restores at a new generation and the job finishes, every step once", async () => {
    if (skip) return;
    const launcherLines: string[] = [];
    await using mesh = await startMesh("mt-emu-kill-", {
      trainers: 2,
      shards: 0,
      env: gpuEnv(8),
      onEvent: (l) => launcherLines.push(l),
    });
    await using client = await MeshClient.connect(mesh.url, mesh.auth());
    const cfg = job({ job: "default.emu-kill", trainers: 2, maxSteps: 16, checkpointEvery: 4 });
    const kill = atRank0Step(8, () => mesh.kill("trainer-1", "SIGKILL"));
    const r = await runJob(client, cfg, kill.onEvent);
    expect(r.record.state).toBe(JobState.Done);
    expect(kill.step).toBeGreaterThan(0);
    expect(launcherLines.some((l) => l.includes("trainer-1 died (signal SIGKILL); restarting"))).toBe(true);
    const restores = r.seen.filter((e) => e.kind === EventKind.Restore);
    expect(restores.length).toBeGreaterThanOrEqual(1);
    expect(restores[0]!.step % 4).toBe(0);
    expectEveryStepOnce(r.seen, 2, planHere(cfg).totalSteps);
    // the restore rebuilt the communicator: a new generation's NCCL group on each rank
    expect(trainerLog(mesh.opts.logDir, cfg.job, 0)).toContain("replica restored");
  }, 300_000);

  test("a trainer SIGSTOPped: it is named within 10 s, the survivors abort their communicator, and after SIGCONT the job restores and finishes", async () => {
    if (skip) return;
    await using mesh = await startMesh("mt-emu-stop-", { trainers: 2, shards: 0, env: gpuEnv(8) });
    await using client = await MeshClient.connect(mesh.url, mesh.auth());
    const cfg = job({ job: "default.emu-stop", trainers: 2, maxSteps: 16, checkpointEvery: 4 });
    let stoppedMs = 0;
    let namedAfterMs = -1;
    const stop = atRank0Step(8, () => {
      stoppedMs = performance.now();
      mesh.kill("trainer-1", "SIGSTOP");
    });
    const log0 = () => trainerLog(mesh.opts.logDir, cfg.job, 0);
    let resumed: Promise<void> | null = null;
    const r = await runJob(client, cfg, (e) => {
      stop.onEvent(e);
      if (e.kind === EventKind.Stalled && e.text.startsWith("trainer 1 has sent no heartbeat") && resumed === null) {
        namedAfterMs = performance.now() - stoppedMs;
        // once rank 0 has given its NCCL operation up (aborted, not waiting forever), trainer 1 goes on
        resumed = (async () => {
          for (let i = 0; i < 600 && !log0().includes("rank 1 is unreachable"); i++) await Bun.sleep(50);
          mesh.kill("trainer-1", "SIGCONT");
        })();
      }
    });
    await resumed;
    expect(r.record.state).toBe(JobState.Done);
    expect(namedAfterMs).toBeGreaterThan(0);
    expect(namedAfterMs).toBeLessThan(10_000);
    expect(log0()).toContain("rank 1 is unreachable: trainer 1 has sent no heartbeat");
    expect(r.seen.some((e) => e.kind === EventKind.Restore)).toBe(true);
    expectEveryStepOnce(r.seen, 2, planHere(cfg).totalSteps);
  }, 300_000);
});
