// The parameter server's messages: a trainer's pushes and pulls and their replies
// (mt.<job>.ps.<k>.push/pull.<rank>), the chunks they carry, a shard's stats
// (mt.<job>.ps.<k>.stats), and a shard's state (served on mt.<job>.ps.<k>.state, taken on
// mt.<job>.ps.<k>.load; an all-reduce replica's state travels in the same form). The decoding
// contract is in common.ts.
import type { Builder, ByteBuffer } from "flatbuffers";
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
  Chunk as ChunkT,
  ChunkState as ChunkStateT,
  DType,
  NamedVector as NamedVectorT,
  PullReply as PullReplyT,
  PullRequest as PullRequestT,
  PushReply as PushReplyT,
  PushRequest as PushRequestT,
  ShardState as ShardStateT,
  ShardStats as ShardStatsT,
} from "../wire.ts";
import { big, builder, num, readList, root, str } from "./common.ts";

export { DType };

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
