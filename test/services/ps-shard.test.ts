// Parameter-server shard logic without NATS (the hash ring and the layout: hashring.test.ts): sync policies, duplicates,
// optimizer updates against a float64 reference, snapshots, and bad pushes.
import { describe, expect, test } from "bun:test";
import { buildLayout } from "../../services/runtime/job/layout.ts";
import { ParameterShard } from "../../services/parameter-server/shard.ts";
import { BadRequestError, CorruptDataError, DeadlineError } from "../../services/runtime/mesh/errors.ts";
import { reshard } from "../../services/checkpoint/snapshot-parts.ts";
import type { DataPlan } from "../../schemas/messages/data-loader.ts";
import type { Manifest } from "../../schemas/messages/checkpoint.ts";
import { type JobConfig, jobDefaults, parseJobConfig } from "../../services/runtime/job/config.ts";
import {
  chunkF32,
  decodePullReply,
  DType,
  encodeShardState,
  f32Chunk,
  type PushRequest,
  type ShardState,
  withChecksum,
} from "../../schemas/messages/parameter-server.ts";
import { Codec, ErrorFeedback, parseCompression } from "../../engine/parallel/compress.ts";
import { chunkCodec, decodeChunk, encodeChunk } from "../../services/runtime/transport/chunk-codec.ts";
import { Rng } from "../../engine/rng.ts";
import { expectThrown } from "../helpers/errors.ts";
import { cpu, randn, relErr } from "../helpers/numeric.ts";
import { specOf } from "../helpers/jobs.ts";

const be = cpu();

function job(over: Partial<JobConfig>): JobConfig {
  return parseJobConfig({
    ...jobDefaults,
    job: "t.t",
    chunkBytes: 4096,
    schedule: "constant",
    warmupSteps: 0,
    ...over,
  });
}

/** SGD without momentum or decay: an update is p - lr g. */
const plainSgd = { kind: "sgd", momentum: 0, nesterov: false, weightDecay: 0 } as const;

function makeShard(cfg: JobConfig, total = 2500, decay = 1500) {
  const layout = buildLayout(cfg.job, total, decay, cfg.chunkBytes, 1);
  const initial = Float32Array.from(randn(new Rng(7), total, 0.1));
  const shard = new ParameterShard({ backend: be, config: cfg, layout, shard: 0, totalSteps: 100, initial });
  return { shard, layout, initial, ids: Uint32Array.from(layout.byShard[0]!) };
}

/** One trainer's full push of gradient vector g (all chunks of the shard) for a step. */
function pushAll(layout: ReturnType<typeof buildLayout>, trainer: number, step: number, g: Float32Array): PushRequest {
  return {
    job: "t.t",
    trainer,
    step,
    chunks: layout.chunks.map((c) => f32Chunk(c.id, g.slice(c.offset, c.offset + c.count))),
  };
}

async function pullAll(
  shard: ParameterShard,
  ids: Uint32Array,
  trainer: number,
  step: number,
  total: number,
): Promise<Float32Array> {
  const r = decodePullReply(await shard.pull(trainer, step, ids), 1 << 30);
  const out = new Float32Array(total);
  let at = 0;
  for (const c of r.chunks) {
    out.set(chunkF32(c), at);
    at += c.count;
  }
  return out;
}

/** `got` is `initial` less `delta` in every element (within 1e-6). */
function expectMovedBy(got: Float32Array, initial: Float32Array, delta: number): void {
  expect(
    relErr(
      got,
      initial.map((x) => x - delta),
    ),
  ).toBeLessThan(1e-6);
}

/** A push of `make(layout)` to a fresh shard is refused, naming `fragment`, and changes nothing. */
async function expectPushRefused(
  cfg: JobConfig,
  make: (l: ReturnType<typeof buildLayout>) => PushRequest,
  fragment: string,
): Promise<void> {
  const { shard, layout, initial, ids } = makeShard(cfg);
  expectThrown(() => shard.push(make(layout)), BadRequestError, fragment);
  expect(await pullAll(shard, ids, 0, 0, initial.length)).toEqual(initial);
  expect(shard.clocks).toEqual([0, 0]);
  shard.dispose();
}

