// cuDNN's backend C API through bun:ffi, for one thing: fused causal attention on tensor cores
// (the graphs of ffi/cuda/sdpa-graph.ts). Descriptors are made and finalized here
// (cudnnBackendCreateDescriptor / SetAttribute / Finalize), the heuristics' engine configs are
// tried in order until one makes an execution plan, and a plan is built once per shape and kept
// (building one compiles kernels at run time: about a second). Execution binds the caller's
// device pointers to the graph's tensors by unique id and runs on the backend's stream.
//
// The library is found as cuBLAS is: MESHTRAIN_CUDNN, the loader's folders, then NVIDIA's pip
// wheels (<site-packages>/nvidia/cudnn/lib/libcudnn.so.9, which loads libcudnn_graph and the
// engine libraries beside it).
//
// Attribute element types, as the backend API reads them: enums (data type, pointwise mode,
// reduction operator, heuristics mode) are int32; BOOLEAN is a C++ bool (1 byte); INT64, DOUBLE,
// VOID_PTR, HANDLE and BACKEND_DESCRIPTOR are 8 bytes; FLOAT is 4.
import { MeshtrainError } from "../errors.ts";
import { dlopen, ptr as addressOf } from "bun:ffi";
import type { Ptr } from "../backend.ts";
import { NativeLibraryError } from "../errors.ts";
import { tryFindLibrary } from "../find-library.ts";
import {
  cudnnDataType,
  type GraphOp,
  type GraphTensor,
  pointwiseModes,
  reductionModes,
  type SdpaGraph,
} from "./sdpa-graph.ts";

/** A cudnnStatus_t other than CUDNN_STATUS_SUCCESS. */
export class CudnnError extends Error {
  override readonly name = "CudnnError";
  constructor(
    readonly call: string,
    readonly status: number,
    readonly statusName: string,
    detail: string,
  ) {
    super(`${call} failed: ${statusName} (${status})${detail === "" ? "" : `: ${detail}`}`);
  }
}

/** cuDNN has no engine for a graph on this GPU (or with these sizes): a caller may fall back. */
export class CudnnUnsupportedError extends MeshtrainError {
  override readonly name = "CudnnUnsupportedError";
}

const symbols = {
  cudnnGetVersion: { args: [], returns: "u64" },
  cudnnGetLastErrorString: { args: ["ptr", "u64"], returns: "void" },
  cudnnCreate: { args: ["ptr"], returns: "i32" },
  cudnnDestroy: { args: ["u64"], returns: "i32" },
  cudnnSetStream: { args: ["u64", "u64"], returns: "i32" },
  cudnnBackendCreateDescriptor: { args: ["i32", "ptr"], returns: "i32" },
  cudnnBackendDestroyDescriptor: { args: ["u64"], returns: "i32" },
  cudnnBackendFinalize: { args: ["u64"], returns: "i32" },
  // descriptor, attribute name, attribute type, element count, elements
  cudnnBackendSetAttribute: { args: ["u64", "i32", "i32", "i64", "ptr"], returns: "i32" },
  // descriptor, attribute name, attribute type, requested count, *count, elements
  cudnnBackendGetAttribute: { args: ["u64", "i32", "i32", "i64", "ptr", "ptr"], returns: "i32" },
  cudnnBackendExecute: { args: ["u64", "u64", "u64"], returns: "i32" },
} as const;

/** Every cuDNN symbol the binding uses (the fake cuDNN in the tests exports each). */
export const cudnnSymbolNames = Object.keys(symbols);

export const cudnnInstallHint =
  "install cuDNN 9 (pip install nvidia-cudnn-cu13, or NVIDIA's cudnn9 package), or set MESHTRAIN_CUDNN to libcudnn.so.9";

export function findCudnn(): string | null {
  return tryFindLibrary({
    what: "cuDNN",
    envVar: "MESHTRAIN_CUDNN",
    names: ["libcudnn.so.9", "libcudnn.so"],
    pipSubdir: ["cudnn", "cu13"],
    installHint: cudnnInstallHint,
  });
}

