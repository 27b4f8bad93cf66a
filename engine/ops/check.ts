// Input checks shared by every op. Wrong shapes, dtypes or contexts are caller errors that a
// user can make (a misconfigured model, a batch of the wrong size), so they raise typed
// errors that name the op and the shapes rather than assertions.
import type { DType, Dims4, ElemType } from "../../ffi/backend.ts";
import { BackendMismatchError, DTypeError, ShapeError, StaleTensorError } from "../errors.ts";
import { autocastDType } from "../mixed.ts";
import type { Shape, Tensor } from "../tensor.ts";
import type { Context } from "../context.ts";

/** Same context for all, none stale; returns the shared context. */
export function checkInputs(op: string, tensors: readonly Tensor[]): Context {
  const ctx = tensors[0]!.ctx;
  for (const t of tensors) {
    if (t.ctx !== ctx) {
      throw new BackendMismatchError(
        op,
        tensors.map((x) => x.ctx.backend.name),
        tensors.map((x) => x.shape),
      );
    }
    if (t.isStale) throw new StaleTensorError(op, t.shape);
  }
  return ctx;
}

export function checkDType(op: string, t: Tensor, dtype: DType): void {
  if (t.dtype !== dtype) throw new DTypeError(op, dtype, t.dtype, t.shape);
}

export function checkRank(op: string, t: Tensor, ranks: readonly number[], shapes: readonly Shape[]): void {
  if (!ranks.includes(t.shape.length)) {
    throw new ShapeError(op, shapes, `expected ${ranks.join(" or ")} dims, got ${t.shape.length}`);
  }
}

export const lastDim = (shape: Shape): number => shape[shape.length - 1]!;

/** Row-major contiguous strides. */
export function contiguousStrides(shape: Shape): number[] {
  const strides = new Array<number>(shape.length);
  let s = 1;
  for (let i = shape.length - 1; i >= 0; i--) {
    strides[i] = s;
    s *= shape[i]!;
  }
  return strides;
}

/** Merge adjacent dims that are contiguous in every stride set; drop size-1 dims. */
export function collapseDims(
  dims: readonly number[],
  strideSets: readonly (readonly number[])[],
): { dims: number[]; strides: number[][] } {
  const d = [...dims];
  const s = strideSets.map((x) => [...x]);
  // drop size-1 dims first (their strides do not matter), so they never block a merge
  for (let i = d.length - 1; i >= 0 && d.length > 1; i--) {
    if (d[i] === 1) {
      d.splice(i, 1);
      for (const st of s) st.splice(i, 1);
    }
  }
  for (let i = d.length - 2; i >= 0; i--) {
    const mergeable = s.every((st) => st[i] === st[i + 1]! * d[i + 1]!);
    if (mergeable) {
      d[i] = d[i]! * d[i + 1]!;
      for (const st of s) st[i] = st[i + 1]!;
      d.splice(i + 1, 1);
      for (const st of s) st.splice(i + 1, 1);
    }
  }
  return { dims: d, strides: s };
}

/** A layout the 4-dim kernels take, plus element offsets of each stride set. */
export interface Block4 {
  dims: Dims4;
  strides: Dims4[];
  offsets: number[];
}

/**
 * Split a collapsed layout into 4-dim blocks: a layout that still has more than 4 dims after
 * merging is iterated over its leading dims here, one kernel call per block. Usually one block.
 */
export function blocks4(dims: readonly number[], strideSets: readonly (readonly number[])[]): Block4[] {
  const { dims: d, strides: s } = collapseDims(dims, strideSets);
  while (d.length < 4) {
    d.unshift(1);
    for (const st of s) st.unshift(0);
  }
  const lead = d.length - 4;
  const inner = { dims: d.slice(lead) as unknown as Dims4, strides: s.map((st) => st.slice(lead) as unknown as Dims4) };
  const blocks: Block4[] = [];
  const count = d.slice(0, lead).reduce((a, b) => a * b, 1);
  for (let b = 0; b < count; b++) {
    let rest = b;
    const offsets = s.map(() => 0);
    for (let i = lead - 1; i >= 0; i--) {
      const coord = rest % d[i]!;
      rest = Math.floor(rest / d[i]!);
      s.forEach((st, k) => (offsets[k] = offsets[k]! + coord * st[i]!));
    }
    blocks.push({ ...inner, offsets });
  }
  return blocks;
}

/** Whether t may be an activation of this context: f32, or its autocast type (engine/mixed.ts). */
export function checkActivationDType(op: string, t: Tensor): ElemType {
  const half = autocastDType(t.ctx.precision);
  if (t.dtype !== "f32" && t.dtype !== half)
    throw new DTypeError(op, half === null ? "f32" : `f32 or ${half}`, t.dtype, t.shape);
  return t.dtype as ElemType;
}

/** A requested output type: f32, or the context's autocast type. */
export function checkOutDType(op: string, ctx: Context, dtype: DType): ElemType {
  const half = autocastDType(ctx.precision);
  if (dtype !== "f32" && dtype !== half) throw new DTypeError(op, half === null ? "f32" : `f32 or ${half}`, dtype, []);
  return dtype as ElemType;
}

/** The backend's elementwise activation kernels (forward: out, inp, n; backward: dinp, inp, dout, n). */
type ActivationKernel = "reluForward" | "reluBackward" | "geluForward" | "geluBackward";

/**
 * An elementwise activation (relu, gelu) of an activation tensor (f32 or the autocast type; out of
 * the same type) through the backend's kernels:
 * `forward` writes out from inp, `backward` adds the gradient into dinp from inp and dout.
 */
export function activation(
  op: string,
  inp: Tensor,
  forward: ActivationKernel & `${string}Forward`,
  backward: ActivationKernel & `${string}Backward`,
): Tensor {
  const ctx = checkInputs(op, [inp]);
  const elem = checkActivationDType(op, inp);
  const be = ctx.backend;
  const out = ctx.empty(inp.shape, elem);
  be[forward](out.ptr, inp.ptr, inp.numel, elem);
  ctx.record(op, [inp], out, () => be[backward](inp.ensureGrad().ptr, inp.ptr, out.grad!.ptr, inp.numel, elem));
  return out;
}

/** The context of a binary op on two f32 tensors, once both are checked. */
export function binaryInputs(op: string, a: Tensor, b: Tensor): Context {
  const ctx = checkInputs(op, [a, b]);
  checkDType(op, a, "f32");
  checkDType(op, b, "f32");
  return ctx;
}