describe("BSP", () => {
  test("the W pushes of a step are averaged into one SGD update (float64 reference, Nesterov, decay on the first 1500)", async () => {
    const cfg = job({
      trainers: 2,
      sync: "bsp",
      lr: 0.1,
      optimizer: { kind: "sgd", momentum: 0.9, nesterov: true, weightDecay: 0.01 },
    });
    const { shard, layout, initial, ids } = makeShard(cfg);
    const n = initial.length;
    const p = Float64Array.from(initial),
      buf = new Float64Array(n);
    for (let step = 0; step < 3; step++) {
      const g0 = Float32Array.from(randn(new Rng(100 + step), n)),
        g1 = Float32Array.from(randn(new Rng(200 + step), n));
      expect(shard.push(pushAll(layout, 0, step, g0))).toEqual({
        accepted: layout.chunks.length,
        duplicates: 0,
        updates: 0,
      });
      expect(shard.push(pushAll(layout, 1, step, g1))).toEqual({
        accepted: layout.chunks.length,
        duplicates: 0,
        updates: layout.chunks.length,
      });
      for (let i = 0; i < n; i++) {
        const g = (g0[i]! + g1[i]!) / 2 + (i < 1500 ? 0.01 * p[i]! : 0);
        buf[i] = step === 0 ? g : 0.9 * buf[i]! + g;
        p[i] = p[i]! - 0.1 * (g + 0.9 * buf[i]!);
      }
      expect(relErr(await pullAll(shard, ids, 0, step + 1, n), p)).toBeLessThan(1e-5);
    }
    expect(shard.updates).toBe(3 * layout.chunks.length);
    shard.dispose();
  });

  test("AdamW with bias correction matches the float64 reference", async () => {
    const o = { kind: "adamw" as const, beta1: 0.9, beta2: 0.99, eps: 1e-8, weightDecay: 0.1 };
    const cfg = job({ trainers: 1, sync: "bsp", lr: 0.01, optimizer: o });
    const { shard, layout, initial, ids } = makeShard(cfg);
    const n = initial.length;
    const p = Float64Array.from(initial),
      m = new Float64Array(n),
      v = new Float64Array(n);
    for (let step = 0; step < 3; step++) {
      const g = Float32Array.from(randn(new Rng(300 + step), n));
      shard.push(pushAll(layout, 0, step, g));
      const t = step + 1;
      for (let i = 0; i < n; i++) {
        m[i] = 0.9 * m[i]! + 0.1 * g[i]!;
        v[i] = 0.99 * v[i]! + 0.01 * g[i]! * g[i]!;
        const mh = m[i]! / (1 - 0.9 ** t),
          vh = v[i]! / (1 - 0.99 ** t);
        p[i] = p[i]! - 0.01 * ((i < 1500 ? 0.1 * p[i]! : 0) + mh / (Math.sqrt(vh) + 1e-8));
      }
    }
    expect(relErr(await pullAll(shard, ids, 0, 3, n), p)).toBeLessThan(1e-5);
    shard.dispose();
  });

  test("a pull for step s waits until every trainer pushed step s-1; a duplicated push is applied once", async () => {
    const cfg = job({ trainers: 2, sync: "bsp", optimizer: plainSgd, lr: 1 });
    const { shard, layout, initial, ids } = makeShard(cfg);
    const g = new Float32Array(initial.length).fill(1);
    shard.push(pushAll(layout, 0, 0, g));
    expect(shard.push(pushAll(layout, 0, 0, g))).toEqual({ accepted: 0, duplicates: layout.chunks.length, updates: 0 });
    let done = false;
    const pending = pullAll(shard, ids, 0, 1, initial.length).then((v) => ((done = true), v));
    await Bun.sleep(0);
    expect(done).toBe(false);
    expect(shard.waiting).toBe(1);
    shard.push(pushAll(layout, 1, 0, g));
    const after = await pending;
    // one update with the mean gradient 1 and lr 1: p - 1 (a double-applied push would give p - 1.5)
    expectMovedBy(after, initial, 1);
    expect(shard.waiting).toBe(0);
    shard.dispose();
  });

  test("the same pull asked again while it waits (its first ask lost on the way) is one waiter, and both asks get the parameters", async () => {
    const cfg = job({ trainers: 2, sync: "bsp", optimizer: plainSgd, lr: 1 });
    const { shard, layout, initial, ids } = makeShard(cfg);
    const g = new Float32Array(initial.length).fill(1);
    shard.push(pushAll(layout, 0, 0, g));
    const asks = [0, 1, 2].map(() => pullAll(shard, ids, 0, 1, initial.length));
    await Bun.sleep(0);
    expect(shard.waiting).toBe(1);
    // another trainer's pull of the step is a waiter of its own
    const other = pullAll(shard, ids, 1, 1, initial.length);
    await Bun.sleep(0);
    expect(shard.waiting).toBe(2);
    shard.push(pushAll(layout, 1, 0, g));
    for (const v of [...(await Promise.all(asks)), await other]) expectMovedBy(v, initial, 1);
    expect(shard.waiting).toBe(0);
    shard.dispose();
  });
});

