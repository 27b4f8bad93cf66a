// Buffers of the kernel tests under host emulation (test/ffi/cuda-emulation.test.ts): every
// buffer has a CPU copy and an emulator copy, in the CPU backend's memory; activations in f32 or
// a 2-byte type; the plans' scratch, poisoned before each scalar plan.
import type { Allocation, Ptr } from "../../ffi/backend.ts";
import { scratchBytes } from "../../ffi/cuda/kernels.ts";
import { cpu } from "./numeric.ts";

// ---- memory: every buffer has a CPU copy and an emulator copy -------------------------------------

export const be = cpu();
export const live: Allocation[] = [];
export let scratch: Allocation | undefined;
// the scratch bytes the plans may use: all of it (split column sums keep partials to its end)
export const scratchUsedBytes = scratchBytes;

export type HostArray = Float32Array | Int32Array | Uint16Array;

export function devAlloc(data: HostArray): Ptr {
  const a = be.alloc(Math.max(8, data.byteLength));
  live.push(a);
  be.upload(a.ptr, data);
  return a.ptr;
}

/** [cpu, emulator] copies of data */
export function twin(data: HostArray): [Ptr, Ptr] {
  return [devAlloc(data), devAlloc(data)];
}

/** [cpu, emulator] outputs of n floats, NaN so that an element the kernel never writes fails */
export const outF32 = (n: number): [Ptr, Ptr] => twin(new Float32Array(n).fill(NaN));
export const outU16 = (n: number): [Ptr, Ptr] => twin(new Uint16Array(n).fill(0xffff));

export function readF32(p: Ptr, n: number): Float32Array {
  const out = new Float32Array(n);
  be.download(p, out);
  return out;
}
export function readU16(p: Ptr, n: number): Uint16Array {
  const out = new Uint16Array(n);
  be.download(p, out);
  return out;
}

// ---- buffers of activations: f32 or a 2-byte type (ffi/ops.ts `elem`) ------------------------------

export type Elem = "f32" | "bf16" | "f16";
/** The activation types the kernel suites run: f32 and bf16 (f16 takes the same paths, through
 *  conversions the cast tests cover bit by bit). */
export const elems = ["f32", "bf16"] as const;

/** data rounded to elem, as a buffer of that type stores it (f32, or 2-byte bits) */
export function asElem(data: Float32Array, elem: Elem): Float32Array | Uint16Array {
  if (elem === "f32") return data;
  const wide = devAlloc(data);
  const [narrow] = outU16(data.length);
  if (elem === "bf16") be.castF32ToBF16(narrow, wide, data.length);
  else be.castF32ToF16(narrow, wide, data.length);
  return readU16(narrow, data.length);
}
export const twinElem = (data: Float32Array, elem: Elem): [Ptr, Ptr] => twin(asElem(data, elem));
/** [cpu, emulator] outputs of n elements of elem, NaN */
export const outElem = (n: number, elem: Elem): [Ptr, Ptr] => (elem === "f32" ? outF32(n) : outU16(n));
/** n elements of elem, as f32 */
export function readElem(p: Ptr, n: number, elem: Elem): Float32Array {
  if (elem === "f32") return readF32(p, n);
  const [wide] = outF32(n);
  if (elem === "bf16") be.castBF16ToF32(wide, p, n);
  else be.castF16ToF32(wide, p, n);
  return readF32(wide, n);
}
/** A tolerance for results stored in elem: two f32 results a rounding apart may round to
 *  neighbouring 2-byte values (bf16 keeps 8 bits, f16 11). */
export const elemTol = (elem: Elem, tol: number): number =>
  elem === "bf16" ? Math.max(tol, 2 ** -7) : elem === "f16" ? Math.max(tol, 2 ** -10) : tol;
/** each case once per activation type */
export const byElem = <T extends readonly unknown[]>(cases: readonly T[]): [...T, Elem][] =>
  cases.flatMap((c) => elems.map((e): [...T, Elem] => [...c, e]));

/** Scratch contents are unspecified: poison them before each scalar plan. */
export function poisonedScratch(): Ptr {
  be.upload(scratch!.ptr, new Uint8Array(scratchUsedBytes).fill(0xff));
  return scratch!.ptr;
}
export function scratchI64(): number {
  const out = new BigInt64Array(1);
  be.download(scratch!.ptr, out);
  return Number(out[0]);
}
export function scratchF64(): number {
  const out = new Float64Array(1);
  be.download(scratch!.ptr, out);
  return out[0]!;
}

/** The plans' scratch, allocated before the suite and freed after it. */
export function openScratch(): void {
  scratch = be.alloc(scratchBytes);
}
export function freeScratch(): void {
  if (scratch !== undefined) be.free(scratch);
}
/** Frees the buffers a test allocated. */
export function freeLive(): void {
  for (const a of live.splice(0)) be.free(a);
}
