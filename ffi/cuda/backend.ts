// CUDA backend: the driver API, cuBLAS and our PTX kernels (ffi/cuda/kernels/*.cu), called
// directly through bun:ffi. One device, its primary context, one non-blocking stream.
//
// Ordering: every kernel, copy and GEMM goes onto the one stream, so they run in call order
// and the engine needs no synchronization of its own. Calls that hand a value to JavaScript
// (download, sumSquares, countNonFinite, the invalid-index counts) synchronize the stream.
// The engine keeps those out of the forward and backward passes (ids and targets are checked
// on the host, inRange; the loss is read after backward), so the host queues a whole pass
// while the GPU still runs the previous one's tail.
//
// Host memory the GPU reads or writes asynchronously is pinned (cuMemAllocHost), never a
// JavaScript buffer: the upload staging buffers, the kernel-argument block, the cuBLAS alpha/
// beta scalars and the 8-byte result slot. An upload copies the caller's data into a staging
// buffer and returns while the copy runs; the buffer is reused only after its event reports
// the copy done (two buffers alternate, so a batch upload overlaps the previous step's work).
// No CUDA thread ever calls into JavaScript: completion is polled (whenIdle) or waited on.
import { readFileSync } from "node:fs";
import {
  type Allocation,
  AllocationLedger,
  type Backend,
  type ElemType,
  type GemmDesc,
  gemmCall,
  gemmThenKernels,
  type Ptr,
} from "../backend.ts";
import { CachingAllocator, type CachingAllocatorStats } from "./allocator.ts";
import {
  Cublas,
  cublasWorkspaceBytes,
  findCublas,
  inputTypes,
  loadCublas,
  outputTypes,
  rowMajorGemm,
} from "./cublas.ts";
import { CublasLt, findCublasLt, loadCublasLt } from "./cublaslt.ts";
import { CU_EVENT_DISABLE_TIMING, driver, type Driver, hostBytes } from "./driver.ts";
import { ensurePtx } from "./build.ts";
import { type OpDecl, type OpMethods, type OpName, ops } from "../ops.ts";
import {
  flashPlans,
  type KernelName,
  kernelSpecs,
  type Launch,
  type Plans,
  planTakesScratch,
  plans,
  scratchBytes,
} from "./kernels.ts";
import { type AttentionCall, type AttentionChoice, AttentionRouter } from "./attention-path.ts";

export { probeCuda } from "./driver.ts";

// cuda.h CUdevice_attribute
const CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE = 36;
const CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH = 37;

/** Kernel parameters per launch; the widest kernels (reduceBroadcast's) have 22. */
const kernelArgsMax = 32;
// Layout of the pinned host block: result slot, GEMM scalars, kernel argument values (8 bytes
// each), then the array of pointers to them that cuLaunchKernel reads.
const resultOffset = 0;
const scalarsOffset = 64;
const argValuesOffset = 128;
const argPointersOffset = argValuesOffset + 8 * kernelArgsMax;
const hostBlockBytes = argPointersOffset + 8 * kernelArgsMax;
/** Upload staging starts at this size and grows to the largest upload seen. */
const stagingBytesMin = 4 << 20;

interface Staging {
  ptr: Ptr;
  bytes: number;
  view: Uint8Array;
  /** recorded after the copy that reads this buffer; null before first use */
  event: bigint | null;
}

export interface CudaBackendOptions {
  /** device ordinal (default 0) */
  device?: number;
  /** the driver library (default: the process-wide libcuda, see driver()) */
  driver?: Driver;
  /** the cuBLAS library file (default: findCublas()) */
  cublasPath?: string;
  /** which causal attention runs (ffi/cuda/attention-path.ts; default auto) */
  attention?: AttentionChoice;
  /** the cuDNN library file (default: findCudnn()) */
  cudnnPath?: string;
  /** the cuBLASLt library file (default: findCublasLt()) */
  cublasLtPath?: string;
  /** where a linear layer's bias, GELU and their gradients run: fused into the GEMM by cuBLASLt
   *  where it has a kernel for the call (default), or as the layer kernels after it */
  epilogues?: "cublaslt" | "kernels";
}

// the op methods are made from their declarations in the constructor
// biome-ignore lint/suspicious/noUnsafeDeclarationMerging: the class fills these in
export interface CudaBackend extends OpMethods {}