describe("BSP with global-norm clipping", () => {
  test("two shards agree on the norm of the averaged gradient and clip by it before they apply (float64 reference)", async () => {
    const cfg = job({ trainers: 2, sync: "bsp", lr: 0.1, gradClip: 0.5, optimizer: plainSgd });
    const total = 2500;
    const layout = buildLayout(cfg.job, total, 1500, cfg.chunkBytes, 2);
    expect(layout.byShard.every((ids) => ids.length > 0)).toBe(true);
    const initial = Float32Array.from(randn(new Rng(7), total, 0.1));
    const shards: ParameterShard[] = [];
    const agree = (k: number) => async (step: number, own: number) => {
      const other = await shards[1 - k]!.partialNorm(step, 5_000);
      return Math.sqrt(k === 0 ? own + other : other + own);
    };
    for (const k of [0, 1])
      shards.push(
        new ParameterShard({
          backend: be,
          config: cfg,
          layout,
          shard: k,
          totalSteps: 100,
          initial,
          agreeNorm: agree(k),
        }),
      );
    const p = Float64Array.from(initial);
    const push = (k: number, trainer: number, step: number, g: Float32Array) =>
      shards[k]!.push({
        job: "t.t",
        trainer,
        step,
        chunks: layout.byShard[k]!.map((id) =>
          f32Chunk(id, g.slice(layout.chunks[id]!.offset, layout.chunks[id]!.offset + layout.chunks[id]!.count)),
        ),
      });
    for (let step = 0; step < 3; step++) {
      const g0 = Float32Array.from(randn(new Rng(100 + step), total, 0.02)),
        g1 = Float32Array.from(randn(new Rng(200 + step), total, 0.02));
      for (const k of [0, 1])
        for (const [t, g] of [
          [0, g0],
          [1, g1],
        ] as const)
          push(k, t, step, g);
      let sq = 0;
      for (let i = 0; i < total; i++) sq += ((g0[i]! + g1[i]!) / 2) ** 2;
      const norm = Math.sqrt(sq),
        scale = norm > cfg.gradClip ? cfg.gradClip / (norm + 1e-6) : 1;
      for (let i = 0; i < total; i++) p[i] = p[i]! - 0.1 * scale * ((g0[i]! + g1[i]!) / 2);
      const got = new Float32Array(total);
      for (const k of [0, 1]) {
        const ids = Uint32Array.from(layout.byShard[k]!);
        const r = decodePullReply(await shards[k]!.pull(0, step + 1, ids), 1 << 30);
        r.chunks.forEach((c, i) => got.set(chunkF32(c), layout.chunks[ids[i]!]!.offset));
        expect(relErr(Float64Array.of(shards[k]!.lastNorm), Float64Array.of(norm))).toBeLessThan(1e-6);
      }
      expect(scale).toBeLessThan(1); // the clip acted
      expect(relErr(got, p)).toBeLessThan(1e-5);
      expect(shards[0]!.lastNorm).toBe(shards[1]!.lastNorm); // the same bits on every shard
    }
    expect(() => makeShard(job({ sync: "bsp" })).shard.partialNorm(0, 10)).toThrow(BadRequestError);
    for (const s of shards) s.dispose();
  });

  test("a shard waits for every push of the step before it gives its part of the norm", async () => {
    const cfg = job({ trainers: 2, sync: "bsp", gradClip: 1 });
    const { shard, layout } = makeShard(cfg);
    const part = shard.partialNorm(0, 5_000);
    let done = false;
    void part.then(() => (done = true));
    const g = Float32Array.from(randn(new Rng(1), 2500, 0.01));
    shard.push(pushAll(layout, 0, 0, g));
    shard.flush();
    await Bun.sleep(10);
    expect(done).toBe(false);
    shard.push(pushAll(layout, 1, 0, g));
    shard.flush();
    let sq = 0;
    for (const v of g) sq += v * v;
    expect(relErr(Float64Array.of(await part), Float64Array.of(sq))).toBeLessThan(1e-5);
    await expect(shard.partialNorm(5, 20)).rejects.toBeInstanceOf(DeadlineError);
    shard.dispose();
  });

  test("a norm or a pull of a step the job does not have is refused at once; waiting norms end with the shard", async () => {
    const cfg = job({ trainers: 2, sync: "bsp", gradClip: 1 });
    const { shard, layout } = makeShard(cfg); // 100 steps
    // no push comes for step 100 (the last pull's): its norm would only wait out its timeout
    for (const step of [100, 2 ** 40, -1, 0.5, Number.NaN])
      expectThrown(() => shard.partialNorm(step, 5_000), BadRequestError, "runs steps 0 to 99");
    for (const step of [101, 2 ** 40, -1, 0.5, Number.NaN]) {
      expectThrown(
        () => shard.pull(0, step, Uint32Array.of(layout.byShard[0]![0]!)),
        BadRequestError,
        "runs steps 0 to 100",
      );
    }
    const waiting = shard.partialNorm(99, 60_000);
    shard.dispose();
    await expect(waiting).rejects.toBeInstanceOf(DeadlineError);
  });
});

describe("ASP and SSP", () => {
  test("ASP applies each push on arrival and never makes a pull wait", async () => {
    const cfg = job({ trainers: 2, sync: "asp", optimizer: plainSgd, lr: 0.5 });
    const { shard, layout, initial, ids } = makeShard(cfg);
    const g = new Float32Array(initial.length).fill(1);
    for (let s = 0; s < 3; s++) expect(shard.push(pushAll(layout, 0, s, g)).updates).toBe(layout.chunks.length);
    const p = await pullAll(shard, ids, 1, 0, initial.length);
    expectMovedBy(p, initial, 1.5);
    shard.dispose();
  });

  test("ASP with update batching applies one averaged update per 2 pushes", async () => {
    const cfg = job({ trainers: 2, sync: "asp", batchPushes: 2, optimizer: plainSgd, lr: 1 });
    const { shard, layout, initial, ids } = makeShard(cfg);
    expect(shard.push(pushAll(layout, 0, 0, new Float32Array(initial.length).fill(1))).updates).toBe(0);
    expect(shard.push(pushAll(layout, 1, 0, new Float32Array(initial.length).fill(3))).updates).toBe(
      layout.chunks.length,
    );
    expectMovedBy(await pullAll(shard, ids, 0, 1, initial.length), initial, 2);
    shard.dispose();
  });

  test("SSP lets a trainer run `staleness` steps ahead of the slowest, then its pull waits", async () => {
    const cfg = job({ trainers: 2, sync: "ssp", staleness: 2 });
    const { shard, layout, initial, ids } = makeShard(cfg);
    const g = new Float32Array(initial.length).fill(0.01);
    for (let s = 0; s < 3; s++) {
      await shard.pull(0, s, ids); // steps 0, 1, 2: at most 2 ahead of trainer 1 (clock 0)
      shard.push(pushAll(layout, 0, s, g));
    }
    expect(shard.clocks).toEqual([3, 0]);
    let done = false;
    const p = shard.pull(0, 3, ids).then(() => (done = true));
    await Bun.sleep(0);
    expect(done).toBe(false);
    shard.push(pushAll(layout, 1, 0, g));
    await p;
    expect(done).toBe(true);
    shard.dispose();
  });

  test.each(["ssp", "asp"] as const)(
    "%s: a push sent before a restore that arrives after the load (a step past the trainer's clock) is refused and changes nothing; the restored run's pushes of those steps are taken",
    async (sync) => {
      const cfg = job({ trainers: 2, sync, staleness: 3, optimizer: plainSgd, lr: 0.5 });
      const { shard, layout, initial, ids } = makeShard(cfg);
      const g = new Float32Array(initial.length).fill(1);
      const atTwo = () => {
        for (let s = 0; s < 2; s++) for (const t of [0, 1]) shard.push(pushAll(layout, t, s, g));
      };
      atTwo();
      const snapshot = shard.exportState(); // the newest snapshot: step 2
      for (const t of [0, 1]) shard.push(pushAll(layout, t, 2, g));
      shard.importState(snapshot); // a restore to step 2, while trainer 1's push of step 3 is on its way
      expect(shard.clocks).toEqual([2, 2]);
      expectThrown(() => shard.push(pushAll(layout, 1, 3, g)), BadRequestError, "from before a restore");
      expect(shard.clocks).toEqual([2, 2]);
      expect(shard.exportState()).toEqual(snapshot);
      // the restored run: its pushes of steps 2 and 3 are fresh, not duplicates of the old run's
      for (const s of [2, 3])
        for (const t of [0, 1])
          expect(shard.push(pushAll(layout, t, s, g))).toEqual({
            accepted: layout.chunks.length,
            duplicates: 0,
            updates: layout.chunks.length,
          });
      // 8 pushes of 1 at lr 0.5, one SGD update each (without momentum or decay)
      expectMovedBy(await pullAll(shard, ids, 0, 4, initial.length), initial, 4);
      shard.dispose();
    },
  );
});

