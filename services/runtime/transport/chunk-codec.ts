// Compressed chunks in parameter-server mode, as messages: a push's Chunk carries one
// EncodedGradient of engine/parallel/parameter-server.ts (which encodes and decodes them, with
// the codecs of engine/parallel/compress.ts); a compressed pull (F16/BF16) is a lossy copy of the
// shard's f32 master parameters for the trainer's forward and backward.
//
// On the wire (schemas/common.fbs): BF16/F16 count uint16; I8 count int8 and the chunk's one
// scale; TopK nnz uint32 indices (ascending) then nnz f32 values.
import { hostKernels } from "../../../ffi/cpu/host.ts";
import { type Compression, CompressionError, type ErrorFeedback } from "../../../engine/parallel/compress.ts";
import {
  decodeGradient,
  type EncodedGradient,
  encodeSlice,
  topKSlice,
} from "../../../engine/parallel/parameter-server.ts";
import { type Chunk, DType } from "../../../schemas/messages/parameter-server.ts";
import { BadRequestError } from "../mesh/errors.ts";

export { chunkCodec } from "../../../engine/parallel/parameter-server.ts";

const dtypeOfKind: Record<Compression["kind"], DType> = {
  none: DType.F32,
  bf16: DType.BF16,
  fp16: DType.F16,
  int8: DType.I8,
  topk: DType.TopK,
};

const kindOfDtype = new Map(Object.entries(dtypeOfKind).map(([k, d]) => [d, k as Compression["kind"]]));

/** The chunk dtype a compression pushes. */
export const pushDType = (c: Compression): DType => dtypeOfKind[c.kind];

/** The dtype a compression pulls parameters as: bf16 and fp16 pull a 16-bit copy, the others f32. */
export function pullDType(c: Compression): DType {
  return c.kind === "bf16" ? DType.BF16 : c.kind === "fp16" ? DType.F16 : DType.F32;
}

/** Chunk `id` of a push, carrying `e`. */
export const gradientChunk = (id: number, e: EncodedGradient): Chunk => ({
  id,
  version: 0,
  dtype: dtypeOfKind[e.kind],
  scale: e.scale,
  count: e.count,
  data: e.data,
  ...(e.kind === "topk" ? { nnz: e.nnz } : {}),
});

/**
 * Encodes x (chunk `id`'s gradient, elements [at, at + x.length) of the feedback's vector; x is
 * overwritten with gradient + residual) into a chunk of the feedback codec's dtype.
 */
export const encodeChunk = (ef: ErrorFeedback, id: number, x: Float32Array, at: number): Chunk =>
  gradientChunk(id, encodeSlice(ef, x, at));

/** The TopK chunk `id` (elements [at, at + count) of the vector) of a selection over the whole vector. */
export const topKChunk = (sel: { idx: Uint32Array; values: Float32Array }, id: number, at: number, count: number) =>
  gradientChunk(id, topKSlice(sel, at, count));

/**
 * out = the chunk's values as f32 (out.length === chunk.count). A chunk that does not decode
 * (a dtype no push has, top-k indices out of order or range, an int8 scale that is negative or
 * infinite) is refused with BadRequestError; a NaN int8 scale decodes to NaN (the finiteness
 * check names it).
 */
export function decodeChunk(c: Chunk, out: Float32Array): void {
  const kind = kindOfDtype.get(c.dtype);
  if (kind === undefined)
    throw new BadRequestError(`chunk ${c.id}: dtype ${DType[c.dtype] ?? c.dtype} does not decode`);
  if (out.length !== c.count)
    throw new RangeError(`decodeChunk: ${out.length} outputs for chunk ${c.id} of ${c.count}`);
  try {
    decodeGradient({ kind, count: c.count, data: c.data, scale: c.scale, nnz: c.nnz ?? 0 }, out);
  } catch (e) {
    if (e instanceof CompressionError) throw new BadRequestError(`chunk ${c.id} (${DType[c.dtype]}): ${e.message}`);
    throw e;
  }
}

/** Parameters for a pull reply: x (f32) as `dtype` bytes into dst (F32, F16 or BF16). */
export function fillParams(dtype: DType, x: Float32Array, dst: Uint8Array): void {
  const k = hostKernels();
  if (dtype === DType.F32) {
    dst.set(new Uint8Array(x.buffer, x.byteOffset, x.byteLength));
    return;
  }
  const bits = new Uint16Array(x.length);
  if (dtype === DType.BF16) k.toBf16(bits, x);
  else if (dtype === DType.F16) k.toF16(bits, x);
  else throw new BadRequestError(`parameters are pulled as F32, F16 or BF16, not ${DType[dtype] ?? dtype}`);
  dst.set(new Uint8Array(bits.buffer));
}
