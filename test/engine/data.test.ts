// Data readers: the real MNIST and Moby Dick files, token files in both layouts, and every
// malformed-file case with an error that names the file and the problem.
import { afterAll, describe, expect, test } from "bun:test";
import { mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { DataFileError } from "../../engine/data/errors.ts";
import { readDataFile } from "../../engine/data/files.ts";
import { ImageBatcher } from "../../engine/data/images.ts";
import { loadMnist, mnistMean, mnistStd, parseIdx, readIdx } from "../../engine/data/mnist.ts";
import { epochOrder, trainValSplit } from "../../engine/data/sampler.ts";
import { CharVocab, mobyDickPath, readTextFile } from "../../engine/data/text.ts";
import { llmcMagic, readTokenFile, splitTokens, TokenBatcher, writeTokenFile } from "../../engine/data/tokens.ts";
import { ShardWriter, shardPieceTokens } from "../../engine/data/shards.ts";
import { MemoryTokens, readTokens, ShardTokens } from "../../engine/data/token-stream.ts";
import { gpt2Tokenizer, streamDecoder } from "../../engine/data/tokenizer.ts";
import { Rng } from "../../engine/rng.ts";
import { expectThrown } from "../helpers/errors.ts";

const dir = mkdtempSync(join(tmpdir(), "meshtrain-data-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));
const file = (name: string, bytes: Uint8Array | string) => {
  const p = join(dir, name);
  writeFileSync(p, bytes);
  return p;
};

function expectDataError(fn: () => unknown, path: string, fragment: string) {
  const error = expectThrown(fn, DataFileError, path, fragment);
  expect((error as DataFileError).file).toBe(path);
}

/** idx bytes: magic 0 0 type ndims, big-endian dims, data */
function idx(type: number, dims: number[], data: number[]): Uint8Array {
  const head = new Uint8Array(4 + 4 * dims.length);
  head.set([0, 0, type, dims.length]);
  const view = new DataView(head.buffer);
  dims.forEach((d, i) => view.setUint32(4 + 4 * i, d, false));
  return Uint8Array.from([...head, ...data]);
}

describe("MNIST", () => {
  const mnist = loadMnist();
  test("the packaged idx files: 60000 train and 10000 test images of 28x28, labels 0..9", () => {
    expect(mnist.train.count).toBe(60000);
    expect(mnist.test.count).toBe(10000);
    expect([mnist.train.rows, mnist.train.cols]).toEqual([28, 28]);
    expect(mnist.train.images.length).toBe(60000 * 784);
    const counts = new Array(10).fill(0);
    for (const l of mnist.test.labels) counts[l]++;
    expect(counts.every((c) => c > 800)).toBe(true);
  });

  test("batches are normalized and match their labels; epochs reshuffle", () => {
    const b = new ImageBatcher(mnist.test, 100);
    const first = b.batch([0, 1, 2], 0);
    expect(first.inputShape).toEqual([3, 784]);
    expect([...first.targets]).toEqual([...mnist.test.labels.subarray(0, 3)]);
    // pixel 0 is background (0): (0/255 - 0.1307) / 0.3081
    expect(first.inputs[0]).toBeCloseTo(-0.1307 / 0.3081, 5);
    expect(b.batchesPerEpoch(true)).toBe(100);
    const e0 = epochOrder(10000, 1, 0);
    const e1 = epochOrder(10000, 1, 1);
    expect(e0).not.toEqual(e1);
    expect([...e0].sort((x, y) => x - y)).toEqual([...Array(10000).keys()]);
    expect(epochOrder(10000, 1, 0)).toEqual(e0);
  });

  test("seeded train/validation split: disjoint, complete, reproducible; batches draw only their subset", () => {
    const { train, val } = trainValSplit(60000, 0.1, 3);
    expect(val.length).toBe(6000);
    expect(train.length).toBe(54000);
    const all = new Set([...train, ...val]);
    expect(all.size).toBe(60000);
    expect(trainValSplit(60000, 0.1, 3).val).toEqual(val);
    expect(trainValSplit(60000, 0.1, 4).val).not.toEqual(val);
    // the same split asked again is a copy of the one before: the caller owns what it gets
    const again = trainValSplit(60000, 0.1, 4);
    again.val.fill(0);
    expect(trainValSplit(60000, 0.1, 4).val).not.toEqual(again.val);
    expect(trainValSplit(60000, 0.1, 3).val).toEqual(val);
    // a synthetic split whose two pixels encode each sample's id, to see which samples a batch holds
    const count = 300;
    const images = new Uint8Array(count * 2);
    for (let i = 0; i < count; i++) images.set([i & 0xff, i >> 8], 2 * i);
    const synthetic = { images, labels: new Uint8Array(count), count, rows: 1, cols: 2 };
    const small = trainValSplit(count, 0.2, 5);
    const pixel = (x: number) => Math.round((x * mnistStd + mnistMean) * 255) | 0; // | 0: no -0
    const seen: number[] = [];
    for (const batch of new ImageBatcher(synthetic, 7, small.val).epoch(1, 0, true, false)) {
      for (let r = 0; r < batch.targets.length; r++)
        seen.push(pixel(batch.inputs[2 * r]!) + 256 * pixel(batch.inputs[2 * r + 1]!));
    }
    expect(seen.length).toBe(60);
    expect([...seen].sort((a, b) => a - b)).toEqual([...small.val]);
    expect(() => trainValSplit(10, 1, 0)).toThrow(/valFraction/);
    expect(() => new ImageBatcher(synthetic, 7, Uint32Array.of(0, count))).toThrow(/sample id outside the 300 samples/);
  });

  test("malformed idx files", () => {
    expectDataError(() => readIdx(join(dir, "absent")), join(dir, "absent"), "file not found");
    const empty = file("empty", new Uint8Array(0));
    expectDataError(() => readIdx(empty), empty, "file is empty");
    expectDataError(() => parseIdx("x", Uint8Array.of(1, 2, 3, 4)), "x", "not an idx file");
    expectDataError(() => parseIdx("x", idx(0x0d, [2], [0, 0])), "x", "unsupported idx element type 0xd");
    expectDataError(
      () => parseIdx("x", idx(0x08, [2, 2], [1, 2, 3])),
      "x",
      "truncated: dims [2, 2] need 4 data bytes, file has 3",
    );
    expectDataError(() => parseIdx("x", idx(0x08, [2], [1, 2, 3])), "x", "trailing bytes");
    expectDataError(() => parseIdx("x", Uint8Array.of(0, 0, 8, 2, 0, 0)), "x", "truncated idx header");
    expectDataError(() => parseIdx("x", idx(0x08, [0], [])), "x", "dimension 0 is zero");
  });

  test("a folder whose labels do not match its images", () => {
    const bad = mkdtempSync(join(dir, "mnist-"));
    const img = idx(0x08, [2, 2, 2], [0, 1, 2, 3, 4, 5, 6, 7]);
    writeFileSync(join(bad, "train-images-idx3-ubyte"), img);
    writeFileSync(join(bad, "t10k-images-idx3-ubyte"), img);
    writeFileSync(join(bad, "train-labels-idx1-ubyte"), idx(0x08, [3], [1, 2, 3]));
    writeFileSync(join(bad, "t10k-labels-idx1-ubyte"), idx(0x08, [2], [1, 2]));
    expectDataError(() => loadMnist(bad), join(bad, "train-labels-idx1-ubyte"), "3 labels for 2 images");
    writeFileSync(join(bad, "train-labels-idx1-ubyte"), idx(0x08, [2], [1, 12]));
    expectDataError(() => loadMnist(bad), join(bad, "train-labels-idx1-ubyte"), "label 12 at index 1 is outside 0..9");
  });
});

describe("character-level text", () => {
  test("Moby Dick from its npm package: 1.19M characters, 83 distinct", () => {
    const text = readTextFile(mobyDickPath());
    expect(text.startsWith("CHAPTER 1. Loomings.")).toBe(true);
    const vocab = CharVocab.fromText(text);
    expect(vocab.size).toBe(83);
    const sample = text.slice(1000, 3000);
    expect(vocab.decode(vocab.encode(sample))).toBe(sample);
  });

  test("code points, not UTF-16 units; unknown characters are named", () => {
    const vocab = CharVocab.fromText("ab—🐋");
    expect(vocab.size).toBe(4);
    expect([...vocab.encode("🐋a")]).toEqual([3, 0]);
    expect(() => vocab.encode("abc")).toThrow(/character "c" \(U\+63\) at position 2/);
  });

  test("invalid UTF-8 and missing files", () => {
    const bad = file("bad.txt", Uint8Array.of(0x61, 0xff, 0x62));
    expectDataError(() => readTextFile(bad), bad, "not valid UTF-8");
    expectDataError(() => readTextFile(join(dir, "nope.txt")), join(dir, "nope.txt"), "file not found");
    expectDataError(() => readTextFile(dir), dir, "not a regular file");
  });
});

describe("uint16 token files", () => {
  const tokens = Uint16Array.from({ length: 1001 }, (_, i) => (i * 7) % 50257);

  test("llm.c layout round trip", () => {
    const p = join(dir, "train.bin");
    writeTokenFile(p, tokens, "llmc");
    expect(readTokenFile(p)).toEqual(tokens);
  });

  test("nanoGPT raw layout round trip", () => {
    const p = join(dir, "raw.bin");
    writeTokenFile(p, tokens, "raw");
    expect(readTokenFile(p)).toEqual(tokens);
  });

  test("malformed token files", () => {
    const header = (magic: number, version: number, count: number, extra: number) => {
      const h = new Int32Array(256);
      h.set([magic, version, count]);
      return Uint8Array.from([...new Uint8Array(h.buffer), ...new Uint8Array(extra)]);
    };
    const v2 = file("v2.bin", header(llmcMagic, 2, 3, 12));
    expectDataError(() => readTokenFile(v2), v2, "version 2 is not supported");
    const short = file("short.bin", header(llmcMagic, 1, 10, 6));
    expectDataError(() => readTokenFile(short), short, "header says 10 tokens");
    const odd = file("odd.bin", Uint8Array.of(1, 2, 3));
    expectDataError(() => readTokenFile(odd), odd, "odd byte count");
    const cut = file("cut.bin", header(llmcMagic, 1, 1, 0).subarray(0, 100));
    expectDataError(() => readTokenFile(cut), cut, "truncated llm.c header");
  });

  test("windows: targets are inputs shifted by one; sequential covers every window once", () => {
    const stream = Uint16Array.from({ length: 50 }, (_, i) => i % 10);
    const batcher = new TokenBatcher(stream, 4, 8, 10);
    const b = batcher.random(new Rng(1));
    expect(b.inputShape).toEqual([4, 8]);
    for (let i = 0; i < 32; i++) expect(b.targets[i]).toBe((b.inputs[i]! + 1) % 10);
    const seen: number[] = [];
    for (const s of batcher.sequential()) seen.push(...s.inputs.filter((_, i) => i % 8 === 0));
    expect(seen).toEqual([0, 8, 6, 4, 2, 0]); // windows start at 0, 8, 16, 24, 32, 40
    expect(() => new TokenBatcher(stream.subarray(0, 8), 1, 8, 10)).toThrow(
      "the token stream holds 8 tokens, too few for one window of 8 + 1",
    );
    expect(() => new TokenBatcher(stream, 1, 8, 5).random(new Rng(1))).toThrow(/outside the vocabulary of 5/);
  });

  test("shards streamed from disk: any window, across shard boundaries, equals the joined stream; a shard unlike its manifest is named", () => {
    const d = mkdtempSync(join(dir, "shards-"));
    const all = Uint16Array.from({ length: 1000 }, (_, i) => (i * 31 + 7) % 50257);
    const w = new ShardWriter(d, 97); // 10 full shards and one of 30
    w.push("train", all.subarray(0, 400));
    w.push("train", Array.from(all.subarray(400)));
    const shards = w.finish();
    expect(shards.map((s) => s.tokens)).toEqual([...Array(10).fill(97), 30]);
    const disk = new ShardTokens(d, shards);
    const memory = new MemoryTokens(all);
    expect(disk.length).toBe(1000);
    for (const [start, count] of [
      [0, 1000],
      [0, 97],
      [96, 2],
      [97, 97],
      [90, 300],
      [969, 31],
      [999, 1],
      [500, 0],
    ] as const)
      expect(readTokens(disk, start, count)).toEqual(readTokens(memory, start, count));
    const out = new Uint16Array(10);
    disk.read(95, 4, out, 3);
    expect(Array.from(out.subarray(3, 7))).toEqual(Array.from(all.subarray(95, 99)));
    expect(() => disk.read(990, 11, out)).toThrow(/outside \[0, 1000\)/);
    // the sequential pass over windows reads the same batches from disk as from memory
    const a = [...new TokenBatcher(disk, 3, 16, 50257).sequential()].map((b) => Array.from(b.inputs));
    const b = [...new TokenBatcher(all, 3, 16, 50257).sequential()].map((b) => Array.from(b.inputs));
    expect(a).toEqual(b);
    disk.close();
    // a shard that is not what the manifest says: fewer tokens, cut short, not a shard
    const lying = new ShardTokens(d, [{ ...shards[0]!, tokens: 98 }]);
    expectDataError(() => lying.read(0, 1, out), join(d, shards[0]!.file), "holds 97 tokens, the manifest says 98");
    writeFileSync(join(d, shards[1]!.file), new Uint8Array(1024 + 50));
    expectDataError(
      () => new ShardTokens(d, [shards[1]!]).read(0, 1, out),
      join(d, shards[1]!.file),
      "not an llm.c token shard",
    );
    const cut = file("cut-shard.bin", new Uint8Array(readFileSync(join(d, shards[2]!.file)).subarray(0, 1024 + 100)));
    expectDataError(
      () => new ShardTokens(dir, [{ ...shards[2]!, file: "cut-shard.bin" }]).read(0, 1, out),
      cut,
      "is 1124 bytes, its header says 1218",
    );
  });

  test("a shard larger than the writer's piece in memory is streamed to its file: the same tokens, the file's crc32, no temp file left", () => {
    const d = mkdtempSync(join(dir, "big-shards-"));
    const shardTokens = 2 * shardPieceTokens + 5;
    const all = Uint16Array.from({ length: 5 * shardPieceTokens + 3 }, (_, i) => (i * 7919 + 13) % 50257);
    const w = new ShardWriter(d, shardTokens);
    // pushes of odd sizes, one crossing a piece and a shard at once
    for (let at = 0, n = 1; at < all.length; at += n, n = (n * 3 + 1) % (shardPieceTokens + 11) || 1)
      w.push("train", all.subarray(at, Math.min(at + n, all.length)));
    w.push("val", [1, 2, 3]);
    const shards = w.finish();
    expect(shards.filter((s) => s.split === "train").map((s) => s.tokens)).toEqual([
      shardTokens,
      shardTokens,
      all.length - 2 * shardTokens,
    ]);
    for (const s of shards) {
      const bytes = readFileSync(join(d, s.file));
      expect(s.crc32).toBe((Bun.hash.crc32(bytes) >>> 0).toString(16).padStart(8, "0"));
    }
    expect(readdirSync(d).filter((f) => f.includes(".tmp-"))).toEqual([]);
    const disk = new ShardTokens(
      d,
      shards.filter((s) => s.split === "train"),
    );
    expect(readTokens(disk, 0, all.length)).toEqual(readTokens(new MemoryTokens(all), 0, all.length));
    disk.close();
    expect(Array.from(readTokenFile(join(d, shards.find((s) => s.split === "val")!.file)))).toEqual([1, 2, 3]);
  });

  test("train/validation split keeps order", () => {
    const { train, val } = splitTokens(
      Uint16Array.from({ length: 100 }, (_, i) => i),
      0.1,
    );
    expect(train.length).toBe(90);
    expect(val[0]).toBe(90);
    expect(() => splitTokens(tokens, 0)).toThrow(/valFraction/);
  });
});

describe("streamed decoding", () => {
  test("a GPT-2 token that ends inside a UTF-8 character is held back until the next completes it", () => {
    const tok = gpt2Tokenizer();
    const text = "subsequent🙂at, hé€ 你好";
    const ids = Array.from(tok.encode(text));
    // the sequence does split characters: some tokens alone decode to U+FFFD
    expect(ids.some((id) => tok.decode([id]).includes("\uFFFD"))).toBe(true);
    const writes: string[] = [];
    const stream = streamDecoder(tok.decode, (s) => writes.push(s));
    for (const id of ids) stream.push(id);
    stream.end();
    expect(writes.join("")).toBe(text);
    expect(writes.some((w) => w.includes("\uFFFD"))).toBe(false);
    expect(writes.length).toBeGreaterThan(3); // streamed, not written once at the end
  });

  test("a character never completed is written at the end, as decoding all at once gives it", () => {
    const tok = gpt2Tokenizer();
    const emoji = Array.from(tok.encode("🙂"));
    const cut = [...Array.from(tok.encode("a")), emoji[0]!];
    const writes: string[] = [];
    const stream = streamDecoder(tok.decode, (s) => writes.push(s));
    for (const id of cut) stream.push(id);
    expect(writes.join("")).toBe("a");
    stream.end();
    expect(writes.join("")).toBe(tok.decode(cut));
  });
});

test("a data file that cannot be read says why in words, not the system call's code", () => {
  const file = join(dir, "a-file.txt");
  writeFileSync(file, "text\n");
  for (const [path, why] of [
    [join(dir, "absent.bin"), "file not found"],
    [join(file, "inside.bin"), "cannot be read: a part of its path is a file, not a folder"],
    [dir, "is not a regular file"],
  ] as const) {
    const e = expectThrown(() => readDataFile(path), DataFileError);
    expect(e.message).toBe(`${path}: ${why}`);
  }
});
