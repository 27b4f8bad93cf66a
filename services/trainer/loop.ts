// One trainer rank running one job: the job's life around its steps. The step itself is the
// mode's (modes.ts, chosen once when the rank opens the job):
//   parameter-server mode: next batch -> pull parameters (as the sync policy allows) ->
//     forward/backward -> clip -> push gradients, the step's time split into data wait, pull,
//     compute and push;
//   all-reduce mode (the rank's TrainerReplica, trainer-replica.ts: a whole copy over the
//     engine's DataParallel, or a model-parallel share):
//     next batch -> forward/backward with the gradient all-reduced bucket by bucket -> clip ->
//     update, the split into data wait, compute, communication and exposed communication.
// Rank 0 asks the checkpoint service for a snapshot every `checkpointEvery` steps (or
// `checkpointMinutes`) at a step boundary (under BSP no shard can move past the step until rank
// 0 pushes, so the snapshot is exactly the state after step-1; in all-reduce mode it is of the
// replicas). A rank that opens an all-reduce job (new, resumed or restarted) asks for a restore
// of the newest snapshot, which loads every rank, so all resume at one step with one
// communicator generation. A collective that fails (a peer died) rewinds every rank to the
// newest snapshot instead of retrying the step: a ring operation cannot be retried by one rank.
//
// The job's life: every rank takes the step count, the vocabulary and the parameter layout from
// the plan its spec carries (computed at submission; only the data-loader reads the data) and
// checks that the mesh runs every rank and shard the job needs. A rank that fails
// fails the whole job (its record in the KV bucket, which closes it everywhere). At the end each
// rank evaluates its share of the test split; rank 0 combines them, asks for the final snapshot
// (exported as a model file) and ends the job as done. The other ranks repeat their final
// events until the job has ended, so a restarted rank 0 still hears them.
import type { Backend } from "../../ffi/backend.ts";
import { CudaBackend } from "../../ffi/cuda/backend.ts";
import { Context } from "../../engine/context.ts";
import { autocastDType } from "../../engine/mixed.ts";
import type { HostBatch } from "../../engine/train.ts";
import { dirname } from "node:path";
import {
  type Batch,
  type DataPlan,
  decodeBatch,
  encodeBatchRequest,
  Split,
} from "../../schemas/messages/data-loader.ts";
import {
  decodeEvent,
  decodeJobRequest,
  emptyEvent,
  encodeEvent,
  encodeJobRequest,
  type Event,
  EventKind,
  JobState,
} from "../../schemas/messages/job.ts";
import { decodeManifest, type Manifest } from "../../schemas/messages/checkpoint.ts";
import { encodeTrainerStats } from "../../schemas/messages/trainer.ts";
import { type Bus, release, requestWhileAway, type Subscription } from "../runtime/mesh/bus.ts";
import { awaitMembers, type MeshMembers, type MeshNeeds, rankNeeds } from "../runtime/mesh/discovery.ts";
import { type CombinedEval, EvalTally } from "../runtime/job/evals.ts";
import { BadRequestError, DeadlineError, NoRespondersError } from "../runtime/mesh/errors.ts";
import { HeartbeatPublisher } from "../runtime/control/liveness.ts";
import { dataRanks, evaluatesAt, type JobConfig, lrAt, stepScheduleOf, usesShards } from "../runtime/job/config.ts";
import { jobOfRequest, subjects, recoverAsker, trainerFailedTag } from "../runtime/job/subjects.ts";
import type { JobControl } from "../runtime/job/ledger.ts";
import type { Logger } from "../runtime/mesh/log.ts";
import { pause } from "../runtime/mesh/pause.ts";
import type { buildModel } from "../runtime/job/model.ts";
import {
  checkpointTimeoutMs,
  scheduledSnapshotTimeoutMs,
  finalRepeatMs,
  finalSaveAttemptsMax,
  finishWaitMsMax,
  jobStartWaitMsMax,
  batchLookAhead,
  loaderCredits,
  membersWaitMsMax,
  placesRetryMs,
  reaskMs,
  batchReaskFirstMs,
  requestTimeoutMs,
  stepAttemptsMax,
  notReadyWaitMsMax,
  notReadyPauseMs,
  firstTimedSnapshotMs,
} from "./limits.ts";
import { bytesPerParam } from "../../engine/parallel/zero.ts";
import { m as metrics } from "../runtime/mesh/metrics.ts";
import type { NcclIdExchange } from "../runtime/job/nccl-id.ts";
import type { ReplicaOptions } from "./replica.ts";
import { type StepHost, type TrainerMode, trainerMode } from "./modes.ts";
import { planModel, replicaOf } from "./trainer-replica.ts";
import { toHost } from "./batches.ts";
import type { StepSchedule } from "../runtime/job/world.ts";

