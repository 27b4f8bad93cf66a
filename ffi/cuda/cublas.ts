// cuBLAS through bun:ffi: cublasGemmEx and cublasGemmStridedBatchedEx with f32, tf32, bf16
// and f16 inputs, accumulating in f32 and writing C in f32 (or, with 2-byte inputs, in their type).
//
// cuBLAS is column-major; meshtrain is row-major. A row-major (M,N) matrix is the same memory
// as a column-major (N,M) one, so C = op(A) op(B) in row-major is C^T = op(B)^T op(A)^T in
// column-major: swap the operands (B first), swap M and N, keep each operand's transpose flag
// and leading dimension. rowMajorGemm() does that mapping; it is pure and tested on the CPU.
import { dlopen, ptr as addressOf, CString, type Pointer } from "bun:ffi";
import type { GemmDesc, GemmInput, GemmOutput, Ptr } from "../backend.ts";
import { NativeLibraryError } from "../errors.ts";
import { tryFindLibrary } from "../find-library.ts";

export class CublasError extends Error {
  override readonly name = "CublasError";
  constructor(
    readonly call: string,
    readonly status: number,
    readonly statusName: string,
  ) {
    super(`${call} failed: ${statusName} (${status})`);
  }
}

export const cublasStatusNames: Readonly<Record<number, string>> = {
  0: "CUBLAS_STATUS_SUCCESS",
  1: "CUBLAS_STATUS_NOT_INITIALIZED",
  3: "CUBLAS_STATUS_ALLOC_FAILED",
  7: "CUBLAS_STATUS_INVALID_VALUE",
  8: "CUBLAS_STATUS_ARCH_MISMATCH",
  11: "CUBLAS_STATUS_MAPPING_ERROR",
  13: "CUBLAS_STATUS_EXECUTION_FAILED",
  14: "CUBLAS_STATUS_INTERNAL_ERROR",
  15: "CUBLAS_STATUS_NOT_SUPPORTED",
  16: "CUBLAS_STATUS_LICENSE_ERROR",
};

// cublas_api.h / library_types.h
export const CUBLAS_OP_N = 0;
export const CUBLAS_OP_T = 1;
export const CUDA_R_32F = 0;
export const CUDA_R_16F = 2;
export const CUDA_R_16BF = 14;
export const CUBLAS_COMPUTE_32F = 68;
export const CUBLAS_COMPUTE_32F_FAST_TF32 = 77;
export const CUBLAS_GEMM_DEFAULT = -1;
export const CUBLAS_DEFAULT_MATH = 0;

const symbols = {
  cublasCreate_v2: { args: ["ptr"], returns: "i32" },
  cublasDestroy_v2: { args: ["u64"], returns: "i32" },
  cublasSetStream_v2: { args: ["u64", "u64"], returns: "i32" },
  cublasSetMathMode: { args: ["u64", "i32"], returns: "i32" },
  cublasSetWorkspace_v2: { args: ["u64", "u64", "u64"], returns: "i32" },
  cublasGetVersion_v2: { args: ["u64", "ptr"], returns: "i32" },
  cublasGetStatusName: { args: ["i32"], returns: "ptr" },
  cublasGemmEx: {
    // handle, transa, transb, m, n, k, alpha*, A, Atype, lda, B, Btype, ldb, beta*, C, Ctype, ldc, computeType, algo
    // biome-ignore format: the C signature on one line, in the order the comment above names
    args: ["u64", "i32", "i32", "i32", "i32", "i32", "u64", "u64", "i32", "i32", "u64", "i32", "i32", "u64", "u64", "i32", "i32", "i32", "i32"],
    returns: "i32",
  },
  cublasGemmStridedBatchedEx: {
    // ..., A, Atype, lda, strideA (long long), B, Btype, ldb, strideB, beta*, C, Ctype, ldc, strideC, batchCount, computeType, algo
    // biome-ignore format: the C signature on one line, in the order the comment above names
    args: ["u64", "i32", "i32", "i32", "i32", "i32", "u64", "u64", "i32", "i32", "i64", "u64", "i32", "i32", "i64", "u64", "u64", "i32", "i32", "i64", "i32", "i32", "i32"],
    returns: "i32",
  },
} as const;

