// The driver binding and the CUDA backend against a fake libcuda (fixtures/fake-cuda.c) on a
// machine without a GPU: device memory is host memory there and kernels are recorded, not run.
// This checks what the binding itself does: CUDA's error names in typed errors, the probe's
// answers, zeroed allocations, pinned-staging uploads and downloads, fills, caching, out of
// memory, and, for every kernel plan, that the 8-byte argument slots cuLaunchKernel receives
// hold exactly the plan's arguments in the spec's types. The kernels' numerics are checked on a
// real GPU by the op parity suite (test/engine/ops.test.ts).
import { afterAll, beforeEach, describe, expect, test } from "bun:test";
import { dlopen, ptr as addressOf, type Pointer, toArrayBuffer } from "bun:ffi";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { Dims4, Ptr } from "../../ffi/backend.ts";
import { CudaBackend } from "../../ffi/cuda/backend.ts";
import { findNvcc } from "../../ffi/cuda/build.ts";
import { CudaError, Driver, probeCuda, ptxRejectedHint } from "../../ffi/cuda/driver.ts";
import { kernelSpecs, type Launch, planTakesScratch, plans } from "../../ffi/cuda/kernels.ts";
import { ops } from "../../ffi/ops.ts";
import { OutOfMemoryError } from "../../ffi/errors.ts";
import { skip } from "../helpers/skip.ts";

const dir = mkdtempSync(join(tmpdir(), "mt-fake-cuda-"));
const libPath = join(dir, "libfakecuda.so");
const cc = Bun.spawnSync(
  ["cc", "-shared", "-fPIC", "-O1", "-Wall", "-o", libPath, join(import.meta.dir, "fixtures", "fake-cuda.c")],
  { stderr: "pipe" },
);
if (cc.exitCode !== 0) throw new Error(`compiling the fake libcuda failed:\n${cc.stderr.toString()}`);
afterAll(() => rmSync(dir, { recursive: true, force: true }));

// the same library as the Driver loads, so the controls see its state
const fake = dlopen(libPath, {
  fake_reset: { args: [], returns: "void" },
  fake_set_capacity: { args: ["u64"], returns: "void" },
  fake_set_device_count: { args: ["i32"], returns: "void" },
  fake_fail: { args: ["ptr", "i32"], returns: "void" },
  fake_launch_count: { args: [], returns: "i32" },
  fake_launch_at: { args: ["i32", "ptr"], returns: "void" },
  fake_alloc_count: { args: [], returns: "i64" },
  fake_used_bytes: { args: [], returns: "u64" },
  fake_stream_sync_count: { args: [], returns: "i32" },
}).symbols;
const failNext = (call: string, code: number) => fake.fake_fail(addressOf(Buffer.from(`${call}\0`)), code);

interface Recorded {
  name: string;
  grid: number[];
  block: number[];
  shared: number;
  params: DataView;
}
/** FakeLaunch: name[64], grid[3], block[3], shared (u32), stream (u64 at 96), params[32] (u64 at 104) */
function recorded(i: number): Recorded {
  const buf = new Uint8Array(104 + 32 * 8);
  fake.fake_launch_at(i, addressOf(buf));
  const v = new DataView(buf.buffer);
  const end = buf.indexOf(0);
  return {
    name: new TextDecoder().decode(buf.subarray(0, end)),
    grid: [0, 1, 2].map((k) => v.getUint32(64 + 4 * k, true)),
    block: [0, 1, 2].map((k) => v.getUint32(76 + 4 * k, true)),
    shared: v.getUint32(88, true),
    params: new DataView(buf.buffer, 104),
  };
}

const driver = new Driver(libPath);
beforeEach(() => fake.fake_reset());

