// The CUDA driver API (libcuda.so.1) through bun:ffi: init, the primary context, streams,
// events, device and pinned host memory, async copies, modules and kernel launches.
//
// Symbol names are the ABI names the headers' macros expand to (cuMemAlloc -> cuMemAlloc_v2,
// cuStreamDestroy -> cuStreamDestroy_v2, ...): calling the unversioned legacy symbol of a
// function that has a _v2 is silently wrong on 64-bit sizes. We call the non-per-thread
// (legacy) names and always pass our own stream, so default-stream semantics never matter.
//
// Every call's CUresult is checked; a failure becomes a CudaError carrying CUDA's own name
// for the code (cuGetErrorName) and the call that failed. No CUDA thread ever calls into
// JavaScript: we register no callbacks; completion is observed by polling events or by
// blocking synchronize calls.
import { CString, dlopen, FFIType, ptr as addressOf, type Pointer, toArrayBuffer } from "bun:ffi";
import { existsSync } from "node:fs";
import type { Ptr } from "../backend.ts";
import { NativeLibraryError } from "../errors.ts";

/** A CUresult other than CUDA_SUCCESS. */
export class CudaError extends Error {
  override readonly name = "CudaError";
  constructor(
    readonly call: string,
    readonly code: number,
    /** CUDA's name for the code, e.g. CUDA_ERROR_OUT_OF_MEMORY */
    readonly codeName: string,
    detail: string,
  ) {
    super(`${call} failed: ${codeName} (${code})${detail === "" ? "" : `: ${detail}`}`);
  }
}

export const CUDA_SUCCESS = 0;
export const CUDA_ERROR_OUT_OF_MEMORY = 2;
export const CUDA_ERROR_NO_DEVICE = 100;
export const CUDA_ERROR_NOT_READY = 600;

const CUDA_ERROR_INVALID_PTX = 218;
const CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222;

/**
 * Why a driver refuses PTX it cannot JIT, and the fix: the usual cause is an nvcc newer than the
 * driver (CUDA 13's nvcc writes PTX ISA 9.0, which a CUDA 12 driver does not read). Names the
 * PTX's ISA version and target and the driver's CUDA version. Empty for other errors.
 */
export function ptxRejectedHint(code: number, ptx: string, driverVersion: () => number): string {
  if (code !== CUDA_ERROR_UNSUPPORTED_PTX_VERSION && code !== CUDA_ERROR_INVALID_PTX) return "";
  const isa = /^\s*\.version\s+(\S+)/m.exec(ptx)?.[1] ?? "unknown";
  const target = /^\s*\.target\s+(\S+)/m.exec(ptx)?.[1] ?? "unknown";
  let driver = "an unknown CUDA version";
  try {
    driver = `CUDA ${cudaVersionText(driverVersion())}`;
  } catch {
    // keep "unknown": the hint must not hide the load error
  }
  // 222 says the ISA is too new; 218 is any JIT failure, of which that is only the usual cause
  const fix =
    "update the NVIDIA driver, or rebuild the kernels with an nvcc no newer than the driver " +
    "(MESHTRAIN_NVCC=/path/to/nvcc bun ffi/cuda/build.ts)";
  return (
    `the PTX is ISA ${isa} for ${target} and this driver supports ${driver}; ` +
    (code === CUDA_ERROR_UNSUPPORTED_PTX_VERSION ? fix : `if the nvcc that wrote it is newer than the driver, ${fix}`)
  );
}

/** cuDriverGetVersion's 13000 as "13.0" */
export const cudaVersionText = (v: number): string => `${Math.floor(v / 1000)}.${(v % 1000) / 10}`;

