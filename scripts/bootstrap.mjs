#!/usr/bin/env node
// Set-up that the two README commands run first. Plain Node (>= 20), no dependencies, so it
// works on a fresh Debian machine before `npm ci`:
//   1. Debian packages: OpenBLAS (OpenMP build), C and C++ compilers, nats-server and flatc. Installed with apt-get when
//      running as root; otherwise the exact command is printed and set-up goes on.
//   2. npm packages (Bun among them): `npm ci` when node_modules is missing or older than
//      package-lock.json.
//   3. The C kernel library and the NCCL shim, compiled with the system C compiler (skipped with
//      a message if the compiler or OpenBLAS is still missing), and the CUDA kernels compiled to
//      PTX where nvcc is present.
// Quiet when everything is in place. MESHTRAIN_SKIP_BOOTSTRAP=1 skips it entirely.
import { execFileSync, spawnSync } from "node:child_process";
import { existsSync, readFileSync, statSync, writeFileSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const root = join(dirname(fileURLToPath(import.meta.url)), "..");
const log = (line) => console.error(`bootstrap: ${line}`);

if (process.env.MESHTRAIN_SKIP_BOOTSTRAP === "1") process.exit(0);

const major = Number(process.versions.node.split(".")[0]);
if (major < 20) {
  log(`Node ${process.versions.node} is too old; meshtrain needs Node >= 20`);
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
    ok: () => [`/usr/lib/${multiarch}/openblas-openmp/libopenblas.so.0`, `/usr/lib/${multiarch}/openblas-pthread/libopenblas.so.0`,
      `/usr/lib/${multiarch}/libopenblas.so.0`].some((p) => existsSync(p)) || Boolean(process.env.MESHTRAIN_OPENBLAS),
  },
  { what: "a C compiler", pkg: "gcc", ok: () => which(process.env.CC || "cc") || which("gcc") || which("clang") },
  // the tests run the CUDA kernels on a host emulator compiled as C++ (test/ffi/fixtures/cuda-emu)
  { what: "a C++ compiler", pkg: "g++", ok: () => which("g++") },
  // the mesh: a local nats-server for the launcher and the tests, flatc for `bun run schemas`
  { what: "nats-server", pkg: "nats-server", ok: () => which("nats-server") || Boolean(process.env.MESHTRAIN_NATS_SERVER) },
  { what: "the FlatBuffers compiler", pkg: "flatbuffers-compiler", ok: () => which("flatc") },
];

const missing = needs.filter((n) => !n.ok());
if (missing.length > 0) {
  const pkgs = missing.map((n) => n.pkg);
  const isRoot = typeof process.getuid === "function" && process.getuid() === 0;
  if (isRoot && which("apt-get")) {
    log(`installing ${missing.map((n) => n.what).join(", ")}: apt-get install -y ${pkgs.join(" ")}`);
    const env = { ...process.env, DEBIAN_FRONTEND: "noninteractive" };
    const install = () => spawnSync("apt-get", ["install", "-y", "-q", "--no-install-recommends", ...pkgs], { stdio: "inherit", env });
    let r = install();
    if (r.status !== 0) {
      // a fresh machine has no package lists yet
      spawnSync("apt-get", ["update", "-q"], { stdio: "inherit", env });
      r = install();
    }
    if (r.status !== 0) log(`apt-get failed (exit ${r.status}); install by hand: apt-get install -y ${pkgs.join(" ")}`);
  } else {
    log(`missing ${missing.map((n) => n.what).join(", ")}. Install with:`);
    log(`  sudo apt-get update && sudo apt-get install -y ${pkgs.join(" ")}`);
    log("continuing; commands that need them will fail with the same advice");
  }
}

// ---- npm packages --------------------------------------------------------------------------
const lock = join(root, "package-lock.json");
const stamp = join(root, "node_modules", ".meshtrain-lock-mtime");
const lockStamp = String(statSync(lock).mtimeMs) + ":" + readFileSync(lock).length;
const bunBinary = join(root, "node_modules", ".bin", "bun");
const upToDate = existsSync(bunBinary) && existsSync(stamp) && readFileSync(stamp, "utf8") === lockStamp;
if (!upToDate) {
  log("installing npm packages (npm ci)");
  const r = spawnSync("npm", ["ci", "--no-audit", "--no-fund"], { cwd: root, stdio: "inherit" });
  if (r.status !== 0) {
    log(`npm ci failed (exit ${r.status})`);
    process.exit(1);
  }
  writeFileSync(stamp, lockStamp);
}

// ---- native kernels ------------------------------------------------------------------------
if (needs.slice(0, 2).every((n) => n.ok())) {
  // the CPU kernels; the NCCL shim (it builds without NCCL installed); the CUDA kernels as PTX
  // where nvcc is present (ffi/cuda/build.ts skips quietly without it)
  for (const [what, script] of [["the CPU kernel library", "ffi/cpu/build.ts"], ["the NCCL shim", "ffi/nccl/build.ts"],
    ["the CUDA kernels", "ffi/cuda/build.ts"]]) {
    try {
      execFileSync(bunBinary, [join(root, script), "--quiet"], { cwd: root, stdio: ["ignore", "ignore", "inherit"] });
    } catch (e) {
      log(`building ${what} failed: ${e.message}`);
      process.exit(1);
    }
  }
}
