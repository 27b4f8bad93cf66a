// What the local training commands print about precision and skipped steps.
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
