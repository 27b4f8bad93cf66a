// Mixed precision: autocast matmul against float64 references on the rounded inputs, the
// poisoned context, and the dynamic loss scaler's PyTorch GradScaler rules on small models.
// The backend-dependent parts run on every backend present (the CPU; CUDA where there is a GPU).
import { describe, expect, test } from "bun:test";
import type { Backend } from "../../ffi/backend.ts";
import { ConfigError } from "../../ffi/errors.ts";
import { GradientOverflowError, NonFiniteLossError } from "../../engine/errors.ts";
import type { Precision } from "../../engine/mixed.ts";
import { GptModel } from "../../engine/models/gpt.ts";
import { MlpModel } from "../../engine/models/mlp.ts";
import { add } from "../../engine/ops/add.ts";
import { matmul, matmulBackwardReference, matmulReference } from "../../engine/ops/matmul.ts";
import { AdamW } from "../../engine/optim/adamw.ts";
import { LossScaler, lossScaleDefaults } from "../../engine/optim/loss-scale.ts";
import type { Optimizer } from "../../engine/optim/optimizer.ts";
import { Rng } from "../../engine/rng.ts";
import { Context } from "../../engine/context.ts";
import { evaluate, type HostBatch, lossAndGradients, type StepConfig } from "../../engine/train.ts";
import { cpu, f64, grad64, leaf, randInts, randn, relErr } from "../helpers/numeric.ts";
import { parityBackends } from "../helpers/emulated-cuda.ts";
import { constantLrStep } from "../helpers/training.ts";

const backends = (await parityBackends()).map((b) => [b.name, b.backend] as const);
const poisoned = (be: Backend, precision: Precision, seed = 0) => new Context(be, { seed, precision, poison: true });

/** x rounded to nearest even as a 2-byte float, as float64 values (decoded in JavaScript). */
function rounded(x: Float64Array, to: "bf16" | "f16"): Float64Array {
  const f = Float32Array.from(x);
  if (to === "f16") return Float64Array.from(Float16Array.from(f));
  const u = new Uint32Array(f.buffer);
  for (let i = 0; i < u.length; i++) u[i] = ((u[i]! + 0x7fff + ((u[i]! >>> 16) & 1)) >>> 16) << 16; // no NaN here
  return Float64Array.from(f);
}

describe.each(backends)("autocast matmul on %s", (_name, backend) => {
  // [name, a shape, b shape, M, N, K, batch, transA, transB]; K is odd and large enough to
  // show f32 accumulation (an f16 accumulator would be off by ~1e-3)
  const cases = [
    ["2-D", [7, 37], [37, 5], 7, 5, 37, 1, false, false],
    ["x @ W^T (Linear)", [2, 3, 37], [5, 37], 6, 5, 37, 1, false, true],
    ["transA", [37, 7], [37, 5], 7, 5, 37, 1, true, false],
    ["batched, both transposed", [3, 37, 7], [3, 5, 37], 7, 5, 37, 3, true, true],
  ] as const;

  describe.each(["bf16", "f16"] as const)("%s", (half) => {
    test.each(cases)(
      "%s: forward and backward match float64 on the rounded inputs",
      (_n, aShape, bShape, M, N, K, batch, tA, tB) => {
        const rng = new Rng(3);
        const a = randn(rng, M * K * batch),
          b = randn(rng, K * N * batch),
          dout = randn(rng, M * N * batch);
        const ctx = poisoned(backend(), half);
        const ta = leaf(ctx, a, [...aShape]),
          tb = leaf(ctx, b, [...bShape]);
        const out = matmul(ta, tb, { transA: tA, transB: tB });
        ctx.backwardFrom(out, ctx.fromArray(Float32Array.from(dout), [...out.shape]));
        const [ah, bh, dh] = [rounded(a, half), rounded(b, half), rounded(dout, half)];
        const want = { out: [] as number[], da: [] as number[], db: [] as number[] };
        // with a 2-D b (Linear) a's leading dims fold into M: one GEMM, batch 1
        for (let i = 0; i < batch; i++) {
          const [sa, sb, so] = [M * K, K * N, M * N].map((n) => (x: Float64Array) => x.subarray(i * n, (i + 1) * n));
          want.out.push(...matmulReference(sa!(ah), sb!(bh), M, N, K, tA, tB));
          const g = matmulBackwardReference(sa!(ah), sb!(bh), so!(dh), M, N, K, tA, tB);
          want.da.push(...g.da);
          want.db.push(...g.db);
        }
        expect(relErr(out.toFloat32(), want.out)).toBeLessThan(1e-5);
        expect(relErr(grad64(ta), want.da)).toBeLessThan(1e-5);
        expect(relErr(grad64(tb), want.db)).toBeLessThan(1e-5);
        // and close to the unrounded f32 result: 8 (bf16) or 11 (f16) significant bits per input
        const exact = [...Array(batch).keys()].flatMap((i) => [
          ...matmulReference(
            a.subarray(i * M * K, (i + 1) * M * K),
            b.subarray(i * K * N, (i + 1) * K * N),
            M,
            N,
            K,
            tA,
            tB,
          ),
        ]);
        expect(relErr(out.toFloat32(), exact)).toBeLessThan(half === "bf16" ? 1e-2 : 2e-3);
      },
    );
  });

  test("gradients accumulate into existing ones (beta = 1)", () => {
    const rng = new Rng(4);
    const [a, b] = [randn(rng, 6 * 9), randn(rng, 9 * 4)];
    const ctx = poisoned(backend(), "bf16");
    const w = leaf(ctx, b, [9, 4]);
    const x = leaf(ctx, a, [6, 9], false);
    const ones = ctx.fromArray(new Float32Array(24).fill(1), [6, 4]);
    ctx.backwardFrom(add(matmul(x, w), matmul(x, w)), ones); // the same weight used twice: both contributions add up
    const once = matmulBackwardReference(
      rounded(a, "bf16"),
      rounded(b, "bf16"),
      new Float64Array(24).fill(1),
      6,
      4,
      9,
    ).db;
    expect(
      relErr(
        grad64(w),
        once.map((v) => 2 * v),
      ),
    ).toBeLessThan(1e-5);
  });
});

