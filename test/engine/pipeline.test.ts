// Pipeline parallelism in one process: the schedules (order, bubble, activations held) and the
// stages of a GPT against the single process's training, step by step.
import { describe, expect, test } from "bun:test";
import { ConfigError } from "../../ffi/errors.ts";
import { gptStageActivations } from "../../engine/memory-estimate.ts";
import { GptModel, gptParamSpecs, stageBlocks } from "../../engine/models/gpt.ts";
import { AdamW } from "../../engine/optim/adamw.ts";
import {
  coordsOf,
  type ModelLayout,
  modelParallelRank,
  modelParallelRings,
  type PipelineStepResult,
  shareRuns,
} from "../../engine/parallel/pipeline.ts";
import { PieceRouter, RingGroup, ringDefaults } from "../../engine/parallel/ring.ts";
import {
  peakInFlight,
  type PipeSchedule,
  simulatePipeline,
  stageActions,
  theoreticalBubble,
} from "../../engine/parallel/pipeline-order.ts";
import { MemoryTransport } from "../../engine/parallel/transport.ts";
import { putSlice, type SliceOf, slabLayoutOf } from "../../engine/params.ts";
import { Rng } from "../../engine/rng.ts";
import { evaluate, type HostBatch } from "../../engine/train.ts";
import { newContext, randInts } from "../helpers/numeric.ts";
import { constantLrStep } from "../helpers/training.ts";

