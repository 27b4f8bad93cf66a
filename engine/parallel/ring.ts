// Ring collectives over a PeerTransport (the NATS one on CPUs).
//
// All-reduce of n elements among N ranks is a reduce-scatter and then an all-gather, 2(N-1)
// hops, each moving n/N elements from every rank to the next, so every link carries
// 2(N-1)/N·n elements, which is the least any all-reduce can move. The buffer is cut into N
// segments and each segment into pieces of at most pieceBytesMax; pieces travel independently,
// so a piece goes on to the next hop as soon as it has been added in, and every link is busy
// while the first pieces are still on their way round.
//
// Schedule of the rank at ring position p (segments numbered mod N):
//   reduce-scatter hop h = 0..N-2: send segment p-h-1, receive segment p-h-2 and add it in;
//     the segment received at hop h is the one sent at hop h+1; at hop N-2 it is segment p,
//     now summed over every rank (so rank p owns segment p, as reduceScatter promises)
//   all-gather hop h = 0..N-2: send segment p-h, receive segment p-h-1 and copy it; the
//     segment received at hop h is sent at hop h+1.
// Segment s is summed in the order s+1, s+2, ..., s (ring order, fixed), by rank s alone, and
// then copied: every rank ends bit-identical.
//
// A piece is named by (group, step, bucket, phase, hop, piece): a duplicate (a retry whose ack
// was lost) is acknowledged and dropped. Pieces of an operation this rank has not started yet
// are held (up to earlyBytesMax, then the sender is told to retry). An operation that makes no
// progress for progressTimeoutMs fails with a typed error, and a rank whose operation fails
// tells the others, who fail theirs at once instead of waiting out the timeout.
import { hostKernels } from "../../ffi/cpu/host.ts";
import {
  BadPieceError,
  checkKey,
  type Collective,
  CollectiveAbortedError,
  CollectiveClosedError,
  CollectiveError,
  CollectiveTimeoutError,
  type OpKey,
  type Range,
  type ReduceOp,
  segment,
  type WireCoder,
} from "./collective.ts";
import {
  MemoryTransport,
  type PeerTransport,
  type Phase,
  type Piece,
  type PieceHeader,
  type Receipt,
} from "./transport.ts";

export interface RingOptions {
  /** an operation that neither receives nor delivers a piece for this long fails */
  progressTimeoutMs: number;
  /** bytes of pieces held for operations this rank has not started yet */
  earlyBytesMax: number;
  /** dst += src (f32, src at any alignment); the native kernel unless a test passes another */
  add?: (dst: Float32Array, src: Uint8Array) => void;
}

export const ringDefaults: RingOptions = {
  // a healthy hop of a 64 MB bucket takes well under a second on loopback; a peer that sends
  // nothing for 30 s is gone or stuck
  progressTimeoutMs: 30_000,
  // two 25 MB buckets of a peer that runs one step ahead
  earlyBytesMax: 64 << 20,
};

/** Finished operations remembered, so a late duplicate is recognized rather than held as early. */
const finishedOpsMax = 4096;
/** Held bytes counted per early piece besides its data (the header object). */
const earlyPieceOverheadBytes = 256;

const opId = (group: string, step: number, bucket: number) => `${group}|${step}|${bucket}`;

/** Routes received pieces to the operation they name. One per transport; shared by its rings. */
export class PieceRouter {
  readonly #ops = new Map<string, RingOp>();
  readonly #early = new Map<string, Piece[]>();
  #earlyBytes = 0;
  readonly #finished = new Set<string>();

  constructor(readonly earlyBytesMax: number) {}

