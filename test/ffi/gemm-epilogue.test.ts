// A GEMM's epilogue (ffi/backend.ts GemmEpilogue: a linear layer's bias, bias + GELU keeping
// the pre-activation, and the bias gradient) against float64, on the CPU (the layer kernels after
// sgemm) and on the CUDA backend emulated on the host, where cuBLASLt fuses it
// (fixtures/fake-cublaslt.c checks the descriptors, layouts and epilogue attributes the binding
// sets, and computes in float64). Also: the fallback to the kernels where cuBLASLt has no
// algorithm, where the aux matrix is misaligned, and where the backend is asked for kernels; and
// the descriptions gemmCall refuses.
// Letters: row-major C (M,N) = A (M,K) B^T, B (N,K) as a linear layer's weight; bias (N).
import { afterEach, describe, expect, test } from "bun:test";
import { type Backend, type ElemType, type GemmEpilogue, type GemmInput, gemmCall } from "../../ffi/backend.ts";
import { CudaBackend } from "../../ffi/cuda/backend.ts";
import { Rng } from "../../engine/rng.ts";
import { compareEpilogues } from "../../bench/epilogues.ts";
import { emulatedCuda, type FakeCublasLt, fakeCublasLt } from "../helpers/emulated-cuda.ts";
import { cpu, cudaSkipReason, randn, relErr, roundTo16, widen16 } from "../helpers/numeric.ts";
import { skip } from "../helpers/skip.ts";

const toolsMissing =
  Bun.which("g++") === null || Bun.which("cc") === null
    ? "g++ and cc are needed to build the emulated CUDA backend"
    : null;
const emulated = toolsMissing === null ? await emulatedCuda() : { ok: false as const, reason: toolsMissing };
const emulatedMissing = emulated.ok ? null : emulated.reason;
const fakeLt: FakeCublasLt | null = emulated.ok ? await fakeCublasLt() : null;
// each test's backends, disposed after it: the emulated device's memory is one for every test
// file a process runs, and each backend holds a cuBLAS workspace
const owned: CudaBackend[] = [];
afterEach(() => {
  for (const be of owned.splice(0)) be.dispose();
});

const k = 0.7978845608028654; // sqrt(2/pi)
const gelu = (x: number) => 0.5 * x * (1 + Math.tanh(k * (x + 0.044715 * x ** 3)));
const geluGrad = (x: number) => {
  const t = Math.tanh(k * (x + 0.044715 * x ** 3));
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * k * (1 + 3 * 0.044715 * x * x);
};

/** Values as a buffer of `elem` holds them (2-byte types rounded to nearest even). */
function asElem(x: Float64Array, elem: ElemType): Float64Array {
  return elem === "f32" ? Float64Array.from(Float32Array.from(x)) : roundTo16(x, elem).values;
}

function upload(be: Backend, x: Float64Array, elem: ElemType) {
  const data = elem === "f32" ? Float32Array.from(x) : roundTo16(x, elem).bits;
  const a = be.alloc(data.byteLength);
  be.upload(a.ptr, data);
  return a;
}

function download(be: Backend, p: number, n: number, elem: ElemType): Float64Array {
  if (elem === "f32") {
    const out = new Float32Array(n);
    be.download(p, out);
    return Float64Array.from(out);
  }
  const bits = new Uint16Array(n);
  be.download(p, bits);
  return widen16(bits, elem);
}

interface Case {
  M: number;
  N: number;
  K: number;
  input: GemmInput;
}