describe("bad pushes are rejected before anything changes", () => {
  const cfg = job({ trainers: 2, sync: "bsp" });

  test.each([
    [
      "an unknown chunk",
      (l: ReturnType<typeof buildLayout>) => ({
        job: "t.t",
        trainer: 0,
        step: 0,
        chunks: [f32Chunk(999, new Float32Array(4))],
      }),
      "not owned",
    ],
    [
      "a wrong element count",
      (l: ReturnType<typeof buildLayout>) => ({
        job: "t.t",
        trainer: 0,
        step: 0,
        chunks: [f32Chunk(l.chunks[0]!.id, new Float32Array(7))],
      }),
      "7 elements",
    ],
    [
      "a trainer outside the job",
      (l: ReturnType<typeof buildLayout>) => ({ ...pushAll(l, 5, 0, new Float32Array(2500)) }),
      "trainer 5",
    ],
    [
      "a NaN gradient",
      (l: ReturnType<typeof buildLayout>) => pushAll(l, 0, 0, new Float32Array(2500).fill(Number.NaN)),
      "NaN or Inf",
    ],
    [
      "one Inf in the last chunk",
      (l: ReturnType<typeof buildLayout>) =>
        pushAll(
          l,
          0,
          0,
          new Float32Array(2500).map((_, i) => (i === 2499 ? Infinity : 0)),
        ),
      "chunk 2 ",
    ],
    ["a step ahead of BSP", (l: ReturnType<typeof buildLayout>) => pushAll(l, 0, 3, new Float32Array(2500)), "step 3"],
  ])("%s", (_, make, fragment) => expectPushRefused(cfg, make, fragment));

  test("pulls of unknown chunks or with a repeated chunk", () => {
    const { shard } = makeShard(cfg);
    expectThrown(() => shard.pull(0, 0, Uint32Array.of(999)), BadRequestError, "chunk 999");
    expectThrown(() => shard.pull(0, 0, Uint32Array.of(0, 0)), BadRequestError, "twice");
    shard.dispose();
  });
});

