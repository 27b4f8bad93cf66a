// What a GPT training step costs, for `bench engine --config`: its FLOPs and MFU against the
// device's dense bf16 peak, the FLOP rate of its GEMMs and attention and the GB/s of every other
// op (against the device's memory bandwidth) in --profile's table, and the
// host's time issuing its work (a GPU runs that work while the host queues more: launch cost only
// shows where the host is slower than the GPU).
import type { Backend } from "../ffi/backend.ts";
import type { GptConfig } from "../engine/models/gpt.ts";
import { gptParamCount } from "../engine/memory-estimate.ts";

/**
 * FLOPs of one training step, as nanoGPT's estimate_mfu counts them (and PaLM's appendix B):
 * 6 N per token for the weights' GEMMs forward and backward (N the parameters without the
 * position embedding) and 12 L H D T per token for attention's two products, computed over the
 * full (T,T) square. GPT-2 small at b8 T1024: 7.04 TFLOP.
 */
export function gptStepFlops(config: GptConfig, batch: number): number {
  const { nLayer: L, nHead: H, nEmbd: C, blockSize: T } = config;
  const N = gptParamCount(config) - T * C;
  return batch * T * (6 * N + 12 * L * H * (C / H) * T);
}

/** GEMM FLOPs of a step's phase (forward 2 N per token; backward twice that) and attention's
 *  (forward 4 H D T per token per layer over the square, backward 2.5x), for --profile's rate column. */
export function opFlops(config: GptConfig, batch: number, phase: string, op: string): number | null {
  const { nLayer: L, nHead: H, nEmbd: C, blockSize: T } = config;
  const tokens = batch * T;
  const N = gptParamCount(config) - T * C;
  const attentionForward = tokens * L * 4 * H * (C / H) * T;
  if (op === "gemm") return phase === "forward" ? 2 * N * tokens : phase === "backward" ? 4 * N * tokens : null;
  if (op === "attentionForward") return attentionForward;
  if (op === "attentionBackward") return 2.5 * attentionForward;
  return null;
}

/** Dense bf16 tensor-core peak of a GPU by its name, in FLOP/s (NVIDIA's datasheets), or null. */
export function bf16PeakFlops(deviceName: string): number | null {
  const n = deviceName.toUpperCase();
  if (n.includes("H100") && n.includes("PCIE")) return 756e12;
  if (n.includes("H100") || n.includes("H200") || n.includes("GH200")) return 989e12;
  if (n.includes("A100")) return 312e12;
  if (n.includes("L40S")) return 362e12;
  if (n.includes("A10G") || n.includes(" A10")) return 125e12;
  return null;
}

const elemBytes = (elem: unknown) => (elem === "f32" ? 4 : 2);
const count = (v: unknown) => Number(v);
const dimsNumel = (dims: unknown) => (dims as number[]).reduce((a, b) => a * b, 1);

/**
 * The bytes a backend call must read and write at the least (each operand once), for the GB/s
 * column of --profile; null for the ops measured in FLOPs (GEMMs, attention), host transfers and
 * the rest. Arguments are as ffi/ops.ts declares them; `elem` (the last argument of a layer op)
 * sizes the activations, and sums, statistics and parameters are f32.
 */
