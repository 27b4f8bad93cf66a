// Data parallelism over any Collective: every rank holds a replica of the model (or, with ZeRO,
// its partition of the optimizer state, gradients and parameters), and a step is
//   forward/backward -> average the gradient over the ranks (bucket by bucket while backward
//   goes on) -> unscale (f16) -> clip by the global norm -> the same optimizer step on every rank.
// Every rank reduces to bit-identical gradients (the collective's fixed order), so the replicas
// stay equal; checkReplicas() compares a hash of the parameters to prove it.
//
// The collective is the caller's: a ring or a hierarchical collective over NATS and shared memory
// (services/trainer/replica.ts wires the trainer service's), or over MemoryTransport for ranks in
// one process (the engine's tests and benches). A rank that loses its communicator (a restore,
// a peer lost) gets a new one from the same function; communicatorReplaced() says so.
//
// Buckets (grad-buckets.ts): parameters grouped in the order backward completes their gradients,
// each reduced as soon as backward has written its last gradient, while backward goes on.
// ZeRO (stages 1-3) runs its steps in a ZeroRank (zero.ts): the partition's memory, the
// reduce-scatters, the partitioned update and the parameter gathers. This file holds stage 0's
// step, compression, offload without ZeRO, and what every stage shares (the loss scale, the
// replica check, snapshots and restores).
//
// Averaging: rank r scales its mean gradient by rows_r / rows (the step's samples over all
// ranks; folded into the loss's seed) before the sum, so a short last step weighs each sample
// once, as a single process with the whole batch would.
//
// On GPUs with NCCL (`deviceCollective`, engine/parallel/nccl-collective.ts), stage 0's buckets
// stay in device memory: each bucket has a device buffer its gradients are copied into (on the
// backend's stream, so the all-reduce NCCL queues there runs after them), it is all-reduced in
// place, and copied back into the gradient slab; the f16 check, the norm and the update then
// read device memory as in one process. No gradient crosses to the host.
//
// Compression (`compress`, compress.ts): a bucket is encoded with error feedback (a residual per
// bucket). bf16, fp16 and int8 go round the ring encoded (the collective's encodedAllReduce: each
// partial sum re-encoded, its rounding kept in the residual of the rank that encoded it, so each
// link carries 2(N-1)/N of the encoded bytes). Top-k, whose partial sums would fill in, and
// collectives without an encoded ring, all-gather every rank's encoding, and each rank sums the
// decoded contributions in rank order. Either way every rank ends with the same bits. ZeRO keeps
// its partition of that sum. With top-k the density of the summed bucket is reported.
//
// Offload (`offload`, ZeRO-Offload's CPU optimizer): the optimizer's state, the update and an f32
// master copy of the parameters live in host memory (a CPU-backend mirror of the parameter
// store). The buckets already come to the host for the all-reduce; their reduced gradients go
// into the mirror instead of back to the device, the loss scaler, the clip and the optimizer run
// there with the CPU kernels, and the updated parameters go back to the device. With ZeRO each
// rank's host holds only its partition (zero.ts).
import type { Backend } from "../../ffi/backend.ts";
import { CpuBackend } from "../../ffi/cpu/backend.ts";
import { Context } from "../context.ts";
import { EngineError, NonFiniteLossError } from "../errors.ts";
import type { Model } from "../models/model.ts";
import { type OptimizerSpec, optimizerOf } from "../optim/choose.ts";
import { LossScaler } from "../optim/loss-scale.ts";
import type { Optimizer, UpdatePlan } from "../optim/optimizer.ts";
import type { ParamStore } from "../params.ts";
import { forwardPass, type HostBatch, LossSlots, unscaleAndClip } from "../train.ts";
import { BadPieceError, type Collective, type GroupSum, type HostGroup, type OpKey } from "./collective.ts";
import { Codec, density, parseCompression } from "./compress.ts";
import { backwardByBucket, type Bucket, GradBuckets, InFlight, oneLess, slices } from "./grad-buckets.ts";
import type { DeviceBuffer } from "./nccl-collective.ts";
import { type ModelMemory, type Partition, type StepArgs, ZeroRank, type ZeroStage } from "./zero.ts";

/** Bucket ids at and above this name the replica check's operations, not gradient buckets (ZeRO's
 *  own operations are numbered below it: zero.ts). */
