// The CUDA backend on the host, for machines without a GPU: the real CudaBackend code (driver
// binding, caching allocator, pinned staging, kernel-argument block, scratch reads, cuBLAS
// argument marshalling and the row-major swap) over fake-cuda.c, whose cuLaunchKernel runs
// each kernel of ffi/cuda/kernels/*.cu compiled by g++ against the host CUDA emulator
// (fixtures/cuda-emu), and fake-cublas.c, whose GEMMs are column-major loops that check their
// arguments as cuBLAS documents them, and fake-cublaslt.c, the same loops with the linear layers'
// epilogues (bias, GELU, bias gradient) that every emulated backend fuses. fake-cudnn.c checks the fused-attention graphs the cuDNN
// binding builds and computes attention on the host; only backends asked for with
// cudnnBackend() load it (backend() is made as before, without a cudnnPath).
//
// Everything is built once into .test-results/emulated-cuda/<hash of the sources>/ and reused
// by later runs; the build needs g++ and cc. The PTX the backend loads at start needs nvcc (or
// PTX built earlier); the fake driver accepts it without compiling it.
import { dlopen, ptr } from "bun:ffi";
import { createHash } from "node:crypto";
import { existsSync, mkdirSync, readdirSync, readFileSync, renameSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import type { AttentionChoice } from "../../ffi/cuda/attention-path.ts";
import { CudaBackend, type CudaBackendOptions } from "../../ffi/cuda/backend.ts";
import { findNvcc } from "../../ffi/cuda/build.ts";
import { Driver } from "../../ffi/cuda/driver.ts";
import { kernelSpecs } from "../../ffi/cuda/kernels.ts";
import type { Backend } from "../../ffi/backend.ts";
import { cudaSkipReason, testBackends } from "./numeric.ts";

const root = join(import.meta.dir, "..", "..");
const fixtures = join(root, "test", "ffi", "fixtures");
export const emuDir = join(fixtures, "cuda-emu");
const kernelsDir = join(root, "ffi", "cuda", "kernels");

// -ffp-contract=off: no fused multiply-adds the CPU backend would not do either (GCC contracts by
// default on targets with FMA, such as aarch64).
const cxxFlags = ["-std=c++20", "-O2", "-ffp-contract=off", "-fPIC", "-pthread", "-Wall", "-Wno-unused-variable"];

/** One translation unit per kernel module: the emulator header, the .cu file, and a registration
 *  line per kernel in kernelSpecs (so a kernel missing from the .cu fails to compile). */
function translationUnits(): Map<string, string> {
  const byModule = new Map<string, string[]>();
  for (const [name, spec] of Object.entries(kernelSpecs)) {
    byModule.set(spec.module, [...(byModule.get(spec.module) ?? []), name]);
  }
  const units = new Map<string, string>();
  for (const [module, names] of byModule) {
    const source = join(kernelsDir, `${module}.cu`);
    units.set(
      `gen_${module}.cpp`,
      `#include "emu.h"\n#include ${JSON.stringify(source)}\n${names.map((n) => `EMU_REGISTER(${n})`).join("\n")}\n`,
    );
  }
  return units;
}

async function run(cmd: string[], cwd: string): Promise<void> {
  const proc = Bun.spawn(cmd, { cwd, stdout: "pipe", stderr: "pipe" });
  const [stderr, code] = await Promise.all([new Response(proc.stderr).text(), proc.exited]);
  if (code !== 0) throw new Error(`${cmd.join(" ")} failed (exit ${code}):\n${stderr}`);
}

/** Builds libemu.so in dir: objects compiled in parallel, then linked. */
export async function buildEmulator(dir: string): Promise<string> {
  const gxx = Bun.which("g++");
  if (gxx === null) throw new Error("g++ not found on PATH");
  const sources = [join(emuDir, "emu.cpp")];
  for (const [file, text] of translationUnits()) {
    writeFileSync(join(dir, file), text);
    sources.push(join(dir, file));
  }
  const objects = sources.map((_, i) => join(dir, `unit${i}.o`));
  await Promise.all(sources.map((s, i) => run([gxx, ...cxxFlags, `-I${emuDir}`, "-c", s, "-o", objects[i]!], dir)));
  const lib = join(dir, "libemu.so");
  await run([gxx, "-shared", "-pthread", "-o", lib, ...objects], dir);
  return lib;
}

/** The fake cuDNN's pieces (fake-cudnn.h says what each holds), compiled together into
 *  libfakecudnn.so. */
const fakeCudnnSources = [
  "fake-cudnn.c",
  "fake-cudnn-finalize.c",
  "fake-cudnn-pattern.c",
  "fake-cudnn-execute.c",
  "fake-cudnn-json.c",
];

/** Hash of everything the build reads, so a changed kernel or fake rebuilds. */
function sourcesHash(): string {
  const h = createHash("sha256").update(JSON.stringify(kernelSpecs)).update(cxxFlags.join(" "));
  const files = [
    ...readdirSync(kernelsDir).map((f) => join(kernelsDir, f)),
    ...readdirSync(emuDir).map((f) => join(emuDir, f)),
    join(fixtures, "fake-cuda.c"),
    join(fixtures, "fake-cublas.c"),
    ...[...fakeCudnnSources, "fake-cudnn.h"].map((f) => join(fixtures, f)),
    join(fixtures, "fake-cublaslt.c"),
    join(fixtures, "emulated-nccl.c"),
    join(fixtures, "nccl-types.h"),
    join(root, "ffi", "numerics.h"),
  ].sort();
  for (const f of files) h.update(f).update(readFileSync(f));
  return h.digest("hex").slice(0, 16);
}

export interface Built {
  emulator: string;
  fakeCuda: string;
  fakeCublas: string;
  fakeCudnn: string;
  fakeCublasLt: string;
  emulatedNccl: string;
}

async function build(): Promise<Built> {
  const dir = join(root, ".test-results", "emulated-cuda", sourcesHash());
  const built: Built = {
    emulator: join(dir, "libemu.so"),
    fakeCuda: join(dir, "libfakecuda.so"),
    fakeCublas: join(dir, "libfakecublas.so"),
    fakeCudnn: join(dir, "libfakecudnn.so"),
    fakeCublasLt: join(dir, "libfakecublaslt.so"),
    emulatedNccl: join(dir, "libemulatednccl.so"),
  };
  if (Object.values(built).every((p) => existsSync(p))) return built;
  // build in a fresh folder and rename, so a concurrent or interrupted build leaves nothing half-written
  const tmp = `${dir}.${process.pid}.tmp`;
  rmSync(tmp, { recursive: true, force: true });
  mkdirSync(tmp, { recursive: true });
  const cc = (src: string | string[], out: string, libs = ["-ldl"]) => {
    const sources = (Array.isArray(src) ? src : [src]).map((f) => join(fixtures, f));
    return run(["cc", "-shared", "-fPIC", "-O2", "-Wall", "-o", join(tmp, out), ...sources, ...libs], tmp);
  };
  await Promise.all([
    buildEmulator(tmp),
    cc("fake-cuda.c", "libfakecuda.so"),
    cc("fake-cublas.c", "libfakecublas.so"),
    cc(fakeCudnnSources, "libfakecudnn.so", ["-lm"]),
    cc("fake-cublaslt.c", "libfakecublaslt.so", ["-lm"]),
    cc("emulated-nccl.c", "libemulatednccl.so", ["-lm", "-pthread"]),
  ]);
  // another worker's build of the same sources may have landed first: keep it (a process may
  // have loaded its libraries already), drop this one
  if (Object.values(built).every((p) => existsSync(p))) {
    rmSync(tmp, { recursive: true, force: true });
    return built;
  }
  rmSync(dir, { recursive: true, force: true });
  try {
    renameSync(tmp, dir);
  } catch (e) {
    // renamed by another worker between the check and here
    rmSync(tmp, { recursive: true, force: true });
    if (!Object.values(built).every((p) => existsSync(p))) throw e;
    return built;
  }
  // builds of earlier sources are of no further use
  const parent = join(dir, "..");
  for (const old of readdirSync(parent))
    if (join(parent, old) !== dir && !old.endsWith(".tmp")) rmSync(join(parent, old), { recursive: true, force: true });
  return built;
}

/** Every fake library (built once into .test-results), for scripts/emulated-gpus.ts. */
export function emulatedLibraries(): Promise<Readonly<Built>> {
  return build();
}

/** The emulator library (libemu.so), built once into .test-results like the rest. */
export async function emulatorLibrary(): Promise<string> {
  return (await build()).emulator;
}

/** emulated-nccl.c: an NCCL whose ranks are processes on this machine, summing their (emulated
 *  device) buffers through shared memory; built once into .test-results like the rest. */
export async function emulatedNcclLibrary(): Promise<string> {
  return (await build()).emulatedNccl;
}

/** What the fake driver under the emulated backend recorded: kernel launches, and the launch
 *  count at each cuStreamSynchronize (where the host waited on the GPU). */
export interface Timeline {
  reset(): void;
  launches(): string[];
  /** for each stream synchronization, how many kernels had been launched before it */
  streamSyncs(): number[];
}

export type EmulatedCuda =
  | {
      ok: true;
      backend: () => CudaBackend;
      timeline: Timeline;
      /** a backend over the same fake driver whose cuDNN is fake-cudnn.c, one per choice */
      cudnnBackend: (attention: AttentionChoice) => CudaBackend;
      /** a new backend over the same fake driver and fake libraries, with these options (the
       *  caller disposes of it) */
      backendWith: (options: Omit<CudaBackendOptions, "driver">) => CudaBackend;
    }
  | { ok: false; reason: string };

let opened: Promise<EmulatedCuda> | undefined;

/** The emulated CUDA backend (one per process), or why it cannot be had here. */
export function emulatedCuda(): Promise<EmulatedCuda> {
  opened ??= open();
  return opened;
}

async function open(): Promise<EmulatedCuda> {
  if (Bun.which("g++") === null || Bun.which("cc") === null)
    return { ok: false, reason: "g++ and cc are needed to build it" };
  if (findNvcc() === null && !existsSync(join(root, "ffi", "cuda", "build"))) {
    return { ok: false, reason: "the backend loads PTX at start and there is no nvcc to build it" };
  }
  const built = await build();
  const control = dlopen(built.fakeCuda, {
    fake_use_emulator: { args: ["ptr"], returns: "i32" },
    fake_timeline_reset: { args: [], returns: "void" },
    fake_launch_count: { args: [], returns: "i32" },
    fake_launch_at: { args: ["i32", "ptr"], returns: "void" },
    fake_stream_sync_count: { args: [], returns: "i32" },
    fake_stream_sync_at: { args: ["i32"], returns: "i32" },
  });
  const c = control.symbols;
  // FakeLaunch begins with the kernel's name, char[64]; the whole struct is 360 bytes
  const record = new Uint8Array(360);
  // the fake keeps the first 4096 launches and stops counting there: past that, positions lie
  const recordedLaunches = () => {
    const n = c.fake_launch_count();
    if (n >= 4096) throw new Error("the fake driver's launch record is full (4096): reset the timeline more often");
    return n;
  };
  const timeline: Timeline = {
    reset: () => c.fake_timeline_reset(),
    launches: () =>
      Array.from({ length: recordedLaunches() }, (_, i) => {
        c.fake_launch_at(i, ptr(record));
        return Buffer.from(record.subarray(0, record.indexOf(0))).toString();
      }),
    streamSyncs: () => {
      recordedLaunches();
      return Array.from({ length: Math.min(c.fake_stream_sync_count(), 256) }, (_, i) => c.fake_stream_sync_at(i));
    },
  };
  if (control.symbols.fake_use_emulator(ptr(Buffer.from(`${built.emulator}\0`))) !== 0) {
    return { ok: false, reason: `the fake driver could not load ${built.emulator}` };
  }
  const driver = new Driver(built.fakeCuda);
  const libraries = { driver, cublasPath: built.fakeCublas, cublasLtPath: built.fakeCublasLt };
  let backend: CudaBackend | undefined;
  const withCudnn = new Map<AttentionChoice, CudaBackend>();
  const cudnnBackend = (attention: AttentionChoice) => {
    let be = withCudnn.get(attention);
    if (be === undefined) {
      be = new CudaBackend({ ...libraries, attention, cudnnPath: built.fakeCudnn });
      withCudnn.set(attention, be);
    }
    return be;
  };
  return {
    ok: true,
    backend: () => (backend ??= new CudaBackend(libraries)),
    timeline,
    cudnnBackend,
    backendWith: (options) => new CudaBackend({ ...libraries, ...options }),
  };
}

/** The last operation graph fake-cudnn.c finalized, accepted or not: ops in the caller's order,
 *  tensors by uid, and the roles its pattern matcher gave them (names as in sdpa-graph.ts). */
export interface FakeCudnnGraph {
  status: number;
  error: string;
  direction: "forward" | "backward" | null;
  ops: Record<string, string | number>[];
  tensors: {
    uid: number;
    dtype: string;
    dims: number[];
    strides: number[];
    virtual: boolean;
    byValue: boolean;
    alignment: number;
  }[];
  roles: Record<string, number>;
}

/** The last execution: the handle's stream, the plan's engine and workspace, the variant pack's
 *  uids in its order, and the by-value scalars read (non-finite ones as strings Number() reads). */
export interface FakeCudnnExecution {
  direction: "forward" | "backward";
  stream: number;
  engine: number;
  workspaceBytes: number;
  uids: number[];
  scalars: Record<string, number | string>;
}

/** fake-cudnn.c (built with the rest) and its controls for tests. */
export interface FakeCudnn {
  path: string;
  executions(): number;
  lastGraph(): FakeCudnnGraph;
  lastExecution(): FakeCudnnExecution;
  /** how many engine configs the heuristics return, and how many of the first refuse to make a
   *  plan; (2, 0) unless set */
  setEngineConfigs(count: number, refusing: number): void;
}

/** The fake cuDNN library; the build needs g++ and cc, as for the rest. */
export async function fakeCudnn(): Promise<FakeCudnn> {
  const path = (await build()).fakeCudnn;
  const lib = dlopen(path, {
    fake_cudnn_executions: { args: [], returns: "i64" },
    fake_cudnn_set_engine_configs: { args: ["i64", "i64"], returns: "void" },
    fake_cudnn_last_graph_json: { args: ["ptr", "i64"], returns: "i64" },
    fake_cudnn_last_execution_json: { args: ["ptr", "i64"], returns: "i64" },
  });
  const s = lib.symbols;
  const json = (read: (out: Uint8Array | null, cap: number) => number | bigint) => {
    const out = new Uint8Array(Number(read(null, 0)) + 1);
    read(out, out.length);
    return JSON.parse(Buffer.from(out.subarray(0, out.length - 1)).toString());
  };
  return {
    path,
    executions: () => Number(s.fake_cudnn_executions()),
    lastGraph: () => json((o, n) => s.fake_cudnn_last_graph_json(o === null ? null : ptr(o), n)),
    lastExecution: () => json((o, n) => s.fake_cudnn_last_execution_json(o === null ? null : ptr(o), n)),
    setEngineConfigs: (count, refusing) => s.fake_cudnn_set_engine_configs(count, refusing),
  };
}

/** Every backend a parity suite should run on: the CPU, CUDA where a GPU is present, and
 *  otherwise the CUDA backend emulated on the host (when it can be built). Prints one line for
 *  what is skipped. */
export async function parityBackends(): Promise<{ name: string; backend: () => Backend }[]> {
  const emulated = cudaSkipReason === null ? null : await emulatedCuda();
  if (emulated?.ok === true) console.log("no GPU here: the CUDA backend runs emulated on the host");
  if (emulated?.ok === false)
    console.log(`${cudaSkipReason}; the emulated CUDA backend is skipped too: ${emulated.reason}`);
  return [
    ...testBackends(),
    ...(emulated?.ok === true ? [{ name: "cuda (emulated on the host)", backend: emulated.backend }] : []),
  ];
}

/** fake-cublaslt.c's controls: its matmul count, the last epilogue it ran, and refusal. */
export interface FakeCublasLt {
  matmuls(): number;
  lastEpilogue(): number;
  /** while on, the heuristic finds no algorithm (as a GPU without a kernel for a call) */
  refuse(on: boolean): void;
}

/** The fake cuBLASLt every emulated backend loads (built with the rest). */
export async function fakeCublasLt(): Promise<FakeCublasLt> {
  const lib = dlopen((await build()).fakeCublasLt, {
    fake_cublaslt_matmul_calls: { args: [], returns: "i64" },
    fake_cublaslt_last_epilogue: { args: [], returns: "i32" },
    fake_cublaslt_refuse: { args: ["i32"], returns: "void" },
  });
  const s = lib.symbols;
  return {
    matmuls: () => Number(s.fake_cublaslt_matmul_calls()),
    lastEpilogue: () => s.fake_cublaslt_last_epilogue(),
    refuse: (on) => s.fake_cublaslt_refuse(on ? 1 : 0),
  };
}
