// The local launcher: reads deploy/docker-compose.yml (the single source of the topology) and
// starts the same services as local processes, next to an embedded nats-server. The compose
// file's trainer and parameter-server entries are templates: the launcher starts as many ranks
// and shards as asked for, each with its own MT_RANK or MT_SHARD.
//
// Lifetimes: every child runs in its own session (a terminal's Ctrl-C reaches only the launcher,
// which stops the services, then NATS, in order) and gets SIGTERM from the kernel if the launcher
// dies without stopping them (util-linux's setpriv --pdeathsig): nothing outlives the launcher.
// A service that dies is restarted, as `restart: on-failure` does in compose: after a pause that
// doubles with each quick failure in a row (RestartPolicy), and at most `budget` times within a
// sliding window; past that the launcher gives up on it and says why, with the last error the
// service wrote (onGiveUp: the CLI fails the running jobs with it). Each service's output goes to one log file per launch;
// lines about a job can also be copied into that job's own log folder.
import { createWriteStream, mkdirSync, mkdtempSync, readFileSync, rmSync, type WriteStream } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { Subprocess } from "bun";
import type * as Yaml from "yaml";
import { z } from "zod";
import { jobIdPattern } from "../services/runtime/job/subjects.ts";
import { type NatsServer, startNatsServer } from "../services/runtime/mesh/nats-server.ts";
import { ConfigError } from "../ffi/errors.ts";
import { checkOutDir } from "./user-paths.ts";
import { type Credentials, clientUser, makeCredentials, type RoleName } from "../services/runtime/job/roles.ts";
import { configExitCode } from "../services/runtime/mesh/service.ts";
import { orAfter } from "../services/runtime/mesh/timers.ts";
import { serviceNames } from "../services/bin.ts";
import { servicesExecutable } from "../services/build.ts";

export const composePath = join(import.meta.dir, "..", "deploy", "docker-compose.yml");
const root = join(import.meta.dir, "..");

/** When the launcher restarts a service that died, and when it gives up. */
export interface RestartPolicy {
  /** pause before the first restart of a failure streak; each quick failure after it doubles it */
  baseDelayMs: number;
  maxDelayMs: number;
  /** restarts allowed within windowMs before the launcher gives up on the service */
  budget: number;
  windowMs: number;
  /** a run this long was healthy: the next failure starts a new streak (the base pause) */
  healthyRunMs: number;
}

export const restartDefaults: RestartPolicy = {
  baseDelayMs: 500,
  maxDelayMs: 30_000,
  budget: 10,
  windowMs: 10 * 60_000,
  healthyRunMs: 60_000,
};

/** One service's restarts: the pause before the next, or null once the window's budget is spent. */
export class RestartTracker {
  readonly #times: number[] = [];
  #streak = 0;

  constructor(readonly policy: RestartPolicy) {}

  /** restarts within the window, as of the last call */
  get recent(): number {
    return this.#times.length;
  }

