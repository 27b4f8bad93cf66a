// Optimizers, schedules, clipping and accumulation against the published rules, computed by
// hand (in float64) in the test.
import { describe, expect, test } from "bun:test";
import { GptModel } from "../../engine/models/gpt.ts";
import { MlpModel } from "../../engine/models/mlp.ts";
import { AdamW } from "../../engine/optim/adamw.ts";
import { optimizerOf } from "../../engine/optim/choose.ts";
import type { Optimizer } from "../../engine/optim/optimizer.ts";
import { clipGradNorm, gradNorm } from "../../engine/optim/clip.ts";
import { lrAt, scaleLrForBatch, scheduleOf } from "../../engine/optim/schedule.ts";
import { Sgd, type SgdConfig } from "../../engine/optim/sgd.ts";
import { ParamBuilder, ParamStore } from "../../engine/params.ts";
import { Rng } from "../../engine/rng.ts";
import type { Context } from "../../engine/context.ts";
import type { HostBatch } from "../../engine/train.ts";
import { newContext, randInts, relErr } from "../helpers/numeric.ts";
import { ConfigError } from "../../ffi/errors.ts";
import { constantLrStep } from "../helpers/training.ts";

/** A store with w (3, decays) and b (2, no decay), values set, and a way to set grads. */
function tinyStore(ctx: Context) {
  const pb = new ParamBuilder();
  pb.add("w", [3], { kind: "zeros" }, true);
  pb.add("b", [2], { kind: "zeros" }, false);
  const store = ParamStore.build(ctx, pb, 0);
  const w = store.entry("w");
  const b = store.entry("b");
  const slab = new Float32Array(store.slabNumel);
  slab.set([1, -2, 3], w.offset);
  slab.set([0.5, -0.5], b.offset);
  store.writeValues(slab);
  const setGrads = (gw: number[], gb: number[]) => {
    const g = new Float32Array(store.slabNumel);
    g.set(gw, w.offset);
    g.set(gb, b.offset);
    ctx.backend.upload(store.grads.ptr, g);
  };
  const values = () => {
    const v = store.readValues();
    return { w: [...v.subarray(w.offset, w.offset + 3)], b: [...v.subarray(b.offset, b.offset + 2)] };
  };
  return { store, setGrads, values };
}

const grads = [
  { w: [0.1, -0.2, 0.3], b: [1, -1] },
  { w: [-0.4, 0.5, 0.6], b: [0.5, 0.25] },
  { w: [0.7, -0.8, -0.9], b: [-2, 3] },
];

function expectClose(actual: number[], expected: number[], tol = 1e-6) {
  expect(relErr(actual, expected)).toBeLessThanOrEqual(tol);
}

/**
 * Three SGD steps over `grads` at `lr` on a fresh tinyStore; after each, the values must be what
 * `byHand(g, t)` computes by the rule under test (it keeps its own state); b only where it says.
 */
function expectSgdSteps(
  options: SgdConfig,
  lr: number,
  byHand: (g: (typeof grads)[number], t: number) => { w: number[]; b?: number[] },
) {
  const ctx = newContext();
  const { store, setGrads, values } = tinyStore(ctx);
  const opt = new Sgd(ctx, store, options);
  grads.forEach((g, t) => {
    setGrads(g.w, g.b);
    opt.step(lr);
    const { w, b } = byHand(g, t);
    expectClose(values().w, w);
    if (b !== undefined) expectClose(values().b, b);
  });
}

