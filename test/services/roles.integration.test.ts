// NATS roles on a real nats-server: the credentials `makeCredentials` writes (owner-only files),
// an anonymous or unknown client refused at connect, each role refused what it may not do with a
// clear error on its side, and whole jobs on a local mesh whose every service runs as its own
// role, with a server log free of permission violations.
import { afterAll, describe, expect, test } from "bun:test";
import { readFileSync, statSync, writeFileSync } from "node:fs";
import { join, relative } from "node:path";
import { createUser } from "@nats-io/nkeys";
import { JobState } from "../../schemas/messages/job.ts";
import { type JobConfig, jobDefaults, parseJobConfig } from "../../services/runtime/job/config.ts";
import { recoverAsker, subjects } from "../../services/runtime/job/subjects.ts";
import { recordsBucket, runningRecord } from "../../services/runtime/job/ledger.ts";
import { jetstreamManager } from "@nats-io/jetstream";
import { NatsAccessError, NatsBus } from "../../services/runtime/mesh/nats.ts";
import { startNatsServer } from "../../services/runtime/mesh/nats-server.ts";
import {
  clientUser,
  CredentialsError,
  makeCredentials,
  permissionsOf,
  roleUsers,
  type RoleName,
} from "../../services/runtime/job/roles.ts";
import { NoRespondersError, refusedAs } from "../../services/runtime/mesh/errors.ts";
import { ncclIdBytes, NcclIdStore } from "../../services/runtime/job/nccl-id.ts";
import { encodeJobRequest } from "../../schemas/messages/job.ts";
import { MeshClient } from "../../sdk/client.ts";
import { LocalMesh } from "../../sdk/local-mesh.ts";
import { watchJob } from "../../sdk/watch.ts";
import { runCli } from "../helpers/cli.ts";
import { removeTempDirs, tempDir } from "../helpers/mesh.ts";

afterAll(removeTempDirs);

const mode = (path: string) => statSync(path).mode & 0o777;

/** What the server says of a subscription by `bus` to `subject` within 3 s ("no refusal" if nothing). */
const subscriptionError = (bus: NatsBus, subject: string): Promise<string> =>
  new Promise<string>((resolve) => {
    bus.nc.subscribe(subject, {
      callback: (err) => {
        if (err) resolve(err.message);
      },
    });
    setTimeout(() => resolve("no refusal"), 3_000);
  });

