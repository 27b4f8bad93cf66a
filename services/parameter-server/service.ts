// The parameter-server shard process: serves `mt.<job>.ps.<shard>.push|pull|stats|state|load`
// for every job in the `mt-jobs` bucket that has a shard with this index. Subjects are served
// with a wildcard job token, so a request for a job this shard does not run gets an
// UnknownJobError reply rather than silence. Opening a job waits for the data-loader's plan
// (the schedule's step count); requests meanwhile get NotReadyError.
import type { Backend } from "../../ffi/backend.ts";
import { decodeDataPlan } from "../../schemas/messages/data-loader.ts";
import { decodeJobRequest, encodeJobRequest, type JobSpec } from "../../schemas/messages/job.ts";
import {
  decodePullRequest,
  decodePushRequest,
  decodeShardState,
  encodePushReply,
  encodeShardState,
  encodeShardStats,
} from "../../schemas/messages/parameter-server.ts";
import type { Bus } from "../runtime/mesh/bus.ts";
import {
  DeadlineError,
  LimitExceededError,
  NoRespondersError,
  NotReadyError,
  UnknownJobError,
} from "../runtime/mesh/errors.ts";
import { cutTag, partOfTag } from "../runtime/job/replica-parts.ts";
import { HeartbeatPublisher } from "../runtime/control/liveness.ts";
import {
  anyJob,
  jobOfRequest,
  shardOpenedTag,
  subjects,
  trainerOfRequest,
  recoverAsker,
} from "../runtime/job/subjects.ts";
import { configOfSpec, type JobConfig, usesShards } from "../runtime/job/config.ts";
import type { Logger } from "../runtime/mesh/log.ts";
import { initialParameters } from "../runtime/job/model.ts";
import { checkPlanLayout, planLayout, planOfSpec } from "../runtime/job/plan.ts";
import { jobsMaxDefault, normWaitMs } from "./limits.ts";

/** Asks for a restore while the checkpoint service has not opened the job yet (about 30 s). */
const restoreAsksMax = 40;
import { m as metrics, onScrape } from "../runtime/mesh/metrics.ts";
import { ParameterShard } from "./shard.ts";

interface JobEntry {
  shard: ParameterShard;
  pushes: number;
  duplicates: number;
  pulls: number;
  /** this shard's heartbeat for the job (its step: the slowest trainer's clock) */
  hb: HeartbeatPublisher;
  /** its ask to be restored is unanswered: it takes no push or pull meanwhile, so that a
   *  restarted trainer's push cannot make the fresh shard look trained (the checkpoint service
   *  restores only a shard that holds nothing) */
  recovering: boolean;
}

export class ParameterServer {
  readonly #jobs = new Map<string, JobEntry>();
  /** jobs waiting for the data-loader's plan; aborted when the job closes first */
  readonly #opening = new Map<string, AbortController>();

  constructor(
    readonly bus: Bus,
    readonly shardIndex: number,
    readonly backend: Backend,
    readonly log: Logger | undefined,
    readonly payloadBytesMax: number,
    readonly jobsMax = jobsMaxDefault,
    /** the machine it runs on, said in its heartbeats (MT_HOST) */
    readonly host = "",
  ) {
    onScrape(() => {
      const shard = String(shardIndex);
      for (const [job, e] of this.#jobs) {
        const clocks = [...e.shard.clocks];
        clocks.forEach((c, t) => metrics.shardClock.set({ job, shard, trainer: String(t) }, c));
        if (clocks.length > 0) metrics.shardStaleness.set({ job, shard }, Math.max(...clocks) - Math.min(...clocks));
        metrics.shardUpdates.set({ job, shard }, e.shard.updates);
      }
    });
  }

