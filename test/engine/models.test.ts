// Model structure: parameter counts, weight tying, sampling, and model files.
import { afterAll, describe, expect, test } from "bun:test";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { DataFileError } from "../../engine/data/errors.ts";
import { loadSlabInto, readModelFile, saveModelFile } from "../../engine/modelfile.ts";
import { GptModel } from "../../engine/models/gpt.ts";
import { MlpModel } from "../../engine/models/mlp.ts";
import { Rng } from "../../engine/rng.ts";
import { ConfigError } from "../../ffi/errors.ts";
import { sampleLogits, samplingDefaults } from "../../engine/models/sampling.ts";
import { expectCachedGeneration } from "../helpers/generation.ts";
import { cpu, newContext, randInts } from "../helpers/numeric.ts";

const dir = mkdtempSync(join(tmpdir(), "meshtrain-models-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

describe("mlp", () => {
  test("784-800-10 has LeCun's 636,010 parameters, decay on matrices only", () => {
    const model = new MlpModel(newContext(), { widths: [784, 800, 10], activation: "relu", dropout: 0 }, 1);
    expect(model.store.paramCount).toBe(784 * 800 + 800 + 800 * 10 + 10);
    expect(model.store.entries.filter((e) => e.decay).map((e) => e.name)).toEqual(["mlp.0.weight", "mlp.1.weight"]);
    expect(model.store.entry("mlp.0.weight").offset % 16).toBe(0);
    expect(model.forward(newContextTensor(model)).shape).toEqual([2, 10]);
  });
  test("bad widths are refused", () => {
    expect(() => new MlpModel(newContext(), { widths: [784], activation: "relu", dropout: 0 }, 1)).toThrow(ConfigError);
    expect(() => new MlpModel(newContext(), { widths: [4, 0, 2], activation: "relu", dropout: 0 }, 1)).toThrow(
      ConfigError,
    );
  });
});

function newContextTensor(model: MlpModel) {
  const ctx = model.store.valuesTensor.ctx;
  return ctx.fromArray(new Float32Array(2 * 784), [2, 784]);
}

describe("gpt", () => {
  const config = { vocabSize: 11, blockSize: 8, nLayer: 2, nHead: 2, nEmbd: 16, dropout: 0 };

  test("parameter count and logits shape; tied head: wte gets gradient from input and output", () => {
    const ctx = newContext();
    const model = new GptModel(ctx, config, 1);
    const C = 16;
    const perBlock = 2 * C + (C * 3 * C + 3 * C) + (C * C + C) + 2 * C + (C * 4 * C + 4 * C) + (4 * C * C + C);
    expect(model.store.paramCount).toBe(11 * C + 8 * C + 2 * perBlock + 2 * C);
    const rng = new Rng(1);
    // ids only 0..4 as inputs: rows 5..10 of wte are reached only through the output projection
    const x = ctx.fromArray(randInts(rng, 16, 5), [2, 8]);
    expect(model.forward(x).shape).toEqual([2, 8, 11]);
    ctx.newPass();
    model.store.zeroGrad();
    const y = ctx.fromArray(randInts(rng, 16, 11), [2, 8]);
    ctx.backward(model.loss(ctx.fromArray(randInts(rng, 16, 5), [2, 8]), y));
    const g = model.store.readGrads();
    const wte = model.store.entry("wte.weight");
    const row10 = g.subarray(wte.offset + 10 * C, wte.offset + 11 * C);
    expect(row10.some((v) => v !== 0)).toBe(true);
  });

  test("backwardSteps: every parameter once, only after its last gradient write (wte, tied, last); the same gradients as backward()", () => {
    const ctx = newContext();
    const model = new GptModel(ctx, config, 1);
    const rng = new Rng(2);
    const x = randInts(rng, 16, 11),
      y = randInts(rng, 16, 11);
    const run = () => {
      ctx.newPass();
      model.store.zeroGrad();
      return model.loss(ctx.fromArray(x, [2, 8]), ctx.fromArray(y, [2, 8]));
    };
    ctx.backward(run());
    const reference = model.store.readGrads();
    const loss = run();
    const planned = ctx
      .gradReadyOrder()
      .flat()
      .map((t) => t.name!);
    const order: string[] = [];
    const complete = new Map<string, Float32Array>();
    for (const ready of ctx.backwardSteps(loss)) {
      for (const t of ready) {
        order.push(t.name!);
        complete.set(t.name!, (t.grad!.toArray() as Float32Array).slice());
      }
    }
    expect(order).toEqual(planned);
    expect(new Set(order).size).toBe(model.store.entries.length);
    expect(order.at(-1)).toBe("wte.weight"); // read by the head first and the embedding last
    // each gradient, when yielded, is already final: nothing after it wrote to it
    const final = model.store.readGrads();
    for (const e of model.store.entries) {
      expect(complete.get(e.name)).toEqual(final.slice(e.offset, e.offset + e.numel));
      expect(final.slice(e.offset, e.offset + e.numel)).toEqual(reference.slice(e.offset, e.offset + e.numel));
    }
    expect(ctx.tape.length).toBe(0);
  });

  test("generate: same seed, same text; respects blockSize; bad settings refused", () => {
    const ctx = newContext();
    const model = new GptModel(ctx, config, 3);
    const a = model.generate([1, 2, 3], 20, new Rng(5), { topK: 4 });
    const b = model.generate([1, 2, 3], 20, new Rng(5), { topK: 4 });
    expect(a).toEqual(b);
    expect(a.length).toBe(20);
    const streamed: number[] = [];
    expect(model.generate([1, 2, 3], 20, new Rng(5), { topK: 4, onToken: (t) => streamed.push(t) })).toEqual(a);
    expect(streamed).toEqual(a); // each token as it is sampled, in order
    expect(a.every((t) => t >= 0 && t < 11)).toBe(true);
    expect(() => model.generate([], 5, new Rng(1))).toThrow(ConfigError);
    for (const bad of [
      { temperature: 0 },
      { topK: -1 },
      { topK: 1.5 },
      { topP: 0 },
      { topP: 1.01 },
      { topP: Number.NaN },
    ])
      expect(() => model.generate([1], 5, new Rng(1), bad)).toThrow(ConfigError);
  });

  test("generate with the KV cache: the tokens of the whole window's forward, its logits to rounding", () => {
    expectCachedGeneration(cpu());
  });

  test("top-p keeps the most likely tokens up to p; a drawn stop token ends the sample", () => {
    const model = new GptModel(newContext(), config, 3);
    const rng = new Rng(2);
    const logits = Float32Array.from([0, 3, 1, 2.9, -1]);
    const drawn = new Set(
      Array.from({ length: 200 }, () => sampleLogits(logits, rng, { ...samplingDefaults, topP: 0.6 })),
    );
    expect([...drawn].sort()).toEqual([1, 3]); // p(1) ≈ 0.48 < 0.6, with p(3) ≈ 0.44 past it
    const greedy = Array.from({ length: 20 }, () => sampleLogits(logits, rng, { ...samplingDefaults, topP: 0.01 }));
    expect(new Set(greedy)).toEqual(new Set([1]));
    const free = model.generate([1, 2, 3], 20, new Rng(5));
    const stop = free[4]!;
    const stopped = model.generate([1, 2, 3], 20, new Rng(5), { stopAt: stop });
    expect(stopped).toEqual(free.slice(0, free.indexOf(stop)));
  });

  test("configs that cannot work are refused", () => {
    expect(() => new GptModel(newContext(), { ...config, nHead: 3 }, 1)).toThrow(/divisible/);
    expect(() => new GptModel(newContext(), { ...config, vocabSize: 0 }, 1)).toThrow(ConfigError);
    expect(() => new GptModel(newContext(), { ...config, dropout: 1 }, 1)).toThrow(ConfigError);
  });
});

describe("model files", () => {
  const config = { vocabSize: 7, blockSize: 4, nLayer: 1, nHead: 1, nEmbd: 8, dropout: 0 };
  const save = (name: string) => {
    const model = new GptModel(newContext(), config, 9);
    const path = join(dir, name);
    saveModelFile(path, model.store, { kind: "gpt", config, vocab: ["a", "b", "c", "d", "e", "f", "g"], step: 12 });
    return { model, path };
  };

  test("round trip: same weights, config and vocabulary", () => {
    const { model, path } = save("ok.mtm");
    const loaded = readModelFile(path);
    expect(loaded.header.step).toBe(12);
    expect(loaded.header.vocab).toEqual(["a", "b", "c", "d", "e", "f", "g"]);
    const copy = new GptModel(newContext(), loaded.header.config as typeof config, 0);
    loadSlabInto(path, copy.store, loaded);
    expect(copy.store.readValues()).toEqual(model.store.readValues());
  });

  test("corruption, truncation, other files and other versions are detected", () => {
    const { path } = save("bad.mtm");
    const bytes = readFileSync(path);
    const flipped = Buffer.from(bytes);
    flipped.writeUInt8(flipped[flipped.length - 5]! ^ 0x10, flipped.length - 5);
    writeFileSync(join(dir, "flip.mtm"), flipped);
    expect(() => readModelFile(join(dir, "flip.mtm"))).toThrow(/checksum mismatch/);
    writeFileSync(join(dir, "cut.mtm"), bytes.subarray(0, bytes.length - 4));
    expect(() => readModelFile(join(dir, "cut.mtm"))).toThrow(/truncated or corrupt/);
    writeFileSync(join(dir, "other.mtm"), "hello, world, not a model");
    expect(() => readModelFile(join(dir, "other.mtm"))).toThrow(/bad magic number/);
    const v2 = Buffer.from(bytes);
    v2.writeUInt32LE(2, 8);
    writeFileSync(join(dir, "v2.mtm"), v2);
    expect(() => readModelFile(join(dir, "v2.mtm"))).toThrow(/format version 2; this meshtrain reads version 1/);
    expect(() => readModelFile(join(dir, "v2.mtm"))).toThrow(DataFileError);
  });

  test("a slab of another architecture is refused", () => {
    const { path } = save("arch.mtm");
    const other = new GptModel(newContext(), { ...config, nLayer: 2 }, 0);
    expect(() => loadSlabInto(path, other.store, readModelFile(path))).toThrow(/layout does not match/);
  });
});
