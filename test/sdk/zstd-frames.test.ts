// The .zst frame check ahead of the decompressor (sdk/local/zstd-frames.ts): whole files pass
// byte for byte whatever their frames hold, and every cut of one is refused.
import { describe, expect, test } from "bun:test";
import { Readable } from "node:stream";
import { constants, zstdCompressSync, zstdDecompressSync } from "node:zlib";
import { ZstdFrameCheck } from "../../sdk/local/zstd-frames.ts";
import { DataFileError } from "../../engine/data/errors.ts";

/** The bytes through the check, fed in chunks of `chunk` bytes. */
async function through(bytes: Uint8Array, chunk: number): Promise<Buffer> {
  const parts: Buffer[] = [];
  for (let i = 0; i < bytes.length; i += chunk) parts.push(Buffer.from(bytes.subarray(i, i + chunk)));
  const out: Buffer[] = [];
  for await (const b of Readable.from(parts).pipe(new ZstdFrameCheck("t.zst"))) out.push(b as Buffer);
  return Buffer.concat(out);
}

const text = Buffer.from(
  Array.from({ length: 400 }, (_, i) => `line ${i} ${"abcdefghij".slice(i % 7)} ${(i * 7919) % 1000}\n`).join(""),
);
const checksummed = zstdCompressSync(text, { params: { [constants.ZSTD_c_checksumFlag]: 1 } });
const unchecked = zstdCompressSync(text, { params: { [constants.ZSTD_c_checksumFlag]: 0 } });
/** a skippable frame (magic 0x184D2A53) of 5 bytes */
const skippable = Buffer.from([0x53, 0x2a, 0x4d, 0x18, 5, 0, 0, 0, 1, 2, 3, 4, 5]);
/** a frame of one RLE block, "a" 10 times: a single-segment header with a 1-byte content size,
 *  the block header (last, type 1, size 10), the byte */
const rle = Buffer.from([0x28, 0xb5, 0x2f, 0xfd, 0x20, 10, 0x53, 0, 0, 0x61]);
/** a frame of two raw blocks, "hello" then "abc": a single-segment header with a 1-byte content
 *  size (8), then block headers (not last, raw, 5) and (last, raw, 3) with their bytes */
const raw = Buffer.from([
  0x28,
  0xb5,
  0x2f,
  0xfd,
  0x20,
  8,
  40,
  0,
  0,
  ...Buffer.from("hello"),
  25,
  0,
  0,
  ...Buffer.from("abc"),
]);
/** a large frame: many compressed blocks of 128 KB */
const large = zstdCompressSync(
  Buffer.from(Array.from({ length: 600_000 }, (_, i) => ((i * 2654435761) >>> 27) + 0x41)),
  { params: { [constants.ZSTD_c_checksumFlag]: 1 } },
);

describe("the zstd frame check", () => {
  const whole: [string, Buffer][] = [
    ["one frame with a checksum", checksummed],
    ["one frame without", unchecked],
    [
      "frames one after another, a skippable frame among them",
      Buffer.concat([unchecked, skippable, checksummed, rle, raw, large]),
    ],
  ];
  test.each(whole)("%s passes unchanged, in any chunking", async (_, bytes) => {
    for (const chunk of [1, 3, 64, bytes.length]) expect((await through(bytes, chunk)).equals(bytes)).toBe(true);
    expect(zstdDecompressSync(bytes).length).toBeGreaterThan(0); // and they are zstd
  });

  test("every cut of a file of several frames is refused, except at a frame's end", async () => {
    const frames = [unchecked, skippable, rle, raw, checksummed];
    const bytes = Buffer.concat(frames);
    const ends = new Set(frames.map((_, i) => Buffer.concat(frames.slice(0, i + 1)).length));
    for (let cut = 1; cut < bytes.length; cut++) {
      const run = through(bytes.subarray(0, cut), 17);
      if (ends.has(cut)) await run;
      else await expect(run).rejects.toThrow(`t.zst: ends inside a zstd frame, at byte ${cut}: the file is truncated`);
    }
  });

  test("an empty file and bytes that are not zstd are refused", async () => {
    await expect(through(Buffer.alloc(0), 1)).rejects.toThrow(
      "t.zst: is empty: a .zst file holds one zstd frame at least",
    );
    await expect(through(Buffer.from("hello world"), 4)).rejects.toThrow(DataFileError);
    await expect(through(Buffer.from("hello world"), 4)).rejects.toThrow(
      "t.zst: is not zstd: no zstd frame begins at byte 0 (magic 0x6c6c6568)",
    );
    // a valid frame, then garbage
    await expect(through(Buffer.concat([unchecked, Buffer.from("junk")]), 5)).rejects.toThrow(
      `no zstd frame begins at byte ${unchecked.length}`,
    );
  });
});
