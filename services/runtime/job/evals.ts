// Evaluations of a job combined over its ranks: each rank evaluates its share of the split and
// publishes an Eval event; the combined result weighs each rank's by the samples it evaluated.
// A rank's result for a step counts once, however often it arrives (ranks that finished repeat
// their final events until the job ends, so a restarted coordinator still hears them).
import type { Event } from "../../../schemas/messages/job.ts";

export interface CombinedEval {
  step: number;
  /** accuracy over every rank's samples */
  accuracy: number;
  /** mean loss per sample */
  loss: number;
  evaluated: number;
  ranks: number;
  /** "test" or "val" */
  split: string;
}

/** Steps whose evaluations are kept (older ones are dropped): a job evaluates every so often. */
const stepsKeptMax = 64;

export class EvalTally {
  readonly #byStep = new Map<number, Map<number, { accuracy: number; loss: number; count: number; split: string }>>();

  constructor(readonly ranks: number) {}

  /** Adds an Eval event; returns the combined result when this event completed its step. */
  add(e: Event): CombinedEval | null {
    if (!(e.rank < this.ranks) || !(e.count >= 0) || !Number.isFinite(e.accuracy) || !Number.isFinite(e.loss))
      return null;
    let step = this.#byStep.get(e.step);
    if (!step) {
      step = new Map();
      this.#byStep.set(e.step, step);
      if (this.#byStep.size > stepsKeptMax) this.#byStep.delete(Math.min(...this.#byStep.keys()));
    }
    if (step.has(e.rank)) return null;
    step.set(e.rank, { accuracy: e.accuracy, loss: e.loss, count: e.count, split: e.text });
    return step.size === this.ranks ? this.combined(e.step) : null;
  }

  /** Forgets the evaluations of steps after `step` (a restore to it: they are run again). */
  forgetAfter(step: number): void {
    for (const s of [...this.#byStep.keys()]) if (s > step) this.#byStep.delete(s);
  }

  /** The step's result over the ranks heard so far (null: none). */
  combined(stepIndex: number): CombinedEval | null {
    const step = this.#byStep.get(stepIndex);
    if (!step || step.size === 0) return null;
    let correct = 0,
      loss = 0,
      count = 0,
      split = "";
    for (const r of step.values()) {
      correct += r.accuracy * r.count;
      loss += r.loss * r.count;
      count += r.count;
      split = r.split;
    }
    return {
      step: stepIndex,
      accuracy: count > 0 ? correct / count : 0,
      loss: count > 0 ? loss / count : 0,
      evaluated: count,
      ranks: step.size,
      split,
    };
  }

  /** The newest step every rank has reported at or before `atMost` (null: none). */
  newestComplete(atMost = Number.POSITIVE_INFINITY): CombinedEval | null {
    let best: number | null = null;
    for (const [s, m] of this.#byStep)
      if (m.size === this.ranks && s <= atMost && (best === null || s > best)) best = s;
    return best === null ? null : this.combined(best);
  }
}
