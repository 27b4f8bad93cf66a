// Plain TypeScript forms of every wire message, with encode/decode pairs. Decoding copies
// what it keeps out of the FlatBuffers buffer only where it must (float data stays a view
// into the aligned payload), validates counts against byte lengths, and turns any malformed
// read into a WireFormatError. Callers check semantics (shapes, job names, ranges).
import { Builder, type ByteBuffer } from "flatbuffers";
import {
  Batch as BatchT,
  BatchRequest as BatchRequestT,
  CheckpointList as CheckpointListT,
  Chunk as ChunkT,
  CollPhase,
  CollPiece as CollPieceT,
  ChunkState as ChunkStateT,
  DType,
  ErrorReply as ErrorReplyT,
  DataPlan as DataPlanT,
  Event as EventT,
  EventKind,
  FileEntry as FileEntryT,
  JobRecord as JobRecordT,
  JobRequest as JobRequestT,
  JobSpec as JobSpecT,
  JobState,
  LoaderStats as LoaderStatsT,
  ShardStats as ShardStatsT,
  Manifest as ManifestT,
  NamedVector as NamedVectorT,
  PullReply as PullReplyT,
  PullRequest as PullRequestT,
  PushReply as PushReplyT,
  PushRequest as PushRequestT,
  ShardState as ShardStateT,
  Split,
  SyncPolicy,
  TrainerStats as TrainerStatsT,
  Heartbeat as HeartbeatT,
  Reconnected as ReconnectedT,
} from "./wire.ts";
import {
  bytesOf,
  createBytes,
  createBytesFilled,
  createI32s,
  f32Of,
  finishBytes,
  guarded,
  openRoot,
  verifyTable,
  type RootType,
  schemaVersion,
  WireFormatError,
} from "./codec.ts";

export { CollPhase, DType, EventKind, JobState, Split, SyncPolicy };

/** bytes per element (TopK: per entry sent, an index and a value) */
const dtypeBytes: Record<DType, number> = {
  [DType.F32]: 4,
  [DType.F16]: 2,
  [DType.I8]: 1,
  [DType.BF16]: 2,
  [DType.TopK]: 8,
};

/** Bytes of a chunk's data: count elements, or nnz entries for TopK. */
export const chunkDataBytes = (dtype: DType, count: number, nnz = 0): number =>
  (dtype === DType.TopK ? nnz : count) * dtypeBytes[dtype];

function root<T extends { schemaVersion(): number }>(
  name: string,
  identifier: string,
  getRoot: (bb: ByteBuffer) => T,
): RootType<T> {
  return { name, identifier, getRoot, version: (r) => r.schemaVersion() };
}

const str = (b: Builder, s: string) => b.createString(s);
/**
 * A builder whose capacity is a multiple of 64 bytes: FlatBuffers aligns from the end of the
 * buffer, so only then are 16-byte aligned vectors also aligned from the start of its memory.
 */
const builder = (bytes: number) => new Builder(Math.ceil(bytes / 64) * 64);
const big = (n: number) => BigInt(n);
const num = (n: bigint) => Number(n);

// ---- chunks --------------------------------------------------------------------------------

export interface Chunk {
  id: number;
  version: number;
  dtype: DType;
  scale: number;
  count: number;
  /** the element bytes (f32: count * 4; TopK: nnz indices then nnz values) */
  data: Uint8Array;
  /** TopK: the entries sent (0 otherwise) */
  nnz?: number;
}

export const f32Chunk = (id: number, values: Float32Array, version = 0): Chunk => ({
  id,
  version,
  dtype: DType.F32,
  scale: 1,
  count: values.length,
  data: bytesOf(values),
});

/** fp32 values of an F32 chunk (a view); other dtypes are decompressed by the caller. */
export const chunkF32 = (c: Chunk): Float32Array => f32Of(`chunk ${c.id}`, c.data);

/** A chunk whose bytes are written straight into the message by `fill` (count elements of dtype: F32, F16 or BF16). */
export interface ChunkSource {
  id: number;
  version: number;
  count: number;
  /** F32 when absent */
  dtype?: DType;
  fill(dst: Uint8Array): void;
}

function writeChunk(b: Builder, c: Chunk | ChunkSource): number {
  const dtype = c.dtype ?? DType.F32,
    scale = "fill" in c ? 1 : c.scale;
  if ("fill" in c && dtype !== DType.F32 && dtype !== DType.F16 && dtype !== DType.BF16)
    throw new RangeError(`a filled chunk is dense, not ${DType[dtype]}`);
  const data = "fill" in c ? createBytesFilled(b, c.count * dtypeBytes[dtype], c.fill) : createBytes(b, c.data);
  ChunkT.startChunk(b);
  ChunkT.addId(b, c.id);
  ChunkT.addVersion(b, big(c.version));
  ChunkT.addDtype(b, dtype);
  ChunkT.addScale(b, scale);
  ChunkT.addCount(b, c.count);
  ChunkT.addData(b, data);
  if (!("fill" in c) && (c.nnz ?? 0) > 0) ChunkT.addNnz(b, c.nnz!);
  return ChunkT.endChunk(b);
}

