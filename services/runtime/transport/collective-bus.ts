// The collective's transport over NATS: each trainer rank answers `mt.<job>.coll.<rank>`, and
// a piece is one request whose (empty) reply says the peer took it. Requests, not publishes,
// because core NATS drops what a slow consumer cannot take: the reply is the acknowledgement,
// a missing reply is retried, and the ring's keys make the retry harmless.
//
// Flow control: at most `windowPieces` pieces are in flight to one peer, which keeps every
// link busy (a piece's acknowledgement returns while the next ones travel) and bounds what the
// server buffers for a slow rank. A piece the peer cannot take yet (its early-piece budget is
// full: CapacityError) or that gets no answer (DeadlineError, NoRespondersError while the peer
// restarts) is sent again after a pause, until `peerLostMs` has passed: then PeerLostError.
//
// Every piece is checked on arrival: the job, the communicator's generation, the addressee,
// the sender's rank and the data's length; a piece that fails is answered with an error and
// changes nothing.
//
// With `sharedMemory`, peers on the same machine exchange the values through /dev/shm and the
// request carries only the header (services/runtime/transport/collective-shm.ts); every inline piece's
// answer says which machine answered, so the sender learns which peers share its memory. Those
// requests then go straight to the peer over a Unix socket (services/runtime/transport/direct-link.ts),
// with NATS as the fallback when the socket cannot be reached.
//
// With `netAddress`, a rank also takes pieces over TCP on that address, and an inline piece's
// answer gives the sender the port and a secret of its own (random, per sender, per communicator
// generation; the answer comes over NATS, where only the sender's user may ask on its subject).
// A peer on another machine then sends its pieces, values and all, straight over TCP, one hop
// where NATS takes three: the connection's hello is the sender's rank and its secret, and its
// pieces are checked as if they came on that rank's subject. NATS remains the fallback while the
// connection is being made, and whenever it fails.
import { networkInterfaces } from "node:os";
import { BadPieceError, CollectiveClosedError, PeerLostError } from "../../../engine/parallel/collective.ts";
import type { PeerTransport, Phase, Piece, PieceHeader, Receipt } from "../../../engine/parallel/transport.ts";
import {
  CollPhase,
  collPieceOverheadBytes,
  decodeCollPiece,
  encodeCollPiece,
} from "../../../schemas/messages/trainer.ts";
import type { Bus, Subscription } from "../mesh/bus.ts";
import { ShmInbox, ShmOutbox, shmIdentity, shmRefusedPrefix, shmSocketPath } from "./collective-shm.ts";
import { DirectLinkClient, DirectLinkServer } from "./direct-link.ts";
import { BadRequestError, CapacityError, DeadlineError, NoRespondersError } from "../mesh/errors.ts";
import { subjects } from "../job/subjects.ts";
import { pause } from "../mesh/pause.ts";

export interface BusTransportOptions {
  job: string;
  /** this rank, and how many there are */
  rank: number;
  size: number;
  /** the communicator's generation: bumped whenever the ranks rebuild it (a restore) */
  generation: number;
  /** the largest piece's data; a message is this plus collPieceOverheadBytes */
  pieceBytesMax: number;
  windowPieces: number;
  /** one attempt at delivering a piece */
  sendTimeoutMs: number;
  /** how long a piece is retried before its peer counts as lost */
  peerLostMs: number;
  /** values through shared memory to the peers on this machine (they are found out, not configured) */
  sharedMemory: boolean;
  /** the address this rank takes pieces on over TCP from other machines (a port is picked);
   *  absent or null: its peers send through NATS */
  netAddress?: string | null;
  /** counts the bytes of values this transport delivered (whatever the path), for the wire
   *  statistics; `inlineBytes`, where present, those that went in the message (through NATS, not
   *  shared memory: between hosts) */
  meter?: { bytes: number; inlineBytes?: number };
}

export const busTransportDefaults = {
  // 1 MB pieces: large enough that a message's fixed costs vanish, small enough that a 25 MB
  // bucket among 4 ranks is cut into several pieces per segment, which pipeline
  pieceBytesMax: 1 << 20,
  // 4 MB in flight per link: the acknowledgement round trip is hidden behind 3 more pieces
  windowPieces: 4,
  sendTimeoutMs: 10_000,
  peerLostMs: 30_000,
  sharedMemory: false,
} as const;

