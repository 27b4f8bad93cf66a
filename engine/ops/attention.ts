// causalSelfAttention: multi-head causal attention over a fused qkv projection, flash-attention
// style (Backend.attentionForward / attentionBackward).
//
//   qkv (B,T,3C): channels [q | k | v], each C = H*D, head h at channels [h*D, (h+1)*D)
//   out (B,T,C) = for each head, softmax(q k^T / sqrt(D), causal) v, heads side by side
//   lse (B,H,T) each query row's log-sum-exp, saved for backward
//
// The kernels walk tiles of K and V with an online softmax and never form the (T,T) score
// matrix: forward keeps out and lse, backward recomputes the scores tile by tile. Memory per
// layer grows with T, not T^2. Under autocast (Context.precision bf16 or f16, engine/mixed.ts)
// the products read qkv in the 2-byte type (qkv itself when a linear layer wrote it so, else a
// copy), and the probabilities and gradients are rounded to it before each product, as tensor
// cores read them; the softmax and every sum stay f32. out, its gradient and qkv's gradient are
// of that type too (bf16 activations), lse f32. tf32 and f32 read qkv itself and write f32.
// On CUDA the backend runs cuDNN's fused attention or its own kernels (ffi/cuda/attention-path.ts).
//
// The written-out form (scores, causal softmax, probabilities times v) is the float64 reference
// below, which the parity tests compare against.
import { ShapeError } from "../errors.ts";
import { activationDType, autocastDType } from "../mixed.ts";
import { addInto } from "./cast.ts";
import type { Tensor } from "../tensor.ts";
import { checkActivationDType, checkInputs } from "./check.ts";
import { gemmOperand } from "./matmul.ts";

/** The context of an attention op's qkv (B,T,3C), checked with its head count. */
function checkQkv(op: string, qkv: Tensor, nHead: number) {
  const ctx = checkInputs(op, [qkv]);
  checkActivationDType(op, qkv);
  if (
    qkv.shape.length !== 3 ||
    qkv.shape[2]! % 3 !== 0 ||
    !Number.isInteger(nHead) ||
    nHead < 1 ||
    (qkv.shape[2]! / 3) % nHead !== 0
  ) {
    throw new ShapeError(op, [qkv.shape], `qkv must be (B,T,3C) with C divisible by nHead=${nHead}`);
  }
  return ctx;
}

export function causalSelfAttention(qkv: Tensor, nHead: number): Tensor {
  const ctx = checkQkv("causalSelfAttention", qkv, nHead);
  const [B, T, C3] = qkv.shape as [number, number, number];
  const C = C3 / 3;
  const H = nHead;
  const scale = 1 / Math.sqrt(C / H);
  const be = ctx.backend;
  const elem = activationDType(ctx.precision); // fixed for this op's backward too
  // what the products read: qkv, or its 2-byte autocast copy
  const input = gemmOperand(qkv, autocastDType(ctx.precision));
  const out = ctx.empty([B, T, C], elem);
  const lse = ctx.empty([B, H, T]);
  be.attentionForward(out.ptr, lse.ptr, input.ptr, B, T, C, H, scale, elem);
  ctx.record(
    "causalSelfAttention",
    [qkv],
    out,
    () => {
      const delta = ctx.empty([B, H, T]);
      // qkv of elem takes the gradient straight; an f32 qkv (autocast copied) through a buffer
      const direct = qkv.dtype === elem;
      const { grad, fresh } = direct ? qkv.gradForWrite() : { grad: ctx.empty(qkv.shape, elem), fresh: true };
      be.attentionBackward(
        grad.ptr,
        delta.ptr,
        out.grad!.ptr,
        out.ptr,
        lse.ptr,
        input.ptr,
        B,
        T,
        C,
        H,
        scale,
        elem,
        !fresh,
      );
      if (!direct) {
        addInto(qkv.ensureGrad(), grad);
        grad.drop();
      }
      delta.drop();
    },
    [input, out, lse],
  );
  lse.drop();
  if (input !== qkv) input.drop();
  return out;
}

/**
 * Generation's attention for its new token: qkv (B,T,3C) holds the cached rows of the earlier
 * tokens and the new token's as row T-1; out (B,1,C) is what causalSelfAttention gives for that
 * row (Backend.attentionDecode), at O(T) cost instead of every row's O(T²). Records nothing:
 * generation runs without gradients.
 */
