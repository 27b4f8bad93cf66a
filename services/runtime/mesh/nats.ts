// NatsBus: the Bus over a real NATS server (@nats-io/transport-node), with every endpoint
// registered through @nats-io/services so `$SRV.PING|INFO|STATS` discovery works.
import { existsSync } from "node:fs";
import { busTraffic } from "./metrics.ts";
import { Svcm, type Service, type ServiceMsg } from "@nats-io/services";
import { connect, type NatsConnection, type Subscription as NatsSub } from "@nats-io/transport-node";
import { type Msg, headers as natsHeaders, type MsgHdrs } from "@nats-io/transport-node";
import {
  answer,
  type Bus,
  type EndpointSpec,
  type Handler,
  reconnectedSubject,
  type RequestOptions,
  type StoreBus,
  subjectMatches,
  type Subscription,
  unwrapReply,
} from "./bus.ts";
import { decodeReconnected, encodeReconnected, type Reconnected } from "../../../schemas/messages/runtime.ts";
import {
  DeadlineError,
  MeshError,
  NatsAccessError,
  NatsUnreachableError,
  NoRespondersError,
  refusedAs,
  RequestLostError,
} from "./errors.ts";

export { NatsAccessError };
import type { Logger } from "./log.ts";
import { RefusalLog } from "./refusal-log.ts";
import { inboxPrefixOf, readSeed } from "../job/roles.ts";
import { type Nkey, nkeyAuthenticator } from "./nkey.ts";
import { orAfter } from "./timers.ts";
import type { KV } from "@nats-io/kv";
import { type BucketOptions, openBucket } from "./kv-bucket.ts";

export interface NatsBusOptions {
  url: string;
  /** connection name shown by the server (`nats-server` /connz) */
  name: string;
  /** $SRV identity; omit for clients that serve nothing (the SDK) */
  service?: { name: string; version: string; description?: string; metadata?: Record<string, string> };
  log?: Logger;
  /** total time to keep retrying the first connection */
  connectRetryMsMax: number;
  /** largest pause between connection attempts */
  connectBackoffMsMax: number;
  /** what to do when the server cannot be reached (default: how to start one) */
  hint?: string;
  /** TLS: the CA that signed the server's certificate, and this client's certificate and key
   *  (for a server that verifies its clients); any of them, or a tls:// URL, requires TLS */
  tls?: NatsTls;
  /** the nkey seed file of the user to connect as (services/runtime/job/roles.ts); none: anonymous */
  nkeyFile?: string;
}

/** The nkey seed file named by MT_NATS_NKEY (the SDK's and the CLI's default). */
export const nkeyFromEnv = (env: Record<string, string | undefined> = process.env): string | undefined =>
  env.MT_NATS_NKEY || undefined;

export interface NatsTls {
  caFile?: string;
  certFile?: string;
  keyFile?: string;
}

/** The TLS options of a connection: none for a nats:// URL without files, else TLS required. */
export function tlsOf(url: string, tls: NatsTls | undefined): NatsTls | undefined {
  const files = Object.fromEntries(Object.entries(tls ?? {}).filter(([, v]) => typeof v === "string" && v !== ""));
  if (Object.keys(files).length === 0 && !url.startsWith("tls://")) return undefined;
  for (const [k, f] of Object.entries(files)) {
    if (!existsSync(f as string))
      throw new NatsAccessError(`the TLS ${k.replace("File", "")} file ${f} does not exist`);
  }
  return files;
}

/** The TLS files named by MT_TLS_CA, MT_TLS_CERT and MT_TLS_KEY (the SDK's and the CLI's default). */
export const tlsFromEnv = (env: Record<string, string | undefined> = process.env): NatsTls => ({
  ...(env.MT_TLS_CA ? { caFile: env.MT_TLS_CA } : {}),
  ...(env.MT_TLS_CERT ? { certFile: env.MT_TLS_CERT } : {}),
  ...(env.MT_TLS_KEY ? { keyFile: env.MT_TLS_KEY } : {}),
});

