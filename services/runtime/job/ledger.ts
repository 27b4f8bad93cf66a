// Jobs on the mesh live in two JetStream KV buckets:
//   mt-jobs          the specs (JobSpec) of the jobs that run now, one key per job. Every service
//                    follows it: a put opens the service's part of the job, a delete closes it
//                    and frees what it held.
//   mt-job-records   every job's record (JobRecord): running, done, failed or cancelled, its
//                    newest evaluation, and once it ended, why and where its model went.
// A job ends exactly once: the first caller to move its record from running to an end state
// wins (compare-and-set on the key's revision); it then deletes the spec, so every service
// closes the job, and publishes the Ended event. A service that restarts opens only the specs of
// running jobs: an ended job is never reopened.
import type { KV, KvEntry } from "@nats-io/kv";
import {
  decodeJobRecord,
  decodeJobSpec,
  emptyEvent,
  encodeEvent,
  encodeJobRecord,
  encodeJobSpec,
  EventKind,
  type JobRecord,
  type JobSpec,
  JobState,
} from "../../../schemas/messages/job.ts";
import { type Bus, type StoreBus } from "../mesh/bus.ts";
import { JetStreamUnavailableError, NatsUnreachableError, refusedAs } from "../mesh/errors.ts";
import { subjects } from "./subjects.ts";
import { jobClosed, jobOpened } from "../mesh/metrics.ts";
import type { Logger } from "../mesh/log.ts";

export const jobsBucket = "mt-jobs";
export const recordsBucket = "mt-job-records";
/** A job spec is config, not data. */
export const jobSpecBytesMax = 256 << 10;
/** A record is a spec plus a few figures and texts. */
export const jobRecordBytesMax = 512 << 10;
/** Texts copied into a record or an event (a failure's reason): bounded, whatever they quote. */
export const reasonCharsMax = 2000;
/** Compare-and-set attempts of one record update before giving up (each loses only to another writer). */
const casAttemptsMax = 20;

/** A paused job's record says why in its reason, starting with this (watchers wait through it). */
export const resizingReasonPrefix = "resizing: ";

/** How long a job-store operation waits out JetStream's elections: when a server of a cluster is
 *  lost, the survivors elect new leaders of the meta group and of its streams within seconds. */
export const jobStoreLeaderWaitMsMax = 30_000;

/** A KV operation that failed without being applied: nobody leads the stream (or JetStream) now. */
const notApplied = (e: unknown): boolean =>
  e instanceof Error && (e.name === "JetStreamNotEnabled" || /temporarily unavailable|no responders/i.test(e.message));
const timedOut = (e: unknown): boolean => e instanceof Error && /timeout/i.test(`${e.name} ${e.message}`);
/** A read repeated does no harm; a write that timed out may have been applied, and is repeated
 *  only where repeating it changes nothing (a put of the same value, a create checked after). */
export const readAgain = (e: unknown): boolean => notApplied(e) || timedOut(e);
/** How long a read of a key this process wrote waits for a replica that answers from before the write. */
const staleReadWaitMsMax = 5_000;
/** Keys whose last write a process remembers (the oldest are forgotten). */
const writtenKeysMax = 4096;

/** A cluster whose JetStream has no meta leader yet (just started, or electing) times out; a
 *  server without JetStream at all answers at once (no responders), and is not waited for. */
const openAgain = (e: unknown): boolean =>
  timedOut(e) || (e instanceof Error && /temporarily unavailable/i.test(e.message));

/**
 * Runs a KV operation, again while `again` says the failure is JetStream electing a leader (for
 * up to jobStoreLeaderWaitMsMax). `what` names it when the NATS user may not do it (a client user
 * reaches its own owner's jobs only: roles.ts).
 */
