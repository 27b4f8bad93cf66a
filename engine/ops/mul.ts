// mul: out = a * b with broadcasting. d a = reduce(dout * b) over a's broadcast dims.
import type { Tensor } from "../tensor.ts";
import { binaryForward, broadcastIndices } from "./broadcast.ts";
import { binaryInputs } from "./check.ts";

export function mul(a: Tensor, b: Tensor): Tensor {
  const ctx = binaryInputs("mul", a, b);
  const be = ctx.backend;
  const { plan, out } = binaryForward(ctx, "mul", a, b);
  if (plan === null) {
    ctx.record("mul", [a, b], out, () => {
      // forward was: out = a * b  =>  da += dout * b, db += dout * a
      const dout = out.grad!.ptr;
      const scratch = ctx.empty(out.shape);
      const tmp = scratch.ptr;
      if (a.requiresGrad) {
        be.mul(tmp, dout, b.ptr, out.numel);
        be.axpy(a.ensureGrad().ptr, tmp, out.numel, 1);
      }
      if (b.requiresGrad) {
        be.mul(tmp, dout, a.ptr, out.numel);
        be.axpy(b.ensureGrad().ptr, tmp, out.numel, 1);
      }
      scratch.drop();
    });
    return out;
  }
  ctx.record("mul", [a, b], out, () => {
    // forward was: out[i] = a[i·as] * b[i·bs]  =>  da[i·as] += dout[i] * b[i·bs]
    const dout = out.grad!.ptr;
    const scratch = ctx.empty(out.shape);
    const tmp = scratch.ptr;
    const da = a.requiresGrad ? a.ensureGrad().ptr : 0;
    const db = b.requiresGrad ? b.ensureGrad().ptr : 0;
    // dout and tmp are contiguous in the out layout (strides[0])
    for (const {
      dims,
      strides: [os, as, bs],
      offsets: [o, ao, bo],
    } of plan.blocks) {
      if (a.requiresGrad) {
        be.binaryBroadcast("mul", tmp + o! * 4, dout + o! * 4, b.ptr + bo! * 4, dims, os!, bs!);
        be.reduceBroadcast(da + ao! * 4, tmp + o! * 4, dims, as!);
      }
      if (b.requiresGrad) {
        be.binaryBroadcast("mul", tmp + o! * 4, dout + o! * 4, a.ptr + ao! * 4, dims, os!, as!);
        be.reduceBroadcast(db + bo! * 4, tmp + o! * 4, dims, bs!);
      }
    }
    scratch.drop();
  });
  return out;
}

// ---- float64 reference --------------------------------------------------------------------

export function mulReference(a: Float64Array, aShape: number[], b: Float64Array, bShape: number[]) {
  const { outShape, ai, bi } = broadcastIndices("mul", aShape, bShape);
  const out = new Float64Array(ai.length);
  for (let i = 0; i < out.length; i++) out[i] = a[ai[i]!]! * b[bi[i]!]!;
  return { out, outShape };
}

export function mulBackwardReference(
  a: Float64Array,
  aShape: number[],
  b: Float64Array,
  bShape: number[],
  dout: Float64Array,
) {
  const { ai, bi } = broadcastIndices("mul", aShape, bShape);
  const da = new Float64Array(a.length);
  const db = new Float64Array(b.length);
  for (let i = 0; i < dout.length; i++) {
    da[ai[i]!] = da[ai[i]!]! + dout[i]! * b[bi[i]!]!;
    db[bi[i]!] = db[bi[i]!]! + dout[i]! * a[ai[i]!]!;
  }
  return { da, db };
}
