// The data-loader process: serves `mt.<job>.data.next` (a Batch per BatchRequest),
// `mt.<job>.data.plan` (the plan its spec carries) and `mt.<job>.data.stats` for every job in
// the `mt-jobs` bucket, and `mt.ctl.plan`: the plan of a job about to be submitted. It is
// the only service that reads a job's data: a data set it cannot read refuses the submission (or
// fails the job at once), with the reason. Jobs that read the same data set share one copy of it
// in memory, freed when the last of them closes.
import { decodeBatchRequest, encodeDataPlan, encodeLoaderStats } from "../../schemas/messages/data-loader.ts";
import { decodeJobRequest, decodeJobSpec, type JobSpec } from "../../schemas/messages/job.ts";
import type { Bus } from "../runtime/mesh/bus.ts";
import { ConfigError, MeshtrainError } from "../../ffi/errors.ts";
import { LimitExceededError, UnknownJobError } from "../runtime/mesh/errors.ts";
import { anyJob, jobOfRequest, subjects } from "../runtime/job/subjects.ts";
import { configOfSpec, type JobConfig } from "../runtime/job/config.ts";
import { jobSpecBytesMax } from "../runtime/job/ledger.ts";
import { planOfSpec } from "../runtime/job/plan.ts";
import type { JobControl } from "../runtime/job/ledger.ts";
import type { Logger } from "../runtime/mesh/log.ts";
import { m as metrics, onScrape } from "../runtime/mesh/metrics.ts";
import { jobsMaxDefault } from "./limits.ts";
import { JobData } from "./loader.ts";
import { type Dataset, datasetKey, readDataset } from "./sources.ts";
import { HeartbeatPublisher } from "../runtime/control/liveness.ts";

export interface DataLoaderOptions {
  payloadBytesMax: number;
  /** jobs served at once */
  jobsMax?: number;
  log?: Logger;
  /** the job records: the step count goes into the job's record */
  control?: JobControl;
  /** a data set to serve every job instead of reading each job's (tests) */
  dataset?: Dataset;
  /** the machine it runs on, said in its heartbeats (MT_HOST) */
  host?: string;
}

export class DataLoader {
  readonly #jobs = new Map<string, JobData>();
  /** per job: this loader's heartbeat (services/runtime/control/liveness.ts) */
  readonly #heartbeats = new Map<string, HeartbeatPublisher>();
  /** loaded data sets by datasetKey, with the jobs that use each */
  readonly #datasets = new Map<string, { data: Dataset; jobs: Set<string> }>();
  readonly payloadBytesMax: number;
  readonly jobsMax: number;

  constructor(
    readonly bus: Bus,
    readonly o: DataLoaderOptions,
  ) {
    this.payloadBytesMax = o.payloadBytesMax;
    this.jobsMax = o.jobsMax ?? jobsMaxDefault;
    onScrape(() => {
      for (const [job, j] of this.#jobs) {
        metrics.loaderQueue.set({ job }, j.queueDepth);
        metrics.loaderWait.set({ job, quantile: "0.5" }, j.waitPercentile(0.5) / 1000);
        metrics.loaderWait.set({ job, quantile: "0.99" }, j.waitPercentile(0.99) / 1000);
      }
    });
  }