describe("SGD (torch.optim.SGD rules)", () => {
  test("momentum 0.9, weight decay 0.1 on w only, three steps", () => {
    const lr = 0.1;
    // by hand: g' = g + wd p (w only); buf1 = g'; buf_t = 0.9 buf + g'; p -= lr buf
    let w = [1, -2, 3];
    let b = [0.5, -0.5];
    let bufW = [0, 0, 0];
    let bufB = [0, 0];
    expectSgdSteps({ momentum: 0.9, dampening: 0, nesterov: false, weightDecay: 0.1 }, lr, (g, t) => {
      const gw = g.w.map((x, i) => x + 0.1 * w[i]!);
      bufW = t === 0 ? gw : bufW.map((m, i) => 0.9 * m + gw[i]!);
      bufB = t === 0 ? g.b : bufB.map((m, i) => 0.9 * m + g.b[i]!);
      w = w.map((p, i) => p - lr * bufW[i]!);
      b = b.map((p, i) => p - lr * bufB[i]!);
      return { w, b };
    });
  });

  test("Nesterov momentum", () => {
    let w = [1, -2, 3];
    let buf = [0, 0, 0];
    expectSgdSteps({ momentum: 0.5, dampening: 0, nesterov: true, weightDecay: 0 }, 0.2, (g, t) => {
      buf = t === 0 ? g.w : buf.map((m, i) => 0.5 * m + g.w[i]!);
      // p -= lr (g + momentum buf)
      w = w.map((p, i) => p - 0.2 * (g.w[i]! + 0.5 * buf[i]!));
      return { w };
    });
  });

  test("dampening, and plain SGD without momentum", () => {
    let w = [1, -2, 3];
    let buf = [0, 0, 0];
    expectSgdSteps({ momentum: 0.9, dampening: 0.3, nesterov: false, weightDecay: 0 }, 0.1, (g, t) => {
      buf = t === 0 ? g.w : buf.map((m, i) => 0.9 * m + 0.7 * g.w[i]!);
      w = w.map((p, i) => p - 0.1 * buf[i]!);
      return { w };
    });
    const plain = tinyStore(newContext());
    const sgd = new Sgd(plain.store.valuesTensor.ctx, plain.store, {
      momentum: 0,
      dampening: 0,
      nesterov: false,
      weightDecay: 0,
    });
    plain.setGrads([1, 2, 3], [4, 5]);
    sgd.step(0.5);
    expectClose(plain.values().w, [0.5, -3, 1.5]);
    expectClose(plain.values().b, [-1.5, -3]);
  });

  test("invalid settings are refused", () => {
    const ctx = newContext();
    const { store } = tinyStore(ctx);
    expect(() => new Sgd(ctx, store, { momentum: 1.5, dampening: 0, nesterov: false, weightDecay: 0 })).toThrow(
      ConfigError,
    );
    expect(() => new Sgd(ctx, store, { momentum: 0, dampening: 0, nesterov: true, weightDecay: 0 })).toThrow(
      /nesterov/,
    );
    expect(() => new Sgd(ctx, store, { momentum: 0.9, dampening: 0, nesterov: false, weightDecay: -1 })).toThrow(
      ConfigError,
    );
  });
});

describe("optimizerOf: the optimizer a spec names", () => {
  test.each([
    ["sgd", { kind: "sgd", momentum: 0.9, nesterov: true, weightDecay: 0.1 }, ["momentum"]],
    ["adamw", { kind: "adamw", beta1: 0.8, beta2: 0.99, eps: 1e-6, weightDecay: 0.1 }, ["m", "v"]],
  ] as const)("%s: three steps as the class built by hand, the same state", (_, spec, state) => {
    const run = (make: (ctx: Context, store: ParamStore) => Optimizer) => {
      const ctx = newContext();
      const { store, setGrads, values } = tinyStore(ctx);
      const opt = make(ctx, store);
      for (const g of grads) {
        setGrads(g.w, g.b);
        opt.step(0.1);
      }
      return { values: values(), name: opt.name, state: opt.stateSlabs().map((x) => x.name) };
    };
    const byHand = run((ctx, store) =>
      spec.kind === "sgd"
        ? new Sgd(ctx, store, { momentum: 0.9, dampening: 0, nesterov: true, weightDecay: 0.1 })
        : new AdamW(ctx, store, { beta1: 0.8, beta2: 0.99, eps: 1e-6, weightDecay: 0.1 }),
    );
    const chosen = run((ctx, store) => optimizerOf(ctx, store, spec));
    expect(chosen).toEqual(byHand);
    expect(chosen.name).toBe(spec.kind);
    expect(chosen.state).toEqual([...state]);
  });

  test("sparse gradients (top-k): AdamW keeps each coordinate's age; SGD has no such state", () => {
    const ctx = newContext();
    const { store } = tinyStore(ctx);
    const adamw = optimizerOf(
      ctx,
      store,
      { kind: "adamw", beta1: 0.9, beta2: 0.999, eps: 1e-8, weightDecay: 0 },
      { sparse: true },
    );
    expect(adamw.stateSlabs().map((x) => x.name)).toEqual(["m", "v", "age"]);
    const sgd = optimizerOf(
      ctx,
      store,
      { kind: "sgd", momentum: 0, nesterov: false, weightDecay: 0 },
      { sparse: true },
    );
    expect(sgd.stateSlabs().map((x) => x.name)).toEqual(["momentum"]);
  });
});

