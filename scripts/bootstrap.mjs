#!/usr/bin/env node
// Set-up that the two README commands run first. Plain Node (>= 20), no dependencies, so it
// works on a fresh Debian machine before `npm ci`. `--for run` (npm start) installs what the
// main job needs; `--for test` (npm test, and the default) adds what only the tests use.
//   1. Debian packages: OpenBLAS (OpenMP build), a C compiler and nats-server; for the tests also
//      a C++ compiler, flatc, chromium (the tests' browser), and docker.io, docker-compose and
//      debootstrap (the compose test runs the containers). Installed with apt-get when
//      running as root, one line per step (apt's own output only when it fails); otherwise the
//      exact command is printed and set-up goes on.
//   2. npm packages (Bun among them): `npm ci` (`--omit=dev` for run) when node_modules is
//      missing, older than package-lock.json, or lacks the development packages the tests need.
//   3. The C kernel library, compiled with the system C compiler (skipped with a message if the
//      compiler or OpenBLAS is still missing), the CUDA kernels compiled to PTX where nvcc is
//      present, and the services' compiled executable (services/build.ts).
// Quiet when everything is in place. MESHTRAIN_SKIP_BOOTSTRAP=1 skips it entirely. What it does
// goes to stdout, each command it runs printed exactly; only failures go to stderr.
import { execFile, spawnSync } from "node:child_process";
import { existsSync, readdirSync, readFileSync, statSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { aptUpdateReason } from "./apt.mjs";

const root = join(dirname(fileURLToPath(import.meta.url)), "..");
const log = (line) => console.log(`bootstrap: ${line}`);
const fail = (line) => console.error(`bootstrap: ${line}`);

if (process.env.MESHTRAIN_SKIP_BOOTSTRAP === "1") process.exit(0);

const purposes = ["run", "test"];
const forAt = process.argv.indexOf("--for");
const purpose = forAt === -1 ? "test" : process.argv[forAt + 1];
if (!purposes.includes(purpose)) {
  fail(`--for takes ${purposes.join(" or ")}, not ${purpose ?? "nothing"}`);
  process.exit(2);
}
const forTests = purpose === "test";

const major = Number(process.versions.node.split(".")[0]);
if (major < 20) {
  fail(`Node ${process.versions.node} is too old; meshtrain needs Node >= 20`);
  process.exit(1);
}

// ---- Debian packages -----------------------------------------------------------------------
const multiarch = process.arch === "arm64" ? "aarch64-linux-gnu" : "x86_64-linux-gnu";
const which = (cmd) => spawnSync("sh", ["-c", `command -v ${cmd}`], { stdio: "ignore" }).status === 0;

/** Each need: a check, and the Debian package that satisfies it. */
const needs = [
  {
    what: "OpenBLAS (OpenMP build)",
    pkg: "libopenblas0-openmp",
    ok: () =>
      [
        `/usr/lib/${multiarch}/openblas-openmp/libopenblas.so.0`,
        `/usr/lib/${multiarch}/openblas-pthread/libopenblas.so.0`,
        `/usr/lib/${multiarch}/libopenblas.so.0`,
      ].some((p) => existsSync(p)) || Boolean(process.env.MESHTRAIN_OPENBLAS),
  },
  { what: "a C compiler", pkg: "gcc", ok: () => which(process.env.CC || "cc") || which("gcc") || which("clang") },
  // the mesh: a local nats-server for the launcher and the tests
  {
    what: "nats-server",
    pkg: "nats-server",
    ok: () => which("nats-server") || Boolean(process.env.MESHTRAIN_NATS_SERVER),
  },
  // the tests run the CUDA kernels on a host emulator compiled as C++ (test/ffi/fixtures/cuda-emu)
  { what: "a C++ compiler", pkg: "g++", tests: true, ok: () => which("g++") },
  // the tests check that schemas/generated is what flatc makes (`bun run schemas`)
  { what: "the FlatBuffers compiler", pkg: "flatbuffers-compiler", tests: true, ok: () => which("flatc") },
  // the tests' browser: playwright-core drives it to check the live dashboard's page
  {
    what: "chromium (the tests' browser)",
    pkg: "chromium",
    tests: true,
    ok: () => which("chromium") || which("chromium-browser"),
  },
  // the compose test runs deploy/docker-compose.yml for real: a Docker engine (the test starts
  // dockerd itself as root), compose, and debootstrap for the base images (no image registry)
  { what: "a Docker engine", pkg: "docker.io", tests: true, ok: () => which("dockerd") || dockerAnswers() },
  {
    what: "docker-compose",
    pkg: "docker-compose",
    tests: true,
    ok: () => which("docker-compose") || spawnSync("docker", ["compose", "version"], { stdio: "ignore" }).status === 0,
  },
  // the test bed of hosts (testbed/hosts.ts): network namespaces, shaped links, dropped packets
  { what: "iproute2 (ip, tc)", pkg: "iproute2", tests: true, ok: () => which("ip") && which("tc") },
  { what: "iptables", pkg: "iptables", tests: true, ok: () => which("iptables") || existsSync("/usr/sbin/iptables") },
  {
    what: "debootstrap (the compose test's base images)",
    pkg: "debootstrap",
    tests: true,
    ok: () => which("debootstrap"),
  },
];

/** A Docker daemon answers (one this machine does not run itself: a remote or a desktop engine). */
function dockerAnswers() {
  return which("docker") && spawnSync("docker", ["info"], { stdio: "ignore", timeout: 10_000 }).status === 0;
}

const missing = needs.filter((n) => (forTests || !n.tests) && !n.ok());
if (missing.length > 0) {
  const pkgs = missing.map((n) => n.pkg);
  const isRoot = typeof process.getuid === "function" && process.getuid() === 0;
  if (isRoot && which("apt-get")) {
    aptInstall(missing, pkgs);
  } else {
    // a problem the user must fix, so stderr, though set-up goes on
    fail(`missing ${missing.map((n) => n.what).join(", ")}. Install with:`);
    fail(`  sudo apt-get update && sudo apt-get install -y ${pkgs.join(" ")}`);
    fail("continuing; commands that need them will fail with the same advice");
  }
}

/** apt-get install, after apt-get update when apt cannot see the packages yet (a fresh machine). */
function aptInstall(missing, pkgs) {
  const env = { ...process.env, DEBIAN_FRONTEND: "noninteractive" };
  const listsDir = "/var/lib/apt/lists";
  const lists = existsSync(listsDir) ? readdirSync(listsDir) : [];
  // LC_ALL=C: the "Candidate:" lines are translated in other locales
  const policy = spawnSync("apt-cache", ["policy", ...pkgs], {
    encoding: "utf8",
    stdio: ["ignore", "pipe", "ignore"],
    env: { ...env, LC_ALL: "C" },
  });
  const reason = aptUpdateReason(lists, policy.stdout ?? "", pkgs);
  if (reason !== null) {
    log(`${reason}; running: apt-get update`);
    // a failed update is reported; the install below then says which packages it cannot find
    quietly("apt-get", ["update"], env);
  }
  const args = ["install", "-y", "-q", "--no-install-recommends", ...pkgs];
  log(`installing ${missing.map((n) => n.what).join(", ")}: apt-get ${args.join(" ")}`);
  if (!quietly("apt-get", args, env)) fail(`install by hand: apt-get update && apt-get ${args.join(" ")}`);
}

/** Runs a command with its output kept back; on failure prints that output (its last 60 lines)
 *  to stderr. Whether it succeeded. */
function quietly(cmd, args, env) {
  const r = spawnSync(cmd, args, { env, encoding: "utf8", stdio: ["ignore", "pipe", "pipe"], maxBuffer: 256 << 20 });
  if (r.status === 0) return true;
  const out = `${r.stdout ?? ""}${r.stderr ?? ""}`.trimEnd().split("\n").slice(-60);
  for (const line of out) fail(`  ${line}`);
  fail(`${cmd} ${args[0]} failed (${r.error ? r.error.message : `exit ${r.status}`})`);
  return false;
}

// ---- npm packages --------------------------------------------------------------------------
const lock = join(root, "package-lock.json");
const stamp = join(root, "node_modules", ".meshtrain-lock-mtime");
const lockStamp = String(statSync(lock).mtimeMs) + ":" + readFileSync(lock).length;
const bunBinary = join(root, "node_modules", ".bin", "bun");
// the stamp: the lock it was installed from, and ":dev" when the development packages are in
const installed = existsSync(bunBinary) && existsSync(stamp) ? readFileSync(stamp, "utf8") : "";
const upToDate = installed === `${lockStamp}:dev` || (!forTests && installed === lockStamp);
if (!upToDate) {
  const args = ["ci", "--no-audit", "--no-fund", ...(forTests ? [] : ["--omit=dev"])];
  log(`installing npm packages${forTests ? "" : " (the ones the main job needs)"}: npm ${args.join(" ")}`);
  const r = spawnSync("npm", args, { cwd: root, stdio: "inherit" });
  if (r.status !== 0) {
    fail(`npm ci failed (exit ${r.status})`);
    process.exit(1);
  }
  writeFileSync(stamp, forTests ? `${lockStamp}:dev` : lockStamp);
}

// ---- native kernels ------------------------------------------------------------------------
if (needs.slice(0, 2).every((n) => n.ok())) {
  // the CPU kernels and, at the same time, the CUDA kernels as PTX where nvcc is present
  // (ffi/cuda/build.ts skips quietly without it) and the services' compiled executable (the
  // launchers run the sources while it is missing or out of date). With --quiet each prints one
  // line to stdout for what it built and nothing when it is up to date; compiler errors and
  // warnings go to stderr, passed through.
  const builds = [
    ["the CPU kernel library", "ffi/cpu/build.ts"],
    ["the CUDA kernels", "ffi/cuda/build.ts"],
    ["the services' executable", "services/build.ts"],
  ].map(
    ([what, script]) =>
      new Promise((resolve) => {
        execFile(
          bunBinary,
          [join(root, script), "--quiet"],
          { cwd: root, encoding: "utf8", maxBuffer: 64 << 20 },
          (error, stdout, stderr) => resolve({ what, error, stdout, stderr }),
        );
      }),
  );
  let failed = false;
  for (const { what, error, stdout, stderr } of await Promise.all(builds)) {
    if (stderr.trim() !== "") process.stderr.write(stderr);
    for (const line of stdout.split("\n")) if (line.trim() !== "") log(line);
    if (error) {
      fail(`building ${what} failed: ${error.message}`);
      failed = true;
    }
  }
  if (failed) process.exit(1);
}