export async function untilLed<T>(
  op: () => Promise<T>,
  again: (e: unknown) => boolean = notApplied,
  what = "use the job store",
  waitMs = jobStoreLeaderWaitMsMax,
  away?: Away,
): Promise<T> {
  const started = Date.now();
  for (let attempt = 1; ; attempt++) {
    try {
      return await op();
    } catch (e) {
      const refused = refusedAs(e, what);
      if (refused !== e) throw refused;
      if (!again(e)) throw e;
      // a client cut off from its server for this long: the mesh is gone, not electing a leader
      const gone = away?.ms() ?? 0;
      if (away !== undefined && gone > away.max)
        throw new NatsUnreachableError(
          `cannot ${what}: lost the NATS server at ${away.server} ${Math.round(gone / 1000)} s ago, and none answers since; is the mesh up? (meshtrain mesh up)`,
          { cause: e },
        );
      // no leader for this long: the NATS server is gone (or its JetStream), not electing one
      if (Date.now() - started > waitMs)
        throw new JetStreamUnavailableError(
          `cannot ${what}: the job store (NATS JetStream) did not answer for ${Math.round((Date.now() - started) / 1000)} s (${(e as Error).message}); is the mesh up? (meshtrain status)`,
          { cause: e },
        );
      await Bun.sleep(Math.min(100 * attempt, 1000));
    }
  }
}

/** A client's bound on waiting for a server it lost (StoreBus.awayMs), where a service waits on. */
export interface Away {
  ms: () => number;
  max: number;
  server: string;
}

export type JobChange = { job: string; spec: JobSpec | null };

/** What a service logs once it follows the job specs again after a cluster change (tests wait for it). */
export const jobSpecsFollowedAgain = "following the job specs again";

export const isEnded = (r: JobRecord): boolean => r.state !== JobState.Running;
export const stateName = (s: JobState): string => JobState[s]!.toLowerCase();
export const boundText = (text: string): string =>
  text.length > reasonCharsMax ? `${text.slice(0, reasonCharsMax - 1)}…` : text;

/** A fresh record of a job submitted now. */
export function runningRecord(job: string, configJson: string, attempts: number): JobRecord {
  return {
    job,
    state: JobState.Running,
    configJson,
    submittedMs: Date.now(),
    endedMs: 0,
    totalSteps: 0,
    evalStep: 0,
    accuracy: -1,
    loss: 0,
    evaluated: 0,
    evalSplit: "",
    reason: "",
    snapshot: "",
    modelPath: "",
    snapshotDir: "",
    attempts,
  };
}

export class JobStore {
  private constructor(
    readonly specs: KV,
    readonly records: KV,
    readonly bus: StoreBus,
    readonly away: Away | undefined,
  ) {}

