// A trainer's step, one strategy per mode, chosen once when the rank opens the job
// (services/trainer/loop.ts's TrainerRun holds the job's life around it: batches, boundaries,
// restores, the end):
//   ParameterServerMode  batch -> pull the parameters -> forward/backward -> push the gradients;
//                        the shards hold the parameters and the optimizer.
//   ReplicaMode          batch -> forward/backward with the gradient all-reduced as backward
//                        goes on -> the same update on every rank, through the rank's
//                        TrainerReplica (trainer-replica.ts: a whole copy over the engine's
//                        DataParallel, or a share of a pipeline/tensor-parallel model); the rank
//                        holds the parameters and the optimizer.
import type { Backend } from "../../ffi/backend.ts";
import { CollectiveClosedError, CollectiveError } from "../../engine/parallel/collective.ts";
import type { ModelMemory } from "../../engine/parallel/zero.ts";
import { parseCompression } from "../../engine/parallel/compress.ts";
import type { Context } from "../../engine/context.ts";
import { type EvalResult, evaluate, type HostBatch, lossAndGradients } from "../../engine/train.ts";
import { type Batch, type DataPlan } from "../../schemas/messages/data-loader.ts";
import { decodeEvent, decodeJobRequest, encodeJobRequest, type Event, EventKind } from "../../schemas/messages/job.ts";
import { decodeManifest } from "../../schemas/messages/checkpoint.ts";
import { decodeShardState, decodeShardStats, encodeShardState } from "../../schemas/messages/parameter-server.ts";
import type { Bus, Subscription } from "../runtime/mesh/bus.ts";
import { NoRespondersError, NotReadyError } from "../runtime/mesh/errors.ts";
import type { Logger } from "../runtime/mesh/log.ts";
import { type HeartbeatPublisher, stalledTrainer } from "../runtime/control/liveness.ts";
import type { TrainerPlace } from "../runtime/job/collective-plan.ts";
import { type JobConfig, shardsClip } from "../runtime/job/config.ts";
import { jobOfRequest, subjects, trainerOpenedTag, recoverAsker, trainerLacksTag } from "../runtime/job/subjects.ts";
import type { buildModel } from "../runtime/job/model.ts";
import { planLayout } from "../runtime/job/plan.ts";
import { cutTag, partOfTag, precutSaveTag } from "../runtime/job/replica-parts.ts";
import { microBatches } from "./batches.ts";
import { checkpointTimeoutMs, requestTimeoutMs } from "./limits.ts";
import { PsClient } from "./ps-client.ts";
import type { TrainerReplica } from "./trainer-replica.ts";

/** What a mode's step needs of the run around it. */
export interface StepHost {
  readonly cfg: JobConfig;
  readonly rank: number;
  readonly bus: Bus;
  readonly backend: Backend;
  readonly ctx: Context;
  readonly model: ReturnType<typeof buildModel>;
  readonly payloadBytesMax: number;
  readonly log: Logger | undefined;
  /** the job's steps */
  readonly total: number;
  /** test-only: sleep this long in every step's compute (read once per step: it may change) */
  readonly stepDelayMs: number;
  readonly hb: HeartbeatPublisher | null;
  /** the batch of a step (requested ahead) */
  batch(step: number): Promise<Batch>;
  /** the step boundary's evaluation and snapshot; the time the snapshot took */
  boundary(step: number): Promise<number>;
  /** throws when a restore came after `generation` began (the step is abandoned) */
  checkGeneration(step: number, generation: number): void;
  publish(e: Partial<Event> & { kind: EventKind }): void;
  /** the learning rate of a step, and the samples all ranks train at it */
  lr(step: number): number;
  rowsAt(step: number): number;
  /** whether a restore was announced and not yet taken */
  restorePending(): boolean;
  /** settles when the next restore is announced (the work of the generation running is abandoned) */
  restoreAnnounced(): Promise<void>;
  /** the restores seen so far (a step begun under an earlier one is abandoned) */
  generation(): number;
}

/** What a step that failed calls for: a rewind of every rank, a wait (not counted as an attempt), or a retry. */
export type StepFailure = "rewind" | "wait" | "retry";

