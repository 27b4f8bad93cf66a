// `meshtrain prepare`'s inputs, read as a stream of documents: a folder's files (each a
// document), a plain text file (one document, a book, read in pieces cut where GPT-2's
// pre-tokenizer always cuts, its end held out for validation), a JSON Lines file (a document per
// line, in a named field; plain, gzip or zstd, streamed: sdk/local/prepare-jsonl.ts) or a Parquet
// file (a document per row, in a named column, read a row group at a time:
// sdk/local/prepare-parquet.ts), or a folder of those.
import { createReadStream, existsSync, readdirSync, readFileSync, realpathSync, statSync } from "node:fs";
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
  /** a plain text's pieces: characters at least and at most (defaults textPieceCharsMin and
   *  textPieceCharsMax; tests lower them) */
  textPieceCharsMin?: number;
  textPieceCharsMax?: number;
  /** a single plain text file: the share of its end held out for validation (prepare's --val-fraction) */
  valFraction?: number;
}

/** The extension of a folder's plain text files unless --ext says otherwise. */
export const textExtDefault = ".txt";

/** A plain text file is one document, read in pieces of at least this many characters. */
export const textPieceCharsMin = 10_000;

export interface Document {
  text: string;
  /** "file" or "file:line", for errors and counts */
  where: string;
  /** a piece of a plain text file after its first: it continues the document (nothing between) */
  continues?: boolean;
  /** a piece of a plain text file's held-out end (the text after --val-fraction's position) */
  heldOut?: boolean;
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

/** A plain text with no place to cut (see isPieceBoundary) for this many characters is cut
 *  anyway, at a character's start, so that reading it holds a bounded piece of it. */
export const textPieceCharsMax = 1 << 24;

/** Bytes read from a plain text file at a time. */
export const textReadBytes = 1 << 20;

const whiteSpace = /\s/;
const letter = /\p{L}/u;

/**
 * Whether GPT-2's pre-tokenizer cuts `text` before index i whatever surrounds it: after a
 * character that is not white space, before a line break, or before a space and a letter. None of
 * its patterns (contractions, ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`, runs of white space)
 * matches across such a place, so the pieces of a text cut there, tokenized apart, give the whole
 * text's tokens (BPE merges within a pre-token only). Characters are tokens of their own anyway.
 */
export function isPieceBoundary(text: string, i: number): boolean {
  if (i <= 0 || i >= text.length || whiteSpace.test(text[i - 1]!)) return false;
  const at = text.charCodeAt(i);
  if (at === 0x0a) return true;
  if (at !== 0x20 || i + 1 >= text.length) return false;
  return letter.test(String.fromCodePoint(text.codePointAt(i + 1)!));
}

/** The index of the start of the character that byte `k` of UTF-8 `bytes` is in. */
function charStart(bytes: Uint8Array, k: number): number {
  let at = Math.min(k, bytes.length);
  while (at > 0 && at < bytes.length && (bytes[at]! & 0xc0) === 0x80) at--;
  return at;
}

const looseDecoder = new TextDecoder("utf-8");

/** A plain text file's text in blocks of whole lines (so that no block ends inside a character,
 *  and a bad byte is named by its line; a line past the read size is cut at a character's start),
 *  checked as UTF-8 as it is read, each with its bytes and their offset in the file. */
async function* textBlocks(
  path: string,
  o: SourceOptions,
  notes: string[],
): AsyncGenerator<{ text: string; bytes: Buffer; offset: number }> {
  const readBytes = o.textReadBytes ?? textReadBytes;
  // a line past the read size: cut before its last character (it may be incomplete)
  const cutLine = (open: Buffer): number => Math.max(charStart(open, open.length - 1), 0);
  for await (const b of lineBlocks(path, createReadStream(path, { highWaterMark: readBytes }), readBytes, cutLine))
    yield {
      text: decodeUtf8(b.bytes, { path, line: b.line, offset: b.offset }, o.invalidUtf8, notes),
      bytes: b.bytes,
      offset: b.offset,
    };
}

/**
 * A plain text file as one document, read as a stream in pieces, each cut where isPieceBoundary
 * says (so their tokens are the whole text's). With o.valFraction, the pieces from the first such
 * place at or after that share of the file's bytes from its end are its held-out end (heldOut).
 */
async function* textDocument(path: string, o: SourceOptions, notes: string[]): AsyncGenerator<Document> {
  const where = shownPath(path);
  const min = o.textPieceCharsMin ?? textPieceCharsMin;
  const max = o.textPieceCharsMax ?? textPieceCharsMax;
  const fraction = o.valFraction ?? 0;
  const heldOutByte = fraction > 0 ? Math.floor(statSync(path).size * (1 - fraction)) : Number.POSITIVE_INFINITY;
  let open = "";
  let pieces = 0;
  let heldOut = false;
  /** where in `open` the held-out end may begin, once its byte is read (-1: not yet, or done) */
  let cutFrom = -1;
  const piece = (text: string): Document => ({ text, where, continues: pieces++ > 0, heldOut });
  /** pieces of at least `min` characters from the front of `open`, none past `limit` */
  const front = function* (limit: number): Generator<Document> {
    while (Math.min(open.length, limit) >= min) {
      let i = Math.min(limit - 1, max, open.length - 1);
      while (i > 0 && !isPieceBoundary(open, i)) i--;
      if (i === 0) {
        if (Math.min(open.length, limit) < max) return; // a place to cut may come
        i = max;
        const last = open.charCodeAt(i - 1);
        if (last >= 0xd800 && last <= 0xdbff) i--; // not between a surrogate pair's halves
      }
      yield piece(open.slice(0, i));
      open = open.slice(i);
      limit -= i;
      if (cutFrom >= 0) cutFrom -= i;
    }
  };
  for await (const b of textBlocks(path, o, notes)) {
    if (!heldOut && cutFrom < 0 && b.offset + b.bytes.length > heldOutByte) {
      const k = charStart(b.bytes, heldOutByte - b.offset);
      cutFrom = open.length + looseDecoder.decode(b.bytes.subarray(0, k)).length;
    }
    open += b.text;
    if (cutFrom >= 0) {
      // the first place to cut at or after the held-out end's byte (past max characters with
      // none, that byte itself: a text of no spaces or line breaks)
      let i = Math.max(cutFrom, 1);
      while (i < open.length && !isPieceBoundary(open, i)) i++;
      if (i === open.length && open.length - cutFrom > max) i = cutFrom;
      if (i < open.length) {
        // pieces before the held-out end's byte, then what is left before the cut (front moves
        // cutFrom along with the text it takes; the cut is as far past it as before)
        const past = i - cutFrom;
        yield* front(cutFrom);
        const at = cutFrom + past;
        if (at > 0) yield piece(open.slice(0, at));
        open = open.slice(at);
        heldOut = true;
        cutFrom = -1;
      }
    }
    yield* front(cutFrom >= 0 ? cutFrom : open.length);
  }
  // the held-out end's byte came, but no place to cut after it: cut at that byte
  if (cutFrom >= 0) {
    yield* front(cutFrom);
    if (cutFrom > 0) yield piece(open.slice(0, cutFrom));
    open = open.slice(cutFrom);
    heldOut = true;
  }
  if (open !== "") yield piece(open);
}

/** What a folder holds that is read: Parquet files, JSON Lines files (plain or compressed), or
 *  plain text files with the extension --ext names. */
function readsFile(o: SourceOptions): { test: (f: string) => boolean; what: string } {
  if (o.parquet !== undefined) return { test: (f) => f.endsWith(".parquet"), what: ".parquet" };
  if (o.jsonl !== undefined) return { test: (f) => jsonlFile.test(f), what: ".jsonl, .jsonl.gz or .jsonl.zst" };
  return { test: (f) => f.endsWith(o.ext), what: o.ext };
}

/** The input's files in order: a folder's and its folders', by name, or the one file given. */
function inputFiles(o: SourceOptions): string[] {
  if (!existsSync(o.text)) throw new DataFileError(o.text, "not found");
  const st = statSync(o.text);
  if (st.isFile()) return [o.text];
  // a pipe or a device would be read without end (/dev/zero) or wait for a writer (a FIFO)
  if (!st.isDirectory())
    throw new DataFileError(o.text, "is not a regular file or a folder (prepare reads files, not pipes or devices)");
  const reads = readsFile(o);
  // its folders' too, each folder's entries by name (a link is followed: a folder of links to the
  // corpus's files reads them; a folder met twice, by a link back up, is read once)
  const files: string[] = [];
  const seen = new Set<string>();
  const walk = (dir: string) => {
    let real: string, names: string[];
    try {
      real = realpathSync(dir);
      names = readdirSync(dir).sort();
    } catch (e) {
      throw new DataFileError(dir, readFailure(e), { cause: e });
    }
    if (seen.has(real)) return;
    seen.add(real);
    for (const name of names) {
      const path = join(dir, name);
      const st = statSync(path, { throwIfNoEntry: false });
      if (st?.isDirectory()) walk(path);
      else if (st?.isFile() && reads.test(name)) files.push(path);
    }
  };
  walk(o.text);
  if (files.length === 0) throw new DataFileError(o.text, `holds no ${reads.what} file, in it or its folders`);
  return files;
}

/** The documents in order: a Parquet file's rows (--parquet), a JSON Lines file's lines (--jsonl),
 *  a plain text file in pieces (one document); in a folder, each file's in turn (a plain text
 *  file whole: each is a document of the corpus). */
export async function* documents(o: SourceOptions, notes: string[]): AsyncGenerator<Document> {
  if (o.jsonl !== undefined && o.parquet !== undefined)
    throw new ConfigError("--jsonl and --parquet name two formats; give the one the input is in");
  if ((o.jsonl !== undefined || o.parquet !== undefined) && o.ext !== textExtDefault)
    throw new ConfigError(
      `--ext chooses a folder's plain text files; with ${o.jsonl !== undefined ? "--jsonl a folder's .jsonl, .jsonl.gz and .jsonl.zst" : "--parquet a folder's .parquet"} files are read`,
    );
  const files = inputFiles(o);
  const folder = statSync(o.text).isDirectory();
  if (!folder) refuseFormatAsText(o);
  for (const path of files) {
    // the Parquet reader (350 KB with its codecs) is loaded only for Parquet input
    if (o.parquet !== undefined)
      yield* (await import("./prepare-parquet.ts")).parquetDocuments(path, o.parquet, o.invalidUtf8, notes);
    else if (o.jsonl !== undefined) yield* jsonlDocuments(path, o.jsonl, o.invalidUtf8, notes);
    else if (folder) yield { text: readUtf8(path, o, notes), where: shownPath(path) };
    else yield* textDocument(path, o, notes);
  }
}

/** A file whose name says Parquet, JSON Lines or compression, given as plain text (its bytes
 *  would be tokenized as they are: JSON's syntax, or not UTF-8 at all). */
function refuseFormatAsText(o: SourceOptions): void {
  const name = shownPath(o.text);
  if (o.parquet === undefined && o.text.endsWith(".parquet"))
    throw new ConfigError(`${name} is Parquet: --parquet <column> names the column that holds the text`);
  if (o.jsonl === undefined && o.parquet === undefined) {
    if (jsonlFile.test(o.text))
      throw new ConfigError(`${name} is JSON Lines: --jsonl <field> names the field that holds each document`);
    if (compressedText.test(o.text))
      throw new ConfigError(
        `${name} is compressed: prepare reads compressed JSON Lines (--jsonl <field>), and plain text uncompressed`,
      );
  }
}

/** Text is about this many times its compressed size (gzip or zstd, and Parquet's codecs): a guess
 *  that only sizes the count of threads. */
export const compressionRatioGuess = 4;
const compressedFile = /\.(gz|zst|parquet)$/;
const compressedText = /\.(gz|zst)$/;

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
