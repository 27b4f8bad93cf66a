// All-reduce mode's replicas (services/trainer/replica.ts), several ranks in one process over the
// in-memory bus: the averaged step against one process with the whole batch, buckets cut in
// backward order, the replica check, and snapshot parts (export, hostile loads, restore).
import { describe, expect, test } from "bun:test";
import { loadMnist } from "../../engine/data/mnist.ts";
import type { Model } from "../../engine/models/model.ts";
import { optimizerOf } from "../../engine/optim/choose.ts";
import { Rng } from "../../engine/rng.ts";
import { Context } from "../../engine/context.ts";
import type { HostBatch, StepResult, TrainStep } from "../../engine/train.ts";
import { CpuBackend } from "../../ffi/cpu/backend.ts";
import { MemoryBus } from "../../services/runtime/mesh/bus.ts";
import { BadRequestError, CapacityError } from "../../services/runtime/mesh/errors.ts";
import { gptJobDefaults, type JobConfig, jobDefaults, parseJobConfig } from "../../services/runtime/job/config.ts";
import { buildModel, type ModelPlan } from "../../services/runtime/job/model.ts";
import { ReplicaDivergedError, type ReplicaStepResult } from "../../services/trainer/replica.ts";
import { imagePlan } from "../helpers/jobs.ts";
import { withChecksum } from "../../schemas/messages/parameter-server.ts";
import { closeRanks, type ReplicaRank, replicaRanks } from "../helpers/replicas.ts";
import { constantLrStep } from "../helpers/training.ts";

const mnist = loadMnist();
const cols = 784;

const config = (over: Partial<JobConfig> = {}): JobConfig =>
  parseJobConfig({
    ...jobDefaults,
    job: "replica",
    sync: "allreduce",
    model: { kind: "mlp", widths: [784, 64, 10], dropout: 0 },
    trainers: 2,
    bucketMb: 0.002,
    chunkBytes: 16 << 10,
    gradClip: 1,
    ...over,
  });

/** Rows [from, from+n) of the MNIST training set. */
function batch(from: number, n: number): HostBatch {
  const x = new Float32Array(n * cols);
  for (let i = 0; i < n * cols; i++) x[i] = mnist.train.images[from * cols + i]! / 255;
  const y = new Int32Array(n);
  for (let i = 0; i < n; i++) y[i] = mnist.train.labels[from + i]!;
  return { inputs: x, inputShape: [n, cols], targets: y, targetShape: [n] };
}

const sharedBus = new MemoryBus();

/** The ranks of `cfg` (stepping at the constant `lr` where it is given) on `bus`, a new one where it is not. */
const ranks = (cfg: JobConfig, o: { lr?: number; bus?: MemoryBus } = {}): ReplicaRank[] =>
  replicaRanks(cfg, {
    bus: o.bus ?? new MemoryBus(),
    plan: imagePlan,
    transport: { peerLostMs: 5_000 },
    progressTimeoutMs: 5_000,
    ...(o.lr === undefined ? {} : { lr: o.lr }),
  });

/** One process with the whole batch: the job's model and optimizer at the constant `lr`. */
function singleProcess(cfg: JobConfig, plan: ModelPlan, lr: number) {
  const ctx = new Context(new CpuBackend(), { seed: 0 });
  const single = buildModel(ctx, cfg, plan);
  const opt = optimizerOf(ctx, single.store, cfg.optimizer);
  return { ctx, single, train: constantLrStep(ctx, single, opt, { lr, gradClip: cfg.gradClip, accumSteps: 1 }) };
}

const relDiff = (a: number, b: number) => Math.abs(a - b) / Math.max(Math.abs(b), 1e-12);

/**
 * `steps` steps of 2 ranks beside the single process: at step s it takes data(2bs, 2b) whole, rank
 * r its rows from 2bs + rb. `each` sees every step's results. Returns the worst relative difference
 * of the ranks' mean loss and of their norm from the single process's.
 */
async function stepBeside(
  rs: ReplicaRank[],
  train: TrainStep,
  data: (from: number, n: number) => HostBatch,
  o: { steps: number; b: number },
  each: (results: ReplicaStepResult[], whole: StepResult) => void = () => {},
): Promise<number> {
  const { b } = o;
  let worst = 0;
  for (let s = 0; s < o.steps; s++) {
    const whole = train.run([data(s * 2 * b, 2 * b)]);
    const results = await Promise.all(
      rs.map((r, rank) => r.replica.step(s, [data(s * 2 * b + rank * b, b)], b, 2 * b)),
    );
    const loss = (results[0]!.loss + results[1]!.loss) / 2;
    worst = Math.max(worst, relDiff(loss, whole.loss), relDiff(results[0]!.gradNorm, whole.gradNorm));
    each(results, whole);
  }
  return worst;
}

