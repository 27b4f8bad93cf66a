// CPU backend: OpenBLAS's cblas_sgemm and the kernels of kernels.c, called through bun:ffi.
//
// Memory safety: backend memory comes from mt_alloc (posix_memalign, or mmap for large blocks), never from a
// JavaScript ArrayBuffer, so the garbage collector can never free or move memory that native
// code holds. The only JavaScript memory native code ever sees is the source or destination
// of upload/download, and those calls are synchronous: the TypedArray argument stays
// referenced by the caller's frame for the whole call.
import { dlopen, FFIType, ptr as addressOf, type Pointer } from "bun:ffi";
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
import { OutOfMemoryError } from "../errors.ts";
import { cArgTypes, type OpDecl, type OpMethods, type OpName, ops, passesStraight, toCArgs } from "../ops.ts";
import { ensureKernelLibrary } from "./build.ts";

const CblasRowMajor = 101;
const CblasNoTrans = 111;
const CblasTrans = 112;

/** The 2-byte GEMM's scratch grows in steps of this many bytes, so a run of slightly larger GEMMs
 *  does not reallocate each time. */
const scratchGrainBytes = 64 * 1024;
const alignBytes = 64;
const alignUp = (n: number, to: number) => Math.ceil(n / to) * to;

/**
 * Elements a strided-batched GEMM operand spans: `batch` matrices of `rows` rows of `cols`
 * elements, rows `ld` apart and matrices `stride` apart (batch 1 ignores the stride).
 */
export function gemmOperandElems(rows: number, cols: number, ld: number, stride: number, batch: number): number {
  const one = (rows - 1) * ld + cols;
  return batch === 1 ? one : (batch - 1) * stride + one;
}

const operand = ["ptr", "i64", "i64"] as const;

function loadLibraries() {
  const { kernels, openblas } = ensureKernelLibrary();
  const blas = dlopen(openblas, {
    cblas_sgemm: {
      args: ["i32", "i32", "i32", "i32", "i32", "i32", "f32", "ptr", "i32", "ptr", "i32", "f32", "ptr", "i32"],
      returns: "void",
    },
    cblas_sgemv: {
      args: ["i32", "i32", "i32", "i32", "f32", "ptr", "i32", "ptr", "i32", "f32", "ptr", "i32"],
      returns: "void",
    },
    openblas_get_num_threads: { args: [], returns: "i32" },
  });
  const k = dlopen(kernels, {
    mt_alloc: { args: ["i64"], returns: "ptr" },
    mt_free: { args: ["ptr", "i64"], returns: "void" },
    mt_copy: { args: ["ptr", "ptr", "i64"], returns: "void" },
    mt_zero: { args: ["ptr", "i64"], returns: "void" },
    mt_fill_f32: { args: ["ptr", "i64", "f32"], returns: "void" },
    mt_num_threads: { args: [], returns: "i32" },
    // transA, transB, M, N, K, alpha, A, B, beta, C, batch; each operand its pointer, leading
    // dimension and batch stride
    mt_sgemm_strided_batched: {
      args: ["i32", "i32", "i64", "i64", "i64", "f32", ...operand, ...operand, "f32", ...operand, "i64"],
      returns: "void",
    },
  });
  // every op's kernel, its parameters derived from its declaration (ffi/ops.ts)
  const table: Record<string, { args: FFIType[]; returns: FFIType }> = {};
  for (const d of Object.values(ops) as OpDecl[]) {
    const returns = d.result === "void" ? FFIType.void : d.result === "i64" ? FFIType.i64_fast : FFIType.f64;
    table[d.cpu] = { args: cArgTypes(d).map((t) => ffiTypes[t]), returns };
  }
  const kernelOps = dlopen(kernels, table);
  return { blas, k, ops: kernelOps.symbols as Record<string, (...args: unknown[]) => unknown> };
}

const ffiTypes = { ptr: FFIType.ptr, i64: FFIType.i64, f32: FFIType.f32, u64: FFIType.u64, i32: FFIType.i32 } as const;

/** The method of op `d` over its C kernel: the kernel itself when the arguments pass as they are. */
function cpuMethod(d: OpDecl, kernel: (...args: unknown[]) => unknown): (...args: unknown[]) => unknown {
  if (passesStraight(d)) return kernel;
  const n = d.args.length;
  // inRange (the last, optional argument) means nothing on the CPU: the count costs no wait
  return (...args: unknown[]) => kernel(...toCArgs(d, args.length > n ? args.slice(0, n) : args));
}

type Libraries = ReturnType<typeof loadLibraries>;
let libraries: Libraries | undefined;

// bun:ffi's "ptr" arguments take a number; its Pointer type is a branded number.
const p = (x: Ptr): Pointer => x as Pointer;

function hostAddress(view: ArrayBufferView): Pointer {
  return addressOf(view as Uint8Array);
}

// the op methods are made from their declarations in the constructor
// biome-ignore lint/suspicious/noUnsafeDeclarationMerging: the class fills these in
export interface CpuBackend extends OpMethods {}

