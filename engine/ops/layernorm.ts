// layerNorm over the last dim C:
//   out (N,C) = (inp - mean) * rstd * weight + bias, mean/rstd (N) saved for the backward.
// inp, weight and bias are f32; out is f32 or, for a norm that only a GEMM reads, the autocast
// type (`outDType`, engine/mixed.ts), and its gradient has out's type.
import { ShapeError } from "../errors.ts";
import { dropAll, sameShape, type Tensor } from "../tensor.ts";
import { addBackward } from "./add.ts";
import type { DType, ElemType } from "../../ffi/backend.ts";
import { checkDType, checkInputs, checkOutDType, lastDim } from "./check.ts";

export const layerNormEps = 1e-5;

export function layerNorm(
  inp: Tensor,
  weight: Tensor,
  bias: Tensor,
  eps = layerNormEps,
  outDType: DType = "f32",
): Tensor {
  const ctx = checkInputs("layerNorm", [inp, weight, bias]);
  for (const t of [inp, weight, bias]) checkDType("layerNorm", t, "f32");
  const elem = checkOutDType("layerNorm", ctx, outDType);
  const C = lastDim(inp.shape);
  if (weight.shape.length !== 1 || bias.shape.length !== 1 || weight.shape[0] !== C || bias.shape[0] !== C) {
    throw new ShapeError(
      "layerNorm",
      [inp.shape, weight.shape, bias.shape],
      "weight and bias must be (C) with C = last dim of inp",
    );
  }
  const N = inp.numel / C;
  const be = ctx.backend;
  const out = ctx.empty(inp.shape, elem);
  const mean = ctx.empty([N]);
  const rstd = ctx.empty([N]);
  be.layerNormForward(out.ptr, mean.ptr, rstd.ptr, inp.ptr, weight.ptr, bias.ptr, N, C, eps, elem);
  recordLayerNorm(inp, weight, bias, out, mean, rstd);
  return out;
}

/**
 * sum = x + d and out = layerNorm(sum): a residual add and the LayerNorm that reads it, in one
 * pass over memory (Backend.residualLayerNormForward). Backward is the two ops' own: an add node
 * and a LayerNorm node, so the sum's gradient gathers from both of its readers as usual.
 */
export function residualLayerNorm(
  x: Tensor,
  d: Tensor,
  weight: Tensor,
  bias: Tensor,
  eps = layerNormEps,
  outDType: DType = "f32",
): { sum: Tensor; out: Tensor } {
  const ctx = checkInputs("residualLayerNorm", [x, d, weight, bias]);
  for (const t of [x, d, weight, bias]) checkDType("residualLayerNorm", t, "f32");
  const elem = checkOutDType("residualLayerNorm", ctx, outDType);
  const C = lastDim(x.shape);
  if (
    !sameShape(x.shape, d.shape) ||
    weight.shape.length !== 1 ||
    bias.shape.length !== 1 ||
    weight.shape[0] !== C ||
    bias.shape[0] !== C
  ) {
    throw new ShapeError(
      "residualLayerNorm",
      [x.shape, d.shape, weight.shape],
      "x and d must have one shape, weight and bias (C) with C = its last dim",
    );
  }
  const N = x.numel / C;
  const sum = ctx.empty(x.shape);
  const out = ctx.empty(x.shape, elem);
  const mean = ctx.empty([N]);
  const rstd = ctx.empty([N]);
  ctx.backend.residualLayerNormForward(
    sum.ptr,
    out.ptr,
    mean.ptr,
    rstd.ptr,
    x.ptr,
    d.ptr,
    weight.ptr,
    bias.ptr,
    N,
    C,
    eps,
    elem,
  );
  ctx.record("add", [x, d], sum, () => addBackward(sum, x, d), []);
  recordLayerNorm(sum, weight, bias, out, mean, rstd);
  return { sum, out };
}

/** LayerNorm's tape node: backward reads inp, weight, mean and rstd (mean and rstd are the op's
 *  own, dropped here: they live while the node needs them). */
function recordLayerNorm(inp: Tensor, weight: Tensor, bias: Tensor, out: Tensor, mean: Tensor, rstd: Tensor): void {
  const ctx = inp.ctx;
  const be = ctx.backend;
  const C = lastDim(inp.shape);
  const N = inp.numel / C;
  ctx.record(
    "layerNorm",
    [inp, weight, bias],
    out,
    () => {
      // the kernel writes all three gradients; ones that are not wanted go to scratch
      const scratch: Tensor[] = [];
      const into = (t: Tensor, zeroed: boolean) => {
        if (t.requiresGrad) return t.ensureGrad().ptr;
        const s = zeroed ? ctx.zeros(t.shape) : ctx.empty(t.shape);
        scratch.push(s);
        return s.ptr;
      };
      const [dinp, dweight, dbias] = [into(inp, false), into(weight, true), into(bias, true)];
      const dout = out.grad!.ptr;
      be.layerNormBackward(
        dinp,
        dweight,
        dbias,
        dout,
        inp.ptr,
        weight.ptr,
        mean.ptr,
        rstd.ptr,
        N,
        C,
        out.dtype as ElemType,
      );
      dropAll(...scratch);
    },
    [inp, weight, mean, rstd],
  );
  dropAll(mean, rstd);
}

// ---- float64 reference --------------------------------------------------------------------

export function layerNormReference(
  inp: Float64Array,
  weight: Float64Array,
  bias: Float64Array,
  N: number,
  C: number,
  eps = layerNormEps,
) {
  const out = new Float64Array(N * C);
  const mean = new Float64Array(N);
  const rstd = new Float64Array(N);
  for (let n = 0; n < N; n++) {
    let m = 0;
    for (let c = 0; c < C; c++) m += inp[n * C + c]!;
    m /= C;
    let v = 0;
    for (let c = 0; c < C; c++) v += (inp[n * C + c]! - m) ** 2;
    v /= C;
    const s = 1 / Math.sqrt(v + eps);
    for (let c = 0; c < C; c++) out[n * C + c] = (inp[n * C + c]! - m) * s * weight[c]! + bias[c]!;
    mean[n] = m;
    rstd[n] = s;
  }
  return { out, mean, rstd };
}

// forward was: out = norm * weight + bias, norm = (x - mean) * rstd
// dnorm = dout * weight; dx = rstd (dnorm - mean(dnorm) - norm mean(dnorm norm))
export function layerNormBackwardReference(
  inp: Float64Array,
  weight: Float64Array,
  dout: Float64Array,
  N: number,
  C: number,
  eps = layerNormEps,
) {
  const { mean, rstd } = layerNormReference(inp, weight, new Float64Array(C), N, C, eps);
  const dinp = new Float64Array(N * C);
  const dweight = new Float64Array(C);
  const dbias = new Float64Array(C);
  for (let n = 0; n < N; n++) {
    let dm = 0;
    let dnm = 0;
    for (let c = 0; c < C; c++) {
      const norm = (inp[n * C + c]! - mean[n]!) * rstd[n]!;
      const dnorm = weight[c]! * dout[n * C + c]!;
      dm += dnorm;
      dnm += dnorm * norm;
    }
    dm /= C;
    dnm /= C;
    for (let c = 0; c < C; c++) {
      const norm = (inp[n * C + c]! - mean[n]!) * rstd[n]!;
      const dnorm = weight[c]! * dout[n * C + c]!;
      dbias[c] = dbias[c]! + dout[n * C + c]!;
      dweight[c] = dweight[c]! + norm * dout[n * C + c]!;
      dinp[n * C + c] = (dnorm - dm - norm * dnm) * rstd[n]!;
    }
  }
  return { dinp, dweight, dbias };
}
