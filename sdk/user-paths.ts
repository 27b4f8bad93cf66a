// The paths the user types: resolved against their folder, shown back as they would type them;
// and how they run meshtrain, for the commands a run suggests next.
import { dirname, isAbsolute, join, relative, resolve, sep } from "node:path";

/**
 * The folder the user ran the command in. `npm run meshtrain -- ...` runs with the package root
 * as its working directory and passes the user's in INIT_CWD (npm_package_json names that
 * package). A process started elsewhere (a script that changes folder first) inherits INIT_CWD
 * but does not run in the package's folder: its own folder is the user's.
 */
const userDir = (): string => {
  const init = process.env.INIT_CWD,
    pkg = process.env.npm_package_json;
  return init && pkg && resolve(process.cwd()) === dirname(resolve(pkg)) ? init : process.cwd();
};

/** A path the user typed (or a default), absolute: relative paths resolve against userDir. */
export function userPath(p: string): string {
  return resolve(userDir(), p);
}

/** An absolute path as the user would type it: relative to userDir when inside it. */
export function shownPath(p: string): string {
  const rel = relative(userDir(), p);
  return rel !== "" && rel.split(sep)[0] !== ".." && !isAbsolute(rel) ? rel : p;
}

/** How the user runs meshtrain: `npm start --` when they came through npm start (the mesh's
 *  resume line), else `npx meshtrain` (works in the project without a global install). */
export function cliName(other = "npx meshtrain"): string {
  return process.env.npm_lifecycle_event === "start" ? "npm start --" : other;
}

/** One shell word: quoted when it holds anything beyond letters, digits and ./_-+,:=@% */
export function shellWord(s: string): string {
  return /^[\w./+,:=@%-]+$/.test(s) ? s : `'${s.replaceAll("'", "'\\''")}'`;
}

/** Where `run` and `mesh up` keep jobs' snapshots, models and logs unless --dir says otherwise. */
export const defaultRunDir = (): string => join("runs", "mesh");