describe("AdamW (torch.optim.AdamW rules)", () => {
  test("three steps with bias correction and decoupled weight decay on w only", () => {
    const ctx = newContext();
    const { store, setGrads, values } = tinyStore(ctx);
    const [b1, b2, eps, wd, lr] = [0.9, 0.999, 1e-8, 0.1, 0.01];
    const opt = new AdamW(ctx, store, { beta1: b1, beta2: b2, eps, weightDecay: wd });
    let w = [1, -2, 3];
    let bb = [0.5, -0.5];
    let mW = [0, 0, 0],
      vW = [0, 0, 0],
      mB = [0, 0],
      vB = [0, 0];
    grads.forEach((g, i) => {
      const t = i + 1;
      setGrads(g.w, g.b);
      opt.step(lr);
      // p = p (1 - lr wd); m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2;
      // p -= lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
      mW = mW.map((m, k) => b1 * m + (1 - b1) * g.w[k]!);
      vW = vW.map((v, k) => b2 * v + (1 - b2) * g.w[k]! ** 2);
      mB = mB.map((m, k) => b1 * m + (1 - b1) * g.b[k]!);
      vB = vB.map((v, k) => b2 * v + (1 - b2) * g.b[k]! ** 2);
      const bc1 = 1 - b1 ** t,
        bc2 = 1 - b2 ** t;
      w = w.map((p, k) => p * (1 - lr * wd) - (lr * (mW[k]! / bc1)) / (Math.sqrt(vW[k]! / bc2) + eps));
      bb = bb.map((p, k) => p - (lr * (mB[k]! / bc1)) / (Math.sqrt(vB[k]! / bc2) + eps));
      expectClose(values().w, w);
      expectClose(values().b, bb);
    });
    expect(opt.stepCount).toBe(3);
  });

  test("the whole slab (w decayed, b not) is one launch, and a clip factor folded in equals the gradients scaled first", () => {
    const launches: number[] = [];
    let decayed = 0;
    const run = (fold: boolean) => {
      const ctx = newContext();
      const { store, setGrads, values } = tinyStore(ctx);
      const adamwStep = ctx.backend.adamwStep.bind(ctx.backend);
      ctx.backend.adamwStep = (...args: Parameters<typeof adamwStep>) => {
        launches.push(args[6]); // decayEnd
        adamwStep(...args);
      };
      decayed = store.decayRange.numel;
      const opt = new AdamW(ctx, store, { beta1: 0.9, beta2: 0.999, eps: 1e-8, weightDecay: 0.1 });
      for (const [i, g] of grads.entries()) {
        setGrads(g.w, g.b);
        const factor = 0.25 * (i + 1);
        if (fold) opt.step(0.01, factor);
        else {
          ctx.backend.scale(store.grads.ptr, store.slabNumel, factor);
          opt.step(0.01);
        }
      }
      ctx.backend.adamwStep = adamwStep;
      return [...values().w, ...values().b];
    };
    const folded = run(true);
    // one launch a step, weight decay on the decayed prefix (w, padded), none on the rest (b)
    expect(launches).toEqual([decayed, decayed, decayed]);
    expect(decayed).toBeGreaterThanOrEqual(3);
    expect(run(false)).toEqual(folded);
  });
});

