// ZeRO (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
// Models") on the data-parallel replica: which elements of the model a rank owns.
//
// The gradient buckets are what the collective moves; each bucket is a buffer of its
// parameters' elements, in order. Rank r of N owns segment r of every bucket (the segment a
// reduce-scatter leaves summed on rank r: collective.ts's segment()), so a bucket's
// reduce-scatter hands each rank exactly the gradients it updates, and an all-gather of the
// bucket gives every rank every updated parameter. A rank's partition is the union of its
// segments, as ranges of the parameter slab (a segment that spans several parameters is cut at
// their edges), packed one after another: the layout of its optimizer state and, at stage 2, of
// the gradients it keeps.
//
//   stage 1: the optimizer state is partitioned (each rank updates only its partition, then the
//            parameters are all-gathered)
//   stage 2: the gradients too (reduce-scattered; backward writes into its scratch arena and the
//            rank keeps only its partition's sums between steps)
//   stage 3: the parameters too (each rank keeps its partition; a bucket's parameters are
//            all-gathered as forward and backward need them, and freed after)
// zeroPartitions says it in one line per stage, for the CLI's help and a job's report.
//
// ZeroRank is a rank's side of it; the data-parallel replica (data-parallel.ts) hands it every
// step at stages 1-3. Backward writes into the gradient slab (stage 1) or each micro-batch's arena
// (stages 2-3); each bucket is reduce-scattered as backward completes it, and the rank keeps its
// segment. Then overflow and the global norm over every rank's partition (one small all-reduce),
// the optimizer on the partition, and the updated parameters all-gathered (stage 3 instead
// gathers each bucket as a pass needs it, and frees it after). With offload the host holds only
// the partition (master copy, reduced gradients, optimizer state, packed): each reduce-scattered
// segment goes straight from the bucket's host buffer into the host's gradients, and the updated
// partition goes back to the device (stage 3: into the partition the gathers read). On device
// buffers (NCCL) each reduction and gather runs in a buffer of NCCL's block layout, taken from the
// allocator for that operation only: no gradient or parameter crosses to the host.
import type { Allocation, Backend, Ptr } from "../../ffi/backend.ts";
import { CpuBackend } from "../../ffi/cpu/backend.ts";
import { Context } from "../context.ts";
import { NonFiniteLossError } from "../errors.ts";
import { clipFactor } from "../optim/clip.ts";
import type { LossScaler } from "../optim/loss-scale.ts";
import type { Optimizer, UpdatePlan, UpdateRange } from "../optim/optimizer.ts";
import type { ParamEntry } from "../params.ts";
import type { Tensor } from "../tensor.ts";
import { type HostBatch, LossSlots, uploadBatch } from "../train.ts";
import { type BlockLayout, blockLayout, type Collective, type OpKey, type Range, segment } from "./collective.ts";
import type { DataParallelOptions } from "./data-parallel.ts";
import { backwardByBucket, type Bucket, type GradBuckets, InFlight, oneLess, slices } from "./grad-buckets.ts";
import type { DeviceBuffer } from "./nccl-collective.ts";

// ZeRO's operation keys, above the buckets' own and below the replica check's (1 << 24 and up)
/** the all-reduce of the partitions' overflow counts and sums of squares */
const statsBucket = (1 << 24) - 1;
/** bucket b's updated parameters are all-gathered as bucket gatherBucket + b */
const gatherBucket = 1 << 23;
/** stage 3: the step's n-th gather of a bucket's parameters is bucket paramGatherBucket + n */
const paramGatherBucket = 1 << 22;

export type ZeroStage = 0 | 1 | 2 | 3;

/** What each ZeRO stage partitions among the data-parallel ranks (stage 0: nothing). */
export const zeroPartitions: Readonly<Record<ZeroStage, string>> = {
  0: "nothing (every rank holds the parameters, the gradients and the optimizer state)",
  1: "the optimizer state",
  2: "the optimizer state and the gradients",
  3: "the optimizer state, the gradients and the parameters (gathered per bucket as forward and backward need them)",
};

/** A bucket as ZeRO sees it: its parameters in buffer order. */
export interface BucketEntries {
  entries: readonly ParamEntry[];
  numel: number;
}

/** One owned range: where it is in its bucket's buffer, in the slab and in the partition. */
export interface OwnedRange extends UpdateRange {
  bucket: number;
  /** offset in the bucket's buffer */
  bucketOffset: number;
}

