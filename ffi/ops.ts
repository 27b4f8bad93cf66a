// Every kernel op of the backends, declared once: its arguments (names and types, in the order
// the Backend method takes them), what it returns, and its CPU kernel in ffi/cpu/kernels.c. From
// these:
//   - the Backend interface's op methods (OpMethods, below: argument and result types);
//   - the CPU backend's dlopen table and its methods (ffi/cpu/backend.ts);
//   - the CUDA backend's methods, each running its plan (ffi/cuda/kernels.ts `plans`, whose type
//     is derived from these too: a missing plan, or one of other arguments, does not compile),
//     and the parameter types of each CUDA kernel that mirrors an op (kernelSpecs' opKernels);
//   - the check of kernels.c's prototypes against them (test/ffi/ops.test.ts).
// Adding an op: its declaration here, its C kernel and its CUDA kernel and plan, its float64
// reference (engine/ops/*) and its test.
//
// Argument types:
//   ptr    backend memory (Ptr)           i64  a count, size or stride (number)
//   f32    a float32 (number)             u64  a 64-bit seed (bigint)
//   bool   a flag (boolean; int32 0/1 in C)
//   binop  add or mul (BinaryOp; int32 0/1 in C)
//   elem   f32, bf16 or f16: what a buffer of 2- or 4-byte elements holds (ElemType; int32 0/1/2 in C)
//   dims4  four int64 (Dims4), outermost first
// Backward kernels ADD into their gradient buffers (dinp += ...).
import type { BinaryOp, Dims4, ElemType, Ptr } from "./backend.ts";

export type ArgType = "ptr" | "i64" | "f32" | "u64" | "bool" | "binop" | "elem" | "dims4";

/** elem arguments as C takes them */
export const elemCodes: Readonly<Record<ElemType, number>> = { f32: 0, bf16: 1, f16: 2 };

export interface OpDecl {
  readonly args: readonly (readonly [name: string, type: ArgType])[];
  /** what reaches JavaScript: nothing, a count (i64), or a sum (f64); a GPU backend waits for it */
  readonly result: "void" | "i64" | "f64";
  /** takes a last, optional `inRange`: the caller has checked on the host that every id or target
   *  is in range, so the count is not wanted (a GPU backend then returns 0 without waiting) */
  readonly inRange?: true;
  /** a GPU backend's plan also takes device scratch (for partial sums of a split reduction) */
  readonly scratch?: true;
  /** the CPU kernel in ffi/cpu/kernels.c */
  readonly cpu: string;
  /** the C kernel's parameters by name, when their order is not the method's */
  readonly cpuOrder?: readonly string[];
}

const p = (name: string) => [name, "ptr"] as const;
const i = (name: string) => [name, "i64"] as const;
const f = (name: string) => [name, "f32"] as const;
const e = ["elem", "elem"] as const;

