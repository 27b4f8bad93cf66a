// deploy/nats-cluster/: the three servers' configs pass the real nats-server's own check, name
// three distinct servers that all route to each other, and the compose overlay points every
// service of the base compose file at all three (a different home server first, so the services
// are spread), with MT_KV_REPLICAS=3. The cluster's behaviour itself (a server lost mid-job) is
// test/e2e/nats-cluster.test.ts, on servers the same settings are generated for.
import { afterAll, describe, expect, test } from "bun:test";
import { copyFileSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { parse } from "yaml";
import { composePath, readTopology } from "../../sdk/local-mesh.ts";
import { kvReplicasFromEnv } from "../../services/runtime/mesh/kv-bucket.ts";
import { natsServers } from "../../services/runtime/mesh/nats.ts";
import { natsServerBinary } from "../../services/runtime/mesh/nats-server.ts";
import { baseConfigSchema } from "../../services/runtime/mesh/service.ts";
import { makeCredentials } from "../../services/runtime/job/roles.ts";
import { removeTempDirs, tempDir } from "../helpers/mesh.ts";

afterAll(removeTempDirs);

const dir = join(import.meta.dir, "..", "..", "deploy", "nats-cluster");
const names = ["nats-0", "nats-1", "nats-2"];

describe("deploy/nats-cluster", () => {
  test.each(names)(
    "%s.conf is valid to nats-server -t (with the users `meshtrain creds` writes) and names its server",
    (name) => {
      // the configs as the compose overlay mounts them: next to the users' auth.conf
      const mounted = tempDir("mt-nats-cluster-conf-");
      for (const f of [`${name}.conf`, "cluster.conf"]) copyFileSync(join(dir, f), join(mounted, f));
      copyFileSync(
        join(makeCredentials(join(mounted, "creds"), { trainers: 2, shards: 2 }).dir, "auth.conf"),
        join(mounted, "auth.conf"),
      );
      const file = join(mounted, `${name}.conf`);
      const check = Bun.spawnSync([natsServerBinary(), "-c", file, "-t"], { stdout: "pipe", stderr: "pipe" });
      expect(check.exitCode, `${check.stdout}${check.stderr}`).toBe(0);
      expect(readFileSync(file, "utf8")).toMatch(new RegExp(`^server_name: ${name}$`, "m"));
    },
  );

  test("the shared config routes to every member, and keeps JetStream", () => {
    const text = readFileSync(join(dir, "cluster.conf"), "utf8");
    const routes = [...text.matchAll(/nats-route:\/\/([\w-]+):6222/g)].map((m) => m[1]);
    expect(routes).toEqual(names);
    expect(text).toMatch(/jetstream \{\s*store_dir: \/data\/jetstream/);
  });

  test("the compose overlay gives every service of the base file all three servers, a home server each, and MT_KV_REPLICAS=3", () => {
    const overlay = parse(readFileSync(join(dir, "docker-compose.yml"), "utf8"), { merge: true }) as {
      services: Record<string, { environment?: Record<string, string> }>;
    };
    const services = readTopology(composePath).map((s) => s.name);
    const homes = new Set<string>();
    for (const name of services) {
      const env = overlay.services[name]?.environment ?? {};
      const url = env.MT_NATS_URL ?? "";
      expect(baseConfigSchema.shape.natsUrl.safeParse(url).success, `${name}: ${url}`).toBe(true);
      const hosts = natsServers(url).map((u) => new URL(u).hostname);
      expect([...hosts].sort(), name).toEqual(names);
      homes.add(hosts[0]!);
      expect(kvReplicasFromEnv(env), name).toBe(3);
    }
    // each server is the first choice of some service: none sits idle until another fails
    expect([...homes].sort()).toEqual(names);
    expect(Object.keys(overlay.services)).toEqual(expect.arrayContaining(["nats", "nats-1", "nats-2"]));
  });

  test("a list of URLs: comma-separated, spaces around them ignored; a service refuses one that is not a NATS URL", () => {
    expect(natsServers("nats://a:4222, nats://b:4222,nats://c:4222")).toEqual([
      "nats://a:4222",
      "nats://b:4222",
      "nats://c:4222",
    ]);
    expect(baseConfigSchema.shape.natsUrl.safeParse("nats://a:4222,http://b:4222").success).toBe(false);
    expect(baseConfigSchema.shape.natsUrl.safeParse("nats://a:4222,").success).toBe(false);
  });
});
