// The CPU backend itself: memory, copies, reductions and casts against plain references.
import { describe, expect, test } from "bun:test";
import { CpuBackend } from "../../ffi/cpu/backend.ts";
import { hostKernels } from "../../ffi/cpu/host.ts";
import { Rng } from "../../engine/rng.ts";
import { castSpecials, cpu, relErr, transposePairs } from "../helpers/numeric.ts";

/** float32 -> bfloat16 bits, round to nearest even, written from the definition. */
function bf16Reference(x: number): number {
  const f = new Float32Array([x]);
  const u = new Uint32Array(f.buffer)[0]!;
  if (Number.isNaN(x)) return (u >>> 16) | 0x40;
  const upper = u >>> 16;
  const lower = u & 0xffff;
  if (lower > 0x8000 || (lower === 0x8000 && (upper & 1) === 1)) return (upper + 1) & 0xffff;
  return upper;
}

function roundTrip(be: CpuBackend, input: Float32Array, to: "bf16" | "f16") {
  const n = input.length;
  const src = be.alloc(n * 4);
  const half = be.alloc(n * 2);
  const back = be.alloc(n * 4);
  be.upload(src.ptr, input);
  if (to === "bf16") {
    be.castF32ToBF16(half.ptr, src.ptr, n);
    be.castBF16ToF32(back.ptr, half.ptr, n);
  } else {
    be.castF32ToF16(half.ptr, src.ptr, n);
    be.castF16ToF32(back.ptr, half.ptr, n);
  }
  const bits = new Uint16Array(n);
  const restored = new Float32Array(n);
  be.download(half.ptr, bits);
  be.download(back.ptr, restored);
  for (const a of [src, half, back]) be.free(a);
  return { bits, restored };
}

describe("casts", () => {
  const rng = new Rng(42);
  const random = Array.from({ length: 5000 }, () => rng.normal() * 10 ** (rng.int(20) - 10));
  const input = Float32Array.from([...castSpecials, ...random]);

  test("f32 -> f16 -> f32 matches Float16Array bit for bit (round to nearest even)", () => {
    const { bits, restored } = roundTrip(cpu(), input, "f16");
    const expected = new Uint16Array(Float16Array.from(input).buffer);
    // NaN payloads may differ; both must be NaN
    for (let i = 0; i < input.length; i++) {
      if (Number.isNaN(input[i]!)) expect(Number.isNaN(restored[i]!)).toBe(true);
      else expect(bits[i]).toBe(expected[i]!);
    }
    const back = Float32Array.from(Float16Array.from(input));
    for (let i = 0; i < input.length; i++) if (!Number.isNaN(input[i]!)) expect(restored[i]).toBe(back[i]!);
  });

  test("f32 -> bf16 -> f32 matches the definition bit for bit", () => {
    const { bits, restored } = roundTrip(cpu(), input, "bf16");
    for (let i = 0; i < input.length; i++) {
      expect(bits[i]).toBe(bf16Reference(input[i]!));
      if (Number.isNaN(input[i]!)) expect(Number.isNaN(restored[i]!)).toBe(true);
      else expect(restored[i]).toBe(new Float32Array(new Uint32Array([bits[i]! << 16]).buffer)[0]!);
    }
  });
});

describe("memory", () => {
  test("alloc is zeroed and 64-byte aligned; stats count allocations; free rejects unknown pointers", () => {
    const be = new CpuBackend();
    const a = be.alloc(1000);
    expect(a.ptr % 64).toBe(0);
    const host = new Uint8Array(1000).fill(7);
    be.download(a.ptr, host);
    expect(host.every((v) => v === 0)).toBe(true);
    expect(be.stats.allocCount).toBe(1);
    expect(be.stats.liveBytes).toBe(1000);
    be.free(a);
    expect(be.stats.liveBytes).toBe(0);
    expect(() => be.free(a)).toThrow(/not a live allocation/);
    be.dispose();
    expect(() => be.alloc(8)).toThrow(/after dispose/);
  });

  test("upload/download honour typed-array views with offsets", () => {
    const be = cpu();
    const a = be.alloc(16);
    const src = Float32Array.of(9, 1, 2, 3, 4, 9);
    be.upload(a.ptr, src.subarray(1, 5));
    const dst = new Float32Array(8);
    be.download(a.ptr, dst.subarray(2, 6));
    expect([...dst]).toEqual([0, 0, 1, 2, 3, 4, 0, 0]);
    be.free(a);
  });

  test("negative or fractional byte counts are rejected", () => {
    expect(() => cpu().alloc(-1)).toThrow(RangeError);
    expect(() => cpu().alloc(1.5)).toThrow(RangeError);
  });
});

