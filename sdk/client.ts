// The meshtrain client SDK over NATS: submit a job, stream its events, its record (state, newest
// evaluation, where its model went), cancel, and checkpoints. The CLI is built on it; so can
// anyone's scripts.
//   const mesh = await MeshClient.connect("nats://127.0.0.1:4222", { nkeyFile: "runs/mesh/creds/client.nk" });
//   await mesh.submit(config);
//   for await (const e of mesh.events(config.job)) console.log(e);
import { readFileSync } from "node:fs";
import { checkNatsUrl } from "./mesh-address.ts";
import { hostname, userInfo } from "node:os";
import { type DataPlan, decodeDataPlan } from "../schemas/messages/data-loader.ts";
import {
  type JobSpec,
  decodeEvent,
  encodeJobSpec,
  encodeJobRequest,
  type Event,
  EventKind,
  type JobRecord,
  JobState,
  SyncPolicy,
} from "../schemas/messages/job.ts";
import { decodeCheckpointList, decodeManifest, type Manifest } from "../schemas/messages/checkpoint.ts";
import { decodeShardStats, type ShardStats } from "../schemas/messages/parameter-server.ts";
import { decodeTrainerStats, type TrainerStats } from "../schemas/messages/trainer.ts";
import { type NatsTls, nkeyFromEnv, tlsFromEnv } from "../services/runtime/mesh/nats.ts";
import {
  awaitMembers,
  meshMembers,
  type MeshMembers,
  type MeshNeeds,
  type MetricsEndpoint,
  metricsEndpoints,
  rankNeeds,
} from "../services/runtime/mesh/discovery.ts";
import {
  BadRequestError,
  CapacityError,
  DeadlineError,
  JobStateError,
  NoRespondersError,
  UnknownJobError,
} from "../services/runtime/mesh/errors.ts";
import { ConfigError } from "../ffi/errors.ts";
import { defaultOwner, ownerProblem, qualifyJob, subjects } from "../services/runtime/job/subjects.ts";
import {
  type JobConfig,
  jobConfigFromJson,
  parseJobConfig,
  specOfConfig,
  syncPolicy,
  modelParallel,
  usesShards,
} from "../services/runtime/job/config.ts";
import { trajectoryDiff } from "../services/runtime/job/resume.ts";
import { changeWorld } from "../services/runtime/job/world.ts";
import { type CollectivePlan, collectivePlan } from "../services/runtime/job/collective-plan.ts";
import { isEnded, JobLedger, JobStore, runningRecord, stateName } from "../services/runtime/job/ledger.ts";
import { NatsBus, natsServers } from "../services/runtime/mesh/nats.ts";
import { ownerOfSeedFile } from "../services/runtime/job/roles.ts";
import { percent, plural, when } from "./format.ts";

export { specOfConfig, syncPolicy };
/** A resize: a snapshot (up to a minute), every service closing the job (up to a minute), the plan, the reopen. */
export const resizeTimeoutMs = 240_000;
/** Events queued for a slow consumer before the oldest are dropped (counted in `dropped`). */
export const eventQueueMax = 100_000;
/** How long `submit` looks for the ranks a job needs: a service busy in a synchronous stretch
 *  (reading a data set, a long step) can miss one look's window. */
export const submitMembersWaitMs = 5_000;

/** How long a client's job-store operation waits for a NATS server it lost to come back (a local
 *  mesh's launcher restarts a dead one in a few seconds) before it says the mesh is gone. */
export const clientAwayMsMax = 8_000;
/** The data-loader's plan of a job at submission: it reads the data set first (MNIST: under a
 *  second; a large token folder: longer). */
export const planTimeoutMs = 60_000;
/** Shard stats in `status`: a live shard answers in milliseconds. */
const statsTimeoutMs = 3_000;

export interface JobStatus {
  job: string;
  /** null: no record on this mesh (its snapshots were found on disk) */
  record: JobRecord | null;
  config: JobConfig;
  /** per shard while the job runs */
  shards: (ShardStats | { shard: number; error: string })[];
  /** per trainer rank while the job runs: its step and the model state it holds */
  trainers: (TrainerStats | { rank: number; error: string })[];
  checkpoints: Manifest[];
}

