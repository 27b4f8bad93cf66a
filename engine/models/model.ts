// What the training loop needs from a model: logits from inputs, a loss, and the parameter
// slabs. Inputs are f32 features (mlp) or i32 token ids (gpt); targets are i32 class ids.
import type { ParamStore } from "../params.ts";
import type { Tensor } from "../tensor.ts";

export interface Model {
  readonly kind: "mlp" | "gpt";
  /** the resolved, JSON-serializable config (written into checkpoints) */
  readonly config: object;
  readonly store: ParamStore;
  forward(inputs: Tensor): Tensor;
  /** mean softmax cross-entropy of forward(inputs) against targets */
  loss(inputs: Tensor, targets: Tensor): Tensor;
  /**
   * loss() a part at a time: before each part (a layer, a block) it yields the names of the
   * parameters that part reads, so a caller can make them ready first (ZeRO stage 3 gathers
   * them); driven to its end, it returns what loss() returns.
   */
  lossSteps(inputs: Tensor, targets: Tensor): Generator<readonly string[], Tensor, void>;
  /** floating-point operations of the GEMMs of one training step (forward + backward) */
  gemmFlopsPerStep(batch: number): number;
  /** the GEMM shapes of one training step: [M, N, K, count] (benchmarks time exactly these) */
  gemmShapes(batch: number): GemmShape[];
}

export interface GemmShape {
  /** batched GEMMs (attention) count each matrix product once per batch element */
  M: number;
  N: number;
  K: number;
  transA: boolean;
  transB: boolean;
  batch: number;
}

/** Runs a stepwise pass to its end (the parameters are all in place). */
export function drive<T>(steps: Generator<readonly string[], T, void>): T {
  let r = steps.next();
  while (!r.done) r = steps.next();
  return r.value;
}

/** The parameter names of a store under `prefix` (a module's: "h.0", "wte"). */
export const namesUnder = (names: readonly string[], prefix: string): string[] =>
  names.filter((n) => n === prefix || n.startsWith(`${prefix}.`));

export const gemmFlops = (shapes: readonly GemmShape[]): number =>
  shapes.reduce((sum, s) => sum + 2 * s.M * s.N * s.K * s.batch, 0);