const phases: Readonly<Record<Phase, CollPhase>> = {
  "reduce-scatter": CollPhase.ReduceScatter,
  "all-gather": CollPhase.AllGather,
  broadcast: CollPhase.Broadcast,
  gather: CollPhase.Gather,
  abort: CollPhase.Abort,
};
const phaseOf = new Map<CollPhase, Phase>(Object.entries(phases).map(([k, v]) => [v, k as Phase]));
/** longest abort reason sent */
const reasonCharsMax = 500;

class Window {
  inFlight = 0;
  readonly waiters: (() => void)[] = [];
}

/**
 * How pieces go to one peer: not known yet (inline until its first answer), inline, shared
 * memory (headers over a Unix socket), or over TCP (values and all); NATS while a direct
 * connection is not there.
 */
type Link =
  | { kind: "unknown" }
  | { kind: "inline" }
  | { kind: "shm"; out: ShmOutbox; mapped: boolean; direct: DirectLinkClient | null }
  | { kind: "net"; direct: DirectLinkClient | null };

/** An answer's line offering a TCP link: "tcp <host> <port> <secret>". */
const netOffer = /^tcp ([0-9A-Za-z.:%-]{1,64}) (\d{1,5}) ([0-9a-f]{32})$/;

/**
 * The address a rank's TCP links listen on, from its setting: "none" none; "auto" this machine's
 * first IPv4 address that is not loopback (none found: none); else the address given.
 */
export function netAddressOf(setting: string): string | null {
  if (setting === "none") return null;
  if (setting !== "auto") return setting;
  for (const addrs of Object.values(networkInterfaces()))
    for (const a of addrs ?? []) if (a.family === "IPv4" && !a.internal) return a.address;
  return null;
}

const encoder = new TextEncoder();
const decoder = new TextDecoder();

export class BusTransport implements PeerTransport {
  readonly rank: number;
  readonly pieceBytesMax: number;
  readonly #o: BusTransportOptions;
  readonly #windows = new Map<number, Window>();
  readonly #links = new Map<number, Link>();
  readonly #identity: string | null;
  readonly #inbox: ShmInbox | null;
  #sub: Subscription | null = null;
  #server: DirectLinkServer | null = null;
  #net: DirectLinkServer | null = null;
  /** the secret each sender proves itself with on a TCP link to this rank */
  readonly #secrets = new Map<number, string>();
  /** the answer each sender's inline pieces get (made once: it is sent with every one) */
  readonly #answers = new Map<number, Uint8Array>();
  #closed = false;

  constructor(
    readonly bus: Bus,
    options: BusTransportOptions,
  ) {
    this.#o = options;
    this.rank = options.rank;
    if (options.pieceBytesMax % 4 !== 0 || options.pieceBytesMax < 4)
      throw new RangeError(`pieceBytesMax must be a positive multiple of 4, got ${options.pieceBytesMax}`);
    this.pieceBytesMax = options.pieceBytesMax;
    this.#identity = options.sharedMemory ? shmIdentity() : null;
    this.#inbox = this.#identity === null ? null : new ShmInbox(options.job, options.generation, options.rank);
  }