export interface Partition {
  rank: number;
  size: number;
  /** per bucket: the rank's segment of the bucket's buffer */
  segments: Range[];
  /** per bucket: the owned ranges inside it */
  ranges: OwnedRange[][];
  /** elements owned (the length of the packed state) */
  numel: number;
}

/** Rank `rank`'s partition of `buckets` among `size` ranks. */
export function partitionOf(buckets: readonly BucketEntries[], size: number, rank: number): Partition {
  if (!(Number.isInteger(size) && size >= 1 && Number.isInteger(rank) && rank >= 0 && rank < size))
    throw new RangeError(`a partition needs 0 <= rank < size, got rank ${rank} of ${size}`);
  let packed = 0;
  const segments: Range[] = [];
  const ranges: OwnedRange[][] = [];
  buckets.forEach((b, id) => {
    const seg = segment(b.numel, size, rank);
    segments.push(seg);
    const mine: OwnedRange[] = [];
    let at = 0;
    for (const e of b.entries) {
      const from = Math.max(seg.offset, at),
        to = Math.min(seg.offset + seg.count, at + e.numel);
      if (to > from) {
        mine.push({
          bucket: id,
          bucketOffset: from,
          paramOffset: e.offset + (from - at),
          stateOffset: packed,
          numel: to - from,
          decay: e.decay,
        });
        packed += to - from;
      }
      at += e.numel;
    }
    ranges.push(mine);
  });
  return { rank, size, segments, ranges, numel: packed };
}

/** The memory a rank holds for the model, in bytes, read from its allocations. */
export interface ModelMemory {
  stage: ZeroStage;
  ranks: number;
  params: number;
  /** elements with a parameter (padding excluded): the denominator of bytes per parameter */
  paramCount: number;
  /** the gradient slab (stages 0-1) or the partition's gradients (stage 2) */
  grads: number;
  optimizer: number;
  /** host buffers the buckets travel in (one bucket's worth each) */
  buckets: number;
  /** the scratch arena's high-water mark (activations; at stage 2 the step's gradients too) */
  arenaPeak: number;
  /** offload: host memory the optimizer runs in (f32 master parameters, gradients, its state) */
  host: number;
  /** stage 3: the most parameter bytes gathered at once (0 below stage 3) */
  gatheredPeak: number;
}

/** Bytes per parameter of the model state (parameters, gradients, optimizer state). */
export function bytesPerParam(m: ModelMemory): number {
  return (m.params + m.grads + m.optimizer) / m.paramCount;
}

/** One step's inputs: this rank's micro-batches (`rows` samples of the step's `totalRows`) and the learning rate. */
export interface StepArgs {
  step: number;
  micro: readonly HostBatch[];
  rows: number;
  totalRows: number;
  lr: number;
}

/** What a ZeRO rank runs with: the data-parallel replica's settings it reads, its buckets and
 *  its loss scaler. */
export interface ZeroRankOptions
  extends Pick<
    DataParallelOptions,
    | "ctx"
    | "model"
    | "rank"
    | "ranks"
    | "zero"
    | "collective"
    | "deviceCollective"
    | "offload"
    | "seed"
    | "gradClip"
    | "accumSteps"
    | "probe"
  > {
  buckets: GradBuckets;
  scaler: LossScaler | null;
  /** the optimizer over the partition's packed plan, built in `ctx` (the host's with offload) */
  optimizer: (ctx: Context, plan: UpdatePlan) => Optimizer;
  /** a compressed bucket's sum over the ranks into b.buf (the replica's compression) */
  compressedAllReduce: (b: Bucket, key: OpKey) => Promise<void>;
}

/** A ZeRO step's outcome, for the replica's result: the loss, the update, and its times given the step's end. */
export interface ZeroStepOutcome {
  loss: number;
  update: { finite: boolean; gradNorm: number };
  times: (t1: number) => { computeMs: number; commMs: number; exposedCommMs: number };
}

/** Offload with ZeRO: a rank's partition in host memory (master parameters, reduced gradients,
 *  packed as the optimizer state; scratch to add a micro-batch's gradients in). */
interface HostPartition {
  ctx: Context;
  params: Allocation;
  grads: Allocation;
  scratch: Allocation;
}

/**
 * One data-parallel rank's side of ZeRO (stages 1-3): the memory of its partition and the passes
 * of a ZeRO step. The DataParallel replica holds one and hands it its steps, the stage 3 gathers
 * an evaluation needs, and the reads and loads of its partition.
 */