function readChunk(c: ChunkT): Chunk {
  const dtype = c.dtype();
  const width = dtypeBytes[dtype];
  if (width === undefined) throw new WireFormatError("malformed", `chunk ${c.id()}: unknown dtype ${dtype}`);
  const data = c.dataArray() ?? new Uint8Array(0);
  const count = c.count(),
    nnz = c.nnz();
  if (dtype === DType.TopK) {
    if (nnz > count)
      throw new WireFormatError("malformed", `chunk ${c.id()}: ${nnz} top-k entries of ${count} elements`);
    if (data.byteLength !== nnz * width)
      throw new WireFormatError(
        "malformed",
        `chunk ${c.id()}: ${data.byteLength} data bytes for ${nnz} top-k entries of ${width} bytes`,
      );
  } else if (nnz !== 0)
    throw new WireFormatError("malformed", `chunk ${c.id()}: nnz ${nnz} on a dense ${DType[dtype]} chunk`);
  else if (data.byteLength !== count * width) {
    throw new WireFormatError(
      "malformed",
      `chunk ${c.id()}: ${data.byteLength} data bytes for ${count} elements of ${width} bytes`,
    );
  }
  return { id: c.id(), version: num(c.version()), dtype, scale: c.scale(), count, data, nnz };
}

/** Reads a vector of tables, verifying that each element table lies inside the buffer. */
function readList<T extends { bb: ByteBuffer | null; bb_pos: number }, R>(
  length: number,
  at: (i: number) => T | null,
  read: (t: T) => R,
  what: string,
): R[] {
  const out: R[] = [];
  for (let i = 0; i < length; i++) {
    const t = at(i);
    if (t === null || t.bb === null) throw new WireFormatError("malformed", `${what}[${i}] is missing`);
    verifyTable(t.bb, t.bb_pos, `${what}[${i}]`);
    out.push(read(t));
  }
  return out;
}

function chunkVector(
  b: Builder,
  chunks: readonly (Chunk | ChunkSource)[],
  create: (b: Builder, offsets: number[]) => number,
): number {
  return create(
    b,
    chunks.map((c) => writeChunk(b, c)),
  );
}

// ---- ErrorReply ----------------------------------------------------------------------------

export interface ErrorReply {
  code: string;
  message: string;
  subject: string;
}

const errorRoot = root("ErrorReply", "MTER", (bb) => ErrorReplyT.getRootAsErrorReply(bb));

export function encodeErrorReply(e: ErrorReply): Uint8Array {
  const b = builder(256 + e.message.length);
  const code = str(b, e.code),
    message = str(b, e.message),
    subject = str(b, e.subject);
  return finishBytes(b, ErrorReplyT.createErrorReply(b, schemaVersion, code, message, subject), errorRoot.identifier);
}

/** True when the bytes carry the ErrorReply identifier (checked before decoding a reply). */
export const isErrorReply = (data: Uint8Array): boolean =>
  data.byteLength >= 8 && data[4] === 0x4d && data[5] === 0x54 && data[6] === 0x45 && data[7] === 0x52; // "MTER"

export function decodeErrorReply(data: Uint8Array, bytesMax: number): ErrorReply {
  const r = openRoot(data, errorRoot, bytesMax);
  return guarded("ErrorReply", () => ({
    code: r.code() ?? "",
    message: r.message() ?? "",
    subject: r.subject() ?? "",
  }));
}

// ---- push ----------------------------------------------------------------------------------

export interface PushRequest {
  job: string;
  trainer: number;
  step: number;
  chunks: Chunk[];
}

const pushRoot = root("PushRequest", "MTPS", (bb) => PushRequestT.getRootAsPushRequest(bb));

export function encodePushRequest(m: PushRequest): Uint8Array {
  const b = builder(1024 + m.chunks.reduce((s, c) => s + c.data.byteLength + 64, 0));
  const chunks = chunkVector(b, m.chunks, PushRequestT.createChunksVector);
  const job = str(b, m.job);
  return finishBytes(
    b,
    PushRequestT.createPushRequest(b, schemaVersion, job, m.trainer, big(m.step), chunks),
    pushRoot.identifier,
  );
}

export function decodePushRequest(data: Uint8Array, bytesMax: number): PushRequest {
  const r = openRoot(data, pushRoot, bytesMax, { align: false }); // byte vectors only: no aligned copy
  return guarded("PushRequest", () => ({
    job: r.job() ?? "",
    trainer: r.trainer(),
    step: num(r.step()),
    chunks: readList(r.chunksLength(), (i) => r.chunks(i), readChunk, "PushRequest.chunks"),
  }));
}

export interface PushReply {
  accepted: number;
  duplicates: number;
  updates: number;
}

const pushReplyRoot = root("PushReply", "MTPR", (bb) => PushReplyT.getRootAsPushReply(bb));

export function encodePushReply(m: PushReply): Uint8Array {
  const b = builder(64);
  return finishBytes(
    b,
    PushReplyT.createPushReply(b, schemaVersion, m.accepted, m.duplicates, m.updates),
    pushReplyRoot.identifier,
  );
}

export function decodePushReply(data: Uint8Array, bytesMax: number): PushReply {
  const r = openRoot(data, pushReplyRoot, bytesMax);
  return guarded("PushReply", () => ({ accepted: r.accepted(), duplicates: r.duplicates(), updates: r.updates() }));
}

// ---- pull ----------------------------------------------------------------------------------

