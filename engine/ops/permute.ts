// permute / transpose: a contiguous copy of x with its dims reordered (out dim k = x dim
// perm[k]). reshape and narrowRows are free views (Tensor methods); a permute moves data,
// so it is an op with a backward: the inverse permute, added into dx.
import { ShapeError } from "../errors.ts";
import type { Tensor } from "../tensor.ts";
import { blocks4, checkDType, checkInputs, contiguousStrides } from "./check.ts";

export function permute(x: Tensor, perm: readonly number[]): Tensor {
  const ctx = checkInputs("permute", [x]);
  checkDType("permute", x, "f32");
  const rank = x.shape.length;
  const sorted = [...perm].sort((a, b) => a - b);
  if (perm.length !== rank || sorted.some((d, i) => d !== i)) {
    throw new ShapeError("permute", [x.shape], `perm [${perm.join(", ")}] is not a permutation of ${rank} dims`);
  }
  const outShape = perm.map((d) => x.shape[d]!);
  const xStrides = contiguousStrides(x.shape);
  const inStrides = perm.map((d) => xStrides[d]!); // x's strides in out-dim order
  const blocks = blocks4(outShape, [contiguousStrides(outShape), inStrides]);
  const be = ctx.backend;
  const out = ctx.empty(outShape);
  for (const {
    dims,
    strides: [outS, inS],
    offsets: [o, i],
  } of blocks) {
    be.stridedCopy(out.ptr + o! * 4, outS!, x.ptr + i! * 4, inS!, dims, false);
  }
  ctx.record(
    "permute",
    [x],
    out,
    () => {
      // forward was: out[i·outS] = x[i·inS]  =>  dx[i·inS] += dout[i·outS]
      const dx = x.ensureGrad().ptr;
      const dout = out.grad!.ptr;
      for (const {
        dims,
        strides: [outS, inS],
        offsets: [o, i],
      } of blocks) {
        be.stridedCopy(dx + i! * 4, inS!, dout + o! * 4, outS!, dims, true);
      }
    },
    [],
  );
  return out;
}

/** Swap two dims (a copy). */
export function transpose(x: Tensor, dim0: number, dim1: number): Tensor {
  const perm = x.shape.map((_, i) => i);
  if (!(dim0 in perm) || !(dim1 in perm))
    throw new ShapeError("transpose", [x.shape], `dims ${dim0}, ${dim1} out of range`);
  perm[dim0] = dim1;
  perm[dim1] = dim0;
  return permute(x, perm);
}

// ---- float64 reference --------------------------------------------------------------------

export function permuteReference(x: Float64Array, shape: readonly number[], perm: readonly number[]): Float64Array {
  const outShape = perm.map((d) => shape[d]!);
  const xStrides = contiguousStrides(shape);
  const outStrides = contiguousStrides(outShape);
  const out = new Float64Array(x.length);
  for (let i = 0; i < x.length; i++) {
    let rest = i;
    let src = 0;
    for (let k = 0; k < outShape.length; k++) {
      const coord = Math.floor(rest / outStrides[k]!);
      rest -= coord * outStrides[k]!;
      src += coord * xStrides[perm[k]!]!;
    }
    out[i] = x[src]!;
  }
  return out;
}

/** The backward of a permute is the inverse permute. */
export function permuteBackwardReference(
  dout: Float64Array,
  shape: readonly number[],
  perm: readonly number[],
): Float64Array {
  const inverse = new Array<number>(perm.length);
  perm.forEach((d, k) => (inverse[d] = k));
  return permuteReference(
    dout,
    perm.map((d) => shape[d]!),
    inverse,
  );
}
