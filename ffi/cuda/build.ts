// Compiles each ffi/cuda/kernels/<module>.cu to ffi/cuda/build/<module>.ptx with nvcc. The
// PTX targets compute_80 and the driver JIT-compiles it for the GPU it runs on (A100, H100,
// H200), so the build needs nvcc but no GPU. A module is rebuilt only when its source, the
// shared headers, the flags or the nvcc version change (a stamp file beside the PTX records
// them). Run directly (`bun ffi/cuda/build.ts`) at set-up; the CUDA backend also calls
// ensurePtx() so a fresh checkout just works.
import { createHash } from "node:crypto";
import { existsSync, mkdirSync, readdirSync, readFileSync, renameSync, rmSync, statSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { NativeLibraryError } from "../errors.ts";
import { nativeBuildDir } from "../build-dir.ts";
import { packageRoot } from "../package-root.ts";

/** element functions shared with the CPU kernels (ffi/numerics.h), included by some modules */
const numericsHeaderPath = join(packageRoot, "ffi", "numerics.h");

const here = join(packageRoot, "ffi", "cuda");
export const kernelSourceDir = join(here, "kernels");
const buildDir = nativeBuildDir(here);

export const nvccInstallHint =
  "install the CUDA toolkit (nvcc 12 or newer, https://developer.nvidia.com/cuda-downloads) " +
  "or set MESHTRAIN_NVCC to an nvcc binary";

const defaultNvccPaths = ["/usr/local/cuda/bin/nvcc"];

// -arch=compute_80: PTX only (no SASS), JIT-compiled by the driver for sm_80 and newer.
// -lineinfo: source lines in profiles (Nsight) at no runtime cost. No --use_fast_math: the
// kernels must match the CPU backend (expf, logf, tanhf, IEEE division and sqrt).
export const nvccFlags: readonly string[] = ["-ptx", "-arch=compute_80", "-O3", "-std=c++17", "-lineinfo"];

/** nvcc from MESHTRAIN_NVCC, then PATH, then /usr/local/cuda/bin; null when there is none. */
export function findNvcc(): string | null {
  const override = process.env.MESHTRAIN_NVCC;
  if (override !== undefined && override !== "") {
    // An explicit setting that points nowhere is a configuration error, not "no nvcc".
    if (!existsSync(override)) throw new NativeLibraryError(`MESHTRAIN_NVCC=${override} does not exist`);
    return override;
  }
  const onPath = Bun.which("nvcc");
  if (onPath !== null) return onPath;
  return defaultNvccPaths.find((p) => existsSync(p)) ?? null;
}

/** Module stems: every <stem>.cu in ffi/cuda/kernels, sorted. */
export function kernelSourceModules(): string[] {
  return readdirSync(kernelSourceDir)
    .filter((f) => f.endsWith(".cu"))
    .map((f) => f.slice(0, -".cu".length))
    .sort();
}

const versionCache = new Map<string, string>();
function nvccVersion(nvcc: string): string {
  const cached = versionCache.get(nvcc);
  if (cached !== undefined) return cached;
  const result = Bun.spawnSync([nvcc, "--version"], { stdout: "pipe", stderr: "pipe" });
  if (result.exitCode !== 0) {
    throw new NativeLibraryError(`${nvcc} --version failed (exit ${result.exitCode}):\n${result.stderr.toString()}`);
  }
  const version = result.stdout.toString().trim();
  versionCache.set(nvcc, version);
  return version;
}

interface Stamp {
  /** sha256 of the module source and every shared header */
  readonly source: string;
  readonly flags: string;
  /** `nvcc --version` of the compiler that wrote the PTX */
  readonly nvcc: string;
}

function sourceHash(module: string): string {
  const hash = createHash("sha256").update(readFileSync(join(kernelSourceDir, `${module}.cu`)));
  const headers = readdirSync(kernelSourceDir)
    .filter((f) => f.endsWith(".cuh"))
    .sort();
  for (const h of headers) hash.update(h).update(readFileSync(join(kernelSourceDir, h)));
  // the element functions shared with the CPU kernels
  hash.update(readFileSync(numericsHeaderPath));
  return hash.digest("hex");
}

function readStamp(path: string): Stamp | null {
  if (!existsSync(path)) return null;
  try {
    return JSON.parse(readFileSync(path, "utf8")) as Stamp;
  } catch {
    return null; // a torn or foreign stamp just means "rebuild"
  }
}

/** The nvcc command that compiles `module` to `tmp`. */
function compileArgs(nvcc: string, module: string, tmp: string): string[] {
  return [nvcc, ...nvccFlags, "-o", tmp, join(kernelSourceDir, `${module}.cu`)];
}

/** Ends a compile: the PTX renamed into place (a concurrent loader never sees a half-written
 *  file), its stamp written beside it; nvcc's warnings to `warn`. */
function finishCompile(
  job: PtxJob,
  tmp: string,
  exitCode: number | null,
  stderr: string,
  warn: (text: string) => void,
) {
  if (exitCode !== 0) {
    rmSync(tmp, { force: true });
    throw new NativeLibraryError(
      `compiling ${join(kernelSourceDir, `${job.module}.cu`)} failed (exit ${exitCode}):\n${stderr}`,
    );
  }
  if (stderr.trim() !== "") warn(stderr.trim());
  renameSync(tmp, job.ptxPath);
  const stampTmp = `${job.stampPath}.${process.pid}.tmp`;
  writeFileSync(stampTmp, JSON.stringify(job.stamp));
  renameSync(stampTmp, job.stampPath);
}

interface PtxJob {
  readonly module: string;
  readonly ptxPath: string;
  readonly stampPath: string;
  /** what the stamp will say once it is built */
  readonly stamp: Stamp;
}

/**
 * Every module's PTX path, and the modules to compile (missing or stale). Without nvcc, PTX
 * built earlier from the same sources and flags is used as it is, and a missing one throws.
 */
function ptxPlan(): { paths: Record<string, string>; stale: PtxJob[]; nvcc: string | null } {
  const nvcc = findNvcc();
  const flags = nvccFlags.join(" ");
  const paths: Record<string, string> = {};
  const stale: PtxJob[] = [];
  for (const module of kernelSourceModules()) {
    const ptxPath = join(buildDir, `${module}.ptx`);
    const stampPath = join(buildDir, `${module}.stamp`);
    const source = sourceHash(module);
    const stamp = readStamp(stampPath);
    const built = existsSync(ptxPath) && stamp !== null && stamp.source === source && stamp.flags === flags;
    if (nvcc === null) {
      if (!built) {
        throw new NativeLibraryError(
          `nvcc not found (checked MESHTRAIN_NVCC, PATH and ${defaultNvccPaths.join(", ")}) and ${ptxPath} ` +
            `is missing or stale; the CUDA backend needs the CUDA toolkit to build its kernels: ${nvccInstallHint}`,
        );
      }
    } else {
      const version = nvccVersion(nvcc);
      if (!built || stamp.nvcc !== version)
        stale.push({ module, ptxPath, stampPath, stamp: { source, flags, nvcc: version } });
    }
    paths[module] = ptxPath;
  }
  if (stale.length > 0) mkdirSync(buildDir, { recursive: true });
  return { paths, stale, nvcc };
}

/**
 * Paths of the PTX of every kernel module, compiling those that are missing or stale, one after
 * another. `log` gets one compile command per module it compiles; `warn` gets nvcc's warnings.
 */
export function ensurePtx(
  log: (line: string) => void = () => {},
  warn: (text: string) => void = log,
): Record<string, string> {
  const { paths, stale, nvcc } = ptxPlan();
  for (const job of stale) {
    const tmp = `${job.ptxPath}.${process.pid}.tmp`;
    const args = compileArgs(nvcc!, job.module, tmp);
    log(`building CUDA kernels: ${args.join(" ")}`);
    const result = Bun.spawnSync(args, { stdout: "pipe", stderr: "pipe" });
    finishCompile(job, tmp, result.exitCode, result.stderr.toString(), warn);
  }
  return paths;
}

/** ensurePtx with up to `parallel` compiles at once (the set-up's build: nvcc runs one core each). */
export async function ensurePtxParallel(
  parallel: number,
  log: (line: string) => void = () => {},
  warn: (text: string) => void = log,
): Promise<Record<string, string>> {
  const { paths, stale, nvcc } = ptxPlan();
  // the largest sources first (flash.cu alone is over half the CPU time): the last compile to
  // start is a short one, and the build ends sooner (26 -> 19 s on 2 cores, beside the C kernels)
  const size = new Map(stale.map((job) => [job, statSync(join(kernelSourceDir, `${job.module}.cu`)).size]));
  const queue = [...stale].sort((a, b) => size.get(b)! - size.get(a)!);
  const worker = async () => {
    for (let job = queue.shift(); job !== undefined; job = queue.shift()) {
      const tmp = `${job.ptxPath}.${process.pid}.tmp`;
      const args = compileArgs(nvcc!, job.module, tmp);
      log(`building CUDA kernels: ${args.join(" ")}`);
      const child = Bun.spawn(args, { stdout: "ignore", stderr: "pipe" });
      const [exitCode, stderr] = await Promise.all([child.exited, new Response(child.stderr).text()]);
      finishCompile(job, tmp, exitCode, stderr, warn);
    }
  };
  await Promise.all(Array.from({ length: Math.max(1, parallel) }, worker));
  return paths;
}

if (import.meta.main) {
  // Progress on stdout; nvcc's diagnostics on stderr. --quiet (set-up): one line if it compiled
  // any module, nothing if all were up to date or there is no nvcc.
  const quiet = process.argv.includes("--quiet");
  if (findNvcc() === null) {
    // Exit 0: set-up on a CPU-only machine must still succeed; the CPU backend needs no nvcc.
    if (!quiet) console.log(`CUDA kernels: nvcc not found, skipping (${nvccInstallHint})`);
  } else {
    let builtCount = 0;
    const progress = (line: string) => {
      builtCount++;
      if (!quiet) console.log(line);
    };
    const paths = await ensurePtxParallel(navigator.hardwareConcurrency, progress, (text) => console.error(text));
    if (!quiet) for (const [module, path] of Object.entries(paths)) console.log(`CUDA kernels ${module}: ${path}`);
    else if (builtCount > 0)
      console.log(
        `built the CUDA kernels: ${builtCount} of ${Object.keys(paths).length} modules to PTX in ${buildDir}`,
      );
  }
}
