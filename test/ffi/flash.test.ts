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
import { type AttentionShape, attentionCase, attentionOn, attentionTolerance } from "../helpers/attention.ts";
import { emulatedCuda } from "../helpers/emulated-cuda.ts";
import { cudaSkipReason, type HalfElem, relErr } from "../helpers/numeric.ts";
import { skip } from "../helpers/skip.ts";

const emulated = await emulatedCuda();
const owned: CudaBackend[] = [];
afterAll(() => {
  for (const be of owned) be.dispose();
});

/** Forward and backward (writing dqkv, then adding into it) on `be` against float64. */
function checkAgainstFloat64(be: CudaBackend, s: AttentionShape, elem: HalfElem): void {
  const c = attentionCase(s, elem);
  const tol = attentionTolerance(elem);
  for (const accumulate of [false, true]) {
    const a = attentionOn(be, c.bits, s, elem, accumulate);
    expect(relErr(a.out, c.want.out)).toBeLessThan(tol);
    expect(relErr(a.lse, c.want.lse)).toBeLessThan(1e-3);
    expect(relErr(c.gradient(a.dqkv, accumulate), c.want.dqkv)).toBeLessThan(2 * tol);
  }
}

describe.skipIf(skip("the emulated CUDA backend", emulated.ok ? null : emulated.reason))(
  'the CUDA backend (emulated on the host) with attention "kernel"',
  () => {
    const shapes: AttentionShape[] = [
      { B: 1, T: 1, H: 2, D: 64 },
      { B: 2, T: 70, H: 1, D: 64 },
      { B: 1, T: 65, H: 1, D: 128 },
    ];
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
  const gpuShapes: AttentionShape[] = [
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