// A few names, for when cuGetErrorName itself is unavailable (the library failed half-way).
const fallbackNames: Record<number, string> = {
  1: "CUDA_ERROR_INVALID_VALUE",
  2: "CUDA_ERROR_OUT_OF_MEMORY",
  3: "CUDA_ERROR_NOT_INITIALIZED",
  34: "CUDA_ERROR_STUB_LIBRARY",
  35: "CUDA_ERROR_INSUFFICIENT_DRIVER",
  100: "CUDA_ERROR_NO_DEVICE",
  101: "CUDA_ERROR_INVALID_DEVICE",
  200: "CUDA_ERROR_INVALID_IMAGE",
  218: "CUDA_ERROR_INVALID_PTX",
  222: "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
  500: "CUDA_ERROR_NOT_FOUND",
  600: "CUDA_ERROR_NOT_READY",
  700: "CUDA_ERROR_ILLEGAL_ADDRESS",
  701: "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
  719: "CUDA_ERROR_LAUNCH_FAILED",
  999: "CUDA_ERROR_UNKNOWN",
};

export const CU_STREAM_NON_BLOCKING = 0x1;
export const CU_EVENT_DEFAULT = 0x0;
export const CU_EVENT_DISABLE_TIMING = 0x2;
export const CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16;
export const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75;
export const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76;

// All handles (CUcontext, CUstream, CUevent, CUmodule, CUfunction) and CUdeviceptr are 64-bit.
const symbols = {
  cuInit: { args: ["u32"], returns: "i32" },
  cuDriverGetVersion: { args: ["ptr"], returns: "i32" },
  cuGetErrorName: { args: ["i32", "ptr"], returns: "i32" },
  cuGetErrorString: { args: ["i32", "ptr"], returns: "i32" },
  cuDeviceGetCount: { args: ["ptr"], returns: "i32" },
  cuDeviceGet: { args: ["ptr", "i32"], returns: "i32" },
  cuDeviceGetName: { args: ["ptr", "i32", "i32"], returns: "i32" },
  cuDeviceGetAttribute: { args: ["ptr", "i32", "i32"], returns: "i32" },
  cuDeviceGetUuid: { args: ["ptr", "i32"], returns: "i32" },
  cuDeviceTotalMem_v2: { args: ["ptr", "i32"], returns: "i32" },
  cuDevicePrimaryCtxRetain: { args: ["ptr", "i32"], returns: "i32" },
  cuDevicePrimaryCtxRelease_v2: { args: ["i32"], returns: "i32" },
  cuCtxSetCurrent: { args: ["u64"], returns: "i32" },
  cuCtxSynchronize: { args: [], returns: "i32" },
  cuStreamCreate: { args: ["ptr", "u32"], returns: "i32" },
  cuStreamDestroy_v2: { args: ["u64"], returns: "i32" },
  cuStreamSynchronize: { args: ["u64"], returns: "i32" },
  cuStreamQuery: { args: ["u64"], returns: "i32" },
  cuStreamWaitEvent: { args: ["u64", "u64", "u32"], returns: "i32" },
  cuEventCreate: { args: ["ptr", "u32"], returns: "i32" },
  cuEventRecord: { args: ["u64", "u64"], returns: "i32" },
  cuEventQuery: { args: ["u64"], returns: "i32" },
  cuEventSynchronize: { args: ["u64"], returns: "i32" },
  cuEventElapsedTime: { args: ["ptr", "u64", "u64"], returns: "i32" },
  cuEventDestroy_v2: { args: ["u64"], returns: "i32" },
  cuMemAlloc_v2: { args: ["ptr", "u64"], returns: "i32" },
  cuMemFree_v2: { args: ["u64"], returns: "i32" },
  cuMemAllocHost_v2: { args: ["ptr", "u64"], returns: "i32" },
  cuMemFreeHost: { args: ["u64"], returns: "i32" },
  cuMemGetInfo_v2: { args: ["ptr", "ptr"], returns: "i32" },
  cuMemcpyHtoDAsync_v2: { args: ["u64", "u64", "u64", "u64"], returns: "i32" },
  cuMemcpyDtoHAsync_v2: { args: ["u64", "u64", "u64", "u64"], returns: "i32" },
  cuMemcpyDtoDAsync_v2: { args: ["u64", "u64", "u64", "u64"], returns: "i32" },
  cuMemsetD8Async: { args: ["u64", "u8", "u64", "u64"], returns: "i32" },
  cuMemsetD32Async: { args: ["u64", "u32", "u64", "u64"], returns: "i32" },
  cuModuleLoadData: { args: ["ptr", "ptr"], returns: "i32" },
  cuModuleGetFunction: { args: ["ptr", "u64", "ptr"], returns: "i32" },
  cuModuleUnload: { args: ["u64"], returns: "i32" },
  cuLaunchKernel: {
    args: ["u64", "u32", "u32", "u32", "u32", "u32", "u32", "u32", "u64", "u64", "u64"],
    returns: "i32",
  },
} as const;

