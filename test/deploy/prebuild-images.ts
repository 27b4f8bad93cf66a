// Builds the compose test's images beside the suite (test/helpers/compose-images.ts says why):
// `bun test/deploy/prebuild-images.ts STATE_FILE`, started by scripts/test.ts. It finds the Docker
// engine (starting dockerd as root where none answers), builds what is missing, and writes
// {pid, state, reason, seconds} to STATE_FILE: "building" first, then "ready", "failed" or
// "skipped". A dockerd it started keeps running for the compose test until this process gets
// SIGTERM or SIGINT (scripts/test.ts sends it after the suite); then it stops that dockerd and
// exits.
import { renameSync, writeFileSync } from "node:fs";
import { buildImages, daemonStartMs, findEngine, type PrebuildState } from "../helpers/compose-images.ts";

const stateFile = process.argv[2] ?? "";
if (stateFile === "") {
  console.error("usage: bun test/deploy/prebuild-images.ts STATE_FILE");
  process.exit(2);
}

/** Written whole (a rename), so that a reader never sees half a file. */
function write(state: PrebuildState["state"], more: Partial<PrebuildState> = {}): void {
  const s: PrebuildState = { pid: process.pid, state, ...more };
  writeFileSync(`${stateFile}.tmp`, JSON.stringify(s));
  renameSync(`${stateFile}.tmp`, stateFile);
}

const stopped = Promise.withResolvers<void>();
for (const signal of ["SIGTERM", "SIGINT"] as const) process.on(signal, () => stopped.resolve());

write("building");
const t0 = performance.now();
const engine = await findEngine();
if (typeof engine === "string") {
  write("skipped", { reason: engine });
  process.exit(0);
}
try {
  await buildImages(engine.compose, `mt-prebuild-${process.pid}`);
  write("ready", { seconds: Math.round((performance.now() - t0) / 1000) });
} catch (e) {
  // the compose test builds again and fails with the reason; this line is for the suite's log
  const reason = (e as Error).message.replace(/\s+/g, " ").slice(0, 500);
  write("failed", { reason, seconds: Math.round((performance.now() - t0) / 1000) });
}
if (engine.daemon !== null) {
  await stopped.promise;
  engine.daemon.kill("SIGTERM");
  // dockerd stops its containerd and the shims first: a few seconds, more on a loaded machine
  const timer = setTimeout(() => engine.daemon?.kill("SIGKILL"), daemonStartMs);
  await engine.daemon.exited;
  clearTimeout(timer);
}
process.exit(0);
