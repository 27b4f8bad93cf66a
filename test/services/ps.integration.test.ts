// Parameter-server shard processes on a real nats-server: discovery, a BSP step end to end,
// bad input on every subject (each answered with a typed error, the shard keeps serving),
// graceful drain, and an unreachable server.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { Svcm } from "@nats-io/services";
import { Builder } from "flatbuffers";
import { finishBytes, schemaVersion, WireFormatError } from "../../schemas/codec.ts";
import {
  chunkF32,
  decodePullReply,
  decodePushReply,
  decodeShardState,
  decodeShardStats,
  encodePullRequest,
  encodePushRequest,
  encodeShardState,
  shardStateChecksum,
  withChecksum,
  f32Chunk,
} from "../../schemas/messages/parameter-server.ts";
import { encodeJobRequest, SyncPolicy } from "../../schemas/messages/job.ts";
import { PullRequest as PullRequestT } from "../../schemas/wire.ts";
import { buildLayout } from "../../services/runtime/job/layout.ts";
import { BadRequestError, NotReadyError, UnknownJobError } from "../../services/runtime/mesh/errors.ts";
import { type JobConfig, jobDefaults } from "../../services/runtime/job/config.ts";
import { subjects } from "../../services/runtime/job/subjects.ts";
import { configExitCode } from "../../services/runtime/mesh/service.ts";
import { JobStore } from "../../services/runtime/job/ledger.ts";
import { initialParameters } from "../../services/runtime/job/model.ts";
import { freePort } from "../../services/runtime/mesh/nats-server.ts";
import { expectRejected } from "../helpers/errors.ts";
import { imagePlan, specOf } from "../helpers/jobs.ts";
import { clientBus, type ServiceProcess, spawnService, startNatsServer, waitFor } from "../helpers/mesh.ts";

const cfg: JobConfig = {
  ...jobDefaults,
  job: "default.psjob",
  model: { kind: "mlp", widths: [784, 16, 10], dropout: 0 },
  trainers: 2,
  shards: 2,
  sync: "bsp",
  optimizer: { kind: "sgd", momentum: 0, nesterov: false, weightDecay: 0 },
  lr: 1,
  schedule: "constant",
  warmupSteps: 0,
  chunkBytes: 4096,
};
const payloadBytesMax = 1 << 20;
const init = initialParameters(cfg, imagePlan);
const layout = buildLayout(cfg.job, init.values.length, init.decayElems, cfg.chunkBytes, cfg.shards);
const timeout = 10_000;

let server: Awaited<ReturnType<typeof startNatsServer>>;
let shards: ServiceProcess[];
let loader: ServiceProcess;
let bus: Awaited<ReturnType<typeof clientBus>>;

beforeAll(async () => {
  server = await startNatsServer();
  shards = [0, 1].map((k) =>
    spawnService("services/parameter-server/main.ts", [
      "--nats-url",
      server.url,
      "--shard",
      String(k),
      "--payload-bytes-max",
      String(payloadBytesMax),
    ]),
  );
  // the shards take the job's step count from the data-loader's plan
  loader = spawnService("services/data-loader/main.ts", [
    "--nats-url",
    server.url,
    "--payload-bytes-max",
    String(payloadBytesMax),
  ]);
  bus = await clientBus(server.url);
  const store = await JobStore.open(bus);
  await store.putSpec(specOf(cfg));
  for (const k of [0, 1]) {
    await waitFor(
      `shard ${k} to open the job`,
      async () =>
        decodeShardStats(
          await bus.request(subjects.psStats(cfg.job, k), encodeJobRequest({ job: cfg.job, step: 0, tag: "" }), 1000),
          1 << 20,
        ).chunks > 0,
    );
  }
}, 60_000);

afterAll(async () => {
  await bus?.close();
  for (const s of [...(shards ?? []), ...(loader ? [loader] : [])]) await s[Symbol.asyncDispose]();
  await server?.stop();
});

const pushFor = (k: number, trainer: number, step: number, g: Float32Array) =>
  encodePushRequest({
    job: cfg.job,
    trainer,
    step,
    chunks: layout.byShard[k]!.map((id) => {
      const c = layout.chunks[id]!;
      return f32Chunk(id, g.slice(c.offset, c.offset + c.count));
    }),
  });

