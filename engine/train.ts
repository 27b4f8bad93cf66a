// One optimizer step over k micro-batches, and evaluation. lossAndGradients is what a trainer
// service runs between pulling parameters and pushing gradients (services/trainer/loop.ts);
// the single-process runs (sdk/local/train-mlp.ts, sdk/local/train-gpt.ts) use TrainStep.
//
// Gradient accumulation: each micro-batch's mean loss is back-propagated with d(loss) = 1/k
// into the same gradient slab, so k micro-batches of size b give exactly the gradient of one
// batch of size k*b (tested to 1e-5).
//
// Precision f16 adds dynamic loss scaling (engine/optim/loss-scale.ts): d(loss) = scale/k,
// and a step whose gradients overflow is skipped. A skipped step uses up its batches but not
// a step: as in PyTorch (GradScaler.step does not call optimizer.step), the parameters, the
// optimizer state and its step count stay as they were, and so does the learning rate, which
// follows the step count. The next run() retries that step with the next batches at half the
// scale.
import { NonFiniteLossError, EngineError, ShapeError } from "./errors.ts";
import { ConfigError } from "../ffi/errors.ts";
import type { Model } from "./models/model.ts";
import type { ParamStore } from "./params.ts";
import { clipGradNorm, measureClip } from "./optim/clip.ts";
import { type LossScaleConfig, LossScaler } from "./optim/loss-scale.ts";
import type { Optimizer } from "./optim/optimizer.ts";
import { lrAt, type Schedule } from "./optim/schedule.ts";
import { countCorrect } from "./ops/accuracy.ts";
import { softmaxCrossEntropy } from "./ops/crossentropy.ts";
import type { Tensor } from "./tensor.ts";
import type { Context } from "./context.ts";

/** A batch in host memory: f32 features or i32 token ids, and i32 targets. */
export interface HostBatch {
  inputs: Float32Array | Int32Array;
  inputShape: number[];
  targets: Int32Array;
  targetShape: number[];
}

export interface StepConfig {
  lr: number;
  schedule: Schedule;
  /** global-norm clipping threshold; 0 disables clipping */
  gradClip: number;
  /** micro-batches per optimizer step */
  accumSteps: number;
  /** loss-scaler settings over lossScaleDefaults; precision f16 only (bf16 and f32 keep f32's
   *  exponent range in their gradients and need no scaler) */
  lossScale?: Partial<LossScaleConfig>;
}

export interface StepResult {
  step: number;
  /** mean loss over the step's micro-batches */
  loss: number;
  /** gradient norm before clipping (after unscaling); Infinity when the step was skipped */
  gradNorm: number;
  lr: number;
  /** the gradients overflowed (f16 loss scaling): nothing was updated */
  skipped: boolean;
  /** the loss scale after this step's update, which the next step uses; 1 without a scaler */
  lossScale: number;
}

export interface Gradients {
  /** mean loss over the micro-batches */
  loss: number;
  /** norm before clipping; Infinity when not finite */
  gradNorm: number;
  /** false: the gradients overflowed under loss scaling; the slab holds inf/NaN and must not be used */
  finite: boolean;
  /** what the optimizer multiplies the slab by (the clip's factor, when it was deferred; else 1) */
  gradScale: number;
}

export function uploadBatch(ctx: Context, b: HostBatch): { x: Tensor; y: Tensor } {
  return { x: ctx.fromArray(b.inputs, b.inputShape), y: ctx.fromArray(b.targets, b.targetShape) };
}

export class TrainStep {
  /** present when the context's precision is f16 */
  readonly scaler: LossScaler | null;

  constructor(
    readonly ctx: Context,
    readonly model: Model,
    readonly optimizer: Optimizer,
    readonly config: StepConfig,
  ) {
    if (!Number.isInteger(config.accumSteps) || config.accumSteps < 1) {
      throw new ConfigError(`accumSteps must be an integer >= 1, got ${config.accumSteps}`);
    }
    if (!(config.gradClip >= 0)) throw new ConfigError(`gradClip must be >= 0, got ${config.gradClip}`);
    if (config.lossScale !== undefined && ctx.precision !== "f16") {
      throw new ConfigError(
        `lossScale is for precision f16; this context computes in ${ctx.precision}, which needs no loss scaling`,
      );
    }
    this.scaler = ctx.precision === "f16" ? new LossScaler(config.lossScale) : null;
  }

  /** The number of optimizer steps taken so far. */
  get step(): number {
    return this.optimizer.stepCount;
  }

  run(micro: readonly HostBatch[]): StepResult {
    const k = this.config.accumSteps;
    if (micro.length !== k) throw new ShapeError("TrainStep.run", [[micro.length]], `expected ${k} micro-batches`);
    if ((this.ctx.precision === "f16") !== (this.scaler !== null)) {
      throw new EngineError(
        `TrainStep: the context's precision changed to ${this.ctx.precision} after the TrainStep was built`,
      );
    }
    // the clip's factor goes into the optimizer's pass (no pass scales the slab first)
    const { loss, gradNorm, finite, gradScale } = lossAndGradients(
      this.ctx,
      this.model,
      micro,
      this.config.gradClip,
      this.step,
      this.scaler,
      true,
    );
    const lr = lrAt(this.config.schedule, this.config.lr, this.step);
    if (finite) this.optimizer.step(lr, gradScale);
    this.scaler?.update(finite, this.step);
    return { step: this.step, loss, gradNorm, lr, skipped: !finite, lossScale: this.scaler?.scale ?? 1 };
  }
}

