// The compose file run for real, where a Docker engine runs or can be started (root, Debian's
// docker.io): the images are built without any image registry (scripts/docker-images.sh:
// debootstrap + docker import, Debian's nats-server; the services' image through the compose
// file's own build section), the mesh comes up, a job submitted from this host through NATS's
// published port on 127.0.0.1 finishes though a trainer container is SIGKILLed during it, and
// after `down` and `up` (volumes kept) the finished job is not run again while a short job keeps
// a snapshot of its end state. Containers, networks and volumes are removed even on failure.
//
// The services' image is tagged by a hash of its inputs and reused while they do not change.
// A cold build fetches Debian's packages, npm and the npm packages over the host's network:
// alone on the 2-core machine, the base images take about 50 s and the services' image 73 s.
// Beside the rest of the suite it takes several times that (in fresh clones with no images the
// test took 379-457 s, against 56-69 s warm, while the image still installed Debian's npm
// package, 101 s of the build alone); a warm run builds nothing.
import { afterAll, expect, test } from "bun:test";
import { createHash } from "node:crypto";
import { existsSync, readdirSync, readFileSync, statSync } from "node:fs";
import { join } from "node:path";
import type { Subprocess } from "bun";
import { EventKind, JobState } from "../../schemas/messages/job.ts";
import { MeshClient } from "../../sdk/client.ts";
import { watchJob } from "../../sdk/watch.ts";
import { type JobConfig, jobDefaults, parseJobConfig } from "../../services/runtime/job/config.ts";
import { clientUser, makeCredentials } from "../../services/runtime/job/roles.ts";
import { removeTempDirs, tempDir } from "../helpers/mesh.ts";
import { skip } from "../helpers/skip.ts";

const root = join(import.meta.dir, "..", "..");
const composeFile = join(root, "deploy", "docker-compose.yml");
const imagesScript = join(root, "scripts", "docker-images.sh");
/** The services' image; older tags of it are removed when a new one is built. */
const imageRepo = "meshtrain-test";
/** How long a dockerd this test starts gets to answer (a loaded machine). */
const daemonStartMs = 60_000;
/** How long the services get to register after `up` (Bun's start, the kernels' compile). */
const membersWaitMs = 180_000;
/** A cold build (debootstrap, apt-get, npm ci) and both mesh runs. */
const testTimeoutMs = 10 * 60_000;

interface Ran {
  code: number;
  out: string;
  err: string;
}

/** Runs a command without blocking the event loop (the NATS client keeps working meanwhile). */
async function run(argv: string[], env: Record<string, string | undefined> = process.env): Promise<Ran> {
  const p = Bun.spawn(argv, { cwd: root, env, stdin: "ignore", stdout: "pipe", stderr: "pipe" });
  const [out, err, code] = await Promise.all([new Response(p.stdout).text(), new Response(p.stderr).text(), p.exited]);
  return { code, out, err };
}

async function mustRun(argv: string[], env?: Record<string, string | undefined>): Promise<string> {
  const r = await run(argv, env);
  if (r.code !== 0)
    throw new Error(
      `${argv.join(" ")} exited with ${r.code}: ${(r.err || r.out).trim().split("\n").slice(-5).join(" | ")}`,
    );
  return r.out;
}

const lastLine = (text: string) => text.trim().split("\n").at(-1) ?? "";

interface Engine {
  /** `docker compose` (the v2 plugin) or `docker-compose` (1.29) */
  compose: string[];
  /** the dockerd this test started (stopped after it), or null where one already ran */
  daemon: Subprocess | null;
}

/** A Docker daemon that answers, starting one as root where none does; a string says why not. */
async function findEngine(): Promise<Engine | string> {
  if (Bun.which("docker") === null) return "no docker client (apt-get install docker.io docker-compose)";
  const compose =
    (await run(["docker", "compose", "version"])).code === 0
      ? ["docker", "compose"]
      : Bun.which("docker-compose")
        ? ["docker-compose"]
        : null;
  if (compose === null)
    return "neither `docker compose` nor `docker-compose` is installed (apt-get install docker-compose)";
  if ((await run(["docker", "info"])).code === 0) return { compose, daemon: null };
  if (process.getuid?.() !== 0) return "no Docker daemon answers, and starting one needs root";
  if (Bun.which("dockerd") === null)
    return "no Docker daemon answers and dockerd is not installed (apt-get install docker.io)";
  console.log("no Docker daemon answers: starting dockerd --iptables=false for this test");
  return startDaemon(compose);
}

/**
 * dockerd without its iptables rules: the containers reach each other on docker's bridge and
 * this host through published ports (docker-proxy), nothing beyond; builds use the host's network.
 */
