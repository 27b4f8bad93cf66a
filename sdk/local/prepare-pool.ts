// `meshtrain prepare`'s tokenizers: worker threads (sdk/local/prepare-worker.ts), one tokenizer
// each, or this thread alone. Documents go in batches, batch b to worker b mod n, and come back
// in batch order, so the shards are the same bytes whatever the count of workers.
import { CharVocab } from "../../engine/data/text.ts";
import { charTokenizer, gpt2FastTokenizer, type Tokenizer } from "../../engine/data/tokenizer.ts";

/** A batch's token ids, its documents' one after another, and each document's count of them. */
export interface EncodedBatch {
  ids: Uint16Array;
  lengths: Uint32Array;
}

export type PoolRequest =
  | { kind: "init"; chars: readonly string[] | null }
  | { kind: "batch"; batch: number; texts: string[] };
export type PoolReply =
  | ({ kind: "batch"; batch: number } & EncodedBatch)
  | { kind: "error"; batch: number; message: string };

/** Characters per batch: large enough that a message's cost is small beside its encoding (tens of
 *  ms of one core's work), small enough that batches in flight stay a few MB each. */
export const batchCharsMax = 1 << 20;
/** Batches given to each worker before its first answer: one being encoded, one waiting. */
export const batchesInFlightPerWorker = 2;
/** Worker threads at most: past a machine's cores they only add memory. */
export const workersMax = 256;

/** Text read or tokenized between two full collections of a thread's garbage (the texts, their
 *  pieces and ids): left to the collector's own pace, a heap grows with the input's size, not
 *  with what it holds. */
export const collectEveryBytes = 32_000_000;

/** Counts what a thread has read or tokenized, and collects its garbage every collectEveryBytes. */
export function garbageCollector(): (bytes: number) => void {
  let since = 0;
  return (bytes) => {
    since += bytes;
    if (since < collectEveryBytes) return;
    Bun.gc(true);
    since = 0;
  };
}

export function encodeBatch(tokenizer: Tokenizer, texts: readonly string[]): EncodedBatch {
  const parts = texts.map((t) => tokenizer.encode(t));
  const lengths = Uint32Array.from(parts, (p) => p.length);
  const ids = new Uint16Array(lengths.reduce((n, l) => n + l, 0));
  let at = 0;
  for (const p of parts) {
    ids.set(p, at);
    at += p.length;
  }
  return { ids, lengths };
}

export interface TokenizerPool {
  /** batches may be given before earlier ones are answered; each answers in its own time */
  encode(texts: string[]): Promise<EncodedBatch>;
  /** batches that may be in flight before the first is awaited */
  readonly inFlightMax: number;
  close(): void;
}

/** chars: the character vocabulary, or null for GPT-2's BPE */
export function tokenizerPool(workers: number, chars: readonly string[] | null): TokenizerPool {
  return workers === 1 ? new ThreadPool(chars) : new WorkerPool(workers, chars);
}

class ThreadPool implements TokenizerPool {
  readonly inFlightMax = 1;
  readonly #tokenizer: Tokenizer;
  constructor(chars: readonly string[] | null) {
    this.#tokenizer = chars === null ? gpt2FastTokenizer() : charTokenizer(new CharVocab(chars));
  }
  encode(texts: string[]): Promise<EncodedBatch> {
    return Promise.resolve(encodeBatch(this.#tokenizer, texts));
  }
  close(): void {}
}

class WorkerPool implements TokenizerPool {
  readonly inFlightMax: number;
  readonly #workers: Worker[];
  readonly #waiting = new Map<number, { resolve: (b: EncodedBatch) => void; reject: (e: Error) => void }>();
  #next = 0;

  constructor(n: number, chars: readonly string[] | null) {
    this.inFlightMax = n * batchesInFlightPerWorker;
    this.#workers = Array.from({ length: n }, () => {
      const w = new Worker(new URL("./prepare-worker.ts", import.meta.url).href);
      w.onmessage = (e: MessageEvent<PoolReply>) => this.#answer(e.data);
      w.onerror = (e) => this.#failAll(new Error(`a prepare worker failed: ${e.message}`));
      w.postMessage({ kind: "init", chars } satisfies PoolRequest);
      return w;
    });
  }

  encode(texts: string[]): Promise<EncodedBatch> {
    const batch = this.#next++;
    return new Promise((resolve, reject) => {
      this.#waiting.set(batch, { resolve, reject });
      this.#workers[batch % this.#workers.length]!.postMessage({ kind: "batch", batch, texts } satisfies PoolRequest);
    });
  }

  #answer(r: PoolReply): void {
    const w = this.#waiting.get(r.batch);
    this.#waiting.delete(r.batch);
    if (r.kind === "error") w?.reject(new Error(r.message));
    else w?.resolve({ ids: r.ids, lengths: r.lengths });
  }

  #failAll(e: Error): void {
    for (const w of this.#waiting.values()) w.reject(e);
    this.#waiting.clear();
  }

  close(): void {
    for (const w of this.#workers) w.terminate();
  }
}
