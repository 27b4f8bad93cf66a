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
// Buckets: parameters are grouped, in the order backward completes their gradients, into
// buckets of about `bucketMb`. The order comes from the tape of a forward pass over `probe` (the
// first op to read a parameter is the last backward op to write its gradient); every rank runs
// the same model, so every rank cuts the same buckets. A bucket's all-reduce starts as soon as
// backward has written its last gradient; backward yields to the event loop between ops while a
// bucket is in flight, so its pieces move while the next gradients are computed.
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
// there with the CPU kernels, and the updated parameters go back to the device. With ZeRO
// (stages 1-3) each rank's host holds only its partition: the master copy of its ranges, their
// reduced gradients and their optimizer state (the plan's packed layout). Each bucket's
// reduce-scattered segment goes from the bucket's host buffer straight into the host's gradients
// as soon as it arrives, while backward computes the next buckets; once the norm is known the
// host updates the partition and its parameters go back to the device (stage 3: into the
// partition the gathers read), and the all-gather spreads them as without offload. Stages 2 and
// 3 then keep no gradient partition on the device at all.
import type { Allocation, Backend, Ptr } from "../../ffi/backend.ts";
import { CpuBackend } from "../../ffi/cpu/backend.ts";
import { EngineError, NonFiniteLossError } from "../errors.ts";
import type { Model } from "../models/model.ts";
import { LossScaler } from "../optim/loss-scale.ts";
import { clipFactor } from "../optim/clip.ts";
import type { Optimizer, UpdatePlan } from "../optim/optimizer.ts";
import { optimizerOf } from "../optim/choose.ts";
import type { ParamEntry, ParamStore } from "../params.ts";
import { type Tensor } from "../tensor.ts";
import { Context } from "../context.ts";
import { forwardPass, type HostBatch, LossSlots, unscaleAndClip, uploadBatch } from "../train.ts";
import {
  BadPieceError,
  type BlockLayout,
  blockLayout,
  type Collective,
  type GroupSum,
  type HostGroup,
  type OpKey,
} from "./collective.ts";
import type { DeviceBuffer } from "./nccl-collective.ts";
import { Codec, density, ErrorFeedback, parseCompression } from "./compress.ts";
import { type ModelMemory, type Partition, partitionOf, type ZeroStage } from "./zero.ts";

/** Bucket ids at and above this name the replica check's operations, not gradient buckets. */
const checkBucket = 1 << 24;
/** ZeRO: the all-reduce of the partitions' overflow counts and sums of squares */
const statsBucket = (1 << 24) - 1;
/** ZeRO: bucket b's parameters are all-gathered as bucket gatherBucket + b */
const gatherBucket = 1 << 23;
/** ZeRO stage 3: the step's n-th gather of a bucket's parameters is bucket paramGatherBucket + n */
const paramGatherBucket = 1 << 22;
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

/** The optimizer every rank runs (a job's `optimizer` setting). */
export type OptimizerSpec =
  | { kind: "sgd"; momentum: number; nesterov: boolean; weightDecay: number }
  | { kind: "adamw"; beta1: number; beta2: number; eps: number; weightDecay: number };

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

interface Bucket {
  id: number;
  entries: ParamEntry[];
  /** elements over its entries */
  numel: number;
  /** the host array the bucket is reduced in (empty while the bucket takes the device path) */
  buf: Float32Array;
  /** deviceCollective: the bucket's device buffer, all-reduced in place (null until the first
   *  step on the device path) */
  dev: Allocation | null;
  /** compression: the bucket's error feedback, and the encodings it travels as (the encoded
   *  ring's scratch, or every rank's encoding all-gathered) */
  feedback: ErrorFeedback | null;
  gathered: Float32Array | null;
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

/** Offload with ZeRO: a rank's partition in host memory (master parameters, reduced gradients,
 *  packed as the optimizer state; scratch to add a micro-batch's gradients in). */
interface HostPartition {
  ctx: Context;
  params: Allocation;
  grads: Allocation;
  scratch: Allocation;
}

/** One step's inputs: this rank's micro-batches (`rows` samples of the step's `totalRows`) and the learning rate. */
interface StepArgs {
  step: number;
  micro: readonly HostBatch[];
  rows: number;
  totalRows: number;
  lr: number;
}

/** Each parameter of bucket b with its part of the bucket's host buffer, in order. */
function* slices(b: Bucket): Generator<[ParamEntry, Float32Array]> {
  let at = 0;
  for (const e of b.entries) {
    yield [e, b.buf.subarray(at, at + e.numel)];
    at += e.numel;
  }
}

/** A step's collectives in flight: how many, since when, and all of them to await. */
class InFlight {
  #pending: Promise<void>[] = [];
  #running = 0;
  /** operations started this step */
  count = 0;
  /** when the first started (Infinity: none yet) */
  firstStart = Infinity;

