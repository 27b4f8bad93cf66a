// The parameter-server shard process: serves `mt.<job>.ps.<shard>.push|pull|stats|state|load`
// for every job in the `mt-jobs` bucket that has a shard with this index. Subjects are served
// with a wildcard job token, so a request for a job this shard does not run gets an
// UnknownJobError reply rather than silence.
import type { Backend } from "../../ffi/backend.ts";
import {
  decodeJobRequest, decodePullRequest, encodeJobRequest, decodePushRequest, decodeShardState, encodePushReply, encodeShardState,
  encodeShardStats, type JobSpec,
} from "../../schemas/messages.ts";
import type { Bus } from "../runtime/bus.ts";
import { BadRequestError, LimitExceededError, NotReadyError, UnknownJobError } from "../runtime/errors.ts";
import { jobConfigFromJson, subjects } from "../runtime/job.ts";
import type { Logger } from "../runtime/log.ts";
import { initialParameters } from "../runtime/model.ts";
import { totalSteps } from "../data-loader/sampler.ts";
import { buildLayout } from "./layout.ts";
import { jobsMax } from "./limits.ts";
import { ParameterShard } from "./shard.ts";

interface JobEntry {
  shard: ParameterShard;
  pushes: number;
  duplicates: number;
  pulls: number;
}

export class ParameterServer {
  readonly #jobs = new Map<string, JobEntry>();

  constructor(readonly bus: Bus, readonly shardIndex: number, readonly backend: Backend, readonly log: Logger | undefined,
    readonly payloadBytesMax: number) {}

  serve(): void {
    const k = this.shardIndex;
    const on = (name: string, handler: (job: string, data: Uint8Array) => Promise<Uint8Array> | Uint8Array) =>
      this.bus.serve({ name, subject: `mt.*.ps.${k}.${name}`, handler: (data, subject) => handler(subject.split(".")[1]!, data) });
    on("push", (job, data) => {
      const m = decodePushRequest(data, this.payloadBytesMax);
      const e = this.#entry(job, m.job);
      const r = e.shard.push(m);
      e.pushes++;
      e.duplicates += r.duplicates;
      return encodePushReply(r);
    });
    on("pull", async (job, data) => {
      const m = decodePullRequest(data, this.payloadBytesMax);
      const e = this.#entry(job, m.job);
      e.pulls++;
      const reply = await e.shard.pull(m.trainer, m.step, m.ids);
      if (reply.byteLength > this.payloadBytesMax) {
        throw new LimitExceededError(`a pull of ${m.ids.length} chunks is ${reply.byteLength} bytes, over the ${this.payloadBytesMax}-byte limit; pull fewer chunks per request`);
      }
      return reply;
    });
    on("stats", (job, data) => {
      const m = decodeJobRequest(data, this.payloadBytesMax);
      const e = this.#entry(job, m.job);
      const s = e.shard;
      return encodeShardStats({
        job, shard: k, chunks: s.ids.length, elements: s.elements, updates: s.updates, pushes: e.pushes, duplicates: e.duplicates,
        pulls: e.pulls, waiting: s.waiting, clocks: [...s.clocks],
      });
    });
    on("state", (job, data) => {
      const m = decodeJobRequest(data, this.payloadBytesMax);
      return encodeShardState(this.#entry(job, m.job).shard.exportState());
    });
    on("load", (job, data) => {
      // snapshots are as large as the shard's parameters and state: allow 64 MB
      const s = decodeShardState(data, Math.max(this.payloadBytesMax, 64 << 20));
      this.#entry(job, s.job).shard.importState(s);
      this.log?.info({ job, step: s.step }, "shard state loaded");
      return encodeShardStats({ job, shard: k, chunks: s.chunks.length, elements: 0, updates: s.updates, pushes: 0, duplicates: 0, pulls: 0, waiting: 0, clocks: [] });
    });
  }

  #entry(subjectJob: string, messageJob: string): JobEntry {
    if (messageJob !== subjectJob) throw new BadRequestError(`message for job "${messageJob}" sent on a subject of job "${subjectJob}"`);
    const e = this.#jobs.get(subjectJob);
    if (!e) throw new UnknownJobError(`shard ${this.shardIndex} runs no job "${subjectJob}" (running: ${[...this.#jobs.keys()].join(", ") || "none"})`);
    return e;
  }

  get jobs(): string[] {
    return [...this.#jobs.keys()];
  }

  /** Opens (or re-opens with a new spec) this shard's part of a job. */
  openJob(spec: JobSpec): void {
    const cfg = jobConfigFromJson(spec.configJson);
    if (cfg.job !== spec.job) throw new BadRequestError(`job spec "${spec.job}" carries the config of "${cfg.job}"`);
    this.closeJob(spec.job);
    if (this.shardIndex >= cfg.shards) return; // this job has fewer shards
    if (this.#jobs.size >= jobsMax) throw new LimitExceededError(`shard ${this.shardIndex} runs ${jobsMax} jobs already`);
    const init = initialParameters(cfg, this.backend);
    const layout = buildLayout(cfg.job, init.values.length, init.decayElems, cfg.chunkBytes, cfg.shards);
    const shard = new ParameterShard({ backend: this.backend, config: cfg, layout, shard: this.shardIndex, totalSteps: totalSteps(cfg), initial: init.values });
    this.#jobs.set(cfg.job, { shard, pushes: 0, duplicates: 0, pulls: 0 });
    this.log?.info({ job: cfg.job, chunks: shard.ids.length, elements: shard.elements, sync: cfg.sync }, "job opened");
    this.#restoreIfResumed(cfg.job);
  }

  /**
   * A shard that opens a job which already has snapshots was restarted (or the job was
   * resubmitted to resume): its fresh parameters would disagree with the other shards, so it
   * asks the checkpoint service to restore the whole job. A new job has no snapshot yet.
   */
  #restoreIfResumed(job: string): void {
    const req = encodeJobRequest({ job, step: 0, tag: `shard ${this.shardIndex} opened the job` });
    this.bus.request(subjects.ckptRestore(job), req, 120_000).then(
      () => this.log?.warn({ job }, "job restored from its last snapshot after this shard opened it"),
      (e: unknown) => {
        if (e instanceof NotReadyError) return; // no snapshot: a new job
        this.log?.warn({ job, err: (e as Error).message }, "no restore after opening the job");
      },
    );
  }

  closeJob(job: string): void {
    const e = this.#jobs.get(job);
    if (!e) return;
    e.shard.dispose();
    this.#jobs.delete(job);
    this.log?.info({ job }, "job closed");
  }

  stop(): void {
    for (const job of [...this.#jobs.keys()]) this.closeJob(job);
  }
}
