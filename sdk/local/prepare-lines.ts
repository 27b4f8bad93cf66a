// `meshtrain prepare`'s reading of a text stream (a plain text file, or JSON Lines through gzip or
// zstd): blocks of whole lines, each with the line and byte offset where it begins, so that memory
// holds one block and a bad byte is named by its line whatever the file's size.
import type { Readable } from "node:stream";
import { DataFileError } from "../../engine/data/errors.ts";
import { MeshtrainError } from "../../ffi/errors.ts";
import { readFailure } from "../../engine/data/files.ts";

export interface LineBlock {
  /** whole lines, each ending at a line break (the file's last may not) */
  bytes: Buffer;
  /** the line the block begins on (1-based) */
  line: number;
  /** the byte offset of its start in the (decompressed) stream */
  offset: number;
}

/**
 * The stream's bytes as blocks of whole lines. A line still open past `lineBytesMax` bytes goes
 * to `tooLong`, which says where to cut it (a block then ends there, inside the line) or throws.
 */
export async function* lineBlocks(
  path: string,
  stream: Readable,
  lineBytesMax: number,
  tooLong: (open: Buffer, line: number) => number,
): AsyncGenerator<LineBlock> {
  // the open line's pieces, joined once its end comes (a long line is not copied again per piece)
  let open: Buffer[] = [];
  let openBytes = 0;
  let line = 1;
  let offset = 0;
  const block = (bytes: Buffer): LineBlock => {
    const b = { bytes, line, offset };
    for (let at = bytes.indexOf(0x0a); at >= 0; at = bytes.indexOf(0x0a, at + 1)) line++;
    offset += bytes.length;
    return b;
  };
  try {
    for await (const chunk of stream as AsyncIterable<Buffer>) {
      const end = chunk.lastIndexOf(0x0a) + 1;
      if (end > 0) {
        yield block(open.length === 0 ? chunk.subarray(0, end) : Buffer.concat([...open, chunk.subarray(0, end)]));
        open = [];
        openBytes = 0;
      }
      if (end < chunk.length) {
        open.push(chunk.subarray(end));
        openBytes += chunk.length - end;
      }
      if (openBytes > lineBytesMax) {
        const joined = Buffer.concat(open);
        const cut = tooLong(joined, line);
        if (cut > 0) yield block(joined.subarray(0, cut));
        open = [joined.subarray(cut)];
        openBytes = joined.length - cut;
      }
    }
  } catch (e) {
    if (e instanceof MeshtrainError) throw e;
    throw new DataFileError(path, readFailure(e), { cause: e });
  } finally {
    stream.destroy();
  }
  if (openBytes > 0) yield block(Buffer.concat(open));
}
