// In-process MLP training on MNIST: the README's main job until the mesh services exist.
import { mkdirSync } from "node:fs";
import { dirname } from "node:path";
import type { Backend } from "../../ffi/backend.ts";
import { type DeviceChoice, heldDeviceLine, openBackend } from "../../ffi/select.ts";
import { ImageBatcher } from "../../engine/data/images.ts";
import { loadMnist } from "../../engine/data/mnist.ts";
import { trainValSplit } from "../../engine/data/sampler.ts";
import { saveModelFile } from "../../engine/modelfile.ts";
import { type MlpConfig, MlpModel } from "../../engine/models/mlp.ts";
import type { Optimizer } from "../../engine/optim/optimizer.ts";
import { checkSchedule, scheduleOf } from "../../engine/optim/schedule.ts";
import { optimizerOf } from "../../engine/optim/choose.ts";
import { type JobConfig, jobDefaults } from "../../services/runtime/job/config.ts";
import { defaultDraft } from "../../services/runtime/job/options.ts";
import { ConfigError } from "../../ffi/errors.ts";
import type { Precision } from "../../engine/mixed.ts";
import { Context } from "../../engine/context.ts";
import { evaluate, TrainStep } from "../../engine/train.ts";
import { type StopSignal, stoppedLine, trainStop } from "../signals.ts";
import { Progress, RateMeter } from "../progress.ts";
import { checkOutFile } from "../user-paths.ts";
import { precisionNote, skippedStepNote, warmupNote } from "./precision.ts";
import { modelLines } from "./next-steps.ts";

export interface MlpRunOptions {
  widths: number[];
  dropout: number;
  epochs: number;
  batchSize: number;
  accum: number;
  optimizer: "sgd" | "adamw";
  lr: number;
  momentum: number;
  nesterov: boolean;
  weightDecay: number;
  /** AdamW's second-moment decay */
  beta2: number;
  schedule: "constant" | "cosine" | "linear";
  warmup: number;
  gradClip: number;
  seed: number;
  /** share of the training set held out (seeded) for validation each epoch; 0: none */
  valFraction: number;
  dataDir?: string;
  out: string;
  /** auto: CUDA when a driver and a GPU are present, else the CPU */
  device: DeviceChoice;
  /** what the GEMMs read (engine/mixed.ts); parameters stay f32 */
  precision: Precision;
}

// Defaults: LeCun's 784-800-10 network, trained to >= 98% test accuracy in ~10 epochs.
const d = jobDefaults;
const sgd = d.optimizer as Extract<JobConfig["optimizer"], { kind: "sgd" }>;
const mlp = d.model as Extract<JobConfig["model"], { kind: "mlp" }>;

/** A run's defaults: the mesh's job defaults (services/runtime/job/options.ts), and where the model goes. */
export const mlpRunDefaults: MlpRunOptions = {
  widths: mlp.widths,
  dropout: mlp.dropout,
  epochs: d.epochs,
  batchSize: d.batchSize,
  accum: d.accumSteps,
  optimizer: "sgd",
  lr: d.lr,
  momentum: sgd.momentum,
  nesterov: sgd.nesterov,
  weightDecay: sgd.weightDecay,
  beta2: defaultDraft("mlp", "adamw").optimizer.beta2 as number,
  schedule: d.schedule,
  warmup: d.warmupSteps,
  gradClip: d.gradClip,
  seed: d.seed,
  valFraction: d.valFraction,
  out: "runs/mlp-mnist/model.mtm",
  device: "auto",
  precision: d.precision,
};

/** Samples per evaluation batch; `meshtrain eval` reads the same batches. */
export const evalBatchSamples = 1000;

export interface MlpRunResult {
  testAccuracy: number;
  testLoss: number;
  steps: number;
  seconds: number;
  /** the signal that stopped the run before its end (the model is still evaluated and written), else null */
  interrupted: StopSignal | null;
}

export function makeOptimizer(ctx: Context, model: MlpModel, o: MlpRunOptions): Optimizer {
  return optimizerOf(
    ctx,
    model.store,
    o.optimizer === "sgd"
      ? { kind: "sgd", momentum: o.momentum, nesterov: o.nesterov, weightDecay: o.weightDecay }
      : { kind: "adamw", beta1: 0.9, beta2: o.beta2, eps: 1e-8, weightDecay: o.weightDecay },
  );
}

export async function runMlp(o: MlpRunOptions): Promise<MlpRunResult> {
  checkOutFile(o.out, "--out");
  const device = heldDeviceLine((why) => console.log(why));
  // (not withBackend: the run is async, a loop that yields to Ctrl-C between steps)
  const { backend } = openBackend(o.device, device.log);
  try {
    return await trainMlp(o, backend, device.flush);
  } finally {
    backend.dispose();
  }
}

