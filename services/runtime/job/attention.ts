// Which causal attention a GPT asks for (`--attention`; a mesh job's `attention`), and what
// cuDNN's fused attention needs of a run, so that a choice that cannot be honoured is refused
// where it enters (the CLI, a job config, a trainer opening a job) with the reason, not at the
// first attention call. The choices and what each runs are ffi/cuda/attention-path.ts's; the
// shapes cuDNN takes are ffi/cuda/sdpa-graph.ts's; which precisions autocast to 2 bytes is
// engine/mixed.ts's. Only `cudnn` and `kernel` can be refused: auto falls back to the reference
// kernels, which take every shape and precision.
import { autocastDType, type Precision } from "../../../engine/mixed.ts";
import { type AttentionChoice, attentionChoices } from "../../../ffi/cuda/attention-path.ts";
import { flashUnsupported } from "../../../ffi/cuda/kernels.ts";
import { sdpaUnsupported } from "../../../ffi/cuda/sdpa-graph.ts";

export { type AttentionChoice, attentionChoices };

/** The help of `--attention`, for `train gpt` and the mesh's job options alike. */
export const attentionHelp =
  "which causal attention runs on a GPU: auto: cuDNN's fused flash attention where cuDNN loads and takes the " +
  "shape under --precision bf16|f16, else the f32-FMA kernels; cudnn: cuDNN's or an error saying why; " +
  "kernel: our tensor-core kernels (bf16|f16, head size 64 or 128) or an error saying why; " +
  "reference: the f32-FMA kernels. A CPU runs its C kernels (cudnn and kernel are refused there)";

/** The shape of a GPT that attention sees. */
export interface AttentionShape {
  nEmbd: number;
  nHead: number;
  blockSize: number;
}

/**
 * Why `choice` cannot run a GPT at `precision` (and of `shape`, where it is known yet); null
 * when it can. The text follows "attention cudnn" (or "--attention cudnn").
 */
export function attentionProblem(
  choice: AttentionChoice,
  precision: Precision,
  shape: AttentionShape | null,
): string | null {
  if (choice === "kernel") return kernelProblem(precision, shape);
  if (choice !== "cudnn") return null;
  const half = autocastDType(precision);
  if (half === null)
    return (
      `needs bf16 or f16 autocast (--precision bf16 or f16): cuDNN's fused attention reads q, k and v in 2 bytes, ` +
      `and precision ${precision} keeps them f32 (auto or reference runs the f32-FMA kernels there)`
    );
  if (shape === null) return null;
  const D = shape.nEmbd / shape.nHead;
  const refused = sdpaUnsupported({
    B: 1,
    H: shape.nHead,
    T: shape.blockSize,
    D,
    dtype: half === "f16" ? "half" : "bf16",
    scale: 1 / Math.sqrt(D),
  });
  return refused === null
    ? null
    : `cannot run this GPT: ${refused} (head size = n-embd / n-head = ${shape.nEmbd} / ${shape.nHead}; auto or reference runs the kernels)`;
}

/** Why the tensor-core kernels cannot run a GPT at `precision` (and of `shape`); null when they can. */
function kernelProblem(precision: Precision, shape: AttentionShape | null): string | null {
  const half = autocastDType(precision);
  if (half === null)
    return (
      `needs bf16 or f16 autocast (--precision bf16 or f16): the tensor-core kernels read q, k and v in 2 bytes, ` +
      `and precision ${precision} keeps them f32 (auto or reference runs the f32-FMA kernels there)`
    );
  if (shape === null) return null;
  const why = flashUnsupported(shape.nEmbd, shape.nHead, half);
  return why === null
    ? null
    : `cannot run this GPT: ${why} (head size = n-embd / n-head = ${shape.nEmbd} / ${shape.nHead}; auto or reference runs the f32-FMA kernels)`;
}

/** Why `choice` cannot run where the run computes: `cpuBecause` says why that is a CPU, null
 *  for a GPU (where whether cuDNN loads is the CUDA backend's to say, naming how to install it).
 *  The text follows "attention cudnn"; null when it may run. */
export function attentionDeviceProblem(choice: AttentionChoice, cpuBecause: string | null): string | null {
  if (cpuBecause === null || (choice !== "cudnn" && choice !== "kernel")) return null;
  const what = choice === "cudnn" ? "cuDNN's fused attention runs on one" : "the tensor-core kernels run on one";
  return `needs a GPU (${what}), but ${cpuBecause}; a CPU runs its C kernels (attention auto or reference)`;
}
