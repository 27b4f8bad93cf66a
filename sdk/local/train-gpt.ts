// In-process GPT training on character-level text (Moby Dick by default) or on uint16 token
// files (llm.c / nanoGPT layouts), with periodic validation, a time limit, and a model file
// that `meshtrain sample` reads.
import { mkdirSync } from "node:fs";
import { dirname, join } from "node:path";
import { ConfigError } from "../../ffi/errors.ts";
import { hfFolderShape, loadHfFolder } from "../../engine/hf-gpt2.ts";
import { type JobConfig, gptJobDefaults } from "../../services/runtime/job/config.ts";
import { checkOutFile, shownPath } from "../user-paths.ts";
import type { Backend } from "../../ffi/backend.ts";
import { CudaBackend } from "../../ffi/cuda/backend.ts";
import { type DeviceChoice, heldDeviceLine, openBackend } from "../../ffi/select.ts";
import {
  type AttentionChoice,
  attentionDeviceProblem,
  attentionProblem,
} from "../../services/runtime/job/attention.ts";
import { loadCorpus } from "../../engine/data/corpus.ts";
import type { CharVocab } from "../../engine/data/text.ts";
import { TokenBatcher } from "../../engine/data/tokens.ts";
import { formatBytes, type GptMemory, gptMemory } from "../../engine/memory-estimate.ts";
import { planDevice } from "../plan.ts";
import { saveModelFile } from "../../engine/modelfile.ts";
import { gpt2EndOfText, gpt2Tokenizer } from "../../engine/data/tokenizer.ts";
import { type GptConfig, gptDefaults, GptModel } from "../../engine/models/gpt.ts";
import { optimizerOf } from "../../engine/optim/choose.ts";
import { checkSchedule, scheduleOf } from "../../engine/optim/schedule.ts";
import { Rng } from "../../engine/rng.ts";
import { autocastDType, type Precision } from "../../engine/mixed.ts";
import { Context } from "../../engine/context.ts";
import { evaluate, TrainStep } from "../../engine/train.ts";
import { Progress, RateMeter } from "../progress.ts";
import { type StopSignal, stoppedLine, trainStop } from "../signals.ts";
import { precisionNote, skippedStepNote, warmupNote } from "./precision.ts";
import { modelLines } from "./next-steps.ts";

export interface GptRunOptions {
  /** a UTF-8 text file for a character-level model (default: Moby Dick) */
  text?: string;
  /** a folder with train.bin and val.bin (uint16 tokens), and vocab.json or --vocab-size */
  tokensDir?: string;
  vocabSize?: number;
  valFraction: number;
  nLayer: number;
  nHead: number;
  nEmbd: number;
  blockSize: number;
  dropout: number;
  batchSize: number;
  accum: number;
  lr: number;
  minLr: number;
  warmup: number;
  maxSteps: number;
  weightDecay: number;
  beta2: number;
  gradClip: number;
  evalEvery: number;
  /** batches (of batchSize windows) a validation pass reads at most; 0: the whole split */
  evalBatches: number;
  timeLimitMin: number;
  seed: number;
  out: string;
  sampleChars: number;
  /** auto: CUDA when a driver and a GPU are present, else the CPU */
  device: DeviceChoice;
  /** what the GEMMs read (engine/mixed.ts); parameters stay f32 */
  precision: Precision;
  /** which causal attention runs on a GPU (services/runtime/job/attention.ts); a CPU runs its C kernels */
  attention: AttentionChoice;
  /** activation checkpointing (GptModel.recompute) */
  recompute: boolean;
  /** fine-tuning: start from a Hugging Face GPT-2 folder (`meshtrain export`'s, or transformers') */
  initFrom?: string;
  /** the options the user gave (the CLI's): with initFrom, a shape option that disagrees with the folder's is refused */
  given?: ReadonlySet<string>;
}

const g = gptJobDefaults;
const adamw = g.optimizer as Extract<JobConfig["optimizer"], { kind: "adamw" }>;

