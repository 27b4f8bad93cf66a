// cuDNN's fused causal attention as data: the operation graphs of scaled dot-product attention,
// forward and backward, in the form cuDNN's backend API matches against its fused
// flash-attention engines (the composite pattern cudnn-frontend 1.x emits for
// `sdpa(causal, generate_stats)` and `sdpa_backward` on cuDNN 9.0-9.20). ffi/cuda/cudnn.ts turns
// a graph into backend descriptors; the fake cuDNN in the tests checks what it receives against
// the same pattern, and the shapes below against attention's definition.
//
// Letters: B batch, H heads, T time (queries = keys, self-attention), D head size, C = H*D.
// Every tensor is 4-D [B, H, rows, cols], strides in elements. The operands live in meshtrain's
// own layouts, so no copy or transpose runs before or after cuDNN:
//   qkv  (B,T,3C): q at channel 0, k at C, v at 2C, head h at h*D of each
//        Q = qkv + 0, dims [B,H,T,D], strides [T*3C, D, 3C, 1]; K, V the same from +C, +2C
//        K^T (what the first product reads) swaps the last two: [B,H,D,T], [T*3C, D, 1, 3C]
//   out  (B,T,C): O dims [B,H,T,D], strides [T*C, D, C, 1]
//   lse  (B,H,T) f32: Stats dims [B,H,T,1], strides [H*T, T, 1, 1], densely packed
// Gradients dQ, dK, dV have Q's layout inside a (B,T,3C) buffer, so they land as dqkv.
//
// Forward (S scores, P probabilities; intermediates are virtual: cuDNN never writes them):
//   S = Q K^T · scale;  S[i,j] = -inf where j > i;  M = rowmax S;  E = exp(S - M);  Z = rowsum E
//   Stats = M + log Z;  P = E / Z (in the input type);  O = P V
// Backward, recomputing P from Stats:
//   sum = rowsum(dO ∘ O) · 1;  E = exp(mask(Q K^T · scale) - Stats)       (= P)
//   dV = E^T dO;  dS = (dO V^T - sum) ∘ E · scale;  dK = dS^T Q;  dQ = dS K  (through an f32 dQ)
// The two non-virtual f32 intermediates of backward (the row sums and dQ's accumulator) live in
// workspace the caller provides (sdpaBackwardScratch). sdpaForwardPack and sdpaBackwardPack bind
// the buffers of these layouts to the graphs' uids.
import type { Ptr } from "../backend.ts";

/** cuDNN data types (cudnnDataType_t) */
export const cudnnDataType = { float: 0, half: 2, int32: 4, bf16: 9, bool: 11 } as const;
export type CudnnDType = keyof typeof cudnnDataType;

/** cudnnPointwiseMode_t */
export const pointwiseModes = {
  add: 0,
  mul: 1,
  div: 6,
  sub: 9,
  exp: 13,
  log: 15,
  identity: 21,
  cmpGe: 303,
  genIndex: 501,
  binarySelect: 601,
} as const;
export type PointwiseMode = keyof typeof pointwiseModes;

/** cudnnReduceTensorOp_t */
export const reductionModes = { add: 0, max: 3 } as const;
export type ReductionMode = keyof typeof reductionModes;

export type Dims = readonly [number, number, number, number];

export interface GraphTensor {
  /** CUDNN_ATTR_TENSOR_UNIQUE_ID; the variant pack names buffers by it */
  readonly uid: number;
  readonly name: string;
  readonly dtype: CudnnDType;
  readonly dims: Dims;
  readonly strides: Dims;
  /** an intermediate cuDNN keeps to itself (no buffer) */
  readonly virtual: boolean;
  /** a scalar passed by value: the variant pack points at host memory holding it */
  readonly byValue?: number;
}

export type GraphOp =
  | { readonly kind: "matmul"; readonly a: string; readonly b: string; readonly c: string }
  | {
      readonly kind: "pointwise";
      readonly mode: PointwiseMode;
      /** CUDNN_ATTR_POINTWISE_MATH_PREC */
      readonly compute: CudnnDType;
      readonly x: string;
      readonly b?: string;
      /** BINARY_SELECT's condition: y = t ? x : b */
      readonly t?: string;
      readonly y: string;
      /** GEN_INDEX's axis: 2 the row (query) index, 3 the column (key) index */
      readonly axis?: number;
    }
  | { readonly kind: "reduction"; readonly mode: ReductionMode; readonly x: string; readonly y: string }
  | { readonly kind: "reshape"; readonly x: string; readonly y: string };

