// Distributed sampling and the loader's batches, without NATS.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { loadMnist } from "../../engine/data/mnist.ts";
import { DataLoader } from "../../services/data-loader/service.ts";
import { JobData, planHere } from "../../services/data-loader/loader.ts";
import { rankSlice } from "../../services/data-loader/sampler.ts";
import { loadCorpus } from "../../engine/data/corpus.ts";
import { Rng } from "../../engine/rng.ts";
import { initialParameters } from "../../services/runtime/job/model.ts";
import { changeWorld, StepSchedule, worldProblems, worldResumeProblem } from "../../services/runtime/job/world.ts";
import { type Dataset, readDataset, windowOffset } from "../../services/data-loader/sources.ts";
import { stepsPerEpochOf } from "../../services/runtime/job/plan.ts";
import { specOf } from "../helpers/jobs.ts";
import { WireFormatError } from "../../schemas/codec.ts";
import {
  decodeBatch,
  decodeDataPlan,
  decodeLoaderStats,
  encodeBatchRequest,
  Split,
} from "../../schemas/messages/data-loader.ts";
import { encodeJobRequest, SyncPolicy } from "../../schemas/messages/job.ts";
import { readTokens } from "../../engine/data/token-stream.ts";
import { readManifest, readSplit } from "../../engine/data/shards.ts";
import { prepareDefaults, runPrepare } from "../../sdk/local/prepare.ts";
import { MemoryBus } from "../../services/runtime/mesh/bus.ts";
import { BadRequestError, UnknownJobError } from "../../services/runtime/mesh/errors.ts";
import { ConfigError } from "../../ffi/errors.ts";
import { gptJobDefaults, type JobConfig, jobDefaults, parseJobConfig } from "../../services/runtime/job/config.ts";

const window = readTokens;
const mnist = loadMnist();
const images: Dataset = { kind: "mnist", data: mnist };
const cfg = (over: object) => parseJobConfig({ ...jobDefaults, job: "t.dl", ...over });

