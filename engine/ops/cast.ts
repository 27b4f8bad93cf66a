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