export function opBytes(op: string, args: readonly unknown[]): number | null {
  const a = args;
  switch (op) {
    case "add":
    case "mul":
    case "axpy":
      return 12 * count(a[op === "axpy" ? 2 : 3]);
    case "scale":
      return 8 * count(a[1]);
    case "sum":
    case "sumSquares":
    case "countNonFinite":
      return 4 * count(a[op === "sum" ? 2 : 1]);
    case "copy":
      return 2 * count(a[2]);
    case "zero":
      return count(a[1]);
    case "fill":
      return 4 * count(a[1]);
    case "castF32ToBF16":
    case "castF32ToF16":
    case "castBF16ToF32":
    case "castF16ToF32":
      return 6 * count(a[2]);
    case "reduceBroadcast":
      return 4 * dimsNumel(a[2]);
    case "biasAdd":
      return 2 * count(a[3]) * count(a[4]) * elemBytes(a[5]);
    case "biasBackward":
      return count(a[2]) * count(a[3]) * elemBytes(a[4]);
    case "biasGeluForward":
      return 3 * count(a[3]) * count(a[4]) * elemBytes(a[5]);
    case "reluForward":
    case "geluForward":
      return 2 * count(a[2]) * elemBytes(a[3]);
    case "reluBackward":
    case "geluBackward":
      return 3 * count(a[3]) * elemBytes(a[4]);
    case "dropoutForward":
    case "dropoutBackward":
      return 8 * count(a[2]);
    case "crossEntropyForward":
    case "countCorrect":
      return count(a[op === "countCorrect" ? 2 : 5]) * count(a[op === "countCorrect" ? 3 : 6]) * elemBytes(a.at(-1));
    case "crossEntropyBackward":
      // logits read, gradient written (and read first where it accumulates)
      return (a[7] ? 3 : 2) * count(a[5]) * count(a[6]) * elemBytes(a[8]);
    case "layerNormForward":
      // inp (f32) read, out (elem) written
      return count(a[6]) * count(a[7]) * (4 + elemBytes(a[9]));
    case "residualLayerNormForward":
      // x and d read, their sum written (f32), out (elem) written
      return count(a[8]) * count(a[9]) * (12 + elemBytes(a[11]));
    case "layerNormBackward":
      // dout (elem) and inp read, dinp read and written
      return count(a[8]) * count(a[9]) * (elemBytes(a[10]) + 12);
    case "embeddingForward":
      return 8 * count(a[3]) * count(a[4]);
    case "embeddingBackward":
      return 12 * count(a[3]) * count(a[4]);
    case "adamwStep":
      // param, m and v read and written, grad read (and age read and written where kept)
      return (a[4] ? 36 : 28) * count(a[5]);
    case "sgdStep":
      return 20 * count(a[3]);
    default:
      return null;
  }
}

/** Peak memory bandwidth (bytes/s) of a GPU from its memory clock (kHz) and bus width (bits), as
 *  cuDeviceGetAttribute reports them (double data rate); null where either is 0 or unknown. */
export function peakBandwidth(memoryClockKHz: number, busWidthBits: number): number | null {
  return memoryClockKHz > 0 && busWidthBits > 0 ? 2 * memoryClockKHz * 1e3 * (busWidthBits / 8) : null;
}

/**
 * A backend whose method calls, all but those named in `direct`, go through `around(name, call,
 * args)`; `call` is the method bound to the real backend (its private fields need the real
 * `this`). The wrappers are made once per method, so an interceptor that only checks a flag costs
 * that check a call.
 */
export function interceptCalls(
  inner: Backend,
  direct: ReadonlySet<string>,
  around: (name: string, call: (...args: unknown[]) => unknown, args: unknown[]) => unknown,
): Backend {
  const wrappers = new Map<PropertyKey, unknown>();
  return new Proxy(inner, {
    get(target, prop) {
      const known = wrappers.get(prop);
      if (known !== undefined) return known;
      const value = Reflect.get(target, prop, target);
      if (typeof value !== "function") return value;
      const call = value.bind(target) as (...args: unknown[]) => unknown;
      const name = String(prop);
      const wrapper =
        typeof prop !== "string" || direct.has(name) ? call : (...args: unknown[]) => around(name, call, args);
      wrappers.set(prop, wrapper);
      return wrapper;
    },
  });
}

/** Backend calls that wait for the device: their host time is the device's, not the host's. */
const waiting = new Set(["synchronize", "download", "sumSquares", "countNonFinite", "whenIdle"]);

/**
 * The host's time inside the backend's calls while `on` (kernel launches, GEMM and cuDNN calls:
 * argument marshalling and the driver), without the calls that wait for the device, and how many
 * calls. Run a step through `backend` with `on` set, then read() the totals.
 */
export class HostIssueMeter {
  on = false;
  #ms = 0;
  #calls = 0;
  readonly backend: Backend;

  constructor(inner: Backend) {
    this.backend = interceptCalls(inner, waiting, (_name, call, args) => {
      if (!this.on) return call(...args);
      const t = performance.now();
      const r = call(...args);
      this.#ms += performance.now() - t;
      this.#calls++;
      return r;
    });
  }

  /** the totals since the last read */
  read(): { ms: number; calls: number } {
    const r = { ms: this.#ms, calls: this.#calls };
    this.#ms = 0;
    this.#calls = 0;
    return r;
  }
}
