// The trainer process of one rank: runs its part of every job in the `mt-jobs` bucket that
// has that many trainers; a closed job (ended or cancelled) stops its loop after the current step.
import type { Backend } from "../../ffi/backend.ts";
import { type JobSpec, JobState } from "../../schemas/messages/job.ts";
import type { Bus } from "../runtime/mesh/bus.ts";
import type { MeshMembers, MeshNeeds } from "../runtime/mesh/discovery.ts";
import { planOfSpec } from "../runtime/job/plan.ts";
import { configOfSpec, type JobConfig } from "../runtime/job/config.ts";
import type { JobControl } from "../runtime/job/ledger.ts";
import type { NcclIdExchange } from "../runtime/job/nccl-id.ts";
import type { Logger } from "../runtime/mesh/log.ts";
import { TrainerRun } from "./loop.ts";
import type { ReplicaOptions } from "./replica.ts";

export interface TrainerDeps {
  bus: Bus;
  rank: number;
  /** the backend that runs a job (its attention choice: backends.ts); a throw fails the job */
  backendFor: (cfg: JobConfig) => Backend;
  log?: Logger;
  payloadBytesMax: number;
  control?: JobControl;
  members?: (needs?: MeshNeeds, windowMs?: number) => Promise<MeshMembers>;
  /** all-reduce jobs on GPUs: where NCCL communicators exchange their ids (the job store) */
  ncclIds?: NcclIdExchange;
  /** test-only: how long to sleep in every step's compute (a straggler on purpose), asked at every step */
  stepDelayMs?: () => number;
  /** the machine it runs on, said in its heartbeats (MT_HOST) */
  host?: string;
  /** all-reduce jobs: the collective's transport settings (the address of its TCP links) and timeout */
  collective?: Pick<ReplicaOptions, "transport" | "progressTimeoutMs">;
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
    const { backendFor: _, ...deps } = this.deps;
    const run = new TrainerRun({
      ...deps,
      backend: this.deps.backendFor(cfg),
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
        if (next) this.#openPending(next);
      });
    this.#runs.set(cfg.job, { run, done });
  }

  /** A job reopened while its previous run was stopping: one that cannot open now fails, as
   *  JobLedger.follow fails a job that cannot open (nothing else would see this throw). */
  #openPending(spec: JobSpec): void {
    try {
      this.openJob(spec);
    } catch (e) {
      const { rank, log, control } = this.deps;
      const why = `trainer ${rank} cannot open job ${spec.job}: ${(e as Error).message}`;
      log?.error({ job: spec.job, err: (e as Error).message }, "cannot open job; failing it");
      void control?.end(spec.job, { state: JobState.Failed, reason: why }, spec.attempt).catch((err: unknown) => {
        log?.error({ job: spec.job, err: (err as Error).message }, "cannot record the job's failure");
      });
    }
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
