// The trainer process of one rank: runs its part of every job in the `mt-jobs` bucket that
// has that many trainers; a closed job (ended or cancelled) stops its loop after the current step.
import type { Backend } from "../../ffi/backend.ts";
import type { JobSpec } from "../../schemas/messages.ts";
import type { Bus } from "../runtime/bus.ts";
import type { MeshMembers } from "../runtime/discovery.ts";
import { configOfSpec } from "../runtime/job.ts";
import type { JobControl } from "../runtime/jobs.ts";
import type { Logger } from "../runtime/log.ts";
import { TrainerRun } from "./loop.ts";

export interface TrainerDeps {
  bus: Bus;
  rank: number;
  backend: Backend;
  log?: Logger;
  payloadBytesMax: number;
  control?: JobControl;
  members?: () => Promise<MeshMembers>;
}

export class Trainer {
  readonly #runs = new Map<string, { run: TrainerRun; done: Promise<void> }>();

  constructor(readonly deps: TrainerDeps) {}

  openJob(spec: JobSpec): void {
    const cfg = configOfSpec(spec);
    const { rank, log } = this.deps;
    if (rank >= cfg.trainers || this.#runs.has(cfg.job)) return;
    const run = new TrainerRun({ ...this.deps, cfg, ...(log ? { log: log.child({ job: cfg.job }) } : {}) });
    const done = run.run()
      .catch(() => {
        // reported as a Failed event, in the job's record and the log by the run itself
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
