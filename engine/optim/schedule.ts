// Learning-rate schedules, as pure functions of the step (0-based), and the linear scaling
// rule (Goyal et al., 2017: scale the learning rate with the global batch).
import { ConfigError } from "../../ffi/errors.ts";

export type Schedule =
  | { kind: "constant" }
  /** linear warmup from lr/warmupSteps to lr, then cosine decay to minLr at totalSteps */
  | { kind: "cosine"; warmupSteps: number; totalSteps: number; minLr: number }
  /** linear warmup, then linear decay to minLr at totalSteps */
  | { kind: "linear"; warmupSteps: number; totalSteps: number; minLr: number };

/**
 * The schedule of a run of `totalSteps` steps: the one place a run's settings become a
 * Schedule (trainers, shards and the single-process runs all call it). Warmup is cut short to
 * leave at least one step after it.
 */
export function scheduleOf(kind: Schedule["kind"], warmupSteps: number, totalSteps: number, minLr: number): Schedule {
  if (kind === "constant") return { kind };
  return { kind, warmupSteps: Math.min(warmupSteps, Math.max(0, totalSteps - 1)), totalSteps, minLr };
}

export function checkSchedule(s: Schedule, lr: number): void {
  if (!(lr > 0) || !Number.isFinite(lr)) throw new ConfigError(`learning rate must be a positive number, got ${lr}`);
  if (s.kind === "constant") return;
  if (!Number.isInteger(s.warmupSteps) || s.warmupSteps < 0)
    throw new ConfigError(`warmupSteps must be an integer >= 0, got ${s.warmupSteps}`);
  if (!Number.isInteger(s.totalSteps) || s.totalSteps <= s.warmupSteps) {
    throw new ConfigError(`totalSteps (${s.totalSteps}) must be an integer > warmupSteps (${s.warmupSteps})`);
  }
  if (!(s.minLr >= 0 && s.minLr <= lr)) throw new ConfigError(`minLr must be in [0, lr], got ${s.minLr}`);
}

/** The learning rate at `step`: warmup as in nanoGPT, lr * (step + 1) / warmupSteps. */
export function lrAt(s: Schedule, lr: number, step: number): number {
  if (s.kind === "constant") return lr;
  if (step < s.warmupSteps) return (lr * (step + 1)) / s.warmupSteps;
  if (step >= s.totalSteps) return s.minLr;
  const ratio = (step - s.warmupSteps) / (s.totalSteps - s.warmupSteps);
  const coeff = s.kind === "cosine" ? 0.5 * (1 + Math.cos(Math.PI * ratio)) : 1 - ratio;
  return s.minLr + coeff * (lr - s.minLr);
}

/** Linear scaling rule: a learning rate tuned at baseBatch, used at globalBatch. */
export function scaleLrForBatch(lr: number, baseBatch: number, globalBatch: number): number {
  if (!(baseBatch > 0) || !(globalBatch > 0))
    throw new ConfigError(`batch sizes must be > 0 (${baseBatch}, ${globalBatch})`);
  return (lr * globalBatch) / baseBatch;
}