export interface TrainerMode {
  /** the rank this one's Step and Eval events carry (null: another rank speaks for its copy) */
  readonly eventRank: number | null;
  /** the data-loader's rank this trainer reads */
  readonly dataRank: number;
  /** bytes of gradients and parameters this rank has put on the bus */
  readonly wireBytes: number;
  /** all-reduce mode: the communicator generation the rank runs (0 before its first restore, and
   *  in parameter-server mode) */
  readonly commGeneration: number;
  /** what the rank holds for the model, read from its allocations (null: the shards hold it) */
  readonly memory: ModelMemory | null;
  /** the subjects the mode answers (a replica's loads and snapshot parts) */
  serve(): Subscription[];
  /** the ranks' host labels (all-reduce: more than one host makes the collective hierarchical)
   *  and, where they announced them, their devices (all-reduce: NCCL where collective-plan.ts says) */
  useTopology(hosts: readonly string[], places?: readonly (TrainerPlace | undefined)[]): void;
  /** the step to start from */
  findStartStep(): Promise<number>;
  /** one step, its Step event published */
  runStep(step: number, generation: number): Promise<void>;
  /** what a failed step calls for */
  failure(e: unknown): StepFailure;
  /** a restore abandons the step running: it must be over before the restore is taken */
  abandon(run: Promise<unknown>): Promise<void>;
  /** whether the restore announced (with its load's generation) can be taken now, is superseded by a newer load, or is missing */
  restoreState(to: number, generation: number): "ready" | "superseded" | "missing";
  /** takes the restore announced: its step */
  applyRestore(to: number): number;
  /** before an evaluation at `step` reads its batches: the final parameters pulled from the shards
   *  (first, so that a restore meanwhile refuses the pull at once instead of leaving it waiting) */
  beforeEvaluate(step: number): Promise<void>;
  /** the model's evaluation over `batches` */
  evaluate(step: number, batches: readonly HostBatch[]): Promise<EvalResult>;
  /** rank 0, at a scheduled snapshot: cuts what it serves now where it can; the save request's tag */
  snapshotTag(step: number): string;
  close(): void;
}

/** The mode of a job: all-reduce with the rank's replica (replicaOf), else parameter server (no replica). */
export function trainerMode(host: StepHost, plan: DataPlan, replica: TrainerReplica | null): TrainerMode {
  return replica === null ? new ParameterServerMode(host, plan) : new ReplicaMode(host, replica);
}

/** Parameter-server mode: pull, compute, push. */
class ParameterServerMode implements TrainerMode {
  readonly commGeneration = 0;
  readonly #h: StepHost;
  readonly #ps: PsClient;
  /** host copies of pulled parameters (one per restore generation) and pushed gradients */
  #params: { generation: number; data: Float32Array };
  readonly #grads: Float32Array;