describe("reductions", () => {
  test("sumSquares agrees with a float64 sum over odd lengths", () => {
    const be = cpu();
    const rng = new Rng(1);
    for (const n of [1, 15, 16, 17, 4097, 100003]) {
      const x = Float32Array.from({ length: n }, () => rng.normal());
      const a = be.alloc(n * 4);
      be.upload(a.ptr, x);
      let ref = 0;
      for (const v of x) ref += v * v;
      expect(Math.abs(be.sumSquares(a.ptr, n) - ref) / ref).toBeLessThan(1e-6);
      be.free(a);
    }
  });

  test("countNonFinite counts NaN and both infinities", () => {
    const be = cpu();
    const x = new Float32Array(70000);
    x[3] = NaN;
    x[40000] = Infinity;
    x[69999] = -Infinity;
    const a = be.alloc(x.byteLength);
    be.upload(a.ptr, x);
    expect(be.countNonFinite(a.ptr, x.length)).toBe(3);
    be.free(a);
  });
});

describe("kernels that split work by hand", () => {
  // Regression: they once split by the number of threads requested; a smaller team (here:
  // 4 requested, OMP_THREAD_LIMIT=1 granted) left part of the range uncomputed.
  test.each([
    ["default threads", {}],
    ["4 requested, 1 granted", { OMP_NUM_THREADS: "4", OMP_THREAD_LIMIT: "1" }],
    ["3 threads", { OMP_NUM_THREADS: "3" }],
  ])(
    "%s: sumSquares, biasBackward, embeddingBackward match references",
    (_name, env) => {
      const p = Bun.spawnSync([process.execPath, `${import.meta.dir}/fixtures/reductions.ts`], {
        env: { ...process.env, ...env },
        stdout: "pipe",
        stderr: "pipe",
      });
      expect(p.stderr.toString()).toBe("");
      const r = JSON.parse(p.stdout.toString());
      expect(r.sumSquares).toBeLessThan(1e-6);
      expect(r.biasBackward).toBeLessThan(1e-5);
      expect(r.embeddingBackward).toBeLessThan(1e-5);
    },
    60_000,
  );
});