describe.each(backends)("tf32 on %s", (_name, backend) => {
  test("within TF32's 10-bit mantissa of the float64 result; on the CPU f32 bit for bit", () => {
    const rng = new Rng(4);
    const [a, b] = [randn(rng, 6 * 9), randn(rng, 9 * 4)];
    const run = (precision: Precision) => {
      const ctx = poisoned(backend(), precision);
      const ta = leaf(ctx, a, [6, 9]),
        tb = leaf(ctx, b, [9, 4]);
      const out = matmul(ta, tb);
      ctx.backwardFrom(out, ctx.fromArray(new Float32Array(24).fill(1), [6, 4]));
      return { out: out.toFloat32(), da: ta.grad!.toFloat32() };
    };
    const tf32 = run("tf32");
    expect(relErr(tf32.out, matmulReference(a, b, 6, 4, 9))).toBeLessThan(2e-3);
    if (backend().name === "cpu") expect(tf32).toEqual(run("f32"));
  });
});

describe("context options", () => {
  test("an unknown precision is a ConfigError", () => {
    expect(() => new Context(cpu(), { precision: "f8" as Precision })).toThrow(ConfigError);
    expect(new Context(cpu()).precision).toBe("f32");
  });

  test("poison: new f32 and f16 tensors hold NaN, bf16 ones the largest finite bf16, zeros() is still zero", () => {
    const ctx = new Context(cpu(), { poison: true });
    expect(ctx.empty([3, 5]).toFloat32().every(Number.isNaN)).toBe(true);
    const h = ctx.empty([7], "f16").toArray() as Uint16Array;
    expect(Float32Array.from(new Float16Array(h.buffer)).every(Number.isNaN)).toBe(true);
    expect([...(ctx.empty([7], "bf16").toArray() as Uint16Array)]).toEqual(Array(7).fill(0x7f7f));
    expect(ctx.zeros([4]).toFloat32()).toEqual(new Float32Array(4));
    expect(new Context(cpu()).poison).toBe(false);
  });
});

// ---- the loss scaler ------------------------------------------------------------------------

function mlpBatch(rng: Rng, n: number): HostBatch {
  // a learnable rule: the class is the index of the largest of the first 5 features
  const inputs = Float32Array.from({ length: n * 20 }, () => rng.normal());
  const targets = Int32Array.from({ length: n }, (_, r) => {
    const row = inputs.subarray(r * 20, r * 20 + 5);
    return row.indexOf(Math.max(...row));
  });
  return { inputs, inputShape: [n, 20], targets, targetShape: [n] };
}

function mlpTrainer(precision: Precision, extra: Partial<Omit<StepConfig, "schedule">> = {}, be: Backend = cpu()) {
  const ctx = poisoned(be, precision, 1);
  const model = new MlpModel(ctx, { widths: [20, 32, 5], activation: "relu", dropout: 0 }, 3);
  const optimizer = new AdamW(ctx, model.store, { beta1: 0.9, beta2: 0.999, eps: 1e-8, weightDecay: 0.01 });
  const trainer = constantLrStep(ctx, model, optimizer, { lr: 1e-2, gradClip: 1, accumSteps: 1, ...extra });
  return { ctx, model, optimizer, trainer };
}

