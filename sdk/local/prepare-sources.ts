// `meshtrain prepare`'s inputs, read as a stream of documents: a folder's files (each a
// document), a plain text file (cut at blank lines into documents of textDocumentCharsMin
// characters or more), a JSON Lines file (a document per line, in a named field; plain, gzip or
// zstd, streamed: sdk/local/prepare-jsonl.ts) or a Parquet file (a document per row, in a named
// column, read a row group at a time: sdk/local/prepare-parquet.ts), or a folder of those.
import { createReadStream, existsSync, readdirSync, readFileSync, statSync } from "node:fs";
import { join } from "node:path";
import { DataFileError } from "../../engine/data/errors.ts";
import { ConfigError } from "../../ffi/errors.ts";
import { shownPath } from "../user-paths.ts";
import { jsonlDocuments, jsonlFile } from "./prepare-jsonl.ts";
import { lineBlocks } from "./prepare-lines.ts";
import { decodeUtf8 } from "./prepare-utf8.ts";
import { readFailure } from "../../engine/data/files.ts";

export interface SourceOptions {
  /** a text file, a folder of them, or (with jsonl) a JSON Lines file; absolute */
  text: string;
  /** JSON Lines (plain, .gz or .zst): the field of each line that holds its document */
  jsonl?: string;
  /** Parquet: the column that holds each row's document */
  parquet?: string;
  /** a folder's files to read, by extension */
  ext: string;
  /** invalid UTF-8: refuse (an error naming the file and line) or replace with U+FFFD (and say so) */
  invalidUtf8: "refuse" | "replace";
  /** bytes read from a plain text file at a time (default textReadBytes; tests lower it) */
  textReadBytes?: number;
  /** a paragraph's characters at most (default textParagraphCharsMax; tests lower it) */
  textParagraphCharsMax?: number;
}

/** The extension of a folder's plain text files unless --ext says otherwise. */
export const textExtDefault = ".txt";

/** A plain text file is cut at blank lines into documents of at least this many characters (a
 *  book gives many, so it can be split by document). */
export const textDocumentCharsMin = 10_000;

export interface Document {
  text: string;
  /** "file" or "file:line", for errors and counts */
  where: string;
}

/** A file's text: refused or repaired where it is not UTF-8, saying which and where. */
function readUtf8(path: string, o: SourceOptions, notes: string[]): string {
  let bytes: Uint8Array;
  try {
    bytes = readFileSync(path);
  } catch (e) {
    throw new DataFileError(path, readFailure(e), { cause: e });
  }
  return decodeUtf8(bytes, { path, line: 1, offset: 0 }, o.invalidUtf8, notes);
}

/** A plain text paragraph longer than this many characters (a file with no blank line, say) is cut
 *  at its last line break before it, so that reading it holds a bounded piece of it. */
export const textParagraphCharsMax = 1 << 24;

/** Bytes read from a plain text file at a time. */
export const textReadBytes = 1 << 20;

/** A plain text file's text in pieces of whole lines (so that no piece ends inside a character,
 *  and a bad byte is named by its line; a line past the read size is cut at a character's start),
 *  checked as UTF-8 as it is read. */
async function* textPieces(path: string, o: SourceOptions, notes: string[]): AsyncGenerator<string> {
  const readBytes = o.textReadBytes ?? textReadBytes;
  const charStart = (open: Buffer): number => {
    let cut = open.length;
    while (cut > 0 && (open[cut - 1]! & 0xc0) === 0x80) cut--;
    return Math.max(cut - 1, 0);
  };
  for await (const b of lineBlocks(path, createReadStream(path, { highWaterMark: readBytes }), readBytes, charStart))
    yield decodeUtf8(b.bytes, { path, line: b.line, offset: b.offset }, o.invalidUtf8, notes);
}

/** A plain text's documents, read as a stream: consecutive paragraphs (cut at blank lines) of at
 *  least textDocumentCharsMin characters. */
