// The trainer process of one rank: runs its part of every job in the `mt-jobs` bucket that
// has that many trainers; a closed job (ended or cancelled) stops its loop after the current step.
import type { Backend } from "../../ffi/backend.ts";
import type { JobSpec } from "../../schemas/messages.ts";
import type { Bus } from "../runtime/mesh/bus.ts";
import type { MeshMembers } from "../runtime/mesh/discovery.ts";
import { planOfSpec } from "../runtime/job/plan.ts";
import { configOfSpec } from "../runtime/job/job.ts";
import type { JobControl } from "../runtime/job/jobs.ts";
import type { Logger } from "../runtime/mesh/log.ts";
import { TrainerRun } from "./loop.ts";

export interface TrainerDeps {
  bus: Bus;
  rank: number;
  backend: Backend;
  log?: Logger;
  payloadBytesMax: number;
  control?: JobControl;
  members?: () => Promise<MeshMembers>;
  /** test-only: sleep this long in every step's compute (a straggler on purpose) */
  stepDelayMs?: number;
}

export class Trainer {
  readonly #runs = new Map<string, { run: TrainerRun; done: Promise<void> }>();
  /** a job reopened while its previous run was still stopping: started once that run is done */
  readonly #pending = new Map<string, JobSpec>();

  constructor(readonly deps: TrainerDeps) {}

  openJob(spec: JobSpec): void {
    const cfg = configOfSpec(spec);
    const { rank, log } = this.deps;
    if (rank >= cfg.trainers) return;
    const previous = this.#runs.get(cfg.job);
    if (previous) {
      if (!previous.run.stopped) return; // the same job again: it runs already
      this.#pending.set(cfg.job, spec);
      return;
    }
    const run = new TrainerRun({
      ...this.deps,
      cfg,
      plan: planOfSpec(spec),
      attempt: spec.attempt ?? 0,
      ...(log ? { log: log.child({ job: cfg.job }) } : {}),
    });
    const done = run
      .run()
      .catch(() => {
        // reported as a Failed event, in the job's record and the log by the run itself
      })
      .finally(() => {
        this.#runs.delete(cfg.job);
        const next = this.#pending.get(cfg.job);
        this.#pending.delete(cfg.job);
        if (next) this.openJob(next);
      });
    this.#runs.set(cfg.job, { run, done });
  }

  closeJob(job: string): void {
    this.#pending.delete(job);
    this.#runs.get(job)?.run.stop();
  }

  async stop(): Promise<void> {
    this.#pending.clear();
    for (const { run } of this.#runs.values()) run.stop();
    await Promise.all([...this.#runs.values()].map((r) => r.done));
  }
}
