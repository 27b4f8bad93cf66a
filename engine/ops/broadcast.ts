// Broadcasting (NumPy rules): shapes are right-aligned; each dim must match or be 1.
// broadcastPlan() turns two shapes into the 4-dim blocks the backend's broadcast kernels take;
// each block's strides are [out, a, b] and its offsets are element offsets into out, a, b.
import { ShapeError } from "../errors.ts";
import type { BinaryOp } from "../../ffi/backend.ts";
import { type Shape, sameShape, type Tensor } from "../tensor.ts";
import type { Context } from "../context.ts";
import { type Block4, blocks4, contiguousStrides } from "./check.ts";

export interface BroadcastPlan {
  outShape: number[];
  /** usually one block; more when the layout needs more than 4 dims (see blocks4) */
  blocks: Block4[];
  /** out-shape strides into a / b (0 on broadcast dims), before collapsing: for references */
  aFull: number[];
  bFull: number[];
}

/** Strides of `shape` seen through the right-aligned out shape; 0 where shape broadcasts. */
function broadcastStrides(shape: Shape, outShape: readonly number[]): number[] {
  const own = contiguousStrides(shape);
  const pad = outShape.length - shape.length;
  return outShape.map((d, i) => {
    if (i < pad) return 0;
    const sd = shape[i - pad]!;
    return sd === 1 && d !== 1 ? 0 : own[i - pad]!;
  });
}

export function broadcastPlan(op: string, a: Shape, b: Shape): BroadcastPlan {
  const rank = Math.max(a.length, b.length);
  const outShape: number[] = [];
  for (let i = 0; i < rank; i++) {
    const da = a[i - (rank - a.length)] ?? 1;
    const db = b[i - (rank - b.length)] ?? 1;
    if (da !== db && da !== 1 && db !== 1) {
      throw new ShapeError(op, [a, b], `dim ${i} cannot broadcast (${da} vs ${db})`);
    }
    outShape.push(Math.max(da, db));
  }
  const aFull = broadcastStrides(a, outShape);
  const bFull = broadcastStrides(b, outShape);
  const blocks = blocks4(outShape, [contiguousStrides(outShape), aFull, bFull]);
  return { outShape, blocks, aFull, bFull };
}

/** out = a op b, the forward of add and mul: one elementwise call where the shapes are the same
 *  (plan null), else block by block over the plan of their shapes. */
export function binaryForward(
  ctx: Context,
  op: BinaryOp,
  a: Tensor,
  b: Tensor,
): { plan: BroadcastPlan | null; out: Tensor } {
  if (sameShape(a.shape, b.shape)) {
    const out = ctx.empty(a.shape);
    ctx.backend[op](out.ptr, a.ptr, b.ptr, out.numel);
    return { plan: null, out };
  }
  const plan = broadcastPlan(op, a.shape, b.shape);
  const out = ctx.empty(plan.outShape);
  for (const {
    dims,
    strides: [, as, bs],
    offsets: [o, ao, bo],
  } of plan.blocks) {
    ctx.backend.binaryBroadcast(op, out.ptr + o! * 4, a.ptr + ao! * 4, b.ptr + bo! * 4, dims, as!, bs!);
  }
  return { plan, out };
}

/** The float64 references' view of a broadcast: the out shape, and for each flat out index the
 *  flat index into a and into b. */
export function broadcastIndices(
  op: BinaryOp,
  aShape: number[],
  bShape: number[],
): { outShape: number[]; ai: Int32Array; bi: Int32Array } {
  const plan = broadcastPlan(op, aShape, bShape);
  return {
    outShape: plan.outShape,
    ai: broadcastIndexReference(plan.outShape, plan.aFull),
    bi: broadcastIndexReference(plan.outShape, plan.bFull),
  };
}

/** For each flat out index, the flat index into an operand with these full strides. */
export function broadcastIndexReference(outShape: readonly number[], fullStrides: readonly number[]): Int32Array {
  const n = outShape.reduce((x, y) => x * y, 1);
  const map = new Int32Array(n);
  const outStrides = contiguousStrides(outShape);
  for (let i = 0; i < n; i++) {
    let rest = i;
    let idx = 0;
    for (let d = 0; d < outShape.length; d++) {
      const coord = Math.floor(rest / outStrides[d]!);
      rest -= coord * outStrides[d]!;
      idx += coord * fullStrides[d]!;
    }
    map[i] = idx;
  }
  return map;
}