/** Every cuBLAS symbol the binding uses (tests check them against a real libcublas). */
export const cublasSymbolNames = Object.keys(symbols);

export const cublasInstallHint =
  "install cuBLAS (pip install nvidia-cublas, or the CUDA toolkit), or set MESHTRAIN_CUBLAS to libcublas.so";

export function findCublas(): string | null {
  return tryFindLibrary({
    what: "cuBLAS",
    envVar: "MESHTRAIN_CUBLAS",
    names: ["libcublas.so.13", "libcublas.so.12", "libcublas.so"],
    pipSubdir: ["cu13", "cublas"],
    installHint: cublasInstallHint,
  });
}

type CublasLib = ReturnType<typeof dlopen<typeof symbols>>;

export function loadCublas(path: string | null = findCublas()): CublasLib {
  if (path === null) throw new NativeLibraryError(`cuBLAS not found; ${cublasInstallHint}`);
  try {
    return dlopen(path, symbols);
  } catch (e) {
    throw new NativeLibraryError(`cannot load cuBLAS from ${path}: ${(e as Error).message}`, { cause: e });
  }
}

/** The column-major cuBLAS call that computes a row-major GEMM. */
export interface CublasGemmArgs {
  transa: number;
  transb: number;
  m: number;
  n: number;
  k: number;
  A: Ptr;
  lda: number;
  strideA: number;
  B: Ptr;
  ldb: number;
  strideB: number;
  C: Ptr;
  ldc: number;
  strideC: number;
}

/** Row-major C (M,N) = op(A) op(B)  ==  column-major C^T (N,M) = op(B)^T op(A)^T. */
export function rowMajorGemm(
  transA: boolean,
  transB: boolean,
  M: number,
  N: number,
  K: number,
  A: Ptr,
  lda: number,
  strideA: number,
  B: Ptr,
  ldb: number,
  strideB: number,
  C: Ptr,
  ldc: number,
  strideC: number,
): CublasGemmArgs {
  return {
    transa: transB ? CUBLAS_OP_T : CUBLAS_OP_N,
    transb: transA ? CUBLAS_OP_T : CUBLAS_OP_N,
    m: N,
    n: M,
    k: K,
    A: B,
    lda: ldb,
    strideA: strideB,
    B: A,
    ldb: lda,
    strideB: strideA,
    C,
    ldc,
    strideC,
  };
}

/** cuBLAS's element and compute types for each GEMM input */
export const inputTypes: Readonly<Record<GemmInput, { dtype: number; compute: number }>> = {
  f32: { dtype: CUDA_R_32F, compute: CUBLAS_COMPUTE_32F },
  tf32: { dtype: CUDA_R_32F, compute: CUBLAS_COMPUTE_32F_FAST_TF32 },
  bf16: { dtype: CUDA_R_16BF, compute: CUBLAS_COMPUTE_32F },
  f16: { dtype: CUDA_R_16F, compute: CUBLAS_COMPUTE_32F },
};

export const outputTypes: Readonly<Record<GemmOutput, number>> = {
  f32: CUDA_R_32F,
  bf16: CUDA_R_16BF,
  f16: CUDA_R_16F,
};

const int32Max = 2 ** 31 - 1;

/** The workspace cuBLAS's documentation recommends for Hopper (cublasSetWorkspace: 32 MiB; 4 MiB
 *  before it): some of its fastest GEMM kernels need it, and without one set it picks from fewer. */
export const cublasWorkspaceBytes = 32 << 20;

/** A cuBLAS handle bound to one stream. alpha and beta live in host memory the caller owns
 *  (pinned, so its address is stable): cuBLAS reads them during the call (host pointer mode). */
export class Cublas {
  readonly #lib: CublasLib;
  readonly #handle: bigint;
  readonly #scalars: Float32Array;
  readonly #scalarsPtr: Ptr;

