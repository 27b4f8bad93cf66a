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

export function openBackend(choice: DeviceChoice, log: (line: string) => void = () => {}): OpenedBackend {
  if (choice === "cpu") return opened(new CpuBackend(), "device: cpu (asked for)", log);
  const probe = probeCuda();
  if (choice === "cuda") {
    if (!probe.ok) throw new NativeLibraryError(`--device cuda: ${probe.reason}`);
    return opened(new CudaBackend({ device: 0 }), `device: cuda (${probe.reason})`, log);
  }
  if (probe.ok) return opened(new CudaBackend({ device: 0 }), `device: cuda, picked by auto (${probe.reason})`, log);
  return opened(new CpuBackend(), `device: cpu, picked by auto (no CUDA: ${probe.reason})`, log);
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
