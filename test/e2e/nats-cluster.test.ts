// The mesh on a three-server NATS cluster (deploy/nats-cluster/ is the same for a real
// deployment): three real nats-server processes routed to each other, JetStream's job store
// (KV buckets mt-jobs and mt-job-records) kept on all three (replicas 3). The services of one
// BSP job connect to different servers; the server that leads JetStream, and that some of the
// services are connected to, is SIGKILLed mid-run and not restarted. Its services fail over to
// the other two, the streams elect new leaders among the survivors, and the job finishes Done
// with every step applied exactly once (each chunk's version in the final snapshot counts the
// updates applied to it: one per step under BSP); every service then follows the job store again
// and a second job runs. Beside it: a request lost with a server fails at once, the buckets'
// replicas (MT_KV_REPLICAS), and the CLI given the cluster's URLs.
import { afterAll, describe, expect, test } from "bun:test";
import { type JetStreamManager, jetstreamManager } from "@nats-io/jetstream";
import { join } from "node:path";
import { JobState } from "../../schemas/messages/job.ts";
import { MeshClient } from "../../sdk/client.ts";
import { watchJob } from "../../sdk/watch.ts";
import { planHere } from "../../services/data-loader/loader.ts";
import { ConfigError } from "../../ffi/errors.ts";
import { DeadlineError } from "../../services/runtime/mesh/errors.ts";
import { JobStore, jobSpecsFollowedAgain, jobsBucket, recordsBucket } from "../../services/runtime/job/ledger.ts";
import { kvReplicasFromEnv, openBucket } from "../../services/runtime/mesh/kv-bucket.ts";
import { NatsBus } from "../../services/runtime/mesh/nats.ts";
import { freePort, type NatsServer, startNatsServer } from "../../services/runtime/mesh/nats-server.ts";
import { finalChunkVersions } from "../helpers/jobs.ts";
import { atRank0Step, mlpJob } from "../helpers/mesh-jobs.ts";
import { clientBus, removeTempDirs, type ServiceProcess, spawnService, tempDir, waitFor } from "../helpers/mesh.ts";

afterAll(removeTempDirs);

const clusterSize = 3;

interface Member {
  name: string;
  server: NatsServer;
  monitorPort: number;
}

/** What a server's /jsz says of JetStream's meta group. */
interface Jsz {
  meta_cluster?: { leader?: string; cluster_size?: number };
}

/** A server's HTTP monitoring endpoint, as JSON. */
async function monitor<T>(m: Member, path: string): Promise<T> {
  return (await (await fetch(`http://127.0.0.1:${m.monitorPort}${path}`)).json()) as T;
}

/** Three servers of cluster "mt" on loopback, each routed to the other two, each with its own store. */
async function startCluster(): Promise<Member[] & AsyncDisposable> {
  // the route and monitor ports are free when picked, but another process may take one before
  // its server binds it: start all three again on new ports then
  for (let attempt = 1; ; attempt++) {
    const ports = await Promise.all(Array.from({ length: 2 * clusterSize }, freePort));
    const routePorts = ports.slice(0, clusterSize);
    const monitorPorts = ports.slice(clusterSize);
    const started = await Promise.allSettled(
      routePorts.map(async (port, i) => {
        const name = `nats-${i}`;
        const routes = routePorts.filter((_, j) => j !== i).map((p) => `nats-route://127.0.0.1:${p}`);
        const server = await startNatsServer({
          cluster: { name: "mt", serverName: name, port, routes },
          monitorPort: monitorPorts[i]!,
        });
        return { name, server, monitorPort: monitorPorts[i]! };
      }),
    );
    const members = started.flatMap((r) => (r.status === "fulfilled" ? [r.value] : []));
    const stopAll = async () => void (await Promise.all(members.map((m) => m.server.stop())));
    const failed = started.find((r) => r.status === "rejected");
    if (failed === undefined) return Object.assign(members, { [Symbol.asyncDispose]: stopAll });
    await stopAll();
    const portLost = /address already in use/.test(String(failed.reason));
    if (!portLost || attempt === 3) throw failed.reason;
  }
}

/** The JetStream meta leader, once every member agrees on one in a group of clusterSize. */
async function metaLeader(members: readonly Member[]): Promise<string> {
  let leader = "";
  await waitFor(
    "the JetStream meta group to elect a leader all members know",
    async () => {
      const seen = await Promise.all(members.map((m) => monitor<Jsz>(m, "/jsz")));
      leader = seen[0]!.meta_cluster?.leader ?? "";
      return (
        leader !== "" &&
        seen.every((j) => j.meta_cluster?.leader === leader && j.meta_cluster.cluster_size === clusterSize)
      );
    },
    30_000,
  );
  return leader;
}

