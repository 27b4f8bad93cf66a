// Bad input on every subject of the data-loader and checkpoint services, on a live mesh: each
// gets an error reply naming the problem, and the service answers the next good request.
// (The parameter-server's subjects: test/services/ps.integration.test.ts.)
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { Builder } from "flatbuffers";
import { finishBytes, schemaVersion, WireFormatError } from "../../schemas/codec.ts";
import { decodeBatch, decodeLoaderStats, encodeBatchRequest, Split } from "../../schemas/messages/data-loader.ts";
import { decodeCheckpointList, decodeManifest } from "../../schemas/messages/checkpoint.ts";
import { encodeJobRequest, EventKind } from "../../schemas/messages/job.ts";
import { encodePullRequest } from "../../schemas/messages/parameter-server.ts";
import { JobRequest as JobRequestT } from "../../schemas/wire.ts";
import {
  BadRequestError,
  CorruptDataError,
  NotReadyError,
  UnknownJobError,
} from "../../services/runtime/mesh/errors.ts";
import { jobDefaults, parseJobConfig } from "../../services/runtime/job/config.ts";
import { recoverAsker, subjects } from "../../services/runtime/job/subjects.ts";
import { MeshClient } from "../../sdk/client.ts";
import { LocalMesh } from "../../sdk/local-mesh.ts";
import { removeTempDirs, tempDir, waitFor } from "../helpers/mesh.ts";

const job = "default.badinput";
const payloadBytesMax = 1 << 20;
let mesh: LocalMesh;
let client: MeshClient;
let dir: string;

beforeAll(async () => {
  dir = tempDir("mt-bad-");
  // a mesh without trainers: the job opens on the loader, the shards and the checkpoint service
  // and stays still
  mesh = await LocalMesh.start({
    jobsDir: join(dir, "checkpoints"),
    logDir: join(dir, "logs"),
    trainers: 0,
    env: { MT_PAYLOAD_BYTES_MAX: String(payloadBytesMax) },
  });
  client = await MeshClient.connect(mesh.url, mesh.auth());
  await waitFor(
    "the checkpoint service",
    async () => (await client.checkpoints(job).catch((e: unknown) => e)) instanceof UnknownJobError,
  );
  await client.submit(
    parseJobConfig({
      ...jobDefaults,
      job,
      model: { kind: "mlp", widths: [784, 32, 10], dropout: 0 },
      chunkBytes: 16 << 10,
    }),
    {
      checkMembers: false,
    },
  );
  await waitFor("the loader and checkpoint service to open the job", async () => {
    await client.bus.request(subjects.ckptList(job), encodeJobRequest({ job, step: 0, tag: "" }), 1000);
    await client.bus.request(`mt.${job}.data.stats`, encodeJobRequest({ job, step: 0, tag: "" }), 1000);
    return (await client.status(job))!.shards.every((s) => "clocks" in s);
  });
}, 60_000);

afterAll(async () => {
  await client?.close();
  await mesh?.stop();
  removeTempDirs();
});

const wrongVersion = (() => {
  const b = new Builder(64);
  const j = b.createString(job),
    t = b.createString("");
  return finishBytes(b, JobRequestT.createJobRequest(b, schemaVersion + 7, j, 0n, t, 0), "MTJR");
})();
const garbage = crypto.getRandomValues(new Uint8Array(512));
const huge = new Uint8Array(payloadBytesMax + 1000);
huge.set(encodeJobRequest({ job, step: 0, tag: "" }));
const jr = (j = job) => encodeJobRequest({ job: j, step: 0, tag: "" });
const br = (over: object = {}) =>
  encodeBatchRequest({ job, rank: 0, split: Split.Train, credits: 2, step: 0, ...over });

type Cls = abstract new (...a: never[]) => Error;
const next = subjects.dataNext(job),
  dstats = `mt.${job}.data.stats`;