async function startDaemon(compose: string[]): Promise<Engine | string> {
  const daemon = Bun.spawn(["dockerd", "--iptables=false"], { stdin: "ignore", stdout: "ignore", stderr: "pipe" });
  let log = "";
  void (async () => {
    for await (const chunk of daemon.stderr) log = (log + new TextDecoder().decode(chunk)).slice(-4096);
  })();
  const deadline = Date.now() + daemonStartMs;
  while (Date.now() < deadline && daemon.exitCode === null) {
    if ((await run(["docker", "info"])).code === 0) return { compose, daemon };
    await Bun.sleep(500);
  }
  daemon.kill("SIGTERM");
  await daemon.exited;
  return `dockerd did not start: ${lastLine(log)}`;
}

/** Why the base images cannot be made here, or null. */
async function baseImagesMissing(): Promise<string | null> {
  if (Bun.which("debootstrap") !== null) return null;
  const tags = (await mustRun(["sh", imagesScript, "--tags"])).match(/=(\S+)/g) ?? [];
  for (const t of tags)
    if ((await run(["docker", "image", "inspect", t.slice(1)])).code !== 0)
      return "debootstrap is missing (apt-get install debootstrap)";
  return null;
}

const engine = await findEngine();
const missing = typeof engine === "string" ? engine : await baseImagesMissing();

afterAll(removeTempDirs);

// dockerd stops its containerd and the shims first: a few seconds, more on a loaded machine
afterAll(
  async () => {
    if (typeof engine === "string" || engine.daemon === null) return;
    engine.daemon.kill("SIGTERM");
    await engine.daemon.exited;
  },
  { timeout: daemonStartMs },
);

/**
 * The certificate authorities of a proxy the npm registry's traffic goes through: the PEM file
 * MESHTRAIN_EXTRA_CA names, else the ones this machine added to Debian's store (empty if none).
 */
function extraCa(): string {
  const named = process.env.MESHTRAIN_EXTRA_CA;
  if (named !== undefined && named !== "") return readFileSync(named, "utf8");
  const dir = "/usr/local/share/ca-certificates";
  if (!existsSync(dir)) return "";
  const files = readdirSync(dir, { recursive: true, encoding: "utf8" }).filter((f) => f.endsWith(".crt"));
  return files
    .sort()
    .map((f) => readFileSync(join(dir, f), "utf8").trim())
    .join("\n");
}

/**
 * A hash of what goes into the services' image: the build arguments and every file git lists
 * (tracked, and untracked but not ignored; .dockerignore leaves out only what git ignores too).
 */