const streamOf = (bucket: string) => `KV_${bucket}`;

/** A stream's leader and followers, once it has a leader and its followers are current. */
async function placement(
  jsm: JetStreamManager,
  stream: string,
): Promise<{ leader: string; replicas: number; peers: string[] }> {
  let out = { leader: "", replicas: 0, peers: [] as string[] };
  await waitFor(`stream ${stream} to have a leader and current followers`, async () => {
    const si = await jsm.streams.info(stream);
    const followers = si.cluster?.replicas ?? [];
    out = {
      leader: si.cluster?.leader ?? "",
      replicas: si.config.num_replicas,
      peers: [si.cluster?.leader ?? "", ...followers.map((r) => r.name)].sort(),
    };
    return out.leader !== "" && followers.every((r) => r.current);
  });
  return out;
}

/**
 * Best effort: asks the stream's leader to step down until `want` leads it (each election picks
 * one of the others at random), so that the kill below also takes the job store's leader.
 */
async function leadStream(bus: NatsBus, jsm: JetStreamManager, stream: string, want: string): Promise<boolean> {
  for (let attempt = 0; attempt < 8; attempt++) {
    const { leader } = await placement(jsm, stream);
    if (leader === want) return true;
    await bus.nc.request(`$JS.API.STREAM.LEADER.STEPDOWN.${stream}`, new Uint8Array(0), { timeout: 5_000 });
    await waitFor(`stream ${stream} to elect a leader other than ${leader}`, async () => {
      const now = (await jsm.streams.info(stream)).cluster?.leader ?? "";
      return now !== "" && now !== leader;
    });
  }
  return false;
}

/** The connection names (service names) a server holds now. */
async function connectionNames(m: Member): Promise<string[]> {
  const connz = await monitor<{ connections?: { name?: string }[] }>(m, "/connz?limit=1024");
  return (connz.connections ?? []).map((c) => c.name ?? "").sort();
}

/** A URL list with `home` first, then the other members (where a client fails over to). */
const urlsFrom = (members: readonly Member[], home: Member) =>
  [home, ...members.filter((m) => m !== home)].map((m) => m.server.url).join(",");

/** How long the job may take, kill included (it takes seconds when all is well). */
const watchMsMax = 80_000;

