// NatsBus: the Bus over a real NATS server (@nats-io/transport-node), with every endpoint
// registered through @nats-io/services so `$SRV.PING|INFO|STATS` discovery works.
import { busTraffic } from "./metrics.ts";
import { Svcm, type Service, type ServiceMsg } from "@nats-io/services";
import { connect, type NatsConnection, type Subscription as NatsSub } from "@nats-io/transport-node";
import { headers as natsHeaders, type MsgHdrs } from "@nats-io/transport-node";
import { answer, type Bus, type EndpointSpec, type Handler, type Subscription, unwrapReply } from "./bus.ts";
import { DeadlineError, MeshError, NoRespondersError } from "./errors.ts";
import type { Logger } from "./log.ts";

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
}

export const natsInstallHint = "apt-get install -y nats-server && nats-server -p 4222 (or: docker run -p 4222:4222 nats)";

/** Error codes that answer a question about a job rather than report a problem (logged at debug level). */
const answerCodes = new Set(["unknown_job", "not_ready", "job_state"]);

export class NatsUnreachableError extends Error {
  override readonly name = "NatsUnreachableError";
}

/**
 * Connects, retrying with exponential backoff. The first failure is logged once with the URL and
 * how to start a server; later attempts log at debug level.
 */
export async function connectWithRetry(opts: NatsBusOptions): Promise<NatsConnection> {
  const started = Date.now();
  let pauseMs = 100;
  for (let attempt = 1; ; attempt++) {
    try {
      return await connect({
        servers: opts.url,
        name: opts.name,
        // after the first connection, the client reconnects on its own, forever: a service
        // outlives a restart of its server
        maxReconnectAttempts: -1,
        reconnectTimeWait: 250,
        timeout: 2000,
      });
    } catch (e) {
      const elapsedMs = Date.now() - started;
      const why = e instanceof Error ? e.message : String(e);
      if (elapsedMs + pauseMs > opts.connectRetryMsMax) {
        throw new NatsUnreachableError(
          `cannot reach NATS at ${opts.url} after ${attempt} attempts over ${elapsedMs} ms (${why}); ${opts.hint ?? `start a server: ${natsInstallHint}`}`,
          { cause: e },
        );
      }
      if (attempt === 1)
        opts.log?.error({ url: opts.url, err: why }, `NATS at ${opts.url} is unreachable; retrying with backoff. Start a server: ${natsInstallHint}`);
      else opts.log?.debug({ url: opts.url, attempt }, "NATS still unreachable");
      await Bun.sleep(pauseMs);
      pauseMs = Math.min(pauseMs * 2, opts.connectBackoffMsMax);
    }
  }
}

const droppedText = "the connection to NATS dropped while waiting for the answer";

export class NatsBus implements Bus {
  #service: Service | undefined;
  readonly #subs: NatsSub[] = [];

  /** requests waiting for an answer: each fails at once when the connection drops */
  readonly #inflight = new Set<(e: Error) => void>();

