// One causal attention forward and backward on a CUDA backend, every activation in a 2-byte type
// (the op's contract in ffi/ops.ts: qkv, out, dout and dqkv of elem, lse f32), for the suites that
// compare an attention path (cuDNN's, the tensor-core kernels) with float64 and the reference;
// and the inputs of a shape with their float64 results (attentionCase), the same in every suite.
import type { CudaBackend } from "../../ffi/cuda/backend.ts";
import { causalSelfAttentionBackwardReference, causalSelfAttentionReference } from "../../engine/ops/attention.ts";
import { Rng } from "../../engine/rng.ts";
import { type HalfElem, roundTo16, widen16 } from "./numeric.ts";

export interface AttentionShape {
  B: number;
  T: number;
  H: number;
  D: number;
}

export interface AttentionResult {
  out: Float64Array;
  lse: Float32Array;
  dqkv: Float64Array;
}

/** Forward, then backward writing dqkv, or adding into dqkv0 with `accumulate`; results widened. */
export function attentionOn(
  be: CudaBackend,
  x: { qkv: Uint16Array; dout: Uint16Array; dqkv0: Uint16Array },
  s: AttentionShape,
  elem: HalfElem,
  accumulate: boolean,
): AttentionResult {
  const { B, T, H, D } = s;
  const C = H * D;
  const scale = 1 / Math.sqrt(D);
  const sizes = [x.qkv.byteLength, B * T * C * 2, B * H * T * 4, B * H * T * 4, x.dout.byteLength, x.dqkv0.byteLength];
  const [qkv, out, lse, delta, dout, dqkv] = sizes.map((n) => be.alloc(n));
  be.upload(qkv!.ptr, x.qkv);
  be.upload(dout!.ptr, x.dout);
  be.upload(dqkv!.ptr, x.dqkv0);
  be.attentionForward(out!.ptr, lse!.ptr, qkv!.ptr, B, T, C, H, scale, elem);
  be.attentionBackward(
    dqkv!.ptr,
    delta!.ptr,
    dout!.ptr,
    out!.ptr,
    lse!.ptr,
    qkv!.ptr,
    B,
    T,
    C,
    H,
    scale,
    elem,
    accumulate,
  );
  const r = {
    out: new Uint16Array(B * T * C),
    lse: new Float32Array(B * H * T),
    dqkv: new Uint16Array(x.dqkv0.length),
  };
  be.download(out!.ptr, r.out);
  be.download(lse!.ptr, r.lse);
  be.download(dqkv!.ptr, r.dqkv);
  for (const a of [qkv, out, lse, delta, dout, dqkv]) be.free(a!);
  return { out: widen16(r.out, elem), lse: r.lse, dqkv: widen16(r.dqkv, elem) };
}

/** The relative error out and dqkv may have against float64 for inputs of elem: P (and backward's
 *  dS) are rounded to the 2-byte type before the products that read them, as on tensor cores. */
export const attentionTolerance = (elem: HalfElem) => (elem === "bf16" ? 2e-2 : 4e-3);

/** Inputs of one shape in elem and what float64 makes of them. */
export interface AttentionCase {
  /** as attentionOn takes them: qkv (B,T,3C) and dout (B,T,C) random (seeded by the shape and
   *  elem), dqkv0 (B,T,3C) sin(i), what dqkv holds before a backward that adds into it */
  readonly bits: { qkv: Uint16Array; dout: Uint16Array; dqkv0: Uint16Array };
  /** float64 of the rounded inputs: out (B,T,C), lse (B,H,T), dqkv (B,T,3C) */
  readonly want: { out: Float64Array; lse: Float64Array; dqkv: Float64Array };
  /** The gradient a backward gave: dqkv as it wrote it, or less dqkv0 where it added into it. */
  gradient(dqkv: Float64Array, accumulate: boolean): Float64Array;
}

export function attentionCase(s: AttentionShape, elem: HalfElem): AttentionCase {
  const { B, T, H, D } = s;
  const C = H * D;
  const rng = new Rng(B * 1000 + T * 10 + D + (elem === "bf16" ? 0 : 7));
  const normal = (n: number) => Array.from({ length: n }, () => rng.normal());
  const qkv = roundTo16(normal(B * T * 3 * C), elem);
  const dout = roundTo16(normal(B * T * C), elem);
  const dqkv0 = roundTo16(
    Array.from({ length: B * T * 3 * C }, (_, i) => Math.sin(i)),
    elem,
  );
  return {
    bits: { qkv: qkv.bits, dout: dout.bits, dqkv0: dqkv0.bits },
    want: {
      out: causalSelfAttentionReference(qkv.values, B, T, C, H).out,
      lse: lseReference(qkv.values, s),
      dqkv: causalSelfAttentionBackwardReference(qkv.values, dout.values, B, T, C, H),
    },
    gradient: (dqkv, accumulate) => (accumulate ? dqkv.map((v, i) => v - dqkv0.values[i]!) : dqkv),
  };
}

/** lse (B,H,T) in float64: log sum_j<=i exp(q_i . k_j * scale), scale 1/sqrt(D) */
function lseReference(qkv: Float64Array, { B, T, H, D }: AttentionShape): Float64Array {
  const C = H * D;
  const scale = 1 / Math.sqrt(D);
  const lse = new Float64Array(B * H * T);
  const at = (b: number, t: number, part: number, h: number, d: number) =>
    qkv[(b * T + t) * 3 * C + part * C + h * D + d]!;
  for (let b = 0; b < B; b++)
    for (let h = 0; h < H; h++)
      for (let i = 0; i < T; i++) {
        const s = Array.from({ length: i + 1 }, (_, j) => {
          let dot = 0;
          for (let d = 0; d < D; d++) dot += at(b, i, 0, h, d) * at(b, j, 1, h, d);
          return dot * scale;
        });
        const max = Math.max(...s);
        lse[(b * H + h) * T + i] = max + Math.log(s.reduce((z, v) => z + Math.exp(v - max), 0));
      }
  return lse;
}
