// The collective layer: what data-parallel training (and later ZeRO, tensor parallelism and
// elastic resizing) asks of a group of ranks, whatever carries the bytes.
//
//   allReduce      every rank ends with the element-wise sum (or mean) of every rank's buffer
//   reduceScatter  rank r ends with the sum of segment r (segments below); the rest is scratch
//   allGather      every rank ends with every rank's segment r as rank r had it
//   broadcast      every rank ends with the root's buffer
//   barrier        returns once every rank of the group has called it
//
// Implementations: RingCollective (engine/parallel/ring.ts), a ring over any PeerTransport
// (NATS, shared memory, in-memory); HierarchicalCollective (engine/parallel/hierarchical.ts),
// rings within and across hosts; NcclCollective (engine/parallel/nccl-collective.ts), NCCL over f32
// device memory on the CUDA backend's stream.
//
// Every rank of a group issues the same operations with the same keys in the same order. A key
// is (step, bucket): it names the operation on the wire, so a retried or duplicated piece is
// taken once, and pieces that arrive before this rank started the operation wait for it.
//
// Results are bit-identical on every rank: each element's sum is computed once, by one rank,
// in the fixed ring order, and then copied.

/** Names one operation among the group's: a training step and a bucket within it. */
export interface OpKey {
  step: number;
  bucket: number;
}

export interface Range {
  offset: number;
  count: number;
}

export type ReduceOp = "sum" | "avg";

/** Ranks exchanging host arrays: a hierarchy's leaders (one rank per host), or every rank. */
export interface HostGroup {
  /** this rank's index in the group, 0..size-1 */
  readonly rank: number;
  readonly size: number;
  /** In place: segment r of every member's buffer is member r's segment r. */
  allGather(buf: Float32Array, key: OpKey): Promise<void>;
}

/**
 * How an encoded all-reduce (encodedAllReduce) cuts its values down on the wire: a codec's slot
 * sizes and its error feedback (engine/parallel/compress.ts, ErrorFeedback.wireCoder). Every range a rank sends, its own
 * values or a partial sum, goes through encode, so what the rounding left out stays in the rank's
 * residual for its next step: nothing is lost, only delayed.
 */
export interface WireCoder {
  /** bytes of the encoding of n values (a multiple of 4) */
  slotBytes(n: number): number;
  /** Encodes x (elements [at, at + x.length) of the buffer) into slot with error feedback: the
   *  residual of that range is added into x first, and what the encoding leaves out replaces it.
   *  x is left holding what slot decodes to. */
  encode(x: Float32Array, slot: Uint8Array, at: number): void;
  /** out = decode(slot) (add: out += it); throws on a slot that does not decode */
  decode(slot: Uint8Array, out: Float32Array, add: boolean): void;
  /** a scratch array of at least `words` float32 the operation encodes into, kept by the caller
   *  (it is read until the operation settles) */
  scratch(words: number): Float32Array;
}

/** Sums `x` over `group` in place, as the caller encodes it (engine/parallel/data-parallel.ts:
 *  a bucket's compression with its error feedback). */
export type GroupSum = (x: Float32Array, group: HostGroup, key: OpKey) => Promise<void>;

export interface Collective<B = Float32Array> {
  /** this rank's index in the group, 0..size-1 */
  readonly rank: number;
  readonly size: number;
  /**
   * `between`: how the sum crosses between hosts where it does not go as f32 (a compressed
   * exchange with error feedback among a hierarchy's leaders). Collectives with no links between
   * hosts of their own ignore it.
   */
  allReduce(buf: B, key: OpKey, op?: ReduceOp, between?: GroupSum): Promise<void>;
  /**
   * The sum over ranks of buf in place, every hop's range encoded by `coder` (a ring whose
   * reduce-scatter re-encodes each partial sum and whose all-gather copies the owner's encoding:
   * 2(N-1)/N of the encoded bytes per link, and the same bits on every rank). Absent: the caller
   * all-gathers every rank's encoding instead.
   */
  encodedAllReduce?(buf: B, key: OpKey, coder: WireCoder): Promise<void>;
  /** In place: returns segment(buf length, size, rank), which then holds the sum over ranks. */
  reduceScatter(buf: B, key: OpKey): Promise<Range>;
  /** In place: segment r of every rank's buffer is rank r's segment r. */
  allGather(buf: B, key: OpKey): Promise<void>;
  broadcast(buf: B, root: number, key: OpKey): Promise<void>;
  barrier(key: OpKey): Promise<void>;
  /** Fails the operations in flight (with `reason`) and releases the transport. */
  close(reason?: string): void;
  /**
   * Collectives over device memory that run on a stream of their own (NCCL beside the compute
   * stream): makes the compute stream wait, on the GPU, for every operation settled so far, and
   * resolves once they have finished (polled: the event loop stays free for an abort, where a
   * synchronize on a stream waiting for a dead peer would block it for good). Await it before
   * compute work or a download reads their results. Absent: nothing to wait for.
   */
  join?(): Promise<void>;
}

