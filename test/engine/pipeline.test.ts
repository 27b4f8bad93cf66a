// Pipeline parallelism in one process: the schedules (order, bubble, activations held) and the
// stages of a GPT against the single process's training, step by step.
import { describe, expect, test } from "bun:test";
import { ConfigError } from "../../engine/errors.ts";
import { GptModel, stageBlocks } from "../../engine/models/gpt.ts";
import { AdamW } from "../../engine/optim/adamw.ts";
import { PipelineStage, type PipelineStepResult, pipelineRings } from "../../engine/parallel/pipeline.ts";
import { PieceRouter, RingGroup, ringDefaults } from "../../engine/parallel/ring.ts";
import { peakInFlight, type PipeSchedule, simulatePipeline, stageActions, theoreticalBubble } from "../../engine/parallel/schedule.ts";
import { MemoryTransport } from "../../engine/parallel/transport.ts";
import { Rng } from "../../engine/rng.ts";
import { type HostBatch, TrainStep } from "../../engine/train.ts";
import { newContext, randInts } from "../helpers/numeric.ts";

describe("pipeline schedules", () => {
  test("1F1B: warm-up forwards, then one forward and one backward, then the drain", () => {
    const show = (s: number) =>
      stageActions("1f1b", 4, 6, s)
        .map((a) => `${a.kind[0]}${a.micro}`)
        .join(" ");
    expect(show(0)).toBe("f0 f1 f2 f3 b0 f4 b1 f5 b2 b3 b4 b5");
    expect(show(3)).toBe("f0 b0 f1 b1 f2 b2 f3 b3 f4 b4 f5 b5");
    expect(stageActions("gpipe", 4, 3, 1).map((a) => `${a.kind[0]}${a.micro}`)).toEqual(["f0", "f1", "f2", "b0", "b1", "b2"]);
    // fewer micro-batches than stages: the warm-up is cut to M
    expect(stageActions("1f1b", 4, 2, 0).map((a) => `${a.kind[0]}${a.micro}`)).toEqual(["f0", "f1", "b0", "b1"]);
  });

  test("activations held: 1F1B's stage s at most min(P - s, M), GPipe's all M", () => {
    for (const [P, M] of [
      [2, 8],
      [4, 8],
      [4, 3],
      [8, 16],
    ] as const) {
      for (let s = 0; s < P; s++) {
        expect(peakInFlight(stageActions("1f1b", P, M, s))).toBe(Math.min(P - s, M));
        expect(peakInFlight(stageActions("gpipe", P, M, s))).toBe(M);
      }
    }
  });

  test("the bubble of both schedules with equal pass times is (P-1)/(M+P-1), on every stage; neither deadlocks", () => {
    for (const schedule of ["gpipe", "1f1b"] as PipeSchedule[]) {
      for (const [P, M] of [
        [1, 4],
        [2, 4],
        [4, 4],
        [4, 16],
        [8, 3],
      ] as const) {
        const sim = simulatePipeline(schedule, P, M);
        for (const b of sim.bubble) expect(b).toBeCloseTo(theoreticalBubble(P, M), 12);
      }
    }
    // backward twice the forward (as in practice): the same share, over 3 time units a pass pair
    const sim = simulatePipeline("1f1b", 4, 8, 1, 2);
    for (const b of sim.bubble) expect(b).toBeCloseTo(theoreticalBubble(4, 8), 12);
  });

  test("bad sizes are refused", () => {
    expect(() => stageActions("1f1b", 0, 4, 0)).toThrow(ConfigError);
    expect(() => stageActions("1f1b", 2, 0, 0)).toThrow(ConfigError);
    expect(() => stageActions("1f1b", 2, 4, 2)).toThrow(ConfigError);
    expect(() => stageBlocks(4, { stage: 0, stages: 5 })).toThrow(ConfigError);
  });
});

const config = { vocabSize: 23, blockSize: 16, nLayer: 4, nHead: 2, nEmbd: 32, dropout: 0 };
const M = 4; // micro-batches a step
const b = 3; // windows a micro-batch
const lr = 3e-3;
const gradClip = 0.5; // low enough to clip: every stage must scale by the same global norm

function batches(steps: number): HostBatch[][] {
  const rng = new Rng(5);
  const T = config.blockSize;
  return Array.from({ length: steps }, () =>
    Array.from({ length: M }, () => ({
      inputs: randInts(rng, b * T, config.vocabSize),
      inputShape: [b, T],
      targets: randInts(rng, b * T, config.vocabSize),
      targetShape: [b, T],
    })),
  );
}

const adamw = { beta1: 0.9, beta2: 0.99, eps: 1e-8, weightDecay: 0.1 };

function singleProcess(data: HostBatch[][]): { losses: number[]; norms: number[]; params: Map<string, Float32Array> } {
  const ctx = newContext(1);
  const model = new GptModel(ctx, config, 7);
  const trainer = new TrainStep(ctx, model, new AdamW(ctx, model.store, adamw), { lr, schedule: { kind: "constant" }, gradClip, accumSteps: M });
  const losses: number[] = [],
    norms: number[] = [];
  for (const micro of data) {
    const r = trainer.run(micro);
    losses.push(r.loss);
    norms.push(r.gradNorm);
  }
  const values = model.store.readValues();
  const params = new Map(model.store.entries.map((e) => [e.name, values.slice(e.offset, e.offset + e.numel)]));
  ctx.dispose();
  return { losses, norms, params };
}

