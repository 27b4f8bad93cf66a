// deploy/k8s/ checked without a cluster (none can run here): every object against the Kubernetes
// schema of its apiVersion/kind, with no unknown fields; the references between objects (Secrets,
// ConfigMaps, selectors, named ports, volumes); what meshtrain needs of them (every MT_* variable
// one the service reads, each ordinal's nkey seed in its Secret, replicas that agree with the
// mesh's topology); the NATS servers' config through a real nats-server's config test; and, where
// kubectl is installed, the kustomize output of the base and of the GPU overlay, built with real
// credentials, through the same checks. The last test shows that the checks can fail.
import { afterAll, describe, expect, test } from "bun:test";
import { cpSync, mkdirSync, readFileSync, writeFileSync } from "node:fs";
import { basename, dirname, join } from "node:path";
import { parse as parseYaml } from "yaml";
import { jobDefaults } from "../../services/runtime/job/config.ts";
import { makeCredentials } from "../../services/runtime/job/roles.ts";
import { removeTempDirs, root, tempDir } from "../helpers/mesh.ts";
import { skip } from "../helpers/skip.ts";
import {
  containerEnv,
  expand,
  type K8sObject,
  parseManifests,
  podProblems,
  podTemplate,
  selectorProblems,
  unknownFields,
  validateSchema,
} from "./k8s.ts";

afterAll(removeTempDirs);

const k8sDir = join(root, "deploy", "k8s");
const baseDir = join(k8sDir, "base");
const podIndex = "metadata.labels['apps.kubernetes.io/pod-index']";

interface Kustomization {
  resources: string[];
  secretGenerator: { name: string; files: string[] }[];
}
const kustomization = parseYaml(readFileSync(join(baseDir, "kustomization.yaml"), "utf8")) as Kustomization;
const baseObjects = kustomization.resources.flatMap((f) => parseManifests(readFileSync(join(baseDir, f), "utf8"), f));
/** The Secrets the base's secretGenerator makes: name and keys ("key=path" or the file's name). */
const generatedSecrets = new Map(
  kustomization.secretGenerator.map((g) => [
    g.name,
    g.files.map((f) => (f.includes("=") ? f.split("=")[0]! : basename(f))),
  ]),
);
const secretsOf = (objs: readonly K8sObject[]) =>
  new Map(objs.filter((o) => o.kind === "Secret").map((o) => [o.metadata.name, Object.keys(o.data ?? {})]));

const kubectlMissing =
  Bun.which("kubectl") === null
    ? "kubectl is not installed (it renders the kustomizations: apt-get install kubectl)"
    : null;
const natsServerMissing =
  Bun.which("nats-server") === null ? "nats-server is not installed (apt-get install nats-server)" : null;

/** The MT_* variables a service reads: its config keys (the names its flags' refusal lists) and
 *  those the runtime reads from the environment itself (env.MT_X in services/ and ffi/). */
function variablesRead(service: string): Set<string> {
  const p = Bun.spawnSync([process.execPath, join(root, "services", service, "main.ts"), "--no-such-flag", "x"], {
    env: { ...process.env, MT_LOG_LEVEL: "silent" },
    stderr: "pipe",
    stdout: "pipe",
  });
  const known = /known: (.*)$/m.exec(p.stderr.toString())?.[1];
  if (known === undefined) throw new Error(`${service} did not list its flags: ${p.stderr.toString()}`);
  const names = known.split(", ").map((f) => `MT_${f.slice(2).replaceAll("-", "_").toUpperCase()}`);
  for (const dir of ["services", "ffi"]) {
    for (const file of new Bun.Glob("**/*.ts").scanSync(join(root, dir))) {
      for (const m of readFileSync(join(root, dir, file), "utf8").matchAll(/env\??\.(MT_[A-Z0-9_]+)/g))
        names.push(m[1]!);
    }
  }
  return new Set(names);
}
const services = ["data-loader", "parameter-server", "trainer", "checkpoint"];
const readByService = new Map(services.map((s) => [s, variablesRead(s)]));

/** The meshtrain service a container runs (bun services/<name>/main.ts), or null. */
const serviceOf = (c: { command?: string[] }) =>
  /^services\/([a-z-]+)\/main\.ts$/.exec(c.command?.[1] ?? "")?.[1] ?? null;

/**
 * What meshtrain needs of its pods: every MT_* variable read by the service; /metrics on the
 * annotated port; MT_NATS_NKEY, expanded for each ordinal, a key of the Secret mounted at its
 * folder (owner-readable only), and that Secret holding no other seeds.
 */
