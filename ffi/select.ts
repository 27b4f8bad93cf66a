// Picks the compute backend for `--device auto|cpu|cuda`. `auto` takes CUDA when a driver
// and a device are present and says in one short line which it picked; `cuda` without them
// is an error that names what is missing and how to install it. The probe's full finding
// (driver and device, or why CUDA is not usable with the install hint) is `detail`, for logs:
// on a machine without a GPU, `auto` picking the CPU is expected, not something to fix.
import type { Backend } from "./backend.ts";
import { CpuBackend } from "./cpu/backend.ts";
import type { AttentionChoice } from "./cuda/attention-path.ts";
import { CudaBackend, probeCuda } from "./cuda/backend.ts";
import { NativeLibraryError } from "./errors.ts";

export const deviceChoices = ["auto", "cpu", "cuda"] as const;
export type DeviceChoice = (typeof deviceChoices)[number];

export interface OpenedBackend {
  backend: Backend;
  /** one short line saying which backend runs and why (printed by the CLI) */
  why: string;
  /** the CUDA probe's full finding, for logs ("not probed" for --device cpu) */
  detail: string;
}

/** Gets `why` and `detail` (see OpenedBackend); a CLI prints the first, a service logs both. */
export type DeviceLog = (why: string, detail: string) => void;

/** Settings that only a GPU backend reads. */
export interface GpuOptions {
  /** which causal attention runs (ffi/cuda/attention-path.ts; default auto) */
  attention?: AttentionChoice;
}

/**
 * `slot` spreads processes over the GPUs of a host: a trainer passes its rank and gets GPU
 * rank mod (GPU count). Single-process commands use GPU 0.
 */
export function openBackend(
  choice: DeviceChoice,
  log: DeviceLog = () => {},
  slot = 0,
  gpu: GpuOptions = {},
): OpenedBackend {
  if (choice === "cpu")
    return opened(new CpuBackend(), "device: cpu (asked for)", "CUDA not probed (--device cpu)", log);
  const probe = probeCuda();
  if (choice === "cuda" && !probe.ok) throw new NativeLibraryError(`--device cuda: ${probe.reason}`);
  if (!probe.ok) return opened(new CpuBackend(), "device: cpu (no GPU found)", `no CUDA: ${probe.reason}`, log);
  const ordinal = slot % probe.deviceCount;
  const how = choice === "auto" ? ", picked by auto" : "";
  return opened(
    new CudaBackend({ device: ordinal, attention: gpu.attention }),
    `device: cuda:${ordinal}${how} (${probe.reason})`,
    probe.reason,
    log,
  );
}

/**
 * A DeviceLog that keeps its line until `flush()`: a command says which device runs once it has
 * read its inputs, so that an input error (a missing model, an empty folder) is the only line it
 * prints. Nothing is printed when flush is never called.
 */
export function heldDeviceLine(print: DeviceLog): { log: DeviceLog; flush: () => void } {
  let held: [string, string] | null = null;
  return {
    log: (why, detail) => {
      held = [why, detail];
    },
    flush: () => {
      if (held !== null) print(...held);
      held = null;
    },
  };
}

/** Run fn on the chosen backend and dispose of it afterwards, whatever happens. */
export function withBackend<T>(choice: DeviceChoice, log: DeviceLog | undefined, fn: (backend: Backend) => T): T {
  const { backend } = openBackend(choice, log);
  try {
    return fn(backend);
  } finally {
    backend.dispose();
  }
}

function opened(backend: Backend, why: string, detail: string, log: DeviceLog): OpenedBackend {
  log(why, detail);
  return { backend, why, detail };
}