describe("a three-server NATS cluster", () => {
  test("the job store is replicated 3 times; the JetStream leader a trainer and a shard are connected to is SIGKILLed mid-run, and the job finishes Done with every step applied once", async () => {
    await using members = await startCluster();
    const victimName = await metaLeader(members);
    const victim = members.find((m) => m.name === victimName)!;
    const [a, b] = members.filter((m) => m !== victim) as [Member, Member];

    // the job store, made here with 3 replicas before anything else opens it
    const admin = await NatsBus.connect({
      url: urlsFrom(members, a),
      name: "test-admin",
      connectRetryMsMax: 10_000,
      connectBackoffMsMax: 500,
    });
    await JobStore.open(admin, { replicas: 3 });
    const jsm = await jetstreamManager(admin.nc);
    for (const bucket of [jobsBucket, recordsBucket]) {
      const p = await placement(jsm, streamOf(bucket));
      expect({ bucket, replicas: p.replicas, peers: p.peers }).toEqual({
        bucket,
        replicas: 3,
        peers: members.map((m) => m.name).sort(),
      });
    }
    const ledRecords = await leadStream(admin, jsm, streamOf(recordsBucket), victimName);
    console.log(
      `victim ${victimName}: JetStream meta leader${ledRecords ? ", leader of the job records' stream" : ""}`,
    );

    // trainer 0 and shard 0 on the victim; the rest on the other two; MT_KV_REPLICAS as a deployment sets it
    const dir = tempDir("mt-natscluster-");
    const env = (home: Member) => ({
      MT_NATS_URL: urlsFrom(members, home),
      MT_KV_REPLICAS: "3",
      MT_METRICS_PORT: "-1",
      OMP_NUM_THREADS: "1",
    });
    const services: ServiceProcess[] = [
      spawnService("services/trainer/main.ts", [], { ...env(victim), MT_RANK: "0" }),
      spawnService("services/parameter-server/main.ts", [], { ...env(victim), MT_SHARD: "0" }),
      spawnService("services/trainer/main.ts", [], { ...env(a), MT_RANK: "1" }),
      spawnService("services/data-loader/main.ts", [], env(a)),
      spawnService("services/parameter-server/main.ts", [], { ...env(b), MT_SHARD: "1" }),
      spawnService("services/checkpoint/main.ts", [], { ...env(b), MT_DIR: join(dir, "jobs") }),
    ];
    try {
      await using client = await MeshClient.connect(urlsFrom(members, a), { connectRetryMsMax: 10_000 });
      const cfg = mlpJob({ job: "default.natscluster", maxSteps: 120, checkpointEvery: 50, evalEvery: 0 });
      const total = planHere(cfg).totalSteps;
      await client.submit(cfg, { membersWaitMs: 60_000 });
      expect(await connectionNames(victim)).toEqual(["parameter-server", "trainer"]);

      const kill = atRank0Step(40, () => process.kill(victim.server.pid, "SIGKILL"));
      const r = await watchJob(client, cfg.job, {
        quiet: true,
        // inside the test's own limit: a job that stalls fails here, with the services' logs below
        signal: AbortSignal.timeout(watchMsMax),
        onEvent: kill.onEvent,
      });
      expect(kill.step).toBeGreaterThanOrEqual(40);
      expect(await victim.server.exited).not.toBe(0);
      expect(r.record.state, r.record.reason).toBe(JobState.Done);

      // the victim's services failed over to the survivors (none of them died), where all six are now
      expect(services.map((s) => s.proc.exitCode)).toEqual(services.map(() => null));
      const survivors = [...(await connectionNames(a)), ...(await connectionNames(b))].filter(
        (n) => !n.startsWith("test-") && n !== "meshtrain-sdk",
      );
      expect(survivors.sort()).toEqual([
        "checkpoint",
        "data-loader",
        "parameter-server",
        "parameter-server",
        "trainer",
        "trainer",
      ]);

      // under BSP each step updates every chunk once: the final snapshot's versions count the steps applied
      const versions = [...finalChunkVersions(r.record).values()].flat();
      expect(versions.length).toBeGreaterThan(0);
      expect(new Set(versions)).toEqual(new Set([total]));

      // every service follows the job specs again (a watch whose consumer sat on the victim is
      // started anew: JetStream places new consumers again once it has given up the victim, which
      // takes 2.9's servers some 20 s), and a next job runs
      for (const svc of services)
        await waitFor(
          "every service to follow the job specs again",
          () => svc.log().includes(jobSpecsFollowedAgain),
          60_000,
        );
      const next = mlpJob({ job: "default.natscluster-after", maxSteps: 10, checkpointEvery: 5, evalEvery: 0 });
      await client.submit(next, { membersWaitMs: 60_000 });
      const after = await watchJob(client, next.job, { quiet: true, signal: AbortSignal.timeout(watchMsMax) });
      expect({ state: after.record.state, reason: after.record.reason }).toEqual({ state: JobState.Done, reason: "" });
    } catch (e) {
      // what each service last said: the one that stalled or died is the lead
      for (const s of services) console.log(`--- ${s.proc.pid}\n${s.log().trim().split("\n").slice(-15).join("\n")}`);
      throw e;
    } finally {
      for (const s of services) await s[Symbol.asyncDispose]();
      await admin.close();
    }
  }, 120_000);

  test("a request whose answerer sits behind a server that dies fails at once (not at its timeout) saying so; the caller's retry is answered", async () => {
    await using members = await startCluster();
    const victim = members[0]!;
    const a = members[1]!;
    const connect = (home: Member, name: string) =>
      NatsBus.connect({ url: urlsFrom(members, home), name, connectRetryMsMax: 10_000, connectBackoffMsMax: 500 });
    const answerer = await connect(victim, "test-answerer");
    const caller = await connect(a, "test-caller");
    try {
      // answers only once the caller has given up on the first request: an answer sent from the
      // answerer's next server could otherwise beat the news of the lost server to the caller
      let received = () => {};
      const arrived = new Promise<void>((resolve) => (received = resolve));
      let first: Promise<unknown> = Promise.resolve();
      answerer.handle("t.slow", async (data) => {
        received();
        await first;
        return data;
      });
      answerer.handle("t.ping", (data) => data);
      await answerer.nc.flush();
      // the answerer's interest has crossed the route to the caller's server (sent in order after t.slow's)
      await waitFor(
        "the caller to reach the answerer",
        async () => (await caller.request("t.ping", new Uint8Array([0]), 1_000)).length === 1,
      );
      first = caller.request("t.slow", new Uint8Array([1]), 60_000).catch((e: unknown) => e);
      await arrived;
      // the answerer's client reconnects at once only when it last connected more than 250 ms
      // ago (reconnectTimeWait), as on a loaded machine: then its notice that it reconnected
      // races the news of the lost server to the caller, every run
      await Bun.sleep(300);
      process.kill(victim.server.pid, "SIGKILL");
      const e = await first;
      expect(e).toBeInstanceOf(DeadlineError);
      expect((e as Error).message).toMatch(
        /^a server of the NATS cluster \(127\.0\.0\.1:\d+\) left while waiting for the answer on t\.slow; retry$/,
      );
      let answer: Uint8Array | null = null;
      await waitFor("the retried request to be answered", async () => {
        answer = await caller.request("t.slow", new Uint8Array([2]), 5_000);
        return true;
      });
      expect([...answer!]).toEqual([2]);
    } finally {
      await caller.close();
      await answerer.close();
    }
  }, 60_000);

  test("MT_KV_REPLICAS: the job store opens on a fresh cluster; a bucket made with fewer replicas is raised to it, never lowered; a value outside 1..5 is refused", async () => {
    await using members = await startCluster();
    const bus = await NatsBus.connect({
      url: urlsFrom(members, members[0]!),
      name: "test-replicas",
      connectRetryMsMax: 10_000,
      connectBackoffMsMax: 500,
    });
    try {
      // at once on a fresh cluster: opening the job store waits out JetStream's first election
      await JobStore.open(bus, { replicas: 3 });
      const jsm = await jetstreamManager(bus.nc);
      const replicas = async () => (await jsm.streams.info(streamOf("mt-raise"))).config.num_replicas;
      await openBucket(bus.nc, "mt-raise", { replicas: 1 });
      expect(await replicas()).toBe(1);
      await openBucket(bus.nc, "mt-raise", { replicas: 3 });
      expect(await replicas()).toBe(3);
      await openBucket(bus.nc, "mt-raise", { replicas: 1 });
      expect(await replicas()).toBe(3);
    } finally {
      await bus.close();
    }
    expect(kvReplicasFromEnv({})).toBe(1);
    expect(kvReplicasFromEnv({ MT_KV_REPLICAS: "3" })).toBe(3);
    for (const bad of ["0", "6", "2.5", "three"])
      expect(() => kvReplicasFromEnv({ MT_KV_REPLICAS: bad })).toThrow(ConfigError);
  }, 120_000);

  test("the CLI takes the cluster's URLs in --nats-url: with the first server dead it reaches the job store through the next", async () => {
    await using members = await startCluster();
    const leader = await metaLeader(members);
    const bus = await NatsBus.connect({
      url: urlsFrom(members, members[0]!),
      name: "test-store",
      connectRetryMsMax: 10_000,
      connectBackoffMsMax: 500,
    });
    await JobStore.open(bus, { replicas: 3 }).finally(() => bus.close());
    // not the JetStream leader: this is about connecting, not about elections
    const dead = members.find((m) => m.name !== leader)!;
    process.kill(dead.server.pid, "SIGKILL");
    await dead.server.exited;
    // the dead server may have led a bucket's stream: the survivors elect another leader first
    // (seconds, more on a loaded machine), so that the CLI's wait below is about connecting
    const live = await NatsBus.connect({
      url: urlsFrom(members, dead),
      name: "test-settled",
      connectRetryMsMax: 10_000,
      connectBackoffMsMax: 500,
    });
    try {
      await waitFor(
        "the job store to answer without the dead server",
        async () => (await (await JobStore.open(live, { replicas: 3 })).allRecords(), true),
        90_000,
      );
    } finally {
      await live.close();
    }
    const cli = Bun.spawnSync(
      [
        process.execPath,
        join(import.meta.dir, "..", "..", "sdk", "cli", "main.ts"),
        "status",
        "--nats-url",
        urlsFrom(members, dead),
      ],
      {
        stdout: "pipe",
        stderr: "pipe",
        env: { ...process.env, MT_KV_REPLICAS: "3", MT_NATS_NKEY: "" },
      },
    );
    expect(cli.exitCode, cli.stderr.toString()).toBe(0);
  }, 150_000);

  test("replicas 3 on a single server is refused with a ConfigError that names MT_KV_REPLICAS", async () => {
    await using server = await startNatsServer();
    await using bus = await clientBus(server.url);
    const e = await JobStore.open(bus, { replicas: 3 }).catch((err: unknown) => err);
    expect(e).toBeInstanceOf(ConfigError);
    expect((e as Error).message).toMatch(
      /mt-jobs cannot have 3 replicas here .*MT_KV_REPLICAS must not exceed the JetStream servers/,
    );
  });
});
