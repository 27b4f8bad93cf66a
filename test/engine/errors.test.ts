// Wrong shapes, dtypes, contexts and indices give typed errors that name the op and the
// shapes; a NaN/Inf loss stops training with a clear message and leaves the weights intact.
import { describe, expect, test } from "bun:test";
import {
  BackendMismatchError,
  DTypeError,
  IndexRangeError,
  NonFiniteLossError,
  ShapeError,
  StaleTensorError,
} from "../../engine/errors.ts";
import { MlpModel } from "../../engine/models/mlp.ts";
import {
  add,
  biasAdd,
  causalSelfAttention,
  embedding,
  layerNorm,
  matmul,
  mul,
  permute,
  relu,
  softmaxCrossEntropy,
} from "../../engine/ops/index.ts";
import { Sgd } from "../../engine/optim/sgd.ts";
import { GptModel } from "../../engine/models/gpt.ts";
import { expectThrown } from "../helpers/errors.ts";
import { newContext } from "../helpers/numeric.ts";
import { constantLrStep } from "../helpers/training.ts";

const f = (ctx: ReturnType<typeof newContext>, shape: number[]) =>
  ctx.fromArray(new Float32Array(shape.reduce((a, b) => a * b, 1)), shape);
const ids = (ctx: ReturnType<typeof newContext>, values: number[], shape = [values.length]) =>
  ctx.fromArray(Int32Array.from(values), shape);

const expectError = (...args: Parameters<typeof expectThrown>): void => {
  expectThrown(...args);
};

describe("shape errors name the op and the shapes", () => {
  const ctx = newContext();
  test("matmul inner dims", () =>
    expectError(() => matmul(f(ctx, [2, 3]), f(ctx, [4, 5])), ShapeError, "matmul", "[2, 3]", "[4, 5]", "inner dims"));
  test("matmul batch dims", () =>
    expectError(() => matmul(f(ctx, [2, 3, 4]), f(ctx, [3, 4, 5])), ShapeError, "matmul", "batch dims"));
  test("matmul 1-D operand", () => expectError(() => matmul(f(ctx, [3]), f(ctx, [3, 2])), ShapeError, "matmul"));
  test("add cannot broadcast", () =>
    expectError(() => add(f(ctx, [2, 3]), f(ctx, [4])), ShapeError, "add", "[2, 3]", "[4]"));
  test("mul cannot broadcast", () =>
    expectError(() => mul(f(ctx, [5, 2]), f(ctx, [3, 2])), ShapeError, "mul", "[5, 2]", "[3, 2]"));
  test("biasAdd length", () =>
    expectError(() => biasAdd(f(ctx, [2, 3]), f(ctx, [4])), ShapeError, "biasAdd", "[2, 3]", "[4]"));
  test("layerNorm weight", () =>
    expectError(() => layerNorm(f(ctx, [2, 3]), f(ctx, [4]), f(ctx, [3])), ShapeError, "layerNorm", "[2, 3]", "[4]"));
  test("cross-entropy targets", () =>
    expectError(
      () => softmaxCrossEntropy(f(ctx, [4, 10]), ids(ctx, [1, 2, 3])),
      ShapeError,
      "softmaxCrossEntropy",
      "[4, 10]",
      "[3]",
    ));
  test("embedding table rank", () =>
    expectError(() => embedding(f(ctx, [10]), ids(ctx, [1])), ShapeError, "embedding", "[10]"));
  test("attention heads", () =>
    expectError(
      () => causalSelfAttention(f(ctx, [1, 4, 12]), 3),
      ShapeError,
      "causalSelfAttention",
      "[1, 4, 12]",
      "nHead=3",
    ));
  test("permute perm", () => expectError(() => permute(f(ctx, [2, 3]), [0, 0]), ShapeError, "permute", "[2, 3]"));
  test("reshape element count", () =>
    expectError(() => f(ctx, [2, 3]).reshape([4, 2]), ShapeError, "reshape", "[2, 3]", "[4, 2]"));
  test("narrowRows range", () => expectError(() => f(ctx, [2, 3]).narrowRows(1, 2), ShapeError, "narrowRows"));
  test("gpt context longer than blockSize", () => {
    const gctx = newContext();
    const model = new GptModel(gctx, { vocabSize: 5, blockSize: 4, nLayer: 1, nHead: 1, nEmbd: 4, dropout: 0 }, 1);
    expectError(
      () => model.forward(ids(gctx, [0, 1, 2, 3, 4], [1, 5])),
      ShapeError,
      "gpt.forward",
      "[1, 5]",
      "blockSize 4",
    );
  });
  test("zero or fractional dims", () => {
    expectError(() => ctx.empty([2, 0]), ShapeError, "[2, 0]");
    expectError(() => ctx.empty([1.5]), ShapeError, "[1.5]");
  });
});