  /** A run that lasted `ranMs` ended at `nowMs`: the pause before restarting it, or null (give up). */
  next(nowMs: number, ranMs: number): number | null {
    const p = this.policy;
    while (this.#times.length > 0 && this.#times[0]! <= nowMs - p.windowMs) this.#times.shift();
    if (this.#times.length >= p.budget) return null;
    this.#streak = ranMs >= p.healthyRunMs ? 0 : this.#streak + 1;
    this.#times.push(nowMs);
    return Math.min(p.maxDelayMs, p.baseDelayMs * 2 ** Math.max(0, this.#streak - 1));
  }
}

/** The error a service last reported: a pino line at level error or fatal (its err, else its msg), or a crash's "SomeError: text" line. */
export function errorOfLine(line: string): string | null {
  if (line.startsWith("{")) {
    try {
      const o = JSON.parse(line) as { level?: unknown; err?: unknown; msg?: unknown };
      if (o.level !== "error" && o.level !== "fatal" && o.level !== 50 && o.level !== 60) return null;
      const text = [o.msg, o.err].filter((x) => typeof x === "string" && x !== "").join(": ");
      return text === "" ? null : text;
    } catch {
      return null;
    }
  }
  const m = /^\s*([A-Z]\w*(?:Error|Exception)): (.+)$/.exec(line);
  return m ? `${m[1]}: ${m[2]}` : null;
}
/** How long the services of a fresh mesh get to register (start-up on a loaded machine). */
export const membersWaitMs = 60_000;
/** How long services get to drain after SIGTERM before they are killed. */
export const stopGraceMs = 10_000;
/** Per-job log files kept open at once (mesh up): the oldest is closed first. */
const jobLogFilesMax = 64;

const composeSchema = z
  .object({
    services: z.record(
      z.string(),
      z
        .object({
          image: z.string().optional(),
          command: z.array(z.string()).optional(),
          environment: z.record(z.string(), z.union([z.string(), z.number(), z.boolean()])).optional(),
        })
        .loose(),
    ),
  })
  .loose();

export interface ServiceSpec {
  name: string;
  /** argv: `bun` replaced by this Bun, or the services' compiled executable (readTopology) */
  argv: string[];
  env: Record<string, string>;
}

/** The services of the compose file that run meshtrain code (not the NATS server itself). */
export function readTopology(path = composePath): ServiceSpec[] {
  // the YAML parser is loaded here, not by every process that imports this module (a client command)
  const yaml = require("yaml") as typeof Yaml;
  const doc = composeSchema.parse(yaml.parse(readFileSync(path, "utf8"), { merge: true }));
  const executable = servicesExecutable();
  return Object.entries(doc.services)
    .filter(([, s]) => s.command?.[0] === "bun")
    .map(([name, s]) => {
      const env = Object.fromEntries(Object.entries(s.environment ?? {}).map(([k, v]) => [k, String(v)]));
      const args = s.command!.slice(1);
      // `bun services/<service>/main.ts …` runs as `meshtrain-services <service> …` where the
      // services' compiled executable is built and up to date (services/build.ts): the same code,
      // started in a quarter of the CPU time
      const service = /^services\/([a-z-]+)\/main\.ts$/.exec(args[0] ?? "")?.[1];
      if (executable !== null && service !== undefined && (serviceNames as readonly string[]).includes(service))
        return { name, argv: [executable, service, ...args.slice(1)], env: { ...env, MESHTRAIN_ROOT: root } };
      return { name, argv: [process.execPath, ...args.map((a) => (a.endsWith(".ts") ? join(root, a) : a))], env };
    });
}

/**
 * The topology with `trainers` trainer ranks and `shards` parameter-server shards: the compose
 * file's entries of each kind are the template (their first one, renamed per index).
 */
export function scaleTopology(
  specs: readonly ServiceSpec[],
  counts: { trainers?: number; shards?: number },
): ServiceSpec[] {
  const scale = (key: "MT_RANK" | "MT_SHARD", n: number | undefined, out: ServiceSpec[]) => {
    const kind = specs.filter((s) => s.env[key] !== undefined);
    const template = kind[0];
    if (n === undefined || template === undefined) return out.push(...kind);
    const base = template.name.replace(/-?\d+$/, "");
    for (let i = 0; i < n; i++)
      out.push({ ...template, name: `${base}-${i}`, env: { ...template.env, [key]: String(i) } });
  };
  const out: ServiceSpec[] = specs.filter((s) => s.env.MT_RANK === undefined && s.env.MT_SHARD === undefined);
  scale("MT_SHARD", counts.shards, out);
  scale("MT_RANK", counts.trainers, out);
  return out;
}

export interface MeshOptions {
  /** folder that holds the jobs' folders (snapshots, model, logs): MT_DIR of the checkpoint service */
  jobsDir: string;
  /** folder for this launch's service logs (one file per service) */
  logDir: string;
  /** also copy every log line about a job into <jobsDir>/<job>/logs/<service>.log */
  jobLogs?: boolean;
  trainers?: number;
  shards?: number;
  /** NATS port (default: a free one) and JetStream folder (default: a temporary one, removed at stop) */
  port?: number;
  natsStoreDir?: string;
  /** extra MT_* overrides for every service */
  env?: Record<string, string>;
  /** extra MT_* overrides per service name (tests: MT_STEP_DELAY_MS for one trainer) */
  serviceEnv?: Record<string, Record<string, string>>;
  /** host label per trainer rank (MT_HOST), as if the ranks ran on these machines; default: this machine's name */
  trainerHosts?: string[];
  onEvent?: (line: string) => void;
  /** a service kept failing, or could not start for a reason no restart fixes (`cannotStart`: it
   *  exited with configExitCode), and is not restarted again: its name, what it last wrote as an
   *  error, its log */
  onGiveUp?: (service: string, lastError: string, log: string, cannotStart: boolean) => void;
  /** restart policy (default restartDefaults) */
  restart?: Partial<RestartPolicy>;
  /** NATS users per role (services/runtime/job/roles.ts), each service connecting as its own; false:
   *  an open server anyone may use (default true) */
  auth?: boolean;
  /** where the users' nkey seeds and auth.conf go (default: <NATS folder>/creds); kept seeds are reused */
  credsDir?: string;
  /** the owners of jobs that get a client user each (default: the default owner) */
  clients?: readonly string[];
}

interface Running {
  spec: ServiceSpec;
  proc: Subprocess;
  restarts: RestartTracker;
  /** its output copied to the logs, to the last line */
  pumped: Promise<unknown>;
}

/** argv that asks the kernel to SIGTERM the child when the launcher dies (Linux; plain argv elsewhere). */
function tiedToLauncher(argv: string[]): string[] {
  const setpriv = Bun.which("setpriv");
  return setpriv ? [setpriv, "--pdeathsig", "TERM", "--", ...argv] : argv;
}

export class LocalMesh implements AsyncDisposable {
  readonly #running = new Map<string, Running>();
  readonly #logs = new Map<string, WriteStream>();
  #stopping: Promise<void> | null = null;

  #nats: NatsServer;

  private constructor(
    nats: NatsServer,
    readonly opts: MeshOptions,
    readonly services: ServiceSpec[],
    /** the JetStream store when the launcher made it (removed at stop) */
    readonly tempNatsDir: string | null,
    /** the users' credentials, when the mesh runs with roles */
    readonly credentials: Credentials | null,
  ) {
    this.#nats = nats;
  }

  /** The NATS server now (a restart replaces it, on the same port and store). */
  get nats(): NatsServer {
    return this.#nats;
  }

  static async start(opts: MeshOptions, topology = readTopology()): Promise<LocalMesh> {
    // what the options cannot mean is refused before anything starts or is made
    for (const [name, n] of [
      ["trainers", opts.trainers],
      ["shards", opts.shards],
    ] as const)
      if (n !== undefined && !(Number.isInteger(n) && n >= 0 && n <= 64))
        throw new ConfigError(`LocalMesh: ${name} is a count from 0 to 64, not ${n}`);
    if (opts.port !== undefined && !(Number.isInteger(opts.port) && opts.port >= 1 && opts.port <= 65535))
      throw new ConfigError(`LocalMesh: port is from 1 to 65535 (none: a free one), not ${opts.port}`);
    checkOutDir(opts.logDir, "LocalMesh: logDir");
    checkOutDir(opts.jobsDir, "LocalMesh: jobsDir");
    if (opts.natsStoreDir !== undefined) checkOutDir(opts.natsStoreDir, "LocalMesh: natsStoreDir");
    mkdirSync(opts.logDir, { recursive: true });
    mkdirSync(opts.jobsDir, { recursive: true });
    // the store outlives a NATS restart: a given folder, or one this launch makes and removes
    const tempNatsDir = opts.natsStoreDir === undefined ? mkdtempSync(join(tmpdir(), "mt-nats-")) : null;
    const natsDir = opts.natsStoreDir ?? tempNatsDir!;
    const services = scaleTopology(topology, opts);
    let credentials: Credentials | null = null;
    let nats: NatsServer;
    try {
      credentials =
        (opts.auth ?? true)
          ? makeCredentials(opts.credsDir ?? join(natsDir, "creds"), {
              trainers: Math.max(1, services.filter((s) => s.env.MT_RANK !== undefined).length),
              shards: services.filter((s) => s.env.MT_SHARD !== undefined).length,
              ...(opts.clients === undefined ? {} : { clients: opts.clients }),
            })
          : null;
      nats = await startNatsServer({
        ...(opts.port === undefined ? {} : { port: opts.port }),
        dir: natsDir,
        wrap: tiedToLauncher,
        logFile: join(opts.logDir, "nats-server.log"),
        ...(credentials === null ? {} : { authorization: credentials.authorization }),
      });
    } catch (e) {
      // a launch that did not start leaves no store, and no users' seeds, behind
      if (tempNatsDir !== null) rmSync(tempNatsDir, { recursive: true, force: true });
      throw e;
    }
    const mesh = new LocalMesh(nats, opts, services, tempNatsDir, credentials);
    mesh.#watchNats();
    for (const spec of mesh.services) mesh.#spawn(spec);
    return mesh;
  }

  /**
   * NATS that dies is restarted on the same port with the same JetStream store (the jobs'
   * specs and records are in it); the services reconnect on their own and retry what failed.
   */
  #watchNats(): void {
    const nats = this.#nats;
    void nats.exited.then(async (code) => {
      if (this.#stopping) return;
      this.opts.onEvent?.(
        `nats-server died (exit ${code}); restarting it on port ${nats.port} with its store (log: ${join(this.opts.logDir, "nats-server.log")})`,
      );
      for (let attempt = 1; !this.#stopping; attempt++) {
        try {
          this.#nats = await startNatsServer({
            port: nats.port,
            dir: nats.dir,
            wrap: tiedToLauncher,
            logFile: join(this.opts.logDir, "nats-server.log"),
            ...(this.credentials === null ? {} : { authorization: this.credentials.authorization }),
          });
          this.opts.onEvent?.(`nats-server is back on port ${nats.port}`);
          this.#watchNats();
          return;
        } catch (e) {
          this.opts.onEvent?.(`nats-server did not restart (attempt ${attempt}): ${(e as Error).message}`);
          await Bun.sleep(Math.min(500 * attempt, 5_000));
        }
      }
    });
  }

  get url(): string {
    return this.nats.url;
  }

  /** How a client connects as `user` (default admin: the launcher's owner; "client": the mesh's
   *  one client user, client-default): its seed file, or nothing on an open mesh. */
  auth(user: RoleName | "client" = "admin"): { nkeyFile?: string } {
    return this.credentials === null
      ? {}
      : { nkeyFile: this.credentials.seedFile(user === "client" ? clientUser() : user) };
  }

  /** The NATS user a service of the topology connects as (null: none of the mesh's roles; it connects anonymously, and a mesh with roles refuses it). */
  static userOf(spec: ServiceSpec): RoleName | null {
    if (spec.env.MT_RANK !== undefined) return `trainer-${Number(spec.env.MT_RANK)}`;
    if (spec.env.MT_SHARD !== undefined) return `ps-${Number(spec.env.MT_SHARD)}`;
    const kind = spec.name.replace(/-?\d+$/, "");
    if (kind === "data-loader" || kind === "checkpoint") return kind;
    return null;
  }

  /** Process ids of everything the mesh runs now: NATS and every service. */
  get pids(): number[] {
    return [this.nats.pid, ...[...this.#running.values()].map((r) => r.proc.pid)];
  }

  /**
   * OpenMP threads per process on this machine: the trainers split the cores between them
   * (their compute is the step's critical path); every other service gets one thread.
   */
  #threads(spec: ServiceSpec): string {
    const trainers = this.services.filter((s) => s.env.MT_RANK !== undefined).length;
    return String(
      spec.env.MT_RANK !== undefined
        ? Math.max(1, Math.floor(navigator.hardwareConcurrency / Math.max(trainers, 1)))
        : 1,
    );
  }

  #env(spec: ServiceSpec): Record<string, string> {
    const user = LocalMesh.userOf(spec);
    return {
      ...(process.env as Record<string, string>),
      ...spec.env,
      OMP_NUM_THREADS: this.#threads(spec),
      MT_NATS_URL: this.nats.url,
      MT_DIR: this.opts.jobsDir,
      // its role's seed; none on an open mesh (the compose file's container paths do not apply here)
      MT_NATS_NKEY: this.credentials === null || user === null ? "" : this.credentials.seedFile(user),
      ...this.opts.env,
      ...this.opts.serviceEnv?.[spec.name],
      // per-service identity from the topology wins over the overrides
      ...(spec.env.MT_SHARD ? { MT_SHARD: spec.env.MT_SHARD } : {}),
      ...(spec.env.MT_RANK ? { MT_RANK: spec.env.MT_RANK } : {}),
      ...(spec.env.MT_RANK && this.opts.trainerHosts?.[Number(spec.env.MT_RANK)]
        ? {
            MT_HOST: this.opts.trainerHosts[Number(spec.env.MT_RANK)]!,
            MT_LOCAL_RANK: String(localRank(this.opts.trainerHosts, Number(spec.env.MT_RANK))),
          }
        : {}),
    };
  }

  #file(path: string): WriteStream {
    let s = this.#logs.get(path);
    if (!s) {
      if (this.#logs.size >= jobLogFilesMax + this.services.length) {
        const oldest = [...this.#logs.keys()].find((p) => p.startsWith(this.opts.jobsDir));
        if (oldest) {
          this.#logs.get(oldest)!.end();
          this.#logs.delete(oldest);
        }
      }
      s = createWriteStream(path, { flags: "a" });
      this.#logs.set(path, s);
    }
    return s;
  }

  /** Where a service's log goes. */
  logPath(name: string): string {
    return join(this.opts.logDir, `${name}.log`);
  }

  /** Copies a service's output to its log, and each line about a job to that job's log too. */
  async #pump(name: string, stream: ReadableStream<Uint8Array>): Promise<void> {
    const log = this.#file(this.logPath(name));
    const decoder = new TextDecoder();
    let rest = "";
    for await (const chunk of stream) {
      log.write(chunk);
      const lines = (rest + decoder.decode(chunk, { stream: true })).split("\n");
      rest = lines.pop() ?? "";
      for (const line of lines) {
        const error = errorOfLine(line);
        if (error !== null) this.#lastError.set(name, error.slice(0, 500));
      }
      if (!this.opts.jobLogs) continue;
      for (const line of lines) {
        const job = /"job":"([^"]{1,97})"/.exec(line)?.[1];
        if (!job || !jobIdPattern.test(job)) continue;
        const dir = join(this.opts.jobsDir, job, "logs");
        mkdirSync(dir, { recursive: true });
        this.#file(join(dir, `${name}.log`)).write(`${line}\n`);
      }
    }
  }

  #spawn(spec: ServiceSpec, restarts = new RestartTracker({ ...restartDefaults, ...this.opts.restart })): void {
    const startedMs = Date.now();
    const proc = Bun.spawn(tiedToLauncher(spec.argv), {
      cwd: root,
      env: this.#env(spec),
      stdin: "ignore",
      stdout: "pipe",
      stderr: "pipe",
      detached: true,
    });
    const pumped = Promise.all([this.#pump(spec.name, proc.stdout), this.#pump(spec.name, proc.stderr)]);
    this.#running.set(spec.name, { spec, proc, restarts, pumped });
    void proc.exited.then(async (code) => {
      if (this.#stopping) return;
      const now = Date.now();
      const why = proc.signalCode ? `signal ${proc.signalCode}` : `exit ${code}`;
      const log = this.logPath(spec.name);
      if (code === configExitCode && !proc.signalCode) {
        // an invalid setting, a missing device or library: the next start would fail the same way
        await pumped;
        const lastError = this.#lastError.get(spec.name) ?? "(none in its log)";
        this.opts.onEvent?.(
          `${spec.name} cannot start: ${lastError}; not restarting: a configuration error (log: ${log})`,
        );
        this.opts.onGiveUp?.(spec.name, lastError, log, true);
        return;
      }
      const pause = restarts.next(now, now - startedMs);
      if (pause === null) {
        await pumped; // its last lines, the crash's among them
        const lastError = this.#lastError.get(spec.name) ?? "(none in its log)";
        const { budget, windowMs } = restarts.policy;
        this.opts.onEvent?.(
          `${spec.name} died (${why}) after ${budget} restarts within ${Math.round(windowMs / 60_000)} min; not restarting. Its last error: ${lastError} (log: ${log})`,
        );
        this.opts.onGiveUp?.(spec.name, lastError, log, false);
        return;
      }
      this.opts.onEvent?.(`${spec.name} died (${why}); restarting in ${(pause / 1000).toFixed(1)} s (log: ${log})`);
      setTimeout(() => {
        if (!this.#stopping) this.#spawn(spec, restarts);
      }, pause);
    });
  }

  /** per service: the last error it wrote (errorOfLine) */
  readonly #lastError = new Map<string, string>();

  /** Sends a signal to a service's current process (the chaos tests' SIGKILL). */
  kill(name: string, signal: NodeJS.Signals = "SIGKILL"): number {
    const r = this.#running.get(name);
    if (!r) throw new Error(`no service ${name}; services: ${[...this.#running.keys()].join(", ")}`);
    r.proc.kill(signal);
    return r.proc.pid;
  }

  /** The process id of a service's current process. */
  pid(name: string): number {
    const r = this.#running.get(name);
    if (!r) throw new Error(`no service ${name}; services: ${[...this.#running.keys()].join(", ")}`);
    return r.proc.pid;
  }

  /** A service's restarts within the policy's window. */
  restarts(name: string): number {
    return this.#running.get(name)?.restarts.recent ?? 0;
  }

  /**
   * Stops every service (SIGTERM, then SIGKILL after stopGraceMs), then NATS. Idempotent; `now`
   * (a second Ctrl-C) kills what still runs at once, also during a stop already under way.
   */
  stop(now = false): Promise<void> {
    if (now) for (const r of this.#running.values()) r.proc.kill("SIGKILL");
    this.#stopping ??= this.#stop();
    return this.#stopping;
  }

  async #stop(): Promise<void> {
    const procs = [...this.#running.values()].map((r) => r.proc);
    for (const p of procs) p.kill("SIGTERM");
    const deadline = setTimeout(() => procs.forEach((p) => p.kill("SIGKILL")), stopGraceMs);
    await Promise.all(procs.map((p) => p.exited));
    clearTimeout(deadline);
    // the services' last lines are in the pipes still: copy them before the files close (a pipe
    // that some leftover child of a service holds open is not waited for)
    await orAfter(Promise.all([...this.#running.values()].map((r) => r.pumped.catch(() => {}))), stopGraceMs, null);
    await Promise.all([...this.#logs.values()].map((s) => new Promise<void>((resolve) => s.end(resolve))));
    await this.#nats.stop();
    if (this.tempNatsDir !== null) rmSync(this.tempNatsDir, { recursive: true, force: true });
  }

  [Symbol.asyncDispose](): Promise<void> {
    return this.stop();
  }
}

/** A rank's index among the ranks its host label names (it picks the GPU there). */
function localRank(hosts: readonly string[], rank: number): number {
  return hosts.slice(0, rank).filter((h) => h === hosts[rank]).length;
}