  /** untilLed with this store's bound on a lost server (a client's; none for a service) */
  #led<T>(op: () => Promise<T>, again: (e: unknown) => boolean, what: string): Promise<T> {
    return untilLed(op, again, what, jobStoreLeaderWaitMsMax, this.away);
  }

  /**
   * Opens (creates) both buckets; `replicas`: on how many servers of a cluster they are kept
   * (default MT_KV_REPLICAS, else 1: kv-bucket.ts says how an existing bucket is treated).
   *
   * Reads go to each bucket's stream leader (STREAM.MSG.GET), not to any replica (a direct get,
   * nats.js's default): a replica back from a partition answers from before it caught up, and
   * the data-loader's note of a new job's step count read "no record" there and did nothing (the
   * job ended Done with totalSteps 0). `leaderReads: false` is for a client, whose role may only
   * name its own keys in a direct get's subject: it reads from replicas, and reads its own writes
   * again until they are not older (#readOwn).
   */
  static async open(
    bus: StoreBus,
    o: { replicas?: number; leaderReads?: boolean; awayMsMax?: number } = {},
  ): Promise<JobStore> {
    const { awayMsMax, ...bucket } = { ...o, leaderReads: o.leaderReads ?? true }; // an undefined leaderReads is the default too
    const awayMs = bus.awayMs?.bind(bus);
    const away =
      awayMsMax === undefined || awayMs === undefined ? undefined : { ms: awayMs, max: awayMsMax, server: bus.server };
    try {
      const specs = await untilLed(
        () => bus.openBucket(jobsBucket, { history: 1, maxValueSize: jobSpecBytesMax, ...bucket }),
        openAgain,
        undefined,
        undefined,
        away,
      );
      const records = await untilLed(
        () => bus.openBucket(recordsBucket, { history: 1, maxValueSize: jobRecordBytesMax, ...bucket }),
        openAgain,
        undefined,
        undefined,
        away,
      );
      return new JobStore(specs, records, bus, away);
    } catch (e) {
      if ((e as Error).name !== "JetStreamNotEnabled") throw e;
      throw new JetStreamUnavailableError(
        `the NATS server at ${bus.server} runs without JetStream, where the mesh keeps job specs ` +
          `(KV buckets ${jobsBucket}, ${recordsBucket}); start it with JetStream: nats-server -js (or jetstream {} in its config)`,
        { cause: e },
      );
    }
  }

  /**
   * The revision this process last wrote of each key ("specs/<job>", "records/<job>"). A
   * bucket's replicas answer reads (direct gets), and one back from a partition answers from
   * before it caught up: a read of a key this process wrote, answered older than that write, is
   * asked again (within staleReadWaitMsMax), so that the process reads its own writes.
   */
  readonly #written = new Map<string, number>();

  #wrote(key: string, revision: number): void {
    this.#written.delete(key);
    this.#written.set(key, revision);
    if (this.#written.size > writtenKeysMax) this.#written.delete(this.#written.keys().next().value!);
  }

  /** A read of `key` that is not older than this process's own last write of it. */
  async #readOwn(key: string, read: () => Promise<KvEntry | null>): Promise<KvEntry | null> {
    const started = Date.now();
    for (;;) {
      const e = await read();
      const wrote = this.#written.get(key);
      if (wrote === undefined || (e !== null && e.revision >= wrote) || Date.now() - started > staleReadWaitMsMax)
        return e;
      await Bun.sleep(100);
    }
  }

  async putSpec(spec: JobSpec): Promise<void> {
    // a put that timed out may have been applied: putting the same spec again changes nothing
    const revision = await this.#led(
      () => this.specs.put(spec.job, encodeJobSpec(spec)),
      readAgain,
      `write the spec of job ${spec.job}`,
    );
    this.#wrote(`specs/${spec.job}`, revision);
  }

  /**
   * Deletes a job's spec; given an attempt, only the spec of that submission (a newer one put
   * meanwhile stays). The delete is conditional on the revision read, so it cannot remove a spec
   * put between the read and the delete.
   */
  async deleteSpec(job: string, attempt = 0): Promise<void> {
    const e = await this.#led(() => this.specs.get(job), readAgain, `read the spec of job ${job}`);
    if (!e || e.operation !== "PUT") return;
    if (attempt > 0) {
      const spec = decodeJobSpec(e.value, jobSpecBytesMax);
      if ((spec.attempt ?? 0) > 0 && spec.attempt !== attempt) return;
    }
    try {
      await this.#led(
        () => this.specs.delete(job, { previousSeq: e.revision }),
        notApplied,
        `delete the spec of job ${job}`,
      );
    } catch (err) {
      // another writer got there first (a resubmission put a new spec): that spec is not ours
      if (!/wrong last sequence/i.test((err as Error).message)) throw err;
    }
  }

  async spec(job: string): Promise<JobSpec | null> {
    const e = await this.#readOwn(`specs/${job}`, () =>
      this.#led(() => this.specs.get(job), readAgain, `read the spec of job ${job}`),
    );
    return e && e.operation === "PUT" ? decodeJobSpec(e.value, jobSpecBytesMax) : null;
  }

  async record(job: string): Promise<{ record: JobRecord; revision: number } | null> {
    const e = await this.#readOwn(`records/${job}`, () =>
      this.#led(() => this.records.get(job), readAgain, `read the record of job ${job}`),
    );
    return e && e.operation === "PUT"
      ? { record: decodeJobRecord(e.value, jobRecordBytesMax), revision: e.revision }
      : null;
  }

  /** Every job's record (of one owner's jobs when `owner` is given), oldest submission first.
   *  One that does not decode is left out. */
  async allRecords(owner?: string): Promise<JobRecord[]> {
    const whose = owner === undefined ? "every owner's jobs" : `the jobs of ${owner}`;
    // the whole listing is repeated, not only its start: a stream electing a leader can fail
    // the keys' consumer after it began
    const keys = await this.#led(
      async () => {
        const found: string[] = [];
        for await (const k of await this.records.keys(owner === undefined ? ">" : `${owner}.*`)) found.push(k);
        return found;
      },
      readAgain,
      `list ${whose}`,
    );
    const out: JobRecord[] = [];
    for (const k of keys) {
      try {
        const r = await this.record(k);
        if (r) out.push(r.record);
      } catch {
        // a record we cannot read is not listed; `status <job>` names the problem
      }
    }
    return out.sort((a, b) => a.submittedMs - b.submittedMs);
  }

  /** Writes a record that must not exist yet; false when one does. */
  async createRecord(r: JobRecord): Promise<boolean> {
    const bytes = encodeJobRecord(r);
    try {
      const revision = await this.#led(
        () => this.records.create(r.job, bytes),
        readAgain,
        `write the record of job ${r.job}`,
      );
      this.#wrote(`records/${r.job}`, revision);
      return true;
    } catch (e) {
      if (!/exist|wrong last sequence/i.test((e as Error).message)) throw e;
      // the record found may be this create's own: one that timed out (a stream electing its
      // leader) and was applied after all, then asked again
      const found = await this.record(r.job);
      return found !== null && Buffer.from(encodeJobRecord(found.record)).equals(Buffer.from(bytes));
    }
  }

  /**
   * Changes a job's record by compare-and-set: `change` sees the current record and returns the
   * new one, or null to leave it. Retried when another writer got in between. Returns what was
   * written (null: no record, or change declined).
   */
  async updateRecord(job: string, change: (r: JobRecord) => JobRecord | null): Promise<JobRecord | null> {
    for (let attempt = 1; attempt <= casAttemptsMax; attempt++) {
      const cur = await this.record(job);
      if (cur === null) return null;
      const next = change(cur.record);
      if (next === null) return null;
      try {
        const revision = await this.#led(
          () => this.records.update(job, encodeJobRecord(next), cur.revision),
          notApplied,
          `write the record of job ${job}`,
        );
        this.#wrote(`records/${job}`, revision);
        return next;
      } catch (e) {
        if (!/wrong last sequence/i.test((e as Error).message)) throw e;
      }
    }
    throw new Error(`the record of job ${job} changed ${casAttemptsMax} times while it was being updated`);
  }

  /**
   * Calls onChange for every job spec present now and every later put or delete. A spec that
   * does not decode is logged and skipped (it cannot be run; the SDK validates before putting).
   *
   * The watch is a consumer on one server of a cluster (nats.js makes it R1): when that server
   * dies, nats.js notices only after two missed 30 s heartbeats. So the watch starts again, from
   * the revision after the last one delivered, as soon as a server leaves the cluster or the
   * connection moves to another one; a revision delivered twice (the old watch's last ones) is
   * skipped.
   */
  async watch(onChange: (c: JobChange) => void, log?: Logger): Promise<{ stop(): void }> {
    let last = 0; // the revision (stream sequence) of the last change delivered
    const deliver = (e: KvEntry) => {
      if (e.revision <= last) return;
      last = e.revision;
      if (e.operation !== "PUT") return onChange({ job: e.key, spec: null });
      try {
        onChange({ job: e.key, spec: decodeJobSpec(e.value, jobSpecBytesMax) });
      } catch (err) {
        log?.error({ job: e.key, err: (err as Error).message }, "job spec in the KV bucket does not decode; ignored");
      }
    };
    const start = async (): Promise<{ stop(): void } & AsyncIterable<KvEntry>> => {
      // first the last value of every key, then changes; again: every change after the last delivered
      const w = await this.#led(
        () => this.specs.watch(last === 0 ? {} : { resumeFromRevision: last + 1 }),
        readAgain,
        "follow the job specs",
      );
      void (async () => {
        for await (const e of w) deliver(e);
      })();
      return w;
    };
    let watcher = await start();
    let stopped = false;
    // the new watch runs before the old one stops (the old one's consumer may well be alive)
    const restart = async (why: string) => {
      const from = last + 1;
      const next = await start();
      const old = watcher;
      watcher = next;
      old.stop();
      log?.info({ why, fromRevision: from }, jobSpecsFollowedAgain);
    };
    void followAgain(this.bus.clusterChanges(), () => stopped, restart, log);
    return {
      stop: () => {
        stopped = true;
        watcher.stop();
      },
    };
  }
}