  receive(p: Piece): Receipt {
    const id = opId(p.group, p.step, p.bucket);
    const op = this.#ops.get(id);
    if (op) return op.take(p);
    if (this.#finished.has(id)) return { kind: "duplicate" };
    const bytes = p.data.byteLength + earlyPieceOverheadBytes;
    if (this.#earlyBytes + bytes > this.earlyBytesMax) {
      return {
        kind: "busy",
        why: `rank ${p.to} holds ${this.#earlyBytes} bytes of pieces for operations it has not started`,
      };
    }
    this.#earlyBytes += bytes;
    const held = this.#early.get(id) ?? [];
    held.push({ ...p, data: p.data.slice() }); // the payload is only valid during the call
    this.#early.set(id, held);
    return { kind: "taken" };
  }

  /** Starts routing to `op`. */
  open(op: RingOp): void {
    if (this.#ops.has(op.id))
      throw new Error(`collective ${op.id} is already running: every operation needs its own key`);
    this.#finished.delete(op.id);
    this.#ops.set(op.id, op);
  }

  /**
   * Hands `op` the pieces that came before it started. Called once the op has sent its first
   * pieces: handed over earlier, they could complete its receipts while nothing is in flight yet,
   * and it would end without sending.
   */
  replayEarly(op: RingOp): void {
    const held = this.#early.get(op.id) ?? [];
    this.#early.delete(op.id);
    for (const p of held) {
      this.#earlyBytes -= p.data.byteLength + earlyPieceOverheadBytes;
      op.take(p);
    }
  }

  finish(id: string): void {
    this.#ops.delete(id);
    this.#finished.add(id);
    if (this.#finished.size > finishedOpsMax) this.#finished.delete(this.#finished.values().next().value!);
  }

  /** Fails every running operation (the collective is closing). */
  failAll(e: Error): void {
    for (const op of [...this.#ops.values()]) op.fail(e, true);
    this.#early.clear();
    this.#earlyBytes = 0;
  }

  get earlyBytes(): number {
    return this.#earlyBytes;
  }
}

/** One running operation: its receipts, its sends in flight, its deadline. */
class RingOp {
  readonly #seen = new Set<string>();
  #receivesLeft: number;
  #sendsInFlight = 0;
  #progressAt = performance.now();
  #settled = false;
  readonly #done = Promise.withResolvers<void>();
  readonly #stop = new AbortController();
  readonly #timer: ReturnType<typeof setInterval>;

  readonly id: string;

  constructor(
    readonly group: string,
    readonly key: OpKey,
    readonly what: string,
    receives: number,
    readonly ring: RingGroup,
    readonly handle: (p: Piece) => void,
    timeoutMs: number,
  ) {
    this.id = opId(group, key.step, key.bucket);
    this.#receivesLeft = receives;
    // an operation whose step is abandoned (a restore) fails with nobody awaiting it: not an
    // unhandled rejection, which would end the process; whoever awaits `done` still sees it
    this.#done.promise.catch(() => {});
    this.#timer = setInterval(
      () => {
        const idleMs = performance.now() - this.#progressAt;
        if (idleMs > timeoutMs) {
          this.fail(
            new CollectiveTimeoutError(
              `${what}: no progress for ${Math.round(idleMs)} ms (${this.#receivesLeft} pieces still to receive from rank ${ring.upstream}, ` +
                `${this.#sendsInFlight} sends to rank ${ring.downstream} not taken); ` +
                (this.#receivesLeft > 0
                  ? `waiting for rank ${ring.upstream}, or a rank before it in the ring, gone or stuck`
                  : `rank ${ring.downstream} is gone or stuck`),
            ),
            true,
          );
        }
      },
      Math.max(10, Math.min(1000, timeoutMs / 4)),
    );
  }

  get done(): Promise<void> {
    return this.#done.promise;
  }

  take(p: Piece): Receipt {
    if (this.#settled) return { kind: "duplicate" };
    if (p.phase === "abort") {
      this.fail(new CollectiveAbortedError(p.from, p.reason), false);
      return { kind: "taken" };
    }
    const key = `${p.phase}/${p.hop}/${p.piece}`;
    if (this.#seen.has(key)) return { kind: "duplicate" };
    try {
      this.handle(p);
    } catch (e) {
      if (e instanceof BadPieceError) return { kind: "bad", why: `${this.what}: ${e.message}` };
      throw e;
    }
    this.#seen.add(key);
    this.#receivesLeft--;
    this.#progressAt = performance.now();
    this.#maybeDone();
    return { kind: "taken" };
  }

  send(header: PieceHeader, values: Float32Array): void {
    if (this.#settled) return;
    this.#sendsInFlight++;
    this.ring.transport.send(header, values, this.#stop.signal).then(
      () => {
        this.#sendsInFlight--;
        this.#progressAt = performance.now();
        this.#maybeDone();
      },
      (e: unknown) => this.fail(e instanceof Error ? e : new CollectiveError(String(e)), true),
    );
  }

  /** `tell`: this rank's own failure, which the other ranks hear of (not an abort they sent). */
  fail(e: Error, tell: boolean): void {
    if (this.#settled) return;
    this.#settle();
    this.#stop.abort(e);
    if (tell) this.ring.tellAbort(this.group, this.key, e.message);
    this.#done.reject(e);
  }

  /** Stops the deadline of an operation that never started (its key was in use). */
  dispose(): void {
    this.#settled = true;
    clearInterval(this.#timer);
  }

  #maybeDone(): void {
    if (this.#receivesLeft > 0 || this.#sendsInFlight > 0 || this.#settled) return;
    this.#settle();
    this.#done.resolve();
  }

  #settle(): void {
    this.#settled = true;
    clearInterval(this.#timer);
    this.ring.router.finish(this.id);
  }
}

const mod = (x: number, n: number) => ((x % n) + n) % n;

/** One ring: an ordered list of global ranks, named on the wire by `name`. */
export class RingGroup {
  readonly pos: number;
  readonly pieceElems: number;
  readonly #add: (dst: Float32Array, src: Uint8Array) => void;
  /** the segment each ring position owns: its rank's place among the ring's ranks in rank order,
   *  so in the ring of every rank, rank r owns segment r whatever the ring's order */
  readonly #segOf: readonly number[];

  constructor(
    readonly name: string,
    readonly ranks: readonly number[],
    readonly transport: PeerTransport,
    readonly router: PieceRouter,
    readonly options: RingOptions,
  ) {
    this.pos = ranks.indexOf(transport.rank);
    if (this.pos < 0) throw new RangeError(`rank ${transport.rank} is not in ring "${name}" (${ranks.join(",")})`);
    if (new Set(ranks).size !== ranks.length)
      throw new RangeError(`ring "${name}" lists a rank twice (${ranks.join(",")})`);
    this.pieceElems = Math.floor(transport.pieceBytesMax / 4);
    if (this.pieceElems < 1) throw new RangeError(`pieceBytesMax ${transport.pieceBytesMax} holds no float32`);
    this.#add = options.add ?? hostKernels().addInto;
    const sorted = [...ranks].sort((a, b) => a - b);
    this.#segOf = ranks.map((r) => sorted.indexOf(r));
  }

  /** The segment this rank's reduce-scatter leaves summed (its rank's place in rank order). */
  get ownSegment(): number {
    return this.#segOf[this.pos]!;
  }

  /** The rank this one receives ring pieces from. */
  get upstream(): number {
    return this.ranks[mod(this.pos - 1, this.ranks.length)]!;
  }

  /** The rank this one sends ring pieces to. */
  get downstream(): number {
    return this.ranks[mod(this.pos + 1, this.ranks.length)]!;
  }

  /** The buffer's segments by ring position, cut into pieces. */
  #segments(n: number): Range[][] {
    return this.#segOf.map((i) => this.#pieces(segment(n, this.size, i)));
  }

  get size(): number {
    return this.ranks.length;
  }

  /** Tells every other rank of the ring that this rank gave the operation up. */
  tellAbort(group: string, key: OpKey, reason: string): void {
    for (const to of this.ranks) {
      if (to === this.transport.rank) continue;
      this.transport.abort(
        {
          group,
          from: this.transport.rank,
          to,
          step: key.step,
          bucket: key.bucket,
          phase: "abort",
          hop: 0,
          piece: 0,
          offset: 0,
          count: 0,
        },
        reason,
      );
    }
  }

  /** Pieces of a range: [offset, count) cut into pieceElems. */
  #pieces(r: Range): Range[] {
    const out: Range[] = [];
    for (let o = 0; o < r.count; o += this.pieceElems)
      out.push({ offset: r.offset + o, count: Math.min(this.pieceElems, r.count - o) });
    return out;
  }

  #run(
    kind: string,
    key: OpKey,
    receives: number,
    handle: (op: RingOp, p: Piece) => void,
    start: (op: RingOp) => void,
  ): Promise<void> {
    checkKey(key);
    const group = `${this.name}#${kind}`;
    const what = `${kind} of step ${key.step} bucket ${key.bucket} in ring "${this.name || "all"}" at rank ${this.transport.rank}`;
    const op: RingOp = new RingOp(
      group,
      key,
      what,
      receives,
      this,
      (p) => handle(op, p),
      this.options.progressTimeoutMs,
    );
    try {
      this.router.open(op);
    } catch (e) {
      op.dispose();
      throw e;
    }
    start(op);
    this.router.replayEarly(op);
    return op.done;
  }

  #header(kind: string, key: OpKey, to: number, phase: Phase, hop: number, piece: number, r: Range): PieceHeader {
    return {
      group: `${this.name}#${kind}`,
      from: this.transport.rank,
      to,
      step: key.step,
      bucket: key.bucket,
      phase,
      hop,
      piece,
      offset: r.offset,
      count: r.count,
    };
  }

  /** Checks a received piece against the one expected; returns the expected range. */
  #expect(p: Piece, from: number, phase: Phase, hopMax: number, pieces: Range[]): Range {
    if (p.from !== from)
      throw new BadPieceError(
        `${p.phase} piece from rank ${p.from}; this rank hears ${phase} pieces from rank ${from}`,
      );
    if (p.phase !== phase) throw new BadPieceError(`unexpected phase ${p.phase}`);
    if (!(p.hop <= hopMax)) throw new BadPieceError(`hop ${p.hop} beyond the last (${hopMax})`);
    const r = pieces[p.piece];
    if (r === undefined) throw new BadPieceError(`piece ${p.piece} of ${pieces.length}`);
    if (p.offset !== r.offset || p.count !== r.count) {
      throw new BadPieceError(
        `piece ${p.piece} covers [${p.offset}, +${p.count}), expected [${r.offset}, +${r.count})`,
      );
    }
    return r;
  }

  /**
   * Reduce-scatter and/or all-gather over buf (see the schedule at the top). `rs` alone leaves
   * segment pos summed; `ag` alone spreads every rank's own segment; both: all-reduce.
   */
  ring(buf: Float32Array, key: OpKey, kind: string, rs: boolean, ag: boolean): Promise<void> {
    const N = this.size,
      p = this.pos;
    if (N === 1 || buf.length === 0) return Promise.resolve();
    const segs = this.#segments(buf.length);
    const next = this.ranks[mod(p + 1, N)]!,
      prev = this.ranks[mod(p - 1, N)]!;
    let receives = 0;
    for (let h = 0; h <= N - 2; h++)
      receives += (rs ? segs[mod(p - h - 2, N)]!.length : 0) + (ag ? segs[mod(p - h - 1, N)]!.length : 0);
    const send = (op: RingOp, phase: Phase, hop: number, s: number, j: number) => {
      const r = segs[s]![j]!;
      op.send(this.#header(kind, key, next, phase, hop, j, r), buf.subarray(r.offset, r.offset + r.count));
    };
    return this.#run(
      kind,
      key,
      receives,
      (op, piece) => {
        if (piece.phase === "reduce-scatter") {
          if (!rs) throw new BadPieceError("a reduce-scatter piece in an all-gather");
          const s = mod(p - piece.hop - 2, N);
          const r = this.#expect(piece, prev, "reduce-scatter", N - 2, segs[s]!);
          this.#add(buf.subarray(r.offset, r.offset + r.count), piece.data);
          if (piece.hop < N - 2) send(op, "reduce-scatter", piece.hop + 1, s, piece.piece);
          else if (ag) send(op, "all-gather", 0, s, piece.piece); // s === p: summed over every rank
        } else {
          if (!ag) throw new BadPieceError(`a ${piece.phase} piece in a reduce-scatter`);
          const s = mod(p - piece.hop - 1, N);
          const r = this.#expect(piece, prev, "all-gather", N - 2, segs[s]!);
          copyInto(buf.subarray(r.offset, r.offset + r.count), piece.data);
          if (piece.hop < N - 2) send(op, "all-gather", piece.hop + 1, s, piece.piece);
        }
      },
      (op) => {
        const first = rs ? mod(p - 1, N) : p;
        segs[first]!.forEach((_, j) => send(op, rs ? "reduce-scatter" : "all-gather", 0, first, j));
      },
    );
  }

  /**
   * All-reduce with every piece encoded by `coder` (the schedule of ring(), on encodings): at a
   * reduce-scatter hop a rank decodes the partial sum it received, adds its own values, and
   * encodes the new partial sum (its error feedback keeps the rounding); the owner of a segment
   * adds its values to the last partial sum, encodes the whole sum once, and takes its decoding
   * as the result; the all-gather copies that encoding round the ring. Each of a rank's values is
   * encoded once per operation, each link carries 2(N-1)/N of the encoded bytes, and every rank
   * decodes the same bytes to the same sum. On the wire a piece's count is the 4-byte words of
   * its encoding.
   */
  encodedRing(buf: Float32Array, key: OpKey, coder: WireCoder, kind = "encoded-all-reduce"): Promise<void> {
    const N = this.size,
      p = this.pos;
    if (buf.length === 0) return Promise.resolve();
    const { segs, wire, at, words } = this.#encodedLayout(buf.length, coder);
    const scratch = coder.scratch(2 * words);
    const slot = (half: 0 | 1, s: number, j: number) =>
      new Uint8Array(scratch.buffer, scratch.byteOffset + (half * words + at[s]![j]!) * 4, wire[s]![j]!.count * 4);
    const values = (s: number, j: number) => {
      const r = segs[s]![j]!;
      return buf.subarray(r.offset, r.offset + r.count);
    };
    const decode = (from: Uint8Array, s: number, j: number, add: boolean) => {
      try {
        coder.decode(from, values(s, j), add);
      } catch (e) {
        throw new BadPieceError(`piece ${j} of segment ${s} does not decode: ${(e as Error).message}`, { cause: e });
      }
    };
    // the owner's sum of segment s, piece j, encoded once; its decoding (what encode leaves in
    // the values) is the result everywhere
    const own = (s: number, j: number) => {
      const out = slot(1, s, j);
      coder.encode(values(s, j), out, segs[s]![j]!.offset);
      return out;
    };
    if (N === 1) {
      segs[0]!.forEach((_, j) => own(0, j));
      return Promise.resolve();
    }
    const next = this.ranks[mod(p + 1, N)]!,
      prev = this.ranks[mod(p - 1, N)]!;
    let receives = 0;
    for (let h = 0; h <= N - 2; h++) receives += segs[mod(p - h - 2, N)]!.length + segs[mod(p - h - 1, N)]!.length;
    const send = (op: RingOp, phase: Phase, hop: number, s: number, j: number, data: Uint8Array) =>
      op.send(
        this.#header(kind, key, next, phase, hop, j, wire[s]![j]!),
        new Float32Array(data.buffer, data.byteOffset, data.byteLength / 4),
      );
    return this.#run(
      kind,
      key,
      receives,
      (op, piece) => {
        const rs = piece.phase === "reduce-scatter";
        const s = mod(p - piece.hop - (rs ? 2 : 1), N);
        this.#expect(piece, prev, rs ? "reduce-scatter" : "all-gather", N - 2, wire[s]!);
        const j = piece.piece;
        // the received bytes are valid during the call only, and at any alignment
        const into = slot(rs ? 0 : 1, s, j);
        into.set(piece.data);
        decode(into, s, j, rs);
        if (!rs) {
          if (piece.hop < N - 2) send(op, "all-gather", piece.hop + 1, s, j, into);
        } else if (piece.hop < N - 2) {
          coder.encode(values(s, j), into, segs[s]![j]!.offset);
          send(op, "reduce-scatter", piece.hop + 1, s, j, into);
        } else send(op, "all-gather", 0, s, j, own(s, j)); // s === p: summed over every rank
      },
      (op) => {
        const first = mod(p - 1, N);
        segs[first]!.forEach((_, j) => {
          const out = slot(0, first, j);
          coder.encode(values(first, j), out, segs[first]![j]!.offset);
          send(op, "reduce-scatter", 0, first, j, out);
        });
      },
    );
  }

  /** The float32 words of scratch encodedRing takes for n values. */
  encodedWords(n: number, coder: WireCoder): number {
    return n === 0 ? 0 : 2 * this.#encodedLayout(n, coder).words;
  }

  /**
   * n values' pieces (as ring() cuts them) and their encodings: each piece's encoding has a fixed
   * place (`at`, in words) in the reduce-scatter's half of the scratch and in the all-gather's,
   * each `words` long; on the wire a piece's count is its encoding's words.
   */
  #encodedLayout(n: number, coder: WireCoder): { segs: Range[][]; wire: Range[][]; at: number[][]; words: number } {
    const segs = this.#segments(n);
    const wire = segs.map((pieces) => pieces.map((r) => ({ offset: r.offset, count: coder.slotBytes(r.count) / 4 })));
    const at: number[][] = [];
    let words = 0;
    for (const pieces of wire) at.push(pieces.map((w) => ((words += w.count), words - w.count)));
    return { segs, wire, at, words };
  }

  /** The root's buffer to every rank, piece by piece along the ring from the root. */
  broadcast(buf: Float32Array, rootPos: number, key: OpKey, kind = "broadcast"): Promise<void> {
    const N = this.size,
      d = mod(this.pos - rootPos, N);
    if (N === 1 || buf.length === 0) return Promise.resolve();
    const pieces = this.#pieces({ offset: 0, count: buf.length });
    const next = this.ranks[mod(this.pos + 1, N)]!,
      prev = this.ranks[mod(this.pos - 1, N)]!;
    const send = (op: RingOp, j: number) => {
      const r = pieces[j]!;
      op.send(this.#header(kind, key, next, "broadcast", d, j, r), buf.subarray(r.offset, r.offset + r.count));
    };
    return this.#run(
      kind,
      key,
      d === 0 ? 0 : pieces.length,
      (op, piece) => {
        const r = this.#expect(piece, prev, "broadcast", N - 2, pieces);
        if (piece.hop !== d - 1) throw new BadPieceError(`broadcast hop ${piece.hop} at distance ${d} from the root`);
        copyInto(buf.subarray(r.offset, r.offset + r.count), piece.data);
        if (d < N - 1) send(op, piece.piece);
      },
      (op) => {
        if (d === 0) pieces.forEach((_, j) => send(op, j));
      },
    );
  }

  /** Every rank's own segment to the root (which keeps its own): the second half of a reduce. */
  gather(buf: Float32Array, rootPos: number, key: OpKey, kind = "gather"): Promise<void> {
    const N = this.size;
    if (N === 1 || buf.length === 0) return Promise.resolve();
    const segs = this.#segments(buf.length);
    const root = this.ranks[rootPos]!;
    const isRoot = this.pos === rootPos;
    const receives = isRoot ? segs.reduce((s, pieces, i) => s + (i === rootPos ? 0 : pieces.length), 0) : 0;
    // piece numbers run over the segments in order, so one number names one range
    const numbered = segs.flatMap((pieces, i) => pieces.map((r) => ({ seg: i, r })));
    return this.#run(
      kind,
      key,
      receives,
      (_op, piece) => {
        const entry = numbered[piece.piece];
        if (entry === undefined || entry.seg === rootPos)
          throw new BadPieceError(`gather piece ${piece.piece} of ${numbered.length}`);
        const r = this.#expect(
          piece,
          this.ranks[entry.seg]!,
          "gather",
          0,
          numbered.map((e) => e.r),
        );
        copyInto(buf.subarray(r.offset, r.offset + r.count), piece.data);
      },
      (op) => {
        if (isRoot) return;
        numbered.forEach(({ seg, r }, j) => {
          if (seg === this.pos)
            op.send(this.#header(kind, key, root, "gather", 0, j, r), buf.subarray(r.offset, r.offset + r.count));
        });
      },
    );
  }

  /** The sum of every rank's buffer at the root (other ranks' buffers are left as scratch). */
  async reduce(buf: Float32Array, rootPos: number, key: OpKey): Promise<void> {
    await this.ring(buf, key, "reduce", true, false);
    await this.gather(buf, rootPos, key, "reduce-gather");
  }
}

function copyInto(dst: Float32Array, src: Uint8Array): void {
  new Uint8Array(dst.buffer, dst.byteOffset, dst.byteLength).set(src);
}

export function scaleInPlace(buf: Float32Array, s: number): void {
  for (let i = 0; i < buf.length; i++) buf[i]! *= s;
}

/**
 * What the collectives built of ring groups over one transport share: the router their pieces
 * arrive through, the ring of every rank (`everyRank`: all-gather and barrier move no sums, so
 * they take it whatever the topology), and closing once.
 */
export abstract class RingsOverTransport {
  readonly router: PieceRouter;
  #closed = false;