/**
 * Forward and backward over micro-batches into the gradient slab (zeroed first), then clipping:
 * everything of a step but the update. A trainer in parameter-server mode pushes the slab; the
 * shards apply the optimizer. With a scaler, backward seeds d(loss) = scale/k and the slab is
 * unscaled before clipping, or, if it overflowed, returned with finite = false and not clipped.
 * A non-finite loss throws NonFiniteLossError once every micro-batch has run backward; the slab
 * is then unusable (and zeroed by the next call), the parameters untouched.
 */
export function lossAndGradients(
  ctx: Context,
  model: Model,
  micro: readonly HostBatch[],
  gradClip: number,
  step: number,
  scaler: LossScaler | null = null,
  deferClip = false,
): Gradients {
  const store = model.store;
  const k = micro.length;
  const dloss = (scaler?.scale ?? 1) / k;
  store.zeroGrad();
  const losses = new LossSlots(ctx, k);
  try {
    micro.forEach((b, i) => {
      // the parameters' 2-byte copies are cast in the first micro-batch's pass and read by the rest
      ctx.keepWeightCopies = i > 0;
      const l = forwardPass(ctx, model, b);
      ctx.backward(l, dloss);
      losses.keep(i, l);
    });
  } finally {
    ctx.keepWeightCopies = false;
  }
  // stop before the update: the parameters stay as they were at the last good step (the
  // gradient slab holds what backward made of the bad loss; the next call zeroes it)
  const loss = losses.mean(step, true);
  return { loss, ...unscaleAndClip(ctx, model.store, scaler, gradClip, deferClip) };
}

/** One micro-batch's forward pass, in a new pass of the context's arena: its loss. */
export function forwardPass(ctx: Context, model: Model, b: HostBatch): Tensor {
  ctx.newPass();
  const { x, y } = uploadBatch(ctx, b);
  return model.loss(x, y);
}

/**
 * The micro-batches' losses, kept on the device and read once, after the last backward is
 * queued: on a GPU each read makes the host wait for every pass queued before it, and the GPU
 * then idles while the host queues the next.
 */
export class LossSlots {
  readonly #ptr: number;

  constructor(
    readonly ctx: Context,
    readonly k: number,
  ) {
    this.#ptr = k > 0 ? ctx.scalarSlots(k) : 0;
  }

  /** Keeps micro-batch i's loss. */
  keep(i: number, loss: Tensor): void {
    this.ctx.backend.copy(this.#ptr + 4 * i, loss.ptr, 4);
  }

  /** The mean loss (0 without micro-batches); with `check`, NonFiniteLossError at a non-finite one. */
  mean(step: number, check: boolean): number {
    if (this.k === 0) return 0;
    const values = new Float32Array(this.k);
    this.ctx.backend.download(this.#ptr, values);
    let loss = 0;
    for (const value of values) {
      if (check && !Number.isFinite(value)) throw new NonFiniteLossError(step, value);
      loss += value / this.k;
    }
    return loss;
  }
}

/** The step's summed gradient, unscaled (f16: a skipped step when it overflowed) and clipped by
 *  its global norm; with `defer` the clip is left to the optimizer (gradScale, its factor: AdamW
 *  reads the gradients times it in its one pass), else applied to the slab (gradScale 1). */
export function unscaleAndClip(
  ctx: Context,
  store: ParamStore,
  scaler: LossScaler | null,
  gradClip: number,
  defer = false,
): { gradNorm: number; finite: boolean; gradScale: number } {
  if (scaler !== null && !scaler.unscale(ctx, store)) return { gradNorm: Infinity, finite: false, gradScale: 1 };
  if (!defer) return { gradNorm: clipGradNorm(ctx, store, gradClip), finite: true, gradScale: 1 };
  const { norm, factor } = measureClip(ctx, store, gradClip);
  return { gradNorm: norm, finite: true, gradScale: factor };
}

export interface EvalResult {
  loss: number;
  /** fraction of rows whose argmax logit is the target */
  accuracy: number;
  /** rows (samples or tokens) evaluated */
  count: number;
}

export interface EvaluateOptions {
  /** count argmax hits (on the backend: one number comes back); off: accuracy is NaN. Default on. */
  accuracy?: boolean;
}

/** Mean loss and argmax accuracy over batches, without recording gradients or dropout. */
export function evaluate(
  ctx: Context,
  model: Model,
  batches: Iterable<HostBatch>,
  options: EvaluateOptions = {},
): EvalResult {
  const withAccuracy = options.accuracy ?? true;
  const wasTraining = ctx.training;
  ctx.training = false;
  let lossSum = 0;
  let correct = 0;
  let count = 0;
  try {
    for (const b of batches) {
      ctx.newPass();
      const { x, y } = uploadBatch(ctx, b);
      const { loss, logits } = ctx.noGrad(() => {
        const logits = model.forward(x);
        return { loss: softmaxCrossEntropy(logits, y), logits };
      });
      const rows = b.targets.length;
      lossSum += loss.item() * rows;
      if (withAccuracy) correct += countCorrect(logits, y);
      count += rows;
    }
  } finally {
    ctx.training = wasTraining;
  }
  return {
    loss: lossSum / Math.max(count, 1),
    accuracy: withAccuracy ? correct / Math.max(count, 1) : Number.NaN,
    count,
  };
}