// biome-ignore lint/suspicious/noUnsafeDeclarationMerging: see above
export class CudaBackend implements Backend {
  readonly name = "cuda";
  readonly deviceOrdinal: number;
  readonly #cublasPath: string | undefined;
  readonly #d: Driver;
  readonly #device: number;
  readonly #context: bigint;
  readonly #stream: bigint;
  readonly #allocator: CachingAllocator;
  readonly #ledger = new AllocationLedger();
  readonly #host: Ptr;
  readonly #args: DataView;
  readonly #result: DataView;
  readonly #modules = new Map<string, bigint>();
  readonly #functions = new Map<KernelName, bigint>();
  /** created at the first GEMM: a backend that only moves memory never loads cuBLAS */
  #cublasHandle: Cublas | null = null;
  readonly #cublasLtPath: string | undefined;
  readonly #epilogues: "cublaslt" | "kernels";
  /** made at the first GEMM with an epilogue; a string says why there is none */
  #lt: CublasLt | string | null = null;
  /** why cuBLASLt left an epilogue to the kernels, each reason once */
  readonly #epilogueFallbacks = new Set<string>();
  #cublasWorkspace: Ptr = 0;
  readonly #scratch: Ptr;
  readonly #staging: Staging[] = [];
  readonly #sideStreams: SideStream[] = [];
  readonly #attention: AttentionRouter;
  #stagingNext = 0;
  #kernelLaunches = 0;
  #gemmCalls = 0;
  #disposed = false;

