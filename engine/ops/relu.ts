// relu: out = max(inp, 0), elementwise.
import type { Tensor } from "../tensor.ts";
import { activation } from "./check.ts";

export const relu = (inp: Tensor): Tensor => activation("relu", inp, "reluForward", "reluBackward");

// ---- float64 reference --------------------------------------------------------------------

// NaN propagates, as in torch.relu
export const reluReference = (x: Float64Array): Float64Array => x.map((v) => (v < 0 ? 0 : v));

// forward was: out = max(x, 0)  =>  dx = dout where x > 0
export const reluBackwardReference = (x: Float64Array, dout: Float64Array): Float64Array =>
  x.map((v, i) => (v > 0 ? dout[i]! : 0));
