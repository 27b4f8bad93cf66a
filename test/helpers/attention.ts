// One causal attention forward and backward on a CUDA backend, every activation in a 2-byte type
// (the op's contract in ffi/ops.ts: qkv, out, dout and dqkv of elem, lse f32), for the suites that
// compare an attention path (cuDNN's, the tensor-core kernels) with float64 and the reference.
import type { CudaBackend } from "../../ffi/cuda/backend.ts";
import { type HalfElem, widen16 } from "./numeric.ts";

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