function meshtrainProblems(objs: readonly K8sObject[], secrets: ReadonlyMap<string, readonly string[]>): string[] {
  const problems: string[] = [];
  for (const o of objs) {
    const pod = podTemplate(o);
    for (const c of pod?.spec.containers ?? []) {
      const service = serviceOf(c);
      if (service === null) continue;
      const where = `${o.kind}/${o.metadata.name}`;
      const env = containerEnv(c, objs);
      const read = readByService.get(service);
      if (read === undefined) problems.push(`${where}: runs ${service}, which is no meshtrain service`);
      for (const name of env.keys())
        if (name.startsWith("MT_") && !read?.has(name)) problems.push(`${where}: ${service} reads no ${name}`);
      const annotated = o.spec?.template?.metadata?.annotations?.["prometheus.io/port"];
      if (env.get("MT_METRICS_PORT") !== annotated)
        problems.push(`${where}: MT_METRICS_PORT ${env.get("MT_METRICS_PORT")} is not the scraped port ${annotated}`);
      problems.push(...nkeyProblems(where, o, c, pod!.spec, secrets));
    }
  }
  return problems;
}

// any: parsed YAML
function nkeyProblems(
  where: string,
  o: K8sObject,
  c: any,
  podSpec: any,
  secrets: ReadonlyMap<string, readonly string[]>,
): string[] {
  const template = (c.env ?? []).find((e: { name: string }) => e.name === "MT_NATS_NKEY")?.value as string | undefined;
  if (template === undefined) return [`${where}: no MT_NATS_NKEY (its NATS user's seed)`];
  const ordinalVars: string[] = (c.env ?? [])
    .filter((e: { valueFrom?: { fieldRef?: { fieldPath?: string } } }) => e.valueFrom?.fieldRef?.fieldPath === podIndex)
    .map((e: { name: string }) => e.name);
  const ordinals = o.kind === "StatefulSet" ? Array.from({ length: o.spec.replicas ?? 1 }, (_, i) => String(i)) : ["-"];
  const files = ordinals.map((i) => expand(template, Object.fromEntries(ordinalVars.map((v) => [v, i]))));
  const mount = (c.volumeMounts ?? []).find((m: { mountPath: string }) => m.mountPath === dirname(files[0]!));
  const volumeNamed = (name: string | undefined) =>
    (podSpec.volumes ?? []).find((v: { name: string }) => v.name === name);
  let volume = volumeNamed(mount?.name);
  const problems: string[] = [];
  if (volume?.emptyDir !== undefined) {
    // the pod's own seed, copied there by an init container from the Secret of every ordinal's,
    // which the service's container itself must not mount
    const init = (podSpec.initContainers ?? []).find((i: any) =>
      (i.volumeMounts ?? []).some((m: { name: string }) => m.name === volume.name),
    );
    const from = (init?.volumeMounts ?? []).find((m: { name: string }) => volumeNamed(m.name)?.secret !== undefined);
    if (init === undefined || from === undefined)
      return [`${where}: MT_NATS_NKEY's folder is an emptyDir that no init container fills from a Secret`];
    const source = `${from.mountPath}/${basename(template)}`;
    const initOrdinals = (init.env ?? [])
      .filter((e: any) => e.valueFrom?.fieldRef?.fieldPath === podIndex)
      .map((e: { name: string }) => e.name);
    if (!(init.command ?? []).join(" ").includes(source) || ordinalVars.some((v) => !initOrdinals.includes(v))) {
      problems.push(
        `${where}: init container ${init.name} does not copy ${source} with the pod's ordinal in ${ordinalVars.join(", ")}`,
      );
    }
    if ((c.volumeMounts ?? []).some((m: { name: string }) => m.name === from.name))
      problems.push(`${where}: the container mounts every ordinal's seeds itself`);
    volume = volumeNamed(from.name);
  }
  const keys = secrets.get(volume?.secret?.secretName);
  if (keys === undefined)
    return [`${where}: no Secret is mounted at ${dirname(files[0]!)}, the folder of MT_NATS_NKEY`];
  if (volume.secret.defaultMode !== 0o400)
    problems.push(`${where}: the seeds' mode is ${volume.secret.defaultMode?.toString(8)}, not 400`);
  const want = [...new Set(files.map((f) => basename(f)))].sort();
  if (JSON.stringify(want) !== JSON.stringify([...keys].sort())) {
    problems.push(
      `${where}: its ${ordinals.length} pod(s) read ${want.join(", ")}; Secret ${volume.secret.secretName} holds ${[...keys].sort().join(", ")}`,
    );
  }
  return problems;
}

