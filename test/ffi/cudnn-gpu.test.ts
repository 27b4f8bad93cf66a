// cuDNN's fused attention on a real GPU (ffi/cuda/attention-path.ts): the same calls on a backend
// that runs cuDNN and on one that runs the f32-FMA reference kernels, on the same 2-byte q, k, v
// and dout: out (2-byte) and lse against each other and against the float64 definition, and the
// gradient written into dqkv, then added into it once more. Shapes: head sizes 64 and 128, T not a
// multiple of any tile, T = 1. Prints the time of both paths at GPT-2 small's attention.
// Skips without a GPU or without cuDNN.
import { afterAll, describe, expect, test } from "bun:test";
import { CudaBackend, probeCuda } from "../../ffi/cuda/backend.ts";
import { findCudnn } from "../../ffi/cuda/cudnn.ts";
import { causalSelfAttentionBackwardReference, causalSelfAttentionReference } from "../../engine/ops/attention.ts";
import { Rng } from "../../engine/rng.ts";
import { relErr, roundTo16, widen16 } from "../helpers/numeric.ts";
import { skip } from "../helpers/skip.ts";

const probe = probeCuda();
let cudnnMissing: string | null = null;
try {
  if (findCudnn() === null) cudnnMissing = "no libcudnn.so.9 here (MESHTRAIN_CUDNN, the loader's folders, pip wheels)";
} catch (e) {
  cudnnMissing = (e as Error).message;
}

let fused: CudaBackend | undefined;
let reference: CudaBackend | undefined;
const fusedBackend = () => (fused ??= new CudaBackend({ attention: "cudnn" }));
const referenceBackend = () => (reference ??= new CudaBackend({ attention: "reference" }));
afterAll(() => {
  fused?.dispose();
  reference?.dispose();
});

interface Outputs {
  out: Float64Array;
  lse: Float32Array;
  /** the gradient written (accumulate false), and then added once more (accumulate true) */
  dqkv: Float64Array;
  dqkvTwice: Float64Array;
}

/** One forward and two backwards on `be`: out, dout and dqkv of elem, as the op contract says. */
function attention(
  be: CudaBackend,
  qkv16: Uint16Array,
  dout16: Uint16Array,
  s: { B: number; T: number; C: number; H: number },
  elem: "bf16" | "f16",
): Outputs {
  const { B, T, C, H } = s;
  const scale = 1 / Math.sqrt(C / H);
  const qkv = be.alloc(qkv16.byteLength);
  const out = be.alloc(B * T * C * 2);
  const lse = be.alloc(B * H * T * 4);
  const delta = be.alloc(B * H * T * 4);
  const dO = be.alloc(dout16.byteLength);
  const dqkv = be.alloc(qkv16.byteLength);
  be.upload(qkv.ptr, qkv16);
  be.upload(dO.ptr, dout16);
  be.upload(dqkv.ptr, new Uint16Array(qkv16.length).fill(0xffff)); // NaN: every element must be written
  be.attentionForward(out.ptr, lse.ptr, qkv.ptr, B, T, C, H, scale, elem);
  const backward = (accumulate: boolean) =>
    be.attentionBackward(dqkv.ptr, delta.ptr, dO.ptr, out.ptr, lse.ptr, qkv.ptr, B, T, C, H, scale, elem, accumulate);
  const read16 = (a: { ptr: number }, n: number) => {
    const bits = new Uint16Array(n);
    be.download(a.ptr, bits);
    return widen16(bits, elem);
  };
  backward(false);
  const once = read16(dqkv, qkv16.length);
  backward(true);
  const r = {
    out: read16(out, B * T * C),
    lse: new Float32Array(B * H * T),
    dqkv: once,
    dqkvTwice: read16(dqkv, qkv16.length),
  };
  be.download(lse.ptr, r.lse);
  for (const a of [qkv, out, lse, delta, dO, dqkv]) be.free(a);
  return r;
}

const shapes = [
  { B: 2, T: 64, H: 2, D: 64 },
  { B: 1, T: 100, H: 3, D: 64 },
  { B: 2, T: 1, H: 2, D: 64 },
  { B: 1, T: 77, H: 2, D: 128 },
];

