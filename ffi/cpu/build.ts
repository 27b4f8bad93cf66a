// Builds the CPU kernels (ffi/cpu/kernels.c, attention.c, compress.c) into a shared library with the system C compiler, and finds
// Debian's OpenBLAS. The library is rebuilt only when the source, flags or OpenBLAS path
// change (a stamp file beside it records them). Run directly (`bun ffi/cpu/build.ts`) at
// set-up; the CPU backend also calls ensureKernelLibrary() so a fresh checkout just works.
import { createHash } from "node:crypto";
import {
  closeSync,
  existsSync,
  mkdirSync,
  openSync,
  readFileSync,
  renameSync,
  statSync,
  unlinkSync,
  writeFileSync,
  writeSync,
} from "node:fs";
import { hostname } from "node:os";
import { join } from "node:path";
import { NativeLibraryError } from "../errors.ts";
import { nativeBuildDir } from "../build-dir.ts";
import { packageRoot } from "../package-root.ts";

const here = join(packageRoot, "ffi", "cpu");
/** The kernel library's sources (one library of three translation units) and the header they share. */
export const kernelSourcePaths = ["kernels.c", "attention.c", "compress.c"].map((f) => join(here, f));
const kernelHeaderPath = join(here, "kernels.h");
export const numericsHeaderPath = join(here, "..", "numerics.h");
const buildDir = nativeBuildDir(here);
const libraryPath = join(buildDir, "libmtkernels.so");
const stampPath = join(buildDir, "libmtkernels.stamp");
/** held while one process builds, so that processes starting together (a compose mesh's
 *  services sharing one cache volume) build the library once, not once each */
const lockPath = join(buildDir, "libmtkernels.lock");
/** a lock older than this was left by a builder that died: it is taken over */
const lockStaleMs = 180_000;

// Debian's multiarch triplets for the machines we run on.
const multiarch = process.arch === "arm64" ? "aarch64-linux-gnu" : "x86_64-linux-gnu";

// The OpenMP build first: measured 130-190 GFLOP/s against 95-120 for the pthread build on
// the 2-core machine, and inside our own OpenMP regions (batched attention GEMMs) it runs
// each call single-threaded instead of oversubscribing.
const openblasCandidates = [
  `/usr/lib/${multiarch}/openblas-openmp/libopenblas.so.0`,
  `/usr/lib/${multiarch}/openblas-pthread/libopenblas.so.0`,
  `/usr/lib/${multiarch}/libopenblas.so.0`,
];

export const openblasInstallHint = "apt-get install -y libopenblas0-openmp";
export const compilerInstallHint = "apt-get install -y gcc";

export function findOpenBLAS(): string {
  const override = process.env.MESHTRAIN_OPENBLAS;
  if (override !== undefined && override !== "") {
    if (!existsSync(override)) {
      throw new NativeLibraryError(`MESHTRAIN_OPENBLAS=${override} does not exist`);
    }
    return override;
  }
  const found = openblasCandidates.find((p) => existsSync(p));
  if (found === undefined) {
    throw new NativeLibraryError(
      `OpenBLAS not found (looked in ${openblasCandidates.join(", ")}); install it with: ${openblasInstallHint}`,
    );
  }
  return found;
}

/** The system C compiler: $CC, else cc, gcc or clang. Shared with ffi/cuda/nccl-build.ts. */
export function findCompiler(): string {
  const override = process.env.CC;
  const candidates = override !== undefined && override !== "" ? [override] : ["cc", "gcc", "clang"];
  for (const c of candidates) {
    if (Bun.which(c) !== null) return c;
  }
  throw new NativeLibraryError(
    `no C compiler found (tried ${candidates.join(", ")}); install one with: ${compilerInstallHint}`,
  );
}

function compileFlags(): string[] {
  // -march=native: the library is built on the machine that runs it (at set-up, or in the
  // container at start). -fno-math-errno lets expf/tanhf inline; no -ffast-math, because
  // the non-finite checks (isfinite) and NaN propagation must stay exact.
  const extra = process.env.MESHTRAIN_CFLAGS;
  const arch = extra !== undefined && extra !== "" ? extra.split(/\s+/) : ["-march=native"];
  return ["-O3", ...arch, "-fopenmp", "-fPIC", "-shared", "-std=c11", "-fno-math-errno", "-Wall", "-Wextra"];
}

