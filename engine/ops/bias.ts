// biasAdd: out (...,C) = inp (...,C) + bias (C). Rows N = numel / C.
import { ShapeError } from "../errors.ts";
import type { Tensor } from "../tensor.ts";
import { checkDType, checkInputs, checkRank, lastDim } from "./check.ts";

export function biasAdd(inp: Tensor, bias: Tensor): Tensor {
  const ctx = checkInputs("biasAdd", [inp, bias]);
  checkDType("biasAdd", inp, "f32");
  checkDType("biasAdd", bias, "f32");
  checkRank("biasAdd", bias, [1], [inp.shape, bias.shape]);
  const C = bias.shape[0]!;
  if (lastDim(inp.shape) !== C)
    throw new ShapeError("biasAdd", [inp.shape, bias.shape], "last dim of inp must equal bias length");
  const N = inp.numel / C;
  const be = ctx.backend;
  const out = ctx.empty(inp.shape);
  be.biasAdd(out.ptr, inp.ptr, bias.ptr, N, C, "f32");
  ctx.record(
    "biasAdd",
    [inp, bias],
    out,
    () => {
      // forward was: out[n,c] = inp[n,c] + bias[c]
      const dout = out.grad!.ptr;
      if (inp.requiresGrad) be.axpy(inp.ensureGrad().ptr, dout, out.numel, 1);
      if (bias.requiresGrad) be.biasBackward(bias.ensureGrad().ptr, dout, N, C, "f32");
    },
    [],
  );
  return out;
}

// ---- float64 reference --------------------------------------------------------------------

export function biasAddReference(inp: Float64Array, bias: Float64Array, N: number, C: number): Float64Array {
  const out = new Float64Array(N * C);
  for (let n = 0; n < N; n++) for (let c = 0; c < C; c++) out[n * C + c] = inp[n * C + c]! + bias[c]!;
  return out;
}

export function biasAddBackwardReference(dout: Float64Array, N: number, C: number) {
  const dbias = new Float64Array(C);
  for (let n = 0; n < N; n++) for (let c = 0; c < C; c++) dbias[c] = dbias[c]! + dout[n * C + c]!;
  return { dinp: Float64Array.from(dout), dbias };
}