  constructor(options: CudaBackendOptions = {}) {
    this.deviceOrdinal = options.device ?? 0;
    this.#cublasPath = options.cublasPath;
    this.#cublasLtPath = options.cublasLtPath;
    this.#epilogues = options.epilogues ?? "cublaslt";
    const d = (this.#d = options.driver ?? driver());
    d.init();
    this.#device = d.device(this.deviceOrdinal);
    this.#context = d.primaryContextRetain(this.#device);
    d.setCurrentContext(this.#context);
    this.#stream = d.streamCreate();
    this.#allocator = new CachingAllocator(
      {
        alloc: (b) => d.memAlloc(b),
        free: (p) => d.memFree(p),
        synchronize: () => d.streamSynchronize(this.#stream),
      },
      this.name,
    );
    this.#host = d.memAllocHost(hostBlockBytes);
    const host = hostBytes(this.#host, hostBlockBytes);
    this.#args = new DataView(host, argValuesOffset, 8 * kernelArgsMax);
    this.#result = new DataView(host, resultOffset, 8);
    // the pointer array never changes: slot i always points at argument value i
    const pointers = new DataView(host, argPointersOffset, 8 * kernelArgsMax);
    for (let i = 0; i < kernelArgsMax; i++)
      pointers.setBigUint64(8 * i, BigInt(this.#host + argValuesOffset + 8 * i), true);
    this.#scratch = this.#allocator.alloc(scratchBytes).ptr;
    for (const [module, path] of Object.entries(ensurePtx())) {
      this.#modules.set(module, d.moduleLoadPtx(readFileSync(path, "utf8"), module));
    }
    // the op methods (OpMethods), each running its plan; one with a result reads it back from
    // scratch (which waits for the stream), unless the caller checked its ids on the host
    const self = this as unknown as Record<string, unknown>;
    for (const [name, d] of Object.entries(ops) as [OpName, OpDecl][]) {
      if (routedOps.has(name)) continue; // methods of the class, below
      const plan = plans[name] as (...args: unknown[]) => Launch[];
      const n = d.args.length;
      self[name] =
        d.result === "void"
          ? planTakesScratch(d)
            ? (...args: unknown[]) => this.#run(plan(this.#scratch, ...args))
            : (...args: unknown[]) => this.#run(plan(...args))
          : (...args: unknown[]) => {
              this.#run(plan(this.#scratch, ...args));
              return d.inRange === true && args[n] === true ? 0 : this.#readResult(d.result as "i64" | "f64");
            };
    }
    this.#attention = new AttentionRouter(
      options.attention ?? "auto",
      {
        alloc: (bytes) => this.#allocator.alloc(bytes).ptr,
        free: (p) => this.#allocator.free(p),
        run: (launches) => this.#run(launches),
        stream: this.#stream,
      },
      options.cudnnPath,
    );
  }

  // ---- attention: cuDNN's fused graphs or the kernels (attention-path.ts) -------------------

  // Each takes its op's arguments (OpMethods), which its plans take too. cuDNN runs the call where
  // the router says so; else the tensor-core kernels (flash.cu) or the f32 ones (attention.cu).
  attentionForward: OpMethods["attentionForward"] = (...args) => {
    const [out, lse, qkv, B, T, C, H, scale, elem] = args;
    const call = { B, T, C, H, scale, elem };
    if (this.#attention.forward(out, lse, qkv, call)) return;
    this.#run(this.#attentionPlans(call).attentionForward(...args));
  };

  attentionBackward: OpMethods["attentionBackward"] = (...args) => {
    // args[1], delta, is the kernels' scratch: cuDNN keeps its own
    const [dqkv, , dout, out, lse, qkv, B, T, C, H, scale, elem, accumulate] = args;
    const call = { B, T, C, H, scale, elem };
    if (this.#attention.backward(dqkv, dout, out, lse, qkv, call, accumulate)) return;
    this.#run(this.#attentionPlans(call).attentionBackward(...args));
  };

  #attentionPlans(call: AttentionCall): Pick<Plans, "attentionForward" | "attentionBackward"> {
    return this.#attention.usesKernel(call) ? flashPlans : plans;
  }

  describeAttention(elem: ElemType): string {
    return this.#attention.describe(elem);
  }

  get stats() {
    return this.#ledger.stats;
  }

  /** Work queued on the stream since the backend was made: kernel launches, cuBLAS GEMMs and
   *  cuDNN executions (the bench divides by steps). */
  get launchCounts(): { kernels: number; gemms: number; cudnn: number } {
    return { kernels: this.#kernelLaunches, gemms: this.#gemmCalls, cudnn: this.#attention.executions };
  }

  get allocatorStats(): CachingAllocatorStats {
    return this.#allocator.stats;
  }

  get deviceName(): string {
    return this.#d.deviceName(this.#device);
  }

  /** The GPU's UUID ("GPU-…"): ranks on one host compare them to tell whether they share a GPU. */
  get deviceUuid(): string {
    return this.#d.deviceUuid(this.#device);
  }

  /** The device's memory clock (kHz) and bus width (bits), as the driver reports them (0 where
   *  it does not): their product is the peak memory bandwidth (bench/step-cost.ts). */
  get memoryInterface(): { clockKHz: number; busWidthBits: number } {
    const attribute = (a: number) => {
      try {
        return this.#d.deviceAttribute(this.#device, a);
      } catch {
        return 0; // a driver that no longer reports it
      }
    };
    return {
      clockKHz: attribute(CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE),
      busWidthBits: attribute(CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH),
    };
  }

  /**
   * Queues a kernel that keeps the stream busy for `ms` (one thread watching the GPU's timer):
   * what is queued behind it runs back to back, with no wait on the host. Returns timing events
   * recorded after the hold and after the work `queue` adds; elapsedMs of the pair is the GPU's
   * own time for that work. The host must finish queuing within the hold (hostMs says how long it took).
   */
  timeQueued(ms: number, queue: () => void): { gpuMs: number; hostMs: number } {
    const d = this.#d;
    const [start, end] = [d.eventCreate(0), d.eventCreate(0)];
    try {
      this.#launch({
        kernel: "mt_hold_ns",
        grid: [1, 1, 1],
        block: [32, 1, 1],
        sharedBytes: 0,
        args: [Math.round(ms * 1e6)],
      });
      d.eventRecord(start, this.#stream);
      const t = performance.now();
      queue();
      const hostMs = performance.now() - t;
      d.eventRecord(end, this.#stream);
      d.eventSynchronize(end);
      return { gpuMs: d.eventElapsedMs(start, end), hostMs };
    } finally {
      d.eventDestroy(start);
      d.eventDestroy(end);
    }
  }

  /** the stream every operation runs on (for NCCL collectives that must join it) */
  get stream(): bigint {
    return this.#stream;
  }

  /** A stream beside the compute stream, for work that overlaps it (NCCL's collectives while
   *  backward goes on), ordered against it by events on the GPU. Destroyed with the backend. */
  sideStream(): SideStream {
    this.#checkUsable();
    const side = new SideStream(this.#d, this.#stream);
    this.#sideStreams.push(side);
    return side;
  }

  /** Waits for a side stream's work and frees it (a job's end; the backend serves the next). */
  closeSideStream(side: SideStream): void {
    const i = this.#sideStreams.indexOf(side);
    if (i < 0) return;
    this.#sideStreams.splice(i, 1);
    side.destroy();
  }

  // ---- memory -----------------------------------------------------------------------------

  alloc(bytes: number): Allocation {
    this.#checkUsable();
    const block = this.#allocator.alloc(bytes);
    // the engine expects zeroed memory from alloc (the CPU backend's mt_alloc zeroes too)
    if (block.bytes > 0) this.#d.memsetD8Async(block.ptr, 0, block.bytes, this.#stream);
    return this.#ledger.add(block.ptr, bytes);
  }

  free(allocation: Allocation): void {
    this.#ledger.remove(allocation);
    this.#allocator.free(allocation.ptr);
  }

  /** Give cached device memory back to the driver. */
  emptyCache(): void {
    this.#allocator.emptyCache();
  }

  upload(dst: Ptr, src: ArrayBufferView): void {
    const bytes = src.byteLength;
    if (bytes === 0) return;
    const stage = this.#stagingFor(bytes);
    stage.view.set(new Uint8Array(src.buffer, src.byteOffset, bytes));
    this.#d.copyHtoDAsync(dst, stage.ptr, bytes, this.#stream);
    stage.event ??= this.#d.eventCreate(CU_EVENT_DISABLE_TIMING);
    this.#d.eventRecord(stage.event, this.#stream);
  }

  download(src: Ptr, dst: ArrayBufferView): void {
    const bytes = dst.byteLength;
    if (bytes === 0) return;
    const stage = this.#stagingFor(bytes);
    this.#d.copyDtoHAsync(stage.ptr, src, bytes, this.#stream);
    this.#d.streamSynchronize(this.#stream);
    new Uint8Array(dst.buffer, dst.byteOffset, bytes).set(stage.view.subarray(0, bytes));
  }

  copy(dst: Ptr, src: Ptr, bytes: number): void {
    if (bytes > 0) this.#d.copyDtoDAsync(dst, src, bytes, this.#stream);
  }

  zero(dst: Ptr, bytes: number): void {
    if (bytes > 0) this.#d.memsetD8Async(dst, 0, bytes, this.#stream);
  }

  fill(dst: Ptr, n: number, value: number): void {
    if (n > 0) this.#d.memsetD32Async(dst, f32Bits(value), n, this.#stream);
  }

  synchronize(): void {
    this.#d.streamSynchronize(this.#stream);
  }

  /** Resolves when all queued work has finished, polling an event: the event loop stays free. */
  async whenIdle(pollMs = 1): Promise<void> {
    const event = this.#d.eventCreate(CU_EVENT_DISABLE_TIMING);
    try {
      this.#d.eventRecord(event, this.#stream);
      while (!this.#d.eventDone(event)) await Bun.sleep(pollMs);
    } finally {
      this.#d.eventDestroy(event);
    }
  }

  // ---- GEMM (cuBLAS) ----------------------------------------------------------------------

  gemm(desc: GemmDesc): void {
    const g = gemmCall(desc);
    if (g.epilogue != null && this.#fusedGemm(g)) return;
    // the dgelu epilogue's product: a block of the caching allocator, back to it once queued
    // work is ordered on the one stream
    let product: Ptr = 0;
    gemmThenKernels(
      this,
      g,
      (plain) => {
        if (plain.M === 0 || plain.N === 0 || plain.batch === 0) return;
        this.#gemmCalls++;
        this.#cublas().gemm(plain);
      },
      (bytes) => {
        product = this.#allocator.alloc(bytes).ptr;
        return product;
      },
    );
    if (product !== 0) this.#allocator.free(product);
  }

  /** How a linear layer's epilogues run: fused by cuBLASLt, or the kernels and why. */
  describeEpilogues(): string {
    if (this.#epilogues === "kernels") return "bias, GELU, their gradients as kernels after the GEMM, as asked";
    const lt = this.#cublasLt();
    if (lt === null) return `bias, GELU, their gradients as kernels after the GEMM: ${this.#lt}`;
    const fallbacks = [...this.#epilogueFallbacks];
    const fused = `bias, GELU, their gradients fused into the GEMM (cuBLASLt ${lt.version()})`;
    return fallbacks.length === 0 ? fused : `${fused}; as kernels where ${fallbacks.join("; ")}`;
  }

  /** g's GEMM and epilogue as one cuBLASLt call; false (nothing queued) where it has none. */
  #fusedGemm(g: Required<GemmDesc>): boolean {
    const ep = g.epilogue!;
    if (this.#epilogues === "kernels" || g.M === 0 || g.N === 0 || g.K === 0) return false;
    const lt = this.#cublasLt();
    if (lt === null) return false;
    const { dtype, compute } = inputTypes[g.input];
    const call = {
      ...rowMajorGemm(g.transA, g.transB, g.M, g.N, g.K, g.A, g.lda, 0, g.B, g.ldb, 0, g.C, g.ldc, 0),
      abType: dtype,
      cType: outputTypes[g.output],
      compute,
      alpha: g.alpha,
      beta: g.beta,
    };
    // cuBLASLt writes the bias gradient; the layer adds it into dbias (its gradient accumulates)
    const sums = ep.kind === "biasGrad" ? this.#allocator.alloc(4 * g.M).ptr : 0;
    const plan = lt.plan(call, ep, sums);
    if (typeof plan === "string") {
      if (sums !== 0) this.#allocator.free(sums);
      this.#epilogueFallbacks.add(plan);
      return false;
    }
    this.#gemmCalls++;
    if (ep.kind === "biasGrad") {
      lt.run(plan, call, ep, sums);
      this.axpy(ep.dbias, sums, g.M, 1);
      this.#allocator.free(sums);
    } else if (g.output === "f32" || ep.kind === "dgelu") {
      lt.run(plan, call, ep);
    } else if (ep.biasCopy !== undefined) {
      // a 2-byte output takes its bias in its own type: the caller's copy
      lt.run(plan, call, { ...ep, bias: ep.biasCopy });
    } else {
      // ... or rounded here, as autocast rounds it
      const bias = this.#allocator.alloc(2 * g.N).ptr;
      if (g.output === "bf16") this.castF32ToBF16(bias, ep.bias, g.N);
      else this.castF32ToF16(bias, ep.bias, g.N);
      lt.run(plan, call, { ...ep, bias });
      this.#allocator.free(bias);
    }
    return true;
  }

  // ---- kernels ----------------------------------------------------------------------------

  dispose(): void {
    if (this.#disposed) return;
    const d = this.#d;
    d.streamSynchronize(this.#stream);
    this.#disposed = true;
    this.#attention.dispose();
    this.#cublasHandle?.destroy();
    if (this.#lt instanceof CublasLt) this.#lt.destroy();
    for (const m of this.#modules.values()) d.moduleUnload(m);
    this.#modules.clear();
    this.#functions.clear();
    this.#allocator.releaseAll();
    this.#ledger.clear();
    for (const s of this.#staging) {
      if (s.event !== null) d.eventDestroy(s.event);
      d.memFreeHost(s.ptr);
    }
    this.#staging.length = 0;
    for (const side of this.#sideStreams) side.destroy();
    this.#sideStreams.length = 0;
    d.memFreeHost(this.#host);
    d.streamDestroy(this.#stream);
    d.primaryContextRelease(this.#device);
  }

  // ---- internals --------------------------------------------------------------------------

  #checkUsable(): void {
    if (this.#disposed) throw new Error("CudaBackend used after dispose()");
  }

  /** cuBLASLt on the backend's stream and cuBLAS's workspace, or null where it cannot load. */
  #cublasLt(): CublasLt | null {
    if (this.#lt === null) {
      this.#cublas(); // the workspace
      try {
        const lib = loadCublasLt(this.#cublasLtPath ?? findCublasLt());
        this.#lt = new CublasLt(lib, this.#stream, { ptr: this.#cublasWorkspace, bytes: cublasWorkspaceBytes });
      } catch (e) {
        this.#lt = (e as Error).message;
      }
    }
    return typeof this.#lt === "string" ? null : this.#lt;
  }

  #cublas(): Cublas {
    if (this.#cublasHandle !== null) return this.#cublasHandle;
    this.#cublasWorkspace = this.#allocator.alloc(cublasWorkspaceBytes).ptr;
    this.#cublasHandle = new Cublas(
      loadCublas(this.#cublasPath ?? findCublas()),
      this.#stream,
      new Float32Array(hostBytes(this.#host, hostBlockBytes), scalarsOffset, 2),
      this.#host + scalarsOffset,
      // the handle's own (and cuBLASLt's), for the backend's life (every GEMM runs on the one stream)
      { ptr: this.#cublasWorkspace, bytes: cublasWorkspaceBytes },
    );
    return this.#cublasHandle;
  }

  #run(launches: readonly Launch[]): void {
    for (const l of launches) this.#launch(l);
  }

  #launch(l: Launch): void {
    const params = kernelSpecs[l.kernel].params;
    this.#kernelLaunches++;
    // a wrong argument list is a programmer error in kernels.ts, never an operating error
    if (l.args.length !== params.length)
      throw new Error(`${l.kernel}: ${l.args.length} arguments for ${params.length} parameters`);
    const v = this.#args;
    for (let i = 0; i < params.length; i++) {
      const a = l.args[i]!;
      switch (params[i]) {
        case "f32":
          v.setFloat32(8 * i, a as number, true);
          break;
        case "i32":
          v.setInt32(8 * i, a as number, true);
          break;
        case "u64":
          v.setBigUint64(8 * i, a as bigint, true);
          break;
        default:
          v.setBigInt64(8 * i, BigInt(a), true); // ptr, i64
      }
    }
    this.#d.launch(
      this.#function(l.kernel),
      l.kernel,
      l.grid,
      l.block,
      l.sharedBytes,
      this.#stream,
      this.#host + argPointersOffset,
    );
  }

  #function(kernel: KernelName): bigint {
    let fn = this.#functions.get(kernel);
    if (fn === undefined) {
      const module = this.#modules.get(kernelSpecs[kernel].module);
      if (module === undefined) throw new Error(`${kernel}: module ${kernelSpecs[kernel].module} was not loaded`);
      fn = this.#d.moduleFunction(module, kernel);
      this.#functions.set(kernel, fn);
    }
    return fn;
  }

  /** Copy the 8-byte result a plan left at scratch[0] to the host (synchronizes). */
  #readResult(kind: "i64" | "f64"): number {
    this.#d.copyDtoHAsync(this.#host + resultOffset, this.#scratch, 8, this.#stream);
    this.#d.streamSynchronize(this.#stream);
    return kind === "f64" ? this.#result.getFloat64(0, true) : Number(this.#result.getBigInt64(0, true));
  }

  /** A pinned staging buffer of at least `bytes`, free for reuse (its last copy has finished). */
  #stagingFor(bytes: number): Staging {
    const index = this.#stagingNext;
    this.#stagingNext = (index + 1) % 2;
    let stage = this.#staging[index];
    if (stage?.event != null) this.#d.eventSynchronize(stage.event);
    if (stage === undefined || stage.bytes < bytes) {
      if (stage !== undefined) this.#d.memFreeHost(stage.ptr);
      const size = Math.max(bytes, stagingBytesMin, stage?.bytes ?? 0);
      const ptr = this.#d.memAllocHost(size);
      stage = { ptr, bytes: size, view: new Uint8Array(hostBytes(ptr, size)), event: stage?.event ?? null };
      this.#staging[index] = stage;
    }
    return stage;
  }
}

/** Ops whose method chooses among implementations instead of running one plan. */
const routedOps: ReadonlySet<OpName> = new Set(["attentionForward", "attentionBackward"]);

const bitsView = new DataView(new ArrayBuffer(4));
function f32Bits(value: number): number {
  bitsView.setFloat32(0, value, true);
  return bitsView.getUint32(0, true);
}

/**
 * A second stream and the two events that order it against the compute stream without the host
 * waiting: afterCompute() before queuing work that reads what compute wrote (a bucket's
 * gradients), joinCompute() before compute reads what the side stream wrote (the reduced bucket).
 */
export class SideStream {
  readonly stream: bigint;
  readonly #d: Driver;
  readonly #main: bigint;
  readonly #toSide: bigint;
  readonly #toMain: bigint;
  #destroyed = false;

  constructor(d: Driver, main: bigint) {
    this.#d = d;
    this.#main = main;
    this.stream = d.streamCreate();
    this.#toSide = d.eventCreate();
    this.#toMain = d.eventCreate();
  }

  /** Work queued on the side stream from now on runs after everything queued on compute so far. */
  afterCompute(): void {
    this.#d.eventRecord(this.#toSide, this.#main);
    this.#d.streamWaitEvent(this.stream, this.#toSide);
  }

  /** Work queued on compute from now on runs after everything queued on the side stream so far. */
  joinCompute(): void {
    this.#d.eventRecord(this.#toMain, this.stream);
    this.#d.streamWaitEvent(this.#main, this.#toMain);
  }

  /** Whether the side stream's work up to the last joinCompute() has finished (never blocks: a
   *  caller polls it and keeps its event loop free, where a synchronize would block it). */
  drained(): boolean {
    return this.#d.eventDone(this.#toMain);
  }

  /** @internal the backend's dispose(): waits for the side stream, then frees it */
  destroy(): void {
    if (this.#destroyed) return;
    this.#destroyed = true;
    this.#d.streamSynchronize(this.stream);
    this.#d.eventDestroy(this.#toSide);
    this.#d.eventDestroy(this.#toMain);
    this.#d.streamDestroy(this.stream);
  }
}