export function attentionDecode(qkv: Tensor, nHead: number): Tensor {
  const ctx = checkQkv("attentionDecode", qkv, nHead);
  const [B, T, C3] = qkv.shape as [number, number, number];
  const C = C3 / 3;
  const elem = activationDType(ctx.precision);
  const input = gemmOperand(qkv, autocastDType(ctx.precision));
  const out = ctx.empty([B, 1, C], elem);
  ctx.backend.attentionDecode(out.ptr, input.ptr, B, T, C, nHead, 1 / Math.sqrt(C / nHead), elem);
  if (input !== qkv) input.drop();
  return out;
}

// ---- float64 reference --------------------------------------------------------------------

/** Straight from the definition: per batch, head and query position. */
export function causalSelfAttentionReference(qkv: Float64Array, B: number, T: number, C: number, H: number) {
  const D = C / H;
  const scale = 1 / Math.sqrt(D);
  const out = new Float64Array(B * T * C);
  const att = new Float64Array(B * H * T * T);
  const at = (b: number, t: number, part: number, h: number, d: number) =>
    qkv[(b * T + t) * 3 * C + part * C + h * D + d]!;
  for (let b = 0; b < B; b++) {
    for (let h = 0; h < H; h++) {
      for (let i = 0; i < T; i++) {
        const row = ((b * H + h) * T + i) * T;
        let max = -Infinity;
        for (let j = 0; j <= i; j++) {
          let dot = 0;
          for (let d = 0; d < D; d++) dot += at(b, i, 0, h, d) * at(b, j, 1, h, d);
          att[row + j] = dot * scale;
          max = Math.max(max, dot * scale);
        }
        let sum = 0;
        for (let j = 0; j <= i; j++) sum += Math.exp(att[row + j]! - max);
        for (let j = 0; j <= i; j++) att[row + j] = Math.exp(att[row + j]! - max) / sum;
        for (let d = 0; d < D; d++) {
          let acc = 0;
          for (let j = 0; j <= i; j++) acc += att[row + j]! * at(b, j, 2, h, d);
          out[(b * T + i) * C + h * D + d] = acc;
        }
      }
    }
  }
  return { out, att };
}

export function causalSelfAttentionBackwardReference(
  qkv: Float64Array,
  dout: Float64Array,
  B: number,
  T: number,
  C: number,
  H: number,
): Float64Array {
  const D = C / H;
  const scale = 1 / Math.sqrt(D);
  const { att } = causalSelfAttentionReference(qkv, B, T, C, H);
  const dqkv = new Float64Array(qkv.length);
  const idx = (b: number, t: number, part: number, h: number, d: number) => (b * T + t) * 3 * C + part * C + h * D + d;
  for (let b = 0; b < B; b++) {
    for (let h = 0; h < H; h++) {
      for (let i = 0; i < T; i++) {
        const row = ((b * H + h) * T + i) * T;
        // out[i,d] = sum_j att[i,j] v[j,d]
        const datt = new Float64Array(T);
        for (let j = 0; j <= i; j++) {
          for (let d = 0; d < D; d++) {
            const g = dout[(b * T + i) * C + h * D + d]!;
            datt[j] = datt[j]! + g * qkv[idx(b, j, 2, h, d)]!;
            dqkv[idx(b, j, 2, h, d)] = dqkv[idx(b, j, 2, h, d)]! + att[row + j]! * g;
          }
        }
        // att[i,:] = softmax(scale q_i . k_j): dpre[j] = att[j] (datt[j] - sum_k att[k] datt[k])
        let dot = 0;
        for (let j = 0; j <= i; j++) dot += att[row + j]! * datt[j]!;
        for (let j = 0; j <= i; j++) {
          const dpre = att[row + j]! * (datt[j]! - dot) * scale;
          for (let d = 0; d < D; d++) {
            dqkv[idx(b, i, 0, h, d)] = dqkv[idx(b, i, 0, h, d)]! + dpre * qkv[idx(b, j, 1, h, d)]!;
            dqkv[idx(b, j, 1, h, d)] = dqkv[idx(b, j, 1, h, d)]! + dpre * qkv[idx(b, i, 0, h, d)]!;
          }
        }
      }
    }
  }
  return dqkv;
}