describe("distributed sampling", () => {
  test.each([
    [60_000, 2, 64],
    [1000, 3, 7],
    [10, 4, 3],
    [5, 8, 2],
  ])("N=%d W=%d B=%d: every sample exactly once per epoch, ranks disjoint", (N, W, B) => {
    const sched = new StepSchedule(N, B, [{ from: 0, trainers: W }], 1);
    expect(sched.totalSteps).toBe(stepsPerEpochOf(N, W, B));
    const seen = new Uint8Array(N);
    for (let s = 0; s < sched.totalSteps; s++) {
      for (let r = 0; r < W; r++) {
        const { start, count } = rankSlice(sched.at(s), r);
        expect(count).toBeLessThanOrEqual(B);
        for (let i = start; i < start + count; i++) seen[i]!++;
      }
    }
    expect(seen.every((x) => x === 1)).toBe(true);
  });

  test("a world that changes mid-epoch (2 -> 3 at step 5, 3 -> 2 at step 40): the rest of each epoch is re-split, every sample once per epoch", () => {
    const N = 1000,
      B = 16;
    const world = [
      { from: 0, trainers: 2 },
      { from: 5, trainers: 3 },
      { from: 40, trainers: 2 },
    ];
    const sched = new StepSchedule(N, B, world, 3);
    // epoch 0: 5 steps of 32, then steps of 48 (1000 - 160 = 840 = 17.5 x 48: 18 steps), epoch 1 ...
    expect(sched.epochStarts.slice(0, 2)).toEqual([0, 23]);
    expect(sched.at(22)).toEqual({
      epoch: 0,
      cursor: 160 + 17 * 48,
      rows: 840 - 17 * 48,
      trainers: 3,
      index: 22,
      last: true,
    });
    expect(sched.at(5).trainers).toBe(3);
    expect(sched.at(39).trainers).toBe(3);
    expect(sched.at(40).trainers).toBe(2);
    for (let e = 0; e < 3; e++) {
      const seen = new Uint8Array(N);
      const end = sched.epochStarts[e + 1] ?? sched.totalSteps;
      for (let s = sched.epochStarts[e]!; s < end; s++)
        for (let r = 0; r < 3; r++) {
          const { start, count } = rankSlice(sched.at(s), r);
          if (r >= sched.at(s).trainers) expect(count).toBe(0);
          for (let i = start; i < start + count; i++) seen[i]!++;
        }
      expect(seen.every((x) => x === 1)).toBe(true);
    }
    // the step count follows the world: 23 steps, then epochs of 2 and 3 trainers
    expect(sched.totalSteps).toBe(23 + (40 - 23) + Math.ceil((N - (40 - 23) * 48) / 32) + Math.ceil(N / 32));
    expect(() => sched.at(sched.totalSteps)).toThrow(BadRequestError);
  });

  test("a world is checked: from step 0, increasing, ending at the job's trainers", () => {
    expect(worldProblems([{ from: 0, trainers: 2 }], 2)).toEqual([]);
    expect(worldProblems([{ from: 3, trainers: 2 }], 2)).toEqual(["the world starts at step 3, not 0"]);
    expect(
      worldProblems(
        [
          { from: 0, trainers: 2 },
          { from: 0, trainers: 3 },
        ],
        3,
      )[0],
    ).toContain("is not after step 0");
    expect(worldProblems([{ from: 0, trainers: 2 }], 3)[0]).toContain("ends with 2 trainers, the job has 3");
    expect(() => cfg({ trainers: 3, world: [{ from: 0, trainers: 2 }] })).toThrow(ConfigError);
    expect(changeWorld({ trainers: 2 }, 10, 3)).toEqual([
      { from: 0, trainers: 2 },
      { from: 10, trainers: 3 },
    ]);
    // which snapshots resume a job: of the same history before their step, and not before its last change
    const two = { trainers: 2, batchSize: 64 },
      grown = {
        trainers: 3,
        batchSize: 64,
        world: [
          { from: 0, trainers: 2 },
          { from: 40, trainers: 3 },
        ],
      };
    expect(worldResumeProblem(grown, two, 40)).toBeNull(); // the snapshot the resize resumed from
    expect(worldResumeProblem(grown, grown, 90)).toBeNull();
    expect(worldResumeProblem(grown, two, 70)).toContain("it was taken with trainers"); // the old ranks' after the change
    expect(worldResumeProblem(grown, two, 20)).toContain("after this snapshot's step 20");
    expect(worldResumeProblem({ trainers: 4, batchSize: 32 }, two, 70)).toBeNull(); // the same global batch
    // a change at a step already changed replaces it; one back to the count before drops it
    expect(
      changeWorld(
        {
          trainers: 3,
          world: [
            { from: 0, trainers: 2 },
            { from: 10, trainers: 3 },
          ],
        },
        10,
        2,
      ),
    ).toEqual([{ from: 0, trainers: 2 }]);
  });

  test("a job's epochs: ids per rank are disjoint, cover the training split once, and differ between epochs", () => {
    const j = new JobData(cfg({ trainers: 3, batchSize: 500, epochs: 2, valFraction: 0.1 }), images);
    for (const epoch of [0, 1]) {
      const seen = new Set<number>();
      for (let s = 0; s < j.stepsPerEpoch; s++) {
        for (let r = 0; r < 3; r++)
          for (const id of j.trainIds(r, epoch * j.stepsPerEpoch + s)) {
            expect(seen.has(id)).toBe(false);
            seen.add(id);
          }
      }
      expect([...seen].sort((a, b) => a - b)).toEqual([...j.train]);
    }
    expect(j.trainIds(0, 0)).not.toEqual(j.trainIds(0, j.stepsPerEpoch));
    expect(j.trainIds(0, j.totalSteps).length).toBe(0);
  });

  test("resuming at step T gives exactly the batches an uninterrupted run gets from T on", () => {
    const a = new JobData(cfg({ trainers: 2, batchSize: 64 }), images);
    const b = new JobData(cfg({ trainers: 2, batchSize: 64 }), images); // a fresh loader, as after a restart
    const T = 470; // inside epoch 2
    for (let s = T; s < T + 5; s++)
      for (const r of [0, 1]) {
        expect(decodeBatch(b.next(r, Split.Train, s, 2), 1 << 24)).toEqual(
          decodeBatch(a.next(r, Split.Train, s, 2), 1 << 24),
        );
      }
  });
});

