// The host CUDA emulator as the kernel tests drive it (test/ffi/cuda-emulation.test.ts): its
// launch entry, the kernels' arguments as its 64-bit slots, the grid modes every plan runs in,
// and the comparisons of its results with the CPU backend's.
import { expect } from "bun:test";
import { dlopen, ptr } from "bun:ffi";
import type { Dims4 } from "../../ffi/backend.ts";
import { kernelSpecs, type KernelName, type Launch } from "../../ffi/cuda/kernels.ts";
import { relErr } from "./numeric.ts";

export interface Emulator {
  launch(
    name: Uint8Array,
    grid: number,
    bx: number,
    by: number,
    bz: number,
    slots: BigUint64Array,
    gridCap: number,
  ): number;
}

export function openEmulator(path: string): Emulator {
  const lib = dlopen(path, {
    emu_launch: { args: ["ptr", "u32", "u32", "u32", "u32", "ptr", "u32"], returns: "i32" },
  });
  return {
    launch: (name, grid, bx, by, bz, slots, gridCap) =>
      lib.symbols.emu_launch(ptr(name), grid, bx, by, bz, ptr(slots), gridCap),
  };
}

/** The kernel arguments as 64-bit slots, decoded by type on the C++ side (emu_from_slot). */
export function encodeArgs(launch: Launch): BigUint64Array {
  const params = kernelSpecs[launch.kernel].params;
  const slots = new BigUint64Array(Math.max(1, params.length));
  const f32Bits = new Uint32Array(1);
  params.forEach((type, i) => {
    const arg = launch.args[i]!;
    if (type === "f32") {
      new Float32Array(f32Bits.buffer)[0] = arg as number;
      slots[i] = BigInt(f32Bits[0]!);
    } else {
      slots[i] = BigInt.asUintN(64, BigInt(arg));
    }
  });
  return slots;
}

// Grid modes: as planned, and capped at a few blocks so every grid-stride loop runs several
// rounds (elementwise kernels past 3*256 items, warp-row kernels past 24 rows, column kernels
// past 96 columns). Block-partial kernels are never capped: their grid is the partial count that
// the second pass reads, one partial per block (reduce.cu).
export const gridModes = [
  { name: "grid as planned", gridCap: 0 },
  { name: "grid capped at 3 blocks", gridCap: 3 },
] as const;
export const uncappedKernels = new Set<KernelName>([
  "mt_sum_squares_partial_f32",
  "mt_count_nonfinite_partial_f32",
  "mt_count_correct_partial_f32",
]);

// ---- comparisons ---------------------------------------------------------------------------------

/** The first element where emu and cpu differ in value (NaN matches any NaN), or null. */
export function firstMismatch(emu: ArrayLike<number>, ref: ArrayLike<number>): string | null {
  if (emu.length !== ref.length) return `lengths ${emu.length} vs ${ref.length}`;
  for (let i = 0; i < ref.length; i++) {
    const e = emu[i]!,
      c = ref[i]!;
    if (!(e === c || (Number.isNaN(e) && Number.isNaN(c))) || Object.is(e, -0) !== Object.is(c, -0)) {
      return `element ${i}: emulator ${e}, cpu ${c}`;
    }
  }
  return null;
}

export function expectExact(what: string, emu: ArrayLike<number>, ref: ArrayLike<number>): void {
  expect({ what, mismatch: firstMismatch(emu, ref) }).toEqual({ what, mismatch: null });
}

/** GELU is 0.5 x (1 + tanh(u)): where tanh is near -1 (x below about -2) the CPU kernels' fast
 *  tanh and glibc's (in the emulator) differ by about an ulp of 1, which becomes an absolute
 *  difference of about |x| 6e-8 in a result that may be far smaller (at x = -5.13 one gives 0, the
 *  other -1.5e-7). Compare on a scale of at least this, not relative to such a tiny result. */
export const geluScaleMin = 1e-2;

/** Non-finite elements must match exactly; the finite rest within relErr <= tol, relative to the
 *  largest |ref|, or to scaleMin where every |ref| is smaller. */
export function expectClose(
  what: string,
  emu: ArrayLike<number>,
  ref: ArrayLike<number>,
  tol = 1e-5,
  scaleMin = 0,
): void {
  expect(emu.length).toBe(ref.length);
  const e: number[] = [],
    c: number[] = [];
  let nonFinite: string | null = null;
  for (let i = 0; i < ref.length; i++) {
    if (Number.isFinite(emu[i]!) && Number.isFinite(ref[i]!)) {
      e.push(emu[i]!);
      c.push(ref[i]!);
    } else if (nonFinite === null && firstMismatch([emu[i]!], [ref[i]!]) !== null) {
      nonFinite = `element ${i}: emulator ${emu[i]}, cpu ${ref[i]}`;
    }
  }
  expect({ what, nonFinite }).toEqual({ what, nonFinite: null });
  const largest = c.reduce((m, v) => Math.max(m, Math.abs(v)), 0);
  const err = largest >= scaleMin ? relErr(e, c) : relErr(e, c) * (Math.max(largest, 1e-30) / scaleMin);
  expect({ what, withinTol: err <= tol ? true : `relErr ${err} > ${tol}` }).toEqual({ what, withinTol: true });
}

export const bitsOf = (x: Float32Array): Uint32Array => new Uint32Array(x.buffer, x.byteOffset, x.length);
export const prod = (d: Dims4): number => d[0] * d[1] * d[2] * d[3];
/** elements a strided view over dims spans */
export const extent = (d: Dims4, s: Dims4): number => 1 + d.reduce((acc, n, k) => acc + s[k]! * (n - 1), 0);
