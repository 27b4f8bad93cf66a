// relu: out = max(inp, 0), elementwise.
import type { Tensor } from "../tensor.ts";
import { checkDType, checkInputs } from "./check.ts";

export function relu(inp: Tensor): Tensor {
  const ctx = checkInputs("relu", [inp]);
  checkDType("relu", inp, "f32");
  const be = ctx.backend;
  const out = ctx.empty(inp.shape);
  be.reluForward(out.ptr, inp.ptr, inp.numel);
  ctx.record("relu", [inp], out, () => {
    be.reluBackward(inp.ensureGrad().ptr, inp.ptr, out.grad!.ptr, inp.numel);
  });
  return out;
}

// ---- float64 reference --------------------------------------------------------------------

// NaN propagates, as in torch.relu
export const reluReference = (x: Float64Array): Float64Array => x.map((v) => (v < 0 ? 0 : v));

// forward was: out = max(x, 0)  =>  dx = dout where x > 0
export const reluBackwardReference = (x: Float64Array, dout: Float64Array): Float64Array =>
  x.map((v, i) => (v > 0 ? dout[i]! : 0));