describe("loader over a MemoryBus", () => {
  const bus = new MemoryBus();
  const loader = new DataLoader(bus, { payloadBytesMax: 8 << 20, dataset: images });
  loader.serve();
  const c = cfg({ trainers: 2, batchSize: 64 });
  const opened = loader.openJob(specOf(c));
  beforeAll(() => opened);
  const ask = async (
    m: { rank?: number; split?: Split; step?: number; credits?: number; job?: string },
    subject = "mt.t.dl.data.next",
  ) =>
    decodeBatch(
      await bus.request(
        subject,
        encodeBatchRequest({ job: "t.dl", rank: 0, split: Split.Train, credits: 2, step: 0, ...m }),
        1000,
      ),
      8 << 20,
    );

  test("batches are normalized pixels and labels of the named samples; the next ones are prefetched", async () => {
    const b = await ask({ step: 0 });
    expect(b.rows).toBe(64);
    expect(b.cols).toBe(784);
    const id = b.sampleIds[5]!;
    expect(b.y[5]).toBe(mnist.train.labels[id]!);
    expect(b.x[5 * 784 + 400]).toBeCloseTo((mnist.train.images[id * 784 + 400]! / 255 - 0.1307) / 0.3081, 5);
    await Bun.sleep(10); // let the background prefetch run (it yields between batches)
    await ask({ step: 1 });
    const stats = decodeLoaderStats(
      await bus.request("mt.t.dl.data.stats", encodeJobRequest({ job: "t.dl", step: 0, tag: "" }), 1000),
      1 << 16,
    );
    expect(stats.prefetchHits).toBe(1);
    expect(stats.batches).toBe(2);
  });

  test("evaluation shares of the test split are disjoint and cover it", async () => {
    const ids: number[] = [];
    for (const rank of [0, 1]) {
      for (let i = 0; ; i++) {
        const b = await ask({ rank, split: Split.Test, step: i });
        if (b.endOfEpoch) break;
        ids.push(...b.sampleIds);
      }
    }
    expect(ids.sort((a, b) => a - b)).toEqual(Array.from({ length: 10_000 }, (_, i) => i));
  });

  test("bad requests: unknown job, rank outside the job, no validation split, garbage", async () => {
    await expect(ask({ job: "t.zz" }, "mt.t.zz.data.next")).rejects.toBeInstanceOf(UnknownJobError);
    await expect(ask({ rank: 2 })).rejects.toThrow(BadRequestError);
    await expect(ask({ split: Split.Val })).rejects.toThrow("no validation split");
    await expect(bus.request("mt.t.dl.data.next", Uint8Array.of(1, 2, 3), 1000)).rejects.toBeInstanceOf(
      WireFormatError,
    );
    expect((await ask({ step: 3 })).rows).toBe(64); // still serving
  });

  test("data.plan: the sample counts and the step count the trainers and shards schedule over", async () => {
    const plan = decodeDataPlan(
      await bus.request("mt.t.dl.data.plan", encodeJobRequest({ job: "t.dl", step: 0, tag: "" }), 1000),
      1 << 16,
    );
    expect(plan).toMatchObject({
      job: "t.dl",
      trainSamples: 60_000,
      valSamples: 0,
      testSamples: 10_000,
      stepsPerEpoch: 469,
      totalSteps: 469 * c.epochs,
      vocabSize: 0,
    });
    expect(plan.slabNumel).toBeGreaterThanOrEqual(784 * 800 + 800 + 800 * 10 + 10);
    await expect(
      bus.request("mt.t.nope.data.plan", encodeJobRequest({ job: "t.nope", step: 0, tag: "" }), 1000),
    ).rejects.toBeInstanceOf(UnknownJobError);
  });
});

