// A check of a .zst file's frame structure as its bytes stream past, ahead of the decompressor.
// Bun's zstd decompressor (node:zlib's createZstdDecompress) ends without an error at a premature
// end of input: a file cut inside a frame gave the documents before the cut and no word of the
// rest. This walks the frames as RFC 8878 lays them out (a frame header, then blocks, each with
// a 3-byte header giving its size and whether it is the last, then an optional checksum; or a
// skippable frame with its size), without decompressing, and fails at the end of the file unless
// the last frame ended there.
import { Transform, type TransformCallback } from "node:stream";
import { DataFileError } from "../../engine/data/errors.ts";

const zstdMagic = 0xfd2fb528;
/** skippable frames: 0x184D2A50 to 0x184D2A5F */
const skippableMagic = 0x184d2a50;
/** a frame header's Dictionary_ID field size, by its 2-bit flag */
const dictIdBytes = [0, 1, 2, 4];
/** its Frame_Content_Size field size, by its 2-bit flag (flag 0: 1 byte in a single-segment frame, else none) */
const contentSizeBytes = [0, 2, 4, 8];

type Field = "magic" | "skippable size" | "frame header" | "block header";

export class ZstdFrameCheck extends Transform {
  readonly #path: string;
  /** the field being gathered, its bytes so far, and how many it has */
  #field: Field = "magic";
  readonly #bytes = new Uint8Array(4);
  #have = 0;
  #want = 4;
  /** bytes to pass over before the next field (a block's contents, a header's optional fields) */
  #skip = 0;
  #checksum = false;
  #frames = 0;
  /** bytes seen so far */
  #offset = 0;

  constructor(path: string) {
    super();
    this.#path = path;
  }

  override _transform(chunk: Buffer, _encoding: BufferEncoding, done: TransformCallback): void {
    try {
      this.#scan(chunk);
    } catch (e) {
      done(e as Error);
      return;
    }
    done(null, chunk);
  }

  override _flush(done: TransformCallback): void {
    if (this.#field === "magic" && this.#have === 0 && this.#skip === 0 && this.#frames > 0) done();
    else
      done(
        new DataFileError(
          this.#path,
          this.#frames === 0 && this.#offset === 0
            ? "is empty: a .zst file holds one zstd frame at least"
            : `ends inside a zstd frame, at byte ${this.#offset}: the file is truncated`,
        ),
      );
  }

  #scan(chunk: Uint8Array): void {
    let i = 0;
    while (i < chunk.length) {
      if (this.#skip > 0) {
        const n = Math.min(this.#skip, chunk.length - i);
        this.#skip -= n;
        i += n;
        this.#offset += n;
        continue;
      }
      const n = Math.min(this.#want - this.#have, chunk.length - i);
      this.#bytes.set(chunk.subarray(i, i + n), this.#have);
      this.#have += n;
      i += n;
      this.#offset += n;
      if (this.#have < this.#want) return;
      this.#have = 0;
      this.#parse();
    }
  }

  #parse(): void {
    const b = this.#bytes;
    switch (this.#field) {
      case "magic": {
        const magic = (b[0]! | (b[1]! << 8) | (b[2]! << 16) | (b[3]! << 24)) >>> 0;
        if (magic === zstdMagic) this.#next("frame header", 1);
        else if ((magic & 0xfffffff0) >>> 0 === skippableMagic) this.#next("skippable size", 4);
        else
          throw new DataFileError(
            this.#path,
            `is not zstd: no zstd frame begins at byte ${this.#offset - 4} (magic 0x${magic.toString(16).padStart(8, "0")})`,
          );
        return;
      }
      case "skippable size":
        this.#skip = (b[0]! | (b[1]! << 8) | (b[2]! << 16) | (b[3]! << 24)) >>> 0;
        this.#frames++;
        this.#next("magic", 4);
        return;
      case "frame header": {
        const d = b[0]!;
        if (d & 0x08)
          throw new DataFileError(
            this.#path,
            `is not zstd: a frame header's reserved bit is set (byte ${this.#offset - 1})`,
          );
        const singleSegment = (d >> 5) & 1;
        const contentFlag = d >> 6;
        this.#checksum = ((d >> 2) & 1) === 1;
        this.#skip =
          (singleSegment ? 0 : 1) +
          dictIdBytes[d & 3]! +
          (contentFlag === 0 ? singleSegment : contentSizeBytes[contentFlag]!);
        this.#next("block header", 3);
        return;
      }
      case "block header": {
        const h = b[0]! | (b[1]! << 8) | (b[2]! << 16);
        const last = h & 1;
        const type = (h >> 1) & 3;
        if (type === 3)
          throw new DataFileError(this.#path, `is not zstd: a block of the reserved type at byte ${this.#offset - 3}`);
        // an RLE block holds one byte, repeated size times
        this.#skip = type === 1 ? 1 : h >>> 3;
        if (last) {
          if (this.#checksum) this.#skip += 4;
          this.#frames++;
          this.#next("magic", 4);
        } else this.#next("block header", 3);
        return;
      }
    }
  }

  #next(field: Field, want: number): void {
    this.#field = field;
    this.#want = want;
  }
}
