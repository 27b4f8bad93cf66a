// linear: out (...,O) = act(inp (...,I) @ weight (O,I)^T + bias (O)), act the identity or GELU
// (tanh form, as GPT-2): a layer as one op, as PyTorch's addmm and llm.c's matmul + bias do.
//
// The bias, the GELU, the bias gradient and the GELU's gradient are GEMM epilogues
// (ffi/backend.ts GemmEpilogue): on CUDA, cuBLASLt adds the bias (and applies GELU, writing the
// pre-activation beside the output) as the GEMM stores its result, and sums the bias gradient
// while the weight gradient's GEMM reads the output gradient; elsewhere the layer kernels run
// after the GEMM (biasAdd, biasGeluForward, biasBackward). The GELU's gradient crosses two
// layers: a layer whose input is a GELU layer's output, read by no other op, writes that
// input's gradient through the GELU's in its input-gradient GEMM (dgelu, reading the GELU
// layer's saved pre-activation), and the GELU layer's backward takes it as its
// pre-activation's gradient: no separate gradient of the GELU's output and no geluBackward pass
// (an MLP's c_proj and c_fc). No pre-bias copy is made and one tape node stands for the layer.
// With GELU the pre-activation is kept for backward, beside the output; PyTorch keeps the same
// two.
//
// Under autocast (bf16/f16) the GEMMs read 2-byte copies of inp, weight and the output's
// gradient and accumulate in f32 (engine/mixed.ts), as matmul does. An input already in the
// autocast type is read as it is (its gradient is written in that type), and `outDType` may ask
// for the output in that type: the GEMM writes 2-byte C, the bias and GELU kernels read and
// write it, and the output's gradient (of that type) feeds the GEMMs with no copy.
import { ShapeError } from "../errors.ts";
import { autocastDType } from "../mixed.ts";
import { dropAll, type Tensor } from "../tensor.ts";
import { type Context } from "../context.ts";
import type { DType, GemmEpilogue } from "../../ffi/backend.ts";
import { checkActivationDType, checkDType, checkInputs, checkOutDType, lastDim } from "./check.ts";
import { weightCopy } from "../params.ts";
import { gemm, gemmOperand, gradOutput } from "./matmul.ts";

export type Activation = "none" | "gelu";

/** A GELU layer's output -> its pre-activation (saved by its node until its backward has run). */
const geluPre = new WeakMap<Tensor, Tensor>();
/** GELU layers' outputs whose gradient the reading layer wrote through the GELU's (dgelu). */
const gradThroughGelu = new WeakSet<Tensor>();

/** How many of the pass's recorded ops read t (or a view of it). */
const readers = (ctx: Context, t: Tensor): number =>
  ctx.tape.reduce((n, node) => n + (node.inputs.some((x) => x === t || x.viewOf === t) ? 1 : 0), 0);

