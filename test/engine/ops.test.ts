// Every op, on every available backend (the CPU; CUDA where a GPU is present, else the CUDA
// backend over a fake driver running the kernels on the host CUDA emulator):
//   1. the float64 reference's gradients agree with central finite differences of its forward;
//   2. the backend's float32 forward agrees with the reference (relative error <= 1e-4);
//   3. the backend's float32 backward agrees with the reference's gradients (<= 1e-4);
//   4. on a backend other than the CPU, forward and backward agree with the CPU backend's on the
//      same inputs (<= 1e-5).
// Outputs are poisoned (NaN) before each op runs, so an element a kernel leaves unwritten
// fails. Inputs are fresh random normals, never zeros. Shapes include 1s and odd sizes that
// do not fit SIMD widths.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import {
  add,
  biasAdd,
  causalSelfAttention,
  dropout,
  embedding,
  gelu,
  layerNorm,
  matmul,
  mean,
  mul,
  permute,
  relu,
  softmaxCrossEntropy,
  sum,
  transpose,
} from "../../engine/ops/index.ts";
import { addBackwardReference, addReference } from "../../engine/ops/add.ts";
import {
  attentionDecode,
  causalSelfAttentionBackwardReference,
  causalSelfAttentionReference,
} from "../../engine/ops/attention.ts";
import { biasAddBackwardReference, biasAddReference } from "../../engine/ops/bias.ts";
import { softmaxCrossEntropyBackwardReference, softmaxCrossEntropyReference } from "../../engine/ops/crossentropy.ts";
import { countCorrect, countCorrectReference } from "../../engine/ops/accuracy.ts";
import { dropoutBackwardReference, dropoutReference } from "../../engine/ops/dropout.ts";
import { embeddingBackwardReference, embeddingReference } from "../../engine/ops/embedding.ts";
import { geluBackwardReference, geluReference } from "../../engine/ops/gelu.ts";
import { layerNormBackwardReference, layerNormReference } from "../../engine/ops/layernorm.ts";
import { matmulBackwardReference, matmulReference } from "../../engine/ops/matmul.ts";
import { mulBackwardReference, mulReference } from "../../engine/ops/mul.ts";
import { permuteBackwardReference, permuteReference } from "../../engine/ops/permute.ts";
import { meanReference, sumBackwardReference, sumReference } from "../../engine/ops/reduce.ts";
import { reluBackwardReference, reluReference } from "../../engine/ops/relu.ts";
import { Rng } from "../../engine/rng.ts";
import type { Tensor } from "../../engine/tensor.ts";
import {
  cpu,
  dot,
  f32,
  f64,
  finiteDiff,
  grad64,
  leaf,
  newContext,
  randInts,
  randn,
  relErr,
  transposePairs,
  useBackend,
} from "../helpers/numeric.ts";
import type { Backend } from "../../ffi/backend.ts";
import { Context } from "../../engine/context.ts";
import type { Precision } from "../../engine/mixed.ts";
import { parityBackends } from "../helpers/emulated-cuda.ts";
import { expectThrown } from "../helpers/errors.ts";
import { IndexRangeError, ShapeError } from "../../engine/errors.ts";

const tolF32 = 1e-4;
/** another backend against the CPU backend, same float32 inputs */
const tolBackends = 1e-5;
const tolFiniteDiff = 1e-6;
const finiteDiffMaxElems = 600;

interface Input {
  data: Float64Array;
  shape: number[];
  grad?: boolean;
}

interface OpCase {
  inputs: Input[];
  ints?: { data: Int32Array; shape: number[] }[];
  run: (x: Tensor[], ints: Tensor[]) => Tensor;
  ref: (x: Float64Array[]) => Float64Array;
  refGrad: (x: Float64Array[], dout: Float64Array) => Float64Array[];
}

/** Round data to float32 first, so reference and backend see the same inputs. */
function input(rng: Rng, shape: number[], grad = true, scale = 1): Input {
  const n = shape.reduce((a, b) => a * b, 1);
  return { data: f64(f32(randn(rng, n, scale))), shape, grad };
}