type DriverLib = ReturnType<typeof dlopen<typeof symbols>>;

export const driverInstallHint =
  "install the NVIDIA driver (it provides libcuda.so.1), or set MESHTRAIN_LIBCUDA to its path";

const libcudaCandidates = [
  "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
  "/usr/lib/aarch64-linux-gnu/libcuda.so.1",
  "/usr/lib64/libcuda.so.1",
  "/usr/local/nvidia/lib64/libcuda.so.1",
  "/usr/lib/wsl/lib/libcuda.so.1",
];

/** The libcuda path to load: MESHTRAIN_LIBCUDA, a standard location, or the bare soname for
 *  the dynamic loader's own search (LD_LIBRARY_PATH, ld.so.cache). */
export function libcudaPath(): string {
  const override = process.env.MESHTRAIN_LIBCUDA;
  if (override !== undefined && override !== "") return override;
  return libcudaCandidates.find((p) => existsSync(p)) ?? "libcuda.so.1";
}

/** The loaded driver library with checked calls. One per process; see driver(). */
export class Driver {
  readonly lib: DriverLib;
  readonly path: string;
  // out-parameters: JS memory is fine here because each call is synchronous and the array is
  // referenced for its whole duration
  readonly #out64 = new BigUint64Array(2);
  readonly #out32 = new Int32Array(2);
  readonly #outF32 = new Float32Array(1);

  constructor(path: string) {
    this.path = path;
    try {
      this.lib = dlopen(path, symbols);
    } catch (e) {
      throw new NativeLibraryError(
        `cannot load the CUDA driver library ${path}: ${(e as Error).message}; ${driverInstallHint}`,
        { cause: e },
      );
    }
  }

  /** CUDA's name for a result code. */
  errorName(code: number): string {
    const out = this.#out64;
    if (this.lib.symbols.cuGetErrorName(code, addressOf(out)) !== CUDA_SUCCESS || out[0] === 0n) {
      return fallbackNames[code] ?? `CUresult ${code}`;
    }
    return new CString(Number(out[0]) as Pointer).toString();
  }

  errorString(code: number): string {
    const out = this.#out64;
    if (this.lib.symbols.cuGetErrorString(code, addressOf(out)) !== CUDA_SUCCESS || out[0] === 0n) return "";
    return new CString(Number(out[0]) as Pointer).toString();
  }

  /** Throw a CudaError unless code is CUDA_SUCCESS. */
  check(call: string, code: number): void {
    if (code !== CUDA_SUCCESS) throw new CudaError(call, code, this.errorName(code), this.errorString(code));
  }

  init(): void {
    this.check("cuInit", this.lib.symbols.cuInit(0));
  }

