// The cuBLAS binding without a GPU: the row-major -> column-major operand swap checked by
// running the column-major call it produces through a plain column-major GEMM, and, where
// libcublas is installed (pip's nvidia-cublas, the CUDA toolkit), every symbol resolving.
import { describe, expect, test } from "bun:test";
import { matmulReference } from "../../engine/ops/matmul.ts";
import { Rng } from "../../engine/rng.ts";
import {
  CUBLAS_OP_T,
  cublasStatusName,
  cublasSymbolNames,
  findCublas,
  loadCublas,
  rowMajorGemm,
} from "../../ffi/cuda/cublas.ts";
import { cublasLtSymbolNames, findCublasLt, loadCublasLt } from "../../ffi/cuda/cublaslt.ts";
import { probeCuda } from "../../ffi/cuda/driver.ts";
import { relErr, transposePairs } from "../helpers/numeric.ts";
import { skip } from "../helpers/skip.ts";

/**
 * Column-major BLAS semantics over flat memory with element offsets as "pointers":
 * C[i + j ldc] = alpha sum_k opA(i,k) opB(k,j) + beta C[i + j ldc], with
 * opA(i,k) = transa ? A[k + i lda] : A[i + k lda] (likewise B).
 */
function columnMajorGemm(
  mem: Float64Array,
  transa: number,
  transb: number,
  m: number,
  n: number,
  k: number,
  A: number,
  lda: number,
  B: number,
  ldb: number,
  C: number,
  ldc: number,
): void {
  for (let j = 0; j < n; j++) {
    for (let i = 0; i < m; i++) {
      let acc = 0;
      for (let p = 0; p < k; p++) {
        const a = transa === CUBLAS_OP_T ? mem[A + p + i * lda]! : mem[A + i + p * lda]!;
        const b = transb === CUBLAS_OP_T ? mem[B + j + p * ldb]! : mem[B + p + j * ldb]!;
        acc += a * b;
      }
      mem[C + i + j * ldc] = acc;
    }
  }
}

describe("rowMajorGemm", () => {
  const shapes: [number, number, number][] = [
    [1, 1, 1],
    [3, 5, 7],
    [8, 2, 9],
    [13, 17, 4],
  ];
  describe.each(shapes)("M=%i N=%i K=%i", (M, N, K) => {
    test.each(transposePairs)("transA=%p transB=%p", (tA, tB) => {
      const rng = new Rng(M * 100 + N * 10 + K + (tA ? 1 : 0) + (tB ? 2 : 0));
      const a = Float64Array.from({ length: M * K }, () => rng.normal());
      const b = Float64Array.from({ length: K * N }, () => rng.normal());
      // one flat memory: a at 0, b after it, then C
      const [Aoff, Boff, Coff] = [0, M * K, M * K + K * N];
      const mem = new Float64Array(Coff + M * N);
      mem.set(a, Aoff);
      mem.set(b, Boff);
      const lda = tA ? M : K;
      const ldb = tB ? K : N;
      const g = rowMajorGemm(tA, tB, M, N, K, Aoff, lda, 0, Boff, ldb, 0, Coff, N, 0);
      columnMajorGemm(mem, g.transa, g.transb, g.m, g.n, g.k, g.A, g.lda, g.B, g.ldb, g.C, g.ldc);
      expect(relErr(mem.subarray(Coff), matmulReference(a, b, M, N, K, tA, tB))).toBeLessThanOrEqual(1e-12);
    });
  });

  test("batched strides follow their operands through the swap", () => {
    const g = rowMajorGemm(false, true, 4, 6, 5, 1000, 5, 20, 2000, 5, 30, 3000, 6, 24);
    expect(g).toEqual({
      transa: CUBLAS_OP_T,
      transb: 0,
      m: 6,
      n: 4,
      k: 5,
      A: 2000,
      lda: 5,
      strideA: 30,
      B: 1000,
      ldb: 5,
      strideB: 20,
      C: 3000,
      ldc: 6,
      strideC: 24,
    });
  });
});

const cublasPath = findCublas();
const cublasMissing =
  cublasPath === null ? "no libcublas on this machine (pip install nvidia-cublas, or set MESHTRAIN_CUBLAS)" : null;

describe("libcublas", () => {
  test.skipIf(skip("libcublas", cublasMissing))("every symbol the binding declares resolves", () => {
    const lib = loadCublas(cublasPath);
    expect(
      cublasSymbolNames.every((name) => typeof (lib.symbols as Record<string, unknown>)[name] === "function"),
    ).toBe(true);
    expect(cublasStatusName(lib, 13)).toBe("CUBLAS_STATUS_EXECUTION_FAILED");
  });

  const ltPath = findCublasLt();
  test.skipIf(skip("libcublasLt", ltPath === null ? "no libcublasLt on this machine" : null))(
    "every cuBLASLt symbol the binding declares resolves",
    () => {
      const lib = loadCublasLt(ltPath);
      for (const name of cublasLtSymbolNames)
        expect(typeof (lib.symbols as Record<string, unknown>)[name], name).toBe("function");
      expect(Number(lib.symbols.cublasLtGetVersion())).toBeGreaterThan(0);
    },
  );

  test.skipIf(
    skip("libcublas", cublasMissing) || skip("a machine without a GPU", probeCuda().ok ? "a GPU is present" : null),
  )("without a GPU, creating a handle is a typed CublasError, not a crash", async () => {
    const { Cublas, CublasError } = await import("../../ffi/cuda/cublas.ts");
    const lib = loadCublas(cublasPath);
    const scalars = new Float32Array(2);
    let error: unknown;
    try {
      new Cublas(lib, 0n, scalars, 0);
    } catch (e) {
      error = e;
    }
    expect(error).toBeInstanceOf(CublasError);
    expect((error as InstanceType<typeof CublasError>).message).toMatch(
      /^cublasCreate_v2 failed: CUBLAS_STATUS_\w+ \(\d+\)$/,
    );
  });
});