describe("gemm (every input type)", () => {
  type Input = "f32" | "tf32" | "bf16" | "f16";
  /** The value each 2-byte element holds, decoded in JavaScript (not by the backend's widening). */
  const decode = (input: Input, bits: Uint16Array): Float64Array =>
    input === "bf16"
      ? Float64Array.from(bits, (b) => new Float32Array(new Uint32Array([b << 16]).buffer)[0]!)
      : Float64Array.from(new Float16Array(bits.buffer, bits.byteOffset, bits.length));

  /** Uploads x as `input` elements; returns the allocation and the values it holds. */
  function operand(be: CpuBackend, input: Input, x: Float32Array) {
    const n = x.length;
    const f32 = be.alloc(n * 4);
    be.upload(f32.ptr, x);
    if (input === "f32" || input === "tf32") return { a: f32, values: Float64Array.from(x), extra: [] };
    const half = be.alloc(n * 2);
    if (input === "bf16") be.castF32ToBF16(half.ptr, f32.ptr, n);
    else be.castF32ToF16(half.ptr, f32.ptr, n);
    const bits = new Uint16Array(n);
    be.download(half.ptr, bits);
    return { a: half, values: decode(input, bits), extra: [f32] };
  }

  /** C[b] = alpha op(A[b]) op(B[b]) + beta C[b] in float64, straight from the definition. */
  function reference(
    s: Shape,
    A: Float64Array,
    B: Float64Array,
    C: Float64Array,
    alpha: number,
    beta: number,
  ): Float64Array {
    const out = Float64Array.from(C);
    for (let b = 0; b < s.batch; b++) {
      for (let i = 0; i < s.M; i++) {
        for (let j = 0; j < s.N; j++) {
          let acc = 0;
          for (let k = 0; k < s.K; k++) {
            const av = A[b * s.strideA + (s.tA ? k * s.lda + i : i * s.lda + k)]!;
            const bv = B[b * s.strideB + (s.tB ? j * s.ldb + k : k * s.ldb + j)]!;
            acc += av * bv;
          }
          const c = b * s.strideC + i * s.ldc + j;
          out[c] = alpha * acc + beta * C[c]!;
        }
      }
    }
    return out;
  }

  interface Shape {
    M: number;
    N: number;
    K: number;
    tA: boolean;
    tB: boolean;
    batch: number;
    lda: number;
    ldb: number;
    ldc: number;
    strideA: number;
    strideB: number;
    strideC: number;
  }
  /** Odd sizes, leading dimensions padded by `pad` and matrices `gap` elements apart beyond that. */
  function shape(
    M: number,
    N: number,
    K: number,
    tA: boolean,
    tB: boolean,
    batch: number,
    pad: number,
    gap: number,
  ): Shape {
    const lda = (tA ? M : K) + pad,
      ldb = (tB ? K : N) + pad,
      ldc = N + pad;
    return {
      M,
      N,
      K,
      tA,
      tB,
      batch,
      lda,
      ldb,
      ldc,
      strideA: (tA ? K : M) * lda + gap,
      strideB: (tB ? N : K) * ldb + gap,
      strideC: M * ldc + gap,
    };
  }

  // M = 1 with batch 1 is a matrix-vector product (cblas_sgemv: a generated token's layers)
  const cases: [Input, boolean, boolean, number, number, number][] = [];
  for (const input of ["f32", "tf32", "bf16", "f16"] as const) {
    for (const [tA, tB] of transposePairs) {
      cases.push([input, tA, tB, 1, 0, 7], [input, tA, tB, 3, 0, 7], [input, tA, tB, 3, 5, 7]);
      cases.push([input, tA, tB, 1, 0, 1], [input, tA, tB, 1, 5, 1]);
    }
  }
  test.each(cases)(
    "%s transA=%p transB=%p batch %d, padding %d, M=%d: float64 reference on the rounded inputs",
    (input, tA, tB, batch, pad, M) => {
      const be = cpu();
      const s = shape(M, 5, 13, tA, tB, batch, pad, pad * 3);
      const rng = new Rng(batch * 10 + pad + (tA ? 100 : 0) + (tB ? 200 : 0));
      const rand = (n: number) => Float32Array.from({ length: n }, () => rng.normal());
      const nA = (batch - 1) * s.strideA + (tA ? s.K : s.M) * s.lda;
      const nB = (batch - 1) * s.strideB + (tB ? s.N : s.K) * s.ldb;
      const nC = (batch - 1) * s.strideC + s.M * s.ldc;
      const A = operand(be, input, rand(nA));
      const B = operand(be, input, rand(nB));
      const c0 = rand(nC);
      const C = be.alloc(nC * 4);
      be.upload(C.ptr, c0);
      be.gemm({
        input,
        transA: tA,
        transB: tB,
        M: s.M,
        N: s.N,
        K: s.K,
        alpha: 0.75,
        A: A.a.ptr,
        lda: s.lda,
        strideA: s.strideA,
        B: B.a.ptr,
        ldb: s.ldb,
        strideB: s.strideB,
        beta: 0.5,
        C: C.ptr,
        ldc: s.ldc,
        strideC: s.strideC,
        batch,
      });
      const got = new Float32Array(nC);
      be.download(C.ptr, got);
      const want = reference(s, A.values, B.values, Float64Array.from(c0), 0.75, 0.5);
      expect(relErr(got, want)).toBeLessThan(1e-5);
      // padding and gaps of C are not written
      const written = new Set<number>();
      for (let b = 0; b < batch; b++)
        for (let i = 0; i < s.M; i++) for (let j = 0; j < s.N; j++) written.add(b * s.strideC + i * s.ldc + j);
      for (let i = 0; i < nC; i++) if (!written.has(i)) expect(got[i]).toBe(c0[i]!);
      for (const a of [A.a, B.a, C, ...A.extra, ...B.extra]) be.free(a);
    },
  );

  test("one row (M = 1) with beta 0 overwrites C: a NaN there (an arena's poison) is not scaled into it", () => {
    const be = cpu();
    const [N, K] = [6, 4];
    const a = be.alloc(K * 4);
    const b = be.alloc(N * K * 4);
    const c = be.alloc(N * 4);
    be.upload(a.ptr, Float32Array.from([1, 2, 3, 4]));
    be.upload(
      b.ptr,
      Float32Array.from({ length: N * K }, (_, i) => i % 3),
    );
    be.fill(c.ptr, N, Number.NaN);
    be.gemm({ M: 1, N, K, transB: true, A: a.ptr, lda: K, B: b.ptr, ldb: K, C: c.ptr, ldc: N });
    const got = new Float32Array(N);
    be.download(c.ptr, got);
    const want = Array.from({ length: N }, (_, j) =>
      [1, 2, 3, 4].reduce((acc, x, k) => acc + x * ((j * K + k) % 3), 0),
    );
    expect([...got]).toEqual(want);
    for (const m of [a, b, c]) be.free(m);
  });

  test("2-byte inputs: scratch is allocated once, grown only for a larger GEMM, freed by dispose", () => {
    const be = new CpuBackend();
    const run = (M: number, N: number, K: number) => {
      const a = be.alloc(M * K * 2),
        b = be.alloc(K * N * 2),
        c = be.alloc(M * N * 4);
      be.gemm({ input: "bf16", M, N, K, A: a.ptr, lda: K, B: b.ptr, ldb: N, C: c.ptr, ldc: N });
      for (const x of [a, b, c]) be.free(x);
    };
    run(64, 64, 64);
    expect(be.stats.allocCount).toBe(3 + 1); // A, B, C and the scratch
    for (let i = 0; i < 3; i++) run(64, 64, 64);
    run(8, 8, 8);
    expect(be.stats.allocCount).toBe(4 + 4 * 3); // only the operands of the 4 runs
    run(512, 512, 512);
    expect(be.stats.allocCount).toBe(16 + 3 + 1); // operands and one larger scratch
    be.dispose();
    expect(be.stats.liveBytes).toBe(0);
  });

  test("bad arguments are refused before any native call; an empty product does nothing", () => {
    const be = cpu();
    const desc = { input: "bf16" as const, M: 4, N: 4, K: 4, A: 0, lda: 4, B: 0, ldb: 4, C: 0, ldc: 4 };
    expect(() => be.gemm({ ...desc, lda: 3 })).toThrow(/leading dimension/);
    expect(() => be.gemm({ ...desc, M: -1 })).toThrow(RangeError);
    expect(() => be.gemm({ ...desc, K: 2.5 })).toThrow(RangeError);
    expect(() => be.gemm({ ...desc, batch: 2, strideA: -4 })).toThrow(RangeError);
    expect(() => be.gemm({ ...desc, input: "f8" as never })).toThrow(/unknown input type/);
    expect(() => be.gemm({ ...desc, input: "constructor" as never })).toThrow(/unknown input type/);
    // M, N or batch zero: nothing is read or written (the pointers here are not memory)
    for (const empty of [{ M: 0 }, { N: 0, ldb: 0, ldc: 0 }, { batch: 0 }]) be.gemm({ ...desc, ...empty });
  });

  test("K = 0 makes C = beta C, in every input type", () => {
    const be = cpu();
    for (const input of ["f32", "bf16"] as const) {
      const c = be.alloc(6 * 4);
      be.upload(c.ptr, Float32Array.from([1, 2, 3, 4, 5, 6]));
      be.gemm({ input, M: 2, N: 3, K: 0, A: c.ptr, lda: 0, B: c.ptr, ldb: 3, beta: 0.5, C: c.ptr, ldc: 3 });
      const got = new Float32Array(6);
      be.download(c.ptr, got);
      expect([...got]).toEqual([0.5, 1, 1.5, 2, 2.5, 3]);
      be.free(c);
    }
  });
});

