// Whole training steps through the CUDA backend's code, on a machine without a GPU: the
// CudaBackend over the fake driver whose launches run the .cu kernels on the host emulator,
// and the fake cuBLAS (test/helpers/emulated-cuda.ts). The same seeds on the CPU backend give
// the reference: losses step by step, the final parameters, evaluation, and an allocation
// count that stops growing after the first steps (the caching allocator and the arena at work).
// Small models: every CUDA thread is a host thread here.
import { describe, expect, test } from "bun:test";
import type { Backend } from "../../ffi/backend.ts";
import { GptModel } from "../../engine/models/gpt.ts";
import { MlpModel } from "../../engine/models/mlp.ts";
import type { Model } from "../../engine/models/model.ts";
import { AdamW } from "../../engine/optim/adamw.ts";
import { Sgd } from "../../engine/optim/sgd.ts";
import { Rng } from "../../engine/rng.ts";
import { Context } from "../../engine/context.ts";
import { evaluate, type HostBatch, type TrainStep } from "../../engine/train.ts";
import { emulatedCuda, type Timeline } from "../helpers/emulated-cuda.ts";
import { expectCachedGeneration } from "../helpers/generation.ts";
import { cpu, relErr } from "../helpers/numeric.ts";
import { skip } from "../helpers/skip.ts";
import { constantLrStep } from "../helpers/training.ts";

const emulated = await emulatedCuda();

interface Run {
  losses: number[];
  gradNorms: number[];
  params: Float32Array;
  evalLoss: number;
  allocCounts: number[];
}

function train(be: Backend, build: (ctx: Context) => { model: Model; step: TrainStep }, batches: HostBatch[]): Run {
  const ctx = new Context(be, { seed: 5 });
  const { model, step } = build(ctx);
  const run: Run = { losses: [], gradNorms: [], params: new Float32Array(0), evalLoss: 0, allocCounts: [] };
  for (const b of batches) {
    const r = step.run([b]);
    run.losses.push(r.loss);
    run.gradNorms.push(r.gradNorm);
    run.allocCounts.push(be.stats.allocCount);
  }
  run.evalLoss = evaluate(ctx, model, batches.slice(0, 2)).loss;
  run.params = new Float32Array(model.store.slabNumel);
  be.download(model.store.values.ptr, run.params);
  ctx.dispose();
  return run;
}

function mlpBatches(n: number): HostBatch[] {
  const rng = new Rng(9);
  return Array.from({ length: n }, () => ({
    inputs: Float32Array.from({ length: 32 * 20 }, () => rng.normal()),
    inputShape: [32, 20],
    targets: Int32Array.from({ length: 32 }, () => rng.int(3)),
    targetShape: [32],
  }));
}

function gptBatches(n: number, V: number, T: number): HostBatch[] {
  const rng = new Rng(10);
  return Array.from({ length: n }, () => ({
    inputs: Int32Array.from({ length: 4 * T }, () => rng.int(V)),
    inputShape: [4, T],
    targets: Int32Array.from({ length: 4 * T }, () => rng.int(V)),
    targetShape: [4, T],
  }));
}

function expectSameRun(got: Run, want: Run): void {
  expect(relErr(got.losses, want.losses)).toBeLessThanOrEqual(1e-5);
  expect(relErr(got.gradNorms, want.gradNorms)).toBeLessThanOrEqual(1e-4);
  expect(relErr(got.params, want.params)).toBeLessThanOrEqual(1e-4);
  expect(Math.abs(got.evalLoss - want.evalLoss) / want.evalLoss).toBeLessThanOrEqual(1e-5);
  // after two steps the arena and the caching allocator have everything they need
  expect(got.allocCounts.slice(2).every((c) => c === got.allocCounts[2])).toBe(true);
}