/** The pauses between tries to follow the job specs again: the first, and the longest. */
const followAgainPauseMs = { first: 1000, max: 10_000 } as const;

/**
 * Calls restart after each cluster change (clusterChanges), one at a time: changes during a
 * restart make one more. A restart that fails is tried again, with growing pauses, until one
 * succeeds: the old watch's consumer may have died with its server, and a service that goes on
 * with it never hears of another job.
 */
export async function followAgain(
  changes: AsyncIterable<string>,
  stopped: () => boolean,
  restart: (why: string) => Promise<void>,
  log?: Logger,
  pause: { first: number; max: number } = followAgainPauseMs,
): Promise<void> {
  let why: string | null = null;
  let running: Promise<void> | null = null;
  const drain = async () => {
    let failures = 0;
    while (why !== null && !stopped()) {
      const now: string = why;
      why = null;
      try {
        await restart(now);
        failures = 0;
      } catch (err) {
        failures++;
        const pauseMs = Math.min(pause.first * 2 ** (failures - 1), pause.max);
        log?.warn(
          { err: (err as Error).message, failures, pauseMs },
          "cannot follow the job specs again yet; trying again",
        );
        await Bun.sleep(pauseMs);
        why ??= now;
      }
    }
    running = null;
  };
  for await (const moved of changes) {
    if (stopped()) return;
    why = moved;
    running ??= drain();
  }
}

