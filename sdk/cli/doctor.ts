// `meshtrain doctor`: what this machine has of meshtrain's native pieces, one line each: found
// where (and which version, where the piece says), or missing and the exact command that
// installs it. The CPU pieces (a C compiler, OpenBLAS, the kernel library built from them, and
// nats-server for a local mesh) are what the main job needs: doctor exits 1 when one is missing.
// The GPU pieces (the NVIDIA driver, cuBLAS, cuBLASLt, cuDNN, NCCL, nvcc for the kernels' PTX)
// are reported, never required.
import { existsSync, readFileSync } from "node:fs";
import { join } from "node:path";
import type { Command } from "commander";
import { compilerInstallHint, findCompiler, findOpenBLAS, openblasInstallHint } from "../../ffi/cpu/build.ts";
import { nativeBuildDir } from "../../ffi/build-dir.ts";
import { cublasInstallHint, findCublas } from "../../ffi/cuda/cublas.ts";
import { cublasLtInstallHint, findCublasLt } from "../../ffi/cuda/cublaslt.ts";
import { cudnnInstallHint, findCudnn } from "../../ffi/cuda/cudnn.ts";
import { findNvcc, nvccInstallHint } from "../../ffi/cuda/build.ts";
import { probeCuda } from "../../ffi/cuda/driver.ts";
import { ncclInstallHint, findNccl } from "../../ffi/cuda/nccl.ts";
import { natsServerBinary, natsServerInstallHint } from "../../services/runtime/mesh/nats-server.ts";

/** One piece: whether the main job needs it, and what was found. */
export interface Finding {
  what: string;
  /** "cpu": the main job needs it; "gpu": GPU training does */
  for: "cpu" | "gpu";
  found: boolean;
  /** where it is and its version (found), or what is missing and the command that installs it */
  detail: string;
}

/** The first line a program prints for `args` (its version), or "" where it prints none. */
function firstLine(bin: string, args: string[]): string {
  try {
    const r = Bun.spawnSync([bin, ...args], { stdout: "pipe", stderr: "pipe", timeout: 5_000 });
    const text = `${r.stdout.toString()}\n${r.stderr.toString()}`.trim();
    return text.split("\n").find((l) => l.trim() !== "") ?? "";
  } catch {
    return "";
  }
}

/** A lookup that throws where the piece is missing (its message names the install command). */
function lookup(what: string, of: Finding["for"], find: () => string, version: (at: string) => string): Finding {
  try {
    const at = find();
    const v = version(at);
    return { what, for: of, found: true, detail: v === "" ? at : `${at} (${v})` };
  } catch (e) {
    return { what, for: of, found: false, detail: (e as Error).message };
  }
}

/** A GPU library found by path, or the command that installs it. */
function library(what: string, path: string | null, hint: string): Finding {
  return path === null
    ? { what, for: "gpu", found: false, detail: `not found; ${hint}` }
    : { what, for: "gpu", found: true, detail: path };
}

/** The CPU kernel library: built where, or where it is built on first use. */
function kernelLibrary(): Finding {
  const dir = nativeBuildDir(join(import.meta.dir, "..", "..", "ffi", "cpu"));
  const lib = join(dir, "libmtkernels.so");
  return existsSync(lib)
    ? { what: "CPU kernel library", for: "cpu", found: true, detail: lib }
    : {
        what: "CPU kernel library",
        for: "cpu",
        found: true,
        detail: `not built yet: the first run compiles it into ${dir} (needs the C compiler and OpenBLAS)`,
      };
}

/** The path `find` gives, or null where it throws (the piece is missing). */
const tryOrNull = (find: () => string): string | null => {
  try {
    return find();
  } catch {
    return null;
  }
};

/** Every piece this machine has or lacks. */
export function doctorFindings(): Finding[] {
  const cuda = probeCuda();
  const nvcc = (() => {
    try {
      return findNvcc();
    } catch (e) {
      return e as Error;
    }
  })();
  return [
    {
      what: "Bun",
      for: "cpu",
      found: true,
      detail: `${process.execPath} (${Bun.version})`,
    },
    lookup("C compiler", "cpu", findCompiler, (cc) => firstLine(cc, ["--version"])),
    lookup("OpenBLAS", "cpu", findOpenBLAS, () => ""),
    kernelLibrary(),
    lookup("nats-server", "cpu", natsServerBinary, (bin) => firstLine(bin, ["--version"])),
    cuda.ok
      ? { what: "NVIDIA driver and GPU", for: "gpu", found: true, detail: cuda.reason }
      : { what: "NVIDIA driver and GPU", for: "gpu", found: false, detail: cuda.reason },
    library("cuBLAS", findCublas(), cublasInstallHint),
    library("cuBLASLt", findCublasLt(), cublasLtInstallHint),
    library("cuDNN", findCudnn(), cudnnInstallHint),
    library(
      "NCCL",
      tryOrNull(() => findNccl()),
      ncclInstallHint,
    ),
    nvcc instanceof Error
      ? { what: "nvcc (the CUDA kernels' PTX)", for: "gpu", found: false, detail: nvcc.message }
      : nvcc === null
        ? { what: "nvcc (the CUDA kernels' PTX)", for: "gpu", found: false, detail: `not found; ${nvccInstallHint}` }
        : { what: "nvcc (the CUDA kernels' PTX)", for: "gpu", found: true, detail: `${nvcc} (${nvccRelease(nvcc)})` },
  ];
}

/** "release 13.0" from nvcc --version's last line. */
const nvccRelease = (nvcc: string): string => {
  try {
    const r = Bun.spawnSync([nvcc, "--version"], { stdout: "pipe", timeout: 5_000 });
    return /release [\d.]+/.exec(r.stdout.toString())?.[0] ?? "version unknown";
  } catch {
    return "version unknown";
  }
};

/** The report's lines, and whether the main job can run. */
export function doctorReport(findings: readonly Finding[], version: string): { lines: string[]; canRun: boolean } {
  const width = Math.max(...findings.map((f) => f.what.length));
  const line = (f: Finding) => `  ${f.found ? "ok     " : "missing"}  ${f.what.padEnd(width)}  ${f.detail}`;
  const cpu = findings.filter((f) => f.for === "cpu");
  const gpu = findings.filter((f) => f.for === "gpu");
  const canRun = cpu.every((f) => f.found);
  const gpuReady = gpu.every((f) => f.found);
  return {
    canRun,
    lines: [
      `meshtrain ${version} on ${process.platform}-${process.arch}`,
      "the main job (CPU):",
      ...cpu.map(line),
      "GPU training (optional):",
      ...gpu.map(line),
      canRun
        ? `the main job can run here${gpuReady ? ", on the GPU too" : " (on the CPU)"}`
        : "the main job cannot run here: install what is missing above",
    ],
  };
}

/** meshtrain's version: its package.json's (in a clone and in an installed package alike). */
export function meshtrainVersion(): string {
  return (JSON.parse(readFileSync(join(import.meta.dir, "..", "..", "package.json"), "utf8")) as { version: string })
    .version;
}

export function addDoctorCommand(program: Command): void {
  program
    .command("doctor")
    .description("list meshtrain's native pieces on this machine: found where, or the command that installs them")
    .action(() => {
      const { lines, canRun } = doctorReport(doctorFindings(), meshtrainVersion());
      console.log(lines.join("\n"));
      process.exitCode = canRun ? 0 : 1;
    });
}