/** TLS sessions in a row the server closes silently before a connection counts as refused. */
const tlsTimeoutsMax = 3;

/** The user of a seed file (NatsAccessError when the file is missing or holds no seed). */
function userOf(nkeyFile: string | undefined): Nkey | undefined {
  if (nkeyFile === undefined || nkeyFile === "") return undefined;
  try {
    return readSeed(nkeyFile);
  } catch (e) {
    throw new NatsAccessError((e as Error).message, { cause: e });
  }
}

/** Whether a connection error is the server refusing this client rather than not answering. */
const refused = (why: string) =>
  /certificate|self[- ]signed|\bssl\b|\btls\b|handshake|authori[sz]ation|permissions? violation|user credentials/i.test(
    why,
  );

/** The servers of a NATS URL: one, or several comma-separated (the members of a cluster). */
export const natsServers = (url: string): string[] =>
  url
    .split(",")
    .map((u) => u.trim())
    .filter((u) => u !== "");

export const natsInstallHint =
  "apt-get install -y nats-server && nats-server -p 4222 (or: docker run -p 4222:4222 nats)";

export { NatsUnreachableError } from "./errors.ts";

/**
 * Connects, retrying with exponential backoff. The first failure is logged once with the URL and
 * how to start a server; later attempts log at debug level.
 */
/** How often a connection pings its server, and how many unanswered pings drop it. */
export const pingIntervalMs = 5_000;
export const maxPingsOut = 3;

export async function connectWithRetry(opts: NatsBusOptions): Promise<NatsConnection> {
  const started = Date.now();
  let pauseMs = 100;
  const tls = tlsOf(opts.url, opts.tls);
  // a server that verifies client certificates closes the session of a client without one it
  // trusts after the handshake: the client sees only timeouts. Over TLS, a few in a row from a
  // server that accepts the connection are that refusal (a server still starting refuses the
  // connection instead).
  let tlsTimeouts = 0;
  const user = userOf(opts.nkeyFile);
  for (let attempt = 1; ; attempt++) {
    try {
      return await connect({
        servers: natsServers(opts.url),
        // in the order given: the first is this process's home server (a deployment spreads its
        // services over a cluster by listing a different one first); the rest, and the cluster's
        // members the servers announce, are where it fails over to
        noRandomize: true,
        name: opts.name,
        ...(tls === undefined ? {} : { tls }),
        ...(user === undefined
          ? {}
          : { authenticator: nkeyAuthenticator(user), inboxPrefix: inboxPrefixOf(user.publicKey) }),
        // after the first connection, the client reconnects on its own, forever: a service
        // outlives a restart of its server
        maxReconnectAttempts: -1,
        reconnectTimeWait: 250,
        timeout: 2000,
        // a server cut off by a partition closes nothing: its connection just goes silent. A
        // ping every 5 s, and 3 unanswered, find it within 20 s and move to another server
        // (nats.js's defaults, 2 min and 2, take 4 min)
        pingInterval: pingIntervalMs,
        maxPingOut: maxPingsOut,
        // nats.js makes an Error per request (and one per timeout timer) only to keep the
        // caller's stack for a failure; request() names the subject in its own errors instead,
        // and those Errors were 2.5% of a trainer's main thread in a parameter-server job
        noAsyncTraces: true,
      });
    } catch (e) {
      const elapsedMs = Date.now() - started;
      const why = e instanceof Error ? e.message : String(e);
      if (refused(why)) {
        const advice = /certificate|self[- ]signed|ssl|tls|handshake/i.test(why)
          ? tls === undefined
            ? "the server requires TLS: use a tls:// URL with the CA that signed its certificate (MT_TLS_CA, --tls-ca)"
            : "check that the CA (MT_TLS_CA) signed the server's certificate, and that this client's certificate and key (MT_TLS_CERT, MT_TLS_KEY) are the ones the server trusts"
          : opts.nkeyFile
            ? `the server does not know the user of ${opts.nkeyFile} (credentials of another mesh?)`
            : "the server requires credentials: give the nkey seed file of a user (MT_NATS_NKEY, --nats-nkey)";
        throw new NatsAccessError(`NATS at ${opts.url} refused this client: ${why}; ${advice}`, { cause: e });
      }
      tlsTimeouts = tls !== undefined && /timeout/i.test(why) ? tlsTimeouts + 1 : 0;
      if (tlsTimeouts >= tlsTimeoutsMax) {
        const advice = tls?.certFile
          ? `it verifies client certificates and did not take this client's (${tls.certFile}): is it signed by the CA the server trusts?`
          : "it verifies client certificates and this client presents none: set MT_TLS_CERT and MT_TLS_KEY (--tls-cert, --tls-key)";
        throw new NatsAccessError(
          `NATS at ${opts.url} refused this client: it closed the TLS session ${tlsTimeouts} times in a row; ${advice}`,
          { cause: e },
        );
      }
      if (elapsedMs + pauseMs > opts.connectRetryMsMax) {
        throw new NatsUnreachableError(
          `cannot reach NATS at ${opts.url} after ${attempt} attempts over ${elapsedMs} ms (${why}); ${opts.hint ?? `start a server: ${natsInstallHint}`}`,
          { cause: e },
        );
      }
      if (attempt === 1)
        opts.log?.error(
          { url: opts.url, err: why },
          `NATS at ${opts.url} is unreachable; retrying with backoff. Start a server: ${natsInstallHint}`,
        );
      else opts.log?.debug({ url: opts.url, attempt }, "NATS still unreachable");
      await Bun.sleep(pauseMs);
      pauseMs = Math.min(pauseMs * 2, opts.connectBackoffMsMax);
    }
  }
}

