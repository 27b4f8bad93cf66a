// The small interface services talk through. NatsBus (nats.ts) implements it over a real
// server; MemoryBus below is for unit tests only. A request answered with an ErrorReply is
// thrown on the caller's side as the typed error it names (errors.ts).
import type { KV } from "@nats-io/kv";
import type { BucketOptions } from "./kv-bucket.ts";
import { decodeErrorReply, encodeErrorReply, isErrorReply } from "../../../schemas/messages/runtime.ts";
import {
  DeadlineError,
  errorReplyOf,
  LimitExceededError,
  NoRespondersError,
  rebuildError,
  RequestLostError,
} from "./errors.ts";

/**
 * Where a process whose connection to NATS dropped and came back says so (a Reconnected,
 * schemas/reconnected.fbs): a request it was to answer while it was away is lost (its server,
 * still holding the old connection, delivered it there). Every other process fails its requests
 * still waiting on one of the subjects it answers, and their callers ask again at once instead of
 * after their timeouts.
 */
export const reconnectedSubject = "mt.ctl.reconnected";

/** Handles one request; what it returns is the reply. A throw becomes an ErrorReply. */
export type Handler = (data: Uint8Array, subject: string) => Promise<Uint8Array> | Uint8Array;

export interface EndpointSpec {
  /** a short name for $SRV stats (a subject token) */
  name: string;
  subject: string;
  handler: Handler;
  /** queue group; shards of one subject never share one, replicas of a loader would */
  queue?: string;
}

export interface Subscription {
  unsubscribe(): void;
  /**
   * Stops taking new messages but still handles (and answers) those already routed here, then
   * unsubscribes: the handler may run after this returns, and must answer as a closed one would.
   * Where a bus cannot tell the two apart, the same as unsubscribe.
   */
  drain?(): void;
}

/**
 * Ends a subscription by a drain where the bus has one, else outright: for a handler that stays
 * correct after its owner closed (it refuses then), so that a request routed to it just before is
 * answered at once instead of left to its sender's timeout.
 */
export function release(sub: Subscription | null | undefined): void {
  if (sub?.drain) sub.drain();
  else sub?.unsubscribe();
}

export interface RequestOptions {
  /**
   * Ask again every reaskMs while no answer came (the first answer wins): for an idempotent
   * request whose answerer may have been reached through a route that is gone (a NATS server cut
   * off, still holding its clients' subscriptions in the others' view), or whose answer was.
   */
  reaskMs?: number;
  /**
   * The first ask again comes this soon, each next one after twice the wait before, up to
   * reaskMs (default: every reaskMs): for a request whose answerer restarts in about this time
   * (a process killed while it held the ask), where asking again costs the answerer little.
   */
  reaskFirstMs?: number;
}

export interface Bus {
  request(subject: string, data: Uint8Array, timeoutMs: number, o?: RequestOptions): Promise<Uint8Array>;
  /** A bus on a NATS cluster: calls `fn` with the client URLs of servers that left the cluster
   *  (cut off or down); returns the way to stop. */
  onServersLeft?(fn: (urls: string[]) => void): () => void;
  publish(subject: string, data: Uint8Array): void;
  /** `onError`: the server refused the subscription (the user's role does not allow it) */
  subscribe(
    subject: string,
    onMessage: (data: Uint8Array, subject: string) => void,
    onError?: (e: Error) => void,
  ): Subscription;
  serve(endpoint: EndpointSpec): void;
  /**
   * Answers requests on `subject` until unsubscribed, outside $SRV discovery: per-job hot-path
   * subjects (collective pieces) that come and go with the job. A throw becomes an ErrorReply;
   * a message without a reply subject is handled and not answered.
   */
  handle(subject: string, handler: Handler): Subscription;
  close(): Promise<void>;
}

/**
 * A bus on a NATS server with JetStream, as the job store and the NCCL id exchange use it: the
 * mesh's KV buckets, the server it reached, and the moves of its connection. What reaches NATS
 * outside services/runtime/mesh/ goes through a Bus; nothing there holds the connection.
 */
export interface StoreBus extends Bus {
  /** creates or opens a KV bucket (kv-bucket.ts: its replicas, the races of its creation) */
  openBucket(name: string, options: BucketOptions): Promise<KV>;
  /** the server this bus is connected to, as messages name it */
  readonly server: string;
  /** each time the connection moves to another server, or a server leaves the cluster */
  clusterChanges(): AsyncIterable<string>;
  /** how long the connection has been lost (0: connected), where the bus can tell */
  awayMs?(): number;
}

/** Largest error reply read back (an error message is text, not data). */
export const errorReplyBytesMax = 64 << 10;

/** Room left in a message for the reply's subject and headers. */
const replyOverheadBytes = 4096;

