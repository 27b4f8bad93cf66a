// Codec helpers around the flatc-generated classes:
//   - bulk vector copies (the generated builders copy one element at a time, ~20x slower),
//   - aligned views (NATS payloads arrive at arbitrary byte offsets; a Float32Array needs 4),
//   - opening a root with every check done before a field is read (size, identifier,
//     schema version), and turning any read past the buffer into a typed error,
//   - chunking flat vectors and packing chunks into messages under a payload limit.
import { MeshtrainError } from "../ffi/errors.ts";
import { Builder, ByteBuffer } from "flatbuffers";

/** Version written into and required from every root table's `schema_version`. */
export const schemaVersion = 1;

/** Codes a decode failure carries; they cross the wire inside ErrorReply.code. */
export type WireFormatCode = "truncated" | "oversized" | "bad_identifier" | "bad_version" | "malformed";

export class WireFormatError extends MeshtrainError {
  override readonly name = "WireFormatError";
  declare readonly code: WireFormatCode;
  constructor(code: WireFormatCode, message: string, options?: ErrorOptions) {
    super(message, options, code);
  }
}

/** What openRoot needs to know about one root table type. */
export interface RootType<T> {
  name: string;
  identifier: string;
  getRoot(bb: ByteBuffer): T;
  version(root: T): number;
}

/** Smallest valid buffer: root offset (4) + file identifier (4). */
const headerBytes = 8;

/**
 * Checks size, file identifier and schema version, then returns the root. The bytes are first
 * copied to aligned memory when they are not 4-byte aligned, so typed vectors can be viewed;
 * `align: false` skips that for messages whose vectors are all bytes (f32Of copies the
 * unaligned ones it is asked to view).
 */
export function openRoot<T>(
  data: Uint8Array,
  type: RootType<T>,
  bytesMax: number,
  opts: { align: boolean } = { align: true },
): T {
  if (data.byteLength < headerBytes) {
    throw new WireFormatError(
      "truncated",
      `${type.name}: ${data.byteLength} bytes is shorter than a FlatBuffers header (${headerBytes})`,
    );
  }
  if (data.byteLength > bytesMax) {
    throw new WireFormatError("oversized", `${type.name}: ${data.byteLength} bytes exceeds the limit of ${bytesMax}`);
  }
  // messages that hold only byte vectors (read with any alignment) skip the copy: opts.align false
  const bb = new ByteBuffer(opts.align ? alignedBytes(data) : data);
  if (!bb.__has_identifier(type.identifier)) {
    const got = new TextDecoder().decode(data.subarray(4, 8)).replace(/[^\x20-\x7e]/g, "?");
    throw new WireFormatError(
      "bad_identifier",
      `${type.name}: file identifier "${got}", expected "${type.identifier}"`,
    );
  }
  const rootOffset = bb.readUint32(0);
  if (rootOffset < headerBytes || rootOffset + 4 > data.byteLength) {
    throw new WireFormatError(
      "truncated",
      `${type.name}: root offset ${rootOffset} is outside the ${data.byteLength}-byte buffer`,
    );
  }
  verifyTable(bb, rootOffset, type.name);
  const root = guarded(type.name, () => type.getRoot(bb));
  const version = guarded(type.name, () => type.version(root));
  if (version !== schemaVersion) {
    throw new WireFormatError(
      "bad_version",
      `${type.name}: schema version ${version}, this build speaks ${schemaVersion}`,
    );
  }
  return root;
}

/**
 * Checks that a table and its vtable lie inside the buffer (the generated readers return 0 for
 * bytes past the end instead of failing, so a cut buffer would otherwise read as zeros).
 */
export function verifyTable(bb: ByteBuffer, tablePos: number, what: string): void {
  const length = bb.capacity();
  const fail = (why: string) => {
    throw new WireFormatError("truncated", `${what}: ${why} (buffer of ${length} bytes)`);
  };
  if (!(tablePos >= 0 && tablePos + 4 <= length)) fail(`table at ${tablePos} is outside the buffer`);
  const vtable = tablePos - bb.readInt32(tablePos);
  if (!(vtable >= 0 && vtable + 4 <= length)) fail(`vtable at ${vtable} is outside the buffer`);
  const vtableBytes = bb.readUint16(vtable);
  const tableBytes = bb.readUint16(vtable + 2);
  if (vtableBytes < 4 || vtableBytes % 2 !== 0 || vtable + vtableBytes > length)
    fail(`vtable of ${vtableBytes} bytes at ${vtable} does not fit`);
  if (tableBytes < 4 || tablePos + tableBytes > length)
    fail(`table of ${tableBytes} bytes at ${tablePos} does not fit`);
}

/** Runs a read of generated accessors; a read outside the buffer becomes a WireFormatError. */
export function guarded<R>(what: string, read: () => R): R {
  try {
    return read();
  } catch (e) {
    if (e instanceof WireFormatError) throw e;
    throw new WireFormatError("malformed", `${what}: malformed message (${(e as Error).message})`, { cause: e });
  }
}

