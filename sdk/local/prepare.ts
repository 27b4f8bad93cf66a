// `meshtrain prepare`: text to token shards. Plain text files, a folder of them, or JSON Lines
// (one document per line, a named field) are tokenized (GPT-2's BPE, or characters), split into
// training and validation by document (seeded), and written as llm.c shards of a bounded size
// with a manifest (engine/data/shards.ts). The same input gives the same bytes; an interrupted
// prepare is run again from the start to the same result (the manifest is written last, and the
// folder's earlier shards are removed first).
import { existsSync, mkdirSync, readdirSync, readFileSync, rmSync, statSync } from "node:fs";
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
  writeDurably,
} from "../../engine/data/shards.ts";
import { CharVocab } from "../../engine/data/text.ts";
import { charTokenizer, gpt2Tokenizer, type Tokenizer, type TokenizerName } from "../../engine/data/tokenizer.ts";
import { ConfigError } from "../../ffi/errors.ts";
import { Rng } from "../../engine/rng.ts";
import { shownPath } from "../user-paths.ts";

export interface PrepareOptions {
  /** a text file, a folder of them, or (with jsonl) a JSON Lines file; absolute */
  text: string;
  /** JSON Lines: the field of each line that holds its document */
  jsonl?: string;
  tokenizer: TokenizerName;
  /** the folder to write (absolute) */
  out: string;
  valFraction: number;
  seed: number;
  /** tokens per shard at most */
  shardTokens: number;
  /** a folder's files to read, by extension */
  ext: string;
  /** invalid UTF-8: refuse (an error naming the file and line) or replace with U+FFFD (and say so) */
  invalidUtf8: "refuse" | "replace";
  /** the progress bar on a terminal; lines elsewhere */
  quiet?: boolean;
}

export const prepareDefaults = {
  tokenizer: "gpt2",
  valFraction: 0.1,
  seed: 1,
  shardTokens: 100_000_000,
  ext: ".txt",
  invalidUtf8: "refuse",
} as const;

/** A plain text file is cut at blank lines into documents of at least this many characters (a
 *  book gives many, so it can be split by document). */
export const textDocumentCharsMin = 10_000;

interface Document {
  text: string;
  /** "file" or "file:line", for errors and counts */
  where: string;
}

/** The byte offset of the first invalid UTF-8 sequence, or -1. */
export function invalidUtf8At(b: Uint8Array): number {
  for (let i = 0; i < b.length; ) {
    const c = b[i]!;
    const n = c < 0x80 ? 1 : c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3 : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
    if (n === 0 || i + n > b.length) return i;
    for (let k = 1; k < n; k++) if ((b[i + k]! & 0xc0) !== 0x80) return i;
    // overlong 3- and 4-byte forms, surrogates, and code points past U+10FFFF
    if (n === 3 && ((c === 0xe0 && b[i + 1]! < 0xa0) || (c === 0xed && b[i + 1]! >= 0xa0))) return i;
    if (n === 4 && ((c === 0xf0 && b[i + 1]! < 0x90) || (c === 0xf4 && b[i + 1]! >= 0x90))) return i;
    i += n;
  }
  return -1;
}

const lineOf = (b: Uint8Array, offset: number): number => {
  let line = 1;
  for (let i = 0; i < offset; i++) if (b[i] === 0x0a) line++;
  return line;
};

/** A file's text: refused or repaired where it is not UTF-8, saying which and where. */
function readUtf8(path: string, o: PrepareOptions, notes: string[]): string {
  let bytes: Uint8Array;
  try {
    bytes = readFileSync(path);
  } catch (e) {
    throw new DataFileError(path, `cannot be read: ${(e as Error).message}`, { cause: e });
  }
  const bad = invalidUtf8At(bytes);
  if (bad >= 0) {
    const where = `${shownPath(path)}:${lineOf(bytes, bad)}: invalid UTF-8 at byte ${bad}`;
    if (o.invalidUtf8 === "refuse")
      throw new DataFileError(
        path,
        `line ${lineOf(bytes, bad)}: invalid UTF-8 at byte ${bad}; --invalid-utf8 replace replaces such bytes with U+FFFD`,
      );
    notes.push(`${where}: replaced with U+FFFD (--invalid-utf8 replace)`);
  }
  return new TextDecoder("utf-8").decode(bytes);
}

/** A plain text's documents: consecutive paragraphs of at least textDocumentCharsMin characters. */
function paragraphsOf(text: string, file: string): Document[] {
  const docs: Document[] = [];
  let current = "";
  for (const para of text.split(/\n[ \t]*\n/)) {
    current = current === "" ? para : `${current}\n\n${para}`;
    if (current.length >= textDocumentCharsMin) {
      docs.push({ text: current, where: file });
      current = "";
    }
  }
  if (current.trim() !== "") docs.push({ text: current, where: file });
  return docs;
}

