// A prepared token folder (`meshtrain prepare`): shards in llm.c's layout (a header of 256
// little-endian int32: magic 20240520, version 1, token count; then the tokens as uint16), at
// most shardTokens each, named <split>_<n>.bin, and manifest.json, written last, which says what
// they hold. A character-level folder has vocab.json beside them.
import { closeSync, existsSync, fsyncSync, openSync, readFileSync, renameSync, writeSync } from "node:fs";
import { join } from "node:path";
import { z } from "zod";
import { DataFileError } from "./errors.ts";
import { llmcMagic, llmcVersionU16, readTokenFile } from "./tokens.ts";
import { tokenizerNames } from "./tokenizer.ts";

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

/** Writes a file durably: a temp file beside it, fsync, rename over the target. */
export function writeDurably(path: string, parts: readonly Uint8Array[]): void {
  const tmp = `${path}.tmp-${process.pid}`;
  const fd = openSync(tmp, "w");
  try {
    for (const p of parts) for (let at = 0; at < p.length; ) at += writeSync(fd, p, at, p.length - at);
    fsyncSync(fd);
  } finally {
    closeSync(fd);
  }
  renameSync(tmp, path);
}

/** Fills shards of at most shardTokens tokens per split, writing each one as it fills. */
export class ShardWriter {
  readonly shards: ShardEntry[] = [];
  readonly tokens = { train: 0, val: 0 };
  readonly #buffers: Record<SplitName, { data: Uint16Array; used: number; next: number }>;

  constructor(
    readonly dir: string,
    readonly shardTokens: number,
  ) {
    this.#buffers = {
      train: { data: new Uint16Array(shardTokens), used: 0, next: 0 },
      val: { data: new Uint16Array(shardTokens), used: 0, next: 0 },
    };
  }

  push(split: SplitName, ids: ArrayLike<number>): void {
    const b = this.#buffers[split];
    this.tokens[split] += ids.length;
    for (let i = 0; i < ids.length; ) {
      const n = Math.min(ids.length - i, b.data.length - b.used);
      if (ids instanceof Uint16Array) b.data.set(ids.subarray(i, i + n), b.used);
      else for (let k = 0; k < n; k++) b.data[b.used + k] = ids[i + k]!;
      b.used += n;
      i += n;
      if (b.used === b.data.length) this.#flush(split);
    }
  }

  #flush(split: SplitName): void {
    const b = this.#buffers[split];
    if (b.used === 0) return;
    const header = new Int32Array(headerInts);
    header[0] = llmcMagic;
    header[1] = llmcVersionU16;
    header[2] = b.used;
    const head = new Uint8Array(header.buffer);
    const body = new Uint8Array(b.data.buffer, 0, 2 * b.used);
    const file = shardFile(split, b.next++);
    writeDurably(join(this.dir, file), [head, body]);
    const crc = Bun.hash.crc32(body, Bun.hash.crc32(head));
    this.shards.push({ file, split, tokens: b.used, crc32: (crc >>> 0).toString(16).padStart(8, "0") });
    b.used = 0;
  }

  /** Writes what is left of each split. */
  finish(): ShardEntry[] {
    for (const s of splits) this.#flush(s);
    return this.shards;
  }
}

/** The manifest of a prepared folder, or null when it has none (a train.bin/val.bin folder). */
export function readManifest(dir: string): Manifest | null {
  const path = join(dir, manifestName);
  if (!existsSync(path)) return null;
  let raw: unknown;
  try {
    raw = JSON.parse(readFileSync(path, "utf8"));
  } catch (e) {
    throw new DataFileError(path, `is not JSON: ${(e as Error).message}`, { cause: e });
  }
  const r = manifestSchema.safeParse(raw);
  if (!r.success)
    throw new DataFileError(
      path,
      `is not a meshtrain token manifest: ${r.error.issues.map((i) => `${i.path.join(".")}: ${i.message}`).join("; ")}`,
    );
  return r.data;
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