describe("snapshots", () => {
  /** Two shards of one AdamW job with one trainer: one trains, the other takes its state. */
  const adamwShards = () => {
    const adamw = { kind: "adamw", beta1: 0.9, beta2: 0.999, eps: 1e-8, weightDecay: 0.01 } as const;
    const cfg = job({ trainers: 1, sync: "bsp", optimizer: adamw, lr: 0.01 });
    return [makeShard(cfg), makeShard(cfg)] as const;
  };

  test("export then import into a fresh shard restores parameters, optimizer state and versions", async () => {
    const [a, b] = adamwShards();
    for (let s = 0; s < 2; s++) a.shard.push(pushAll(a.layout, 0, s, Float32Array.from(randn(new Rng(s), 2500))));
    const state = a.shard.exportState();
    b.shard.importState(state);
    const g = Float32Array.from(randn(new Rng(9), 2500));
    a.shard.push(pushAll(a.layout, 0, 2, g));
    b.shard.push(pushAll(b.layout, 0, 2, g));
    expect(await pullAll(b.shard, b.ids, 0, 3, 2500)).toEqual(await pullAll(a.shard, a.ids, 0, 3, 2500));
    expect(b.shard.exportState()).toEqual(a.shard.exportState());
    a.shard.dispose();
    b.shard.dispose();
  });

  test("a snapshot for another job, or with missing state, is refused and changes nothing", async () => {
    const cfg = job({ trainers: 1, sync: "bsp" });
    const { shard, initial, ids } = makeShard(cfg);
    const s = shard.exportState();
    expectThrown(() => shard.importState({ ...s, job: "t.other" }), BadRequestError, "other");
    expectThrown(() => shard.importState({ ...s, chunks: s.chunks.slice(1) }), BadRequestError, "owns");
    const noState = { ...s, chunks: s.chunks.map((c) => ({ ...c, state: [] })) };
    expectThrown(() => shard.importState(noState), BadRequestError, "momentum");
    expect(await pullAll(shard, ids, 0, 0, initial.length)).toEqual(initial);
    shard.dispose();
  });

  test("a state larger than a message travels in parts of one moment, and a restore applies them together after the last", async () => {
    const [a, b] = adamwShards();
    a.shard.push(pushAll(a.layout, 0, 0, Float32Array.from(randn(new Rng(3), 2500))));
    // 4 KB chunks of 3 vectors: 12 KB each, so an 84 KB limit (less the 64 KB overhead) takes 1 per part
    const limit = (64 + 20) << 10;
    // the cut: its head names the parts and carries no chunks; the parts are of its moment
    const head = a.shard.cut(1, limit);
    expect([head.chunks.length, head.step]).toEqual([0, 1]);
    const first = a.shard.exportPart(0, 1, limit);
    expect(first.parts).toBe(head.parts);
    const parts = [first];
    // a push between the asks does not reach the later parts: they are cut from the cut's moment
    a.shard.push(pushAll(a.layout, 0, 1, Float32Array.from(randn(new Rng(4), 2500))));
    for (let p = 1; p < first.parts!; p++) parts.push(a.shard.exportPart(p, 1, limit));
    expect(first.parts).toBeGreaterThan(1);
    expect(parts.map((s) => s.part)).toEqual([...Array(first.parts).keys()]);
    expectThrown(() => a.shard.exportPart(1, 1, limit), BadRequestError, "cut it first");
    const before = b.shard.exportState();
    // a part changed after it was cut, or holding a NaN, is refused; nothing is applied before the last part
    expectThrown(() => b.shard.loadPart({ ...parts[0]!, step: 5 }), BadRequestError, "checksum");
    const nan = structuredClone(parts[0]!);
    nan.chunks[0]!.state[1]!.data[3] = Number.NaN;
    expectThrown(() => b.shard.loadPart(withChecksum(nan)), BadRequestError, "NaN");
    // finite, but no training run holds it (3e38, the attack's plant): refused, naming the chunk
    const huge = structuredClone(parts[0]!);
    huge.chunks[0]!.params[0] = 3e38;
    expectThrown(
      () => b.shard.loadPart(withChecksum(huge)),
      BadRequestError,
      `snapshot chunk ${huge.chunks[0]!.id} holds a value that is NaN, infinite or beyond ±1.84e+19`,
    );
    const edge = structuredClone(parts[0]!);
    edge.chunks[0]!.state[0]!.data[0] = -(2 ** 64) * 1.0000001;
    expectThrown(() => b.shard.loadPart(withChecksum(edge)), BadRequestError, "beyond");
    parts.slice(0, -1).forEach((s, i) => expect(b.shard.loadPart(s)).toBe(parts.length - 1 - i));
    // a last part of another moment (its counters differ) does not complete them: it starts over
    const other = withChecksum({ ...parts.at(-1)!, updates: parts.at(-1)!.updates + 1 });
    expect(b.shard.loadPart(other)).toBe(parts.length - 1);
    parts.slice(0, -1).forEach((s) => b.shard.loadPart(s));
    expect(b.shard.exportState()).toEqual(before);
    expect(b.shard.loadPart(parts.at(-1)!)).toBe(0);
    const whole = b.shard.exportState();
    expect(whole.chunks).toEqual(parts.flatMap((s) => s.chunks));
    expect(whole.step).toBe(1);
    a.shard.dispose();
    b.shard.dispose();
  });

  test("a shard that owns no chunks answers one part with none, and loads it", () => {
    const cfg = job({ trainers: 1, sync: "bsp", shards: 2 });
    const layout = buildLayout(cfg.job, 100, 50, cfg.chunkBytes, 2);
    const empty = layout.byShard.findIndex((ids) => ids.length === 0);
    expect(empty).toBeGreaterThanOrEqual(0);
    const shard = new ParameterShard({
      backend: be,
      config: cfg,
      layout,
      shard: empty,
      totalSteps: 10,
      initial: new Float32Array(100),
    });
    const s = shard.exportPart(0, 0, 1 << 20);
    expect([s.parts, s.part, s.chunks.length]).toEqual([1, 0, 0]);
    expect(shard.loadPart(s)).toBe(0);
    shard.dispose();
  });

  test("a job with a shard that owns no chunks: its snapshot is of one step, resharded and restored (the empty shard's clocks never move)", () => {
    const cfg = job({ trainers: 1, sync: "bsp", shards: 2 });
    const total = 100;
    const layout = buildLayout(cfg.job, total, 50, cfg.chunkBytes, 2);
    const empty = layout.byShard.findIndex((ids) => ids.length === 0);
    const owner = 1 - empty;
    /** the job's two shards, each at the seed's parameters (zeros) */
    const twoShards = () =>
      [0, 1].map(
        (k) =>
          new ParameterShard({
            backend: be,
            config: cfg,
            layout,
            shard: k,
            totalSteps: 10,
            initial: new Float32Array(total),
          }),
      );
    const shards = twoShards();
    // trainers push to the shards that own chunks only
    for (let step = 0; step < 3; step++)
      shards[owner]!.push(pushAll(layout, 0, step, Float32Array.from(randn(new Rng(step), total))));
    expect([shards[owner]!.clocks, shards[empty]!.clocks]).toEqual([[3], [0]]);
    // the snapshot of step 3: the empty shard's state is of the step asked
    const parts = shards.map((sh) => sh.exportPart(0, 3, 1 << 20));
    expect(parts.map((p) => p.step)).toEqual([3, 3]);
    const plan = { slabNumel: total, decayElems: 50 } as DataPlan;
    const files = (states: ShardState[]) =>
      new Map(states.map((st, k) => [`ps-${k}-0.mtss`, encodeShardState(withChecksum(st))]));
    const manifest = { id: "step-000000003" } as Manifest;
    const loads = reshard(cfg, plan, manifest, files(parts), 1 << 20);
    expect(loads.map((l) => l.map((p) => p.step))).toEqual([[3], [3]]);
    // a snapshot written before this (the empty shard's state said step 0) restores too
    const legacy = reshard(
      cfg,
      plan,
      manifest,
      files(parts.map((p, k) => (k === empty ? { ...p, step: 0, optimizerSteps: 0 } : p))),
      1 << 20,
    );
    expect(legacy.map((l) => l.map((p) => p.step))).toEqual([[3], [3]]);
    // fresh shards take the loads; the restored parameters are the trained ones
    const fresh = twoShards();
    for (const k of [0, 1]) for (const part of loads[k]!) fresh[k]!.loadPart(part);
    expect(fresh[owner]!.exportState().chunks).toEqual(shards[owner]!.exportState().chunks);
    expect(fresh.map((sh) => sh.clocks)).toEqual([[3], [3]]);
    // states of two steps among the shards that own chunks are still refused
    const cfg3 = job({ trainers: 1, sync: "bsp", shards: 1 });
    expect(() =>
      reshard(
        cfg3,
        plan,
        manifest,
        files([
          { ...parts[owner]!, shard: 0 },
          { ...parts[owner]!, step: 2, chunks: parts[owner]!.chunks.slice(0, 1) },
        ]),
        1 << 20,
      ),
    ).toThrow(new CorruptDataError("snapshot step-000000003: ps-1-0.mtss is of step 2, the others of 3"));
    for (const sh of [...shards, ...fresh]) sh.dispose();
  });

  test("a waiting BSP pull names the trainers it waits for", () => {
    const cfg = job({ trainers: 3, sync: "bsp" });
    const { shard, layout } = makeShard(cfg);
    shard.push(pushAll(layout, 0, 0, new Float32Array(2500)));
    shard.push(pushAll(layout, 2, 0, new Float32Array(2500)));
    expect(shard.waitingFor(1)).toBe("for trainer 1 (their pushes of step 0)");
    shard.push(pushAll(layout, 1, 0, new Float32Array(2500)));
    expect(shard.waitingFor(2)).toBe("for trainers 0, 1, 2 (their pushes of step 1)");
    shard.dispose();
  });

  test("a restore answers pulls that were waiting with a DeadlineError", async () => {
    const cfg = job({ trainers: 2, sync: "bsp" });
    const { shard, ids } = makeShard(cfg);
    const waiting = shard.pull(0, 1, ids);
    shard.importState(shard.exportState());
    await expect(waiting).rejects.toBeInstanceOf(DeadlineError);
    shard.dispose();
  });
});

