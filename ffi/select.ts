// Picks the compute backend for `--device auto|cpu|cuda`. `auto` takes CUDA when a driver
// and a device are present and says which it picked and why; `cuda` without them is an error
// that names what is missing.
import type { Backend } from "./backend.ts";
import { CpuBackend } from "./cpu/backend.ts";
import { CudaBackend, probeCuda } from "./cuda/backend.ts";
import { NativeLibraryError } from "./errors.ts";

export const deviceChoices = ["auto", "cpu", "cuda"] as const;
export type DeviceChoice = (typeof deviceChoices)[number];

export interface OpenedBackend {
  backend: Backend;
  /** one line saying which backend runs and why (printed by the CLI) */
  why: string;
}

/**
 * `slot` spreads processes over the GPUs of a host: a trainer passes its rank and gets GPU
 * rank mod (GPU count). Single-process commands use GPU 0.
 */
export function openBackend(choice: DeviceChoice, log: (line: string) => void = () => {}, slot = 0): OpenedBackend {
  if (choice === "cpu") return opened(new CpuBackend(), "device: cpu (asked for)", log);
  const probe = probeCuda();
  if (choice === "cuda" && !probe.ok) throw new NativeLibraryError(`--device cuda: ${probe.reason}`);
  if (!probe.ok) return opened(new CpuBackend(), `device: cpu, picked by auto (no CUDA: ${probe.reason})`, log);
  const ordinal = slot % probe.deviceCount;
  const how = choice === "auto" ? ", picked by auto" : "";
  return opened(new CudaBackend({ device: ordinal }), `device: cuda:${ordinal}${how} (${probe.reason})`, log);
}

/** Run fn on the chosen backend and dispose of it afterwards, whatever happens. */
export function withBackend<T>(choice: DeviceChoice, log: ((line: string) => void) | undefined, fn: (backend: Backend) => T): T {
  const { backend } = openBackend(choice, log);
  try {
    return fn(backend);
  } finally {
    backend.dispose();
  }
}

function opened(backend: Backend, why: string, log: (line: string) => void): OpenedBackend {
  log(why);
  return { backend, why };
}
