// `meshtrain prepare --jsonl <field>`: a JSON Lines file, plain or compressed (.gz: gzip, .zst:
// zstd, both by node:zlib, the zstd frames checked by zstd-frames.ts), read as a stream a line at a time, so memory holds one chunk and one
// line whatever the file's size.
import { createReadStream } from "node:fs";
import { pipeline, type Readable } from "node:stream";
import { createGunzip, createZstdDecompress } from "node:zlib";
import { DataFileError } from "../../engine/data/errors.ts";
import { shownPath } from "../user-paths.ts";
import type { Document } from "./prepare-sources.ts";
import { lineBlocks } from "./prepare-lines.ts";
import { decodeUtf8, type InvalidUtf8 } from "./prepare-utf8.ts";
import { ZstdFrameCheck } from "./zstd-frames.ts";

/** The names a JSON Lines file goes by; the extension after .jsonl says how it is compressed. */
export const jsonlFile = /\.jsonl(\.gz|\.zst)?$/;

/** A line's bytes at most: a document that long is surely a file that is not JSON Lines, and
 *  reading on would hold all of it in memory. */
export const jsonlLineBytesMax = 1 << 28;

function decompressed(path: string): Readable {
  const raw = createReadStream(path);
  if (path.endsWith(".gz")) return raw.pipe(createGunzip());
  // the frames are checked as they pass: Bun's decompressor says nothing of a file cut short
  if (path.endsWith(".zst")) return pipeline(raw, new ZstdFrameCheck(path), createZstdDecompress(), () => {});
  return raw;
}

/** The file's lines as bytes, with where each begins (its line number, its byte offset). */
async function* lines(path: string): AsyncGenerator<{ bytes: Uint8Array; line: number; offset: number }> {
  const tooLong = (_: Buffer, line: number): never => {
    throw new DataFileError(path, `line ${line}: longer than ${jsonlLineBytesMax} bytes; is it JSON Lines?`);
  };
  for await (const b of lineBlocks(path, decompressed(path), jsonlLineBytesMax, tooLong)) {
    let line = b.line;
    for (let start = 0; start < b.bytes.length; line++) {
      const nl = b.bytes.indexOf(0x0a, start);
      const end = nl < 0 ? b.bytes.length : nl;
      yield { bytes: b.bytes.subarray(start, end), line, offset: b.offset + start };
      start = end + 1;
    }
  }
}

/** A JSON Lines file's documents: each line's `field`, a string; blank lines are skipped. */
export async function* jsonlDocuments(
  path: string,
  field: string,
  invalidUtf8: InvalidUtf8,
  notes: string[],
): AsyncGenerator<Document> {
  for await (const l of lines(path)) {
    const text = decodeUtf8(l.bytes, { path, line: l.line, offset: l.offset }, invalidUtf8, notes).trim();
    if (text === "") continue;
    let value: unknown;
    try {
      value = JSON.parse(text);
    } catch (e) {
      throw new DataFileError(path, `line ${l.line}: not JSON (${(e as Error).message})`);
    }
    const doc = typeof value === "object" && value !== null ? (value as Record<string, unknown>)[field] : undefined;
    if (typeof doc !== "string")
      throw new DataFileError(path, `line ${l.line}: no string field ${JSON.stringify(field)}`);
    yield { text: doc, where: `${shownPath(path)}:${l.line}` };
  }
}