/** The three epilogues on one backend, and their float64 references. */
function runEpilogues(be: Backend, { M, N, K, input }: Case, seed = 1) {
  const rng = new Rng(seed);
  const elem: ElemType = input === "tf32" ? "f32" : input;
  const x = asElem(randn(rng, M * K), elem);
  const w = asElem(randn(rng, N * K, 0.5), elem);
  const bias = asElem(randn(rng, N), "f32");
  const dbias0 = asElem(randn(rng, N), "f32");
  const [xa, wa, ba] = [upload(be, x, elem), upload(be, w, elem), upload(be, bias, "f32")];
  const bytes = elem === "f32" ? 4 : 2;
  const C = be.alloc(M * N * bytes);
  const out = be.alloc(M * N * bytes);
  const pre = be.alloc(M * N * bytes);
  const dbias = upload(be, dbias0, "f32");
  const dw = be.alloc(N * K * 4);
  const xw = (Cp: number, epilogue: GemmEpilogue) =>
    be.gemm({
      input,
      output: elem,
      transB: true,
      M,
      N,
      K,
      A: xa.ptr,
      lda: K,
      B: wa.ptr,
      ldb: K,
      C: Cp,
      ldc: N,
      epilogue,
    });
  xw(C.ptr, { kind: "bias", bias: ba.ptr });
  xw(out.ptr, { kind: "biasGelu", bias: ba.ptr, pre: pre.ptr });
  // the GELU's gradient at pre, times x w^T (as the next layer's input gradient would be)
  const dg = be.alloc(M * N * bytes);
  xw(dg.ptr, { kind: "dgelu", pre: pre.ptr });
  // the weight gradient of a layer whose output gradient is x viewed (M rows of N): dW (N,K) +=
  // g^T w with g = the first M*N of x... here g is C's own values (N columns), read as A
  const g = download(be, C.ptr, M * N, elem);
  be.gemm({
    input,
    transA: true,
    M: N,
    N: K,
    K: M,
    A: C.ptr,
    lda: N,
    B: xa.ptr,
    ldb: K,
    beta: 1,
    C: dw.ptr,
    ldc: K,
    epilogue: { kind: "biasGrad", dbias: dbias.ptr },
  });
  const got = {
    biased: g,
    gelu: download(be, out.ptr, M * N, elem),
    dgelu: download(be, dg.ptr, M * N, elem),
    pre: download(be, pre.ptr, M * N, elem),
    dbias: download(be, dbias.ptr, N, "f32"),
    dw: download(be, dw.ptr, N * K, "f32"),
  };
  const preStored = got.pre;
  for (const a of [xa, wa, ba, C, out, pre, dbias, dw, dg]) be.free(a);
  // float64: z = x w^T + bias
  const z = new Float64Array(M * N);
  for (let i = 0; i < M; i++)
    for (let j = 0; j < N; j++) {
      let s = bias[j]!;
      for (let p = 0; p < K; p++) s += x[i * K + p]! * w[j * K + p]!;
      z[i * N + j] = s;
    }
  const dbiasRef = Float64Array.from(dbias0);
  const dwRef = new Float64Array(N * K);
  for (let i = 0; i < M; i++)
    for (let j = 0; j < N; j++) {
      dbiasRef[j]! += g[i * N + j]!;
      for (let p = 0; p < K; p++) dwRef[j * K + p]! += g[i * N + j]! * x[i * K + p]!;
    }
  const dgelu = z.map((v, i) => (v - bias[i % N]!) * geluGrad(preStored[i]!));
  const want = { biased: z, gelu: z.map(gelu), pre: z, dbias: dbiasRef, dw: dwRef, dgelu };
  return { got, want };
}

const tolerance = (input: GemmInput) => (input === "f32" || input === "tf32" ? 1e-5 : 1.6e-2);

function expectClose(got: Record<string, Float64Array>, want: Record<string, Float64Array>, tol: number) {
  for (const [name, values] of Object.entries(want)) {
    const err = relErr(got[name]!, values);
    if (!(err <= tol)) throw new Error(`${name}: relative error ${err} > ${tol}`);
  }
}

const cases: Case[] = [
  { M: 6, N: 16, K: 8, input: "f32" },
  { M: 5, N: 24, K: 7, input: "bf16" },
  { M: 3, N: 8, K: 9, input: "f16" },
];

describe("GEMM epilogues on the CPU (sgemm, then the layer kernels)", () => {
  for (const c of cases) {
    test(`${c.input} M=${c.M} N=${c.N} K=${c.K}`, () => {
      const { got, want } = runEpilogues(cpu(), c);
      expectClose(got, want, tolerance(c.input));
    });
  }
});