describe("AdamW for sparse (top-k) gradients: a gradient after tau steps counts as tau steps of its mean", () => {
  const [b1, b2, eps, wd, lr] = [0.9, 0.99, 1e-8, 0.1, 0.01];

  test("with a gradient in every coordinate at every step it is AdamW, bit for bit", () => {
    const ctx = newContext();
    const a = tinyStore(ctx),
      s = tinyStore(ctx);
    const plain = new AdamW(ctx, a.store, { beta1: b1, beta2: b2, eps, weightDecay: wd });
    const sparse = new AdamW(ctx, s.store, { beta1: b1, beta2: b2, eps, weightDecay: wd, sparse: true });
    expect(sparse.stateSlabs().map((x) => x.name)).toEqual(["m", "v", "age"]);
    for (const g of grads) {
      a.setGrads(g.w, g.b);
      s.setGrads(g.w, g.b);
      plain.step(lr);
      sparse.step(lr);
      expect(s.store.readValues()).toEqual(a.store.readValues());
    }
  });

  test("against a float64 reference: a zero decays and waits; g after tau steps moves the moments by beta^tau and the parameter tau steps", () => {
    const ctx = newContext();
    const { store, setGrads, values } = tinyStore(ctx);
    const opt = new AdamW(ctx, store, { beta1: b1, beta2: b2, eps, weightDecay: wd, sparse: true });
    // w[0] every step, w[1] after 3 steps, w[2] never; b[0] at steps 1 and 4, b[1] at step 4
    const seq = [
      { w: [0.1, 0, 0], b: [1, 0] },
      { w: [-0.4, 0, 0], b: [0, 0] },
      { w: [0.7, 0.9, 0], b: [0, 0] },
      { w: [0.2, 0, 0], b: [-2, 0.6] },
    ];
    const ref = {
      p: [1, -2, 3, 0.5, -0.5],
      m: [0, 0, 0, 0, 0],
      v: [0, 0, 0, 0, 0],
      age: [0, 0, 0, 0, 0],
    };
    const decays = [true, true, true, false, false];
    seq.forEach((g, i) => {
      const t = i + 1;
      setGrads(g.w, g.b);
      opt.step(lr);
      const bc1 = 1 - b1 ** t,
        bc2 = 1 - b2 ** t;
      [...g.w, ...g.b].forEach((gk, k) => {
        if (decays[k]) ref.p[k]! *= 1 - lr * wd;
        if (gk === 0) {
          ref.age[k]!++;
          return;
        }
        const tau = ref.age[k]! + 1;
        ref.age[k] = 0;
        // tau steps of the mean gradient gk / tau, by the recursion itself
        for (let j = 0; j < tau; j++) {
          ref.m[k] = b1 * ref.m[k]! + (1 - b1) * (gk / tau);
          ref.v[k] = b2 * ref.v[k]! + (1 - b2) * (gk / tau) ** 2;
        }
        ref.p[k]! -= (tau * lr * (ref.m[k]! / bc1)) / (Math.sqrt(ref.v[k]! / bc2) + eps);
      });
      const got = values();
      expectClose([...got.w, ...got.b], ref.p, 2e-6);
    });
    const age = new Float32Array(store.slabNumel);
    ctx.backend.download(opt.stateSlabs()[2]!.allocation.ptr, age);
    expect([age[store.entry("w").offset + 2], age[store.entry("w").offset + 1], age[store.entry("b").offset]]).toEqual([
      4, 1, 0,
    ]);
  });

  test("a burst of tau steps' gradient moves the parameter as tau dense steps of its mean would (plain AdamW: about sqrt(tau) of them)", () => {
    const tau = 16,
      g = 0.05;
    const ctx = newContext();
    const run = (sparse: boolean, burst: boolean) => {
      const { store, setGrads, values } = tinyStore(ctx);
      const opt = new AdamW(ctx, store, { beta1: b1, beta2: b2, eps, weightDecay: 0, sparse });
      for (let round = 0; round < 8; round++) {
        for (let j = 0; j < tau; j++) {
          const x = burst ? (j === tau - 1 ? tau * g : 0) : g;
          setGrads([x, 0, 0], [0, 0]);
          opt.step(lr);
        }
      }
      return 1 - values().w[0]!;
    };
    const dense = run(false, false);
    const caughtUp = run(true, true);
    const plain = run(false, true);
    expect(Math.abs(caughtUp - dense) / dense).toBeLessThan(0.15);
    expect(plain / dense).toBeLessThan(0.5);
  });
});

