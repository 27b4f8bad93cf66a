// Kernel benchmark: every memory-bound kernel of a backend at a size well beyond the caches,
// reported as achieved GB/s (bytes each call must read + write) against the backend's own copy
// (a parallel memcpy on the CPU, cuMemcpyDtoD on CUDA) over the same byte count, measured in
// the same run and interleaved with it. On CUDA it also prints the host-side cost of one
// kernel call (our argument marshalling + cuLaunchKernel), the floor of a small op's time.
//
//   bun run bench kernels [--device auto|cpu|cuda] [--elems N] [--reps N] [--json-only]
import type { Backend, Ptr } from "../ffi/backend.ts";
import { parseBenchArgs, positiveInt } from "./args.ts";
import { median, printTable, round, significant } from "./table.ts";
import { CpuBackend } from "../ffi/cpu/backend.ts";
import { deviceChoices, type DeviceChoice, openBackend } from "../ffi/select.ts";
import { ConfigError } from "../ffi/errors.ts";
import { Rng } from "../engine/rng.ts";

export interface KernelBenchResult {
  kernel: string;
  bytes_per_call: number;
  ms: number;
  gb_per_s: number;
  memcpy_gb_per_s: number;
  ratio: number;
}

interface Case {
  name: string;
  /** bytes the kernel must read and write */
  bytes: number;
  run: () => void;
}

/** Whole-number shapes of every case for n elements (n a multiple of 2^18): rows of GPT-2's
 *  width, cross-entropy rows of a 1024 vocabulary, a (B,T,12,64) transpose. */
export function kernelShapes(n: number) {
  if (!Number.isSafeInteger(n) || n <= 0 || n % (1 << 18) !== 0)
    throw new ConfigError(`--elems must be a positive multiple of ${1 << 18}, got ${n}`);
  const C = 768; // a GPT-2 width: rows of a few KB
  const N = Math.floor(n / C);
  const V = 1024; // cross-entropy / embedding vocabulary
  const T = 256; // the transpose's sequence length
  const B = Math.floor(N / T);
  return { C, N, NC: N * C, V, NV: n / V, T, B, BTC: B * T * C };
}

function cases(
  be: Backend,
  n: number,
  buf: (elems: number) => Ptr,
  ints: (count: number, limit: number) => Ptr,
): Case[] {
  const [x, y, z, w] = [buf(n), buf(n), buf(n), buf(n)];
  const half = buf(n / 2);
  const { C, N, NC, V, NV, T, B, BTC } = kernelShapes(n);
  const vec = buf(C);
  const vec2 = buf(C);
  const rowStats = buf(N);
  const rowStats2 = buf(N);
  const targets = ints(NV, V);
  const table = buf(V * C);
  const ids = ints(N, V);
  const lossScalar = buf(1);
  be.fill(lossScalar, 1, 1);
  const f = 4;
  return [
    { name: "add", bytes: 3 * n * f, run: () => be.add(z, x, y, n) },
    { name: "axpy", bytes: 3 * n * f, run: () => be.axpy(y, x, n, 0.5) },
    { name: "biasAdd (N,768)", bytes: 2 * NC * f, run: () => be.biasAdd(y, x, vec, N, C, "f32") },
    { name: "biasBackward (N,768)", bytes: NC * f, run: () => be.biasBackward(vec, x, N, C, "f32") },
    { name: "reluForward", bytes: 2 * n * f, run: () => be.reluForward(y, x, n, "f32") },
    { name: "reluBackward", bytes: 4 * n * f, run: () => be.reluBackward(z, x, y, n, "f32") },
    { name: "geluForward", bytes: 2 * n * f, run: () => be.geluForward(y, x, n, "f32") },
    { name: "geluBackward", bytes: 4 * n * f, run: () => be.geluBackward(z, x, y, n, "f32") },
    { name: "biasGeluForward (N,768)", bytes: 3 * NC * f, run: () => be.biasGeluForward(y, z, vec, N, C, "f32") },
    { name: "dropoutForward", bytes: 2 * n * f, run: () => be.dropoutForward(y, x, n, 0.1, 7n) },
    {
      name: "layerNormForward (N,768)",
      bytes: 2 * NC * f,
      run: () => be.layerNormForward(y, rowStats, rowStats2, x, vec, vec2, N, C, 1e-5, "f32"),
    },
    {
      name: "residualLayerNormForward (N,768)",
      bytes: 4 * NC * f,
      run: () => be.residualLayerNormForward(z, y, rowStats, rowStats2, x, w, vec, vec2, N, C, 1e-5, "f32"),
    },
    {
      name: "layerNormBackward (N,768)",
      bytes: 4 * NC * f,
      run: () => be.layerNormBackward(z, vec, vec2, y, x, vec, rowStats, rowStats2, N, C, "f32"),
    },
    {
      name: "crossEntropyForward (N,1024)",
      bytes: n * f,
      run: () => be.crossEntropyForward(lossScalar, rowStats, rowStats2, x, targets, NV, V, "f32"),
    },
    {
      name: "crossEntropyBackward (N,1024) in place",
      bytes: 2 * n * f,
      run: () => be.crossEntropyBackward(z, z, rowStats2, targets, lossScalar, NV, V, false, "f32"),
    },
    { name: "embeddingForward (N,768)", bytes: 2 * NC * f, run: () => be.embeddingForward(y, ids, table, N, C, V) },
    { name: "embeddingBackward (N,768)", bytes: 3 * NC * f, run: () => be.embeddingBackward(table, ids, x, N, C) },
    {
      name: "transpose (B,T,12,64)->(B,12,T,64)",
      bytes: 2 * BTC * f,
      run: () => be.stridedCopy(y, [12 * T * 64, T * 64, 64, 1], x, [T * C, 64, C, 1], [B, 12, T, 64], false),
    },
    { name: "sgdStep (momentum)", bytes: 5 * n * f, run: () => be.sgdStep(x, y, z, n, 1e-3, 0.9, 0, 0, false, false) },
    {
      name: "adamwStep",
      bytes: 7 * n * f,
      run: () => be.adamwStep(x, y, z, w, 0, n, n, 1e-3, 0.9, 0.999, 1e-8, 0.01, 0.5, 0.5, 1),
    },
    { name: "sumSquares", bytes: n * f, run: () => be.sumSquares(x, n) },
    { name: "castF32ToBF16", bytes: (n / 2) * (4 + 2), run: () => be.castF32ToBF16(half, x, n / 2) },
    { name: "castF32ToF16", bytes: (n / 2) * (4 + 2), run: () => be.castF32ToF16(half, x, n / 2) },
    { name: "zero", bytes: n * f, run: () => be.zero(z, n * f) },
  ];
}

