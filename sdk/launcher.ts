// The local launcher: reads deploy/docker-compose.yml (the single source of the topology) and
// starts the same services as local processes, next to an embedded nats-server on a free port.
// A service that dies is restarted (after a short pause, a bounded number of times), as
// `restart: on-failure` does in compose. Service logs go to one file per service.
import { createWriteStream, mkdirSync, readFileSync, type WriteStream } from "node:fs";
import { join } from "node:path";
import type { Subprocess } from "bun";
import { parse } from "yaml";
import { z } from "zod";
import { type NatsServer, startNatsServer } from "../services/runtime/nats-server.ts";

export const composePath = join(import.meta.dir, "..", "deploy", "docker-compose.yml");
const root = join(import.meta.dir, "..");

/** Restarts of one service before the launcher gives up on it. */
export const restartsMax = 10;
/** Pause before a restart, so a service that fails at once does not spin. */
export const restartDelayMs = 500;

const composeSchema = z.object({
  services: z.record(z.string(), z.object({
    image: z.string().optional(),
    command: z.array(z.string()).optional(),
    environment: z.record(z.string(), z.union([z.string(), z.number(), z.boolean()])).optional(),
  }).loose()),
}).loose();

export interface ServiceSpec {
  name: string;
  /** argv, `bun` replaced by this Bun */
  argv: string[];
  env: Record<string, string>;
}

/** The services of the compose file that run meshtrain code (not the NATS server itself). */
export function readTopology(path = composePath): ServiceSpec[] {
  const doc = composeSchema.parse(parse(readFileSync(path, "utf8"), { merge: true }));
  return Object.entries(doc.services)
    .filter(([, s]) => s.command?.[0] === "bun")
    .map(([name, s]) => ({
      name,
      argv: [process.execPath, ...s.command!.slice(1).map((a) => (a.endsWith(".ts") ? join(root, a) : a))],
      env: Object.fromEntries(Object.entries(s.environment ?? {}).map(([k, v]) => [k, String(v)])),
    }));
}

export interface MeshOptions {
  /** folder for service logs and checkpoints */
  dir: string;
  /** extra MT_* overrides for every service */
  env?: Record<string, string>;
  onEvent?: (line: string) => void;
}

interface Running {
  spec: ServiceSpec;
  proc: Subprocess;
  restarts: number;
}

export class LocalMesh implements AsyncDisposable {
  readonly #running = new Map<string, Running>();
  readonly #logs = new Map<string, WriteStream>();
  #stopping = false;

  private constructor(readonly nats: NatsServer, readonly opts: MeshOptions, readonly services: ServiceSpec[]) {}

  static async start(opts: MeshOptions, topology = readTopology()): Promise<LocalMesh> {
    mkdirSync(join(opts.dir, "logs"), { recursive: true });
    const nats = await startNatsServer();
    const mesh = new LocalMesh(nats, opts, topology);
    for (const spec of topology) mesh.#spawn(spec, 0);
    return mesh;
  }

  get url(): string {
    return this.nats.url;
  }

  /**
   * OpenMP threads per process on this machine: the trainers split the cores between them
   * (their compute is the step's critical path); every other service gets one thread.
   */
  #threads(spec: ServiceSpec): string {
    const trainers = this.services.filter((s) => s.env.MT_RANK !== undefined).length;
    return String(spec.env.MT_RANK !== undefined ? Math.max(1, Math.floor(navigator.hardwareConcurrency / Math.max(trainers, 1))) : 1);
  }

  #env(spec: ServiceSpec): Record<string, string> {
    return {
      ...(process.env as Record<string, string>), ...spec.env,
      OMP_NUM_THREADS: this.#threads(spec),
      MT_NATS_URL: this.nats.url,
      MT_DIR: join(this.opts.dir, "checkpoints"),
      ...this.opts.env,
      // per-service identity from the compose file wins over the overrides
      ...(spec.env.MT_SHARD ? { MT_SHARD: spec.env.MT_SHARD } : {}),
      ...(spec.env.MT_RANK ? { MT_RANK: spec.env.MT_RANK } : {}),
    };
  }

  #log(name: string): WriteStream {
    let s = this.#logs.get(name);
    if (!s) {
      s = createWriteStream(join(this.opts.dir, "logs", `${name}.log`), { flags: "a" });
      this.#logs.set(name, s);
    }
    return s;
  }

  #spawn(spec: ServiceSpec, restarts: number): void {
    const log = this.#log(spec.name);
    const proc = Bun.spawn(spec.argv, { cwd: root, env: this.#env(spec), stdin: "ignore", stdout: "pipe", stderr: "pipe" });
    for (const stream of [proc.stdout, proc.stderr]) {
      void (async () => {
        for await (const chunk of stream) log.write(chunk);
      })();
    }
    this.#running.set(spec.name, { spec, proc, restarts });
    void proc.exited.then((code) => {
      if (this.#stopping) return;
      const why = proc.signalCode ? `signal ${proc.signalCode}` : `exit ${code}`;
      if (restarts >= restartsMax) {
        this.opts.onEvent?.(`${spec.name} died (${why}) ${restarts} times; not restarting (log: ${join(this.opts.dir, "logs", spec.name + ".log")})`);
        return;
      }
      this.opts.onEvent?.(`${spec.name} died (${why}); restarting`);
      setTimeout(() => {
        if (!this.#stopping) this.#spawn(spec, restarts + 1);
      }, restartDelayMs);
    });
  }

  /** Sends a signal to a service's current process (the chaos tests' SIGKILL). */
  kill(name: string, signal: NodeJS.Signals = "SIGKILL"): number {
    const r = this.#running.get(name);
    if (!r) throw new Error(`no service ${name}; services: ${[...this.#running.keys()].join(", ")}`);
    r.proc.kill(signal);
    return r.proc.pid;
  }

  restarts(name: string): number {
    return this.#running.get(name)?.restarts ?? 0;
  }

  async stop(): Promise<void> {
    if (this.#stopping) return;
    this.#stopping = true;
    const procs = [...this.#running.values()].map((r) => r.proc);
    for (const p of procs) p.kill("SIGTERM");
    const deadline = setTimeout(() => procs.forEach((p) => p.kill("SIGKILL")), 10_000);
    await Promise.all(procs.map((p) => p.exited));
    clearTimeout(deadline);
    for (const s of this.#logs.values()) s.end();
    await this.nats.stop();
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.stop();
  }
}
