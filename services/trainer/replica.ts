// A trainer rank's replica in all-reduce mode (`sync: "allreduce"`): the parameters, the
// optimizer state and the loss scaler live in the trainer, and a step is
//   forward/backward -> average the gradient over the ranks (ring all-reduce, bucket by bucket
//   while backward goes on) -> unscale (f16) -> clip by the global norm -> the same optimizer
//   step on every rank.
// Every rank reduces to bit-identical gradients (fixed ring order), so the replicas stay equal;
// a hash of the parameters is compared every `replicaCheckEvery` steps to prove it.
//
// Topology: when the ranks' host labels (useTopology, from service discovery) name more than
// one machine, the all-reduce is hierarchical (engine/parallel/hierarchical.ts): within each
// host first, then across one leader per host, so the links between machines carry each byte
// once. On one machine it is the flat ring.
//
// Buckets: parameters are grouped, in the order backward completes their gradients, into
// buckets of about `bucketMb`. The order comes from the tape of a forward pass (the first op to
// read a parameter is the last backward op to write its gradient); every rank runs the same
// model, so every rank cuts the same buckets. A bucket's all-reduce starts as soon as backward
// has written its last gradient; backward yields to the event loop between ops while a bucket is
// in flight, so its pieces move while the next gradients are computed.
//
// Averaging: rank r scales its mean gradient by rows_r / rows (the step's samples over all
// ranks, known from the data plan; folded into the loss's seed) before the sum, so a short last
// step weighs each sample once, as a single process with the whole batch would.
//
// Compression (`compress`, engine/parallel/compress.ts): a bucket is encoded with error
// feedback (a residual per bucket), every rank's encoding is all-gathered, and each rank sums
// the decoded contributions in rank order (the same bits on every rank). ZeRO keeps its
// partition of that sum. With top-k the density of the summed bucket is reported.
//
// Offload (`offload: "optimizer"`, ZeRO-Offload's CPU optimizer): the optimizer's state, the
// update and an f32 master copy of the parameters live in host memory (a CPU-backend mirror of
// the parameter store). The buckets already come to the host for the all-reduce; their reduced
// gradients go into the mirror instead of back to the device, the loss scaler, the clip and the
// optimizer run there with the CPU kernels, and the updated parameters go back to the device.
// With ZeRO (stages 1-3) each rank's host holds only its partition: the master copy of its
// ranges, their reduced gradients and their optimizer state (the plan's packed layout). Each
// bucket's reduce-scattered segment goes from the bucket's host buffer straight into the host's
// gradients as soon as it arrives, while backward computes the next buckets; once the norm is
// known the host updates the partition and its parameters go back to the device (stage 3: into
// the partition the gathers read), and the all-gather spreads them as without offload. Stages
// 2 and 3 then keep no gradient partition on the device at all.
//
// Checkpoints: rank 0 serves its replica in parts (ShardState messages of the job's chunk
// layout, each under the message limit) to the checkpoint service; on restore every rank is
// loaded the same parts and applies them at its next step boundary, with the communicator
// generation the restore assigned (pieces of the earlier generation are refused).
import type { Allocation, Backend } from "../../ffi/backend.ts";
import { EngineError, NonFiniteLossError } from "../../engine/errors.ts";
import type { Model } from "../../engine/models/model.ts";
import { AdamW } from "../../engine/optim/adamw.ts";
import { clipGradNorm } from "../../engine/optim/clip.ts";
import { LossScaler } from "../../engine/optim/loss-scale.ts";
import type { Optimizer, UpdatePlan } from "../../engine/optim/optimizer.ts";
import { Sgd } from "../../engine/optim/sgd.ts";
import type { ParamEntry, ParamStore } from "../../engine/params.ts";
import { BadPieceError, type Collective } from "../../engine/parallel/collective.ts";
import { HierarchicalCollective } from "../../engine/parallel/hierarchical.ts";
import { Codec, density, ErrorFeedback, parseCompression } from "../../engine/parallel/compress.ts";
import { RingCollective } from "../../engine/parallel/ring.ts";
import { type ModelMemory, type Partition, partitionOf, type ZeroStage } from "../../engine/parallel/zero.ts";
import { Context, type Tensor } from "../../engine/tensor.ts";
import { CpuBackend } from "../../ffi/cpu/backend.ts";
import { type HostBatch, uploadBatch } from "../../engine/train.ts";
import { type ShardState, shardStateChecksum } from "../../schemas/messages.ts";
import type { Bus } from "../runtime/bus.ts";
import { BusTransport, busTransportDefaults, type BusTransportOptions } from "../runtime/collective-bus.ts";
import { BadRequestError } from "../runtime/errors.ts";
import type { JobConfig } from "../runtime/job.ts";
import { buildLayout, type Layout } from "../runtime/layout.ts";
import { cutPartition, cutReplica, type ReplicaMeta } from "../runtime/replica-parts.ts";
import { implausibleStateText, plausibleState } from "../runtime/limits.ts";

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

export class ReplicaDivergedError extends Error {
  override readonly name = "ReplicaDivergedError";
}

interface Bucket {
  id: number;
  entries: ParamEntry[];
  /** elements over its entries */
  numel: number;
  buf: Float32Array;
  /** compression: the bucket's error feedback, and every rank's encoding of it (all-gathered) */
  feedback: ErrorFeedback | null;
  gathered: Float32Array | null;
}

