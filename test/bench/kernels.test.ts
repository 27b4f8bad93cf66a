// The kernel benchmark's shapes are whole numbers for every --elems it accepts: a fractional
// size once reached a kernel (`mt_strided_copy_f32: argument 2 (i64) is invalid: 170.66` at
// --elems 33554432) and only a GPU run found it.
import { describe, expect, test } from "bun:test";
import { kernelShapes } from "../../bench/kernels.ts";
import { ConfigError } from "../../ffi/errors.ts";

describe("bench kernels: shapes", () => {
  test.each([1 << 18, 1 << 20, 1 << 23, 33_554_432, 3 * (1 << 18), 1 << 28])(
    "--elems %i gives whole shapes inside the buffers",
    (n) => {
      const s = kernelShapes(n);
      for (const [name, v] of Object.entries(s))
        expect({ name, whole: Number.isSafeInteger(v) && v > 0 }).toEqual({ name, whole: true });
      expect(s.NC).toBeLessThanOrEqual(n);
      expect(s.BTC).toBeLessThanOrEqual(s.NC);
      expect(s.NV * s.V).toBe(n);
    },
  );

  test.each([0, 1000, 1.5 * (1 << 18), -(1 << 18)])("--elems %d is refused", (n) => {
    expect(() => kernelShapes(n)).toThrow(ConfigError);
  });
});
