// matmul: out = op(a) @ op(b), op = identity or transpose, for 2-D operands or batches.
//
//   a (..., M, K) or, with transA, (..., K, M)
//   b (..., K, N) or, with transB, (..., N, K)      (same leading batch dims as a)
//   or b 2-D with an n-D a (shared weights, x @ W^T): a's leading dims are folded into M.
//   out (..., M, N)
//
// Under autocast (Context.precision bf16 or f16) the GEMMs read 2-byte copies of a, b and
// dout and accumulate in f32 into the f32 out, da and db (engine/mixed.ts). An operand already
// in the autocast type (a bf16 activation) is read as it is, and its gradient is written in
// that type.
import type { Backend, DType, GemmEpilogue, GemmInput, GemmOutput, Ptr } from "../../ffi/backend.ts";
import { ShapeError } from "../errors.ts";
import { autocastDType } from "../mixed.ts";
import { castCopy } from "./cast.ts";
import { weightCopy } from "../params.ts";
import { numelOf, type Tensor } from "../tensor.ts";
import { checkActivationDType, checkInputs, checkOutDType } from "./check.ts";

export interface MatmulOptions {
  transA?: boolean;
  transB?: boolean;
  /** the output's type: f32 (default), or the autocast type for an output that an op reading
   *  2-byte inputs takes (the head's logits, under autocast, for the loss) */
  out?: DType;
}

interface Plan {
  batch: number;
  M: number;
  N: number;
  K: number;
  outShape: number[];
}

function plan(a: Tensor, b: Tensor, transA: boolean, transB: boolean): Plan {
  const shapes = [a.shape, b.shape];
  if (a.shape.length < 2 || b.shape.length < 2) throw new ShapeError("matmul", shapes, "operands need at least 2 dims");
  const ar = a.shape[a.shape.length - 2]!,
    ac = a.shape[a.shape.length - 1]!;
  const br = b.shape[b.shape.length - 2]!,
    bc = b.shape[b.shape.length - 1]!;
  const N = transB ? br : bc;
  const Kb = transB ? bc : br;
  if (b.shape.length === 2 && a.shape.length > 2) {
    // fold a's leading dims into M (shared weights)
    if (transA) throw new ShapeError("matmul", shapes, "transA with a 2-D b needs a 2-D a");
    if (ac !== Kb) throw new ShapeError("matmul", shapes, `inner dims differ (${ac} vs ${Kb})`);
    return { batch: 1, M: a.numel / ac, N, K: ac, outShape: [...a.shape.slice(0, -1), N] };
  }
  if (a.shape.length !== b.shape.length) throw new ShapeError("matmul", shapes, "batched operands need the same rank");
  const batchDims = a.shape.slice(0, -2);
  if (batchDims.some((d, i) => d !== b.shape[i])) throw new ShapeError("matmul", shapes, "batch dims differ");
  const M = transA ? ac : ar;
  const K = transA ? ar : ac;
  if (K !== Kb) throw new ShapeError("matmul", shapes, `inner dims differ (${K} vs ${Kb})`);
  return { batch: numelOf(batchDims), M, N, K, outShape: [...batchDims, M, N] };
}

/** C = op(A) op(B) + beta C over `batch` contiguous matrices whose A and B hold `input` elements
 *  and C `output` ones, with an epilogue (a linear layer's bias, GELU or bias gradient) where
 *  one is given. */
export function gemm(
  be: Backend,
  input: GemmInput,
  output: GemmOutput,
  batch: number,
  tA: boolean,
  tB: boolean,
  M: number,
  N: number,
  K: number,
  A: Ptr,
  B: Ptr,
  beta: number,
  C: Ptr,
  epilogue: GemmEpilogue | null = null,
): void {
  be.gemm({
    input,
    output,
    transA: tA,
    transB: tB,
    M,
    N,
    K,
    A,
    lda: tA ? M : K,
    strideA: M * K,
    B,
    ldb: tB ? K : N,
    strideB: K * N,
    beta,
    C,
    ldc: N,
    strideC: M * N,
    batch,
    epilogue,
  });
}

/** What a GEMM of this precision reads of t: t itself (f32 GEMMs, or t already in the autocast
 *  type), a parameter's view into its store's 2-byte copy (cast once per step, engine/params.ts
 *  weightCopy), or a 2-byte autocast copy made now. */
export const gemmOperand = (t: Tensor, half: "bf16" | "f16" | null): Tensor =>
  half === null || t.dtype === half ? t : (weightCopy(t, half) ?? castCopy(t, half));

/** What a GEMM that writes a tensor's gradient writes: its type (a bf16 activation's is bf16). */
export const gradOutput = (t: Tensor): GemmOutput => t.dtype as GemmOutput;

