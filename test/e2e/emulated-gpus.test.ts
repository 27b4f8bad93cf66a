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
import { EventKind, JobState } from "../../schemas/messages.ts";
import { planHere } from "../../services/data-loader/loader.ts";
import type { JobConfig } from "../../services/runtime/job/job.ts";
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
const steps = 6;
const job = (over: Partial<JobConfig>): JobConfig =>
  mlpJob({
    sync: "allreduce",
    model: { kind: "mlp", widths: [784, 32, 10], dropout: 0 },
    batchSize: rowsPerRank,
    maxSteps: steps,
    evalEvery: 0,
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

function trainerLog(jobsDir: string, jobId: string, rank: number): string {
  return readFileSync(join(jobsDir, jobId, "logs", `trainer-${rank}.log`), "utf8");
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
    const cases: [number, 0 | 1 | 2 | 3, number][] = [
      [2, 0, 2],
      [4, 0, 1],
      [2, 1, 1],
      [4, 2, 2],
      [4, 3, 1],
    ];
    for (const [ranks, zero, accumSteps] of cases) {
      const cfg = job({ job: `default.emu-${ranks}-z${zero}-a${accumSteps}`, trainers: ranks, zero, accumSteps });
      const plan = await client.collectivePlan(cfg);
      expect(plan?.carrier).toBe("nccl");
      expect(plan?.deviceBuckets).toBe(zero === 0);
      const r = await runJob(client, cfg);
      expect(r.record.state).toBe(JobState.Done);
      expectEveryStepOnce(r.seen, ranks, steps);
      const diff = relDiff(stepLosses(r.seen), reference.get(ranks)!, steps);
      console.log(
        `${ranks} ranks, ZeRO ${zero}, ${accumSteps} micro-batches: loss within ${diff.toExponential(2)} of one process`,
      );
      expect(diff).toBeLessThan(1e-5);
      expect(trainerLog(mesh.opts.jobsDir, cfg.job, 0)).toContain(
        `all-reduce: NCCL among the ${ranks} GPUs of one host`,
      );
    }
  }, 600_000);

  test("ranks that share a GPU take the ring: the plan and the trainers say why", async () => {
    if (skip) return;
    await using mesh = await startMesh("mt-emu-shared-", { trainers: 2, shards: 0, env: gpuEnv(1) });
    await using client = await MeshClient.connect(mesh.url, mesh.auth());
    const cfg = job({ job: "default.emu-shared", trainers: 2, maxSteps: 3 });
    const plan = await client.collectivePlan(cfg);
    expect(plan?.carrier).toBe("ring");
    expect(plan?.text).toContain("not NCCL: ranks 0 and 1 share GPU GPU-");
    const r = await runJob(client, cfg);
    expect(r.record.state).toBe(JobState.Done);
    expect(trainerLog(mesh.opts.jobsDir, cfg.job, 1)).toContain("not NCCL: ranks 0 and 1 share GPU");
  }, 300_000);
});