describe("host kernels", () => {
  test("lookup: each byte's table entry, from any byte offset, every value a byte can take; wrong sizes refused", () => {
    const lut = Float32Array.from({ length: 256 }, (_, v) => (v / 255 - 0.1307) / 0.3081);
    lut[7] = Number.NaN;
    lut[200] = Number.NEGATIVE_INFINITY;
    const bytes = new Uint8Array(1031 + 3);
    for (let i = 0; i < bytes.length; i++) bytes[i] = (i * 37 + 11) & 255;
    for (const offset of [0, 1, 2, 3]) {
      const view = bytes.subarray(offset, offset + 1031);
      const out = new Float32Array(view.length);
      hostKernels().lookup(out, view, lut);
      const want = Float32Array.from(view, (b) => lut[b]!);
      expect(Buffer.from(out.buffer).equals(Buffer.from(want.buffer))).toBe(true);
    }
    hostKernels().lookup(new Float32Array(0), new Uint8Array(0), lut);
    expect(() => hostKernels().lookup(new Float32Array(3), new Uint8Array(4), lut)).toThrow(
      "lookup: 3 outputs for 4 inputs",
    );
    expect(() => hostKernels().lookup(new Float32Array(4), new Uint8Array(4), new Float32Array(255))).toThrow(
      "lookup: a table of 255 values, not 256",
    );
  });
});