export class ZeroRank {
  readonly stage: ZeroStage;
  /** the part of every bucket this rank owns */
  readonly partition: Partition;
  /** the optimizer over the partition (in host memory with offload) */
  readonly optimizer: Optimizer;
  readonly #o: ZeroRankOptions;
  /** stage 2: the partition's reduced gradients, and scratch to add a micro-batch's into them */
  readonly ownedGrads: Allocation | null = null;
  readonly #addScratch: Allocation | null = null;
  /** stage 3: the partition's f32 parameters (packed as the optimizer state), the buckets
   *  gathered now (device buffers the parameters are bound to) and those on their way */
  readonly ownedParams: Allocation | null = null;
  /** offload: the host's partition */
  readonly hostPart: HostPartition | null = null;
  readonly #gathered = new Map<number, Allocation>();
  readonly #gathering = new Map<number, Promise<void>>();
  #gatheredBytes = 0;
  #gatheredPeak = 0;
  /** gatherAll() is under way (its gathers do not count toward the training passes' peak) */
  #whole = false;
  #gatherSeq = { step: -1, n: 0 };
  readonly #layouts = new Map<number, BlockLayout>();

  constructor(o: ZeroRankOptions) {
    this.#o = o;
    const { ctx, model } = o;
    const backend = ctx.backend;
    const store = model.store;
    this.stage = o.zero;
    const part = partitionOf(o.buckets.list, o.ranks, o.rank);
    this.partition = part;
    const widest = Math.max(1, ...part.ranges.flat().map((r) => r.numel));
    if (o.zero >= 2) {
      store.releaseGradSlab();
      if (!o.offload) {
        this.ownedGrads = ctx.allocPersistent(Math.max(part.numel, 1) * 4);
        this.#addScratch = ctx.allocPersistent(widest * 4);
      }
    }
    if (o.zero === 3) {
      // every rank initialized the whole model from the seed; it keeps its partition
      const owned = ctx.allocPersistent(Math.max(part.numel, 1) * 4);
      for (const r of part.ranges.flat())
        backend.copy(owned.ptr + r.stateOffset * 4, store.values.ptr + r.paramOffset * 4, r.numel * 4);
      this.ownedParams = owned;
      store.releaseValueSlab();
    }
    let plan: UpdatePlan = {
      ranges: part.ranges.flat(),
      stateNumel: part.numel,
      grads: this.ownedGrads,
      params: this.ownedParams,
    };
    if (o.offload) {
      const hp = this.#hostPartition(widest);
      this.hostPart = hp;
      plan = { ranges: part.ranges.flat(), stateNumel: part.numel, grads: hp.grads, params: hp.params };
    }
    this.optimizer = o.optimizer(this.hostPart?.ctx ?? ctx, plan);
  }

