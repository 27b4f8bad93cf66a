// Finds a native library (libnccl, libcublas, ...) on a machine we did not set up ourselves:
// an override variable, then the loader's and the CUDA toolkit's folders, then NVIDIA's pip
// wheels. The GPU machines we test on carry cuBLAS and NCCL only inside pip packages, so the
// wheel folders matter as much as the system ones.
//
// Nothing here runs python: the site-packages folders are found by listing the places pip,
// pyenv, conda and virtualenvs put them. Nothing is dlopen'ed either: the answer is a path.
import { existsSync, readdirSync, statSync } from "node:fs";
import { homedir } from "node:os";
import { join } from "node:path";
import { NativeLibraryError } from "./errors.ts";

export interface LibrarySpec {
  /** what the library is, for messages: "NCCL", "cuBLAS" */
  what: string;
  /** environment variable that may hold the library's file path; it wins over any search */
  envVar: string;
  /** file names to look for, preferred first: ["libnccl.so.2", "libnccl.so"] */
  names: readonly string[];
  /**
   * Folder(s) under `<site-packages>/nvidia/` whose `lib/` holds the wheel's library: "nccl"
   * for nvidia-nccl-cu12/cu13. CUDA 13 wheels moved most libraries into one shared folder
   * (nvidia/cu13/lib/libcublas.so.13) while NCCL kept nvidia/nccl/lib, so a list is accepted:
   * cuBLAS passes ["cu13", "cublas"].
   */
  pipSubdir?: string | readonly string[];
  /** the command that installs it, quoted in the error */
  installHint: string;
}

/** The environment the search reads; tests pass their own instead of editing process.env. */
export type SearchEnv = Readonly<Record<string, string | undefined>>;

const multiarch = process.arch === "arm64" ? "aarch64-linux-gnu" : "x86_64-linux-gnu";

/** Sub-folders of `parent` whose names match, sorted (newest python last is fine: any will do). */
function subdirs(parent: string, pattern: RegExp): string[] {
  let names: string[];
  try {
    names = readdirSync(parent);
  } catch {
    return []; // the parent does not exist here: nothing to look in
  }
  return names
    .filter((n) => pattern.test(n))
    .sort()
    .map((n) => join(parent, n));
}

const pythonDir = /^python3(\.\d+)?t?$/; // python3, python3.12, python3.13t (free-threaded)

/** Every python site-packages / dist-packages folder we can find without running python. */
export function pythonPackageDirs(env: SearchEnv = process.env): string[] {
  const home = env.HOME || homedir();
  // lib/ folders of python installations, the active environment first (it is what the user means)
  const prefixes: string[] = [];
  if (env.VIRTUAL_ENV) prefixes.push(join(env.VIRTUAL_ENV, "lib"));
  if (env.CONDA_PREFIX) prefixes.push(join(env.CONDA_PREFIX, "lib"));
  prefixes.push(join(home, ".local", "lib"));
  for (const root of new Set([env.PYENV_ROOT || join(home, ".pyenv"), "/root/.pyenv"])) {
    for (const version of subdirs(join(root, "versions"), /./)) prefixes.push(join(version, "lib"));
  }
  prefixes.push("/usr/local/lib", "/usr/lib", "/opt/conda/lib");
  const dirs: string[] = [];
  for (const prefix of prefixes) {
    for (const py of subdirs(prefix, pythonDir)) dirs.push(join(py, "site-packages"), join(py, "dist-packages"));
  }
  return [...new Set(dirs)].filter(isDir);
}

function isDir(p: string): boolean {
  try {
    return statSync(p).isDirectory();
  } catch {
    return false;
  }
}

/** The system folders, in the order searched. */
export function systemLibraryDirs(env: SearchEnv = process.env): string[] {
  // LD_LIBRARY_PATH first, as the dynamic loader itself does: a user who set it means it.
  const fromEnv = (env.LD_LIBRARY_PATH ?? "").split(":").filter((d) => d !== "");
  const cudaTargets = subdirs("/usr/local/cuda/targets", /./).map((t) => join(t, "lib"));
  return [
    ...new Set([
      ...fromEnv,
      `/usr/lib/${multiarch}`,
      "/usr/local/cuda/lib64",
      ...cudaTargets,
      "/usr/lib64",
      "/usr/lib",
    ]),
  ];
}

/** Every folder searched for `spec`, in order (the override variable aside). */
export function librarySearchDirs(spec: LibrarySpec, env: SearchEnv = process.env): string[] {
  const subs =
    spec.pipSubdir === undefined ? [] : typeof spec.pipSubdir === "string" ? [spec.pipSubdir] : spec.pipSubdir;
  const wheelDirs = pythonPackageDirs(env).flatMap((sp) => subs.map((s) => join(sp, "nvidia", s, "lib")));
  return [...systemLibraryDirs(env), ...wheelDirs];
}

function fromOverride(spec: LibrarySpec, env: SearchEnv): string | null {
  const override = env[spec.envVar];
  if (override === undefined || override === "") return null;
  // A set variable that points nowhere is a configuration error, not "not installed": say so
  // instead of silently searching elsewhere and loading a different copy.
  if (!existsSync(override)) {
    throw new NativeLibraryError(
      `${spec.envVar}=${override} does not exist; point it at the ${spec.what} library file or unset it`,
    );
  }
  return override;
}

/**
 * The path of the library, or null when it is in none of the places searched. A set override
 * variable that names a missing file still throws NativeLibraryError (it is a mistake to fix).
 */
export function tryFindLibrary(spec: LibrarySpec, env: SearchEnv = process.env): string | null {
  const override = fromOverride(spec, env);
  if (override !== null) return override;
  for (const dir of librarySearchDirs(spec, env)) {
    for (const name of spec.names) {
      const p = join(dir, name);
      if (existsSync(p)) return p;
    }
  }
  return null;
}

/** The path of the library; NativeLibraryError naming every place looked and how to install it. */
export function findLibrary(spec: LibrarySpec, env: SearchEnv = process.env): string {
  const found = tryFindLibrary(spec, env);
  if (found !== null) return found;
  const dirs = librarySearchDirs(spec, env);
  const wheelNote =
    spec.pipSubdir === undefined ? "" : " (pip wheels: <site-packages>/nvidia/<subdir>/lib under every python found)";
  throw new NativeLibraryError(
    `${spec.what} not found: ${spec.envVar} is not set, and none of ${spec.names.join(", ")} is in ` +
      `${dirs.join(", ")}${wheelNote}. Install it with: ${spec.installHint}, or set ${spec.envVar} to the library's path`,
  );
}
