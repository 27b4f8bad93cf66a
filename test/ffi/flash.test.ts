// The tensor-core attention kernels (ffi/cuda/kernels/flash.cu, `--attention kernel`) on the CUDA
// backend emulated on the host, in every CI: the host emulator computes mma.sync m16n8k16 from
// the warp's fragments as the PTX ISA lays them out (test/ffi/fixtures/cuda-emu), so the kernels'
// tiling, fragment indexing, causal masking, online softmax and their backward run here against
// the float64 definition (engine/ops/attention.ts). Head sizes
// 64 and 128; T = 1, T not a multiple of the 64-row tile, more than one tile; bf16 and f16;
// backward writing dqkv and adding into it. Also the router's and the CLI's refusals. On a
// machine with a GPU the same checks run on it, at GPT-2's head size and longer sequences.
import { afterAll, describe, expect, test } from "bun:test";
import type { ElemType } from "../../ffi/backend.ts";
import { AttentionRouter, KernelUnsupportedError } from "../../ffi/cuda/attention-path.ts";
import { CudaBackend } from "../../ffi/cuda/backend.ts";
import { flashBackward, flashForward, flashUnsupported } from "../../ffi/cuda/kernels.ts";
import { causalSelfAttentionBackwardReference, causalSelfAttentionReference } from "../../engine/ops/attention.ts";
import { Rng } from "../../engine/rng.ts";
import { attentionOn } from "../helpers/attention.ts";
import { emulatedCuda } from "../helpers/emulated-cuda.ts";
import { cudaSkipReason, type HalfElem, relErr, roundTo16, widen16 } from "../helpers/numeric.ts";
import { skip } from "../helpers/skip.ts";

const emulated = await emulatedCuda();
const owned: CudaBackend[] = [];
afterAll(() => {
  for (const be of owned) be.dispose();
});

interface Shape {
  B: number;
  T: number;
  H: number;
  D: number;
}

/** lse (B,H,T) in float64 */
function lseReference(qkv: Float64Array, { B, T, H, D }: Shape): Float64Array {
  const C = H * D;
  const out = new Float64Array(B * H * T);
  for (let b = 0; b < B; b++)
    for (let h = 0; h < H; h++)
      for (let i = 0; i < T; i++) {
        const s: number[] = [];
        for (let j = 0; j <= i; j++) {
          let dot = 0;
          for (let d = 0; d < D; d++)
            dot += qkv[(b * T + i) * 3 * C + h * D + d]! * qkv[(b * T + j) * 3 * C + C + h * D + d]!;
          s.push(dot / Math.sqrt(D));
        }
        const m = Math.max(...s);
        out[(b * H + h) * T + i] = m + Math.log(s.reduce((a, x) => a + Math.exp(x - m), 0));
      }
  return out;
}

// P and dS are rounded to the 2-byte type before their products, as on tensor cores
const tolerance = (elem: HalfElem) => (elem === "bf16" ? 2e-2 : 4e-3);

/** Forward and backward (writing dqkv, then adding into it) on `be` against float64. */
function checkAgainstFloat64(be: CudaBackend, s: Shape, elem: HalfElem): void {
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
  const want = causalSelfAttentionReference(qkv.values, B, T, C, H).out;
  const dwant = causalSelfAttentionBackwardReference(qkv.values, dout.values, B, T, C, H);
  const lseWant = lseReference(qkv.values, s);
  const tol = tolerance(elem);
  for (const accumulate of [false, true]) {
    const a = attentionOn(be, { qkv: qkv.bits, dout: dout.bits, dqkv0: dqkv0.bits }, s, elem, accumulate);
    const added = (d: Float64Array) => (accumulate ? d.map((v, i) => v - dqkv0.values[i]!) : d);
    expect(relErr(a.out, want)).toBeLessThan(tol);
    expect(relErr(a.lse, lseWant)).toBeLessThan(1e-3);
    expect(relErr(added(a.dqkv), dwant)).toBeLessThan(2 * tol);
  }
}