// The small default (the mesh's gpt job's, services/runtime/job/options.ts): ~0.8M parameters, reaches < 2.0 nats/char validation loss on Moby Dick
// in a few minutes on two CPU cores.
export const gptRunDefaults: GptRunOptions = {
  valFraction: g.valFraction,
  ...gptDefaults,
  batchSize: g.batchSize,
  accum: g.accumSteps,
  lr: g.lr,
  minLr: g.minLr,
  warmup: g.warmupSteps,
  // a run of steps (the mesh's: of epochs)
  maxSteps: 2000,
  weightDecay: adamw.weightDecay,
  beta2: adamw.beta2,
  gradClip: g.gradClip,
  evalEvery: 250,
  evalBatches: g.evalBatches,
  timeLimitMin: 15,
  seed: g.seed,
  out: "runs/gpt-moby-dick/model.mtm",
  sampleChars: 300,
  device: "auto",
  precision: g.precision,
  attention: g.attention,
  recompute: g.recompute,
};

export interface GptRunResult {
  valLoss: number;
  steps: number;
  seconds: number;
  sample?: string;
  /** the signal that stopped the run before its end (the model is still evaluated and written), else null */
  interrupted: StopSignal | null;
}

/** sample needs a character vocabulary; "Call me" where the text has those characters (Moby Dick's opening) */
function nextCommands(vocab: CharVocab | undefined): string[][] {
  if (vocab === undefined) return [["eval"]];
  const prompt = [..."Call me"].every((c) => vocab.chars.includes(c)) ? ["--prompt", "Call me"] : [];
  return [["sample", ...prompt], ["eval"]];
}

const shapeFlags = { blockSize: "--block-size", nLayer: "--n-layer", nHead: "--n-head", nEmbd: "--n-embd" } as const;

/**
 * --init-from: a Hugging Face GPT-2 folder's shape (its config.json) is the model's; a shape
 * option the user gave that disagrees is refused, naming both.
 */
export function initFromShape(
  dir: string,
  given: Partial<Record<keyof typeof shapeFlags, unknown>>,
): ReturnType<typeof hfFolderShape> {
  const hf = hfFolderShape(dir);
  for (const [key, flag] of Object.entries(shapeFlags) as [keyof typeof shapeFlags, string][]) {
    if (given[key] !== undefined && given[key] !== hf[key])
      throw new ConfigError(
        `--init-from ${shownPath(dir)}: its model has ${flag.slice(2)} ${hf[key]}; ${flag} ${given[key]} disagrees (leave it out)`,
      );
  }
  return hf;
}

/** --init-from: the folder's shape (config.json), which the shape options the user gave must agree with. */
function initShape(o: GptRunOptions, vocabSize: number): Pick<GptConfig, "blockSize" | "nLayer" | "nHead" | "nEmbd"> {
  const given = Object.fromEntries([...(o.given ?? [])].map((k) => [k, o[k as keyof GptRunOptions]]));
  const hf = initFromShape(o.initFrom!, given);
  if (hf.vocabSize !== vocabSize) {
    throw new ConfigError(
      `--init-from ${shownPath(o.initFrom!)}: its vocabulary is ${hf.vocabSize} tokens (transformer.wte.weight [${hf.vocabSize}, ${hf.nEmbd}]); the data's is ${vocabSize}`,
    );
  }
  return hf;
}

/** The header's memory line: the analytic count (engine/memory-estimate.ts, docs/MEMORY.md). */
export function memoryLine(m: GptMemory): string {
  return (
    `memory: parameters ${formatBytes(m.parameters)} + gradients ${formatBytes(m.gradients)} + AdamW ${formatBytes(m.optimizer)} ` +
    (m.weightCopies > 0 ? `+ their 2-byte copy ${formatBytes(m.weightCopies)} ` : "") +
    `+ activations ${formatBytes(m.activationsPeak)} at a pass's peak = ${formatBytes(m.total)} (predicted)`
  );
}