const bytesOf = (x: Float32Array) => Buffer.from(x.buffer, x.byteOffset, x.byteLength);
function optimizerState(ctx: Context, o: Optimizer): Buffer[] {
  return o.stateSlabs().map(({ allocation }) => {
    const host = new Float32Array(allocation.bytes / 4);
    ctx.backend.download(allocation.ptr, host);
    return bytesOf(host);
  });
}

describe("LossScaler (torch.cuda.amp.GradScaler rules)", () => {
  test("defaults are PyTorch's", () => {
    const s = new LossScaler();
    expect(s.scale).toBe(65536);
    expect(s.config).toEqual({
      initScale: 65536,
      growthFactor: 2,
      backoffFactor: 0.5,
      growthInterval: 2000,
      skipsInARowMax: 64,
    });
    expect(lossScaleDefaults.initScale).toBe(2 ** 16);
  });

  test("halves on overflow, doubles after growthInterval good steps in a row, an overflow restarts the count", () => {
    const s = new LossScaler({ initScale: 1024, growthInterval: 3 });
    const trace = [true, true, false, true, true, true, true, true, true].map((finite, step) => {
      s.update(finite, step);
      return s.scale;
    });
    expect(trace).toEqual([1024, 1024, 512, 512, 512, 1024, 1024, 1024, 2048]);
    expect(s.skippedSteps).toBe(1);
  });

  test("never grows past the largest f32; stops with GradientOverflowError after skipsInARowMax overflows in a row", () => {
    const big = new LossScaler({ initScale: 2 ** 127, growthInterval: 1 });
    big.update(true, 0);
    expect(big.scale).toBe(2 ** 127);
    const s = new LossScaler({ skipsInARowMax: 3 });
    for (let i = 0; i < 3; i++) s.update(false, 7);
    expect(s.scale).toBe(2 ** 13);
    expect(() => s.update(false, 7)).toThrow(GradientOverflowError);
    expect(() => new LossScaler({ skipsInARowMax: 3 }).update(false, 7)).not.toThrow();
  });

  test.each([
    ["initScale", 0],
    ["initScale", Infinity],
    ["initScale", NaN],
    ["growthFactor", 1],
    ["growthFactor", 0.5],
    ["backoffFactor", 1],
    ["backoffFactor", 0],
    ["growthInterval", 0],
    ["growthInterval", 2.5],
    ["skipsInARowMax", -1],
  ] as const)("%s = %p is a ConfigError", (key, value) => {
    expect(() => new LossScaler({ [key]: value })).toThrow(ConfigError);
    expect(() => new LossScaler({ [key]: value })).toThrow(`lossScale.${key}`);
  });

  test("lossScale settings outside precision f16 are a ConfigError (bf16 and f32 need no scaler)", () => {
    expect(() => mlpTrainer("bf16", { lossScale: { initScale: 8 } })).toThrow(/lossScale is for precision f16/);
    expect(mlpTrainer("bf16").trainer.scaler).toBeNull();
    expect(mlpTrainer("f16").trainer.scaler?.scale).toBe(65536);
    expect(() => mlpTrainer("f16", { lossScale: { backoffFactor: 2 } })).toThrow(ConfigError);
  });
});

