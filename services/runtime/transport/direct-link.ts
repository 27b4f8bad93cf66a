// Requests straight from one process to another, with the bus's semantics: the handler is a bus
// Handler, its typed errors come back as typed errors (ErrorReply bytes, as over NATS), a request
// without an answer in time is a DeadlineError, and one to a peer that is gone is a
// NoRespondersError. The collective sends its pieces this way once it knows a peer can be
// reached (services/runtime/transport/collective-bus.ts), with NATS as the fallback:
//   - over a Unix socket to a peer on this machine, for the pieces whose values are in shared
//     memory: their few hundred bytes then go process to process, without the NATS server's hop
//     and its scheduling on a busy machine (a round trip of about 0.03 ms against 0.3 ms through
//     NATS on the build machine). The socket is the user's file: its peers are this machine's;
//   - over TCP to a peer on another machine, values and all: one hop over the link, where NATS
//     takes three (client to server, server to server, server to client) and copies every byte
//     in each server. Anyone on the network can connect, so a connection's first frame is a
//     hello the listener checks (the collective's: the sender's rank and the secret the peer
//     gave that rank over NATS); a connection whose hello is refused is closed.
//
// Frames: u32 payload length, u32 request id (little-endian), payload. A reply carries its
// request's id. A frame over `frameBytesMax` closes the connection (its sender is broken or
// hostile); the server keeps serving the others.
import { unlinkSync } from "node:fs";
import type { Socket } from "bun";
import { answer, type Handler, unwrapReply } from "../mesh/bus.ts";
import { encodeErrorReply } from "../../../schemas/messages/runtime.ts";
import { BadRequestError, DeadlineError, errorReplyOf, NoRespondersError } from "../mesh/errors.ts";

const headerBytes = 8;

/**
 * Cuts a byte stream into frames; `onFrame` gets (id, payload), the payload its own (kept by
 * whoever takes it). Each frame's bytes are copied once, from the chunks they come in (a
 * megabyte frame comes in many), into an array of the frame's length.
 */
class FrameReader {
  readonly #head = new Uint8Array(headerBytes);
  #headHave = 0;
  #frame: { id: number; bytes: Uint8Array; have: number } | null = null;

  constructor(
    readonly frameBytesMax: number,
    readonly onFrame: (id: number, payload: Uint8Array) => void,
  ) {}