/** After the second step: the pass's measured peak against the prediction, and what the arena holds. */
export function measuredLine(ctx: Context, m: GptMemory): string {
  const peak = ctx.arena.passPeakBytes;
  return `memory: a training pass's peak ${formatBytes(peak)} measured (${(peak / m.activationsPeak).toFixed(3)} x predicted); the arena holds ${formatBytes(ctx.arena.capacityBytes)}`;
}

/** The first `count` items (all of them for 0). */
export function* firstBatches<T>(items: Iterable<T>, count: number): Generator<T> {
  let taken = 0;
  for (const item of items) {
    if (count > 0 && taken === count) return;
    taken++;
    yield item;
  }
}

export async function runGpt(o: GptRunOptions): Promise<GptRunResult> {
  // said in the flags (the model's own check names its config's keys)
  if (o.initFrom === undefined && o.nEmbd % o.nHead !== 0)
    throw new ConfigError(`--n-embd (${o.nEmbd}) must be divisible by --n-head (${o.nHead})`);
  checkOutFile(o.out, "--out");
  // what the asked attention cannot run on is refused before the backend opens (the shape of
  // an --init-from folder is checked once it is read)
  refuseAttention(
    o,
    attentionProblem(o.attention, o.precision, o.initFrom === undefined ? o : null) ??
      attentionDeviceProblem(o.attention, o.device === "cpu" ? "--device cpu asks for the CPU" : null),
  );
  const device = heldDeviceLine((why) => console.log(why));
  const { backend, detail } = openBackend(o.device, device.log, 0, { attention: o.attention });
  try {
    refuseAttention(
      o,
      attentionDeviceProblem(
        o.attention,
        backend.name === "cpu" ? `--device ${o.device} found no GPU (${detail})` : null,
      ),
    );
    return await trainGpt(o, backend, device.flush);
  } finally {
    backend.dispose();
  }
}

/** Refuses --attention where it cannot run (services/runtime/job/attention.ts says why). */
function refuseAttention(o: GptRunOptions, problem: string | null): void {
  if (problem !== null) throw new ConfigError(`--attention ${o.attention} ${problem}`);
}

