// Which causal attention runs on CUDA, and cuDNN's fused attention run in meshtrain's layouts.
//
//   cudnn      cuDNN's fused flash attention (ffi/cuda/cudnn.ts, graphs in sdpa-graph.ts) on
//              tensor cores: 2-byte q, k, v (bf16 or f16 autocast), f32 statistics
//   kernel     our tensor-core kernels (kernels/flash.cu: FlashAttention-2's tiling on mma.sync):
//              2-byte q, k, v, head sizes 64 and 128; for where cuDNN is missing. Checked in CI
//              on the host emulator only so far: auto does not pick it until a GPU has run it
//   reference  the f32-FMA kernels of kernels/attention.cu: any GPU, any precision, and the
//              numbers the others are checked against
//   auto       cuDNN where it loads and takes the shape under bf16/f16 autocast, else the
//              reference kernels
//
// The attention op's contract (ffi/ops.ts) holds whichever runs: qkv, out, dout and dqkv of the
// autocast type, lse f32; backward writes dqkv, or adds into it with `accumulate`. cuDNN reads
// and writes those buffers where they are: forward writes O into out and Stats into lse;
// backward reads O and dO as they are and writes dQ, dK, dV into dqkv, or, to add, into a
// scratch buffer from the backend's caching allocator that one more kernel adds into dqkv (the
// buffer goes back after the call: stream order makes that safe). A plan is built once per
// shape and kept.
import type { ElemType, Ptr } from "../backend.ts";
import { NativeLibraryError } from "../errors.ts";
import { Cudnn, CudnnUnsupportedError, type CudnnPlan, findCudnn, loadCudnn } from "./cudnn.ts";
import { accumulatePlan, flashUnsupported, type Launch } from "./kernels.ts";
import {
  type SdpaShape,
  sdpaBackwardGraph,
  sdpaBackwardPack,
  sdpaBackwardScratch,
  sdpaForwardGraph,
  sdpaForwardPack,
  sdpaUnsupported,
} from "./sdpa-graph.ts";

export const attentionChoices = ["auto", "cudnn", "kernel", "reference"] as const;

/** --attention kernel asked of inputs the tensor-core kernels do not take. */
export class KernelUnsupportedError extends Error {
  override readonly name = "KernelUnsupportedError";
}
export type AttentionChoice = (typeof attentionChoices)[number];

/** What the router needs of the backend: stream-ordered scratch memory and kernel launches. */
export interface AttentionDevice {
  alloc(bytes: number): Ptr;
  free(ptr: Ptr): void;
  run(launches: readonly Launch[]): void;
  stream: bigint;
}

/** The attention call's arguments (those of Backend.attentionForward / attentionBackward). */
export interface AttentionCall {
  B: number;
  T: number;
  C: number;
  H: number;
  scale: number;
  elem: ElemType;
}

export class AttentionRouter {
  readonly #choice: AttentionChoice;
  readonly #device: AttentionDevice;
  readonly #cudnnPath: string | undefined;
  /** undefined: not loaded yet; a string: why it cannot load (auto falls back) */
  #cudnn: Cudnn | string | undefined;
  readonly #plans = new Map<string, CudnnPlan>();
  /** shapes cuDNN refused, with its reason (auto runs the kernels for them) */
  readonly #refused = new Map<string, string>();
  /** cuDNN plans executed */
  executions = 0;

  constructor(choice: AttentionChoice, device: AttentionDevice, cudnnPath?: string) {
    if (!(attentionChoices as readonly string[]).includes(choice))
      throw new RangeError(`attention: unknown choice ${String(choice)} (one of ${attentionChoices.join(", ")})`);
    this.#choice = choice;
    this.#device = device;
    this.#cudnnPath = cudnnPath;
    // asked for by name: a missing library is an error now, not at the first attention call
    if (choice === "cudnn") this.#handle();
  }

  get choice(): AttentionChoice {
    return this.#choice;
  }