describe.skipIf(skip("the emulated CUDA backend", emulated.ok ? null : emulated.reason))(
  "training on the CUDA backend (emulated on the host) matches the CPU",
  () => {
    const gpu = () => (emulated as { backend: () => Backend }).backend();

    test("mlp 20-16-3, Nesterov SGD with weight decay, 8 steps", () => {
      const build = (ctx: Context) => {
        const model = new MlpModel(ctx, { widths: [20, 16, 3], activation: "relu", dropout: 0 }, 3);
        const opt = new Sgd(ctx, model.store, { momentum: 0.9, dampening: 0, nesterov: true, weightDecay: 1e-3 });
        return {
          model,
          step: constantLrStep(ctx, model, opt, { lr: 0.1, gradClip: 0, accumSteps: 1 }),
        };
      };
      const batches = mlpBatches(8);
      expectSameRun(train(gpu(), build, batches), train(cpu(), build, batches));
    }, 120_000);

    test("gpt generation with the KV cache: the tokens of the whole window's forward, its logits to rounding", () => {
      expectCachedGeneration(gpu());
    }, 120_000);

    test("gpt L1 H2 C8 T6 V11 (embeddings, attention, LayerNorm, GELU, tied head), AdamW with clipping, 5 steps", () => {
      const [V, T] = [11, 6];
      const build = (ctx: Context) => {
        const model = new GptModel(ctx, { vocabSize: V, blockSize: T, nLayer: 1, nHead: 2, nEmbd: 8, dropout: 0 }, 4);
        const opt = new AdamW(ctx, model.store, { beta1: 0.9, beta2: 0.99, eps: 1e-8, weightDecay: 0.1 });
        return {
          model,
          step: constantLrStep(ctx, model, opt, { lr: 3e-3, gradClip: 0.5, accumSteps: 1 }),
        };
      };
      const batches = gptBatches(5, V, T);
      expectSameRun(train(gpu(), build, batches), train(cpu(), build, batches));
    }, 120_000);

    // The host must not wait on the GPU while it queues a pass: each wait drains the GPU's queue,
    // and the GPU then idles while the host queues the rest. So: no stream synchronization before
    // the backward pass is fully queued (the last kernel of backward is the token embedding's), and
    // none after the optimizer's first kernel, so the next step's forward is queued while the
    // update runs. Ids and targets are checked on the host; the loss is read after backward.
    test.each([1, 3])(
      "a GPT step of %i micro-batch(es) waits on the GPU only between its last backward pass and its update",
      (k) => {
        const { timeline } = emulated as { timeline: Timeline };
        const [V, T] = [11, 6];
        const ctx = new Context(gpu(), { seed: 5 });
        const model = new GptModel(ctx, { vocabSize: V, blockSize: T, nLayer: 1, nHead: 2, nEmbd: 8, dropout: 0.1 }, 4);
        const opt = new AdamW(ctx, model.store, { beta1: 0.9, beta2: 0.99, eps: 1e-8, weightDecay: 0.1 });
        const step = constantLrStep(ctx, model, opt, { lr: 3e-3, gradClip: 0.5, accumSteps: k });
        const batches = gptBatches(3 * k, V, T);
        step.run(batches.slice(0, k));
        step.run(batches.slice(k, 2 * k));
        timeline.reset();
        step.run(batches.slice(2 * k));
        const launches = timeline.launches();
        const syncs = timeline.streamSyncs();
        ctx.dispose();
        const backwardQueued = launches.lastIndexOf("mt_embedding_backward_f32") + 1;
        const updateStarts = launches.indexOf("mt_adamw_step_f32");
        expect(backwardQueued).toBeGreaterThan(launches.indexOf("mt_crossentropy_backward_f32"));
        expect(updateStarts).toBeGreaterThan(backwardQueued);
        expect(launches.filter((name) => name === "mt_crossentropy_backward_f32")).toHaveLength(k);
        // the losses, and the gradient norm for clipping
        expect(syncs.length).toBe(2);
        for (const s of syncs) {
          expect(s).toBeGreaterThanOrEqual(backwardQueued);
          expect(s).toBeLessThanOrEqual(updateStarts);
        }
      },
      120_000,
    );
  },
);