/** The 2 replicas are bit-identical and within 1e-4 of the single process; their buckets cover it once. */
function expectReplicasMatch(rs: ReplicaRank[], single: Model): void {
  const [p0, p1] = rs.map((r) => r.model.store.readValues());
  expect(Buffer.from(p0!.buffer).equals(Buffer.from(p1!.buffer))).toBe(true);
  const ref = single.store.readValues();
  let maxErr = 0;
  for (let i = 0; i < ref.length; i++) maxErr = Math.max(maxErr, Math.abs(p0![i]! - ref[i]!));
  expect(maxErr).toBeLessThan(1e-4);
  expect(rs[0]!.replica.bucketSizes.reduce((a, n) => a + n, 0)).toBe(single.store.paramCount);
}

describe("all-reduce replicas", () => {
  test("2 ranks x batch b follow one process with batch 2b for 50 steps (<= 1e-4), with global-norm clipping; the replicas stay bit-identical", async () => {
    const cfg = config();
    const b = 32,
      lr = 0.05;
    const rs = ranks(cfg, { lr });
    const { ctx, single, train } = singleProcess(cfg, imagePlan, lr);
    try {
      let clipped = 0;
      const worst = await stepBeside(rs, train, batch, { steps: 50, b }, (results, whole) => {
        expect(results[0]!.gradNorm).toBe(results[1]!.gradNorm); // one averaged gradient on every rank
        if (whole.gradNorm > cfg.gradClip) clipped++;
      });
      expect(worst).toBeLessThanOrEqual(1e-4);
      expect(clipped).toBeGreaterThan(0); // the clip was exercised
      expectReplicasMatch(rs, single);
      // several buckets (2 KB: the last layer and its bias, then the first layer), cut in backward order
      expect(rs[0]!.replica.bucketSizes).toEqual([640 + 10, 64 + 784 * 64]);
      await Promise.all(rs.map((r) => r.replica.checkReplicas(50)));
    } finally {
      closeRanks(rs);
      ctx.dispose();
    }
  }, 60_000);

  test("a GPT (AdamW, tied embedding, clipping): 2 ranks x 4 windows follow one process with 8 windows for 20 steps (<= 1e-4); several buckets", async () => {
    const cfg = parseJobConfig({
      ...gptJobDefaults,
      job: "replica-gpt",
      sync: "allreduce",
      trainers: 2,
      bucketMb: 0.02,
      chunkBytes: 16 << 10,
      model: { ...gptJobDefaults.model, nLayer: 2, nHead: 2, nEmbd: 32, blockSize: 16 },
    });
    const V = 20,
      T = 16,
      b = 4,
      lr = 3e-3;
    const plan = { vocabSize: V, vocab: [] as number[] };
    const rng = new Rng(5);
    const stream = Int32Array.from({ length: 40 * 2 * b * (T + 1) }, () => rng.int(V));
    const windows = (from: number, n: number): HostBatch => {
      const inputs = new Int32Array(n * T),
        targets = new Int32Array(n * T);
      for (let w = 0; w < n; w++) {
        inputs.set(stream.subarray((from + w) * (T + 1), (from + w) * (T + 1) + T), w * T);
        targets.set(stream.subarray((from + w) * (T + 1) + 1, (from + w + 1) * (T + 1)), w * T);
      }
      return { inputs, inputShape: [n, T], targets, targetShape: [n, T] };
    };
    const rs = replicaRanks(cfg, { bus: sharedBus, plan, progressTimeoutMs: 5_000, lr });
    expect(cfg.optimizer.kind).toBe("adamw");
    const { ctx, single, train } = singleProcess(cfg, plan, lr);
    try {
      expect(await stepBeside(rs, train, windows, { steps: 20, b })).toBeLessThanOrEqual(1e-4);
      expectReplicasMatch(rs, single);
      expect(rs[0]!.replica.bucketSizes.length).toBeGreaterThan(1);
    } finally {
      closeRanks(rs);
      ctx.dispose();
    }
  }, 60_000);

  test("a rank without samples (the epoch's short last step) still reduces, and the step weighs each sample once", async () => {
    const cfg = config({ gradClip: 0 });
    const rs = ranks(cfg, { lr: 0.1 });
    const { ctx, single, train } = singleProcess(cfg, imagePlan, 0.1);
    try {
      const only = batch(0, 3);
      const whole = train.run([only]);
      const [r0] = await Promise.all([rs[0]!.replica.step(0, [only], 3, 3), rs[1]!.replica.step(0, [], 0, 3)]);
      expect(relDiff(r0!.gradNorm, whole.gradNorm)).toBeLessThan(1e-5);
      const ref = single.store.readValues(),
        p1 = rs[1]!.model.store.readValues();
      for (let i = 0; i < ref.length; i += 97) expect(Math.abs(p1[i]! - ref[i]!)).toBeLessThan(1e-6);
    } finally {
      closeRanks(rs);
      ctx.dispose();
    }
  });

  test("a rank that takes its topology late loses none of the pieces its faster peers already sent (2 hosts x 2, hierarchical)", async () => {
    // the race CI hit: ranks 0-2 had their labels and sent step 0's pieces while rank 3 was still
    // reading service discovery; its first communicator took them as early, the rebuilt one never
    // saw them, and the step hung until the progress timeout
    const cfg = config({ trainers: 4 });
    const rs = ranks(cfg, { lr: 0.05 });
    const hosts = ["a", "a", "b", "b"];
    try {
      const steps = rs.slice(0, 3).map((r, rank) => {
        r.replica.useTopology(hosts);
        const mine = batch(rank * 16, 16);
        return r.replica.step(0, [mine], 16, 64);
      });
      await Bun.sleep(300); // the others' first pieces are out (and retried: no one listens yet)
      rs[3]!.replica.useTopology(hosts);
      const last = batch(3 * 16, 16);
      const results = await Promise.all([...steps, rs[3]!.replica.step(0, [last], 16, 64)]);
      expect(new Set(results.map((x) => x.gradNorm)).size).toBe(1);
      expect(rs[3]!.replica.hostCount).toBe(2);
      const values = rs.map((r) => Buffer.from(r.model.store.readValues().buffer));
      for (const v of values) expect(v.equals(values[0]!)).toBe(true);
      // the topology is fixed once the communicator has been used
      expect(() => rs[0]!.replica.useTopology(hosts)).toThrow("before the communicator's first use");
    } finally {
      closeRanks(rs);
    }
  }, 30_000);

  test("a replica that differs is caught by the hash check on every rank", async () => {
    const cfg = config();
    const rs = ranks(cfg);
    try {
      await Promise.all(rs.map((r) => r.replica.checkReplicas(0)));
      const v = rs[1]!.model.store.readValues();
      v[5] = v[5]! + 1e-7;
      rs[1]!.model.store.writeValues(v);
      const outcomes = await Promise.allSettled(rs.map((r) => r.replica.checkReplicas(1)));
      for (const o of outcomes) {
        expect(o.status).toBe("rejected");
        expect((o as PromiseRejectedResult).reason).toBeInstanceOf(ReplicaDivergedError);
        expect(String((o as PromiseRejectedResult).reason.message)).toContain("rank 1");
      }
    } finally {
      closeRanks(rs);
    }
  });

  test("snapshot parts: exported under the size limit, hostile parts refused without a change, a restore continues on the same trajectory", async () => {
    const cfg = config({ optimizer: { kind: "adamw", beta1: 0.9, beta2: 0.999, eps: 1e-8, weightDecay: 0.01 } });
    const rs = ranks(cfg, { lr: 1e-3 });
    const rest = ranks(cfg, { lr: 1e-3 }); // a second pair that resumes from rank 0's snapshot
    try {
      const run = async (group: ReplicaRank[], s: number) =>
        Promise.all(
          group.map((r, rank) => {
            const mine = batch(s * 16 + rank * 8, 8);
            return r.replica.step(s, [mine], 8, 16);
          }),
        );
      for (let s = 0; s < 3; s++) await run(rs, s);
      const partBytes = 96 << 10; // 204 KB of parameters x 3 slabs: several parts
      const first = await rs[0]!.replica.exportPart(3, 0, partBytes);
      const parts = await Promise.all(
        Array.from({ length: first.parts! }, (_, p) => rs[0]!.replica.exportPart(3, p, partBytes)),
      );
      expect(parts.length).toBeGreaterThan(3);
      await expect(rs[0]!.replica.exportPart(3, parts.length, partBytes)).rejects.toThrow(BadRequestError);
      const before = rest[0]!.model.store.readValues();
      const target = rest[0]!.replica;
      const hostile = [
        { ...parts[0]!, job: "other" },
        { ...parts[0]!, generation: 0 },
        { ...parts[0]!, shard: parts.length },
        { ...parts[0]!, chunks: [{ ...parts[0]!.chunks[0]!, id: 999 }] },
        { ...parts[0]!, chunks: [{ ...parts[0]!.chunks[0]!, params: parts[0]!.chunks[0]!.params.slice(1) }] },
        {
          ...parts[0]!,
          chunks: [
            { ...parts[0]!.chunks[0]!, params: parts[0]!.chunks[0]!.params.map((v, i) => (i === 3 ? Number.NaN : v)) },
          ],
        },
        { ...parts[0]!, chunks: [{ ...parts[0]!.chunks[0]!, state: parts[0]!.chunks[0]!.state.slice(1) }] },
      ];
      for (const h of hostile)
        expect(() => target.staging.stage({ ...h, generation: h.generation ?? 5 })).toThrow(BadRequestError);
      // well-formed (checksums made to match) but no training run's: a value of 3e38, a step past the job's last
      const huge = structuredClone({ ...parts[0]!, generation: 5 });
      huge.chunks[0]!.params[1] = 3e38;
      expect(() => target.staging.stage(withChecksum(huge))).toThrow(
        "holds a value that is NaN, infinite or beyond ±1.84e+19",
      );
      expect(() => target.staging.stage(withChecksum({ ...parts[0]!, generation: 5, step: 1001 }))).toThrow(
        "replica of step 1001: job",
      );
      expect(target.staging.staged).toBeNull();
      expect(Buffer.from(rest[0]!.model.store.readValues().buffer).equals(Buffer.from(before.buffer))).toBe(true);
      // every part into both ranks of the second pair, then both pairs go on: the same parameters
      for (const r of rest) {
        // a stray part of another load (a generation far ahead) does not block this one
        r.replica.staging.stage({ ...parts[0]!, generation: 2 ** 53 - 1 });
        for (const p of parts.slice(0, -1)) r.replica.staging.stage({ ...p, generation: 5 });
        expect(r.replica.staging.staged).toBeNull(); // not complete yet
        r.replica.staging.stage({ ...parts.at(-1)!, generation: 5 });
        // the next restore's first part (a restore right after this one) leaves this load whole
        r.replica.staging.stage({ ...parts[0]!, generation: 6 });
        expect([r.replica.staging.staged, r.replica.staging.newerThan(5), r.replica.staging.newerThan(6)]).toEqual([
          { step: 3, generation: 5 },
          true,
          false,
        ]);
        expect(r.replica.apply()).toEqual({ step: 3, generation: 5 });
      }
      for (let s = 3; s < 6; s++) {
        await run(rs, s);
        await run(rest, s);
      }
      const a = rs[0]!.model.store.readValues(),
        c = rest[1]!.model.store.readValues();
      expect(Buffer.from(a.buffer).equals(Buffer.from(c.buffer))).toBe(true);
      expect(rest[0]!.replica.optimizer.stepCount).toBe(6);
    } finally {
      closeRanks(rs);
      closeRanks(rest);
    }
  });
  test("between a restore's interrupt and its reconnect, the rank's collective subject tells a sender to retry instead of having no responder", async () => {
    const cfg = config();
    const bus = new MemoryBus();
    const rs = ranks(cfg, { bus });
    const piece = new Uint8Array([1, 2, 3]);
    try {
      await Promise.all(rs.map((r) => r.replica.checkReplicas(0))); // the communicators are up
      rs[0]!.replica.interrupt();
      const between = await bus.request(`mt.${cfg.job}.coll.0.1`, piece, 1_000).catch((e: unknown) => e as Error);
      expect(between).toBeInstanceOf(CapacityError);
      expect((between as Error).message).toContain("rank 0 is between communicator generations");
      rs[0]!.replica.reconnect(1);
      // the new generation's communicator answers now (a piece that does not decode is refused as such)
      const after = await bus.request(`mt.${cfg.job}.coll.0.1`, piece, 1_000).catch((e: unknown) => e as Error);
      expect((after as Error).message).not.toContain("between communicator generations");
    } finally {
      closeRanks(rs);
    }
  });
});