describe("driver binding", () => {
  test("probe names the device, its compute capability, the driver version and the device's memory", () => {
    expect(probeCuda(() => driver)).toEqual({
      ok: true,
      deviceCount: 1,
      reason: "Fake GPU, compute 9.0, driver 13.0",
      totalBytes: 1 << 30,
    });
    fake.fake_set_device_count(4);
    expect(probeCuda(() => driver)).toEqual({
      ok: true,
      deviceCount: 4,
      reason: "Fake GPU (device 0 of 4), compute 9.0, driver 13.0",
      totalBytes: 1 << 30,
    });
  });

  test("no device: the probe says so instead of throwing", () => {
    fake.fake_set_device_count(0);
    expect(probeCuda(() => driver)).toEqual({ ok: false, deviceCount: 0, reason: "the CUDA driver reports no device" });
    fake.fake_reset();
    failNext("cuInit", 100);
    expect(
      probeCuda(() => {
        driver.init();
        return driver;
      }),
    ).toEqual({ ok: false, deviceCount: 0, reason: "the CUDA driver finds no device (CUDA_ERROR_NO_DEVICE)" });
  });

  test("no driver library: the probe names what is missing", () => {
    const probe = probeCuda(() => new Driver(join(dir, "no-such-libcuda.so.1")));
    expect(probe.ok).toBe(false);
    expect(probe.reason).toContain("no CUDA driver (libcuda.so.1 not loadable");
  });

  test("a failing call is a CudaError carrying CUDA's name for the code and the call", () => {
    failNext("cuMemAlloc_v2", 1);
    let error: unknown;
    try {
      driver.memAlloc(1024);
    } catch (e) {
      error = e;
    }
    expect(error).toBeInstanceOf(CudaError);
    const e = error as CudaError;
    expect([e.call, e.code, e.codeName, e.message]).toEqual([
      "cuMemAlloc_v2",
      1,
      "CUDA_ERROR_INVALID_VALUE",
      "cuMemAlloc_v2 failed: CUDA_ERROR_INVALID_VALUE (1): CUDA_ERROR_INVALID_VALUE",
    ]);
  });

  test("PTX the driver cannot JIT names its ISA version, the driver's CUDA version and the fix", () => {
    const ptx = "//\n// Generated by NVIDIA NVVM Compiler\n.version 9.0\n.target sm_80\n.address_size 64\n";
    failNext("cuModuleLoadData", 222);
    expect(() => driver.moduleLoadPtx(ptx, "elementwise")).toThrow(
      "cuModuleLoadData(elementwise.ptx) failed: CUDA_ERROR_UNSUPPORTED_PTX_VERSION (222): the provided PTX was compiled with an " +
        "unsupported toolchain. (fake); the PTX is ISA 9.0 for sm_80 and this driver supports CUDA 13.0; update the NVIDIA driver, " +
        "or rebuild the kernels with an nvcc no newer than the driver (MESHTRAIN_NVCC=/path/to/nvcc bun ffi/cuda/build.ts)",
    );
    // other load errors carry no such hint
    failNext("cuModuleLoadData", 200);
    expect(() => driver.moduleLoadPtx(ptx, "elementwise")).toThrow(/CUDA_ERROR_INVALID_IMAGE \(200\)[^;]*$/);
    expect(
      ptxRejectedHint(218, "garbage", () => {
        throw new Error("no driver");
      }),
    ).toBe(
      "the PTX is ISA unknown for unknown and " +
        "this driver supports an unknown CUDA version; if the nvcc that wrote it is newer than the driver, update the NVIDIA driver, " +
        "or rebuild the kernels with an nvcc no newer than the driver (MESHTRAIN_NVCC=/path/to/nvcc bun ffi/cuda/build.ts)",
    );
  });

  test("out of device memory is null from memAlloc (so the allocator can free cache and retry)", () => {
    fake.fake_set_capacity(1000);
    expect(driver.memAlloc(4096)).toBeNull();
  });
});

const nvcc = findNvcc();

