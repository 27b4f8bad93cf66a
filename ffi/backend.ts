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

export type Ptr = number;

export type DType = "f32" | "bf16" | "f16" | "i32";

export const dtypeBytes: Readonly<Record<DType, number>> = { f32: 4, bf16: 2, f16: 2, i32: 4 };

/** A block of backend memory. Freed explicitly with Backend.free. */
export interface Allocation {
  readonly ptr: Ptr;
  readonly bytes: number;
}

export type BinaryOp = "add" | "mul";

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

export interface Backend {
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

  // ---- elementwise (f32) ----
  add(out: Ptr, a: Ptr, b: Ptr, n: number): void;
  mul(out: Ptr, a: Ptr, b: Ptr, n: number): void;
  /** y += alpha x */
  axpy(y: Ptr, x: Ptr, n: number, alpha: number): void;
  scale(x: Ptr, n: number, s: number): void;
  /** dinp[i] += dout[0] * scale (dout is a scalar in backend memory) */
  addScalarFrom(dinp: Ptr, dout: Ptr, scale: number, n: number): void;
  /** out[i] = a[i·aStrides] op b[i·bStrides] over dims; out is contiguous with `dims` */
  binaryBroadcast(op: BinaryOp, out: Ptr, a: Ptr, b: Ptr, dims: Dims4, aStrides: Dims4, bStrides: Dims4): void;
  /** out[i·outStrides] += inp[i] over dims (inp contiguous): reduce a gradient onto a broadcast operand */
  reduceBroadcast(out: Ptr, inp: Ptr, dims: Dims4, outStrides: Dims4): void;

  // ---- layers ----
  biasAdd(out: Ptr, inp: Ptr, bias: Ptr, N: number, C: number): void;
  biasBackward(dbias: Ptr, dout: Ptr, N: number, C: number): void;
  reluForward(out: Ptr, inp: Ptr, n: number): void;
  reluBackward(dinp: Ptr, inp: Ptr, dout: Ptr, n: number): void;
  geluForward(out: Ptr, inp: Ptr, n: number): void;
  geluBackward(dinp: Ptr, inp: Ptr, dout: Ptr, n: number): void;
  dropoutForward(out: Ptr, inp: Ptr, n: number, p: number, seed: bigint): void;
  dropoutBackward(dinp: Ptr, dout: Ptr, n: number, p: number, seed: bigint): void;
  /**
   * Returns the count of targets outside [0, V). `inRange`: the caller has checked on the host
   * that every target is in [0, V), so the count is not wanted; a GPU backend then returns 0
   * without waiting for the device (out-of-range targets still never read outside the row).
   */
  crossEntropyForward(loss: Ptr, losses: Ptr, probs: Ptr, logits: Ptr, targets: Ptr, N: number, V: number, inRange?: boolean): number;
  crossEntropyBackward(dlogits: Ptr, probs: Ptr, targets: Ptr, dloss: Ptr, N: number, V: number): void;
  layerNormForward(out: Ptr, mean: Ptr, rstd: Ptr, inp: Ptr, weight: Ptr, bias: Ptr, N: number, C: number, eps: number): void;
  layerNormBackward(dinp: Ptr, dweight: Ptr, dbias: Ptr, dout: Ptr, inp: Ptr, weight: Ptr, mean: Ptr, rstd: Ptr, N: number, C: number): void;
  /** Returns the count of ids outside [0, V) (their rows come out zero). `inRange` as for
   *  crossEntropyForward: 0 is returned without waiting for the device. */
  embeddingForward(out: Ptr, ids: Ptr, table: Ptr, N: number, C: number, V: number, inRange?: boolean): number;
  embeddingBackward(dtable: Ptr, ids: Ptr, dout: Ptr, N: number, C: number): void;
  causalSoftmaxForward(out: Ptr, inp: Ptr, BH: number, T: number, scale: number): void;
  causalSoftmaxBackward(dinp: Ptr, out: Ptr, dout: Ptr, BH: number, T: number, scale: number): void;
  /** out[i·outStrides] = (or +=) inp[i·inpStrides] over dims: permutes, splits, merges.
   *  No two indices may map to the same out element. */
  stridedCopy(out: Ptr, outStrides: Dims4, inp: Ptr, inpStrides: Dims4, dims: Dims4, accumulate: boolean): void;

  // ---- reductions ----
  /** out[0] = sum of inp (n) */
  sum(out: Ptr, inp: Ptr, n: number): void;
  sumSquares(x: Ptr, n: number): number;
  countNonFinite(x: Ptr, n: number): number;

  // ---- optimizer updates (PyTorch semantics; see ffi/cpu/kernels.c) ----
  sgdStep(
    param: Ptr,
    grad: Ptr,
    momentumBuf: Ptr,
    n: number,
    lr: number,
    momentum: number,
    dampening: number,
    weightDecay: number,
    nesterov: boolean,
    first: boolean,
  ): void;
  adamwStep(
    param: Ptr,
    grad: Ptr,
    m: Ptr,
    v: Ptr,
    /** 0, or the steps since each coordinate last had a gradient (sparse gradients: ffi/numerics.h) */
    age: Ptr,
    n: number,
    lr: number,
    beta1: number,
    beta2: number,
    eps: number,
    weightDecay: number,
    biasCorrection1: number,
    biasCorrection2: number,
  ): void;

  // ---- casts ----
  castF32ToBF16(out: Ptr, inp: Ptr, n: number): void;
  castBF16ToF32(out: Ptr, inp: Ptr, n: number): void;
  castF32ToF16(out: Ptr, inp: Ptr, n: number): void;
  castF16ToF32(out: Ptr, inp: Ptr, n: number): void;

  /** release native resources; the backend is unusable afterwards */
  dispose(): void;
}