type CudnnLib = ReturnType<typeof dlopen<typeof symbols>>;

export function loadCudnn(path: string | null = findCudnn()): CudnnLib {
  if (path === null) throw new NativeLibraryError(`cuDNN not found; ${cudnnInstallHint}`);
  try {
    return dlopen(path, symbols);
  } catch (e) {
    throw new NativeLibraryError(`cannot load cuDNN from ${path}: ${(e as Error).message}`, { cause: e });
  }
}

// ---- the backend API's numbers (cudnn_graph.h, stable across cuDNN 9) ---------------------------

/** cudnnBackendDescriptorType_t */
const descriptorTypes = {
  pointwise: 0,
  engine: 2,
  engineConfig: 3,
  engineHeuristics: 4,
  executionPlan: 5,
  operationPointwise: 13,
  operationGraph: 15,
  variantPack: 16,
  tensor: 17,
  matmul: 18,
  operationMatmul: 19,
  reduction: 21,
  operationReduction: 22,
  operationReshape: 31,
} as const;

/** cudnnBackendAttributeType_t */
const attrTypes = {
  handle: 0,
  dataType: 1,
  boolean: 2,
  int64: 3,
  float: 4,
  voidPtr: 6,
  heurMode: 8,
  pointwiseMode: 14,
  descriptor: 15,
  reductionOperator: 18,
} as const;

/** cudnnBackendAttributeName_t */
const attrs = {
  pointwiseMode: 0,
  pointwiseMathPrec: 1,
  pointwiseAxis: 9,
  heurMode: 200,
  heurGraph: 201,
  heurResults: 202,
  configEngine: 300,
  planHandle: 400,
  planConfig: 401,
  planWorkspaceSize: 402,
  opPointwiseDesc: 750,
  opPointwiseX: 751,
  opPointwiseB: 752,
  opPointwiseY: 753,
  opPointwiseAlpha1: 754,
  opPointwiseAlpha2: 755,
  opPointwiseT: 758,
  graphHandle: 800,
  graphOps: 801,
  tensorAlignment: 900,
  tensorDataType: 901,
  tensorDims: 902,
  tensorStrides: 903,
  tensorUid: 906,
  tensorVirtual: 907,
  tensorByValue: 908,
  packUids: 1000,
  packPointers: 1001,
  packWorkspace: 1003,
  engineGlobalIndex: 1301,
  matmulCompType: 1500,
  opMatmulA: 1520,
  opMatmulB: 1521,
  opMatmulC: 1522,
  opMatmulDesc: 1523,
  reductionOperator: 1600,
  reductionCompType: 1601,
  opReductionX: 1610,
  opReductionY: 1611,
  opReductionDesc: 1612,
  opReshapeX: 2200,
  opReshapeY: 2201,
} as const;

const CUDNN_HEUR_MODE_A = 3;
/** engine configs asked of the heuristics; the first that makes a plan wins */
const engineConfigsMax = 8;
/** every tensor's CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT: what tensor-core engines need, and what the
 *  caching allocator and meshtrain's layouts give (every operand offset is a multiple of 16 bytes) */
const tensorAlignmentBytes = 16;

const statusNames: Record<number, string> = {
  0: "CUDNN_STATUS_SUCCESS",
  1001: "CUDNN_STATUS_NOT_INITIALIZED",
  1002: "CUDNN_STATUS_SUBLIBRARY_VERSION_MISMATCH",
  1008: "CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED",
  2000: "CUDNN_STATUS_BAD_PARAM",
  2002: "CUDNN_STATUS_BAD_PARAM_NULL_POINTER",
  2003: "CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER",
  2004: "CUDNN_STATUS_BAD_PARAM_NOT_FINALIZED",
  2008: "CUDNN_STATUS_BAD_PARAM_SHAPE_MISMATCH",
  3000: "CUDNN_STATUS_NOT_SUPPORTED",
  3001: "CUDNN_STATUS_NOT_SUPPORTED_GRAPH_PATTERN",
  3002: "CUDNN_STATUS_NOT_SUPPORTED_SHAPE",
  3003: "CUDNN_STATUS_NOT_SUPPORTED_DATA_TYPE",
  3004: "CUDNN_STATUS_NOT_SUPPORTED_LAYOUT",
  3007: "CUDNN_STATUS_NOT_SUPPORTED_ARCH_MISMATCH",
  3009: "CUDNN_STATUS_NOT_SUPPORTED_SUBLIBRARY_UNAVAILABLE",
  4000: "CUDNN_STATUS_INTERNAL_ERROR",
  4001: "CUDNN_STATUS_INTERNAL_ERROR_COMPILATION_FAILED",
  4004: "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED",
  5000: "CUDNN_STATUS_EXECUTION_FAILED",
};

