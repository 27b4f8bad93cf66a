// `meshtrain prepare`: text to token shards. Plain text files, JSON Lines (plain, .gz or .zst),
// Parquet, or a folder of any of them (sdk/local/prepare-sources.ts) are tokenized (GPT-2's BPE, or
// characters) on worker threads (sdk/local/prepare-pool.ts), split into training and validation
// (two or more documents by a seeded draw per document, validation given one at least; a single
// document by position, its end held out: a plain text file is one, read in pieces), and written as llm.c shards of a bounded size with a
// manifest (engine/data/shards.ts). The same input gives the same bytes for any count of threads;
// an interrupted prepare is run again from the start to the same result (the manifest is written
// last, and the folder's earlier shards are removed first).
import { mkdirSync, readdirSync, rmSync } from "node:fs";
import { availableParallelism } from "node:os";
import { basename, join } from "node:path";
import cliProgress from "cli-progress";
import { DataFileError } from "../../engine/data/errors.ts";
import {
  manifestFormat,
  manifestName,
  manifestVersion,
  type Manifest,
  ShardWriter,
  type SplitName,
} from "../../engine/data/shards.ts";
import { writeDurably } from "../../engine/durable.ts";
import { CharVocab } from "../../engine/data/text.ts";
import { charTokenizer, gpt2Tokenizer, type TokenizerName } from "../../engine/data/tokenizer.ts";
import { ConfigError } from "../../ffi/errors.ts";
import { Rng } from "../../engine/rng.ts";
import { checkOutDir } from "../user-paths.ts";
import { batchCharsMax, type EncodedBatch, garbageCollector, tokenizerPool, workersMax } from "./prepare-pool.ts";
import { bytesOf, type Document, documents, type SourceOptions, textExtDefault } from "./prepare-sources.ts";

/** Input bytes per tokenizing thread at least: about two seconds of one thread's work, so that its
 *  start (about half a second of a core) is a small part of it. */
export const workerBytesMin = 32_000_000;

export interface PrepareOptions extends SourceOptions {
  tokenizer: TokenizerName;
  /** the folder to write (absolute) */
  out: string;
  valFraction: number;
  seed: number;
  /** tokens per shard at most */
  shardTokens: number;
  /** threads that tokenize at most (default: the machine's cores); the shards are the same for any count */
  workers?: number;
  /** input bytes that one more thread needs to be started (default workerBytesMin; tests lower it) */
  workerBytesMin?: number;
  /** the progress bar on a terminal; lines elsewhere */
  quiet?: boolean;
}

/** Tokens a shard holds at most: its header counts them in a signed 32-bit integer (llm.c's layout). */
export const shardTokensMax = 2 ** 31 - 1;

export const prepareDefaults = {
  tokenizer: "gpt2",
  valFraction: 0.1,
  seed: 1,
  shardTokens: 100_000_000,
  ext: textExtDefault,
  invalidUtf8: "refuse",
} as const;

/** Whether document i goes to validation: a seeded draw per document, the same on every run. */
const isVal = (seed: number, i: number, valFraction: number): boolean =>
  valFraction > 0 && new Rng((seed * 0x9e3779b1 + i * 0x85ebca6b) >>> 0).uniform() < valFraction;

/** Removes what an earlier (or interrupted) prepare left in the folder: shards, temp files, the manifest. */
export function clearFolder(dir: string): void {
  for (const f of readdirSync(dir)) {
    if (/^(train|val)_\d{6}\.bin(\.tmp-\d+)?$/.test(f) || /^(manifest|vocab)\.json(\.tmp-\d+)?$/.test(f))
      rmSync(join(dir, f));
  }
}

/** Where a text goes when it is a piece of a plain text file (sdk/local/prepare-sources.ts): {} for a whole document. */
type PieceOf = Pick<Document, "continues" | "heldOut">;

/** How the tokens were split: by a seeded draw per document (two or more documents), or by
 *  position (one document: the last valFraction of its tokens held out, as nanoGPT does). */
