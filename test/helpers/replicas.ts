// All-reduce replicas for the trainer tests: cfg.trainers ranks in one process over one bus,
// each with its own context (dropout seed 7 + rank, the job's precision) and model.
import type { Backend } from "../../ffi/backend.ts";
import { CpuBackend } from "../../ffi/cpu/backend.ts";
import type { Model } from "../../engine/models/model.ts";
import { Context } from "../../engine/context.ts";
import { type Bus, MemoryBus } from "../../services/runtime/mesh/bus.ts";
import type { JobConfig } from "../../services/runtime/job/config.ts";
import { buildModel, type ModelPlan } from "../../services/runtime/job/model.ts";
import { Replica, type ReplicaOptions } from "../../services/trainer/replica.ts";

export interface ReplicaRank {
  ctx: Context;
  model: Model;
  replica: Replica;
}

export interface ReplicaRanksOptions {
  /** what buildModel needs of the job's plan (imagePlan for an MLP) */
  plan: ModelPlan;
  /** how long a step waits for its peers before it fails (tests keep it short) */
  progressTimeoutMs: number;
  /** a new MemoryBus when unset */
  bus?: Bus;
  /** each rank's own backend; a new CpuBackend when unset */
  backend?: () => Backend;
  /** 1 MiB when unset */
  payloadBytesMax?: number;
  transport?: ReplicaOptions["transport"];
  /** the job's learning rate, held constant (the tests step beside a constant-rate reference);
   *  cfg's lr and schedule when unset */
  lr?: number;
}

/** The cfg.trainers ranks of an all-reduce job, each with its replica listening on the bus. */
export function replicaRanks(job: JobConfig, o: ReplicaRanksOptions): ReplicaRank[] {
  const cfg: JobConfig = o.lr === undefined ? job : { ...job, lr: o.lr, scaleLr: false, schedule: "constant" };
  const bus = o.bus ?? new MemoryBus();
  return Array.from({ length: cfg.trainers }, (_, rank) => {
    const ctx = new Context(o.backend?.() ?? new CpuBackend(), { seed: 7 + rank, precision: cfg.precision });
    const model = buildModel(ctx, cfg, o.plan);
    const replica = new Replica({
      bus,
      backend: ctx.backend,
      cfg,
      rank,
      ctx,
      model,
      payloadBytesMax: o.payloadBytesMax ?? 1 << 20,
      totalSteps: 1000,
      transport: o.transport,
      progressTimeoutMs: o.progressTimeoutMs,
    });
    return { ctx, model, replica };
  });
}

/** Closes each rank's replica and disposes of its context. */
export function closeRanks(ranks: readonly ReplicaRank[]): void {
  for (const r of ranks) {
    r.replica.close();
    r.ctx.dispose();
  }
}
