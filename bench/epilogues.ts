// GEMM epilogue benchmark (CUDA): a linear layer's GEMM with its bias, bias + GELU, bias
// gradient, or the GELU's gradient fused by cuBLASLt, against the same GEMM on cublasGemmEx
// followed by the layer kernels (biasAdd, biasGeluForward, biasBackward, geluBackward), at GPT-2
// small's layer shapes under bf16 autocast.
// Two backends in one process, one per way, timed interleaved (one call of each in turn, each
// from an idle GPU to an idle GPU), medians; the fused backend's line says which calls cuBLASLt
// actually took. This is the measurement behind the CUDA backend's default (epilogues fused).
//
//   bun run bench epilogues [--rows N] [--width C] [--reps N] [--json-only]
import type { Allocation, Backend, GemmEpilogue, GemmOutput } from "../ffi/backend.ts";
import { Rng } from "../engine/rng.ts";
import { CudaBackend, probeCuda } from "../ffi/cuda/backend.ts";
import { NativeLibraryError } from "../ffi/errors.ts";
import { parseBenchArgs, positiveInt } from "./args.ts";
import { timed } from "./kernels.ts";
import { median, printTable, round, significant } from "./table.ts";

export interface EpilogueBenchResult {
  layer: string;
  epilogue: GemmEpilogue["kind"];
  gemm_tflop: number;
  kernels_ms: number;
  fused_ms: number;
  speedup: number;
}

interface Layer {
  name: string;
  /** input features, output features */
  I: number;
  O: number;
  out: GemmOutput;
  gelu: boolean;
  /** its input is a GELU's output: the input gradient's GEMM applies the GELU's gradient */
  geluInput: boolean;
}

/** GPT-2's four linear layers of a block at width C: which outputs are bf16 follows the model */
const layersOf = (C: number): Layer[] => [
  { name: `qkv ${C}->${3 * C}`, I: C, O: 3 * C, out: "bf16", gelu: false, geluInput: false },
  { name: `attn proj ${C}->${C}`, I: C, O: C, out: "f32", gelu: false, geluInput: false },
  { name: `fc ${C}->${4 * C}`, I: C, O: 4 * C, out: "bf16", gelu: true, geluInput: false },
  { name: `mlp proj ${4 * C}->${C}`, I: 4 * C, O: C, out: "f32", gelu: false, geluInput: true },
];

/** Buffers of one layer on one backend, and its forward and weight-gradient calls (and, after a
 *  GELU, the input gradient's call with the GELU's gradient). */
function layerCalls(be: Backend, N: number, l: Layer) {
  const allocations: Allocation[] = [];
  const alloc = (bytes: number) => {
    const a = be.alloc(bytes);
    allocations.push(a);
    return a.ptr;
  };
  const rng = new Rng(l.I + l.O);
  // random bf16 (the top half of random f32s): tensor cores draw less power on zeros
  const random = (elems: number) => {
    const p = alloc(elems * 2);
    const f = new Float32Array(elems).map(() => rng.normal());
    be.upload(
      p,
      new Uint16Array(f.buffer).filter((_, i) => i % 2 === 1),
    );
    return p;
  };
  const x = random(N * l.I);
  const w = random(l.O * l.I);
  const bias = alloc(l.O * 4);
  const outBytes = l.out === "f32" ? 4 : 2;
  const out = alloc(N * l.O * outBytes);
  const pre = alloc(N * l.O * outBytes);
  const dpre = random(N * l.O);
  const dw = alloc(l.O * l.I * 4);
  const dbias = alloc(l.O * 4);
  const dx = alloc(N * l.I * 2);
  const inputPre = random(N * l.I);
  // a bf16 output's bias also in bf16, as a linear layer passes its parameter's weight copy
  const biasCopy = l.out === "f32" ? undefined : random(l.O);
  const forward: GemmEpilogue = l.gelu ? { kind: "biasGelu", bias, pre, biasCopy } : { kind: "bias", bias, biasCopy };
  const fwd = () =>
    be.gemm({
      input: "bf16",
      output: l.out,
      transB: true,
      M: N,
      N: l.O,
      K: l.I,
      A: x,
      lda: l.I,
      B: w,
      ldb: l.I,
      C: out,
      ldc: l.O,
      epilogue: forward,
    });
  const wgrad = () =>
    be.gemm({
      input: "bf16",
      transA: true,
      M: l.O,
      N: l.I,
      K: N,
      A: dpre,
      lda: l.O,
      B: x,
      ldb: l.I,
      beta: 1,
      C: dw,
      ldc: l.I,
      epilogue: { kind: "biasGrad", dbias },
    });
  // dx (N,I) = gelu'(inputPre) * (dpre (N,O) W (O,I))
  const dgrad = () =>
    be.gemm({
      input: "bf16",
      output: "bf16",
      M: N,
      N: l.I,
      K: l.O,
      A: dpre,
      lda: l.O,
      B: w,
      ldb: l.I,
      C: dx,
      ldc: l.I,
      epilogue: { kind: "dgelu", pre: inputPre },
    });
  return {
    forward: { kind: forward.kind, run: fwd },
    wgrad: { kind: "biasGrad" as const, run: wgrad },
    dgrad: l.geluInput ? { kind: "dgelu" as const, run: dgrad } : null,
    free: () => {
      for (const a of allocations) be.free(a);
    },
  };
}