  serve(): void {
    const k = this.shardIndex;
    // pushes and pulls carry the trainer's rank as their last token (subjects.psPush)
    const perTrainer = new Set(["push", "pull"]);
    const on = (name: string, handler: (subject: string, data: Uint8Array) => Promise<Uint8Array> | Uint8Array) =>
      this.bus.serve({
        name,
        subject: anyJob(`ps.${k}.${name}${perTrainer.has(name) ? ".*" : ""}`),
        handler: (data, subject) => handler(subject, data),
      });
    on("push", (subject, data) => {
      const m = decodePushRequest(data, this.payloadBytesMax);
      trainerOfRequest(subject, m.trainer);
      const e = this.#serving(subject, m.job);
      const r = e.shard.push(m);
      e.pushes++;
      e.duplicates += r.duplicates;
      e.hb.at(Math.min(...e.shard.clocks), "serving");
      return encodePushReply(r);
    });
    on("pull", async (subject, data) => {
      const m = decodePullRequest(data, this.payloadBytesMax);
      trainerOfRequest(subject, m.trainer);
      const e = this.#serving(subject, m.job);
      e.pulls++;
      const reply = await e.shard.pull(m.trainer, m.step, m.ids, m.dtype);
      if (reply.byteLength > this.payloadBytesMax) {
        throw new LimitExceededError(
          `a pull of ${m.ids.length} chunks is ${reply.byteLength} bytes, over the ${this.payloadBytesMax}-byte limit; pull fewer chunks per request`,
        );
      }
      return reply;
    });
    on("stats", (subject, data) => {
      const m = decodeJobRequest(data, this.payloadBytesMax);
      const e = this.#entry(subject, m.job);
      const s = e.shard;
      return encodeShardStats({
        job: m.job,
        shard: k,
        chunks: s.ids.length,
        elements: s.elements,
        updates: s.updates,
        pushes: e.pushes,
        duplicates: e.duplicates,
        pulls: e.pulls,
        waiting: s.waiting,
        clocks: [...s.clocks],
      });
    });
    // a snapshot's state: cut (tag "cut"), then one part (tag "part <p>") per request, each under the message limit
    on("state", (subject, data) => {
      const m = decodeJobRequest(data, this.payloadBytesMax);
      // a shard waiting for its restore holds no state of the job (its fresh initialization)
      const shard = this.#serving(subject, m.job).shard;
      // "cut": the state of this moment is kept for the parts that follow; the answer is its head (no chunks)
      if (m.tag === cutTag) return encodeShardState(shard.cut(m.step, this.payloadBytesMax));
      return encodeShardState(shard.exportPart(partOfTag(m.tag), m.step, this.payloadBytesMax));
    });
    // BSP clipping: this shard's sum of squares of a step's averaged gradient, once it has it
    on("norm", async (subject, data) => {
      const m = decodeJobRequest(data, this.payloadBytesMax);
      const value = await this.#entry(subject, m.job).shard.partialNorm(m.step, normWaitMs);
      return encodeJobRequest({ job: m.job, step: m.step, tag: "", value });
    });
    on("load", (subject, data) => {
      // snapshots are as large as the shard's parameters and state: allow 64 MB
      const s = decodeShardState(data, Math.max(this.payloadBytesMax, 64 << 20));
      const missing = this.#entry(subject, s.job).shard.loadPart(s);
      if (missing === 0)
        this.log?.info({ job: s.job, step: s.step, parts: Math.max(1, s.parts ?? 0) }, "shard state loaded");
      // waiting: the parts still to come (0: the state is applied)
      return encodeShardStats({
        job: s.job,
        shard: k,
        chunks: s.chunks.length,
        elements: 0,
        updates: s.updates,
        pushes: 0,
        duplicates: 0,
        pulls: 0,
        waiting: missing,
        clocks: [],
      });
    });
  }

  /**
   * The global norm of a step's averaged gradient: every chunk-owning shard's sum of squares,
   * added in shard order (every shard gets the same bits). Retried until normWaitMs has passed.
   */
  async #agreeNorm(cfg: JobConfig, owners: readonly number[], step: number, own: number): Promise<number> {
    const req = encodeJobRequest({ job: cfg.job, step, tag: "" });
    const started = Date.now();
    const parts = await Promise.all(
      owners.map(async (k) => {
        if (k === this.shardIndex) return own;
        for (let attempt = 1; ; attempt++) {
          try {
            return (
              decodeJobRequest(await this.bus.request(subjects.psNorm(cfg.job, k), req, normWaitMs), 1 << 16).value ?? 0
            );
          } catch (e) {
            if (Date.now() - started > normWaitMs || !this.#jobs.has(cfg.job)) throw e;
            await Bun.sleep(Math.min(100 * attempt, 2000));
          }
        }
      }),
    );
    let sum = 0;
    for (const p of parts) sum += p;
    return Math.sqrt(sum);
  }

