// A pass's working memory: the measured peak of a GPT training pass matches the analytic count
// of engine/memory-estimate.ts (docs/MEMORY.md) within 10%, in f32 and bf16, with and without
// recomputation; a forward-only pass holds about one block's activations; an evaluation batch
// of the training micro-batch needs less than a training step; memory is freed as soon as its
// last reader has run; and the arena allocates nothing after the first passes of each shape.
import { describe, expect, test } from "bun:test";
import { StaleTensorError } from "../../engine/errors.ts";
import { gptMemory, mlpActivations } from "../../engine/memory-estimate.ts";
import type { Precision } from "../../engine/mixed.ts";
import { type GptConfig, GptModel } from "../../engine/models/gpt.ts";
import { MlpModel } from "../../engine/models/mlp.ts";
import { Sgd, sgdDefaults } from "../../engine/optim/sgd.ts";
import { add } from "../../engine/ops/add.ts";
import { gelu } from "../../engine/ops/gelu.ts";
import { AdamW, adamwDefaults } from "../../engine/optim/adamw.ts";
import { Rng } from "../../engine/rng.ts";
import { Context } from "../../engine/context.ts";
import { evaluate, type HostBatch } from "../../engine/train.ts";
import { cpu, newContext } from "../helpers/numeric.ts";
import { constantLrStep } from "../helpers/training.ts";

const batchOf = (rng: Rng, B: number, T: number, V: number): HostBatch => ({
  inputs: Int32Array.from({ length: B * T }, () => rng.int(V)),
  inputShape: [B, T],
  targets: Int32Array.from({ length: B * T }, () => rng.int(V)),
  targetShape: [B, T],
});

/** A training step of `model` with AdamW and clipping. */
const adamwStep = (ctx: Context, model: GptModel) =>
  constantLrStep(ctx, model, new AdamW(ctx, model.store, adamwDefaults), { lr: 1e-3, gradClip: 1, accumSteps: 1 });

/** The arena's peak over one forward and backward, and what forward left for backward. */
function measure(config: GptConfig, B: number, precision: Precision, recompute: boolean) {
  const ctx = new Context(cpu(), { seed: 1, precision });
  const model = new GptModel(ctx, config, 1);
  model.recompute = recompute;
  const b = batchOf(new Rng(2), B, config.blockSize, config.vocabSize);
  ctx.newPass();
  const x = ctx.fromArray(b.inputs as Int32Array, b.inputShape);
  const y = ctx.fromArray(b.targets, b.targetShape);
  const inputs = ctx.arena.usedBytes;
  const loss = model.loss(x, y);
  const saved = ctx.arena.usedBytes - inputs;
  ctx.backward(loss);
  const peak = ctx.arena.passPeakBytes - inputs;
  ctx.dispose();
  return { saved, peak };
}

describe("a GPT pass's memory against the analytic count", () => {
  // L, H, C, T, V, B: a small and a large vocabulary against the width (the peak moves from the
  // last block's MLP backward to the head's), one head, odd sizes
  const shapes = [
    [3, 4, 128, 64, 83, 8],
    [2, 6, 96, 48, 500, 3],
    [4, 1, 32, 16, 50257, 2],
    [2, 2, 64, 128, 65, 4],
  ] as const;
  describe.each(["f32", "bf16"] as const)("%s", (precision) => {
    test.each(shapes.flatMap((s) => [false, true].map((rc) => [...s, rc] as const)))(
      "L%i H%i C%i T%i V%i B%i recompute %p: saved and peak within 10%",
      (L, H, C, T, V, B, recompute) => {
        const config = { vocabSize: V, blockSize: T, nLayer: L, nHead: H, nEmbd: C, dropout: 0 };
        const got = measure(config, B, precision, recompute);
        const want = gptMemory(config, { batch: B, precision, recompute, optimizer: "adamw" });
        expect(Math.abs(got.saved / want.activationsSaved - 1)).toBeLessThan(0.1);
        expect(Math.abs(got.peak / want.activationsPeak - 1)).toBeLessThan(0.1);
      },
    );
  });

  test("parameters, gradients and AdamW state: 4 + 4 + 8 bytes a parameter", () => {
    const config = { vocabSize: 50257, blockSize: 1024, nLayer: 12, nHead: 12, nEmbd: 768, dropout: 0 };
    const m = gptMemory(config, { batch: 1, precision: "f32", recompute: false, optimizer: "adamw" });
    expect(m.parameters / 4).toBe(124_439_808); // GPT-2 small with tied embeddings
    expect(m.gradients).toBe(m.parameters);
    expect(m.optimizer).toBe(2 * m.parameters);
  });
});