/** A job name's earlier run: from its record on this mesh, and its snapshots on disk. */
export interface PreviousRun {
  /** the newest snapshot's settings (what it resumes with), else the record's */
  config: JobConfig;
  record: JobRecord | null;
  /** its newest snapshot */
  snapshot: Manifest | null;
  /** recorded as running, but without a spec: its submission was cut off (resubmitting it is allowed) */
  orphaned: boolean;
}

/** One line on how a job ended, for errors that refuse to touch it again. */
export function endedLine(r: JobRecord): string {
  const figures = r.accuracy >= 0 ? `, ${r.evalSplit || "test"} accuracy ${percent(r.accuracy)}` : "";
  const model = r.modelPath ? `, model ${r.modelPath}` : "";
  return `job ${r.job} ${stateName(r.state)} at ${when(r.endedMs)}${figures}${model}${r.reason ? ` (${r.reason})` : ""}`;
}

/**
 * Refuses to submit under a name that ran before unless that run can be resumed: it failed or
 * was cancelled (or only its snapshots are known), it did not finish, and the settings agree
 * with its snapshots'.
 */
export function checkResume(cfg: JobConfig, prev: PreviousRun, where: string): void {
  const r = prev.record;
  if (r?.state === JobState.Running && !prev.orphaned) {
    throw new JobStateError(
      `job ${cfg.job} is running on ${where}; follow it with: meshtrain watch ${cfg.job} (or stop it: meshtrain cancel ${cfg.job})`,
    );
  }
  if (r?.state === JobState.Done || (r === null && prev.snapshot?.modelPath)) {
    const line = r
      ? endedLine(r)
      : `job ${cfg.job} finished (final snapshot ${prev.snapshot!.id}, model ${prev.snapshot!.modelPath})`;
    throw new JobStateError(`${line}; give the new run another --job name`);
  }
  // without a snapshot there is nothing to resume from: the job starts over, with any settings
  const diff = prev.snapshot ? trajectoryDiff(prev.config, cfg) : [];
  if (diff.length > 0) {
    throw new JobStateError(
      `job ${cfg.job} ran before with other settings (${diff.join("; ")}); resuming it needs the same settings: ` +
        "leave those options out, or give the new run another --job name",
    );
  }
}

/**
 * A resumed job's config with its world: resuming on another number of trainers changes them from
 * the snapshot's step (the sampler re-splits the rest of that epoch among the new ranks). An
 * all-reduce job that keeps its global batch (trainers x batchSize) needs no change: its steps
 * take the same samples.
 */
export function resumedWorld(cfg: JobConfig, prev: PreviousRun): JobConfig {
  const was = prev.config;
  if (prev.snapshot === null || cfg.world.length > 0) return cfg;
  if (cfg.trainers === was.trainers) return parseJobConfig({ ...cfg, world: was.world });
  const regrouped =
    was.sync === "allreduce" &&
    cfg.sync === "allreduce" &&
    was.trainers * was.batchSize === cfg.trainers * cfg.batchSize;
  // the same samples per step over a history of one world: nothing to record
  if (regrouped && was.world.length === 0) return cfg;
  // another global batch (not regrouped): trajectoryDiff names it
  if (!regrouped && cfg.batchSize !== was.batchSize) return cfg;
  // a resized job's history, then the new trainers (and, regrouped, their batch) from the snapshot
  return parseJobConfig({ ...cfg, world: changeWorld(was, prev.snapshot.step, cfg.trainers, cfg.batchSize) });
}

/** How long the header's collective waits for trainers that have not said where they run. */
const collectivePlanWaitMs = 5_000;