/** Run a case on a fresh poisoned context of `backend`: the output and each input's gradient. */
function runCase(c: OpCase, backend: Backend, dout: Float64Array | null, precision: Precision = "f32") {
  const ctx = new Context(backend, { seed: 7, poison: true, precision });
  const xs = c.inputs.map((i) => leaf(ctx, i.data, i.shape, i.grad ?? true));
  const ints = (c.ints ?? []).map((i) => ctx.fromArray(i.data, i.shape));
  const out = c.run(xs, ints);
  const outData = out.toFloat32();
  if (dout === null) return { out: outData, numel: out.numel, grads: [] };
  ctx.backwardFrom(out, ctx.fromArray(f32(dout), out.shape));
  const grads = c.inputs.map((inp, k) => (inp.grad === false ? null : grad64(xs[k]!)));
  ctx.dispose();
  return { out: outData, numel: out.numel, grads };
}

function checkOp(c: OpCase, rng: Rng): void {
  const backend = newContext().backend;
  const data = c.inputs.map((i) => i.data);
  const expected = c.ref(data);
  const dout = f64(f32(randn(rng, expected.length)));
  const got = runCase(c, backend, dout);
  expect(got.numel).toBe(expected.length);
  expect(relErr(got.out, expected)).toBeLessThanOrEqual(tolF32);

  const grads = c.refGrad(data, dout);
  c.inputs.forEach((inp, k) => {
    if (inp.grad === false) return;
    expect(relErr(got.grads[k]!, grads[k]!)).toBeLessThanOrEqual(tolF32);
    if (inp.data.length <= finiteDiffMaxElems) {
      const numeric = finiteDiff((x) => dot(c.ref(data.map((d, j) => (j === k ? x : d))), dout), inp.data);
      expect(relErr(grads[k]!, numeric)).toBeLessThanOrEqual(tolFiniteDiff);
    }
  });
  if (backend.name === "cpu") return;
  const onCpu = runCase(c, cpu(), dout);
  expect(relErr(got.out, onCpu.out)).toBeLessThanOrEqual(tolBackends);
  c.inputs.forEach((inp, k) => {
    if (inp.grad !== false) expect(relErr(got.grads[k]!, onCpu.grads[k]!)).toBeLessThanOrEqual(tolBackends);
  });
}

// ---- case builders: one per op, shared by the fixed-shape and random-shape tests ----

function matmulCase(rng: Rng, M: number, N: number, K: number, tA: boolean, tB: boolean): OpCase {
  return {
    inputs: [input(rng, tA ? [K, M] : [M, K]), input(rng, tB ? [N, K] : [K, N])],
    run: ([a, b]) => matmul(a!, b!, { transA: tA, transB: tB }),
    ref: ([a, b]) => matmulReference(a!, b!, M, N, K, tA, tB),
    refGrad: ([a, b], d) => Object.values(matmulBackwardReference(a!, b!, d, M, N, K, tA, tB)),
  };
}

function broadcastCase(rng: Rng, op: "add" | "mul", as: number[], bs: number[]): OpCase {
  return {
    inputs: [input(rng, as), input(rng, bs)],
    run: ([a, b]) => (op === "add" ? add : mul)(a!, b!),
    ref: ([a, b]) => (op === "add" ? addReference : mulReference)(a!, as, b!, bs).out,
    refGrad: ([a, b], d) =>
      Object.values(op === "add" ? addBackwardReference(as, bs, d) : mulBackwardReference(a!, as, b!, bs, d)),
  };
}

function biasAddCase(rng: Rng, shape: number[]): OpCase {
  const C = shape[shape.length - 1]!;
  const N = shape.reduce((a, b) => a * b, 1) / C;
  return {
    inputs: [input(rng, shape), input(rng, [C])],
    run: ([x, b]) => biasAdd(x!, b!),
    ref: ([x, b]) => biasAddReference(x!, b!, N, C),
    refGrad: (_x, d) => Object.values(biasAddBackwardReference(d, N, C)),
  };
}

function crossEntropyCase(rng: Rng, shape: number[], scale = 3): OpCase {
  const V = shape[shape.length - 1]!;
  const N = shape.reduce((a, b) => a * b, 1) / V;
  const targets = randInts(rng, N, V);
  return {
    inputs: [input(rng, shape, true, scale)],
    ints: [{ data: targets, shape: shape.slice(0, -1) }],
    run: ([x], [t]) => softmaxCrossEntropy(x!, t!),
    ref: ([x]) => Float64Array.of(softmaxCrossEntropyReference(x!, targets, N, V).loss),
    refGrad: ([x], d) => [
      softmaxCrossEntropyBackwardReference(softmaxCrossEntropyReference(x!, targets, N, V).probs, targets, N, V, d[0]),
    ],
  };
}

