// `meshtrain prepare`: text to llm.c token shards with a manifest. The same input gives the same
// bytes, an interrupted prepare run again gives them too, shards are bounded and checksummed,
// documents are split by a seeded draw, GPT-2's <|endoftext|> comes before each document, and
// bad input is one clear error naming the file and line.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import {
  existsSync,
  mkdirSync,
  mkdtempSync,
  readdirSync,
  readFileSync,
  rmSync,
  symlinkSync,
  writeFileSync,
} from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { gzipSync, zstdCompressSync } from "node:zlib";
import { parquetWriteFile } from "hyparquet-writer";
import { ConfigError } from "../../ffi/errors.ts";
import { loadCorpus } from "../../engine/data/corpus.ts";
import { DataFileError } from "../../engine/data/errors.ts";
import { readManifest, readSplit } from "../../engine/data/shards.ts";
import { readTokens } from "../../engine/data/token-stream.ts";
import { mobyDickPath } from "../../engine/data/text.ts";
import { gpt2PieceEnd } from "../../engine/data/gpt2-pieces.ts";
import { PieceTable } from "../../engine/data/piece-table.ts";
import { gpt2EndOfText, gpt2FastTokenizer, gpt2Tokenizer } from "../../engine/data/tokenizer.ts";
import gpt2Ranks from "js-tiktoken/ranks/gpt2";
import { llmcMagic, readTokenFile } from "../../engine/data/tokens.ts";
import { type PrepareOptions, prepareDefaults, runPrepare } from "../../sdk/local/prepare.ts";
import { invalidUtf8At } from "../../sdk/local/prepare-utf8.ts";
import { type Document, documents, isPieceBoundary } from "../../sdk/local/prepare-sources.ts";
import { lineBlocks } from "../../sdk/local/prepare-lines.ts";
import { Readable } from "node:stream";
import { sotuDir } from "../helpers/big-corpus.ts";
import { runCli } from "../helpers/cli.ts";

