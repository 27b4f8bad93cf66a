// Casts between f32 and the 2-byte autocast types: the autocast copies of GEMM inputs
// (engine/mixed.ts says when they are made), and gradients moved between an f32 tensor and a
// 2-byte one. None is recorded on the tape.
import type { DType } from "../../ffi/backend.ts";
import { DTypeError } from "../errors.ts";
import type { Tensor } from "../tensor.ts";

/** dst = src, of the same element count: f32 rounded to nearest even into bf16 or f16, or bf16
 *  or f16 widened (exactly) to f32; any other pair is refused, naming `op`. */
export function castInto(dst: Tensor, src: Tensor, op = "cast"): void {
  const be = src.ctx.backend;
  const n = src.numel;
  if (src.dtype === "f32" && dst.dtype === "bf16") be.castF32ToBF16(dst.ptr, src.ptr, n);
  else if (src.dtype === "f32" && dst.dtype === "f16") be.castF32ToF16(dst.ptr, src.ptr, n);
  else if (src.dtype === "bf16" && dst.dtype === "f32") be.castBF16ToF32(dst.ptr, src.ptr, n);
  else if (src.dtype === "f16" && dst.dtype === "f32") be.castF16ToF32(dst.ptr, src.ptr, n);
  else throw new DTypeError(op, dst.dtype, src.dtype, src.shape);
}

/** t (f32) rounded to nearest even into a new arena tensor of `dtype`. */
export function castCopy(t: Tensor, dtype: Extract<DType, "bf16" | "f16">): Tensor {
  const out = t.ctx.empty(t.shape, dtype);
  castInto(out, t);
  return out;
}

/** dst (f32) += src (a 2-byte type): a gradient computed in the autocast type added into an f32
 *  one. */
export function addInto(dst: Tensor, src: Tensor): void {
  const wide = dst.ctx.empty(src.shape);
  castInto(wide, src);
  dst.ctx.backend.axpy(dst.ptr, wide.ptr, src.numel, 1);
  wide.drop();
}