export type SplitRule = "document" | "position";

export interface PrepareResult {
  manifest: Manifest;
  /** the threads that tokenized */
  threads: number;
  seconds: number;
  notes: string[];
  splitRule: SplitRule;
}

/**
 * Puts each document's tokens into a split, one document behind the input: the last one's split
 * is decided when the input ends, so that two or more documents always give validation at least
 * one (the last, where the draw gave none) and a single document is split by position.
 */
class DocumentSplitter {
  readonly docs = { train: 0, val: 0 };
  #pending: ArrayLike<number> | null = null;
  #count = 0;

  constructor(
    readonly writer: ShardWriter,
    readonly o: PrepareOptions,
    /** the id before each document, or the ids between documents (characters: a newline) */
    readonly eot: number | null,
    readonly between: ArrayLike<number>,
  ) {}

  get count(): number {
    return this.#count;
  }

  /** a plain text file's pieces (a document read in pieces, its end held out): their tokens so far */
  #pieces: { train: number; val: number } | null = null;

  place(ids: ArrayLike<number>, d: PieceOf = {}): void {
    if (d.continues !== undefined || d.heldOut !== undefined) return this.#placePiece(ids, d);
    if (this.#pending !== null) this.#write(this.#count - 1, this.#pending, false);
    this.#pending = ids;
    this.#count++;
  }

  /** A piece of the one document a plain text file is: to training up to its held-out end, then
   *  to validation. The end continues the document: no <|endoftext|> before it. */
  #placePiece(ids: ArrayLike<number>, d: PieceOf): void {
    const split: SplitName = d.heldOut ? "val" : "train";
    this.#pieces ??= { train: 0, val: 0 };
    if (!d.continues) {
      this.#count++;
      this.#push(split, ids);
    } else {
      if (this.docs[split] === 0) this.docs[split]++;
      this.writer.push(split, ids);
    }
    this.#pieces[split] += ids.length;
  }

  #write(i: number, ids: ArrayLike<number>, last: boolean): void {
    const forced = last && this.o.valFraction > 0 && this.docs.val === 0;
    const split: SplitName = forced || isVal(this.o.seed, i, this.o.valFraction) ? "val" : "train";
    this.#push(split, ids);
  }

  #push(split: SplitName, ids: ArrayLike<number>): void {
    // GPT-2: <|endoftext|> before every document; characters: a newline between them
    if (this.eot !== null) this.writer.push(split, [this.eot]);
    else if (this.docs[split] > 0) this.writer.push(split, this.between);
    this.writer.push(split, ids);
    this.docs[split]++;
  }

  /** Writes the last document; returns the rule that split the corpus. */
  finish(): SplitRule {
    const pieces = this.#pieces;
    if (pieces !== null) {
      const tokens = pieces.train + pieces.val;
      if (this.o.valFraction > 0 && (pieces.train === 0 || pieces.val === 0))
        throw new DataFileError(
          this.o.text,
          `holds one document of ${tokens} token${tokens === 1 ? "" : "s"}, too short to hold out --val-fraction ${this.o.valFraction} of it by position`,
        );
      return "position";
    }
    const ids = this.#pending;
    if (ids === null) throw new DataFileError(this.o.text, "holds no document: the corpus is empty");
    if (this.#count > 1) {
      this.#write(this.#count - 1, ids, true);
      return "document";
    }
    const valTokens = Math.round(ids.length * this.o.valFraction);
    if (this.o.valFraction > 0 && (valTokens === 0 || valTokens === ids.length))
      throw new DataFileError(
        this.o.text,
        `holds one document of ${ids.length} token${ids.length === 1 ? "" : "s"}, too short to hold out --val-fraction ${this.o.valFraction} of it by position`,
      );
    const cut = ids.length - valTokens;
    const sub = (a: number, b: number) =>
      ids instanceof Uint16Array || ids instanceof Uint32Array ? ids.subarray(a, b) : Array.from(ids).slice(a, b);
    this.#push("train", sub(0, cut));
    // the held-out end continues the document: no <|endoftext|> before it
    if (valTokens > 0) {
      this.writer.push("val", sub(cut, ids.length));
      this.docs.val++;
    }
    return "position";
  }
}

