// softmaxCrossEntropy: loss = mean_n -log softmax(logits[n])[targets[n]], fused and stable.
//   logits (...,V) f32 or, under autocast, the 2-byte type (the head's GEMM writes them so; the
//   sums are f32 either way), targets (...) i32 with the same leading dims; N = numel(targets).
// The forward keeps only each row's log-sum-exp lse (N), not the probabilities (N,V):
// dlogits = (exp(logits - lse) - onehot) * dloss / N is computed from the logits in backward.
// When nothing but this op reads the logits any more (their owner dropped them, as a model's
// loss does), the gradient is written over them: one (N,V) array in all, where a vocabulary of
// 50,257 makes it the largest of the pass.
import { IndexRangeError, ShapeError } from "../errors.ts";
import type { Tensor } from "../tensor.ts";
import { checkActivationDType, checkDType, checkInputs, lastDim } from "./check.ts";

export function softmaxCrossEntropy(logits: Tensor, targets: Tensor): Tensor {
  const ctx = checkInputs("softmaxCrossEntropy", [logits, targets]);
  const elem = checkActivationDType("softmaxCrossEntropy", logits);
  checkDType("softmaxCrossEntropy", targets, "i32");
  const V = lastDim(logits.shape);
  const N = logits.numel / V;
  const lead = logits.shape.slice(0, -1);
  if (logits.shape.length < 2 || targets.shape.length !== lead.length || lead.some((d, i) => d !== targets.shape[i])) {
    throw new ShapeError(
      "softmaxCrossEntropy",
      [logits.shape, targets.shape],
      "targets must have the leading dims of logits",
    );
  }
  const be = ctx.backend;
  const loss = ctx.empty([1]);
  const losses = ctx.empty([N]);
  const lse = ctx.empty([N]);
  // targets known on the host to be in range need no count (on a GPU: no wait in the forward pass)
  const invalid = be.crossEntropyForward(
    loss.ptr,
    losses.ptr,
    lse.ptr,
    logits.ptr,
    targets.ptr,
    N,
    V,
    elem,
    targets.knownInRange(V),
  );
  losses.drop();
  if (invalid > 0) throw new IndexRangeError("softmaxCrossEntropy", invalid, V, targets.shape);
  ctx.record(
    "softmaxCrossEntropy",
    [logits],
    loss,
    () => {
      const inPlace = logits.gradInPlace();
      be.crossEntropyBackward(
        logits.ensureGrad().ptr,
        logits.ptr,
        lse.ptr,
        targets.ptr,
        loss.grad!.ptr,
        N,
        V,
        !inPlace,
        elem,
      );
    },
    [logits, targets, lse],
  );
  lse.drop();
  return loss;
}

// ---- float64 reference --------------------------------------------------------------------

export function softmaxCrossEntropyReference(logits: Float64Array, targets: Int32Array, N: number, V: number) {
  const probs = new Float64Array(N * V);
  let total = 0;
  for (let n = 0; n < N; n++) {
    let max = -Infinity;
    for (let v = 0; v < V; v++) max = Math.max(max, logits[n * V + v]!);
    let sum = 0;
    for (let v = 0; v < V; v++) sum += Math.exp(logits[n * V + v]! - max);
    for (let v = 0; v < V; v++) probs[n * V + v] = Math.exp(logits[n * V + v]! - max) / sum;
    total += Math.log(sum) + max - logits[n * V + targets[n]!]!;
  }
  return { loss: total / N, probs };
}

// forward was: loss = (1/N) sum_n (logsumexp(x_n) - x_n[t_n])  =>  dx_n[v] = (p_n[v] - [v == t_n]) / N
export function softmaxCrossEntropyBackwardReference(
  probs: Float64Array,
  targets: Int32Array,
  N: number,
  V: number,
  dloss = 1,
): Float64Array {
  const d = new Float64Array(N * V);
  for (let n = 0; n < N; n++) {
    for (let v = 0; v < V; v++) d[n * V + v] = ((probs[n * V + v]! - (v === targets[n] ? 1 : 0)) * dloss) / N;
  }
  return d;
}