export interface TrainerOptions {
  bus: Bus;
  backend: Backend;
  cfg: JobConfig;
  /** the job's plan, from its spec */
  plan: DataPlan;
  rank: number;
  payloadBytesMax: number;
  log?: Logger;
  /** the job's record: failures end the job; rank 0 ends it as done (absent in unit tests) */
  control?: JobControl;
  /** the submission this run belongs to (its spec's attempt): it ends only that one */
  attempt?: number;
  /** who is on the mesh ($SRV discovery); absent: not checked */
  members?: (needs?: MeshNeeds, windowMs?: number) => Promise<MeshMembers>;
  /** all-reduce mode: collective settings over the defaults (tests shorten the timeouts) */
  collective?: Pick<ReplicaOptions, "transport" | "progressTimeoutMs">;
  /** all-reduce mode on GPUs: where NCCL communicators exchange their ids (the job store) */
  ncclIds?: NcclIdExchange;
  /** test-only (MT_STEP_DELAY_MS, MT_STEP_DELAY_FILE): how long to sleep in every step's compute,
   *  to make a straggler or to pace a job, asked at every step */
  stepDelayMs?: () => number;
  /** the machine it runs on, said in its heartbeats (MT_HOST) */
  host?: string;
}

/** The restore tag of a trainer rank that opens an all-reduce job. */

export class StaleStepError extends Error {
  override readonly name = "StaleStepError";
}

/** rank 0's answer to `ctl.checkpoint` */
const snapshotAskedReply = new TextEncoder().encode("a snapshot at the next step boundary");

/**
 * What a job's followers (watch, the dashboard) are told of a step that failed and is tried again:
 * a failure that took its time (a pull that waited out its timeout on a shard), which would
 * otherwise be in this trainer's log only (its heartbeats go on, so no stall is reported); null
 * for a quick one.
 */
export function retryNotice(rank: number, step: number, e: unknown, attempt: number): string | null {
  if (!(e instanceof DeadlineError)) return null;
  return `trainer ${rank}: step ${step} failed (${e.message.slice(0, 300)}); trying again (attempt ${attempt + 1} of ${stepAttemptsMax})`;
}

export class TrainerRun {
  readonly #o: TrainerOptions;
  readonly #ctx: Context;
  readonly #model: ReturnType<typeof buildModel>;
  /** the step's strategy of the job's mode (modes.ts): parameter server, or replica */
  readonly #mode: TrainerMode;
  /** the job's plan, from its spec */
  readonly #plan: DataPlan;
  /** each step's epoch, samples and world (services/runtime/job/world.ts) */
  readonly #steps: StepSchedule;
  readonly #lr: (step: number) => number;
  #stopped = false;
  /** aborted when the run is stopped (the job was closed), to end waits at once */
  readonly #stopSignal = new AbortController();
  /** rank 0: every rank's evaluations */
  #tally: EvalTally | null = null;
  #evalSub: Subscription | null = null;
  /** this rank's final Eval event, repeated until the job ends */
  #final: (Partial<Event> & { kind: EventKind }) | null = null;
  #restoreTo: number | null = null;
  /** all-reduce mode: the communicator generation of the load the restore announced (0: any) */
  #restoreGeneration = 0;
  /** bumped by every restore: a step begun before it must not push */
  #generation = 0;
  /** resolves when a restore arrives, so a step blocked on a dead shard is abandoned at once */
  #restored: { promise: Promise<void>; resolve: () => void } = Promise.withResolvers<void>();
  #sub: Subscription | null = null;
  /** this rank's heartbeat (services/runtime/control/liveness.ts): step and phase */
  #hb: HeartbeatPublisher | null = null;
  /** batch requests sent ahead of the step that needs them, in step order */
  #ahead: { step: number; promise: Promise<Batch> }[] = [];
  /** a snapshot was asked for (SDK `save`): rank 0 takes it at the next step boundary */
  #snapshotAsked = false;
  /** rank 0: snapshots this run took after the step it began at, and when the last one was (or the run began) */
  #snapshots = 0;
  #startStep = 0;
  #lastSnapshotMs = performance.now();
  #ctl: Subscription | null = null;
  #replicaSubs: Subscription[] = [];
  /** the run is over: its handlers refuse what their subscriptions' drain still routes to them */
  #closed = false;
  /** the step this rank is at (for its stats) */
  #at = 0;