/** `inputsRead` prints the device line once the corpus and the model are read. */
async function trainGpt(given: GptRunOptions, backend: Backend, inputsRead: () => void): Promise<GptRunResult> {
  const t0 = performance.now();
  const corpus = loadCorpus(given);
  // --init-from: the folder's shape is the run's; what the user gave is kept out of the record
  const { given: _, ...settings } = given;
  const o: GptRunOptions =
    given.initFrom === undefined ? settings : { ...settings, ...initShape(given, corpus.vocabSize) };
  // the folder's shape, which the check before the backend opened did not know
  if (given.initFrom !== undefined) refuseAttention(o, attentionProblem(o.attention, o.precision, o));
  const ctx = new Context(backend, { seed: o.seed, precision: o.precision });
  const { config, model } = buildGpt(ctx, o, corpus.vocabSize);
  const predicted = gptMemory(config, {
    batch: o.batchSize,
    precision: o.precision,
    recompute: o.recompute,
    optimizer: "adamw",
  });
  // a run that cannot fit is refused now, not when its first pass runs out (minutes in, on a CPU)
  const room = planDevice(backend.name === "cpu" ? "cpu" : "cuda", null);
  if (predicted.total > room.bytes)
    throw new ConfigError(
      `the run does not fit: it needs ${memoryLine(predicted).replace(/^memory: /, "")}, more than the ` +
        `${formatBytes(room.bytes)} of ${backend.name === "cpu" ? "this machine's memory" : "the GPU's memory"}; ` +
        "a smaller --batch-size (--accum keeps the tokens per step), --recompute, or a smaller model",
    );
  const schedule = scheduleOf("cosine", o.warmup, o.maxSteps, o.minLr);
  checkSchedule(schedule, o.lr);
  const optimizer = optimizerOf(ctx, model.store, {
    kind: "adamw",
    beta1: 0.9,
    beta2: o.beta2,
    eps: 1e-8,
    weightDecay: o.weightDecay,
  });
  const trainer = new TrainStep(ctx, model, optimizer, {
    lr: o.lr,
    schedule,
    gradClip: o.gradClip,
    accumSteps: o.accum,
  });
  const batches = (tokens: typeof corpus.train, split: string) =>
    new TokenBatcher(tokens, o.batchSize, o.blockSize, corpus.vocabSize, `the ${split} split of ${corpus.name}`);
  const trainBatches = batches(corpus.train, "training");
  // validation batches are training micro-batches: a forward pass over them needs less memory
  // than a training step (`meshtrain eval` reads the same batches)
  const valBatches = batches(corpus.val, "validation");
  const tokensPerStep = o.batchSize * o.accum * o.blockSize;

  inputsRead();
  console.log(
    `meshtrain: gpt on ${corpus.name}: ${corpus.train.length.toLocaleString("en-US")} train / ${corpus.val.length.toLocaleString("en-US")} val tokens, vocab ${corpus.vocabSize}, ${backend.name} backend, ${precisionNote(o.precision)}`,
  );
  // autocast hands attention 2-byte q, k and v; else f32
  console.log(`attention: ${backend.describeAttention(autocastDType(o.precision) ?? "f32")}`);
  // on a GPU: whether cuBLASLt fuses the linear layers' bias, GELU and their gradients
  if (backend instanceof CudaBackend) console.log(`linear layers: ${backend.describeEpilogues()}`);
  console.log(`config: ${JSON.stringify({ model: config, training: o })}`);
  console.log(
    `parameters: ${model.store.paramCount.toLocaleString("en-US")} | tokens/step: ${tokensPerStep} ` +
      `| GEMM GFLOP/step: ${(model.gemmFlopsPerStep(o.batchSize * o.accum) / 1e9).toFixed(2)} | limit: ${stepsText(o.maxSteps)} or ${o.timeLimitMin} min`,
  );
  console.log(memoryLine(predicted));
  const warmup = warmupNote(o.warmup, o.maxSteps);
  if (warmup !== null) console.log(warmup);

  const rng = new Rng(o.seed);
  const progress = new Progress(o.maxSteps, "tokens");
  const rate = new RateMeter();
  // the loop's start is the first time mark: a run of one step (--max-steps 1) has a rate too
  rate.add(0);
  const deadline = t0 + o.timeLimitMin * 60_000;
  let valLoss = Number.NaN;
  let step = 0;
  let validatedAt = -1;
  const validate = () => {
    validatedAt = step;
    valLoss = evaluate(ctx, model, firstBatches(valBatches.sequential(), o.evalBatches), { accuracy: false }).loss;
    progress.log(
      `step ${step}: val loss ${valLoss.toFixed(4)} nats/token (${((performance.now() - t0) / 1000).toFixed(0)} s)`,
    );
  };
  // fine-tuning: where the loaded model starts
  if (o.initFrom !== undefined) {
    console.log(`initialized from ${shownPath(o.initFrom)} (model.safetensors, config.json)`);
    validate();
  }
  // Ctrl-C: the run ends after the step under way, evaluated and written; a second ends it at
  // once (the handlers let go after the loop, and whatever ends the function)
  using stop = trainStop(
    (line) => progress.log(line),
    () => step,
  );
  while (step < o.maxSteps && performance.now() < deadline) {
    await stop.betweenSteps();
    if (stop.requested !== null) break;
    const micro = Array.from({ length: o.accum }, () => {
      const b = trainBatches.random(rng);
      return o.accum === 1 ? b : { ...b, inputs: b.inputs.slice(), targets: b.targets.slice() };
    });
    const r = trainer.run(micro);
    step++;
    // after the second step: the first pass's chunks are one by then, as large as a pass needs
    if (step === Math.min(2, o.maxSteps)) progress.log(measuredLine(ctx, predicted));
    rate.add(tokensPerStep);
    if (r.skipped) progress.log(skippedStepNote(step, r.lossScale));
    progress.update(step, {
      loss: r.loss.toFixed(4),
      sps: rate.rate.toFixed(0),
      extra: `lr ${r.lr.toExponential(2)} | `,
    });
    if (step % o.evalEvery === 0) validate();
  }
  stop[Symbol.dispose]();
  // the model written is the one evaluated last (also a run the time limit stopped before its first step)
  if (validatedAt !== step) validate();
  progress.stop();
  const interrupted = stop.requested;
  if (interrupted !== null) console.log(stoppedLine(interrupted, step, o.maxSteps));
  else if (step < o.maxSteps)
    console.log(`stopped at the ${o.timeLimitMin}-minute time limit after ${stepsText(step)}`);

  const seconds = (performance.now() - t0) / 1000;
  const sample = finishGpt(o, corpus, config, model, { step, valLoss, seconds });
  ctx.dispose();
  return { valLoss, steps: step, seconds, sample, interrupted };
}

