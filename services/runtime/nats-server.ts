// Starts a real nats-server as a child process: on a free port, with a generated config
// (JetStream in a temporary folder, max_payload raised to the mesh's message limit). Used by
// the local launcher and by the integration tests. `await using server = await startNatsServer()`.
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";

export const natsServerInstallHint = "apt-get install -y nats-server";

export class NatsServerError extends Error {
  override readonly name = "NatsServerError";
}

export interface NatsServer extends AsyncDisposable {
  url: string;
  port: number;
  dir: string;
  stop(): Promise<void>;
}

export interface NatsServerOptions {
  /** the server's max_payload; NATS's own default is 1 MB */
  maxPayloadBytes: number;
  jetstream: boolean;
  /** how long to wait for the server to accept connections */
  startTimeoutMs: number;
}

export const natsServerDefaults: NatsServerOptions = { maxPayloadBytes: 8 << 20, jetstream: true, startTimeoutMs: 10_000 };

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
  const bin = process.env.MESHTRAIN_NATS_SERVER || Bun.which("nats-server") || Bun.which("nats-server", { PATH: "/usr/sbin:/usr/local/sbin:/usr/bin" });
  if (!bin) throw new NatsServerError(`nats-server not found; install it with: ${natsServerInstallHint}`);
  return bin;
}

async function canConnect(port: number): Promise<boolean> {
  try {
    const socket = await Bun.connect({ hostname: "127.0.0.1", port, socket: { data() {} } });
    socket.end();
    return true;
  } catch {
    return false;
  }
}

export async function startNatsServer(options: Partial<NatsServerOptions> = {}): Promise<NatsServer> {
  const opts = { ...natsServerDefaults, ...options };
  const bin = natsServerBinary();
  const dir = mkdtempSync(join(tmpdir(), "mt-nats-"));
  const port = await freePort();
  const conf = [
    `listen: "127.0.0.1:${port}"`,
    `max_payload: ${opts.maxPayloadBytes}`,
    // the mesh's largest messages are max_payload; give the write path room for a few
    `max_pending: ${Math.max(64 << 20, opts.maxPayloadBytes * 8)}`,
    opts.jetstream ? `jetstream { store_dir: "${join(dir, "js")}" }` : "",
  ].join("\n");
  writeFileSync(join(dir, "nats.conf"), conf + "\n");
  const proc = Bun.spawn([bin, "-c", join(dir, "nats.conf")], { stdout: "ignore", stderr: "pipe" });
  const deadline = Date.now() + opts.startTimeoutMs;
  while (!(await canConnect(port))) {
    if (proc.exitCode !== null || Date.now() > deadline) {
      proc.kill();
      const err = await new Response(proc.stderr).text();
      rmSync(dir, { recursive: true, force: true });
      throw new NatsServerError(`nats-server did not start on port ${port}: ${err.trim().split("\n").slice(-3).join(" | ")}`);
    }
    await Bun.sleep(20);
  }
  const stop = async () => {
    if (proc.exitCode === null) {
      proc.kill("SIGTERM");
      await proc.exited;
    }
    rmSync(dir, { recursive: true, force: true });
  };
  return { url: `nats://127.0.0.1:${port}`, port, dir, stop, [Symbol.asyncDispose]: stop };
}