  constructor(host: StepHost, plan: DataPlan) {
    this.#h = host;
    const { cfg, rank, bus, payloadBytesMax } = host;
    this.#ps = new PsClient(
      bus,
      planLayout(cfg, plan),
      rank,
      payloadBytesMax,
      parseCompression(cfg.compress),
      cfg.warmupSteps,
    );
    const n = host.model.store.slabNumel;
    this.#params = { generation: 0, data: new Float32Array(n) };
    this.#grads = new Float32Array(n);
  }

  get eventRank(): number {
    return this.#h.rank;
  }
  get dataRank(): number {
    return this.#h.rank;
  }
  get wireBytes(): number {
    return this.#ps.wireBytes;
  }
  get memory(): null {
    return null;
  }
  serve(): Subscription[] {
    return [];
  }
  useTopology(): void {}

  /** What this rank has pushed completely to every shard (0 for a new job). */
  async findStartStep(): Promise<number> {
    const { cfg, rank, bus } = this.#h;
    let step = Number.POSITIVE_INFINITY;
    for (let k = 0; k < cfg.shards; k++) {
      const req = encodeJobRequest({ job: cfg.job, step: 0, tag: "" });
      const stats = decodeShardStats(await bus.request(subjects.psStats(cfg.job, k), req, requestTimeoutMs), 1 << 20);
      // a shard that owns no chunk sees no pushes: its clocks say nothing
      if (stats.chunks > 0) step = Math.min(step, stats.clocks[rank] ?? 0);
    }
    return Number.isFinite(step) ? step : 0;
  }

  async runStep(step: number, generation: number): Promise<void> {
    const h = this.#h;
    const { cfg, backend, model } = h;
    const t0 = performance.now();
    h.hb?.at(step, "data");
    const batch = await h.batch(step);
    const t1 = performance.now();
    const wire0 = this.#ps.wireBytes;
    const params = this.#paramsFor(generation);
    h.hb?.at(step, "pull");
    await this.#ps.pull(step, params);
    h.checkGeneration(step, generation);
    backend.upload(model.store.values.ptr, params);
    const t2 = performance.now();
    const snapshotMs = await h.boundary(step);
    const t3 = performance.now();
    h.checkGeneration(step, generation);
    h.hb?.at(step, "compute");
    let loss = 0;
    if (batch.rows > 0) {
      // no loss scaler (parameter-server mode refuses f16): the gradients are f32 and always
      // pushed. BSP with clipping: the shards clip the averaged gradient by its global norm
      const micro = microBatches(batch, cfg.accumSteps);
      loss = lossAndGradients(h.ctx, model, micro, shardsClip(cfg) ? 0 : cfg.gradClip, step).loss;
      backend.download(model.store.grads.ptr, this.#grads);
    } else {
      this.#grads.fill(0); // this rank got no samples in the epoch's last, short step
    }
    const delayMs = h.stepDelayMs;
    if (delayMs) await Bun.sleep(delayMs);
    const t4 = performance.now();
    h.checkGeneration(step, generation);
    h.hb?.at(step, "push");
    await this.#ps.push(step, this.#grads);
    const t5 = performance.now();
    h.hb?.stepTook(t5 - t0);
    h.publish({
      kind: EventKind.Step,
      step,
      loss,
      lr: h.lr(step),
      samplesPerS: batch.rows / ((t5 - t0) / 1000),
      dataWaitMs: t1 - t0,
      pullMs: t2 - t1,
      computeMs: t4 - t3,
      pushMs: t5 - t4,
      count: batch.rows,
      wireBytes: this.#ps.wireBytes - wire0,
      snapshotMs,
    });
  }

  /** Host buffer for pulled parameters, one per restore generation (an abandoned pull keeps writing the old one). */
  #paramsFor(generation: number): Float32Array {
    if (this.#params.generation !== generation)
      this.#params = { generation, data: new Float32Array(this.#params.data.length) };
    return this.#params.data;
  }

  /** A shard waiting for its restore (or opening the job) answers NotReady: waited for. */
  failure(e: unknown): StepFailure {
    return e instanceof NotReadyError ? "wait" : "retry";
  }

  /** The abandoned step's push is refused by its generation check: nothing to wait for. */
  async abandon(): Promise<void> {}

  /** The shards were loaded before the restore was announced. */
  restoreState(): "ready" {
    return "ready";
  }
  applyRestore(to: number): number {
    return to;
  }

  /** At the end, the final parameters from the shards. */
  async beforeEvaluate(step: number): Promise<void> {
    const h = this.#h;
    if (step < h.total) return;
    const generation = h.generation();
    const params = this.#paramsFor(generation);
    // The final pull waits for the job's last update. A restore announced meanwhile abandons it:
    // one that reached a shard just after the restore's load waits for the restored run's end
    // (its timeout first, 120 s), and the rank with it, the other ranks waiting on its pushes.
    const pulled = this.#ps.pull(step, params);
    pulled.catch(() => {}); // abandoned: its failure is expected
    await Promise.race([pulled, h.restoreAnnounced()]);
    h.checkGeneration(step, generation);
    h.backend.upload(h.model.store.values.ptr, params);
  }

  async evaluate(_step: number, batches: readonly HostBatch[]): Promise<EvalResult> {
    return evaluate(this.#h.ctx, this.#h.model, batches);
  }

  snapshotTag(): string {
    return "schedule";
  }

  close(): void {}
}

/** All-reduce mode: a replica (or a model-parallel share) trained with its peers. */
class ReplicaMode implements TrainerMode {
  readonly #h: StepHost;
  readonly #replica: TrainerReplica;
  /** the step this rank's replica is at (what a snapshot of it is labelled) */
  #at = 0;
  /** close() was called: the handlers serve() made refuse what a drain still routes to them */
  #closed = false;

  get commGeneration(): number {
    return this.#replica.generation;
  }

  constructor(host: StepHost, replica: TrainerReplica) {
    this.#h = host;
    this.#replica = replica;
  }

  get eventRank(): number | null {
    return this.#replica.eventRank;
  }
  get dataRank(): number {
    return this.#replica.dataRank;
  }
  get wireBytes(): number {
    return this.#replica.wireBytes;
  }
  get memory(): ModelMemory {
    return this.#replica.memory;
  }

  useTopology(hosts: readonly string[], places?: readonly (TrainerPlace | undefined)[]): void {
    const { log } = this.#h;
    const replica = this.#replica;
    replica.useTopology(hosts, places);
    const plan = replica.plan;
    const many = replica.hostCount > 1;
    log?.info(
      { hosts, hostCount: replica.hostCount, collective: plan?.carrier ?? "ring" },
      plan !== null
        ? `all-reduce: ${plan.text}`
        : many
          ? "all-reduce is hierarchical across hosts"
          : "all-reduce is a ring on one host",
    );
  }

  /**
   * Every rank takes the parts of a snapshot's replica on restore; rank 0 serves its replica's
   * parts to the checkpoint service (under ZeRO every rank its partition's), for the step it is at.
   */
  serve(): Subscription[] {
    const { cfg, bus, rank, payloadBytesMax } = this.#h;
    const replica = this.#replica;
    const subs = [
      bus.handle(subjects.replicaLoad(cfg.job, rank), (data) => {
        this.#refuseClosed();
        replica.staging.stage(decodeShardState(data, payloadBytesMax));
        return new Uint8Array(0);
      }),
    ];
    // the liveness watch (the checkpoint service's) names a trainer that went quiet: an NCCL
    // communicator waiting on it is aborted, so the step fails and every rank rewinds
    const peerStalled = replica.peerStalled?.bind(replica);
    if (peerStalled !== undefined)
      subs.push(
        bus.subscribe(subjects.events(cfg.job, "stalled"), (data) => {
          let text: string;
          try {
            text = decodeEvent(data, 1 << 16).text;
          } catch {
            return; // not an event: nothing to act on
          }
          const peer = stalledTrainer(text);
          if (peer !== null) peerStalled(peer, text);
        }),
      );
    const subject =
      replica.serves === "whole"
        ? subjects.replicaState(cfg.job)
        : replica.serves === "partition"
          ? subjects.replicaPartition(cfg.job, rank)
          : null;
    if (subject === null) return subs;
    subs.push(
      bus.handle(subject, (data, subject) => {
        this.#refuseClosed();
        const m = decodeJobRequest(data, 1 << 16);
        jobOfRequest(subject, m.job);
        // "cut" copies the replica of this step for the parts asked next (the rank goes on meanwhile)
        if (m.tag === cutTag || !replica.hasCut(m.step)) {
          if (m.step !== this.#at)
            throw new NotReadyError(`trainer ${rank}'s replica is at step ${this.#at}, not ${m.step}`);
          if (m.tag === cutTag) {
            const parts = replica.cut(m.step, payloadBytesMax);
            return encodeJobRequest({ job: cfg.job, step: m.step, tag: cutTag, value: parts });
          }
        }
        return replica.exportPart(m.step, partOfTag(m.tag), payloadBytesMax).then(encodeShardState);
      }),
    );
    return subs;
  }

  /**
   * The newest snapshot's step, loaded into every rank (a resumed job, or a rank that restarted
   * and lost its replica); 0 when the job has none.
   */
  async findStartStep(): Promise<number> {
    const { cfg, rank, bus } = this.#h;
    try {
      const subject = subjects.ckptRecover(cfg.job, recoverAsker.trainer(rank));
      const req = encodeJobRequest({ job: cfg.job, step: 0, tag: trainerOpenedTag(rank) });
      const m = decodeManifest(await bus.request(subject, req, checkpointTimeoutMs), 1 << 22);
      // the first ask of each rank is answered with the restore that loaded every rank (the
      // first rank's); if that loaded an earlier process of this rank, this one asks for its own
      if (this.#replica.staging.staged?.step !== m.step && !this.#h.restorePending()) {
        const again = encodeJobRequest({ job: cfg.job, step: 0, tag: trainerLacksTag(rank, m.id) });
        return decodeManifest(await bus.request(subject, again, checkpointTimeoutMs), 1 << 22).step;
      }
      return m.step; // every rank takes the restore at its next step boundary (the Restore event)
    } catch (e) {
      if (e instanceof NotReadyError) return 0; // no snapshot: a new job, every rank from the seed's initialization
      throw e;
    }
  }

  async runStep(step: number, generation: number): Promise<void> {
    const h = this.#h;
    const { cfg } = h;
    const replica = this.#replica;
    this.#at = step;
    const t0 = performance.now();
    h.hb?.at(step, "data");
    const batch = await h.batch(step);
    const t1 = performance.now();
    h.checkGeneration(step, generation);
    const snapshotMs = await h.boundary(step);
    h.checkGeneration(step, generation);
    h.hb?.at(step, "compute and collective");
    const micro = batch.rows > 0 ? microBatches(batch, cfg.accumSteps) : [];
    const wire0 = replica.wireBytes;
    const delayed = performance.now();
    const sleepMs = h.stepDelayMs;
    if (sleepMs) await Bun.sleep(sleepMs);
    const delayMs = performance.now() - delayed;
    const r = await replica.step(step, micro, batch.rows, h.rowsAt(step));
    h.checkGeneration(step, generation);
    if (cfg.replicaCheckEvery > 0 && ((step + 1) % cfg.replicaCheckEvery === 0 || step + 1 === h.total))
      await replica.checkReplicas(step);
    this.#at = step + 1;
    const t3 = performance.now();
    h.hb?.stepTook(t3 - t0);
    h.publish({
      kind: EventKind.Step,
      step,
      loss: r.loss,
      lr: r.lr,
      samplesPerS: batch.rows / ((t3 - t0) / 1000),
      dataWaitMs: t1 - t0,
      computeMs: r.computeMs + delayMs,
      commMs: r.commMs,
      exposedCommMs: r.exposedCommMs,
      pullMs: 0,
      pushMs: 0,
      count: batch.rows,
      wireBytes: replica.wireBytes - wire0,
      density: r.density,
      snapshotMs,
      ...(r.skipped ? { text: "f16 gradients overflowed: the update was skipped on every rank" } : {}),
    });
  }

  /** A collective that failed (a peer died or stalled) cannot be retried by one rank alone: every rank rewinds. */
  failure(e: unknown): StepFailure {
    return e instanceof CollectiveError && !(e instanceof CollectiveClosedError) ? "rewind" : "retry";
  }

  /** The step's collectives are failed, and it must be over before the restore rewrites the model it computes on. */
  async abandon(run: Promise<unknown>): Promise<void> {
    this.#replica.interrupt();
    await run.catch(() => {});
  }

  restoreState(to: number, generation: number): "ready" | "superseded" | "missing" {
    const staging = this.#replica.staging;
    const staged = staging.staged;
    if (staged !== null && staged.step === to && (generation === 0 || staged.generation === generation)) return "ready";
    return generation > 0 && staging.newerThan(generation) ? "superseded" : "missing";
  }

  applyRestore(to: number): number {
    const { generation } = this.#replica.apply();
    this.#at = to;
    this.#h.log?.info({ step: to, generation }, "replica restored");
    return to;
  }

  async beforeEvaluate(): Promise<void> {}

  /** ZeRO stage 3 gathers the whole model for it (every rank evaluates at this boundary); a model-parallel copy evaluates through its stages together. */
  async evaluate(step: number, batches: readonly HostBatch[]): Promise<EvalResult> {
    return this.#replica.evaluate(step, batches);
  }

  /** Without ZeRO rank 0 holds the whole state and cuts it here (no round trip for it); the checkpoint service reads the parts in the background. */
  snapshotTag(step: number): string {
    if (this.#replica.serves !== "whole") return "schedule";
    this.#replica.cut(step, this.#h.payloadBytesMax);
    return precutSaveTag;
  }

  /** A request routed here as the run ended (its subscriptions drain) is not served from the closed
   *  replica: it is answered as the subject will be once drained, by no one (loop.ts #refuseClosed). */
  #refuseClosed(): void {
    if (this.#closed)
      throw new NoRespondersError(
        `trainer ${this.#h.rank} no longer runs job ${this.#h.cfg.job} (its replica is closed)`,
      );
  }

  close(): void {
    this.#closed = true;
    this.#replica.close();
  }
}
