// The data-loader's messages: a trainer's batch requests and the batches it answers
// (mt.<job>.data.next), its stats, and a job's data plan (the data-loader answers it on
// mt.ctl.plan and mt.<job>.data.plan; a JobSpec carries it too). The decoding contract is in
// common.ts.
import type { Builder } from "flatbuffers";
import {
  bytesOf,
  createBytes,
  createBytesFilled,
  createI32s,
  f32Of,
  finishBytes,
  guarded,
  openRoot,
  schemaVersion,
  WireFormatError,
} from "../codec.ts";
import {
  Batch as BatchT,
  BatchRequest as BatchRequestT,
  DataPlan as DataPlanT,
  LoaderStats as LoaderStatsT,
  Split,
} from "../wire.ts";
import { hostKernels } from "../../ffi/cpu/host.ts";
import { big, builder, num, root, str } from "./common.ts";

export { Split };

// ---- data ----------------------------------------------------------------------------------

export interface BatchRequest {
  job: string;
  rank: number;
  split: Split;
  credits: number;
  /** Train: the trainer step the batch is for; Val/Test: the batch index in the rank's share */
  step: number;
}

const batchRequestRoot = root("BatchRequest", "MTBQ", (bb) => BatchRequestT.getRootAsBatchRequest(bb));

export function encodeBatchRequest(m: BatchRequest): Uint8Array {
  const b = builder(128);
  const job = str(b, m.job);
  return finishBytes(
    b,
    BatchRequestT.createBatchRequest(b, schemaVersion, job, m.rank, m.split, m.credits, big(m.step)),
    batchRequestRoot.identifier,
  );
}

export function decodeBatchRequest(data: Uint8Array, bytesMax: number): BatchRequest {
  const r = openRoot(data, batchRequestRoot, bytesMax);
  return guarded("BatchRequest", () => ({
    job: r.job() ?? "",
    rank: r.rank(),
    split: r.split(),
    credits: r.credits(),
    step: num(r.step()),
  }));
}

export interface Batch {
  epoch: number;
  index: number;
  sampleIds: Uint32Array;
  rows: number;
  cols: number;
  /** (rows, cols) */
  x: Float32Array;
  /** (rows) */
  y: Int32Array;
  endOfEpoch: boolean;
  /** token data: (rows, cols + 1) token ids, each row a window with its next token; x and y empty */
  tokens?: Uint16Array;
}

/**
 * Images on the wire as 8-bit pixels and the 256 values they stand for: encodeBatch sends
 * these instead of x, and decodeBatch turns them back into x (the same floats, bit for bit).
 */
export interface BatchPixels {
  /** (rows, cols) */
  pixels: Uint8Array;
  /** 256 finite values */
  values: Float32Array;
}

const batchRoot = root("Batch", "MTBA", (bb) => BatchT.getRootAsBatch(bb));

/** With `pixels`, x is not sent (pass it empty): the receiver rebuilds it from the pixels. */
export function encodeBatch(m: Batch, pixels?: BatchPixels): Uint8Array {
  const tokens = m.tokens ?? new Uint16Array(0);
  const px = pixels?.pixels ?? new Uint8Array(0),
    pv = pixels?.values ?? new Float32Array(0);
  const b = builder(
    2048 + m.x.byteLength + m.y.byteLength + m.sampleIds.byteLength + tokens.byteLength + px.byteLength + pv.byteLength,
  );
  const x = createBytes(b, bytesOf(m.x));
  const y = createI32s(b, m.y);
  const ids = createI32s(b, m.sampleIds);
  const t = createBytesFilled(b, tokens.byteLength, (dst) => dst.set(bytesOf(tokens)), 4, 2);
  const p = createBytes(b, px);
  const v = createBytesFilled(b, pv.byteLength, (dst) => dst.set(bytesOf(pv)), 4, 4);
  return finishBytes(
    b,
    BatchT.createBatch(b, schemaVersion, m.epoch, m.index, ids, m.rows, m.cols, x, y, m.endOfEpoch, t, p, v),
    batchRoot.identifier,
  );
}

