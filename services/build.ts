// The services' compiled executable: services/bin.ts and everything it imports, compiled by
// `bun build --compile --bytecode` into one file, with its bytecode. A service process starts
// from it in a quarter of the CPU time it takes from the TypeScript sources (0.1 s against 0.4 s
// on these 2-core machines), which every process of a mesh pays at every start and restart.
//
// The executable is used only while it matches what it was built from: its stamp lists every
// file the build read (the sources and the npm packages' files) with its size and modification
// time, as make does, and servicesExecutable() answers null, so that launchers run the sources,
// as soon as one differs (a check of the 520 files takes a few milliseconds; their contents'
// digest took 200).
// The bootstrap builds it (`bun services/build.ts --quiet`).
import { existsSync, mkdirSync, readFileSync, renameSync, rmSync, statSync, writeFileSync } from "node:fs";
import { join, relative } from "node:path";
import { nativeBuildDir } from "../ffi/build-dir.ts";
import { compiled, packageRoot } from "../ffi/package-root.ts";

const buildDir = nativeBuildDir(join(packageRoot, "services"));
const executablePath = join(buildDir, "meshtrain-services");
const stampPath = join(buildDir, "meshtrain-services.json");
const entry = join(packageRoot, "services", "bin.ts");

export interface Stamp {
  bun: string;
  /** each file the build read, relative to the package's folder, with its size and mtime */
  inputs: [path: string, size: number, mtimeMs: number][];
}

/** What a file is now, as a stamp holds it (`path` relative to `root`); null when it is gone. */
export function fileNow(path: string, root = packageRoot): Stamp["inputs"][number] | null {
  try {
    const s = statSync(join(root, path));
    return [path, s.size, s.mtimeMs];
  } catch {
    return null;
  }
}

/** Whether every file a stamp lists (relative to `root`) is as it was, under this Bun. */
export function stampHolds(stamp: Stamp, root = packageRoot): boolean {
  if (stamp.bun !== Bun.version || !Array.isArray(stamp.inputs) || stamp.inputs.length === 0) return false;
  return stamp.inputs.every((f) => {
    const now = Array.isArray(f) && typeof f[0] === "string" ? fileNow(f[0], root) : null;
    return now !== null && now[1] === f[1] && now[2] === f[2];
  });
}

let fresh: string | null | undefined;

/** The services' executable when it is built and matches its sources, else null (run them from
 *  source). Checked once per process. */
export function servicesExecutable(): string | null {
  if (fresh !== undefined) return fresh;
  fresh = null;
  if (compiled || !existsSync(executablePath)) return fresh;
  try {
    if (stampHolds(JSON.parse(readFileSync(stampPath, "utf8")) as Stamp)) fresh = executablePath;
  } catch {
    // no stamp, or not one we wrote: run from source
  }
  return fresh;
}

/** Builds the executable unless it is up to date; returns its path and whether it was built. */
export async function buildServicesExecutable(): Promise<{ path: string; built: boolean }> {
  if (servicesExecutable() !== null) return { path: executablePath, built: false };
  mkdirSync(buildDir, { recursive: true });
  // built under another name and renamed: a launcher never starts a half-written file
  const tmp = `${executablePath}.${process.pid}.tmp`;
  const result = await Bun.build({
    entrypoints: [entry],
    compile: { outfile: tmp },
    bytecode: true,
    format: "esm",
    target: "bun",
    metafile: true,
  });
  if (!result.success) {
    rmSync(tmp, { force: true });
    throw new Error(`compiling ${entry} failed:\n${result.logs.map(String).join("\n")}`);
  }
  const inputs = Object.keys(result.metafile?.inputs ?? {}).map((f) =>
    fileNow(relative(packageRoot, join(process.cwd(), f))),
  );
  if (inputs.length === 0 || inputs.includes(null)) {
    rmSync(tmp, { force: true });
    throw new Error(`compiling ${entry}: the build did not say which files it read`);
  }
  renameSync(tmp, executablePath);
  const stamp: Stamp = { bun: Bun.version, inputs: inputs as Stamp["inputs"] };
  writeFileSync(stampPath, `${JSON.stringify(stamp)}\n`);
  fresh = executablePath;
  return { path: executablePath, built: true };
}

if (import.meta.main) {
  // --quiet (set-up): one line if it built the executable, nothing if it was up to date. A build
  // that fails is said on stderr and fails nothing: the services then run from their sources.
  const quiet = process.argv.includes("--quiet");
  try {
    const { path, built } = await buildServicesExecutable();
    if (built) console.log(`built the services' executable: ${path}`);
    else if (!quiet) console.log(`the services' executable is up to date: ${path}`);
  } catch (e) {
    console.error(`the services' executable was not built (${(e as Error).message}); they run from their sources`);
  }
}
