// Distributed sampling and the loader's batches, without NATS.
import { beforeAll, describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { loadMnist } from "../../engine/data/mnist.ts";
import { DataLoader } from "../../services/data-loader/service.ts";
import { JobData } from "../../services/data-loader/loader.ts";
import { rankSlice, stepsPerEpochOf } from "../../services/data-loader/sampler.ts";
import { WireFormatError } from "../../schemas/codec.ts";
import { decodeBatch, decodeDataPlan, decodeLoaderStats, encodeBatchRequest, encodeJobRequest, Split, SyncPolicy } from "../../schemas/messages.ts";
import { MemoryBus } from "../../services/runtime/bus.ts";
import { BadRequestError, UnknownJobError } from "../../services/runtime/errors.ts";
import { type JobConfig, jobDefaults, parseJobConfig } from "../../services/runtime/job.ts";

const mnist = loadMnist();
const cfg = (over: object) => parseJobConfig({ ...jobDefaults, job: "dl", ...over });

describe("distributed sampling", () => {
  test.each([[60_000, 2, 64], [1000, 3, 7], [10, 4, 3], [5, 8, 2]])("N=%d W=%d B=%d: every sample exactly once per epoch, ranks disjoint", (N, W, B) => {
    const seen = new Uint8Array(N);
    for (let s = 0; s < stepsPerEpochOf(N, W, B); s++) {
      for (let r = 0; r < W; r++) {
        const { start, count } = rankSlice(N, W, B, s, r);
        expect(count).toBeLessThanOrEqual(B);
        for (let i = start; i < start + count; i++) seen[i]!++;
      }
    }
    expect(seen.every((x) => x === 1)).toBe(true);
  });

  test("a job's epochs: ids per rank are disjoint, cover the training split once, and differ between epochs", () => {
    const j = new JobData(cfg({ trainers: 3, batchSize: 500, epochs: 2, valFraction: 0.1 }), mnist);
    for (const epoch of [0, 1]) {
      const seen = new Set<number>();
      for (let s = 0; s < j.stepsPerEpoch; s++) {
        for (let r = 0; r < 3; r++) for (const id of j.trainIds(r, epoch * j.stepsPerEpoch + s)) {
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
    const a = new JobData(cfg({ trainers: 2, batchSize: 64 }), mnist);
    const b = new JobData(cfg({ trainers: 2, batchSize: 64 }), mnist); // a fresh loader, as after a restart
    const T = 470; // inside epoch 2
    for (let s = T; s < T + 5; s++) for (const r of [0, 1]) {
      expect(decodeBatch(b.next(r, Split.Train, s, 2), 1 << 24)).toEqual(decodeBatch(a.next(r, Split.Train, s, 2), 1 << 24));
    }
  });
});

describe("loader over a MemoryBus", () => {
  const bus = new MemoryBus();
  const loader = new DataLoader(bus, { payloadBytesMax: 8 << 20, dataset: mnist });
  loader.serve();
  const c = cfg({ trainers: 2, batchSize: 64 });
  const opened = loader.openJob({ job: "dl", trainers: 2, shards: 2, sync: SyncPolicy.BSP, staleness: 0, configJson: JSON.stringify(c) });
  beforeAll(() => opened);
  const ask = async (m: { rank?: number; split?: Split; step?: number; credits?: number; job?: string }, subject = "mt.dl.data.next") =>
    decodeBatch(await bus.request(subject, encodeBatchRequest({ job: "dl", rank: 0, split: Split.Train, credits: 2, step: 0, ...m }), 1000), 8 << 20);

  test("batches are normalized pixels and labels of the named samples; the next ones are prefetched", async () => {
    const b = await ask({ step: 0 });
    expect(b.rows).toBe(64);
    expect(b.cols).toBe(784);
    const id = b.sampleIds[5]!;
    expect(b.y[5]).toBe(mnist.train.labels[id]!);
    expect(b.x[5 * 784 + 400]).toBeCloseTo((mnist.train.images[id * 784 + 400]! / 255 - 0.1307) / 0.3081, 5);
    await Bun.sleep(10); // let the background prefetch run (it yields between batches)
    await ask({ step: 1 });
    const stats = decodeLoaderStats(await bus.request("mt.dl.data.stats", encodeJobRequest({ job: "dl", step: 0, tag: "" }), 1000), 1 << 16);
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
    await expect(ask({ job: "zz" }, "mt.zz.data.next")).rejects.toBeInstanceOf(UnknownJobError);
    await expect(ask({ rank: 2 })).rejects.toThrow(BadRequestError);
    await expect(ask({ split: Split.Val })).rejects.toThrow("no validation split");
    await expect(bus.request("mt.dl.data.next", Uint8Array.of(1, 2, 3), 1000)).rejects.toBeInstanceOf(WireFormatError);
    expect((await ask({ step: 3 })).rows).toBe(64); // still serving
  });

  test("data.plan: the sample counts and the step count the trainers and shards schedule over", async () => {
    const plan = decodeDataPlan(await bus.request("mt.dl.data.plan", encodeJobRequest({ job: "dl", step: 0, tag: "" }), 1000), 1 << 16);
    expect(plan).toEqual({ job: "dl", trainSamples: 60_000, valSamples: 0, testSamples: 10_000, stepsPerEpoch: 469, totalSteps: 469 * c.epochs });
    await expect(bus.request("mt.nope.data.plan", encodeJobRequest({ job: "nope", step: 0, tag: "" }), 1000)).rejects.toBeInstanceOf(UnknownJobError);
  });
});

describe("the loader's jobs: a limit, shared data sets, freed when their jobs close, unreadable data refused", () => {
  const spec = (job: string, over: Partial<JobConfig> = {}) =>
    ({ job, trainers: 1, shards: 1, sync: SyncPolicy.BSP, staleness: 0, configJson: JSON.stringify(cfg({ ...over, job, trainers: 1 })) });

  test("jobs reading one folder share one copy; the last to close frees it; one job over the limit is refused with the reason", async () => {
    const loader = new DataLoader(new MemoryBus(), { payloadBytesMax: 8 << 20, jobsMax: 2 });
    await loader.openJob(spec("a"));
    await loader.openJob(spec("b"));
    expect(loader.datasets).toBe(1);
    await expect(loader.openJob(spec("c"))).rejects.toThrow("the data-loader serves 2 jobs already (a, b)");
    loader.closeJob("a");
    expect([loader.jobs, loader.datasets]).toEqual([["b"], 1]);
    await loader.openJob(spec("c"));
    loader.closeJob("b");
    loader.closeJob("c");
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
      for (const [name, dims] of [["train-images-idx3-ubyte", [10, 2, 2]], ["t10k-images-idx3-ubyte", [10, 2, 2]]] as const) {
        writeFileSync(join(dir, name), idx([...dims], new Uint8Array(40)));
      }
      for (const name of ["train-labels-idx1-ubyte", "t10k-labels-idx1-ubyte"]) writeFileSync(join(dir, name), idx([10], new Uint8Array(10)));
      const loader = new DataLoader(new MemoryBus(), { payloadBytesMax: 8 << 20 });
      await expect(loader.openJob(spec("tiny", { dataDir: dir }))).rejects.toThrow("the model takes 784 inputs, but the images in");
      expect([loader.jobs, loader.datasets]).toEqual([[], 0]);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  test("a folder without the idx files is refused naming the file; nothing is held", async () => {
    const loader = new DataLoader(new MemoryBus(), { payloadBytesMax: 8 << 20 });
    await expect(loader.openJob(spec("d", { dataDir: "/nonexistent" }))).rejects.toThrow("/nonexistent/train-images-idx3-ubyte: file not found");
    expect([loader.jobs, loader.datasets]).toEqual([[], 0]);
  });
});

describe("trainer micro-batches", () => {
  test("a batch cut into k micro-batches keeps every row once, in order; a short batch into fewer", async () => {
    const { microBatches } = await import("../../services/trainer/loop.ts");
    const b = { epoch: 0, index: 0, sampleIds: new Uint32Array(10), rows: 10, cols: 3, x: Float32Array.from({ length: 30 }, (_, i) => i), y: Int32Array.from({ length: 10 }, (_, i) => i), endOfEpoch: false };
    const m = microBatches(b, 4);
    expect(m.map((x) => x.targetShape[0])).toEqual([3, 3, 3, 1]);
    expect(m.flatMap((x) => [...x.targets])).toEqual([...b.y]);
    expect(m.flatMap((x) => [...x.inputs])).toEqual([...b.x]);
    expect(microBatches({ ...b, rows: 2, x: b.x.subarray(0, 6), y: b.y.subarray(0, 2) }, 4)).toHaveLength(2);
  });
});