async function pullVector(trainer: number, step: number): Promise<Float32Array> {
  const out = new Float32Array(init.values.length);
  await Promise.all(
    [0, 1].map(async (k) => {
      const reply = await bus.request(
        subjects.psPull(cfg.job, k, trainer),
        encodePullRequest({ job: cfg.job, trainer, step, ids: Uint32Array.from(layout.byShard[k]!) }),
        timeout,
      );
      for (const c of decodePullReply(reply, 64 << 20).chunks) out.set(chunkF32(c), layout.chunks[c.id]!.offset);
    }),
  );
  return out;
}

test("both shards answer $SRV.PING and $SRV.STATS as parameter-server instances", async () => {
  const client = new Svcm(bus.nc as unknown as ConstructorParameters<typeof Svcm>[0]).client();
  const found: string[] = [];
  for await (const p of await client.ping("parameter-server")) found.push(p.metadata?.shard ?? "?");
  expect(found.sort()).toEqual(["0", "1"]);
  const endpoints: string[] = [];
  for await (const s of await client.stats("parameter-server"))
    endpoints.push(...(s.endpoints ?? []).map((e) => e.subject));
  expect(endpoints).toContain("mt.*.*.ps.0.push.*");
  expect(endpoints).toContain("mt.*.*.ps.1.pull.*");
});

test("a BSP step across two shard processes: both pushes averaged into one update, pulls wait for it", async () => {
  expect(await pullVector(0, 0)).toEqual(init.values);
  const g0 = init.values.map((_, i) => Math.sin(i)),
    g1 = init.values.map((_, i) => Math.cos(i));
  for (const k of [0, 1])
    decodePushReply(await bus.request(subjects.psPush(cfg.job, k, 0), pushFor(k, 0, 0, g0), timeout), 1024);
  const waiting = pullVector(1, 1); // waits for trainer 1's push
  for (const k of [0, 1]) {
    const r = decodePushReply(await bus.request(subjects.psPush(cfg.job, k, 1), pushFor(k, 1, 0, g1), timeout), 1024);
    expect(r.updates).toBe(layout.byShard[k]!.length);
  }
  const after = await waiting;
  const expected = init.values.map((p, i) => p - (g0[i]! + g1[i]!) / 2);
  let maxErr = 0;
  for (let i = 0; i < after.length; i++) maxErr = Math.max(maxErr, Math.abs(after[i]! - expected[i]!));
  expect(maxErr).toBeLessThan(1e-6);
  // a retried push (same trainer, step, chunks) is applied once
  const dup = decodePushReply(await bus.request(subjects.psPush(cfg.job, 0, 1), pushFor(0, 1, 0, g1), timeout), 1024);
  expect(dup).toEqual({ accepted: 0, duplicates: layout.byShard[0]!.length, updates: 0 });
  expect(await pullVector(0, 1)).toEqual(after);
});

