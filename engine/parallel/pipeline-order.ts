// Pipeline schedules: the order in which one stage of a P-stage pipeline runs the forward and
// backward passes of a step's M micro-batches.
//
//   gpipe  every forward, then every backward (Huang et al. 2019). A stage holds the
//          activations of all M micro-batches at the end of its forwards.
//   1f1b   one forward, one backward (PipeDream-Flush, Narayanan et al. 2021; Megatron-LM's
//          non-interleaved schedule): stage s first runs min(P−s−1, M) warm-up forwards, then
//          alternates a forward with the backward of its oldest micro-batch, then drains the
//          backwards. A stage holds at most min(P−s, M) micro-batches' activations at once.
//
// Both run the same passes, so both compute the same gradients; they differ in memory, and in
// how the dependencies between stages (forward m needs stage s−1's forward m, backward m needs
// stage s+1's backward m) leave a stage idle. Their bubble, the share of a step a stage waits,
// is the same in theory: (P−1)/(M+P−1) with equal pass times.
import { ConfigError } from "../../ffi/errors.ts";

export const pipeSchedules = ["gpipe", "1f1b"] as const;
export type PipeSchedule = (typeof pipeSchedules)[number];

export interface PipeAction {
  readonly kind: "forward" | "backward";
  /** the micro-batch, 0..M-1 */
  readonly micro: number;
}

export function checkPipeline(stages: number, micro: number): void {
  if (!Number.isInteger(stages) || stages < 1)
    throw new ConfigError(`pipeline stages must be an integer >= 1, got ${stages}`);
  if (!Number.isInteger(micro) || micro < 1)
    throw new ConfigError(`micro-batches must be an integer >= 1, got ${micro}`);
}

/** The passes stage `stage` of `stages` runs in one step of `micro` micro-batches, in order. */
export function stageActions(schedule: PipeSchedule, stages: number, micro: number, stage: number): PipeAction[] {
  checkPipeline(stages, micro);
  if (!Number.isInteger(stage) || stage < 0 || stage >= stages)
    throw new ConfigError(`stage ${stage} is not one of the pipeline's ${stages}`);
  const fwd = (m: number): PipeAction => ({ kind: "forward", micro: m });
  const bwd = (m: number): PipeAction => ({ kind: "backward", micro: m });
  const out: PipeAction[] = [];
  if (schedule === "gpipe") {
    for (let m = 0; m < micro; m++) out.push(fwd(m));
    for (let m = 0; m < micro; m++) out.push(bwd(m));
    return out;
  }
  const warmup = Math.min(stages - stage - 1, micro);
  let f = 0,
    b = 0;
  for (; f < warmup; f++) out.push(fwd(f));
  for (; f < micro; f++, b++) out.push(fwd(f), bwd(b));
  for (; b < micro; b++) out.push(bwd(b));
  return out;
}

/** The theoretical bubble of either schedule with equal pass times: (P−1)/(M+P−1). */
export const theoreticalBubble = (stages: number, micro: number): number => (stages - 1) / (micro + stages - 1);

/** The most micro-batches whose forward has run and backward not yet, over a stage's actions. */
export function peakInFlight(actions: readonly PipeAction[]): number {
  let live = 0,
    peak = 0;
  for (const a of actions) {
    live += a.kind === "forward" ? 1 : -1;
    peak = Math.max(peak, live);
  }
  return peak;
}

export interface SimulatedPipeline {
  /** per stage: the share of the step it spent waiting */
  bubble: number[];
  /** the step's length, in units of one forward */
  makespan: number;
}

/**
 * Runs every stage's actions against the dependencies between stages, with a forward taking
 * `forwardTime` and a backward `backwardTime` and messages taking no time: when each pass can
 * start and the idle share of each stage. With equal times (backward = forward) the bubble is
 * the theory's; the tests check both schedules against it, and against deadlock.
 */
export function simulatePipeline(
  schedule: PipeSchedule,
  stages: number,
  micro: number,
  forwardTime = 1,
  backwardTime = 1,
): SimulatedPipeline {
  const plans = Array.from({ length: stages }, (_, s) => stageActions(schedule, stages, micro, s));
  const fwdDone = Array.from({ length: stages }, () => new Array<number>(micro).fill(-1));
  const bwdDone = Array.from({ length: stages }, () => new Array<number>(micro).fill(-1));
  const next = new Array<number>(stages).fill(0);
  const clock = new Array<number>(stages).fill(0);
  const busy = new Array<number>(stages).fill(0);
  for (let progress = true; progress; ) {
    progress = false;
    for (let s = 0; s < stages; s++) {
      const a = plans[s]![next[s]!];
      if (a === undefined) continue;
      // the input of this pass: the previous stage's forward, or the next stage's backward
      const ready =
        a.kind === "forward"
          ? s === 0
            ? 0
            : fwdDone[s - 1]![a.micro]!
          : s === stages - 1
            ? fwdDone[s]![a.micro]!
            : bwdDone[s + 1]![a.micro]!;
      if (ready < 0) continue;
      const cost = a.kind === "forward" ? forwardTime : backwardTime;
      const end = Math.max(clock[s]!, ready) + cost;
      (a.kind === "forward" ? fwdDone : bwdDone)[s]![a.micro] = end;
      clock[s] = end;
      busy[s]! += cost;
      next[s]!++;
      progress = true;
    }
  }
  if (next.some((n, s) => n < plans[s]!.length))
    throw new ConfigError(`the ${schedule} schedule deadlocks with ${stages} stages and ${micro} micro-batches`);
  const makespan = Math.max(...clock);
  return { bubble: busy.map((b) => 1 - b / makespan), makespan };
}
