// deploy/k8s/'s pods, as far as they can run without Kubernetes: each meshtrain container's
// command started as the kubelet would start it in one pod (its ConfigMap's variables, the
// downward API's values for that pod's ordinal and node, $(VAR)s expanded, its Secret's seed
// files and its volumes in folders standing in for their mounts), against a real nats-server
// that takes only the users of the auth.conf `meshtrain creds` writes; every probe's path then
// answers 200 on the container's port. What differs from a cluster, and why: one nats-server on
// loopback (MT_NATS_URL, MT_KV_REPLICAS=1), a free port for the metrics (MT_METRICS_PORT: tests
// never bind fixed ports), and mounts under a temporary folder.
import { afterAll, describe, expect, test } from "bun:test";
import { cpSync, mkdirSync, readdirSync, readFileSync, statSync } from "node:fs";
import { join } from "node:path";
import { parse as parseYaml } from "yaml";
import { freePort } from "../../services/runtime/mesh/nats-server.ts";
import { makeCredentials } from "../../services/runtime/job/roles.ts";
import { removeTempDirs, root, spawnService, startNatsServer, tempDir, waitFor } from "../helpers/mesh.ts";
import { containerEnv, expand, type K8sObject, parseManifests, podTemplate } from "./k8s.ts";

afterAll(removeTempDirs);

const baseDir = join(root, "deploy", "k8s", "base");
const kustomization = parseYaml(readFileSync(join(baseDir, "kustomization.yaml"), "utf8")) as {
  resources: string[];
  secretGenerator: { name: string; files: string[] }[];
};
const objects = kustomization.resources.flatMap((f) => parseManifests(readFileSync(join(baseDir, f), "utf8"), f));

interface Pod {
  name: string;
  ordinal: number;
  node: string;
}

/** The value the downward API gives a fieldRef in `pod`. */
function fieldValue(path: string, pod: Pod): string {
  if (path === "metadata.name") return pod.name;
  if (path === "metadata.labels['apps.kubernetes.io/pod-index']") return String(pod.ordinal);
  if (path === "spec.nodeName") return pod.node;
  throw new Error(`this test does not stand in for fieldRef ${path}`);
}

/** The container's environment in `pod`, as the kubelet makes it (a $(VAR) sees the variables before it). */
// any: parsed YAML
function podEnv(c: any, pod: Pod): Record<string, string> {
  const env: Record<string, string> = {};
  for (const [k, v] of containerEnv({ envFrom: c.envFrom }, objects)) env[k] = v!;
  for (const e of c.env ?? [])
    env[e.name] = e.valueFrom?.fieldRef ? fieldValue(e.valueFrom.fieldRef.fieldPath, pod) : expand(e.value, env);
  return env;
}