async function* paragraphDocuments(path: string, o: SourceOptions, notes: string[]): AsyncGenerator<Document> {
  const where = shownPath(path);
  let current = "";
  const add = function* (para: string): Generator<Document> {
    current = current === "" ? para : `${current}\n\n${para}`;
    if (current.length >= textDocumentCharsMin) {
      yield { text: current, where };
      current = "";
    }
  };
  const charsMax = o.textParagraphCharsMax ?? textParagraphCharsMax;
  // the text after the last blank line so far: the paragraph that the next piece may continue
  let open = "";
  for await (const piece of textPieces(path, o, notes)) {
    const paras = (open + piece).split(/\n[ \t]*\n/);
    open = paras.pop()!;
    for (const para of paras) yield* add(para);
    while (open.length > charsMax) {
      let cut = open.lastIndexOf("\n", charsMax - 1) + 1 || charsMax;
      const last = open.charCodeAt(cut - 1);
      if (last >= 0xd800 && last <= 0xdbff) cut--; // not between a surrogate pair's halves
      yield* add(open.slice(0, cut));
      open = open.slice(cut);
    }
  }
  yield* add(open);
  if (current.trim() !== "") yield { text: current, where };
}

/** What a folder holds that is read: Parquet files, JSON Lines files (plain or compressed), or
 *  plain text files with the extension --ext names. */
function readsFile(o: SourceOptions): { test: (f: string) => boolean; what: string } {
  if (o.parquet !== undefined) return { test: (f) => f.endsWith(".parquet"), what: ".parquet" };
  if (o.jsonl !== undefined) return { test: (f) => jsonlFile.test(f), what: ".jsonl, .jsonl.gz or .jsonl.zst" };
  return { test: (f) => f.endsWith(o.ext), what: o.ext };
}

/** The input's files in order: a folder's by name, or the one file given. */
function inputFiles(o: SourceOptions): string[] {
  if (!existsSync(o.text)) throw new DataFileError(o.text, "not found");
  const st = statSync(o.text);
  if (st.isFile()) return [o.text];
  // a pipe or a device would be read without end (/dev/zero) or wait for a writer (a FIFO)
  if (!st.isDirectory())
    throw new DataFileError(o.text, "is not a regular file or a folder (prepare reads files, not pipes or devices)");
  const reads = readsFile(o);
  // (a link is followed: a folder of links to the corpus's files reads them)
  const files = readdirSync(o.text)
    .filter((f) => reads.test(f) && statSync(join(o.text, f), { throwIfNoEntry: false })?.isFile() === true)
    .sort();
  if (files.length === 0) throw new DataFileError(o.text, `holds no ${reads.what} file`);
  return files.map((f) => join(o.text, f));
}

/** The documents in order: a Parquet file's rows (--parquet), a JSON Lines file's lines (--jsonl),
 *  a plain text file's paragraphs; in a folder, each file's in turn (a plain text file whole). */
export async function* documents(o: SourceOptions, notes: string[]): AsyncGenerator<Document> {
  if (o.jsonl !== undefined && o.parquet !== undefined)
    throw new ConfigError("--jsonl and --parquet name two formats; give the one the input is in");
  if ((o.jsonl !== undefined || o.parquet !== undefined) && o.ext !== textExtDefault)
    throw new ConfigError(
      `--ext chooses a folder's plain text files; with ${o.jsonl !== undefined ? "--jsonl a folder's .jsonl, .jsonl.gz and .jsonl.zst" : "--parquet a folder's .parquet"} files are read`,
    );
  const folder = existsSync(o.text) && statSync(o.text).isDirectory();
  for (const path of inputFiles(o)) {
    // the Parquet reader (350 KB with its codecs) is loaded only for Parquet input
    if (o.parquet !== undefined)
      yield* (await import("./prepare-parquet.ts")).parquetDocuments(path, o.parquet, o.invalidUtf8, notes);
    else if (o.jsonl !== undefined) yield* jsonlDocuments(path, o.jsonl, o.invalidUtf8, notes);
    else if (folder) yield { text: readUtf8(path, o, notes), where: shownPath(path) };
    else yield* paragraphDocuments(path, o, notes);
  }
}

/** Text is about this many times its compressed size (gzip or zstd, and Parquet's codecs): a guess
 *  that only sizes the count of threads. */
export const compressionRatioGuess = 4;
const compressedFile = /\.(gz|zst|parquet)$/;

/** The input's bytes on disk (compressed, for a compressed input), and a guess at its text's. */
export function bytesOf(o: SourceOptions): { disk: number; text: number } {
  try {
    const files = inputFiles(o);
    const size = (f: string) => statSync(f).size;
    return {
      disk: files.reduce((n, f) => n + size(f), 0),
      text: files.reduce((n, f) => n + size(f) * (compressedFile.test(f) ? compressionRatioGuess : 1), 0),
    };
  } catch {
    // an input that cannot be listed is reported when its documents are read
    return { disk: 0, text: 0 };
  }
}
