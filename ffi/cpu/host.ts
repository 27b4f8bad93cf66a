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
  /** x as bf16 / f16 bits (round to nearest even; f16 overflows to Inf) */
  toBf16(out: Uint16Array, x: Float32Array): void;
  toF16(out: Uint16Array, x: Float32Array): void;
  /** out = (add ? out + : ) the bf16 / f16 values */
  fromBf16(out: Float32Array, bits: Uint16Array, add: boolean): void;
  fromF16(out: Float32Array, bits: Uint16Array, add: boolean): void;
  /** int8 with a power-of-two scale per `block` elements; returns the blocks holding NaN or Inf (scale NaN) */
  encodeI8(q: Int8Array, scales: Float32Array, x: Float32Array, block: number): number;
  decodeI8(out: Float32Array, q: Int8Array, scales: Float32Array, block: number, add: boolean): void;
  /** the k entries of x largest in magnitude (NaN and Inf first), indices ascending */
  topK(idx: Uint32Array, val: Float32Array, x: Float32Array, scratch: Float32Array): void;
  /** out[idx[i]] += val[i] (indices must be < out.length: checked here) */
  scatterAdd(out: Float32Array, idx: Uint32Array, val: Float32Array): void;
  /** r = x - sent where finite, else 0 (error feedback's residual) */
  residual(r: Float32Array, x: Float32Array, sent: Float32Array): void;
  /** out[i] = lut[bytes[i]] (a 256-entry table; bytes at any offset): pixels to inputs */
  lookup(out: Float32Array, bytes: Uint8Array, lut: Float32Array): void;
}

function load(): HostKernels {
  const k = dlopen(ensureKernelLibrary().kernels, {
    mt_add_unaligned_f32: { args: ["ptr", "ptr", "i64"], returns: "void" },
    mt_f32_to_bf16: { args: ["ptr", "ptr", "i64"], returns: "void" },
    mt_f32_to_f16: { args: ["ptr", "ptr", "i64"], returns: "void" },
    mt_bf16_to_f32: { args: ["ptr", "ptr", "i64"], returns: "void" },
    mt_f16_to_f32: { args: ["ptr", "ptr", "i64"], returns: "void" },
    mt_add_bf16: { args: ["ptr", "ptr", "i64"], returns: "void" },
    mt_add_f16: { args: ["ptr", "ptr", "i64"], returns: "void" },
    mt_encode_i8: { args: ["ptr", "ptr", "ptr", "i64", "i64"], returns: "i64" },
    mt_decode_i8: { args: ["ptr", "ptr", "ptr", "i64", "i64", "i32"], returns: "void" },
    mt_topk_f32: { args: ["ptr", "ptr", "ptr", "i64", "i64", "ptr"], returns: "void" },
    mt_scatter_add_f32: { args: ["ptr", "ptr", "ptr", "i64"], returns: "void" },
    mt_residual_f32: { args: ["ptr", "ptr", "ptr", "i64"], returns: "void" },
    mt_lut_u8_f32: { args: ["ptr", "ptr", "ptr", "i64"], returns: "void" },
  }).symbols;
  const same = (what: string, a: { length: number }, b: { length: number }) => {
    if (a.length !== b.length) throw new RangeError(`${what}: ${a.length} outputs for ${b.length} inputs`);
  };
  const blocks = (what: string, n: number, scales: Float32Array, block: number) => {
    if (!(Number.isInteger(block) && block > 0) || scales.length !== Math.ceil(n / block))
      throw new RangeError(`${what}: ${scales.length} scales for ${n} values in blocks of ${block}`);
  };
  return {
    addInto(dst, src) {
      if (src.byteLength !== dst.length * 4)
        throw new RangeError(`addInto: ${src.byteLength} source bytes for ${dst.length} float32`);
      if (dst.length === 0) return;
      k.mt_add_unaligned_f32(addressOf(dst), addressOf(src), dst.length);
    },
    toBf16(out, x) {
      same("toBf16", out, x);
      if (x.length > 0) k.mt_f32_to_bf16(addressOf(out), addressOf(x), x.length);
    },
    toF16(out, x) {
      same("toF16", out, x);
      if (x.length > 0) k.mt_f32_to_f16(addressOf(out), addressOf(x), x.length);
    },
    fromBf16(out, bits, add) {
      same("fromBf16", out, bits);
      if (out.length > 0) (add ? k.mt_add_bf16 : k.mt_bf16_to_f32)(addressOf(out), addressOf(bits), out.length);
    },
    fromF16(out, bits, add) {
      same("fromF16", out, bits);
      if (out.length > 0) (add ? k.mt_add_f16 : k.mt_f16_to_f32)(addressOf(out), addressOf(bits), out.length);
    },
    encodeI8(q, scales, x, block) {
      same("encodeI8", q, x);
      blocks("encodeI8", x.length, scales, block);
      return x.length > 0 ? Number(k.mt_encode_i8(addressOf(q), addressOf(scales), addressOf(x), x.length, block)) : 0;
    },
    decodeI8(out, q, scales, block, add) {
      same("decodeI8", out, q);
      blocks("decodeI8", q.length, scales, block);
      if (q.length > 0) k.mt_decode_i8(addressOf(out), addressOf(q), addressOf(scales), q.length, block, add ? 1 : 0);
    },
    topK(idx, val, x, scratch) {
      same("topK", idx, val);
      const kk = idx.length;
      if (kk < 1 || kk > x.length || scratch.length < x.length)
        throw new RangeError(`topK: k = ${kk} of ${x.length} values (scratch ${scratch.length})`);
      k.mt_topk_f32(addressOf(idx), addressOf(val), addressOf(x), x.length, kk, addressOf(scratch));
    },
    scatterAdd(out, idx, val) {
      same("scatterAdd", idx, val);
      for (let i = 0; i < idx.length; i++)
        if (idx[i]! >= out.length) throw new RangeError(`scatterAdd: index ${idx[i]} outside ${out.length} values`);
      if (idx.length > 0) k.mt_scatter_add_f32(addressOf(out), addressOf(idx), addressOf(val), idx.length);
    },
    residual(r, x, sent) {
      same("residual", r, x);
      same("residual", sent, x);
      if (x.length > 0) k.mt_residual_f32(addressOf(r), addressOf(x), addressOf(sent), x.length);
    },
    lookup(out, bytes, lut) {
      same("lookup", out, bytes);
      if (lut.length !== 256) throw new RangeError(`lookup: a table of ${lut.length} values, not 256`);
      if (out.length > 0) k.mt_lut_u8_f32(addressOf(out), addressOf(bytes), addressOf(lut), out.length);
    },
  };
}

let kernels: HostKernels | undefined;

/** The host kernels, loaded (and the kernel library built if needed) on first use. */
export function hostKernels(): HostKernels {
  kernels ??= load();
  return kernels;
}