const save = subjects.ckptSave(job),
  list = subjects.ckptList(job),
  restore = subjects.ckptRestore(job);
const cases: [string, string, Uint8Array, Cls, string][] = [
  ["data.next: truncated", next, br().subarray(0, 6), WireFormatError, "shorter"],
  ["data.next: garbage", next, garbage, WireFormatError, "identifier"],
  [
    "data.next: wrong file_identifier",
    next,
    encodePullRequest({ job, trainer: 0, step: 0, ids: new Uint32Array(1) }),
    WireFormatError,
    "MTBQ",
  ],
  ["data.next: oversized", next, huge, WireFormatError, "exceeds the limit"],
  ["data.next: rank outside the job", next, br({ rank: 9 }), BadRequestError, "rank 9"],
  ["data.next: no validation split", next, br({ split: Split.Val }), BadRequestError, "validation"],
  [
    "data.next: unknown job",
    subjects.dataNext("default.nobody"),
    encodeBatchRequest({ job: "default.nobody", rank: 0, split: Split.Train, credits: 1, step: 0 }),
    UnknownJobError,
    "nobody",
  ],
  ["data.stats: wrong version", dstats, wrongVersion, WireFormatError, "schema version 8"],
  ["data.stats: job differs from subject", dstats, jr("other"), BadRequestError, "other"],
  ["ckpt.save: garbage", save, garbage, WireFormatError, ""],
  ["ckpt.save: wrong version", save, wrongVersion, WireFormatError, "schema version"],
  ["ckpt.save: unknown job", subjects.ckptSave("default.ghost"), jr("default.ghost"), UnknownJobError, "ghost"],
  [
    "ckpt.save: a step past the job's end",
    save,
    encodeJobRequest({ job, step: 2 ** 53 - 1, tag: "" }),
    BadRequestError,
    "runs steps 0 to",
  ],
  [
    "ckpt.save: a step the state is not at (BSP)",
    save,
    encodeJobRequest({ job, step: 3, tag: "" }),
    BadRequestError,
    "the state is at step 0",
  ],
  [
    "ckpt.restore: a 100 KB tag",
    restore,
    encodeJobRequest({ job, step: 0, tag: "x".repeat(100_000) }),
    WireFormatError,
    "tag of 100000 characters",
  ],
  ["ckpt.list: truncated", list, jr().subarray(0, 9), WireFormatError, ""],
  ["ckpt.list: oversized", list, huge, WireFormatError, "exceeds"],
  [
    "ckpt.restore: a snapshot that does not exist",
    restore,
    encodeJobRequest({ job, step: 0, tag: "step-000000777" }),
    BadRequestError, // not "retry": waiting does not make it
    "has no snapshot step-000000777; it has ",
  ],
  ["ckpt.restore: wrong file_identifier", restore, br(), WireFormatError, "MTJR"],
  [
    "ckpt.restore: a tag that is no snapshot id (it restored the newest snapshot)",
    restore,
    encodeJobRequest({ job, step: 0, tag: "not-a-step\r\n" }),
    BadRequestError,
    '"not-a-step\\r\\n" is not a snapshot id: one is step- and 9 digits',
  ],
  [
    "ckpt.restore: a service's recovery tag (recoveries have their own subject)",
    restore,
    encodeJobRequest({ job, step: 0, tag: "trainer 0 opened the job" }),
    BadRequestError,
    "is not a snapshot id",
  ],
  [
    "ckpt.recover: a service's ask naming a snapshot (rewinding is an operator's restore)",
    subjects.ckptRecover(job, recoverAsker.trainer(0)),
    encodeJobRequest({ job, step: 0, tag: "step-000000000" }),
    BadRequestError,
    "operator's restore",
  ],
  ["ckpt.recover: garbage", subjects.ckptRecover(job, recoverAsker.trainer(0)), garbage, WireFormatError, ""],
  [
    "ckpt.recover: a trainer of a parameter-server job (the shards hold the state)",
    subjects.ckptRecover(job, recoverAsker.trainer(1)),
    encodeJobRequest({ job, step: 0, tag: "trainer 1 opened the job" }),
    BadRequestError,
    "holds no state to recover",
  ],
  [
    "ckpt.recover: a shard whose tag names another shard",
    subjects.ckptRecover(job, recoverAsker.shard(0)),
    encodeJobRequest({ job, step: 0, tag: "shard 1 opened the job" }),
    BadRequestError,
    "shard 0 recovers when it opens the job",
  ],
  [
    "ckpt.recover: an asker the subject does not name",
    `${subjects.ckptRecover(job, "x")}`,
    encodeJobRequest({ job, step: 0, tag: "trainer 0 opened the job" }),
    BadRequestError,
    "ckpt.recover.trainer-<rank>",
  ],
];

