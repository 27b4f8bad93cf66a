// gelu (tanh form, as GPT-2): out = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
import type { Tensor } from "../tensor.ts";
import { activation } from "./check.ts";

export const gelu = (inp: Tensor): Tensor => activation("gelu", inp, "geluForward", "geluBackward");

// ---- float64 reference --------------------------------------------------------------------

const s = Math.sqrt(2 / Math.PI);

export const geluReference = (x: Float64Array): Float64Array =>
  x.map((v) => 0.5 * v * (1 + Math.tanh(s * (v + 0.044715 * v * v * v))));

// forward was: out = 0.5 x (1 + t), t = tanh(u), u = s (x + 0.044715 x^3)
// dout/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) s (1 + 3 0.044715 x^2)
export const geluBackwardReference = (x: Float64Array, dout: Float64Array): Float64Array =>
  x.map((v, i) => {
    const t = Math.tanh(s * (v + 0.044715 * v * v * v));
    return dout[i]! * (0.5 * (1 + t) + 0.5 * v * (1 - t * t) * s * (1 + 3 * 0.044715 * v * v));
  });
