// What a trainer rank holds in all-reduce mode, whichever way the job cuts the model: one
// interface, TrainerReplica, that modes.ts's ReplicaMode steps, snapshots and restores through,
// and the one place that builds it from the job's config (replicaOf):
//   Replica               a whole copy of the model, its gradient all-reduced with the other
//                         ranks' (replica.ts over the engine's DataParallel: buckets, ZeRO,
//                         compression, offload);
//   ModelParallelReplica  one share of a copy (`pipelineStages` x `tensorParallel` > 1): its
//                         stage's blocks cut to its tensor rank (model-parallel.ts).
// Where the two differ, the interface says it as a property or a method (what the rank serves a
// snapshot, the rank its events carry, how it evaluates), never as a test of the class.
import type { Model } from "../../engine/models/model.ts";
import type { ModelMemory } from "../../engine/parallel/zero.ts";
import type { Context } from "../../engine/context.ts";
import type { EvalResult, HostBatch } from "../../engine/train.ts";
import type { DataPlan } from "../../schemas/messages/data-loader.ts";
import type { ShardState } from "../../schemas/messages/parameter-server.ts";
import type { CollectivePlan, TrainerPlace } from "../runtime/job/collective-plan.ts";
import { type JobConfig, modelParallel } from "../runtime/job/config.ts";
import { buildModel } from "../runtime/job/model.ts";
import { checkPlanLayout } from "../runtime/job/plan.ts";
import { ModelParallelReplica } from "./model-parallel.ts";
import { Replica, type ReplicaOptions, type ReplicaStaging, type ReplicaStepResult } from "./replica.ts";

/** What a rank serves a snapshot: the whole replica (rank 0 without ZeRO), its partition or share, or nothing. */
export type ReplicaServes = "whole" | "partition" | "none";

export interface TrainerReplica {
  /** the model this rank steps: the whole of it, or (model parallelism) its share */
  readonly model: Model;
  /** the communicator generation it runs (0 before its first restore) */
  readonly generation: number;
  /** the rank its Step and Eval events carry (null: another rank speaks for its copy) */
  readonly eventRank: number | null;
  /** the data-loader's rank it reads */
  readonly dataRank: number;
  /** bytes of values it has sent to its peers */
  readonly wireBytes: number;
  /** what it holds for the model, read from its allocations */
  readonly memory: ModelMemory;
  /** how many machines the ranks' host labels name (1 until useTopology) */
  readonly hostCount: number;
  /** which collective carries the job (after useTopology); null: the ring */
  readonly plan: CollectivePlan | null;
  readonly serves: ReplicaServes;
  /** a restore's parts as they arrive, checked; nothing changes until apply() */
  readonly staging: ReplicaStaging;
  /** the ranks' host labels and, where they announced them, their devices (before the first step) */
  useTopology(hosts: readonly string[], places?: readonly (TrainerPlace | undefined)[]): void;
  /** a peer went quiet (the liveness watch named it); absent where no communicator could wait on it forever */
  peerStalled?(peer: number, why: string): void;
  /** one step over `micro` (this rank's `rows` of the step's `totalRows` samples), its update at
   *  the job's learning rate at `step` (config.ts's lrAt) */
  step(step: number, micro: readonly HostBatch[], rows: number, totalRows: number): Promise<ReplicaStepResult>;
  /** compares the copies' parameters (an error names those that differ) */
  checkReplicas(step: number): Promise<void>;
  /** the model's evaluation over `batches` at the boundary of `step` (every rank at the same one) */
  evaluate(step: number, batches: readonly HostBatch[]): Promise<EvalResult>;
  /** cuts what it serves for the snapshot of `step`: copies kept for its parts; returns their number */
  cut(step: number, partBytesMax: number): number;
  /** whether a cut of `step` is kept */
  hasCut(step: number): boolean;
  /** part `part` of what it serves a snapshot of `step`, under `partBytesMax` */
  exportPart(step: number, part: number, partBytesMax: number): Promise<ShardState>;
  /** fails the operations in flight (a restore abandons the step) */
  interrupt(): void;
  /** rebuilds the communicator under a new generation */
  reconnect(generation: number): void;
  /** applies the staged restore, and its communicator generation */
  apply(): { step: number; generation: number };
  close(): void;
}

/** A replica's options, less what replicaOf derives from the job's plan (the model, the steps). */
export interface ReplicaOfOptions extends Omit<ReplicaOptions, "model" | "totalSteps"> {
  /** the job's plan, from its spec */
  plan: DataPlan;
}

/**
 * The replica of an all-reduce job's rank: a share of the model where the job cuts it
 * (pipeline or tensor parallelism), else a whole copy of the model built from the job's plan.
 */
export function replicaOf(o: ReplicaOfOptions): TrainerReplica {
  const { bus, backend, cfg, rank, ctx, plan, payloadBytesMax, transport, progressTimeoutMs } = o;
  const common = { bus, backend, cfg, rank, ctx, payloadBytesMax, transport, progressTimeoutMs };
  // a model-parallel rank holds its share only (checked against the plan's whole model); its
  // rings are always over the job's transport (no NCCL)
  if (modelParallel(cfg)) return new ModelParallelReplica({ ...common, plan });
  return new Replica({
    ...common,
    ncclIds: o.ncclIds,
    attempt: o.attempt,
    model: planModel(ctx, cfg, plan),
    totalSteps: plan.totalSteps,
  });
}

/** The whole model of a job, checked against its plan's parameter layout; `fresh` false: its
 *  starting values come from elsewhere (a parameter-server trainer pulls them from the shards),
 *  so a fine-tuned job's folder is not read for them (buildModel). */
export function planModel(ctx: Context, cfg: JobConfig, plan: DataPlan, fresh = true): Model {
  const model = buildModel(ctx, cfg, plan, fresh);
  checkPlanLayout(plan, model.store.slabNumel, model.store.decayRange.numel);
  return model;
}
