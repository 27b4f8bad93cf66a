// Mixed precision: which multiply a GEMM runs, and the 2-byte copies autocast makes.
//
// Context.precision picks the GEMM inputs of matmul (engine/ops/matmul.ts):
//   f32   plain f32 GEMMs (the default)
//   tf32  f32 tensors, multiply inputs rounded to TF32 on tensor cores (f32 on a CPU)
//   bf16  autocast: matmul casts a and b to bf16 arena copies and runs a bf16 gemm; its backward
//         casts dout once and reuses those copies. A parameter's copy is a view into its store's
//         bf16 copy of the whole slab, cast once per optimizer step (engine/params.ts
//         weightCopy). Accumulation is f32, into f32 outputs and gradients.
//   f16   as bf16, with f16 copies. f16's 5-bit exponent flushes small gradients to zero, so
//         a training step with f16 scales the loss (engine/optim/loss-scale.ts).
// Attention's batched GEMMs (engine/ops/attention.ts) follow the same rule. Parameters stay f32
// (fp32 master weights: the optimizer updates them in f32), and every op that is not a GEMM
// (softmax, LayerNorm, the loss) computes in f32.
//
// bf16 activations: under autocast, a tensor that only GEMMs and attention read (a LayerNorm's
// output, the qkv projection, attention's output, the MLP's hidden layer) is stored in the
// autocast type (activationDType), written so by the op that makes it (LayerNorm, a linear layer
// whose GEMM writes 2-byte C and whose bias and GELU kernels read and write it, attention), and
// its gradient has that type too. The residual stream, the branches added into it, the logits and
// every sum stay f32. A GEMM then reads such a tensor as it is: no copy. The autocast copies are made by ops/cast.ts; this
// module imports no tensor code, so the tensor module can take its precision from here.
import { ConfigError } from "../ffi/errors.ts";

export const precisions = ["f32", "tf32", "bf16", "f16"] as const;
export type Precision = (typeof precisions)[number];

export function checkPrecision(p: string): Precision {
  if (!(precisions as readonly string[]).includes(p)) {
    throw new ConfigError(`precision must be one of ${precisions.join(", ")}, got ${JSON.stringify(p)}`);
  }
  return p as Precision;
}

/** The 2-byte dtype autocast copies GEMM inputs into, or null when GEMMs read f32 tensors. */
export function autocastDType(p: Precision): "bf16" | "f16" | null {
  return p === "bf16" || p === "f16" ? p : null;
}

/** What an activation that only GEMMs (and attention) read is stored in: the autocast type, or
 *  f32. Such tensors' gradients have their type too. */
export function activationDType(p: Precision): "f32" | "bf16" | "f16" {
  return autocastDType(p) ?? "f32";
}
