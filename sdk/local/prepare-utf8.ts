// `meshtrain prepare`'s UTF-8 check: input that is not UTF-8 is refused with the file, line and
// byte, or (--invalid-utf8 replace) decoded with U+FFFD where it is not, saying where.
import { DataFileError } from "../../engine/data/errors.ts";
import { shownPath } from "../user-paths.ts";

export type InvalidUtf8 = "refuse" | "replace";

/** The byte offset of the first invalid UTF-8 sequence, or -1. */
export function invalidUtf8At(b: Uint8Array): number {
  for (let i = 0; i < b.length; ) {
    const c = b[i]!;
    const n = c < 0x80 ? 1 : c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3 : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
    if (n === 0 || i + n > b.length) return i;
    for (let k = 1; k < n; k++) if ((b[i + k]! & 0xc0) !== 0x80) return i;
    // overlong 3- and 4-byte forms, surrogates, and code points past U+10FFFF
    if (n === 3 && ((c === 0xe0 && b[i + 1]! < 0xa0) || (c === 0xed && b[i + 1]! >= 0xa0))) return i;
    if (n === 4 && ((c === 0xf0 && b[i + 1]! < 0x90) || (c === 0xf4 && b[i + 1]! >= 0x90))) return i;
    i += n;
  }
  return -1;
}

const lineOf = (b: Uint8Array, offset: number): number => {
  let line = 1;
  for (let i = 0; i < offset; i++) if (b[i] === 0x0a) line++;
  return line;
};

const strictDecoder = new TextDecoder("utf-8", { fatal: true });

/** Where some bytes begin: the file, its line there, and the byte offset of their start. */
export interface BytesAt {
  path: string;
  /** the line, or with row, a Parquet row */
  line: number;
  /** the byte offset of their start (a Parquet row's: 0, the offset within the row's value) */
  offset: number;
  row?: true;
}

/** The bytes' text; bytes that are not UTF-8 are refused, or replaced and noted. */
export function decodeUtf8(bytes: Uint8Array, at: BytesAt, what: InvalidUtf8, notes: string[]): string {
  // the native decoder checks every byte fast; the scan that says where runs only when it fails
  try {
    return strictDecoder.decode(bytes);
  } catch {
    // not UTF-8: found, refused or replaced below
  }
  const bad = invalidUtf8At(bytes);
  if (bad >= 0) {
    const where = at.row ? `row ${at.line}` : `line ${at.line + linesBefore(bytes, bad)}`;
    const byte = at.offset + bad;
    if (what === "refuse")
      throw new DataFileError(
        at.path,
        `${where}: invalid UTF-8 at byte ${byte}; --invalid-utf8 replace replaces such bytes with U+FFFD`,
      );
    // a text's line as file:line, as editors take it; a Parquet row as file: row n
    const shown = at.row ? `${shownPath(at.path)}: ${where}` : `${shownPath(at.path)}:${where.slice("line ".length)}`;
    notes.push(`${shown}: invalid UTF-8 at byte ${byte}: replaced with U+FFFD (--invalid-utf8 replace)`);
  }
  return new TextDecoder("utf-8").decode(bytes);
}

const linesBefore = (b: Uint8Array, offset: number): number => {
  let lines = 0;
  for (let i = 0; i < offset; i++) if (b[i] === 0x0a) lines++;
  return lines;
};
