// Data parallelism on device buffers (DataParallel with a deviceCollective): ranks as processes,
// each with the CUDA backend emulated on the host and the emulated NCCL (summing the ranks'
// emulated device buffers through shared memory), so a "multi-GPU" job runs here. At 2 and 4
// ranks, with and without gradient accumulation, the ranks' mean loss follows one process that
// trains on the whole batch on the CPU backend (within 1e-5), the replicas end bit-identical (the
// replica check runs through NCCL too), and the buckets stay on the device; ZeRO 1-3 too, its
// partitions' reduce-scatters and all-gathers on device buffers. The refusals of what
// does not run on device buffers yet are checked in one process.
import { describe, expect, test } from "bun:test";
import { join } from "node:path";
import { DataParallel } from "../../engine/parallel/data-parallel.ts";
import { inProcessRings } from "../../engine/parallel/ring.ts";
import { Context } from "../../engine/context.ts";
import { CpuBackend } from "../../ffi/cpu/backend.ts";
import { NcclLibrary } from "../../ffi/cuda/nccl.ts";
import { emulatedCuda, emulatedNcclLibrary } from "../helpers/emulated-cuda.ts";
import { skip } from "../helpers/skip.ts";
import { batch, dpOptions, rowsPerRank, singleProcess } from "./fixtures/dp-batches.ts";

const emulated = await emulatedCuda();
const rankScript = join(import.meta.dir, "fixtures", "dp-nccl-rank.ts");
const steps = 6;

interface StepLine {
  step: number;
  loss: number;
  gradNorm: number;
}
interface EndLine {
  digest: string;
  values: number[];
  buckets: number;
  bucketNumel: number;
  paramCount: number;
  bucketBytes: number;
}

async function runJob(ranks: number, accumSteps: number, zero = 0): Promise<{ steps: StepLine[][]; ends: EndLine[] }> {
  const lib = await emulatedNcclLibrary();
  const id = Buffer.from(NcclLibrary.open(lib).getUniqueId()).toString("hex");
  const procs = Array.from({ length: ranks }, (_, r) =>
    Bun.spawn(
      [
        process.execPath,
        rankScript,
        lib,
        id,
        String(ranks),
        String(r),
        String(accumSteps),
        String(steps),
        String(zero),
      ],
      {
        stdout: "pipe",
        stderr: "pipe",
      },
    ),
  );
  const timer = setTimeout(() => {
    for (const p of procs) p.kill(9);
  }, 120_000);
  try {
    const outs = await Promise.all(
      procs.map(async (p) => {
        const [out, err, code] = await Promise.all([
          new Response(p.stdout).text(),
          new Response(p.stderr).text(),
          p.exited,
        ]);
        if (code !== 0) throw new Error(`a rank exited with ${code}:\n${out}\n${err}`);
        return out
          .trim()
          .split("\n")
          .filter((l) => l.startsWith("{"))
          .map((l) => JSON.parse(l));
      }),
    );
    return { steps: outs.map((o) => o.slice(0, -1) as StepLine[]), ends: outs.map((o) => o.at(-1) as EndLine) };
  } finally {
    clearTimeout(timer);
  }
}

/** One process with the whole batch on the CPU backend: losses, norms and final parameters. */
function reference(ranks: number): { losses: number[]; norms: number[]; values: Float32Array } {
  const ctx = new Context(new CpuBackend(), { seed: 0 });
  try {
    const { model: single, train } = singleProcess(ctx);
    const losses: number[] = [],
      norms: number[] = [];
    for (let s = 0; s < steps; s++) {
      const r = train.run([batch(s * ranks * rowsPerRank, ranks * rowsPerRank)]);
      losses.push(r.loss);
      norms.push(r.gradNorm);
    }
    return { losses, norms, values: single.store.readValues() };
  } finally {
    ctx.dispose();
  }
}

/** The ranks' mean loss and the global norm follow one process with the whole batch within 1e-5
 *  at every step, every rank sees the same norm, and the replicas end bit-identical and within
 *  1e-5 of the process's parameters. */
function expectFollowsOneProcess(job: { steps: StepLine[][]; ends: EndLine[] }, ranks: number): void {
  const ref = reference(ranks);
  for (let s = 0; s < steps; s++) {
    const loss = job.steps.reduce((sum, lines) => sum + lines[s]!.loss, 0) / ranks;
    expect(Math.abs(loss - ref.losses[s]!) / Math.abs(ref.losses[s]!)).toBeLessThanOrEqual(1e-5);
    for (const lines of job.steps) expect(lines[s]!.gradNorm).toBe(job.steps[0]![s]!.gradNorm);
    expect(Math.abs(job.steps[0]![s]!.gradNorm - ref.norms[s]!) / ref.norms[s]!).toBeLessThanOrEqual(1e-5);
  }
  expect(new Set(job.ends.map((e) => e.digest)).size).toBe(1);
  let worst = 0;
  job.ends[0]!.values.forEach((v, i) => {
    worst = Math.max(worst, Math.abs(v - ref.values[i]!));
  });
  expect(worst).toBeLessThanOrEqual(1e-5);
}

const skipReason = emulated.ok ? null : `the emulated CUDA backend cannot be built here: ${emulated.reason}`;

describe.skipIf(skip("the emulated CUDA backend", skipReason))("data parallelism on device buffers over NCCL", () => {
  test.each([
    [2, 1],
    [4, 1],
    [2, 3],
    [4, 2],
  ])(
    "%d ranks, %d micro-batches: the loss follows one process with the whole batch (1e-5), replicas bit-identical",
    async (ranks, accum) => {
      const job = await runJob(ranks, accum);
      expectFollowsOneProcess(job, ranks);
      // the buckets are device buffers holding every parameter's gradient once, and no host copy
      const end = job.ends[0]!;
      expect(end.buckets).toBeGreaterThan(1);
      expect(end.bucketNumel).toBe(end.paramCount);
      expect(end.bucketBytes).toBe(end.paramCount * 4);
    },
  );

  test.each([
    [4, 1, 1],
    [2, 2, 2],
    [4, 2, 3],
  ])(
    "%d ranks, %d micro-batches, ZeRO stage %d on device buffers: the loss follows one process (1e-5), replicas bit-identical",
    async (ranks, accum, zero) => {
      const job = await runJob(ranks, accum, zero);
      expectFollowsOneProcess(job, ranks);
      // ZeRO keeps no bucket buffer between steps: each reduction's comes from the allocator
      expect(job.ends[0]!.bucketBytes).toBe(0);
    },
  );

  test("what does not run on device buffers yet is refused with the reason", () => {
    const [ring] = inProcessRings(1, { progressTimeoutMs: 1000 }, 16);
    const ctx = new Context(new CpuBackend(), { seed: 0 });
    const base = dpOptions(ctx, 0, 1, ring!, {
      deviceCollective: () => {
        throw new Error("not called");
      },
    });
    try {
      expect(() => new DataParallel({ ...base, offload: true })).toThrow(/not with offload/);
      expect(() => new DataParallel({ ...base, compress: "fp16", zero: 2 })).toThrow(
        /not with compression \(fp16\) with ZeRO stage 2/,
      );
    } finally {
      ring!.close("done");
      ctx.dispose();
    }
  });
});
