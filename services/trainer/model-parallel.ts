// A trainer rank of a model-parallel job (`pipelineStages` x `tensorParallel` > 1, all-reduce
// mode): it holds one share of the GPT, its stage's blocks cut to its tensor rank
// (engine/parallel/pipeline.ts), and steps with the other ranks of its copy of the model and the
// same share in the other copies. Ranks are numbered tensor rank fastest, then stage, then copy
// (coordsOf): a job of 8 trainers with 2 stages and 2 tensor ranks runs copies d = 0 and 1 of
// ranks 0-3 and 4-7, and copy d trains on the data-loader's rank d.
//
// Every collective (a stage's activations to the next, the tensor ranks' all-reduces, the tied
// embedding, the replicas' gradients) is a ring of the job's collective transport over NATS
// (services/runtime/transport/collective-bus.ts), one per group, under the communicator generation that
// the newest restore assigned.
//
// Snapshots are in the whole model's layout, so they export as a model file and restore into any
// layout: each rank of copy 0 serves the elements it answers for (shareRuns "owned") as slab
// ranges, as a ZeRO rank serves its partition, and the checkpoint service assembles the
// replica from them. A restore loads the whole replica's parts into every rank, which keeps
// its share of the parameters and the optimizer state.
//
// The events: the last stage's tensor rank 0 of each copy speaks for it (Step and Eval events
// with rank = its copy), so a job's events read as those of its data-parallel ranks.
import type { Backend } from "../../ffi/backend.ts";
import { EngineError } from "../../engine/errors.ts";
import { type GptConfig, gptParamSpecs } from "../../engine/models/gpt.ts";
import type { Optimizer } from "../../engine/optim/optimizer.ts";
import { optimizerOf } from "../../engine/optim/choose.ts";
import { slabLayoutOf } from "../../engine/params.ts";
import { CollectiveClosedError } from "../../engine/parallel/collective.ts";
import { compareCopies } from "../../engine/parallel/data-parallel.ts";
import {
  coordsOf,
  type LayoutCoords,
  type ModelLayout,
  type ModelParallelRank,
  modelParallelRank,
  modelParallelRings,
  type SlabRun,
  shareRuns,
} from "../../engine/parallel/pipeline.ts";
import { PieceRouter, RingGroup, ringDefaults } from "../../engine/parallel/ring.ts";
import type { ModelMemory } from "../../engine/parallel/zero.ts";
import type { Context } from "../../engine/context.ts";
import type { EvalResult, HostBatch } from "../../engine/train.ts";
import type { DataPlan } from "../../schemas/messages/data-loader.ts";
import type { ShardState } from "../../schemas/messages/parameter-server.ts";
import type { Bus } from "../runtime/mesh/bus.ts";
import type { BusTransport } from "../runtime/transport/collective-bus.ts";
import { BadRequestError, CorruptDataError } from "../runtime/mesh/errors.ts";
import { dataRanks, type JobConfig, lrAt } from "../runtime/job/config.ts";
import { buildLayout, type Layout } from "../runtime/job/layout.ts";
import { modelConfigOf } from "../runtime/job/model.ts";
import { cutPartition, KeptParts, type ReplicaMeta } from "../runtime/job/replica-parts.ts";
import {
  CollectiveStandIn,
  jobTransport,
  ReplicaStaging,
  type ReplicaStepResult,
  type TransportSettings,
} from "./replica.ts";
import type { ReplicaServes, TrainerReplica } from "./trainer-replica.ts";

export interface ModelParallelOptions {
  bus: Bus;
  backend: Backend;
  cfg: JobConfig;
  rank: number;
  ctx: Context;
  plan: DataPlan;
  payloadBytesMax: number;
  transport?: TransportSettings;
  progressTimeoutMs?: number;
}

/** One share of a copy of the model (trainer-replica.ts builds it). */
export class ModelParallelReplica implements TrainerReplica {
  readonly layout: Layout;
  readonly mp: ModelLayout;
  readonly coords: LayoutCoords;
  readonly #o: ModelParallelOptions;
  /** between interrupt() and reconnect(): what answers the rank's collective subject */
  readonly #standIn: CollectiveStandIn;
  readonly #config: GptConfig;
  /** the model share and its step runner, rebuilt (on the same model) by every reconnect */
  #rank: ModelParallelRank;
  readonly optimizer: Optimizer;
  /** the transport and its router of the current generation */
  #wire: { transport: BusTransport; router: PieceRouter } | null = null;
  #generation = 0;
  readonly #meter = { bytes: 0 };
  /** this rank's elements in the whole model's slab: all of them (restores), and those it serves */
  readonly #all: SlabRun[];
  readonly #owned: SlabRun[];
  /** a restore's parts as they arrive, checked; nothing changes until apply() */
  readonly staging: ReplicaStaging;
  /** the most bytes of activations this rank's passes held at once (after a forward) */
  #peakHeld = 0;
  readonly #exported = new KeptParts("the share");

