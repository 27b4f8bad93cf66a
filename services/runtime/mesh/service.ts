// What every service process shares: config (file < env < flags), a pino logger, the NATS
// bus registered for $SRV discovery, and a graceful drain on SIGTERM/SIGINT (stop taking
// requests, finish those in flight, flush, exit 0).
import { hostname } from "node:os";
import { z } from "zod";
import { DataFileError } from "../../../engine/data/errors.ts";
import { loadConfig } from "./config.ts";
import { ConfigError, NativeLibraryError } from "../../../ffi/errors.ts";
import { NatsAccessError } from "./errors.ts";
import { createLogger, type Logger } from "./log.ts";
import { serveMetrics } from "./metrics.ts";
import { NatsBus } from "./nats.ts";

export const serviceVersion = "0.1.0";

/** Keys every service accepts. */
export const baseConfigSchema = z.object({
  /** one server, or a cluster's: comma-separated, the home server first (nats.ts natsServers) */
  natsUrl: z
    .string()
    .regex(
      /^(nats|tls|ws|wss):\/\/[^\s,]+(,(nats|tls|ws|wss):\/\/[^\s,]+)*$/,
      "a NATS URL looks like nats://host:4222 (a cluster's: nats://a:4222,nats://b:4222)",
    ),
  logLevel: z.enum(["fatal", "error", "warn", "info", "debug", "trace", "silent"]),
  /** largest message sent or accepted; must not exceed the server's max_payload */
  payloadBytesMax: z
    .number()
    .int()
    .min(64 << 10)
    .max(64 << 20),
  /** how long to keep trying to reach NATS at start-up */
  connectRetryMsMax: z.number().int().min(0),
  /** Prometheus /metrics on this port (0: one the system picks, announced in $SRV metadata and
   *  the log; -1: none), on metricsHost */
  metricsPort: z.number().int().min(-1).max(65535),
  metricsHost: z.string().min(1),
  /** TLS to NATS: the CA that signed the server's certificate, and this service's certificate
   *  and key (when the server verifies clients); empty: none (a tls:// URL still requires TLS) */
  tlsCa: z.string(),
  tlsCert: z.string(),
  tlsKey: z.string(),
  /** the nkey seed file of this service's NATS user (services/runtime/job/roles.ts); empty: anonymous */
  natsNkey: z.string(),
  /** the machine this process runs on (MT_HOST / --host; default the machine's name): its
   *  heartbeats say it, so that the job's watch names a host whose every process went quiet at
   *  once (cut off, or down); a trainer's also groups the all-reduce (ranks with one label
   *  reduce among themselves first) */
  host: z
    .string()
    .min(1)
    .max(64)
    .regex(/^[A-Za-z0-9._-]+$/, "a host label is letters, digits, '.', '_' or '-'"),
});

export const baseConfigDefaults = {
  natsUrl: "nats://127.0.0.1:4222",
  logLevel: "info" as const,
  payloadBytesMax: 8 << 20,
  connectRetryMsMax: 300_000,
  metricsPort: 0,
  metricsHost: "0.0.0.0",
  tlsCa: "",
  tlsCert: "",
  tlsKey: "",
  natsNkey: "",
  host:
    hostname()
      .replace(/[^A-Za-z0-9._-]/g, "-")
      .slice(0, 64) || "host",
};

export interface ServiceContext<C> {
  config: C;
  log: Logger;
  bus: NatsBus;
}

export type BaseConfig = z.infer<typeof baseConfigSchema>;

export interface ServiceDefinition<C extends BaseConfig> {
  name: string;
  description: string;
  /** validates C (a ZodObject: its keys name the flags and MT_* variables) */
  schema: z.ZodObject;
  defaults: Partial<C>;
  /** extra $SRV metadata (shard index, rank) */
  metadata?: (config: C) => Record<string, string>;
  /** runs before the process connects (a trainer opens its device here, so that its $SRV
   *  metadata can say which): a throw fails the start as start's would; what it returns joins
   *  the metadata */
  prepare?: (ctx: { config: C; log: Logger }) => Record<string, string>;
  logFields?: (config: C) => { shard?: number; rank?: number; job?: string };
  /** starts serving; the returned stop() runs before the bus drains (it must not free what
   *  in-flight requests use: memory is released when the process exits) */
  start(ctx: ServiceContext<C>): Promise<{ stop(): Promise<void> }>;
}

/** The process's readiness for /readyz (an orchestrator routes work to it, or waits): connected to
 *  NATS and started; not ready while the client reconnects after a drop. */
