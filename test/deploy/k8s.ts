// Checks of Kubernetes manifests without a cluster (test/deploy/k8s.test.ts runs them on
// deploy/k8s/): the OpenAPI schema of each object's apiVersion/kind (kubernetes-models's compiled
// validators), unknown fields (the schemas let them through: tsc's excess-property check on the
// objects typed with kubernetes-models's interfaces refuses them), and the references between
// objects that the API server does not check either (a Secret's name, a selector, a named port).
import { mkdirSync, symlinkSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { parseAllDocuments } from "yaml";

export interface K8sObject {
  apiVersion: string;
  kind: string;
  metadata: { name: string; labels?: Record<string, string>; annotations?: Record<string, string> };
  // any: a manifest's body is checked by the schema, not by this type
  spec?: any;
  data?: Record<string, string>;
}

/** The objects of a multi-document YAML text, read as Kubernetes reads it: YAML 1.1 (0400 is octal). */
export function parseManifests(text: string, file: string): K8sObject[] {
  const out: K8sObject[] = [];
  for (const doc of parseAllDocuments(text, { version: "1.1" })) {
    if (doc.errors.length > 0) throw new Error(`${file}: ${doc.errors.map((e) => e.message).join("; ")}`);
    const obj = doc.toJS() as K8sObject | null;
    if (obj !== null) out.push(obj);
  }
  return out;
}

/** kubernetes-models's folder of an apiVersion: "v1" (core), "apps/v1", "policy/v1". */
const modelPath = (apiVersion: string) => `kubernetes-models/${apiVersion}`;

/** A Secret's base64 values without line breaks: kustomize wraps them at 70 characters, and the
 *  API server's decoder (Go's base64) skips line breaks, where the schema's "byte" format does not. */
function secretUnwrapped(obj: K8sObject): K8sObject {
  if (obj.kind !== "Secret" || obj.data === undefined) return obj;
  return { ...obj, data: Object.fromEntries(Object.entries(obj.data).map(([k, v]) => [k, v.replace(/[\r\n]/g, "")])) };
}

/** Validates `obj` against its kind's schema; throws the validator's message (the path and the problem). */
export async function validateSchema(obj: K8sObject): Promise<void> {
  const where = `${obj.kind}/${obj.metadata?.name}`;
  let models: Record<string, unknown>;
  try {
    models = await import(modelPath(obj.apiVersion));
  } catch {
    throw new Error(`${where}: no schema for apiVersion ${obj.apiVersion}`);
  }
  const Model = models[obj.kind] as (new (data: unknown) => { validate(): void }) | undefined;
  if (Model === undefined) throw new Error(`${where}: no schema for kind ${obj.kind} in ${obj.apiVersion}`);
  try {
    new Model(secretUnwrapped(obj)).validate();
  } catch (e) {
    throw new Error(`${where}: ${(e as Error).message}`);
  }
}

/**
 * Fields that no schema of their kind has (a misspelt `livenesProbe` would be dropped by the API
 * server without a word): each object becomes a literal of its kind's TypeScript interface in
 * `workDir`, and tsc's excess-property check names every unknown field. Returns tsc's error
 * lines, [] when there are none.
 */
export function unknownFields(objs: readonly K8sObject[], workDir: string, repoRoot: string): string[] {
  mkdirSync(workDir, { recursive: true });
  symlinkSync(join(repoRoot, "node_modules"), join(workDir, "node_modules"));
  const lines = objs.flatMap((o, i) => [
    `import type { I${o.kind} as T${i} } from "${modelPath(o.apiVersion)}/${o.kind}";`,
    `// ${o.kind}/${o.metadata.name}`,
    `export const o${i}: T${i} = ${JSON.stringify(o)};`,
  ]);
  writeFileSync(join(workDir, "objects.ts"), `${lines.join("\n")}\n`);
  const options = {
    strict: true,
    noEmit: true,
    skipLibCheck: true,
    module: "Preserve",
    moduleResolution: "bundler",
    target: "ESNext",
    types: [],
  };
  writeFileSync(join(workDir, "tsconfig.json"), JSON.stringify({ compilerOptions: options, files: ["objects.ts"] }));
  const tsc = Bun.spawnSync([join(repoRoot, "node_modules", ".bin", "tsc"), "-p", workDir], {
    stdout: "pipe",
    stderr: "pipe",
  });
  const out = `${tsc.stdout.toString()}${tsc.stderr.toString()}`.trim();
  if (tsc.exitCode === 0) return [];
  return out === ""
    ? [`tsc exited ${tsc.exitCode}`]
    : out.split("\n").map((l) => l.replace(/^objects\.ts\(\d+,\d+\): /, ""));
}

// any: pod specs are plain parsed YAML here
type Any = any;

/** The pod template of a workload, or null for other kinds. */
export function podTemplate(o: K8sObject): { labels: Record<string, string>; spec: Any } | null {
  if (!["Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"].includes(o.kind)) return null;
  return { labels: o.spec?.template?.metadata?.labels ?? {}, spec: o.spec?.template?.spec ?? {} };
}

const matches = (selector: Record<string, string> | undefined, labels: Record<string, string>) =>
  selector !== undefined &&
  Object.keys(selector).length > 0 &&
  Object.entries(selector).every(([k, v]) => labels[k] === v);

const named = (objs: readonly K8sObject[], kind: string, name: string) =>
  objs.find((o) => o.kind === kind && o.metadata.name === name);

/** Selectors: each workload's matches its own pods; each Service's and PodDisruptionBudget's some workload's. */
export function selectorProblems(objs: readonly K8sObject[]): string[] {
  const problems: string[] = [];
  const pods = objs.flatMap((o) => (podTemplate(o) === null ? [] : [{ owner: o, ...podTemplate(o)! }]));
  for (const p of pods) {
    if (!matches(p.owner.spec?.selector?.matchLabels, p.labels))
      problems.push(`${p.owner.kind}/${p.owner.metadata.name}: selector does not match its pod labels`);
  }
  for (const o of objs) {
    const selector =
      o.kind === "Service"
        ? o.spec?.selector
        : o.kind === "PodDisruptionBudget"
          ? o.spec?.selector?.matchLabels
          : undefined;
    if (selector === undefined) continue;
    const target = pods.filter((p) => matches(selector, p.labels));
    if (target.length === 0) problems.push(`${o.kind}/${o.metadata.name}: selector matches no pods`);
    if (o.kind === "Service")
      problems.push(
        ...servicePortProblems(
          o,
          target.map((p) => p.spec),
        ),
      );
  }
  for (const s of objs.filter((o) => o.kind === "StatefulSet")) {
    const svc = named(objs, "Service", s.spec?.serviceName);
    if (svc === undefined || svc.spec?.clusterIP !== "None")
      problems.push(`StatefulSet/${s.metadata.name}: serviceName ${s.spec?.serviceName} is no headless Service`);
    else if (!matches(svc.spec.selector, podTemplate(s)!.labels))
      problems.push(`StatefulSet/${s.metadata.name}: its Service ${svc.metadata.name} selects other pods`);
  }
  return problems;
}

/** A Service's named target ports are ports of the pods it selects. */
function servicePortProblems(svc: K8sObject, podSpecs: Any[]): string[] {
  const portNames = new Set(
    podSpecs.flatMap((s) => (s.containers ?? []).flatMap((c: Any) => (c.ports ?? []).map((p: Any) => p.name))),
  );
  return (svc.spec?.ports ?? [])
    .filter((p: Any) => typeof p.targetPort === "string" && !portNames.has(p.targetPort))
    .map((p: Any) => `Service/${svc.metadata.name}: targetPort ${p.targetPort} is no port of its pods`);
}

/**
 * Inside each pod: volumes name ConfigMaps and Secrets that exist (`secrets`: a Secret's name
 * and keys, from the manifests or a kustomize secretGenerator), mounts name volumes, envFrom
 * names ConfigMaps, probes name ports, $(VAR) names a variable defined before it, and the
 * Prometheus annotation names a port.
 */
export function podProblems(objs: readonly K8sObject[], secrets: ReadonlyMap<string, readonly string[]>): string[] {
  const problems: string[] = [];
  for (const o of objs) {
    const pod = podTemplate(o);
    if (pod === null) continue;
    const where = `${o.kind}/${o.metadata.name}`;
    const volumes = new Set<string>([...(o.spec?.volumeClaimTemplates ?? []).map((v: Any) => v.metadata.name)]);
    for (const v of pod.spec.volumes ?? []) {
      volumes.add(v.name);
      if (v.configMap && !named(objs, "ConfigMap", v.configMap.name))
        problems.push(`${where}: volume ${v.name}: no ConfigMap ${v.configMap.name}`);
      if (v.secret && !secrets.has(v.secret.secretName))
        problems.push(`${where}: volume ${v.name}: no Secret ${v.secret.secretName}`);
    }
    for (const c of [...(pod.spec.initContainers ?? []), ...(pod.spec.containers ?? [])]) {
      problems.push(...containerProblems(`${where} container ${c.name}`, c, objs, volumes));
    }
    const promPort = o.spec?.template?.metadata?.annotations?.["prometheus.io/port"];
    const ports = (pod.spec.containers ?? []).flatMap((c: Any) =>
      (c.ports ?? []).map((p: Any) => String(p.containerPort)),
    );
    if (promPort !== undefined && !ports.includes(promPort))
      problems.push(`${where}: prometheus.io/port ${promPort} is no container port`);
  }
  return problems;
}

function containerProblems(where: string, c: Any, objs: readonly K8sObject[], volumes: ReadonlySet<string>): string[] {
  const problems: string[] = [];
  for (const m of c.volumeMounts ?? [])
    if (!volumes.has(m.name)) problems.push(`${where}: mounts ${m.name}, which is no volume`);
  const defined = new Set<string>();
  for (const e of c.envFrom ?? []) {
    const cm = e.configMapRef ? named(objs, "ConfigMap", e.configMapRef.name) : undefined;
    if (e.configMapRef && cm === undefined)
      problems.push(`${where}: envFrom names no ConfigMap ${e.configMapRef.name}`);
    for (const k of Object.keys(cm?.data ?? {})) defined.add(k);
  }
  for (const e of c.env ?? []) {
    for (const [, ref] of String(e.value ?? "").matchAll(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g)) {
      if (!defined.has(ref!)) problems.push(`${where}: ${e.name} refers to $(${ref}), which is not defined before it`);
    }
    defined.add(e.name);
  }
  // the kubelet expands $(VAR) in the command and its arguments too
  for (const arg of [...(c.command ?? []), ...(c.args ?? [])]) {
    for (const [, ref] of String(arg).matchAll(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g)) {
      if (!defined.has(ref!))
        problems.push(`${where}: its command refers to $(${ref}), which its environment does not define`);
    }
  }
  const portNames = new Set((c.ports ?? []).map((p: Any) => p.name));
  for (const kind of ["startupProbe", "livenessProbe", "readinessProbe"]) {
    const port = c[kind]?.httpGet?.port;
    if (typeof port === "string" && !portNames.has(port))
      problems.push(`${where}: ${kind} probes port ${port}, which it does not have`);
  }
  return problems;
}

/** A container's environment: envFrom's ConfigMaps' keys, then env's values (null: from a field). */
export function containerEnv(c: Any, objs: readonly K8sObject[]): Map<string, string | null> {
  const env = new Map<string, string | null>();
  for (const e of c.envFrom ?? []) {
    for (const [k, v] of Object.entries(named(objs, "ConfigMap", e.configMapRef?.name)?.data ?? {})) env.set(k, v);
  }
  for (const e of c.env ?? []) env.set(e.name, e.value ?? null);
  return env;
}

/** `text` with each $(NAME) replaced by vars' NAME. */
export const expand = (text: string, vars: Record<string, string>) =>
  text.replace(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g, (all, n: string) => vars[n] ?? all);