describe("ParameterServer over a MemoryBus", () => {
  test("a pull whose reply would exceed the payload limit is refused with LimitExceededError; smaller pulls work", async () => {
    const { ParameterServer } = await import("../../services/parameter-server/service.ts");
    const { MemoryBus } = await import("../../services/runtime/mesh/bus.ts");
    const { LimitExceededError } = await import("../../services/runtime/mesh/errors.ts");
    const { encodePullRequest, decodePullReply } = await import("../../schemas/messages/parameter-server.ts");
    const cfg = job({ model: { kind: "mlp", widths: [784, 16, 10], dropout: 0 }, trainers: 1, shards: 1 });
    const bus = new MemoryBus();
    const ps = new ParameterServer(bus, 0, be, undefined, 16_000);
    ps.serve();
    // a spec without its plan is refused (the plan carries the step count and the layout)
    const spec = specOf(cfg);
    await expect(ps.openJob({ ...spec, plan: undefined })).rejects.toThrow("carries no plan");
    await ps.openJob(spec);
    const one = encodePullRequest({ job: "t.t", trainer: 0, step: 0, ids: Uint32Array.of(0) });
    const all = encodePullRequest({
      job: "t.t",
      trainer: 0,
      step: 0,
      ids: Uint32Array.from({ length: 12 }, (_, i) => i),
    });
    await expect(bus.request("mt.t.t.ps.0.pull.0", all, 1000)).rejects.toBeInstanceOf(LimitExceededError);
    expect(decodePullReply(await bus.request("mt.t.t.ps.0.pull.0", one, 1000), 16_000).chunks[0]!.count).toBe(1024);
    ps.stop();
    await bus.close();
  });
});