describe("memory is reused within a pass", () => {
  const config = { vocabSize: 83, blockSize: 64, nLayer: 6, nHead: 4, nEmbd: 128, dropout: 0.1 };

  test("a forward-only pass holds about one block's activations; a training pass all of them", () => {
    const ctx = newContext(1);
    const model = new GptModel(ctx, config, 1);
    const b = batchOf(new Rng(3), 8, 64, 83);
    evaluate(ctx, model, [b], { accuracy: false });
    const forwardOnly = ctx.arena.passPeakBytes;
    const train = adamwStep(ctx, model);
    train.run([b]);
    const training = ctx.arena.passPeakBytes;
    const BTC4 = 8 * 64 * 128 * 4;
    // logits and a block's widest moment (its MLP: 4C in, 4C out) bound the forward-only pass
    expect(forwardOnly).toBeLessThan(12 * BTC4);
    expect(training).toBeGreaterThan(6 * 16 * BTC4);
    ctx.dispose();
  });

  test("a validation batch of the training micro-batch needs less than a training step, in every precision", () => {
    for (const precision of ["f32", "bf16"] as const) {
      const ctx = newContext(1, { precision });
      const model = new GptModel(ctx, config, 1);
      const rng = new Rng(4);
      const train = adamwStep(ctx, model);
      train.run([batchOf(rng, 4, 64, 83)]);
      const training = ctx.arena.passPeakBytes;
      evaluate(ctx, model, [batchOf(rng, 4, 64, 83)], { accuracy: false });
      expect(ctx.arena.passPeakBytes).toBeLessThan(training / 3);
      ctx.dispose();
    }
  });

  test("a dropped tensor's memory goes to the next allocation; reading it after that is StaleTensorError", () => {
    const ctx = newContext(1);
    ctx.newPass();
    const a = ctx.fromArray(new Float32Array(1000).fill(1), [1000]);
    const b = gelu(a);
    a.drop();
    expect(() => b.toFloat32()).not.toThrow(); // b is its own
    const c = ctx.empty([1000]);
    expect(c.ptr).toBe(a.block!.ptr); // a's memory, reused
    expect(() => a.toFloat32()).toThrow(StaleTensorError);
    expect(() => add(a, b)).toThrow(StaleTensorError);
  });

  test("a tensor a recorded backward reads lives until that backward has run, then goes", () => {
    const ctx = newContext(1);
    ctx.newPass();
    const a = ctx.fromArray(
      Float32Array.from({ length: 64 }, (_, i) => i / 64 - 0.5),
      [64],
    );
    a.requiresGrad = true;
    const h = gelu(a); // gelu's backward reads its input
    const g = gelu(h);
    h.drop(); // its owner is done with it; g's backward still needs it
    const used = ctx.arena.usedBytes;
    expect(h.block!.freed).toBe(false);
    const loss = add(g, g);
    ctx.backwardFrom(loss, ctx.fromArray(new Float32Array(64).fill(1), [64]));
    expect(h.block!.freed).toBe(true);
    expect(a.grad).not.toBeNull(); // a leaf's gradient stays
    expect(ctx.arena.usedBytes).toBeLessThan(used + 64 * 4 * 4);
  });

  test("no allocation after the first training step and the first validation pass, alternating", () => {
    const be = cpu();
    const ctx = new Context(be, { seed: 1 });
    const model = new GptModel(ctx, config, 1);
    const rng = new Rng(5);
    const train = adamwStep(ctx, model);
    const counts: number[] = [];
    for (let i = 0; i < 4; i++) {
      train.run([batchOf(rng, 8, 64, 83)]);
      evaluate(ctx, model, [batchOf(rng, 8, 64, 83), batchOf(rng, 3, 64, 83)], { accuracy: false });
      counts.push(be.stats.allocCount);
    }
    expect(counts.slice(1)).toEqual([counts[1]!, counts[1]!, counts[1]!]);
    ctx.dispose();
  });
});

describe("an MLP pass's memory against the analytic count", () => {
  test.each([
    [[784, 800, 10], 128],
    [[784, 1024, 1024, 10], 64],
    [[20, 7, 3], 5],
  ] as const)("widths %p batch %i: the peak within 10%", (widths, batch) => {
    const ctx = newContext(1);
    const model = new MlpModel(ctx, { widths: [...widths], activation: "relu", dropout: 0.1 }, 1);
    const rng = new Rng(6);
    const train = constantLrStep(ctx, model, new Sgd(ctx, model.store, sgdDefaults), {
      lr: 0.01,
      gradClip: 1,
      accumSteps: 1,
    });
    const b: HostBatch = {
      inputs: Float32Array.from({ length: batch * widths[0] }, () => rng.normal()),
      inputShape: [batch, widths[0]],
      targets: Int32Array.from({ length: batch }, () => rng.int(widths[widths.length - 1]!)),
      targetShape: [batch],
    };
    train.run([b]);
    const want = mlpActivations(widths, batch).peak;
    expect(Math.abs(ctx.arena.passPeakBytes / want - 1)).toBeLessThan(0.1);
    ctx.dispose();
  });
});