  serve(): void {
    this.bus.serve({
      name: "next",
      subject: anyJob("data.next"),
      handler: (data, subject) => {
        const m = decodeBatchRequest(data, this.payloadBytesMax);
        const job = this.#job(subject, m.job);
        const reply = job.next(m.rank, m.split, m.step, m.credits);
        metrics.loaderBatches.inc({ job: m.job });
        if (reply.byteLength > this.payloadBytesMax)
          throw new LimitExceededError(
            `a batch of ${reply.byteLength} bytes exceeds the ${this.payloadBytesMax}-byte limit; lower batchSize`,
          );
        return reply;
      },
    });
    this.bus.serve({
      name: "plan",
      subject: anyJob("data.plan"),
      handler: (data, subject) => {
        const m = decodeJobRequest(data, this.payloadBytesMax);
        return encodeDataPlan(this.#job(subject, m.job).plan);
      },
    });
    this.bus.serve({
      // before a job is submitted: its plan from its config and its data set (read, not held)
      name: "plan-job",
      subject: subjects.planJob,
      handler: (data) => {
        const spec = decodeJobSpec(data, jobSpecBytesMax);
        const cfg = configOfSpec(spec);
        try {
          return encodeDataPlan(new JobData(cfg, this.#dataset(cfg).data).plan);
        } catch (e) {
          if (e instanceof MeshtrainError && e.code !== "") throw e;
          // a file it cannot read, a text too short, a model the data does not fit: the submitter's to fix
          throw new ConfigError(`the data-loader cannot plan job ${cfg.job}: ${(e as Error).message}`, { cause: e });
        }
      },
    });
    this.bus.serve({
      name: "stats",
      subject: anyJob("data.stats"),
      handler: (data, subject) => {
        const m = decodeJobRequest(data, this.payloadBytesMax);
        const j = this.#job(subject, m.job);
        const seconds = (performance.now() - j.startedMs) / 1000;
        return encodeLoaderStats({
          job: m.job,
          batches: j.batches,
          batchesPerS: j.batches / Math.max(seconds, 1e-9),
          queueDepth: j.queueDepth,
          prefetchHits: j.hits,
          prefetchMisses: j.misses,
          waitMsP50: j.waitPercentile(0.5),
          waitMsP99: j.waitPercentile(0.99),
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
      throw new LimitExceededError(
        `the data-loader serves ${this.jobsMax} jobs already (${this.jobs.join(", ")}); wait for one to end or raise its --jobs-max`,
      );
    }
    const plan = planOfSpec(spec);
    const data = this.#dataset(cfg);
    // may refuse the job (images that do not fit its model, data changed since its plan): then nothing is held
    const j = new JobData(cfg, data.data, plan);
    if (!this.o.dataset) {
      this.#datasets.set(datasetKey(cfg), data);
      data.jobs.add(cfg.job);
    }
    this.#jobs.set(cfg.job, j);
    this.#heartbeats.set(cfg.job, new HeartbeatPublisher(this.bus, cfg.job, "data-loader", this.o.host ?? ""));
    this.#heartbeats.get(cfg.job)!.at(0, "serving");
    this.o.log?.info({ ...j.plan }, "job opened");
    await this.o.control?.note(cfg.job, { totalSteps: j.totalSteps });
  }

  /** The data set of a job: the copy jobs already share, or a fresh one (not yet held). */
  #dataset(cfg: JobConfig): { data: Dataset; jobs: Set<string> } {
    if (this.o.dataset) return { data: this.o.dataset, jobs: new Set() };
    // a file that cannot be read throws DataFileError naming it: the job fails with it
    return this.#datasets.get(datasetKey(cfg)) ?? { data: readDataset(cfg), jobs: new Set() };
  }

  closeJob(job: string): void {
    const j = this.#jobs.get(job);
    if (!j) return;
    this.#jobs.delete(job);
    this.#heartbeats.get(job)?.stop();
    this.#heartbeats.delete(job);
    const key = datasetKey(j.cfg);
    const d = this.#datasets.get(key);
    d?.jobs.delete(job);
    if (d && d.jobs.size === 0) {
      // the last job that read it: free it, now rather than whenever the collector next runs, so
      // a long-running loader's memory stays flat from one job to the next (a data set is tens of
      // MB in memory, or a prepared folder's open shard files; a job closes rarely, and a full
      // collection costs milliseconds)
      this.#datasets.delete(key);
      if (d.data.kind === "corpus") for (const t of [d.data.data.train, d.data.data.val]) t.close();
      Bun.gc(true);
    }
    this.o.log?.info({ job }, "job closed");
  }
}
