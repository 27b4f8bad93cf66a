// Builds ffi/cuda/nccl-shim.c (the by-value ncclUniqueId call bun:ffi cannot make) into
// ffi/cuda/build/libmtnccl.so with the system C compiler. It needs neither nccl.h nor libnccl,
// so every machine builds it; NCCL itself is dlopen'ed at run time. Rebuilt only when the
// source or flags change (a stamp file beside it records them). Run directly
// (`bun ffi/cuda/nccl-build.ts`); ffi/cuda/nccl.ts calls ensureNcclShim() too, so a fresh checkout
// just works.
import { createHash } from "node:crypto";
import { existsSync, mkdirSync, readFileSync, renameSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { NativeLibraryError } from "../errors.ts";
import { findCompiler } from "../cpu/build.ts";
import { nativeBuildDir } from "../build-dir.ts";
import { packageRoot } from "../package-root.ts";

const here = join(packageRoot, "ffi", "cuda");
export const shimSourcePath = join(here, "nccl-shim.c");
const buildDir = nativeBuildDir(here);
export const shimLibraryPath = join(buildDir, "libmtnccl.so");
const stampPath = join(buildDir, "libmtnccl.stamp");

// No -march=native: the shim is a handful of calls, nothing to vectorize. -pthread for the
// fallback init thread; -ldl for dlopen on glibc older than 2.34 (harmless after).
const flags = ["-O2", "-fPIC", "-shared", "-std=c11", "-Wall", "-Wextra", "-Werror", "-pthread"];
const libs = ["-ldl"];

/** Path of the compiled shim, compiling it first if it is missing or stale; `log` gets the compile command. */
export function ensureNcclShim(log: (line: string) => void = () => {}): string {
  const source = readFileSync(shimSourcePath);
  const stamp = createHash("sha256")
    .update(source)
    .update([...flags, ...libs].join(" "))
    .digest("hex");
  if (existsSync(shimLibraryPath) && existsSync(stampPath) && readFileSync(stampPath, "utf8") === stamp) {
    return shimLibraryPath; // a machine (an image) with the shim built needs no compiler
  }
  const cc = findCompiler();
  mkdirSync(buildDir, { recursive: true });
  // Build to a temporary name and rename: a concurrent loader never sees a half-written file.
  const tmp = `${shimLibraryPath}.${process.pid}.tmp`;
  const args = [cc, ...flags, "-o", tmp, shimSourcePath, ...libs];
  log(`building the NCCL shim: ${args.join(" ")}`);
  const result = Bun.spawnSync(args, { stdout: "pipe", stderr: "pipe" });
  if (result.exitCode !== 0) {
    rmSync(tmp, { force: true });
    throw new NativeLibraryError(
      `compiling ${shimSourcePath} failed (exit ${result.exitCode}):\n${result.stderr.toString()}`,
    );
  }
  renameSync(tmp, shimLibraryPath);
  writeFileSync(stampPath, stamp);
  return shimLibraryPath;
}

if (import.meta.main) {
  // Progress on stdout; a compile error is thrown (stderr). --quiet (set-up): one line if it
  // built the shim, nothing if it was up to date.
  const quiet = process.argv.includes("--quiet");
  let built = false;
  const path = ensureNcclShim((line) => {
    built = true;
    if (!quiet) console.log(line);
  });
  if (!quiet) console.log(`NCCL shim: ${path}`);
  else if (built) console.log(`built the NCCL shim: ${path}`);
}