const checkBucket = 1 << 24;
/** Bits of the parameter hash per float (exact as an f32 integer, never a NaN). */
const hashBitsPerFloat = 21;

/**
 * Whether `n` copies of one model hold the same parameters: copy `me` all-gathers a 63-bit hash of
 * its `values` (three 21-bit floats, exact in f32, never a NaN) over `collective`, as every other
 * copy does at the same `step`. Returns the copies whose hash differs from copy 0's, and each
 * copy's hash as text.
 */
export async function compareCopies(
  collective: Collective,
  values: Float32Array,
  me: number,
  n: number,
  step: number,
): Promise<{ differ: number[]; hashOf: (copy: number) => string }> {
  const h = Bun.hash(new Uint8Array(values.buffer, values.byteOffset, values.byteLength));
  const buf = new Float32Array(3 * n);
  const mask = (1n << BigInt(hashBitsPerFloat)) - 1n;
  for (let i = 0; i < 3; i++) buf[3 * me + i] = Number((BigInt(h) >> BigInt(hashBitsPerFloat * i)) & mask);
  await collective.allGather(buf, { step, bucket: checkBucket });
  const hashOf = (c: number) => [0, 1, 2].map((i) => buf[3 * c + i]!.toString(16)).join(".");
  return { differ: Array.from({ length: n }, (_, c) => c).filter((c) => hashOf(c) !== hashOf(0)), hashOf };
}

export class ReplicaDivergedError extends Error {
  override readonly name = "ReplicaDivergedError";
}

export interface DataParallelOptions {
  ctx: Context;
  model: Model;
  rank: number;
  /** ranks taking part (each runs a DataParallel with the same options but its rank) */
  ranks: number;
  /** the communicator of the current generation (the caller builds and replaces it) */
  collective: () => Collective;
  /** the current generation's communicator over device memory (NCCL): stage 0's buckets then
   *  stay on the device. Not with ZeRO, offload or compression (refused with the reason). It
   *  returns null where the job's ranks turned out not to reach each other over NCCL (ranks that
   *  share a GPU): the buckets then take the host path, through `collective`. Asked at each step:
   *  the buckets' memory (device buffers or host arrays) is made at the first step it is asked. */
  deviceCollective?: () => Collective<DeviceBuffer> | null;
  zero: ZeroStage;
  /** the optimizer's state and update in host memory (ZeRO-Offload) */
  offload: boolean;
  bucketMb: number;
  /** compression of the buckets (compress.ts's parseCompression): "none", "fp16", "topk:0.01", ... */
  compress: string;
  /** the optimizer every rank runs (a job's `optimizer` setting) */
  optimizer: OptimizerSpec;
  /** clip the averaged gradient's global norm to this (0: no clipping) */
  gradClip: number;
  /** compression: top-k runs dense for these first steps */
  warmupSteps: number;
  /** micro-batches per step (ZeRO stage 2 reduces each; every rank runs as many rounds) */
  accumSteps: number;
  /** the host mirror's seed (offload) */
  seed: number;
  /** a one-row batch shaped as the job's, of zeros: its forward pass orders the buckets */
  probe: HostBatch;
}

export interface DataParallelStepResult {
  /** this rank's mean loss over its micro-batches */
  loss: number;
  /** global norm of the averaged gradient before clipping; Infinity when the step was skipped */
  gradNorm: number;
  /** f16: the averaged gradient overflowed and every rank skipped the update */
  skipped: boolean;
  /** forward, backward and update */
  computeMs: number;
  /** from the first bucket's all-reduce start until the step holds every reduced bucket */
  commMs: number;
  /** how long the step waited for all-reduces after its backward was done */
  exposedCommMs: number;
  /** top-k: share of the summed gradient that is not zero (-1 otherwise) */
  density: number;
}

export class DataParallel {
  readonly optimizer: Optimizer;
  readonly scaler: LossScaler | null;
  readonly zero: ZeroStage;
  /** ZeRO: the part of every bucket this rank owns (null at stage 0) */
  readonly partition: Partition | null;
  /** the bucket codec (compression) */
  readonly codec: Codec;
  readonly #o: DataParallelOptions;
  readonly #buckets: GradBuckets;
  /** ZeRO (stages 1-3): this rank's partition and the passes of its steps (zero.ts) */
  readonly #zero: ZeroRank | null = null;
  /** offload at stage 0: the host mirror of the parameter store the optimizer runs on */
  readonly #host: { ctx: Context; store: ParamStore } | null = null;
  /** top-k: nonzero and total entries of the summed buckets this step */
  #dense = { nonzero: 0, total: 0 };