/**
 * The bytes themselves when 4-byte aligned (vectors are aligned relative to the buffer start,
 * so float32 vectors inside are then aligned too), else an aligned copy.
 */
export function alignedBytes(data: Uint8Array): Uint8Array {
  if (data.byteOffset % 4 === 0) return data;
  const copy = new Uint8Array(data.byteLength);
  copy.set(data);
  return copy;
}

/** A view of any typed array's bytes. */
export function bytesOf(v: ArrayBufferView): Uint8Array {
  return new Uint8Array(v.buffer, v.byteOffset, v.byteLength);
}

/**
 * Float32 elements of a byte vector read from a message. A view when the offset is 4-byte
 * aligned (always, for buffers opened with openRoot and vectors written by createBytes), else
 * a copy. Throws when the byte count is not a whole number of floats.
 */
export function f32Of(what: string, bytes: Uint8Array | null): Float32Array {
  if (bytes === null) return new Float32Array(0);
  if (bytes.byteLength % 4 !== 0)
    throw new WireFormatError("malformed", `${what}: ${bytes.byteLength} bytes is not a whole number of float32`);
  if (bytes.byteOffset % 4 === 0) return new Float32Array(bytes.buffer, bytes.byteOffset, bytes.byteLength / 4);
  return new Float32Array(bytes.slice().buffer);
}

/** Start of an int32 vector's length prefix inside a Builder (private fields of the runtime). */
interface BuilderInternals {
  bb: ByteBuffer;
  space: number;
}

/**
 * Writes a byte vector in one copy, its data aligned to `alignment` bytes from the buffer's
 * end (FlatBuffers aligns relative to the end; the finished buffer starts on a multiple of
 * the largest alignment used, so the data is aligned from the start too).
 */
export function createBytes(b: Builder, bytes: Uint8Array, alignment = 16): number {
  return createBytesFilled(b, bytes.byteLength, (dst) => dst.set(bytes), alignment);
}

/**
 * Reserves an aligned byte vector and lets `fill` write it in place (a backend download straight
 * into the message: no intermediate copy).
 */
export function createBytesFilled(
  b: Builder,
  byteLength: number,
  fill: (dst: Uint8Array) => void,
  alignment = 16,
  elemBytes = 1,
): number {
  b.startVector(elemBytes, byteLength / elemBytes, alignment);
  const inner = b as unknown as BuilderInternals;
  inner.space -= byteLength;
  fill(inner.bb.bytes().subarray(inner.space, inner.space + byteLength));
  return b.endVector();
}

/** Same for an int32 or uint32 vector. */
export function createI32s(b: Builder, values: Int32Array | Uint32Array): number {
  return createBytesFilled(b, values.byteLength, (dst) => dst.set(bytesOf(values)), 4, 4);
}

/** The finished buffer: a view into the builder's memory (the builder is not reused), no copy. */
export function finishBytes(b: Builder, root: number, identifier: string): Uint8Array {
  b.finish(root, identifier);
  return b.asUint8Array();
}

// ---- chunking ------------------------------------------------------------------------------

/** [offset, count) element ranges that cut `total` elements into chunks of `chunkElems`. */
export function chunkRanges(total: number, chunkElems: number): { offset: number; count: number }[] {
  if (!(Number.isInteger(total) && total >= 0))
    throw new RangeError(`total must be a non-negative integer, got ${total}`);
  if (!(Number.isInteger(chunkElems) && chunkElems > 0))
    throw new RangeError(`chunkElems must be a positive integer, got ${chunkElems}`);
  const out: { offset: number; count: number }[] = [];
  for (let offset = 0; offset < total; offset += chunkElems)
    out.push({ offset, count: Math.min(chunkElems, total - offset) });
  return out;
}

/** Bytes a message needs beyond its payload vectors (tables, vtables, strings, alignment). */
export const messageOverheadBytes = 1024;
/** Per chunk inside a message: table, vtable, vector prefix and alignment padding. */
export const chunkOverheadBytes = 64;

/**
 * Groups items into messages of at most `bytesMax` bytes each (payload + overheads). An item
 * that cannot fit a message on its own is an error: chunks must be cut smaller.
 */
export function packByBytes<T>(items: readonly T[], bytesOfItem: (item: T) => number, bytesMax: number): T[][] {
  const groups: T[][] = [];
  let group: T[] = [];
  let used = messageOverheadBytes;
  for (const item of items) {
    const need = bytesOfItem(item) + chunkOverheadBytes;
    if (messageOverheadBytes + need > bytesMax) {
      throw new RangeError(`an item of ${bytesOfItem(item)} bytes cannot fit a message of at most ${bytesMax} bytes`);
    }
    if (used + need > bytesMax && group.length > 0) {
      groups.push(group);
      group = [];
      used = messageOverheadBytes;
    }
    group.push(item);
    used += need;
  }
  if (group.length > 0) groups.push(group);
  return groups;
}
