// The checkpoint service: `mt.<job>.ckpt.save|list|restore`.
//   save:    reads every shard's state (`ps.<k>.state`), writes them with the job's config, step,
//            loader cursors and latest evaluation metric as one snapshot, then applies retention.
//            The final save of a job (tag "final") also exports the parameters as a model file,
//            <dir>/<job>/model.mtm, that `meshtrain eval` reads.
//   list:    the job's snapshots; also of a job that has ended (they stay on disk).
//   restore: the newest snapshot that verifies (or the one named), loaded into every shard
//            (`ps.<k>.load`); then a Restore event tells the trainers where to resume.
// All-reduce jobs have no shards: a snapshot holds trainer rank 0's replica, read in parts
// (`replica.state`, files replica-<p>.mtss), and a restore loads every part into every trainer
// rank (`replica.<r>.load`) under a new communicator generation before the Restore event.
// What a snapshot's files are, how they are fetched and verified, and how they are cut again
// for the job's shards or ranks: snapshot-parts.ts.
// A job opened under a name whose snapshots were taken with other settings is refused (it would
// overwrite them, and resuming from them would be wrong): the job fails with the differences.
import { mkdirSync } from "node:fs";
import {
  decodeJobRequest,
  type JobRequest,
  encodeEvent,
  encodeJobRequest,
  emptyEvent,
  EventKind,
  JobState,
  decodeEvent,
  type JobSpec,
} from "../../schemas/messages/job.ts";
import { decodeShardState, decodeShardStats, encodeShardState } from "../../schemas/messages/parameter-server.ts";
import { encodeCheckpointList, encodeManifest, type Manifest } from "../../schemas/messages/checkpoint.ts";
import { type DataPlan } from "../../schemas/messages/data-loader.ts";
import { join } from "node:path";
import { type Bus, type RequestOptions, requestWhileAway, type Subscription } from "../runtime/mesh/bus.ts";
import {
  BadRequestError,
  CorruptDataError,
  JobStateError,
  NotReadyError,
  UnknownJobError,
} from "../runtime/mesh/errors.ts";
import { ConfigError } from "../../ffi/errors.ts";
import { EvalTally } from "../runtime/job/evals.ts";
import {
  configOfSpec,
  dataRanks,
  partitionRanks,
  type JobConfig,
  jobConfigFromJson,
  usesShards,
} from "../runtime/job/config.ts";
import {
  anyJob,
  jobIdPattern,
  jobOfRequest,
  recoverAskerOf,
  shardOfOpenedTag,
  shardOpenedTag,
  trainerOfFailedTag,
  trainerOfLacksTag,
  trainerOfOpenedTag,
  subjects,
} from "../runtime/job/subjects.ts";
import { trajectoryDiff } from "../runtime/job/resume.ts";
import { worldResumeProblem } from "../runtime/job/world.ts";
import { boundText, type JobControl } from "../runtime/job/ledger.ts";
import type { Logger } from "../runtime/mesh/log.ts";
import { exportModelFile } from "../runtime/job/model.ts";
import { cutTag, precutSaveTag } from "../runtime/job/replica-parts.ts";
import { planLayout, planOfSpec } from "../runtime/job/plan.ts";
import {
  cutReaskFirstMs,
  cutReaskMs,
  resizeCloseWaitMs,
  resizePlanTimeoutMs,
  resizeSnapshotWaitMs,
  stateTimeoutMs,
} from "./limits.ts";
import { type AskState, assemble, fetchParts, replicaOfSnapshot, reshard } from "./snapshot-parts.ts";
import { CheckpointStore, isSnapshotId, modelFileName, snapshotId, UnusableSnapshotsError } from "./store.ts";
import { JobWatch } from "../runtime/control/watch.ts";
import type { LostHost } from "../runtime/control/liveness.ts";
import { type LeftBehind, resizeJob, shrinkWithout } from "../runtime/control/resize.ts";

/** How a cut is asked: again while unanswered (limits.ts cutReaskFirstMs). */
const cutReask: RequestOptions = { reaskMs: cutReaskMs, reaskFirstMs: cutReaskFirstMs };