describe("bad input on every loader and checkpoint subject gets an error reply; the service keeps serving", () => {
  test.each(cases)("%s", async (_, subject, data, cls, fragment) => {
    let error: unknown;
    try {
      await client.bus.request(subject, data, 10_000);
    } catch (e) {
      error = e;
    }
    expect(error).toBeInstanceOf(cls);
    expect((error as Error).message).toContain(fragment);
    const service = subject.split(".")[2];
    if (service === "data") {
      expect(decodeBatch(await client.bus.request(next, br({ step: 5 }), 10_000), payloadBytesMax).rows).toBe(128);
      expect(decodeLoaderStats(await client.bus.request(dstats, jr(), 10_000), 1 << 16).job).toBe(job);
    } else {
      expect(decodeCheckpointList(await client.bus.request(list, jr(), 10_000), 1 << 20).job).toBe(job);
    }
  });

  test("after all that, a save and a restore of the job work", async () => {
    const m = decodeManifest(
      await client.bus.request(save, encodeJobRequest({ job, step: 0, tag: "test" }), 30_000),
      1 << 20,
    );
    expect(m.files.map((f) => f.name)).toEqual(["ps-0-0.mtss", "ps-1-0.mtss"]);
    // a step's snapshot is written once: saving it again answers with the one there
    const again = decodeManifest(
      await client.bus.request(save, encodeJobRequest({ job, step: 0, tag: "again" }), 30_000),
      1 << 20,
    );
    expect([again.id, again.createdMs]).toEqual([m.id, m.createdMs]);
    const r = decodeManifest(await client.bus.request(restore, jr(), 30_000), 1 << 20);
    expect(r.id).toBe(m.id);
  });

  test("a flipped byte in a snapshot file is detected on restore and reported; the service keeps serving", async () => {
    const m = decodeManifest(
      await client.bus.request(save, encodeJobRequest({ job, step: 0, tag: "test" }), 30_000),
      1 << 20,
    );
    const path = join(dir, "checkpoints", job, m.id, "ps-1-0.mtss");
    const bytes = readFileSync(path);
    bytes[Math.floor(bytes.length / 2)]! ^= 0x10;
    writeFileSync(path, bytes);
    const reports: string[] = [];
    const events = client.events(job);
    const collect = (async () => {
      for await (const e of events) if (e.kind === EventKind.Log) reports.push(e.text);
    })();
    let error: unknown;
    try {
      await client.bus.request(restore, jr(), 30_000);
    } catch (e) {
      error = e;
    }
    // its only snapshot is corrupt: nothing to fall back to (the fallback itself: checkpoint-store.test.ts)
    expect(error).toBeInstanceOf(CorruptDataError);
    await waitFor("the corruption report", () => reports.length > 0, 5_000);
    expect(reports[0]).toContain(`${m.id}: ps-1-0.mtss fails its checksum`);
    await events.return?.();
    await collect;
    expect(decodeCheckpointList(await client.bus.request(list, jr(), 10_000), 1 << 20).items.map((x) => x.id)).toEqual([
      m.id,
    ]);
  });
});
