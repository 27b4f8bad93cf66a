// The data-loader process: serves `mt.<job>.data.next` (a Batch per BatchRequest) and
// `mt.<job>.data.stats` for every job in the `mt-jobs` bucket.
import type { Mnist } from "../../engine/data/mnist.ts";
import { decodeBatchRequest, decodeJobRequest, encodeLoaderStats, type JobSpec } from "../../schemas/messages.ts";
import type { Bus } from "../runtime/bus.ts";
import { LimitExceededError, UnknownJobError } from "../runtime/errors.ts";
import { configOfSpec, jobOfRequest } from "../runtime/job.ts";
import type { Logger } from "../runtime/log.ts";
import { jobsMax } from "./limits.ts";
import { JobData } from "./loader.ts";

export class DataLoader {
  readonly #jobs = new Map<string, JobData>();

  constructor(readonly bus: Bus, readonly log: Logger | undefined, readonly payloadBytesMax: number, readonly dataset?: Mnist) {}

  serve(): void {
    this.bus.serve({
      name: "next", subject: "mt.*.data.next", handler: (data, subject) => {
        const m = decodeBatchRequest(data, this.payloadBytesMax);
        const job = this.#job(subject, m.job);
        const reply = job.next(m.rank, m.split, m.step, m.credits);
        if (reply.byteLength > this.payloadBytesMax) throw new LimitExceededError(`a batch of ${reply.byteLength} bytes exceeds the ${this.payloadBytesMax}-byte limit; lower batchSize`);
        return reply;
      },
    });
    this.bus.serve({
      name: "stats", subject: "mt.*.data.stats", handler: (data, subject) => {
        const m = decodeJobRequest(data, this.payloadBytesMax);
        const j = this.#job(subject, m.job);
        const seconds = (performance.now() - j.startedMs) / 1000;
        return encodeLoaderStats({
          job: m.job, batches: j.batches, batchesPerS: j.batches / Math.max(seconds, 1e-9), queueDepth: j.queueDepth,
          prefetchHits: j.hits, prefetchMisses: j.misses, waitMsP50: j.waitPercentile(0.5), waitMsP99: j.waitPercentile(0.99),
        });
      },
    });
  }

  #job(subject: string, messageJob: string): JobData {
    const job = jobOfRequest(subject, messageJob);
    const j = this.#jobs.get(job);
    if (!j) throw new UnknownJobError(`the data-loader runs no job "${job}"`);
    return j;
  }

  openJob(spec: JobSpec): void {
    const cfg = configOfSpec(spec);
    if (!this.#jobs.has(cfg.job) && this.#jobs.size >= jobsMax) throw new LimitExceededError(`the data-loader serves ${jobsMax} jobs already`);
    const j = new JobData(cfg, this.dataset);
    this.#jobs.set(cfg.job, j);
    this.log?.info({ job: cfg.job, train: j.train.length, val: j.val.length, stepsPerEpoch: j.stepsPerEpoch, totalSteps: j.totalSteps }, "job opened");
  }

  closeJob(job: string): void {
    if (this.#jobs.delete(job)) this.log?.info({ job }, "job closed");
  }
}