const droppedText = "the connection to NATS dropped while waiting for the answer";
const reconnectedText = "the connection to NATS came back: what was asked while it was away may be lost";
/** How often a bus reads the cluster's servers from the INFO its server sent last. */
const clusterCheckMs = 500;

/** What a Reconnected notice may name: beyond it, a notice is ignored. */
const noticeSubjectsMax = 256;
const noticeBytesMax = 64 << 10;

/** The cluster's servers (connect_urls) that left since `before` (none when the INFO names none at all). */
function serversLeft(before: ReadonlySet<string>, nc: NatsConnection): string[] {
  const now = new Set(nc.info?.connect_urls ?? []);
  return now.size === 0 ? [] : [...before].filter((u) => !now.has(u));
}

/** Each time the connection moves to another server, or a server leaves the cluster (its address drops out of the INFO). */
async function* clusterChangesOf(nc: NatsConnection): AsyncGenerator<string> {
  const members = () => new Set(nc.info?.connect_urls ?? []);
  let before = members();
  for await (const s of nc.status()) {
    if (s.type === "reconnect") yield `reconnected to ${s.server}`;
    if (s.type !== "update" && s.type !== "reconnect") continue;
    const now = members();
    const left = [...before].filter((u) => !now.has(u));
    before = now;
    if (s.type === "update" && left.length > 0 && now.size > 0) yield `${left.join(", ")} left the NATS cluster`;
  }
}

export class NatsBus implements StoreBus {
  #service: Service | undefined;
  /** the subscriptions open (close() ends them); one ended is let go */
  readonly #subs = new Set<NatsSub>();
  /** every handler's refusals, logged rate-limited with the subject and the reason */
  readonly #refused: RefusalLog;

  /** requests waiting for an answer, by their subject: each fails at once when the connection
   *  drops, or when the process that answers it says its connection came back */
  readonly #inflight = new Map<(e: Error) => void, string>();
  /** the subjects this process answers requests on (handle, serve), with how many of its
   *  subscriptions do (a rank's stand-in is drained as its next transport subscribes the same) */
  readonly #answers = new Map<string, number>();

  /** when the connection was lost, while it is (a reconnect clears it) */
  #awaySince: number | null = null;

  /** How long the connection has been lost: 0 while connected. */
  awayMs(): number {
    if (this.nc.isClosed()) return Number.POSITIVE_INFINITY;
    return this.#awaySince === null ? 0 : Date.now() - this.#awaySince;
  }

