// safetensors (Hugging Face's tensor file): an 8-byte little-endian header length, the header as
// JSON ({name: {dtype, shape, data_offsets: [begin, end]}}, data offsets from the end of the
// header, optional "__metadata__" of strings), padded with spaces to 8 bytes, then the data.
// Written and read here by hand: it is a few lines, and Debian has no safetensors package.
import { closeSync, openSync, readFileSync, readSync } from "node:fs";
import { DataFileError } from "./data/errors.ts";
import { writeDurably } from "./durable.ts";
import { readFailure } from "./data/files.ts";

export interface NamedTensor {
  name: string;
  shape: number[];
  data: Float32Array;
}

/** Writes f32 tensors, in the given order, durably. */
export function writeSafetensors(
  path: string,
  tensors: readonly NamedTensor[],
  metadata: Record<string, string> = {},
): void {
  const header: Record<string, unknown> = { __metadata__: metadata };
  let offset = 0;
  for (const t of tensors) {
    const n = t.shape.reduce((a, b) => a * b, 1);
    if (n !== t.data.length)
      throw new RangeError(`safetensors: ${t.name} has ${t.data.length} values for shape [${t.shape.join(", ")}]`);
    header[t.name] = { dtype: "F32", shape: t.shape, data_offsets: [offset, offset + 4 * n] };
    offset += 4 * n;
  }
  let json = JSON.stringify(header);
  json += " ".repeat((8 - ((8 + json.length) % 8)) % 8);
  const head = new Uint8Array(8 + json.length);
  new DataView(head.buffer).setBigUint64(0, BigInt(json.length), true);
  head.set(new TextEncoder().encode(json), 8);
  writeDurably(path, [
    head,
    ...tensors.map((t) => new Uint8Array(t.data.buffer, t.data.byteOffset, t.data.byteLength)),
  ]);
}

/** A safetensors file's "__metadata__" (its header alone is read), or null where it has none or
 *  the file is not safetensors. */
export function safetensorsMetadata(path: string): Record<string, string> | null {
  let fd: number;
  try {
    fd = openSync(path, "r");
  } catch {
    return null;
  }
  try {
    const head = new Uint8Array(8);
    if (readSync(fd, head, 0, 8, 0) !== 8) return null;
    const n = Number(new DataView(head.buffer).getBigUint64(0, true));
    if (!(n > 1 && n <= 100_000_000)) return null;
    const header = new Uint8Array(n);
    if (readSync(fd, header, 0, n, 8) !== n) return null;
    const meta = (JSON.parse(new TextDecoder().decode(header)) as { __metadata__?: unknown }).__metadata__;
    return typeof meta === "object" && meta !== null ? (meta as Record<string, string>) : null;
  } catch {
    return null;
  } finally {
    closeSync(fd);
  }
}

/** Reads every tensor of a safetensors file as f32 (F32 only: what meshtrain writes and GPT-2's files hold). */
export function readSafetensors(path: string): Map<string, { shape: number[]; data: Float32Array }> {
  let bytes: Uint8Array;
  try {
    bytes = readFileSync(path);
  } catch (e) {
    throw new DataFileError(path, readFailure(e), { cause: e });
  }
  if (bytes.length < 8) throw new DataFileError(path, "is too short for a safetensors header");
  const n = Number(new DataView(bytes.buffer, bytes.byteOffset).getBigUint64(0, true));
  if (!(n > 1 && 8 + n <= bytes.length))
    throw new DataFileError(path, `its header length ${n} does not fit its ${bytes.length} bytes`);
  let header: Record<string, { dtype: string; shape: number[]; data_offsets: [number, number] }>;
  try {
    header = JSON.parse(new TextDecoder().decode(bytes.subarray(8, 8 + n)));
  } catch (e) {
    throw new DataFileError(path, `its header is not JSON: ${(e as Error).message}`, { cause: e });
  }
  const data = bytes.subarray(8 + n);
  const out = new Map<string, { shape: number[]; data: Float32Array }>();
  for (const [name, t] of Object.entries(header)) {
    if (name === "__metadata__") continue;
    if (t.dtype !== "F32") throw new DataFileError(path, `tensor ${name} is ${t.dtype}; only F32 is read`);
    const [begin, end] = t.data_offsets;
    const count = t.shape.reduce((a, b) => a * b, 1);
    if (!(begin >= 0 && end === begin + 4 * count && end <= data.length))
      throw new DataFileError(path, `tensor ${name}'s offsets [${begin}, ${end}) do not fit its shape or the file`);
    // a copy of the bytes (a Buffer's slice shares its pool, and the data may start at any offset)
    out.set(name, { shape: t.shape, data: new Float32Array(new Uint8Array(data.subarray(begin, end)).buffer) });
  }
  return out;
}