  constructor(o: ModelParallelOptions) {
    this.#o = o;
    this.#standIn = new CollectiveStandIn(o.bus, o.cfg.job, o.rank);
    const { cfg, plan } = o;
    if (cfg.model.kind !== "gpt") throw new EngineError("model parallelism cuts a gpt");
    this.mp = { data: dataRanks(cfg), stages: cfg.pipelineStages, tensor: cfg.tensorParallel };
    this.coords = coordsOf(this.mp, o.rank);
    this.#config = modelConfigOf(cfg, plan) as GptConfig;
    const whole = slabLayoutOf(gptParamSpecs(this.#config));
    if (whole.slabNumel !== plan.slabNumel || whole.decayEnd !== plan.decayElems) {
      throw new CorruptDataError(
        `job ${cfg.job}'s plan holds a model of ${plan.slabNumel} slab elements (${plan.decayElems} decayed); this trainer builds ${whole.slabNumel} (${whole.decayEnd})`,
      );
    }
    this.layout = buildLayout(cfg.job, plan.slabNumel, plan.decayElems, cfg.chunkBytes, 1);
    this.staging = new ReplicaStaging(
      cfg.job,
      this.layout,
      () => this.optimizer.stateSlabs().map((x) => x.name),
      plan.totalSteps,
    );
    const opt = cfg.optimizer;
    let optimizer: Optimizer | null = null;
    this.#rank = modelParallelRank({
      ...this.#common(0),
      optimizer: (m) => (optimizer = optimizerOf(o.ctx, m.store, opt)),
    });
    this.optimizer = optimizer!;
    this.#all = shareRuns(this.model, whole.entries, "all");
    this.#owned = shareRuns(this.model, whole.entries, "owned");
  }

