// The CUDA kernel contract, checked without a GPU:
//   (a) with nvcc: every module compiles to PTX, and the PTX entry points match kernelSpecs
//       exactly (names, parameter counts and types), with no kernel missing from the specs;
//   (b) every plan, over tiny to huge shapes, launches known kernels with well-typed arguments
//       and legal launch shapes; empty inputs launch nothing (or, for scalar results, one
//       single-block launch that writes the result);
//   (c) every non-GEMM Backend method has a plan taking the method's arguments.
import { afterAll, describe, expect, test } from "bun:test";
import { chmodSync, existsSync, mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import type { Dims4 } from "../../ffi/backend.ts";
import { ensurePtx, findNvcc, kernelSourceModules, nvccInstallHint } from "../../ffi/cuda/build.ts";
import {
  attentionThreads,
  kernelModules,
  kernelSpecs,
  type KernelName,
  type Launch,
  type ParamType,
  planTakesScratch,
  plans,
  reduceShape,
  scratchBytes,
  flashBackward,
  flashForward,
} from "../../ffi/cuda/kernels.ts";
import { type OpDecl, type OpName, ops } from "../../ffi/ops.ts";
import { NativeLibraryError } from "../../ffi/errors.ts";
import { skip } from "../helpers/skip.ts";

// ---- (c) the method list ------------------------------------------------------------------------

/** every op (ffi/ops.ts), and those that return a number to JavaScript (their plans take scratch first) */
const methods = Object.keys(ops) as OpName[];
const scalarMethods = new Set<OpName>(methods.filter((m) => ops[m].result !== "void"));
const elems = ["f32", "bf16", "f16"] as const;

describe("plans cover the Backend", () => {
  test("one plan per op (ffi/ops.ts), no extras", () => {
    expect(Object.keys(plans).sort()).toEqual(Object.keys(ops).sort());
  });

  test("each plan takes the op's declared arguments (plus scratch for a result or a split sum; inRange optional)", () => {
    const names = Object.keys(ops) as OpName[];
    const arity = Object.fromEntries(names.map((m) => [m, plans[m].length]));
    const expected = Object.fromEntries(
      names.map((m) => {
        const d = ops[m] as OpDecl;
        return [m, d.args.length + (planTakesScratch(d) ? 1 : 0)];
      }),
    );
    expect(arity).toEqual(expected);
  });

  test("kernelModules() lists exactly the .cu files", () => {
    expect([...kernelModules()].sort()).toEqual(kernelSourceModules());
  });
});

// ---- (a) PTX ------------------------------------------------------------------------------------

const nvcc = findNvcc();
const nvccMissing = nvcc === null ? `nvcc not found (set MESHTRAIN_NVCC, or ${nvccInstallHint})` : null;

interface PtxEntry {
  /** PTX parameter types in order (u64, u32, s32, f32, ...) */
  readonly params: string[];
  /** threads per block from .maxntid (__launch_bounds__), or null without one */
  readonly maxThreads: number | null;
}

/** Every .entry in a PTX text, by name. */
function ptxEntries(ptx: string): Map<string, PtxEntry> {
  const entries = new Map<string, PtxEntry>();
  for (const m of ptx.matchAll(/\.entry\s+([A-Za-z_$][\w$]*)\s*\(([^)]*)\)([^{]*)\{/g)) {
    const params = m[2]!
      .split(",")
      .map((p) => p.trim())
      .filter((p) => p !== "");
    const maxntid = /\.maxntid\s+(\d+),\s*(\d+),\s*(\d+)/.exec(m[3]!);
    entries.set(m[1]!, {
      params: params.map((p) => /^\.param\s+\.(\w+)\s+[\w$]+$/.exec(p)?.[1] ?? `unparsed(${p})`),
      maxThreads: maxntid === null ? null : Number(maxntid[1]) * Number(maxntid[2]) * Number(maxntid[3]),
    });
  }
  return entries;
}

const ptxTypes: Record<ParamType, readonly string[]> = {
  ptr: ["u64"],
  i64: ["u64"],
  u64: ["u64"],
  i32: ["u32", "s32"],
  f32: ["f32"],
};

let built: Record<string, string> | undefined;
const compileTimeoutMs = 600_000; // ~10 modules, a few seconds each on a busy 2-core machine
const ptx = () => (built ??= ensurePtx());

describe("PTX", () => {
  test.skipIf(skip("nvcc", nvccMissing))(
    "every module compiles to compute_80 PTX",
    () => {
      const paths = ptx();
      expect(Object.keys(paths).sort()).toEqual([...kernelModules()].sort());
      for (const path of Object.values(paths)) {
        const text = readFileSync(path, "utf8");
        expect(text).toMatch(/^\.target sm_80\b/m);
        expect(text).toMatch(/\.entry /);
      }
    },
    compileTimeoutMs,
  );

  test.skipIf(skip("nvcc", nvccMissing))(
    "an up-to-date build compiles nothing",
    () => {
      ptx();
      const lines: string[] = [];
      ensurePtx((line) => lines.push(line));
      expect(lines).toEqual([]);
    },
    compileTimeoutMs,
  );

  test.skipIf(skip("nvcc", nvccMissing))(
    "every kernelSpecs entry is a PTX .entry with exactly its parameter types",
    () => {
      const paths = ptx();
      const mismatches: string[] = [];
      for (const [name, spec] of Object.entries(kernelSpecs)) {
        const entry = ptxEntries(readFileSync(paths[spec.module]!, "utf8")).get(name);
        if (entry === undefined) {
          mismatches.push(`${name}: no .entry in ${spec.module}.ptx`);
          continue;
        }
        const types = entry.params;
        const ok = types.length === spec.params.length && spec.params.every((t, i) => ptxTypes[t].includes(types[i]!));
        if (!ok) mismatches.push(`${name}: spec (${spec.params.join(", ")}) vs PTX (${types.join(", ")})`);
      }
      expect(mismatches).toEqual([]);
    },
    compileTimeoutMs,
  );

  test.skipIf(skip("nvcc", nvccMissing))(
    "every PTX .entry is in kernelSpecs, in its own module (no orphans)",
    () => {
      const orphans: string[] = [];
      for (const [module, path] of Object.entries(ptx())) {
        for (const name of ptxEntries(readFileSync(path, "utf8")).keys()) {
          const spec = (kernelSpecs as Record<string, { module: string }>)[name];
          if (spec?.module !== module) orphans.push(`${module}.ptx: ${name}`);
        }
      }
      expect(orphans).toEqual([]);
    },
    compileTimeoutMs,
  );

  test.skipIf(skip("nvcc", nvccMissing))(
    "every kernel is bounded for the largest block a plan gives it (.maxntid): 1024, or the attention tiles' 128",
    () => {
      const unbounded: string[] = [];
      for (const path of Object.values(ptx())) {
        for (const [name, entry] of ptxEntries(readFileSync(path, "utf8"))) {
          const want = attentionKernels.has(name as KernelName) ? attentionThreads : 1024;
          if (entry.maxThreads !== want) unbounded.push(`${name}: .maxntid ${entry.maxThreads}`);
        }
      }
      expect(unbounded).toEqual([]);
    },
    compileTimeoutMs,
  );

  // What the driver's JIT does at load time: assemble the PTX for the GPUs we run on. The PTX
  // targets compute_80, so sm_80 is the oldest GPU it runs on and the one with the least to give
  // (shared memory per block; the same registers): PTX that assembles for it assembles for sm_90,
  // whose instruction set is a superset. Assembling for sm_90 too doubled the test's 40 CPU-s
  // (flash.ptx, 4.6 MB, is most of it) and found nothing the sm_80 pass did not; the GPU tests
  // (scripts/device-check.sh tests) load the modules on a lent H100/H200, whose driver assembles
  // them for sm_90.
  const ptxas = nvcc === null ? null : join(dirname(nvcc), "ptxas");
  test.skipIf(
    skip("nvcc", nvccMissing) || skip("ptxas", ptxas !== null && !existsSync(ptxas) ? `${ptxas} not found` : null),
  )(
    "the PTX assembles for sm_80, the oldest GPU it targets (ptxas)",
    () => {
      const failures: string[] = [];
      for (const [module, path] of Object.entries(ptx())) {
        for (const arch of ["sm_80"]) {
          // -O0: whether the PTX is valid for the architecture, which is what this checks, in half
          // the time of ptxas's optimizer (the driver assembles it again, optimized, on the GPU)
          const result = Bun.spawnSync([ptxas!, "-O0", `-arch=${arch}`, "-o", "/dev/null", path], {
            stdout: "pipe",
            stderr: "pipe",
          });
          if (result.exitCode !== 0) failures.push(`${module} ${arch}: ${result.stderr.toString()}`);
        }
      }
      expect(failures).toEqual([]);
    },
    compileTimeoutMs,
  );
});

describe("build errors", () => {
  const dir = mkdtempSync(join(tmpdir(), "meshtrain-nvcc-"));
  const saved = process.env.MESHTRAIN_NVCC;
  afterAll(() => {
    if (saved === undefined) delete process.env.MESHTRAIN_NVCC;
    else process.env.MESHTRAIN_NVCC = saved;
    rmSync(dir, { recursive: true, force: true });
  });

  test("a failing nvcc raises NativeLibraryError with its stderr and leaves no PTX behind", () => {
    const fake = join(dir, "nvcc");
    writeFileSync(
      fake,
      [
        "#!/bin/sh",
        'if [ "$1" = "--version" ]; then echo "fake nvcc for meshtrain tests"; exit 0; fi',
        'echo "fake-nvcc: simulated compile error" >&2',
        "exit 2",
      ].join("\n"),
    );
    chmodSync(fake, 0o755);
    process.env.MESHTRAIN_NVCC = fake;
    expect(findNvcc()).toBe(fake);
    let error: unknown;
    try {
      ensurePtx();
    } catch (e) {
      error = e;
    }
    expect(error).toBeInstanceOf(NativeLibraryError);
    expect((error as Error).message).toContain("fake-nvcc: simulated compile error");
    const buildDir = join(import.meta.dir, "../../ffi/cuda/build");
    if (existsSync(buildDir)) expect(readdirSync(buildDir).filter((f) => f.endsWith(".tmp"))).toEqual([]);
  });

  test("MESHTRAIN_NVCC pointing nowhere is a configuration error", () => {
    process.env.MESHTRAIN_NVCC = join(dir, "missing-nvcc");
    expect(() => findNvcc()).toThrow(NativeLibraryError);
    expect(() => findNvcc()).toThrow("MESHTRAIN_NVCC");
  });
});

// ---- (b) launch shapes --------------------------------------------------------------------------

const p = 0x7f12_3456_0000; // a plausible CUdeviceptr; plans never dereference
const scratch = 0x7f00_0000_0100;
const huge = 3e9; // > 2^31 elements: 64-bit sizes, capped grids
const sizes = [1, 7, 1000, 65536, 2 ** 31 + 5, huge];
const seeds = [0n, 0xdeadbeefcafebaben, (1n << 64n) - 1n];

type Args = readonly unknown[];
const dims4: Dims4[] = [
  [1, 1, 1, 1],
  [2, 3, 4, 5],
  [1, 1, 100_000, 30_000],
  [262_144, 1, 1, 70_000],
  [7, 12, 4096, 64],
  [1, 1, 1, huge],
];
const contiguous = (d: Dims4): Dims4 => [d[1] * d[2] * d[3], d[2] * d[3], d[3], 1];
const broadcastOn = (d: Dims4, keep: readonly boolean[]): Dims4 => {
  const s = contiguous(d);
  return [0, 1, 2, 3].map((k) => (keep[k] ? s[k]! : 0)) as unknown as Dims4;
};
const keepPatterns = [
  [false, false, false, false],
  [false, false, false, true],
  [false, false, true, false],
  [true, false, false, false],
  [false, true, false, true],
  [true, true, true, true],
];
const rowsByCols: [number, number][] = [
  [1, 1],
  [8192, 768],
  [1_000_000, 4096],
  [huge, 1],
  [1, huge],
  [16, 65_536],
];
const vocab: [number, number][] = [
  [1, 1],
  [1, 50_257],
  [8192, 50_257],
  [1_000_000, 50_257],
  [huge, 1],
  [5, 2],
];
// B, T, C, H
const attention: [number, number, number, number][] = [
  [1, 1, 1, 1],
  [8, 1024, 768, 12],
  [1, 65_536, 128, 1],
  [64, 4096, 4096, 32],
  [48, 256, 384, 6],
];

const cases: { readonly [M in OpName]: readonly Args[] } = {
  add: sizes.map((n) => [p, p, p, n]),
  mul: sizes.map((n) => [p, p, p, n]),
  axpy: sizes.map((n) => [p, p, n, -0.5]),
  scale: sizes.map((n) => [p, n, 2]),
  addScalarFrom: sizes.map((n) => [p, p, 0.25, n]),
  binaryBroadcast: dims4.flatMap((d) =>
    (["add", "mul"] as const).map((op) => [op, p, p, p, d, broadcastOn(d, [false, true, false, true]), contiguous(d)]),
  ),
  reduceBroadcast: dims4.flatMap((d) => keepPatterns.map((keep) => [p, p, d, broadcastOn(d, keep)])),
  biasAdd: rowsByCols.flatMap(([N, C]) => elems.map((e) => [p, p, p, N, C, e])),
  biasBackward: rowsByCols.flatMap(([N, C]) => elems.map((e) => [scratch, p, p, N, C, e])),
  reluForward: sizes.map((n, i) => [p, p, n, elems[i % 3]]),
  reluBackward: sizes.map((n, i) => [p, p, p, n, elems[i % 3]]),
  geluForward: sizes.map((n, i) => [p, p, n, elems[i % 3]]),
  geluBackward: sizes.map((n, i) => [p, p, p, n, elems[i % 3]]),
  dropoutForward: sizes.flatMap((n) => seeds.map((s) => [p, p, n, 0.1, s])),
  dropoutBackward: sizes.flatMap((n) => seeds.map((s) => [p, p, n, 0.1, s])),
  biasGeluForward: rowsByCols.map(([N, C], i) => [p, p, p, N, C, elems[i % 3]]),
  crossEntropyForward: vocab.map(([N, V], i) => [scratch, p, p, p, p, p, N, V, elems[i % 3]]),
  crossEntropyBackward: vocab.flatMap(([N, V], i) =>
    [true, false].map((acc) => [p, p, p, p, p, N, V, acc, elems[i % 3]]),
  ),
  countCorrect: vocab.map(([N, V], i) => [scratch, p, p, N, V, elems[i % 3]]),
  layerNormForward: rowsByCols.map(([N, C], i) => [p, p, p, p, p, p, N, C, 1e-5, elems[i % 3]]),
  residualLayerNormForward: rowsByCols.map(([N, C], i) => [p, p, p, p, p, p, p, p, N, C, 1e-5, elems[i % 3]]),
  layerNormBackward: rowsByCols.flatMap(([N, C]) => elems.map((e) => [scratch, p, p, p, p, p, p, p, p, N, C, e])),
  embeddingForward: vocab.map(([N, V]) => [scratch, p, p, p, N, 768, V]),
  embeddingBackward: rowsByCols.map(([N, C]) => [p, p, p, N, C]),
  attentionForward: attention.flatMap(([B, T, C, H]) =>
    (["f32", "bf16"] as const).map((e) => [p, p, p, B, T, C, H, 0.125, e]),
  ),
  attentionDecode: attention.flatMap(([B, T, C, H]) =>
    (["f32", "bf16"] as const).map((e) => [p, p, B, T, C, H, 0.125, e]),
  ),
  attentionBackward: attention.flatMap(([B, T, C, H]) =>
    (["f32", "f16"] as const).flatMap((e) => [true, false].map((acc) => [p, p, p, p, p, p, B, T, C, H, 0.125, e, acc])),
  ),
  stridedCopy: dims4.flatMap((d) =>
    [false, true].map((acc) => [p, contiguous(d), p, [d[3], 1, d[0] * d[3], d[0] * d[1] * d[3]], d, acc]),
  ),
  sum: sizes.map((n) => [p, p, n]),
  sumSquares: sizes.map((n) => [scratch, p, n]),
  countNonFinite: sizes.map((n) => [scratch, p, n]),
  sgdStep: sizes.flatMap((n) => [
    [p, p, p, n, 0.1, 0.9, 0, 1e-4, true, false],
    [p, p, 0, n, 0.1, 0, 0, 0, false, true],
  ]),
  adamwStep: sizes.map((n) => [p, p, p, p, p, n, n >> 1, 1e-3, 0.9, 0.999, 1e-8, 0.1, 0.1, 0.001, 0.5]),
  castF32ToBF16: sizes.map((n) => [p, p, n]),
  castBF16ToF32: sizes.map((n) => [p, p, n]),
  castF32ToF16: sizes.map((n) => [p, p, n]),
  castF16ToF32: sizes.map((n) => [p, p, n]),
};

/** The same methods with an empty input. */
const emptyCases: { readonly [M in OpName]: Args } = {
  add: [p, p, p, 0],
  mul: [p, p, p, 0],
  axpy: [p, p, 0, 1],
  scale: [p, 0, 1],
  addScalarFrom: [p, p, 1, 0],
  binaryBroadcast: ["add", p, p, p, [2, 0, 3, 4], [0, 0, 4, 1], [12, 12, 4, 1]],
  reduceBroadcast: [p, p, [2, 3, 0, 4], [0, 0, 0, 1]],
  biasAdd: [p, p, p, 0, 768, "bf16"],
  biasBackward: [scratch, p, p, 8192, 0, "f32"],
  reluForward: [p, p, 0, "f32"],
  reluBackward: [p, p, p, 0, "bf16"],
  geluForward: [p, p, 0, "bf16"],
  geluBackward: [p, p, p, 0, "f32"],
  dropoutForward: [p, p, 0, 0.5, 1n],
  dropoutBackward: [p, p, 0, 0.5, 1n],
  biasGeluForward: [p, p, p, 0, 3072, "bf16"],
  crossEntropyForward: [scratch, p, p, p, p, p, 0, 50_257, "bf16"],
  crossEntropyBackward: [p, p, p, p, p, 0, 50_257, false, "bf16"],
  countCorrect: [scratch, p, p, 0, 50_257, "bf16"],
  layerNormForward: [p, p, p, p, p, p, 0, 768, 1e-5, "bf16"],
  residualLayerNormForward: [p, p, p, p, p, p, p, p, 0, 768, 1e-5, "f32"],
  layerNormBackward: [scratch, p, p, p, p, p, p, p, p, 0, 768, "bf16"],
  embeddingForward: [scratch, p, p, p, 0, 768, 50_257],
  embeddingBackward: [p, p, p, 0, 768],
  attentionForward: [p, p, p, 0, 1024, 768, 12, 0.125, "f32"],
  attentionDecode: [p, p, 0, 1024, 768, 12, 0.125, "f32"],
  attentionBackward: [p, p, p, p, p, p, 8, 0, 768, 12, 0.125, "bf16", false],
  stridedCopy: [p, [0, 0, 1, 1], p, [0, 0, 1, 1], [1, 1, 0, 5], true],
  sum: [p, p, 0],
  sumSquares: [scratch, p, 0],
  countNonFinite: [scratch, p, 0],
  sgdStep: [p, p, p, 0, 0.1, 0.9, 0, 0, false, false],
  adamwStep: [p, p, p, p, p, 0, 0, 1e-3, 0.9, 0.999, 1e-8, 0, 0.1, 0.001, 1],
  castF32ToBF16: [p, p, 0],
  castBF16ToF32: [p, p, 0],
  castF32ToF16: [p, p, 0],
  castF16ToF32: [p, p, 0],
};
/** Plans with a scalar result still write it for an empty input: one single-block launch. */
const writesScalarWhenEmpty = new Set<OpName>([
  "countCorrect",
  "sum",
  "sumSquares",
  "countNonFinite",
  "crossEntropyForward",
  "embeddingForward",
]);

function planFor(method: OpName, args: Args): Launch[] {
  return (plans[method] as (...a: readonly unknown[]) => Launch[])(...args);
}

// Kernel-specific launch requirements stated in the .cu files.
const singleBlockKernels = new Set<KernelName>([
  "mt_sum_f32",
  "mt_crossentropy_loss_f32",
  "mt_embedding_count_invalid_i32",
  "mt_sum_partials_f64",
  "mt_sum_partials_i64",
]);
const columnKernels = new Set<KernelName>([
  "mt_bias_backward_f32",
  "mt_bias_backward_partial_f32",
  "mt_layernorm_backward_params_f32",
  "mt_layernorm_params_partial_f32",
  "mt_reduce_bcast_cols_f32",
]);
const attentionKernels = new Set<KernelName>([
  "mt_attention_forward_f32",
  "mt_attention_backward_kv_f32",
  "mt_attention_backward_q_f32",
  "mt_flash_forward_d64",
  "mt_flash_forward_d128",
  "mt_flash_backward_q_d64",
  "mt_flash_backward_q_d128",
  "mt_flash_backward_kv_d64",
  "mt_flash_backward_kv_d128",
]);

/** Everything wrong with one launch, as readable strings (empty when it is fine). */
function launchProblems(l: Launch): string[] {
  const problems: string[] = [];
  const spec = (kernelSpecs as Record<string, { params: readonly ParamType[] } | undefined>)[l.kernel];
  if (spec === undefined) return [`unknown kernel ${l.kernel}`];
  if (l.args.length !== spec.params.length) problems.push(`${l.args.length} args for ${spec.params.length} params`);
  spec.params.forEach((type, i) => {
    const a = l.args[i];
    const ok =
      type === "u64"
        ? typeof a === "bigint" && a >= 0n && a < 1n << 64n
        : type === "f32"
          ? typeof a === "number"
          : type === "i32"
            ? typeof a === "number" && Number.isInteger(a) && a >= -(2 ** 31) && a < 2 ** 31
            : typeof a === "number" && Number.isSafeInteger(a);
    if (!ok) problems.push(`arg ${i} (${type}) = ${String(a)} (${typeof a})`);
  });
  const [gx, gy, gz] = l.grid;
  const [bx, by, bz] = l.block;
  const int = (v: number, lo: number, hi: number) => Number.isInteger(v) && v >= lo && v <= hi;
  if (!int(gx, 1, 2 ** 31 - 1) || !int(gy, 1, 65535) || !int(gz, 1, 65535)) problems.push(`grid ${l.grid.join("x")}`);
  if (!int(bx, 1, 1024) || !int(by, 1, 1024) || !int(bz, 1, 64) || !int(bx * by * bz, 1, 1024)) {
    problems.push(`block ${l.block.join("x")}`);
  }
  // every kernel here reduces or loops in whole warps
  if ((bx * by * bz) % 32 !== 0) problems.push(`block ${l.block.join("x")} is not whole warps`);
  if (!int(l.sharedBytes, 0, 48 * 1024)) problems.push(`sharedBytes ${l.sharedBytes}`);
  if (singleBlockKernels.has(l.kernel) && (gx !== 1 || by !== 1 || bz !== 1)) problems.push("needs one 1D block");
  if (columnKernels.has(l.kernel) && (bx !== 32 || by > 32 || bz !== 1)) problems.push("needs a (32, <=32) block");
  if (attentionKernels.has(l.kernel) && (bx !== 128 || by !== 1 || bz !== 1))
    problems.push("needs a 128-thread 1D block (4 threads per row of 32)");
  return problems.map((s) => `${l.kernel}: ${s}`);
}

describe("launches", () => {
  test("the tensor-core attention's launches (flash.cu): known kernels, typed args, 128-thread blocks", () => {
    const problems: string[] = [];
    for (const [B, T, C, H] of [
      [1, 1, 128, 2],
      [8, 1024, 768, 12],
      [3, 70, 256, 2],
    ] as const) {
      for (const elem of ["bf16", "f16"] as const) {
        const launches = [
          ...flashForward(p, p, p, B, T, C, H, 0.125, elem),
          ...flashBackward(p, p, p, p, p, p, B, T, C, H, 0.125, elem, true),
        ];
        expect(launches.map((l): string => l.kernel)).toEqual([
          `mt_flash_forward_d${C / H}`,
          "mt_attention_delta_f32",
          `mt_flash_backward_kv_d${C / H}`,
          `mt_flash_backward_q_d${C / H}`,
        ]);
        for (const l of launches) problems.push(...launchProblems(l));
      }
    }
    expect(problems).toEqual([]);
    expect(flashForward(p, p, p, 0, 8, 128, 2, 1, "bf16")).toEqual([]);
  });

  test.each([...methods])("%s: known kernels, typed args, legal launch shapes", (method) => {
    const problems: string[] = [];
    for (const args of cases[method]) {
      const launches = planFor(method, args);
      if (launches.length === 0) problems.push(`no launches for (${args.map(String).join(", ")})`);
      for (const l of launches) problems.push(...launchProblems(l));
      // what a plan keeps in scratch (results, partial sums) stays inside it
      for (const l of launches)
        for (const a of l.args)
          if (typeof a === "number" && a > scratch && a < scratch + 2 ** 32 && a >= scratch + scratchBytes)
            problems.push(`${l.kernel}: scratch address ${a - scratch} bytes in, past its ${scratchBytes}`);
    }
    expect(problems).toEqual([]);
  });

  test.each([...methods])("%s: an empty input launches nothing but a scalar result", (method) => {
    const launches = planFor(method, emptyCases[method]);
    if (!writesScalarWhenEmpty.has(method)) {
      expect(launches).toEqual([]);
      return;
    }
    expect(launches.length).toBe(1);
    const [l] = launches;
    expect(launchProblems(l!)).toEqual([]);
    expect(l!.grid).toEqual([1, 1, 1]);
    expect(singleBlockKernels.has(l!.kernel)).toBe(true);
  });

  test.each([...scalarMethods])("%s: the last launch writes the result into scratch", (method) => {
    for (const args of [...cases[method], emptyCases[method]]) {
      const launches = planFor(method, args);
      const last = launches[launches.length - 1]!;
      expect(singleBlockKernels.has(last.kernel)).toBe(true);
      expect(last.args).toContain(scratch);
      // anything else a plan puts in scratch stays inside it
      for (const l of launches) {
        for (const a of l.args) {
          if (typeof a === "number" && a > scratch && a < scratch + 2 ** 32)
            expect(a).toBeLessThan(scratch + scratchBytes);
        }
      }
    }
  });

  test("a huge elementwise launch keeps 64-bit sizes and a capped grid", () => {
    const [l] = plans.add(p, p, p, huge);
    expect(l!.args[3]).toBe(huge);
    expect(l!.grid[0]).toBeLessThan(huge / l!.block[0]);
  });

  test("dropout passes the seed as an exact u64 bigint", () => {
    const seed = (1n << 64n) - 3n;
    expect(plans.dropoutForward(p, p, 10, 0.5, seed)[0]!.args[4]).toBe(seed);
  });
});

describe("invalid input is refused", () => {
  test("a seed outside u64", () => {
    expect(() => plans.dropoutForward(p, p, 10, 0.5, -1n)).toThrow(RangeError);
    expect(() => plans.dropoutBackward(p, p, 10, 0.5, 1n << 64n)).toThrow(RangeError);
  });
  test("negative, fractional or unsafe sizes", () => {
    expect(() => plans.add(p, p, p, -1)).toThrow(RangeError);
    expect(() => plans.scale(p, 2.5, 1)).toThrow(RangeError);
    expect(() => plans.reluForward(p, p, 2 ** 60, "f32")).toThrow(RangeError);
    expect(() => plans.layerNormForward(p, p, p, p, p, p, -3, 768, 1e-5, "f32")).toThrow(RangeError);
  });
  test("an attention head larger than the kernels' shared tiles", () => {
    expect(() => plans.attentionForward(p, p, p, 1, 64, 256, 1, 0.0625, "f32")).toThrow(
      "head size 256 is larger than the CUDA kernels' 128",
    );
    expect(() => plans.attentionBackward(p, p, p, p, p, p, 1, 64, 30, 4, 0.5, "f32", true)).toThrow(
      "C=30 is not a multiple of H=4",
    );
  });
  test("a pointer that is not an address", () => {
    expect(() => plans.add(1.5, p, p, 10)).toThrow(RangeError);
    expect(() => plans.sumSquares(-8, p, 10)).toThrow(RangeError);
  });
});

describe("reduceBroadcast splits dims into kept and reduced", () => {
  test("a bias-like reduction keeps the inner dim", () => {
    expect(reduceShape([1, 1, 50, 768], [0, 0, 0, 1])).toEqual({
      kept: { dims: [1, 1, 1, 768], inStrides: [0, 0, 0, 1], outStrides: [0, 0, 0, 1] },
      reduced: { dims: [1, 1, 1, 50], inStrides: [0, 0, 0, 768] },
      innerReduced: false,
    });
  });
  test("neighbouring reduced dims merge, and so do nested kept dims", () => {
    expect(reduceShape([3, 4, 5, 6], [4, 1, 0, 0])).toEqual({
      kept: { dims: [1, 1, 1, 12], inStrides: [0, 0, 0, 30], outStrides: [0, 0, 0, 1] },
      reduced: { dims: [1, 1, 1, 30], inStrides: [0, 0, 0, 1] },
      innerReduced: true,
    });
  });
  test("kept dims whose out strides do not nest stay apart; size-1 dims vanish", () => {
    expect(reduceShape([3, 1, 5, 6], [0, 77, 1, 5])).toEqual({
      kept: { dims: [1, 1, 5, 6], inStrides: [0, 0, 6, 1], outStrides: [0, 0, 1, 5] },
      reduced: { dims: [1, 1, 1, 3], inStrides: [0, 0, 0, 30] },
      innerReduced: false,
    });
  });
  test("a full reduction to a scalar", () => {
    const shape = reduceShape([2, 3, 4, 5], [0, 0, 0, 0]);
    expect(shape.kept.dims).toEqual([1, 1, 1, 1]);
    expect(shape.reduced).toEqual({ dims: [1, 1, 1, 120], inStrides: [0, 0, 0, 1] });
    expect(shape.innerReduced).toBe(true);
  });
});

test("the PTX build folder is ignored by git", () => {
  const gitignore = join(import.meta.dir, "../../.gitignore");
  expect(existsSync(gitignore)).toBe(true);
  expect(readFileSync(gitignore, "utf8").split("\n")).toContain("ffi/cuda/build/");
});
