// Option parsers for the CLI: each turns a string into a checked value or raises commander's
// InvalidArgumentError, which commander prints as "error: option '--x <n>' argument '...' is invalid. <reason>".
// The job options' own readers are the option table's; these are the same readers for other commands.
import { InvalidArgumentError } from "commander";
import { intIn, numberIn, OptionValueError } from "../../services/runtime/job/options.ts";
import { ownerProblem } from "../../services/runtime/job/subjects.ts";
import { ConfigError } from "../../ffi/errors.ts";

/** A reader of the option table's (services/runtime/job/options.ts) as a commander parser. */
export const asArgument =
  <T>(read: (raw: string) => T) =>
  (raw: string): T => {
    try {
      return read(raw);
    } catch (e) {
      if (e instanceof OptionValueError) throw new InvalidArgumentError(e.message);
      throw e;
    }
  };

export const float = (min = Number.NEGATIVE_INFINITY, max = Number.POSITIVE_INFINITY, { exclusiveMin = false } = {}) =>
  asArgument(numberIn(min, max, { exclusiveMin }).read);

export const int = (min = 0, max = Number.MAX_SAFE_INTEGER) => asArgument(intIn(min, max).read);

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

/** The benchmarks of `meshtrain bench`: bench/index.ts runs them (they come with the repository, not the package). */
export const benchNames = [
  "engine",
  "kernels",
  "epilogues",
  "ps",
  "checkpoint",
  "data-loader",
  "prepare",
  "trainer",
  "allreduce",
  "stream",
  "client",
  "hosts",
] as const;
export type BenchName = (typeof benchNames)[number];

export function choice<T extends string>(...allowed: T[]) {
  return (raw: string): T => {
    if (!(allowed as string[]).includes(raw)) throw new InvalidArgumentError(`expected one of: ${allowed.join(", ")}`);
    return raw as T;
  };
}

/** "80GB", "24 GiB", "512MiB", "1e9": bytes (GB and GiB both 2^30: a device's memory is quoted so). */
export function parseMemorySize(raw: string): number {
  const m = /^\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*(b|k|kb|kib|m|mb|mib|g|gb|gib|t|tb|tib)?\s*$/i.exec(raw);
  if (m === null)
    throw new ConfigError(`--device-memory must be a size such as 80GB, 24GiB or 512MiB, got ${JSON.stringify(raw)}`);
  const unit = (m[2] ?? "b").toLowerCase()[0]!;
  const scale = { b: 1, k: 2 ** 10, m: 2 ** 20, g: 2 ** 30, t: 2 ** 40 }[unit as "b" | "k" | "m" | "g" | "t"];
  const bytes = Math.round(Number(m[1]) * scale);
  if (!(bytes > 0) || !Number.isSafeInteger(bytes))
    throw new ConfigError(`--device-memory must be a positive size, got ${JSON.stringify(raw)}`);
  return bytes;
}
