// Numeric helpers for tests: seeded data, relative errors, central finite differences, and
// the backends a parity suite runs on.
import type { Backend } from "../../ffi/backend.ts";
import { CpuBackend } from "../../ffi/cpu/backend.ts";
import { CudaBackend, probeCuda } from "../../ffi/cuda/backend.ts";
import { Rng } from "../../engine/rng.ts";
import { type Tensor } from "../../engine/tensor.ts";
import { Context, type ContextOptions } from "../../engine/context.ts";

let shared: CpuBackend | undefined;
/** One CPU backend for the whole test process (loading the libraries once). */
export function cpu(): CpuBackend {
  shared ??= new CpuBackend();
  return shared;
}

let sharedCuda: CudaBackend | undefined;
const cudaProbe = probeCuda();
/** Why the CUDA tests skip here, or null when a GPU is present. */
export const cudaSkipReason: string | null = cudaProbe.ok ? null : `CUDA tests skipped: ${cudaProbe.reason}`;

export interface TestBackend {
  name: string;
  backend: () => Backend;
}

/** The CPU backend, and the CUDA backend where a driver and a device are present. */
export function testBackends(): TestBackend[] {
  const list: TestBackend[] = [{ name: "cpu", backend: cpu }];
  if (cudaProbe.ok) list.push({ name: "cuda", backend: () => (sharedCuda ??= new CudaBackend()) });
  return list;
}

let active: Backend | undefined;
/** The contexts newContext() made on the backend useBackend() set: a parity suite's tests leave
 *  theirs to it, and on an emulated GPU (one device's memory for every test file of a process)
 *  they are disposed when the suite hands the backend back. */
const madeOnActive: Context[] = [];
/** The backend newContext() uses (the CPU when unset); a parity suite sets it per block. */
export function useBackend(backend: Backend | undefined): void {
  for (const ctx of madeOnActive.splice(0)) ctx.dispose();
  active = backend;
}

export function newContext(seed = 0, options: Omit<ContextOptions, "seed"> = {}): Context {
  const ctx = new Context(active ?? cpu(), { seed, ...options });
  if (active !== undefined) madeOnActive.push(ctx);
  return ctx;
}

export function randn(rng: Rng, n: number, scale = 1): Float64Array {
  const out = new Float64Array(n);
  for (let i = 0; i < n; i++) out[i] = rng.normal() * scale;
  return out;
}

export function randInts(rng: Rng, n: number, limit: number): Int32Array {
  const out = new Int32Array(n);
  for (let i = 0; i < n; i++) out[i] = rng.int(limit);
  return out;
}

export const f32 = (x: Float64Array): Float32Array => Float32Array.from(x);
export const f64 = (x: ArrayLike<number>): Float64Array => Float64Array.from(x);

/** max |a - b| / max |b| (the infinity-norm relative error of a against reference b) */
export function relErr(a: ArrayLike<number>, b: ArrayLike<number>): number {
  if (a.length !== b.length) throw new Error(`relErr: lengths differ (${a.length} vs ${b.length})`);
  let diff = 0;
  let scale = 0;
  for (let i = 0; i < a.length; i++) {
    const d = Math.abs(a[i]! - b[i]!);
    if (!(d <= diff)) diff = d; // also catches NaN
    scale = Math.max(scale, Math.abs(b[i]!));
  }
  return diff / Math.max(scale, 1e-30);
}

/** A 2-byte element type of activations under autocast. */
export type HalfElem = "bf16" | "f16";

/** The bits of x rounded to nearest even in the 2-byte type (bf16 from x's f32 value, as the
 *  kernels round), and their values as numbers. */
export function roundTo16(x: ArrayLike<number>, elem: HalfElem): { bits: Uint16Array; values: Float64Array } {
  const bits = new Uint16Array(x.length);
  const f = new Float32Array(1);
  const u = new Uint32Array(f.buffer);
  for (let i = 0; i < x.length; i++) {
    if (elem === "bf16") {
      f[0] = x[i]!;
      bits[i] = (u[0]! + 0x7fff + ((u[0]! >>> 16) & 1)) >>> 16;
    } else {
      bits[i] = new Uint16Array(new Float16Array([x[i]!]).buffer)[0]!;
    }
  }
  return { bits, values: widen16(bits, elem) };
}

/** 2-byte bits as numbers */
export function widen16(bits: Uint16Array, elem: HalfElem): Float64Array {
  if (elem === "f16") return Float64Array.from(new Float16Array(bits.buffer, bits.byteOffset, bits.length));
  const u = Uint32Array.from(bits, (b) => b << 16);
  return Float64Array.from(new Float32Array(u.buffer));
}

/** Central differences of a scalar function at x, one coordinate at a time. */
export function finiteDiff(f: (x: Float64Array) => number, x: Float64Array, h = 1e-6): Float64Array {
  const g = new Float64Array(x.length);
  const xp = Float64Array.from(x);
  for (let i = 0; i < x.length; i++) {
    const v = xp[i]!;
    xp[i] = v + h;
    const fp = f(xp);
    xp[i] = v - h;
    const fm = f(xp);
    xp[i] = v;
    g[i] = (fp - fm) / (2 * h);
  }
  return g;
}

/** sum(out * w): the scalar whose gradient with respect to out is w */
export function dot(out: ArrayLike<number>, w: ArrayLike<number>): number {
  let s = 0;
  for (let i = 0; i < out.length; i++) s += out[i]! * w[i]!;
  return s;
}

/** An f32 leaf tensor that requires grad. */
export function leaf(ctx: Context, data: Float64Array, shape: number[], requiresGrad = true): Tensor {
  const t = ctx.fromArray(f32(data), shape);
  t.requiresGrad = requiresGrad;
  return t;
}

export function grad64(t: Tensor): Float64Array {
  const g = t.grad;
  if (g === null) throw new Error("tensor has no gradient");
  return f64(g.toFloat32());
}

/**
 * Floats a cast to a 2-byte format must get right: signed zeros, f16's largest value (65504) and
 * either side of its overflow threshold (65520 ties to Infinity), f16's smallest normal, its
 * smallest subnormal and either side of half of it, f32's extremes, the infinities, NaN, bf16
 * ties that round to even (1.00390625, 1.01171875), and values bf16 must round (256.5, 257.5).
 */
export const castSpecials: readonly number[] = [
  0,
  -0,
  1,
  -1,
  0.1,
  65504,
  65519,
  65520,
  1e6,
  -1e6,
  6.1e-5,
  6.0e-5,
  5.96e-8,
  2.98e-8,
  2.99e-8,
  1e-10,
  3.4e38,
  -3.4e38,
  Infinity,
  -Infinity,
  NaN,
  1.00390625,
  1.01171875,
  256.5,
  257.5,
];

/** Every (transA, transB) a GEMM takes. */
export const transposePairs: [boolean, boolean][] = [
  [false, false],
  [false, true],
  [true, false],
  [true, true],
];