describe("dtype, context and index errors", () => {
  test("an f32 op given i32 data", () => {
    const ctx = newContext();
    expectError(() => relu(ids(ctx, [1, 2])), DTypeError, "relu", "expected dtype f32, got i32", "[2]");
    expectError(() => softmaxCrossEntropy(f(ctx, [2, 3]), f(ctx, [2])), DTypeError, "softmaxCrossEntropy", "i32");
  });
  test("tensors of two contexts in one op", () => {
    const a = newContext();
    const b = newContext();
    expectError(() => add(f(a, [2]), f(b, [2])), BackendMismatchError, "add", "[2]");
  });
  test("a tensor of an earlier pass", () => {
    const ctx = newContext();
    const old = f(ctx, [3]);
    ctx.newPass();
    expectError(() => relu(old), StaleTensorError, "relu", "[3]");
  });
  test("class ids and token ids out of range", () => {
    const ctx = newContext();
    expectError(
      () => softmaxCrossEntropy(f(ctx, [2, 3]), ids(ctx, [0, 3])),
      IndexRangeError,
      "softmaxCrossEntropy",
      "1 index value(s) outside [0, 3)",
    );
    expectError(
      () => embedding(f(ctx, [4, 2]), ids(ctx, [-1, 2, 9])),
      IndexRangeError,
      "embedding",
      "2 index value(s) outside [0, 4)",
    );
  });
  test("backward from a non-scalar or a constant", () => {
    const ctx = newContext();
    const x = f(ctx, [3]);
    expectError(() => ctx.backward(x), ShapeError, "backward");
    expectError(() => ctx.backward(f(ctx, [1])), Error, "does not depend");
  });
});

describe("a non-finite loss stops training", () => {
  /** An MLP 4-8-3 and its trainer: SGD with momentum at the constant learning rate `lr`. */
  const mlpTrainer = (lr: number) => {
    const ctx = newContext();
    const model = new MlpModel(ctx, { widths: [4, 8, 3], activation: "relu", dropout: 0 }, 1);
    const sgd = new Sgd(ctx, model.store, { momentum: 0.9, dampening: 0, nesterov: false, weightDecay: 0 });
    return { model, trainer: constantLrStep(ctx, model, sgd, { lr, gradClip: 0, accumSteps: 1 }) };
  };
  const good = { inputs: Float32Array.of(1, 2, 3, 4), inputShape: [1, 4], targets: Int32Array.of(1), targetShape: [1] };

  test("NaN input: NonFiniteLossError with the step, weights untouched", () => {
    const { model, trainer } = mlpTrainer(0.1);
    trainer.run([good]);
    const before = model.store.readValues();
    const bad = { ...good, inputs: Float32Array.of(1, NaN, 3, 4) };
    expectError(() => trainer.run([bad]), NonFiniteLossError, "loss is NaN at step 1", "learning rate");
    expect(Buffer.from(model.store.readValues().buffer).equals(Buffer.from(before.buffer))).toBe(true);
    // and training goes on from there with good data
    expect(Number.isFinite(trainer.run([good]).loss)).toBe(true);
  });
  test("a learning rate that diverges ends in the same clear error", () => {
    const { trainer } = mlpTrainer(1e30);
    expect(() => {
      for (let i = 0; i < 20; i++) trainer.run([good]);
    }).toThrow(NonFiniteLossError);
  });
});
