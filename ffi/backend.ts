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

/** What C of a GEMM holds: f32, or (with 2-byte inputs of the same type) bf16 or f16, rounded
 *  from the f32 accumulation. */
export type GemmOutput = "f32" | "bf16" | "f16";

/**
 * One GEMM, row-major: C (M,N) = alpha op(A) op(B) + beta C, where op(A) is (M,K) and op(B) (K,N),
 * or `batch` of them at the strides (in elements; a batch of 1 ignores them). A and B hold `input`
 * elements (default f32; bf16/f16: autocast copies); accumulation is f32, and C holds `output`
 * (default f32; a 2-byte output needs inputs of that type). Leading dimensions are in elements.
 * A zero M, N or batch does nothing; K = 0 makes C = beta C.
 */
export interface GemmDesc {
  input?: GemmInput;
  /** default f32 */
  output?: GemmOutput;
  transA?: boolean;
  transB?: boolean;
  M: number;
  N: number;
  K: number;
  /** default 1 */
  alpha?: number;
  /** default 0 */
  beta?: number;
  A: Ptr;
  lda: number;
  strideA?: number;
  B: Ptr;
  ldb: number;
  strideB?: number;
  C: Ptr;
  ldc: number;
  strideC?: number;
  /** default 1 */
  batch?: number;
  /** what the same call also does (a linear layer's bias, GELU or bias gradient); none by default */
  epilogue?: GemmEpilogue | null;
}

/**
 * What a GEMM does besides the multiply (batch 1), in the terms of the row-major GemmDesc:
 *   bias      C (M,N) = alpha op(A) op(B) + bias, bias (N) f32 added to every row (beta 0)
 *   biasGelu  pre = alpha op(A) op(B) + bias, C = gelu(pre) (GPT-2's tanh form); pre (M,N) has
 *             C's type and leading dimension (beta 0)
 *   biasGrad  dbias (M) f32 += the sums of op(A) over K: A stored (K,M), transA, lda = M (the
 *             output gradient, read by the weight gradient's GEMM)
 *   dgelu     C = gelu'(pre) * alpha op(A) op(B): the gradient of a GELU layer's pre-activation
 *             from the next layer's input-gradient GEMM; pre (M,N) has C's type and leading
 *             dimension (beta 0)
 * A backend fuses it into the GEMM where its library can (cuBLASLt) and otherwise runs the
 * layer kernels after the GEMM (gemmThenKernels): the same result to rounding. `biasCopy`: the
 * bias already rounded to a 2-byte C's type (the parameter's weight copy, engine/params.ts),
 * where the caller has one; a fused epilogue adds that (cuBLASLt takes a 2-byte C's bias in its
 * type) instead of rounding the bias itself.
 */
export type GemmEpilogue =
  | { kind: "bias"; bias: Ptr; biasCopy?: Ptr }
  | { kind: "biasGelu"; bias: Ptr; pre: Ptr; biasCopy?: Ptr }
  | { kind: "biasGrad"; dbias: Ptr }
  | { kind: "dgelu"; pre: Ptr };

/** The element type of a GEMM's A and B as the layer kernels name it. */
export const gemmInputElem = (input: GemmInput): ElemType => (input === "tf32" ? "f32" : input);

/** A GemmDesc with its defaults filled in, checked: sizes whole and not negative, each leading
 *  dimension at least its row. RangeError names the problem. */
export function gemmCall(d: GemmDesc): Required<GemmDesc> {
  const g: Required<GemmDesc> = {
    input: "f32",
    output: "f32",
    transA: false,
    transB: false,
    alpha: 1,
    beta: 0,
    strideA: 0,
    strideB: 0,
    strideC: 0,
    batch: 1,
    epilogue: null,
    ...d,
  };
  if (!Object.hasOwn(gemmInputBytes, g.input)) throw new RangeError(`gemm: unknown input type ${String(g.input)}`);
  if (g.output !== "f32" && g.output !== g.input)
    throw new RangeError(`gemm: a ${String(g.output)} output needs ${String(g.output)} inputs, not ${g.input}`);
  const { M, N, K, lda, ldb, ldc, batch, strideA, strideB, strideC } = g;
  // every GEMM of a step comes through here: checked without allocating
  const whole = (v: number) => Number.isSafeInteger(v) && v >= 0;
  const sizes = whole(M) && whole(N) && whole(K) && whole(lda) && whole(ldb) && whole(ldc) && whole(batch);
  if (!(sizes && whole(strideA) && whole(strideB) && whole(strideC))) {
    throw new RangeError(
      `gemm: invalid sizes M=${M} N=${N} K=${K} batch=${batch} ld=${lda},${ldb},${ldc} strides=${strideA},${strideB},${strideC}`,
    );
  }
  if (lda < (g.transA ? M : K) || ldb < (g.transB ? K : N) || ldc < N) {
    throw new RangeError(
      `gemm: a leading dimension is shorter than its row (lda=${lda} ldb=${ldb} ldc=${ldc}, M=${M} N=${N} K=${K})`,
    );
  }
  const ep = g.epilogue;
  if (ep != null) {
    if (g.batch !== 1) throw new RangeError(`gemm: a ${ep.kind} epilogue needs batch 1, not ${g.batch}`);
    if (ep.kind === "biasGrad") {
      if (!g.transA || g.lda !== M)
        throw new RangeError(
          `gemm: a biasGrad epilogue needs A stored (K,M): transA and lda = M (lda=${g.lda}, M=${M})`,
        );
    } else if (g.beta !== 0 || ldc !== N) {
      throw new RangeError(`gemm: a ${ep.kind} epilogue needs beta 0 and ldc = N (beta=${g.beta} ldc=${ldc} N=${N})`);
    }
  }
  return g;
}