export async function runPrepare(o: PrepareOptions): Promise<PrepareResult> {
  // train gpt, eval and the mesh's data-loader evaluate on the validation split: a folder without one trains nowhere
  if (!(o.valFraction > 0 && o.valFraction <= 0.5))
    throw new ConfigError(
      `--val-fraction must be in (0, 0.5], got ${o.valFraction} (a GPT trained on the folder is evaluated on its validation split)`,
    );
  if (!Number.isSafeInteger(o.shardTokens) || o.shardTokens < 1 || o.shardTokens > shardTokensMax)
    throw new ConfigError(`--shard-tokens must be an integer in [1, ${shardTokensMax}], got ${o.shardTokens}`);
  const workers = o.workers ?? availableParallelism();
  if (!Number.isSafeInteger(workers) || workers < 1 || workers > workersMax)
    throw new ConfigError(`--workers must be an integer in [1, ${workersMax}], got ${workers}`);
  checkOutDir(o.out, "--out");
  const t0 = performance.now();
  const notes: string[] = [];
  const inputBytes = bytesOf(o);
  const totalBytes = inputBytes.disk;
  // characters: the vocabulary is the corpus's, so a first pass collects it
  let vocab: CharVocab | null = null;
  if (o.tokenizer === "char") {
    const chars = new Set<string>(["\n"]);
    const collect = garbageCollector();
    for await (const d of documents(o, [])) {
      for (const c of d.text) chars.add(c);
      collect(d.text.length);
    }
    vocab = new CharVocab([...chars].sort((a, b) => a.codePointAt(0)! - b.codePointAt(0)!));
  }
  const tokenizer = vocab === null ? gpt2Tokenizer() : charTokenizer(vocab);
  mkdirSync(o.out, { recursive: true });
  clearFolder(o.out);
  const writer = new ShardWriter(o.out, o.shardTokens);
  const splitter = new DocumentSplitter(writer, o, tokenizer.eot, vocab?.encode("\n") ?? []);
  // the bar counts text: for a compressed input, against a guess at its size
  const progress = new Progress(o, inputBytes.text, t0);
  // a thread's start costs about half a second of a core (the BPE's ranks, and a table of pieces
  // that fills as it goes): a thread is started for each workerBytesMin of text, up to --workers
  const threads = Math.min(workers, Math.max(1, Math.floor(inputBytes.text / (o.workerBytesMin ?? workerBytesMin))));
  await tokenizeInOrder(o, threads, vocab, notes, (e, pieces, bytes) => {
    for (let i = 0, at = 0; i < e.lengths.length; at += e.lengths[i]!, i++)
      splitter.place(e.ids.subarray(at, at + e.lengths[i]!), pieces[i]);
    progress.update(bytes, splitter.count, writer);
  });
  progress.stop();
  const splitRule = splitter.finish();
  const docs = splitter.docs;
  if (writer.tokens.train === 0)
    throw new DataFileError(
      o.text,
      `every one of its ${splitter.count} documents went to validation; lower --val-fraction`,
    );
  const shards = writer.finish();
  if (vocab !== null)
    writeDurably(join(o.out, "vocab.json"), [new TextEncoder().encode(`${JSON.stringify({ chars: vocab.chars })}\n`)]);
  const manifest: Manifest = {
    format: manifestFormat,
    version: manifestVersion,
    tokenizer: tokenizer.name,
    vocabSize: tokenizer.vocabSize,
    eot: tokenizer.eot,
    documents: docs,
    tokens: writer.tokens,
    shardTokens: o.shardTokens,
    valFraction: o.valFraction,
    seed: o.seed,
    splitRule,
    sources: [basename(o.text)],
    sourceBytes: totalBytes,
    shards,
  };
  writeDurably(join(o.out, manifestName), [new TextEncoder().encode(`${JSON.stringify(manifest, null, 2)}\n`)]);
  return { manifest, seconds: (performance.now() - t0) / 1000, notes, splitRule, threads };
}