const dir = mkdtempSync(join(tmpdir(), "meshtrain-prepare-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const root = join(import.meta.dir, "..", "..");
const opts = (over: Partial<PrepareOptions> & { text: string; out: string }): PrepareOptions => ({
  ...prepareDefaults,
  quiet: true,
  ...over,
});
const files = (d: string) =>
  readdirSync(d)
    .sort()
    .map((f) => [f, readFileSync(join(d, f))] as const);

/** A folder of n small documents. */
function corpus(name: string, n: number): string {
  const d = join(dir, name);
  mkdirSync(d, { recursive: true });
  for (let i = 0; i < n; i++)
    writeFileSync(
      join(d, `doc-${String(i).padStart(3, "0")}.txt`),
      `Document ${i}. ${"The whale swims on. ".repeat(1 + (i % 7))}\n`,
    );
  writeFileSync(join(d, "README.md"), "not a document");
  return d;
}

const bad = (name: string, content: string | Uint8Array) => {
  const p = join(dir, name);
  writeFileSync(p, content);
  return p;
};

describe("prepare", () => {
  test("a folder: each .txt a document, <|endoftext|> before each, shards bounded and checksummed, the same bytes every time", async () => {
    const src = corpus("docs", 60);
    const a = join(dir, "a"),
      b = join(dir, "b");
    const r = await runPrepare(opts({ text: src, out: a, shardTokens: 1024, valFraction: 0.2 }));
    await runPrepare(opts({ text: src, out: b, shardTokens: 1024, valFraction: 0.2 }));
    expect(files(b)).toEqual(files(a));
    const m = r.manifest;
    expect(m.documents.train + m.documents.val).toBe(60);
    expect(m.documents.val).toBeGreaterThan(3);
    expect(m.documents.val).toBeLessThan(25);
    expect(m.shards.filter((s) => s.split === "train").length).toBeGreaterThan(1);
    for (const s of m.shards) {
      const bytes = readFileSync(join(a, s.file));
      expect(new DataView(bytes.buffer, bytes.byteOffset).getInt32(0, true)).toBe(llmcMagic);
      expect(s.tokens).toBeLessThanOrEqual(1024);
      expect((Bun.hash.crc32(bytes) >>> 0).toString(16).padStart(8, "0")).toBe(s.crc32);
    }
    // the train split decodes to its documents, each after <|endoftext|>
    const train = readSplit(a, readManifest(a)!, "train");
    expect(train.length).toBe(m.tokens.train);
    expect(train[0]).toBe(gpt2EndOfText);
    const texts = gpt2Tokenizer().decode(train).split("<|endoftext|>").slice(1);
    expect(texts.length).toBe(m.documents.train);
    expect(texts[0]).toStartWith("Document ");
    // a different seed draws another split
    const c = join(dir, "c");
    await runPrepare(opts({ text: src, out: c, shardTokens: 1024, valFraction: 0.2, seed: 2 }));
    expect(files(c)).not.toEqual(files(a));
  });

  test("an interrupted prepare, run again, gives the same result (stale shards and temp files are removed first)", async () => {
    const src = corpus("docs2", 20);
    const fresh = join(dir, "fresh"),
      again = join(dir, "again");
    await runPrepare(opts({ text: src, out: fresh, shardTokens: 512, valFraction: 0.3 }));
    mkdirSync(again);
    writeFileSync(join(again, "train_000000.bin"), "half a shard");
    writeFileSync(join(again, "train_000007.bin"), "a shard of a larger run");
    writeFileSync(join(again, "manifest.json.tmp-123"), "{");
    await runPrepare(opts({ text: src, out: again, shardTokens: 512, valFraction: 0.3 }));
    expect(files(again)).toEqual(files(fresh));
  });

  test("a book is one document: its end held out (characters: vocab.json); train gpt's corpus reads it", async () => {
    const out = join(dir, "moby-char");
    const r = await runPrepare(opts({ text: mobyDickPath(), out, tokenizer: "char" }));
    expect([r.splitRule, r.manifest.documents]).toEqual(["position", { train: 1, val: 1 }]);
    expect(r.manifest.vocabSize).toBe(83);
    const c = loadCorpus({ tokensDir: out, valFraction: 0 });
    expect(c.tokenizer).toBe("char");
    expect(c.vocab!.size).toBe(83);
    // the text itself: its start, then its last tenth (at a place to cut), nothing added between
    const text = readFileSync(mobyDickPath(), "utf8");
    const train = c.vocab!.decode(readTokens(c.train, 0, c.train.length));
    const val = c.vocab!.decode(readTokens(c.val, 0, c.val.length));
    expect(train + val).toBe(text);
    expect(Math.abs(Buffer.byteLength(val) / Buffer.byteLength(text) - 0.1)).toBeLessThan(1e-4);
    expect(() => loadCorpus({ tokensDir: out, vocabSize: 50257, valFraction: 0 })).toThrow(
      /prepared with a vocabulary of 83/,
    );
  });

  test("a plain text is read as a stream of pieces cut where GPT-2's pre-tokenizer always cuts: the whole text's tokens wherever a read ends; a bad byte past the first read named by its line; a text with no place to cut cut at the cap", async () => {
    const read = async (path: string, over: Partial<PrepareOptions> = {}) => {
      const docs: Document[] = [];
      for await (const d of documents(opts({ text: path, out: dir, valFraction: 0, ...over }), [])) docs.push(d);
      return docs;
    };
    // Moby Dick, with blank lines of spaces and tabs, runs of them, and characters of 2 to 4 bytes
    const text = `${readFileSync(mobyDickPath(), "utf8").slice(0, 300_000)}\n \t\n\n\n\t\nélan 🐋 ${"whale ".repeat(3000)}\n\n`;
    const p = bad("stream.txt", text);
    const whole = Array.from(gpt2FastTokenizer().encode(text));
    for (const [readBytes, pieceMin] of <[number, number][]>[
      [61, 50],
      [4096, 1000],
      [1 << 22, 10_000],
    ]) {
      const pieces = await read(p, { textReadBytes: readBytes, textPieceCharsMin: pieceMin });
      expect(pieces.map((d) => d.text).join("")).toBe(text);
      expect(pieces.map((d) => [d.continues, d.heldOut])).toEqual(pieces.map((_, i) => [i > 0, false]));
      // its end held out: the pieces from the first place to cut at or after 70% of its bytes
      const split = await read(p, { textReadBytes: readBytes, textPieceCharsMin: pieceMin, valFraction: 0.3 });
      expect(split.map((d) => d.text).join("")).toBe(text);
      const first = split.findIndex((d) => d.heldOut);
      expect(split.slice(first).every((d) => d.heldOut)).toBe(true);
      const held = split
        .slice(first)
        .map((d) => d.text)
        .join("");
      const cutByte = Math.floor(Buffer.byteLength(text) * 0.7);
      const heldFrom = Buffer.byteLength(text) - Buffer.byteLength(held);
      expect(heldFrom).toBeGreaterThanOrEqual(cutByte);
      expect(isPieceBoundary(text, text.length - held.length)).toBe(true);
      // no place to cut between the held-out byte and the cut
      const fromChar = Buffer.from(text).subarray(0, cutByte).toString().length;
      for (let i = fromChar; i < text.length - held.length; i++) expect(isPieceBoundary(text, i)).toBe(false);
      // a piece is what a read gave (at least pieceMin characters), less what follows its last place to cut
      expect(pieces.length).toBeGreaterThan(text.length / Math.max(readBytes!, pieceMin!) / 2);
      // each piece tokenized apart: the whole text's tokens
      const fast = gpt2FastTokenizer();
      expect(pieces.flatMap((d) => Array.from(fast.encode(d.text)))).toEqual(whole);
    }
    // a bad byte in the second read: its line counts the lines of the reads before
    const latin = bad("stream-latin1.txt", new Uint8Array([...new TextEncoder().encode("a b\n".repeat(5000)), 0xe9]));
    await expect(read(latin, { textReadBytes: 4096 })).rejects.toThrow(
      /stream-latin1\.txt: line 5001: invalid UTF-8 at byte 20000/,
    );
    // no place to cut in 25,000 whales: cut at the cap, never between a surrogate pair's halves
    const endless = bad("endless.txt", `${"🐋 whale\n".repeat(4000)}x${"🐋".repeat(25_000)}`);
    const cut = await read(endless, { textReadBytes: 1000, textPieceCharsMin: 1000, textPieceCharsMax: 20_000 });
    expect(cut.map((d) => d.text).join("")).toBe(readFileSync(endless, "utf8"));
    for (const d of cut.slice(0, -1)) expect(d.text.length).toBeLessThanOrEqual(20_000);
    for (const d of cut) expect(d.text.isWellFormed()).toBe(true);
  });

  test("a folder's subfolders are read too, each folder's entries by name; a link back up is read once", async () => {
    const d = join(dir, "nested");
    mkdirSync(join(d, "b", "c"), { recursive: true });
    writeFileSync(join(d, "a.txt"), "first document");
    writeFileSync(join(d, "b", "c", "x.txt"), "third document");
    writeFileSync(join(d, "b", "b.txt"), "second document");
    writeFileSync(join(d, "b", "skip.md"), "not read");
    writeFileSync(join(d, "z.txt"), "fourth document");
    symlinkSync(d, join(d, "b", "up"));
    const texts: string[] = [];
    for await (const doc of documents(opts({ text: d, out: dir }), [])) texts.push(doc.text);
    expect(texts).toEqual(["first document", "second document", "third document", "fourth document"]);
  });

  test("places to cut: after a character that is not white space, before a line break or a space and a letter", () => {
    const at = (text: string) => [...text].map((_, i) => (isPieceBoundary(text, i) ? "|" : ".")).join("");
    // not before "1" (no letter), after a no-break space (white space) nor between two spaces
    expect(at("ab\ncd ef 12 é\u00a0\nx  y")).toBe("..|..|.....|.......");
    // each kind, tokenized apart and whole: the same tokens
    const fast = gpt2FastTokenizer();
    for (const text of [
      "Hello world",
      "end.\nNext",
      "x\u3000\ny",
      "don't stop",
      "12 apples",
      "a  b",
      "é\nb",
      "鯨\n鯨 whale",
    ]) {
      for (let i = 1; i < text.length; i++)
        if (isPieceBoundary(text, i))
          expect([...fast.encode(text.slice(0, i)), ...fast.encode(text.slice(i))]).toEqual([...fast.encode(text)]);
    }
  });

  test("blocks of whole lines, whatever the chunks: each with its line and byte offset; a line still open past the limit goes to tooLong", async () => {
    const text = "ab\ncd\n\néé fgh\nij";
    const bytes = Buffer.from(text);
    const read = async (
      size: number,
      max: number,
      tooLong = (_: Buffer, l: number): number => {
        throw new Error(`line ${l} too long`);
      },
    ) => {
      const chunks = Array.from({ length: Math.ceil(bytes.length / size) }, (_, i) =>
        bytes.subarray(i * size, (i + 1) * size),
      );
      const out: { text: string; line: number; offset: number }[] = [];
      for await (const b of lineBlocks("x", Readable.from(chunks), max, tooLong))
        out.push({ text: b.bytes.toString("utf8"), line: b.line, offset: b.offset });
      return out;
    };
    for (const size of [1, 3, 5, 100]) {
      const blocks = await read(size, 100);
      expect(blocks.map((b) => b.text).join("")).toBe(text);
      for (const b of blocks) {
        expect(bytes.subarray(b.offset, b.offset + Buffer.byteLength(b.text)).toString("utf8")).toBe(b.text);
        expect(b.line).toBe(bytes.subarray(0, b.offset).toString("utf8").split("\n").length);
        if (b !== blocks.at(-1)) expect(b.text.endsWith("\n")).toBe(true);
      }
    }
    await expect(read(2, 3)).rejects.toThrow("line 4 too long");
  });

  test("JSON Lines: one document per line, from the named field", async () => {
    const path = join(dir, "docs.jsonl");
    writeFileSync(
      path,
      Array.from({ length: 30 }, (_, i) => JSON.stringify({ id: i, text: `line ${i}: the sea` })).join("\n"),
    );
    const r = await runPrepare(opts({ text: path, jsonl: "text", out: join(dir, "jsonl"), valFraction: 0.2 }));
    expect(r.manifest.documents.train + r.manifest.documents.val).toBe(30);
  });

  test("a folder of 11 Markdown files: split by document, at least one in validation, whatever the seed", async () => {
    const src = join(dir, "md");
    mkdirSync(src);
    for (let i = 0; i < 11; i++) writeFileSync(join(src, `note-${i}.md`), `# Note ${i}\n\nThe whale swims on.\n`);
    for (const seed of [1, 2, 3, 4, 5]) {
      const r = await runPrepare(opts({ text: src, ext: ".md", out: join(dir, `md-${seed}`), seed }));
      expect(r.splitRule).toBe("document");
      expect(r.manifest.splitRule).toBe("document");
      expect(r.manifest.documents.train + r.manifest.documents.val).toBe(11);
      expect(r.manifest.documents.val).toBeGreaterThanOrEqual(1);
      expect(r.manifest.documents.train).toBeGreaterThanOrEqual(1);
    }
    const { code, out } = runCli(root, "prepare", "--text", src, "--ext", ".md", "--out", join(dir, "md-cli"));
    expect(code).toBe(0);
    expect(out).toMatch(/^prepared .*md-cli: 11 documents \(\d+ train, [1-9]\d* val\)/m);
    expect(out).toMatch(/^split by document: each drawn for validation with probability 0\.1 \(seed 1\)/m);
  });

  test("a single text: split by position, the last --val-fraction of it held out, its tokens the whole text's", async () => {
    const text = "Call me Ishmael. Some years ago, never mind how long precisely. ".repeat(40);
    const path = join(dir, "single.txt");
    writeFileSync(path, text);
    const out = join(dir, "single");
    const r = await runPrepare(opts({ text: path, out, valFraction: 0.25 }));
    expect(r.splitRule).toBe("position");
    const ids = Array.from(gpt2Tokenizer().encode(text));
    const m = readManifest(out)!;
    expect(m.splitRule).toBe("position");
    const train = [...readSplit(out, m, "train")];
    const val = [...readSplit(out, m, "val")];
    // <|endoftext|> before the document, none before its held-out end: it continues it
    expect(train[0]).toBe(gpt2EndOfText);
    expect([...train.slice(1), ...val]).toEqual(ids);
    // the end held out is the text's last quarter, to a word
    const held = gpt2Tokenizer().decode(val);
    expect(text.endsWith(held)).toBe(true);
    expect(Math.abs(held.length - text.length / 4)).toBeLessThan(12);
    const c = loadCorpus({ tokensDir: out, valFraction: 0 });
    expect(c.val.length).toBe(val.length);
    const cli = runCli(root, "prepare", "--text", path, "--out", join(dir, "single-cli"), "--val-fraction", "0.25");
    expect(cli.code).toBe(0);
    expect(cli.out).toContain(
      "split by position: one document, the last 0.25 of it held out for validation (as nanoGPT does)",
    );
    expect(cli.out).toMatch(/^prepared .*single-cli: 1 document, [\d,]+ train and [\d,]+ val tokens/m); // not "2 documents"
  });

  test("a validation shard whose bytes changed since prepare wrote it is refused where the corpus is read, naming it", async () => {
    const text = "Call me Ishmael. Some years ago, never mind how long precisely. ".repeat(40);
    const out = join(dir, "flipped");
    await runPrepare(opts({ text: bad("flipped.txt", text), out, valFraction: 0.25 }));
    const val = readManifest(out)!.shards.find((x) => x.split === "val")!;
    const path = join(out, val.file);
    const bytes = readFileSync(path);
    bytes[bytes.length - 3]! ^= 0x01; // a token's low bit: still a token of the vocabulary
    writeFileSync(path, bytes);
    // checked when the shard is first opened: the first window read from it
    const c = loadCorpus({ tokensDir: out, valFraction: 0 });
    expect(() => readTokens(c.val, 0, 1)).toThrow(
      new RegExp(`${val.file}: does not match the manifest's crc32 \\([0-9a-f]{8}, not ${val.crc32}\\)`),
    );
  });

  test("the fast GPT-2 encoder gives js-tiktoken's ids on Moby Dick and the State of the Union", () => {
    const fast = gpt2FastTokenizer(),
      slow = gpt2Tokenizer();
    const books = [
      readFileSync(mobyDickPath(), "utf8"),
      ...readdirSync(sotuDir)
        .filter((f) => f.endsWith(".txt"))
        .sort()
        .map((f) => readFileSync(join(sotuDir, f), "utf8")),
    ];
    for (const text of books) expect(fast.encode(text)).toEqual(Uint16Array.from(slow.encode(text)));
  }, 240_000);

  test("the piece table: a piece seen before is found by its place in the text; a full table encodes what it cannot hold", () => {
    const encoded: string[] = [];
    const table = new PieceTable((p) => (encoded.push(p), [p.length, p.charCodeAt(0)]), 2);
    const text = " the whale the sea the whale";
    const pieces = [" the", " whale", " the", " sea", " the", " whale"];
    let at = 0;
    for (const p of pieces) {
      expect(table.ids(text, at, at + p.length)).toEqual([p.length, p.charCodeAt(0)]);
      at += p.length;
    }
    // " sea" came when the table was full: encoded each time it is asked for
    expect(table.ids(text, 14, 18)).toEqual([4, 32]);
    expect(encoded).toEqual([" the", " whale", " sea", " sea"]);
  });

  test("GPT-2's pieces, cut by the scan, are its pattern's: contractions, runs of white space, other scripts, surrogates", () => {
    const pattern = new RegExp(gpt2Ranks.pat_str, "gu");
    const cases = [
      "He's here, they're 'RE' we'll I'd 'x '' ''s 're' ' 'll",
      "a  b\n\n c \t\td  \n x   ",
      "12 ３４ ٣٤ é鯨 🐋🐋 x\ud800y \udc00 \ud83d",
      "a\u00a0b \u00a0c\u3000d \u2028",
      " ",
      "'",
      "\n\n\n",
      " 's",
    ];
    for (const text of cases) {
      const cut: string[] = [];
      for (let i = 0; i < text.length; ) cut.push(text.slice(i, (i = gpt2PieceEnd(text, i))));
      expect(cut).toEqual([...text.matchAll(pattern)].map((m) => m[0]));
    }
  });

  test("1 and 2 workers write the same bytes (batches of several documents each, shards across them); --workers is checked", async () => {
    const src = corpus("docs-workers", 50);
    writeFileSync(join(src, "doc-big.txt"), "A batch of its own, and more. ".repeat(40_000));
    const [one, two] = [join(dir, "w1"), join(dir, "w2")];
    await runPrepare(opts({ text: src, out: one, shardTokens: 4096, workers: 1 }));
    const r = await runPrepare(opts({ text: src, out: two, shardTokens: 4096, workers: 2, workerBytesMin: 100_000 }));
    expect(r.threads).toBe(2);
    expect(r.manifest.shards.length).toBeGreaterThan(20);
    expect(files(two)).toEqual(files(one));
    await expect(runPrepare(opts({ text: src, out: join(dir, "w0"), workers: 0 }))).rejects.toThrow(
      "--workers must be an integer in [1, 256], got 0",
    );
    const cli = runCli(root, "prepare", "--text", src, "--out", join(dir, "w-cli"), "--workers", "1.5");
    expect(cli.code).not.toBe(0);
    expect(cli.err).toContain("--workers");
  });

  describe("Parquet and compressed JSON Lines give the shards of the same documents as plain files", () => {
    const texts = Array.from(
      { length: 40 },
      (_, i) => `Document ${i}. ${"The whale swims on, é and 鯨. ".repeat(1 + (i % 7))}`,
    );
    const jsonl = texts.map((text, i) => `${JSON.stringify({ id: i, text })}\n`).join("");
    const shardsOf = (d: string) => files(d).filter(([f]) => f.endsWith(".bin"));
    const reference = join(dir, "formats-txt");
    beforeAll(async () => {
      const src = join(dir, "formats-src");
      mkdirSync(src, { recursive: true });
      texts.forEach((t, i) => writeFileSync(join(src, `doc-${String(i).padStart(3, "0")}.txt`), t));
      await runPrepare(opts({ text: src, out: reference, valFraction: 0.2, shardTokens: 1024 }));
    });
    const inputs: [string, () => Partial<PrepareOptions> & { text: string }][] = [
      ["a .jsonl.gz", () => ({ text: bad("docs.jsonl.gz", gzipSync(jsonl)), jsonl: "text" })],
      ["a .jsonl.zst", () => ({ text: bad("docs.jsonl.zst", zstdCompressSync(jsonl)), jsonl: "text" })],
      [
        "a folder of .jsonl, .jsonl.gz and .jsonl.zst files",
        () => {
          const d = join(dir, "jsonl-folder");
          mkdirSync(d, { recursive: true });
          const part = (a: number, b: number) =>
            texts
              .slice(a, b)
              .map((text) => `${JSON.stringify({ text })}\n`)
              .join("");
          writeFileSync(join(d, "a.jsonl"), part(0, 10));
          writeFileSync(join(d, "b.jsonl.gz"), gzipSync(part(10, 25)));
          writeFileSync(join(d, "c.jsonl.zst"), zstdCompressSync(part(25, 40)));
          writeFileSync(join(d, "notes.txt"), "not read");
          return { text: d, jsonl: "text" };
        },
      ],
      [
        "a Parquet file of several row groups",
        () => {
          const text = join(dir, "docs.parquet");
          parquetWriteFile({
            filename: text,
            columnData: [
              { name: "id", data: Int32Array.from(texts, (_, i) => i), type: "INT32" },
              { name: "text", data: texts, type: "STRING" },
            ],
            rowGroupSize: 7,
          });
          return { text, parquet: "text" };
        },
      ],
    ];
    test.each(inputs)("%s", async (_, input) => {
      const out = join(dir, `formats-${_.replace(/\W+/g, "-")}`);
      const r = await runPrepare(opts({ ...input(), out, valFraction: 0.2, shardTokens: 1024 }));
      expect(r.manifest.documents.train + r.manifest.documents.val).toBe(40);
      expect(shardsOf(out)).toEqual(shardsOf(reference));
      const c = loadCorpus({ tokensDir: out, valFraction: 0 });
      expect(readTokens(c.val, 0, c.val.length)).toEqual(readSplit(reference, readManifest(reference)!, "val"));
    });

    test("the CLI reads Parquet; bad Parquet and JSON Lines are one clear error", async () => {
      const pq = join(dir, "docs.parquet");
      const cli = runCli(
        root,
        "prepare",
        "--text",
        pq,
        "--parquet",
        "text",
        "--out",
        join(dir, "pq-cli"),
        "--val-fraction",
        "0.2",
      );
      expect(cli.code).toBe(0);
      expect(cli.out).toMatch(/^prepared .*pq-cli: 40 documents/m);
      await expect(runPrepare(opts({ text: pq, parquet: "body", out: join(dir, "pq-bad") }))).rejects.toThrow(
        'has no column "body"; its columns: id, text',
      );
      // a file whose name says its format, given as plain text: its bytes would be tokenized as they are
      await expect(runPrepare(opts({ text: pq, out: join(dir, "pq-bad") }))).rejects.toThrow(
        "docs.parquet is Parquet: --parquet <column> names the column that holds the text",
      );
      await expect(
        runPrepare(opts({ text: bad("plain.jsonl.gz", gzipSync(jsonl)), out: join(dir, "pq-bad") })),
      ).rejects.toThrow("plain.jsonl.gz is JSON Lines: --jsonl <field> names the field that holds each document");
      await expect(
        runPrepare(opts({ text: bad("not.parquet", "hello"), parquet: "text", out: join(dir, "pq-bad") })),
      ).rejects.toThrow(/not\.parquet: is not a Parquet file/);
      const cut = gzipSync(jsonl).subarray(0, 200);
      await expect(
        runPrepare(opts({ text: bad("cut.jsonl.gz", cut), jsonl: "text", out: join(dir, "gz-bad") })),
      ).rejects.toThrow(/cut\.jsonl\.gz: cannot be read: /);
      // two zstd frames, the second cut short: the first's documents are not taken for the file
      const frames = Buffer.concat([zstdCompressSync(jsonl.slice(0, 900)), zstdCompressSync(jsonl.slice(900))]);
      await expect(
        runPrepare(
          opts({
            text: bad("cut.jsonl.zst", frames.subarray(0, frames.length - 5)),
            jsonl: "text",
            out: join(dir, "zst-cut"),
          }),
        ),
      ).rejects.toThrow(`cut.jsonl.zst: ends inside a zstd frame, at byte ${frames.length - 5}: the file is truncated`);
      const head = Buffer.from(jsonl.slice(0, 400));
      const latin = zstdCompressSync(Buffer.concat([head, Buffer.from([0xe9, 0x0a])]));
      await expect(
        runPrepare(opts({ text: bad("latin.jsonl.zst", latin), jsonl: "text", out: join(dir, "zst-bad") })),
      ).rejects.toThrow(
        `latin.jsonl.zst: line ${head.toString().split("\n").length}: invalid UTF-8 at byte ${head.length}`,
      );
      await expect(
        runPrepare(opts({ text: pq, parquet: "text", jsonl: "text", out: join(dir, "both") })),
      ).rejects.toThrow(ConfigError);
      await expect(runPrepare(opts({ text: pq, parquet: "text", ext: ".md", out: join(dir, "ext") }))).rejects.toThrow(
        "--ext chooses a folder's plain text files; with --parquet a folder's .parquet files are read",
      );
      const latinPq = join(dir, "latin.parquet");
      parquetWriteFile({
        filename: latinPq,
        columnData: [
          {
            name: "text",
            data: [new TextEncoder().encode("fine"), new Uint8Array([0x62, 0xe9, 0x63])],
            type: "BYTE_ARRAY",
          },
        ],
      });
      await expect(runPrepare(opts({ text: latinPq, parquet: "text", out: join(dir, "pq-latin") }))).rejects.toThrow(
        "latin.parquet: row 1: invalid UTF-8 at byte 1; --invalid-utf8 replace",
      );
      const r = await runPrepare(
        opts({ text: latinPq, parquet: "text", out: join(dir, "pq-latin"), invalidUtf8: "replace" }),
      );
      expect(r.notes).toEqual([
        expect.stringMatching(/latin\.parquet: row 1: invalid UTF-8 at byte 1: replaced with U\+FFFD/),
      ]);
    });
  });

  describe("bad input: one error naming the file and line", () => {
    test.each([
      ["a missing input", () => opts({ text: join(dir, "nowhere"), out: join(dir, "o1") }), /nowhere: not found/],
      [
        "an empty corpus",
        () => opts({ text: bad("empty.txt", ""), out: join(dir, "o2") }),
        /holds no document: the corpus is empty/,
      ],
      [
        "a folder without .txt files",
        () =>
          opts({ text: (mkdirSync(join(dir, "none"), { recursive: true }), join(dir, "none")), out: join(dir, "o3") }),
        /holds no \.txt file/,
      ],
      [
        "a JSON line without the field",
        () => opts({ text: bad("nofield.jsonl", '{"text":"a"}\n{"body":"b"}\n'), jsonl: "text", out: join(dir, "o4") }),
        /line 2: no string field "text"/,
      ],
      [
        "a line that is not JSON",
        () => opts({ text: bad("notjson.jsonl", '{"text":"a"}\n{text\n'), jsonl: "text", out: join(dir, "o5") }),
        /line 2: not JSON/,
      ],
      [
        "invalid UTF-8",
        () => opts({ text: bad("latin1.txt", new Uint8Array([0x61, 0x0a, 0x62, 0xe9, 0x63])), out: join(dir, "o6") }),
        /latin1\.txt: line 2: invalid UTF-8 at byte 3; --invalid-utf8 replace/,
      ],
      [
        "a device (read without end)",
        () => opts({ text: "/dev/zero", out: join(dir, "o9") }),
        /\/dev\/zero: is not a regular file or a folder \(prepare reads files, not pipes or devices\)/,
      ],
      [
        "a named pipe (it would wait for a writer)",
        () => {
          const fifo = join(dir, "pipe.txt");
          if (!existsSync(fifo)) Bun.spawnSync(["mkfifo", fifo]);
          return opts({ text: fifo, out: join(dir, "o10") });
        },
        /pipe\.txt: is not a regular file or a folder/,
      ],
      [
        "a folder whose only .txt is a folder",
        () => {
          const d = join(dir, "sub-only");
          mkdirSync(join(d, "inner.txt"), { recursive: true });
          return opts({ text: d, out: join(dir, "o11") });
        },
        /sub-only: holds no \.txt file/,
      ],
      [
        "one document too short to split by position",
        () => opts({ text: bad("one.txt", "w"), out: join(dir, "o7") }),
        /holds one document of 1 token, too short to hold out --val-fraction 0\.1 of it by position/,
      ],
    ])("%s", async (_, make, message) => {
      await expect(runPrepare(make())).rejects.toThrow(DataFileError);
      await expect(runPrepare(make())).rejects.toThrow(message);
    });

    test("invalid UTF-8 replaced on request, and said where", async () => {
      const p = bad("latin1b.txt", new Uint8Array([...new TextEncoder().encode("a\n".repeat(20)), 0x62, 0xe9, 0x63]));
      const r = await runPrepare(opts({ text: p, out: join(dir, "o8"), invalidUtf8: "replace" }));
      expect(r.notes).toEqual([
        expect.stringMatching(/latin1b\.txt:21: invalid UTF-8 at byte 41: replaced with U\+FFFD/),
      ]);
    });

    test("the UTF-8 check: valid text, overlong forms, surrogates, truncation", async () => {
      expect(invalidUtf8At(new TextEncoder().encode("héllo wörld, 鯨, 🐋"))).toBe(-1);
      expect(invalidUtf8At(new Uint8Array([0x41, 0xc0, 0x80]))).toBe(1); // overlong NUL
      expect(invalidUtf8At(new Uint8Array([0xed, 0xa0, 0x80]))).toBe(0); // a surrogate
      expect(invalidUtf8At(new Uint8Array([0x41, 0xe2, 0x82]))).toBe(1); // cut short
      expect(invalidUtf8At(new Uint8Array([0xf4, 0x90, 0x80, 0x80]))).toBe(0); // past U+10FFFF
    });
  });

  test("the CLI: the summary and the next command; tokens of train.bin folders still read as before", async () => {
    const src = corpus("docs3", 40);
    const { code, out } = runCli(root, "prepare", "--text", src, "--out", join(dir, "cli"));
    expect(code).toBe(0);
    expect(out).toMatch(
      /^prepared .*cli: 40 documents \(\d+ train, \d+ val\), [\d,]+ train and [\d,]+ val tokens in 2 shards; gpt2, a vocabulary of 50,257; /m,
    );
    expect(out).toContain(`next: npx meshtrain train gpt --tokens ${join(dir, "cli")}`);
    expect(readTokenFile(join(dir, "cli", "train_000000.bin"))[0]).toBe(gpt2EndOfText);
  });
});

test("a GPT trains on a prepared GPT-2 folder; sample decodes BPE, streaming; eval reads its val shards and says the perplexity", async () => {
  const src = corpus("docs4", 80);
  const data = join(dir, "bpe");
  await runPrepare(opts({ text: src, out: data, valFraction: 0.2 }));
  const cli = (...args: string[]) => runCli(dir, ...args);
  const model = join(dir, "bpe.mtm");
  const train = cli(
    "train",
    "gpt",
    "--tokens",
    data,
    "--n-layer",
    "1",
    "--n-head",
    "2",
    "--n-embd",
    "32",
    "--block-size",
    "32",
    "--batch-size",
    "4",
    "--max-steps",
    "8",
    "--eval-every",
    "8",
    "--warmup",
    "2",
    "--sample-chars",
    "40",
    "--out",
    model,
  );
  expect(train.code).toBe(0);
  expect(train.out).toContain("vocab 50257");
  expect(train.out).toContain("sample (temperature 0.8):");
  expect(train.out).toContain("next: npx meshtrain sample --model bpe.mtm --prompt The");
  const sample = cli("sample", "--model", model, "--prompt", "The whale", "--length", "12");
  expect(sample.code).toBe(0);
  expect(sample.out).toStartWith("The whale");
  expect(sample.out.length).toBeGreaterThan("The whale".length);
  const ev = cli("eval", "--model", model);
  expect(ev.code).toBe(0);
  expect(ev.out).toMatch(
    /^validation loss: [\d.]+ nats\/token on [\d,]+ tokens of .*bpe \(its val shards\) \(\d+ batch(es)? of 4 windows, all\)$/m,
  );
  expect(ev.out).toMatch(/^perplexity: [\d.]+$/m);
}, 120_000);