/** x of a batch sent as pixels: values[pixel] for each pixel (`pixels` at any byte offset). */
export function pixelsToX(name: string, pixels: Uint8Array, values: Float32Array | null): Float32Array {
  if (values === null || values.length !== 256)
    throw new WireFormatError("malformed", `${name}: ${values?.length ?? 0} pixel values, not 256`);
  for (const v of values)
    if (!Number.isFinite(v)) throw new WireFormatError("malformed", `${name}: a pixel value is ${v}`);
  // in C (a trainer decodes every image of every batch: in JavaScript, even four pixels per
  // 32-bit read, this was 9% of a parameter-server job's trainer)
  const x = new Float32Array(pixels.length);
  hostKernels().lookup(x, pixels, values);
  return x;
}

export function decodeBatch(data: Uint8Array, bytesMax: number): Batch {
  const r = openRoot(data, batchRoot, bytesMax);
  const m = guarded("Batch", () => ({
    epoch: r.epoch(),
    index: r.index(),
    sampleIds: (r.sampleIdsArray() ?? new Uint32Array(0)).slice(),
    rows: r.rows(),
    cols: r.cols(),
    x: f32Of("Batch.x", r.xArray()),
    y: (r.yArray() ?? new Int32Array(0)).slice(),
    endOfEpoch: r.endOfEpoch(),
    ...tokensField(r.tokensArray()),
    pixels: r.pixelsArray(),
    pixelValues: r.pixelValuesArray(),
  }));
  const { pixels, pixelValues, ...batch } = m;
  if (pixels !== null && pixels.length > 0) {
    if (batch.x.length > 0)
      throw new WireFormatError("malformed", `Batch: both x (${batch.x.length} values) and ${pixels.length} pixels`);
    batch.x = pixelsToX("Batch", pixels, pixelValues);
  }
  return checkBatch(batch);
}

function checkBatch(m: Batch): Batch {
  const tokens = m.tokens?.length ?? 0;
  const ok =
    tokens > 0
      ? m.x.length === 0 && m.y.length === 0 && tokens === m.rows * (m.cols + 1)
      : m.x.length === m.rows * m.cols && m.y.length === m.rows;
  if (!ok || m.sampleIds.length !== m.rows) {
    throw new WireFormatError(
      "malformed",
      `Batch: ${m.rows}x${m.cols} with ${m.x.length} x values, ${m.y.length} labels, ${tokens} tokens, ${m.sampleIds.length} ids`,
    );
  }
  return m;
}

const tokensField = (t: Uint16Array | null): { tokens?: Uint16Array } =>
  t !== null && t.length > 0 ? { tokens: t.slice() } : {};

// ---- loader stats --------------------------------------------------------------------------

export interface LoaderStats {
  job: string;
  batches: number;
  batchesPerS: number;
  queueDepth: number;
  prefetchHits: number;
  prefetchMisses: number;
  waitMsP50: number;
  waitMsP99: number;
}

const loaderStatsRoot = root("LoaderStats", "MTLS", (bb) => LoaderStatsT.getRootAsLoaderStats(bb));

export function encodeLoaderStats(m: LoaderStats): Uint8Array {
  const b = builder(128);
  const job = str(b, m.job);
  return finishBytes(
    b,
    LoaderStatsT.createLoaderStats(
      b,
      schemaVersion,
      job,
      big(m.batches),
      m.batchesPerS,
      m.queueDepth,
      big(m.prefetchHits),
      big(m.prefetchMisses),
      m.waitMsP50,
      m.waitMsP99,
    ),
    loaderStatsRoot.identifier,
  );
}