export function linear(
  inp: Tensor,
  weight: Tensor,
  bias: Tensor | null,
  activation: Activation = "none",
  outDType: DType = "f32",
): Tensor {
  const ctx = checkInputs("linear", bias === null ? [inp, weight] : [inp, weight, bias]);
  for (const t of bias === null ? [weight] : [weight, bias]) checkDType("linear", t, "f32");
  checkActivationDType("linear", inp);
  const elem = checkOutDType("linear", ctx, outDType);
  const I = lastDim(inp.shape);
  if (weight.shape.length !== 2 || weight.shape[1] !== I || inp.shape.length < 1) {
    throw new ShapeError(
      "linear",
      [inp.shape, weight.shape],
      "weight must be (out, in) with in = the input's last dim",
    );
  }
  const O = weight.shape[0]!;
  if (bias !== null && (bias.shape.length !== 1 || bias.shape[0] !== O)) {
    throw new ShapeError("linear", [weight.shape, bias.shape], "bias must be (out)");
  }
  const N = inp.numel / I;
  const shape = [...inp.shape.slice(0, -1), O];
  const be = ctx.backend;
  const input = ctx.precision; // fixed for this op's backward too
  const half = autocastDType(input);
  // x16, w16: what the GEMMs read (2-byte copies under autocast), kept for backward
  const x16 = gemmOperand(inp, half);
  const w16 = gemmOperand(weight, half);
  // pre (N,O) = x w^T + b, out = gelu(pre): the bias and GELU are the GEMM's epilogue
  const gelu = activation === "gelu";
  const pre = ctx.empty(shape, elem);
  const out = gelu ? ctx.empty(shape, elem) : pre;
  const xw = (C: Tensor, epilogue: GemmEpilogue | null) =>
    gemm(be, input, elem, 1, false, true, N, O, I, x16.ptr, w16.ptr, 0, C.ptr, epilogue);
  // a 2-byte output's bias in its type, where the bias is a parameter: its weight copy
  const biasCopy = bias !== null && half !== null && elem === half ? weightCopy(bias, half)?.ptr : undefined;
  if (bias === null) {
    xw(pre, null);
    if (gelu) be.geluForward(out.ptr, pre.ptr, out.numel, elem);
  } else if (gelu) xw(out, { kind: "biasGelu", bias: bias.ptr, pre: pre.ptr, biasCopy });
  else xw(pre, { kind: "bias", bias: bias.ptr, biasCopy });
  // backward reads w16 for the input's gradient, x16 for the weight's, pre for GELU's
  const saved = [...(inp.requiresGrad ? [w16] : []), ...(weight.requiresGrad ? [x16] : []), ...(gelu ? [pre] : [])];
  ctx.record(
    "linear",
    bias === null ? [inp, weight] : [inp, weight, bias],
    out,
    () => {
      const dout = out.grad!; // of elem
      // forward was: out = gelu(pre)  =>  dpre = gelu'(pre) dout (already so where the layer
      // reading out wrote its gradient through the GELU's)
      const throughGelu = gelu && !gradThroughGelu.has(out);
      const dpre = throughGelu ? ctx.zeros(shape, elem) : dout;
      if (throughGelu) be.geluBackward(dpre.ptr, pre.ptr, dout.ptr, dpre.numel, elem);
      // forward was: pre = x w^T + b  =>  db = sum over rows of dpre (the weight gradient's
      // GEMM takes it as its epilogue, reading dpre as it does; alone here without one)
      const dbias = bias?.requiresGrad ? bias.ensureGrad() : null;
      if (dbias !== null && !weight.requiresGrad) be.biasBackward(dbias.ptr, dpre.ptr, N, O, elem);
      const g16 = gemmOperand(dpre, half);
      // dx (N,I) += dpre w;  dw (O,I) += dpre^T x
      if (inp.requiresGrad) {
        const { grad, fresh } = inp.gradForWrite();
        // inp a GELU layer's output that only this layer reads: its gradient goes through the
        // GELU's in the same GEMM (that layer's backward then takes it as its pre-activation's)
        const inputPre = fresh ? geluPre.get(inp) : undefined;
        const throughInputGelu = inputPre !== undefined && readers(ctx, inp) === 1;
        const epilogue: GemmEpilogue | null = throughInputGelu ? { kind: "dgelu", pre: inputPre.ptr } : null;
        gemm(be, input, gradOutput(inp), 1, false, false, N, I, O, g16.ptr, w16.ptr, fresh ? 0 : 1, grad.ptr, epilogue);
        if (throughInputGelu) gradThroughGelu.add(inp);
      }
      if (weight.requiresGrad) {
        const epilogue: GemmEpilogue | null = dbias === null ? null : { kind: "biasGrad", dbias: dbias.ptr };
        gemm(be, input, "f32", 1, true, false, O, I, N, g16.ptr, x16.ptr, 1, weight.ensureGrad().ptr, epilogue);
      }
      if (g16 !== dpre) g16.drop();
      if (dpre !== dout) dpre.drop();
    },
    saved,
  );
  if (gelu && out.requiresGrad) geluPre.set(out, pre);
  // the op's own tensors: the autocast copies, and the pre-activation under GELU
  if (x16 !== inp) x16.drop();
  if (w16 !== weight) w16.drop();
  if (gelu) pre.drop();
  return out;
}