  constructor(o: DataParallelOptions) {
    this.#o = o;
    const { ctx, model } = o;
    const store = model.store;
    this.codec = new Codec(parseCompression(o.compress));
    if (o.deviceCollective !== undefined) {
      const why = o.offload
        ? "offload (the optimizer runs on the host)"
        : this.codec.kind !== "none" && o.zero > 0
          ? `compression (${o.compress}) with ZeRO stage ${o.zero}`
          : null;
      if (why !== null)
        throw new EngineError(
          `data parallelism on device buffers (NCCL) runs without offload, and compresses only at ZeRO stage 0; not with ${why}: use the host path`,
        );
    }
    const onDevice = o.deviceCollective !== undefined;
    this.#buckets = new GradBuckets({ ctx, model, probe: o.probe, bucketMb: o.bucketMb, codec: this.codec, onDevice });
    this.zero = o.zero;
    this.scaler = ctx.precision === "f16" ? new LossScaler() : null;
    const optimizer = (c: Context, s: ParamStore, plan?: UpdatePlan) =>
      optimizerOf(c, s, o.optimizer, { plan, sparse: this.codec.kind === "topk" });
    if (o.zero > 0) {
      const zero = new ZeroRank({
        ...o,
        buckets: this.#buckets,
        scaler: this.scaler,
        optimizer: (c, plan) => optimizer(c, store, plan),
        compressedAllReduce: (b, key) => this.#compressedAllReduce(b, key),
      });
      this.#zero = zero;
      this.partition = zero.partition;
      this.optimizer = zero.optimizer;
      return;
    }
    this.partition = null;
    if (o.offload) {
      const hostCtx = new Context(new CpuBackend(), { seed: o.seed });
      this.#host = { ctx: hostCtx, store: store.mirror(hostCtx) };
    }
    this.optimizer = this.#host ? optimizer(this.#host.ctx, this.#host.store) : optimizer(ctx, store);
  }

  /** What this rank holds for the model, read from its allocations (and the arena's high-water mark). */
  get memory(): ModelMemory {
    const { model, ctx, ranks } = this.#o;
    const store = model.store;
    const hostPart = this.#zero?.hostPart ?? null;
    return {
      stage: this.zero,
      ranks,
      params: this.#zero?.ownedParams?.bytes ?? store.values.bytes,
      paramCount: store.paramCount,
      grads: store.holdsGradSlab ? store.grads.bytes : (this.#zero?.ownedGrads?.bytes ?? 0),
      optimizer: this.#host || hostPart ? 0 : this.#optimizerBytes,
      host: this.#host
        ? this.#host.store.values.bytes + this.#host.store.grads.bytes + this.#optimizerBytes
        : hostPart
          ? hostPart.params.bytes + hostPart.grads.bytes + this.#optimizerBytes
          : 0,
      // the host buffers buckets travel through (compression: the residuals and the all-gathered encodings too)
      buckets: this.#buckets.list.reduce(
        (sum, b) =>
          sum +
          b.buf.byteLength +
          (b.dev?.bytes ?? 0) +
          (b.feedback?.residual.byteLength ?? 0) +
          (b.gathered?.byteLength ?? 0),
        0,
      ),
      arenaPeak: ctx.arena.highWaterBytes,
      gatheredPeak: this.#zero?.gatheredPeak ?? 0,
    };
  }