interface JobEntry {
  cfg: JobConfig;
  /** the plan its spec carries (a GPT's vocabulary, for the model file) */
  plan: DataPlan;
  /** evaluation results by step, combined over ranks */
  evals: EvalTally;
  sub: Subscription;
  /** one save or restore at a time per job */
  busy: Promise<unknown>;
  /** all-reduce mode: the communicator generation of the last restore */
  generation: number;
  /**
   * all-reduce mode: the last restore's manifest, and the ranks that opened the job since (a
   * rank's first ask is answered with it: one restore loaded every rank; a rank that asks again
   * is a restarted process, whose replica is gone, and gets a new restore for every rank)
   */
  lastRestore: { manifest: Manifest; opened: Set<number> } | null;
  /** trainer ranks answered with the last restore when they opened the job: each may ask once
   *  more (trainerLacksTag) when it holds none of it */
  mayRestoreAgain: Set<number>;
  /**
   * The job had no snapshot when it was opened (a new job), and the trainer ranks and shards
   * that have asked since ("trainer 1", "shard 0"). A first ask in a new job starts the asker
   * from the seed, even when rank 0 has meanwhile snapshotted step 0 (no rank passes step 0
   * without every rank and shard): restoring then would rewind the others for nothing. A second
   * ask is a restarted process, and restores.
   */
  fresh: boolean;
  firstAsks: Set<string>;
  /** the shards and ranks that have asked for their restore since the job opened here */
  asked: Set<string>;
  /** the control plane's watch: ranks that go quiet (Stalled) or fall behind (Straggler) */
  watch: JobWatch;
  /** the submission of the job this entry runs (its spec's attempt) */
  attempt: number;
  /** snapshots answered but still being written, by step, and the chain of their writes (one at a time) */
  staged: Map<number, Manifest>;
  writing: Promise<void>;
  /** a resize was asked and is under way */
  resizeAsked: boolean;
  /** the resize has paused the job: saves are refused (the ranks that ask are about to stop) */
  resizing: boolean;
  /** aborted when the job goes on without a lost host: the snapshot being taken gives up its
   *  requests at once (the lost ranks' parts will not come) */
  saves: AbortController;
}

export class CheckpointService {
  readonly #jobs = new Map<string, JobEntry>();

  constructor(
    readonly bus: Bus,
    readonly store: CheckpointStore,
    readonly log: Logger | undefined,
    readonly payloadBytesMax: number,
    readonly control?: JobControl,
    /** write every snapshot before answering the save (the ranks wait for the disk); else in the background */
    readonly syncSnapshots = false,
    /** test-only: a pause before each background write (a slow disk) */
    readonly writeDelayMs = 0,
  ) {}