export interface PullRequest {
  job: string;
  trainer: number;
  step: number;
  ids: Uint32Array;
  /** the parameters' type in the reply (F32 when absent; F16 or BF16: a lossy copy) */
  dtype?: DType;
}

const pullRoot = root("PullRequest", "MTPL", (bb) => PullRequestT.getRootAsPullRequest(bb));

export function encodePullRequest(m: PullRequest): Uint8Array {
  const b = builder(256 + m.ids.byteLength);
  const ids = createI32s(b, m.ids);
  const job = str(b, m.job);
  return finishBytes(
    b,
    PullRequestT.createPullRequest(b, schemaVersion, job, m.trainer, big(m.step), ids, m.dtype ?? DType.F32),
    pullRoot.identifier,
  );
}

export function decodePullRequest(data: Uint8Array, bytesMax: number): PullRequest {
  const r = openRoot(data, pullRoot, bytesMax);
  return guarded("PullRequest", () => ({
    job: r.job() ?? "",
    trainer: r.trainer(),
    step: num(r.step()),
    ids: (r.idsArray() ?? new Uint32Array(0)).slice(),
    dtype: r.dtype(),
  }));
}

export interface PullReply {
  updates: number;
  chunks: Chunk[];
}

const pullReplyRoot = root("PullReply", "MTPY", (bb) => PullReplyT.getRootAsPullReply(bb));

/** A pull reply; chunks given as sources have their bytes filled in place (see ChunkSource). */
export function encodePullReply(updates: number, chunks: readonly (Chunk | ChunkSource)[]): Uint8Array {
  const b = builder(
    1024 +
      chunks.reduce(
        (s, c) => s + ("fill" in c ? c.count * dtypeBytes[c.dtype ?? DType.F32] : c.data.byteLength) + 64,
        0,
      ),
  );
  const vec = chunkVector(b, chunks, PullReplyT.createChunksVector);
  return finishBytes(b, PullReplyT.createPullReply(b, schemaVersion, big(updates), vec), pullReplyRoot.identifier);
}

export function decodePullReply(data: Uint8Array, bytesMax: number): PullReply {
  const r = openRoot(data, pullReplyRoot, bytesMax, { align: false }); // byte vectors only: no aligned copy
  return guarded("PullReply", () => ({
    updates: num(r.updates()),
    chunks: readList(r.chunksLength(), (i) => r.chunks(i), readChunk, "PullReply.chunks"),
  }));
}

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