export interface ReplicaStepResult {
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

export interface ReplicaOptions {
  bus: Bus;
  backend: Backend;
  cfg: JobConfig;
  rank: number;
  ctx: Context;
  model: Model;
  /** the largest message (a part of the replica, a collective piece plus its header) */
  payloadBytesMax: number;
  /** the job's steps (its plan's): a restore's replica is of one of them */
  totalSteps: number;
  /** collective transport settings over busTransportDefaults (tests shorten the timeouts) */
  transport?: Partial<Pick<BusTransportOptions, "pieceBytesMax" | "windowPieces" | "sendTimeoutMs" | "peerLostMs" | "sharedMemory">>;
  progressTimeoutMs?: number;
}

/** Offload with ZeRO: a rank's partition in host memory (master parameters, reduced gradients,
 *  packed as the optimizer state; scratch to add a micro-batch's gradients in). */
interface HostPartition {
  ctx: Context;
  params: Allocation;
  grads: Allocation;
  scratch: Allocation;
}

export class Replica {
  readonly optimizer: Optimizer;
  readonly scaler: LossScaler | null;
  readonly layout: Layout;
  readonly zero: ZeroStage;
  /** ZeRO: the part of every bucket this rank owns (null at stage 0) */
  readonly partition: Partition | null;
  readonly #o: ReplicaOptions;
  /** offload: the host mirror of the parameter store the optimizer runs on */
  readonly #host: { ctx: Context; store: ParamStore } | null = null;
  /** offload with ZeRO: the host's partition (master parameters, reduced gradients, packed as the
   *  optimizer state; scratch to add a micro-batch's gradients in) */
  readonly #hostPart: HostPartition | null = null;
  /** the bucket codec (compression) */
  readonly codec: Codec;
  /** bytes of values this rank's communicators delivered to peers */
  readonly #meter = { bytes: 0 };
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
  #generation = 0;
  /** built at its first use, once the topology is known (see useTopology) */
  #collective: Collective | null = null;
  /** host label per rank; null or a single label: the flat ring */
  #hosts: readonly string[] | null = null;
  #buckets: Bucket[] | null = null;
  #bucketOf = new Map<string, Bucket>();
  readonly #staging: ReplicaStaging;
  /** rank 0: the encoded parts of the replica at a step, kept while the checkpoint service reads them */
  #exported: { step: number; parts: ShardState[] } | null = null;

  constructor(o: ReplicaOptions) {
    this.#o = o;
    const { ctx, model, cfg } = o;
    const store = model.store;
    this.codec = new Codec(parseCompression(cfg.compress));
    const buckets = this.#plan();
    this.zero = cfg.zero;
    this.partition = cfg.zero > 0 ? partitionOf(buckets, cfg.trainers, o.rank) : null;
    let plan: UpdatePlan | undefined;
    const offload = cfg.offload === "optimizer";
    if (this.partition !== null) {
      const part = this.partition;
      const widest = Math.max(1, ...part.ranges.flat().map((r) => r.numel));
      if (cfg.zero >= 2) {
        store.releaseGradSlab();
        if (!offload) {
          this.#ownedGrads = ctx.allocPersistent(Math.max(part.numel, 1) * 4);
          this.#addScratch = ctx.allocPersistent(widest * 4);
        }
      }
      if (cfg.zero === 3) {
        // every rank initialized the whole model from the seed; it keeps its partition
        const owned = ctx.allocPersistent(Math.max(part.numel, 1) * 4);
        for (const r of part.ranges.flat()) o.backend.copy(owned.ptr + r.stateOffset * 4, store.values.ptr + r.paramOffset * 4, r.numel * 4);
        this.#ownedParams = owned;
        store.releaseValueSlab();
      }
      plan = { ranges: part.ranges.flat(), stateNumel: part.numel, grads: this.#ownedGrads, params: this.#ownedParams };
      if (offload) {
        const hostCtx = new Context(new CpuBackend(), { seed: cfg.seed });
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
          o.backend.download(this.#ownedParams !== null ? this.#ownedParams.ptr + r.stateOffset * 4 : store.values.ptr + r.paramOffset * 4, v);
          hostCtx.backend.upload(hp.params.ptr + r.stateOffset * 4, v);
        }
        this.#hostPart = hp;
        plan = { ranges: part.ranges.flat(), stateNumel: part.numel, grads: hp.grads, params: hp.params };
      }
    } else if (offload) {
      const hostCtx = new Context(new CpuBackend(), { seed: cfg.seed });
      this.#host = { ctx: hostCtx, store: store.mirror(hostCtx) };
    }
    const opt = cfg.optimizer;
    const [optCtx, optStore] = this.#host ? [this.#host.ctx, this.#host.store] : [this.#hostPart?.ctx ?? ctx, store];
    this.optimizer =
      opt.kind === "sgd"
        ? new Sgd(optCtx, optStore, { momentum: opt.momentum, dampening: 0, nesterov: opt.nesterov, weightDecay: opt.weightDecay }, plan)
        : new AdamW(
            optCtx,
            optStore,
            { beta1: opt.beta1, beta2: opt.beta2, eps: opt.eps, weightDecay: opt.weightDecay, sparse: this.codec.kind === "topk" },
            plan,
          );
    this.scaler = ctx.precision === "f16" ? new LossScaler() : null;
    this.layout = buildLayout(cfg.job, store.slabNumel, store.decayRange.numel, cfg.chunkBytes, 1);
    this.#staging = new ReplicaStaging(cfg.job, this.layout, () => this.optimizer.stateSlabs().map((x) => x.name), o.totalSteps);
  }

  /** What this rank holds for the model, read from its allocations (and the arena's high-water mark). */
  get memory(): ModelMemory {
    const { model, ctx, cfg } = this.#o;
    const store = model.store;
    return {
      stage: this.zero,
      ranks: cfg.trainers,
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
      buckets: (this.#buckets ?? []).reduce((sum, b) => sum + b.buf.byteLength + (b.feedback?.residual.byteLength ?? 0) + (b.gathered?.byteLength ?? 0), 0),
      arenaPeak: ctx.arena.highWaterBytes,
      gatheredPeak: this.#gatheredPeak,
    };
  }

  get generation(): number {
    return this.#generation;
  }

  /** What this rank serves a snapshot: rank 0 the whole replica, or (ZeRO) every rank its partition. */
  get serves(): "whole" | "partition" | "none" {
    return this.partition !== null ? "partition" : this.#o.rank === 0 ? "whole" : "none";
  }

  /** The rank this one's Step and Eval events carry (every rank speaks for itself). */
  get eventRank(): number | null {
    return this.#o.rank;
  }

  /** The data-loader's rank this rank reads. */
  get dataRank(): number {
    return this.#o.rank;
  }

  get #optimizerBytes(): number {
    return this.optimizer.stateSlabs().reduce((sum, s) => sum + s.allocation.bytes, 0);
  }

  /** Where the optimizer's state lives: host memory when offloaded, else the device. */
  get #optBackend(): Backend {
    return this.#host?.ctx.backend ?? this.#hostPart?.ctx.backend ?? this.#o.backend;
  }

