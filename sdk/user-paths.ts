// The paths the user types: resolved against their folder, shown back as they would type them;
// and how they run meshtrain, for the commands a run suggests next.
import { closeSync, openSync, type Stats, statSync, unlinkSync } from "node:fs";
import { dirname, isAbsolute, join, relative, resolve, sep } from "node:path";
import { ConfigError } from "../ffi/errors.ts";
import { pathProblem } from "../engine/data/files.ts";

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

/** How the user runs a meshtrain command: `npx meshtrain` (works in the project without a global install). */
export function cliName(): string {
  return "npx meshtrain";
}

/**
 * How the user runs `meshtrain run` again (a stopped run's resume line): `npm start --` when they
 * came through npm start, whose script is `run` already (`npm start -- run` ran `run run`), else
 * `npx meshtrain run`.
 */
export function runCommandName(): string {
  return process.env.npm_lifecycle_event === "start" ? "npm start --" : `${cliName()} run`;
}

/** One shell word: quoted when it holds anything beyond letters, digits and ./_-+,:=@% */
export function shellWord(s: string): string {
  return /^[\w./+,:=@%-]+$/.test(s) ? s : `'${s.replaceAll("'", "'\\''")}'`;
}

/** Where `run` and `mesh up` keep jobs' snapshots, models and logs unless --dir says otherwise. */
export const defaultRunDir = (): string => join("runs", "mesh");

/** Why a path cannot be written, in the user's words (a system call's error code). */
function whyNot(e: unknown): string {
  const code = (e as NodeJS.ErrnoException).code;
  if (code === "ENOENT") return "a folder on its path cannot be made there";
  return pathProblem(e) ?? code ?? (e as Error).message;
}

/** What is at a path to be written (undefined: nothing), or why the path cannot be. */
function statOf(path: string, option: string): Stats | undefined {
  try {
    return statSync(path, { throwIfNoEntry: false });
  } catch (e) {
    throw new ConfigError(`${option} ${shownPath(path)} cannot be written: ${whyNot(e)}`, { cause: e });
  }
}

/**
 * The nearest folder on a path to be written that exists, checked writable by writing (and
 * removing) a file there: what the command will make under it, it can. Nothing is left behind,
 * and no folder is made (a command refused for another reason leaves none).
 */
function checkWritableFrom(path: string, option: string, asked = path): void {
  let at = path;
  let st = statOf(at, option);
  while (st === undefined && dirname(at) !== at) {
    at = dirname(at);
    st = statOf(at, option);
  }
  if (st !== undefined && !st.isDirectory())
    throw new ConfigError(
      `${option} ${shownPath(asked)} cannot be written: a part of its path is a file, not a folder`,
    );
  const probe = join(at, `.meshtrain-write-test-${process.pid}`);
  try {
    closeSync(openSync(probe, "wx"));
    unlinkSync(probe);
  } catch (e) {
    throw new ConfigError(`${option} ${shownPath(asked)} cannot be written: ${whyNot(e)}`, { cause: e });
  }
}

/**
 * A file a command will write at its end (`train --out`), checked before any work: not a folder,
 * and its folder can be made and written. A model trained for minutes is not lost to a path that
 * could never take it.
 */
export function checkOutFile(path: string, option: string): void {
  const shown = shownPath(path);
  const st = statOf(path, option);
  if (st?.isDirectory())
    throw new ConfigError(`${option} ${shown} is a folder: name the file to write (e.g. ${join(shown, "model.mtm")})`);
  if (st !== undefined && !st.isFile()) throw new ConfigError(`${option} ${shown} is not a regular file`);
  checkWritableFrom(dirname(path), option, path);
}

/** A folder a command will write into (`prepare --out`, `--dir`), checked before any work: a
 *  folder or nothing yet, where it can be made and written. */
export function checkOutDir(path: string, option: string): void {
  const st = statOf(path, option);
  if (st !== undefined && !st.isDirectory())
    throw new ConfigError(`${option} ${shownPath(path)} is a file, not a folder`);
  checkWritableFrom(path, option);
}