  driverVersion(): number {
    this.check("cuDriverGetVersion", this.lib.symbols.cuDriverGetVersion(addressOf(this.#out32)));
    return this.#out32[0]!;
  }

  deviceCount(): number {
    this.check("cuDeviceGetCount", this.lib.symbols.cuDeviceGetCount(addressOf(this.#out32)));
    return this.#out32[0]!;
  }

  /** CUdevice handle of ordinal `ordinal` */
  device(ordinal: number): number {
    this.check("cuDeviceGet", this.lib.symbols.cuDeviceGet(addressOf(this.#out32), ordinal));
    return this.#out32[0]!;
  }

  deviceName(device: number): string {
    const buf = new Uint8Array(256);
    this.check("cuDeviceGetName", this.lib.symbols.cuDeviceGetName(addressOf(buf), buf.length, device));
    const end = buf.indexOf(0);
    return new TextDecoder().decode(buf.subarray(0, end < 0 ? buf.length : end));
  }

  /** The GPU's UUID as nvidia-smi prints it ("GPU-" and 32 hex digits in 8-4-4-4-12 groups):
   *  the same GPU under any CUDA_VISIBLE_DEVICES numbering, so ranks can tell whether they share one. */
  deviceUuid(device: number): string {
    const out = new Uint8Array(16);
    this.check("cuDeviceGetUuid", this.lib.symbols.cuDeviceGetUuid(addressOf(out), device));
    const hex = Buffer.from(out).toString("hex");
    return `GPU-${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
  }

  deviceAttribute(device: number, attribute: number): number {
    this.check(
      "cuDeviceGetAttribute",
      this.lib.symbols.cuDeviceGetAttribute(addressOf(this.#out32), attribute, device),
    );
    return this.#out32[0]!;
  }

  deviceTotalBytes(device: number): number {
    this.check("cuDeviceTotalMem_v2", this.lib.symbols.cuDeviceTotalMem_v2(addressOf(this.#out64), device));
    return Number(this.#out64[0]);
  }

  /** Retain the device's primary context (the one the runtime API, cuBLAS and NCCL share). */
  primaryContextRetain(device: number): bigint {
    this.check("cuDevicePrimaryCtxRetain", this.lib.symbols.cuDevicePrimaryCtxRetain(addressOf(this.#out64), device));
    return this.#out64[0]!;
  }

  primaryContextRelease(device: number): void {
    this.check("cuDevicePrimaryCtxRelease_v2", this.lib.symbols.cuDevicePrimaryCtxRelease_v2(device));
  }

  setCurrentContext(ctx: bigint): void {
    this.check("cuCtxSetCurrent", this.lib.symbols.cuCtxSetCurrent(ctx));
  }

  contextSynchronize(): void {
    this.check("cuCtxSynchronize", this.lib.symbols.cuCtxSynchronize());
  }

  streamCreate(flags = CU_STREAM_NON_BLOCKING): bigint {
    this.check("cuStreamCreate", this.lib.symbols.cuStreamCreate(addressOf(this.#out64), flags));
    return this.#out64[0]!;
  }

  streamDestroy(stream: bigint): void {
    this.check("cuStreamDestroy_v2", this.lib.symbols.cuStreamDestroy_v2(stream));
  }

  streamSynchronize(stream: bigint): void {
    this.check("cuStreamSynchronize", this.lib.symbols.cuStreamSynchronize(stream));
  }

  /** true when all work on the stream has finished (never blocks) */
  streamDone(stream: bigint): boolean {
    const code = this.lib.symbols.cuStreamQuery(stream);
    if (code === CUDA_ERROR_NOT_READY) return false;
    this.check("cuStreamQuery", code);
    return true;
  }

  streamWaitEvent(stream: bigint, event: bigint): void {
    this.check("cuStreamWaitEvent", this.lib.symbols.cuStreamWaitEvent(stream, event, 0));
  }

  eventCreate(flags = CU_EVENT_DISABLE_TIMING): bigint {
    this.check("cuEventCreate", this.lib.symbols.cuEventCreate(addressOf(this.#out64), flags));
    return this.#out64[0]!;
  }

  eventRecord(event: bigint, stream: bigint): void {
    this.check("cuEventRecord", this.lib.symbols.cuEventRecord(event, stream));
  }

  /** true when the work recorded before the event has finished (never blocks) */
  eventDone(event: bigint): boolean {
    const code = this.lib.symbols.cuEventQuery(event);
    if (code === CUDA_ERROR_NOT_READY) return false;
    this.check("cuEventQuery", code);
    return true;
  }

  eventSynchronize(event: bigint): void {
    this.check("cuEventSynchronize", this.lib.symbols.cuEventSynchronize(event));
  }

  /** milliseconds between two timing events (both created with CU_EVENT_DEFAULT) */
  eventElapsedMs(start: bigint, end: bigint): number {
    this.check("cuEventElapsedTime", this.lib.symbols.cuEventElapsedTime(addressOf(this.#outF32), start, end));
    return this.#outF32[0]!;
  }

  eventDestroy(event: bigint): void {
    this.check("cuEventDestroy_v2", this.lib.symbols.cuEventDestroy_v2(event));
  }

  /** cuMemAlloc, or null when the device is out of memory (the caller may free cache and retry) */
  memAlloc(bytes: number): Ptr | null {
    const code = this.lib.symbols.cuMemAlloc_v2(addressOf(this.#out64), BigInt(bytes));
    if (code === CUDA_ERROR_OUT_OF_MEMORY) return null;
    this.check("cuMemAlloc_v2", code);
    return Number(this.#out64[0]);
  }

  memFree(ptr: Ptr): void {
    this.check("cuMemFree_v2", this.lib.symbols.cuMemFree_v2(BigInt(ptr)));
  }

  /** page-locked host memory: async copies from it overlap with compute */
  memAllocHost(bytes: number): Ptr {
    this.check("cuMemAllocHost_v2", this.lib.symbols.cuMemAllocHost_v2(addressOf(this.#out64), BigInt(bytes)));
    return Number(this.#out64[0]);
  }

  memFreeHost(ptr: Ptr): void {
    this.check("cuMemFreeHost", this.lib.symbols.cuMemFreeHost(BigInt(ptr)));
  }

  memInfo(): { freeBytes: number; totalBytes: number } {
    const free = new BigUint64Array(1);
    this.check("cuMemGetInfo_v2", this.lib.symbols.cuMemGetInfo_v2(addressOf(free), addressOf(this.#out64)));
    return { freeBytes: Number(free[0]), totalBytes: Number(this.#out64[0]) };
  }

  copyHtoDAsync(dst: Ptr, srcHost: Ptr, bytes: number, stream: bigint): void {
    this.check(
      "cuMemcpyHtoDAsync_v2",
      this.lib.symbols.cuMemcpyHtoDAsync_v2(BigInt(dst), BigInt(srcHost), BigInt(bytes), stream),
    );
  }

  copyDtoHAsync(dstHost: Ptr, src: Ptr, bytes: number, stream: bigint): void {
    this.check(
      "cuMemcpyDtoHAsync_v2",
      this.lib.symbols.cuMemcpyDtoHAsync_v2(BigInt(dstHost), BigInt(src), BigInt(bytes), stream),
    );
  }

  copyDtoDAsync(dst: Ptr, src: Ptr, bytes: number, stream: bigint): void {
    this.check(
      "cuMemcpyDtoDAsync_v2",
      this.lib.symbols.cuMemcpyDtoDAsync_v2(BigInt(dst), BigInt(src), BigInt(bytes), stream),
    );
  }

  memsetD8Async(dst: Ptr, value: number, count: number, stream: bigint): void {
    this.check("cuMemsetD8Async", this.lib.symbols.cuMemsetD8Async(BigInt(dst), value, BigInt(count), stream));
  }

  memsetD32Async(dst: Ptr, bits: number, count: number, stream: bigint): void {
    this.check("cuMemsetD32Async", this.lib.symbols.cuMemsetD32Async(BigInt(dst), bits >>> 0, BigInt(count), stream));
  }

  /** Load a module from PTX text (JIT-compiled by the driver for this device). */
  moduleLoadPtx(ptx: string, name: string): bigint {
    const image = Buffer.from(`${ptx}\0`, "utf8");
    const code = this.lib.symbols.cuModuleLoadData(addressOf(this.#out64), addressOf(image));
    if (code !== CUDA_SUCCESS) {
      const detail = [this.errorString(code), ptxRejectedHint(code, ptx, () => this.driverVersion())].filter(
        (s) => s !== "",
      );
      throw new CudaError(`cuModuleLoadData(${name}.ptx)`, code, this.errorName(code), detail.join("; "));
    }
    return this.#out64[0]!;
  }

  moduleFunction(module: bigint, name: string): bigint {
    const cname = Buffer.from(`${name}\0`, "utf8");
    this.check(
      `cuModuleGetFunction(${name})`,
      this.lib.symbols.cuModuleGetFunction(addressOf(this.#out64), module, addressOf(cname)),
    );
    return this.#out64[0]!;
  }

  moduleUnload(module: bigint): void {
    this.check("cuModuleUnload", this.lib.symbols.cuModuleUnload(module));
  }

  /** kernelParams: the address of an array of pointers to each argument's value */
  launch(
    fn: bigint,
    name: string,
    grid: readonly [number, number, number],
    block: readonly [number, number, number],
    sharedBytes: number,
    stream: bigint,
    kernelParams: Ptr,
  ): void {
    const code = this.lib.symbols.cuLaunchKernel(
      fn,
      grid[0],
      grid[1],
      grid[2],
      block[0],
      block[1],
      block[2],
      sharedBytes,
      stream,
      BigInt(kernelParams),
      0n,
    );
    if (code !== CUDA_SUCCESS) this.check(`cuLaunchKernel(${name})`, code);
  }
}

/** A byte view of native host memory (pinned buffers): writes go straight to it. */
export function hostBytes(ptr: Ptr, bytes: number): ArrayBuffer {
  return toArrayBuffer(ptr as Pointer, 0, bytes);
}

export { FFIType };

let loaded: Driver | undefined;
let loadError: Error | undefined;

/** The process-wide driver, loaded and cuInit-ed once. Throws NativeLibraryError or CudaError. */
export function driver(): Driver {
  if (loaded !== undefined) return loaded;
  if (loadError !== undefined) throw loadError;
  try {
    const d = new Driver(libcudaPath());
    d.init();
    loaded = d;
    return d;
  } catch (e) {
    loadError = e as Error;
    throw e;
  }
}

export interface CudaProbe {
  ok: boolean;
  /** devices the driver reports (0 when not ok) */
  deviceCount: number;
  /** what was found ("NVIDIA H100 80GB HBM3, compute 9.0, driver 13.0") or why not */
  reason: string;
  /** device 0's memory in bytes (when ok) */
  totalBytes?: number;
}

/** Is there a usable CUDA driver and device? Never throws. `load` gives the driver (tests
 *  pass one over another library). */
export function probeCuda(load: () => Driver = driver): CudaProbe {
  try {
    const d = load();
    const count = d.deviceCount();
    if (count === 0) return { ok: false, deviceCount: 0, reason: "the CUDA driver reports no device" };
    const dev = d.device(0);
    const major = d.deviceAttribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR);
    const minor = d.deviceAttribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR);
    const v = d.driverVersion();
    const plural = count === 1 ? "" : ` (device 0 of ${count})`;
    return {
      ok: true,
      deviceCount: count,
      reason: `${d.deviceName(dev)}${plural}, compute ${major}.${minor}, driver ${cudaVersionText(v)}`,
      totalBytes: d.deviceTotalBytes(dev),
    };
  } catch (e) {
    if (e instanceof CudaError && e.code === CUDA_ERROR_NO_DEVICE)
      return { ok: false, deviceCount: 0, reason: "the CUDA driver finds no device (CUDA_ERROR_NO_DEVICE)" };
    if (e instanceof NativeLibraryError)
      return { ok: false, deviceCount: 0, reason: `no CUDA driver (libcuda.so.1 not loadable: ${driverInstallHint})` };
    return { ok: false, deviceCount: 0, reason: (e as Error).message };
  }
}