describe("learning-rate schedules", () => {
  test("scheduleOf: constant ignores the rest; warmup is cut to leave a step after it", () => {
    expect(scheduleOf("constant", 100, 10, 0)).toEqual({ kind: "constant" });
    expect(scheduleOf("cosine", 100, 1000, 0.01)).toEqual({
      kind: "cosine",
      warmupSteps: 100,
      totalSteps: 1000,
      minLr: 0.01,
    });
    expect(scheduleOf("linear", 100, 50, 0)).toEqual({ kind: "linear", warmupSteps: 49, totalSteps: 50, minLr: 0 });
    expect(scheduleOf("cosine", 5, 0, 0)).toEqual({ kind: "cosine", warmupSteps: 0, totalSteps: 0, minLr: 0 });
  });

  test("constant", () => {
    expect(lrAt({ kind: "constant" }, 0.1, 0)).toBe(0.1);
    expect(lrAt({ kind: "constant" }, 0.1, 10 ** 6)).toBe(0.1);
  });
  test("linear warmup then cosine to minLr", () => {
    const s = { kind: "cosine", warmupSteps: 10, totalSteps: 110, minLr: 0.01 } as const;
    expect(lrAt(s, 1, 0)).toBeCloseTo(0.1, 12); // (0 + 1) / 10
    expect(lrAt(s, 1, 9)).toBeCloseTo(1, 12);
    expect(lrAt(s, 1, 10)).toBeCloseTo(1, 12); // cos(0)
    expect(lrAt(s, 1, 60)).toBeCloseTo(0.01 + 0.5 * 0.99, 12); // halfway: cos(pi/2) = 0
    expect(lrAt(s, 1, 110)).toBeCloseTo(0.01, 12);
    expect(lrAt(s, 1, 500)).toBeCloseTo(0.01, 12);
  });
  test("linear warmup then linear decay", () => {
    const s = { kind: "linear", warmupSteps: 4, totalSteps: 104, minLr: 0 } as const;
    expect(lrAt(s, 2, 1)).toBeCloseTo(1, 12); // 2 * 2 / 4
    expect(lrAt(s, 2, 54)).toBeCloseTo(1, 12); // half-way down
    expect(lrAt(s, 2, 104)).toBe(0);
  });
  test("linear scaling rule", () => {
    expect(scaleLrForBatch(0.1, 256, 1024)).toBeCloseTo(0.4, 12);
    expect(() => scaleLrForBatch(0.1, 0, 8)).toThrow(ConfigError);
  });
});

describe("gradient clipping", () => {
  test("scales to maxNorm when above, leaves it alone when below", () => {
    const ctx = newContext();
    const { store, setGrads } = tinyStore(ctx);
    setGrads([3, 0, 0], [0, 4]); // norm 5
    expect(clipGradNorm(ctx, store, 1)).toBeCloseTo(5, 5);
    expect(gradNorm(ctx, store)).toBeCloseTo(1, 5);
    const g = store.readGrads();
    expect(g[store.entry("w").offset]).toBeCloseTo(0.6, 5);
    setGrads([0.3, 0, 0], [0, 0.4]);
    expect(clipGradNorm(ctx, store, 1)).toBeCloseTo(0.5, 6);
    expect(gradNorm(ctx, store)).toBeCloseTo(0.5, 6);
    expect(clipGradNorm(ctx, store, 0)).toBeCloseTo(0.5, 6); // 0: measure only
  });
});

function mlpBatch(rng: Rng, n: number): HostBatch {
  return {
    inputs: Float32Array.from({ length: n * 20 }, () => rng.normal()),
    inputShape: [n, 20],
    targets: randInts(rng, n, 5),
    targetShape: [n],
  };
}

function slice(b: HostBatch, start: number, n: number, rowIn: number, rowOut: number): HostBatch {
  return {
    inputs: b.inputs.slice(start * rowIn, (start + n) * rowIn),
    inputShape: [n, ...b.inputShape.slice(1)],
    targets: b.targets.slice(start * rowOut, (start + n) * rowOut),
    targetShape: [n, ...b.targetShape.slice(1)],
  };
}

describe("gradient accumulation", () => {
  test("mlp: 4 micro-batches of 8 give the gradient and update of one batch of 32 (<= 1e-5)", () => {
    const big = mlpBatch(new Rng(5), 32);
    const run = (k: number) => {
      const ctx = newContext(1);
      const model = new MlpModel(ctx, { widths: [20, 16, 5], activation: "relu", dropout: 0 }, 3);
      const optimizer = new Sgd(ctx, model.store, { momentum: 0.9, dampening: 0, nesterov: false, weightDecay: 0 });
      const trainer = constantLrStep(ctx, model, optimizer, { lr: 0.1, gradClip: 0, accumSteps: k });
      const micro = Array.from({ length: k }, (_, i) => slice(big, i * (32 / k), 32 / k, 20, 1));
      const r = trainer.run(micro);
      return { grads: model.store.readGrads(), values: model.store.readValues(), loss: r.loss };
    };
    const one = run(1);
    const four = run(4);
    expect(relErr(four.grads, one.grads)).toBeLessThanOrEqual(1e-5);
    expect(relErr(four.values, one.values)).toBeLessThanOrEqual(1e-5);
    expect(Math.abs(four.loss - one.loss) / one.loss).toBeLessThanOrEqual(1e-5);
  });

  test("gpt: 2 micro-batches of 3 sequences give the gradient of one batch of 6 (<= 1e-5)", () => {
    const rng = new Rng(6);
    const [B, T, V] = [6, 8, 11];
    const big: HostBatch = {
      inputs: randInts(rng, B * T, V),
      inputShape: [B, T],
      targets: randInts(rng, B * T, V),
      targetShape: [B, T],
    };
    const run = (k: number) => {
      const ctx = newContext(1);
      const model = new GptModel(ctx, { vocabSize: V, blockSize: T, nLayer: 2, nHead: 2, nEmbd: 16, dropout: 0 }, 4);
      const optimizer = new AdamW(ctx, model.store, { beta1: 0.9, beta2: 0.99, eps: 1e-8, weightDecay: 0.1 });
      const trainer = constantLrStep(ctx, model, optimizer, { lr: 1e-3, gradClip: 0, accumSteps: k });
      trainer.run(Array.from({ length: k }, (_, i) => slice(big, i * (B / k), B / k, T, T)));
      return model.store.readGrads();
    };
    expect(relErr(run(2), run(1))).toBeLessThanOrEqual(1e-5);
  });
});

