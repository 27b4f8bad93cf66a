// Follows a job's events to its end: a progress line or bar (step, loss, accuracy, samples/s),
// evaluations combined over ranks (weighted by the samples each evaluated), restores and
// checkpoints printed as they happen. Resolves with the final evaluation.
import { type Event, EventKind } from "../schemas/messages.ts";
import { Progress, RateMeter } from "./progress.ts";

export class JobFailedError extends Error {
  override readonly name = "JobFailedError";
}

export interface JobResult {
  accuracy: number;
  loss: number;
  evaluated: number;
  steps: number;
  seconds: number;
  restores: number;
  checkpoints: number;
  /** mean over all ranks' steps, milliseconds */
  split: { dataWaitMs: number; pullMs: number; computeMs: number; pushMs: number };
  samplesPerS: number;
}

export interface WatchOptions {
  trainers: number;
  totalSteps: number;
  /** lines that are not progress (the launcher's restarts); printed above the bar */
  progress?: Progress;
  quiet?: boolean;
}

export async function watchJob(events: AsyncIterable<Event>, o: WatchOptions): Promise<JobResult> {
  const t0 = performance.now();
  const progress = o.progress ?? new Progress(o.totalSteps, "samples");
  const say = (line: string) => !o.quiet && progress.log(line);
  const rate = new RateMeter(40);
  const evals = new Map<number, { loss: number; correct: number; count: number; ranks: number }>();
  const done = new Set<number>();
  let step = 0, loss = Number.NaN, accuracy = "-", restores = 0, checkpoints = 0;
  let final: { loss: number; correct: number; count: number } | null = null;
  const split = { dataWaitMs: 0, pullMs: 0, computeMs: 0, pushMs: 0 };
  let stepEvents = 0, samples = 0;
  try {
    for await (const e of events) {
      switch (e.kind) {
        case EventKind.Step:
          if (e.rank === 0) {
            step = e.step + 1;
            loss = e.loss;
          }
          rate.add(e.count);
          samples += e.count;
          stepEvents++;
          split.dataWaitMs += e.dataWaitMs;
          split.pullMs += e.pullMs;
          split.computeMs += e.computeMs;
          split.pushMs += e.pushMs;
          if (!o.quiet) progress.update(Math.min(step, o.totalSteps), { loss: Number.isFinite(loss) ? loss.toFixed(4) : "-", sps: rate.rate.toFixed(0), extra: `acc ${accuracy} | ` });
          break;
        case EventKind.Eval: {
          const r = evals.get(e.step) ?? { loss: 0, correct: 0, count: 0, ranks: 0 };
          r.loss += e.loss * e.count;
          r.correct += e.accuracy * e.count;
          r.count += e.count;
          r.ranks++;
          evals.set(e.step, r);
          if (r.ranks === o.trainers) {
            accuracy = `${((100 * r.correct) / r.count).toFixed(2)}%`;
            say(`step ${e.step}: ${e.text} loss ${(r.loss / r.count).toFixed(4)}, accuracy ${accuracy} (${r.count} samples over ${o.trainers} trainers)`);
            if (e.step >= o.totalSteps) final = r;
          }
          break;
        }
        case EventKind.Restore:
          restores++;
          say(`restored: ${e.text}; resuming at step ${e.step}`);
          break;
        case EventKind.Checkpoint:
          checkpoints++;
          break;
        case EventKind.Log:
          say(e.text);
          break;
        case EventKind.Failed:
          throw new JobFailedError(`trainer ${e.rank} failed: ${e.text}`);
        case EventKind.Done:
          done.add(e.rank);
          break;
      }
      if (done.size === o.trainers && final !== null) break;
    }
  } finally {
    if (!o.quiet) progress.stop();
  }
  if (final === null) throw new JobFailedError("the event stream ended before the job finished");
  return {
    accuracy: final.correct / final.count, loss: final.loss / final.count, evaluated: final.count, steps: o.totalSteps,
    seconds: (performance.now() - t0) / 1000, restores, checkpoints,
    split: {
      dataWaitMs: split.dataWaitMs / Math.max(stepEvents, 1), pullMs: split.pullMs / Math.max(stepEvents, 1),
      computeMs: split.computeMs / Math.max(stepEvents, 1), pushMs: split.pushMs / Math.max(stepEvents, 1),
    },
    samplesPerS: samples / ((performance.now() - t0) / 1000),
  };
}