describe("pipeline schedules", () => {
  test("1F1B: warm-up forwards, then one forward and one backward, then the drain", () => {
    const show = (s: number) =>
      stageActions("1f1b", 4, 6, s)
        .map((a) => `${a.kind[0]}${a.micro}`)
        .join(" ");
    expect(show(0)).toBe("f0 f1 f2 f3 b0 f4 b1 f5 b2 b3 b4 b5");
    expect(show(3)).toBe("f0 b0 f1 b1 f2 b2 f3 b3 f4 b4 f5 b5");
    expect(stageActions("gpipe", 4, 3, 1).map((a) => `${a.kind[0]}${a.micro}`)).toEqual([
      "f0",
      "f1",
      "f2",
      "b0",
      "b1",
      "b2",
    ]);
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

const config = { vocabSize: 23, blockSize: 16, nLayer: 4, nHead: 4, nEmbd: 32, dropout: 0 };
const microTotal = 4; // micro-batches a step, over every data-parallel replica
const b = 3; // windows a micro-batch
const lr = 3e-3;
const gradClip = 0.5; // low enough to clip: every rank must scale by the same global norm

function batches(steps: number): HostBatch[][] {
  const rng = new Rng(5);
  const T = config.blockSize;
  return Array.from({ length: steps }, () =>
    Array.from({ length: microTotal }, () => ({
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
  const trainer = constantLrStep(ctx, model, new AdamW(ctx, model.store, adamw), {
    lr,
    gradClip,
    accumSteps: microTotal,
  });
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

/**
 * Rank `rank`'s rings of the layout over a transport in memory (the mesh's run over NATS). 16 KB
 * pieces: an activation of a micro-batch (3 x 16 x 32 floats) travels in several.
 */
function memoryRings(layout: ModelLayout, rank: number, peers: Map<number, MemoryTransport>) {
  const transport = new MemoryTransport(rank, peers, 16 << 10);
  const router = new PieceRouter(ringDefaults.earlyBytesMax);
  transport.listen((p) => router.receive(p));
  const rings = modelParallelRings(
    "job",
    layout,
    rank,
    (name, members) => new RingGroup(name, members, transport, router, ringDefaults),
  );
  return { transport, rings };
}

/** Every rank of the layout in this process, over a transport in memory (the mesh's rings over NATS). */
async function layoutRun(
  layout: ModelLayout,
  schedule: PipeSchedule,
  data: HostBatch[][],
  recompute = false,
  model = config,
) {
  const peers = new Map<number, MemoryTransport>();
  const size = layout.data * layout.stages * layout.tensor;
  const ranks = Array.from({ length: size }, (_, rank) => {
    // dropout seeds as the mesh's trainers take them: the same among a stage's tensor ranks
    const ctx = newContext(1 + Math.floor(rank / layout.tensor));
    const { transport, rings } = memoryRings(layout, rank, peers);
    const r = modelParallelRank({
      ctx,
      config: model,
      seed: 7,
      layout,
      rings,
      optimizer: (m) => new AdamW(ctx, m.store, adamw),
      schedule,
      gradClip,
      recompute,
    });
    return { ...r, ctx, transport };
  });
  const perReplica = microTotal / layout.data;
  const results: PipelineStepResult[][] = ranks.map(() => []);
  for (const [step, micro] of data.entries()) {
    const r = await Promise.all(
      ranks.map((x) =>
        x.stage.step(step, micro.slice(x.coords.d * perReplica, (x.coords.d + 1) * perReplica), lr, 1 / layout.data),
      ),
    );
    r.forEach((x, i) => results[i]!.push(x));
  }
  // each parameter's copies (replicas; wte's two ends), tensor shares put back together by name
  const params = new Map<string, Float32Array[]>();
  const shares = new Map<string, { of: SliceOf; values: Float32Array }[]>();
  for (const { model, ctx, transport, coords } of ranks) {
    const values = model.store.readValues();
    for (const e of model.store.entries) {
      const v = values.slice(e.offset, e.offset + e.numel);
      const of = model.slices.get(e.name);
      if (of !== undefined) {
        const key = `${e.name}|${coords.d}`;
        shares.set(key, [...(shares.get(key) ?? []), { of, values: v }]);
      } else if (coords.t === 0) params.set(e.name, [...(params.get(e.name) ?? []), v]);
      else expect(Array.from(v)).toEqual(Array.from(params.get(e.name)!.at(-1)!)); // a replicated parameter: equal on every tensor rank
    }
    transport.close();
    ctx.dispose();
  }
  for (const [key, parts] of shares) {
    const name = key.split("|")[0]!;
    const whole = new Float32Array(parts[0]!.of.shape.reduce((a, b) => a * b, 1));
    for (const p of parts) putSlice(whole, p.of, p.values);
    params.set(name, [...(params.get(name) ?? []), whole]);
  }
  return { results, params, ranks: ranks.map((r) => ({ coords: r.coords, paramBytes: r.model.store.paramCount * 4 })) };
}

const relDiff = (a: number, b: number) => Math.abs(a - b) / Math.max(Math.abs(b), 1e-30);

describe("model-parallel GPT in one process: data x pipeline x tensor", () => {
  const steps = 20;
  const data = batches(steps);
  const reference = singleProcess(data);

  for (const as of [
    [{ data: 1, stages: 2, tensor: 1 }, "1f1b"],
    [{ data: 1, stages: 4, tensor: 1 }, "1f1b"],
    [{ data: 1, stages: 4, tensor: 1 }, "gpipe"],
    [{ data: 1, stages: 1, tensor: 2 }, "1f1b"],
    [{ data: 1, stages: 1, tensor: 4 }, "1f1b"],
    [{ data: 2, stages: 2, tensor: 1 }, "1f1b"],
    [{ data: 1, stages: 2, tensor: 2 }, "gpipe"],
    [{ data: 2, stages: 1, tensor: 2 }, "1f1b"],
    [{ data: 1, stages: 2, tensor: 2 }, "1f1b", "recompute"],
  ] as const) {
    const [layout, schedule] = as;
    const name = `${layout.data}x${layout.stages}x${layout.tensor}`;
    const recompute = as.length > 2;
    test(`${name} (data x pipeline x tensor) ${schedule}${recompute ? " with recomputation" : ""}: the single process's ${steps} steps (losses, clipped norms, parameters)`, async () => {
      const run = await layoutRun(layout, schedule, data, recompute);
      // every rank reports the same loss and norm
      for (const r of run.results) {
        expect(r.map((x) => x.globalLoss)).toEqual(run.results[0]!.map((x) => x.globalLoss));
        expect(r.map((x) => x.gradNorm)).toEqual(run.results[0]!.map((x) => x.gradNorm));
      }
      let worstLoss = 0,
        worstNorm = 0,
        worstParam = 0;
      run.results[0]!.forEach((r, i) => {
        worstLoss = Math.max(worstLoss, relDiff(r.globalLoss, reference.losses[i]!));
        worstNorm = Math.max(worstNorm, relDiff(r.gradNorm, reference.norms[i]!));
      });
      for (const [pname, copies] of run.params) {
        const want = reference.params.get(pname)!;
        for (const got of copies) {
          expect(got.length).toBe(want.length);
          for (let i = 0; i < want.length; i++) worstParam = Math.max(worstParam, Math.abs(got[i]! - want[i]!));
        }
        // the copies of a parameter (replicas, and wte's two ends) are bit-equal
        for (const got of copies) expect(got).toEqual(copies[0]!);
      }
      expect(new Set(run.params.keys())).toEqual(new Set(reference.params.keys()));
      const whole = [...reference.params.values()].reduce((n, p) => n + p.length, 0) * 4;
      console.log(
        `${name} ${schedule}: worst relative difference over ${steps} steps: loss ${worstLoss.toExponential(2)}, norm ${worstNorm.toExponential(2)}; ` +
          `worst parameter difference ${worstParam.toExponential(2)}; parameter bytes per rank ${run.ranks.map((r) => r.paramBytes).join(" ")} (whole model ${whole})`,
      );
      expect(reference.norms.some((n) => n > gradClip)).toBe(true); // clipping is exercised
      expect(worstLoss).toBeLessThan(1e-5);
      expect(worstNorm).toBeLessThan(1e-4);
      expect(worstParam).toBeLessThan(1e-5);
      // activations held, measured: 1F1B's first stage at most P micro-batches, GPipe's all M
      const M = microTotal / layout.data;
      const held = Math.max(...run.results[0]!.map((r) => r.peakInFlight));
      expect(held).toBe(schedule === "1f1b" ? Math.min(layout.stages, M) : M);
    });
  }

  test("dropout under tensor parallelism: a stage's tensor ranks drop the same elements, so their replicated parameters stay equal", async () => {
    const run = await layoutRun({ data: 1, stages: 2, tensor: 2 }, "1f1b", data.slice(0, 5), false, {
      ...config,
      dropout: 0.2,
    });
    // layoutRun compares every replicated parameter across the tensor ranks; the losses are finite and agree
    for (const r of run.results) expect(r.map((x) => x.globalLoss)).toEqual(run.results[0]!.map((x) => x.globalLoss));
    expect(run.results[0]!.every((x) => Number.isFinite(x.globalLoss))).toBe(true);
  });

  test("tensor parallel: each rank holds 1/T of the split matrices (measured from its slab), the rest replicated", async () => {
    const run = await layoutRun({ data: 1, stages: 1, tensor: 4 }, "1f1b", data.slice(0, 1));
    const ctx = newContext(1);
    const whole = new GptModel(ctx, config, 7);
    const split = new GptModel(ctx, config, 7, { stage: 0, stages: 1, tensor: { rank: 1, size: 4 } });
    const bytes = (m: GptModel, names: (n: string) => boolean) =>
      m.store.entries.filter((e) => names(e.name)).reduce((n, e) => n + e.numel * 4, 0);
    const isSplit = (n: string) => split.splitNames.has(n);
    console.log(
      `tensor parallel over 4: split matrices ${bytes(whole, isSplit)} bytes whole, ${bytes(split, isSplit)} on a rank; replicated ${bytes(split, (n) => !isSplit(n))} bytes on every rank`,
    );
    expect(bytes(split, isSplit) * 4).toBe(bytes(whole, isSplit));
    expect(bytes(split, (n) => !isSplit(n))).toBe(bytes(whole, (n) => !isSplit(n)));
    expect(run.ranks.every((r) => r.paramBytes === split.store.paramCount * 4)).toBe(true);
    ctx.dispose();
  });

  test("1F1B holds fewer bytes of activations on the first stage than GPipe (measured from the open passes)", async () => {
    const few = data.slice(0, 2);
    const layout = { data: 1, stages: 2, tensor: 1 };
    const [one, all] = [await layoutRun(layout, "1f1b", few), await layoutRun(layout, "gpipe", few)];
    const bytes = (r: typeof one) => Math.max(...r.results[0]!.map((x) => x.peakHeldBytes));
    console.log(
      `stage 0 of 2, ${microTotal} micro-batches: 1F1B holds ${bytes(one)} bytes of activations at most, GPipe ${bytes(all)}`,
    );
    expect(bytes(one)).toBeLessThan(bytes(all));
  });

  test("each rank's activations held, measured from its open passes, match the plan's count (engine/memory-estimate.ts) within 10%", async () => {
    const few = data.slice(0, 2);
    const rows: string[] = [];
    for (const [layout, schedule] of [
      [{ data: 1, stages: 2, tensor: 1 }, "1f1b"],
      [{ data: 1, stages: 2, tensor: 1 }, "gpipe"],
      [{ data: 1, stages: 1, tensor: 2 }, "1f1b"],
      [{ data: 1, stages: 2, tensor: 2 }, "gpipe"],
    ] as const) {
      const run = await layoutRun(layout, schedule, few);
      run.results.forEach((steps, rank) => {
        const { s: stage } = coordsOf(layout, rank);
        const measured = Math.max(...steps.map((x) => x.peakHeldBytes));
        const p = gptStageActivations(config, {
          batch: b,
          precision: "f32",
          recompute: false,
          optimizer: "adamw",
          tensor: layout.tensor,
          stage,
          stages: layout.stages,
          microBatches: microTotal / layout.data,
          schedule,
        });
        const predicted = p.inFlight * p.perMicroBatch;
        rows.push(
          `${layout.data}x${layout.stages}x${layout.tensor} ${schedule} rank ${rank}: ${measured} bytes held, predicted ${predicted}`,
        );
        expect(Math.abs(measured / predicted - 1)).toBeLessThan(0.1);
      });
    }
    console.log(rows.join("\n"));
  });

  test("evaluate: every rank of a 1x2x2 copy reports the whole model's loss and accuracy on the same batches", async () => {
    const layout = { data: 1, stages: 2, tensor: 2 };
    const peers = new Map<number, MemoryTransport>();
    const ranks = Array.from({ length: 4 }, (_, rank) => {
      const ctx = newContext(1);
      const { transport, rings } = memoryRings(layout, rank, peers);
      return {
        ...modelParallelRank({
          ctx,
          config,
          seed: 7,
          layout,
          rings,
          optimizer: (m) => new AdamW(ctx, m.store, adamw),
          schedule: "1f1b",
          gradClip,
        }),
        ctx,
        transport,
      };
    });
    const batches = data[0]!;
    const got = await Promise.all(ranks.map((r) => r.stage.evaluate(5, batches)));
    const ctx = newContext(1);
    const want = evaluate(ctx, new GptModel(ctx, config, 7), batches);
    for (const g of got) {
      expect(g.count).toBe(want.count);
      expect(g.accuracy).toBe(want.accuracy);
      expect(relDiff(g.loss, want.loss)).toBeLessThan(1e-6);
    }
    ctx.dispose();
    for (const r of ranks) {
      r.transport.close();
      r.ctx.dispose();
    }
  });

  test("shares in the whole slab: one copy's owned runs cover every parameter once; every rank's runs read its initial values from the whole model's", () => {
    const layout = { data: 1, stages: 2, tensor: 2 };
    const ctx = newContext(1);
    const whole = new GptModel(ctx, config, 7);
    const wholeValues = whole.store.readValues();
    const { entries } = slabLayoutOf(gptParamSpecs(config));
    expect(entries).toEqual([...whole.store.entries]);
    const covered = new Uint8Array(whole.store.slabNumel);
    for (let rank = 0; rank < 4; rank++) {
      const { s, t } = coordsOf(layout, rank);
      const m = new GptModel(ctx, config, 7, { stage: s, stages: 2, tensor: { rank: t, size: 2 } });
      const mine = m.store.readValues();
      for (const r of shareRuns(m, entries, "all"))
        expect(mine.subarray(r.local, r.local + r.count)).toEqual(wholeValues.subarray(r.whole, r.whole + r.count));
      for (const r of shareRuns(m, entries, "owned"))
        for (let i = r.whole; i < r.whole + r.count; i++) covered[i]! += 1;
    }
    const coveredCount = covered.reduce((n, c) => n + c, 0);
    expect(Math.max(...covered)).toBe(1);
    expect(coveredCount).toBe(whole.store.paramCount);
    ctx.dispose();
  });

  test("a tensor-parallel block refuses the synchronous forward, and nHead must divide among the ranks", () => {
    const ctx = newContext(1);
    expect(
      () => new GptModel(ctx, { ...config, nHead: 2 }, 7, { stage: 0, stages: 1, tensor: { rank: 0, size: 4 } }),
    ).toThrow(ConfigError);
    const m = new GptModel(ctx, config, 7, { stage: 0, stages: 1, tensor: { rank: 0, size: 2 } });
    ctx.newPass();
    expect(() => m.forward(ctx.fromArray(new Int32Array(16), [1, 16]))).toThrow(ConfigError);
    ctx.dispose();
  });
});