describe("GEMM epilogues on CUDA (emulated): cuBLASLt fuses them", () => {
  for (const c of cases) {
    test.skipIf(skip("the emulated CUDA backend", emulatedMissing))(`${c.input} M=${c.M} N=${c.N} K=${c.K}`, () => {
      if (!emulated.ok) return;
      const be = emulated.backendWith({});
      owned.push(be);
      const before = fakeLt!.matmuls();
      const { got, want } = runEpilogues(be, c);
      expectClose(got, want, tolerance(c.input));
      // bias, bias + GELU, its gradient and the bias gradient: four fused calls, the last BGRADB
      expect(fakeLt!.matmuls() - before).toBe(4);
      expect(fakeLt!.lastEpilogue()).toBe(512);
      expect(be.describeEpilogues()).toMatch(/^bias, GELU, their gradients fused into the GEMM \(cuBLASLt \d+\)$/);
    });
  }

  test.skipIf(skip("the emulated CUDA backend", emulatedMissing))(
    "where cuBLASLt finds no algorithm, the kernels run instead, with the same results, and the description says why",
    () => {
      if (!emulated.ok) return;
      const be = emulated.backendWith({});
      owned.push(be);
      const c = cases[1]!;
      fakeLt!.refuse(true);
      try {
        const before = fakeLt!.matmuls();
        const { got, want } = runEpilogues(be, c);
        expectClose(got, want, tolerance(c.input));
        expect(fakeLt!.matmuls()).toBe(before);
        expect(be.describeEpilogues()).toMatch(
          /as kernels where bias at 24x5x7 \(types 14\/14\): cuBLASLt has no kernel for it \(CUBLAS_STATUS_NOT_SUPPORTED\); biasGelu at 24x5x7/,
        );
      } finally {
        fakeLt!.refuse(false);
      }
    },
  );

  test.skipIf(skip("the emulated CUDA backend", emulatedMissing))(
    "epilogues 'kernels' never calls cuBLASLt; a GELU aux whose rows are not a multiple of 8 falls back alone",
    () => {
      if (!emulated.ok) return;
      const kernels = emulated.backendWith({ epilogues: "kernels" });
      const lt = emulated.backendWith({});
      owned.push(kernels, lt);
      const c: Case = { M: 4, N: 12, K: 5, input: "bf16" };
      let before = fakeLt!.matmuls();
      const a = runEpilogues(kernels, c);
      expect(fakeLt!.matmuls()).toBe(before);
      expect(kernels.describeEpilogues()).toContain("as asked");
      expectClose(a.got, a.want, tolerance(c.input));
      before = fakeLt!.matmuls();
      const b = runEpilogues(lt, c);
      // N = 12: bias and the bias gradient fused, GELU's and its gradient's aux (ld 12) not
      expect(fakeLt!.matmuls() - before).toBe(2);
      expect(lt.describeEpilogues()).toContain("its GELU input needs a leading dimension that is a multiple of 8");
      expectClose(b.got, b.want, tolerance(c.input));
    },
  );
});

test.skipIf(skip("the emulated CUDA backend", emulatedMissing))(
  "a bf16 output's bias: the caller's bf16 copy is read as it is; without one the backend rounds the f32 bias (one cast)",
  () => {
    if (!emulated.ok) return;
    const be = emulated.backendWith({});
    owned.push(be);
    const [M, N, K] = [4, 16, 8];
    const rng = new Rng(9);
    const x = upload(be, asElem(randn(rng, M * K), "bf16"), "bf16");
    const w = upload(be, asElem(randn(rng, N * K), "bf16"), "bf16");
    const biasValues = randn(rng, N);
    const bias = upload(be, biasValues, "f32");
    const biasCopy = upload(be, biasValues, "bf16");
    const run = (epilogue: GemmEpilogue) => {
      const c = be.alloc(M * N * 2);
      const kernels = be.launchCounts.kernels;
      be.gemm({
        input: "bf16",
        output: "bf16",
        transB: true,
        M,
        N,
        K,
        A: x.ptr,
        lda: K,
        B: w.ptr,
        ldb: K,
        C: c.ptr,
        ldc: N,
        epilogue,
      });
      const launched = be.launchCounts.kernels - kernels;
      const out = download(be, c.ptr, M * N, "bf16");
      be.free(c);
      return { out, launched };
    };
    const rounded = run({ kind: "bias", bias: bias.ptr });
    const copied = run({ kind: "bias", bias: bias.ptr, biasCopy: biasCopy.ptr });
    expect(rounded.launched).toBe(1);
    expect(copied.launched).toBe(0);
    expect(copied.out).toEqual(rounded.out);
    for (const a of [x, w, bias, biasCopy]) be.free(a);
  },
);

