// The mesh spread over the hosts of a bed (testbed/hosts.ts), as a deployment would spread it
// over machines: a NATS cluster of three servers on three hosts (JetStream's job store kept on
// all three), the data-loader and the checkpoint service on one host, the parameter-server
// shards on others, and the trainers two per host, each with its host's label (MT_HOST) and its
// slot on it (MT_LOCAL_RANK). Every service connects to its host's NATS server first (or, on a
// host without one, to the next host's), with the others as its failover. An open mesh (no NATS
// users): what crosses hosts is the subject here, not access.
import { createWriteStream, mkdirSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { readTopology, scaleTopology } from "../sdk/local-mesh.ts";
import { type NatsServer, startNatsServer } from "../services/runtime/mesh/nats-server.ts";
import type { MeshClient } from "../sdk/client.ts";
import { subjects } from "../services/runtime/job/subjects.ts";
import { NoRespondersError } from "../services/runtime/mesh/errors.ts";
import { type HostBed, stopProcesses } from "./hosts.ts";

export interface HostMeshOptions {
  /** hosts of the NATS cluster's servers (three: a majority survives one host lost) */
  natsHosts: readonly number[];
  /** the host of the data-loader and the checkpoint service */
  serviceHost: number;
  /** the host of each parameter-server shard (none: an all-reduce mesh) */
  shardHosts: readonly number[];
  /** the hosts of the trainers, `trainersPerHost` on each, ranks in order */
  trainerHosts: readonly number[];
  trainersPerHost: number;
  /** the host label each trainer reports: its own host's (default), or host 0's for every
   *  trainer ("one"), which makes an all-reduce flat: a ring over every rank, host or not */
  labels?: "host" | "one";
  /** the NATS servers' pings of their routes and clients (nats-server.ts NatsClusterOptions.ping;
   *  default nats-server's): a busy route to a member cut off fails sooner, by the hosts' TCP
   *  (testbed/hosts.ts tcpRetries); pings find a quiet one */
  natsPing?: { intervalS: number; max: number };
  /** false: the NATS cluster alone (a bench that runs processes of its own on the hosts) */
  services?: boolean;
  /** MT_* settings for every service */
  env?: Record<string, string>;
  /** where each service's log goes (one file per service); default: a temporary folder */
  logDir?: string;
}

export interface MeshProcess {
  name: string;
  host: number;
  argv: readonly string[];
  env: Record<string, string>;
  proc: Bun.Subprocess;
  log: string;
}

/** Each NATS server's monitoring port, on its host's address. */
const monitorPort = 8222;

/** The label a trainer of host i reports (MT_HOST). */
export const hostLabel = (i: number): string => `host-${i}`;

export class HostMesh implements AsyncDisposable {
  private constructor(
    readonly bed: HostBed,
    readonly nats: { host: number; server: NatsServer }[],
    readonly processes: MeshProcess[],
    readonly jobsDir: string,
    readonly logDir: string,
    readonly tempDir: string,
  ) {}

  /** The cluster's client URLs, host `first`'s server first (a client's home server). */
  urls(first?: number): string {
    const ordered = [...this.nats].sort((a, b) => Number(b.host === first) - Number(a.host === first));
    return ordered.map((n) => n.server.url).join(",");
  }

  /** The cluster's client URLs for a process on `host`: its own server first, or, on a host
   *  without one, the next host's that has one. */
  homeUrls(host: number): string {
    const hosts = this.nats.map((n) => n.host);
    return this.urls(hosts.includes(host) ? host : (hosts.find((h) => h > host) ?? hosts[0]!));
  }

  static async start(bed: HostBed, o: HostMeshOptions): Promise<HostMesh> {
    const tempDir = mkdtempSync(join(tmpdir(), "mt-hostmesh-"));
    const logDir = o.logDir ?? join(tempDir, "logs");
    const jobsDir = join(tempDir, "jobs");
    mkdirSync(logDir, { recursive: true });
    mkdirSync(jobsDir, { recursive: true });
    // every host has its own ports: the cluster's usual ones do
    const nats = await Promise.all(
      o.natsHosts.map(async (h, i) => ({
        host: h,
        server: await startNatsServer({
          host: bed.address(h),
          port: 4222,
          monitorPort,
          dir: join(tempDir, `nats-${i}`),
          logFile: join(logDir, `nats-${i}.log`),
          wrap: (argv) => bed.argv(h, argv),
          cluster: {
            name: "mt",
            serverName: `nats-${i}`,
            port: 6222,
            routes: o.natsHosts.filter((x) => x !== h).map((x) => `nats-route://${bed.address(x)}:6222`),
            ...(o.natsPing === undefined ? {} : { ping: o.natsPing }),
          },
        }),
      })),
    );
    const mesh = new HostMesh(bed, nats, [], jobsDir, logDir, tempDir);
    const trainers = o.trainerHosts.length * o.trainersPerHost;
    const specs = o.services === false ? [] : scaleTopology(readTopology(), { trainers, shards: o.shardHosts.length });
    for (const spec of specs) {
      const rank = spec.env.MT_RANK === undefined ? null : Number(spec.env.MT_RANK);
      const shard = spec.env.MT_SHARD === undefined ? null : Number(spec.env.MT_SHARD);
      const host =
        rank !== null
          ? o.trainerHosts[Math.floor(rank / o.trainersPerHost)]!
          : shard !== null
            ? o.shardHosts[shard]!
            : o.serviceHost;
      const env: Record<string, string> = {
        ...(process.env as Record<string, string>),
        ...spec.env,
        MT_NATS_URL: mesh.homeUrls(host),
        MT_NATS_NKEY: "",
        MT_DIR: jobsDir,
        MT_KV_REPLICAS: String(Math.min(3, o.natsHosts.length)),
        MT_METRICS_PORT: "-1",
        OMP_NUM_THREADS: "1",
        ...o.env,
        // heartbeats say it: the job's watch names a host whose every process went quiet
        MT_HOST: hostLabel(host),
        ...(rank === null
          ? {}
          : o.labels === "one"
            ? { MT_HOST: hostLabel(0), MT_LOCAL_RANK: String(rank) }
            : { MT_HOST: hostLabel(host), MT_LOCAL_RANK: String(rank % o.trainersPerHost) }),
      };
      const log = join(logDir, `${spec.name}.log`);
      const p: MeshProcess = { name: spec.name, host, argv: spec.argv, env, log, proc: undefined as never };
      mesh.#spawn(p);
      mesh.processes.push(p);
    }
    return mesh;
  }

  /** Starts a service's process on its host, its output appended to its log. */
  #spawn(p: MeshProcess): void {
    const out = createWriteStream(p.log, { flags: "a" });
    p.proc = this.bed.spawn(p.host, p.argv, { env: p.env, stdin: "ignore", stdout: "pipe", stderr: "pipe" });
    for (const stream of [p.proc.stdout, p.proc.stderr] as ReadableStream<Uint8Array>[])
      void (async () => {
        for await (const chunk of stream) out.write(chunk);
      })();
  }

  /**
   * Kills a service ("trainer-2", "parameter-server-1") with SIGKILL and starts it again on its
   * host, as an orchestrator restarts a crashed one; resolves once the new process runs.
   */
  async restart(name: string): Promise<void> {
    const p = this.processes.find((x) => x.name === name);
    if (p === undefined)
      throw new Error(`no service ${name} in this mesh (${this.processes.map((x) => x.name).join(", ")})`);
    p.proc.kill("SIGKILL");
    await p.proc.exited;
    this.#spawn(p);
  }

  /** Waits until every service of the mesh has registered (discovery sees it), or fails after
   *  `timeoutMs` naming what is missing. It takes some 10 s; once in a full run of the suite on
   *  2 cores it took past 60 s (one trainer of four registered), so the wait is 120 s. */
  async untilUp(client: MeshClient, timeoutMs = 120_000): Promise<void> {
    const trainers = this.processes.filter((p) => p.name.startsWith("trainer")).length;
    const shards = this.processes.filter((p) => p.name.startsWith("parameter-server")).length;
    const deadline = Date.now() + timeoutMs;
    let seen = "nothing yet";
    for (;;) {
      try {
        const m = await client.members();
        seen = `${m.trainers.length}/${trainers} trainers, ${m.shards.length}/${shards} shards, ${m.dataLoaders} data-loaders, ${m.checkpoints} checkpoint services`;
        // registered is not yet serving: the data-loader and the checkpoint service add their
        // endpoints once the job store opens (JetStream's first election on a fresh cluster);
        // a request that is answered, even with an error, is served
        if (m.trainers.length === trainers && m.shards.length === shards && m.dataLoaders > 0 && m.checkpoints > 0) {
          const served = async (subject: string) =>
            await client.bus.request(subject, new Uint8Array(1), 5_000).then(
              () => true,
              (e: unknown) => !(e instanceof NoRespondersError),
            );
          if ((await served(subjects.planJob)) && (await served(subjects.ckptList("default.untilup")))) return;
          seen += ", the data-loader's or the checkpoint service's endpoints not yet served";
        }
      } catch (e) {
        seen = (e as Error).message;
      }
      if (Date.now() > deadline)
        throw new Error(`the mesh across hosts is not up after ${timeoutMs} ms: ${seen} (logs: ${this.logDir})`);
      await Bun.sleep(200);
    }
  }

  /**
   * Waits until every NATS server of the mesh routes to every other one and JetStream has a
   * meta leader again (after a partition healed: the routes form anew, the server that was cut
   * off catches up), or fails after `timeoutMs` saying what is missing. Reads each server's
   * monitoring endpoint (/routez, /jsz).
   */
  async untilClustered(timeoutMs = 60_000): Promise<void> {
    const deadline = Date.now() + timeoutMs;
    const want = this.nats.length - 1;
    let seen = "nothing yet";
    for (;;) {
      const states = await Promise.all(
        this.nats.map(async (n) => {
          const at = `http://${this.bed.address(n.host)}:${monitorPort}`;
          try {
            const get = async (path: string) =>
              (await (await fetch(`${at}${path}`, { signal: AbortSignal.timeout(2_000) })).json()) as Record<
                string,
                unknown
              >;
            const routes = new Set(((await get("/routez")).routes as { remote_id: string }[]).map((r) => r.remote_id));
            const leader = ((await get("/jsz")).meta_cluster as { leader?: string } | undefined)?.leader ?? "";
            return { host: n.host, routes: routes.size, leader };
          } catch (e) {
            return { host: n.host, routes: -1, leader: "", err: (e as Error).message };
          }
        }),
      );
      if (states.every((s) => s.routes === want && s.leader !== "")) return;
      seen = states.map((s) => `host ${s.host}: ${s.routes} routes, leader ${s.leader || "none"}`).join("; ");
      if (Date.now() > deadline)
        throw new Error(`the NATS cluster is not whole after ${timeoutMs} ms: ${seen} (logs: ${this.logDir})`);
      await Bun.sleep(250);
    }
  }

  /** Process ids of the services of host i (NATS included). */
  pidsOn(host: number): number[] {
    return [
      ...this.nats.filter((n) => n.host === host).map((n) => n.server.pid),
      ...this.processes.filter((p) => p.host === host && p.proc.exitCode === null).map((p) => p.proc.pid),
    ];
  }

  async [Symbol.asyncDispose](): Promise<void> {
    await stopProcesses(
      this.processes.map((p) => p.proc).filter((p) => p.exitCode === null),
      10_000,
    );
    await Promise.all(this.nats.map((n) => n.server.stop()));
    rmSync(this.tempDir, { recursive: true, force: true });
  }
}