  /** The job's entry for a push or pull: NotReadyError while the shard waits for its restore. */
  #serving(subject: string, messageJob: string): JobEntry {
    const e = this.#entry(subject, messageJob);
    if (e.recovering)
      throw new NotReadyError(
        `shard ${this.shardIndex} waits for job "${messageJob}" to be restored (it opened the job again)`,
      );
    return e;
  }

  #entry(subject: string, messageJob: string): JobEntry {
    const job = jobOfRequest(subject, messageJob);
    const e = this.#jobs.get(job);
    if (e) return e;
    if (this.#opening.has(job))
      throw new NotReadyError(`shard ${this.shardIndex} is opening job "${job}" (waiting for the data-loader's plan)`);
    throw new UnknownJobError(
      `shard ${this.shardIndex} runs no job "${job}" (running: ${[...this.#jobs.keys()].join(", ") || "none"})`,
    );
  }

  get jobs(): string[] {
    return [...this.#jobs.keys()];
  }

  /**
   * Opens (or re-opens with a new spec) this shard's part of a job: the learning-rate schedule
   * runs over the step count of the plan its spec carries, the chunks are the plan's layout.
   */
  async openJob(spec: JobSpec): Promise<void> {
    const cfg = configOfSpec(spec);
    this.closeJob(spec.job);
    if (this.shardIndex >= cfg.shards || !usesShards(cfg)) return; // this job has fewer shards, or none (all-reduce)
    if (this.#jobs.size + this.#opening.size >= this.jobsMax) {
      throw new LimitExceededError(
        `shard ${this.shardIndex} runs ${this.jobsMax} jobs already (${[...this.#jobs.keys(), ...this.#opening.keys()].join(", ")}); raise its --jobs-max`,
      );
    }
    const abort = new AbortController();
    this.#opening.set(cfg.job, abort);
    try {
      const plan = planOfSpec(spec);
      const totalSteps = plan.totalSteps;
      const init = initialParameters(cfg, plan, this.backend);
      checkPlanLayout(plan, init.values.length, init.decayElems);
      const layout = planLayout(cfg, plan);
      const owners = layout.byShard.flatMap((ids, k) => (ids.length > 0 ? [k] : []));
      const shard = new ParameterShard({
        backend: this.backend,
        config: cfg,
        layout,
        shard: this.shardIndex,
        totalSteps,
        initial: init.values,
        ...(owners.length > 1
          ? { agreeNorm: (step: number, own: number) => this.#agreeNorm(cfg, owners, step, own) }
          : {}),
      });
      shard.onNormFailure = (step, e) =>
        this.log?.error({ job: cfg.job, step, err: e.message }, "the shards did not agree on the gradient norm");
      const hb = new HeartbeatPublisher(this.bus, cfg.job, `shard ${this.shardIndex}`, this.host);
      hb.at(0, "serving");
      this.#jobs.set(cfg.job, { shard, pushes: 0, duplicates: 0, pulls: 0, hb, recovering: true });
      this.log?.info(
        { job: cfg.job, chunks: shard.ids.length, elements: shard.elements, sync: cfg.sync, totalSteps },
        "job opened",
      );
      this.#restoreIfResumed(cfg.job);
    } finally {
      if (this.#opening.get(cfg.job) === abort) this.#opening.delete(cfg.job);
    }
  }

  /**
   * A shard that opens a job which already has snapshots was restarted (or the job was
   * resubmitted to resume): its fresh parameters would disagree with the other shards, so it
   * asks the checkpoint service to restore the whole job. A new job has no snapshot yet.
   */
  #restoreIfResumed(job: string, attempt = 1): void {
    const entry = this.#jobs.get(job);
    const answered = () => {
      if (entry) entry.recovering = false;
    };
    const req = encodeJobRequest({ job, step: 0, tag: shardOpenedTag(this.shardIndex) });
    this.bus.request(subjects.ckptRecover(job, recoverAsker.shard(this.shardIndex)), req, 120_000).then(
      () => {
        answered();
        this.log?.warn({ job }, "job restored from its last snapshot after this shard opened it");
      },
      (e: unknown) => {
        if (e instanceof NotReadyError) return answered(); // no snapshot (a new job), or nothing to restore
        // every service opens the job when its spec appears, in no set order: the checkpoint
        // service may not have yet, or it is restarting (a resumed job must still be restored once it has)
        // no checkpoint service at all (a mesh without one, or it is restarting): nothing can
        // restore this shard now, so it serves meanwhile, and asks again
        if (e instanceof NoRespondersError) answered();
        const later = e instanceof UnknownJobError || e instanceof NoRespondersError || e instanceof DeadlineError;
        if (later && attempt < restoreAsksMax && this.#jobs.get(job) === entry) {
          setTimeout(() => this.#restoreIfResumed(job, attempt + 1), Math.min(100 * attempt, 1000));
          return;
        }
        answered();
        this.log?.warn({ job, err: (e as Error).message }, "no restore after opening the job");
      },
    );
  }

  closeJob(job: string): void {
    this.#opening.get(job)?.abort();
    this.#opening.delete(job);
    const e = this.#jobs.get(job);
    if (!e) return;
    e.shard.dispose();
    e.hb.stop();
    this.#jobs.delete(job);
    this.log?.info({ job }, "job closed");
  }

  stop(): void {
    for (const job of [...this.#jobs.keys(), ...this.#opening.keys()]) this.closeJob(job);
  }
}