/** The figures a job ends with (done), or why it ended (failed, cancelled). */
export interface JobEnding {
  state: JobState.Done | JobState.Failed | JobState.Cancelled;
  reason?: string;
  evalStep?: number;
  accuracy?: number;
  loss?: number;
  evaluated?: number;
  evalSplit?: string;
  snapshot?: string;
  modelPath?: string;
  snapshotDir?: string;
}

export type JobFacts = Partial<Pick<JobRecord, "totalSteps" | "snapshotDir">>;

/** What a service's part of a job may report about the job as a whole. */
export interface JobControl {
  /** Ends a running job (given `attempt` > 0: only that submission of it); resolves with the
   *  record written, or null when it had ended already. */
  end(job: string, ending: JobEnding, attempt?: number): Promise<JobRecord | null>;
  /** Records an evaluation every rank has reported. */
  noteEval(
    job: string,
    e: { step: number; accuracy: number; loss: number; evaluated: number; split: string },
  ): Promise<void>;
  /** Records what a service learnt when it opened the job: the step count the data-loader
   *  planned, the folder the checkpoint service keeps the job's snapshots in. */
  note(job: string, facts: JobFacts): Promise<void>;
  /** Takes submission `attempt`'s spec away while its record stays running, saying why (a
   *  resize): every service closes the job. False when the job is not that submission running. */
  pause?(job: string, attempt: number, why: string): Promise<boolean>;
  /** Runs a paused job again as `spec` (its next attempt): the record takes the spec's config
   *  and step count, then the spec is put, and every service opens it. */
  resume?(spec: JobSpec, totalSteps: number): Promise<JobRecord | null>;
}

/** JobControl over the KV buckets, plus the spec-following every service runs. */
export class JobLedger implements JobControl {
  private constructor(
    readonly store: JobStore,
    readonly bus: Bus,
    readonly log: Logger | undefined,
  ) {}

  /** `leaderReads` (JobStore.open): false for a client, whose role reads by direct gets only. */
  static async open(
    bus: StoreBus,
    log?: Logger,
    o: { leaderReads?: boolean; awayMsMax?: number } = {},
  ): Promise<JobLedger> {
    return new JobLedger(await JobStore.open(bus, o), bus, log);
  }

  async end(job: string, ending: JobEnding, attempt = 0): Promise<JobRecord | null> {
    const reason = boundText(ending.reason ?? "");
    const ended = (r: JobRecord): JobRecord => ({ ...r, ...ending, reason, endedMs: Date.now() });
    // only the submission it is about: a late end from an earlier one leaves a resubmission alone
    const ours = (r: JobRecord) => attempt === 0 || r.attempts === attempt;
    // this submission's spec goes first, in any case: whoever sees the record ended finds no
    // spec of it open anywhere (and a crash between the two writes leaves a running record
    // without a spec, which watch reports and a resubmission runs)
    await this.store.deleteSpec(job, attempt);
    let written = await this.store.updateRecord(job, (r) => (isEnded(r) || !ours(r) ? null : ended(r)));
    if (written === null && (await this.store.record(job)) === null) {
      // a spec put without a record (a script that bypassed the SDK): record how it ended
      const r = ended(runningRecord(job, "", 1));
      written = (await this.store.createRecord(r)) ? r : null;
    }
    if (written) {
      const text = `${stateName(written.state)}${reason ? `: ${reason}` : ""}`;
      this.bus.publish(
        subjects.events(job, "ended"),
        encodeEvent({ ...emptyEvent(job, EventKind.Ended), step: written.evalStep, text }),
      );
      this.log?.info({ job, state: stateName(written.state), reason }, "job ended");
    }
    return written;
  }

