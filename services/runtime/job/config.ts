// A job's resolved configuration: what `meshtrain submit` sends, what every service of the
// job reads, and what each checkpoint stores. Its keys, types, ranges and defaults are the rows
// of the option table (options.ts); this module derives the zod schema and the defaults from
// them, checks what no single row can (how the options go together), and says what follows from
// a config: its sync mode's traits, its learning rate at a step, its steps.
import { z } from "zod";
import { lrAt as scheduledLr, scheduleOf } from "../../../engine/optim/schedule.ts";
import { type DataPlan } from "../../../schemas/messages/data-loader.ts";
import { type JobSpec, SyncPolicy } from "../../../schemas/messages/job.ts";
import { BadRequestError } from "../mesh/errors.ts";
import { ConfigError } from "../../../ffi/errors.ts";
import { attentionProblem } from "./attention.ts";
import {
  type AnyJobOption,
  allJobOptions,
  defaultDraft,
  type JobOption,
  type jobOptionRows,
  type ModelKind,
  type OptimizerKind,
} from "./options.ts";
import { jobIdPattern, ownerOfJob, ownerProblem } from "./subjects.ts";
import { dataRanks, modelRanks, StepSchedule, worldOf, worldProblems } from "./world.ts";

export { dataRanks, modelRanks };
export { meshPrecisions, syncModes } from "./options.ts";

// The config's type, from the rows: the top-level keys, and each model's and optimizer's fields.
type Row = (typeof jobOptionRows)[number];
type ValueOf<R> = R extends { type: { read: (raw: string) => infer T } } ? T : never;
type ModelsOf<R> = R extends JobOption<unknown, string, infer M, readonly OptimizerKind[]> ? M[number] : never;
type OptimizersOf<R> = R extends JobOption<unknown, string, readonly ModelKind[], infer O> ? O[number] : never;
type TopLevel = { [R in Row as R["key"] extends `${string}.${string}` ? never : R["key"]]: ValueOf<R> };
type KindsOf<R, G extends "model" | "optimizer"> = G extends "model" ? ModelsOf<R> : OptimizersOf<R>;
/** A model's or an optimizer's fields: the rows of its group that name its kind. */
type GroupOf<G extends "model" | "optimizer", K extends string> = { kind: K } & {
  [R in Row as R["key"] extends `${G}.${infer F}`
    ? F extends "kind"
      ? never
      : K extends KindsOf<R, G>
        ? F
        : never
    : never]: ValueOf<R>;
};
type ModelOf<K extends ModelKind> = GroupOf<"model", K>;
type OptimizerOf<K extends OptimizerKind> = GroupOf<"optimizer", K>;
export type JobConfig = TopLevel & {
  model: ModelOf<"mlp"> | ModelOf<"gpt">;
  optimizer: OptimizerOf<"sgd"> | OptimizerOf<"adamw">;
};

/** Each key once: the first row of a key is its type (--text and --tokens set dataDir too). */
const keyRows = allJobOptions.filter((r, i) => allJobOptions.findIndex((o) => o.key === r.key) === i);
const field = (r: AnyJobOption): string => r.key.slice(r.key.indexOf(".") + 1);
const schemaOf = (r: AnyJobOption): z.ZodType =>
  r.olderConfigs === undefined ? r.type.schema : r.type.schema.default(r.olderConfigs as never);

/** A group's variants (model, optimizer): an object per kind, with the rows its kind has. */
function variants<K extends string>(group: "model" | "optimizer", kinds: readonly K[]) {
  const own = keyRows.filter((r) => r.key.startsWith(`${group}.`) && r.key !== `${group}.kind`);
  const has = (r: AnyJobOption, k: K): boolean =>
    ((group === "model" ? r.models : r.optimizers) as readonly string[] | undefined)?.includes(k) ?? true;
  const [first, ...rest] = kinds.map((k) =>
    z.object({
      kind: z.literal(k),
      ...Object.fromEntries(own.filter((r) => has(r, k)).map((r) => [field(r), schemaOf(r)])),
    }),
  );
  return z.discriminatedUnion("kind", [first!, ...rest]);
}

