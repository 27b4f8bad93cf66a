// What the CLI exits with, and how it says an error: in one place, for every command. A command
// stopped by a signal (after what a stop takes: a snapshot, the model) exits 128 + its number
// (130 for Ctrl-C: sdk/signals.ts signalExitCode).
import { MeshtrainError } from "../../ffi/errors.ts";
import { printable } from "../format.ts";

export const exitCodes = {
  done: 0,
  /** any error meshtrain raises on purpose (MeshtrainError: bad input, a failed job, an unreachable mesh) */
  failed: 1,
  /** `plan`: the job does not fit the trainers' memory */
  doesNotFit: 3,
} as const;

/**
 * The line an error is said in and the code to exit with; null for anything that is not a
 * MeshtrainError, which is a bug and keeps its stack. A message may quote what came over the bus
 * (a job's failure, a service's error reply), so it is made printable.
 */
export function errorExit(e: unknown): { line: string; code: number } | null {
  if (!(e instanceof MeshtrainError)) return null;
  return { line: `meshtrain: ${e.name}: ${printable(e.message)}`, code: exitCodes.failed };
}
