// Compressed chunks in parameter-server mode (engine/parallel/compress.ts has the codecs): a
// trainer's push encodes each chunk of its gradient with error feedback, a shard decodes it to
// f32 before anything is applied; a compressed pull (F16/BF16) is a lossy copy of the shard's
// f32 master parameters for the trainer's forward and backward.
//
// On the wire (schemas/common.fbs): BF16/F16 count uint16; I8 count int8 and the chunk's one
// scale; TopK nnz uint32 indices (ascending) then nnz f32 values.
import { hostKernels } from "../../../ffi/cpu/host.ts";
import {
  checkIndices,
  checkScales,
  Codec,
  type Compression,
  CompressionError,
  type ErrorFeedback,
} from "../../../engine/parallel/compress.ts";
import { type Chunk, DType } from "../../../schemas/messages.ts";
import { BadRequestError } from "../mesh/errors.ts";

/** The chunk dtype a compression pushes. */
export function pushDType(c: Compression): DType {
  switch (c.kind) {
    case "none":
      return DType.F32;
    case "bf16":
      return DType.BF16;
    case "fp16":
      return DType.F16;
    case "int8":
      return DType.I8;
    case "topk":
      return DType.TopK;
  }
}

/** The dtype a compression pulls parameters as: bf16 and fp16 pull a 16-bit copy, the others f32. */
export function pullDType(c: Compression): DType {
  return c.kind === "bf16" ? DType.BF16 : c.kind === "fp16" ? DType.F16 : DType.F32;
}

/** A codec for one job's chunks: int8 takes one scale per chunk. */
export const chunkCodec = (c: Compression, chunkElems: number): Codec => new Codec(c, Math.max(1, chunkElems));

/**
 * Encodes x (chunk `id`'s gradient, elements [at, at + x.length) of the feedback's vector; x is
 * overwritten with gradient + residual) into a chunk of the feedback codec's dtype.
 */
export function encodeChunk(ef: ErrorFeedback, id: number, x: Float32Array, at: number): Chunk {
  const codec = ef.codec;
  const n = x.length;
  const slot = new Uint8Array(codec.slotBytes(n));
  ef.encode(x, slot, at);
  const dtype = pushDType(codec.compression);
  const chunk: Chunk = { id, version: 0, dtype, scale: 1, count: n, data: slot };
  switch (dtype) {
    case DType.BF16:
    case DType.F16:
      return { ...chunk, data: slot.subarray(0, 2 * n) };
    case DType.I8:
      return {
        ...chunk,
        scale: n > 0 ? new Float32Array(slot.buffer, 0, 1)[0]! : 0,
        data: slot.subarray(4 * codec.scaleCount(n), 4 * codec.scaleCount(n) + n),
      };
    case DType.TopK:
      return { ...chunk, nnz: n > 0 ? codec.keep(n) : 0 };
    default:
      return chunk;
  }
}

/** The first position of the ascending `idx` whose index is >= at. */
function lowerBound(idx: Uint32Array, at: number): number {
  let lo = 0,
    hi = idx.length;
  while (lo < hi) {
    const mid = (lo + hi) >>> 1;
    if (idx[mid]! < at) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

/**
 * The TopK chunk `id` (elements [at, at + count) of the vector) of a selection over the whole
 * vector (ErrorFeedback.selectTopK): its entries, however many fall in the chunk (0 included).
 */
export function topKChunk(
  sel: { idx: Uint32Array; values: Float32Array },
  id: number,
  at: number,
  count: number,
): Chunk {
  const lo = lowerBound(sel.idx, at),
    hi = lowerBound(sel.idx, at + count);
  const nnz = hi - lo;
  const data = new Uint8Array(8 * nnz);
  const idx = new Uint32Array(data.buffer, 0, nnz);
  for (let j = 0; j < nnz; j++) idx[j] = sel.idx[lo + j]! - at;
  new Float32Array(data.buffer, 4 * nnz, nnz).set(sel.values.subarray(lo, hi));
  return { id, version: 0, dtype: DType.TopK, scale: 1, count, data, nnz };
}

/** Dense f16/bf16 data as a Uint16Array (copied when the payload is not 2-byte aligned). */
const u16Of = (data: Uint8Array, n: number): Uint16Array =>
  data.byteOffset % 2 === 0
    ? new Uint16Array(data.buffer, data.byteOffset, n)
    : new Uint16Array(data.slice().buffer, 0, n);

/**
 * out = the chunk's values as f32 (out.length === chunk.count). A chunk that does not decode
 * (top-k indices out of order or range, an int8 scale that is negative or infinite) is refused
 * with BadRequestError; a NaN int8 scale decodes to NaN (the finiteness check names it).
 */
export function decodeChunk(c: Chunk, out: Float32Array): void {
  const k = hostKernels();
  const n = c.count;
  if (out.length !== n) throw new RangeError(`decodeChunk: ${out.length} outputs for chunk ${c.id} of ${n}`);
  try {
    switch (c.dtype) {
      case DType.F32:
        new Uint8Array(out.buffer, out.byteOffset, 4 * n).set(c.data);
        return;
      case DType.BF16:
        k.fromBf16(out, u16Of(c.data, n), false);
        return;
      case DType.F16:
        k.fromF16(out, u16Of(c.data, n), false);
        return;
      case DType.I8: {
        const scales = new Float32Array([c.scale]);
        checkScales(scales);
        k.decodeI8(out, new Int8Array(c.data.buffer, c.data.byteOffset, n), scales, Math.max(n, 1), false);
        return;
      }
      case DType.TopK: {
        const nnz = c.nnz ?? 0;
        const aligned = c.data.slice(); // indices and values at 4-byte boundaries
        const idx = new Uint32Array(aligned.buffer, 0, nnz);
        checkIndices(idx, n);
        out.fill(0);
        k.scatterAdd(out, idx, new Float32Array(aligned.buffer, 4 * nnz, nnz));
        return;
      }
      default:
        throw new BadRequestError(`chunk ${c.id}: dtype ${DType[c.dtype] ?? c.dtype} does not decode`);
    }
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