  constructor(o: TrainerOptions) {
    this.#o = o;
    // dropout differs per rank, except among a stage's tensor ranks: they drop the same elements
    // of the activations they all hold (ranks count tensor rank fastest)
    const dropoutRank = Math.floor(o.rank / o.cfg.tensorParallel);
    this.#ctx = new Context(o.backend, { seed: o.cfg.seed * 1000 + dropoutRank, precision: o.cfg.precision });
    this.#plan = o.plan;
    this.#steps = stepScheduleOf(o.cfg, o.plan.trainSamples);
    this.#lr = (step) => lrAt(o.cfg, o.plan, step);
    // all-reduce mode: the rank's replica holds the model (a share of it where the job cuts it);
    // parameter-server mode: the whole model, its parameters pulled from the shards
    const replica = usesShards(o.cfg)
      ? null
      : replicaOf({
          bus: o.bus,
          backend: o.backend,
          cfg: o.cfg,
          rank: o.rank,
          ctx: this.#ctx,
          plan: o.plan,
          payloadBytesMax: o.payloadBytesMax,
          ...o.collective,
          ...(o.ncclIds ? { ncclIds: o.ncclIds } : {}),
          attempt: o.attempt ?? 0,
        });
    // parameter-server mode: the shards hold the starting values, and the trainer pulls them
    this.#model = replica?.model ?? planModel(this.#ctx, o.cfg, o.plan, false);
    this.#mode = trainerMode(this.#stepHost(), o.plan, replica);
  }