/** x of a batch sent as pixels: values[pixel] for each pixel. */
function pixelsToX(name: string, pixels: Uint8Array, values: Float32Array | null): Float32Array {
  if (values === null || values.length !== 256)
    throw new WireFormatError("malformed", `${name}: ${values?.length ?? 0} pixel values, not 256`);
  for (const v of values)
    if (!Number.isFinite(v)) throw new WireFormatError("malformed", `${name}: a pixel value is ${v}`);
  const x = new Float32Array(pixels.length);
  for (let i = 0; i < pixels.length; i++) x[i] = values[pixels[i]!]!;
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

// ---- events --------------------------------------------------------------------------------

export interface Event {
  job: string;
  kind: EventKind;
  rank: number;
  step: number;
  timeMs: number;
  loss: number;
  lr: number;
  /** -1 when the event carries none */
  accuracy: number;
  samplesPerS: number;
  dataWaitMs: number;
  pullMs: number;
  computeMs: number;
  pushMs: number;
  text: string;
  /** Eval: samples evaluated */
  count: number;
  /** Step, all-reduce mode: the collectives' time, and the part the step waited for after compute */
  commMs: number;
  exposedCommMs: number;
  /** Step: gradient and parameter bytes this rank moved on the bus for the step, as encoded */
  wireBytes: number;
  /** Step, all-reduce with top-k: share of the summed gradient not zero (-1: none) */
  density: number;
  /** Step, rank 0: time the step waited at its boundary for a snapshot */
  snapshotMs: number;
  /** Restore, all-reduce mode: the communicator generation of the replica load it announces (0: any) */
  generation: number;
}

export const emptyEvent = (job: string, kind: EventKind): Event => ({
  job,
  kind,
  rank: 0,
  step: 0,
  timeMs: Date.now(),
  loss: 0,
  lr: 0,
  accuracy: -1,
  samplesPerS: 0,
  dataWaitMs: 0,
  pullMs: 0,
  computeMs: 0,
  pushMs: 0,
  text: "",
  count: 0,
  commMs: 0,
  exposedCommMs: 0,
  wireBytes: 0,
  density: -1,
  snapshotMs: 0,
  generation: 0,
});

const eventRoot = root("Event", "MTEV", (bb) => EventT.getRootAsEvent(bb));

export function encodeEvent(m: Event): Uint8Array {
  const b = builder(256 + m.text.length * 3);
  const job = str(b, m.job),
    text = str(b, m.text);
  return finishBytes(
    b,
    EventT.createEvent(
      b,
      schemaVersion,
      job,
      m.kind,
      m.rank,
      big(m.step),
      m.timeMs,
      m.loss,
      m.lr,
      m.accuracy,
      m.samplesPerS,
      m.dataWaitMs,
      m.pullMs,
      m.computeMs,
      m.pushMs,
      text,
      m.count,
      m.commMs,
      m.exposedCommMs,
      m.wireBytes,
      m.density,
      m.snapshotMs,
      big(m.generation),
    ),
    eventRoot.identifier,
  );
}

export function decodeEvent(data: Uint8Array, bytesMax: number): Event {
  const r = openRoot(data, eventRoot, bytesMax);
  return guarded("Event", () => ({
    job: r.job() ?? "",
    kind: r.kind(),
    rank: r.rank(),
    step: num(r.step()),
    timeMs: r.timeMs(),
    loss: r.loss(),
    lr: r.lr(),
    accuracy: r.accuracy(),
    samplesPerS: r.samplesPerS(),
    dataWaitMs: r.dataWaitMs(),
    pullMs: r.pullMs(),
    computeMs: r.computeMs(),
    pushMs: r.pushMs(),
    text: r.text() ?? "",
    count: r.count(),
    commMs: r.commMs(),
    exposedCommMs: r.exposedCommMs(),
    wireBytes: r.wireBytes(),
    density: r.density(),
    snapshotMs: r.snapshotMs(),
    generation: num(r.generation()),
  }));
}

// ---- job spec ------------------------------------------------------------------------------

export interface JobSpec {
  job: string;
  trainers: number;
  shards: number;
  sync: SyncPolicy;
  staleness: number;
  configJson: string;
  /** the submission of the job name this spec belongs to (its record's attempts); 0: not known */
  attempt?: number;
  /** the job's plan, computed at submission (absent: a request for one, `mt.ctl.plan`) */
  plan?: DataPlan;
}

const jobRoot = root("JobSpec", "MTJS", (bb) => JobSpecT.getRootAsJobSpec(bb));

export function encodeJobSpec(m: JobSpec): Uint8Array {
  const b = builder(512 + m.configJson.length * 3 + (m.plan?.vocab.length ?? 0) * 4);
  const job = str(b, m.job),
    config = str(b, m.configJson);
  const plan = m.plan ? createPlan(b, m.plan) : 0;
  JobSpecT.startJobSpec(b);
  JobSpecT.addSchemaVersion(b, schemaVersion);
  JobSpecT.addJob(b, job);
  JobSpecT.addTrainers(b, m.trainers);
  JobSpecT.addShards(b, m.shards);
  JobSpecT.addSync(b, m.sync);
  JobSpecT.addStaleness(b, m.staleness);
  JobSpecT.addConfigJson(b, config);
  JobSpecT.addAttempt(b, m.attempt ?? 0);
  if (plan !== 0) JobSpecT.addPlan(b, plan);
  return finishBytes(b, JobSpecT.endJobSpec(b), jobRoot.identifier);
}

export function decodeJobSpec(data: Uint8Array, bytesMax: number): JobSpec {
  const r = openRoot(data, jobRoot, bytesMax);
  return guarded("JobSpec", () => ({
    job: r.job() ?? "",
    trainers: r.trainers(),
    shards: r.shards(),
    sync: r.sync(),
    staleness: r.staleness(),
    configJson: r.configJson() ?? "",
    attempt: r.attempt(),
    ...planField(r.plan()),
  }));
}

function planField(p: DataPlanT | null): { plan?: DataPlan } {
  if (p === null) return {};
  verifyTable(p.bb!, p.bb_pos, "JobSpec.plan");
  return { plan: planOf(p) };
}

// ---- shard state (checkpoints) -------------------------------------------------------------

export interface ChunkState {
  id: number;
  version: number;
  params: Float32Array;
  state: { name: string; data: Float32Array }[];
}

export interface ShardState {
  job: string;
  shard: number;
  updates: number;
  optimizerSteps: number;
  chunks: ChunkState[];
  /** the trainers' step when the snapshot was taken */
  step: number;
  /** a state cut into messages (a replica in all-reduce mode): `shard` is this part's index; 0 or 1: whole */
  parts?: number;
  /** all-reduce mode, on restore: the communicator generation the ranks resume with */
  generation?: number;
  /** all-reduce mode, f16: the loss scaler's scale (0: none) */
  lossScale?: number;
  /** ZeRO: the chunks are slab ranges (id = offset) of trainer `rank`'s partition */
  slabRanges?: boolean;
  rank?: number;
  /** a parameter server's state in `parts` messages: `shard` is the shard, this the part */
  part?: number;
  /** shardStateChecksum of the rest (0n: none) */
  checksum?: bigint;
}

/**
 * A checksum (wyhash, chained) over what a state holds: job, step, counters, loss scale, and
 * every chunk's id, version, state names and bytes. It leaves out where a part travels (shard,
 * part, parts, generation, rank), which the checkpoint service sets when it routes a restore.
 * A load whose checksum differs was changed after it was cut and is refused.
 */
export function shardStateChecksum(m: ShardState): bigint {
  let h = Bun.hash.wyhash(
    JSON.stringify([m.job, m.updates, m.optimizerSteps, m.step, m.lossScale ?? 0, m.slabRanges ?? false]),
    0n,
  );
  for (const c of m.chunks) {
    h = Bun.hash.wyhash(`${c.id}:${c.version}:${c.params.length}:${c.state.map((v) => v.name).join(",")}`, h);
    h = Bun.hash.wyhash(bytesOf(c.params), h);
    for (const v of c.state) h = Bun.hash.wyhash(bytesOf(v.data), h);
  }
  return h;
}

/** The state with its checksum set. */
export const withChecksum = (m: ShardState): ShardState => ({ ...m, checksum: shardStateChecksum(m) });

const shardStateRoot = root("ShardState", "MTSS", (bb) => ShardStateT.getRootAsShardState(bb));

export function encodeShardState(m: ShardState): Uint8Array {
  const bytes = m.chunks.reduce((s, c) => s + c.params.byteLength * (1 + c.state.length) + 256, 1024);
  const b = builder(bytes);
  const chunks = m.chunks.map((c) => {
    const state = ChunkStateT.createStateVector(
      b,
      c.state.map((v) => {
        const data = createBytes(b, bytesOf(v.data)),
          name = str(b, v.name);
        return NamedVectorT.createNamedVector(b, name, data);
      }),
    );
    const params = createBytes(b, bytesOf(c.params));
    return ChunkStateT.createChunkState(b, c.id, big(c.version), params, state);
  });
  const vec = ShardStateT.createChunksVector(b, chunks),
    job = str(b, m.job);
  return finishBytes(
    b,
    ShardStateT.createShardState(
      b,
      schemaVersion,
      job,
      m.shard,
      big(m.updates),
      big(m.optimizerSteps),
      vec,
      big(m.step),
      m.parts ?? 0,
      big(m.generation ?? 0),
      m.lossScale ?? 0,
      m.slabRanges ?? false,
      m.rank ?? 0,
      m.part ?? 0,
      m.checksum ?? 0n,
    ),
    shardStateRoot.identifier,
  );
}

export function decodeShardState(data: Uint8Array, bytesMax: number): ShardState {
  const r = openRoot(data, shardStateRoot, bytesMax, { align: false }); // byte vectors only: no aligned copy
  return guarded("ShardState", () => ({
    job: r.job() ?? "",
    shard: r.shard(),
    updates: num(r.updates()),
    optimizerSteps: num(r.optimizerSteps()),
    step: num(r.step()),
    parts: r.parts(),
    generation: num(r.generation()),
    lossScale: r.lossScale(),
    slabRanges: r.slabRanges(),
    rank: r.rank(),
    part: r.part(),
    checksum: r.checksum(),
    chunks: readList(
      r.chunksLength(),
      (i) => r.chunks(i),
      (c) => ({
        id: c.id(),
        version: num(c.version()),
        params: f32Of(`chunk ${c.id()} params`, c.paramsArray()),
        state: readList(
          c.stateLength(),
          (i) => c.state(i),
          (v) => ({ name: v.name() ?? "", data: f32Of(`chunk ${c.id()} state`, v.dataArray()) }),
          "state",
        ),
      }),
      "ShardState.chunks",
    ),
  }));
}

// ---- checkpoint manifest -------------------------------------------------------------------

export interface FileEntry {
  name: string;
  bytes: number;
  crc32: number;
}

export interface Manifest {
  formatVersion: number;
  job: string;
  id: string;
  step: number;
  createdMs: number;
  metric: number;
  configJson: string;
  files: FileEntry[];
  /** per trainer rank: the step its data resumes from */
  cursors: number[];
  /** the model file exported from this snapshot (a job's final one); "" otherwise */
  modelPath: string;
}

const manifestRoot = root("Manifest", "MTCM", (bb) => ManifestT.getRootAsManifest(bb));

function writeManifest(b: Builder, m: Manifest): number {
  const cursors = ManifestT.createCursorsVector(b, m.cursors.map(big));
  const files = ManifestT.createFilesVector(
    b,
    m.files.map((f) => FileEntryT.createFileEntry(b, str(b, f.name), big(f.bytes), f.crc32)),
  );
  const job = str(b, m.job),
    id = str(b, m.id),
    config = str(b, m.configJson),
    modelPath = str(b, m.modelPath);
  return ManifestT.createManifest(
    b,
    schemaVersion,
    m.formatVersion,
    job,
    id,
    big(m.step),
    m.createdMs,
    m.metric,
    config,
    files,
    cursors,
    modelPath,
  );
}

export function encodeManifest(m: Manifest): Uint8Array {
  const b = builder(1024 + (m.configJson.length + m.modelPath.length) * 3);
  return finishBytes(b, writeManifest(b, m), manifestRoot.identifier);
}

function readManifest(r: ManifestT): Manifest {
  return {
    formatVersion: r.formatVersion(),
    job: r.job() ?? "",
    id: r.id() ?? "",
    step: num(r.step()),
    createdMs: r.createdMs(),
    metric: r.metric(),
    configJson: r.configJson() ?? "",
    files: readList(
      r.filesLength(),
      (i) => r.files(i),
      (f) => ({ name: f.name() ?? "", bytes: num(f.bytes()), crc32: f.crc32() }),
      "Manifest.files",
    ),
    cursors: Array.from({ length: r.cursorsLength() }, (_, i) => num(r.cursors(i) ?? 0n)),
    modelPath: r.modelPath() ?? "",
  };
}

export function decodeManifest(data: Uint8Array, bytesMax: number): Manifest {
  const r = openRoot(data, manifestRoot, bytesMax);
  return guarded("Manifest", () => readManifest(r));
}

export interface CheckpointList {
  job: string;
  items: Manifest[];
}

const checkpointListRoot = root("CheckpointList", "MTCL", (bb) => CheckpointListT.getRootAsCheckpointList(bb));

export function encodeCheckpointList(m: CheckpointList): Uint8Array {
  const b = builder(1024);
  const items = CheckpointListT.createItemsVector(
    b,
    m.items.map((x) => writeManifest(b, x)),
  );
  const job = str(b, m.job);
  return finishBytes(
    b,
    CheckpointListT.createCheckpointList(b, schemaVersion, job, items),
    checkpointListRoot.identifier,
  );
}

export function decodeCheckpointList(data: Uint8Array, bytesMax: number): CheckpointList {
  const r = openRoot(data, checkpointListRoot, bytesMax);
  return guarded("CheckpointList", () => ({
    job: r.job() ?? "",
    items: readList(r.itemsLength(), (i) => r.items(i), readManifest, "CheckpointList.items"),
  }));
}

// ---- job requests --------------------------------------------------------------------------

export interface JobRequest {
  job: string;
  step: number;
  tag: string;
  /** ps.<k>.norm's reply: a shard's sum of squares; a trainer's ckpt.recover after a failed
   *  collective: the communicator generation that failed (absent: 0) */
  value?: number;
}

const jobRequestRoot = root("JobRequest", "MTJR", (bb) => JobRequestT.getRootAsJobRequest(bb));

/** A request's job name and tag are short words (a tag names a part, a snapshot or a reason):
 *  longer ones are refused, so that no text copied from a request into an event or a log is large. */
export const jobRequestTextMax = 256;

export function encodeJobRequest(m: JobRequest): Uint8Array {
  const b = builder(128);
  const job = str(b, m.job),
    tag = str(b, m.tag);
  return finishBytes(
    b,
    JobRequestT.createJobRequest(b, schemaVersion, job, big(m.step), tag, m.value ?? 0),
    jobRequestRoot.identifier,
  );
}

export function decodeJobRequest(data: Uint8Array, bytesMax: number): JobRequest {
  const r = openRoot(data, jobRequestRoot, bytesMax);
  return guarded("JobRequest", () => {
    const value = r.value();
    const job = r.job() ?? "",
      tag = r.tag() ?? "";
    for (const [what, text] of [
      ["job name", job],
      ["tag", tag],
    ] as const)
      if (text.length > jobRequestTextMax)
        throw new WireFormatError(
          "malformed",
          `a JobRequest's ${what} of ${text.length} characters (at most ${jobRequestTextMax})`,
        );
    return { job, step: num(r.step()), tag, ...(value !== 0 ? { value } : {}) };
  });
}

// ---- shard stats ---------------------------------------------------------------------------

export interface ShardStats {
  job: string;
  shard: number;
  chunks: number;
  elements: number;
  updates: number;
  pushes: number;
  duplicates: number;
  pulls: number;
  waiting: number;
  clocks: number[];
}

const shardStatsRoot = root("ShardStats", "MTST", (bb) => ShardStatsT.getRootAsShardStats(bb));

export function encodeShardStats(m: ShardStats): Uint8Array {
  const b = builder(256);
  const clocks = ShardStatsT.createClocksVector(b, m.clocks.map(big));
  const job = str(b, m.job);
  return finishBytes(
    b,
    ShardStatsT.createShardStats(
      b,
      schemaVersion,
      job,
      m.shard,
      m.chunks,
      big(m.elements),
      big(m.updates),
      big(m.pushes),
      big(m.duplicates),
      big(m.pulls),
      m.waiting,
      clocks,
    ),
    shardStatsRoot.identifier,
  );
}

export function decodeShardStats(data: Uint8Array, bytesMax: number): ShardStats {
  const r = openRoot(data, shardStatsRoot, bytesMax);
  return guarded("ShardStats", () => ({
    job: r.job() ?? "",
    shard: r.shard(),
    chunks: r.chunks(),
    elements: num(r.elements()),
    updates: num(r.updates()),
    pushes: num(r.pushes()),
    duplicates: num(r.duplicates()),
    pulls: num(r.pulls()),
    waiting: r.waiting(),
    clocks: Array.from({ length: r.clocksLength() }, (_, i) => num(r.clocks(i) ?? 0n)),
  }));
}

// ---- trainer stats -------------------------------------------------------------------------

export interface TrainerStats {
  job: string;
  rank: number;
  step: number;
  /** ZeRO stage (0 in parameter-server mode) and the ranks the model state is cut among */
  zeroStage: number;
  ranks: number;
  paramCount: number;
  paramBytes: number;
  gradBytes: number;
  optimizerBytes: number;
  bucketBytes: number;
  arenaPeakBytes: number;
  wireBytes: number;
  /** offload: host memory the optimizer runs in */
  hostBytes: number;
  /** ZeRO stage 3: the most parameter bytes gathered at once */
  gatheredPeakBytes: number;
}

const trainerStatsRoot = root("TrainerStats", "MTTS", (bb) => TrainerStatsT.getRootAsTrainerStats(bb));

export function encodeTrainerStats(m: TrainerStats): Uint8Array {
  const b = builder(256);
  const job = str(b, m.job);
  return finishBytes(
    b,
    TrainerStatsT.createTrainerStats(
      b,
      schemaVersion,
      job,
      m.rank,
      big(m.step),
      m.zeroStage,
      m.ranks,
      big(m.paramCount),
      big(m.paramBytes),
      big(m.gradBytes),
      big(m.optimizerBytes),
      big(m.bucketBytes),
      big(m.arenaPeakBytes),
      big(m.wireBytes),
      big(m.hostBytes),
      big(m.gatheredPeakBytes),
    ),
    trainerStatsRoot.identifier,
  );
}

export function decodeTrainerStats(data: Uint8Array, bytesMax: number): TrainerStats {
  const r = openRoot(data, trainerStatsRoot, bytesMax);
  return guarded("TrainerStats", () => ({
    job: r.job() ?? "",
    rank: r.rank(),
    step: num(r.step()),
    zeroStage: r.zeroStage(),
    ranks: r.ranks(),
    paramCount: num(r.paramCount()),
    paramBytes: num(r.paramBytes()),
    gradBytes: num(r.gradBytes()),
    optimizerBytes: num(r.optimizerBytes()),
    bucketBytes: num(r.bucketBytes()),
    arenaPeakBytes: num(r.arenaPeakBytes()),
    wireBytes: num(r.wireBytes()),
    hostBytes: num(r.hostBytes()),
    gatheredPeakBytes: num(r.gatheredPeakBytes()),
  }));
}

// ---- heartbeats ----------------------------------------------------------------------------

export interface Heartbeat {
  job: string;
  /** "trainer 1", "shard 0", "data-loader" */
  who: string;
  step: number;
  /** data, pull, compute, push, collective, eval, checkpoint, serving, idle */
  phase: string;
  /** when the phase began (ms, the sender's clock) */
  phaseMs: number;
  /** a trainer: its last step's time (ms) */
  stepMs: number;
  /** the machine it runs on (empty: not said) */
  host: string;
}

const heartbeatRoot = root("Heartbeat", "MTHB", (bb) => HeartbeatT.getRootAsHeartbeat(bb));

export function encodeHeartbeat(m: Heartbeat): Uint8Array {
  const b = builder(128);
  const job = str(b, m.job),
    who = str(b, m.who),
    phase = str(b, m.phase),
    host = str(b, m.host);
  return finishBytes(
    b,
    HeartbeatT.createHeartbeat(b, schemaVersion, job, who, big(m.step), phase, m.phaseMs, m.stepMs, host),
    heartbeatRoot.identifier,
  );
}

export function decodeHeartbeat(data: Uint8Array, bytesMax: number): Heartbeat {
  const r = openRoot(data, heartbeatRoot, bytesMax);
  return guarded("Heartbeat", () => ({
    job: r.job() ?? "",
    who: r.who() ?? "",
    step: num(r.step()),
    phase: r.phase() ?? "",
    phaseMs: r.phaseMs(),
    stepMs: r.stepMs(),
    host: r.host() ?? "",
  }));
}

// ---- reconnected ----------------------------------------------------------------------------

export interface Reconnected {
  /** the process's connection name */
  who: string;
  /** the subjects it answers requests on (NATS wildcards) */
  subjects: string[];
}

const reconnectedRoot = root("Reconnected", "MTRC", (bb) => ReconnectedT.getRootAsReconnected(bb));

export function encodeReconnected(m: Reconnected): Uint8Array {
  const b = builder(64 + m.who.length * 3 + m.subjects.reduce((n, x) => n + 8 + x.length * 3, 0));
  const who = str(b, m.who);
  const subjects = ReconnectedT.createSubjectsVector(
    b,
    m.subjects.map((x) => str(b, x)),
  );
  return finishBytes(b, ReconnectedT.createReconnected(b, schemaVersion, who, subjects), reconnectedRoot.identifier);
}

export function decodeReconnected(data: Uint8Array, bytesMax: number): Reconnected {
  const r = openRoot(data, reconnectedRoot, bytesMax);
  return guarded("Reconnected", () => ({
    who: r.who() ?? "",
    subjects: Array.from({ length: r.subjectsLength() }, (_, i) => r.subjects(i) ?? ""),
  }));
}

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
function createPlan(b: Builder, m: DataPlan): number {
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

function planOf(r: DataPlanT): DataPlan {
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
  return finishBytes(b, createPlan(b, m), dataPlanRoot.identifier);
}

export function decodeDataPlan(data: Uint8Array, bytesMax: number): DataPlan {
  const r = openRoot(data, dataPlanRoot, bytesMax);
  return guarded("DataPlan", () => planOf(r));
}

// ---- job record ----------------------------------------------------------------------------

export interface JobRecord {
  job: string;
  state: JobState;
  configJson: string;
  submittedMs: number;
  /** 0 while running */
  endedMs: number;
  /** 0 until the data-loader has planned the job */
  totalSteps: number;
  /** the newest evaluation over every rank (accuracy -1: none yet) */
  evalStep: number;
  accuracy: number;
  loss: number;
  evaluated: number;
  evalSplit: string;
  reason: string;
  snapshot: string;
  modelPath: string;
  snapshotDir: string;
  attempts: number;
}

const jobRecordRoot = root("JobRecord", "MTJB", (bb) => JobRecordT.getRootAsJobRecord(bb));

export function encodeJobRecord(m: JobRecord): Uint8Array {
  const texts = [m.job, m.configJson, m.evalSplit, m.reason, m.snapshot, m.modelPath, m.snapshotDir];
  const b = builder(512 + texts.reduce((s, t) => s + t.length * 3, 0));
  const [job, config, split, reason, snapshot, modelPath, snapshotDir] = texts.map((t) => str(b, t)) as [
    number,
    number,
    number,
    number,
    number,
    number,
    number,
  ];
  return finishBytes(
    b,
    JobRecordT.createJobRecord(
      b,
      schemaVersion,
      job,
      m.state,
      config,
      m.submittedMs,
      m.endedMs,
      big(m.totalSteps),
      big(m.evalStep),
      m.accuracy,
      m.loss,
      m.evaluated,
      split,
      reason,
      snapshot,
      modelPath,
      snapshotDir,
      m.attempts,
    ),
    jobRecordRoot.identifier,
  );
}

export function decodeJobRecord(data: Uint8Array, bytesMax: number): JobRecord {
  const r = openRoot(data, jobRecordRoot, bytesMax);
  const m = guarded("JobRecord", () => ({
    job: r.job() ?? "",
    state: r.state(),
    configJson: r.configJson() ?? "",
    submittedMs: r.submittedMs(),
    endedMs: r.endedMs(),
    totalSteps: num(r.totalSteps()),
    evalStep: num(r.evalStep()),
    accuracy: r.accuracy(),
    loss: r.loss(),
    evaluated: r.evaluated(),
    evalSplit: r.evalSplit() ?? "",
    reason: r.reason() ?? "",
    snapshot: r.snapshot() ?? "",
    modelPath: r.modelPath() ?? "",
    snapshotDir: r.snapshotDir() ?? "",
    attempts: r.attempts(),
  }));
  if (JobState[m.state] === undefined) throw new WireFormatError("malformed", `JobRecord: unknown state ${m.state}`);
  return m;
}

// ---- collective pieces ---------------------------------------------------------------------

export interface CollPiece {
  job: string;
  generation: number;
  group: string;
  from: number;
  to: number;
  step: number;
  bucket: number;
  phase: CollPhase;
  hop: number;
  piece: number;
  /** element offset in the operation's buffer */
  offset: number;
  count: number;
  /** count f32 values; any byte alignment (added or copied straight from the payload) */
  data: Uint8Array;
  /** Abort: why the sender gave the operation up */
  reason: string;
  /** nonzero: data is empty; the values are in slot shmSlot of the sender's shared-memory file with this nonce */
  shmNonce: number;
  shmSlot: number;
}

const collRoot = root("CollPiece", "MTCP", (bb) => CollPieceT.getRootAsCollPiece(bb));
/** Bytes a piece's message needs besides its data. */
export const collPieceOverheadBytes = 512;

/**
 * `values` are written straight into the message (one copy); with `shm` they are in a shared
 * memory slot, and the message carries their count and the slot instead.
 */
export function encodeCollPiece(
  m: Omit<CollPiece, "data" | "count" | "shmNonce" | "shmSlot">,
  values: Float32Array,
  shm?: { nonce: number; slot: number },
): Uint8Array {
  const inline = shm === undefined ? values : new Float32Array(0);
  const b = builder(collPieceOverheadBytes + inline.byteLength + m.reason.length * 3);
  const job = str(b, m.job),
    group = str(b, m.group),
    reason = str(b, m.reason);
  const data = createBytes(b, bytesOf(inline));
  return finishBytes(
    b,
    CollPieceT.createCollPiece(
      b,
      schemaVersion,
      job,
      big(m.generation),
      group,
      m.from,
      m.to,
      big(m.step),
      m.bucket,
      m.phase,
      m.hop,
      m.piece,
      big(m.offset),
      values.length,
      data,
      reason,
      shm?.nonce ?? 0,
      shm?.slot ?? 0,
    ),
    collRoot.identifier,
  );
}

export function decodeCollPiece(data: Uint8Array, bytesMax: number): CollPiece {
  const r = openRoot(data, collRoot, bytesMax, { align: false }); // byte vectors only: no aligned copy
  const m = guarded("CollPiece", () => ({
    job: r.job() ?? "",
    generation: num(r.generation()),
    group: r.group() ?? "",
    from: r.from(),
    to: r.to(),
    step: num(r.step()),
    bucket: r.bucket(),
    phase: r.phase(),
    hop: r.hop(),
    piece: r.piece(),
    offset: num(r.offset()),
    count: r.count(),
    data: r.dataArray() ?? new Uint8Array(0),
    reason: r.reason() ?? "",
    shmNonce: r.shmNonce(),
    shmSlot: r.shmSlot(),
  }));
  if (CollPhase[m.phase] === undefined) throw new WireFormatError("malformed", `CollPiece: unknown phase ${m.phase}`);
  if (m.shmNonce !== 0) {
    if (m.data.byteLength !== 0)
      throw new WireFormatError("malformed", `CollPiece: ${m.data.byteLength} data bytes in a shared-memory piece`);
  } else if (m.data.byteLength !== m.count * 4)
    throw new WireFormatError("malformed", `CollPiece: ${m.data.byteLength} data bytes for ${m.count} float32`);
  return m;
}