async function inputsHash(args: readonly string[]): Promise<string> {
  const h = createHash("sha256");
  for (const a of args) h.update(a).update("\0");
  const files = (await mustRun(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"]))
    .split("\0")
    .filter((f) => f !== "");
  for (const f of files.sort()) {
    const path = join(root, f);
    if (!existsSync(path) || !statSync(path).isFile()) continue; // deleted, or a submodule
    h.update(f).update("\0").update(readFileSync(path)).update("\0");
  }
  return h.digest("hex").slice(0, 16);
}

/** The base and NATS images (made once), then the services' image (reused while its inputs stay). */
async function buildImages(compose: string[], project: string): Promise<Record<string, string>> {
  const made = await mustRun(["sh", imagesScript]);
  const vars = Object.fromEntries([...made.matchAll(/^(MT_\w+)=(\S+)$/gm)].map((m) => [m[1]!, m[2]!]));
  const ca = extraCa();
  const image = `${imageRepo}:${await inputsHash([vars.MT_BASE_IMAGE!, ca])}`;
  const env = { ...vars, MT_IMAGE: image, MT_EXTRA_CA_CERT: ca };
  if ((await run(["docker", "image", "inspect", image])).code === 0) {
    console.log(`images: ${vars.MT_BASE_IMAGE}, ${vars.MT_NATS_IMAGE} and ${image} reused`);
    return env;
  }
  const t0 = performance.now();
  // the compose file's own build section (host network, build arguments); every service shares the image
  await mustRun([...compose, "-p", project, "-f", composeFile, "build", "data-loader"], { ...process.env, ...env });
  const tags = (await mustRun(["docker", "image", "ls", imageRepo, "--format", "{{.Repository}}:{{.Tag}}"])).split(
    "\n",
  );
  for (const old of tags.filter((t) => t !== "" && t !== image)) await run(["docker", "rmi", old]);
  console.log(`images: ${image} built in ${((performance.now() - t0) / 1000).toFixed(0)} s on ${vars.MT_BASE_IMAGE}`);
  return env;
}

/** `down -v`, then whatever of the project's is still there (two runs here kept their volumes). */
async function removeProject(
  compose: string[],
  project: string,
  env: Record<string, string | undefined>,
): Promise<void> {
  const down = await run([...compose, "-p", project, "-f", composeFile, "down", "-v", "--remove-orphans"], env);
  if (down.code !== 0) console.log(`down -v exited with ${down.code}: ${lastLine(down.err)}`);
  const label = `label=com.docker.compose.project=${project}`;
  const containers = (await run(["docker", "ps", "-aq", "--filter", label])).out.split("\n").filter((c) => c !== "");
  if (containers.length > 0) await run(["docker", "rm", "-f", "-v", ...containers]);
  const volumes = (await run(["docker", "volume", "ls", "-q", "--filter", label])).out
    .split("\n")
    .filter((v) => v !== "");
  const rm = volumes.length > 0 ? await run(["docker", "volume", "rm", ...volumes]) : null;
  if (rm !== null && rm.code !== 0) console.log(`docker volume rm ${volumes.join(" ")}: ${lastLine(rm.err)}`);
}

/** A free port on loopback for NATS's published port. */
function freePort(): number {
  const server = Bun.listen({ hostname: "127.0.0.1", port: 0, socket: { data() {} } });
  const port = server.port;
  server.stop(true);
  return port;
}

const jobConfig = (job: string, maxSteps: number): JobConfig =>
  parseJobConfig({
    ...jobDefaults,
    job,
    model: { kind: "mlp", widths: [784, 64, 10], dropout: 0 },
    maxSteps,
    warmupSteps: 5,
    checkpointEvery: 50,
  });

test.skipIf(skip("a Docker engine", missing))(
  "the compose mesh built offline: a job from this host finishes though a trainer container is killed; after down/up the finished job stays finished and a short job keeps its end snapshot",
  async () => {
    const { compose } = engine as Engine;
    const project = `mt-compose-test-${process.pid}`;
    const port = freePort();
    // the mesh's NATS users (the services' seeds are mounted from here; this host connects as the client)
    const creds = makeCredentials(join(tempDir("mt-compose-creds-"), "creds"), { trainers: 2, shards: 2 });
    const env = {
      ...process.env,
      ...(await buildImages(compose, project)),
      MT_NATS_PORT: String(port),
      MT_CREDS_DIR: creds.dir,
    };
    const asClient = { connectRetryMsMax: 60_000, nkeyFile: creds.seedFile(clientUser()) };
    const dc = (...args: string[]) => mustRun([...compose, "-p", project, "-f", composeFile, ...args], env);
    const url = `nats://127.0.0.1:${port}`;
    const tag = process.pid.toString(36);
    const long = jobConfig(`default.compose-long-${tag}`, 200);
    const short = jobConfig(`default.compose-short-${tag}`, 10);
    // where the time goes, printed at the end (no bound is checked)
    const phases: string[] = [];
    let t = performance.now();
    const phase = (name: string) => {
      phases.push(`${name} ${((performance.now() - t) / 1000).toFixed(1)} s`);
      t = performance.now();
    };
    try {
      await dc("up", "-d", "--no-build");
      phase("up");
      const trainer = (await dc("ps", "-q", "trainer-1")).trim();
      const pid = Number((await mustRun(["docker", "inspect", "-f", "{{.State.Pid}}", trainer])).trim());
      let killedAt = -1;
      let snapshots: string[] = [];
      {
        await using client = await MeshClient.connect(url, asClient);
        await client.submit(long, { membersWaitMs });
        phase("services registered");
        const r = await watchJob(client, long.job, {
          quiet: true,
          onEvent: (e) => {
            if (killedAt < 0 && e.kind === EventKind.Step && e.rank === 0 && e.step >= 20) {
              process.kill(pid, "SIGKILL"); // a crash: compose's restart: on-failure brings it back
              killedAt = e.step;
            }
          },
        });
        expect(killedAt).toBeGreaterThanOrEqual(20);
        expect(r.record.state).toBe(JobState.Done);
        expect(Number(r.record.totalSteps)).toBe(200);
        snapshots = (await client.checkpoints(long.job)).map((m) => m.id);
        phase("job with a trainer killed");
      }
      expect(
        Number((await mustRun(["docker", "inspect", "-f", "{{.RestartCount}}", trainer])).trim()),
      ).toBeGreaterThanOrEqual(1);

      await dc("down");
      phase("down");
      await dc("up", "-d", "--no-build");
      {
        await using client = await MeshClient.connect(url, asClient);
        await client.submit(short, { membersWaitMs });
        phase("up, services registered");
        const r = await watchJob(client, short.job, { quiet: true });
        phase("short job");
        expect(r.record.state).toBe(JobState.Done);
        const end = (await client.checkpoints(short.job)).find((m) => Number(m.step) === 10);
        expect(end?.modelPath).toMatch(/model\.mtm$/);
        // the services took up the jobs' specs in order: the finished one first, and left it alone
        expect((await client.record(long.job)).state).toBe(JobState.Done);
        expect((await client.checkpoints(long.job)).map((m) => m.id)).toEqual(snapshots);
        const logs = await dc("logs", "--no-color", "trainer-0", "trainer-1");
        expect(logs).toContain(`"job":"${short.job}"`);
        expect(logs).not.toContain(`"job":"${long.job}"`);
      }
    } finally {
      await removeProject(compose, project, env);
      phase("down -v");
      console.log(`phases: ${phases.join(", ")}`);
    }
  },
  testTimeoutMs,
);
