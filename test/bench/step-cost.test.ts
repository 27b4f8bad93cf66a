// --profile's rate columns (bench/step-cost.ts): the bytes each op must move, read from its
// arguments as ffi/ops.ts declares them, and a memory bandwidth from the driver's clock and bus
// width. A model reading the wrong argument gives NaN or a wrong count; the table of a real (CPU)
// profiled step shows that every op of a GPT step has a finite rate or is measured in FLOPs.
import { describe, expect, test } from "bun:test";
import { runConfigBench } from "../../bench/engine-config.ts";
import { opBytes, peakBandwidth } from "../../bench/step-cost.ts";
import { cpu } from "../helpers/numeric.ts";

describe("opBytes", () => {
  test("layer ops count their activations in their element type, sums and parameters in f32", () => {
    // biasAdd(out, inp, bias, N, C, elem): read and write N*C
    expect(opBytes("biasAdd", [0, 0, 0, 8, 4, "bf16"])).toBe(2 * 8 * 4 * 2);
    expect(opBytes("biasAdd", [0, 0, 0, 8, 4, "f32"])).toBe(2 * 8 * 4 * 4);
    // geluBackward(dinp, inp, dout, n, elem)
    expect(opBytes("geluBackward", [0, 0, 0, 100, "bf16"])).toBe(600);
    // crossEntropyBackward(dlogits, logits, lse, targets, dloss, N, V, accumulate, elem)
    expect(opBytes("crossEntropyBackward", [0, 0, 0, 0, 0, 4, 10, false, "bf16"])).toBe(2 * 40 * 2);
    expect(opBytes("crossEntropyBackward", [0, 0, 0, 0, 0, 4, 10, true, "f32"])).toBe(3 * 40 * 4);
    // residualLayerNormForward(sum, out, mean, rstd, x, d, w, b, N, C, eps, elem)
    expect(opBytes("residualLayerNormForward", [0, 0, 0, 0, 0, 0, 0, 0, 3, 8, 1e-5, "bf16"])).toBe(3 * 8 * 14);
    // adamwStep(param, grad, m, v, age, n, ...): 7 f32 passes, 9 with the age
    expect(opBytes("adamwStep", [0, 0, 0, 0, 0, 10, 10, 1e-3, 0.9, 0.99, 1e-8, 0.1, 1, 1, 1])).toBe(280);
    expect(opBytes("adamwStep", [0, 0, 0, 0, 4096, 10, 10, 1e-3, 0.9, 0.99, 1e-8, 0.1, 1, 1, 1])).toBe(360);
    expect(opBytes("castF32ToBF16", [0, 0, 1000])).toBe(6000);
    expect(opBytes("copy", [0, 0, 1000])).toBe(2000);
  });

  test("GEMMs, attention and host transfers are not counted in bytes", () => {
    for (const op of ["gemm", "attentionForward", "attentionBackward", "upload", "download"])
      expect(opBytes(op, [])).toBeNull();
  });
});

test("peakBandwidth: double data rate over the bus; unknown where the driver reports 0", () => {
  // an H100 SXM: 2619 MHz, 5120 bits
  expect(peakBandwidth(2_619_000, 5120)).toBeCloseTo(3.352e12, -9);
  expect(peakBandwidth(0, 5120)).toBeNull();
  expect(peakBandwidth(2_619_000, 0)).toBeNull();
});

test("a profiled GPT step on the CPU: every op has a finite rate, or is one measured in FLOPs", () => {
  const out = runConfigBench(cpu(), "cpu", {
    config: "small",
    batch: 2,
    steps: 1,
    precision: "bf16",
    profile: true,
    torch: false,
    quiet: true,
  }) as { profile: { op: string; tflops: number | string; gb_per_s: number | string; peak_pct: unknown }[] };
  const rates = Object.fromEntries(out.profile.map((r) => [r.op, r.tflops === "-" ? r.gb_per_s : r.tflops]));
  for (const [op, rate] of Object.entries(rates)) {
    const measured = typeof rate === "number" && Number.isFinite(rate) && rate >= 0;
    expect({ op, measured: measured || ["upload", "download", "binaryBroadcast"].includes(op) }).toEqual({
      op,
      measured: true,
    });
  }
  for (const op of ["gemm", "adamwStep", "layerNormBackward", "crossEntropyForward"]) expect(rates[op]).toBeNumber();
  // no device peaks on a CPU
  expect(out.profile.every((r) => r.peak_pct === "-")).toBe(true);
});

test("launchExposure (emulated CUDA): the work runs once from an idle GPU and once queued behind a hold, timed by events", async () => {
  const { emulatedCuda } = await import("../helpers/emulated-cuda.ts");
  const { launchExposure } = await import("../../bench/engine-config.ts");
  const emulated = await emulatedCuda();
  if (!emulated.ok) {
    console.log(`skipped: ${emulated.reason}`);
    return;
  }
  const be = emulated.backendWith({});
  const x = be.alloc(4 * 1024);
  let calls = 0;
  emulated.timeline.reset();
  const e = launchExposure(
    be,
    () => {
      calls++;
      for (let i = 0; i < 4; i++) be.add(x.ptr, x.ptr, x.ptr, 1024);
    },
    2,
  );
  expect(calls).toBe(4);
  // each rep: the hold, then the work behind it (fake-cuda.c's events report 1.5 ms apart)
  const launches = emulated.timeline.launches();
  expect(launches.filter((k) => k === "mt_hold_ns")).toHaveLength(2);
  expect(launches.filter((k) => k === "mt_add_f32")).toHaveLength(16);
  expect(e.gpuMs).toBe(1.5);
  expect(Number.isFinite(e.wallMs) && e.wallMs >= 0 && e.exposedMs >= 0 && e.hostMs >= 0).toBe(true);
  be.free(x);
  be.dispose();
});
