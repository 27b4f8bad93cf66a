// A trainer rank's replica in all-reduce mode (`sync: "allreduce"`): the service's side of
// engine/parallel/data-parallel.ts, which does the step (buckets, ZeRO, compression, offload).
// This file wires it to the mesh:
//   - the communicator: NCCL where every rank has its own GPU of one host and NCCL loads
//     (services/runtime/job/collective-plan.ts decides from what the ranks announce in service
//     discovery; nccl-group.ts connects it through the job store), else a ring over NATS
//     (BusTransport, shared memory between processes of one machine), hierarchical when the
//     ranks' host labels name more than one machine; rebuilt under a new generation by a
//     restore (reconnect);
//   - checkpoints: rank 0 serves its replica in parts (ShardState messages of the job's chunk
//     layout, each under the message limit) to the checkpoint service, or under ZeRO every rank
//     its partition; on restore every rank is loaded the same parts (ReplicaStaging) and applies
//     them at its next step boundary, with the communicator generation the restore assigned
//     (pieces of the earlier generation are refused).
import type { Backend } from "../../ffi/backend.ts";
import type { Model } from "../../engine/models/model.ts";
import type { Optimizer } from "../../engine/optim/optimizer.ts";
import type { LossScaler } from "../../engine/optim/loss-scale.ts";
import type { Collective } from "../../engine/parallel/collective.ts";
import { DataParallel, type DataParallelStepResult } from "../../engine/parallel/data-parallel.ts";
import { HierarchicalCollective, topologyRings } from "../../engine/parallel/hierarchical.ts";
import { NcclHierarchical } from "../../engine/parallel/nccl-hierarchical.ts";
import type { Codec } from "../../engine/parallel/compress.ts";
import { RingCollective } from "../../engine/parallel/ring.ts";
import type { ModelMemory, Partition, ZeroStage } from "../../engine/parallel/zero.ts";
import { type DeviceBuffer, StagedCollective } from "../../engine/parallel/nccl-collective.ts";
import { CudaBackend, type SideStream } from "../../ffi/cuda/backend.ts";
import { type CollectivePlan, collectivePlan, type TrainerPlace } from "../runtime/job/collective-plan.ts";
import type { NcclIdExchange } from "../runtime/job/nccl-id.ts";
import { NcclGroup } from "./nccl-group.ts";
import type { Context } from "../../engine/context.ts";
import { EngineError } from "../../engine/errors.ts";
import { type EvalResult, evaluate, type HostBatch } from "../../engine/train.ts";
import { type ShardState, shardStateChecksum } from "../../schemas/messages/parameter-server.ts";
import { type Bus, release, type Subscription } from "../runtime/mesh/bus.ts";
import { BusTransport, busTransportDefaults, type BusTransportOptions } from "../runtime/transport/collective-bus.ts";
import { BadRequestError, CapacityError } from "../runtime/mesh/errors.ts";
import { type JobConfig, lrAt } from "../runtime/job/config.ts";
import { subjects } from "../runtime/job/subjects.ts";
import { buildLayout, type Layout } from "../runtime/job/layout.ts";
import { cutPartition, cutReplica, KeptParts, type ReplicaMeta } from "../runtime/job/replica-parts.ts";
import { implausibleStateText, plausibleState } from "../runtime/job/limits.ts";
import type { ReplicaServes, TrainerReplica } from "./trainer-replica.ts";

export { ReplicaDivergedError } from "../../engine/parallel/data-parallel.ts";
/** A step's result, and the learning rate its update took (the job's schedule at that step). */
export type ReplicaStepResult = DataParallelStepResult & { lr: number };

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
  transport?: TransportSettings;
  progressTimeoutMs?: number;
  /** where NCCL communicators find their ids (the job store); absent: the ring always */
  ncclIds?: NcclIdExchange;
  /** the job's submission (its spec's attempt): a resubmitted job's communicators get keys of their own */
  attempt?: number;
}

export type TransportSettings = Partial<
  Pick<
    BusTransportOptions,
    "pieceBytesMax" | "windowPieces" | "sendTimeoutMs" | "peerLostMs" | "sharedMemory" | "netAddress"
  >
>;

/**
 * Trainer `rank`'s transport for its job's collectives, of communicator generation `generation`:
 * a piece and its header fit the message limit; peers on this machine get their values through
 * shared memory, and peers on others send over TCP to the settings' address, unless the job says
 * NATS (`collTransport: nats`). `meter` counts the bytes delivered.
 */