/** `inputsRead` prints the device line once the data and the options are checked. */
async function trainMlp(o: MlpRunOptions, backend: Backend, inputsRead: () => void): Promise<MlpRunResult> {
  const t0 = performance.now();
  const data = loadMnist(o.dataDir);
  const features = data.train.rows * data.train.cols;
  if (o.widths[0] !== features || o.widths[o.widths.length - 1] !== 10) {
    throw new ConfigError(
      `--widths must start with ${features} (pixels) and end with 10 (classes), got ${o.widths.join(",")}`,
    );
  }
  const ctx = new Context(backend, { seed: o.seed, precision: o.precision });
  const config: MlpConfig = { widths: o.widths, activation: "relu", dropout: o.dropout };
  const model = new MlpModel(ctx, config, o.seed);
  const split = trainValSplit(data.train.count, o.valFraction, o.seed);
  const micro = new ImageBatcher(data.train, o.batchSize, split.train);
  const valBatches = split.val.length > 0 ? new ImageBatcher(data.train, evalBatchSamples, split.val) : null;
  const stepsPerEpoch = Math.floor(micro.batchesPerEpoch(true) / o.accum);
  const totalSteps = stepsPerEpoch * o.epochs;
  const schedule = scheduleOf(o.schedule, o.warmup, totalSteps, 0);
  checkSchedule(schedule, o.lr);
  const trainer = new TrainStep(ctx, model, makeOptimizer(ctx, model, o), {
    lr: o.lr,
    schedule,
    gradClip: o.gradClip,
    accumSteps: o.accum,
  });

  inputsRead();
  console.log(
    `meshtrain: mlp ${o.widths.join("-")} on MNIST (${split.train.length} train / ${split.val.length} validation / ${data.test.count} test), ${backend.name} backend, ${precisionNote(o.precision)}`,
  );
  console.log(`config: ${JSON.stringify(o)}`);
  console.log(
    `parameters: ${model.store.paramCount.toLocaleString("en-US")} | samples/step: ${o.batchSize * o.accum} ` +
      `| steps: ${totalSteps} (${stepsPerEpoch}/epoch) | GEMM GFLOP/step: ${(model.gemmFlopsPerStep(o.batchSize * o.accum) / 1e9).toFixed(2)}`,
  );
  const warmup = o.schedule === "constant" ? null : warmupNote(o.warmup, totalSteps);
  if (warmup !== null) console.log(warmup);

  const testBatches = new ImageBatcher(data.test, evalBatchSamples);
  const progress = new Progress(totalSteps, "samples");
  const rate = new RateMeter();
  let step = 0;
  let last = { loss: 0, accuracy: 0 };
  // Ctrl-C: the run ends after the step under way, evaluated and written; a second ends it at
  // once (the handlers let go after the loop, and whatever ends the function)
  using stop = trainStop(
    (line) => progress.log(line),
    () => step,
  );
  let evaluatedAt = -1;
  for (let epoch = 0; epoch < o.epochs; epoch++) {
    const batches = micro.epoch(o.seed, epoch, true, true);
    for (let s = 0; s < stepsPerEpoch; s++) {
      await stop.betweenSteps();
      if (stop.requested !== null) break;
      const group =
        o.accum === 1
          ? [batches.next().value!]
          : Array.from({ length: o.accum }, () => cloneBatch(batches.next().value!));
      const r = trainer.run(group);
      step++;
      rate.add(o.batchSize * o.accum);
      if (r.skipped) progress.log(skippedStepNote(step, r.lossScale));
      progress.update(step, {
        loss: r.loss.toFixed(4),
        sps: rate.rate.toFixed(0),
        extra: `epoch ${epoch + 1}/${o.epochs} | `,
      });
    }
    // an epoch cut short by Ctrl-C: evaluated below, as a run stopped between epochs is not
    if (stop.requested !== null) break;
    evaluatedAt = step;
    const ev = evaluate(ctx, model, testBatches.epoch(0, 0, false, false));
    last = { loss: ev.loss, accuracy: ev.accuracy };
    const val =
      valBatches === null
        ? ""
        : (() => {
            const v = evaluate(ctx, model, valBatches.epoch(0, 0, false, false));
            return `validation loss ${v.loss.toFixed(4)}, validation accuracy ${(v.accuracy * 100).toFixed(2)}%; `;
          })();
    progress.log(
      `epoch ${epoch + 1}/${o.epochs}: ${val}test loss ${ev.loss.toFixed(4)}, test accuracy ${(ev.accuracy * 100).toFixed(2)}%`,
    );
  }
  stop[Symbol.dispose]();
  const interrupted = stop.requested;
  if (evaluatedAt !== step) {
    const ev = evaluate(ctx, model, testBatches.epoch(0, 0, false, false));
    last = { loss: ev.loss, accuracy: ev.accuracy };
  }
  progress.stop();
  if (interrupted !== null) console.log(stoppedLine(interrupted, step, totalSteps));
  mkdirSync(dirname(o.out), { recursive: true });
  saveModelFile(o.out, model.store, { kind: "mlp", config, step, training: o });
  const seconds = (performance.now() - t0) / 1000;
  console.log(
    `test accuracy: ${(last.accuracy * 100).toFixed(2)}% (error ${((1 - last.accuracy) * 100).toFixed(2)}%; ` +
      `LeCun et al. list 1.6% for 784-800-10) after ${step} steps in ${seconds.toFixed(1)} s`,
  );
  for (const line of modelLines(o.out, [["eval"]])) console.log(line);
  ctx.dispose();
  return { testAccuracy: last.accuracy, testLoss: last.loss, steps: step, seconds, interrupted };
}

/** The batcher reuses its buffers; accumulation needs k batches alive at once. */
function cloneBatch<T extends { inputs: Float32Array | Int32Array; targets: Int32Array }>(b: T): T {
  return { ...b, inputs: b.inputs.slice(), targets: b.targets.slice() };
}