  /** Offload: the partition's memory on the host, its master copy from the device's (every rank
   *  initialized alike). */
  #hostPartition(widest: number): HostPartition {
    const { ctx, model, seed } = this.#o;
    const part = this.partition;
    const hostCtx = new Context(new CpuBackend(), { seed });
    const bytes = Math.max(part.numel, 1) * 4;
    const hp = {
      ctx: hostCtx,
      params: hostCtx.allocPersistent(bytes),
      grads: hostCtx.allocPersistent(bytes),
      scratch: hostCtx.allocPersistent(widest * 4),
    };
    for (const r of part.ranges.flat()) {
      const v = new Float32Array(r.numel);
      ctx.backend.download(
        this.ownedParams !== null
          ? this.ownedParams.ptr + r.stateOffset * 4
          : model.store.values.ptr + r.paramOffset * 4,
        v,
      );
      hostCtx.backend.upload(hp.params.ptr + r.stateOffset * 4, v);
    }
    return hp;
  }

  /** Stage 3: the most parameter bytes the training passes held gathered at once. */
  get gatheredPeak(): number {
    return this.#gatheredPeak;
  }

  /** Where the optimizer's state lives: host memory when offloaded, else the device. */
  get optimizerBackend(): Backend {
    return this.hostPart?.ctx.backend ?? this.#o.ctx.backend;
  }

  /** The device collective of the current generation, or null (the host path). */
  get #deviceColl(): Collective<DeviceBuffer> | null {
    return this.#o.deviceCollective?.() ?? null;
  }

  /**
   * A ZeRO step. Stage 1: backward into the gradient slab as at stage 0, each bucket
   * reduce-scattered (this rank keeps the sums of its partition, in the slab). Stage 2: every
   * micro-batch's backward writes into the arena, and each bucket is reduce-scattered as soon as
   * it is complete; the partition's sums are added up in a buffer of the partition's size.
   * Then: overflow and the global norm from every rank's partition (one small all-reduce), the
   * optimizer on the partition, and each bucket's updated parameters all-gathered.
   */
  async step(s: StepArgs): Promise<ZeroStepOutcome> {
    const t0 = performance.now();
    if (this.#o.deviceCollective !== undefined) this.#o.buckets.provide(this.#deviceColl !== null);
    const flight = new InFlight();
    const loss = await this.#passes(s, flight);
    const tBackward = performance.now();
    await flight.all();
    if (!Number.isFinite(loss)) throw new NonFiniteLossError(s.step, loss);
    const update = await this.#update(s.step, s.lr);
    // every rank's updated partition to every rank (stage 3 gathers them as the next pass needs them)
    if (update.finite && this.stage < 3) await this.#gatherUpdated(s.step);
    return {
      loss,
      update,
      times: (t1) => ({
        computeMs: tBackward - t0,
        commMs: t1 - Math.min(flight.firstStart, tBackward),
        exposedCommMs: t1 - tBackward,
      }),
    };
  }

  /**
   * The micro-batches' passes, each bucket reduce-scattered as backward completes it (stage 2:
   * every micro-batch's, its gradients living in that pass's arena; the ranks agree on the
   * rounds, so a rank with fewer micro-batches reduces zeros). Returns the mean loss; the
   * reductions are in `flight`.
   */
  async #passes({ step, micro, rows, totalRows }: StepArgs, flight: InFlight): Promise<number> {
    const { ctx, model, buckets } = this.#o;
    const store = model.store;
    const stage2 = this.stage >= 2;
    const stage3 = this.stage === 3;
    const k = micro.length;
    const dloss = ((this.#o.scaler?.scale ?? 1) * (totalRows > 0 ? rows / totalRows : 0)) / Math.max(k, 1);
    const rounds = stage2 ? Math.max(this.#o.accumSteps, k, 1) : 1;
    const losses = new LossSlots(ctx, k);
    store.zeroGrad();
    const gather = stage3 ? (need: readonly Tensor[]) => this.#gatherFor(need, step) : undefined;
    for (let i = 0; i < Math.max(k, rounds); i++) {
      const round = stage2 ? i : 0;
      if (stage2) store.zeroGrad(); // drops the last pass's arena gradients
      const left = buckets.left();
      const complete = (b: Bucket) => {
        if (!oneLess(left, b)) return;
        flight.add(this.#reduceScatter(b, step, round));
        if (stage3) this.#release(b); // no later backward node reads its parameters
      };
      // stage 3: a rank without a micro-batch this round still takes part in the rounds'
      // parameter gathers: it runs the probe batch with a zero loss seed (zero gradients)
      const batch = i < k ? micro[i]! : stage3 && i < rounds ? this.#o.probe : null;
      if (batch !== null) {
        ctx.newPass();
        const { x, y } = uploadBatch(ctx, batch);
        const l = stage3 ? await this.#lossGathered(x, y, step) : model.loss(x, y);
        if (i < k) losses.keep(i, l);
        if (!stage2 && i < k - 1) {
          ctx.backward(l, dloss); // stage 1 adds the micro-batches up in the slab and reduces once
          continue;
        }
        await backwardByBucket(ctx, buckets, l, i < k ? dloss : 0, complete, flight, gather);
      }
      if (stage3) await this.releaseAll();
      if (i >= rounds) continue;
      for (const b of buckets.list) if (left.get(b)! > 0) flight.add(this.#reduceScatter(b, step, round));
      // the buckets' buffers are reused by the next round
      if (stage2 && i < Math.max(k, rounds) - 1) await flight.all();
    }
    return losses.mean(step, false);
  }

  /** Bucket b's gradients of this round reduce-scattered; this rank keeps (adds in) its segment. */
  #reduceScatter(b: Bucket, step: number, round: number): Promise<void> {
    const backend = this.#o.ctx.backend;
    const store = this.#o.model.store;
    const stage2 = this.stage >= 2;
    const key = { step, bucket: round * this.#o.buckets.list.length + b.id };
    const dc = this.#deviceColl;
    if (dc !== null) return this.#reduceScatterOnDevice(dc, b, key, round > 0);
    for (const [e, dst] of slices(b)) {
      const grad = stage2 ? store.gradOf(e.name) : null;
      if (!stage2) backend.download(store.grads.ptr + e.offset * 4, dst);
      else if (grad === null)
        dst.fill(0); // no op read it in this micro-batch
      else backend.download(grad.ptr, dst);
    }
    return (b.feedback ? this.#o.compressedAllReduce(b, key) : this.#o.collective().reduceScatter(b.buf, key)).then(
      () => this.#keep(b, round > 0),
    );
  }

  /** Keeps this rank's segment of a reduce-scattered bucket (adds it in, for a later micro-batch). */
  #keep(b: Bucket, add: boolean): void {
    const { ctx, model } = this.#o;
    const backend = ctx.backend;
    const hp = this.hostPart;
    for (const r of this.partition.ranges[b.id]!) {
      const src = b.buf.subarray(r.bucketOffset, r.bucketOffset + r.numel);
      if (hp !== null) {
        // offload: the segment goes from the bucket's host buffer into the host's gradients
        const dst = hp.grads.ptr + r.stateOffset * 4;
        if (this.stage === 1 || !add) hp.ctx.backend.upload(dst, src);
        else {
          hp.ctx.backend.upload(hp.scratch.ptr, src);
          hp.ctx.backend.add(dst, dst, hp.scratch.ptr, r.numel);
        }
        continue;
      }
      if (this.stage === 1) {
        backend.upload(model.store.grads.ptr + r.paramOffset * 4, src);
        continue;
      }
      const dst = this.ownedGrads!.ptr + r.stateOffset * 4;
      if (!add) {
        backend.upload(dst, src);
        continue;
      }
      backend.upload(this.#addScratch!.ptr, src);
      backend.add(dst, dst, this.#addScratch!.ptr, r.numel);
    }
  }

  /**
   * On device buffers: bucket b's gradients copied into a buffer in NCCL's block layout (the
   * allocator's, for this reduction only: ZeRO 2 and 3 keep no gradient buffer of the whole
   * model; zeroed, so the padding adds nothing), reduce-scattered, and this rank's block kept.
   * None crosses to the host. After a failure the buffer is not given back: an NCCL kernel the
   * abort has not yet stopped may still write it.
   */
  async #reduceScatterOnDevice(dc: Collective<DeviceBuffer>, b: Bucket, key: OpKey, add: boolean): Promise<void> {
    const backend = this.#o.ctx.backend;
    const store = this.#o.model.store;
    const layout = this.#blocks(b);
    const dev = backend.alloc(Math.max(layout.padded, 1) * 4);
    let at = 0;
    for (const e of b.entries) {
      const grad = this.stage >= 2 ? (store.gradOf(e.name)?.ptr ?? null) : store.grads.ptr + e.offset * 4;
      // a parameter no op read in this micro-batch: its zeros are already there
      if (grad !== null) this.#blockCopies(b, dev.ptr, at, e.numel, grad, "in");
      at += e.numel;
    }
    await dc.reduceScatter({ ptr: dev.ptr, count: layout.padded }, key);
    await dc.join?.(); // the keep's copies read what NCCL wrote
    this.#keepDevice(b, dev.ptr, add);
    backend.free(dev);
  }

  /** On device buffers: #keep from the bucket's device buffer (this rank's block). */
  #keepDevice(b: Bucket, dev: Ptr, add: boolean): void {
    const { ctx, model } = this.#o;
    const backend = ctx.backend;
    const mine = this.#blocks(b);
    for (const r of this.partition.ranges[b.id]!) {
      const [sp] = mine.spans(r.bucketOffset, r.numel); // within this rank's segment: one span
      const src = dev + sp!.device * 4;
      if (this.stage === 1) backend.copy(model.store.grads.ptr + r.paramOffset * 4, src, r.numel * 4);
      else {
        const dst = this.ownedGrads!.ptr + r.stateOffset * 4;
        if (add) backend.add(dst, dst, src, r.numel);
        else backend.copy(dst, src, r.numel * 4);
      }
    }
  }

  /** Bucket b in NCCL's block layout over the ranks (blockLayout()), made once per bucket: every
   *  step's copies in and out read it. */
  #blocks(b: Bucket): BlockLayout {
    let layout = this.#layouts.get(b.id);
    if (layout === undefined) {
      layout = blockLayout(b.numel, this.#o.ranks);
      this.#layouts.set(b.id, layout);
    }
    return layout;
  }

  /**
   * On device buffers: `count` elements of bucket b from bucket offset `at` copied between the
   * bucket's device buffer `dev` (block layout) and `ptr` ("in": ptr to dev; "out": dev to ptr),
   * a copy per segment they span.
   */
  #blockCopies(b: Bucket, dev: Ptr, at: number, count: number, ptr: Ptr, way: "in" | "out"): void {
    const backend = this.#o.ctx.backend;
    for (const span of this.#blocks(b).spans(at, count)) {
      const [d, h] = [dev + span.device * 4, ptr + (span.at - at) * 4];
      if (way === "in") backend.copy(d, h, span.count * 4);
      else backend.copy(h, d, span.count * 4);
    }
  }

  /**
   * Overflow and the global norm over every rank's partition (one small all-reduce; offload: in
   * host memory, where the partition's gradients are), then unscale, clip and the optimizer on
   * this rank's partition.
   */
  async #update(step: number, lr: number): Promise<{ finite: boolean; gradNorm: number }> {
    const store = this.#o.model.store;
    const ranges = this.partition.ranges.flat();
    const hp = this.hostPart;
    const gb = hp?.ctx.backend ?? this.#o.ctx.backend;
    const gradAt = (r: (typeof ranges)[number]) =>
      hp !== null
        ? hp.grads.ptr + r.stateOffset * 4
        : this.stage >= 2
          ? this.ownedGrads!.ptr + r.stateOffset * 4
          : store.grads.ptr + r.paramOffset * 4;
    const stats = new Float32Array(2);
    let nonFinite = 0,
      sumSq = 0;
    for (const r of ranges) {
      nonFinite += gb.countNonFinite(gradAt(r), r.numel);
      sumSq += gb.sumSquares(gradAt(r), r.numel);
    }
    stats[0] = nonFinite;
    stats[1] = nonFinite > 0 ? 0 : sumSq;
    await this.#o.collective().allReduce(stats, { step, bucket: statsBucket }, "sum");
    if (stats[0] !== 0) return { finite: false, gradNorm: Infinity };
    const scale = this.#o.scaler?.scale ?? 1;
    const gradNorm = Math.sqrt(stats[1]!) / scale;
    // unscaling and the clip in one factor, which the optimizer reads the gradients times
    this.optimizer.step(lr, (1 / scale) * clipFactor(gradNorm, this.#o.gradClip));
    // offload: the host's updated partition back to the device (stage 3: the packed partition)
    if (hp !== null) this.#partitionToDevice(hp);
    return { finite: true, gradNorm };
  }

  /** Offload: the host's master partition to the device's parameters (the slab's ranges at
   *  stages 1-2; the packed partition at stage 3). */
  #partitionToDevice(hp: HostPartition): void {
    const { ctx, model } = this.#o;
    const backend = ctx.backend;
    const v = new Float32Array(this.partition.numel);
    hp.ctx.backend.download(hp.params.ptr, v);
    if (this.ownedParams !== null) {
      backend.upload(this.ownedParams.ptr, v);
      return;
    }
    for (const r of this.partition.ranges.flat())
      backend.upload(model.store.values.ptr + r.paramOffset * 4, v.subarray(r.stateOffset, r.stateOffset + r.numel));
  }

  /** Stages 1-2: every rank's updated partition all-gathered into every rank's parameters. */
  async #gatherUpdated(step: number): Promise<void> {
    const backend = this.#o.ctx.backend;
    const store = this.#o.model.store;
    const buckets = this.#o.buckets.list;
    const dc = this.#deviceColl;
    if (dc !== null) {
      // each bucket in a buffer of NCCL's block layout for this gather only (not given back after
      // a failure: see #reduceScatterOnDevice)
      const bufs = buckets.map((b) => backend.alloc(Math.max(this.#blocks(b).padded, 1) * 4));
      await Promise.all(
        buckets.map((b, i) => {
          for (const r of this.partition.ranges[b.id]!)
            this.#blockCopies(b, bufs[i]!.ptr, r.bucketOffset, r.numel, store.values.ptr + r.paramOffset * 4, "in");
          return dc.allGather(
            { ptr: bufs[i]!.ptr, count: this.#blocks(b).padded },
            { step, bucket: gatherBucket + b.id },
          );
        }),
      );
      await dc.join?.();
      buckets.forEach((b, i) => {
        let at = 0;
        for (const e of b.entries) {
          this.#blockCopies(b, bufs[i]!.ptr, at, e.numel, store.values.ptr + e.offset * 4, "out");
          at += e.numel;
        }
        backend.free(bufs[i]!);
      });
      return;
    }
    const collective = this.#o.collective();
    const gathers = buckets.map((b) => {
      for (const r of this.partition.ranges[b.id]!)
        backend.download(
          store.values.ptr + r.paramOffset * 4,
          b.buf.subarray(r.bucketOffset, r.bucketOffset + r.numel),
        );
      return collective.allGather(b.buf, { step, bucket: gatherBucket + b.id });
    });
    await Promise.all(gathers);
    for (const b of buckets) for (const [e, part] of slices(b)) backend.upload(store.values.ptr + e.offset * 4, part);
  }

  /**
   * Stage 3, one forward pass: before each part of the model's lossSteps its buckets are
   * gathered (the next part's are asked for at once, so their all-gather runs while this part
   * computes), and the buckets neither reads are freed (backward gathers them again).
   */
  async #lossGathered(x: Tensor, y: Tensor, step: number): Promise<Tensor> {
    const { buckets } = this.#o;
    const list = buckets.list;
    const steps = this.#o.model.lossSteps(x, y);
    let part = 0;
    for (let r = steps.next(); ; r = steps.next(), part++) {
      if (r.done) return r.value;
      const need = buckets.idsOf(r.value);
      const next = buckets.forwardPlan[part + 1] ?? [];
      for (const id of [...this.#gathered.keys()])
        if (!need.includes(id) && !next.includes(id)) this.#release(list[id]!);
      const ready = need.map((id) => this.#gather(list[id]!, step));
      for (const id of next) if (!need.includes(id)) this.#gather(list[id]!, step).catch(() => {}); // awaited when its part comes
      await Promise.all(ready);
    }
  }

  /** Stage 3, backward: the buckets of the parameters a node reads, and the next bucket backward will need. */
  async #gatherFor(params: readonly Tensor[], step: number): Promise<void> {
    const { buckets } = this.#o;
    const list = buckets.list;
    const ids = buckets.idsOf(params.map((t) => t.name!)).filter((id) => !this.#gathered.has(id));
    if (ids.length === 0) return;
    const waits = ids.map((id) => this.#gather(list[id]!, step));
    const after = list[Math.max(...ids) + 1];
    if (after !== undefined) this.#gather(after, step).catch(() => {});
    await Promise.all(waits);
  }

  /**
   * Stage 3: all-gathers bucket b's parameters (every rank contributes its segment, from its
   * partition) into a device buffer and binds them to it. Every rank asks for the same gathers in
   * the same order, so the n-th of a step has the same key everywhere.
   */
  #gather(b: Bucket, step: number): Promise<void> {
    if (this.#gathered.has(b.id)) return Promise.resolve();
    const running = this.#gathering.get(b.id);
    if (running !== undefined) return running;
    if (this.#gatherSeq.step !== step) this.#gatherSeq = { step, n: 0 };
    const key = { step, bucket: paramGatherBucket + this.#gatherSeq.n++ };
    const { model } = this.#o;
    const dc = this.#deviceColl;
    const gathered = dc !== null ? this.#gatherOnDevice(dc, b, key) : this.#gatherOnHost(b, key);
    const op = gathered
      .then((alloc) => {
        let at = 0;
        for (const e of b.entries) {
          model.store.bind(e.name, alloc.ptr + at * 4);
          at += e.numel;
        }
        this.#gathered.set(b.id, alloc);
        this.#gatheredBytes += alloc.bytes;
        // the training passes' peak (an evaluation gathers the whole model, and says so)
        if (!this.#whole) this.#gatheredPeak = Math.max(this.#gatheredPeak, this.#gatheredBytes);
      })
      .finally(() => this.#gathering.delete(b.id));
    this.#gathering.set(b.id, op);
    return op;
  }

  /** Stage 3 on the host path: this rank's segment through a host array, all-gathered, uploaded. */
  async #gatherOnHost(b: Bucket, key: OpKey): Promise<Allocation> {
    const { ctx } = this.#o;
    const backend = ctx.backend;
    const buf = new Float32Array(b.numel);
    for (const r of this.partition.ranges[b.id]!)
      backend.download(
        this.ownedParams!.ptr + r.stateOffset * 4,
        buf.subarray(r.bucketOffset, r.bucketOffset + r.numel),
      );
    await this.#o.collective().allGather(buf, key);
    const alloc = ctx.allocPersistent(b.numel * 4);
    backend.upload(alloc.ptr, buf);
    return alloc;
  }

  /** Stage 3 on device buffers: this rank's block all-gathered in a block-layout buffer, then
   *  copied out into the bucket's order (the parameters are bound to it); no host copy. */
  async #gatherOnDevice(dc: Collective<DeviceBuffer>, b: Bucket, key: OpKey): Promise<Allocation> {
    const ctx = this.#o.ctx;
    const layout = this.#blocks(b);
    // not given back after a failure (see #reduceScatterOnDevice)
    const blocks = ctx.backend.alloc(Math.max(layout.padded, 1) * 4);
    for (const r of this.partition.ranges[b.id]!)
      this.#blockCopies(b, blocks.ptr, r.bucketOffset, r.numel, this.ownedParams!.ptr + r.stateOffset * 4, "in");
    await dc.allGather({ ptr: blocks.ptr, count: layout.padded }, key);
    await dc.join?.();
    const alloc = ctx.allocPersistent(b.numel * 4);
    this.#blockCopies(b, blocks.ptr, 0, b.numel, alloc.ptr, "out");
    ctx.backend.free(blocks);
    return alloc;
  }

  /** Stage 3: unbinds bucket b's parameters and frees their buffer. */
  #release(b: Bucket): void {
    const a = this.#gathered.get(b.id);
    if (a === undefined) return;
    for (const e of b.entries) this.#o.model.store.bind(e.name, null);
    this.#o.ctx.freePersistent(a);
    this.#gathered.delete(b.id);
    this.#gatheredBytes -= a.bytes;
  }

  /**
   * Stage 3: every bucket's parameters gathered and bound (an evaluation runs the whole model at
   * once). Every rank calls it at the same step boundary; releaseAll() undoes it.
   */
  async gatherAll(step: number): Promise<void> {
    if (this.stage !== 3) return;
    this.#whole = true;
    try {
      await Promise.all(this.#o.buckets.list.map((b) => this.#gather(b, step)));
    } finally {
      this.#whole = false;
    }
  }

  /** Stage 3: waits for the gathers in flight and frees every gathered bucket. */
  async releaseAll(): Promise<void> {
    if (this.stage !== 3) return;
    await Promise.allSettled([...this.#gathering.values()]);
    for (const b of this.#o.buckets.list) this.#release(b);
  }

  /** The communicator was replaced (a restore, a new generation): stage 3's gathers are counted afresh. */
  communicatorReplaced(): void {
    this.#gatherSeq = { step: -1, n: 0 };
  }

  /**
   * `count` values of this rank's partition at slab offset `offset` (packed at `packed`): its
   * parameters (its own at stage 3, the replicated slab's below) and its optimizer state.
   */
  readRange(offset: number, count: number, packed: number): { params: Float32Array; state: Float32Array[] } {
    const backend = this.#o.ctx.backend;
    const params = new Float32Array(count);
    if (this.ownedParams !== null) backend.download(this.ownedParams.ptr + packed * 4, params);
    else backend.download(this.#o.model.store.values.ptr + offset * 4, params);
    const state = this.optimizer.stateSlabs().map((s) => {
      const v = new Float32Array(count);
      this.optimizerBackend.download(s.allocation.ptr + packed * 4, v);
      return v;
    });
    return { params, state };
  }

  /**
   * Loads this rank's partition of a whole replica (a restore, in the slab's layout, whatever
   * stage and number of ranks saved it): its parameters (stage 3: its own; below, the whole
   * slab), its optimizer state and, offloaded, the host's master copy.
   */
  load(values: Float32Array, states: readonly Float32Array[]): void {
    const backend = this.#o.ctx.backend;
    const slabs = this.optimizer.stateSlabs();
    if (this.ownedParams !== null) {
      // stage 3: this rank keeps its partition of the parameters (any gathered copy is stale)
      for (const b of this.#o.buckets.list) this.#release(b);
      for (const r of this.partition.ranges.flat())
        backend.upload(
          this.ownedParams.ptr + r.stateOffset * 4,
          values.subarray(r.paramOffset, r.paramOffset + r.numel),
        );
    } else this.#o.model.store.writeValues(values);
    // offload: in host memory, with the partition's master copy
    const hp = this.hostPart;
    for (const r of this.partition.ranges.flat()) {
      slabs.forEach((s, i) =>
        this.optimizerBackend.upload(
          s.allocation.ptr + r.stateOffset * 4,
          states[i]!.subarray(r.paramOffset, r.paramOffset + r.numel),
        ),
      );
      hp?.ctx.backend.upload(
        hp.params.ptr + r.stateOffset * 4,
        values.subarray(r.paramOffset, r.paramOffset + r.numel),
      );
    }
  }

  /** Frees the host memory of offload. */
  dispose(): void {
    this.hostPart?.ctx.dispose();
  }
}