export function jobTransport(
  o: { bus: Bus; cfg: JobConfig; rank: number; payloadBytesMax: number; transport?: TransportSettings },
  generation: number,
  meter: { bytes: number },
): BusTransport {
  const t = { ...busTransportDefaults, ...o.transport };
  return new BusTransport(o.bus, {
    ...t,
    pieceBytesMax: Math.min(t.pieceBytesMax, Math.floor((o.payloadBytesMax - 4096) / 4) * 4),
    job: o.cfg.job,
    rank: o.rank,
    size: o.cfg.trainers,
    generation,
    sharedMemory: o.transport?.sharedMemory ?? o.cfg.collTransport === "auto",
    netAddress: o.cfg.collTransport === "auto" ? (o.transport?.netAddress ?? null) : null,
    meter,
  });
}

/**
 * What answers trainer `rank`'s collective subject between a restore's interrupt and its
 * reconnect: a sender is told to retry (CapacityError) instead of finding no responder for as
 * long as the restore takes. Released in the same turn of the event loop as the next
 * generation's transport subscribes, by a drain: a piece the server routed to the stand-in
 * before it took the unsubscribe is still answered (retry). Unsubscribed outright, such a piece
 * was dropped by the client unanswered, and its sender waited out its 10 s send timeout (seen
 * after one in three operator restores of an all-reduce job: the first step after it took 10.3 s).
 */
export class CollectiveStandIn {
  #sub: Subscription | null = null;

  constructor(
    readonly bus: Bus,
    readonly job: string,
    readonly rank: number,
  ) {}

  hold(): void {
    this.#sub ??= this.bus.handle(subjects.collTo(this.job, this.rank), () => {
      throw new CapacityError(`rank ${this.rank} is between communicator generations (a restore is under way); retry`);
    });
  }

  release(): void {
    release(this.#sub);
    this.#sub = null;
  }
}

/** A whole copy of the model, its gradient all-reduced with the other ranks' (trainer-replica.ts builds it). */
export class Replica implements TrainerReplica {
  /** the step: buckets, ZeRO, compression, offload (engine/parallel/data-parallel.ts) */
  readonly dp: DataParallel;
  readonly layout: Layout;
  readonly #o: ReplicaOptions;
  /** bytes of values this rank's communicators delivered to peers */
  readonly #meter = { bytes: 0 };
  #generation = 0;
  /** built at its first use, once the topology is known (see useTopology) */
  #collective: Collective | null = null;
  /** between interrupt() and reconnect(): what answers the rank's collective subject */
  readonly #standIn: CollectiveStandIn;
  /** host label per rank; null or a single label: the flat ring */
  #hosts: readonly string[] | null = null;
  /** which collective carries the job (useTopology); null: the ring */
  #plan: CollectivePlan | null = null;
  /** the NCCL communicator of the current generation (the host's, in a hierarchy), where the plan says NCCL */
  #nccl: NcclGroup | null = null;
  /** the collective over device buffers built on it (the hierarchy's, over several hosts) */
  #device: Collective<DeviceBuffer> | null = null;
  /** the stream NCCL runs on beside the compute stream, made with the first communicator and kept */
  #sideStream: SideStream | null = null;
  /** a restore's parts as they arrive, checked; nothing changes until apply() */
  readonly staging: ReplicaStaging;
  /** rank 0: the encoded parts of the replica at a step, kept while the checkpoint service reads them */
  readonly #exported = new KeptParts("the replica");

