// Activation recomputation (Context.recompute, GptModel.recompute): the same gradients as the
// kept activations, a lower peak of the pass's arena, and the arena's mark/release under it.
import { describe, expect, test } from "bun:test";
import { EngineError, ShapeError } from "../../engine/errors.ts";
import { GptModel } from "../../engine/models/gpt.ts";
import { add } from "../../engine/ops/add.ts";
import { gelu } from "../../engine/ops/gelu.ts";
import { Rng } from "../../engine/rng.ts";
import type { Tensor } from "../../engine/tensor.ts";
import type { Context } from "../../engine/context.ts";
import { newContext, randInts } from "../helpers/numeric.ts";

const maxRelDiff = (a: Float32Array, b: Float32Array): number => {
  let worst = 0;
  const scale = Math.max(...a.map(Math.abs), 1e-30);
  for (let i = 0; i < a.length; i++) worst = Math.max(worst, Math.abs(a[i]! - b[i]!) / scale);
  return worst;
};

/** One pass of the GPT: loss, gradients, and the arena's peak. */
function gptPass(ctx: Context, model: GptModel, x: Int32Array, y: Int32Array, shape: number[]) {
  ctx.newPass();
  model.store.zeroGrad();
  const loss = model.loss(ctx.fromArray(x, shape), ctx.fromArray(y, shape));
  const value = loss.item();
  ctx.backward(loss);
  return { loss: value, grads: model.store.readGrads().slice(), peak: ctx.arena.passPeakBytes };
}

describe("activation recomputation", () => {
  test("GPT with dropout: the same loss and gradients as keeping the activations (<= 1e-6 relative), and a lower peak of the pass's memory", () => {
    const config = { vocabSize: 23, blockSize: 32, nLayer: 6, nHead: 4, nEmbd: 64, dropout: 0.1 };
    const rng = new Rng(7);
    const shape = [4, 32];
    const x = randInts(rng, 128, 23),
      y = randInts(rng, 128, 23);
    const run = (recompute: boolean) => {
      // the same seed: the same parameters and the same dropout masks, if recompute replays them
      const ctx = newContext(11);
      const model = new GptModel(ctx, config, 3);
      model.recompute = recompute;
      const first = gptPass(ctx, model, x, y, shape);
      const second = gptPass(ctx, model, x, y, shape); // the next pass's masks follow on alike
      const out = { first, second, tapeLeft: ctx.tape.length };
      ctx.dispose();
      return out;
    };
    const kept = run(false),
      again = run(true);
    expect(again.first.loss).toBe(kept.first.loss);
    expect(maxRelDiff(kept.first.grads, again.first.grads)).toBeLessThanOrEqual(1e-6);
    expect(again.second.loss).toBe(kept.second.loss);
    expect(maxRelDiff(kept.second.grads, again.second.grads)).toBeLessThanOrEqual(1e-6);
    expect(kept.first.grads.some((g) => g !== 0)).toBe(true);
    expect(again.tapeLeft).toBe(0);
    const mb = (b: number) => (b / 2 ** 20).toFixed(2);
    console.log(
      `peak activation memory of a pass (arena), GPT ${config.nLayer} layers, batch ${shape.join("x")}: ` +
        `kept ${mb(kept.first.peak)} MiB, recomputed ${mb(again.first.peak)} MiB (${((again.first.peak / kept.first.peak) * 100).toFixed(0)}%)`,
    );
    expect(again.first.peak).toBeLessThan(kept.first.peak * 0.6);
  });

  test("peak memory: each more block adds its input only, not its activations", () => {
    const peakOf = (nLayer: number, recompute: boolean) => {
      const ctx = newContext();
      const model = new GptModel(ctx, { vocabSize: 17, blockSize: 16, nLayer, nHead: 2, nEmbd: 32, dropout: 0 }, 1);
      model.recompute = recompute;
      const rng = new Rng(1);
      const { peak } = gptPass(ctx, model, randInts(rng, 64, 17), randInts(rng, 64, 17), [4, 16]);
      ctx.dispose();
      return peak;
    };
    const perBlockKept = peakOf(3, false) - peakOf(2, false);
    const perBlockRecomputed = peakOf(3, true) - peakOf(2, true);
    const input = 4 * 16 * 32 * 4; // (B,T,C) f32: the block's kept input
    console.log(
      `bytes one more block adds to the peak: kept ${perBlockKept}, recomputed ${perBlockRecomputed} (its input: ${input})`,
    );
    // the output copy and its gradient are the input of the next: the input and its gradient, aligned
    expect(perBlockRecomputed).toBeLessThanOrEqual(2 * input + 128);
    expect(perBlockKept).toBeGreaterThan(8 * perBlockRecomputed);
  });

  test("backwardSteps: each parameter of a recomputed block is ready once, with its final gradient", () => {
    const ctx = newContext();
    const model = new GptModel(ctx, { vocabSize: 11, blockSize: 8, nLayer: 2, nHead: 2, nEmbd: 16, dropout: 0 }, 1);
    model.recompute = true;
    const rng = new Rng(2);
    ctx.newPass();
    model.store.zeroGrad();
    const loss = model.loss(ctx.fromArray(randInts(rng, 16, 11), [2, 8]), ctx.fromArray(randInts(rng, 16, 11), [2, 8]));
    const order: string[] = [];
    const atReady = new Map<string, Float32Array>();
    for (const ready of ctx.backwardSteps(loss)) {
      for (const t of ready) {
        order.push(t.name!);
        atReady.set(t.name!, (t.grad!.toArray() as Float32Array).slice());
      }
    }
    expect(new Set(order).size).toBe(order.length);
    expect(new Set(order)).toEqual(new Set(model.store.entries.map((e) => e.name)));
    const final = model.store.readGrads();
    for (const e of model.store.entries) expect(atReady.get(e.name)).toEqual(final.slice(e.offset, e.offset + e.numel));
  });

  test("a function that changes its input's shape is refused; without gradients it just runs", () => {
    const ctx = newContext();
    ctx.newPass();
    const w = ctx.fromArray(new Float32Array([1, 2, 3, 4]), [2, 2]);
    w.requiresGrad = true;
    expect(() => ctx.recompute(w, [], (t: Tensor) => t.reshape([4]))).toThrow(ShapeError);
    const y = ctx.noGrad(() => ctx.recompute(w, [], (t) => add(gelu(t), t)));
    expect(y.requiresGrad).toBe(false);
    expect(ctx.tape.length).toBe(0);
  });

  test("arena marks: release frees what came after; a stale mark is refused", () => {
    const ctx = newContext();
    ctx.newPass();
    const a = ctx.arena;
    a.alloc(1000);
    const m = a.mark();
    const used = a.usedBytes;
    a.alloc(5000);
    a.release(m);
    expect(a.usedBytes).toBe(used);
    expect(a.passPeakBytes).toBeGreaterThanOrEqual(used + 5000);
    expect(() => a.release({ ...m, usedBytes: used + 64 })).toThrow(EngineError);
    ctx.newPass();
    expect(() => a.release(m)).toThrow(EngineError);
    expect(a.passPeakBytes).toBe(0);
  });
});
