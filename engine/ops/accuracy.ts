// countCorrect: how many rows of logits (...,V) have their largest logit at their target, counted
// on the backend (Backend.countCorrect), so an evaluation reads back one number instead of the
// logits (a GPT-2 batch's are hundreds of MB at 50,257 classes). The argmax is the first of equal
// maxima, and NaN never takes over, unless a row's first logit is NaN (then 0): what a strict >
// scan from the first class finds, as the reference below does.
import { ShapeError } from "../errors.ts";
import type { Tensor } from "../tensor.ts";
import { checkActivationDType, checkDType, checkInputs, lastDim } from "./check.ts";

export function countCorrect(logits: Tensor, targets: Tensor): number {
  const ctx = checkInputs("countCorrect", [logits, targets]);
  const elem = checkActivationDType("countCorrect", logits);
  checkDType("countCorrect", targets, "i32");
  const V = lastDim(logits.shape);
  const lead = logits.shape.slice(0, -1);
  if (logits.shape.length < 2 || targets.shape.length !== lead.length || lead.some((d, i) => d !== targets.shape[i])) {
    throw new ShapeError("countCorrect", [logits.shape, targets.shape], "targets must have the leading dims of logits");
  }
  return ctx.backend.countCorrect(logits.ptr, targets.ptr, logits.numel / V, V, elem);
}

// ---- reference ------------------------------------------------------------------------------

export function countCorrectReference(logits: ArrayLike<number>, targets: Int32Array): number {
  const V = logits.length / targets.length;
  let correct = 0;
  for (let n = 0; n < targets.length; n++) {
    let best = 0;
    for (let v = 1; v < V; v++) if (logits[n * V + v]! > logits[n * V + best]!) best = v;
    if (best === targets[n]) correct++;
  }
  return correct;
}