function layerNormCase(rng: Rng, N: number, C: number, inputGrad = true): OpCase {
  return {
    inputs: [input(rng, [N, C], inputGrad, 2), input(rng, [C]), input(rng, [C])],
    run: ([x, w, b]) => layerNorm(x!, w!, b!),
    ref: ([x, w, b]) => layerNormReference(x!, w!, b!, N, C).out,
    refGrad: ([x, w], d) => Object.values(layerNormBackwardReference(x!, w!, d, N, C)),
  };
}

function embeddingCase(rng: Rng, V: number, C: number, idShape: number[]): OpCase {
  const ids = randInts(
    rng,
    idShape.reduce((a, b) => a * b, 1),
    V,
  );
  return {
    inputs: [input(rng, [V, C])],
    ints: [{ data: ids, shape: idShape }],
    run: ([table], [i]) => embedding(table!, i!),
    ref: ([table]) => embeddingReference(table!, ids, C),
    refGrad: (_x, d) => [embeddingBackwardReference(ids, d, V, C)],
  };
}

function attentionCase(rng: Rng, B: number, T: number, C: number, H: number): OpCase {
  return {
    inputs: [input(rng, [B, T, 3 * C])],
    run: ([qkv]) => causalSelfAttention(qkv!, H),
    ref: ([qkv]) => causalSelfAttentionReference(qkv!, B, T, C, H).out,
    refGrad: ([qkv], d) => [causalSelfAttentionBackwardReference(qkv!, d, B, T, C, H)],
  };
}

function unaryCase(rng: Rng, op: "relu" | "gelu", shape: number[]): OpCase {
  const [f, ref, refGrad] =
    op === "relu"
      ? ([relu, reluReference, reluBackwardReference] as const)
      : ([gelu, geluReference, geluBackwardReference] as const);
  return {
    inputs: [input(rng, shape, true, 2)],
    run: ([x]) => f(x!),
    ref: ([x]) => ref(x!),
    refGrad: ([x], d) => [refGrad(x!, d)],
  };
}

function permuteCase(rng: Rng, shape: number[], perm: number[]): OpCase {
  return {
    inputs: [input(rng, shape)],
    run: ([x]) => permute(x!, perm),
    ref: ([x]) => permuteReference(x!, shape, perm),
    refGrad: (_x, d) => [permuteBackwardReference(d, shape, perm)],
  };
}

/** the first largest of row n's V values */
function argmaxOf(x: Float32Array, n: number, V: number): number {
  let best = 0;
  for (let v = 1; v < V; v++) if (x[n * V + v]! > x[n * V + best]!) best = v;
  return best;
}

// Where there is no GPU, the CUDA backend's own code still runs: over a fake driver whose
// launches run the .cu kernels on the host emulator (test/helpers/emulated-cuda.ts).
const backends = await parityBackends();