export const ops = {
  // ---- elementwise (f32) ----
  add: { args: [p("out"), p("a"), p("b"), i("n")], result: "void", cpu: "mt_add_f32" },
  mul: { args: [p("out"), p("a"), p("b"), i("n")], result: "void", cpu: "mt_mul_f32" },
  /** y += alpha x */
  axpy: { args: [p("y"), p("x"), i("n"), f("alpha")], result: "void", cpu: "mt_axpy_f32" },
  scale: { args: [p("x"), i("n"), f("s")], result: "void", cpu: "mt_scale_f32" },
  /** dinp[i] += dout[0] * scale (dout is a scalar in backend memory) */
  addScalarFrom: { args: [p("dinp"), p("dout"), f("scale"), i("n")], result: "void", cpu: "mt_add_scalar_ptr_f32" },
  /** out[i] = a[i·aStrides] op b[i·bStrides] over dims; out is contiguous with `dims` */
  binaryBroadcast: {
    args: [["op", "binop"], p("out"), p("a"), p("b"), ["dims", "dims4"], ["aStrides", "dims4"], ["bStrides", "dims4"]],
    result: "void",
    cpu: "mt_binary_bcast_f32",
  },
  /** out[i·outStrides] += inp[i] over dims (inp contiguous): reduce a gradient onto a broadcast operand */
  reduceBroadcast: {
    args: [p("out"), p("inp"), ["dims", "dims4"], ["outStrides", "dims4"]],
    result: "void",
    cpu: "mt_reduce_bcast_f32",
  },

  // ---- layers ----
  // `elem` says what the activations (and their gradients) hold: f32, or the autocast type
  // (engine/mixed.ts); biases, LayerNorm's parameters and statistics, and sums are f32.
  /** out, inp (N,C) of elem; out may be inp */
  biasAdd: {
    args: [p("out"), p("inp"), p("bias"), i("N"), i("C"), e],
    result: "void",
    cpu: "mt_bias_add_f32",
  },
  /** dbias (C) f32 += column sums of dout (N,C) of elem */
  biasBackward: {
    args: [p("dbias"), p("dout"), i("N"), i("C"), e],
    result: "void",
    scratch: true,
    cpu: "mt_bias_backward_f32",
  },
  reluForward: { args: [p("out"), p("inp"), i("n"), e], result: "void", cpu: "mt_relu_forward_f32" },
  reluBackward: { args: [p("dinp"), p("inp"), p("dout"), i("n"), e], result: "void", cpu: "mt_relu_backward_f32" },
  geluForward: { args: [p("out"), p("inp"), i("n"), e], result: "void", cpu: "mt_gelu_forward_f32" },
  geluBackward: { args: [p("dinp"), p("inp"), p("dout"), i("n"), e], result: "void", cpu: "mt_gelu_backward_f32" },
  dropoutForward: {
    args: [p("out"), p("inp"), i("n"), f("p"), ["seed", "u64"]],
    result: "void",
    cpu: "mt_dropout_forward_f32",
  },
  dropoutBackward: {
    args: [p("dinp"), p("dout"), i("n"), f("p"), ["seed", "u64"]],
    result: "void",
    cpu: "mt_dropout_backward_f32",
  },
  /** pre += bias in place, out = gelu(pre) (a layer's bias and activation in one pass); both of elem */
  biasGeluForward: {
    args: [p("out"), p("pre"), p("bias"), i("N"), i("C"), e],
    result: "void",
    cpu: "mt_bias_gelu_forward_f32",
  },
  /** returns the count of targets outside [0, V); lse (N): each row's log-sum-exp; logits of elem */
  crossEntropyForward: {
    args: [p("loss"), p("losses"), p("lse"), p("logits"), p("targets"), i("N"), i("V"), e],
    result: "i64",
    inRange: true,
    cpu: "mt_crossentropy_forward_f32",
  },
  /** dlogits (+)= softmax - onehot, from the logits and lse; without accumulate it overwrites, and
   *  dlogits may be the logits themselves; both of elem */
  crossEntropyBackward: {
    args: [p("dlogits"), p("logits"), p("lse"), p("targets"), p("dloss"), i("N"), i("V"), ["accumulate", "bool"], e],
    result: "void",
    cpu: "mt_crossentropy_backward_f32",
  },
  /** returns how many rows of logits (N,V) of elem have their largest logit at the target (the
   *  first largest on ties; NaN logits are passed over, unless a row's first is NaN: then 0 is
   *  its argmax, as a strict > scan from the start finds) */
  countCorrect: {
    args: [p("logits"), p("targets"), i("N"), i("V"), e],
    result: "i64",
    cpu: "mt_count_correct_f32",
  },
  layerNormForward: {
    args: [p("out"), p("mean"), p("rstd"), p("inp"), p("weight"), p("bias"), i("N"), i("C"), f("eps"), e],
    result: "void",
    cpu: "mt_layernorm_forward_f32",
  },
  /** sum = x + d, out = layerNorm(sum): a residual add and the LayerNorm that reads it, in one pass;
   *  out of elem, the rest f32 */
  residualLayerNormForward: {
    args: [
      p("sum"),
      p("out"),
      p("mean"),
      p("rstd"),
      p("x"),
      p("d"),
      p("weight"),
      p("bias"),
      i("N"),
      i("C"),
      f("eps"),
      e,
    ],
    result: "void",
    cpu: "mt_residual_layernorm_forward_f32",
  },
  /** dout (the out's gradient) of elem; the rest f32 */
  layerNormBackward: {
    args: [
      p("dinp"),
      p("dweight"),
      p("dbias"),
      p("dout"),
      p("inp"),
      p("weight"),
      p("mean"),
      p("rstd"),
      i("N"),
      i("C"),
      e,
    ],
    result: "void",
    scratch: true,
    cpu: "mt_layernorm_backward_f32",
  },
  /** returns the count of ids outside [0, V) (their rows come out zero) */
  embeddingForward: {
    args: [p("out"), p("ids"), p("table"), i("N"), i("C"), i("V")],
    result: "i64",
    inRange: true,
    cpu: "mt_embedding_forward_f32",
  },
  embeddingBackward: {
    args: [p("dtable"), p("ids"), p("dout"), i("N"), i("C")],
    result: "void",
    cpu: "mt_embedding_backward_f32",
  },
  /** causal self-attention over qkv (B,T,3C) of `elem`, H heads: out (B,T,C) of elem, lse (B,H,T)
   *  f32; tiles with an online softmax, no (T,T) matrix */
  attentionForward: {
    args: [p("out"), p("lse"), p("qkv"), i("B"), i("T"), i("C"), i("H"), f("scale"), e],
    result: "void",
    cpu: "mt_attention_forward_f32",
  },
  /** out (B,C) of elem = each batch's last query row's (T-1) causal attention over keys [0, T) of
   *  qkv (B,T,3C) of elem, as attentionForward computes that row (P rounded to elem): generation's
   *  new token attending over the keys and values cached for the earlier ones. No lse (no backward). */
  attentionDecode: {
    args: [p("out"), p("qkv"), i("B"), i("T"), i("C"), i("H"), f("scale"), e],
    result: "void",
    cpu: "mt_attention_decode_f32",
  },
  /** dqkv (B,T,3C) += the gradient (= without accumulate), recomputing the scores tile by tile
   *  from lse; dqkv, dout and out of elem; delta (B,H,T) is scratch (each row's dout . out) */
  attentionBackward: {
    args: [
      p("dqkv"),
      p("delta"),
      p("dout"),
      p("out"),
      p("lse"),
      p("qkv"),
      i("B"),
      i("T"),
      i("C"),
      i("H"),
      f("scale"),
      e,
      ["accumulate", "bool"],
    ],
    result: "void",
    cpu: "mt_attention_backward_f32",
  },
  /** out[i·outStrides] = (or +=) inp[i·inpStrides] over dims: permutes, splits, merges. No two
   *  indices may map to the same out element. */
  stridedCopy: {
    args: [
      p("out"),
      ["outStrides", "dims4"],
      p("inp"),
      ["inpStrides", "dims4"],
      ["dims", "dims4"],
      ["accumulate", "bool"],
    ],
    result: "void",
    cpu: "mt_strided_copy_f32",
    cpuOrder: ["out", "inp", "dims", "outStrides", "inpStrides", "accumulate"],
  },

  // ---- reductions ----
  /** out[0] = sum of inp (n) */
  sum: { args: [p("out"), p("inp"), i("n")], result: "void", cpu: "mt_sum_f32" },
  sumSquares: { args: [p("x"), i("n")], result: "f64", cpu: "mt_sum_squares_f32" },
  countNonFinite: { args: [p("x"), i("n")], result: "i64", cpu: "mt_count_nonfinite_f32" },

  // ---- optimizer updates (PyTorch semantics; see ffi/cpu/kernels.c) ----
  sgdStep: {
    args: [
      p("param"),
      p("grad"),
      p("momentumBuf"),
      i("n"),
      f("lr"),
      f("momentum"),
      f("dampening"),
      f("weightDecay"),
      ["nesterov", "bool"],
      ["first", "bool"],
    ],
    result: "void",
    cpu: "mt_sgd_step_f32",
  },
  /** `age`: 0, or the steps since each coordinate last had a gradient (sparse gradients:
   *  ffi/numerics.h); weight decay on the first decayEnd of the n; the gradient read times
   *  gradScale (the global-norm clip's factor, so no pass scales the gradients first) */
  adamwStep: {
    args: [
      p("param"),
      p("grad"),
      p("m"),
      p("v"),
      p("age"),
      i("n"),
      i("decayEnd"),
      f("lr"),
      f("beta1"),
      f("beta2"),
      f("eps"),
      f("weightDecay"),
      f("biasCorrection1"),
      f("biasCorrection2"),
      f("gradScale"),
    ],
    result: "void",
    cpu: "mt_adamw_step_f32",
  },

  // ---- casts ----
  castF32ToBF16: { args: [p("out"), p("inp"), i("n")], result: "void", cpu: "mt_f32_to_bf16" },
  castBF16ToF32: { args: [p("out"), p("inp"), i("n")], result: "void", cpu: "mt_bf16_to_f32" },
  castF32ToF16: { args: [p("out"), p("inp"), i("n")], result: "void", cpu: "mt_f32_to_f16" },
  castF16ToF32: { args: [p("out"), p("inp"), i("n")], result: "void", cpu: "mt_f16_to_f32" },
} as const satisfies Record<string, OpDecl>;

