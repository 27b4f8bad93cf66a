// `meshtrain prepare`'s inputs, read as a stream of documents: a folder's files (each a
// document), a plain text file (cut at blank lines into documents of textDocumentCharsMin
// characters or more), or a JSON Lines file (a document per line, in a named field).
import { existsSync, readdirSync, readFileSync, statSync } from "node:fs";
import { join } from "node:path";
import { DataFileError } from "../../engine/data/errors.ts";
import { ConfigError } from "../../ffi/errors.ts";
import { shownPath } from "../user-paths.ts";

export interface SourceOptions {
  /** a text file, a folder of them, or (with jsonl) a JSON Lines file; absolute */
  text: string;
  /** JSON Lines: the field of each line that holds its document */
  jsonl?: string;
  /** a folder's files to read, by extension */
  ext: string;
  /** invalid UTF-8: refuse (an error naming the file and line) or replace with U+FFFD (and say so) */
  invalidUtf8: "refuse" | "replace";
}

/** A plain text file is cut at blank lines into documents of at least this many characters (a
 *  book gives many, so it can be split by document). */
export const textDocumentCharsMin = 10_000;

export interface Document {
  text: string;
  /** "file" or "file:line", for errors and counts */
  where: string;
}

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

/** A file's text: refused or repaired where it is not UTF-8, saying which and where. */
function readUtf8(path: string, o: SourceOptions, notes: string[]): string {
  let bytes: Uint8Array;
  try {
    bytes = readFileSync(path);
  } catch (e) {
    throw new DataFileError(path, `cannot be read: ${(e as Error).message}`, { cause: e });
  }
  const bad = invalidUtf8At(bytes);
  if (bad >= 0) {
    const where = `${shownPath(path)}:${lineOf(bytes, bad)}: invalid UTF-8 at byte ${bad}`;
    if (o.invalidUtf8 === "refuse")
      throw new DataFileError(
        path,
        `line ${lineOf(bytes, bad)}: invalid UTF-8 at byte ${bad}; --invalid-utf8 replace replaces such bytes with U+FFFD`,
      );
    notes.push(`${where}: replaced with U+FFFD (--invalid-utf8 replace)`);
  }
  return new TextDecoder("utf-8").decode(bytes);
}

/** A plain text's documents: consecutive paragraphs of at least textDocumentCharsMin characters. */
function paragraphsOf(text: string, file: string): Document[] {
  const docs: Document[] = [];
  let current = "";
  for (const para of text.split(/\n[ \t]*\n/)) {
    current = current === "" ? para : `${current}\n\n${para}`;
    if (current.length >= textDocumentCharsMin) {
      docs.push({ text: current, where: file });
      current = "";
    }
  }
  if (current.trim() !== "") docs.push({ text: current, where: file });
  return docs;
}

/** The inputs in order: a folder's files by name, each a document; a text file's paragraphs; a JSON Lines file's lines. */
export async function* documents(o: SourceOptions, notes: string[]): AsyncGenerator<Document> {
  if (!existsSync(o.text)) throw new DataFileError(o.text, "not found");
  if (statSync(o.text).isDirectory()) {
    if (o.jsonl !== undefined)
      throw new ConfigError(`--jsonl reads one JSON Lines file; ${shownPath(o.text)} is a folder`);
    const files = readdirSync(o.text)
      .filter((f) => f.endsWith(o.ext))
      .sort();
    if (files.length === 0) throw new DataFileError(o.text, `holds no ${o.ext} file`);
    for (const f of files) {
      const path = join(o.text, f);
      yield { text: readUtf8(path, o, notes), where: shownPath(path) };
    }
    return;
  }
  const text = readUtf8(o.text, o, notes);
  if (o.jsonl === undefined) {
    yield* paragraphsOf(text, shownPath(o.text));
    return;
  }
  const lines = text.split("\n");
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i]!.trim();
    if (line === "") continue;
    const where = `${shownPath(o.text)}:${i + 1}`;
    let value: unknown;
    try {
      value = JSON.parse(line);
    } catch (e) {
      throw new DataFileError(o.text, `line ${i + 1}: not JSON (${(e as Error).message})`);
    }
    const doc = typeof value === "object" && value !== null ? (value as Record<string, unknown>)[o.jsonl] : undefined;
    if (typeof doc !== "string")
      throw new DataFileError(o.text, `line ${i + 1}: no string field ${JSON.stringify(o.jsonl)}`);
    yield { text: doc, where };
  }
}

export function bytesOf(o: SourceOptions): number {
  if (!existsSync(o.text)) return 0;
  if (!statSync(o.text).isDirectory()) return statSync(o.text).size;
  return readdirSync(o.text)
    .filter((f) => f.endsWith(o.ext))
    .reduce((n, f) => n + statSync(join(o.text, f)).size, 0);
}