export interface SdpaGraph {
  readonly direction: "forward" | "backward";
  readonly tensors: readonly GraphTensor[];
  readonly ops: readonly GraphOp[];
}

/** A causal self-attention call: sizes and the 2-byte type of q, k, v, out and the gradients. */
export interface SdpaShape {
  readonly B: number;
  readonly H: number;
  readonly T: number;
  /** head size */
  readonly D: number;
  readonly dtype: "bf16" | "half";
  /** the softmax scale, usually 1/sqrt(D) */
  readonly scale: number;
}

/** What the fused engines take: 2-byte inputs, head sizes that are multiples of 8 up to 128 (the
 *  sizes cuDNN 9 documents for its flash-attention fprop and bprop). null when supported. */
export function sdpaUnsupported(s: SdpaShape): string | null {
  for (const [k, v] of [
    ["B", s.B],
    ["H", s.H],
    ["T", s.T],
    ["D", s.D],
  ] as const) {
    if (!Number.isSafeInteger(v) || v < 1) return `${k}=${v} is not a positive integer`;
  }
  if (s.D % 8 !== 0 || s.D > 128) return `head size ${s.D}: cuDNN's fused attention takes multiples of 8 up to 128`;
  if (!Number.isFinite(s.scale)) return `scale ${s.scale} is not finite`;
  return null;
}

const uids = {
  q: 1,
  k: 2,
  v: 3,
  o: 4,
  stats: 5,
  dO: 6,
  dQ: 7,
  dK: 8,
  dV: 9,
  scale: 10,
  negInf: 11,
  one: 12,
  rowSum: 13,
  dQAccum: 14,
} as const;
/** The variant pack's unique ids of the buffers a caller binds. */
export const sdpaUids = uids;
/** Intermediates are numbered from here, in the order they are made. */
const virtualUidBase = 100;

/** Shorthands for the layouts in the header. */
function layouts(s: SdpaShape) {
  const { B, H, T, D } = s;
  const C = H * D;
  const C3 = 3 * C;
  return {
    qkv: { dims: [B, H, T, D] as Dims, strides: [T * C3, D, C3, 1] as Dims },
    qkvT: { dims: [B, H, D, T] as Dims, strides: [T * C3, D, 1, C3] as Dims },
    out: { dims: [B, H, T, D] as Dims, strides: [T * C, D, C, 1] as Dims },
    rows: { dims: [B, H, T, 1] as Dims, strides: [H * T, T, 1, 1] as Dims },
    scores: { dims: [B, H, T, T] as Dims, strides: [H * T * T, T * T, T, 1] as Dims },
    scoresT: { dims: [B, H, T, T] as Dims, strides: [H * T * T, T * T, 1, T] as Dims },
    scalar: { dims: [1, 1, 1, 1] as Dims, strides: [1, 1, 1, 1] as Dims },
  };
}

/** Builds a graph's tensor list and ops in order; intermediates get uids as they are made. */
class GraphBuilder {
  readonly tensors: GraphTensor[] = [];
  readonly ops: GraphOp[] = [];
  #next = virtualUidBase;

  io(uid: number, name: string, dtype: CudnnDType, l: { dims: Dims; strides: Dims }, byValue?: number): string {
    this.tensors.push({ uid, name, dtype, dims: l.dims, strides: l.strides, virtual: false, byValue });
    return name;
  }

