// Engine benchmark: one full training step (forward, backward, optimizer) of the MLP
// 784-1024-1024-10 at batch 256 and of the default GPT, against OpenBLAS sgemm timed on
// exactly the GEMM shapes of that step, in the same run. The ratio is the fraction of the
// machine's GEMM rate the whole step achieves; the rest is overhead.
//
//   bun run bench engine [--steps N] [--json-only]
import type { Backend } from "../ffi/backend.ts";
import { parseBenchArgs, positiveInt } from "./args.ts";
import { median, printTable, round } from "./table.ts";
import { CpuBackend } from "../ffi/cpu/backend.ts";
import { gptDefaults, GptModel } from "../engine/models/gpt.ts";
import { MlpModel } from "../engine/models/mlp.ts";
import { gemmFlops, type GemmShape, type Model } from "../engine/models/model.ts";
import { AdamW, adamwDefaults } from "../engine/optim/adamw.ts";
import { Sgd, sgdDefaults } from "../engine/optim/sgd.ts";
import { Rng } from "../engine/rng.ts";
import { Context } from "../engine/tensor.ts";
import { type HostBatch, TrainStep } from "../engine/train.ts";

export interface EngineBenchResult {
  model: string;
  batch: number;
  step_ms: number;
  samples_per_s: number;
  achieved_gflops: number;
  sgemm_gflops: number;
  ratio: number;
  target: number;
}


/**
 * Times `reps` training steps and `reps` rounds of the step's GEMMs (every GEMM of the step
 * once, on scratch buffers of the same shapes), interleaved one of each at a time so both see
 * the same machine conditions; returns the medians in ms.
 */
function timeInterleaved(be: Backend, trainer: TrainStep, batch: HostBatch, shapes: readonly GemmShape[], reps: number) {
  const buffers = shapes.map((s) => {
    const a = be.alloc(s.M * s.K * s.batch * 4);
    const b = be.alloc(s.K * s.N * s.batch * 4);
    const c = be.alloc(s.M * s.N * s.batch * 4);
    const rng = new Rng(s.M + s.N + s.K);
    be.upload(a.ptr, Float32Array.from({ length: s.M * s.K * s.batch }, () => rng.normal()));
    be.upload(b.ptr, Float32Array.from({ length: s.K * s.N * s.batch }, () => rng.normal()));
    return { a, b, c };
  });
  const gemmRound = () => {
    shapes.forEach((s, i) => {
      const { a, b, c } = buffers[i]!;
      const lda = s.transA ? s.M : s.K;
      const ldb = s.transB ? s.K : s.N;
      if (s.batch === 1) be.gemm(s.transA, s.transB, s.M, s.N, s.K, 1, a.ptr, lda, b.ptr, ldb, 0, c.ptr, s.N);
      else be.gemmStridedBatched(s.transA, s.transB, s.M, s.N, s.K, 1, a.ptr, lda, s.M * s.K, b.ptr, ldb, s.K * s.N, 0, c.ptr, s.N, s.M * s.N, s.batch);
    });
  };
  const timed = (fn: () => void) => {
    const t = performance.now();
    fn();
    return performance.now() - t;
  };
  for (let i = 0; i < 3; i++) {
    trainer.run([batch]);
    gemmRound();
  }
  const stepMs: number[] = [];
  const gemmMs: number[] = [];
  for (let r = 0; r < reps; r++) {
    stepMs.push(timed(() => trainer.run([batch])));
    gemmMs.push(timed(gemmRound));
  }
  for (const { a, b, c } of buffers) [a, b, c].forEach((x) => be.free(x));
  return { stepMs: median(stepMs), gemmMs: median(gemmMs) };
}

function result(name: string, batch: number, model: Model, stepMs: number, gemmMs: number, target: number): EngineBenchResult {
  const flops = gemmFlops(model.gemmShapes(batch));
  return {
    model: name,
    batch,
    step_ms: round(stepMs, 2),
    samples_per_s: round((batch * 1000) / stepMs, 1),
    achieved_gflops: round(flops / stepMs / 1e6, 1),
    sgemm_gflops: round(flops / gemmMs / 1e6, 1),
    ratio: round(gemmMs / stepMs, 3),
    target,
  };
}


export function benchMlp(be: Backend, steps: number): EngineBenchResult {
  const batch = 256;
  const ctx = new Context(be, { seed: 1 });
  const model = new MlpModel(ctx, { widths: [784, 1024, 1024, 10], activation: "relu", dropout: 0 }, 1);
  const trainer = new TrainStep(ctx, model, new Sgd(ctx, model.store, sgdDefaults),
    { lr: 0.01, schedule: { kind: "constant" }, gradClip: 0, accumSteps: 1 });
  const rng = new Rng(2);
  const hb: HostBatch = {
    inputs: Float32Array.from({ length: batch * 784 }, () => rng.normal()),
    inputShape: [batch, 784],
    targets: Int32Array.from({ length: batch }, () => rng.int(10)),
    targetShape: [batch],
  };
  const { stepMs, gemmMs } = timeInterleaved(be, trainer, hb, model.gemmShapes(batch), steps);
  ctx.dispose();
  return result("mlp 784-1024-1024-10", batch, model, stepMs, gemmMs, 0.7);
}

export const gptBenchBatch = 32;

export function benchGpt(be: Backend, steps: number): EngineBenchResult {
  const batch = gptBenchBatch;
  const vocabSize = 83; // Moby Dick's character count
  const ctx = new Context(be, { seed: 1 });
  const config = { ...gptDefaults, vocabSize };
  const model = new GptModel(ctx, config, 1);
  const trainer = new TrainStep(ctx, model, new AdamW(ctx, model.store, adamwDefaults),
    { lr: 1e-3, schedule: { kind: "constant" }, gradClip: 1, accumSteps: 1 });
  const rng = new Rng(3);
  const n = batch * config.blockSize;
  const hb: HostBatch = {
    inputs: Int32Array.from({ length: n }, () => rng.int(vocabSize)),
    inputShape: [batch, config.blockSize],
    targets: Int32Array.from({ length: n }, () => rng.int(vocabSize)),
    targetShape: [batch, config.blockSize],
  };
  const { stepMs, gemmMs } = timeInterleaved(be, trainer, hb, model.gemmShapes(batch), steps);
  ctx.dispose();
  const c = config;
  return result(`gpt L${c.nLayer} H${c.nHead} C${c.nEmbd} T${c.blockSize} V${c.vocabSize}`, batch, model, stepMs, gemmMs, 0.5);
}

export function runEngineBench(argv: string[]): EngineBenchResult[] {
  const values = parseBenchArgs(argv, { steps: { type: "string", default: "20" }, "json-only": { type: "boolean", default: false } });
  const steps = positiveInt("steps", values.steps);
  const be = new CpuBackend();
  const rows = [benchMlp(be, steps), benchGpt(be, steps)];
  if (!values["json-only"]) {
    console.log(`engine benchmark: CPU backend, ${be.threads} threads; medians of ${steps} steps interleaved with ${steps} rounds of their GEMMs; ratio = sgemm time / step time`);
    printTable(rows, ["model", "batch", "step_ms", "samples_per_s", "achieved_gflops", "sgemm_gflops", "ratio", "target"]);
  }
  console.log(JSON.stringify({ bench: "engine", results: rows }));
  return rows;
}

if (import.meta.main) runEngineBench(process.argv.slice(2));