  add(op: Promise<void>): void {
    this.firstStart = Math.min(this.firstStart, performance.now());
    this.count++;
    this.#running++;
    const tracked = op.finally(() => this.#running--);
    tracked.catch(() => {}); // awaited by all()
    this.#pending.push(tracked);
  }

  /** Whether any is still running (backward then yields to let its pieces move). */
  get busy(): boolean {
    return this.#running > 0;
  }

  /** Waits for every operation added so far; the next ones start a new batch. */
  async all(): Promise<void> {
    const pending = this.#pending;
    this.#pending = [];
    await Promise.all(pending);
  }
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
  /** offload: the host mirror of the parameter store the optimizer runs on */
  readonly #host: { ctx: Context; store: ParamStore } | null = null;
  /** offload with ZeRO: the host's partition (master parameters, reduced gradients, packed as the
   *  optimizer state; scratch to add a micro-batch's gradients in) */
  readonly #hostPart: HostPartition | null = null;
  /** top-k: nonzero and total entries of the summed buckets this step */
  #dense = { nonzero: 0, total: 0 };
  /** ZeRO stage 2: the partition's reduced gradients, and scratch to add a micro-batch's into them */
  readonly #ownedGrads: Allocation | null = null;
  readonly #addScratch: Allocation | null = null;
  /** ZeRO stage 3: the partition's f32 parameters (packed as the optimizer state), the buckets
   *  gathered now (device buffers the parameters are bound to) and those on their way */
  readonly #ownedParams: Allocation | null = null;
  readonly #gathered = new Map<number, Allocation>();
  readonly #gathering = new Map<number, Promise<void>>();
  #gatheredBytes = 0;
  #gatheredPeak = 0;
  /** gatherAll() is under way (its gathers do not count toward the training passes' peak) */
  #whole = false;
  #gatherSeq = { step: -1, n: 0 };
  /** the buckets each part of the forward pass reads (lossSteps on the probe batch), in order */
  #forwardPlan: number[][] = [];
  #buckets: Bucket[] | null = null;
  #bucketOf = new Map<string, Bucket>();

  constructor(o: DataParallelOptions) {
    this.#o = o;
    const { ctx, model } = o;
    const backend = ctx.backend;
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
    const buckets = this.#plan();
    this.zero = o.zero;
    this.partition = o.zero > 0 ? partitionOf(buckets, o.ranks, o.rank) : null;
    let plan: UpdatePlan | undefined;
    const offload = o.offload;
    if (this.partition !== null) {
      const part = this.partition;
      const widest = Math.max(1, ...part.ranges.flat().map((r) => r.numel));
      if (o.zero >= 2) {
        store.releaseGradSlab();
        if (!offload) {
          this.#ownedGrads = ctx.allocPersistent(Math.max(part.numel, 1) * 4);
          this.#addScratch = ctx.allocPersistent(widest * 4);
        }
      }
      if (o.zero === 3) {
        // every rank initialized the whole model from the seed; it keeps its partition
        const owned = ctx.allocPersistent(Math.max(part.numel, 1) * 4);
        for (const r of part.ranges.flat())
          backend.copy(owned.ptr + r.stateOffset * 4, store.values.ptr + r.paramOffset * 4, r.numel * 4);
        this.#ownedParams = owned;
        store.releaseValueSlab();
      }
      plan = { ranges: part.ranges.flat(), stateNumel: part.numel, grads: this.#ownedGrads, params: this.#ownedParams };
      if (offload) {
        const hostCtx = new Context(new CpuBackend(), { seed: o.seed });
        const bytes = Math.max(part.numel, 1) * 4;
        const hp = {
          ctx: hostCtx,
          params: hostCtx.allocPersistent(bytes),
          grads: hostCtx.allocPersistent(bytes),
          scratch: hostCtx.allocPersistent(widest * 4),
        };
        // the master copy of the partition, from the device's (every rank initialized alike)
        for (const r of part.ranges.flat()) {
          const v = new Float32Array(r.numel);
          backend.download(
            this.#ownedParams !== null
              ? this.#ownedParams.ptr + r.stateOffset * 4
              : store.values.ptr + r.paramOffset * 4,
            v,
          );
          hostCtx.backend.upload(hp.params.ptr + r.stateOffset * 4, v);
        }
        this.#hostPart = hp;
        plan = { ranges: part.ranges.flat(), stateNumel: part.numel, grads: hp.grads, params: hp.params };
      }
    } else if (offload) {
      const hostCtx = new Context(new CpuBackend(), { seed: o.seed });
      this.#host = { ctx: hostCtx, store: store.mirror(hostCtx) };
    }
    const opt = o.optimizer;
    const [optCtx, optStore] = this.#host ? [this.#host.ctx, this.#host.store] : [this.#hostPart?.ctx ?? ctx, store];
    this.optimizer = optimizerOf(optCtx, optStore, opt, { plan, sparse: this.codec.kind === "topk" });
    this.scaler = ctx.precision === "f16" ? new LossScaler() : null;
  }

  /** What this rank holds for the model, read from its allocations (and the arena's high-water mark). */
  get memory(): ModelMemory {
    const { model, ctx, ranks } = this.#o;
    const store = model.store;
    return {
      stage: this.zero,
      ranks,
      params: this.#ownedParams?.bytes ?? store.values.bytes,
      paramCount: store.paramCount,
      grads: store.holdsGradSlab ? store.grads.bytes : (this.#ownedGrads?.bytes ?? 0),
      optimizer: this.#host || this.#hostPart ? 0 : this.#optimizerBytes,
      host: this.#host
        ? this.#host.store.values.bytes + this.#host.store.grads.bytes + this.#optimizerBytes
        : this.#hostPart
          ? this.#hostPart.params.bytes + this.#hostPart.grads.bytes + this.#optimizerBytes
          : 0,
      // the host buffers buckets travel through (compression: the residuals and the all-gathered encodings too)
      buckets: (this.#buckets ?? []).reduce(
        (sum, b) =>
          sum +
          b.buf.byteLength +
          (b.dev?.bytes ?? 0) +
          (b.feedback?.residual.byteLength ?? 0) +
          (b.gathered?.byteLength ?? 0),
        0,
      ),
      arenaPeak: ctx.arena.highWaterBytes,
      gatheredPeak: this.#gatheredPeak,
    };
  }

  get #optimizerBytes(): number {
    return this.optimizer.stateSlabs().reduce((sum, s) => sum + s.allocation.bytes, 0);
  }

  /** Where the optimizer's state lives: host memory when offloaded, else the device. */
  get #optBackend(): Backend {
    return this.#host?.ctx.backend ?? this.#hostPart?.ctx.backend ?? this.#o.ctx.backend;
  }

  /**
   * The buckets, cut from the tape of a forward pass over a one-row batch of zeros shaped as the
   * job's (nothing is computed backward). Every rank cuts the same ones.
   */
  #plan(): Bucket[] {
    if (this.#buckets) return this.#buckets;
    const { ctx, model, bucketMb } = this.#o;
    const store = model.store;
    ctx.newPass();
    const { x, y } = uploadBatch(ctx, this.#o.probe);
    const parts: (readonly string[])[] = [];
    const steps = model.lossSteps(x, y);
    for (let r = steps.next(); !r.done; r = steps.next()) parts.push(r.value);
    const order = ctx.gradReadyOrder().flat();
    ctx.newPass();
    const seen = new Set<string>();
    const entries: ParamEntry[] = [];
    for (const t of order) {
      if (t.name === undefined || seen.has(t.name)) continue;
      seen.add(t.name);
      entries.push(store.entry(t.name));
    }
    // parameters no op reads have zero gradients; they ride in the last bucket
    for (const e of store.entries) if (!seen.has(e.name)) entries.push(e);
    const capElems = Math.max(1, Math.floor((bucketMb * 1e6) / 4));
    const buckets: Bucket[] = [];
    let cur: ParamEntry[] = [],
      n = 0;
    const codec = this.codec;
    const onDevice = this.#o.deviceCollective !== undefined;
    const close = () => {
      const lossy = codec.lossy;
      buckets.push({
        id: buckets.length,
        entries: cur,
        numel: n,
        // with a device collective, which path the buckets take is known at the first step
        buf: new Float32Array(onDevice ? 0 : n),
        dev: null,
        feedback: lossy ? new ErrorFeedback(codec, n) : null,
        gathered: null, // sized by the path the bucket takes, at its first step
      });
      cur = [];
      n = 0;
    };
    for (const e of entries) {
      cur.push(e);
      n += e.numel;
      if (n >= capElems) close();
    }
    if (cur.length > 0) close();
    this.#buckets = buckets;
    for (const bk of buckets) for (const e of bk.entries) this.#bucketOf.set(e.name, bk);
    this.#forwardPlan = parts.map((names) => this.#bucketIds(names));
    return buckets;
  }

  /** Sizes of the buckets in elements, in the order they are reduced (after the first step). */
  get bucketSizes(): number[] {
    return (this.#buckets ?? []).map((b) => b.numel);
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
    const s = { step, micro, rows, totalRows, lr };
    return this.zero > 0 ? this.#stepZero(s) : this.#stepReplica(s);
  }

  /** Stage 0: each bucket all-reduced as backward completes it, then the same update on every rank. */
  async #stepReplica({ step, micro, rows, totalRows, lr }: StepArgs): Promise<DataParallelStepResult> {
    const { ctx, model } = this.#o;
    const backend = ctx.backend;
    const store = model.store;
    const buckets = this.#plan();
    const t0 = performance.now();
    const collective = this.#o.collective();
    const flight = new InFlight();
    const onDevice = this.#o.deviceCollective?.() ?? null;
    this.#bucketMemory(buckets, onDevice !== null);
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
    this.#dense = { nonzero: 0, total: 0 };
    const k = micro.length;
    // the rank's share of the global batch is folded into the loss's seed, so the gradients
    // come out of backward already weighted and the buckets' sum is the global mean
    const dloss = ((this.scaler?.scale ?? 1) * (totalRows > 0 ? rows / totalRows : 0)) / Math.max(k, 1);
    const losses = new LossSlots(ctx, k);
    const left = new Map(buckets.map((b) => [b, b.entries.length]));
    for (let i = 0; i < k; i++) {
      const l = forwardPass(ctx, model, micro[i]!);
      losses.keep(i, l);
      if (i < k - 1) ctx.backward(l, dloss);
      else await this.#backward(l, dloss, step, (b) => this.#oneLess(left, b) && launch(b), flight);
    }
    const loss = losses.mean(step, false);
    // buckets not launched yet: a rank without samples this step, or gradients no op wrote
    for (const b of buckets) if (left.get(b)! > 0) launch(b);
    const tBackward = performance.now();
    await flight.all();
    // NCCL on a stream of its own: the copies back and the update wait for it on the GPU
    await onDevice?.join?.();
    const tReduced = performance.now();
    // offload: the reduced gradients stay on the host, in the mirror the optimizer runs on
    const [gradCtx, gradStore] = this.#host ? [this.#host.ctx, this.#host.store] : [ctx, store];
    for (const b of buckets) {
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

  /** With a device collective: each bucket's device buffer (stage 0), or its host array where
   *  this generation's communicator is on the host path, made once (the first step) and kept. */
  #bucketMemory(buckets: readonly Bucket[], onDevice: boolean): void {
    for (const b of buckets) {
      // ZeRO's reductions on the device take their buffers from the allocator, one at a time
      if (onDevice) {
        if (this.zero === 0) b.dev ??= this.#o.ctx.allocPersistent(Math.max(b.numel, 1) * 4);
      } else if (b.buf.length !== b.numel) b.buf = new Float32Array(b.numel);
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
  readonly #layouts = new Map<number, BlockLayout>();

  /**
   * ZeRO on device buffers: `count` elements of bucket b from bucket offset `at` copied between
   * the bucket's device buffer `dev` (block layout) and `ptr` ("in": ptr to dev; "out": dev to
   * ptr), a copy per segment they span.
   */
  #blockCopies(b: Bucket, dev: Ptr, at: number, count: number, ptr: Ptr, way: "in" | "out"): void {
    const backend = this.#o.ctx.backend;
    for (const span of this.#blocks(b).spans(at, count)) {
      const [d, h] = [dev + span.device * 4, ptr + (span.at - at) * 4];
      if (way === "in") backend.copy(d, h, span.count * 4);
      else backend.copy(h, d, span.count * 4);
    }
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

  /** Counts one more of bucket b's gradients as written; whether that was its last. */
  #oneLess(left: Map<Bucket, number>, b: Bucket): boolean {
    const n = left.get(b)! - 1;
    left.set(b, n);
    return n === 0;
  }

  /**
   * Backward from loss `l` (seed `seed`), one tape node at a time: each parameter gradient it
   * completes goes to `ready` (its bucket), and while buckets are in flight backward yields to
   * the event loop between nodes, so their pieces move while the next gradients are computed.
   * Stage 3 gathers the parameters each node reads before it runs.
   */
  async #backward(l: Tensor, seed: number, step: number, ready: (b: Bucket) => void, flight: InFlight): Promise<void> {
    const ctx = this.#o.ctx;
    if (this.zero === 3) {
      for (const ev of ctx.backwardEvents(l, seed)) {
        if ("need" in ev) await this.#gatherFor(ev.need, step);
        else for (const t of ev.ready) ready(this.#bucketFor(t));
        if (flight.busy) await new Promise<void>((r) => setImmediate(r));
      }
      return;
    }
    for (const done of ctx.backwardSteps(l, seed)) {
      for (const t of done) ready(this.#bucketFor(t));
      if (flight.busy) await new Promise<void>((r) => setImmediate(r));
    }
  }

  /**
   * A ZeRO step. Stage 1: backward into the gradient slab as at stage 0, each bucket
   * reduce-scattered (this rank keeps the sums of its partition, in the slab). Stage 2: every
   * micro-batch's backward writes into the arena, and each bucket is reduce-scattered as soon as
   * it is complete; the partition's sums are added up in a buffer of the partition's size.
   * Then: overflow and the global norm from every rank's partition (one small all-reduce), the
   * optimizer on the partition, and each bucket's updated parameters all-gathered.
   */
  async #stepZero({ step, micro, rows, totalRows, lr }: StepArgs): Promise<DataParallelStepResult> {
    const t0 = performance.now();
    if (this.#o.deviceCollective !== undefined) this.#bucketMemory(this.#plan(), this.#deviceColl !== null);
    const flight = new InFlight();
    const loss = await this.#zeroPasses({ step, micro, rows, totalRows, lr }, flight);
    const tBackward = performance.now();
    await flight.all();
    if (!Number.isFinite(loss)) throw new NonFiniteLossError(step, loss);
    const { finite, gradNorm } = await this.#zeroUpdate(step, lr);
    // every rank's updated partition to every rank (stage 3 gathers them as the next pass needs them)
    if (finite && this.zero < 3) await this.#gatherUpdated(step);
    return this.#result(step, loss, { finite, gradNorm }, (t1) => ({
      computeMs: tBackward - t0,
      commMs: t1 - Math.min(flight.firstStart, tBackward),
      exposedCommMs: t1 - tBackward,
    }));
  }

  /**
   * ZeRO: the micro-batches' passes, each bucket reduce-scattered as backward completes it (stage
   * 2: every micro-batch's, its gradients living in that pass's arena; the ranks agree on the
   * rounds, so a rank with fewer micro-batches reduces zeros). Returns the mean loss; the
   * reductions are in `flight`.
   */
  async #zeroPasses({ step, micro, rows, totalRows }: StepArgs, flight: InFlight): Promise<number> {
    const { ctx, model } = this.#o;
    const store = model.store;
    const buckets = this.#plan();
    const stage2 = this.zero >= 2;
    const stage3 = this.zero === 3;
    const k = micro.length;
    const dloss = ((this.scaler?.scale ?? 1) * (totalRows > 0 ? rows / totalRows : 0)) / Math.max(k, 1);
    const rounds = stage2 ? Math.max(this.#o.accumSteps, k, 1) : 1;
    const losses = new LossSlots(ctx, k);
    store.zeroGrad();
    this.#dense = { nonzero: 0, total: 0 };
    for (let i = 0; i < Math.max(k, rounds); i++) {
      const round = stage2 ? i : 0;
      if (stage2) store.zeroGrad(); // drops the last pass's arena gradients
      const left = new Map(buckets.map((b) => [b, b.entries.length]));
      const complete = (b: Bucket) => {
        if (!this.#oneLess(left, b)) return;
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
        await this.#backward(l, i < k ? dloss : 0, step, complete, flight);
      }
      if (stage3) await this.releaseAll();
      if (i >= rounds) continue;
      for (const b of buckets) if (left.get(b)! > 0) flight.add(this.#reduceScatter(b, step, round));
      // the buckets' buffers are reused by the next round
      if (stage2 && i < Math.max(k, rounds) - 1) await flight.all();
    }
    return losses.mean(step, false);
  }

  /** The device collective of the current generation, or null (the host path). */
  get #deviceColl(): Collective<DeviceBuffer> | null {
    return this.#o.deviceCollective?.() ?? null;
  }

  /** ZeRO: bucket b's gradients of this round reduce-scattered; this rank keeps (adds in) its segment. */
  #reduceScatter(b: Bucket, step: number, round: number): Promise<void> {
    const backend = this.#o.ctx.backend;
    const store = this.#o.model.store;
    const stage2 = this.zero >= 2;
    const key = { step, bucket: round * this.#buckets!.length + b.id };
    const dc = this.#deviceColl;
    if (dc !== null) return this.#reduceScatterOnDevice(dc, b, key, round > 0);
    for (const [e, dst] of slices(b)) {
      const grad = stage2 ? store.gradOf(e.name) : null;
      if (!stage2) backend.download(store.grads.ptr + e.offset * 4, dst);
      else if (grad === null)
        dst.fill(0); // no op read it in this micro-batch
      else backend.download(grad.ptr, dst);
    }
    return (b.feedback ? this.#compressedAllReduce(b, key) : this.#o.collective().reduceScatter(b.buf, key)).then(() =>
      this.#keep(b, round > 0),
    );
  }

  /**
   * ZeRO: overflow and the global norm over every rank's partition (one small all-reduce; offload:
   * in host memory, where the partition's gradients are), then unscale, clip and the optimizer on
   * this rank's partition.
   */
  async #zeroUpdate(step: number, lr: number): Promise<{ finite: boolean; gradNorm: number }> {
    const store = this.#o.model.store;
    const ranges = this.partition!.ranges.flat();
    const hp = this.#hostPart;
    const gb = hp?.ctx.backend ?? this.#o.ctx.backend;
    const gradAt = (r: (typeof ranges)[number]) =>
      hp !== null
        ? hp.grads.ptr + r.stateOffset * 4
        : this.zero >= 2
          ? this.#ownedGrads!.ptr + r.stateOffset * 4
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
    const scale = this.scaler?.scale ?? 1;
    const gradNorm = Math.sqrt(stats[1]!) / scale;
    // unscaling and the clip in one factor, which the optimizer reads the gradients times
    this.optimizer.step(lr, (1 / scale) * clipFactor(gradNorm, this.#o.gradClip));
    // offload: the host's updated partition back to the device (stage 3: the packed partition)
    if (hp !== null) this.#partitionToDevice(hp);
    return { finite: true, gradNorm };
  }

  /** ZeRO stages 1-2: every rank's updated partition all-gathered into every rank's parameters. */
  async #gatherUpdated(step: number): Promise<void> {
    const backend = this.#o.ctx.backend;
    const store = this.#o.model.store;
    const buckets = this.#buckets!;
    const dc = this.#deviceColl;
    if (dc !== null) {
      // each bucket in a buffer of NCCL's block layout for this gather only (not given back after
      // a failure: see #reduceScatterOnDevice)
      const bufs = buckets.map((b) => backend.alloc(Math.max(this.#blocks(b).padded, 1) * 4));
      await Promise.all(
        buckets.map((b, i) => {
          for (const r of this.partition!.ranges[b.id]!)
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
      for (const r of this.partition!.ranges[b.id]!)
        backend.download(
          store.values.ptr + r.paramOffset * 4,
          b.buf.subarray(r.bucketOffset, r.bucketOffset + r.numel),
        );
      return collective.allGather(b.buf, { step, bucket: gatherBucket + b.id });
    });
    await Promise.all(gathers);
    for (const b of buckets) for (const [e, part] of slices(b)) backend.upload(store.values.ptr + e.offset * 4, part);
  }

  /** The buckets holding parameters `names`, in the order the names first come. */
  #bucketIds(names: readonly string[]): number[] {
    const ids: number[] = [];
    for (const n of names) {
      const b = this.#bucketOf.get(n);
      if (b !== undefined && !ids.includes(b.id)) ids.push(b.id);
    }
    return ids;
  }

  /**
   * ZeRO stage 3, one forward pass: before each part of the model's lossSteps its buckets are
   * gathered (the next part's are asked for at once, so their all-gather runs while this part
   * computes), and the buckets neither reads are freed (backward gathers them again).
   */
  async #lossGathered(x: Tensor, y: Tensor, step: number): Promise<Tensor> {
    const buckets = this.#buckets!;
    const steps = this.#o.model.lossSteps(x, y);
    let part = 0;
    for (let r = steps.next(); ; r = steps.next(), part++) {
      if (r.done) return r.value;
      const need = this.#bucketIds(r.value);
      const next = this.#forwardPlan[part + 1] ?? [];
      for (const id of [...this.#gathered.keys()])
        if (!need.includes(id) && !next.includes(id)) this.#release(buckets[id]!);
      const ready = need.map((id) => this.#gather(buckets[id]!, step));
      for (const id of next) if (!need.includes(id)) this.#gather(buckets[id]!, step).catch(() => {}); // awaited when its part comes
      await Promise.all(ready);
    }
  }

  /** ZeRO stage 3, backward: the buckets of the parameters a node reads, and the next bucket backward will need. */
  async #gatherFor(params: readonly Tensor[], step: number): Promise<void> {
    const buckets = this.#buckets!;
    const ids = this.#bucketIds(params.map((t) => t.name!)).filter((id) => !this.#gathered.has(id));
    if (ids.length === 0) return;
    const waits = ids.map((id) => this.#gather(buckets[id]!, step));
    const after = buckets[Math.max(...ids) + 1];
    if (after !== undefined) this.#gather(after, step).catch(() => {});
    await Promise.all(waits);
  }

  /**
   * ZeRO stage 3: all-gathers bucket b's parameters (every rank contributes its segment, from its
   * partition) into a device buffer and binds them to it. Every rank asks for the same gathers in
   * the same order, so the n-th of a step has the same key everywhere.
   */
  #gather(b: Bucket, step: number): Promise<void> {
    if (this.#gathered.has(b.id)) return Promise.resolve();
    const running = this.#gathering.get(b.id);
    if (running !== undefined) return running;
    if (this.#gatherSeq.step !== step) this.#gatherSeq = { step, n: 0 };
    const key = { step, bucket: paramGatherBucket + this.#gatherSeq.n++ };
    const { ctx, model } = this.#o;
    const backend = ctx.backend;
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
    for (const r of this.partition!.ranges[b.id]!)
      backend.download(
        this.#ownedParams!.ptr + r.stateOffset * 4,
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
    for (const r of this.partition!.ranges[b.id]!)
      this.#blockCopies(b, blocks.ptr, r.bucketOffset, r.numel, this.#ownedParams!.ptr + r.stateOffset * 4, "in");
    await dc.allGather({ ptr: blocks.ptr, count: layout.padded }, key);
    await dc.join?.();
    const alloc = ctx.allocPersistent(b.numel * 4);
    this.#blockCopies(b, blocks.ptr, 0, b.numel, alloc.ptr, "out");
    ctx.backend.free(blocks);
    return alloc;
  }

  /** ZeRO stage 3: unbinds bucket b's parameters and frees their buffer. */
  #release(b: Bucket): void {
    const a = this.#gathered.get(b.id);
    if (a === undefined) return;
    for (const e of b.entries) this.#o.model.store.bind(e.name, null);
    this.#o.ctx.freePersistent(a);
    this.#gathered.delete(b.id);
    this.#gatheredBytes -= a.bytes;
  }

  /**
   * ZeRO stage 3: every bucket's parameters gathered and bound (an evaluation runs the whole
   * model at once). Every rank calls it at the same step boundary; releaseAll() undoes it.
   */
  async gatherAll(step: number): Promise<void> {
    if (this.zero !== 3) return;
    this.#whole = true;
    try {
      await Promise.all(this.#buckets!.map((b) => this.#gather(b, step)));
    } finally {
      this.#whole = false;
    }
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
    if (this.zero !== 3) return;
    await Promise.allSettled([...this.#gathering.values()]);
    for (const b of this.#buckets!) this.#release(b);
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
    if (factor !== 1) for (const b of this.#buckets ?? []) b.feedback?.rescale(factor);
  }

  /** ZeRO: keeps this rank's segment of a reduce-scattered bucket (adds it in, for a later micro-batch). */
  #keep(b: Bucket, add: boolean): void {
    const { ctx, model } = this.#o;
    const backend = ctx.backend;
    const hp = this.#hostPart;
    for (const r of this.partition!.ranges[b.id]!) {
      const src = b.buf.subarray(r.bucketOffset, r.bucketOffset + r.numel);
      if (hp !== null) {
        // offload: the segment goes from the bucket's host buffer into the host's gradients
        const dst = hp.grads.ptr + r.stateOffset * 4;
        if (this.zero === 1 || !add) hp.ctx.backend.upload(dst, src);
        else {
          hp.ctx.backend.upload(hp.scratch.ptr, src);
          hp.ctx.backend.add(dst, dst, hp.scratch.ptr, r.numel);
        }
        continue;
      }
      if (this.zero === 1) {
        backend.upload(model.store.grads.ptr + r.paramOffset * 4, src);
        continue;
      }
      const dst = this.#ownedGrads!.ptr + r.stateOffset * 4;
      if (!add) {
        backend.upload(dst, src);
        continue;
      }
      backend.upload(this.#addScratch!.ptr, src);
      backend.add(dst, dst, this.#addScratch!.ptr, r.numel);
    }
  }

  /**
   * ZeRO on device buffers: bucket b's gradients copied into a buffer in NCCL's block layout
   * (the allocator's, for this reduction only: ZeRO 2 and 3 keep no gradient buffer of the whole
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
      const grad = this.zero >= 2 ? (store.gradOf(e.name)?.ptr ?? null) : store.grads.ptr + e.offset * 4;
      // a parameter no op read in this micro-batch: its zeros are already there
      if (grad !== null) this.#blockCopies(b, dev.ptr, at, e.numel, grad, "in");
      at += e.numel;
    }
    await dc.reduceScatter({ ptr: dev.ptr, count: layout.padded }, key);
    await dc.join?.(); // the keep's copies read what NCCL wrote
    this.#keepDevice(b, dev.ptr, add);
    backend.free(dev);
  }

  /** ZeRO on device buffers: #keep from the bucket's device buffer (this rank's block). */
  #keepDevice(b: Bucket, dev: Ptr, add: boolean): void {
    const { ctx, model } = this.#o;
    const backend = ctx.backend;
    const mine = this.#blocks(b);
    for (const r of this.partition!.ranges[b.id]!) {
      const [sp] = mine.spans(r.bucketOffset, r.numel); // within this rank's segment: one span
      const src = dev + sp!.device * 4;
      if (this.zero === 1) backend.copy(model.store.grads.ptr + r.paramOffset * 4, src, r.numel * 4);
      else {
        const dst = this.#ownedGrads!.ptr + r.stateOffset * 4;
        if (add) backend.add(dst, dst, src, r.numel);
        else backend.copy(dst, src, r.numel * 4);
      }
    }
  }

  /** Offload with ZeRO: the host's master partition to the device's parameters (the slab's
   *  ranges at stages 1-2; the packed partition at stage 3). */
  #partitionToDevice(hp: HostPartition): void {
    const { ctx, model } = this.#o;
    const backend = ctx.backend;
    const v = new Float32Array(this.partition!.numel);
    hp.ctx.backend.download(hp.params.ptr, v);
    if (this.#ownedParams !== null) {
      backend.upload(this.#ownedParams.ptr, v);
      return;
    }
    for (const r of this.partition!.ranges.flat())
      backend.upload(model.store.values.ptr + r.paramOffset * 4, v.subarray(r.stateOffset, r.stateOffset + r.numel));
  }

  #bucketFor(t: Tensor): Bucket {
    const b = t.name === undefined ? undefined : this.#bucketOf.get(t.name);
    if (b === undefined)
      throw new EngineError(
        `parameter ${t.name ?? "(unnamed)"} is in no gradient bucket: the tape differs from the one the buckets were cut from`,
      );
    return b;
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

  /** Where the optimizer's state lives: host memory when offloaded, else the device. */
  get optimizerBackend(): Backend {
    return this.#optBackend;
  }

  /** The communicator was replaced (a restore, a new generation): stage 3's gathers are counted afresh. */
  communicatorReplaced(): void {
    this.#gatherSeq = { step: -1, n: 0 };
  }

  /** The optimizer's state slabs, whole, as host copies (a snapshot of the replica). */
  readOptimizerState(): { name: string; data: Float32Array }[] {
    const store = this.#o.model.store;
    return this.optimizer.stateSlabs().map((s) => {
      const data = new Float32Array(store.slabNumel);
      this.#optBackend.download(s.allocation.ptr, data);
      return { name: s.name, data };
    });
  }

  /**
   * ZeRO: `count` values of this rank's partition at slab offset `offset` (packed at `packed`):
   * its parameters (its own at stage 3, the replicated slab's below) and its optimizer state.
   */
  readPartitionRange(offset: number, count: number, packed: number): { params: Float32Array; state: Float32Array[] } {
    const backend = this.#o.ctx.backend;
    const params = new Float32Array(count);
    if (this.#ownedParams !== null) backend.download(this.#ownedParams.ptr + packed * 4, params);
    else backend.download(this.#o.model.store.values.ptr + offset * 4, params);
    const state = this.optimizer.stateSlabs().map((s) => {
      const v = new Float32Array(count);
      this.#optBackend.download(s.allocation.ptr + packed * 4, v);
      return v;
    });
    return { params, state };
  }

  /**
   * Loads a whole replica (a restore, in the slab's layout): parameters, optimizer state (ZeRO:
   * this rank keeps its partition's ranges, whatever stage and number of ranks saved it), the step
   * count and the loss scale. The gradients and the compression residuals are dropped.
   */
  load(st: { values: Float32Array; states: Float32Array[]; optimizerSteps: number; lossScale: number }): void {
    const { model, ctx } = this.#o;
    const backend = ctx.backend;
    const store = model.store;
    const slabs = this.optimizer.stateSlabs();
    const { values, states } = st;
    if (this.#ownedParams !== null) {
      // stage 3: this rank keeps its partition of the parameters (any gathered copy is stale)
      for (const b of this.#buckets ?? []) this.#release(b);
      for (const r of this.partition!.ranges.flat())
        backend.upload(
          this.#ownedParams.ptr + r.stateOffset * 4,
          values.subarray(r.paramOffset, r.paramOffset + r.numel),
        );
    } else store.writeValues(values);
    this.#host?.store.writeValues(values);
    if (this.partition === null) slabs.forEach((s, i) => this.#optBackend.upload(s.allocation.ptr, states[i]!));
    else {
      // offload: in host memory, with the partition's master copy
      const hp = this.#hostPart;
      for (const r of this.partition.ranges.flat()) {
        slabs.forEach((s, i) =>
          this.#optBackend.upload(
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
    this.optimizer.setStepCount(st.optimizerSteps);
    if (this.scaler !== null && st.lossScale > 0) this.scaler.restoreScale(st.lossScale);
    store.zeroGrad();
    // the residuals belong to the steps the restore abandoned
    for (const b of this.#buckets ?? []) b.feedback?.reset();
  }

  /** Frees the host memory of offload. */
  dispose(): void {
    this.#host?.ctx.dispose();
    this.#hostPart?.ctx.dispose();
  }
}