// biome-ignore lint/suspicious/noUnsafeDeclarationMerging: see above
export class CpuBackend implements Backend {
  readonly name = "cpu";
  readonly #lib: Libraries;
  readonly #ledger = new AllocationLedger();
  #disposed = false;
  /** The 2-byte GEMM's f32 copies of A and B: owned by the backend, grown on demand, never
   *  shrunk, freed by dispose(). Once the first training step has seen every GEMM shape, no
   *  2-byte GEMM allocates (its growth shows in stats.allocCount like any allocation). */
  #scratch: Allocation | null = null;
  #epilogueScratch: Allocation | null = null;

  constructor() {
    libraries ??= loadLibraries();
    this.#lib = libraries;
    // the op methods (OpMethods), each straight to its kernel
    const self = this as unknown as Record<string, unknown>;
    for (const [name, d] of Object.entries(ops) as [OpName, OpDecl][]) self[name] = cpuMethod(d, this.#lib.ops[d.cpu]!);
  }

  get stats() {
    return this.#ledger.stats;
  }

  /** threads the kernels and OpenBLAS use (OMP_NUM_THREADS, else all cores) */
  get threads(): number {
    return this.#lib.k.symbols.mt_num_threads();
  }

  alloc(bytes: number): Allocation {
    if (this.#disposed) throw new Error("CpuBackend used after dispose()");
    if (!Number.isSafeInteger(bytes) || bytes < 0) throw new RangeError(`alloc: invalid byte count ${bytes}`);
    const address = this.#lib.k.symbols.mt_alloc(bytes);
    if (address === null || address === 0) throw new OutOfMemoryError(this.name, bytes);
    return this.#ledger.add(Number(address), bytes);
  }

  free(allocation: Allocation): void {
    const bytes = this.#ledger.remove(allocation);
    this.#lib.k.symbols.mt_free(p(allocation.ptr), bytes);
  }

  upload(dst: Ptr, src: ArrayBufferView): void {
    if (src.byteLength === 0) return;
    this.#lib.k.symbols.mt_copy(p(dst), hostAddress(src), src.byteLength);
  }

  download(src: Ptr, dst: ArrayBufferView): void {
    if (dst.byteLength === 0) return;
    this.#lib.k.symbols.mt_copy(hostAddress(dst), p(src), dst.byteLength);
  }

  copy(dst: Ptr, src: Ptr, bytes: number): void {
    this.#lib.k.symbols.mt_copy(p(dst), p(src), bytes);
  }
  zero(dst: Ptr, bytes: number): void {
    this.#lib.k.symbols.mt_zero(p(dst), bytes);
  }
  fill(dst: Ptr, n: number, value: number): void {
    this.#lib.k.symbols.mt_fill_f32(p(dst), n, value);
  }
  synchronize(): void {
    // CPU kernels are synchronous.
  }

  emptyCache(): void {
    // nothing kept: mt_alloc and mt_free go straight to the C allocator
  }

  describeAttention(elem: ElemType): string {
    return `fused C kernels (f32 sums${elem === "f32" ? "" : `, ${elem} products`})`;
  }

  /**
   * A CPU has no 2-byte or TF32 multiply units that OpenBLAS uses, so:
   *   f32, tf32  sgemm on the f32 inputs (tf32 thus computes in full f32, which is more precise)
   *   bf16, f16  widen the whole extent of A and B to f32 in the scratch (exact: every 2-byte
   *              value is an f32), then sgemm. Products and sums are f32, as on tensor cores.
   */
  gemm(desc: GemmDesc): void {
    const g = gemmCall(desc);
    // an epilogue runs as the layer kernels (the same ones the layers call unfused)
    gemmThenKernels(
      this,
      g,
      (plain) => this.#gemm(plain),
      (bytes) => this.#epilogueScratchFor(bytes),
    );
  }

  #gemm(g: Required<GemmDesc>): void {
    if (g.M === 0 || g.N === 0 || g.batch === 0) return;
    // K = 0 reads neither operand (C = beta C); BLAS wants every leading dimension >= 1
    const lds = { lda: Math.max(1, g.lda), ldb: Math.max(1, g.ldb) };
    if (g.output === "f32" && (g.input === "f32" || g.input === "tf32" || g.K === 0)) {
      this.#sgemm({ ...g, ...lds });
      return;
    }
    const { M, N, K, transA, transB, batch } = g;
    // A is stored (M,K), or (K,M) with transA; B (K,N), or (N,K) with transB
    const nA = K === 0 ? 0 : gemmOperandElems(transA ? K : M, transA ? M : K, g.lda, g.strideA, batch);
    const nB = K === 0 ? 0 : gemmOperandElems(transB ? N : K, transB ? K : N, g.ldb, g.strideB, batch);
    const wide = g.output === "f32" ? 0 : gemmOperandElems(M, N, g.ldc, g.strideC, batch);
    const offsetB = alignUp(nA * 4, alignBytes);
    const offsetC = offsetB + alignUp(nB * 4, alignBytes);
    const scratch = this.#scratchFor(offsetC + wide * 4);
    if (nA > 0) this.#widen(g.input as "bf16" | "f16", scratch, g.A, nA);
    if (nB > 0) this.#widen(g.input as "bf16" | "f16", scratch + offsetB, g.B, nB);
    const [A, B] = nA > 0 ? [scratch, scratch + offsetB] : [g.A, g.B];
    if (g.output === "f32") {
      this.#sgemm({ ...g, ...lds, A, B });
      return;
    }
    // a 2-byte C: widened whole (exact; elements between rows come back unchanged), multiplied
    // into in f32, then rounded back to nearest even
    const C = scratch + offsetC;
    this.#widen(g.output, C, g.C, wide);
    this.#sgemm({ ...g, ...lds, A, B, C });
    if (g.output === "bf16") this.castF32ToBF16(g.C, C, wide);
    else this.castF32ToF16(g.C, C, wide);
  }

  /**
   * One row of C (M = 1: a generated token's layers) as a matrix-vector product: OpenBLAS 0.3.21's
   * sgemm packs all of B for one row of A, which doubles the bytes a memory-bound product moves
   * (newer OpenBLAS forwards such calls to gemv itself). C (1,N) = alpha op(A) (1,K) op(B) (K,N)
   * + beta C; with beta 0, C is zeroed first: BLAS may scale it by beta, and 0 * NaN (an arena's
   * poison) is NaN.
   */
  #sgemv(g: Required<GemmDesc>): void {
    const { transA, transB, N, K, alpha, A, lda, B, ldb, beta, C } = g;
    if (beta === 0) this.zero(C, N * 4);
    // A's one row: contiguous, or with transA a column of A stored (K,1), lda apart
    const incA = transA ? lda : 1;
    // transB: B stored (N,K), y = B x; else stored (K,N), y = B^T x
    const [rows, cols] = transB ? [N, K] : [K, N];
    this.#lib.blas.symbols.cblas_sgemv(
      CblasRowMajor,
      transB ? CblasNoTrans : CblasTrans,
      rows,
      cols,
      alpha,
      p(B),
      ldb,
      p(A),
      incA,
      beta,
      p(C),
      1,
    );
  }

  /** One GEMM goes straight to cblas_sgemm: through the batched kernel's (inactive) OpenMP
   *  region OpenBLAS ran it on one thread (measured: 110 against 170 GFLOP/s on 2 cores). */
  #sgemm(g: Required<GemmDesc>): void {
    const { transA, transB, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc } = g;
    if (g.batch === 1 && M === 1 && K > 0) {
      this.#sgemv(g);
      return;
    }
    if (g.batch === 1) {
      this.#lib.blas.symbols.cblas_sgemm(
        CblasRowMajor,
        transA ? CblasTrans : CblasNoTrans,
        transB ? CblasTrans : CblasNoTrans,
        M,
        N,
        K,
        alpha,
        p(A),
        lda,
        p(B),
        ldb,
        beta,
        p(C),
        ldc,
      );
      return;
    }
    this.#lib.k.symbols.mt_sgemm_strided_batched(
      transA ? 1 : 0,
      transB ? 1 : 0,
      M,
      N,
      K,
      alpha,
      p(A),
      lda,
      g.strideA,
      p(B),
      ldb,
      g.strideB,
      beta,
      p(C),
      ldc,
      g.strideC,
      g.batch,
    );
  }

  #widen(input: "bf16" | "f16", out: Ptr, inp: Ptr, n: number): void {
    if (input === "bf16") this.castBF16ToF32(out, inp, n);
    else this.castF16ToF32(out, inp, n);
  }

  /** The dgelu epilogue's product (apart from #scratch, which the GEMM itself uses), kept. */
  #epilogueScratchFor(bytes: number): Ptr {
    if (this.#epilogueScratch === null || this.#epilogueScratch.bytes < bytes) {
      if (this.#epilogueScratch !== null) this.free(this.#epilogueScratch);
      this.#epilogueScratch = null;
      this.#epilogueScratch = this.alloc(alignUp(bytes, scratchGrainBytes));
    }
    return this.#epilogueScratch.ptr;
  }

  #scratchFor(bytes: number): Ptr {
    if (this.#scratch === null || this.#scratch.bytes < bytes) {
      if (this.#scratch !== null) this.free(this.#scratch);
      this.#scratch = null; // an alloc failure must not leave a freed block here
      this.#scratch = this.alloc(alignUp(bytes, scratchGrainBytes));
    }
    return this.#scratch.ptr;
  }

  dispose(): void {
    for (const [ptr, bytes] of this.#ledger.clear()) this.#lib.k.symbols.mt_free(p(ptr), bytes);
    this.#scratch = null;
    this.#epilogueScratch = null;
    this.#disposed = true;
  }
}
