// causalSelfAttention: multi-head causal attention over a fused qkv projection.
//
//   qkv (B,T,3C): channels [q | k | v], each C = H*D, head h at channels [h*D, (h+1)*D)
//   out (B,T,C)
//
//   q, k, v (B*H,T,D)   split out of qkv by strided copies (no separate permute pass)
//   preatt  (B*H,T,T) = q k^T                  batched GEMM
//   att     (B*H,T,T) = causal softmax(preatt / sqrt(D)), zero above the diagonal
//   y       (B*H,T,D) = att v                  batched GEMM
//   out     (B,T,C)   = y with heads merged back
//
// The batched GEMMs read what the context's precision says (engine/mixed.ts), as matmul's do:
// tf32 passes the f32 buffers, bf16/f16 make one 2-byte copy of each operand (q, k, v and att
// in the forward, dy and dpreatt in the backward) and accumulate in f32. Softmax stays f32.
import type { Dims4, GemmInput, Ptr } from "../../ffi/backend.ts";
import { ShapeError } from "../errors.ts";
import { autocastDType } from "../mixed.ts";
import { castCopy } from "./cast.ts";
import type { Context, Tensor } from "../tensor.ts";
import { checkDType, checkInputs } from "./check.ts";

/** What the batched GEMMs read under the context's current precision, and how an f32 operand
 *  becomes that (itself, or a 2-byte arena copy). */
function gemmOperands(ctx: Context): { input: GemmInput; operand: (t: Tensor) => Ptr } {
  const half = autocastDType(ctx.precision);
  if (half !== null) return { input: half, operand: (t) => castCopy(t, half).ptr };
  return { input: ctx.precision === "tf32" ? "tf32" : "f32", operand: (t) => t.ptr };
}

export function causalSelfAttention(qkv: Tensor, nHead: number): Tensor {
  const ctx = checkInputs("causalSelfAttention", [qkv]);
  checkDType("causalSelfAttention", qkv, "f32");
  if (qkv.shape.length !== 3 || qkv.shape[2]! % 3 !== 0 || (qkv.shape[2]! / 3) % nHead !== 0) {
    throw new ShapeError("causalSelfAttention", [qkv.shape], `qkv must be (B,T,3C) with C divisible by nHead=${nHead}`);
  }
  const [B, T, C3] = qkv.shape as [number, number, number];
  const C = C3 / 3;
  const H = nHead;
  const D = C / H;
  const BH = B * H;
  const scale = 1 / Math.sqrt(D);
  const be = ctx.backend;
  const f = 4; // bytes per f32

  const dims: Dims4 = [B, H, T, D];
  const headMajor: Dims4 = [H * T * D, T * D, D, 1]; // (B,H,T,D) contiguous
  const inQkv: Dims4 = [T * C3, D, C3, 1]; // (B,H,T,D) read out of (B,T,3C)
  const inOut: Dims4 = [T * C, D, C, 1]; // (B,H,T,D) read out of (B,T,C)

  const q = ctx.empty([BH, T, D]);
  const k = ctx.empty([BH, T, D]);
  const v = ctx.empty([BH, T, D]);
  be.stridedCopy(q.ptr, headMajor, qkv.ptr, inQkv, dims, false);
  be.stridedCopy(k.ptr, headMajor, qkv.ptr + C * f, inQkv, dims, false);
  be.stridedCopy(v.ptr, headMajor, qkv.ptr + 2 * C * f, inQkv, dims, false);
  const { input, operand } = gemmOperands(ctx);
  const [qg, kg, vg] = [operand(q), operand(k), operand(v)];
  const preatt = ctx.empty([BH, T, T]);
  be.gemmEx(input, false, true, T, T, D, 1, qg, D, T * D, kg, D, T * D, 0, preatt.ptr, T, T * T, BH);
  const att = ctx.empty([BH, T, T]);
  be.causalSoftmaxForward(att.ptr, preatt.ptr, BH, T, scale);
  const attg = operand(att);
  const y = ctx.empty([BH, T, D]);
  be.gemmEx(input, false, false, T, D, T, 1, attg, T, T * T, vg, D, T * D, 0, y.ptr, D, T * D, BH);
  const out = ctx.empty([B, T, C]);
  be.stridedCopy(out.ptr, inOut, y.ptr, headMajor, dims, false);

  ctx.record("causalSelfAttention", [qkv], out, () => {
    const dy = ctx.empty([BH, T, D]);
    be.stridedCopy(dy.ptr, headMajor, out.grad!.ptr, inOut, dims, false);
    const dyg = operand(dy);
    // forward was: y = att v  =>  datt = dy v^T, dv = att^T dy
    const datt = ctx.empty([BH, T, T]);
    be.gemmEx(input, false, true, T, T, D, 1, dyg, D, T * D, vg, D, T * D, 0, datt.ptr, T, T * T, BH);
    const dv = ctx.empty([BH, T, D]);
    be.gemmEx(input, true, false, T, D, T, 1, attg, T, T * T, dyg, D, T * D, 0, dv.ptr, D, T * D, BH);
    // forward was: att = causal softmax(scale preatt)
    const dpreatt = ctx.zeros([BH, T, T]);
    be.causalSoftmaxBackward(dpreatt.ptr, att.ptr, datt.ptr, BH, T, scale);
    const dpreattg = operand(dpreatt);
    // forward was: preatt = q k^T  =>  dq = dpreatt k, dk = dpreatt^T q
    const dq = ctx.empty([BH, T, D]);
    be.gemmEx(input, false, false, T, D, T, 1, dpreattg, T, T * T, kg, D, T * D, 0, dq.ptr, D, T * D, BH);
    const dk = ctx.empty([BH, T, D]);
    be.gemmEx(input, true, false, T, D, T, 1, dpreattg, T, T * T, qg, D, T * D, 0, dk.ptr, D, T * D, BH);
    const dqkv = qkv.ensureGrad().ptr;
    be.stridedCopy(dqkv, inQkv, dq.ptr, headMajor, dims, true);
    be.stridedCopy(dqkv + C * f, inQkv, dk.ptr, headMajor, dims, true);
    be.stridedCopy(dqkv + 2 * C * f, inQkv, dv.ptr, headMajor, dims, true);
  });
  return out;
}

// ---- float64 reference --------------------------------------------------------------------

/** Straight from the definition: per batch, head and query position. */
export function causalSelfAttentionReference(qkv: Float64Array, B: number, T: number, C: number, H: number) {
  const D = C / H;
  const scale = 1 / Math.sqrt(D);
  const out = new Float64Array(B * T * C);
  const att = new Float64Array(B * H * T * T);
  const at = (b: number, t: number, part: number, h: number, d: number) => qkv[(b * T + t) * 3 * C + part * C + h * D + d]!;
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

export function causalSelfAttentionBackwardReference(qkv: Float64Array, dout: Float64Array, B: number, T: number, C: number, H: number): Float64Array {
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
