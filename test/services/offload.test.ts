// Optimizer offload (`offload: "optimizer"`, services/trainer/replica.ts): the optimizer state,
// the update and an f32 master copy of the parameters in host memory, the device holding only
// parameters and gradients. Ranks in one process over the in-memory bus: the trajectory is the
// one without offload, the memory moves from the device to the host as counted, and on the CUDA
// backend (emulated on the host, test/helpers/emulated-cuda.ts) it matches the CPU.
import { describe, expect, test } from "bun:test";
import type { Backend } from "../../ffi/backend.ts";
import { CpuBackend } from "../../ffi/cpu/backend.ts";
import { bytesPerParam, type ModelMemory } from "../../engine/parallel/zero.ts";
import { gptJobDefaults, type JobConfig, parseJobConfig } from "../../services/runtime/job/config.ts";
import { emulatedCuda } from "../helpers/emulated-cuda.ts";
import { closeRanks, replicaRanks } from "../helpers/replicas.ts";
import { skip } from "../helpers/skip.ts";
import { tokenWindows } from "../helpers/windows.ts";

const emulated = await emulatedCuda();

const V = 20,
  T = 8;
const plan = { vocabSize: V, vocab: [] as number[] };
const windows = tokenWindows({ V, T, seed: 3, windows: 190 });

const config = (over: Partial<JobConfig>): JobConfig =>
  parseJobConfig({
    ...gptJobDefaults,
    job: "offload",
    sync: "allreduce",
    trainers: 2,
    bucketMb: 0.01,
    chunkBytes: 16 << 10,
    model: { ...gptJobDefaults.model, nLayer: 1, nHead: 2, nEmbd: 16, blockSize: T },
    ...over,
  });

interface Run {
  losses: number[];
  norms: number[];
  params: Float32Array[];
  memory: ModelMemory[];
}

async function train(cfg: JobConfig, steps: number, backend: () => Backend): Promise<Run> {
  const ranks = replicaRanks(cfg, { plan, backend, progressTimeoutMs: 30_000, lr: 3e-3 });
  const run: Run = { losses: [], norms: [], params: [], memory: [] };
  try {
    for (let s = 0; s < steps; s++) {
      const results = await Promise.all(
        ranks.map((r, rank) => r.replica.step(s, [windows((s * 2 + rank) * 2, 2)], 2, 4)),
      );
      run.losses.push(results.reduce((a, x) => a + x.loss, 0) / results.length);
      run.norms.push(results[0]!.gradNorm);
    }
    run.params = ranks.map((r) => r.model.store.readValues());
    run.memory = ranks.map((r) => r.replica.memory);
  } finally {
    closeRanks(ranks);
  }
  return run;
}

describe("optimizer offload", () => {
  test("AdamW in host memory follows the run without offload, bit for bit on the CPU; the device holds 8 bytes per parameter, the host 16", async () => {
    const base = await train(config({}), 30, () => new CpuBackend());
    const off = await train(config({ offload: "optimizer" }), 30, () => new CpuBackend());
    expect(off.losses).toEqual(base.losses);
    expect(off.norms).toEqual(base.norms);
    for (const p of off.params) expect(Buffer.from(p.buffer).equals(Buffer.from(base.params[0]!.buffer))).toBe(true);
    const [b, o] = [base.memory[0]!, off.memory[0]!];
    expect(bytesPerParam(b)).toBeCloseTo(16, 0);
    expect(b.host).toBe(0);
    // on the device: parameters and gradients; the optimizer state is gone from it
    expect(o.optimizer).toBe(0);
    expect(bytesPerParam(o)).toBeCloseTo(8, 0);
    expect(bytesPerParam(b) - bytesPerParam(o)).toBeCloseTo(b.optimizer / b.paramCount, 6);
    // on the host: f32 master parameters, gradients, and AdamW's two moments
    expect(o.host / o.paramCount).toBeCloseTo(16, 0);
  }, 60_000);

  test("the config refuses offload outside all-reduce mode, saying why, and takes it with ZeRO (test/services/zero.test.ts)", () => {
    expect(() => config({ offload: "optimizer", sync: "bsp" })).toThrow(/needs sync allreduce/);
    expect(config({ offload: "optimizer", zero: 2 }).zero).toBe(2);
  });

  describe.skipIf(skip("the emulated CUDA backend", emulated.ok ? null : emulated.reason))(
    "on the CUDA backend (emulated on the host)",
    () => {
      test("offloaded AdamW on the CUDA backend follows the CPU run without offload", async () => {
        const gpu = () => (emulated as { backend: () => Backend }).backend();
        const base = await train(config({}), 8, () => new CpuBackend());
        const off = await train(config({ offload: "optimizer" }), 8, gpu);
        for (let i = 0; i < base.losses.length; i++)
          expect(Math.abs(off.losses[i]! - base.losses[i]!) / base.losses[i]!).toBeLessThan(1e-4);
        expect(off.memory[0]!.optimizer).toBe(0);
        expect(off.memory[0]!.host / off.memory[0]!.paramCount).toBeCloseTo(16, 0);
      }, 180_000);
    },
  );
});