  constructor(o: ReplicaOptions) {
    this.#o = o;
    this.#standIn = new CollectiveStandIn(o.bus, o.cfg.job, o.rank);
    const { ctx, model, cfg } = o;
    this.dp = new DataParallel({
      ctx,
      model,
      rank: o.rank,
      ranks: cfg.trainers,
      collective: () => this.#comm,
      // on a GPU whose job may take NCCL the buckets are device buffers once the plan says NCCL
      ...(this.#ncclCandidate && cfg.offload !== "optimizer" && (cfg.compress === "none" || cfg.zero === 0)
        ? { deviceCollective: () => this.#deviceComm }
        : {}),
      zero: cfg.zero,
      offload: cfg.offload === "optimizer",
      bucketMb: cfg.bucketMb,
      compress: cfg.compress,
      optimizer: cfg.optimizer,
      gradClip: cfg.gradClip,
      warmupSteps: cfg.warmupSteps,
      accumSteps: cfg.accumSteps,
      seed: cfg.seed,
      probe: probeBatch(cfg),
    });
    this.layout = buildLayout(cfg.job, model.store.slabNumel, model.store.decayRange.numel, cfg.chunkBytes, 1);
    this.staging = new ReplicaStaging(
      cfg.job,
      this.layout,
      () => this.optimizer.stateSlabs().map((x) => x.name),
      o.totalSteps,
    );
  }

  get model(): Model {
    return this.#o.model;
  }
  get optimizer(): Optimizer {
    return this.dp.optimizer;
  }
  get scaler(): LossScaler | null {
    return this.dp.scaler;
  }
  get zero(): ZeroStage {
    return this.dp.zero;
  }
  /** ZeRO: the part of every bucket this rank owns (null at stage 0) */
  get partition(): Partition | null {
    return this.dp.partition;
  }
  get codec(): Codec {
    return this.dp.codec;
  }
  /** What this rank holds for the model, read from its allocations (and the arena's high-water mark). */
  get memory(): ModelMemory {
    return this.dp.memory;
  }
  /** Sizes of the buckets in elements, in the order they are reduced (after the first step). */
  get bucketSizes(): number[] {
    return this.dp.bucketSizes;
  }

  get generation(): number {
    return this.#generation;
  }

  /** What this rank serves a snapshot: rank 0 the whole replica, or (ZeRO) every rank its partition. */
  get serves(): ReplicaServes {
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

  /** Bytes of values this rank has sent to its peers (every collective, every path). */
  get wireBytes(): number {
    return this.#meter.bytes;
  }

  /** How many machines the ranks' labels name (1 until useTopology). */
  get hostCount(): number {
    return new Set(this.#hosts ?? [""]).size;
  }

  /** Which collective carries the job (after useTopology; null before, or without places). */
  get plan(): CollectivePlan | null {
    return this.#plan;
  }

  get #side(): SideStream {
    this.#sideStream ??= (this.#o.backend as CudaBackend).sideStream();
    return this.#sideStream;
  }

  /** Whether this rank could take NCCL: on a GPU, with the job store to exchange ids through. */
  get #ncclCandidate(): boolean {
    return this.#o.backend instanceof CudaBackend && this.#o.ncclIds !== undefined;
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
  useTopology(hosts: readonly string[], places?: readonly (TrainerPlace | undefined)[]): void {
    const n = this.#o.cfg.trainers;
    if (hosts.length !== n || hosts.some((h) => h === ""))
      throw new RangeError(`a topology needs a host label for each of the ${n} ranks, got ${hosts.join(",")}`);
    if (this.#collective !== null) throw new Error("the topology must be given before the communicator's first use");
    this.#hosts = [...hosts];
    if (places !== undefined) {
      this.#plan = collectivePlan(this.#o.cfg, places);
      // a trainer that cannot run NCCL itself (no job store here) must not be planned onto it
      if (this.#plan.carrier !== "ring" && !this.#ncclCandidate)
        throw new Error("the collective plan says NCCL for a rank that cannot set it up");
    }
  }

  /** The communicator of the current generation (built at first use). */
  get #comm(): Collective {
    this.#collective ??= this.#connect(this.#generation);
    return this.#collective;
  }

  /** The current generation's NCCL communicator where the buckets are device buffers, else null (the host path). */
  get #deviceComm(): Collective<DeviceBuffer> | null {
    if (this.#plan?.deviceBuckets !== true) return null;
    void this.#comm; // builds the generation's communicator
    return this.#device;
  }

  /** A peer went quiet (the liveness watch named it): an NCCL communicator would wait on it forever, so it is aborted here. */
  peerStalled(peer: number, why: string): void {
    if (peer !== this.#o.rank) this.#nccl?.abortFor(peer, why);
  }

  #connect(generation: number): Collective {
    const cfg = this.#o.cfg;
    const carrier = this.#plan?.carrier ?? "ring";
    if (carrier !== "ring") {
      this.#device = this.#ncclCollective(carrier, generation);
      // host arrays (the replica check; ZeRO's and offload's buckets) through the same communicator
      return new StagedCollective(this.#device, this.#o.backend);
    }
    const transport = jobTransport(this.#o, generation, this.#meter);
    const options = this.#o.progressTimeoutMs ? { progressTimeoutMs: this.#o.progressTimeoutMs } : {};
    return this.#hosts !== null && new Set(this.#hosts).size > 1
      ? new HierarchicalCollective(transport, { hosts: this.#hosts }, options)
      : new RingCollective(transport, cfg.trainers, options);
  }

  /**
   * The generation's collective over device buffers: one NCCL communicator over every rank, or
   * (several hosts) one per host whose leader is its first rank, under the ring among the
   * leaders over the job's transport. The communicator's key names its leader, its group (the
   * job's submission, and the host) and the generation.
   */
  #ncclCollective(carrier: "nccl" | "nccl-ring", generation: number): Collective<DeviceBuffer> {
    const { cfg, rank } = this.#o;
    const group = `dp-${this.#o.attempt ?? 0}`;
    const nccl = (ranks: readonly number[], name: string) =>
      new NcclGroup({
        backend: this.#o.backend as CudaBackend,
        side: this.#side,
        ids: this.#o.ncclIds!,
        key: { job: cfg.job, leader: ranks[0]!, group: name, generation },
        rank: ranks.indexOf(rank),
        ranks: ranks.length,
      });
    if (carrier === "nccl") {
      this.#nccl = nccl(
        Array.from({ length: cfg.trainers }, (_, r) => r),
        group,
      );
      return this.#nccl;
    }
    const hosts = this.#hosts!;
    const { byHost } = topologyRings(hosts);
    const index = [...byHost.keys()].indexOf(hosts[rank]!);
    this.#nccl = nccl(byHost.get(hosts[rank]!)!, `${group}-h${index}`);
    const options = this.#o.progressTimeoutMs ? { progressTimeoutMs: this.#o.progressTimeoutMs } : {};
    const between = new HierarchicalCollective(jobTransport(this.#o, generation, this.#meter), { hosts }, options);
    return new NcclHierarchical(this.#nccl, between, this.#o.backend);
  }

  /** Rebuilds the communicator under a new generation: operations in flight fail, stale pieces are refused. */
  reconnect(generation: number): void {
    this.#collective?.close(`communicator generation ${this.#generation} replaced by ${generation}`);
    this.#nccl?.dispose();
    this.#nccl = null;
    this.#device = null;
    this.dp.communicatorReplaced();
    this.#generation = generation;
    this.#standIn.release();
    this.#collective = this.#connect(generation);
  }

  close(): void {
    this.#standIn.release();
    this.#collective?.close("the trainer stopped");
    this.#nccl?.dispose();
    if (this.#sideStream !== null) (this.#o.backend as CudaBackend).closeSideStream(this.#sideStream);
    this.#sideStream = null;
    this.dp.dispose();
  }

  /** Fails the operations in flight (a restore abandons the step); the restore's apply() reconnects (CollectiveStandIn meanwhile). */
  interrupt(): void {
    this.#collective?.close("the step was abandoned for a restore");
    this.#standIn.hold();
  }

  /**
   * One step: forward/backward over `micro` (this rank's `rows` samples), the averaged gradient
   * over all ranks (`totalRows` samples), and the update at the job's learning rate at `step`.
   */
  async step(step: number, micro: readonly HostBatch[], rows: number, totalRows: number): Promise<ReplicaStepResult> {
    const lr = lrAt(this.#o.cfg, this.#o, step);
    return { ...(await this.dp.step(step, micro, rows, totalRows, lr)), lr };
  }

  /** ZeRO stage 3: every bucket's parameters gathered and bound (every rank at the same step boundary). */
  gatherAll(step: number): Promise<void> {
    return this.dp.gatherAll(step);
  }

  /** The whole parameter slab as this rank sees it (stage 3: gathered, by every rank at `step`). */
  readValues(step: number): Promise<Float32Array> {
    return this.dp.readValues(step);
  }

  /** ZeRO stage 3: waits for the gathers in flight and frees every gathered bucket. */
  releaseAll(): Promise<void> {
    return this.dp.releaseAll();
  }

  /** The model's evaluation over `batches`; ZeRO stage 3 gathers the whole model for it (every rank at this boundary). */
  async evaluate(step: number, batches: readonly HostBatch[]): Promise<EvalResult> {
    await this.gatherAll(step);
    const r = evaluate(this.#o.ctx, this.#o.model, batches);
    await this.releaseAll();
    return r;
  }

  /** Compares the ranks' parameters (ReplicaDivergedError naming the ranks that differ). */
  checkReplicas(step: number): Promise<void> {
    return this.dp.checkReplicas(step);
  }

  /** Cuts the replica (or this rank's partition) for the snapshot of `step`: copies kept for its parts; returns their number. */
  cut(step: number, partBytesMax: number): number {
    return this.#exported.keep(step, this.#parts(step, partBytesMax));
  }

  /** Whether a cut of `step` is kept. */
  hasCut(step: number): boolean {
    return this.#exported.has(step);
  }

  /**
   * What this rank serves a snapshot, part `part` of it as it is at `step`: at stage 0 (rank 0)
   * the replica (parameters, optimizer state, step count, loss scale) cut along the job's chunks;
   * under ZeRO (every rank) its own partition, slab ranges with their parameters and state
   * (services/runtime/job/replica-parts.ts). Each part fits `partBytesMax`.
   */
  async exportPart(step: number, part: number, partBytesMax: number): Promise<ShardState> {
    return this.#exported.part(step, part, () => this.#parts(step, partBytesMax));
  }

  #parts(step: number, partBytesMax: number): ShardState[] {
    return this.partition === null ? this.#replicaParts(step, partBytesMax) : this.#partitionParts(step, partBytesMax);
  }

  #meta(step: number): ReplicaMeta {
    return { job: this.#o.cfg.job, step, optimizerSteps: this.optimizer.stepCount, lossScale: this.scaler?.scale ?? 0 };
  }

  #replicaParts(step: number, partBytesMax: number): ShardState[] {
    return cutReplica(
      this.#meta(step),
      this.layout,
      this.#o.model.store.readValues(),
      this.dp.readOptimizerState(),
      partBytesMax,
    );
  }

  /** ZeRO: this rank's ranges of the slab, their parameters (its own at stage 3, the replicated slab's below) and its packed state. */
  #partitionParts(step: number, partBytesMax: number): ShardState[] {
    const ranges = this.partition!.ranges.flat().map((r) => ({
      offset: r.paramOffset,
      count: r.numel,
      packed: r.stateOffset,
    }));
    return cutPartition(
      { ...this.#meta(step), rank: this.#o.rank },
      ranges,
      this.optimizer.stateSlabs().map((x) => x.name),
      (offset, count, packed) => this.dp.readPartitionRange(offset, count, packed),
      partBytesMax,
    );
  }

  /** Applies the staged restore: parameters, optimizer state, loss scale, and the communicator's generation. */
  apply(): { step: number; generation: number } {
    const st = this.staging.take(this.#o.model.store.slabNumel);
    this.dp.load(st);
    this.#exported.clear();
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
      this.#loading = {
        step: s.step,
        generation: g,
        parts,
        optimizerSteps: s.optimizerSteps,
        lossScale: s.lossScale ?? 0,
        got: new Map(),
      };
    const st = this.#complete?.generation === g ? this.#complete : this.#loading!;
    if (st.step !== s.step || st.parts !== parts)
      throw new BadRequestError(
        `replica part of step ${s.step} (${parts} parts) in a load of step ${st.step} (${st.parts} parts)`,
      );
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
  take(slabNumel: number): {
    step: number;
    generation: number;
    optimizerSteps: number;
    lossScale: number;
    values: Float32Array;
    states: Float32Array[];
  } {
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
    return {
      step: st.step,
      generation: st.generation,
      optimizerSteps: st.optimizerSteps,
      lossScale: st.lossScale,
      values,
      states,
    };
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
export function checkReplicaPart(
  s: ShardState,
  job: string,
  layout: Layout,
  names: readonly string[],
  totalSteps: number,
): void {
  const parts = s.parts ?? 0;
  if (s.job !== job) throw new BadRequestError(`a replica of job ${s.job} loaded into job ${job}`);
  if (s.checksum !== shardStateChecksum(s))
    throw new BadRequestError("a replica part whose checksum does not match its contents (changed after it was cut)");
  if (!(parts >= 1) || s.shard >= parts) throw new BadRequestError(`replica part ${s.shard} of ${parts}`);
  if (!((s.generation ?? 0) > 0)) throw new BadRequestError("a replica load names no communicator generation");
  if (!Number.isSafeInteger(s.step) || s.step < 0 || s.step > totalSteps)
    throw new BadRequestError(`replica of step ${s.step}: job ${job} runs steps 0 to ${totalSteps}`);
  if (!(Number.isFinite(s.lossScale ?? 0) && (s.lossScale ?? 0) >= 0))
    throw new BadRequestError(`replica with loss scale ${s.lossScale}`);
  const want = names.join(",");
  for (const c of s.chunks) {
    const info = layout.chunks[c.id];
    if (!info) throw new BadRequestError(`replica chunk ${c.id}: the job has chunks 0 to ${layout.chunks.length - 1}`);
    if (c.params.length !== info.count)
      throw new BadRequestError(`replica chunk ${c.id} has ${c.params.length} values, expected ${info.count}`);
    if (c.state.map((v) => v.name).join(",") !== want)
      throw new BadRequestError(
        `replica chunk ${c.id} has optimizer state [${c.state.map((v) => v.name).join(",")}], this job needs [${want}]`,
      );
    for (const v of [c.params, ...c.state.map((x) => x.data)]) {
      if (v.length !== info.count)
        throw new BadRequestError(
          `replica chunk ${c.id} has a state vector of ${v.length} values, expected ${info.count}`,
        );
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
