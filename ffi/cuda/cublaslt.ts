// cuBLASLt through bun:ffi, for a linear layer's GEMM with its epilogue in the same kernel:
//   bias      C = A B + bias                        (CUBLASLT_EPILOGUE_BIAS)
//   biasGelu  pre = A B + bias, C = gelu(pre)       (CUBLASLT_EPILOGUE_GELU_AUX_BIAS: pre is
//             the "aux" output backward reads; cuBLASLt's GELU is GPT-2's tanh form)
//   biasGrad  dbias += the sums of op(A) over K     (CUBLASLT_EPILOGUE_BGRADB: the bias gradient
//             taken while the weight gradient's GEMM reads the output gradient)
//   dgelu     C = gelu'(pre) * (A B)                (CUBLASLT_EPILOGUE_DGELU: the gradient of a GELU
//             layer's pre-activation, from the next layer's input-gradient GEMM)
// Everything else (plain GEMMs, batched ones) stays on cublasGemmEx (cublas.ts).
//
// The bias vector has D's type: f32 for an f32 output, and for a 2-byte one a copy the caller
// rounds to that type (cuBLASLt takes no f32 bias there; PyTorch's autocast rounds the bias too).
// A plan (matmul descriptor, four layouts, the heuristic's first algorithm) is made once per
// shape, types and epilogue, and kept; a call only sets its bias and aux pointers and runs.
// The heuristic may find no algorithm for a combination (cuBLASLt documents which it supports,
// and a GPU may support fewer): the plan then records the refusal, and the caller runs the GEMM
// and the epilogue's kernels instead. The row-major to column-major mapping is cublas.ts's
// rowMajorGemm: row-major C (M,N) is column-major D (N,M), so the bias runs along D's rows (its
// length is D's row count, N) and BGRADB's reduction of D's B (row-major A) gives M sums.
//
// The library is found as cuBLAS is: MESHTRAIN_CUBLASLT, the loader's folders, NVIDIA's pip
// wheels (nvidia/cu13/lib/libcublasLt.so.13, beside libcublas.so.13).
import { dlopen, ptr as addressOf } from "bun:ffi";
import type { GemmEpilogue, Ptr } from "../backend.ts";
import { NativeLibraryError } from "../errors.ts";
import { tryFindLibrary } from "../find-library.ts";
import { CublasError, type CublasGemmArgs, CUDA_R_32F, cublasStatusNames } from "./cublas.ts";

/** A matrix of cublasLtMatmul: its device pointer and its layout descriptor. */
const matrix = ["u64", "u64"] as const;

const symbols = {
  cublasLtCreate: { args: ["ptr"], returns: "i32" },
  cublasLtDestroy: { args: ["u64"], returns: "i32" },
  cublasLtGetVersion: { args: [], returns: "u64" },
  cublasLtMatmulDescCreate: { args: ["ptr", "i32", "i32"], returns: "i32" },
  cublasLtMatmulDescDestroy: { args: ["u64"], returns: "i32" },
  cublasLtMatmulDescSetAttribute: { args: ["u64", "i32", "ptr", "u64"], returns: "i32" },
  // layout, type, rows, cols, leading dimension
  cublasLtMatrixLayoutCreate: { args: ["ptr", "i32", "u64", "u64", "i64"], returns: "i32" },
  cublasLtMatrixLayoutDestroy: { args: ["u64"], returns: "i32" },
  cublasLtMatmulPreferenceCreate: { args: ["ptr"], returns: "i32" },
  cublasLtMatmulPreferenceDestroy: { args: ["u64"], returns: "i32" },
  cublasLtMatmulPreferenceSetAttribute: { args: ["u64", "i32", "ptr", "u64"], returns: "i32" },
  // handle, desc, A, B, C, D layouts, preference, requested count, results, *returned count
  cublasLtMatmulAlgoGetHeuristic: {
    args: ["u64", "u64", "u64", "u64", "u64", "u64", "u64", "i32", "ptr", "ptr"],
    returns: "i32",
  },
  // handle, desc, alpha, A, Adesc, B, Bdesc, beta, C, Cdesc, D, Ddesc, algo, workspace, bytes, stream
  cublasLtMatmul: {
    args: ["u64", "u64", "ptr", ...matrix, ...matrix, "ptr", ...matrix, ...matrix, "ptr", "u64", "u64", "u64"],
    returns: "i32",
  },
} as const;