describe("bad input on every subject gets an error reply, and the shard keeps serving", () => {
  const job = cfg.job;
  const stale = (() => {
    const b = new Builder(64);
    const j = b.createString(job);
    return finishBytes(b, PullRequestT.createPullRequest(b, schemaVersion + 1, j, 0, 0n, 0, 0), "MTPL");
  })();
  const garbage = crypto.getRandomValues(new Uint8Array(300));
  /** Step 0's push without chunks, and its pull of `ids`, by `trainer`: the rows change who sends them where. */
  const emptyPush = (trainer: number, of = job) => encodePushRequest({ job: of, trainer, step: 0, chunks: [] });
  const pull = (trainer: number, ids = new Uint32Array(0)) => encodePullRequest({ job, trainer, step: 0, ids });
  const jobRequest = (step: number, tag: string) => encodeJobRequest({ job, step, tag });
  const cases: [string, string, Uint8Array, abstract new (...a: never[]) => Error, string][] = [
    [
      "push: truncated bytes",
      subjects.psPush(job, 0, 0),
      pushFor(0, 0, 1, init.values).subarray(0, 20),
      WireFormatError,
      "",
    ],
    ["push: garbage", subjects.psPush(job, 0, 0), garbage, WireFormatError, "file identifier"],
    [
      "push: a pull request (wrong file_identifier)",
      subjects.psPush(job, 0, 0),
      pull(0, new Uint32Array(1)),
      WireFormatError,
      'expected "MTPS"',
    ],
    [
      "push: oversized",
      subjects.psPush(job, 0, 0),
      encodePushRequest({ job, trainer: 0, step: 1, chunks: [f32Chunk(0, new Float32Array(300_000))] }),
      WireFormatError,
      "exceeds the limit",
    ],
    [
      "push: wrong shape",
      subjects.psPush(job, 0, 0),
      encodePushRequest({ job, trainer: 0, step: 1, chunks: [f32Chunk(layout.byShard[0]![0]!, new Float32Array(5))] }),
      BadRequestError,
      "5 elements",
    ],
    [
      "push: unknown job",
      subjects.psPush("default.nojob", 0, 0),
      emptyPush(0, "default.nojob"),
      UnknownJobError,
      "nojob",
    ],
    [
      "push: job differs from subject",
      subjects.psPush(job, 0, 0),
      emptyPush(0, "default.other"),
      BadRequestError,
      "other",
    ],
    [
      "push: a trainer's message on another trainer's subject",
      subjects.psPush(job, 0, 1),
      emptyPush(0),
      BadRequestError,
      "trainer 0 sent on trainer 1's subject",
    ],
    [
      "pull: a trainer's message on another trainer's subject",
      subjects.psPull(job, 1, 0),
      pull(1),
      BadRequestError,
      "trainer 1 sent on trainer 0's subject",
    ],
    ["pull: wrong version", subjects.psPull(job, 1, 0), stale, WireFormatError, "schema version 2"],
    [
      "pull: chunk of the other shard",
      subjects.psPull(job, 1, 0),
      pull(0, Uint32Array.of(layout.byShard[0]![0]!)),
      BadRequestError,
      "not owned",
    ],
    ["pull: trainer outside the job", subjects.psPull(job, 1, 9), pull(9), BadRequestError, "trainer 9"],
    ["stats: garbage", subjects.psStats(job, 0), garbage, WireFormatError, ""],
    [
      "stats: unknown job",
      subjects.psStats("default.ghost", 1),
      encodeJobRequest({ job: "default.ghost", step: 0, tag: "" }),
      UnknownJobError,
      "ghost",
    ],
    ["state: truncated", subjects.psState(job, 0), new Uint8Array(3), WireFormatError, "shorter"],
    [
      "load: snapshot of the wrong shard",
      subjects.psLoad(job, 0),
      encodeShardState(withChecksum({ job, shard: 1, updates: 0, optimizerSteps: 0, step: 0, chunks: [] })),
      BadRequestError,
      "shard 1",
    ],
    [
      "load: a state changed after it was cut (checksum)",
      subjects.psLoad(job, 0),
      encodeShardState({
        ...withChecksum({ job, shard: 0, updates: 0, optimizerSteps: 0, step: 0, chunks: [] }),
        step: 1,
      }),
      BadRequestError,
      "checksum",
    ],
    [
      "load: a step past the job's end",
      subjects.psLoad(job, 0),
      encodeShardState(withChecksum({ job, shard: 0, updates: 0, optimizerSteps: 0, step: 2 ** 53 - 1, chunks: [] })),
      BadRequestError,
      "runs steps 0 to",
    ],
    ["state: a part not named", subjects.psState(job, 0), jobRequest(0, ""), BadRequestError, "part <n>"],
    [
      "state: a later part before part 0",
      subjects.psState(job, 0),
      jobRequest(77, "part 1"),
      BadRequestError,
      "cut it first",
    ],
    ["load: wrong identifier", subjects.psLoad(job, 0), jobRequest(0, ""), WireFormatError, "MTSS"],
  ];
  test.each(cases)("%s", async (_, subject, data, cls, fragment) => {
    await expectRejected(() => bus.request(subject, data, timeout), cls, fragment);
    // still serving
    const stats = decodeShardStats(await bus.request(subjects.psStats(job, 0), jobRequest(0, ""), timeout), 1 << 20);
    expect(stats.job).toBe(job);
  });
});

