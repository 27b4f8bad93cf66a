// The trainer process of one rank: runs its part of every job in the `mt-jobs` bucket that
// has that many trainers; a deleted job (cancel) stops its loop after the current step.
import type { Backend } from "../../ffi/backend.ts";
import type { JobSpec } from "../../schemas/messages.ts";
import type { Bus } from "../runtime/bus.ts";
import { configOfSpec } from "../runtime/job.ts";
import type { Logger } from "../runtime/log.ts";
import { totalSteps } from "../data-loader/sampler.ts";
import { TrainerRun } from "./loop.ts";

export class Trainer {
  readonly #runs = new Map<string, { run: TrainerRun; done: Promise<void> }>();

  constructor(readonly bus: Bus, readonly rank: number, readonly backend: Backend, readonly log: Logger | undefined, readonly payloadBytesMax: number) {}

  openJob(spec: JobSpec): void {
    const cfg = configOfSpec(spec);
    if (this.rank >= cfg.trainers || this.#runs.has(cfg.job)) return;
    const run = new TrainerRun({ bus: this.bus, backend: this.backend, cfg, rank: this.rank, totalSteps: totalSteps(cfg), payloadBytesMax: this.payloadBytesMax, ...(this.log ? { log: this.log.child({ job: cfg.job }) } : {}) });
    const done = run.run()
      .catch(() => {
        // reported as a Failed event and logged by the run itself
      })
      .finally(() => this.#runs.delete(cfg.job));
    this.#runs.set(cfg.job, { run, done });
  }

  closeJob(job: string): void {
    this.#runs.get(job)?.run.stop();
  }

  async stop(): Promise<void> {
    for (const { run } of this.#runs.values()) run.stop();
    await Promise.all([...this.#runs.values()].map((r) => r.done));
  }
}