class Health {
  started = false;
  #connection: string | null;

  constructor(natsUrl: string) {
    this.#connection = `connecting to NATS at ${natsUrl}`;
  }

  notReady(): string | null {
    return this.#connection ?? (this.started ? null : "starting");
  }

  follow(nc: NatsBus["nc"]): void {
    this.#connection = null;
    void (async () => {
      for await (const s of nc.status()) {
        if (s.type === "disconnect") this.#connection = `disconnected from NATS at ${s.server}; reconnecting`;
        else if (s.type === "reconnect") this.#connection = null;
      }
    })().catch(() => {}); // the status stream ends with the connection, and the process with it
  }
}

/**
 * The exit code of a service that cannot start for a reason no restart can fix (sysexits.h's
 * EX_CONFIG): its configuration is invalid, its device or a native library is missing, a file
 * it needs cannot be read, or its credentials are refused. The local launcher does not restart
 * it and fails the running jobs at once with its message.
 */
export const configExitCode = 78;

/** Whether a start-up error is one that no restart can fix. */
export function isConfigurationError(e: unknown): boolean {
  return (
    e instanceof ConfigError ||
    e instanceof NativeLibraryError ||
    e instanceof DataFileError ||
    e instanceof NatsAccessError ||
    (e instanceof Error && (e as NodeJS.ErrnoException).code === "ENOENT")
  );
}

/** Runs a service process until SIGTERM/SIGINT; exits with one clear line on a start-up error:
 *  configExitCode when no restart can fix it, else 1. */
export async function runService<C extends BaseConfig>(
  def: ServiceDefinition<C>,
  argv = process.argv.slice(2),
): Promise<void> {
  let log = createLogger({ service: def.name });
  try {
    const config = loadConfig(def.schema, { argv, env: process.env }, def.defaults) as C;
    log = createLogger({ service: def.name, ...def.logFields?.(config) }, config.logLevel);
    log.info({ config }, `${def.name} starting`);
    const health = new Health(config.natsUrl);
    const metrics =
      config.metricsPort >= 0 ? serveMetrics(config.metricsPort, config.metricsHost, () => health.notReady()) : null;
    if (metrics !== null) log.info({ metrics: metrics.url }, `${def.name} serves Prometheus metrics at ${metrics.url}`);
    const prepared = def.prepare?.({ config, log }) ?? {};
    const metadata = {
      ...(def.metadata?.(config) ?? {}),
      ...prepared,
      ...(metrics === null ? {} : { metrics: metrics.url }),
    };
    const bus = await NatsBus.connect({
      url: config.natsUrl,
      name: def.name,
      service: { name: def.name, version: serviceVersion, description: def.description, metadata },
      log,
      connectRetryMsMax: config.connectRetryMsMax,
      connectBackoffMsMax: 5_000,
      tls: { caFile: config.tlsCa, certFile: config.tlsCert, keyFile: config.tlsKey },
      ...(config.natsNkey === "" ? {} : { nkeyFile: config.natsNkey }),
    });
    health.follow(bus.nc);
    // The signals are taken before start, not after the "ready" line: a supervisor that stops the
    // service as soon as it reads that line must find the drain in place. A signal during start
    // is kept and acted on once start has finished.
    let running: { stop(): Promise<void> } | null = null;
    let signalled: string | null = null;
    let stopping = false;
    const shutdown = async (signal: string) => {
      if (running === null) {
        signalled ??= signal;
        return;
      }
      if (stopping) return;
      stopping = true;
      log.info({ signal }, `${def.name} draining`);
      await running.stop();
      await bus.close(); // stop taking requests, answer those in flight, flush
      await metrics?.stop();
      log.info(`${def.name} stopped`);
      process.exit(0);
    };
    process.on("SIGTERM", () => void shutdown("SIGTERM"));
    process.on("SIGINT", () => void shutdown("SIGINT"));
    running = await def.start({ config, log, bus });
    health.started = true;
    log.info(`${def.name} ready on ${config.natsUrl}`);
    if (signalled !== null) await shutdown(signalled);
    void bus.nc.closed().then((err) => {
      if (!stopping) {
        log.fatal({ err: err?.message }, "NATS connection closed");
        process.exit(1);
      }
    });
  } catch (e) {
    const fatal = isConfigurationError(e);
    log.fatal({ err: (e as Error).message, configuration: fatal }, `${def.name} failed to start`);
    console.error(`${def.name}: ${(e as Error).message}`);
    process.exit(fatal ? configExitCode : 1);
  }
}
