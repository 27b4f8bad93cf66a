#!/usr/bin/env bun
// One rank of a model-parallel GPT (data x pipeline x tensor, engine/parallel/pipeline.ts) over a
// real nats-server, as its own process: the stages' activations and gradients, the tensor
// ranks' all-reduces and the replicas' gradients travel as CollPiece FlatBuffers messages on
// each rank's subject (mt.<job>.coll.<rank>, services/runtime/transport/collective-bus.ts). Trains `steps`
// steps on synthetic token batches every rank makes alike from the plan's seed, and prints one
// JSON line per step. test/services/pipeline.integration.test.ts starts one per rank, against
// the single process's trajectory.
//
//   bun bench/pipeline-stage.ts <plan.json>
import { type PlanRun, runPlanProcesses } from "./plan-processes.ts";
import { writeFileSync } from "node:fs";
import { type GptConfig, GptModel } from "../engine/models/gpt.ts";
import { type OptimizerSpec, optimizerOf } from "../engine/optim/choose.ts";
import { type ModelLayout, modelParallelRank, modelParallelRings } from "../engine/parallel/pipeline.ts";
import { PieceRouter, RingGroup, ringDefaults } from "../engine/parallel/ring.ts";
import type { PipeSchedule } from "../engine/parallel/pipeline-order.ts";
import { Rng } from "../engine/rng.ts";
import { Context } from "../engine/context.ts";
import { type HostBatch, TrainStep } from "../engine/train.ts";
import { CpuBackend } from "../ffi/cpu/backend.ts";
import { BusTransport, busTransportDefaults } from "../services/runtime/transport/collective-bus.ts";
import { NatsBus } from "../services/runtime/mesh/nats.ts";

export interface StagePlan {
  url: string;
  job: string;
  layout: ModelLayout;
  rank: number;
  schedule: PipeSchedule;
  /** micro-batches a step (over every replica: each runs micro / layout.data), and windows a micro-batch */
  micro: number;
  microBatch: number;
  steps: number;
  model: GptConfig;
  seed: number;
  lr: number;
  gradClip: number;
  /** where the stage writes its final parameters (name -> values), for a comparison */
  paramsFile?: string;
  recompute?: boolean;
  sharedMemory?: boolean;
}

export interface StageStepResult {
  step: number;
  loss: number;
  gradNorm: number;
  stepMs: number;
  idleMs: number;
  peakInFlight: number;
  peakHeldBytes: number;
  /** this stage's parameters, in bytes (f32) */
  paramBytes: number;
}

export const stageAdamW: OptimizerSpec = { kind: "adamw", beta1: 0.9, beta2: 0.99, eps: 1e-8, weightDecay: 0.1 };

/** The step's micro-batches: random token windows from (seed, step), the same in every stage. */
export function syntheticBatches(
  plan: Pick<StagePlan, "seed" | "micro" | "microBatch" | "model">,
  step: number,
): HostBatch[] {
  const rng = new Rng(plan.seed * 100_003 + step);
  const { blockSize: T, vocabSize: V } = plan.model;
  const ints = (n: number) => Int32Array.from({ length: n }, () => rng.int(V));
  return Array.from({ length: plan.micro }, () => ({
    inputs: ints(plan.microBatch * T),
    inputShape: [plan.microBatch, T],
    targets: ints(plan.microBatch * T),
    targetShape: [plan.microBatch, T],
  }));
}

/** The single process over the same batches: the trajectory the stages must repeat. */
export function singleProcessRun(plan: Omit<StagePlan, "url" | "job" | "layout" | "rank" | "schedule">): {
  losses: number[];
  norms: number[];
  params: Map<string, Float32Array>;
} {
  const ctx = new Context(new CpuBackend(), { seed: 1 });
  try {
    const model = new GptModel(ctx, plan.model, plan.seed);
    const trainer = new TrainStep(ctx, model, optimizerOf(ctx, model.store, stageAdamW), {
      lr: plan.lr,
      schedule: { kind: "constant" },
      gradClip: plan.gradClip,
      accumSteps: plan.micro,
    });
    const losses: number[] = [],
      norms: number[] = [];
    for (let s = 0; s < plan.steps; s++) {
      const r = trainer.run(syntheticBatches(plan, s));
      losses.push(r.loss);
      norms.push(r.gradNorm);
    }
    const values = model.store.readValues();
    return {
      losses,
      norms,
      params: new Map(model.store.entries.map((e) => [e.name, values.slice(e.offset, e.offset + e.numel)])),
    };
  } finally {
    ctx.dispose();
  }
}

async function main(): Promise<void> {
  const plan = (await Bun.file(process.argv[2]!).json()) as StagePlan;
  const { layout } = plan;
  const size = layout.data * layout.stages * layout.tensor;
  const bus = await NatsBus.connect({
    url: plan.url,
    name: `mp-rank-${plan.rank}`,
    connectRetryMsMax: 10_000,
    connectBackoffMsMax: 500,
  });
  const transport = new BusTransport(bus, {
    ...busTransportDefaults,
    job: plan.job,
    rank: plan.rank,
    size,
    generation: 1,
    sharedMemory: plan.sharedMemory ?? false,
  });
  const router = new PieceRouter(ringDefaults.earlyBytesMax);
  transport.listen((p) => router.receive(p));
  const rings = modelParallelRings(
    "mp",
    layout,
    plan.rank,
    (name, members) => new RingGroup(name, members, transport, router, ringDefaults),
  );
  const ctx = new Context(new CpuBackend(), { seed: 1 });
  const { model, stage, coords } = modelParallelRank({
    ctx,
    config: plan.model,
    seed: plan.seed,
    layout,
    rings,
    optimizer: (m) => optimizerOf(ctx, m.store, stageAdamW),
    schedule: plan.schedule,
    gradClip: plan.gradClip,
    recompute: plan.recompute ?? false,
  });
  const perReplica = plan.micro / layout.data;
  // a piece to a rank that has not subscribed yet is retried until it has
  for (let step = 0; step < plan.steps; step++) {
    const micro = syntheticBatches(plan, step).slice(coords.d * perReplica, (coords.d + 1) * perReplica);
    const r = await stage.step(step, micro, plan.lr, 1 / layout.data);
    const out: StageStepResult = {
      step,
      loss: r.globalLoss,
      gradNorm: r.gradNorm,
      stepMs: r.stepMs,
      idleMs: r.idleMs,
      peakInFlight: r.peakInFlight,
      peakHeldBytes: r.peakHeldBytes,
      paramBytes: model.store.paramCount * 4,
    };
    process.stdout.write(`${JSON.stringify(out)}\n`);
  }
  if (plan.paramsFile) {
    const values = model.store.readValues();
    const params = Object.fromEntries(
      model.store.entries.map((e) => [e.name, Array.from(values.subarray(e.offset, e.offset + e.numel))]),
    );
    writeFileSync(plan.paramsFile, JSON.stringify({ coords, slices: Object.fromEntries(model.slices), params }));
  }
  // a rank's last sends are acknowledged before its step returns; the barrier keeps every rank
  // listening until all of them are done
  await rings.modelGroup.barrier({ step: plan.steps, bucket: 0 });
  if (rings.data) await rings.data.barrier({ step: plan.steps, bucket: 0 });
  transport.close();
  ctx.dispose();
  await bus.close();
}

export type StagesRun = PlanRun<StageStepResult>;

/** Runs one stage process per plan to the end; processes left are killed. */
export const runStageProcesses = (dir: string, plans: StagePlan[]): Promise<StagesRun> =>
  runPlanProcesses<StageStepResult>(import.meta.path, dir, plans);

if (import.meta.main) await main();