export function matmul(a: Tensor, b: Tensor, options: MatmulOptions = {}): Tensor {
  const ctx = checkInputs("matmul", [a, b]);
  checkActivationDType("matmul", a);
  checkActivationDType("matmul", b);
  const tA = options.transA ?? false;
  const tB = options.transB ?? false;
  const { batch, M, N, K, outShape } = plan(a, b, tA, tB);
  const be = ctx.backend;
  const elem = checkOutDType("matmul", ctx, options.out ?? "f32");
  const input: GemmInput = ctx.precision; // fixed for this op's backward too
  const half = autocastDType(input);
  // a16, b16: a and b as the GEMMs read them (2-byte copies under autocast), kept for backward
  const a16 = gemmOperand(a, half);
  const b16 = gemmOperand(b, half);
  const out = ctx.empty(outShape, elem);
  gemm(be, input, elem, batch, tA, tB, M, N, K, a16.ptr, b16.ptr, 0, out.ptr);
  // backward reads b16 for a's gradient and a16 for b's
  const saved = [...(a.requiresGrad ? [b16] : []), ...(b.requiresGrad ? [a16] : [])];
  ctx.record(
    "matmul",
    [a, b],
    out,
    () => {
      const dout16 = gemmOperand(out.grad!, half); // (M,N), cast once for both gradients
      const dout = dout16.ptr;
      if (a.requiresGrad) {
        const { grad, fresh } = a.gradForWrite();
        const [da, beta, o] = [grad.ptr, fresh ? 0 : 1, gradOutput(a)];
        // forward was: out = op(a) op(b)  =>  d op(a) = dout op(b)^T
        if (!tA)
          gemm(be, input, o, batch, false, !tB, M, K, N, dout, b16.ptr, beta, da); // da (M,K)
        else gemm(be, input, o, batch, tB, true, K, M, N, b16.ptr, dout, beta, da); // da (K,M) = op(b) dout^T
      }
      if (b.requiresGrad) {
        const { grad, fresh } = b.gradForWrite();
        const [db, beta, o] = [grad.ptr, fresh ? 0 : 1, gradOutput(b)];
        // d op(b) = op(a)^T dout
        if (!tB)
          gemm(be, input, o, batch, !tA, false, K, N, M, a16.ptr, dout, beta, db); // db (K,N)
        else gemm(be, input, o, batch, true, tA, N, K, M, dout, a16.ptr, beta, db); // db (N,K) = dout^T op(a)
      }
      if (dout16 !== out.grad) dout16.drop();
    },
    saved,
  );
  // the autocast copies are this op's own: kept only while backward needs them
  if (a16 !== a) a16.drop();
  if (b16 !== b) b16.drop();
  return out;
}

// ---- float64 reference --------------------------------------------------------------------

/** A product's sizes, out (M,N) = op(a) (M,K) op(b) (K,N), and whether a and b are stored transposed. */
type MatmulDims = [M: number, N: number, K: number, transA?: boolean, transB?: boolean];

/** Each term of out = op(a) op(b), k innermost: where it adds (in out), and where its factors
 *  op(a)[i,k] and op(b)[k,j] are stored (row-major, as the flags say). */
function forEachTerm(
  [M, N, K, transA = false, transB = false]: MatmulDims,
  term: (oi: number, ai: number, bi: number) => void,
): void {
  for (let i = 0; i < M; i++)
    for (let j = 0; j < N; j++)
      for (let k = 0; k < K; k++) term(i * N + j, transA ? k * M + i : i * K + k, transB ? j * K + k : k * N + j);
}

/** out (M,N) = op(a) op(b); a, b stored row-major as the flags say. */
export function matmulReference(a: Float64Array, b: Float64Array, ...dims: MatmulDims): Float64Array {
  const out = new Float64Array(dims[0] * dims[1]);
  forEachTerm(dims, (oi, ai, bi) => {
    out[oi] = out[oi]! + a[ai]! * b[bi]!;
  });
  return out;
}

/** Gradients of sum(out * dout) with respect to a and b, in their stored layouts. */
export function matmulBackwardReference(
  a: Float64Array,
  b: Float64Array,
  dout: Float64Array,
  ...dims: MatmulDims
): { da: Float64Array; db: Float64Array } {
  const [M, N, K] = dims;
  const da = new Float64Array(M * K);
  const db = new Float64Array(K * N);
  forEachTerm(dims, (oi, ai, bi) => {
    da[ai] = da[ai]! + dout[oi]! * b[bi]!;
    db[bi] = db[bi]! + dout[oi]! * a[ai]!;
  });
  return { da, db };
}