describe("compressed pushes and pulls", () => {
  const codecPush = (
    cfg: JobConfig,
    layout: ReturnType<typeof buildLayout>,
    trainer: number,
    step: number,
    g: Float32Array,
  ) => {
    const ef = new ErrorFeedback(chunkCodec(parseCompression(cfg.compress), layout.chunkElems), g.length);
    const x = g.slice();
    return {
      job: "t.t",
      trainer,
      step,
      chunks: layout.chunks.map((c) => encodeChunk(ef, c.id, x.subarray(c.offset, c.offset + c.count), c.offset)),
    };
  };

  for (const compress of ["bf16", "fp16", "int8", "topk:0.1"]) {
    test(`${compress}: the shard applies the decoded gradient (float64 reference of SGD on it), and still takes F32`, async () => {
      const cfg = job({
        trainers: 2,
        sync: "bsp",
        lr: 0.1,
        compress,
        optimizer: plainSgd,
      });
      const { shard, layout, initial, ids } = makeShard(cfg);
      const n = initial.length;
      const g0 = Float32Array.from(randn(new Rng(11), n)),
        g1 = Float32Array.from(randn(new Rng(12), n));
      const push0 = codecPush(cfg, layout, 0, 0, g0);
      // what the shard should see: each chunk decoded
      const seen = new Float32Array(n);
      for (const c of push0.chunks)
        decodeChunk(c, seen.subarray(layout.chunks[c.id]!.offset, layout.chunks[c.id]!.offset + c.count));
      shard.push(push0);
      shard.push(pushAll(layout, 1, 0, g1)); // F32 is always accepted
      const p = Float64Array.from(initial, (v, i) => v - 0.1 * ((seen[i]! + g1[i]!) / 2));
      expect(relErr(await pullAll(shard, ids, 0, 1, n), p)).toBeLessThan(1e-6);
      if (compress === "topk:0.1")
        expect(seen.filter((v) => v !== 0).length).toBe(
          layout.chunks.reduce((s, c) => s + Math.ceil(0.1 * c.count), 0),
        );
      shard.dispose();
    });
  }

  test("top-k with AdamW: the shard keeps each coordinate's age, and a gradient after 2 steps moves it 2 steps", async () => {
    const adamw = { kind: "adamw", beta1: 0.9, beta2: 0.99, eps: 1e-8, weightDecay: 0 } as const;
    const cfg = job({ trainers: 1, sync: "bsp", lr: 0.01, compress: "topk:0.1", optimizer: adamw });
    const { shard, layout, initial, ids } = makeShard(cfg);
    expect(shard.exportState().chunks[0]!.state.map((s) => s.name)).toEqual(["m", "v", "age"]);
    const n = initial.length;
    // coordinate 0: nothing at step 0, then 2 (two steps of 1); coordinate 1: 1 at each step
    shard.push(
      pushAll(
        layout,
        0,
        0,
        Float32Array.from({ length: n }, (_, i) => (i === 1 ? 1 : 0)),
      ),
    );
    shard.push(
      pushAll(
        layout,
        0,
        1,
        Float32Array.from({ length: n }, (_, i) => (i === 0 ? 2 : i === 1 ? 1 : 0)),
      ),
    );
    const p = await pullAll(shard, ids, 0, 2, n);
    // both: m and v after two steps of 1 are exactly their bias corrections, so each step moves lr
    expect(initial[0]! - p[0]!).toBeCloseTo(0.02, 6);
    expect(initial[1]! - p[1]!).toBeCloseTo(0.02, 6);
    expect(p[2]).toBe(initial[2]!);
    shard.dispose();
    const dense = makeShard(job({ trainers: 1, compress: "int8", optimizer: adamw })).shard;
    expect(dense.exportState().chunks[0]!.state.map((s) => s.name)).toEqual(["m", "v"]);
    dense.dispose();
  });

  test("a bf16 pull is the f32 master parameters rounded to bf16; the shard keeps f32", async () => {
    const cfg = job({ trainers: 1, sync: "bsp", compress: "bf16" });
    const { shard, layout, initial, ids } = makeShard(cfg);
    const r = decodePullReply(await shard.pull(0, 0, ids, DType.BF16), 1 << 30);
    const got = new Float32Array(initial.length);
    for (const c of r.chunks) {
      expect(c.dtype).toBe(DType.BF16);
      expect(c.data.byteLength).toBe(2 * c.count);
      decodeChunk(c, got.subarray(layout.chunks[c.id]!.offset, layout.chunks[c.id]!.offset + c.count));
    }
    const bf = new Codec({ kind: "bf16" });
    const s = new Uint8Array(bf.slotBytes(initial.length));
    bf.encode(initial, s);
    const ref = new Float32Array(initial.length);
    bf.decode(s, ref, false);
    expect(got).toEqual(ref);
    expect(await pullAll(shard, ids, 0, 0, initial.length)).toEqual(initial); // f32 pulls: the master copy, exact
    expectThrown(() => shard.pull(0, 0, ids, DType.I8), BadRequestError, "F32, F16 or BF16");
    shard.dispose();
  });

  describe("hostile compressed chunks are refused and change nothing", () => {
    const cfg = job({ trainers: 2, sync: "bsp", compress: "topk:0.1" });
    const topk = (l: ReturnType<typeof buildLayout>, idx: number[], values: number[], nnz = idx.length) => {
      const c = l.chunks[0]!;
      const data = new Uint8Array(8 * idx.length);
      new Uint32Array(data.buffer, 0, idx.length).set(idx);
      new Float32Array(data.buffer, 4 * idx.length, idx.length).set(values);
      return {
        job: "t.t",
        trainer: 0,
        step: 0,
        chunks: [{ id: c.id, version: 0, dtype: DType.TopK, scale: 1, count: c.count, data, nnz }],
      };
    };
    test.each([
      ["top-k indices out of range", (l: ReturnType<typeof buildLayout>) => topk(l, [1, 5000], [1, 2]), "below 1024"],
      ["top-k indices repeated", (l: ReturnType<typeof buildLayout>) => topk(l, [3, 3], [1, 2]), "ascend"],
      ["top-k indices descending", (l: ReturnType<typeof buildLayout>) => topk(l, [9, 3], [1, 2]), "ascend"],
      ["a top-k NaN value", (l: ReturnType<typeof buildLayout>) => topk(l, [3, 9], [1, Number.NaN]), "NaN or Inf"],
      [
        "a dtype the job does not push (I8 in a top-k job)",
        (l: ReturnType<typeof buildLayout>) => {
          const c = l.chunks[0]!;
          return {
            job: "t.t",
            trainer: 0,
            step: 0,
            chunks: [
              { id: c.id, version: 0, dtype: DType.I8, scale: 1, count: c.count, data: new Uint8Array(c.count) },
            ],
          };
        },
        "compress topk:0.1: F32 or TopK",
      ],
    ])("%s", (_, make, fragment) => expectPushRefused(cfg, make, fragment));

    test("an int8 chunk with a negative or infinite scale", async () => {
      const c8 = job({ trainers: 2, sync: "bsp", compress: "int8" });
      for (const scale of [-1, Infinity]) {
        const { shard, layout, initial, ids } = makeShard(c8);
        const c = layout.chunks[0]!;
        const m = {
          job: "t.t",
          trainer: 0,
          step: 0,
          chunks: [
            { id: c.id, version: 0, dtype: DType.I8, scale, count: c.count, data: new Uint8Array(c.count).fill(3) },
          ],
        };
        expectThrown(() => shard.push(m), BadRequestError, "scale");
        expect(await pullAll(shard, ids, 0, 0, initial.length)).toEqual(initial);
        shard.dispose();
      }
    });
  });
});