/** The run's GPT, from the seed or (--init-from) a Hugging Face folder's tensors. */
function buildGpt(ctx: Context, o: GptRunOptions, vocabSize: number): { config: GptConfig; model: GptModel } {
  const config: GptConfig = {
    vocabSize,
    blockSize: o.blockSize,
    nLayer: o.nLayer,
    nHead: o.nHead,
    nEmbd: o.nEmbd,
    dropout: o.dropout,
  };
  const model = new GptModel(ctx, config, o.seed);
  model.recompute = o.recompute;
  if (o.initFrom !== undefined) {
    const values = model.store.readValues();
    loadHfFolder(o.initFrom, model.store.entries, values);
    model.store.writeValues(values);
  }
  return { config, model };
}

/** The end of a run: the model file, the validation loss, a sample, and the next commands. Returns the sample. */
function finishGpt(
  o: GptRunOptions,
  corpus: ReturnType<typeof loadCorpus>,
  config: GptConfig,
  model: GptModel,
  run: { step: number; valLoss: number; seconds: number },
): string | undefined {
  const { step, valLoss, seconds } = run;
  mkdirSync(dirname(o.out), { recursive: true });
  const bpe = corpus.tokenizer === "gpt2";
  saveModelFile(o.out, model.store, {
    kind: "gpt",
    config,
    vocab: corpus.vocab ? [...corpus.vocab.chars] : undefined,
    ...(bpe ? { tokenizer: "gpt2" as const } : {}),
    step,
    training: o,
  });
  console.log(`validation loss: ${valLoss.toFixed(4)} nats/token after ${stepsText(step)} in ${seconds.toFixed(1)} s`);
  let sample: string | undefined;
  if (corpus.vocab !== undefined && o.sampleChars > 0) {
    const prompt = corpus.vocab.encode(corpus.vocab.chars.includes("\n") ? "\n" : corpus.vocab.chars[0]!);
    sample = corpus.vocab.decode(model.generate([...prompt], o.sampleChars, new Rng(o.seed), { temperature: 0.8 }));
    console.log(`sample (temperature 0.8):\n${sample}`);
  } else if (bpe && o.sampleChars > 0) {
    // GPT-2 BPE: from <|endoftext|>, a document's start; tokens, about 4 characters each
    const tok = gpt2Tokenizer();
    sample = tok.decode(
      model.generate([gpt2EndOfText], Math.ceil(o.sampleChars / 4), new Rng(o.seed), { temperature: 0.8 }),
    );
    console.log(`sample (temperature 0.8):\n${sample}`);
  }
  for (const line of modelLines(o.out, bpe ? [["sample", "--prompt", "The"], ["eval"]] : nextCommands(corpus.vocab)))
    console.log(line);
  return sample;
}

const stepsText = (n: number) => `${n} step${n === 1 ? "" : "s"}`;