  get #optimizerBytes(): number {
    return this.optimizer.stateSlabs().reduce((sum, s) => sum + s.allocation.bytes, 0);
  }

  /** Where the optimizer's state lives: host memory when offloaded, else the device. */
  get optimizerBackend(): Backend {
    return this.#host?.ctx.backend ?? this.#zero?.optimizerBackend ?? this.#o.ctx.backend;
  }

  /** Sizes of the buckets in elements, in the order they are reduced (after the first step). */
  get bucketSizes(): number[] {
    return this.#buckets.list.map((b) => b.numel);
  }

  /**
   * One step: forward/backward over `micro` (this rank's `rows` samples), the averaged gradient
   * over all ranks (`totalRows` samples), and the update at `lr`.
   */
  async step(
    step: number,
    micro: readonly HostBatch[],
    rows: number,
    totalRows: number,
    lr: number,
  ): Promise<DataParallelStepResult> {
    this.codec.atStep(step, this.#o.warmupSteps);
    this.#dense = { nonzero: 0, total: 0 };
    const s = { step, micro, rows, totalRows, lr };
    if (this.#zero === null) return this.#stepReplica(s);
    const { loss, update, times } = await this.#zero.step(s);
    return this.#result(step, loss, update, times);
  }

  /** Stage 0: each bucket all-reduced as backward completes it, then the same update on every rank. */
  async #stepReplica({ step, micro, rows, totalRows, lr }: StepArgs): Promise<DataParallelStepResult> {
    const { ctx, model } = this.#o;
    const backend = ctx.backend;
    const store = model.store;
    const buckets = this.#buckets;
    const t0 = performance.now();
    const collective = this.#o.collective();
    const flight = new InFlight();
    const onDevice = this.#o.deviceCollective?.() ?? null;
    buckets.provide(onDevice !== null, (bytes) => ctx.allocPersistent(bytes));
    const launch = (b: Bucket) => {
      const key = { step, bucket: b.id };
      if (onDevice !== null && b.dev !== null) {
        // device to device on the backend's stream; NCCL's all-reduce is queued after the copies
        this.#bucketCopies(b, "in");
        // compression: where the sum crosses hosts (a hierarchy's leaders), encoded with this
        // bucket's error feedback; NCCL within a host moves f32
        const between = b.feedback ? this.#groupSum(b) : undefined;
        flight.add(onDevice.allReduce({ ptr: b.dev.ptr, count: b.numel }, key, "sum", between));
        return;
      }
      for (const [e, part] of slices(b)) backend.download(store.grads.ptr + e.offset * 4, part);
      flight.add(b.feedback ? this.#compressedAllReduce(b, key) : collective.allReduce(b.buf, key, "sum"));
    };
    store.zeroGrad();
    const k = micro.length;
    // the rank's share of the global batch is folded into the loss's seed, so the gradients
    // come out of backward already weighted and the buckets' sum is the global mean
    const dloss = ((this.scaler?.scale ?? 1) * (totalRows > 0 ? rows / totalRows : 0)) / Math.max(k, 1);
    const losses = new LossSlots(ctx, k);
    const left = buckets.left();
    for (let i = 0; i < k; i++) {
      const l = forwardPass(ctx, model, micro[i]!);
      losses.keep(i, l);
      if (i < k - 1) ctx.backward(l, dloss);
      else await backwardByBucket(ctx, buckets, l, dloss, (b) => oneLess(left, b) && launch(b), flight);
    }
    const loss = losses.mean(step, false);
    // buckets not launched yet: a rank without samples this step, or gradients no op wrote
    for (const b of buckets.list) if (left.get(b)! > 0) launch(b);
    const tBackward = performance.now();
    await flight.all();
    // NCCL on a stream of its own: the copies back and the update wait for it on the GPU
    await onDevice?.join?.();
    const tReduced = performance.now();
    // offload: the reduced gradients stay on the host, in the mirror the optimizer runs on
    const [gradCtx, gradStore] = this.#host ? [this.#host.ctx, this.#host.store] : [ctx, store];
    for (const b of buckets.list) {
      if (onDevice !== null) this.#bucketCopies(b, "out");
      else for (const [e, part] of slices(b)) gradCtx.backend.upload(gradStore.grads.ptr + e.offset * 4, part);
    }
    // a non-finite loss stops the job, but only after the reduction: the peers are not left
    // waiting for this rank's buckets
    if (!Number.isFinite(loss)) throw new NonFiniteLossError(step, loss);
    const { finite, gradNorm, gradScale } = unscaleAndClip(gradCtx, gradStore, this.scaler, this.#o.gradClip, true);
    if (finite) {
      this.optimizer.step(lr, gradScale);
      // offload: the updated master parameters back to the device
      if (this.#host) store.writeValues(this.#host.store.readValues());
    }
    return this.#result(step, loss, { finite, gradNorm }, (t1) => ({
      computeMs: tBackward - t0 + (t1 - tReduced),
      commMs: flight.count > 0 ? tReduced - flight.firstStart : 0,
      exposedCommMs: tReduced - tBackward,
    }));
  }

  /**
   * The step's result once its update ran (or was skipped: not finite); the loss scale follows.
   * `times` gets the step's end.
   */
  #result(
    step: number,
    loss: number,
    u: { finite: boolean; gradNorm: number },
    times: (t1: number) => Pick<DataParallelStepResult, "computeMs" | "commMs" | "exposedCommMs">,
  ): DataParallelStepResult {
    this.#updateScale(u.finite, step);
    return { loss, gradNorm: u.gradNorm, skipped: !u.finite, ...times(performance.now()), density: this.#density };
  }

  /** Device buckets: the gradients of b's parameters into its device buffer ("in"), or the
   *  reduced buffer back into the gradient slab ("out"); device-to-device copies. */
  #bucketCopies(b: Bucket, way: "in" | "out"): void {
    const backend = this.#o.ctx.backend;
    const grads = this.#o.model.store.grads.ptr;
    let at = 0;
    for (const e of b.entries) {
      const [slab, buf] = [grads + e.offset * 4, b.dev!.ptr + at * 4];
      if (way === "in") backend.copy(buf, slab, e.numel * 4);
      else backend.copy(slab, buf, e.numel * 4);
      at += e.numel;
    }
  }

  /**
   * ZeRO stage 3: every bucket's parameters gathered and bound (an evaluation runs the whole
   * model at once). Every rank calls it at the same step boundary; releaseAll() undoes it.
   */
  async gatherAll(step: number): Promise<void> {
    await this.#zero?.gatherAll(step);
  }

  /**
   * The whole parameter slab as this rank sees it. At stage 3 it is gathered (a collective: every
   * rank calls it at the same step boundary, `step`).
   */
  async readValues(step: number): Promise<Float32Array> {
    const store = this.#o.model.store;
    if (this.zero !== 3) return store.readValues();
    await this.gatherAll(step);
    const out = new Float32Array(store.slabNumel);
    for (const e of store.entries)
      this.#o.ctx.backend.download(store.param(e.name).ptr, out.subarray(e.offset, e.offset + e.numel));
    await this.releaseAll();
    return out;
  }

  /** ZeRO stage 3: waits for the gathers in flight and frees every gathered bucket. */
  async releaseAll(): Promise<void> {
    await this.#zero?.releaseAll();
  }

  /**
   * A compressed bucket's sum over the ranks into b.buf: round the ring encoded (bf16, fp16,
   * int8), or this rank's gradient plus its residual encoded into its slot, every rank's slot
   * all-gathered, and the decoded slots added up in rank order (top-k). Every rank computes the
   * same sum, bit for bit.
   */
  #compressedAllReduce(b: Bucket, key: { step: number; bucket: number }): Promise<void> {
    const collective = this.#o.collective();
    const codec = this.codec;
    if (codec.kind !== "topk" && collective.encodedAllReduce !== undefined) {
      const coder = b.feedback!.wireCoder((words) => {
        if (b.gathered === null || b.gathered.length < words) b.gathered = new Float32Array(words);
        return b.gathered;
      });
      return collective.encodedAllReduce(b.buf, key, coder);
    }
    const every: HostGroup = {
      rank: this.#o.rank,
      size: this.#o.ranks,
      allGather: (x, k) => collective.allGather(x, k),
    };
    return this.#compressedSum(b, b.buf, every, key);
  }

  /** Bucket b's compressed sum, for a device collective to run where the sum crosses hosts. */
  #groupSum(b: Bucket): GroupSum {
    return (x, group, key) => this.#compressedSum(b, x, group, key);
  }

  /**
   * `x` (bucket b's values on this member) summed over `group` in place: this member's encoding
   * (with the bucket's error feedback) all-gathered, and every member's decoded and added in
   * member order, so every member ends with the same sum.
   */
  async #compressedSum(b: Bucket, x: Float32Array, group: HostGroup, key: OpKey): Promise<void> {
    const codec = this.codec;
    const width = codec.slotBytes(b.numel);
    // top-k's slots follow its warm-up (the same width on every rank at a step)
    if (b.gathered?.byteLength !== group.size * width) b.gathered = new Float32Array((group.size * width) / 4);
    const all = b.gathered!;
    const slotOf = (r: number) => new Uint8Array(all.buffer, all.byteOffset + r * width, width);
    b.feedback!.encode(x, slotOf(group.rank));
    await group.allGather(all, key);
    x.fill(0);
    for (let r = 0; r < group.size; r++) {
      try {
        codec.decode(slotOf(r), x, true);
      } catch (e) {
        throw new BadPieceError(
          `rank ${r}'s ${codec.kind} encoding of bucket ${b.id} at step ${key.step}: ${(e as Error).message}`,
          { cause: e },
        );
      }
    }
    if (codec.kind === "topk") {
      this.#dense.nonzero += density(x) * b.numel;
      this.#dense.total += b.numel;
    }
  }

  get #density(): number {
    return this.#dense.total > 0 ? this.#dense.nonzero / this.#dense.total : -1;
  }

  /** The loss scaler's update; the residuals follow its scale (they are in the scaled gradient's units). */
  #updateScale(finite: boolean, step: number): void {
    if (this.scaler === null) return;
    const before = this.scaler.scale;
    this.scaler.update(finite, step);
    const factor = this.scaler.scale / before;
    if (factor !== 1) for (const b of this.#buckets.list) b.feedback?.rescale(factor);
  }

  /**
   * Compares the ranks' parameters: every rank all-gathers every rank's 63-bit hash of its
   * parameter slab. A difference throws ReplicaDivergedError naming the ranks (on every rank).
   */
  async checkReplicas(step: number): Promise<void> {
    const { ranks, rank, model } = this.#o;
    if (this.zero === 3) return; // each rank holds only its partition of the parameters: no replica to compare
    const { differ, hashOf } = await compareCopies(this.#o.collective(), model.store.readValues(), rank, ranks, step);
    if (differ.length > 0) {
      throw new ReplicaDivergedError(
        `the replicas diverged by step ${step}: the parameters of rank${differ.length > 1 ? "s" : ""} ${differ.join(", ")} ` +
          `hash ${differ.map(hashOf).join(", ")}, rank 0's ${hashOf(0)}; every rank should apply the same averaged gradient`,
      );
    }
  }

  /** The communicator was replaced (a restore, a new generation): stage 3's gathers are counted afresh. */
  communicatorReplaced(): void {
    this.#zero?.communicatorReplaced();
  }

  /** The optimizer's state slabs, whole, as host copies (a snapshot of the replica). */
  readOptimizerState(): { name: string; data: Float32Array }[] {
    const store = this.#o.model.store;
    return this.optimizer.stateSlabs().map((s) => {
      const data = new Float32Array(store.slabNumel);
      this.optimizerBackend.download(s.allocation.ptr, data);
      return { name: s.name, data };
    });
  }

  /**
   * ZeRO: `count` values of this rank's partition at slab offset `offset` (packed at `packed`):
   * its parameters (its own at stage 3, the replicated slab's below) and its optimizer state.
   */
  readPartitionRange(offset: number, count: number, packed: number): { params: Float32Array; state: Float32Array[] } {
    if (this.#zero === null) throw new EngineError("readPartitionRange: at ZeRO stage 0 a rank holds no partition");
    return this.#zero.readRange(offset, count, packed);
  }

  /**
   * Loads a whole replica (a restore, in the slab's layout): parameters, optimizer state (ZeRO:
   * this rank keeps its partition's ranges, whatever stage and number of ranks saved it), the step
   * count and the loss scale. The gradients and the compression residuals are dropped.
   */
  load(st: { values: Float32Array; states: Float32Array[]; optimizerSteps: number; lossScale: number }): void {
    const store = this.#o.model.store;
    const { values, states } = st;
    if (this.#zero !== null) this.#zero.load(values, states);
    else {
      store.writeValues(values);
      this.#host?.store.writeValues(values);
      this.optimizer.stateSlabs().forEach((s, i) => this.optimizerBackend.upload(s.allocation.ptr, states[i]!));
    }
    this.optimizer.setStepCount(st.optimizerSteps);
    if (this.scaler !== null && st.lossScale > 0) this.scaler.restoreScale(st.lossScale);
    store.zeroGrad();
    // the residuals belong to the steps the restore abandoned
    for (const b of this.#buckets.list) b.feedback?.reset();
  }

  /** Frees the host memory of offload. */
  dispose(): void {
    this.#host?.ctx.dispose();
    this.#zero?.dispose();
  }
}