/** Every cuBLASLt symbol the binding uses (the fake in the tests exports each). */
export const cublasLtSymbolNames = Object.keys(symbols);

export const cublasLtInstallHint =
  "install cuBLAS (pip install nvidia-cublas, or the CUDA toolkit; libcublasLt.so comes with it), or set MESHTRAIN_CUBLASLT to libcublasLt.so";

export function findCublasLt(): string | null {
  return tryFindLibrary({
    what: "cuBLASLt",
    envVar: "MESHTRAIN_CUBLASLT",
    names: ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"],
    pipSubdir: ["cu13", "cublas"],
    installHint: cublasLtInstallHint,
  });
}

type CublasLtLib = ReturnType<typeof dlopen<typeof symbols>>;

export function loadCublasLt(path: string | null = findCublasLt()): CublasLtLib {
  if (path === null) throw new NativeLibraryError(`cuBLASLt not found; ${cublasLtInstallHint}`);
  try {
    return dlopen(path, symbols);
  } catch (e) {
    throw new NativeLibraryError(`cannot load cuBLASLt from ${path}: ${(e as Error).message}`, { cause: e });
  }
}

// cublasLt.h (stable since CUDA 11)
/** cublasLtMatmulDescAttributes_t */
const desc = {
  transA: 3,
  transB: 4,
  epilogue: 7,
  biasPointer: 8,
  auxPointer: 11,
  auxLd: 12,
  auxDataType: 22,
  biasDataType: 26,
} as const;
/** cublasLtEpilogue_t */
export const epilogueCodes = { bias: 4, biasGelu: 164, biasGrad: 512, dgelu: 192 } as const satisfies Record<
  GemmEpilogue["kind"],
  number
>;
const CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1;
/** cublasLtMatmulHeuristicResult_t: the algorithm (8 uint64), workspace size, state, waves, 4 reserved ints */
const heuristicResultBytes = 96;
/** cuBLASLt wants the aux matrix's leading dimension a multiple of 8 and its pointer 16-byte aligned */
const auxLdMultiple = 8;
const auxAlignBytes = 16;

/** One column-major call, as rowMajorGemm maps it, with its element types. */
export interface LtCall extends CublasGemmArgs {
  /** cudaDataType_t of A and B, and of C/D */
  abType: number;
  cType: number;
  /** cublasComputeType_t */
  compute: number;
  alpha: number;
  beta: number;
}

/** A call's matmul descriptor, layouts and algorithm (CublasLt.plan). */
export interface LtPlan {
  desc: bigint;
  layouts: [bigint, bigint, bigint];
  /** the heuristic's first result; its first 64 bytes are the algorithm */
  algo: Uint8Array;
}

/** The epilogue's vector (the bias, or where the bias gradient goes), or null where it has none. */
const vectorOf = (e: GemmEpilogue, biasGradOut: Ptr): Ptr | null =>
  e.kind === "biasGrad" ? biasGradOut : e.kind === "dgelu" ? null : e.bias;

/** The epilogue's aux matrix (the GELU's pre-activation), or null. */
const auxOf = (e: GemmEpilogue): Ptr | null => (e.kind === "biasGelu" || e.kind === "dgelu" ? e.pre : null);

/** A cuBLASLt handle on one stream, sharing the caller's workspace (cuBLAS's: both run on the one
 *  stream, one call at a time). */
export class CublasLt {
  readonly #lib: CublasLtLib;
  readonly #handle: bigint;
  readonly #stream: bigint;
  readonly #workspace: { ptr: Ptr; bytes: number };
  readonly #preference: bigint;
  /** by shape, types and epilogue: a plan, or why cuBLASLt has none */
  readonly #plans = new Map<string, LtPlan | string>();
  readonly #scalars = new Float32Array(2);
  readonly #u64 = new BigUint64Array(1);
  readonly #i32 = new Int32Array(1);
  #calls = 0;