/** An execution plan and what executing it needs. */
export interface CudnnPlan {
  readonly graph: SdpaGraph;
  readonly workspaceBytes: number;
  /** the engine cuDNN chose (CUDNN_ATTR_ENGINE_GLOBAL_INDEX), for logs */
  readonly engineIndex: number;
  /** uids of the non-virtual tensors, in the variant pack's order */
  readonly uids: BigInt64Array;
  /** host copies of the by-value scalars, which the variant pack points at */
  readonly scalars: Map<number, Float32Array>;
  readonly descriptor: bigint;
}

/** One cuDNN handle on one stream. */
export class Cudnn {
  readonly #lib: CudnnLib;
  readonly #handle: bigint;
  readonly version: number;
  /** every descriptor a kept plan depends on, destroyed with the handle */
  readonly #kept: bigint[] = [];
  #disposed = false;

  constructor(lib: CudnnLib, stream: bigint) {
    this.#lib = lib;
    this.version = Number(lib.symbols.cudnnGetVersion());
    const out = new BigUint64Array(1);
    this.#check("cudnnCreate", lib.symbols.cudnnCreate(addressOf(out)));
    this.#handle = out[0]!;
    this.#check("cudnnSetStream", lib.symbols.cudnnSetStream(this.#handle, stream));
  }

  /** "9.19.0" from cudnnGetVersion's 91900 */
  get versionText(): string {
    const v = this.version;
    return `${Math.floor(v / 10000)}.${Math.floor((v % 10000) / 100)}.${v % 100}`;
  }

