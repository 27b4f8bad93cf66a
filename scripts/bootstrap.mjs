#!/usr/bin/env node
// Set-up that the two README commands run first. Plain Node (>= 20), no dependencies, so it
// works on a fresh Debian machine before `npm ci`:
//   1. Debian packages: OpenBLAS (OpenMP build), C and C++ compilers, nats-server, flatc and
//      chromium (the tests' browser). Installed with apt-get when running as root; otherwise the
//      exact command is printed and set-up goes on.
//   2. npm packages (Bun among them): `npm ci` when node_modules is missing or older than
//      package-lock.json.
//   3. The C kernel library and the NCCL shim, compiled with the system C compiler (skipped with
//      a message if the compiler or OpenBLAS is still missing), and the CUDA kernels compiled to
//      PTX where nvcc is present.
// Quiet when everything is in place. MESHTRAIN_SKIP_BOOTSTRAP=1 skips it entirely. What it does
// goes to stdout, each command it runs printed exactly; only failures go to stderr.
import { execFileSync, spawnSync } from "node:child_process";
import { existsSync, readdirSync, readFileSync, statSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { aptUpdateReason } from "./apt.mjs";

const root = join(dirname(fileURLToPath(import.meta.url)), "..");
const log = (line) => console.log(`bootstrap: ${line}`);
const fail = (line) => console.error(`bootstrap: ${line}`);

if (process.env.MESHTRAIN_SKIP_BOOTSTRAP === "1") process.exit(0);

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
  // the tests run the CUDA kernels on a host emulator compiled as C++ (test/ffi/fixtures/cuda-emu)
  { what: "a C++ compiler", pkg: "g++", ok: () => which("g++") },
  // the mesh: a local nats-server for the launcher and the tests, flatc for `bun run schemas`
  { what: "nats-server", pkg: "nats-server", ok: () => which("nats-server") || Boolean(process.env.MESHTRAIN_NATS_SERVER) },
  { what: "the FlatBuffers compiler", pkg: "flatbuffers-compiler", ok: () => which("flatc") },
  // the tests' browser: playwright-core drives it to check the live dashboard's page
  { what: "chromium (the tests' browser)", pkg: "chromium", ok: () => which("chromium") || which("chromium-browser") },
];

const missing = needs.filter((n) => !n.ok());
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
  const policy = spawnSync("apt-cache", ["policy", ...pkgs], { encoding: "utf8", stdio: ["ignore", "pipe", "ignore"], env: { ...env, LC_ALL: "C" } });
  const reason = aptUpdateReason(lists, policy.stdout ?? "", pkgs);
  if (reason !== null) {
    log(`${reason}; running: apt-get update`);
    const u = spawnSync("apt-get", ["update"], { stdio: "inherit", env });
    // a failed update is reported; the install below then says which packages it cannot find
    if (u.status !== 0) fail(`apt-get update failed (exit ${u.status})`);
  }
  const args = ["install", "-y", "-q", "--no-install-recommends", ...pkgs];
  log(`installing ${missing.map((n) => n.what).join(", ")}: apt-get ${args.join(" ")}`);
  const r = spawnSync("apt-get", args, { stdio: "inherit", env });
  if (r.status !== 0) fail(`apt-get failed (exit ${r.status}); install by hand: apt-get update && apt-get ${args.join(" ")}`);
}

// ---- npm packages --------------------------------------------------------------------------
const lock = join(root, "package-lock.json");
const stamp = join(root, "node_modules", ".meshtrain-lock-mtime");
const lockStamp = String(statSync(lock).mtimeMs) + ":" + readFileSync(lock).length;
const bunBinary = join(root, "node_modules", ".bin", "bun");
const upToDate = existsSync(bunBinary) && existsSync(stamp) && readFileSync(stamp, "utf8") === lockStamp;
if (!upToDate) {
  const args = ["ci", "--no-audit", "--no-fund"];
  log(`installing npm packages: npm ${args.join(" ")}`);
  const r = spawnSync("npm", args, { cwd: root, stdio: "inherit" });
  if (r.status !== 0) {
    fail(`npm ci failed (exit ${r.status})`);
    process.exit(1);
  }
  writeFileSync(stamp, lockStamp);
}

// ---- native kernels ------------------------------------------------------------------------
if (needs.slice(0, 2).every((n) => n.ok())) {
  // the CPU kernels; the NCCL shim (it builds without NCCL installed); the CUDA kernels as PTX
  // where nvcc is present (ffi/cuda/build.ts skips quietly without it). With --quiet each
  // prints one line to stdout for what it built and nothing when it is up to date; compiler
  // errors and warnings go to stderr, passed through.
  for (const [what, script] of [
    ["the CPU kernel library", "ffi/cpu/build.ts"],
    ["the NCCL shim", "ffi/nccl/build.ts"],
    ["the CUDA kernels", "ffi/cuda/build.ts"],
  ]) {
    let out;
    try {
      out = execFileSync(bunBinary, [join(root, script), "--quiet"], { cwd: root, encoding: "utf8", stdio: ["ignore", "pipe", "inherit"] });
    } catch (e) {
      fail(`building ${what} failed: ${e.message}`);
      process.exit(1);
    }
    for (const line of out.split("\n")) if (line.trim() !== "") log(line);
  }
}