/**
 * Path of the compiled kernel library, compiling it first if it is missing or stale. `log` gets
 * the compile command when it compiles; `warn` gets the compiler's warnings.
 */
export function ensureKernelLibrary(
  log: (line: string) => void = () => {},
  warn: (text: string) => void = log,
): { kernels: string; openblas: string } {
  const openblas = findOpenBLAS();
  // the sources, their header, and the header they share with the CUDA kernels
  const source = Buffer.concat(
    [...kernelSourcePaths, kernelHeaderPath, numericsHeaderPath].map((path) => readFileSync(path)),
  );
  const flags = compileFlags();
  const stamp = createHash("sha256").update(source).update(flags.join(" ")).update(openblas).digest("hex");
  const upToDate = () => existsSync(libraryPath) && existsSync(stampPath) && readFileSync(stampPath, "utf8") === stamp;
  if (upToDate()) return { kernels: libraryPath, openblas };
  const cc = findCompiler();
  mkdirSync(buildDir, { recursive: true });
  const release = buildLock(upToDate);
  if (release === null) return { kernels: libraryPath, openblas }; // another process built it
  try {
    build(cc, flags, openblas, stamp, log, warn);
  } finally {
    release();
  }
  return { kernels: libraryPath, openblas };
}

/**
 * The build's lock, or null once `done` says another process has built the library meanwhile.
 * Waits (polling) while another process holds it.
 */
function buildLock(done: () => boolean): (() => void) | null {
  for (;;) {
    try {
      const fd = openSync(lockPath, "wx", 0o644);
      writeSync(fd, `${hostname()} ${process.pid}\n`);
      closeSync(fd);
      const release = () => {
        try {
          unlinkSync(lockPath);
        } catch {
          // taken over as stale: not ours to remove any more
        }
      };
      if (!done()) return release;
      release();
      return null;
    } catch (e) {
      if ((e as NodeJS.ErrnoException).code !== "EEXIST") throw e;
    }
    if (done()) return null;
    let ageMs = 0;
    try {
      ageMs = Date.now() - statSync(lockPath).mtimeMs;
    } catch {
      continue; // released just now
    }
    if (ageMs > lockStaleMs) {
      try {
        unlinkSync(lockPath);
      } catch {
        // another waiter took it over first
      }
      continue;
    }
    Bun.sleepSync(200);
  }
}

function build(
  cc: string,
  flags: string[],
  openblas: string,
  stamp: string,
  log: (line: string) => void,
  warn: (text: string) => void,
): void {
  // Build to a temporary name and rename: a concurrent loader never sees a half-written file.
  const tmp = `${libraryPath}.${process.pid}.tmp`;
  const args = [cc, ...flags, "-o", tmp, ...kernelSourcePaths, openblas, `-Wl,-rpath,${join(openblas, "..")}`, "-lm"];
  log(`building CPU kernels: ${args.join(" ")}`);
  const result = Bun.spawnSync(args, { stdout: "pipe", stderr: "pipe" });
  if (result.exitCode !== 0) {
    throw new NativeLibraryError(
      `compiling ${kernelSourcePaths.join(", ")} failed (exit ${result.exitCode}):\n${result.stderr.toString()}`,
    );
  }
  const warnings = result.stderr.toString().trim();
  if (warnings !== "") warn(warnings);
  renameSync(tmp, libraryPath);
  writeFileSync(stampPath, stamp);
}

if (import.meta.main) {
  // Progress on stdout; compiler diagnostics on stderr. --quiet (set-up): one line if it built
  // the library, nothing if it was up to date.
  const quiet = process.argv.includes("--quiet");
  let built = false;
  const progress = (line: string) => {
    built = true;
    if (!quiet) console.log(line);
  };
  const { kernels, openblas } = ensureKernelLibrary(progress, (text) => console.error(text));
  if (!quiet) console.log(`CPU kernels: ${kernels}\nOpenBLAS:    ${openblas}`);
  else if (built) console.log(`built the CPU kernels: ${kernels}`);
}