test("state then load round-trips a shard's snapshot through the wire", async () => {
  const req = encodeJobRequest({ job: cfg.job, step: 0, tag: "part 0" });
  const state = decodeShardState(await bus.request(subjects.psState(cfg.job, 1), req, timeout), 64 << 20);
  expect(state.chunks.map((c) => c.id).sort((a, b) => a - b)).toEqual(layout.byShard[1]!);
  expect([state.parts, state.part, state.checksum === shardStateChecksum(state)]).toEqual([1, 0, true]);
  await bus.request(subjects.psLoad(cfg.job, 1), encodeShardState(state), timeout);
  const again = decodeShardState(await bus.request(subjects.psState(cfg.job, 1), req, timeout), 64 << 20);
  expect(again).toEqual(state);
});

test("a shard waiting for its restore refuses a state request (its state is its fresh initialization, not the job's), and answers once restored", async () => {
  // the checkpoint service's part, played here: it holds the shard's recovery until the test lets it go
  const resumed: JobConfig = { ...cfg, job: "default.psjob-resumed" };
  const release = Promise.withResolvers<void>();
  const asked: string[] = [];
  const recover = bus.handle(`mt.${resumed.job}.ckpt.recover.*`, async (_, subject) => {
    asked.push(subject);
    await release.promise;
    return new Uint8Array(0);
  });
  await bus.nc.flush(); // the handler is in place before the shard opens the job
  const store = await JobStore.open(bus);
  await store.putSpec(specOf(resumed));
  const cut = encodeJobRequest({ job: resumed.job, step: 0, tag: "cut" });
  await waitFor("shard 0 to open the job and ask for its restore", () =>
    asked.includes(`mt.${resumed.job}.ckpt.recover.shard-0`),
  );
  await expectRejected(
    () => bus.request(subjects.psState(resumed.job, 0), cut, timeout),
    NotReadyError,
    `shard 0 waits for job "${resumed.job}" to be restored`,
  );
  release.resolve();
  await waitFor("shard 0's cut once restored", async () =>
    bus.request(subjects.psState(resumed.job, 0), cut, timeout).then(
      (bytes) => decodeShardState(bytes, 1 << 20).shard === 0,
      () => false,
    ),
  );
  recover.unsubscribe();
});

test("SIGTERM drains and exits 0", async () => {
  const server2 = await startNatsServer();
  const p = spawnService("services/parameter-server/main.ts", ["--nats-url", server2.url, "--shard", "0"]);
  await waitFor("the shard to be ready", () => p.log().includes("ready"));
  p.proc.kill("SIGTERM");
  expect(await p.exited).toBe(0);
  expect(p.log()).toContain("stopped");
  await server2.stop();
}, 30_000);

test("an unreachable NATS gives one clear error naming the URL and how to start a server, then retries", async () => {
  const url = `nats://127.0.0.1:${await freePort()}`;
  const p = spawnService("services/parameter-server/main.ts", [
    "--nats-url",
    url,
    "--shard",
    "0",
    "--connect-retry-ms-max",
    "1500",
  ]);
  expect(await p.exited).toBe(1);
  const log = p.log();
  expect(log.match(/is unreachable; retrying/g)?.length).toBe(1);
  expect(log).toContain(url);
  expect(log).toContain("nats-server");
}, 30_000);

test("invalid configuration is reported with the key and where it came from", async () => {
  const p = spawnService("services/parameter-server/main.ts", ["--shard", "-1"], { MT_NATS_URL: "http://wrong" });
  expect(await p.exited).toBe(configExitCode); // not restarted: no restart fixes it
  expect(p.log()).toContain("shard (from --shard)");
  expect(p.log()).toContain("natsUrl (from $MT_NATS_URL)");
}, 30_000);

test("a NATS server without JetStream is one clear error naming the fix", async () => {
  await using plain = await startNatsServer({ jetstream: false });
  const p = spawnService("services/parameter-server/main.ts", ["--nats-url", plain.url, "--shard", "0"]);
  expect(await p.exited).toBe(1);
  expect(p.log()).toContain("runs without JetStream");
  expect(p.log()).toContain("nats-server -js");
}, 30_000);
