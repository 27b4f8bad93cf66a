// add: out = a + b with broadcasting. The backward sums dout over a's (b's) broadcast dims.
import type { Tensor } from "../tensor.ts";
import { binaryForward, broadcastIndices } from "./broadcast.ts";
import { binaryInputs } from "./check.ts";

export function add(a: Tensor, b: Tensor): Tensor {
  const ctx = binaryInputs("add", a, b);
  const be = ctx.backend;
  const { plan, out } = binaryForward(ctx, "add", a, b);
  if (plan === null) {
    ctx.record("add", [a, b], out, () => addBackward(out, a, b), []);
    return out;
  }
  ctx.record(
    "add",
    [a, b],
    out,
    () => {
      // forward was: out[i] = a[i·as] + b[i·bs]  =>  da[i·as] += dout[i]
      const dout = out.grad!.ptr;
      const da = a.requiresGrad ? a.ensureGrad().ptr : 0;
      const db = b.requiresGrad ? b.ensureGrad().ptr : 0;
      for (const {
        dims,
        strides: [, as, bs],
        offsets: [o, ao, bo],
      } of plan.blocks) {
        if (a.requiresGrad) be.reduceBroadcast(da + ao! * 4, dout + o! * 4, dims, as!);
        if (b.requiresGrad) be.reduceBroadcast(db + bo! * 4, dout + o! * 4, dims, bs!);
      }
    },
    [],
  );
  return out;
}

/**
 * forward was: out = a + b  =>  da += dout, db += dout. An operand without a gradient yet takes
 * dout's memory (b first: a's sharing would let later adds into a's gradient change dout) or a
 * copy of it, not a zero fill and an add.
 */
export function addBackward(out: Tensor, a: Tensor, b: Tensor): void {
  const be = out.ctx.backend;
  const dout = out.grad!;
  const into = (t: Tensor, share: boolean) => {
    if (!t.requiresGrad || (share && t.shareGrad(dout))) return;
    const { grad, fresh } = t.gradForWrite();
    if (fresh) be.copy(grad.ptr, dout.ptr, dout.bytes);
    else be.axpy(grad.ptr, dout.ptr, out.numel, 1);
  };
  into(b, false);
  into(a, true);
}

// ---- float64 reference --------------------------------------------------------------------

export function addReference(a: Float64Array, aShape: number[], b: Float64Array, bShape: number[]) {
  const { outShape, ai, bi } = broadcastIndices("add", aShape, bShape);
  const out = new Float64Array(ai.length);
  for (let i = 0; i < out.length; i++) out[i] = a[ai[i]!]! + b[bi[i]!]!;
  return { out, outShape };
}

export function addBackwardReference(aShape: number[], bShape: number[], dout: Float64Array) {
  const { ai, bi } = broadcastIndices("add", aShape, bShape);
  const da = new Float64Array(aShape.reduce((x, y) => x * y, 1));
  const db = new Float64Array(bShape.reduce((x, y) => x * y, 1));
  for (let i = 0; i < dout.length; i++) {
    da[ai[i]!] = da[ai[i]!]! + dout[i]!;
    db[bi[i]!] = db[bi[i]!]! + dout[i]!;
  }
  return { da, db };
}