  constructor(lib: CublasLtLib, stream: bigint, workspace: { ptr: Ptr; bytes: number }) {
    this.#lib = lib;
    this.#stream = stream;
    this.#workspace = workspace;
    const out = new BigUint64Array(1);
    this.#check("cublasLtCreate", lib.symbols.cublasLtCreate(addressOf(out)));
    this.#handle = out[0]!;
    this.#check("cublasLtMatmulPreferenceCreate", lib.symbols.cublasLtMatmulPreferenceCreate(addressOf(out)));
    this.#preference = out[0]!;
    this.#u64[0] = BigInt(workspace.bytes);
    this.#check(
      "cublasLtMatmulPreferenceSetAttribute",
      lib.symbols.cublasLtMatmulPreferenceSetAttribute(
        this.#preference,
        CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
        addressOf(this.#u64),
        8n,
      ),
    );
  }

  version(): number {
    return Number(this.#lib.symbols.cublasLtGetVersion());
  }

  /** matmuls run so far */
  get calls(): number {
    return this.#calls;
  }

  /**
   * The plan that runs the call with its epilogue (made at its shape's first call, and kept), or
   * why cuBLASLt cannot: the aux matrix's alignment, or no algorithm for this combination. The
   * bias has C's type, the bias gradient is f32; the aux matrix has C's type and leading
   * dimension. `biasGradOut`: where a biasGrad epilogue writes (its alignment counts).
   */
  plan(c: LtCall, epilogue: GemmEpilogue, biasGradOut: Ptr = 0): LtPlan | string {
    const shape = `${c.m}x${c.n}x${c.k}`;
    const aux = auxOf(epilogue);
    if (aux !== null && (c.ldc % auxLdMultiple !== 0 || aux % auxAlignBytes !== 0)) {
      return `${epilogue.kind} at ${shape}: its GELU input needs a leading dimension that is a multiple of ${auxLdMultiple} and ${auxAlignBytes}-byte alignment (ld ${c.ldc})`;
    }
    const key = `${epilogue.kind} ${c.abType} ${c.cType} ${c.compute} ${c.transa}${c.transb} ${shape} ${c.lda} ${c.ldb} ${c.ldc}`;
    let plan = this.#plans.get(key);
    if (plan === undefined) {
      plan = this.#plan(c, epilogue, vectorOf(epilogue, biasGradOut));
      if (typeof plan === "string") plan = `${epilogue.kind} at ${shape} (types ${c.abType}/${c.cType}): ${plan}`;
      this.#plans.set(key, plan);
    }
    return plan;
  }

  /** Queues the call on its plan (plan() of the same call): its pointers, this time's. */
  run(plan: LtPlan, c: LtCall, epilogue: GemmEpilogue, biasGradOut: Ptr = 0): void {
    const vector = vectorOf(epilogue, biasGradOut);
    const s = this.#lib.symbols;
    if (vector !== null) this.#setPointer(plan.desc, desc.biasPointer, vector);
    const aux = auxOf(epilogue);
    if (aux !== null) this.#setPointer(plan.desc, desc.auxPointer, aux);
    this.#scalars[0] = c.alpha;
    this.#scalars[1] = c.beta;
    const [la, lb, lc] = plan.layouts;
    const C = BigInt(c.C);
    this.#calls++;
    this.#check(
      "cublasLtMatmul",
      // biome-ignore format: one line per operand reads better than one per argument
      s.cublasLtMatmul(this.#handle, plan.desc, addressOf(this.#scalars, 0),
        BigInt(c.A), la,
        BigInt(c.B), lb,
        addressOf(this.#scalars, 4), C, lc,
        C, lc,
        addressOf(plan.algo), BigInt(this.#workspace.ptr), BigInt(this.#workspace.bytes), this.#stream),
    );
  }

  destroy(): void {
    for (const plan of this.#plans.values()) if (typeof plan !== "string") this.#destroyPlan(plan);
    this.#plans.clear();
    this.#lib.symbols.cublasLtMatmulPreferenceDestroy(this.#preference);
    this.#check("cublasLtDestroy", this.#lib.symbols.cublasLtDestroy(this.#handle));
  }

  #plan(c: LtCall, epilogue: GemmEpilogue, vector: Ptr | null): LtPlan | string {
    const s = this.#lib.symbols;
    const out = new BigUint64Array(1);
    this.#check("cublasLtMatmulDescCreate", s.cublasLtMatmulDescCreate(addressOf(out), c.compute, CUDA_R_32F));
    const plan: LtPlan = { desc: out[0]!, layouts: [0n, 0n, 0n], algo: new Uint8Array(heuristicResultBytes) };
    try {
      this.#setI32(plan.desc, desc.transA, c.transa);
      this.#setI32(plan.desc, desc.transB, c.transb);
      this.#setI32(plan.desc, desc.epilogue, epilogueCodes[epilogue.kind]);
      if (vector !== null) {
        // the bias has D's type (cuBLASLt takes no f32 bias for a 2-byte D); the bias gradient is f32
        this.#setI32(plan.desc, desc.biasDataType, epilogue.kind === "biasGrad" ? CUDA_R_32F : c.cType);
        // the heuristic reads the pointers' alignment: set this call's now, each call's later
        this.#setPointer(plan.desc, desc.biasPointer, vector);
      }
      const aux = auxOf(epilogue);
      if (aux !== null) {
        // the pre-activation: written by GELU_AUX_BIAS, read by DGELU; C's type and leading dimension
        this.#setPointer(plan.desc, desc.auxPointer, aux);
        this.#u64[0] = BigInt(c.ldc);
        this.#setAttr(plan.desc, desc.auxLd, this.#u64, 8);
        this.#setI32(plan.desc, desc.auxDataType, c.cType);
      }
      // stored shapes: A is (m,k), or (k,m) transposed; B (k,n), or (n,k); C (m,n)
      const shapes: [number, number, number, number][] = [
        [c.abType, c.transa ? c.k : c.m, c.transa ? c.m : c.k, c.lda],
        [c.abType, c.transb ? c.n : c.k, c.transb ? c.k : c.n, c.ldb],
        [c.cType, c.m, c.n, c.ldc],
      ];
      shapes.forEach(([type, rows, cols, ld], i) => {
        this.#check(
          "cublasLtMatrixLayoutCreate",
          s.cublasLtMatrixLayoutCreate(addressOf(out), type, BigInt(rows), BigInt(cols), BigInt(ld)),
        );
        plan.layouts[i] = out[0]!;
      });
      const [la, lb, lc] = plan.layouts;
      const found = this.#i32;
      found[0] = 0;
      const status = s.cublasLtMatmulAlgoGetHeuristic(
        this.#handle,
        plan.desc,
        la,
        lb,
        lc,
        lc,
        this.#preference,
        1,
        addressOf(plan.algo),
        addressOf(found),
      );
      if (status !== 0 || found[0] === 0) {
        this.#destroyPlan(plan);
        const why = status === 0 ? "no algorithm" : (cublasStatusNames[status] ?? `status ${status}`);
        return `cuBLASLt has no kernel for it (${why})`;
      }
      return plan;
    } catch (e) {
      this.#destroyPlan(plan);
      throw e;
    }
  }

  #destroyPlan(plan: LtPlan): void {
    const s = this.#lib.symbols;
    for (const l of plan.layouts) if (l !== 0n) s.cublasLtMatrixLayoutDestroy(l);
    s.cublasLtMatmulDescDestroy(plan.desc);
  }

  #setI32(d: bigint, attr: number, value: number): void {
    this.#i32[0] = value;
    this.#setAttr(d, attr, this.#i32, 4);
  }

  #setPointer(d: bigint, attr: number, p: Ptr): void {
    this.#u64[0] = BigInt(p);
    this.#setAttr(d, attr, this.#u64, 8);
  }

  #setAttr(d: bigint, attr: number, value: Int32Array | BigUint64Array, bytes: number): void {
    this.#check(
      "cublasLtMatmulDescSetAttribute",
      this.#lib.symbols.cublasLtMatmulDescSetAttribute(d, attr, addressOf(value), BigInt(bytes)),
    );
  }

  #check(call: string, status: number): void {
    if (status !== 0) throw new CublasError(call, status, cublasStatusNames[status] ?? `cublasStatus ${status}`);
  }
}