/** How MeshClient.connect reaches the mesh. */
export interface MeshConnectOptions {
  /** how long to keep trying to reach the server (default 3 s for each server the URL lists: a
   *  cluster's survivors may each take their connect timeout while it elects new leaders) */
  connectRetryMsMax?: number;
  /** default: MT_TLS_CA, MT_TLS_CERT, MT_TLS_KEY */
  tls?: NatsTls;
  /** the NATS user's nkey seed file (default: MT_NATS_NKEY; none: anonymous) */
  nkeyFile?: string;
  /**
   * whose jobs a name without an owner means (a job is <owner>.<name>); default: MT_OWNER, else
   * the owner of a client-<owner>.nk seed file, else "default". On a mesh with roles a client
   * user acts on its owner's jobs only (services/runtime/job/roles.ts).
   */
  owner?: string;
}

/** The owner a client acts for: given, MT_OWNER, its seed file's (client-<owner>.nk), else the default. */
export function ownerFor(given: string | undefined, nkeyFile: string | undefined): string {
  const owner =
    given ??
    (process.env.MT_OWNER || undefined) ??
    (nkeyFile === undefined ? null : ownerOfSeedFile(nkeyFile)) ??
    defaultOwner;
  const problem = ownerProblem(owner);
  if (problem !== null) throw new BadRequestError(problem);
  return owner;
}

export class MeshClient implements AsyncDisposable {
  private constructor(
    readonly bus: NatsBus,
    readonly jobs: JobStore,
    readonly ledger: JobLedger,
    readonly url: string,
    /** whose jobs a bare name means */
    readonly owner: string,
  ) {}

  /** A job's full identity: `name` with this client's owner, unless it names its own (<owner>.<name>). */
  job(name: string): string {
    return qualifyJob(name, this.owner);
  }

  /** `tls`: the CA of a tls:// server (and a client certificate and key when it verifies
   *  clients); by default MT_TLS_CA, MT_TLS_CERT and MT_TLS_KEY. `nkeyFile`: the seed of the NATS
   *  user to connect as (a mesh with roles: services/runtime/job/roles.ts); by default MT_NATS_NKEY. */
  static async connect(url: string, o: MeshConnectOptions = {}): Promise<MeshClient> {
    checkNatsUrl(url, "MeshClient.connect: the NATS URL");
    const nkeyFile = o.nkeyFile ?? nkeyFromEnv();
    const owner = ownerFor(o.owner, nkeyFile);
    const bus = await NatsBus.connect({
      url,
      name: "meshtrain-sdk",
      connectRetryMsMax: o.connectRetryMsMax ?? 3_000 * natsServers(url).length,
      connectBackoffMsMax: 1000,
      tls: o.tls ?? tlsFromEnv(),
      ...(nkeyFile === undefined ? {} : { nkeyFile }),
    });
    try {
      // a client gives up on a server it lost after a while (a service waits on: it is restarted)
      const ledger = await JobLedger.open(bus, undefined, { leaderReads: false, awayMsMax: clientAwayMsMax });
      return new MeshClient(bus, ledger.store, ledger, url, owner);
    } catch (e) {
      await bus.close();
      throw e;
    }
  }

  /** Who is on the mesh now ($SRV discovery); with `needs`, whether it runs what they say, at
   *  once when it does (other members may then be left out). */
  async members(needs?: MeshNeeds, windowMs?: number): Promise<MeshMembers> {
    return await meshMembers(this.bus, { needs, waitMs: windowMs });
  }

  /**
   * What will carry an all-reduce job's gradients (NCCL or the ring, and why), from where the
   * mesh's trainers say they run: the trainers decide the same from the same announcement.
   * Null for a job of another mode.
   */
  async collectivePlan(cfg: JobConfig, waitMs = collectivePlanWaitMs): Promise<CollectivePlan | null> {
    if (usesShards(cfg) || modelParallel(cfg)) return null;
    // a trainer says where it runs (its host, device, GPU) once its backend is open: a mesh that
    // has just started is asked again for a few seconds
    const until = Date.now() + waitMs;
    for (;;) {
      const seen = await this.members(rankNeeds(cfg));
      const places = Array.from({ length: cfg.trainers }, (_, r) => seen.trainerPlaces?.[r]);
      if (places.every((p) => p !== undefined) || Date.now() >= until) return collectivePlan(cfg, places);
      await Bun.sleep(250);
    }
  }

