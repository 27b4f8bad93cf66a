// uint16 token files in the llm.c / nanoGPT layouts, and batches of token windows.
//
// llm.c: a header of 256 little-endian int32 (magic 20240520, version 1, token count), then
//        the tokens as little-endian uint16.
// nanoGPT: the tokens as little-endian uint16 and nothing else (train.bin / val.bin).
import { ConfigError } from "../../ffi/errors.ts";
import { writeDurably } from "../durable.ts";
import { Rng } from "../rng.ts";
import type { HostBatch } from "../train.ts";
import { DataFileError } from "./errors.ts";
import { readDataFile } from "./files.ts";
import { asTokens, llmcMagic, llmcVersionU16, type Tokens } from "./token-stream.ts";

export { llmcMagic, llmcVersionU16 };
const hostIsLittleEndian = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;
if (!hostIsLittleEndian) throw new Error("meshtrain token files are little-endian; big-endian hosts are not supported");
const headerInts = 256;
const headerBytes = headerInts * 4;

export function parseTokens(path: string, bytes: Uint8Array): Uint16Array {
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const looksLlmc = bytes.length >= 4 && view.getInt32(0, true) === llmcMagic;
  let body: Uint8Array;
  if (looksLlmc) {
    if (bytes.length < headerBytes)
      throw new DataFileError(path, `truncated llm.c header (${bytes.length} of ${headerBytes} bytes)`);
    const version = view.getInt32(4, true);
    if (version !== llmcVersionU16) {
      throw new DataFileError(
        path,
        `llm.c token file version ${version} is not supported (only version ${llmcVersionU16}, uint16 tokens)`,
      );
    }
    const count = view.getInt32(8, true);
    const expected = headerBytes + 2 * count;
    if (count <= 0 || bytes.length !== expected) {
      throw new DataFileError(path, `header says ${count} tokens (${expected} bytes), file has ${bytes.length} bytes`);
    }
    body = bytes.subarray(headerBytes);
  } else {
    if (bytes.length % 2 !== 0)
      throw new DataFileError(path, `raw uint16 token file has an odd byte count (${bytes.length})`);
    body = bytes;
  }
  // copy into an aligned buffer (the body may start at an odd offset in a shared buffer);
  // the files are little-endian, as is every host we run on (hostIsLittleEndian, asserted below)
  const tokens = new Uint16Array(body.length / 2);
  new Uint8Array(tokens.buffer).set(body);
  return tokens;
}

export function readTokenFile(path: string): Uint16Array {
  return parseTokens(path, readDataFile(path));
}

/** Writes tokens durably (temp file, fsync, rename) in the llm.c layout, or raw (nanoGPT). */
export function writeTokenFile(path: string, tokens: Uint16Array, layout: "llmc" | "raw" = "llmc"): void {
  const body = new Uint8Array(tokens.buffer, tokens.byteOffset, tokens.byteLength);
  if (layout === "raw") return writeDurably(path, [body]);
  const header = new Int32Array(headerInts);
  header[0] = llmcMagic;
  header[1] = llmcVersionU16;
  header[2] = tokens.length;
  writeDurably(path, [new Uint8Array(header.buffer), body]);
}

/** Train/validation split of a token stream: the last `valFraction` is validation. */
export function splitTokens(tokens: Uint16Array, valFraction: number): { train: Uint16Array; val: Uint16Array } {
  if (!(valFraction > 0 && valFraction < 1)) throw new ConfigError(`valFraction must be in (0, 1), got ${valFraction}`);
  const cut = Math.floor(tokens.length * (1 - valFraction));
  return { train: tokens.subarray(0, cut), val: tokens.subarray(cut) };
}

/** Batches of (B,T) windows: inputs tokens[i..i+T), targets tokens[i+1..i+T+1). The tokens
 *  are read a window at a time (a prepared folder's from disk: engine/data/token-stream.ts). */
export class TokenBatcher {
  readonly #inputs: Int32Array;
  readonly #targets: Int32Array;
  readonly #window: Uint16Array;
  readonly tokens: Tokens;

  constructor(
    tokens: Tokens | Uint16Array,
    readonly batchSize: number,
    readonly blockSize: number,
    readonly vocabSize: number,
    /** what the tokens are, as errors name them (a file, a corpus's split) */
    readonly source = "the token stream",
  ) {
    this.tokens = asTokens(tokens);
    this.#window = new Uint16Array(blockSize + 1);
    if (!Number.isInteger(batchSize) || batchSize < 1)
      throw new ConfigError(`batch size must be an integer >= 1, got ${batchSize}`);
    if (tokens.length < blockSize + 1) {
      throw new ConfigError(
        `${source} holds ${tokens.length} token${tokens.length === 1 ? "" : "s"}, too few for one window of ${blockSize} + 1: a smaller --block-size, or more text`,
      );
    }
    this.#inputs = new Int32Array(batchSize * blockSize);
    this.#targets = new Int32Array(batchSize * blockSize);
  }

  #fill(b: number, start: number): void {
    const T = this.blockSize;
    const w = this.#window;
    this.tokens.read(start, T + 1, w);
    for (let t = 0; t < T; t++) {
      const x = w[t]!;
      const y = w[t + 1]!;
      if (x >= this.vocabSize || y >= this.vocabSize) {
        throw new DataFileError(
          this.source,
          `token id ${Math.max(x, y)} at offset ${start + t} is outside the vocabulary of ${this.vocabSize}`,
        );
      }
      this.#inputs[b * T + t] = x;
      this.#targets[b * T + t] = y;
    }
  }

  #batch(n: number): HostBatch {
    const T = this.blockSize;
    const full = n === this.batchSize;
    return {
      inputs: full ? this.#inputs : this.#inputs.subarray(0, n * T),
      inputShape: [n, T],
      targets: full ? this.#targets : this.#targets.subarray(0, n * T),
      targetShape: [n, T],
    };
  }

  /** Random windows (nanoGPT's get_batch), from a seeded stream. Buffers are reused. */
  random(rng: Rng): HostBatch {
    const maxStart = this.tokens.length - this.blockSize - 1;
    for (let b = 0; b < this.batchSize; b++) this.#fill(b, rng.int(maxStart + 1));
    return this.#batch(this.batchSize);
  }

  /** Every non-overlapping window once, in order: the whole stream for evaluation. */
  *sequential(): Generator<HostBatch> {
    const windows = Math.floor((this.tokens.length - 1) / this.blockSize);
    for (let w = 0; w < windows; w += this.batchSize) {
      const n = Math.min(this.batchSize, windows - w);
      for (let b = 0; b < n; b++) this.#fill(b, (w + b) * this.blockSize);
      yield this.#batch(n);
    }
  }
}