  /** The subjects this process answers requests on: what its reconnect notice names. */
  get answeredSubjects(): string[] {
    return [...this.#answers.keys()];
  }

  #answering(subject: string, by: 1 | -1): void {
    const n = (this.#answers.get(subject) ?? 0) + by;
    if (n > 0) this.#answers.set(subject, n);
    else this.#answers.delete(subject);
  }
  /** the cluster's servers as the last INFO named them (connect_urls) */
  #clusterMembers = new Set<string>();
  readonly #clusterTimer: ReturnType<typeof setInterval>;
  /** who hears of servers that left the cluster (onServersLeft) */
  readonly #serversLeft = new Set<(urls: string[]) => void>();
  /** this bus among the others, in its Reconnected notices: its own are not for it */
  readonly #who: string;

  private constructor(
    readonly nc: NatsConnection,
    readonly opts: NatsBusOptions,
  ) {
    this.#refused = new RefusalLog(opts.log);
    this.#who = `${opts.name ?? "client"} ${crypto.randomUUID().slice(0, 8)}`;
    // an answer to a request sent before a disconnect never comes (the server that would route
    // it is gone): fail those requests now, so that callers retry once the client has
    // reconnected instead of waiting out their whole timeout. The same when another server of
    // the cluster leaves (its address drops out of the INFO this server sends): a request whose
    // answerer was connected there, or whose answer was passing through it, is lost too.
    this.#clusterMembers = new Set(nc.info?.connect_urls ?? []);
    void (async () => {
      for await (const s of nc.status()) {
        // a publish or subscription this user's role does not allow (a request's own refusal
        // reaches its caller as NatsAccessError): say so, it is a deployment's mistake
        if (s.type === "error" && /permissions? violation/i.test(s.error.message))
          opts.log?.error({ err: s.error.message }, "NATS refused an operation of this process's role");
        if (s.type === "reconnect") {
          this.#awaySince = null;
          // what was asked while away went out on the new connection, or nowhere: asked again;
          // the others hear that what they asked of this process may be lost
          this.#dropAll(reconnectedText);
          this.#sayReconnected();
          continue;
        }
        if (s.type === "update") this.#checkCluster();
        if (s.type !== "disconnect") continue;
        this.#awaySince ??= Date.now();
        // the next server's INFO starts afresh (what was lost is failed now)
        this.#clusterMembers = new Set();
        this.#dropAll(droppedText);
      }
    })().catch(() => {});
    // nats.js says "update" only when its list of servers changes, and it keeps the servers it
    // was given: one of those leaving shows only in the INFO the server sends, read here
    this.#clusterTimer = setInterval(() => this.#checkCluster(), clusterCheckMs);
    this.#clusterTimer.unref();
    nc.subscribe(reconnectedSubject, {
      callback: (err, msg) => {
        if (err === null) this.#peerReconnected(msg.data);
      },
    });
  }

  /** A server of the cluster left (its address dropped out of the INFO this server sends): a
   *  request whose answerer was connected there, or whose answer was passing through it, is
   *  lost; those waiting are failed, and who follows departures hears of it. */
  #checkCluster(): void {
    if (this.nc.isClosed() || this.nc.info === undefined) return;
    const left = serversLeft(this.#clusterMembers, this.nc);
    this.#clusterMembers = new Set(this.nc.info.connect_urls ?? []);
    if (left.length === 0) return;
    this.opts.log?.warn({ left }, "a server of the NATS cluster left it");
    for (const said of this.#serversLeft) said(left);
    const why = `a server of the NATS cluster (${left.join(", ")}) left while waiting for the answer`;
    this.#dropAll(why);
  }

  /** Every request waiting for an answer fails now, for `why`: each is failed once. */
  #dropAll(why: string): void {
    for (const drop of this.#inflight.keys()) drop(new RequestLostError(why));
    this.#inflight.clear();
  }

  /** Calls `fn` with the client URLs of the cluster's servers that left it (its routes to
   *  them closed: cut off or down), as the server this bus is connected to says; returns the
   *  way to stop. */
  onServersLeft(fn: (urls: string[]) => void): () => void {
    this.#serversLeft.add(fn);
    return () => this.#serversLeft.delete(fn);
  }

  #sayReconnected(): void {
    if (this.#answers.size === 0) return; // a client: nobody waits on it
    const subjects = [...this.#answers.keys()].slice(0, noticeSubjectsMax);
    try {
      this.nc.publish(reconnectedSubject, encodeReconnected({ who: this.#who, subjects }));
    } catch (e) {
      this.opts.log?.warn({ err: (e as Error).message }, "could not say that this process reconnected");
    }
  }

  /** Another process's connection came back: the requests waiting on what it answers are asked again. */
  #peerReconnected(data: Uint8Array): void {
    let notice: Reconnected;
    try {
      notice = decodeReconnected(data, noticeBytesMax);
    } catch {
      return; // not a notice: nothing to act on
    }
    if (notice.who === this.#who || notice.subjects.length > noticeSubjectsMax) return;
    // the INFO saying that a server left is read before a notice that came after it, but nats.js
    // tells of it (status "update") only after the messages read with it: a process that
    // reconnected because its server died has a request fail for that server first
    this.#checkCluster();
    const who = notice.who.slice(0, 64);
    let asked = 0;
    for (const [drop, subject] of this.#inflight)
      if (notice.subjects.some((p) => p.length <= 256 && subjectMatches(p, subject))) {
        this.#inflight.delete(drop);
        drop(
          new RequestLostError(
            `a process that answers ${subject} (${who}) reconnected to NATS while waiting for the answer`,
          ),
        );
        asked++;
      }
    if (asked > 0)
      this.opts.log?.info({ who, asked }, "a process reconnected: the requests waiting on it are asked again");
  }

  static async connect(opts: NatsBusOptions): Promise<NatsBus> {
    const nc = await connectWithRetry(opts);
    const bus = new NatsBus(nc, opts);
    if (opts.service) {
      // @nats-io/services is built against its own copy of nats-core; the connection types
      // differ nominally but the protocol object is the same.
      bus.#service = await new Svcm(nc as unknown as ConstructorParameters<typeof Svcm>[0]).add({
        name: opts.service.name,
        version: opts.service.version,
        description: opts.service.description ?? "",
        metadata: opts.service.metadata ?? {},
      });
    }
    return bus;
  }

  async request(subject: string, data: Uint8Array, timeoutMs: number, o: RequestOptions = {}): Promise<Uint8Array> {
    let drop: (e: Error) => void = () => {};
    const dropped = new Promise<never>((_, reject) => (drop = reject));
    this.#inflight.set(drop, subject);
    try {
      const reaskMs = o.reaskMs ?? timeoutMs;
      const pending = this.#ask(subject, data, timeoutMs, reaskMs, Math.min(o.reaskFirstMs ?? reaskMs, reaskMs));
      pending.catch(() => {}); // when the drop wins, its own failure comes later
      const msg = await Promise.race([pending, dropped]);
      busTraffic("in", subject, msg.data.byteLength);
      return unwrapReply(msg.data);
    } catch (e) {
      if (e instanceof RequestLostError) throw new RequestLostError(`${e.message} on ${subject}; retry`, { cause: e });
      throw translate(e, subject, timeoutMs);
    } finally {
      this.#inflight.delete(drop);
    }
  }

  /**
   * The request, asked again (after `firstMs`, then after twice the wait before, at most
   * `reaskMs`) until one answer comes or `timeoutMs` is out: the first answer wins (an error
   * answer too), the others are dropped. A timeout ends it only when every ask timed out; no
   * responders ends it at once.
   */
  #ask(subject: string, data: Uint8Array, timeoutMs: number, reaskMs: number, firstMs: number): Promise<Msg> {
    const deadline = Date.now() + timeoutMs;
    return new Promise<Msg>((resolve, reject) => {
      let open = 0,
        done = false,
        waitMs = firstMs;
      let timer: ReturnType<typeof setTimeout> | undefined;
      const end = (settle: () => void) => {
        if (done) return;
        done = true;
        clearTimeout(timer);
        settle();
      };
      const ask = () => {
        const left = deadline - Date.now();
        open++;
        busTraffic("out", subject, data.byteLength);
        this.nc.request(subject, data, { timeout: Math.max(1, left) }).then(
          (msg) => end(() => resolve(msg)),
          (e: unknown) => {
            open--;
            if (open > 0 && isTimeout(e)) return; // a later ask may still be answered
            end(() => reject(e));
          },
        );
        if (left > waitMs && !done) timer = setTimeout(ask, waitMs);
        waitMs = Math.min(waitMs * 2, reaskMs);
      };
      ask();
    });
  }

  publish(subject: string, data: Uint8Array): void {
    busTraffic("out", subject, data.byteLength);
    this.nc.publish(subject, data);
  }

  subscribe(
    subject: string,
    onMessage: (data: Uint8Array, subject: string) => void,
    onError?: (e: Error) => void,
  ): Subscription {
    const sub = this.nc.subscribe(subject, {
      callback: (err, msg) => {
        if (err !== null) {
          onError?.(refusedAs(err, `subscribe to ${subject}`) as Error);
          return;
        }
        busTraffic("in", msg.subject, msg.data.byteLength);
        onMessage(msg.data, msg.subject);
      },
    });
    this.#subs.add(sub);
    return {
      unsubscribe: () => {
        this.#subs.delete(sub);
        sub.unsubscribe();
      },
    };
  }

  handle(subject: string, handler: Handler): Subscription {
    const log = this.opts.log;
    this.#answering(subject, 1);
    const sub = this.nc.subscribe(subject, {
      callback: (err, msg) => {
        if (err !== null) {
          log?.error({ err: err.message, subject }, "subscription failed");
          return;
        }
        busTraffic("in", msg.subject, msg.data.byteLength);
        void answer(handler, msg.data, msg.subject, this.#maxPayload).then(({ reply, failed, error }) => {
          if (failed) this.#refused.note(subject, msg.subject, error);
          if (msg.reply === undefined || msg.reply === "") return; // a publish: nothing to answer
          busTraffic("out", msg.subject, reply.byteLength);
          this.#send(subject, () =>
            failed ? msg.respond(reply, { headers: errorHeaders(error) }) : msg.respond(reply),
          );
        });
      },
    });
    this.#subs.add(sub);
    // once, whichever ends it: the subject is no longer answered here (by this subscription)
    let ended = false;
    const end = () => {
      if (ended) return;
      ended = true;
      this.#answering(subject, -1);
      this.#subs.delete(sub);
    };
    return {
      unsubscribe: () => {
        end();
        sub.unsubscribe();
      },
      // the requests the server routed here before it took the unsubscribe are still answered;
      // it answers those that come after with "no responders" at once
      drain: () => {
        end();
        if (sub.isClosed() || sub.isDraining() || this.nc.isClosed()) return;
        sub.drain().catch(() => sub.unsubscribe());
      },
    };
  }

  serve(endpoint: EndpointSpec): void {
    if (!this.#service) throw new Error("this bus was connected without a service identity; it cannot serve");
    const log = this.opts.log;
    this.#answering(endpoint.subject, 1);
    this.#service.addEndpoint(endpoint.name, {
      subject: endpoint.subject,
      ...(endpoint.queue === undefined ? {} : { queue: endpoint.queue }),
      // Handlers run concurrently: a BSP pull waits for other trainers' pushes, which must
      // be handled meanwhile.
      handler: (err: Error | null, msg: ServiceMsg) => {
        if (err !== null) {
          log?.error({ err: err.message, subject: endpoint.subject }, "endpoint subscription failed");
          return;
        }
        busTraffic("in", msg.subject, msg.data.byteLength);
        void answer(endpoint.handler, msg.data, msg.subject, this.#maxPayload).then(({ reply, failed, error }) => {
          busTraffic("out", msg.subject, reply.byteLength);
          if (failed) {
            // "no such job here", "not ready yet" are answers, not trouble: only the log's debug
            // level has them; the rest are logged rate-limited
            this.#refused.note(endpoint.subject, msg.subject, error);
            // counted in $SRV.STATS num_errors; the body is our ErrorReply
            this.#send(endpoint.subject, () =>
              msg.respondError(400, headerText(error instanceof Error ? error.message : "error"), reply),
            );
          } else {
            this.#send(endpoint.subject, () => msg.respond(reply));
          }
        });
      },
    });
  }

  /** The server's max_payload (what one message carries). */
  get #maxPayload(): number {
    return this.nc.info?.max_payload ?? Infinity;
  }

  /** Sends an answer; one the connection refuses (closed, too large) is logged, never thrown into the event loop. */
  #send(subject: string, respond: () => unknown): void {
    try {
      respond();
    } catch (e) {
      this.opts.log?.error({ subject, err: e instanceof Error ? e.message : String(e) }, "could not send the answer");
    }
  }

  openBucket(name: string, options: BucketOptions): Promise<KV> {
    return openBucket(this.nc, name, options);
  }

  get server(): string {
    return this.nc.getServer();
  }

  clusterChanges(): AsyncIterable<string> {
    return clusterChangesOf(this.nc);
  }

  /** Drains: stops taking requests, finishes the ones in flight, flushes, closes. */
  async close(): Promise<void> {
    clearInterval(this.#clusterTimer);
    if (this.nc.isClosed()) return;
    this.#refused.close();
    await this.#service?.stop();
    for (const s of this.#subs) s.unsubscribe();
    // a drain that cannot finish (a server gone for good) ends in a plain close
    const drained = this.nc.drain().then(
      () => true,
      () => false,
    );
    if (!(await orAfter(drained, closeDrainMsMax, false))) await this.nc.close().catch(() => {});
  }
}

/** How long close() lets a drain take before it closes the connection outright. */
export const closeDrainMsMax = 10_000;

/** The status headers of an error reply, as @nats-io/services writes them (one line each). */
function errorHeaders(error: unknown): MsgHdrs {
  const h = natsHeaders();
  h.set("Nats-Service-Error", headerText(error instanceof Error ? error.message : "error"));
  h.set("Nats-Service-Error-Code", "400");
  return h;
}

/** Text for a NATS header: one line (the protocol refuses CR/LF there), bounded. */
export const headerText = (text: string): string => text.replace(/[\r\n]+/g, " ").slice(0, 200);

const errorNames = (e: unknown): string[] =>
  [e, (e as { cause?: unknown } | undefined)?.cause].map((x) => (x instanceof Error ? x.name : ""));

/** Whether a request failed for want of an answer in time (nats.js's own error). */
const isTimeout = (e: unknown): boolean =>
  errorNames(e).includes("TimeoutError") || (e instanceof Error && /timeout/i.test(e.message));

function translate(e: unknown, subject: string, timeoutMs: number): unknown {
  const names = errorNames(e);
  const text = e instanceof Error ? e.message : "";
  if (isTimeout(e)) return new DeadlineError(`no reply on ${subject} within ${timeoutMs} ms`, { cause: e });
  if (names.includes("NoRespondersError") || /no responders/i.test(text))
    return new NoRespondersError(`no service answers ${subject}`, { cause: e });
  if (names.includes("PermissionViolationError") || /permissions? violation/i.test(text)) {
    // what only admin may do says how to be admin (a client user's restore or resize)
    const admins = /\.ckpt\.(restore|resize)$/.test(subject)
      ? "; restore and resize are admin's: connect as the admin user (its seed admin.nk: --nats-nkey or MT_NATS_NKEY; in the SDK, a LocalMesh's auth(\"admin\"))"
      : "";
    return new NatsAccessError(
      `permission denied: this client's NATS user may not send ${subject} (its role does not allow it${admins})`,
      { cause: e },
    );
  }
  return e;
}