describe.skipIf(skip("nvcc", nvcc === null ? "no nvcc to build the PTX kernels (set MESHTRAIN_NVCC)" : null))(
  "CUDA backend over the fake driver",
  () => {
    const backend = () => new CudaBackend({ driver });

    test("alloc is zeroed; upload, download, copy, zero and fill move exactly the bytes asked", () => {
      const be = backend();
      const a = be.alloc(64);
      const b = be.alloc(64);
      const got = new Uint8Array(64);
      be.download(a.ptr, got);
      expect(got.every((x) => x === 0)).toBe(true);
      const src = Float32Array.from({ length: 20 }, (_, i) => i * 1.5 - 3);
      be.upload(a.ptr, src.subarray(3, 13)); // a view with an offset
      be.copy(b.ptr, a.ptr, 40);
      be.fill(b.ptr + 40, 4, NaN);
      be.zero(b.ptr + 8, 4);
      const out = new Float32Array(16);
      be.download(b.ptr, out);
      const want = [...src.subarray(3, 13)];
      want[2] = 0;
      expect([...out.subarray(0, 10)]).toEqual(want);
      expect([...new Uint32Array(out.buffer, 40, 4)]).toEqual([0x7fc00000, 0x7fc00000, 0x7fc00000, 0x7fc00000]);
      be.dispose();
    });

    test("a large upload grows the pinned staging buffer and arrives intact", () => {
      const be = backend();
      const n = 3 << 20; // 12 MB, more than the first staging buffer
      const a = be.alloc(n * 4);
      const src = Float32Array.from({ length: n }, (_, i) => (i % 1000) - 500);
      be.upload(a.ptr, src);
      const out = new Float32Array(n);
      be.download(a.ptr, out);
      expect(out).toEqual(src);
      be.dispose();
    });

    test("freed blocks are reused without new device allocations; dispose gives everything back", () => {
      const be = backend();
      const before = Number(fake.fake_alloc_count());
      for (let i = 0; i < 10; i++) be.free(be.alloc(12345));
      expect(Number(fake.fake_alloc_count()) - before).toBe(1);
      expect(be.allocatorStats.cacheHits).toBe(9);
      be.dispose();
      expect(fake.fake_used_bytes()).toBe(0n);
    });

    test("device out of memory is OutOfMemoryError, and the backend keeps working", () => {
      const be = backend();
      fake.fake_set_capacity(8 << 20);
      expect(() => be.alloc(64 << 20)).toThrow(OutOfMemoryError);
      const ok = be.alloc(1024);
      be.free(ok);
      be.dispose();
    });

    test("a failed launch is a CudaError naming the kernel", () => {
      const be = backend();
      failNext("cuLaunchKernel", 719);
      expect(() => be.add(0x1000, 0x2000, 0x3000, 10)).toThrow(
        "cuLaunchKernel(mt_add_f32) failed: CUDA_ERROR_LAUNCH_FAILED (719): unspecified launch failure (fake)",
      );
      be.dispose();
    });

    // Fake addresses are fine: the fake records launches and never runs them.
    const [P, Q, R, S, T, U, V, W] = [0x10000, 0x20040, 0x30080, 0x400c0, 0x50100, 0x60140, 0x70180, 0x801c0];
    const d4 = (a: number, b: number, c: number, d: number): Dims4 => [a, b, c, d];
    type Case = [keyof typeof plans, unknown[]];
    const cases: Case[] = [
      ["add", [P, Q, R, 1001]],
      ["mul", [P, Q, R, 70000]],
      ["axpy", [P, Q, 555, -0.25]],
      ["scale", [P, 3, 1.75]],
      ["addScalarFrom", [P, Q, 0.125, 99]],
      ["binaryBroadcast", ["mul", P, Q, R, d4(2, 3, 4, 5), d4(60, 20, 5, 1), d4(0, 5, 0, 1)]],
      ["reduceBroadcast", [P, Q, d4(2, 3, 4, 5), d4(0, 5, 0, 1)]],
      ["biasAdd", [P, Q, R, 300, 129, "bf16"]],
      ["biasBackward", [P, Q, 300, 129, "f32"]],
      ["reluForward", [P, Q, 12345, "f32"]],
      ["reluBackward", [P, Q, R, 12345, "f16"]],
      ["geluForward", [P, Q, 777, "bf16"]],
      ["geluBackward", [P, Q, R, 777, "f32"]],
      ["dropoutForward", [P, Q, 5000, 0.3, 0xfedcba9876543210n]],
      ["dropoutBackward", [P, Q, 5000, 0.3, 0x0123456789abcdefn]],
      ["biasGeluForward", [P, Q, R, 300, 129, "bf16"]],
      ["crossEntropyBackward", [P, Q, R, S, T, 37, 83, true, "bf16"]],
      ["residualLayerNormForward", [P, Q, R, S, T, U, V, W, 2048, 128, 1e-5, "bf16"]],
      ["layerNormForward", [P, Q, R, S, T, U, 2048, 128, 1e-5, "f32"]],
      ["layerNormBackward", [P, Q, R, S, T, U, V, W, 2048, 128, "bf16"]],
      ["embeddingBackward", [P, Q, R, 2048, 128]],
      ["attentionForward", [P, Q, R, 4, 100, 128, 2, 0.125, "bf16"]],
      ["attentionBackward", [P, Q, R, S, T, U, 4, 100, 128, 2, 0.125, "f32", true]],
      ["stridedCopy", [P, d4(24, 12, 4, 1), Q, d4(1, 2, 6, 24), d4(2, 3, 4, 5), true]],
      ["sum", [P, Q, 100000]],
      ["sgdStep", [P, Q, R, 4096, 0.05, 0.9, 0, 5e-4, true, false]],
      ["adamwStep", [P, Q, R, S, 0, 4096, 2048, 1e-3, 0.9, 0.999, 1e-8, 0.01, 0.1, 0.001, 0.5]],
      ["castF32ToBF16", [P, Q, 4097]],
      ["castBF16ToF32", [P, Q, 4097]],
      ["castF32ToF16", [P, Q, 4097]],
      ["castF16ToF32", [P, Q, 4097]],
    ];

    /** The plan's launches for these arguments; a plan that takes scratch gets the backend's, found
     *  from the recorded launches (an argument that moves with scratch is scratch + its value at 0). */
    function plannedAsRun(method: keyof typeof plans, args: unknown[]): readonly Launch[] {
      const plan = plans[method] as (...a: unknown[]) => readonly Launch[];
      if (!planTakesScratch(ops[method])) return plan(...args);
      const [at0, at1] = [plan(0, ...args), plan(1, ...args)];
      for (let i = 0; i < at0.length; i++) {
        const j = at0[i]!.args.findIndex((a, k) => a !== at1[i]!.args[k]);
        if (j < 0) continue;
        const got = decodeArgs(recorded(i).params, at0[i]!)[j] as number;
        return plan(got - (at0[i]!.args[j] as number), ...args);
      }
      return at0;
    }

    test.each(cases)("%s: cuLaunchKernel gets the plan's kernels, geometry and arguments", (method, args) => {
      const be = backend();
      fake.fake_reset();
      (be[method as keyof CudaBackend] as (...a: unknown[]) => unknown)(...args);
      const want = plannedAsRun(method, args);
      expect(want.length).toBeGreaterThan(0);
      expect(fake.fake_launch_count()).toBe(want.length);
      want.forEach((l, i) => {
        const got = recorded(i);
        expect({ name: got.name, grid: got.grid, block: got.block, shared: got.shared }).toEqual({
          name: l.kernel,
          grid: [...l.grid],
          block: [...l.block],
          shared: l.sharedBytes,
        });
        expect(decodeArgs(got.params, l)).toEqual(
          l.args.map((a, j) => expectedValue(kernelSpecs[l.kernel].params[j]!, a)),
        );
      });
      be.dispose();
    });

    test.each([
      ["sumSquares", "f64"],
      ["countNonFinite", "i64"],
      ["crossEntropyForward", "i64"],
      ["embeddingForward", "i64"],
      ["countCorrect", "i64"],
    ] as const)("%s passes the backend's scratch buffer first and returns the %s left at its start", (method, kind) => {
      const be = backend();
      const args: Record<typeof method, (number | string)[]> = {
        sumSquares: [P, 1000],
        countNonFinite: [P, 1000],
        crossEntropyForward: [P, Q, R, S, T, 37, 83, "bf16"],
        embeddingForward: [P, Q, R, 50, 16, 83],
        countCorrect: [P, Q, 37, 83, "bf16"],
      };
      const call = () => (be[method] as (...a: (number | string)[]) => number)(...args[method]);
      fake.fake_reset();
      call();
      // the fake runs no kernel: write the result where the kernels would, then ask again.
      // Where the plan puts scratch: plan with a marker address and find it.
      const marker = 0x7eadbeef00;
      const planned = (plans[method] as (...a: unknown[]) => readonly Launch[])(marker, ...args[method]);
      const at = planned.findIndex((l) => l.args.includes(marker));
      const slotIndex = planned[at]!.args.indexOf(marker);
      const scratch = Number(recorded(at).params.getBigUint64(8 * slotIndex, true));
      expect(scratch).not.toBe(marker);
      const slot = new DataView(toArrayBuffer(scratch as Pointer, 0, 8));
      if (kind === "f64") slot.setFloat64(0, 42.5, true);
      else slot.setBigInt64(0, 7n, true);
      expect(call()).toBe(kind === "f64" ? 42.5 : 7);
      be.dispose();
    });

    test.each(["crossEntropyForward", "embeddingForward"] as const)(
      "%s with inRange (ids checked on the host) returns 0 without waiting on the GPU, and counts nothing",
      (method) => {
        const be = backend();
        const args = method === "crossEntropyForward" ? [P, Q, R, S, T, 37, 83, "f32"] : [P, Q, R, 50, 16, 83];
        fake.fake_reset();
        expect((be[method] as (...a: unknown[]) => number)(...args, true)).toBe(0);
        expect(fake.fake_stream_sync_count()).toBe(0);
        const names = Array.from({ length: fake.fake_launch_count() }, (_, i) => recorded(i).name);
        expect(names).toEqual(
          method === "crossEntropyForward"
            ? ["mt_crossentropy_forward_f32", "mt_crossentropy_loss_f32"]
            : ["mt_embedding_forward_f32"],
        );
        // without it: the count, and one wait to read it
        fake.fake_reset();
        (be[method] as (...a: unknown[]) => number)(...args);
        expect(fake.fake_stream_sync_count()).toBe(1);
        be.dispose();
      },
    );
  },
);

function decodeArgs(v: DataView, l: Launch): unknown[] {
  return kernelSpecs[l.kernel].params.map((type, j) => {
    switch (type) {
      case "f32":
        return v.getFloat32(8 * j, true);
      case "i32":
        return v.getInt32(8 * j, true);
      case "u64":
        return v.getBigUint64(8 * j, true);
      default:
        return Number(v.getBigInt64(8 * j, true));
    }
  });
}

function expectedValue(type: string, a: number | bigint | Ptr): unknown {
  if (type === "f32") return Math.fround(a as number);
  if (type === "u64") return a as bigint;
  return Number(a);
}
