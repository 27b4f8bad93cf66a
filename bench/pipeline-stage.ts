#!/usr/bin/env bun
// One stage of a pipeline-parallel GPT over a real nats-server, as its own process: the stages'
// activations and gradients travel as CollPiece FlatBuffers messages on each stage's subject
// (mt.<job>.coll.<rank>, services/runtime/collective-bus.ts). Trains `steps` steps on synthetic
// token batches every stage makes alike from the plan's seed, and prints one JSON line per step.
// `bun run bench pipeline` starts P of these; test/services/pipeline.integration.test.ts does
// too, against the single process's trajectory.
//
//   bun bench/pipeline-stage.ts <plan.json>
import { writeFileSync } from "node:fs";
import { type GptConfig, GptModel } from "../engine/models/gpt.ts";
import { AdamW } from "../engine/optim/adamw.ts";
import { PipelineStage, pipelineRings } from "../engine/parallel/pipeline.ts";
import { PieceRouter, RingGroup, ringDefaults } from "../engine/parallel/ring.ts";
import type { PipeSchedule } from "../engine/parallel/schedule.ts";
import { Rng } from "../engine/rng.ts";
import { Context } from "../engine/tensor.ts";
import { type HostBatch, TrainStep } from "../engine/train.ts";
import { CpuBackend } from "../ffi/cpu/backend.ts";
import { BusTransport, busTransportDefaults } from "../services/runtime/collective-bus.ts";
import { NatsBus } from "../services/runtime/nats.ts";

export interface StagePlan {
  url: string;
  job: string;
  stage: number;
  stages: number;
  schedule: PipeSchedule;
  /** micro-batches a step, and windows a micro-batch */
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

export const stageAdamW = { beta1: 0.9, beta2: 0.99, eps: 1e-8, weightDecay: 0.1 };

/** The step's micro-batches: random token windows from (seed, step), the same in every stage. */
export function syntheticBatches(plan: Pick<StagePlan, "seed" | "micro" | "microBatch" | "model">, step: number): HostBatch[] {
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
export function singleProcessRun(plan: Omit<StagePlan, "url" | "job" | "stage" | "stages" | "schedule">): {
  losses: number[];
  norms: number[];
  params: Map<string, Float32Array>;
} {
  const ctx = new Context(new CpuBackend(), { seed: 1 });
  try {
    const model = new GptModel(ctx, plan.model, plan.seed);
    const trainer = new TrainStep(ctx, model, new AdamW(ctx, model.store, stageAdamW), {
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
    return { losses, norms, params: new Map(model.store.entries.map((e) => [e.name, values.slice(e.offset, e.offset + e.numel)])) };
  } finally {
    ctx.dispose();
  }
}

async function main(): Promise<void> {
  const plan = (await Bun.file(process.argv[2]!).json()) as StagePlan;
  const bus = await NatsBus.connect({ url: plan.url, name: `pp-stage-${plan.stage}`, connectRetryMsMax: 10_000, connectBackoffMsMax: 500 });
  const transport = new BusTransport(bus, {
    ...busTransportDefaults,
    job: plan.job,
    rank: plan.stage,
    size: plan.stages,
    generation: 1,
    sharedMemory: plan.sharedMemory ?? false,
  });
  const router = new PieceRouter(ringDefaults.earlyBytesMax);
  transport.listen((p) => router.receive(p));
  const ranks = Array.from({ length: plan.stages }, (_, s) => s);
  const { link, stages } = pipelineRings("pp", ranks, plan.stage, (name, members) => new RingGroup(name, members, transport, router, ringDefaults));
  const ctx = new Context(new CpuBackend(), { seed: 1 });
  const model = new GptModel(ctx, plan.model, plan.seed, { stage: plan.stage, stages: plan.stages });
  model.recompute = plan.recompute ?? false;
  const stage = new PipelineStage({
    ctx,
    model,
    optimizer: new AdamW(ctx, model.store, stageAdamW),
    link,
    stages,
    schedule: plan.schedule,
    gradClip: plan.gradClip,
  });
  // every stage subscribes before any sends: a piece to a stage not yet listening is retried
  for (let step = 0; step < plan.steps; step++) {
    const r = await stage.step(step, syntheticBatches(plan, step), plan.lr);
    const out: StageStepResult = {
      step,
      loss: r.loss,
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
    const params = Object.fromEntries(model.store.entries.map((e) => [e.name, Array.from(values.subarray(e.offset, e.offset + e.numel))]));
    writeFileSync(plan.paramsFile, JSON.stringify(params));
  }
  // the last stage's final sends are acknowledged before it returns; a barrier keeps every stage
  // listening until all of them are done
  await stages.barrier({ step: plan.steps, bucket: 0 });
  transport.close();
  ctx.dispose();
  await bus.close();
}

export interface StagesRun {
  results: StageStepResult[][];
  codes: number[];
  stderr: string[];
}

/** Runs one process per stage of `plans` and collects their lines. */
export async function runStageProcesses(dir: string, plans: StagePlan[]): Promise<StagesRun> {
  const procs = plans.map((plan) => {
    const file = `${dir}/${plan.job}-stage-${plan.stage}.json`;
    writeFileSync(file, JSON.stringify(plan));
    return Bun.spawn([process.execPath, import.meta.path, file], { cwd: `${import.meta.dir}/..`, stdout: "pipe", stderr: "pipe" });
  });
  try {
    const outs = await Promise.all(
      procs.map(async (p) => ({ out: await new Response(p.stdout).text(), err: await new Response(p.stderr).text(), code: await p.exited })),
    );
    return {
      results: outs.map((o) =>
        o.out
          .trim()
          .split("\n")
          .filter((l) => l.startsWith("{"))
          .map((l) => JSON.parse(l) as StageStepResult),
      ),
      codes: outs.map((o) => o.code),
      stderr: outs.map((o) => o.err),
    };
  } finally {
    for (const p of procs) if (p.exitCode === null) p.kill("SIGKILL");
  }
}

if (import.meta.main) await main();