  async noteEval(
    job: string,
    e: { step: number; accuracy: number; loss: number; evaluated: number; split: string },
  ): Promise<void> {
    await this.store.updateRecord(job, (r) =>
      isEnded(r) || r.evalStep > e.step
        ? null
        : { ...r, evalStep: e.step, accuracy: e.accuracy, loss: e.loss, evaluated: e.evaluated, evalSplit: e.split },
    );
  }

  async pause(job: string, attempt: number, why: string): Promise<boolean> {
    const written = await this.store.updateRecord(job, (r) =>
      isEnded(r) || r.attempts !== attempt ? null : { ...r, reason: boundText(why) },
    );
    if (written === null) return false;
    await this.store.deleteSpec(job, attempt);
    return true;
  }

  async resume(spec: JobSpec, totalSteps: number): Promise<JobRecord | null> {
    const attempt = spec.attempt ?? 0;
    const written = await this.store.updateRecord(spec.job, (r) =>
      isEnded(r) || r.attempts !== attempt - 1
        ? null
        : { ...r, configJson: spec.configJson, attempts: attempt, totalSteps, reason: "" },
    );
    if (written !== null) await this.store.putSpec(spec);
    return written;
  }

  async note(job: string, facts: JobFacts): Promise<void> {
    const known = (r: JobRecord) => Object.entries(facts).every(([k, v]) => r[k as keyof JobFacts] === v);
    await this.store.updateRecord(job, (r) => (isEnded(r) || known(r) ? null : { ...r, ...facts }));
  }

  /**
   * Opens and closes a service's part of each job as specs come and go. A job whose record has
   * ended is not opened (its stale spec is removed). When a part cannot open a job (its data
   * cannot be read, a limit is reached), the job fails at once with that reason: nobody waits
   * for a job that cannot run.
   */
  async follow(
    service: string,
    part: { openJob(spec: JobSpec): void | Promise<void>; closeJob(job: string): void },
  ): Promise<{ stop(): void }> {
    // each change of a job's spec gets a number: an open still reading the record when a newer
    // change arrives (the job ended meanwhile) must not open it after it was closed
    const changes = new Map<string, number>();
    let counter = 0;
    return await this.store.watch(({ job, spec }) => {
      const n = ++counter;
      if (!spec) {
        changes.delete(job); // an open still under way sees no number of its own: it stops
        part.closeJob(job);
        jobClosed(job); // its metrics' series are kept for a while, then dropped
        return;
      }
      changes.set(job, n);
      void this.#open(service, part, spec, () => changes.get(job) === n);
    }, this.log);
  }

  async #open(
    service: string,
    part: { openJob(spec: JobSpec): void | Promise<void> },
    spec: JobSpec,
    current: () => boolean,
  ): Promise<void> {
    try {
      const rec = await this.store.record(spec.job);
      if (!current()) return; // deleted or replaced while the record was read
      if (rec && isEnded(rec.record)) {
        this.log?.info({ job: spec.job, state: stateName(rec.record.state) }, "job ended already; not opened");
        await this.store.deleteSpec(spec.job, spec.attempt);
        return;
      }
      jobOpened(spec.job);
      await part.openJob(spec);
    } catch (e) {
      const why = `${service} cannot open job ${spec.job}: ${(e as Error).message}`;
      this.log?.error({ job: spec.job, err: (e as Error).message }, "cannot open job; failing it");
      await this.end(spec.job, { state: JobState.Failed, reason: why }, spec.attempt).catch((err: unknown) => {
        this.log?.error({ job: spec.job, err: (err as Error).message }, "cannot record the job's failure");
      });
    }
  }
}
