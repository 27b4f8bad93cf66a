// Autocast copies of GEMM inputs (engine/mixed.ts says when they are made).
import type { DType } from "../../ffi/backend.ts";
import type { Tensor } from "../tensor.ts";

/** t (f32) rounded to nearest even into a new arena tensor of `dtype`; not recorded on the tape. */
export function castCopy(t: Tensor, dtype: Extract<DType, "bf16" | "f16">): Tensor {
  const out = t.ctx.empty(t.shape, dtype);
  if (dtype === "bf16") t.ctx.backend.castF32ToBF16(out.ptr, t.ptr, t.numel);
  else t.ctx.backend.castF32ToF16(out.ptr, t.ptr, t.numel);
  return out;
}

/** dst (f32) += src (a 2-byte type): a gradient computed in the autocast type added into an f32
 *  one. Not recorded on the tape. */
export function addInto(dst: Tensor, src: Tensor): void {
  const be = dst.ctx.backend;
  const wide = dst.ctx.empty(src.shape);
  if (src.dtype === "bf16") be.castBF16ToF32(wide.ptr, src.ptr, src.numel);
  else be.castF16ToF32(wide.ptr, src.ptr, src.numel);
  be.axpy(dst.ptr, wide.ptr, src.numel, 1);
  wide.drop();
}