describe("a trainer's pushes and pulls over a MemoryBus", () => {
  test("a push or pull of many messages keeps at most psMessagesInFlight of them in flight to each shard, and every chunk arrives", async () => {
    const { ParameterServer } = await import("../../services/parameter-server/service.ts");
    const { MemoryBus } = await import("../../services/runtime/mesh/bus.ts");
    const { PsClient } = await import("../../services/trainer/ps-client.ts");
    const { psMessagesInFlight } = await import("../../services/trainer/limits.ts");
    const { planLayout } = await import("../../services/runtime/job/plan.ts");
    // 2 shards, messages of one 4 KiB chunk each: 6 messages a shard
    const cfg = job({
      model: { kind: "mlp", widths: [784, 16, 10], dropout: 0 },
      trainers: 1,
      shards: 2,
      sync: "asp",
      optimizer: plainSgd,
    });
    const spec = specOf(cfg);
    const bus = new MemoryBus();
    const servers = [0, 1].map((k) => new ParameterServer(bus, k, be, undefined, 8_000));
    for (const ps of servers) {
      ps.serve();
      await ps.openJob(spec);
    }
    const inFlight = new Map<string, number>();
    const most = new Map<string, number>();
    const request = bus.request.bind(bus);
    bus.request = async (subject: string, data: Uint8Array, timeoutMs: number) => {
      if (!subject.startsWith("mt.t.t.ps.")) return await request(subject, data, timeoutMs);
      const shard = subject.split(".").slice(0, 6).join("."); // mt.t.t.ps.<k>.<push|pull>
      inFlight.set(shard, (inFlight.get(shard) ?? 0) + 1);
      most.set(shard, Math.max(most.get(shard) ?? 0, inFlight.get(shard)!));
      try {
        await Bun.sleep(1); // the answer takes a while: the next messages would all be sent meanwhile
        return await request(subject, data, timeoutMs);
      } finally {
        inFlight.set(shard, inFlight.get(shard)! - 1);
      }
    };
    const layout = planLayout(cfg, spec.plan!);
    const client = new PsClient(bus, layout, 0, 8_000);
    const n = spec.plan!.slabNumel;
    const before = new Float32Array(n);
    await client.pull(0, before);
    const grads = Float32Array.from({ length: n }, (_, i) => (i % 7) - 3);
    const reply = await client.push(0, grads);
    expect(reply.accepted).toBe(layout.chunks.length);
    const after = new Float32Array(n);
    await client.pull(1, after);
    // ASP, plain SGD: every value moved by -lr g, so every chunk was pulled and pushed
    const lr = cfg.lr;
    let worst = 0;
    for (let i = 0; i < n; i++) worst = Math.max(worst, Math.abs(after[i]! - (before[i]! - lr * grads[i]!)));
    expect(worst).toBeLessThan(1e-6);
    const messages = layout.byShard.map((ids: number[]) => ids.length);
    expect(Math.min(...messages)).toBeGreaterThan(psMessagesInFlight);
    expect(Object.fromEntries(most)).toEqual({
      "mt.t.t.ps.0.pull": psMessagesInFlight,
      "mt.t.t.ps.0.push": psMessagesInFlight,
      "mt.t.t.ps.1.pull": psMessagesInFlight,
      "mt.t.t.ps.1.push": psMessagesInFlight,
    });
    for (const ps of servers) ps.stop();
    await bus.close();
  });
});