  /** Descriptors for the graph, the heuristics' configs tried in order; CudnnUnsupportedError
   *  when no engine takes it. */
  plan(graph: SdpaGraph): CudnnPlan {
    const made: bigint[] = [];
    const track = (d: bigint) => {
      made.push(d);
      return d;
    };
    try {
      const tensors = new Map<string, bigint>();
      for (const t of graph.tensors) tensors.set(t.name, track(this.#tensor(t)));
      const ops = graph.ops.map((op) => this.#operation(op, tensors, track));
      const opGraph = track(this.#create("operationGraph"));
      this.#set(opGraph, attrs.graphHandle, attrTypes.handle, new BigUint64Array([this.#handle]));
      this.#set(opGraph, attrs.graphOps, attrTypes.descriptor, new BigUint64Array(ops));
      this.#finalize(opGraph, `the ${graph.direction} attention graph`);
      const { plan, engineIndex } = this.#bestPlan(opGraph, graph, track);
      const ws = new BigInt64Array(1);
      this.#get(plan, attrs.planWorkspaceSize, attrTypes.int64, ws);
      const io = graph.tensors.filter((t) => !t.virtual);
      const scalars = new Map<number, Float32Array>();
      for (const t of io) if (t.byValue !== undefined) scalars.set(t.uid, new Float32Array([t.byValue]));
      this.#kept.push(...made);
      return {
        graph,
        workspaceBytes: Number(ws[0]),
        engineIndex,
        uids: new BigInt64Array(io.map((t) => BigInt(t.uid))),
        scalars,
        descriptor: plan,
      };
    } catch (e) {
      for (const d of made.reverse()) this.#lib.symbols.cudnnBackendDestroyDescriptor(d);
      throw e;
    }
  }

  /** Runs a plan on the handle's stream: `buffers` gives each non-virtual, non-scalar tensor's
   *  device address by uid; `workspace` holds at least plan.workspaceBytes. */
  execute(plan: CudnnPlan, buffers: ReadonlyMap<number, Ptr>, workspace: Ptr): void {
    this.#checkUsable();
    const pointers = new BigUint64Array(plan.uids.length);
    plan.uids.forEach((uid, i) => {
      const scalar = plan.scalars.get(Number(uid));
      const p = scalar !== undefined ? addressOf(scalar) : buffers.get(Number(uid));
      // a missing buffer is a programmer error in the caller, never an operating error
      if (p === undefined) throw new Error(`cuDNN ${plan.graph.direction}: no buffer for tensor uid ${uid}`);
      pointers[i] = BigInt(p);
    });
    const pack = this.#create("variantPack");
    try {
      this.#set(pack, attrs.packUids, attrTypes.int64, plan.uids);
      this.#set(pack, attrs.packPointers, attrTypes.voidPtr, pointers);
      this.#set(pack, attrs.packWorkspace, attrTypes.voidPtr, new BigUint64Array([BigInt(workspace)]));
      this.#finalize(pack, "the variant pack");
      this.#check("cudnnBackendExecute", this.#lib.symbols.cudnnBackendExecute(this.#handle, plan.descriptor, pack));
    } finally {
      this.#lib.symbols.cudnnBackendDestroyDescriptor(pack);
    }
  }

  dispose(): void {
    if (this.#disposed) return;
    this.#disposed = true;
    for (const d of this.#kept.reverse()) this.#lib.symbols.cudnnBackendDestroyDescriptor(d);
    this.#kept.length = 0;
    this.#lib.symbols.cudnnDestroy(this.#handle);
  }

  // ---- descriptors ----------------------------------------------------------------------------

  #tensor(t: GraphTensor): bigint {
    const d = this.#create("tensor");
    this.#set(d, attrs.tensorDataType, attrTypes.dataType, new Int32Array([cudnnDataType[t.dtype]]));
    this.#set(d, attrs.tensorDims, attrTypes.int64, new BigInt64Array(t.dims.map(BigInt)));
    this.#set(d, attrs.tensorStrides, attrTypes.int64, new BigInt64Array(t.strides.map(BigInt)));
    this.#set(d, attrs.tensorUid, attrTypes.int64, new BigInt64Array([BigInt(t.uid)]));
    this.#set(d, attrs.tensorAlignment, attrTypes.int64, new BigInt64Array([BigInt(tensorAlignmentBytes)]));
    if (t.virtual) this.#set(d, attrs.tensorVirtual, attrTypes.boolean, new Uint8Array([1]));
    if (t.byValue !== undefined) this.#set(d, attrs.tensorByValue, attrTypes.boolean, new Uint8Array([1]));
    this.#finalize(d, `tensor ${t.name}`);
    return d;
  }

  #operation(op: GraphOp, tensors: ReadonlyMap<string, bigint>, track: (d: bigint) => bigint): bigint {
    const t = (name: string) => new BigUint64Array([tensors.get(name)!]);
    const float = new Int32Array([cudnnDataType.float]);
    switch (op.kind) {
      case "matmul": {
        const mm = track(this.#create("matmul"));
        this.#set(mm, attrs.matmulCompType, attrTypes.dataType, float);
        this.#finalize(mm, "a matmul");
        const d = track(this.#create("operationMatmul"));
        this.#set(d, attrs.opMatmulA, attrTypes.descriptor, t(op.a));
        this.#set(d, attrs.opMatmulB, attrTypes.descriptor, t(op.b));
        this.#set(d, attrs.opMatmulC, attrTypes.descriptor, t(op.c));
        this.#set(d, attrs.opMatmulDesc, attrTypes.descriptor, new BigUint64Array([mm]));
        this.#finalize(d, `matmul ${op.a} x ${op.b}`);
        return d;
      }
      case "pointwise": {
        const pw = track(this.#create("pointwise"));
        this.#set(pw, attrs.pointwiseMode, attrTypes.pointwiseMode, new Int32Array([pointwiseModes[op.mode]]));
        this.#set(pw, attrs.pointwiseMathPrec, attrTypes.dataType, new Int32Array([cudnnDataType[op.compute]]));
        if (op.axis !== undefined)
          this.#set(pw, attrs.pointwiseAxis, attrTypes.int64, new BigInt64Array([BigInt(op.axis)]));
        this.#finalize(pw, `pointwise ${op.mode}`);
        const d = track(this.#create("operationPointwise"));
        this.#set(d, attrs.opPointwiseDesc, attrTypes.descriptor, new BigUint64Array([pw]));
        this.#set(d, attrs.opPointwiseX, attrTypes.descriptor, t(op.x));
        if (op.b !== undefined) this.#set(d, attrs.opPointwiseB, attrTypes.descriptor, t(op.b));
        if (op.t !== undefined) this.#set(d, attrs.opPointwiseT, attrTypes.descriptor, t(op.t));
        this.#set(d, attrs.opPointwiseY, attrTypes.descriptor, t(op.y));
        this.#set(d, attrs.opPointwiseAlpha1, attrTypes.float, new Float32Array([1]));
        this.#set(d, attrs.opPointwiseAlpha2, attrTypes.float, new Float32Array([1]));
        this.#finalize(d, `pointwise ${op.mode} -> ${op.y}`);
        return d;
      }
      case "reduction": {
        const r = track(this.#create("reduction"));
        this.#set(r, attrs.reductionCompType, attrTypes.dataType, float);
        this.#set(r, attrs.reductionOperator, attrTypes.reductionOperator, new Int32Array([reductionModes[op.mode]]));
        this.#finalize(r, `reduction ${op.mode}`);
        const d = track(this.#create("operationReduction"));
        this.#set(d, attrs.opReductionDesc, attrTypes.descriptor, new BigUint64Array([r]));
        this.#set(d, attrs.opReductionX, attrTypes.descriptor, t(op.x));
        this.#set(d, attrs.opReductionY, attrTypes.descriptor, t(op.y));
        this.#finalize(d, `reduction ${op.mode} -> ${op.y}`);
        return d;
      }
      case "reshape": {
        const d = track(this.#create("operationReshape"));
        this.#set(d, attrs.opReshapeX, attrTypes.descriptor, t(op.x));
        this.#set(d, attrs.opReshapeY, attrTypes.descriptor, t(op.y));
        this.#finalize(d, `reshape ${op.x} -> ${op.y}`);
        return d;
      }
    }
  }

  /** The heuristics' configs (mode A) in order; the first that finalizes into a plan. */
  #bestPlan(opGraph: bigint, graph: SdpaGraph, track: (d: bigint) => bigint): { plan: bigint; engineIndex: number } {
    const heur = track(this.#create("engineHeuristics"));
    this.#set(heur, attrs.heurGraph, attrTypes.descriptor, new BigUint64Array([opGraph]));
    this.#set(heur, attrs.heurMode, attrTypes.heurMode, new Int32Array([CUDNN_HEUR_MODE_A]));
    this.#finalize(heur, `the heuristics for the ${graph.direction} attention graph`);
    const configs = new BigUint64Array(engineConfigsMax);
    for (let i = 0; i < engineConfigsMax; i++) configs[i] = track(this.#create("engineConfig"));
    const count = new BigInt64Array(1);
    this.#check(
      "cudnnBackendGetAttribute(ENGINEHEUR_RESULTS)",
      this.#lib.symbols.cudnnBackendGetAttribute(
        heur,
        attrs.heurResults,
        attrTypes.descriptor,
        engineConfigsMax,
        addressOf(count),
        addressOf(configs),
      ),
    );
    const reasons: string[] = [];
    for (let i = 0; i < Math.min(Number(count[0]), engineConfigsMax); i++) {
      const plan = this.#create("executionPlan");
      this.#set(plan, attrs.planHandle, attrTypes.handle, new BigUint64Array([this.#handle]));
      this.#set(plan, attrs.planConfig, attrTypes.descriptor, new BigUint64Array([configs[i]!]));
      const status = this.#lib.symbols.cudnnBackendFinalize(plan);
      if (status === 0) {
        track(plan);
        return { plan, engineIndex: this.#engineIndex(configs[i]!, track) };
      }
      reasons.push(`${statusName(status)}: ${this.#lastError()}`);
      this.#lib.symbols.cudnnBackendDestroyDescriptor(plan);
    }
    throw new CudnnUnsupportedError(
      `cuDNN ${this.versionText} has no engine for the ${graph.direction} attention graph ` +
        `(${Number(count[0])} configs from its heuristics${reasons.length === 0 ? "" : `; ${reasons.join("; ")}`})`,
    );
  }

  #engineIndex(config: bigint, track: (d: bigint) => bigint): number {
    const engine = new BigUint64Array([track(this.#create("engine"))]);
    const count = new BigInt64Array(1);
    const index = new BigInt64Array(1);
    const s = this.#lib.symbols;
    // for logs only: an engine that cannot say its index still runs
    if (
      s.cudnnBackendGetAttribute(
        config,
        attrs.configEngine,
        attrTypes.descriptor,
        1,
        addressOf(count),
        addressOf(engine),
      ) !== 0
    )
      return -1;
    if (
      s.cudnnBackendGetAttribute(
        engine[0]!,
        attrs.engineGlobalIndex,
        attrTypes.int64,
        1,
        addressOf(count),
        addressOf(index),
      ) !== 0
    )
      return -1;
    return Number(index[0]);
  }

  // ---- calls ----------------------------------------------------------------------------------

  #create(type: keyof typeof descriptorTypes): bigint {
    this.#checkUsable();
    const out = new BigUint64Array(1);
    this.#check(
      `cudnnBackendCreateDescriptor(${type})`,
      this.#lib.symbols.cudnnBackendCreateDescriptor(descriptorTypes[type], addressOf(out)),
    );
    return out[0]!;
  }

  #set(
    d: bigint,
    name: number,
    type: number,
    values: Int32Array | Uint8Array | Float32Array | BigInt64Array | BigUint64Array,
  ): void {
    this.#check(
      `cudnnBackendSetAttribute(${attrName(name)})`,
      this.#lib.symbols.cudnnBackendSetAttribute(d, name, type, values.length, addressOf(values)),
    );
  }

  #get(d: bigint, name: number, type: number, out: BigInt64Array): void {
    const count = new BigInt64Array(1);
    this.#check(
      `cudnnBackendGetAttribute(${attrName(name)})`,
      this.#lib.symbols.cudnnBackendGetAttribute(d, name, type, out.length, addressOf(count), addressOf(out)),
    );
  }

  #finalize(d: bigint, what: string): void {
    const status = this.#lib.symbols.cudnnBackendFinalize(d);
    if (status === 0) return;
    const error = new CudnnError(`cudnnBackendFinalize(${what})`, status, statusName(status), this.#lastError());
    // a graph cuDNN cannot run here is not a bug to crash on: the caller may fall back
    if (Math.floor(status / 1000) === 3) throw new CudnnUnsupportedError(error.message);
    throw error;
  }

  #check(call: string, status: number): void {
    if (status !== 0) throw new CudnnError(call, status, statusName(status), this.#lastError());
  }

  /** cuDNN's own words on its last failure (cudnnGetLastErrorString), one line */
  #lastError(): string {
    const buf = new Uint8Array(1024);
    this.#lib.symbols.cudnnGetLastErrorString(addressOf(buf), buf.length);
    const end = buf.indexOf(0);
    return Buffer.from(buf.subarray(0, end < 0 ? buf.length : end))
      .toString()
      .replace(/[\r\n]+/g, " ")
      .trim();
  }

  #checkUsable(): void {
    if (this.#disposed) throw new Error("cuDNN handle used after dispose()");
  }
}

function statusName(status: number): string {
  return statusNames[status] ?? `cudnnStatus ${status}`;
}

const attrNames = new Map<number, string>(Object.entries(attrs).map(([k, v]) => [v, k]));
function attrName(name: number): string {
  return attrNames.get(name) ?? String(name);
}
