// TLS to NATS on a real nats-server that verifies its clients (certificates made with openssl):
// a client with the right CA and its own certificate connects and is served, a service process
// too; no TLS, a wrong CA, no client certificate, one of another CA or a missing file is refused
// within seconds with an error that says which, not retried for minutes.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { MeshClient } from "../../sdk/client.ts";
import { startNatsServer } from "../../services/runtime/mesh/nats-server.ts";
import { NatsAccessError, NatsBus, type NatsTls } from "../../services/runtime/mesh/nats.ts";
import { spawnService, waitFor } from "../helpers/mesh.ts";

const dir = mkdtempSync(join(tmpdir(), "mt-tls-"));
let server: Awaited<ReturnType<typeof startNatsServer>>;

function openssl(...args: string[]): void {
  const p = Bun.spawnSync(["openssl", ...args], { cwd: dir, stdout: "pipe", stderr: "pipe" });
  if (p.exitCode !== 0) throw new Error(`openssl ${args.join(" ")}: ${p.stderr.toString()}`);
}

/** `openssl req` with a new 2048-bit RSA key, <name>.key, for the subject /CN=<name>. */
function newKeyRequest(name: string, ...args: string[]): void {
  openssl("req", ...args, "-newkey", "rsa:2048", "-nodes", "-keyout", `${name}.key`, "-subj", `/CN=${name}`);
}

/** A CA: <name>.pem and <name>.key. */
function makeCa(name: string): void {
  newKeyRequest(name, "-x509", "-out", `${name}.pem`, "-days", "2");
}

/** A certificate of `ca` for 127.0.0.1 and localhost: <name>.pem and <name>.key. */
function makeCert(name: string, ca: string): void {
  writeFileSync(join(dir, `${name}.ext`), "subjectAltName=IP:127.0.0.1,DNS:localhost\n");
  newKeyRequest(name, "-out", `${name}.csr`);
  openssl(
    "x509",
    "-req",
    "-in",
    `${name}.csr`,
    "-CA",
    `${ca}.pem`,
    "-CAkey",
    `${ca}.key`,
    "-CAcreateserial",
    "-out",
    `${name}.pem`,
    "-days",
    "2",
    "-extfile",
    `${name}.ext`,
  );
}

const file = (name: string) => join(dir, name);
const client: NatsTls = { caFile: file("ca.pem"), certFile: file("client.pem"), keyFile: file("client.key") };

beforeAll(async () => {
  makeCa("ca");
  makeCa("other-ca");
  makeCert("server", "ca");
  makeCert("client", "ca");
  makeCert("stranger", "other-ca");
  server = await startNatsServer({
    tls: { certFile: file("server.pem"), keyFile: file("server.key"), caFile: file("ca.pem"), verify: true },
  });
});
afterAll(async () => {
  await server?.[Symbol.asyncDispose]();
  rmSync(dir, { recursive: true, force: true });
});

const connect = (tls: NatsTls | undefined, url = server.url) =>
  NatsBus.connect({
    url,
    name: "tls-test",
    connectRetryMsMax: 30_000,
    connectBackoffMsMax: 500,
    ...(tls === undefined ? {} : { tls }),
  });

/** Refused with NatsAccessError whose message matches `why`, well before the 30 s of retries. */
async function expectRefused(tls: NatsTls | undefined, why: RegExp, url = server.url): Promise<void> {
  const t0 = performance.now();
  const e = await connect(tls, url).then(
    async (bus) => {
      await bus.close();
      return null;
    },
    (err: unknown) => err,
  );
  expect(e).toBeInstanceOf(NatsAccessError);
  expect((e as Error).message).toMatch(why);
  expect(performance.now() - t0).toBeLessThan(10_000);
}

describe("TLS to NATS", () => {
  test("the server's URL is tls://; a client with the CA and its certificate is served", async () => {
    expect(server.url).toStartWith("tls://127.0.0.1:");
    const a = await connect(client);
    const b = await connect(client);
    try {
      a.handle("t.echo", (data) => data);
      await a.nc.flush();
      expect(new TextDecoder().decode(await b.request("t.echo", new TextEncoder().encode("over tls"), 5_000))).toBe(
        "over tls",
      );
      expect(a.nc.info?.tls_required).toBe(true);
    } finally {
      await a.close();
      await b.close();
    }
  });

  test("the SDK connects with MT_TLS_* files and reads the mesh's job store", async () => {
    await using c = await MeshClient.connect(server.url, { connectRetryMsMax: 5_000, tls: client });
    expect(await c.list()).toEqual([]);
  });

  test("a service process connects with MT_TLS_CA, MT_TLS_CERT and MT_TLS_KEY and registers", async () => {
    await using svc = spawnService("services/data-loader/main.ts", [], {
      MT_NATS_URL: server.url,
      MT_TLS_CA: client.caFile!,
      MT_TLS_CERT: client.certFile!,
      MT_TLS_KEY: client.keyFile!,
    });
    await using c = await MeshClient.connect(server.url, { connectRetryMsMax: 5_000, tls: client });
    await waitFor("the data-loader to register over TLS", async () => (await c.members()).dataLoaders === 1, 20_000);
    expect(svc.proc.exitCode, svc.log()).toBeNull();
  });

  test("the CLI takes --tls-ca, --tls-cert and --tls-key; without them it is refused in one line", () => {
    const cli = (...args: string[]) =>
      Bun.spawnSync([process.execPath, join(import.meta.dir, "..", "..", "sdk", "cli", "main.ts"), ...args], {
        stdout: "pipe",
        stderr: "pipe",
        env: { ...process.env, MT_TLS_CA: "" },
      });
    const ok = cli(
      "status",
      "--nats-url",
      server.url,
      "--tls-ca",
      client.caFile!,
      "--tls-cert",
      client.certFile!,
      "--tls-key",
      client.keyFile!,
    );
    expect(ok.exitCode, ok.stderr.toString()).toBe(0);
    const refused = cli("status", "--nats-url", server.url);
    expect(refused.exitCode).not.toBe(0);
    expect(refused.stderr.toString().trim().split("\n")).toHaveLength(1);
    expect(refused.stderr.toString()).toMatch(/refused this client/);
  }, 60_000);

  test("refused within seconds (not after minutes of retries), saying why: no TLS, another CA, no client certificate, a certificate of another CA, a missing file", async () => {
    await expectRefused(undefined, /requires TLS|tls/i, server.url.replace("tls://", "nats://"));
    await expectRefused(
      { caFile: file("other-ca.pem"), certFile: client.certFile!, keyFile: client.keyFile! },
      /refused this client.*CA/s,
    );
    await expectRefused({ caFile: client.caFile! }, /refused this client.*presents none: set MT_TLS_CERT/s);
    await expectRefused(
      { caFile: client.caFile!, certFile: file("stranger.pem"), keyFile: file("stranger.key") },
      /refused this client.*stranger\.pem/s,
    );
    await expectRefused({ caFile: file("nope.pem") }, /the TLS ca file .*nope\.pem does not exist/);
  });
});
