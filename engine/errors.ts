import { MeshtrainError } from "../ffi/errors.ts";

// Typed errors of the engine. One class per failure mode; each names the op and what was
// wrong so that a user can fix the call without reading engine code.

export class EngineError extends MeshtrainError {
  override name: string = "EngineError";
}

const fmt = (shape: readonly number[]) => `[${shape.join(", ")}]`;

/** Shapes that an op cannot combine. Carries the op name and every input shape. */
export class ShapeError extends EngineError {
  override readonly name = "ShapeError";
  constructor(
    readonly op: string,
    readonly shapes: readonly (readonly number[])[],
    detail: string,
  ) {
    super(`${op}: ${detail} (shapes ${shapes.map(fmt).join(", ")})`);
  }
}

export class DTypeError extends EngineError {
  override readonly name = "DTypeError";
  constructor(
    readonly op: string,
    readonly expected: string,
    readonly actual: string,
    shape: readonly number[],
  ) {
    super(`${op}: expected dtype ${expected}, got ${actual} (shape ${fmt(shape)})`);
  }
}

/** Tensors from different contexts/backends were combined in one op. */
export class BackendMismatchError extends EngineError {
  override readonly name = "BackendMismatchError";
  constructor(
    readonly op: string,
    backends: readonly string[],
    shapes: readonly (readonly number[])[],
  ) {
    super(
      `${op}: inputs live on different backends/contexts (${backends.join(", ")}; shapes ${shapes.map(fmt).join(", ")})`,
    );
  }
}

/** An index (token id, class label) outside the range an op accepts. */
export class IndexRangeError extends EngineError {
  override readonly name = "IndexRangeError";
  constructor(
    readonly op: string,
    readonly invalidCount: number,
    readonly limit: number,
    shape: readonly number[],
  ) {
    super(`${op}: ${invalidCount} index value(s) outside [0, ${limit}) (index shape ${fmt(shape)})`);
  }
}

/** A tensor from an earlier forward/backward pass was used after its arena was reset. */
export class StaleTensorError extends EngineError {
  override readonly name = "StaleTensorError";
  constructor(op: string, shape: readonly number[]) {
    super(`${op}: tensor of shape ${fmt(shape)} belongs to an earlier pass; its memory has been reused`);
  }
}

/** The loss became NaN or infinite: training cannot continue with these settings. */
export class NonFiniteLossError extends EngineError {
  override readonly name = "NonFiniteLossError";
  constructor(
    readonly step: number,
    readonly loss: number,
  ) {
    super(
      `loss is ${loss} at step ${step}: training stopped. Lower the learning rate, enable gradient clipping ` +
        `(--grad-clip), or check the input data for NaN/Inf values.`,
    );
  }
}

/** f16 gradients overflowed step after step although the loss scale kept halving. */
export class GradientOverflowError extends EngineError {
  override readonly name = "GradientOverflowError";
  constructor(
    readonly step: number,
    readonly skipsInARow: number,
    readonly lossScale: number,
  ) {
    super(
      `gradients overflowed in ${skipsInARow} steps in a row at step ${step} (loss scale now ${lossScale}): training stopped. ` +
        `Lower the learning rate, or train in bf16 or f32 (--precision).`,
    );
  }
}