  /** Every service's Prometheus /metrics endpoint (from service discovery). */
  async metricsEndpoints(): Promise<MetricsEndpoint[]> {
    return await metricsEndpoints(this.bus);
  }

  /**
   * Resolves true once the mesh runs every rank, shard and service the job needs (false when
   * `signal` aborts first); CapacityError naming what is missing after `waitMs`.
   */
  async waitForMembers(
    cfg: Pick<JobConfig, "job" | "trainers" | "shards">,
    waitMs: number,
    signal?: AbortSignal,
  ): Promise<boolean> {
    return await awaitMembers((needs, windowMs) => this.members(needs, windowMs), cfg, waitMs, this.url, signal);
  }

  /**
   * The earlier run of a job name, if there was one: its record on this mesh, else its newest
   * snapshot on the checkpoint service's disk (a local `meshtrain run` starts a new mesh each time).
   */
  async previous(name: string, o: { waitMs?: number } = {}): Promise<PreviousRun | null> {
    const job = this.job(name);
    const rec = await this.jobs.record(job);
    let snaps: Manifest[] = [];
    try {
      snaps = await this.#onceServed(
        () => this.checkpoints(job),
        o.waitMs,
        `no checkpoint service answers on ${this.url}, so the snapshots of job ${job} cannot be looked up; is the mesh up? (meshtrain status)`,
      );
    } catch (e) {
      if (!(e instanceof UnknownJobError)) throw e;
    }
    const snapshot = snaps.at(-1) ?? null;
    const orphaned = rec !== null && rec.record.state === JobState.Running && (await this.jobs.spec(job)) === null;
    // a job resumes from its snapshots: their settings are the ones it keeps
    if (snapshot)
      return { config: jobConfigFromJson(snapshot.configJson), record: rec?.record ?? null, snapshot, orphaned };
    return rec
      ? { config: jobConfigFromJson(rec.record.configJson), record: rec.record, snapshot: null, orphaned }
      : null;
  }

  /**
   * Validates the config, checks that the mesh runs every rank the job needs (waiting up to
   * `membersWaitMs` for them to register: a mesh that is starting), and starts the job
   * (its record, then its spec, which every service follows). A name that ran before resumes
   * from its snapshots, if that run failed or was cancelled and the settings agree; a running or
   * finished job is refused.
   */
  async submit(
    config: JobConfig,
    o: { membersWaitMs?: number; checkMembers?: boolean; signal?: AbortSignal } = {},
  ): Promise<JobRecord> {
    let cfg = parseJobConfig({ ...config, job: this.job(config.job) });
    if (
      (o.checkMembers ?? true) &&
      !(await this.waitForMembers(cfg, o.membersWaitMs ?? submitMembersWaitMs, o.signal))
    ) {
      throw new DeadlineError(
        `the submission of job ${cfg.job} was stopped (${String(o.signal?.reason ?? "aborted")})`,
      );
    }
    const prev = await this.previous(cfg.job, { waitMs: o.membersWaitMs ?? submitMembersWaitMs });
    if (prev) {
      cfg = resumedWorld(cfg, prev);
      checkResume(cfg, prev, this.url);
    }
    const plan = await this.plan(cfg);
    const attempts = (prev?.record?.attempts ?? 0) + 1;
    const rec = runningRecord(cfg.job, JSON.stringify(cfg), attempts);
    const written = prev?.record
      ? await this.jobs.updateRecord(cfg.job, (r) =>
          r.state === prev.record!.state && r.attempts === prev.record!.attempts ? rec : null,
        )
      : (await this.jobs.createRecord(rec))
        ? rec
        : null;
    if (written === null)
      throw new JobStateError(
        `job ${cfg.job} was submitted or changed by someone else just now; see meshtrain status ${cfg.job}`,
      );
    await this.jobs.putSpec(specOfConfig(cfg, { attempt: written.attempts, plan }));
    return written;
  }

  /**
   * `ask`, asked again while nobody serves its subject (a mesh that is starting: a service is seen
   * by discovery a moment before it serves, and registers within seconds); CapacityError saying
   * `missing` once `waitMs` has passed.
   */
  async #onceServed<T>(ask: () => Promise<T>, waitMs = submitMembersWaitMs, missing: string): Promise<T> {
    const started = Date.now();
    for (;;) {
      try {
        return await ask();
      } catch (e) {
        if (!(e instanceof NoRespondersError)) throw e;
        if (Date.now() - started > waitMs) throw new CapacityError(missing);
        await Bun.sleep(200);
      }
    }
  }

  /**
   * The plan of a job (steps, data set sizes, vocabulary, parameter layout), from the mesh's
   * data-loader, which reads the job's data set; its errors (a file it cannot read) are the
   * submission's.
   */
  async plan(config: JobConfig, o: { waitMs?: number } = {}): Promise<DataPlan> {
    const cfg = parseJobConfig({ ...config, job: this.job(config.job) });
    const spec = encodeJobSpec(specOfConfig(cfg));
    return await this.#onceServed(
      async () => decodeDataPlan(await this.bus.request(subjects.planJob, spec, planTimeoutMs), 1 << 20),
      o.waitMs,
      `no data-loader answers on ${this.url} to plan job ${cfg.job}; is the mesh up? (meshtrain status)`,
    );
  }

  /** Stops a running job: every service closes it (trainers after their current step). */
  async cancel(name: string): Promise<JobRecord> {
    const job = this.job(name);
    const r = await this.record(job);
    if (isEnded(r)) throw new JobStateError(`${endedLine(r)}; nothing to cancel`);
    const user = userName();
    const who = user === null ? `a client on ${hostname()}` : `${user}@${hostname()}`;
    const written = await this.ledger.end(
      job,
      { state: JobState.Cancelled, reason: `cancelled by ${who}` },
      r.attempts,
    );
    if (written === null) throw new JobStateError(`${endedLine(await this.record(job))} before it could be cancelled`);
    return written;
  }

  /** A job's record; UnknownJobError when this mesh has none. */
  async record(name: string): Promise<JobRecord> {
    const job = this.job(name);
    const r = await this.jobs.record(job);
    if (!r) throw new UnknownJobError(`no job ${job} on ${this.url} (meshtrain status lists the jobs)`);
    return r.record;
  }

  /** Fails every running job with `reason` (a service the launcher gave up on); the records written. */
  async failRunning(reason: string): Promise<JobRecord[]> {
    const failed: JobRecord[] = [];
    for (const r of await this.list({ every: true })) {
      if (isEnded(r)) continue;
      const written = await this.ledger.end(r.job, { state: JobState.Failed, reason }, r.attempts);
      if (written !== null) failed.push(written);
    }
    return failed;
  }

  /** The jobs of this client's owner that this mesh has a record of, oldest first; `every`: every
   *  owner's (on a mesh with roles, the admin user's to see). */
  async list(o: { every?: boolean } = {}): Promise<JobRecord[]> {
    return await this.jobs.allRecords(o.every ? undefined : this.owner);
  }

  /**
   * The job's events as an async iterator, from now on. Subscribe before submitting to see
   * every event. Ends when the iterator is returned (break) or `signal` aborts.
   */
  events(name: string, signal?: AbortSignal): AsyncIterableIterator<Event> & { dropped: number } {
    const job = this.job(name);
    const queue: Event[] = [];
    let wake: (() => void) | null = null;
    let ended = false;
    let refused: Error | null = null;
    const it = {
      dropped: 0,
      [Symbol.asyncIterator]() {
        return it;
      },
      async next(): Promise<IteratorResult<Event>> {
        while (queue.length === 0 && !ended) await new Promise<void>((r) => (wake = r));
        if (refused !== null) throw refused;
        const value = queue.shift();
        return value === undefined ? { done: true, value: undefined } : { done: false, value };
      },
      async return(): Promise<IteratorResult<Event>> {
        end();
        return { done: true, value: undefined };
      },
    };
    const sub = this.bus.subscribe(
      subjects.allEvents(job),
      (data) => {
        try {
          queue.push(decodeEvent(data, 1 << 20));
        } catch {
          return; // a malformed event is not the client's to fail on
        }
        if (queue.length > eventQueueMax) {
          queue.shift();
          it.dropped++;
        }
        wake?.();
      },
      (e) => {
        // another owner's job (roles.ts): the server refused the subscription
        refused = e;
        end();
      },
    );
    const end = () => {
      ended = true;
      sub.unsubscribe();
      wake?.();
    };
    // a signal aborted already never fires its event: end now
    if (signal?.aborted) end();
    else signal?.addEventListener("abort", end, { once: true });
    return it;
  }

  /** The job's record, config, shard clocks (while it runs) and snapshots. */
  async status(name: string): Promise<JobStatus> {
    const job = this.job(name);
    const rec = await this.jobs.record(job);
    let checkpoints: Manifest[] = [];
    try {
      checkpoints = await this.checkpoints(job);
    } catch (e) {
      if (rec === null && e instanceof NoRespondersError)
        throw new UnknownJobError(
          `no job ${job} on ${this.url}: no record, and no checkpoint service answers there to look for its snapshots; is the mesh up? (meshtrain mesh up)`,
          { cause: e },
        );
      if (!(e instanceof UnknownJobError) && rec === null) throw e;
      // no snapshots, or no checkpoint service running: status still reports the rest
    }
    if (rec === null) {
      const newest = checkpoints.at(-1);
      if (!newest)
        throw new UnknownJobError(
          `no job ${job} on ${this.url}: no record and no snapshots (meshtrain status lists the jobs)`,
        );
      return { job, record: null, config: jobConfigFromJson(newest.configJson), shards: [], trainers: [], checkpoints };
    }
    const config = jobConfigFromJson(rec.record.configJson);
    const ended = isEnded(rec.record);
    const [shards, trainers] = await Promise.all([
      ended || !usesShards(config) ? [] : this.#shardStats(job, config.shards),
      ended ? [] : this.#trainerStats(job, config.trainers),
    ]);
    return { job, record: rec.record, config, shards, trainers, checkpoints };
  }

  async #trainerStats(job: string, trainers: number): Promise<JobStatus["trainers"]> {
    const req = encodeJobRequest({ job, step: 0, tag: "" });
    return await Promise.all(
      Array.from({ length: trainers }, async (_, rank) => {
        try {
          return decodeTrainerStats(
            await this.bus.request(subjects.trainerStats(job, rank), req, statsTimeoutMs),
            1 << 20,
          );
        } catch (e) {
          return { rank, error: (e as Error).message };
        }
      }),
    );
  }

  async #shardStats(job: string, shards: number): Promise<JobStatus["shards"]> {
    const req = encodeJobRequest({ job, step: 0, tag: "" });
    return await Promise.all(
      Array.from({ length: shards }, async (_, k) => {
        try {
          return decodeShardStats(await this.bus.request(subjects.psStats(job, k), req, statsTimeoutMs), 1 << 20);
        } catch (e) {
          return { shard: k, error: (e as Error).message };
        }
      }),
    );
  }

  /** The job's snapshots (also of a job that ended: they stay on the checkpoint service's disk). */
  async checkpoints(name: string): Promise<Manifest[]> {
    const job = this.job(name);
    return decodeCheckpointList(
      await this.bus.request(subjects.ckptList(job), encodeJobRequest({ job, step: 0, tag: "" }), 10_000),
      64 << 20,
    ).items;
  }

  /** Refuses with JobStateError unless the job runs now. */
  async #running(job: string, what: string): Promise<JobRecord> {
    const r = await this.record(job);
    if (isEnded(r)) {
      const resume =
        r.state === JobState.Done
          ? ""
          : `; to resume it from its newest snapshot, submit it again: meshtrain submit --job ${job}`;
      throw new JobStateError(`${endedLine(r)}; ${what} needs a running job${resume}`);
    }
    return r;
  }

  /**
   * Asks for a snapshot now: trainer rank 0 takes it at its next step boundary (where the
   * parameter servers are consistent). Resolves with the Checkpoint event, or rejects after
   * timeoutMs (the job is not training).
   */
  async saveCheckpoint(name: string, timeoutMs = 60_000): Promise<Event> {
    const job = this.job(name);
    await this.#running(job, "a snapshot");
    const events = this.events(job, AbortSignal.timeout(timeoutMs));
    try {
      // rank 0 answers at once (no one answers: the job has no running rank 0)
      await this.bus.request(subjects.checkpointNow(job), new Uint8Array(0), Math.min(timeoutMs, 10_000));
      for await (const e of events) {
        if (e.kind === EventKind.Checkpoint) return e;
        if (e.kind === EventKind.Ended) throw new JobStateError(`job ${job} ended before the snapshot (${e.text})`);
      }
      throw new DeadlineError(
        `no snapshot of ${job} within ${timeoutMs} ms; is it training? (meshtrain status ${job})`,
      );
    } finally {
      await events.return?.();
    }
  }

  /**
   * Rolls a running job back to a snapshot (the newest good one when id is empty). A job that
   * ended is not rolled back: resubmitting it resumes from its newest snapshot.
   */
  async restore(name: string, id = ""): Promise<Manifest> {
    const job = this.job(name);
    await this.#running(job, "restore");
    return decodeManifest(
      await this.bus.request(subjects.ckptRestore(job), encodeJobRequest({ job, step: 0, tag: id }), 120_000),
      1 << 22,
    );
  }

  /**
   * Changes a running job's trainers or shards at a step boundary: the checkpoint service takes
   * a snapshot, every service closes the job and opens it again with the new sizes from that
   * snapshot (the trainers change from its step: the sampler re-splits the rest of the epoch; the
   * shards take its chunks as the new hash ring says). Checks first that the mesh runs every rank
   * and shard the new sizes need. Resolves with the manifest resumed from.
   */
  async resize(
    name: string,
    to: { trainers?: number; shards?: number },
    o: { membersWaitMs?: number } = {},
  ): Promise<Manifest> {
    for (const [what, n] of Object.entries(to))
      if (n !== undefined && !(Number.isInteger(n) && n >= 1 && n <= 64))
        throw new ConfigError(`a resize's ${what} is a count from 1 to 64, not ${n}`);
    const job = this.job(name);
    const rec = await this.#running(job, "resize");
    const cfg = jobConfigFromJson(rec.configJson);
    const trainers = to.trainers ?? cfg.trainers,
      shards = to.shards ?? cfg.shards;
    if (!usesShards(cfg) && to.shards !== undefined)
      throw new BadRequestError(
        `job ${job} has no parameter-server shards to resize: its trainers hold the parameters (--sync ${cfg.sync})`,
      );
    if (trainers === cfg.trainers && shards === cfg.shards)
      throw new BadRequestError(
        `job ${job} runs ${plural(trainers, "trainer")}${usesShards(cfg) ? ` and ${plural(shards, "shard")}` : ""} already`,
      );
    await awaitMembers(
      (needs, windowMs) => this.members(needs, windowMs),
      { job, trainers, shards, sync: cfg.sync },
      o.membersWaitMs ?? submitMembersWaitMs,
      this.url,
      undefined,
      "resize to",
    );
    const req = encodeJobRequest({ job, step: 0, tag: `trainers ${trainers} shards ${shards}` });
    return decodeManifest(await this.bus.request(subjects.ckptResize(job), req, resizeTimeoutMs), 1 << 22);
  }

  async close(): Promise<void> {
    await this.bus.close();
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.close();
  }
}

export { EventKind, JobState };

/**
 * The name of the user this process runs as, or null: $USER or $LOGNAME, else the system's
 * (Bun's userInfo() says "unknown" where node reads the password file, so that is read too).
 */
function userName(): string | null {
  const env = process.env.USER || process.env.LOGNAME;
  if (env) return env;
  try {
    const name = userInfo().username;
    if (name && name !== "unknown") return name;
    const uid = String(process.getuid?.() ?? "");
    const entry = readFileSync("/etc/passwd", "utf8")
      .split("\n")
      .map((l) => l.split(":"))
      .find((f) => f[2] === uid);
    return entry?.[0] || null;
  } catch {
    return null; // no user name (a container without one)
  }
}