describe.each(backends)("$name backend", ({ backend }) => {
  beforeAll(() => useBackend(backend()));
  afterAll(() => useBackend(undefined));

  describe("matmul", () => {
    const shapes: [number, number, number][] = [
      [1, 1, 1],
      [3, 5, 7],
      [17, 9, 33],
      [64, 31, 20],
    ];
    describe.each(shapes)("M=%i N=%i K=%i", (M, N, K) => {
      test.each(transposePairs)("transA=%p transB=%p", (tA, tB) => {
        const rng = new Rng(M * 1000 + N * 10 + K);
        checkOp(matmulCase(rng, M, N, K, tA, tB), rng);
      });
    });

    test.each(transposePairs)("batched (3 x 5x7x6) transA=%p transB=%p", (tA, tB) => {
      const [Bt, M, N, K] = [3, 5, 7, 6];
      const rng = new Rng(99);
      // the reference runs per batch element on subarrays
      const part = (x: Float64Array, i: number, size: number) => x.subarray(i * size, (i + 1) * size);
      const concat = (parts: Float64Array[]) => Float64Array.from(parts.flatMap((p) => [...p]));
      checkOp(
        {
          inputs: [input(rng, tA ? [Bt, K, M] : [Bt, M, K]), input(rng, tB ? [Bt, N, K] : [Bt, K, N])],
          run: ([a, b]) => matmul(a!, b!, { transA: tA, transB: tB }),
          ref: ([a, b]) =>
            concat(
              Array.from({ length: Bt }, (_, i) =>
                matmulReference(part(a!, i, M * K), part(b!, i, K * N), M, N, K, tA, tB),
              ),
            ),
          refGrad: ([a, b], d) => {
            const g = Array.from({ length: Bt }, (_, i) =>
              matmulBackwardReference(part(a!, i, M * K), part(b!, i, K * N), part(d, i, M * N), M, N, K, tA, tB),
            );
            return [concat(g.map((x) => x.da)), concat(g.map((x) => x.db))];
          },
        },
        rng,
      );
    });

    test("3-D input against a shared 2-D weight (x @ W^T)", () => {
      const rng = new Rng(5);
      const [B, T, C, O] = [2, 3, 5, 4];
      checkOp(
        {
          inputs: [input(rng, [B, T, C]), input(rng, [O, C])],
          run: ([x, w]) => matmul(x!, w!, { transB: true }),
          ref: ([x, w]) => matmulReference(x!, w!, B * T, O, C, false, true),
          refGrad: ([x, w], d) => Object.values(matmulBackwardReference(x!, w!, d, B * T, O, C, false, true)),
        },
        rng,
      );
    });
  });

  describe.each(["add", "mul"] as const)("%s with broadcasting", (op) => {
    const pairs: [number[], number[]][] = [
      [
        [4, 5],
        [4, 5],
      ],
      [[3, 4, 5], [5]],
      [
        [3, 1, 5],
        [1, 4, 1],
      ],
      [
        [2, 3, 4, 5],
        [3, 1, 5],
      ],
      [[7], [1]],
      [[1], [6, 3]],
      [
        [9, 17],
        [9, 1],
      ],
      // alternating broadcast dims: 5 dims even after merging (split into 4-dim blocks)
      [
        [2, 1, 3, 1, 2],
        [2, 1, 2, 1],
      ],
      [
        [2, 1, 2, 1, 2, 1],
        [2, 1, 2, 1, 2],
      ],
    ];
    test.each(pairs)("%p with %p", (as, bs) => {
      const rng = new Rng(as.length * 31 + bs.length);
      checkOp(broadcastCase(rng, op, as, bs), rng);
    });
    test("same tensor on both sides", () => {
      const rng = new Rng(3);
      const c = broadcastCase(rng, op, [3, 4], [3, 4]);
      checkOp(
        {
          inputs: [c.inputs[0]!],
          run: ([a]) => c.run([a!, a!], []),
          ref: ([a]) => c.ref([a!, a!]),
          refGrad: ([a], d) => {
            const [ga, gb] = c.refGrad([a!, a!], d);
            return [ga!.map((v, i) => v + gb![i]!)];
          },
        },
        rng,
      );
    });
  });

  describe("biasAdd", () => {
    test.each([[[1, 1]], [[5, 7]], [[33, 65]], [[128, 100]], [[2, 3, 5]]])("shape %p", (shape) => {
      const rng = new Rng(shape[0]! + shape[1]!);
      checkOp(biasAddCase(rng, shape), rng);
    });
  });

  describe.each(["relu", "gelu"] as const)("%s", (op) => {
    test.each([[[1]], [[7, 13]], [[3, 5, 11]], [[40000]]])("shape %p", (shape) => {
      const rng = new Rng(shape.length);
      checkOp(unaryCase(rng, op, shape), rng);
    });
  });

  describe("softmaxCrossEntropy", () => {
    test.each([[[1, 2]], [[5, 7]], [[33, 83]], [[4, 1000]], [[2, 3, 5]]])("logits %p", (shape) => {
      const rng = new Rng(shape.reduce((a, b) => a * b, 1));
      checkOp(crossEntropyCase(rng, shape), rng);
    });
    test("stays finite for huge logits", () => {
      const ctx = newContext();
      const logits = ctx.fromArray(Float32Array.of(1e30, -1e30, 0, 80, 90, -5), [2, 3]);
      const loss = softmaxCrossEntropy(logits, ctx.fromArray(Int32Array.of(1, 0), [2]));
      // row 0 picks the -1e30 logit: its loss is 2e30, large but finite
      expect(Number.isFinite(loss.item())).toBe(true);
    });
  });

  describe("countCorrect", () => {
    test("the first largest logit per row, NaN passed over unless first, counted on the backend", () => {
      const ctx = newContext();
      // rows: a plain max; a tie (the first wins); NaN later (passed over); NaN first (argmax 0);
      // all -inf (0); one class
      const V = 4;
      const logits = Float32Array.of(
        ...[0.5, 3, -1, 2],
        ...[7, 1, 7, 0],
        ...[1, Number.NaN, 5, 2],
        ...[Number.NaN, 9, 9, 1],
        ...[-Infinity, -Infinity, -Infinity, -Infinity],
      );
      const argmax = [1, 0, 2, 0, 0];
      for (const shift of [0, 1]) {
        const targets = Int32Array.from(argmax, (a, n) => (n % 2 === 0 ? a : (a + shift) % V));
        const want = countCorrectReference(logits, targets);
        expect(want).toBe(shift === 0 ? 5 : 3);
        expect(countCorrect(ctx.fromArray(logits, [5, V]), ctx.fromArray(targets, [5]))).toBe(want);
      }
    });

    test.each([
      [1, 2],
      [33, 83],
      [9, 50_257],
    ])("%d rows of %d classes, against the reference", (N, V) => {
      const rng = new Rng(N + V);
      const logits = f32(randn(rng, N * V));
      const targets = Int32Array.from({ length: N }, (_, n) => (n % 3 === 0 ? argmaxOf(logits, n, V) : rng.int(V)));
      const ctx = newContext();
      expect(countCorrect(ctx.fromArray(logits, [N, V]), ctx.fromArray(targets, [N]))).toBe(
        countCorrectReference(logits, targets),
      );
    });

    test("bf16 logits (an autocast head's) are counted as stored", () => {
      const ctx = new Context(newContext().backend, { seed: 1, precision: "bf16" });
      const [N, V] = [6, 40];
      const rng = new Rng(9);
      const wide = ctx.fromArray(f32(randn(rng, N * V)), [N, V]);
      const narrow = ctx.empty([N, V], "bf16");
      ctx.backend.castF32ToBF16(narrow.ptr, wide.ptr, N * V);
      const stored = narrow.toFloat32();
      const targets = Int32Array.from({ length: N }, (_, n) => argmaxOf(stored, n, V));
      expect(countCorrect(narrow, ctx.fromArray(targets, [N]))).toBe(N);
      ctx.dispose();
    });

    test("targets of other leading dims are refused", () => {
      const ctx = newContext();
      expect(() => countCorrect(ctx.zeros([2, 3, 4]), ctx.fromArray(new Int32Array(3), [3]))).toThrow(ShapeError);
    });
  });

  describe("layerNorm", () => {
    test.each([
      [1, 3],
      [5, 7],
      [9, 64],
      [300, 129],
    ])("N=%i C=%i", (N, C) => {
      const rng = new Rng(N + 7 * C);
      checkOp(layerNormCase(rng, N, C), rng);
    });
    test("input without grad (weights only)", () => {
      const rng = new Rng(4);
      checkOp(layerNormCase(rng, 6, 10, false), rng);
    });
  });

  describe("embedding", () => {
    test.each([
      [1, 1, 1],
      [10, 7, 13],
      [83, 32, 64],
    ])("V=%i C=%i N=%i (repeated ids)", (V, C, N) => {
      const rng = new Rng(V + C + N);
      checkOp(embeddingCase(rng, V, C, [N]), rng);
    });
    test("2-D ids give a 3-D output", () => {
      const ctx = newContext();
      const table = ctx.fromArray(
        new Float32Array(12).map((_, i) => i),
        [4, 3],
      );
      const out = embedding(table, ctx.fromArray(Int32Array.of(3, 0, 1, 1), [2, 2]));
      expect(out.shape).toEqual([2, 2, 3]);
      expect([...out.toFloat32()]).toEqual([9, 10, 11, 0, 1, 2, 3, 4, 5, 3, 4, 5]);
    });
    test("ids and targets the host has not seen are counted on the device: served in range, IndexRangeError outside", () => {
      const ctx = newContext();
      const table = ctx.fromArray(
        new Float32Array(12).map((_, i) => i),
        [4, 3],
      );
      // written straight into backend memory: no host range
      const deviceIds = (values: number[]) => {
        const t = ctx.empty([values.length], "i32");
        ctx.backend.upload(t.ptr, Int32Array.from(values));
        return t;
      };
      const known = ctx.fromArray(Int32Array.of(3, 0, 2, 1), [2, 2]);
      expect([known.valueRange, known.knownInRange(4), known.knownInRange(3)]).toEqual([
        { min: 0, max: 3 },
        true,
        false,
      ]);
      expect(known.narrowRows(1, 1).valueRange).toEqual({ min: 0, max: 3 }); // a view stays within its base's range
      const unknown = deviceIds([3, 0]);
      expect([unknown.valueRange, unknown.knownInRange(4)]).toEqual([null, false]);
      expect([...embedding(table, unknown).toFloat32()]).toEqual([9, 10, 11, 0, 1, 2]);
      expectThrown(() => embedding(table, deviceIds([1, 4, -2])), IndexRangeError, "2 index value(s) outside [0, 4)");
      const logits = ctx.fromArray(Float32Array.of(1, 2, 3, 3, 2, 1), [2, 3]);
      expect(softmaxCrossEntropy(logits, deviceIds([2, 0])).item()).toBeCloseTo(
        Math.log(Math.exp(1) + Math.exp(2) + Math.exp(3)) - 3,
        6,
      );
      expectThrown(
        () => softmaxCrossEntropy(logits, deviceIds([0, 3])),
        IndexRangeError,
        "1 index value(s) outside [0, 3)",
      );
    });
  });

  describe("causalSelfAttention", () => {
    test.each([
      [1, 1, 4, 1],
      [2, 5, 12, 3],
      [2, 8, 16, 2],
      [3, 17, 24, 4],
      // past one tile, T not a multiple of a tile (64 rows on the CPU, 32 on CUDA), T = 1, one
      // head, head sizes 32, 64 and 128
      [1, 1, 32, 1],
      [1, 100, 64, 1],
      [1, 97, 64, 2],
      [1, 70, 256, 2],
    ])("B=%i T=%i C=%i H=%i", (B, T, C, H) => {
      const rng = new Rng(B * T * C * H);
      checkOp(attentionCase(rng, B, T, C, H), rng);
    });
    test.each([
      [1, 1, 4, 1],
      [2, 5, 12, 3],
      [1, 33, 16, 2],
      [2, 100, 64, 1],
      [1, 70, 256, 2],
    ])("attentionDecode B=%i T=%i C=%i H=%i: the last row of the float64 reference", (B, T, C, H) => {
      const rng = new Rng(B * T * C * H + 7);
      const qkv = f64(f32(randn(rng, B * T * 3 * C)));
      const ctx = newContext();
      const got = attentionDecode(ctx.fromArray(f32(qkv), [B, T, 3 * C]), H);
      expect(got.shape).toEqual([B, 1, C]);
      const { out } = causalSelfAttentionReference(qkv, B, T, C, H);
      const last = Float64Array.from({ length: B * C }, (_, i) => out[(Math.floor(i / C) * T + T - 1) * C + (i % C)]!);
      expect(relErr(got.toFloat32(), last)).toBeLessThan(1e-5);
    });
    test("position i never sees later positions", () => {
      const rng = new Rng(1);
      const [B, T, C, H] = [1, 6, 8, 2];
      const qkv = f64(f32(randn(rng, B * T * 3 * C)));
      const changed = Float64Array.from(qkv);
      for (let c = 0; c < 3 * C; c++) changed[(T - 1) * 3 * C + c] = 100; // change the last position only
      const ctx = newContext();
      const a = causalSelfAttention(ctx.fromArray(f32(qkv), [B, T, 3 * C]), H).toFloat32();
      const b = causalSelfAttention(ctx.fromArray(f32(changed), [B, T, 3 * C]), H).toFloat32();
      expect([...a.subarray(0, (T - 1) * C)]).toEqual([...b.subarray(0, (T - 1) * C)]);
    });
  });

  describe("dropout", () => {
    /** The seed the first dropout call of a context made with newContext(7) draws (as checkOp's does). */
    const firstSeed = () => newContext(7).nextDropoutSeed();
    test.each([[[1]], [[5, 7]], [[50000]]])("shape %p, p=0.3, mask recomputed in backward", (shape) => {
      const rng = new Rng(2);
      const p = 0.3;
      checkOp(
        {
          inputs: [input(rng, shape)],
          run: ([x]) => dropout(x!, p),
          ref: ([x]) => dropoutReference(x!, p, firstSeed()),
          refGrad: (_x, d) => [dropoutBackwardReference(d, p, firstSeed())],
        },
        rng,
      );
    });
    test("keeps about 1-p of the elements and preserves the mean", () => {
      const ctx = newContext(3);
      const n = 200000;
      const out = dropout(ctx.fromArray(new Float32Array(n).fill(1), [n]), 0.25).toFloat32();
      const kept = out.filter((v) => v !== 0).length / n;
      expect(Math.abs(kept - 0.75)).toBeLessThan(0.01);
      expect(Math.abs(out.reduce((a, b) => a + b, 0) / n - 1)).toBeLessThan(0.01);
    });
    test("identity in evaluation mode and for p = 0", () => {
      const ctx = newContext();
      const x = ctx.fromArray(Float32Array.of(1, 2, 3), [3]);
      expect(dropout(x, 0)).toBe(x);
      ctx.training = false;
      expect(dropout(x, 0.5)).toBe(x);
    });
  });

  describe("permute / transpose", () => {
    const cases: [number[], number[]][] = [
      [
        [2, 3],
        [1, 0],
      ],
      [
        [2, 3, 4],
        [0, 2, 1],
      ],
      [
        [2, 3, 4, 5],
        [3, 1, 0, 2],
      ],
      [
        [2, 3, 4, 5],
        [0, 2, 1, 3],
      ],
      [
        [3, 1, 4, 2, 2],
        [4, 2, 0, 1, 3],
      ],
      [
        [5, 7],
        [0, 1],
      ],
    ];
    test.each(cases)("shape %p perm %p", (shape, perm) => {
      const rng = new Rng(shape.length * 13 + perm[0]!);
      checkOp(permuteCase(rng, shape, perm), rng);
    });
    test("transpose swaps two dims", () => {
      const ctx = newContext();
      const x = ctx.fromArray(Float32Array.of(1, 2, 3, 4, 5, 6), [2, 3]);
      const t = transpose(x, 0, 1);
      expect(t.shape).toEqual([3, 2]);
      expect([...t.toFloat32()]).toEqual([1, 4, 2, 5, 3, 6]);
    });
  });

  describe("sum / mean", () => {
    test.each([[[1]], [[7, 13]], [[100000]]])("shape %p", (shape) => {
      const rng = new Rng(shape[0]!);
      const n = shape.reduce((a, b) => a * b, 1);
      for (const [op, ref, isMean] of [
        [sum, sumReference, false],
        [mean, meanReference, true],
      ] as const) {
        checkOp(
          {
            inputs: [input(rng, shape)],
            run: ([x]) => op(x!),
            ref: ([x]) => Float64Array.of(ref(x!)),
            refGrad: (_x, d) => [sumBackwardReference(n, d[0]!, isMean)],
          },
          rng,
        );
      }
    });
  });

  describe("views and composition", () => {
    test("reshape and narrowRows share the gradient of their base", () => {
      const rng = new Rng(8);
      const data = f64(f32(randn(rng, 24)));
      const ctx = newContext();
      const x = leaf(ctx, data, [6, 4]);
      const rows = x.narrowRows(2, 3).reshape([4, 3]); // rows 2..4 of x, seen as (4,3)
      const loss = sum(mul(rows, rows));
      ctx.backward(loss);
      const g = grad64(x);
      const expected = data.map((v, i) => (i >= 8 && i < 20 ? 2 * v : 0));
      expect(relErr(g, expected)).toBeLessThanOrEqual(tolF32);
    });
    test("a tensor used twice accumulates both gradients", () => {
      const ctx = newContext();
      const x = leaf(ctx, Float64Array.of(1, -2, 3), [3]);
      const y = add(relu(x), mul(x, x)); // dy/dx = [x>0] + 2x
      ctx.backward(sum(y));
      expect([...grad64(x)]).toEqual([3, -4, 7]);
    });
  });

  describe("non-finite values propagate", () => {
    test("relu keeps NaN (as torch.relu does) instead of hiding it as 0", () => {
      const ctx = newContext();
      const out = relu(ctx.fromArray(Float32Array.of(NaN, -1, 2, -Infinity, Infinity), [5])).toFloat32();
      expect(Number.isNaN(out[0]!)).toBe(true);
      expect([...out.subarray(1)]).toEqual([0, 2, 0, Infinity]);
    });
  });

  // Seeded random shapes (dims 1..40, so most are odd and few fit SIMD widths exactly), through
  // the same three checks.
  describe("random shapes", () => {
    const rng = new Rng(20261122);
    const dim = (max = 40) => 1 + rng.int(max);
    const runs = Array.from({ length: 6 }, (_, i) => i);

    test.each(runs)("matmul #%i", () => {
      checkOp(matmulCase(rng, dim(), dim(), dim(), rng.int(2) === 1, rng.int(2) === 1), rng);
    });

    test.each(runs)("add and mul with a random broadcast pattern #%i", () => {
      const rank = 1 + rng.int(4);
      const out = Array.from({ length: rank }, () => dim(7));
      const as = out.map((d) => (rng.int(3) === 0 ? 1 : d));
      const bs = out.slice(rng.int(rank)).map((d) => (rng.int(3) === 0 ? 1 : d));
      checkOp(broadcastCase(rng, "add", as, bs), rng);
      checkOp(broadcastCase(rng, "mul", as, bs), rng);
    });

    test.each(runs)("layerNorm, biasAdd, cross-entropy #%i", () => {
      const [N, C] = [dim(), dim(99) + 2]; // C >= 3: at C = 2 layerNorm's input gradient is ~0 by construction
      checkOp(layerNormCase(rng, N, C), rng);
      checkOp(biasAddCase(rng, [N, C]), rng);
      checkOp(crossEntropyCase(rng, [N, C], 4), rng);
    });

    test.each(runs)("attention, gelu, embedding, permute #%i", () => {
      const [B, T, H, D] = [dim(3), dim(20), dim(4), dim(9)];
      checkOp(attentionCase(rng, B, T, H * D, H), rng);
      checkOp(unaryCase(rng, "gelu", [B, T, H * D]), rng);
      checkOp(embeddingCase(rng, dim(50), H * D, [B, T]), rng);
      checkOp(permuteCase(rng, [B, T, H, D], rng.shuffle([0, 1, 2, 3])), rng);
    });
  });

  // Reduced-precision GEMMs (autocast) against the f32 CPU result on the same inputs: tf32 may
  // round multiply inputs to 10 mantissa bits, bf16 to 7, f16 to 10 (f32 accumulation throughout).
  describe.each([
    ["tf32", 1e-3],
    ["bf16", 1e-2],
    ["f16", 1e-2],
  ] as const)("matmul in %s", (precision, tol) => {
    test.each(transposePairs)("64x48x96 transA=%p transB=%p", (tA, tB) => {
      const rng = new Rng(41 + (tA ? 1 : 0) + (tB ? 2 : 0));
      const c = matmulCase(rng, 64, 48, 96, tA, tB);
      const dout = f64(f32(randn(rng, 64 * 48)));
      const got = runCase(c, newContext().backend, dout, precision);
      const want = runCase(c, cpu(), dout, "f32");
      expect(relErr(got.out, want.out)).toBeLessThanOrEqual(tol);
      expect(relErr(got.grads[0]!, want.grads[0]!)).toBeLessThanOrEqual(tol);
      expect(relErr(got.grads[1]!, want.grads[1]!)).toBeLessThanOrEqual(tol);
    });
    test("attention B=2 T=17 C=24 H=3", () => {
      const rng = new Rng(43);
      const c = attentionCase(rng, 2, 17, 24, 3);
      const dout = f64(f32(randn(rng, 2 * 17 * 24)));
      const got = runCase(c, newContext().backend, dout, precision);
      const want = runCase(c, cpu(), dout, "f32");
      expect(relErr(got.out, want.out)).toBeLessThanOrEqual(tol);
      expect(relErr(got.grads[0]!, want.grads[0]!)).toBeLessThanOrEqual(tol);
    });
  });
});
