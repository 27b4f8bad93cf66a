// Option parsers for the CLI: each turns a string into a checked value or raises commander's
// InvalidArgumentError, which commander prints as "error: option '--x <n>' argument '...' is invalid. <reason>".
// And the paths the user types: resolved against their folder, shown back as they would type them.
import { dirname, isAbsolute, relative, resolve, sep } from "node:path";
import { InvalidArgumentError } from "commander";
import { ownerProblem } from "../services/runtime/job/job.ts";

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

export function float(min = -Infinity, max = Infinity, { exclusiveMin = false } = {}) {
  return (raw: string): number => {
    const v = Number(raw);
    const low = exclusiveMin ? v > min : v >= min;
    if (raw.trim() === "" || !Number.isFinite(v) || !low || v > max) {
      throw new InvalidArgumentError(
        `expected a number ${exclusiveMin ? ">" : ">="} ${min}${max < Infinity ? ` and <= ${max}` : ""}`,
      );
    }
    return v;
  };
}

export function int(min = 0, max = Number.MAX_SAFE_INTEGER) {
  return (raw: string): number => {
    const v = Number(raw);
    if (!/^-?\d+$/.test(raw.trim()) || !Number.isSafeInteger(v) || v < min || v > max) {
      throw new InvalidArgumentError(
        `expected an integer >= ${min}${max < Number.MAX_SAFE_INTEGER ? ` and <= ${max}` : ""}`,
      );
    }
    return v;
  };
}

/** "784,800,10" -> [784, 800, 10] */
export function intList(raw: string): number[] {
  const parts = raw.split(",").map((s) => s.trim());
  const values = parts.map(Number);
  if (parts.length < 2 || values.some((v, i) => !/^\d+$/.test(parts[i]!) || v <= 0)) {
    throw new InvalidArgumentError("expected at least two comma-separated positive integers, e.g. 784,800,10");
  }
  return values;
}

/** "alice,bob" -> ["alice", "bob"]: owners of jobs (services/runtime/job/job.ts), each once */
export function ownerList(raw: string): string[] {
  const owners = raw.split(",").map((s) => s.trim());
  for (const o of owners) {
    const problem = ownerProblem(o);
    if (problem !== null) throw new InvalidArgumentError(problem);
  }
  if (new Set(owners).size !== owners.length) throw new InvalidArgumentError("each owner once");
  return owners;
}

export function choice<T extends string>(...allowed: T[]) {
  return (raw: string): T => {
    if (!(allowed as string[]).includes(raw)) throw new InvalidArgumentError(`expected one of: ${allowed.join(", ")}`);
    return raw as T;
  };
}