describe.skipIf(skip("a GPU", probe.ok ? null : probe.reason) || skip("cuDNN 9", cudnnMissing))(
  "cuDNN's fused attention on the GPU",
  () => {
    describe.each(["bf16", "f16"] as const)("%s", (elem) => {
      test.each(shapes)("B=$B T=$T H=$H D=$D: out, lse and dqkv against the kernels and float64", (sh) => {
        const { B, T, H, D } = sh;
        const C = H * D;
        const s = { B, T, C, H };
        const rng = new Rng(B * 1000 + T * 10 + D);
        const qkv = roundTo16(
          Float32Array.from({ length: B * T * 3 * C }, () => rng.normal()),
          elem,
        );
        const dout = roundTo16(
          Float32Array.from({ length: B * T * C }, () => rng.normal()),
          elem,
        );
        const a = attention(fusedBackend(), qkv.bits, dout.bits, s, elem);
        const b = attention(referenceBackend(), qkv.bits, dout.bits, s, elem);
        const want = causalSelfAttentionReference(qkv.values, B, T, C, H).out;
        const dwant = causalSelfAttentionBackwardReference(qkv.values, dout.values, B, T, C, H);
        // both round P (and backward's dS) to the 2-byte type before a product, and store out and
        // dqkv in it: errors of that size
        const tol = elem === "bf16" ? 2e-2 : 4e-3;
        expect(relErr(a.out, want)).toBeLessThan(tol);
        expect(relErr(b.out, want)).toBeLessThan(tol);
        expect(relErr(a.lse, b.lse)).toBeLessThan(1e-4);
        expect(relErr(a.dqkv, dwant)).toBeLessThan(2 * tol);
        expect(relErr(b.dqkv, dwant)).toBeLessThan(2 * tol);
        expect(relErr(a.dqkv, b.dqkv)).toBeLessThan(2 * tol);
        // accumulate: the second backward adds the same gradient again
        expect(
          relErr(
            a.dqkvTwice,
            a.dqkv.map((v) => 2 * v),
          ),
        ).toBeLessThan(2 * tol);
        expect(
          relErr(
            b.dqkvTwice,
            b.dqkv.map((v) => 2 * v),
          ),
        ).toBeLessThan(2 * tol);
      });
    });

    test("GPT-2 small's attention (B=8 T=1024 H=12 D=64, bf16): both paths timed", () => {
      const [B, T, H, D] = [8, 1024, 12, 64];
      const C = H * D;
      const flopFwd = 2 * B * H * T * T * D; // two products over the causal half
      const report: string[] = [];
      for (const [name, be] of [
        ["cuDNN", fusedBackend()],
        ["reference kernels", referenceBackend()],
      ] as const) {
        const qkv = be.alloc(B * T * 3 * C * 2);
        const out = be.alloc(B * T * C * 4);
        const lse = be.alloc(B * H * T * 4);
        const delta = be.alloc(B * H * T * 4);
        const dO = be.alloc(B * T * C * 4);
        const dqkv = be.alloc(B * T * 3 * C * 4);
        const rng = new Rng(5);
        be.upload(
          qkv.ptr,
          roundTo16(
            Float32Array.from({ length: B * T * 3 * C }, () => rng.normal()),
            "bf16",
          ).bits,
        );
        be.upload(
          dO.ptr,
          Float32Array.from({ length: B * T * C }, () => rng.normal()),
        );
        const scale = 1 / Math.sqrt(D);
        const time = (fn: () => void) => {
          fn();
          be.synchronize();
          const t = performance.now();
          for (let i = 0; i < 5; i++) fn();
          be.synchronize();
          return (performance.now() - t) / 5;
        };
        const fwd = time(() => be.attentionForward(out.ptr, lse.ptr, qkv.ptr, B, T, C, H, scale, "bf16"));
        const bwd = time(() =>
          be.attentionBackward(
            dqkv.ptr,
            delta.ptr,
            dO.ptr,
            out.ptr,
            lse.ptr,
            qkv.ptr,
            B,
            T,
            C,
            H,
            scale,
            "bf16",
            false,
          ),
        );
        report.push(
          `${name}: forward ${fwd.toFixed(2)} ms (${((flopFwd / fwd) * 1e-9).toFixed(0)} TFLOP/s), ` +
            `backward ${bwd.toFixed(2)} ms (${(((2.5 * flopFwd) / bwd) * 1e-9).toFixed(0)} TFLOP/s)`,
        );
        for (const x of [qkv, out, lse, delta, dO, dqkv]) be.free(x);
      }
      console.log(`attention at GPT-2 small's shape, per layer: ${report.join("; ")}`);
      console.log(`fused path: ${fusedBackend().describeAttention("bf16")}`);
      expect(report.length).toBe(2);
    });
  },
);
