// A prepared token folder (`meshtrain prepare`): shards in llm.c's layout (a header of 256
// little-endian int32: magic 20240520, version 1, token count; then the tokens as uint16), at
// most shardTokens each, named <split>_<n>.bin, and manifest.json, written last, which says what
// they hold. A character-level folder has vocab.json beside them.
import { closeSync, existsSync, fsyncSync, openSync, renameSync, writeSync } from "node:fs";
import { join } from "node:path";
import { z } from "zod";
import { DataFileError } from "./errors.ts";
import { llmcMagic, llmcVersionU16, readTokenFile } from "./tokens.ts";
import { ShardTokens } from "./token-stream.ts";
import { tokenizerNames } from "./tokenizer.ts";
import { fileCrc32, readJsonFile } from "./files.ts";

export const manifestName = "manifest.json";
export const manifestFormat = "meshtrain-tokens";
export const manifestVersion = 1;
const headerInts = 256;

export const splits = ["train", "val"] as const;
export type SplitName = (typeof splits)[number];

const shardSchema = z.object({
  file: z.string().regex(/^(train|val)_\d{6}\.bin$/),
  split: z.enum(splits),
  tokens: z.number().int().min(1),
  /** crc32 of the file's bytes, as hex */
  crc32: z.string().regex(/^[0-9a-f]{8}$/),
});

export const manifestSchema = z.object({
  format: z.literal(manifestFormat),
  version: z.literal(manifestVersion),
  tokenizer: z.enum(tokenizerNames),
  vocabSize: z.number().int().min(1).max(65536),
  /** the id before every document, or null (documents joined by a newline) */
  eot: z.number().int().min(0).nullable(),
  documents: z.object({ train: z.number().int().min(0), val: z.number().int().min(0) }),
  tokens: z.object({ train: z.number().int().min(0), val: z.number().int().min(0) }),
  shardTokens: z.number().int().min(1),
  valFraction: z.number().min(0).max(0.5),
  seed: z.number().int(),
  /** by a seeded draw per document, or (one document) by position: the end of its tokens held out */
  splitRule: z.enum(["document", "position"]).optional(),
  /** the inputs, as given, and their total bytes */
  sources: z.array(z.string()),
  sourceBytes: z.number().int().min(0),
  shards: z.array(shardSchema),
});
export type Manifest = z.infer<typeof manifestSchema>;
export type ShardEntry = z.infer<typeof shardSchema>;

export const shardFile = (split: SplitName, index: number): string => `${split}_${String(index).padStart(6, "0")}.bin`;

/** Tokens a split's shard holds in memory before they go to its file: a shard of any size is
 *  written a piece at a time, so memory stays flat whatever --shard-tokens says. */
export const shardPieceTokens = 1 << 20;

/** One split's shard being written: a temp file that grows a piece at a time. */
interface OpenShard {
  fd: number;
  tmp: string;
  file: string;
  /** tokens in the file so far */
  written: number;
}

/** Fills shards of at most shardTokens tokens per split, streaming each to a temp file as it
 *  fills; a full shard gets its header, an fsync and its name (the same durability as
 *  writeDurably), and its crc32 from the file read back a piece at a time. */
export class ShardWriter {
  readonly shards: ShardEntry[] = [];
  readonly tokens = { train: 0, val: 0 };
  readonly #buffers: Record<SplitName, { data: Uint16Array; used: number; next: number; open: OpenShard | null }>;