/**
 * Segment i of n elements cut among `size` ranks: [floor(i·n/size), floor((i+1)·n/size)). Sizes
 * differ by at most one element; with n < size some segments are empty.
 */
export function segment(n: number, size: number, i: number): Range {
  const offset = Math.floor((i * n) / size);
  return { offset, count: Math.floor(((i + 1) * n) / size) - offset };
}

/**
 * n elements cut among `size` ranks in NCCL's layout: NCCL's reduce-scatter and all-gather cut a
 * buffer into equal blocks, while segment()'s differ by one element. Segment j goes to block j
 * of a padded buffer (block = ceil(n/size) elements; the padding after a shorter segment stays
 * zero), so a ring's segments and NCCL's blocks hold the same elements.
 */
export interface BlockLayout {
  /** elements per block */
  block: number;
  /** elements of the padded buffer: block · size */
  padded: number;
  /** [at, at+count) of the unpadded order in pieces that each lie in one segment, with each
   *  piece's place in the padded buffer */
  spans(at: number, count: number): { at: number; device: number; count: number }[];
}

export function blockLayout(n: number, size: number): BlockLayout {
  const block = Math.ceil(n / size);
  const segments = Array.from({ length: size }, (_, j) => segment(n, size, j));
  return {
    block,
    padded: block * size,
    spans(at, count) {
      if (!(at >= 0 && count >= 0 && at + count <= n))
        throw new RangeError(`elements [${at}, ${at + count}) are outside the ${n} of the layout`);
      const out: { at: number; device: number; count: number }[] = [];
      for (const [j, sg] of segments.entries()) {
        const from = Math.max(at, sg.offset),
          to = Math.min(at + count, sg.offset + sg.count);
        if (to > from) out.push({ at: from, device: j * block + (from - sg.offset), count: to - from });
      }
      return out;
    },
  };
}

// ---- errors ---------------------------------------------------------------------------------

export class CollectiveError extends Error {
  override readonly name: string = "CollectiveError";
}

/** A peer did not take a piece within the time allowed: it died, hung, or left the mesh. */
export class PeerLostError extends CollectiveError {
  override readonly name = "PeerLostError";
  constructor(
    readonly peer: number,
    detail: string,
    options?: ErrorOptions,
  ) {
    super(`rank ${peer} is unreachable: ${detail}`, options);
  }
}

/** An operation made no progress for its timeout (a peer upstream is gone or stuck). */
export class CollectiveTimeoutError extends CollectiveError {
  override readonly name = "CollectiveTimeoutError";
}

/** A peer gave the operation up and said so (its own error is the reason). */
export class CollectiveAbortedError extends CollectiveError {
  override readonly name = "CollectiveAbortedError";
  constructor(
    readonly peer: number,
    readonly reason: string,
  ) {
    super(`rank ${peer} aborted the operation: ${reason}`);
  }
}

/** The library under the collective failed the operation (NCCL: a peer gone, a link down, a
 *  timeout); the communicator is unusable and every rank must rebuild it. */
export class CollectiveTransportError extends CollectiveError {
  override readonly name = "CollectiveTransportError";
}

/** A piece that does not fit the operation it names (a bug or a hostile sender). */
export class BadPieceError extends CollectiveError {
  override readonly name = "BadPieceError";
}

/** The collective was closed (the job stopped) while the operation ran. */
export class CollectiveClosedError extends CollectiveError {
  override readonly name = "CollectiveClosedError";
}

/** Programmer errors in how a collective is called: the same on every rank, asserted. */
export function checkKey(key: OpKey): void {
  if (
    !Number.isSafeInteger(key.step) ||
    key.step < 0 ||
    !Number.isInteger(key.bucket) ||
    key.bucket < 0 ||
    key.bucket > 0xffff_ffff
  ) {
    throw new RangeError(
      `collective key needs a step >= 0 and a bucket in [0, 2^32), got step ${key.step} bucket ${key.bucket}`,
    );
  }
}
