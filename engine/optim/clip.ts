// Global-norm gradient clipping (torch.nn.utils.clip_grad_norm_): if the L2 norm of all
// gradients exceeds maxNorm, scale them all by maxNorm / (norm + 1e-6). One reduction over the
// gradient slab, and one scale (or none: measureClip leaves the factor to the optimizer).
import { ConfigError } from "../../ffi/errors.ts";
import type { ParamStore } from "../params.ts";
import type { Context } from "../context.ts";

export function gradNorm(ctx: Context, store: ParamStore): number {
  return Math.sqrt(ctx.backend.sumSquares(store.grads.ptr, store.slabNumel));
}

/** The factor that clips gradients of global norm `norm` to maxNorm (1: none needed, or maxNorm <= 0 or Infinity). */
export function clipFactor(norm: number, maxNorm: number): number {
  return maxNorm > 0 && Number.isFinite(maxNorm) && norm > maxNorm ? maxNorm / (norm + 1e-6) : 1;
}

/** The gradients' global norm and the factor that clips them to maxNorm, the slab untouched
 *  (an optimizer that reads the gradients times the factor applies it: AdamW). */
export function measureClip(ctx: Context, store: ParamStore, maxNorm: number): { norm: number; factor: number } {
  if (Number.isNaN(maxNorm)) throw new ConfigError("clipGradNorm: maxNorm is NaN");
  const norm = gradNorm(ctx, store);
  return { norm, factor: clipFactor(norm, maxNorm) };
}

/** Returns the norm before clipping. maxNorm <= 0 or Infinity only measures. */
export function clipGradNorm(ctx: Context, store: ParamStore, maxNorm: number): number {
  const { norm, factor } = measureClip(ctx, store, maxNorm);
  if (factor !== 1) ctx.backend.scale(store.grads.ptr, store.slabNumel, factor);
  return norm;
}