  constructor(
    readonly dir: string,
    readonly shardTokens: number,
  ) {
    const piece = () => new Uint16Array(Math.min(shardTokens, shardPieceTokens));
    this.#buffers = {
      train: { data: piece(), used: 0, next: 0, open: null },
      val: { data: piece(), used: 0, next: 0, open: null },
    };
  }

  push(split: SplitName, ids: ArrayLike<number>): void {
    const b = this.#buffers[split];
    this.tokens[split] += ids.length;
    for (let i = 0; i < ids.length; ) {
      const room = Math.min(b.data.length - b.used, this.shardTokens - (b.open?.written ?? 0) - b.used);
      const n = Math.min(ids.length - i, room);
      if (ids instanceof Uint16Array) b.data.set(ids.subarray(i, i + n), b.used);
      else for (let k = 0; k < n; k++) b.data[b.used + k] = ids[i + k]!;
      b.used += n;
      i += n;
      if (b.used === b.data.length || (b.open?.written ?? 0) + b.used === this.shardTokens) this.#spill(split);
      if (b.open !== null && b.open.written === this.shardTokens) this.#close(split);
    }
  }

  /** The buffered tokens to the split's open shard file (opened, with room for its header, first). */
  #spill(split: SplitName): void {
    const b = this.#buffers[split];
    if (b.used === 0) return;
    if (b.open === null) {
      const file = shardFile(split, b.next++);
      const tmp = join(this.dir, `${file}.tmp-${process.pid}`);
      const fd = openSync(tmp, "w+"); // read back for its crc32
      b.open = { fd, tmp, file, written: 0 };
      writeAll(fd, new Uint8Array(4 * headerInts), 0);
    }
    const body = new Uint8Array(b.data.buffer, 0, 2 * b.used);
    writeAll(b.open.fd, body, 4 * headerInts + 2 * b.open.written);
    b.open.written += b.used;
    b.used = 0;
  }

  /** The open shard's header, fsync, its name, and its manifest entry. */
  #close(split: SplitName): void {
    const b = this.#buffers[split];
    const o = b.open;
    if (o === null) return;
    b.open = null;
    const header = new Int32Array(headerInts);
    header[0] = llmcMagic;
    header[1] = llmcVersionU16;
    header[2] = o.written;
    let crc: number;
    try {
      writeAll(o.fd, new Uint8Array(header.buffer), 0);
      fsyncSync(o.fd);
      crc = fileCrc32(o.fd, 4 * headerInts + 2 * o.written);
    } finally {
      closeSync(o.fd);
    }
    renameSync(o.tmp, join(this.dir, o.file));
    this.shards.push({ file: o.file, split, tokens: o.written, crc32: (crc >>> 0).toString(16).padStart(8, "0") });
  }

  /** Writes what is left of each split. */
  finish(): ShardEntry[] {
    for (const s of splits) {
      this.#spill(s);
      this.#close(s);
    }
    return this.shards;
  }
}

function writeAll(fd: number, bytes: Uint8Array, position: number): void {
  for (let at = 0; at < bytes.length; ) at += writeSync(fd, bytes, at, bytes.length - at, position + at);
}

/** The manifest of a prepared folder, or null when it has none (a train.bin/val.bin folder). */
export function readManifest(dir: string): Manifest | null {
  const path = join(dir, manifestName);
  if (!existsSync(path)) return null;
  const r = manifestSchema.safeParse(readJsonFile(path));
  if (!r.success)
    throw new DataFileError(
      path,
      `is not a meshtrain token manifest: ${r.error.issues.map((i) => `${i.path.join(".")}: ${i.message}`).join("; ")}`,
    );
  return r.data;
}

/** A prepared folder's validation shards, read a window at a time, each checked against its
 *  crc32 when first opened; refused where it has none. */
export function valShards(dir: string, m: Manifest): ShardTokens {
  const val = new ShardTokens(
    dir,
    m.shards.filter((s) => s.split === "val"),
    { checkCrcs: true },
  );
  if (val.length === 0) throw new DataFileError(dir, "holds no validation tokens (prepared with --val-fraction 0)");
  return val;
}

/** A split's shards, read whole and joined, each checked against the manifest. */
export function readSplit(dir: string, m: Manifest, split: SplitName): Uint16Array {
  const shards = m.shards.filter((s) => s.split === split);
  const out = new Uint16Array(shards.reduce((n, s) => n + s.tokens, 0));
  let at = 0;
  for (const s of shards) {
    const tokens = readTokenFile(join(dir, s.file));
    if (tokens.length !== s.tokens)
      throw new DataFileError(join(dir, s.file), `holds ${tokens.length} tokens, the manifest says ${s.tokens}`);
    out.set(tokens, at);
    at += tokens.length;
  }
  return out;
}
