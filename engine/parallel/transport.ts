// What a ring needs from the wire: deliver one piece to one rank and learn that it was taken,
// and hear the pieces sent to this rank. services/runtime/transport/collective-bus.ts implements it over
// NATS; MemoryTransport below connects ranks inside one process (unit tests).
//
// The transport owns retries and flow control (how many pieces may be in flight to one peer);
// the ring owns the algorithm and the bookkeeping that makes a retried piece harmless.
import { BadPieceError, PeerLostError } from "./collective.ts";

export type Phase = "reduce-scatter" | "all-gather" | "broadcast" | "gather" | "abort";

export interface PieceHeader {
  /** the ring and the operation kind, e.g. "#all-reduce", "host:a#reduce" */
  group: string;
  /** global ranks */
  from: number;
  to: number;
  step: number;
  bucket: number;
  phase: Phase;
  hop: number;
  piece: number;
  /** element range of the data in the operation's buffer */
  offset: number;
  count: number;
}

/** A piece as received: data is count float32 at any byte alignment, valid during the call only. */
export interface Piece extends PieceHeader {
  data: Uint8Array;
  /** abort: why */
  reason: string;
}

/**
 * What the receiver made of a piece. "busy": this rank cannot hold it yet (its early-piece
 * budget is full); the sender retries. "bad": it can never be taken; the sender fails.
 */
export type Receipt =
  | { kind: "taken" }
  | { kind: "duplicate" }
  | { kind: "busy"; why: string }
  | { kind: "bad"; why: string };

export interface PeerTransport {
  /** this process's global rank */
  readonly rank: number;
  /** the largest piece's data, in bytes (a multiple of 4) */
  readonly pieceBytesMax: number;
  /**
   * Delivers a piece; resolves once the peer has taken it. `values` are read when the piece is
   * written to the wire (perhaps after waiting for a slot), and again for a retry; the caller
   * leaves them alone until the promise settles. Rejects with PeerLostError when the peer does
   * not take it in time, BadPieceError when the peer refuses it, or `signal`'s reason.
   */
  send(header: PieceHeader, values: Float32Array, signal: AbortSignal): Promise<void>;
  /** Best effort, no answer: tells `to` that this rank gave the operation up. */
  abort(header: PieceHeader, reason: string): void;
  /** Where pieces addressed to this rank go; the receipt is the sender's answer. */
  listen(receive: (p: Piece) => Receipt): void;
  close(): void;
}

/** Ranks of one process connected in memory: each send is handed straight to the peer's receiver. */
export class MemoryTransport implements PeerTransport {
  #receive: ((p: Piece) => Receipt) | null = null;
  closed = false;
  /** pieces sent, for tests that count traffic */
  sent = 0;

  constructor(
    readonly rank: number,
    readonly peers: Map<number, MemoryTransport>,
    readonly pieceBytesMax: number,
    readonly hooks: { beforeDeliver?: (h: PieceHeader) => "deliver" | "drop" | "twice" } = {},
  ) {
    peers.set(rank, this);
  }

  async send(header: PieceHeader, values: Float32Array, signal: AbortSignal): Promise<void> {
    for (;;) {
      signal.throwIfAborted();
      await new Promise((res) => setImmediate(res)); // deliver on a later turn, as a wire would
      signal.throwIfAborted();
      const peer = this.peers.get(header.to);
      if (!peer || peer.closed || peer.#receive === null) throw new PeerLostError(header.to, "not connected");
      const action = this.hooks.beforeDeliver?.(header) ?? "deliver";
      if (action === "drop") continue; // as if the ack were lost: send again
      const piece = { ...header, data: new Uint8Array(values.slice().buffer), reason: "" };
      this.sent++;
      let r = peer.#receive(piece);
      if (action === "twice") r = peer.#receive({ ...piece, data: piece.data.slice() });
      if (r.kind === "busy") {
        await new Promise((res) => setTimeout(res, 1));
        continue;
      }
      if (r.kind === "bad") throw new BadPieceError(`rank ${header.to} refused the piece: ${r.why}`);
      return;
    }
  }

  abort(header: PieceHeader, reason: string): void {
    const peer = this.peers.get(header.to);
    const receive = peer === undefined ? null : peer.#receive;
    queueMicrotask(() => receive?.({ ...header, phase: "abort", data: new Uint8Array(0), reason }));
  }

  listen(receive: (p: Piece) => Receipt): void {
    this.#receive = receive;
  }

  close(): void {
    this.closed = true;
    this.peers.delete(this.rank);
  }
}
