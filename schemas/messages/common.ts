// What every message module builds from. Each module under schemas/messages/ holds the plain
// TypeScript forms of the messages one service owns (it sends them, or serves the subject they
// travel on), with encode/decode pairs. Decoding copies what it keeps out of the FlatBuffers
// buffer only where it must (float data stays a view into the aligned payload), validates
// counts against byte lengths, and turns any malformed read into a WireFormatError. Callers
// check semantics (shapes, job names, ranges).
import { Builder, type ByteBuffer } from "flatbuffers";
import { type RootType, verifyTable, WireFormatError } from "../codec.ts";

/** A message's root table: its name, file identifier, and how to read its schema version. */
export function root<T extends { schemaVersion(): number }>(
  name: string,
  identifier: string,
  getRoot: (bb: ByteBuffer) => T,
): RootType<T> {
  return { name, identifier, getRoot, version: (r) => r.schemaVersion() };
}

export const str = (b: Builder, s: string) => b.createString(s);
/**
 * A builder whose capacity is a multiple of 64 bytes: FlatBuffers aligns from the end of the
 * buffer, so only then are 16-byte aligned vectors also aligned from the start of its memory.
 */
export const builder = (bytes: number) => new Builder(Math.ceil(bytes / 64) * 64);
export const big = (n: number) => BigInt(n);
export const num = (n: bigint) => Number(n);

/** Reads a vector of tables, verifying that each element table lies inside the buffer. */
export function readList<T extends { bb: ByteBuffer | null; bb_pos: number }, R>(
  length: number,
  at: (i: number) => T | null,
  read: (t: T) => R,
  what: string,
): R[] {
  const out: R[] = [];
  for (let i = 0; i < length; i++) {
    const t = at(i);
    if (t === null || t.bb === null) throw new WireFormatError("malformed", `${what}[${i}] is missing`);
    verifyTable(t.bb, t.bb_pos, `${what}[${i}]`);
    out.push(read(t));
  }
  return out;
}