  virtual(name: string, dtype: CudnnDType, l: { dims: Dims; strides: Dims }): string {
    this.tensors.push({ uid: this.#next++, name, dtype, dims: l.dims, strides: l.strides, virtual: true });
    return name;
  }

  matmul(a: string, b: string, c: string): string {
    this.ops.push({ kind: "matmul", a, b, c });
    return c;
  }

  pointwise(mode: PointwiseMode, x: string, y: string, more: { b?: string; t?: string; axis?: number } = {}): string {
    const compute: CudnnDType = mode === "cmpGe" ? "bool" : "float";
    this.ops.push({ kind: "pointwise", mode, compute, x, y, ...more });
    return y;
  }

  reduction(mode: ReductionMode, x: string, y: string): string {
    this.ops.push({ kind: "reduction", mode, x, y });
    return y;
  }

  reshape(x: string, y: string): string {
    this.ops.push({ kind: "reshape", x, y });
    return y;
  }

  /** The operands both directions bind first: Q, K^T, then V as `v` names it ("V", or "V^T" for
   *  backward's dO V^T) and O, each in its layout from the header. */
  operands(s: SdpaShape, l: ReturnType<typeof layouts>, v: "V" | "V^T") {
    return {
      q: this.io(uids.q, "Q", s.dtype, l.qkv),
      kT: this.io(uids.k, "K^T", s.dtype, l.qkvT),
      v: this.io(uids.v, v, s.dtype, v === "V" ? l.qkv : l.qkvT),
      o: this.io(uids.o, "O", s.dtype, l.out),
    };
  }

  /** S · scale = Q K^T · scale, the scores both directions start from */
  scaledScores(q: string, kT: string, scale: string, l: ReturnType<typeof layouts>): string {
    const scores = this.matmul(q, kT, this.virtual("S", "float", l.scores));
    return this.pointwise("mul", scores, this.virtual("S*scale", "float", l.scores), { b: scale });
  }

  /** scores where key j > query i become -inf (cudnn-frontend's top-left causal mask) */
  causalMask(scores: string, negInf: string, l: ReturnType<typeof layouts>, tag: string): string {
    const row = this.pointwise("genIndex", scores, this.virtual(`${tag}.row`, "int32", l.scores), { axis: 2 });
    const col = this.pointwise("genIndex", scores, this.virtual(`${tag}.col`, "int32", l.scores), { axis: 3 });
    const keep = this.pointwise("cmpGe", row, this.virtual(`${tag}.keep`, "bool", l.scores), { b: col });
    return this.pointwise("binarySelect", scores, this.virtual(`${tag}.masked`, "float", l.scores), {
      b: negInf,
      t: keep,
    });
  }
}

/** Forward: O and Stats from Q, K, V (sdpa with a causal mask, generating stats for backward). */
export function sdpaForwardGraph(s: SdpaShape): SdpaGraph {
  const l = layouts(s);
  const g = new GraphBuilder();
  const { q, kT, v, o } = g.operands(s, l, "V");
  const stats = g.io(uids.stats, "Stats", "float", l.rows);
  const scale = g.io(uids.scale, "scale", "float", l.scalar, s.scale);
  const negInf = g.io(uids.negInf, "-inf", "float", l.scalar, Number.NEGATIVE_INFINITY);

  const scaled = g.scaledScores(q, kT, scale, l);
  const masked = g.causalMask(scaled, negInf, l, "mask");
  const max = g.reduction("max", masked, g.virtual("M", "float", l.rows));
  const shifted = g.pointwise("sub", masked, g.virtual("S-M", "float", l.scores), { b: max });
  const e = g.pointwise("exp", shifted, g.virtual("E", "float", l.scores));
  const z = g.reduction("add", e, g.virtual("Z", "float", l.rows));
  const logZ = g.pointwise("log", z, g.virtual("log Z", "float", l.rows));
  g.pointwise("add", max, stats, { b: logZ });
  const p = g.pointwise("div", e, g.virtual("P", s.dtype, l.scores), { b: z });
  g.matmul(p, v, o);
  return { direction: "forward", tensors: g.tensors, ops: g.ops };
}

/** Backward: dQ, dK, dV from Q, K, V, O, dO and the forward's Stats. */
export function sdpaBackwardGraph(s: SdpaShape): SdpaGraph {
  const l = layouts(s);
  const { B, H, T, D } = s;
  const g = new GraphBuilder();
  const { q, kT, v: vT, o } = g.operands(s, l, "V^T");
  const dO = g.io(uids.dO, "dO", s.dtype, l.out);
  const stats = g.io(uids.stats, "Stats", "float", l.rows);
  const scale = g.io(uids.scale, "scale", "float", l.scalar, s.scale);
  const one = g.io(uids.one, "1", "float", l.scalar, 1);
  const negInf = g.io(uids.negInf, "-inf", "float", l.scalar, Number.NEGATIVE_INFINITY);
  const dQ = g.io(uids.dQ, "dQ", s.dtype, l.qkv);
  const dK = g.io(uids.dK, "dK", s.dtype, l.qkv);
  const dV = g.io(uids.dV, "dV", s.dtype, l.qkv);
  const rowSum = g.io(uids.rowSum, "rowsum(dO*O)", "float", l.rows);
  const dQAccum = g.io(uids.dQAccum, "dQ (f32)", "float", {
    dims: [B, H, T, D],
    strides: [H * T * D, T * D, D, 1],
  });

  // sum = rowsum(dO ∘ O): the softmax backward's per-row dot product
  const dOO = g.pointwise(
    "mul",
    dO,
    g.virtual("dO*O", "float", { dims: [B, H, T, D], strides: [H * T * D, T * D, H * D, 1] }),
    {
      b: o,
    },
  );
  const dOORows = g.reduction("add", dOO, g.virtual("rowsum", "float", l.rows));
  g.pointwise("mul", dOORows, rowSum, { b: one });

  // P again, from the saved log-sum-exp
  const scaled = g.scaledScores(q, kT, scale, l);
  const shifted = g.pointwise("sub", scaled, g.virtual("S-Stats", "float", l.scores), { b: stats });
  const masked = g.causalMask(shifted, negInf, l, "mask");
  const p = g.pointwise("exp", masked, g.virtual("P", "float", l.scores));

  // dV = P^T dO
  const pT = g.reshape(p, g.virtual("P^T", s.dtype, l.scoresT));
  g.matmul(pT, dO, dV);

  // dS = (dO V^T - sum) ∘ P · scale
  const dP = g.matmul(dO, vT, g.virtual("dP", "float", l.scores));
  const dPSub = g.pointwise("sub", dP, g.virtual("dP-sum", "float", l.scores), { b: rowSum });
  const dSRaw = g.pointwise("mul", dPSub, g.virtual("(dP-sum)*P", "float", l.scores), { b: p });
  const dS = g.pointwise("mul", dSRaw, g.virtual("dS", "float", l.scores), { b: scale });

  // dK = dS^T Q
  const dST = g.reshape(dS, g.virtual("dS^T", s.dtype, l.scoresT));
  g.matmul(dST, q, dK);

  // dQ = dS K, accumulated in f32, then written in the input type
  const k = g.reshape(kT, g.virtual("K", s.dtype, l.qkv));
  g.matmul(dS, k, dQAccum);
  g.pointwise("identity", dQAccum, dQ);
  return { direction: "backward", tensors: g.tensors, ops: g.ops };
}

/** Bytes of the backward's own f32 intermediates (row sums, then dQ's accumulator), each at a
 *  multiple of 256 bytes, that the caller places in device memory. */
export function sdpaBackwardScratch(s: SdpaShape): { rowSumOffset: number; dQAccumOffset: number; bytes: number } {
  const align = (n: number) => Math.ceil(n / 256) * 256;
  const rowSumBytes = align(s.B * s.H * s.T * 4);
  const dQAccumBytes = align(s.B * s.H * s.T * s.D * 4);
  return { rowSumOffset: 0, dQAccumOffset: rowSumBytes, bytes: rowSumBytes + dQAccumBytes };
}

/** Device addresses of a forward's operands: qkv (B,T,3C) and out (B,T,C) of the 2-byte type,
 *  lse (B,H,T) f32. */
export interface SdpaForwardBuffers {
  readonly qkv: Ptr;
  readonly out: Ptr;
  readonly lse: Ptr;
}

/** A backward's: the forward's, dout (B,T,C), dqkv (B,T,3C) where dQ, dK and dV land, and
 *  scratch, sdpaBackwardScratch(s).bytes of device memory. */
export interface SdpaBackwardBuffers extends SdpaForwardBuffers {
  readonly dout: Ptr;
  readonly dqkv: Ptr;
  readonly scratch: Ptr;
}

/** The forward's variant pack: the address of each buffer by uid (the by-value scalars are the
 *  plan's, cudnn.ts binds them). */
export function sdpaForwardPack(s: SdpaShape, b: SdpaForwardBuffers): Map<number, Ptr> {
  return new Map([...qkvParts(s, b.qkv), [uids.o, b.out], [uids.stats, b.lse]]);
}

/** The backward's variant pack, as sdpaForwardPack's. */
export function sdpaBackwardPack(s: SdpaShape, b: SdpaBackwardBuffers): Map<number, Ptr> {
  const scratch = sdpaBackwardScratch(s);
  const [dQ, dK, dV] = qkvParts(s, b.dqkv).map(([, p]) => p);
  return new Map([
    ...qkvParts(s, b.qkv),
    [uids.o, b.out],
    [uids.dO, b.dout],
    [uids.stats, b.lse],
    [uids.dQ, dQ!],
    [uids.dK, dK!],
    [uids.dV, dV!],
    [uids.rowSum, b.scratch + scratch.rowSumOffset],
    [uids.dQAccum, b.scratch + scratch.dQAccumOffset],
  ]);
}

/** Q, K, V (or dQ, dK, dV) inside a (B,T,3C) buffer of 2-byte elements at base, by uid. */
function qkvParts(s: SdpaShape, base: Ptr): [number, Ptr][] {
  const rowBytes = 2 * s.H * s.D;
  return [
    [uids.q, base],
    [uids.k, base + rowBytes],
    [uids.v, base + 2 * rowBytes],
  ];
}