  constructor(
    readonly transport: PeerTransport,
    earlyBytesMax: number,
  ) {
    this.router = new PieceRouter(earlyBytesMax);
    transport.listen((p) => this.router.receive(p));
  }

  /** every rank, in the order pieces travel between them */
  protected abstract get everyRank(): RingGroup;

  get rank(): number {
    return this.transport.rank;
  }
  get size(): number {
    return this.everyRank.size;
  }

  /** Segments by global rank (the ring's order does not change them). */
  allGather(buf: Float32Array, key: OpKey): Promise<void> {
    this.check();
    return this.everyRank.ring(buf, key, "all-gather", false, true);
  }

  barrier(key: OpKey): Promise<void> {
    this.check();
    return this.everyRank.ring(new Float32Array(this.size), key, "barrier", false, true);
  }

  close(reason = "the collective was closed"): void {
    if (this.#closed) return;
    this.#closed = true;
    this.router.failAll(new CollectiveClosedError(reason));
    this.transport.close();
  }

  protected check(): void {
    if (this.#closed) throw new CollectiveClosedError("the collective is closed");
  }
}

/** The ring collective over every rank of a transport's job, in rank order. */
export class RingCollective extends RingsOverTransport implements Collective {
  readonly group: RingGroup;

  constructor(transport: PeerTransport, size: number, options: Partial<RingOptions> = {}) {
    const o = { ...ringDefaults, ...options };
    super(transport, o.earlyBytesMax);
    this.group = new RingGroup(
      "",
      Array.from({ length: size }, (_, i) => i),
      transport,
      this.router,
      o,
    );
  }

  protected get everyRank(): RingGroup {
    return this.group;
  }

  async allReduce(buf: Float32Array, key: OpKey, op: ReduceOp = "sum"): Promise<void> {
    this.check();
    await this.group.ring(buf, key, "all-reduce", true, true);
    if (op === "avg") scaleInPlace(buf, 1 / this.size);
  }

  encodedAllReduce(buf: Float32Array, key: OpKey, coder: WireCoder): Promise<void> {
    this.check();
    return this.group.encodedRing(buf, key, coder);
  }

  async reduceScatter(buf: Float32Array, key: OpKey): Promise<Range> {
    this.check();
    await this.group.ring(buf, key, "reduce-scatter", true, false);
    return segment(buf.length, this.size, this.rank);
  }

  broadcast(buf: Float32Array, root: number, key: OpKey): Promise<void> {
    this.check();
    return this.group.broadcast(buf, root, key);
  }
}

/** `n` ranks of one process joined in a ring over MemoryTransport: data parallelism without a
 *  mesh (the in-process runner, the engine's tests and benches). */
export function inProcessRings(
  n: number,
  options: Partial<RingOptions> = {},
  pieceBytesMax = 1 << 20,
): RingCollective[] {
  const peers = new Map<number, MemoryTransport>();
  return Array.from(
    { length: n },
    (_, r) => new RingCollective(new MemoryTransport(r, peers, pieceBytesMax), n, options),
  );
}