export type OpName = keyof typeof ops;

type TsOf<T extends ArgType> = T extends "ptr"
  ? Ptr
  : T extends "i64" | "f32"
    ? number
    : T extends "u64"
      ? bigint
      : T extends "bool"
        ? boolean
        : T extends "binop"
          ? BinaryOp
          : T extends "elem"
            ? ElemType
            : Dims4;

/** The JavaScript arguments of an op's declaration. */
type ArgsTs<A extends OpDecl["args"]> = {
  -readonly [K in keyof A]: A[K] extends readonly [string, infer T extends ArgType] ? TsOf<T> : never;
};
export type OpArgs<D extends OpDecl> = ArgsTs<D["args"]>;
type OpResult<D extends OpDecl> = D["result"] extends "void" ? void : number;
type OpMethod<D extends OpDecl> = D extends { inRange: true }
  ? (...args: [...OpArgs<D>, inRange?: boolean]) => OpResult<D>
  : (...args: OpArgs<D>) => OpResult<D>;

/** The op methods every Backend has, typed from the declarations. */
export type OpMethods = { [K in OpName]: OpMethod<(typeof ops)[K]> };

/** The C parameter types of a declaration, in the kernel's order (what dlopen and kernels.c take). */
export function cArgTypes(d: OpDecl): ("ptr" | "i64" | "f32" | "u64" | "i32")[] {
  const byName = new Map(d.args.map(([name, type]) => [name, type]));
  const order = d.cpuOrder ?? d.args.map(([name]) => name);
  return order.flatMap((name): ("ptr" | "i64" | "f32" | "u64" | "i32")[] => {
    const t = byName.get(name);
    if (t === undefined) throw new Error(`op ${d.cpu}: cpuOrder names ${name}, which is not an argument`);
    if (t === "dims4") return ["i64", "i64", "i64", "i64"];
    if (t === "bool" || t === "binop" || t === "elem") return ["i32"];
    return [t];
  });
}

/** Whether a declaration's JavaScript arguments go to the C kernel as they are (no conversion, same order). */
export const passesStraight = (d: OpDecl): boolean =>
  d.cpuOrder === undefined &&
  d.inRange !== true &&
  d.args.every(([, t]) => t === "ptr" || t === "i64" || t === "f32" || t === "u64");

/** The C kernel's arguments from the method's (expanded dims, flags as 0/1, in the kernel's order). */
export function toCArgs(d: OpDecl, args: readonly unknown[]): unknown[] {
  const order = d.cpuOrder ?? d.args.map(([name]) => name);
  const at = new Map(d.args.map(([name, type], k) => [name, { type, value: args[k] }]));
  return order.flatMap((name) => {
    const { type, value } = at.get(name)!;
    if (type === "dims4") return [...(value as Dims4)];
    if (type === "bool") return [value ? 1 : 0];
    if (type === "binop") return [value === "add" ? 0 : 1];
    if (type === "elem") return [elemCodes[value as ElemType]];
    return [value];
  });
}