describe("reproducibility and the step path", () => {
  const train = (seed: number, steps: number) => {
    const ctx = newContext(seed);
    const model = new MlpModel(ctx, { widths: [20, 32, 5], activation: "relu", dropout: 0.3 }, seed);
    const init = model.store.readValues();
    const optimizer = new AdamW(ctx, model.store, { beta1: 0.9, beta2: 0.999, eps: 1e-8, weightDecay: 0.01 });
    const trainer = constantLrStep(ctx, model, optimizer, { lr: 1e-2, gradClip: 1, accumSteps: 1 });
    const rng = new Rng(9);
    const losses = Array.from({ length: steps }, () => trainer.run([mlpBatch(rng, 16)]).loss);
    return { init, losses, values: model.store.readValues() };
  };

  test("the same seed gives bit-identical weights and losses (dropout included)", () => {
    const a = train(7, 5);
    const b = train(7, 5);
    expect(Buffer.from(a.init.buffer).equals(Buffer.from(b.init.buffer))).toBe(true);
    expect(a.losses).toEqual(b.losses);
    expect(Buffer.from(a.values.buffer).equals(Buffer.from(b.values.buffer))).toBe(true);
  });

  test("a different seed gives different weights", () => {
    expect(relErr(train(8, 0).init, train(7, 0).init)).toBeGreaterThan(0.1);
  });

  // f16 and bf16 include the CPU backend's GEMM scratch and the loss scaler
  test.each(["f32", "f16", "bf16"] as const)(
    "no backend allocation on the step path after the first step (%s)",
    async (precision) => {
      const { CpuBackend } = await import("../../ffi/cpu/backend.ts");
      const { Context } = await import("../../engine/context.ts");
      const be = new CpuBackend();
      const ctx = new Context(be, { seed: 1, precision });
      const model = new GptModel(ctx, { vocabSize: 13, blockSize: 8, nLayer: 2, nHead: 2, nEmbd: 16, dropout: 0.1 }, 1);
      const optimizer = new AdamW(ctx, model.store, { beta1: 0.9, beta2: 0.99, eps: 1e-8, weightDecay: 0.1 });
      const trainer = constantLrStep(ctx, model, optimizer, { lr: 1e-3, gradClip: 1, accumSteps: 2 });
      const rng = new Rng(2);
      const batch = (): HostBatch => ({
        inputs: randInts(rng, 32, 13),
        inputShape: [4, 8],
        targets: randInts(rng, 32, 13),
        targetShape: [4, 8],
      });
      trainer.run([batch(), batch()]);
      trainer.run([batch(), batch()]);
      const after = be.stats.allocCount;
      for (let i = 0; i < 5; i++) trainer.run([batch(), batch()]);
      expect(be.stats.allocCount).toBe(after);
      ctx.dispose();
      // all that stays is the backend's own scratch, in 64 KiB grains: the GELU gradient's GEMM
      // product (the MLP's dgelu epilogue, every precision) and the widened 2-byte operands
      expect([be.stats.liveBytes > 0, be.stats.liveBytes % 65536]).toEqual([true, 0]);
      if (precision === "f32") expect(be.stats.liveBytes).toBe(65536);
      be.dispose();
    },
  );
});
