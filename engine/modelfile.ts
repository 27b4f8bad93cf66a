// A trained model on disk: config + parameter slab, written durably and verified on read.
// (The checkpoint service snapshots whole jobs; this is the single-model file a user samples
// from or fine-tunes.)
//
// Layout, little-endian:
//   bytes 0-7   magic "MTMODEL\0"
//   bytes 8-11  u32 format version
//   bytes 12-15 u32 header length H
//   16..16+H    header, UTF-8 JSON (kind, config, vocab, parameter table, checksum, ...)
//   then        zero padding to a 64-byte boundary, then the f32 parameter slab
import { existsSync, statSync } from "node:fs";
import { join } from "node:path";
import { writeDurably } from "./durable.ts";
import { DataFileError } from "./data/errors.ts";
import { readDataFile } from "./data/files.ts";
import type { ParamEntry, ParamStore } from "./params.ts";

export const modelFileMagic = "MTMODEL\0";
export const modelFileVersion = 1;
const prefixBytes = 16;
const alignBytes = 64;
/** A header larger than this is not one we wrote. */
const headerBytesMax = 16 * 1024 * 1024;

export interface ModelFileHeader {
  kind: "mlp" | "gpt";
  config: object;
  /** character vocabulary of a char-level model */
  vocab?: string[];
  /** a BPE model's tokenizer (its samples decode with it) */
  tokenizer?: "gpt2";
  entries: ParamEntry[];
  slabNumel: number;
  /** optimizer steps the weights have seen */
  step: number;
  /** the training run's resolved settings, for the record */
  training?: object;
  /** CRC-32 of the slab bytes */
  slabCrc32: number;
  createdAt: string;
}

export function saveModelFile(
  path: string,
  store: ParamStore,
  header: Omit<ModelFileHeader, "entries" | "slabNumel" | "slabCrc32" | "createdAt">,
): void {
  const slab = store.readValues();
  const slabBytes = new Uint8Array(slab.buffer);
  const full: ModelFileHeader = {
    ...header,
    entries: [...store.entries],
    slabNumel: store.slabNumel,
    slabCrc32: Bun.hash.crc32(slabBytes),
    createdAt: new Date().toISOString(),
  };
  const json = new TextEncoder().encode(JSON.stringify(full));
  const dataOffset = Math.ceil((prefixBytes + json.length) / alignBytes) * alignBytes;
  // the header and its padding, then the slab as it was read: no second copy of the model
  const head = new Uint8Array(dataOffset);
  head.set(new TextEncoder().encode(modelFileMagic), 0);
  const view = new DataView(head.buffer);
  view.setUint32(8, modelFileVersion, true);
  view.setUint32(12, json.length, true);
  head.set(json, prefixBytes);
  writeDurably(path, [head, slabBytes]);
}

export interface LoadedModelFile {
  header: ModelFileHeader;
  slab: Float32Array;
}

export function readModelFile(path: string): LoadedModelFile {
  // a folder: a Hugging Face export, which the commands that take one read with their own flag
  if (statSync(path, { throwIfNoEntry: false })?.isDirectory())
    throw new DataFileError(
      path,
      existsSync(join(path, "config.json"))
        ? "is a Hugging Face GPT-2 folder (exported already?), not a meshtrain model file (.mtm)"
        : "is a folder, not a meshtrain model file (.mtm)",
    );
  const bytes = readDataFile(path);
  if (bytes.length < prefixBytes || new TextDecoder().decode(bytes.subarray(0, 8)) !== modelFileMagic) {
    throw new DataFileError(path, "not a meshtrain model file (bad magic number)");
  }
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const version = view.getUint32(8, true);
  if (version !== modelFileVersion) {
    throw new DataFileError(
      path,
      `model file format version ${version}; this meshtrain reads version ${modelFileVersion} (retrain or convert with the meshtrain that wrote it)`,
    );
  }
  const headerLength = view.getUint32(12, true);
  if (headerLength > headerBytesMax || prefixBytes + headerLength > bytes.length) {
    throw new DataFileError(path, `truncated or corrupt: header length ${headerLength} exceeds the file`);
  }
  let header: ModelFileHeader;
  try {
    header = JSON.parse(
      new TextDecoder("utf-8", { fatal: true }).decode(bytes.subarray(prefixBytes, prefixBytes + headerLength)),
    );
  } catch (e) {
    throw new DataFileError(path, "corrupt header (not valid JSON)", { cause: e });
  }
  if (
    (header.kind !== "mlp" && header.kind !== "gpt") ||
    !Number.isInteger(header.slabNumel) ||
    !Array.isArray(header.entries)
  ) {
    throw new DataFileError(path, "corrupt header (missing kind, entries or slabNumel)");
  }
  const dataOffset = Math.ceil((prefixBytes + headerLength) / alignBytes) * alignBytes;
  const expected = dataOffset + header.slabNumel * 4;
  if (bytes.length !== expected) {
    throw new DataFileError(path, `truncated or corrupt: expected ${expected} bytes, file has ${bytes.length}`);
  }
  const slab = new Float32Array(header.slabNumel);
  const slabBytes = new Uint8Array(slab.buffer);
  slabBytes.set(bytes.subarray(dataOffset));
  if (Bun.hash.crc32(slabBytes) !== header.slabCrc32) {
    throw new DataFileError(path, "corrupt: parameter checksum mismatch");
  }
  return { header, slab };
}

/** Copy a loaded slab into a model built from the same config, after checking the layouts agree. */
export function loadSlabInto(path: string, store: ParamStore, loaded: LoadedModelFile): void {
  const a = loaded.header.entries;
  const b = store.entries;
  const same =
    a.length === b.length &&
    a.every(
      (e, i) =>
        e.name === b[i]!.name &&
        e.offset === b[i]!.offset &&
        e.numel === b[i]!.numel &&
        e.shape.length === b[i]!.shape.length &&
        e.shape.every((d, j) => d === b[i]!.shape[j]),
    );
  if (!same || loaded.header.slabNumel !== store.slabNumel) {
    throw new DataFileError(path, "parameter layout does not match the model built from its config");
  }
  store.writeValues(loaded.slab);
}