/**
 * g's GEMM by `gemm` (which runs a plain one), then its epilogue by the layer kernels: how a
 * backend without a fused epilogue runs one. biasGelu's GEMM writes pre; dgelu's writes
 * `scratch(bytes)` (the backend's, kept between calls), whose product with the GELU's gradient
 * at pre then goes to C (geluBackward adds into its output: C is zeroed first).
 */
export function gemmThenKernels(
  be: Backend,
  g: Required<GemmDesc>,
  gemm: (g: Required<GemmDesc>) => void,
  scratch: (bytes: number) => Ptr,
): void {
  const ep = g.epilogue;
  const n = g.M * g.N;
  if (ep?.kind === "dgelu" && n > 0) {
    const bytes = n * (g.output === "f32" ? 4 : 2);
    const product = scratch(bytes);
    gemm({ ...g, epilogue: null, C: product });
    be.zero(g.C, bytes);
    be.geluBackward(g.C, ep.pre, product, n, g.output);
    return;
  }
  gemm({ ...g, epilogue: null, C: ep?.kind === "biasGelu" ? ep.pre : g.C });
  if (ep == null) return;
  if (ep.kind === "bias") be.biasAdd(g.C, g.C, ep.bias, g.M, g.N, g.output);
  else if (ep.kind === "biasGelu") be.biasGeluForward(g.C, ep.pre, ep.bias, g.M, g.N, g.output);
  else if (ep.kind === "biasGrad") be.biasBackward(ep.dbias, g.A, g.K, g.M, gemmInputElem(g.input));
}

/** Up to 4 dims, outermost first; unused leading dims are 1. Strides in elements. */
export type Dims4 = readonly [number, number, number, number];

export interface BackendStats {
  /** allocations made by alloc() since the backend was created */
  readonly allocCount: number;
  readonly allocBytes: number;
  /** live (not yet freed) bytes */
  readonly liveBytes: number;
}

/**
 * What a backend's alloc() handed out and free() has not taken back: each live block's size (what
 * free checks a pointer against, and dispose releases) and the counts that stats reports.
 */
export class AllocationLedger {
  readonly #live = new Map<Ptr, number>();
  #allocCount = 0;
  #allocBytes = 0;
  #liveBytes = 0;

  get stats(): BackendStats {
    return { allocCount: this.#allocCount, allocBytes: this.#allocBytes, liveBytes: this.#liveBytes };
  }

  /** Records a block of `bytes` handed out at ptr. */
  add(ptr: Ptr, bytes: number): Allocation {
    this.#live.set(ptr, bytes);
    this.#allocCount++;
    this.#allocBytes += bytes;
    this.#liveBytes += bytes;
    return { ptr, bytes };
  }

  /** Takes a live block off the record and returns its size; an Error where it is not live. */
  remove(allocation: Allocation): number {
    const bytes = this.#live.get(allocation.ptr);
    if (bytes === undefined) throw new Error(`free: ${allocation.ptr} is not a live allocation of this backend`);
    this.#live.delete(allocation.ptr);
    this.#liveBytes -= bytes;
    return bytes;
  }

  /** Empties the record (a backend's dispose) and returns the blocks that were live. */
  clear(): [Ptr, number][] {
    const live = [...this.#live];
    this.#live.clear();
    this.#liveBytes = 0;
    return live;
  }
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
  /** Give memory the backend keeps for reuse (a GPU's caching allocator) back to the system. */
  emptyCache(): void;

  // ---- GEMM: one call, described (GemmDesc) ----
  gemm(desc: GemmDesc): void;

  /** One line on which causal attention runs for inputs of `elem` (for a command's header). */
  describeAttention(elem: ElemType): string;

  // the kernel ops (elementwise, layers, reductions, optimizer updates, casts) are OpMethods,
  // declared once in ffi/ops.ts

  /** release native resources; the backend is unusable afterwards */
  dispose(): void;
}
