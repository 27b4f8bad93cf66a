// Kernels over host (JavaScript) memory, for code that works on message payloads rather than
// backend slabs: the ring all-reduce adds each received piece into its buffer with one call.
//
// Memory safety: the typed arrays are referenced by the caller's frame for the whole
// synchronous call, and native code keeps no pointer to them afterwards.
import { dlopen, ptr as addressOf } from "bun:ffi";
import { ensureKernelLibrary } from "./build.ts";

export interface HostKernels {
  /** dst[i] += src as float32[i], for i < dst.length; src may start at any byte offset */
  addInto(dst: Float32Array, src: Uint8Array): void;
}

function load(): HostKernels {
  const k = dlopen(ensureKernelLibrary().kernels, {
    mt_add_unaligned_f32: { args: ["ptr", "ptr", "i64"], returns: "void" },
  }).symbols;
  return {
    addInto(dst, src) {
      if (src.byteLength !== dst.length * 4) throw new RangeError(`addInto: ${src.byteLength} source bytes for ${dst.length} float32`);
      if (dst.length === 0) return;
      k.mt_add_unaligned_f32(addressOf(dst), addressOf(src), dst.length);
    },
  };
}

let kernels: HostKernels | undefined;

/** The host kernels, loaded (and the kernel library built if needed) on first use. */
export function hostKernels(): HostKernels {
  kernels ??= load();
  return kernels;
}
