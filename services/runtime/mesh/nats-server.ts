// Starts a real nats-server as a child process: on a free port (or a given one), with a
// generated config (JetStream in a temporary folder removed at stop, or in a given folder that
// is kept; max_payload raised to the mesh's message limit). Used by the local launcher and by
// the integration tests. `await using server = await startNatsServer()`.
import { MeshtrainError } from "../../../ffi/errors.ts";
import { createWriteStream, mkdirSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";

export const natsServerInstallHint = "apt-get install -y nats-server";

export class NatsServerError extends MeshtrainError {
  override readonly name = "NatsServerError";
}

export interface NatsServer extends AsyncDisposable {
  url: string;
  port: number;
  dir: string;
  pid: number;
  /** resolves with the exit code when the server process ends (for whatever reason) */
  exited: Promise<number>;
  stop(): Promise<void>;
}

export interface NatsServerOptions {
  /** the server's max_payload; NATS's own default is 1 MB */
  maxPayloadBytes: number;
  jetstream: boolean;
  /** how long to wait for the server to accept connections */
  startTimeoutMs: number;
  /** a port to listen on (refused when taken); default: a free one */
  port?: number;
  /** the address it listens on, for clients, routes and monitoring (default 127.0.0.1; a host
   *  of the test bed gives its own, testbed/hosts.ts) */
  host?: string;
  /** the folder for the config and the JetStream store, kept at stop; default: a temporary one, removed */
  dir?: string;
  /** rewrites the server's argv (the launcher ties its life to the launcher's) */
  wrap?: (argv: string[]) => string[];
  /** where the server's own log goes once it runs (default: dropped); its stderr is always
   *  drained, so a chatty server never blocks on a full pipe */
  logFile?: string;
  /** TLS: the server's certificate and key, and the CA its clients must present certificates of
   *  (verify: a client without one is refused); the URL is then tls:// */
  tls?: { certFile: string; keyFile: string; caFile?: string; verify?: boolean };
  /** one server of a cluster (deploy/nats-cluster/ has the same for a real deployment) */
  cluster?: NatsClusterOptions;
  /** the HTTP monitoring port (/varz, /jsz, /connz) on its host (127.0.0.1 unless given); default: none */
  monitorPort?: number;
  /** the users and their permissions: an `authorization { ... }` block (services/runtime/job/roles.ts
   *  natsAuthorization); default: none, anyone may connect and do anything */
  authorization?: string;
}

/** A cluster member: its name in the cluster, where it listens for routes, the routes to the others. */
export interface NatsClusterOptions {
  /** the cluster's name (the same on every member) */
  name: string;
  /** this server's name: JetStream's peers and leaders are named by it */
  serverName: string;
  /** the port this server takes routes on */
  port: number;
  /** the other members' route URLs, nats-route://host:port */
  routes: string[];
  /**
   * How often the server pings its routes and its clients (seconds), and how many pings
   * unanswered drop one (default nats-server's: 2 min and 2). A member cut off by a partition
   * closes nothing: its routes go silent, and the others keep routing its old clients'
   * subscriptions there (a request to a queue group's member that moved away is lost) until
   * they find the route stale. nats-server 2.9 has one setting for routes and clients alike,
   * and delays a ping while the connection carries traffic: 1 s and 2 find a quiet member cut
   * off within about 6 s, and drop a client whose event loop is blocked for about 3 s (a
   * trainer's step computes on it). A busy route fails sooner by its host's TCP: with
   * net.ipv4.tcp_retries2 = 2, once its data goes unacknowledged for about 1.4 s.
   */
  ping?: { intervalS: number; max: number };
}

/** The config lines of a cluster member (server_name sits outside the cluster block). */
const clusterConf = (c: NatsClusterOptions, host: string): string =>
  [
    `server_name: "${c.serverName}"`,
    ...(c.ping === undefined ? [] : [`ping_interval: "${c.ping.intervalS}s"`, `ping_max: ${c.ping.max}`]),
    "cluster {",
    `  name: "${c.name}"`,
    `  listen: "${host}:${c.port}"`,
    `  routes: [${c.routes.map((r) => `"${r}"`).join(", ")}]`,
    "}",
  ].join("\n");

/**
 * A client's outbound buffer on the server (max_pending): past it, the server drops the client
 * as a slow consumer. A shard takes every trainer's push at once (a trainer keeps at most
 * psMessagesInFlight messages in flight to each shard), so 32 messages of max_payload: 256 MiB at
 * 8 MiB (NATS's own default, 64 MiB, dropped a GPT's shards under 8 trainers' pushes).
 */
export const maxPendingBytes = (maxPayloadBytes: number): number => Math.max(256 << 20, maxPayloadBytes * 32);

export const natsServerDefaults: NatsServerOptions = {
  maxPayloadBytes: 8 << 20,
  jetstream: true,
  startTimeoutMs: 10_000,
};

/** A port nobody listens on right now (bind port 0, read it, close). */
export async function freePort(): Promise<number> {
  return await new Promise((resolve, reject) => {
    const srv = createServer();
    srv.once("error", reject);
    srv.listen(0, "127.0.0.1", () => {
      const addr = srv.address();
      srv.close(() => (typeof addr === "object" && addr ? resolve(addr.port) : reject(new Error("no port"))));
    });
  });
}

export function natsServerBinary(): string {
  const bin =
    process.env.MESHTRAIN_NATS_SERVER ||
    Bun.which("nats-server") ||
    Bun.which("nats-server", { PATH: "/usr/sbin:/usr/local/sbin:/usr/bin" });
  if (!bin) throw new NatsServerError(`nats-server not found; install it with: ${natsServerInstallHint}`);
  return bin;
}

async function canConnect(host: string | undefined, port: number): Promise<boolean> {
  try {
    const socket = await Bun.connect({ hostname: host ?? "127.0.0.1", port, socket: { data() {} } });
    socket.end();
    return true;
  } catch {
    return false;
  }
}

async function drain(stream: ReadableStream<Uint8Array>, logFile: string | undefined): Promise<void> {
  const out = logFile ? createWriteStream(logFile, { flags: "a" }) : null;
  for await (const chunk of stream) out?.write(chunk);
  out?.end();
}

/** How many ports a server given none tries: another process can take a free port before it binds. */
const portTriesMax = 3;

export async function startNatsServer(options: Partial<NatsServerOptions> = {}): Promise<NatsServer> {
  const opts = { ...natsServerDefaults, ...options };
  if (opts.port !== undefined && (await canConnect(opts.host, opts.port))) {
    throw new NatsServerError(
      `port ${opts.port} is taken (another meshtrain mesh, or another NATS server, listens there); pick another with --port`,
    );
  }
  if (opts.port !== undefined) return await startOn(opts, opts.port);
  for (let attempt = 1; ; attempt++) {
    const port = await freePort();
    try {
      return await startOn(opts, port);
    } catch (e) {
      const lostPort =
        e instanceof NatsServerError && e.message.includes(`${port}`) && /address already in use/.test(e.message);
      if (!lostPort || attempt === portTriesMax) throw e;
    }
  }
}

async function startOn(opts: NatsServerOptions, port: number): Promise<NatsServer> {
  const bin = natsServerBinary();
  const keep = opts.dir !== undefined;
  const host = opts.host ?? "127.0.0.1";
  const dir = opts.dir ?? mkdtempSync(join(tmpdir(), "mt-nats-"));
  mkdirSync(dir, { recursive: true });
  const removeDir = () => {
    if (!keep) rmSync(dir, { recursive: true, force: true });
  };
  const conf = [
    `listen: "${host}:${port}"`,
    `max_payload: ${opts.maxPayloadBytes}`,
    `max_pending: ${maxPendingBytes(opts.maxPayloadBytes)}`,
    opts.jetstream ? `jetstream { store_dir: "${join(dir, "js")}" }` : "",
    opts.cluster ? clusterConf(opts.cluster, host) : "",
    opts.monitorPort === undefined ? "" : `http: "${host}:${opts.monitorPort}"`,
    opts.authorization ?? "",
    opts.tls
      ? [
          "tls {",
          `  cert_file: "${opts.tls.certFile}"`,
          `  key_file: "${opts.tls.keyFile}"`,
          opts.tls.caFile ? `  ca_file: "${opts.tls.caFile}"` : "",
          opts.tls.verify ? "  verify: true" : "",
          "}",
        ].join("\n")
      : "",
  ].join("\n");
  writeFileSync(join(dir, "nats.conf"), conf + "\n");
  const argv = [bin, "-c", join(dir, "nats.conf")];
  // its own session: a terminal's Ctrl-C reaches whoever started it, who stops it in order
  const proc = Bun.spawn(opts.wrap ? opts.wrap(argv) : argv, {
    stdin: "ignore",
    stdout: "ignore",
    stderr: "pipe",
    detached: true,
  });
  const deadline = Date.now() + opts.startTimeoutMs;
  while (!(await canConnect(host, port))) {
    if (proc.exitCode !== null || Date.now() > deadline) {
      proc.kill();
      const err = await new Response(proc.stderr).text();
      removeDir();
      throw new NatsServerError(
        `nats-server did not start on port ${port}: ${err.trim().split("\n").slice(-3).join(" | ")}`,
      );
    }
    await Bun.sleep(20);
  }
  void drain(proc.stderr, opts.logFile);
  const stop = async () => {
    if (proc.exitCode === null) {
      proc.kill("SIGTERM");
      const killer = setTimeout(() => proc.kill("SIGKILL"), 10_000);
      await proc.exited;
      clearTimeout(killer);
    }
    removeDir();
  };
  return {
    url: `${opts.tls ? "tls" : "nats"}://${host}:${port}`,
    port,
    dir,
    pid: proc.pid,
    exited: proc.exited,
    stop,
    [Symbol.asyncDispose]: stop,
  };
}