  /** Peers whose pieces go through shared memory. */
  get sharedMemoryPeers(): number[] {
    return [...this.#links].filter(([, l]) => l.kind === "shm").map(([peer]) => peer);
  }

  /** Peers whose pieces go over a TCP link now. */
  get netPeers(): number[] {
    return [...this.#links].filter(([, l]) => l.kind === "net" && l.direct?.open).map(([peer]) => peer);
  }

  /** The TCP port this rank takes pieces on (0: none). */
  get netPort(): number {
    return this.#net?.port ?? 0;
  }

  /** Bytes of the largest message this transport sends or takes. */
  get messageBytesMax(): number {
    return this.pieceBytesMax + collPieceOverheadBytes + reasonCharsMax * 3;
  }

  listen(receive: (p: Piece) => Receipt): void {
    const { job, rank } = this.#o;
    const handler = (data: Uint8Array, subject: string) => {
      // a piece routed here before close (drained, below): its sender retries, and finds the
      // communicator that replaced this one, or is replaced itself
      if (this.#closed)
        throw new CapacityError(
          `rank ${rank}'s communicator generation ${this.#o.generation} is closed (a restore replaces it); retry`,
        );
      const { piece, inline } = this.#check(data, subject);
      const receipt = receive(piece);
      if (receipt.kind === "busy") throw new CapacityError(receipt.why);
      if (receipt.kind === "bad") throw new BadRequestError(receipt.why);
      return inline ? this.#answer(piece.from) : new Uint8Array(0);
    };
    this.#sub = this.bus.handle(subjects.collTo(job, rank), handler);
    if (this.#identity !== null) {
      // a socket on this machine: its peers are this machine's processes (the file is the
      // user's), and a shared-memory piece's values are read from its sender's own segment
      this.#server = DirectLinkServer.unix(
        shmSocketPath(job, this.#o.generation, rank),
        subjects.collTo(job, rank),
        handler,
        this.messageBytesMax,
      );
    }
    const address = this.#o.netAddress ?? null;
    if (address !== null) {
      // the hello: "<rank>:<secret>", the secret this rank gave that sender
      const hello = (bytes: Uint8Array): string | null => {
        const m = /^(\d{1,6}):([0-9a-f]{32})$/.exec(decoder.decode(bytes.subarray(0, 64)));
        const from = Number(m?.[1]);
        return m !== null && this.#secrets.get(from) === m[2] ? subjects.coll(job, rank, from) : null;
      };
      this.#net = DirectLinkServer.tcp(address, hello, handler, this.messageBytesMax);
    }
  }

  /**
   * An inline piece's answer: this machine's identity (shared memory), and the TCP link `from`
   * may use, with its secret, one line each.
   */
  #answer(from: number): Uint8Array {
    const made = this.#answers.get(from);
    if (made !== undefined) return made;
    const lines: string[] = [];
    if (this.#identity !== null) lines.push(this.#identity);
    const net = this.#net;
    if (net !== null) {
      const secret = Buffer.from(crypto.getRandomValues(new Uint8Array(16))).toString("hex");
      this.#secrets.set(from, secret);
      lines.push(`tcp ${this.#o.netAddress} ${net.port} ${secret}`);
    }
    const answer = encoder.encode(lines.join("\n"));
    this.#answers.set(from, answer);
    return answer;
  }

  #check(data: Uint8Array, subject: string): { piece: Piece; inline: boolean } {
    const { job, generation, rank, size } = this.#o;
    const m = decodeCollPiece(data, this.messageBytesMax);
    // over NATS the sender is the subject's last token, which only its trainer's user may publish
    const sender = subject.slice(subject.lastIndexOf(".") + 1);
    if (sender !== "*" && sender !== String(m.from))
      throw new BadRequestError(
        `piece says it is from rank ${m.from}, but came on the subject of rank ${JSON.stringify(sender.slice(0, 32))}`,
      );
    if (m.job !== job) throw new BadRequestError(`piece for job "${m.job}" sent to job "${job}"`);
    // a newer generation's piece comes from a rank that took a restore this one is about to
    // take: the sender retries until it has; an older one's is from before the restore
    if (m.generation > generation)
      throw new CapacityError(
        `rank ${rank} still runs communicator generation ${generation}, the piece is of ${m.generation}`,
      );
    if (m.generation !== generation)
      throw new BadRequestError(
        `piece of communicator generation ${m.generation}; rank ${rank} runs generation ${generation}`,
      );
    if (m.to !== rank) throw new BadRequestError(`piece for rank ${m.to} sent to rank ${rank}`);
    if (!(m.from < size) || m.from === rank)
      throw new BadRequestError(`piece from rank ${m.from}, not a peer of rank ${rank} among ${size}`);
    if (m.data.byteLength > this.pieceBytesMax)
      throw new BadRequestError(`piece of ${m.data.byteLength} bytes exceeds ${this.pieceBytesMax}`);
    if (m.shmNonce === 0) return { piece: { ...m, phase: phaseOf.get(m.phase)! }, inline: true };
    if (this.#inbox === null) throw new BadRequestError(`${shmRefusedPrefix}rank ${rank} takes its pieces inline`);
    if (m.count * 4 > this.pieceBytesMax)
      throw new BadRequestError(`piece of ${m.count * 4} bytes exceeds ${this.pieceBytesMax}`);
    let values: Uint8Array;
    try {
      values = this.#inbox.read(m.from, m.shmNonce, m.shmSlot, m.count);
    } catch (e) {
      throw new BadRequestError((e as Error).message);
    }
    return { piece: { ...m, data: values, phase: phaseOf.get(m.phase)! }, inline: false };
  }

  async send(header: PieceHeader, values: Float32Array, signal: AbortSignal): Promise<void> {
    if (values.byteLength > this.pieceBytesMax)
      throw new RangeError(`piece of ${values.byteLength} bytes exceeds ${this.pieceBytesMax}`);
    await this.#acquire(header.to, signal);
    try {
      const inline = await this.#deliver(header, values, signal);
      const meter = this.#o.meter;
      if (meter) {
        meter.bytes += values.byteLength;
        if (inline && meter.inlineBytes !== undefined) meter.inlineBytes += values.byteLength;
      }
    } finally {
      this.#release(header.to);
    }
  }

  #link(peer: number): Link {
    const l = this.#links.get(peer);
    if (l !== undefined) return l;
    // a peer's first answer says whether it shares this machine's memory or offers a TCP link
    const fresh: Link = { kind: this.#identity === null && this.#o.netAddress == null ? "inline" : "unknown" };
    this.#links.set(peer, fresh);
    return fresh;
  }

  /**
   * After an inline piece's answer: a peer that answered from this machine gets shared memory, one
   * that offers a TCP link gets its pieces over it (once connected), any other stays inline.
   */
  #learn(peer: number, answer: Uint8Array): void {
    if (this.#link(peer).kind !== "unknown") return;
    const { job, generation, rank, windowPieces } = this.#o;
    const lines = answer.byteLength > 0 && answer.byteLength < 1024 ? decoder.decode(answer).split("\n") : [];
    const out =
      this.#identity !== null && lines.includes(this.#identity)
        ? ShmOutbox.create(job, generation, rank, peer, windowPieces, this.pieceBytesMax)
        : null;
    const offer = out === null ? lines.map((l) => netOffer.exec(l)).find((m) => m != null) : undefined;
    if (out === null && offer != null && this.#o.netAddress != null) {
      const [, host, port, secret] = offer;
      const link: Link = { kind: "net", direct: null };
      this.#links.set(peer, link);
      void DirectLinkClient.tcp(
        host!,
        Number(port),
        encoder.encode(`${rank}:${secret}`),
        this.messageBytesMax,
        this.#o.sendTimeoutMs,
      ).then((c) => {
        if (this.#closed || this.#links.get(peer) !== link) c?.close();
        else link.direct = c;
      });
      return;
    }
    if (out === null) {
      this.#links.set(peer, { kind: "inline" });
      return;
    }
    const link: Link = { kind: "shm", out, mapped: false, direct: null };
    this.#links.set(peer, link);
    void DirectLinkClient.unix(shmSocketPath(job, generation, peer), this.messageBytesMax).then((c) => {
      if (this.#closed || this.#links.get(peer) !== link) c?.close();
      else link.direct = c;
    });
  }

  /** Resolves once the peer took the piece: true if its values went in the message (inline). */
  async #deliver(header: PieceHeader, values: Float32Array, signal: AbortSignal): Promise<boolean> {
    const { job, generation, sendTimeoutMs, peerLostMs } = this.#o;
    const subject = subjects.coll(job, header.to, this.rank);
    const started = performance.now();
    // the window bounds a peer's pieces in flight by its slots, so a slot is free
    let link = this.#link(header.to);
    let slot = link.kind === "shm" && values.length > 0 ? link.out.take() : null;
    try {
      for (let attempt = 1; ; attempt++) {
        signal.throwIfAborted();
        if (this.#closed) throw new CollectiveClosedError("the transport is closed");
        const m = { ...header, job, generation, phase: phases[header.phase], reason: "" };
        let msg: Uint8Array;
        if (link.kind === "shm" && slot !== null) {
          link.out.write(slot, values); // again for a retry, as the interface says
          msg = encodeCollPiece(m, values, { nonce: link.out.nonce, slot });
        } else msg = encodeCollPiece(m, values);
        try {
          // an attempt never outlasts the piece's budget: a peer that died holding the request
          // is declared lost on time
          const leftMs = peerLostMs - (performance.now() - started);
          const attemptMs = Math.max(100, Math.min(sendTimeoutMs, leftMs));
          const direct = (link.kind === "shm" || link.kind === "net") && link.direct?.open ? link.direct : null;
          const answer =
            direct !== null ? await direct.request(msg, attemptMs) : await this.bus.request(subject, msg, attemptMs);
          if (link.kind === "shm" && slot !== null && !link.mapped) {
            link.mapped = true;
            link.out.unlink();
          }
          if (slot === null) this.#learn(header.to, answer);
          return slot === null;
        } catch (e) {
          if (
            e instanceof BadRequestError &&
            slot !== null &&
            link.kind === "shm" &&
            e.message.includes(shmRefusedPrefix)
          ) {
            // the peer cannot read this machine's shared memory after all: inline from now on
            link.out.release(slot);
            link.out.unlink();
            link.direct?.close();
            slot = null;
            this.#links.set(header.to, (link = { kind: "inline" }));
            attempt = 0;
            continue;
          }
          if (e instanceof BadRequestError)
            throw new BadPieceError(`rank ${header.to} refused a piece: ${e.message}`, { cause: e });
          const retry = e instanceof CapacityError || e instanceof DeadlineError || e instanceof NoRespondersError;
          const elapsedMs = performance.now() - started;
          if (!retry) throw e;
          if (elapsedMs > peerLostMs)
            throw new PeerLostError(
              header.to,
              `${attempt} attempts over ${Math.round(elapsedMs)} ms: ${(e as Error).message}`,
              { cause: e },
            );
          // a busy peer frees room as its operation starts; an absent one may be restarting
          await pause(Math.min(2 ** attempt, e instanceof CapacityError ? 50 : 500), signal);
        }
      }
    } finally {
      if (slot !== null && link.kind === "shm") link.out.release(slot);
    }
  }

  abort(header: PieceHeader, reason: string): void {
    if (this.#closed) return;
    const { job, generation } = this.#o;
    const msg = encodeCollPiece(
      {
        ...header,
        job,
        generation,
        phase: CollPhase.Abort,
        reason: reason.replace(/[\r\n]+/g, " ").slice(0, reasonCharsMax),
      },
      new Float32Array(0),
    );
    this.bus.publish(subjects.coll(job, header.to, this.rank), msg);
  }

  async #acquire(to: number, signal: AbortSignal): Promise<void> {
    let w = this.#windows.get(to);
    if (w === undefined) this.#windows.set(to, (w = new Window()));
    while (w.inFlight >= this.#o.windowPieces) {
      signal.throwIfAborted();
      const { promise, resolve } = Promise.withResolvers<void>();
      w.waiters.push(resolve);
      const onAbort = () => resolve();
      signal.addEventListener("abort", onAbort, { once: true });
      await promise;
      signal.removeEventListener("abort", onAbort);
    }
    signal.throwIfAborted();
    w.inFlight++;
  }

  #release(to: number): void {
    const w = this.#windows.get(to)!;
    w.inFlight--;
    w.waiters.shift()?.();
  }

  close(): void {
    this.#closed = true;
    // drained, not dropped: every piece in flight to this rank gets its answer now, instead of
    // waiting out its sender's timeout (a rank replaces its transport at every restore)
    if (this.#sub?.drain) this.#sub.drain();
    else this.#sub?.unsubscribe();
    this.#sub = null;
    this.#server?.close();
    this.#server = null;
    this.#net?.close();
    this.#net = null;
    for (const l of this.#links.values()) {
      if (l.kind === "shm") l.out.unlink();
      if (l.kind === "shm" || l.kind === "net") l.direct?.close();
    }
    for (const w of this.#windows.values()) for (const wake of w.waiters.splice(0)) wake();
  }
}
