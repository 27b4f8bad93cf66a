// Generation with the KV cache against the whole window's forward, on any backend: the same
// tokens for the same seed, and each step's logits to rounding (tests on the CPU and on the
// emulated CUDA backend).
import { expect } from "bun:test";
import type { Backend } from "../../ffi/backend.ts";
import { Context } from "../../engine/context.ts";
import { type GptConfig, GptModel, KvCache } from "../../engine/models/gpt.ts";
import { Rng } from "../../engine/rng.ts";
import { relErr } from "./numeric.ts";

/** blockSize 8: a 3-token prompt and 12 new tokens slide the window past it */
export const kvConfig: GptConfig = { vocabSize: 11, blockSize: 8, nLayer: 2, nHead: 2, nEmbd: 16, dropout: 0 };

/** A model whose logits are far from uniform (the init's std 0.02 gives near-uniform ones). */
function sharpModel(ctx: Context): GptModel {
  const model = new GptModel(ctx, kvConfig, 3);
  const values = model.store.readValues();
  model.store.writeValues(values.map((v) => v * 20));
  return model;
}

export function expectCachedGeneration(backend: Backend): void {
  const ctx = new Context(backend, { seed: 1 });
  try {
    const model = sharpModel(ctx);
    const cached = model.generate([1, 2, 3], 12, new Rng(5), { topK: 6 });
    const full = model.generate([1, 2, 3], 12, new Rng(5), { topK: 6, kvCache: false });
    expect(cached).toEqual(full);
    expect(new Set(cached).size).toBeGreaterThan(2); // a sample, not one token repeated
    // each step's logits: a prefill of 3, then one token at a time, then re-prefills of the window
    const tokens = [1, 2, 3, ...full];
    const cache = new KvCache(ctx, kvConfig);
    const errs: number[] = [];
    for (let n = 3; n <= tokens.length; n++) {
      ctx.newPass();
      const got = ctx.noGrad(() => cache.step(model, tokens.slice(0, n)));
      const window = tokens.slice(Math.max(0, n - kvConfig.blockSize), n);
      const all = ctx.noGrad(() => model.forward(ctx.fromArray(Int32Array.from(window), [1, window.length])));
      const V = kvConfig.vocabSize;
      errs.push(relErr(got, all.toFloat32().subarray((window.length - 1) * V)));
    }
    cache.dispose();
    expect(Math.max(...errs)).toBeLessThan(1e-5);
  } finally {
    ctx.dispose();
  }
}