/** The inputs in order: a folder's files by name, each a document; a text file's paragraphs; a JSON Lines file's lines. */
export function* documents(o: PrepareOptions, notes: string[]): Generator<Document> {
  if (!existsSync(o.text)) throw new DataFileError(o.text, "not found");
  if (statSync(o.text).isDirectory()) {
    if (o.jsonl !== undefined)
      throw new ConfigError(`--jsonl reads one JSON Lines file; ${shownPath(o.text)} is a folder`);
    const files = readdirSync(o.text)
      .filter((f) => f.endsWith(o.ext))
      .sort();
    if (files.length === 0) throw new DataFileError(o.text, `holds no ${o.ext} file`);
    for (const f of files) {
      const path = join(o.text, f);
      yield { text: readUtf8(path, o, notes), where: shownPath(path) };
    }
    return;
  }
  const text = readUtf8(o.text, o, notes);
  if (o.jsonl === undefined) {
    yield* paragraphsOf(text, shownPath(o.text));
    return;
  }
  const lines = text.split("\n");
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i]!.trim();
    if (line === "") continue;
    const where = `${shownPath(o.text)}:${i + 1}`;
    let value: unknown;
    try {
      value = JSON.parse(line);
    } catch (e) {
      throw new DataFileError(o.text, `line ${i + 1}: not JSON (${(e as Error).message})`);
    }
    const doc = typeof value === "object" && value !== null ? (value as Record<string, unknown>)[o.jsonl] : undefined;
    if (typeof doc !== "string")
      throw new DataFileError(o.text, `line ${i + 1}: no string field ${JSON.stringify(o.jsonl)}`);
    yield { text: doc, where };
  }
}

/** Whether document i goes to validation: a seeded draw per document, the same on every run. */
const isVal = (seed: number, i: number, valFraction: number): boolean =>
  valFraction > 0 && new Rng((seed * 0x9e3779b1 + i * 0x85ebca6b) >>> 0).uniform() < valFraction;

function bytesOf(o: PrepareOptions): number {
  if (!existsSync(o.text)) return 0;
  if (!statSync(o.text).isDirectory()) return statSync(o.text).size;
  return readdirSync(o.text)
    .filter((f) => f.endsWith(o.ext))
    .reduce((n, f) => n + statSync(join(o.text, f)).size, 0);
}

/** Removes what an earlier (or interrupted) prepare left in the folder: shards, temp files, the manifest. */
export function clearFolder(dir: string): void {
  for (const f of readdirSync(dir)) {
    if (/^(train|val)_\d{6}\.bin(\.tmp-\d+)?$/.test(f) || /^(manifest|vocab)\.json(\.tmp-\d+)?$/.test(f))
      rmSync(join(dir, f));
  }
}

/** How the tokens were split: by a seeded draw per document (two or more documents), or by
 *  position (one document: the last valFraction of its tokens held out, as nanoGPT does). */
export type SplitRule = "document" | "position";

export interface PrepareResult {
  manifest: Manifest;
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

  place(ids: ArrayLike<number>): void {
    if (this.#pending !== null) this.#write(this.#count - 1, this.#pending, false);
    this.#pending = ids;
    this.#count++;
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
  if (!(o.valFraction >= 0 && o.valFraction <= 0.5))
    throw new ConfigError(`--val-fraction must be in [0, 0.5], got ${o.valFraction}`);
  if (!Number.isSafeInteger(o.shardTokens) || o.shardTokens < 1)
    throw new ConfigError(`--shard-tokens must be a positive integer, got ${o.shardTokens}`);
  const t0 = performance.now();
  const notes: string[] = [];
  const totalBytes = bytesOf(o);
  // characters: the vocabulary is the corpus's, so a first pass collects it
  let tokenizer: Tokenizer;
  let vocab: CharVocab | null = null;
  if (o.tokenizer === "char") {
    const chars = new Set<string>(["\n"]);
    for (const d of documents(o, [])) for (const c of d.text) chars.add(c);
    vocab = new CharVocab([...chars].sort((a, b) => a.codePointAt(0)! - b.codePointAt(0)!));
    tokenizer = charTokenizer(vocab);
  } else tokenizer = gpt2Tokenizer();
  mkdirSync(o.out, { recursive: true });
  clearFolder(o.out);
  const writer = new ShardWriter(o.out, o.shardTokens);
  const splitter = new DocumentSplitter(writer, o, tokenizer.eot, vocab?.encode("\n") ?? []);
  const progress = new Progress(o, totalBytes, t0);
  for (const d of documents(o, notes)) {
    splitter.place(tokenizer.encode(d.text));
    progress.update(Buffer.byteLength(d.text, "utf8"), splitter.count, writer);
  }
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
  return { manifest, seconds: (performance.now() - t0) / 1000, notes, splitRule };
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