/** Folders standing in for the pod's mounts: a Secret's files from the credentials, others empty. */
// any: parsed YAML
function mountAll(o: K8sObject, c: any, creds: string, rootDir: string): void {
  for (const m of c.volumeMounts ?? []) {
    const dir = join(rootDir, m.mountPath);
    mkdirSync(dir, { recursive: true });
    const volume = podTemplate(o)!.spec.volumes?.find((v: { name: string }) => v.name === m.name);
    const generator = kustomization.secretGenerator.find((g) => g.name === volume?.secret?.secretName);
    for (const f of generator?.files ?? [])
      cpSync(join(creds, f.replace(/^creds\//, "")), join(dir, f.replace(/^creds\//, "")));
  }
}

/**
 * Runs the pod's init containers as the kubelet would, before its services: their `sh -c` command
 * with $(VAR)s expanded and each mount's path moved under the pod's folder.
 */
function runInitContainers(o: K8sObject, pod: Pod, creds: string, rootDir: string): void {
  for (const c of podTemplate(o)!.spec.initContainers ?? []) {
    if (c.command?.[0] !== "sh" || c.command[1] !== "-c")
      throw new Error(`this test runs only sh -c init containers, not ${c.name}'s ${c.command}`);
    mountAll(o, c, creds, rootDir);
    let script = expand(c.command[2], podEnv(c, pod));
    // one pass, the longest path first (one mount's path may begin another's)
    const paths = (c.volumeMounts ?? [])
      .map((m: { mountPath: string }) => m.mountPath as string)
      .sort((x: string, y: string) => y.length - x.length);
    script = script.replace(
      new RegExp(paths.map((p: string) => p.replace(/[.*+?^${}()|[\]\\]/g, "\\$&")).join("|"), "g"),
      (p) => join(rootDir, p),
    );
    const run = Bun.spawnSync(["sh", "-c", script], { stdout: "pipe", stderr: "pipe" });
    if (run.exitCode !== 0) throw new Error(`init container ${c.name} of ${pod.name} failed: ${run.stderr.toString()}`);
  }
}

const replicasOf = (name: string) =>
  objects.find((o) => o.kind === "StatefulSet" && o.metadata.name === name)!.spec.replicas as number;

describe("deploy/k8s pods without Kubernetes", () => {
  test("every meshtrain container, started as its pod spec says (the last ordinal of each StatefulSet), is ready on its probes' paths with its own NATS user", async () => {
    const dir = tempDir("mt-k8s-pods-");
    const creds = makeCredentials(join(dir, "creds"), {
      trainers: replicasOf("trainer"),
      shards: replicasOf("parameter-server"),
    });
    await using nats = await startNatsServer({ authorization: creds.authorization });
    const started: {
      where: string;
      probes: string[];
      port: number;
      proc: ReturnType<typeof spawnService>;
      ordinal: number;
    }[] = [];
    try {
      for (const o of objects.filter((x) => podTemplate(x) !== null)) {
        const ordinal = o.kind === "StatefulSet" ? o.spec.replicas - 1 : 0;
        const pod = {
          name: o.kind === "StatefulSet" ? `${o.metadata.name}-${ordinal}` : `${o.metadata.name}-7d9f8-x2x4q`,
          ordinal,
          node: "node-a",
        };
        if (String(podTemplate(o)!.spec.containers[0]?.command?.[1]).startsWith("services/"))
          runInitContainers(o, pod, creds.dir, join(dir, pod.name));
        for (const c of podTemplate(o)!.spec.containers) {
          if (!String(c.command?.[1]).startsWith("services/")) continue; // NATS's own pods: the config test covers them
          const rootDir = join(dir, pod.name);
          mountAll(o, c, creds.dir, rootDir);
          const env = podEnv(c, pod);
          for (const [k, v] of Object.entries(env))
            if (c.volumeMounts?.some((m: { mountPath: string }) => v.startsWith(m.mountPath)))
              env[k] = join(rootDir, v);
          const port = await freePort();
          Object.assign(env, {
            MT_NATS_URL: nats.url,
            MT_KV_REPLICAS: "1",
            MT_METRICS_PORT: String(port),
            MT_METRICS_HOST: "127.0.0.1",
            MT_LOG_LEVEL: "info",
          });
          const probes = ["startupProbe", "livenessProbe", "readinessProbe"].map((p) => c[p].httpGet.path as string);
          started.push({
            where: pod.name,
            probes,
            port,
            ordinal,
            proc: spawnService(c.command[1], c.command.slice(2), env),
          });
        }
      }
      expect(started.map((s) => s.where).sort()).toEqual([
        "checkpoint-0",
        "data-loader-7d9f8-x2x4q",
        "parameter-server-1",
        "trainer-1",
      ]);
      for (const s of started) {
        for (const path of s.probes) {
          await waitFor(
            `${s.where} to answer 200 on ${path}`,
            async () => (await fetch(`http://127.0.0.1:${s.port}${path}`)).status === 200,
            60_000,
          );
        }
        expect(s.proc.proc.exitCode).toBeNull();
      }
      // a rank's and a shard's pod holds its own seed only (the init container copied it there)
      expect(readdirSync(join(dir, "trainer-1", "var/run/meshtrain/nkey"))).toEqual(["trainer-1.nk"]);
      expect(readdirSync(join(dir, "parameter-server-1", "var/run/meshtrain/nkey"))).toEqual(["ps-1.nk"]);
      expect(statSync(join(dir, "trainer-1", "var/run/meshtrain/nkey", "trainer-1.nk")).mode & 0o777).toBe(0o400);
      // the ordinal became the rank and the shard (the processes log them with every line)
      expect(started.find((s) => s.where === "trainer-1")!.proc.log()).toContain('"rank":1');
      expect(started.find((s) => s.where === "parameter-server-1")!.proc.log()).toContain('"shard":1');
    } finally {
      for (const s of started) await s.proc[Symbol.asyncDispose]();
    }
  }, 120_000);
});
