// Dynamic loss scaling for f16 autocast, with torch.cuda.amp.GradScaler's rules:
//   backward seeds d(loss) = scale (the gradients come out `scale` times too large, so that
//   small ones stay above f16's underflow);
//   if any gradient is inf or NaN: skip the optimizer step, scale *= backoffFactor;
//   else: gradients *= 1/scale (before clipping), step, and after growthInterval good steps
//   in a row, scale *= growthFactor.
// The check is one reduction over the gradient slab (countNonFinite), the unscale one kernel.
// Powers of two keep scaling and unscaling exact: they only move the exponent.
import { ConfigError } from "../../ffi/errors.ts";
import { GradientOverflowError } from "../errors.ts";
import type { ParamStore } from "../params.ts";
import type { Context } from "../context.ts";

const f32Max = 3.4028234663852886e38;

export interface LossScaleConfig {
  /** the first step's scale */
  initScale: number;
  /** multiplies the scale after growthInterval steps in a row without overflow */
  growthFactor: number;
  /** multiplies the scale after an overflow */
  backoffFactor: number;
  /** good steps in a row before the scale grows */
  growthInterval: number;
  /**
   * Overflows in a row before training stops with GradientOverflowError. 64 halvings take the
   * default scale from 2^16 to 2^-48; gradients that still overflow there are non-finite
   * without any scaling: the run has diverged, and skipping steps forever would hide it.
   */
  skipsInARowMax: number;
}

/** PyTorch's GradScaler defaults. */
export const lossScaleDefaults: Readonly<LossScaleConfig> = {
  initScale: 2 ** 16,
  growthFactor: 2,
  backoffFactor: 0.5,
  growthInterval: 2000,
  skipsInARowMax: 64,
};

export function checkLossScaleConfig(c: LossScaleConfig): void {
  if (!(c.initScale > 0) || !Number.isFinite(c.initScale))
    throw new ConfigError(`lossScale.initScale must be a finite number > 0, got ${c.initScale}`);
  if (!(c.growthFactor > 1) || !Number.isFinite(c.growthFactor))
    throw new ConfigError(`lossScale.growthFactor must be a finite number > 1, got ${c.growthFactor}`);
  if (!(c.backoffFactor > 0 && c.backoffFactor < 1))
    throw new ConfigError(`lossScale.backoffFactor must be in (0, 1), got ${c.backoffFactor}`);
  for (const key of ["growthInterval", "skipsInARowMax"] as const) {
    if (!Number.isSafeInteger(c[key]) || c[key] < 1)
      throw new ConfigError(`lossScale.${key} must be an integer >= 1, got ${c[key]}`);
  }
}

export class LossScaler {
  readonly config: Readonly<LossScaleConfig>;
  #scale: number;
  /** good steps since the last overflow or growth */
  #goodSteps = 0;
  #skipsInARow = 0;
  #skippedTotal = 0;

  constructor(config: Partial<LossScaleConfig> = {}) {
    this.config = { ...lossScaleDefaults, ...config };
    checkLossScaleConfig(this.config);
    this.#scale = this.config.initScale;
  }

  /** the factor the next backward seeds d(loss) with */
  get scale(): number {
    return this.#scale;
  }
  /** steps skipped over the scaler's life */
  get skippedSteps(): number {
    return this.#skippedTotal;
  }

  /**
   * Checks the gradient slab for inf/NaN; when there is none, divides it by the scale and
   * returns true. On overflow it returns false and leaves the slab as it is (unusable).
   */
  unscale(ctx: Context, store: ParamStore): boolean {
    const be = ctx.backend;
    if (be.countNonFinite(store.grads.ptr, store.slabNumel) > 0) return false;
    be.scale(store.grads.ptr, store.slabNumel, 1 / this.#scale);
    return true;
  }

  /** Resumes at a checkpoint's scale (the count of good steps starts over). */
  restoreScale(scale: number): void {
    if (!(scale > 0) || !Number.isFinite(scale))
      throw new ConfigError(`a loss scale must be a finite number > 0, got ${scale}`);
    this.#scale = scale;
    this.#goodSteps = 0;
    this.#skipsInARow = 0;
  }

  /** After a step: back off on overflow, grow after growthInterval good steps in a row. */
  update(finite: boolean, step: number): void {
    const c = this.config;
    if (!finite) {
      this.#skippedTotal++;
      if (++this.#skipsInARow > c.skipsInARowMax) throw new GradientOverflowError(step, this.#skipsInARow, this.#scale);
      this.#scale *= c.backoffFactor;
      this.#goodSteps = 0;
      return;
    }
    this.#skipsInARow = 0;
    if (++this.#goodSteps === c.growthInterval) {
      // as PyTorch, never grow to a scale that is not finite (here: as an f32, which seeds d(loss))
      if (this.#scale * c.growthFactor <= f32Max) this.#scale *= c.growthFactor;
      this.#goodSteps = 0;
    }
  }
}