  /** What the mode's step needs of this run. */
  #stepHost(): StepHost {
    const o = this.#o;
    const run = this;
    return {
      cfg: o.cfg,
      rank: o.rank,
      bus: o.bus,
      backend: o.backend,
      ctx: this.#ctx,
      model: this.#model,
      payloadBytesMax: o.payloadBytesMax,
      log: o.log,
      total: this.#plan.totalSteps,
      get stepDelayMs() {
        return o.stepDelayMs?.() ?? 0;
      },
      get hb() {
        return run.#hb;
      },
      batch: (step) => this.#batch(step),
      boundary: (step) => this.#boundary(step),
      checkGeneration: (step, generation) => this.#checkGeneration(step, generation),
      publish: (e) => this.#publish(e),
      lr: this.#lr,
      rowsAt: (step) => this.#steps.at(step).rows,
      restorePending: () => this.#restoreTo !== null,
      restoreAnnounced: () => this.#restored.promise,
      generation: () => this.#generation,
    };
  }

  get #total(): number {
    return this.#plan.totalSteps;
  }

  /** Whether stop() was called (the run may still be finishing its step). */
  get stopped(): boolean {
    return this.#stopped;
  }

  /** Stops after the current step; a step blocked on a pull is abandoned at once. */
  stop(): void {
    this.#stopped = true;
    this.#generation++;
    this.#restored.resolve();
    this.#stopSignal.abort();
  }

  /**
   * Waits (a while: a restarted process takes seconds to register) until the mesh runs every
   * trainer rank, shard and service the job needs; then fails the job, naming what is missing.
   */
  async #checkMembers(): Promise<void> {
    const { members, cfg, log } = this.#o;
    if (!members) return;
    if (!(await awaitMembers(members, cfg, membersWaitMsMax, "its NATS server", this.#stopSignal.signal))) return;
    if (usesShards(cfg)) return;
    // The collective's topology and carrier: every rank reads the same announcements from service
    // discovery and must decide alike (a rank planning the ring while the others plan NCCL would
    // leave both waiting), so a reply that misses a rank (a discovery round under load) is asked again.
    const started = Date.now();
    // every rank's announcement, and no wait for other ranks' once they are in
    const ranks = rankNeeds(cfg);
    let seen = await members(ranks);
    const complete = (m: MeshMembers) =>
      Array.from({ length: cfg.trainers }, (_, r) => r).every(
        (r) => m.trainerHosts?.[r] !== undefined && m.trainerPlaces?.[r] !== undefined,
      );
    while (!complete(seen) && Date.now() - started < membersWaitMsMax && !this.#stopped) {
      await pause(placesRetryMs, this.#stopSignal.signal);
      seen = await members(ranks);
    }
    const known = seen.trainerHosts ?? {};
    const hosts = Array.from({ length: cfg.trainers }, (_, r) => known[r] ?? "");
    if (hosts.some((h) => h === "")) {
      log?.warn({ hosts }, "some ranks gave no host label; the all-reduce is the flat ring");
      return;
    }
    const places = Array.from({ length: cfg.trainers }, (_, r) => seen.trainerPlaces?.[r]);
    this.#mode.useTopology(hosts, places);
  }

  #publish(e: Partial<Event> & { kind: EventKind }): void {
    const kind = EventKind[e.kind].toLowerCase();
    if (e.kind === EventKind.Step) this.#metrics(e);
    let rank: number | null = this.#o.rank;
    // Step and Eval events are a data-parallel rank's: in a model-parallel job one rank of each
    // copy of the model speaks for it, as its copy
    if (e.kind === EventKind.Step || e.kind === EventKind.Eval) rank = this.#mode.eventRank;
    if (rank === null) return;
    this.#o.bus.publish(
      subjects.events(this.#o.cfg.job, kind),
      encodeEvent({ ...emptyEvent(this.#o.cfg.job, e.kind), rank, ...e }),
    );
  }

  /** This rank's step in its Prometheus metrics (services/runtime/mesh/metrics.ts). */
  #metrics(e: Partial<Event>): void {
    const job = this.#o.cfg.job;
    metrics.trainerStep.set({ job }, e.step ?? 0);
    metrics.trainerSteps.inc({ job });
    metrics.trainerLoss.set({ job }, e.loss ?? 0);
    metrics.trainerRate.set({ job }, e.samplesPerS ?? 0);
    const phases = {
      data_wait: e.dataWaitMs,
      pull: e.pullMs,
      compute: e.computeMs,
      push: e.pushMs,
      comm: e.commMs,
      exposed_comm: e.exposedCommMs,
    };
    for (const [phase, ms] of Object.entries(phases)) metrics.trainerPhase.set({ job, phase }, (ms ?? 0) / 1000);
    const wire = usesShards(this.#o.cfg) ? 0 : this.#mode.wireBytes;
    if (wire > this.#wireSeen) metrics.collectiveBytes.inc({ job }, wire - this.#wireSeen);
    this.#wireSeen = wire;
  }
  #wireSeen = 0;

  /** The data-loader's rank this trainer reads (its copy of the model's, in a model-parallel job). */
  get #dataRank(): number {
    return this.#mode.dataRank;
  }

  async run(): Promise<void> {
    const { cfg, log, bus, rank } = this.#o;
    this.#sub = bus.subscribe(subjects.events(cfg.job, "restore"), (data) => {
      const e = decodeEvent(data, 1 << 16);
      this.#restoreTo = e.step;
      this.#restoreGeneration = e.generation;
      this.#tally?.forgetAfter(e.step); // the steps after it are evaluated again
      this.#generation++;
      this.#restored.resolve();
      this.#restored = Promise.withResolvers<void>();
      log?.warn({ step: e.step, why: e.text }, "job restored from a checkpoint; resuming there");
    });
    this.#replicaSubs.push(...this.#mode.serve());
    this.#replicaSubs.push(
      bus.handle(subjects.trainerStats(cfg.job, rank), (data, subject) => this.#stats(data, subject)),
    );
    this.#hb = new HeartbeatPublisher(bus, cfg.job, `trainer ${rank}`, this.#o.host ?? "");
    if (rank === 0) {
      // a request (or a publish: no answer then): a snapshot at the next step boundary; every
      // request is answered, a malformed one with its error
      this.#ctl = bus.handle(subjects.checkpointNow(cfg.job), async (data) => {
        if (data.byteLength !== 0)
          throw new BadRequestError(`a snapshot request has an empty body, not ${data.byteLength} bytes`);
        this.#refuseClosed();
        this.#snapshotAsked = true;
        return snapshotAskedReply;
      });
      this.#tally = new EvalTally(dataRanks(cfg));
      this.#evalSub = bus.subscribe(subjects.events(cfg.job, "eval"), (data) => this.#onEval(data));
    }
    try {
      await this.#checkMembers();
      let step = await this.#retry(
        "find the start step (every shard must have opened the job)",
        () => this.#mode.findStartStep(),
        jobStartWaitMsMax,
      );
      this.#startStep = step;
      // autocast hands attention 2-byte q, k and v; else f32
      const attention = this.#o.backend.describeAttention(autocastDType(cfg.precision) ?? "f32");
      // on a GPU: whether cuBLASLt fuses the linear layers' bias, GELU and their gradients
      const be = this.#o.backend;
      const linear = be instanceof CudaBackend ? be.describeEpilogues() : undefined;
      log?.info(
        { step, totalSteps: this.#total, precision: cfg.precision, attention, ...(linear ? { linear } : {}) },
        `training; attention: ${attention}${linear ? `; linear layers: ${linear}` : ""}`,
      );
      const m = this.#mode.memory;
      if (m !== null) {
        const mb = (b: number) => Math.round(b / 1e4) / 100;
        log?.info(
          {
            zero: m.stage,
            paramsMb: mb(m.params),
            gradsMb: mb(m.grads),
            optimizerMb: mb(m.optimizer),
            bucketsMb: mb(m.buckets),
            bytesPerParam: bytesPerParam(m),
          },
          `model state on this rank: ${bytesPerParam(m).toFixed(2)} bytes per parameter (ZeRO stage ${m.stage}, ${cfg.trainers} ranks)` +
            (m.host > 0
              ? `; the optimizer is offloaded: ${(m.host / m.paramCount).toFixed(2)} bytes per parameter in host memory`
              : "") +
            (m.stage === 3
              ? "; parameters are gathered per bucket as the passes need them (the peak is in status)"
              : ""),
        );
      }
      for (;;) {
        while (step < this.#total && !this.#stopped) {
          this.#at = step;
          step = await this.#step(step);
        }
        this.#at = step;
        if (this.#stopped) return;
        // a restore during the end (the final evaluation, the final snapshot) takes every rank
        // back to the restored step, to train the last steps again
        const back = await this.#end();
        if (back === null) return;
        step = back;
      }
    } catch (e) {
      if (this.#stopped) return; // the job was closed (ended or cancelled) under us: not a failure
      const why = `trainer ${rank}: ${(e as Error).message}`;
      log?.error({ err: (e as Error).message }, "training failed");
      this.#publish({ kind: EventKind.Failed, text: why });
      await this.#o.control
        ?.end(cfg.job, { state: JobState.Failed, reason: why }, this.#o.attempt)
        .catch((err: unknown) => {
          log?.error({ err: (err as Error).message }, "cannot record the job's failure");
        });
      throw e;
    } finally {
      this.#hb?.stop();
      // drained: a request the server routed here before the unsubscribe is answered (refused),
      // not left to its sender's timeout (a `save` asked as the job ended waited 10 s for nothing)
      this.#closed = true;
      for (const s of [this.#sub, this.#ctl, this.#evalSub, ...this.#replicaSubs]) release(s);
      this.#mode.close();
      this.#ctx.dispose();
    }
  }

  /**
   * A request that the drain of the run's subscriptions still routes here is answered as the
   * subject will be a moment later, by no one: a resize counts the rank closed, a restore's load
   * waits for the rank's next run as for a process away, and the sender learns at once.
   */
  #refuseClosed(): void {
    if (this.#closed)
      throw new NoRespondersError(
        `trainer ${this.#o.rank} no longer runs job ${this.#o.cfg.job} (the job ended, or this trainer is stopping)`,
      );
  }

  /** `mt.<job>.trainer.<rank>.stats`: the step, and what this rank holds for the model, read from its allocations. */
  #stats(data: Uint8Array, subject: string): Uint8Array {
    this.#refuseClosed();
    const { cfg, rank } = this.#o;
    const m = decodeJobRequest(data, 1 << 16);
    jobOfRequest(subject, m.job);
    const store = this.#model.store;
    const mem = this.#mode.memory ?? undefined;
    return encodeTrainerStats({
      job: cfg.job,
      rank,
      step: this.#at,
      zeroStage: mem?.stage ?? 0,
      ranks: mem?.ranks ?? cfg.trainers,
      paramCount: store.paramCount,
      paramBytes: mem?.params ?? store.values.bytes,
      gradBytes: mem?.grads ?? (store.holdsGradSlab ? store.grads.bytes : 0),
      optimizerBytes: mem?.optimizer ?? 0,
      bucketBytes: mem?.buckets ?? 0,
      arenaPeakBytes: mem?.arenaPeak ?? this.#ctx.arena.highWaterBytes,
      wireBytes: this.#mode.wireBytes,
      hostBytes: mem?.host ?? 0,
      gatheredPeakBytes: mem?.gatheredPeak ?? 0,
    });
  }

  /** Rank 0: tallies every rank's evaluations; a step all ranks reported goes into the job's record. */
  #onEval(data: Uint8Array): void {
    let e: Event;
    try {
      e = decodeEvent(data, 1 << 16);
    } catch {
      return; // not an event of ours; the publishers validate theirs
    }
    const done = this.#tally?.add(e);
    if (done) {
      void this.#o.control?.noteEval(this.#o.cfg.job, done).catch((err: unknown) => {
        this.#o.log?.warn({ err: (err as Error).message }, "cannot record an evaluation in the job's record");
      });
    }
  }

  /**
   * Rank 0, after its own final evaluation: waits for every rank's, asks for the final snapshot
   * (which the checkpoint service exports as a model file), and ends the job as done.
   */
  async #finish(): Promise<void> {
    const { cfg, bus, log, control } = this.#o;
    const final = await this.#finalEval();
    if (final === null) return; // stopped, or restored
    let snap: Manifest | null = null,
      note = "";
    for (let attempt = 1; attempt <= finalSaveAttemptsMax && !this.#stopped && this.#restoreTo === null; attempt++) {
      try {
        const req = encodeJobRequest({ job: cfg.job, step: this.#total, tag: "final" });
        snap = decodeManifest(await bus.request(subjects.ckptSave(cfg.job), req, checkpointTimeoutMs), 1 << 22);
        break;
      } catch (e) {
        note = (e as Error).message;
        log?.warn({ attempt, err: note }, "final snapshot failed");
        await pause(1000 * attempt, this.#stopSignal.signal);
      }
    }
    // the job was closed meanwhile (cancelled): it is not this run's to end. Restored (the
    // checkpoint service serves a save and a restore one after the other: a save that was
    // answered came first): the ranks train the last steps again and end it then
    if (this.#stopped || this.#restoreTo !== null) return;
    await control?.end(
      cfg.job,
      {
        state: JobState.Done,
        evalStep: final.step,
        accuracy: final.accuracy,
        loss: final.loss,
        evaluated: final.evaluated,
        evalSplit: final.split,
        snapshot: snap?.id ?? "",
        modelPath: snap?.modelPath ?? "",
        ...(snap?.modelPath ? { snapshotDir: dirname(snap.modelPath) } : {}),
        reason: snap
          ? ""
          : `trained, but the final snapshot failed (${note}); the parameters stay on the shards only until the job closes`,
      },
      this.#o.attempt,
    );
  }

  /** Every rank's evaluation of the final step, combined; null when stopped or restored first. */
  async #finalEval(): Promise<CombinedEval | null> {
    const started = Date.now();
    for (;;) {
      const r = this.#tally!.combined(this.#total);
      if (r !== null && r.ranks === dataRanks(this.#o.cfg)) return r;
      if (this.#stopped || this.#restoreTo !== null) return null;
      if (Date.now() - started > finishWaitMsMax) {
        throw new Error(
          `ranks ${r === null ? "all but this one" : `${r.ranks} of ${dataRanks(this.#o.cfg)}`} reported their final evaluation within ${finishWaitMsMax} ms`,
        );
      }
      await pause(100, this.#stopSignal.signal);
    }
  }

  /**
   * The job's end on this rank: the final evaluation, Done, and on rank 0 the final snapshot and
   * the job's record (other ranks repeat their final events until the job ends). Returns the
   * step to train from when a restore came meanwhile, else null (the job is over for this rank).
   */
  async #end(): Promise<number | null> {
    for (let attempt = 1; ; attempt++) {
      if (this.#restoreTo !== null) return this.#takeRestore();
      const evaluated = this.#evaluate(this.#total).then(() => "done" as const);
      evaluated.catch(() => {}); // a restore fails its pull or collectives: expected
      try {
        if ((await Promise.race([evaluated, this.#restored.promise.then(() => "restored" as const)])) === "done") break;
        await this.#mode.abandon(evaluated);
        await evaluated.catch(() => {});
        return this.#takeRestore();
      } catch (e) {
        // a restored shard refuses the final pull before the restore's event arrives: wait for
        // it, as a step does (and a shard that is not ready yet is waited for the same way)
        if (this.#stopped) return null;
        if (attempt >= stepAttemptsMax) throw e;
        this.#o.log?.warn({ attempt, err: (e as Error).message }, "final evaluation failed; retrying");
        await pause(Math.min(200 * attempt, 2000), this.#stopSignal.signal);
      }
    }
    if (this.#restoreTo !== null) return this.#takeRestore();
    this.#publish({ kind: EventKind.Done, step: this.#total });
    if (this.#o.rank === 0) await this.#finish();
    else await this.#repeatFinal();
    return this.#restoreTo !== null && !this.#stopped ? this.#takeRestore() : null;
  }

  /**
   * The restore announced (its step); all-reduce mode takes the replica it staged. When the next
   * restore's parts have come already (an operator's and a recovery's back to back), this one's
   * load may be gone: the rank waits for that restore's event and takes it instead.
   */
  async #takeRestore(): Promise<number> {
    for (;;) {
      const to = this.#restoreTo!;
      const generation = this.#restoreGeneration;
      this.#restoreTo = null;
      const state = this.#mode.restoreState(to, generation);
      if (state === "ready") return this.#mode.applyRestore(to);
      if (state === "superseded") {
        this.#o.log?.warn(
          { step: to, generation },
          "the next restore's load came before this one was taken; waiting for its event",
        );
        if (this.#restoreTo === null) {
          const wake = new AbortController();
          void this.#restored.promise.then(() => wake.abort());
          await pause(checkpointTimeoutMs, AbortSignal.any([this.#stopSignal.signal, wake.signal]));
        }
        if (this.#stopped) return to;
        if (this.#restoreTo !== null) continue;
      }
      throw new Error(`a restore to step ${to} was announced, but this rank holds no complete replica of it`);
    }
  }

  /** Ranks > 0: repeat the final events until the job ends (rank 0 may have restarted and missed them) or is restored. */
  async #repeatFinal(): Promise<void> {
    const started = Date.now();
    while (!this.#stopped && this.#restoreTo === null && Date.now() - started < finishWaitMsMax) {
      await pause(finalRepeatMs, this.#stopSignal.signal);
      if (this.#stopped || this.#restoreTo !== null || this.#final === null) return;
      this.#publish(this.#final);
      this.#publish({ kind: EventKind.Done, step: this.#total });
    }
  }

  /** Runs a step (retrying it on failures); returns the next step to run. */
  async #step(step: number): Promise<number> {
    let waitingSinceMs: number | null = null;
    for (let attempt = 1; ; attempt++) {
      if (this.#stopped) return step;
      if (this.#restoreTo !== null) return this.#takeRestore();
      try {
        const run = this.#mode.runStep(step, this.#generation).then(() => "done" as const);
        run.catch(() => {}); // once abandoned by a restore, its failure (StaleStepError) is expected
        const outcome = await Promise.race([run, this.#restored.promise.then(() => "restored" as const)]);
        if (outcome === "restored") {
          // parameter-server mode: the abandoned step's push is refused by its generation check.
          // All-reduce mode: its collectives are failed, and it must be over before the restore
          // rewrites the model it computes on
          await this.#mode.abandon(run);
          continue;
        }
        return step + 1;
      } catch (e) {
        if (this.#stopped) return step;
        const failure = this.#mode.failure(e);
        if (failure === "rewind" && this.#restoreTo === null) {
          await this.#rewind(step, e as Error);
          continue;
        }
        // a shard waiting for its restore (or opening the job) answers NotReady: wait for it, not
        // counting attempts, for up to notReadyWaitMsMax
        if (failure === "wait") {
          waitingSinceMs ??= Date.now();
          if (Date.now() - waitingSinceMs < notReadyWaitMsMax) {
            attempt--;
            await Bun.sleep(notReadyPauseMs);
            continue;
          }
        }
        if (attempt >= stepAttemptsMax) throw e;
        this.#o.log?.warn({ step, attempt, err: (e as Error).message }, "step failed; retrying");
        const notice = retryNotice(this.#o.rank, step, e, attempt);
        if (notice !== null) this.#publish({ kind: EventKind.Log, step, text: notice });
        await Bun.sleep(Math.min(200 * attempt, 2000));
      }
    }
  }

  /**
   * All-reduce mode, after a collective failed (a peer died or stalled): every rank is rewound to
   * the newest snapshot (its Restore event sets #restoreTo). Without a snapshot the job fails.
   */
  async #rewind(step: number, cause: Error): Promise<void> {
    const { cfg, bus, rank, log } = this.#o;
    log?.warn({ step, err: cause.message }, "a collective failed; rewinding every rank to the newest snapshot");
    try {
      // the value is the communicator generation that failed: a restore already past it (another
      // rank asked first) answers without restoring again
      const req = encodeJobRequest({
        job: cfg.job,
        step,
        tag: trainerFailedTag(rank, step),
        value: this.#mode.commGeneration,
      });
      // asked again while this rank is away (its host cut off, its connection coming back)
      await requestWhileAway(
        bus,
        subjects.ckptRecover(cfg.job, recoverAsker.trainer(rank)),
        req,
        checkpointTimeoutMs,
        () => this.#restoreTo !== null || this.#stopped,
      );
    } catch (e) {
      if (this.#restoreTo !== null) return; // another rank's restore came meanwhile
      throw new Error(`${cause.message}; and the ranks cannot rewind to a snapshot: ${(e as Error).message}`, {
        cause,
      });
    }
  }

  /** Retries until it succeeds, the run stops, or `waitMsMax` has passed. */
  async #retry<T>(what: string, fn: () => Promise<T>, waitMsMax: number): Promise<T> {
    const started = Date.now();
    for (let attempt = 1; ; attempt++) {
      try {
        return await fn();
      } catch (e) {
        if (Date.now() - started > waitMsMax || this.#stopped)
          throw new Error(`cannot ${what} within ${waitMsMax} ms: ${(e as Error).message}`, { cause: e });
        await Bun.sleep(Math.min(100 * attempt, 2000));
      }
    }
  }

  /** Rank 0: whether checkpointMinutes have passed since the last snapshot (the first: a minute
   *  at most, so that a fault early in a run does not send it back to its start). */
  #snapshotDue(): boolean {
    const minutes = this.#o.cfg.checkpointMinutes;
    if (!(minutes > 0)) return false;
    const intervalMs = this.#snapshots === 0 ? Math.min(firstTimedSnapshotMs, minutes * 60_000) : minutes * 60_000;
    return performance.now() - this.#lastSnapshotMs >= intervalMs;
  }

  /**
   * What runs at a step boundary, before the step computes: the scheduled evaluation, and on
   * rank 0 a snapshot (scheduled or asked for) of the state after step-1.
   */
  async #boundary(step: number): Promise<number> {
    const { cfg, rank } = this.#o;
    if (evaluatesAt(cfg, this.#steps, step)) await this.#evaluate(step);
    const scheduled = cfg.checkpointEvery > 0 && step % cfg.checkpointEvery === 0;
    if (rank === 0 && (scheduled || this.#snapshotAsked || this.#snapshotDue())) {
      this.#snapshotAsked = false;
      const t0 = performance.now();
      await this.#checkpoint(step);
      // (a snapshot of the step the run began at saves no work: the first timed one still comes early)
      if (step > this.#startStep) this.#snapshots++;
      this.#lastSnapshotMs = performance.now();
      return performance.now() - t0;
    }
    return 0;
  }

  /**
   * The batch of `step`. The requests for the next `batchLookAhead` steps go out at once, so
   * their transfers overlap this step's compute (the loader has them prefetched; only the
   * transfer is left), and a reply that a busy machine delays does not stall the next step.
   */
  async #batch(step: number): Promise<Batch> {
    const { cfg, rank, bus } = this.#o;
    const fetch = (s: number) => {
      const req = encodeBatchRequest({
        job: cfg.job,
        rank: this.#dataRank,
        split: Split.Train,
        credits: loaderCredits,
        step: s,
      });
      const promise = bus
        .request(subjects.dataNext(cfg.job), req, requestTimeoutMs, { reaskMs, reaskFirstMs: batchReaskFirstMs })
        .then((r) => decodeBatch(r, this.#o.payloadBytesMax));
      promise.catch(() => {}); // a failed look-ahead is retried as the step's own request
      return { step: s, promise };
    };
    // look-aheads for other steps are stale (a restore moved the step)
    if (this.#ahead[0]?.step !== step) this.#ahead = [];
    const ahead = this.#ahead.shift() ?? null;
    for (let s = (this.#ahead.at(-1)?.step ?? step) + 1; this.#ahead.length < batchLookAhead && s < this.#total; s++)
      this.#ahead.push(fetch(s));
    try {
      return await (ahead ?? fetch(step)).promise;
    } catch (e) {
      if (!ahead) throw e;
      return await fetch(step).promise;
    }
  }

  /** A step abandoned by a restore stops at its next check instead of touching the model. */
  #checkGeneration(step: number, generation: number): void {
    if (generation !== this.#generation) throw new StaleStepError(`step ${step} began before a restore; abandoned`);
  }

  async #checkpoint(step: number): Promise<void> {
    this.#hb?.at(step, "checkpoint");
    const { cfg, bus, log } = this.#o;
    // training goes on: a missed snapshot costs recovery time, not correctness
    const failed = (e: unknown) => log?.warn({ step, err: (e as Error).message }, "checkpoint failed");
    try {
      const tag = this.#mode.snapshotTag(step);
      await bus.request(
        subjects.ckptSave(cfg.job),
        encodeJobRequest({ job: cfg.job, step, tag }),
        scheduledSnapshotTimeoutMs,
      );
    } catch (e) {
      failed(e);
    }
  }

  /** Evaluates the current parameters on this rank's share of the held-out split. */
  async #evaluate(step: number): Promise<void> {
    this.#hb?.at(step, "eval");
    const { cfg, bus } = this.#o;
    await this.#mode.beforeEvaluate(step);
    // the validation split during training; at the end the test split, where the data set has one
    const split =
      this.#plan.valSamples > 0 && (step < this.#total || this.#plan.testSamples === 0) ? Split.Val : Split.Test;
    const batches: HostBatch[] = [];
    for (let i = 0; ; i++) {
      const req = encodeBatchRequest({ job: cfg.job, rank: this.#dataRank, split, credits: 0, step: i });
      const b = decodeBatch(
        await bus.request(subjects.dataNext(cfg.job), req, requestTimeoutMs, {
          reaskMs,
          reaskFirstMs: batchReaskFirstMs,
        }),
        this.#o.payloadBytesMax,
      );
      if (b.endOfEpoch) break;
      batches.push(toHost(b));
    }
    // ZeRO stage 3 gathers the whole model; a model-parallel copy evaluates through its stages
    const r = await this.#mode.evaluate(step, batches);
    const e = {
      kind: EventKind.Eval,
      step,
      loss: r.loss,
      accuracy: r.accuracy,
      count: r.count,
      text: Split[split].toLowerCase(),
    };
    if (step >= this.#total) this.#final = e;
    this.#publish(e);
  }
}
