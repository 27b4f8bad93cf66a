// Where the native builds go (the C kernel library, the CUDA kernels' PTX, the NCCL shim): in a
// `build` folder beside their sources where that is writable (a checkout, a project's own
// node_modules); else, for a package installed where its user cannot write (a global install,
// a read-only image), in the user's cache: $XDG_CACHE_HOME/meshtrain (~/.cache/meshtrain), one
// folder per meshtrain version. MESHTRAIN_CACHE_DIR names another folder for every build.
import { accessSync, constants, existsSync, readFileSync } from "node:fs";
import { homedir } from "node:os";
import { join, relative } from "node:path";
import { packageRoot } from "./package-root.ts";

const writable = (path: string): boolean => {
  try {
    accessSync(path, constants.W_OK);
    return true;
  } catch {
    return false;
  }
};

/** meshtrain's version, from its package.json (a cache folder per version). */
const version = (): string => {
  const pkg = JSON.parse(readFileSync(join(packageRoot, "package.json"), "utf8")) as { version?: unknown };
  return typeof pkg.version === "string" ? pkg.version : "unversioned";
};

/** The folder the builds of the sources in `sourceDir` go to (see the file's header). */
export function nativeBuildDir(sourceDir: string): string {
  const inTree = join(sourceDir, "build");
  const where = relative(packageRoot, sourceDir);
  const override = process.env.MESHTRAIN_CACHE_DIR;
  if (override !== undefined && override !== "") return join(override, where);
  if (existsSync(inTree) ? writable(inTree) : writable(sourceDir)) return inTree;
  const cache = process.env.XDG_CACHE_HOME || join(homedir(), ".cache");
  return join(cache, "meshtrain", version(), where);
}