describe("credentials", () => {
  test("one seed per role, rank and shard, owner-only; a second run keeps the seeds; auth.conf names every user", () => {
    const dir = join(tempDir("mt-creds-"), "creds");
    const a = makeCredentials(dir, { trainers: 2, shards: 1 });
    expect(roleUsers({ trainers: 2, shards: 1 })).toEqual([
      "admin",
      "client-default",
      "data-loader",
      "checkpoint",
      "ps-0",
      "trainer-0",
      "trainer-1",
    ]);
    expect(mode(dir)).toBe(0o700);
    for (const user of roleUsers({ trainers: 2, shards: 1 })) {
      expect(mode(a.seedFile(user))).toBe(0o600);
      expect(readFileSync(a.seedFile(user), "utf8")).toStartWith("SU");
    }
    expect(mode(join(dir, "auth.conf"))).toBe(0o600);
    expect(a.authorization.match(/nkey: "U[A-Z0-9]{55}"/g)?.length).toBe(7);
    const seed = readFileSync(a.seedFile("trainer-1"), "utf8");
    const b = makeCredentials(dir, { trainers: 3, shards: 1 });
    expect(readFileSync(b.seedFile("trainer-1"), "utf8")).toBe(seed);
    expect(b.authorization.match(/nkey: /g)?.length).toBe(8);
  });

  test("meshtrain creds writes them for a deployment (deploy/k8s makes Secrets of them); a nats-server that includes its auth.conf takes its users", async () => {
    const parent = tempDir("mt-creds-cli-");
    const dir = join(parent, "k8s-creds");
    const run = runCli(parent, "creds", "--dir", dir, "--trainers", "2", "--shards", "1");
    expect(run.code).toBe(0);
    expect(run.out).toContain("wrote 7 users' nkey seeds");
    expect(mode(join(dir, "trainer-1.nk"))).toBe(0o600);
    // nats-server resolves an include from its config's folder
    const natsDir = tempDir("mt-creds-nats-");
    await using server = await startNatsServer({
      dir: natsDir,
      authorization: `include "${relative(natsDir, join(dir, "auth.conf"))}"`,
    });
    const bus = await NatsBus.connect({
      url: server.url,
      name: "t",
      connectRetryMsMax: 5_000,
      connectBackoffMsMax: 200,
      nkeyFile: join(dir, "trainer-1.nk"),
    });
    await bus.close();
    const bad = runCli(parent, "creds", "--dir", dir, "--shards", "99");
    expect(bad.code).toBe(1);
    expect(bad.err).toContain("--shards");
  });

  test("sizes out of bounds and unknown roles are refused by name", () => {
    expect(() => roleUsers({ trainers: 0, shards: 1 })).toThrow(CredentialsError);
    expect(() => roleUsers({ trainers: 1, shards: 65 })).toThrow("shards must be 0..64");
    expect(() => permissionsOf("ps-x" as RoleName)).toThrow("no role ps-x");
  });

  test("a trainer's pushes and pulls name its own rank; only admin may restore, resize or answer everything", () => {
    const t1 = permissionsOf("trainer-1");
    expect(t1.publish).toContain("mt.*.*.ps.*.push.1");
    expect(t1.publish.some((s) => /push\.(0|\*|>)$/.test(s))).toBe(false);
    expect(t1.subscribe).toContain("mt.*.*.coll.1.*");
    // collective pieces: to any rank, from its own only
    expect(t1.publish).toContain("mt.*.*.coll.*.1");
    expect(t1.publish.some((s) => /coll\.[^.]+\.(0|\*|>)$/.test(s) || /coll\.(\*|>)$/.test(s))).toBe(false);
    for (const user of ["client-default", "trainer-0", "ps-0", "data-loader", "checkpoint"] as const) {
      const p = permissionsOf(user).publish;
      expect(p.some((s) => /ckpt\.(restore|resize|>)$/.test(s) || s === ">")).toBe(false);
    }
  });
});