/** Reads the documents, tokenizes them in batches on the workers, and hands each batch's ids to
 *  `take` in the documents' order, with a bounded count of batches in flight. */
async function tokenizeInOrder(
  o: PrepareOptions,
  workers: number,
  vocab: CharVocab | null,
  notes: string[],
  take: (e: EncodedBatch, pieces: readonly PieceOf[], bytes: number) => void,
): Promise<void> {
  const pool = tokenizerPool(workers, vocab?.chars ?? null);
  const inFlight: { encoded: Promise<EncodedBatch>; pieces: PieceOf[]; bytes: number }[] = [];
  let texts: string[] = [];
  let pieces: PieceOf[] = [];
  let chars = 0;
  const send = async () => {
    if (texts.length === 0) return;
    const encoded = pool.encode(texts);
    // a batch that fails while an earlier one is awaited is reported when its turn comes
    encoded.catch(() => {});
    inFlight.push({ encoded, pieces, bytes: texts.reduce((n, t) => n + Buffer.byteLength(t, "utf8"), 0) });
    texts = [];
    pieces = [];
    chars = 0;
    while (inFlight.length >= pool.inFlightMax) await takeFirst();
  };
  const collect = garbageCollector();
  const takeFirst = async () => {
    const b = inFlight.shift()!;
    take(await b.encoded, b.pieces, b.bytes);
    collect(b.bytes);
  };
  try {
    for await (const d of documents(o, notes)) {
      texts.push(d.text);
      pieces.push(d.continues === undefined ? {} : { continues: d.continues, heldOut: d.heldOut ?? false });
      chars += d.text.length;
      if (chars >= batchCharsMax) await send();
    }
    await send();
    while (inFlight.length > 0) await takeFirst();
  } finally {
    pool.close();
  }
}

/** The progress bar on a terminal, a line every 5 s elsewhere, nothing when quiet. */
class Progress {
  readonly #bar: cliProgress.SingleBar | null;
  #bytesDone = 0;
  #lastLine = performance.now();

  constructor(
    readonly o: PrepareOptions,
    readonly totalBytes: number,
    readonly t0: number,
  ) {
    this.#bar =
      o.quiet || !process.stdout.isTTY
        ? null
        : new cliProgress.SingleBar({
            format: "prepare {bar} {percentage}% | {docs} documents | {tokens} tokens | {mbps} MB/s",
            barCompleteChar: "█",
            barIncompleteChar: "░",
            barsize: 24,
            hideCursor: true,
            clearOnComplete: true,
          });
    this.#bar?.start(Math.max(totalBytes, 1), 0, { docs: 0, tokens: 0, mbps: "0.0" });
  }

  update(bytes: number, docs: number, writer: ShardWriter): void {
    this.#bytesDone += bytes;
    const seconds = (performance.now() - this.t0) / 1000;
    const fields = {
      docs: docs.toLocaleString("en-US"),
      tokens: (writer.tokens.train + writer.tokens.val).toLocaleString("en-US"),
      mbps: (this.#bytesDone / 1e6 / Math.max(seconds, 1e-3)).toFixed(1),
    };
    this.#bar?.update(Math.min(this.#bytesDone, this.totalBytes), fields);
    if (this.#bar === null && !this.o.quiet && performance.now() - this.#lastLine > 5000) {
      console.log(`prepare: ${fields.docs} documents, ${fields.tokens} tokens, ${fields.mbps} MB/s`);
      this.#lastLine = performance.now();
    }
  }

  stop(): void {
    this.#bar?.stop();
  }
}