  /** Bytes of values this rank has sent to its peers (every collective, every path). */
  get wireBytes(): number {
    return this.#meter.bytes;
  }

  /** How many machines the ranks' labels name (1 until useTopology). */
  get hostCount(): number {
    return new Set(this.#hosts ?? [""]).size;
  }

  /**
   * Takes the ranks' host labels (every rank must pass the same ones before its first step):
   * more than one host makes the all-reduce hierarchical.
   *
   * The communicator is built after this, at its first use. Rebuilding one under the same
   * generation would lose pieces: a faster peer's first pieces, taken and held by the old
   * communicator as early, would never reach the new one, and the step would hang. A topology
   * given after the communicator was built is a programmer's error.
   */
  useTopology(hosts: readonly string[]): void {
    const n = this.#o.cfg.trainers;
    if (hosts.length !== n || hosts.some((h) => h === ""))
      throw new RangeError(`a topology needs a host label for each of the ${n} ranks, got ${hosts.join(",")}`);
    if (this.#collective !== null) throw new Error("the topology must be given before the communicator's first use");
    this.#hosts = [...hosts];
  }

  /** The communicator of the current generation (built at first use). */
  get #comm(): Collective {
    this.#collective ??= this.#connect(this.#generation);
    return this.#collective;
  }

  #connect(generation: number): Collective {
    const { bus, cfg, rank, payloadBytesMax } = this.#o;
    const t = { ...busTransportDefaults, ...this.#o.transport };
    // a piece and its header fit the message limit
    const pieceBytesMax = Math.min(t.pieceBytesMax, Math.floor((payloadBytesMax - 4096) / 4) * 4);
    const transport = new BusTransport(bus, {
      ...t,
      pieceBytesMax,
      job: cfg.job,
      rank,
      size: cfg.trainers,
      generation,
      sharedMemory: this.#o.transport?.sharedMemory ?? cfg.collTransport === "auto",
      meter: this.#meter,
    });
    const options = this.#o.progressTimeoutMs ? { progressTimeoutMs: this.#o.progressTimeoutMs } : {};
    return this.#hosts !== null && new Set(this.#hosts).size > 1
      ? new HierarchicalCollective(transport, { hosts: this.#hosts }, options)
      : new RingCollective(transport, cfg.trainers, options);
  }

  /** Rebuilds the communicator under a new generation: operations in flight fail, stale pieces are refused. */
  reconnect(generation: number): void {
    this.#collective?.close(`communicator generation ${this.#generation} replaced by ${generation}`);
    // stage 3: the new communicator's gathers are counted afresh on every rank
    this.#gatherSeq = { step: -1, n: 0 };
    this.#generation = generation;
    this.#collective = this.#connect(generation);
  }

  close(): void {
    this.#collective?.close("the trainer stopped");
    this.#host?.ctx.dispose();
    this.#hostPart?.ctx.dispose();
  }

  /** Fails the operations in flight (a restore abandons the step); the restore's apply() reconnects. */
  interrupt(): void {
    this.#collective?.close("the step was abandoned for a restore");
  }

  /**
   * The buckets, cut from the tape of a forward pass over a one-row batch of zeros shaped as the
   * job's (nothing is computed backward). Every rank cuts the same ones.
   */
  #plan(): Bucket[] {
    if (this.#buckets) return this.#buckets;
    const { ctx, model, cfg } = this.#o;
    const store = model.store;
    ctx.newPass();
    const { x, y } = uploadBatch(ctx, probeBatch(cfg));
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
    const capElems = Math.max(1, Math.floor((cfg.bucketMb * 1e6) / 4));
    const buckets: Bucket[] = [];
    let cur: ParamEntry[] = [],
      n = 0;
    const codec = this.codec;
    const close = () => {
      const lossy = codec.lossy;
      buckets.push({
        id: buckets.length,
        entries: cur,
        numel: n,
        buf: new Float32Array(n),
        feedback: lossy ? new ErrorFeedback(codec, n) : null,
        gathered: lossy ? new Float32Array((cfg.trainers * codec.slotBytes(n)) / 4) : null,
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
  async step(step: number, micro: readonly HostBatch[], rows: number, totalRows: number, lr: number): Promise<ReplicaStepResult> {
    const { ctx, model, backend, cfg } = this.#o;
    const store = model.store;
    this.codec.atStep(step, cfg.warmupSteps);
    if (this.zero > 0) return this.#stepZero(step, micro, rows, totalRows, lr);
    const buckets = this.#plan();
    const t0 = performance.now();
    const weight = totalRows > 0 ? rows / totalRows : 0;
    const collective = this.#comm;
    const pending: Promise<void>[] = [];
    let inFlight = 0;
    let firstStart = Infinity;
    const left = new Map(buckets.map((b) => [b, b.entries.length]));
    const launch = (b: Bucket) => {
      let at = 0;
      for (const e of b.entries) {
        backend.download(store.grads.ptr + e.offset * 4, b.buf.subarray(at, at + e.numel));
        at += e.numel;
      }
      firstStart = Math.min(firstStart, performance.now());
      inFlight++;
      const key = { step, bucket: b.id };
      const op = (b.feedback ? this.#compressedAllReduce(b, key) : collective.allReduce(b.buf, key, "sum")).finally(() => inFlight--);
      op.catch(() => {}); // awaited below
      pending.push(op);
    };

    store.zeroGrad();
    this.#dense = { nonzero: 0, total: 0 };
    let loss = 0;
    const k = micro.length;
    // the rank's share of the global batch is folded into the loss's seed, so the gradients
    // come out of backward already weighted and the buckets' sum is the global mean
    const dloss = ((this.scaler?.scale ?? 1) * weight) / Math.max(k, 1);
    if (k > 0) {
      const slots = ctx.scalarSlots(k);
      for (let i = 0; i < k; i++) {
        ctx.newPass();
        const { x, y } = uploadBatch(ctx, micro[i]!);
        const l = model.loss(x, y);
        backend.copy(slots + 4 * i, l.ptr, 4);
        if (i < k - 1) {
          ctx.backward(l, dloss);
          continue;
        }
        for (const ready of ctx.backwardSteps(l, dloss)) {
          for (const t of ready) {
            const b = this.#bucketFor(t);
            const n = left.get(b)! - 1;
            left.set(b, n);
            if (n === 0) launch(b);
          }
          // let the buckets in flight move while backward goes on
          if (inFlight > 0) await new Promise<void>((r) => setImmediate(r));
        }
      }
      const values = new Float32Array(k);
      backend.download(slots, values);
      for (const v of values) loss += v / k;
    }
    // buckets not launched yet: a rank without samples this step, or gradients no op wrote
    for (const b of buckets) if (left.get(b)! > 0) launch(b);
    const tBackward = performance.now();
    await Promise.all(pending);
    const tReduced = performance.now();
    // offload: the reduced gradients stay on the host, in the mirror the optimizer runs on
    const [gradCtx, gradStore] = this.#host ? [this.#host.ctx, this.#host.store] : [ctx, store];
    for (const b of buckets) {
      let at = 0;
      for (const e of b.entries) {
        gradCtx.backend.upload(gradStore.grads.ptr + e.offset * 4, b.buf.subarray(at, at + e.numel));
        at += e.numel;
      }
    }
    // a non-finite loss stops the job, but only after the reduction: the peers are not left
    // waiting for this rank's buckets
    if (!Number.isFinite(loss)) throw new NonFiniteLossError(step, loss);
    let finite = true,
      gradNorm = Infinity;
    if (this.scaler !== null) finite = this.scaler.unscale(gradCtx, gradStore);
    if (finite) {
      gradNorm = clipGradNorm(gradCtx, gradStore, cfg.gradClip);
      this.optimizer.step(lr);
      // offload: the updated master parameters back to the device
      if (this.#host) store.writeValues(this.#host.store.readValues());
    }
    this.#updateScale(finite, step);
    const t1 = performance.now();
    return {
      loss,
      gradNorm,
      skipped: !finite,
      computeMs: tBackward - t0 + (t1 - tReduced),
      commMs: pending.length > 0 ? tReduced - firstStart : 0,
      exposedCommMs: tReduced - tBackward,
      density: this.#density,
    };
  }

  /**
   * A ZeRO step. Stage 1: backward into the gradient slab as at stage 0, each bucket
   * reduce-scattered (this rank keeps the sums of its partition, in the slab). Stage 2: every
   * micro-batch's backward writes into the arena, and each bucket is reduce-scattered as soon as
   * it is complete; the partition's sums are added up in a buffer of the partition's size.
   * Then: overflow and the global norm from every rank's partition (one small all-reduce), the
   * optimizer on the partition, and each bucket's updated parameters all-gathered.
   */
  async #stepZero(step: number, micro: readonly HostBatch[], rows: number, totalRows: number, lr: number): Promise<ReplicaStepResult> {
    const { ctx, model, backend, cfg } = this.#o;
    const store = model.store;
    const part = this.partition!;
    const buckets = this.#plan();
    const stage2 = this.zero >= 2;
    const stage3 = this.zero === 3;
    const t0 = performance.now();
    const weight = totalRows > 0 ? rows / totalRows : 0;
    const collective = this.#comm;
    let pending: Promise<void>[] = [];
    let inFlight = 0;
    let firstStart = Infinity;
    const launch = (b: Bucket, round: number) => {
      let at = 0;
      for (const e of b.entries) {
        const dst = b.buf.subarray(at, at + e.numel);
        const grad = stage2 ? store.gradOf(e.name) : null;
        if (!stage2) backend.download(store.grads.ptr + e.offset * 4, dst);
        else if (grad === null)
          dst.fill(0); // no op read it in this micro-batch
        else backend.download(grad.ptr, dst);
        at += e.numel;
      }
      firstStart = Math.min(firstStart, performance.now());
      inFlight++;
      const key = { step, bucket: round * buckets.length + b.id };
      const op = (b.feedback ? this.#compressedAllReduce(b, key) : collective.reduceScatter(b.buf, key))
        .then(() => this.#keep(b, round > 0))
        .finally(() => inFlight--);
      op.catch(() => {}); // awaited below
      pending.push(op);
    };

    let loss = 0;
    const k = micro.length;
    const dloss = ((this.scaler?.scale ?? 1) * weight) / Math.max(k, 1);
    // stage 2 reduces every micro-batch (its gradients live in that pass's arena); the ranks
    // agree on the rounds, so a rank with fewer micro-batches reduces zeros
    const rounds = stage2 ? Math.max(cfg.accumSteps, k, 1) : 1;
    const slots = k > 0 ? ctx.scalarSlots(k) : 0;
    store.zeroGrad();
    this.#dense = { nonzero: 0, total: 0 };
    for (let i = 0; i < Math.max(k, rounds); i++) {
      const round = stage2 ? i : 0;
      if (stage2) store.zeroGrad(); // drops the last pass's arena gradients
      const left = new Map(buckets.map((b) => [b, b.entries.length]));
      // stage 3: a rank without a micro-batch this round still takes part in the rounds'
      // parameter gathers: it runs the probe batch with a zero loss seed (zero gradients)
      const batch = i < k ? micro[i]! : stage3 && i < rounds ? probeBatch(cfg) : null;
      if (batch !== null) {
        const seed = i < k ? dloss : 0;
        ctx.newPass();
        const { x, y } = uploadBatch(ctx, batch);
        const l = stage3 ? await this.#lossGathered(x, y, step) : model.loss(x, y);
        if (i < k) backend.copy(slots + 4 * i, l.ptr, 4);
        if (!stage2 && i < k - 1) {
          ctx.backward(l, seed);
          continue;
        }
        const done = (t: Tensor) => {
          const b = this.#bucketFor(t);
          const n = left.get(b)! - 1;
          left.set(b, n);
          if (n > 0) return;
          launch(b, round);
          if (stage3) this.#release(b); // no later backward node reads its parameters
        };
        if (stage3) {
          for (const ev of ctx.backwardEvents(l, seed)) {
            if ("need" in ev) await this.#gatherFor(ev.need, step);
            else for (const t of ev.ready) done(t);
            if (inFlight > 0) await new Promise<void>((r) => setImmediate(r));
          }
        } else {
          for (const ready of ctx.backwardSteps(l, seed)) {
            for (const t of ready) done(t);
            if (inFlight > 0) await new Promise<void>((r) => setImmediate(r));
          }
        }
      }
      if (stage3) await this.releaseAll();
      if (i >= rounds) continue;
      for (const b of buckets) if (left.get(b)! > 0) launch(b, round);
      // the buckets' buffers are reused by the next round
      if (stage2 && i < Math.max(k, rounds) - 1) {
        await Promise.all(pending);
        pending = [];
      }
    }
    if (k > 0) {
      const values = new Float32Array(k);
      backend.download(slots, values);
      for (const v of values) loss += v / k;
    }
    const tBackward = performance.now();
    await Promise.all(pending);
    const tReduced = performance.now();
    if (!Number.isFinite(loss)) throw new NonFiniteLossError(step, loss);

    // overflow and the norm, over every rank's partition (offload: in host memory, where the
    // partition's gradients are)
    const ranges = part.ranges.flat();
    const hp = this.#hostPart;
    const gb = hp?.ctx.backend ?? backend;
    const gradAt = (r: (typeof ranges)[number]) =>
      hp !== null ? hp.grads.ptr + r.stateOffset * 4 : stage2 ? this.#ownedGrads!.ptr + r.stateOffset * 4 : store.grads.ptr + r.paramOffset * 4;
    const stats = new Float32Array(2);
    let nonFinite = 0,
      sumSq = 0;
    for (const r of ranges) {
      nonFinite += gb.countNonFinite(gradAt(r), r.numel);
      sumSq += gb.sumSquares(gradAt(r), r.numel);
    }
    stats[0] = nonFinite;
    stats[1] = nonFinite > 0 ? 0 : sumSq;
    await collective.allReduce(stats, { step, bucket: statsBucket }, "sum");
    const finite = stats[0] === 0;
    const scale = this.scaler?.scale ?? 1;
    let gradNorm = Infinity;
    if (finite) {
      gradNorm = Math.sqrt(stats[1]!) / scale;
      let factor = 1 / scale;
      if (cfg.gradClip > 0 && gradNorm > cfg.gradClip) factor *= cfg.gradClip / (gradNorm + 1e-6);
      if (factor !== 1) for (const r of ranges) gb.scale(gradAt(r), r.numel, factor);
      this.optimizer.step(lr);
      // offload: the host's updated partition back to the device (stage 3: the packed partition)
      if (hp !== null) this.#partitionToDevice(hp);
    }
    // every rank's updated partition to every rank (stage 3 gathers them as the next pass needs them)
    if (finite && !stage3) {
      const gathers = buckets.map((b) => {
        for (const r of part.ranges[b.id]!) backend.download(store.values.ptr + r.paramOffset * 4, b.buf.subarray(r.bucketOffset, r.bucketOffset + r.numel));
        return collective.allGather(b.buf, { step, bucket: gatherBucket + b.id });
      });
      await Promise.all(gathers);
      for (const b of buckets) {
        let at = 0;
        for (const e of b.entries) {
          backend.upload(store.values.ptr + e.offset * 4, b.buf.subarray(at, at + e.numel));
          at += e.numel;
        }
      }
    }
    this.#updateScale(finite, step);
    const t1 = performance.now();
    return {
      loss,
      gradNorm,
      skipped: !finite,
      computeMs: tBackward - t0,
      commMs: t1 - Math.min(firstStart, tBackward),
      exposedCommMs: t1 - tBackward,
      density: this.#density,
    };
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
      for (const id of [...this.#gathered.keys()]) if (!need.includes(id) && !next.includes(id)) this.#release(buckets[id]!);
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
    const { ctx, backend, model } = this.#o;
    const buf = new Float32Array(b.numel);
    for (const r of this.partition!.ranges[b.id]!)
      backend.download(this.#ownedParams!.ptr + r.stateOffset * 4, buf.subarray(r.bucketOffset, r.bucketOffset + r.numel));
    const op = this.#comm
      .allGather(buf, key)
      .then(() => {
        const alloc = ctx.allocPersistent(b.numel * 4);
        backend.upload(alloc.ptr, buf);
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
    for (const e of store.entries) this.#o.backend.download(store.param(e.name).ptr, out.subarray(e.offset, e.offset + e.numel));
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
   * A compressed bucket's sum over the ranks into b.buf: this rank's gradient plus its residual
   * is encoded into its slot, every rank's slot is all-gathered, and the decoded slots are
   * added up in rank order (every rank computes the same sum, bit for bit).
   */
  async #compressedAllReduce(b: Bucket, key: { step: number; bucket: number }): Promise<void> {
    const codec = this.codec;
    const width = codec.slotBytes(b.numel);
    // top-k's slots follow its warm-up (the same width on every rank at a step)
    if (b.gathered!.byteLength !== this.#o.cfg.trainers * width) b.gathered = new Float32Array((this.#o.cfg.trainers * width) / 4);
    const all = b.gathered!;
    const slotOf = (r: number) => new Uint8Array(all.buffer, all.byteOffset + r * width, width);
    b.feedback!.encode(b.buf, slotOf(this.#o.rank));
    await this.#comm.allGather(all, key);
    b.buf.fill(0);
    for (let r = 0; r < this.#o.cfg.trainers; r++) {
      try {
        codec.decode(slotOf(r), b.buf, true);
      } catch (e) {
        throw new BadPieceError(`rank ${r}'s ${codec.kind} encoding of bucket ${b.id} at step ${key.step}: ${(e as Error).message}`, { cause: e });
      }
    }
    if (codec.kind === "topk") {
      this.#dense.nonzero += density(b.buf) * b.numel;
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
    const { backend, model } = this.#o;
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

  /** Offload with ZeRO: the host's master partition to the device's parameters (the slab's
   *  ranges at stages 1-2; the packed partition at stage 3). */
  #partitionToDevice(hp: HostPartition): void {
    const { backend, model } = this.#o;
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
      throw new EngineError(`parameter ${t.name ?? "(unnamed)"} is in no gradient bucket: the tape differs from the one the buckets were cut from`);
    return b;
  }

  /**
   * Compares the ranks' parameters: every rank all-gathers every rank's 63-bit hash of its
   * parameter slab. A difference throws ReplicaDivergedError naming the ranks (on every rank).
   */
  async checkReplicas(step: number): Promise<void> {
    const { cfg, rank, model } = this.#o;
    if (this.zero === 3) return; // each rank holds only its partition of the parameters: no replica to compare
    const h = Bun.hash(new Uint8Array(model.store.readValues().buffer));
    const n = cfg.trainers;
    const buf = new Float32Array(3 * n);
    const mask = (1n << BigInt(hashBitsPerFloat)) - 1n;
    for (let i = 0; i < 3; i++) buf[3 * rank + i] = Number((BigInt(h) >> BigInt(hashBitsPerFloat * i)) & mask);
    await this.#comm.allGather(buf, { step, bucket: checkBucket });
    const hashOf = (r: number) => [0, 1, 2].map((i) => buf[3 * r + i]!.toString(16)).join(".");
    const differ = Array.from({ length: n }, (_, r) => r).filter((r) => hashOf(r) !== hashOf(0));
    if (differ.length > 0) {
      throw new ReplicaDivergedError(
        `the replicas diverged by step ${step}: the parameters of rank${differ.length > 1 ? "s" : ""} ${differ.join(", ")} ` +
          `hash ${differ.map(hashOf).join(", ")}, rank 0's ${hashOf(0)}; every rank should apply the same averaged gradient`,
      );
    }
  }

  /** Cuts the replica (or this rank's partition) for the snapshot of `step`: copies kept for its parts; returns their number. */
  cut(step: number, partBytesMax: number): number {
    this.#exported = { step, parts: this.partition === null ? this.#replicaParts(step, partBytesMax) : this.#partitionParts(step, partBytesMax) };
    return this.#exported.parts.length;
  }

  /** Whether a cut of `step` is kept. */
  hasCut(step: number): boolean {
    return this.#exported?.step === step;
  }

  /**
   * What this rank serves a snapshot, part `part` of it as it is at `step`: at stage 0 (rank 0)
   * the replica (parameters, optimizer state, step count, loss scale) cut along the job's chunks;
   * under ZeRO (every rank) its own partition, slab ranges with their parameters and state
   * (services/runtime/replica-parts.ts). Each part fits `partBytesMax`.
   */
  async exportPart(step: number, part: number, partBytesMax: number): Promise<ShardState> {
    if (this.#exported?.step !== step) this.cut(step, partBytesMax);
    const parts = this.#exported!.parts;
    if (!Number.isInteger(part) || part < 0 || part >= parts.length) throw new BadRequestError(`the replica has parts 0 to ${parts.length - 1}, not ${part}`);
    return parts[part]!;
  }

  #meta(step: number): ReplicaMeta {
    return { job: this.#o.cfg.job, step, optimizerSteps: this.optimizer.stepCount, lossScale: this.scaler?.scale ?? 0 };
  }

  #replicaParts(step: number, partBytesMax: number): ShardState[] {
    const store = this.#o.model.store;
    const states = this.optimizer.stateSlabs().map((s) => {
      const data = new Float32Array(store.slabNumel);
      this.#optBackend.download(s.allocation.ptr, data);
      return { name: s.name, data };
    });
    return cutReplica(this.#meta(step), this.layout, store.readValues(), states, partBytesMax);
  }

  /** ZeRO: this rank's ranges of the slab, their parameters (its own at stage 3, the replicated slab's below) and its packed state. */
  #partitionParts(step: number, partBytesMax: number): ShardState[] {
    const { backend, model, rank } = this.#o;
    const slabs = this.optimizer.stateSlabs();
    const ranges = this.partition!.ranges.flat().map((r) => ({ offset: r.paramOffset, count: r.numel, packed: r.stateOffset }));
    const read = (offset: number, count: number, packed: number) => {
      const params = new Float32Array(count);
      if (this.#ownedParams !== null) backend.download(this.#ownedParams.ptr + packed * 4, params);
      else backend.download(model.store.values.ptr + offset * 4, params);
      const state = slabs.map((s) => {
        const v = new Float32Array(count);
        this.#optBackend.download(s.allocation.ptr + packed * 4, v);
        return v;
      });
      return { params, state };
    };
    return cutPartition(
      { ...this.#meta(step), rank },
      ranges,
      slabs.map((x) => x.name),
      read,
      partBytesMax,
    );
  }

  /** Takes one part of a snapshot's replica (a restore), checked; nothing changes until apply(). */
  stage(s: ShardState): void {
    this.#staging.stage(s);
  }

  /** The restore staged completely (every part, every chunk once), or null. */
  get staged(): { step: number; generation: number } | null {
    return this.#staging.staged;
  }

  /** Whether a restore's load newer than `generation` has begun here. */
  loadsNewerThan(generation: number): boolean {
    return this.#staging.newerThan(generation);
  }

  /** Applies the staged restore: parameters, optimizer state, loss scale, and the communicator's generation. */
  apply(): { step: number; generation: number } {
    const { model, backend } = this.#o;
    const store = model.store;
    const slabs = this.optimizer.stateSlabs();
    const st = this.#staging.take(store.slabNumel);
    const { values, states } = st;
    if (this.#ownedParams !== null) {
      // stage 3: this rank keeps its partition of the parameters (any gathered copy is stale)
      for (const b of this.#buckets ?? []) this.#release(b);
      for (const r of this.partition!.ranges.flat())
        backend.upload(this.#ownedParams.ptr + r.stateOffset * 4, values.subarray(r.paramOffset, r.paramOffset + r.numel));
    } else store.writeValues(values);
    this.#host?.store.writeValues(values);
    if (this.partition === null) slabs.forEach((s, i) => this.#optBackend.upload(s.allocation.ptr, states[i]!));
    else {
      // ZeRO: this rank keeps its partition's ranges (the snapshot holds the slab's layout, so a
      // job resumes on any number of ranks and at any stage); offload: in host memory, with the
      // partition's master copy
      const hp = this.#hostPart;
      for (const r of this.partition.ranges.flat()) {
        slabs.forEach((s, i) => this.#optBackend.upload(s.allocation.ptr + r.stateOffset * 4, states[i]!.subarray(r.paramOffset, r.paramOffset + r.numel)));
        hp?.ctx.backend.upload(hp.params.ptr + r.stateOffset * 4, values.subarray(r.paramOffset, r.paramOffset + r.numel));
      }
    }
    this.optimizer.setStepCount(st.optimizerSteps);
    if (this.scaler !== null && st.lossScale > 0) this.scaler.restoreScale(st.lossScale);
    store.zeroGrad();
    // the residuals belong to the steps the restore abandoned
    for (const b of this.#buckets ?? []) b.feedback?.reset();
    this.#exported = null;
    this.reconnect(st.generation);
    return { step: st.step, generation: st.generation };
  }
}

/**
 * The parts of a restore's replica as they arrive (each checked with checkReplicaPart), until
 * every part of one load is here: then take() assembles the replica's values and state vectors
 * in the slab's layout. Parts of another load (another communicator generation) start a new one:
 * the checkpoint service loads every part of a restore before it announces it, one restore at a
 * time, so the newest parts are the ones to keep (refusing older generations instead would let
 * one part with a huge one block every restore). The last complete load stays until it is taken
 * or a newer one completes: a rank may see the next restore's parts before it takes the one
 * announced, and then takes that one all the same.
 */
export class ReplicaStaging {
  #complete: StagedLoad | null = null;
  #loading: StagedLoad | null = null;

  constructor(
    readonly job: string,
    readonly layout: Layout,
    readonly stateNames: () => string[],
    /** the job's steps: a replica of a later step was not cut from it */
    readonly totalSteps: number,
  ) {}

  stage(s: ShardState): void {
    checkReplicaPart(s, this.job, this.layout, this.stateNames(), this.totalSteps);
    const parts = s.parts!;
    const g = s.generation!;
    // a part of the complete load sent again replaces its copy there
    if (this.#complete?.generation !== g && (this.#loading === null || this.#loading.generation !== g))
      this.#loading = { step: s.step, generation: g, parts, optimizerSteps: s.optimizerSteps, lossScale: s.lossScale ?? 0, got: new Map() };
    const st = this.#complete?.generation === g ? this.#complete : this.#loading!;
    if (st.step !== s.step || st.parts !== parts)
      throw new BadRequestError(`replica part of step ${s.step} (${parts} parts) in a load of step ${st.step} (${st.parts} parts)`);
    st.got.set(s.shard, s);
    if (st === this.#loading && this.#whole(st)) {
      this.#complete = st;
      this.#loading = null;
    }
  }

  #whole(st: StagedLoad): boolean {
    if (st.got.size !== st.parts) return false;
    const ids = [...st.got.values()].flatMap((p) => p.chunks.map((c) => c.id));
    return ids.length === this.layout.chunks.length && new Set(ids).size === ids.length;
  }

  /** The newest restore staged completely (every part, every chunk once), or null. */
  get staged(): { step: number; generation: number } | null {
    const st = this.#complete;
    return st === null || !this.#whole(st) ? null : { step: st.step, generation: st.generation };
  }

  /** Whether a load newer than `generation` has begun (or completed) here: its restore is announced next. */
  newerThan(generation: number): boolean {
    return (this.#loading?.generation ?? 0) > generation || (this.#complete?.generation ?? 0) > generation;
  }

  /** The complete restore's values and state vectors (slab of `slabNumel`), and its counters; the staging empties. */
  take(slabNumel: number): { step: number; generation: number; optimizerSteps: number; lossScale: number; values: Float32Array; states: Float32Array[] } {
    const st = this.#complete;
    if (st === null || !this.#whole(st)) throw new EngineError("no complete replica is staged");
    const values = new Float32Array(slabNumel);
    const states = this.stateNames().map(() => new Float32Array(slabNumel));
    for (const part of st.got.values()) {
      for (const c of part.chunks) {
        const info = this.layout.chunks[c.id]!;
        values.set(c.params, info.offset);
        c.state.forEach((v, i) => states[i]!.set(v.data, info.offset));
      }
    }
    this.#complete = null;
    return { step: st.step, generation: st.generation, optimizerSteps: st.optimizerSteps, lossScale: st.lossScale, values, states };
  }
}

interface StagedLoad {
  step: number;
  generation: number;
  parts: number;
  optimizerSteps: number;
  lossScale: number;
  got: Map<number, ShardState>;
}

/**
 * Checks one part of a snapshot's replica before anything is kept: its job, checksum, part
 * number, communicator generation, step and loss scale, and every chunk against the job's
 * layout (its length, the optimizer's state vectors `names`, finite and plausible values). BadRequestError
 * names the first problem.
 */
export function checkReplicaPart(s: ShardState, job: string, layout: Layout, names: readonly string[], totalSteps: number): void {
  const parts = s.parts ?? 0;
  if (s.job !== job) throw new BadRequestError(`a replica of job ${s.job} loaded into job ${job}`);
  if (s.checksum !== shardStateChecksum(s)) throw new BadRequestError("a replica part whose checksum does not match its contents (changed after it was cut)");
  if (!(parts >= 1) || s.shard >= parts) throw new BadRequestError(`replica part ${s.shard} of ${parts}`);
  if (!((s.generation ?? 0) > 0)) throw new BadRequestError("a replica load names no communicator generation");
  if (!Number.isSafeInteger(s.step) || s.step < 0 || s.step > totalSteps)
    throw new BadRequestError(`replica of step ${s.step}: job ${job} runs steps 0 to ${totalSteps}`);
  if (!(Number.isFinite(s.lossScale ?? 0) && (s.lossScale ?? 0) >= 0)) throw new BadRequestError(`replica with loss scale ${s.lossScale}`);
  const want = names.join(",");
  for (const c of s.chunks) {
    const info = layout.chunks[c.id];
    if (!info) throw new BadRequestError(`replica chunk ${c.id}: the job has chunks 0 to ${layout.chunks.length - 1}`);
    if (c.params.length !== info.count) throw new BadRequestError(`replica chunk ${c.id} has ${c.params.length} values, expected ${info.count}`);
    if (c.state.map((v) => v.name).join(",") !== want)
      throw new BadRequestError(`replica chunk ${c.id} has optimizer state [${c.state.map((v) => v.name).join(",")}], this job needs [${want}]`);
    for (const v of [c.params, ...c.state.map((x) => x.data)]) {
      if (v.length !== info.count) throw new BadRequestError(`replica chunk ${c.id} has a state vector of ${v.length} values, expected ${info.count}`);
      if (!plausibleState(v)) throw new BadRequestError(`replica chunk ${c.id} holds ${implausibleStateText}`);
    }
  }
}

/** A one-row batch of zeros shaped as the job's (what the buckets are cut from). */
function probeBatch(cfg: JobConfig): HostBatch {
  if (cfg.model.kind === "mlp") {
    const cols = cfg.model.widths[0]!;
    return { inputs: new Float32Array(cols), inputShape: [1, cols], targets: new Int32Array(1), targetShape: [1] };
  }
  const t = cfg.model.blockSize;
  return { inputs: new Int32Array(t), inputShape: [1, t], targets: new Int32Array(t), targetShape: [1, t] };
}
