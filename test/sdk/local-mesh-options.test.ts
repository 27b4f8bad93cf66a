// LocalMesh.start's options, checked before anything starts: a count or a port that cannot be
// one, a folder that is a file, are ConfigErrors naming the option; a launch whose NATS server
// cannot start leaves no temporary store (with the users' nkey seeds) behind.
import { afterAll, expect, test } from "bun:test";
import { mkdtempSync, readdirSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { ConfigError, LocalMesh, MeshClient, type MeshOptions, MeshtrainError } from "../../sdk/index.ts";

const dir = mkdtempSync(join(tmpdir(), "meshtrain-localmesh-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));
const base: MeshOptions = { jobsDir: join(dir, "jobs"), logDir: join(dir, "logs") };

test.each([
  [{ trainers: 1.5 }, "LocalMesh: trainers is a count from 0 to 64, not 1.5"],
  [{ shards: -1 }, "LocalMesh: shards is a count from 0 to 64, not -1"],
  [{ port: 70_000 }, "LocalMesh: port is from 1 to 65535 (none: a free one), not 70000"],
  [{ jobsDir: join(dir, "a-file") }, `LocalMesh: jobsDir ${join(dir, "a-file")} is a file, not a folder`],
] as const)("%p is refused before anything starts", async (over, message) => {
  writeFileSync(join(dir, "a-file"), "");
  const e = (await LocalMesh.start({ ...base, ...over }).catch((x) => x)) as Error;
  expect(e).toBeInstanceOf(ConfigError);
  expect(e.message).toBe(message);
});

test("a NATS server that cannot start (its port taken) leaves no temporary store or seeds", async () => {
  using taken = Bun.listen({ hostname: "127.0.0.1", port: 0, socket: { data() {} } });
  const tmp = mkdtempSync(join(dir, "tmp-"));
  const was = process.env.TMPDIR;
  process.env.TMPDIR = tmp;
  try {
    const e = await LocalMesh.start({ ...base, port: taken.port }).catch((x) => x);
    expect(e).toBeInstanceOf(MeshtrainError);
    expect((e as Error).message).toContain(`port ${taken.port} is taken`);
  } finally {
    if (was === undefined) delete process.env.TMPDIR;
    else process.env.TMPDIR = was;
  }
  expect(readdirSync(tmp)).toEqual([]);
});

test("MeshClient.connect refuses a URL that cannot name a NATS server at once, as the CLI does", async () => {
  for (const url of ["", "not a url", "http://127.0.0.1:8222"]) {
    const e = (await MeshClient.connect(url).catch((x) => x)) as Error;
    expect(e, url).toBeInstanceOf(ConfigError);
    expect(e.message, url).toStartWith(`MeshClient.connect: the NATS URL ${JSON.stringify(url)}: `);
  }
});

test("a resize's sizes that cannot be counts are refused before anything is asked of the mesh", async () => {
  const client = Object.create(MeshClient.prototype) as MeshClient; // not connected: nothing is sent
  for (const [to, text] of [
    [{ trainers: -1 }, "a resize's trainers is a count from 1 to 64, not -1"],
    [{ trainers: 1.5 }, "a resize's trainers is a count from 1 to 64, not 1.5"],
    [{ shards: Number.NaN }, "a resize's shards is a count from 1 to 64, not NaN"],
  ] as const) {
    const e = (await client.resize("j", to).catch((x) => x)) as Error;
    expect(e).toBeInstanceOf(ConfigError);
    expect(e.message).toBe(text);
  }
});
