// The parameters' 2-byte copy that autocast GEMMs read (engine/params.ts weightCopy): one cast of
// the whole slab per optimizer step (a step's later micro-batches read the first one's), a new
// cast in every other pass (so whatever wrote the parameters between passes is seen: the
// optimizer, a restore, a pull), and none for what is not a parameter bound to its store's slab.
import { describe, expect, test } from "bun:test";
import { interceptCalls } from "../../bench/step-cost.ts";
import { GptModel } from "../../engine/models/gpt.ts";
import { AdamW, adamwDefaults } from "../../engine/optim/adamw.ts";
import { weightCopy } from "../../engine/params.ts";
import { Rng } from "../../engine/rng.ts";
import { Context } from "../../engine/context.ts";
import { evaluate, type HostBatch } from "../../engine/train.ts";
import { cpu } from "../helpers/numeric.ts";
import { constantLrStep } from "../helpers/training.ts";

const config = { vocabSize: 29, blockSize: 8, nLayer: 2, nHead: 2, nEmbd: 16, dropout: 0 };
const batchOf = (rng: Rng): HostBatch => ({
  inputs: Int32Array.from({ length: 16 }, () => rng.int(29)),
  inputShape: [2, 8],
  targets: Int32Array.from({ length: 16 }, () => rng.int(29)),
  targetShape: [2, 8],
});

/** A bf16 context over a CPU backend that counts casts of `n` elements (the whole slab's). */
function counting() {
  const casts = { slab: 0, n: -1 };
  const be = interceptCalls(cpu(), new Set(), (name, call, args) => {
    if (name === "castF32ToBF16" && args[2] === casts.n) casts.slab++;
    return call(...args);
  });
  const ctx = new Context(be, { seed: 1, precision: "bf16" });
  const model = new GptModel(ctx, config, 3);
  casts.n = model.store.slabNumel;
  return { ctx, model, casts };
}

describe("the weights' 2-byte copy", () => {
  test("one cast of the slab per optimizer step, whatever its micro-batches; one per evaluation pass", () => {
    const { ctx, model, casts } = counting();
    const rng = new Rng(4);
    const step = constantLrStep(ctx, model, new AdamW(ctx, model.store, adamwDefaults), {
      lr: 1e-3,
      gradClip: 1,
      accumSteps: 3,
    });
    step.run([batchOf(rng), batchOf(rng), batchOf(rng)]);
    step.run([batchOf(rng), batchOf(rng), batchOf(rng)]);
    expect(casts.slab).toBe(2);
    evaluate(ctx, model, [batchOf(rng), batchOf(rng)], { accuracy: false });
    expect(casts.slab).toBe(4);
    expect(model.store.weightCopyBytes).toBe(2 * model.store.slabNumel);
    ctx.dispose();
  });

  test("parameters written between passes (a restore) are what the next pass reads", () => {
    const rng = new Rng(5);
    const batch = batchOf(rng);
    const lossOf = (ctx: Context, model: GptModel) => evaluate(ctx, model, [batch], { accuracy: false }).loss;
    const a = counting();
    const b = counting();
    const other = new GptModel(b.ctx, config, 11);
    const before = lossOf(a.ctx, a.model);
    a.model.store.writeValues(other.store.readValues());
    const after = lossOf(a.ctx, a.model);
    expect(after).not.toBe(before);
    expect(after).toBe(lossOf(b.ctx, other));
    a.ctx.dispose();
    b.ctx.dispose();
  });

  test("no copy for what is not a parameter bound to its store's slab", () => {
    const { ctx, model } = counting();
    ctx.newPass();
    const param = model.store.param(model.store.entries[0]!.name);
    const view = weightCopy(param, "bf16");
    expect(view?.dtype).toBe("bf16");
    expect(view?.shape).toEqual(param.shape);
    expect(weightCopy(ctx.zeros([4, 4]), "bf16")).toBeNull();
    // a slab released (ZeRO stage 3 binds the parameters to gathered buffers)
    model.store.releaseValueSlab();
    expect(weightCopy(param, "bf16")).toBeNull();
    ctx.dispose();
  });
});