  /** false: a frame is over the limit (the connection should close) */
  push(chunk: Uint8Array): boolean {
    let i = 0;
    for (;;) {
      if (this.#frame === null) {
        const n = Math.min(headerBytes - this.#headHave, chunk.byteLength - i);
        this.#head.set(chunk.subarray(i, i + n), this.#headHave);
        this.#headHave += n;
        i += n;
        if (this.#headHave < headerBytes) return true;
        this.#headHave = 0;
        const dv = new DataView(this.#head.buffer);
        const len = dv.getUint32(0, true);
        if (len > this.frameBytesMax) return false;
        this.#frame = { id: dv.getUint32(4, true), bytes: new Uint8Array(len), have: 0 };
      }
      const f = this.#frame;
      const n = Math.min(f.bytes.byteLength - f.have, chunk.byteLength - i);
      f.bytes.set(chunk.subarray(i, i + n), f.have);
      f.have += n;
      i += n;
      if (f.have < f.bytes.byteLength) return true;
      this.#frame = null;
      this.onFrame(f.id, f.bytes);
    }
  }
}

function frame(id: number, payload: Uint8Array): Uint8Array {
  const out = new Uint8Array(headerBytes + payload.byteLength);
  const dv = new DataView(out.buffer);
  dv.setUint32(0, payload.byteLength, true);
  dv.setUint32(4, id, true);
  out.set(payload, headerBytes);
  return out;
}

/** Writes whole frames: what the socket does not take now goes on its next drain. */
class Writer {
  #queue: Uint8Array[] = [];

  write(s: Socket<unknown>, bytes: Uint8Array): void {
    if (this.#queue.length > 0) {
      this.#queue.push(bytes);
      return;
    }
    const n = s.write(bytes);
    if (n < bytes.byteLength) this.#queue.push(bytes.subarray(Math.max(0, n)));
  }

  drain(s: Socket<unknown>): void {
    while (this.#queue.length > 0) {
      const head = this.#queue[0]!;
      const n = s.write(head);
      if (n < head.byteLength) {
        this.#queue[0] = head.subarray(Math.max(0, n));
        return;
      }
      this.#queue.shift();
    }
  }
}

interface ServerConn {
  reader: FrameReader;
  writer: Writer;
  /** the name the handler is called with: null until a TCP connection's hello is taken */
  name: string | null;
}

/**
 * A TCP connection's hello: the name its requests are handled under (the collective's subject of
 * the sender it proved to be), or null to refuse it.
 */
export type Hello = (hello: Uint8Array) => string | null;

type Listener = Bun.UnixSocketListener<ServerConn> | Bun.TCPSocketListener<ServerConn>;

/** Answers requests on a Unix socket, or on a TCP port behind a hello, with `handler` (as bus.handle would). */
export class DirectLinkServer {
  readonly #listener: Listener;

  private constructor(
    /** the socket's path (Unix), or "" */
    readonly path: string,
    listener: Listener,
  ) {
    this.#listener = listener;
  }

  /** The TCP port (0 for a Unix socket). */
  get port(): number {
    return "port" in this.#listener ? this.#listener.port : 0;
  }

  /** On a Unix socket at `path`; null when it cannot be made (the peers then use NATS). */
  static unix(path: string, name: string, handler: Handler, frameBytesMax: number): DirectLinkServer | null {
    try {
      unlinkSync(path); // a predecessor's, left by a crash
    } catch {}
    try {
      return new DirectLinkServer(
        path,
        Bun.listen<ServerConn>({ unix: path, socket: serving(handler, frameBytesMax, name) }),
      );
    } catch {
      return null;
    }
  }

  /** On a free TCP port of `hostname`, each connection behind its hello; null when it cannot listen. */
  static tcp(hostname: string, hello: Hello, handler: Handler, frameBytesMax: number): DirectLinkServer | null {
    try {
      return new DirectLinkServer(
        "",
        Bun.listen<ServerConn>({ hostname, port: 0, socket: serving(handler, frameBytesMax, hello) }),
      );
    } catch {
      return null;
    }
  }

  /** Takes no new connection; those open end with their peers (a reply already written still arrives). */
  close(): void {
    this.#listener.stop(false);
    if (this.path === "") return;
    try {
      unlinkSync(this.path);
    } catch {}
  }
}

/** The server's socket handlers: every connection handled as `name`, or as its hello says. */
function serving(handler: Handler, frameBytesMax: number, name: string | Hello) {
  return {
    open(s: Socket<ServerConn>) {
      const writer = new Writer();
      const conn: ServerConn = {
        writer,
        name: typeof name === "string" ? name : null,
        reader: new FrameReader(frameBytesMax, (id, payload) => {
          // a handler that answers at once is answered at once: the reply is on the wire
          // before whatever its work set off (the end of an operation, a close) runs
          const reply = (r: Uint8Array) => writer.write(s, frame(id, r));
          if (conn.name === null) {
            conn.name = (name as Hello)(payload);
            if (conn.name !== null) reply(new Uint8Array(0));
            else {
              reply(encodeErrorReply(errorReplyOf(new BadRequestError("the link's hello was refused"), "direct link")));
              s.end();
            }
            return;
          }
          const as = conn.name;
          let result: Uint8Array | Promise<Uint8Array>;
          try {
            result = handler(payload, as);
          } catch (e) {
            reply(encodeErrorReply(errorReplyOf(e, as)));
            return;
          }
          if (result instanceof Uint8Array) reply(result);
          else void answer(() => result, payload, as).then(({ reply: r }) => reply(r));
        }),
      };
      s.data = conn;
    },
    data(s: Socket<ServerConn>, chunk: Uint8Array) {
      if (!s.data.reader.push(chunk)) s.end();
    },
    drain(s: Socket<ServerConn>) {
      s.data.writer.drain(s);
    },
    error() {},
  };
}

interface Pending {
  resolve: (b: Uint8Array) => void;
  reject: (e: Error) => void;
  timer: ReturnType<typeof setTimeout>;
}

/** The requesting side of one link. */
export class DirectLinkClient {
  #socket: Socket<undefined> | null = null;
  readonly #pending = new Map<number, Pending>();
  readonly #writer = new Writer();
  #nextId = 1;
  #open = true;

  private constructor(
    /** where it goes: a socket's path, or host:port */
    readonly path: string,
  ) {}

  /** Over the Unix socket at `path`; null when nothing listens there (no such peer on this machine). */
  static unix(path: string, frameBytesMax: number): Promise<DirectLinkClient | null> {
    return DirectLinkClient.#connect(path, { unix: path }, frameBytesMax);
  }

  /**
   * Over TCP to hostname:port, once the listener took `hello` (within `timeoutMs`); null when it
   * cannot be reached or refuses the hello.
   */
  static async tcp(
    hostname: string,
    port: number,
    hello: Uint8Array,
    frameBytesMax: number,
    timeoutMs: number,
  ): Promise<DirectLinkClient | null> {
    const c = await DirectLinkClient.#connect(`${hostname}:${port}`, { hostname, port }, frameBytesMax);
    if (c === null) return null;
    try {
      await c.request(hello, timeoutMs);
      return c;
    } catch {
      c.close();
      return null;
    }
  }

  static async #connect(
    path: string,
    where: { unix: string } | { hostname: string; port: number },
    frameBytesMax: number,
  ): Promise<DirectLinkClient | null> {
    const c = new DirectLinkClient(path);
    const reader = new FrameReader(frameBytesMax, (id, payload) => c.#settle(id, payload));
    try {
      const socket = {
        data(s: Socket<undefined>, chunk: Uint8Array) {
          if (!reader.push(chunk)) s.end();
        },
        drain(s: Socket<undefined>) {
          c.#writer.drain(s);
        },
        close() {
          c.#fail(`the direct link to ${path} closed`);
        },
        error() {
          c.#fail(`the direct link to ${path} failed`);
        },
      };
      c.#socket =
        "unix" in where ? await Bun.connect({ unix: where.unix, socket }) : await Bun.connect({ ...where, socket });
      return c;
    } catch {
      return null;
    }
  }

  /** false once the connection is gone: use NATS instead */
  get open(): boolean {
    return this.#open;
  }

  request(data: Uint8Array, timeoutMs: number): Promise<Uint8Array> {
    if (!this.#open || this.#socket === null)
      return Promise.reject(new NoRespondersError(`the direct link to ${this.path} is closed`));
    const id = this.#nextId;
    this.#nextId = (this.#nextId % 0xffff_fffe) + 1;
    const { promise, resolve, reject } = Promise.withResolvers<Uint8Array>();
    const timer = setTimeout(() => {
      this.#pending.delete(id);
      reject(new DeadlineError(`no reply on the direct link to ${this.path} within ${timeoutMs} ms`));
    }, timeoutMs);
    this.#pending.set(id, { resolve, reject, timer });
    this.#writer.write(this.#socket, frame(id, data));
    return promise;
  }

  #settle(id: number, reply: Uint8Array): void {
    const p = this.#pending.get(id);
    if (p === undefined) return; // timed out already
    this.#pending.delete(id);
    clearTimeout(p.timer);
    try {
      p.resolve(unwrapReply(reply));
    } catch (e) {
      p.reject(e as Error);
    }
  }

  #fail(why: string): void {
    this.#open = false;
    for (const [id, p] of this.#pending) {
      clearTimeout(p.timer);
      p.reject(new NoRespondersError(why));
      this.#pending.delete(id);
    }
  }

  close(): void {
    this.#open = false;
    this.#socket?.end();
    this.#fail(`the direct link to ${this.path} was closed`);
  }
}