export function runKernelBench(argv: string[]): KernelBenchResult[] {
  const values = parseBenchArgs(argv, {
    elems: { type: "string", default: String(1 << 23) },
    reps: { type: "string", default: "15" },
    "json-only": { type: "boolean", default: false },
    device: { type: "string", default: "auto" },
  });
  const device = values.device as DeviceChoice;
  if (!deviceChoices.includes(device))
    throw new ConfigError(`--device must be one of ${deviceChoices.join(", ")}, got ${values.device}`);
  const n = positiveInt("elems", values.elems, 1 << 18);
  kernelShapes(n);
  const reps = positiveInt("reps", values.reps);
  const { backend: be, why } = openBackend(device);
  const rng = new Rng(1);
  const allocations: Ptr[] = [];
  const buf = (elems: number) => {
    const a = be.alloc(elems * 4);
    be.upload(
      a.ptr,
      Float32Array.from({ length: elems }, () => rng.normal() * 0.5),
    );
    allocations.push(a.ptr);
    return a.ptr;
  };
  const ints = (count: number, limit: number) => {
    const a = be.alloc(count * 4);
    be.upload(
      a.ptr,
      Int32Array.from({ length: count }, () => rng.int(limit)),
    );
    allocations.push(a.ptr);
    return a.ptr;
  };
  const src = be.alloc(8 * n * 4);
  const dst = be.alloc(8 * n * 4);
  const rows: KernelBenchResult[] = [];
  for (const c of cases(be, n, buf, ints)) {
    // memcpy moves bytes/2 in and bytes/2 out: the same traffic as the kernel
    const copyBytes = Math.round(c.bytes / 2);
    const kernelMs: number[] = [];
    const copyMs: number[] = [];
    c.run();
    be.copy(dst.ptr, src.ptr, copyBytes);
    for (let r = 0; r < reps; r++) {
      kernelMs.push(timed(be, c.run));
      copyMs.push(timed(be, () => be.copy(dst.ptr, src.ptr, copyBytes)));
    }
    const ms = median(kernelMs);
    const gbps = c.bytes / ms / 1e6;
    const copyGbps = (2 * copyBytes) / median(copyMs) / 1e6;
    rows.push({
      kernel: c.name,
      bytes_per_call: c.bytes,
      ms: round(ms, 3),
      gb_per_s: significant(gbps),
      memcpy_gb_per_s: significant(copyGbps),
      ratio: significant(gbps / copyGbps),
    });
  }
  const launchUs = be.name === "cpu" ? null : launchOverheadUs(be, buf(1));
  if (!values["json-only"]) {
    const threads = be instanceof CpuBackend ? `, ${be.threads} threads` : "";
    console.log(
      `kernel benchmark: ${why}${threads}, ${n} f32 elements per tensor, median of ${reps}; ` +
        "ratio = achieved GB/s / the backend's copy GB/s on the same bytes",
    );
    printTable(rows, ["kernel", "bytes_per_call", "ms", "gb_per_s", "memcpy_gb_per_s", "ratio"]);
    if (launchUs !== null)
      console.log(`host cost of one kernel call (add of 1 element, 10000 calls queued): ${round(launchUs, 2)} us`);
  }
  console.log(
    JSON.stringify({
      bench: "kernels",
      device: be.name,
      elems: n,
      results: rows,
      ...(launchUs === null ? {} : { launch_us: round(launchUs, 3) }),
    }),
  );
  be.dispose();
  return rows;
}

/** ms of fn, from an idle device to an idle device (a GPU backend queues work) */
export function timed(be: Backend, fn: () => void): number {
  be.synchronize();
  const t = performance.now();
  fn();
  be.synchronize();
  return performance.now() - t;
}

/** Microseconds the host spends per kernel call: many tiny launches queued back to back. */
function launchOverheadUs(be: Backend, x: Ptr): number {
  const calls = 10_000;
  be.synchronize();
  const t = performance.now();
  for (let i = 0; i < calls; i++) be.add(x, x, x, 1);
  const hostMs = performance.now() - t;
  be.synchronize();
  return (hostMs * 1000) / calls;
}

if (import.meta.main) runKernelBench(process.argv.slice(2));