  /** scalars: a Float32Array of 2 over stable host memory at scalarsPtr; workspace: device memory
   *  of workspaceBytes for the handle's GEMMs (cublasSetWorkspace), used only on its stream */
  constructor(
    lib: CublasLib,
    stream: bigint,
    scalars: Float32Array,
    scalarsPtr: Ptr,
    workspace: { ptr: Ptr; bytes: number } | null = null,
  ) {
    this.#lib = lib;
    const out = new BigUint64Array(1);
    this.#check("cublasCreate_v2", lib.symbols.cublasCreate_v2(addressOf(out)));
    this.#handle = out[0]!;
    this.#check("cublasSetStream_v2", lib.symbols.cublasSetStream_v2(this.#handle, stream));
    // default math: f32 GEMMs stay f32; tf32 is asked for per call through its compute type
    this.#check("cublasSetMathMode", lib.symbols.cublasSetMathMode(this.#handle, CUBLAS_DEFAULT_MATH));
    if (workspace !== null) {
      const { ptr, bytes } = workspace;
      this.#check("cublasSetWorkspace_v2", lib.symbols.cublasSetWorkspace_v2(this.#handle, BigInt(ptr), BigInt(bytes)));
    }
    this.#scalars = scalars;
    this.#scalarsPtr = scalarsPtr;
  }

  version(): number {
    const out = new Int32Array(1);
    this.#check("cublasGetVersion_v2", this.#lib.symbols.cublasGetVersion_v2(this.#handle, addressOf(out)));
    return out[0]!;
  }

  gemm(g: Required<GemmDesc>): void {
    const {
      input,
      output,
      transA,
      transB,
      M,
      N,
      K,
      alpha,
      A,
      lda,
      strideA,
      B,
      ldb,
      strideB,
      beta,
      C,
      ldc,
      strideC,
      batch,
    } = g;
    if (M === 0 || N === 0 || batch === 0) return;
    for (const [name, v] of [
      ["M", M],
      ["N", N],
      ["K", K],
      ["lda", lda],
      ["ldb", ldb],
      ["ldc", ldc],
      ["batch", batch],
    ] as const) {
      if (!Number.isInteger(v) || v < 0 || v > int32Max)
        throw new RangeError(`gemm: ${name} = ${v} is outside cuBLAS's int range`);
    }
    // cuBLAS wants every leading dimension >= 1, even where K = 0 leaves an operand empty
    // (C = beta C then); our row-major callers pass ld = K for such operands
    const rm = rowMajorGemm(
      transA,
      transB,
      M,
      N,
      K,
      A,
      Math.max(1, lda),
      strideA,
      B,
      Math.max(1, ldb),
      strideB,
      C,
      ldc,
      strideC,
    );
    const { dtype, compute } = inputTypes[input];
    this.#scalars[0] = alpha;
    this.#scalars[1] = beta;
    const alpha_ = BigInt(this.#scalarsPtr);
    const beta_ = BigInt(this.#scalarsPtr + 4);
    const s = this.#lib.symbols;
    const h = this.#handle;
    const { transa: ta, transb: tb, m, n, k, lda: la, ldb: lb, ldc: lc } = rm;
    const [a, b, c] = [BigInt(rm.A), BigInt(rm.B), BigInt(rm.C)];
    const [algo, ctype] = [CUBLAS_GEMM_DEFAULT, outputTypes[output]];
    if (batch === 1) {
      // biome-ignore format: one line per operand reads better than one per argument
      const status = s.cublasGemmEx(h, ta, tb, m, n, k, alpha_,
        a, dtype, la,
        b, dtype, lb,
        beta_, c, ctype, lc,
        compute, algo);
      this.#check("cublasGemmEx", status);
      return;
    }
    const [sa, sb, sc] = [rm.strideA, rm.strideB, rm.strideC];
    this.#check(
      "cublasGemmStridedBatchedEx",
      // biome-ignore format: one line per operand reads better than one per argument
      s.cublasGemmStridedBatchedEx(h, ta, tb, m, n, k, alpha_,
        a, dtype, la, sa,
        b, dtype, lb, sb,
        beta_, c, ctype, lc, sc,
        batch, compute, algo),
    );
  }

  destroy(): void {
    this.#check("cublasDestroy_v2", this.#lib.symbols.cublasDestroy_v2(this.#handle));
  }

  #check(call: string, status: number): void {
    if (status !== 0) throw new CublasError(call, status, cublasStatusName(this.#lib, status));
  }
}

export function cublasStatusName(lib: CublasLib, status: number): string {
  const p = lib.symbols.cublasGetStatusName(status);
  if (p === null || p === 0) return cublasStatusNames[status] ?? `cublasStatus ${status}`;
  return new CString(p as Pointer).toString();
}