/** Every check on one set of objects; [] when they pass. */
const allProblems = (objs: readonly K8sObject[], secrets: ReadonlyMap<string, readonly string[]>) => [
  ...selectorProblems(objs),
  ...podProblems(objs, secrets),
  ...meshtrainProblems(objs, secrets),
];

const find = (objs: readonly K8sObject[], kind: string, name: string) => {
  const o = objs.find((x) => x.kind === kind && x.metadata.name === name);
  if (o === undefined) throw new Error(`no ${kind}/${name}`);
  return o;
};
const natsConf = () => find(baseObjects, "ConfigMap", "nats-config").data!["nats.conf"]!;
const meshEnv = () => find(baseObjects, "ConfigMap", "meshtrain-env").data!;

/** Copies a kustomization tree, writes real credentials for its trainers and shards, and renders `overlay` with kubectl. */
function render(overlay: string, trainers: number, shards: number): K8sObject[] {
  const dir = tempDir("mt-k8s-");
  cpSync(k8sDir, dir, { recursive: true });
  makeCredentials(join(dir, "base", "creds"), { trainers, shards });
  const p = Bun.spawnSync(["kubectl", "kustomize", join(dir, overlay)], { stdout: "pipe", stderr: "pipe" });
  if (p.exitCode !== 0) throw new Error(`kubectl kustomize ${overlay}: ${p.stderr.toString()}`);
  return parseManifests(p.stdout.toString(), `kustomize ${overlay}`);
}

const replicas = (objs: readonly K8sObject[], name: string) => find(objs, "StatefulSet", name).spec.replicas as number;