describe("the loader's jobs: a limit, shared data sets, freed when their jobs close, unreadable data refused", () => {
  // the plan of the default data (a job whose folder cannot be read is refused on opening)
  const spec = (name: string, over: Partial<JobConfig> = {}) => {
    const job = `t.${name}`;
    return specOf(cfg({ ...over, job, trainers: 1 }), { plan: { ...specOf(cfg({ job, trainers: 1 })).plan!, job } });
  };

  test("jobs reading one folder share one copy; the last to close frees it; one job over the limit is refused with the reason", async () => {
    const loader = new DataLoader(new MemoryBus(), { payloadBytesMax: 8 << 20, jobsMax: 2 });
    await loader.openJob(spec("a"));
    await loader.openJob(spec("b"));
    expect(loader.datasets).toBe(1);
    await expect(loader.openJob(spec("c"))).rejects.toThrow("the data-loader serves 2 jobs already (t.a, t.b)");
    loader.closeJob("t.a");
    expect([loader.jobs, loader.datasets]).toEqual([["t.b"], 1]);
    await loader.openJob(spec("c"));
    loader.closeJob("t.b");
    loader.closeJob("t.c");
    expect([loader.jobs, loader.datasets]).toEqual([[], 0]);
  });

  test("images that do not fit the job's model are refused; the data set read for it is not held", async () => {
    // an idx folder of 2x2 images: readable, but not for a model that takes 784 inputs
    const dir = mkdtempSync(join(tmpdir(), "mt-idx-"));
    try {
      const idx = (dims: number[], data: Uint8Array) => {
        const head = new DataView(new ArrayBuffer(4 + 4 * dims.length));
        head.setUint32(0, (0x08 << 8) | dims.length, false);
        dims.forEach((d, i) => head.setUint32(4 + 4 * i, d, false));
        return Buffer.concat([new Uint8Array(head.buffer), data]);
      };
      for (const [name, dims] of [
        ["train-images-idx3-ubyte", [10, 2, 2]],
        ["t10k-images-idx3-ubyte", [10, 2, 2]],
      ] as const) {
        writeFileSync(join(dir, name), idx([...dims], new Uint8Array(40)));
      }
      for (const name of ["train-labels-idx1-ubyte", "t10k-labels-idx1-ubyte"])
        writeFileSync(join(dir, name), idx([10], new Uint8Array(10)));
      const loader = new DataLoader(new MemoryBus(), { payloadBytesMax: 8 << 20 });
      await expect(loader.openJob(spec("tiny", { dataDir: dir }))).rejects.toThrow(
        "the model takes 784 inputs, but the images in",
      );
      expect([loader.jobs, loader.datasets]).toEqual([[], 0]);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  test("a folder without the idx files is refused naming the file; nothing is held", async () => {
    const loader = new DataLoader(new MemoryBus(), { payloadBytesMax: 8 << 20 });
    await expect(loader.openJob(spec("d", { dataDir: "/nonexistent" }))).rejects.toThrow(
      "/nonexistent/train-images-idx3-ubyte: file not found",
    );
    expect([loader.jobs, loader.datasets]).toEqual([[], 0]);
  });
});

describe("trainer micro-batches", () => {
  test("a batch cut into k micro-batches keeps every row once, in order; a short batch into fewer", async () => {
    const { microBatches } = await import("../../services/trainer/batches.ts");
    const b = {
      epoch: 0,
      index: 0,
      sampleIds: new Uint32Array(10),
      rows: 10,
      cols: 3,
      x: Float32Array.from({ length: 30 }, (_, i) => i),
      y: Int32Array.from({ length: 10 }, (_, i) => i),
      endOfEpoch: false,
    };
    const m = microBatches(b, 4);
    expect(m.map((x) => x.targetShape[0])).toEqual([3, 3, 3, 1]);
    expect(m.flatMap((x) => [...x.targets])).toEqual([...b.y]);
    expect(m.flatMap((x) => [...x.inputs])).toEqual([...b.x]);
    expect(microBatches({ ...b, rows: 2, x: b.x.subarray(0, 6), y: b.y.subarray(0, 2) }, 4)).toHaveLength(2);
  });
});

describe("token windows (the gpt's data)", () => {
  // a text whose every position is recognizable: its characters cycle through a small alphabet
  const dir = mkdtempSync(join(tmpdir(), "mt-text-"));
  const file = join(dir, "t.txt");
  const alphabet = "abcdefghij \n";
  const rng = new Rng(3);
  writeFileSync(file, Array.from({ length: 4000 }, () => alphabet[rng.int(alphabet.length)]).join(""));
  const T = 8;
  const gcfg = (over: object = {}) =>
    parseJobConfig({
      ...gptJobDefaults,
      job: "t.tw",
      dataDir: file,
      trainers: 3,
      batchSize: 5,
      epochs: 3,
      model: { ...gptJobDefaults.model, blockSize: T },
      ...over,
    });
  const corpus = loadCorpus({ text: file, valFraction: 0.1 });
  afterAll(() => rmSync(dir, { recursive: true, force: true }));

  test("the plan: windows at every offset, the vocabulary's characters, the model's layout", () => {
    const cfg = gcfg();
    const plan = planHere(cfg);
    const windows = Math.floor((corpus.train.length - T) / T);
    expect(plan).toMatchObject({
      trainSamples: windows,
      valSamples: Math.floor((corpus.val.length - 1) / T),
      testSamples: 0,
      stepsPerEpoch: Math.ceil(windows / 15),
    });
    expect(plan.vocab.map((c) => String.fromCodePoint(c)).join("")).toBe([...alphabet].sort().join(""));
    expect(plan.vocabSize).toBe(alphabet.length);
    expect(planHere(gcfg({ maxSteps: 7 })).totalSteps).toBe(7);
    // the vector the trainers will build: embeddings of the 12 characters and the 64 positions' rows among them
    const init = initialParameters(cfg, plan);
    expect([plan.slabNumel, plan.decayElems, plan.paramCount]).toEqual([
      init.values.length,
      init.decayElems,
      init.paramCount,
    ]);
  });

  test("every epoch visits each window once across the ranks, at an offset of its own; rows are T+1 consecutive tokens", () => {
    const cfg = gcfg();
    const j = new JobData(cfg, readDataset(cfg));
    const offsets: number[] = [];
    for (let epoch = 0; epoch < 3; epoch++) {
      const seen = new Set<number>();
      const off = windowOffset(cfg.seed, epoch, T);
      offsets.push(off);
      for (let s = 0; s < j.stepsPerEpoch; s++) {
        for (let r = 0; r < 3; r++) {
          const b = decodeBatch(j.next(r, Split.Train, epoch * j.stepsPerEpoch + s, 0), 1 << 24);
          expect([b.cols, b.x.length, b.y.length, b.tokens!.length]).toEqual([T, 0, 0, b.rows * (T + 1)]);
          b.sampleIds.forEach((id, row) => {
            expect(seen.has(id)).toBe(false);
            seen.add(id);
            expect([...b.tokens!.subarray(row * (T + 1), (row + 1) * (T + 1))]).toEqual([
              ...window(corpus.train, off + id * T, T + 1),
            ]);
          });
        }
      }
      expect(seen.size).toBe(j.train.length);
    }
    expect(offsets[0]).toBe(0);
    expect(new Set(Array.from({ length: 8 }, (_, e) => windowOffset(cfg.seed, e, T))).size).toBeGreaterThan(1);
  });

  test("resuming at a step gives exactly the batches an uninterrupted run gets; validation windows cover the held-out end once; no test split", async () => {
    const cfg = gcfg();
    const a = new JobData(cfg, readDataset(cfg)),
      b = new JobData(cfg, readDataset(cfg));
    for (let s = 30; s < 36; s++)
      for (const r of [0, 1, 2])
        expect(decodeBatch(b.next(r, Split.Train, s, 2), 1 << 24)).toEqual(
          decodeBatch(a.next(r, Split.Train, s, 2), 1 << 24),
        );
    const ids: number[] = [];
    for (const r of [0, 1, 2]) {
      for (let i = 0; ; i++) {
        const v = decodeBatch(a.next(r, Split.Val, i, 0), 1 << 24);
        if (v.endOfEpoch) break;
        v.sampleIds.forEach((id, row) =>
          expect([...v.tokens!.subarray(row * (T + 1), (row + 1) * (T + 1))]).toEqual([
            ...window(corpus.val, id * T, T + 1),
          ]),
        );
        ids.push(...v.sampleIds);
      }
    }
    expect(ids.sort((x, y) => x - y)).toEqual([...a.val]);
    expect(() => a.next(0, Split.Test, 0, 0)).toThrow("has no test split; ask for Val");
  });

  test("a prepared folder streamed from its shards (500 tokens each, windows across their edges): every window once per epoch, the same after a resume", async () => {
    const jsonl = join(dir, "docs.jsonl");
    writeFileSync(
      jsonl,
      Array.from(
        { length: 20 },
        (_, d) =>
          `${JSON.stringify({ text: Array.from({ length: 300 }, () => alphabet[rng.int(alphabet.length)]).join("") + d })}\n`,
      ).join(""),
    );
    const out = join(dir, "prepared");
    await runPrepare({
      ...prepareDefaults,
      tokenizer: "char",
      text: jsonl,
      jsonl: "text",
      out,
      valFraction: 0.2,
      shardTokens: 500,
      quiet: true,
    });
    const m = readManifest(out)!;
    expect(m.shards.filter((x) => x.split === "train").length).toBeGreaterThan(5);
    const joined = readSplit(out, m, "train");
    const pcfg = gcfg({ dataset: "tokens", dataDir: out, valFraction: 0 });
    const j = new JobData(pcfg, readDataset(pcfg));
    expect(j.train.length).toBe(Math.floor((joined.length - T) / T));
    for (let epoch = 0; epoch < 2; epoch++) {
      const seen = new Set<number>();
      const off = windowOffset(pcfg.seed, epoch, T);
      for (let s = 0; s < j.stepsPerEpoch; s++)
        for (let r = 0; r < 3; r++) {
          const b = decodeBatch(j.next(r, Split.Train, epoch * j.stepsPerEpoch + s, 0), 1 << 24);
          b.sampleIds.forEach((id, row) => {
            expect(seen.has(id)).toBe(false);
            seen.add(id);
            expect([...b.tokens!.subarray(row * (T + 1), (row + 1) * (T + 1))]).toEqual([
              ...joined.subarray(off + id * T, off + id * T + T + 1),
            ]);
          });
        }
      expect(seen.size).toBe(j.train.length);
    }
    const resumed = new JobData(pcfg, readDataset(pcfg));
    for (let s = 20; s < 24; s++)
      for (const r of [0, 1, 2])
        expect(decodeBatch(resumed.next(r, Split.Train, s, 2), 1 << 24)).toEqual(
          decodeBatch(j.next(r, Split.Train, s, 2), 1 << 24),
        );
  });

  test("a plan made for other data (the file changed since submission) refuses the job; a text too short for one window is refused", () => {
    const cfg = gcfg();
    const plan = planHere(cfg);
    expect(() => new JobData(cfg, readDataset(cfg), { ...plan, trainSamples: plan.trainSamples + 1 })).toThrow(
      "the data changed since the job was submitted",
    );
    expect(() => new JobData(cfg, readDataset(cfg), { ...plan, vocab: plan.vocab.slice().reverse() })).toThrow(
      "the data changed",
    );
    const short = join(dir, "short.txt");
    writeFileSync(short, "abcdefghijklmnopqrst");
    expect(() => planHere(gcfg({ dataDir: short }))).toThrow("hold no window");
  });

  test("the trainer cuts a token batch into micro-batches of inputs and next-token targets", async () => {
    const { microBatches } = await import("../../services/trainer/batches.ts");
    const tokens = Uint16Array.from({ length: 3 * 5 }, (_, i) => i); // 3 windows of T=4 (+1)
    const b = {
      epoch: 0,
      index: 0,
      sampleIds: new Uint32Array(3),
      rows: 3,
      cols: 4,
      x: new Float32Array(0),
      y: new Int32Array(0),
      endOfEpoch: false,
      tokens,
    };
    const m = microBatches(b, 2);
    expect(m.map((x) => x.inputShape)).toEqual([
      [2, 4],
      [1, 4],
    ]);
    expect([...m[0]!.inputs]).toEqual([0, 1, 2, 3, 5, 6, 7, 8]);
    expect([...m[0]!.targets]).toEqual([1, 2, 3, 4, 6, 7, 8, 9]);
    expect([...m[1]!.targets]).toEqual([11, 12, 13, 14]);
  });
});