describe("a nats-server with the roles", async () => {
  const dir = tempDir("mt-roles-");
  const creds = makeCredentials(join(dir, "creds"), { trainers: 2, shards: 2, clients: ["default", "alice", "bob"] });
  const server = await startNatsServer({ authorization: creds.authorization });
  afterAll(() => server.stop());
  const as = (user: RoleName | string) =>
    NatsBus.connect({
      url: server.url,
      name: `test-${user}`,
      connectRetryMsMax: 5_000,
      connectBackoffMsMax: 200,
      nkeyFile: user.includes("/") ? user : creds.seedFile(user as RoleName),
    });
  const job = "default.j";
  const req = encodeJobRequest({ job, step: 0, tag: "" });
  /** what a request as `bus` gets: "refused", "allowed" (no one serves it here), or the error */
  const outcome = async (bus: NatsBus, subject: string): Promise<string> => {
    try {
      await bus.request(subject, req, 2_000);
      return "answered";
    } catch (e) {
      if (e instanceof NatsAccessError) {
        expect(e.message).toContain(`may not send ${subject}`);
        return "refused";
      }
      if (e instanceof NoRespondersError) return "allowed";
      return `${(e as Error).name}: ${(e as Error).message}`;
    }
  };

  test("an anonymous client is refused at connect, within seconds, saying credentials are needed", async () => {
    const started = Date.now();
    const err = await NatsBus.connect({
      url: server.url,
      name: "anon",
      connectRetryMsMax: 5_000,
      connectBackoffMsMax: 200,
    }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(NatsAccessError);
    expect((err as Error).message).toContain("requires credentials");
    expect(Date.now() - started).toBeLessThan(5_000);
  });

  test("a user the server does not know, and a file that is no seed, are refused with their file named", async () => {
    const stranger = join(dir, "stranger.nk");
    writeFileSync(stranger, new TextDecoder().decode(createUser().getSeed()), { mode: 0o600 });
    const err = await as(stranger).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(NatsAccessError);
    expect((err as Error).message).toContain(`does not know the user of ${stranger}`);
    const junk = join(dir, "junk.nk");
    writeFileSync(junk, "not a seed\n");
    expect(await as(junk).catch((e: unknown) => e)).toBeInstanceOf(NatsAccessError);
    expect(((await as(join(dir, "missing.nk")).catch((e: unknown) => e)) as Error).message).toContain("does not exist");
  });

  test("a trainer pushes and pulls only as its own rank, and cannot load a shard or restore a job", async () => {
    const t1 = await as("trainer-1");
    try {
      expect(await outcome(t1, subjects.psPush(job, 0, 1))).toBe("allowed");
      expect(await outcome(t1, subjects.psPull(job, 1, 1))).toBe("allowed");
      expect(await outcome(t1, subjects.coll(job, 0, 1))).toBe("allowed");
      // a piece claiming to come from another rank: refused by the server before any rank sees it
      expect(await outcome(t1, subjects.coll(job, 0, 0))).toBe("refused");
      expect(await outcome(t1, subjects.coll(job, 2, 0))).toBe("refused");
      // a recovery only as itself: the asker is the subject's last token
      expect(await outcome(t1, subjects.ckptRecover(job, recoverAsker.trainer(1)))).toBe("allowed");
      expect(await outcome(t1, subjects.ckptRecover(job, recoverAsker.trainer(0)))).toBe("refused");
      expect(await outcome(t1, subjects.ckptRecover(job, recoverAsker.shard(1)))).toBe("refused");
      expect(await outcome(t1, subjects.psPush(job, 0, 0))).toBe("refused");
      expect(await outcome(t1, subjects.psPull(job, 1, 0))).toBe("refused");
      expect(await outcome(t1, subjects.psLoad(job, 0))).toBe("refused");
      expect(await outcome(t1, subjects.psState(job, 0))).toBe("refused");
      expect(await outcome(t1, subjects.ckptRestore(job))).toBe("refused");
      expect(await outcome(t1, subjects.ckptResize(job))).toBe("refused");
      expect(await outcome(t1, subjects.replicaLoad(job, 0))).toBe("refused");
    } finally {
      await t1.close();
    }
  });

  test("NCCL ids: every trainer reads them, and writes only those of the communicators it leads", async () => {
    const [t0, t1] = [await as("trainer-0"), await as("trainer-1")];
    try {
      const [s0, s1] = [await NcclIdStore.open(t0), await NcclIdStore.open(t1)];
      const id = new Uint8Array(ncclIdBytes).fill(7);
      const key = { job, leader: 0, group: "dp-1", generation: 3 };
      await s0.publish(key, id, 2);
      expect(await s1.wait(key, 2, 5_000)).toEqual(id);
      // trainer-1 leads a communicator of its own (a host's, in a hierarchy), not rank 0's
      await s1.publish({ ...key, leader: 1 }, id, 2);
      const refused = await s1.publish({ ...key, generation: 4 }, id, 2).then(
        () => "published",
        (e: Error) => e.message,
      );
      expect(refused).not.toBe("published");
    } finally {
      await t0.close();
      await t1.close();
    }
  });

  test("a client submits, watches and snapshots, and cannot restore, resize, load, push or join the collective", async () => {
    const c = await as(clientUser());
    try {
      expect(await outcome(c, subjects.ckptList(job))).toBe("allowed");
      expect(await outcome(c, subjects.planJob)).toBe("allowed");
      for (const s of [
        subjects.ckptRestore(job),
        subjects.ckptResize(job),
        subjects.ckptRecover(job, recoverAsker.trainer(0)),
        subjects.ckptSave(job),
        subjects.psLoad(job, 0),
        subjects.psPush(job, 0, 0),
        subjects.psPull(job, 0, 0),
        subjects.coll(job, 1, 0),
        subjects.replicaState(job),
        subjects.dataNext(job),
      ]) {
        expect([s, await outcome(c, s)]).toEqual([s, "refused"]);
      }
    } finally {
      await c.close();
    }
    // the SDK as the client role: the job store (JetStream KV) is open to it
    await using sdk = await MeshClient.connect(server.url, { nkeyFile: creds.seedFile(clientUser()) });
    expect(await sdk.list()).toEqual([]);
  });

  test("no one but admin subscribes to another's subjects: a trainer to another rank's collective, anyone to the shared inboxes", async () => {
    const t1 = await as("trainer-1");
    try {
      for (const subject of [
        subjects.collTo(job, 0),
        subjects.coll(job, 0, 1),
        "_INBOX.>",
        subjects.psPush(job, 0, 0),
      ]) {
        expect(await subscriptionError(t1, subject)).toContain("Permissions Violation for Subscription");
      }
    } finally {
      await t1.close();
    }
  });

  test.each([
    [
      "ps-0",
      [subjects.psNorm(job, 1), subjects.ckptRecover(job, recoverAsker.shard(0))],
      [
        subjects.ckptRecover(job, recoverAsker.shard(1)),
        subjects.ckptRecover(job, recoverAsker.trainer(0)),
        subjects.psPush(job, 1, 0),
        subjects.psLoad(job, 1),
        subjects.ckptRestore(job),
        subjects.dataNext(job),
        subjects.coll(job, 0, 1),
      ],
    ],
    [
      "data-loader",
      [],
      [
        subjects.psPush(job, 0, 0),
        subjects.psPull(job, 0, 0),
        subjects.ckptRestore(job),
        subjects.ckptSave(job),
        subjects.coll(job, 0, 1),
      ],
    ],
    [
      "checkpoint",
      [subjects.psState(job, 0), subjects.psLoad(job, 1), subjects.replicaLoad(job, 1), subjects.planJob],
      [subjects.psPush(job, 0, 0), subjects.psPull(job, 0, 0), subjects.coll(job, 0, 1), subjects.dataNext(job)],
    ],
  ] as const)("%s sends what its service needs and is refused the rest", async (user, allowed, refused) => {
    const bus = await as(user);
    try {
      for (const s of allowed) expect([s, await outcome(bus, s)]).toEqual([s, "allowed"]);
      for (const s of refused) expect([s, await outcome(bus, s)]).toEqual([s, "refused"]);
    } finally {
      await bus.close();
    }
  });

  test("a shard serves only its own subjects: ps-0 may not take shard 1's pushes", async () => {
    const ps0 = await as("ps-0");
    try {
      expect(await subscriptionError(ps0, "mt.*.*.ps.1.>")).toContain("Permissions Violation for Subscription");
    } finally {
      await ps0.close();
    }
  });

  test("a client acts on its owner's jobs only: another owner's record cannot be written, read, cancelled, listed or watched; admin sees every owner's", async () => {
    await using alice = await MeshClient.connect(server.url, { nkeyFile: creds.seedFile(clientUser("alice")) });
    await using bob = await MeshClient.connect(server.url, { nkeyFile: creds.seedFile(clientUser("bob")) });
    await using admin = await MeshClient.connect(server.url, { nkeyFile: creds.seedFile("admin") });
    // the owner comes from the seed file's name; a bare name is the owner's job
    expect([alice.owner, bob.owner, admin.owner]).toEqual(["alice", "bob", "default"]);
    expect(alice.job("mnist")).toBe("alice.mnist");
    expect(await alice.jobs.createRecord(runningRecord("alice.mnist", "{}", 1))).toBe(true);
    expect(await bob.jobs.createRecord(runningRecord("bob.gpt", "{}", 1))).toBe(true);
    expect((await alice.record("mnist")).job).toBe("alice.mnist");
    const refused = async (what: string, op: () => Promise<unknown>) => {
      const e = await op().then(
        () => null,
        (err: unknown) => err,
      );
      expect([what, (e as Error | null)?.name]).toEqual([what, "NatsAccessError"]);
      expect((e as Error).message).toMatch(/permission denied/);
    };
    await refused("write another owner's record", () => alice.jobs.createRecord(runningRecord("bob.mnist", "{}", 1)));
    await refused("overwrite another owner's spec", () =>
      alice.jobs.putSpec({ job: "bob.gpt", trainers: 1, shards: 1, sync: 0, staleness: 0, configJson: "{}" }),
    );
    await refused("read another owner's record", () => alice.record("bob.gpt"));
    await refused("cancel another owner's job", () => alice.cancel("bob.gpt"));
    await refused("list every owner's jobs", () => alice.list({ every: true }));
    await refused("ask for another owner's snapshots", () => alice.checkpoints("bob.gpt"));
    await refused("watch another owner's events", async () => {
      for await (const _ of alice.events("bob.gpt", AbortSignal.timeout(5_000))) break;
    });
    // nor through JetStream's API by hand: a consumer of every key, a get that names the key in its payload
    const jsm = await jetstreamManager(alice.bus.nc);
    await refused("consume every owner's records", async () => {
      try {
        await jsm.consumers.add(`KV_${recordsBucket}`, { name: "sneak", filter_subject: `$KV.${recordsBucket}.>` });
      } catch (e) {
        throw refusedAs(e, "consume every owner's records");
      }
    });
    await refused("get another owner's record by sequence", async () => {
      try {
        await jsm.streams.getMessage(`KV_${recordsBucket}`, { last_by_subj: `$KV.${recordsBucket}.bob.gpt` });
      } catch (e) {
        throw refusedAs(e, "get another owner's record");
      }
    });
    expect((await alice.list()).map((r) => r.job)).toEqual(["alice.mnist"]);
    expect((await bob.list()).map((r) => r.job)).toEqual(["bob.gpt"]);
    expect((await bob.record("gpt")).state).toBe(JobState.Running);
    // admin reads and cancels anyone's
    expect((await admin.list({ every: true })).map((r) => r.job).sort()).toEqual(["alice.mnist", "bob.gpt"]);
    expect((await admin.cancel("bob.gpt")).state).toBe(JobState.Cancelled);
  });

  test("admin may restore (here: allowed, and no one serves it)", async () => {
    const admin = await as("admin");
    try {
      expect(await outcome(admin, subjects.ckptRestore(job))).toBe("allowed");
      expect(await outcome(admin, subjects.psLoad(job, 1))).toBe("allowed");
    } finally {
      await admin.close();
    }
  });
});

const config = (over: Partial<JobConfig>): JobConfig =>
  parseJobConfig({
    ...jobDefaults,
    model: { kind: "mlp", widths: [784, 64, 10], dropout: 0 },
    warmupSteps: 5,
    chunkBytes: 16 << 10,
    evalEvery: 0,
    ...over,
  });

test("a local mesh runs with the roles by default: BSP and all-reduce jobs submitted by the client role finish, and the server logged no violation", async () => {
  const dir = tempDir("mt-roles-mesh-");
  await using mesh = await LocalMesh.start({ jobsDir: join(dir, "jobs"), logDir: join(dir, "logs") });
  expect(mesh.credentials).not.toBeNull();
  await using client = await MeshClient.connect(mesh.url, mesh.auth(clientUser()));
  const refusals: Promise<unknown>[] = [];
  for (const cfg of [
    config({ job: "roles-bsp", maxSteps: 30, checkpointEvery: 10 }),
    config({ job: "roles-ar", sync: "allreduce", maxSteps: 30, checkpointEvery: 10 }),
  ]) {
    await client.submit(cfg, { membersWaitMs: 60_000 });
    let asked = false;
    const r = await watchJob(client, cfg.job, {
      quiet: true,
      onEvent: (e) => {
        if (!asked && e.step >= 12) {
          asked = true;
          void client.saveCheckpoint(cfg.job).catch(() => {});
          // the client cannot rewind a running job: the SDK says why
          refusals.push(client.restore(cfg.job).catch((err: unknown) => err));
        }
      },
    });
    expect([cfg.job, r.record.state]).toEqual([cfg.job, JobState.Done]);
  }
  for (const err of await Promise.all(refusals)) {
    expect(err).toBeInstanceOf(NatsAccessError);
    expect((err as Error).message).toContain("may not send mt.default.roles-");
    expect((err as Error).message).toContain("restore and resize are admin's: connect as the admin user");
  }
  const log = readFileSync(join(dir, "logs", "nats-server.log"), "utf8");
  // the only ones: the client's restores above, refused
  expect(
    log
      .split("\n")
      .filter(
        (l) =>
          /Violation/.test(l) && !/Publish Violation .* Subject "mt\.default\.roles-(bsp|ar)\.ckpt\.restore"/.test(l),
      ),
  ).toEqual([]);
  // an anonymous client cannot even connect
  expect(await MeshClient.connect(mesh.url, { connectRetryMsMax: 2_000 }).catch((e: unknown) => e)).toBeInstanceOf(
    NatsAccessError,
  );
}, 120_000);