describe("deploy/k8s manifests", () => {
  test("every object passes the Kubernetes schema of its apiVersion and kind", async () => {
    expect(baseObjects.length).toBeGreaterThan(10);
    for (const o of baseObjects) await validateSchema(o);
  });

  test("no object has a field that its kind does not define", () => {
    expect(unknownFields(baseObjects, tempDir("mt-k8s-ts-"), root)).toEqual([]);
  });

  test("references hold: Secrets, ConfigMaps, selectors, Services, ports, volumes, $(VAR)s; MT_* variables the services read; each ordinal's nkey seed", () => {
    expect(allProblems(baseObjects, generatedSecrets)).toEqual([]);
  });

  test("the replicas are the mesh's topology (deploy/docker-compose.yml, the job defaults); NATS's routes, KV replicas, payload limit and URL agree", () => {
    const compose = parseYaml(readFileSync(join(root, "deploy", "docker-compose.yml"), "utf8")) as {
      services: Record<string, unknown>;
    };
    const count = (prefix: string) => Object.keys(compose.services).filter((s) => s.startsWith(prefix)).length;
    expect(replicas(baseObjects, "trainer")).toBe(count("trainer-"));
    expect(replicas(baseObjects, "parameter-server")).toBe(count("parameter-server-"));
    expect(replicas(baseObjects, "trainer")).toBeGreaterThanOrEqual(jobDefaults.trainers);
    expect(replicas(baseObjects, "parameter-server")).toBeGreaterThanOrEqual(jobDefaults.shards);
    const servers = replicas(baseObjects, "nats");
    const routes = [...natsConf().matchAll(/nats:\/\/(nats-\d+)\.([a-z-]+):6222/g)];
    expect(routes.map((r) => r[1])).toEqual(Array.from({ length: servers }, (_, i) => `nats-${i}`));
    for (const r of routes) expect(r[2]).toBe(find(baseObjects, "StatefulSet", "nats").spec.serviceName);
    expect(Number(meshEnv().MT_KV_REPLICAS)).toBeLessThanOrEqual(servers);
    expect(Number(meshEnv().MT_PAYLOAD_BYTES_MAX)).toBeLessThanOrEqual(
      Number(/^max_payload: (\d+)$/m.exec(natsConf())?.[1]),
    );
    const url = new URL(meshEnv().MT_NATS_URL!);
    expect(find(baseObjects, "Service", url.hostname).spec.ports.map((p: { port: number }) => p.port)).toContain(
      Number(url.port),
    );
  });

  test.skipIf(skip("nats-server", natsServerMissing))(
    "the servers' config passes nats-server's config test, with the auth.conf `meshtrain creds` writes",
    () => {
      // the pod's layout: the ConfigMap in config/, the nats-auth Secret in auth/
      const dir = tempDir("mt-k8s-nats-");
      mkdirSync(join(dir, "config"));
      writeFileSync(join(dir, "config", "nats.conf"), natsConf());
      makeCredentials(join(dir, "auth"), {
        trainers: replicas(baseObjects, "trainer"),
        shards: replicas(baseObjects, "parameter-server"),
      });
      const check = (env: Record<string, string>) =>
        Bun.spawnSync(["nats-server", "-c", join(dir, "config", "nats.conf"), "-t"], {
          env: { ...process.env, ...env },
          stdout: "pipe",
          stderr: "pipe",
        });
      const ok = check({ POD_NAME: "nats-0" });
      expect(`${ok.stdout}${ok.stderr}`).toContain("is valid");
      expect(ok.exitCode).toBe(0);
      expect(check({}).exitCode).not.toBe(0); // without its pod's name: refused, so the test above means something
    },
  );

  test.skipIf(skip("kubectl", kubectlMissing))(
    "kustomize renders the base and the GPU overlay with real credentials; both pass every check",
    async () => {
      const t = replicas(baseObjects, "trainer");
      const s = replicas(baseObjects, "parameter-server");
      for (const overlay of ["base", "gpu"]) {
        const objs = render(overlay, t, s);
        for (const o of objs) await validateSchema(o);
        expect(unknownFields(objs, tempDir("mt-k8s-ts-"), root)).toEqual([]);
        expect(allProblems(objs, secretsOf(objs))).toEqual([]);
      }
      const gpu = find(render("gpu", t, s), "StatefulSet", "trainer").spec.template.spec.containers[0];
      expect(gpu.image).toBe("meshtrain-gpu:latest");
      expect(gpu.resources.limits["nvidia.com/gpu"]).toBe(1);
      expect(gpu.env.filter((e: { name: string }) => e.name === "MT_DEVICE")).toEqual([
        { name: "MT_DEVICE", value: "cuda" },
      ]);
    },
  );

  test("the checks fail on broken manifests: a schema violation, an unknown field, a wrong reference, an unread variable, replicas without seeds", async () => {
    const trainer = () => structuredClone(find(baseObjects, "StatefulSet", "trainer"));
    const broken = trainer();
    broken.spec.replicas = "2";
    delete broken.spec.template.spec.containers[0].name;
    await expect(validateSchema(broken)).rejects.toThrow(/replicas must be integer|must have required property 'name'/);
    const misspelt = trainer();
    misspelt.spec.template.spec.containers[0].livenesProbe = misspelt.spec.template.spec.containers[0].livenessProbe;
    expect(unknownFields([misspelt], tempDir("mt-k8s-ts-"), root).join("\n")).toContain("livenesProbe");
    const cases: [string, (o: K8sObject) => void, RegExp][] = [
      [
        "a Secret's name",
        (o) => (o.spec.template.spec.volumes[0].secret.secretName = "nkeys-trainers"),
        /no Secret nkeys-trainers/,
      ],
      [
        "a selector",
        (o) => (o.spec.selector.matchLabels["app.kubernetes.io/name"] = "trainers"),
        /selector does not match/,
      ],
      [
        "a variable",
        (o) => o.spec.template.spec.containers[0].env.push({ name: "MT_RANKS", value: "2" }),
        /trainer reads no MT_RANKS/,
      ],
      [
        "the replicas",
        (o) => (o.spec.replicas = 3),
        /read trainer-0.nk, trainer-1.nk, trainer-2.nk; Secret nkeys-trainer holds trainer-0.nk, trainer-1.nk/,
      ],
      [
        "a probe's port",
        (o) => (o.spec.template.spec.containers[0].readinessProbe.httpGet.port = "metric"),
        /readinessProbe probes port metric/,
      ],
      [
        "the seed the init container copies",
        (o) =>
          (o.spec.template.spec.initContainers[0].command[2] =
            o.spec.template.spec.initContainers[0].command[2].replaceAll("$(MT_RANK)", "0")),
        /init container own-nkey does not copy \/var\/run\/meshtrain\/nkeys\/trainer-\$\(MT_RANK\)\.nk/,
      ],
      [
        "every seed mounted in the trainer",
        (o) =>
          o.spec.template.spec.containers[0].volumeMounts.push({ name: "nkeys", mountPath: "/seeds", readOnly: true }),
        /the container mounts every ordinal's seeds itself/,
      ],
      [
        "an undefined variable in a command",
        (o) => delete o.spec.template.spec.initContainers[0].env,
        /its command refers to \$\(MT_RANK\)/,
      ],
    ];
    for (const [what, mutate, problem] of cases) {
      const o = trainer();
      mutate(o);
      const objs = baseObjects.map((x) => (x.kind === "StatefulSet" && x.metadata.name === "trainer" ? o : x));
      expect({ what, problems: allProblems(objs, generatedSecrets).join("\n") }).toEqual({
        what,
        problems: expect.stringMatching(problem),
      });
    }
  });
});