  /** One line on what runs for inputs of `elem`, for a command's header. */
  describe(elem: ElemType): string {
    const reference = "f32-FMA kernels (reference)";
    if (this.#choice === "reference") return `${reference}, as asked (--attention reference)`;
    if (this.#choice === "kernel") {
      return elem === "f32"
        ? `${reference}: --attention kernel cannot run: it needs bf16 or f16 autocast`
        : `tensor-core kernels (FlashAttention-2 tiling on mma.sync, ${elem}), as asked (--attention kernel)`;
    }
    if (elem === "f32") return `${reference}: cuDNN's fused attention needs bf16 or f16 autocast`;
    const cudnn = this.#handle();
    if (typeof cudnn === "string") return `${reference}: ${cudnn}`;
    return `cuDNN ${cudnn.versionText} fused flash attention (${elem} on tensor cores, f32 statistics)`;
  }

  /** Whether the tensor-core kernels run this call (--attention kernel); throws
   *  KernelUnsupportedError where they cannot. */
  usesKernel(call: AttentionCall): boolean {
    if (this.#choice !== "kernel") return false;
    const why = flashUnsupported(call.C, call.H, call.elem);
    if (why !== null) throw new KernelUnsupportedError(`--attention kernel: ${why}`);
    return true;
  }

  /** Whether cuDNN runs this call; throws where --attention cudnn cannot be honoured. */
  usesCudnn(call: AttentionCall): boolean {
    if (this.#choice === "reference" || this.#choice === "kernel") return false;
    if (call.elem === "f32") {
      if (this.#choice === "cudnn")
        throw new NativeLibraryError("--attention cudnn needs bf16 or f16 autocast (--precision bf16|f16)");
      return false;
    }
    const key = shapeKey(call);
    const refused = this.#refused.get(key) ?? sdpaUnsupported(shapeOf(call));
    if (refused !== null) return this.#refuse(key, refused);
    return typeof this.#handle() !== "string";
  }

  /** out (B,T,C) and lse (B,H,T) f32 from qkv (B,T,3C), out and qkv of call.elem, through cuDNN.
   *  False when cuDNN does not run it (usesCudnn, an empty input, or a graph it refused just now):
   *  the caller runs the kernels. */
  forward(out: Ptr, lse: Ptr, qkv: Ptr, call: AttentionCall): boolean {
    const plan = this.#planFor("forward", call);
    if (plan === null) return false;
    const d = this.#device;
    const ws = d.alloc(Math.max(plan.workspaceBytes, 1));
    try {
      this.#execute(plan, sdpaForwardPack(shapeOf(call), { qkv, out, lse }), ws);
    } finally {
      d.free(ws);
    }
    return true;
  }

  /** dqkv (B,T,3C) = (or += with accumulate) the gradient through cuDNN, from dout, out, lse and
   *  qkv; dqkv, dout, out and qkv of call.elem. False as forward's. */
  backward(dqkv: Ptr, dout: Ptr, out: Ptr, lse: Ptr, qkv: Ptr, call: AttentionCall, accumulate: boolean): boolean {
    const plan = this.#planFor("backward", call);
    if (plan === null) return false;
    const n = 3 * call.B * call.T * call.C;
    const shape = shapeOf(call);
    const workspace = backwardWorkspace(shape, plan);
    const d = this.#device;
    const grads = accumulate ? d.alloc(2 * n) : dqkv;
    const ws = d.alloc(workspace.bytes);
    try {
      const pack = sdpaBackwardPack(shape, { qkv, out, lse, dout, dqkv: grads, scratch: ws });
      this.#execute(plan, pack, ws + workspace.planOffset);
      if (accumulate) d.run(accumulatePlan(dqkv, grads, n, call.elem));
    } finally {
      d.free(ws);
      if (grads !== dqkv) d.free(grads);
    }
    return true;
  }

  dispose(): void {
    if (this.#cudnn instanceof Cudnn) this.#cudnn.dispose();
    this.#plans.clear();
  }

  // ---- internals ------------------------------------------------------------------------------

  /** The cuDNN handle, loaded at first use; or, under auto, why there is none. */
  #handle(): Cudnn | string {
    if (this.#cudnn !== undefined) return this.#cudnn;
    try {
      const path = this.#cudnnPath ?? findCudnn();
      if (path === null)
        throw new NativeLibraryError("cuDNN not found (set MESHTRAIN_CUDNN, or pip install nvidia-cudnn-cu13)");
      this.#cudnn = new Cudnn(loadCudnn(path), this.#device.stream);
    } catch (e) {
      if (this.#choice === "cudnn") throw e;
      this.#cudnn = (e as Error).message;
    }
    return this.#cudnn;
  }

  #refuse(key: string, reason: string): false {
    if (this.#choice === "cudnn") throw new CudnnUnsupportedError(`--attention cudnn: ${reason}`);
    this.#refused.set(key, reason);
    return false;
  }

  /** The call's plan (built at its shape's first call), or null where the kernels run it. */
  #planFor(direction: "forward" | "backward", call: AttentionCall): CudnnPlan | null {
    if (call.B * call.T === 0 || !this.usesCudnn(call)) return null;
    const key = `${direction}:${shapeKey(call)}`;
    const kept = this.#plans.get(key);
    if (kept !== undefined) return kept;
    const cudnn = this.#handle() as Cudnn; // usesCudnn: it loaded
    const shape = shapeOf(call);
    try {
      const plan = cudnn.plan(direction === "forward" ? sdpaForwardGraph(shape) : sdpaBackwardGraph(shape));
      this.#plans.set(key, plan);
      return plan;
    } catch (e) {
      if (!(e instanceof CudnnUnsupportedError)) throw e;
      this.#refuse(shapeKey(call), e.message);
      return null;
    }
  }

  #execute(plan: CudnnPlan, pack: ReadonlyMap<number, Ptr>, workspace: Ptr): void {
    const cudnn = this.#handle() as Cudnn;
    cudnn.execute(plan, pack, workspace);
    this.executions++;
  }
}

/** A backward's workspace as the router lays it out: the graph's own intermediates
 *  (sdpaBackwardScratch) first, then the plan's workspace for cuDNN, at planOffset. */
export function backwardWorkspace(shape: SdpaShape, plan: CudnnPlan): { bytes: number; planOffset: number } {
  const scratch = sdpaBackwardScratch(shape);
  return { bytes: scratch.bytes + plan.workspaceBytes, planOffset: scratch.bytes };
}

function shapeOf(call: AttentionCall): SdpaShape {
  return {
    B: call.B,
    H: call.H,
    T: call.T,
    D: call.C / call.H,
    dtype: call.elem === "f16" ? "half" : "bf16",
    scale: call.scale,
  };
}

const shapeKey = (c: AttentionCall) => `${c.B},${c.T},${c.C},${c.H},${c.elem},${c.scale}`;
