// The package's own folder, where its sources, native builds and npm packages are found.
//
// Run from source, it is the folder above this file's. In the services' compiled executable
// (services/build.ts) every module's import.meta.dir lies inside the executable (/$bunfs/…), so the
// launcher that starts it names the folder in MESHTRAIN_ROOT (sdk/local-mesh.ts does).
import { join } from "node:path";

/** Whether this code runs inside a compiled executable, not from its source files. */
export const compiled = import.meta.dir.startsWith("/$bunfs/") || import.meta.dir.startsWith("B:\\~BUN\\");

function rootOf(): string {
  if (!compiled) return join(import.meta.dir, "..");
  const root = process.env.MESHTRAIN_ROOT;
  if (root === undefined || root === "") {
    // no ConfigError here: this module sits below the error classes' own imports
    throw new Error(
      "this compiled meshtrain executable needs MESHTRAIN_ROOT, the meshtrain folder it was built from (its launcher sets it)",
    );
  }
  return root;
}

export const packageRoot = rootOf();