export function decodeLoaderStats(data: Uint8Array, bytesMax: number): LoaderStats {
  const r = openRoot(data, loaderStatsRoot, bytesMax);
  return guarded("LoaderStats", () => ({
    job: r.job() ?? "",
    batches: num(r.batches()),
    batchesPerS: r.batchesPerS(),
    queueDepth: r.queueDepth(),
    prefetchHits: num(r.prefetchHits()),
    prefetchMisses: num(r.prefetchMisses()),
    waitMsP50: r.waitMsP50(),
    waitMsP99: r.waitMsP99(),
  }));
}

// ---- data plan -----------------------------------------------------------------------------

export interface DataPlan {
  job: string;
  trainSamples: number;
  valSamples: number;
  testSamples: number;
  stepsPerEpoch: number;
  totalSteps: number;
  /** token data: the vocabulary's size (0: images) */
  vocabSize: number;
  /** character data: the vocabulary as Unicode code points in id order (empty: none) */
  vocab: number[];
  /** the flat parameter vector's length (padding included) and its leading decayed elements */
  slabNumel: number;
  decayElems: number;
  paramCount: number;
  /** a prepared folder's tokenizer ("gpt2"); "" for characters and images */
  tokenizer: string;
}

const dataPlanRoot = root("DataPlan", "MTDP", (bb) => DataPlanT.getRootAsDataPlan(bb));

/** Writes a plan into `b` (a message of its own, or the plan inside a JobSpec). */
export function writeDataPlan(b: Builder, m: DataPlan): number {
  const job = str(b, m.job);
  const vocab = DataPlanT.createVocabVector(b, Uint32Array.from(m.vocab));
  const tokenizer = str(b, m.tokenizer);
  return DataPlanT.createDataPlan(
    b,
    schemaVersion,
    job,
    m.trainSamples,
    m.valSamples,
    m.testSamples,
    big(m.stepsPerEpoch),
    big(m.totalSteps),
    m.vocabSize,
    vocab,
    big(m.slabNumel),
    big(m.decayElems),
    big(m.paramCount),
    tokenizer,
  );
}

/** Reads a plan (a message of its own, or the plan inside a JobSpec); refuses one that does not hold together. */
export function readDataPlan(r: DataPlanT): DataPlan {
  const m: DataPlan = {
    job: r.job() ?? "",
    trainSamples: r.trainSamples(),
    valSamples: r.valSamples(),
    testSamples: r.testSamples(),
    stepsPerEpoch: num(r.stepsPerEpoch()),
    totalSteps: num(r.totalSteps()),
    vocabSize: r.vocabSize(),
    vocab: [...(r.vocabArray() ?? [])],
    slabNumel: num(r.slabNumel()),
    decayElems: num(r.decayElems()),
    paramCount: num(r.paramCount()),
    tokenizer: r.tokenizer() ?? "",
  };
  if (m.tokenizer !== "" && m.tokenizer !== "gpt2")
    throw new WireFormatError("malformed", `DataPlan: unknown tokenizer ${JSON.stringify(m.tokenizer.slice(0, 40))}`);
  if (m.vocab.length > 0 && (m.vocab.length !== m.vocabSize || m.vocab.some((c) => c > 0x10ffff))) {
    throw new WireFormatError(
      "malformed",
      `DataPlan: a vocabulary of ${m.vocab.length} characters for vocab_size ${m.vocabSize}, or a code point past U+10FFFF`,
    );
  }
  if (m.vocabSize > 65536 || m.decayElems > m.slabNumel || m.paramCount > m.slabNumel) {
    throw new WireFormatError(
      "malformed",
      `DataPlan: vocab_size ${m.vocabSize}, ${m.decayElems} decayed and ${m.paramCount} parameters of a ${m.slabNumel}-element vector`,
    );
  }
  return m;
}

export function encodeDataPlan(m: DataPlan): Uint8Array {
  const b = builder(256 + m.vocab.length * 4);
  return finishBytes(b, writeDataPlan(b, m), dataPlanRoot.identifier);
}

export function decodeDataPlan(data: Uint8Array, bytesMax: number): DataPlan {
  const r = openRoot(data, dataPlanRoot, bytesMax);
  return guarded("DataPlan", () => readDataPlan(r));
}