/** Each layer's forward and weight-gradient call on both backends, timed interleaved. */
export function compareEpilogues(
  kernels: CudaBackend,
  fused: CudaBackend,
  N: number,
  C: number,
  reps: number,
): EpilogueBenchResult[] {
  const rows: EpilogueBenchResult[] = [];
  for (const l of layersOf(C)) {
    const a = layerCalls(kernels, N, l);
    const b = layerCalls(fused, N, l);
    for (const which of ["forward", "wgrad", "dgrad"] as const) {
      const [k, f] = [a[which], b[which]];
      if (k === null || f === null) continue;
      for (let w = 0; w < 3; w++) {
        k.run();
        f.run();
      }
      const km: number[] = [];
      const fm: number[] = [];
      for (let r = 0; r < reps; r++) {
        km.push(timed(kernels, k.run));
        fm.push(timed(fused, f.run));
      }
      const [kms, fms] = [median(km), median(fm)];
      rows.push({
        layer: l.name,
        epilogue: f.kind,
        gemm_tflop: significant((2 * N * l.I * l.O) / 1e12),
        kernels_ms: round(kms, 3),
        fused_ms: round(fms, 3),
        speedup: significant(kms / fms),
      });
    }
    a.free();
    b.free();
  }
  return rows;
}

export function runEpilogueBench(argv: string[]): EpilogueBenchResult[] {
  const values = parseBenchArgs(argv, {
    rows: { type: "string", default: "8192" },
    width: { type: "string", default: "768" },
    reps: { type: "string", default: "20" },
    "json-only": { type: "boolean", default: false },
  });
  const N = positiveInt("rows", values.rows);
  const C = positiveInt("width", values.width);
  const reps = positiveInt("reps", values.reps);
  const probe = probeCuda();
  if (!probe.ok)
    throw new NativeLibraryError(
      `bench epilogues needs a GPU (on a CPU epilogues are always the kernels): ${probe.reason}`,
    );
  const kernels = new CudaBackend({ epilogues: "kernels" });
  const fused = new CudaBackend({ epilogues: "cublaslt" });
  try {
    const rows = compareEpilogues(kernels, fused, N, C, reps);
    const device = `${fused.deviceName}, ${N} rows, bf16 inputs`;
    if (!values["json-only"]) {
      console.log(`GEMM epilogue benchmark: ${device}; median of ${reps}, interleaved`);
      console.log(`kernels: ${kernels.describeEpilogues()}`);
      console.log(`fused:   ${fused.describeEpilogues()}`);
      printTable(rows, ["layer", "epilogue", "gemm_tflop", "kernels_ms", "fused_ms", "speedup"]);
      const [k, f] = [rows.reduce((s, r) => s + r.kernels_ms, 0), rows.reduce((s, r) => s + r.fused_ms, 0)];
      console.log(
        `a block's linear layers: ${round(k, 3)} ms as GEMM + kernels, ${round(f, 3)} ms fused (x${significant(k / f)})`,
      );
    }
    console.log(JSON.stringify({ bench: "epilogues", device, fused: fused.describeEpilogues(), results: rows }));
    return rows;
  } finally {
    kernels.dispose();
    fused.dispose();
  }
}

if (import.meta.main) runEpilogueBench(process.argv.slice(2));
