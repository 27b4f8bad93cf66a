// sum and mean of all elements: out (1). Accumulated in double on the CPU.
import type { Tensor } from "../tensor.ts";
import { checkDType, checkInputs } from "./check.ts";

function reduceAll(op: "sum" | "mean", x: Tensor): Tensor {
  const ctx = checkInputs(op, [x]);
  checkDType(op, x, "f32");
  const be = ctx.backend;
  const out = ctx.empty([1]);
  be.sum(out.ptr, x.ptr, x.numel);
  const scale = op === "mean" ? 1 / x.numel : 1;
  if (scale !== 1) be.scale(out.ptr, 1, scale);
  ctx.record(
    op,
    [x],
    out,
    () => {
      // forward was: out = scale * sum(x)  =>  dx[i] += scale * dout
      be.addScalarFrom(x.ensureGrad().ptr, out.grad!.ptr, scale, x.numel);
    },
    [],
  );
  return out;
}

export const sum = (x: Tensor): Tensor => reduceAll("sum", x);
export const mean = (x: Tensor): Tensor => reduceAll("mean", x);

// ---- float64 reference --------------------------------------------------------------------

export const sumReference = (x: Float64Array): number => x.reduce((a, b) => a + b, 0);
export const meanReference = (x: Float64Array): number => sumReference(x) / x.length;
// forward was: out = sum(x) (or mean)  =>  dx[i] = dout (or dout / n)
export const sumBackwardReference = (n: number, dout: number, mean = false): Float64Array =>
  new Float64Array(n).fill(mean ? dout / n : dout);