test.skipIf(skip("the emulated CUDA backend", emulatedMissing))(
  "bench epilogues' comparison runs every layer's forward and weight gradient both ways (tiny shapes)",
  () => {
    if (!emulated.ok) return;
    const kernels = emulated.backendWith({ epilogues: "kernels" });
    const fused = emulated.backendWith({});
    owned.push(kernels, fused);
    const before = fakeLt!.matmuls();
    const rows = compareEpilogues(kernels, fused, 16, 8, 1);
    expect(rows.map((r) => `${r.layer} ${r.epilogue}`)).toEqual([
      "qkv 8->24 bias",
      "qkv 8->24 biasGrad",
      "attn proj 8->8 bias",
      "attn proj 8->8 biasGrad",
      "fc 8->32 biasGelu",
      "fc 8->32 biasGrad",
      "mlp proj 32->8 bias",
      "mlp proj 32->8 biasGrad",
      "mlp proj 32->8 dgelu",
    ]);
    // 3 warm-ups and 1 timed call per row, all fused
    expect(fakeLt!.matmuls() - before).toBe(9 * 4);
    for (const r of rows) expect(r.kernels_ms > 0 && r.fused_ms > 0 && r.speedup > 0).toBe(true);
    expect(fused.describeEpilogues()).not.toContain("as kernels");
  },
);

describe("GEMM epilogues on a real GPU: cuBLASLt fuses them at aligned shapes", () => {
  const aligned: Case[] = [
    { M: 64, N: 96, K: 128, input: "bf16" },
    { M: 64, N: 96, K: 128, input: "f16" },
    { M: 32, N: 64, K: 48, input: "f32" },
    { M: 32, N: 64, K: 48, input: "tf32" },
  ];
  for (const c of aligned) {
    test.skipIf(skip("CUDA", cudaSkipReason))(`${c.input} M=${c.M} N=${c.N} K=${c.K}`, () => {
      const be = new CudaBackend({});
      owned.push(be);
      const { got, want } = runEpilogues(be, c);
      console.log(`${c.input}: ${be.describeEpilogues()}`);
      expectClose(got, want, c.input === "tf32" ? 2e-3 : tolerance(c.input));
      expect(be.describeEpilogues()).not.toContain("as kernels");
    });
  }
});

describe("gemmCall refuses an epilogue it cannot run", () => {
  const base = { M: 2, N: 3, K: 4, A: 64, lda: 4, B: 128, ldb: 3, C: 256, ldc: 3 };
  test("bias with beta != 0, a batch, or ldc != N", () => {
    const epilogue: GemmEpilogue = { kind: "bias", bias: 512 };
    expect(() => gemmCall({ ...base, beta: 1, epilogue })).toThrow(/needs beta 0 and ldc = N/);
    expect(() => gemmCall({ ...base, batch: 2, epilogue })).toThrow(/needs batch 1, not 2/);
    expect(() => gemmCall({ ...base, ldc: 5, epilogue })).toThrow(/needs beta 0 and ldc = N/);
    expect(gemmCall({ ...base, epilogue }).epilogue).toEqual(epilogue);
  });
  test("biasGrad without A stored (K,M)", () => {
    const epilogue: GemmEpilogue = { kind: "biasGrad", dbias: 512 };
    expect(() => gemmCall({ ...base, epilogue })).toThrow(/needs A stored \(K,M\): transA and lda = M/);
    expect(() => gemmCall({ ...base, transA: true, lda: 3, epilogue })).toThrow(/transA and lda = M \(lda=3, M=2\)/);
    expect(gemmCall({ ...base, transA: true, lda: 2, beta: 1, epilogue }).beta).toBe(1);
  });
});
