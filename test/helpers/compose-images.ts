// The compose test's images and Docker engine (test/deploy/compose.test.ts), and their build
// ahead of it. A cold build (debootstrap, apt-get, npm ci: see scripts/docker-images.sh and
// deploy/Dockerfile) spends minutes mostly waiting on the network and the disk; in a test file it
// held one of the suite's two workers all that time. So scripts/test.ts starts
// test/deploy/prebuild-images.ts beside `bun test` when it runs the whole suite: that process
// finds or starts the engine, builds the images, writes how it went to the file that
// MT_COMPOSE_PREBUILD names, and keeps a dockerd it started running until scripts/test.ts stops
// it after the suite. The compose test waits for it (waitForPrebuild) and then finds the engine
// answering and the images built; run alone, or where the prebuild failed, it builds them itself.
import { createHash } from "node:crypto";
import { existsSync, readdirSync, readFileSync, statSync } from "node:fs";
import { join } from "node:path";
import type { Subprocess } from "bun";

export const root = join(import.meta.dir, "..", "..");
export const composeFile = join(root, "deploy", "docker-compose.yml");
const imagesScript = join(root, "scripts", "docker-images.sh");
/** The services' image; older tags of it are removed when a new one is built. */
const imageRepo = "meshtrain-test";
/** How long a dockerd started here gets to answer (a loaded machine). */
export const daemonStartMs = 60_000;
export interface Ran {
  code: number;
  out: string;
  err: string;
}

/** Runs a command without blocking the event loop (the NATS client keeps working meanwhile). */
export async function run(argv: string[], env: Record<string, string | undefined> = process.env): Promise<Ran> {
  const p = Bun.spawn(argv, { cwd: root, env, stdin: "ignore", stdout: "pipe", stderr: "pipe" });
  const [out, err, code] = await Promise.all([new Response(p.stdout).text(), new Response(p.stderr).text(), p.exited]);
  return { code, out, err };
}

export async function mustRun(argv: string[], env?: Record<string, string | undefined>): Promise<string> {
  const r = await run(argv, env);
  if (r.code !== 0)
    throw new Error(
      `${argv.join(" ")} exited with ${r.code}: ${(r.err || r.out).trim().split("\n").slice(-5).join(" | ")}`,
    );
  return r.out;
}

export const lastLine = (text: string) => text.trim().split("\n").at(-1) ?? "";

export interface Engine {
  /** `docker compose` (the v2 plugin) or `docker-compose` (1.29) */
  compose: string[];
  /** the dockerd started here (its starter stops it), or null where one already ran */
  daemon: Subprocess | null;
}

/** A Docker daemon that answers, starting one as root where none does; a string says why not. */
export async function findEngine(): Promise<Engine | string> {
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
  console.log("no Docker daemon answers: starting dockerd --iptables=false");
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
export async function baseImagesMissing(): Promise<string | null> {
  if (Bun.which("debootstrap") !== null) return null;
  const tags = (await mustRun(["sh", imagesScript, "--tags"])).match(/=(\S+)/g) ?? [];
  for (const t of tags)
    if ((await run(["docker", "image", "inspect", t.slice(1)])).code !== 0)
      return "debootstrap is missing (apt-get install debootstrap)";
  return null;
}

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
export async function buildImages(compose: string[], project: string): Promise<Record<string, string>> {
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

/** The environment variable naming the prebuild's state file (set by scripts/test.ts). */
export const prebuildEnv = "MT_COMPOSE_PREBUILD";

/** What the prebuild wrote: building while it works, then ready, failed or skipped. */
export interface PrebuildState {
  pid: number;
  state: "building" | "ready" | "failed" | "skipped";
  /** why it failed or skipped */
  reason?: string;
  /** seconds it took */
  seconds?: number;
}

function readPrebuild(file: string): PrebuildState | null {
  try {
    return JSON.parse(readFileSync(file, "utf8")) as PrebuildState;
  } catch {
    return null; // not written yet, or half-written
  }
}

const alive = (pid: number) => {
  try {
    process.kill(pid, 0);
    return true;
  } catch {
    return false;
  }
};

/**
 * Waits (at most `timeoutMs`) for the prebuild scripts/test.ts started, where it started one, and
 * says how it went in one line; null where there was none to wait for.
 */
export async function waitForPrebuild(timeoutMs: number): Promise<string | null> {
  const file = process.env[prebuildEnv];
  if (file === undefined || file === "") return null;
  const t0 = performance.now();
  for (;;) {
    const s = readPrebuild(file);
    if (s !== null && s.state !== "building")
      return `images prebuilt beside the suite: ${s.state}${s.reason ? ` (${s.reason})` : ""}${s.seconds !== undefined ? ` in ${s.seconds} s` : ""}`;
    if (s !== null && !alive(s.pid)) return "the images' prebuild ended without a result";
    if (performance.now() - t0 > timeoutMs) return `the images' prebuild still runs after ${timeoutMs / 1000} s`;
    await Bun.sleep(500);
  }
}
