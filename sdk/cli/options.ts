// Option parsers for the CLI: each turns a string into a checked value or raises commander's
// InvalidArgumentError, which commander prints as "error: option '--x <n>' argument '...' is invalid. <reason>".
// The job options' own readers are the option table's; these are the same readers for other commands.
import { InvalidArgumentError } from "commander";
import { intIn, numberIn, OptionValueError } from "../../services/runtime/job/options.ts";
import { ownerProblem } from "../../services/runtime/job/subjects.ts";

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

export function choice<T extends string>(...allowed: T[]) {
  return (raw: string): T => {
    if (!(allowed as string[]).includes(raw)) throw new InvalidArgumentError(`expected one of: ${allowed.join(", ")}`);
    return raw as T;
  };
}
