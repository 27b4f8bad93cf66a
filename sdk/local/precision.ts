// What the local training commands print about precision, skipped steps and the schedule.
import type { Precision } from "../../engine/mixed.ts";

const notes: Record<Precision, string> = {
  f32: "f32",
  tf32: "tf32 GEMMs (f32 on a CPU)",
  bf16: "bf16 autocast GEMMs, f32 master weights",
  f16: "f16 autocast GEMMs, f32 master weights, dynamic loss scaling",
};

export const precisionNote = (p: Precision): string => notes[p];

/** The line for a step the f16 loss scaler skipped. */
export const skippedStepNote = (step: number, lossScale: number): string =>
  `step ${step}: gradients overflowed in f16; step skipped (parameters unchanged), loss scale now ${lossScale}`;

/** A note when the warmup is as long as the run (the schedule then warms up to its last step,
 *  and never decays), else null. */
export function warmupNote(warmup: number, steps: number): string | null {
  return warmup >= steps && steps > 0
    ? `note: the ${warmup} warmup steps (--warmup) are as many as the run's ${steps}: the learning rate rises to its peak at the last step and never decays; a shorter --warmup gives the schedule room`
    : null;
}