/**
 * Runs a handler and turns its failure into an ErrorReply payload. A reply larger than the
 * transport carries (`replyBytesMax`, the server's max_payload) becomes an error naming the sizes:
 * sending it would throw in the middle of the connection's write path.
 */
export async function answer(
  handler: Handler,
  data: Uint8Array,
  subject: string,
  replyBytesMax = Infinity,
): Promise<{ reply: Uint8Array; failed: boolean; error?: unknown }> {
  try {
    const reply = await handler(data, subject);
    if (reply.byteLength > replyBytesMax - replyOverheadBytes)
      throw new LimitExceededError(
        `the answer on ${subject} is ${reply.byteLength} bytes, more than the ${replyBytesMax - replyOverheadBytes} a message carries (the server's max_payload less ${replyOverheadBytes})`,
      );
    return { reply, failed: false };
  } catch (e) {
    return { reply: encodeErrorReply(errorReplyOf(e, subject)), failed: true, error: e };
  }
}

/** A reply as the caller sees it: error replies become thrown typed errors. */
export function unwrapReply(reply: Uint8Array): Uint8Array {
  if (isErrorReply(reply)) throw rebuildError(decodeErrorReply(reply, errorReplyBytesMax));
  return reply;
}

/** Subject matching with NATS wildcards: `*` one token, `>` the rest. */
export function subjectMatches(pattern: string, subject: string): boolean {
  const p = pattern.split("."),
    s = subject.split(".");
  for (let i = 0; i < p.length; i++) {
    if (p[i] === ">") return s.length > i;
    if (i >= s.length || (p[i] !== "*" && p[i] !== s[i])) return false;
  }
  return p.length === s.length;
}

/** The pause before a request is asked again of one that is away. */
const awayPauseMs = 250;

/**
 * A request to one that may be away for now: no one answers its subject (a process restarting,
 * one whose host is cut off), or what was asked was lost (RequestLostError). Asked again after a
 * pause until it is answered, `timeoutMs` is out, or `stop()` says to give up.
 */
export async function requestWhileAway(
  bus: Bus,
  subject: string,
  data: Uint8Array,
  timeoutMs: number,
  stop: () => boolean = () => false,
): Promise<Uint8Array> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    try {
      return await bus.request(subject, data, Math.max(1, deadline - Date.now()));
    } catch (e) {
      const away = e instanceof NoRespondersError || e instanceof RequestLostError;
      if (!away || stop() || Date.now() + awayPauseMs >= deadline) throw e;
      await Bun.sleep(awayPauseMs);
    }
  }
}

/** In-process bus for unit tests: same semantics, no server, messages copied like a wire. */
export class MemoryBus implements Bus {
  readonly #endpoints = new Map<string, EndpointSpec>();
  readonly #subs = new Set<{ subject: string; fn: (d: Uint8Array, s: string) => void }>();

  async request(subject: string, data: Uint8Array, timeoutMs: number): Promise<Uint8Array> {
    const ep =
      this.#endpoints.get(subject) ?? [...this.#endpoints.values()].find((e) => subjectMatches(e.subject, subject));
    if (!ep) throw new NoRespondersError(`no service answers ${subject}`);
    let timer: ReturnType<typeof setTimeout> | undefined;
    const deadline = new Promise<never>((_, reject) => {
      timer = setTimeout(() => reject(new DeadlineError(`no reply on ${subject} within ${timeoutMs} ms`)), timeoutMs);
    });
    try {
      const { reply } = await Promise.race([answer(ep.handler, data.slice(), subject), deadline]);
      return unwrapReply(reply.slice());
    } finally {
      clearTimeout(timer);
    }
  }

  publish(subject: string, data: Uint8Array): void {
    for (const sub of this.#subs) if (subjectMatches(sub.subject, subject)) sub.fn(data.slice(), subject);
  }

  subscribe(subject: string, onMessage: (data: Uint8Array, subject: string) => void): Subscription {
    const sub = { subject, fn: onMessage };
    this.#subs.add(sub);
    return { unsubscribe: () => this.#subs.delete(sub) };
  }

  handle(subject: string, handler: Handler): Subscription {
    const ep = { name: "handle", subject, handler };
    this.serve(ep);
    return { unsubscribe: () => this.#endpoints.get(subject) === ep && this.#endpoints.delete(subject) };
  }

  serve(endpoint: EndpointSpec): void {
    if (this.#endpoints.has(endpoint.subject)) throw new Error(`${endpoint.subject} is served already`);
    this.#endpoints.set(endpoint.subject, endpoint);
  }

  async close(): Promise<void> {
    this.#endpoints.clear();
    this.#subs.clear();
  }
}