  private constructor(
    readonly nc: NatsConnection,
    readonly opts: NatsBusOptions,
  ) {
    // an answer to a request sent before a disconnect never comes (the server that would route
    // it is gone): fail those requests now, so that callers retry once the client has
    // reconnected instead of waiting out their whole timeout
    void (async () => {
      for await (const s of nc.status()) {
        if (s.type !== "disconnect") continue;
        for (const drop of this.#inflight) drop(new DeadlineError(droppedText));
      }
    })().catch(() => {});
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

  async request(subject: string, data: Uint8Array, timeoutMs: number): Promise<Uint8Array> {
    let drop: (e: Error) => void = () => {};
    const dropped = new Promise<never>((_, reject) => (drop = reject));
    this.#inflight.add(drop);
    try {
      busTraffic("out", subject, data.byteLength);
      const pending = this.nc.request(subject, data, { timeout: timeoutMs });
      pending.catch(() => {}); // when the drop wins, its own failure comes later
      const msg = await Promise.race([pending, dropped]);
      busTraffic("in", subject, msg.data.byteLength);
      return unwrapReply(msg.data);
    } catch (e) {
      if (e instanceof DeadlineError && e.message.startsWith(droppedText)) throw new DeadlineError(`${droppedText} on ${subject}; retry`, { cause: e });
      throw translate(e, subject, timeoutMs);
    } finally {
      this.#inflight.delete(drop);
    }
  }

  publish(subject: string, data: Uint8Array): void {
    busTraffic("out", subject, data.byteLength);
    this.nc.publish(subject, data);
  }

  subscribe(subject: string, onMessage: (data: Uint8Array, subject: string) => void): Subscription {
    const sub = this.nc.subscribe(subject, {
      callback: (err, msg) => {
        if (err !== null) return;
        busTraffic("in", msg.subject, msg.data.byteLength);
        onMessage(msg.data, msg.subject);
      },
    });
    this.#subs.push(sub);
    return { unsubscribe: () => sub.unsubscribe() };
  }

  handle(subject: string, handler: Handler): Subscription {
    const log = this.opts.log;
    const sub = this.nc.subscribe(subject, {
      callback: (err, msg) => {
        if (err !== null) {
          log?.error({ err: err.message, subject }, "subscription failed");
          return;
        }
        busTraffic("in", msg.subject, msg.data.byteLength);
        void answer(handler, msg.data, msg.subject, this.#maxPayload).then(({ reply, failed, error }) => {
          if (msg.reply === undefined || msg.reply === "") return; // a publish: nothing to answer
          busTraffic("out", msg.subject, reply.byteLength);
          this.#send(subject, () => (failed ? msg.respond(reply, { headers: errorHeaders(error) }) : msg.respond(reply)));
        });
      },
    });
    this.#subs.push(sub);
    return { unsubscribe: () => sub.unsubscribe() };
  }

  serve(endpoint: EndpointSpec): void {
    if (!this.#service) throw new Error("this bus was connected without a service identity; it cannot serve");
    const log = this.opts.log;
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
            // "no such job here", "not ready yet" are answers, not trouble: only the log's debug level has them
            const level = error instanceof MeshError && answerCodes.has(error.code) ? "debug" : "warn";
            log?.[level]({ subject: msg.subject, err: error instanceof Error ? error.message : String(error) }, "request failed");
            // counted in $SRV.STATS num_errors; the body is our ErrorReply
            this.#send(endpoint.subject, () => msg.respondError(400, headerText(error instanceof Error ? error.message : "error"), reply));
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

  /** Drains: stops taking requests, finishes the ones in flight, flushes, closes. */
  async close(): Promise<void> {
    if (this.nc.isClosed()) return;
    await this.#service?.stop();
    for (const s of this.#subs) s.unsubscribe();
    // a drain that cannot finish (a server gone for good) ends in a plain close
    const drained = this.nc.drain().then(
      () => true,
      () => false,
    );
    if (!(await Promise.race([drained, Bun.sleep(closeDrainMsMax).then(() => false)]))) await this.nc.close().catch(() => {});
  }
}

/** How long close() lets a drain take before it closes the connection outright. */
const closeDrainMsMax = 10_000;

/** The status headers of an error reply, as @nats-io/services writes them (one line each). */
function errorHeaders(error: unknown): MsgHdrs {
  const h = natsHeaders();
  h.set("Nats-Service-Error", headerText(error instanceof Error ? error.message : "error"));
  h.set("Nats-Service-Error-Code", "400");
  return h;
}

/** Text for a NATS header: one line (the protocol refuses CR/LF there), bounded. */
export const headerText = (text: string): string => text.replace(/[\r\n]+/g, " ").slice(0, 200);

function translate(e: unknown, subject: string, timeoutMs: number): unknown {
  const names = [e, (e as { cause?: unknown } | undefined)?.cause].map((x) => (x instanceof Error ? x.name : ""));
  const text = e instanceof Error ? e.message : "";
  if (names.includes("TimeoutError") || /timeout/i.test(text)) return new DeadlineError(`no reply on ${subject} within ${timeoutMs} ms`, { cause: e });
  if (names.includes("NoRespondersError") || /no responders/i.test(text)) return new NoRespondersError(`no service answers ${subject}`, { cause: e });
  return e;
}