export const jobConfigSchema = z.object(
  Object.fromEntries(
    keyRows.flatMap((r): [string, z.ZodType][] => {
      if (r.key === "model.kind") return [["model", variants("model", ["mlp", "gpt"] as const)]];
      if (r.key === "optimizer.kind") return [["optimizer", variants("optimizer", ["sgd", "adamw"] as const)]];
      return r.key.includes(".") ? [] : [[r.key, schemaOf(r)]];
    }),
  ),
) as unknown as z.ZodType<JobConfig>;

/** The defaults of an MLP job (MNIST, SGD with Nesterov momentum, two trainers). */
export const jobDefaults = defaultDraft("mlp") as unknown as Omit<JobConfig, "job">;

/**
 * The defaults of a GPT job: AdamW, cosine to a tenth, clipping at 1, over character-level Moby
 * Dick, 32 windows of 64 per trainer per step. The windows are the epoch's unit: each is visited
 * once per epoch (at an offset that changes with the epoch), so three epochs are about 800 steps
 * of two trainers.
 */
export const gptJobDefaults = defaultDraft("gpt") as unknown as Omit<JobConfig, "job">;

export const defaultsOf = (kind: JobConfig["model"]["kind"]): Omit<JobConfig, "job"> =>
  kind === "gpt" ? gptJobDefaults : jobDefaults;

/** The one check of a config where it enters (the CLI, the SDK, a JobSpec): its rows' types,
 *  then how they go together. */
export function parseJobConfig(data: unknown): JobConfig {
  const r = jobConfigSchema.safeParse(data);
  if (!r.success) {
    throw new ConfigError(
      `invalid job config: ${r.error.issues.map((i) => `${i.path.join(".") || "(job)"}: ${i.message}`).join("; ")}`,
    );
  }
  const c = r.data;
  const problem = [
    c.minLr > c.lr && `minLr (${c.minLr}) exceeds lr (${c.lr})`,
    ...modelDataProblems(c),
    ...modeProblems(c),
    ...modelParallelProblems(c),
  ].find((p) => p !== false);
  if (problem !== undefined) throw new ConfigError(`invalid job config: ${problem}`);
  return c;
}

/** f16 runs in all-reduce mode only: its loss scaler skips a step when the gradients overflow,
 *  and only there does every rank see the same (reduced) gradient, so every rank skips alike.
 *  In parameter-server mode the trainers and shards would have to agree first. */
export const meshF16Refusal =
  "precision f16 runs in all-reduce mode (--sync allreduce) or a single process (meshtrain train): its loss " +
  "scaler skips steps whose gradients overflow, which a parameter server's trainers and shards do not agree on; use f32, tf32 or bf16";

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

/** A rule's outcome: false where the config keeps it, else why it does not. */
type Problem = string | false;

/** The model and its data set agree. */
function modelDataProblems(c: JobConfig): Problem[] {
  const m = c.model;
  if (m.kind === "mlp")
    return [
      c.attention !== "auto" && `attention ${c.attention} is for the gpt (its causal attention); the mlp has none`,
      c.initFrom !== "" &&
        "initFrom is for the gpt (a Hugging Face GPT-2 folder to fine-tune); the mlp starts from its seed",
      c.recompute &&
        "recompute is for the gpt (each transformer block recomputes its activations); the mlp keeps its few",
      c.dataset !== "mnist" && `the mlp trains on dataset mnist, not ${c.dataset} (the gpt trains on text and tokens)`,
      (m.widths[0] !== 784 || m.widths[m.widths.length - 1] !== 10) &&
        `model.widths must start with 784 (MNIST pixels) and end with 10 (classes), got ${m.widths.join(",")}`,
    ];
  const attention = attentionProblem(c.attention, c.precision, m);
  return [
    c.dataset === "mnist" &&
      "the gpt trains on dataset text (a UTF-8 file) or tokens (a folder of uint16 tokens), not mnist",
    m.nEmbd % m.nHead !== 0 && `model.nEmbd (${m.nEmbd}) must be divisible by model.nHead (${m.nHead})`,
    attention !== null && `attention ${c.attention} ${attention}`,
    c.dataset === "text" &&
      c.valFraction === 0 &&
      "dataset text needs valFraction > 0 (the held-out tail of the text is what the gpt is evaluated on)",
    c.dataset === "tokens" &&
      c.valFraction !== 0 &&
      "dataset tokens is evaluated on its folder's validation split (val.bin, or a prepared folder's val shards); valFraction must be 0",
    c.dataset === "text" &&
      m.vocabSize !== 0 &&
      "model.vocabSize is for token folders without vocab.json; a text's vocabulary is its characters",
  ];
}