  /** What a rank is built from, with rings over a new transport of generation `generation`. */
  #common(generation: number) {
    const { cfg, rank, ctx } = this.#o;
    const transport = jobTransport(this.#o, generation, this.#meter);
    const router = new PieceRouter(ringDefaults.earlyBytesMax);
    transport.listen((p) => router.receive(p));
    this.#wire = { transport, router };
    const options = {
      ...ringDefaults,
      ...(this.#o.progressTimeoutMs ? { progressTimeoutMs: this.#o.progressTimeoutMs } : {}),
    };
    const rings = modelParallelRings(
      "mp",
      this.mp,
      rank,
      (name, members) => new RingGroup(name, members, transport, router, options),
    );
    return {
      ctx,
      config: this.#config,
      seed: cfg.seed,
      layout: this.mp,
      rings,
      schedule: cfg.pipeSchedule,
      gradClip: cfg.gradClip,
      recompute: cfg.recompute,
    };
  }

  get model(): ModelParallelRank["model"] {
    return this.#rank.model;
  }

  /** What this rank serves a snapshot: its owned elements, if it is in copy 0. */
  get serves(): ReplicaServes {
    return this.coords.d === 0 ? "partition" : "none";
  }

  /** The rank whose Step and Eval events speak for this copy (its number), or null. */
  get eventRank(): number | null {
    return this.coords.s === this.mp.stages - 1 && this.coords.t === 0 ? this.coords.d : null;
  }

  /** The data-loader's rank this copy reads. */
  get dataRank(): number {
    return this.coords.d;
  }

  get memory(): ModelMemory {
    const { ctx, cfg } = this.#o;
    const store = this.model.store;
    return {
      stage: 0,
      ranks: cfg.trainers,
      params: store.values.bytes,
      paramCount: store.paramCount,
      grads: store.grads.bytes,
      optimizer: this.optimizer.stateSlabs().reduce((sum, s) => sum + s.allocation.bytes, 0),
      host: 0,
      buckets: 0,
      // activations live in a pass per micro-batch in flight: the most they held at once
      arenaPeak: Math.max(ctx.arena.highWaterBytes, this.#peakHeld),
      gatheredPeak: 0,
    };
  }

  get wireBytes(): number {
    return this.#meter.bytes;
  }

  get generation(): number {
    return this.#generation;
  }

  readonly hostCount = 1;
  /** no collective plan: every group is a ring over the job's transport */
  readonly plan = null;

  /** The topology does not change the rings of a model-parallel job (a flat ring each). */
  useTopology(_hosts: readonly string[]): void {}

  /**
   * One step of this rank: its share of the copy's micro-batches (`micro`: the copy's batch,
   * `rows` of the step's `total`), reduced with the other copies by their rows.
   */
  async step(step: number, micro: readonly HostBatch[], rows: number, total: number): Promise<ReplicaStepResult> {
    const lr = lrAt(this.#o.cfg, this.#o.plan, step);
    const r = await this.#rank.stage.step(step, micro, lr, total > 0 ? rows / total : 0);
    this.#peakHeld = Math.max(this.#peakHeld, r.peakHeldBytes);
    return {
      loss: r.loss,
      gradNorm: r.gradNorm,
      skipped: false,
      // waits: for a neighbour stage's activations or gradients, and in the tensor ranks' all-reduces
      computeMs: r.stepMs - r.idleMs - r.tensorMs,
      commMs: r.idleMs + r.tensorMs,
      exposedCommMs: r.idleMs + r.tensorMs,
      density: -1,
      lr,
    };
  }

  /** The copy's evaluation over `batches` (every rank of the copy gets the same). */
  evaluate(step: number, batches: readonly HostBatch[]): Promise<EvalResult> {
    return this.#rank.stage.evaluate(step, batches);
  }

  /** The copies' parameters compared: every copy of this share must hold the same bits. */
  async checkReplicas(step: number): Promise<void> {
    const data = this.#rank.rings.data;
    if (data === null) return;
    const { differ } = await compareCopies(data, this.model.store.readValues(), this.coords.d, data.size, step);
    if (differ.length > 0) {
      const { s, t } = this.coords;
      throw new EngineError(
        `the copies of stage ${s}, tensor rank ${t} diverged by step ${step}: copies ${differ.join(", ")} differ from copy 0`,
      );
    }
  }

  /** Cuts this rank's share (copy 0) for the snapshot of `step`; returns its number of parts. */
  cut(step: number, partBytesMax: number): number {
    if (this.serves !== "partition")
      throw new BadRequestError(
        `trainer ${this.#o.rank} is in copy ${this.coords.d} of the model; copy 0 serves snapshots`,
      );
    const store = this.model.store;
    const values = store.readValues();
    const slabs = this.optimizer.stateSlabs();
    const states = slabs.map((s) => {
      const v = new Float32Array(store.slabNumel);
      this.#o.backend.download(s.allocation.ptr, v);
      return v;
    });
    const meta: ReplicaMeta & { rank: number } = {
      job: this.#o.cfg.job,
      step,
      optimizerSteps: this.optimizer.stepCount,
      lossScale: 0,
      rank: this.#o.rank,
    };
    const ranges = this.#owned.map((r) => ({ offset: r.whole, count: r.count, packed: r.local }));
    const parts = cutPartition(
      meta,
      ranges,
      slabs.map((s) => s.name),
      (_offset, count, packed) => ({
        params: values.slice(packed, packed + count),
        state: states.map((v) => v.slice(packed, packed + count)),
      }),
      partBytesMax,
    );
    return this.#exported.keep(step, parts);
  }

  hasCut(step: number): boolean {
    return this.#exported.has(step);
  }

  async exportPart(step: number, part: number, partBytesMax: number): Promise<ShardState> {
    if (!this.#exported.has(step)) this.cut(step, partBytesMax);
    return this.#exported.part(step, part, () => []);
  }

  /** Applies the staged restore: this rank's share of the parameters and optimizer state, and the generation. */
  apply(): { step: number; generation: number } {
    const { backend, plan } = this.#o;
    const slabs = this.optimizer.stateSlabs();
    const st = this.staging.take(plan.slabNumel);
    const { values, states } = st;
    const store = this.model.store;
    const mine = new Float32Array(store.slabNumel);
    const mineStates = slabs.map(() => new Float32Array(store.slabNumel));
    for (const r of this.#all) {
      mine.set(values.subarray(r.whole, r.whole + r.count), r.local);
      mineStates.forEach((m, i) => m.set(states[i]!.subarray(r.whole, r.whole + r.count), r.local));
    }
    store.writeValues(mine);
    slabs.forEach((s, i) => backend.upload(s.allocation.ptr, mineStates[i]!));
    this.optimizer.setStepCount(st.optimizerSteps);
    store.zeroGrad();
    this.#exported.clear();
    this.reconnect(st.generation);
    return { step: st.step, generation: st.generation };
  }

  /** New rings under a new generation: operations in flight fail, stale pieces are refused. */
  reconnect(generation: number): void {
    this.#disconnect(`communicator generation ${this.#generation} replaced by ${generation}`);
    this.#standIn.release();
    this.#generation = generation;
    this.#rank = modelParallelRank({ ...this.#common(generation), optimizer: () => this.optimizer, model: this.model });
  }

  /** Fails the operations in flight (a restore abandons the step); apply() reconnects (CollectiveStandIn meanwhile). */
  interrupt(): void {
    this.#disconnect("the step was abandoned for a restore");
    this.#standIn.hold();
  }

  close(): void {
    this.#standIn.release();
    this.#disconnect("the trainer stopped");
  }

  #disconnect(reason: string): void {
    if (this.#wire === null) return;
    this.#wire.router.failAll(new CollectiveClosedError(reason));
    this.#wire.transport.close();
    this.#wire = null;
  }
}