  serve(): void {
    const on = (
      name: string,
      handler: (e: JobEntry, m: JobRequest, subject: string) => Promise<Uint8Array> | Uint8Array,
      subject = anyJob(`ckpt.${name}`),
    ) =>
      this.bus.serve({
        name,
        subject,
        handler: (data, subject) => {
          const m = decodeJobRequest(data, this.payloadBytesMax);
          const job = jobOfRequest(subject, m.job);
          const e = this.#jobs.get(job);
          if (!e) throw new UnknownJobError(`the checkpoint service runs no job "${job}" (it is not running)`);
          return handler(e, m, subject);
        },
      });
    on("save", (e, m) => this.#serial(e, () => this.#save(e, m.step, m.tag)));
    // an operator's: the newest good snapshot (no tag) or the one its id names; any other tag is
    // refused (it restored the newest one: a typo in an id rewound a running job)
    on("restore", (e, m) => {
      if (m.tag !== "" && !isSnapshotId(m.tag))
        throw new BadRequestError(
          `${JSON.stringify(m.tag.length > 64 ? `${m.tag.slice(0, 63)}…` : m.tag)} is not a snapshot id: one is step- and 9 digits, as \`meshtrain checkpoints ${e.cfg.job}\` lists them (none: the newest that verifies)`,
        );
      return this.#serial(e, () => this.#restore(e, m.tag));
    });
    // the services' own asks (a shard or rank that opened the job, or lost its state): the newest
    // good snapshot only; rewinding to a chosen one is an operator's restore (admin's permission)
    on(
      "recover",
      (e, m, subject) => {
        const asker = this.#recoverAsker(e, subject, m.tag);
        return this.#serial(e, () => this.#recover(e, asker, m.tag, m.value ?? 0));
      },
      anyJob("ckpt.recover.*"),
    );
    on("resize", (e, m) => this.#resize(e, m.tag));
    // list answers for ended jobs too: their snapshots stay on disk
    this.bus.serve({
      name: "list",
      subject: anyJob("ckpt.list"),
      handler: (data, subject) => {
        const job = jobOfRequest(subject, decodeJobRequest(data, this.payloadBytesMax).job);
        const items = jobIdPattern.test(job) ? this.store.list(job) : [];
        if (items.length === 0 && !this.#jobs.has(job)) {
          throw new UnknownJobError(
            `no job "${job}" here: it is not running and has no snapshots in ${this.store.root}`,
          );
        }
        return encodeCheckpointList({ job, items });
      },
    });
  }

  #serial<T>(e: JobEntry, fn: () => Promise<T>): Promise<T> {
    const next = e.busy.then(fn, fn);
    e.busy = next.catch(() => undefined);
    return next;
  }

  /**
   * A snapshot of the job at `asked`. A save that trainer rank 0 asks at a step boundary (tag
   * "schedule") waits only for the state to be cut (copied where it lives: the shards, or the
   * replica or partitions); the parts are fetched, checked and written in the background while
   * training goes on, one snapshot at a time, and the Checkpoint event says when it is on disk.
   * Any other save (the final one, one asked directly, or all with syncSnapshots) answers once
   * it is written.
   */
  async #save(e: JobEntry, asked: number, why: string): Promise<Uint8Array> {
    const { cfg, plan } = e;
    const t0 = performance.now();
    if (e.resizing)
      throw new NotReadyError(
        `job ${cfg.job} is being resized: its ranks stop now, and resume from the snapshot taken for it`,
      );
    if (!Number.isSafeInteger(asked) || asked < 0 || asked > plan.totalSteps)
      throw new BadRequestError(`a save for step ${asked}: job ${cfg.job} runs steps 0 to ${plan.totalSteps}`);
    // one snapshot in memory at a time: a save waits for the write before it (which a save
    // interval longer than a write never does)
    if (e.staged.size > 0) await e.writing;
    const scheduled = why === "schedule" || why === precutSaveTag;
    if (!scheduled || this.syncSnapshots) return await this.#fetchAndWrite(e, asked, why, t0, 0);
    // (a replica trainer rank 0 cut before it asked: nothing to cut)
    const step = why === precutSaveTag && !usesShards(cfg) && cfg.zero === 0 ? asked : await this.#cut(e, asked);
    const existing = e.staged.get(step) ?? this.#goodSnapshot(cfg.job, step);
    if (existing !== null) return encodeManifest(existing);
    const stagedMs = performance.now() - t0;
    // what the answer says: the snapshot being written (its files are listed once they are)
    const staged: Manifest = {
      job: cfg.job,
      id: snapshotId(step),
      step,
      formatVersion: 0,
      createdMs: Date.now(),
      metric: Number.NaN,
      configJson: JSON.stringify(cfg),
      cursors: Array(dataRanks(cfg)).fill(step),
      modelPath: "",
      files: [],
    };
    e.staged.set(step, staged);
    e.writing = e.writing.then(async () => {
      await Bun.sleep(this.writeDelayMs); // after the answer goes out
      try {
        await this.#fetchAndWrite(e, asked, why, performance.now(), stagedMs);
      } catch (err) {
        this.log?.error(
          { job: cfg.job, id: staged.id, err: (err as Error).message },
          "snapshot not written; the ones before it stay",
        );
        this.#event(
          cfg.job,
          EventKind.Log,
          step,
          `snapshot ${staged.id} could not be written (${(err as Error).message}); the ones before it stay`,
        );
      } finally {
        e.staged.delete(step);
      }
    });
    return encodeManifest(staged);
  }

  /**
   * Cuts the job's state for a snapshot of `asked` where it lives, and answers the state's step
   * (the one asked, except under ASP and SSP: the step every trainer had pushed).
   */
  async #cut(e: JobEntry, asked: number): Promise<number> {
    const { cfg, plan } = e;
    const req = encodeJobRequest({ job: cfg.job, step: asked, tag: cutTag });
    if (!usesShards(cfg)) {
      const ranks = partitionRanks(cfg);
      const sources =
        ranks > 0
          ? Array.from({ length: ranks }, (_, r) => subjects.replicaPartition(cfg.job, r))
          : [subjects.replicaState(cfg.job)];
      await Promise.all(sources.map((subject) => this.#askState(cfg, subject, req, cutReask)));
      return asked;
    }
    const owners = planLayout(cfg, plan).byShard.map((ids) => ids.length > 0);
    const heads = await Promise.all(
      Array.from({ length: cfg.shards }, async (_, k) => {
        const cut = await this.#askState(cfg, subjects.psState(cfg.job, k), req, cutReask);
        const h = decodeShardState(cut, this.payloadBytesMax);
        if (h.job !== cfg.job || h.shard !== k)
          throw new BadRequestError(`shard ${k} answered the cut of job ${h.job}'s shard ${h.shard}`);
        return h;
      }),
    );
    const holding = heads.filter((_, k) => owners[k]);
    const step = holding.length === 0 ? asked : Math.min(...holding.map((h) => h.step));
    const off = holding.find((h) => h.step !== asked);
    if (cfg.sync === "bsp" && off !== undefined)
      throw new BadRequestError(`a save for step ${asked}, but the state is at step ${off.step}`);
    return step;
  }

  /** Fetches the state's parts (from the cut, or cutting it now), checks them and writes the snapshot. */
  async #fetchAndWrite(e: JobEntry, asked: number, why: string, t0: number, stagedMs: number): Promise<Uint8Array> {
    const { cfg, plan } = e;
    const ask: AskState = (subject, req) => this.#askState(cfg, subject, req);
    const states = await fetchParts(cfg, asked, ask, this.payloadBytesMax);
    // the snapshot's step is the state's, never the request's: under ASP and SSP the step every
    // trainer had pushed; otherwise it must be the step asked for
    // (a shard that owns no chunks gets no pushes, and its clocks say nothing)
    const holding = states.filter((s) => s.state.chunks.length > 0);
    const step = holding.length === 0 ? asked : Math.min(...holding.map((s) => s.state.step));
    const loose = usesShards(cfg) && cfg.sync !== "bsp";
    const off = holding.find((s) => s.state.step !== asked);
    if (!loose && off !== undefined)
      throw new BadRequestError(`a save for step ${asked}, but the state is at step ${off.state.step}`);
    // a step's snapshot is written once: a save of a step already saved (a retried request, or
    // a run going over that step again after a restore) answers with it
    const existing = (stagedMs > 0 ? null : e.staged.get(step)) ?? this.#goodSnapshot(cfg.job, step);
    if (existing !== null) {
      this.log?.info({ job: cfg.job, id: existing.id, why }, "snapshot of this step exists; kept");
      return encodeManifest(existing);
    }
    // the final snapshot's parameters as a model file, written (durably) before the snapshot
    // that names it; the final snapshot is on disk before the answer (the job ends with it)
    let modelPath = "";
    if (why === "final") {
      modelPath = join(this.store.jobDir(cfg.job), modelFileName);
      // a job that never took a snapshot before its final one has no folder yet
      mkdirSync(this.store.jobDir(cfg.job), { recursive: true });
      // under ZeRO the ranks' partitions, assembled into the replica's chunks
      const replica =
        partitionRanks(cfg) > 0 && !usesShards(cfg)
          ? assemble(
              cfg,
              plan,
              partitionRanks(cfg),
              states.map((s) => s.state),
              this.payloadBytesMax,
            )
          : states.map((s) => s.state);
      exportModelFile(cfg, plan, replica, modelPath, step);
    }
    const files = states.map(({ name, bytes }) => ({ name, bytes }));
    const manifest = this.store.prepare(
      {
        job: cfg.job,
        step,
        metric: this.#metricAt(e, step),
        configJson: JSON.stringify(cfg),
        cursors: Array(dataRanks(cfg)).fill(step),
        modelPath,
      },
      files,
    );
    // (the ranks that asked for it at a step boundary went on meanwhile: stagedMs is what they waited)
    const w0 = performance.now();
    this.store.write(manifest, files);
    const removed = this.store.retain(cfg.job, cfg.keepLast);
    const bytes = files.reduce((sum, f) => sum + f.bytes.byteLength, 0);
    const writeMs = performance.now() - w0;
    const waited = stagedMs > 0 ? `; the ranks waited ${stagedMs.toFixed(0)} ms for its cut` : "";
    this.log?.info(
      {
        job: cfg.job,
        id: manifest.id,
        step,
        bytes,
        ms: Math.round(performance.now() - t0),
        stagedMs: Math.round(stagedMs),
        removed,
        why,
        modelPath,
      },
      "snapshot saved",
    );
    this.#event(
      cfg.job,
      EventKind.Checkpoint,
      step,
      `saved ${manifest.id} (${(bytes / 1e6).toFixed(1)} MB in ${(performance.now() - t0).toFixed(0)} ms, written in ${writeMs.toFixed(0)} ms${waited})${modelPath ? `; model ${modelPath}` : ""}`,
    );
    return encodeManifest(manifest);
  }

  /** The snapshot of `step` if there is one whose files all verify (a corrupt one may be replaced). */
  #goodSnapshot(job: string, step: number): Manifest | null {
    const id = snapshotId(step);
    if (!this.store.list(job).some((m) => m.id === id)) return null;
    try {
      return this.store.read(job, id).manifest;
    } catch (e) {
      if (e instanceof CorruptDataError) return null;
      throw e;
    }
  }

  /** A request for a snapshot's state, given up at once when the job goes on without a lost host. */
  #askState(cfg: JobConfig, subject: string, req: Uint8Array, o?: RequestOptions): Promise<Uint8Array> {
    const asked = this.bus.request(subject, req, stateTimeoutMs, o);
    const signal = this.#jobs.get(cfg.job)?.saves.signal;
    if (signal === undefined) return asked;
    return new Promise((resolve, reject) => {
      const stop = () => reject(signal.reason);
      if (signal.aborted) return stop();
      signal.addEventListener("abort", stop, { once: true });
      asked.then(resolve, reject).finally(() => signal.removeEventListener("abort", stop));
    });
  }

  /** Accuracy of the newest evaluation every rank reported at or before `step` (NaN when none). */
  #metricAt(e: JobEntry, step: number): number {
    return e.evals.newestComplete(step)?.accuracy ?? Number.NaN;
  }

  /**
   * Who asks a recovery: the process its subject names (NATS permissions keep that token to its
   * user), one of the job's, asking for what such a process loses. A shard asks when it opens the
   * job; a trainer of an all-reduce job when it opens the job, when it came back without the
   * restore that loaded the others, or when a collective failed. The tag says which, and names
   * the asker itself.
   */
  #recoverAsker(e: JobEntry, subject: string, tag: string): { kind: "trainer" | "shard"; index: number } {
    const { cfg } = e;
    if (tag.startsWith("step-"))
      throw new BadRequestError(
        `a recovery restores job ${cfg.job}'s newest good snapshot; restoring ${boundText(tag)} is an operator's restore (mt.<job>.ckpt.restore)`,
      );
    const asker = recoverAskerOf(subject);
    if (asker === null)
      throw new BadRequestError(
        `a recovery is asked on mt.<job>.ckpt.recover.trainer-<rank> or .shard-<k>, not ${subject}`,
      );
    const who = `${asker.kind} ${asker.index}`;
    if (asker.kind === "shard") {
      if (!usesShards(cfg) || asker.index >= cfg.shards) throw new BadRequestError(`job ${cfg.job} has no ${who}`);
      if (shardOfOpenedTag(tag) !== asker.index)
        throw new BadRequestError(`${who} recovers when it opens the job (tag "${shardOpenedTag(asker.index)}")`);
      return asker;
    }
    if (asker.index >= cfg.trainers) throw new BadRequestError(`job ${cfg.job} has no ${who}`);
    if (usesShards(cfg))
      throw new BadRequestError(`${who} of a parameter-server job holds no state to recover: the shards hold it`);
    const named = trainerOfOpenedTag(tag) ?? trainerOfLacksTag(tag) ?? trainerOfFailedTag(tag);
    if (named !== asker.index)
      throw new BadRequestError(
        `a recovery on ${who}'s subject must be about ${who} (its tag names ${named === null ? "no trainer" : `trainer ${named}`})`,
      );
    return asker;
  }

  /**
   * A recovery: a new restore, unless the restore it asks for was done already. A trainer whose
   * collective failed names the communicator generation that failed: a restore since (another
   * rank asked first) gave every rank a later one, and answers it. A restarted trainer's second
   * ask (it holds none of the restore that loaded the others) restores once per time it opened
   * the job.
   */
  async #recover(
    e: JobEntry,
    asker: { kind: "trainer" | "shard"; index: number },
    tag: string,
    generation: number,
  ): Promise<Uint8Array> {
    const last = e.lastRestore;
    if (asker.kind === "trainer" && trainerOfFailedTag(tag) !== null) {
      if (!Number.isSafeInteger(generation) || generation < 0 || generation > Date.now())
        throw new BadRequestError(`a recovery names communicator generation ${generation}, which no rank runs`);
      if (last !== null && generation < e.generation) {
        this.log?.debug(
          { job: e.cfg.job, tag, generation, restored: e.generation },
          "recovery answered by the last restore",
        );
        return encodeManifest(last.manifest);
      }
    }
    if (asker.kind === "trainer" && trainerOfLacksTag(tag) !== null && last !== null) {
      if (!e.mayRestoreAgain.delete(asker.index)) return encodeManifest(last.manifest);
    }
    return await this.#restore(e, tag);
  }

  async #restore(e: JobEntry, tag: string): Promise<Uint8Array> {
    const { cfg } = e;
    await e.writing; // the newest snapshot is on disk
    // the shards of a resumed job each ask when they open it: one restore loads them all, and
    // the others find their shard loaded already (restoring again would rewind the trainers)
    const opened = shardOfOpenedTag(tag);
    const rank = usesShards(cfg) ? null : trainerOfOpenedTag(tag);
    // a shard or rank that asks a second time came back (restarted) since it opened the job
    const asker = opened !== null ? `shard ${opened}` : rank !== null ? `trainer ${rank}` : null;
    const askedBefore = asker !== null && e.asked.has(asker);
    if (asker !== null) e.asked.add(asker);
    // a new job: a shard's first ask finds the snapshot of step 0 at most, which it holds already
    if (opened !== null && e.fresh && !e.firstAsks.has(`shard ${opened}`)) {
      e.firstAsks.add(`shard ${opened}`);
      throw new NotReadyError(`job ${cfg.job} is new: shard ${opened} starts from the seed's initialization`);
    }
    if (opened !== null && opened < cfg.shards && !(await this.#holdsNothing(cfg, opened))) {
      throw new NotReadyError(
        `shard ${opened} of job ${cfg.job} holds state already (an earlier restore loaded it, or it trained): nothing to restore`,
      );
    }
    const last = e.lastRestore;
    if (rank !== null && e.fresh && last === null && !e.firstAsks.has(`trainer ${rank}`)) {
      e.firstAsks.add(`trainer ${rank}`);
      throw new NotReadyError(`job ${cfg.job} is new: trainer ${rank} starts from the seed's initialization`);
    }
    if (rank !== null && last !== null && !last.opened.has(rank)) {
      last.opened.add(rank);
      // a process of this rank that came back after the restore may find it holds none of it
      e.mayRestoreAgain.add(rank);
      return encodeManifest(last.manifest);
    }
    const id = tag.startsWith("step-") ? tag : "";
    if (askedBefore && id === "" && this.store.list(cfg.job).length === 0) {
      // a process that had opened the job came back without its state, and nothing can give
      // it back: the job cannot go on consistently, so it fails now rather than wait on it
      await this.#failJob(
        cfg,
        `${asker} restarted and lost its state, and job ${cfg.job} has no snapshot to restore it from${cfg.checkpointEvery === 0 ? " (checkpointEvery is 0)" : ""}`,
      );
    }
    let snap: ReturnType<CheckpointStore["latestGood"]>;
    try {
      snap = this.store.latestGood(
        cfg.job,
        id,
        (bad, why) => {
          this.log?.error({ job: cfg.job, id: bad, why }, "snapshot failed verification; trying the previous one");
          this.#event(cfg.job, EventKind.Log, 0, `snapshot ${bad} is corrupt: ${why}`);
        },
        // a resized job resumes from the step its trainers changed, or later under the new ones
        (m) => {
          try {
            return worldResumeProblem(cfg, jobConfigFromJson(m.configJson), m.step);
          } catch (e) {
            return `its settings do not read: ${(e as Error).message}`;
          }
        },
      );
      if (usesShards(cfg)) {
        const loads = reshard(cfg, e.plan, snap.manifest, snap.files, this.payloadBytesMax);
        await Promise.all(
          loads.map((parts, k) => this.#sendParts(e, subjects.psLoad(cfg.job, k), parts, encodeShardState)),
        );
      } else {
        await this.#loadReplicas(e, snap.manifest, snap.files);
      }
    } catch (err) {
      // a process that opened the job holds the seed's initialization, not the job's state, and
      // no snapshot gives it back: served on, it would train from scratch (a resumed job) or
      // disagree with the others (a restarted one) without a word. The job fails, saying why.
      if ((err instanceof CorruptDataError || err instanceof UnusableSnapshotsError) && asker !== null)
        await this.#failJob(
          cfg,
          `${asker} opened job ${cfg.job} without its state, and no snapshot restores it: ${err.message}`,
        );
      throw err;
    }
    // A recovery asked by a process of a run that was closed meanwhile (a cancelled run's rank)
    // waited for processes that are gone; the job's next run, perhaps on other ranks, must not
    // take its loads or its event (seen as a resumed ZeRO job's second restore, or "holds no
    // complete replica"): its loads stopped, and it announces nothing
    if (this.#jobs.get(cfg.job) !== e)
      throw new JobStateError(
        `job ${cfg.job} was closed or reopened while its restore to ${snap.manifest.id} was loaded; not restored`,
      );
    this.log?.warn({ job: cfg.job, id: snap.manifest.id, step: snap.manifest.step, why: tag }, "job restored");
    if (!usesShards(cfg)) e.lastRestore = { manifest: snap.manifest, opened: new Set(rank === null ? [] : [rank]) };
    // all-reduce mode: the event names the load it announces, so a rank that sees the next
    // restore's parts arrive before it took this one knows to wait for that one's event
    const generation = usesShards(cfg) ? 0 : e.generation;
    this.#event(
      cfg.job,
      EventKind.Restore,
      snap.manifest.step,
      `restored ${snap.manifest.id} (${tag || "requested"})`,
      generation,
    );
    return encodeManifest(snap.manifest);
  }

  /** Ends the job as failed with `reason` (its event, its record), then refuses with it. */
  async #failJob(cfg: JobConfig, reason: string): Promise<never> {
    this.log?.error({ job: cfg.job }, reason);
    this.#event(cfg.job, EventKind.Failed, 0, reason);
    await this.control?.end(cfg.job, { state: JobState.Failed, reason }).catch((err: unknown) => {
      this.log?.error({ err: (err as Error).message }, "cannot record the job's failure");
    });
    throw new BadRequestError(reason);
  }

  /**
   * All-reduce mode: every part of the snapshot's replica into every trainer rank, under a new
   * communicator generation (later than any before, also across restarts of this service).
   */
  async #loadReplicas(e: JobEntry, manifest: Manifest, files: ReadonlyMap<string, Uint8Array>): Promise<void> {
    const { cfg, plan } = e;
    const id = manifest.id;
    const generation = Math.max(e.generation + 1, Date.now());
    e.generation = generation;
    // (a ZeRO snapshot: the ranks' partitions, assembled into the replica every rank loads)
    const states = replicaOfSnapshot(cfg, plan, manifest, files, this.payloadBytesMax);
    const parts = states.map((s) => encodeShardState({ ...s, generation }));
    if (parts.length === 0)
      throw new BadRequestError(`snapshot ${id} holds no replica (it was taken by a parameter-server job)`);
    await Promise.all(
      Array.from({ length: cfg.trainers }, (_, r) =>
        this.#sendParts(e, subjects.replicaLoad(cfg.job, r), parts, (bytes) => bytes),
      ),
    );
  }

  /** A restore's parts to one process, in order (it checks each and applies them together after
   *  the last), waiting for it while it is away; stopped once the run they are for is closed or
   *  reopened. */
  async #sendParts<T>(
    e: JobEntry,
    subject: string,
    parts: readonly T[],
    encode: (part: T) => Uint8Array,
  ): Promise<void> {
    const closed = () => this.#jobs.get(e.cfg.job) !== e;
    for (const part of parts) {
      if (closed()) return;
      await requestWhileAway(this.bus, subject, encode(part), stateTimeoutMs, closed);
    }
  }

  /** Whether a shard holds nothing yet: no update applied, no trainer's step pushed. */
  async #holdsNothing(cfg: JobConfig, shard: number): Promise<boolean> {
    const req = encodeJobRequest({ job: cfg.job, step: 0, tag: "" });
    const s = decodeShardStats(await this.bus.request(subjects.psStats(cfg.job, shard), req, stateTimeoutMs), 1 << 20);
    return s.updates === 0 && s.clocks.every((c) => c === 0);
  }

  /** Changes a running job's trainers or shards (the control plane's resizeJob, hosted here: it
   *  needs the job's snapshots). Answers the manifest resumed from. */
  async #resize(e: JobEntry, tag: string, lost?: LeftBehind): Promise<Uint8Array> {
    const { cfg } = e;
    const job = cfg.job;
    if (e.resizeAsked) throw new JobStateError(`job ${job} is being resized already`);
    e.resizeAsked = true;
    try {
      const manifest = await resizeJob(
        cfg,
        tag,
        {
          bus: this.bus,
          control: this.control,
          log: this.log,
          attempt: e.attempt,
          plan: e.plan,
          newestStep: () => this.store.list(job).at(-1)?.step ?? -1,
          current: () => this.#jobs.get(job) === e,
          stopSaves: () =>
            this.#serial(e, async () => {
              e.resizing = true;
            }),
          written: () => e.writing,
          resumable: (c) =>
            this.store.latestGood(
              job,
              "",
              (bad, why) =>
                this.log?.error({ job, id: bad, why }, "snapshot failed verification; trying the previous one"),
              (s) => {
                try {
                  return worldResumeProblem(c, jobConfigFromJson(s.configJson), s.step);
                } catch (err) {
                  return `its settings do not read: ${(err as Error).message}`;
                }
              },
            ).manifest,
          note: (step, text) => this.#event(job, EventKind.Log, step, text),
        },
        { snapshotWaitMs: resizeSnapshotWaitMs, closeWaitMs: resizeCloseWaitMs, planTimeoutMs: resizePlanTimeoutMs },
        lost,
      );
      return encodeManifest(manifest);
    } finally {
      e.resizing = false;
      e.resizeAsked = false;
    }
  }

  /** A host of job `cfg` silent as a whole for its shrinkAfterS: the job goes on without its
   *  ranks (a resize from the newest snapshot), or the events say why it cannot. */
  async #goOnWithout(cfg: JobConfig, h: LostHost): Promise<void> {
    const e = this.#jobs.get(cfg.job);
    if (e === undefined || e.cfg !== cfg) return; // the job was closed or reopened since
    const secs = (h.silentMs / 1000).toFixed(0);
    const plan = shrinkWithout(cfg, h.host, h.who);
    if ("refused" in plan) {
      this.log?.warn({ job: cfg.job, host: h.host, why: plan.refused }, "cannot go on without a lost host");
      this.#event(cfg.job, EventKind.Stalled, 0, `host ${h.host} silent for ${secs} s: ${plan.refused}`);
      return;
    }
    this.#event(
      cfg.job,
      EventKind.Log,
      0,
      `host ${h.host} silent for ${secs} s: the job goes on without ${h.who.join(", ")} (${plan.tag})`,
    );
    // the snapshot being taken waits for the lost ranks' parts: it gives up now
    e.saves.abort(new NotReadyError(`the job goes on without host ${h.host}; this snapshot is given up`));
    try {
      await this.#resize(e, plan.tag, plan.lost);
    } catch (err) {
      this.log?.error({ job: cfg.job, host: h.host, err: (err as Error).message }, "cannot go on without a lost host");
      this.#event(cfg.job, EventKind.Log, 0, `the job cannot go on without host ${h.host}: ${(err as Error).message}`);
    } finally {
      e.saves = new AbortController(); // where the job goes on as it was (a resize reopens it as a new entry)
    }
  }

  #event(job: string, kind: EventKind, step: number, text: string, generation = 0): void {
    this.bus.publish(
      subjects.events(job, EventKind[kind].toLowerCase()),
      encodeEvent({ ...emptyEvent(job, kind), step, text, generation }),
    );
  }

  openJob(spec: JobSpec): void {
    const cfg = configOfSpec(spec);
    const plan = planOfSpec(spec);
    this.closeJob(cfg.job);
    this.#checkResumable(cfg);
    this.store.sweep(cfg.job);
    const evals = new EvalTally(dataRanks(cfg));
    const sub = this.bus.subscribe(subjects.events(cfg.job, "eval"), (data) => {
      try {
        evals.add(decodeEvent(data, 1 << 16));
      } catch (err) {
        this.log?.warn({ err: (err as Error).message }, "undecodable eval event ignored");
      }
    });
    const fresh = this.store.list(cfg.job).length === 0;
    this.#jobs.set(cfg.job, {
      cfg,
      plan,
      evals,
      sub,
      busy: Promise.resolve(),
      generation: 0,
      lastRestore: null,
      mayRestoreAgain: new Set(),
      fresh,
      firstAsks: new Set(),
      asked: new Set(),
      watch: new JobWatch(
        this.bus,
        cfg,
        (kind, step, text) => this.#event(cfg.job, kind, step, text),
        cfg.shrinkAfterS > 0
          ? { afterMs: cfg.shrinkAfterS * 1000, hand: (h) => void this.#goOnWithout(cfg, h) }
          : undefined,
      ),
      attempt: spec.attempt ?? 0,
      staged: new Map(),
      writing: Promise.resolve(),
      resizeAsked: false,
      resizing: false,
      saves: new AbortController(),
    });
    void this.control?.note(cfg.job, { snapshotDir: this.store.jobDir(cfg.job) }).catch((err: unknown) => {
      this.log?.warn({ job: cfg.job, err: (err as Error).message }, "cannot record the job's folder in its record");
    });
  }

  /** A job name with snapshots resumes from them: only with the settings they were taken with. */
  #checkResumable(cfg: JobConfig): void {
    const newest = this.store.list(cfg.job).at(-1);
    if (!newest) return;
    const diff = trajectoryDiff(jobConfigFromJson(newest.configJson), cfg);
    if (diff.length > 0) {
      throw new ConfigError(
        `job ${cfg.job} has snapshots taken with other settings in ${this.store.jobDir(cfg.job)} (${diff.join("; ")}); ` +
          "resubmit it with those settings to resume it, or give the new run another job name",
      );
    }
  }

  /** Resolves when every snapshot being written is on disk. */
  async flush(): Promise<void> {
    await Promise.all([...this.#jobs.values()].map((e) => e.writing));
  }

  closeJob(job: string): void {
    this.#jobs.get(job)?.sub.unsubscribe();
    this.#jobs.get(job)?.watch.close();
    this.#jobs.delete(job);
  }
}