/** The world, the batch and the settings each sync mode takes. */
function modeProblems(c: JobConfig): Problem[] {
  const world = worldProblems(c.world, c.trainers, c.batchSize);
  const allreduce = c.sync === "allreduce";
  return [
    world.length > 0 && world.join("; "),
    c.batchSize % c.accumSteps !== 0 && `batchSize (${c.batchSize}) must be a multiple of accumSteps (${c.accumSteps})`,
    c.precision === "f16" && !allreduce && meshF16Refusal,
    c.scaleLr &&
      c.warmupSteps === 0 &&
      "scaleLr needs warmupSteps > 0 (a learning rate scaled by the trainers diverges without warmup; Goyal et al. warm up over 5 epochs)",
    c.zero > 0 &&
      !allreduce &&
      `ZeRO (zero ${c.zero}) partitions the trainers' replicas, so it needs sync allreduce; the parameter server already holds one copy of the model, cut among its shards`,
    c.offload !== "none" &&
      !allreduce &&
      "offload optimizer moves the trainers' optimizer to host memory, so it needs sync allreduce; in parameter-server mode the optimizer runs on the shards already",
    allreduce &&
      (c.batchPushes !== 1 || c.staleness !== 0) &&
      "batchPushes and staleness apply to the parameter server's asp and ssp, not to allreduce",
    c.sync === "bsp" &&
      c.batchPushes !== 1 &&
      "batchPushes applies to asp and ssp (bsp aggregates the W pushes of a step)",
  ];
}

/** A pipeline or tensor-parallel layout: a gpt, all-reduce, a whole number of copies, and nothing not built with it. */
function modelParallelProblems(c: JobConfig): Problem[] {
  const mp = modelRanks(c);
  if (mp <= 1) return [];
  const what = `pipeline stages ${c.pipelineStages} x tensor parallel ${c.tensorParallel}`;
  const not = [
    c.zero > 0 && `zero ${c.zero}`,
    c.compress !== "none" && `compress ${c.compress}`,
    c.offload !== "none" && `offload ${c.offload}`,
    c.precision === "f16" && "precision f16",
    c.world.length > 0 && "a changed world (resize)",
    c.initFrom !== "" && "initFrom (fine-tuning)",
  ].filter(Boolean);
  if (c.model.kind !== "gpt") return [`${what} cut a gpt's blocks; the mlp is not cut`];
  const m = c.model;
  return [
    c.sync !== "allreduce" &&
      `${what} needs sync allreduce (the model's ranks exchange activations and reduce gradients among themselves)`,
    c.trainers % mp !== 0 &&
      `${c.trainers} trainers do not divide into copies of ${mp} ranks (${what}); use a multiple of ${mp}`,
    m.nLayer < c.pipelineStages && `${m.nLayer} layers cannot fill ${c.pipelineStages} pipeline stages`,
    m.nHead % c.tensorParallel !== 0 &&
      `tensor parallel ${c.tensorParallel} splits the heads: nHead (${m.nHead}) must be a multiple of it`,
    not.length > 0 &&
      `${not.join(", ")} with ${what} is not built yet (the model-parallel ranks reduce f32 gradients of their own shares); leave it out`,
  ];
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

/** The job's learning rate at `step`: its schedule over the plan's steps, peaking at peakLr (what
 *  the trainers step with and report, and in parameter-server mode what the shards apply). */
export const lrAt = (cfg: JobConfig, plan: Pick<DataPlan, "totalSteps">, step: number): number =>
  scheduledLr(scheduleOf(cfg.schedule, cfg.warmupSteps, plan.totalSteps, cfg.minLr), peakLr(cfg), step);

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