const shapes: Shape[] = [
  { B: 1, T: 1, H: 2, D: 64 },
  { B: 2, T: 70, H: 1, D: 64 },
  { B: 1, T: 65, H: 1, D: 128 },
];

describe.skipIf(skip("the emulated CUDA backend", emulated.ok ? null : emulated.reason))(
  'the CUDA backend (emulated on the host) with attention "kernel"',
  () => {
    const backend = (attention: "kernel") => {
      if (!emulated.ok) throw new Error("unreachable");
      const be = emulated.backendWith({ attention });
      owned.push(be);
      return be;
    };
    const kernel = emulated.ok ? backend("kernel") : null;

    describe.each(["bf16", "f16"] as const)("%s", (elem) => {
      test.each(shapes)("B=$B T=$T H=$H D=$D: out, lse and dqkv against float64", (s) => {
        const launches = kernel!.launchCounts.kernels;
        checkAgainstFloat64(kernel!, s, elem);
        // a forward and the backward's delta, kv and q kernels, twice
        expect(kernel!.launchCounts.kernels - launches).toBe(8);
      });
    });

    test("the kernels run where the tensor cores take the inputs, and are refused elsewhere with the reason", () => {
      expect(flashUnsupported(128, 2, "bf16")).toBeNull();
      expect(flashUnsupported(256, 2, "f16")).toBeNull();
      expect(flashUnsupported(128, 2, "f32")).toMatch(/2-byte inputs/);
      expect(flashUnsupported(96, 1, "bf16")).toMatch(/built for head sizes 64 and 128, not 96/);
      expect(() => flashForward(0, 0, 0, 1, 8, 96, 1, 1, "bf16")).toThrow(RangeError);
      expect(() => flashBackward(0, 0, 0, 0, 0, 0, 1, 8, 64, 1, 1, "f32", false)).toThrow(/2-byte inputs/);
      // tiles are staged with 16-byte copies
      expect(() => flashForward(0, 0, 8, 1, 8, 64, 1, 1, "bf16")).toThrow(/qkv at 8 is not 16-byte aligned/);
      expect(() => flashBackward(0, 0, 4, 0, 0, 0, 1, 8, 64, 1, 1, "bf16", false)).toThrow(/dout at 4 is not/);
      const noDevice = { alloc: () => 0, free: () => {}, run: () => {}, stream: 0n };
      const router = new AttentionRouter("kernel", noDevice);
      const call = (C: number, elem: ElemType) => ({ B: 1, T: 8, C, H: 1, scale: 1, elem });
      expect(router.usesKernel(call(64, "bf16"))).toBe(true);
      expect(router.usesCudnn(call(64, "bf16"))).toBe(false);
      expect(() => router.usesKernel(call(96, "bf16"))).toThrow(KernelUnsupportedError);
      expect(() => router.usesKernel(call(64, "f32"))).toThrow(/--attention kernel: it runs on 2-byte inputs/);
      expect(router.describe("bf16")).toBe(
        "tensor-core kernels (FlashAttention-2 tiling on mma.sync, bf16), as asked (--attention kernel)",
      );
      expect(router.describe("f32")).toMatch(/^f32-FMA kernels \(reference\): --attention kernel cannot run/);
      // auto never picks them (not yet run on a GPU)
      expect(new AttentionRouter("auto", noDevice, "/nonexistent/libcudnn.so").usesKernel(call(64, "bf16"))).toBe(
        false,
      );
    });
  },
);

describe.skipIf(skip("CUDA", cudaSkipReason))('a GPU with attention "kernel"', () => {
  const gpuShapes: Shape[] = [
    { B: 2, T: 256, H: 2, D: 64 },
    { B: 1, T: 300, H: 2, D: 128 },
    { B: 1, T: 1, H: 12, D: 64 },
  ];
  describe.each(["bf16", "f16"] as const)("%s", (elem) => {
    test.each(gpuShapes)("B=$B T=$T H=$H D=$D: out, lse and dqkv against float64", (s) => {
      const be = new CudaBackend({ attention: "kernel" });
      owned.push(be);
      checkAgainstFloat64(be, s, elem);
    });
  });
});