describe.each(backends)("f16 training steps with loss scaling on %s", (_name, backend) => {
  test("an overflowing step is skipped: parameters, optimizer state and step count bit-identical, scale halved", () => {
    // scale 1 for a good first step (so the AdamW state is not zero), then 2^30: d(logits)
    // times 2^30 is far beyond f16's 65504, so the f16 copy of dout is inf
    const { ctx, model, optimizer, trainer } = mlpTrainer(
      "f16",
      { lossScale: { initScale: 1, growthFactor: 2 ** 30, growthInterval: 1 } },
      backend(),
    );
    const rng = new Rng(1);
    const first = trainer.run([mlpBatch(rng, 16)]);
    expect(first).toMatchObject({ step: 1, skipped: false, lossScale: 2 ** 30 });
    const values = bytesOf(model.store.readValues());
    const state = optimizerState(ctx, optimizer);
    const r = trainer.run([mlpBatch(rng, 16)]);
    expect(r).toMatchObject({ step: 1, skipped: true, lossScale: 2 ** 29, gradNorm: Infinity });
    expect(Number.isFinite(r.loss)).toBe(true);
    expect(bytesOf(model.store.readValues()).equals(values)).toBe(true);
    expect(optimizerState(ctx, optimizer)).toEqual(state);
    expect(optimizer.stepCount).toBe(1);
    // it keeps halving until the gradients fit, then steps again
    let next = trainer.run([mlpBatch(rng, 16)]);
    for (let i = 0; i < 40 && next.skipped; i++) next = trainer.run([mlpBatch(rng, 16)]);
    expect(next.skipped).toBe(false);
    expect(next.step).toBe(2);
    expect(trainer.scaler!.skippedSteps).toBeGreaterThan(1);
  });

  test("the scale grows after growthInterval good steps", () => {
    const { trainer } = mlpTrainer("f16", { lossScale: { initScale: 256, growthInterval: 3 } }, backend());
    const rng = new Rng(2);
    const scales = Array.from({ length: 7 }, () => trainer.run([mlpBatch(rng, 16)]).lossScale);
    expect(scales).toEqual([256, 256, 512, 512, 512, 1024, 1024]);
  });

  test("unscaled f16 gradients match f32 gradients; a scale of 2^16 and of 2^4 give the same gradients", () => {
    const batch = mlpBatch(new Rng(5), 32);
    const grads = (precision: Precision, initScale?: number) => {
      const { ctx, model } = mlpTrainer(precision, {}, backend());
      const scaler = initScale === undefined ? null : new LossScaler({ initScale });
      const g = lossAndGradients(ctx, model, [batch], 0, 0, scaler);
      expect(g.finite).toBe(true);
      return { g: model.store.readGrads(), norm: g.gradNorm };
    };
    const ref = grads("f32");
    const big = grads("f16", 2 ** 16);
    expect(relErr(big.g, ref.g)).toBeLessThan(5e-3);
    expect(Math.abs(big.norm - ref.norm) / ref.norm).toBeLessThan(5e-3);
    // powers of two only move exponents: both scales give the same bits unless one underflows
    expect(relErr(grads("f16", 2 ** 4).g, big.g)).toBeLessThan(1e-6);
  });

  test("a non-finite loss is still NonFiniteLossError, not a skipped step", () => {
    const { trainer } = mlpTrainer("f16", {}, backend());
    const b = mlpBatch(new Rng(1), 4);
    b.inputs[3] = NaN;
    expect(() => trainer.run([b])).toThrow(NonFiniteLossError);
  });
});

describe("the step path", () => {});

// The emulated CUDA backend runs every CUDA thread as a host thread: dozens of full training
// steps take minutes there, so these run on real backends only (the CPU; a GPU).
const realBackends = backends.filter(([name]) => !name.includes("emulated"));

describe.each(realBackends)("training in reduced precision reaches f32's loss on %s", (_name, backend) => {
  const evalSet = [mlpBatch(new Rng(99), 256)];
  const train = (precision: Precision) => {
    const { ctx, model, trainer } = mlpTrainer(precision, {}, backend());
    const rng = new Rng(7);
    const results = Array.from({ length: 40 }, () => trainer.run([mlpBatch(rng, 32)]));
    return {
      ...evaluate(ctx, model, evalSet),
      skipped: results.filter((r) => r.skipped).length,
      first: results[0]!.loss,
    };
  };
  let f32Result: ReturnType<typeof train> | undefined;

  test.each(["bf16", "f16"] as const)("mlp, 40 AdamW steps in %s", (precision) => {
    const f32 = (f32Result ??= train("f32"));
    const r = train(precision);
    expect(f32.loss).toBeLessThan(0.6 * f32.first); // it did learn
    expect(Math.abs(r.loss - f32.loss)).toBeLessThan(0.05 * f32.loss);
    expect(Math.abs(r.accuracy - f32.accuracy)).toBeLessThan(0.03);
    expect(r.skipped).toBe(0); // 2^16 times these gradients fits in f16
  });

  test.each(["bf16", "f16"] as const)(
    "gpt (attention, LayerNorm, tied head), 20 steps in %s, poisoned",
    (precision) => {
      const run = (p: Precision) => {
        const ctx = poisoned(backend(), p, 1);
        const model = new GptModel(ctx, { vocabSize: 11, blockSize: 8, nLayer: 1, nHead: 2, nEmbd: 16, dropout: 0 }, 2);
        const optimizer = new AdamW(ctx, model.store, { beta1: 0.9, beta2: 0.99, eps: 1e-8, weightDecay: 0.1 });
        const trainer = constantLrStep(ctx, model, optimizer, { lr: 1e-2, gradClip: 1, accumSteps: 1 });
        const rng = new Rng(4);
        // a learnable sequence: each token is the previous one plus 1 (mod 11)
        const batch = (): HostBatch => {
          const starts = randInts(rng, 4, 11);
          const inputs = Int32Array.from({ length: 32 }, (_, i) => (starts[i >> 3]! + (i & 7)) % 11);
          return { inputs, inputShape: [4, 8], targets: inputs.map((t) => (t + 1) % 11), targetShape: [4, 8] };
        };
        const losses = Array.from({ length: 20 }, () => trainer.run([batch()]).loss);
        return f64(losses);
      };
      const ref = run("f32");
      const got = run(precision);
      expect(ref[19]!).toBeLessThan(0.7 * ref[0]!);
      expect(Math.abs(got[19]! - ref[19]!)).toBeLessThan(0.05 * ref[19]!);
    },
  );
});
