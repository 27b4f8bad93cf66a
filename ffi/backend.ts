// The one interface every compute backend implements: the CPU backend (ffi/cpu: OpenBLAS +
// kernels.c) and the CUDA backend (ffi/cuda: driver API + cuBLAS + PTX kernels). The engine
// talks to nothing else.
//
// Memory is addressed by `Ptr`: a plain number holding a native address (a host address on
// the CPU, a CUdeviceptr on CUDA). Addresses stay below 2^53 on every platform we run on.
// Counts (n, N, C, ...) are element counts; byte sizes say "bytes".
//
// Every kernel is synchronous from the caller's point of view on the CPU. On CUDA they are
// stream-ordered; anything that returns a number to JavaScript (sumSquares,
// countNonFinite, the invalid-index counts) synchronizes.
//
// Backward kernels ADD into their gradient buffers (dinp += ...).

import type { OpMethods } from "./ops.ts";

export type Ptr = number;

export type DType = "f32" | "bf16" | "f16" | "i32";

export const dtypeBytes: Readonly<Record<DType, number>> = { f32: 4, bf16: 2, f16: 2, i32: 4 };

/** A block of backend memory. Freed explicitly with Backend.free. */
export interface Allocation {
  readonly ptr: Ptr;
  readonly bytes: number;
}

export type BinaryOp = "add" | "mul";

/** What a buffer's elements are, where a kernel reads either width (attention's qkv under autocast). */
export type ElemType = "f32" | "bf16" | "f16";

/**
 * What the multiply of a GEMM reads. Accumulation and C are always f32.
 *   f32   4-byte floats, full-precision multiplies
 *   tf32  4-byte floats whose multiply inputs may be rounded to 10 mantissa bits (tensor cores);
 *         a backend without such units computes in f32, which is more precise
 *   bf16, f16  A and B hold 2-byte elements (autocast copies of f32 tensors)
 */
export type GemmInput = "f32" | "tf32" | "bf16" | "f16";
export const gemmInputBytes: Readonly<Record<GemmInput, number>> = { f32: 4, tf32: 4, bf16: 2, f16: 2 };

/** Up to 4 dims, outermost first; unused leading dims are 1. Strides in elements. */
export type Dims4 = readonly [number, number, number, number];

export interface BackendStats {
  /** allocations made by alloc() since the backend was created */
  readonly allocCount: number;
  readonly allocBytes: number;
  /** live (not yet freed) bytes */
  readonly liveBytes: number;
}

export interface Backend extends OpMethods {
  readonly name: string;
  readonly stats: BackendStats;

  // ---- memory ----
  alloc(bytes: number): Allocation;
  free(allocation: Allocation): void;
  /** copy host data into backend memory at dst */
  upload(dst: Ptr, src: ArrayBufferView): void;
  /** copy backend memory at src into host memory */
  download(src: Ptr, dst: ArrayBufferView): void;
  copy(dst: Ptr, src: Ptr, bytes: number): void;
  zero(dst: Ptr, bytes: number): void;
  fill(dst: Ptr, n: number, value: number): void;
  synchronize(): void;

  // ---- GEMM, row-major: C (M,N) = alpha op(A) op(B) + beta C; op(A) is (M,K), op(B) (K,N) ----
  gemm(
    transA: boolean,
    transB: boolean,
    M: number,
    N: number,
    K: number,
    alpha: number,
    A: Ptr,
    lda: number,
    B: Ptr,
    ldb: number,
    beta: number,
    C: Ptr,
    ldc: number,
  ): void;
  gemmStridedBatched(
    transA: boolean,
    transB: boolean,
    M: number,
    N: number,
    K: number,
    alpha: number,
    A: Ptr,
    lda: number,
    strideA: number,
    B: Ptr,
    ldb: number,
    strideB: number,
    beta: number,
    C: Ptr,
    ldc: number,
    strideC: number,
    batch: number,
  ): void;
  /** Strided-batched GEMM whose A and B hold `input` elements (strides and leading dimensions
   *  in elements); accumulates in f32 and reads/writes C as f32. batch 1 ignores the strides. */
  gemmEx(
    input: GemmInput,
    transA: boolean,
    transB: boolean,
    M: number,
    N: number,
    K: number,
    alpha: number,
    A: Ptr,
    lda: number,
    strideA: number,
    B: Ptr,
    ldb: number,
    strideB: number,
    beta: number,
    C: Ptr,
    ldc: number,
    strideC: number,
    batch: number,
  ): void;

  // the kernel ops (elementwise, layers, reductions, optimizer updates, casts) are OpMethods,
  // declared once in ffi/ops.ts

  /** release native resources; the backend is unusable afterwards */
  dispose(): void;
}
