// A split's tokens as a stream that is read, not held: in memory (a text's, a train.bin's), or
// a prepared folder's shards read from disk in bounded pieces (pread of exactly the window
// asked for), so a corpus larger than memory trains with a flat resident set. A window may cross
// from one shard into the next.
import { closeSync, fstatSync, openSync, readSync } from "node:fs";
import { join } from "node:path";
import { DataFileError } from "./errors.ts";
import { fileCrc32, readFailure } from "./files.ts";

export interface Tokens {
  readonly length: number;
  /** tokens [start, start + count) into out[outOffset...] */
  read(start: number, count: number, out: Uint16Array, outOffset?: number): void;
  /** lets go of what it holds open (files); reading again opens them again */
  close(): void;
}

export class MemoryTokens implements Tokens {
  constructor(readonly data: Uint16Array) {}
  get length(): number {
    return this.data.length;
  }
  read(start: number, count: number, out: Uint16Array, outOffset = 0): void {
    if (start < 0 || start + count > this.data.length)
      throw new RangeError(`tokens [${start}, ${start + count}) outside [0, ${this.data.length})`);
    out.set(this.data.subarray(start, start + count), outOffset);
  }
  close(): void {}
}

export const asTokens = (t: Tokens | Uint16Array): Tokens => (t instanceof Uint16Array ? new MemoryTokens(t) : t);

/** tokens [start, start + count) as a new array */
export function readTokens(t: Tokens, start: number, count: number): Uint16Array {
  const out = new Uint16Array(count);
  t.read(start, count, out);
  return out;
}

/** llm.c's token file: a header of 256 int32 (magic, version, token count, ...), then uint16 tokens */
export const llmcMagic = 20240520;
export const llmcVersionU16 = 1;
const headerBytes = 256 * 4;

/** A split's shards, read from disk a window at a time (file descriptors opened on first use). */
export class ShardTokens implements Tokens {
  readonly length: number;
  readonly #starts: number[] = [];
  readonly #fds = new Map<number, number>();
  /** the shards whose bytes matched their crc32 */
  readonly #verified = new Set<number>();

  constructor(
    readonly dir: string,
    /** each shard's file in `dir`, its token count and crc32, in order (a manifest's entries: shards.ts) */
    readonly shards: readonly { file: string; tokens: number; crc32?: string }[],
    /**
     * checkCrcs: each shard's bytes against its crc32, read whole the first time the shard is
     * opened (a validation split's: a byte changed since prepare wrote it would change every loss
     * read from it without a word). A training split, many times larger, is not read twice so.
     */
    readonly o: { checkCrcs?: boolean } = {},
  ) {
    let at = 0;
    for (const s of shards) {
      this.#starts.push(at);
      at += s.tokens;
    }
    this.length = at;
  }

  #fd(i: number): number {
    let fd = this.#fds.get(i);
    if (fd === undefined) {
      const path = join(this.dir, this.shards[i]!.file);
      try {
        fd = openSync(path, "r");
      } catch (e) {
        throw new DataFileError(path, readFailure(e), { cause: e });
      }
      try {
        this.#checkHeader(fd, path, this.shards[i]!.tokens);
        this.#checkCrc(fd, path, i);
      } catch (e) {
        closeSync(fd);
        throw e;
      }
      this.#fds.set(i, fd);
    }
    return fd;
  }

  /** A shard is what its manifest entry says: llm.c's header, version 1, the same token count, that many bytes. */
  #checkHeader(fd: number, path: string, tokens: number): void {
    const head = new Int32Array(3);
    const got = readSync(fd, new Uint8Array(head.buffer), 0, 12, 0);
    const size = fstatSync(fd).size;
    if (got < 12 || head[0] !== llmcMagic)
      throw new DataFileError(path, "is not an llm.c token shard (no magic 20240520 in its header)");
    if (head[1] !== llmcVersionU16)
      throw new DataFileError(
        path,
        `llm.c token file version ${head[1]} is not supported (only version 1, uint16 tokens)`,
      );
    if (head[2] !== tokens) throw new DataFileError(path, `holds ${head[2]} tokens, the manifest says ${tokens}`);
    if (size !== headerBytes + 2 * tokens)
      throw new DataFileError(path, `is ${size} bytes, its header says ${headerBytes + 2 * tokens}`);
  }

  #checkCrc(fd: number, path: string, i: number): void {
    const want = this.shards[i]!.crc32;
    if (!this.o.checkCrcs || want === undefined || this.#verified.has(i)) return;
    const crc = (fileCrc32(fd, fstatSync(fd).size) >>> 0).toString(16).padStart(8, "0");
    if (crc !== want)
      throw new DataFileError(
        path,
        `does not match the manifest's crc32 (${crc}, not ${want}): it changed since prepare wrote it; prepare the folder again`,
      );
    this.#verified.add(i);
  }

  /** The shard holding token `at` (binary search over their first tokens). */
  #shardOf(at: number): number {
    let lo = 0,
      hi = this.shards.length - 1;
    while (lo < hi) {
      const mid = (lo + hi + 1) >> 1;
      if (this.#starts[mid]! <= at) lo = mid;
      else hi = mid - 1;
    }
    return lo;
  }

  read(start: number, count: number, out: Uint16Array, outOffset = 0): void {
    if (start < 0 || count < 0 || start + count > this.length)
      throw new RangeError(`tokens [${start}, ${start + count}) outside [0, ${this.length})`);
    let at = start,
      left = count,
      o = outOffset;
    while (left > 0) {
      const i = this.#shardOf(at);
      const local = at - this.#starts[i]!;
      const n = Math.min(left, this.shards[i]!.tokens - local);
      const bytes = new Uint8Array(out.buffer, out.byteOffset + 2 * o, 2 * n);
      const got = readSync(this.#fd(i), bytes, 0, bytes.length, headerBytes + 2 * local);
      if (got !== bytes.length)
        throw new DataFileError(
          join(this.dir, this.shards[i]!.file),
          `is shorter than its manifest says (read ${got} of ${bytes.length} bytes at token ${local})`,
        );
      at += n;
      left -= n;
      o += n;
    }
  }

  close(): void {
    for (const fd of this.#fds.values()) closeSync(fd);
    this.#fds.clear();
  }
}