async function pipelined(P: number, schedule: PipeSchedule, data: HostBatch[][]) {
  // the stages on ranks 10, 11, ... of a transport in memory: the rings the mesh's ranks use over NATS
  const peers = new Map<number, MemoryTransport>();
  const ranks = Array.from({ length: P }, (_, s) => 10 + s);
  const stages = ranks.map((rank, s) => {
    const ctx = newContext(1);
    const model = new GptModel(ctx, config, 7, { stage: s, stages: P });
    // 16 KB pieces: an activation of a micro-batch (3 x 16 x 32 floats) travels in several
    const transport = new MemoryTransport(rank, peers, 16 << 10);
    const router = new PieceRouter(ringDefaults.earlyBytesMax);
    transport.listen((p) => router.receive(p));
    const { link, stages: group } = pipelineRings("pp", ranks, rank, (name, members) => new RingGroup(name, members, transport, router, ringDefaults));
    const stage = new PipelineStage({ ctx, model, optimizer: new AdamW(ctx, model.store, adamw), link, stages: group, schedule, gradClip });
    return { ctx, model, stage, collective: transport };
  });
  const results: PipelineStepResult[][] = stages.map(() => []);
  for (const [step, micro] of data.entries()) {
    const r = await Promise.all(stages.map((s) => s.stage.step(step, micro, lr)));
    r.forEach((x, s) => results[s]!.push(x));
  }
  const params = new Map<string, Float32Array[]>();
  for (const { model, ctx, collective } of stages) {
    const values = model.store.readValues();
    for (const e of model.store.entries) params.set(e.name, [...(params.get(e.name) ?? []), values.slice(e.offset, e.offset + e.numel)]);
    collective.close();
    ctx.dispose();
  }
  return { results, params, models: stages.map((s) => s.model) };
}

const relDiff = (a: number, b: number) => Math.abs(a - b) / Math.max(Math.abs(b), 1e-30);

describe("pipeline-parallel GPT in one process", () => {
  const steps = 20;
  const data = batches(steps);
  const reference = singleProcess(data);

  for (const [P, schedule] of [
    [2, "1f1b"],
    [4, "1f1b"],
    [4, "gpipe"],
  ] as const) {
    test(`P=${P} ${schedule}: the single process's loss trajectory for ${steps} steps, its clipped norms and final parameters; wte equal on both ends`, async () => {
      const run = await pipelined(P, schedule, data);
      // every stage reports the same loss and norm
      for (let s = 1; s < P; s++) {
        expect(run.results[s]!.map((r) => r.loss)).toEqual(run.results[0]!.map((r) => r.loss));
        expect(run.results[s]!.map((r) => r.gradNorm)).toEqual(run.results[0]!.map((r) => r.gradNorm));
      }
      let worstLoss = 0,
        worstNorm = 0,
        worstParam = 0;
      run.results[0]!.forEach((r, i) => {
        worstLoss = Math.max(worstLoss, relDiff(r.loss, reference.losses[i]!));
        worstNorm = Math.max(worstNorm, relDiff(r.gradNorm, reference.norms[i]!));
      });
      for (const [name, copies] of run.params) {
        const want = reference.params.get(name)!;
        for (const got of copies) for (let i = 0; i < want.length; i++) worstParam = Math.max(worstParam, Math.abs(got[i]! - want[i]!));
      }
      // the tied embedding: one copy on the first stage, one on the last, bit-equal
      expect(run.params.get("wte.weight")!.length).toBe(2);
      expect(run.params.get("wte.weight")![0]).toEqual(run.params.get("wte.weight")![1]!);
      expect(new Set(run.params.keys())).toEqual(new Set(reference.params.keys()));
      console.log(
        `P=${P} ${schedule}: worst relative difference over ${steps} steps: loss ${worstLoss.toExponential(2)}, norm ${worstNorm.toExponential(2)}; ` +
          `worst parameter difference ${worstParam.toExponential(2)} (losses ${reference.losses[0]!.toFixed(4)} -> ${reference.losses.at(-1)!.toFixed(4)})`,
      );
      expect(reference.norms.some((n) => n > gradClip)).toBe(true); // clipping is exercised
      expect(worstLoss).toBeLessThan(1e-5);
      expect(worstNorm).toBeLessThan(1e-4);
      expect(worstParam).toBeLessThan(1e-5);
      // activations held, measured: 1F1B's first stage at most P micro-batches, GPipe's all M
      const held = run.results[0]!.map((r) => r.peakInFlight);
      expect(Math.max(...held)).toBe(schedule === "1f1b" ? Math.min(P, M) : M);
    });
  }

  test("1F1B holds fewer bytes of activations on the first stage than GPipe (measured from the open passes)", async () => {
    const few = data.slice(0, 2);
    const [one, all] = [await pipelined(2, "1f1b", few), await pipelined(2, "gpipe", few)];
    const bytes = (r: typeof one) => Math.max(...r.results[0]!.map((x) => x.peakHeldBytes));
    console.log(`stage 0 of 2, ${M} micro-batches: 1F1B holds ${bytes(one)} bytes of activations at most, GPipe ${bytes(all)}`);
    expect(bytes(one)).toBeLessThan(bytes(all));
  });
});
